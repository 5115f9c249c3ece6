// The fused GEMMs' plans (src/fused/plans.h) without GPUs: the bounds every plan must keep at any
// shape, world size and SM budget (workspace within the sequential intermediate, CTAs within the
// budget, an interleaved order only on a grid coprime to the world size, staging within the
// workspace), the H200 plans the journal's measurements were taken with, and the errors.
#include <gtest/gtest.h>

#include <cstdlib>
#include <numeric>
#include <random>
#include <string>

#include "fused/plans.h"
#include "mkernel/error.h"

namespace mk::fused {
namespace {

// A whole H200 per rank (132 SMs; the plans cap CTAs at kMaxChannels).
PlanContext h200(int world) { return {world, world, 132}; }

struct Shape {
  int64_t m, n, k;
};

std::string name(const Shape& s, const PlanContext& ctx) {
  return std::to_string(s.m) + "x" + std::to_string(s.n) + "x" + std::to_string(s.k) + ", world " +
         std::to_string(ctx.world) + ", " + std::to_string(ctx.sms) + " SMs";
}

// What holds for every plan of a reducing kernel.
void expect_reducing_plan_bounds(const FusedGemmPlan& p, const PlanContext& ctx, int64_t m,
                                 int64_t n) {
  EXPECT_GE(p.ctas, 1) << p.describe();
  EXPECT_LE(p.ctas, ctx.sms) << p.describe();
  EXPECT_TRUE(p.block_n == 64 || p.block_n == 128 || p.block_n == 192 || p.block_n == 256)
      << p.describe();
  EXPECT_LE(p.staging_bytes, p.workspace_bytes) << p.describe();
  EXPECT_TRUE(p.outbox_slots >= 0 && p.outbox_slots <= 2) << p.describe();  // kMaxOutboxSlots
  if (p.lag >= 0) {  // interleaved: two waves of remote tiles, on a coprime grid
    EXPECT_EQ(std::gcd(p.ctas, ctx.world), 1) << p.describe();
    EXPECT_EQ(p.lag, 2 * (ctx.world - 1) * p.ctas) << p.describe();
  }
  if (ctx.world == 1) EXPECT_EQ(p.workspace_bytes, 0u) << p.describe();
  (void)m;
  (void)n;
}

TEST(FusedPlans, GemmArKeepsItsBoundsEverywhere) {
  std::mt19937_64 gen(12345);
  for (int world : {1, 2, 3, 4, 8}) {
    for (int sms : {132, 66, 33, 4}) {
      const PlanContext ctx{world, world, sms};
      for (int i = 0; i < 60; ++i) {
        const Shape s{static_cast<int64_t>(1 + gen() % 20000),
                      static_cast<int64_t>(8 * (1 + gen() % 4096)),
                      static_cast<int64_t>(8 * (1 + gen() % 2048))};
        SCOPED_TRACE(name(s, ctx));
        FusedGemmPlan p;
        try {
          p = plan_gemm_ar(ctx, s.m, s.n, s.k, {});
        } catch (const Error& e) {  // only for too many tiles
          EXPECT_NE(std::string(e.what()).find("are supported"), std::string::npos) << e.what();
          continue;
        }
        expect_reducing_plan_bounds(p, ctx, s.m, s.n);
        // Within the sequential [M, N] bf16 intermediate; the documented exception: three or
        // more ranks and N < 128 (an fp32 accumulator of up to M x N).
        const auto intermediate = static_cast<std::size_t>(s.m * s.n * 2);
        if (world <= 2 || s.n >= 128) {
          EXPECT_LE(p.workspace_bytes, intermediate) << p.describe();
        } else {
          EXPECT_LE(p.workspace_bytes, 2 * intermediate) << p.describe();
        }
        if (p.outbox_slots == 0) EXPECT_EQ(p.staging_bytes, 0u) << p.describe();
        // Interleaved only with four waves of own tiles per rank (measured: fewer run faster in
        // the blocked order).
        const int64_t tiles_n = (s.n + p.block_n - 1) / p.block_n;
        if (p.lag >= 0)
          EXPECT_GE((s.m + 127) / 128 * (tiles_n / world), 4 * p.ctas) << p.describe();
      }
    }
  }
}

TEST(FusedPlans, GemmRsKeepsItsBoundsEverywhere) {
  std::mt19937_64 gen(54321);
  for (int world : {1, 2, 3, 4, 8}) {
    for (int sms : {132, 66, 33, 4}) {
      const PlanContext ctx{world, world, sms};
      for (int i = 0; i < 60; ++i) {
        const Shape s{static_cast<int64_t>(world * (1 + gen() % 5000)),
                      static_cast<int64_t>(8 * (1 + gen() % 4096)),
                      static_cast<int64_t>(8 * (1 + gen() % 2048))};
        SCOPED_TRACE(name(s, ctx));
        FusedGemmPlan p;
        try {
          p = plan_gemm_rs(ctx, s.m, s.n, s.k, {});
        } catch (const Error& e) {
          EXPECT_NE(std::string(e.what()).find("are supported"), std::string::npos) << e.what();
          continue;
        }
        expect_reducing_plan_bounds(p, ctx, s.m, s.n);
        EXPECT_EQ(p.shard_rows, s.m / world);
        // The fp32 accumulator of this rank's rows: M / w x N x 4 <= M x N x 2 for w >= 2.
        if (world > 1) {
          EXPECT_EQ(p.workspace_bytes, static_cast<std::size_t>(s.m / world * s.n * 4));
        }
        // Interleaved only with two waves of tiles per shard (gemm_rs stages in them).
        const int64_t tiles = (p.shard_rows + 127) / 128 * ((s.n + p.block_n - 1) / p.block_n);
        if (p.lag >= 0) EXPECT_GE(tiles, 2 * p.ctas) << p.describe();
      }
    }
  }
}

TEST(FusedPlans, AgGemmKeepsItsBoundsEverywhere) {
  std::mt19937_64 gen(777);
  for (int world : {1, 2, 4, 8}) {
    for (int sms : {132, 33}) {
      const PlanContext ctx{world, world, sms};
      for (int i = 0; i < 40; ++i) {
        const Shape s{static_cast<int64_t>(world * (1 + gen() % 5000)),
                      static_cast<int64_t>(8 * (1 + gen() % 4096)),
                      static_cast<int64_t>(8 * (1 + gen() % 2048))};
        SCOPED_TRACE(name(s, ctx));
        const FusedGemmPlan p = plan_ag_gemm(ctx, s.m, s.n, s.k, {});
        EXPECT_LE(p.ctas, sms) << p.describe();
        EXPECT_GE(p.comm_ctas, 1) << p.describe();
        EXPECT_LE(p.comm_ctas, p.ctas) << p.describe();
        EXPECT_GE(p.pieces, 1) << p.describe();
        EXPECT_LE(p.pieces, kMaxOpSignals) << p.describe();
        EXPECT_GE(static_cast<int64_t>(p.pieces) * p.piece_rows, p.shard_rows) << p.describe();
        // The gathered A, exactly the sequential intermediate.
        EXPECT_EQ(p.workspace_bytes, static_cast<std::size_t>(s.m * s.k * 2)) << p.describe();
      }
    }
  }
}

// The plans behind the journal's two-rank H200 numbers (docs/PERFORMANCE.md, sessions 4-5).
TEST(FusedPlans, TwoRankH200PlansOfTheJournal) {
  const PlanContext ctx = h200(2);
  const FusedGemmPlan rs = plan_gemm_rs(ctx, 8192, 8192, 4096, {});
  EXPECT_EQ(rs.block_n, 256) << rs.describe();
  EXPECT_EQ(rs.ctas, 131) << rs.describe();  // interleaved on a grid coprime to 2
  EXPECT_EQ(rs.lag, 262) << rs.describe();
  const FusedGemmPlan rs_small = plan_gemm_rs(ctx, 4096, 4096, 2048, {});
  EXPECT_EQ(rs_small.lag, -1) << rs_small.describe();  // 256 tiles per shard: under two waves
  const FusedGemmPlan ar = plan_gemm_ar(ctx, 8192, 8192, 4096, {});
  EXPECT_EQ(ar.outbox_slots, 2) << ar.describe();
  EXPECT_EQ(ar.lag, 2 * ar.ctas) << ar.describe();
  const FusedGemmPlan decode = plan_gemm_ar(ctx, 128, 8192, 4096, {});
  EXPECT_EQ(decode.outbox_slots, 0) << decode.describe();  // no room for staging
  // M = 1024: staging fits only beside 128-wide tiles (one slot, 128 CTAs); two waves of own
  // tiles: blocked order, as at 4096^3 and 8192 x 2048 (session 5)
  const FusedGemmPlan rows1024 = plan_gemm_ar(ctx, 1024, 8192, 4096, {});
  EXPECT_EQ(rows1024.block_n, 128) << rows1024.describe();
  EXPECT_EQ(rows1024.outbox_slots, 1) << rows1024.describe();
  EXPECT_EQ(rows1024.ctas, 128) << rows1024.describe();
  EXPECT_EQ(rows1024.lag, -1) << rows1024.describe();
  EXPECT_EQ(plan_gemm_ar(ctx, 4096, 4096, 2048, {}).lag, -1);
  EXPECT_EQ(plan_gemm_ar(ctx, 8192, 2048, 4096, {}).lag, -1);
}

// ag_gemm's pieces: the shard arrives in rounds of comm_ctas pieces (pushing CTA c takes pieces
// c, c + comm_ctas, ...), so pieces are sized for about four rounds, 128-512 KiB each
// (docs/PERFORMANCE.md, session 13: one round of 512 KiB pieces landed all at once).
TEST(FusedPlans, AgGemmPiecesArriveInRounds) {
  const PlanContext ctx = h200(2);
  struct Case {
    int64_t m, n, k;
    int rounds_at_least;
  };
  for (const Case& c :
       {Case{4096, 4096, 4096, 2}, Case{8192, 2048, 8192, 4}, Case{2048, 8192, 8192, 2},
        Case{8192, 8192, 8192, 4}, Case{16384, 8192, 8192, 4}, Case{8192, 28672, 8192, 4}}) {
    const FusedGemmPlan p = plan_ag_gemm(ctx, c.m, c.n, c.k, {});
    SCOPED_TRACE(p.describe());
    const int64_t piece_bytes = int64_t{p.piece_rows} * c.k * 2;
    EXPECT_GE(piece_bytes, int64_t{128} << 10);
    EXPECT_LE(piece_bytes, int64_t{512} << 10);
    EXPECT_GE(p.pieces, c.rounds_at_least * p.comm_ctas);
  }
  // No more pushers than NVLink carries (72 at 5 GB/s each): 8192x2048x8192 asked for 127.
  EXPECT_EQ(plan_ag_gemm(ctx, 8192, 2048, 8192, {}).comm_ctas, 72);
  EXPECT_EQ(plan_ag_gemm(ctx, 4096, 4096, 4096, {}).comm_ctas, 64);
  // A shard under one 128 KiB piece: one piece; an explicit piece size is kept.
  EXPECT_EQ(plan_ag_gemm(ctx, 64, 256, 512, {}).pieces, 1);
  FusedGemmConfig rows;
  rows.piece_rows = 64;
  EXPECT_EQ(plan_ag_gemm(ctx, 4096, 4096, 4096, rows).piece_rows, 64);
}

// ag_gemm across nodes: each piece has a host-pad signal per node (after the entry signal), so
// the pieces per shard shrink to fit kInterNodeSignals; at most kMaxGatherRanks ranks.
TEST(FusedPlans, AgGemmAcrossNodesFitsTheHostPad) {
  const PlanContext two_nodes{4, 2, 132, 2};
  FusedGemmConfig tiny_pieces;
  tiny_pieces.piece_rows = 1;
  const FusedGemmPlan p = plan_ag_gemm(two_nodes, 4 * 100000, 256, 64, tiny_pieces);
  EXPECT_EQ(p.nodes, 2);
  EXPECT_LE(1 + 2 * p.pieces, kInterNodeSignals) << p.describe();
  EXPECT_GE(static_cast<int64_t>(p.pieces) * p.piece_rows, p.shard_rows) << p.describe();
  EXPECT_NE(p.describe().find("across 2 nodes"), std::string::npos) << p.describe();
  const FusedGemmPlan one_node = plan_ag_gemm(h200(4), 4 * 100000, 256, 64, tiny_pieces);
  EXPECT_LE(one_node.pieces, kMaxOpSignals) << one_node.describe();  // only the device pad
  EXPECT_GT(one_node.pieces, p.pieces) << one_node.describe();
  try {
    plan_ag_gemm({128, 8, 132, 16}, 128 * 8, 256, 64, {});
    ADD_FAILURE() << "no error for 128 ranks across nodes";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("at most 64 ranks"), std::string::npos) << e.what();
  }
}

// ag_gemm's kernel argument (GatherRoutes) holds at most kMaxGatherRanks shards on one node as
// across nodes, and kMaxRailPeers rail peers (one per other node): beyond either the plan refuses
// (the routes would be written past their tables).
TEST(FusedPlans, AgGemmRejectsWhatItsRoutesCannotHold) {
  auto message = [](const PlanContext& ctx) {
    try {
      plan_ag_gemm(ctx, ctx.world * 128, 256, 64, {});
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument) << e.what();
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_NE(message({65, 65, 132, 1}).find("at most 64 ranks; got 65"), std::string::npos)
      << message({65, 65, 132, 1});
  EXPECT_NE(message({34, 1, 132, 34}).find("at most 33 nodes; got 34"), std::string::npos)
      << message({34, 1, 132, 34});
  EXPECT_NE(message({64, 1, 132, 64}).find("at most 33 nodes; got 64"), std::string::npos)
      << message({64, 1, 132, 64});
  EXPECT_EQ(message({64, 64, 132, 1}), "no error");
  EXPECT_EQ(message({33, 1, 132, 33}), "no error");
  EXPECT_EQ(message({64, 2, 132, 32}), "no error");
}

// gemm_rs across nodes: tiles at most 128 wide, blocked order, fp32 partials unless bf16 is
// asked for, 3 x nodes - 2 regions of workspace, signals within both pads.
TEST(FusedPlans, GemmRsAcrossNodes) {
  const PlanContext two_nodes{4, 2, 132, 2};
  const FusedGemmPlan p = plan_gemm_rs(two_nodes, 8192, 8192, 2048, {});
  EXPECT_EQ(p.nodes, 2);
  EXPECT_LE(p.block_n, 128) << p.describe();
  EXPECT_EQ(p.lag, -1);
  EXPECT_FALSE(p.bf16_partials);
  EXPECT_EQ(p.workspace_bytes, std::size_t{4} * 2048 * 8192 * 4) << p.describe();
  EXPECT_NE(p.describe().find("across 2 nodes"), std::string::npos) << p.describe();
  const int64_t tiles = (p.shard_rows + 127) / 128 * ((8192 + p.block_n - 1) / p.block_n);
  EXPECT_LE(2 * tiles + 1, kInterNodeSignals);
  EXPECT_LE(2 * 2 * tiles, kMaxOpSignals);
  const PlanContext pair_of_nodes{2, 1, 132, 2};  // the two ranks are on different nodes
  EXPECT_FALSE(plan_gemm_rs(pair_of_nodes, 4096, 4096, 2048, {}).bf16_partials);
  FusedGemmConfig bf16;  // across nodes at any world size: node sums in bf16 (NodeLinks)
  bf16.bf16_partials = true;
  EXPECT_TRUE(plan_gemm_rs(pair_of_nodes, 4096, 4096, 2048, bf16).bf16_partials);
  EXPECT_TRUE(plan_gemm_rs(two_nodes, 8192, 8192, 2048, bf16).bf16_partials);
  EXPECT_NE(plan_gemm_rs(two_nodes, 8192, 8192, 2048, bf16).describe().find("bf16 partials"),
            std::string::npos);
  FusedGemmConfig wide;
  wide.block_n = 256;
  EXPECT_THROW(plan_gemm_rs(two_nodes, 8192, 8192, 2048, wide), Error);
  try {  // 2 x 4096 slices of one shard do not fit the host pad
    plan_gemm_rs(two_nodes, 4 * 8192, 8192, 2048, {});
    ADD_FAILURE() << "no error for a shard of 4096 tiles across nodes";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("across 2 nodes"), std::string::npos) << e.what();
  }
}

// gemm_ar across nodes: any M, tiles at most 128 wide, blocked order, no outbox, 4 x nodes - 2
// regions of M x the widest owner's columns fp32.
TEST(FusedPlans, GemmArAcrossNodes) {
  const PlanContext two_nodes{4, 2, 132, 2};
  for (const int64_t m : {1, 7, 128, 4096}) {
    const FusedGemmPlan p = plan_gemm_ar(two_nodes, m, 8192, 2048, {});
    EXPECT_EQ(p.nodes, 2);
    EXPECT_LE(p.block_n, 128) << p.describe();
    EXPECT_EQ(p.lag, -1);
    EXPECT_FALSE(p.bf16_partials);
    EXPECT_EQ(p.outbox_slots, 0);
    const int64_t tiles_n = (8192 + p.block_n - 1) / p.block_n;
    const int64_t max_cols = (tiles_n + 3) / 4 * p.block_n;  // 4 ranks share the column tiles
    EXPECT_EQ(p.workspace_bytes, static_cast<std::size_t>(6 * m * max_cols * 4)) << p.describe();
  }
  FusedGemmConfig bf16;  // across nodes at any world size: node sums in bf16 (NodeLinks)
  bf16.bf16_partials = true;
  EXPECT_TRUE(plan_gemm_ar(two_nodes, 128, 8192, 2048, bf16).bf16_partials);
  FusedGemmConfig wide;
  wide.block_n = 192;
  EXPECT_THROW(plan_gemm_ar(two_nodes, 128, 8192, 2048, wide), Error);
  // Two host-pad signals per slice (node sum, finished slice): 8192 x 8192 over 4 ranks has
  // 1024 tiles per rank, 4097 signals - one more than the pad holds (a limit to lift).
  EXPECT_THROW(plan_gemm_ar(two_nodes, 8192, 8192, 2048, {}), Error);
}

// bf16 partials: only when asked, and only with two ranks (one partial per slice); across
// nodes the node sums at any world size (GemmRsAcrossNodes above). MKERNEL_BF16_PARTIALS reaches
// the plans folded into the config (with_overrides), either way.
TEST(FusedPlans, Bf16PartialsOnlyWhenAsked) {
  const PlanContext ctx = h200(2);
  FusedGemmConfig bf16;
  bf16.bf16_partials = true;
  EXPECT_FALSE(plan_gemm_rs(ctx, 8192, 8192, 4096, {}).bf16_partials);
  EXPECT_FALSE(plan_gemm_ar(ctx, 8192, 8192, 4096, {}).bf16_partials);
  EXPECT_TRUE(plan_gemm_rs(ctx, 8192, 8192, 4096, bf16).bf16_partials);
  EXPECT_FALSE(plan_gemm_rs(h200(4), 8192, 8192, 4096, bf16).bf16_partials);
  EXPECT_TRUE(plan_gemm_ar(ctx, 8192, 8192, 4096, bf16).bf16_partials);
  EXPECT_FALSE(plan_gemm_ar(h200(4), 8192, 8192, 4096, bf16).bf16_partials);
  EXPECT_NE(plan_gemm_rs(ctx, 8192, 8192, 4096, bf16).describe().find("bf16 partials"),
            std::string::npos);
}

// The overrides fold into the config: a knob the caller left at 0 takes the variable's value,
// one the caller set keeps it; bf16 partials follow the variable either way.
TEST(FusedPlans, OverridesFoldIntoTheConfig) {
  mk::detail::Overrides o;
  o.block_n = 128;
  o.comm_ctas = 24;
  o.piece_rows = 64;
  o.bf16_partials = 0;
  FusedGemmConfig asked;
  asked.block_n = 256;
  asked.bf16_partials = true;
  const FusedGemmConfig c = with_overrides(asked, o);
  EXPECT_EQ(c.block_n, 256);
  EXPECT_EQ(c.comm_ctas, 24);
  EXPECT_EQ(c.piece_rows, 64);
  EXPECT_FALSE(c.bf16_partials);
  EXPECT_EQ(with_overrides({}, o).block_n, 128);
  o.bf16_partials = 1;
  EXPECT_TRUE(with_overrides({}, o).bf16_partials);
  o.bf16_partials = -1;
  EXPECT_TRUE(with_overrides(asked, o).bf16_partials);
  EXPECT_FALSE(with_overrides({}, o).bf16_partials);
  const FusedGemmPlan ag = plan_ag_gemm(h200(2), 8192, 8192, 8192, with_overrides({}, o));
  EXPECT_EQ(ag.block_n, 128) << ag.describe();
  EXPECT_EQ(ag.comm_ctas, 24) << ag.describe();
  EXPECT_EQ(ag.piece_rows, 64) << ag.describe();
}

// MKERNEL_GEMM_BLOCK_N asks where the library picks, so across nodes it enters at most the widest
// tile the reducing ops run there (gemm_rs / gemm_ar pass kMaxReduceBlockN): 256 runs at 128
// instead of failing the caller's check, which stays for a width set in the config.
TEST(FusedPlans, BlockNOverrideKeepsToTheWidestTileAcrossNodes) {
  mk::detail::Overrides o;
  o.block_n = 256;
  const PlanContext two_nodes{4, 2, 132, 2};
  const FusedGemmConfig across = with_overrides({}, o, kMaxReduceBlockN);
  EXPECT_EQ(across.block_n, kMaxReduceBlockN);
  EXPECT_EQ(plan_gemm_rs(two_nodes, 8192, 8192, 2048, across).block_n, 128);
  EXPECT_EQ(plan_gemm_ar(two_nodes, 128, 8192, 2048, across).block_n, 128);
  EXPECT_EQ(plan_gemm_rs(h200(2), 8192, 8192, 4096, with_overrides({}, o)).block_n, 256);
  FusedGemmConfig wide;
  wide.block_n = 256;
  EXPECT_THROW(plan_gemm_rs(two_nodes, 8192, 8192, 2048, with_overrides(wide, o, 128)), Error);
}

// gemm_rs's and gemm_ar's partials through the stage ring: two ranks, fp32, slices at multiples
// of the tile width, and at least one whole tile.
TEST(FusedPlans, GemmRsTmaPartials) {
  const PlanContext ctx = h200(2);
  const FusedGemmPlan p = plan_gemm_rs(ctx, 8192, 8192, 4096, {});
  EXPECT_TRUE(p.tma_partials) << p.describe();
  EXPECT_NE(p.describe().find("TMA partials"), std::string::npos) << p.describe();
  EXPECT_FALSE(plan_gemm_rs(h200(4), 8192, 8192, 2048, {}).tma_partials);  // peers add (red)
  FusedGemmConfig bf16;
  bf16.bf16_partials = true;
  EXPECT_FALSE(plan_gemm_rs(ctx, 8192, 8192, 4096, bf16).tma_partials);
  FusedGemmConfig w192;
  w192.block_n = 192;
  EXPECT_FALSE(plan_gemm_rs(ctx, 8192, 8200, 4096, w192).tma_partials);  // 64 x 8200 % 192 != 0
  EXPECT_TRUE(plan_gemm_rs(ctx, 8192, 8208, 4096, w192).tma_partials);
  EXPECT_FALSE(plan_gemm_rs(ctx, 2 * 100, 8192, 4096, {}).tma_partials);  // shards < 128 rows
  // gemm_ar: the same rules, M rows instead of a shard's
  EXPECT_TRUE(plan_gemm_ar(ctx, 8192, 8192, 4096, {}).tma_partials);
  EXPECT_TRUE(plan_gemm_ar(ctx, 128, 8192, 4096, {}).tma_partials);
  EXPECT_FALSE(plan_gemm_ar(ctx, 127, 8192, 4096, {}).tma_partials);
  EXPECT_FALSE(plan_gemm_ar(h200(4), 8192, 8192, 2048, {}).tma_partials);
  EXPECT_FALSE(plan_gemm_ar(ctx, 8192, 8192, 4096, bf16).tma_partials);
}

// gemm_rs's fp32 outbox staging by TMA stores: whenever fp32 partials go through the outbox and a
// whole own tile exists, any world size. (gemm_ar stages with plain stores: never.)
TEST(FusedPlans, TmaStaging) {
  const PlanContext ctx = h200(2);
  const FusedGemmPlan rs = plan_gemm_rs(ctx, 8192, 8192, 4096, {});
  EXPECT_TRUE(rs.tma_staging) << rs.describe();
  EXPECT_NE(rs.describe().find("TMA staging"), std::string::npos) << rs.describe();
  EXPECT_TRUE(plan_gemm_rs(h200(4), 8192, 8192, 2048, {}).tma_staging);  // peers add from it
  EXPECT_FALSE(plan_gemm_rs(ctx, 2 * 100, 8192, 4096, {}).tma_staging);  // no whole own tile
  FusedGemmConfig bf16;
  bf16.bf16_partials = true;
  EXPECT_FALSE(plan_gemm_rs(ctx, 8192, 8192, 4096, bf16).tma_staging);
  const FusedGemmPlan ar = plan_gemm_ar(ctx, 8192, 8192, 4096, {});
  EXPECT_GT(ar.outbox_slots, 0) << ar.describe();
  EXPECT_FALSE(ar.tma_staging) << ar.describe();
}

// TMA sends, two ranks, one node: gemm_ar's results always, and the
// partials of the decode shapes (no outbox) through the ring's views; gemm_rs's fp32 slices whose
// staging slot is busy (or that have none), where a whole slice exists.
TEST(FusedPlans, TmaSends) {
  const PlanContext ctx = h200(2);
  const FusedGemmPlan decode = plan_gemm_ar(ctx, 128, 8192, 4096, {});
  EXPECT_EQ(decode.outbox_slots, 0) << decode.describe();
  EXPECT_TRUE(decode.tma_sends && decode.tma_partials) << decode.describe();
  EXPECT_NE(decode.describe().find("TMA sends"), std::string::npos) << decode.describe();
  const FusedGemmPlan large = plan_gemm_ar(ctx, 8192, 8192, 4096, {});
  EXPECT_TRUE(large.tma_sends && large.outbox_slots > 0) << large.describe();
  EXPECT_TRUE(plan_gemm_ar(ctx, 64, 8192, 4096, {}).tma_sends);  // results only: no views
  EXPECT_FALSE(plan_gemm_ar(ctx, 64, 8192, 4096, {}).tma_partials);
  EXPECT_FALSE(plan_gemm_ar(h200(4), 128, 8192, 2048, {}).tma_sends);
  FusedGemmConfig bf16;
  bf16.bf16_partials = true;
  EXPECT_TRUE(plan_gemm_ar(ctx, 128, 8192, 4096, bf16).tma_sends);
  EXPECT_TRUE(plan_gemm_rs(ctx, 8192, 8192, 4096, {}).tma_sends);  // gemm_rs: busy slots
  EXPECT_FALSE(plan_gemm_rs(ctx, 8192, 8192, 4096, bf16).tma_sends);
  EXPECT_FALSE(plan_gemm_rs(h200(4), 8192, 8192, 2048, {}).tma_sends);
  EXPECT_FALSE(plan_gemm_rs(ctx, 2 * 100, 8192, 4096, {}).tma_sends);  // no whole slice
  FusedGemmConfig off;  // the config's field (until measured over NVLink)
  off.tma_sends = false;
  EXPECT_FALSE(plan_gemm_ar(ctx, 128, 8192, 4096, off).tma_sends);
  EXPECT_FALSE(plan_gemm_rs(ctx, 8192, 8192, 4096, off).tma_sends);
}

// The host-only half of the input-check property test: random shapes, world sizes, node counts,
// SM budgets and configs - out-of-range values included - into every plan. Each either plans
// within the bounds (the widths the engine has, CTAs within the budget, pieces covering the
// shard) or throws kInvalidArgument naming the op and what was wrong; never anything else.
TEST(FusedPlans, RandomArgumentsPlanOrNameTheProblem) {
  std::mt19937_64 gen(std::random_device{}());
  auto pick = [&](std::initializer_list<int64_t> values) {
    return *(values.begin() + gen() % values.size());
  };
  int planned = 0, rejected = 0;
  for (int i = 0; i < 6000; ++i) {
    const int world = static_cast<int>(pick({1, 2, 3, 4, 6, 8, 9, 16}));
    const int nodes = world % 2 == 0 && gen() % 3 == 0 ? 2 : 1;
    const PlanContext ctx{world, world / nodes, static_cast<int>(pick({1, 4, 33, 66, 132, 200})),
                          nodes};
    const int64_t m = pick({-1, 0, 1, 7, 128, 129, 1000, 4096, 8192, 100000}) * pick({1, world});
    const int64_t n = pick({0, 8, 12, 64, 1000, 4096, 8200, 65536});
    const int64_t k = pick({0, 8, 9, 64, 1024, 4096, 8192});
    FusedGemmConfig c;
    c.block_n = static_cast<int>(pick({0, 0, 64, 96, 128, 192, 256, 512, -64}));
    c.comm_ctas = static_cast<int>(pick({0, 0, 1, 16, 1000, -1}));
    c.piece_rows = static_cast<int>(pick({0, 0, 1, 64, 1 << 20, -5}));
    c.sms = static_cast<int>(pick({0, 0, 4, 132, -1}));
    c.bf16_partials = gen() % 4 == 0;
    c.tma_sends = gen() % 2 == 0;
    const int op = static_cast<int>(gen() % 3);
    const char* names[] = {"ag_gemm: ", "gemm_rs: ", "gemm_ar: "};
    const std::string what = std::string(names[op]) + std::to_string(m) + "x" + std::to_string(n) +
                             "x" + std::to_string(k) + " world " + std::to_string(world) + "/" +
                             std::to_string(nodes) + " nodes";
    try {
      const FusedGemmPlan p = op == 0   ? plan_ag_gemm(ctx, m, n, k, c)
                              : op == 1 ? plan_gemm_rs(ctx, m, n, k, c)
                                        : plan_gemm_ar(ctx, m, n, k, c);
      ++planned;
      EXPECT_TRUE(p.block_n == 64 || p.block_n == 128 || p.block_n == 192 || p.block_n == 256)
          << what << ": " << p.describe();
      EXPECT_TRUE(c.block_n == 0 || p.block_n == c.block_n || (nodes > 1 && p.block_n <= 128))
          << what << ": " << p.describe();
      EXPECT_GE(p.ctas, 1) << what << ": " << p.describe();
      EXPECT_LE(p.ctas, std::max(1, std::min(ctx.sms, kMaxChannels)))
          << what << ": " << p.describe();
      if (op == 0) {
        EXPECT_GE(static_cast<int64_t>(p.pieces) * p.piece_rows, p.shard_rows) << what;
        EXPECT_LE(p.comm_ctas, p.ctas) << what;
      }
      EXPECT_LE(p.staging_bytes, p.workspace_bytes) << what << ": " << p.describe();
    } catch (const Error& e) {
      ++rejected;
      EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument) << what << ": " << e.what();
      EXPECT_NE(std::string(e.what()).find(names[op]), std::string::npos)
          << what << ": " << e.what();
    }
  }
  EXPECT_GT(planned, 500);
  EXPECT_GT(rejected, 500);
  std::printf("random plan arguments: %d planned, %d rejected with a named problem\n", planned,
              rejected);
}

TEST(FusedPlans, RejectWhatTheyCannotDo) {
  const PlanContext ctx = h200(2);
  auto message = [](auto fn) {
    try {
      fn();
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_NE(message([&] { plan_gemm_rs(ctx, 8191, 8192, 4096, {}); }).find("multiple of the world"),
            std::string::npos);
  EXPECT_NE(message([&] { plan_gemm_ar(ctx, 1024, 12, 4096, {}); }).find("N = 12"),
            std::string::npos);
  FusedGemmConfig negative;
  negative.sms = -1;
  EXPECT_NE(message([&] { plan_ag_gemm(ctx, 1024, 1024, 1024, negative); }).find("sms = -1"),
            std::string::npos);
  const PlanContext nine{9, 9, 132};
  EXPECT_NE(message([&] { plan_gemm_ar(nine, 9 * 128, 1024, 1024, {}); }).find("ranks per node"),
            std::string::npos);
  // More tiles per rank than op signals: a clear error, not a launch.
  EXPECT_NE(message([&] { plan_gemm_rs(ctx, 2 * 1048576, 65536, 64, {}); }).find("are supported"),
            std::string::npos);
}

}  // namespace
}  // namespace mk::fused
