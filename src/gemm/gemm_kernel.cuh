// The GEMM engine's kernel: persistent, warp-specialised, TMA + wgmma (sm_90a).
//
//   C[M, N] (bf16) = A[M, K] (bf16, row-major) * B^T, fp32 accumulation, where B is [N, K]
//   row-major (the nn.Linear weight layout, K-major tiles) or, with kTransB, [K, N] row-major
//   (N-major tiles: the B stage holds kBlockN / 64 boxes of [64 K rows][64 N values]).
//
// One CTA per SM. Warpgroup 0 is the producer (one thread issues TMA loads of A and B tiles into
// a ring of kStages shared-memory stages); warpgroups 1..kConsumers are consumers, each owning 64
// rows of the 128-row tile and issuing wgmma on them. The pieces, so that fused kernels can swap
// them:
//   Scheduler  - which output tile a CTA computes next (and, in fused kernels, what it must wait
//                for before loading operands)
//   mainloop   - the stage ring: full/empty mbarriers, TMA loads, wgmma (knows nothing of comms)
//   Epilogue   - where an accumulator tile goes (here: bounds-checked bf16 stores to C)
//
//   stage s:  [ A tile (128 x 64) | B tile (kBlockN x 64) ]   both 128-byte swizzled, K-major
//   producer: wait empty[s] -> arm full[s] with the stage's bytes -> TMA A, TMA B
//   consumer: wait full[s] -> 4 x wgmma k16 -> commit; once the previous stage's group retired,
//             arrive empty[prev]
// Partial tiles: TMA reads out-of-bounds elements as zero (K, M and N tails), the epilogue masks
// its stores.
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>

#include <cstdint>

#include "mkernel/device/mbarrier.cuh"
#include "mkernel/device/tma.cuh"
#include "mkernel/device/wgmma.cuh"

namespace mk::gemm_engine {

template <int kBlockN_>
struct TileConfig {
  static constexpr int kBlockM = 128;       // 2 consumer warpgroups x 64 rows
  static constexpr int kBlockN = kBlockN_;  // 256 or 128
  static constexpr int kBlockK = 64;        // 64 bf16 = 128 bytes = one swizzle row
  static constexpr int kConsumers = 2;
  static constexpr int kThreads = 128 * (1 + kConsumers);
  static constexpr int kABytes = kBlockM * kBlockK * 2;
  static constexpr int kBBytes = kBlockN * kBlockK * 2;
  static constexpr int kStageBytes = kABytes + kBBytes;
  static constexpr int kStages = kBlockN == 256 ? 4 : 6;
  static constexpr int kAccRegs = kBlockN / 2;  // fp32 accumulators per consumer thread
  // Stages, then the barriers; +1024 to align the stages to the 1024-byte swizzle atom.
  static constexpr int kSmemBytes = kStages * kStageBytes + 2 * kStages * 8 + 1024;
  static constexpr int kProducerRegs = 40;
  static constexpr int kConsumerRegs = 232;
  static_assert(kSmemBytes <= 227 * 1024, "shared memory per CTA on sm_90");
  static_assert(kBlockN == 128 || kBlockN == 256, "wgmma shapes instantiated in wgmma.cuh");
};

// Persistent tile order: CTAs walk tiles t = blockIdx.x, blockIdx.x + gridDim.x, ...; tiles are
// numbered in groups of kGroupM tile-rows, column by column inside a group, so the CTAs running
// at the same time share A rows and B columns in L2.
struct TileScheduler {
  static constexpr int kGroupM = 16;
  int tiles_m;
  int tiles_n;

  __device__ int num_tiles() const { return tiles_m * tiles_n; }
  __device__ void tile(int t, int& tm, int& tn) const {
    const int per_group = kGroupM * tiles_n;
    const int first_m = (t / per_group) * kGroupM;
    const int rows = min(tiles_m - first_m, kGroupM);
    const int in_group = t % per_group;
    tm = first_m + in_group % rows;
    tn = in_group / rows;
  }
};

// Stores a consumer's 64 x kBlockN accumulator slice as bf16, masking rows >= M and cols >= N.
struct StoreEpilogue {
  __nv_bfloat16* c;
  int64_t ldc;
  int m;
  int n;

  template <int kRegs>
  __device__ void operator()(const float (&acc)[kRegs], int row0, int col0) const {
    const int t = threadIdx.x % 128;
    const int row = row0 + (t / 32) * 16 + (t % 32) / 4;
    const int col_base = col0 + 2 * (t % 4);
#pragma unroll
    for (int j = 0; j < kRegs / 4; ++j) {
      const int col = col_base + 8 * j;
      if (col >= n) continue;  // n is a multiple of 8: col + 1 < n as well
      if (row < m) {
        *reinterpret_cast<__nv_bfloat162*>(c + row * ldc + col) =
            __floats2bfloat162_rn(acc[4 * j], acc[4 * j + 1]);
      }
      if (row + 8 < m) {
        *reinterpret_cast<__nv_bfloat162*>(c + (row + 8) * ldc + col) =
            __floats2bfloat162_rn(acc[4 * j + 2], acc[4 * j + 3]);
      }
    }
  }
};

template <int kBlockN, bool kTransB>
__device__ __forceinline__ void wgmma_tile_k16(float (&acc)[kBlockN / 2], uint64_t da, uint64_t db,
                                               bool accumulate) {
  if constexpr (kBlockN == 256) {
    dev::wgmma_m64n256k16_bf16<kTransB>(acc, da, db, accumulate);
  } else {
    dev::wgmma_m64n128k16_bf16<kTransB>(acc, da, db, accumulate);
  }
}

// B box of an N-major stage: 64 K rows x 64 N values (128 bytes a row).
constexpr int kMnBoxBytes = 64 * 128;

template <class Cfg, bool kTransB, class Epilogue>
__global__ void __launch_bounds__(Cfg::kThreads, 1)
    gemm_kernel(const __grid_constant__ CUtensorMap tma_a,
                const __grid_constant__ CUtensorMap tma_b, int k, TileScheduler scheduler,
                Epilogue epilogue) {
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem =
      reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t{1023});
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + Cfg::kStages * Cfg::kStageBytes);
  uint64_t* empty = full + Cfg::kStages;
  auto stage_a = [&](int s) { return smem + s * Cfg::kStageBytes; };
  auto stage_b = [&](int s) { return smem + s * Cfg::kStageBytes + Cfg::kABytes; };

  if (threadIdx.x == 0) {
    for (int s = 0; s < Cfg::kStages; ++s) {
      dev::mbarrier_init(&full[s], 1);
      dev::mbarrier_init(&empty[s], Cfg::kConsumers);
    }
    dev::mbarrier_init_fence();
  }
  __syncthreads();

  const int k_iters = (k + Cfg::kBlockK - 1) / Cfg::kBlockK;
  const int warpgroup = threadIdx.x / 128;

  if (warpgroup == 0) {
    // ---- producer ----
    dev::warpgroup_reg_dealloc<Cfg::kProducerRegs>();
    if (threadIdx.x == 0) {
      dev::tma_prefetch_descriptor(&tma_a);
      dev::tma_prefetch_descriptor(&tma_b);
      int it = 0;  // k-iterations issued by this CTA, across tiles: position in the stage ring
      for (int t = blockIdx.x; t < scheduler.num_tiles(); t += gridDim.x) {
        int tm, tn;
        scheduler.tile(t, tm, tn);
        for (int kb = 0; kb < k_iters; ++kb, ++it) {
          const int s = it % Cfg::kStages;
          const uint32_t phase = (it / Cfg::kStages) & 1;
          dev::mbarrier_wait(&empty[s], phase ^ 1);  // first lap passes at once
          dev::mbarrier_arrive_expect_tx(&full[s], Cfg::kStageBytes);
          dev::tma_load_2d(stage_a(s), &tma_a, &full[s], kb * Cfg::kBlockK, tm * Cfg::kBlockM);
          if constexpr (kTransB) {
#pragma unroll
            for (int j = 0; j < Cfg::kBlockN / 64; ++j) {
              dev::tma_load_2d(stage_b(s) + j * kMnBoxBytes, &tma_b, &full[s],
                               tn * Cfg::kBlockN + j * 64, kb * Cfg::kBlockK);
            }
          } else {
            dev::tma_load_2d(stage_b(s), &tma_b, &full[s], kb * Cfg::kBlockK, tn * Cfg::kBlockN);
          }
        }
      }
    }
  } else {
    // ---- consumers ----
    dev::warpgroup_reg_alloc<Cfg::kConsumerRegs>();
    const int consumer = warpgroup - 1;  // rows [64 * consumer, 64 * consumer + 64) of the tile
    const bool leader = threadIdx.x % 128 == 0;
    float acc[Cfg::kAccRegs];
    int it = 0;
    for (int t = blockIdx.x; t < scheduler.num_tiles(); t += gridDim.x) {
      int tm, tn;
      scheduler.tile(t, tm, tn);
      for (int kb = 0; kb < k_iters; ++kb, ++it) {
        const int s = it % Cfg::kStages;
        const uint32_t phase = (it / Cfg::kStages) & 1;
        dev::mbarrier_wait(&full[s], phase);
        dev::wgmma_fence_operands(acc);
        dev::wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < Cfg::kBlockK / 16; ++kk) {
          const uint64_t da = dev::wgmma_desc_sw128(stage_a(s) + consumer * 64 * 128 + kk * 32);
          const uint64_t db =
              kTransB ? dev::wgmma_desc_sw128_mn(stage_b(s) + kk * 16 * 128, kMnBoxBytes)
                      : dev::wgmma_desc_sw128(stage_b(s) + kk * 32);
          wgmma_tile_k16<Cfg::kBlockN, kTransB>(acc, da, db, kb > 0 || kk > 0);
        }
        dev::wgmma_commit();
        dev::wgmma_fence_operands(acc);
        // The group of the previous stage has retired once at most this one is pending.
        dev::wgmma_wait<1>();
        if (kb > 0 && leader) dev::mbarrier_arrive(&empty[(it - 1) % Cfg::kStages]);
      }
      dev::wgmma_wait<0>();
      dev::wgmma_fence_operands(acc);
      if (leader && k_iters > 0) dev::mbarrier_arrive(&empty[(it - 1) % Cfg::kStages]);
      epilogue(acc, tm * Cfg::kBlockM + consumer * 64, tn * Cfg::kBlockN);
    }
  }
}

}  // namespace mk::gemm_engine
