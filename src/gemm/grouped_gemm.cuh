// Grouped GEMM as a Fusion policy of the GEMM engine (gemm_kernel.cuh): G problems
// C_g[M_g, N] = A_g[M_g, K] op(B_g) with shared N and K, the row counts M_g in device memory
// (e.g. tokens per expert, computed on the GPU: no host synchronisation).
//
// A and C hold the groups' rows back to back ([max_rows, K] and [max_rows, N]), or each group
// in a block of `capacity` rows ([G, capacity, K] and [G, capacity, N], the masked layout); B is
// [G][N, K] or [G][K, N]. A prep kernel turns the row counts into each group's first row, its
// rows and its first tile (device scratch); the persistent CTAs walk the tiles of all groups in
// order, group by group (binary search of the tile prefix), with the grouped raster inside a
// group. A tile's A box may run past its group into the next group's rows: those rows are
// computed and dropped. The epilogue stores with TMA where the 64-row slice lies inside the
// group and with masked stores from registers where it crosses the group's end.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "gemm/gemm_kernel.cuh"

namespace mk::gemm_engine {

// First rows, rows and first tiles of every group (one CTA of kPrepThreads, by block scans).
constexpr int kPrepThreads = 256;
//   capacity 0 (contiguous, padded): row_start[g] = sum of round_up(M_i, row_block) for i < g
//     (row_block 1: back to back; padded: kGroupedRowBlock), each M_i clamped to [0, room left in
//     max_rows]; capacity > 0 (masked): row_start[g] = g * capacity, M_g clamped to
//     [0, capacity]
//   row_count[g] = the clamped M_g
//   tile_prefix[g] = sum of ceil(M_i / 128) * tiles_n for i < g; [G] = all tiles
__global__ void grouped_prep_kernel(const int32_t* group_rows, int groups, int64_t max_rows,
                                    int64_t capacity, int row_block, int tiles_n,
                                    int32_t* row_start, int32_t* row_count, int32_t* tile_prefix);

template <int kBlockN>
struct GroupedGemm {
  // B [G][...]: a tile's group is its third coordinate.
  static constexpr FusionTraits kTraits{.batched_b = true};
  CUtensorMap a;               // A [rows, K] (all groups' rows), boxes of 128 rows x 64
  CUtensorMap c;               // C [rows, N], boxes of 64 rows x 64 columns
  __nv_bfloat16* c_ptr;        // C, for the masked stores at a group's end
  const int32_t* row_start;    // device [G] (prep kernel)
  const int32_t* row_count;    // device [G] (prep kernel)
  const int32_t* tile_prefix;  // device [G + 1] (prep kernel)
  int groups;
  int tiles_n;
  int n;

  struct ConsumerState {};

  __device__ int num_tiles() const { return tile_prefix[groups]; }

  __device__ Tile tile(int t) const {
    int lo = 0, hi = groups - 1;  // the last group whose first tile is <= t
    while (lo < hi) {
      const int mid = (lo + hi + 1) / 2;
      if (tile_prefix[mid] <= t) {
        lo = mid;
      } else {
        hi = mid - 1;
      }
    }
    const int g = lo;
    const int first_row = row_start[g];
    const int rows = row_count[g];
    Tile tile{0, 0, g};
    GroupedRaster{(rows + 127) / 128, tiles_n}.tile(t - tile_prefix[g], tile.m, tile.n);
    tile.row = first_row + tile.m * 128;
    tile.rows = min(128, rows - tile.m * 128);
    return tile;
  }

  __device__ void wait_operands(const Tile&) const {}

  __device__ void load_a(void* dst, uint64_t* bar, const Tile& tile, int k0) const {
    dev::tma_load_2d(dst, &a, bar, k0, tile.row);
  }

  template <int kRegs>
  __device__ void store(const float (&acc)[kRegs], const Tile& tile, int consumer, uint8_t* scratch,
                        ConsumerState&) const {
    const int row0 = tile.row + consumer * 64, col0 = tile.n * kBlockN;
    const int rows = tile.rows - consumer * 64;  // of this slice inside the group
    if (rows >= 64) {
      store_slice(acc, col0, n, consumer, scratch, [&](const uint8_t* buf, int j) {
        dev::tma_store_2d(&c, buf, col0 + 64 * j, row0);
      });
    } else if (rows > 0) {
      store_masked(acc, row0, rows, col0);
    }
  }

  // bf16 pairs straight from registers, rows < `rows` of the slice and columns < n only.
  template <int kRegs>
  __device__ void store_masked(const float (&acc)[kRegs], int row0, int rows, int col0) const {
    const int t = threadIdx.x % 128;
    const int r = (t / 32) * 16 + (t % 32) / 4;
    const int col_base = col0 + 2 * (t % 4);
#pragma unroll
    for (int b = 0; b < kRegs / 4; ++b) {
      const int col = col_base + 8 * b;
      if (col >= n) continue;  // n is a multiple of 8: col + 1 < n as well
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        if (r + 8 * h >= rows) continue;
        *reinterpret_cast<__nv_bfloat162*>(c_ptr + static_cast<int64_t>(row0 + r + 8 * h) * n +
                                           col) =
            __floats2bfloat162_rn(acc[4 * b + 2 * h], acc[4 * b + 2 * h + 1]);
      }
    }
  }

  __device__ void consumer_done(ConsumerState&) const {}
  __device__ void side_task(int, int) const {}
  __device__ void finish() const {}
};
static_assert(check_fusion_widths<GroupedGemm>());

// The gate / up projection of an MoE layer's experts with SwiGLU in the epilogue:
//   h_g[M_g, I] = silu(A_g Wg_g^T) * (A_g Wu_g^T)
// for w13 [G][2I, H] (nn.Linear's layout: the gate's I rows, then the up's I rows). A tile of
// kBlockN accumulator columns is gate columns [kHalf n, kHalf n + kHalf) next to the up columns of
// the same range (kHalf = kBlockN / 2): load_b fetches the two kHalf-row boxes of w13 into one
// stage (a 5-D box over w13 viewed as [G][2][I / kHalf][kHalf][H]), so a thread holds gate column
// c and up column c (accumulator registers i and i + kRegs / 2) and computes h there, in fp32,
// rounded to bf16 once. Tiles are 128 x kBlockN (kHalf h columns each; I a multiple of kHalf);
// rows, groups and layouts as GroupedGemm's.
template <int kBlockN>
struct GroupedSwiglu : GroupedGemm<kBlockN> {
  using Base = GroupedGemm<kBlockN>;
  using typename Base::ConsumerState;
  static constexpr int kHalf = kBlockN / 2;
  static constexpr FusionTraits kTraits{.load_b = true};
  CUtensorMap w13;  // (H, kHalf, I / kHalf, 2, G): boxes of 64 x kHalf x 1 x 2 x 1

  __device__ void load_b(void* dst, uint64_t* bar, const Tile& tile, int k0) const {
    dev::tma_load_5d(dst, &w13, bar, k0, 0, tile.n, 0, tile.shard);
  }

  // tiles_n = I / kHalf and n = I (GroupedGemm's fields): h's columns.
  template <int kRegs>
  __device__ void store(const float (&acc)[kRegs], const Tile& tile, int consumer, uint8_t* scratch,
                        ConsumerState&) const {
    static_assert(kRegs == kBlockN / 2, "a consumer's 64 rows of the tile's gate and up columns");
    float h[kRegs / 2];
#pragma unroll
    for (int i = 0; i < kRegs / 2; ++i) {
      const float gate = acc[i], up = acc[i + kRegs / 2];
      h[i] = gate / (1.f + __expf(-gate)) * up;
    }
    const int row0 = tile.row + consumer * 64, col0 = tile.n * kHalf;
    const int rows = tile.rows - consumer * 64;
    if (rows >= 64) {
      store_slice(h, col0, this->n, consumer, scratch, [&](const uint8_t* buf, int j) {
        dev::tma_store_2d(&this->c, buf, col0 + 64 * j, row0);
      });
    } else if (rows > 0) {
      this->store_masked(h, row0, rows, col0);
    }
  }
};
static_assert(check_fusion<TileConfig<128>, GroupedSwiglu<128>>());
static_assert(check_fusion<TileConfig<256>, GroupedSwiglu<256>>());

}  // namespace mk::gemm_engine
