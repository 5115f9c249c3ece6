// Host side of the standalone collectives: validate -> pick config -> launch.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cstdio>
#include <string>

#include "collectives/kernels.cuh"
#include "mkernel/collectives.h"
#include "mkernel/error.h"
#include "runtime/cuda_check.h"
#include "runtime/device_guard.h"
#include "runtime/kernel_preload.h"
#include "runtime/overrides.h"
#include "runtime/validate.h"

namespace mk {
namespace {

using detail::require_device_pointer;
using detail::require_symmetric;

// Channels (CTAs per rank): enough to keep NVLink busy, few enough to leave SMs to others, and
// within the communicator's SM budget so ranks sharing a GPU stay co-resident. Must be the same on
// every rank: it depends only on the byte count (equal on all ranks) and the topology.
int pick_channels(const Communicator& comm, const CollectiveConfig& config, std::size_t bytes,
                  const char* op) {
  int channels = config.channels > 0 ? config.channels : comm.overrides().channels;
  if (channels <= 0) {
    // ~64 KiB per channel, at most 128: 128 channels were the fastest at every size from 8 to
    // 512 MiB for all three ops on the H200 NV18 host (docs/PERFORMANCE.md, 2026-11-30).
    channels = static_cast<int>(std::clamp<std::size_t>(bytes >> 16, 1, 128));
  }
  const int budget = std::max(1, std::min(comm.topology().sm_budget(), kMaxChannels));
  channels = std::min(channels, budget);
  if (config.threads % 32 != 0 || config.threads < 64 || config.threads > 512) {
    throw Error(ErrorCode::kInvalidArgument, std::string(op) +
                                                 ": threads = " + std::to_string(config.threads) +
                                                 "; expected a multiple of 32 in [64, 512]");
  }
  if (comm.overrides().print_config && comm.rank() == 0) {
    std::fprintf(stderr, "[mkernel] %s: %zu bytes, %d channels x %d threads\n", op, bytes, channels,
                 config.threads);
  }
  return channels;
}

// Whether reduce_scatter takes the bulk path (reduce_scatter_bulk_kernel): when the config allows
// it (CollectiveConfig::bulk), wherever it can - 16-byte aligned slices (vector width 16) and a
// ring that holds a chunk of every local rank; else the loads of reduce_scatter_kernel.
bool use_rs_bulk(const Communicator& comm, const CollectiveConfig& config, int vector_bytes) {
  return config.bulk && vector_bytes == 16 &&
         coll::bulk_chunk_bytes(comm.topology().local_size) > 0;
}

// Largest power-of-two vector width (<= 16 bytes) dividing every address and size in `values`.
int vector_bytes(std::initializer_list<uintptr_t> values) {
  uintptr_t bits = 16;
  for (uintptr_t v : values) bits |= v;
  return static_cast<int>(bits & (~bits + 1));  // lowest set bit
}

void launch_check(const char* op) {
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) {
    throw Error(ErrorCode::kCuda, std::string(op) + ": launch failed: " + cudaGetErrorString(err));
  }
}

template <typename T, typename Fn>
void dispatch_vector(int bytes, Fn&& fn) {
  switch (bytes) {
    case 16:
      return fn.template operator()<T, 16>();
    case 8:
      return fn.template operator()<T, 8>();
    case 4:
      if constexpr (sizeof(T) <= 4) return fn.template operator()<T, 4>();
      break;
    default:
      break;
  }
  if constexpr (sizeof(T) == 2) return fn.template operator()<T, 2>();
}

template <typename Fn>
void dispatch_dtype(DType dtype, Fn&& fn) {
  switch (dtype) {
    case DType::kBF16:
      return fn.template operator()<__nv_bfloat16>();
    case DType::kF16:
      return fn.template operator()<__half>();
    case DType::kF32:
      return fn.template operator()<float>();
  }
}

void common_checks(Communicator& comm, DType dtype, cudaStream_t stream, const char* op) {
  detail::require_usable(comm, op);
  detail::require_single_node(comm, op);
  detail::require_dtype(dtype, op);
  detail::require_stream(comm, stream, op);
}

}  // namespace

namespace detail {

namespace {

// Every collective kernel, loaded into the current context (runtime/kernel_preload.h).
void preload_collective_kernels(bool) {
  auto load = [](const void* fn) {
    cudaFuncAttributes attr{};
    MK_CUDA_CHECK(cudaFuncGetAttributes(&attr, fn));
  };
  load(reinterpret_cast<const void*>(&coll::all_gather_kernel<1>));
  load(reinterpret_cast<const void*>(&coll::all_gather_kernel<2>));
  load(reinterpret_cast<const void*>(&coll::all_gather_kernel<4>));
  load(reinterpret_cast<const void*>(&coll::all_gather_kernel<8>));
  load(reinterpret_cast<const void*>(&coll::all_gather_kernel<16>));
  for (DType dtype : {DType::kBF16, DType::kF16, DType::kF32}) {
    dispatch_dtype(dtype, [&]<typename T>() {
      for (int bytes : {2, 4, 8, 16}) {
        if (bytes < static_cast<int>(sizeof(T))) continue;
        dispatch_vector<T>(bytes, [&]<typename U, int kBytes>() {
          load(reinterpret_cast<const void*>(&coll::reduce_scatter_kernel<U, kBytes>));
          load(reinterpret_cast<const void*>(&coll::all_reduce_kernel<U, kBytes>));
        });
      }
      // Allowing the ring's shared memory loads the kernel as well.
      MK_CUDA_CHECK(cudaFuncSetAttribute(coll::reduce_scatter_bulk_kernel<T>,
                                         cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         coll::kBulkBarrierBytes + coll::kBulkRingBytes));
    });
  }
}

const bool kPreloadRegistered = register_kernel_preload(&preload_collective_kernels);

}  // namespace
}  // namespace detail

void all_gather(Communicator& comm, const void* input, void* output, std::size_t count, DType dtype,
                cudaStream_t stream, const CollectiveConfig& config) {
  constexpr const char* op = "all_gather";
  detail::DeviceGuard guard(comm.device());
  common_checks(comm, dtype, stream, op);
  const std::size_t elem = dtype_size(dtype);
  const std::size_t chunk = detail::checked_mul(count, elem, op, "count * element size");
  const std::size_t total = detail::checked_mul(chunk, comm.world_size(), op, "output size");
  if (count == 0) return;
  require_device_pointer(comm, input, elem, op, "input");
  require_device_pointer(comm, output, elem, op, "output");
  const SymmetricRange out = require_symmetric(comm, output, total, op, "output");
  const void* my_slot = static_cast<const char*>(output) + chunk * comm.rank();
  if (input != my_slot && detail::overlaps(input, chunk, output, total)) {
    throw Error(ErrorCode::kInvalidArgument,
                std::string(op) + ": input overlaps output but is not this rank's slot " +
                    "(output + rank * count); use separate buffers or exactly that slot");
  }
  const int channels = pick_channels(comm, config, chunk, op);
  const std::size_t out_offset = out.offset + chunk * comm.rank();
  const int vb = vector_bytes({reinterpret_cast<uintptr_t>(input), out_offset, chunk});
  const DeviceComm dc = comm.device_comm();
  auto launch = [&]<int kBytes>() {
    coll::all_gather_kernel<kBytes>
        <<<channels, config.threads, 0, stream>>>(dc, static_cast<const coll::Vec<kBytes>*>(input),
                                                  chunk / kBytes, out.device_peers, out_offset);
  };
  switch (vb) {
    case 16:
      launch.template operator()<16>();
      break;
    case 8:
      launch.template operator()<8>();
      break;
    case 4:
      launch.template operator()<4>();
      break;
    case 2:
      launch.template operator()<2>();
      break;
    default:
      launch.template operator()<1>();
      break;
  }
  launch_check(op);
}

void reduce_scatter(Communicator& comm, const void* input, void* output, std::size_t count,
                    DType dtype, cudaStream_t stream, const CollectiveConfig& config) {
  constexpr const char* op = "reduce_scatter";
  detail::DeviceGuard guard(comm.device());
  common_checks(comm, dtype, stream, op);
  const std::size_t elem = dtype_size(dtype);
  const std::size_t chunk = detail::checked_mul(count, elem, op, "count * element size");
  const std::size_t total = detail::checked_mul(chunk, comm.world_size(), op, "input size");
  if (count == 0) return;
  require_device_pointer(comm, input, elem, op, "input");
  require_device_pointer(comm, output, elem, op, "output");
  const SymmetricRange in = require_symmetric(comm, input, total, op, "input");
  if (detail::overlaps(input, total, output, chunk)) {
    throw Error(ErrorCode::kInvalidArgument,
                std::string(op) +
                    ": output overlaps input; peers read the whole input, so the "
                    "output must be a separate buffer");
  }
  const int channels = pick_channels(comm, config, chunk, op);
  const std::size_t begin_bytes = chunk * comm.rank();
  const int vb = vector_bytes({in.offset, begin_bytes, reinterpret_cast<uintptr_t>(output)});
  const DeviceComm dc = comm.device_comm();
  if (use_rs_bulk(comm, config, vb)) {
    // config.threads is the loads' block size; the ring's sums are sized for kBulkThreads.
    const int local_size = comm.topology().local_size;
    if (comm.overrides().print_config && comm.rank() == 0) {
      std::fprintf(stderr, "[mkernel] %s: bulk path, %d threads, %d stages x %d ranks x %u bytes\n",
                   op, coll::kBulkThreads, coll::kBulkStages, local_size,
                   coll::bulk_chunk_bytes(local_size));
    }
    dispatch_dtype(dtype, [&]<typename T>() {
      coll::reduce_scatter_bulk_kernel<T>
          <<<channels, coll::kBulkThreads, coll::bulk_smem_bytes(local_size), stream>>>(
              dc, in.device_peers, in.offset, count, static_cast<T*>(output));
    });
  } else {
    dispatch_dtype(dtype, [&]<typename T>() {
      dispatch_vector<T>(std::max<int>(vb, sizeof(T)), [&]<typename U, int kBytes>() {
        coll::reduce_scatter_kernel<U, kBytes><<<channels, config.threads, 0, stream>>>(
            dc, in.device_peers, in.offset, count, static_cast<U*>(output));
      });
    });
  }
  launch_check(op);
}

void all_reduce(Communicator& comm, const void* input, void* output, std::size_t count, DType dtype,
                cudaStream_t stream, const CollectiveConfig& config) {
  constexpr const char* op = "all_reduce";
  detail::DeviceGuard guard(comm.device());
  common_checks(comm, dtype, stream, op);
  const std::size_t elem = dtype_size(dtype);
  const std::size_t bytes = detail::checked_mul(count, elem, op, "count * element size");
  if (count == 0) return;
  require_device_pointer(comm, input, elem, op, "input");
  require_device_pointer(comm, output, elem, op, "output");
  const SymmetricRange in = require_symmetric(comm, input, bytes, op, "input");
  const SymmetricRange out = require_symmetric(comm, output, bytes, op, "output");
  if (input != output && detail::overlaps(input, bytes, output, bytes)) {
    throw Error(ErrorCode::kInvalidArgument,
                std::string(op) +
                    ": input and output overlap partially; pass the same pointer "
                    "for in place or disjoint buffers");
  }
  // Rank r owns elements [r * per_rank, (r + 1) * per_rank), per_rank a multiple of 8 elements
  // so that every owned range starts on a 16-byte boundary.
  const std::size_t world = comm.world_size();
  const std::size_t per_rank = ((count + world - 1) / world + 7) / 8 * 8;
  const std::size_t begin = std::min(count, per_rank * comm.rank());
  const std::size_t end = std::min(count, begin + per_rank);
  const int channels = pick_channels(comm, config, bytes / world, op);
  const int vb = vector_bytes({in.offset, out.offset});
  const DeviceComm dc = comm.device_comm();
  dispatch_dtype(dtype, [&]<typename T>() {
    dispatch_vector<T>(std::max<int>(vb, sizeof(T)), [&]<typename U, int kBytes>() {
      coll::all_reduce_kernel<U, kBytes><<<channels, config.threads, 0, stream>>>(
          dc, in.device_peers, in.offset, begin, end, out.device_peers, out.offset);
    });
  });
  launch_check(op);
}

}  // namespace mk
