// How fast can one SM's TMA ring take in a GEMM's operands, alone and in clusters that share A by
// TMA multicast? The GEMM engine's stage ring without the tensor cores: per CTA one tile (bm rows
// of A, bn rows of B, B [N, K]), its K in 64-wide k-blocks through `stages` stages; a producer
// thread arms each stage and loads its boxes, a consumer thread waits for the stage, stands in
// for the wgmmas by spinning `delay` cycles, and releases it. With clusters of c CTAs along N
// (the CTAs of a tile-row), each CTA loads bm / c rows of A and multicasts them into all c
// CTAs' stage, and a stage is refilled only once every CTA of the cluster has released it -
// the coupling of cuBLAS's and CUTLASS's clustered kernels, and of our dropped CTA pairs
// (docs/design/gemm_decode.md: the pairs lost 24-37% at 64-96 columns on an H100, while
// cuBLAS's 4 x 1 clusters of 64 x 64 tiles run 192 x 2048 x 7168 at ~110 GB/s into each SM
// against our ~90 without clusters). The question: is per-SM ingest capped by the SM, or by the
// L2's reads, which multicast cuts - and what does the coupling cost?
//   bench_ingest [--iters 20]
// Each configuration runs `iters` launches back to back (after as many to warm up), five times;
// it prints the median's us per launch, GB/s landed in each SM's shared memory, TB/s read from
// L2 (A's bytes once per cluster), CTA 0's SM clock, and whether every stage held its tile's
// rows. Flags: the consumer reading nothing of the stage (1), polling test_wait instead of
// sleeping in try_wait (2) - its own share of a k-block's time - and the consumer's release
// spread over its warp, lane r arriving on CTA r's barrier, as CUTLASS's clustered pipelines
// release (4), instead of one thread arriving on each CTA in turn. Two more take the cluster
// apart: each CTA loads all of its A itself while its stages still wait for every CTA's release
// (8: the coupling without the multicast), or with local releases only (16: the cluster's
// launch alone).
#include <cuda.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "bench_check.h"
#include "gemm/gemm_internal.h"
#include "mkernel/device/cluster.cuh"
#include "mkernel/device/mbarrier.cuh"
#include "mkernel/device/tma.cuh"

namespace {

constexpr int kRowBytes = 128;  // a k-block row: 64 bf16
constexpr int kNoCheck = 1, kSpin = 2, kSpread = 4, kOwnA = 8, kUncoupled = 16;

struct Params {
  int bm, bn, cluster, stages, k_blocks, tiles_n, delay;
  int flags;  // kNoCheck: the consumer reads nothing; kSpin: it polls test_wait, not try_wait;
              // kSpread: the consumer's warp releases, a lane a CTA; kOwnA: no multicast, each
              // CTA loads its A; kUncoupled: kOwnA and each CTA releases only its own stage
  unsigned* mismatches;
  unsigned long long* clocks;  // CTA 0's last launch: SM cycles and nanoseconds, start to end
};

__device__ __forceinline__ unsigned long long globaltimer() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__device__ __forceinline__ void tma_load_2d_multicast(void* dst, const CUtensorMap* map,
                                                      uint64_t* bar, int32_t c0, int32_t c1,
                                                      uint16_t mask) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"
      ".multicast::cluster [%0], [%1, {%3, %4}], [%2], %5;" ::"r"(mk::dev::smem_addr(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(mk::dev::smem_addr(bar)), "r"(c0), "r"(c1),
      "h"(mask)
      : "memory");
}

__device__ __forceinline__ void arrive_remote(uint32_t cluster_addr) {
  asm volatile("mbarrier.arrive.shared::cluster.b64 _, [%0];" ::"r"(cluster_addr) : "memory");
}

// Whether the cluster's CTAs share A by multicast (else each loads all of its A itself).
__host__ __device__ constexpr bool multicasts(int cluster, int flags) {
  return cluster > 1 && !(flags & (kOwnA | kUncoupled));
}

// The value the host wrote at (row, col) of A (raw 16-bit patterns; nothing is multiplied).
__host__ __device__ inline uint16_t a_value(int64_t row, int64_t col) {
  return static_cast<uint16_t>((row * 131 + col * 7) & 0x7fff);
}

__global__ void __launch_bounds__(64)
    ingest_kernel(const __grid_constant__ CUtensorMap map_a,
                  const __grid_constant__ CUtensorMap map_b, const Params p) {
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem =
      reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t{1023});
  const int a_bytes = p.bm * kRowBytes, b_bytes = p.bn * kRowBytes;
  const int stage_bytes = a_bytes + b_bytes;
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + p.stages * stage_bytes);
  uint64_t* empty = full + p.stages;
  const uint32_t rank = p.cluster > 1 ? mk::dev::cluster_rank() : 0;
  const int tile = blockIdx.x, m = tile / p.tiles_n, n = tile % p.tiles_n;
  const int part_rows = p.bm / p.cluster;
  // A stage is refilled once `releases` consumers released it: every CTA's when coupled.
  const bool coupled = p.cluster > 1 && !(p.flags & kUncoupled);
  const int releases = coupled ? p.cluster : 1;
  const long long clock0 = clock64();
  const unsigned long long time0 = globaltimer();

  if (threadIdx.x == 0) {
    for (int s = 0; s < p.stages; ++s) {
      mk::dev::mbarrier_init(&full[s], 1);
      mk::dev::mbarrier_init(&empty[s], releases);
    }
    mk::dev::mbarrier_init_fence();
  }
  __syncthreads();
  if (p.cluster > 1) mk::dev::cluster_sync();  // the peers' barriers exist before any arrival

  if (threadIdx.x == 0) {  // producer
    for (int kb = 0; kb < p.k_blocks; ++kb) {
      const int s = kb % p.stages;
      if (kb >= p.stages) mk::dev::mbarrier_wait(&empty[s], ((kb / p.stages) - 1) & 1);
      uint8_t* a = smem + s * stage_bytes;
      mk::dev::mbarrier_arrive_expect_tx(&full[s], stage_bytes);
      // A's box is a part's rows: without multicast all c parts, into this CTA only.
      if (!multicasts(p.cluster, p.flags)) {
        for (int r = 0; r < p.cluster; ++r) {
          mk::dev::tma_load_2d(a + r * part_rows * kRowBytes, &map_a, &full[s], kb * 64,
                               m * p.bm + r * part_rows);
        }
      } else {
        tma_load_2d_multicast(a + rank * part_rows * kRowBytes, &map_a, &full[s], kb * 64,
                              m * p.bm + rank * part_rows,
                              static_cast<uint16_t>((1u << p.cluster) - 1));
      }
      mk::dev::tma_load_2d(a + a_bytes, &map_b, &full[s], kb * 64, n * p.bn);
    }
  } else if (threadIdx.x == 32 || (threadIdx.x > 32 && (p.flags & kSpread))) {  // consumer
    const int lane = threadIdx.x - 32;  // lane 0 waits, reads and spins; kSpread: all release
    unsigned bad = 0;
    for (int kb = 0; kb < p.k_blocks; ++kb) {
      const int s = kb % p.stages;
      if (lane == 0) {
        if (p.flags & kSpin) {
          while (!mk::dev::mbarrier_test(&full[s], (kb / p.stages) & 1)) {
          }
        } else {
          mk::dev::mbarrier_wait(&full[s], (kb / p.stages) & 1);
        }
      }
      // The first 16 bytes of each part's first row (row 0 of a 128-byte swizzle atom is not
      // permuted): A's columns kb * 64 .. + 7 of that row.
      const uint8_t* a = smem + s * stage_bytes;
      for (int r = 0; r < p.cluster && lane == 0 && !(p.flags & kNoCheck); ++r) {
        const uint16_t* got = reinterpret_cast<const uint16_t*>(a + r * part_rows * kRowBytes);
        const int64_t row = static_cast<int64_t>(m) * p.bm + r * part_rows;
        for (int j = 0; j < 8; ++j) bad += got[j] != a_value(row, kb * 64 + j);
      }
      if (p.delay > 0 && lane == 0) {
        const long long until = clock64() + p.delay;
        while (clock64() < until) {
        }
      }
      const auto release = [&](int r) {  // stage s of CTA r (this CTA's when not coupled)
        if (coupled) {
          arrive_remote(mk::dev::peer_smem_addr(&empty[s], r));
        } else {
          mk::dev::mbarrier_arrive(&empty[s]);
        }
      };
      if (p.flags & kSpread) {
        __syncwarp();  // lane 0's reads of the stage come before every lane's release
        if (lane < releases) release(lane);
      } else {
        for (int r = 0; r < releases; ++r) release(r);
      }
    }
    if (bad) atomicAdd(p.mismatches, bad);
    if (blockIdx.x == 0 && lane == 0) {
      p.clocks[0] = clock64() - clock0;
      p.clocks[1] = globaltimer() - time0;
    }
  }
  __syncthreads();
  if (p.cluster > 1) mk::dev::cluster_sync();  // no CTA leaves while a peer may still write to it
}

struct Config {
  int64_t m, n, k;
  int bm, bn, cluster, stages, delay;
  int flags = 0;
};

// The clocks' two words sit after the mismatch counter (one allocation).
unsigned long long* mismatches_clocks(unsigned* mismatches) {
  return reinterpret_cast<unsigned long long*>(mismatches + 2);
}

// A and B packed as the shape's (rows k apart, as the GEMM benchmarks' operands are).
void run(const Config& c, int iters, uint16_t* a, uint16_t* b, unsigned* mismatches) {
  {
    std::vector<uint16_t> h(c.m * c.k);
    for (int64_t r = 0; r < c.m; ++r) {
      for (int64_t col = 0; col < c.k; ++col) h[r * c.k + col] = a_value(r, col);
    }
    CK(cudaMemcpy(a, h.data(), h.size() * 2, cudaMemcpyHostToDevice));
  }
  const int tiles_m = static_cast<int>(c.m / c.bm), tiles_n = static_cast<int>(c.n / c.bn);
  const int ctas = tiles_m * tiles_n;
  const int stage_bytes = (c.bm + c.bn) * kRowBytes;
  const int smem = c.stages * stage_bytes + 2 * c.stages * 8 + 1024;
  const CUtensorMap map_a = mk::gemm_engine::make_map(a, c.m, c.k, c.bm / c.cluster);
  const CUtensorMap map_b = mk::gemm_engine::make_map(b, c.n, c.k, c.bn);
  const Params p{c.bm,    c.bn,    c.cluster, c.stages,   static_cast<int>(c.k / 64),
                 tiles_n, c.delay, c.flags,   mismatches, mismatches_clocks(mismatches)};
  CK(cudaFuncSetAttribute(ingest_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  CK(cudaFuncSetAttribute(ingest_kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1));
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(ctas);
  cfg.blockDim = dim3(64);
  cfg.dynamicSmemBytes = smem;
  cudaLaunchAttribute attr;
  attr.id = cudaLaunchAttributeClusterDimension;
  attr.val.clusterDim.x = c.cluster;
  attr.val.clusterDim.y = attr.val.clusterDim.z = 1;
  cfg.attrs = &attr;
  cfg.numAttrs = 1;
  CK(cudaMemset(mismatches, 0, sizeof(unsigned)));
  auto launch = [&] { CK(cudaLaunchKernelEx(&cfg, ingest_kernel, map_a, map_b, p)); };
  // Back to back, as the GEMM benchmarks run (an idle GPU between launches lowers its clock).
  for (int i = 0; i < iters; ++i) launch();
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  constexpr int kRounds = 5;
  std::vector<float> ms(kRounds);
  for (int r = 0; r < kRounds; ++r) {
    CK(cudaEventRecord(e0));
    for (int i = 0; i < iters; ++i) launch();
    CK(cudaEventRecord(e1));
    CK(cudaEventSynchronize(e1));
    CK(cudaEventElapsedTime(&ms[r], e0, e1));
  }
  std::sort(ms.begin(), ms.end());
  const double s = ms[kRounds / 2] * 1e-3 / iters;
  unsigned long long clocks[2];
  CK(cudaMemcpy(clocks, p.clocks, sizeof clocks, cudaMemcpyDeviceToHost));
  unsigned bad = 0;
  CK(cudaMemcpy(&bad, mismatches, sizeof bad, cudaMemcpyDeviceToHost));
  const double landed = static_cast<double>(c.k / 64) * stage_bytes;  // a CTA's
  const double l2 =
      static_cast<double>(ctas) * (c.k / 64) *
      (static_cast<double>(c.bm) / (multicasts(c.cluster, c.flags) ? c.cluster : 1) + c.bn) *
      kRowBytes;
  std::printf(
      "%5lldx%5lldx%5lld  tile %3dx%3d  cluster %d  stages %2d  delay %4d  flags %d  ctas %3d: "
      "%7.1f us  %6.1f GB/s an SM  %5.2f TB/s from L2  SM %4.0f MHz  %s\n",
      static_cast<long long>(c.m), static_cast<long long>(c.n), static_cast<long long>(c.k), c.bm,
      c.bn, c.cluster, c.stages, c.delay, c.flags, ctas, s * 1e6, landed / s * 1e-9, l2 / s * 1e-12,
      clocks[1] ? 1e3 * static_cast<double>(clocks[0]) / static_cast<double>(clocks[1]) : 0.0,
      bad ? "WRONG" : "ok");
  CK(cudaEventDestroy(e0));
  CK(cudaEventDestroy(e1));
}

}  // namespace

int main(int argc, char** argv) {
  int iters = 20;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--iters") && i + 1 < argc) iters = std::atoi(argv[++i]);
  }
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, 0));
  std::printf("%s, %d SMs\n", prop.name, prop.multiProcessorCount);
  const int64_t max_m = 512, max_n = 4096, max_k = 14336;
  uint16_t *a, *b;
  unsigned* mismatches;
  CK(cudaMalloc(&a, max_m * max_k * 2));
  CK(cudaMalloc(&b, max_n * max_k * 2));
  CK(cudaMalloc(&mismatches, 2 * sizeof(unsigned) + 2 * sizeof(unsigned long long)));
  CK(cudaMemset(b, 0x3c, max_n * max_k * 2));
  const int kMaxStageBytes = 200 * 1024;
  auto fill = [&](int bm, int bn) {
    return std::min(16, kMaxStageBytes / ((bm + bn) * kRowBytes));
  };
  std::vector<Config> configs;
  // 192 x 2048 x 7168 in cuBLAS's tiles (64 x 64, 4 x 1 clusters) and ours without clusters.
  for (int delay : {0, 128}) {
    for (int cl : {1, 2, 4}) configs.push_back({192, 2048, 7168, 64, 64, cl, fill(64, 64), delay});
  }
  // 256 x 2048 x 7168, 64 x 64, and 512 x 2048 x 7168, 64 x 128 (the plan's on the H100): 128
  // CTAs, more than clusters of 4 can hold at once (120 on an H100 or H200).
  for (int cl : {1, 2}) configs.push_back({256, 2048, 7168, 64, 64, cl, fill(64, 64), 128});
  for (int cl : {1, 2}) configs.push_back({512, 2048, 7168, 64, 128, cl, fill(64, 128), 256});
  // 512 x 2048 x 7168, 128 x 64 (the CTA pairs' case: 26.5 us alone, 35.9 in pairs, H100).
  for (int delay : {0, 256}) {
    for (int cl : {1, 2}) configs.push_back({512, 2048, 7168, 128, 64, cl, fill(128, 64), delay});
  }
  // Little's law: the ring's depth at 64 x 64, no clusters and 4.
  for (int stages : {4, 8}) {
    for (int cl : {1, 4}) configs.push_back({192, 2048, 7168, 64, 64, cl, stages, 128});
  }
  for (int stages : {2, 4}) configs.push_back({512, 2048, 7168, 128, 64, 1, stages, 0});
  // The consumer's own cost: no reads of the stage, then polling instead of try_wait.
  for (int flags : {kNoCheck, kNoCheck | kSpin}) {
    for (int cl : {1, 4}) configs.push_back({192, 2048, 7168, 64, 64, cl, fill(64, 64), 0, flags});
  }
  // The release spread over the consumer's warp (CUTLASS's), at the cases above that lost most.
  for (int cl : {2, 4}) {
    configs.push_back({192, 2048, 7168, 64, 64, cl, fill(64, 64), 0, kSpread});
    configs.push_back({192, 2048, 7168, 64, 64, cl, fill(64, 64), 0, kNoCheck | kSpin | kSpread});
  }
  configs.push_back({512, 2048, 7168, 128, 64, 2, fill(128, 64), 256, kSpread});
  // The cluster taken apart: its launch alone, then the coupling without the multicast.
  for (int cl : {2, 4}) {
    for (int flags : {kUncoupled, kOwnA}) {
      configs.push_back({192, 2048, 7168, 64, 64, cl, fill(64, 64), 0, flags});
    }
  }
  for (const Config& c : configs) run(c, iters, a, b, mismatches);
  CK(cudaFree(a));
  CK(cudaFree(b));
  CK(cudaFree(mismatches));
  return 0;
}
