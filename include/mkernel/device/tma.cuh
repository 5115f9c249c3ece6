// mkernel/device/tma.cuh - bulk tensor copies (TMA) global -> shared, completing on an mbarrier.
// Tensor maps are built on the host (cuTensorMapEncodeTiled) and passed as
// `const __grid_constant__ CUtensorMap` kernel parameters.
#pragma once

#include <cuda.h>

#include <cstdint>

#include "mkernel/device/mbarrier.cuh"

namespace mk::dev {

__device__ __forceinline__ void tma_prefetch_descriptor(const CUtensorMap* map) {
  asm volatile("prefetch.tensormap [%0];" ::"l"(reinterpret_cast<uint64_t>(map)) : "memory");
}

// Loads the box at element coordinates (c0 innermost, c1) of `map` into `dst`; out-of-bounds
// elements read as zero. Completion adds the box's bytes to `bar`'s transaction count.
__device__ __forceinline__ void tma_load_2d(void* dst, const CUtensorMap* map, uint64_t* bar,
                                            int32_t c0, int32_t c1) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%3, %4}], [%2];" ::"r"(smem_addr(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(smem_addr(bar)), "r"(c0), "r"(c1)
      : "memory");
}

}  // namespace mk::dev
