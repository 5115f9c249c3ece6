// Host side of moe_layer: the checks, the scratch's parts, then moe::launch_layer (moe.cu): the
// route kernels, the layout, and one launch for the dispatch, the experts' gate / up (SwiGLU in
// its epilogue) and down GEMMs and the combine (moe_layer.cuh) - across nodes, three launches
// for now (the dispatch and the combine across nodes around the experts' GEMMs).
#include <algorithm>
#include <cstdint>
#include <string>

#include "gemm/gemm_internal.h"
#include "mkernel/error.h"
#include "mkernel/moe.h"
#include "moe/moe_plan.h"
#include "runtime/cuda_check.h"
#include "runtime/device_guard.h"
#include "runtime/validate.h"

namespace mk {
namespace {

constexpr const char* kOp = "moe_layer";

std::size_t align256(std::size_t bytes) { return (bytes + 255) / 256 * 256; }

// The scratch's parts, in order: recv_x [rows, H], h [rows, I] (bf16), expert_rows [E_local]
// int32, handle [rows][3] int32, the gate / up tile-rows' done counters.
struct ScratchParts {
  std::size_t recv, h, expert_rows, handle, done, total;
};
ScratchParts scratch_parts(const MoePlan& plan, int64_t hidden, int64_t intermediate) {
  const auto rows = static_cast<std::size_t>(plan.rows);
  ScratchParts p{};
  p.recv = 0;
  p.h = p.recv + align256(rows * hidden * 2);
  p.expert_rows = p.h + align256(rows * intermediate * 2);
  p.handle = p.expert_rows + align256(static_cast<std::size_t>(plan.experts_local) * 4);
  p.done = p.handle + align256(rows * 12);
  p.total = p.done + align256(gemm_engine::swiglu_down_counters_bytes(plan.experts_local,
                                                                      static_cast<int64_t>(rows)));
  return p;
}

}  // namespace

std::string MoeLayerPlan::describe() const {
  return dispatch.describe() + "; I " + std::to_string(intermediate) +
         ": dispatch, gate / up + SwiGLU, down and combine in one launch, " +
         std::to_string(scratch_bytes) + " B scratch";
}

MoeLayerPlan moe_layer_plan(const Communicator& comm, const MoeProblem& problem,
                            int64_t intermediate, const MoeConfig& config) {
  MoeLayerPlan plan;
  plan.dispatch = moe::plan_moe(comm.world_size(), comm.topology().sm_budget(), problem, config,
                                kOp, comm.topology().num_nodes)
                      .plan;
  gemm_engine::require_swiglu_intermediate(intermediate, kOp);
  gemm_engine::require_swiglu_width(config.block_n, intermediate, kOp, "config.block_n");
  plan.intermediate = intermediate;
  plan.scratch_bytes = scratch_parts(plan.dispatch, problem.hidden, intermediate).total;
  return plan;
}

void moe_layer(Communicator& comm, const MoeProblem& problem, int64_t intermediate, const void* x,
               const void* topk_idx, IndexType index_type, const float* topk_weights,
               const void* w13, const void* w2, void* out, void* workspace, void* scratch,
               cudaStream_t stream, const MoeConfig& config) {
  detail::DeviceGuard guard(comm.device());
  detail::require_usable(comm, kOp);
  detail::require_stream(comm, stream, kOp);
  const MoeLayerPlan plan = moe_layer_plan(comm, problem, intermediate, config);
  const MoePlan& d = plan.dispatch;
  const auto h = static_cast<std::size_t>(problem.hidden);
  const auto i = static_cast<std::size_t>(intermediate);
  const auto experts = static_cast<std::size_t>(d.experts_local);
  // Everything checked before the first launch: nothing runs (and no peer waits for this rank)
  // on a refusal. x, topk_idx and the workspace are launch_layer's first checks.
  detail::require_device_pointer(comm, scratch, 256, kOp, "scratch");
  detail::require_device_pointer(comm, w13, 16, kOp, "w13");
  detail::require_device_pointer(comm, w2, 16, kOp, "w2");
  const std::size_t tokens = static_cast<std::size_t>(problem.tokens);
  const std::size_t k = static_cast<std::size_t>(problem.top_k);
  const std::size_t idx_size = index_type == IndexType::kInt64 ? 8 : 4;
  if (tokens > 0) {
    detail::require_device_pointer(comm, topk_weights, 4, kOp, "topk_weights");
    detail::require_device_pointer(comm, out, 16, kOp, "out");
  }
  detail::require_disjoint(
      kOp, {{"x", tokens > 0 ? x : nullptr, tokens * h * 2, false},
            {"topk_idx", tokens > 0 ? topk_idx : nullptr, tokens * k * idx_size, false},
            {"topk_weights", tokens > 0 ? topk_weights : nullptr, tokens * k * 4, false},
            {"w13", w13, experts * 2 * i * h * 2, false},
            {"w2", w2, experts * h * i * 2, false},
            {"out", tokens > 0 ? out : nullptr, tokens * h * 2, true},
            {"workspace", workspace, d.workspace_bytes, true},
            {"scratch", scratch, plan.scratch_bytes, true}});
  const ScratchParts parts = scratch_parts(d, problem.hidden, intermediate);
  auto* base = static_cast<uint8_t*>(scratch);
  // Nothing below allocates: a CUDA graph captures the call as it is (the route kernels, the
  // layout's, two memsets and the one launch; across nodes the three launches).
  moe::launch_layer(comm, problem, intermediate, x, topk_idx, index_type, topk_weights, w13, w2,
                    out, workspace, base + parts.recv, base + parts.h,
                    reinterpret_cast<int32_t*>(base + parts.expert_rows),
                    reinterpret_cast<int32_t*>(base + parts.handle),
                    reinterpret_cast<uint64_t*>(base + parts.done), stream, config, kOp);
}

}  // namespace mk
