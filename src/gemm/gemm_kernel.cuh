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
//   Epilogue   - where an accumulator tile goes (here: bf16 through shared memory, TMA stores)
//
//   smem:     [ stage 0 | ... | stage S-1 | epilogue buffers | full[S] | empty[S] ]
//   stage s:  [ A tile (128 x 64) | B tile (kBlockN x 64) ]   both 128-byte swizzled, K-major
//   producer: wait empty[s] -> arm full[s] with the stage's bytes -> TMA A, TMA B
//   consumer: wait full[s] -> 4 x wgmma k16 -> commit; once the previous stage's group retired,
//             arrive empty[prev]
// Partial tiles: TMA reads out-of-bounds elements as zero (K, M and N tails), and the epilogue's
// TMA stores clip at the matrix edge.
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
  static constexpr int kBlockN = kBlockN_;  // 64, 128, 192 or 256
  static constexpr int kBlockK = 64;        // 64 bf16 = 128 bytes = one swizzle row
  static constexpr int kConsumers = 2;
  static constexpr int kThreads = 128 * (1 + kConsumers);
  static constexpr int kABytes = kBlockM * kBlockK * 2;
  static constexpr int kBBytes = kBlockN * kBlockK * 2;
  static constexpr int kStageBytes = kABytes + kBBytes;
  // Epilogue staging: per consumer, two 64 x 64 bf16 buffers (one filling while one is stored).
  static constexpr int kEpilogueBytes = kConsumers * 2 * 64 * 64 * 2;
  // As many stages as fit (at most 8) next to the epilogue buffers, the barriers and the
  // 1024 bytes spent aligning everything to the swizzle atom.
  static constexpr int kSmemLimit = 227 * 1024;
  static constexpr int kStages =
      (kSmemLimit - 1024 - kEpilogueBytes - 256) / kStageBytes < 8
          ? (kSmemLimit - 1024 - kEpilogueBytes - 256) / kStageBytes
          : 8;
  static constexpr int kSmemBytes = 1024 + kStages * kStageBytes + kEpilogueBytes + 2 * kStages * 8;
  static constexpr int kAccRegs = kBlockN / 2;  // fp32 accumulators per consumer thread
  static constexpr int kProducerRegs = 40;
  static constexpr int kConsumerRegs = 232;
  static_assert(kStages >= 3, "too few pipeline stages fit");
  static_assert(kSmemBytes <= kSmemLimit, "shared memory per CTA on sm_90");
  static_assert(kBlockN % 64 == 0 && kBlockN <= 256, "tile widths of wgmma_ops.cuh");
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

// Writes a consumer's 64 x kBlockN accumulator slice to C as bf16 through shared memory and the
// copy engine: 64-column chunks are packed into a 128-byte-swizzled 64 x 64 buffer (conflict-free
// 4-byte stores), then one thread issues a TMA store of the chunk and the warpgroup moves on;
// two buffers alternate, so packing chunk j overlaps the store of chunk j - 1, and the last
// stores overlap the next tile's mainloop. TMA clips rows >= M and columns >= N.
struct TmaStoreEpilogue {
  CUtensorMap map;  // C [M, N] bf16, boxes of 64 rows x 64 columns, 128-byte swizzle
  int n;
  static constexpr int kChunkBytes = 64 * 64 * 2;

  // scratch: this consumer's 2 x kChunkBytes, 1024-byte aligned. All 128 threads call.
  template <int kRegs>
  __device__ void operator()(const float (&acc)[kRegs], int row0, int col0, int consumer,
                             uint8_t* scratch) const {
    constexpr int kChunks = kRegs / 32;  // 64 columns = 8 column blocks of 4 registers
    const int t = threadIdx.x % 128;
    const int r = (t / 32) * 16 + (t % 32) / 4;  // this thread's rows: r and r + 8
    const int word = (t % 4) * 4;                 // byte offset inside a 16-byte chunk
    const int barrier = 1 + consumer;
#pragma unroll
    for (int j = 0; j < kChunks; ++j) {
      if (col0 + 64 * j >= n) break;  // the same on every thread of the warpgroup
      uint8_t* buf = scratch + (j % 2) * kChunkBytes;
      if (t == 0) dev::bulk_wait_group_read<1>();  // the store that last read `buf` is done
      dev::named_barrier_sync(barrier, 128);
#pragma unroll
      for (int b = 0; b < 8; ++b) {
        const float* v = &acc[32 * j + 4 * b];
        dev::st_shared_u32(buf + r * 128 + ((b ^ (r % 8)) * 16) + word, pack_bf16(v[0], v[1]));
        dev::st_shared_u32(buf + (r + 8) * 128 + ((b ^ ((r + 8) % 8)) * 16) + word,
                           pack_bf16(v[2], v[3]));
      }
      dev::fence_proxy_async_shared();
      dev::named_barrier_sync(barrier, 128);
      if (t == 0) {
        dev::tma_store_2d(&map, buf, col0 + 64 * j, row0);
        dev::bulk_commit_group();
      }
    }
  }

  // Before the CTA exits: the copy engine has finished reading the buffers.
  __device__ void finish() const {
    if (threadIdx.x % 128 == 0) dev::bulk_wait_group<0>();
  }

  __device__ static uint32_t pack_bf16(float lo, float hi) {
    const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&v);
  }
};

// B box of an N-major stage: 64 K rows x 64 N values (128 bytes a row).
constexpr int kMnBoxBytes = 64 * 128;

template <class Cfg, bool kTransB, class Epilogue>
__global__ void __launch_bounds__(Cfg::kThreads, 1)
    gemm_kernel(const __grid_constant__ CUtensorMap tma_a,
                const __grid_constant__ CUtensorMap tma_b, int k, TileScheduler scheduler,
                const __grid_constant__ Epilogue epilogue) {
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem =
      reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t{1023});
  uint8_t* epilogue_smem = smem + Cfg::kStages * Cfg::kStageBytes;
  uint64_t* full = reinterpret_cast<uint64_t*>(epilogue_smem + Cfg::kEpilogueBytes);
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
          dev::wgmma_bf16<Cfg::kBlockN, kTransB>(acc, da, db, kb > 0 || kk > 0);
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
      epilogue(acc, tm * Cfg::kBlockM + consumer * 64, tn * Cfg::kBlockN, consumer,
               epilogue_smem + consumer * (Cfg::kEpilogueBytes / Cfg::kConsumers));
    }
    epilogue.finish();
  }
}

}  // namespace mk::gemm_engine
