// mkernel/topology.h - who is where: nodes, local ranks, shared GPUs. Pure host logic.
#pragma once

#include <cstdint>
#include <vector>

namespace mk {

// What each rank tells the others when a communicator is created (exchanged by allgather,
// so the layout is fixed-size and trivially copyable).
struct RankInfo {
  uint64_t host_id = 0;          // hash of hostname + boot id: equal <=> same machine
  int32_t pid = 0;               // process id (same host_id and pid <=> same process)
  int32_t device = 0;            // CUDA ordinal in that process (informational)
  uint8_t device_uuid[16] = {};  // identifies the physical GPU across processes
  int32_t sm_count = 0;          // multiprocessors of that GPU
  int32_t ranks_per_node = 0;    // the rank's MKERNEL_GPUS_PER_NODE override, 0 = by host
};

struct Topology {
  int rank = 0;
  int world_size = 1;
  int node = 0;  // index of this rank's (possibly virtual) node, ordered by first rank
  int num_nodes = 1;
  int local_rank = 0;              // index inside the node
  int local_size = 1;              // ranks in this node (equal on every node)
  std::vector<int> node_of;        // [world_size] node of each rank
  std::vector<int> local_rank_of;  // [world_size] local rank of each rank inside its node
  std::vector<int> node_ranks;     // [local_size] global ranks of this node, by local rank
  std::vector<bool> same_process;  // [world_size] rank lives in this process
  int ranks_on_my_device = 1;      // ranks (this one included) that share this rank's GPU
  int max_ranks_per_device = 1;    // the largest such count over all ranks
  int min_sm_count = 0;            // smallest SM count over all ranks' GPUs

  // SMs one persistent kernel of this communicator may occupy so that the kernels of every rank
  // sharing a GPU are co-resident; equal on all ranks, so grid sizes agree across ranks.
  int sm_budget() const { return min_sm_count / max_ranks_per_device; }
  bool is_local(int r) const { return node_of[r] == node; }
  // The ranks with this rank's local index on the other nodes, ascending: the only ranks its
  // inter-node path talks to (every byte crosses the network between two GPUs of one rail).
  std::vector<int> rail_peers() const;
};

// Identifies this machine: a hash of the host name and the kernel's boot id (equal <=> same host).
uint64_t this_host_id();

// Builds the topology of `rank` from everyone's RankInfo (indexed by rank). Nodes are the
// distinct hosts, unless ranks_per_node (from MKERNEL_GPUS_PER_NODE) splits the ranks into
// virtual nodes of that many consecutive ranks, each on one host. Throws mk::Error on
// inconsistent input (ranks disagree on the override, nodes of unequal size, a virtual node
// spanning hosts, world not divisible by ranks_per_node).
Topology compute_topology(int rank, const std::vector<RankInfo>& infos);

}  // namespace mk
