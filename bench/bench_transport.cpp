// The inter-node proxy path over loopback, no GPU needed: two ranks (threads of this process)
// each with a transport, a HostSignalPad and a Proxy; commands are pushed into the proxy's ring
// from the host, exactly as the GPU will push them (include/mkernel/transport/proxy.h).
//
//   bench_transport [--backend socket] [--total-mib 1024] [--iters 2000]
//
// latency:   ping-pong of an 8-byte put+signal (rank 0 -> 1 -> 0); one way = round trip / 2,
//            median of --iters round trips
// bandwidth: rank 0 streams --total-mib MiB to rank 1 in puts of each chunk size, the last one
//            signalled; time from the first push until rank 1 sees the signal
// idle:      the CPU the progress threads (proxy consumers, transport receivers) of both ranks
//            use in one second with nothing to do
// Prints one line per measurement (the journal, docs/PERFORMANCE.md, records them).
#include <sys/resource.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

#include "mkernel/bootstrap.h"
#include "mkernel/transport/proxy.h"
#include "mkernel/transport/transport.h"

namespace {

using namespace mk::transport;
using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

// CPU seconds this process has used (user + system, all threads).
double process_cpu_seconds() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return static_cast<double>(u.ru_utime.tv_sec + u.ru_stime.tv_sec) +
         1e-6 * static_cast<double>(u.ru_utime.tv_usec + u.ru_stime.tv_usec);
}

struct Args {
  std::string backend = "socket";
  uint64_t total_mib = 1024;
  int iters = 2000;
};

void run_rank(mk::Bootstrap& boot, const Args& args, std::vector<std::string>& lines) {
  const int me = boot.rank(), peer = 1 - me;
  constexpr uint32_t kSignals = 8;
  HostSignalPad pad(2, kSignals);
  TransportConfig config;
  config.signals = &pad;
  config.num_signals = kSignals;
  config.timeout_seconds = 60;
  auto t = make_transport(boot, config, args.backend);
  const uint64_t bytes = args.total_mib << 20;
  std::vector<char> src(bytes, static_cast<char>(me + 1)), dst(bytes, 0);
  t->register_buffer(0, src.data(), src.size());
  t->register_buffer(1, dst.data(), dst.size());
  Proxy proxy(*t);
  auto healthy = [&] {
    t->check();
    proxy.check();
  };
  auto wait = [&](uint32_t signal, uint64_t value) {
    if (!pad.wait(peer, signal, value, 60, healthy)) {
      throw mk::Error(mk::ErrorCode::kTimeout, "bench_transport: no signal from the peer");
    }
  };
  boot.barrier();

  // ---- latency: 8-byte put + signal, ping-pong ----
  std::vector<double> rtt;
  for (int i = 1; i <= args.iters; ++i) {
    if (me == 0) {
      const auto start = Clock::now();
      proxy.push(0, make_put_signal(peer, i, 0, 0, 1, 0, 8, 1, i));
      wait(1, i);
      rtt.push_back(seconds_since(start));
    } else {
      wait(1, i);
      proxy.push(0, make_put_signal(peer, i, 0, 0, 1, 0, 8, 1, i));
    }
  }
  if (me == 0) {
    std::sort(rtt.begin(), rtt.end());
    char line[200];
    std::snprintf(line, sizeof(line),
                  "%s latency: 8 B put+signal one way %.1f us (median of %d round trips; p90 %.1f)",
                  t->name(), rtt[rtt.size() / 2] * 1e6 / 2, args.iters,
                  rtt[rtt.size() * 9 / 10] * 1e6 / 2);
    lines.push_back(line);
  }
  boot.barrier();

  // ---- bandwidth: one direction, chunks of several sizes ----
  uint64_t round = 0;
  for (uint64_t chunk : {uint64_t{64} << 10, uint64_t{1} << 20, uint64_t{4} << 20}) {
    ++round;
    boot.barrier();
    if (me == 0) {
      const auto start = Clock::now();
      const uint64_t n = bytes / chunk;
      for (uint64_t c = 0; c < n; ++c) {
        const uint64_t off = c * chunk;
        if (c + 1 < n) {
          proxy.push(0, make_put(peer, c, 0, off, 1, off, chunk, 2));
        } else {
          proxy.push(0, make_put_signal(peer, c, 0, off, 1, off, chunk, 2, round));
        }
      }
      wait(3, round);  // rank 1 answers once the last byte arrived
      const double s = seconds_since(start);
      char line[200];
      std::snprintf(line, sizeof(line),
                    "%s bandwidth: %llu MiB in puts of %llu KiB: %.3f s, %.2f GB/s", t->name(),
                    static_cast<unsigned long long>(args.total_mib),
                    static_cast<unsigned long long>(chunk >> 10), s, bytes / s * 1e-9);
      lines.push_back(line);
    } else {
      wait(2, round);
      proxy.push(0, make_put_signal(peer, round, 0, 0, 1, 0, 8, 3, round));
    }
  }
  proxy.drain(60);
  boot.barrier();

  // ---- idle: both rank threads sleep; only the progress threads run ----
  const double cpu0 = process_cpu_seconds();
  const auto idle_start = Clock::now();
  std::this_thread::sleep_for(std::chrono::seconds(1));
  boot.barrier();
  if (me == 0) {
    const double share = (process_cpu_seconds() - cpu0) / seconds_since(idle_start);
    char line[200];
    std::snprintf(line, sizeof(line),
                  "%s idle: progress threads of both ranks (one proxy ring each) use %.0f%% of a "
                  "core",
                  t->name(), 100 * share);
    lines.push_back(line);
  }
  boot.barrier();
}

}  // namespace

int main(int argc, char** argv) {
  Args args;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--backend" && i + 1 < argc) {
      args.backend = argv[++i];
    } else if (a == "--total-mib" && i + 1 < argc) {
      args.total_mib = std::strtoull(argv[++i], nullptr, 10);
    } else if (a == "--iters" && i + 1 < argc) {
      args.iters = std::atoi(argv[++i]);
    } else {
      std::fprintf(stderr, "usage: %s [--backend socket] [--total-mib 1024] [--iters 2000]\n",
                   argv[0]);
      return 2;
    }
  }
  if (args.total_mib < 4 || args.iters < 1) {
    std::fprintf(stderr, "bench_transport: --total-mib >= 4 and --iters >= 1\n");
    return 2;
  }
  mk::InProcessGroup group(2);
  std::vector<std::string> lines;
  std::vector<std::thread> ranks;
  int failed = 0;
  for (int r = 0; r < 2; ++r) {
    ranks.emplace_back([&, r] {
      try {
        auto boot = group.bootstrap(r);
        run_rank(*boot, args, lines);
      } catch (const std::exception& e) {
        std::fprintf(stderr, "rank %d: %s\n", r, e.what());
        failed = 1;
      }
    });
  }
  for (auto& t : ranks) t.join();
  std::printf("bench_transport: 2 ranks in one process over loopback, %u hardware threads\n",
              std::thread::hardware_concurrency());
  for (const auto& l : lines) std::printf("%s\n", l.c_str());
  return failed;
}
