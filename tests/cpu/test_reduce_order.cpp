// The work order of the reducing fused GEMMs (src/fused/reduce_order.h): every (owner, index)
// exactly once, the partials of an own tile produced at least `lag` positions before it on every
// peer (so waits point strictly backwards: no cycle), and the tail after the last remote tile.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <utility>
#include <vector>

#include "fused/reduce_order.h"

namespace {

using mk::fused::ReduceOrder;

// Position of (step, index) in the order (the same on every rank: steps are rank-relative).
std::vector<std::vector<int>> positions(const ReduceOrder& o) {
  std::vector<std::vector<int>> pos(o.world, std::vector<int>(o.per_owner, -1));
  for (int t = 0; t < o.world * o.per_owner; ++t) {
    int step = -1, index = -1;
    o.at(t, step, index);
    EXPECT_GE(step, 0);
    EXPECT_LT(step, o.world);
    EXPECT_GE(index, 0);
    EXPECT_LT(index, o.per_owner);
    if (step < 0 || step >= o.world || index < 0 || index >= o.per_owner) continue;
    EXPECT_EQ(pos[step][index], -1)
        << "position " << t << " repeats (" << step << ", " << index << ")";
    pos[step][index] = t;
  }
  return pos;
}

void expect_order(const ReduceOrder& o) {
  SCOPED_TRACE("world " + std::to_string(o.world) + ", P " + std::to_string(o.per_owner) +
               ", lag " + std::to_string(o.lag));
  const auto pos = positions(o);
  int last_remote = -1;
  for (int step = 0; step < o.world; ++step) {
    for (int j = 0; j < o.per_owner; ++j) {
      ASSERT_GE(pos[step][j], 0) << "(" << step << ", " << j << ") never comes";
      if (step > 0) last_remote = std::max(last_remote, pos[step][j]);
    }
  }
  EXPECT_EQ(o.last_remote(), last_remote);
  if (o.lag < 0) {  // blocked: every remote tile before every own tile
    EXPECT_EQ(last_remote, o.remote_count() - 1);
    return;
  }
  // Own index j on rank r waits for index j from each peer q, which is q's step (r - q) mod w:
  // made at least max(1, lag / (w - 1)) positions earlier (lag + 1 in the interleaved part).
  const int groups = o.groups();
  for (int j = 0; j < o.per_owner; ++j) {
    for (int step = 1; step < o.world; ++step) {
      const int lead = pos[0][j] - pos[step][j];
      EXPECT_GE(lead, std::max(1, o.lag / (o.world - 1)))
          << "own tile " << j << " waits for a partial made only " << lead << " positions earlier";
      if (j < groups) EXPECT_GE(lead, o.lag + 1) << "own tile " << j;
    }
  }
  // After the last remote tile: at least lag / (w - 1) own tiles (gemm_rs's staging).
  EXPECT_GE(o.world * o.per_owner - 1 - last_remote, o.lag / (o.world - 1));
}

TEST(ReduceOrder, BlockedAndInterleavedCoverEverythingOnce) {
  for (int world : {2, 3, 4, 8}) {
    for (int per_owner : {1, 2, 7, 64, 1000}) {
      expect_order({world, per_owner, -1});
      for (int lag_units : {0, 1, 2, 5, per_owner}) {  // lag in groups of w - 1 tiles
        if (lag_units > per_owner) continue;
        expect_order({world, per_owner, lag_units * (world - 1)});
      }
    }
  }
}

// The plans' lag, two waves of remote positions per peer (2 (w - 1) CTAs): every CTA (positions
// t = b, b + grid, ...) has at least two own positions after the last remote one - gemm_rs's
// outbox staging footprints.
TEST(ReduceOrder, PlansLagLeavesEveryCtaTwoTailTiles) {
  for (int world : {2, 3, 4, 8}) {
    for (int grid : {1, 4, 66, 132}) {
      for (int per_owner : {2 * grid, 2 * grid + 5, 7 * grid + 3}) {
        const ReduceOrder o{world, per_owner, 2 * (world - 1) * grid};
        const int total = world * per_owner;
        for (int b = 0; b < grid; ++b) {
          int tail = 0;
          for (int t = b; t < total; t += grid) tail += t > o.last_remote() ? 1 : 0;
          EXPECT_GE(tail, 2) << "world " << world << ", grid " << grid << ", P " << per_owner
                             << ": CTA " << b;
        }
      }
    }
  }
}

// On a grid coprime to w (the plans' interleave_grid) every CTA makes one own tile in w of the
// interleaved part, so all CTAs' side threads share the sending.
TEST(ReduceOrder, CoprimeGridSpreadsOwnTilesOverTheCtas) {
  for (int world : {2, 3, 4, 8}) {
    for (int budget : {4, 33, 66, 132}) {
      const int grid = ReduceOrder::interleave_grid(budget, world);
      EXPECT_LE(grid, budget);
      EXPECT_GE(grid, budget - 3);
      const int per_owner = 40 * grid;
      const ReduceOrder o{world, per_owner, 2 * (world - 1) * grid};
      const int end = o.lag + o.groups() * world;  // the interleaved part: [lag, end)
      for (int b = 0; b < grid; ++b) {
        int own = 0, all = 0;
        for (int t = o.lag + b; t + world * grid <= end; t += grid, ++all) {
          int step = -1, index = -1;
          o.at(t, step, index);
          own += step == 0 ? 1 : 0;
        }
        EXPECT_LE(std::abs(own * world - all), world - 1)
            << "world " << world << ", grid " << grid << ": CTA " << b << " makes " << own
            << " own tiles of " << all;
      }
    }
  }
}

TEST(ReduceOrder, TwoRanksAlternateAfterTheLag) {
  const ReduceOrder o{2, 6, 2};  // R R | R O R O R O R O | O O
  const std::vector<std::pair<int, int>> want = {{1, 0}, {1, 1}, {1, 2}, {0, 0}, {1, 3}, {0, 1},
                                                 {1, 4}, {0, 2}, {1, 5}, {0, 3}, {0, 4}, {0, 5}};
  for (int t = 0; t < 12; ++t) {
    int step = -1, index = -1;
    o.at(t, step, index);
    EXPECT_EQ(std::make_pair(step, index), want[t]) << "position " << t;
  }
  EXPECT_EQ(o.last_remote(), 8);
}

}  // namespace
