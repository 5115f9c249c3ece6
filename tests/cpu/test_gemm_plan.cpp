// The GEMM engine's tile-width choice (host logic, no GPU): explicit widths are kept, bad ones
// rejected with the op's name, the environment override applies, and the heuristic picks the
// widths the H200 sweep found best (docs/PERFORMANCE.md, GEMM engine v2).
#include <gtest/gtest.h>

#include <cstdlib>
#include <string>

#include "gemm/gemm_internal.h"
#include "mkernel/error.h"

namespace mk {
namespace {

constexpr int kSms = 132;  // H200

int pick(int requested, int64_t m, int64_t n) {
  return gemm_engine::pick_block_n(requested, m, n, kSms, "test_op");
}

TEST(GemmPlan, ExplicitWidthIsKept) {
  for (int w : {64, 128, 192, 256}) EXPECT_EQ(pick(w, 4096, 4096), w);
}

TEST(GemmPlan, BadWidthNamesOpAndValue) {
  try {
    pick(96, 4096, 4096);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
    EXPECT_NE(std::string(e.what()).find("test_op: block_n = 96"), std::string::npos) << e.what();
  }
}

TEST(GemmPlan, RequestedWidthWins) {
  EXPECT_EQ(pick(128, 8192, 8192), 128);
  EXPECT_EQ(pick(256, 128, 8192), 256);
}

TEST(GemmPlan, HeuristicMatchesTheSweep) {
  EXPECT_EQ(pick(0, 128, 8192), 64);    // 128 CTAs instead of 32 or 64
  EXPECT_EQ(pick(0, 3000, 5120), 192);  // 5 full waves instead of 4 partial ones
  EXPECT_EQ(pick(0, 4096, 4096), 256);
  EXPECT_EQ(pick(0, 8192, 8192), 256);
  EXPECT_EQ(pick(0, 1024, 8192), 256);
  EXPECT_EQ(pick(0, 1, 8), 64);  // one tile whatever the width: the cheapest
}

}  // namespace
}  // namespace mk
