// Host side of fused/across_nodes.cuh, for the fused GEMMs' .cu files: the NodeLinks a launch
// across nodes passes its kernel.
#pragma once

#include <algorithm>

#include "fused/across_nodes.cuh"
#include "fused/rail_routes.h"
#include "mkernel/communicator.h"
#include "runtime/inter_node_rings.h"

namespace mk::fused {

// This rank's rail routes, the communicator's inter-node rings, and where the transfer regions
// live. The workspace `ws` is `regions` regions of `region_bytes`: the node's first (routes.nodes
// of them), then the transfer regions - used there when the path stages in device memory (the
// workspace's allocation is then registered with the path), else the path's host staging holds
// them (InterNode::host_staging). Collective on first use and when the host staging grows.
inline NodeLinks node_links(Communicator& comm, const SymmetricRange& ws, uint64_t region_bytes,
                            int regions) {
  const Topology& topo = comm.topology();
  NodeLinks links{};
  links.routes = RailRoutes(topo.node_of, topo.local_rank_of).reduce_routes(topo.rank);
  const uint64_t node_bytes = region_bytes * static_cast<uint64_t>(links.routes.nodes);
  const detail::InterNodeStaging staging = detail::inter_node_staging(
      comm, region_bytes * static_cast<uint64_t>(regions - links.routes.nodes));
  const bool in_workspace = staging.base == nullptr;
  uint8_t* const my_ws = reinterpret_cast<uint8_t*>(ws.host_peers[topo.local_rank]);
  const detail::InterNodeRings path =
      detail::inter_node_rings(comm, in_workspace ? my_ws : nullptr, ws.size);
  links.num_rings = std::min(path.count, kMaxReduceRings);
  for (int i = 0; i < links.num_rings; ++i) links.rings[i] = path.ring[i];
  if (in_workspace) {
    links.xfer = my_ws + ws.offset + node_bytes;
    links.xfer_buffer = path.buffer;
    links.xfer_offset = ws.offset + node_bytes;
  } else {
    links.xfer = staging.base;
    links.xfer_buffer = staging.buffer;
    links.xfer_offset = 0;
  }
  return links;
}

}  // namespace mk::fused
