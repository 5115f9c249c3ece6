// The attention engine's kernel: persistent, warp-specialised, TMA + wgmma (sm_90a).
//
//   O = softmax(scale * Q K^T [masked]) V per (batch, head), online softmax over KV blocks.
//
// One CTA per SM, three warpgroups. Warpgroup 0 is the producer: one thread loads a work item's
// Q tile (128 rows x D) once, then its KV blocks (128 keys x D each, K and V in separate stages of
// a ring) with TMA. Warpgroups 1 and 2 are consumers, each owning 64 query rows of the tile:
//
//   consumer, per work item (blocks b_0 .. b_{n-1}):
//     S = Q K_0^T; softmax -> P (bf16, registers)
//     for i = 1 .. n-1:
//       issue S = Q K_i^T                 (tensor cores, asynchronous)
//       issue O += P V_{i-1}              (P from registers: wgmma_bf16_rs)
//       wait for S; online softmax of S   (under the P V above)
//       wait for P V; P = bf16(S)
//     O += P V_{n-1}; O /= l; store O (bf16) and LSE
//
// with O rescaled for each new maximum before its next P V: D 128 right after issuing the next
// Q K^T (under it), D 64 right after the P V wait (AttentionConfig::kRescaleUnderQk).
//
// so that the exponentials of one block run while the tensor cores multiply the previous one
// (FlashAttention-3's intra-warpgroup overlap).
//
// The kernel is the mainloop; a Policy (PlainAttention below, or ring attention's) supplies the
// rest, the way the GEMM engine's Fusion policies do:
//   num_items(), item(t)          scheduler: the t-th work item (batch, head, query tile, the
//                                 number of KV blocks it visits); CTAs take them in a snake
//                                 over waves (snake_item)
//   load_q(dst, bar, item)        TMA of the item's Q tile (kChunks boxes of 128 rows x 64)
//   kv_block(item, i)             producer: where the item's i-th KV block lives (the policy's
//                                 KvBlock, found once a block and handed to the two below)
//   wait_kv(item, blk)            producer, before the block's loads: it has arrived (ring)
//   load_kv(dst, bar, item, blk, which)  TMA of the block, K (which 0) or V (1)
//   kKeysAhead                    the producer's order: K(i), V(i) (false), or K(i), V(i - 1) -
//                                 the consumers' order of use - so that a K load never waits
//                                 for a V stage (true: the ring, whose producer works out each
//                                 block's source between loads; measured 2026-12-02 at 3b6c3a3:
//                                 the ring non-causal 1-2.5% faster, the plain engine 0.5-1%
//                                 slower with it)
//   mask(item, i)                 which keys of block i each query row of the tile sees: at D
//                                 64 the producer's, with K's load (handed to the consumers in
//                                 shared memory beside the stage, so their loop runs no policy
//                                 code); at D 128 the consumers' own (AttentionConfig::
//                                 kProducerMasks says why)
//   store(o, lse, item, consumer, scratch)  epilogue: the normalised rows and their LSE
//
//   smem:  [ Q (128 x D) | K stage 0 .. S-1 | V stage 0 .. S-1 | epilogue buffers | barriers |
//            block masks (2S, D 64) ]
//          every tile 128-byte swizzled, D in chunks of 64 columns ([chunk][rows][64])
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>

#include <concepts>
#include <cstdint>

#include "gemm/gemm_kernel.cuh"  // store_slice, pack_bf16: the GEMM epilogue's data path
#include "mkernel/device/mbarrier.cuh"
#include "mkernel/device/tma.cuh"
#include "mkernel/device/wgmma.cuh"

namespace mk::attention_engine {

template <int kHeadDim_>
struct AttentionConfig {
  static constexpr int kHeadDim = kHeadDim_;  // 64 or 128
  static constexpr int kBlockM = 128;         // query rows: 2 consumer warpgroups x 64
  static constexpr int kBlockN = 128;         // keys per KV block
  static constexpr int kConsumers = 2;
  static constexpr int kThreads = 128 * (1 + kConsumers);
  static constexpr int kChunks = kHeadDim / 64;  // 64-column (128-byte) swizzle chunks of D
  static constexpr int kQBytes = kBlockM * kHeadDim * 2;
  static constexpr int kKvBytes = kBlockN * kHeadDim * 2;  // one K (or V) block
  static constexpr int kQChunkBytes = kBlockM * 128;
  static constexpr int kKvChunkBytes = kBlockN * 128;
  // Epilogue staging: per consumer, two 64 x 64 bf16 buffers (gemm_engine::store_slice).
  static constexpr int kEpilogueBytes = kConsumers * 2 * 64 * 64 * 2;
  static constexpr int kSmemLimit = 227 * 1024;
  static constexpr int kMaxStages = 4;
  // (256 bytes for the barriers and the masks' slots: 16 + 48 a stage, 208 at 4 stages.)
  static constexpr int kFit = (kSmemLimit - 1024 - kQBytes - kEpilogueBytes - 256) / (2 * kKvBytes);
  static constexpr int kStages = kFit < kMaxStages ? kFit : kMaxStages;
  // Who works out a block's mask: the producer, handing it over in shared memory so that the
  // consumers' block loop runs no policy code (D 64, whose loop is softmax-bound: faster at
  // every shape measured), or each consumer between the block's Q K^T and its softmax (D 128,
  // the plain engine and the ring: slower with the hand-over; journal, 2026-12-05).
  static constexpr bool kProducerMasks = kHeadDim == 64;
  // Whether the consumers keep a block's softmax ahead of the wait for the block before's P V
  // (pin_before_wait) and write O's zeros before they wait for Q: D 128 faster with both, D 64
  // slower, for a reason not yet found (journal, 2026-12-06).
  static constexpr bool kSoftmaxUnderPv = kHeadDim == 128;
  // Barriers: q_full, q_empty, k_full[S], k_empty[S], v_full[S], v_empty[S]; then the blocks'
  // masks (kv_len, diag), 2S slots by block number (kProducerMasks).
  static constexpr int kMaskSlots = 2 * kStages;
  static constexpr int kSmemBytes = 1024 + kQBytes + 2 * kStages * kKvBytes + kEpilogueBytes +
                                    (2 + 4 * kStages) * 8 + (kProducerMasks ? kMaskSlots * 8 : 0);
  static constexpr int kORegs = kHeadDim / 2;  // O accumulator registers per consumer thread
  static constexpr int kSRegs = kBlockN / 2;   // S accumulator registers per consumer thread
  // Where O is rescaled for a block's new maximum: under the next block's Q K^T (D 128: 1-6%
  // faster on the H200, measured side by side) or after the P V, before the next Q K^T (D 64:
  // moving it measured 6-8% slower).
  static constexpr bool kRescaleUnderQk = kHeadDim == 128;
  static_assert(kHeadDim == 64 || kHeadDim == 128, "head dims of the engine");
  static_assert(kStages >= 2, "too few KV stages fit");
  static_assert(kSmemBytes <= kSmemLimit, "shared memory per CTA on sm_90");
};

// Named barriers (id 0 is __syncthreads): each consumer warpgroup's own for its epilogue (1 +
// consumer: gemm_engine::store_slice numbers them so), and a policy's side warps' (the 96
// threads of the producer warpgroup's warps 1-3).
enum NamedBarrier : int { kEpilogueBarrier0 = 1, kSideBarrier = 3 };

// One work item: query tile `m` (rows 128 m ..) of (batch, head), reading key head kv_head, at
// step `step` (ring attention: a round of chunks), and the number of KV blocks it visits there
// (0: none). carry_in: the tile's softmax state (O, m, l) comes from an earlier step
// (load_state); carry_out: a later step goes on from it (store_state) instead of this item
// writing O and LSE. A tile that sees no key at all gets O = 0 and LSE = -inf.
struct WorkItem {
  int step;
  int index;  // t: the item's place among the step's items (the same tile at every step)
  int batch;
  int head;
  int kv_head;
  int part;  // the query rows' part (ring attention's zigzag halves; 0 otherwise)
  int m;
  int blocks;
  bool carry_in;
  bool carry_out;
  // A policy's per-item note for its mask() (ring attention: the item's one masked block, worked
  // out once an item so the consumers' block loop reloads no kernel parameters for it).
  int mask_hint;
};

// Which keys of a KV block each query row of the tile sees: key column c (0..127 in the block)
// is visible to tile row r (0..127) iff c < kv_len and c <= r + diag. `active` false: all of them
// (no masking needed).
struct BlockMask {
  bool active;
  int kv_len;
  int diag;
};

// The hooks every policy has, with their signatures (kORegs: a consumer's O registers), and its
// register split (setmaxnreg) as kProducerRegs / kConsumerRegs.
template <class P, int kORegs>
concept AttentionPolicy = requires(const P p, const WorkItem& item, int i,
                                   const typename P::KvBlock& blk, void* dst, uint64_t* bar,
                                   float (&o)[kORegs], const float (&co)[kORegs], float (&row)[2],
                                   const float (&crow)[2], uint8_t* scratch) {
  { P::kProducerRegs } -> std::convertible_to<int>;
  { P::kConsumerRegs } -> std::convertible_to<int>;
  { P::kKeysAhead } -> std::convertible_to<bool>;
  { p.num_steps() } -> std::same_as<int>;
  { p.num_items() } -> std::same_as<int>;
  { p.item(i, i) } -> std::same_as<WorkItem>;
  { p.kv_block(item, i) } -> std::same_as<typename P::KvBlock>;
  { p.wait_kv(item, blk) } -> std::same_as<void>;
  { p.load_q(dst, bar, item) } -> std::same_as<void>;
  { p.load_kv(dst, bar, item, blk, i) } -> std::same_as<void>;
  { p.mask(item, i) } -> std::same_as<BlockMask>;
  { p.load_state(o, row, row, item, i) } -> std::same_as<void>;
  { p.store_state(co, crow, crow, item, i) } -> std::same_as<void>;
  { p.store(co, crow, item, i, scratch) } -> std::same_as<void>;
  { p.step_done(i) } -> std::same_as<void>;
  { p.side_task(i, i) } -> std::same_as<void>;
  { p.finish() } -> std::same_as<void>;
};

__device__ __forceinline__ float exp2_approx(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// Max and sum over the four threads of a quad (they hold one row's columns).
__device__ __forceinline__ float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}
__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

// The online softmax of one consumer thread's two rows (r and r + 8 of its warpgroup's 64).
//   m: the running maximum of the raw scores (-inf before any visible key)
//   l: this thread's part of the running sum of exp2(scale_log2 * (s - m)) (the quad's four
//      parts are added at the end)
template <int kSRegs>
struct OnlineSoftmax {
  float m[2] = {-INFINITY, -INFINITY};
  float l[2] = {0.f, 0.f};

  // s (raw scores) -> probabilities in place; returns in `rescale` the factor by which O and l
  // shrink for each row.
  __device__ __forceinline__ void step(float (&s)[kSRegs], float scale_log2, float (&rescale)[2]) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float mx = m[h];
#pragma unroll
      for (int j = 0; j < kSRegs / 4; ++j)
        mx = fmaxf(mx, fmaxf(s[4 * j + 2 * h], s[4 * j + 2 * h + 1]));
      mx = quad_max(mx);
      // A row with no visible key yet keeps m = -inf: subtract 0 so exp2 gives 0, not NaN.
      const float m_scaled = mx == -INFINITY ? 0.f : mx * scale_log2;
      rescale[h] = exp2_approx(m[h] * scale_log2 - m_scaled);
      m[h] = mx;
      float sum = 0.f;
#pragma unroll
      for (int j = 0; j < kSRegs / 4; ++j) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          float& x = s[4 * j + 2 * h + e];
          x = exp2_approx(fmaf(x, scale_log2, -m_scaled));
          sum += x;
        }
      }
      l[h] = l[h] * rescale[h] + sum;
    }
  }
};

// A consumer's softmax state (O not yet normalised, m, its own part of l) kept in global memory
// as its registers are: per (slot, consumer) kORegs / 4 float4 a thread, then one float4 (m0, m1,
// l0, l1) a thread - coalesced, no shuffles; read back by a thread of the same place (ring
// attention's rounds) or merged (the split tail's pieces, split_attention.cuh).
//   o:  float4 [slots][2 consumers][kORegs / 4][128 threads]
//   ml: float4 [slots][2 consumers][128 threads]
template <int kORegs>
struct StateImage {
  float4* o;
  float4* ml;

  __device__ float4* o_of(int slot, int consumer) const {
    return o + static_cast<int64_t>(slot * 2 + consumer) * (kORegs / 4) * 128 + threadIdx.x % 128;
  }
  __device__ float4* ml_of(int slot, int consumer) const {
    return ml + static_cast<int64_t>(slot * 2 + consumer) * 128 + threadIdx.x % 128;
  }
  __device__ void load(float (&acc)[kORegs], float (&m)[2], float (&l)[2], int slot,
                       int consumer) const {
    const float4* so = o_of(slot, consumer);
#pragma unroll
    for (int j = 0; j < kORegs / 4; ++j) {
      const float4 v = so[j * 128];
      acc[4 * j] = v.x;
      acc[4 * j + 1] = v.y;
      acc[4 * j + 2] = v.z;
      acc[4 * j + 3] = v.w;
    }
    const float4 v = *ml_of(slot, consumer);
    m[0] = v.x;
    m[1] = v.y;
    l[0] = v.z;
    l[1] = v.w;
  }
  __device__ void store(const float (&acc)[kORegs], const float (&m)[2], const float (&l)[2],
                        int slot, int consumer) const {
    float4* so = o_of(slot, consumer);
#pragma unroll
    for (int j = 0; j < kORegs / 4; ++j) {
      so[j * 128] = make_float4(acc[4 * j], acc[4 * j + 1], acc[4 * j + 2], acc[4 * j + 3]);
    }
    *ml_of(slot, consumer) = make_float4(m[0], m[1], l[0], l[1]);
  }
};

// Sets the scores of the keys a row does not see to -inf (thread's rows r, r + 8 of consumer
// `consumer`'s 64; columns as in the wgmma accumulator layout).
template <int kSRegs>
__device__ __forceinline__ void apply_mask(float (&s)[kSRegs], const BlockMask& mask,
                                           int consumer) {
  const int t = threadIdx.x % 128;
  const int row = consumer * 64 + (t / 32) * 16 + (t % 32) / 4;
  const int col = 2 * (t % 4);
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int limit = min(mask.kv_len - 1, row + 8 * h + mask.diag);  // last visible column
#pragma unroll
    for (int j = 0; j < kSRegs / 4; ++j) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        if (8 * j + col + e > limit) s[4 * j + 2 * h + e] = -INFINITY;
      }
    }
  }
}

// Keeps the softmax that produced x before the wgmma wait that follows it, under the P V in
// flight: a shared-memory store of x that never executes (x, a row sum of exponentials, is never
// negative). ptxas keeps memory operations in order with wgmma.wait_group; without one, it
// moved the wait to the top of the softmax (after its first two max instructions), so a
// warpgroup's exponentials never overlapped its own P V - only the other warpgroup's.
__device__ __forceinline__ void pin_before_wait(float x, void* smem) {
  const auto a = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  asm volatile(
      "{\n .reg .pred p;\n setp.lt.f32 p, %0, 0f00000000;\n @p st.shared.f32 [%1], %0;\n}" ::"f"(x),
      "r"(a)
      : "memory");
}

// P (fp32 probabilities in the S accumulator layout) -> bf16 A fragments, one per 16 keys.
template <int kSRegs>
__device__ __forceinline__ void to_fragments(const float (&s)[kSRegs],
                                             uint32_t (&p)[kSRegs / 8][4]) {
#pragma unroll
  for (int kk = 0; kk < kSRegs / 8; ++kk) {
#pragma unroll
    for (int i = 0; i < 4; ++i)
      p[kk][i] = gemm_engine::pack_bf16(s[8 * kk + 2 * i], s[8 * kk + 2 * i + 1]);
  }
}

// The plain attention of attention(): items (batch, head, query tile) with the query tiles of a
// head next to each other (they share its K and V in L2) and, causal, the longest first; a tile
// visits its KV blocks from the last (the diagonal, masked) down to 0.
template <int kHeadDim>
struct PlainAttention {
  CUtensorMap q;  // (D, H, S_q, B): boxes of 64 x 1 x 128 x 1
  CUtensorMap k;  // (D, H_kv, S_kv, B)
  CUtensorMap v;
  CUtensorMap o;  // (D, H, S_q, B): boxes of 64 x 1 x 64 x 1
  float* lse;     // [B, H, S_q] or null
  int heads;
  int group;  // H / H_kv
  int seq_q;
  int seq_kv;
  int m_tiles;
  int kv_blocks;
  int items;
  bool causal;

  static constexpr int kProducerRegs = 40;
  static constexpr bool kKeysAhead = false;
  static constexpr int kConsumerRegs = 232;

  __device__ int num_steps() const { return 1; }
  __device__ int num_items() const { return items; }
  __device__ WorkItem item(int, int t) const {
    WorkItem w{};
    const int bh = t / m_tiles;
    const int in_head = t % m_tiles;
    w.m = causal ? m_tiles - 1 - in_head : in_head;
    w.batch = bh / heads;
    w.head = bh % heads;
    w.kv_head = w.head / group;
    // Keys visible to the tile's last row: up to (last row) + S_kv - S_q when causal.
    const int last_row = min(seq_q, (w.m + 1) * 128) - 1;
    const int last_key = causal ? min(seq_kv - 1, last_row + seq_kv - seq_q) : seq_kv - 1;
    w.blocks = last_key < 0 ? 0 : last_key / 128 + 1;
    w.index = t;
    return w;
  }
  // Block i of an item is KV block blocks - 1 - i.
  struct KvBlock {
    int n;
  };
  __device__ KvBlock kv_block(const WorkItem& w, int i) const { return {w.blocks - 1 - i}; }
  __device__ void wait_kv(const WorkItem&, const KvBlock&) const {}
  __device__ void load_q(void* dst, uint64_t* bar, const WorkItem& w) const {
#pragma unroll
    for (int c = 0; c < kHeadDim / 64; ++c) {
      dev::tma_load_4d(static_cast<uint8_t*>(dst) + c * 128 * 128, &q, bar, 64 * c, w.head,
                       w.m * 128, w.batch);
    }
  }
  __device__ void load_kv(void* dst, uint64_t* bar, const WorkItem& w, const KvBlock& blk,
                          int which) const {
    const int n = blk.n;
#pragma unroll
    for (int c = 0; c < kHeadDim / 64; ++c) {
      dev::tma_load_4d(static_cast<uint8_t*>(dst) + c * 128 * 128, which == 0 ? &k : &v, bar,
                       64 * c, w.kv_head, n * 128, w.batch);
    }
  }
  __device__ BlockMask mask(const WorkItem& w, int i) const {
    return block_mask(w, w.blocks - 1 - i);
  }
  // The keys of KV block n the item's rows see.
  __device__ BlockMask block_mask(const WorkItem& w, int n) const {
    const int kv_len = seq_kv - n * 128;
    const int diag = causal ? w.m * 128 + seq_kv - seq_q - n * 128 : (1 << 30);
    return {kv_len < 128 || diag < 127, kv_len, diag};
  }
  // The consumer's 64 rows of O (normalised, fp32 accumulator layout) and their LSE (the thread's
  // rows r and r + 8; natural log).
  __device__ void store(const float (&acc)[kHeadDim / 2], const float (&row_lse)[2],
                        const WorkItem& w, int consumer, uint8_t* scratch) const {
    const int row0 = w.m * 128 + consumer * 64;
    gemm_engine::store_slice(acc, 0, kHeadDim, consumer, scratch, [&](const uint8_t* buf, int j) {
      dev::tma_store_4d(&o, buf, 64 * j, w.head, row0, w.batch);
    });
    const int t = threadIdx.x % 128;
    if (lse != nullptr && t % 4 == 0) {
      const int r = row0 + (t / 32) * 16 + (t % 32) / 4;
      float* out = lse + (static_cast<int64_t>(w.batch) * heads + w.head) * seq_q;
      if (r < seq_q) out[r] = row_lse[0];
      if (r + 8 < seq_q) out[r + 8] = row_lse[1];
    }
  }
  // One step, no carried state, no side work.
  __device__ void load_state(float (&)[kHeadDim / 2], float (&)[2], float (&)[2], const WorkItem&,
                             int) const {}
  __device__ void store_state(const float (&)[kHeadDim / 2], const float (&)[2], const float (&)[2],
                              const WorkItem&, int) const {}
  __device__ void step_done(int) const {}
  __device__ void side_task(int, int) const {}
  __device__ void finish() const {}
};

// The work item a CTA takes in wave w (items [w G, (w + 1) G) on G CTAs): the c-th on even waves,
// the (G - 1 - c)-th on odd ones. Causal items come longest first within a head, so a CTA that
// drew a long item in one wave draws a short one in the next: with plain round robin, the CTAs'
// totals differed by up to a third at 8 query tiles a head; the snake keeps them within a few
// percent, and consecutive items (one head's K and V in L2) still run side by side.
__device__ __forceinline__ int snake_item(int wave) {
  const int g = static_cast<int>(gridDim.x), c = static_cast<int>(blockIdx.x);
  return wave * g + (wave % 2 == 0 ? c : g - 1 - c);
}

template <class Cfg, class Policy>
__global__ void __launch_bounds__(Cfg::kThreads, 1)
    attention_kernel(const __grid_constant__ Policy policy, float scale_log2) {
  static_assert(AttentionPolicy<Policy, Cfg::kORegs>,
                "a policy needs the engine's hooks with their signatures (AttentionPolicy)");
  static_assert(Policy::kProducerRegs % 8 == 0 && Policy::kConsumerRegs % 8 == 0 &&
                    Policy::kProducerRegs + Cfg::kConsumers * Policy::kConsumerRegs <=
                        (1 + Cfg::kConsumers) * 168,
                "setmaxnreg split beyond the CTA's registers");
  constexpr int kStages = Cfg::kStages;
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem =
      reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t{1023});
  uint8_t* q_smem = smem;                                     // (kChunks, 128, 64)
  uint8_t* k_smem = q_smem + Cfg::kQBytes;                    // (stages, kChunks, 128, 64)
  uint8_t* v_smem = k_smem + kStages * Cfg::kKvBytes;         // (stages, kChunks, 128, 64)
  uint8_t* epilogue_smem = v_smem + kStages * Cfg::kKvBytes;  // (consumers, 2, 64, 64)
  uint64_t* q_full = reinterpret_cast<uint64_t*>(epilogue_smem + Cfg::kEpilogueBytes);
  uint64_t* q_empty = q_full + 1;
  uint64_t* k_full = q_empty + 1;
  uint64_t* k_empty = k_full + kStages;
  uint64_t* v_full = k_empty + kStages;
  uint64_t* v_empty = v_full + kStages;
  // (kProducerMasks) Block j's mask in slot j % kMaskSlots, written before K's full barrier is
  // armed (its release orders it) and read after the wait on it, once block j's Q K^T is done. The
  // slot is written again for block j + 2S, once both consumers have handed back block j + S's K -
  // after both read block j's mask (a lap of slack: they hand back block j's K before reading it).
  int2* masks = reinterpret_cast<int2*>(v_empty + kStages);
  auto put_mask = [&](int j, const BlockMask& m) {
    masks[j % Cfg::kMaskSlots] =
        m.active ? make_int2(m.kv_len, m.diag) : make_int2(Cfg::kBlockN, 1 << 30);
  };
  // The producer's wait for the stage of item w's block i (block j of the CTA's ring) that K
  // loads into: with kProducerMasks the block's mask worked out before the wait (off the path
  // from the stage's release to its load) and handed over after it.
  auto wait_k_stage = [&](uint64_t* empty, uint32_t parity, const WorkItem& w, int i, int j) {
    BlockMask mask{};
    if constexpr (Cfg::kProducerMasks) mask = policy.mask(w, i);
    dev::mbarrier_wait(empty, parity);
    if constexpr (Cfg::kProducerMasks) put_mask(j, mask);
  };
  // The consumers' mask of item w's block i (block it + i of the CTA's ring): the producer's,
  // or worked out here.
  auto consumer_mask = [&](const WorkItem& w, int it, int i) {
    if constexpr (Cfg::kProducerMasks) {
      const int2 v = masks[(it + i) % Cfg::kMaskSlots];
      return BlockMask{v.x < Cfg::kBlockN || v.y < Cfg::kBlockN - 1, v.x, v.y};
    } else {
      return policy.mask(w, i);
    }
  };

  if (threadIdx.x == 0) {
    dev::mbarrier_init(q_full, 1);
    dev::mbarrier_init(q_empty, Cfg::kConsumers);
    for (int s = 0; s < kStages; ++s) {
      dev::mbarrier_init(&k_full[s], 1);
      dev::mbarrier_init(&k_empty[s], Cfg::kConsumers);
      dev::mbarrier_init(&v_full[s], 1);
      dev::mbarrier_init(&v_empty[s], Cfg::kConsumers);
    }
    dev::mbarrier_init_fence();
  }
  __syncthreads();

  // This CTA's items of a step, in order (the same tiles at every step).
  const int items = policy.num_items();
  auto for_each_item = [&](int step, auto&& fn) {
    for (int wave = 0; wave * static_cast<int>(gridDim.x) < items; ++wave) {
      const int t = snake_item(wave);
      if (t < items) fn(policy.item(step, t));
    }
  };

  const int warpgroup = threadIdx.x / 128;
  if (warpgroup == 0) {
    // ---- producer ----
    dev::warpgroup_reg_dealloc<Policy::kProducerRegs>();
    if (threadIdx.x == 0) {
      int it = 0;     // KV blocks loaded by this CTA across items: position in the stage ring
      int tiles = 0;  // Q tiles loaded
      for (int step = 0; step < policy.num_steps(); ++step) {
        for_each_item(step, [&](const WorkItem& w) {
          if (w.blocks == 0) return;
          dev::mbarrier_wait(q_empty, (tiles & 1) ^ 1);  // the first passes at once
          dev::mbarrier_arrive_expect_tx(q_full, Cfg::kQBytes);
          policy.load_q(q_smem, q_full, w);
          ++tiles;
          if constexpr (Policy::kKeysAhead) {
            // K of block i, then V of block i - 1: the consumers' order of use.
            auto load = [&](int which, int i, const typename Policy::KvBlock& blk) {
              const int s = (it + i) % kStages;
              uint64_t* empty = which == 0 ? &k_empty[s] : &v_empty[s];
              uint64_t* full = which == 0 ? &k_full[s] : &v_full[s];
              uint8_t* dst = (which == 0 ? k_smem : v_smem) + s * Cfg::kKvBytes;
              const uint32_t parity = (((it + i) / kStages) & 1) ^ 1;  // first lap: at once
              if (which == 0) {
                wait_k_stage(empty, parity, w, i, it + i);
              } else {
                dev::mbarrier_wait(empty, parity);
              }
              dev::mbarrier_arrive_expect_tx(full, Cfg::kKvBytes);
              policy.load_kv(dst, full, w, blk, which);
            };
            typename Policy::KvBlock prev{};  // the block whose V is still to load
            for (int i = 0; i < w.blocks; ++i) {
              const typename Policy::KvBlock blk = policy.kv_block(w, i);
              policy.wait_kv(w, blk);
              load(0, i, blk);
              if (i > 0) load(1, i - 1, prev);
              prev = blk;
            }
            load(1, w.blocks - 1, prev);
            it += w.blocks;
          } else {
            for (int i = 0; i < w.blocks; ++i, ++it) {
              const int s = it % kStages;
              const uint32_t phase = ((it / kStages) & 1) ^ 1;
              const typename Policy::KvBlock blk = policy.kv_block(w, i);
              policy.wait_kv(w, blk);
              wait_k_stage(&k_empty[s], phase, w, i, it);
              dev::mbarrier_arrive_expect_tx(&k_full[s], Cfg::kKvBytes);
              policy.load_kv(k_smem + s * Cfg::kKvBytes, &k_full[s], w, blk, 0);
              dev::mbarrier_wait(&v_empty[s], phase);
              dev::mbarrier_arrive_expect_tx(&v_full[s], Cfg::kKvBytes);
              policy.load_kv(v_smem + s * Cfg::kKvBytes, &v_full[s], w, blk, 1);
            }
          }
        });
      }
    } else if (threadIdx.x >= 32) {
      policy.side_task(threadIdx.x - 32, 96);
    }
  } else {
    // ---- consumers ----
    dev::warpgroup_reg_alloc<Policy::kConsumerRegs>();
    const int consumer = warpgroup - 1;  // rows [64 consumer, 64 consumer + 64) of the tile
    const bool leader = threadIdx.x % 128 == 0;
    uint8_t* scratch = epilogue_smem + consumer * (Cfg::kEpilogueBytes / Cfg::kConsumers);
    // Q K^T: A = this consumer's 64 Q rows, B = a K block, both K-major (D along the swizzle
    // rows).
    auto issue_s = [&](float(&s)[Cfg::kSRegs], int stage) {
      dev::wgmma_fence_operands(s);
      dev::wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < Cfg::kHeadDim / 16; ++kk) {
        const int chunk = kk / 4, col = (kk % 4) * 32;
        const uint64_t da =
            dev::wgmma_desc_sw128(q_smem + chunk * Cfg::kQChunkBytes + consumer * 64 * 128 + col);
        const uint64_t db = dev::wgmma_desc_sw128(k_smem + stage * Cfg::kKvBytes +
                                                  chunk * Cfg::kKvChunkBytes + col);
        dev::wgmma_bf16<Cfg::kBlockN, false>(s, da, db, kk > 0);
      }
      dev::wgmma_commit();
    };
    // O += P V: A = P (registers), B = a V block, N-major (D along the swizzle rows, keys = K).
    auto issue_pv = [&](float(&o)[Cfg::kORegs], uint32_t(&p)[Cfg::kBlockN / 16][4], int stage) {
      dev::wgmma_fence_operands(o);
      dev::wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < Cfg::kBlockN / 16; ++kk) {
        const uint64_t db = dev::wgmma_desc_sw128_mn(v_smem + stage * Cfg::kKvBytes + kk * 16 * 128,
                                                     Cfg::kKvChunkBytes);
        dev::wgmma_bf16_rs<Cfg::kHeadDim, true>(o, p[kk], db, true);
      }
      dev::wgmma_commit();
    };
    auto rescale_o = [&](float(&o)[Cfg::kORegs], const float(&rescale)[2]) {
#pragma unroll
      for (int j = 0; j < Cfg::kORegs / 4; ++j) {
        o[4 * j] *= rescale[0];
        o[4 * j + 1] *= rescale[0];
        o[4 * j + 2] *= rescale[1];
        o[4 * j + 3] *= rescale[1];
      }
    };

    int it = 0, tiles = 0;
    for (int step = 0; step < policy.num_steps(); ++step) {
      for_each_item(step, [&](const WorkItem& w) {
        if (w.blocks == 0 && w.carry_out) return;  // nothing to add, nothing to write yet
        float o[Cfg::kORegs];
        OnlineSoftmax<Cfg::kSRegs> softmax;
        if (w.carry_in) {  // the state an earlier step of this tile left
          policy.load_state(o, softmax.m, softmax.l, w, consumer);
        } else {
#pragma unroll
          for (int i = 0; i < Cfg::kORegs; ++i) o[i] = 0.f;
        }
        // O's registers are written here, while Q and K are awaited. Without the fence a policy
        // whose O always starts at zero (RingAttention's one-round kernel) had its zeroing
        // deferred past block 0's softmax, and a zero-O special case computed there for every
        // item, in the gap before block 1's Q K^T.
        if constexpr (Cfg::kSoftmaxUnderPv) dev::wgmma_fence_operands(o);
        if (w.blocks > 0) {
          dev::mbarrier_wait(q_full, tiles & 1);
          ++tiles;
          float s[Cfg::kSRegs];
          uint32_t p[Cfg::kBlockN / 16][4];
          float rescale[2];
          // Block 0: S, softmax, P.
          int stage = it % kStages;
          dev::mbarrier_wait(&k_full[stage], (it / kStages) & 1);
          issue_s(s, stage);
          dev::wgmma_wait<0>();
          dev::wgmma_fence_operands(s);
          if (leader) {
            dev::mbarrier_arrive(&k_empty[stage]);
            if (w.blocks == 1) dev::mbarrier_arrive(q_empty);
          }
          BlockMask mask = consumer_mask(w, it, 0);
          if (mask.active) apply_mask(s, mask, consumer);
          softmax.step(s, scale_log2, rescale);
          if (!Cfg::kRescaleUnderQk && w.carry_in) rescale_o(o, rescale);
          to_fragments(s, p);
          for (int i = 1; i < w.blocks; ++i) {
            const int prev = stage;
            stage = (it + i) % kStages;
            dev::mbarrier_wait(&k_full[stage], ((it + i) / kStages) & 1);
            if constexpr (Cfg::kRescaleUnderQk) {
              issue_s(s, stage);
              rescale_o(o, rescale);  // for block i - 1's maximum (zeros before the first P V)
              dev::mbarrier_wait(&v_full[prev], ((it + i - 1) / kStages) & 1);
            } else {
              dev::mbarrier_wait(&v_full[prev], ((it + i - 1) / kStages) & 1);
              issue_s(s, stage);
            }
            issue_pv(o, p, prev);
            dev::wgmma_wait<1>();  // S is done
            dev::wgmma_fence_operands(s);
            if (leader) {
              dev::mbarrier_arrive(&k_empty[stage]);
              if (i == w.blocks - 1) dev::mbarrier_arrive(q_empty);  // the tile's last Q K^T
            }
            mask = consumer_mask(w, it, i);
            if (mask.active) apply_mask(s, mask, consumer);
            softmax.step(s, scale_log2, rescale);
            if constexpr (Cfg::kSoftmaxUnderPv) {
              pin_before_wait(fminf(softmax.l[0], softmax.l[1]), scratch);  // (never stores)
            }
            dev::wgmma_wait<0>();  // P V is done: O and P may change
            dev::wgmma_fence_operands(o);
#pragma unroll
            for (int kk = 0; kk < Cfg::kBlockN / 16; ++kk) dev::wgmma_fence_operands(p[kk]);
            if (leader) dev::mbarrier_arrive(&v_empty[prev]);
            if (!Cfg::kRescaleUnderQk) rescale_o(o, rescale);
            to_fragments(s, p);
          }
          if (Cfg::kRescaleUnderQk) rescale_o(o, rescale);
          dev::mbarrier_wait(&v_full[stage], ((it + w.blocks - 1) / kStages) & 1);
          issue_pv(o, p, stage);
          dev::wgmma_wait<0>();
          dev::wgmma_fence_operands(o);
#pragma unroll
          for (int kk = 0; kk < Cfg::kBlockN / 16; ++kk) dev::wgmma_fence_operands(p[kk]);
          if (leader) dev::mbarrier_arrive(&v_empty[stage]);
          it += w.blocks;
        }
        if (w.carry_out) {  // a later step of this tile goes on from here
          policy.store_state(o, softmax.m, softmax.l, w, consumer);
          return;
        }
        // Normalise: l over the quad; a row that saw no key keeps O = 0 and gets LSE = -inf.
        float row_lse[2];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const float l = quad_sum(softmax.l[h]);
          const float inv = l > 0.f ? 1.f / l : 0.f;
          row_lse[h] =
              l > 0.f ? (softmax.m[h] * scale_log2 + __log2f(l)) * 0.69314718056f : -INFINITY;
#pragma unroll
          for (int j = 0; j < Cfg::kORegs / 4; ++j) {
            o[4 * j + 2 * h] *= inv;
            o[4 * j + 2 * h + 1] *= inv;
          }
        }
        policy.store(o, row_lse, w, consumer, scratch);
      });
      if (leader) policy.step_done(step);  // this warpgroup read the step's last KV block
    }
    if (leader) dev::bulk_wait_group<0>();  // the last stores have landed
  }
  policy.finish();
}

}  // namespace mk::attention_engine
