// The gathered A stage's copies (src/gemm/gather_layout.h, used by gemm_kernel.cuh's
// gather_a_stage) against the layout a TMA box with the 128-byte swizzle leaves: every piece of
// every row of a 64-, 128- or 192-row stage copied exactly once, by one lane of one of the
// gathering warps, to where wgmma's descriptor reads it.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "gemm/gather_layout.h"

namespace mk::gemm_engine {
namespace {

TEST(GatherLayout, EveryPieceOnceWhereTheSwizzlePutsIt) {
  for (int rows : {64, 128, 192}) {
    SCOPED_TRACE("rows " + std::to_string(rows));
    ASSERT_EQ(rows % kGatherRowsPerStep, 0);
    std::vector<int> copies(static_cast<size_t>(rows) * 8, 0);
    for (int warp = 0; warp < kGatherWarps; ++warp) {
      for (int i = 0; i < rows / kGatherRowsPerStep; ++i) {
        for (int lane = 0; lane < 32; ++lane) {
          const int r = gather_row(warp, lane, i), piece = lane % 8;
          ASSERT_GE(r, 0);
          ASSERT_LT(r, rows);
          EXPECT_EQ(gather_offset(warp, lane, i), swizzled_piece(r, piece))
              << "warp " << warp << ", lane " << lane << ", copy " << i;
          ++copies[static_cast<size_t>(r) * 8 + piece];
        }
      }
    }
    for (int r = 0; r < rows; ++r) {
      for (int c = 0; c < 8; ++c) {
        EXPECT_EQ(copies[static_cast<size_t>(r) * 8 + c], 1) << "row " << r << ", piece " << c;
      }
    }
  }
}

// One instruction of a warp covers four whole rows (eight lanes a row, 128 contiguous bytes of
// the source each), and the lanes of a row write eight different 16-byte columns.
TEST(GatherLayout, AnInstructionMovesWholeRows) {
  for (int warp = 0; warp < kGatherWarps; ++warp) {
    for (int i = 0; i < 2; ++i) {
      for (int lane = 0; lane < 32; lane += 8) {
        std::vector<bool> column(8, false);
        for (int l = lane; l < lane + 8; ++l) {
          EXPECT_EQ(gather_row(warp, l, i), gather_row(warp, lane, i));
          column[(gather_offset(warp, l, i) % 128) / 16] = true;
        }
        for (bool c : column) EXPECT_TRUE(c);
      }
    }
  }
}

// The swizzle itself: a row's eight pieces fill its 128 bytes, and the eight rows of a
// 1024-byte atom put a given piece in eight different 16-byte columns (what lets wgmma and TMA
// read a column of pieces without bank conflicts).
TEST(GatherLayout, SwizzlePermutesPiecesWithinRows) {
  for (int r = 0; r < 16; ++r) {
    std::vector<bool> seen(8, false);
    for (int c = 0; c < 8; ++c) {
      const uint32_t at = swizzled_piece(r, c);
      EXPECT_EQ(at / 128, static_cast<uint32_t>(r));
      seen[(at % 128) / 16] = true;
    }
    for (bool s : seen) EXPECT_TRUE(s);
  }
  for (int c = 0; c < 8; ++c) {
    std::vector<bool> column(8, false);
    for (int r = 0; r < 8; ++r) column[(swizzled_piece(r, c) % 128) / 16] = true;
    for (bool s : column) EXPECT_TRUE(s);
  }
}

}  // namespace
}  // namespace mk::gemm_engine
