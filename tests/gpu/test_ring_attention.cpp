// ring_attention (mkernel/attention.h) with ranks as threads of one process (sharing the GPU when
// there are fewer GPUs than ranks): worlds 1, 2, 4 and 8, causal (zigzag shards) and not
// (contiguous shards), GQA, D 64 and 128, S_local not a multiple of the tile. Every rank's share
// of one full sequence goes in; the outputs, put back in sequence order, must match the fp32
// reference of full-sequence attention by the tolerance rule (error within twice that of the
// bf16-rounded computation), and the LSE within 1e-3. Also: a second call writes the same bits;
// 100 graph replays with new inputs written into the captured buffers, checked against eager
// calls bit for bit; a missing rank (time limit); refusals before launch.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "attention_reference.h"
#include "collective_checks.h"
#include "gemm_reference.h"
#include "gpu_test_util.h"
#include "mkernel/attention.h"

namespace mk::test {
namespace {

uint64_t fresh_seed() { return (uint64_t{std::random_device{}()} << 32) | std::random_device{}(); }

struct RingCase {
  int64_t batch, seq_local, heads, kv_heads, head_dim;
  bool causal;
  int sms = 0;         // AttentionConfig::sms (few CTAs: long rounds, copies racing the compute)
  int sms_step = 0;    // rank r runs with sms + r * sms_step CTAs (ranks with different grids)
  int late_rank = -1;  // this rank enqueues each call 50 ms after the others (its stream's work
                       // queued behind everything theirs holds)
};

std::string describe(const RingCase& c, int world) {
  return "world " + std::to_string(world) + " B" + std::to_string(c.batch) + " S_local " +
         std::to_string(c.seq_local) + " H" + std::to_string(c.heads) + "/" +
         std::to_string(c.kv_heads) + " D" + std::to_string(c.head_dim) +
         (c.causal ? " causal (zigzag)" : "") + (c.sms ? " sms " + std::to_string(c.sms) : "") +
         (c.sms_step ? " + " + std::to_string(c.sms_step) + " x rank" : "") +
         (c.late_rank >= 0 ? ", rank " + std::to_string(c.late_rank) + " late" : "");
}

AttentionProblem local_problem(const RingCase& c) {
  AttentionProblem p;
  p.batch = c.batch;
  p.seq_q = p.seq_kv = c.seq_local;
  p.heads = c.heads;
  p.kv_heads = c.kv_heads;
  p.head_dim = c.head_dim;
  p.causal = c.causal;
  return p;
}

// Where rank r's local rows [part * len, (part + 1) * len) sit in the full sequence.
struct Shard {
  int parts;
  int64_t len;
  int64_t first(int world, int rank, int part) const {
    if (parts == 1) return rank * len;
    return (part == 0 ? rank : 2 * world - 1 - rank) * len;
  }
};
Shard shard_of(const RingCase& c) {
  return c.causal ? Shard{2, c.seq_local / 2} : Shard{1, c.seq_local};
}

// Copies rows between a full [B, S, heads, D] tensor and a rank's [B, S_local, heads, D] shard.
void copy_shard(void* local, const void* full, const RingCase& c, int world, int rank,
                int64_t heads, bool to_full, cudaStream_t s) {
  const Shard sh = shard_of(c);
  const int64_t row = heads * c.head_dim * 2, full_s = world * c.seq_local;
  for (int64_t b = 0; b < c.batch; ++b) {
    for (int part = 0; part < sh.parts; ++part) {
      char* l = static_cast<char*>(local) + (b * c.seq_local + part * sh.len) * row;
      char* f = static_cast<char*>(const_cast<void*>(full)) +
                (b * full_s + sh.first(world, rank, part)) * row;
      cudaMemcpyAsync(to_full ? f : l, to_full ? l : f, sh.len * row, cudaMemcpyDefault, s);
    }
  }
}
// The same for LSE: [B, H, S_local] -> [B, H, S].
void copy_lse_to_full(float* full, const float* local, const RingCase& c, int world, int rank,
                      cudaStream_t s) {
  const Shard sh = shard_of(c);
  const int64_t full_s = world * c.seq_local;
  for (int64_t bh = 0; bh < c.batch * c.heads; ++bh) {
    for (int part = 0; part < sh.parts; ++part) {
      cudaMemcpyAsync(full + bh * full_s + sh.first(world, rank, part),
                      local + bh * c.seq_local + part * sh.len, sh.len * 4, cudaMemcpyDefault, s);
    }
  }
}

struct Local {
  void *q = nullptr, *k = nullptr, *v = nullptr, *o = nullptr;
  float* lse = nullptr;
  int64_t q_count, kv_count;
  explicit Local(const RingCase& c) {
    q_count = c.batch * c.seq_local * c.heads * c.head_dim;
    kv_count = c.batch * c.seq_local * c.kv_heads * c.head_dim;
    cudaMalloc(&q, q_count * 2);
    cudaMalloc(&k, kv_count * 2);
    cudaMalloc(&v, kv_count * 2);
    cudaMalloc(&o, q_count * 2);
    cudaMalloc(reinterpret_cast<void**>(&lse), c.batch * c.heads * c.seq_local * 4);
  }
  ~Local() {
    cudaFree(q);
    cudaFree(k);
    cudaFree(v);
    cudaFree(o);
    cudaFree(lse);
  }
  // q, k and v random at scale 1, the same on every rank (seeds 1, 2, 3).
  void fill(cudaStream_t s) const {
    fill_random_bf16_scaled(q, q_count, 1.0f, 1, s);
    fill_random_bf16_scaled(k, kv_count, 1.0f, 2, s);
    fill_random_bf16_scaled(v, kv_count, 1.0f, 3, s);
  }
  void run(Communicator& comm, const RingCase& c, void* ws, cudaStream_t s) const {
    if (comm.rank() == c.late_rank) std::this_thread::sleep_for(std::chrono::milliseconds(50));
    AttentionConfig config;
    config.sms = c.sms + comm.rank() * c.sms_step;
    ring_attention(comm, local_problem(c), {q}, {k}, {v}, o, lse, ws, s, config);
  }
};

void expect_ring_matches(int world, const RingCase& c, uint64_t seed,
                         const CommOptions& options = {}) {
  SCOPED_TRACE(describe(c, world) + ", seed " + std::to_string(seed));
  const int64_t full_s = world * c.seq_local;
  const int64_t q_count = c.batch * full_s * c.heads * c.head_dim;
  const int64_t kv_count = c.batch * full_s * c.kv_heads * c.head_dim;
  void *q, *k, *v, *o;
  float* lse;
  MKT_CUDA(cudaMalloc(&q, q_count * 2));
  MKT_CUDA(cudaMalloc(&k, kv_count * 2));
  MKT_CUDA(cudaMalloc(&v, kv_count * 2));
  MKT_CUDA(cudaMalloc(&o, q_count * 2));
  MKT_CUDA(cudaMalloc(reinterpret_cast<void**>(&lse), c.batch * c.heads * full_s * 4));
  fill_random_bf16_scaled(q, q_count, 2.0f, seed, nullptr);
  fill_random_bf16_scaled(k, kv_count, 2.0f, seed ^ 0x11, nullptr);
  fill_random_bf16_scaled(v, kv_count, 1.0f, seed ^ 0x22, nullptr);
  MKT_CUDA(cudaMemset(o, 0xFF, q_count * 2));
  MKT_CUDA(cudaMemset(lse, 0xFF, c.batch * c.heads * full_s * 4));
  MKT_CUDA(cudaDeviceSynchronize());

  run_in_process(
      world,
      [&](Communicator& comm) {
        const int rank = comm.rank();
        cudaStream_t s;
        MKT_CUDA(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
        {
          Local mine(c);
          copy_shard(mine.q, q, c, world, rank, c.heads, false, s);
          copy_shard(mine.k, k, c, world, rank, c.kv_heads, false, s);
          copy_shard(mine.v, v, c, world, rank, c.kv_heads, false, s);
          SymmetricBuffer ws = comm.alloc(ring_attention_workspace_bytes(comm, local_problem(c)));
          ready(comm, s);
          mine.run(comm, c, ws.data(), s);
          comm.synchronize(s);
          std::vector<char> first(mine.q_count * 2);
          MKT_CUDA(cudaMemcpy(first.data(), mine.o, first.size(), cudaMemcpyDeviceToHost));
          copy_shard(mine.o, o, c, world, rank, c.heads, true, s);
          copy_lse_to_full(lse, mine.lse, c, world, rank, s);
          finished(comm, s);
          // Deterministic: the same bits again.
          mine.run(comm, c, ws.data(), s);
          comm.synchronize(s);
          std::vector<char> second(first.size());
          MKT_CUDA(cudaMemcpy(second.data(), mine.o, second.size(), cudaMemcpyDeviceToHost));
          EXPECT_TRUE(first == second) << "rank " << rank << ": a second call wrote other bits";
          finished(comm, s);
        }
        cudaStreamDestroy(s);
      },
      options);

  // Against the fp32 reference of the full sequence (sampled rows).
  AttentionProblem full = local_problem(c);
  full.seq_q = full.seq_kv = full_s;
  std::vector<int32_t> rows;
  std::mt19937_64 gen(seed);
  if (full_s <= 1024) {  // every row
    for (int64_t i = 0; i < full_s; ++i) rows.push_back(static_cast<int32_t>(i));
  } else {  // the first and last 64, 128 random ones
    for (int64_t i = 0; i < 64; ++i) rows.push_back(static_cast<int32_t>(i));
    for (int64_t i = full_s - 64; i < full_s; ++i) rows.push_back(static_cast<int32_t>(i));
    std::uniform_int_distribution<int64_t> pick(0, full_s - 1);
    for (int i = 0; i < 128; ++i) rows.push_back(static_cast<int32_t>(pick(gen)));
  }
  const int nrows = static_cast<int>(rows.size());
  const int64_t d = c.head_dim, ref_count = c.batch * nrows * c.heads * d;
  int32_t* rows_dev;
  float *exact, *lowp, *ref_lse;
  MKT_CUDA(cudaMalloc(reinterpret_cast<void**>(&rows_dev), nrows * 4));
  MKT_CUDA(cudaMalloc(reinterpret_cast<void**>(&exact), ref_count * 4));
  MKT_CUDA(cudaMalloc(reinterpret_cast<void**>(&lowp), ref_count * 4));
  MKT_CUDA(cudaMalloc(reinterpret_cast<void**>(&ref_lse), c.batch * c.heads * nrows * 4));
  MKT_CUDA(cudaMemcpy(rows_dev, rows.data(), nrows * 4, cudaMemcpyHostToDevice));
  attention_reference(full, {q}, {k}, {v}, rows_dev, nrows, exact, lowp, ref_lse, nullptr);
  std::vector<float> h_exact(ref_count), h_lowp(ref_count), h_ref_lse(c.batch * c.heads * nrows);
  std::vector<uint16_t> h_o(q_count);
  std::vector<float> h_lse(c.batch * c.heads * full_s);
  MKT_CUDA(cudaMemcpy(h_exact.data(), exact, ref_count * 4, cudaMemcpyDeviceToHost));
  MKT_CUDA(cudaMemcpy(h_lowp.data(), lowp, ref_count * 4, cudaMemcpyDeviceToHost));
  MKT_CUDA(cudaMemcpy(h_ref_lse.data(), ref_lse, h_ref_lse.size() * 4, cudaMemcpyDeviceToHost));
  MKT_CUDA(cudaMemcpy(h_o.data(), o, q_count * 2, cudaMemcpyDeviceToHost));
  MKT_CUDA(cudaMemcpy(h_lse.data(), lse, h_lse.size() * 4, cudaMemcpyDeviceToHost));
  int64_t nan_o = 0, nan_lse = 0;
  for (uint16_t x : h_o) nan_o += std::isnan(from_bits(x, DType::kBF16));
  for (float x : h_lse) nan_lse += std::isnan(x);
  EXPECT_EQ(nan_o, 0) << "O elements left unwritten (or NaN)";
  EXPECT_EQ(nan_lse, 0) << "LSE elements left unwritten (or NaN)";
  double err = 0, err_low = 0, err_lse = 0;
  for (int64_t b = 0; b < c.batch; ++b) {
    for (int r = 0; r < nrows; ++r) {
      for (int64_t h = 0; h < c.heads; ++h) {
        const int64_t ref = ((b * nrows + r) * c.heads + h) * d;
        const int64_t got = ((b * full_s + rows[r]) * c.heads + h) * d;
        for (int64_t j = 0; j < d; ++j) {
          err = std::max(err, std::abs(from_bits(h_o[got + j], DType::kBF16) -
                                       static_cast<double>(h_exact[ref + j])));
          err_low =
              std::max(err_low, std::abs(static_cast<double>(h_lowp[ref + j]) - h_exact[ref + j]));
        }
        err_lse = std::max(
            err_lse, static_cast<double>(std::abs(h_lse[(b * c.heads + h) * full_s + rows[r]] -
                                                  h_ref_lse[(b * c.heads + h) * nrows + r])));
      }
    }
  }
  EXPECT_LE(err, 2 * err_low + 1e-5) << "O error " << err << ", bf16 computation's " << err_low;
  EXPECT_LE(err_lse, 1e-3) << "LSE error";
  for (void* p :
       {q, k, v, o, static_cast<void*>(lse), static_cast<void*>(rows_dev),
        static_cast<void*>(exact), static_cast<void*>(lowp), static_cast<void*>(ref_lse)}) {
    cudaFree(p);
  }
}

// Three calls back to back with the last rank late before each (collective_checks.h), each on
// inputs and outputs of its own and the same workspace: none deadlocks, and each writes the bits
// of the same call made alone.
void expect_back_to_back(int world, const RingCase& c, uint64_t seed,
                         const CommOptions& options = {}) {
  constexpr int kCalls = 3;
  SCOPED_TRACE(describe(c, world) + ", three calls back to back, the last rank late, seed " +
               std::to_string(seed));
  run_in_process(
      world,
      [&](Communicator& comm) {
        const int rank = comm.rank();
        cudaStream_t s;
        MKT_CUDA(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
        {
          std::vector<std::unique_ptr<Local>> mine;
          for (int i = 0; i < kCalls; ++i) {
            mine.push_back(std::make_unique<Local>(c));
            const uint64_t base = seed + 3 * (kCalls * rank + i);
            fill_random_bf16_scaled(mine[i]->q, mine[i]->q_count, 2.0f, base, s);
            fill_random_bf16_scaled(mine[i]->k, mine[i]->kv_count, 2.0f, base + 1, s);
            fill_random_bf16_scaled(mine[i]->v, mine[i]->kv_count, 1.0f, base + 2, s);
          }
          SymmetricBuffer ws = comm.alloc(ring_attention_workspace_bytes(comm, local_problem(c)));
          const std::size_t o_bytes = mine[0]->q_count * 2;
          std::vector<std::vector<char>> alone(kCalls, std::vector<char>(o_bytes));
          for (int i = 0; i < kCalls; ++i) {
            MKT_CUDA(cudaMemsetAsync(mine[i]->o, 0xFF, o_bytes, s));
            ready(comm, s);
            mine[i]->run(comm, c, ws.data(), s);
            finished(comm, s);
            MKT_CUDA(cudaMemcpy(alone[i].data(), mine[i]->o, o_bytes, cudaMemcpyDeviceToHost));
            MKT_CUDA(cudaMemsetAsync(mine[i]->o, 0xFF, o_bytes, s));
          }
          ready(comm, s);
          call_back_to_back_one_late(comm, s, kCalls,
                                     [&](int i) { mine[i]->run(comm, c, ws.data(), s); });
          for (int i = 0; i < kCalls; ++i) {
            std::vector<char> got(o_bytes);
            MKT_CUDA(cudaMemcpy(got.data(), mine[i]->o, o_bytes, cudaMemcpyDeviceToHost));
            EXPECT_TRUE(got == alone[i])
                << "rank " << rank << ", call " << i << ": other bits than the call made alone";
          }
          comm.bootstrap().barrier();
        }
        cudaStreamDestroy(s);
      },
      options);
}

TEST(InProcessRingAttention, BackToBackCallsWithALateRank) {
  MKT_REQUIRE_GPU();
  const uint64_t seed = fresh_seed();
  for (int world : {2, 4}) {
    expect_back_to_back(world, {1, 512, 4, 2, 128, true}, seed);
    expect_back_to_back(world, {2, 384, 4, 1, 64, false}, seed + 1);
  }
  expect_back_to_back(3, {1, 1024, 4, 4, 128, true, 7}, seed + 2);  // few CTAs: long items
}

TEST(InProcessRingAttention, MatchesFullSequenceAttention) {
  MKT_REQUIRE_GPU();
  const uint64_t seed = fresh_seed();
  for (int world : {1, 2, 4, 8}) {
    expect_ring_matches(world, {1, 512, 4, 4, 128, true}, seed);
    expect_ring_matches(world, {2, 384, 4, 1, 64, false}, seed + 1);
  }
  expect_ring_matches(2, {1, 2048, 8, 2, 128, true}, seed + 2);
  expect_ring_matches(3, {2, 200, 4, 2, 128, true}, seed + 3);  // parts of 100 rows
  expect_ring_matches(4, {1, 300, 2, 2, 64, false}, seed + 4);
  expect_ring_matches(2, {1, 130, 8, 8, 128, true}, seed + 5);
  // Few CTAs: every round long, the slots reused while other CTAs still compute (world 4: 2
  // rounds; world 8: 4).
  expect_ring_matches(4, {1, 2048, 8, 2, 128, true, 7}, seed + 6);
  expect_ring_matches(8, {1, 1024, 4, 4, 64, false, 5}, seed + 7);
  // Ranks with different CTA counts (5 and 35; 3, 23 and 43; the whole budget and 7 - on a GPU
  // of its own, rank 0 then has CTAs without a share): each pushes its units share for share into
  // its peers' slots, and each counts them whole (the copies' shares do not depend on the grid).
  expect_ring_matches(2, {1, 1024, 4, 4, 128, true, 5, 30}, seed + 8);
  expect_ring_matches(3, {2, 512, 4, 2, 64, false, 3, 20}, seed + 9);
  expect_ring_matches(2, {1, 768, 4, 4, 128, false, 0, 7}, seed + 10);
}

// Across virtual nodes over the socket transport (ring_nodes.cuh: a ring launch a node, the
// chunks moving one node on between launches, the softmax state carried): the same reference,
// causal zigzag and not, GQA, D 64 and 128, parts not a multiple of 128 rows.
void replay_with_new_inputs(int world, const CommOptions& options = {});

class RingNodes : public AcrossNodes {};
TEST_P(RingNodes, MatchesFullSequenceAttention) {
  MKT_REQUIRE_GPU();
  const auto [nodes, per_node] = GetParam();
  const int world = nodes * per_node;
  const uint64_t seed = fresh_seed();
  const CommOptions options = virtual_nodes(per_node, 30);
  expect_ring_matches(world, {1, 512, 4, 4, 128, true}, seed, options);
  expect_ring_matches(world, {2, 384, 4, 1, 64, false}, seed + 1, options);
  expect_ring_matches(world, {1, 300, 4, 2, 128, true}, seed + 2, options);  // parts of 150 rows
  // Ranks with different CTA counts (3, 7, 11, ... as the budget allows), within a node and
  // across: each node's launch and the exchanges between launches do not depend on the grids.
  expect_ring_matches(world, {1, 512, 4, 2, 128, true, 3, 4}, seed + 3, options);
}
// One rank enqueues each call 50 ms after the others (the second call has no host exchange that
// would absorb it): everything the others' streams hold for the call - exchange launches that
// wait for this rank, and what follows them - is queued on the GPU before this rank's first op.
// Nothing of this rank's may wait behind any of it (ring_nodes.cuh's header).
TEST_P(RingNodes, LateRankDoesNotDeadlock) {
  MKT_REQUIRE_GPU();
  const auto [nodes, per_node] = GetParam();
  const int world = nodes * per_node;
  RingCase c{2, 384, 4, 1, 64, false};
  c.late_rank = world - 1;
  expect_ring_matches(world, c, fresh_seed(), virtual_nodes(per_node, 30));
}
// Three calls back to back with the last rank late before each: the across-node call's launches,
// exchanges and copies of one call queued behind the others' whole calls.
TEST_P(RingNodes, BackToBackCallsWithALateRank) {
  MKT_REQUIRE_GPU();
  const auto [nodes, per_node] = GetParam();
  const int world = nodes * per_node;
  const uint64_t seed = fresh_seed();
  expect_back_to_back(world, {2, 384, 4, 1, 64, false}, seed, virtual_nodes(per_node, 30));
  expect_back_to_back(world, {1, 512, 4, 4, 128, true}, seed + 1, virtual_nodes(per_node, 30));
}
// One captured call (the node launches, the exchanges' launches and copies), replayed 100 times
// on new inputs, some checked bit for bit against eager calls.
TEST_P(RingNodes, GraphReplays100TimesWithNewInputs) {
  MKT_REQUIRE_GPU();
  const auto [nodes, per_node] = GetParam();
  replay_with_new_inputs(nodes * per_node, virtual_nodes(per_node, 30));
}
INSTANTIATE_TEST_SUITE_P(RingAcrossNodes, RingNodes,
                         ::testing::Values(NodesLayout{2, 1}, NodesLayout{2, 2}, NodesLayout{4, 1},
                                           NodesLayout{2, 4}, NodesLayout{3, 1}, NodesLayout{3, 2}),
                         layout_name);

// Captured once per rank; 100 replays, each on new inputs written into the captured buffers,
// some checked bit for bit against an eager call on the same inputs.

TEST(InProcessRingAttention, GraphReplays100TimesWithNewInputs) {
  MKT_REQUIRE_GPU();
  for (int world : {2, 4}) {  // world 4: two rounds, a slot reused within a launch
    SCOPED_TRACE("world " + std::to_string(world));
    replay_with_new_inputs(world);
  }
}

void replay_with_new_inputs(int world, const CommOptions& options) {
  const RingCase c{1, 256, 4, 2, 128, true};
  const uint64_t seed = fresh_seed();
  run_in_process(
      world,
      [&](Communicator& comm) {
        const int rank = comm.rank();
        cudaStream_t s;
        MKT_CUDA(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
        {
          Local mine(c), eager(c);
          SymmetricBuffer ws = comm.alloc(ring_attention_workspace_bytes(comm, local_problem(c)));
          auto refill = [&](int round) {
            const uint64_t r = seed + 1000 * round + rank;
            fill_random_bf16_scaled(mine.q, mine.q_count, 2.0f, r, s);
            fill_random_bf16_scaled(mine.k, mine.kv_count, 2.0f, r ^ 0x11, s);
            fill_random_bf16_scaled(mine.v, mine.kv_count, 1.0f, r ^ 0x22, s);
          };
          refill(0);
          ready(comm, s);
          mine.run(comm, c, ws.data(), s);  // loaded and warm before the capture
          comm.synchronize(s);
          cudaGraph_t graph;
          cudaGraphExec_t exec;
          MKT_CUDA(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
          mine.run(comm, c, ws.data(), s);
          MKT_CUDA(cudaStreamEndCapture(s, &graph));
          ASSERT_NO_FATAL_FAILURE(instantiate_uploaded(graph, s, &exec));
          comm.bootstrap().barrier();
          int mismatches = 0;
          for (int round = 1; round <= 100; ++round) {
            refill(round);
            MKT_CUDA(cudaGraphLaunch(exec, s));
            if (round % 25 == 0) {
              cudaMemcpyAsync(eager.q, mine.q, mine.q_count * 2, cudaMemcpyDeviceToDevice, s);
              cudaMemcpyAsync(eager.k, mine.k, mine.kv_count * 2, cudaMemcpyDeviceToDevice, s);
              cudaMemcpyAsync(eager.v, mine.v, mine.kv_count * 2, cudaMemcpyDeviceToDevice, s);
              eager.run(comm, c, ws.data(), s);
              comm.synchronize(s);
              // Read back on this rank's stream, not the legacy one: a peer may already have
              // queued its next replay, whose kernels wait for this rank (communicator.h).
              std::vector<char> a(mine.q_count * 2), b(a.size());
              MKT_CUDA(cudaMemcpyAsync(a.data(), mine.o, a.size(), cudaMemcpyDeviceToHost, s));
              MKT_CUDA(cudaMemcpyAsync(b.data(), eager.o, b.size(), cudaMemcpyDeviceToHost, s));
              MKT_CUDA(cudaStreamSynchronize(s));
              mismatches += a != b;
            }
          }
          comm.synchronize(s);
          EXPECT_EQ(mismatches, 0) << "rank " << rank << ": replays differ from eager calls";
          cudaGraphExecDestroy(exec);
          cudaGraphDestroy(graph);
          finished(comm, s);
        }
        cudaStreamDestroy(s);
      },
      options);
}

// A small case for compute-sanitizer (scripts/device_run.sh sanitize).
TEST(SanitizeRingAttention, Small) {
  MKT_REQUIRE_GPU();
  expect_ring_matches(2, {1, 256, 2, 1, 128, true}, fresh_seed());
}

TEST(InProcessRingAttention, MissingRankTimesOut) {
  MKT_REQUIRE_GPU();
  CommOptions options;
  options.timeout_seconds = 1.0;
  run_in_process(
      2,
      [](Communicator& comm) {
        const RingCase c{1, 256, 2, 2, 128, false};
        cudaStream_t s;
        MKT_CUDA(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
        {
          Local mine(c);
          mine.fill(s);
          SymmetricBuffer ws = comm.alloc(ring_attention_workspace_bytes(comm, local_problem(c)));
          ready(comm, s);
          expect_missing_rank_times_out(comm, s, [&] { mine.run(comm, c, ws.data(), s); });
        }
        cudaStreamDestroy(s);
      },
      options);
}

// Ranks that disagree on what every rank must share - S_local (each rank's own T in a caller
// that shards unevenly), causal, H: the entry finds it before any share moves; each rank raises
// kInvalidArgument naming itself, the peer and ring_attention, well inside the time limit (no
// time-out), and nothing reached the slot the peer writes at world 2 (the workspace was zeroed).
TEST(InProcessRingAttention, RanksThatDisagreeFailNamingIt) {
  MKT_REQUIRE_GPU();
  CommOptions options;
  options.timeout_seconds = 20.0;
  for (int variant = 0; variant < 3; ++variant) {
    run_in_process(
        2,
        [variant](Communicator& comm) {
          const int me = comm.rank();
          RingCase c{1, 256, 4, 2, 128, false};
          RingCase other = c;
          if (variant == 0) other.seq_local = 512;
          if (variant == 1) other.causal = true;
          if (variant == 2) other.heads = 2;
          const RingCase mine_case = me == 0 ? c : other;
          cudaStream_t s;
          MKT_CUDA(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
          {
            Local mine(mine_case);
            mine.fill(s);
            // The same symmetric buffer on every rank (collective), zeroed: room for either.
            SymmetricBuffer ws =
                comm.alloc(std::max(ring_attention_workspace_bytes(comm, local_problem(c)),
                                    ring_attention_workspace_bytes(comm, local_problem(other))));
            MKT_CUDA(cudaMemsetAsync(ws.data(), 0, ws.size(), s));
            ready(comm, s);
            expect_ranks_disagree(
                comm, s, [&] { mine.run(comm, mine_case, ws.data(), s); }, "ring_attention",
                "variant " + std::to_string(variant));
            // At world 2 the peer writes its K and V into slot 0: the workspace's first bytes.
            const int64_t chunk =
                std::min(c.batch * c.seq_local * c.kv_heads * c.head_dim,
                         other.batch * other.seq_local * other.kv_heads * other.head_dim) *
                2;
            std::vector<uint8_t> host(2 * chunk);
            MKT_CUDA(cudaMemcpy(host.data(), ws.data(), host.size(), cudaMemcpyDeviceToHost));
            EXPECT_TRUE(std::all_of(host.begin(), host.end(), [](uint8_t b) { return b == 0; }))
                << "variant " << variant << ": a peer's share reached rank " << me;
          }
          cudaStreamDestroy(s);
        },
        options);
  }
}

TEST(InProcessRingAttention, RejectsBadArgumentsBeforeLaunch) {
  MKT_REQUIRE_GPU();
  run_in_process(2, [](Communicator& comm) {
    const RingCase c{1, 256, 4, 2, 128, true};
    cudaStream_t s;
    MKT_CUDA(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    {
      Local mine(c);
      const AttentionProblem good = local_problem(c);
      SymmetricBuffer ws = comm.alloc(ring_attention_workspace_bytes(comm, good));
      MKT_CUDA(cudaMemsetAsync(mine.o, 0xFF, mine.q_count * 2, s));
      MKT_CUDA(cudaStreamSynchronize(s));
      AttentionProblem odd = good;
      odd.seq_q = odd.seq_kv = 255;
      expect_error(
          [&] {
            ring_attention(comm, odd, {mine.q}, {mine.k}, {mine.v}, mine.o, mine.lse, ws.data(), s);
          },
          ErrorCode::kInvalidArgument, "even S_local");
      AttentionProblem uneven = good;
      uneven.seq_kv = 128;
      expect_error(
          [&] {
            ring_attention(comm, uneven, {mine.q}, {mine.k}, {mine.v}, mine.o, mine.lse, ws.data(),
                           s);
          },
          ErrorCode::kInvalidArgument, "seq_kv");
      void* plain = nullptr;
      MKT_CUDA(cudaMalloc(&plain, ring_attention_workspace_bytes(comm, good)));
      expect_error(
          [&] {
            ring_attention(comm, good, {mine.q}, {mine.k}, {mine.v}, mine.o, mine.lse, plain, s);
          },
          ErrorCode::kInvalidArgument, "workspace");
      cudaFree(plain);
      EXPECT_EQ(count_nans_bf16(mine.o, mine.q_count, s), static_cast<uint64_t>(mine.q_count))
          << "O was written by a refused call";
      comm.bootstrap().barrier();
    }
    cudaStreamDestroy(s);
  });
}

}  // namespace
}  // namespace mk::test
