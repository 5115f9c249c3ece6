// mkernel/fused.h - GEMMs fused with the collective around them, in one persistent launch.
//
// Tensor-parallel linear layers: the collective's data moves over NVLink inside a node, and
// through the communicator's inter-node path between nodes, while the GEMM engine
// (mkernel/gemm.h) computes, tile by tile, so that communication hides behind compute. Any world
// size and any number of (virtual) nodes. Stream-ordered, no host synchronisation, capturable in
// CUDA graphs; argument errors throw mk::Error before anything is launched.
//
// Workspace: symmetric memory the caller allocates once (Communicator::alloc) and passes to every
// call, at the same offset on every rank; *_workspace_bytes says how much. Calls on one
// communicator must be issued in the same order on every rank (as with NCCL).
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <string>

#include "mkernel/communicator.h"
#include "mkernel/gemm.h"

namespace mk {

// Knobs of the fused GEMMs. 0 = picked by the library (the same on every rank: it depends only on
// the shapes and the topology), or the MKERNEL_* override of that knob when one is set (README).
// MKERNEL_PRINT_CONFIG=1 prints the choice on rank 0.
struct FusedGemmConfig {
  int block_n = 0;     // GEMM tile width: 64, 128, 192 or 256 (MKERNEL_GEMM_BLOCK_N)
  int comm_ctas = 0;   // ag_gemm: CTAs whose spare warps push the shard; 0 = as many as keep up
                       // with the GEMM (MKERNEL_COMM_CTAS)
  int piece_rows = 0;  // ag_gemm: rows moved per signal (the unit the GEMM waits for); 0 = pieces
                       // of 128-512 KiB (MKERNEL_PIECE_ROWS)
  int sms = 0;         // persistent CTAs; 0 = the communicator's SM budget
  // gemm_rs / gemm_ar with two ranks: the peer's partial sums travel as bf16 - rounded once before
  // the fp32 add, as NCCL's reduce-scatter of bf16 partials rounds them - for half the staging,
  // NVLink and accumulator bytes. Off by default: the sums stay fp32 until the final rounding.
  // Across nodes (any world size): the node sums cross the network as bf16 (rounded once more
  // per node), and at two ranks per node the node's partials travel as bf16 too.
  // MKERNEL_BF16_PARTIALS=1 / =0 overrides it either way (benchmarks).
  bool bf16_partials = false;
  // gemm_rs / gemm_ar with two ranks and fp32 partials: where the SM's copy engine can carry them,
  // slices (and gemm_ar's results) leave by TMA stores straight into the peer's memory instead
  // of the threads' stores (FusedGemmPlan::tma_sends says where). On by default; a field until
  // it is measured over NVLink against the threads' stores (bench_fused --sweep 'tma_sends0').
  bool tma_sends = true;
};

// What a fused GEMM call will do (the same on every rank), for printing and for tests.
struct FusedGemmPlan {
  int64_t shard_rows = 0;  // rows of one rank's shard
  int block_n = 0;         // GEMM tile width (tiles are 128 x block_n)
  int ctas = 0;            // persistent CTAs
  int comm_ctas = 0;       // of which move data
  int piece_rows = 0;      // rows per signalled piece
  int pieces = 0;          // pieces per shard
  std::size_t workspace_bytes = 0;
  std::size_t staging_bytes = 0;  // of which: partials' staging slots (0: sent by the epilogue)
  int outbox_slots = 0;  // gemm_ar's staging slots per consumer warpgroup (0: no outbox; gemm_rs
                         // stages in its output, per CTA, and reports 0 here)
  int lag = -1;   // gemm_rs / gemm_ar: peers' tiles before own tiles start to interleave with
                  // them (-1: all peers' tiles first; src/fused/reduce_order.h)
  int nodes = 1;  // ag_gemm across nodes: shards also arrive over the rail
  bool bf16_partials = false;    // the peer's partial sums travel as bf16 (requested in the config,
                                 // two ranks only; across nodes: node sums, FusedGemmConfig)
  bool tma_partials = false;     // gemm_rs / gemm_ar, two ranks, fp32: the producer TMA-loads
                                 // the peer's partials of whole own tiles into the stage ring
                                 // for the epilogue
  bool tma_staging = false;      // gemm_rs with the outbox, fp32: a peer's slice is staged by
                                 // TMA stores from shared memory, not by the epilogue's global
                                 // stores
  bool tma_sends = false;        // two ranks, by TMA stores from the epilogue into the peer:
                                 // gemm_ar's own tiles' results, and without an outbox (small M)
                                 // with fp32 partials (tma_partials) a peer's tile's partials;
                                 // gemm_rs's (fp32) whole slices whose outbox slot is busy or
                                 // that have none - instead of the threads' stores (the side
                                 // threads' with an outbox); FusedGemmConfig::tma_sends
  std::string describe() const;  // one line
};

// ---- AllGather + GEMM --------------------------------------------------------------------------
// C[M, N] = concat over ranks r of A_r  @  op(B), on every rank, where
//   a_shard:   this rank's A_r, [M / world, K] row-major bf16 (any device memory)
//   b:         this rank's B, [N, K] (BLayout::kNK) or [K, N] (kKN) row-major bf16
//   c:         [M, N] row-major bf16 (any device memory)
//   workspace: ag_gemm_workspace_bytes(m, k) bytes inside a symmetric buffer (holds the gathered A)
//   gathered_a: optional [M, K] output of the gathered A (nullptr: not written)
// M divisible by the world size (shards of any number of rows); N and K multiples of 8.
// Each rank computes its own rows first while its shard is pushed to the peers, piece by piece;
// a peer's rows are computed once their pieces have arrived.
std::size_t ag_gemm_workspace_bytes(int64_t m, int64_t k);
void ag_gemm(Communicator& comm, const void* a_shard, const void* b, void* c, int64_t m, int64_t n,
             int64_t k, BLayout b_layout, void* workspace, cudaStream_t stream,
             const FusedGemmConfig& config = {}, void* gathered_a = nullptr);

// The plan ag_gemm follows for these arguments (throws on the errors ag_gemm would throw on).
FusedGemmPlan ag_gemm_plan(const Communicator& comm, int64_t m, int64_t n, int64_t k,
                           const FusedGemmConfig& config = {});

// ---- GEMM + ReduceScatter ----------------------------------------------------------------------
// out[M / world, N] on rank o = rows [o * M / world, (o + 1) * M / world) of
// sum over ranks r of A_r @ op(B_r), where
//   a:   this rank's A_r, [M, K_r] row-major bf16 (K_r = this rank's slice of K)
//   b:   this rank's B_r, [N, K_r] (BLayout::kNK) or [K_r, N] (kKN) row-major bf16
//   out: [M / world, N] row-major bf16 (any device memory)
//   workspace: gemm_rs_workspace_bytes(comm, m, n) bytes inside a symmetric buffer, all zero
//     before the first call (Communicator::alloc memory is not: clear it once); with three or
//     more ranks every call leaves it zero again (with two, the one peer's partial is stored, not
//     added: no zeroing needed). It holds this rank's fp32 accumulator [M / world, N].
// M divisible by the world size (shards of any number of rows); N and K_r multiples of 8.
// Sums are fp32 until the final rounding; with more than two ranks the order in which the peers'
// partial sums are added varies from run to run (the last bits may differ).
// Each rank computes the peers' rows first, reducing each tile into its owner's accumulator as
// it is produced, and its own rows last, adding the peers' sums in its epilogue.
std::size_t gemm_rs_workspace_bytes(int64_t m, int64_t n, int world_size);
// The same for this communicator: across nodes the workspace also holds, per other
// node, a relay accumulator, the staging of the node sum sent there and the sum received from
// there - 3 x nodes - 2 times the one-node size.
std::size_t gemm_rs_workspace_bytes(const Communicator& comm, int64_t m, int64_t n);
void gemm_rs(Communicator& comm, const void* a, const void* b, void* out, int64_t m, int64_t n,
             int64_t k_local, BLayout b_layout, void* workspace, cudaStream_t stream,
             const FusedGemmConfig& config = {});
FusedGemmPlan gemm_rs_plan(const Communicator& comm, int64_t m, int64_t n, int64_t k_local,
                           const FusedGemmConfig& config = {});

// ---- GEMM + AllReduce ----------------------------------------------------------------------
// out[M, N] = sum over ranks r of A_r @ op(B_r) on every rank, bitwise identical on all, where
//   a:   this rank's A_r, [M, K_r] row-major bf16 (any M >= 1)
//   b:   this rank's B_r, [N, K_r] (BLayout::kNK) or [K_r, N] (kKN) row-major bf16
//   out: [M, N] bf16 inside a symmetric buffer (same offset on every rank): peers write into it
//   workspace: gemm_ar_workspace_bytes(...) bytes in a symmetric buffer, zero before the first
//     call (with three or more ranks every call leaves it zero): this rank's accumulator of the
//     columns it owns - fp32 with three or more ranks; with two, half of it lives in `out` (see
//     src/fused/gemm_ar.cuh), so the workspace never exceeds the bf16 [M, N] intermediate
// N and K_r multiples of 8. Sums are fp32 until one final rounding by the rank that owns the
// column; with more than two ranks the order of the peers' additions varies between runs, but
// every rank always receives the same bits.
std::size_t gemm_ar_workspace_bytes(const Communicator& comm, int64_t m, int64_t n, int64_t k_local,
                                    const FusedGemmConfig& config = {});
void gemm_ar(Communicator& comm, const void* a, const void* b, void* out, int64_t m, int64_t n,
             int64_t k_local, BLayout b_layout, void* workspace, cudaStream_t stream,
             const FusedGemmConfig& config = {});
FusedGemmPlan gemm_ar_plan(const Communicator& comm, int64_t m, int64_t n, int64_t k_local,
                           const FusedGemmConfig& config = {});

}  // namespace mk
