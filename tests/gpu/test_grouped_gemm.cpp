// Grouped GEMM (mk::grouped_gemm) against the plain GEMM engine on each group (bitwise: the same
// tiles, the same K order) and against the fp64 product (tolerance rule: within twice cuBLAS's
// error): empty groups, groups of 1, 127, 128, 129 rows, random sizes, both B layouts, every tile
// width; rows past the groups' total stay untouched; the padded layout (groups from multiples of
// 128 rows, the padding untouched) and the masked layout ([G, capacity, K]); a
// CUDA graph replayed with the row counts changed on the device between replays; argument
// errors.
#include <algorithm>
#include <numeric>
#include <random>

#include "gemm/gemm_internal.h"
#include "gemm_reference.h"
#include "gpu_test_util.h"
#include "mkernel/gemm.h"

namespace mk::test {
namespace {

uint64_t fresh_seed() { return (uint64_t{std::random_device{}()} << 32) | std::random_device{}(); }

struct Grouped {
  std::vector<int32_t> rows;  // M_g
  int64_t n, k;
  BLayout layout;
  int block_n;          // 0 = heuristic
  bool padded = false;  // GroupedLayout::kPadded: each group from a multiple of 128 rows
};

int64_t taken_rows(const Grouped& c, int64_t m) {
  return c.padded ? (m + kGroupedRowBlock - 1) / kGroupedRowBlock * kGroupedRowBlock : m;
}

std::string describe(const Grouped& c) {
  std::string s = "groups {";
  for (std::size_t i = 0; i < c.rows.size() && i < 12; ++i)
    s += (i ? "," : "") + std::to_string(c.rows[i]);
  return s + (c.rows.size() > 12 ? ",...}" : "}") + " N " + std::to_string(c.n) + " K " +
         std::to_string(c.k) + (c.layout == BLayout::kKN ? " B [K, N]" : " B [N, K]") +
         " block_n " + std::to_string(c.block_n) + (c.padded ? " padded" : "");
}

// Checks C's groups against the plain engine and fp64, and the rows past the total.
void check_groups(const Grouped& c, const void* a, const void* b, const void* out, int64_t max_rows,
                  cublasHandle_t blas, cudaStream_t stream, uint64_t seed,
                  const std::string& what) {
  const bool kn = c.layout == BLayout::kKN;
  // The same tile width as the grouped launch (its heuristic sees max_rows): same tiles, same bits.
  GemmConfig plain;
  int sms = 0;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  plain.block_n = gemm_engine::pick_block_n(c.block_n, max_rows, c.n, sms, "test");
  plain.split_k = 1;  // K whole, as the grouped GEMM computes it
  int64_t row = 0;
  void *ref = nullptr, *ref_blas = nullptr;
  cudaMallocAsync(&ref, std::max<int64_t>(max_rows, 1) * c.n * 2, stream);
  cudaMallocAsync(&ref_blas, std::max<int64_t>(max_rows, 1) * c.n * 2, stream);
  for (std::size_t g = 0; g < c.rows.size(); ++g) {
    const int64_t m = std::max(c.rows[g], 0);
    if (m == 0) continue;
    const char* a_g = static_cast<const char*>(a) + row * c.k * 2;
    const char* b_g = static_cast<const char*>(b) + static_cast<int64_t>(g) * c.n * c.k * 2;
    const char* out_g = static_cast<const char*>(out) + row * c.n * 2;
    gemm(a_g, b_g, ref, m, c.n, c.k, c.layout, stream, plain);
    EXPECT_EQ(count_different_bytes16(out_g, ref, m * c.n * 2, stream), 0u)
        << what << ": group " << g << " (" << m << " rows) differs from the plain engine";
    cublas_gemm(blas, a_g, b_g, ref_blas, m, c.n, c.k, kn);
    const SampledErrors err =
        sampled_errors(out_g, ref_blas, a_g, b_g, m, c.n, c.k, kn, seed + g, stream);
    EXPECT_LE(err.ours, 2 * err.cublas + 1e-6)
        << what << ": group " << g << " error " << err.ours << ", cuBLAS " << err.cublas;
    if (taken_rows(c, m) > m) {  // the padding after the group: untouched
      EXPECT_EQ(count_nans_bf16(out_g + m * c.n * 2, (taken_rows(c, m) - m) * c.n, stream),
                static_cast<uint64_t>((taken_rows(c, m) - m) * c.n))
          << what << ": group " << g << "'s padding rows were written";
    }
    row += taken_rows(c, m);
  }
  if (row < max_rows) {  // untouched: still the poison (bf16 NaN)
    EXPECT_EQ(count_nans_bf16(static_cast<const char*>(out) + row * c.n * 2, (max_rows - row) * c.n,
                              stream),
              static_cast<uint64_t>((max_rows - row) * c.n))
        << what << ": rows past the groups' total were written";
  }
  cudaFreeAsync(ref, stream);
  cudaFreeAsync(ref_blas, stream);
  cudaStreamSynchronize(stream);
}

void expect_grouped(const Grouped& c, uint64_t seed) {
  const std::string what = describe(c);
  SCOPED_TRACE(what);
  int64_t total = 0;
  for (int32_t r : c.rows) total += taken_rows(c, std::max(r, 0));
  const int64_t max_rows = total + 37;  // room past the total: must stay untouched
  const int groups = static_cast<int>(c.rows.size());
  cudaStream_t stream;
  MKT_CUDA(cudaStreamCreate(&stream));
  void *a, *b, *out;
  int32_t* rows_dev;
  MKT_CUDA(cudaMalloc(&a, max_rows * c.k * 2));
  MKT_CUDA(cudaMalloc(&b, groups * c.n * c.k * 2));
  MKT_CUDA(cudaMalloc(&out, max_rows * c.n * 2));
  MKT_CUDA(cudaMalloc(reinterpret_cast<void**>(&rows_dev), groups * sizeof(int32_t)));
  MKT_CUDA(cudaMemcpy(rows_dev, c.rows.data(), groups * sizeof(int32_t), cudaMemcpyHostToDevice));
  fill_random_bf16(a, max_rows * c.k, seed, stream);
  fill_random_bf16(b, groups * c.n * c.k, seed ^ 0x5151, stream);
  MKT_CUDA(cudaMemsetAsync(out, 0xFF, max_rows * c.n * 2, stream));
  GemmConfig config;
  config.block_n = c.block_n;
  grouped_gemm(a, b, out, rows_dev, groups, max_rows, c.n, c.k, c.layout, stream, config,
               c.padded ? GroupedLayout::kPadded : GroupedLayout::kContiguous);
  MKT_CUDA(cudaStreamSynchronize(stream));
  MKT_CUDA(cudaGetLastError());
  cublasHandle_t blas;
  ASSERT_EQ(cublasCreate(&blas), CUBLAS_STATUS_SUCCESS);
  cublasSetStream(blas, stream);
  check_groups(c, a, b, out, max_rows, blas, stream, seed, what);
  cublasDestroy(blas);
  for (void* p : {a, b, out}) cudaFree(p);
  cudaFree(rows_dev);
  cudaStreamDestroy(stream);
}

TEST(GroupedGemm, EdgeGroups) {
  MKT_REQUIRE_GPU();
  for (int w : {64, 128, 192, 256}) {
    expect_grouped({{0}, 64, 64, BLayout::kNK, w}, fresh_seed());
    expect_grouped({{1}, 8, 8, BLayout::kNK, w}, fresh_seed());
    expect_grouped({{127, 128, 129}, 264, 136, BLayout::kNK, w}, fresh_seed());
    expect_grouped({{0, 1000, 0, 300, -5}, 520, 1000, BLayout::kKN, w}, fresh_seed());
  }
}

TEST(GroupedGemm, RandomGroups) {
  MKT_REQUIRE_GPU();
  std::mt19937_64 gen(fresh_seed());
  for (int i = 0; i < 6; ++i) {
    std::vector<int32_t> rows(1 + gen() % 16);
    for (auto& r : rows) r = static_cast<int32_t>(gen() % 5 == 0 ? 0 : gen() % 700);
    expect_grouped(
        {rows, static_cast<int64_t>(8 * (1 + gen() % 200)),
         static_cast<int64_t>(8 * (1 + gen() % 200)), gen() % 2 ? BLayout::kKN : BLayout::kNK, 0},
        gen());
  }
}

// moe_dispatch's padded layout: each group from a multiple of 128 rows, the padding untouched.
TEST(GroupedGemm, PaddedLayout) {
  MKT_REQUIRE_GPU();
  for (int w : {0, 64, 256}) {
    Grouped c{{0, 1, 127, 128, 129, 300, 0, 5}, 264, 200, BLayout::kNK, w};
    c.padded = true;
    expect_grouped(c, fresh_seed());
    c.layout = BLayout::kKN;
    c.rows = {40, 0, 0, 257};
    expect_grouped(c, fresh_seed());
  }
}

// MoE-like: 64 experts, ~4096 tokens routed unevenly, N 2048 and K 1024 (an expert's w1 slice).
TEST(GroupedGemm, MoeShape) {
  MKT_REQUIRE_GPU();
  std::mt19937_64 gen(fresh_seed());
  std::vector<int32_t> rows(64);
  for (auto& r : rows) r = static_cast<int32_t>(gen() % 129);
  expect_grouped({rows, 2048, 1024, BLayout::kNK, 0}, gen());
}

// One captured launch, replayed with the row counts rewritten on the device in between (as an
// MoE router would): every replay follows its counts.
// The grouped GEMM with the caller's tables (what the MoE ops run across nodes), the same buffer
// for two calls and poisoned before the first: the prep kernel rewrites the tables and zeroes the
// tile counter (dynamic tiles) every call - else a call would start its CTAs past the tiles.
TEST(GroupedGemm, CallerTablesReused) {
  MKT_REQUIRE_GPU();
  const Grouped c{{300, 0, 7, 1200, 129, 64, 0, 513, 2000, 1}, 1024, 512, BLayout::kNK, 0};
  const std::string what = describe(c);
  int64_t total = 0;
  for (int32_t r : c.rows) total += r;
  const int64_t max_rows = total + 37;
  const int groups = static_cast<int>(c.rows.size());
  cudaStream_t stream;
  MKT_CUDA(cudaStreamCreate(&stream));
  void *a, *b, *out, *tables;
  int32_t* rows_dev;
  MKT_CUDA(cudaMalloc(&a, max_rows * c.k * 2));
  MKT_CUDA(cudaMalloc(&b, groups * c.n * c.k * 2));
  MKT_CUDA(cudaMalloc(&out, max_rows * c.n * 2));
  MKT_CUDA(cudaMalloc(&tables, gemm_engine::grouped_tables_bytes(groups)));
  MKT_CUDA(cudaMemset(tables, 0x7F, gemm_engine::grouped_tables_bytes(groups)));
  MKT_CUDA(cudaMalloc(reinterpret_cast<void**>(&rows_dev), groups * sizeof(int32_t)));
  MKT_CUDA(cudaMemcpy(rows_dev, c.rows.data(), groups * sizeof(int32_t), cudaMemcpyHostToDevice));
  cublasHandle_t blas;
  ASSERT_EQ(cublasCreate(&blas), CUBLAS_STATUS_SUCCESS);
  cublasSetStream(blas, stream);
  for (int call = 0; call < 2; ++call) {
    const uint64_t seed = fresh_seed();
    fill_random_bf16(a, max_rows * c.k, seed, stream);
    fill_random_bf16(b, groups * c.n * c.k, seed ^ 0x5151, stream);
    MKT_CUDA(cudaMemsetAsync(out, 0xFF, max_rows * c.n * 2, stream));
    gemm_engine::grouped_gemm(a, b, out, rows_dev, groups, max_rows, c.n, c.k, c.layout, stream,
                              GemmConfig{}, GroupedLayout::kContiguous,
                              static_cast<int32_t*>(tables));
    MKT_CUDA(cudaStreamSynchronize(stream));
    MKT_CUDA(cudaGetLastError());
    check_groups(c, a, b, out, max_rows, blas, stream, seed,
                 what + ", call " + std::to_string(call + 1));
  }
  cublasDestroy(blas);
  for (void* p : {a, b, out, tables}) cudaFree(p);
  cudaFree(rows_dev);
  cudaStreamDestroy(stream);
}

TEST(GroupedGemm, GraphReplayWithDeviceCounts) {
  MKT_REQUIRE_GPU();
  const int groups = 5, replays = 20;
  const int64_t n = 136, k = 200, max_rows = 900;
  std::mt19937_64 gen(fresh_seed());
  std::vector<std::vector<int32_t>> counts(replays, std::vector<int32_t>(groups));
  for (auto& c : counts) {
    int64_t left = max_rows;
    for (auto& r : c) {
      r = static_cast<int32_t>(gen() % std::min<int64_t>(left + 1, 300));
      left -= r;
    }
  }
  cudaStream_t stream;
  MKT_CUDA(cudaStreamCreate(&stream));
  void *a, *b, *out, *history;
  int32_t *rows_dev, *all_counts;
  MKT_CUDA(cudaMalloc(&a, max_rows * k * 2));
  MKT_CUDA(cudaMalloc(&b, groups * n * k * 2));
  MKT_CUDA(cudaMalloc(&out, max_rows * n * 2));
  MKT_CUDA(cudaMalloc(&history, replays * max_rows * n * 2));
  MKT_CUDA(cudaMalloc(reinterpret_cast<void**>(&rows_dev), groups * sizeof(int32_t)));
  MKT_CUDA(cudaMalloc(reinterpret_cast<void**>(&all_counts), replays * groups * sizeof(int32_t)));
  std::vector<int32_t> flat;
  for (const auto& c : counts) flat.insert(flat.end(), c.begin(), c.end());
  MKT_CUDA(
      cudaMemcpy(all_counts, flat.data(), flat.size() * sizeof(int32_t), cudaMemcpyHostToDevice));
  const uint64_t seed = gen();
  fill_random_bf16(a, max_rows * k, seed, stream);
  fill_random_bf16(b, groups * n * k, seed ^ 77, stream);
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  MKT_CUDA(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  grouped_gemm(a, b, out, rows_dev, groups, max_rows, n, k, BLayout::kNK, stream);
  MKT_CUDA(cudaStreamEndCapture(stream, &graph));
  ASSERT_NO_FATAL_FAILURE(instantiate_uploaded(graph, stream, &exec));
  for (int i = 0; i < replays; ++i) {
    MKT_CUDA(cudaMemcpyAsync(rows_dev, all_counts + i * groups, groups * sizeof(int32_t),
                             cudaMemcpyDeviceToDevice, stream));
    MKT_CUDA(cudaMemsetAsync(out, 0xFF, max_rows * n * 2, stream));
    MKT_CUDA(cudaGraphLaunch(exec, stream));
    MKT_CUDA(cudaMemcpyAsync(static_cast<char*>(history) + i * max_rows * n * 2, out,
                             max_rows * n * 2, cudaMemcpyDeviceToDevice, stream));
  }
  MKT_CUDA(cudaStreamSynchronize(stream));
  cublasHandle_t blas;
  ASSERT_EQ(cublasCreate(&blas), CUBLAS_STATUS_SUCCESS);
  cublasSetStream(blas, stream);
  for (int i = 0; i < replays; ++i) {
    check_groups({counts[i], n, k, BLayout::kNK, 0}, a, b,
                 static_cast<char*>(history) + i * max_rows * n * 2, max_rows, blas, stream,
                 seed + i, "replay " + std::to_string(i));
  }
  cublasDestroy(blas);
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  for (void* p : {a, b, out, history}) cudaFree(p);
  cudaFree(rows_dev);
  cudaFree(all_counts);
  cudaStreamDestroy(stream);
}

// The masked layout (decode): A [G, capacity, K], C [G, capacity, N], group g's first M_g rows
// of its block used, counts clamped to the capacity. Each group against the plain engine
// (bitwise) and fp64 (tolerance rule); every row past a group's count stays poisoned.
void expect_masked(const std::vector<int32_t>& counts, int64_t capacity, int64_t n, int64_t k,
                   BLayout layout, int block_n, uint64_t seed) {
  std::string what = "masked, capacity " + std::to_string(capacity) + ", " +
                     describe({counts, n, k, layout, block_n});
  SCOPED_TRACE(what);
  const int groups = static_cast<int>(counts.size());
  const int64_t total = groups * capacity;
  const bool kn = layout == BLayout::kKN;
  cudaStream_t stream;
  MKT_CUDA(cudaStreamCreate(&stream));
  void *a, *b, *out, *ref, *ref_blas;
  int32_t* rows_dev;
  MKT_CUDA(cudaMalloc(&a, total * k * 2));
  MKT_CUDA(cudaMalloc(&b, groups * n * k * 2));
  MKT_CUDA(cudaMalloc(&out, total * n * 2));
  MKT_CUDA(cudaMalloc(&ref, capacity * n * 2));
  MKT_CUDA(cudaMalloc(&ref_blas, capacity * n * 2));
  MKT_CUDA(cudaMalloc(reinterpret_cast<void**>(&rows_dev), groups * sizeof(int32_t)));
  MKT_CUDA(cudaMemcpy(rows_dev, counts.data(), groups * sizeof(int32_t), cudaMemcpyHostToDevice));
  fill_random_bf16(a, total * k, seed, stream);
  fill_random_bf16(b, groups * n * k, seed ^ 0x5151, stream);
  MKT_CUDA(cudaMemsetAsync(out, 0xFF, total * n * 2, stream));
  GemmConfig config;
  config.block_n = block_n;
  grouped_gemm(a, b, out, rows_dev, groups, capacity, n, k, layout, stream, config,
               GroupedLayout::kMasked);
  MKT_CUDA(cudaStreamSynchronize(stream));
  MKT_CUDA(cudaGetLastError());
  cublasHandle_t blas;
  ASSERT_EQ(cublasCreate(&blas), CUBLAS_STATUS_SUCCESS);
  cublasSetStream(blas, stream);
  int sms = 0;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  GemmConfig plain;  // the grouped launch's width (its heuristic sees all the blocks' rows)
  plain.block_n = gemm_engine::pick_block_n(block_n, total, n, sms, "test");
  plain.split_k = 1;
  for (int g = 0; g < groups; ++g) {
    const int64_t m = std::clamp<int64_t>(counts[g], 0, capacity);
    const char* a_g = static_cast<const char*>(a) + g * capacity * k * 2;
    const char* b_g = static_cast<const char*>(b) + static_cast<int64_t>(g) * n * k * 2;
    const char* out_g = static_cast<const char*>(out) + g * capacity * n * 2;
    if (m > 0) {
      gemm(a_g, b_g, ref, m, n, k, layout, stream, plain);
      EXPECT_EQ(count_different_bytes16(out_g, ref, m * n * 2, stream), 0u)
          << "group " << g << " (" << m << " rows) differs from the plain engine";
      cublas_gemm(blas, a_g, b_g, ref_blas, m, n, k, kn);
      const SampledErrors err =
          sampled_errors(out_g, ref_blas, a_g, b_g, m, n, k, kn, seed + g, stream);
      EXPECT_LE(err.ours, 2 * err.cublas + 1e-6)
          << "group " << g << " error " << err.ours << ", cuBLAS " << err.cublas;
    }
    if (m < capacity) {
      EXPECT_EQ(count_nans_bf16(out_g + m * n * 2, (capacity - m) * n, stream),
                static_cast<uint64_t>((capacity - m) * n))
          << "group " << g << ": rows past its count " << m << " were written";
    }
  }
  cublasDestroy(blas);
  for (void* p : {a, b, out, ref, ref_blas}) cudaFree(p);
  cudaFree(rows_dev);
  cudaStreamDestroy(stream);
}

TEST(GroupedGemm, MaskedLayout) {
  MKT_REQUIRE_GPU();
  // Empty groups, counts past the capacity and negative ones (clamped), partial tiles.
  for (int w : {0, 64, 256}) {
    expect_masked({0, 1, 127, 128, 129, 300, -4}, 200, 264, 136, BLayout::kNK, w, fresh_seed());
    expect_masked({5, 0, 0, 64}, 64, 520, 1000, BLayout::kKN, w, fresh_seed());
  }
  // Decode-like: 32 experts, capacity 64, most nearly empty, one with most of the tokens.
  std::mt19937_64 gen(fresh_seed());
  std::vector<int32_t> counts(32);
  for (auto& r : counts) r = static_cast<int32_t>(gen() % 3 == 0 ? 0 : gen() % 9);
  counts[gen() % 32] = 64;
  expect_masked(counts, 64, 2048, 1024, BLayout::kNK, 0, gen());
}

TEST(GroupedGemm, RejectsBadArgumentsBeforeLaunch) {
  MKT_REQUIRE_GPU();
  void* p;
  ASSERT_EQ(cudaMalloc(&p, 1 << 20), cudaSuccess);
  char* q = static_cast<char*>(p);
  auto* rows = reinterpret_cast<int32_t*>(q + 65536);
  std::vector<int32_t> host_rows(4);
  expect_error([&] { grouped_gemm(q, q, q, rows, 0, 8, 8, 8, BLayout::kNK, nullptr); },
               ErrorCode::kInvalidArgument, "groups = 0");
  expect_error([&] { grouped_gemm(q, q, q, rows, 4, 0, 8, 8, BLayout::kNK, nullptr); },
               ErrorCode::kInvalidArgument, "max_rows = 0");
  expect_error([&] { grouped_gemm(q, q, q, rows, 4, 8, 12, 8, BLayout::kNK, nullptr); },
               ErrorCode::kInvalidArgument, "N = 12");
  expect_error([&] { grouped_gemm(q, q, q, host_rows.data(), 4, 8, 8, 8, BLayout::kNK, nullptr); },
               ErrorCode::kInvalidArgument, "group_rows");
  expect_error([&] { grouped_gemm(q + 2, q, q, rows, 4, 8, 8, 8, BLayout::kNK, nullptr); },
               ErrorCode::kInvalidArgument, "A is not 16-byte aligned");
  expect_error(
      [&] {
        grouped_gemm(q, q, q, rows, 4, 0, 8, 8, BLayout::kNK, nullptr, {}, GroupedLayout::kMasked);
      },
      ErrorCode::kInvalidArgument, "rows (the capacity of a group) = 0");
  expect_error(
      [&] {
        grouped_gemm(q, q, q, rows, 65536, 1 << 16, 8, 8, BLayout::kNK, nullptr, {},
                     GroupedLayout::kMasked);
      },
      ErrorCode::kInvalidArgument, "groups x rows");
  expect_error(
      [&] {
        grouped_gemm(q, q, q, rows, 4, 8, 8, 8, BLayout::kNK, nullptr, {},
                     static_cast<GroupedLayout>(7));
      },
      ErrorCode::kInvalidArgument, "unknown grouped layout");
  cudaFree(p);
}

TEST(SanitizeGroupedGemm, Small) {
  MKT_REQUIRE_GPU();
  expect_grouped({{0, 70, 130, 1}, 136, 72, BLayout::kNK, 0}, fresh_seed());
  expect_grouped({{65, 0, 3}, 200, 64, BLayout::kKN, 192}, fresh_seed());
  expect_masked({0, 3, 70, -1}, 64, 136, 72, BLayout::kNK, 0, fresh_seed());
}

}  // namespace
}  // namespace mk::test
