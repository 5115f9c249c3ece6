// moe_layer in one persistent launch: dispatch -> gate / up + SwiGLU -> down -> combine
// (mkernel/moe.h, docs/design/moe_layer.md).
//
// Per rank and call, on its stream: the route kernels and notify_kernel (as moe_dispatch_gemm's:
// the layout, the GEMMs' tables with one tile per tile-row, the block counters zeroed), the
// combine counters zeroed (a memset), then the GEMM engine with MoeLayerFused, one CTA per SM:
//   side warps  the rows placed, as moe_dispatch_gemm's (send - the consumers copying -, wait
//               for every source's rows, every row bound here in layout order, the handle's
//               unused rows); a row past its expert's room (the capacity error, recorded by
//               notify) is counted as done at its source, without data
//   producer    a gate / up tile waits for its rows (the block counter), a down tile for the
//               gate / up tiles of its tile-row (GroupedSwigluDown)
//   consumers   first the sends' copies (moe_dispatch_gemm's consumer_prologue); then gate / up:
//               SwiGLU, h stored, the tile-row's count (GroupedSwigluDown); down: each row of
//               the tile straight to its source's combine slot [token][slot] (the handle), then
//               per row the flag (this launch's epoch) and one count in the source's counter of
//               (token, column block)
//   every warp  last (finish, once the CTA's tiles are done), the combine's sums: this rank's
//               (token, 256-column span) pairs dealt out over all warps of all CTAs; each waits
//               until every valid slot of its token has counted in, then sums the slots that
//               came, w x y in fp32 in slot order, rounded once - moe_combine's sum, bit for bit
// No y in the dispatch layout and no second pass over it: the down tiles' outputs land where the
// sums read them. A token's slots sit in (mostly) different experts, so its sums can start only
// near the end of the down tiles; they run on every warp then (a tail bound by memory: 2 x k x H
// bytes read a token), not on the three side warps alone (measured: 6 ms of 18 at DeepSeek-V3
// 8192 tokens when they did).
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "gemm/gemm_kernel.cuh"
#include "gemm/grouped_gemm.cuh"
#include "moe/moe_dispatch_gemm.cuh"
#include "moe/moe_kernels.cuh"

namespace mk::moe {

template <int kBlockN>
struct MoeLayerFused {
  // The side warps place rows (moe_dispatch_gemm's register split: 88 at 256-wide tiles, 120
  // below); the consumers hold the tile's accumulators in the rest.
  static constexpr gemm_engine::FusionTraits kTraits{
      .init_shared = true,
      .load_b = true,
      .split_k = true,
      .consumer_prologue = true,
      .producer_regs = MoeDispatchGemm<kBlockN>::kTraits.producer_regs,
      .consumer_regs = MoeDispatchGemm<kBlockN>::kTraits.consumer_regs};

  MoeDispatchGemm<kBlockN> dispatch;              // the rows' placement and the tiles' waits for
                                                  // them (its `grouped` is not used)
  gemm_engine::GroupedSwigluDown<kBlockN> gemms;  // the tiles, their loads and gate / up's store
  const float* weights;                           // [T, k] fp32
  __nv_bfloat16* out;                             // [T, H]
  int count_stride;                               // counters per token (ceil(H / 128))

  using ConsumerState = typename gemm_engine::GroupedSwigluDown<kBlockN>::ConsumerState;

  __device__ int num_tiles() const { return gemms.num_tiles(); }
  __device__ gemm_engine::Tile tile(int t) const { return gemms.tile(t); }

  // (Traced through dispatch.trace, as the side warps' placement is.)
  __device__ void wait_operands(const gemm_engine::Tile& tile) const {
    if (gemms.is_down(tile)) {
      const uint32_t arg = static_cast<uint32_t>(tile.shard) + (1u << 16);
      fused::trace_mark(dispatch.trace, fused::kTraceProducer, fused::kTraceOperandsWait, arg);
      gemms.wait_operands(tile);
      fused::trace_mark(dispatch.trace, fused::kTraceProducer, fused::kTraceOperandsIn, arg);
    } else {
      dispatch.wait_operands(tile);
    }
  }
  __device__ void init_shared() const { dispatch.init_shared(); }
  __device__ void load_a(void* dst, uint64_t* bar, const gemm_engine::Tile& tile, int k0) const {
    gemms.load_a(dst, bar, tile, k0);
  }
  __device__ void load_b(void* dst, uint64_t* bar, const gemm_engine::Tile& tile, int k0) const {
    gemms.load_b(dst, bar, tile, k0);
  }

  // A handle row names a rank, one of its tokens and a slot (else the row is not stored).
  __device__ bool handle_ok(int32_t src, int32_t token, int32_t slot) const {
    const Dims& d = dispatch.d;
    return src >= 0 && src < d.world && token >= 0 && token < d.max_tokens && slot >= 0 &&
           slot < d.top_k;
  }

  __device__ uint64_t* counter(int src, int64_t token, int block) const {
    const Workspace& ws = dispatch.ws;
    return ws.at<uint64_t>(src, ws.comb_count) + token * count_stride + block;
  }

  template <int kRegs>
  __device__ void store(const float (&acc)[kRegs], const gemm_engine::Tile& tile, int consumer,
                        uint8_t* scratch, ConsumerState& state) const {
    const bool leader = threadIdx.x % 128 == 0;
    const int lane = fused::kTraceConsumer0 + consumer;
    if (leader)
      fused::trace_mark(dispatch.trace, lane, fused::kTraceStoreBegin, gemms.is_down(tile));
    store_tile(acc, tile, consumer, scratch, state);
    if (leader) fused::trace_mark(dispatch.trace, lane, fused::kTraceStoreEnd);
  }
  template <int kRegs>
  __device__ void store_tile(const float (&acc)[kRegs], const gemm_engine::Tile& tile, int consumer,
                             uint8_t* scratch, ConsumerState& state) const {
    if (!gemms.is_down(tile)) {
      gemms.store(acc, tile, consumer, scratch, state);
      return;
    }
    const int rows = tile.rows - consumer * 64;  // of this slice inside the group
    if (rows <= 0) return;
    // A failed launch (a peer missing: the rows were never placed, the handle may hold anything)
    // stores nothing: no source rank read from a stale handle, no count.
    // (One decision for the warpgroup: the abort flag may be raised while its threads read it,
    // and the barriers below need all 128.)
    const bool failed = dev::Launch::begin(dispatch.comm).failed();
    if (dev::named_barrier_or(1 + consumer, 128, failed)) return;
    const Dims& d = dispatch.d;
    const Workspace& ws = dispatch.ws;
    const int64_t row0 = tile.row + consumer * 64;
    const int col0 = tile.n * kBlockN, hidden = static_cast<int>(d.hidden);
    const int t = threadIdx.x % 128;
    // This thread's part of each packed 64 x 64 chunk: 16-byte piece t % 8 of rows t / 8 + 16 q,
    // whose destinations are the same for every chunk: the source's combine slot of the row.
    __nv_bfloat16* dst[4];
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      const int r = t / 8 + 16 * q;
      dst[q] = nullptr;
      if (r >= rows) continue;
      const int32_t* h = dispatch.handle + (row0 + r) * 3;
      const int32_t src = __ldcg(h), token = __ldcg(h + 1), slot = __ldcg(h + 2);
      if (!handle_ok(src, token, slot)) continue;
      dst[q] = ws.at<__nv_bfloat16>(src, ws.comb_x) +
               (static_cast<int64_t>(token) * d.top_k + slot) * d.hidden;
    }
    gemm_engine::store_slice(
        acc, col0, hidden, consumer, scratch, [](const uint8_t*, int) {},
        [&](const uint8_t* buf, int j) {
          const int c = t % 8, col = col0 + 64 * j + 8 * c;
          if (col >= hidden) return;
#pragma unroll
          for (int q = 0; q < 4; ++q) {
            const int r = t / 8 + 16 * q;
            if (dst[q] == nullptr) continue;
            const uint4 v = *reinterpret_cast<const uint4*>(buf + r * 128 + ((c ^ (r % 8)) * 16));
            *reinterpret_cast<uint4*>(dst[q] + col) = v;
          }
        });
    // Every thread's rows stored (the barrier), then per row: the flag, a system-scope fence
    // (the row's bytes, all threads', before the count) and the count.
    dev::named_barrier_sync(1 + consumer, 128);
    if (t < rows && t < 64) {
      const int32_t* h = dispatch.handle + (row0 + t) * 3;
      const int32_t src = __ldcg(h), token = __ldcg(h + 1), slot = __ldcg(h + 2);
      if (!handle_ok(src, token, slot)) return;
      const uint32_t mark = static_cast<uint32_t>(dev::Launch::begin(dispatch.comm).epoch);
      ws.at<uint32_t>(src, ws.comb_flag)[static_cast<int64_t>(token) * d.top_k + slot] = mark;
      dev::fence_acq_rel_sys();
      atomicAdd_system(reinterpret_cast<unsigned long long*>(counter(src, token, tile.n)), 1ull);
    }
  }

  __device__ void consumer_done(ConsumerState&) const {}

  // This rank's (token, 256-column span) pairs, dealt out over every warp of every CTA once its
  // own work is done (finish): wait until every valid slot of the token has counted in for the
  // span's column blocks, then out[token, span] = sum over the slots that came of w x y, fp32,
  // slot order, rounded once (moe_combine's sum). Each lane sums 8 columns and loads up to 8
  // slots' pieces before the first add: the sums are bound by memory, so the loads in flight
  // set their speed.
  __device__ void combine(int warp, int all_warps, int lane) const {
    constexpr int kSpan = 256, kPerSpan = kSpan / kBlockN, kBatch = 4;
    const Dims& d = dispatch.d;
    const Workspace& ws = dispatch.ws;
    const int k = d.top_k, me = d.rank;
    const int hidden = static_cast<int>(d.hidden);
    const int blocks = (hidden + kBlockN - 1) / kBlockN, spans = (hidden + kSpan - 1) / kSpan;
    const dev::Launch launch = dev::Launch::begin(dispatch.comm);
    const uint32_t mark = static_cast<uint32_t>(launch.epoch);
    const __nv_bfloat16* rows = ws.at<__nv_bfloat16>(me, ws.comb_x);
    const uint32_t* flags = ws.at<uint32_t>(me, ws.comb_flag);
    const int64_t items = d.tokens * spans;
    for (int64_t i = warp; i < items; i += all_warps) {
      const int64_t token = i / spans;
      const int span = static_cast<int>(i % spans);
      bool valid = false;
      float w = 0.f;
      if (lane < k) {
        const int64_t e = dispatch.topk_at(token * k + lane);
        valid = e >= 0 && e < d.experts;
        w = weights[token * k + lane];
      }
      const uint64_t expected = __popc(__ballot_sync(~0u, valid));
      bool ok = true;
      const int block = span * kPerSpan + lane;
      if (lane < kPerSpan && block < blocks && expected > 0) {
        ok = launch.wait_counter(counter(me, token, block), me, expected,
                                 static_cast<uint32_t>(token));
      }
      if (!__all_sync(~0u, ok)) return;  // timed out / aborted: recorded
      __syncwarp();  // the waiting lanes' acquire, before every lane's reads of flags and rows
      const bool present = lane < k && ld_flag(flags + token * k + lane) == mark;
      const unsigned slots = __ballot_sync(~0u, present);
      const int col = span * kSpan + 8 * lane;
      const bool live = col < hidden;
      const __nv_bfloat16* piece = rows + token * k * d.hidden + col;
      float sum[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
      for (int j0 = 0; j0 < k; j0 += kBatch) {  // the same trip count on every lane
        uint4 v[kBatch];
#pragma unroll
        for (int q = 0; q < kBatch; ++q) {
          const int j = j0 + q;
          if (live && j < k && (slots >> j & 1u)) v[q] = dev::load_l2(piece + j * d.hidden);
        }
#pragma unroll
        for (int q = 0; q < kBatch; ++q) {
          const int j = j0 + q;
          const float wj = __shfl_sync(~0u, w, j % 32);
          if (!live || j >= k || (slots >> j & 1u) == 0) continue;
          const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&v[q]);
#pragma unroll
          for (int c = 0; c < 4; ++c) {
            const float2 f = __bfloat1622float2(h[c]);
            sum[2 * c] = __fmaf_rn(wj, f.x, sum[2 * c]);
            sum[2 * c + 1] = __fmaf_rn(wj, f.y, sum[2 * c + 1]);
          }
        }
      }
      if (live) {
        uint4 o;
        __nv_bfloat162* ob = reinterpret_cast<__nv_bfloat162*>(&o);
#pragma unroll
        for (int c = 0; c < 4; ++c) ob[c] = __floats2bfloat162_rn(sum[2 * c], sum[2 * c + 1]);
        *reinterpret_cast<uint4*>(out + token * d.hidden + col) = o;
      }
    }
  }

  __device__ static uint32_t ld_flag(const uint32_t* p) {
    return static_cast<uint32_t>(__ldcg(reinterpret_cast<const int32_t*>(p)));
  }

  __device__ void side_task(int thread, int threads) const { dispatch.side_task(thread, threads); }
  // The consumers copy the sends first, as moe_dispatch_gemm's
  // (MoeDispatchGemm::consumer_prologue).
  __device__ void consumer_prologue(int thread, int threads) const {
    dispatch.consumer_prologue(thread, threads);
  }

  // Every thread of every CTA, last: the combine's sums once the CTA's own tiles are done (the
  // barrier: the sums' timed waits then span only other CTAs' last tiles, not the whole GEMM
  // phase - and few sums could start earlier anyway), then the launch's end.
  __device__ void finish() const {
    __syncthreads();
    const int warps = static_cast<int>(blockDim.x) / 32;
    if (threadIdx.x == 128)
      fused::trace_mark(dispatch.trace, fused::kTraceConsumer0, fused::kTraceDone);
    combine(static_cast<int>(blockIdx.x) * warps + static_cast<int>(threadIdx.x) / 32,
            static_cast<int>(gridDim.x) * warps, static_cast<int>(threadIdx.x) % 32);
    if (threadIdx.x == 128)
      fused::trace_mark(dispatch.trace, fused::kTraceConsumer0, fused::kTraceSummed);
    dispatch.finish();
  }
};
static_assert(gemm_engine::check_fusion<gemm_engine::TileConfig<128>, MoeLayerFused<128>>());
static_assert(gemm_engine::check_fusion<gemm_engine::TileConfig<256>, MoeLayerFused<256>>());

}  // namespace mk::moe
