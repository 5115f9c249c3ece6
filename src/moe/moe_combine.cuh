// moe_combine's kernel, on one node and across nodes (mkernel/moe.h, docs/design/moe.md).
//
// Persistent, one CTA per channel. Phases of channel c:
//   entry   the node's ranks meet (channel barrier); across nodes CTA 0 also announces the launch
//           to this rank's rail peers (host-pad kEntrySignal)
//   send    channel c's share of the layout's rows: a row whose source is on this node goes to
//           the source's combine slot [token][slot] with a presence flag (this launch's epoch);
//           a row from a source s on another node m goes to s's relay on this node (the rank
//           with s's local index) - into its relay_y[m] at the row's crossing index x top_k +
//           slot (the dispatch's placement kept the index by row), with a flag; then kOp + c to
//           every rank of the node
//   relay   (across nodes) once every rank of the node has sent (all channels) and every rail
//           peer has entered this launch: for each other node m and its source s = (m, my local
//           index), channel c's share of s's crossing rows (the count the dispatch kept:
//           relay_rows) - their top_k slots each, rows and flags - staged and put into s's inbound
//           combine region for this node (host-pad kDataSignal0 + c)
//   reduce  every rank of the node, every channel; every relay on the other nodes, every channel:
//           per token, the present slots in slot order (a slot bound for another node is read
//           where its relay put it: the dispatch's slot_route), w * y summed in fp32, rounded once
// The sum is the one-node sum bit for bit, whatever path a slot took. Across nodes the combine
// reads what its moe_dispatch left in the workspace (the crossing indices, the rows relayed per
// node): no other dispatch on that workspace in between (mkernel/moe.h). Nothing is read from
// the transfer regions across launches (other ops reuse them).
//
// Reuse: rows land in a rank of the node only after it entered this launch (the entry barrier);
// a relay stages and puts only after every rail peer entered this launch (rail_entered in
// moe_dispatch.cuh: they are done reading their inbound regions, and every put out of its
// staging has landed).
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "mkernel/device/launch.cuh"
#include "mkernel/device_comm.h"
#include "mkernel/transport/command.h"
#include "moe/moe_dispatch.cuh"
#include "moe/moe_kernels.cuh"

namespace mk::moe {

// relay: the rows of this node's ranks for the sources of the other nodes whose rail peer this
// rank is, staged and put back to them. False when a wait or a push gave up (every thread).
__device__ bool relay_back(const dev::Launch& launch, const DeviceComm& comm, const Dims& d,
                           const NodeMap& nm, const NodeXfer& xf, const Workspace& ws, int c,
                           int channels) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int k = d.top_k;
  const int me_node = nm.node_of[d.rank];
  const int64_t n16 = d.hidden / 8, slots = d.max_tokens * k;
  if (!rail_entered(launch, d, nm)) return false;
  for (int i = 1; i < d.nodes; ++i) {
    const int m = (me_node + i) % d.nodes;
    const int s = nm.rank(m, d.me);
    bool ok = true;
    int64_t lo, hi;  // of s's crossing rows, as the dispatch counted them (relay_rows)
    share(ws.at<int32_t>(d.me, ws.relay_rows)[m], c, channels, lo, hi);
    lo *= k;
    hi *= k;
    const __nv_bfloat16* from = ws.at<__nv_bfloat16>(d.me, ws.relay_y) + m * slots * d.hidden;
    const uint32_t* from_flags = ws.at<uint32_t>(d.me, ws.relay_flag) + m * slots;
    uint8_t* region = xf.comb_region(m);
    uint32_t* flags = reinterpret_cast<uint32_t*>(region);
    __nv_bfloat16* rows = reinterpret_cast<__nv_bfloat16*>(region + xf.comb_rows_at);
    for (int64_t q = lo + threadIdx.x; q < hi; q += kThreads) flags[q] = __ldcg(from_flags + q);
    for (int64_t q = lo + warp; q < hi; q += kWarps) {
      int4* const to[1] = {reinterpret_cast<int4*>(rows + q * d.hidden)};
      copy_row<1, true>(reinterpret_cast<const int4*>(from + q * d.hidden), to, 1, n16, lane);
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      dev::fence_acq_rel_sys();
      const uint32_t signal = kDataSignal0 + static_cast<uint32_t>(c);
      const uint64_t value = dev::signal_value(launch.epoch, 1);
      const auto buf = static_cast<uint8_t>(xf.xfer_buffer);
      const auto rank = static_cast<uint32_t>(s);
      const uint64_t src_off = xf.comb_offset(m), dst_off = xf.comb_offset(d.nodes + me_node);
      if (hi > lo) {
        const uint64_t row = 2 * static_cast<uint64_t>(d.hidden);
        ok =
            xf.push(comm, c,
                    transport::make_put(rank, static_cast<uint64_t>(c), buf, src_off + 4 * lo, buf,
                                        dst_off + 4 * lo, 4 * (hi - lo), signal)) &&
            xf.push(comm, c,
                    transport::make_put_signal(
                        rank, static_cast<uint64_t>(c), buf, src_off + xf.comb_rows_at + lo * row,
                        buf, dst_off + xf.comb_rows_at + lo * row, (hi - lo) * row, signal, value));
      } else {
        ok =
            xf.push(comm, c, transport::make_signal(rank, static_cast<uint64_t>(c), signal, value));
      }
    }
    if (__syncthreads_and(ok) == 0) return false;
  }
  return true;
}

__global__ void __launch_bounds__(kThreads, 1)
    combine_kernel(DeviceComm comm, Dims d, NodeMap nm, NodeXfer xf, const __nv_bfloat16* y,
                   const float* weights, const int32_t* handle, Workspace ws, __nv_bfloat16* out) {
  const dev::Launch launch = dev::Launch::begin(comm);
  const int c = blockIdx.x, channels = gridDim.x;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t n16 = d.hidden / 8, slots = d.max_tokens * d.top_k;
  const uint32_t mark = static_cast<uint32_t>(launch.epoch);
  const bool across = d.nodes > 1;
  const int per = across ? nm.per_node : d.world;
  // Every rank of the node has entered: done reading the last combine's rows from its buffers.
  if (!launch.channel_barrier_agreeing(SignalId::kEntry, c, d.signature)) {
    launch.end();
    return;
  }
  if (across && c == 0) announce_entry(launch, comm, d, nm, xf);

  // ---- send: channel c's rows of the layout back towards their sources ----
  int64_t lo, hi;
  share(d.rows, c, channels, lo, hi);
  const int32_t* row_cross = ws.at<int32_t>(d.me, ws.row_cross);
  for (int64_t r = lo + warp; r < hi; r += kWarps) {
    const int32_t src = handle[r * 3];
    if (src < 0) continue;
    const int64_t t = handle[r * 3 + 1], j = handle[r * 3 + 2];
    // A row pointing outside this call's problem (a handle of another dispatch) goes nowhere: a
    // write there would land anywhere in a peer's workspace. Recorded, and not combined.
    if (src >= d.world || t < 0 || t >= d.max_tokens || j < 0 || j >= d.top_k) {
      if (lane == 0) {
        const int field = src >= d.world ? 0 : t < 0 || t >= d.max_tokens ? 1 : 2;
        const int64_t bound = field == 0 ? d.world : field == 1 ? d.max_tokens : d.top_k;
        const int64_t value = field == 0 ? src : field == 1 ? t : j;
        dev::record_data_error(comm, launch.epoch, DeviceErrorCode::kBadHandle,
                               static_cast<int32_t>(r), static_cast<uint32_t>(field),
                               static_cast<uint64_t>(bound), static_cast<uint64_t>(value));
      }
      continue;
    }
    __nv_bfloat16* to;
    uint32_t* flag;
    if (on_my_node(d, nm, src)) {
      const int l = local_of(d, nm, src);
      to = ws.at<__nv_bfloat16>(l, ws.comb_x) + (t * d.top_k + j) * d.hidden;
      flag = ws.at<uint32_t>(l, ws.comb_flag) + t * d.top_k + j;
    } else {  // to its relay here: the rank with its local index
      const int l = nm.local_of[src];
      const int64_t at = nm.node_of[src] * slots + row_cross[r] * d.top_k + j;
      to = ws.at<__nv_bfloat16>(l, ws.relay_y) + at * d.hidden;
      flag = ws.at<uint32_t>(l, ws.relay_flag) + at;
    }
    int4* const rows[1] = {reinterpret_cast<int4*>(to)};
    copy_row(reinterpret_cast<const int4*>(y + r * d.hidden), rows, 1, n16, lane);
    if (lane == 0) *flag = mark;
  }
  __syncthreads();
  for (int l = threadIdx.x; l < per; l += kThreads) {
    dev::fence_acq_rel_sys();
    launch.signal(l, dev::signal_index(SignalId::kOp, c), 1);
  }

  // ---- every rank of the node has sent (the relay's input and the local slots) ----
  bool ok = true;
  for (int w = threadIdx.x; w < per * channels; w += kThreads) {
    const int l = w / channels;
    ok = launch.wait(node_rank(d, nm, l), dev::signal_index(SignalId::kOp, w % channels), 1) && ok;
  }
  ok = __syncthreads_and(ok) != 0;

  // ---- relay: this node's rows for the other nodes' sources, back to them ----
  ok = ok && (!across || relay_back(launch, comm, d, nm, xf, ws, c, channels));

  // ---- reduce: the other nodes' relays have put this rank's rows ----
  if (ok && across) {
    for (int w = threadIdx.x; w < (d.nodes - 1) * channels; w += kThreads) {
      const int n = (nm.node_of[d.rank] + 1 + w / channels) % d.nodes;
      ok = launch.wait_remote(nm.rank(n, d.me), kDataSignal0 + static_cast<uint32_t>(w % channels),
                              1) &&
           ok;
    }
    ok = __syncthreads_and(ok) != 0;
  }
  if (ok) {
    const __nv_bfloat16* rows = ws.at<__nv_bfloat16>(d.me, ws.comb_x);
    const uint32_t* flags = ws.at<uint32_t>(d.me, ws.comb_flag);
    const int32_t* slot_route = ws.at<int32_t>(d.me, ws.slot_route);
    share(d.tokens, c, channels, lo, hi);
    for (int64_t t = lo + warp; t < hi; t += kWarps) {
      float w = 0.f;
      bool present = false, remote = false;
      const __nv_bfloat16* from = nullptr;  // this lane's slot's row
      if (lane < d.top_k) {
        const int64_t p = t * d.top_k + lane;
        const int32_t route = across ? slot_route[p] : -1;
        if (route < 0) {
          present = flags[p] == mark;
          from = rows + p * d.hidden;
        } else {  // put here by its relay on node route / max_tokens
          const int64_t n = route / d.max_tokens, i = route % d.max_tokens;
          const uint8_t* region = xf.comb_region(d.nodes + static_cast<int>(n));
          const int64_t q = i * d.top_k + lane;
          remote = true;
          present = __ldcg(reinterpret_cast<const unsigned int*>(region) + q) == mark;
          from = reinterpret_cast<const __nv_bfloat16*>(region + xf.comb_rows_at) + q * d.hidden;
        }
        w = weights[p];
      }
      const unsigned present_slots = __ballot_sync(~0u, present);
      const unsigned remote_slots = __ballot_sync(~0u, remote);
      float wj[kMoeMaxTopK];  // every slot's weight in every lane (before lanes part ways)
      const int4* src[kMoeMaxTopK];
#pragma unroll
      for (int j = 0; j < kMoeMaxTopK; ++j) {
        wj[j] = __shfl_sync(~0u, w, j);
        src[j] = reinterpret_cast<const int4*>(
            __shfl_sync(~0u, reinterpret_cast<unsigned long long>(from), j));
      }
      for (int64_t i = lane; i < n16; i += 32) {
        float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
#pragma unroll
        for (int j = 0; j < kMoeMaxTopK; ++j) {
          if (j >= d.top_k) break;
          if ((present_slots >> j & 1u) == 0) continue;
          int4 v;
          if ((remote_slots >> j & 1u) != 0) {  // landed while the kernel ran: through L2
            const uint4 u = dev::load_l2(src[j] + i);
            v = make_int4(static_cast<int>(u.x), static_cast<int>(u.y), static_cast<int>(u.z),
                          static_cast<int>(u.w));
          } else {
            v = src[j][i];
          }
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
