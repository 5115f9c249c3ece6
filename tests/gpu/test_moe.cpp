// moe_dispatch / moe_combine (mkernel/moe.h) against the routing contract's CPU reference
// (tests/cpu/moe_reference.h), ranks as threads of one process (sharing the GPU when there are
// fewer GPUs than ranks): worlds 1, 2, 4 and 8.
//
// Every rank rebuilds every rank's inputs from the shared seed. Dispatch: the counts, the whole
// handle and every placed row must equal the reference bit for bit (rows carry their source's
// random bits). Combine: each rank's experts turn a row into bf16(row x s(expert)) on the host, so
// a row that comes back to the wrong slot changes the sum; the source's output must equal the
// reference's fp32 slot-order sum bit for bit. Also: -1 slots, all tokens on one expert, all
// tokens local, ranks without tokens, int32 and int64 indices, capacity overflow and bad indices
// (raised once by check(), the communicator usable after), 100 graph replays with new routing, a
// missing rank (time limit), refusals before launch with outputs untouched, a Sanitize case.
// moe_dispatch_gemm: its dispatched rows, counts and handle as moe_dispatch's, bit for bit, and y
// bit for bit as the grouped GEMM computes it on those rows (same tile width); both weight
// layouts, both row layouts, overflow, graph replays with new routing, a missing rank.
#include <algorithm>
#include <cstring>
#include <map>
#include <numeric>
#include <random>

#include "../cpu/moe_reference.h"
#include "collective_checks.h"
#include "gemm/gemm_internal.h"
#include "gemm_reference.h"
#include "gpu_test_util.h"
#include "mkernel/moe.h"
#include "moe/moe_plan.h"

namespace mk::test {
namespace {

enum class Routing { kRandom, kOneExpert, kLocal, kSkewed, kBadIndex };

struct MoeCase {
  int experts;
  int top_k;
  int64_t hidden;
  int64_t tokens;  // rank r has tokens - (r % 3) * tokens / 4, or none where `empty_rank` == r
  MoeLayout layout = MoeLayout::kPadded;
  int64_t capacity = 0;
  IndexType index = IndexType::kInt32;
  Routing routing = Routing::kRandom;
  int empty_rank = -1;
  int sms = 0;  // MoeConfig::sms of every launch (few CTAs: see SanitizeMoe.DispatchGemm)
  // Every launch after host-side work comes after a meeting (ready()): the SanitizeMoe cases.
  // Without it, the last part of expect_moe launches while peers may still be in the last op -
  // what the kernels must allow - but under compute-sanitizer a rank's copies and memsets can wait
  // for the whole GPU, where a peer's launch already waits for this rank's next one
  // (mkernel/communicator.h: ranks sharing a GPU in one process).
  bool meet = false;
};

std::string describe(const MoeCase& c, int world) {
  static const char* kRouting[] = {"random", "one expert", "local", "skewed", "bad index"};
  return "world " + std::to_string(world) + ", E " + std::to_string(c.experts) + ", top-" +
         std::to_string(c.top_k) + ", H " + std::to_string(c.hidden) + ", T " +
         std::to_string(c.tokens) + (c.layout == MoeLayout::kMasked ? ", masked" : ", padded") +
         " capacity " + std::to_string(c.capacity) +
         (c.index == IndexType::kInt64 ? ", int64" : ", int32") + ", routing " +
         kRouting[static_cast<int>(c.routing)];
}

int64_t tokens_of(const MoeCase& c, int rank) {
  if (rank == c.empty_rank) return 0;
  return c.tokens - (rank % 3) * c.tokens / 4;
}

// Rank r's top-k choices [T_r][k]: distinct experts per token (a router's), some slots -1.
std::vector<int64_t> routing_of(const MoeCase& c, int world, int rank, uint64_t seed) {
  std::mt19937_64 gen(seed * 1000003 + rank);
  const int64_t tokens = tokens_of(c, rank);
  const int e_local = c.experts / world;
  std::vector<int64_t> topk(static_cast<size_t>(tokens * c.top_k), -1);
  std::vector<int> experts(c.experts);
  for (int64_t t = 0; t < tokens; ++t) {
    int64_t* row = &topk[static_cast<size_t>(t * c.top_k)];
    switch (c.routing) {
      case Routing::kOneExpert:  // every token of every rank: the same k experts
        for (int j = 0; j < c.top_k; ++j) row[j] = j;
        break;
      case Routing::kLocal:  // only this rank's experts (k <= E_local)
        std::iota(experts.begin(), experts.begin() + e_local, rank * e_local);
        std::shuffle(experts.begin(), experts.begin() + e_local, gen);
        for (int j = 0; j < c.top_k; ++j) row[j] = experts[j];
        break;
      case Routing::kSkewed: {  // Zipf-like: expert i with weight 1 / (i + 1)^1.2, distinct
        std::vector<double> w(c.experts);
        for (int i = 0; i < c.experts; ++i) w[i] = 1.0 / std::pow(i + 1.0, 1.2);
        for (int j = 0; j < c.top_k; ++j) {
          std::discrete_distribution<int> pick(w.begin(), w.end());
          const int e = pick(gen);
          row[j] = e;
          w[e] = 0;
        }
        break;
      }
      default:
        std::iota(experts.begin(), experts.end(), 0);
        std::shuffle(experts.begin(), experts.end(), gen);
        for (int j = 0; j < c.top_k; ++j) row[j] = gen() % 8 == 0 ? -1 : experts[j];
        break;
    }
    if (c.routing == Routing::kBadIndex && t % 17 == 3) {
      row[t % c.top_k] = (t % 2) ? c.experts + static_cast<int64_t>(t) : -2 - t;
    }
  }
  return topk;
}

std::vector<uint16_t> tokens_data(const MoeCase& c, int rank, uint64_t seed) {
  const auto bytes = random_elements(static_cast<size_t>(tokens_of(c, rank) * c.hidden),
                                     DType::kBF16, seed * 7919 + rank);
  std::vector<uint16_t> out(bytes.size() / 2);
  std::memcpy(out.data(), bytes.data(), bytes.size());
  return out;
}

std::vector<float> weights_of(const MoeCase& c, int rank, uint64_t seed) {
  std::mt19937_64 gen(seed * 31 + rank);
  std::uniform_real_distribution<float> u(0.05f, 1.f);
  std::vector<float> w(static_cast<size_t>(tokens_of(c, rank) * c.top_k));
  for (float& v : w) v = u(gen);
  return w;
}

// What an expert does to a row in these tests: bf16(x * s(e)), s depending on the global expert.
uint16_t expert_value(uint16_t x, int64_t expert) {
  return float_to_bf16(bf16_to_float(x) * (1.f + static_cast<float>(expert % 7) * 0.375f));
}

// Everyone's inputs and the reference routing.
struct World {
  MoeCase c;
  int world;
  int64_t max_tokens = 0;
  std::vector<std::vector<int64_t>> topk;
  std::vector<std::vector<uint16_t>> x;
  std::vector<std::vector<float>> weights;
  MoeRouting ref;

  World(const MoeCase& mc, int w, uint64_t seed, int64_t capacity_rows) : c(mc), world(w) {
    for (int r = 0; r < world; ++r) {
      topk.push_back(routing_of(c, world, r, seed));
      x.push_back(tokens_data(c, r, seed));
      weights.push_back(weights_of(c, r, seed));
      max_tokens = std::max(max_tokens, tokens_of(c, r));
    }
    ref = moe_route_reference(
        topk, c.top_k, c.experts,
        c.layout == MoeLayout::kMasked ? MoeRefLayout::kMasked : MoeRefLayout::kPadded,
        capacity_rows);
  }
};

struct Buffers {
  void* x = nullptr;
  void* topk = nullptr;
  float* weights = nullptr;
  void* recv = nullptr;
  int32_t* rows = nullptr;
  int32_t* handle = nullptr;
  void* y = nullptr;
  void* out = nullptr;
  std::size_t x_bytes = 0, topk_bytes = 0, recv_bytes = 0, handle_bytes = 0, out_bytes = 0;

  Buffers(const MoeProblem& p, const MoePlan& plan, IndexType index) {
    const size_t idx = index == IndexType::kInt64 ? 8 : 4;
    x_bytes = std::max<size_t>(16, p.tokens * p.hidden * 2);
    topk_bytes = std::max<size_t>(16, p.tokens * p.top_k * idx);
    recv_bytes = plan.rows * p.hidden * 2;
    handle_bytes = plan.rows * 12;
    out_bytes = std::max<size_t>(16, p.tokens * p.hidden * 2);
    cudaMalloc(&x, x_bytes);
    cudaMalloc(&topk, topk_bytes);
    cudaMalloc(reinterpret_cast<void**>(&weights), std::max<size_t>(16, p.tokens * p.top_k * 4));
    cudaMalloc(&recv, recv_bytes);
    cudaMalloc(reinterpret_cast<void**>(&rows), plan.experts_local * 4);
    cudaMalloc(reinterpret_cast<void**>(&handle), handle_bytes);
    cudaMalloc(&y, recv_bytes);
    cudaMalloc(&out, out_bytes);
  }
  ~Buffers() {
    for (void* p : {x, topk, static_cast<void*>(weights), recv, static_cast<void*>(rows),
                    static_cast<void*>(handle), y, out}) {
      cudaFree(p);
    }
  }
};

void upload_inputs(const World& w, int rank, const Buffers& b, cudaStream_t s) {
  const auto& topk = w.topk[rank];
  if (!topk.empty()) {
    if (w.c.index == IndexType::kInt64) {
      cudaMemcpyAsync(b.topk, topk.data(), topk.size() * 8, cudaMemcpyHostToDevice, s);
    } else {
      std::vector<int32_t> narrow(topk.begin(), topk.end());
      cudaMemcpyAsync(b.topk, narrow.data(), narrow.size() * 4, cudaMemcpyHostToDevice, s);
    }
    cudaMemcpyAsync(b.x, w.x[rank].data(), w.x[rank].size() * 2, cudaMemcpyHostToDevice, s);
    cudaMemcpyAsync(b.weights, w.weights[rank].data(), w.weights[rank].size() * 4,
                    cudaMemcpyHostToDevice, s);
  }
  cudaStreamSynchronize(s);
}

MoeProblem problem_of(const World& w, int rank) {
  MoeProblem p;
  p.tokens = tokens_of(w.c, rank);
  p.max_tokens = w.max_tokens;
  p.hidden = w.c.hidden;
  p.top_k = w.c.top_k;
  p.num_experts = w.c.experts;
  p.layout = w.c.layout;
  p.capacity = w.c.capacity;
  return p;
}

// The dispatch's outputs against the reference, bit for bit.
// (placed_rows false: the call was not asked for recv_x - the counts and the handle only.)
void check_dispatch(const World& w, int rank, const MoePlan& plan, const Buffers& b, cudaStream_t s,
                    bool placed_rows = true) {
  const MoeReceived& want = w.ref.received[rank];
  std::vector<int32_t> rows(plan.experts_local), handle(plan.rows * 3);
  std::vector<uint16_t> recv(plan.rows * w.c.hidden);
  cudaMemcpyAsync(rows.data(), b.rows, rows.size() * 4, cudaMemcpyDeviceToHost, s);
  cudaMemcpyAsync(handle.data(), b.handle, handle.size() * 4, cudaMemcpyDeviceToHost, s);
  cudaMemcpyAsync(recv.data(), b.recv, recv.size() * 2, cudaMemcpyDeviceToHost, s);
  ASSERT_EQ(cudaStreamSynchronize(s), cudaSuccess);
  EXPECT_EQ(rows, want.expert_rows) << "rows per local expert";
  ASSERT_EQ(want.rows.size(), static_cast<size_t>(plan.rows));
  int64_t bad_handles = 0, bad_rows = 0;
  for (int64_t r = 0; r < plan.rows; ++r) {
    const MoeRow got{handle[r * 3], handle[r * 3 + 1], handle[r * 3 + 2]};
    const MoeRow& ref = want.rows[r];
    if (!(got == ref)) {
      if (bad_handles++ < 5) {
        ADD_FAILURE() << "handle row " << r << ": (" << got.src << ", " << got.token << ", "
                      << got.slot << "), expected (" << ref.src << ", " << ref.token << ", "
                      << ref.slot << ")";
      }
      continue;
    }
    if (ref.src < 0 || !placed_rows) continue;
    const uint16_t* sent = &w.x[ref.src][static_cast<size_t>(ref.token * w.c.hidden)];
    if (std::memcmp(sent, &recv[r * w.c.hidden], w.c.hidden * 2) != 0 && bad_rows++ < 5) {
      ADD_FAILURE() << "row " << r << " differs from rank " << ref.src << "'s token " << ref.token;
    }
  }
  EXPECT_EQ(bad_handles, 0);
  EXPECT_EQ(bad_rows, 0);
}

// y = each row as its expert changes it (host), uploaded; returns nothing.
void make_y(const World& w, int rank, const MoePlan& plan, const Buffers& b, cudaStream_t s) {
  std::vector<uint16_t> y(plan.rows * w.c.hidden, 0x7fc0);  // NaN where no row is
  for (int64_t r = 0; r < plan.rows; ++r) {
    const MoeRow& row = w.ref.received[rank].rows[r];
    if (row.src < 0) continue;
    const int64_t e = w.topk[row.src][static_cast<size_t>(row.token) * w.c.top_k + row.slot];
    for (int64_t h = 0; h < w.c.hidden; ++h) {
      y[r * w.c.hidden + h] =
          expert_value(w.x[row.src][static_cast<size_t>(row.token * w.c.hidden + h)], e);
    }
  }
  cudaMemcpyAsync(b.y, y.data(), y.size() * 2, cudaMemcpyHostToDevice, s);
  cudaStreamSynchronize(s);
}

// The combine's output at `rank` against the reference sum (y = expert_value, or y = the
// dispatched rows themselves when `identity`).
void check_combine(const World& w, int rank, const Buffers& b, cudaStream_t s, bool identity) {
  const int64_t tokens = tokens_of(w.c, rank), h = w.c.hidden;
  if (tokens == 0) return;
  // Which (token, slot) rows of this rank landed somewhere (not dropped past a room).
  std::vector<char> placed(static_cast<size_t>(tokens * w.c.top_k), 0);
  for (const MoeReceived& d : w.ref.received) {
    for (const MoeRow& row : d.rows) {
      if (row.src == rank) placed[static_cast<size_t>(row.token) * w.c.top_k + row.slot] = 1;
    }
  }
  std::vector<std::vector<uint16_t>> ys(placed.size());
  for (int64_t t = 0; t < tokens; ++t) {
    for (int j = 0; j < w.c.top_k; ++j) {
      const size_t i = static_cast<size_t>(t * w.c.top_k + j);
      if (!placed[i]) continue;
      ys[i].resize(h);
      for (int64_t q = 0; q < h; ++q) {
        const uint16_t v = w.x[rank][static_cast<size_t>(t * h + q)];
        ys[i][q] = identity ? v : expert_value(v, w.topk[rank][i]);
      }
    }
  }
  const auto want =
      moe_combine_reference(tokens, w.c.top_k, h, w.weights[rank], [&](int64_t t, int j) {
        const auto& v = ys[static_cast<size_t>(t * w.c.top_k + j)];
        return v.empty() ? nullptr : v.data();
      });
  std::vector<uint16_t> got(static_cast<size_t>(tokens * h));
  cudaMemcpyAsync(got.data(), b.out, got.size() * 2, cudaMemcpyDeviceToHost, s);
  ASSERT_EQ(cudaStreamSynchronize(s), cudaSuccess);
  int64_t bad = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    if (got[i] != want[i] && bad++ < 5) {
      ADD_FAILURE() << "out[" << i / h << "][" << i % h << "] = " << bf16_to_float(got[i])
                    << ", expected " << bf16_to_float(want[i]);
    }
  }
  EXPECT_EQ(bad, 0) << "combine differs from the fp32 slot-order sum";
}

// The data error this rank's reference expects, raised once by check(); then none.
void expect_data_errors(Communicator& comm, const World& w, int rank, cudaStream_t s) {
  const MoeReceived& want = w.ref.received[rank];
  bool bad_here = false;
  for (const MoeRow& b : w.ref.bad_indices) bad_here = bad_here || b.src == rank;
  if (!bad_here && want.overflowed.empty()) {
    EXPECT_NO_THROW(comm.synchronize(s));
    return;
  }
  try {
    comm.synchronize(s);
    ADD_FAILURE() << "rank " << rank << ": no data error raised";
  } catch (const Error& e) {
    const std::string msg = e.what();
    if (bad_here) {  // the count kernel runs first: its error is the launch's first
      EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument) << msg;
      EXPECT_NE(msg.find("topk_idx["), std::string::npos) << msg;
    } else {
      EXPECT_EQ(e.code(), ErrorCode::kOutOfMemory) << msg;
      bool named = false;
      for (int32_t ex : want.overflowed) {
        named = named || msg.find("local expert " + std::to_string(ex) + " ") != std::string::npos;
      }
      EXPECT_TRUE(named) << msg;
    }
  }
  EXPECT_NO_THROW(comm.check()) << "a data error is raised once";
}

void expect_moe(Communicator& comm, const MoeCase& c, uint64_t seed) {
  const int world = comm.world_size(), rank = comm.rank();
  SCOPED_TRACE(describe(c, world) + ", rank " + std::to_string(rank));
  // The capacity the plan picks (for the reference), from any rank's problem.
  MoeProblem probe;
  probe.tokens = 0;
  probe.max_tokens = c.tokens;  // rank 0 has the most tokens (tokens_of)
  probe.hidden = c.hidden;
  probe.top_k = c.top_k;
  probe.num_experts = c.experts;
  probe.layout = c.layout;
  probe.capacity = c.capacity;
  MoeConfig config;
  config.sms = c.sms;
  const MoePlan probe_plan = moe_plan(comm, probe, config);
  const World w(c, world, seed, probe_plan.capacity);
  ASSERT_EQ(w.max_tokens, c.tokens);
  const MoeProblem p = problem_of(w, rank);
  const MoePlan plan = moe_plan(comm, p, config);
  SymmetricBuffer ws = comm.alloc(plan.workspace_bytes);
  cudaStream_t s;
  MKT_CUDA(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  Buffers b(p, plan, c.index);
  MKT_CUDA(cudaMemsetAsync(b.recv, 0xff, b.recv_bytes, s));
  MKT_CUDA(cudaMemsetAsync(b.handle, 0x5a, b.handle_bytes, s));  // poison: every row written
  MKT_CUDA(cudaMemsetAsync(b.out, 0xff, b.out_bytes, s));
  upload_inputs(w, rank, b, s);
  ready(comm, s);
  // Zeroed on the stream with no meeting after it: peers write into this workspace only once
  // this rank's launch has begun (the kernels' entry barrier), so after the zeroing.
  MKT_CUDA(cudaMemsetAsync(ws.data(), 0, plan.workspace_bytes, s));
  moe_dispatch(comm, p, b.x, b.topk, c.index, b.recv, b.rows, b.handle, ws.data(), s, config);
  ASSERT_NO_FATAL_FAILURE(expect_data_errors(comm, w, rank, s));
  ASSERT_NO_FATAL_FAILURE(check_dispatch(w, rank, plan, b, s));
  if (comm.topology().num_nodes > 1) {
    // Across nodes, another dispatch (new routing, another workspace) between the dispatch and
    // its combine: it reuses the inter-node transfer regions, which the combine must not read.
    const World w3(c, world, seed + 2000, probe_plan.capacity);
    SymmetricBuffer ws3 = comm.alloc(plan.workspace_bytes);
    Buffers b3(p, plan, c.index);
    MKT_CUDA(cudaMemsetAsync(ws3.data(), 0, plan.workspace_bytes, s));
    upload_inputs(w3, rank, b3, s);
    ready(comm, s);
    moe_dispatch(comm, p, b3.x, b3.topk, c.index, b3.recv, b3.rows, b3.handle, ws3.data(), s,
                 config);
    ASSERT_NO_FATAL_FAILURE(expect_data_errors(comm, w3, rank, s));
    ASSERT_NO_FATAL_FAILURE(check_dispatch(w3, rank, plan, b3, s));
    comm.bootstrap().barrier();
  }
  ASSERT_NO_FATAL_FAILURE(make_y(w, rank, plan, b, s));
  ready(comm, s);
  moe_combine(comm, p, b.y, b.weights, b.handle, b.out, ws.data(), s, config);
  comm.synchronize(s);
  ASSERT_NO_FATAL_FAILURE(check_combine(w, rank, b, s, /*identity=*/false));
  // Again on the same buffers: deterministic, and usable after a data error.
  ready(comm, s);
  moe_dispatch(comm, p, b.x, b.topk, c.index, b.recv, b.rows, b.handle, ws.data(), s, config);
  moe_combine(comm, p, b.y, b.weights, b.handle, b.out, ws.data(), s, config);
  try {
    comm.synchronize(s);
  } catch (const Error& e) {  // the same data error once more; nothing else
    EXPECT_NE(e.code(), ErrorCode::kTimeout) << e.what();
  }
  ASSERT_NO_FATAL_FAILURE(check_dispatch(w, rank, plan, b, s));
  ASSERT_NO_FATAL_FAILURE(check_combine(w, rank, b, s, /*identity=*/false));
  // And with new tokens and routing, without a meeting first (but where c.meet): peers may still
  // be in the last combine while this rank's dispatch starts (the kernels' entry barriers order
  // the reuse of the workspace - across nodes also the staging and inbound regions).
  const World w2(c, world, seed + 1000, probe_plan.capacity);
  upload_inputs(w2, rank, b, s);
  MKT_CUDA(cudaMemsetAsync(b.recv, 0xff, b.recv_bytes, s));
  MKT_CUDA(cudaMemsetAsync(b.handle, 0x5a, b.handle_bytes, s));
  MKT_CUDA(cudaMemsetAsync(b.out, 0xff, b.out_bytes, s));
  if (c.meet) ready(comm, s);
  moe_dispatch(comm, p, b.x, b.topk, c.index, b.recv, b.rows, b.handle, ws.data(), s, config);
  ASSERT_NO_FATAL_FAILURE(expect_data_errors(comm, w2, rank, s));
  ASSERT_NO_FATAL_FAILURE(check_dispatch(w2, rank, plan, b, s));
  ASSERT_NO_FATAL_FAILURE(make_y(w2, rank, plan, b, s));
  if (c.meet) ready(comm, s);
  moe_combine(comm, p, b.y, b.weights, b.handle, b.out, ws.data(), s, config);
  comm.synchronize(s);
  ASSERT_NO_FATAL_FAILURE(check_combine(w2, rank, b, s, /*identity=*/false));
  comm.bootstrap().barrier();
  cudaStreamDestroy(s);
}

void run_cases(int world, const std::vector<MoeCase>& cases, uint64_t seed,
               CommOptions options = {}) {
  run_in_process(
      world,
      [&](Communicator& comm) {
        for (size_t i = 0; i < cases.size(); ++i) {
          if (cases[i].experts % world != 0) continue;
          expect_moe(comm, cases[i], seed + i);
        }
      },
      options);
}

TEST(InProcessMoe, World1) {
  MKT_REQUIRE_GPU();
  run_cases(1,
            {{8, 2, 2048, 300},
             {64, 8, 4096, 200, MoeLayout::kMasked, 0, IndexType::kInt64},
             {256, 8, 7168, 96},
             {8, 1, 512, 1000, MoeLayout::kPadded, 0, IndexType::kInt32, Routing::kOneExpert},
             // The most experts (the route kernels' shared memory past 48 KB).
             {kMoeMaxExperts, 2, 64, 64}},
            11);
}

TEST(InProcessMoe, World2) {
  MKT_REQUIRE_GPU();
  run_cases(2,
            {{8, 2, 2048, 256},
             {64, 8, 7168, 128, MoeLayout::kPadded, 0, IndexType::kInt64},
             {256, 8, 4096, 130, MoeLayout::kMasked, 0},
             {8, 1, 1024, 300, MoeLayout::kPadded, 0, IndexType::kInt32, Routing::kLocal},
             {16, 4, 256, 257, MoeLayout::kPadded, 0, IndexType::kInt32, Routing::kSkewed, 1}},
            21);
}

TEST(InProcessMoe, World4) {
  MKT_REQUIRE_GPU();
  run_cases(4,
            {{8, 2, 2048, 200},
             {64, 8, 1024, 150, MoeLayout::kMasked, 0, IndexType::kInt64},
             {256, 8, 2048, 64},
             {16, 2, 512, 100, MoeLayout::kPadded, 0, IndexType::kInt32, Routing::kOneExpert, 2}},
            31);
}

TEST(InProcessMoe, World8) {
  MKT_REQUIRE_GPU();
  run_cases(8,
            {{8, 2, 1024, 100},
             {64, 8, 2048, 64, MoeLayout::kPadded, 0, IndexType::kInt64},
             {256, 8, 512, 50, MoeLayout::kMasked, 0},
             {16, 1, 256, 90, MoeLayout::kPadded, 0, IndexType::kInt32, Routing::kLocal, 5}},
            41);
}

// moe_dispatch and moe_combine across virtual nodes over the socket transport: the received
// rows, counts and handle must be the one-node routing's, bit for bit, whichever path a row took
// (NVLink from a rank of the node, or the network to the rail peer and NVLink from there), and
// the combine's sums the fp32 slot-order reference's, bit for bit; twice on one workspace.
class MoeNodes : public AcrossNodes {};
TEST_P(MoeNodes, DispatchCombine) {
  MKT_REQUIRE_GPU();
  const auto [nodes, per_node] = GetParam();
  run_cases(nodes * per_node,
            {{8, 2, 1024, 200},
             {64, 8, 2048, 96, MoeLayout::kMasked, 0, IndexType::kInt64},
             {16, 4, 512, 130, MoeLayout::kPadded, 0, IndexType::kInt32, Routing::kSkewed, 1},
             {8, 1, 256, 150, MoeLayout::kPadded, 0, IndexType::kInt32, Routing::kLocal},
             {16, 4, 256, 120, MoeLayout::kMasked, 12, IndexType::kInt32, Routing::kSkewed}},
            61, virtual_nodes(per_node, 30));
}
INSTANTIATE_TEST_SUITE_P(MoeAcrossNodes, MoeNodes,
                         ::testing::Values(NodesLayout{2, 1}, NodesLayout{2, 2}, NodesLayout{4, 1},
                                           NodesLayout{2, 4}),
                         layout_name);

TEST(InProcessMoe, CapacityOverflowAndBadIndices) {
  MKT_REQUIRE_GPU();
  run_cases(2,
            {// Masked with room for 20 rows per expert; padded with 300 rows in all; skewed.
             {8, 2, 256, 200, MoeLayout::kMasked, 20, IndexType::kInt32, Routing::kSkewed},
             {8, 4, 256, 200, MoeLayout::kPadded, 300, IndexType::kInt64, Routing::kSkewed},
             {16, 4, 512, 120, MoeLayout::kPadded, 0, IndexType::kInt64, Routing::kBadIndex},
             {16, 4, 512, 120, MoeLayout::kMasked, 0, IndexType::kInt32, Routing::kBadIndex}},
            51);
}

// One graph (dispatch, then combine of the dispatched rows as they are) replayed 100 times,
// new routing, tokens and weights uploaded before each replay.
TEST(InProcessMoe, GraphReplays100TimesWithNewRouting) {
  MKT_REQUIRE_GPU();
  run_in_process(2, [](Communicator& comm) {
    const int rank = comm.rank();
    const MoeCase c{16, 4, 512, 96, MoeLayout::kPadded};
    const World first(c, comm.world_size(), 1, 0);
    const MoeProblem p = problem_of(first, rank);
    const MoePlan plan = moe_plan(comm, p);
    SymmetricBuffer ws = comm.alloc(plan.workspace_bytes);
    cudaStream_t s;
    MKT_CUDA(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    MKT_CUDA(cudaMemsetAsync(ws.data(), 0, plan.workspace_bytes, s));
    Buffers b(p, plan, c.index);
    upload_inputs(first, rank, b, s);
    ready(comm, s);
    moe_dispatch(comm, p, b.x, b.topk, c.index, b.recv, b.rows, b.handle, ws.data(), s);
    moe_combine(comm, p, b.recv, b.weights, b.handle, b.out, ws.data(), s);
    comm.synchronize(s);
    cudaGraph_t graph;
    MKT_CUDA(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
    moe_dispatch(comm, p, b.x, b.topk, c.index, b.recv, b.rows, b.handle, ws.data(), s);
    moe_combine(comm, p, b.recv, b.weights, b.handle, b.out, ws.data(), s);
    MKT_CUDA(cudaStreamEndCapture(s, &graph));
    cudaGraphExec_t exec;
    ASSERT_NO_FATAL_FAILURE(instantiate_uploaded(graph, s, &exec));
    comm.bootstrap().barrier();
    for (int replay = 0; replay < 100; ++replay) {
      SCOPED_TRACE("replay " + std::to_string(replay));
      MoeCase ci = c;
      ci.routing = replay % 3 == 2 ? Routing::kSkewed : Routing::kRandom;
      const World w(ci, comm.world_size(), 1000 + replay, plan.capacity);
      upload_inputs(w, rank, b, s);
      ready(comm, s);
      MKT_CUDA(cudaGraphLaunch(exec, s));
      comm.synchronize(s);
      ASSERT_NO_FATAL_FAILURE(check_dispatch(w, rank, plan, b, s));
      ASSERT_NO_FATAL_FAILURE(check_combine(w, rank, b, s, /*identity=*/true));
    }
    comm.bootstrap().barrier();
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
    cudaStreamDestroy(s);
  });
}

TEST(InProcessMoe, MissingRankTimesOut) {
  MKT_REQUIRE_GPU();
  CommOptions options;
  options.timeout_seconds = 1.0;
  run_in_process(
      2,
      [](Communicator& comm) {
        const MoeCase c{8, 2, 256, 64};
        const World w(c, comm.world_size(), 3, 0);
        const MoeProblem p = problem_of(w, comm.rank());
        const MoePlan plan = moe_plan(comm, p);
        SymmetricBuffer ws = comm.alloc(plan.workspace_bytes);
        cudaStream_t s;
        MKT_CUDA(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
        Buffers b(p, plan, c.index);
        upload_inputs(w, comm.rank(), b, s);
        ready(comm, s);
        expect_missing_rank_times_out(comm, s, [&] {
          moe_dispatch(comm, p, b.x, b.topk, c.index, b.recv, b.rows, b.handle, ws.data(), s);
        });
        cudaStreamDestroy(s);
      },
      options);
}

// Ranks that disagree on what every rank must share (here max_tokens, as Python's default - each
// rank's own T - gives when the ranks' T differ; or one rank in another MoE op): the entry
// barrier finds it, each rank raises kInvalidArgument naming itself and the peer, well inside the
// time limit (no hang, no time-out), and no row reached a peer's receive region. Variants:
//   0 max_tokens differs (moe_dispatch)        1 the capacity differs (moe_dispatch)
//   2 rank 1 combines while rank 0 dispatches  3 as 0, then a second call queued on each rank
//     (the rank that finds the difference first goes on to its next launch at once: the other
//     must still find it, from the first one's verdict)
//   4 as 0 with moe_dispatch_gemm (notify's barrier, then the fused launch sends nothing)
TEST(InProcessMoe, RanksThatDisagreeFailNamingIt) {
  MKT_REQUIRE_GPU();
  CommOptions options;
  options.timeout_seconds = 20.0;
  for (int variant = 0; variant < 5; ++variant) {
    run_in_process(
        2,
        [variant](Communicator& comm) {
          const int me = comm.rank();
          const MoeCase c{8, 2, 256, 64};
          const World w(c, comm.world_size(), 5, 0);
          MoeProblem p = problem_of(w, me);
          if (variant != 1) p.max_tokens += 8 * me;
          if (variant == 1) p.capacity = me == 0 ? 0 : 4096;
          MoeProblem largest = p;
          largest.max_tokens = w.max_tokens + 8;
          largest.capacity = 4096;
          const MoePlan plan = moe_plan(comm, p);
          // The same symmetric buffer on every rank (collective), zeroed: room for either plan.
          SymmetricBuffer ws = comm.alloc(
              std::max(moe_plan(comm, largest).workspace_bytes, plan.workspace_bytes) + 4096);
          cudaStream_t s;
          MKT_CUDA(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
          MKT_CUDA(cudaMemsetAsync(ws.data(), 0, ws.size(), s));
          Buffers b(p, plan, c.index);
          void *weights = nullptr, *y = nullptr;
          MKT_CUDA(cudaMalloc(&weights, plan.experts_local * 128 * c.hidden * 2));
          MKT_CUDA(cudaMalloc(&y, plan.rows * 128 * 2));
          upload_inputs(w, me, b, s);
          ready(comm, s);
          const auto dispatch = [&] {
            moe_dispatch(comm, p, b.x, b.topk, c.index, b.recv, b.rows, b.handle, ws.data(), s);
          };
          const char* op = variant == 2 && me == 1 ? "moe_combine"
                           : variant == 4          ? "moe_dispatch_gemm"
                                                   : "moe_dispatch";
          expect_ranks_disagree(
              comm, s,
              [&] {
                if (variant == 2 && me == 1) {
                  moe_combine(comm, p, b.recv, b.weights, b.handle, b.out, ws.data(), s);
                } else if (variant == 4) {
                  moe_dispatch_gemm(comm, p, b.x, b.topk, c.index, weights, BLayout::kNK, 128, y,
                                    b.recv, b.rows, b.handle, ws.data(), s);
                } else {
                  dispatch();
                }
                if (variant == 3) dispatch();
              },
              op, "variant " + std::to_string(variant));
          // Nothing in this rank's receive region: no peer sent a row (the workspace was zeroed).
          std::vector<uint8_t> host(ws.size());
          MKT_CUDA(cudaMemcpy(host.data(), ws.data(), host.size(), cudaMemcpyDeviceToHost));
          const std::size_t recv_x_begin =
              moe::plan_moe(comm.world_size(), 132, p, {}, "test").offsets.recv_x;
          const std::size_t recv_x_bytes =
              static_cast<std::size_t>(comm.world_size()) * p.max_tokens * p.hidden * 2;
          bool untouched = true;
          for (std::size_t i = recv_x_begin; i < recv_x_begin + recv_x_bytes && i < host.size();
               ++i) {
            untouched = untouched && host[i] == 0;
          }
          EXPECT_TRUE(untouched) << "variant " << variant << ": a peer's rows reached rank " << me;
          cudaFree(weights);
          cudaFree(y);
          cudaStreamDestroy(s);
        },
        options);
  }
}

// A combine handed a handle row outside its problem (a token past max_tokens: another dispatch's
// handle) skips that row and records it; check() names the row, and the communicator stays
// usable (the next combine with the dispatch's own handle runs).
TEST(InProcessMoe, CombineRefusesAForeignHandleRow) {
  MKT_REQUIRE_GPU();
  run_in_process(1, [](Communicator& comm) {
    const MoeCase c{8, 2, 256, 64};
    const World w(c, comm.world_size(), 9, 0);
    const MoeProblem p = problem_of(w, 0);
    const MoePlan plan = moe_plan(comm, p);
    SymmetricBuffer ws = comm.alloc(plan.workspace_bytes);
    cudaStream_t s;
    MKT_CUDA(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    Buffers b(p, plan, c.index);
    upload_inputs(w, 0, b, s);
    moe_dispatch(comm, p, b.x, b.topk, c.index, b.recv, b.rows, b.handle, ws.data(), s);
    comm.synchronize(s);
    std::vector<int32_t> handle(plan.rows * 3);
    MKT_CUDA(cudaMemcpy(handle.data(), b.handle, handle.size() * 4, cudaMemcpyDeviceToHost));
    int64_t row = -1;
    for (int64_t r = 0; r < plan.rows && row < 0; ++r) {
      if (handle[r * 3] >= 0) row = r;
    }
    ASSERT_GE(row, 0);
    std::vector<int32_t> foreign = handle;
    foreign[row * 3 + 1] = static_cast<int32_t>(p.max_tokens + 5);
    MKT_CUDA(cudaMemcpy(b.handle, foreign.data(), foreign.size() * 4, cudaMemcpyHostToDevice));
    moe_combine(comm, p, b.recv, b.weights, b.handle, b.out, ws.data(), s);
    try {
      comm.synchronize(s);
      ADD_FAILURE() << "no error for a handle row outside the problem";
    } catch (const Error& e) {
      const std::string msg = e.what();
      EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument) << msg;
      EXPECT_NE(msg.find("the handle's row " + std::to_string(row) + " has token " +
                         std::to_string(p.max_tokens + 5)),
                std::string::npos)
          << msg;
    }
    MKT_CUDA(cudaMemcpy(b.handle, handle.data(), handle.size() * 4, cudaMemcpyHostToDevice));
    moe_combine(comm, p, b.recv, b.weights, b.handle, b.out, ws.data(), s);
    EXPECT_NO_THROW(comm.synchronize(s));
    cudaStreamDestroy(s);
  });
}

TEST(InProcessMoe, RejectsBadArgumentsBeforeLaunch) {
  MKT_REQUIRE_GPU();
  run_in_process(2, [](Communicator& comm) {
    const MoeCase c{8, 2, 256, 64};
    const World w(c, comm.world_size(), 4, 0);
    const MoeProblem good = problem_of(w, comm.rank());
    const MoePlan plan = moe_plan(comm, good);
    SymmetricBuffer ws = comm.alloc(plan.workspace_bytes);
    cudaStream_t s;
    MKT_CUDA(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    Buffers b(good, plan, c.index);
    MKT_CUDA(cudaMemsetAsync(b.recv, 0xab, b.recv_bytes, s));
    MKT_CUDA(cudaMemsetAsync(b.handle, 0xab, b.handle_bytes, s));
    MKT_CUDA(cudaStreamSynchronize(s));
    void* plain;
    MKT_CUDA(cudaMalloc(&plain, plan.workspace_bytes));
    auto dispatch = [&](MoeProblem p, void* workspace = nullptr, const void* x = nullptr) {
      moe_dispatch(comm, p, x ? x : b.x, b.topk, c.index, b.recv, b.rows, b.handle,
                   workspace ? workspace : ws.data(), s);
    };
    auto with = [&](auto change) {
      MoeProblem p = good;
      change(p);
      return p;
    };
    expect_error([&] { dispatch(with([](MoeProblem& p) { p.num_experts = 7; })); },
                 ErrorCode::kInvalidArgument, "num_experts = 7");
    expect_error([&] { dispatch(with([](MoeProblem& p) { p.top_k = 17; })); },
                 ErrorCode::kInvalidArgument, "top_k = 17");
    expect_error([&] { dispatch(with([](MoeProblem& p) { p.hidden = 12; })); },
                 ErrorCode::kInvalidArgument, "hidden = 12");
    expect_error([&] { dispatch(with([](MoeProblem& p) { p.tokens = p.max_tokens + 1; })); },
                 ErrorCode::kInvalidArgument, "max_tokens");
    expect_error([&] { dispatch(good, plain); }, ErrorCode::kInvalidArgument, "workspace");
    expect_error([&] { dispatch(with([](MoeProblem& p) { p.max_tokens *= 4; })); },
                 ErrorCode::kOutOfMemory, "");  // the workspace is too small for it
    expect_error([&] { dispatch(good, nullptr, static_cast<char*>(b.x) + 2); },
                 ErrorCode::kInvalidArgument, "x");
    expect_error(
        [&] {
          moe_dispatch(comm, good, b.x, b.topk, c.index, b.recv, b.rows, b.handle, ws.data(), s,
                       MoeConfig{-1});
        },
        ErrorCode::kInvalidArgument, "config.sms");
    expect_error(
        [&] { moe_combine(comm, good, b.recv, b.weights, b.handle, b.recv, ws.data(), s); },
        ErrorCode::kInvalidArgument, "overlap");
    std::vector<unsigned char> recv(b.recv_bytes), handle(b.handle_bytes);
    cudaMemcpy(recv.data(), b.recv, recv.size(), cudaMemcpyDeviceToHost);
    cudaMemcpy(handle.data(), b.handle, handle.size(), cudaMemcpyDeviceToHost);
    EXPECT_TRUE(std::all_of(recv.begin(), recv.end(), [](unsigned char v) { return v == 0xab; }));
    EXPECT_TRUE(
        std::all_of(handle.begin(), handle.end(), [](unsigned char v) { return v == 0xab; }));
    comm.bootstrap().barrier();
    cudaFree(plain);
    cudaStreamDestroy(s);
  });
}

// ---- moe_dispatch_gemm ----------------------------------------------------------------------

struct FusedCase {
  MoeCase moe;
  int64_t n;
  BLayout w_layout;
  int block_n;  // both sides' tile width (the same tiles: the same bits)
  int sms = 0;  // MoeConfig::sms (few CTAs: fewer spinning waits under compute-sanitizer)
};

// moe_dispatch then grouped_gemm (the reference path) against moe_dispatch_gemm, on the same
// inputs: layout, counts and handle equal, every placed row and its y row bitwise equal. Every
// other call does not ask for recv_x: the GEMM's rows come from where they landed all the same,
// and recv_x is left alone.
void expect_fused(Communicator& comm, const FusedCase& f, uint64_t seed, int calls = 2) {
  const MoeCase& c = f.moe;
  const int world = comm.world_size(), rank = comm.rank();
  SCOPED_TRACE(describe(c, world) + ", N " + std::to_string(f.n) +
               (f.w_layout == BLayout::kKN ? ", w [E, H, N]" : ", w [E, N, H]") + ", block_n " +
               std::to_string(f.block_n) + ", rank " + std::to_string(rank));
  const MoeProblem p = problem_of(World(c, world, seed, 0), rank);
  MoeConfig config;
  config.block_n = f.block_n;
  config.sms = f.sms;
  const MoePlan plan = moe_plan(comm, p, config);
  const World w(c, world, seed, plan.capacity);  // the reference routing for the plan's room
  SymmetricBuffer ws = comm.alloc(plan.workspace_bytes);
  cudaStream_t s;
  MKT_CUDA(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  Buffers ref(p, plan, c.index), got(p, plan, c.index);
  const int64_t e_local = plan.experts_local;
  void *weights, *y_ref, *y_got;
  MKT_CUDA(cudaMalloc(&weights, e_local * f.n * c.hidden * 2));
  MKT_CUDA(cudaMalloc(&y_ref, plan.rows * f.n * 2));
  MKT_CUDA(cudaMalloc(&y_got, plan.rows * f.n * 2));
  fill_random_bf16(weights, e_local * f.n * c.hidden, seed * 7 + rank, s);
  upload_inputs(w, rank, ref, s);
  upload_inputs(w, rank, got, s);
  MKT_CUDA(cudaMemsetAsync(ws.data(), 0, plan.workspace_bytes, s));
  // count_different_bytes16 runs right after the combines, a peer's maybe still waiting for this
  // process's staging copies: its kernel loaded now, not lazily then (gemm_reference.h).
  preload_reference_kernels();
  ready(comm, s);
  GemmConfig gemm_config;
  gemm_config.block_n = f.block_n;
  // The reference GEMM on this rank's share of the SMs, as the op's own: a persistent grid wider
  // than the share waits for SMs that a peer's waiting kernel holds.
  gemm_config.sms = plan.ctas;
  for (int call = 0; call < calls; ++call) {
    SCOPED_TRACE("call " + std::to_string(call));
    // (Across nodes the rows pass through recv_x: a null one is refused before any launch.)
    const bool across = comm.topology().num_nodes > 1;
    const bool copy_rows = call % 2 == 0 || across;
    if (across && call == 1) {
      expect_error(
          [&] {
            moe_dispatch_gemm(comm, p, got.x, got.topk, c.index, weights, f.w_layout, f.n, y_got,
                              nullptr, got.rows, got.handle, ws.data(), s, config);
          },
          ErrorCode::kInvalidArgument, "recv_x is null");
    }
    MKT_CUDA(cudaMemsetAsync(got.recv, 0xff, got.recv_bytes, s));
    MKT_CUDA(cudaMemsetAsync(got.handle, 0x5a, got.handle_bytes, s));
    MKT_CUDA(cudaMemsetAsync(y_got, 0xff, plan.rows * f.n * 2, s));
    MKT_CUDA(cudaMemsetAsync(y_ref, 0xff, plan.rows * f.n * 2, s));
    moe_dispatch(comm, p, ref.x, ref.topk, c.index, ref.recv, ref.rows, ref.handle, ws.data(), s,
                 config);
    grouped_gemm(ref.recv, weights, y_ref, ref.rows, static_cast<int>(e_local), plan.capacity, f.n,
                 c.hidden, f.w_layout, s, gemm_config,
                 c.layout == MoeLayout::kMasked ? GroupedLayout::kMasked : GroupedLayout::kPadded);
    moe_dispatch_gemm(comm, p, got.x, got.topk, c.index, weights, f.w_layout, f.n, y_got,
                      copy_rows ? got.recv : nullptr, got.rows, got.handle, ws.data(), s, config);
    try {
      comm.synchronize(s);
    } catch (const Error& e) {  // overflow cases: the same data error from both calls
      EXPECT_EQ(e.code(), ErrorCode::kOutOfMemory) << e.what();
    }
    EXPECT_NO_THROW(comm.check());
    ASSERT_NO_FATAL_FAILURE(check_dispatch(w, rank, plan, got, s, copy_rows));
    if (!copy_rows) {
      std::vector<unsigned char> recv(got.recv_bytes);
      MKT_CUDA(cudaMemcpy(recv.data(), got.recv, recv.size(), cudaMemcpyDeviceToHost));
      EXPECT_TRUE(std::all_of(recv.begin(), recv.end(), [](unsigned char v) { return v == 0xff; }))
          << "recv_x written by a call that did not ask for it";
    }
    std::vector<int32_t> handle(plan.rows * 3);
    MKT_CUDA(cudaMemcpy(handle.data(), got.handle, handle.size() * 4, cudaMemcpyDeviceToHost));
    std::vector<uint16_t> a(plan.rows * f.n), b(plan.rows * f.n);
    MKT_CUDA(cudaMemcpy(a.data(), y_got, a.size() * 2, cudaMemcpyDeviceToHost));
    MKT_CUDA(cudaMemcpy(b.data(), y_ref, b.size() * 2, cudaMemcpyDeviceToHost));
    int64_t bad = 0, placed = 0;
    for (int64_t r = 0; r < plan.rows; ++r) {
      if (handle[r * 3] < 0) continue;
      ++placed;
      if (std::memcmp(&a[r * f.n], &b[r * f.n], f.n * 2) != 0 && bad++ < 5) {
        ADD_FAILURE() << "y row " << r << " (from rank " << handle[r * 3] << ", token "
                      << handle[r * 3 + 1] << ", slot " << handle[r * 3 + 2]
                      << ") differs from the grouped GEMM's";
      }
    }
    EXPECT_EQ(bad, 0) << "of " << placed << " rows";
    if (f.n == c.hidden && c.layout == MoeLayout::kPadded) {
      // A combine right after: the fused launch ended as launches do (a combine that took the
      // fused launch's chunk signals for its own would sum rows that have not arrived).
      MKT_CUDA(cudaMemsetAsync(got.out, 0xff, got.out_bytes, s));
      MKT_CUDA(cudaMemsetAsync(ref.out, 0xff, ref.out_bytes, s));
      // Every rank done with its checks' copies first (as ready() says why).
      ready(comm, s);
      moe_combine(comm, p, y_got, got.weights, got.handle, got.out, ws.data(), s, config);
      moe_combine(comm, p, y_ref, ref.weights, ref.handle, ref.out, ws.data(), s, config);
      comm.synchronize(s);
      EXPECT_EQ(count_different_bytes16(got.out, ref.out, got.out_bytes, s), 0u)
          << "combine after the fused launch";
    }
    ready(comm, s);
  }
  // Every rank's puts delivered before cudaFree synchronises the GPU (collective_checks.h).
  finished(comm, s);
  for (void* q : {weights, y_ref, y_got}) cudaFree(q);
  comm.bootstrap().barrier();
  cudaStreamDestroy(s);
}

void run_fused(int world, const std::vector<FusedCase>& cases, uint64_t seed,
               CommOptions options = {}) {
  run_in_process(
      world,
      [&](Communicator& comm) {
        for (size_t i = 0; i < cases.size(); ++i) {
          if (cases[i].moe.experts % world != 0) continue;
          expect_fused(comm, cases[i], seed + i);
        }
      },
      options);
}

// moe_dispatch_gemm across virtual nodes (two launches there: the dispatch across nodes, then
// the grouped GEMM): its rows, counts and handle as the one-node routing's, y as the grouped
// GEMM's on those rows, bit for bit; a combine after it.
TEST_P(MoeNodes, DispatchGemm) {
  MKT_REQUIRE_GPU();
  const auto [nodes, per_node] = GetParam();
  run_fused(nodes * per_node,
            {{{8, 2, 1024, 200}, 1024, BLayout::kNK, 128},
             {{16, 4, 512, 130, MoeLayout::kMasked, 0, IndexType::kInt64}, 256, BLayout::kKN, 64},
             {{16, 4, 256, 120, MoeLayout::kPadded, 300, IndexType::kInt32, Routing::kSkewed},
              256,
              BLayout::kNK,
              256}},
            71, virtual_nodes(per_node, 30));
}

const std::vector<FusedCase> kFusedCases = {
    {{8, 2, 512, 300}, 264, BLayout::kNK, 128},
    {{16, 4, 256, 150, MoeLayout::kPadded, 0, IndexType::kInt64}, 256, BLayout::kNK, 256},
    {{16, 4, 256, 200, MoeLayout::kMasked, 0, IndexType::kInt64}, 512, BLayout::kKN, 256},
    {{64, 8, 1024, 96, MoeLayout::kPadded, 0, IndexType::kInt32, Routing::kSkewed},
     136,
     BLayout::kNK,
     64},
    {{8, 1, 128, 500, MoeLayout::kPadded, 0, IndexType::kInt32, Routing::kOneExpert, 1},
     128,
     BLayout::kNK,
     192},
    {{8, 4, 256, 200, MoeLayout::kMasked, 20, IndexType::kInt32, Routing::kSkewed},
     256,
     BLayout::kNK,
     128},  // overflow: the rows that fit
    // H not a multiple of 64: the last k-block's pieces past H zero-filled (the gather's own,
    // where TMA's box fill did it)
    {{16, 4, 200, 150}, 136, BLayout::kNK, 128},
};

TEST(InProcessMoeDispatchGemm, World1) {
  MKT_REQUIRE_GPU();
  run_fused(1, kFusedCases, 71);
}

TEST(InProcessMoeDispatchGemm, World2) {
  MKT_REQUIRE_GPU();
  run_fused(2, kFusedCases, 81);
}

TEST(InProcessMoeDispatchGemm, World4) {
  MKT_REQUIRE_GPU();
  run_fused(4, kFusedCases, 91);
}

// One captured launch (route, notify, the fused kernel), replayed with new routing and tokens.
TEST(InProcessMoeDispatchGemm, GraphReplaysWithNewRouting) {
  MKT_REQUIRE_GPU();
  run_in_process(2, [](Communicator& comm) {
    const int rank = comm.rank();
    const MoeCase c{16, 4, 256, 120};
    const int64_t n = 256;
    const World first(c, comm.world_size(), 5, 0);
    const MoeProblem p = problem_of(first, rank);
    MoeConfig config;
    config.block_n = 128;
    GemmConfig gemm_config;
    gemm_config.block_n = 128;
    const MoePlan plan = moe_plan(comm, p, config);
    SymmetricBuffer ws = comm.alloc(plan.workspace_bytes);
    cudaStream_t s;
    MKT_CUDA(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    MKT_CUDA(cudaMemsetAsync(ws.data(), 0, plan.workspace_bytes, s));
    Buffers b(p, plan, c.index), ref(p, plan, c.index);
    void *weights, *y, *y_ref;
    MKT_CUDA(cudaMalloc(&weights, plan.experts_local * n * c.hidden * 2));
    MKT_CUDA(cudaMalloc(&y, plan.rows * n * 2));
    MKT_CUDA(cudaMalloc(&y_ref, plan.rows * n * 2));
    fill_random_bf16(weights, plan.experts_local * n * c.hidden, 99 + rank, s);
    upload_inputs(first, rank, b, s);
    ready(comm, s);
    // (Without recv_x: the replays gather every row from where it landed.)
    auto fused = [&] {
      moe_dispatch_gemm(comm, p, b.x, b.topk, c.index, weights, BLayout::kNK, n, y, nullptr, b.rows,
                        b.handle, ws.data(), s, config);
    };
    fused();
    comm.synchronize(s);
    cudaGraph_t graph;
    MKT_CUDA(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
    fused();
    MKT_CUDA(cudaStreamEndCapture(s, &graph));
    cudaGraphExec_t exec;
    ASSERT_NO_FATAL_FAILURE(instantiate_uploaded(graph, s, &exec));
    comm.bootstrap().barrier();
    for (int replay = 0; replay < 20; ++replay) {
      SCOPED_TRACE("replay " + std::to_string(replay));
      MoeCase ci = c;
      ci.routing = replay % 2 ? Routing::kSkewed : Routing::kRandom;
      const World w(ci, comm.world_size(), 500 + replay, plan.capacity);
      upload_inputs(w, rank, b, s);
      upload_inputs(w, rank, ref, s);
      ready(comm, s);
      MKT_CUDA(cudaGraphLaunch(exec, s));
      comm.synchronize(s);
      ASSERT_NO_FATAL_FAILURE(check_dispatch(w, rank, plan, b, s, /*placed_rows=*/false));
      // The reference: moe_dispatch's rows through the grouped GEMM.
      moe_dispatch(comm, p, ref.x, ref.topk, c.index, ref.recv, ref.rows, ref.handle, ws.data(), s);
      comm.synchronize(s);
      ASSERT_NO_FATAL_FAILURE(check_dispatch(w, rank, plan, ref, s));
      grouped_gemm(ref.recv, weights, y_ref, ref.rows, plan.experts_local, plan.capacity, n,
                   c.hidden, BLayout::kNK, s, gemm_config, GroupedLayout::kPadded);
      MKT_CUDA(cudaStreamSynchronize(s));
      std::vector<int32_t> handle(plan.rows * 3);
      std::vector<uint16_t> got(plan.rows * n), want(plan.rows * n);
      MKT_CUDA(cudaMemcpy(handle.data(), b.handle, handle.size() * 4, cudaMemcpyDeviceToHost));
      MKT_CUDA(cudaMemcpy(got.data(), y, got.size() * 2, cudaMemcpyDeviceToHost));
      MKT_CUDA(cudaMemcpy(want.data(), y_ref, want.size() * 2, cudaMemcpyDeviceToHost));
      int64_t bad = 0;
      for (int64_t r = 0; r < plan.rows; ++r) {
        if (handle[r * 3] >= 0 && std::memcmp(&got[r * n], &want[r * n], n * 2) != 0) ++bad;
      }
      EXPECT_EQ(bad, 0);
    }
    comm.bootstrap().barrier();
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
    for (void* q : {weights, y, y_ref}) cudaFree(q);
    cudaStreamDestroy(s);
  });
}

TEST(InProcessMoeDispatchGemm, MissingRankTimesOut) {
  MKT_REQUIRE_GPU();
  CommOptions options;
  options.timeout_seconds = 1.0;
  run_in_process(
      2,
      [](Communicator& comm) {
        const MoeCase c{8, 2, 256, 64};
        const World w(c, comm.world_size(), 6, 0);
        const MoeProblem p = problem_of(w, comm.rank());
        const MoePlan plan = moe_plan(comm, p);
        SymmetricBuffer ws = comm.alloc(plan.workspace_bytes);
        cudaStream_t s;
        MKT_CUDA(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
        Buffers b(p, plan, c.index);
        void *weights, *y;
        MKT_CUDA(cudaMalloc(&weights, plan.experts_local * 128 * c.hidden * 2));
        MKT_CUDA(cudaMalloc(&y, plan.rows * 128 * 2));
        upload_inputs(w, comm.rank(), b, s);
        ready(comm, s);
        expect_missing_rank_times_out(comm, s, [&] {
          // (No recv_x: the gather reads where row_src says, never landed - its entries are
          // checked before any copy.)
          moe_dispatch_gemm(comm, p, b.x, b.topk, c.index, weights, BLayout::kNK, 128, y, nullptr,
                            b.rows, b.handle, ws.data(), s);
        });
        cudaFree(weights);
        cudaFree(y);
        cudaStreamDestroy(s);
      },
      options);
}

// Ranks as mkrun processes (ctest gpu_mkrun_w2 / w4 / w8): sharing a GPU, they time-slice.
TEST(LaunchedMoe, DispatchGemmMatchesTheGroupedGemm) {
  MKT_REQUIRE_MKRUN();
  auto comm = launched_comm();
  for (size_t i = 0; i < kFusedCases.size(); ++i) {
    if (kFusedCases[i].moe.experts % comm->world_size() != 0) continue;
    expect_fused(*comm, kFusedCases[i], 121 + i);
  }
}

// The compiler's resource report for the MoE kernels on the GEMM engine: no local memory.
TEST(InProcessMoe, KernelsDoNotSpill) {
  MKT_REQUIRE_GPU();
  const std::vector<GemmKernelResources> kernels = detail::moe_kernel_resources();
  // moe_dispatch_gemm 4 widths x 2 B layouts, moe_layer 2, its expert GEMMs across nodes 2
  ASSERT_EQ(kernels.size(), 12u);
  for (const GemmKernelResources& k : kernels) {
    EXPECT_EQ(k.local_bytes, 0) << k.name << " uses local memory (register spills or a stack)";
    std::printf("  %-28s %3d registers\n", k.name.c_str(), k.registers);
  }
}

// The SanitizeMoe cases run at world 1 first, then at world 2: at world 1 no launch waits for a
// peer, so the sanitizer checks every kernel of the case (they do not depend on the world size)
// even in a run whose world-2 part fails. At world 2 every launch after host-side work comes after
// a meeting (MoeCase::meet; expect_fused's combines always do): under racecheck and memcheck the
// world-2 part hung in some runs without it - two time limits back to back, the first rank's
// launch waiting for its peer's, which started only once that one had given up - the signature
// of a rank's host call that waits for the whole GPU while a peer's kernel waits for this rank
// (docs/design/moe.md, "The two-rank hang under compute-sanitizer").
TEST(SanitizeMoe, DispatchGemm) {
  MKT_REQUIRE_GPU();
  // Four CTAs a rank, in every launch of the case (the reference dispatch and the combines too):
  // under the sanitizer every spinning wait is slow, and few CTAs spin fewer of them. (Not what
  // stopped the hangs above: one CTA a rank hung as often.)
  const std::vector<FusedCase> cases = {{{8, 2, 128, 40}, 128, BLayout::kNK, 128, 4}};
  run_fused(1, cases, 111);
  run_fused(2, cases, 111);
}

TEST(SanitizeMoe, Small) {
  MKT_REQUIRE_GPU();
  std::vector<MoeCase> cases = {{8, 2, 64, 40},
                                {8, 4, 64, 33, MoeLayout::kMasked, 9, IndexType::kInt64}};
  // Four CTAs a rank, as above (the cases' every launch), and a meeting before each launch.
  for (MoeCase& c : cases) {
    c.sms = 4;
    c.meet = true;
  }
  run_cases(1, cases, 61);
  run_cases(2, cases, 61);
}

}  // namespace
}  // namespace mk::test
