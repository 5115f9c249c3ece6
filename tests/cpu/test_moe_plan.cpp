// The MoE ops' plan (src/moe/moe_plan.h): sizes checked before launch, the layouts' rows, the
// CTAs, and the workspace laid out - a host function, tested without a GPU.
#include <gtest/gtest.h>

#include <string>

#include "mkernel/error.h"
#include "moe/moe_plan.h"

namespace mk::moe {
namespace {

MoeProblem deepseek(int64_t tokens) {
  MoeProblem p;
  p.tokens = tokens;
  p.max_tokens = tokens;
  p.hidden = 7168;
  p.top_k = 8;
  p.num_experts = 256;
  return p;
}

TEST(MoePlan, WorstCaseRooms) {
  const Plan padded = plan_moe(8, 132, deepseek(4096), {}, "moe_dispatch");
  // Every routed row of every rank (top-8 of 32 local experts: 8 per token), plus the padding.
  EXPECT_EQ(padded.plan.rows, 8 * 4096 * 8 + 32 * 127);
  EXPECT_EQ(padded.plan.capacity, padded.plan.rows);
  EXPECT_EQ(padded.plan.experts_local, 32);
  MoeProblem m = deepseek(128);
  m.layout = MoeLayout::kMasked;
  const Plan masked = plan_moe(8, 132, m, {}, "moe_dispatch");
  EXPECT_EQ(masked.plan.capacity, 8 * 128);  // one row per token of every rank
  EXPECT_EQ(masked.plan.rows, 32 * 8 * 128);
  // Fewer local experts than slots: a token has at most E_local rows on a rank.
  MoeProblem few = deepseek(100);
  few.num_experts = 16;
  EXPECT_EQ(plan_moe(8, 132, few, {}, "moe_dispatch").plan.rows, 8 * 100 * 2 + 2 * 127);
}

TEST(MoePlan, GivenCapacityAndCtas) {
  MoeProblem p = deepseek(512);
  p.capacity = 5000;
  const Plan plan = plan_moe(2, 66, p, {}, "moe_dispatch");
  EXPECT_EQ(plan.plan.rows, 5000);
  EXPECT_EQ(plan.plan.ctas, 66);  // the SM budget
  MoeConfig config;
  config.sms = 20;
  EXPECT_EQ(plan_moe(2, 66, p, config, "moe_dispatch").plan.ctas, 20);
  config.sms = 500;
  EXPECT_EQ(plan_moe(2, 66, p, config, "moe_dispatch").plan.ctas, 66);
  const std::string line = plan.plan.describe();
  EXPECT_NE(line.find("padded layout: 5000 rows"), std::string::npos) << line;
  EXPECT_NE(line.find("128 local experts"), std::string::npos) << line;
}

TEST(MoePlan, WorkspaceLaidOutWithoutOverlap) {
  MoeProblem p = deepseek(1000);
  p.top_k = 6;
  p.hidden = 2048;
  const int world = 4;
  const Plan plan = plan_moe(world, 33, p, {}, "moe_dispatch");
  const Offsets& o = plan.offsets;
  const uint64_t t = 1000, k = 6, h = 2048, w = world;
  struct Field {
    uint64_t at, bytes;
  };
  const Field fields[] = {{o.recv_meta, w * t * (1 + 2 * k) * 4},
                          {o.recv_x, w * t * h * 2},
                          {o.comb_x, t * k * h * 2},
                          {o.comb_flag, t * k * 4},
                          {o.chunk_cnt, static_cast<uint64_t>(plan.chunks(1000)) * 256 * 4},
                          {o.chunk_dcnt, static_cast<uint64_t>(plan.chunks(1000)) * w * 4},
                          {o.pos, t * k * 4},
                          {o.send_list, w * t * 4},
                          {o.totals, (256 + w + 1) * 4}};
  uint64_t end = 0;
  for (const Field& f : fields) {
    EXPECT_EQ(f.at % 256, 0u);
    EXPECT_GE(f.at, end) << "fields overlap";
    end = f.at + f.bytes;
  }
  EXPECT_GE(o.bytes, end);
  // moe_dispatch_gemm's gather table: an int per layout row, after the arrival counters.
  EXPECT_GE(o.row_src, o.counters + static_cast<uint64_t>(plan.blocks) * 8);
  EXPECT_GE(o.comb_count, o.row_src + static_cast<uint64_t>(plan.plan.rows) * 4);
  EXPECT_EQ(o.row_src % 256, 0u);
  EXPECT_EQ(plan.plan.workspace_bytes, o.bytes);
  EXPECT_EQ(plan.meta_ints, 1 + 2 * 6);
}

// Across nodes: the route's node tables, the combine's relay buffers and the transfer regions
// (dispatch, then combine: staging per other node, inbound per other node) follow the one-node
// fields; a dispatch region holds the header, the crossing metadata and the rows of max_tokens
// tokens, a combine region the flags and rows of max_tokens x top_k slots.
TEST(MoePlan, AcrossNodesTransferRegions) {
  MoeProblem p = deepseek(1000);
  p.top_k = 6;
  p.hidden = 2048;
  const Plan one = plan_moe(8, 33, p, {}, "moe_dispatch");
  EXPECT_EQ(one.nodes, 1);
  EXPECT_EQ(one.cross.bytes, 0u);
  const Plan two = plan_moe(8, 33, p, {}, "moe_dispatch", 2);
  EXPECT_EQ(two.nodes, 2);
  const CrossRegion& r = two.cross;
  EXPECT_EQ(r.cross_ints, 1 + 3 * 6);
  const uint64_t t = 1000, h = 2048, per_node = 4, e_local = 256 / 8;
  EXPECT_GE(r.meta_at, (per_node * (e_local + 1) + 1) * 4);  // the header
  EXPECT_GE(r.rows_at, r.meta_at + t * r.cross_ints * 4);
  EXPECT_GE(r.bytes, r.rows_at + t * h * 2);
  EXPECT_EQ(r.meta_at % 256, 0u);
  EXPECT_EQ(r.rows_at % 256, 0u);
  EXPECT_EQ(r.bytes % 256, 0u);
  const Offsets& o = two.offsets;
  EXPECT_GE(o.chunk_ncnt, o.comb_count);
  EXPECT_GE(o.cross_list, o.chunk_ncnt + static_cast<uint64_t>(two.chunks(1000)) * 2 * 4);
  EXPECT_GE(o.send_slot, o.cross_list + 2 * t * 4);
  EXPECT_GE(o.slot_route, o.send_slot + t * 6 * 4);
  EXPECT_GE(o.recv_cross, o.slot_route + t * 6 * 4);
  EXPECT_GE(o.row_cross, o.recv_cross + 8 * t * 4);
  EXPECT_GE(o.relay_y, o.row_cross + static_cast<uint64_t>(two.plan.rows) * 4);
  EXPECT_GE(o.relay_flag, o.relay_y + 2 * t * 6 * h * 2);
  EXPECT_GE(o.xfer, o.relay_flag + 2 * t * 6 * 4);
  EXPECT_EQ(o.xfer % 256, 0u);
  const CombRegion& c = two.comb;
  EXPECT_GE(c.rows_at, t * 6 * 4);
  EXPECT_GE(c.bytes, c.rows_at + t * 6 * h * 2);
  EXPECT_EQ(o.bytes, o.xfer + 4 * (r.bytes + c.bytes));
  EXPECT_EQ(two.plan.workspace_bytes, o.bytes);
  EXPECT_GT(two.plan.workspace_bytes, one.plan.workspace_bytes + 4 * t * h * 2);
}

TEST(MoePlan, RouteChunks) {
  const Plan small = plan_moe(2, 66, deepseek(100), {}, "moe_dispatch");
  EXPECT_EQ(small.chunk_tokens, kMinChunkTokens);
  EXPECT_EQ(small.chunks(0), 1);  // the last chunk writes the totals, also of no tokens
  EXPECT_EQ(small.chunks(100), (100 + kMinChunkTokens - 1) / kMinChunkTokens);
  EXPECT_EQ(small.chunks(kMinChunkTokens), 1);
  EXPECT_EQ(small.chunks(kMinChunkTokens + 1), 2);
  const Plan big = plan_moe(2, 66, deepseek(65536), {}, "moe_dispatch");
  EXPECT_EQ(big.chunks(65536), kMaxChunks);
  EXPECT_LE(big.chunks(65535), kMaxChunks);
}

TEST(MoePlan, RefusesWhatItCannotDo) {
  const auto refused = [](int world, MoeProblem p, const std::string& needle,
                          MoeConfig config = {}) {
    try {
      plan_moe(world, 132, p, config, "moe_dispatch");
      ADD_FAILURE() << "accepted; expected an error containing '" << needle << "'";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument) << e.what();
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
      EXPECT_EQ(std::string(e.what()).rfind("invalid argument: moe_dispatch: ", 0), 0u) << e.what();
    }
  };
  MoeProblem p = deepseek(64);
  p.num_experts = 12;
  refused(8, p, "num_experts = 12; expected a multiple of the world size 8");
  p.num_experts = kMoeMaxExperts * 2;
  refused(1, p, "num_experts = ");
  p = deepseek(64);
  p.top_k = 0;
  refused(2, p, "top_k = 0");
  p.top_k = kMoeMaxTopK + 1;
  refused(2, p, "top_k = 17");
  p = deepseek(64);
  p.hidden = 7170;
  refused(2, p, "hidden = 7170");
  p = deepseek(64);
  p.tokens = 65;
  refused(2, p, "tokens = 65, max_tokens = 64");
  p = deepseek(64);
  p.capacity = -3;
  refused(2, p, "capacity = -3");
  // A capacity whose masked rows (capacity x E_local) would wrap 64 bits: refused, not wrapped.
  for (const int64_t capacity : {(int64_t{1} << 62) + 1, int64_t{1} << 62, int64_t{1} << 31}) {
    for (const MoeLayout layout : {MoeLayout::kMasked, MoeLayout::kPadded}) {
      p = deepseek(64);
      p.layout = layout;
      p.capacity = capacity;
      refused(2, p, "capacity = " + std::to_string(capacity) + " exceeds 2^31 - 1 rows");
    }
  }
  p = deepseek(64);
  MoeConfig config;
  config.sms = -1;
  refused(2, p, "config.sms = -1", config);
  p = deepseek(1 << 26);  // 2^26 tokens x 8 ranks x 8 slots: rows past 2^31
  refused(8, p, "exceed 2^31");
  p.capacity = 1 << 20;  // the rows fit, the pairs a rank may receive do not
  refused(8, p, "the pairs a rank may receive (4294967296) exceed 2^31 - 1");
  // Across nodes: equal nodes, at most kMoeMaxNodeRanks ranks.
  const auto refused_nodes = [](int world, int nodes, const std::string& needle) {
    try {
      plan_moe(world, 132, deepseek(64), {}, "moe_dispatch", nodes);
      ADD_FAILURE() << "accepted; expected an error containing '" << needle << "'";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument) << e.what();
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  refused_nodes(8, 3, "3 nodes for world size 8");
  refused_nodes(128, 16, "at most 64 ranks across nodes");
}

}  // namespace
}  // namespace mk::moe
