// moe_layer on one GPU with the ranks as threads of this process: their launches side by side on
// the GPU's SMs (each rank its communicator's SM budget), against the layer at world 1 on the same
// work (every rank's tokens, every expert) on the whole GPU - the SM-side cost of expert
// parallelism on one GPU (issue 30: "two ranks sharing the GPU, correctness and the SM-side
// cost"). The "peer" rows stay in this GPU's memory: NVLink is not measured here.
//   bench_moe_layer_ranks [--ranks 2] [--iters 5] [--json FILE] [--commit SHA]
// Shapes: the models of bench_moe_layer.py (DeepSeek-V3-like, Qwen3-235B-like, Mixtral), 1024 and
// 4096 tokens a rank, every expert somewhere (E / ranks a rank), uniform routing. Rounds of
// `iters` calls, the median of 7; the world-`ranks` launches and the world-1 layer alternate
// round by round. Correctness at every point: each rank's rows of out against the world-1
// layer's rows of the same tokens, within 4 bf16 steps of the largest |out| (the same sums in the
// same order: equal but for the GEMMs' tile choice).
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "bench_check.h"
#include "bench_inprocess.h"
#include "bench_kernels.h"
#include "mkernel/mkernel.h"
#include "mkernel/moe.h"

namespace {

using namespace mk;

struct Point {
  const char* model;
  int64_t hidden, inter;
  int experts, top_k;
  int64_t tokens;  // a rank
};

struct Result {
  double ranks_ms = 0, world1_ms = 0;
  bool correct = false;
  double max_diff = 0, max_abs = 0;
};

constexpr int kRounds = 7;

// One rank's layer over its share of the inputs (rank r: tokens [r T, (r + 1) T), experts
// [r E_local, (r + 1) E_local)).
struct RankLayer {
  std::shared_ptr<Communicator> comm;
  MoeProblem p;
  int64_t inter = 0;
  const void *x = nullptr, *topk = nullptr, *w13 = nullptr, *w2 = nullptr;
  const float* weights = nullptr;
  void* out = nullptr;
  SymmetricBuffer ws;
  void* scratch = nullptr;
  cudaStream_t s = nullptr;

  void call() {
    moe_layer(*comm, p, inter, x, topk, IndexType::kInt32, weights, w13, w2, out, ws.data(),
              scratch, s);
  }
};

// The layer of `world` ranks over `tokens` tokens a rank, rank `rank`'s share of the full
// buffers.
void setup(RankLayer& l, std::unique_ptr<Bootstrap> boot, const Point& pt, int world, int rank,
           int64_t tokens, const uint16_t* x, const int32_t* topk, const float* weights,
           const uint16_t* w13, const uint16_t* w2, uint16_t* out) {
  l.comm = Communicator::create(std::move(boot));
  l.p.tokens = l.p.max_tokens = tokens;
  l.p.hidden = pt.hidden;
  l.p.top_k = pt.top_k;
  l.p.num_experts = pt.experts;
  l.inter = pt.inter;
  const int64_t e_local = pt.experts / world;
  l.x = x + rank * tokens * pt.hidden;
  l.topk = topk + rank * tokens * pt.top_k;
  l.weights = weights + rank * tokens * pt.top_k;
  l.w13 = w13 + rank * e_local * 2 * pt.inter * pt.hidden;
  l.w2 = w2 + rank * e_local * pt.hidden * pt.inter;
  l.out = out + rank * tokens * pt.hidden;
  l.ws = l.comm->alloc(moe_workspace_bytes(*l.comm, l.p));
  CK(cudaMalloc(&l.scratch, moe_layer_plan(*l.comm, l.p, pt.inter).scratch_bytes));
  CK(cudaStreamCreateWithFlags(&l.s, cudaStreamNonBlocking));
  CK(cudaMemsetAsync(l.ws.data(), 0, moe_workspace_bytes(*l.comm, l.p), l.s));
  CK(cudaStreamSynchronize(l.s));
  l.comm->bootstrap().barrier();
}

// ms per call of `iters` calls (every rank starts at once).
double time_calls(RankLayer& l, int iters, cudaEvent_t start, cudaEvent_t stop) {
  l.comm->bootstrap().barrier();
  CK(cudaEventRecord(start, l.s));
  for (int i = 0; i < iters; ++i) l.call();
  CK(cudaEventRecord(stop, l.s));
  l.comm->synchronize(l.s);
  float ms = 0;
  CK(cudaEventElapsedTime(&ms, start, stop));
  return static_cast<double>(ms) / iters;
}

Result run_point(const Point& pt, int world, int iters) {
  const int64_t all_tokens = world * pt.tokens;
  const auto xn = static_cast<std::size_t>(all_tokens * pt.hidden);
  const auto slots = static_cast<std::size_t>(all_tokens * pt.top_k);
  const auto w13n = static_cast<std::size_t>(pt.experts) * 2 * pt.inter * pt.hidden;
  const auto w2n = static_cast<std::size_t>(pt.experts) * pt.hidden * pt.inter;
  uint16_t *x, *w13, *w2, *out_ranks, *out_one;
  int32_t* topk;
  float* weights;
  CK(cudaMalloc(reinterpret_cast<void**>(&x), xn * 2));
  CK(cudaMalloc(reinterpret_cast<void**>(&w13), w13n * 2));
  CK(cudaMalloc(reinterpret_cast<void**>(&w2), w2n * 2));
  CK(cudaMalloc(reinterpret_cast<void**>(&out_ranks), xn * 2));
  CK(cudaMalloc(reinterpret_cast<void**>(&out_one), xn * 2));
  CK(cudaMalloc(reinterpret_cast<void**>(&topk), slots * 4));
  CK(cudaMalloc(reinterpret_cast<void**>(&weights), slots * 4));
  const auto seed = static_cast<uint64_t>(std::time(nullptr));
  bench::launch_fill(x, xn, seed, 0, nullptr);
  bench::launch_fill(w13, w13n, seed, 1, nullptr);
  bench::launch_fill(w2, w2n, seed, 2, nullptr);
  {  // Uniform routing: top_k distinct experts a token; weights summing to 1.
    std::mt19937_64 gen(seed);
    std::vector<int32_t> idx(slots);
    std::vector<float> w(slots);
    std::vector<int32_t> perm(pt.experts);
    std::uniform_real_distribution<float> u(0.05f, 1.f);
    for (int64_t t = 0; t < all_tokens; ++t) {
      std::iota(perm.begin(), perm.end(), 0);
      float sum = 0;
      for (int j = 0; j < pt.top_k; ++j) {
        std::swap(perm[j], perm[j + gen() % (pt.experts - j)]);
        idx[t * pt.top_k + j] = perm[j];
        sum += w[t * pt.top_k + j] = u(gen);
      }
      for (int j = 0; j < pt.top_k; ++j) w[t * pt.top_k + j] /= sum;
    }
    CK(cudaMemcpy(topk, idx.data(), slots * 4, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(weights, w.data(), slots * 4, cudaMemcpyHostToDevice));
  }
  CK(cudaDeviceSynchronize());

  Result result;
  std::vector<double> rank_ms(world, 0);
  std::vector<double> one_rounds;
  InProcessGroup group(world), alone(1);
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r] {
      CK(cudaSetDevice(0));
      RankLayer l;
      setup(l, group.bootstrap(r), pt, world, r, pt.tokens, x, topk, weights, w13, w2, out_ranks);
      // Rank 0 also holds the world-1 layer over every token and expert (one communicator of its
      // own), timed while the other ranks wait at the barrier.
      RankLayer one;
      if (r == 0) {
        setup(one, alone.bootstrap(0), pt, 1, 0, all_tokens, x, topk, weights, w13, w2, out_one);
      }
      l.comm->bootstrap().barrier();  // nothing launched while rank 0 still allocates
      cudaEvent_t start, stop;
      CK(cudaEventCreate(&start));
      CK(cudaEventCreate(&stop));
      l.call();  // warm-up, and the output compared below
      l.comm->synchronize(l.s);
      if (r == 0) {
        one.call();
        one.comm->synchronize(one.s);
      }
      std::vector<double> rounds;
      for (int round = 0; round < kRounds; ++round) {
        rounds.push_back(time_calls(l, iters, start, stop));
        l.comm->bootstrap().barrier();
        if (r == 0) one_rounds.push_back(time_calls(one, iters, start, stop));
        l.comm->bootstrap().barrier();
      }
      rank_ms[r] = mk::bench::median(rounds);
      CK(cudaEventDestroy(start));
      CK(cudaEventDestroy(stop));
      l.comm->synchronize(l.s);
      l.comm->bootstrap().barrier();  // no rank frees while another's kernel may run
      CK(cudaFree(l.scratch));
      CK(cudaStreamDestroy(l.s));
      if (r == 0) {
        CK(cudaFree(one.scratch));
        CK(cudaStreamDestroy(one.s));
      }
    });
  }
  for (auto& t : threads) t.join();
  result.ranks_ms = *std::max_element(rank_ms.begin(), rank_ms.end());
  result.world1_ms = mk::bench::median(one_rounds);

  const bench::MaxDiff d = bench::max_diff_bf16(out_ranks, out_one, xn);
  result.max_diff = d.diff;
  result.max_abs = d.mag;
  result.correct = std::isfinite(d.mag) && d.mag > 0 && d.diff <= 4 * std::ldexp(d.mag, -8);
  for (void* p : {static_cast<void*>(x), static_cast<void*>(w13), static_cast<void*>(w2),
                  static_cast<void*>(out_ranks), static_cast<void*>(out_one),
                  static_cast<void*>(topk), static_cast<void*>(weights)}) {
    CK(cudaFree(p));
  }
  return result;
}

}  // namespace

int main(int argc, char** argv) {
  mk::bench::InProcessArgs args;
  args.iters = 5;
  if (!mk::bench::parse_inprocess_args(argc, argv, args)) return 2;
  const int world = args.ranks, iters = args.iters;
  setenv("CUDA_DEVICE_MAX_CONNECTIONS", "32", 0);  // a queue per rank's stream
  cudaDeviceProp prop{};
  CK(cudaGetDeviceProperties(&prop, 0));
  std::vector<Point> points;
  for (int64_t t : {1024, 4096}) {
    points.push_back({"deepseek_v3", 7168, 2048, 256, 8, t});
    points.push_back({"qwen3_235b", 4096, 1536, 128, 8, t});
    points.push_back({"mixtral", 4096, 14336, 8, 2, t});
  }
  std::printf("moe_layer in-process, %d ranks on one %s (against world 1 on the same work)\n",
              world, prop.name);
  std::printf("%-12s %6s %10s %10s %7s %8s  check\n", "model", "T/rank", "ranks ms", "world 1",
              "ratio", "TFLOP/s");
  std::string rows;
  bool all_ok = true;
  for (const Point& p : points) {
    if (p.experts % world != 0) continue;
    const Result r = run_point(p, world, iters);
    const double flops = 6.0 * world * p.tokens * p.top_k * p.hidden * p.inter;  // all ranks
    const double ratio = r.ranks_ms / r.world1_ms;
    all_ok = all_ok && r.correct;
    std::printf("%-12s %6lld %10.4f %10.4f %7.3f %8.1f  %s (diff %.2e, |out| %.2e)\n", p.model,
                static_cast<long long>(p.tokens), r.ranks_ms, r.world1_ms, ratio,
                flops / r.ranks_ms * 1e-9, r.correct ? "ok" : "WRONG", r.max_diff, r.max_abs);
    char row[1024];
    std::snprintf(row, sizeof(row),
                  "%s    {\"shape\": {\"tokens_per_rank\": %lld, \"hidden\": %lld, "
                  "\"intermediate\": %lld, \"experts\": %d, \"top_k\": %d, \"model\": \"%s\", "
                  "\"world\": %d}, \"dtype\": \"bf16\", \"ms\": {\"mkernel\": %.5f, "
                  "\"world1_same_work\": %.5f, \"torch_reference\": null, \"compute_alone\": "
                  "null, \"dispatch_combine_alone\": null, \"sequential\": null}, \"limit_ms\": "
                  "%.5f, \"ratio_to_limit\": %.4f, \"tflops\": %.1f, \"correct\": %s}",
                  rows.empty() ? "" : ",\n", static_cast<long long>(p.tokens),
                  static_cast<long long>(p.hidden), static_cast<long long>(p.inter), p.experts,
                  p.top_k, p.model, world, r.ranks_ms, r.world1_ms, r.world1_ms, ratio,
                  flops / r.ranks_ms * 1e-9, r.correct ? "true" : "false");
    rows += row;
  }
  if (!args.json.empty() &&
      !mk::bench::write_inprocess_results(
          args.json, "moe_layer", args.commit, prop.name, world,
          "in-process (one GPU: ranks share it, peer rows stay in its memory)", rows)) {
    return 2;
  }
  return all_ok ? 0 : 1;
}
