// The inter-node path with the GPU as the producer (issue 8): on each of two ranks, CTAs of a
// kernel push put / put+signal commands into command rings in host-pinned memory; the host proxy
// turns them into socket-transport sends (device buffers staged through host memory); the
// receiving side raises signals in a host signal pad that is pinned and mapped into the GPU, and
// a kernel there polls it and checks every byte that arrived. Both directions at once, several
// rings, many producer CTAs, several rounds (signal values grow; nothing is reset).
#include <thread>

#include "gpu_test_util.h"
#include "mkernel/transport/proxy.h"
#include "mkernel/transport/transport.h"
#include "proxy_kernels.h"

namespace mk::test {
namespace {

using transport::HostSignalPad;
using transport::MemoryKind;
using transport::Proxy;
using transport::ProxyOptions;
using transport::RingAllocator;
using transport::TransportConfig;

RingAllocator pinned_memory() {
  RingAllocator a;
  a.alloc = [](std::size_t bytes) -> void* {
    void* p = nullptr;
    if (cudaHostAlloc(&p, bytes, cudaHostAllocMapped | cudaHostAllocPortable) != cudaSuccess) {
      cudaGetLastError();
      return nullptr;
    }
    return p;
  };
  a.free = [](void* p) { cudaFreeHost(p); };
  return a;
}

void run_rank(Bootstrap& boot, int device) {
  constexpr int kCtas = 24, kRings = 2, kRounds = 3;
  constexpr uint64_t kChunk = 64 << 10, kChunks = 200, kBytes = kChunk * kChunks;  // 12.5 MiB
  const int me = boot.rank(), peer = 1 - me;
  MKT_CUDA(cudaSetDevice(device));
  cudaStream_t copy_stream, push_stream, check_stream;
  MKT_CUDA(cudaStreamCreateWithFlags(&copy_stream, cudaStreamNonBlocking));
  MKT_CUDA(cudaStreamCreateWithFlags(&push_stream, cudaStreamNonBlocking));
  MKT_CUDA(cudaStreamCreateWithFlags(&check_stream, cudaStreamNonBlocking));
  HostSignalPad pad(2, kCtas, pinned_memory());
  // The transport's threads stage device buffers through host memory on their own stream.
  auto copy = [device, copy_stream](void* dst, const void* src, std::size_t n) {
    cudaSetDevice(device);
    cudaMemcpyAsync(dst, src, n, cudaMemcpyDefault, copy_stream);
    cudaStreamSynchronize(copy_stream);
  };
  TransportConfig config;
  config.signals = &pad;
  config.num_signals = kCtas;
  config.timeout_seconds = 30;
  config.copy_to_device = copy;
  config.copy_from_device = copy;
  auto t = transport::make_transport(boot, config, "socket");
  uint8_t *src, *dst;
  int* counters;  // [0] push failures, [1] wait time-outs
  unsigned long long* mismatches;
  MKT_CUDA(cudaMalloc(reinterpret_cast<void**>(&src), kBytes));
  MKT_CUDA(cudaMalloc(reinterpret_cast<void**>(&dst), kBytes));
  MKT_CUDA(cudaMalloc(reinterpret_cast<void**>(&counters), 2 * sizeof(int)));
  MKT_CUDA(cudaMalloc(reinterpret_cast<void**>(&mismatches), sizeof(unsigned long long)));
  preload_proxy_kernels();
  launch_fill_pattern(src, kBytes, me, push_stream);
  MKT_CUDA(cudaStreamSynchronize(push_stream));
  t->register_buffer(0, src, kBytes, MemoryKind::kDevice);
  t->register_buffer(1, dst, kBytes, MemoryKind::kDevice);
  ProxyOptions options;
  options.num_rings = kRings;
  options.ring_capacity = 64;  // smaller than the commands of a round: producers wait for space
  options.allocator = pinned_memory();
  Proxy proxy(*t, options);
  ProxyRings rings{};
  rings.count = kRings;
  for (int i = 0; i < kRings; ++i) rings.ring[i] = proxy.ring(i);
  for (int round = 1; round <= kRounds; ++round) {
    MKT_CUDA(cudaMemsetAsync(dst, 0, kBytes, check_stream));
    MKT_CUDA(cudaMemsetAsync(counters, 0, 2 * sizeof(int), check_stream));
    MKT_CUDA(cudaMemsetAsync(mismatches, 0, sizeof(unsigned long long), check_stream));
    MKT_CUDA(cudaStreamSynchronize(check_stream));
    boot.barrier();  // the peer's dst is clear before anything is sent into it
    launch_await_and_check(pad.words(), 2, peer, kCtas, round, dst, kBytes, mismatches,
                           counters + 1, check_stream);
    launch_push_puts(rings, kCtas, peer, kChunk, kChunks, round, counters, push_stream);
    MKT_CUDA(cudaStreamSynchronize(push_stream));
    MKT_CUDA(cudaStreamSynchronize(check_stream));
    proxy.check();
    t->check();
    int host_counters[2];
    unsigned long long host_mismatches = 0;
    MKT_CUDA(cudaMemcpy(host_counters, counters, sizeof(host_counters), cudaMemcpyDeviceToHost));
    MKT_CUDA(
        cudaMemcpy(&host_mismatches, mismatches, sizeof(host_mismatches), cudaMemcpyDeviceToHost));
    EXPECT_EQ(host_counters[0], 0) << "rank " << me << " round " << round << ": failed pushes";
    EXPECT_EQ(host_counters[1], 0)
        << "rank " << me << " round " << round << ": no arrival signal within 10 s";
    EXPECT_EQ(host_mismatches, 0u) << "rank " << me << " round " << round << ": bytes wrong";
    boot.barrier();  // both ranks checked before the next round clears dst
  }
  proxy.drain(30);
  const auto stats = proxy.stats();
  EXPECT_EQ(stats.puts, kRounds * kChunks);
  EXPECT_EQ(stats.rejected, 0u);
  boot.barrier();
  proxy.stop();
  for (void* p : {static_cast<void*>(src), static_cast<void*>(dst), static_cast<void*>(counters),
                  static_cast<void*>(mismatches)}) {
    cudaFree(p);
  }
  for (cudaStream_t s : {copy_stream, push_stream, check_stream}) cudaStreamDestroy(s);
}

TEST(GpuProxy, KernelsPushCommandsAndPollArrivals) {
  MKT_REQUIRE_GPU();
  InProcessGroup group(2);
  std::vector<std::thread> ranks;
  for (int r = 0; r < 2; ++r) {
    ranks.emplace_back([&, r] {
      try {
        auto boot = group.bootstrap(r);
        run_rank(*boot, r % test_devices());
      } catch (const std::exception& e) {
        ADD_FAILURE() << "rank " << r << " threw: " << e.what();
      }
    });
  }
  for (auto& t : ranks) t.join();
}

}  // namespace
}  // namespace mk::test
