// The MoE ops on one GPU with the ranks as threads of this process: their launches side by side
// on the GPU's SMs (each rank its communicator's SM budget), against the op at world 1 on the same
// work (every rank's tokens, every expert) on the whole GPU - the SM-side cost of expert
// parallelism on one GPU (issues 29 and 30: "two ranks sharing the GPU"). The "peer" rows stay in
// this GPU's memory: NVLink is not measured here.
//   bench_moe_ranks [--op moe_layer|moe_dispatch_gemm] [--ranks 2] [--iters 5] [--json FILE]
//                   [--commit SHA] [--torch MODEL:TOKENS:MS,...] [--trace MODEL:TOKENS]
//                   [--points MODEL:TOKENS,...] [--prefix MODEL:TOKENS,...] [--recv-x keep|skip]
// --points: those points only (TOKENS a rank; an A/B's few points, scripts/ab_variants.sh).
// --prefix: those points only, and after the timed rounds the world-1 op's kernels, each timed as
// what it adds to the call (graph_nodes.h, time_prefixes: the call's graph cut after each node),
// with moe_dispatch_gemm's grouped GEMM alone on the rows the call placed beside them.
// --trace: that point only (TOKENS a rank), and after the timed rounds one more call of every
// rank and of the world-1 op with the fused launch's timeline recorded (MKERNEL_TRACE,
// src/fused/trace_layout.h), summarised: when the side warps' sends, the other ranks' rows and
// the placement are done (over CTAs), how long the producer waits for placed rows, the consumers'
// time, in ten bins of the launch.
// Shapes: the models of bench_moe_layer.py / bench_moe.py (DeepSeek-V3-like, Qwen3-235B-like,
// Mixtral), every expert somewhere (E / ranks a rank), uniform routing; moe_layer at 1024 and
// 4096 tokens a rank, moe_dispatch_gemm at 128, 1024, 4096 and 8192 tokens in all (the world-1
// file's points, so that --torch - torch._grouped_mm's time on those rows there, gemm_alone,
// which bench/run.sh passes from the same run - gives the speedup the issue asks for). Rounds of
// `iters` calls, the median of 7; the world-`ranks` launches and the world-1 op alternate round
// by round. Correctness at every point: moe_layer - each rank's rows of out against the world-1
// layer's rows of the same tokens; moe_dispatch_gemm - each rank's y row of (source, token, slot)
// against the world-1 row of the same (token, slot), found through the handles; within 4 bf16
// steps of the largest magnitude (the same sums in the same order: equal but for the GEMMs' tile
// choice).
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <map>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "bench_check.h"
#include "bench_inprocess.h"
#include "bench_kernels.h"
#include "fused/trace_layout.h"
#include "graph_nodes.h"
#include "mkernel/mkernel.h"
#include "mkernel/moe.h"
#include "trace_records.h"

namespace {

using namespace mk;

enum class Op { kLayer, kDispatchGemm };

struct Point {
  const char* model;
  int64_t hidden, inter;  // moe_dispatch_gemm: inter is its N
  int experts, top_k;
  int64_t tokens;  // a rank
};

struct Result {
  double ranks_ms = 0, world1_ms = 0;
  bool correct = false;
  double max_diff = 0, max_abs = 0;
};

constexpr int kRounds = 7;

// One rank's op over its share of the inputs (rank r: tokens [r T, (r + 1) T), experts
// [r E_local, (r + 1) E_local)).
// --recv-x keep: moe_dispatch_gemm's timed calls ask for the dispatched rows too (recv_x: the
// walk copies every row into the layout as well), to time that path beside the default.
bool timed_recv_x = false;

struct RankOp {
  Op op = Op::kLayer;
  std::shared_ptr<Communicator> comm;
  MoeProblem p;
  int64_t inter = 0;
  const void *x = nullptr, *topk = nullptr, *w13 = nullptr, *w2 = nullptr;
  const float* weights = nullptr;
  void* out = nullptr;  // moe_layer: [T, H]
  // moe_dispatch_gemm: w13 is its w [E_local, N, H]; its outputs in the dispatch layout. The
  // timed calls pass no recv_x (what a caller that does not keep the dispatched rows passes -
  // Python's default) unless --recv-x keep; recv holds the rows of a call that asked for them
  // (keep_rows: --prefix's grouped GEMM alone on them).
  int64_t rows = 0;
  void *y = nullptr, *recv = nullptr;
  int32_t *expert_rows = nullptr, *handle = nullptr;
  SymmetricBuffer ws;
  void* scratch = nullptr;
  cudaStream_t s = nullptr;

  void call(bool keep_rows = false) {
    if (op == Op::kLayer) {
      moe_layer(*comm, p, inter, x, topk, IndexType::kInt32, weights, w13, w2, out, ws.data(),
                scratch, s);
    } else {
      moe_dispatch_gemm(*comm, p, x, topk, IndexType::kInt32, w13, BLayout::kNK, inter, y,
                        keep_rows || timed_recv_x ? recv : nullptr, expert_rows, handle, ws.data(),
                        s);
    }
  }
  void release() {
    for (void* q :
         {scratch, y, recv, static_cast<void*>(expert_rows), static_cast<void*>(handle)}) {
      if (q != nullptr) CK(cudaFree(q));
    }
    CK(cudaStreamDestroy(s));
  }
};

// What a moe_dispatch_gemm rank leaves to compare: its handle and y rows.
struct Rows {
  std::vector<int32_t> handle;
  std::vector<uint16_t> y;
};

// The op of `world` ranks over `tokens` tokens a rank, rank `rank`'s share of the full buffers.
void setup(RankOp& l, Op op, std::unique_ptr<Bootstrap> boot, const Point& pt, int world, int rank,
           int64_t tokens, const uint16_t* x, const int32_t* topk, const float* weights,
           const uint16_t* w13, const uint16_t* w2, uint16_t* out) {
  l.op = op;
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
  l.ws = l.comm->alloc(moe_workspace_bytes(*l.comm, l.p));
  if (op == Op::kLayer) {
    l.w13 = w13 + rank * e_local * 2 * pt.inter * pt.hidden;
    l.w2 = w2 + rank * e_local * pt.hidden * pt.inter;
    l.out = out + rank * tokens * pt.hidden;
    CK(cudaMalloc(&l.scratch, moe_layer_plan(*l.comm, l.p, pt.inter).scratch_bytes));
  } else {
    l.w13 = w13 + rank * e_local * pt.inter * pt.hidden;
    l.rows = moe_plan(*l.comm, l.p).rows;
    CK(cudaMalloc(&l.y, l.rows * pt.inter * 2));
    CK(cudaMalloc(&l.recv, l.rows * pt.hidden * 2));
    CK(cudaMalloc(reinterpret_cast<void**>(&l.expert_rows), e_local * 4));
    CK(cudaMalloc(reinterpret_cast<void**>(&l.handle), l.rows * 3 * 4));
  }
  CK(cudaStreamCreateWithFlags(&l.s, cudaStreamNonBlocking));
  CK(cudaMemsetAsync(l.ws.data(), 0, moe_workspace_bytes(*l.comm, l.p), l.s));
  CK(cudaStreamSynchronize(l.s));
  l.comm->bootstrap().barrier();
}

Rows download(const RankOp& l) {
  Rows r{std::vector<int32_t>(l.rows * 3), std::vector<uint16_t>(l.rows * l.inter)};
  CK(cudaMemcpy(r.handle.data(), l.handle, r.handle.size() * 4, cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(r.y.data(), l.y, r.y.size() * 2, cudaMemcpyDeviceToHost));
  return r;
}

float bf16_value(uint16_t b) {
  const uint32_t bits = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// Every rank's y row of (source s, token t, slot j) against the world-1 row of (token
// s T + t, slot j); false when a routed pair is missing on either side.
bool compare_rows(const std::vector<Rows>& ranks, const Rows& one, int64_t tokens, int top_k,
                  int64_t n, Result& result) {
  std::map<int64_t, int64_t> at;  // (global token) k + slot -> world-1 row
  for (int64_t r = 0; r < static_cast<int64_t>(one.handle.size() / 3); ++r) {
    if (one.handle[r * 3] < 0) continue;
    at[static_cast<int64_t>(one.handle[r * 3 + 1]) * top_k + one.handle[r * 3 + 2]] = r;
  }
  double diff = 0, mag = 0;
  int64_t matched = 0;
  for (const Rows& rk : ranks) {
    for (int64_t r = 0; r < static_cast<int64_t>(rk.handle.size() / 3); ++r) {
      if (rk.handle[r * 3] < 0) continue;
      const int64_t token = rk.handle[r * 3] * tokens + rk.handle[r * 3 + 1];
      const auto it = at.find(token * top_k + rk.handle[r * 3 + 2]);
      if (it == at.end()) return false;
      ++matched;
      for (int64_t c = 0; c < n; ++c) {
        const double a = bf16_value(rk.y[r * n + c]), b = bf16_value(one.y[it->second * n + c]);
        diff = std::max(diff, std::fabs(a - b));
        mag = std::max(mag, std::fabs(b));
      }
    }
  }
  result.max_diff = diff;
  result.max_abs = mag;
  return matched == static_cast<int64_t>(at.size());
}

// Min / median / max of a list ("-" when empty).
std::string spread(std::vector<double> v) {
  if (v.empty()) return "-";
  std::sort(v.begin(), v.end());
  char s[64];
  std::snprintf(s, sizeof(s), "%.1f / %.1f / %.1f", v.front(), v[v.size() / 2], v.back());
  return s;
}

// One traced launch of the fused MoE kernel (moe_dispatch_gemm's or moe_layer's).
void summarise_trace(const char* who, int ctas, const std::vector<uint64_t>& raw) {
  using namespace mk::fused;
  const bench::Timeline tl = bench::read_timeline(raw, ctas);
  if (ctas <= 0 || tl.span <= 0) {
    std::printf("%s: no trace records (%d CTAs)\n", who, ctas);
    return;
  }
  const double span = tl.span, bin = span / bench::kTraceBins;
  std::vector<double> sent, landed, placed, first_in, last_done, summed;
  double wait_us = 0, down_wait_us = 0, main_us = 0, epi_us = 0;
  int tiles = 0, waited = 0;
  std::vector<double> b_wait(bench::kTraceBins), b_place(bench::kTraceBins),
      b_tiles(bench::kTraceBins);
  for (int c = 0; c < ctas; ++c) {
    const auto& side = tl.lanes[c][kTraceSide];
    double start = side.empty() ? 0 : side.front().us, last_sent = -1, landed_at = -1;
    for (const bench::TraceRecord& r : side) {
      if (r.event == kTraceSent) last_sent = r.us;
      if (r.event == kTraceLanded) {
        landed.push_back(r.us);
        landed_at = r.us;
      }
      if (r.event == kTracePlaced) {
        placed.push_back(r.us);
        if (landed_at >= 0)
          bench::bin_add(b_place, landed_at, r.us, span);  // the walk (step 3) only
      }
    }
    if (last_sent >= 0) sent.push_back(last_sent);
    double at = -1;
    bool first = true;
    for (const bench::TraceRecord& r : tl.lanes[c][kTraceProducer]) {
      if (r.event == kTraceOperandsWait) at = r.us;
      if (r.event != kTraceOperandsIn || at < 0) continue;
      const double w = r.us - at;
      const bool down = (r.arg >> 16) != 0;
      (down ? down_wait_us : wait_us) += w;
      if (!down && w > 1) ++waited;
      bench::bin_add(b_wait, at, r.us, span);
      if (first) first_in.push_back(r.us);
      first = false;
      at = -1;
    }
    for (int l = kTraceConsumer0; l < kTraceConsumer0 + 2; ++l) {
      double prev = start, begin = 0;
      for (const bench::TraceRecord& r : tl.lanes[c][l]) {
        if (r.event == kTraceStoreBegin) {
          begin = r.us;
          main_us += begin - prev;
        } else if (r.event == kTraceStoreEnd) {
          epi_us += r.us - begin;
          prev = r.us;
          ++tiles;
          b_tiles[std::min(bench::kTraceBins - 1, static_cast<int>(r.us / bin))] +=
              1;  // (a count, not a length)
        } else if (r.event == kTraceSummed) {
          summed.push_back(r.us);
        }
      }
      if (l == kTraceConsumer0) last_done.push_back(prev);
    }
  }
  const double consumers = 2.0 * ctas * span;
  std::printf(
      "%s: launch %.1f us by the trace, %d CTAs, %d tile slices\n"
      "  side warps (us since the launch's first record, min / median / max over CTAs):\n"
      "    sends done %s; every other rank's rows landed %s; every row placed %s\n"
      "  producer: waited for placed rows %.1f%% of its time (%d tiles > 1 us), for gate / up "
      "tiles %.1f%%; first tile's rows in at %s\n"
      "  consumers: mainloop (with the producer's waits) %.1f%%, epilogue %.1f%%, after the "
      "last tile %.1f%%; last tile done %s%s%s\n"
      "  bins of %.1f us: producer waiting / side warps placing (%% of CTAs), tile slices done\n",
      who, span, ctas, tiles, spread(sent).c_str(), spread(landed).c_str(), spread(placed).c_str(),
      100 * wait_us / (ctas * span), waited, 100 * down_wait_us / (ctas * span),
      spread(first_in).c_str(), 100 * main_us / consumers, 100 * epi_us / consumers,
      100 * (consumers - main_us - epi_us) / consumers, spread(last_done).c_str(),
      summed.empty() ? "" : "; combine sums done ", summed.empty() ? "" : spread(summed).c_str(),
      bin);
  for (int i = 0; i < bench::kTraceBins; ++i) {
    std::printf("    %2d  %5.1f %5.1f  %6.0f\n", i, 100 * b_wait[i] / (ctas * bin),
                100 * b_place[i] / (ctas * bin), b_tiles[i]);
  }
  if (tl.full_lanes > 0) {
    std::printf("  WARNING: %d lanes full (%d records): their later records are lost\n",
                tl.full_lanes, kTraceWordsPerLane / 2);
  }
}

// ms per call of `iters` calls (every rank starts at once).
double time_calls(RankOp& l, int iters, cudaEvent_t start, cudaEvent_t stop) {
  l.comm->bootstrap().barrier();
  CK(cudaEventRecord(start, l.s));
  for (int i = 0; i < iters; ++i) l.call();
  CK(cudaEventRecord(stop, l.s));
  l.comm->synchronize(l.s);
  float ms = 0;
  CK(cudaEventElapsedTime(&ms, start, stop));
  return static_cast<double>(ms) / iters;
}

// The world-1 op's kernels, what each adds to its time (--prefix), and for moe_dispatch_gemm our
// grouped GEMM alone on the rows the call placed (the padded layout and the counts it left).
void print_prefixes(RankOp& one, const Point& pt) {
  const std::vector<mk::bench::PrefixTime> times = mk::bench::time_prefixes(
      one.s, [&] { one.call(); }, 10, kRounds);
  std::printf("  world 1, %s at %lld tokens: the call cut after each of its nodes (ms)\n", pt.model,
              static_cast<long long>(one.p.tokens));
  std::printf("    %-72s %9s %9s\n", "the call up to", "ms", "added");
  for (const mk::bench::PrefixTime& t : times) {
    std::printf("    %-72s %9.4f %9.4f\n", mk::bench::short_name(t.node).c_str(), t.ms,
                t.increment);
  }
  if (one.op != Op::kDispatchGemm) return;
  cudaEvent_t start, stop;
  CK(cudaEventCreate(&start));
  CK(cudaEventCreate(&stop));
  one.call(/*keep_rows=*/true);  // the rows placed in recv (the timed calls copy none)
  const auto gemm = [&] {
    grouped_gemm(one.recv, one.w13, one.y, one.expert_rows, pt.experts, one.rows, pt.inter,
                 pt.hidden, BLayout::kNK, one.s, {}, GroupedLayout::kPadded);
  };
  gemm();  // warm
  std::vector<double> rounds;
  for (int round = 0; round < kRounds; ++round) {
    CK(cudaEventRecord(start, one.s));
    for (int i = 0; i < 10; ++i) gemm();
    CK(cudaEventRecord(stop, one.s));
    CK(cudaEventSynchronize(stop));
    float ms = 0;
    CK(cudaEventElapsedTime(&ms, start, stop));
    rounds.push_back(static_cast<double>(ms) / 10);
  }
  std::printf("    %-72s %9.4f\n", "our grouped GEMM alone on the placed rows (grouped_gemm)",
              mk::bench::median(rounds));
  CK(cudaEventDestroy(start));
  CK(cudaEventDestroy(stop));
}

Result run_point(Op op, const Point& pt, int world, int iters, bool trace, bool prefix, int sms) {
  const int64_t all_tokens = world * pt.tokens;
  const auto xn = static_cast<std::size_t>(all_tokens * pt.hidden);
  const auto slots = static_cast<std::size_t>(all_tokens * pt.top_k);
  // moe_layer: w13 [E, 2I, H] and w2 [E, H, I]; moe_dispatch_gemm: w [E, N, H] in w13.
  const auto w13n =
      static_cast<std::size_t>(pt.experts) * (op == Op::kLayer ? 2 : 1) * pt.inter * pt.hidden;
  const auto w2n =
      op == Op::kLayer ? static_cast<std::size_t>(pt.experts) * pt.hidden * pt.inter : 1;
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
  const uint64_t seed = bench::bench_seed();
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
  std::vector<Rows> rank_rows(world);
  Rows one_rows;
  InProcessGroup group(world), alone(1);
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r] {
      CK(cudaSetDevice(0));
      RankOp l;
      setup(l, op, group.bootstrap(r), pt, world, r, pt.tokens, x, topk, weights, w13, w2,
            out_ranks);
      // Rank 0 also holds the world-1 op over every token and expert (one communicator of its
      // own), timed while the other ranks wait at the barrier.
      RankOp one;
      if (r == 0) {
        setup(one, op, alone.bootstrap(0), pt, 1, 0, all_tokens, x, topk, weights, w13, w2,
              out_one);
      }
      // The timeline's buffer, allocated before any launch (ranks sharing the GPU in one process
      // must not allocate while a peer's kernel may run): this thread's, for the most CTAs.
      if (trace) {
        fused::trace_arm(*l.comm, sms, l.s);
        CK(cudaStreamSynchronize(l.s));
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
      if (op == Op::kDispatchGemm) {
        rank_rows[r] = download(l);
        if (r == 0) one_rows = download(one);
      }
      std::vector<double> rounds;
      for (int round = 0; round < kRounds; ++round) {
        rounds.push_back(time_calls(l, iters, start, stop));
        l.comm->bootstrap().barrier();
        if (r == 0) one_rounds.push_back(time_calls(one, iters, start, stop));
        l.comm->bootstrap().barrier();
      }
      rank_ms[r] = mk::bench::median(rounds);
      if (trace) {  // one more call each, traced; the summaries one rank after the other
        l.comm->bootstrap().barrier();
        l.call();
        l.comm->synchronize(l.s);
        l.comm->bootstrap().barrier();
        int ctas = 0;
        const std::vector<uint64_t> raw = fused::trace_read(ctas);
        for (int q = 0; q < world; ++q) {
          l.comm->bootstrap().barrier();
          if (q != r) continue;
          const std::string who = "rank " + std::to_string(r) + " of " + std::to_string(world);
          summarise_trace(who.c_str(), ctas, raw);
          std::fflush(stdout);
        }
        l.comm->bootstrap().barrier();
        if (r == 0) {
          one.call();
          one.comm->synchronize(one.s);
          // (Read first: trace_read sets `ctas` to the world-1 launch's, all SMs - not the
          // ranks' share - and argument evaluation order is unspecified.)
          int one_ctas = 0;
          const std::vector<uint64_t> one_raw = fused::trace_read(one_ctas);
          summarise_trace("world 1", one_ctas, one_raw);
          std::fflush(stdout);
        }
        l.comm->bootstrap().barrier();
      }
      if (prefix) {  // rank 0's world-1 op cut into its kernels, the other ranks waiting
        l.comm->bootstrap().barrier();
        if (r == 0) {
          print_prefixes(one, pt);
          std::fflush(stdout);
        }
        l.comm->bootstrap().barrier();
      }
      CK(cudaEventDestroy(start));
      CK(cudaEventDestroy(stop));
      l.comm->synchronize(l.s);
      l.comm->bootstrap().barrier();  // no rank frees while another's kernel may run
      l.release();
      if (r == 0) one.release();
    });
  }
  for (auto& t : threads) t.join();
  result.ranks_ms = *std::max_element(rank_ms.begin(), rank_ms.end());
  result.world1_ms = mk::bench::median(one_rounds);

  bool matched = true;
  if (op == Op::kLayer) {
    const bench::MaxDiff d = bench::max_diff_bf16(out_ranks, out_one, xn);
    result.max_diff = d.diff;
    result.max_abs = d.mag;
  } else {
    matched = compare_rows(rank_rows, one_rows, pt.tokens, pt.top_k, pt.inter, result);
  }
  result.correct = matched && std::isfinite(result.max_abs) && result.max_abs > 0 &&
                   result.max_diff <= 4 * std::ldexp(result.max_abs, -8);
  for (void* p : {static_cast<void*>(x), static_cast<void*>(w13), static_cast<void*>(w2),
                  static_cast<void*>(out_ranks), static_cast<void*>(out_one),
                  static_cast<void*>(topk), static_cast<void*>(weights)}) {
    CK(cudaFree(p));
  }
  return result;
}

// "a,b,c" -> {"a", "b", "c"}.
std::vector<std::string> split_commas(const std::string& list) {
  std::vector<std::string> items;
  std::size_t at = 0;
  while (at < list.size()) {
    std::size_t end = list.find(',', at);
    if (end == std::string::npos) end = list.size();
    items.push_back(list.substr(at, end - at));
    at = end + 1;
  }
  return items;
}

// --torch MODEL:TOKENS:MS,...: torch._grouped_mm's time on a world-1 point's rows.
bool parse_torch(const std::string& list, std::map<std::pair<std::string, int64_t>, double>& out) {
  for (const std::string& item : split_commas(list)) {
    const std::size_t a = item.find(':'), b = item.rfind(':');
    if (a == std::string::npos || a == b) return false;
    out[{item.substr(0, a), std::atoll(item.substr(a + 1, b - a - 1).c_str())}] =
        std::atof(item.substr(b + 1).c_str());
  }
  return true;
}

// --points / --trace: MODEL:TOKENS,... (TOKENS a rank, > 0) appended to `out`.
bool parse_points(const std::string& list, std::vector<std::pair<std::string, int64_t>>& out) {
  const std::size_t before = out.size();
  for (const std::string& item : split_commas(list)) {
    const std::size_t colon = item.find(':');
    if (colon == std::string::npos || std::atoll(item.c_str() + colon + 1) <= 0) return false;
    out.emplace_back(item.substr(0, colon), std::atoll(item.c_str() + colon + 1));
  }
  return out.size() > before;
}

}  // namespace

int main(int argc, char** argv) {
  mk::bench::InProcessArgs args;
  args.iters = 5;
  Op op = Op::kLayer;
  std::map<std::pair<std::string, int64_t>, double> torch_ms;
  // --points; --trace's one point; --prefix's points
  std::vector<std::pair<std::string, int64_t>> only, traced, prefixed;
  const auto extra = [&](const std::string& key, const std::string& value) {
    if (key == "--op" && (value == "moe_layer" || value == "moe_dispatch_gemm")) {
      op = value == "moe_layer" ? Op::kLayer : Op::kDispatchGemm;
      return true;
    }
    if (key == "--trace") {
      traced.clear();
      return parse_points(value, traced) && traced.size() == 1;
    }
    if (key == "--points") return parse_points(value, only);
    if (key == "--prefix") return parse_points(value, prefixed);
    if (key == "--recv-x" && (value == "keep" || value == "skip")) {
      timed_recv_x = value == "keep";
      return true;
    }
    return key == "--torch" && parse_torch(value, torch_ms);
  };
  if (!mk::bench::parse_inprocess_args(argc, argv, args, extra,
                                       " [--op moe_layer|moe_dispatch_gemm] "
                                       "[--torch MODEL:TOKENS:MS,...] [--trace MODEL:TOKENS] "
                                       "[--points MODEL:TOKENS,...] [--prefix MODEL:TOKENS,...] "
                                       "[--recv-x keep|skip]")) {
    return 2;
  }
  const bool trace = !traced.empty();     // (--trace: that point only)
  const bool prefix = !prefixed.empty();  // (--prefix: those points only)
  if (trace && prefix) {
    std::fprintf(stderr, "%s: --trace and --prefix: one at a time\n", argv[0]);
    return 2;
  }
  if (trace) only = traced;
  if (prefix) only = prefixed;
  const char* only_flag = trace ? "--trace" : prefix ? "--prefix" : "--points";
  if (trace) setenv("MKERNEL_TRACE", "1", 1);  // read when a communicator is created
  const int world = args.ranks, iters = args.iters;
  const char* kernel = op == Op::kLayer ? "moe_layer" : "moe_dispatch_gemm";
  setenv("CUDA_DEVICE_MAX_CONNECTIONS", "32", 0);  // a queue per rank's stream
  cudaDeviceProp prop{};
  CK(cudaGetDeviceProperties(&prop, 0));
  // The three models' shapes at `tokens` a rank.
  const auto models = [](int64_t tokens) {
    return std::vector<Point>{{"deepseek_v3", 7168, 2048, 256, 8, tokens},
                              {"qwen3_235b", 4096, 1536, 128, 8, tokens},
                              {"mixtral", 4096, 14336, 8, 2, tokens}};
  };
  std::vector<Point> points;
  if (!only.empty()) {
    for (const auto& [model, tokens] : only) {
      const std::size_t before = points.size();
      for (const Point& p : models(tokens)) {
        if (model == p.model) points.push_back(p);
      }
      if (points.size() == before) {
        std::fprintf(stderr, "%s %s: deepseek_v3, qwen3_235b or mixtral\n", only_flag,
                     model.c_str());
        return 2;
      }
    }
  } else if (op == Op::kLayer) {
    for (int64_t t : {1024, 4096}) {
      for (const Point& p : models(t)) points.push_back(p);
    }
  } else {
    for (int64_t all : {128, 1024, 4096, 8192}) {  // bench_moe.py's points, in all
      if (all % world != 0) continue;
      for (const Point& p : models(all / world)) points.push_back(p);
    }
  }
  std::printf("%s in-process, %d ranks on one %s (against world 1 on the same work%s)\n", kernel,
              world, prop.name, op == Op::kLayer ? "" : "; x torch: torch._grouped_mm there");
  std::printf("%-12s %6s %10s %10s %7s %8s %8s  check\n", "model", "T/rank", "ranks ms", "world 1",
              "ratio", "TFLOP/s", "x torch");
  std::string rows;
  bool all_ok = true;
  for (const Point& p : points) {
    if (p.experts % world != 0) continue;
    const Result r = run_point(op, p, world, iters, trace, prefix, prop.multiProcessorCount);
    const double routed = static_cast<double>(world) * p.tokens * p.top_k;
    const double flops = (op == Op::kLayer ? 6.0 : 2.0) * routed * p.hidden * p.inter;
    const double ratio = r.ranks_ms / r.world1_ms;
    const auto torch_it = torch_ms.find({p.model, world * p.tokens});
    const double torch = torch_it == torch_ms.end() ? 0 : torch_it->second;
    all_ok = all_ok && r.correct;
    std::printf("%-12s %6lld %10.4f %10.4f %7.3f %8.1f %8s  %s (diff %.2e, |max| %.2e)\n", p.model,
                static_cast<long long>(p.tokens), r.ranks_ms, r.world1_ms, ratio,
                flops / r.ranks_ms * 1e-9,
                torch > 0 ? std::to_string(torch / r.ranks_ms).substr(0, 5).c_str() : "-",
                r.correct ? "ok" : "WRONG", r.max_diff, r.max_abs);
    char row[1536];
    if (op == Op::kLayer) {
      std::snprintf(row, sizeof(row),
                    "%s    {\"shape\": {\"tokens_per_rank\": %lld, \"hidden\": %lld, "
                    "\"intermediate\": %lld, \"experts\": %d, \"top_k\": %d, \"model\": \"%s\", "
                    "\"world\": %d}, \"dtype\": \"bf16\", \"ms\": {\"mkernel\": %.5f, "
                    "\"world1_same_work\": %.5f, \"torch_reference\": null, \"compute_alone\": "
                    "null, \"dispatch_combine_alone\": null, \"sequential\": null}, "
                    "\"limit_ms\": %.5f, \"ratio_to_limit\": %.4f, \"tflops\": %.1f, "
                    "\"correct\": %s}",
                    rows.empty() ? "" : ",\n", static_cast<long long>(p.tokens),
                    static_cast<long long>(p.hidden), static_cast<long long>(p.inter), p.experts,
                    p.top_k, p.model, world, r.ranks_ms, r.world1_ms, r.world1_ms, ratio,
                    flops / r.ranks_ms * 1e-9, r.correct ? "true" : "false");
    } else {
      // limit: torch._grouped_mm on the same rows where the run measured it (the dispatch alone
      // is not timed here); null without it.
      const auto or_null = [&](double v) { return torch > 0 ? std::to_string(v) : "null"; };
      const std::string torch_json = or_null(torch), limit = or_null(torch),
                        ratio_json = or_null(r.ranks_ms / torch),
                        speedup = or_null(torch / r.ranks_ms);
      std::snprintf(row, sizeof(row),
                    "%s    {\"shape\": {\"tokens_per_rank\": %lld, \"hidden\": %lld, \"N\": %lld, "
                    "\"experts\": %d, \"top_k\": %d, \"model\": \"%s\", \"world\": %d}, "
                    "\"dtype\": \"bf16\", \"ms\": {\"mkernel\": %.5f, \"world1_same_work\": %.5f, "
                    "\"dispatch_alone\": null, \"nccl_dispatch\": null, \"gemm_alone\": %s, "
                    "\"sequential\": null}, \"limit_ms\": %s, \"ratio_to_limit\": %s, "
                    "\"speedup_vs_torch_grouped_mm\": %s, \"tflops\": %.1f, \"correct\": %s}",
                    rows.empty() ? "" : ",\n", static_cast<long long>(p.tokens),
                    static_cast<long long>(p.hidden), static_cast<long long>(p.inter), p.experts,
                    p.top_k, p.model, world, r.ranks_ms, r.world1_ms, torch_json.c_str(),
                    limit.c_str(), ratio_json.c_str(), speedup.c_str(), flops / r.ranks_ms * 1e-9,
                    r.correct ? "true" : "false");
    }
    rows += row;
  }
  if (!args.json.empty() &&
      !mk::bench::write_inprocess_results(
          args.json, kernel, args.commit, prop.name, world,
          "in-process (one GPU: ranks share it, peer rows stay in its memory)", rows)) {
    return 2;
  }
  return all_ok ? 0 : 1;
}
