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
// the kernel now). kBlockM: 128-row tiles, or the plain GEMM's 64- and 192-row ones.
template <int kBlockN, bool kTransB, class Fusion, int kBlockM = 128>
auto prepared_kernel() {
  using Cfg = FusionTileConfig<kBlockN, Fusion, kBlockM>;
  constexpr auto kernel = gemm_kernel<Cfg, kTransB, Fusion>;
  detail::allow_dynamic_smem<kernel>(Cfg::kSmemBytes);
  return kernel;
}

// fn.template operator()<kBlockN, kTransB>() for every width and B layout.
template <class Fn>
void for_each_width(Fn&& fn) {
  for (int block_n : {64, 128, 192, 256}) {
    for (bool trans_b : {false, true}) dispatch(block_n, trans_b, fn);
  }
}

// Every (width, layout) instantiation of a policy template: loaded now, so that no launch waits
// for lazy loading behind a peer's kernel that waits for this rank (communicator creation).
template <template <int> class Fusion>
void preload_all() {
  for_each_width(
      [&]<int kBlockN, bool kTransB>() { prepared_kernel<kBlockN, kTransB, Fusion<kBlockN>>(); });
}

// The launch's configuration: `grid` persistent CTAs, in clusters of `cluster` (grid a multiple).
template <class Cfg>
struct LaunchShape {
  cudaLaunchConfig_t config{};
  cudaLaunchAttribute attr{};
  LaunchShape(int grid, int cluster, cudaStream_t stream) {
    config.gridDim = dim3(grid);
    config.blockDim = dim3(Cfg::kThreads);
    config.dynamicSmemBytes = Cfg::kSmemBytes;
    config.stream = stream;
    if (cluster > 1) {
      attr.id = cudaLaunchAttributeClusterDimension;
      attr.val.clusterDim = {static_cast<unsigned>(cluster), 1, 1};
      config.attrs = &attr;
      config.numAttrs = 1;
    }
  }
};

// Launches gemm_kernel<..., Fusion> on `grid` persistent CTAs (in clusters of `cluster`: the
// split GEMM's); throws naming `op` if it fails.
template <int kBlockN, bool kTransB, class Fusion, int kBlockM = 128>
void launch(const Fusion& fusion, const CUtensorMap& map_b, int64_t k, int grid,
            cudaStream_t stream, const char* op, int cluster = 1) {
  using Cfg = FusionTileConfig<kBlockN, Fusion, kBlockM>;
  auto kernel = prepared_kernel<kBlockN, kTransB, Fusion, kBlockM>();
  cudaError_t err = cudaSuccess;
  if (cluster > 1) {
    LaunchShape<Cfg> shape(grid, cluster, stream);
    err = cudaLaunchKernelEx(&shape.config, kernel, map_b, static_cast<int>(k), fusion);
  } else {
    kernel<<<grid, Cfg::kThreads, Cfg::kSmemBytes, stream>>>(map_b, static_cast<int>(k), fusion);
  }
  if (err == cudaSuccess) err = cudaGetLastError();
  if (err != cudaSuccess) {
    throw Error(ErrorCode::kCuda, std::string(op) + ": launch failed: " + cudaGetErrorString(err));
  }
}

// CTAs of gemm_kernel<..., Fusion> the current device runs at once in clusters of `cluster`
// (clusters x cluster; a cluster's CTAs share a GPC, whose SMs need not divide evenly).
template <int kBlockN, bool kTransB, class Fusion>
int cluster_ctas(int cluster) {
  using Cfg = FusionTileConfig<kBlockN, Fusion>;
  auto kernel = prepared_kernel<kBlockN, kTransB, Fusion>();
  LaunchShape<Cfg> shape(cluster, cluster, nullptr);
  int clusters = 0;
  MK_CUDA_CHECK(cudaOccupancyMaxActiveClusters(&clusters, kernel, &shape.config));
  return clusters * cluster;
}

}  // namespace mk::gemm_engine
