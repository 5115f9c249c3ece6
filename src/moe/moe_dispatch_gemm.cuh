// moe_dispatch_gemm: routed tokens land and are multiplied in one launch (mkernel/moe.h).
//
// Per rank and call, on its stream (after the route kernels of moe_kernels.cuh, which here also
// list this rank's own (token, slot) pairs in its layout's order, by_local):
//   notify_kernel   one CTA: entry barrier; this rank's counts to every destination; every
//                   source's counts -> the receive side's layout (LayoutTables: expert starts,
//                   source prefixes, rows per source) and the grouped GEMM's scheduler tables
//                   (row_start, row_count, tile_prefix, the tile counter zeroed); the block
//                   arrival counters zeroed
//   the fused launch: the GEMM engine with MoeDispatchGemm, one CTA per SM:
//     side warps (the producer warpgroup's three spare warps):
//       1. send    channel c's share of the rows for each other rank, in chunks of kChunkRows,
//                  and for each row where its (token, slot) pairs come in that rank's layout
//                  order (recv_order) - copied by the consumers (below); side thread 0
//                  signals kOp + c with step = chunks so far once every consumer warp has
//                  counted the chunk copied
//       2. wait    until every other rank's channels have signalled all their chunks
//       3. place   every row bound here in layout order - this rank's own in x (by_local),
//                  received ones in their staging (recv_order) - in units of kChunkRows taken
//                  by the CTAs in turn: the first experts' blocks fill first, whatever the
//                  world size (a block's rows come from several sources); a warp's rows of a
//                  unit looked up side by side (a lane each). Placing a row is writing its
//                  handle and where it is (row_src: x's token, or the staging row), and - only
//                  when the caller asked for recv_x - copying it there, one by one; one fence
//                  before their counts (no L2 prefetch ahead of the copy: it ran 6% slower
//                  with one - docs/design/moe.md)
//       4. the handle's unused rows set to -1 (done between 1 and 2: notify's tables are all
//          it needs)
//       every placed row counts itself into its 128-row block's arrival counter
//     producer (gather_a: the warpgroup's four warps - the side warps once steps 1-4 are done):
//               before a tile's first load warp 0's lane 0 waits until its block counter
//               reaches the tile's rows and hands the tile to the other warps through the tile
//               ring; then each thread looks up row_src for its rows of the tile and copies their
//               pieces straight from x or the staging into the stages (cp.async), while lane 0
//               loads the weights' boxes (TMA); a CTA's tiles after its first come from a counter
//               (the engine's dynamic tiles: the tiles running side by side stay neighbours,
//               whenever each CTA's rows came in)
//     consumers: first the sends' copies (the engine's consumer_prologue: until the walk
//               places the first tile's rows, which needs every peer's rows, they would only
//               wait), then the grouped GEMM's tiles (y in the dispatch layout)
//   No row is copied into a layout buffer for the GEMM: a row bound for several of this rank's
//   experts is read from where it is by each of their tiles.
//
//   block of a layout row:  padded - row / 128 (experts start on multiples of 128);
//                           masked - e x ceil(capacity / 128) + (row - e x capacity) / 128
//
// Reuse: the notify kernel's entry barrier orders everything: a rank that entered this call's
// notify launch has finished its last fused launch (which read its receive region) and its last
// notify (which read its count words).
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "fused/trace.cuh"
#include "gemm/gemm_kernel.cuh"
#include "gemm/grouped_gemm.cuh"
#include "moe/moe_kernels.cuh"
#include "moe/moe_walk.h"

namespace mk::moe {

constexpr int kChunkRows = 16;  // rows per signalled chunk (remote) or unit (local)
static_assert(kChunkRows <= 32, "a warp's rows of a unit: one lane each");

// One CTA of kThreads: the layout of this rank's receive side (moe_plan.h, LayoutTables).
__global__ void __launch_bounds__(kThreads, 1)
    notify_kernel(DeviceComm comm, Dims d, Workspace ws, int tiles_n, int32_t* expert_rows) {
  const dev::Launch launch = dev::Launch::begin(comm);
  if (!launch.channel_barrier_agreeing(SignalId::kEntry, 0, d.signature)) {
    launch.end();
    return;
  }
  const int el_n = d.experts_local, words = el_n + 1;
  const int32_t* totals = ws.at<int32_t>(d.me, ws.totals);
  for (int w = threadIdx.x; w < d.world * words; w += kThreads) {
    const int dst = w / words, i = w % words;
    const int32_t n = i < el_n ? totals[dst * el_n + i] : totals[d.experts + dst];
    launch.signal(dst, count_signal(i), static_cast<uint32_t>(n));
  }
  extern __shared__ int32_t s_cnt[];  // [world][words], then [E_local] rows that fit
  int32_t* s_fit = s_cnt + d.world * words;
  if (__syncthreads_and(gather_counts(launch, comm, d, words, s_cnt)) == 0) {
    launch.end();
    return;
  }
  const LayoutTables lt = layout_tables(d.world, el_n);
  int32_t* tables = ws.at<int32_t>(d.me, ws.layout);
  int32_t* start = tables + lt.start;
  // from: each source's prefix over this rank's experts; sent: this rank's over each
  // destination's (the same numbers that rank's `from` gets for this one). Scanned in s_fit,
  // free until below.
  for (int r = 0; r < d.world; ++r) {
    for (int which = 0; which < 2; ++which) {
      for (int e = threadIdx.x; e < el_n; e += kThreads) {
        s_fit[e] = which == 0 ? s_cnt[r * words + e] : totals[r * el_n + e];
      }
      const int64_t all = block_exclusive_scan<kThreads>(s_fit, el_n);
      int32_t* out = tables + (which == 0 ? lt.from : lt.sent) + r * (el_n + 1);
      for (int e = threadIdx.x; e < el_n; e += kThreads) out[e] = s_fit[e];
      if (threadIdx.x == 0) out[el_n] = static_cast<int32_t>(all);
      __syncthreads();  // s_fit read before it is written again
    }
  }
  for (int e = threadIdx.x; e < el_n; e += kThreads) {
    int32_t sum = 0;
    for (int src = 0; src < d.world; ++src) {
      const int32_t n = s_cnt[src * words + e];
      tables[lt.pre + src * el_n + e] = sum;
      sum += n;
    }
    expert_rows[e] = sum;
    s_fit[e] = sum;  // the total for now; the rows that fit below
    start[e] = d.masked ? 0 : (sum + kRowBlock - 1) / kRowBlock * kRowBlock;
  }
  for (int src = threadIdx.x; src < d.world; src += kThreads) {
    tables[lt.recv + src] = s_cnt[src * words + el_n];
  }
  __syncthreads();
  if (d.masked) {
    for (int e = threadIdx.x; e <= el_n; e += kThreads) {
      start[e] = static_cast<int32_t>(min64(e * d.capacity, INT32_MAX));
    }
  } else {
    // start[] is in global memory: scan a shared copy (s_cnt is free by now).
    for (int e = threadIdx.x; e < el_n; e += kThreads) s_cnt[e] = start[e];
    __syncthreads();
    const int64_t end = block_exclusive_scan<kThreads>(s_cnt, el_n);
    for (int e = threadIdx.x; e < el_n; e += kThreads) start[e] = s_cnt[e];
    if (threadIdx.x == 0) start[el_n] = static_cast<int32_t>(min64(end, INT32_MAX));
  }
  __syncthreads();
  // before: the rows bound here (fitting or not) for the experts before each one - the index of
  // the side warps' walk in layout order. (s_fit still holds the totals; s_cnt is free.)
  for (int e = threadIdx.x; e < el_n; e += kThreads) s_cnt[e] = s_fit[e];
  const int64_t bound = block_exclusive_scan<kThreads>(s_cnt, el_n);
  for (int e = threadIdx.x; e < el_n; e += kThreads) tables[lt.before + e] = s_cnt[e];
  if (threadIdx.x == 0) tables[lt.before + el_n] = static_cast<int32_t>(min64(bound, INT32_MAX));
  __syncthreads();
  for (int e = threadIdx.x; e < el_n; e += kThreads) {
    const int64_t held = d.masked ? d.capacity : max64(0, d.capacity - start[e]);
    const int32_t total = s_fit[e];
    if (total > held) {
      dev::record_data_error(comm, launch.epoch, DeviceErrorCode::kCapacity, e, 0,
                             static_cast<uint64_t>(held), static_cast<uint64_t>(total));
    }
    s_fit[e] = static_cast<int32_t>(min64(total, held));
    tables[lt.row_start + e] = start[e];
    tables[lt.row_count + e] = s_fit[e];
  }
  __syncthreads();
  // The grouped GEMM's tiles: ceil(rows that fit / 128) x tiles_n per expert, in expert order.
  for (int e = threadIdx.x; e < el_n; e += kThreads) {
    s_cnt[e] = (s_fit[e] + kRowBlock - 1) / kRowBlock * tiles_n;
  }
  __syncthreads();
  const int64_t tiles = block_exclusive_scan<kThreads>(s_cnt, el_n);
  for (int e = threadIdx.x; e < el_n; e += kThreads) tables[lt.tile_prefix + e] = s_cnt[e];
  if (threadIdx.x == 0) {
    tables[lt.tile_prefix + el_n] = static_cast<int32_t>(tiles);
    tables[lt.tile_prefix + el_n + 1] = 0;  // the fused launch's tile counter (dynamic tiles)
  }
  // The arrival counters start from zero (the last fused launch is over: stream order).
  uint64_t* counters = ws.at<uint64_t>(d.me, ws.counters);
  const int64_t blocks =
      d.masked ? d.blocks_per_expert * el_n : (d.rows + kRowBlock - 1) / kRowBlock;
  for (int64_t b = threadIdx.x; b < blocks; b += kThreads) counters[b] = 0;
  launch.end();
}

// One warp copies a row of n16 16-byte words, kInFlight per lane, read through L2 (src may have
// been written during the kernel). The side warps run on the producer warpgroup's few
// registers: 32-bit indices, four vectors in flight (eight spilled).
template <int kInFlight = 4>
__device__ __forceinline__ void copy_row_warp(const int4* src, int4* dst, int n16, int lane) {
  auto load_fresh = [](const int4* p) {
    const uint4 v = dev::load_l2(p);
    return make_int4(static_cast<int>(v.x), static_cast<int>(v.y), static_cast<int>(v.z),
                     static_cast<int>(v.w));
  };
  int i = lane;
  for (; i + 32 * (kInFlight - 1) < n16; i += 32 * kInFlight) {
    int4 v[kInFlight];
#pragma unroll
    for (int u = 0; u < kInFlight; ++u) v[u] = load_fresh(src + i + 32 * u);
#pragma unroll
    for (int u = 0; u < kInFlight; ++u) dst[i + 32 * u] = v[u];
  }
  for (; i < n16; i += 32) dst[i] = load_fresh(src + i);
}

// One warp copies a row of n16 16-byte words with kInFlight per lane, every word of a round in
// flight at once (the tail too): the consumers' copies, on registers to spare.
template <int kInFlight>
__device__ __forceinline__ void copy_row_wide(const int4* src, int4* dst, int n16, int lane) {
  for (int base = lane; base < n16; base += 32 * kInFlight) {
    int4 v[kInFlight];
#pragma unroll
    for (int u = 0; u < kInFlight; ++u) {
      if (base + 32 * u < n16) v[u] = __ldg(src + base + 32 * u);
    }
#pragma unroll
    for (int u = 0; u < kInFlight; ++u) {
      if (base + 32 * u < n16) dst[base + 32 * u] = v[u];
    }
  }
}

template <int kBlockN>
struct MoeDispatchGemm {
  // The side warps keep the layout's bookkeeping (and copy rows, when the caller asked for
  // recv_x); the walk copies each row with kWalkInFlight vectors a lane in flight, as many as
  // their registers allow: below 256-wide tiles the consumers (96 accumulators at most) give 16
  // registers a thread to the producer warpgroup, and the walk keeps twice the vectors in flight;
  // 256-wide tiles' consumers need 208 for their 128 accumulators, which leaves the side warps 88
  // (72 spilled) and four vectors. The producer warpgroup's four warps gather the tiles' A rows
  // (gather_a; the side warps after their side task) on the same registers.
  static constexpr bool kWideTile = kBlockN >= 256;
  static constexpr int kWalkInFlight = kWideTile ? 4 : 8;
  static constexpr gemm_engine::FusionTraits kTraits{.init_shared = true,
                                                     .batched_b = true,
                                                     .dynamic_tiles = true,
                                                     .consumer_prologue = true,
                                                     .gather_a = true,
                                                     .producer_regs = kWideTile ? 88 : 120,
                                                     .consumer_regs = kWideTile ? 208 : 192};
  static constexpr int kSideBarrier = 3;  // named barrier of the 96 side threads
  // The sends (consumer_prologue): the consumers copy, up to 8 KB of a row in flight a warp.
  static constexpr int kSendInFlight = 16;

  gemm_engine::GroupedGemm<kBlockN> grouped;  // C = y, the layout's tables (its A unused)
  DeviceComm comm;
  Dims d;
  Workspace ws;
  const void* topk;  // [T, k] int32 or int64 (topk_int64)
  bool topk_int64;
  const __nv_bfloat16* x;     // [T, H]
  __nv_bfloat16* recv;        // [rows, H]: the layout's rows, copied there - or null: not asked
                              // for (moe_layer: its gate / up tiles' A)
  int32_t* row_src;           // [rows]: where each placed row is (source_code), or null (the
                              // GEMM does not gather: moe_layer)
  int32_t* handle;            // [rows][3]
  int drop_blocks = 0;        // moe_layer: column blocks a dropped row counts in at its source
  int drop_stride = 0;        // (its combine counters per token; 0 blocks: moe_dispatch_gemm)
  uint64_t* trace = nullptr;  // timeline records (fused/trace.cuh), or null

  struct ConsumerState {};

  __device__ int num_tiles() const { return grouped.num_tiles(); }
  __device__ gemm_engine::Tile tile(int t) const { return grouped.tile(t); }
  __device__ int* tile_counter() const { return grouped.tile_counter(); }

  __device__ int64_t block_of(int e, int64_t row) const {
    return d.masked ? e * d.blocks_per_expert + (row - e * d.capacity) / kRowBlock
                    : row / kRowBlock;
  }

  // The tile's rows have all been placed.
  __device__ void wait_operands(const gemm_engine::Tile& tile) const {
    if (tile.rows <= 0) return;
    fused::trace_mark(trace, fused::kTraceProducer, fused::kTraceOperandsWait, tile.shard);
    const int64_t b = block_of(tile.shard, tile.row);
    const dev::Launch launch = dev::Launch::begin(comm);
    const uint64_t* counter = ws.at<uint64_t>(d.me, ws.counters) + b;
    launch.wait_local(counter, static_cast<uint64_t>(tile.rows), static_cast<uint32_t>(b));
    dev::fence_proxy_async_global();
    fused::trace_mark(trace, fused::kTraceProducer, fused::kTraceOperandsIn, tile.shard);
  }

  __device__ void init_shared() const {
    fused::trace_init();
    for (int w = 0; w < kMaxSendWarps; ++w) chunks_copied()[w] = 0;
    // Whether the launches before this one failed (notify's entry barrier met a peer with another
    // signature, or timed out): then the side warps do nothing and the consumers copy no sends -
    // no row goes to a peer, whose offsets may not be this rank's - and the tiles' waits give up
    // at once. Read once, by thread 0, so that every side thread and every consumer takes the
    // same path (a failure during this launch may raise the abort between two threads' reads).
    sends_off() = dev::Launch::begin(comm).failed();
  }
  __device__ static bool& sends_off() {
    __shared__ bool off;
    return off;
  }

  // The sends' hand-over (consumer_prologue, signal_sends): each consumer warp counts the chunks
  // it has copied in a word of its own, and side thread 0 signals the CTA's j-th chunk once every
  // warp's count has reached j. A word a warp, not one running total: the warps do not wait for
  // each other, so a total could reach j x warps while a slow warp still copies chunk j (the
  // others already counting later chunks). Counts, not a named barrier: bar.sync wants every
  // participant at the same instruction, which two roles' code is not (compute-sanitizer's
  // synccheck reported divergent threads at such a barrier), and only thread 0 of the side warps
  // has anything to wait for.
  static constexpr int kMaxSendWarps = 12;  // consumer warps: up to three warpgroups
  // The counts, a word per consumer warp.
  __device__ static uint32_t* chunks_copied() {
    __shared__ uint32_t count[kMaxSendWarps];
    return count;
  }

  // Where row r of the tile starts: its row_src entry (placed: the tile's block counter, which
  // lane 0 of the producer acquired), decoded. The row and its entry are checked against the
  // layout, x's tokens and the staging's rows, so that a launch whose notify or placement failed
  // (a peer missing: stale tables and entries) copies from inside them, not from anywhere.
  __device__ const __nv_bfloat16* a_row(const gemm_engine::Tile& tile, int r) const {
    const int64_t row = static_cast<int64_t>(tile.row) + r;
    if (r >= tile.rows || row < 0 || row >= d.rows) return nullptr;
    const int v = __ldcg(row_src + row);
    if (v < 0) {
      const int64_t token = -1 - static_cast<int64_t>(v);
      return token < d.tokens ? x + token * d.hidden : nullptr;
    }
    return v < d.world * d.max_tokens
               ? ws.at<__nv_bfloat16>(d.rank, ws.recv_x) + static_cast<int64_t>(v) * d.hidden
               : nullptr;
  }

  template <int kRegs>
  __device__ void store(const float (&acc)[kRegs], const gemm_engine::Tile& tile, int consumer,
                        uint8_t* scratch, ConsumerState&) const {
    const bool leader = threadIdx.x % 128 == 0;
    if (leader)
      fused::trace_mark(trace, fused::kTraceConsumer0 + consumer, fused::kTraceStoreBegin);
    typename gemm_engine::GroupedGemm<kBlockN>::ConsumerState state{};
    grouped
        .template store<gemm_engine::FusionTileConfig<kBlockN, MoeDispatchGemm>::kEpilogueBuffers>(
            acc, tile, consumer, scratch, state);
    if (leader) fused::trace_mark(trace, fused::kTraceConsumer0 + consumer, fused::kTraceStoreEnd);
  }

  __device__ void consumer_done(ConsumerState&) const {}
  // Every thread of every CTA, last: the launch's end (the last CTA bumps the epoch).
  __device__ void finish() const { dev::Launch::begin(comm).end(); }

  __device__ int64_t topk_at(int64_t p) const {
    return topk_int64 ? static_cast<const int64_t*>(topk)[p] : static_cast<const int32_t*>(topk)[p];
  }

  // A row past its expert's room (the capacity error, which notify recorded): moe_layer counts
  // it as done at its source in every column block, so that the sums there do not wait for it
  // (they leave it out: its flag is not set). One lane calls.
  __device__ void dropped(int src, int token) const {
    unsigned long long* count = reinterpret_cast<unsigned long long*>(
        ws.at<uint64_t>(src, ws.comb_count) + static_cast<int64_t>(token) * drop_stride);
    for (int b = 0; b < drop_blocks; ++b) atomicAdd_system(count + b, 1ull);
  }

  // Where row `at` of local expert e comes from: its source rank, token and top-k slot, and its
  // send slot in that source's staging region (-1: this rank's own token, read from x). A
  // received row's order entry and metadata are read through L2 (written during the launch).
  struct RowSource {
    int src, token, slot, staged;
  };
  __device__ RowSource source_of(const int32_t* tables, const LayoutTables& lt, int e,
                                 int at) const {
    const int el_n = d.experts_local, k = d.top_k;
    const WalkSource w = walk_source(tables, lt, d.world, el_n, e, at);
    const int src = w.src, i = w.index;
    if (src == d.rank) {
      const int p = ws.at<int32_t>(d.rank, ws.by_local)[i];
      return {src, p / k, p % k, -1};
    }
    const int64_t region = static_cast<int64_t>(src) * d.max_tokens;
    const int v = __ldcg(ws.at<int32_t>(d.rank, ws.recv_order) + region * k + i);
    const int staged = v / k;
    return {src, __ldcg(ws.at<int32_t>(d.rank, ws.recv_meta) + (region + staged) * d.meta_ints),
            v % k, staged};
  }

  // row_src's entry for the row `from` names: -1 - token for this rank's token in x, else its
  // index in the staging ([world][max_tokens] rows, below 2^31: moe_plan checks).
  __device__ static int source_code(const RowSource& from, int64_t max_tokens) {
    return from.staged < 0 ? -1 - from.token
                           : static_cast<int>(from.src * max_tokens + from.staged);
  }

  // The row `from` names: this rank's token in x, or a received row in its source's staging.
  __device__ const int4* source_row(const RowSource& from) const {
    const int64_t n16 = d.hidden / 8;
    return from.staged < 0
               ? reinterpret_cast<const int4*>(x) + from.token * n16
               : reinterpret_cast<const int4*>(ws.at<__nv_bfloat16>(d.rank, ws.recv_x)) +
                     (static_cast<int64_t>(from.src) * d.max_tokens + from.staged) * n16;
  }

  // Rows [first, last) of the layout's unused tail of expert e's region: handle -1.
  __device__ void unused_rows(int64_t first, int64_t last, int thread, int threads) const {
    for (int64_t r = first + thread; r < last; r += threads) {
      handle[r * 3] = handle[r * 3 + 1] = handle[r * 3 + 2] = -1;
    }
  }

  // 1. Channel c's share of the rows for each other rank, chunk by chunk. The consumers copy
  //    them (consumer_prologue: they would only wait for the first tile's rows, which the walk
  //    places after every peer's rows have landed, and they have the registers for 8 KB of a row
  //    in flight a warp - the side warps keep four or eight vectors a lane); side thread 0 signals
  //    each chunk once every consumer warp has counted it copied (signal_sends).
  __device__ void send_share(int dst, int64_t& lo, int64_t& hi) const {
    share(ws.at<int32_t>(d.rank, ws.totals)[d.experts + dst], blockIdx.x, gridDim.x, lo, hi);
  }

  // The consumers, before their first tile (`thread` of `threads`).
  __device__ void consumer_prologue(int thread, int threads) const {
    const int el_n = d.experts_local, k = d.top_k, me = d.rank;
    const int n16 = static_cast<int>(d.hidden / 8);
    const LayoutTables lt = layout_tables(d.world, el_n);
    const int32_t* tables = ws.at<int32_t>(me, ws.layout);
    const int32_t* pos = ws.at<int32_t>(me, ws.pos);
    const int4* x16 = reinterpret_cast<const int4*>(x);
    const int warp = thread / 32, lane = thread % 32, warps = threads / 32;
    // (None after a failed notify: init_shared; the side warps stop there too.)
    for (int i = 1; i < (sends_off() ? 1 : d.world); ++i) {
      const int dst = (me + i) % d.world;
      int64_t lo, hi;
      send_share(dst, lo, hi);
      const int64_t region = static_cast<int64_t>(me) * d.max_tokens;
      int4* rx = reinterpret_cast<int4*>(ws.at<__nv_bfloat16>(dst, ws.recv_x)) + region * n16;
      int32_t* meta = ws.at<int32_t>(dst, ws.recv_meta) + region * d.meta_ints;
      int32_t* order = ws.at<int32_t>(dst, ws.recv_order) + region * k;
      const int32_t* sent = tables + lt.sent + dst * (el_n + 1);
      const int32_t* list =
          ws.at<int32_t>(me, ws.send_list) + static_cast<int64_t>(dst) * d.max_tokens;
      for (int first = static_cast<int>(lo); first < hi; first += kChunkRows) {
        const int last = min(static_cast<int>(hi), first + kChunkRows);
        for (int slot = first + warp; slot < last; slot += warps) {
          const int t = list[slot];
          copy_row_wide<kSendInFlight>(x16 + static_cast<int64_t>(t) * n16,
                                       rx + static_cast<int64_t>(slot) * n16, n16, lane);
          if (lane == 0) meta[static_cast<int64_t>(slot) * d.meta_ints] = t;
          if (lane < k) {  // where each of its rows there comes in the receiver's layout order
            const int64_t e = topk_at(static_cast<int64_t>(t) * k + lane);
            if (e >= 0 && e < d.experts && static_cast<int>(e / el_n) == dst) {
              order[sent[e % el_n] + pos[static_cast<int64_t>(t) * k + lane]] = slot * k + lane;
            }
          }
        }
        __syncwarp();  // the lanes' stores before lane 0's release
        if (lane == 0) dev::red_add_release_cta(&chunks_copied()[warp], 1);
      }
    }
  }

  // Side thread 0: each chunk's signal, once each of the `warps` consumer warps has copied it.
  __device__ void signal_sends(int warps) const {
    if (warps > kMaxSendWarps) __trap();  // (a launch shape the counts have no words for)
    uint32_t copied = 0;
    for (int i = 1; i < d.world; ++i) {
      const int dst = (d.rank + i) % d.world;
      int64_t lo, hi;
      send_share(dst, lo, hi);
      uint32_t chunk = 0;
      for (int64_t first = lo; first < hi; first += kChunkRows) {
        ++copied;
        for (int w = 0; w < warps; ++w) {
          while (dev::ld_acquire_cta(&chunks_copied()[w]) < copied) {
          }
        }
        dev::fence_acq_rel_sys();  // the consumers' stores (acquired above) before the signal
        dev::Launch::begin(comm).signal(dst, dev::signal_index(SignalId::kOp, blockIdx.x), ++chunk);
      }
      fused::trace_mark(trace, fused::kTraceSide, fused::kTraceSent, dst);
    }
  }

  // The side warps' four steps (the header). Indices are 32-bit (rows and tokens below 2^31):
  // these warps run on the producer warpgroup's few registers.
  __device__ void side_task(int thread, int threads) const {
    const int warp = thread / 32, lane = thread % 32, warps = threads / 32;
    const int c = blockIdx.x, channels = gridDim.x;
    const int el_n = d.experts_local, me = d.rank;
    const int n16 = static_cast<int>(d.hidden / 8);
    const LayoutTables lt = layout_tables(d.world, el_n);
    const int32_t* tables = ws.at<int32_t>(me, ws.layout);
    if (thread == 0) fused::trace_mark(trace, fused::kTraceSide, fused::kTraceSideStart);
    // After a failed notify (init_shared) nothing at all: no signals, and no walk - the layout
    // tables are the last call's, which this call's x and by_local do not match. (Every side
    // thread reads the same flag: no barrier below is met by some of them only.)
    if (sends_off()) return;

    // 1. The sends (the consumers copy, thread 0 signals; the other side threads go on).
    if (thread == 0) signal_sends((static_cast<int>(blockDim.x) - 128) / 32);

    // 4. The handle's rows that no (source, token, slot) lands in - done here, before the wait
    //    for the peers' rows: it needs only notify's tables, and with a gathered A the side
    //    warps' task is what this CTA's first stages wait for (they gather once it is done).
    for (int e = c; e < el_n; e += channels) {
      const int64_t start = tables[lt.start + e];
      const int64_t end =
          d.masked ? start + d.capacity : min64(d.capacity, tables[lt.start + e + 1]);
      unused_rows(start + tables[lt.row_count + e], end, thread, threads);
    }
    if (!d.masked) {
      int64_t lo, hi;
      const int64_t used = min64(d.capacity, tables[lt.start + el_n]);
      share(d.capacity - used, c, channels, lo, hi);
      unused_rows(used + lo, used + hi, thread, threads);
    }

    // 2. Every other rank's rows have landed (all its channels' chunks): the walk below takes
    //    them in layout order, not in the order they were sent.
    bool failed = false;
    for (int i = thread; i < (d.world - 1) * channels; i += threads) {
      const int src = (me + 1 + i / channels) % d.world, part = i % channels;
      int64_t lo, hi;
      share(tables[lt.recv + src], part, channels, lo, hi);
      const auto chunks = static_cast<uint32_t>((hi - lo + kChunkRows - 1) / kChunkRows);
      if (chunks > 0 && !failed) {
        failed =
            !dev::Launch::begin(comm).wait(src, dev::signal_index(SignalId::kOp, part), chunks);
      }
    }
    if (dev::named_barrier_or(kSideBarrier, threads, failed)) return;
    if (thread == 0) fused::trace_mark(trace, fused::kTraceSide, fused::kTraceLanded);

    // 3. Every row bound here, local or received, in layout order, in units of kChunkRows taken
    //    by the CTAs in turn: the first experts' blocks fill first, as the tiles want them. A row
    //    past its expert's room (the capacity error notify recorded) is not placed: moe_layer
    //    counts it done at its source.
    //    A warp takes its rows of a unit (q = unit + warp + j * warps) together: lane j looks
    //    row j up (expert, layout row, source) and writes its handle and row_src entry; if the
    //    rows are copied (recv), the warp copies them one by one (both kinds through L2: a staged
    //    row may have landed during the launch; x's rows as well, one copy loop); then after one
    //    fence the lanes count their rows into their blocks (one add per block and warp).
    //    A unit is kChunkRows rows when they are copied (a tile's rows, copied by several CTAs at
    //    once, are in sooner) and a row for every side lane when not (only look-ups: 16-row
    //    units left 27 of a warp's 32 lanes idle, and a CTA walked 6x as many units, each a
    //    chain of dependent loads and a fence - 90 us at 65536 rows, during which the tiles
    //    waited for these warps to gather).
    const int32_t* before = tables + lt.before;
    const int bound = before[el_n];
    int4* recv16 = reinterpret_cast<int4*>(recv);
    auto* counters = reinterpret_cast<unsigned long long*>(ws.at<uint64_t>(me, ws.counters));
    const int unit_rows = recv != nullptr ? kChunkRows : 32 * warps;
    for (int unit = c * unit_rows; unit < bound; unit += channels * unit_rows) {
      const int end = min(bound, unit + unit_rows);
      const int q = unit + warp + lane * warps,
                rows = max(0, end - unit - warp + warps - 1) / warps;
      int e = -1, row = 0;  // e < 0: no row to place on this lane
      const int4* from_row = nullptr;
      if (lane < rows) {  // (q < end, without q's overflow near 2^31 on the idle lanes)
        const int found = walk_expert(before, el_n, q), at = q - before[found];
        const RowSource from = source_of(tables, lt, found, at);
        if (at < tables[lt.row_count + found]) {
          e = found;
          row = tables[lt.start + e] + at;
          from_row = source_row(from);
          int32_t* h = handle + static_cast<int64_t>(row) * 3;
          h[0] = from.src;
          h[1] = from.token;
          h[2] = from.slot;
          if (row_src != nullptr) row_src[row] = source_code(from, d.max_tokens);
        } else {
          dropped(from.src, from.token);
        }
      }
      for (int j = 0; recv != nullptr && j < rows; ++j) {
        const auto* s = reinterpret_cast<const int4*>(
            __shfl_sync(~0u, reinterpret_cast<unsigned long long>(from_row), j));
        const int r = __shfl_sync(~0u, row, j);
        if (s != nullptr) {
          copy_row_warp<kWalkInFlight>(s, recv16 + static_cast<int64_t>(r) * n16, n16, lane);
        }
      }
      __syncwarp();     // every lane's stores of every row, then
      __threadfence();  // before the counts
      const int64_t block = e >= 0 ? block_of(e, row) : -1;
      const unsigned same = __match_any_sync(~0u, block);
      if (e >= 0 && lane == __ffs(same) - 1) {
        atomicAdd(counters + block, static_cast<unsigned long long>(__popc(same)));
      }
    }
    if (thread == 0) fused::trace_mark(trace, fused::kTraceSide, fused::kTracePlaced);

    if (thread == 0) fused::trace_mark(trace, fused::kTraceSide, fused::kTraceSideEnd);
  }
};
static_assert(gemm_engine::check_fusion_widths<MoeDispatchGemm>());

}  // namespace mk::moe
