// The MoE dispatch and combine kernels (mkernel/moe.h, docs/design/moe.md).
//
// Per rank and call, on its stream:
//   route_count_kernel   chunk c of the tokens: rows per expert and per destination rank (local)
//   route_scan_kernel    chunk c: prefixes over the earlier chunks, then one warp walks the chunk
//                        in (token, slot) order with __match_any_sync: each pair's position in
//                        its (this rank, expert) stream, each (token, destination) pair's slot in
//                        the send order; the last chunk writes the totals (local; no atomics on
//                        positions, so the layout is a pure function of topk_idx)
//   dispatch_kernel      persistent, one CTA per channel:
//      entry barrier
//      counts   -> every destination's signal pad: rows for each of its local experts, rows sent
//      send     -> channel c's share of the rows for each destination: x[t] once per (token,
//                  destination) into the destination's receive region [src][slot], with its
//                  metadata (token; per slot, local expert and position); then signal kOp + c
//      place    <- every source's counts: the layout (expert starts, source prefixes); channel c
//                  of every source: its rows copied to their expert-major rows, once per local
//                  expert of the token, with the handle; unused rows' handle set to -1
//   combine_kernel       persistent, one CTA per channel:
//      entry barrier
//      send     -> each row of y with a handle goes to its source rank's [token][slot] with a
//                  presence flag (the launch's epoch); then signal kOp + c to every rank
//      reduce   <- every rank's every channel: per token, the present slots in slot order,
//                  w * y summed in fp32, rounded once
// The entry barriers: a rank writes into a peer's receive region, count words or combine buffer
// only once the peer is in the same launch - so done with the last one, and with whatever came
// before it on its stream (the workspace's first zeroing, say).
#pragma once

#include <cuda_bf16.h>

#include <cstdint>
#include <cub/block/block_scan.cuh>

#include "mkernel/device/launch.cuh"
#include "mkernel/device_comm.h"
#include "mkernel/moe.h"
#include "moe/moe_plan.h"

namespace mk::moe {

constexpr int kThreads = 512;  // dispatch / combine CTAs: 16 warps, one row each at a time
constexpr int kWarps = kThreads / 32;
constexpr int kRouteThreads = 256;
constexpr int kRowBlock = 128;  // padded layout: experts start on multiples (MoeProblem)
// Signal pad slots (SignalId::kOp + ...): kOp + channel for "channel's rows landed", and from
// kCountSignals the counts: word (kCountSignals + e, src) = rows src routed to local expert e,
// (kCountSignals + E_local, src) = rows src sent (values signal_value(epoch, count)).
constexpr uint32_t kCountSignals = kMaxChannels;
static_assert(kCountSignals + kMoeMaxExperts + 1 <= kMaxOpSignals, "count signals past kOp's");
static_assert(kMoeMaxTopK <= 32, "a warp holds a token's slots, a lane each");
static_assert(kRowBlock == kMoeRowBlock);

__device__ __forceinline__ int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }
__device__ __forceinline__ int64_t max64(int64_t a, int64_t b) { return a < b ? b : a; }

__device__ __forceinline__ uint32_t count_signal(int i) {
  return dev::signal_index(SignalId::kOp, static_cast<int>(kCountSignals) + i);
}

// Sizes of one call, the same on every rank but `tokens`.
struct Dims {
  int world;
  int rank;
  int experts;        // E
  int experts_local;  // E_local
  int top_k;
  int meta_ints;  // per received row: token, then (local expert, position) per slot
  int64_t tokens;
  int64_t max_tokens;
  int64_t hidden;
  int64_t chunk_tokens;  // tokens per route chunk
  int64_t rows;          // rows of the layout
  int64_t capacity;      // padded: the room (== rows); masked: rows per local expert
  bool masked;
  bool local_list;            // route_scan_kernel also lists this rank's own pairs (by_local)
  int64_t blocks_per_expert;  // masked: arrival counters per local expert; padded: 0 (by row)
};

// The workspace, from its base on each rank (byte offsets; moe.cu lays it out).
struct Workspace {
  uint8_t* const* peers;  // device [world]: each rank's symmetric buffer holding the workspace
  uint64_t offset;        // the workspace's offset in it (the same on every rank)
  uint64_t recv_meta;     // int32 [world][max_tokens][meta_ints]  (receiver)
  uint64_t recv_x;        // bf16 [world][max_tokens][hidden]       (receiver)
  uint64_t comb_x;        // bf16 [max_tokens][top_k][hidden]       (combine, at the source)
  uint64_t comb_flag;     // uint32 [max_tokens][top_k]             (combine: the epoch it came in)
  uint64_t chunk_cnt;     // int32 [chunks][experts]                (local)
  uint64_t chunk_dcnt;    // int32 [chunks][world]                  (local)
  uint64_t pos;           // int32 [max_tokens][top_k]              (local)
  uint64_t send_list;     // int32 [world][max_tokens]              (local)
  uint64_t totals;        // int32 [experts + world]                (local)
  uint64_t by_local;      // int32 [max_tokens * top_k]              (local; moe_dispatch_gemm)
  uint64_t layout;        // int32 LayoutTables                      (local; moe_dispatch_gemm)
  uint64_t counters;      // uint64 [blocks]                         (local; moe_dispatch_gemm)
  uint64_t comb_count;    // uint64 [max_tokens][ceil(hidden / 128)] (at the source; moe_layer)

  template <class T>
  __device__ T* at(int rank, uint64_t field) const {
    return reinterpret_cast<T*>(peers[rank] + offset + field);
  }
};

// Every source's counts for this rank (words per source: E_local experts, then its row total),
// waited for and read from the signal pad into s_cnt [world][words] by the CTA's threads; false
// on this thread when a wait gave up (the caller combines the threads' answers).
__device__ __forceinline__ bool gather_counts(const dev::Launch& launch, const DeviceComm& comm,
                                              const Dims& d, int words, int32_t* s_cnt) {
  bool ok = true;
  for (int w = threadIdx.x; w < d.world * words; w += kThreads) {
    const int src = w / words;
    const uint32_t signal = count_signal(w % words);
    ok = launch.wait(src, signal, 0) && ok;
    s_cnt[w] = static_cast<int32_t>(
        dev::ld_relaxed_sys(comm.signals + static_cast<uint64_t>(signal) * comm.world_size + src));
  }
  return ok;
}

template <class Idx>
__device__ __forceinline__ bool valid_expert(Idx e, int experts) {
  return e >= 0 && e < static_cast<Idx>(experts);
}

// Whether slot j is the first of its token's row to route to rank `dst` (the row travels once).
template <class Idx>
__device__ __forceinline__ bool first_for_rank(const Idx* row, int j, int dst, const Dims& d) {
  for (int i = 0; i < j; ++i) {
    const Idx e = row[i];
    if (valid_expert(e, d.experts) && static_cast<int>(e / d.experts_local) == dst) return false;
  }
  return true;
}

// [lo, hi) of n items for part `part` of `parts` (the same split on every rank).
__device__ __forceinline__ void share(int64_t n, int part, int parts, int64_t& lo, int64_t& hi) {
  lo = n * part / parts;
  hi = n * (part + 1) / parts;
}

// Exclusive prefix sums in place over n ints of shared memory, by the whole CTA of kBlockThreads
// threads; returns the total.
template <int kBlockThreads>
__device__ __forceinline__ int64_t block_exclusive_scan(int32_t* values, int n) {
  using Scan = cub::BlockScan<int64_t, kBlockThreads>;
  __shared__ typename Scan::TempStorage scan;
  __shared__ int64_t carry;
  if (threadIdx.x == 0) carry = 0;
  __syncthreads();
  for (int base = 0; base < n; base += kBlockThreads) {
    const int i = base + static_cast<int>(threadIdx.x);
    const int64_t v = i < n ? values[i] : 0;
    int64_t before = 0, total = 0;
    Scan(scan).ExclusiveSum(v, before, total);
    if (i < n) values[i] = static_cast<int32_t>(carry + before);
    __syncthreads();
    if (threadIdx.x == 0) carry += total;
    __syncthreads();
  }
  return carry;
}

// Rows per expert and per destination rank of chunk blockIdx.x (one CTA per chunk; at least one
// CTA, also for no tokens). Bad indices are recorded here, once.
template <class Idx>
__global__ void __launch_bounds__(kRouteThreads)
    route_count_kernel(DeviceComm comm, Dims d, const Idx* topk, Workspace ws) {
  extern __shared__ int32_t s_counts[];  // [experts] then [world]
  int32_t* s_dcnt = s_counts + d.experts;
  for (int i = threadIdx.x; i < d.experts + d.world; i += blockDim.x) s_counts[i] = 0;
  __syncthreads();
  const int64_t t0 = blockIdx.x * d.chunk_tokens;
  const int64_t t1 = min64(d.tokens, t0 + d.chunk_tokens);
  const uint64_t epoch = dev::ld_relaxed_gpu(&comm.state->epoch) + 1;  // the dispatch's
  for (int64_t p = t0 * d.top_k + threadIdx.x; p < t1 * d.top_k; p += blockDim.x) {
    const Idx e = topk[p];
    if (e == -1) continue;
    const int64_t t = p / d.top_k;
    const int j = static_cast<int>(p % d.top_k);
    if (!valid_expert(e, d.experts)) {
      dev::record_data_error(comm, epoch, DeviceErrorCode::kBadIndex, static_cast<int32_t>(t),
                             static_cast<uint32_t>(j), static_cast<uint64_t>(d.experts),
                             static_cast<uint64_t>(static_cast<int64_t>(e)));
      continue;
    }
    atomicAdd(&s_counts[e], 1);
    const int dst = static_cast<int>(e / d.experts_local);
    if (first_for_rank(topk + t * d.top_k, j, dst, d)) atomicAdd(&s_dcnt[dst], 1);
  }
  __syncthreads();
  int32_t* cnt =
      ws.at<int32_t>(d.rank, ws.chunk_cnt) + static_cast<int64_t>(blockIdx.x) * d.experts;
  int32_t* dcnt =
      ws.at<int32_t>(d.rank, ws.chunk_dcnt) + static_cast<int64_t>(blockIdx.x) * d.world;
  for (int i = threadIdx.x; i < d.experts; i += blockDim.x) cnt[i] = s_counts[i];
  for (int i = threadIdx.x; i < d.world; i += blockDim.x) dcnt[i] = s_dcnt[i];
}

// Positions and send order of chunk blockIdx.x (same grid as route_count_kernel).
template <class Idx>
__global__ void __launch_bounds__(kRouteThreads)
    route_scan_kernel(Dims d, const Idx* topk, Workspace ws) {
  extern __shared__ int32_t s_base[];  // [experts] then [world]: running positions
  int32_t* s_dbase = s_base + d.experts;
  int32_t* s_local = s_dbase + d.world;  // [E_local]: first entry of each own expert in by_local
  const int c = blockIdx.x;
  const int32_t* cnt = ws.at<int32_t>(d.rank, ws.chunk_cnt);
  const int32_t* dcnt = ws.at<int32_t>(d.rank, ws.chunk_dcnt);
  int32_t* totals = ws.at<int32_t>(d.rank, ws.totals);
  for (int i = threadIdx.x; i < d.experts + d.world; i += blockDim.x) {
    const bool expert = i < d.experts;
    const int32_t* column = expert ? cnt + i : dcnt + (i - d.experts);
    const int stride = expert ? d.experts : d.world;
    int32_t sum = 0;
    for (int earlier = 0; earlier < c; ++earlier) {
      sum += column[static_cast<int64_t>(earlier) * stride];
    }
    s_base[i] = sum;
    if (c == static_cast<int>(gridDim.x) - 1) {
      totals[i] = sum + column[static_cast<int64_t>(c) * stride];
    }
  }
  if (d.local_list) {  // this rank's rows for its own experts, all chunks: their list's offsets
    for (int e = threadIdx.x; e < d.experts_local; e += blockDim.x) {
      const int32_t* column = cnt + d.rank * d.experts_local + e;
      int32_t sum = 0;
      for (int chunk = 0; chunk < static_cast<int>(gridDim.x); ++chunk) {
        sum += column[static_cast<int64_t>(chunk) * d.experts];
      }
      s_local[e] = sum;
    }
    __syncthreads();
    block_exclusive_scan<kRouteThreads>(s_local, d.experts_local);
  }
  __syncthreads();
  if (threadIdx.x >= 32) return;
  int32_t* by_local = ws.at<int32_t>(d.rank, ws.by_local);
  const int first_own = d.rank * d.experts_local;
  const int lane = threadIdx.x;
  const unsigned lower = (1u << lane) - 1;
  int32_t* pos = ws.at<int32_t>(d.rank, ws.pos);
  int32_t* send_list = ws.at<int32_t>(d.rank, ws.send_list);
  const int64_t t0 = static_cast<int64_t>(c) * d.chunk_tokens;
  const int64_t t1 = min64(d.tokens, t0 + d.chunk_tokens);
  for (int64_t p0 = t0 * d.top_k; p0 < t1 * d.top_k; p0 += 32) {
    const int64_t p = p0 + lane;
    const bool active = p < t1 * d.top_k;
    const Idx e = active ? topk[p] : Idx{-1};
    const bool ok = active && valid_expert(e, d.experts);
    const int64_t t = p / d.top_k;
    const int j = static_cast<int>(p % d.top_k);
    // This pair's position among this rank's rows for expert e: earlier chunks, earlier steps,
    // earlier lanes.
    const unsigned same = __match_any_sync(~0u, ok ? static_cast<int>(e) : -1);
    int32_t my_pos = -1;
    if (ok) my_pos = s_base[e] + __popc(same & lower);
    __syncwarp();
    if (ok && (same & lower) == 0) s_base[e] += __popc(same);
    __syncwarp();
    if (active) pos[p] = my_pos;
    if (d.local_list && ok && e >= first_own && e < first_own + d.experts_local) {
      by_local[s_local[e - first_own] + my_pos] = static_cast<int32_t>(p);
    }
    // The (token, destination) pair's slot in the destination's send order.
    const int dst = ok ? static_cast<int>(e / d.experts_local) : -1;
    const bool first = ok && first_for_rank(topk + t * d.top_k, j, dst, d);
    const unsigned to_same = __match_any_sync(~0u, first ? dst : -1);
    if (first) {
      send_list[static_cast<int64_t>(dst) * d.max_tokens + s_dbase[dst] + __popc(to_same & lower)] =
          static_cast<int32_t>(t);
    }
    __syncwarp();
    if (first && (to_same & lower) == 0) s_dbase[dst] += __popc(to_same);
    __syncwarp();
  }
}

// One warp copies a row of `n16` 16-byte words from src to each of the first `count`
// destinations (dst[i]; nullptr: none), four words in flight per lane. The destinations stay in
// registers: every index into dst is a compile-time constant.
template <int kMaxDst>
__device__ __forceinline__ void copy_row(const int4* src, int4* const (&dst)[kMaxDst], int count,
                                         int64_t n16, int lane) {
  int64_t i = lane;
  for (; i + 96 < n16; i += 128) {
    const int4 v0 = src[i], v1 = src[i + 32], v2 = src[i + 64], v3 = src[i + 96];
#pragma unroll
    for (int k = 0; k < kMaxDst; ++k) {
      if (k >= count) break;
      int4* out = dst[k];
      if (out == nullptr) continue;
      out[i] = v0;
      out[i + 32] = v1;
      out[i + 64] = v2;
      out[i + 96] = v3;
    }
  }
  for (; i < n16; i += 32) {
    const int4 v = src[i];
#pragma unroll
    for (int k = 0; k < kMaxDst; ++k) {
      if (k >= count) break;
      if (dst[k] != nullptr) dst[k][i] = v;
    }
  }
}

template <class Idx>
__global__ void __launch_bounds__(kThreads, 1)
    dispatch_kernel(DeviceComm comm, Dims d, const Idx* topk, const __nv_bfloat16* x, Workspace ws,
                    __nv_bfloat16* out, int32_t* expert_rows, int32_t* handle) {
  const dev::Launch launch = dev::Launch::begin(comm);
  const int c = blockIdx.x, channels = gridDim.x;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int el_n = d.experts_local, words = el_n + 1;
  // Every rank has entered this launch: done with the last one's receive regions and counts,
  // and with what came before it on its stream (the workspace's first zeroing, say).
  if (!launch.channel_barrier(SignalId::kEntry, c, 1)) {
    launch.end();
    return;
  }
  const int64_t n16 = d.hidden / 8;
  const int32_t* totals = ws.at<int32_t>(d.rank, ws.totals);

  // ---- counts: to every destination (one node: rank == local rank) ----
  for (int64_t w = static_cast<int64_t>(c) * kThreads + threadIdx.x;
       w < static_cast<int64_t>(d.world) * words; w += static_cast<int64_t>(channels) * kThreads) {
    const int dst = static_cast<int>(w / words), i = static_cast<int>(w % words);
    const int32_t n = i < el_n ? totals[dst * el_n + i] : totals[d.experts + dst];
    launch.signal(dst, count_signal(i), static_cast<uint32_t>(n));
  }

  // ---- send: channel c's share of the rows for each destination ----
  const int32_t* pos = ws.at<int32_t>(d.rank, ws.pos);
  const int32_t* send_list = ws.at<int32_t>(d.rank, ws.send_list);
  for (int i = 0; i < d.world; ++i) {
    const int dst = (d.rank + 1 + i) % d.world;  // every rank starts with a different peer
    int64_t lo, hi;
    share(totals[d.experts + dst], c, channels, lo, hi);
    const int64_t region = static_cast<int64_t>(d.rank) * d.max_tokens;
    __nv_bfloat16* rx = ws.at<__nv_bfloat16>(dst, ws.recv_x) + region * d.hidden;
    int32_t* meta = ws.at<int32_t>(dst, ws.recv_meta) + region * d.meta_ints;
    for (int64_t slot = lo + warp; slot < hi; slot += kWarps) {
      const int32_t t = send_list[static_cast<int64_t>(dst) * d.max_tokens + slot];
      int4* const rows[1] = {reinterpret_cast<int4*>(rx + slot * d.hidden)};
      copy_row(reinterpret_cast<const int4*>(x + static_cast<int64_t>(t) * d.hidden), rows, 1, n16,
               lane);
      int32_t* m = meta + slot * d.meta_ints;
      if (lane == 0) m[0] = t;
      if (lane < d.top_k) {
        const Idx e = topk[static_cast<int64_t>(t) * d.top_k + lane];
        const bool here = valid_expert(e, d.experts) && static_cast<int>(e / el_n) == dst;
        m[1 + 2 * lane] = here ? static_cast<int32_t>(e % el_n) : -1;
        m[2 + 2 * lane] = here ? pos[static_cast<int64_t>(t) * d.top_k + lane] : -1;
      }
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      dev::fence_acq_rel_sys();
      launch.signal(dst, dev::signal_index(SignalId::kOp, c), 1);
    }
  }

  // ---- place: the layout from every source's counts ----
  extern __shared__ int32_t s_cnt[];  // [world][words]: counts, then prefixes over sources
  int32_t* s_total = s_cnt + d.world * words;
  int32_t* s_start = s_total + el_n;  // [E_local + 1]
  bool ok = __syncthreads_and(gather_counts(launch, comm, d, words, s_cnt)) != 0;
  if (ok) {
    for (int e = threadIdx.x; e < el_n; e += kThreads) {
      int32_t sum = 0;
      for (int src = 0; src < d.world; ++src) {
        const int32_t n = s_cnt[src * words + e];
        s_cnt[src * words + e] = sum;  // rows of earlier sources
        sum += n;
      }
      s_total[e] = sum;
      s_start[e] = d.masked ? 0 : (sum + kRowBlock - 1) / kRowBlock * kRowBlock;
    }
    __syncthreads();
    if (d.masked) {
      for (int e = threadIdx.x; e <= el_n; e += kThreads) {
        s_start[e] = static_cast<int32_t>(min64(e * d.capacity, INT32_MAX));
      }
      __syncthreads();
    } else {
      const int64_t end = block_exclusive_scan<kThreads>(s_start, el_n);
      if (threadIdx.x == 0) s_start[el_n] = static_cast<int32_t>(min64(end, INT32_MAX));
      __syncthreads();
    }
    if (c == 0) {
      for (int e = threadIdx.x; e < el_n; e += kThreads) expert_rows[e] = s_total[e];
    }
    // Experts with rows past their room: recorded once (the rows that fit are placed).
    for (int e = c * kThreads + threadIdx.x; e < el_n; e += channels * kThreads) {
      const int64_t held =
          d.masked ? d.capacity : max64(0, d.capacity - static_cast<int64_t>(s_start[e]));
      if (s_total[e] > held) {
        dev::record_data_error(comm, launch.epoch, DeviceErrorCode::kCapacity, e, 0,
                               static_cast<uint64_t>(held), static_cast<uint64_t>(s_total[e]));
      }
    }
    // Channel c of every source: its rows landed.
    for (int src = threadIdx.x; src < d.world; src += kThreads) {
      ok = launch.wait(src, dev::signal_index(SignalId::kOp, c), 1) && ok;
    }
    ok = __syncthreads_and(ok) != 0;
  }
  if (ok) {
    for (int src = 0; src < d.world; ++src) {
      int64_t lo, hi;
      // Rows src sent here (word el_n stayed a count: the prefixes cover the experts only).
      share(s_cnt[src * words + el_n], c, channels, lo, hi);
      const int64_t region = static_cast<int64_t>(src) * d.max_tokens;
      const __nv_bfloat16* rx = ws.at<__nv_bfloat16>(d.rank, ws.recv_x) + region * d.hidden;
      const int32_t* meta = ws.at<int32_t>(d.rank, ws.recv_meta) + region * d.meta_ints;
      for (int64_t slot = lo + warp; slot < hi; slot += kWarps) {
        const int32_t* m = meta + slot * d.meta_ints;
        const int32_t t = m[0];
        int64_t row = -1;  // this lane's slot's destination row
        if (lane < d.top_k) {
          const int32_t e = m[1 + 2 * lane];
          if (e >= 0) {
            const int64_t at = static_cast<int64_t>(s_cnt[src * words + e]) + m[2 + 2 * lane];
            const int64_t held = d.masked ? d.capacity : d.capacity - s_start[e];
            if (at < held) row = s_start[e] + at;
          }
        }
        if (row >= 0) {
          int32_t* h = handle + row * 3;
          h[0] = src;
          h[1] = t;
          h[2] = lane;
        }
        int4* rows[kMoeMaxTopK];
#pragma unroll
        for (int j = 0; j < kMoeMaxTopK; ++j) {
          const int64_t r = __shfl_sync(~0u, row, j);
          rows[j] = j < d.top_k && r >= 0 ? reinterpret_cast<int4*>(out + r * d.hidden) : nullptr;
        }
        copy_row(reinterpret_cast<const int4*>(rx + slot * d.hidden), rows, d.top_k, n16, lane);
      }
    }
    // Rows no (source, token, slot) landed in: the handle says so.
    for (int e = c; e < el_n; e += channels) {
      const int64_t start = s_start[e];
      const int64_t end = d.masked ? start + d.capacity : min64(d.capacity, s_start[e + 1]);
      const int64_t first = min64(end, start + s_total[e]);
      for (int64_t r = first + threadIdx.x; r < end; r += kThreads) {
        handle[r * 3] = handle[r * 3 + 1] = handle[r * 3 + 2] = -1;
      }
    }
    if (!d.masked) {
      int64_t lo, hi;
      const int64_t used = min64(d.capacity, s_start[el_n]);
      share(d.capacity - used, c, channels, lo, hi);
      for (int64_t r = used + lo + threadIdx.x; r < used + hi; r += kThreads) {
        handle[r * 3] = handle[r * 3 + 1] = handle[r * 3 + 2] = -1;
      }
    }
  }
  launch.end();
}

__global__ void __launch_bounds__(kThreads, 1)
    combine_kernel(DeviceComm comm, Dims d, const __nv_bfloat16* y, const float* weights,
                   const int32_t* handle, Workspace ws, __nv_bfloat16* out) {
  const dev::Launch launch = dev::Launch::begin(comm);
  const int c = blockIdx.x, channels = gridDim.x;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t n16 = d.hidden / 8;
  const uint32_t mark = static_cast<uint32_t>(launch.epoch);
  // Every rank has entered: done reading the last combine's rows from its combine buffer.
  if (!launch.channel_barrier(SignalId::kEntry, c, 1)) {
    launch.end();
    return;
  }

  // ---- send: channel c's rows of the layout back to their sources ----
  int64_t lo, hi;
  share(d.rows, c, channels, lo, hi);
  for (int64_t r = lo + warp; r < hi; r += kWarps) {
    const int32_t src = handle[r * 3];
    if (src < 0) continue;
    const int64_t at = static_cast<int64_t>(handle[r * 3 + 1]) * d.top_k + handle[r * 3 + 2];
    int4* const rows[1] = {
        reinterpret_cast<int4*>(ws.at<__nv_bfloat16>(src, ws.comb_x) + at * d.hidden)};
    copy_row(reinterpret_cast<const int4*>(y + r * d.hidden), rows, 1, n16, lane);
    if (lane == 0) ws.at<uint32_t>(src, ws.comb_flag)[at] = mark;
  }
  __syncthreads();
  for (int dst = threadIdx.x; dst < d.world; dst += kThreads) {
    dev::fence_acq_rel_sys();
    launch.signal(dst, dev::signal_index(SignalId::kOp, c), 1);
  }

  // ---- reduce: every rank's every channel has sent its rows here ----
  bool ok = true;
  for (int w = threadIdx.x; w < d.world * channels; w += kThreads) {
    ok = launch.wait(w / channels, dev::signal_index(SignalId::kOp, w % channels), 1) && ok;
  }
  ok = __syncthreads_and(ok) != 0;
  if (ok) {
    const __nv_bfloat16* rows = ws.at<__nv_bfloat16>(d.rank, ws.comb_x);
    const uint32_t* flags = ws.at<uint32_t>(d.rank, ws.comb_flag);
    share(d.tokens, c, channels, lo, hi);
    for (int64_t t = lo + warp; t < hi; t += kWarps) {
      float w = 0.f;
      bool present = false;
      if (lane < d.top_k) {
        present = flags[t * d.top_k + lane] == mark;
        w = weights[t * d.top_k + lane];
      }
      const unsigned slots = __ballot_sync(~0u, present);
      float wj[kMoeMaxTopK];  // every slot's weight in every lane (before lanes part ways)
#pragma unroll
      for (int j = 0; j < kMoeMaxTopK; ++j) wj[j] = __shfl_sync(~0u, w, j);
      for (int64_t i = lane; i < n16; i += 32) {
        float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
#pragma unroll
        for (int j = 0; j < kMoeMaxTopK; ++j) {
          if (j >= d.top_k) break;
          if ((slots >> j & 1u) == 0) continue;
          const int4 v = reinterpret_cast<const int4*>(rows + (t * d.top_k + j) * d.hidden)[i];
          const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&v);
#pragma unroll
          for (int q = 0; q < 4; ++q) {
            const float2 f = __bfloat1622float2(h[q]);
            acc[2 * q] = __fmaf_rn(wj[j], f.x, acc[2 * q]);
            acc[2 * q + 1] = __fmaf_rn(wj[j], f.y, acc[2 * q + 1]);
          }
        }
        int4 o;
        __nv_bfloat162* ob = reinterpret_cast<__nv_bfloat162*>(&o);
#pragma unroll
        for (int q = 0; q < 4; ++q) ob[q] = __floats2bfloat162_rn(acc[2 * q], acc[2 * q + 1]);
        reinterpret_cast<int4*>(out + t * d.hidden)[i] = o;
      }
    }
  }
  launch.end();
}

}  // namespace mk::moe
