// moe_layer (mkernel/moe.h) against a CPU reference of the whole layer, ranks as threads of one
// process (sharing the GPU when there are fewer GPUs than ranks): worlds 1, 2, 4 and 8.
//
// Every rank builds every expert's weights from the shared seed (w13 [2I, H]: gate rows then up
// rows; w2 [H, I]) and uploads its own experts'. The reference, in double from the same bf16
// inputs: per token, per slot j with expert e, gate and up = x . rows of w13, inter =
// bf16(silu(gate) * up), y = bf16(inter . rows of w2), out = bf16(sum_j w_j y_j). The GPU sums in
// fp32 in another order, so an intermediate or a y may round the other way: the bound (about 6%
// of a typical output, measured on a model of the arithmetic) covers that and the fp32 sums'
// error, far below what a wrong expert, slot, weight, a gate / up mix-up or a lost K tail gives
// (errors of 30-40x the bound in that model); a small numeric drift (1% on the gate) would pass.
// Also: -1 slots, skewed routing with empty experts, ranks with fewer tokens, padded and masked
// layouts, deterministic repeats, graph replays with new routing and inputs, capacity overflow
// (the rows that fit summed, the error raised), a missing rank (the time-limit error), refusals
// before launch with the output untouched.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <numeric>
#include <random>

#include "../cpu/moe_reference.h"
#include "collective_checks.h"
#include "gpu_test_util.h"
#include "mkernel/moe.h"

namespace mk::test {
namespace {

struct LayerCase {
  int experts;
  int top_k;
  int64_t hidden;
  int64_t inter;
  int64_t tokens;  // rank r has tokens - (r % 2) * tokens / 3
  MoeLayout layout = MoeLayout::kPadded;
  bool skewed = false;
  int sms = 0;  // MoeConfig::sms (few CTAs: many waves, down tiles waiting on other CTAs' rows)
  int64_t capacity = 0;  // MoeProblem::capacity (0: every row fits)
};

std::string describe(const LayerCase& c, int world) {
  return "world " + std::to_string(world) + ", E " + std::to_string(c.experts) + ", top-" +
         std::to_string(c.top_k) + ", H " + std::to_string(c.hidden) + ", I " +
         std::to_string(c.inter) + ", T " + std::to_string(c.tokens) +
         (c.layout == MoeLayout::kMasked ? ", masked" : ", padded") + (c.skewed ? ", skewed" : "") +
         (c.sms ? ", sms " + std::to_string(c.sms) : "");
}

int64_t tokens_of(const LayerCase& c, int rank) { return c.tokens - (rank % 2) * c.tokens / 3; }

std::vector<uint16_t> random_bf16(std::size_t n, uint64_t seed, float scale) {
  std::mt19937_64 gen(seed);
  std::uniform_real_distribution<float> u(-scale, scale);
  std::vector<uint16_t> out(n);
  for (auto& v : out) v = float_to_bf16(u(gen));
  return out;
}

// Expert e's weights: w13 [2I][H] then w2 [H][I], entries of size ~1/sqrt(fan-in).
struct ExpertWeights {
  std::vector<uint16_t> w13, w2;
};
ExpertWeights expert_weights(const LayerCase& c, int e, uint64_t seed) {
  return {random_bf16(static_cast<std::size_t>(2 * c.inter * c.hidden), seed * 977 + 2 * e,
                      2.f / std::sqrt(static_cast<float>(c.hidden))),
          random_bf16(static_cast<std::size_t>(c.hidden * c.inter), seed * 977 + 2 * e + 1,
                      2.f / std::sqrt(static_cast<float>(c.inter)))};
}

// A rank's routing [T][k]: distinct experts per token, some slots -1; skewed: expert i drawn
// with weight 1 / (i + 1)^1.5 (the high ones often get no row at all).
std::vector<int32_t> routing(const LayerCase& c, int64_t tokens, uint64_t seed) {
  std::mt19937_64 gen(seed);
  std::vector<int32_t> topk(static_cast<std::size_t>(tokens * c.top_k), -1);
  for (int64_t t = 0; t < tokens; ++t) {
    std::vector<double> w(c.experts);
    for (int i = 0; i < c.experts; ++i) w[i] = c.skewed ? 1.0 / std::pow(i + 1.0, 1.5) : 1.0;
    for (int j = 0; j < c.top_k; ++j) {
      std::discrete_distribution<int> pick(w.begin(), w.end());
      const int e = pick(gen);
      w[e] = 0;
      topk[static_cast<std::size_t>(t * c.top_k + j)] = gen() % 9 == 0 ? -1 : e;
    }
  }
  return topk;
}

struct Inputs {
  std::vector<uint16_t> x;
  std::vector<int32_t> topk;
  std::vector<float> weights;
};
Inputs inputs_of(const LayerCase& c, int rank, uint64_t seed) {
  const int64_t tokens = tokens_of(c, rank);
  Inputs in;
  in.x = random_bf16(static_cast<std::size_t>(tokens * c.hidden), seed * 31 + rank, 1.f);
  in.topk = routing(c, tokens, seed * 37 + rank);
  std::mt19937_64 gen(seed * 41 + rank);
  std::uniform_real_distribution<float> u(0.05f, 1.f);
  in.weights.resize(in.topk.size());
  for (float& v : in.weights) v = u(gen);
  return in;
}

// The reference out [T][H] and each element's bound.
void reference(const LayerCase& c, const Inputs& in, const std::vector<ExpertWeights>& experts,
               std::vector<double>& out, std::vector<double>& bound) {
  const int64_t tokens = static_cast<int64_t>(in.topk.size()) / c.top_k;
  const int64_t h = c.hidden, n = c.inter;
  out.assign(static_cast<std::size_t>(tokens * h), 0.0);
  bound.assign(out.size(), 0.0);
  std::vector<double> xt(h), inter(n), inter_abs(n);
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t i = 0; i < h; ++i) xt[i] = bf16_to_float(in.x[t * h + i]);
    std::vector<double> sum(h, 0.0), err(h, 0.0);
    for (int j = 0; j < c.top_k; ++j) {
      const int e = in.topk[t * c.top_k + j];
      if (e < 0) continue;
      const ExpertWeights& w = experts[e];
      for (int64_t r = 0; r < n; ++r) {
        double gate = 0, up = 0;
        for (int64_t i = 0; i < h; ++i) {
          gate += xt[i] * bf16_to_float(w.w13[r * h + i]);
          up += xt[i] * bf16_to_float(w.w13[(n + r) * h + i]);
        }
        const double act = gate / (1.0 + std::exp(-gate)) * up;
        inter[r] = bf16_to_float(float_to_bf16(static_cast<float>(act)));
        inter_abs[r] = std::fabs(inter[r]);
      }
      const double wj = in.weights[t * c.top_k + j];
      for (int64_t o = 0; o < h; ++o) {
        double y = 0, y_abs = 0;
        for (int64_t r = 0; r < n; ++r) {
          const double w2 = bf16_to_float(w.w2[o * n + r]);
          y += inter[r] * w2;
          y_abs += inter_abs[r] * std::fabs(w2);
        }
        const double yb = bf16_to_float(float_to_bf16(static_cast<float>(y)));
        sum[o] += wj * yb;
        // y: one ulp of its rounding; the intermediates: 2^-8 of each (half a bf16 ulp at
        // most) for all of them at once - only those whose exact value lies within the fp32
        // sums' error of a rounding midpoint can round the other way (by one ulp), a few in a
        // row, so this exceeds their share by far; the fp32 sums' error.
        err[o] += wj * (ulp(yb, DType::kBF16) + y_abs * (std::ldexp(1.0, -8) + 1e-6));
      }
    }
    for (int64_t o = 0; o < h; ++o) {
      const double r = bf16_to_float(float_to_bf16(static_cast<float>(sum[o])));
      out[t * h + o] = r;
      bound[t * h + o] = 2 * ulp(r, DType::kBF16) + err[o] + 1e-6;
    }
  }
}

struct LayerBuffers {
  void *x = nullptr, *topk = nullptr, *w13 = nullptr, *w2 = nullptr, *out = nullptr;
  void* scratch = nullptr;
  float* weights = nullptr;
  std::size_t out_bytes = 0;
  LayerBuffers(const LayerCase& c, const MoeProblem& p, int e_local, std::size_t scratch_bytes) {
    const auto t = static_cast<std::size_t>(std::max<int64_t>(p.tokens, 1));
    out_bytes = t * c.hidden * 2;
    cudaMalloc(&x, t * c.hidden * 2);
    cudaMalloc(&topk, t * c.top_k * 4);
    cudaMalloc(reinterpret_cast<void**>(&weights), t * c.top_k * 4);
    cudaMalloc(&w13, static_cast<std::size_t>(e_local) * 2 * c.inter * c.hidden * 2);
    cudaMalloc(&w2, static_cast<std::size_t>(e_local) * c.hidden * c.inter * 2);
    cudaMalloc(&out, out_bytes);
    cudaMalloc(&scratch, scratch_bytes);
  }
  ~LayerBuffers() {
    for (void* p : {x, topk, static_cast<void*>(weights), w13, w2, out, scratch}) cudaFree(p);
  }
  // This rank's experts, rank * E_local + l for l < E_local, into w13 and w2.
  void upload_experts(const std::vector<ExpertWeights>& all, int rank, int e_local,
                      cudaStream_t s) const {
    for (int l = 0; l < e_local; ++l) {
      const ExpertWeights& w = all[rank * e_local + l];
      cudaMemcpyAsync(static_cast<uint16_t*>(w13) + l * w.w13.size(), w.w13.data(),
                      w.w13.size() * 2, cudaMemcpyHostToDevice, s);
      cudaMemcpyAsync(static_cast<uint16_t*>(w2) + l * w.w2.size(), w.w2.data(), w.w2.size() * 2,
                      cudaMemcpyHostToDevice, s);
    }
  }
  void upload(const Inputs& in, cudaStream_t s) const {
    if (in.topk.empty()) return;
    cudaMemcpyAsync(x, in.x.data(), in.x.size() * 2, cudaMemcpyHostToDevice, s);
    cudaMemcpyAsync(topk, in.topk.data(), in.topk.size() * 4, cudaMemcpyHostToDevice, s);
    cudaMemcpyAsync(weights, in.weights.data(), in.weights.size() * 4, cudaMemcpyHostToDevice, s);
    cudaStreamSynchronize(s);
  }
};

MoeProblem problem_of(const LayerCase& c, int rank) {
  MoeProblem p;
  p.tokens = tokens_of(c, rank);
  p.max_tokens = c.tokens;
  p.hidden = c.hidden;
  p.top_k = c.top_k;
  p.num_experts = c.experts;
  p.layout = c.layout;
  p.capacity = c.capacity;
  return p;
}

// One rank's layer, ready to be called: every expert's weights (from `weight_seed`; this rank's
// uploaded), the workspace zeroed, a stream, the buffers; its inputs are uploaded per call.
struct RankLayer {
  LayerCase c;
  int rank, e_local;
  MoeProblem p;
  MoeConfig config;
  std::vector<ExpertWeights> all;
  std::size_t ws_bytes;
  SymmetricBuffer ws;
  cudaStream_t s = nullptr;
  LayerBuffers b;

  static MoeConfig config_of(const LayerCase& c) {
    MoeConfig config;
    config.sms = c.sms;
    return config;
  }
  static std::vector<ExpertWeights> weights_of(const LayerCase& c, uint64_t seed) {
    std::vector<ExpertWeights> all;
    for (int e = 0; e < c.experts; ++e) all.push_back(expert_weights(c, e, seed));
    return all;
  }
  static cudaStream_t new_stream() {
    cudaStream_t s = nullptr;
    EXPECT_EQ(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), cudaSuccess);
    return s;
  }

  RankLayer(Communicator& comm, const LayerCase& layer, uint64_t weight_seed)
      : c(layer),
        rank(comm.rank()),
        e_local(layer.experts / comm.world_size()),
        p(problem_of(layer, rank)),
        config(config_of(layer)),
        all(weights_of(layer, weight_seed)),
        ws_bytes(moe_workspace_bytes(comm, p)),
        ws(comm.alloc(ws_bytes)),
        s(new_stream()),
        b(layer, p, e_local, moe_layer_plan(comm, p, layer.inter, config).scratch_bytes) {
    b.upload_experts(all, rank, e_local, s);
    EXPECT_EQ(cudaMemsetAsync(ws.data(), 0, ws_bytes, s), cudaSuccess);
    EXPECT_EQ(cudaStreamSynchronize(s), cudaSuccess);
  }
  ~RankLayer() { cudaStreamDestroy(s); }
  RankLayer(const RankLayer&) = delete;
  RankLayer& operator=(const RankLayer&) = delete;

  void call(Communicator& comm) {
    moe_layer(comm, p, c.inter, b.x, b.topk, IndexType::kInt32, b.weights, b.w13, b.w2, b.out,
              ws.data(), b.scratch, s, config);
  }
};

std::vector<uint16_t> download(const LayerBuffers& b, std::size_t count, cudaStream_t s) {
  std::vector<uint16_t> out(count);
  if (count > 0) cudaMemcpyAsync(out.data(), b.out, count * 2, cudaMemcpyDeviceToHost, s);
  cudaStreamSynchronize(s);
  return out;
}

void expect_matches(const LayerCase& c, const Inputs& in, const std::vector<ExpertWeights>& all,
                    const std::vector<uint16_t>& got) {
  std::vector<double> want, bound;
  reference(c, in, all, want, bound);
  ASSERT_EQ(got.size(), want.size());
  int64_t bad = 0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    const double g = bf16_to_float(got[i]);
    if (!(std::fabs(g - want[i]) <= bound[i])) {
      if (bad++ < 5) {
        ADD_FAILURE() << "out[" << i / c.hidden << "][" << i % c.hidden << "] = " << g
                      << ", reference " << want[i] << " (bound " << bound[i] << ")";
      }
    }
  }
  EXPECT_EQ(bad, 0) << "elements outside the bound";
}

void expect_layer(Communicator& comm, const LayerCase& c, uint64_t seed) {
  const int rank = comm.rank();
  SCOPED_TRACE(describe(c, comm.world_size()) + ", rank " + std::to_string(rank));
  RankLayer l(comm, c, seed);
  const MoeLayerPlan plan = moe_layer_plan(comm, l.p, c.inter, l.config);
  EXPECT_EQ(plan.intermediate, c.inter);
  EXPECT_GT(plan.scratch_bytes, 0u);
  const Inputs in = inputs_of(c, rank, seed);
  l.b.upload(in, l.s);
  MKT_CUDA(cudaMemsetAsync(l.b.out, 0xff, l.b.out_bytes, l.s));  // poison
  ready(comm, l.s);
  l.call(comm);
  comm.synchronize(l.s);
  const std::size_t count = static_cast<std::size_t>(l.p.tokens * c.hidden);
  const std::vector<uint16_t> first = download(l.b, count, l.s);
  ASSERT_NO_FATAL_FAILURE(expect_matches(c, in, l.all, first));
  // Deterministic: the same bits again.
  ready(comm, l.s);
  l.call(comm);
  comm.synchronize(l.s);
  EXPECT_TRUE(download(l.b, count, l.s) == first) << "a second call wrote other bits";
  comm.bootstrap().barrier();
}

// Three calls back to back with the last rank late before each (collective_checks.h), each on
// tokens, routing and an output of its own and the same workspace: none deadlocks, each call
// made alone matches the reference, and each of the three writes its bits.
void expect_back_to_back(Communicator& comm, const LayerCase& c, uint64_t seed) {
  constexpr int kCalls = 3;
  const int rank = comm.rank();
  SCOPED_TRACE(describe(c, comm.world_size()) +
               ", three calls back to back, the last rank late, rank " + std::to_string(rank));
  ASSERT_EQ(c.experts % comm.world_size(), 0);
  // Each layer: the same experts' weights (seed), its own inputs and buffers; the calls run on
  // the first one's workspace and stream.
  std::vector<std::unique_ptr<RankLayer>> l;
  std::vector<Inputs> in;
  for (int i = 0; i < kCalls; ++i) {
    l.push_back(std::make_unique<RankLayer>(comm, c, seed));
    in.push_back(inputs_of(c, rank, seed + 100 * (i + 1)));
    l[i]->b.upload(in[i], l[i]->s);
  }
  RankLayer& first = *l[0];
  const auto call = [&](int i) {
    const LayerBuffers& b = l[i]->b;
    moe_layer(comm, first.p, c.inter, b.x, b.topk, IndexType::kInt32, b.weights, b.w13, b.w2, b.out,
              first.ws.data(), b.scratch, first.s, first.config);
  };
  const std::size_t count = static_cast<std::size_t>(first.p.tokens * c.hidden);
  std::vector<std::vector<uint16_t>> alone;
  for (int i = 0; i < kCalls; ++i) {
    MKT_CUDA(cudaMemsetAsync(l[i]->b.out, 0xff, l[i]->b.out_bytes, first.s));  // poison
    ready(comm, first.s);
    call(i);
    finished(comm, first.s);
    alone.push_back(download(l[i]->b, count, first.s));
    ASSERT_NO_FATAL_FAILURE(expect_matches(c, in[i], first.all, alone[i]));
    MKT_CUDA(cudaMemsetAsync(l[i]->b.out, 0xff, l[i]->b.out_bytes, first.s));
  }
  ready(comm, first.s);
  call_back_to_back_one_late(comm, first.s, kCalls, call);
  for (int i = 0; i < kCalls; ++i) {
    EXPECT_TRUE(download(l[i]->b, count, first.s) == alone[i])
        << "call " << i << ": other bits than the call made alone";
  }
  comm.bootstrap().barrier();
}

// 24 experts: every world of the tests below divides them.
const std::vector<LayerCase> kBackToBackCases = {{24, 2, 256, 128, 150},
                                                 {24, 4, 128, 64, 90, MoeLayout::kMasked, true}};

void run_layer_cases(int world, const std::vector<LayerCase>& cases, uint64_t seed,
                     CommOptions options = {}) {
  run_in_process(
      world,
      [&](Communicator& comm) {
        for (std::size_t i = 0; i < cases.size(); ++i) {
          if (cases[i].experts % world != 0) continue;
          expect_layer(comm, cases[i], seed + i);
        }
      },
      options);
}

// Across virtual nodes over the socket transport (three launches there: the dispatch across
// nodes, the expert GEMMs, the combine across nodes): the reference's tolerance and the same bits
// twice.
class MoeLayerNodes : public AcrossNodes {};
TEST_P(MoeLayerNodes, Layer) {
  MKT_REQUIRE_GPU();
  const auto [nodes, per_node] = GetParam();
  run_layer_cases(nodes * per_node,
                  {{8, 2, 256, 128, 150},
                   {16, 4, 256, 64, 100, MoeLayout::kPadded, true},
                   {8, 2, 128, 128, 90, MoeLayout::kMasked}},
                  1001, virtual_nodes(per_node, 30));
}
// The same with the layouts of three nodes (MoeLayerNodes' cases need no divisor of 3), where
// the ring across nodes deadlocked with a late rank.
class MoeLayerLateRank : public AcrossNodes {};
TEST_P(MoeLayerLateRank, BackToBackCalls) {
  MKT_REQUIRE_GPU();
  const auto [nodes, per_node] = GetParam();
  run_in_process(
      nodes * per_node,
      [](Communicator& comm) {
        for (std::size_t i = 0; i < kBackToBackCases.size(); ++i) {
          expect_back_to_back(comm, kBackToBackCases[i], 1201 + i);
        }
      },
      virtual_nodes(per_node, 30));
}
INSTANTIATE_TEST_SUITE_P(MoeAcrossNodes, MoeLayerLateRank,
                         ::testing::Values(NodesLayout{2, 2}, NodesLayout{3, 1}, NodesLayout{3, 2},
                                           NodesLayout{2, 4}),
                         layout_name);
INSTANTIATE_TEST_SUITE_P(MoeAcrossNodes, MoeLayerNodes,
                         ::testing::Values(NodesLayout{2, 1}, NodesLayout{2, 2}, NodesLayout{4, 1},
                                           NodesLayout{2, 4}),
                         layout_name);

TEST(InProcessMoeLayer, World1) {
  MKT_REQUIRE_GPU();
  run_layer_cases(1,
                  {{8, 2, 256, 128, 300},
                   {16, 4, 512, 192, 200, MoeLayout::kMasked},
                   {8, 1, 136, 64, 130, MoeLayout::kPadded, true},
                   // ~6000 rows: the experts' GEMMs take 128 x 256 tiles (128 h columns) here,
                   // the 128 x 128 ones in the cases above.
                   {8, 2, 256, 256, 3000}},
                  501);
}

TEST(InProcessMoeLayer, World2) {
  MKT_REQUIRE_GPU();
  run_layer_cases(2,
                  {{8, 2, 256, 128, 150},
                   {16, 8, 256, 64, 100, MoeLayout::kPadded, true},
                   {8, 2, 128, 128, 90, MoeLayout::kMasked}},
                  601);
}

// Few CTAs for the experts' GEMMs (and the dispatch / combine): many waves, so down tiles wait for
// gate / up tiles of their rows on other CTAs, and a CTA's own earlier gate / up tiles.
TEST(InProcessMoeLayer, FewCtas) {
  MKT_REQUIRE_GPU();
  run_layer_cases(1,
                  {{8, 2, 256, 192, 700, MoeLayout::kPadded, true, 3},
                   {8, 2, 256, 256, 900, MoeLayout::kMasked, false, 5}},
                  801);
  run_layer_cases(2, {{8, 2, 256, 128, 400, MoeLayout::kPadded, true, 4}}, 811);
}

TEST(InProcessMoeLayer, World4) {
  MKT_REQUIRE_GPU();
  run_layer_cases(4, {{8, 2, 128, 128, 64}, {16, 4, 256, 64, 40, MoeLayout::kPadded, true}}, 701);
}

// Eight ranks (on a one-GPU host: 16 CTAs each): every expert's rows come from eight sources.
TEST(InProcessMoeLayer, World8) {
  MKT_REQUIRE_GPU();
  run_layer_cases(8, {{8, 2, 128, 64, 48}, {16, 8, 128, 128, 40, MoeLayout::kMasked, true}}, 901);
}

TEST(InProcessMoeLayer, BackToBackCallsWithALateRank) {
  MKT_REQUIRE_GPU();
  for (int world : {2, 3, 4}) {
    run_in_process(world, [](Communicator& comm) {
      for (std::size_t i = 0; i < kBackToBackCases.size(); ++i) {
        expect_back_to_back(comm, kBackToBackCases[i], 1101 + i);
      }
    });
  }
}

// Masked, room for 20 rows an expert, skewed routing: the rows past an expert's room are not
// computed - its owner's synchronize() raises kOutOfMemory naming the expert, once - and every
// token's output sums the slots that fit: each expert's first 20 rows in (source rank, token,
// slot) order.
TEST(InProcessMoeLayer, CapacityOverflow) {
  MKT_REQUIRE_GPU();
  for (int world : {1, 2}) {
    run_in_process(world, [&](Communicator& comm) {
      LayerCase c{8, 2, 256, 128, 200, MoeLayout::kMasked, true};
      c.capacity = 20;
      const uint64_t seed = 1001;
      SCOPED_TRACE(describe(c, world) + ", capacity 20, rank " + std::to_string(comm.rank()));
      RankLayer l(comm, c, seed);
      // Every rank's slots in the layout's order; those past their expert's room become -1.
      std::vector<Inputs> kept;
      for (int r = 0; r < world; ++r) kept.push_back(inputs_of(c, r, seed));
      std::vector<int64_t> rows(c.experts, 0);
      std::vector<bool> overflowed(c.experts, false);
      for (Inputs& in : kept) {
        for (int32_t& e : in.topk) {
          if (e >= 0 && rows[e]++ >= c.capacity) {
            overflowed[e] = true;
            e = -1;
          }
        }
      }
      ASSERT_TRUE(std::find(overflowed.begin(), overflowed.end(), true) != overflowed.end());
      l.b.upload(inputs_of(c, l.rank, seed), l.s);
      MKT_CUDA(cudaMemsetAsync(l.b.out, 0xff, l.b.out_bytes, l.s));  // poison
      ready(comm, l.s);
      l.call(comm);
      bool mine = false;
      for (int e = 0; e < l.e_local; ++e) mine = mine || overflowed[l.rank * l.e_local + e];
      if (mine) {
        try {
          comm.synchronize(l.s);
          ADD_FAILURE() << "no capacity error raised";
        } catch (const Error& e) {
          EXPECT_EQ(e.code(), ErrorCode::kOutOfMemory) << e.what();
          EXPECT_NE(std::string(e.what()).find("local expert "), std::string::npos) << e.what();
        }
        EXPECT_NO_THROW(comm.check()) << "a data error is raised once";
      } else {
        EXPECT_NO_THROW(comm.synchronize(l.s));
      }
      const std::size_t count = static_cast<std::size_t>(l.p.tokens * c.hidden);
      expect_matches(c, kept[l.rank], l.all, download(l.b, count, l.s));
      comm.bootstrap().barrier();
    });
  }
}

// A rank that never joins: the others' layer ends with the time-limit error naming it (the
// dispatch's wait), and nothing hangs - once the launch has failed its remaining waits return at
// once, the tiles run over what was placed and the down tiles store nothing.
TEST(InProcessMoeLayer, MissingRankTimesOut) {
  MKT_REQUIRE_GPU();
  CommOptions options;
  options.timeout_seconds = 1.0;
  run_in_process(
      2,
      [](Communicator& comm) {
        RankLayer l(comm, {8, 2, 128, 64, 64}, 3);
        l.b.upload(inputs_of(l.c, l.rank, 3), l.s);
        ready(comm, l.s);
        expect_missing_rank_times_out(comm, l.s, [&] { l.call(comm); });
      },
      options);
}

// Captured once per rank, replayed 100 times with new routing, tokens and weights each time
// (every replay checked against the reference).
TEST(InProcessMoeLayer, GraphReplaysWithNewRouting) {
  MKT_REQUIRE_GPU();
  run_in_process(2, [](Communicator& comm) {
    RankLayer l(comm, {8, 2, 256, 128, 96}, 5);
    l.b.upload(inputs_of(l.c, l.rank, 1), l.s);
    ready(comm, l.s);
    l.call(comm);
    comm.synchronize(l.s);
    cudaGraph_t graph;
    MKT_CUDA(cudaStreamBeginCapture(l.s, cudaStreamCaptureModeThreadLocal));
    l.call(comm);
    MKT_CUDA(cudaStreamEndCapture(l.s, &graph));
    cudaGraphExec_t exec;
    ASSERT_NO_FATAL_FAILURE(instantiate_uploaded(graph, l.s, &exec));
    comm.bootstrap().barrier();
    const std::size_t count = static_cast<std::size_t>(l.p.tokens * l.c.hidden);
    for (int replay = 0; replay < 100; ++replay) {
      SCOPED_TRACE("replay " + std::to_string(replay));
      LayerCase ci = l.c;
      ci.skewed = replay % 2 == 1;
      const Inputs in = inputs_of(ci, l.rank, 100 + replay);
      l.b.upload(in, l.s);
      ready(comm, l.s);
      MKT_CUDA(cudaGraphLaunch(exec, l.s));
      comm.synchronize(l.s);
      ASSERT_NO_FATAL_FAILURE(expect_matches(ci, in, l.all, download(l.b, count, l.s)));
    }
    comm.bootstrap().barrier();
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
  });
}

// Refused before anything runs (no peer waits for this rank), the error naming the problem, the
// output untouched. World 1: a refusal on one rank of several would leave the others waiting.
TEST(InProcessMoeLayer, RejectsBadArgumentsBeforeLaunch) {
  MKT_REQUIRE_GPU();
  run_in_process(1, [](Communicator& comm) {
    const LayerCase c{8, 2, 256, 128, 64};
    const MoeProblem p = problem_of(c, 0);
    SymmetricBuffer ws = comm.alloc(moe_workspace_bytes(comm, p));
    cudaStream_t s;
    MKT_CUDA(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    LayerBuffers b(c, p, c.experts, moe_layer_plan(comm, p, c.inter).scratch_bytes);
    MKT_CUDA(cudaMemsetAsync(b.out, 0x5a, b.out_bytes, s));
    MKT_CUDA(cudaStreamSynchronize(s));
    auto expect_refused = [&](const std::string& what, auto&& call) {
      try {
        call();
        ADD_FAILURE() << "expected a refusal naming '" << what << "'";
      } catch (const Error& e) {
        EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << e.what();
        EXPECT_NE(std::string(e.what()).find("moe_layer"), std::string::npos) << e.what();
      }
    };
    expect_refused("intermediate = 100", [&] {
      moe_layer(comm, p, 100, b.x, b.topk, IndexType::kInt32, b.weights, b.w13, b.w2, b.out,
                ws.data(), b.scratch, s);
    });
    expect_refused("w13", [&] {
      moe_layer(comm, p, c.inter, b.x, b.topk, IndexType::kInt32, b.weights, nullptr, b.w2, b.out,
                ws.data(), b.scratch, s);
    });
    expect_refused("scratch", [&] {
      moe_layer(comm, p, c.inter, b.x, b.topk, IndexType::kInt32, b.weights, b.w13, b.w2, b.out,
                ws.data(), nullptr, s);
    });
    for (int block_n : {100, 64, 192}) {  // the experts' GEMMs take 128 or 256
      expect_refused("config.block_n = " + std::to_string(block_n), [&] {
        MoeConfig config;
        config.block_n = block_n;
        moe_layer(comm, p, c.inter, b.x, b.topk, IndexType::kInt32, b.weights, b.w13, b.w2, b.out,
                  ws.data(), b.scratch, s, config);
      });
    }
    expect_refused("out", [&] {  // out over w2
      moe_layer(comm, p, c.inter, b.x, b.topk, IndexType::kInt32, b.weights, b.w13, b.w2, b.w2,
                ws.data(), b.scratch, s);
    });
    MKT_CUDA(cudaStreamSynchronize(s));
    std::vector<uint8_t> out(b.out_bytes);
    cudaMemcpy(out.data(), b.out, out.size(), cudaMemcpyDeviceToHost);
    EXPECT_TRUE(std::all_of(out.begin(), out.end(), [](uint8_t v) { return v == 0x5a; }))
        << "a refused call wrote the output";
    cudaStreamDestroy(s);
  });
}

// World 1 first, as test_moe.cpp's SanitizeMoe cases (see there): the sanitizer checks every
// kernel of the case where no launch waits for a peer. run_layer_cases meets before each launch.
TEST(SanitizeMoe, Layer) {
  MKT_REQUIRE_GPU();
  // 4 CTAs a rank
  const std::vector<LayerCase> cases = {{8, 2, 64, 64, 40, MoeLayout::kPadded, false, 4}};
  run_layer_cases(1, cases, 801);
  run_layer_cases(2, cases, 801);
}

}  // namespace
}  // namespace mk::test
