// The bootstraps: InProcessGroup (threads), make_callback_bootstrap, and the rank side of the
// mkrun protocol against a fake launcher on a socketpair. mkrun itself: test_mkrun.cpp.
#include <gtest/gtest.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "cpu_test_util.h"
#include "mkernel/bootstrap.h"
#include "mkernel/error.h"
#include "runtime/launcher_protocol.h"
#include "runtime/socket_util.h"

namespace mk {
namespace {

using test::Outcome;
using test::run_group;
using test::ScopedEnv;

bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

// Byte i of rank r's contribution in round `round`: encodes all three, salted per run.
uint8_t pattern(uint32_t salt, int rank, int round, std::size_t i) {
  return static_cast<uint8_t>(salt + rank * 131 + round * 17 + i * 7 + (i >> 8));
}

// Allgathers `bytes` rank-encoded bytes and checks every received byte.
void allgather_and_check(Bootstrap& b, uint32_t salt, int round, std::size_t bytes) {
  std::vector<uint8_t> send(bytes);
  for (std::size_t i = 0; i < bytes; ++i) send[i] = pattern(salt, b.rank(), round, i);
  std::vector<uint8_t> recv(bytes * b.size() + 1, 0xee);  // one poisoned byte past the end
  b.allgather(send.data(), recv.data(), bytes);
  for (int r = 0; r < b.size(); ++r) {
    for (std::size_t i = 0; i < bytes; ++i) {
      ASSERT_EQ(recv[r * bytes + i], pattern(salt, r, round, i))
          << "rank " << b.rank() << " round " << round << ": byte " << i << " from rank " << r;
    }
  }
  ASSERT_EQ(recv.back(), 0xee) << "allgather wrote past size * bytes";
}

void expect_all_ok(const std::vector<Outcome>& outcomes) {
  for (std::size_t r = 0; r < outcomes.size(); ++r) {
    EXPECT_FALSE(outcomes[r].threw) << "rank " << r << ": " << outcomes[r].message;
  }
}

// ---- InProcessGroup ---------------------------------------------------------------------------

TEST(InProcessGroup, AllgatherAcrossEightThreads) {
  const uint32_t salt = std::random_device{}();
  SCOPED_TRACE("salt " + std::to_string(salt));
  expect_all_ok(run_group(8, [&](Bootstrap& b) {
    EXPECT_EQ(b.size(), 8);
    allgather_and_check(b, salt, 0, 4099);
  }));
}

TEST(InProcessGroup, RepeatedAllgathersOfVaryingSizes) {
  const uint32_t salt = std::random_device{}();
  SCOPED_TRACE("salt " + std::to_string(salt));
  const std::vector<std::size_t> sizes = {1, 0, 8, 3, 65536, 7, 0, 1000, 24, 1};
  expect_all_ok(run_group(8, [&](Bootstrap& b) {
    for (int round = 0; round < 40; ++round) {
      allgather_and_check(b, salt, round, sizes[round % sizes.size()]);
    }
  }));
}

TEST(InProcessGroup, AllgatherInPlace) {
  // Each rank's send buffer is its own slot of the receive buffer.
  expect_all_ok(run_group(4, [&](Bootstrap& b) {
    std::vector<int32_t> all(4, -1);
    all[b.rank()] = 100 + b.rank();
    b.allgather(&all[b.rank()], all.data(), sizeof(int32_t));
    EXPECT_EQ(all, (std::vector<int32_t>{100, 101, 102, 103}));
  }));
}

TEST(InProcessGroup, BarrierHoldsEveryRank) {
  std::atomic<int> arrived{0};
  expect_all_ok(run_group(6, [&](Bootstrap& b) {
    for (int round = 1; round <= 20; ++round) {
      ++arrived;
      b.barrier();
      EXPECT_GE(arrived.load(), 6 * round)
          << "rank " << b.rank() << " passed barrier " << round << " before everyone arrived";
      b.barrier();  // nobody starts the next round before all have checked this one
    }
  }));
}

TEST(InProcessGroup, MismatchedSizesFailEveryRankAndGroupRecovers) {
  const std::vector<Outcome> outcomes = run_group(4, [&](Bootstrap& b) {
    std::vector<char> send(16, 1), recv(64);
    const std::size_t bytes = b.rank() == 2 ? 16 : 8;
    try {
      b.allgather(send.data(), recv.data(), bytes);
      ADD_FAILURE() << "rank " << b.rank() << ": mismatched allgather did not throw";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kBootstrap);
      EXPECT_TRUE(contains(e.what(), "rank 0 passed 8 bytes but rank 2 passed 16")) << e.what();
    }
    allgather_and_check(b, 7, 1, 8);  // a failed count check leaves the group usable
  });
  expect_all_ok(outcomes);
}

TEST(InProcessGroup, TimeoutFailsFastAndNamesMissingRanks) {
  ScopedEnv timeout("MKERNEL_BOOTSTRAP_TIMEOUT_S", "0.2");
  InProcessGroup group(4);
  std::vector<std::unique_ptr<Bootstrap>> b;
  for (int r = 0; r < 4; ++r) b.push_back(group.bootstrap(r));
  const auto start = std::chrono::steady_clock::now();
  // Ranks 0 and 2 join; ranks 1 and 3 never do.
  const std::vector<Outcome> outcomes = test::run_threads(2, [&](int i) { b[2 * i]->barrier(); });
  EXPECT_LT(seconds_since(start), 5.0);
  bool named = false;
  for (const Outcome& o : outcomes) {
    EXPECT_TRUE(o.threw);
    EXPECT_EQ(o.code, ErrorCode::kTimeout) << o.message;
    named |= contains(o.message,
                      "in-process allgather gave up after 0.2 s; ranks [1, 3] did not arrive");
  }
  EXPECT_TRUE(named) << outcomes[0].message << " / " << outcomes[1].message;
  // A late rank finds the group broken at once instead of waiting for the others.
  try {
    b[1]->barrier();
    ADD_FAILURE() << "a broken group completed an allgather";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kBootstrap);
    EXPECT_TRUE(contains(e.what(), "rank 1: ")) << e.what();
    EXPECT_TRUE(contains(e.what(), "gave up")) << e.what();
  }
}

// A limit too long for the steady clock's nanoseconds (1e10 s, 1e300 s) is no limit, not an
// overflow that gives up at once: a rank arriving late still completes the allgather.
TEST(InProcessGroup, VeryLongTimeoutStillWaits) {
  for (const char* limit : {"1e10", "1e300"}) {
    ScopedEnv timeout("MKERNEL_BOOTSTRAP_TIMEOUT_S", limit);
    InProcessGroup group(2);
    std::vector<std::unique_ptr<Bootstrap>> b;
    for (int r = 0; r < 2; ++r) b.push_back(group.bootstrap(r));
    const std::vector<Outcome> outcomes = test::run_threads(2, [&](int r) {
      if (r == 1) std::this_thread::sleep_for(std::chrono::milliseconds(200));
      allgather_and_check(*b[r], 3, 0, 8);
    });
    for (std::size_t r = 0; r < outcomes.size(); ++r) {
      EXPECT_FALSE(outcomes[r].threw) << limit << ": rank " << r << ": " << outcomes[r].message;
    }
  }
}

TEST(InProcessGroup, DestroyedBootstrapFailsWaitingRanksFast) {
  InProcessGroup group(3);  // default time limit: only the early failure can end this quickly
  std::vector<std::unique_ptr<Bootstrap>> b;
  for (int r = 0; r < 3; ++r) b.push_back(group.bootstrap(r));
  const auto start = std::chrono::steady_clock::now();
  const std::vector<Outcome> outcomes = test::run_threads(3, [&](int r) {
    if (r == 1) {
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
      b[1].reset();  // e.g. rank 1's thread died with an exception
      return;
    }
    b[r]->barrier();
  });
  EXPECT_LT(seconds_since(start), 5.0);
  for (int r : {0, 2}) {
    EXPECT_TRUE(outcomes[r].threw) << "rank " << r;
    EXPECT_EQ(outcomes[r].code, ErrorCode::kBootstrap);
    EXPECT_TRUE(contains(outcomes[r].message, "rank 1 left the group")) << outcomes[r].message;
  }
}

TEST(InProcessGroup, EachRankHandedOutOnce) {
  InProcessGroup group(2);
  EXPECT_EQ(group.size(), 2);
  auto b0 = group.bootstrap(0);
  EXPECT_EQ(b0->rank(), 0);
  EXPECT_EQ(b0->size(), 2);
  try {
    group.bootstrap(0);
    ADD_FAILURE() << "rank 0 handed out twice";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
    EXPECT_TRUE(contains(e.what(), "rank 0 was already handed out")) << e.what();
  }
  for (int bad : {-1, 2}) {
    try {
      group.bootstrap(bad);
      ADD_FAILURE() << "rank " << bad << " accepted";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
      EXPECT_TRUE(contains(e.what(), "rank " + std::to_string(bad) + " is out of range"))
          << e.what();
    }
  }
}

TEST(InProcessGroup, RejectsBadSizeAndTimeout) {
  EXPECT_THROW(InProcessGroup(0), Error);
  ScopedEnv timeout("MKERNEL_BOOTSTRAP_TIMEOUT_S", "soon");
  try {
    InProcessGroup group(2);
    ADD_FAILURE() << "bad MKERNEL_BOOTSTRAP_TIMEOUT_S accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
    EXPECT_TRUE(contains(e.what(), "MKERNEL_BOOTSTRAP_TIMEOUT_S='soon'")) << e.what();
    EXPECT_TRUE(contains(e.what(), "positive number of seconds")) << e.what();
  }
}

TEST(InProcessGroup, RejectsNullBuffers) {
  InProcessGroup group(1);
  auto b = group.bootstrap(0);
  char byte = 0;
  EXPECT_THROW(b->allgather(nullptr, &byte, 1), Error);
  EXPECT_THROW(b->allgather(&byte, nullptr, 1), Error);
  b->allgather(nullptr, nullptr, 0);  // nothing to move: fine
}

// ---- make_callback_bootstrap ------------------------------------------------------------------

TEST(CallbackBootstrap, ForwardsToTheCallback) {
  std::vector<std::size_t> calls;
  auto b = make_callback_bootstrap(2, 4, [&](const void* send, void* recv, std::size_t bytes) {
    calls.push_back(bytes);
    for (int r = 0; r < 4; ++r) std::memcpy(static_cast<char*>(recv) + r * bytes, send, bytes);
  });
  EXPECT_EQ(b->rank(), 2);
  EXPECT_EQ(b->size(), 4);
  const int32_t mine = 42;
  std::vector<int32_t> all(4);
  b->allgather(&mine, all.data(), sizeof(mine));
  EXPECT_EQ(all, (std::vector<int32_t>{42, 42, 42, 42}));
  b->barrier();
  EXPECT_EQ(calls, (std::vector<std::size_t>{4, 1}));
}

TEST(CallbackBootstrap, ValidatesArguments) {
  auto noop = [](const void*, void*, std::size_t) {};
  for (auto [rank, size] : std::vector<std::pair<int, int>>{{-1, 2}, {2, 2}, {0, 0}}) {
    try {
      make_callback_bootstrap(rank, size, noop);
      ADD_FAILURE() << "rank " << rank << " size " << size << " accepted";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
      EXPECT_TRUE(
          contains(e.what(), "rank " + std::to_string(rank) + " and size " + std::to_string(size)))
          << e.what();
    }
  }
  try {
    make_callback_bootstrap(0, 1, AllgatherFn{});
    ADD_FAILURE() << "empty function accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
    EXPECT_TRUE(contains(e.what(), "empty")) << e.what();
  }
}

TEST(CallbackBootstrap, CallbackFailuresBecomeBootstrapErrors) {
  auto b = make_callback_bootstrap(1, 2, [](const void*, void*, std::size_t bytes) {
    if (bytes == 1) throw std::runtime_error("MPI_Allgather returned 13");
    throw Error(ErrorCode::kTimeout, "peer slow");
  });
  try {
    b->barrier();
    ADD_FAILURE();
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kBootstrap);
    EXPECT_TRUE(
        contains(e.what(), "rank 1: the user-supplied allgather failed: MPI_Allgather returned 13"))
        << e.what();
  }
  char send[2] = {}, recv[4] = {};
  try {
    b->allgather(send, recv, 2);
    ADD_FAILURE();
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kTimeout) << "an mk::Error from the callback passes unchanged";
  }
}

// ---- the rank side of the mkrun protocol ------------------------------------------------------

namespace launcher = detail::launcher;

// Plays mkrun for one rank of a 2-rank job: the rank under test is rank 1 and holds one end of a
// socketpair; the test holds the other end (`parent`).
class FakeLauncher : public ::testing::Test {
 protected:
  void SetUp() override {
    int pair[2];
    ASSERT_EQ(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, pair), 0);
    parent_.reset(pair[0]);
    child_.reset(pair[1]);
    const std::string fd = std::to_string(child_.get());
    env_.push_back(std::make_unique<ScopedEnv>(launcher::kRankEnv, "1"));
    env_.push_back(std::make_unique<ScopedEnv>(launcher::kWorldSizeEnv, "2"));
    env_.push_back(std::make_unique<ScopedEnv>(launcher::kFdEnv, fd.c_str()));
  }

  // Reads one allgather request; returns its payload.
  std::string read_request() {
    launcher::Header h;
    const auto deadline = detail::Deadline::after(5);
    EXPECT_EQ(detail::recv_all(parent_.get(), &h, sizeof(h), deadline, "test"),
              detail::IoStatus::kDone);
    EXPECT_EQ(h.magic, launcher::kMagic);
    EXPECT_EQ(h.kind, launcher::MessageKind::kAllgather);
    std::string payload(h.bytes, '\0');
    EXPECT_EQ(detail::recv_all(parent_.get(), payload.data(), payload.size(), deadline, "test"),
              detail::IoStatus::kDone);
    return payload;
  }

  void reply(launcher::MessageKind kind, const std::string& payload) {
    const launcher::Header h{launcher::kMagic, kind, payload.size()};
    const auto deadline = detail::Deadline::after(5);
    ASSERT_EQ(detail::send_all(parent_.get(), &h, sizeof(h), deadline, "test"),
              detail::IoStatus::kDone);
    ASSERT_EQ(detail::send_all(parent_.get(), payload.data(), payload.size(), deadline, "test"),
              detail::IoStatus::kDone);
  }

  detail::UniqueFd parent_, child_;
  std::vector<std::unique_ptr<ScopedEnv>> env_;
};

TEST_F(FakeLauncher, AllgatherRoundTrip) {
  ASSERT_TRUE(launched_by_mkrun());
  auto b = bootstrap_from_launcher();
  EXPECT_EQ(b->rank(), 1);
  EXPECT_EQ(b->size(), 2);
  std::thread parent([&] {
    EXPECT_EQ(read_request(), "BBBB");
    reply(launcher::MessageKind::kResult, "AAAABBBB");
  });
  char recv[9] = {};
  b->allgather("BBBB", recv, 4);
  parent.join();
  EXPECT_STREQ(recv, "AAAABBBB");
}

TEST_F(FakeLauncher, RefusalThrowsAndKeepsConnectionUsable) {
  auto b = bootstrap_from_launcher();
  std::thread parent([&] {
    read_request();
    reply(launcher::MessageKind::kError, "allgather #0: rank 0 passed 8 bytes but rank 1 passed 4");
    read_request();
    reply(launcher::MessageKind::kResult, "xy");
  });
  char recv[2] = {};
  try {
    b->allgather("abcd", recv, 4);
    ADD_FAILURE() << "refusal did not throw";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kBootstrap);
    EXPECT_TRUE(contains(e.what(), "rank 1: allgather failed: allgather #0: rank 0 passed 8 bytes"))
        << e.what();
  }
  b->allgather("y", recv, 1);
  parent.join();
  EXPECT_EQ(std::string(recv, 2), "xy");
}

TEST_F(FakeLauncher, LauncherGoneIsAnError) {
  auto b = bootstrap_from_launcher();
  parent_.reset();
  try {
    b->barrier();
    ADD_FAILURE() << "allgather succeeded without a launcher";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kBootstrap);
    EXPECT_TRUE(contains(e.what(), "mkrun launcher closed the connection")) << e.what();
  }
}

TEST_F(FakeLauncher, TimeoutBreaksTheConnection) {
  ScopedEnv timeout("MKERNEL_BOOTSTRAP_TIMEOUT_S", "0.2");
  auto b = bootstrap_from_launcher();
  const auto start = std::chrono::steady_clock::now();
  try {
    b->barrier();  // the fake launcher never answers
    ADD_FAILURE();
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kTimeout);
    EXPECT_TRUE(contains(e.what(), "rank 1: allgather through mkrun gave up after 0.2 s"))
        << e.what();
  }
  EXPECT_LT(seconds_since(start), 5.0);
  // mkrun learns at once: after the request, the connection is shut down.
  EXPECT_EQ(read_request().size(), 1u);
  char more = 0;
  EXPECT_EQ(detail::recv_all(parent_.get(), &more, 1, detail::Deadline::after(5), "test"),
            detail::IoStatus::kClosed);
  // The stream is out of step for good: later calls refuse at once.
  try {
    b->barrier();
    ADD_FAILURE();
  } catch (const Error& e) {
    EXPECT_TRUE(contains(e.what(), "unusable after an earlier failure")) << e.what();
  }
}

TEST_F(FakeLauncher, OneBootstrapPerConnectionAtATime) {
  auto first = bootstrap_from_launcher();
  EXPECT_THROW(bootstrap_from_launcher(), Error);
  first.reset();
  auto second = bootstrap_from_launcher();  // available again once the first is gone
  EXPECT_EQ(second->rank(), 1);
}

TEST(LauncherBootstrap, NotLaunchedByMkrun) {
  ScopedEnv fd(launcher::kFdEnv, nullptr);
  EXPECT_FALSE(launched_by_mkrun());
  try {
    bootstrap_from_launcher();
    ADD_FAILURE();
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kBootstrap);
    EXPECT_TRUE(contains(e.what(), "MKERNEL_LAUNCHER_FD is not set")) << e.what();
    EXPECT_TRUE(contains(e.what(), "mkrun -n")) << e.what();
  }
}

TEST(LauncherBootstrap, BadEnvironmentIsNamed) {
  int p[2];
  ASSERT_EQ(pipe(p), 0);
  detail::UniqueFd read_end(p[0]), write_end(p[1]);
  const std::string pipe_fd = std::to_string(p[0]);
  struct Case {
    const char* rank;
    const char* world;
    const char* fd;
    std::string expected;
  };
  const Case cases[] = {
      {"0", "2", "abc", "MKERNEL_LAUNCHER_FD='abc' is not valid"},
      {"2", "2", "5", "MKERNEL_RANK='2' is not valid; expected an integer in [0, 1]"},
      {"0", "0", "5", "MKERNEL_WORLD_SIZE='0' is not valid"},
      {"0", "2", pipe_fd.c_str(), "MKERNEL_LAUNCHER_FD=" + pipe_fd + " is not an open socket"},
  };
  for (const Case& c : cases) {
    ScopedEnv rank(launcher::kRankEnv, c.rank), world(launcher::kWorldSizeEnv, c.world),
        fd(launcher::kFdEnv, c.fd);
    try {
      bootstrap_from_launcher();
      ADD_FAILURE() << "accepted " << c.expected;
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kBootstrap);
      EXPECT_TRUE(contains(e.what(), c.expected)) << e.what();
    }
  }
}

}  // namespace
}  // namespace mk
