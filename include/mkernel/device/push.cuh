// mkernel/device/push.cuh - a kernel's command to the inter-node proxy, within the time limit.
#pragma once

#include <cstdint>

#include "mkernel/device/sync.cuh"
#include "mkernel/device_comm.h"
#include "mkernel/transport/ring.h"

namespace mk::dev {

// Pushes `c` into `ring`, waiting while the ring is full for at most the communicator's time
// limit (false: the ring broke or the limit passed; the proxy or the waits then report).
__device__ __forceinline__ bool push_command(const DeviceComm& comm,
                                             const transport::CommandRing& ring,
                                             const transport::Command& c) {
  const uint64_t start = global_timer_ns();
  const uint64_t limit = comm.timeout_ns;
  return ring.push(c, [&](uint64_t) { return limit == 0 || global_timer_ns() - start < limit; })
             .status == transport::PushStatus::kOk;
}

}  // namespace mk::dev
