// ring_attention on one GPU: the ranks as threads of this process, their ring launches side by
// side on the GPU's SMs (each rank its communicator's SM budget), against the attention engine
// alone on the same work and the same number of SMs - the SM-side cost of the ring machinery
// (issue 32's one-GPU target: <= 1.05x). The "peer" copies stay in this GPU's memory: NVLink is
// not measured here. engine_same_work runs on every rank at once, as the ring launches do (they
// share the GPU's memory system), each rank on its own copy of the keys and values; engine_alone is
// rank 0's with the other ranks idle. Ring and engine rounds alternate (9 each, the median of
// each): a drift of the clocks weighs on both.
//   bench_ring_attention [--ranks 2] [--iters 10] [--json FILE] [--commit SHA]
// Shapes: S_local 4096 and 8192, D 128, (B, H, H_kv) (1, 32, 8) and (4, 16, 16), causal (zigzag)
// and not. engine_same_work: the rank's queries against all keys - non-causal, one problem of
// world x S_local keys; causal, each of its two zigzag chunks c against the keys up to its end
// ((c + 1) S_local / 2, causal aligned bottom-right: the masks the ring applies), two calls -
// with AttentionConfig::sms = the ring's CTAs. Causal points also time engine_same_flops: one
// non-causal problem of world x S_local / 2 keys (the same FLOPs, no mask, every item as long as
// the others: an engine's best case, and this benchmark's baseline before 2026-12-05).
// Correctness at every point:
// each rank's rows of the ring's O against mk::attention over the whole sequence (causal), as
// bf16: every element within 4 bf16 steps of its row's largest magnitude (+ 1e-4),
// bench::count_far_rows.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <string>
#include <thread>
#include <vector>

#include "bench_check.h"
#include "bench_inprocess.h"
#include "bench_kernels.h"
#include "mkernel/attention.h"
#include "mkernel/mkernel.h"

namespace {

using namespace mk;

struct Point {
  int64_t batch, heads, kv_heads, seq_local, head_dim;
  bool causal;
};

struct Result {
  double ring_ms = 0, engine_ms = 0, engine_alone_ms = 0;
  double engine_flops_ms = 0;  // causal: the same FLOPs as one non-causal problem
  bool correct = false;
  double max_diff = 0, max_abs = 0;
};

// Rows [part * len, (part + 1) * len) of a rank's share <-> the full sequence.
int64_t first_row(const Point& p, int world, int rank, int part) {
  if (!p.causal) return rank * p.seq_local;
  const int64_t len = p.seq_local / 2;
  return (part == 0 ? rank : 2 * world - 1 - rank) * len;
}

void copy_rows(void* local, const void* full, const Point& p, int world, int rank, int64_t heads,
               bool to_full, cudaStream_t s) {
  const int parts = p.causal ? 2 : 1;
  const int64_t len = p.seq_local / parts, row = heads * p.head_dim * 2;
  const int64_t full_s = world * p.seq_local;
  for (int64_t b = 0; b < p.batch; ++b) {
    for (int part = 0; part < parts; ++part) {
      char* l = static_cast<char*>(local) + (b * p.seq_local + part * len) * row;
      char* f = static_cast<char*>(const_cast<void*>(full)) +
                (b * full_s + first_row(p, world, rank, part)) * row;
      CK(cudaMemcpyAsync(to_full ? f : l, to_full ? l : f, len * row, cudaMemcpyDefault, s));
    }
  }
}

constexpr int kRounds = 9;  // timed rounds of `iters` calls, per op

Result run_point(const Point& p, int world, int iters) {
  const int64_t full_s = world * p.seq_local;
  const int64_t q_full = p.batch * full_s * p.heads * p.head_dim;
  const int64_t kv_full = p.batch * full_s * p.kv_heads * p.head_dim;
  void *q, *k, *v, *o_ring, *o_ref;
  CK(cudaMalloc(&q, q_full * 2));
  CK(cudaMalloc(&k, kv_full * 2));
  CK(cudaMalloc(&v, kv_full * 2));
  CK(cudaMalloc(&o_ring, q_full * 2));
  CK(cudaMalloc(&o_ref, q_full * 2));
  const uint64_t seed = bench::bench_seed();
  bench::launch_fill(q, q_full, seed, 0, nullptr);
  bench::launch_fill(k, kv_full, seed, 1, nullptr);
  bench::launch_fill(v, kv_full, seed, 2, nullptr);
  CK(cudaDeviceSynchronize());

  Result result;
  std::vector<double> rank_ms(world, 0), engine_ms(world, 0), flops_ms(world, 0);
  InProcessGroup group(world);
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r] {
      CK(cudaSetDevice(0));
      auto comm = Communicator::create(group.bootstrap(r));
      AttentionProblem local;
      local.batch = p.batch;
      local.seq_q = local.seq_kv = p.seq_local;
      local.heads = p.heads;
      local.kv_heads = p.kv_heads;
      local.head_dim = p.head_dim;
      local.causal = p.causal;
      cudaStream_t s;
      CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
      const int64_t q_n = p.batch * p.seq_local * p.heads * p.head_dim;
      const int64_t kv_n = p.batch * p.seq_local * p.kv_heads * p.head_dim;
      void *lq, *lk, *lv, *lo;
      CK(cudaMalloc(&lq, q_n * 2));
      CK(cudaMalloc(&lk, kv_n * 2));
      CK(cudaMalloc(&lv, kv_n * 2));
      CK(cudaMalloc(&lo, q_n * 2));
      copy_rows(lq, q, p, world, r, p.heads, false, s);
      copy_rows(lk, k, p, world, r, p.kv_heads, false, s);
      copy_rows(lv, v, p, world, r, p.kv_heads, false, s);
      SymmetricBuffer ws = comm->alloc(ring_attention_workspace_bytes(*comm, local));
      auto ring = [&] {
        ring_attention(*comm, local, {lq}, {lk}, {lv}, lo, nullptr, ws.data(), s);
      };
      ring();
      comm->synchronize(s);
      copy_rows(lo, o_ring, p, world, r, p.heads, true, s);
      CK(cudaStreamSynchronize(s));
      cudaEvent_t start, stop;
      CK(cudaEventCreate(&start));
      CK(cudaEventCreate(&stop));
      // The engine on the same work and SMs: this rank's queries against all keys, on the ring's
      // CTAs (causal: each zigzag chunk against the keys up to its end, below).
      AttentionProblem same = local;  // (non-causal)
      same.seq_kv = full_s;
      // Causal's same FLOPs as one unmasked problem (engine_same_flops).
      AttentionProblem flat = local;
      flat.causal = false;
      flat.seq_kv = full_s / 2;
      AttentionConfig config;
      config.sms = ring_attention_plan(*comm, local).ctas;
      // Each rank's engine reads its own copy of the keys and values, as on GPUs of their own:
      // ranks sharing one buffer would share its lines in L2, which the ring's ranks (reading
      // their own chunks and slots) do not.
      void *ek, *ev;
      CK(cudaMalloc(&ek, kv_full * 2));
      CK(cudaMalloc(&ev, kv_full * 2));
      CK(cudaMemcpyAsync(ek, k, kv_full * 2, cudaMemcpyDeviceToDevice, s));
      CK(cudaMemcpyAsync(ev, v, kv_full * 2, cudaMemcpyDeviceToDevice, s));
      const AttentionTensor kk{ek}, vv{ev};
      // Causal: chunk c = part 0's r or part 1's 2 world - 1 - r, its S_local / 2 queries (a view
      // of lq) against keys [0, (c + 1) S_local / 2) of the whole k, v (views), causal aligned
      // bottom-right - query i of the chunk sees keys up to c S_local / 2 + i.
      const int64_t half = p.seq_local / 2;
      auto engine = [&] {
        if (!p.causal) {
          attention(same, {lq}, kk, vv, lo, nullptr, s, config);
          return;
        }
        for (int part = 0; part < 2; ++part) {
          const int64_t c = part == 0 ? r : 2 * world - 1 - r;
          AttentionProblem chunk = local;
          chunk.seq_q = half;
          chunk.seq_kv = (c + 1) * half;
          const AttentionTensor cq{
              static_cast<const char*>(lq) + part * half * p.heads * p.head_dim * 2,
              p.seq_local * p.heads * p.head_dim, p.heads * p.head_dim, p.head_dim};
          const AttentionTensor ck{ek, full_s * p.kv_heads * p.head_dim, p.kv_heads * p.head_dim,
                                   p.head_dim};
          const AttentionTensor cv{ev, full_s * p.kv_heads * p.head_dim, p.kv_heads * p.head_dim,
                                   p.head_dim};
          attention(chunk, cq, ck, cv, lo, nullptr, s, config);
        }
      };
      auto engine_flops = [&] { attention(flat, {lq}, kk, vv, lo, nullptr, s, config); };
      engine();
      if (p.causal) engine_flops();
      CK(cudaStreamSynchronize(s));
      // `iters` calls, ms per call (`together`: every rank starts at once).
      auto time_calls = [&](auto&& call, bool ring_sync, bool together = true) {
        if (together) comm->bootstrap().barrier();
        CK(cudaEventRecord(start, s));
        for (int i = 0; i < iters; ++i) call();
        CK(cudaEventRecord(stop, s));
        if (ring_sync) {
          comm->synchronize(s);
        } else {
          CK(cudaEventSynchronize(stop));
        }
        float ms = 0;
        CK(cudaEventElapsedTime(&ms, start, stop));
        return static_cast<double>(ms) / iters;
      };
      // Ring and engine rounds alternate (every rank at once, as the ring runs), so that a drift
      // of the clocks over the run weighs on both; the median of each. Then the engine on rank 0
      // alone (the other ranks idle).
      std::vector<double> ring_rounds, engine_rounds, flops_rounds;
      for (int round = 0; round < kRounds; ++round) {
        ring_rounds.push_back(time_calls(ring, true));
        engine_rounds.push_back(time_calls(engine, false));
        if (p.causal) flops_rounds.push_back(time_calls(engine_flops, false));
      }
      rank_ms[r] = mk::bench::median(ring_rounds);
      engine_ms[r] = mk::bench::median(engine_rounds);
      if (p.causal) flops_ms[r] = mk::bench::median(flops_rounds);
      comm->bootstrap().barrier();
      if (r == 0) {
        std::vector<double> alone;
        for (int round = 0; round < kRounds; ++round) {
          alone.push_back(time_calls(engine, false, /*together=*/false));
        }
        result.engine_alone_ms = mk::bench::median(alone);
      }
      comm->bootstrap().barrier();
      CK(cudaEventDestroy(start));
      CK(cudaEventDestroy(stop));
      for (void* x : {lq, lk, lv, lo, ek, ev}) CK(cudaFree(x));
      CK(cudaStreamDestroy(s));
    });
  }
  for (auto& t : threads) t.join();
  result.ring_ms = *std::max_element(rank_ms.begin(), rank_ms.end());
  result.engine_ms = *std::max_element(engine_ms.begin(), engine_ms.end());
  result.engine_flops_ms = *std::max_element(flops_ms.begin(), flops_ms.end());

  // The whole sequence through the engine, against the ranks' rows put back in order.
  AttentionProblem full;
  full.batch = p.batch;
  full.seq_q = full.seq_kv = full_s;
  full.heads = p.heads;
  full.kv_heads = p.kv_heads;
  full.head_dim = p.head_dim;
  full.causal = p.causal;
  attention(full, {q}, {k}, {v}, o_ref, nullptr, nullptr);
  const bench::MaxDiff d = bench::max_diff_bf16(o_ring, o_ref, q_full);
  result.max_diff = d.diff;
  result.max_abs = d.mag;
  // Every element within 4 bf16 steps of its row's largest |O| (D values of one query and head):
  // causal rows late in the sequence are far smaller than the first ones, so a bound on the
  // largest |O| overall would not see them; and a bound on each element's own magnitude flags
  // elements small by cancellation, where the ring and the engine (another block order) round P
  // differently (the world-1 causal shapes at 16f9503).
  result.correct = bench::count_far_rows(o_ring, o_ref, q_full / p.head_dim,
                                         static_cast<int>(p.head_dim), nullptr) == 0;
  for (void* x : {q, k, v, o_ring, o_ref}) CK(cudaFree(x));
  return result;
}

}  // namespace

int main(int argc, char** argv) {
  mk::bench::InProcessArgs args;
  args.iters = 10;
  if (!mk::bench::parse_inprocess_args(argc, argv, args)) return 2;
  const int world = args.ranks, iters = args.iters;
  setenv("CUDA_DEVICE_MAX_CONNECTIONS", "32", 0);  // a queue per rank's stream
  cudaDeviceProp prop{};
  CK(cudaGetDeviceProperties(&prop, 0));
  std::vector<Point> points;
  for (int64_t s : {4096, 8192}) {
    for (bool causal : {false, true}) {
      points.push_back({1, 32, 8, s, 128, causal});
      points.push_back({4, 16, 16, s, 128, causal});
    }
  }
  std::printf("ring_attention in-process, %d ranks on one %s\n", world, prop.name);
  std::printf("%2s %3s %3s %6s %4s %6s %9s %9s %9s %9s %7s %8s  check\n", "B", "H", "Hkv", "S_loc",
              "D", "causal", "ring ms", "engine", "flops", "alone", "ratio", "TFLOP/s");
  std::string rows;
  bool all_ok = true;
  for (const Point& p : points) {
    const Result r = run_point(p, world, iters);
    // This rank's FLOPs: its queries against every key (half of them, causal).
    const double flops = 4.0 * p.batch * p.heads * p.seq_local * (world * p.seq_local) *
                         p.head_dim / (p.causal ? 2 : 1);
    const double ratio = r.ring_ms / r.engine_ms;
    all_ok = all_ok && r.correct;
    std::printf(
        "%2lld %3lld %3lld %6lld %4lld %6s %9.4f %9.4f %9.4f %9.4f %7.3f %8.1f  %s (diff %.2e, "
        "|O| %.2e)\n",
        static_cast<long long>(p.batch), static_cast<long long>(p.heads),
        static_cast<long long>(p.kv_heads), static_cast<long long>(p.seq_local),
        static_cast<long long>(p.head_dim), p.causal ? "True" : "False", r.ring_ms, r.engine_ms,
        r.engine_flops_ms, r.engine_alone_ms, ratio, flops / r.ring_ms * 1e-9,
        r.correct ? "ok" : "WRONG", r.max_diff, r.max_abs);
    char flops_col[32] = "null";
    if (p.causal) std::snprintf(flops_col, sizeof(flops_col), "%.5f", r.engine_flops_ms);
    char row[1024];
    std::snprintf(row, sizeof(row),
                  "%s    {\"shape\": {\"batch\": %lld, \"heads\": %lld, \"kv_heads\": %lld, "
                  "\"seq_local\": %lld, \"head_dim\": %lld, \"causal\": %s, \"world\": %d}, "
                  "\"dtype\": \"bf16\", \"ms\": {\"mkernel\": %.5f, \"engine_same_work\": %.5f, "
                  "\"engine_same_flops\": %s, \"engine_alone\": %.5f, \"torch_sdpa\": null, "
                  "\"sequential\": null}, \"limit_ms\": %.5f, "
                  "\"ratio_to_limit\": %.4f, \"ring_vs_engine\": %.4f, \"tflops\": %.1f, "
                  "\"correct\": %s}",
                  rows.empty() ? "" : ",\n", static_cast<long long>(p.batch),
                  static_cast<long long>(p.heads), static_cast<long long>(p.kv_heads),
                  static_cast<long long>(p.seq_local), static_cast<long long>(p.head_dim),
                  p.causal ? "true" : "false", world, r.ring_ms, r.engine_ms, flops_col,
                  r.engine_alone_ms, r.engine_ms, ratio, ratio, flops / r.ring_ms * 1e-9,
                  r.correct ? "true" : "false");
    rows += row;
  }
  if (!args.json.empty() &&
      !mk::bench::write_inprocess_results(
          args.json, "ring_attention", args.commit, prop.name, world,
          "in-process (one GPU: ranks share it, peer copies stay in its memory)", rows)) {
    return 2;
  }
  return all_ok ? 0 : 1;
}
