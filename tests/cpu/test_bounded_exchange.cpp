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

// A plain callback runs on the calling thread, bounded or not (MPI may be called from one thread
// only; the rank's CUDA device is set there): mkernel runs no user code on threads of its own.
TEST(BoundedExchange, PlainCallbackRunsOnTheCallingThread) {
  const std::thread::id caller = std::this_thread::get_id();
  std::vector<std::thread::id> ran_on;
  auto b = make_callback_bootstrap(0, 1, AllgatherFn([&](const void* s, void* r, std::size_t n) {
                                     ran_on.push_back(std::this_thread::get_id());
                                     std::memcpy(r, s, n);
                                   }));
  detail::StepBootstrap step_b(std::move(b), 0.2);
  char x = 7, y = 0;
  step_b.allgather_within(&x, &y, 1, 0.2);  // the caller's, bounded
  {
    const detail::StepBootstrap::Step step(step_b, "a step");
    step_b.barrier();  // a step's, under the communicator's limit
  }
  step_b.barrier();  // unbounded
  EXPECT_EQ(y, 7);
  EXPECT_EQ(ran_on, std::vector<std::thread::id>(3, caller));
}

// A failed exchange of the caller's own (outside a step) leaves the ranks out of step as much as
// a step's: later exchanges, the communicator's steps included, fail at once instead of pairing
// with the wrong exchange of a peer.
TEST(BoundedExchange, CallersFailedExchangeBreaksTheBootstrap) {
  InProcessGroup group(2);
  auto late = group.bootstrap(1);
  detail::StepBootstrap b(group.bootstrap(0), 5);
  try {
    char x = 0, all[2];
    b.allgather_within(&x, all, 1, 0.2);
    ADD_FAILURE() << "completed without rank 1";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kTimeout) << e.what();
    // The caller's limit ran out, not the communicator's: the message does not claim it.
    EXPECT_FALSE(contains(e.what(), "MKERNEL_TIMEOUT_S")) << e.what();
  }
  EXPECT_FALSE(b.broken().empty());
  const auto start = std::chrono::steady_clock::now();
  try {
    const detail::StepBootstrap::Step step(b,
                                           "Communicator::alloc (symmetric allocation of 8 bytes)");
    b.barrier();
    ADD_FAILURE() << "an out-of-step bootstrap exchanged again";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kBootstrap) << e.what();
    EXPECT_TRUE(contains(e.what(), "Communicator::alloc (symmetric allocation of 8 bytes): "))
        << e.what();
    EXPECT_TRUE(contains(e.what(), "out of step")) << e.what();
  }
  EXPECT_LT(seconds_since(start), 0.5);
}

// The communicator's limit is named only where it is what ran out on this rank: not when a peer's
// failure reaches this rank first, nor when there is no limit.
TEST(BoundedExchange, TheLimitIsNamedOnlyWhereItRanOut) {
  InProcessGroup group(3);
  auto absent = group.bootstrap(2);
  detail::StepBootstrap quick(group.bootstrap(0), 0.2), patient(group.bootstrap(1), 30);
  std::string quick_error, patient_error;
  std::thread t([&] {
    try {
      const detail::StepBootstrap::Step step(patient, "a step");
      patient.barrier();
    } catch (const Error& e) {
      patient_error = e.what();
    }
  });
  try {
    const detail::StepBootstrap::Step step(quick, "a step");
    quick.barrier();
  } catch (const Error& e) {
    quick_error = e.what();
  }
  t.join();
  EXPECT_TRUE(contains(quick_error, "time limit 0.2 s (the communicator's, MKERNEL_TIMEOUT_S)"))
      << quick_error;
  EXPECT_TRUE(contains(patient_error, "a step: rank 1: ")) << patient_error;
  EXPECT_TRUE(contains(patient_error, "did not arrive")) << patient_error;
  EXPECT_FALSE(contains(patient_error, "time limit 30 s")) << patient_error;

  auto b = make_callback_bootstrap(
      0, 2, TimedAllgatherFn([&](const void*, void*, std::size_t, double seconds) {
        throw bootstrap_timeout(0, "store allgather", seconds, {1});
      }));
  detail::StepBootstrap unlimited(std::move(b), 0);  // MKERNEL_TIMEOUT_S=0
  try {
    const detail::StepBootstrap::Step step(unlimited, "a step");
    unlimited.barrier();
  } catch (const Error& e) {
    EXPECT_FALSE(contains(e.what(), "time limit")) << e.what();
  }
}

}  // namespace
}  // namespace mk
