// Internal: a kernel's dynamic shared memory beyond the default 48 KiB, allowed once per device.
#pragma once

#include <cuda_runtime_api.h>

#include <atomic>
#include <cstdint>

#include "runtime/cuda_check.h"

namespace mk::detail {

// cudaFuncSetAttribute(kKernel, MaxDynamicSharedMemorySize, bytes) on the current device, once
// (bit d of a per-kernel mask): every launch asks, and the call costs the host half a
// microsecond. It also loads the kernel.
template <auto kKernel>
void allow_dynamic_smem(int bytes) {
  static std::atomic<uint64_t> done{0};
  int device = 0;
  MK_CUDA_CHECK(cudaGetDevice(&device));
  const uint64_t bit = device < 64 ? uint64_t{1} << device : 0;
  if (bit == 0 || (done.load(std::memory_order_acquire) & bit) == 0) {
    MK_CUDA_CHECK(
        cudaFuncSetAttribute(kKernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
    done.fetch_or(bit, std::memory_order_release);
  }
}

}  // namespace mk::detail
