// The GEMM engine against cuBLAS, one GPU: bench_gemm [--json FILE] [--iters 20] [--check]
// Shapes of issue 3. Same random inputs for both; times are medians of CUDA-event-timed
// iterations after warm-up, each iteration on one of two input sets (so operands do not stay in
// L2 between iterations for the smaller shapes). Correct = |mkernel - cuBLAS| <= 2 bf16 ulps of
// the largest output (the exact fp64 check lives in tests/gpu/test_gemm.cpp).
#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <functional>
#include <sstream>
#include <string>
#include <vector>

#include "bench_kernels.h"
#include "mkernel/gemm.h"

namespace {

#define CK(x)                                                                               \
  do {                                                                                      \
    auto e_ = (x);                                                                          \
    if (e_ != decltype(e_){}) {                                                             \
      std::fprintf(stderr, "%s failed (%d) at %s:%d\n", #x, static_cast<int>(e_), __FILE__, \
                   __LINE__);                                                               \
      std::exit(2);                                                                         \
    }                                                                                       \
  } while (0)

struct Shape {
  int64_t m, n, k;
};

double median_ms(int iters, cudaStream_t s, const std::function<void(int)>& op) {
  for (int i = 0; i < 3; ++i) op(i);
  CK(cudaStreamSynchronize(s));
  std::vector<cudaEvent_t> ev(2 * iters);
  for (auto& e : ev) CK(cudaEventCreate(&e));
  for (int i = 0; i < iters; ++i) {
    CK(cudaEventRecord(ev[2 * i], s));
    op(i);
    CK(cudaEventRecord(ev[2 * i + 1], s));
  }
  CK(cudaStreamSynchronize(s));
  std::vector<float> t(iters);
  for (int i = 0; i < iters; ++i) CK(cudaEventElapsedTime(&t[i], ev[2 * i], ev[2 * i + 1]));
  for (auto& e : ev) cudaEventDestroy(e);
  std::sort(t.begin(), t.end());
  return t[iters / 2];
}

}  // namespace

int main(int argc, char** argv) {
  std::string json;
  int iters = 20;
  bool check_only = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--json" && i + 1 < argc)
      json = argv[++i];
    else if (a == "--iters" && i + 1 < argc)
      iters = std::atoi(argv[++i]);
    else if (a == "--check")
      check_only = true;
    else {
      std::fprintf(stderr, "usage: %s [--json FILE] [--iters N] [--check]\n", argv[0]);
      return 2;
    }
  }
  const std::vector<Shape> shapes = {{4096, 4096, 4096},  {8192, 8192, 8192},  {16384, 8192, 8192},
                                     {8192, 2048, 8192},  {8192, 28672, 8192}, {8192, 8192, 28672},
                                     {4096, 14336, 4096}, {3000, 5120, 3584},  {128, 8192, 8192},
                                     {1024, 8192, 8192}};
  cudaStream_t s;
  CK(cudaStreamCreate(&s));
  cublasHandle_t h;
  CK(cublasCreate(&h));
  CK(cublasSetStream(h, s));
  cudaDeviceProp prop{};
  CK(cudaGetDeviceProperties(&prop, 0));
  unsigned int* d_stat;
  CK(cudaMalloc(reinterpret_cast<void**>(&d_stat), 2 * sizeof(unsigned int)));
  std::ostringstream rows;
  bool all_correct = true;
  double log_ratio_sum = 0, worst_ratio = 1e9;
  std::printf("%-22s %10s %10s %9s %9s %7s  %s\n", "shape (MxNxK)", "mkernel ms", "cuBLAS ms",
              "TFLOP/s", "cuBLAS", "ratio", "check");
  for (const Shape& sh : shapes) {
    void *a[2], *b[2], *c, *c_blas;
    for (int i = 0; i < 2; ++i) {
      CK(cudaMalloc(&a[i], sh.m * sh.k * 2));
      CK(cudaMalloc(&b[i], sh.n * sh.k * 2));
      mk::bench::launch_fill(a[i], sh.m * sh.k, 17 + i, 0, s);
      mk::bench::launch_fill(b[i], sh.n * sh.k, 29 + i, 1, s);
    }
    CK(cudaMalloc(&c, sh.m * sh.n * 2));
    CK(cudaMalloc(&c_blas, sh.m * sh.n * 2));
    const float one = 1.f, zero = 0.f;
    auto ours = [&](int i) {
      mk::gemm(a[i & 1], b[i & 1], c, sh.m, sh.n, sh.k, mk::BLayout::kNK, s);
    };
    auto theirs = [&](int i) {
      CK(cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, sh.n, sh.m, sh.k, &one, b[i & 1], CUDA_R_16BF,
                      sh.k, a[i & 1], CUDA_R_16BF, sh.k, &zero, c_blas, CUDA_R_16BF, sh.n,
                      CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
    };
    ours(0);
    theirs(0);
    CK(cudaMemsetAsync(d_stat, 0, 2 * sizeof(unsigned int), s));
    mk::bench::launch_max_diff_bf16(c, c_blas, sh.m * sh.n, d_stat, s);
    unsigned int stat[2];
    CK(cudaMemcpyAsync(stat, d_stat, sizeof(stat), cudaMemcpyDeviceToHost, s));
    CK(cudaStreamSynchronize(s));
    float diff, mag;
    std::memcpy(&diff, &stat[0], 4);
    std::memcpy(&mag, &stat[1], 4);
    const bool correct = diff <= 2 * mag / 128.f;  // 2 bf16 ulps of the largest value
    all_correct = all_correct && correct;
    const std::string label =
        std::to_string(sh.m) + "x" + std::to_string(sh.n) + "x" + std::to_string(sh.k);
    if (check_only) {
      std::printf("%-22s max |mkernel - cuBLAS| %.4g (max |C| %.4g)  %s\n", label.c_str(), diff,
                  mag, correct ? "ok" : "WRONG");
    } else {
      const double ms = median_ms(iters, s, ours);
      const double ms_blas = median_ms(iters, s, theirs);
      const double flops = 2.0 * sh.m * sh.n * sh.k;
      const double ratio = ms_blas / ms;  // TFLOP/s relative to cuBLAS
      log_ratio_sum += std::log(ratio);
      worst_ratio = std::min(worst_ratio, ratio);
      std::printf("%-22s %10.3f %10.3f %9.1f %9.1f %7.3f  %s\n", label.c_str(), ms, ms_blas,
                  flops / ms * 1e-9, flops / ms_blas * 1e-9, ratio, correct ? "ok" : "WRONG");
      rows << (rows.tellp() > 0 ? ",\n" : "") << "    {\"shape\": {\"M\": " << sh.m
           << ", \"N\": " << sh.n << ", \"K\": " << sh.k
           << "}, \"dtype\": \"bf16\", \"ms\": {\"mkernel\": " << ms
           << ", \"gemm_alone\": " << ms_blas << "}, \"limit_ms\": " << ms_blas
           << ", \"ratio_to_limit\": " << ms / ms_blas << ", \"tflops\": " << flops / ms * 1e-9
           << ", \"tflops_cublas\": " << flops / ms_blas * 1e-9
           << ", \"correct\": " << (correct ? "true" : "false") << "}";
    }
    for (int i = 0; i < 2; ++i) cudaFree(a[i]), cudaFree(b[i]);
    cudaFree(c), cudaFree(c_blas);
  }
  if (!check_only) {
    std::printf("geometric mean of TFLOP/s vs cuBLAS: %.3f, worst %.3f\n",
                std::exp(log_ratio_sum / shapes.size()), worst_ratio);
  }
  if (!json.empty() && !check_only) {
    std::time_t t = std::time(nullptr);
    char date[32];
    std::strftime(date, sizeof(date), "%Y-%m-%dT%H:%M:%SZ", std::gmtime(&t));
    const char* commit = std::getenv("MKERNEL_COMMIT");
    FILE* f = std::fopen(json.c_str(), "w");
    std::fprintf(f,
                 "{\n  \"kernel\": \"gemm\",\n  \"commit\": \"%s\",\n  \"date\": \"%s\",\n"
                 "  \"device\": \"%s\",\n  \"world_size\": 1,\n  \"num_nodes\": 1,\n"
                 "  \"transport\": \"none\",\n  \"rows\": [\n%s\n  ]\n}\n",
                 commit ? commit : "unknown", date, prop.name, rows.str().c_str());
    std::fclose(f);
  }
  return all_correct ? 0 : 1;
}
