// Internal: the MoE ops' plan - sizes checked, the layout's rows, the CTAs, the workspace laid out
// (a pure host function of the problem, the world size and the SM budget:
// tests/cpu/test_moe_plan.cpp).
#pragma once

#include <cstdint>
#include <vector>

#include "mkernel/device_comm.h"
#include "mkernel/moe.h"

namespace mk::moe {

constexpr int kMoeMaxNodeRanks = 64;  // ranks of a communicator across nodes (NodeMap's tables)

// Byte offsets in the workspace (each 256-byte aligned), and its size.
struct Offsets {
  uint64_t recv_meta = 0;   // int32 [world][max_tokens][meta_ints]
  uint64_t recv_x = 0;      // bf16 [world][max_tokens][hidden]
  uint64_t comb_x = 0;      // bf16 [max_tokens][top_k][hidden]
  uint64_t comb_flag = 0;   // uint32 [max_tokens][top_k]
  uint64_t chunk_cnt = 0;   // int32 [max_chunks][experts]
  uint64_t chunk_dcnt = 0;  // int32 [max_chunks][world]
  uint64_t pos = 0;         // int32 [max_tokens][top_k]
  uint64_t send_list = 0;   // int32 [world][max_tokens]
  uint64_t totals = 0;      // int32 [experts + world + nodes]
  // moe_dispatch_gemm only (laid out for every plan: small next to the rows):
  uint64_t by_local = 0;    // int32 [max_tokens * top_k]: this rank's (token, slot) pairs bound
                            // for its own experts, in its layout's order
  uint64_t recv_order = 0;  // int32 [world][max_tokens * top_k]: each source's rows for this
                            // rank's experts in layout order, as send slot x top_k + slot (the
                            // source writes them; the side warps place rows in that order)
  uint64_t layout = 0;      // int32 LayoutTables (the receive side's layout, the notify kernel's)
  uint64_t counters = 0;    // uint64 [blocks]: rows placed in each 128-row block of the layout
  uint64_t row_src = 0;     // int32 [rows]: where each placed row is, for the GEMM's gather
                            // (-1 - token: this rank's x; else its staging row in recv_x)
  // moe_layer only (laid out for every plan):
  uint64_t comb_count = 0;  // uint64 [max_tokens][ceil(hidden / 128)]: slots of each (token,
                            // column block) summed-ready at the source
  // Across nodes (moe_dispatch.cuh; the first three laid out for every plan, small on one node):
  uint64_t chunk_ncnt = 0;  // int32 [max_chunks][nodes]
  uint64_t cross_list = 0;  // int32 [nodes][max_tokens]
  uint64_t send_slot = 0;   // int32 [max_tokens][top_k]
  // Across nodes only (nodes > 1; what moe_combine reads of the dispatch before it - the
  // workspace as that dispatch left it):
  uint64_t slot_route = 0;  // int32 [max_tokens][top_k]: a slot bound for another node n, as
                            // n x max_tokens + its token's index in the crossing list; else -1
  uint64_t recv_cross = 0;  // int32 [world][max_tokens]: a received row's crossing index
  uint64_t row_cross = 0;   // int32 [rows]: a layout row's crossing index (a remote source's)
  uint64_t relay_y = 0;     // bf16 [nodes][max_tokens x top_k][hidden]: rows for the sources of
                            // node m this rank relays, at crossing index x top_k + slot
  uint64_t relay_flag = 0;  // uint32 [nodes][max_tokens x top_k]: the launch that wrote them
  uint64_t relay_rows = 0;  // int32 [nodes]: crossing rows of the source of node m this rank
                            // relayed (the dispatch's count, kept for the combine: the header it
                            // came in lies in staging that other ops reuse)
  uint64_t xfer = 0;        // the transfer regions: 2 x nodes of CrossRegion::bytes (dispatch),
                            // then 2 x nodes of CombRegion::bytes (combine); used where the
                            // inter-node path stages in device memory
  uint64_t bytes = 0;
};

// One transfer region of the dispatch across nodes (NodeXfer): the header (int32 [per_node]
// [E_local + 1] counts, then the crossing rows), the metadata (int32 [max_tokens][cross_ints]:
// token; per slot, global expert, position, send slot) and the rows (bf16 [max_tokens][hidden]),
// each 256-byte aligned.
struct CrossRegion {
  int cross_ints = 0;
  uint64_t meta_at = 0;
  uint64_t rows_at = 0;
  uint64_t bytes = 0;
};

// One transfer region of the combine across nodes: flags (uint32 [max_tokens x top_k]) then rows
// (bf16 [max_tokens x top_k][hidden]) at crossing index x top_k + slot.
struct CombRegion {
  uint64_t rows_at = 0;
  uint64_t bytes = 0;
};

// The receive side's layout as the notify kernel writes it (int32 arrays from Offsets::layout):
//   start [E_local + 1]   first row of each local expert (padded: multiples of 128)
//   pre   [world][E_local] rows of earlier sources within each expert
//   recv  [world]         rows each source sends here
//   row_start, row_count [E_local], tile_prefix [E_local + 1], one int: the grouped GEMM's
//                          scheduler (row_count: the rows that fit) and its tile counter
//                          (gemm_engine::grouped_tables_bytes)
//   before [E_local + 1]  rows bound here for the local experts before each one (fitting or
//                          not: the index of the side warps' walk in layout order)
//   from  [world][E_local + 1] each source's rows bound for the local experts before each one's
//                          (its index in recv_order; the last: all its rows here)
//   sent  [world][E_local + 1] the same of this rank's rows for each destination (what `from`
//                          holds for this rank there: where it writes recv_order)
struct LayoutTables {  // int32 offsets: world x E_local <= E (kMoeMaxExperts)
  int32_t start, pre, recv, row_start, row_count, tile_prefix, before, from, sent, ints;
};
constexpr LayoutTables layout_tables(int world, int experts_local) {
  const int32_t e = experts_local, w = world;
  LayoutTables t{};
  t.start = 0;
  t.pre = t.start + e + 1;
  t.recv = t.pre + w * e;
  t.row_start = t.recv + w;
  t.row_count = t.row_start + e;
  t.tile_prefix = t.row_count + e;
  t.before = t.tile_prefix + e + 2;
  t.from = t.before + e + 1;
  t.sent = t.from + w * (e + 1);
  t.ints = t.sent + w * (e + 1);
  return t;
}

// Shared memory of the dispatch kernel: [world][E_local + 1] counts (then prefixes over
// sources), [E_local] totals, [E_local + 1] starts; and the most any plan may ask for (the
// kernel's limit is raised to it once, when a communicator loads it).
constexpr int64_t dispatch_smem_bytes(int world, int experts_local) {
  return 4 * (static_cast<int64_t>(world) * (experts_local + 1) + 2 * experts_local + 1);
}
constexpr int64_t kDispatchSmemMax =
    dispatch_smem_bytes(1, kMoeMaxExperts) + 4 * static_cast<int64_t>(kMaxChannels);

// Shared memory of the route kernels: [experts][world][nodes across nodes][E_local] int32 running
// counts; the most any plan asks for (E + E_local <= 2 E, world <= E), raised once like the
// dispatch's (E = 8192 needs 64 KB, past the default 48).
constexpr int64_t route_smem_bytes(int experts, int world, int nodes, int experts_local) {
  return 4 * (static_cast<int64_t>(experts) + world + (nodes > 1 ? nodes : 0) + experts_local);
}
constexpr int64_t kRouteSmemMax =
    route_smem_bytes(kMoeMaxExperts, 1, kMoeMaxNodeRanks, kMoeMaxExperts);

// Route chunks: one CTA each, whose one warp walks the chunk's (token, slot) pairs 32 at a time
// (route_scan_kernel: the positions in order), so a chunk's walk is a chain of
// chunk_tokens x top_k / 32 steps. 16 tokens keep it at 4 steps with top-8, and the CTA's
// prefix over the earlier chunks' counts (at most kMaxChunks - 1 loads a key, 16 in flight)
// short.
constexpr int64_t kMinChunkTokens = 16;  // tokens per route chunk, at least
constexpr int kMaxChunks = 128;          // route chunks (CTAs), at most

struct Plan {
  MoePlan plan;
  Offsets offsets;
  int64_t chunk_tokens = 0;       // route chunks of this many tokens
  int meta_ints = 0;              // per received row: token, then (local expert, position) per slot
  int64_t blocks = 0;             // 128-row blocks of the layout (arrival counters)
  int64_t blocks_per_expert = 0;  // masked: ceil(capacity / 128); padded: 0 (blocks by row)
  int nodes = 1;                  // of the communicator
  CrossRegion cross;              // nodes > 1: one transfer region of the dispatch
  CombRegion comb;                // nodes > 1: one of the combine
  // Route chunks for `tokens` of this rank (at least 1: the last chunk writes the totals).
  int chunks(int64_t tokens) const;
};

// moe_layer's combine counters per token: one per 128 columns of the hidden size.
constexpr int comb_count_stride(int64_t hidden) { return static_cast<int>((hidden + 127) / 128); }

// moe_layer's one launch (moe.cu; moe_layer.cpp has checked every argument but x, topk_idx and
// the workspace, which this checks first): the route kernels, notify, then the fused launch
// (moe_layer.cuh) - recv [rows, H] and h [rows, I] bf16, expert_rows, handle and done
// (gemm_engine::swiglu_down_counters_bytes) in the caller's scratch.
void launch_layer(Communicator& comm, const MoeProblem& problem, int64_t intermediate,
                  const void* x, const void* topk_idx, IndexType index_type,
                  const float* topk_weights, const void* w13, const void* w2, void* out,
                  void* workspace, void* recv, void* h, int32_t* expert_rows, int32_t* handle,
                  uint64_t* done, cudaStream_t stream, const MoeConfig& config, const char* op);

// Throws mk::Error(kInvalidArgument) naming `op` and what is wrong with the problem or config.
// Across nodes (`nodes` > 1, `nodes` x equal nodes): the workspace also holds the dispatch's
// transfer regions.
Plan plan_moe(int world, int sm_budget, const MoeProblem& problem, const MoeConfig& config,
              const char* op, int nodes = 1);

}  // namespace mk::moe

namespace mk {
struct GemmKernelResources;  // gemm/gemm_internal.h
}
namespace mk::detail {
// Every MoE kernel on the GEMM engine the library launches (moe_dispatch_gemm's widths and B
// layouts, moe_layer's two widths), with its compiled resources.
std::vector<GemmKernelResources> moe_kernel_resources();
}  // namespace mk::detail
