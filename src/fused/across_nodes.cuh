// What the reducing fused GEMMs share across nodes (gemm_rs_nodes.cuh, gemm_ar_nodes.cuh): the
// links to the other nodes (routes, the inter-node rings, the registered workspace), the three
// epilogue steps both make - a partial sent over NVLink into a node peer's region, a relay's
// node sum put to its owner, an owner's sum of everything - and NodeReducingFusion, their common
// part as a base (CRTP): the epilogue's route switch, the consumers' bookkeeping (ReduceState,
// fused/reducing.cuh), the hooks written once. The steps take the policy, which says where a
// slice lives: at(ws, region, offset) for the node's regions (below routes.nodes),
// region_words() for the transfer regions (what crosses the network: staging and inbound;
// NodeLinks::xfer_at / xfer_byte), my_ws, ws_local[] and comm.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "fused/partials.cuh"
#include "fused/reduce_routes.h"
#include "fused/reducing.cuh"
#include "fused/trace.cuh"
#include "gemm/gemm_kernel.cuh"
#include "mkernel/device/launch.cuh"
#include "mkernel/device/push.cuh"
#include "mkernel/device_comm.h"
#include "mkernel/transport/command.h"
#include "mkernel/transport/ring.h"

namespace mk::fused {

constexpr int kMaxReduceRings = 4;

using dev::load_l2;  // (mkernel/device/sync.cuh)

// A kernel argument: the routes and the communicator's inter-node path as this launch uses it.
struct NodeLinks {
  ReduceRoutes routes;
  transport::CommandRing rings[kMaxReduceRings];
  int num_rings;
  // The transfer regions (region routes.nodes on, one after the other), what the network
  // carries: in the workspace after the node's regions (InterNode::host_staging() false), or in
  // this rank's pinned host staging, mapped here (true: the transport then makes no CUDA call).
  uint8_t* xfer;         // region routes.nodes, as this rank addresses it
  int xfer_buffer;       // the registered id of the buffer holding them (puts' source and dest)
  uint64_t xfer_offset;  // byte offset of region routes.nodes in that buffer, on every rank
  // bf16 on the wire (FusedGemmConfig::bf16_partials): the node sums always, the node's partials
  // where one sender writes a region (two ranks per node). A bf16 slice [rows][width] sits where
  // the fp32 slice would start, in the first half of its footprint.
  bool bf16_sums;
  bool bf16_local;

  // Transfer region `region` (routes.nodes or later; regions of `region_words` fp32 words): the
  // word at `offset` in it as this rank addresses it, and its byte offset in the registered buffer.
  __device__ float* xfer_at(int region, int64_t region_words, int64_t offset) const {
    return reinterpret_cast<float*>(xfer) + (region - routes.nodes) * region_words + offset;
  }
  __device__ uint64_t xfer_byte(int region, int64_t region_words, int64_t offset) const {
    return xfer_offset + 4 * static_cast<uint64_t>((region - routes.nodes) * region_words + offset);
  }

  // Pushes a command into ring `k` mod the rings (false: the ring broke or the time limit passed;
  // the proxy or the waits then report).
  __device__ bool push(const DeviceComm& comm, int k, const transport::Command& c) const {
    return dev::push_command(comm, rings[k % num_rings], c);
  }

  // Producer warps of CTA 0: this launch has begun - the device pad's entry signal to the node's
  // other ranks, a signal command (host pad signal 0) to each rail peer.
  __device__ void announce(const DeviceComm& comm, const dev::Launch& launch, int thread,
                           int threads) const {
    for (int peer = thread; peer < comm.local_size; peer += threads) {
      if (peer != comm.local_rank) launch.signal(peer, dev::signal_index(SignalId::kEntry, 0), 1);
    }
    for (int m = thread; m < routes.nodes; m += threads) {
      if (m == routes.node()) continue;
      push(comm, m,
           transport::make_signal(static_cast<uint32_t>(routes.rail_peer(m)), 0, kReduceEntrySignal,
                                  dev::signal_value(launch.epoch, 1)));
    }
  }

  // Thread 0 of a consumer: every other rank of the node raised op signal `signal` here.
  __device__ void wait_local(const DeviceComm& comm, const dev::Launch& launch,
                             uint32_t signal) const {
    for (int i = 0; i < routes.per_node; ++i) {
      if (i != routes.local() && !launch.wait(comm.node_ranks[i], signal, 1)) break;
    }
  }
};

// A slice of `width` columns at `p` for add_and_clear: fp32 [rows][width], or with `bf16` bf16
// [rows][width] read as pairs (add_and_clear's bf16 mode).
__device__ __forceinline__ PartialAt slice_at(float* p, int width, bool bf16) {
  return PartialAt::block(p, bf16 ? width / 2 : width);
}

// kLocalPeer / kViaRelay: the slice's partial over NVLink into the target's region (fp32 added
// with more than two ranks per node, else stored - as bf16 with links.bf16_local), its signal
// owed to the consumer's next epilogue. All 128 threads of the consumer.
template <class Policy, int kRegs>
__device__ __forceinline__ void send_to_node_peer(const Policy& p, float (&acc)[kRegs],
                                                  int consumer, uint8_t* scratch,
                                                  ReduceState& state, const dev::Launch& launch,
                                                  int owner, int64_t offset, int rows, int width,
                                                  int slice, int slices) {
  const ReduceRoutes& routes = p.links.routes;
  const int dest = routes.target_local(owner);
  const int region = routes.target_region(owner);
  if (threadIdx.x % 128 == 0) state.ensure_entered(launch, dest, p.comm.node_ranks[dest]);
  float* block = p.at(p.ws_local[dest], region, offset);
  if (p.links.bf16_local) {
    send_slice_bf16(acc, consumer, scratch, reinterpret_cast<__nv_bfloat16*>(block), width, rows,
                    width);
  } else {
    send_slice(
        acc, consumer, scratch, [&](int r, int c) { return block + r * width + c; }, rows, width,
        /*add=*/routes.per_node > 2);
  }
  if (threadIdx.x % 128 == 0) {
    state.owe(dest,
              dev::signal_index(SignalId::kOp, ReduceRoutes::device_signal(region, slices, slice)));
  }
}

// kRelayed: wait for the node's other partials of the slice, add them (clearing them for the next
// launch when they were added), write the node sum (fp32, or bf16 with links.bf16_sums) into the
// staging region, and put it into the owner's inbound region (put+signal, host pad 1 + slice)
// once the owner entered.
template <class Policy, int kRegs>
__device__ __forceinline__ void relay_node_sum(const Policy& p, float (&acc)[kRegs], int consumer,
                                               uint8_t* scratch, ReduceState& state,
                                               const dev::Launch& launch, int owner, int64_t offset,
                                               int rows, int width, int slice, int slices) {
  const ReduceRoutes& routes = p.links.routes;
  const int t = threadIdx.x % 128, barrier = 1 + consumer;
  const int region = routes.target_region(owner);  // this rank's relay accumulator
  if (t == 0) {
    p.links.wait_local(
        p.comm, launch,
        dev::signal_index(SignalId::kOp, ReduceRoutes::device_signal(region, slices, slice)));
    state.ensure_rail(launch, owner);  // its last launch has read our last node sum
  }
  dev::named_barrier_sync(barrier, 128);
  if (routes.per_node > 1) {
    float* sums = p.at(p.my_ws, region, offset);
    add_and_clear(acc, slice_at(sums, width, p.links.bf16_local), rows, width,
                  routes.per_node > 2 ? sums : nullptr, barrier, p.links.bf16_local);
  }
  const int staging = routes.staging_region(owner);
  float* out_block = p.links.xfer_at(staging, p.region_words(), offset);
  // (Both end with a barrier: every thread's stores are done.)
  if (p.links.bf16_sums) {
    send_slice_bf16(acc, consumer, scratch, reinterpret_cast<__nv_bfloat16*>(out_block), width,
                    rows, width);
  } else {
    send_slice(
        acc, consumer, scratch, [&](int r, int c) { return out_block + r * width + c; }, rows,
        width, /*add=*/false);
  }
  if (t == 0) {
    dev::fence_acq_rel_sys();  // the staging writes, before the proxy reads them
    const auto buffer = static_cast<uint8_t>(p.links.xfer_buffer);
    p.links.push(
        p.comm, slice,
        transport::make_put_signal(
            static_cast<uint32_t>(owner), static_cast<uint64_t>(slice), buffer,
            p.links.xfer_byte(staging, p.region_words(), offset), buffer,
            p.links.xfer_byte(routes.inbound_region_at_owner(owner), p.region_words(), offset),
            static_cast<uint64_t>(rows) * width * (p.links.bf16_sums ? 2 : 4),
            ReduceRoutes::host_signal(slice), dev::signal_value(launch.epoch, 1)));
  }
}

// kOwn, first part: thread 0 waits for the node's partials (op signal of region 0) and every
// other node's sum (host pad); then all threads add them (the node's cleared when added).
template <class Policy, int kRegs>
__device__ __forceinline__ void add_node_sums(const Policy& p, float (&acc)[kRegs], int consumer,
                                              const dev::Launch& launch, int64_t offset, int rows,
                                              int width, int slice, int slices) {
  const ReduceRoutes& routes = p.links.routes;
  const int t = threadIdx.x % 128, barrier = 1 + consumer;
  if (t == 0) {
    p.links.wait_local(
        p.comm, launch,
        dev::signal_index(SignalId::kOp, ReduceRoutes::device_signal(0, slices, slice)));
    for (int m = 0; m < routes.nodes; ++m) {
      if (m != routes.node())
        launch.wait_remote(routes.rail_peer(m), ReduceRoutes::host_signal(slice), 1);
    }
  }
  dev::named_barrier_sync(barrier, 128);
  if (routes.per_node > 1) {
    float* sums = p.at(p.my_ws, 0, offset);
    add_and_clear(acc, slice_at(sums, width, p.links.bf16_local), rows, width,
                  routes.per_node > 2 ? sums : nullptr, barrier, p.links.bf16_local);
  }
  for (int m = 0; m < routes.nodes; ++m) {
    if (m == routes.node()) continue;
    add_and_clear(acc,
                  slice_at(p.links.xfer_at(routes.inbound_region(m), p.region_words(), offset),
                           width, p.links.bf16_sums),
                  rows, width, nullptr, barrier, p.links.bf16_sums);
  }
}

// The across-node reducing policies' common part. A policy derives from
// NodeReducingFusion<Policy, kBlockN> and provides, besides the engine's scheduler hooks
// (num_tiles, tile, wait_operands, a_rows, load_a), side_task() and finish():
//   rows()                 rows of the output a tile-row indexes (S, or M)
//   slice_width(tile), slice(tile, half), slices(), slice_offset(tile, half), region_words()
//                          its slices' numbering and place in a region
//   finish_own(acc, tile, consumer, scratch, state, launch, offset, rows, width, slice)
//                          an own slice once every partial and node sum is in `acc`: store it
template <class Policy, int kBlockN>
struct NodeReducingFusion {
  static constexpr gemm_engine::FusionTraits kTraits{
      .a_rows = true, .init_shared = true, .producer_regs = 56, .consumer_regs = 224};
  using ConsumerState = ReduceState;

  DeviceComm comm;
  float* ws_local[8];  // each local rank's workspace, mapped here
  float* my_ws;        // this rank's (local address)
  NodeLinks links;     // routes, inter-node rings, the registered workspace
  uint64_t* trace;     // timeline records (fused/trace.cuh), or null

  __device__ const Policy& self() const { return static_cast<const Policy&>(*this); }

  __device__ void init_shared() const { trace_init(); }

  // The node's regions (below routes.nodes) in a workspace (the transfer regions: NodeLinks).
  __device__ float* at(float* ws, int region, int64_t offset) const {
    return ws + region * self().region_words() + offset;
  }

  // A slice by its route (reduce_routes.h): to a node peer's region, a relay's node sum over the
  // network, or an own slice's sum of everything.
  template <int kRegs>
  __device__ void store(float (&acc)[kRegs], const gemm_engine::Tile& tile, int consumer,
                        uint8_t* scratch, ReduceState& state) const {
    const dev::Launch launch = dev::Launch::begin(comm);
    if (threadIdx.x % 128 == 0) state.flush(launch);
    const int rows = max(0, min(64, self().rows() - (tile.m * 128 + consumer * 64)));
    if (rows == 0) return;  // below the output: nothing to send, wait for or store
    const int width = self().slice_width(tile);
    const int s = self().slice(tile, consumer);
    const int64_t offset = self().slice_offset(tile, consumer);
    switch (links.routes.kind(tile.shard)) {
      case ReduceKind::kLocalPeer:
      case ReduceKind::kViaRelay:
        send_to_node_peer(self(), acc, consumer, scratch, state, launch, tile.shard, offset, rows,
                          width, s, self().slices());
        return;
      case ReduceKind::kRelayed:
        relay_node_sum(self(), acc, consumer, scratch, state, launch, tile.shard, offset, rows,
                       width, s, self().slices());
        return;
      case ReduceKind::kOwn:
        break;
    }
    add_node_sums(self(), acc, consumer, launch, offset, rows, width, s, self().slices());
    if (threadIdx.x % 128 == 0) trace_mark(trace, kTraceConsumer0 + consumer, kTraceAdded);
    self().finish_own(acc, tile, consumer, scratch, state, launch, offset, rows, width, s);
  }

  __device__ void consumer_done(ReduceState& state) const {
    if (threadIdx.x % 128 == 0) {
      state.flush(dev::Launch::begin(comm));
      trace_mark(trace, kTraceConsumer0 + threadIdx.x / 128 - 1, kTraceDone);
    }
  }
};

}  // namespace mk::fused
