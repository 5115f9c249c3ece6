// The attention engine's last, partial wave split over every CTA (attention(); docs/design/
// attention.md, The tail wave).
//
// Work items are equal (non-causal) or nearly so; on G CTAs the items [0, (waves - 1) G) fill
// whole waves and the rest, the tail, runs on `tail` CTAs while the others idle - at 4096 items
// on 132 SMs a whole item's time for 4 items (3% of the launch). When the tail is at most half a
// wave, attention() runs three launches instead of one:
//
//   1. the plain kernel on the whole waves (PlainAttention with items = the first ones);
//   2. the same mainloop on the tail items cut into `pieces` runs of KV blocks each
//      (SplitAttention): each piece ends with its softmax state (O not normalised, m, l) in a
//      StateImage slot instead of O;
//   3. merge_pieces_kernel: per tail item, the pieces' states rescaled to the largest m and summed,
//      then O (bf16) and LSE written as the plain kernel would.
//
// The plain kernel's code is untouched (its own instance; only its item count differs).
#pragma once

#include <cuda_bf16.h>

#include "attention/attention_kernel.cuh"

namespace mk::attention_engine {

// Piece p of `pieces` of an item's `blocks` KV blocks: visit indices [piece_begin(p),
// piece_begin(p + 1)) (counted from the item's first visited block). Some are empty when
// blocks < pieces.
__host__ __device__ __forceinline__ int piece_begin(int blocks, int p, int pieces) {
  return static_cast<int>(static_cast<int64_t>(blocks) * p / pieces);
}

template <int kHeadDim>
struct SplitAttention {
  using Plain = PlainAttention<kHeadDim>;
  static constexpr int kORegs = kHeadDim / 2;

  Plain plain;               // the maps and the problem; plain.item(0, t) for every t
  StateImage<kORegs> state;  // slot = piece index t below
  int first;                 // the first tail item (the plain launch ran those before it)
  int tail;                  // tail items
  int pieces;                // pieces a tail item

  static constexpr int kProducerRegs = Plain::kProducerRegs;
  static constexpr bool kKeysAhead = Plain::kKeysAhead;
  static constexpr int kConsumerRegs = Plain::kConsumerRegs;
  using KvBlock = typename Plain::KvBlock;

  __device__ int num_steps() const { return 1; }
  __device__ int num_items() const { return tail * pieces; }
  // Piece t: piece t % pieces of tail item t / pieces, its blocks counted down from the item's
  // (part: one past the piece's highest KV block).
  __device__ WorkItem item(int, int t) const {
    WorkItem w = plain.item(0, first + t / pieces);
    const int p = t % pieces;
    const int top = w.blocks - piece_begin(w.blocks, p, pieces);
    w.blocks = piece_begin(w.blocks, p + 1, pieces) - piece_begin(w.blocks, p, pieces);
    w.part = top;
    w.index = t;
    w.carry_out = true;
    return w;
  }
  __device__ KvBlock kv_block(const WorkItem& w, int i) const { return {w.part - 1 - i}; }
  __device__ void wait_kv(const WorkItem&, const KvBlock&) const {}
  __device__ void load_q(void* dst, uint64_t* bar, const WorkItem& w) const {
    plain.load_q(dst, bar, w);
  }
  __device__ void load_kv(void* dst, uint64_t* bar, const WorkItem& w, const KvBlock& blk,
                          int which) const {
    plain.load_kv(dst, bar, w, blk, which);
  }
  __device__ BlockMask mask(const WorkItem& w, int i) const {
    return plain.block_mask(w, w.part - 1 - i);
  }
  __device__ void load_state(float (&)[kORegs], float (&)[2], float (&)[2], const WorkItem&,
                             int) const {}
  __device__ void store_state(const float (&acc)[kORegs], const float (&m)[2], const float (&l)[2],
                              const WorkItem& w, int consumer) const {
    state.store(acc, m, l, w.index, consumer);
  }
  // Every piece carries out: the merge writes O.
  __device__ void store(const float (&)[kORegs], const float (&)[2], const WorkItem&, int,
                        uint8_t*) const {}
  __device__ void step_done(int) const {}
  __device__ void side_task(int, int) const {}
  __device__ void finish() const {}
};

// Column groups (of 8 columns: one float4 of a thread's state) a merge CTA takes.
constexpr int kMergeGroups = 4;

// Grid (tail items, D / 8 / kMergeGroups), 256 threads: thread (consumer, t) of CTA (i, g)
// merges what the same thread of the split kernel held - rows r, r + 8 of the consumer's 64 and
// the column groups [g kMergeGroups, (g + 1) kMergeGroups) - over item i's non-empty pieces, then
// writes those O elements (bf16) and, in column group 0's CTAs, the rows' LSE. o: [B, S_q, H, D]
// contiguous, lse [B, H, S_q] or null.
template <int kHeadDim>
__global__ void __launch_bounds__(256)
    merge_pieces_kernel(const __grid_constant__ SplitAttention<kHeadDim> split, __nv_bfloat16* o,
                        float scale_log2) {
  constexpr int kORegs = kHeadDim / 2;
  const int item = blockIdx.x;
  const int consumer = threadIdx.x / 128;
  const WorkItem w = split.plain.item(0, split.first + item);
  const int pieces = split.pieces;
  auto filled = [&](int p) {
    return piece_begin(w.blocks, p + 1, pieces) > piece_begin(w.blocks, p, pieces);
  };
  // The rows' largest maximum over the pieces (-inf: no piece saw a key of the row).
  float top[2] = {-INFINITY, -INFINITY};
  for (int p = 0; p < pieces; ++p) {
    if (!filled(p)) continue;
    const float4 ml = *split.state.ml_of(item * pieces + p, consumer);
    top[0] = fmaxf(top[0], ml.x);
    top[1] = fmaxf(top[1], ml.y);
  }
  float acc[kMergeGroups][4] = {};
  float l[2] = {0.f, 0.f};
  const int g0 = blockIdx.y * kMergeGroups;
  for (int p = 0; p < pieces; ++p) {
    if (!filled(p)) continue;
    const int slot = item * pieces + p;
    const float4 ml = *split.state.ml_of(slot, consumer);
    float f[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const float m = h == 0 ? ml.x : ml.y;
      f[h] = m == -INFINITY ? 0.f : exp2f((m - top[h]) * scale_log2);
    }
    l[0] += f[0] * ml.z;
    l[1] += f[1] * ml.w;
    const float4* so = split.state.o_of(slot, consumer);
#pragma unroll
    for (int j = 0; j < kMergeGroups; ++j) {
      const float4 v = so[(g0 + j) * 128];
      acc[j][0] += f[0] * v.x;
      acc[j][1] += f[0] * v.y;
      acc[j][2] += f[1] * v.z;
      acc[j][3] += f[1] * v.w;
    }
  }
  // Normalise as the plain kernel does: l over the quad; a row with no key gets O = 0, LSE -inf.
  const int t = threadIdx.x % 128;
  const int row0 = w.m * 128 + consumer * 64 + (t / 32) * 16 + (t % 32) / 4;
  const PlainAttention<kHeadDim>& plain = split.plain;
  const int64_t row_stride = static_cast<int64_t>(plain.heads) * kHeadDim;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const float sum = quad_sum(l[h]);
    const float inv = sum > 0.f ? 1.f / sum : 0.f;
    const int r = row0 + 8 * h;
    if (r >= plain.seq_q) continue;
    __nv_bfloat16* out = o + (static_cast<int64_t>(w.batch) * plain.seq_q + r) * row_stride +
                         static_cast<int64_t>(w.head) * kHeadDim + 2 * (t % 4);
#pragma unroll
    for (int j = 0; j < kMergeGroups; ++j) {
      *reinterpret_cast<uint32_t*>(out + (g0 + j) * 8) =
          gemm_engine::pack_bf16(acc[j][2 * h] * inv, acc[j][2 * h + 1] * inv);
    }
    if (plain.lse != nullptr && blockIdx.y == 0 && t % 4 == 0) {
      plain.lse[(static_cast<int64_t>(w.batch) * plain.heads + w.head) * plain.seq_q + r] =
          sum > 0.f ? (top[h] * scale_log2 + __log2f(sum)) * 0.69314718056f : -INFINITY;
    }
  }
  static_assert(kORegs / 4 % kMergeGroups == 0, "column groups a merge CTA");
}

}  // namespace mk::attention_engine
