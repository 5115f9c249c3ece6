// GEMM + AllReduce as a Fusion policy of the GEMM engine (src/gemm/gemm_kernel.cuh).
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

#include "fused/gemm_rs.cuh"  // kMaxLocalRanks
#include "fused/partials.cuh"
#include "fused/reduce_order.h"
#include "fused/trace.cuh"
#include "gemm/gemm_kernel.cuh"
#include "mkernel/device/launch.cuh"
#include "mkernel/device_comm.h"

namespace mk::fused {

template <int kBlockN>
struct GemmArFusion {
  static constexpr int kProducerRegs = 56;   // the outbox copy loop (partials.cuh), and
  static constexpr int kConsumerRegs = 224;  // 56 + 2 x 224 <= 3 x 168 (gemm_kernel.cuh)
  CUtensorMap a;                             // A_r [M, K_r], boxes 128 x 64
  CUtensorMap a_last;  // A_r again, boxes of the last tile-row's rows (last_rows) x 64
  CUtensorMap out;                           // this rank's C [M, N] bf16, boxes 64 x 64
  CUtensorMap partials_c;                    // tma_partials: C as fp32 [M][N / 2], boxes 64 x 32
  CUtensorMap partials_ws;  // tma_partials: the accumulator as fp32 [..][kBlockN / 2], 64 x 32
  CUtensorMap peer_out;          // tma_sends: the peer's C, as `out`
  CUtensorMap peer_partials_c;   // tma_sends and tma_partials: the peer's C as fp32 (partials_c)
  CUtensorMap peer_partials_ws;  // tma_sends and tma_partials: its accumulator (partials_ws)
  __nv_bfloat16* out_peers[kMaxLocalRanks];  // each local rank's C, mapped here
  float* accum_peers[kMaxLocalRanks];        // each local rank's accumulator, mapped here
  DeviceComm comm;
  int m;
  int n;
  int tiles_m;
  int tiles_n;
  int last_rows;  // rows of the last tile-row (1..128)
  bool single_peer;    // two ranks: partials are stored (one per slice), not added
  bool bf16_partials;  // (single_peer only) partials travel as bf16, into the owner's C
  bool tma_partials;   // (single_peer, fp32) whole own tiles' partials come through the ring
  bool tma_sends;      // (single_peer) the epilogue sends by TMA stores (above)
  bool partials_first;  // (tma_partials) those partials come before the tile's k-blocks
  float* staging;      // this rank's outbox slots, [CTA][consumer][slot][slot_floats]; or null
  int64_t slot_floats;
  int outbox_slots;   // per consumer, when staging is set
  ReduceOrder order;  // lag >= 0: interleaved (reduce_order.h); else owners r + 1, ..., r
  uint64_t* trace;    // timeline records (fused/trace.cuh), or null

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
  __device__ int a_rows(const gemm_engine::Tile& tile) const {
    return tile.m == tiles_m - 1 ? last_rows : 128;
  }
  __device__ void load_a(void* dst, uint64_t* bar, const gemm_engine::Tile& tile, int k0) const {
    dev::tma_load_2d(dst, tile.m == tiles_m - 1 ? &a_last : &a, bar, k0, tile.m * 128);
  }

  // ---- The peer's partials of a whole own tile through the stage ring (tma_partials) ----
  // A two-rank slice's first kBlockN / 2 columns lie in C (boxes of the `partials_c` view), the
  // rest in a half-width slice of the workspace that starts at a multiple of kBlockN / 2 floats
  // (the plan checks 64 N % kBlockN == 0): 64 rows of the `partials_ws` view.
  using Ring = RingPartials<kBlockN>;

  __device__ int ring_partials(const gemm_engine::Tile& tile) const {
    const bool whole = tile.m * 128 + 128 <= m && (tile.n + 1) * kBlockN <= n;
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
      const int row0 = tile.m * 128 + half * 64;
      constexpr int kInC = kBlockN / 64;  // boxes of the slice's first half (in C)
      if (box < kInC) {
        dev::tma_load_2d(box_dst, &partials_c, bar, tile.n * (kBlockN / 2) + 32 * box, row0);
      } else {
        const PartialAt at = slice_at(tile, half);
        const int row =
            static_cast<int>((at.second - accum_peers[comm.local_rank]) / (kBlockN / 2));
        dev::tma_load_2d(box_dst, &partials_ws, bar, 32 * (box - kInC), row);
      }
    };
    load_own_partials<kBlockN>(comm, slot(tile, 0), slot(tile, 1), dst, bar, i, load_box);
  }

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

  struct ConsumerState {
    int owner = -1;  // a partial whose signal is still owed, or -1
    uint32_t signal = 0;
    bool by_tma = false;  // that partial left by TMA stores of this thread (tma_sends)
    uint32_t entered = 0;  // bit p: rank p is known to have entered this launch
    OutboxCursor outbox;
  };

  // This consumer's staging slots (the outbox), or null: partials are sent by the epilogue.
  __device__ float* my_staging(int consumer) const {
    return staging == nullptr ? nullptr
                              : staging + (static_cast<int64_t>(blockIdx.x) * 2 + consumer) *
                                              outbox_slots * slot_floats;
  }

  __device__ void init_shared() const {
    if (staging != nullptr) outbox_init();
    trace_init();
  }

  // Thread 0: peer p may be written to (its previous launch is over).
  __device__ void ensure_entered(ConsumerState& state, int peer, const dev::Launch& launch) const {
    if (state.entered & (1u << peer)) return;
    launch.wait(peer, dev::signal_index(SignalId::kEntry, 0), 1);
    state.entered |= 1u << peer;
  }

  // This rank's accumulator slice of an own tile (rows 0: below C).
  __device__ PartialAt own_slice(const gemm_engine::Tile& tile, int half, int& rows,
                                 int& width) const {
    rows = max(0, min(64, m - (tile.m * 128 + half * 64)));
    width = words(slice_width(tile));
    return slice_at(tile, half);
  }

  template <int kRegs>
  __device__ void store(float (&acc)[kRegs], const gemm_engine::Tile& tile, int consumer,
                        uint8_t* scratch, ConsumerState& state,
                        const gemm_engine::EpilogueRing& ring = {}) const {
    reducing_store(*this, acc, tile, consumer, scratch, state, ring);
  }

  template <int kRegs>
  __device__ void store_tile(float (&acc)[kRegs], const gemm_engine::Tile& tile, int consumer,
                             uint8_t* scratch, ConsumerState& state,
                             const gemm_engine::EpilogueRing& ring) const {
    const dev::Launch launch = dev::Launch::begin(comm);
    const int t = threadIdx.x % 128;
    if (t == 0) flush(state, launch);
    if (staging != nullptr) state.outbox.slots = outbox_slots;
    // The slice (rows of the tile) and the warpgroup (barriers, staging, scratch) are the same
    // under the cooperative schedule and differ under ping-pong (gemm_kernel.cuh).
    const int half = gemm_engine::slice_half(tile, consumer);
    const int row0 = tile.m * 128 + half * 64, col0 = tile.n * kBlockN;
    const int rows = min(64, m - row0), width = slice_width(tile);
    const int owner = tile.shard;                    // one node: global rank = local rank
    // A whole slice by TMA stores (the views' boxes) when there is no outbox or its slot is busy.
    if (owner != comm.rank && tma_sends && tma_partials && rows == 64 && width == kBlockN &&
        (staging == nullptr || !outbox_slot_free(consumer, state.outbox))) {
      if (t == 0) {
        ensure_entered(state, owner, launch);
        state.owner = owner;  // (set before the chunks: nothing of the tile stays live across them)
        state.signal = slot(tile, half);
        state.by_tma = true;
      }
      const int ws_row =
          static_cast<int>((slice_at(tile, half).second - accum_peers[owner]) / (kBlockN / 2));
      const int c0 = tile.n * (kBlockN / 2);
      stage_chunks(acc, consumer, scratch, width, [&](const uint8_t* buf, int j) {
        constexpr int kInC = kBlockN / 64;  // chunks of the slice's first half (in C)
        if (j < kInC) {
          dev::tma_store_2d(&peer_partials_c, buf, c0 + 32 * j, row0);
        } else {
          dev::tma_store_2d(&peer_partials_ws, buf, 32 * (j - kInC), ws_row);
        }
      });
      return;
    }
    if (owner != comm.rank && staging != nullptr) {  // one item per remote tile, even if empty
      OutboxItem item{};
      item.src =
          PartialAt::block(my_staging(consumer) + state.outbox.slot() * slot_floats, words(width));
      item.at = slice_at(tile, half);
      item.rows = max(rows, 0);
      item.width = words(width);
      item.owner = owner;
      item.signal = slot(tile, half);
      // (Staged with plain stores: its slots are contiguous blocks, which these write in ~2 us
      // per 64 KiB beside the GEMM; TMA staging, as gemm_rs's, took ~3: trace, H200, 2026-12-01.)
      outbox_post(acc, consumer, state.outbox, item, bf16_partials, trace);
      return;
    }
    if (row0 >= m) return;  // the slice lies below C (the last tile-row is partial)
    if (owner != comm.rank) {
      if (t == 0) ensure_entered(state, owner, launch);
      if (bf16_partials) {
        send_slice_bf16(acc, consumer, scratch,
                        out_peers[owner] + static_cast<int64_t>(row0) * n + col0, n, rows, width);
      } else {
        send_slice(acc, consumer, scratch, slice_at(tile, half), rows, width, !single_peer);
      }
      if (t == 0) {
        state.owner = owner;
        state.signal = slot(tile, half);
      }
      return;
    }
    // Own slice: the peers' sums, one rounding, then C here and in every peer.
    const bool started = prologue_loads(tile) > 0;  // the accumulator started from them: start()
    if (t == 0) {
      if (ring.count == 0 && !started) {  // (in the ring: the producer waited)
        wait_for_partials(comm, launch, slot(tile, half));
        trace_mark(trace, kTraceConsumer0 + consumer, kTraceWaited);
      }
      // (with the outbox and without TMA sends its side threads make sure)
      for (int p = 0; p < comm.local_size && (staging == nullptr || tma_sends); ++p) {
        if (p != comm.local_rank) ensure_entered(state, p, launch);
      }
    }
    if (started) {
      // (the TMA loads read the words in C before the k-blocks: the result may overwrite them)
    } else if (ring.count > 0) {  // the words in C were read by the TMA loads: the result may
      add_from_ring<Ring::kPerStage>(acc, ring, half, consumer);  // overwrite them (ends with a
                                                                  // barrier)
    } else {
      dev::named_barrier_sync(1 + consumer, 128);
      // Every thread has read its words of the slice (in C too) before store_slice's first
      // barrier; the result overwrites them only after it.
      const PartialAt sums = slice_at(tile, half);  // three or more ranks: one block, cleared
      add_and_clear(acc, sums, rows, width, single_peer ? nullptr : sums.second, 1 + consumer,
                    bf16_partials);
    }
    if (t == 0) trace_mark(trace, kTraceConsumer0 + consumer, kTraceAdded);
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
        item.width = width / 2;
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

  // Thread 0 of a consumer, halfway through a tile's k-blocks (gemm_kernel.cuh): the previous
  // epilogue's partials, sent by TMA stores, have long landed - tell the owner now rather than
  // at the next epilogue, a whole mainloop later.
  __device__ void mid_tile(ConsumerState& state) const {
    if (state.by_tma) flush(state, dev::Launch::begin(comm));
  }

  __device__ void flush(ConsumerState& state, const dev::Launch& launch) const {
    if (state.owner < 0) return;
    if (state.by_tma) {  // this thread's stores, before its release
      dev::bulk_stores_landed();
      state.by_tma = false;
    }
    dev::fence_acq_rel_sys();  // after the warpgroup's writes (send_slice ends with a barrier)
    launch.signal(state.owner, state.signal, 1);
    state.owner = -1;
  }

  __device__ void consumer_done(ConsumerState& state) const {
    if (tma_sends && threadIdx.x % 128 == 0) {  // every TMA store into the peer (results too)
      dev::bulk_stores_landed();                // before the exit barrier's release (finish)
    }
    if (staging != nullptr) {
      state.outbox.slots = outbox_slots;  // (a consumer without remote tiles never set it)
      outbox_close(state.outbox);
    }
    if (threadIdx.x % 128 == 0) flush(state, dev::Launch::begin(comm));  // (TMA sends too)
    if (threadIdx.x % 128 == 0)
      trace_mark(trace, kTraceConsumer0 + threadIdx.x / 128 - 1, kTraceDone);
  }

  // Producer warps 1..3: CTA 0 announces this launch to the peers; then every CTA's three
  // warps serve its outbox.
  __device__ void side_task(int thread, int threads) const {
    const dev::Launch launch = dev::Launch::begin(comm);
    if (thread == 0) trace_mark(trace, kTraceSide, kTraceSideStart);
    if (blockIdx.x == 0) {
      for (int peer = thread; peer < comm.local_size; peer += threads) {
        if (peer != comm.local_rank) launch.signal(peer, dev::signal_index(SignalId::kEntry, 0), 1);
      }
    }
    if (staging == nullptr) return;
    EnteredPeers entered;  // thread 0's
    outbox_serve(
        comm, !single_peer, [&](int peer) { return entered.ensure(launch, peer); },
        [&](int peer) {  // in floats: peer's C minus this rank's (same offset, other mapping)
          return static_cast<int64_t>(reinterpret_cast<uintptr_t>(out_peers[peer]) -
                                      reinterpret_cast<uintptr_t>(out_peers[comm.local_rank])) /
                 4;
        },
        trace);
    if (thread == 0) trace_mark(trace, kTraceSide, kTraceSideEnd);
  }

  // Every thread: meet the same CTA of every rank (all pushes into C have landed), then end.
  __device__ void finish() const {
    const dev::Launch launch = dev::Launch::begin(comm);
    launch.channel_barrier(SignalId::kExit, blockIdx.x, 1);
    launch.end();
  }
};

}  // namespace mk::fused
