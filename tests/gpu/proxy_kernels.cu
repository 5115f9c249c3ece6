// Kernels of the GPU-proxy test (proxy_kernels.h).
#include "mkernel/device/sync.cuh"
#include "mkernel/transport/command.h"
#include "proxy_kernels.h"

namespace mk::test {
namespace {

constexpr uint64_t kWaitNs = 10ull * 1000 * 1000 * 1000;

__device__ uint8_t pattern(uint64_t i, int rank) {
  return static_cast<uint8_t>((i * 131 + rank * 7 + 1) & 0xFF);
}

struct DeviceWait {
  uint64_t start;
  __device__ bool operator()(uint64_t) const { return dev::global_timer_ns() - start < kWaitNs; }
};

__global__ void push_puts_kernel(ProxyRings rings, uint32_t peer, uint64_t chunk, uint64_t chunks,
                                 uint64_t value, int* failures) {
  if (threadIdx.x != 0) return;
  const transport::CommandRing& ring = rings.ring[blockIdx.x % rings.count];
  const uint32_t signal = blockIdx.x;
  for (uint64_t c = blockIdx.x; c < chunks; c += gridDim.x) {
    const uint64_t off = c * chunk;
    const bool last = c + gridDim.x >= chunks;
    const transport::Command cmd =
        last ? transport::make_put_signal(peer, c, 0, off, 1, off, chunk, signal, value)
             : transport::make_put(peer, c, 0, off, 1, off, chunk, signal);
    const auto result = ring.push(cmd, DeviceWait{dev::global_timer_ns()});
    if (result.status != transport::PushStatus::kOk) atomicAdd(failures, 1);
  }
}

__global__ void await_and_check_kernel(const uint64_t* pad_words, int world, int src, int ctas,
                                       uint64_t value, const uint8_t* dst, uint64_t bytes,
                                       unsigned long long* mismatches, int* timeouts) {
  __shared__ int gave_up;
  if (threadIdx.x == 0) {
    gave_up = 0;
    const uint64_t start = dev::global_timer_ns();
    for (int s = 0; s < ctas && !gave_up; ++s) {
      while (dev::ld_acquire_sys(pad_words + static_cast<uint64_t>(s) * world + src) < value) {
        if (dev::global_timer_ns() - start > kWaitNs) {
          gave_up = 1;
          atomicAdd(timeouts, 1);
          break;
        }
      }
    }
  }
  __syncthreads();
  if (gave_up) return;
  unsigned long long bad = 0;
  for (uint64_t i = threadIdx.x; i < bytes; i += blockDim.x) bad += dst[i] != pattern(i, src);
  if (bad) atomicAdd(mismatches, bad);
}

__global__ void fill_pattern_kernel(uint8_t* dst, uint64_t bytes, int rank) {
  for (uint64_t i = blockIdx.x * static_cast<uint64_t>(blockDim.x) + threadIdx.x; i < bytes;
       i += static_cast<uint64_t>(gridDim.x) * blockDim.x) {
    dst[i] = pattern(i, rank);
  }
}

}  // namespace

void preload_proxy_kernels() {
  cudaFuncAttributes attributes;
  for (const void* kernel : {reinterpret_cast<const void*>(push_puts_kernel),
                             reinterpret_cast<const void*>(await_and_check_kernel),
                             reinterpret_cast<const void*>(fill_pattern_kernel)}) {
    cudaFuncGetAttributes(&attributes, kernel);
  }
}

void launch_push_puts(const ProxyRings& rings, int ctas, uint32_t peer, uint64_t chunk,
                      uint64_t chunks, uint64_t value, int* failures, cudaStream_t s) {
  push_puts_kernel<<<ctas, 32, 0, s>>>(rings, peer, chunk, chunks, value, failures);
}

void launch_await_and_check(const uint64_t* pad_words, int world, int src, int ctas, uint64_t value,
                            const uint8_t* dst, uint64_t bytes, unsigned long long* mismatches,
                            int* timeouts, cudaStream_t s) {
  await_and_check_kernel<<<1, 512, 0, s>>>(pad_words, world, src, ctas, value, dst, bytes,
                                           mismatches, timeouts);
}

void launch_fill_pattern(uint8_t* dst, uint64_t bytes, int rank, cudaStream_t s) {
  fill_pattern_kernel<<<256, 256, 0, s>>>(dst, bytes, rank);
}

}  // namespace mk::test
