// GEMM + ReduceScatter as a Fusion policy of the GEMM engine (src/gemm/gemm_kernel.cuh), on the
// reducing kernels' common part (fused/reducing.cuh): this file is its layout - the accumulator
// slice by slice, the outbox staged in the output - and its own tiles' finish.
//
// Rank r holds A_r [M, K_r] and B_r; the output of rank o is rows [o * S, (o + 1) * S) of
// sum_r A_r B_r^T (S = M / world). Rank r computes its partial product tile by tile, owner by owner
// in the order r + 1, r + 2, ..., r - 1 and its own rows last (interleaved with the peers' where
// there are enough tiles: reduce_order.h):
//   - a tile owned by a peer o is sent to o's accumulator [S][N] fp32 in the workspace: added
//     there by vector reductions (red.add.v4.f32), or with two ranks simply stored (the
//     accumulator receives one partial) - see send_slice - then the
//     consumer raises o's op signal (2 * tile + consumer) - deferred to its next epilogue, so that
//     it never waits for its own reduces to land;
//   - a tile of its own rows comes last: every peer handled it earlier (in its own order), so the
//     consumer waits for the peers' signals of its slice (already there in the steady state), adds
//     the accumulated fp32 partials to its registers, zeroes them for the next launch, and stores
//     bf16 to the output. Reductions stay fp32 until that one rounding. With two ranks and fp32
//     partials (tma_partials) the producer thread does the waiting instead: after a whole own
//     tile's k-blocks it waits for the peer's signals and TMA-loads the partial sums into the
//     next stages of the ring, where the epilogue adds them from shared memory
//     (add_from_ring).
// With two ranks and bf16_partials (FusedGemmConfig, opt-in) the one peer partial travels as bf16
// instead - rounded once, as the sequential baseline's NCCL reduce-scatter rounds it - which
// halves the staging writes, the NVLink bytes and the owner's reads; the owner adds it to its own
// fp32 partial. The accumulator then holds bf16 in the same slice layout (half of its bytes).
// With two ranks and fp32 partials (tma_sends) a peer's whole slice whose outbox slot is still
// busy - or that has no outbox - goes straight to the owner: TMA stores of its 32-column chunks
// from the scratch buffers into the owner's accumulator (the `partials` view of it), instead of
// waiting for the side threads to free the slot; the consumer's deferred signal follows once they
// have landed.
// Reuse: a peer adds into o's accumulator only after o entered the launch (o's previous launch,
// which read and zeroed it, is over). The workspace must be zero before the first launch.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "fused/partials.cuh"
#include "fused/reducing.cuh"
#include "gemm/gemm_kernel.cuh"
#include "mkernel/device/launch.cuh"

namespace mk::fused {

template <int kBlockN>
struct GemmRsFusion : ReducingFusion<GemmRsFusion<kBlockN>, kBlockN> {
  using Base = ReducingFusion<GemmRsFusion<kBlockN>, kBlockN>;
  using Base::accum_peers;
  using Base::bf16_partials;
  using Base::comm;
  using Base::order;
  using Base::single_peer;
  CUtensorMap a;         // A_r as [world][S][K_r], boxes 128 x 64 x 1
  CUtensorMap a_last;    // `a` again, boxes of a shard's last tile-row's rows (gemm_kernel.cuh)
  CUtensorMap out;       // this rank's output [S][N] bf16, boxes 64 x 64
  CUtensorMap partials;  // tma_partials: my_accum as [S * N / kBlockN][kBlockN] fp32, boxes 64 x 32
  CUtensorMap staging;   // tma_staging: the output's row pairs as fp32 (make_map_fp32_row_pairs)
  CUtensorMap peer_partials;  // tma_sends: the peer's accumulator, as `partials`
  float* my_accum;            // this rank's accumulator (local address)
  __nv_bfloat16* out_local;   // the output [S][N] (this rank's address): outbox staging, below
  bool tma_staging;  // (fp32) outbox slots are filled by TMA stores (partials.cuh, stage_chunks)
  int shard_rows;    // S
  int n;
  gemm_engine::GroupedRaster raster;  // tiles of one shard

  // ---- scheduler and operands ----
  __device__ int num_tiles() const { return comm.world_size * raster.num_tiles(); }

  __device__ gemm_engine::Tile tile(int t) const {
    int step = 0, index = 0;
    order.at(t, step, index);
    gemm_engine::Tile tile;
    tile.shard = (comm.rank + step) % comm.world_size;  // step 0: own rows
    raster.tile(index, tile.m, tile.n);
    return tile;
  }

  __device__ void wait_operands(const gemm_engine::Tile&) const {}

  __device__ bool last_row(const gemm_engine::Tile& tile) const {
    return tile.m == raster.tiles_m - 1;
  }
  __device__ int a_rows(const gemm_engine::Tile& tile) const {
    return last_row(tile) ? gemm_engine::last_tile_rows(shard_rows) : 128;
  }
  __device__ void load_a(void* dst, uint64_t* bar, const gemm_engine::Tile& tile, int k0) const {
    dev::tma_load_3d(dst, last_row(tile) ? &a_last : &a, bar, k0, tile.m * 128, tile.shard);
  }

  // ---- layout ----
  __device__ int rows() const { return shard_rows; }

  // Signal slot of a 64-row half of a tile, in the owner's numbering.
  __device__ uint32_t slot(const gemm_engine::Tile& tile, int half) const {
    return dev::signal_index(SignalId::kOp, 2 * (tile.m * raster.tiles_n + tile.n) + half);
  }

  // The accumulator is laid out slice by slice (not row-major), so that the 64 x kBlockN slice a
  // consumer sends is one contiguous block (64 KiB at kBlockN = 256) instead of 64 rows 4*N
  // bytes apart: band = 64 rows of a tile-row (the last band of the shard may be shorter), and
  // inside a band the tiles' slices follow each other, each [h][w] row-major with
  // h = rows of the band, w = columns of the tile. Total exactly S x N floats.
  __device__ int64_t slice_offset(int m, int tile_n, int half) const {
    const int row0 = m * 128 + half * 64;
    const int h = min(64, shard_rows - row0);
    return static_cast<int64_t>(row0) * n + static_cast<int64_t>(h) * tile_n * kBlockN;
  }
  __device__ int slice_width(const gemm_engine::Tile& tile) const {
    return min(kBlockN, n - tile.n * kBlockN);
  }
  // A slice in an accumulator (`accum`: a rank's workspace) as 32-bit words - fp32 values, or with
  // bf16 partials pairs of bf16 (the same layout in elements, half the bytes): its first word and
  // the words per row (slice_offset and widths are multiples of 8 elements: 16-byte aligned rows).
  __device__ float* slice_words(float* accum, int m, int tile_n, int half) const {
    const int64_t e = slice_offset(m, tile_n, half);
    return bf16_partials ? reinterpret_cast<float*>(reinterpret_cast<__nv_bfloat16*>(accum) + e)
                         : accum + e;
  }
  __device__ int words(int width) const { return bf16_partials ? width / 2 : width; }

  // This rank's accumulator slice of an own tile: one contiguous block (rows 0: below the shard).
  __device__ PartialAt own_slice(const gemm_engine::Tile& tile, int half, int& rows,
                                 int& width) const {
    rows = max(0, min(64, shard_rows - (tile.m * 128 + half * 64)));
    width = words(slice_width(tile));  // words: bf16 pairs with bf16_partials
    return PartialAt::block(slice_words(my_accum, tile.m, tile.n, half), width);
  }

  // The producer thread, tma_partials: box `box` of a slice is 64 rows of the `partials` view (a
  // slice starts at a multiple of kBlockN floats: the plan checks 64 N % kBlockN == 0).
  __device__ void load_partial_box(void* dst, uint64_t* bar, const gemm_engine::Tile& tile,
                                   int half, int box) const {
    const int row = static_cast<int>(slice_offset(tile.m, tile.n, half) / kBlockN);
    dev::tma_load_2d(dst, &partials, bar, 32 * box, row);
  }
  // Thread 0, tma_sends: chunk j of a whole slice into the peer's accumulator (the same view).
  __device__ bool tma_sends_slices() const { return this->tma_sends; }
  __device__ void store_tma_chunk(const gemm_engine::Tile& tile, int half, const uint8_t* buf,
                                  int j) const {
    const int row = static_cast<int>(slice_offset(tile.m, tile.n, half) / kBlockN);
    dev::tma_store_2d(&peer_partials, buf, 32 * j, row);
  }

  // ---- Outbox staging in the output ----
  // A CTA stages its outgoing slices (partials.cuh) in the output footprints of its own last
  // tiles, those after the last remote position of the order: nothing writes there before the
  // CTA's own final stores of those tiles, and before them the CTA closes its outbox and waits
  // for it to drain.
  // So the outbox costs no memory beyond the accumulator. A footprint (128 x kBlockN bf16) holds
  // one fp32 slot (64 x kBlockN fp32: slot row r = output rows 2r and 2r + 1), or two bf16 slots
  // (output rows 0-63 and 64-127).
  // footprints(): the whole (not clipped) own tiles of this CTA, last first - how many there
  // are (up to 2 x kMaxOutboxSlots), and the k-th of them (its m and n) in `found`. Found once per
  // CTA (prepare_shared) and kept in shared memory: every peer's-tile epilogue asks.
  struct Footprints {
    int count;
    int m[2 * kMaxOutboxSlots];
    int n[2 * kMaxOutboxSlots];
  };
  __device__ static Footprints& footprint_list() {
    __shared__ Footprints list;
    return list;
  }
  __device__ void prepare_shared() const {
    Footprints& list = footprint_list();
    const int last = num_tiles() - 1 -
                     (num_tiles() - 1 - static_cast<int>(blockIdx.x)) % static_cast<int>(gridDim.x);
    list.count = 0;
    for (int t = last; t > order.last_remote() && list.count < 2 * kMaxOutboxSlots;
         t -= gridDim.x) {
      const gemm_engine::Tile own = tile(t);
      if (own.m * 128 + 128 <= shard_rows && (own.n + 1) * kBlockN <= n) {
        list.m[list.count] = own.m;
        list.n[list.count] = own.n;
        ++list.count;
      }
    }
  }
  __device__ int footprints(int k, gemm_engine::Tile& found) const {
    const Footprints& list = footprint_list();
    if (k < list.count) {
      found.m = list.m[k];
      found.n = list.n[k];
      found.shard = comm.rank;
    }
    return list.count;
  }
  // Outbox slots per consumer of this CTA: 0 (the epilogue sends), 1 or 2. None for a CTA of one
  // tile: it has nothing to send ahead of.
  __device__ int outbox_slots() const {
    if (blockIdx.x + gridDim.x >= num_tiles()) return 0;
    gemm_engine::Tile unused;
    const int count = footprints(0, unused);
    return bf16_partials ? min(kMaxOutboxSlots, count) : count / 2;
  }
  __device__ int64_t peer_shift(int) const { return 0; }  // (no broadcast items)
  // Footprints the CTA's 2 x slots staging slots take.
  __device__ int staging_footprints(int slots) const { return bf16_partials ? slots : 2 * slots; }
  // Staging slot k of the CTA (k = consumer * slots + slot), as 32-bit words (words() wide), in
  // the footprint `own` = staging_footprint(k).
  __device__ gemm_engine::Tile staging_footprint(int k) const {
    gemm_engine::Tile own;
    footprints(bf16_partials ? k / 2 : k, own);
    return own;
  }
  __device__ PartialAt staging_at(int k, const gemm_engine::Tile& own) const {
    __nv_bfloat16* base = out_local + static_cast<int64_t>(own.m) * 128 * n + own.n * kBlockN;
    if (bf16_partials) {  // rows n bf16 apart
      return PartialAt::block(reinterpret_cast<float*>(base + (k % 2) * 64 * n), n / 2);
    }
    return {reinterpret_cast<float*>(base), n, reinterpret_cast<float*>(base + n), n, kBlockN / 2};
  }
  // Thread 0, tma_staging: the TMA store of a slice's 32-column chunk j into the fp32 slot of
  // the footprint whose first column and row pair in `staging` are x0 = own.n * kBlockN / 2 and
  // pair0 = own.m * 64 (staging_at's layout: columns < kBlockN / 2 in the even output rows, the
  // rest in the odd ones - as `staging` sees them, row pairs and halves).
  __device__ void store_staged_chunk(int x0, int pair0, const uint8_t* buf, int j) const {
    const int col = 32 * j, half = col >= kBlockN / 2 ? 1 : 0;
    dev::tma_store_3d(&staging, buf, x0 + col - half * (kBlockN / 2), half, pair0);
  }

  // ---- A peer's tile ----
  // Staged in the consumer's next slot (fp32: by TMA stores when tma_staging) and posted.
  template <int kRegs>
  __device__ void post_to_outbox(float (&acc)[kRegs], const gemm_engine::Tile& tile, int half,
                                 uint8_t* scratch, ReduceState& state) const {
    const int owner = tile.shard;  // one node: global rank = local rank
    const int width = words(slice_width(tile));
    const int k = half * state.outbox.slots + state.outbox.slot();
    const int rows = max(0, min(64, shard_rows - (tile.m * 128 + half * 64)));
    auto make_item = [&] {
      OutboxItem item{};
      item.src = staging_at(k, staging_footprint(k));
      item.at = PartialAt::block(slice_words(accum_peers[owner], tile.m, tile.n, half), width);
      item.rows = rows;
      item.width = width;
      item.owner = owner;
      item.signal = slot(tile, half);
      return item;
    };
    if (tma_staging && !bf16_partials) {
      const gemm_engine::Tile own = staging_footprint(k);
      const int x0 = own.n * (kBlockN / 2), pair0 = own.m * 64;
      outbox_post_by_tma(
          acc, half, state.outbox, rows > 0, width, scratch,
          [this, x0, pair0](const uint8_t* buf, int j) { store_staged_chunk(x0, pair0, buf, j); },
          make_item, this->trace);
    } else {
      outbox_post(acc, half, state.outbox, make_item(), bf16_partials, this->trace);
    }
  }
  // The epilogue's own stores into the owner's accumulator (no outbox): bf16, or fp32 stored
  // (two ranks) or added.
  template <int kRegs>
  __device__ void send_direct(float (&acc)[kRegs], const gemm_engine::Tile& tile, int half,
                              uint8_t* scratch, int rows) const {
    const int owner = tile.shard, width = slice_width(tile);
    if (bf16_partials) {
      send_slice_bf16(
          acc, half, scratch,
          reinterpret_cast<__nv_bfloat16*>(accum_peers[owner]) + slice_offset(tile.m, tile.n, half),
          width, rows, width);
    } else {
      float* slice = accum_peers[owner] + slice_offset(tile.m, tile.n, half);
      send_slice(
          acc, half, scratch, [&](int r, int c) { return slice + r * width + c; }, rows, width,
          !single_peer);
    }
  }

  // ---- An own tile: the peers' sums, one rounding to bf16, the output ----
  template <int kRegs>
  __device__ void finish_own(float (&acc)[kRegs], const gemm_engine::Tile& tile, int consumer,
                             uint8_t* scratch, ReduceState& state,
                             const gemm_engine::EpilogueRing& ring,
                             const dev::Launch& launch) const {
    // Past the last remote position this warpgroup posts nothing more: close its outbox now, so
    // that the other one's wait for the drain (before a staging footprint) does not hang on it.
    if (tile.position > order.last_remote()) outbox_close(state.outbox);
    this->add_peer_sums(acc, tile, consumer, ring, launch);
    // A staging footprint (only after the last remote position): wait till the outbox is free.
    const int footprint_count = staging_footprints(state.outbox.slots);
    for (int k = 0; tile.position > order.last_remote() && k < footprint_count; ++k) {
      gemm_engine::Tile staging_tile;
      footprints(k, staging_tile);
      if (staging_tile.m == tile.m && staging_tile.n == tile.n) {
        outbox_wait_drained();
        dev::fence_proxy_async_global();  // the slots' generic writes, before TMA stores there
        break;
      }
    }
    const int row0 = tile.m * 128 + consumer * 64, col0 = tile.n * kBlockN;
    gemm_engine::store_slice(acc, col0, n, consumer, scratch, [&](const uint8_t* buf, int j) {
      dev::tma_store_2d(&out, buf, col0 + 64 * j, row0);
    });
  }

  __device__ void finish() const { dev::Launch::begin(comm).end(); }
};
static_assert(gemm_engine::check_fusion_widths<GemmRsFusion>());

}  // namespace mk::fused
