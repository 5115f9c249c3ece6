#include "mkernel/topology.h"

#include <unistd.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <fstream>
#include <functional>
#include <map>
#include <string>
#include <unordered_map>
#include <utility>

#include "mkernel/error.h"

namespace mk {
namespace {

[[noreturn]] void fail(ErrorCode code, const std::string& message) {
  throw Error(code, "compute_topology: " + message);
}

std::string rank_range(int first, int count) {
  return count == 1 ? "rank " + std::to_string(first)
                    : "ranks " + std::to_string(first) + "-" + std::to_string(first + count - 1);
}

// The ranks_per_node every rank reported (0 = nodes are hosts); they must all agree.
int agreed_ranks_per_node(const std::vector<RankInfo>& infos) {
  const int k = infos[0].ranks_per_node;
  for (std::size_t r = 0; r < infos.size(); ++r) {
    if (infos[r].ranks_per_node < 0) {
      fail(ErrorCode::kInvalidArgument,
           "rank " + std::to_string(r) + " has ranks_per_node " +
               std::to_string(infos[r].ranks_per_node) +
               " (MKERNEL_GPUS_PER_NODE); expected >= 0, 0 meaning one node per host");
    }
    if (infos[r].ranks_per_node != k) {
      fail(ErrorCode::kInvalidArgument,
           "ranks disagree on ranks_per_node (MKERNEL_GPUS_PER_NODE): rank 0 has " +
               std::to_string(k) + " but rank " + std::to_string(r) + " has " +
               std::to_string(infos[r].ranks_per_node) + "; every rank must use the same value");
    }
  }
  return k;
}

// node_of for virtual nodes of k consecutive ranks, each within one host.
std::vector<int> virtual_nodes(const std::vector<RankInfo>& infos, int k) {
  const int world = static_cast<int>(infos.size());
  if (world % k != 0) {
    fail(ErrorCode::kInvalidArgument, "world size " + std::to_string(world) +
                                          " is not divisible by ranks_per_node " +
                                          std::to_string(k) + " (MKERNEL_GPUS_PER_NODE)");
  }
  std::vector<int> node_of(world);
  for (int r = 0; r < world; ++r) {
    const int node = r / k;
    const int first = node * k;
    if (infos[r].host_id != infos[first].host_id) {
      fail(ErrorCode::kInvalidArgument,
           "virtual node " + std::to_string(node) + " (" + rank_range(first, k) +
               ") spans two hosts: rank " + std::to_string(first) + " and rank " +
               std::to_string(r) + " are on different machines; ranks_per_node " +
               std::to_string(k) + " (MKERNEL_GPUS_PER_NODE) must group ranks of one host");
    }
    node_of[r] = node;
  }
  return node_of;
}

// node_of with one node per distinct host, numbered in the order of each host's first rank.
std::vector<int> host_nodes(const std::vector<RankInfo>& infos) {
  std::unordered_map<uint64_t, int> node_of_host;
  std::vector<int> node_of(infos.size());
  for (std::size_t r = 0; r < infos.size(); ++r) {
    const int next = static_cast<int>(node_of_host.size());
    node_of[r] = node_of_host.try_emplace(infos[r].host_id, next).first->second;
  }
  return node_of;
}

// Ranks per node; mkernel needs the same count on every node.
int equal_node_size(const std::vector<int>& node_of, int num_nodes) {
  std::vector<int> size(num_nodes, 0);
  std::vector<int> first_rank(num_nodes, -1);
  for (int r = 0; r < static_cast<int>(node_of.size()); ++r) {
    if (size[node_of[r]]++ == 0) first_rank[node_of[r]] = r;
  }
  for (int n = 1; n < num_nodes; ++n) {
    if (size[n] != size[0]) {
      fail(ErrorCode::kUnsupported,
           "nodes have unequal sizes: node 0 (the host of rank 0) has " + std::to_string(size[0]) +
               " ranks but node " + std::to_string(n) + " (the host of rank " +
               std::to_string(first_rank[n]) + ") has " + std::to_string(size[n]) +
               "; mkernel needs the same number of ranks on every node");
    }
  }
  return size[0];
}

using GpuKey = std::pair<uint64_t, std::array<uint8_t, 16>>;  // (host, device uuid)

GpuKey gpu_of(const RankInfo& info) {
  GpuKey key{info.host_id, {}};
  std::memcpy(key.second.data(), info.device_uuid, key.second.size());
  return key;
}

}  // namespace

std::vector<int> Topology::rail_peers() const {
  std::vector<int> peers;
  for (int r = 0; r < world_size; ++r) {
    if (node_of[r] != node && local_rank_of[r] == local_rank) peers.push_back(r);
  }
  return peers;
}

Topology compute_topology(int rank, const std::vector<RankInfo>& infos) {
  const int world = static_cast<int>(infos.size());
  if (world < 1) fail(ErrorCode::kInvalidArgument, "no ranks; expected at least one RankInfo");
  if (rank < 0 || rank >= world) {
    fail(ErrorCode::kInvalidArgument, "rank " + std::to_string(rank) +
                                          " is out of range; expected 0 <= rank < " +
                                          std::to_string(world));
  }

  Topology t;
  t.rank = rank;
  t.world_size = world;
  const int k = agreed_ranks_per_node(infos);
  t.node_of = k > 0 ? virtual_nodes(infos, k) : host_nodes(infos);
  t.num_nodes = *std::max_element(t.node_of.begin(), t.node_of.end()) + 1;
  t.local_size = equal_node_size(t.node_of, t.num_nodes);
  t.node = t.node_of[rank];

  std::vector<int> next_local(t.num_nodes, 0);
  t.local_rank_of.resize(world);
  for (int r = 0; r < world; ++r) {
    t.local_rank_of[r] = next_local[t.node_of[r]]++;
    if (t.node_of[r] == t.node) t.node_ranks.push_back(r);
  }
  t.local_rank = t.local_rank_of[rank];

  const RankInfo& me = infos[rank];
  t.same_process.resize(world);
  for (int r = 0; r < world; ++r) {
    t.same_process[r] = infos[r].host_id == me.host_id && infos[r].pid == me.pid;
  }

  std::map<GpuKey, int> ranks_per_gpu;
  for (const RankInfo& info : infos) ++ranks_per_gpu[gpu_of(info)];
  t.ranks_on_my_device = ranks_per_gpu[gpu_of(me)];
  t.max_ranks_per_device = 0;
  for (const auto& [gpu, count] : ranks_per_gpu) {
    t.max_ranks_per_device = std::max(t.max_ranks_per_device, count);
  }
  t.min_sm_count = std::min_element(infos.begin(), infos.end(), [](const auto& a, const auto& b) {
                     return a.sm_count < b.sm_count;
                   })->sm_count;
  return t;
}

uint64_t this_host_id() {
  char host[256] = {};
  gethostname(host, sizeof(host) - 1);
  std::string boot_id;
  std::ifstream("/proc/sys/kernel/random/boot_id") >> boot_id;
  return std::hash<std::string>{}(std::string(host) + "/" + boot_id);
}

}  // namespace mk
