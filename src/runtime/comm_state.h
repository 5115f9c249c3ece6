// Internal: what a Communicator owns. Shared by communicator.cpp, symmetric.cpp and the ops.
#pragma once

#include <cuda.h>
#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "mkernel/bootstrap.h"
#include "mkernel/device_comm.h"
#include "mkernel/error.h"
#include "mkernel/topology.h"
#include "runtime/fd_exchange.h"
#include "runtime/inter_node.h"
#include "runtime/overrides.h"
#include "runtime/step_bootstrap.h"

namespace mk::detail {

struct CommState;

// One symmetric allocation: this rank's physical memory plus a mapping of every local peer's.
//   bases[i]  - local rank i's copy, mapped into this process (bases[local_rank] is our own)
//   d_peers   - the same table in device memory, for kernels
struct SymAllocation {
  std::size_t size = 0;         // bytes requested (equal on all ranks)
  std::size_t mapped_size = 0;  // size rounded up to the allocation granularity
  int device = -1;
  int local_rank = 0;        // index of our own copy in bases
  CUdeviceptr reserved = 0;  // one VA range holding all local_size mappings back to back
  std::vector<CUmemGenericAllocationHandle> handles;  // [local_size]; 0 where not mapped
  std::vector<CUdeviceptr> bases;                     // [local_size]
  void** d_peers = nullptr;
  ~SymAllocation();
};

struct CommState {
  std::unique_ptr<StepBootstrap> bootstrap;  // the caller's, bounded by the time limit
  Topology topo;
  int device = -1;
  double timeout_seconds = 60.0;
  Overrides overrides;  // the environment's, parsed once at creation
  std::unique_ptr<FdExchange> fd_exchange;
  uint64_t next_tag = 1;

  std::shared_ptr<SymAllocation> signal_pad;  // [kNumSignals][world] uint64 per rank
  DeviceLaunchState* launch_state = nullptr;  // device
  int32_t* d_node_ranks = nullptr;            // device [local_size]
  DeviceErrorRecord* error_host = nullptr;    // pinned, mapped
  DeviceErrorRecord* error_device = nullptr;  // device view of error_host

  mutable std::mutex registry_mutex;
  std::vector<std::weak_ptr<SymAllocation>> registry;

  // The path between nodes (multi-node communicators; Communicator::inter_node() creates it).
  std::mutex inter_node_mutex;
  std::unique_ptr<InterNode> inter_node;
  int32_t* host_abort = nullptr;      // pinned, mapped: raised by the path's first error
  cudaStream_t copy_streams[2] = {};  // socket staging: to the device, from the device

  std::string broken;                           // non-empty once an error broke the communicator
  ErrorCode broken_code = ErrorCode::kTimeout;  // what check() raises then
};

// Collective: allocate and map a symmetric buffer (symmetric.cpp).
std::shared_ptr<SymAllocation> create_symmetric(CommState& comm, std::size_t bytes);

}  // namespace mk::detail
