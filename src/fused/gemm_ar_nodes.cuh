// GEMM + AllReduce across nodes, as a Fusion policy of the GEMM engine (docs/design/multinode.md
// section 3), on the across-node reducing kernels' common part (fused/across_nodes.cuh). Ownership
// as in the one-node kernel (gemm_ar.cuh): rank o owns column tiles [o * T / w, (o + 1) * T / w) of
// all M rows, so any M works. The reduce is gemm_rs_nodes.cuh's, per owner's column block instead
// of per owner's rows (reduce_routes.h):
//   kLocalPeer / kViaRelay: the fp32 partial over NVLink into the target's region;
//   kRelayed: the node's partials added to its own, the node sum put into the owner's inbound;
//   kOwn: the node's partials and every node's sum added, rounded to bf16 once, stored into C
//     here (TMA) and into the node's other ranks' C (NVLink stores), and written once more,
//     contiguous, into the final-staging region, from where one put+signal per other node
//     carries it into that node's rail peer's final-inbound region.
// Side threads of every CTA: each finished slice that arrives in a final-inbound region (owners
// on other nodes with this rank's local index) is copied into this rank's C and the node's. The
// exit barrier (the same CTA of every local rank) then covers every write into C, as on one node;
// one owner rounds each element, so every rank gets the same bits.
// Workspace regions of M x (the widest owner's columns) fp32 words: reduce_routes.h's 3N - 2,
// then the final staging (bf16, in the first half of each slice's words) and N - 1 final-inbound
// ones. Host-pad signals: node sums 1 + s, finished slices 1 + slices + s. Reuse across launches:
// as gemm_rs_nodes.cuh, and an owner puts a finished slice only after the rail peer entered.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "fused/across_nodes.cuh"
#include "fused/reduce_routes.h"
#include "gemm/gemm_kernel.cuh"
#include "mkernel/device/launch.cuh"

namespace mk::fused {

template <int kBlockN>
struct GemmArAcrossNodes : NodeReducingFusion<GemmArAcrossNodes<kBlockN>, kBlockN> {
  using NodeReducingFusion<GemmArAcrossNodes<kBlockN>, kBlockN>::comm;
  using NodeReducingFusion<GemmArAcrossNodes<kBlockN>, kBlockN>::links;
  __nv_bfloat16* c_local[8];  // each local rank's C, mapped here
  int m;
  int n;
  int tiles_m;
  int tiles_n;
  int max_cols;        // elements: the widest owner's columns (the regions' row length)
  int num_slices;      // 2 x tiles_m x the most column tiles an owner has (signal numbering)
  CUtensorMap a;       // A_r [M, K_r], boxes 128 x 64
  CUtensorMap a_last;  // A_r again, boxes of the last tile-row's rows (a_rows)
  CUtensorMap out;     // this rank's C [M, N] bf16, boxes 64 x 64

  // ---- ownership and order ----
  __device__ int first_col_tile(int owner) const { return owner * tiles_n / links.routes.world; }
  __device__ int col_tiles(int owner) const {
    return first_col_tile(owner + 1) - first_col_tile(owner);
  }
  __device__ int num_tiles() const { return tiles_m * tiles_n; }
  // Tile k of owner's column block (GroupedRaster order), as a Tile of the whole C.
  __device__ gemm_engine::Tile owner_tile(int owner, int k) const {
    gemm_engine::Tile tile{0, 0, owner};
    gemm_engine::GroupedRaster{tiles_m, col_tiles(owner)}.tile(k, tile.m, tile.n);
    tile.n += first_col_tile(owner);
    return tile;
  }

  __device__ gemm_engine::Tile tile(int t) const {
    int owner = links.routes.order[0];
    for (int step = 0; step < links.routes.world; ++step) {  // owners in routes.order, blocked
      owner = links.routes.order[step];
      const int count = tiles_m * col_tiles(owner);
      if (t < count) break;
      t -= count;
    }
    return owner_tile(owner, t);
  }

  __device__ void wait_operands(const gemm_engine::Tile&) const {}

  __device__ int a_rows(const gemm_engine::Tile& tile) const {
    return tile.m == tiles_m - 1 ? gemm_engine::last_tile_rows(m) : 128;
  }
  __device__ void load_a(void* dst, uint64_t* bar, const gemm_engine::Tile& tile, int k0) const {
    dev::tma_load_2d(dst, tile.m == tiles_m - 1 ? &a_last : &a, bar, k0, tile.m * 128);
  }

  // ---- workspace ----
  __device__ int rows() const { return m; }
  __device__ int slices() const { return num_slices; }
  __device__ int slice(const gemm_engine::Tile& tile, int half) const {
    return 2 * (tile.m * col_tiles(tile.shard) + (tile.n - first_col_tile(tile.shard))) + half;
  }
  __device__ int64_t region_words() const { return static_cast<int64_t>(m) * max_cols; }
  // A slice in a region: one contiguous [h][w] block (bands of 64 rows, the owner's tiles' slices
  // one after the other inside a band).
  __device__ int64_t slice_offset(const gemm_engine::Tile& tile, int half) const {
    const int row0 = tile.m * 128 + half * 64;
    const int h = min(64, m - row0);
    return static_cast<int64_t>(row0) * max_cols +
           static_cast<int64_t>(h) * (tile.n - first_col_tile(tile.shard)) * kBlockN;
  }
  __device__ int slice_width(const gemm_engine::Tile& tile) const {
    return min(kBlockN, n - tile.n * kBlockN);
  }
  __device__ int final_staging_region() const { return links.routes.regions(); }
  // The final-inbound region, at a rank of node `at_node`, for slices from node `from_node`.
  __device__ int final_inbound_region(int at_node, int from_node) const {
    return links.routes.regions() + 1 + links.routes.rel(at_node, from_node);
  }
  __device__ uint32_t final_signal(int s) const {
    return ReduceRoutes::host_signal(num_slices + s);
  }

  // An own slice once every partial and node sum is in: one rounding, then C here (TMA), in the
  // node's other ranks (NVLink stores) and, contiguous, in the final-staging region, from where one
  // put+signal per other node carries it into that node's rail peer's final-inbound region.
  template <int kRegs>
  __device__ void finish_own(float (&acc)[kRegs], const gemm_engine::Tile& tile, int consumer,
                             uint8_t* scratch, ReduceState& state, const dev::Launch& launch,
                             int64_t offset, int rows, int width, int s) const {
    const ReduceRoutes& routes = links.routes;
    const int t = threadIdx.x % 128;
    const int row0 = tile.m * 128 + consumer * 64, col0 = tile.n * kBlockN;
    if (t == 0) {  // the node's C and the rail peers' final-inbound regions may be written
      for (int i = 0; i < routes.per_node; ++i) {
        if (i != routes.local()) state.ensure_entered(launch, i, comm.node_ranks[i]);
      }
      for (int mm = 0; mm < routes.nodes; ++mm) {
        if (mm != routes.node()) state.ensure_rail(launch, routes.rail_peer(mm));
      }
    }
    dev::named_barrier_sync(1 + consumer, 128);
    // C here by TMA; the node's other C and the final-staging slice (bf16 [rows][width],
    // contiguous) by every thread's 16-byte units of each packed chunk.
    __nv_bfloat16* staged = reinterpret_cast<__nv_bfloat16*>(
        links.xfer_at(final_staging_region(), region_words(), offset));
    const int my_row = t / 2, my_half = t % 2;  // the half row (32 columns) this thread moves
    gemm_engine::store_slice(
        acc, col0, n, consumer, scratch,
        [&](const uint8_t* buf, int j) { dev::tma_store_2d(&out, buf, col0 + 64 * j, row0); },
        [&](const uint8_t* buf, int j) {
          const int col = 64 * j + 32 * my_half;  // within the slice
          if (my_row >= rows || col >= width) return;
          const int64_t c_offset = static_cast<int64_t>(row0 + my_row) * n + col0 + col;
#pragma unroll
          for (int u = 0; u < 4; ++u) {
            if (col + 8 * u >= width) break;
            const int unit = 4 * my_half + u;
            const uint4 v =
                *reinterpret_cast<const uint4*>(buf + my_row * 128 + ((unit ^ (my_row % 8)) * 16));
            for (int i = 0; i < routes.per_node; ++i) {
              if (i != routes.local()) *reinterpret_cast<uint4*>(c_local[i] + c_offset + 8 * u) = v;
            }
            *reinterpret_cast<uint4*>(staged + my_row * width + col + 8 * u) = v;
          }
        });
    dev::named_barrier_sync(1 + consumer, 128);  // every thread's staging writes, before the puts
    if (t == 0) {
      dev::fence_acq_rel_sys();
      const auto buffer = static_cast<uint8_t>(links.xfer_buffer);
      for (int mm = 0; mm < routes.nodes; ++mm) {
        if (mm == routes.node()) continue;
        links.push(
            comm, s + mm,
            transport::make_put_signal(
                static_cast<uint32_t>(routes.rail_peer(mm)), static_cast<uint64_t>(s), buffer,
                links.xfer_byte(final_staging_region(), region_words(), offset), buffer,
                links.xfer_byte(final_inbound_region(mm, routes.node()), region_words(), offset),
                static_cast<uint64_t>(rows) * width * 2, final_signal(s),
                dev::signal_value(launch.epoch, 1)));
      }
    }
  }

  // Producer warps 1..3: CTA 0 announces the launch; then every CTA relays its share of the
  // finished slices that arrive from the other nodes' owners with this rank's local index into C
  // here and in the node's other ranks.
  __device__ void side_task(int thread, int threads) const {
    const dev::Launch launch = dev::Launch::begin(comm);
    const ReduceRoutes& routes = links.routes;
    if (blockIdx.x == 0) links.announce(comm, launch, thread, threads);
    constexpr int kSideBarrier = 3;
    ReduceState entered;  // thread 0's
    int unit = 0;         // (other node, owner's tile, half), in the owners' tile order
    for (int mm = 0; mm < routes.nodes; ++mm) {
      if (mm == routes.node()) continue;
      const int owner = routes.rail_peer(mm);
      const int count = 2 * tiles_m * col_tiles(owner);
      for (int k = 0; k < count; ++k, ++unit) {
        if (unit % static_cast<int>(gridDim.x) != static_cast<int>(blockIdx.x)) continue;
        const gemm_engine::Tile tile = owner_tile(owner, k / 2);
        const int half = k % 2;
        const int row0 = tile.m * 128 + half * 64;
        const int rows = min(64, m - row0);
        if (rows <= 0) continue;
        const int width = slice_width(tile);
        bool failed = false;
        if (thread == 0) {
          failed = !launch.wait_remote(owner, final_signal(slice(tile, half)), 1);
          for (int i = 0; i < routes.per_node; ++i) {
            if (i != routes.local()) entered.ensure_entered(launch, i, comm.node_ranks[i]);
          }
          dev::fence_acq_rel_sys();
        }
        if (dev::named_barrier_or(kSideBarrier, threads, failed)) return;
        const __nv_bfloat16* src = reinterpret_cast<const __nv_bfloat16*>(links.xfer_at(
            final_inbound_region(routes.node(), mm), region_words(), slice_offset(tile, half)));
        const int units_per_row = width / 8;  // 16-byte units (width is a multiple of 8)
        const int col0 = tile.n * kBlockN;
        for (int v = thread; v < rows * units_per_row; v += threads) {
          const int r = v / units_per_row, c = 8 * (v % units_per_row);
          const uint4 x = load_l2(src + r * width + c);
          const int64_t c_offset = static_cast<int64_t>(row0 + r) * n + col0 + c;
          for (int i = 0; i < routes.per_node; ++i) {
            *reinterpret_cast<uint4*>(c_local[i] + c_offset) = x;
          }
        }
      }
    }
  }

  // Every thread: meet the same CTA of every local rank (every write into C has landed), end.
  __device__ void finish() const {
    const dev::Launch launch = dev::Launch::begin(comm);
    launch.channel_barrier(SignalId::kExit, blockIdx.x, 1);
    launch.end();
  }
};
static_assert(gemm_engine::check_fusion<gemm_engine::TileConfig<64>, GemmArAcrossNodes<64>>() &&
              gemm_engine::check_fusion<gemm_engine::TileConfig<128>, GemmArAcrossNodes<128>>());

}  // namespace mk::fused
