// Device side of the standalone collectives. One CTA = one channel; channel c of every rank meets
// channel c of its peers at an entry barrier (peers' buffers are ready to be read / written) and an
// exit barrier (everything this channel wrote into peers, or read from them, is done).
//
//   all_gather (push):      rank r: for each vector i of its input -> output[r*count + i] on
//                           every rank
//   reduce_scatter (pull):  rank r: sum over ranks p of input_p[r*count + i] -> its output[i];
//                           loads by the threads, or bulk copies into a shared-memory ring
//   all_reduce:             rank r owns chunk r: pull-reduce it from every rank, push the sum to
//                           every rank's output (so all ranks hold bitwise identical results)
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "mkernel/device/launch.cuh"
#include "mkernel/device/tma.cuh"

namespace mk::coll {

constexpr int kUnroll = 4;  // independent vectors in flight per thread (all_gather)
// Loads in flight per thread and peer for reductions, which pull over NVLink (reads need more in
// flight than pushes). 6 x 16 B fits the register budget of 512 threads without spills.
template <int kBytes>
constexpr int kReduceUnroll = kBytes >= 8 ? 6 : 4;

// A vector of kBytes bytes: the unit of every load and store.
template <int kBytes>
struct alignas(kBytes) Vec {
  unsigned char b[kBytes];
};

template <typename T>
__device__ __forceinline__ float to_float(T v);
template <>
__device__ __forceinline__ float to_float(__nv_bfloat16 v) {
  return __bfloat162float(v);
}
template <>
__device__ __forceinline__ float to_float(__half v) {
  return __half2float(v);
}
template <>
__device__ __forceinline__ float to_float(float v) {
  return v;
}

template <typename T>
__device__ __forceinline__ T from_float(float v);
template <>
__device__ __forceinline__ __nv_bfloat16 from_float(float v) {
  return __float2bfloat16_rn(v);
}
template <>
__device__ __forceinline__ __half from_float(float v) {
  return __float2half_rn(v);
}
template <>
__device__ __forceinline__ float from_float(float v) {
  return v;
}

template <typename P>
__device__ __forceinline__ P* at(void* base, std::size_t byte_offset) {
  return reinterpret_cast<P*>(static_cast<char*>(base) + byte_offset);
}

// ---- all_gather ---------------------------------------------------------------------------------

// in: n vectors of this rank's chunk; out_peers[p] + out_offset: where the chunk goes on rank p.
template <int kBytes>
__global__ void __launch_bounds__(512)
    all_gather_kernel(DeviceComm comm, const Vec<kBytes>* in, std::size_t n, void* const* out_peers,
                      std::size_t out_offset) {
  using V = Vec<kBytes>;
  const dev::Launch launch = dev::Launch::begin(comm);
  const int channel = blockIdx.x;
  if (launch.channel_barrier(SignalId::kEntry, channel, 0)) {
    const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x * kUnroll;
    for (std::size_t base =
             static_cast<std::size_t>(blockIdx.x) * blockDim.x * kUnroll + threadIdx.x;
         base < n; base += stride) {
      V v[kUnroll];
#pragma unroll
      for (int j = 0; j < kUnroll; ++j) {
        const std::size_t i = base + static_cast<std::size_t>(j) * blockDim.x;
        if (i < n) v[j] = in[i];
      }
      // Start with the next rank so that not every rank hits the same peer at once.
      for (int k = 0; k < comm.local_size; ++k) {
        int p = comm.local_rank + 1 + k;
        if (p >= comm.local_size) p -= comm.local_size;
        V* dst = at<V>(out_peers[p], out_offset);
#pragma unroll
        for (int j = 0; j < kUnroll; ++j) {
          const std::size_t i = base + static_cast<std::size_t>(j) * blockDim.x;
          if (i < n) dst[i] = v[j];
        }
      }
    }
    launch.channel_barrier(SignalId::kExit, channel, 0);
  }
  launch.end();
}

// ---- reductions
// ----------------------------------------------------------------------------------

// Scalar tail of a reduction: elements [tail, end), by channel 0; arguments as reduce_range.
template <typename T>
__device__ __forceinline__ void reduce_tail(const DeviceComm& comm, void* const* in_peers,
                                            std::size_t in_offset, std::size_t begin,
                                            std::size_t tail, std::size_t end, T* out_local,
                                            void* const* out_peers, std::size_t out_offset) {
  if (blockIdx.x != 0) return;
  for (std::size_t e = tail + threadIdx.x; e < end; e += blockDim.x) {
    float acc = 0.f;
    for (int p = 0; p < comm.local_size; ++p) {
      acc += to_float(at<const T>(in_peers[p], in_offset)[e]);
    }
    const T y = from_float<T>(acc);
    if (out_peers == nullptr) {
      out_local[e - begin] = y;
    } else {
      for (int p = 0; p < comm.local_size; ++p) at<T>(out_peers[p], out_offset)[e] = y;
    }
  }
}

// Sums elements [begin, end) of every local rank's input (in_peers[p] + in_offset, in elements of
// T) in rank order, writing the result either to `out_local` (+ element index - begin) or, when
// out_peers is set, to every rank's out_peers[p] + out_offset at the same element index.
// begin is a multiple of the vector width; pointers are kBytes-aligned.
template <typename T, int kBytes>
__device__ __forceinline__ void reduce_range(const DeviceComm& comm, void* const* in_peers,
                                             std::size_t in_offset, std::size_t begin,
                                             std::size_t end, T* out_local, void* const* out_peers,
                                             std::size_t out_offset) {
  using V = Vec<kBytes>;
  constexpr int kElems = kBytes / sizeof(T);
  const std::size_t n_vec = (end - begin) / kElems;
  const std::size_t stride =
      static_cast<std::size_t>(gridDim.x) * blockDim.x * kReduceUnroll<kBytes>;
  for (std::size_t base =
           static_cast<std::size_t>(blockIdx.x) * blockDim.x * kReduceUnroll<kBytes> + threadIdx.x;
       base < n_vec; base += stride) {
    float acc[kReduceUnroll<kBytes>][kElems];
#pragma unroll
    for (int j = 0; j < kReduceUnroll<kBytes>; ++j) {
#pragma unroll
      for (int e = 0; e < kElems; ++e) acc[j][e] = 0.f;
    }
    for (int p = 0; p < comm.local_size; ++p) {
      const V* src = at<const V>(in_peers[p], in_offset + begin * sizeof(T));
      V v[kReduceUnroll<kBytes>];
#pragma unroll
      for (int j = 0; j < kReduceUnroll<kBytes>; ++j) {
        const std::size_t i = base + static_cast<std::size_t>(j) * blockDim.x;
        if (i < n_vec) v[j] = src[i];
      }
#pragma unroll
      for (int j = 0; j < kReduceUnroll<kBytes>; ++j) {
        const T* x = reinterpret_cast<const T*>(&v[j]);
#pragma unroll
        for (int e = 0; e < kElems; ++e) acc[j][e] += to_float(x[e]);
      }
    }
#pragma unroll
    for (int j = 0; j < kReduceUnroll<kBytes>; ++j) {
      const std::size_t i = base + static_cast<std::size_t>(j) * blockDim.x;
      if (i >= n_vec) continue;
      V out;
      T* y = reinterpret_cast<T*>(&out);
#pragma unroll
      for (int e = 0; e < kElems; ++e) y[e] = from_float<T>(acc[j][e]);
      if (out_peers == nullptr) {
        reinterpret_cast<V*>(out_local)[i] = out;
      } else {
        for (int k = 0; k < comm.local_size; ++k) {
          int p = comm.local_rank + 1 + k;
          if (p >= comm.local_size) p -= comm.local_size;
          at<V>(out_peers[p], out_offset + begin * sizeof(T))[i] = out;
        }
      }
    }
  }
  reduce_tail<T>(comm, in_peers, in_offset, begin, begin + n_vec * kElems, end, out_local,
                 out_peers, out_offset);
}

// reduce_scatter: this rank's elements are [rank * count, rank * count + count) of every input.
template <typename T, int kBytes>
__global__ void __launch_bounds__(512)
    reduce_scatter_kernel(DeviceComm comm, void* const* in_peers, std::size_t in_offset,
                          std::size_t count, T* out) {
  const dev::Launch launch = dev::Launch::begin(comm);
  const int channel = blockIdx.x;
  if (launch.channel_barrier(SignalId::kEntry, channel, 0)) {
    const std::size_t begin = static_cast<std::size_t>(comm.rank) * count;
    reduce_range<T, kBytes>(comm, in_peers, in_offset, begin, begin + count, out, nullptr, 0);
    // Peers may overwrite their inputs only after we are done reading them.
    launch.channel_barrier(SignalId::kExit, channel, 0);
  }
  launch.end();
}

// ---- reduce_scatter through the copy engine (bulk path) -----------------------------------------
//
// The same sums, but the copy engine pulls the slices (1-D bulk copies, TMA) into a ring of
// kBulkStages shared-memory stages per CTA: one thread keeps whole chunks of every rank in flight
// instead of every thread a few 16-byte loads. Stage s holds one chunk of every local rank's slice:
//
//   ring: (kBulkStages, local_size, chunk) bytes, full[kBulkStages] mbarriers
//   thread 0:    arm full[s] with the stage's bytes, one bulk copy per rank      chunk k -> stage
//   all threads: wait full[s] (parity: use of the stage & 1), sum ranks 0, 1, ...  k % kBulkStages
//                in fp32, store 16-byte vectors to out
//   __syncthreads: nobody reads stage s any more -> thread 0 refills it with chunk k + kBulkStages
//
// Persistent: CTA b takes chunks b, b + gridDim.x, ... of the slice's 16-byte multiple prefix (the
// last one may be short); reduce_tail sums the < 16 bytes after it.
constexpr int kBulkStages = 4;
constexpr int kBulkThreads = 256;  // 16 bytes each: a 24 KiB chunk is 6 vectors per thread
// 192 of the 227 KiB a CTA may have, so one CTA per SM: so has the existing kernel (512 threads x
// up to 124 registers), and pick_channels keeps channels x ranks per GPU within the SMs. At 2 ranks
// a CTA has 4 x 24 KiB of its peer's slice in flight, 12 MiB over 128 channels, against ~6 MiB of
// 16-byte loads (512 threads x 6) in the existing path.
constexpr uint32_t kBulkRingBytes = 192 << 10;
constexpr uint32_t kBulkBarrierBytes = 128;  // full[], padded: the ring starts 128-byte aligned

// Bytes of one rank's chunk in a stage: the most the ring holds at `local_size` ranks, in whole
// KiB (24 KiB at 2 ranks, 12 at 4, 6 at 8); 0 if that is less than a KiB.
__host__ __device__ constexpr uint32_t bulk_chunk_bytes(int local_size) {
  return kBulkRingBytes / kBulkStages / local_size / 1024 * 1024;
}

// Dynamic shared memory of reduce_scatter_bulk_kernel; at most kBulkBarrierBytes + kBulkRingBytes.
constexpr uint32_t bulk_smem_bytes(int local_size) {
  return kBulkBarrierBytes + kBulkStages * local_size * bulk_chunk_bytes(local_size);
}

// One CTA's ring in its dynamic shared memory.
struct BulkRing {
  uint64_t* full;       // [kBulkStages]: the stage's copies have landed
  unsigned char* data;  // (kBulkStages, ranks, chunk)
  uint32_t chunk;       // bytes per rank and stage
  int ranks;

  // Thread 0 initialises the barriers; the entry channel barrier's __syncthreads publishes them.
  __device__ static BulkRing init(unsigned char* smem, int local_size) {
    const BulkRing ring{reinterpret_cast<uint64_t*>(smem), smem + kBulkBarrierBytes,
                        bulk_chunk_bytes(local_size), local_size};
    if (threadIdx.x == 0) {
      for (int s = 0; s < kBulkStages; ++s) dev::mbarrier_init(&ring.full[s], 1);
      dev::mbarrier_init_fence();
    }
    return ring;
  }

  __device__ __forceinline__ unsigned char* slot(int stage, int rank) const {
    return data + (static_cast<uint32_t>(stage) * ranks + rank) * chunk;
  }

  // Thread 0: `bytes` at byte `offset` of every rank's slice (in_peers[p] + slice) -> `stage`.
  __device__ __forceinline__ void load(int stage, void* const* in_peers, std::size_t slice,
                                       std::size_t offset, uint32_t bytes) const {
    dev::mbarrier_arrive_expect_tx(&full[stage], bytes * ranks);
    for (int p = 0; p < ranks; ++p) {
      dev::bulk_load_1d(slot(stage, p), at<const char>(in_peers[p], slice + offset), bytes,
                        &full[stage]);
    }
  }

  // All threads: vector i of out = the sum of the ranks' vectors i of `stage`, in rank order and
  // rounded once, as reduce_range does (bitwise the same result).
  template <typename T>
  __device__ __forceinline__ void sum(int stage, uint32_t bytes, T* out) const {
    using V = Vec<16>;
    constexpr int kElems = 16 / sizeof(T);
    for (uint32_t i = threadIdx.x; i < bytes / 16; i += blockDim.x) {
      float acc[kElems];
#pragma unroll
      for (int e = 0; e < kElems; ++e) acc[e] = 0.f;
      for (int p = 0; p < ranks; ++p) {
        const V v = reinterpret_cast<const V*>(slot(stage, p))[i];
        const T* x = reinterpret_cast<const T*>(&v);
#pragma unroll
        for (int e = 0; e < kElems; ++e) acc[e] += to_float(x[e]);
      }
      V y;
#pragma unroll
      for (int e = 0; e < kElems; ++e) reinterpret_cast<T*>(&y)[e] = from_float<T>(acc[e]);
      reinterpret_cast<V*>(out)[i] = y;
    }
  }
};

// Sums bytes [0, body) of every local rank's slice (in_peers[p] + slice) into out through the
// ring. body and slice are multiples of 16. All threads, after the entry channel barrier.
template <typename T>
__device__ __forceinline__ void reduce_bulk(const BulkRing& ring, void* const* in_peers,
                                            std::size_t slice, std::size_t body, T* out) {
  const std::size_t chunks = (body + ring.chunk - 1) / ring.chunk;
  const std::size_t mine = (chunks + gridDim.x - 1 - blockIdx.x) / gridDim.x;
  auto offset = [&](std::size_t k) { return (blockIdx.x + k * gridDim.x) * ring.chunk; };
  auto bytes = [&](std::size_t k) {
    const std::size_t left = body - offset(k);
    return static_cast<uint32_t>(left < ring.chunk ? left : ring.chunk);
  };
  if (threadIdx.x == 0) {
    // The peers wrote their inputs with ordinary stores, which the entry barrier acquired (in
    // other threads of this CTA): order them before this thread's copy-engine reads.
    dev::fence_acq_rel_sys();
    dev::fence_proxy_async_global();
    for (std::size_t k = 0; k < mine && k < kBulkStages; ++k) {
      ring.load(static_cast<int>(k), in_peers, slice, offset(k), bytes(k));
    }
  }
  for (std::size_t k = 0; k < mine; ++k) {
    const int stage = k % kBulkStages;
    dev::mbarrier_wait(&ring.full[stage], (k / kBulkStages) & 1);
    ring.sum<T>(stage, bytes(k), out + offset(k) / sizeof(T));
    __syncthreads();  // the stage is read: it may be refilled
    const std::size_t next = k + kBulkStages;
    if (threadIdx.x == 0 && next < mine) {
      ring.load(stage, in_peers, slice, offset(next), bytes(next));
    }
  }
}

// reduce_scatter_kernel through the ring, for in_offset + the slice's first byte and out 16-byte
// aligned. kBulkThreads threads, bulk_smem_bytes(local_size) bytes of dynamic shared memory: one
// CTA per SM, which the launch bounds tell ptxas (without, it aimed at 40 registers and spilled in
// the 16-bit types' sums).
template <typename T>
__global__ void __launch_bounds__(kBulkThreads, 1)
    reduce_scatter_bulk_kernel(DeviceComm comm, void* const* in_peers, std::size_t in_offset,
                               std::size_t count, T* out) {
  extern __shared__ __align__(128) unsigned char ring_smem[];
  const BulkRing ring = BulkRing::init(ring_smem, comm.local_size);
  const dev::Launch launch = dev::Launch::begin(comm);
  const int channel = blockIdx.x;
  if (launch.channel_barrier(SignalId::kEntry, channel, 0)) {
    const std::size_t begin = static_cast<std::size_t>(comm.rank) * count;
    const std::size_t body = count * sizeof(T) / 16 * 16;
    reduce_bulk<T>(ring, in_peers, in_offset + begin * sizeof(T), body, out);
    reduce_tail<T>(comm, in_peers, in_offset, begin, begin + body / sizeof(T), begin + count, out,
                   nullptr, 0);
    launch.channel_barrier(SignalId::kExit, channel, 0);
  }
  launch.end();
}

// all_reduce: this rank owns elements [begin, end) (its chunk), reduces and broadcasts them.
template <typename T, int kBytes>
__global__ void __launch_bounds__(512)
    all_reduce_kernel(DeviceComm comm, void* const* in_peers, std::size_t in_offset,
                      std::size_t begin, std::size_t end, void* const* out_peers,
                      std::size_t out_offset) {
  const dev::Launch launch = dev::Launch::begin(comm);
  const int channel = blockIdx.x;
  if (launch.channel_barrier(SignalId::kEntry, channel, 0)) {
    if (begin < end) {
      reduce_range<T, kBytes>(comm, in_peers, in_offset, begin, end, nullptr, out_peers,
                              out_offset);
    }
    launch.channel_barrier(SignalId::kExit, channel, 0);
  }
  launch.end();
}

}  // namespace mk::coll
