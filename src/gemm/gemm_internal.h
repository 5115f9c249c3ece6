// Internal interface of the GEMM engine, shared by the fused kernels and the tests.
#pragma once

#include <cuda.h>
#include <cuda_runtime_api.h>

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "mkernel/device_comm.h"
#include "mkernel/error.h"
#include "mkernel/gemm.h"

namespace mk {

namespace gemm_engine {
// Tensor map of `rank` (<= 5) dimensions, innermost first (strides: of dimensions 1.., in bytes),
// 128-byte swizzle (boxes 128 bytes wide; `swizzle` another, boxes as wide as it); out-of-bounds
// reads as zero, writes are dropped.
CUtensorMap encode_map(const void* base, int rank, const cuuint64_t* dims,
                       const cuuint64_t* strides, const cuuint32_t* box,
                       CUtensorMapDataType type = CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
                       CUtensorMapSwizzle swizzle = CU_TENSOR_MAP_SWIZZLE_128B);
// 2-D tensor map over a row-major [rows, cols] bf16 matrix, boxes of [box_rows, box_cols] swizzled
// at their width: 64 cols 128 bytes; 32 or 16 (B [K, N]'s last columns at a step width, as
// wgmma_desc_mn_tail reads them) 64 or 32 bytes. Out-of-bounds reads as zero, writes are dropped.
CUtensorMap make_map(const void* base, int64_t rows, int64_t cols, int box_rows, int box_cols = 64);
// fp32 [rows, cols] row-major, boxes of [box_rows, 32 cols] (128 bytes), 128-byte swizzle.
CUtensorMap make_map_fp32(void* base, int64_t rows, int64_t cols, int box_rows);
// A bf16 [rows, cols] row-major matrix (cols a multiple of 8) seen as fp32 row pairs: row pair p,
// half h (0: row 2p, 1: row 2p + 1), fp32 column c - a box of [64 pairs, one half, 32 columns]
// is 64 rows of 128 bytes, 128-byte swizzle (the outbox's staging slots in gemm_rs's output).
CUtensorMap make_map_fp32_row_pairs(void* base, int64_t rows, int64_t cols);
// The same over [batches, rows, cols] (boxes of one batch): rows clip at each batch's end.
CUtensorMap make_map_3d(const void* base, int64_t batches, int64_t rows, int64_t cols,
                        int box_rows);
// B's map: [N, K] row-major (k_major_rows false) or [K, N] row-major (true).
CUtensorMap make_b_map(const void* b, int64_t n, int64_t k, int block_n, bool k_major_rows);
// `p` is device memory of `device` (aligned to `alignment` bytes), else mk::Error naming `op`
// and `name`.
void require_device_pointer(const void* p, const char* op, const char* name, int device,
                            std::size_t alignment = 16);
// Throws kInvalidArgument "op: N = 12; expected a multiple of 8" (what = "N") unless 8 | value.
void require_multiple_of_8(int64_t value, const char* op, const char* what);

// Tile width for an [m, n] output on `sms` CTAs: `requested` if not 0 (the caller's config, or
// MKERNEL_GEMM_BLOCK_N folded into it), else the width with the fewest estimated tile-waves of
// block_m-row tiles. Throws (naming `op`) on a bad width.
int pick_block_n(int requested, int64_t m, int64_t n, int sms, const char* op, int block_m = 128);

// Split K runs a tile's pieces as one thread-block cluster (gemm_kernel.cuh, SplitSchedule): at
// most the portable cluster size of pieces.
constexpr int kMaxSplit = 8;
// CTAs a device runs at once in clusters of p, at index p = 2..kMaxSplit (a cluster's CTAs share
// a GPC, so fewer than the SMs where a GPC's SMs are not a multiple of p).
using ClusterCtas = std::array<int, kMaxSplit + 1>;
// The stand-in without a device: every SM in some cluster, (sms / p) * p.
ClusterCtas even_clusters(int sms);

// The plain GEMM's tile widths between the four multiples of 64, in steps of 16: with B [N, K],
// 128-row tiles and K whole, where the last wave of a multiple of 64 would leave SMs idle (e.g.
// 640 x 2048: 130 tiles 80 wide, one wave, against 80 128 wide on 132 SMs).
inline constexpr int kStepWidths[] = {80, 96, 112, 144, 160, 224};
template <std::size_t kCount>
constexpr bool is_one_of(const int (&widths)[kCount], int block_n) {
  for (int w : widths) {
    if (w == block_n) return true;
  }
  return false;
}
constexpr bool is_step_width(int block_n) { return is_one_of(kStepWidths, block_n); }
// Those that B [K, N] takes too: past its 64-column boxes a last 16 or 32 columns, one box of
// their own with the swizzle of their width (make_map's box_cols) and a wgmma of their own. Not 112
// (its 48 would take two) nor 80: its 16-column wgmma is a fifth of the tile, and 128 x 80 ran
// 1.17x the four widths' plan at 640 x 2048 x 7168 (H100, 2026-12-07; 144's 16 are a ninth).
inline constexpr int kKnStepWidths[] = {96, 144, 160, 224};
constexpr bool is_kn_step_width(int block_n) { return is_one_of(kKnStepWidths, block_n); }

// gemm()'s plan on `sms` CTAs (`clusters`: how many of them run in clusters of p) for B in
// `b_layout`: the requested height (0: the library's), width (0: any) and split (0: any, 1:
// none; else at most this many pieces) or the cost model's best (src/gemm/plan.cpp). Throws
// (naming `op`) on a bad height, width or split.
// step_widths false: the four widths only (the plan tests' judge of candidates measured before
// the step widths existed).
GemmPlan plan_gemm(int64_t m, int64_t n, int64_t k, BLayout b_layout, int sms,
                   int requested_block_m, int requested_block_n, int requested_split_k,
                   const char* op, const ClusterCtas& clusters, bool step_widths = true);
}  // namespace gemm_engine

namespace gemm_engine {
// An MoE layer's two expert GEMMs in one launch (grouped_gemm.cuh, GroupedSwigluDown; moe_layer's
// launch builds on it): h[rows, I] = silu(A Wg^T) * (A Wu^T) and y[rows, H] = h W2^T per group,
// w13 [groups][2I, H] bf16 (the gate's I rows, then the up's), w2 [groups][H, I], A [rows, H];
// I a multiple of 64, H of 8. Every CTA must be resident (the down tiles wait for the gate / up
// tiles of their rows). The tile-rows' done counters: swiglu_down_counters_bytes.
std::size_t swiglu_down_counters_bytes(int groups, int64_t total_rows);
// The two GEMMs' tile width for these rows: block_n if not 0 (checked), else chosen.
int swiglu_down_width(int block_n, int64_t total_rows, int groups, int64_t intermediate, int sms,
                      const char* op);
// The policy, its tensor maps encoded:
// tables: row_start [groups], row_count [groups], tile_prefix [groups + 1] with one tile per
// tile-row (grouped_table_ints, the counter unused here); done: the tile-rows' counters, zeroed
// before the launch.
template <int kBlockN>
struct GroupedSwigluDown;
template <int kBlockN>
GroupedSwigluDown<kBlockN> swiglu_down_policy(const DeviceComm& comm, const void* a,
                                              const void* w13, const void* w2, void* h, void* y,
                                              const int32_t* tables, uint64_t* done, int groups,
                                              int64_t total_rows, int64_t intermediate,
                                              int64_t hidden);
// mk::grouped_gemm with the group tables in `tables` (as swiglu_down_policy's; nullptr:
// stream-ordered scratch, what the public function does).
void grouped_gemm(const void* a, const void* b, void* c, const int32_t* group_rows, int groups,
                  int64_t rows, int64_t n, int64_t k, BLayout b_layout, cudaStream_t stream,
                  const GemmConfig& config, GroupedLayout layout, int32_t* tables);
// The group tables' ints: row_start, row_count [groups], tile_prefix [groups + 1], the tile
// counter (GroupedGemm's dynamic tiles).
constexpr int64_t grouped_table_ints(int64_t groups) { return 3 * groups + 2; }
std::size_t grouped_tables_bytes(int groups);
// The group tables alone (row_start, row_count, tile_prefix with tiles_n tiles a tile-row, the
// tile counter zeroed) of grouped_gemm's `rows` and `layout`, into `tables`
// (grouped_tables_bytes), on the stream.
void grouped_tables(const int32_t* group_rows, int groups, int64_t rows, GroupedLayout layout,
                    int tiles_n, int32_t* tables, cudaStream_t stream);
// The SwiGLU GEMMs' I: a positive multiple of 64 below 2^30, else kInvalidArgument naming
// `op` and the value.
void require_swiglu_intermediate(int64_t intermediate, const char* op);
// The SwiGLU GEMMs' tile width: 0 (chosen), 128 or 256 (256: I a multiple of 128), else
// kInvalidArgument naming `op`, the argument's `name` and the value.
void require_swiglu_width(int block_n, int64_t intermediate, const char* op, const char* name);
// Loads the grouped GEMM's kernels (every width and B layout) now, with the communicator's
// kernels: none loads lazily behind a peer's kernel that waits.
void preload_grouped();
}  // namespace gemm_engine

namespace gemm_engine {
// Stream-ordered scratch: cudaMallocAsync when made, cudaFreeAsync on the same stream when it
// goes out of scope - after whatever was enqueued meanwhile, on success and on a throw alike.
class StreamScratch {
 public:
  StreamScratch(std::size_t bytes, cudaStream_t stream) : stream_(stream) {
    const cudaError_t err = cudaMallocAsync(&p_, bytes, stream);
    if (err != cudaSuccess) {
      p_ = nullptr;
      throw Error(ErrorCode::kCuda, std::string("stream-ordered scratch of ") +
                                        std::to_string(bytes) +
                                        " bytes: " + cudaGetErrorString(err));
    }
  }
  ~StreamScratch() {
    if (p_ != nullptr) cudaFreeAsync(p_, stream_);
  }
  StreamScratch(const StreamScratch&) = delete;
  StreamScratch& operator=(const StreamScratch&) = delete;
  void* get() const { return p_; }

 private:
  void* p_ = nullptr;
  cudaStream_t stream_;
};
}  // namespace gemm_engine

struct GemmKernelResources {
  std::string name;
  int registers;        // per thread, as compiled (setmaxnreg moves them between roles)
  int64_t local_bytes;  // local memory per thread: spills or stack; must be 0
  int64_t max_dynamic_smem;
};

namespace detail {
// Every GEMM kernel instantiation the library launches, with its compiled resources.
std::vector<GemmKernelResources> gemm_kernel_resources();
// One kernel's compiled resources (cudaFuncGetAttributes), under `name`.
GemmKernelResources kernel_resources(std::string name, const void* kernel);
}  // namespace detail

}  // namespace mk
