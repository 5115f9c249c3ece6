// mkernel/device/wgmma.cuh - warpgroup matrix multiply-accumulate (sm_90a) on shared memory.
//
// Operands live in shared memory in the layout TMA writes with 128-byte swizzling, K-major
// (each row of the tile holds 64 consecutive bf16 along K = 128 bytes). A descriptor tells the
// tensor cores where a 64 x 16 (A) or N x 16 (B) slice starts:
//   bits  0-13  start address >> 4
//   bits 16-29  leading-dimension byte offset >> 4 (unused for swizzled K-major; 16 by convention)
//   bits 32-45  stride-dimension byte offset >> 4 = 1024 B: 8 rows x 128 B between core matrices
//   bits 62-63  swizzle mode: 1 = 128 B (2 = 64 B, 3 = 32 B: wgmma_desc_mn_tail)
// Successive K slices of 16 elements start 32 bytes further; the hardware applies the swizzle.
//
// Accumulator layout per thread (warp w of the warpgroup, lane l), for column block j (8 cols):
//   d[4j + 0], d[4j + 1] -> row 16w + l/4,     cols 8j + 2(l%4) + {0, 1}
//   d[4j + 2], d[4j + 3] -> row 16w + l/4 + 8, cols 8j + 2(l%4) + {0, 1}
#pragma once

#include <cstdint>

#include "mkernel/device/mbarrier.cuh"
#include "mkernel/device/wgmma_ops.cuh"  // the instructions, one per tile width

namespace mk::dev {

__device__ __forceinline__ uint64_t wgmma_desc_sw128(const void* smem) {
  const uint64_t addr = smem_addr(smem);
  return ((addr & 0x3FFFF) >> 4) | (uint64_t{16 >> 4} << 16) | (uint64_t{1024 >> 4} << 32) |
         (uint64_t{1} << 62);
}

// `desc` moved `bytes` further into shared memory: its start address field counts 16 bytes. Exact
// while the address stays inside the shared window (the 14-bit field spans 256 KiB), so a stage's
// descriptor computed once serves each of its k16 slices (one add, in uniform registers).
__device__ __forceinline__ uint64_t wgmma_desc_advance(uint64_t desc, uint32_t bytes) {
  // (On the low word alone: the compiler cannot know that the add never carries into the high.)
  const uint32_t lo = static_cast<uint32_t>(desc) + (bytes >> 4);
  return (desc & 0xFFFFFFFF00000000ull) | lo;
}

// N-major (transposed) B with 128-byte swizzling: the tile is stored as [N / 64][K][64 N values],
// each K row 128 bytes. Stride-dimension offset: 1024 B between groups of 8 K rows; leading-
// dimension offset: `chunk_bytes` between 64-wide N chunks. A k16 slice starts 16 rows (2 KiB)
// further. (Checked by tests/gpu/test_gemm.cpp, Gemm.BLayoutKN.)
__device__ __forceinline__ uint64_t wgmma_desc_sw128_mn(const void* smem, uint32_t chunk_bytes) {
  const uint64_t addr = smem_addr(smem);
  return ((addr & 0x3FFFF) >> 4) | (uint64_t{(chunk_bytes >> 4) & 0x3FFF} << 16) |
         (uint64_t{1024 >> 4} << 32) | (uint64_t{1} << 62);
}

// N-major B's last 16 or 32 columns (a step width's past its 64-wide chunks): one swizzle atom
// wide - kRowBytes 32 or 64, the 32- or 64-byte swizzle (modes 3 and 2) - its K rows back to
// back. Stride-dimension offset: 8 K rows. Leading-dimension offset: the stride between atoms
// along N, which one atom never takes (set to the tail's 64 K rows). A k16 slice starts 16 rows
// further.
template <int kRowBytes>
__device__ __forceinline__ uint64_t wgmma_desc_mn_tail(const void* smem) {
  static_assert(kRowBytes == 32 || kRowBytes == 64, "a 16- or 32-column tail");
  const uint64_t addr = smem_addr(smem);
  constexpr uint64_t kMode = kRowBytes == 64 ? 2 : 3;
  return ((addr & 0x3FFFF) >> 4) | (uint64_t{(64 * kRowBytes) >> 4} << 16) |
         (uint64_t{(8 * kRowBytes) >> 4} << 32) | (kMode << 62);
}

// Orders register accesses before the next wgmma reads or writes accumulators.
__device__ __forceinline__ void wgmma_fence() {
  asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
}
__device__ __forceinline__ void wgmma_commit() {
  asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
}
// Waits until at most kPending committed groups are still running.
template <int kPending>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(kPending) : "memory");
}

// Keeps the compiler from moving accumulator reads/writes across an asynchronous wgmma.
template <int kRegs>
__device__ __forceinline__ void wgmma_fence_operands(float (&d)[kRegs]) {
#pragma unroll
  for (int i = 0; i < kRegs; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// The same for register operands (A fragments of wgmma_bf16_rs): kept in their registers,
// unchanged, until this point - place it after the wgmma_wait that retires the instructions reading
// them.
template <int kRegs>
__device__ __forceinline__ void wgmma_fence_operands(uint32_t (&r)[kRegs]) {
#pragma unroll
  for (int i = 0; i < kRegs; ++i) asm volatile("" : "+r"(r[i])::"memory");
}

// Register budget of a warpgroup role (setmaxnreg; needs __launch_bounds__(threads, 1)).
template <int kRegs>
__device__ __forceinline__ void warpgroup_reg_alloc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(kRegs));
}
template <int kRegs>
__device__ __forceinline__ void warpgroup_reg_dealloc() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(kRegs));
}

}  // namespace mk::dev
