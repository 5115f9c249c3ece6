// Benchmark of the standalone collectives against NCCL, one process per rank under mkrun:
//   mkrun -n 2 -- bench_collectives [--sizes-mib 8,64,512] [--iters 20] [--json FILE] [--check]
// Per size (bytes contributed per rank) and op: mkernel at several channel counts, NCCL, and a
// copy-engine peer copy (cudaMemcpyAsync into the peer's mapping) as the link's ceiling.
// Correctness in the same run: all_gather bitwise equal to NCCL; reductions compared with an fp64
// reference rebuilt on the GPU, err(mkernel) <= 2 * err(NCCL) + 1e-6 (../shared/STYLE.md rule).
// Times: median over iterations (CUDA events), maximum over ranks.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <functional>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "bench_check.h"
#include "bench_kernels.h"
#include "bench_rank.h"
#include "mkernel/mkernel.h"
#include "nccl_dl.h"

namespace {

using namespace mk;
using namespace mk::bench;

struct Args {
  std::vector<std::size_t> sizes_mib = {8, 64, 512};
  std::vector<int> channels = {16, 32, 48, 64, 96, 128};
  int iters = 20;
  int warmup = 5;
  std::string json;
  bool check_only = false;  // correctness against NCCL only, no timing
  std::string ops = "all_gather,reduce_scatter,all_reduce";
};

Args parse(int argc, char** argv) {
  Args a;
  auto list = [](const std::string& s) {
    std::vector<std::size_t> v;
    std::stringstream ss(s);
    for (std::string t; std::getline(ss, t, ',');) v.push_back(std::stoul(t));
    return v;
  };
  for (int i = 1; i < argc; ++i) {
    std::string k = argv[i];
    std::string v = i + 1 < argc ? argv[i + 1] : "";
    if (k == "--sizes-mib")
      a.sizes_mib = list(v), ++i;
    else if (k == "--channels") {
      a.channels.clear();
      for (auto c : list(v)) a.channels.push_back((int)c);
      ++i;
    } else if (k == "--iters")
      a.iters = std::stoi(v), ++i;
    else if (k == "--warmup")
      a.warmup = std::stoi(v), ++i;
    else if (k == "--json")
      a.json = v, ++i;
    else if (k == "--check")
      a.check_only = true;
    else if (k == "--ops")
      a.ops = v, ++i;
    else {
      std::fprintf(stderr, "unknown argument %s\n", k.c_str());
      std::exit(2);
    }
  }
  return a;
}

class Bench {
 public:
  Bench(Communicator& comm, const Args& args) : comm_(comm), args_(args) {
    CK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    for (int i = 0; i < args.iters; ++i) {
      cudaEvent_t a, b;
      CK(cudaEventCreate(&a));
      CK(cudaEventCreate(&b));
      start_.push_back(a);
      stop_.push_back(b);
    }
  }

  // Median of per-iteration event times on this rank, then the maximum over ranks.
  double time_ms(const std::function<void()>& op) {
    for (int i = 0; i < args_.warmup; ++i) op();
    CK(cudaStreamSynchronize(stream_));
    comm_.check();
    comm_.bootstrap().barrier();
    for (int i = 0; i < args_.iters; ++i) {
      CK(cudaEventRecord(start_[i], stream_));
      op();
      CK(cudaEventRecord(stop_[i], stream_));
    }
    CK(cudaStreamSynchronize(stream_));
    comm_.check();
    std::vector<float> t(args_.iters);
    for (int i = 0; i < args_.iters; ++i) CK(cudaEventElapsedTime(&t[i], start_[i], stop_[i]));
    std::sort(t.begin(), t.end());
    double median = t[t.size() / 2];
    std::vector<double> all(comm_.world_size());
    comm_.bootstrap().allgather(&median, all.data(), sizeof(double));
    return *std::max_element(all.begin(), all.end());
  }

  cudaStream_t stream() const { return stream_; }

 private:
  Communicator& comm_;
  const Args& args_;
  cudaStream_t stream_;
  std::vector<cudaEvent_t> start_, stop_;
};

struct Op {
  const char* name;
  double bus_factor;  // busbw = bytes_per_rank * factor / time  (nccl-tests convention)
  std::function<void(const CollectiveConfig&)> ours;
  std::function<void()> theirs;
  std::function<bool(std::string*)> check;
};

std::string now_utc() {
  std::time_t t = std::time(nullptr);
  char buf[32];
  std::strftime(buf, sizeof(buf), "%Y-%m-%dT%H:%M:%SZ", std::gmtime(&t));
  return buf;
}

// Without NCCL (ranks sharing a GPU): half a bf16 ulp of the largest possible sum - `world`
// inputs in [-1, 1) - as the bar's "NCCL error", so that ours may be off by one ulp there.
double no_nccl_bar(int world) {
  double ulp = 1.0 / 128;  // bf16 ulp of values in [1, 2)
  for (int w = world; w >= 2; w /= 2) ulp *= 2;
  return ulp / 2;
}

}  // namespace

int main(int argc, char** argv) {
  const Args args = parse(argc, argv);
  auto boot = bench::mkrun_rank(argv[0]);
  Bootstrap& bootstrap = *boot;
  // Borrowed: the mkrun connection also serves NCCL's id exchange below.
  auto comm = Communicator::create(borrow_bootstrap(bootstrap));
  const int rank = comm->rank(), world = comm->world_size();
  const bool root = rank == 0;

  // Ranks sharing a GPU: NCCL refuses them ("invalid usage") and their timings say nothing, so
  // only the check runs, against references rebuilt here (bitwise for all_gather, the fp64 sum
  // within one bf16 ulp of the largest sum for the reductions).
  const bool shared_gpu = comm->topology().max_ranks_per_device > 1;
  if (shared_gpu && !args.check_only) {
    if (root) {
      std::fprintf(stderr,
                   "bench_collectives: %d ranks share a GPU: timings need one GPU per rank (run "
                   "--check, or fewer ranks)\n",
                   comm->topology().max_ranks_per_device);
    }
    return 2;
  }
  const bench::Nccl* nccl_lib = shared_gpu ? nullptr : &bench::Nccl::get();
  int nccl_version = 0;
  ncclComm_t nc = nullptr;
  if (nccl_lib != nullptr) {
    nccl_lib->GetVersion(&nccl_version);
    ncclUniqueId id{};
    if (root) nccl_lib->check(nccl_lib->GetUniqueId(&id), "ncclGetUniqueId");
    std::vector<ncclUniqueId> ids(world);
    bootstrap.allgather(&id, ids.data(), sizeof(id));
    nccl_lib->check(nccl_lib->CommInitRank(&nc, world, ids[0], rank), "ncclCommInitRank");
  }
  const bench::Nccl& nccl = nccl_lib != nullptr ? *nccl_lib : bench::Nccl::none();

  const std::size_t max_bytes = *std::max_element(args.sizes_mib.begin(), args.sizes_mib.end())
                                << 20;
  // Symmetric buffers for mkernel, plain ones for NCCL.
  SymmetricBuffer sym_big = comm->alloc(max_bytes * world);  // AG output / RS input
  SymmetricBuffer sym_ar = comm->alloc(max_bytes);           // AR in place
  void *plain_in, *plain_big, *plain_small, *scratch;
  CK(cudaMalloc(&plain_in, max_bytes));
  CK(cudaMalloc(&plain_big, max_bytes * world));
  CK(cudaMalloc(&plain_small, max_bytes));
  CK(cudaMalloc(&scratch, max_bytes));
  unsigned long long* d_stat;
  CK(cudaMalloc(&d_stat, sizeof(unsigned long long)));

  Bench bench(*comm, args);
  cudaStream_t s = bench.stream();
  cudaDeviceProp prop{};
  CK(cudaGetDeviceProperties(&prop, comm->device()));
  if (root && nccl_lib != nullptr) {
    std::printf("mkernel collectives vs NCCL %d (%s), world %d, %s\n", nccl_version,
                nccl.path.c_str(), world, prop.name);
  } else if (root) {
    std::printf(
        "mkernel collectives, world %d with %d ranks per GPU (%s): checked against "
        "references rebuilt here, without NCCL\n",
        world, comm->topology().max_ranks_per_device, prop.name);
  }

  std::ostringstream rows;
  bool all_correct = true;
  std::vector<std::string> summary;
  // Fresh data every run, the same generator on every rank: rank 0 draws the seed.
  uint64_t seed =
      static_cast<uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count());
  {
    std::vector<uint64_t> seeds(world);
    bootstrap.allgather(&seed, seeds.data(), sizeof(seed));
    seed = seeds[0];
  }
  auto fill = [&](void* p, std::size_t elems, uint64_t sd) { launch_fill(p, elems, sd, rank, s); };
  auto max_error = [&](const void* got, std::size_t n, std::size_t base, uint64_t sd) {
    CK(cudaMemsetAsync(d_stat, 0, sizeof(*d_stat), s));
    launch_max_error(got, n, base, sd, world, d_stat, s);
    unsigned long long bits = 0;
    CK(cudaMemcpyAsync(&bits, d_stat, sizeof(bits), cudaMemcpyDeviceToHost, s));
    CK(cudaStreamSynchronize(s));
    double e;
    std::memcpy(&e, &bits, sizeof(e));
    double worst = 0;
    std::vector<double> all(world);
    comm->bootstrap().allgather(&e, all.data(), sizeof(e));
    for (double x : all) worst = std::max(worst, x);
    return worst;
  };

  for (std::size_t mib : args.sizes_mib) {
    const std::size_t bytes = mib << 20, count = bytes / 2;
    // Copy-engine peer copy into the next rank's mapping: the link's one-way ceiling.
    double peer_ms = 0;
    if (!args.check_only) {
      const int peer = (comm->topology().local_rank + 1) % comm->topology().local_size;
      void* dst = sym_big.peer(peer);
      peer_ms = bench.time_ms([&] {
        if (root) CK(cudaMemcpyAsync(dst, plain_in, bytes, cudaMemcpyDeviceToDevice, s));
      });
    }
    const double peer_gbps = bytes / peer_ms * 1e-6;

    const double f_ag = world - 1.0;  // (w * S) * (w - 1) / w
    std::vector<Op> ops;
    ops.push_back(
        Op{"all_gather", f_ag,
           [&](const CollectiveConfig& c) {
             all_gather(*comm, plain_in, sym_big.data(), count, DType::kBF16, s, c);
           },
           [&] {
             nccl.check(nccl.AllGather(plain_in, plain_big, count, ncclBfloat16, nc, s),
                        "ncclAllGather");
           },
           [&](std::string* why) {
             fill(plain_in, count, seed + mib);
             all_gather(*comm, plain_in, sym_big.data(), count, DType::kBF16, s);
             if (nc != nullptr) {
               nccl.check(nccl.AllGather(plain_in, plain_big, count, ncclBfloat16, nc, s),
                          "ncclAllGather");
             } else {  // every rank's input, rebuilt: what the gather must hold bitwise
               for (int r = 0; r < world; ++r) {
                 launch_fill(static_cast<char*>(plain_big) + r * bytes, count, seed + mib, r, s);
               }
             }
             CK(cudaMemsetAsync(d_stat, 0, sizeof(*d_stat), s));
             launch_count_diff(sym_big.data(), plain_big, bytes * world / 16, d_stat, s);
             unsigned long long diffs = 0;
             CK(cudaMemcpyAsync(&diffs, d_stat, sizeof(diffs), cudaMemcpyDeviceToHost, s));
             comm->synchronize(s);
             *why = std::to_string(diffs) + " vectors differ from " +
                    (nc != nullptr ? "NCCL" : "the inputs");
             unsigned long long all_diffs[64] = {};
             comm->bootstrap().allgather(&diffs, all_diffs, sizeof(diffs));
             for (int r = 0; r < world; ++r)
               if (all_diffs[r]) return false;
             return true;
           }});
    ops.push_back(Op{
        "reduce_scatter", f_ag,
        [&](const CollectiveConfig& c) {
          reduce_scatter(*comm, sym_big.data(), plain_small, count, DType::kBF16, s, c);
        },
        [&] {
          nccl.check(nccl.ReduceScatter(plain_big, scratch, count, ncclBfloat16, ncclSum, nc, s),
                     "ncclReduceScatter");
        },
        [&](std::string* why) {
          fill(sym_big.data(), count * world, seed + 7 * mib);
          CK(cudaMemcpyAsync(plain_big, sym_big.data(), bytes * world, cudaMemcpyDeviceToDevice,
                             s));
          reduce_scatter(*comm, sym_big.data(), plain_small, count, DType::kBF16, s);
          if (nc != nullptr) {
            nccl.check(nccl.ReduceScatter(plain_big, scratch, count, ncclBfloat16, ncclSum, nc, s),
                       "ncclReduceScatter");
          }
          comm->synchronize(s);
          const double ours = max_error(plain_small, count, rank * count, seed + 7 * mib);
          const double theirs = nc != nullptr
                                    ? max_error(scratch, count, rank * count, seed + 7 * mib)
                                    : no_nccl_bar(world);
          *why = "max error " + std::to_string(ours) + (nc != nullptr ? " vs NCCL " : " bar ") +
                 std::to_string(theirs);
          return ours <= 2 * theirs + 1e-6;
        }});
    ops.push_back(Op{
        "all_reduce", 2.0 * (world - 1) / world,
        [&](const CollectiveConfig& c) {
          all_reduce(*comm, sym_ar.data(), sym_ar.data(), count, DType::kBF16, s, c);
        },
        [&] {
          nccl.check(nccl.AllReduce(plain_small, plain_small, count, ncclBfloat16, ncclSum, nc, s),
                     "ncclAllReduce");
        },
        [&](std::string* why) {
          fill(sym_ar.data(), count, seed + 13 * mib);
          CK(cudaMemcpyAsync(plain_small, sym_ar.data(), bytes, cudaMemcpyDeviceToDevice, s));
          all_reduce(*comm, sym_ar.data(), sym_ar.data(), count, DType::kBF16, s);
          if (nc != nullptr) {
            nccl.check(
                nccl.AllReduce(plain_small, plain_small, count, ncclBfloat16, ncclSum, nc, s),
                "ncclAllReduce");
          }
          comm->synchronize(s);
          const double ours = max_error(sym_ar.data(), count, 0, seed + 13 * mib);
          const double theirs = nc != nullptr ? max_error(plain_small, count, 0, seed + 13 * mib)
                                              : no_nccl_bar(world);
          *why = "max error " + std::to_string(ours) + (nc != nullptr ? " vs NCCL " : " bar ") +
                 std::to_string(theirs);
          return ours <= 2 * theirs + 1e-6;
        }});

    for (Op& op : ops) {
      if (("," + args.ops + ",").find(std::string(",") + op.name + ",") == std::string::npos)
        continue;
      std::string why;
      const bool correct = op.check(&why);
      all_correct = all_correct && correct;
      if (args.check_only) {
        if (root) {
          std::printf("%-15s %5zu MiB  %s  %s\n", op.name, mib, correct ? "ok" : "WRONG",
                      why.c_str());
        }
        continue;
      }
      std::ostringstream sweep;
      double best_ms = 1e30;
      int best_channels = 0;
      for (int ch : args.channels) {
        CollectiveConfig cfg;
        cfg.channels = ch;
        const double ms = bench.time_ms([&] { op.ours(cfg); });
        sweep << (sweep.tellp() > 0 ? ", " : "") << "\"" << ch << "\": " << ms;
        if (ms < best_ms) best_ms = ms, best_channels = ch;
      }
      const double default_ms = bench.time_ms([&] { op.ours(CollectiveConfig{}); });
      // reduce_scatter: also the threads' loads instead of the bulk copies (CollectiveConfig::
      // bulk off), default config otherwise, in the same run.
      double loads_ms = -1;
      if (std::string(op.name) == "reduce_scatter") {
        CollectiveConfig loads;
        loads.bulk = false;
        loads_ms = bench.time_ms([&] { op.ours(loads); });
      }
      const double nccl_ms = bench.time_ms(op.theirs);
      const double bus = bytes * op.bus_factor * 1e-6;  // GB/s once divided by ms
      if (root) {
        char line[400];
        std::snprintf(line, sizeof(line),
                      "%-15s %5zu MiB  mkernel %8.3f ms %6.1f GB/s (default %8.3f ms, best %d ch)  "
                      "NCCL %8.3f ms %6.1f GB/s  peer copy %6.1f GB/s  x%.2f  %s",
                      op.name, mib, best_ms, bus / best_ms, default_ms, best_channels, nccl_ms,
                      bus / nccl_ms, peer_gbps, nccl_ms / best_ms, correct ? "ok" : "WRONG");
        std::printf("%s\n", line);
        if (loads_ms > 0) {
          std::printf("  %s loads path (bulk = false): %.3f ms\n", op.name, loads_ms);
        }
        if (!correct) std::printf("  %s\n", why.c_str());
        summary.push_back(line);
        rows << (rows.tellp() > 0 ? ",\n" : "") << "    {\"op\": \"" << op.name
             << "\", \"shape\": {\"bytes_per_rank\": " << bytes << "}, \"dtype\": \"bf16\", "
             << "\"ms\": {\"mkernel\": " << best_ms
             << ", \"mkernel_default_config\": " << default_ms
             << (loads_ms > 0 ? ", \"mkernel_loads_path\": " + std::to_string(loads_ms) : "")
             << ", \"nccl\": " << nccl_ms << ", \"peer_copy\": " << peer_ms << "}, "
             << "\"busbw_gbps\": {\"mkernel\": " << bus / best_ms << ", \"nccl\": " << bus / nccl_ms
             << ", \"peer_copy_one_way\": " << peer_gbps << "}, "
             << "\"best_channels\": " << best_channels << ", \"channel_sweep_ms\": {" << sweep.str()
             << "}, \"speedup_vs_nccl\": " << nccl_ms / best_ms
             << ", \"correct\": " << (correct ? "true" : "false") << "}";
      }
    }
  }

  if (root && !args.json.empty() && !args.check_only) {
    FILE* f = std::fopen(args.json.c_str(), "w");
    const char* commit = std::getenv("MKERNEL_COMMIT");
    std::fprintf(
        f,
        "{\n  \"kernel\": \"collectives\",\n  \"commit\": \"%s\",\n  \"date\": \"%s\",\n"
        "  \"device\": \"%s\",\n  \"world_size\": %d,\n  \"num_nodes\": 1,\n"
        "  \"transport\": \"nvlink\",\n  \"baseline\": \"NCCL %d\",\n  \"rows\": [\n%s\n  ]\n}\n",
        commit ? commit : "unknown", now_utc().c_str(), prop.name, world, nccl_version,
        rows.str().c_str());
    std::fclose(f);
    std::printf("wrote %s\n", args.json.c_str());
  }
  if (nc != nullptr) nccl.CommDestroy(nc);
  return all_correct ? 0 : 1;
}
