// tools/mkrun end to end: it starts tests/cpu/helpers/mkrun_test_helper as N ranks and must
// serve their allgathers, prefix their output, and name every rank that fails, without hanging.
#include <gtest/gtest.h>
#include <signal.h>

#include <sstream>
#include <string>
#include <vector>

#include "cpu_test_util.h"

#ifndef MKRUN_TEST_HELPER_PATH
#error "tests/CMakeLists.txt defines MKRUN_TEST_HELPER_PATH (the mkrun_test_helper binary)"
#endif

namespace mk {
namespace {

using test::ProcessResult;

// Limit on a "fast" failure: far below any time limit in play (the default bootstrap limit is
// 300 s), far above what the work takes.
constexpr double kFastSeconds = 10;

bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

// mkrun <mkrun_args> -- mkrun_test_helper <helper_args>
ProcessResult mkrun(const std::vector<std::string>& mkrun_args,
                    const std::vector<std::string>& helper_args,
                    const std::vector<std::pair<std::string, std::string>>& env = {}) {
  std::vector<std::string> argv = {MKRUN_PATH};
  argv.insert(argv.end(), mkrun_args.begin(), mkrun_args.end());
  argv.push_back("--");
  argv.push_back(MKRUN_TEST_HELPER_PATH);
  argv.insert(argv.end(), helper_args.begin(), helper_args.end());
  return test::run_process(argv, env);
}

#define EXPECT_OUTPUT_HAS(result, part)                                              \
  EXPECT_TRUE(contains((result).output, part)) << "missing '" << (part) << "' in:\n" \
                                               << (result).output

TEST(MkrunTest, HelpExplainsUsage) {
  const ProcessResult r = test::run_process({MKRUN_PATH, "--help"});
  EXPECT_EQ(r.exit_code, 0);
  for (const char* part : {"usage: mkrun -n <ranks>", "--timeout", "--grace", "MKERNEL_RANK",
                           "MKERNEL_WORLD_SIZE", "MKERNEL_LOCAL_RANK", "MKERNEL_LAUNCHER_FD",
                           "[rank r] ", "MKERNEL_BOOTSTRAP_TIMEOUT_S", "Exit status"}) {
    EXPECT_OUTPUT_HAS(r, part);
  }
}

TEST(MkrunTest, RejectsBadUsage) {
  const std::vector<std::pair<std::vector<std::string>, std::string>> cases = {
      {{}, "-n <ranks> is required"},
      {{"-n", "2"}, "no program given"},
      {{"-n", "0", "true"}, "-n '0' is not valid"},
      {{"-n", "x", "true"}, "-n 'x' is not valid"},
      {{"-n", "2", "--timeout", "-1", "true"}, "--timeout '-1' is not valid"},
      {{"-n", "2", "--frobnicate", "true"}, "unknown option '--frobnicate'"},
      {{"-n"}, "-n needs a value"},
  };
  for (const auto& [args, message] : cases) {
    std::vector<std::string> argv = {MKRUN_PATH};
    argv.insert(argv.end(), args.begin(), args.end());
    const ProcessResult r = test::run_process(argv);
    EXPECT_EQ(r.exit_code, 2) << r.output;
    EXPECT_OUTPUT_HAS(r, message);
    EXPECT_OUTPUT_HAS(r, "mkrun --help");
  }
}

TEST(MkrunTest, AllgathersOfOneThreeAndEightRanks) {
  for (int n : {1, 3, 8}) {
    SCOPED_TRACE("world size " + std::to_string(n));
    const ProcessResult r = mkrun({"-n", std::to_string(n)}, {"allgather", "12"});
    EXPECT_EQ(r.exit_code, 0) << r.output;
    for (int rank = 0; rank < n; ++rank) {
      EXPECT_OUTPUT_HAS(r, "[rank " + std::to_string(rank) + "] rank " + std::to_string(rank) +
                               ": 13 allgathers ok\n");
    }
    EXPECT_FALSE(contains(r.output, "mkrun:")) << r.output;
  }
}

TEST(MkrunTest, SetsRankEnvironmentAndPassesOnlyStdioAndSocket) {
  // A stale value inherited by mkrun itself must not reach the ranks.
  const ProcessResult r = mkrun({"-n", "3"}, {"env"}, {{"MKERNEL_RANK", "99"}});
  EXPECT_EQ(r.exit_code, 0) << r.output;
  for (int rank = 0; rank < 3; ++rank) {
    EXPECT_OUTPUT_HAS(r, "[rank " + std::to_string(rank) + "] rank " + std::to_string(rank) +
                             " of 3: environment ok\n");
  }
}

TEST(MkrunTest, PrefixesEveryOutputLineWithItsRank) {
  const ProcessResult r = mkrun({"-n", "2"}, {"output"});
  EXPECT_EQ(r.exit_code, 0) << r.output;
  for (int rank = 0; rank < 2; ++rank) {
    const std::string p = "[rank " + std::to_string(rank) + "] ";
    EXPECT_OUTPUT_HAS(r, p + "line one\n" + p + "line two\n");
    EXPECT_OUTPUT_HAS(r, p + "error line of rank " + std::to_string(rank) + "\n");
    EXPECT_OUTPUT_HAS(r, p + "no newline at the end\n");
  }
  std::istringstream lines(r.output);
  for (std::string line; std::getline(lines, line);) {
    EXPECT_EQ(line.rfind("[rank ", 0), 0u) << "unprefixed line '" << line << "'";
  }
}

TEST(MkrunTest, NamesFailingRankAndExitCode) {
  const ProcessResult r = mkrun({"-n", "4"}, {"exit-code", "2", "7"});
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_OUTPUT_HAS(r, "mkrun: 1 of 4 ranks failed: rank 2 (exit code 7)");
}

TEST(MkrunTest, NamesRankKilledBySignal) {
  const ProcessResult r = mkrun({"-n", "3"}, {"signal", "1"});
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_OUTPUT_HAS(r, "rank 1 (killed by SIGUSR1)");
}

TEST(MkrunTest, RankLeavingEarlyFailsTheOthersFast) {
  // The bootstrap time limit stays at its default: only mkrun's own detection can be this fast.
  const ProcessResult r = mkrun({"-n", "4"}, {"leave-early", "2"});
  EXPECT_LT(r.seconds, kFastSeconds) << r.output;
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_OUTPUT_HAS(r, "allgather #1 cannot complete: rank 2 has closed the mkrun connection");
  EXPECT_FALSE(contains(r.output, "allgather #2")) << r.output;
  EXPECT_OUTPUT_HAS(r,
                    "3 of 4 ranks failed: rank 0 (exit code 3), rank 1 (exit code 3), "
                    "rank 3 (exit code 3)");
}

TEST(MkrunTest, MismatchedAllgatherSizesFailEveryRank) {
  const ProcessResult r = mkrun({"-n", "3"}, {"mismatch", "1"});
  EXPECT_LT(r.seconds, kFastSeconds) << r.output;
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_OUTPUT_HAS(r, "rank 0 passed 8 bytes but rank 1 passed 16");
  EXPECT_OUTPUT_HAS(r, "3 of 3 ranks failed");
}

TEST(MkrunTest, HangingRankIsTerminatedAfterGrace) {
  // Ranks 0 and 2 time out waiting for rank 1 (whichever gives up first makes mkrun fail the other
  // at once); then rank 1 is terminated.
  const ProcessResult r =
      mkrun({"-n", "3", "--grace", "0.2"}, {"hang", "1"}, {{"MKERNEL_BOOTSTRAP_TIMEOUT_S", "0.3"}});
  EXPECT_LT(r.seconds, kFastSeconds) << r.output;
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_OUTPUT_HAS(r, "allgather through mkrun gave up after 0.3 s");
  EXPECT_OUTPUT_HAS(r, "left allgather #0 while waiting in it; not joined: rank 1");
  EXPECT_OUTPUT_HAS(r, "(--grace); sending SIGTERM to ranks [1]");
  EXPECT_OUTPUT_HAS(r, "rank 1 (killed by SIGTERM from mkrun)");
}

TEST(MkrunTest, TimeoutStopsEveryRank) {
  const ProcessResult r = mkrun({"-n", "3", "--timeout", "0.3"}, {"sleep"});
  EXPECT_LT(r.seconds, kFastSeconds) << r.output;
  EXPECT_EQ(r.exit_code, 124) << r.output;
  EXPECT_OUTPUT_HAS(r, "time limit of 0.3 s (--timeout) reached; sending SIGTERM to ranks [0-2]");
  EXPECT_OUTPUT_HAS(r, "3 of 3 ranks failed");
}

TEST(MkrunTest, PassesSigtermOnToTheRanks) {
  std::vector<std::string> argv = {MKRUN_PATH, "-n", "2", "--", MKRUN_TEST_HELPER_PATH, "sleep"};
  const ProcessResult r = test::run_process(argv, {}, 30, "[rank 1] ready", SIGTERM);
  EXPECT_LT(r.seconds, kFastSeconds) << r.output;
  EXPECT_EQ(r.exit_code, 128 + SIGTERM) << r.output;
  EXPECT_OUTPUT_HAS(r, "received SIGTERM; passing it on to the ranks");
  EXPECT_OUTPUT_HAS(r, "rank 0 (killed by SIGTERM from mkrun)");
}

TEST(MkrunTest, ReportsProgramThatCannotRun) {
  const ProcessResult r = test::run_process({MKRUN_PATH, "-n", "2", "/nonexistent/program"});
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_OUTPUT_HAS(r, "[rank 0] mkrun: cannot execute '/nonexistent/program': No such file");
  EXPECT_OUTPUT_HAS(r, "rank 1 (exit code 127)");
}

TEST(MkrunTest, FdExchangeAcrossRanks) {
  const ProcessResult r = mkrun({"-n", "4"}, {"fd-exchange"});
  EXPECT_EQ(r.exit_code, 0) << r.output;
  for (int rank = 0; rank < 4; ++rank) {
    EXPECT_OUTPUT_HAS(r, "[rank " + std::to_string(rank) + "] rank " + std::to_string(rank) +
                             ": fd exchange ok\n");
  }
}

}  // namespace
}  // namespace mk
