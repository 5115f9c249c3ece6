// GEMM + ReduceScatter across nodes, as a Fusion policy of the GEMM engine
// (docs/design/multinode.md section 3), on the across-node reducing kernels' common part
// (fused/across_nodes.cuh). The routes, regions and signals are those of fused/reduce_routes.h;
// a consumer warpgroup does with each slice:
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
// rounded once more per node. Blocked order (no interleaving), no outbox: the first version,
// correct before fast. Reuse across launches: local senders wait for the target's device
// "entered", a relay for the owner's host-pad "entered" before it overwrites its staging (the last
// launch's put has then been delivered) and sends.
#pragma once

#include <cstdint>

#include "fused/across_nodes.cuh"
#include "gemm/gemm_kernel.cuh"
#include "mkernel/device/launch.cuh"

namespace mk::fused {

template <int kBlockN>
struct GemmRsAcrossNodes : NodeReducingFusion<GemmRsAcrossNodes<kBlockN>, kBlockN> {
  CUtensorMap a;       // A_r as [world][S][K_r], boxes 128 x 64 x 1
  CUtensorMap a_last;  // `a` again, boxes of a shard's last tile-row's rows (a_rows)
  CUtensorMap out;     // this rank's output [S][N] bf16, boxes 64 x 64
  int shard_rows;      // S
  int n;
  gemm_engine::GroupedRaster raster;  // tiles of one shard
  using NodeReducingFusion<GemmRsAcrossNodes<kBlockN>, kBlockN>::comm;
  using NodeReducingFusion<GemmRsAcrossNodes<kBlockN>, kBlockN>::links;

  // Owners in the rail routes' order, each owner's rows in the grouped raster.
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

  // ---- workspace: regions of S x N fp32, each slice one contiguous [h][w] block ----
  __device__ int rows() const { return shard_rows; }
  __device__ int slices() const { return 2 * raster.num_tiles(); }
  __device__ int slice(const gemm_engine::Tile& tile, int half) const {
    return 2 * (tile.m * raster.tiles_n + tile.n) + half;
  }
  __device__ int64_t region_words() const { return static_cast<int64_t>(shard_rows) * n; }
  // gemm_rs.cuh's slice layout: bands of 64 rows, the tiles' slices one after the other.
  __device__ int64_t slice_offset(const gemm_engine::Tile& tile, int half) const {
    const int row0 = tile.m * 128 + half * 64;
    const int h = min(64, shard_rows - row0);
    return static_cast<int64_t>(row0) * n + static_cast<int64_t>(h) * tile.n * kBlockN;
  }
  __device__ int slice_width(const gemm_engine::Tile& tile) const {
    return min(kBlockN, n - tile.n * kBlockN);
  }

  // Own rows: the node's partials and every other node's sum are in; one rounding to bf16.
  template <int kRegs>
  __device__ void finish_own(float (&acc)[kRegs], const gemm_engine::Tile& tile, int consumer,
                             uint8_t* scratch, ReduceState&, const dev::Launch&, int64_t, int, int,
                             int) const {
    const int row0 = tile.m * 128 + consumer * 64, col0 = tile.n * kBlockN;
    gemm_engine::store_slice(acc, col0, n, consumer, scratch, [&](const uint8_t* buf, int j) {
      dev::tma_store_2d(&out, buf, col0 + 64 * j, row0);
    });
  }

  // Producer warps 1..3 of CTA 0: announce this launch to the node and to the rail peers.
  __device__ void side_task(int thread, int threads) const {
    if (blockIdx.x == 0) links.announce(comm, dev::Launch::begin(comm), thread, threads);
  }

  __device__ void finish() const { dev::Launch::begin(comm).end(); }
};
static_assert(gemm_engine::check_fusion<gemm_engine::TileConfig<64>, GemmRsAcrossNodes<64>>() &&
              gemm_engine::check_fusion<gemm_engine::TileConfig<128>, GemmRsAcrossNodes<128>>());

}  // namespace mk::fused
