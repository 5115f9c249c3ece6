// Ring attention's policy for the attention engine (attention_kernel.cuh): sequence-parallel
// attention over the ranks of one node, in one persistent launch.
//
// Rank r holds S_local queries, keys and values. Non-causal: contiguous shards; causal: zigzag -
// of 2w equal chunks of the sequence rank r holds chunks r and 2w - 1 - r (its two "parts"), so
// that every rank does the same work. Step j (0 .. w - 1) attends this rank's queries to the keys
// of rank s = (r - j) mod w, found
//
//   step 0       in the local k, v (the user's tensors, read by TMA where they are)
//   step j >= 1  in slot (j - 1) % kRingSlots of the workspace, into which rank s's side warps
//                wrote its chunk (pushed: each rank writes its k, v into its peers' slots)
//
// The steps go in rounds: round 0 = steps 0 .. kRingSlots (the local chunk, then as many peer
// chunks as the slots hold), round q >= 1 = steps q kRingSlots + 1 .. (q + 1) kRingSlots. A work
// item is a query tile over one round: its blocks are the visible blocks of the round's chunks one
// after the other (the local chunk's first), so the softmax state stays in registers across them;
// only between rounds (world > 1 + kRingSlots) does it go through the workspace (state_o,
// state_ml: each thread its own registers, written and read back by the same thread, as CTA c
// takes the same tiles in every round).
//
// The copies go in units - one (batch, kv head) of a chunk, S_local x D of K and of V, contiguous
// in the slots (head-major: [B, H_kv, S_local, D]) - in the order the work items need them (the
// items of a head are next to each other), so the first items wait for a few units, not for
// whole chunks. (Copied in memory order, whole chunk by whole chunk, every CTA's first tile
// reached step 1 before its chunk had landed: rounds of step 0 alone were faster then, at the
// price of the state's round trip through the workspace for every tile.) Each rank pushes its
// own k, v: read once from the user's tensors, written straight into the peers' slots (over
// NVLink, stores; no copy of its own first). A unit is copied in kCopyShares shares whatever the
// grid: CTA c takes shares c, c + G, ... (G CTAs), so ranks launched with different CTA counts
// still complete every unit. Side warps of CTA c (the producer warpgroup's warps 1-3):
//   entry barrier on the channel of each of its shares (every peer finished its last launch,
//     which read the slots this rank is about to write)
//   round q, for each step j of it (j >= 1): the destination d = (r + j) mod w, for which this
//     rank's chunk is step j, slot (j - 1) % kRingSlots; if d used that slot in an earlier round
//     (j > kRingSlots), wait until d's consumers finished that round (d's done[], 2 x items)
//   then for each unit u, for each step j of the round: its shares of u of the local k, v ->
//     d's slot; d's arrive[slot][u] += its shares (a system-scope atomic after a fence); signal
//     kOp + share to d with value u + 1 ("units 0 .. u of this share written")
//   producer: before a step's first block in an item, reads arrive[slot][unit]; until it reaches
//             kCopyShares x (the slot's use), waits for rank s's share c % kCopyShares of the
//             unit (a missing peer is named), then for the count; then orders that acquire
//             before its TMA reads (proxy fence)
//   consumers: after a round, done[q] += the CTA's items of the round
// Every (step, unit) a rank's slots receive is waited for by some item's producer there (a
// non-causal item sees every block; in causal zigzag, part 1 - chunk 2w - 1 - r - sees every
// peer's chunk whole, and every (batch, kv head) has part-1 items): so every push into a slot is
// counted before the next use of the slot is pushed, and before the destination's kernel ends.
// Peers read a rank's memory only to poll its done[] before pushing to it. So once a rank's call
// has ended without a time-out, no peer touches its workspace or its k, v. (A schedule that
// skips a unit of a step would break this: its late stores could land in the next use.)
//
// Causal, zigzag: the query part of chunk cq and the key part of chunk ck: ck < cq all visible,
// ck == cq (step 0, same part) causal within the chunk, ck > cq nothing. So a step visits half
// the blocks of the full square at every rank.
//
// Workspace (ring_attention_workspace_bytes): kRingSlots x (K, V); state_o, state_ml (world >
// 1 + kRingSlots only); the counters (zeroed before each launch). None of it grows with the world
// size but done[], a word a round.
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>

#include <cstdint>

#include "attention/attention_kernel.cuh"
#include "mkernel/device/launch.cuh"
#include "mkernel/device/sync.cuh"
#include "mkernel/device/tma.cuh"

namespace mk::attention_engine {

constexpr int kRingSlots = 2;      // chunks in flight besides the local one
constexpr int kMaxRingLocal = 16;  // ranks a node (the ring) across nodes
constexpr int kCopyShares = 128;   // a chunk's copies, whatever the grid (<= channels)
static_assert(kCopyShares <= kMaxChannels, "a share's entry signal is a channel");
// Counter ids (a time-out names them): arrive[slot][unit] = step, done[q] = this + q.
constexpr uint32_t kDoneCounter = 1u << 16;

// Round q's steps (see the header): round 0 = 0 .. kRingSlots, then kRingSlots at a time.
__host__ __device__ constexpr int ring_rounds(int world) {
  return world - 1 <= kRingSlots ? 1 : (world - 2) / kRingSlots + 1;
}
__host__ __device__ constexpr int ring_first_step(int round) {
  return round == 0 ? 0 : round * kRingSlots + 1;
}
__host__ __device__ constexpr int ring_round_of(int step) {
  return step <= kRingSlots ? 0 : (step - 1) / kRingSlots;
}

// kOneRound: the launch is the call's only one and covers every step in one round (one node,
// world <= 1 + kRingSlots): no softmax state ever comes from a round or launch before or goes
// to one after, so its paths (the state's loads and stores, the kernel's step loop) are compiled
// out of the consumers. Otherwise (more ranks, or across nodes) they stay, taken at run time.
// ring_attention takes it for non-causal calls only: causal ones measured slower with it.
template <int kHeadDim, bool kOneRound = false>
struct RingAttention {
  static constexpr int kORegs = kHeadDim / 2;
  // The side warps copy with 2 vectors in flight per lane and keep the schedule's counters.
  static constexpr int kProducerRegs = 56;
  static constexpr int kConsumerRegs = 224;
  static constexpr bool kKeysAhead = true;  // (attention_kernel.cuh: the block walk between loads)

  DeviceComm comm;
  CUtensorMap q;        // (D, H, L, P, B) over the user's q: P parts of L rows
  CUtensorMap o;        // (D, H, L, P, B) over the user's o: boxes of 64 rows
  CUtensorMap k_local;  // (D, H_kv, L, P, B) over the user's k, v
  CUtensorMap v_local;
  CUtensorMap k_slot[kRingSlots];  // the same over the workspace's slots
  CUtensorMap v_slot[kRingSlots];
  float* lse;  // [B, H, S_local] or null
  // Workspace: each local rank's base (+ offset) and the regions' offsets.
  uint8_t* const* peers;
  uint64_t offset;
  uint64_t slots;     // bf16 [kRingSlots][2][B, H_kv, S_local, D]: K then V, units contiguous
  uint64_t state_o;   // float4 [items][2 consumers][kORegs / 4][128 threads]
  uint64_t state_ml;  // float4 [items][2 consumers][128 threads]: m0, m1, l0, l1
  uint64_t counters;  // uint64 arrive[kRingSlots][units], done[rounds]
  // The user's k and v (element strides), which the side warps push.
  const __nv_bfloat16* k_src;
  const __nv_bfloat16* v_src;
  int64_t kv_stride_batch, kv_stride_seq, kv_stride_head;
  int64_t chunk_vectors;  // 16-byte vectors of one of K, V: B S_local H_kv D / 8
  int unit_vectors;       // of one unit: S_local D / 8
  int units;              // B H_kv
  int batch;
  int heads;
  int kv_heads;
  int group;
  int seq_local;
  int parts;  // 2 (causal: zigzag) or 1
  int part_len;
  int tiles_per_part;
  int blocks_per_part;
  int items;
  int rounds;
  bool causal;
  // The ring is the node's ranks (local indices; one node: all of them). Across nodes
  // (ring_nodes.cuh) a launch after the first works on the chunks of another node's ranks:
  // chunk_rank[i] is the global rank whose chunk local rank i holds then (owner(); the zigzag's
  // chunk numbers: 2 world chunks), and
  // the softmax state comes from the launch before (carry_first) and goes on to the next
  // (carry_last).
  int16_t chunk_rank[kMaxRingLocal];
  int world;
  bool carry_first;
  bool carry_last;
  // What every local rank's launch must share (dev::entry_signature of the problem's sizes),
  // compared at the entry.
  uint32_t signature;

  __device__ uint8_t* at(int local_rank, uint64_t field) const {
    return peers[local_rank] + offset + field;
  }
  // Shares of unit u written into `slot` of local rank t, over all its uses (kCopyShares a use:
  // never reset).
  __device__ uint64_t* arrive(int t, int slot, int unit) const {
    return reinterpret_cast<uint64_t*>(at(t, counters)) + slot * units + unit;
  }
  // Local rank t's consumers that finished round q, counted in items (2 x items: all).
  __device__ uint64_t* done(int t) const { return arrive(t, 0, 0) + kRingSlots * units; }
  // The local rank this rank's chunk is step j for.
  __device__ int destination(int step) const {
    const int d = comm.local_rank + step;
    return d < comm.local_size ? d : d - comm.local_size;
  }
  // The global rank whose chunk local rank i holds in this launch: the node's own ranks in the
  // first (one node: the only) launch, another node's later (chunk_rank, filled then only).
  __device__ int owner(int i) const { return carries_in() ? chunk_rank[i] : comm.node_ranks[i]; }
  // Whether the softmax state comes from the launch before (never with kOneRound).
  __device__ bool carries_in() const { return !kOneRound && carry_first; }
  // The chunk (of 2 world, zigzag) that part p of global rank r holds.
  __device__ int chunk_of(int r, int p) const { return p == 0 ? r : 2 * world - 1 - r; }
  // The local rank whose chunk step j reads: (local rank - step) mod ring size, step < that.
  __device__ int source(int step) const {
    const int s = comm.local_rank - step;
    return s < 0 ? s + comm.local_size : s;
  }

  // Rounds of steps (see the header).
  __device__ int num_steps() const { return kOneRound ? 1 : rounds; }
  __device__ int first_step(int round) const { return ring_first_step(round); }
  __device__ int last_step(int round) const {
    return min(comm.local_size - 1, ring_first_step(round + 1) - 1);
  }
  // Visible blocks of query tile (part pq, m) in step j's chunk, per key part.
  __device__ void step_blocks(int pq, int m, int step, int (&n)[2]) const {
    n[0] = blocks_per_part;
    n[1] = 0;
    if (!causal) return;
    const int cq = chunk_of(comm.rank, pq), s = owner(source(step));
    const int last_row = min(part_len, (m + 1) * 128) - 1;
    for (int pk = 0; pk < 2; ++pk) {
      const int ck = chunk_of(s, pk);
      n[pk] = ck < cq ? blocks_per_part : ck == cq ? last_row / 128 + 1 : 0;
    }
  }
  __device__ int num_items() const { return items; }
  __device__ WorkItem item(int round, int t) const {
    WorkItem w{};
    w.step = round;
    w.index = t;
    const int per_head = parts * tiles_per_part;
    const int bh = t / per_head;
    // Causal: the later part (more keys) first within a head.
    const int in_head = causal ? per_head - 1 - t % per_head : t % per_head;
    w.batch = bh / heads;
    w.head = bh % heads;
    w.kv_head = w.head / group;
    w.part = in_head / tiles_per_part;
    w.m = in_head % tiles_per_part;
    for (int j = first_step(round); j <= last_step(round); ++j) {
      int n[2];
      step_blocks(w.part, w.m, j, n);
      w.blocks += n[0] + n[1];
    }
    // On one node round 0 always has blocks (step 0: the diagonal, or everything); across nodes
    // a launch's may have none (a node's chunks all after this tile's): the state carries
    // through.
    w.carry_in = !kOneRound && (round > 0 || carry_first);
    w.carry_out = !kOneRound && (round < num_steps() - 1 || carry_last);
    w.mask_hint = diagonal_block(w);
    return w;
  }
  // Block i of an item: its step, key part and block (each part's from the last down), and
  // whether it is the step's first in the item. The producer finds it once a block (kv_block).
  struct Block {
    int step, part, n;
    bool first;
  };
  using KvBlock = Block;
  __device__ Block kv_block(const WorkItem& w, int i) const { return block_of(w, i); }
  __device__ Block block_of(const WorkItem& w, int i) const {
    for (int j = first_step(w.step);; ++j) {
      int n[2];
      step_blocks(w.part, w.m, j, n);
      if (i < n[0] + n[1] || j == last_step(w.step)) {
        const bool first = i == 0;
        return i < n[0] ? Block{j, 0, n[0] - 1 - i, first}
                        : Block{j, 1, n[0] + n[1] - 1 - i, first};
      }
      i -= n[0] + n[1];
    }
  }

  // Producer, before a block's loads: the item's unit of step j >= 1 is all in its slot.
  __device__ void wait_kv(const WorkItem& w, const Block& blk) const {
    if (!blk.first || blk.step == 0) return;
    const int unit = w.batch * kv_heads + w.kv_head;
    const uint64_t* arrived = arrive(comm.local_rank, (blk.step - 1) % kRingSlots, unit);
    // All kCopyShares shares of the unit in the slot, over the slot's uses so far.
    const uint64_t expected =
        static_cast<uint64_t>(kCopyShares) * ((blk.step - 1) / kRingSlots + 1);
    if (!dev::reached(dev::ld_acquire_sys(arrived), expected)) {  // usually there already
      const dev::Launch launch = dev::Launch::begin(comm);
      // Rank s published share blockIdx.x % kCopyShares of the unit (the wait that names a
      // missing peer), then the shares have landed.
      const int share = static_cast<int>(blockIdx.x) % kCopyShares;
      const int src = comm.node_ranks[source(blk.step)];
      if (launch.wait(src, dev::signal_index(SignalId::kOp, share),
                      static_cast<uint32_t>(unit + 1))) {
        launch.wait_counter(arrived, src, expected, static_cast<uint32_t>(blk.step));
      }
    }
    dev::fence_proxy_async_global();  // the acquire above before the TMA reads of the slot
  }
  __device__ void load_q(void* dst, uint64_t* bar, const WorkItem& w) const {
#pragma unroll
    for (int c = 0; c < kHeadDim / 64; ++c) {
      dev::tma_load_5d(static_cast<uint8_t*>(dst) + c * 128 * 128, &q, bar, 64 * c, w.head,
                       w.m * 128, w.part, w.batch);
    }
  }
  __device__ void load_kv(void* dst, uint64_t* bar, const WorkItem& w, const Block& blk,
                          int which) const {
    const int part = blk.part, n = blk.n;
    const int slot = (blk.step - 1) % kRingSlots;
    const CUtensorMap* map = blk.step == 0 ? (which == 0 ? &k_local : &v_local)
                                           : (which == 0 ? &k_slot[slot] : &v_slot[slot]);
#pragma unroll
    for (int c = 0; c < kHeadDim / 64; ++c) {
      dev::tma_load_5d(static_cast<uint8_t*>(dst) + c * 128 * 128, map, bar, 64 * c, w.kv_head,
                       n * 128, part, w.batch);
    }
  }
  // On the producer's path at D 64, the consumers' at D 128 (AttentionConfig::kProducerMasks):
  // without tail blocks (parts of whole 128-row blocks) the only masked block is causal's
  // diagonal, the first block of step 0's own-chunk run - block 0 for part 0, block
  // blocks_per_part for part 1 (after the whole chunk r) - found without walking the steps.
  // diagonal_block(w): that block's index in item w (-1: none), worked out once an item by item()
  // into w.mask_hint; kSlowMask where the parts are not whole blocks. (Read from the kernel's
  // parameters in the block loop instead, it cost 2-3 dependent constant loads a block between
  // the Q K^T wait and the softmax.)
  static constexpr int kSlowMask = -2;
  __device__ int diagonal_block(const WorkItem& w) const {
    if (part_len % 128 != 0) return kSlowMask;
    // (Only the node's own chunks, launch 0, have a diagonal: step 0's is this rank's own.)
    return causal && !carries_in() && w.step == 0 ? (w.part == 0 ? 0 : blocks_per_part) : -1;
  }
  __device__ BlockMask mask(const WorkItem& w, int i) const {
    if (w.mask_hint != kSlowMask) {
      const bool diagonal = i == w.mask_hint;
      return {diagonal, 128, diagonal ? 0 : (1 << 30)};
    }
    const Block blk = block_of(w, i);
    const int n = blk.n;
    const int kv_len = part_len - n * 128;
    const bool diagonal =
        causal && chunk_of(owner(source(blk.step)), blk.part) == chunk_of(comm.rank, w.part);
    const int diag = diagonal ? (w.m - n) * 128 : (1 << 30);
    return {kv_len < 128 || diag < 127, kv_len, diag};
  }

  __device__ StateImage<kORegs> state() const {
    return {reinterpret_cast<float4*>(at(comm.local_rank, state_o)),
            reinterpret_cast<float4*>(at(comm.local_rank, state_ml))};
  }
  __device__ void load_state(float (&acc)[kORegs], float (&m)[2], float (&l)[2], const WorkItem& w,
                             int consumer) const {
    state().load(acc, m, l, w.index, consumer);
  }
  __device__ void store_state(const float (&acc)[kORegs], const float (&m)[2], const float (&l)[2],
                              const WorkItem& w, int consumer) const {
    state().store(acc, m, l, w.index, consumer);
  }
  __device__ void store(const float (&acc)[kORegs], const float (&row_lse)[2], const WorkItem& w,
                        int consumer, uint8_t* scratch) const {
    const int row0 = w.m * 128 + consumer * 64;
    gemm_engine::store_slice(acc, 0, kHeadDim, consumer, scratch, [&](const uint8_t* buf, int j) {
      dev::tma_store_5d(&o, buf, 64 * j, w.head, row0, w.part, w.batch);
    });
    const int t = threadIdx.x % 128;
    if (lse != nullptr && t % 4 == 0) {
      const int r = row0 + (t / 32) * 16 + (t % 32) / 4;
      float* out = lse + (static_cast<int64_t>(w.batch) * heads + w.head) * seq_local +
                   static_cast<int64_t>(w.part) * part_len;
      if (r < part_len) out[r] = row_lse[0];
      if (r + 8 < part_len) out[r + 8] = row_lse[1];
    }
  }
  // A consumer warpgroup's leader, after its last item of round `round`: its TMA reads of the
  // round's slots are all consumed. Counted in items (this CTA's share of the snake), a number
  // the peers that wait for it know whatever this rank's grid.
  __device__ void step_done(int round) const {
    const int g = static_cast<int>(gridDim.x), c = static_cast<int>(blockIdx.x);
    const int waves = items / g, last = waves % 2 == 0 ? c : g - 1 - c;  // snake_item's order
    const int mine = waves + (last < items % g ? 1 : 0);
    dev::fence_acq_rel_sys();
    atomicAdd_system(reinterpret_cast<unsigned long long*>(done(comm.local_rank) + round),
                     static_cast<unsigned long long>(mine));
  }

  // The copies (see the header). Vector v of unit u is element 8 v of (b, h) = (u / H_kv,
  // u % H_kv): row v / (D / 8), columns 8 (v % (D / 8)) ..; share i of a unit is its vectors
  // [share_begin(i), share_begin(i + 1)).
  __device__ int share_begin(int share) const {
    return static_cast<int>(static_cast<int64_t>(unit_vectors) * share / kCopyShares);
  }
  // Vectors [begin, end) of a unit of the user's k or v (rows kv_stride_seq elements apart) to
  // dst (contiguous, a peer's slot), kInFlight loads in flight a thread.
  __device__ void copy_vectors(uint4* dst, const __nv_bfloat16* src, int begin, int end, int thread,
                               int threads) const {
    constexpr int kInFlight = 2;  // 3 spills at the side warps' 56 registers
    constexpr int d8 = kHeadDim / 8;
    for (int v = begin + thread; v < end; v += kInFlight * threads) {
      uint4 x[kInFlight];
#pragma unroll
      for (int i = 0; i < kInFlight; ++i) {
        const int u = v + i * threads;
        if (u < end) {
          x[i] = *reinterpret_cast<const uint4*>(src + (u / d8) * kv_stride_seq + (u % d8) * 8);
        }
      }
#pragma unroll
      for (int i = 0; i < kInFlight; ++i) {
        if (v + i * threads < end) dst[v + i * threads] = x[i];
      }
    }
  }
  __device__ void side_task(int thread, int threads) const {
    if (comm.local_size == 1) return;
    const dev::Launch launch = dev::Launch::begin(comm);
    const int c = static_cast<int>(blockIdx.x), g = static_cast<int>(gridDim.x);
    if (c >= kCopyShares) return;  // no share: nothing to copy, nothing to count
    // Entry: this rank has entered, on the channel of each of its shares (every peer's owner of
    // that share waits for it); then every local peer has entered this launch - so its last
    // launch, which read its slots, is over - seen on this CTA's first share. The signal is the
    // launch's signature: a peer with other sizes (its slots and counts laid out otherwise) or
    // in another op is found here, before any share moves (a failure: seen at the barrier).
    for (int share = c; share < kCopyShares; share += g) {
      for (int t = thread; t < comm.local_size; t += threads) {
        if (t != comm.local_rank) launch.announce(t, SignalId::kEntry, share, signature);
      }
    }
    for (int t = thread; t < comm.local_size; t += threads) {
      if (t != comm.local_rank) launch.agrees(t, SignalId::kEntry, c, signature);
    }
    // Once a wait has failed the side warps stop working but still meet at every barrier below
    // (the same count on every thread: uniform loops), so no thread waits at one that the others
    // left: each thread reads the failure flags itself, and they may be raised between two
    // threads' reads.
    bool stop = side_barrier(launch, threads);
    for (int round = 0; round < num_steps(); ++round) {
      // The destinations' slots of the round: their last readers there (steps kRingSlots
      // earlier) are done on every CTA of the destination.
      for (int j = max(1, first_step(round)); thread == 0 && !stop && j <= last_step(round); ++j) {
        if (j > kRingSlots) {
          const int d = destination(j), before = ring_round_of(j - kRingSlots);
          stop = !launch.wait_counter(done(d) + before, comm.node_ranks[d], 2ull * items,
                                      kDoneCounter + static_cast<uint32_t>(before));
        }
      }
      stop = side_barrier(launch, threads) || stop;
      for (int unit = 0; unit < units; ++unit) {
        for (int j = max(1, first_step(round)); j <= last_step(round); ++j) {
          push_unit(launch, j, unit, thread, threads, stop);
        }
      }
    }
  }
  // The side warps meet; true when a wait of this launch failed (on any of them, or anywhere on
  // this rank). A plain named barrier and the failure flags a failed wait leaves set (read by
  // each thread), not a barrier reduction: synccheck reported the side warps divergent at a
  // barrier.red.or after the entry waits (only lanes 0 and 1 of the first side warp wait on
  // peers there).
  __device__ static bool side_barrier(const dev::Launch& launch, int threads) {
    dev::named_barrier_sync(kSideBarrier, threads);
    return launch.failed();
  }
  // This CTA's shares of unit `unit` of the local k, v into the slot of step j at its
  // destination, then counted there (arrive) and signalled (kOp + share, value unit + 1).
  // With `stop` (a wait failed) only the barrier: the launch is failing.
  __device__ void push_unit(const dev::Launch& launch, int j, int unit, int thread, int threads,
                            bool stop) const {
    const int c = static_cast<int>(blockIdx.x), g = static_cast<int>(gridDim.x);
    const int d = destination(j);
    const int slot = (j - 1) % kRingSlots;
    const int64_t head = (unit / kv_heads) * kv_stride_batch + (unit % kv_heads) * kv_stride_head;
    uint4* dst = reinterpret_cast<uint4*>(at(d, slots)) + 2 * chunk_vectors * slot +
                 static_cast<int64_t>(unit) * unit_vectors;
    for (int share = c; !stop && share < kCopyShares; share += g) {
      copy_vectors(dst, k_src + head, share_begin(share), share_begin(share + 1), thread, threads);
      copy_vectors(dst + chunk_vectors, v_src + head, share_begin(share), share_begin(share + 1),
                   thread, threads);
    }
    dev::named_barrier_sync(kSideBarrier, threads);
    if (thread == 0 && !stop) {
      const int mine = (kCopyShares - 1 - c) / g + 1;  // shares c, c + g, ... < kCopyShares
      dev::fence_acq_rel_sys();
      atomicAdd_system(reinterpret_cast<unsigned long long*>(arrive(d, slot, unit)),
                       static_cast<unsigned long long>(mine));
      for (int share = c; share < kCopyShares; share += g) {
        launch.signal(d, dev::signal_index(SignalId::kOp, share), static_cast<uint32_t>(unit + 1));
      }
    }
  }
  // The end of the launch (Launch::end: __syncthreads, an aligned barrier). Warp 0's lanes 1-31
  // come here at once while lane 0 still runs the producer loop: they meet it first, so the
  // warp reaches the barrier converged.
  __device__ void finish() const {
    __syncwarp();
    dev::Launch::begin(comm).end();
  }
};

}  // namespace mk::attention_engine
