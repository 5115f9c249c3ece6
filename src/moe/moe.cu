// Host side of moe_dispatch / moe_combine: validate -> plan -> route kernels -> the launch.
#include <cuda_bf16.h>

#include <algorithm>
#include <cstdio>
#include <string>

#include "fused/trace_layout.h"
#include "gemm/gemm_internal.h"
#include "gemm/launch.cuh"
#include "mkernel/error.h"
#include "mkernel/moe.h"
#include "moe/moe_combine.cuh"
#include "moe/moe_dispatch.cuh"
#include "moe/moe_dispatch_gemm.cuh"
#include "moe/moe_kernels.cuh"
#include "moe/moe_layer.cuh"
#include "moe/moe_plan.h"
#include "runtime/cuda_check.h"
#include "runtime/device_guard.h"
#include "runtime/inter_node_rings.h"
#include "runtime/kernel_preload.h"
#include "runtime/overrides.h"
#include "runtime/validate.h"

// The layout tables hold the grouped GEMM's tables from row_start on (moe_plan.h).
static_assert(mk::moe::layout_tables(3, 5).before - mk::moe::layout_tables(3, 5).row_start ==
              mk::gemm_engine::grouped_table_ints(5));

namespace mk {
namespace {

constexpr const char* kDispatch = "moe_dispatch";
constexpr const char* kCombine = "moe_combine";
constexpr const char* kDispatchGemm = "moe_dispatch_gemm";

moe::Plan plan_for(const Communicator& comm, const MoeProblem& problem, const MoeConfig& config,
                   const char* op) {
  return moe::plan_moe(comm.world_size(), comm.topology().sm_budget(), problem, config, op,
                       comm.topology().num_nodes);
}

void launch_check(const char* op) {
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) {
    throw Error(ErrorCode::kCuda, std::string(op) + ": launch failed: " + cudaGetErrorString(err));
  }
}

// What every rank's launch must share: the workspace's offsets (max_tokens, hidden, top_k, E, the
// layout and its room) and the channels (the CTAs), and what the op adds (`extra`: moe_layer's
// down width, by which the sums count their column blocks) - not the tokens, which each rank
// has its own of.
uint32_t signature_of(const MoeProblem& p, const moe::Plan& plan, EntryOp op, int64_t extra) {
  return dev::entry_signature(
      op, {p.max_tokens, p.hidden, p.top_k, p.num_experts, static_cast<int64_t>(p.layout),
           plan.plan.capacity, plan.plan.ctas, extra});
}

moe::Dims dims_of(const Communicator& comm, const MoeProblem& p, const moe::Plan& plan,
                  EntryOp op) {
  moe::Dims d{};
  d.world = comm.world_size();
  d.rank = comm.rank();
  d.me = comm.topology().local_rank;
  d.nodes = comm.topology().num_nodes;
  d.experts = p.num_experts;
  d.experts_local = plan.plan.experts_local;
  d.top_k = p.top_k;
  d.meta_ints = plan.meta_ints;
  d.tokens = p.tokens;
  d.max_tokens = p.max_tokens;
  d.hidden = p.hidden;
  d.chunk_tokens = plan.chunk_tokens;
  d.rows = plan.plan.rows;
  d.capacity = plan.plan.capacity;
  d.masked = p.layout == MoeLayout::kMasked;
  d.local_list = false;
  d.blocks_per_expert = plan.blocks_per_expert;
  d.signature = signature_of(p, plan, op, 0);
  return d;
}

moe::Workspace workspace_of(const SymmetricRange& range, const moe::Offsets& o) {
  moe::Workspace w{};
  w.peers = reinterpret_cast<uint8_t* const*>(range.device_peers);
  w.offset = range.offset;
  w.recv_meta = o.recv_meta;
  w.recv_x = o.recv_x;
  w.comb_x = o.comb_x;
  w.comb_flag = o.comb_flag;
  w.chunk_cnt = o.chunk_cnt;
  w.chunk_dcnt = o.chunk_dcnt;
  w.pos = o.pos;
  w.send_list = o.send_list;
  w.totals = o.totals;
  w.by_local = o.by_local;
  w.recv_order = o.recv_order;
  w.layout = o.layout;
  w.counters = o.counters;
  w.comb_count = o.comb_count;
  w.chunk_ncnt = o.chunk_ncnt;
  w.cross_list = o.cross_list;
  w.send_slot = o.send_slot;
  w.slot_route = o.slot_route;
  w.recv_cross = o.recv_cross;
  w.row_cross = o.row_cross;
  w.relay_y = o.relay_y;
  w.relay_flag = o.relay_flag;
  w.relay_rows = o.relay_rows;
  return w;
}

// The nodes as the route and dispatch kernels see them (one node: none of it is read).
moe::NodeMap node_map_of(const Communicator& comm) {
  const Topology& topo = comm.topology();
  moe::NodeMap nm{};
  nm.per_node = topo.local_size;
  if (topo.num_nodes == 1) return nm;
  for (int r = 0; r < topo.world_size; ++r) {  // (moe_plan.cpp: at most kMoeMaxNodeRanks)
    nm.node_of[r] = static_cast<int8_t>(topo.node_of[r]);
    nm.local_of[r] = static_cast<int8_t>(topo.local_rank_of[r]);
    nm.rank_at[topo.node_of[r] * topo.local_size + topo.local_rank_of[r]] = static_cast<int16_t>(r);
  }
  return nm;
}

// Across nodes: the communicator's inter-node rings and where the transfer regions live - in the
// workspace (after its other fields; its allocation then registered with the path) or in the
// path's pinned host staging (InterNode::host_staging). Collective on first use and when the
// staging grows. One node: nothing (the kernel reads none of it).
moe::NodeXfer node_xfer_of(Communicator& comm, const moe::Plan& plan, const SymmetricRange& range) {
  moe::NodeXfer xf{};
  if (plan.nodes == 1) return xf;
  const moe::CrossRegion& cr = plan.cross;
  const uint64_t bytes = 2 * static_cast<uint64_t>(plan.nodes) * (cr.bytes + plan.comb.bytes);
  const detail::InterNodeStaging staging = detail::inter_node_staging(comm, bytes);
  const bool in_workspace = staging.base == nullptr;
  auto* base = reinterpret_cast<uint8_t*>(range.host_peers[comm.topology().local_rank]);
  const detail::InterNodeRings path =
      detail::inter_node_rings(comm, in_workspace ? base : nullptr, range.size);
  xf.num_rings = std::min(path.count, moe::kMaxNodeRings);
  for (int i = 0; i < xf.num_rings; ++i) xf.rings[i] = path.ring[i];
  if (in_workspace) {
    xf.xfer_offset = range.offset + plan.offsets.xfer;
    xf.xfer = base + xf.xfer_offset;
    xf.xfer_buffer = path.buffer;
  } else {
    xf.xfer = staging.base;
    xf.xfer_buffer = staging.buffer;
    xf.xfer_offset = 0;
  }
  xf.region_bytes = cr.bytes;
  xf.meta_at = cr.meta_at;
  xf.rows_at = cr.rows_at;
  xf.cross_ints = cr.cross_ints;
  xf.comb_at = 2 * static_cast<uint64_t>(plan.nodes) * cr.bytes;
  xf.comb_bytes = plan.comb.bytes;
  xf.comb_rows_at = plan.comb.rows_at;
  return xf;
}

// What every MoE op checks first: a usable communicator (one node or across nodes), the stream,
// the plan, the workspace (symmetric, large enough, aligned).
struct Checked {
  moe::Plan plan;
  SymmetricRange workspace;
};

Checked check_common(Communicator& comm, const MoeProblem& problem, const MoeConfig& config,
                     void* workspace, cudaStream_t stream, const char* op) {
  detail::require_usable(comm, op);
  detail::require_stream(comm, stream, op);
  Checked c{plan_for(comm, problem, config, op), {}};
  detail::require_device_pointer(comm, workspace, 256, op, "workspace");
  c.workspace =
      detail::require_symmetric(comm, workspace, c.plan.plan.workspace_bytes, op, "workspace");
  if (c.workspace.offset % 256 != 0) {
    throw Error(ErrorCode::kInvalidArgument,
                std::string(op) + ": the workspace's offset in its symmetric buffer (" +
                    std::to_string(c.workspace.offset) + ") is not a multiple of 256");
  }
  return c;
}

// What moe_dispatch and moe_dispatch_gemm check of the routing side: the index type, x and
// topk_idx (when there are tokens), recv_x (unless recv_optional and null), expert_rows and
// handle - device memory, aligned - and that nothing written overlaps anything else (w and y too:
// moe_dispatch_gemm's, checked there; or absent).
void check_dispatch_operands(const Communicator& comm, const MoeProblem& problem, const Checked& c,
                             const char* op, const void* x, const void* topk_idx,
                             IndexType index_type, const void* recv_x, const int32_t* expert_rows,
                             const int32_t* handle, const void* workspace, const detail::Region& w,
                             const detail::Region& y, bool recv_optional = false) {
  if (index_type != IndexType::kInt32 && index_type != IndexType::kInt64) {
    throw Error(ErrorCode::kInvalidArgument, std::string(op) + ": index_type " +
                                                 std::to_string(static_cast<int>(index_type)) +
                                                 "; expected kInt32 or kInt64");
  }
  const MoePlan& plan = c.plan.plan;
  const std::size_t idx_size = index_type == IndexType::kInt64 ? 8 : 4;
  const auto tokens = static_cast<std::size_t>(problem.tokens);
  const auto h = static_cast<std::size_t>(problem.hidden);
  const auto k = static_cast<std::size_t>(problem.top_k);
  const auto rows = static_cast<std::size_t>(plan.rows);
  if (tokens > 0) {
    detail::require_device_pointer(comm, x, 16, op, "x");
    detail::require_device_pointer(comm, topk_idx, idx_size, op, "topk_idx");
  }
  if (recv_x != nullptr || !recv_optional) {
    detail::require_device_pointer(comm, recv_x, 16, op, "recv_x");
  }
  detail::require_device_pointer(comm, expert_rows, 4, op, "expert_rows");
  detail::require_device_pointer(comm, handle, 4, op, "handle");
  detail::require_disjoint(
      op, {{"x", tokens > 0 ? x : nullptr, tokens * h * 2, false},
           {"topk_idx", tokens > 0 ? topk_idx : nullptr, tokens * k * idx_size, false},
           w,
           y,
           {"recv_x", recv_x, rows * h * 2, true},
           {"expert_rows", expert_rows, static_cast<std::size_t>(plan.experts_local) * 4, true},
           {"handle", handle, rows * 12, true},
           {"workspace", workspace, plan.workspace_bytes, true}});
}

void print(const Communicator& comm, const char* op, const MoeProblem& p, const MoePlan& plan) {
  if (!comm.overrides().print_config || comm.rank() != 0) return;
  std::fprintf(stderr, "[mkernel] %s: T %lld (max %lld), H %lld, top-%d of %d experts: %s\n", op,
               static_cast<long long>(p.tokens), static_cast<long long>(p.max_tokens),
               static_cast<long long>(p.hidden), p.top_k, p.num_experts, plan.describe().c_str());
}

// The route kernels: chunk counts, then positions and send order (moe_kernels.cuh).
template <class Idx>
void launch_route(const DeviceComm& dc, const moe::Dims& d, const moe::NodeMap& nm,
                  const moe::Workspace& ws, const Idx* topk, int chunks, cudaStream_t stream,
                  const char* op) {
  // (Its limit was raised to kRouteSmemMax when the communicator loaded them.)
  const auto smem =
      static_cast<std::size_t>(moe::route_smem_bytes(d.experts, d.world, d.nodes, d.experts_local));
  moe::route_count_kernel<Idx><<<chunks, moe::kRouteThreads, smem, stream>>>(dc, d, nm, topk, ws);
  launch_check(op);
  moe::route_scan_kernel<Idx><<<chunks, moe::kRouteThreads, smem, stream>>>(d, nm, topk, ws);
  launch_check(op);
}

// The fused launches' prelude: the route kernels (either index type), then the one-CTA notify
// kernel (the layout, the GEMM's tables with tiles_n tiles a tile-row, the counters zeroed).
void launch_route_notify(const DeviceComm& dc, const moe::Dims& d, const moe::Workspace& ws,
                         const void* topk_idx, IndexType index_type, int chunks, int tiles_n,
                         int32_t* expert_rows, cudaStream_t stream, const char* op) {
  const moe::NodeMap one_node{d.world, {}, {}, {}};  // (the fused launches: one node)
  if (index_type == IndexType::kInt64) {
    launch_route(dc, d, one_node, ws, static_cast<const int64_t*>(topk_idx), chunks, stream, op);
  } else {
    launch_route(dc, d, one_node, ws, static_cast<const int32_t*>(topk_idx), chunks, stream, op);
  }
  const auto e_local = static_cast<std::size_t>(d.experts_local);
  const std::size_t smem = 4 * (static_cast<std::size_t>(d.world) * (e_local + 1) + e_local);
  moe::notify_kernel<<<1, moe::kThreads, smem, stream>>>(dc, d, ws, tiles_n, expert_rows);
  launch_check(op);
}

template <class Idx>
void launch_dispatch(Communicator& comm, const MoeProblem& problem, const moe::Plan& plan,
                     const SymmetricRange& range, const void* x, const void* topk_idx, void* recv_x,
                     int32_t* expert_rows, int32_t* handle, cudaStream_t stream) {
  const moe::Dims d = dims_of(comm, problem, plan, EntryOp::kMoeDispatch);
  const moe::Workspace ws = workspace_of(range, plan.offsets);
  const moe::NodeMap nm = node_map_of(comm);
  const moe::NodeXfer xf = node_xfer_of(comm, plan, range);
  const DeviceComm dc = comm.device_comm();  // (after the inter-node path exists: its host pad)
  const auto* topk = static_cast<const Idx*>(topk_idx);
  launch_route(dc, d, nm, ws, topk, plan.chunks(problem.tokens), stream, kDispatch);
  // (Its shared-memory limit was raised when the communicator loaded it: preload_moe_kernels.)
  const int smem = static_cast<int>(moe::dispatch_smem_bytes(d.world, d.experts_local));
  moe::dispatch_kernel<Idx><<<plan.plan.ctas, moe::kThreads, smem, stream>>>(
      dc, d, nm, xf, topk, static_cast<const __nv_bfloat16*>(x), ws,
      static_cast<__nv_bfloat16*>(recv_x), expert_rows, handle);
  launch_check(kDispatch);
}

// The combine kernel (one node or across nodes) on y in the dispatch layout.
void launch_combine(Communicator& comm, const MoeProblem& problem, const moe::Plan& plan,
                    const SymmetricRange& range, const void* y, const float* topk_weights,
                    const int32_t* handle, void* out, cudaStream_t stream, const char* op) {
  const moe::NodeMap nm = node_map_of(comm);
  const moe::NodeXfer xf = node_xfer_of(comm, plan, range);
  moe::combine_kernel<<<plan.plan.ctas, moe::kThreads, 0, stream>>>(
      comm.device_comm(), dims_of(comm, problem, plan, EntryOp::kMoeCombine), nm, xf,
      static_cast<const __nv_bfloat16*>(y), topk_weights, handle, workspace_of(range, plan.offsets),
      static_cast<__nv_bfloat16*>(out));
  launch_check(op);
}

// launch_dispatch for topk_idx's index type.
void launch_dispatch(IndexType index_type, Communicator& comm, const MoeProblem& problem,
                     const moe::Plan& plan, const SymmetricRange& range, const void* x,
                     const void* topk_idx, void* recv_x, int32_t* expert_rows, int32_t* handle,
                     cudaStream_t stream) {
  if (index_type == IndexType::kInt64) {
    launch_dispatch<int64_t>(comm, problem, plan, range, x, topk_idx, recv_x, expert_rows, handle,
                             stream);
  } else {
    launch_dispatch<int32_t>(comm, problem, plan, range, x, topk_idx, recv_x, expert_rows, handle,
                             stream);
  }
}

}  // namespace

MoePlan moe_plan(const Communicator& comm, const MoeProblem& problem, const MoeConfig& config) {
  return plan_for(comm, problem, config, "moe_plan").plan;
}

std::size_t moe_workspace_bytes(const Communicator& comm, const MoeProblem& problem) {
  return plan_for(comm, problem, {}, "moe_workspace_bytes").plan.workspace_bytes;
}

void moe_dispatch(Communicator& comm, const MoeProblem& problem, const void* x,
                  const void* topk_idx, IndexType index_type, void* recv_x, int32_t* expert_rows,
                  int32_t* handle, void* workspace, cudaStream_t stream, const MoeConfig& config) {
  detail::DeviceGuard guard(comm.device());
  const Checked c = check_common(comm, problem, config, workspace, stream, kDispatch);
  check_dispatch_operands(comm, problem, c, kDispatch, x, topk_idx, index_type, recv_x, expert_rows,
                          handle, workspace, {}, {});
  const MoePlan& plan = c.plan.plan;
  print(comm, kDispatch, problem, plan);
  launch_dispatch(index_type, comm, problem, c.plan, c.workspace, x, topk_idx, recv_x, expert_rows,
                  handle, stream);
}

void moe_dispatch_gemm(Communicator& comm, const MoeProblem& problem, const void* x,
                       const void* topk_idx, IndexType index_type, const void* w, BLayout w_layout,
                       int64_t n, void* y, void* recv_x, int32_t* expert_rows, int32_t* handle,
                       void* workspace, cudaStream_t stream, const MoeConfig& config) {
  detail::DeviceGuard guard(comm.device());
  const Checked c = check_common(comm, problem, config, workspace, stream, kDispatchGemm);
  const auto invalid = [](const std::string& what) {
    throw Error(ErrorCode::kInvalidArgument, std::string(kDispatchGemm) + ": " + what);
  };
  if (w_layout != BLayout::kNK && w_layout != BLayout::kKN) invalid("unknown weight layout");
  gemm_engine::require_multiple_of_8(n, kDispatchGemm, "N");
  if (n >= (int64_t{1} << 31)) invalid("N = " + std::to_string(n) + "; expected < 2^31");
  const MoePlan& plan = c.plan.plan;
  const auto h = static_cast<std::size_t>(problem.hidden);
  const auto rows = static_cast<std::size_t>(plan.rows);
  const auto e_local = static_cast<std::size_t>(plan.experts_local);
  const auto width = static_cast<std::size_t>(n);
  detail::require_device_pointer(comm, w, 16, kDispatchGemm, "w");
  detail::require_device_pointer(comm, y, 16, kDispatchGemm, "y");
  // (recv_x may be null on one node; across nodes the rows pass through it.)
  if (recv_x == nullptr && comm.topology().num_nodes > 1) {
    invalid(
        "recv_x is null; across nodes the op passes the dispatched rows through it (expected "
        "a [rows, H] buffer, moe_plan().rows)");
  }
  check_dispatch_operands(comm, problem, c, kDispatchGemm, x, topk_idx, index_type, recv_x,
                          expert_rows, handle, workspace, {"w", w, e_local * width * h * 2, false},
                          {"y", y, rows * width * 2, true}, /*recv_optional=*/true);
  // The tile width as the grouped GEMM picks it for these rows (gemm/grouped_gemm.cu): at least
  // a tile-row per expert.
  const int block_n = gemm_engine::pick_block_n(
      config.block_n != 0 ? config.block_n : comm.overrides().block_n,
      std::max<int64_t>(plan.rows, static_cast<int64_t>(e_local) * kGroupedRowBlock), n, plan.ctas,
      kDispatchGemm);
  print(comm, kDispatchGemm, problem, plan);
  const moe::LayoutTables lt = moe::layout_tables(comm.world_size(), plan.experts_local);
  auto* tables =
      reinterpret_cast<int32_t*>(static_cast<uint8_t*>(workspace) + c.plan.offsets.layout);
  if (comm.topology().num_nodes > 1) {
    // Across nodes, two launches for now: the dispatch (moe_dispatch's, across nodes), then the
    // grouped GEMM on its rows with the same tile width - the one launch's results, bit for bit.
    launch_dispatch(index_type, comm, problem, c.plan, c.workspace, x, topk_idx, recv_x,
                    expert_rows, handle, stream);
    GemmConfig gemm_config;
    gemm_config.block_n = block_n;
    gemm_config.sms = plan.ctas;
    const bool masked = problem.layout == MoeLayout::kMasked;
    // (The group tables where the one launch keeps them: no allocation, so a graph captures the
    // call as it is.)
    gemm_engine::grouped_gemm(
        recv_x, w, y, expert_rows, plan.experts_local, masked ? plan.capacity : plan.rows, n,
        problem.hidden, w_layout, stream, gemm_config,
        masked ? GroupedLayout::kMasked : GroupedLayout::kPadded, tables + lt.row_start);
    return;
  }
  moe::Dims d = dims_of(comm, problem, c.plan, EntryOp::kMoeDispatchGemm);
  d.local_list = true;
  const moe::Workspace ws = workspace_of(c.workspace, c.plan.offsets);
  const DeviceComm dc = comm.device_comm();
  const int tiles_n = static_cast<int>((n + block_n - 1) / block_n);
  // The timeline's buffer (null unless MKERNEL_TRACE) before the launches that peers wait for:
  // growing it allocates and frees (a device sync), and may throw.
  uint64_t* const trace = fused::trace_arm(comm, plan.ctas, stream);
  gemm_engine::dispatch(block_n, w_layout == BLayout::kKN, [&]<int kBlockN, bool kTransB>() {
    moe::MoeDispatchGemm<kBlockN> f{};
    f.grouped.c = gemm_engine::make_map(y, plan.rows, n, 64);
    f.grouped.c_ptr = static_cast<__nv_bfloat16*>(y);
    f.grouped.row_start = tables + lt.row_start;
    f.grouped.row_count = tables + lt.row_count;
    f.grouped.tile_prefix = tables + lt.tile_prefix;
    f.grouped.groups = d.experts_local;
    f.grouped.tiles_n = tiles_n;
    f.grouped.n = static_cast<int>(n);
    f.comm = dc;
    f.d = d;
    f.ws = ws;
    f.topk = topk_idx;
    f.topk_int64 = index_type == IndexType::kInt64;
    f.x = static_cast<const __nv_bfloat16*>(x);
    f.recv = static_cast<__nv_bfloat16*>(recv_x);
    f.row_src =
        reinterpret_cast<int32_t*>(static_cast<uint8_t*>(workspace) + c.plan.offsets.row_src);
    f.handle = handle;
    f.trace = trace;
    const CUtensorMap map_b =
        kTransB ? gemm_engine::make_map_3d(w, d.experts_local, problem.hidden, n, 64)
                : gemm_engine::make_map_3d(w, d.experts_local, n, problem.hidden, kBlockN);
    // The maps (which may throw) and the kernel's loading before the first launch: notify
    // signals the peers, who would then wait for a fused launch that never comes.
    gemm_engine::prepared_kernel<kBlockN, kTransB, moe::MoeDispatchGemm<kBlockN>>();
    launch_route_notify(dc, d, ws, topk_idx, index_type, c.plan.chunks(problem.tokens), tiles_n,
                        expert_rows, stream, kDispatchGemm);
    gemm_engine::launch<kBlockN, kTransB>(f, map_b, problem.hidden, plan.ctas, stream,
                                          kDispatchGemm);
  });
}

void moe::launch_layer(Communicator& comm, const MoeProblem& problem, int64_t intermediate,
                       const void* x, const void* topk_idx, IndexType index_type,
                       const float* topk_weights, const void* w13, const void* w2, void* out,
                       void* workspace, void* recv, void* h, int32_t* expert_rows, int32_t* handle,
                       uint64_t* done, cudaStream_t stream, const MoeConfig& config,
                       const char* op) {
  const Checked c = check_common(comm, problem, config, workspace, stream, op);
  check_dispatch_operands(comm, problem, c, op, x, topk_idx, index_type, recv, expert_rows, handle,
                          workspace, {}, {});
  const MoePlan& plan = c.plan.plan;
  print(comm, op, problem, plan);
  moe::Dims d = dims_of(comm, problem, c.plan, EntryOp::kMoeLayer);
  d.local_list = true;
  const moe::Workspace ws = workspace_of(c.workspace, c.plan.offsets);
  const DeviceComm dc = comm.device_comm();
  const int64_t total_rows = d.masked ? d.capacity * d.experts_local : d.rows;
  // Every CTA must be resident (down tiles wait for gate / up tiles, sums for down tiles): the
  // communicator's SM budget, or fewer on request.
  const int width = gemm_engine::swiglu_down_width(config.block_n, total_rows, d.experts_local,
                                                   intermediate, plan.ctas, op);
  d.signature = signature_of(problem, c.plan, EntryOp::kMoeLayer, width);
  const int stride = moe::comb_count_stride(problem.hidden);
  // The launches before the fused one (after every host step that can throw: the policy's tensor
  // maps are encoded first, so a refusal leaves no peer waiting for this rank's counts).
  const auto prep = [&] {
    launch_route_notify(dc, d, ws, topk_idx, index_type, c.plan.chunks(problem.tokens), 1,
                        expert_rows, stream, op);
    // This call's combine counters (this rank's tokens) and the tile-rows' counters from zero:
    // no peer counts into them before this rank's launch has sent it rows.
    if (problem.tokens > 0) {
      MK_CUDA_CHECK(cudaMemsetAsync(static_cast<uint8_t*>(workspace) + c.plan.offsets.comb_count, 0,
                                    static_cast<std::size_t>(problem.tokens) * stride * 8, stream));
    }
    MK_CUDA_CHECK(cudaMemsetAsync(
        done, 0, gemm_engine::swiglu_down_counters_bytes(d.experts_local, total_rows), stream));
  };
  const moe::LayoutTables lt = moe::layout_tables(d.world, d.experts_local);
  auto* tables =
      reinterpret_cast<int32_t*>(static_cast<uint8_t*>(workspace) + c.plan.offsets.layout);
  if (d.nodes > 1) {
    // Across nodes, three launches for now (and the tables): the dispatch across nodes, the two
    // expert GEMMs in one launch (GroupedSwigluDown, y written over recv: a tile-row's down
    // tiles start once its gate / up tiles, the last readers of its rows, are done), the
    // combine across nodes. The same bits as the one launch (the same tiles, moe_combine's sum).
    int32_t* tables_out = tables + lt.row_start;
    launch_dispatch(index_type, comm, problem, c.plan, c.workspace, x, topk_idx, recv, expert_rows,
                    handle, stream);
    gemm_engine::grouped_tables(expert_rows, d.experts_local, d.masked ? d.capacity : d.rows,
                                d.masked ? GroupedLayout::kMasked : GroupedLayout::kPadded, 1,
                                tables_out, stream);
    MK_CUDA_CHECK(cudaMemsetAsync(
        done, 0, gemm_engine::swiglu_down_counters_bytes(d.experts_local, total_rows), stream));
    const DeviceComm dc_nodes = comm.device_comm();
    const auto gemms = [&]<int kBlockN>() {
      auto f = gemm_engine::swiglu_down_policy<kBlockN>(dc_nodes, recv, w13, w2, h, recv,
                                                        tables_out, done, d.experts_local,
                                                        total_rows, intermediate, problem.hidden);
      gemm_engine::launch<kBlockN, false>(f, f.w13, problem.hidden, plan.ctas, stream, op);
    };
    if (width == 256) {
      gemms.template operator()<256>();
    } else {
      gemms.template operator()<128>();
    }
    launch_combine(comm, problem, c.plan, c.workspace, recv, topk_weights, handle, out, stream, op);
    return;
  }
  auto run = [&]<int kBlockN>() {
    moe::MoeLayerFused<kBlockN> f{};
    // (No y: the down tiles store into the combine's slots. The policy's y map gets recv.)
    f.gemms = gemm_engine::swiglu_down_policy<kBlockN>(dc, recv, w13, w2, h, recv,
                                                       tables + lt.row_start, done, d.experts_local,
                                                       total_rows, intermediate, problem.hidden);
    f.dispatch.comm = dc;
    f.dispatch.d = d;
    f.dispatch.ws = ws;
    f.dispatch.topk = topk_idx;
    f.dispatch.topk_int64 = index_type == IndexType::kInt64;
    f.dispatch.x = static_cast<const __nv_bfloat16*>(x);
    f.dispatch.recv = static_cast<__nv_bfloat16*>(recv);
    f.dispatch.handle = handle;
    f.dispatch.drop_blocks = static_cast<int>((problem.hidden + kBlockN - 1) / kBlockN);
    f.dispatch.drop_stride = stride;
    f.dispatch.trace = fused::trace_arm(comm, plan.ctas, stream);  // null unless MKERNEL_TRACE
    f.weights = topk_weights;
    f.out = static_cast<__nv_bfloat16*>(out);
    f.count_stride = stride;
    prep();
    gemm_engine::launch<kBlockN, false>(f, f.gemms.w13, problem.hidden, plan.ctas, stream, op);
  };
  if (width == 256) {
    run.template operator()<256>();
  } else {
    run.template operator()<128>();
  }
}

void moe_combine(Communicator& comm, const MoeProblem& problem, const void* y,
                 const float* topk_weights, const int32_t* handle, void* out, void* workspace,
                 cudaStream_t stream, const MoeConfig& config) {
  detail::DeviceGuard guard(comm.device());
  const Checked c = check_common(comm, problem, config, workspace, stream, kCombine);
  const MoePlan& plan = c.plan.plan;
  const auto tokens = static_cast<std::size_t>(problem.tokens);
  const auto h = static_cast<std::size_t>(problem.hidden);
  const auto k = static_cast<std::size_t>(problem.top_k);
  const std::size_t y_bytes = static_cast<std::size_t>(plan.rows) * h * 2;
  const std::size_t handle_bytes = static_cast<std::size_t>(plan.rows) * 12;
  const std::size_t w_bytes = tokens * k * 4, out_bytes = tokens * h * 2;
  detail::require_device_pointer(comm, y, 16, kCombine, "y");
  detail::require_device_pointer(comm, handle, 4, kCombine, "handle");
  if (tokens > 0) {
    detail::require_device_pointer(comm, topk_weights, 4, kCombine, "topk_weights");
    detail::require_device_pointer(comm, out, 16, kCombine, "out");
  }
  detail::require_disjoint(kCombine,
                           {{"y", y, y_bytes, false},
                            {"topk_weights", tokens > 0 ? topk_weights : nullptr, w_bytes, false},
                            {"handle", handle, handle_bytes, false},
                            {"out", tokens > 0 ? out : nullptr, out_bytes, true},
                            {"workspace", workspace, plan.workspace_bytes, true}});
  print(comm, kCombine, problem, plan);
  launch_combine(comm, problem, c.plan, c.workspace, y, topk_weights, handle, out, stream,
                 kCombine);
}

namespace detail {
namespace {

// The MoE kernels, loaded up front (runtime/kernel_preload.h).
void preload_moe_kernels(bool) {
  auto load = [](const void* fn) {
    cudaFuncAttributes attr{};
    MK_CUDA_CHECK(cudaFuncGetAttributes(&attr, fn));
  };
  // The route kernels' shared memory grows with the experts too (moe::route_smem_bytes).
  const int route_most = static_cast<int>(moe::kRouteSmemMax);
  for (const void* fn : {reinterpret_cast<const void*>(&moe::route_count_kernel<int32_t>),
                         reinterpret_cast<const void*>(&moe::route_count_kernel<int64_t>),
                         reinterpret_cast<const void*>(&moe::route_scan_kernel<int32_t>),
                         reinterpret_cast<const void*>(&moe::route_scan_kernel<int64_t>)}) {
    MK_CUDA_CHECK(
        cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize, route_most));
  }
  // The dispatch's shared memory grows with the experts (moe::dispatch_smem_bytes): allow the
  // most a problem can ask for (kMoeMaxExperts), once per device, here rather than per launch.
  const int most = static_cast<int>(moe::kDispatchSmemMax);
  MK_CUDA_CHECK(cudaFuncSetAttribute(moe::dispatch_kernel<int32_t>,
                                     cudaFuncAttributeMaxDynamicSharedMemorySize, most));
  MK_CUDA_CHECK(cudaFuncSetAttribute(moe::dispatch_kernel<int64_t>,
                                     cudaFuncAttributeMaxDynamicSharedMemorySize, most));
  MK_CUDA_CHECK(
      cudaFuncSetAttribute(moe::notify_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, most));
  load(reinterpret_cast<const void*>(&moe::combine_kernel));
}

const bool kPreloadRegistered = register_kernel_preload(&preload_moe_kernels);
const bool kFusedPreloadRegistered = register_kernel_preload([](bool) {
  gemm_engine::preload_all<moe::MoeDispatchGemm>();
  gemm_engine::prepared_kernel<128, false, moe::MoeLayerFused<128>>();  // moe_layer's launch
  gemm_engine::prepared_kernel<256, false, moe::MoeLayerFused<256>>();
  // moe_layer across nodes: the expert GEMMs' launch on its own (loaded up front: a first load
  // after the dispatch across nodes has started would stall its peers' waits).
  gemm_engine::prepared_kernel<128, false, gemm_engine::GroupedSwigluDown<128>>();
  gemm_engine::prepared_kernel<256, false, gemm_engine::GroupedSwigluDown<256>>();
  gemm_engine::preload_grouped();  // the public grouped GEMMs
});

}  // namespace

std::vector<GemmKernelResources> moe_kernel_resources() {
  std::vector<GemmKernelResources> out;
  auto add = [&](std::string name, auto kernel) {
    out.push_back(kernel_resources(std::move(name), reinterpret_cast<const void*>(kernel)));
  };
  for (int block_n : {64, 128, 192, 256}) {
    for (bool trans_b : {false, true}) {
      gemm_engine::dispatch(block_n, trans_b, [&]<int kBlockN, bool kTransB>() {
        add("moe_dispatch_gemm " + std::to_string(kBlockN) + (kTransB ? " B[K,N]" : " B[N,K]"),
            gemm_engine::prepared_kernel<kBlockN, kTransB, moe::MoeDispatchGemm<kBlockN>>());
      });
    }
  }
  add("moe_layer 128", gemm_engine::prepared_kernel<128, false, moe::MoeLayerFused<128>>());
  add("moe_layer 256", gemm_engine::prepared_kernel<256, false, moe::MoeLayerFused<256>>());
  add("moe_layer nodes 128",
      gemm_engine::prepared_kernel<128, false, gemm_engine::GroupedSwigluDown<128>>());
  add("moe_layer nodes 256",
      gemm_engine::prepared_kernel<256, false, gemm_engine::GroupedSwigluDown<256>>());
  return out;
}

}  // namespace detail

}  // namespace mk
