// The rail-aligned routes of the hierarchical kernels (src/fused/rail_routes.h) at every layout
// from 1 x 1 to 4 x 8, plus a topology whose ranks are not numbered node by node: every shard
// reaches every rank once, crosses the network at most once and only along a rail, each link
// carries what docs/MULTINODE_MODEL.md counts, and the compute orders are permutations in the
// order the kernels need.
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <numeric>
#include <set>
#include <string>
#include <tuple>

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

// What every layout must satisfy.
void expect_routes_hold(const RailRoutes& routes) {
  const int world = routes.world(), g = routes.per_node(), nodes = routes.nodes();
  SCOPED_TRACE(std::to_string(nodes) + " nodes x " + std::to_string(g));
  std::set<std::pair<int, int>> nic_transfers;  // (shard's rank, receiving rank): once each
  std::vector<int> nvlink_out(world, 0);
  for (int q = 0; q < world; ++q) {
    for (int r = 0; r < world; ++r) {
      const auto path = routes.gather_path(q, r);
      if (q == r) {
        EXPECT_TRUE(path.empty());
        continue;
      }
      ASSERT_FALSE(path.empty());
      EXPECT_EQ(path.front().from, q);
      EXPECT_EQ(path.back().to, r);
      int nic_hops = 0;
      for (std::size_t i = 0; i < path.size(); ++i) {
        const auto& h = path[i];
        if (i > 0) EXPECT_EQ(h.from, path[i - 1].to);
        if (h.nic) {
          ++nic_hops;
          EXPECT_EQ(routes.local_of(h.from), routes.local_of(h.to)) << "NIC hop off the rail";
          EXPECT_NE(routes.node_of(h.from), routes.node_of(h.to));
        } else {
          EXPECT_EQ(routes.node_of(h.from), routes.node_of(h.to)) << "NVLink hop across nodes";
        }
      }
      EXPECT_EQ(nic_hops, routes.node_of(q) == routes.node_of(r) ? 0 : 1);
      // Links: the shard crosses to a node once, to its relay there, which forwards it.
      if (path.front().nic) nic_transfers.insert({q, path.front().to});
      for (const auto& h : path) {
        if (!h.nic) ++nvlink_out[h.from];
      }
    }
  }
  // Per rank, as the model counts: its own shard out over its NIC once per other node, as many
  // in; over NVLink its own shard to g - 1 peers plus each NIC arrival to g - 1 peers.
  std::vector<int> nic_out(world, 0), nic_in(world, 0);
  for (const auto& [from, to] : nic_transfers) {
    ++nic_out[from];
    ++nic_in[to];
  }
  for (int r = 0; r < world; ++r) {
    // Every NIC hop is between rail peers, and the rail peer sets are symmetric (a transport's
    // peer set must be).
    const std::vector<int> peers = routes.rail_peers(r);
    EXPECT_EQ(static_cast<int>(peers.size()), nodes - 1);
    for (const int p : peers) {
      const std::vector<int> back = routes.rail_peers(p);
      EXPECT_NE(std::find(back.begin(), back.end(), r), back.end()) << r << " <-> " << p;
    }
    for (const auto& [from, to] : nic_transfers) {
      if (from != r) continue;
      EXPECT_NE(std::find(peers.begin(), peers.end(), to), peers.end()) << r << " -> " << to;
    }
    EXPECT_EQ(nic_out[r], nodes - 1) << "rank " << r;
    EXPECT_EQ(nic_in[r], nodes - 1) << "rank " << r;
    EXPECT_EQ(nvlink_out[r], (g - 1) + (nodes - 1) * (g - 1)) << "rank " << r;
  }

  // ReduceScatter: one path per (rank, owner), mirror of the gather's, ending at the owner.
  std::map<std::pair<int, int>, int> relay_inputs;  // (relay, owner) -> local partials it gets
  for (int r = 0; r < world; ++r) {
    for (int o = 0; o < world; ++o) {
      const auto path = routes.reduce_path(r, o);
      if (r == o) {
        EXPECT_TRUE(path.empty());
        continue;
      }
      ASSERT_FALSE(path.empty());
      EXPECT_EQ(path.front().from, r);
      EXPECT_EQ(path.back().to, o);
      EXPECT_EQ(std::count_if(path.begin(), path.end(), [](const auto& h) { return h.nic; }),
                routes.node_of(r) == routes.node_of(o) ? 0 : 1);
      for (const auto& h : path) {
        if (h.nic) EXPECT_EQ(routes.local_of(h.from), routes.local_of(h.to));
      }
      if (path.size() == 2) ++relay_inputs[{path[0].to, o}];
    }
  }
  for (const auto& [key, inputs] : relay_inputs) {
    EXPECT_EQ(inputs, g - 1) << "relay " << key.first << " of owner " << key.second;
  }

  for (int r = 0; r < world; ++r) {
    std::vector<int> order = routes.gather_order(r);
    ASSERT_EQ(static_cast<int>(order.size()), world);
    EXPECT_EQ(order.front(), r);
    // The node's shards first (NVLink, one hop), then node by node with the rail peer's first.
    for (int i = 0; i < g; ++i) EXPECT_EQ(routes.node_of(order[i]), routes.node_of(r));
    for (int k = 1; k < nodes; ++k) {
      EXPECT_EQ(routes.local_of(order[k * g]), routes.local_of(r)) << "rank " << r;
      EXPECT_EQ(routes.gather_path(order[k * g], r).size(), 1u);
    }
    std::vector<int> sorted = order;
    std::sort(sorted.begin(), sorted.end());
    std::vector<int> all(world);
    std::iota(all.begin(), all.end(), 0);
    EXPECT_EQ(sorted, all);

    order = routes.reduce_order(r);
    ASSERT_EQ(static_cast<int>(order.size()), world);
    EXPECT_EQ(order.back(), r);
    sorted = order;
    std::sort(sorted.begin(), sorted.end());
    EXPECT_EQ(sorted, all);
    // Other nodes' rows first; in each node's group the rows r relays itself come last.
    for (int k = 0; k + 1 < nodes; ++k) {
      for (int i = 0; i < g; ++i) EXPECT_NE(routes.node_of(order[k * g + i]), routes.node_of(r));
      EXPECT_EQ(routes.local_of(order[k * g + g - 1]), routes.local_of(r));
    }
  }
}

TEST(RailRoutes, HoldAtEveryLayout) {
  for (int nodes : {1, 2, 3, 4}) {
    for (int per_node : {1, 2, 4, 8}) expect_routes_hold(contiguous(nodes, per_node));
  }
}

// Ranks need not be numbered node by node (hosts may interleave them).
TEST(RailRoutes, InterleavedRankNumbering) {
  const std::vector<int> node_of = {0, 1, 0, 1, 0, 1};
  const std::vector<int> local_of = {0, 0, 1, 1, 2, 2};
  const RailRoutes routes(node_of, local_of);
  expect_routes_hold(routes);
  EXPECT_EQ(routes.rank_at(1, 2), 5);
  // Shard of rank 0 (node 0, local 0) to rank 3 (node 1, local 1): NIC to rank 1 (node 1,
  // local 0), then NVLink to 3.
  const std::vector<RailRoutes::Hop> expected = {{0, 1, true}, {1, 3, false}};
  EXPECT_EQ(routes.gather_path(0, 3), expected);
  // Rank 3's partial of rank 0's rows: NVLink to rank 1 (rank 0's rail on node 1), NIC to 0.
  const std::vector<RailRoutes::Hop> reduced = {{3, 1, false}, {1, 0, true}};
  EXPECT_EQ(routes.reduce_path(3, 0), reduced);
}

// The multi-node AllGather+GEMM's signals, simulated: what every rank's side threads raise
// (ag_gemm.cuh: (1) its shard to each rail peer over the NIC, (2) to the node's other ranks over
// NVLink, (3) each rail peer's shard on to the node once it arrived) must be exactly what every
// rank waits for by gather_sources - each (pad, receiver, source, signal) word raised once, each
// wait met, and each relay's own wait met by an arrival over the NIC.
void expect_gather_signals_match(const RailRoutes& routes, int pieces) {
  using Word = std::tuple<bool, int, int, int>;  // host pad?, receiver, source, signal
  std::map<Word, int> raised;
  std::vector<Word> relay_waits;
  for (int s = 0; s < routes.world(); ++s) {
    const int base_s = routes.node_of(s) * pieces;
    for (int piece = 0; piece < pieces; ++piece) {
      for (int p : routes.rail_peers(s)) ++raised[{true, p, s, base_s + piece}];  // (1)
      for (int l = 0; l < routes.per_node(); ++l) {                               // (2)
        const int d = routes.rank_at(routes.node_of(s), l);
        if (d != s) ++raised[{false, d, s, base_s + piece}];
      }
      for (int q : routes.rail_peers(s)) {  // (3)
        const int base_q = routes.node_of(q) * pieces;
        relay_waits.push_back({true, s, q, base_q + piece});
        for (int l = 0; l < routes.per_node(); ++l) {
          const int d = routes.rank_at(routes.node_of(s), l);
          if (d != s) ++raised[{false, d, s, base_q + piece}];
        }
      }
    }
  }
  std::map<Word, int> awaited;
  for (int r = 0; r < routes.world(); ++r) {
    const std::vector<RailRoutes::ShardSource> sources = routes.gather_sources(r, pieces);
    ASSERT_EQ(static_cast<int>(sources.size()), routes.world());
    for (int q = 0; q < routes.world(); ++q) {
      if (q == r) continue;
      EXPECT_EQ(sources[q].signal_base, routes.node_of(q) * pieces);
      for (int piece = 0; piece < pieces; ++piece) {
        ++awaited[{sources[q].over_nic, r, sources[q].rank, sources[q].signal_base + piece}];
      }
    }
  }
  EXPECT_EQ(raised, awaited) << routes.nodes() << " x " << routes.per_node();
  for (const auto& [word, count] : raised) EXPECT_EQ(count, 1);
  for (const Word& w : relay_waits) EXPECT_EQ(raised.count(w), 1u);
}

TEST(RailRoutes, GatherSignalsMatchTheirWaits) {
  for (auto [nodes, per_node] : {std::pair{2, 1}, {2, 2}, {3, 2}, {2, 4}, {4, 8}, {3, 3}}) {
    expect_gather_signals_match(contiguous(nodes, per_node), 3);
  }
  // ranks not numbered node by node
  expect_gather_signals_match(RailRoutes({1, 0, 1, 0, 2, 2}, {0, 1, 1, 0, 1, 0}), 2);
}

TEST(RailRoutes, RejectsUnequalNodes) {
  EXPECT_THROW(RailRoutes({0, 0, 1}, {0, 1, 0}), Error);        // 3 ranks on 2 nodes
  EXPECT_THROW(RailRoutes({0, 0, 1, 1}, {0, 0, 0, 1}), Error);  // local 0 twice on node 0
  EXPECT_THROW(RailRoutes({}, {}), Error);
}

// GEMM + ReduceScatter across nodes (fused/reduce_routes.h, the kernel in gemm_rs_nodes.cuh):
// every rank's sends and waits, played the way the kernel's epilogue plays them, over every
// topology: each signal word is raised once and waited for once, a wait reads the region the
// matching send wrote, the waiting slice comes at a later position of the compute order than the
// one it waits for (no wait can form a cycle), and the regions fit the workspace.
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
