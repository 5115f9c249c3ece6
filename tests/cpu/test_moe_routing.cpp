// The MoE routing contract's CPU reference (moe_reference.h, docs/design/moe.md) against
// hand-worked cases: what lands where, in which order, what travels once, capacity overflow,
// bad indices, and the combine's fp32 sum in slot order.
#include <gtest/gtest.h>

#include <cstdint>
#include <random>
#include <vector>

#include "moe_reference.h"

namespace mk::test {
namespace {

// Two ranks, four experts (two local each), top-2, three tokens per rank:
//   rank 0: t0 -> {0, 3}, t1 -> {1, -1}, t2 -> {2, 3}
//   rank 1: t0 -> {3, 0}, t1 -> {0, 1}, t2 -> {-1, -1}
const std::vector<std::vector<int64_t>> kTwoRanks = {{0, 3, 1, -1, 2, 3}, {3, 0, 0, 1, -1, -1}};

TEST(MoeRouting, RowsInSourceTokenSlotOrderPaddedToTheRowBlock) {
  const MoeRouting r = moe_route_reference(kTwoRanks, 2, 4, MoeRefLayout::kPadded, 512);
  ASSERT_EQ(r.received.size(), 2u);
  const MoeReceived& r0 = r.received[0];
  EXPECT_EQ(r0.expert_rows, (std::vector<int32_t>{3, 2}));
  EXPECT_EQ(r0.expert_start, (std::vector<int64_t>{0, 128}));
  EXPECT_EQ(r0.rows[0], (MoeRow{0, 0, 0}));
  EXPECT_EQ(r0.rows[1], (MoeRow{1, 0, 1}));
  EXPECT_EQ(r0.rows[2], (MoeRow{1, 1, 0}));
  EXPECT_EQ(r0.rows[3], MoeRow{});  // padding up to the next row block
  EXPECT_EQ(r0.rows[128], (MoeRow{0, 1, 0}));
  EXPECT_EQ(r0.rows[129], (MoeRow{1, 1, 1}));
  const MoeReceived& r1 = r.received[1];
  EXPECT_EQ(r1.expert_rows, (std::vector<int32_t>{1, 3}));
  EXPECT_EQ(r1.rows[0], (MoeRow{0, 2, 0}));
  EXPECT_EQ(r1.rows[128], (MoeRow{0, 0, 1}));
  EXPECT_EQ(r1.rows[129], (MoeRow{0, 2, 1}));
  EXPECT_EQ(r1.rows[130], (MoeRow{1, 0, 0}));
  EXPECT_TRUE(r0.overflowed.empty());
  EXPECT_TRUE(r1.overflowed.empty());
  EXPECT_TRUE(r.bad_indices.empty());
}

TEST(MoeRouting, ATokenCrossesToARankOnce) {
  const MoeRouting r = moe_route_reference(kTwoRanks, 2, 4, MoeRefLayout::kPadded, 512);
  // Rank 1's t1 has both of its experts on rank 0: one row travels.
  EXPECT_EQ(r.sent[0].tokens[0], (std::vector<int32_t>{0, 1}));
  EXPECT_EQ(r.sent[0].tokens[1], (std::vector<int32_t>{0, 2}));
  EXPECT_EQ(r.sent[1].tokens[0], (std::vector<int32_t>{0, 1}));
  EXPECT_EQ(r.sent[1].tokens[1], (std::vector<int32_t>{0}));
}

TEST(MoeRouting, MaskedBlocksAndCapacityOverflow) {
  const MoeRouting r = moe_route_reference(kTwoRanks, 2, 4, MoeRefLayout::kMasked, 2);
  const MoeReceived& r0 = r.received[0];
  EXPECT_EQ(r0.expert_start, (std::vector<int64_t>{0, 2}));
  ASSERT_EQ(r0.rows.size(), 4u);
  // Expert 0 has three rows for a capacity of two: the first two in order fit.
  EXPECT_EQ(r0.rows[0], (MoeRow{0, 0, 0}));
  EXPECT_EQ(r0.rows[1], (MoeRow{1, 0, 1}));
  EXPECT_EQ(r0.rows[2], (MoeRow{0, 1, 0}));
  EXPECT_EQ(r0.rows[3], (MoeRow{1, 1, 1}));
  EXPECT_EQ(r0.overflowed, (std::vector<int32_t>{0}));
  EXPECT_EQ(r0.expert_rows[0], 3);  // the count says how many there were
  EXPECT_EQ(r.received[1].overflowed, (std::vector<int32_t>{1}));
}

TEST(MoeRouting, PaddedRoomOverflowKeepsWhatFits) {
  // Room for 130 rows: rank 0's expert 1 starts at 128 and fits; rank 1's expert 3 has three
  // rows from 128 on: two fit.
  const MoeRouting r = moe_route_reference(kTwoRanks, 2, 4, MoeRefLayout::kPadded, 130);
  EXPECT_TRUE(r.received[0].overflowed.empty());
  EXPECT_EQ(r.received[1].overflowed, (std::vector<int32_t>{1}));
  EXPECT_EQ(r.received[1].rows[129], (MoeRow{0, 2, 1}));
}

TEST(MoeRouting, BadIndicesAreListedAndDropped) {
  const std::vector<std::vector<int64_t>> topk = {{0, 4, -2, 1}};  // world 1, E 4: 4 and -2 bad
  const MoeRouting r = moe_route_reference(topk, 2, 4, MoeRefLayout::kPadded, 256);
  EXPECT_EQ(r.bad_indices, (std::vector<MoeRow>{{0, 0, 1}, {0, 1, 0}}));
  EXPECT_EQ(r.received[0].expert_rows, (std::vector<int32_t>{1, 1, 0, 0}));
}

TEST(MoeRouting, AllTokensOnOneExpertAndAllLocal) {
  // World 4, E 8, top-1: every token of every rank to expert 5 (rank 2's local expert 1).
  std::vector<std::vector<int64_t>> topk(4, std::vector<int64_t>(300, 5));
  const MoeRouting r = moe_route_reference(topk, 1, 8, MoeRefLayout::kPadded, 4 * 300 + 2 * 127);
  EXPECT_EQ(r.received[2].expert_rows, (std::vector<int32_t>{0, 1200}));
  EXPECT_EQ(r.received[2].expert_start, (std::vector<int64_t>{0, 0}));
  EXPECT_EQ(r.received[2].rows[1199], (MoeRow{3, 299, 0}));
  for (int d : {0, 1, 3}) {
    EXPECT_EQ(r.received[d].expert_rows, (std::vector<int32_t>{0, 0}));
  }
  for (int s = 0; s < 4; ++s) EXPECT_EQ(r.sent[s].tokens[2].size(), 300u);
}

TEST(MoeRouting, RandomRoutingConservesRows) {
  // Every routed (token, slot) lands exactly once when the room is the worst case; every token
  // travels once per distinct destination rank.
  std::mt19937_64 gen(1234);
  for (int trial = 0; trial < 50; ++trial) {
    const int world = 1 + static_cast<int>(gen() % 8);
    const int e_local = 1 + static_cast<int>(gen() % 8);
    const int experts = world * e_local;
    const int k = 1 + static_cast<int>(gen() % std::min(16, experts));
    std::vector<std::vector<int64_t>> topk(world);
    int64_t max_tokens = 0, routed = 0;
    for (auto& t : topk) {
      const int tokens = static_cast<int>(gen() % 40);
      max_tokens = std::max<int64_t>(max_tokens, tokens);
      for (int i = 0; i < tokens * k; ++i) {
        t.push_back(gen() % 5 == 0 ? -1 : static_cast<int64_t>(gen() % experts));
        routed += t.back() >= 0;
      }
    }
    const int64_t room = world * max_tokens * k + e_local * 127;
    const MoeRouting r = moe_route_reference(topk, k, experts, MoeRefLayout::kPadded, room);
    int64_t landed = 0;
    for (const MoeReceived& d : r.received) {
      EXPECT_TRUE(d.overflowed.empty());
      for (const MoeRow& row : d.rows) landed += row.src >= 0;
    }
    EXPECT_EQ(landed, routed);
    for (int s = 0; s < world; ++s) {
      const int64_t tokens = static_cast<int64_t>(topk[s].size()) / k;
      for (int d = 0; d < world; ++d) {
        int64_t want = 0;
        for (int64_t t = 0; t < tokens; ++t) {
          bool any = false;
          for (int j = 0; j < k; ++j) {
            const int64_t e = topk[s][t * k + j];
            any = any || (e >= 0 && e / e_local == d);
          }
          want += any;
        }
        EXPECT_EQ(static_cast<int64_t>(r.sent[s].tokens[d].size()), want);
      }
    }
  }
}

TEST(MoeRouting, CombineSumsInSlotOrderInFp32) {
  // One token, three slots (the middle one empty), H 2.
  const std::vector<uint16_t> y0 = {float_to_bf16(1.0f), float_to_bf16(-2.0f)};
  const std::vector<uint16_t> y2 = {float_to_bf16(3.0f), float_to_bf16(0.5f)};
  const std::vector<float> w = {0.25f, 9.0f, 0.5f};
  const auto out = moe_combine_reference(1, 3, 2, w, [&](int64_t, int j) -> const uint16_t* {
    return j == 0 ? y0.data() : j == 2 ? y2.data() : nullptr;
  });
  EXPECT_EQ(bf16_to_float(out[0]), 0.25f * 1.0f + 0.5f * 3.0f);
  EXPECT_EQ(bf16_to_float(out[1]), 0.25f * -2.0f + 0.5f * 0.5f);
  // bf16 rounding: to nearest even.
  EXPECT_EQ(float_to_bf16(1.0f + 1.0f / 256), float_to_bf16(1.0f));       // a tie: to even
  EXPECT_EQ(float_to_bf16(1.0f + 3.0f / 256), float_to_bf16(1.015625f));  // a tie: up to even
}

}  // namespace
}  // namespace mk::test
