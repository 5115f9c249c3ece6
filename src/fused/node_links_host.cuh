// Host side of fused/across_nodes.cuh, for the fused GEMMs' .cu files: the NodeLinks a launch
// across nodes passes its kernel.
#pragma once

#include <algorithm>

#include "fused/across_nodes.cuh"
#include "fused/rail_routes.h"
#include "mkernel/communicator.h"
#include "runtime/inter_node_rings.h"

namespace mk::fused {

// This rank's rail routes, the communicator's inter-node rings, and the id under which the
// workspace's symmetric allocation is registered with the inter-node path (collective on first
// use: it creates the path and registers the allocation).
inline NodeLinks node_links(Communicator& comm, const SymmetricRange& ws) {
  const Topology& topo = comm.topology();
  NodeLinks links{};
  links.routes = RailRoutes(topo.node_of, topo.local_rank_of).reduce_routes(topo.rank);
  const detail::InterNodeRings path = detail::inter_node_rings(
      comm, reinterpret_cast<void*>(ws.host_peers[topo.local_rank]), ws.size);
  links.num_rings = std::min(path.count, kMaxReduceRings);
  for (int i = 0; i < links.num_rings; ++i) links.rings[i] = path.ring[i];
  links.ws_buffer = path.buffer;
  links.ws_offset = ws.offset;
  return links;
}

}  // namespace mk::fused
