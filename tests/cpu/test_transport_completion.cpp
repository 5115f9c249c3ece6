// Completion accounting without ordering: puts, chunks and signals delivered in any order; chunk
// arithmetic at large sizes; RDMA immediates; the host signal pad.
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <mutex>
#include <random>
#include <thread>
#include <vector>

#include "test_transport_util.h"
#include "transport/completion.h"
#include "transport/wire.h"

namespace mk::transport {
namespace {

using detail::CompletionTracker;
using detail::SendLedger;

// Records raises and checks each against what the receiver has really received.
class CheckingSink final : public SignalSink {
 public:
  std::function<void(uint32_t, uint32_t, uint64_t)> on_raise;
  void raise(uint32_t src, uint32_t signal, uint64_t value) override {
    std::lock_guard<std::mutex> lock(mutex);
    raises.push_back({src, signal, value});
    if (on_raise) on_raise(src, signal, value);
  }
  struct Raise {
    uint32_t src, signal;
    uint64_t value;
  };
  std::mutex mutex;
  std::vector<Raise> raises;
};

TEST(TransportCompletion, SignalBeforeItsBytesWaits) {
  CheckingSink sink;
  CompletionTracker t(2, 4, sink);
  t.add_signal(1, 3, 8192, 7);  // arrives first (SRD may deliver it first)
  EXPECT_TRUE(sink.raises.empty());
  EXPECT_EQ(t.pending(), 1u);
  EXPECT_TRUE(mk::test::contains(t.describe_pending(), "rank 1 signal 3 = 0x7 waits for 8192"));
  t.add_bytes(1, 3, 4096);
  EXPECT_TRUE(sink.raises.empty());
  t.add_bytes(1, 2, 4096);  // another signal's bytes do not count
  t.add_bytes(0, 3, 4096);  // nor another source's
  EXPECT_TRUE(sink.raises.empty());
  t.add_bytes(1, 3, 4096);
  ASSERT_EQ(sink.raises.size(), 1u);
  EXPECT_EQ(sink.raises[0].src, 1u);
  EXPECT_EQ(sink.raises[0].signal, 3u);
  EXPECT_EQ(sink.raises[0].value, 7u);
  EXPECT_EQ(t.pending(), 0u);
  EXPECT_EQ(t.arrived(1, 3), 8192u);
}

TEST(TransportCompletion, LaterSignalArrivingFirstWinsAndEarlierNeverLowersIt) {
  CheckingSink sink;
  CompletionTracker t(2, 4, sink);
  t.add_signal(0, 1, 300, 3);  // third signal (covers 300 bytes) arrives first
  t.add_signal(0, 1, 100, 1);
  t.add_bytes(0, 1, 300);      // all bytes: both satisfied at once -> only the latest is raised
  t.add_signal(0, 1, 200, 2);  // the second arrives last: already covered, lower -> not raised
  ASSERT_EQ(sink.raises.size(), 1u);
  EXPECT_EQ(sink.raises[0].value, 3u);
  EXPECT_EQ(t.pending(), 0u);
}

TEST(TransportCompletion, SignalValuesCompareWrapSafe) {
  CheckingSink sink;
  CompletionTracker t(1, 1, sink);
  const uint64_t near_wrap = ~uint64_t{0} - 1;
  t.add_signal(0, 0, 0, near_wrap);
  t.add_signal(0, 0, 0, near_wrap + 3);  // wrapped past zero: still later
  t.add_signal(0, 0, 0, near_wrap - 5);  // earlier: ignored
  ASSERT_EQ(sink.raises.size(), 2u);
  EXPECT_EQ(sink.raises[1].value, near_wrap + 3);
}

// Many sources and signals; puts split into chunks; every wire event shuffled. At each raise the
// receiver must already hold every byte the sender counted before issuing that signal.
TEST(TransportCompletion, AnyDeliveryOrderRaisesOnlyCompleteSignals) {
  constexpr uint32_t kWorld = 4, kSignals = 6;
  for (uint32_t seed = 1; seed <= 20; ++seed) {
    SCOPED_TRACE(seed);
    std::mt19937_64 rng(seed);
    struct Event {
      bool is_signal;
      uint32_t src, signal;
      uint64_t amount;  // bytes, or target
      uint64_t value;
    };
    std::vector<Event> events;
    std::map<std::pair<uint32_t, uint64_t>, uint64_t> target_of;  // (src*S+signal, value)
    std::map<uint32_t, uint64_t> last_value;                      // src*S+signal
    for (uint32_t src = 0; src < kWorld; ++src) {
      SendLedger ledger(1, kSignals);  // src's ledger towards this receiver (rank 0)
      for (int i = 0; i < 200; ++i) {
        const uint32_t signal = static_cast<uint32_t>(rng() % kSignals);
        if (rng() % 3 != 0) {
          const uint64_t bytes = 1 + rng() % 100000;
          ledger.add(0, signal, bytes);
          for (uint64_t k = 0; k < detail::chunk_count(bytes, 4096); ++k) {
            events.push_back({false, src, signal, detail::chunk_at(0, 0, bytes, 4096, k).bytes, 0});
          }
        } else {
          const uint64_t value = ++last_value[src * kSignals + signal];
          target_of[{src * kSignals + signal, value}] = ledger.total(0, signal);
          events.push_back({true, src, signal, ledger.total(0, signal), value});
        }
      }
    }
    std::shuffle(events.begin(), events.end(), rng);

    CheckingSink sink;
    CompletionTracker tracker(kWorld, kSignals, sink);
    std::vector<uint64_t> received(kWorld * kSignals, 0);
    uint64_t violations = 0;
    sink.on_raise = [&](uint32_t src, uint32_t signal, uint64_t value) {
      if (received[src * kSignals + signal] < target_of[{src * kSignals + signal, value}]) {
        ++violations;
      }
    };
    for (const Event& e : events) {
      if (e.is_signal) {
        tracker.add_signal(e.src, e.signal, e.amount, e.value);
      } else {
        received[e.src * kSignals + e.signal] += e.amount;
        tracker.add_bytes(e.src, e.signal, e.amount);
      }
    }
    EXPECT_EQ(violations, 0u);
    EXPECT_EQ(tracker.pending(), 0u);  // everything arrived: every signal was released
    // Each (src, signal) ends at its last value, raised in increasing order.
    std::map<uint32_t, uint64_t> final_value;
    for (const auto& r : sink.raises) {
      const uint32_t key = r.src * kSignals + r.signal;
      EXPECT_GT(r.value, final_value[key]);
      final_value[key] = r.value;
    }
    EXPECT_TRUE(final_value == last_value);
  }
}

TEST(TransportCompletion, ConcurrentDeliveryFromManyThreads) {
  constexpr uint32_t kThreads = 8, kPerThread = 5000;
  CheckingSink sink;
  CompletionTracker t(kThreads, 2, sink);
  for (uint32_t src = 0; src < kThreads; ++src) t.add_signal(src, 1, kPerThread * 3, 42);
  std::vector<std::thread> threads;
  for (uint32_t src = 0; src < kThreads; ++src) {
    threads.emplace_back([&, src] {
      for (uint32_t i = 0; i < kPerThread; ++i) t.add_bytes(src, 1, 3);
    });
  }
  for (std::thread& th : threads) th.join();
  EXPECT_EQ(sink.raises.size(), kThreads);
  EXPECT_EQ(t.pending(), 0u);
}

TEST(TransportCompletion, OutOfRangeIsRefused) {
  CheckingSink sink;
  CompletionTracker t(2, 4, sink);
  EXPECT_THROW(t.add_bytes(2, 0, 1), Error);
  EXPECT_THROW(t.add_signal(0, 4, 0, 1), Error);
  SendLedger ledger(2, 4);
  EXPECT_THROW(ledger.add(5, 0, 1), Error);
}

TEST(TransportCompletion, ChunksAtLargeSizes) {
  constexpr uint64_t kGiB = uint64_t{1} << 30;
  const uint64_t src = 5 * kGiB + 7, dst = 9 * kGiB + 11, bytes = 10 * kGiB + 1;
  const uint64_t n = detail::chunk_count(bytes, kGiB);
  EXPECT_EQ(n, 11u);
  uint64_t sum = 0;
  for (uint64_t k = 0; k < n; ++k) {
    const detail::Chunk c = detail::chunk_at(src, dst, bytes, kGiB, k);
    EXPECT_EQ(c.src_offset, src + k * kGiB);
    EXPECT_EQ(c.dst_offset, dst + k * kGiB);
    EXPECT_EQ(c.bytes, k + 1 < n ? kGiB : 1u);
    sum += c.bytes;
  }
  EXPECT_EQ(sum, bytes);
  EXPECT_EQ(detail::chunk_count(4 << 20, 4 << 20), 1u);
  EXPECT_EQ(detail::chunk_count((4 << 20) + 1, 4 << 20), 2u);
  // 2^40 bytes in 4 MiB chunks: 262144 chunks (> 65536), the last one at offset 2^40 - 4 MiB.
  EXPECT_EQ(detail::chunk_count(uint64_t{1} << 40, 4 << 20), 262144u);
  EXPECT_EQ(detail::chunk_at(0, 0, uint64_t{1} << 40, 4 << 20, 262143).dst_offset,
            (uint64_t{1} << 40) - (4 << 20));
}

TEST(TransportCompletion, ImmediateCarriesRankAndSignal) {
  for (uint32_t rank : {0u, 1u, 65536u, 70001u, detail::kImmMaxRanks - 1}) {
    for (uint32_t signal : {0u, 479u, detail::kImmMaxSignals - 1, kNoSignal}) {
      const detail::ImmFields f = detail::decode_imm(detail::encode_imm(rank, signal));
      EXPECT_EQ(f.src_rank, rank);
      EXPECT_EQ(f.signal, signal);
    }
  }
}

TEST(TransportCompletion, HostSignalPadNeverLowersAWord) {
  HostSignalPad pad(3, 5);
  pad.raise(2, 4, 10);
  pad.raise(2, 4, 7);
  EXPECT_EQ(pad.load(2, 4), 10u);
  EXPECT_EQ(pad.load(1, 4), 0u);
  EXPECT_EQ(pad.words()[4 * 3 + 2], 10u);  // layout [signal][world], like the device pad
  EXPECT_TRUE(pad.wait(2, 4, 10, 0.01));
  const mk::test::Stopwatch clock;
  EXPECT_FALSE(pad.wait(2, 4, 11, 0.05));
  EXPECT_GE(clock.seconds(), 0.05);
  int polls = 0;
  EXPECT_THROW(pad.wait(0, 0, 1, 5,
                        [&] {
                          if (++polls == 3) throw Error(ErrorCode::kBootstrap, "peer gone");
                        }),
               Error);
}

// The words can live in caller-provided memory (pinned and device-mapped on the GPU path): the
// pad takes it zeroed from the allocator and gives it back once.
TEST(TransportCompletion, HostSignalPadUsesTheGivenMemory) {
  std::vector<uint64_t> storage(3 * 5, 0xDEADBEEF);
  int allocs = 0, frees = 0;
  RingAllocator memory;
  memory.alloc = [&](std::size_t bytes) {
    ++allocs;
    EXPECT_GE(bytes, storage.size() * sizeof(uint64_t));
    return static_cast<void*>(storage.data());
  };
  memory.free = [&](void* p) {
    ++frees;
    EXPECT_EQ(p, storage.data());
  };
  {
    HostSignalPad pad(3, 5, memory);
    EXPECT_EQ(pad.words(), storage.data());
    EXPECT_EQ(storage[7], 0u) << "words start at zero";
    pad.raise(1, 2, 42);
    EXPECT_EQ(storage[2 * 3 + 1], 42u);
  }
  EXPECT_EQ(allocs, 1);
  EXPECT_EQ(frees, 1);
}

}  // namespace
}  // namespace mk::transport
