// What the reducing fused GEMMs share - GEMM + ReduceScatter and GEMM + AllReduce, on one node
// (gemm_rs.cuh, gemm_ar.cuh) and across nodes (gemm_rs_nodes.cuh, gemm_ar_nodes.cuh):
//   ReduceState       a consumer warpgroup's bookkeeping between epilogues: the signal its last
//                     send still owes, who is known to have entered the launch;
//   ReducingFusion    the one-node policies' common part, as a base (CRTP) - the engine's hooks
//                     (store, the ring of the peer's partials, mid_tile, consumer_done,
//                     side_task) written once, around what each policy keeps: its layout (where
//                     a slice lives, its signals, its tensor-map views) and its own-tile finish.
// Each epilogue first raises the signal the warpgroup's previous send owes (its data has landed
// by then), then either sends a peer's tile's slice towards its owner or adds the peers' sums to
// an own tile's slice and finishes it.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "fused/partials.cuh"
#include "fused/reduce_order.h"
#include "fused/reduce_routes.h"
#include "fused/trace.cuh"
#include "gemm/gemm_kernel.cuh"
#include "mkernel/device/launch.cuh"
#include "mkernel/device_comm.h"

namespace mk::fused {

constexpr int kMaxLocalRanks = 8;  // tensor maps of the peers' accumulators travel in the params

// A consumer warpgroup's bookkeeping between epilogues: its thread 0's (the outbox cursor is
// every thread's). Peers are local ranks (on one node the global rank).
struct ReduceState {
  static constexpr uint32_t kByTma = 1u << 31;
  int owed = -1;        // the local rank a signal is owed to for this warpgroup's last send
  uint32_t signal = 0;  // that signal
  // Bit i: local rank i is known to have entered this launch (its previous launch, which read
  // what we write into, is over). kByTma: the owed send left by this thread's TMA stores - a bit
  // here, not a field: the state stays in registers through the mainloop, where one more spilled.
  uint32_t entered = 0;
  uint64_t entered_rail = 0;  // across nodes: bit q, rank q (another node) entered
  OutboxCursor outbox;        // one node: the staging slots (partials.cuh)

  // Thread 0: local rank i (global rank `rank`) may be written to. False: the wait timed out (it
  // is recorded; the launch fails and says so).
  __device__ bool ensure_entered(const dev::Launch& launch, int i, int rank) {
    if (entered & (1u << i)) return true;
    const bool ok = launch.wait(rank, dev::signal_index(SignalId::kEntry, 0), 1);
    entered |= 1u << i;
    return ok;
  }
  // Thread 0, across nodes: rank q of another node has entered (its host-pad announcement).
  __device__ void ensure_rail(const dev::Launch& launch, int q) {
    if ((entered_rail >> q) & 1) return;
    launch.wait_remote(q, kReduceEntrySignal, 1);
    entered_rail |= uint64_t{1} << q;
  }
  // Thread 0: this warpgroup's send to local rank `owner` is announced by `sig` once it has
  // landed (the next flush); `by_tma`: it left by this thread's TMA stores.
  __device__ void owe(int owner, uint32_t sig, bool by_tma = false) {
    owed = owner;
    signal = sig;
    if (by_tma) entered |= kByTma;
  }
  __device__ bool owed_by_tma() const { return (entered & kByTma) != 0; }
  // Thread 0: the owed send has landed (every thread's stores are behind the warpgroup's last
  // barrier; TMA stores waited for here) -> its owner's signal.
  __device__ void flush(const dev::Launch& launch) {
    if (owed < 0) return;
    if (owed_by_tma()) {
      dev::bulk_stores_landed();
      entered &= ~kByTma;
    }
    dev::fence_acq_rel_sys();
    launch.signal(owed, signal, 1);
    owed = -1;
  }
};

// Thread 0 of a consumer, before it reads an own slice's partials: every peer has raised
// `signal` in this launch (each wait bounded by the time limit; after a time-out it stops
// waiting - the launch is failing and says so), each seen with an acquire load (launch.wait: no
// fence afterwards).
__device__ __forceinline__ void wait_for_partials(const DeviceComm& comm, const dev::Launch& launch,
                                                  uint32_t signal) {
  for (int src = 0; src < comm.world_size; ++src) {
    if (src == comm.rank) continue;
    if (!launch.wait(src, signal, 1)) break;
  }
}

// The side threads' record of the peers known to have entered this launch (their thread 0's);
// ensure() waits for a peer's entry signal once. False: the wait timed out (recorded).
struct EnteredPeers {
  uint32_t bits = 0;
  __device__ bool ensure(const dev::Launch& launch, int peer) {
    if (bits & (1u << peer)) return true;
    if (!launch.wait(peer, dev::signal_index(SignalId::kEntry, 0), 1)) return false;
    bits |= 1u << peer;
    return true;
  }
};

// Producer warps of CTA 0: this launch has begun - the entry signal to every other local rank.
__device__ __forceinline__ void announce_entry(const DeviceComm& comm, const dev::Launch& launch,
                                               int thread, int threads) {
  for (int peer = thread; peer < comm.local_size; peer += threads) {
    if (peer != comm.local_rank) launch.signal(peer, dev::signal_index(SignalId::kEntry, 0), 1);
  }
}

// The one-node reducing policies' common part. A policy derives from
// ReducingFusion<Policy, kBlockN> and provides, besides the engine's scheduler hooks (num_tiles,
// tile, wait_operands, a_rows, load_a) and finish():
//   rows()                            rows of the output a tile-row indexes (S, or M)
//   slot(tile, half)                  the op signal of a 64-row half, in the owner's numbering
//   slice_width(tile)                 columns of the tile inside the output
//   own_slice(tile, half, rows, words)  where this rank's accumulator keeps an own slice (rows
//                                     and 32-bit words per row out; rows 0: below the output)
//   load_partial_box(dst, bar, tile, half, box)  the producer's TMA load of one 32-column box of
//                                     the peer's partial (tma_partials)
//   store_tma_chunk(tile, half, buf, j)  thread 0's TMA store of chunk j of a peer's slice into
//                                     the owner's accumulator (tma_sends)
//   tma_sends_slices()                whether whole slices may go that way
//   outbox_slots()                    staging slots per consumer of this CTA (0: no outbox)
//   peer_shift(peer)                  the outbox's broadcast items: local rank peer's copy of the
//                                     output, in floats from this rank's
//   post_to_outbox(acc, tile, half, scratch, state)   stage a peer's slice and post it
//   send_direct(acc, tile, half, scratch, rows)       the epilogue's own send of a peer's slice
//   prepare_shared()                  thread 0, at init_shared (after the outbox and the trace)
//   finish_own(acc, tile, consumer, scratch, state, ring, launch)   an own slice: add the peers'
//                                     sums (add_peer_sums) and store the result
template <class Policy, int kBlockN>
struct ReducingFusion {
  static constexpr gemm_engine::FusionTraits kTraits{.a_rows = true,
                                                     .init_shared = true,
                                                     .mid_tile = true,
                                                     .epilogue_loads = true,
                                                     .producer_regs = 56,    // the outbox's copy
                                                     .consumer_regs = 224};  // loop (partials.cuh)
  using ConsumerState = ReduceState;
  using Ring = RingPartials<kBlockN>;

  DeviceComm comm;
  float* accum_peers[kMaxLocalRanks];  // each local rank's accumulator, mapped here
  bool single_peer;    // two ranks: a slice receives one partial, stored (not added) - plain
                       // NVLink writes, no remote read-modify-write
  bool bf16_partials;  // (single_peer only) partials travel and wait as bf16
  bool tma_partials;   // (single_peer, fp32) whole own tiles' partials come through the ring
  bool tma_sends;      // (single_peer) the epilogue sends by TMA stores where it can
  ReduceOrder order;   // peers' tiles and own tiles in time (reduce_order.h)
  uint64_t* trace;     // timeline records (fused/trace.cuh), or null

  __device__ const Policy& self() const { return static_cast<const Policy&>(*this); }

  __device__ void init_shared() const {
    outbox_init();
    trace_init();
    self().prepare_shared();
  }

  // ---- The peer's partials of a whole own tile through the stage ring (tma_partials) ----
  __device__ bool whole_tile(const gemm_engine::Tile& tile) const {
    return tile.m * 128 + 128 <= self().rows() && self().slice_width(tile) == kBlockN;
  }
  __device__ int epilogue_loads(const gemm_engine::Tile& tile) const {
    return tma_partials && tile.shard == comm.rank && whole_tile(tile) ? Ring::kStages : 0;
  }
  // The producer thread, stage i: before the first, the peer's signals of both slices (bounded
  // waits; after a time-out it loads anyway - the launch fails and says so) and a proxy fence,
  // so that the TMA reads what the acquired signals announced; then the stage's boxes.
  __device__ void load_epilogue(void* dst, uint64_t* bar, const gemm_engine::Tile& tile,
                                int i) const {
    if (i == 0) {
      const dev::Launch launch = dev::Launch::begin(comm);
      wait_for_partials(comm, launch, self().slot(tile, 0));
      wait_for_partials(comm, launch, self().slot(tile, 1));
      dev::fence_proxy_async_global();
    }
    Ring::load(dst, bar, i, [&](void* box_dst, int half, int box) {
      self().load_partial_box(box_dst, bar, tile, half, box);
    });
  }

  // ---- The epilogue ----
  template <int kRegs>
  __device__ void store(float (&acc)[kRegs], const gemm_engine::Tile& tile, int consumer,
                        uint8_t* scratch, ReduceState& state,
                        const gemm_engine::EpilogueRing& ring) const {
    const bool leader = threadIdx.x % 128 == 0;
    if (leader) {
      trace_mark(trace, kTraceConsumer0 + consumer, kTraceStoreBegin, tile.shard != comm.rank);
    }
    // When the CTA's next tile is one of this rank's own, its partial sums start on their way
    // into L2 now, so that its epilogue finds them there.
    if (tile.next >= 0) {
      const gemm_engine::Tile own = self().tile(tile.next);
      int rows = 0, words = 0;
      if (own.shard == comm.rank) {
        const PartialAt at = self().own_slice(own, consumer, rows, words);
        if (rows > 0) prefetch_slice_l2(at, rows, words);
      }
    }
    const dev::Launch launch = dev::Launch::begin(comm);
    if (leader) state.flush(launch);
    state.outbox.slots = self().outbox_slots();
    if (tile.shard != comm.rank) {
      send_peer_slice(acc, tile, consumer, scratch, state, launch);
    } else {
      self().finish_own(acc, tile, consumer, scratch, state, ring, launch);
    }
    if (leader) trace_mark(trace, kTraceConsumer0 + consumer, kTraceStoreEnd);
  }

  // A peer's tile: this consumer's slice goes to its owner - whole by TMA stores when its outbox
  // slot is busy or it has none (tma_sends), else through the outbox, else by the epilogue's own
  // stores; its signal is owed to the next flush.
  template <int kRegs>
  __device__ void send_peer_slice(float (&acc)[kRegs], const gemm_engine::Tile& tile, int consumer,
                                  uint8_t* scratch, ReduceState& state,
                                  const dev::Launch& launch) const {
    const int t = threadIdx.x % 128;
    const int owner = tile.shard;  // one node: global rank = local rank
    const int rows = max(0, min(64, self().rows() - (tile.m * 128 + consumer * 64)));
    const int slots = state.outbox.slots;
    if (self().tma_sends_slices() && rows == 64 && self().slice_width(tile) == kBlockN &&
        (slots == 0 || !outbox_slot_free(consumer, state.outbox))) {
      if (t == 0) {  // (set before the chunks: nothing of the tile stays live across them)
        state.ensure_entered(launch, owner, owner);
        state.owe(owner, self().slot(tile, consumer), /*by_tma=*/true);
      }
      stage_chunks(acc, consumer, scratch, kBlockN, [&](const uint8_t* buf, int j) {
        self().store_tma_chunk(tile, consumer, buf, j);
      });
      return;
    }
    if (slots > 0) {  // one item per remote tile, even if empty
      self().post_to_outbox(acc, tile, consumer, scratch, state);
      return;
    }
    if (rows == 0) return;  // below the output: nothing to send or signal
    if (t == 0) state.ensure_entered(launch, owner, owner);
    self().send_direct(acc, tile, consumer, scratch, rows);
    if (t == 0) state.owe(owner, self().slot(tile, consumer));
  }

  // An own tile, first part (all 128 threads of the consumer): acc += the peers' partial sums of
  // this consumer's slice - from the ring, where the producer waited for them and loaded them,
  // else after waiting for their signals from this rank's accumulator (cleared for the next
  // launch where peers add into it).
  template <int kRegs>
  __device__ void add_peer_sums(float (&acc)[kRegs], const gemm_engine::Tile& tile, int consumer,
                                const gemm_engine::EpilogueRing& ring,
                                const dev::Launch& launch) const {
    const int t = threadIdx.x % 128;
    if (ring.count > 0) {
      add_from_ring<Ring::kPerStage>(acc, ring, consumer, consumer);
    } else {
      int rows = 0, words = 0;
      const PartialAt sums = self().own_slice(tile, consumer, rows, words);
      if (t == 0 && rows > 0) {
        wait_for_partials(comm, launch, self().slot(tile, consumer));
        trace_mark(trace, kTraceConsumer0 + consumer, kTraceWaited);
      }
      dev::named_barrier_sync(1 + consumer, 128);
      if (rows > 0) {
        add_and_clear(acc, sums, rows, bf16_partials ? 2 * words : words,
                      single_peer ? nullptr : sums.second, 1 + consumer, bf16_partials);
      }
    }
    if (t == 0) trace_mark(trace, kTraceConsumer0 + consumer, kTraceAdded);
  }

  // Thread 0 of a consumer, halfway through a tile's k-blocks (gemm_kernel.cuh): the previous
  // epilogue's send, by TMA stores, has long landed - tell its owner now rather than at the next
  // epilogue, a whole mainloop later (the owner's tile may be waiting for it).
  __device__ void mid_tile(ReduceState& state) const {
    if (state.owed_by_tma()) state.flush(dev::Launch::begin(comm));
  }

  __device__ void consumer_done(ReduceState& state) const {
    const bool leader = threadIdx.x % 128 == 0;
    if (tma_sends && leader)
      dev::bulk_stores_landed();                 // every TMA store into a peer, results
                                                 // too, before the end's release
    state.outbox.slots = self().outbox_slots();  // (a consumer without remote tiles never set it)
    outbox_close(state.outbox);
    if (leader) {
      state.flush(dev::Launch::begin(comm));
      trace_mark(trace, kTraceConsumer0 + threadIdx.x / 128 - 1, kTraceDone);
    }
  }

  // Producer warps 1..3: CTA 0 announces this launch to the peers; then every CTA with an outbox
  // serves it.
  __device__ void side_task(int thread, int threads) const {
    const dev::Launch launch = dev::Launch::begin(comm);
    if (thread == 0) trace_mark(trace, kTraceSide, kTraceSideStart);
    if (blockIdx.x == 0) announce_entry(comm, launch, thread, threads);
    if (self().outbox_slots() == 0) return;
    EnteredPeers entered;  // thread 0's
    outbox_serve(
        comm, !single_peer, [&](int peer) { return entered.ensure(launch, peer); },
        [&](int peer) { return self().peer_shift(peer); }, trace);
    if (thread == 0) trace_mark(trace, kTraceSide, kTraceSideEnd);
  }
};

}  // namespace mk::fused
