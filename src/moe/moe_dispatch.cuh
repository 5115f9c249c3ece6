// moe_dispatch's kernel, on one node and across nodes (mkernel/moe.h, docs/design/moe.md).
//
// Persistent, one CTA per channel; after the route kernels (moe_kernels.cuh). Phases of channel c:
//   entry      the node's ranks meet (channel barrier); across nodes CTA 0 also announces the
//              launch to this rank's rail peers (host-pad signal kEntrySignal)
//   cross      (across nodes) for each other node n: once rail peer r = (n, my local index) has
//              entered, channel c's share of the tokens bound for n (route_scan's crossing list,
//              each token once) staged with their metadata - the token; per slot, the global
//              expert if it lives on n, its position, the token's slot in the send order to that
//              expert's rank - and put into r's inbound region for this node (host-pad signal
//              kDataSignal0 + c); channel 0 first puts the header: the counts each rank of n
//              gets from here (kCountsSignal)
//   counts     -> every destination on this node: rows for each of its local experts, rows sent
//   send       -> channel c's share of the rows for each destination on this node: x[t] once per
//                 (token, destination) into its receive region [src][slot], with its metadata
//                 (token; per slot, local expert and position); then signal kOp + c
//   relay      (across nodes) for each other node m, source s = (m, my local index): channel 0
//              forwards s's counts into the count words of every rank of this node, as s would
//              have raised them; channel c sends its share of s's crossing rows to the ranks of
//              this node that hold their experts (once per rank), into their receive regions [s]
//              exactly as s would have written them, then raises kOp + c in s's word of their pads
//   place      <- every source's counts: the layout (expert starts, source prefixes); every
//                 source's rows landed (a source on this node: its channel c; a source on another
//                 node: every channel of its relay, which shares the rows differently): channel c's
//                 share of each source's rows copied to their expert-major rows, once per local
//                 expert of the token, with the handle; unused rows' handle set to -1
// So a remote source's rows reach a receive region in the layout a local source's would: the
// placement, the layout and the handle do not depend on the path (the one-node routing's
// reference, tests/cpu/moe_reference.h, holds across nodes).
//
// Reuse across nodes: a rank stages and puts only once every rail peer has entered this launch
// (rail_entered) - they are done with the last launch's inbound rows, and every put out of this
// rank's staging has landed (they waited for them), so no region of the next op, wherever its
// plan lays it, overlaps bytes still in flight. Relayed writes land in this node's ranks, which
// have passed the entry barrier.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "mkernel/device/launch.cuh"
#include "mkernel/device/push.cuh"
#include "mkernel/device_comm.h"
#include "mkernel/transport/command.h"
#include "mkernel/transport/ring.h"
#include "moe/moe_kernels.cuh"

namespace mk::moe {

constexpr int kMaxNodeRings = 4;
// Host-pad signals of the dispatch across nodes (< kInterNodeSignals: moe_plan.cpp checks).
constexpr uint32_t kEntrySignal = 0;   // "my rail peer entered this launch"
constexpr uint32_t kCountsSignal = 1;  // a source's header (the counts) landed
constexpr uint32_t kDataSignal0 = 2;   // + channel: that channel's share of the crossing rows
static_assert(kDataSignal0 + kMaxChannels <= static_cast<uint32_t>(kInterNodeSignals));

// What crosses the network, from the host (moe.cu): the inter-node rings and the transfer
// regions - 2 x nodes of region_bytes each: [n] this rank's staging for node n, [nodes + m] its
// inbound rows from node m. A region: header (int32 [per_node][E_local + 1] counts, then the
// crossing rows), metadata (int32 [max_tokens][cross_ints]), rows (bf16 [max_tokens][hidden]).
struct NodeXfer {
  transport::CommandRing rings[kMaxNodeRings];
  int num_rings;
  uint8_t* xfer;         // region 0 as this rank addresses it
  int xfer_buffer;       // the registered id of the buffer holding the regions
  uint64_t xfer_offset;  // byte offset of region 0 in that buffer (on every rank)
  uint64_t region_bytes;
  uint64_t meta_at;  // byte offsets inside a region
  uint64_t rows_at;
  int cross_ints;  // 1 + 3 x top_k: token; per slot (global expert or -1, position, send slot)
  // The combine's regions, after the dispatch's: [m] this rank's staging of the rows it relays
  // back to node m, [nodes + n] the rows relayed to this rank from node n (CombRegion).
  uint64_t comb_at;  // byte offset of the first from region 0
  uint64_t comb_bytes;
  uint64_t comb_rows_at;

  __device__ uint8_t* region(int i) const { return xfer + static_cast<uint64_t>(i) * region_bytes; }
  __device__ uint64_t region_offset(int i) const {
    return xfer_offset + static_cast<uint64_t>(i) * region_bytes;
  }
  __device__ uint8_t* comb_region(int i) const {
    return xfer + comb_at + static_cast<uint64_t>(i) * comb_bytes;
  }
  __device__ uint64_t comb_offset(int i) const {
    return xfer_offset + comb_at + static_cast<uint64_t>(i) * comb_bytes;
  }

  // Pushes a command into ring `k` mod the rings (false: the ring broke or the time limit
  // passed; the proxy or the waits then report).
  __device__ bool push(const DeviceComm& comm, int k, const transport::Command& cmd) const {
    return dev::push_command(comm, rings[k % num_rings], cmd);
  }
};

// A rank's index on its node, the rank with index `local` on this rank's node, and whether a
// rank is on this rank's node (one node: rank == local index).
__device__ __forceinline__ int local_of(const Dims& d, const NodeMap& nm, int rank) {
  return d.nodes > 1 ? nm.local_of[rank] : rank;
}
__device__ __forceinline__ int node_rank(const Dims& d, const NodeMap& nm, int local) {
  return d.nodes > 1 ? nm.rank(nm.node_of[d.rank], local) : local;
}
__device__ __forceinline__ bool on_my_node(const Dims& d, const NodeMap& nm, int rank) {
  return d.nodes == 1 || nm.node_of[rank] == nm.node_of[d.rank];
}

// Across nodes, CTA 0 of a launch: "this launch has begun" to every rail peer (host-pad
// kEntrySignal; what rail_entered waits for).
__device__ __forceinline__ void announce_entry(const dev::Launch& launch, const DeviceComm& comm,
                                               const Dims& d, const NodeMap& nm,
                                               const NodeXfer& xf) {
  for (int i = threadIdx.x + 1; i < d.nodes; i += kThreads) {
    const int n = (nm.node_of[d.rank] + i) % d.nodes;
    xf.push(comm, 0,
            transport::make_signal(static_cast<uint32_t>(nm.rank(n, d.me)), 0, kEntrySignal,
                                   dev::signal_value(launch.epoch, 1)));
  }
}

// Every rail peer (this rank's local index on the other nodes) has entered this launch (every
// thread; false when a wait gave up). Before a rank stages anything or puts into anyone: the
// rail peers' last launches waited for every put out of its staging (so no byte of it is still
// read, whatever region the next op lays where), and are done with their inbound regions.
__device__ __forceinline__ bool rail_entered(const dev::Launch& launch, const Dims& d,
                                             const NodeMap& nm) {
  bool ok = true;
  for (int i = threadIdx.x + 1; i < d.nodes; i += kThreads) {
    const int n = (nm.node_of[d.rank] + i) % d.nodes;
    ok = launch.wait_remote(nm.rank(n, d.me), kEntrySignal, 1) && ok;
  }
  return __syncthreads_and(ok) != 0;
}

// cross: channel c's share of the tokens bound for each other node, staged and put to the rail
// peer there (channel 0: the header first). False when a wait or a push gave up (every thread).
template <class Idx>
__device__ bool send_across(const dev::Launch& launch, const DeviceComm& comm, const Dims& d,
                            const NodeMap& nm, const NodeXfer& xf, const Idx* topk,
                            const __nv_bfloat16* x, const Workspace& ws, int c, int channels) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int el_n = d.experts_local, k = d.top_k, per = nm.per_node;
  const int me_node = nm.node_of[d.rank], me_local = d.me;
  const int64_t n16 = d.hidden / 8;
  const int32_t* totals = ws.at<int32_t>(d.me, ws.totals);
  const int32_t* pos = ws.at<int32_t>(d.me, ws.pos);
  const int32_t* send_slot = ws.at<int32_t>(d.me, ws.send_slot);
  int32_t* slot_route = ws.at<int32_t>(d.me, ws.slot_route);
  if (!rail_entered(launch, d, nm)) return false;
  for (int i = 1; i < d.nodes; ++i) {
    const int n = (me_node + i) % d.nodes;
    const int r = nm.rank(n, me_local);
    bool ok = true;
    uint8_t* region = xf.region(n);
    const uint64_t src_off = xf.region_offset(n), dst_off = xf.region_offset(d.nodes + me_node);
    const int32_t crossing = totals[d.experts + d.world + n];
    if (c == 0) {  // the header: what each rank of n gets from this rank, then the crossing rows
      int32_t* header = reinterpret_cast<int32_t*>(region);
      const int words = per * (el_n + 1);
      for (int w = threadIdx.x; w <= words; w += kThreads) {
        if (w == words) {
          header[w] = crossing;
          continue;
        }
        const int dst = nm.rank(n, w / (el_n + 1)), e = w % (el_n + 1);
        header[w] = e < el_n ? totals[dst * el_n + e] : totals[d.experts + dst];
      }
      __syncthreads();
      if (threadIdx.x == 0) {
        dev::fence_acq_rel_sys();
        ok = xf.push(comm, 0,
                     transport::make_put_signal(static_cast<uint32_t>(r), 0,
                                                static_cast<uint8_t>(xf.xfer_buffer), src_off,
                                                static_cast<uint8_t>(xf.xfer_buffer), dst_off,
                                                4 * static_cast<uint64_t>(words + 1), kCountsSignal,
                                                dev::signal_value(launch.epoch, 1)));
      }
    }
    int64_t lo, hi;
    share(crossing, c, channels, lo, hi);
    int32_t* meta = reinterpret_cast<int32_t*>(region + xf.meta_at);
    __nv_bfloat16* rows = reinterpret_cast<__nv_bfloat16*>(region + xf.rows_at);
    const int32_t* list =
        ws.at<int32_t>(d.me, ws.cross_list) + static_cast<int64_t>(n) * d.max_tokens;
    for (int64_t i = lo + warp; i < hi; i += kWarps) {
      const int32_t t = list[i];
      int4* const dst[1] = {reinterpret_cast<int4*>(rows + i * d.hidden)};
      copy_row(reinterpret_cast<const int4*>(x + static_cast<int64_t>(t) * d.hidden), dst, 1, n16,
               lane);
      // Per slot bound for node n: the global expert, its position, and the token's slot in the
      // send order to the expert's rank (route_scan wrote it at the token's first slot for it).
      int64_t e = -1;
      int key = -1 - lane;  // unique unless the slot is bound for node n
      if (lane < k) {
        const Idx v = topk[static_cast<int64_t>(t) * k + lane];
        if (valid_expert(v, d.experts) && nm.node_of_expert(v, el_n) == n) {
          e = static_cast<int64_t>(v);
          key = static_cast<int>(e / el_n);
        }
      }
      const unsigned same = __match_any_sync(~0u, key);
      const int first = __ffs(same) - 1;  // the token's first slot bound for that rank
      const int32_t my_slot = e >= 0 ? send_slot[static_cast<int64_t>(t) * k + lane] : -1;
      const int32_t slot = __shfl_sync(~0u, my_slot, first);
      int32_t* m = meta + i * xf.cross_ints;
      if (lane == 0) m[0] = t;
      if (lane < k) {
        m[1 + 3 * lane] = static_cast<int32_t>(e);
        m[2 + 3 * lane] = e >= 0 ? pos[static_cast<int64_t>(t) * k + lane] : -1;
        m[3 + 3 * lane] = e >= 0 ? slot : -1;
      }
      // Where the combine finds this slot's row when it comes back (route_scan set the others -1).
      if (e >= 0) {
        slot_route[static_cast<int64_t>(t) * k + lane] = static_cast<int32_t>(n * d.max_tokens + i);
      }
    }
    __syncthreads();
    if (threadIdx.x == 0 && ok) {
      dev::fence_acq_rel_sys();
      const uint32_t signal = kDataSignal0 + static_cast<uint32_t>(c);
      const uint64_t value = dev::signal_value(launch.epoch, 1);
      const auto buf = static_cast<uint8_t>(xf.xfer_buffer);
      if (hi > lo) {
        const uint64_t meta_row = 4 * static_cast<uint64_t>(xf.cross_ints);
        const uint64_t row = 2 * static_cast<uint64_t>(d.hidden);
        const auto rank = static_cast<uint32_t>(r);
        ok =
            xf.push(comm, c,
                    transport::make_put(
                        rank, static_cast<uint64_t>(c), buf, src_off + xf.meta_at + lo * meta_row,
                        buf, dst_off + xf.meta_at + lo * meta_row, (hi - lo) * meta_row, signal)) &&
            xf.push(comm, c,
                    transport::make_put_signal(
                        rank, static_cast<uint64_t>(c), buf, src_off + xf.rows_at + lo * row, buf,
                        dst_off + xf.rows_at + lo * row, (hi - lo) * row, signal, value));
      } else {
        ok = xf.push(comm, c,
                     transport::make_signal(static_cast<uint32_t>(r), static_cast<uint64_t>(c),
                                            signal, value));
      }
    }
    if (__syncthreads_and(ok) == 0) return false;
  }
  return true;
}

// relay: the rows of the rail peers of the other nodes, to this node's ranks. False when a wait
// gave up (every thread).
__device__ bool relay_across(const dev::Launch& launch, const DeviceComm& comm, const Dims& d,
                             const NodeMap& nm, const NodeXfer& xf, const Workspace& ws, int c,
                             int channels) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int el_n = d.experts_local, k = d.top_k, per = nm.per_node;
  const int me_node = nm.node_of[d.rank];
  const int64_t n16 = d.hidden / 8;
  const int words = per * (el_n + 1);
  // Every source's counts first (channel 0), into every local rank's count words as the source
  // would raise them: the node's placements wait for them, not for any source's rows.
  bool ok = true;
  for (int i = threadIdx.x + 1; i < d.nodes; i += kThreads) {
    const int m = (me_node + d.nodes - i) % d.nodes;
    ok = launch.wait_remote(nm.rank(m, d.me), kCountsSignal, 1) && ok;
  }
  if (__syncthreads_and(ok) == 0) return false;
  for (int i = 1; c == 0 && i < d.nodes; ++i) {
    const int m = (me_node + d.nodes - i) % d.nodes;
    const int s = nm.rank(m, d.me);
    const int32_t* header = reinterpret_cast<const int32_t*>(xf.region(d.nodes + m));
    for (int w = threadIdx.x; w < words; w += kThreads) {
      launch.signal_as(w / (el_n + 1), count_signal(w % (el_n + 1)), s,
                       static_cast<uint32_t>(__ldcg(header + w)));
    }
    // The crossing rows, for the combine after this dispatch (relay_back).
    if (threadIdx.x == 0) ws.at<int32_t>(d.me, ws.relay_rows)[m] = __ldcg(header + words);
  }
  for (int i = 1; i < d.nodes; ++i) {
    const int m = (me_node + d.nodes - i) % d.nodes;  // the node whose rows this rank relays
    const int s = nm.rank(m, d.me);
    const uint8_t* region = xf.region(d.nodes + m);
    const int32_t* header = reinterpret_cast<const int32_t*>(region);
    if (threadIdx.x == 0) ok = launch.wait_remote(s, kDataSignal0 + static_cast<uint32_t>(c), 1);
    if (__syncthreads_and(ok) == 0) return false;
    int64_t lo, hi;
    share(__ldcg(header + words), c, channels, lo, hi);
    const int32_t* meta = reinterpret_cast<const int32_t*>(region + xf.meta_at);
    const __nv_bfloat16* rows = reinterpret_cast<const __nv_bfloat16*>(region + xf.rows_at);
    const int64_t src_region = static_cast<int64_t>(s) * d.max_tokens;
    for (int64_t row = lo + warp; row < hi; row += kWarps) {
      const int32_t* m_in = meta + row * xf.cross_ints;
      const int32_t t = __ldcg(m_in);
      int32_t e = -1, p = -1, slot = -1;
      if (lane < k) {
        e = __ldcg(m_in + 1 + 3 * lane);
        p = __ldcg(m_in + 2 + 3 * lane);
        slot = __ldcg(m_in + 3 + 3 * lane);
      }
      const int dst = e >= 0 ? e / el_n : -1;
      const unsigned same = __match_any_sync(~0u, e >= 0 ? dst : -1 - lane);
      const bool lead = e >= 0 && __ffs(same) - 1 == lane;  // the first slot for its rank
      // To each destination rank once (its first slot's lane leads): the row, then the metadata
      // it gets - as s writes it: token; per slot, the local expert and position where the slot
      // is that rank's, else -1.
      unsigned leads = __ballot_sync(~0u, lead);
      while (leads != 0) {
        const int q = __ffs(leads) - 1;
        leads &= leads - 1;
        const int dq = __shfl_sync(~0u, dst, q);
        const int32_t sq = __shfl_sync(~0u, slot, q);
        int4* const to[1] = {reinterpret_cast<int4*>(
            ws.at<__nv_bfloat16>(nm.local_of[dq], ws.recv_x) + (src_region + sq) * d.hidden)};
        copy_row<1, true>(reinterpret_cast<const int4*>(rows + row * d.hidden), to, 1, n16, lane);
        int32_t* m_out =
            ws.at<int32_t>(nm.local_of[dq], ws.recv_meta) + (src_region + sq) * d.meta_ints;
        if (lane == 0) {
          m_out[0] = t;
          // The crossing index, for the combine's way back (the placement keeps it by row).
          ws.at<int32_t>(nm.local_of[dq], ws.recv_cross)[src_region + sq] =
              static_cast<int32_t>(row);
        }
        if (lane < k) {
          const bool mine = dst == dq;
          m_out[1 + 2 * lane] = mine ? e % el_n : -1;
          m_out[2 + 2 * lane] = mine ? p : -1;
        }
      }
    }
    __syncthreads();
    for (int l = threadIdx.x; l < per; l += kThreads) {
      dev::fence_acq_rel_sys();
      launch.signal_as(l, dev::signal_index(SignalId::kOp, c), s, 1);
    }
  }
  return true;
}

template <class Idx>
__global__ void __launch_bounds__(kThreads, 1)
    dispatch_kernel(DeviceComm comm, Dims d, NodeMap nm, NodeXfer xf, const Idx* topk,
                    const __nv_bfloat16* x, Workspace ws, __nv_bfloat16* out, int32_t* expert_rows,
                    int32_t* handle) {
  const dev::Launch launch = dev::Launch::begin(comm);
  const int c = blockIdx.x, channels = gridDim.x;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int el_n = d.experts_local, words = el_n + 1;
  // Every rank of the node has entered this launch: done with the last one's receive regions
  // and counts, and with what came before it on its stream (the workspace's first zeroing, say).
  if (!launch.channel_barrier_agreeing(SignalId::kEntry, c, d.signature)) {
    launch.end();
    return;
  }
  const bool across = d.nodes > 1;
  if (across && c == 0) announce_entry(launch, comm, d, nm, xf);
  bool ok = !across || send_across(launch, comm, d, nm, xf, topk, x, ws, c, channels);
  const int64_t n16 = d.hidden / 8;
  const int32_t* totals = ws.at<int32_t>(d.me, ws.totals);
  const int per = across ? nm.per_node : d.world;

  // ---- counts: to every destination on this node ----
  for (int64_t w = static_cast<int64_t>(c) * kThreads + threadIdx.x;
       ok && w < static_cast<int64_t>(per) * words;
       w += static_cast<int64_t>(channels) * kThreads) {
    const int l = static_cast<int>(w / words), i = static_cast<int>(w % words);
    const int dst = node_rank(d, nm, l);
    const int32_t n = i < el_n ? totals[dst * el_n + i] : totals[d.experts + dst];
    launch.signal(l, count_signal(i), static_cast<uint32_t>(n));
  }

  // ---- send: channel c's share of the rows for each destination on this node ----
  const int32_t* pos = ws.at<int32_t>(d.me, ws.pos);
  const int32_t* send_list = ws.at<int32_t>(d.me, ws.send_list);
  for (int i = 0; ok && i < per; ++i) {
    const int l = (d.me + 1 + i) % per;  // every rank starts with a different peer
    const int dst = node_rank(d, nm, l);
    int64_t lo, hi;
    share(totals[d.experts + dst], c, channels, lo, hi);
    const int64_t region = static_cast<int64_t>(d.rank) * d.max_tokens;
    __nv_bfloat16* rx = ws.at<__nv_bfloat16>(l, ws.recv_x) + region * d.hidden;
    int32_t* meta = ws.at<int32_t>(l, ws.recv_meta) + region * d.meta_ints;
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
      launch.signal(l, dev::signal_index(SignalId::kOp, c), 1);
    }
  }

  // ---- relay: the other nodes' rows for this node ----
  ok = ok && (!across || relay_across(launch, comm, d, nm, xf, ws, c, channels));

  // ---- place: the layout from every source's counts ----
  extern __shared__ int32_t s_cnt[];  // [world][words]: counts, then prefixes over sources
  int32_t* s_total = s_cnt + d.world * words;
  int32_t* s_start = s_total + el_n;  // [E_local + 1]
  ok = __syncthreads_and(ok && gather_counts(launch, comm, d, words, s_cnt)) != 0;
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
    // Every source's rows landed: channel c of a source on this node; every channel of the relay
    // of a source on another node (it shares the rows out differently).
    for (int w = threadIdx.x; w < d.world * channels; w += kThreads) {
      const int src = w / channels, cc = w % channels;
      if (on_my_node(d, nm, src) && cc != c) continue;
      ok = launch.wait(src, dev::signal_index(SignalId::kOp, cc), 1) && ok;
    }
    ok = __syncthreads_and(ok) != 0;
  }
  if (ok) {
    for (int src = 0; src < d.world; ++src) {
      int64_t lo, hi;
      // Rows src sent here (word el_n stayed a count: the prefixes cover the experts only).
      share(s_cnt[src * words + el_n], c, channels, lo, hi);
      const int64_t region = static_cast<int64_t>(src) * d.max_tokens;
      const __nv_bfloat16* rx = ws.at<__nv_bfloat16>(d.me, ws.recv_x) + region * d.hidden;
      const int32_t* meta = ws.at<int32_t>(d.me, ws.recv_meta) + region * d.meta_ints;
      const bool remote = !on_my_node(d, nm, src);  // its rows' crossing indices, by row
      const int32_t* recv_cross = ws.at<int32_t>(d.me, ws.recv_cross);
      int32_t* row_cross = ws.at<int32_t>(d.me, ws.row_cross);
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
          if (remote) row_cross[row] = recv_cross[region + slot];
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

}  // namespace mk::moe
