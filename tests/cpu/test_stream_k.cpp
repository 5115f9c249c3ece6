// Stream-K's schedule (src/gemm/stream_k.h), host only: every k-block of every tile is run once,
// ranges are balanced, each tile has one owner that runs its piece last, and the pieces an
// owner adds are the first work of the CTAs just below it - so no CTA waits for a higher one.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <random>
#include <vector>

#include "gemm/stream_k.h"

namespace mk {
namespace {

using gemm_engine::StreamKSchedule;

// Checks every property on one schedule; *split: the number of tiles cut in pieces.
void check(const StreamKSchedule& s, int64_t* split_tiles) {
  SCOPED_TRACE(::testing::Message()
               << "tiles " << s.tiles << ", k_iters " << s.k_iters << ", ctas " << s.ctas);
  // Ranges: contiguous, covering everything, lengths within one of each other.
  EXPECT_EQ(s.range_begin(0), 0);
  EXPECT_EQ(s.range_begin(s.ctas), s.total());
  int64_t shortest = s.total(), longest = 0;
  for (int c = 0; c < s.ctas; ++c) {
    const int64_t len = s.range_begin(c + 1) - s.range_begin(c);
    shortest = std::min(shortest, len);
    longest = std::max(longest, len);
  }
  EXPECT_LE(longest - shortest, 1);
  // cta_of agrees with the ranges at every range's edges.
  for (int c = 0; c < s.ctas; ++c) {
    const int64_t lo = s.range_begin(c), hi = s.range_begin(c + 1);
    if (lo == hi) continue;
    EXPECT_EQ(s.cta_of(lo), c);
    EXPECT_EQ(s.cta_of(hi - 1), c);
  }
  // Every k-block once; per tile its owner and the pieces in CTA order.
  std::vector<int> runs(static_cast<std::size_t>(s.total()), 0);
  std::vector<int> owner(static_cast<std::size_t>(s.tiles), -1);
  std::vector<std::vector<int>> pieces(static_cast<std::size_t>(s.tiles));  // non-owner CTAs
  for (int c = 0; c < s.ctas; ++c) {
    const int n = s.segments(c);
    EXPECT_LE(n, s.max_segments());
    int64_t last_tile = -1;
    for (int j = 0; j < n; ++j) {
      const StreamKSchedule::Segment seg = s.segment(c, j);
      EXPECT_GE(seg.tile, 0);
      EXPECT_LT(seg.tile, s.tiles);
      EXPECT_LT(seg.kb_begin, seg.kb_end);
      EXPECT_GE(seg.kb_begin, 0);
      EXPECT_LE(seg.kb_end, s.k_iters);
      if (j > 0) {
        EXPECT_EQ(seg.tile, last_tile - 1) << "a CTA walks its tiles downward";
      }
      last_tile = seg.tile;
      for (int kb = seg.kb_begin; kb < seg.kb_end; ++kb) {
        ++runs[static_cast<std::size_t>(seg.tile * s.k_iters + kb)];
      }
      EXPECT_EQ(seg.owner, seg.kb_end == s.k_iters);
      EXPECT_EQ(seg.first_cta, s.cta_of(seg.tile * s.k_iters));
      EXPECT_LE(seg.first_cta, c);
      if (seg.owner) {
        EXPECT_EQ(owner[static_cast<std::size_t>(seg.tile)], -1) << "one owner a tile";
        owner[static_cast<std::size_t>(seg.tile)] = c;
        // An owner with pieces below it runs this tile last, after all its other work.
        if (seg.first_cta < c) {
          EXPECT_EQ(j, n - 1);
          EXPECT_EQ(seg.kb_begin, s.range_begin(c) - seg.tile * s.k_iters);
        }
      } else {
        // A piece the CTA does not own is its first work, so at most one a CTA.
        EXPECT_EQ(j, 0) << "CTA " << c << " tile " << seg.tile;
        pieces[static_cast<std::size_t>(seg.tile)].push_back(c);
      }
    }
  }
  for (int64_t g = 0; g < s.total(); ++g) {
    ASSERT_EQ(runs[static_cast<std::size_t>(g)], 1) << "iteration " << g;
  }
  int64_t split = 0;
  for (int64_t t = 0; t < s.tiles; ++t) {
    const int o = owner[static_cast<std::size_t>(t)];
    ASSERT_GE(o, 0) << "tile " << t << " has no owner";
    const std::vector<int>& below = pieces[static_cast<std::size_t>(t)];
    // The pieces come from CTAs first_cta .. owner - 1, every one of them, in that order.
    const int first = s.cta_of(t * s.k_iters);
    ASSERT_EQ(static_cast<int>(below.size()), o - first) << "tile " << t;
    for (std::size_t i = 0; i < below.size(); ++i) EXPECT_EQ(below[i], first + static_cast<int>(i));
    if (!below.empty()) ++split;
  }
  *split_tiles = split;
}

int64_t check_schedule(const StreamKSchedule& s) {
  int64_t split = -1;
  check(s, &split);
  return split;
}

TEST(StreamK, ModelShapes) {
  // 640 x 2048 x 7168 (docs/design/gemm_decode.md): 128 x 256 tiles 5 x 8, 112 k-blocks; and
  // 128 x 128 tiles 5 x 16.
  EXPECT_GT(check_schedule({40, 112, 132}), 0);
  EXPECT_GT(check_schedule({80, 112, 132}), 0);
  // More tiles than CTAs, a multiple: nothing split.
  EXPECT_EQ(check_schedule({264, 64, 132}), 0);
  // One tile over every CTA.
  EXPECT_EQ(check_schedule({1, 132, 132}), 1);
}

TEST(StreamK, FewIterations) {
  // As few iterations as CTAs (the plan never runs more CTAs than iterations: every range has
  // at least one k-block, so an owner's pieces come from every CTA between).
  EXPECT_EQ(check_schedule({2, 3, 6}), 2);
  EXPECT_EQ(check_schedule({1, 1, 1}), 0);
  EXPECT_EQ(check_schedule({1, 8, 8}), 1);
  EXPECT_EQ(check_schedule({3, 1, 3}), 0);
}

TEST(StreamK, RandomShapes) {
  std::mt19937 gen(20261204);
  for (int i = 0; i < 2000; ++i) {
    StreamKSchedule s{1 + static_cast<int64_t>(gen() % 300), 1 + static_cast<int>(gen() % 200),
                      1 + static_cast<int>(gen() % 160)};
    s.ctas = static_cast<int>(std::min<int64_t>(s.ctas, s.total()));
    check_schedule(s);
    if (::testing::Test::HasFailure()) break;
  }
}

TEST(StreamK, LargeProblemsDoNotOverflow) {
  // 2^20 tiles of 4096 k-blocks (beyond any real GEMM) on 132 CTAs: the ranges still add up.
  const StreamKSchedule s{int64_t{1} << 20, 4096, 132};
  EXPECT_EQ(s.range_begin(s.ctas), s.total());
  int64_t sum = 0;
  for (int c = 0; c < s.ctas; ++c) {
    for (int j = 0; j < s.segments(c); ++j) {
      const StreamKSchedule::Segment seg = s.segment(c, j);
      sum += seg.kb_end - seg.kb_begin;
    }
  }
  EXPECT_EQ(sum, s.total());
  EXPECT_EQ(s.cta_of(s.total() - 1), s.ctas - 1);
}

}  // namespace
}  // namespace mk
