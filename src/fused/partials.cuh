// Moving fp32 partial sums of a consumer's 64 x kBlockN accumulator slice between ranks, for the
// fused GEMMs that reduce (GEMM+ReduceScatter, GEMM+AllReduce). A slice lives in the owner's
// accumulator at addresses the policy gives (see the policies' slice_offset and accum_at).
#pragma once

#include <cstdint>

#include "mkernel/device/tma.cuh"

namespace mk::fused {

__device__ __forceinline__ void red_add_f32x4(float* p, float4 v) {
  asm volatile("red.relaxed.sys.global.add.v4.f32 [%0], {%1, %2, %3, %4};" ::"l"(p), "f"(v.x),
               "f"(v.y), "f"(v.z), "f"(v.w)
               : "memory");
}

__device__ __forceinline__ void st_shared_f32x2(void* p, float x, float y) {
  asm volatile("st.shared.v2.f32 [%0], {%1, %2};" ::"r"(dev::smem_addr(p)), "f"(x), "f"(y)
               : "memory");
}

// acc += this thread's words of a slice; `at(row, col)` is the address of the two fp32 words
// (row, col), (row, col + 1) of the slice (col even). `clear`: those words become 0 for the next
// launch (an accumulator that peers add into). Two column blocks at a time: their loads are issued
// before any add or store, so they are in flight together (a plain load-add-store loop waits for
// each load in turn: the compiler cannot prove rows r and r + 8 apart from the words it stores;
// more than two spill at 128 x 256).
template <int kRegs, typename At>
__device__ __forceinline__ void add_and_clear(float (&acc)[kRegs], const At& at, int rows,
                                              int width, bool clear) {
  const int t = threadIdx.x % 128;
  const int r = (t / 32) * 16 + (t % 32) / 4;  // row in the slice; and r + 8
  const int c = 2 * (t % 4);                   // column of block 0
  constexpr int kBatch = 2;
#pragma unroll
  for (int b0 = 0; b0 < kRegs / 4; b0 += kBatch) {
    float2 v[2 * kBatch];
#pragma unroll
    for (int i = 0; i < kBatch; ++i) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int col = c + 8 * (b0 + i), row = r + 8 * h;
        v[2 * i + h] = row < rows && col < width
                           ? __ldcg(reinterpret_cast<const float2*>(at(row, col)))
                           : make_float2(0.f, 0.f);
      }
    }
#pragma unroll
    for (int i = 0; i < kBatch; ++i) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        acc[4 * (b0 + i) + 2 * h] += v[2 * i + h].x;
        acc[4 * (b0 + i) + 2 * h + 1] += v[2 * i + h].y;
        const int col = c + 8 * (b0 + i), row = r + 8 * h;
        if (clear && row < rows && col < width) {
          __stcg(reinterpret_cast<float2*>(at(row, col)), make_float2(0.f, 0.f));
        }
      }
    }
  }
}

// Sends the slice (rows < `rows`, columns < `width`) to an owner's accumulator, usually over
// NVLink; `at(row, col)` is the 16-byte aligned address of the four fp32 words (row, col..col + 3)
// there (col a multiple of 4). 32-column chunks are transposed through a 128-byte-swizzled
// 64 x 32 buffer in shared memory (two alternating, in `scratch`), then every thread writes whole
// 16-byte pieces of rows - coalesced, posted writes; `add`: vector reductions (red.add.v4.f32),
// else plain stores (an accumulator that receives one partial). Ends with a barrier of the
// warpgroup, so that thread 0's release afterwards covers every thread's writes. (TMA stores and
// reduces to the peer, tried first, were no faster.) All 128 threads of the warpgroup call.
template <int kRegs, typename At>
__device__ __forceinline__ void send_slice(const float (&acc)[kRegs], int consumer,
                                           uint8_t* scratch, const At& at, int rows, int width,
                                           bool add) {
  constexpr int kChunks = kRegs / 16;  // 32 columns = 4 column blocks of 4 registers
  constexpr int kChunkBytes = 64 * 32 * 4;
  const int t = threadIdx.x % 128;
  const int r = (t / 32) * 16 + (t % 32) / 4;
  const int barrier = 1 + consumer;
  const int my_row = t / 2;                    // the row this thread writes out
  const int my_units = 4 * (t % 2);            // its four 16-byte units of the row's 128 bytes
  if (t == 0) dev::bulk_wait_group_read<0>();  // the buffers' earlier TMA stores have read them
#pragma unroll
  for (int j = 0; j < kChunks; ++j) {
    if (32 * j >= width) break;
    uint8_t* buf = scratch + (j % 2) * kChunkBytes;
    dev::named_barrier_sync(barrier, 128);  // everyone is done reading buf (chunk j - 2)
#pragma unroll
    for (int b = 0; b < 4; ++b) {
      const float* v = &acc[16 * j + 4 * b];
      const int unit = 2 * b + (t % 4) / 2;  // 16-byte unit of the 128-byte row
      const int offset = 8 * (t % 2);
      st_shared_f32x2(buf + r * 128 + ((unit ^ (r % 8)) * 16) + offset, v[0], v[1]);
      st_shared_f32x2(buf + (r + 8) * 128 + ((unit ^ ((r + 8) % 8)) * 16) + offset, v[2], v[3]);
    }
    dev::named_barrier_sync(barrier, 128);
#pragma unroll
    for (int u = my_units; u < my_units + 4; ++u) {
      const int col = 32 * j + 4 * u;
      if (my_row >= rows || col >= width) continue;
      const float4 v =
          *reinterpret_cast<const float4*>(buf + my_row * 128 + ((u ^ (my_row % 8)) * 16));
      if (add) {
        red_add_f32x4(at(my_row, col), v);
      } else {
        *reinterpret_cast<float4*>(at(my_row, col)) = v;
      }
    }
  }
  dev::named_barrier_sync(barrier, 128);
}

}  // namespace mk::fused
