// The attention engine (mk::attention) against an fp32 reference by the tolerance rule (error
// within twice that of the same computation rounded the way a bf16 implementation rounds, plus a
// small atol) and its LSE: causal and not, S_q != S_kv (bottom-right), rows that see no key,
// GQA 1/4/8 and MQA, D 64 and 128, S from 1 to 32k with tile tails, batches up to 8, a packed
// qkv layout (strides), poisoned outputs, determinism, a CUDA graph replayed on new inputs, the
// kernels' resources (no spills) and the argument errors.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "attention/attention_internal.h"
#include "attention_reference.h"
#include "gemm_reference.h"
#include "gpu_test_util.h"
#include "mkernel/attention.h"

namespace mk::test {
namespace {

uint64_t fresh_seed() { return (uint64_t{std::random_device{}()} << 32) | std::random_device{}(); }

struct Case {
  int64_t batch, seq_q, seq_kv, heads, kv_heads, head_dim;
  bool causal;
  bool packed =
      false;  // q, k, v views of one [B, S, 3, H, D] tensor (needs S_q == S_kv, H == H_kv)
};

std::string describe(const Case& c) {
  return "B" + std::to_string(c.batch) + " S" + std::to_string(c.seq_q) + "/" +
         std::to_string(c.seq_kv) + " H" + std::to_string(c.heads) + "/" +
         std::to_string(c.kv_heads) + " D" + std::to_string(c.head_dim) +
         (c.causal ? " causal" : "") + (c.packed ? " packed qkv" : "");
}

AttentionProblem problem_of(const Case& c) {
  AttentionProblem p;
  p.batch = c.batch;
  p.seq_q = c.seq_q;
  p.seq_kv = c.seq_kv;
  p.heads = c.heads;
  p.kv_heads = c.kv_heads;
  p.head_dim = c.head_dim;
  p.causal = c.causal;
  return p;
}

// Device buffers of a case, filled with fresh random data (scores spread over several units so
// that the running maximum matters), outputs poisoned.
struct Buffers {
  AttentionTensor q, k, v;
  void* storage = nullptr;
  void* o = nullptr;
  float* lse = nullptr;
  int64_t o_count = 0, lse_count = 0;

  Buffers(const Case& c, uint64_t seed, cudaStream_t s) {
    const int64_t d = c.head_dim;
    const int64_t q_count = c.batch * c.seq_q * c.heads * d;
    const int64_t kv_count = c.batch * c.seq_kv * c.kv_heads * d;
    o_count = q_count;
    lse_count = c.batch * c.heads * c.seq_q;
    const int64_t total = c.packed ? 3 * q_count : q_count + 2 * kv_count;
    cudaMalloc(&storage, total * 2);
    cudaMalloc(&o, o_count * 2);
    cudaMalloc(reinterpret_cast<void**>(&lse), lse_count * 4);
    auto* base = static_cast<char*>(storage);
    if (c.packed) {  // [B, S, 3, H, D]
      const int64_t row = 3 * c.heads * d;
      for (int i = 0; i < 3; ++i) {
        AttentionTensor& t = i == 0 ? q : i == 1 ? k : v;
        t = {base + i * c.heads * d * 2, c.seq_q * row, row, d};
      }
    } else {
      q = {base, 0, 0, 0};
      k = {base + q_count * 2, 0, 0, 0};
      v = {base + (q_count + kv_count) * 2, 0, 0, 0};
    }
    refill(c, seed, s);
  }
  void refill(const Case& c, uint64_t seed, cudaStream_t s) {
    const int64_t d = c.head_dim;
    const int64_t total =
        c.packed ? 3 * o_count : o_count + 2 * c.batch * c.seq_kv * c.kv_heads * d;
    // q and k in [-2, 2): scores of standard deviation about 1.3 at D 128; v in [-1, 1).
    fill_random_bf16_scaled(storage, total, 2.0f, seed, s);
    if (!c.packed)
      fill_random_bf16_scaled(const_cast<void*>(v.data), c.batch * c.seq_kv * c.kv_heads * d, 1.0f,
                              seed ^ 0x77, s);
    cudaMemsetAsync(o, 0xFF, o_count * 2, s);  // NaN
    cudaMemsetAsync(lse, 0xFF, lse_count * 4, s);
  }
  ~Buffers() {
    cudaFree(storage);
    cudaFree(o);
    cudaFree(lse);
  }
};

// The query rows the reference computes: all of them up to 1024, else the first and last 96 and
// 64 random ones.
std::vector<int32_t> sampled_rows(int64_t seq_q, uint64_t seed) {
  std::vector<int32_t> rows;
  if (seq_q <= 1024) {
    for (int64_t i = 0; i < seq_q; ++i) rows.push_back(static_cast<int32_t>(i));
    return rows;
  }
  for (int64_t i = 0; i < 96; ++i) rows.push_back(static_cast<int32_t>(i));
  for (int64_t i = seq_q - 96; i < seq_q; ++i) rows.push_back(static_cast<int32_t>(i));
  std::mt19937_64 gen(seed);
  std::uniform_int_distribution<int64_t> pick(96, seq_q - 97);
  for (int i = 0; i < 64; ++i) rows.push_back(static_cast<int32_t>(pick(gen)));
  return rows;
}

struct Result {
  std::vector<uint16_t> o;
  std::vector<float> lse;
};

Result download(const Buffers& buf, cudaStream_t s) {
  Result r{std::vector<uint16_t>(buf.o_count), std::vector<float>(buf.lse_count)};
  cudaMemcpyAsync(r.o.data(), buf.o, buf.o_count * 2, cudaMemcpyDeviceToHost, s);
  cudaMemcpyAsync(r.lse.data(), buf.lse, buf.lse_count * 4, cudaMemcpyDeviceToHost, s);
  cudaStreamSynchronize(s);
  return r;
}

// Our O and LSE against the reference on the sampled rows; every element written.
void check_against_reference(const Case& c, const Buffers& buf, const Result& ours, uint64_t seed,
                             cudaStream_t s) {
  const AttentionProblem p = problem_of(c);
  const std::vector<int32_t> rows = sampled_rows(c.seq_q, seed);
  const int nrows = static_cast<int>(rows.size());
  const int64_t d = c.head_dim;
  const int64_t ref_count = c.batch * nrows * c.heads * d;
  int32_t* rows_dev = nullptr;
  float *exact = nullptr, *lowp = nullptr, *lse = nullptr;
  cudaMallocAsync(reinterpret_cast<void**>(&rows_dev), nrows * 4, s);
  cudaMallocAsync(reinterpret_cast<void**>(&exact), ref_count * 4, s);
  cudaMallocAsync(reinterpret_cast<void**>(&lowp), ref_count * 4, s);
  cudaMallocAsync(reinterpret_cast<void**>(&lse), c.batch * c.heads * nrows * 4, s);
  cudaMemcpyAsync(rows_dev, rows.data(), nrows * 4, cudaMemcpyHostToDevice, s);
  attention_reference(p, buf.q, buf.k, buf.v, rows_dev, nrows, exact, lowp, lse, s);
  std::vector<float> h_exact(ref_count), h_lowp(ref_count), h_lse(c.batch * c.heads * nrows);
  cudaMemcpyAsync(h_exact.data(), exact, ref_count * 4, cudaMemcpyDeviceToHost, s);
  cudaMemcpyAsync(h_lowp.data(), lowp, ref_count * 4, cudaMemcpyDeviceToHost, s);
  cudaMemcpyAsync(h_lse.data(), lse, h_lse.size() * 4, cudaMemcpyDeviceToHost, s);
  cudaFreeAsync(rows_dev, s);
  cudaFreeAsync(exact, s);
  cudaFreeAsync(lowp, s);
  cudaFreeAsync(lse, s);
  MKT_CUDA(cudaStreamSynchronize(s));
  MKT_CUDA(cudaGetLastError());

  int64_t nan_o = 0, nan_lse = 0;
  for (uint16_t x : ours.o) nan_o += std::isnan(from_bits(x, DType::kBF16));
  for (float x : ours.lse) nan_lse += std::isnan(x);
  EXPECT_EQ(nan_o, 0) << "O elements left unwritten (or NaN)";
  EXPECT_EQ(nan_lse, 0) << "LSE elements left unwritten (or NaN)";

  double err_ours = 0, err_low = 0, err_lse = 0;
  int64_t lse_mismatch = 0;
  for (int64_t b = 0; b < c.batch; ++b) {
    for (int r = 0; r < nrows; ++r) {
      for (int64_t h = 0; h < c.heads; ++h) {
        const int64_t ref = ((b * nrows + r) * c.heads + h) * d;
        const int64_t got = ((b * c.seq_q + rows[r]) * c.heads + h) * d;
        for (int64_t j = 0; j < d; ++j) {
          const double e = h_exact[ref + j];
          err_ours = std::max(err_ours, std::abs(from_bits(ours.o[got + j], DType::kBF16) - e));
          err_low = std::max(err_low, std::abs(h_lowp[ref + j] - e));
        }
        const float want = h_lse[(b * c.heads + h) * nrows + r];
        const float have = ours.lse[(b * c.heads + h) * c.seq_q + rows[r]];
        if (std::isinf(want) || std::isinf(have)) {
          lse_mismatch += !(std::isinf(want) && std::isinf(have) && want < 0 && have < 0);
        } else {
          err_lse = std::max(err_lse, static_cast<double>(std::abs(have - want)));
        }
      }
    }
  }
  // The tolerance rule (../shared/STYLE.md).
  EXPECT_LE(err_ours, 2 * err_low + 1e-5)
      << "O error " << err_ours << ", bf16 computation's " << err_low;
  EXPECT_LE(err_lse, 1e-3) << "LSE error";
  EXPECT_EQ(lse_mismatch, 0) << "rows whose LSE should be (or is) -inf";
}

void expect_attention_matches(const Case& c, uint64_t seed, const AttentionConfig& config = {}) {
  SCOPED_TRACE(describe(c) + ": " + attention_plan(problem_of(c), config).describe());
  cudaStream_t s;
  MKT_CUDA(cudaStreamCreate(&s));
  {
    Buffers buf(c, seed, s);
    const AttentionProblem p = problem_of(c);
    attention(p, buf.q, buf.k, buf.v, buf.o, buf.lse, s, config);
    const Result first = download(buf, s);
    MKT_CUDA(cudaGetLastError());
    check_against_reference(c, buf, first, seed, s);
    // Deterministic: a second run writes the same bits.
    attention(p, buf.q, buf.k, buf.v, buf.o, buf.lse, s, config);
    const Result second = download(buf, s);
    EXPECT_TRUE(first.o == second.o) << "O differs between two runs";
    EXPECT_EQ(std::memcmp(first.lse.data(), second.lse.data(), first.lse.size() * 4), 0)
        << "LSE differs between two runs";
  }
  cudaStreamDestroy(s);
}

TEST(Attention, SmallShapes) {
  MKT_REQUIRE_GPU();
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  const Case cases[] = {
      {1, 128, 128, 1, 1, 128, false},  {1, 128, 128, 1, 1, 128, true},
      {2, 1, 1, 2, 1, 64, false},       {1, 1, 1000, 2, 2, 128, true},
      {1, 1000, 1000, 4, 4, 128, true}, {1, 1000, 1000, 4, 1, 64, false},
      {2, 300, 777, 8, 2, 128, true},   {2, 300, 777, 8, 2, 64, false},
      {1, 777, 300, 4, 4, 128, true},   {1, 777, 300, 4, 4, 64, true},
      {8, 257, 257, 2, 2, 64, false},   {3, 129, 129, 3, 3, 128, true},
  };
  for (const Case& c : cases) expect_attention_matches(c, seed);
}

TEST(Attention, GroupedQueryHeads) {
  MKT_REQUIRE_GPU();
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  for (const Case& c :
       {Case{1, 2048, 2048, 16, 4, 128, true}, Case{2, 1024, 1024, 16, 2, 64, true},
        Case{1, 1536, 1536, 8, 1, 128, false}, Case{2, 640, 640, 32, 4, 128, false}}) {
    expect_attention_matches(c, seed);
  }
}

TEST(Attention, PackedQkvStrides) {
  MKT_REQUIRE_GPU();
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  expect_attention_matches({2, 600, 600, 4, 4, 128, true, true}, seed);
  expect_attention_matches({1, 333, 333, 2, 2, 64, false, true}, seed);
}

TEST(Attention, LongSequences) {
  MKT_REQUIRE_GPU();
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  for (const Case& c :
       {Case{1, 32768, 32768, 2, 1, 128, true}, Case{1, 16384, 16384, 2, 2, 64, false},
        Case{1, 8191, 8193, 4, 4, 128, false}, Case{1, 4096, 12288, 2, 2, 128, true}}) {
    expect_attention_matches(c, seed);
  }
}

// The last wave split (AttentionPlan::split_items): few CTAs make a short last wave of long
// items on small problems - pieces of KV blocks merged, the last block partial, GQA, causal
// bottom-right, every item split (no whole wave), and tail items with empty pieces and rows
// that see no key (causal with S_q > S_kv: O = 0, LSE = -inf).
TEST(Attention, LastWaveSplit) {
  MKT_REQUIRE_GPU();
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  const std::pair<Case, int> cases[] = {
      {{1, 128, 3000, 9, 3, 128, false}, 8},   // 9 items on 8 CTAs: the last in 3 pieces
      {{1, 300, 5000, 3, 1, 64, true}, 8},     // causal, 4 pieces
      {{1, 100, 4096, 2, 2, 128, false}, 8},   // 2 items, no whole wave: 4 pieces each
      {{2, 200, 2500, 4, 2, 64, false}, 12},   // 16 items on 12 CTAs: 4 split in 2
      {{1, 2500, 2300, 3, 3, 128, true}, 40},  // 60 items: 20 in 2 pieces, some empty
  };
  for (const auto& [c, sms] : cases) {
    AttentionConfig config;
    config.sms = sms;
    const AttentionPlan plan = attention_plan(problem_of(c), config);
    EXPECT_GT(plan.split_items, 0) << describe(c) << ": " << plan.describe();
    EXPECT_GE(plan.split_pieces, 2) << describe(c) << ": " << plan.describe();
    expect_attention_matches(c, seed, config);
  }
}

// Few CTAs, so that each runs many items one after another (no last-wave split): tiles that
// see no key between tiles that do (causal with S_q > S_kv: O = 0, LSE = -inf), partial tiles,
// GQA, D 64 and 128 - the hand-over from one item to the next in the consumers and the
// producer's Q and K/V loads across it.
TEST(Attention, ManyItemsPerCta) {
  MKT_REQUIRE_GPU();
  const uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  const std::pair<Case, int> cases[] = {
      {{1, 777, 300, 4, 4, 64, true}, 5},  // 28 items on 5 CTAs, 12 of them see no key
      {{1, 777, 300, 4, 4, 128, true}, 5},
      {{2, 640, 640, 4, 2, 64, false}, 3},   // 40 items on 3 CTAs
      {{1, 1000, 1000, 2, 1, 64, true}, 4},  // diagonal blocks, the last tile partial
  };
  for (const auto& [c, sms] : cases) {
    AttentionConfig config;
    config.sms = sms;
    const AttentionPlan plan = attention_plan(problem_of(c), config);
    EXPECT_EQ(plan.split_items, 0) << describe(c) << ": " << plan.describe();
    expect_attention_matches(c, seed, config);
  }
}

// Captured once, replayed on new inputs written into the same buffers.
TEST(Attention, GraphReplaysOnNewInputs) {
  MKT_REQUIRE_GPU();
  const uint64_t seed = fresh_seed();
  const Case c{2, 700, 900, 8, 2, 128, true};
  cudaStream_t s;
  MKT_CUDA(cudaStreamCreate(&s));
  {
    Buffers buf(c, seed, s);
    MKT_CUDA(cudaStreamSynchronize(s));
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    MKT_CUDA(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
    attention(problem_of(c), buf.q, buf.k, buf.v, buf.o, buf.lse, s);
    MKT_CUDA(cudaStreamEndCapture(s, &graph));
    ASSERT_NO_FATAL_FAILURE(instantiate_uploaded(graph, s, &exec));
    for (int round = 0; round < 3; ++round) {
      buf.refill(c, seed + 1000 * round, s);
      MKT_CUDA(cudaGraphLaunch(exec, s));
      check_against_reference(c, buf, download(buf, s), seed + round, s);
    }
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
  }
  cudaStreamDestroy(s);
}

TEST(Attention, KernelsDoNotSpill) {
  MKT_REQUIRE_GPU();
  for (const GemmKernelResources& r : detail::attention_kernel_resources()) {
    EXPECT_EQ(r.local_bytes, 0) << r.name << " uses local memory (spills)";
  }
}

// Small cases for compute-sanitizer (scripts/device_run.sh sanitize).
TEST(SanitizeAttention, Small) {
  MKT_REQUIRE_GPU();
  const uint64_t seed = fresh_seed();
  expect_attention_matches({1, 200, 300, 2, 1, 128, true}, seed);
  expect_attention_matches({2, 130, 70, 2, 2, 64, false}, seed);
  // D 64 takes its blocks' masks from the producer (AttentionConfig::kProducerMasks): causal
  // diagonal blocks and a ragged tail both.
  expect_attention_matches({1, 150, 250, 2, 1, 64, true}, seed);
  AttentionConfig split;  // the last wave split: 3 items on 2 CTAs, the last in 2 pieces
  split.sms = 2;
  expect_attention_matches({1, 100, 2100, 3, 1, 128, false}, seed, split);
}

TEST(Attention, RejectsBadArguments) {
  MKT_REQUIRE_GPU();
  const Case c{1, 256, 256, 4, 2, 128, false};
  cudaStream_t s;
  MKT_CUDA(cudaStreamCreate(&s));
  {
    Buffers buf(c, 1, s);
    MKT_CUDA(cudaStreamSynchronize(s));
    AttentionProblem p = problem_of(c);
    auto run = [&](const AttentionProblem& pp, AttentionTensor q, void* o) {
      attention(pp, q, buf.k, buf.v, o, buf.lse, s);
    };
    AttentionProblem bad = p;
    bad.head_dim = 96;
    expect_error([&] { run(bad, buf.q, buf.o); }, ErrorCode::kInvalidArgument, "head_dim = 96");
    bad = p;
    bad.kv_heads = 3;
    expect_error([&] { run(bad, buf.q, buf.o); }, ErrorCode::kInvalidArgument,
                 "not a multiple of kv_heads");
    bad = p;
    bad.seq_q = 0;
    expect_error([&] { run(bad, buf.q, buf.o); }, ErrorCode::kInvalidArgument,
                 "expected each >= 1");
    AttentionTensor q = buf.q;
    q.data = static_cast<const char*>(q.data) + 2;
    expect_error([&] { run(p, q, buf.o); }, ErrorCode::kInvalidArgument, "16-byte aligned");
    q = buf.q;
    q.stride_seq = 4 * 128 + 4;
    expect_error([&] { run(p, q, buf.o); }, ErrorCode::kInvalidArgument, "seq stride");
    expect_error([&] { run(p, buf.q, const_cast<void*>(buf.q.data)); }, ErrorCode::kInvalidArgument,
                 "o");
    std::vector<float> host(16);
    expect_error([&] { run(p, {host.data()}, buf.o); }, ErrorCode::kInvalidArgument, "q");
    // Nothing was written: O and LSE still hold the poison.
    EXPECT_EQ(count_nans_bf16(buf.o, buf.o_count, s), static_cast<uint64_t>(buf.o_count));
  }
  cudaStreamDestroy(s);
}

}  // namespace
}  // namespace mk::test
