// Moving fp32 partial sums of a consumer's 64 x kBlockN accumulator slice between ranks, for the
// fused GEMMs that reduce (GEMM+ReduceScatter, GEMM+AllReduce). A slice lives in the owner's
// accumulator at addresses the policy gives (see the policies' slice_offset and accum_at).
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "fused/trace.cuh"
#include "gemm/gemm_kernel.cuh"
#include "mkernel/device/launch.cuh"
#include "mkernel/device/mbarrier.cuh"
#include "mkernel/device/sync.cuh"
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
// (row, col), (row, col + 1) of the slice (col even). `clear_block` (or null): the slice as one
// contiguous [rows][width] fp32 block, zeroed afterwards for the next launch (an accumulator that
// peers add into) - by the whole warpgroup in a separate, coalesced pass once every thread's loads
// are back (`barrier`: the warpgroup's named barrier); 8-byte zero stores into the lines just read,
// interleaved with the loads, are many times slower (bench_epilogue, "add+clear cold"). Four
// column blocks at a time (two at 192 wide, where four spill): their loads are issued before any
// add or store, so they are in flight together (a plain load-add-store loop waits for each load
// in turn: the compiler cannot prove rows r and r + 8 apart from the words it stores); the slice
// is read while the GEMM loads L2 heavily, and with two blocks in flight the own tiles'
// epilogues were far slower (docs/PERFORMANCE.md, 2026-11-30).
// `bf16`: the slice holds bf16 partials packed two to a 32-bit word - `at(row, word)` addresses
// the word of columns 2 word and 2 word + 1 - at half the bytes (the two-rank gemm_rs, whose one
// peer partial is rounded to bf16 once, as the sequential baseline's NCCL rounds it); no clear.
// (One loop for both formats: two unrolled adds in the epilogue spilled at 128 x 256.)
template <int kRegs, typename At>
__device__ __forceinline__ void add_and_clear(float (&acc)[kRegs], const At& at, int rows,
                                              int width, float* clear_block, int barrier,
                                              bool bf16 = false) {
  const int t = threadIdx.x % 128;
  const int r = (t / 32) * 16 + (t % 32) / 4;  // row in the slice; and r + 8
  const int c = 2 * (t % 4);                   // column of block 0
  constexpr int kBatch = kRegs == 96 ? 2 : 4;
#pragma unroll
  for (int b0 = 0; b0 < kRegs / 4; b0 += kBatch) {
    uint2 v[2 * kBatch];  // raw bits: two fp32, or in .x two bf16
#pragma unroll
    for (int i = 0; i < kBatch; ++i) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int col = c + 8 * (b0 + i), row = r + 8 * h;
        if (row >= rows || col >= width) {
          v[2 * i + h] = make_uint2(0u, 0u);
        } else if (bf16) {
          v[2 * i + h] =
              make_uint2(__ldcg(reinterpret_cast<const unsigned*>(at(row, col / 2))), 0u);
        } else {
          v[2 * i + h] = __ldcg(reinterpret_cast<const uint2*>(at(row, col)));
        }
      }
    }
#pragma unroll
    for (int i = 0; i < kBatch; ++i) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const uint2 w = v[2 * i + h];  // bf16 -> fp32 is a shift; the low half is the first column
        acc[4 * (b0 + i) + 2 * h] += __uint_as_float(bf16 ? w.x << 16 : w.x);
        acc[4 * (b0 + i) + 2 * h + 1] += __uint_as_float(bf16 ? w.x & 0xffff0000u : w.y);
      }
    }
  }
  if (clear_block != nullptr) {
    dev::named_barrier_sync(barrier, 128);  // every thread has its words (the adds used them)
    const int vectors = rows * width / 4;   // width is a multiple of 8: whole 16-byte vectors
    float4* block = reinterpret_cast<float4*>(clear_block);
    for (int i = t; i < vectors; i += 128) __stcg(block + i, make_float4(0.f, 0.f, 0.f, 0.f));
  }
}

__device__ __forceinline__ float2 ld_shared_f32x2(const void* p) {
  float2 v;
  asm volatile("ld.shared.v2.f32 {%0, %1}, [%2];" : "=f"(v.x), "=f"(v.y) : "r"(dev::smem_addr(p)));
  return v;
}

// The peer's partial sums of a whole own tile, brought by the producer's TMA loads through the
// stage ring behind the tile's k-blocks (gemm_rs with two ranks, GemmRsFusion::load_epilogue):
// the epilogue reads them from shared memory instead of waiting on global loads - a 64 KiB slice
// from global memory is slow to add inside the GEMM, held up by the SM's own TMA traffic
// (docs/PERFORMANCE.md, 2026-11-30 and 2026-12-01). Stage i holds, for slice (half) h of the tile,
// its 32-column boxes [i * kPerStage, i * kPerStage + kPerStage) - 64 x 32 fp32 each, 128-byte
// swizzled - at (h * kPerStage + q) * kPartialBoxBytes.
constexpr int kPartialBoxBytes = 64 * 32 * 4;

// How a whole 128 x kBlockN tile's partials fill the ring: kPerStage boxes of each slice per
// stage (a 48 KiB stage at 256 wide holds 3 + 3), kStages stages.
template <int kBlockN>
struct RingPartials {
  static constexpr int kPerStage =
      gemm_engine::TileConfig<kBlockN>::kStageBytes / kPartialBoxBytes / 2;
  static constexpr int kStages = (kBlockN / 32 + kPerStage - 1) / kPerStage;
  static_assert(kPerStage >= 1 && 2 * kPerStage * kPartialBoxBytes <=
                                      gemm_engine::TileConfig<kBlockN>::kStageBytes,
                "both slices' boxes of a stage fit in it");
  static_assert(kStages <= gemm_engine::TileConfig<kBlockN>::kStages,
                "a tile's partials fit in the ring at once");

  // The producer thread: arms `bar` with stage i's bytes and issues its loads;
  // load_box(dst, half, box) loads the slice's 32-column box `box` (a TMA load on `bar`).
  template <class LoadBox>
  __device__ static void load(void* dst, uint64_t* bar, int i, const LoadBox& load_box) {
    const int boxes = min(kPerStage, kBlockN / 32 - i * kPerStage);
    dev::mbarrier_arrive_expect_tx(bar, 2 * boxes * kPartialBoxBytes);
    for (int h = 0; h < 2; ++h) {
      for (int q = 0; q < boxes; ++q) {
        load_box(static_cast<uint8_t*>(dst) + (h * kPerStage + q) * kPartialBoxBytes, h,
                 i * kPerStage + q);
      }
    }
  }
};

// acc += this consumer's slice (`half`) of the partials in the ring; releases every stage. All
// 128 threads of the consumer call. Conflict-free: a warp's eight rows hit eight different
// 16-byte units of the swizzle (two wavefronts per 256 bytes).
template <int kPerStage, int kRegs>
__device__ __forceinline__ void add_from_ring(float (&acc)[kRegs],
                                              const gemm_engine::EpilogueRing& ring, int half,
                                              int consumer) {
  constexpr int kBoxes = kRegs / 16;  // 32 columns = 4 column blocks of 4 registers
  constexpr int kStages = (kBoxes + kPerStage - 1) / kPerStage;
  const int t = threadIdx.x % 128;
  const int r = (t / 32) * 16 + (t % 32) / 4;  // rows r and r + 8
  const int quad = t % 4;                      // columns 2 quad, 2 quad + 1 of each 8-column block
#pragma unroll
  for (int i = 0; i < kStages; ++i) {
    const uint8_t* stage = ring.wait(i);
#pragma unroll
    for (int q = 0; q < kPerStage; ++q) {
      const int box = i * kPerStage + q;
      if (box >= kBoxes) break;
      const uint8_t* buf = stage + (half * kPerStage + q) * kPartialBoxBytes;
#pragma unroll
      for (int b = 0; b < 4; ++b) {
        const int unit = 2 * b + quad / 2;  // 16-byte unit of the 128-byte row
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int row = r + 8 * h;
          const float2 v =
              ld_shared_f32x2(buf + row * 128 + ((unit ^ (row % 8)) * 16) + (quad % 2) * 8);
          acc[4 * (4 * box + b) + 2 * h] += v.x;
          acc[4 * (4 * box + b) + 2 * h + 1] += v.y;
        }
      }
    }
    ring.release(i, consumer);
  }
}

// Sends the slice (rows < `rows`, columns < `width`) to an owner's accumulator, usually over
// NVLink; `at(row, col)` is the 16-byte aligned address of the four fp32 words (row, col..col + 3)
// there (col a multiple of 4). 32-column chunks are transposed through a 128-byte-swizzled
// 64 x 32 buffer in shared memory (two alternating, in `scratch`), then every thread writes whole
// 16-byte pieces of rows - coalesced, posted writes; `add`: vector reductions (red.add.v4.f32),
// else plain stores (an accumulator that receives one partial). Ends with a barrier of the
// warpgroup, so that thread 0's release afterwards covers every thread's writes. (Two ranks with
// fp32 partials send by TMA stores instead where the policies' views allow - their tma_sends.)
// All 128 threads of the warpgroup call.
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

// send_slice for bf16 partials: the slice rounded to bf16 and stored (not added) at
// dst[r * stride + c] - an owner's accumulator that receives one partial. The engine's epilogue
// path packs it in 64-column chunks (gemm_engine::store_slice); each chunk's 64 rows x 128 bytes
// then leave as 16-byte stores, two threads a row. Ends with a barrier of the warpgroup (as
// send_slice), so that thread 0's release afterwards covers every thread's writes.
template <int kRegs>
__device__ __forceinline__ void send_slice_bf16(const float (&acc)[kRegs], int consumer,
                                                uint8_t* scratch, __nv_bfloat16* dst,
                                                int64_t stride, int rows, int width) {
  const int t = threadIdx.x % 128;
  const int my_row = t / 2, my_units = 4 * (t % 2);  // four 16-byte units (8 columns each)
  gemm_engine::store_slice(
      acc, 0, width, consumer, scratch, [](const uint8_t*, int) {},
      [&](const uint8_t* buf, int j) {
        if (my_row >= rows) return;
#pragma unroll
        for (int u = my_units; u < my_units + 4; ++u) {
          const int col = 64 * j + 8 * u;
          if (col >= width) break;
          *reinterpret_cast<uint4*>(dst + my_row * stride + col) =
              *reinterpret_cast<const uint4*>(buf + my_row * 128 + ((u ^ (my_row % 8)) * 16));
        }
      });
  dev::named_barrier_sync(1 + consumer, 128);
}

// Where a slice's fp32 words live: columns [0, split) of row r at first + r * first_stride,
// columns [split, width) at second + r * second_stride (floats). Uses: an owner's accumulator
// (split = 0: [rows][width] at `second`; two-rank GEMM+AllReduce: the first half over the slice's
// own bf16 footprint in the owner's C), and staging slots (a contiguous block, or a 128-row bf16
// output tile's footprint seen as 64 fp32 rows: row r = output rows 2r and 2r + 1).
struct PartialAt {
  float* first;
  int64_t first_stride;
  float* second;
  int64_t second_stride;
  int split;
  __device__ float* operator()(int r, int c) const {
    return c < split ? first + r * first_stride + c : second + r * second_stride + (c - split);
  }
  __device__ static PartialAt block(float* p, int width) { return {p, 0, p, width, 0}; }
};

// All threads of a consumer: starts bringing a slice (rows x width fp32 where `at` says) into L2
// with the TMA unit's bulk prefetch (asynchronous, no registers), so that the add_and_clear that
// reads it a tile later finds it there instead of in HBM. Harmless if peers still write to it:
// their NVLink writes go through this GPU's L2.
__device__ __forceinline__ void prefetch_l2(const void* p, uint32_t bytes) {
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p), "r"(bytes) : "memory");
}
__device__ __forceinline__ void prefetch_slice_l2(const PartialAt& at, int rows, int width) {
  const int t = threadIdx.x % 128;
  const int split = min(at.split, width), rest = width - split;
  if (rest > 0) {
    if (at.second_stride == rest) {  // one contiguous block
      if (t == 0) prefetch_l2(at.second, static_cast<uint32_t>(rows * rest * 4));
    } else if (t < rows) {
      prefetch_l2(at.second + t * at.second_stride, static_cast<uint32_t>(rest * 4));
    }
  }
  if (split > 0 && t < rows) {
    prefetch_l2(at.first + t * at.first_stride, static_cast<uint32_t>(split * 4));
  }
}

// ---- Outbox: partial slices leave through the producer warpgroup's spare warps -----------------
// Sending a slice from the consumer's epilogue stalls its tensor cores for the whole NVLink
// transfer (an epilogue's stores move little over NVLink: docs/PERFORMANCE.md, 2026-11-30).
// Instead a consumer writes its slice into a staging slot in local memory (fast), hands it to the
// 96 side threads and goes on to its next tile; the side threads copy the slot into the owner's
// accumulator (stores, or red.add with more than two ranks), release, raise the owner's signal and
// free the slot. Each consumer has `slots` staging slots (1 or 2, the same for both consumers of a
// CTA) used in turn. The items themselves travel through one ring of descriptors shared by both
// consumers: a consumer's thread 0 takes the next ring position (a ticket) when its item is ready,
// so the side threads serve the items in the order they were posted and never wait on a consumer
// that has nothing to send while the other one has (the ping-pong schedule posts from the two at
// different times and in different numbers). Each consumer closes its outbox once it has no more
// remote tiles; the side threads arrive on `drained` when both closed and every copy has been
// signalled.
constexpr int kMaxOutboxSlots = 2;
constexpr int kOutboxRing = 2 * kMaxOutboxSlots;  // descriptors in flight
constexpr int kOutboxBarrier = 3;                 // named barrier of the 96 side threads

// Two kinds of item. A partial (owner >= 0): rows x width fp32 from the staging slot `src` to
// the owner's accumulator `at`, then the owner's `signal`. A broadcast (owner < 0): rows x width
// fp32-sized words (finished bf16 output, two values a word) from `src` in this rank's output to
// every peer's output at the same place - `at` addresses them in this rank's output, and the side
// threads add each peer's distance (`peer_shift`); no signal (the kernel's exit barrier covers it).
struct OutboxItem {
  PartialAt src;
  PartialAt at;
  int rows;  // -1: a consumer closed its outbox
  int width;
  int owner;  // local rank, or -1: broadcast
  uint32_t signal;
  int consumer;  // who posted it (set by the post)
  int staged;    // its staging slot, freed once sent; -1: none (set by the post)
};

struct OutboxShared {
  uint64_t full[kOutboxRing];           // a consumer's thread 0 -> side threads: posted
  uint64_t empty[kOutboxRing];          // side threads -> consumers: descriptor free (96)
  uint64_t staged[2][kMaxOutboxSlots];  // side threads -> consumer: staging slot free (96)
  uint64_t drained;                     // side threads -> consumers: all sent (1 arrive)
  int tickets;                          // ring positions taken so far
  OutboxItem item[kOutboxRing];
};

// The CTA's outbox bookkeeping (static shared memory: one per CTA).
__device__ __forceinline__ OutboxShared& outbox_shared() {
  __shared__ OutboxShared box;
  return box;
}

// Thread 0, before the kernel's first __syncthreads.
__device__ __forceinline__ void outbox_init() {
  OutboxShared& box = outbox_shared();
  for (int p = 0; p < kOutboxRing; ++p) {
    dev::mbarrier_init(&box.full[p], 1);
    dev::mbarrier_init(&box.empty[p], 96);
  }
  for (int c = 0; c < 2; ++c) {
    for (int s = 0; s < kMaxOutboxSlots; ++s) dev::mbarrier_init(&box.staged[c][s], 96);
  }
  dev::mbarrier_init(&box.drained, 1);
  box.tickets = 0;
}

// A consumer's position in its staging slots.
struct OutboxCursor {
  int next = 0;
  int slots = 0;  // 0: no outbox (the epilogue sends)
  bool closed = false;
  __device__ int slot() const { return next % slots; }
  __device__ uint32_t parity() const { return (next / slots) & 1; }
};

// Thread 0 of a consumer: the next ring position, once its descriptor is free, gets `item`.
// Releases what this thread wrote or saw before (the warpgroup's writes, after a barrier).
__device__ __forceinline__ void outbox_enqueue(const OutboxItem& item) {
  OutboxShared& box = outbox_shared();
  const int ticket = atomicAdd(&box.tickets, 1);
  const int p = ticket % kOutboxRing;
  dev::mbarrier_wait(&box.empty[p], ((ticket / kOutboxRing) & 1) ^ 1);  // first lap at once
  box.item[p] = item;
  dev::mbarrier_arrive(&box.full[p]);
}

// The fp32 slice (columns < width) staged by TMA: 32-column chunks are transposed through the
// consumer's two 64 x 32 fp32 scratch buffers (128-byte swizzle, as send_slice's), and thread 0
// stores chunk j with store_chunk(buf, j) - a TMA store of the box into the staging slot, issued
// and committed as one bulk group - shared-memory stores and an asynchronous copy, where the
// epilogue's own 8-byte global stores of a slice cost it several microseconds beside the GEMM
// (docs/PERFORMANCE.md, 2026-12-01). All 128 threads of the consumer call; the stores are in flight
// on return (thread 0's bulk groups).
template <int kRegs, class StoreChunk>
__device__ __forceinline__ void stage_chunks(const float (&acc)[kRegs], int consumer,
                                             uint8_t* scratch, int width,
                                             const StoreChunk& store_chunk) {
  constexpr int kChunks = kRegs / 16;  // 32 columns = 4 column blocks of 4 registers
  constexpr int kChunkBytes = 64 * 32 * 4;
  const int t = threadIdx.x % 128;
  const int r = (t / 32) * 16 + (t % 32) / 4;
  const int barrier = 1 + consumer;
#pragma unroll
  for (int j = 0; j < kChunks; ++j) {
    if (32 * j >= width) break;
    uint8_t* buf = scratch + (j % 2) * kChunkBytes;
    if (t == 0) {  // the store that last read buf is done (for chunk 0: any earlier one)
      if (j == 0) {
        dev::bulk_wait_group_read<0>();
      } else {
        dev::bulk_wait_group_read<1>();
      }
    }
    dev::named_barrier_sync(barrier, 128);
#pragma unroll
    for (int b = 0; b < 4; ++b) {
      const float* v = &acc[16 * j + 4 * b];
      const int unit = 2 * b + (t % 4) / 2;  // 16-byte unit of the 128-byte row
      const int offset = 8 * (t % 2);
      st_shared_f32x2(buf + r * 128 + ((unit ^ (r % 8)) * 16) + offset, v[0], v[1]);
      st_shared_f32x2(buf + (r + 8) * 128 + ((unit ^ ((r + 8) % 8)) * 16) + offset, v[2], v[3]);
    }
    dev::fence_proxy_async_shared();
    dev::named_barrier_sync(barrier, 128);
    if (t == 0) {
      store_chunk(buf, j);
      dev::bulk_commit_group();
    }
  }
}

// All 128 threads of a consumer: whether its staging slot cursor.slot() is free now (thread 0's
// look, the same answer on every thread; no wait).
__device__ __forceinline__ bool outbox_slot_free(int consumer, const OutboxCursor& cursor) {
  const bool free =
      threadIdx.x % 128 == 0 &&
      dev::mbarrier_test(&outbox_shared().staged[consumer][cursor.slot()], cursor.parity() ^ 1);
  return dev::named_barrier_or(1 + consumer, 128, free);
}

// All 128 threads of a consumer: waits until its staging slot cursor.slot() is free and returns
// it (`trace`: the timeline - the slot free is kTraceWaited - or null).
__device__ __forceinline__ int outbox_wait_slot(int consumer, const OutboxCursor& cursor,
                                                uint64_t* trace) {
  const int s = cursor.slot();
  dev::mbarrier_wait(&outbox_shared().staged[consumer][s],
                     cursor.parity() ^ 1);  // 1st lap: at once
  if (threadIdx.x % 128 == 0) trace_mark(trace, kTraceConsumer0 + consumer, kTraceWaited, 1);
  return s;
}

// Thread 0 of a consumer: posts `item` staged in slot s.
__device__ __forceinline__ void outbox_post_staged(int consumer, int s, const OutboxItem& item) {
  OutboxItem posted = item;
  posted.consumer = consumer;
  posted.staged = s;
  outbox_enqueue(posted);
}

// All 128 threads of a consumer: waits for its staging slot cursor.slot() to be free, writes the
// slice into item.src (rows < item.rows, columns < item.width) and posts the item; rows 0 posts
// an item without data. `bf16`: the slice is staged as bf16 pairs, one 32-bit word per two
// columns, and item.width counts those words (the side threads copy words either way).
template <int kRegs>
__device__ __forceinline__ void outbox_post(const float (&acc)[kRegs], int consumer,
                                            OutboxCursor& cursor, const OutboxItem& item,
                                            bool bf16 = false, uint64_t* trace = nullptr) {
  const int s = outbox_wait_slot(consumer, cursor, trace);
  const int t = threadIdx.x % 128;
  if (item.rows > 0 && bf16) {
    const int r = (t / 32) * 16 + (t % 32) / 4, w = t % 4;
#pragma unroll
    for (int b = 0; b < kRegs / 4; ++b) {
      const int word = w + 4 * b;
      if (word < item.width) {
        if (r < item.rows) {
          *reinterpret_cast<uint32_t*>(item.src(r, word)) =
              gemm_engine::pack_bf16(acc[4 * b], acc[4 * b + 1]);
        }
        if (r + 8 < item.rows) {
          *reinterpret_cast<uint32_t*>(item.src(r + 8, word)) =
              gemm_engine::pack_bf16(acc[4 * b + 2], acc[4 * b + 3]);
        }
      }
    }
  } else if (item.rows > 0) {
    const int r = (t / 32) * 16 + (t % 32) / 4, c = 2 * (t % 4);
#pragma unroll
    for (int b = 0; b < kRegs / 4; ++b) {
      const int col = c + 8 * b;
      if (col < item.width) {
        if (r < item.rows) {
          *reinterpret_cast<float2*>(item.src(r, col)) = make_float2(acc[4 * b], acc[4 * b + 1]);
        }
        if (r + 8 < item.rows) {
          *reinterpret_cast<float2*>(item.src(r + 8, col)) =
              make_float2(acc[4 * b + 2], acc[4 * b + 3]);
        }
      }
    }
  }
  dev::named_barrier_sync(1 + consumer, 128);  // every thread's staging writes, before the post
  if (t == 0) outbox_post_staged(consumer, s, item);
  ++cursor.next;
}

// outbox_post for an fp32 slice staged by TMA (stage_chunks: store_chunk(buf, j) stores chunk j,
// columns 32 j .., into the slot): thread 0 waits for its stores to land, then posts
// make_item() - built by that thread only, so that the consumers hold no item while they stage.
// `has_data` false: an item without data (rows 0).
template <int kRegs, class StoreChunk, class MakeItem>
__device__ __forceinline__ void outbox_post_by_tma(const float (&acc)[kRegs], int consumer,
                                                   OutboxCursor& cursor, bool has_data, int width,
                                                   uint8_t* scratch, const StoreChunk& store_chunk,
                                                   const MakeItem& make_item, uint64_t* trace) {
  const int s = outbox_wait_slot(consumer, cursor, trace);
  if (has_data) stage_chunks(acc, consumer, scratch, width, store_chunk);
  if (threadIdx.x % 128 == 0) {
    if (has_data) dev::bulk_stores_landed();  // visible to the side threads' generic loads
    outbox_post_staged(consumer, s, make_item());
  }
  ++cursor.next;
}

// Thread 0 of a consumer: posts an item whose data is already in place (item.src) and visible to
// it (a TMA store: it waited for it and fenced the async proxy); no staging slot.
__device__ __forceinline__ void outbox_post_ready(int consumer, const OutboxItem& item) {
  OutboxItem posted = item;
  posted.consumer = consumer;
  posted.staged = -1;
  outbox_enqueue(posted);
}

// All 128 threads of a consumer, once it has no more remote tiles (idempotent).
__device__ __forceinline__ void outbox_close(OutboxCursor& cursor) {
  if (cursor.slots == 0 || cursor.closed) return;
  if (threadIdx.x % 128 == 0) {
    OutboxItem close{};
    close.rows = -1;
    close.consumer = threadIdx.x / 128 - 1;
    close.staged = -1;
    outbox_enqueue(close);
  }
  cursor.closed = true;
}

// All threads of a consumer: every item of the CTA has been copied and signalled, and the slots
// are no longer read (call only after outbox_close, and only with an outbox).
__device__ __forceinline__ void outbox_wait_drained() {
  dev::mbarrier_wait(&outbox_shared().drained, 0);
}

// The 96 side threads: serve the items in posting order until both consumers closed, then arrive
// on `drained`.
// `ensure_entered(peer)` (thread 0 only) returns once the peer may be written to; a false return
// (time-out, recorded) skips the copies to that peer, and the item still gets its slot back.
// `peer_shift(p)`: how far local rank p's copy of this rank's output lies from this rank's (in
// floats; broadcast items only). `trace`: the timeline buffer (fused/trace.cuh), or null.
template <class EnsureEntered, class PeerShift>
__device__ __forceinline__ void outbox_serve(const DeviceComm& comm, bool add,
                                             const EnsureEntered& ensure_entered,
                                             const PeerShift& peer_shift, uint64_t* trace) {
  OutboxShared& box = outbox_shared();
  const int t = threadIdx.x - 32;  // 0..95
  const dev::Launch launch = dev::Launch::begin(comm);
  // Thread 0's verdict on a peer (1: its entry wait timed out, skip it), for all 96: written
  // before a barrier, read into registers between it and the next barrier.
  __shared__ int skip_word;
  // Copies one item's rows x width words from src to at + shift (96 threads; stores or adds).
  auto copy = [&](const OutboxItem& item, int64_t shift, bool add_words) {
    const int units_per_row = item.width / 4, units = item.rows * units_per_row;
    // Four 16-byte loads in flight per thread (6 KiB per CTA): the staging slot is read while the
    // GEMM loads the memory system, and two in flight left the copy slow (docs/PERFORMANCE.md).
    constexpr int kBatch = 4;
    for (int u0 = t; u0 < units; u0 += 96 * kBatch) {
      float4 v[kBatch];
#pragma unroll
      for (int i = 0; i < kBatch; ++i) {
        const int u = u0 + 96 * i;
        if (u < units) {
          v[i] = __ldcg(reinterpret_cast<const float4*>(
              item.src(u / units_per_row, 4 * (u % units_per_row))));
        }
      }
#pragma unroll
      for (int i = 0; i < kBatch; ++i) {
        const int u = u0 + 96 * i;
        if (u >= units) break;
        float* dst = item.at(u / units_per_row, 4 * (u % units_per_row)) + shift;
        if (add_words) {
          red_add_f32x4(dst, v[i]);
        } else {
          *reinterpret_cast<float4*>(dst) = v[i];
        }
      }
    }
  };
  for (int ticket = 0, closes = 0; closes < 2; ++ticket) {  // the items in posting order
    const int p = ticket % kOutboxRing;
    dev::mbarrier_wait(&box.full[p], (ticket / kOutboxRing) & 1);
    const OutboxItem& item = box.item[p];
    const int rows = item.rows;
    if (rows < 0) {
      ++closes;
    } else {
      if (t == 0) trace_mark(trace, kTraceSide, kTraceItem, item.consumer);
      if (rows > 0 && item.owner >= 0) {  // a partial: to its owner, then the owner's signal
        if (t == 0) skip_word = ensure_entered(item.owner) ? 0 : 1;
        dev::named_barrier_sync(kOutboxBarrier, 96);
        const bool skip = skip_word != 0;  // read only between the two barriers
        if (!skip) copy(item, 0, add);
        dev::named_barrier_sync(kOutboxBarrier, 96);  // every copy issued (and the slot read)
        if (t == 0 && !skip) {
          dev::fence_acq_rel_sys();  // the copies have landed before the signal
          launch.signal(item.owner, item.signal, 1);
        }
      } else if (rows > 0) {  // a broadcast: to every peer, no signal
        for (int peer = 0; peer < comm.local_size; ++peer) {
          if (peer == comm.local_rank) continue;
          if (t == 0) skip_word = ensure_entered(peer) ? 0 : 1;
          dev::named_barrier_sync(kOutboxBarrier, 96);
          const bool skip = skip_word != 0;
          if (!skip) copy(item, peer_shift(peer), false);
          dev::named_barrier_sync(kOutboxBarrier, 96);  // skip_word read: the next may set it
        }
      }
      if (t == 0) trace_mark(trace, kTraceSide, kTraceSent, item.consumer);
      if (item.staged >= 0) dev::mbarrier_arrive(&box.staged[item.consumer][item.staged]);
    }
    dev::mbarrier_arrive(&box.empty[p]);
  }
  dev::named_barrier_sync(kOutboxBarrier, 96);  // all 96 are done with the slots
  if (t == 0) dev::mbarrier_arrive(&box.drained);
}

}  // namespace mk::fused
