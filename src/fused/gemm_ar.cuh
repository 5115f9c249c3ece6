// GEMM + AllReduce as a Fusion policy of the GEMM engine (src/gemm/gemm_kernel.cuh), on the
// reducing kernels' common part (fused/reducing.cuh): this file is its layout - column tiles
// owned by ranks, the two-rank accumulator half in C, the outbox behind the accumulator - and
// its own tiles' finish (the result into every rank's C).
//
// Every rank holds A_r [M, K_r] and B_r; every rank ends with C = sum_r A_r B_r^T, [M, N] bf16,
// bitwise identical everywhere. The output's tile columns are split among the ranks: rank o owns
// column tiles [first(o), first(o + 1)) for all M rows, so each rank reads its B once and any M
// (1 included) spreads the reduction over all ranks. Rank r computes the tiles the others own
// first, in the order r + 1, r + 2, ..., and its own last:
//   - a tile owned by o != r: its fp32 slice goes to o's accumulator (plain stores with two
//     ranks, red.add otherwise; partials.cuh), then o's op signal (deferred to the next epilogue);
//     with two ranks and bf16_partials (FusedGemmConfig, opt-in) the slice goes as bf16 - as the
//     sequential baseline's NCCL sums bf16 partials - straight into its own footprint in o's C;
//   - a tile r owns: wait for the peers' signals of the slice, add the accumulated sums, zero
//     them, round to bf16 once, store into C here (TMA) and into every peer's C (coalesced
//     16-byte stores over NVLink): one owner rounds each element, so all ranks get the same bits.
// C must be symmetric memory (peers write into it); the workspace is this rank's accumulator
// (slice_at): M x (its columns) bf16-sized with two ranks, fp32 with more - at most the sequential
// [M, N] bf16 intermediate whenever a tile width allows it (N >= 128; the plan picks one). Reuse: a
// peer writes into o's accumulator or C only after o entered the launch. Before a CTA ends it meets
// the same CTA of every rank (exit barrier): when a rank's kernel is done, every push into its C
// has landed.
// Outbox (partials.cuh), when its staging slots fit behind the accumulator (the plan decides):
// the remote slices are staged locally and sent by the producer warpgroup's side threads, and an
// owned slice, once stored into C here by TMA, is copied from there to the peers' C by the side
// threads too - the consumers never wait for NVLink. Without it the epilogue does both itself.
// With two ranks and fp32 partials (tma_partials) the producer thread waits for the peer's
// signals of a whole own tile and TMA-loads its partials (both parts: C and workspace) into the
// stage ring behind the tile's k-blocks; the epilogue adds them from shared memory.
// Two ranks (tma_sends): an own tile's bf16 result leaves for the peer's C by a TMA store of each
// packed chunk beside its local one - with or without an outbox; and with the ring's views
// (tma_partials) a peer's whole slice that has no outbox (small M) or whose staging slot is busy
// goes chunk by chunk from the scratch buffers (stage_chunks) through the same views of the
// peer's buffers. The issuing thread waits for its stores to land before it signals (halfway
// through its next tile, mid_tile) and before the exit barrier.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "fused/partials.cuh"
#include "fused/reducing.cuh"
#include "gemm/gemm_kernel.cuh"
#include "mkernel/device/launch.cuh"

namespace mk::fused {

template <int kBlockN>
struct GemmArFusion : ReducingFusion<GemmArFusion<kBlockN>, kBlockN> {
  using Base = ReducingFusion<GemmArFusion<kBlockN>, kBlockN>;
  using Base::accum_peers;
  using Base::bf16_partials;
  using Base::comm;
  using Base::order;
  using Base::single_peer;
  using Base::tma_partials;
  using Base::tma_sends;
  CUtensorMap a;                 // A_r [M, K_r], boxes 128 x 64
  CUtensorMap a_last;            // A_r again, boxes of the last tile-row's rows x 64 (a_rows)
  CUtensorMap out;               // this rank's C [M, N] bf16, boxes 64 x 64
  CUtensorMap partials_c;        // tma_partials: C as fp32 [M][N / 2], boxes 64 x 32
  CUtensorMap partials_ws;       // tma_partials: the accumulator as fp32 [..][kBlockN / 2], 64 x 32
  CUtensorMap peer_out;          // tma_sends: the peer's C, as `out`
  CUtensorMap peer_partials_c;   // tma_sends and tma_partials: the peer's C as fp32 (partials_c)
  CUtensorMap peer_partials_ws;  // tma_sends and tma_partials: its accumulator (partials_ws)
  __nv_bfloat16* out_peers[kMaxLocalRanks];  // each local rank's C, mapped here
  int m;
  int n;
  int tiles_m;
  int tiles_n;
  float* staging;  // this rank's outbox slots, [CTA][consumer][slot][slot_floats]; or null
  int64_t slot_floats;
  int slots;  // outbox slots per consumer, when staging is set

  // ---- scheduler and operands ----
  __device__ int first_col_tile(int owner) const { return owner * tiles_n / comm.world_size; }
  __device__ int owned_cols(int owner) const {  // in elements
    return min(first_col_tile(owner + 1) * kBlockN, n) - first_col_tile(owner) * kBlockN;
  }

  __device__ int num_tiles() const { return tiles_m * tiles_n; }

  __device__ gemm_engine::Tile tile(int t) const {
    const int world = comm.world_size;
    if (order.lag >= 0) {  // interleaved (the column tiles split evenly: P the same for all)
      int step = 0, index = 0;
      order.at(t, step, index);
      const int owner = (comm.rank + step) % world;
      gemm_engine::Tile tile{0, 0, owner};
      gemm_engine::GroupedRaster{tiles_m, tiles_n / world}.tile(index, tile.m, tile.n);
      tile.n += first_col_tile(owner);
      return tile;
    }
    int owner = comm.rank;
    for (int q = 1; q <= world; ++q) {  // owners r + 1, ..., r - 1, then r
      owner = (comm.rank + q) % world;
      const int count = tiles_m * (first_col_tile(owner + 1) - first_col_tile(owner));
      if (t < count) break;
      t -= count;
    }
    gemm_engine::Tile tile{0, 0, owner};
    const int cols = first_col_tile(owner + 1) - first_col_tile(owner);
    gemm_engine::GroupedRaster{tiles_m, cols}.tile(t, tile.m, tile.n);
    tile.n += first_col_tile(owner);
    return tile;
  }

  __device__ void wait_operands(const gemm_engine::Tile&) const {}

  // (A box inside the matrix: decode's M < 128 loads its rows alone - gemm_kernel.cuh)
  __device__ bool last_row(const gemm_engine::Tile& tile) const { return tile.m == tiles_m - 1; }
  __device__ int a_rows(const gemm_engine::Tile& tile) const {
    return last_row(tile) ? gemm_engine::last_tile_rows(m) : 128;
  }
  __device__ void load_a(void* dst, uint64_t* bar, const gemm_engine::Tile& tile, int k0) const {
    dev::tma_load_2d(dst, last_row(tile) ? &a_last : &a, bar, k0, tile.m * 128);
  }

  // ---- layout ----
  __device__ int rows() const { return m; }

  // The accumulator of owner o, slice by slice. Three or more ranks: fp32 in o's workspace, bands
  // of 64 rows (the last may be shorter) of its columns, each band its tiles' slices one after the
  // other, each slice [h][w] row-major. Two ranks (one partial per slice, stored): the slice's
  // first w / 2 columns as fp32 in o's C, over the slice's own bf16 footprint there (o overwrites
  // it with the result after reading it), the rest in the workspace, laid out as above with
  // half-width slices - so the workspace is M x (o's columns) bf16-sized, never more than the
  // sequential [M, N] bf16 intermediate.
  // With bf16 partials: the whole slice in its own footprint in o's C, as words (bf16 pairs).
  __device__ PartialAt slice_at(const gemm_engine::Tile& tile, int half) const {
    const int owner = tile.shard;  // one node: global rank = local rank
    const int row0 = tile.m * 128 + half * 64;
    if (bf16_partials) {
      float* c = reinterpret_cast<float*>(out_peers[owner] + static_cast<int64_t>(row0) * n +
                                          tile.n * kBlockN);
      return PartialAt::block(c, n / 2);  // rows n bf16 apart
    }
    const int h = min(64, m - row0), width = slice_width(tile);
    const int64_t offset = static_cast<int64_t>(row0) * owned_cols(owner) +
                           static_cast<int64_t>(h) * (tile.n - first_col_tile(owner)) * kBlockN;
    PartialAt at{};
    at.split = single_peer ? width / 2 : 0;
    at.second_stride = width - at.split;
    at.second = accum_peers[owner] + (single_peer ? offset / 2 : offset);
    at.first_stride = n / 2;
    at.first = reinterpret_cast<float*>(out_peers[owner] + static_cast<int64_t>(row0) * n +
                                        tile.n * kBlockN);
    return at;
  }
  __device__ int slice_width(const gemm_engine::Tile& tile) const {
    return min(kBlockN, n - tile.n * kBlockN);
  }
  // A slice's width in the 32-bit words it travels in (bf16 partials: two columns a word).
  __device__ int words(int width) const { return bf16_partials ? width / 2 : width; }
  __device__ uint32_t slot(const gemm_engine::Tile& tile, int half) const {
    const int cols = first_col_tile(tile.shard + 1) - first_col_tile(tile.shard);
    const int index = tile.m * cols + (tile.n - first_col_tile(tile.shard));
    return dev::signal_index(SignalId::kOp, 2 * index + half);
  }

  // This rank's accumulator slice of an own tile (rows 0: below C).
  __device__ PartialAt own_slice(const gemm_engine::Tile& tile, int half, int& rows,
                                 int& width) const {
    rows = max(0, min(64, m - (tile.m * 128 + half * 64)));
    width = words(slice_width(tile));
    return slice_at(tile, half);
  }

  // The views of a two-rank slice for the ring and the TMA sends: its first kBlockN / 2 columns
  // lie in C (boxes of the `partials_c` view), the rest in a half-width slice of the workspace
  // that starts at a multiple of kBlockN / 2 floats (the plan checks 64 N % kBlockN == 0): 64
  // rows of the `partials_ws` view, from `ws_row`.
  static constexpr int kBoxesInC = kBlockN / 64;
  __device__ int ws_row(const gemm_engine::Tile& tile, int half) const {
    return static_cast<int>((slice_at(tile, half).second - accum_peers[tile.shard]) /
                            (kBlockN / 2));
  }
  __device__ void load_partial_box(void* dst, uint64_t* bar, const gemm_engine::Tile& tile,
                                   int half, int box) const {
    if (box < kBoxesInC) {
      dev::tma_load_2d(dst, &partials_c, bar, tile.n * (kBlockN / 2) + 32 * box,
                       tile.m * 128 + half * 64);
    } else {
      dev::tma_load_2d(dst, &partials_ws, bar, 32 * (box - kBoxesInC), ws_row(tile, half));
    }
  }
  __device__ bool tma_sends_slices() const { return tma_sends && tma_partials; }
  __device__ void store_tma_chunk(const gemm_engine::Tile& tile, int half, const uint8_t* buf,
                                  int j) const {
    if (j < kBoxesInC) {
      dev::tma_store_2d(&peer_partials_c, buf, tile.n * (kBlockN / 2) + 32 * j,
                        tile.m * 128 + half * 64);
    } else {
      dev::tma_store_2d(&peer_partials_ws, buf, 32 * (j - kBoxesInC), ws_row(tile, half));
    }
  }

  // ---- Outbox: slots behind the accumulator ----
  __device__ void prepare_shared() const {}
  __device__ int outbox_slots() const { return staging == nullptr ? 0 : slots; }
  // This consumer's staging slots.
  __device__ float* my_staging(int consumer) const {
    return staging + (static_cast<int64_t>(blockIdx.x) * 2 + consumer) * slots * slot_floats;
  }
  // Broadcast items: local rank peer's C minus this rank's (same offset, other mapping), floats.
  __device__ int64_t peer_shift(int peer) const {
    return static_cast<int64_t>(reinterpret_cast<uintptr_t>(out_peers[peer]) -
                                reinterpret_cast<uintptr_t>(out_peers[comm.local_rank])) /
           4;
  }

  // ---- A peer's tile ----
  // Staged in the consumer's next slot (plain stores: its slots are contiguous blocks) and posted.
  template <int kRegs>
  __device__ void post_to_outbox(float (&acc)[kRegs], const gemm_engine::Tile& tile, int half,
                                 uint8_t*, ReduceState& state) const {
    const int width = slice_width(tile);
    OutboxItem item{};
    item.src = PartialAt::block(my_staging(half) + state.outbox.slot() * slot_floats, words(width));
    item.at = slice_at(tile, half);
    item.rows = max(0, min(64, m - (tile.m * 128 + half * 64)));
    item.width = words(width);
    item.owner = tile.shard;
    item.signal = slot(tile, half);
    outbox_post(acc, half, state.outbox, item, bf16_partials, this->trace);
  }
  // The epilogue's own stores (no outbox): bf16 into the slice's footprint in the owner's C, or
  // fp32 stored (two ranks) or added where slice_at says.
  template <int kRegs>
  __device__ void send_direct(float (&acc)[kRegs], const gemm_engine::Tile& tile, int half,
                              uint8_t* scratch, int rows) const {
    const int width = slice_width(tile);
    if (bf16_partials) {
      send_slice_bf16(acc, half, scratch,
                      out_peers[tile.shard] + static_cast<int64_t>(tile.m * 128 + half * 64) * n +
                          tile.n * kBlockN,
                      n, rows, width);
    } else {
      send_slice(acc, half, scratch, slice_at(tile, half), rows, width, !single_peer);
    }
  }

  // ---- An own tile: the peers' sums, one rounding, then C here and in every peer ----
  template <int kRegs>
  __device__ void finish_own(float (&acc)[kRegs], const gemm_engine::Tile& tile, int consumer,
                             uint8_t* scratch, ReduceState& state,
                             const gemm_engine::EpilogueRing& ring,
                             const dev::Launch& launch) const {
    const int t = threadIdx.x % 128;
    const int row0 = tile.m * 128 + consumer * 64, col0 = tile.n * kBlockN;
    const int rows = min(64, m - row0);
    if (rows <= 0) return;  // the slice lies below C (the last tile-row is partial)
    // (The peers' words in C are read before store_slice's first barrier - by the TMA loads of
    // the ring, or by every thread's adds - and the result overwrites them only after it.)
    this->add_peer_sums(acc, tile, consumer, ring, launch);
    if (t == 0 && (staging == nullptr || tma_sends)) {  // we write into the peers' C ourselves
      for (int p = 0; p < comm.local_size; ++p) {       // (else the side threads make sure)
        if (p != comm.local_rank) state.ensure_entered(launch, p, p);
      }
    }
    if (tma_sends) {  // each chunk to C here and to the peer's C (waited for at the end)
      gemm_engine::store_slice(acc, col0, n, consumer, scratch, [&](const uint8_t* buf, int j) {
        dev::tma_store_2d(&out, buf, col0 + 64 * j, row0);
        dev::tma_store_2d(&peer_out, buf, col0 + 64 * j, row0);
      });
      return;
    }
    if (staging != nullptr) {  // C here by TMA; the side threads copy it to the peers' C
      gemm_engine::store_slice(acc, col0, n, consumer, scratch, [&](const uint8_t* buf, int j) {
        dev::tma_store_2d(&out, buf, col0 + 64 * j, row0);
      });
      if (t == 0) {  // the issuing thread: the stores have landed, visible to generic loads
        dev::bulk_stores_landed();
        float* here = reinterpret_cast<float*>(out_peers[comm.local_rank] +
                                               static_cast<int64_t>(row0) * n + col0);
        OutboxItem item{};
        item.src = {here, n / 2, here, n / 2, 1 << 30};  // rows of C, two bf16 values a word
        item.at = item.src;
        item.rows = rows;
        item.width = slice_width(tile) / 2;
        item.owner = -1;  // to every peer
        outbox_post_ready(consumer, item);
      }
      return;
    }
    const int my_row = t / 2, my_half = t % 2;  // the half row this thread pushes to the peers
    gemm_engine::store_slice(
        acc, col0, n, consumer, scratch,
        [&](const uint8_t* buf, int j) { dev::tma_store_2d(&out, buf, col0 + 64 * j, row0); },
        [&](const uint8_t* buf, int j) {
          // Every thread: its 64 bytes of the packed 64 x 64 bf16 chunk, to every peer's C.
          const int col = col0 + 64 * j + 32 * my_half;
          if (my_row >= rows || col >= n) return;
          const int64_t offset = static_cast<int64_t>(row0 + my_row) * n + col;
#pragma unroll
          for (int u = 0; u < 4; ++u) {
            if (col + 8 * u >= n) break;
            const int unit = 4 * my_half + u;  // 16-byte unit of the 128-byte row
            const uint4 v =
                *reinterpret_cast<const uint4*>(buf + my_row * 128 + ((unit ^ (my_row % 8)) * 16));
            for (int p = 0; p < comm.local_size; ++p) {
              if (p != comm.local_rank)
                *reinterpret_cast<uint4*>(out_peers[p] + offset + 8 * u) = v;
            }
          }
        });
  }

  // Every thread: meet the same CTA of every rank (all pushes into C have landed), then end.
  __device__ void finish() const {
    const dev::Launch launch = dev::Launch::begin(comm);
    launch.channel_barrier(SignalId::kExit, blockIdx.x, 1);
    launch.end();
  }
};
static_assert(gemm_engine::check_fusion_widths<GemmArFusion>());

}  // namespace mk::fused
