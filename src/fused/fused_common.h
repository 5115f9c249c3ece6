// Internal: pieces the fused GEMMs' host code shares.
#pragma once

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdio>
#include <string>
#include <utility>

#include "fused/reduce_routes.h"
#include "mkernel/communicator.h"
#include "mkernel/device_comm.h"
#include "mkernel/error.h"
#include "mkernel/fused.h"
#include "mkernel/gemm.h"
#include "runtime/overrides.h"
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

// The call's config with the communicator's overrides folded in (runtime/overrides.h): a knob the
// caller left at 0 takes its MKERNEL_* value; MKERNEL_BF16_PARTIALS overrides either way. The
// plans see only the result. MKERNEL_GEMM_BLOCK_N asks for a width where the library picks one,
// so it enters at most `widest`, the widest tile the op runs on this communicator (a width the
// caller sets in the config is the caller's, checked by the plan).
inline FusedGemmConfig with_overrides(FusedGemmConfig config, const detail::Overrides& o,
                                      int widest = 256) {
  if (config.block_n == 0) config.block_n = std::min(o.block_n, widest);
  if (config.comm_ctas == 0) config.comm_ctas = o.comm_ctas;
  if (config.piece_rows == 0) config.piece_rows = o.piece_rows;
  if (o.bf16_partials >= 0) config.bf16_partials = o.bf16_partials == 1;
  return config;
}

// gemm_rs / gemm_ar: the same, MKERNEL_GEMM_BLOCK_N at most kMaxReduceBlockN across nodes.
inline FusedGemmConfig with_reduce_overrides(const Communicator& comm,
                                             const FusedGemmConfig& config) {
  return with_overrides(config, comm.overrides(),
                        comm.topology().num_nodes > 1 ? kMaxReduceBlockN : 256);
}

// MKERNEL_PRINT_CONFIG: one line per launch on rank 0, "[mkernel] op MxNxK: <plan>".
inline void print_plan(const Communicator& comm, const char* op, int64_t m, int64_t n, int64_t k,
                       const FusedGemmPlan& plan) {
  if (!comm.overrides().print_config || comm.rank() != 0) return;
  std::fprintf(stderr, "[mkernel] %s %lldx%lldx%lld: %s\n", op, static_cast<long long>(m),
               static_cast<long long>(n), static_cast<long long>(k), plan.describe().c_str());
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
