// The proxy over a fake transport: translation of commands, signal targets from the send
// ledger, malformed commands rejected, transport failures, out-of-order delivery end to end.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <mutex>
#include <random>
#include <thread>
#include <vector>

#include "mkernel/transport/proxy.h"
#include "test_transport_util.h"
#include "transport/completion.h"

namespace mk::transport {
namespace {

using mk::test::contains;

// Rank 0 of a world of 4; buffers 0 and 1 of 1 MiB. Records every op; optionally "delivers" them
// to per-destination trackers in a shuffled order (a network without ordering).
class FakeTransport final : public Transport {
 public:
  explicit FakeTransport(bool shuffle = false) : shuffle_(shuffle) {
    for (uint32_t r = 0; r < 4; ++r) {
      pads_.push_back(std::make_unique<HostSignalPad>(4, 16));
      trackers_.push_back(std::make_unique<detail::CompletionTracker>(4, 16, *pads_.back()));
    }
  }
  const char* name() const override { return "fake"; }
  int rank() const override { return 0; }
  int world_size() const override { return 4; }
  void register_buffer(int, void*, uint64_t, MemoryKind) override {}
  void release_buffer(int) override {}
  bool is_peer(int r) const override { return r > 0 && r < 4 && r != not_a_peer; }
  CommandLimits limits() const override {
    CommandLimits l;
    l.rank = 0;
    l.world_size = 4;
    l.num_signals = 16;
    l.buffer_bytes[0] = l.buffer_bytes[1] = 1 << 20;
    return l;
  }
  void post(std::span<const TransferOp> ops) override {
    while (block_posts.load()) std::this_thread::sleep_for(std::chrono::microseconds(100));
    if (fail_posts) throw Error(ErrorCode::kBootstrap, "fake: rank 2 is gone");
    std::lock_guard<std::mutex> lock(mutex);
    posted.insert(posted.end(), ops.begin(), ops.end());
    ++posts;
    if (!shuffle_) return;
    in_flight.insert(in_flight.end(), ops.begin(), ops.end());
    std::shuffle(in_flight.begin(), in_flight.end(), rng_);
    // Deliver a random part of what is in flight; the rest stays for later.
    const std::size_t n = in_flight.size() / 2 + 1;
    for (std::size_t i = 0; i < n && !in_flight.empty(); ++i) {
      deliver(in_flight.back());
      in_flight.pop_back();
    }
  }
  void flush() {
    std::lock_guard<std::mutex> lock(mutex);
    for (const TransferOp& op : in_flight) deliver(op);
    in_flight.clear();
  }
  void check() const override {}
  bool failed() const override { return false; }

  HostSignalPad& pad(uint32_t dst) { return *pads_[dst]; }
  uint64_t arrived(uint32_t dst, uint32_t signal) { return trackers_[dst]->arrived(0, signal); }

  std::atomic<bool> fail_posts{false};
  std::atomic<bool> block_posts{false};
  int not_a_peer = -1;  // a rank the fake transport does not reach (e.g. one on this node)
  std::mutex mutex;
  std::vector<TransferOp> posted;
  std::vector<TransferOp> in_flight;
  int posts = 0;

 private:
  void deliver(const TransferOp& op) {
    detail::CompletionTracker& t = *trackers_[op.dst_rank];
    if (op.kind == TransferOp::Kind::kSignal) {
      t.add_signal(0, op.signal_id, op.target, op.value);
    } else if (op.signal_id != kNoSignal) {
      t.add_bytes(0, op.signal_id, op.bytes);
    }
  }
  bool shuffle_;
  std::mt19937 rng_{7};
  std::vector<std::unique_ptr<HostSignalPad>> pads_;
  std::vector<std::unique_ptr<detail::CompletionTracker>> trackers_;
};

TEST(TransportProxy, TranslatesCommandsWithLedgerTargets) {
  FakeTransport t;
  Proxy proxy(t);
  proxy.push(0, make_put(1, 10, 0, 0, 1, 0, 100, 3));           // counted on (1, 3): 100
  proxy.push(0, make_put(2, 11, 0, 0, 1, 0, 50, 3));            // (2, 3): 50
  proxy.push(0, make_put(1, 12, 0, 100, 1, 100, 28));           // not counted
  proxy.push(0, make_put_signal(1, 13, 0, 0, 1, 0, 72, 3, 9));  // (1, 3): 172, signal target 172
  proxy.push(0, make_signal(2, 14, 3, 5));                      // (2, 3): target 50
  proxy.push(0, make_signal(3, 15, 4, 6));                      // nothing counted: target 0
  proxy.drain(10);
  proxy.check();
  std::lock_guard<std::mutex> lock(t.mutex);
  ASSERT_EQ(t.posted.size(), 7u);
  EXPECT_EQ(t.posted[3].kind, TransferOp::Kind::kPut);
  EXPECT_EQ(t.posted[3].bytes, 72u);
  EXPECT_EQ(t.posted[4].kind, TransferOp::Kind::kSignal);
  EXPECT_EQ(t.posted[4].target, 172u);
  EXPECT_EQ(t.posted[4].value, 9u);
  EXPECT_EQ(t.posted[4].tile_id, 13u);
  EXPECT_EQ(t.posted[5].target, 50u);
  EXPECT_EQ(t.posted[6].target, 0u);
  const ProxyStats s = proxy.stats();
  EXPECT_EQ(s.commands, 6u);
  EXPECT_EQ(s.puts, 4u);
  EXPECT_EQ(s.signals, 3u);
  EXPECT_EQ(s.bytes, 250u);
  EXPECT_EQ(s.rejected, 0u);
  EXPECT_EQ(proxy.ring(0).completed(), 6u);
}

TEST(TransportProxy, MalformedCommandIsReportedAndNotExecuted) {
  FakeTransport t;
  int errors = 0;
  std::string first_error;
  ProxyOptions options;
  options.on_error = [&](const Error& e) {
    ++errors;
    first_error = e.what();
  };
  Proxy proxy(t, options);
  proxy.push(0, make_put(9, 70000, 0, 0, 1, 0, 8));    // rank 9 of 4
  proxy.push(0, make_put(1, 1, 0, 1 << 20, 1, 0, 8));  // source beyond 1 MiB
  proxy.push(0, make_put(1, 2, 0, 0, 1, 0, 8, 2));     // fine
  EXPECT_THROW(proxy.drain(10), Error);                // waits for all three, then reports
  EXPECT_EQ(proxy.stats().rejected, 2u);
  EXPECT_EQ(proxy.ring(0).completed(), 3u);  // rejected commands complete too (nobody waits)
  {
    std::lock_guard<std::mutex> lock(t.mutex);
    ASSERT_EQ(t.posted.size(), 1u);  // only the valid one went out
    EXPECT_EQ(t.posted[0].tile_id, 2u);
  }
  EXPECT_EQ(errors, 1);
  try {
    proxy.check();
    FAIL() << "check() did not throw";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
    EXPECT_TRUE(contains(e.what(),
                         "proxy ring 0, ticket 0: malformed command rejected, not "
                         "executed: put to rank 9: tile 70000"))
        << e.what();
    EXPECT_TRUE(contains(e.what(), "destination rank 9 is out of range")) << e.what();
  }
  EXPECT_TRUE(contains(first_error, "ticket 0")) << first_error;
}

// A command for a rank the transport does not reach (TransportConfig::peers: e.g. a rank of this
// node) is rejected on its own; the ring goes on.
TEST(TransportProxy, CommandForANonPeerIsRejected) {
  FakeTransport t;
  t.not_a_peer = 2;
  ProxyOptions options;
  options.on_error = [](const Error&) {};
  Proxy proxy(t, options);
  proxy.push(0, make_put(2, 5, 0, 0, 1, 0, 8));     // rank 2: not a peer
  proxy.push(0, make_put(3, 6, 0, 0, 1, 0, 8, 1));  // fine
  EXPECT_THROW(proxy.drain(10), Error);
  EXPECT_EQ(proxy.stats().rejected, 1u);
  {
    std::lock_guard<std::mutex> lock(t.mutex);
    ASSERT_EQ(t.posted.size(), 1u);
    EXPECT_EQ(t.posted[0].dst_rank, 3u);
  }
  try {
    proxy.check();
    FAIL() << "check() did not throw";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
    EXPECT_TRUE(contains(e.what(), "rank 2 is not a peer of the transport")) << e.what();
  }
}

TEST(TransportProxy, TransportFailureStopsProducersQuickly) {
  FakeTransport t;
  t.fail_posts = true;
  ProxyOptions options;
  options.num_rings = 2;
  options.ring_capacity = 4;
  Proxy proxy(t, options);
  proxy.push(1, make_put(2, 1, 0, 0, 1, 0, 8));
  const mk::test::Stopwatch clock;
  bool threw = false;
  try {
    for (int i = 0; i < 100; ++i) proxy.push(0, make_put(2, 1, 0, 0, 1, 0, 8), 30);
  } catch (const Error& e) {
    threw = true;
    EXPECT_TRUE(contains(e.what(), "rank 2 is gone")) << e.what();
  }
  EXPECT_TRUE(threw);
  EXPECT_LT(clock.seconds(), 5.0);
  EXPECT_THROW(proxy.check(), Error);
  EXPECT_THROW(proxy.drain(1), Error);
}

// Waits up to 10 s for check() to throw; returns its message ("" if it never did).
std::string wait_for_error(const Proxy& proxy) {
  for (int i = 0; i < 10000; ++i) {
    try {
      proxy.check();
    } catch (const Error& e) {
      return e.what();
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return "";
}

TEST(TransportProxy, CorruptRingIsReported) {
  FakeTransport t;
  Proxy proxy(t);
  detail::sys_ref(proxy.ring(0).slots[0].seq).store(999);  // a stray write into the ring
  const std::string error = wait_for_error(proxy);
  EXPECT_TRUE(contains(error, "proxy ring 0: the slot of ticket 0 holds sequence word 999"))
      << error;
  EXPECT_EQ(proxy.ring(0).broken_reason(), RingBroken::kCorrupt);
}

TEST(TransportProxy, ProducerThatGivesUpIsReported) {
  FakeTransport t;
  t.block_posts = true;  // the network stalls: the ring fills up
  ProxyOptions options;
  options.ring_capacity = 2;
  options.max_batch = 1;
  Proxy proxy(t, options);
  proxy.push(0, make_put(1, 0, 0, 0, 1, 0, 8));  // taken by the proxy, stuck in post
  while (proxy.ring(0).consumed() < 1) std::this_thread::yield();
  proxy.push(0, make_put(1, 1, 0, 0, 1, 0, 8));
  proxy.push(0, make_put(1, 2, 0, 0, 1, 0, 8));  // the ring is full now
  try {
    proxy.push(0, make_put(1, 3, 0, 0, 1, 0, 8), 0.05);
    ADD_FAILURE() << "pushed into a full ring";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kTimeout);
    EXPECT_TRUE(contains(e.what(), "no free slot within")) << e.what();
  }
  t.block_posts = false;
  const std::string error = wait_for_error(proxy);
  EXPECT_TRUE(contains(error, "a producer gave up waiting for a free slot")) << error;
  EXPECT_EQ(proxy.ring(0).completed(), 3u);  // what was published before the hole was executed
}

TEST(TransportProxy, StoppedProxyRefusesPushes) {
  FakeTransport t;
  Proxy proxy(t);
  proxy.push(0, make_put(1, 1, 0, 0, 1, 0, 8));
  proxy.stop();  // executes what was published first
  EXPECT_EQ(proxy.ring(0).completed(), 1u);
  try {
    proxy.push(0, make_put(1, 1, 0, 0, 1, 0, 8));
    FAIL();
  } catch (const Error& e) {
    EXPECT_TRUE(contains(e.what(), "proxy was stopped")) << e.what();
  }
}

TEST(TransportProxy, BadOptionsAreRefused) {
  FakeTransport t;
  ProxyOptions options;
  options.num_rings = 0;
  EXPECT_THROW(Proxy(t, options), Error);
  options.num_rings = 1;
  options.ring_capacity = 100;
  EXPECT_THROW(Proxy(t, options), Error);
}

// Producers on several rings issue puts counted on a signal and then the signal, per
// destination; the fake network delivers in a shuffled order. Every raised value must find all
// of its bytes already delivered.
TEST(TransportProxy, OutOfOrderDeliveryNeverRaisesEarly) {
  FakeTransport t(/*shuffle=*/true);
  ProxyOptions options;
  options.num_rings = 4;
  options.ring_capacity = 16;
  options.max_batch = 8;
  Proxy proxy(t, options);
  constexpr int kRounds = 200;
  std::vector<std::thread> producers;
  for (int p = 0; p < 4; ++p) {
    producers.emplace_back([&, p] {
      const uint32_t dst = 1 + p % 3;
      const uint32_t signal = static_cast<uint32_t>(p);  // one signal per producer and ring
      for (int round = 1; round <= kRounds; ++round) {
        for (int k = 0; k < 3; ++k) proxy.push(p, make_put(dst, round, 0, 0, 1, 0, 64, signal));
        proxy.push(p, make_signal(dst, round, signal, static_cast<uint64_t>(round)));
      }
    });
  }
  // While they run, every raised round must have its 3 * 64 * round bytes delivered.
  bool early = false;
  std::atomic<bool> done{false};
  std::thread checker([&] {
    while (!done.load()) {
      for (int p = 0; p < 4; ++p) {
        const uint32_t dst = 1 + p % 3;
        const uint64_t round = t.pad(dst).load(0, static_cast<uint32_t>(p));
        if (t.arrived(dst, static_cast<uint32_t>(p)) < round * 3 * 64) early = true;
      }
      std::this_thread::yield();
    }
  });
  for (std::thread& th : producers) th.join();
  proxy.drain(20);
  done = true;
  checker.join();
  t.flush();
  EXPECT_FALSE(early);
  for (int p = 0; p < 4; ++p) {
    EXPECT_EQ(t.pad(1 + p % 3).load(0, static_cast<uint32_t>(p)), static_cast<uint64_t>(kRounds));
  }
  proxy.check();
}

}  // namespace
}  // namespace mk::transport
