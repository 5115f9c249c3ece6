// Host-side collective steps under the communicator's time limit: creation, symmetric allocation
// and the inter-node setup give up within the limit when a rank never arrives - an
// mk::Error(kTimeout) naming the step, this rank and the ranks that did not arrive - or at once
// when a rank dies in the step (mkrun sees its connection close); the communicator then refuses
// new work, and the survivors' destructors return.
#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "../cpu/cpu_test_util.h"
#include "gpu_test_util.h"

namespace mk::test {
namespace {

constexpr double kLimit = 1.5;  // seconds: every test below ends well inside twice this

double seconds_since(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
}

CommOptions limited(int ranks_per_node = -1) {
  CommOptions options;
  options.timeout_seconds = kLimit;
  options.ranks_per_node = ranks_per_node;
  return options;
}

// Rank 0 runs `survivor` (which must fail within the limit); rank 1 runs `late` and then stays
// away a little longer than the limit. Both ranks' threads are joined.
void two_ranks(const std::function<void(std::unique_ptr<Bootstrap>)>& survivor,
               const std::function<void(std::unique_ptr<Bootstrap>)>& late) {
  InProcessGroup group(2);
  std::thread away([&] {
    cudaSetDevice(1 % test_devices());
    late(group.bootstrap(1));
  });
  cudaSetDevice(0);
  survivor(group.bootstrap(0));
  away.join();
}

void expect_timeout(const Error& e, const std::string& step,
                    std::chrono::steady_clock::time_point start) {
  EXPECT_EQ(e.code(), ErrorCode::kTimeout) << e.what();
  for (const std::string& part : {step + ": rank 0: ", std::string("rank 1 did not arrive"),
                                  std::string("time limit 1.5 s")}) {
    EXPECT_NE(std::string(e.what()).find(part), std::string::npos) << e.what();
  }
  const double took = seconds_since(start);
  EXPECT_LT(took, 2 * kLimit) << e.what();
  std::printf("[host step] rank 1 missing from %s: reported after %.3f s\n", step.c_str(), took);
}

void stay_away() { std::this_thread::sleep_for(std::chrono::duration<double>(1.3 * kLimit)); }

TEST(InProcessHostSteps, CreateGivesUpOnAMissingRank) {
  MKT_REQUIRE_GPU();
  const auto start = std::chrono::steady_clock::now();
  two_ranks(
      [&](std::unique_ptr<Bootstrap> b) {
        try {
          Communicator::create(std::move(b), limited());
          ADD_FAILURE() << "created without rank 1";
        } catch (const Error& e) {
          expect_timeout(e, "Communicator::create (exchanging the ranks' GPUs and hosts)", start);
        }
      },
      [](std::unique_ptr<Bootstrap> b) { stay_away(); });
  EXPECT_LT(seconds_since(start), 2 * kLimit);
}

// Both ranks create a communicator (and run `both` on it), then meet; rank 1 stays away a little
// longer than the limit (then runs `late`) while rank 0 runs `survivor`. Both threads are joined.
using CommStep = std::function<void(std::shared_ptr<Communicator>&)>;
void rank_one_away(int ranks_per_node, const CommStep& survivor, const CommStep& both = {},
                   const CommStep& late = {}) {
  InProcessGroup group(2);
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; ++r) {
    threads.emplace_back([&, r] {
      cudaSetDevice(r % test_devices());
      auto comm = Communicator::create(group.bootstrap(r), limited(ranks_per_node));
      if (both) both(comm);
      comm->bootstrap().barrier();
      if (r == 0) {
        survivor(comm);
        return;
      }
      stay_away();
      if (late) late(comm);
    });
  }
  for (auto& t : threads) t.join();
}

TEST(InProcessHostSteps, AllocGivesUpOnAMissingRankAndTheCommunicatorRefusesNewWork) {
  MKT_REQUIRE_GPU();
  rank_one_away(-1, [](std::shared_ptr<Communicator>& comm) {
    const auto start = std::chrono::steady_clock::now();
    try {
      comm->alloc(4096);
      ADD_FAILURE() << "allocated without rank 1";
    } catch (const Error& e) {
      expect_timeout(e, "Communicator::alloc (symmetric allocation of 4096 bytes)", start);
    }
    expect_error([&] { comm->alloc(64); }, ErrorCode::kNotInitialized, "broken");
  });
}

TEST(InProcessHostSteps, InterNodeSetupGivesUpOnAMissingRank) {
  MKT_REQUIRE_GPU();
  rank_one_away(/*ranks_per_node=*/1, [](std::shared_ptr<Communicator>& comm) {
    const auto start = std::chrono::steady_clock::now();
    try {
      comm->inter_node();
      ADD_FAILURE() << "set up the inter-node path without rank 1";
    } catch (const Error& e) {
      expect_timeout(e, "setting up the inter-node path", start);
    }
  });
}

// Freeing a symmetric buffer and destroying a communicator (its inter-node path too: the proxy
// drains, the transport says goodbye) wait for no peer beyond the limit.
TEST(InProcessHostSteps, FreeAndDestructionDoNotWaitForAMissingRank) {
  MKT_REQUIRE_GPU();
  SymmetricBuffer buffers[2];
  rank_one_away(
      /*ranks_per_node=*/1,
      [&](std::shared_ptr<Communicator>& comm) {
        auto start = std::chrono::steady_clock::now();
        buffers[0] = SymmetricBuffer();
        const double freed = seconds_since(start);
        EXPECT_LT(freed, kLimit);
        start = std::chrono::steady_clock::now();
        comm.reset();
        const double destroyed = seconds_since(start);
        EXPECT_LT(destroyed, 2 * kLimit);
        std::printf("[host step] rank 1 away: free took %.3f s, destruction %.3f s\n", freed,
                    destroyed);
      },
      [&](std::shared_ptr<Communicator>& comm) {
        comm->inter_node();
        buffers[comm->rank()] = comm->alloc(1 << 20);
      },
      [&](std::shared_ptr<Communicator>&) { buffers[1] = SymmetricBuffer(); });  // then leaves
}

// ---- a rank that dies in a step, one process per rank ----

constexpr const char kStepEnv[] = "MKERNEL_TEST_HOST_STEP";

// Rank 1 is killed just before the step named by kStepEnv; rank 0 must fail in it naming the
// step and rank 1 well inside the limit (mkrun sees rank 1's connection close).
TEST(HostStepsProcessHelper, Run) {
  MKT_REQUIRE_GPU();
  const char* env = std::getenv(kStepEnv);
  if (env == nullptr || launcher_bootstrap() == nullptr) {
    GTEST_SKIP() << "run by HostSteps.RankKilledIn*";
  }
  const std::string step = env;
  const bool rank1 = launcher_bootstrap()->rank() == 1;
  std::string expected;
  std::function<void(Communicator*)> run;
  if (step == "create") {
    expected = "Communicator::create (exchanging the ranks' GPUs and hosts): rank 0: ";
  } else if (step == "alloc") {
    expected = "Communicator::alloc (symmetric allocation of 4096 bytes): rank 0: ";
    run = [](Communicator* comm) { comm->alloc(4096); };
  } else if (step == "inter_node") {
    expected = "setting up the inter-node path: rank 0: ";
    run = [](Communicator* comm) { comm->inter_node(); };
  } else {
    FAIL() << "unknown step " << step;
  }
  std::shared_ptr<Communicator> comm;
  auto start = std::chrono::steady_clock::now();
  try {
    if (step == "create" && rank1) raise(SIGKILL);
    comm = launched_comm(limited(step == "inter_node" ? 1 : -1));  // 1: two virtual nodes
    comm->bootstrap().barrier();
    if (rank1) raise(SIGKILL);  // dies before the step
    start = std::chrono::steady_clock::now();
    run(comm.get());
    ADD_FAILURE() << step << " went through without rank 1";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(expected), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("rank 1"), std::string::npos) << e.what();
    const double took = seconds_since(start);
    EXPECT_LT(took, kLimit) << e.what();  // mkrun knows at once
    std::printf("[host step] rank 1 killed before %s: reported after %.3f s: %s\n", step.c_str(),
                took, e.what());
  }
  const auto leaving = std::chrono::steady_clock::now();
  comm.reset();  // the survivor's destructor returns
  EXPECT_LT(seconds_since(leaving), 2 * kLimit);
}

void expect_survivor_named(const char* step) {
  char self[4096] = {};
  ASSERT_GT(readlink("/proc/self/exe", self, sizeof(self) - 1), 0);
  const auto start = std::chrono::steady_clock::now();
  const ProcessResult r =
      run_process({MKRUN_PATH, "-n", "2", "--grace", "5", "--", self,
                   "--gtest_filter=HostStepsProcessHelper.Run"},
                  {{kStepEnv, step}, {"MKERNEL_BOOTSTRAP_TIMEOUT_S", "30"}}, 60);
  EXPECT_NE(r.output.find("[rank 0] [       OK ] HostStepsProcessHelper.Run"), std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find("rank 1 (killed by SIGKILL"), std::string::npos) << r.output;
  EXPECT_LT(seconds_since(start), 30) << r.output;  // process start-up included
  const std::size_t line = r.output.find("[host step]");
  if (line != std::string::npos) {
    std::printf("%s\n", r.output.substr(line, r.output.find('\n', line) - line).c_str());
  }
}

TEST(HostSteps, RankKilledInCreateIsNamed) {
  MKT_REQUIRE_GPU();
  expect_survivor_named("create");
}

TEST(HostSteps, RankKilledInAllocIsNamed) {
  MKT_REQUIRE_GPU();
  expect_survivor_named("alloc");
}

TEST(HostSteps, RankKilledInInterNodeSetupIsNamed) {
  MKT_REQUIRE_GPU();
  expect_survivor_named("inter_node");
}

}  // namespace
}  // namespace mk::test
