// The MoE routing contract's CPU reference (moe_reference.h, docs/design/moe.md) against
// hand-worked cases: what lands where, in which order, what travels once (within a node, and
// across nodes through the rail peers), capacity overflow, bad indices, and the combine's fp32
// sum in slot order.
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

// Two nodes of two ranks, eight experts (two a rank), top-3:
//   rank 0 (node 0): t0 -> {4, 6, 0} (ranks 2, 3 on node 1; itself), t1 -> {5, 4, -1} (rank 2
//   twice), t2 -> {1, 2, 3} (node 0 only)
//   rank 3 (node 1): t0 -> {0, 2, 7} (ranks 0, 1 on node 0; itself)
TEST(MoeRouting, AcrossNodesATokenCrossesOnceANode) {
  const std::vector<std::vector<int64_t>> topk = {{4, 6, 0, 5, 4, -1, 1, 2, 3}, {}, {}, {0, 2, 7}};
  const MoeNodeTraffic n = moe_node_traffic_reference(topk, 3, 8, 2);
  // Rank 0: t0 and t1 cross to node 1 once each (t0 has experts on both of its ranks); t2 does
  // not cross. Rank 3: t0 crosses to node 0 once (two ranks there).
  EXPECT_EQ(n.crossing[0][1], (std::vector<int32_t>{0, 1}));
  EXPECT_TRUE(n.crossing[0][0].empty());
  EXPECT_EQ(n.crossing[3][0], (std::vector<int32_t>{0}));
  // The rail peers: rank 0's is rank 2 (local index 0), rank 3's is rank 1 (local index 1).
  EXPECT_EQ(n.relayed[2][2], (std::vector<MoeRelayed>{{0, 0}, {0, 1}}));  // kept by rank 2
  EXPECT_EQ(n.relayed[2][3], (std::vector<MoeRelayed>{{0, 0}}));          // forwarded
  EXPECT_EQ(n.relayed[1][0], (std::vector<MoeRelayed>{{3, 0}}));
  EXPECT_EQ(n.relayed[1][1], (std::vector<MoeRelayed>{{3, 0}}));
  // Within a node: NVLink directly.
  EXPECT_EQ(n.direct[0][0], (std::vector<int32_t>{0, 2}));
  EXPECT_EQ(n.direct[0][1], (std::vector<int32_t>{2}));
  EXPECT_EQ(n.direct[3][3], (std::vector<int32_t>{0}));
}

TEST(MoeRouting, AcrossNodesEveryRankGetsWhatOneNodeWouldSend) {
  // Random routing on 1-4 nodes of 1-4 ranks: every (source, token, destination rank) of the
  // one-node routing arrives exactly once - directly within the node, else through the relay
  // whose node it is - and a token crosses to a node once, only where it has experts there.
  std::mt19937_64 gen(99);
  for (int trial = 0; trial < 40; ++trial) {
    const int per_node = 1 + static_cast<int>(gen() % 4);
    const int world = per_node * (1 + static_cast<int>(gen() % 4));
    const int e_local = 1 + static_cast<int>(gen() % 4);
    const int experts = world * e_local;
    const int k = 1 + static_cast<int>(gen() % std::min(8, experts));
    std::vector<std::vector<int64_t>> topk(world);
    for (auto& t : topk) {
      const int tokens = static_cast<int>(gen() % 30);
      for (int i = 0; i < tokens * k; ++i) {
        t.push_back(gen() % 6 == 0 ? -1 : static_cast<int64_t>(gen() % experts));
      }
    }
    const int64_t room = world * 30 * k + e_local * 127;  // the worst case: all rows fit
    const MoeRouting flat = moe_route_reference(topk, k, experts, MoeRefLayout::kPadded, room);
    const MoeNodeTraffic n = moe_node_traffic_reference(topk, k, experts, per_node);
    for (int s = 0; s < world; ++s) {
      const int home = s / per_node;
      for (int d = 0; d < world; ++d) {
        const int node = d / per_node;
        std::vector<int32_t> got;
        if (node == home) {
          got = n.direct[s][d];
        } else {
          const int relay = node * per_node + s % per_node;
          for (const MoeRelayed& r : n.relayed[relay][d]) {
            if (r.src == s) got.push_back(r.token);
          }
          for (int32_t t : got) {  // it crossed to that node, once
            EXPECT_EQ(std::count(n.crossing[s][node].begin(), n.crossing[s][node].end(), t), 1);
          }
        }
        EXPECT_EQ(got, flat.sent[s].tokens[d]) << "source " << s << " destination " << d;
      }
      for (int node = 0; node < world / per_node; ++node) {  // nothing crosses for nothing
        for (int32_t t : n.crossing[s][node]) {
          bool any = false;
          for (int d = node * per_node; d < (node + 1) * per_node; ++d) {
            any = any ||
                  std::count(flat.sent[s].tokens[d].begin(), flat.sent[s].tokens[d].end(), t) > 0;
          }
          EXPECT_TRUE(any) << "source " << s << " token " << t << " node " << node;
        }
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
