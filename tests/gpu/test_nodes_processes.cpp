// The fused GEMMs across (virtual) nodes as one process per rank, and a rank killed in the middle
// of a kernel (issue 8). A test here starts this binary through mkrun on one helper test, which
// runs only when the variable the test sets names the op (ag_gemm, gemm_rs, gemm_ar) and skips
// in any other run.
#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <stdexcept>
#include <string>
#include <thread>

#include "../cpu/cpu_test_util.h"
#include "across_nodes_checks.h"
#include "collective_checks.h"
#include "gemm_reference.h"
#include "mkernel/fused.h"

namespace mk::test {
namespace {

constexpr const char kNodesHelperEnv[] = "MKERNEL_TEST_NODES_OP";
constexpr const char kKillEnv[] = "MKERNEL_TEST_KILL_OP";

// The op a helper runs (the value of `env` set by the test that started it through mkrun), or
// empty when not started so.
std::string helper_op(const char* env) {
  const char* op = std::getenv(env);
  return op != nullptr && launcher_bootstrap() != nullptr ? op : "";
}

// The helper's communicator: the process-wide mkrun bootstrap, a 20-s kernel limit.
std::shared_ptr<Communicator> helper_comm() {
  CommOptions options;
  options.timeout_seconds = 20;
  return launched_comm(options);
}

// Runs test `helper` of this binary as `ranks` mkrun processes with `env` = `op` and `per_node`
// ranks per virtual node.
ProcessResult run_helper(const char* helper, const char* env, const std::string& op, int ranks,
                         int per_node, double grace_s, double limit_s) {
  char self[4096] = {};
  if (readlink("/proc/self/exe", self, sizeof(self) - 1) <= 0) return {};
  return run_process({MKRUN_PATH, "-n", std::to_string(ranks), "--grace",
                      std::to_string(static_cast<int>(grace_s)), "--", self,
                      std::string("--gtest_filter=") + helper},
                     {{env, op},
                      {"MKERNEL_GPUS_PER_NODE", std::to_string(per_node)},
                      {"MKERNEL_BOOTSTRAP_TIMEOUT_S", "30"}},
                     limit_s);
}

// ---- every check of an op across nodes, one process per rank ----

TEST(NodesProcessHelper, Run) {
  MKT_REQUIRE_GPU();
  const std::string op = helper_op(kNodesHelperEnv);
  if (op.empty()) GTEST_SKIP() << "run by *AcrossNodes/Processes.Run/*";
  auto comm = helper_comm();
  ASSERT_GT(comm->topology().num_nodes, 1);
  if (op == "ag_gemm") {
    expect_ag_gemm_nodes(*comm);
  } else if (op == "gemm_rs") {
    expect_gemm_rs_nodes(*comm);
  } else if (op == "gemm_ar") {
    expect_gemm_ar_nodes(*comm);
  } else {
    FAIL() << "unknown op " << op;
  }
}

// NodesProcessHelper.Run for an op as `ranks` processes on nodes of `per_node` ranks; the suites
// are named after the op (AgGemmAcrossNodes/Processes.Run/2x1, ...), as its other across-node
// tests are.
struct ProcessesCase {
  const char* op;
  int ranks;
  int per_node;
};
class Processes : public ::testing::TestWithParam<ProcessesCase> {};

TEST_P(Processes, Run) {
  MKT_REQUIRE_GPU();
  const ProcessesCase c = GetParam();
  const ProcessResult r =
      run_helper("NodesProcessHelper.Run", kNodesHelperEnv, c.op, c.ranks, c.per_node, 10, 150);
  EXPECT_EQ(r.exit_code, 0) << r.output;
  for (int rank = 0; rank < c.ranks; ++rank) {
    EXPECT_NE(
        r.output.find("[rank " + std::to_string(rank) + "] [       OK ] NodesProcessHelper.Run"),
        std::string::npos)
        << r.output;
  }
}

std::string processes_name(const ::testing::TestParamInfo<ProcessesCase>& info) {
  return std::to_string(info.param.ranks / info.param.per_node) + "x" +
         std::to_string(info.param.per_node);
}
INSTANTIATE_TEST_SUITE_P(AgGemmAcrossNodes, Processes,
                         ::testing::Values(ProcessesCase{"ag_gemm", 2, 1},
                                           ProcessesCase{"ag_gemm", 4, 2}),
                         processes_name);
INSTANTIATE_TEST_SUITE_P(GemmRsAcrossNodes, Processes,
                         ::testing::Values(ProcessesCase{"gemm_rs", 2, 1},
                                           ProcessesCase{"gemm_rs", 4, 2}),
                         processes_name);
INSTANTIATE_TEST_SUITE_P(GemmArAcrossNodes, Processes,
                         ::testing::Values(ProcessesCase{"gemm_ar", 2, 1},
                                           ProcessesCase{"gemm_ar", 4, 2}),
                         processes_name);

// ---- a rank killed mid-kernel ----

// One call of `op` with random operands (this rank's seed), a workspace zero at first use and a
// stream of its own; launch() enqueues it. The reducing ops get shapes whose kernel runs for a
// fraction of a millisecond, so that a rank killed right after its launch returns has not sent
// every node sum yet.
class FusedCall {
 public:
  FusedCall(Communicator& comm, const std::string& op, uint64_t seed) : comm_(comm), op_(op) {
    const int world = comm.world_size();
    if (op == "ag_gemm") {
      m_ = 1024 * world, n_ = 256, k_ = 1024;
      alloc(&a_, m_ / world * k_);
      ws_ = comm.alloc(ag_gemm_workspace_bytes(m_, k_));
      alloc(&out_, m_ * n_);
    } else if (op == "gemm_rs") {
      m_ = 4096 * world, n_ = 4096, k_ = 8192;
      alloc(&a_, m_ * k_);
      ws_ = comm.alloc(gemm_rs_workspace_bytes(comm, m_, n_));
      alloc(&out_, m_ / world * n_);
    } else if (op == "gemm_ar") {
      m_ = 4096, n_ = 4096, k_ = 8192;
      alloc(&a_, m_ * k_);
      ws_ = comm.alloc(gemm_ar_workspace_bytes(comm, m_, n_, k_));
      out_sym_ = comm.alloc(m_ * n_ * 2);
      out_ = out_sym_.data();
    } else {
      throw std::runtime_error("unknown op " + op);
    }
    alloc(&b_, n_ * k_);
    check(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    fill_random_bf16(a_, op == "ag_gemm" ? m_ / world * k_ : m_ * k_, seed, stream_);
    fill_random_bf16(b_, n_ * k_, seed + 1, stream_);
    check(cudaMemsetAsync(ws_.data(), 0, ws_.size(), stream_));
  }
  ~FusedCall() {
    for (void* p : {a_, b_}) cudaFree(p);
    if (out_ != out_sym_.data()) cudaFree(out_);
    cudaStreamDestroy(stream_);
  }
  FusedCall(const FusedCall&) = delete;
  FusedCall& operator=(const FusedCall&) = delete;

  void launch() {
    if (op_ == "ag_gemm") {
      ag_gemm(comm_, a_, b_, out_, m_, n_, k_, BLayout::kNK, ws_.data(), stream_);
    } else if (op_ == "gemm_rs") {
      gemm_rs(comm_, a_, b_, out_, m_, n_, k_, BLayout::kNK, ws_.data(), stream_);
    } else {
      gemm_ar(comm_, a_, b_, out_, m_, n_, k_, BLayout::kNK, ws_.data(), stream_);
    }
  }
  cudaStream_t stream() const { return stream_; }

 private:
  static void check(cudaError_t e) {  // (a constructor cannot ASSERT: it throws instead)
    if (e != cudaSuccess) throw std::runtime_error(cudaGetErrorString(e));
  }
  void alloc(void** p, int64_t bf16_elements) { check(cudaMalloc(p, bf16_elements * 2)); }

  Communicator& comm_;
  std::string op_;
  int64_t m_ = 0, n_ = 0, k_ = 0;
  void *a_ = nullptr, *b_ = nullptr, *out_ = nullptr;
  SymmetricBuffer ws_, out_sym_;
  cudaStream_t stream_ = nullptr;
};

// Started by *AcrossNodes/KilledRank.IsNamed through mkrun (2 ranks, 2 virtual nodes), skipped
// otherwise. After one good launch (the inter-node path and the workspace's registration exist),
// rank 0 launches again at once; rank 1 launches 300 ms later and SIGKILLs itself as soon as its
// launch returns, its kernel in flight. Rank 0's kernel is waiting for rank 1's data by then: it
// must stop, and synchronize() must name rank 1, long before the 20-s time limit.
TEST(NodesKilledRankHelper, Run) {
  MKT_REQUIRE_GPU();
  const std::string op = helper_op(kKillEnv);
  if (op.empty()) GTEST_SKIP() << "run by *AcrossNodes/KilledRank.IsNamed/*";
  auto comm = helper_comm();
  ASSERT_EQ(comm->world_size(), 2);
  ASSERT_EQ(comm->topology().num_nodes, 2);
  const int rank = comm->rank();
  FusedCall call(*comm, op, 1 + rank);
  ready(*comm, call.stream());
  call.launch();
  finished(*comm, call.stream());
  if (rank == 1) {
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    call.launch();
    std::printf("rank 1: launched, now killing itself\n");
    std::fflush(stdout);
    kill(getpid(), SIGKILL);
  }
  const auto start = std::chrono::steady_clock::now();
  call.launch();
  try {
    comm->synchronize(call.stream());
    ADD_FAILURE() << "rank 0: no error although rank 1 was killed";
  } catch (const Error& e) {
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    std::printf("rank 0: error after %.2f s: %s\n", seconds, e.what());
    EXPECT_NE(std::string(e.what()).find("rank 1"), std::string::npos) << e.what();
    EXPECT_LT(seconds, 10.0) << "the lost peer was noticed late";
  }
}

// A rank killed in the middle of a kernel (issue 8): the survivor reports the lost peer within
// the limit and exits cleanly (code 0, well before mkrun's grace period ends); mkrun names only
// the killed rank. Suites named after the op: AgGemmAcrossNodes/KilledRank.IsNamed/ag_gemm, ...
class KilledRank : public ::testing::TestWithParam<const char*> {};

TEST_P(KilledRank, IsNamed) {
  MKT_REQUIRE_GPU();
  const ProcessResult r =
      run_helper("NodesKilledRankHelper.Run", kKillEnv, GetParam(), 2, 1, 60, 90);
  SCOPED_TRACE(r.output);
  EXPECT_FALSE(r.killed_by_test);
  EXPECT_EQ(r.exit_code, 1);  // mkrun: a rank failed
  EXPECT_NE(r.output.find("rank 1: launched, now killing itself"), std::string::npos);
  EXPECT_NE(r.output.find("[rank 0] [       OK ] NodesKilledRankHelper.Run"), std::string::npos);
  EXPECT_NE(r.output.find("1 of 2 ranks failed: rank 1 (killed by SIGKILL)"), std::string::npos);
  EXPECT_LT(r.seconds, 45.0) << "rank 0 did not exit on its own";
}

std::string op_name(const ::testing::TestParamInfo<const char*>& info) { return info.param; }
INSTANTIATE_TEST_SUITE_P(AgGemmAcrossNodes, KilledRank, ::testing::Values("ag_gemm"), op_name);
INSTANTIATE_TEST_SUITE_P(GemmRsAcrossNodes, KilledRank, ::testing::Values("gemm_rs"), op_name);
INSTANTIATE_TEST_SUITE_P(GemmArAcrossNodes, KilledRank, ::testing::Values("gemm_ar"), op_name);

}  // namespace
}  // namespace mk::test
