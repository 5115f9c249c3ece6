// Bounded host-side exchanges: Bootstrap::allgather_within on every bootstrap, and the
// communicator's step-naming view of it (runtime/step_bootstrap.h). A rank that never arrives is
// an mk::Error(kTimeout) within the limit that names the step, this rank and - where the bootstrap
// can tell - the ranks that did not arrive; afterwards the bootstrap refuses further exchanges
// instead of running out of step.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "cpu_test_util.h"
#include "mkernel/bootstrap.h"
#include "mkernel/error.h"
#include "runtime/step_bootstrap.h"

namespace mk {
namespace {

bool contains(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}

double seconds_since(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
}

TEST(BoundedExchange, InProcessNamesTheRanksThatDidNotArrive) {
  InProcessGroup group(3);
  auto b0 = group.bootstrap(0), b1 = group.bootstrap(1), b2 = group.bootstrap(2);
  const auto start = std::chrono::steady_clock::now();
  try {
    char x = 0, all[3];
    b0->allgather_within(&x, all, 1, 0.3);  // ranks 1 and 2 never come
    ADD_FAILURE() << "completed without ranks 1 and 2";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kTimeout) << e.what();
    EXPECT_TRUE(contains(e.what(),
                         "rank 0: in-process allgather gave up after 0.3 s; ranks [1, 2] "
                         "did not arrive"))
        << e.what();
  }
  EXPECT_LT(seconds_since(start), 2.0);
}

// The communicator's view: every exchange, whoever makes it (here a barrier), is bounded by the
// limit and names the step; a later exchange fails at once, naming the first failure.
TEST(BoundedExchange, StepBootstrapNamesTheStepAndStaysBroken) {
  InProcessGroup group(2);
  auto late = group.bootstrap(1);
  detail::StepBootstrap b(group.bootstrap(0), 0.3);
  const auto start = std::chrono::steady_clock::now();
  try {
    const detail::StepBootstrap::Step step(
        b, "Communicator::alloc (symmetric allocation of 64 bytes)");
    b.barrier();
    ADD_FAILURE() << "completed without rank 1";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kTimeout) << e.what();
    for (const char* part : {"Communicator::alloc (symmetric allocation of 64 bytes): rank 0: ",
                             "gave up after 0.3 s; rank 1 did not arrive",
                             "time limit 0.3 s (the communicator's, MKERNEL_TIMEOUT_S)"}) {
      EXPECT_TRUE(contains(e.what(), part)) << e.what();
    }
  }
  EXPECT_LT(seconds_since(start), 2.0);
  EXPECT_FALSE(b.broken().empty());
  try {
    b.barrier();
    ADD_FAILURE() << "an out-of-step bootstrap exchanged again";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kBootstrap) << e.what();
    EXPECT_TRUE(contains(e.what(), "out of step")) << e.what();
    EXPECT_TRUE(contains(e.what(), "rank 1 did not arrive")) << e.what();
  }
}

// A shorter limit of the caller wins over the communicator's; none at all (0) means the
// communicator's; the step's name is restored when the scope ends.
TEST(BoundedExchange, StepsNestAndLimitsCombine) {
  InProcessGroup group(1);
  detail::StepBootstrap b(group.bootstrap(0), 10);
  EXPECT_DOUBLE_EQ(b.limit(), 10);
  {
    const detail::StepBootstrap::Step outer(b, "outer");
    { const detail::StepBootstrap::Step inner(b, "inner"); }
    char x = 1, y = 0;
    b.allgather_within(&x, &y, 1, 0.5);
    EXPECT_EQ(y, 1);
  }
  // Invalid arguments leave the bootstrap in step.
  {
    const detail::StepBootstrap::Step step(b, "a step");
    EXPECT_THROW(b.allgather(nullptr, nullptr, 4), Error);
  }
  EXPECT_TRUE(b.broken().empty());
  b.barrier();
}

// Outside a step the caller's exchanges are the caller's bootstrap's: not bounded by the
// communicator's limit (tests and users meet through it with waits of their own).
TEST(BoundedExchange, OutsideAStepTheCallersBootstrapIsUnbounded) {
  InProcessGroup group(2);
  detail::StepBootstrap b0(group.bootstrap(0), 0.1);
  auto b1 = group.bootstrap(1);
  std::thread late([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(400));
    b1->barrier();
  });
  b0.barrier();  // waits past the 0.1-s limit for rank 1
  late.join();
  EXPECT_TRUE(b0.broken().empty());
}

// A timed callback gets the limit and may name the missing ranks itself.
TEST(BoundedExchange, TimedCallbackGetsTheLimit) {
  std::vector<double> seen;
  auto b = make_callback_bootstrap(
      0, 2, TimedAllgatherFn([&](const void*, void*, std::size_t, double seconds) {
        seen.push_back(seconds);
        throw bootstrap_timeout(0, "store allgather", seconds, {1});
      }));
  detail::StepBootstrap step_b(std::move(b), 1.25);
  try {
    const detail::StepBootstrap::Step step(step_b, "a step");
    step_b.barrier();
    ADD_FAILURE();
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kTimeout) << e.what();
    EXPECT_TRUE(contains(e.what(),
                         "rank 0: store allgather gave up after 1.25 s; rank 1 did "
                         "not arrive"))
        << e.what();
  }
  EXPECT_EQ(seen, std::vector<double>{1.25});
}

// A plain callback that blocks is bounded on a helper thread: the caller gets its time-out in
// time (the ranks are not known to it), and the thread left behind finishes on its own later.
TEST(BoundedExchange, PlainCallbackIsBoundedOnAHelperThread) {
  std::atomic<bool> release{false}, finished{false};
  auto b = make_callback_bootstrap(0, 2, AllgatherFn([&](const void*, void* recv, std::size_t n) {
                                     while (!release) {
                                       std::this_thread::sleep_for(std::chrono::milliseconds(5));
                                     }
                                     std::memset(recv, 0, 2 * n);
                                     finished = true;
                                   }));
  const auto start = std::chrono::steady_clock::now();
  try {
    char x = 0, all[2];
    b->allgather_within(&x, all, 1, 0.2);
    ADD_FAILURE();
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kTimeout) << e.what();
    EXPECT_TRUE(contains(e.what(), "which ranks did not arrive is not known")) << e.what();
  }
  EXPECT_LT(seconds_since(start), 2.0);
  release = true;
  for (int i = 0; i < 200 && !finished; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_TRUE(finished);
  // Unbounded, the plain callback runs on the calling thread as before.
  const std::thread::id caller = std::this_thread::get_id();
  std::thread::id ran_on;
  auto c = make_callback_bootstrap(0, 1, AllgatherFn([&](const void* s, void* r, std::size_t n) {
                                     ran_on = std::this_thread::get_id();
                                     std::memcpy(r, s, n);
                                   }));
  c->barrier();
  EXPECT_EQ(ran_on, caller);
}

}  // namespace
}  // namespace mk
