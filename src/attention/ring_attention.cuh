// Ring attention's policy for the attention engine (attention_kernel.cuh): sequence-parallel
// attention over the ranks of one node, in one persistent launch.
//
// Rank r holds S_local queries, keys and values. Non-causal: contiguous shards; causal: zigzag -
// of 2w equal chunks of the sequence rank r holds chunks r and 2w - 1 - r (its two "parts"), so
// that every rank does the same work. Step j (0 .. w - 1) attends this rank's queries to the keys
// of rank s = (r - j) mod w, found
//
//   step 0       in the local k, v (the user's tensors, read by TMA where they are)
//   step j >= 1  in slot (j - 1) % kRingSlots of the workspace, into which this rank's side
//                warps copied rank s's chunk (pulled from s's "home", the copy of its k, v it
//                published)
//
// The steps go in rounds: round 0 = step 0 alone (the local chunk: while it runs, the side warps
// publish this rank's home and pull the first chunks), round q >= 1 = steps 1 + (q - 1) kRingSlots
// .. q kRingSlots (as many chunks as the slots hold). A work item is a query tile over one round:
// its blocks are the visible blocks of the round's chunks one after the other, so the softmax
// state stays in registers across them; between rounds it goes through the workspace (state_o,
// state_ml: each thread its own registers, written and read back by the same thread, as CTA c
// takes the same tiles in every round). (Round 0 holding steps 0 .. kRingSlots too measured
// slower: every CTA's first tile reached step 1 within tens of microseconds, before the copies.)
//
//   The copies go in kCopyShares shares of a chunk whatever the grid: CTA c takes shares c,
//   c + G, ... (G CTAs), so ranks launched with different CTA counts still copy share for share
//   what their peers published. Side warps of CTA c (the producer warpgroup's warps 1-3), for
//   each of its shares i:
//     entry barrier on channel i (every peer finished its last launch, which read this home)
//     share i of the local k, v -> home; signal kOp + i to every peer ("share i published")
//     for j = 1 .. w - 1: wait until the slot is free (round q >= 2: done[q - 1] = every consumer
//       of every CTA finished round q - 1), wait for rank s's share i, copy it into the slot;
//       then arrive[j] += its shares
//   producer: before a step's first block in an item, waits for rank s's share c % kCopyShares
//             (a missing peer is named), then for arrive[j] = kCopyShares (the whole chunk),
//             then orders that acquire before its TMA reads (proxy fence)
//   consumers: after a round, done[q] += 1
//
// Causal, zigzag: the query part of chunk cq and the key part of chunk ck: ck < cq all visible,
// ck == cq (step 0, same part) causal within the chunk, ck > cq nothing. So a step visits half
// the blocks of the full square at every rank.
//
// Workspace (ring_attention_workspace_bytes): home K, V; kRingSlots x (K, V); state_o,
// state_ml; the counters (zeroed before each launch). None of it grows with the world size.
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>

#include <cstdint>

#include "attention/attention_kernel.cuh"
#include "mkernel/device/launch.cuh"
#include "mkernel/device/sync.cuh"
#include "mkernel/device/tma.cuh"

namespace mk::attention_engine {

constexpr int kRingSlots = 2;     // chunks in flight besides the local one
constexpr int kCopyShares = 128;  // a chunk's copies, whatever the grid (<= channels)
static_assert(kCopyShares <= kMaxChannels, "a share's entry signal is a channel");
constexpr uint32_t kDoneCounter = 1u << 16;  // local counter ids: arrive[j] = j, done[j] = this + j

template <int kHeadDim>
struct RingAttention {
  static constexpr int kORegs = kHeadDim / 2;
  // The side warps copy with 4 vectors in flight per lane and keep the schedule's counters.
  static constexpr int kProducerRegs = 56;
  static constexpr int kConsumerRegs = 224;

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
  uint64_t home;      // bf16 [2][B, S_local, H_kv, D]: K then V, contiguous
  uint64_t slots;     // bf16 [kRingSlots][2][B, S_local, H_kv, D]
  uint64_t state_o;   // float4 [items][2 consumers][kORegs / 4][128 threads]
  uint64_t state_ml;  // float4 [items][2 consumers][128 threads]: m0, m1, l0, l1
  uint64_t counters;  // uint64 arrive[world], done[world]
  // The user's k and v (element strides) for the home copy.
  const __nv_bfloat16* k_src;
  const __nv_bfloat16* v_src;
  int64_t kv_stride_batch, kv_stride_seq, kv_stride_head;
  int64_t chunk_vectors;  // 16-byte vectors of one of K, V: B S_local H_kv D / 8
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

  __device__ uint8_t* at(int local_rank, uint64_t field) const {
    return peers[local_rank] + offset + field;
  }
  __device__ uint64_t* arrive() const {
    return reinterpret_cast<uint64_t*>(at(comm.local_rank, counters));
  }
  __device__ uint64_t* done() const { return arrive() + comm.world_size; }
  // The chunk (of 2w, zigzag) that part p of rank r holds.
  __device__ int chunk_of(int r, int p) const { return p == 0 ? r : 2 * comm.world_size - 1 - r; }
  __device__ int source(int step) const {
    return (comm.rank - step + comm.world_size) % comm.world_size;
  }

  // Rounds of steps (see the header).
  __device__ int num_steps() const { return rounds; }
  __device__ int first_step(int round) const {
    return round == 0 ? 0 : 1 + (round - 1) * kRingSlots;
  }
  __device__ int last_step(int round) const {
    return round == 0 ? 0 : min(comm.world_size - 1, round * kRingSlots);
  }
  // Visible blocks of query tile (part pq, m) in step j's chunk, per key part.
  __device__ void step_blocks(int pq, int m, int step, int (&n)[2]) const {
    n[0] = blocks_per_part;
    n[1] = 0;
    if (!causal) return;
    const int cq = chunk_of(comm.rank, pq), s = source(step);
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
    // Round 0 always has blocks (step 0: the diagonal, or everything).
    w.carry_in = round > 0;
    w.carry_out = round < rounds - 1;
    return w;
  }
  // Block i of an item: its step, key part and block (each part's from the last down), and
  // whether it is the step's first in the item.
  struct Block {
    int step, part, n;
    bool first;
  };
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

  // Producer, before block i: step j >= 1's chunk is all in its slot.
  __device__ void wait_kv(const WorkItem& w, int i) const {
    const Block blk = block_of(w, i);
    if (!blk.first || blk.step == 0) return;
    const dev::Launch launch = dev::Launch::begin(comm);
    // Rank s published share blockIdx.x % kCopyShares (the wait that names a missing peer), then
    // all kCopyShares shares of its chunk have landed in the slot.
    const int share = static_cast<int>(blockIdx.x) % kCopyShares;
    if (launch.wait(source(blk.step), dev::signal_index(SignalId::kOp, share), 1)) {
      launch.wait_local(arrive() + blk.step, static_cast<uint64_t>(kCopyShares),
                        static_cast<uint32_t>(blk.step));
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
  __device__ void load_kv(void* dst, uint64_t* bar, const WorkItem& w, int i, int which) const {
    const Block blk = block_of(w, i);
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
  __device__ BlockMask mask(const WorkItem& w, int i) const {
    const Block blk = block_of(w, i);
    const int n = blk.n;
    const int kv_len = part_len - n * 128;
    const bool diagonal =
        causal && chunk_of(source(blk.step), blk.part) == chunk_of(comm.rank, w.part);
    const int diag = diagonal ? (w.m - n) * 128 : (1 << 30);
    return {kv_len < 128 || diag < 127, kv_len, diag};
  }

  __device__ float4* state_o_of(const WorkItem& w, int consumer) const {
    return reinterpret_cast<float4*>(at(comm.local_rank, state_o)) +
           static_cast<int64_t>(w.index * 2 + consumer) * (kORegs / 4) * 128 + threadIdx.x % 128;
  }
  __device__ float4* state_ml_of(const WorkItem& w, int consumer) const {
    return reinterpret_cast<float4*>(at(comm.local_rank, state_ml)) +
           static_cast<int64_t>(w.index * 2 + consumer) * 128 + threadIdx.x % 128;
  }
  __device__ void load_state(float (&acc)[kORegs], float (&m)[2], float (&l)[2], const WorkItem& w,
                             int consumer) const {
    const float4* so = state_o_of(w, consumer);
#pragma unroll
    for (int j = 0; j < kORegs / 4; ++j) {
      const float4 v = so[j * 128];
      acc[4 * j] = v.x;
      acc[4 * j + 1] = v.y;
      acc[4 * j + 2] = v.z;
      acc[4 * j + 3] = v.w;
    }
    const float4 ml = *state_ml_of(w, consumer);
    m[0] = ml.x;
    m[1] = ml.y;
    l[0] = ml.z;
    l[1] = ml.w;
  }
  __device__ void store_state(const float (&acc)[kORegs], const float (&m)[2], const float (&l)[2],
                              const WorkItem& w, int consumer) const {
    float4* so = state_o_of(w, consumer);
#pragma unroll
    for (int j = 0; j < kORegs / 4; ++j) {
      so[j * 128] = make_float4(acc[4 * j], acc[4 * j + 1], acc[4 * j + 2], acc[4 * j + 3]);
    }
    *state_ml_of(w, consumer) = make_float4(m[0], m[1], l[0], l[1]);
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
  // round's slots are all consumed.
  __device__ void step_done(int round) const {
    __threadfence();
    atomicAdd(reinterpret_cast<unsigned long long*>(done() + round), 1ull);
  }

  // The copies (see the header). Vector v of a chunk is element 8 v of [B, S_local, H_kv, D].
  __device__ int64_t share_begin(int share) const { return chunk_vectors * share / kCopyShares; }
  __device__ void side_task(int thread, int threads) const {
    const int world = comm.world_size;
    if (world == 1) return;
    const dev::Launch launch = dev::Launch::begin(comm);
    const int c = static_cast<int>(blockIdx.x), g = static_cast<int>(gridDim.x);
    if (c >= kCopyShares) return;  // no share: nothing to copy, nothing to count
    // Entry: this rank has entered, on the channel of each of its shares (every peer's owner of
    // that share waits for it); then every local peer has entered this launch - so its last
    // launch, which read this home, is over - seen on the channel of this CTA's first share.
    for (int share = c; share < kCopyShares; share += g) {
      for (int t = thread; t < comm.local_size; t += threads) {
        if (t == comm.local_rank) continue;
        dev::fence_acq_rel_sys();
        launch.signal(t, dev::signal_index(SignalId::kEntry, share), 1);
      }
    }
    bool ok = true;
    for (int t = thread; t < comm.local_size; t += threads) {
      if (t != comm.local_rank) {
        ok = launch.wait(comm.node_ranks[t], dev::signal_index(SignalId::kEntry, c), 1) && ok;
      }
    }
    if (dev::named_barrier_or(kSideBarrier, threads, !ok)) return;
    // This CTA's shares of the local k, v -> home.
    const int d8 = kHeadDim / 8;
    uint4* home_k = reinterpret_cast<uint4*>(at(comm.local_rank, home));
    uint4* home_v = home_k + chunk_vectors;
    int mine = 0;  // shares of this CTA
    for (int share = c; share < kCopyShares; share += g, ++mine) {
      const int64_t end = share_begin(share + 1);
      for (int64_t v = share_begin(share) + thread; v < end; v += threads) {
        const int64_t dv = v % d8, h = v / d8 % kv_heads, s = v / d8 / kv_heads % seq_local,
                      b = v / d8 / kv_heads / seq_local;
        const int64_t e = b * kv_stride_batch + s * kv_stride_seq + h * kv_stride_head + dv * 8;
        home_k[v] = *reinterpret_cast<const uint4*>(k_src + e);
        home_v[v] = *reinterpret_cast<const uint4*>(v_src + e);
      }
    }
    dev::named_barrier_sync(kSideBarrier, threads);
    for (int share = c; share < kCopyShares; share += g) {
      const uint32_t published = dev::signal_index(SignalId::kOp, share);
      for (int t = thread; t < comm.local_size; t += threads) {
        if (t == comm.local_rank) continue;
        dev::fence_acq_rel_sys();
        launch.signal(t, published, 1);
      }
    }
    for (int step = 1; step < world; ++step) {
      const int slot = (step - 1) % kRingSlots;
      // The slot's last readers, the previous round, are done on every CTA.
      const int round = (step - 1) / kRingSlots + 1;
      ok = true;
      if (thread == 0 && round >= 2) {
        ok = launch.wait_local(done() + round - 1, 2ull * gridDim.x,
                               kDoneCounter + static_cast<uint32_t>(round - 1));
      }
      if (dev::named_barrier_or(kSideBarrier, threads, !ok)) return;
      const int s = source(step);  // one node: local rank = rank
      const uint4* src = reinterpret_cast<const uint4*>(at(s, home));
      uint4* dst = reinterpret_cast<uint4*>(at(comm.local_rank, slots)) + 2 * chunk_vectors * slot;
      // Rank s published this CTA's shares (its owners of them copied them home).
      for (int share = c; thread == 0 && ok && share < kCopyShares; share += g) {
        ok = launch.wait(s, dev::signal_index(SignalId::kOp, share), 1);
      }
      if (dev::named_barrier_or(kSideBarrier, threads, !ok)) return;
      for (int share = c; share < kCopyShares; share += g) {
        const int64_t begin = share_begin(share), end = share_begin(share + 1);
        for (int part = 0; part < 2; ++part) {  // K, then V
          const int64_t base = part * chunk_vectors;
          constexpr int kInFlight = 4;
          for (int64_t v = begin + thread; v < end; v += kInFlight * threads) {
            uint4 x[kInFlight];
#pragma unroll
            for (int i = 0; i < kInFlight; ++i) {
              const int64_t u = v + static_cast<int64_t>(i) * threads;
              if (u < end) x[i] = dev::load_l2(src + base + u);
            }
#pragma unroll
            for (int i = 0; i < kInFlight; ++i) {
              const int64_t u = v + static_cast<int64_t>(i) * threads;
              if (u < end) dst[base + u] = x[i];
            }
          }
        }
      }
      dev::named_barrier_sync(kSideBarrier, threads);
      if (thread == 0) {
        __threadfence();
        atomicAdd(reinterpret_cast<unsigned long long*>(arrive() + step),
                  static_cast<unsigned long long>(mine));
      }
    }
  }
  __device__ void finish() const { dev::Launch::begin(comm).end(); }
};

}  // namespace mk::attention_engine
