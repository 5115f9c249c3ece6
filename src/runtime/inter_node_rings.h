// Internal: what a kernel needs of the communicator's inter-node path, for .cu files (the path's
// own header, runtime/inter_node.h, is host-only).
#pragma once

#include <cstdint>

#include "mkernel/communicator.h"
#include "mkernel/transport/ring.h"

namespace mk::detail {

constexpr int kMaxKernelRings = 4;

struct InterNodeRings {
  transport::CommandRing ring[kMaxKernelRings];
  int count = 0;    // rings in use (the path's, at most kMaxKernelRings)
  int buffer = -1;  // the registered id of the buffer asked for
};

// Collective on first use (creates the path, registers the buffer): the path's command rings and
// the id under which `base` - this rank's copy of a symmetric allocation of `bytes` - is
// registered (device memory; none when base is null).
InterNodeRings inter_node_rings(Communicator& comm, void* base, uint64_t bytes);

// Where a launch stages what crosses the network (InterNode::host_staging): this rank's pinned,
// device-mapped host staging of at least `bytes` (collective when it grows), or base null when
// the path stages in device memory - the kernel's workspace then holds those regions.
struct InterNodeStaging {
  uint8_t* base = nullptr;
  int buffer = -1;  // its registered id
};
InterNodeStaging inter_node_staging(Communicator& comm, uint64_t bytes);

}  // namespace mk::detail
