// The multi-producer command ring: wrap-around, many producers, full ring, per-producer order,
// tickets beyond 2^32, producers giving up, corrupted slots.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <thread>
#include <vector>

#include "mkernel/error.h"
#include "mkernel/transport/ring.h"
#include "test_transport_util.h"

namespace mk::transport {
namespace {

// A command that names its producer and its index there (tile id = producer << 32 | index).
Command numbered(uint32_t producer, uint32_t index) {
  return make_put(producer + 1, (static_cast<uint64_t>(producer) << 32) | index, 0, index, 1,
                  uint64_t{index} * 3, 1 + index % 7);
}

struct Consumed {
  uint64_t count = 0;
  std::vector<uint32_t> next;  // [producer] next index expected
  std::string error;
};

// Consumes `total` commands, checking that each producer's commands come in order and intact.
// How long producers and the consumer wait for each other before calling it a hang. Generous:
// with eight spinning producers on a busy 2-core machine, a run that takes 35 ms when idle was
// seen to take over 20 s (the scheduler starves the consumer); only a real hang takes minutes.
constexpr std::chrono::duration<double> kPatience{180.0};

// Sleeps `pause_us` every `pause_every` commands (a slow consumer).
Consumed consume(const CommandRing& ring, uint64_t total, uint32_t producers, int pause_every = 0,
                 int pause_us = 0) {
  Consumed out;
  out.next.assign(producers, 0);
  std::vector<Command> batch(17);
  const auto start = std::chrono::steady_clock::now();
  uint64_t expected_ticket = ring.consumed();
  while (out.count < total && out.error.empty()) {
    RingFault fault;
    const uint32_t n = ring.poll(batch.data(), static_cast<uint32_t>(batch.size()), &fault);
    if (ring.broken_reason() != RingBroken::kNo) {
      out.error = "ring broke at ticket " + std::to_string(fault.ticket);
      break;
    }
    for (uint32_t k = 0; k < n; ++k) {
      const Command& c = batch[k];
      const uint32_t producer = static_cast<uint32_t>(c.tile_id >> 32);
      const uint32_t index = static_cast<uint32_t>(c.tile_id);
      if (c.seq != expected_ticket + 1) out.error = "seq " + std::to_string(c.seq);
      ++expected_ticket;
      if (producer >= producers || index != out.next[producer]) {
        out.error = "producer " + std::to_string(producer) + " index " + std::to_string(index);
        break;
      }
      const Command want = numbered(producer, index);
      if (std::memcmp(&c, &want, offsetof(Command, seq)) != 0) out.error = "corrupt body";
      ++out.next[producer];
      ++out.count;
      if (pause_every > 0 && out.count % pause_every == 0) {
        std::this_thread::sleep_for(std::chrono::microseconds(pause_us));
      }
    }
    ring.complete(expected_ticket);
    if (std::chrono::steady_clock::now() - start > kPatience) {
      out.error = "consumer timed out after " + std::to_string(out.count) + " commands";
    }
    if (n == 0) std::this_thread::yield();
  }
  return out;
}

void produce(const CommandRing& ring, uint32_t producer, uint32_t count,
             std::atomic<int>* failures) {
  for (uint32_t i = 0; i < count; ++i) {
    if (ring.push(numbered(producer, i), HostWait(kPatience.count())).status != PushStatus::kOk) {
      failures->fetch_add(1);
      return;
    }
  }
}

void run(uint64_t capacity, uint32_t producers, uint32_t per_producer, uint64_t first_ticket = 0,
         int pause_every = 0, int pause_us = 0) {
  RingStorage storage(capacity, first_ticket);
  const CommandRing& ring = storage.ring();
  std::atomic<int> failures{0};
  std::vector<std::thread> threads;
  for (uint32_t p = 0; p < producers; ++p) {
    threads.emplace_back(produce, std::cref(ring), p, per_producer, &failures);
  }
  const uint64_t total = uint64_t{producers} * per_producer;
  const Consumed got = consume(ring, total, producers, pause_every, pause_us);
  for (std::thread& t : threads) t.join();
  EXPECT_EQ(failures.load(), 0);
  EXPECT_EQ(got.error, "");
  EXPECT_EQ(got.count, total);
  for (uint32_t p = 0; p < producers; ++p) EXPECT_EQ(got.next[p], per_producer) << p;
  EXPECT_EQ(ring.issued(), first_ticket + total);
  EXPECT_EQ(ring.consumed(), first_ticket + total);
  EXPECT_EQ(ring.completed(), first_ticket + total);
  EXPECT_EQ(ring.broken_reason(), RingBroken::kNo);
}

TEST(TransportRing, OneProducerWrapsManyTimes) { run(4, 1, 100000); }  // 25,000 laps

TEST(TransportRing, SixteenProducersManyCommands) { run(64, 16, 4000); }

TEST(TransportRing, EightProducersTinyRing) { run(2, 8, 2000); }

TEST(TransportRing, FullRingSlowConsumer) { run(8, 8, 400, 0, 64, 500); }

TEST(TransportRing, TicketsBeyond32Bits) {
  run(16, 4, 3000, (uint64_t{1} << 32) - 1000);  // crosses 2^32 mid-run
  run(8, 4, 1000, (uint64_t{1} << 62) + 12345);  // far beyond
}

TEST(TransportRing, ProducerThatGivesUpBreaksTheRing) {
  RingStorage storage(2);
  const CommandRing& ring = storage.ring();
  EXPECT_EQ(ring.push(numbered(0, 0), HostWait(1)).status, PushStatus::kOk);
  EXPECT_EQ(ring.push(numbered(0, 1), HostWait(1)).status, PushStatus::kOk);
  const mk::test::Stopwatch clock;
  const PushResult full = ring.push(numbered(0, 2), HostWait(0.05));  // nobody consumes
  EXPECT_EQ(full.status, PushStatus::kTimedOut);
  EXPECT_EQ(full.ticket, 2u);
  EXPECT_LT(clock.seconds(), 5.0);
  EXPECT_EQ(ring.broken_reason(), RingBroken::kProducerGaveUp);
  EXPECT_EQ(ring.push(numbered(0, 3), HostWait(1)).status, PushStatus::kBroken);
}

TEST(TransportRing, CorruptSlotIsReportedNotConsumed) {
  RingStorage storage(4);
  const CommandRing& ring = storage.ring();
  ASSERT_EQ(ring.push(numbered(0, 0), HostWait(1)).status, PushStatus::kOk);
  ring.slots[1].seq = 12345;  // a stray write, not a producer
  Command out[4];
  RingFault fault;
  EXPECT_EQ(ring.poll(out, 4, &fault), 1u);  // ticket 0 is fine
  EXPECT_EQ(ring.poll(out, 4, &fault), 0u);
  EXPECT_EQ(fault.ticket, 1u);
  EXPECT_EQ(fault.seq, 12345u);
  EXPECT_EQ(ring.broken_reason(), RingBroken::kCorrupt);
}

TEST(TransportRing, UnpublishedSlotStopsThePoll) {
  RingStorage storage(8);
  const CommandRing& ring = storage.ring();
  // A producer took ticket 0 but has not published; ticket 1 is published behind it.
  const uint64_t t0 = detail::sys_ref(*ring.head).fetch_add(1);
  EXPECT_EQ(t0, 0u);
  ASSERT_EQ(ring.push(numbered(0, 1), HostWait(1)).status, PushStatus::kOk);
  Command out[8];
  RingFault fault;
  EXPECT_EQ(ring.poll(out, 8, &fault), 0u);  // in ticket order: waits for ticket 0
  EXPECT_EQ(ring.broken_reason(), RingBroken::kNo);
}

TEST(TransportRing, CapacityMustBeAPowerOfTwo) {
  for (uint64_t bad : {0ull, 1ull, 3ull, 1000ull, (1ull << 25)}) {
    EXPECT_THROW(RingStorage storage(bad), Error) << bad;
  }
  try {
    RingStorage storage(6);
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
    EXPECT_TRUE(mk::test::contains(e.what(), "capacity 6 is not valid")) << e.what();
  }
}

TEST(TransportRing, CustomAllocatorIsUsed) {
  int allocs = 0, frees = 0;
  {
    RingAllocator a;
    a.alloc = [&](std::size_t n) {
      ++allocs;
      return std::aligned_alloc(64, n);
    };
    a.free = [&](void* p) {
      ++frees;
      std::free(p);
    };
    RingStorage storage(16, 0, a);
    EXPECT_EQ(reinterpret_cast<uintptr_t>(storage.ring().slots) % 64, 0u);
  }
  EXPECT_EQ(allocs, 1);
  EXPECT_EQ(frees, 1);
}

}  // namespace
}  // namespace mk::transport
