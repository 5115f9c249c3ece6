// Rail-aligned routes of the hierarchical kernels (rail_routes.h).
#include "fused/rail_routes.h"

#include <algorithm>
#include <string>

#include "mkernel/error.h"

namespace mk::fused {
namespace {

[[noreturn]] void invalid(const std::string& what) {
  throw Error(ErrorCode::kInvalidArgument, "rail routes: " + what);
}

}  // namespace

RailRoutes::RailRoutes(const std::vector<int>& node_of, const std::vector<int>& local_of)
    : node_of_(node_of), local_of_(local_of) {
  const int world = static_cast<int>(node_of.size());
  if (world == 0 || local_of.size() != node_of.size()) {
    invalid("node_of has " + std::to_string(node_of.size()) + " ranks and local_of " +
            std::to_string(local_of.size()) + "; expected the same, at least one");
  }
  nodes_ = *std::max_element(node_of.begin(), node_of.end()) + 1;
  if (world % nodes_ != 0) {
    invalid(std::to_string(world) + " ranks on " + std::to_string(nodes_) +
            " nodes: nodes of unequal size");
  }
  per_node_ = world / nodes_;
  rank_at_.assign(static_cast<std::size_t>(world), -1);
  for (int r = 0; r < world; ++r) {
    const int n = node_of[r], l = local_of[r];
    if (n < 0 || l < 0 || l >= per_node_ || rank_at_[n * per_node_ + l] >= 0) {
      invalid("rank " + std::to_string(r) + " at node " + std::to_string(n) + ", local " +
              std::to_string(l) + ": out of range or taken (" + std::to_string(per_node_) +
              " ranks per node)");
    }
    rank_at_[n * per_node_ + l] = r;
  }
}

std::vector<int> RailRoutes::rail_peers(int r) const {
  std::vector<int> peers;
  for (int node = 0; node < nodes_; ++node) {
    if (node != node_of(r)) peers.push_back(rank_at(node, local_of(r)));
  }
  return peers;
}

std::vector<RailRoutes::ShardSource> RailRoutes::gather_sources(int r, int pieces) const {
  std::vector<ShardSource> sources;
  for (int q = 0; q < world(); ++q) {
    const std::vector<Hop> path = gather_path(q, r);
    sources.push_back({path.empty() ? q : path.back().from, !path.empty() && path.back().nic,
                       node_of(q) * pieces});
  }
  return sources;
}

std::vector<RailRoutes::Hop> RailRoutes::gather_path(int q, int r) const {
  if (q == r) return {};
  if (node_of(q) == node_of(r)) return {{q, r, false}};
  const int relay = rank_at(node_of(r), local_of(q));
  if (relay == r) return {{q, r, true}};
  return {{q, relay, true}, {relay, r, false}};
}

std::vector<RailRoutes::Hop> RailRoutes::reduce_path(int r, int o) const {
  if (r == o) return {};
  if (node_of(r) == node_of(o)) return {{r, o, false}};
  const int relay = rank_at(node_of(r), local_of(o));
  if (relay == r) return {{r, o, true}};
  return {{r, relay, false}, {relay, o, true}};
}

std::vector<int> RailRoutes::gather_order(int r) const {
  const int n = node_of(r), l = local_of(r);
  std::vector<int> order{r};
  for (int d = 1; d < per_node_; ++d) order.push_back(rank_at(n, (l + d) % per_node_));
  for (int dn = 1; dn < nodes_; ++dn) {
    const int node = (n + dn) % nodes_;
    for (int d = 0; d < per_node_; ++d) order.push_back(rank_at(node, (l + d) % per_node_));
  }
  return order;
}

std::vector<int> RailRoutes::reduce_order(int r) const {
  const int n = node_of(r), l = local_of(r);
  std::vector<int> order;
  for (int dn = 1; dn < nodes_; ++dn) {
    const int node = (n + dn) % nodes_;
    for (int d = 1; d < per_node_; ++d) order.push_back(rank_at(node, (l + d) % per_node_));
    order.push_back(rank_at(node, l));  // relayed by r itself
  }
  for (int d = 1; d < per_node_; ++d) order.push_back(rank_at(n, (l + d) % per_node_));
  order.push_back(r);
  return order;
}

ReduceRoutes RailRoutes::reduce_routes(int r) const {
  if (world() > kMaxReduceRanks) {
    throw Error(ErrorCode::kInvalidArgument, "reduce routes: at most " +
                                                 std::to_string(kMaxReduceRanks) + " ranks; got " +
                                                 std::to_string(world()));
  }
  ReduceRoutes routes{};
  routes.world = world();
  routes.nodes = nodes_;
  routes.per_node = per_node_;
  routes.rank = r;
  const std::vector<int> order = reduce_order(r);
  for (int i = 0; i < world(); ++i) {
    routes.order[i] = static_cast<int16_t>(order[i]);
    routes.node_of[i] = static_cast<int8_t>(node_of_[i]);
    routes.local_of[i] = static_cast<int8_t>(local_of_[i]);
    routes.rank_at[i] = static_cast<int16_t>(rank_at_[i]);
  }
  return routes;
}

}  // namespace mk::fused
