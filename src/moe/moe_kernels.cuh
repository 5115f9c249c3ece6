// The MoE dispatch and combine kernels (mkernel/moe.h, docs/design/moe.md).
//
// Per rank and call, on its stream:
//   route_count_kernel   chunk c of the tokens: rows per expert and per destination rank (local)
//   route_scan_kernel    chunk c: prefixes over the earlier chunks, then one warp walks the chunk
//                        in (token, slot) order with __match_any_sync: each pair's position in
//                        its (this rank, expert) stream, each (token, destination) pair's slot in
//                        the send order; the last chunk writes the totals (local; no atomics on
//                        positions, so the layout is a pure function of topk_idx)
//   dispatch_kernel      (moe_dispatch.cuh) persistent, one CTA per channel:
//      entry barrier
//      counts   -> every destination's signal pad: rows for each of its local experts, rows sent
//      send     -> channel c's share of the rows for each destination: x[t] once per (token,
//                  destination) into the destination's receive region [src][slot], with its
//                  metadata (token; per slot, local expert and position); then signal kOp + c
//      place    <- every source's counts: the layout (expert starts, source prefixes); channel c
//                  of every source: its rows copied to their expert-major rows, once per local
//                  expert of the token, with the handle; unused rows' handle set to -1
//   combine_kernel       (moe_combine.cuh) persistent, one CTA per channel:
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
  int me;             // this rank's index on its node (its workspace copy: Workspace::at)
  int nodes;          // nodes of the communicator (1: every rank is local)
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
  // The op and the sizes every rank must share, hashed (dev::entry_signature): the entry
  // barriers compare it with every peer's on this node (Launch::channel_barrier_agreeing), so
  // ranks that disagree - a max_tokens of their own, another capacity or SM count, another op -
  // stop with an error naming them before any row goes to a peer at offsets the peer does not
  // use. (Across nodes only the node's own ranks are compared: a disagreement between nodes is
  // not caught here.)
  uint32_t signature;
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
  uint64_t totals;        // int32 [experts + world + nodes]        (local)
  uint64_t by_local;      // int32 [max_tokens * top_k]              (local; moe_dispatch_gemm)
  uint64_t recv_order;    // int32 [world][max_tokens * top_k]       (receiver; moe_dispatch_gemm)
  uint64_t layout;        // int32 LayoutTables                      (local; moe_dispatch_gemm)
  uint64_t counters;      // uint64 [blocks]                         (local; moe_dispatch_gemm)
  uint64_t comb_count;    // uint64 [max_tokens][ceil(hidden / 128)] (at the source; moe_layer)
  // Across nodes (moe_nodes.cuh; laid out for every plan, small on one node):
  uint64_t chunk_ncnt;  // int32 [chunks][nodes]                (local)
  uint64_t cross_list;  // int32 [nodes][max_tokens]            (local: tokens bound for node n)
  uint64_t send_slot;   // int32 [max_tokens][top_k]            (local: a (token, rank) pair's slot
                        //                                       in the send order, at its first
                        //                                       slot bound for that rank)
  uint64_t slot_route;  // int32 [max_tokens][top_k]  (nodes > 1; moe_plan.h has these five)
  uint64_t recv_cross;  // int32 [world][max_tokens]
  uint64_t row_cross;   // int32 [rows]
  uint64_t relay_y;     // bf16 [nodes][max_tokens x top_k][hidden]
  uint64_t relay_flag;  // uint32 [nodes][max_tokens x top_k]
  uint64_t relay_rows;  // int32 [nodes]

  // Field `field` in the workspace of local rank `local` (this rank: Dims::me).
  template <class T>
  __device__ T* at(int local, uint64_t field) const {
    return reinterpret_cast<T*>(peers[local] + offset + field);
  }
};

// The communicator's nodes as the route and dispatch kernels see them (one node, Dims::nodes 1:
// the tables unused). Ranks across nodes are at most kMoeMaxNodeRanks (moe_plan.cpp checks).
struct NodeMap {
  int per_node;  // ranks a node
  int8_t node_of[kMoeMaxNodeRanks];
  int8_t local_of[kMoeMaxNodeRanks];
  int16_t rank_at[kMoeMaxNodeRanks];  // [node * per_node + local]

  // The rank with index `local` on node `node` (a rail peer: this rank's own index).
  __device__ int rank(int node, int local) const { return rank_at[node * per_node + local]; }

  __device__ int node_of_expert(int64_t e, int experts_local) const {
    return node_of[static_cast<int>(e / experts_local)];
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

// Whether slot j is the first of its token's row to route to node `node` (the row crosses once).
template <class Idx>
__device__ __forceinline__ bool first_for_node(const Idx* row, int j, int node, const Dims& d,
                                               const NodeMap& nm) {
  for (int i = 0; i < j; ++i) {
    const Idx e = row[i];
    if (valid_expert(e, d.experts) && nm.node_of_expert(e, d.experts_local) == node) return false;
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
    route_count_kernel(DeviceComm comm, Dims d, NodeMap nm, const Idx* topk, Workspace ws) {
  extern __shared__ int32_t s_counts[];  // [experts] then [world], then [nodes] across nodes
  int32_t* s_dcnt = s_counts + d.experts;
  int32_t* s_ncnt = s_dcnt + d.world;
  const int keys = d.experts + d.world + (d.nodes > 1 ? d.nodes : 0);
  for (int i = threadIdx.x; i < keys; i += blockDim.x) s_counts[i] = 0;
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
    if (d.nodes > 1) {
      const int node = nm.node_of[dst];
      if (first_for_node(topk + t * d.top_k, j, node, d, nm)) atomicAdd(&s_ncnt[node], 1);
    }
  }
  __syncthreads();
  int32_t* cnt = ws.at<int32_t>(d.me, ws.chunk_cnt) + static_cast<int64_t>(blockIdx.x) * d.experts;
  int32_t* dcnt = ws.at<int32_t>(d.me, ws.chunk_dcnt) + static_cast<int64_t>(blockIdx.x) * d.world;
  for (int i = threadIdx.x; i < d.experts; i += blockDim.x) cnt[i] = s_counts[i];
  for (int i = threadIdx.x; i < d.world; i += blockDim.x) dcnt[i] = s_dcnt[i];
  if (d.nodes > 1) {
    int32_t* ncnt =
        ws.at<int32_t>(d.me, ws.chunk_ncnt) + static_cast<int64_t>(blockIdx.x) * d.nodes;
    for (int i = threadIdx.x; i < d.nodes; i += blockDim.x) ncnt[i] = s_ncnt[i];
  }
}

// Positions and send order of chunk blockIdx.x (same grid as route_count_kernel).
template <class Idx>
__global__ void __launch_bounds__(kRouteThreads)
    route_scan_kernel(Dims d, NodeMap nm, const Idx* topk, Workspace ws) {
  // Running positions: [experts], [world], then [nodes] across nodes; then [E_local].
  extern __shared__ int32_t s_base[];
  int32_t* s_dbase = s_base + d.experts;
  int32_t* s_nbase = s_dbase + d.world;
  const int node_keys = d.nodes > 1 ? d.nodes : 0;
  int32_t* s_local = s_nbase + node_keys;  // [E_local]: first entry of each own expert in by_local
  const int c = blockIdx.x;
  const int32_t* cnt = ws.at<int32_t>(d.me, ws.chunk_cnt);
  const int32_t* dcnt = ws.at<int32_t>(d.me, ws.chunk_dcnt);
  const int32_t* ncnt = ws.at<int32_t>(d.me, ws.chunk_ncnt);
  int32_t* totals = ws.at<int32_t>(d.me, ws.totals);  // experts, then world, then nodes
  for (int i = threadIdx.x; i < d.experts + d.world + node_keys; i += blockDim.x) {
    const bool expert = i < d.experts, rank = !expert && i < d.experts + d.world;
    const int32_t* column = expert ? cnt + i
                            : rank ? dcnt + (i - d.experts)
                                   : ncnt + (i - d.experts - d.world);
    const int stride = expert ? d.experts : rank ? d.world : d.nodes;
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
  int32_t* by_local = ws.at<int32_t>(d.me, ws.by_local);
  const int first_own = d.rank * d.experts_local;
  const int lane = threadIdx.x;
  const unsigned lower = (1u << lane) - 1;
  int32_t* pos = ws.at<int32_t>(d.me, ws.pos);
  int32_t* send_list = ws.at<int32_t>(d.me, ws.send_list);
  int32_t* send_slot = ws.at<int32_t>(d.me, ws.send_slot);
  int32_t* cross_list = ws.at<int32_t>(d.me, ws.cross_list);
  int32_t* slot_route = ws.at<int32_t>(d.me, ws.slot_route);  // (the dispatch fills crossing ones)
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
    if (node_keys > 0 && active) slot_route[p] = -1;
    if (d.local_list && ok && e >= first_own && e < first_own + d.experts_local) {
      by_local[s_local[e - first_own] + my_pos] = static_cast<int32_t>(p);
    }
    // The (token, destination) pair's slot in the destination's send order.
    const int dst = ok ? static_cast<int>(e / d.experts_local) : -1;
    const bool first = ok && first_for_rank(topk + t * d.top_k, j, dst, d);
    const unsigned to_same = __match_any_sync(~0u, first ? dst : -1);
    if (first) {
      const int32_t slot = s_dbase[dst] + __popc(to_same & lower);
      send_list[static_cast<int64_t>(dst) * d.max_tokens + slot] = static_cast<int32_t>(t);
      if (node_keys > 0) send_slot[p] = slot;
    }
    __syncwarp();
    if (first && (to_same & lower) == 0) s_dbase[dst] += __popc(to_same);
    __syncwarp();
    if (node_keys == 0) continue;
    // Across nodes: the (token, node) pair's place in the node's crossing list.
    const int node = ok ? nm.node_of[dst] : -1;
    const bool crosses = ok && first_for_node(topk + t * d.top_k, j, node, d, nm);
    const unsigned to_node = __match_any_sync(~0u, crosses ? node : -1);
    if (crosses) {
      cross_list[static_cast<int64_t>(node) * d.max_tokens + s_nbase[node] +
                 __popc(to_node & lower)] = static_cast<int32_t>(t);
    }
    __syncwarp();
    if (crosses && (to_node & lower) == 0) s_nbase[node] += __popc(to_node);
    __syncwarp();
  }
}

// One warp copies a row of `n16` 16-byte words from src to each of the first `count`
// destinations (dst[i]; nullptr: none), four words in flight per lane. The destinations stay in
// registers: every index into dst is a compile-time constant.
// kL2: the source is read through L2 only (bytes another node's puts landed while the kernel
// ran: after the wait's acquire, no stale L1 line may serve them).
template <int kMaxDst, bool kL2 = false>
__device__ __forceinline__ void copy_row(const int4* src, int4* const (&dst)[kMaxDst], int count,
                                         int64_t n16, int lane) {
  const auto load = [&](int64_t i) {
    if constexpr (kL2) {
      const uint4 v = dev::load_l2(src + i);
      return make_int4(static_cast<int>(v.x), static_cast<int>(v.y), static_cast<int>(v.z),
                       static_cast<int>(v.w));
    } else {
      return src[i];
    }
  };
  int64_t i = lane;
  for (; i + 96 < n16; i += 128) {
    const int4 v0 = load(i), v1 = load(i + 32), v2 = load(i + 64), v3 = load(i + 96);
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
    const int4 v = load(i);
#pragma unroll
    for (int k = 0; k < kMaxDst; ++k) {
      if (k >= count) break;
      if (dst[k] != nullptr) dst[k][i] = v;
    }
  }
}

}  // namespace mk::moe
