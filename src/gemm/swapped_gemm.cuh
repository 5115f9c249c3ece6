// The GEMM engine at decode sizes: swapped operands, the tokens on the narrow side of the tile
// (docs/design/gemm_decode.md).
//
//   C^T [N, M] = B [N, K] A^T, written into C [M, N] (bf16, row-major)
//
// At M <= 64 a 128-row tile of M is mostly zero rows: each k-block still runs the whole wgmma, and
// half of every stage is A. Swapped, the weights B (nn.Linear's [N, K], K-major) take the wgmma's
// A side - 128 rows of N, 64 a consumer warpgroup, loaded exactly as the engine loads A - and the
// tokens A [M, K] (K-major too) its B side: kWidth = M rounded up to 8, 16, 32 or 64. The mainloop
// is gemm_kernel's, unchanged (TileConfig<kWidth>: a stage is 16 KB of weights + kWidth x 128
// bytes of tokens, so the ring holds 10-13 of them at the widths below 64); this policy only says
// where the operands come from and where the finished tile goes.
//
//   tile (m, n):  rows [128 m, 128 m + 128) of N by tokens [kWidth n, kWidth n + kWidth)
//   consumer c:   rows 128 m + 64 c .. + 64 of N; its accumulators: C^T's 64 x kWidth slice
//   epilogue:     transposed through shared memory into [kWidth tokens][64 N values] bf16, one
//                 TMA store of that box into C at (row kWidth n, column 128 m + 64 c); the store
//                 clips tokens >= M and columns >= N, nothing else is written
//   split K:      SplitSchedule, as the plain GEMM (a piece's slice: 64 x kWidth fp32 a consumer)
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>

#include <cstdint>

#include "gemm/gemm_kernel.cuh"
#include "mkernel/device/tma.cuh"

namespace mk::gemm_engine {

// The swapped tile's epilogue data path. A consumer's accumulators hold its 64 rows of N by
// kRegs * 2 tokens (wgmma.cuh's layout: thread t holds rows r and r + 8, r = 16 (t / 32) +
// (t % 32) / 4, and in each block j of 8 tokens the tokens 8 j + 2 (t % 4) + {0, 1}). C wants
// them the other way round: each value goes as bf16 into `buf` laid out as [tokens][64 N values],
// 128-byte rows swizzled as the TMA store reads them (row `token`'s 16-byte chunk c at c ^ (token
// % 8)), then thread 0 of the warpgroup calls issue(buf) - the TMA store - and commits it. The
// previous call's store must have read `buf`: thread 0 waits for it first (free in practice: a
// whole mainloop lies between). All 128 threads of the warpgroup call.
//
// Bank conflicts: for one register, a warp's 32 lanes write 8 consecutive rows (16 bytes: four
// 4-byte words, two lanes each) of 4 tokens whose chunks differ (token % 8 differs, the chunk is
// XORed with it), so 16 distinct banks; none conflict.
template <int kRegs, class Issue>
__device__ __forceinline__ void store_transposed(const float (&acc)[kRegs], int consumer,
                                                 uint8_t* buf, Issue&& issue) {
  constexpr int kBlocks = kRegs / 4;  // blocks of 8 tokens, 4 registers each
  constexpr int kRowBytes = 128;      // one token's 64 N values
  constexpr int kChunkBytes = 16;     // the swizzle's unit: 8 N values
  constexpr int kSwizzleRows = 8;     // rows of a 1024-byte swizzle atom
  const int t = threadIdx.x % 128;
  const int r = (t / 32) * 16 + (t % 32) / 4;
  const int token0 = 2 * (t % 4);
  const int barrier = 1 + consumer;
  if (t == 0) dev::bulk_wait_group_read<0>();
  dev::named_barrier_sync(barrier, 128);
#pragma unroll
  for (int j = 0; j < kBlocks; ++j) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {  // acc[4 j + e]: row r + 8 (e / 2), token 8 j + token0 + e % 2
      const int row = r + 8 * (e / 2), token = 8 * j + token0 + e % 2;
      const int chunk = (row / 8) ^ (token % kSwizzleRows);
      const __nv_bfloat16 v = __float2bfloat16_rn(acc[4 * j + e]);
      dev::st_shared_u16(buf + token * kRowBytes + chunk * kChunkBytes + (row % 8) * 2,
                         __bfloat16_as_ushort(v));
    }
  }
  dev::fence_proxy_async_shared();
  dev::named_barrier_sync(barrier, 128);
  if (t == 0) {
    issue(static_cast<const uint8_t*>(buf));
    dev::bulk_commit_group();
  }
}

// C [M, N] = A [M, K] B^T with B [N, K], the tokens (M) on the narrow side: see the top of the
// file. With kSplitK, the last wave's tiles in pieces of K (SplitSchedule): a kernel of its own,
// as PlainGemm's.
template <int kWidth, bool kSplitK = false>
struct SwappedGemm {
  static_assert(kWidth == 8 || kWidth == 16 || kWidth == 32 || kWidth == 64,
                "the tokens' widths of the swapped tile");
  static constexpr FusionTraits kTraits{.a_rows = true, .split_k = kSplitK};
  CUtensorMap w;         // the weights B [N, K], boxes of 128 rows x 64 (the wgmma's A operand)
  CUtensorMap w_last;    // B again, boxes of the last tile-row's rows x 64
  CUtensorMap c;         // C [M, N], boxes of kWidth rows (tokens) x 64 columns
  GroupedRaster raster;  // tiles_m: tile-rows of 128 of N; tiles_n: tiles of kWidth tokens
  int n;
  int last_rows;  // rows of N in the last tile-row (1..128)
  SplitSchedule split;

  __device__ int num_tiles() const { return split.num_items<kSplitK>(raster); }
  __device__ Tile tile(int t) const { return split.work_item<kSplitK>(raster, t); }
  struct ConsumerState {};

  __device__ void wait_operands(const Tile&) const {}
  __device__ bool last_row(const Tile& tile) const { return tile.m == raster.tiles_m - 1; }
  __device__ int a_rows(const Tile& tile) const { return last_row(tile) ? last_rows : 128; }
  __device__ void load_a(void* dst, uint64_t* bar, const Tile& tile, int k0) const {
    dev::tma_load_2d(dst, last_row(tile) ? &w_last : &w, bar, k0, tile.m * 128);
  }
  template <int kRegs>
  __device__ void store(float (&acc)[kRegs], const Tile& tile, int consumer, uint8_t* scratch,
                        ConsumerState&) const {
    static_assert(kRegs * 2 == kWidth, "a consumer's accumulators: 64 rows x kWidth tokens");
    const int row0 = tile.m * 128 + consumer * 64, token0 = tile.n * kWidth;
    if (row0 >= n) return;  // the last tile-row's second half past N: nothing to add or store
    if constexpr (kSplitK) {
      if (!split.gather(acc, tile.position, consumer, row0, n)) return;  // another piece stores
    }
    store_transposed(acc, consumer, scratch,
                     [&](const uint8_t* buf) { dev::tma_store_2d(&c, buf, row0, token0); });
  }
  __device__ void consumer_done(ConsumerState&) const {}
  __device__ void side_task(int, int) const {}
  __device__ void finish() const {}
};
template <int kWidth>
using SwappedSplitGemm = SwappedGemm<kWidth, true>;

// check_fusion for every width of the swapped tile.
template <template <int> class Policy>
constexpr bool check_swapped_widths() {
  return check_fusion<TileConfig<8>, Policy<8>>() && check_fusion<TileConfig<16>, Policy<16>>() &&
         check_fusion<TileConfig<32>, Policy<32>>() && check_fusion<TileConfig<64>, Policy<64>>();
}
static_assert(check_swapped_widths<SwappedGemm>());
static_assert(check_swapped_widths<SwappedSplitGemm>());

}  // namespace mk::gemm_engine
