// The GEMM engine against an fp64 reference and cuBLAS: every shape of the benchmark list, edge
// shapes (M = 1, partial tiles in M, N and K), decode shapes on the swapped tiles and random
// shapes; fresh random data, poisoned outputs (every element must be written, the bytes around C
// must stay poisoned), determinism, and argument errors.
#include <cublas_v2.h>

#include <algorithm>
#include <random>

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

// Guards around C, poisoned like C: the bytes before it, and after it 64 rows' worth (a swapped
// tile is up to 64 tokens wide: the rows >= M of its last tile) - none may be written.
constexpr int64_t kGuardBefore = 4096;
int64_t guard_after(const Shape& s) { return 64 * s.n * 2; }

void expect_gemm_matches(const Shape& s, uint64_t seed, GemmConfig config = {},
                         BLayout layout = BLayout::kNK) {
  SCOPED_TRACE(name(s) + " block_n " + std::to_string(config.block_n) + " split_k " +
               std::to_string(config.split_k) + " sms " + std::to_string(config.sms) + " tiles " +
               std::to_string(static_cast<int>(config.tiles)) +
               (layout == BLayout::kKN ? " B [K, N]" : " B [N, K]") + ": " +
               gemm_plan(s.m, s.n, s.k, layout, config).describe());
  const bool kn = layout == BLayout::kKN;
  cudaStream_t stream;
  MKT_CUDA(cudaStreamCreate(&stream));
  const int64_t c_bytes = s.m * s.n * 2, guarded = kGuardBefore + c_bytes + guard_after(s);
  void *a, *b, *c_base, *c_blas, *poison;
  MKT_CUDA(cudaMalloc(&a, s.m * s.k * 2));
  MKT_CUDA(cudaMalloc(&b, s.n * s.k * 2));
  MKT_CUDA(cudaMalloc(&c_base, guarded));
  MKT_CUDA(cudaMalloc(&c_blas, c_bytes));
  MKT_CUDA(cudaMalloc(&poison, guarded));
  void* c = static_cast<char*>(c_base) + kGuardBefore;
  fill_random_bf16(a, s.m * s.k, seed, stream);
  fill_random_bf16(b, s.n * s.k, seed ^ 0x5555, stream);
  MKT_CUDA(cudaMemsetAsync(c_base, 0xFF, guarded, stream));  // bf16 NaN everywhere
  MKT_CUDA(cudaMemsetAsync(poison, 0xFF, guarded, stream));

  gemm(a, b, c, s.m, s.n, s.k, layout, stream, config);
  cublasHandle_t h;
  ASSERT_EQ(cublasCreate(&h), CUBLAS_STATUS_SUCCESS);
  cublasSetStream(h, stream);
  cublas_gemm(h, a, b, c_blas, s.m, s.n, s.k, kn);
  MKT_CUDA(cudaStreamSynchronize(stream));
  MKT_CUDA(cudaGetLastError());

  EXPECT_EQ(count_nans_bf16(c, s.m * s.n, stream), 0u) << "elements left unwritten (or NaN)";
  EXPECT_EQ(count_different_bytes16(c_base, poison, kGuardBefore, stream), 0u)
      << "bytes before C written";
  EXPECT_EQ(
      count_different_bytes16(static_cast<char*>(c) + c_bytes, poison, guard_after(s), stream), 0u)
      << "bytes after C (rows >= M) written";
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
  for (void* p : {a, b, c_base, c_blas, poison}) cudaFree(p);
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
    config.split_k = static_cast<int>(1 + gen() % 12);
    config.sms = static_cast<int>(1 + gen() % 40);
    config.block_n = 64 * static_cast<int>(1 + gen() % 4);
    expect_gemm_matches(s, gen(), config, gen() % 2 ? BLayout::kKN : BLayout::kNK);
  }
}

// Split K: the pieces of a tile add up to the whole (against fp64 and cuBLAS), deterministically
// (two runs bitwise equal), whichever piece arrives last; decode-sized M and the last wave's.
TEST(Gemm, SplitKPiecesAddUp) {
  MKT_REQUIRE_GPU();
  const std::vector<Shape> shapes = {{1, 2048, 7168},  {64, 4096, 14336}, {200, 520, 1000},
                                     {129, 264, 4096}, {333, 4104, 8},    {7, 24, 520}};
  for (int split_k : {2, 3, 8, 32}) {
    for (int block_n : {64, 256}) {
      GemmConfig config;
      config.split_k = split_k;
      config.block_n = block_n;
      for (const Shape& s : shapes) expect_gemm_matches(s, fresh_seed(), config);
      config.sms = 7;  // full rounds of whole tiles, then the leftover tiles in pieces
      expect_gemm_matches({1000, 2056, 520}, fresh_seed(), config, BLayout::kKN);
    }
  }
  // The library's own choice where it splits (the plan says so).
  for (const Shape& s : std::vector<Shape>{{1, 2048, 7168}, {32, 4096, 14336}, {256, 2048, 7168}}) {
    const GemmPlan plan = gemm_plan(s.m, s.n, s.k, BLayout::kNK);
    EXPECT_GT(plan.split_k, 1) << plan.describe();
    expect_gemm_matches(s, fresh_seed());
  }
}

// A split GEMM captured in a CUDA graph (its scratch allocation and counter clearing are graph
// nodes), replayed with new inputs: each replay equals a direct call bitwise.
void expect_graph_replays_match(const Shape& s, const GemmConfig& config) {
  SCOPED_TRACE(name(s) + ": " + gemm_plan(s.m, s.n, s.k, BLayout::kNK, config).describe());
  cudaStream_t stream;
  MKT_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  void *a, *b, *c, *c_direct;
  MKT_CUDA(cudaMalloc(&a, s.m * s.k * 2));
  MKT_CUDA(cudaMalloc(&b, s.n * s.k * 2));
  MKT_CUDA(cudaMalloc(&c, s.m * s.n * 2));
  MKT_CUDA(cudaMalloc(&c_direct, s.m * s.n * 2));
  cudaGraph_t graph;
  MKT_CUDA(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  gemm(a, b, c, s.m, s.n, s.k, BLayout::kNK, stream, config);
  MKT_CUDA(cudaStreamEndCapture(stream, &graph));
  cudaGraphExec_t exec;
  ASSERT_NO_FATAL_FAILURE(instantiate_uploaded(graph, stream, &exec));
  for (int replay = 0; replay < 3; ++replay) {
    const uint64_t seed = fresh_seed();
    fill_random_bf16(a, s.m * s.k, seed, stream);
    fill_random_bf16(b, s.n * s.k, seed ^ 0x77, stream);
    MKT_CUDA(cudaMemsetAsync(c, 0xFF, s.m * s.n * 2, stream));
    MKT_CUDA(cudaGraphLaunch(exec, stream));
    gemm(a, b, c_direct, s.m, s.n, s.k, BLayout::kNK, stream, config);
    EXPECT_EQ(count_different_bytes16(c, c_direct, s.m * s.n * 2, stream), 0u)
        << "replay " << replay << " differs from a direct call";
    EXPECT_EQ(count_nans_bf16(c, s.m * s.n, stream), 0u) << "replay " << replay;
  }
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  for (void* p : {a, b, c, c_direct}) cudaFree(p);
  cudaStreamDestroy(stream);
}

TEST(Gemm, SplitKGraphReplays) {
  MKT_REQUIRE_GPU();
  GemmConfig rows;
  rows.tiles = GemmTiles::kRows;
  ASSERT_GT(gemm_plan(16, 2048, 7168, BLayout::kNK, rows).split_k, 1);
  expect_graph_replays_match({16, 2048, 7168}, rows);
}

// Decode sizes: the tokens on the narrow side of swapped tiles (swapped_gemm.cuh) - every tokens'
// width (8, 16, 32, 64) and M inside and at the edge of each, N at and off the 128-row tiles
// (520, 136, 200: a short last tile-row, and one whose second consumer lies past N), K long,
// medium and short (72: a partial k-block); K whole and in pieces; poisoned C and guards.
TEST(Gemm, SwappedDecodeShapes) {
  MKT_REQUIRE_GPU();
  for (int64_t m : {1, 2, 7, 8, 9, 16, 31, 33, 64}) {
    for (int64_t n : {2048, 520, 136, 200}) {
      for (int64_t k : {7168, 4096, 72}) {
        for (int split_k : {1, 4}) {
          GemmConfig config;
          config.split_k = split_k;
          const GemmPlan plan = gemm_plan(m, n, k, BLayout::kNK, config);
          ASSERT_TRUE(plan.swapped) << plan.describe();
          EXPECT_EQ(plan.split_k, split_k == 1 ? 1 : std::min<int64_t>(split_k, (k + 63) / 64));
          expect_gemm_matches({m, n, k}, fresh_seed(), config);
        }
      }
    }
  }
  // The library's own choice: split over the SMs.
  for (const Shape& s : std::vector<Shape>{{1, 2048, 7168}, {1, 7168, 2048}, {16, 4096, 14336}}) {
    const GemmPlan plan = gemm_plan(s.m, s.n, s.k, BLayout::kNK);
    EXPECT_TRUE(plan.swapped && plan.split_k > 1) << plan.describe();
    expect_gemm_matches(s, fresh_seed());
  }
}

// Few CTAs: several tiles each (the epilogue buffer reused from tile to tile), full waves whole
// and the last wave's tiles in pieces.
TEST(Gemm, SwappedFewCtas) {
  MKT_REQUIRE_GPU();
  for (int split_k : {0, 1, 3}) {
    GemmConfig config;
    config.sms = 3;
    config.split_k = split_k;
    for (const Shape& s : std::vector<Shape>{
             {1, 2048, 7168}, {9, 2056, 520}, {33, 1000, 1000}, {64, 520, 72}, {7, 136, 4096}}) {
      ASSERT_TRUE(gemm_plan(s.m, s.n, s.k, BLayout::kNK, config).swapped);
      expect_gemm_matches(s, fresh_seed(), config);
    }
  }
}

// Asked for above 64 tokens (GemmTiles::kTokensNarrow): several tiles of 64 tokens.
TEST(Gemm, SwappedAbove64Tokens) {
  MKT_REQUIRE_GPU();
  GemmConfig config;
  config.tiles = GemmTiles::kTokensNarrow;
  for (const Shape& s : std::vector<Shape>{{65, 2048, 7168}, {128, 520, 4096}, {200, 136, 72}}) {
    for (int split_k : {0, 1, 3}) {
      config.split_k = split_k;
      expect_gemm_matches(s, fresh_seed(), config);
    }
  }
}

TEST(Gemm, SwappedGraphReplays) {
  MKT_REQUIRE_GPU();
  const GemmConfig library_choice;
  ASSERT_GT(gemm_plan(16, 2048, 7168, BLayout::kNK).split_k, 1);
  expect_graph_replays_match({16, 2048, 7168}, library_choice);  // split K
  GemmConfig whole;
  whole.split_k = 1;
  expect_graph_replays_match({1, 520, 4096}, whole);
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
  bad.block_n = 96;
  expect([&] { gemm(q, b, c, 8, 8, 8, BLayout::kNK, nullptr, bad); }, ErrorCode::kInvalidArgument,
         "block_n = 96");
  GemmConfig narrow;
  narrow.tiles = GemmTiles::kTokensNarrow;
  expect([&] { gemm(q, b, c, 8, 8, 8, BLayout::kKN, nullptr, narrow); },
         ErrorCode::kInvalidArgument, "tiles = kTokensNarrow needs B [N, K]");
  cudaFree(p);
}

// The compiler's resource report for every kernel instantiation: no local memory (no spills, no
// stack), and the shared memory the kernel asks for.
TEST(Gemm, KernelsDoNotSpill) {
  MKT_REQUIRE_GPU();
  const std::vector<GemmKernelResources> kernels = detail::gemm_kernel_resources();
  // plain, split K and grouped, 4 widths x 2 B layouts; swapped, whole and split, 4 widths
  ASSERT_EQ(kernels.size(), 32u);
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
  GemmConfig split;  // split K: the slices, the counters and the last piece's sum
  split.split_k = 3;
  expect_gemm_matches({70, 200, 1000}, fresh_seed(), split);
}

// The swapped tiles (tokens on the narrow side), small, for compute-sanitizer: K whole and in
// pieces, a short last tile-row, tokens across the 8-wide box edge, several tiles a CTA.
TEST(SanitizeGemm, Swapped) {
  MKT_REQUIRE_GPU();
  GemmConfig whole;
  whole.split_k = 1;
  expect_gemm_matches({1, 200, 136}, fresh_seed(), whole);
  GemmConfig split;
  split.split_k = 3;
  expect_gemm_matches({9, 136, 1000}, fresh_seed(), split);
  split.sms = 2;
  expect_gemm_matches({33, 520, 520}, fresh_seed(), split);
}

}  // namespace
}  // namespace mk::test
