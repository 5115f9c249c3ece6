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
#include "gemm/prefix_search.h"
#include "mkernel/device/launch.cuh"
#include "mkernel/device_comm.h"

namespace mk::gemm_engine {

// First rows, rows and first tiles of every group (one CTA of kPrepThreads, by block scans).
constexpr int kPrepThreads = 256;
//   capacity 0 (contiguous, padded): row_start[g] = sum of round_up(M_i, row_block) for i < g
//     (row_block 1: back to back; padded: kGroupedRowBlock), each M_i clamped to [0, room left in
//     max_rows]; capacity > 0 (masked): row_start[g] = g * capacity, M_g clamped to
//     [0, capacity]
//   row_count[g] = the clamped M_g
//   tile_prefix[g] = sum of ceil(M_i / 128) * tiles_n for i < g; [G] = all tiles; [G + 1] = 0,
//     the tile counter (GroupedGemm's dynamic tiles)
__global__ void grouped_prep_kernel(const int32_t* group_rows, int groups, int64_t max_rows,
                                    int64_t capacity, int row_block, int tiles_n,
                                    int32_t* row_start, int32_t* row_count, int32_t* tile_prefix);

// bf16 pairs straight from registers into c [.., n] (row-major): the thread's accumulator rows
// (r and r + 8 of a consumer's 64, from row0) below `rows`, and columns below n only. (The stores
// of GroupedGemm::store_masked; that one keeps its own copy: routed through here, GroupedGemm's
// compiled kernels changed.)
template <int kRegs>
__device__ __forceinline__ void store_rows_masked(const float (&acc)[kRegs], __nv_bfloat16* c,
                                                  int n, int row0, int rows, int col0) {
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
      *reinterpret_cast<__nv_bfloat162*>(c + static_cast<int64_t>(row0 + r + 8 * h) * n + col) =
          __floats2bfloat162_rn(acc[4 * b + 2 * h], acc[4 * b + 2 * h + 1]);
    }
  }
}

template <int kBlockN>
struct GroupedGemm {
  // B [G][...]: a tile's group is its third coordinate.
  static constexpr FusionTraits kTraits{
      .batched_b = true, .dynamic_tiles = true, .lean_epilogue = true};
  CUtensorMap a;             // A [rows, K] (all groups' rows), boxes of 128 rows x 64
  CUtensorMap c;             // C [rows, N], boxes of 64 rows x 64 columns
  __nv_bfloat16* c_ptr;      // C, for the masked stores at a group's end
  const int32_t* row_start;  // device [G] (prep kernel)
  const int32_t* row_count;  // device [G] (prep kernel)
  int32_t* tile_prefix;      // device [G + 1] (prep kernel), then the tile counter: zeroed by
                             // whoever writes the tables (the prep kernel; moe_dispatch_gemm's
                             // notify)
  int groups;
  int tiles_n;
  int n;

  struct ConsumerState {};

  __device__ int num_tiles() const { return tile_prefix[groups]; }
  // Skewed groups take different times a tile: the CTAs take the next tile when free.
  __device__ int* tile_counter() const { return tile_prefix + groups + 1; }

  __device__ Tile tile(int t) const {
    const int g = last_at_or_below(tile_prefix, groups, t);  // the group whose tiles hold t
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

  // kBuffers: the epilogue buffers a consumer of the kernel it runs in - its own configuration's
  // by default, or the configuration's of a policy that stores through it (MoeDispatchGemm).
  template <int kBuffers = EngineTileConfig<kBlockN, 128, kTraits.lean_epilogue>::kEpilogueBuffers,
            int kRegs>
  __device__ void store(const float (&acc)[kRegs], const Tile& tile, int consumer, uint8_t* scratch,
                        ConsumerState&) const {
    const int row0 = tile.row + consumer * 64, col0 = tile.n * kBlockN;
    const int rows = tile.rows - consumer * 64;  // of this slice inside the group
    if (rows >= 64) {
      store_slice<kBuffers>(acc, col0, n, consumer, scratch, [&](const uint8_t* buf, int j) {
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

// An MoE layer's two expert GEMMs in one launch: the gate / up projection with SwiGLU in its
// epilogue, then the down projection,
//   h_g[M_g, I] = silu(A_g Wg_g^T) * (A_g Wu_g^T),   y_g[M_g, H] = h_g W2_g^T,
// for w13 [G][2I, H] (nn.Linear's layout: the gate's I rows, then the up's I rows) and w2
// [G][H, I]; A, h, y and the groups' rows as GroupedGemm's (contiguous rows padded per group, or
// masked). One tile list: every gate / up tile (a tile-row of a group x I / kHalf columns), then
// every down tile (the same tile-rows x H / kBlockN columns); the persistent CTAs take them in
// order, so a down tile comes after all the tiles it needs, and its producer waits until the two
// consumers of each gate / up tile of its tile-row have stored their h (done[tile-row]; the
// communicator's time limit applies: a wait can only outlast it if CTAs of this launch are not
// resident - the caller runs it on the communicator's SM budget).
//   gate / up tile: kBlockN accumulator columns = gate columns [kHalf n, kHalf n + kHalf) next to
//     the up columns of the same range (load_b: a 5-D box over w13 viewed as
//     [G][2][I / kHalf][kHalf][H]), so a thread holds gate column c and up column c (registers
//     i and i + kRegs / 2) and computes h there in fp32, rounded to bf16 once; then its h
//     stores have landed before the count (bulk wait, fence, atomic).
//   down tile: B from w2 (3-D boxes), A = h (TMA after the count's acquire and a proxy fence).
// K differs per tile (H for gate / up, I for down): the tiles carry their k-blocks (split_k).
template <int kBlockN>
struct GroupedSwigluDown {
  static constexpr int kHalf = kBlockN / 2;
  static constexpr FusionTraits kTraits{.load_b = true, .split_k = true};
  DeviceComm comm;       // the time limit of the down tiles' waits
  CUtensorMap x;         // gate / up's A: the rows [rows, H], boxes of 128 x 64
  CUtensorMap h_a;       // down's A: h [rows, I], boxes of 128 x 64
  CUtensorMap h_c;       // gate / up's C: h, boxes of 64 x 64
  CUtensorMap y;         // down's C: [rows, H], boxes of 64 x 64
  CUtensorMap w13;       // (H, kHalf, I / kHalf, 2, G): boxes of 64 x kHalf x 1 x 2 x 1
  CUtensorMap w2;        // (I, H, G): boxes of 64 x kBlockN x 1
  __nv_bfloat16* h_ptr;  // h and y, for the masked stores at a group's end
  __nv_bfloat16* y_ptr;
  const int32_t* row_start;    // device [G] (prep kernel)
  const int32_t* row_count;    // device [G]
  const int32_t* tile_prefix;  // device [G + 1]: tile-rows before each group (prep, tiles_n 1)
  uint64_t* done;              // [tile-rows]: h halves stored (2 a gate / up tile), zeroed
  int groups;
  int tiles_up;    // I / kHalf
  int tiles_down;  // ceil(H / kBlockN)
  int inter;       // I
  int hidden;      // H
  int kb_up;       // ceil(H / 64): gate / up's k-blocks
  int kb_down;     // ceil(I / 64): down's

  struct ConsumerState {};

  __device__ int up_tiles() const { return tile_prefix[groups] * tiles_up; }
  __device__ int num_tiles() const { return tile_prefix[groups] * (tiles_up + tiles_down); }
  __device__ bool is_down(const Tile& tile) const { return tile.position >= up_tiles(); }
  __device__ int tile_row(const Tile& tile) const { return tile_prefix[tile.shard] + tile.m; }

  __device__ Tile tile(int t) const {
    const bool down = t >= up_tiles();
    const int tn = down ? tiles_down : tiles_up;
    const int u = down ? t - up_tiles() : t;
    const int g = last_at_or_below(tile_prefix, groups, u, tn);  // the group whose tiles hold u
    const int rows = row_count[g];
    Tile tile{0, 0, g};
    GroupedRaster{(rows + 127) / 128, tn}.tile(u - tile_prefix[g] * tn, tile.m, tile.n);
    tile.row = row_start[g] + tile.m * 128;
    tile.rows = min(128, rows - tile.m * 128);
    tile.position = t;
    tile.kb_begin = 0;
    tile.kb_end = down ? kb_down : kb_up;
    return tile;
  }

  // A down tile's h: every gate / up tile of its tile-row stored (2 x tiles_up halves).
  __device__ void wait_operands(const Tile& tile) const {
    if (!is_down(tile)) return;
    const uint64_t* word = done + tile_row(tile);
    const uint64_t expected = 2ull * static_cast<uint64_t>(tiles_up);
    if (!dev::reached(dev::ld_acquire_sys(word), expected)) {
      dev::Launch::begin(comm).wait_local(word, expected, static_cast<uint32_t>(tile_row(tile)));
    }
    dev::fence_proxy_async_global();  // the acquire above before the TMA reads of h
  }

  __device__ void load_a(void* dst, uint64_t* bar, const Tile& tile, int k0) const {
    dev::tma_load_2d(dst, is_down(tile) ? &h_a : &x, bar, k0, tile.row);
  }
  __device__ void load_b(void* dst, uint64_t* bar, const Tile& tile, int k0) const {
    if (is_down(tile)) {
      dev::tma_load_3d(dst, &w2, bar, k0, tile.n * kBlockN, tile.shard);
    } else {
      dev::tma_load_5d(dst, &w13, bar, k0, 0, tile.n, 0, tile.shard);
    }
  }

  template <int kRegs>
  __device__ void store(const float (&acc)[kRegs], const Tile& tile, int consumer, uint8_t* scratch,
                        ConsumerState&) const {
    static_assert(kRegs == kBlockN / 2, "a consumer's 64 rows of the tile");
    const int row0 = tile.row + consumer * 64;
    const int rows = tile.rows - consumer * 64;  // of this slice inside the group
    if (is_down(tile)) {
      const int col0 = tile.n * kBlockN;
      if (rows >= 64) {
        store_slice(acc, col0, hidden, consumer, scratch, [&](const uint8_t* buf, int j) {
          dev::tma_store_2d(&y, buf, col0 + 64 * j, row0);
        });
      } else if (rows > 0) {
        store_rows_masked(acc, y_ptr, hidden, row0, rows, col0);
      }
      return;
    }
    // silu(gate) * up with the fast division: IEEE `/` has a slow path (huge, tiny or
    // non-finite divisors; likely taken on the rows past a group's end, computed and dropped)
    // that made these tiles far slower than the plain GEMM where experts are many and small
    // (journal, 2026-12-02). __fdividef: 2 ulp, and 0 where exp(-gate) passes 2^126 (silu's
    // limit there).
    // h in place of the gate's half of the accumulators (the next tile's first wgmma overwrites
    // them: no register holds both; a separate h array spilled at moe_layer's 208 registers).
    float(&a)[kRegs] = const_cast<float(&)[kRegs]>(acc);
#pragma unroll
    for (int i = 0; i < kRegs / 2; ++i) {
      const float gate = a[i], up = a[i + kRegs / 2];
      a[i] = __fdividef(gate, 1.f + __expf(-gate)) * up;
    }
    const float(&h)[kRegs / 2] = reinterpret_cast<const float(&)[kRegs / 2]>(a);
    const int col0 = tile.n * kHalf;
    if (rows >= 64) {
      store_slice(h, col0, inter, consumer, scratch, [&](const uint8_t* buf, int j) {
        dev::tma_store_2d(&h_c, buf, col0 + 64 * j, row0);
      });
    } else if (rows > 0) {
      store_rows_masked(h, h_ptr, inter, row0, rows, col0);
    }
    // The half's h in memory, then counted: every thread's masked stores (the barrier), the
    // leader's TMA stores (it issued them: the bulk wait), then the release.
    dev::named_barrier_sync(1 + consumer, 128);
    if (threadIdx.x % 128 == 0) {
      dev::bulk_stores_landed();
      __threadfence();
      atomicAdd(reinterpret_cast<unsigned long long*>(done + tile_row(tile)), 1ull);
    }
  }

  __device__ void consumer_done(ConsumerState&) const {}
  __device__ void side_task(int, int) const {}
  __device__ void finish() const {}
};
static_assert(check_fusion<TileConfig<128>, GroupedSwigluDown<128>>());
static_assert(check_fusion<TileConfig<256>, GroupedSwigluDown<256>>());

}  // namespace mk::gemm_engine
