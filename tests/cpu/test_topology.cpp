// compute_topology: nodes by host or virtual nodes, shared GPUs, and every inconsistent input.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "mkernel/error.h"
#include "mkernel/topology.h"

namespace mk {
namespace {

constexpr int kH200Sms = 132;

// A rank on host `host`, in process `pid`, using physical GPU `gpu` of that host.
RankInfo info(uint64_t host, int pid, int gpu, int sm_count = kH200Sms, int ranks_per_node = 0) {
  RankInfo i;
  i.host_id = host;
  i.pid = pid;
  i.device = gpu;
  i.device_uuid[0] = static_cast<uint8_t>(gpu);
  i.device_uuid[15] = 0xa5;
  i.sm_count = sm_count;
  i.ranks_per_node = ranks_per_node;
  return i;
}

// `ranks_per_host` ranks on each of `hosts` hosts, one process and one GPU per rank.
std::vector<RankInfo> cluster(int hosts, int ranks_per_host, int ranks_per_node = 0) {
  std::vector<RankInfo> infos;
  for (int h = 0; h < hosts; ++h) {
    for (int g = 0; g < ranks_per_host; ++g) {
      infos.push_back(info(1000 + h, 100 + g, g, kH200Sms, ranks_per_node));
    }
  }
  return infos;
}

// Every rank must derive the same global picture (node_of, local_rank_of, sm budget).
void expect_consistent(const std::vector<RankInfo>& infos) {
  const Topology t0 = compute_topology(0, infos);
  for (int r = 0; r < static_cast<int>(infos.size()); ++r) {
    const Topology t = compute_topology(r, infos);
    EXPECT_EQ(t.node_of, t0.node_of) << "rank " << r;
    EXPECT_EQ(t.local_rank_of, t0.local_rank_of) << "rank " << r;
    EXPECT_EQ(t.num_nodes, t0.num_nodes) << "rank " << r;
    EXPECT_EQ(t.local_size, t0.local_size) << "rank " << r;
    EXPECT_EQ(t.sm_budget(), t0.sm_budget()) << "rank " << r;
    EXPECT_EQ(t.node, t.node_of[r]);
    EXPECT_EQ(t.local_rank, t.local_rank_of[r]);
    ASSERT_EQ(static_cast<int>(t.node_ranks.size()), t.local_size);
    EXPECT_EQ(t.node_ranks[t.local_rank], r);
    for (int i = 0; i < t.local_size; ++i) EXPECT_EQ(t.node_of[t.node_ranks[i]], t.node);
  }
}

// Runs compute_topology expecting an mk::Error of `code` whose message contains every fragment.
void expect_error(const std::vector<RankInfo>& infos, ErrorCode code,
                  const std::vector<std::string>& fragments, int rank = 0) {
  try {
    compute_topology(rank, infos);
    ADD_FAILURE() << "no error; expected one containing '" << fragments.at(0) << "'";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), code) << e.what();
    for (const std::string& f : fragments) {
      EXPECT_NE(std::string(e.what()).find(f), std::string::npos)
          << "message '" << e.what() << "' lacks '" << f << "'";
    }
  }
}

TEST(Topology, OneHostEightRanks) {
  const std::vector<RankInfo> infos = cluster(1, 8);
  const Topology t = compute_topology(5, infos);
  EXPECT_EQ(t.rank, 5);
  EXPECT_EQ(t.world_size, 8);
  EXPECT_EQ(t.num_nodes, 1);
  EXPECT_EQ(t.node, 0);
  EXPECT_EQ(t.local_size, 8);
  EXPECT_EQ(t.local_rank, 5);
  EXPECT_EQ(t.node_ranks, (std::vector<int>{0, 1, 2, 3, 4, 5, 6, 7}));
  EXPECT_EQ(t.same_process,
            (std::vector<bool>{false, false, false, false, false, true, false, false}));
  EXPECT_EQ(t.ranks_on_my_device, 1);
  EXPECT_EQ(t.max_ranks_per_device, 1);
  EXPECT_EQ(t.min_sm_count, kH200Sms);
  EXPECT_EQ(t.sm_budget(), kH200Sms);
  for (int r = 0; r < 8; ++r) EXPECT_TRUE(t.is_local(r));
  expect_consistent(infos);
}

TEST(Topology, SingleRank) {
  const Topology t = compute_topology(0, {info(1, 1, 0)});
  EXPECT_EQ(t.world_size, 1);
  EXPECT_EQ(t.num_nodes, 1);
  EXPECT_EQ(t.local_size, 1);
  EXPECT_EQ(t.node_ranks, std::vector<int>{0});
  EXPECT_EQ(t.sm_budget(), kH200Sms);
}

TEST(Topology, NodesAreHostsNumberedByFirstRank) {
  // Ranks alternate between two hosts; host 77 holds rank 0, so it is node 0.
  std::vector<RankInfo> infos;
  for (int r = 0; r < 6; ++r) infos.push_back(info(r % 2 == 0 ? 77 : 11, 100 + r, r / 2));
  const Topology t = compute_topology(3, infos);
  EXPECT_EQ(t.num_nodes, 2);
  EXPECT_EQ(t.local_size, 3);
  EXPECT_EQ(t.node_of, (std::vector<int>{0, 1, 0, 1, 0, 1}));
  EXPECT_EQ(t.local_rank_of, (std::vector<int>{0, 0, 1, 1, 2, 2}));
  EXPECT_EQ(t.node, 1);
  EXPECT_EQ(t.local_rank, 1);
  EXPECT_EQ(t.node_ranks, (std::vector<int>{1, 3, 5}));
  EXPECT_TRUE(t.is_local(5));
  EXPECT_FALSE(t.is_local(4));
  expect_consistent(infos);
}

TEST(Topology, TwoHostsOfEight) {
  const std::vector<RankInfo> infos = cluster(2, 8);
  const Topology t = compute_topology(12, infos);
  EXPECT_EQ(t.num_nodes, 2);
  EXPECT_EQ(t.node, 1);
  EXPECT_EQ(t.local_rank, 4);
  EXPECT_EQ(t.node_ranks, (std::vector<int>{8, 9, 10, 11, 12, 13, 14, 15}));
  // Same pid and GPU index on another host is another process and another GPU.
  EXPECT_FALSE(t.same_process[4]);
  EXPECT_TRUE(t.same_process[12]);
  EXPECT_EQ(t.ranks_on_my_device, 1);
  EXPECT_EQ(t.max_ranks_per_device, 1);
  expect_consistent(infos);
}

TEST(Topology, VirtualNodesSplitOneHost) {
  const std::vector<RankInfo> infos = cluster(1, 8, /*ranks_per_node=*/4);
  const Topology t = compute_topology(5, infos);
  EXPECT_EQ(t.num_nodes, 2);
  EXPECT_EQ(t.local_size, 4);
  EXPECT_EQ(t.node_of, (std::vector<int>{0, 0, 0, 0, 1, 1, 1, 1}));
  EXPECT_EQ(t.local_rank_of, (std::vector<int>{0, 1, 2, 3, 0, 1, 2, 3}));
  EXPECT_EQ(t.node, 1);
  EXPECT_EQ(t.local_rank, 1);
  EXPECT_EQ(t.node_ranks, (std::vector<int>{4, 5, 6, 7}));
  EXPECT_FALSE(t.is_local(3));
  expect_consistent(infos);
}

TEST(Topology, VirtualNodesWithinTwoHosts) {
  const std::vector<RankInfo> infos = cluster(2, 4, /*ranks_per_node=*/2);
  const Topology t = compute_topology(6, infos);
  EXPECT_EQ(t.num_nodes, 4);
  EXPECT_EQ(t.local_size, 2);
  EXPECT_EQ(t.node, 3);
  EXPECT_EQ(t.node_ranks, (std::vector<int>{6, 7}));
  expect_consistent(infos);
}

TEST(Topology, VirtualNodeOfWholeWorldIsOneNode) {
  const std::vector<RankInfo> infos = cluster(1, 4, /*ranks_per_node=*/4);
  const Topology t = compute_topology(2, infos);
  EXPECT_EQ(t.num_nodes, 1);
  EXPECT_EQ(t.local_size, 4);
}

TEST(Topology, RanksSharingGpusInOneProcess) {
  // Four ranks as threads of one process on two GPUs: ranks 0, 1 on GPU 0 and ranks 2, 3 on GPU 1.
  std::vector<RankInfo> infos;
  for (int r = 0; r < 4; ++r) infos.push_back(info(5, 4242, r / 2));
  const Topology t = compute_topology(3, infos);
  EXPECT_EQ(t.same_process, (std::vector<bool>{true, true, true, true}));
  EXPECT_EQ(t.ranks_on_my_device, 2);
  EXPECT_EQ(t.max_ranks_per_device, 2);
  EXPECT_EQ(t.sm_budget(), kH200Sms / 2);
  expect_consistent(infos);
}

TEST(Topology, UnevenGpuSharingBudgetsForTheBusiestGpu) {
  // Ranks 0-2 share GPU 0 (a 114-SM part), rank 3 has GPU 1 alone.
  std::vector<RankInfo> infos = {info(5, 1, 0, 114), info(5, 2, 0, 114), info(5, 3, 0, 114),
                                 info(5, 4, 1, kH200Sms)};
  const Topology t3 = compute_topology(3, infos);
  EXPECT_EQ(t3.ranks_on_my_device, 1);
  EXPECT_EQ(t3.max_ranks_per_device, 3);
  EXPECT_EQ(t3.min_sm_count, 114);
  EXPECT_EQ(t3.sm_budget(), 114 / 3);
  EXPECT_EQ(compute_topology(1, infos).ranks_on_my_device, 3);
  expect_consistent(infos);
}

TEST(Topology, SameUuidOnAnotherHostIsAnotherGpu) {
  // Both hosts report GPU uuids that collide (e.g. not filled in); they are still distinct GPUs.
  std::vector<RankInfo> infos = {info(1, 10, 0), info(2, 10, 0)};
  const Topology t = compute_topology(0, infos);
  EXPECT_EQ(t.ranks_on_my_device, 1);
  EXPECT_EQ(t.max_ranks_per_device, 1);
  EXPECT_EQ(t.same_process, (std::vector<bool>{true, false}));
}

TEST(TopologyErrors, RankOutOfRange) {
  expect_error(cluster(1, 2), ErrorCode::kInvalidArgument, {"rank 2", "0 <= rank < 2"}, 2);
  expect_error(cluster(1, 2), ErrorCode::kInvalidArgument, {"rank -1"}, -1);
}

TEST(TopologyErrors, NoRanks) { expect_error({}, ErrorCode::kInvalidArgument, {"no ranks"}); }

TEST(TopologyErrors, RanksDisagreeOnRanksPerNode) {
  std::vector<RankInfo> infos = cluster(1, 8, 4);
  infos[5].ranks_per_node = 2;
  expect_error(infos, ErrorCode::kInvalidArgument,
               {"disagree", "MKERNEL_GPUS_PER_NODE", "rank 0 has 4", "rank 5 has 2"});
  infos[5].ranks_per_node = 0;  // one rank without the override is a disagreement too
  expect_error(infos, ErrorCode::kInvalidArgument, {"rank 5 has 0"});
}

TEST(TopologyErrors, NegativeRanksPerNode) {
  expect_error(cluster(1, 2, -1), ErrorCode::kInvalidArgument, {"ranks_per_node -1", ">= 0"});
}

TEST(TopologyErrors, WorldNotDivisibleByRanksPerNode) {
  expect_error(cluster(1, 6, 4), ErrorCode::kInvalidArgument,
               {"world size 6", "not divisible", "ranks_per_node 4"});
}

TEST(TopologyErrors, VirtualNodeSpanningTwoHosts) {
  // Hosts of 3 ranks each, virtual nodes of 2: node 1 = ranks 2-3 straddles the hosts.
  expect_error(cluster(2, 3, 2), ErrorCode::kInvalidArgument,
               {"virtual node 1", "spans two hosts", "rank 2 and rank 3"});
}

TEST(TopologyErrors, HostsOfUnequalSize) {
  std::vector<RankInfo> infos = cluster(1, 4);
  infos.push_back(info(2000, 1, 0));
  infos.push_back(info(2000, 2, 1));
  expect_error(infos, ErrorCode::kUnsupported,
               {"unequal sizes", "node 0", "has 4 ranks", "node 1", "rank 4", "has 2"});
}

}  // namespace
}  // namespace mk
