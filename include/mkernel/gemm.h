// mkernel/gemm.h - the GEMM engine on its own (the fused kernels compose the same pieces).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <string>

namespace mk {

enum class BLayout {
  kNK,  // B is [N, K] row-major (a torch.nn.Linear weight): C = A @ B^T
  kKN,  // B is [K, N] row-major: C = A @ B
};

// Where a grouped GEMM's groups keep their rows (grouped_gemm below).
enum class GroupedLayout {
  kContiguous,  // back to back: group g from row M_0 + ... + M_{g-1} of [rows, K] (prefill)
  kMasked,      // group g in its own block of `rows` rows (the capacity) of [G, rows, K], of
                // which the first M_g are used (decode: fixed shapes whatever the routing)
  kPadded,      // as kContiguous, but each group starts on a multiple of kGroupedRowBlock rows:
                // group g from the sum of round_up(M_i, 128) over i < g (moe_dispatch's layout)
};
constexpr int kGroupedRowBlock = 128;

struct GemmConfig {
  int block_m = 0;  // gemm: tile height 64 (one consumer warpgroup), 128, or 192 (three;
                    // widths 64 and 128); 0 = the library's choice (64 for M <= 64; past
                    // it the cost model's of 192 for M 129..192 - unless the width asked for
                    // is 192 or 256 -, 128, and 64 with K whole for M <= 512).
                    // grouped_gemm: 0 or 128.
  int block_n = 0;  // tile width 64, 128, 192 or 256 - gemm with 128-row tiles and K whole
                    // also 80 or 112 (B [N, K] only), 96, 144, 160 or 224; 0 = the library's
                    // choice (or MKERNEL_GEMM_BLOCK_N, when set)
  int sms = 0;      // persistent CTAs; 0 = every SM of the device
  int split_k = 0;  // gemm: at most this many pieces of K for the tiles of the last, partial
                    // wave (1..8; 1: none; fewer where that many would not fit in one round of
                    // the CTA clusters: gemm_plan says); 0 = the library's choice
};

// What gemm() will do for a shape (GemmPlan::describe() prints it; MKERNEL_PRINT_CONFIG=1 too).
// The choice minimises a cost model of the H200 fitted to bench_gemm's sweep (src/gemm/plan.cpp):
// per CTA, the k-blocks it runs times the time of one (the larger of its wgmma time and its
// loads at the L2 rate the active CTAs share), against the HBM floor at the rate that many CTAs
// can pull, plus split K's sum of the pieces.
struct GemmPlan {
  int block_m = 128;             // tile height (tiles are block_m x block_n x 64)
  int block_n = 0;               // tile width
  int ctas = 0;                  // persistent CTAs
  int64_t tiles = 0;             // output tiles
  int64_t whole_tiles = 0;       // of which computed whole, one CTA each (the full waves)
  int split_k = 1;               // the rest: each in this many pieces of K, on as many CTAs
                                 // (one thread-block cluster a tile, all in one round)
  double estimate_us = 0;        // the model's estimate
  std::string describe() const;  // one line: what and why
};
// The plan gemm() follows for B in `b_layout` (throws on the configuration errors gemm() would
// throw on). `sms`: config.sms, or the current device's SM count.
GemmPlan gemm_plan(int64_t m, int64_t n, int64_t k, const GemmConfig& config = {},
                   BLayout b_layout = BLayout::kNK);

// C[M, N] = A[M, K] @ op(B), bf16 in and out, fp32 accumulation, on `stream`.
//   A: [M, K] row-major bf16, 16-byte aligned; any M >= 1.
//   B: [N, K] (BLayout::kNK) or [K, N] (kKN) row-major bf16, 16-byte aligned.
//   C: [M, N] row-major bf16 (leading dimension N).
//   N and K multiples of 8 (16-byte rows); partial tiles are handled.
// Throws mk::Error before launching on anything else. Where the plan splits K (few tiles, long
// K: gemm_plan), a tile's pieces run as one thread-block cluster and add up their fp32 sums in
// its shared memory: one kernel, no workspace, the same bits on every run. split_k = 1 never
// splits.
void gemm(const void* a, const void* b, void* c, int64_t m, int64_t n, int64_t k, BLayout b_layout,
          cudaStream_t stream, const GemmConfig& config = {});

// Grouped GEMM (the MoE experts' layout): C_g = A_g @ op(B_g) for every group g < groups, shared
// N and K, the row counts M_g in device memory - e.g. tokens per expert computed on the GPU, so
// nothing waits for the host; capturable in CUDA graphs with the counts changing between replays.
// Groups without rows cost nothing; a group's tiles spread over all SMs like any others.
//   layout kContiguous (`rows` = max_rows):
//     a:          [max_rows, K] bf16: the groups' rows back to back (group g starts at row
//                 M_0 + ... + M_{g-1})
//     c:          [max_rows, N] bf16, rows as in a; rows past the groups' total are not written
//     group_rows: device int32 [groups]; a negative count counts as 0; rows past max_rows are
//                 dropped (keep the sum <= max_rows)
//   layout kPadded (`rows` = max_rows): as kContiguous, group g from row sum over i < g of
//                 round_up(M_i, 128); the rows between groups are neither read into a group's
//                 result nor written
//   layout kMasked (`rows` = the capacity of a group):
//     a:          [groups, rows, K] bf16: group g's rows at [g, 0 .. M_g)
//     c:          [groups, rows, N] bf16: [g, 0 .. M_g) written, the rest of each block not
//     group_rows: device int32 [groups]; counts clamp to [0, rows]
//   b:            [groups, N, K] (BLayout::kNK) or [groups, K, N] (kKN) bf16
// N and K multiples of 8, 1 <= groups <= 65536, the rows of A below 2^31. Throws mk::Error before
// launching on anything else. Uses a little stream-ordered scratch (cudaMallocAsync).
void grouped_gemm(const void* a, const void* b, void* c, const int32_t* group_rows, int groups,
                  int64_t rows, int64_t n, int64_t k, BLayout b_layout, cudaStream_t stream,
                  const GemmConfig& config = {}, GroupedLayout layout = GroupedLayout::kContiguous);

}  // namespace mk
