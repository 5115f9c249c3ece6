// Internal: pieces the fused GEMMs' host code shares.
#pragma once

#include <cuda_runtime_api.h>

#include <algorithm>
#include <string>

#include "mkernel/communicator.h"
#include "mkernel/device_comm.h"
#include "mkernel/error.h"

namespace mk::fused {

// Persistent CTAs per rank: `requested` (>0) or the communicator's SM budget (SMs / ranks sharing
// a GPU, so that ranks sharing a GPU stay co-resident), capped by the budget.
inline int sm_budget(const Communicator& comm, int requested, const char* op) {
  if (requested < 0) {
    throw Error(ErrorCode::kInvalidArgument,
                std::string(op) + ": sms = " + std::to_string(requested) + "; expected >= 0");
  }
  const int budget = std::max(1, std::min(comm.topology().sm_budget(), kMaxChannels));
  return requested > 0 ? std::min(requested, budget) : budget;
}

inline void launch_check(const char* op) {
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) {
    throw Error(ErrorCode::kCuda, std::string(op) + ": launch failed: " + cudaGetErrorString(err));
  }
}

}  // namespace mk::fused
