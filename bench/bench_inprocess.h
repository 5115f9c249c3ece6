// What the one-GPU benchmarks with ranks as threads share (bench_ring_attention,
// bench_moe_ranks): their command line, the median of timed rounds, and the results file.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <functional>
#include <string>
#include <vector>

namespace mk::bench {

struct InProcessArgs {
  int ranks = 2;
  int iters;
  std::string json;
  std::string commit = "unknown";  // MKERNEL_COMMIT, or --commit
};

// [--ranks N] [--iters N] [--json FILE] [--commit SHA], and the keys `extra` takes (true: it
// took the key and its value); false (after a usage line) on anything else or a non-positive
// count.
inline bool parse_inprocess_args(
    int argc, char** argv, InProcessArgs& a,
    const std::function<bool(const std::string&, const std::string&)>& extra = {},
    const char* extra_usage = "") {
  if (const char* c = std::getenv("MKERNEL_COMMIT")) a.commit = c;
  const int default_ranks = a.ranks, default_iters = a.iters;  // (for the usage line)
  bool ok = true;
  for (int i = 1; ok && i + 1 < argc; i += 2) {
    const std::string key = argv[i], value = argv[i + 1];
    if (key == "--ranks") {
      a.ranks = std::atoi(value.c_str());
    } else if (key == "--iters") {
      a.iters = std::atoi(value.c_str());
    } else if (key == "--json") {
      a.json = value;
    } else if (key == "--commit") {
      a.commit = value;
    } else {
      ok = extra && extra(key, value);
    }
  }
  if (!ok || argc % 2 == 0 || a.ranks < 1 || a.iters < 1) {
    std::fprintf(stderr, "usage: %s [--ranks %d] [--iters %d] [--json FILE] [--commit SHA]%s\n",
                 argv[0], default_ranks, default_iters, extra_usage);
    return false;
  }
  return true;
}

// The data's seed: MKERNEL_BENCH_SEED when set (the same routing and values in every variant of
// an A/B - scripts/ab_variants.sh sets it - or a results file's run again), else the time.
inline uint64_t bench_seed() {
  const char* pinned = std::getenv("MKERNEL_BENCH_SEED");
  if (pinned != nullptr && *pinned != '\0') return std::strtoull(pinned, nullptr, 10);
  return static_cast<uint64_t>(std::time(nullptr));
}

inline double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// The results file (../shared/BENCH_SCHEMA.md) of `kernel` on one GPU: `rows` are the rows'
// JSON objects, comma-separated. False (after a message) when it cannot be written.
inline bool write_inprocess_results(const std::string& path, const char* kernel,
                                    const std::string& commit, const char* device, int world,
                                    const char* transport, const std::string& rows) {
  char date[32];
  const std::time_t now = std::time(nullptr);
  std::strftime(date, sizeof(date), "%Y-%m-%dT%H:%M:%SZ", std::gmtime(&now));
  FILE* f = std::fopen(path.c_str(), "w");
  if (f == nullptr) {
    std::perror(path.c_str());
    return false;
  }
  std::fprintf(f,
               "{\n  \"kernel\": \"%s\",\n  \"commit\": \"%s\",\n  \"date\": \"%s\",\n"
               "  \"device\": \"%s\",\n  \"world_size\": %d,\n  \"gpus\": 1,\n  \"num_nodes\": 1,\n"
               "  \"transport\": \"%s\",\n  \"rows\": [\n%s\n  ]\n}\n",
               kernel, commit.c_str(), date, device, world, transport, rows.c_str());
  std::fclose(f);
  return true;
}

}  // namespace mk::bench
