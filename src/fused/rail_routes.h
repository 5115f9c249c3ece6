// The rail-aligned routes of the hierarchical (multi-node) GEMM kernels - which link carries
// which shard, and the order a rank computes its tiles in - as host logic, tested on the CPU
// (tests/cpu/test_rail_routes.cpp): the schedule ag_gemm, gemm_rs and gemm_ar follow across
// nodes (docs/design/multinode.md).
//
// Ranks form N nodes of G ranks each (Topology: equal node sizes, virtual nodes included). Rank
// (node n, local l) talks to other nodes only through its rail peers (n', l): every shard crosses
// the network once, between two GPUs of the same rail, and NVLink does the rest inside a node.
//   AllGather (shard q of node n_q, local l_q, to rank r of node n_r):
//     same node:    q --NVLink--> r
//     other node:   q --NIC--> relay p = (n_r, l_q) --NVLink--> r   (no second hop when p == r)
//   ReduceScatter (rank r's partial of the rows rank o owns):
//     same node:    r --NVLink--> o
//     other node:   r --NVLink--> relay p = (n_r, l_o), which adds the node's G partials,
//                   --NIC--> o                                        (no first hop when p == r)
#pragma once

#include <vector>

#include "fused/reduce_routes.h"

namespace mk::fused {

class RailRoutes {
 public:
  // node_of[r], local_of[r]: each rank's node and index inside it (Topology::node_of,
  // local_rank_of). Throws mk::Error(kInvalidArgument) unless every node has the same number of
  // ranks, each local index once.
  RailRoutes(const std::vector<int>& node_of, const std::vector<int>& local_of);

  int world() const { return static_cast<int>(node_of_.size()); }
  int nodes() const { return nodes_; }
  int per_node() const { return per_node_; }
  int node_of(int r) const { return node_of_[r]; }
  int local_of(int r) const { return local_of_[r]; }
  int rank_at(int node, int local) const { return rank_at_[node * per_node_ + local]; }

  // One transfer of a route: from -> to, over the network (nic) or NVLink.
  struct Hop {
    int from;
    int to;
    bool nic;
    bool operator==(const Hop&) const = default;
  };
  // The ranks r exchanges with over the network: its rail peers (same local index on the other
  // nodes) - what the communicator's transport takes as TransportConfig::peers.
  std::vector<int> rail_peers(int r) const;

  // AllGather: the hops that bring shard `q` to rank `r` (empty when q == r).
  std::vector<Hop> gather_path(int q, int r) const;
  // ReduceScatter: the hops that take rank `r`'s partial of rank `o`'s rows to o (empty when
  // r == o). A hop into a relay is added there to the node's other partials before going on.
  std::vector<Hop> reduce_path(int r, int o) const;

  // AllGather + GEMM: the order in which rank r computes the row shards (rank ids): its own, its
  // node's others (ring order from r), then node by node in ring order from r's node: first the
  // rail peer's shard (r's own NIC brings it, one hop), then the rest of that node (relayed).
  std::vector<int> gather_order(int r) const;
  // GEMM + ReduceScatter: the order in which rank r computes the partials of each owner's rows:
  // node by node in ring order after r's node, first the rows it sends to another relay (the
  // relay waits for them), then the rows it relays itself (these also wait for the local
  // partials); then its node's other ranks (ring order after r); its own rows last (they wait
  // for everything).
  std::vector<int> reduce_order(int r) const;

  // Where rank r learns that the pieces of shard q have arrived (the multi-node AllGather+GEMM,
  // ag_gemm.cuh's GatherRoutes): the rank that raises their signals - the last hop's sender of
  // gather_path(q, r) - whether over the network (the host pad) or NVLink (the device pad), and
  // where their signals start: node_of(q) x pieces (a relay's own shard and the shards it relays
  // come from different nodes, so never share a signal). Indexed by q; q == r: itself, unused.
  struct ShardSource {
    int rank;
    bool over_nic;
    int signal_base;
    bool operator==(const ShardSource&) const = default;
  };
  std::vector<ShardSource> gather_sources(int r, int pieces) const;

  // GEMM + ReduceScatter across nodes: rank r's kernel argument (reduce_routes.h) - the compute
  // order (reduce_order) and the topology tables. Throws mk::Error(kInvalidArgument) beyond
  // kMaxReduceRanks ranks.
  ReduceRoutes reduce_routes(int r) const;

 private:
  std::vector<int> node_of_;
  std::vector<int> local_of_;
  std::vector<int> rank_at_;  // [node * per_node + local]
  int nodes_ = 0;
  int per_node_ = 0;
};

}  // namespace mk::fused
