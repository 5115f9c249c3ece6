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
// Reductions stay fp32 until the one rounding; node sums travel as fp32, or with bf16_partials
// as bf16 (and the node's partials too at two ranks per node: NodeLinks::bf16_sums / bf16_local),
// rounded once more per node. Blocked order (no interleaving), no outbox, no ping-pong: the first
// version, correct before fast. Reuse across launches: local senders wait for the target's device
// "entered", a relay for the owner's host-pad "entered" before it overwrites its staging (the last
// launch's put has then been delivered) and sends.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "fused/across_nodes.cuh"
#include "fused/partials.cuh"
#include "fused/reduce_routes.h"
#include "fused/trace.cuh"
#include "gemm/gemm_kernel.cuh"
#include "mkernel/device/launch.cuh"
#include "mkernel/device_comm.h"

namespace mk::fused {

template <int kBlockN>
struct GemmRsAcrossNodes {
  static constexpr int kProducerRegs = 56;
  static constexpr int kConsumerRegs = 224;
  CUtensorMap a;    // A_r as [world][S][K_r], boxes 128 x 64 x 1
  CUtensorMap a_last;  // `a` again, boxes of a shard's last tile-row's rows (a_rows)
  CUtensorMap out;  // this rank's output [S][N] bf16, boxes 64 x 64
  DeviceComm comm;
  float* ws_local[8];  // each local rank's workspace (routes.regions() x S x N fp32), mapped here
  float* my_ws;        // this rank's (local address)
  NodeLinks links;     // routes, inter-node rings, the registered workspace
  int shard_rows;      // S
  int n;
  gemm_engine::GroupedRaster raster;  // tiles of one shard
  uint64_t* trace;                    // timeline records (fused/trace.cuh), or null

  __device__ int num_tiles() const { return links.routes.world * raster.num_tiles(); }

  __device__ gemm_engine::Tile tile(int t) const {
    const int per_owner = raster.num_tiles();
    gemm_engine::Tile tile;
    tile.shard = links.routes.order[t / per_owner];
    raster.tile(t % per_owner, tile.m, tile.n);
    return tile;
  }

  __device__ void wait_operands(const gemm_engine::Tile&) const {}

  __device__ int a_rows(const gemm_engine::Tile& tile) const {
    return tile.m == raster.tiles_m - 1 ? gemm_engine::last_tile_rows(shard_rows) : 128;
  }
  __device__ void load_a(void* dst, uint64_t* bar, const gemm_engine::Tile& tile, int k0) const {
    dev::tma_load_3d(dst, tile.m == raster.tiles_m - 1 ? &a_last : &a, bar, k0, tile.m * 128,
                     tile.shard);
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
  // The node's regions (below routes.nodes) in a workspace (the transfer regions: NodeLinks).
  __device__ float* at(float* ws, int region, int64_t offset) const {
    return ws + region * region_words() + offset;
  }

  using ConsumerState = NodePeersState;

  __device__ void init_shared() const { trace_init(); }

  template <int kRegs>
  __device__ void store(float (&acc)[kRegs], const gemm_engine::Tile& tile, int consumer,
                        uint8_t* scratch, ConsumerState& state) const {
    const dev::Launch launch = dev::Launch::begin(comm);
    if (threadIdx.x % 128 == 0) state.flush(launch);
    const int half = gemm_engine::slice_half(tile, consumer);
    const int row0 = tile.m * 128 + half * 64, col0 = tile.n * kBlockN;
    const int rows = max(0, min(64, shard_rows - row0));
    if (rows == 0) return;  // below the shard: nothing to send, wait for or store
    const int width = slice_width(tile.n);
    const int s = slice(tile, half);
    const int64_t offset = slice_offset(tile.m, tile.n, half);
    switch (links.routes.kind(tile.shard)) {
      case ReduceKind::kLocalPeer:
      case ReduceKind::kViaRelay:
        send_to_node_peer(*this, acc, consumer, scratch, state, launch, tile.shard, offset, rows,
                          width, s, slices());
        return;
      case ReduceKind::kRelayed:
        relay_node_sum(*this, acc, consumer, scratch, state, launch, tile.shard, offset, rows,
                       width, s, slices());
        return;
      case ReduceKind::kOwn:
        break;
    }
    // Own rows: the node's partials, every other node's sum, then one rounding to bf16.
    add_node_sums(*this, acc, consumer, launch, offset, rows, width, s, slices());
    if (threadIdx.x % 128 == 0) trace_mark(trace, kTraceConsumer0 + consumer, kTraceAdded);
    gemm_engine::store_slice(acc, col0, n, consumer, scratch, [&](const uint8_t* buf, int j) {
      dev::tma_store_2d(&out, buf, col0 + 64 * j, row0);
    });
  }

  __device__ void consumer_done(ConsumerState& state) const {
    if (threadIdx.x % 128 == 0) {
      state.flush(dev::Launch::begin(comm));
      trace_mark(trace, kTraceConsumer0 + threadIdx.x / 128 - 1, kTraceDone);
    }
  }

  // Producer warps 1..3 of CTA 0: announce this launch to the node and to the rail peers.
  __device__ void side_task(int thread, int threads) const {
    if (blockIdx.x == 0) links.announce(comm, dev::Launch::begin(comm), thread, threads);
  }

  __device__ void finish() const { dev::Launch::begin(comm).end(); }
};

}  // namespace mk::fused
