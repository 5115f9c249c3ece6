// mkernel/moe.h - expert-parallel MoE: dispatch routed tokens to their experts' ranks, and
// combine the experts' outputs back at the tokens' ranks (docs/design/moe.md).
//
// Every rank holds T tokens x [T, H] bf16 and their router's choice topk_idx [T, k] (global expert
// ids, -1 = no expert in that slot); E = world * E_local experts, expert e lives on rank
// e / E_local as its local expert e % E_local. Only routed tokens travel, and a token bound for
// several experts of one rank crosses to it once.
//
// moe_dispatch gives each rank the rows routed to its local experts, expert-major:
//   MoeLayout::kPadded  [rows, H]: local expert e's rows from row start(e) = the sum over e' < e of
//                       round_up(rows(e'), 128) (the grouped GEMM's row block); the rows between
//                       experts are padding (prefill)
//   MoeLayout::kMasked  [E_local, capacity, H]: expert e's rows at [e, 0 .. rows(e)) (decode:
//                       fixed shapes whatever the routing)
// Within an expert the rows come in the order (source rank, token, slot): a pure function of every
// rank's topk_idx, computed on the GPU by prefix counts (no atomics), so results reproduce bit for
// bit. With them: the per-expert row counts (device int32 [E_local], every row routed, also those
// past the room), and the handle - for every row of the layout (source rank, token, slot), int32
// [rows][3], (-1, -1, -1) for padding and unused rows.
//
// moe_combine sends each row of y (the experts' outputs, in the dispatch layout) back to its
// source rank, which sums per token over its slots, in slot order and in fp32, topk_weights[t][j]
// * y(t, j) (fused multiply-adds), and rounds once to bf16: out [T, H]. Slots without a row (-1,
// a bad index, a row past the room) add nothing. The same bits whatever arrives first.
//
// Data errors are recorded on the GPU and raised by Communicator::check() / synchronize() - once,
// without breaking the communicator: a row past its expert's room (ErrorCode::kOutOfMemory,
// naming the expert and its rows: it is not placed, never silently dropped) and an expert id out
// of range (kInvalidArgument, naming the token and slot: treated as -1). The launches complete.
// Everything else is checked before launch (mk::Error). Stream-ordered, no host synchronisation,
// CUDA-graph safe (counts and routing may change between replays). Any world size; the ranks of
// a communicator call in the same order. Every op also runs across nodes (a token crosses the
// network once per destination node, to the rail peer there, which forwards it over NVLink; the
// results are the one-node ones bit for bit); there moe_dispatch_gemm is two launches (the
// dispatch, then the grouped GEMM) and moe_layer three (dispatch, the expert GEMMs, combine).
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <string>

#include "mkernel/communicator.h"
#include "mkernel/gemm.h"

namespace mk {

enum class MoeLayout { kPadded, kMasked };
enum class IndexType { kInt32, kInt64 };

constexpr int kMoeRowBlock = 128;     // padded layout: experts start on multiples of this
constexpr int kMoeMaxTopK = 16;       // top-k slots per token
constexpr int kMoeMaxExperts = 8192;  // E, all ranks' experts together

// One call's sizes. All but `tokens` must be the same on every rank.
struct MoeProblem {
  int64_t tokens = 0;      // T: this rank's tokens (0 <= T <= max_tokens; may differ by rank)
  int64_t max_tokens = 0;  // T_max: the most tokens any rank has; sizes the workspace
  int64_t hidden = 0;      // H: a multiple of 8
  int top_k = 0;           // k: 1..kMoeMaxTopK
  int num_experts = 0;     // E: a multiple of the world size, at most kMoeMaxExperts
  MoeLayout layout = MoeLayout::kPadded;
  // Rows the layout holds: padded - rows of the output (0: every routed row of every rank fits,
  // world * T_max * min(k, E_local) + E_local * 127); masked - rows per local expert (0:
  // world * T_max, one row per token of every rank).
  int64_t capacity = 0;
};

// The same on every rank: channel c of a rank pairs with channel c of its peers.
struct MoeConfig {
  int sms = 0;      // CTAs (channels) of each launch; 0 = the communicator's SM budget. The
                    // same on every rank; the fused launches (moe_dispatch_gemm, moe_layer)
                    // need all of their CTAs resident at once (tiles wait for rows other CTAs
                    // place): no more than the budget, and no other work holding those SMs
  int block_n = 0;  // moe_dispatch_gemm: GEMM tile width 64, 128, 192 or 256; 0 = the library's
                    // choice (or MKERNEL_GEMM_BLOCK_N)
};

// What a dispatch / combine will do (the same on every rank), for printing and tests.
struct MoePlan {
  int64_t rows = 0;      // rows of the dispatch layout (padded: the room; masked: E_local x
                         // capacity)
  int64_t capacity = 0;  // padded: the room; masked: rows per local expert
  int experts_local = 0;
  MoeLayout layout = MoeLayout::kPadded;
  int ctas = 0;
  std::size_t workspace_bytes = 0;  // symmetric, per rank
  std::string describe() const;
};

// The plan (throws mk::Error on what moe_dispatch would refuse in the problem).
MoePlan moe_plan(const Communicator& comm, const MoeProblem& problem, const MoeConfig& config = {});
// Symmetric workspace per rank for a problem (both ops share it).
std::size_t moe_workspace_bytes(const Communicator& comm, const MoeProblem& problem);

// x [T, H] bf16; topk_idx [T, k] (index_type); out: recv_x [rows, H] bf16 (moe_plan().rows),
// expert_rows int32 [E_local], handle int32 [rows][3]. workspace: symmetric, at least
// moe_workspace_bytes, at the same offset on every rank. Device pointers of the communicator's
// GPU, 16-byte aligned (topk_idx, expert_rows and handle: their element size).
void moe_dispatch(Communicator& comm, const MoeProblem& problem, const void* x,
                  const void* topk_idx, IndexType index_type, void* recv_x, int32_t* expert_rows,
                  int32_t* handle, void* workspace, cudaStream_t stream,
                  const MoeConfig& config = {});

// moe_dispatch and the local experts' GEMM in one launch: y = (the dispatched rows of local
// expert e) @ op(w[e]) for every local expert, each 128-row tile multiplied as soon as its rows
// have landed (docs/design/moe.md). w: [E_local, N, H] (BLayout::kNK, nn.Linear's layout) or
// [E_local, H, N] (kKN) bf16, N a multiple of 8; y: [rows, N] bf16 in the dispatch layout (rows
// without a (source, token, slot) are not written); recv_x: [rows, H] bf16, the dispatched rows
// in the layout as moe_dispatch writes them, or null on one node: not written (the GEMM reads each
// row from where it lies - x, or the staging it landed in - not from recv_x; asking for them
// costs their copies; across nodes the rows pass through recv_x, which must be given);
// expert_rows, handle: as moe_dispatch's. The same workspace as moe_dispatch's
// (moe_workspace_bytes).
void moe_dispatch_gemm(Communicator& comm, const MoeProblem& problem, const void* x,
                       const void* topk_idx, IndexType index_type, const void* w, BLayout w_layout,
                       int64_t n, void* y, void* recv_x, int32_t* expert_rows, int32_t* handle,
                       void* workspace, cudaStream_t stream, const MoeConfig& config = {});

// y [rows, H] bf16 in the dispatch layout (the dispatch's rows and handle, same problem);
// topk_weights [T, k] fp32; out [T, H] bf16. The same workspace as the dispatch's - across nodes
// also as that dispatch left it (the way each row came is kept there): no other moe_dispatch on
// it between the two.
void moe_combine(Communicator& comm, const MoeProblem& problem, const void* y,
                 const float* topk_weights, const int32_t* handle, void* out, void* workspace,
                 cudaStream_t stream, const MoeConfig& config = {});

// ---- the whole MoE layer ---------------------------------------------------------------------
//
// out[t] = sum over token t's slots j of topk_weights[t][j] * expert e_j's
//   (silu(x Wg^T) * (x Wu^T)) W2^T,   e_j = topk_idx[t][j]
// with this rank's experts' weights in nn.Linear's layout, bf16:
//   w13 [E_local, 2I, H]  each expert's gate rows (I of them), then its up rows: Mixtral's w1
//                         and w3, DeepSeek's / Qwen's gate_proj and up_proj, stacked (Python:
//                         mkernel.moe_weights_from_hf builds it from a Hugging Face MoE block)
//   w2  [E_local, H, I]   its down projection (w2 / down_proj)
// The intermediate silu(gate) * up is computed in fp32 and rounded to bf16 once; the combine sums
// in fp32 in slot order and rounds once (bit for bit whatever arrives first, as moe_combine).
// I a positive multiple of 64. The routing contract (-1 slots, capacity errors, GPU-side index
// checks, worst-case buffers, one node) is moe_dispatch's; the layout (padded or masked) is the
// one the experts' rows take between the steps.
//
// One persistent launch on `stream` (after the routing's small kernels and two memsets): the rows
// placed as they arrive, the gate / up tiles (SwiGLU in their epilogue) once their rows are in,
// a down tile once the gate / up tiles of its rows are stored, each down row written straight
// into its source's combine slot, and every token summed once its slots are in - the
// intermediates in the caller's `scratch` (docs/design/moe_layer.md).
struct MoeLayerPlan {
  MoePlan dispatch;               // the dispatch / combine (symmetric workspace: its bytes)
  int64_t intermediate = 0;       // I
  std::size_t scratch_bytes = 0;  // moe_layer's `scratch`: the dispatched rows and the
                                  // intermediate (dispatch.rows x (H + I) bf16), the rows per
                                  // expert, the handle, the gate / up tile-rows' counters
  std::string describe() const;
};
MoeLayerPlan moe_layer_plan(const Communicator& comm, const MoeProblem& problem,
                            int64_t intermediate, const MoeConfig& config = {});

// x [T, H] bf16; topk_idx [T, k] (index_type); topk_weights [T, k] fp32; w13, w2 as above; out
// [T, H] bf16. workspace: symmetric, moe_workspace_bytes(comm, problem), at the same offset on
// every rank. scratch: this rank's device memory (256-byte aligned) of moe_layer_plan()'s
// scratch_bytes, for the call's intermediates - nothing is allocated inside, so CUDA graphs
// capture the call as it is; reusable once the call's work on the stream is done.
// config.sms: CTAs of the launch (0, or more than the communicator's SM budget: the budget);
// config.block_n: the experts' GEMMs' tile width, 128 or 256 (0: chosen; 256 needs I a multiple
// of 128).
void moe_layer(Communicator& comm, const MoeProblem& problem, int64_t intermediate, const void* x,
               const void* topk_idx, IndexType index_type, const float* topk_weights,
               const void* w13, const void* w2, void* out, void* workspace, void* scratch,
               cudaStream_t stream, const MoeConfig& config = {});

}  // namespace mk
