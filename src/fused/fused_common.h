// Internal: pieces the fused GEMMs' host code shares.
#pragma once

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdlib>
#include <string>
#include <utility>

#include "mkernel/communicator.h"
#include "mkernel/device_comm.h"
#include "mkernel/error.h"
#include "mkernel/fused.h"
#include "mkernel/gemm.h"
#include "runtime/validate.h"

namespace mk::fused {

// What a fused GEMM's plan needs to know of the communicator - so that the plans can be tested
// on a machine without GPUs (tests/cpu/test_fused_plans.cpp, fused/plans.h).
struct PlanContext {
  int world = 1;
  int local_size = 1;  // ranks on this node
  int sms = 1;         // SMs per rank (the GPU's, divided among the ranks that share it)
  int nodes = 1;       // (virtual) nodes: world / local_size
  int world_size() const { return world; }
};
inline PlanContext plan_context(const Communicator& comm) {
  return {comm.world_size(), comm.topology().local_size, comm.topology().sm_budget(),
          comm.topology().num_nodes};
}

// Persistent CTAs per rank: `requested` (>0) or the communicator's SM budget (SMs / ranks sharing
// a GPU, so that ranks sharing a GPU stay co-resident), capped by the budget.
inline int sm_budget(const PlanContext& ctx, int requested, const char* op) {
  if (requested < 0) {
    throw Error(ErrorCode::kInvalidArgument,
                std::string(op) + ": sms = " + std::to_string(requested) + "; expected >= 0");
  }
  const int budget = std::max(1, std::min(ctx.sms, kMaxChannels));
  return requested > 0 ? std::min(requested, budget) : budget;
}

// Switches for measuring what a mechanism buys: on unless the variable is "0".
//   MKERNEL_OUTBOX      partials leave through the producer's side threads (partials.cuh)
//   MKERNEL_INTERLEAVE  reducing kernels interleave peers' and own tiles (reduce_order.h)
//   MKERNEL_TMA_PARTIALS  gemm_rs's producer loads the peer's partials for the epilogue
//   MKERNEL_TMA_STAGING   gemm_rs stages outbox slices by TMA stores (partials.cuh, stage_chunks)
//   MKERNEL_TMA_SENDS     sends by TMA stores into the peer: gemm_ar's results and (no outbox)
//                         partials, gemm_rs's slices whose staging slot is busy (two ranks)
inline bool switch_on(const char* variable) {
  const char* v = std::getenv(variable);
  return v == nullptr || std::string(v) != "0";
}
inline bool outbox_enabled() { return switch_on("MKERNEL_OUTBOX"); }
inline bool interleave_enabled() { return switch_on("MKERNEL_INTERLEAVE"); }
inline bool tma_partials_enabled() { return switch_on("MKERNEL_TMA_PARTIALS"); }
inline bool tma_staging_enabled() { return switch_on("MKERNEL_TMA_STAGING"); }
inline bool tma_sends_enabled() { return switch_on("MKERNEL_TMA_SENDS"); }
// Experimental, off unless "1": the own tiles' partials before their k-blocks (gemm_kernel.cuh,
// prologue_loads).
inline bool partials_first_requested() {
  const char* v = std::getenv("MKERNEL_PARTIALS_FIRST");
  return v != nullptr && std::string(v) == "1";
}
// FusedGemmConfig::bf16_partials, unless MKERNEL_BF16_PARTIALS says "1" (on) or "0" (off).
inline bool bf16_partials_requested(const FusedGemmConfig& config) {
  const char* v = std::getenv("MKERNEL_BF16_PARTIALS");
  return v == nullptr ? config.bf16_partials : std::string(v) == "1";
}

// The first checks of every fused GEMM call: the communicator usable, one node (unless the op
// runs across nodes), the stream on the communicator's device, a known B layout.
inline void check_call(const Communicator& comm, cudaStream_t stream, BLayout b_layout,
                       const char* op, bool across_nodes = false) {
  detail::require_usable(comm, op);
  if (!across_nodes) detail::require_single_node(comm, op);
  detail::require_stream(comm, stream, op);
  if (b_layout != BLayout::kNK && b_layout != BLayout::kKN) {
    throw Error(ErrorCode::kInvalidArgument, std::string(op) + ": unknown B layout");
  }
}

// The shape rules every fused GEMM shares: M a positive multiple of the world size (shards of
// M / world rows), N and K multiples of 8 (`k_name`: what this op calls K), all below 2^31.
inline void check_shapes(const PlanContext& ctx, int64_t m, int64_t n, int64_t k, const char* op,
                         const char* k_name) {
  const int world = ctx.world;
  auto invalid = [&](const std::string& what) {
    throw Error(ErrorCode::kInvalidArgument, std::string(op) + ": " + what);
  };
  if (m < world || m % world != 0) {
    invalid("M = " + std::to_string(m) + " is not a positive multiple of the world size " +
            std::to_string(world));
  }
  for (auto [value, name] : {std::pair<int64_t, std::string>{n, "N"}, {k, k_name}}) {
    if (value < 8 || value % 8 != 0) {
      invalid(name + " = " + std::to_string(value) + "; expected a multiple of 8");
    }
  }
  if (m >= (int64_t{1} << 31) || n >= (int64_t{1} << 31) || k >= (int64_t{1} << 31)) {
    invalid(std::string("M, N and ") + k_name + " must each be < 2^31");
  }
}

}  // namespace mk::fused
