// GEMM + ReduceScatter across nodes (fused/reduce_routes.h, the kernel in gemm_rs_nodes.cuh):
// every rank's sends and waits, played the way the kernel's epilogue plays them, over every
// topology: each signal word is raised once and waited for once, a wait reads the region the
// matching send wrote, the waiting slice comes at a later position of the compute order than the
// one it waits for (no wait can form a cycle), and the regions fit the workspace.
#include <gtest/gtest.h>

#include <map>
#include <tuple>
#include <vector>

#include "fused/rail_routes.h"
#include "fused/reduce_routes.h"
#include "mkernel/error.h"

namespace mk::fused {
namespace {

RailRoutes contiguous(int nodes, int per_node) {
  std::vector<int> node_of, local_of;
  for (int r = 0; r < nodes * per_node; ++r) {
    node_of.push_back(r / per_node);
    local_of.push_back(r % per_node);
  }
  return RailRoutes(node_of, local_of);
}

// A signal word and the region its data sits in: (receiver, host pad?, signal, source, region).
using Word = std::tuple<int, bool, int, int, int>;

struct Played {
  std::map<Word, int> raised;                        // word -> times raised
  std::map<Word, int> raised_at;                     // word -> position of the raising slice
  std::map<Word, std::vector<int>> awaited_at;       // word -> positions of the waiting slices
  std::map<std::tuple<int, int, int>, int> writers;  // (rank, region, slice) -> senders
};

// Rank r's epilogues over `slices` slices of each owner's rows (two per tile, `slices` / 2 tiles),
// as GemmRsAcrossNodes::store() does them: what it raises where, and what it waits for.
void play(const ReduceRoutes& routes, int slices, Played& out) {
  const int r = routes.rank, per_owner = slices / 2;
  for (int step = 0; step < routes.world; ++step) {
    const int owner = routes.order[step];
    for (int s = 0; s < slices; ++s) {
      const int position = step * per_owner + s / 2;  // a tile's two halves share a position
      switch (routes.kind(owner)) {
        case ReduceKind::kLocalPeer:
        case ReduceKind::kViaRelay: {
          const int target =
              routes.rank_at[routes.node() * routes.per_node + routes.target_local(owner)];
          const int region = routes.target_region(owner);
          const Word w{target, false, ReduceRoutes::device_signal(region, slices, s), r, region};
          ++out.raised[w];
          out.raised_at[w] = position;
          ++out.writers[{target, region, s}];
          break;
        }
        case ReduceKind::kRelayed: {
          const int region = routes.target_region(owner);
          for (int i = 0; i < routes.per_node; ++i) {
            if (i == routes.local()) continue;
            const int src = routes.rank_at[routes.node() * routes.per_node + i];
            out.awaited_at[{r, false, ReduceRoutes::device_signal(region, slices, s), src, region}]
                .push_back(position);
          }
          const Word put{owner, true, static_cast<int>(ReduceRoutes::host_signal(s)), r,
                         routes.inbound_region_at_owner(owner)};
          ++out.raised[put];
          out.raised_at[put] = position;
          ++out.writers[{owner, routes.inbound_region_at_owner(owner), s}];
          EXPECT_NE(routes.staging_region(owner), region);
          break;
        }
        case ReduceKind::kOwn: {
          for (int i = 0; i < routes.per_node; ++i) {
            if (i == routes.local()) continue;
            const int src = routes.rank_at[routes.node() * routes.per_node + i];
            out.awaited_at[{r, false, ReduceRoutes::device_signal(0, slices, s), src, 0}].push_back(
                position);
          }
          for (int m = 0; m < routes.nodes; ++m) {
            if (m == routes.node()) continue;
            out.awaited_at[{r, true, static_cast<int>(ReduceRoutes::host_signal(s)),
                            routes.rail_peer(m), routes.inbound_region(m)}]
                .push_back(position);
          }
          break;
        }
      }
    }
  }
}

void expect_reduce_protocol_holds(const RailRoutes& rails, int slices) {
  SCOPED_TRACE(std::to_string(rails.nodes()) + " x " + std::to_string(rails.per_node()));
  Played played;
  for (int r = 0; r < rails.world(); ++r) {
    const ReduceRoutes routes = rails.reduce_routes(r);
    ASSERT_EQ(routes.order[routes.world - 1], r) << "own rows last";
    // Regions: 0 own, 1 + j relay, N + j staging, 2N - 1 + j inbound, all below regions().
    for (int m = 0; m < routes.nodes; ++m) {
      if (m == routes.node()) continue;
      const int peer = routes.rail_peer(m);
      EXPECT_GE(routes.target_region(peer), 1);
      EXPECT_LT(routes.target_region(peer), routes.nodes);
      EXPECT_GE(routes.staging_region(peer), routes.nodes);
      EXPECT_LT(routes.staging_region(peer), 2 * routes.nodes - 1);
      EXPECT_GE(routes.inbound_region(m), 2 * routes.nodes - 1);
      EXPECT_LT(routes.inbound_region(m), routes.regions());
    }
    play(routes, slices, played);
  }
  std::map<Word, int> awaited;
  for (const auto& [word, positions] : played.awaited_at) awaited[word] = positions.size();
  EXPECT_EQ(played.raised, awaited) << "every signal raised once and waited for once";
  for (const auto& [word, positions] : played.awaited_at) {
    const auto raised = played.raised_at.find(word);
    if (raised == played.raised_at.end()) continue;  // reported above
    for (int position : positions) {
      EXPECT_LT(raised->second, position)
          << "rank " << std::get<0>(word) << " waits at position " << position << " for what rank "
          << std::get<3>(word) << " raises at " << raised->second;
    }
  }
  // A relay accumulator or own-rows region receives the node's other G - 1 partials; an inbound
  // region one node sum.
  const int g = rails.per_node();
  for (const auto& [where, senders] : played.writers) {
    const ReduceRoutes routes = rails.reduce_routes(std::get<0>(where));
    const int region = std::get<1>(where);
    EXPECT_EQ(senders, region < routes.nodes ? g - 1 : 1)
        << "rank " << std::get<0>(where) << " region " << region;
  }
}

TEST(ReduceRoutes, SignalsMatchTheirWaits) {
  for (auto [nodes, per_node] :
       {std::pair{2, 1}, {2, 2}, {3, 2}, {2, 4}, {4, 2}, {3, 3}, {4, 8}, {8, 8}}) {
    expect_reduce_protocol_holds(contiguous(nodes, per_node), 6);
  }
  // ranks not numbered node by node
  expect_reduce_protocol_holds(RailRoutes({1, 0, 1, 0, 2, 2}, {0, 1, 1, 0, 1, 0}), 4);
}

TEST(ReduceRoutes, KindsAndRegions) {
  const RailRoutes rails = contiguous(3, 2);       // rank = node * 2 + local
  const ReduceRoutes r2 = rails.reduce_routes(2);  // node 1, local 0
  EXPECT_EQ(r2.kind(2), ReduceKind::kOwn);
  EXPECT_EQ(r2.kind(3), ReduceKind::kLocalPeer);
  EXPECT_EQ(r2.kind(4), ReduceKind::kRelayed);   // node 2, local 0: its rail peer
  EXPECT_EQ(r2.kind(5), ReduceKind::kViaRelay);  // node 2, local 1: through rank 3
  EXPECT_EQ(r2.regions(), 7);
  EXPECT_EQ(r2.target_region(3), 0);
  EXPECT_EQ(r2.target_region(5), 1 + 0);  // node 2 is the first after node 1
  EXPECT_EQ(r2.target_region(1), 1 + 1);  // node 0 the second
  EXPECT_EQ(r2.staging_region(4), 3 + 0);
  EXPECT_EQ(r2.inbound_region_at_owner(4), 5 + 1);  // at node 2, node 1 is the second after it
  EXPECT_EQ(r2.inbound_region(0), 5 + 1);
  EXPECT_EQ(r2.rail_peer(0), 0);
  EXPECT_THROW(contiguous(65, 1).reduce_routes(0), Error);
}

}  // namespace
}  // namespace mk::fused
