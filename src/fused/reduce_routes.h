// GEMM + ReduceScatter across nodes (docs/design/multinode.md section 3): for rank r
// and a slice of owner o's rows, what r does with its partial, where it adds up, and which signal
// says so - arithmetic shared by the kernel (gemm_rs_nodes.cuh) and by the CPU test that plays
// every rank's raises against every rank's waits (tests/cpu/test_rail_routes.cpp).
//
// Rank r = (node n, local l); o = (n_o, l_o). Along the rail routes (rail_routes.h):
//   kOwn        o == r: wait for the node's other partials (device pad) and the other nodes'
//               sums (host pad), add them to the own partial, store bf16.
//   kLocalPeer  n_o == n: the partial goes over NVLink into o's own-rows accumulator (region 0).
//   kViaRelay   n_o != n, l_o != l: it goes over NVLink to the relay p = (n, l_o), into p's
//               relay accumulator for node n_o (region 1 + rel(n, n_o)).
//   kRelayed    n_o != n, l_o == l: r is the relay. It waits for the node's G - 1 partials in its
//               relay accumulator, adds its own, writes the node sum (fp32) into its staging
//               region for node n_o, and puts it over its NIC into o's inbound region for node n
//               (put+signal), once o has entered the launch.
// Workspace per rank: `regions()` blocks of S x N fp32, each laid out slice by slice (see
// gemm_rs.cuh's slice_offset, so that a slice is one contiguous block and one put):
//   0                 own rows: the node's other partials (added, or stored by the one peer)
//   1 + j             relay accumulator for node n + 1 + j (mod N)
//   N + j             staging: the node sum sent to node n + 1 + j
//   2N - 1 + j        inbound: the node sum that came from node n + 1 + j
// (j = rel(n, m) = (m - n - 1) mod N, 0 .. N - 2.) Signals, per slice s of a shard (two per tile):
// device pad kOp + region x slices + s for regions 0 and 1 + j (raised by the local senders), host
// pad 1 + s (raised by the relay's put, one relay per source node; 0 is "entered").
#pragma once

#include <cstdint>

#include "mkernel/host_device.h"

namespace mk::fused {

constexpr int kMaxReduceRanks = 64;
// The widest tile of gemm_rs / gemm_ar across nodes: wider ones spill in the relay's and the
// owner's epilogues (across_nodes.cuh; the plans cap it).
constexpr int kMaxReduceBlockN = 128;
constexpr uint32_t kReduceEntrySignal = 0;   // host pad: "my rail peer entered this launch"
constexpr uint32_t kReduceSliceSignal0 = 1;  // host pad: node sums from here on

enum class ReduceKind { kOwn, kLocalPeer, kViaRelay, kRelayed };

struct ReduceRoutes {
  int16_t order[kMaxReduceRanks];  // owners in compute order (RailRoutes::reduce_order)
  int8_t node_of[kMaxReduceRanks];
  int8_t local_of[kMaxReduceRanks];
  int16_t rank_at[kMaxReduceRanks];  // [node * per_node + local]
  int world;
  int nodes;
  int per_node;
  int rank;

  MK_HOST_DEVICE int node() const { return node_of[rank]; }
  MK_HOST_DEVICE int local() const { return local_of[rank]; }
  MK_HOST_DEVICE int regions() const { return 3 * nodes - 2; }
  // Node m as seen from node n: 0 .. nodes - 2 (m != n).
  MK_HOST_DEVICE int rel(int n, int m) const { return (m - n - 1 + nodes) % nodes; }

  MK_HOST_DEVICE ReduceKind kind(int owner) const {
    if (owner == rank) return ReduceKind::kOwn;
    if (node_of[owner] == node()) return ReduceKind::kLocalPeer;
    return local_of[owner] == local() ? ReduceKind::kRelayed : ReduceKind::kViaRelay;
  }
  // The local rank (index in the node) whose workspace receives r's partial of owner's rows
  // (kLocalPeer: the owner; kViaRelay: the relay), and the region there.
  MK_HOST_DEVICE int target_local(int owner) const { return local_of[owner]; }
  MK_HOST_DEVICE int target_region(int owner) const {
    return node_of[owner] == node() ? 0 : 1 + rel(node(), node_of[owner]);
  }
  // kRelayed: the staging region of the node sum for owner's node, and the inbound region at
  // the owner that it goes to.
  MK_HOST_DEVICE int staging_region(int owner) const { return nodes + rel(node(), node_of[owner]); }
  MK_HOST_DEVICE int inbound_region_at_owner(int owner) const {
    return 2 * nodes - 1 + rel(node_of[owner], node());
  }
  // kOwn: the inbound region for node m's sum, and the rank that sends it (r's rail peer there).
  MK_HOST_DEVICE int inbound_region(int m) const { return 2 * nodes - 1 + rel(node(), m); }
  MK_HOST_DEVICE int rail_peer(int m) const { return rank_at[m * per_node + local()]; }
  // Op-signal offsets (add SignalId::kOp) of slice s in a region's numbering (0 or 1 + j).
  MK_HOST_DEVICE static int device_signal(int region, int slices, int slice) {
    return region * slices + slice;
  }
  MK_HOST_DEVICE static uint32_t host_signal(int slice) {
    return kReduceSliceSignal0 + static_cast<uint32_t>(slice);
  }
};

}  // namespace mk::fused
