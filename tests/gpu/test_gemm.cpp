// The GEMM engine against an fp64 reference and cuBLAS: every shape of the benchmark list, edge
// shapes (M = 1, partial tiles in M, N and K) and random shapes; fresh random data, poisoned
// outputs (every element must be written), determinism, and argument errors.
#include <cublas_v2.h>

#include <algorithm>
#include <random>

#include "gemm_reference.h"
#include "gpu_test_util.h"
#include "gemm/gemm_internal.h"
#include "mkernel/gemm.h"

namespace mk::test {
namespace {

struct Shape {
  int64_t m, n, k;
};

std::string name(const Shape& s) {
  return std::to_string(s.m) + "x" + std::to_string(s.n) + "x" + std::to_string(s.k);
}

double bf16_to_double(uint16_t u) { return from_bits(u, DType::kBF16); }

// Max |x - ref| over the sampled rows of a [m, n] bf16 matrix on the device.
double max_error(const void* c, int64_t n, const std::vector<int64_t>& rows,
                 const std::vector<double>& ref) {
  std::vector<uint16_t> row(n);
  double worst = 0;
  for (std::size_t r = 0; r < rows.size(); ++r) {
    cudaMemcpy(row.data(), static_cast<const uint16_t*>(c) + rows[r] * n, n * 2,
               cudaMemcpyDeviceToHost);
    for (int64_t j = 0; j < n; ++j) {
      const double x = bf16_to_double(row[j]);
      const double e = std::fabs(x - ref[r * n + j]);
      worst = std::max(worst, e == e ? e : 1e300);
    }
  }
  return worst;
}

// The same product through cuBLAS. Row-major [m, n] is column-major [n, m]: C_cm = op(B_cm) A_cm,
// with B_cm [k, n] transposed for B [n, k] and used as is for B [k, n].
void cublas_gemm(cublasHandle_t h, const void* a, const void* b, void* c, const Shape& s,
                 BLayout layout) {
  const float one = 1.f, zero = 0.f;
  const bool nk = layout == BLayout::kNK;
  ASSERT_EQ(cublasGemmEx(h, nk ? CUBLAS_OP_T : CUBLAS_OP_N, CUBLAS_OP_N, s.n, s.m, s.k, &one, b,
                         CUDA_R_16BF, nk ? s.k : s.n, a, CUDA_R_16BF, s.k, &zero, c, CUDA_R_16BF,
                         s.n, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
            CUBLAS_STATUS_SUCCESS);
}

void expect_gemm_matches(const Shape& s, uint64_t seed, GemmConfig config = {},
                         BLayout layout = BLayout::kNK) {
  SCOPED_TRACE(name(s) + " block_n " + std::to_string(config.block_n) +
               (layout == BLayout::kKN ? " B [K, N]" : " B [N, K]"));
  cudaStream_t stream;
  MKT_CUDA(cudaStreamCreate(&stream));
  void *a, *b, *c, *c_blas;
  MKT_CUDA(cudaMalloc(&a, s.m * s.k * 2));
  MKT_CUDA(cudaMalloc(&b, s.n * s.k * 2));
  MKT_CUDA(cudaMalloc(&c, s.m * s.n * 2));
  MKT_CUDA(cudaMalloc(&c_blas, s.m * s.n * 2));
  fill_random_bf16(a, s.m * s.k, seed, stream);
  fill_random_bf16(b, s.n * s.k, seed ^ 0x5555, stream);
  MKT_CUDA(cudaMemsetAsync(c, 0xFF, s.m * s.n * 2, stream));  // bf16 NaN everywhere

  gemm(a, b, c, s.m, s.n, s.k, layout, stream, config);
  cublasHandle_t h;
  ASSERT_EQ(cublasCreate(&h), CUBLAS_STATUS_SUCCESS);
  cublasSetStream(h, stream);
  cublas_gemm(h, a, b, c_blas, s, layout);
  MKT_CUDA(cudaStreamSynchronize(stream));
  MKT_CUDA(cudaGetLastError());

  EXPECT_EQ(count_nans_bf16(c, s.m * s.n, stream), 0u) << "elements left unwritten (or NaN)";

  // fp64 reference on sampled rows: first, last, and random ones.
  std::mt19937_64 gen(seed);
  std::vector<int64_t> rows = {0, s.m - 1};
  const int samples = s.m * s.n > (int64_t{1} << 26) ? 6 : 14;
  for (int i = 0; i < samples; ++i) rows.push_back(static_cast<int64_t>(gen() % s.m));
  std::sort(rows.begin(), rows.end());
  rows.erase(std::unique(rows.begin(), rows.end()), rows.end());
  int64_t* d_rows;
  double* d_ref;
  MKT_CUDA(cudaMalloc(reinterpret_cast<void**>(&d_rows), rows.size() * sizeof(int64_t)));
  MKT_CUDA(cudaMalloc(reinterpret_cast<void**>(&d_ref), rows.size() * s.n * sizeof(double)));
  MKT_CUDA(cudaMemcpy(d_rows, rows.data(), rows.size() * sizeof(int64_t), cudaMemcpyHostToDevice));
  gemm_reference_rows(a, b, s.n, s.k, layout == BLayout::kKN, d_rows, static_cast<int>(rows.size()),
                      d_ref, stream);
  std::vector<double> ref(rows.size() * s.n);
  MKT_CUDA(cudaMemcpyAsync(ref.data(), d_ref, ref.size() * sizeof(double), cudaMemcpyDeviceToHost,
                           stream));
  MKT_CUDA(cudaStreamSynchronize(stream));
  const double err = max_error(c, s.n, rows, ref);
  const double err_blas = max_error(c_blas, s.n, rows, ref);
  // The tolerance rule (../shared/STYLE.md): within twice cuBLAS's error at the same precision.
  EXPECT_LE(err, 2 * err_blas + 1e-6) << "mkernel error " << err << ", cuBLAS error " << err_blas;

  // Deterministic: a second run is bitwise identical.
  std::vector<uint16_t> first(s.m * s.n), second(s.m * s.n);
  MKT_CUDA(cudaMemcpy(first.data(), c, first.size() * 2, cudaMemcpyDeviceToHost));
  gemm(a, b, c, s.m, s.n, s.k, layout, stream, config);
  MKT_CUDA(cudaStreamSynchronize(stream));
  MKT_CUDA(cudaMemcpy(second.data(), c, second.size() * 2, cudaMemcpyDeviceToHost));
  EXPECT_TRUE(first == second) << "two runs differ";

  cublasDestroy(h);
  cudaFree(a), cudaFree(b), cudaFree(c), cudaFree(c_blas), cudaFree(d_rows), cudaFree(d_ref);
  cudaStreamDestroy(stream);
}

uint64_t fresh_seed() { return (uint64_t{std::random_device{}()} << 32) | std::random_device{}(); }

TEST(Gemm, BenchmarkShapes) {
  MKT_REQUIRE_GPU();
  const std::vector<Shape> shapes = {{4096, 4096, 4096},  {8192, 8192, 8192},  {16384, 8192, 8192},
                                     {8192, 2048, 8192},  {8192, 28672, 8192}, {8192, 8192, 28672},
                                     {4096, 14336, 4096}, {3000, 5120, 3584},  {128, 8192, 8192},
                                     {1024, 8192, 8192}};
  for (const Shape& s : shapes) expect_gemm_matches(s, fresh_seed());
}

TEST(Gemm, EdgeShapesBothTileWidths) {
  MKT_REQUIRE_GPU();
  const std::vector<Shape> shapes = {{1, 8, 8},      {1, 4096, 4096},  {7, 24, 40},
                                     {129, 264, 72}, {255, 520, 1000}, {1000, 1000, 1000},
                                     {128, 256, 64}, {333, 4104, 8}};
  for (int block_n : {64, 128, 192, 256}) {
    GemmConfig config;
    config.block_n = block_n;
    for (const Shape& s : shapes) expect_gemm_matches(s, fresh_seed(), config);
  }
}

// B as [K, N] (N-major tiles, transposed wgmma operand).
TEST(Gemm, BLayoutKN) {
  MKT_REQUIRE_GPU();
  const std::vector<Shape> shapes = {{4096, 4096, 4096}, {8192, 2048, 8192}, {1, 8, 8},
                                     {129, 264, 72},     {1000, 1000, 1000}, {3000, 5120, 3584}};
  for (int block_n : {64, 128, 192, 256}) {
    GemmConfig config;
    config.block_n = block_n;
    for (const Shape& s : shapes) expect_gemm_matches(s, fresh_seed(), config, BLayout::kKN);
  }
}

TEST(Gemm, RandomShapes) {
  MKT_REQUIRE_GPU();
  std::mt19937_64 gen(fresh_seed());
  for (int i = 0; i < 12; ++i) {
    const Shape s{static_cast<int64_t>(1 + gen() % 3000),
                  static_cast<int64_t>(8 * (1 + gen() % 500)),
                  static_cast<int64_t>(8 * (1 + gen() % 500))};
    expect_gemm_matches(s, gen(), {}, gen() % 2 ? BLayout::kKN : BLayout::kNK);
  }
}

TEST(Gemm, RejectsBadArgumentsBeforeLaunch) {
  MKT_REQUIRE_GPU();
  void* p;
  ASSERT_EQ(cudaMalloc(&p, 1 << 20), cudaSuccess);
  char* q = static_cast<char*>(p);
  std::vector<char> host(1024);
  auto expect = [](auto fn, ErrorCode code, const std::string& needle) {
    expect_error(fn, code, needle);
  };
  expect([&] { gemm(q, q, q, 0, 8, 8, BLayout::kNK, nullptr); }, ErrorCode::kInvalidArgument,
         "M = 0");
  expect([&] { gemm(q, q, q, 8, 12, 8, BLayout::kNK, nullptr); }, ErrorCode::kInvalidArgument,
         "N = 12; expected a multiple of 8");
  expect([&] { gemm(q, q, q, 8, 8, 4, BLayout::kNK, nullptr); }, ErrorCode::kInvalidArgument,
         "K = 4");
  expect([&] { gemm(q + 2, q, q, 8, 8, 8, BLayout::kNK, nullptr); }, ErrorCode::kInvalidArgument,
         "A is not 16-byte aligned");
  expect([&] { gemm(q, host.data(), q, 8, 8, 8, BLayout::kNK, nullptr); },
         ErrorCode::kInvalidArgument, "B is not");
  expect([&] { gemm(q, q, q, 8, 8, 8, static_cast<BLayout>(9), nullptr); },
         ErrorCode::kInvalidArgument, "unknown B layout");
  GemmConfig bad;
  bad.block_n = 96;
  expect([&] { gemm(q, q, q, 8, 8, 8, BLayout::kNK, nullptr, bad); }, ErrorCode::kInvalidArgument,
         "block_n = 96");
  cudaFree(p);
}

// The compiler's resource report for every kernel instantiation: no local memory (no spills, no
// stack), and the shared memory the kernel asks for.
TEST(Gemm, KernelsDoNotSpill) {
  MKT_REQUIRE_GPU();
  const std::vector<GemmKernelResources> kernels = detail::gemm_kernel_resources();
  ASSERT_EQ(kernels.size(), 8u);
  for (const GemmKernelResources& k : kernels) {
    SCOPED_TRACE(k.name);
    EXPECT_EQ(k.local_bytes, 0) << "local memory (register spills or a stack frame)";
    EXPECT_GT(k.max_dynamic_smem, 100 * 1024);
    std::printf("  %-22s %3d registers, %lld bytes local, %lld bytes dynamic shared\n",
                k.name.c_str(), k.registers, static_cast<long long>(k.local_bytes),
                static_cast<long long>(k.max_dynamic_smem));
  }
}

// Small cases for compute-sanitizer.
TEST(SanitizeGemm, Small) {
  MKT_REQUIRE_GPU();
  expect_gemm_matches({200, 264, 136}, fresh_seed());
  GemmConfig config;
  config.block_n = 192;
  expect_gemm_matches({130, 392, 72}, fresh_seed(), config, BLayout::kKN);
}

}  // namespace
}  // namespace mk::test
