// The GEMM engine's kernel from host code: run-time tile width and B layout -> compile-time
// instantiation, shared-memory setup, launch. Used by the plain, grouped and fused GEMMs alike.
#pragma once

#include <cuda.h>
#include <cuda_runtime_api.h>

#include <cstdint>
#include <string>

#include "gemm/gemm_kernel.cuh"
#include "mkernel/error.h"
#include "runtime/cuda_check.h"
#include "runtime/smem_opt_in.h"

namespace mk::gemm_engine {

// Calls fn.template operator()<kBlockN, kTransB>() for the run-time block_n (64, 128, 192,
// anything else = 256) and trans_b (B is [K, N]).
template <class Fn>
void dispatch(int block_n, bool trans_b, Fn&& fn) {
  auto width = [&]<bool kTransB>() {
    switch (block_n) {
      case 64:
        return fn.template operator()<64, kTransB>();
      case 128:
        return fn.template operator()<128, kTransB>();
      case 192:
        return fn.template operator()<192, kTransB>();
      default:
        return fn.template operator()<256, kTransB>();
    }
  };
  if (trans_b) {
    width.template operator()<true>();
  } else {
    width.template operator()<false>();
  }
}

// gemm_kernel<..., Fusion> with its shared memory allowed on the current device (which also loads
// the kernel now).
template <int kBlockN, bool kTransB, class Fusion>
auto prepared_kernel() {
  using Cfg = TileConfig<kBlockN>;
  constexpr auto kernel = gemm_kernel<Cfg, kTransB, Fusion>;
  detail::allow_dynamic_smem<kernel>(Cfg::kSmemBytes);
  return kernel;
}

// Every (width, layout) instantiation of a policy template: loaded now, so that no launch waits
// for lazy loading behind a peer's kernel that waits for this rank (communicator creation).
template <template <int> class Fusion>
void preload_all() {
  for (int block_n : {64, 128, 192, 256}) {
    for (bool trans_b : {false, true}) {
      dispatch(block_n, trans_b, [&]<int kBlockN, bool kTransB>() {
        prepared_kernel<kBlockN, kTransB, Fusion<kBlockN>>();
      });
    }
  }
}

// Launches gemm_kernel<..., Fusion> on `grid` persistent CTAs; throws naming `op` if it fails.
template <int kBlockN, bool kTransB, class Fusion>
void launch(const Fusion& fusion, const CUtensorMap& map_b, int64_t k, int grid,
            cudaStream_t stream, const char* op) {
  using Cfg = TileConfig<kBlockN>;
  auto kernel = prepared_kernel<kBlockN, kTransB, Fusion>();
  kernel<<<grid, Cfg::kThreads, Cfg::kSmemBytes, stream>>>(map_b, static_cast<int>(k), fusion);
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) {
    throw Error(ErrorCode::kCuda, std::string(op) + ": launch failed: " + cudaGetErrorString(err));
  }
}

}  // namespace mk::gemm_engine
