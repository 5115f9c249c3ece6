// GEMM + ReduceScatter as a Fusion policy of the GEMM engine (src/gemm/gemm_kernel.cuh).
//
// Rank r holds A_r [M, K_r] and B_r; the output of rank o is rows [o * S, (o + 1) * S) of
// sum_r A_r B_r^T (S = M / world). Rank r computes its partial product tile by tile, owner by owner
// in the order r + 1, r + 2, ..., r - 1 and its own rows last:
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
#include "fused/reduce_order.h"
#include "fused/trace.cuh"
#include "gemm/gemm_kernel.cuh"
#include "mkernel/device/launch.cuh"
#include "mkernel/device_comm.h"

namespace mk::fused {

constexpr int kMaxLocalRanks = 8;  // tensor maps of the peers' accumulators travel in the params

template <int kBlockN>
struct GemmRsFusion {
  static constexpr int kProducerRegs = 56;   // the outbox copy loop (partials.cuh), and
  static constexpr int kConsumerRegs = 224;  // 56 + 2 x 224 <= 3 x 168 (gemm_kernel.cuh)
  CUtensorMap a;                             // A_r as [world][S][K_r], boxes 128 x 64 x 1
  CUtensorMap out;                           // this rank's output [S][N] bf16, boxes 64 x 64
  CUtensorMap partials;  // tma_partials: my_accum as [S * N / kBlockN][kBlockN] fp32, boxes 64 x 32
  CUtensorMap staging;   // tma_staging: the output's row pairs as fp32 (make_map_fp32_row_pairs)
  CUtensorMap peer_partials;  // tma_sends: the peer's accumulator, as `partials`
  CUtensorMap a_last;  // `a` again, boxes of a shard's last tile-row's rows (gemm_kernel.cuh)
  float* accum_peers[kMaxLocalRanks];  // each local rank's accumulator [S][N] fp32, mapped here
  DeviceComm comm;
  float* my_accum;           // this rank's accumulator (local address)
  __nv_bfloat16* out_local;  // the output [S][N] (this rank's address): outbox staging, see below
  bool outbox;               // partials may leave through the outbox (MKERNEL_OUTBOX != 0)
  bool single_peer;    // two ranks: the one peer stores its partial (a sum onto zero) instead of
                       // adding it - plain NVLink writes, no remote read-modify-write
  bool bf16_partials;  // (single_peer only) partials travel and wait as bf16
  bool tma_partials;   // (single_peer, fp32) whole own tiles' partials come through the ring
  bool tma_staging;    // (fp32) outbox slots are filled by TMA stores (partials.cuh, stage_chunks)
  bool tma_sends;      // (single_peer, fp32) whole slices may go straight to the peer (above)
  bool partials_first;  // (tma_partials) those partials come before the tile's k-blocks
  int shard_rows;      // S
  int n;
  gemm_engine::GroupedRaster raster;  // tiles of one shard
  ReduceOrder order;                  // peers' tiles and own tiles in time (reduce_order.h)
  uint64_t* trace;                    // timeline records (fused/trace.cuh), or null

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

  // ---- The peer's partials of a whole own tile through the stage ring (tma_partials) ----
  // A slice [64][kBlockN] starts at a multiple of kBlockN floats (the plan checks 64 N %
  // kBlockN == 0), so it is 64 rows of the `partials` map (add_from_ring has the stages' layout).
  using Ring = RingPartials<kBlockN>;

  __device__ int ring_partials(const gemm_engine::Tile& tile) const {
    const bool whole = tile.m * 128 + 128 <= shard_rows && (tile.n + 1) * kBlockN <= n;
    return tma_partials && tile.shard == comm.rank && whole ? Ring::kStages : 0;
  }
  __device__ int epilogue_loads(const gemm_engine::Tile& tile) const {
    return partials_first ? 0 : ring_partials(tile);
  }
  // partials_first: the same stages before the k-blocks; start() sets the accumulator from them.
  __device__ int prologue_loads(const gemm_engine::Tile& tile) const {
    return partials_first ? ring_partials(tile) : 0;
  }
  template <int kRegs>
  __device__ void start(float (&acc)[kRegs], const gemm_engine::Tile& tile, int consumer,
                        const gemm_engine::EpilogueRing& ring) const {
    start_from_ring<Ring::kPerStage>(acc, ring, gemm_engine::slice_half(tile, consumer), consumer);
  }

  // The producer thread: stage i of the tile's partials (partials.cuh, load_own_partials).
  __device__ void load_epilogue(void* dst, uint64_t* bar, const gemm_engine::Tile& tile,
                                int i) const {
    auto load_box = [&](void* box_dst, int half, int box) {
      const int row = static_cast<int>(slice_offset(tile.m, tile.n, half) / kBlockN);
      dev::tma_load_2d(box_dst, &partials, bar, 32 * box, row);
    };
    load_own_partials<kBlockN>(comm, slot(tile, 0), slot(tile, 1), dst, bar, i, load_box);
  }

  __device__ bool last_row(const gemm_engine::Tile& tile) const {
    return tile.m == raster.tiles_m - 1;
  }
  __device__ int a_rows(const gemm_engine::Tile& tile) const {
    return last_row(tile) ? gemm_engine::last_tile_rows(shard_rows) : 128;
  }
  __device__ void load_a(void* dst, uint64_t* bar, const gemm_engine::Tile& tile, int k0) const {
    dev::tma_load_3d(dst, last_row(tile) ? &a_last : &a, bar, k0, tile.m * 128, tile.shard);
  }

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
  __device__ int slice_width(int tile_n) const { return min(kBlockN, n - tile_n * kBlockN); }
  // A slice in an accumulator (`accum`: a rank's workspace) as 32-bit words - fp32 values, or with
  // bf16 partials pairs of bf16 (the same layout in elements, half the bytes): its first word and
  // the words per row (slice_offset and widths are multiples of 8 elements: 16-byte aligned rows).
  __device__ float* slice_words(float* accum, int m, int tile_n, int half) const {
    const int64_t e = slice_offset(m, tile_n, half);
    return bf16_partials ? reinterpret_cast<float*>(reinterpret_cast<__nv_bfloat16*>(accum) + e)
                         : accum + e;
  }
  __device__ int words(int width) const { return bf16_partials ? width / 2 : width; }

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
  // CTA (init_shared) and kept in shared memory: every peer's-tile epilogue asks.
  struct Footprints {
    int count;
    int m[2 * kMaxOutboxSlots];
    int n[2 * kMaxOutboxSlots];
  };
  __device__ static Footprints& footprint_list() {
    __shared__ Footprints list;
    return list;
  }
  __device__ void find_footprints() const {
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
  // tile: it has nothing to send ahead of, and under ping-pong its second warpgroup gets no tile,
  // so would never close an outbox (the other one waits for the drain before its footprint).
  __device__ int outbox_slots(int footprint_count) const {
    if (!outbox || blockIdx.x + gridDim.x >= num_tiles()) return 0;
    return bf16_partials ? min(kMaxOutboxSlots, footprint_count) : footprint_count / 2;
  }
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
    if (!bf16_partials) return footprint_at(own);
    __nv_bfloat16* base =
        out_local + (static_cast<int64_t>(own.m) * 128 + (k % 2) * 64) * n + own.n * kBlockN;
    return PartialAt::block(reinterpret_cast<float*>(base), n / 2);  // rows n bf16 apart
  }
  __device__ PartialAt footprint_at(const gemm_engine::Tile& own) const {
    __nv_bfloat16* base = out_local + static_cast<int64_t>(own.m) * 128 * n + own.n * kBlockN;
    return {reinterpret_cast<float*>(base), n, reinterpret_cast<float*>(base + n), n, kBlockN / 2};
  }
  // Thread 0, tma_staging: the TMA store of a slice's 32-column chunk j into the fp32 slot of
  // the footprint whose first column and row pair in `staging` are x0 = own.n * kBlockN / 2 and
  // pair0 = own.m * 64 (footprint_at's layout: columns < kBlockN / 2 in the even output rows, the
  // rest in the odd ones - as `staging` sees them, row pairs and halves).
  __device__ void store_staged_chunk(int x0, int pair0, const uint8_t* buf, int j) const {
    const int col = 32 * j, half = col >= kBlockN / 2 ? 1 : 0;
    dev::tma_store_3d(&staging, buf, x0 + col - half * (kBlockN / 2), half, pair0);
  }

  // Per consumer warpgroup: bookkeeping between epilogues (thread 0's, and the outbox cursor).
  static constexpr uint32_t kByTma = 1u << 31;
  struct ConsumerState {
    int owner = -1;  // a reduce whose signal is still owed, or -1
    uint32_t signal = 0;
    // bit o < kMaxLocalRanks: owner o has been seen in this launch; kByTma: the owed reduce left
    // by TMA stores of this thread (tma_sends) - a bit here, not a field: the state stays in
    // registers through the mainloop, where one more spilled at 128 x 256
    uint32_t entered = 0;
    bool ready = false;    // outbox.slots set
    OutboxCursor outbox;
  };

  __device__ void init_shared() const {
    outbox_init();
    trace_init();
    find_footprints();
  }

  // This rank's accumulator slice of an own tile: one contiguous block (rows 0: below the shard).
  __device__ PartialAt own_slice(const gemm_engine::Tile& tile, int half, int& rows,
                                 int& width) const {
    rows = max(0, min(64, shard_rows - (tile.m * 128 + half * 64)));
    width = words(slice_width(tile.n));  // words: bf16 pairs with bf16_partials
    return PartialAt::block(slice_words(my_accum, tile.m, tile.n, half), width);
  }

  // Thread 0: owner o's buffers may be written to (its previous launch is over).
  __device__ void ensure_entered(ConsumerState& pending, int owner, const dev::Launch& launch) const {
    if (pending.entered & (1u << owner)) return;
    launch.wait(owner, dev::signal_index(SignalId::kEntry, 0), 1);
    pending.entered |= 1u << owner;
  }

  template <int kRegs>
  __device__ void store(float (&acc)[kRegs], const gemm_engine::Tile& tile, int consumer,
                        uint8_t* scratch, ConsumerState& pending,
                        const gemm_engine::EpilogueRing& ring = {}) const {
    reducing_store(*this, acc, tile, consumer, scratch, pending, ring);
  }

  template <int kRegs>
  __device__ void store_tile(float (&acc)[kRegs], const gemm_engine::Tile& tile, int consumer,
                             uint8_t* scratch, ConsumerState& pending,
                             const gemm_engine::EpilogueRing& ring) const {
    const dev::Launch launch = dev::Launch::begin(comm);
    const int t = threadIdx.x % 128;
    if (t == 0) flush(pending, launch);
    if (!pending.ready) {
      gemm_engine::Tile unused;
      pending.outbox.slots = outbox_slots(footprints(0, unused));
      pending.ready = true;
    }
    // The slice (rows of the tile) and the warpgroup (barriers, staging, scratch) are the same
    // under the cooperative schedule and differ under ping-pong (gemm_kernel.cuh).
    const int half = gemm_engine::slice_half(tile, consumer);
    const int row0 = tile.m * 128 + half * 64, col0 = tile.n * kBlockN;
    const int slots = pending.outbox.slots;
    if (tile.shard != comm.rank && tma_sends && row0 + 64 <= shard_rows &&
        slice_width(tile.n) == kBlockN &&
        (slots == 0 || !outbox_slot_free(consumer, pending.outbox))) {
      const int owner = tile.shard;  // one node: global rank = local rank
      if (t == 0) {  // (set before the chunks: nothing of the tile stays live across them)
        ensure_entered(pending, owner, launch);
        pending.owner = owner;
        pending.signal = slot(tile, half);
        pending.entered |= kByTma;
      }
      const int row = static_cast<int>(slice_offset(tile.m, tile.n, half) / kBlockN);
      const CUtensorMap* map = &peer_partials;
      stage_chunks(acc, consumer, scratch, kBlockN, [map, row](const uint8_t* buf, int j) {
        dev::tma_store_2d(map, buf, 32 * j, row);
      });
      return;
    }
    if (tile.shard != comm.rank && slots > 0) {  // one item per remote tile, even if empty
      const int owner = tile.shard;              // one node: global rank = local rank
      const int width = words(slice_width(tile.n));
      const int k = consumer * slots + pending.outbox.slot();
      const int rows = max(0, min(64, shard_rows - row0));
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
            acc, consumer, pending.outbox, rows > 0, width, scratch,
            [this, x0, pair0](const uint8_t* buf, int j) { store_staged_chunk(x0, pair0, buf, j); },
            make_item, trace);
      } else {
        outbox_post(acc, consumer, pending.outbox, make_item(), bf16_partials, trace);
      }
      return;
    }
    if (tile.shard != comm.rank) {
      const int owner = tile.shard;  // one node: global rank = local rank
      if (t == 0) ensure_entered(pending, owner, launch);
      if (row0 < shard_rows && bf16_partials) {
        send_slice_bf16(acc, consumer, scratch,
                        reinterpret_cast<__nv_bfloat16*>(accum_peers[owner]) +
                            slice_offset(tile.m, tile.n, half),
                        slice_width(tile.n), min(64, shard_rows - row0), slice_width(tile.n));
      } else if (row0 < shard_rows) {
        const int width = slice_width(tile.n);
        float* slice = accum_peers[owner] + slice_offset(tile.m, tile.n, half);
        send_slice(
            acc, consumer, scratch, [&](int r, int c) { return slice + r * width + c; },
            shard_rows - row0, width, !single_peer);
      }
      if (t == 0 && row0 < shard_rows) {  // an empty slice (below the shard) has no signal
        pending.owner = owner;
        pending.signal = slot(tile, half);
      }
      return;
    }
    // Past the last remote position this warpgroup posts nothing more: close its outbox now, so
    // that the other one's wait for the drain (before a staging footprint) does not hang on it.
    if (tile.position > order.last_remote()) outbox_close(pending.outbox);
    // Own rows: the peers' partial sums of this slice, then one rounding to bf16.
    if (prologue_loads(tile) > 0) {
      // (the accumulator started from them: start())
    } else if (ring.count > 0) {  // in the ring: the producer waited for them and loaded them
      add_from_ring<Ring::kPerStage>(acc, ring, half, consumer);
      if (t == 0) trace_mark(trace, kTraceConsumer0 + consumer, kTraceAdded);
    } else {
      if (t == 0 && row0 < shard_rows) {
        wait_for_partials(comm, launch, slot(tile, half));
        trace_mark(trace, kTraceConsumer0 + consumer, kTraceWaited);
      }
      dev::named_barrier_sync(1 + consumer, 128);
      if (row0 < shard_rows) {
        int rows = 0, width = 0;
        const PartialAt sums = own_slice(tile, half, rows, width);
        // (width counts words: with bf16 partials two columns each)
        add_and_clear(acc, sums, rows, bf16_partials ? 2 * width : width,
                      single_peer ? nullptr : sums.second, 1 + consumer, bf16_partials);
        if (t == 0) trace_mark(trace, kTraceConsumer0 + consumer, kTraceAdded);
      }
    }
    // A staging footprint (only after the last remote position): wait till the outbox is free.
    for (int k = 0; tile.position > order.last_remote() && k < staging_footprints(slots); ++k) {
      gemm_engine::Tile staging_tile;
      footprints(k, staging_tile);
      if (staging_tile.m == tile.m && staging_tile.n == tile.n) {
        outbox_close(pending.outbox);  // footprints come after this CTA's last remote tile
        outbox_wait_drained();
        dev::fence_proxy_async_global();  // the slots' generic writes, before TMA stores there
        break;
      }
    }
    gemm_engine::store_slice(acc, col0, n, consumer, scratch, [&](const uint8_t* buf, int j) {
      dev::tma_store_2d(&out, buf, col0 + 64 * j, row0);
    });
  }

  // Thread 0 of a consumer, halfway through a tile's k-blocks (gemm_kernel.cuh): the previous
  // epilogue's reduce, sent by TMA stores, has long landed - tell its owner now rather than at the
  // next epilogue, a whole mainloop later (the owner's tile may be waiting for it).
  __device__ void mid_tile(ConsumerState& pending) const {
    if (pending.entered & kByTma) flush(pending, dev::Launch::begin(comm));
  }

  // Thread 0 of a consumer: the previous reduce has landed -> tell its owner.
  __device__ void flush(ConsumerState& pending, const dev::Launch& launch) const {
    if (pending.owner < 0) return;
    if (pending.entered & kByTma) {  // this thread's stores, before its release
      dev::bulk_stores_landed();
      pending.entered &= ~kByTma;
    }
    dev::fence_acq_rel_sys();  // after the warpgroup's stores (send_slice ends with a barrier)
    launch.signal(pending.owner, pending.signal, 1);
    pending.owner = -1;
  }

  __device__ void consumer_done(ConsumerState& pending) const {
    outbox_close(pending.outbox);
    if (threadIdx.x % 128 == 0) {
      flush(pending, dev::Launch::begin(comm));
      trace_mark(trace, kTraceConsumer0 + threadIdx.x / 128 - 1, kTraceDone);
    }
  }

  // Producer warps 1..3: CTA 0 announces this launch to the peers; then every CTA with an
  // outbox serves it.
  __device__ void side_task(int thread, int threads) const {
    const dev::Launch launch = dev::Launch::begin(comm);
    if (thread == 0) trace_mark(trace, kTraceSide, kTraceSideStart);
    if (blockIdx.x == 0) {
      for (int peer = thread; peer < comm.local_size; peer += threads) {
        if (peer != comm.local_rank) launch.signal(peer, dev::signal_index(SignalId::kEntry, 0), 1);
      }
    }
    gemm_engine::Tile unused;
    const int slots = outbox_slots(footprints(0, unused));
    if (slots == 0) return;
    EnteredPeers entered;  // thread 0's
    outbox_serve(
        comm, !single_peer, [&](int peer) { return entered.ensure(launch, peer); },
        [](int) { return int64_t{0}; }, trace);  // no broadcast items here
    if (thread == 0) trace_mark(trace, kTraceSide, kTraceSideEnd);
  }

  __device__ void finish() const { dev::Launch::begin(comm).end(); }
};

}  // namespace mk::fused
