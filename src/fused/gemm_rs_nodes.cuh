// GEMM + ReduceScatter across nodes, as a Fusion policy of the GEMM engine (issue 8,
// docs/design/multinode.md section 3). The routes, regions and signals are those of
// fused/reduce_routes.h; this file is what a consumer warpgroup does with each slice:
//   kLocalPeer / kViaRelay: send the fp32 partial over NVLink into the target's region (vector
//     adds, or stores when the node has two ranks and so one sender per region), then raise its
//     signal there - deferred to the consumer's next epilogue, as in gemm_rs.cuh;
//   kRelayed: wait for the node's other partials, add them (and clear them for the next launch),
//     write the node sum into the staging region and push one put+signal command that carries it
//     into the owner's inbound region (host-pad signal), once the owner entered this launch;
//   kOwn: wait for the node's partials (device pad) and every other node's sum (host pad), add
//     them all to the own partial in fp32, store bf16.
// Reductions stay fp32 until the one rounding (node sums travel as fp32). Blocked order (no
// interleaving), no outbox, no ping-pong, no bf16 partials: the first version, correct before
// fast. Reuse across launches: local senders wait for the target's device "entered", a relay for
// the owner's host-pad "entered" before it overwrites its staging (the last launch's put has then
// been delivered) and sends.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "fused/partials.cuh"
#include "fused/reduce_routes.h"
#include "fused/trace.cuh"
#include "gemm/gemm_kernel.cuh"
#include "mkernel/device/launch.cuh"
#include "mkernel/device_comm.h"
#include "mkernel/transport/command.h"
#include "mkernel/transport/ring.h"

namespace mk::fused {

constexpr int kMaxReduceRings = 4;
constexpr int kMaxReduceBlockN = 128;  // wider tiles spill in these epilogues (gemm_rs.cu's plan)

template <int kBlockN>
struct GemmRsAcrossNodes {
  static constexpr int kProducerRegs = 56;
  static constexpr int kConsumerRegs = 224;
  CUtensorMap a;    // A_r as [world][S][K_r], boxes 128 x 64 x 1
  CUtensorMap out;  // this rank's output [S][N] bf16, boxes 64 x 64
  DeviceComm comm;
  float* ws_local[8];  // each local rank's workspace (routes.regions() x S x N fp32), mapped here
  float* my_ws;        // this rank's (local address)
  ReduceRoutes routes;
  transport::CommandRing rings[kMaxReduceRings];  // the communicator's inter-node rings
  int num_rings;
  int ws_buffer;       // the workspace allocation's registered id (puts' source and destination)
  uint64_t ws_offset;  // byte offset of the workspace in that allocation
  int shard_rows;      // S
  int n;
  gemm_engine::GroupedRaster raster;  // tiles of one shard
  uint64_t* trace;                    // timeline records (fused/trace.cuh), or null

  __device__ int num_tiles() const { return routes.world * raster.num_tiles(); }

  __device__ gemm_engine::Tile tile(int t) const {
    const int per_owner = raster.num_tiles();
    gemm_engine::Tile tile;
    tile.shard = routes.order[t / per_owner];
    raster.tile(t % per_owner, tile.m, tile.n);
    return tile;
  }

  __device__ void wait_operands(const gemm_engine::Tile&) const {}

  __device__ void load_a(void* dst, uint64_t* bar, const gemm_engine::Tile& tile, int k0) const {
    dev::tma_load_3d(dst, &a, bar, k0, tile.m * 128, tile.shard);
  }

  // ---- workspace ----
  __device__ int slices() const { return 2 * raster.num_tiles(); }
  __device__ int slice(const gemm_engine::Tile& tile, int half) const {
    return 2 * (tile.m * raster.tiles_n + tile.n) + half;
  }
  __device__ int64_t region_words() const { return static_cast<int64_t>(shard_rows) * n; }
  // A slice inside a region: one contiguous [h][w] block (gemm_rs.cuh's slice layout).
  __device__ int64_t slice_offset(int m, int tile_n, int half) const {
    const int row0 = m * 128 + half * 64;
    const int h = min(64, shard_rows - row0);
    return static_cast<int64_t>(row0) * n + static_cast<int64_t>(h) * tile_n * kBlockN;
  }
  __device__ int slice_width(int tile_n) const { return min(kBlockN, n - tile_n * kBlockN); }
  __device__ float* at(float* ws, int region, int64_t offset) const {
    return ws + region * region_words() + offset;
  }
  __device__ uint64_t byte_offset(int region, int64_t offset) const {
    return ws_offset + 4 * static_cast<uint64_t>(region * region_words() + offset);
  }

  struct ConsumerState {
    int owner_local = -1;  // a send whose signal is still owed (local index), or -1
    uint32_t signal = 0;
    uint32_t entered_local = 0;  // bit i: local rank i has entered this launch
    uint64_t entered_rail = 0;   // bit q: rail peer q has entered this launch
  };

  __device__ void init_shared() const { trace_init(); }

  template <int kRegs>
  __device__ void store(float (&acc)[kRegs], const gemm_engine::Tile& tile, int consumer,
                        uint8_t* scratch, ConsumerState& state) const {
    const dev::Launch launch = dev::Launch::begin(comm);
    const int t = threadIdx.x % 128;
    const int barrier = 1 + consumer;
    if (t == 0) flush(state, launch);
    const int half = gemm_engine::slice_half(tile, consumer);
    const int row0 = tile.m * 128 + half * 64, col0 = tile.n * kBlockN;
    const int rows = max(0, min(64, shard_rows - row0));
    const int width = slice_width(tile.n);
    const int s = slice(tile, half);
    const int64_t offset = slice_offset(tile.m, tile.n, half);
    const int owner = tile.shard;
    const int g = routes.per_node;
    switch (routes.kind(owner)) {
      case ReduceKind::kLocalPeer:
      case ReduceKind::kViaRelay: {
        const int dest = routes.target_local(owner);
        const int region = routes.target_region(owner);
        if (t == 0 && !((state.entered_local >> dest) & 1)) {
          launch.wait(comm.node_ranks[dest], dev::signal_index(SignalId::kEntry, 0), 1);
          state.entered_local |= 1u << dest;
        }
        if (rows == 0) return;  // below the shard: nothing to send, no signal
        float* block = at(ws_local[dest], region, offset);
        send_slice(
            acc, consumer, scratch, [&](int r, int c) { return block + r * width + c; }, rows,
            width, /*add=*/g > 2);
        if (t == 0) {
          state.owner_local = dest;
          state.signal =
              dev::signal_index(SignalId::kOp, ReduceRoutes::device_signal(region, slices(), s));
        }
        return;
      }
      case ReduceKind::kRelayed: {
        if (rows == 0) return;
        const int region = routes.target_region(owner);  // this rank's relay accumulator
        if (t == 0) {
          wait_local_partials(launch, region, s);
          if (!((state.entered_rail >> owner) & 1)) {  // its last launch got our last put
            launch.wait_remote(owner, kReduceEntrySignal, 1);
            state.entered_rail |= uint64_t{1} << owner;
          }
        }
        dev::named_barrier_sync(barrier, 128);
        if (g > 1) {
          float* sums = at(my_ws, region, offset);
          add_and_clear(acc, PartialAt::block(sums, width), rows, width, g > 2 ? sums : nullptr,
                        barrier);
        }
        const int staging = routes.staging_region(owner);
        float* out_block = at(my_ws, staging, offset);
        send_slice(
            acc, consumer, scratch, [&](int r, int c) { return out_block + r * width + c; }, rows,
            width, /*add=*/false);  // (ends with a barrier: every thread's stores done)
        if (t == 0) {
          dev::fence_acq_rel_sys();  // the staging writes, before the proxy reads them
          const transport::Command c = transport::make_put_signal(
              static_cast<uint32_t>(owner), static_cast<uint64_t>(s),
              static_cast<uint8_t>(ws_buffer), byte_offset(staging, offset),
              static_cast<uint8_t>(ws_buffer),
              byte_offset(routes.inbound_region_at_owner(owner), offset),
              static_cast<uint64_t>(rows) * width * 4, ReduceRoutes::host_signal(s),
              dev::signal_value(launch.epoch, 1));
          push(s, c);
        }
        return;
      }
      case ReduceKind::kOwn:
        break;
    }
    // Own rows: the node's partials, every other node's sum, then one rounding to bf16.
    if (t == 0 && rows > 0) {
      wait_local_partials(launch, 0, s);
      for (int m = 0; m < routes.nodes; ++m) {
        if (m != routes.node())
          launch.wait_remote(routes.rail_peer(m), ReduceRoutes::host_signal(s), 1);
      }
      trace_mark(trace, kTraceConsumer0 + consumer, kTraceWaited);
    }
    dev::named_barrier_sync(barrier, 128);
    if (rows > 0) {
      if (g > 1) {
        float* sums = at(my_ws, 0, offset);
        add_and_clear(acc, PartialAt::block(sums, width), rows, width, g > 2 ? sums : nullptr,
                      barrier);
      }
      for (int m = 0; m < routes.nodes; ++m) {
        if (m == routes.node()) continue;
        add_and_clear(acc, PartialAt::block(at(my_ws, routes.inbound_region(m), offset), width),
                      rows, width, nullptr, barrier);
      }
    }
    gemm_engine::store_slice(acc, col0, n, consumer, scratch, [&](const uint8_t* buf, int j) {
      dev::tma_store_2d(&out, buf, col0 + 64 * j, row0);
    });
  }

  // Thread 0 of a consumer: every other rank of the node raised slice s of `region` here.
  __device__ void wait_local_partials(const dev::Launch& launch, int region, int s) const {
    const uint32_t signal =
        dev::signal_index(SignalId::kOp, ReduceRoutes::device_signal(region, slices(), s));
    for (int i = 0; i < routes.per_node; ++i) {
      if (i != routes.local() && !launch.wait(comm.node_ranks[i], signal, 1)) break;
    }
  }

  // Pushes a command into ring `k` mod the rings (false: the ring broke or the time limit passed;
  // the proxy or the waits then report).
  __device__ bool push(int k, const transport::Command& c) const {
    const uint64_t start = dev::global_timer_ns();
    const uint64_t limit = comm.timeout_ns;
    return rings[k % num_rings]
               .push(c,
                     [&](uint64_t) { return limit == 0 || dev::global_timer_ns() - start < limit; })
               .status == transport::PushStatus::kOk;
  }

  // Thread 0 of a consumer: the previous send has landed -> raise its signal at the target.
  __device__ void flush(ConsumerState& state, const dev::Launch& launch) const {
    if (state.owner_local < 0) return;
    dev::fence_acq_rel_sys();  // after the warpgroup's stores (send_slice ends with a barrier)
    launch.signal(state.owner_local, state.signal, 1);
    state.owner_local = -1;
  }

  __device__ void consumer_done(ConsumerState& state) const {
    if (threadIdx.x % 128 == 0) {
      flush(state, dev::Launch::begin(comm));
      trace_mark(trace, kTraceConsumer0 + threadIdx.x / 128 - 1, kTraceDone);
    }
  }

  // Producer warps 1..3 of CTA 0: announce this launch to the node (device pad) and to the rail
  // peers (a signal command each: host pad signal 0).
  __device__ void side_task(int thread, int threads) const {
    if (blockIdx.x != 0) return;
    const dev::Launch launch = dev::Launch::begin(comm);
    for (int peer = thread; peer < comm.local_size; peer += threads) {
      if (peer != comm.local_rank) launch.signal(peer, dev::signal_index(SignalId::kEntry, 0), 1);
    }
    for (int m = thread; m < routes.nodes; m += threads) {
      if (m == routes.node()) continue;
      push(m, transport::make_signal(static_cast<uint32_t>(routes.rail_peer(m)), 0,
                                     kReduceEntrySignal, dev::signal_value(launch.epoch, 1)));
    }
  }

  __device__ void finish() const { dev::Launch::begin(comm).end(); }
};

}  // namespace mk::fused
