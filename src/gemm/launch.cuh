// The GEMM engine's kernel from host code: run-time tile width and B layout -> compile-time
// instantiation, shared-memory setup, launch. Used by the plain, grouped and fused GEMMs alike.
#pragma once

#include <cuda.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "gemm/gemm_kernel.cuh"
#include "mkernel/error.h"
#include "runtime/cuda_check.h"

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
// the kernel now). The attribute is set once per device (bit d of `done`): every launch asks, and
// the call costs the host half a microsecond.
template <int kBlockN, bool kTransB, class Fusion, bool kPingPong = false, bool kPairs = false>
auto prepared_kernel() {
  using Cfg = TileConfig<kBlockN>;
  auto kernel = gemm_kernel<Cfg, kTransB, Fusion, kPingPong, kPairs>;
  static std::atomic<uint64_t> done{0};
  int device = 0;
  MK_CUDA_CHECK(cudaGetDevice(&device));
  const uint64_t bit = device < 64 ? uint64_t{1} << device : 0;
  if (bit == 0 || (done.load(std::memory_order_acquire) & bit) == 0) {
    MK_CUDA_CHECK(
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Cfg::kSmemBytes));
    done.fetch_or(bit, std::memory_order_release);
  }
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
template <int kBlockN, bool kTransB, class Fusion, bool kPingPong = false>
void launch(const Fusion& fusion, const CUtensorMap& map_b, int64_t k, int grid,
            cudaStream_t stream, const char* op) {
  using Cfg = TileConfig<kBlockN>;
  auto kernel = prepared_kernel<kBlockN, kTransB, Fusion, kPingPong>();
  kernel<<<grid, Cfg::kThreads, Cfg::kSmemBytes, stream>>>(map_b, static_cast<int>(k), fusion);
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) {
    throw Error(ErrorCode::kCuda, std::string(op) + ": launch failed: " + cudaGetErrorString(err));
  }
}

// The same kernel in CTA pairs (clusters of two; gemm_kernel.cuh, kPairs) on up to `grid` CTAs:
// an even number (two for a single tile), at most as many as can be resident at once (an SM left
// over in a GPC holds no pair). Throws naming `op` if the launch fails.
template <int kBlockN, bool kTransB, class Fusion>
void launch_pairs(const Fusion& fusion, const CUtensorMap& map_b, int64_t k, int grid,
                  cudaStream_t stream, const char* op) {
  using Cfg = TileConfig<kBlockN>;
  auto kernel = prepared_kernel<kBlockN, kTransB, Fusion, false, true>();
  cudaLaunchAttribute cluster{};
  cluster.id = cudaLaunchAttributeClusterDimension;
  cluster.val.clusterDim.x = 2;
  cluster.val.clusterDim.y = 1;
  cluster.val.clusterDim.z = 1;
  cudaLaunchConfig_t config{};
  config.blockDim = dim3(Cfg::kThreads);
  config.dynamicSmemBytes = Cfg::kSmemBytes;
  config.stream = stream;
  config.attrs = &cluster;
  config.numAttrs = 1;
  static std::atomic<int> resident_pairs{0};  // (one GPU model per process)
  int pairs = resident_pairs.load(std::memory_order_relaxed);
  if (pairs == 0) {
    config.gridDim = dim3(2);
    MK_CUDA_CHECK(cudaOccupancyMaxActiveClusters(&pairs, kernel, &config));
    pairs = pairs > 0 ? pairs : 1;
    resident_pairs.store(pairs, std::memory_order_relaxed);
  }
  const int ctas = 2 * std::max(1, std::min(grid / 2, pairs));
  config.gridDim = dim3(ctas);
  if (std::getenv("MKERNEL_PRINT_CONFIG") != nullptr) {
    std::fprintf(stderr, "[mkernel] %s: %d CTAs in pairs (%d pairs resident at most)\n", op, ctas,
                 pairs);
  }
  const cudaError_t err =
      cudaLaunchKernelEx(&config, kernel, map_b, static_cast<int>(k), fusion);
  if (err != cudaSuccess) {
    throw Error(ErrorCode::kCuda, std::string(op) + ": launch failed: " + cudaGetErrorString(err));
  }
}

}  // namespace mk::gemm_engine
