// Host side of moe_layer: moe_dispatch -> the experts' gate / up (SwiGLU in its epilogue) and
// down GEMMs in one launch -> moe_combine, on one stream, the intermediates in the caller's
// scratch.
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

// The scratch's parts, in order: recv_x [rows, H], h [rows, I], y [rows, H] (bf16), expert_rows
// [E_local] int32, handle [rows][3] int32, the GEMMs' group tables, their done counters.
struct ScratchParts {
  std::size_t recv, h, y, expert_rows, handle, tables, done, total;
};
ScratchParts scratch_parts(const MoePlan& plan, int64_t hidden, int64_t intermediate) {
  const auto rows = static_cast<std::size_t>(plan.rows);
  ScratchParts p{};
  p.recv = 0;
  p.h = p.recv + align256(rows * hidden * 2);
  p.y = p.h + align256(rows * intermediate * 2);
  p.expert_rows = p.y + align256(rows * hidden * 2);
  p.handle = p.expert_rows + align256(static_cast<std::size_t>(plan.experts_local) * 4);
  p.tables = p.handle + align256(rows * 12);
  p.done = p.tables + align256(gemm_engine::grouped_tables_bytes(plan.experts_local));
  p.total = p.done + align256(gemm_engine::swiglu_down_counters_bytes(plan.experts_local,
                                                                      static_cast<int64_t>(rows)));
  return p;
}

}  // namespace

std::string MoeLayerPlan::describe() const {
  return dispatch.describe() + "; I " + std::to_string(intermediate) +
         ": gate / up + SwiGLU and down grouped GEMMs in one launch, " +
         std::to_string(scratch_bytes) + " B scratch";
}

MoeLayerPlan moe_layer_plan(const Communicator& comm, const MoeProblem& problem,
                            int64_t intermediate, const MoeConfig& config) {
  MoeLayerPlan plan;
  plan.dispatch =
      moe::plan_moe(comm.world_size(), comm.topology().sm_budget(), problem, config, kOp).plan;
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
  // Everything the four steps check, before the first launch: nothing runs (and no peer waits
  // for this rank) on a refusal. x and topk_idx are moe_dispatch's first checks.
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
  void* recv = base + parts.recv;
  void* inter = base + parts.h;
  void* y = base + parts.y;
  auto* expert_rows = reinterpret_cast<int32_t*>(base + parts.expert_rows);
  auto* handle = reinterpret_cast<int32_t*>(base + parts.handle);
  auto* tables = reinterpret_cast<int32_t*>(base + parts.tables);
  auto* done = reinterpret_cast<uint64_t*>(base + parts.done);
  // (moe_dispatch checks x and topk_idx first; the combine's checks are all made above.)
  moe_dispatch(comm, problem, x, topk_idx, index_type, recv, expert_rows, handle, workspace, stream,
               config);
  const bool masked = problem.layout == MoeLayout::kMasked;
  const GroupedLayout layout = masked ? GroupedLayout::kMasked : GroupedLayout::kPadded;
  const int64_t rows = masked ? d.capacity : d.rows;  // grouped_gemm's `rows`
  // Nothing below allocates (the group tables and counters are in the scratch too): a CUDA graph
  // captures the call as three kernels and their prep, and nothing can fail between the
  // dispatch and the combine that the checks above did not rule out. The experts' GEMMs run on
  // the communicator's SM budget unless config.sms says otherwise: their down tiles wait for
  // gate / up tiles of other CTAs, so every CTA must be resident, also beside the kernels of
  // ranks that share this GPU.
  const int budget = comm.topology().sm_budget();
  const int sms = config.sms > 0 ? std::min(config.sms, budget) : budget;
  gemm_engine::grouped_swiglu_down(comm.device_comm(), recv, w13, w2, inter, y, expert_rows,
                                   d.experts_local, rows, intermediate, problem.hidden, layout,
                                   config.block_n, sms, tables, done, stream, kOp);
  moe_combine(comm, problem, y, topk_weights, handle, out, workspace, stream, config);
}

}  // namespace mk
