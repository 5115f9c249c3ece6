// The GEMM engine against an fp64 reference and cuBLAS: every shape of the benchmark list, edge
// shapes (M = 1, partial tiles in M, N and K) and random shapes; fresh random data, poisoned
// outputs (every element must be written), determinism, and argument errors.
#include <cublas_v2.h>

#include <algorithm>
#include <random>
#include <tuple>

#include "gemm/gemm_internal.h"
#include "gemm_reference.h"
#include "gpu_test_util.h"
#include "mkernel/gemm.h"

namespace mk::test {
namespace {

struct Shape {
  int64_t m, n, k;
};

std::string name(const Shape& s) {
  return std::to_string(s.m) + "x" + std::to_string(s.n) + "x" + std::to_string(s.k);
}

void expect_gemm_matches(const Shape& s, uint64_t seed, GemmConfig config = {},
                         BLayout layout = BLayout::kNK) {
  SCOPED_TRACE(name(s) + " block_m " + std::to_string(config.block_m) + " block_n " +
               std::to_string(config.block_n) + " split_k " + std::to_string(config.split_k) +
               " sms " + std::to_string(config.sms) +
               (layout == BLayout::kKN ? " B [K, N]" : " B [N, K]") + ": " +
               gemm_plan(s.m, s.n, s.k, config, layout).describe());
  const bool kn = layout == BLayout::kKN;
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
  cublas_gemm(h, a, b, c_blas, s.m, s.n, s.k, kn);
  MKT_CUDA(cudaStreamSynchronize(stream));
  MKT_CUDA(cudaGetLastError());

  EXPECT_EQ(count_nans_bf16(c, s.m * s.n, stream), 0u) << "elements left unwritten (or NaN)";
  // The tolerance rule (../shared/STYLE.md): within twice cuBLAS's error at the same precision.
  const SampledErrors err = sampled_errors(c, c_blas, a, b, s.m, s.n, s.k, kn, seed, stream);
  EXPECT_LE(err.ours, 2 * err.cublas + 1e-6)
      << "mkernel error " << err.ours << ", cuBLAS error " << err.cublas;

  // Deterministic: a second run is bitwise identical.
  MKT_CUDA(cudaMemcpyAsync(c_blas, c, s.m * s.n * 2, cudaMemcpyDeviceToDevice, stream));
  gemm(a, b, c, s.m, s.n, s.k, layout, stream, config);
  EXPECT_EQ(count_different_bytes16(c, c_blas, s.m * s.n * 2 / 16 * 16, stream), 0u)
      << "two runs differ";

  cublasDestroy(h);
  cudaFree(a), cudaFree(b), cudaFree(c), cudaFree(c_blas);
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
    // Few CTAs: many tiles each, back to back at the N edge (one 64-column chunk per slice, so
    // consecutive stores may take the same staging buffer).
    config.sms = 7;
    expect_gemm_matches({1000, 2056, 520}, fresh_seed(), config);
  }
}

// The widths between the multiples of 64 (128-row tiles, K whole): the whole 64-column chunks
// through TMA, the last 16-48 columns stored by the threads - at the N edge (a partial tail, or
// none of it inside C), partial tile-rows, few CTAs with many tiles each. B [K, N] too (96, 144,
// 160, 224): its last 16 or 32 columns a box and a wgmma of their own, swizzled at their width.
TEST(Gemm, StepWidths) {
  MKT_REQUIRE_GPU();
  // (N 232: a partial tail at 80 wide; 440: at 224; 264 and 520 at the others.)
  const std::vector<Shape> shapes = {{1, 8, 8},        {7, 24, 40},        {129, 264, 72},
                                     {255, 520, 1000}, {1000, 1000, 1000}, {333, 4104, 8},
                                     {200, 232, 136},  {300, 440, 200},    {640, 2048, 7168}};
  for (int block_n : {80, 96, 112, 144, 160, 224}) {
    for (const BLayout layout : {BLayout::kNK, BLayout::kKN}) {
      if (layout == BLayout::kKN && (block_n == 80 || block_n == 112)) continue;
      SCOPED_TRACE(std::to_string(block_n) + (layout == BLayout::kKN ? " B [K, N]" : " B [N, K]"));
      GemmConfig config;
      config.block_n = block_n;
      for (const Shape& s : shapes) expect_gemm_matches(s, fresh_seed(), config, layout);
      config.sms = 7;
      expect_gemm_matches({1000, 2056, 520}, fresh_seed(), config, layout);
    }
  }
  // The library's own choice where the model takes one (the plan says so), on 132 SMs: 80 wide
  // at 640 x 2048 x 7168 with B [N, K], 96 at 768 x 2048 x 7168 with B [K, N].
  GemmConfig sms132;
  sms132.sms = 132;
  for (const auto& [s, layout, width] : {std::tuple{Shape{640, 2048, 7168}, BLayout::kNK, 80},
                                         std::tuple{Shape{768, 2048, 7168}, BLayout::kKN, 96}}) {
    const GemmPlan p = gemm_plan(s.m, s.n, s.k, sms132, layout);
    EXPECT_EQ(p.block_n, width) << p.describe();
    expect_gemm_matches(s, fresh_seed(), sms132, layout);
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
  // Forced splits of K on few CTAs: full waves, then the last wave in pieces.
  for (int i = 0; i < 16; ++i) {
    const Shape s{static_cast<int64_t>(1 + gen() % 1500),
                  static_cast<int64_t>(8 * (1 + gen() % 300)),
                  static_cast<int64_t>(8 * (1 + gen() % 1200))};
    GemmConfig config;
    config.split_k = static_cast<int>(1 + gen() % 8);
    config.sms = static_cast<int>(1 + gen() % 40);
    config.block_n = 64 * static_cast<int>(1 + gen() % 4);
    expect_gemm_matches(s, gen(), config, gen() % 2 ? BLayout::kKN : BLayout::kNK);
  }
}

// Split K: the pieces of a tile (one cluster) add up to the whole (against fp64 and cuBLAS),
// deterministically (two runs bitwise equal); decode-sized M, partial tiles and the last wave's.
TEST(Gemm, SplitKPiecesAddUp) {
  MKT_REQUIRE_GPU();
  const std::vector<Shape> shapes = {{1, 2048, 7168},  {64, 4096, 14336}, {200, 520, 1000},
                                     {129, 264, 4096}, {333, 4104, 8},    {7, 24, 520}};
  for (int split_k : {2, 3, 5, 8}) {
    for (int block_n : {64, 256}) {
      GemmConfig config;
      config.split_k = split_k;
      config.block_n = block_n;
      for (const Shape& s : shapes) {
        if (s.k > 64) EXPECT_GT(gemm_plan(s.m, s.n, s.k, config).split_k, 1);  // it does split
        expect_gemm_matches(s, fresh_seed(), config);
      }
      config.sms = 65;  // full rounds of whole tiles, then the leftover tiles in pieces
      const GemmPlan p = gemm_plan(1000, 2056, 520, config);
      EXPECT_GT(p.split_k, 1) << p.describe();
      EXPECT_GT(p.whole_tiles, 0) << p.describe();
      expect_gemm_matches({1000, 2056, 520}, fresh_seed(), config, BLayout::kKN);
    }
  }
  // The library's own choice where it splits (the plan says so).
  for (const Shape& s : std::vector<Shape>{{1, 2048, 7168}, {32, 4096, 14336}, {128, 2048, 7168}}) {
    EXPECT_GT(gemm_plan(s.m, s.n, s.k).split_k, 1) << gemm_plan(s.m, s.n, s.k).describe();
    expect_gemm_matches(s, fresh_seed());
  }
}

// 64-row tiles (one consumer warpgroup, every width) and 192-row tiles (three, widths 64 and
// 128), both B layouts: edge shapes (partial tile-rows, N and K tails), few CTAs (many tiles
// each), and split K in clusters.
TEST(Gemm, TileHeights) {
  MKT_REQUIRE_GPU();
  const std::vector<Shape> shapes = {{1, 8, 8},        {192, 8192, 1024}, {193, 264, 72},
                                     {383, 520, 1000}, {129, 4104, 136},  {1000, 1000, 1000},
                                     {64, 2056, 520},  {63, 264, 4096}};
  std::mt19937_64 gen(fresh_seed());
  for (const auto& [block_m, widths] :
       {std::pair{64, std::vector<int>{64, 128, 192, 256}}, {192, std::vector<int>{64, 128}}}) {
    for (int block_n : widths) {
      for (BLayout layout : {BLayout::kNK, BLayout::kKN}) {
        GemmConfig config;
        config.block_m = block_m;
        config.block_n = block_n;
        for (const Shape& s : shapes) {
          EXPECT_EQ(gemm_plan(s.m, s.n, s.k, config).block_m, block_m);
          expect_gemm_matches(s, gen(), config, layout);
        }
        config.sms = 7;
        expect_gemm_matches({1000, 2056, 520}, gen(), config, layout);
        for (int split_k : {2, 3, 8}) {
          GemmConfig split = config;
          split.sms = 0;
          split.split_k = split_k;
          for (const Shape& s :
               std::vector<Shape>{{block_m, 2048, 7168}, {block_m - 42, 264, 4096}}) {
            const GemmPlan p = gemm_plan(s.m, s.n, s.k, split);
            EXPECT_GT(p.split_k, 1) << p.describe();
            EXPECT_EQ(p.block_m, block_m) << p.describe();
            expect_gemm_matches(s, gen(), split, layout);
          }
        }
      }
    }
  }
  // The widths 192-row tiles do not have are refused before launch.
  GemmConfig wide;
  wide.block_m = 192;
  wide.block_n = 256;
  EXPECT_THROW(gemm_plan(192, 8192, 8192, wide), Error);
}

// A split GEMM captured in a CUDA graph (one kernel node: the pieces meet in their cluster's
// shared memory), replayed with new inputs: each replay equals a direct call bitwise.
TEST(Gemm, SplitKGraphReplays) {
  MKT_REQUIRE_GPU();
  const Shape s{16, 2048, 7168};
  ASSERT_GT(gemm_plan(s.m, s.n, s.k).split_k, 1);
  cudaStream_t stream;
  MKT_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  void *a, *b, *c, *c_direct;
  MKT_CUDA(cudaMalloc(&a, s.m * s.k * 2));
  MKT_CUDA(cudaMalloc(&b, s.n * s.k * 2));
  MKT_CUDA(cudaMalloc(&c, s.m * s.n * 2));
  MKT_CUDA(cudaMalloc(&c_direct, s.m * s.n * 2));
  cudaGraph_t graph;
  MKT_CUDA(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  gemm(a, b, c, s.m, s.n, s.k, BLayout::kNK, stream);
  MKT_CUDA(cudaStreamEndCapture(stream, &graph));
  cudaGraphExec_t exec;
  ASSERT_NO_FATAL_FAILURE(instantiate_uploaded(graph, stream, &exec));
  for (int replay = 0; replay < 3; ++replay) {
    const uint64_t seed = fresh_seed();
    fill_random_bf16(a, s.m * s.k, seed, stream);
    fill_random_bf16(b, s.n * s.k, seed ^ 0x77, stream);
    MKT_CUDA(cudaMemsetAsync(c, 0xFF, s.m * s.n * 2, stream));
    MKT_CUDA(cudaGraphLaunch(exec, stream));
    gemm(a, b, c_direct, s.m, s.n, s.k, BLayout::kNK, stream);
    EXPECT_EQ(count_different_bytes16(c, c_direct, s.m * s.n * 2, stream), 0u)
        << "replay " << replay << " differs from a direct call";
    EXPECT_EQ(count_nans_bf16(c, s.m * s.n, stream), 0u) << "replay " << replay;
  }
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  for (void* p : {a, b, c, c_direct}) cudaFree(p);
  cudaStreamDestroy(stream);
}

TEST(Gemm, RejectsBadArgumentsBeforeLaunch) {
  MKT_REQUIRE_GPU();
  void* p;
  ASSERT_EQ(cudaMalloc(&p, 1 << 20), cudaSuccess);
  char* q = static_cast<char*>(p);  // A at q, B at b, C at c: separate memory
  char* b = q + 4096;
  char* c = q + 8192;
  std::vector<char> host(1024);
  auto expect = [](auto fn, ErrorCode code, const std::string& needle) {
    expect_error(fn, code, needle);
  };
  expect([&] { gemm(q, b, c, 0, 8, 8, BLayout::kNK, nullptr); }, ErrorCode::kInvalidArgument,
         "M = 0");
  expect([&] { gemm(q, b, c, 8, 12, 8, BLayout::kNK, nullptr); }, ErrorCode::kInvalidArgument,
         "N = 12; expected a multiple of 8");
  expect([&] { gemm(q, b, c, 8, 8, 4, BLayout::kNK, nullptr); }, ErrorCode::kInvalidArgument,
         "K = 4");
  expect([&] { gemm(q + 2, b, c, 8, 8, 8, BLayout::kNK, nullptr); }, ErrorCode::kInvalidArgument,
         "A is not 16-byte aligned");
  expect([&] { gemm(q, host.data(), c, 8, 8, 8, BLayout::kNK, nullptr); },
         ErrorCode::kInvalidArgument, "B is not");
  expect([&] { gemm(q, b, c, 8, 8, 8, static_cast<BLayout>(9), nullptr); },
         ErrorCode::kInvalidArgument, "unknown B layout");
  expect([&] { gemm(q, b, q + 64, 8, 8, 8, BLayout::kNK, nullptr); }, ErrorCode::kInvalidArgument,
         "C overlaps A");
  GemmConfig bad;
  bad.block_n = 100;
  expect([&] { gemm(q, b, c, 8, 8, 8, BLayout::kNK, nullptr, bad); }, ErrorCode::kInvalidArgument,
         "block_n = 100");
  bad.block_n = 112;  // a step width B [K, N] does not take (its last 48 columns)
  expect([&] { gemm(q, b, c, 8, 8, 8, BLayout::kKN, nullptr, bad); }, ErrorCode::kInvalidArgument,
         "block_n = 112 takes 128-row tiles and K whole, and B [N, K] where it is 80 or 112");
  cudaFree(p);
}

// The compiler's resource report for every kernel instantiation: no local memory (no spills, no
// stack), and the shared memory the kernel asks for.
TEST(Gemm, KernelsDoNotSpill) {
  MKT_REQUIRE_GPU();
  const std::vector<GemmKernelResources> kernels = detail::gemm_kernel_resources();
  // plain, split K and grouped, 4 widths x 2 B layouts; plain and split K at 192 rows, 2 widths
  // x 2 layouts, and at 64 rows, 4 widths x 2 layouts; plain at the 6 step widths, B [N, K],
  // and 4 of them B [K, N] (the MoE kernels on the engine: detail::moe_kernel_resources,
  // test_moe.cpp)
  ASSERT_EQ(kernels.size(), 58u);
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
  GemmConfig step;  // a step width: the tail columns' plain stores, at the M and N edges
  step.block_n = 80;
  expect_gemm_matches({150, 200, 136}, fresh_seed(), step);
  step.block_n = 160;  // B [K, N]: the last 32 columns' own box and wgmma (64-byte swizzle)
  expect_gemm_matches({150, 200, 136}, fresh_seed(), step, BLayout::kKN);
  step.block_n = 144;  // and the last 16 (32-byte swizzle)
  expect_gemm_matches({150, 200, 136}, fresh_seed(), step, BLayout::kKN);
  GemmConfig config;
  config.block_n = 192;
  expect_gemm_matches({130, 392, 72}, fresh_seed(), config, BLayout::kKN);
  GemmConfig split;  // split K: the pushes into peers, the cluster barriers and the sums
  split.split_k = 3;
  expect_gemm_matches({70, 200, 1000}, fresh_seed(), split);
  struct Height {  // 64- and 192-row tiles: K whole, then split (B [K, N])
    int block_m, block_n, split_k;
    Shape whole, pieces;
  };
  for (const Height& h : {Height{64, 128, 4, {70, 200, 136}, {9, 136, 1000}},
                          Height{192, 64, 3, {250, 200, 136}, {190, 136, 1000}}}) {
    GemmConfig config;
    config.block_m = h.block_m;
    config.block_n = h.block_n;
    expect_gemm_matches(h.whole, fresh_seed(), config);
    config.split_k = h.split_k;
    expect_gemm_matches(h.pieces, fresh_seed(), config, BLayout::kKN);
  }
}

}  // namespace
}  // namespace mk::test
