// Where a fused GEMM's launch spends its time. Runs ag_gemm, gemm_rs or gemm_ar on random data
// with MKERNEL_TRACE set, then summarises the last launch's timeline (src/fused/trace_layout.h)
// on every rank: consumers' mainloops, epilogues and waits for partials, the side threads' copies
// (or ag_gemm's pushes), the producer's waits for gathered rows (ag_gemm), and how these shares
// change over the launch (ten time bins).
//   mkrun -n 2 -- trace_fused [--kernel ag_gemm|gemm_rs|gemm_ar] [--shape MxNxK] [--iters 5]
//                             [--comm-ctas N] [--piece-rows N] [--sms N] [--csv FILE]
//   trace_fused --ranks 2 [...]   the ranks as threads of this one process, on the GPUs present
//                                 (rank r on GPU r % GPUs). On one GPU the ranks' kernels run side
//                                 by side on half of its SMs each and their "peer" traffic stays
//                                 in local memory: what it measures is the work inside the SM
//                                 (epilogues, staging, the side threads' loads), not NVLink.
//                                 (Separate processes on one GPU take turns: their timelines say
//                                 nothing.)
// As in bench_fused.py: gemm_rs / gemm_ar split K over the ranks (each holds K / world of it),
// ag_gemm splits M (each rank holds M / world rows of A). --csv writes every
// record (rank, cta, lane, ns since the launch's first record, event, argument), rank by rank.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include "bench_check.h"
#include "bench_kernels.h"
#include "bench_rank.h"
#include "fused/trace_layout.h"
#include "mkernel/mkernel.h"
#include "trace_records.h"

namespace {

using namespace mk;
using namespace mk::fused;

struct Args {
  std::string kernel = "gemm_rs";
  int64_t m = 8192, n = 8192, k = 8192;
  int iters = 5;
  int ranks = 0;  // > 0: this many ranks as threads of this process (else one rank, from mkrun)
  FusedGemmConfig config;  // --comm-ctas, --piece-rows, --sms (0: the plan's choice)
  std::string csv;
};

Args parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string key = argv[i], v = argv[i + 1];
    if (key == "--kernel") {
      a.kernel = v;
    } else if (key == "--shape") {
      if (std::sscanf(v.c_str(), "%ldx%ldx%ld", &a.m, &a.n, &a.k) != 3) {
        std::fprintf(stderr, "--shape MxNxK, got %s\n", v.c_str());
        std::exit(2);
      }
    } else if (key == "--iters") {
      a.iters = std::atoi(v.c_str());
    } else if (key == "--ranks") {
      a.ranks = std::atoi(v.c_str());
    } else if (key == "--comm-ctas") {
      a.config.comm_ctas = std::atoi(v.c_str());
    } else if (key == "--piece-rows") {
      a.config.piece_rows = std::atoi(v.c_str());
    } else if (key == "--sms") {
      a.config.sms = std::atoi(v.c_str());
    } else if (key == "--csv") {
      a.csv = v;
    } else {
      std::fprintf(stderr, "unknown option %s\n", key.c_str());
      std::exit(2);
    }
  }
  if (a.kernel != "ag_gemm" && a.kernel != "gemm_rs" && a.kernel != "gemm_ar") {
    std::fprintf(stderr, "--kernel ag_gemm, gemm_rs or gemm_ar\n");
    std::exit(2);
  }
  return a;
}

using bench::TraceRecord;

struct Totals {  // microseconds summed over consumer lanes (or side lanes)
  double mainloop = 0, remote_epilogue = 0, own_wait = 0, own_epilogue = 0, after_done = 0;
  double own_add = 0;       // part of own_epilogue: adding the partials
  double slot_wait = 0;     // part of remote_epilogue: waiting for a free outbox slot
  double operand_wait = 0;  // producer (ag_gemm): waiting for a peer's rows
  int operand_waits = 0;
  double side_busy = 0;
  int remote_tiles = 0, own_tiles = 0, items = 0;
  double mover_mainloop = 0;  // of mainloop: in CTAs whose side threads move data
  int mover_tiles = 0;
};

using bench::bin_add;
constexpr int kBins = bench::kTraceBins;

// `movers`: the plan's comm_ctas (the first CTAs move data with their side threads).
void summarise(int rank, int ctas, int movers, const std::vector<uint64_t>& raw, double event_ms,
               FILE* csv) {
  const bench::Timeline timeline = bench::read_timeline(raw, ctas, rank, csv);
  const auto& lanes = timeline.lanes;
  const double span = timeline.span;
  Totals tot;
  std::vector<double> b_main(kBins), b_epi(kBins), b_wait(kBins), b_side(kBins);
  std::vector<double> done_at;
  for (int c = 0; c < ctas; ++c) {
    const double start = lanes[c][kTraceSide].empty() ? 0 : lanes[c][kTraceSide][0].us;
    for (int l = kTraceConsumer0; l < kTraceConsumer0 + 2; ++l) {
      double prev_end = start, begin = 0, waited = -1, added = -1;
      bool remote = false;
      for (const TraceRecord& r : lanes[c][l]) {
        switch (r.event) {
          case kTraceStoreBegin:
            begin = r.us;
            remote = r.arg != 0;
            waited = -1;
            added = -1;
            tot.mainloop += begin - prev_end;
            if (c < movers) {
              tot.mover_mainloop += begin - prev_end;
              ++tot.mover_tiles;
            }
            bin_add(b_main, prev_end, begin, span);
            break;
          case kTraceWaited:
            if (remote) {  // the outbox slot is free (part of the peer's-tile epilogue)
              tot.slot_wait += r.us - begin;
              break;
            }
            waited = r.us;
            tot.own_wait += waited - begin;
            bin_add(b_wait, begin, waited, span);
            break;
          case kTraceAdded:
            added = r.us;
            tot.own_add += added - (waited >= 0 ? waited : begin);
            break;
          case kTraceStoreEnd:
            if (remote) {
              tot.remote_epilogue += r.us - begin;
              ++tot.remote_tiles;
            } else {
              tot.own_epilogue += r.us - (waited >= 0 ? waited : begin);
              ++tot.own_tiles;
            }
            bin_add(b_epi, waited >= 0 ? waited : begin, r.us, span);
            prev_end = r.us;
            break;
          case kTraceDone:
            tot.after_done += span - r.us;
            done_at.push_back(r.us);
            break;
          default:
            break;
        }
      }
    }
    double wait_at = -1;
    for (const TraceRecord& r : lanes[c][kTraceProducer]) {
      if (r.event == kTraceOperandsWait) wait_at = r.us;
      if (r.event == kTraceOperandsIn && wait_at >= 0) {
        tot.operand_wait += r.us - wait_at;
        ++tot.operand_waits;
        wait_at = -1;
      }
    }
    double item_at = -1;
    for (const TraceRecord& r : lanes[c][kTraceSide]) {
      if (r.event == kTraceItem) item_at = r.us;
      if (r.event == kTraceSent && item_at >= 0) {
        tot.side_busy += r.us - item_at;
        bin_add(b_side, item_at, r.us, span);
        ++tot.items;
        item_at = -1;
      }
    }
  }
  const double consumers = 2.0 * ctas;
  std::sort(done_at.begin(), done_at.end());
  auto pct = [&](double us) { return 100.0 * us / (consumers * span); };
  std::printf(
      "rank %d: launch %.1f us by the trace (%.1f us by CUDA events), %d CTAs\n"
      "  consumer time: mainloop %.1f%%, peers' tiles' epilogues %.1f%%, waits for partials "
      "%.1f%%, own epilogues %.1f%%, idle after the last tile %.1f%%\n"
      "  per tile (us): mainloop %.2f, peer's-tile epilogue %.2f (%d; waiting for an outbox slot "
      "%.2f of it), own wait %.2f + epilogue %.2f (%d; adding the partials %.2f of it)\n"
      "  last tile done (us): first CTA %.1f, median %.1f, last %.1f\n"
      "  side threads: %d items, %.2f us each, busy %.1f%% of the launch\n",
      rank, span, event_ms * 1e3, ctas, pct(tot.mainloop), pct(tot.remote_epilogue),
      pct(tot.own_wait), pct(tot.own_epilogue), pct(tot.after_done),
      tot.mainloop / std::max(1, tot.remote_tiles + tot.own_tiles),
      tot.remote_epilogue / std::max(1, tot.remote_tiles), tot.remote_tiles,
      tot.slot_wait / std::max(1, tot.remote_tiles), tot.own_wait / std::max(1, tot.own_tiles),
      tot.own_epilogue / std::max(1, tot.own_tiles), tot.own_tiles,
      tot.own_add / std::max(1, tot.own_tiles), done_at.empty() ? 0 : done_at.front(),
      done_at.empty() ? 0 : done_at[done_at.size() / 2], done_at.empty() ? 0 : done_at.back(),
      tot.items, tot.side_busy / std::max(1, tot.items), 100.0 * tot.side_busy / (ctas * span));
  if (tot.operand_waits > 0) {
    std::printf(
        "  producer: waited for peers' rows %.2f us per peer tile (%d), %.1f%% of the "
        "launch\n",
        tot.operand_wait / tot.operand_waits, tot.operand_waits,
        100.0 * tot.operand_wait / (ctas * span));
  }
  const int tiles = tot.remote_tiles + tot.own_tiles;
  if (movers > 0 && movers < ctas && tot.mover_tiles > 0 && tot.mover_tiles < tiles) {
    std::printf("  mainloop per tile (us): %.2f in the %d CTAs moving data, %.2f in the others\n",
                tot.mover_mainloop / tot.mover_tiles, movers,
                (tot.mainloop - tot.mover_mainloop) / (tiles - tot.mover_tiles));
  }
  std::printf("  bins of %.1f us  mainloop / epilogue / wait (%% of consumers), side busy (%%)\n",
              span / kBins);
  for (int i = 0; i < kBins; ++i) {
    const double cap = consumers * span / kBins;
    std::printf("    %2d  %5.1f %5.1f %5.1f   %5.1f\n", i, 100 * b_main[i] / cap,
                100 * b_epi[i] / cap, 100 * b_wait[i] / cap,
                100 * b_side[i] / (ctas * span / kBins));
  }
}

// One rank's launches and summary; `boot` is its bootstrap, its GPU already current.
void run_rank(const Args& args, std::unique_ptr<Bootstrap> boot) {
  auto comm = Communicator::create(std::move(boot));
  const int rank = comm->rank(), world = comm->world_size();
  const int64_t m = args.m, n = args.n;
  const bool rs = args.kernel == "gemm_rs", ag = args.kernel == "ag_gemm";
  const int64_t k_local = ag ? args.k : args.k / world;
  const int64_t a_rows = ag ? m / world : m;  // ag_gemm: this rank's shard of A
  cudaStream_t stream;
  CK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  void *a, *b, *out_plain = nullptr;
  CK(cudaMalloc(&a, a_rows * k_local * 2));
  CK(cudaMalloc(&b, n * k_local * 2));
  bench::launch_fill(a, a_rows * k_local, 1, rank, stream);
  bench::launch_fill(b, n * k_local, 2, rank, stream);
  const std::size_t ws_bytes = ag   ? ag_gemm_workspace_bytes(m, k_local)
                               : rs ? gemm_rs_workspace_bytes(m, n, world)
                                    : gemm_ar_workspace_bytes(*comm, m, n, k_local);
  SymmetricBuffer ws = comm->alloc(std::max<std::size_t>(ws_bytes, 16));
  CK(cudaMemsetAsync(ws.data(), 0, ws.size(), stream));
  SymmetricBuffer out_sym = comm->alloc(rs || ag ? 16 : m * n * 2);
  if (rs) CK(cudaMalloc(&out_plain, m / world * n * 2));
  if (ag) CK(cudaMalloc(&out_plain, m * n * 2));
  void* out = rs || ag ? out_plain : out_sym.data();
  const FusedGemmConfig& cfg = args.config;
  const FusedGemmPlan plan = ag   ? ag_gemm_plan(*comm, m, n, k_local, cfg)
                             : rs ? gemm_rs_plan(*comm, m, n, k_local, cfg)
                                  : gemm_ar_plan(*comm, m, n, k_local, cfg);
  if (rank == 0) {
    std::printf("%s %ldx%ldx%ld, world %d%s: %s\n", args.kernel.c_str(), m, n, args.k, world,
                args.ranks > 0 ? " (threads of one process)" : "", plan.describe().c_str());
  }
  // The trace buffer is allocated before any launch: ranks sharing a GPU in one process must not
  // allocate while a peer's kernel may already run (mkernel/communicator.h).
  trace_arm(*comm, plan.ctas, stream);
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  float ms = 0;
  for (int i = 0; i < args.iters; ++i) {  // the last launch is the one traced
    CK(cudaStreamSynchronize(stream));
    comm->bootstrap().barrier();
    CK(cudaEventRecord(e0, stream));
    if (ag) {
      ag_gemm(*comm, a, b, out, m, n, k_local, BLayout::kNK, ws.data(), stream, cfg);
    } else if (rs) {
      gemm_rs(*comm, a, b, out, m, n, k_local, BLayout::kNK, ws.data(), stream, cfg);
    } else {
      gemm_ar(*comm, a, b, out, m, n, k_local, BLayout::kNK, ws.data(), stream, cfg);
    }
    CK(cudaEventRecord(e1, stream));
  }
  CK(cudaEventSynchronize(e1));
  CK(cudaEventElapsedTime(&ms, e0, e1));
  int ctas = 0;
  const std::vector<uint64_t> raw = trace_read(ctas);
  FILE* csv = nullptr;
  for (int r = 0; r < world; ++r) {  // one rank at a time: readable output, one CSV
    comm->bootstrap().barrier();
    if (r != rank) continue;
    if (!args.csv.empty()) {
      csv = std::fopen(args.csv.c_str(), r == 0 ? "w" : "a");
      if (csv != nullptr && r == 0) std::fprintf(csv, "rank,cta,lane,us,event,arg\n");
    }
    summarise(rank, ctas, plan.comm_ctas, raw, ms, csv);
    std::fflush(stdout);
    if (csv != nullptr) std::fclose(csv);
  }
  comm->bootstrap().barrier();
}

}  // namespace

int main(int argc, char** argv) {
  const Args args = parse(argc, argv);
  setenv("MKERNEL_TRACE", "1", 1);
  if (args.ranks <= 0) {
    run_rank(args, bench::mkrun_rank(argv[0]));
    return 0;
  }
  setenv("CUDA_DEVICE_MAX_CONNECTIONS", "32", 0);  // a queue per rank's stream (communicator.h)
  int gpus = 0;
  CK(cudaGetDeviceCount(&gpus));
  InProcessGroup group(args.ranks);
  std::vector<std::thread> threads;
  for (int r = 0; r < args.ranks; ++r) {
    threads.emplace_back([&, r] {
      CK(cudaSetDevice(r % gpus));
      run_rank(args, group.bootstrap(r));
    });
  }
  for (auto& t : threads) t.join();
  return 0;
}
