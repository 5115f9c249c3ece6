// What is a stage of the GEMM engine's ring worth? The plain GEMM (PlainGemm, the engine's
// persistent kernel) with the ring capped at fewer stages than fit, one GPU, against the default.
// The question behind it: a fused kernel could give the producer's side threads a stage's worth of
// shared memory (48 KiB at 128 x 256) for TMA bulk copies if the mainloop does not need it.
//   bench_stages [--shapes MxNxK,...] [--iters 20]
// Times are medians of CUDA-event-timed launches, alternating between two input sets.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "bench_check.h"
#include "bench_kernels.h"
#include "gemm/gemm_internal.h"
#include "gemm/gemm_kernel.cuh"
#include "runtime/cuda_check.h"

namespace {

using namespace mk;

struct Shape {
  int64_t m, n, k;
};

template <int kBlockN, int kMaxStages>
float time_gemm(const Shape& s, void* const* a, void* const* b, void* c, int iters, int sms) {
  using Cfg = gemm_engine::TileConfig<kBlockN, kMaxStages>;
  using Fusion = gemm_engine::PlainGemm<kBlockN>;
  auto kernel = gemm_engine::gemm_kernel<Cfg, false, Fusion>;
  CK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Cfg::kSmemBytes));
  Fusion f[2];
  CUtensorMap map_b[2];
  for (int i = 0; i < 2; ++i) {
    f[i] = {gemm_engine::make_map(a[i], s.m, s.k, 128),
            gemm_engine::make_map(c, s.m, s.n, 64),
            {static_cast<int>((s.m + 127) / 128), static_cast<int>((s.n + kBlockN - 1) / kBlockN)},
            static_cast<int>(s.n),
            gemm_engine::make_map(a[i], s.m, s.k, gemm_engine::last_tile_rows(s.m)),
            gemm_engine::last_tile_rows(s.m)};
    map_b[i] = gemm_engine::make_b_map(b[i], s.n, s.k, kBlockN, false);
  }
  const int tiles = f[0].raster.tiles_m * f[0].raster.tiles_n;
  const int grid = std::min(tiles, sms);
  auto run = [&](int i) {
    kernel<<<grid, Cfg::kThreads, Cfg::kSmemBytes>>>(map_b[i % 2], static_cast<int>(s.k), f[i % 2]);
  };
  for (int i = 0; i < 3; ++i) run(i);
  CK(cudaDeviceSynchronize());
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  std::vector<float> ms;
  for (int i = 0; i < iters; ++i) {
    CK(cudaEventRecord(e0));
    run(i);
    CK(cudaEventRecord(e1));
    CK(cudaEventSynchronize(e1));
    float t = 0;
    CK(cudaEventElapsedTime(&t, e0, e1));
    ms.push_back(t);
  }
  CK(cudaGetLastError());
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<Shape> shapes = {{8192, 8192, 4096},
                               {8192, 8192, 8192},
                               {4096, 8192, 4096},
                               {1024, 8192, 4096},
                               {8192, 28672, 4096}};
  int iters = 20;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string key = argv[i];
    if (key == "--iters") {
      iters = std::atoi(argv[i + 1]);
    } else if (key == "--shapes") {
      shapes.clear();
      std::string list = argv[i + 1];
      for (std::size_t p = 0; p < list.size();) {
        const std::size_t e = std::min(list.find(',', p), list.size());
        Shape s{};
        if (std::sscanf(list.substr(p, e - p).c_str(), "%ldx%ldx%ld", &s.m, &s.n, &s.k) != 3) {
          std::fprintf(stderr, "--shapes MxNxK,...\n");
          return 2;
        }
        shapes.push_back(s);
        p = e + 1;
      }
    } else {
      std::fprintf(stderr, "usage: bench_stages [--shapes MxNxK,...] [--iters N]\n");
      return 2;
    }
  }
  int sms = 0;
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  std::printf("stage ring of the plain GEMM (128 x 256 tiles, B [N, K]), %d SMs, medians of %d\n",
              sms, iters);
  std::printf("%-20s %9s %9s   %s\n", "shape", "4 stages", "3 stages", "TFLOP/s at 4 / 3");
  for (const Shape& s : shapes) {
    void *a[2], *b[2], *c;
    for (int i = 0; i < 2; ++i) {
      CK(cudaMalloc(&a[i], s.m * s.k * 2));
      CK(cudaMalloc(&b[i], s.n * s.k * 2));
      bench::launch_fill(a[i], s.m * s.k, 1 + i, 0, nullptr);
      bench::launch_fill(b[i], s.n * s.k, 3 + i, 0, nullptr);
    }
    CK(cudaMalloc(&c, s.m * s.n * 2));
    const float t4 = time_gemm<256, 4>(s, a, b, c, iters, sms);
    const float t3 = time_gemm<256, 3>(s, a, b, c, iters, sms);
    const double flop = 2.0 * s.m * s.n * s.k;
    char name[64];
    std::snprintf(name, sizeof(name), "%ldx%ldx%ld", s.m, s.n, s.k);
    std::printf("%-20s %9.4f %9.4f   %.0f / %.0f  (3 stages: %+.1f%%)\n", name, t4, t3,
                flop / t4 / 1e9, flop / t3 / 1e9, 100.0 * (t3 - t4) / t4);
    for (int i = 0; i < 2; ++i) {
      CK(cudaFree(a[i]));
      CK(cudaFree(b[i]));
    }
    CK(cudaFree(c));
  }
  return 0;
}
