// Ring attention's policy for the attention engine (attention_kernel.cuh): sequence-parallel
// attention over the ranks of one node, in one persistent launch.
//
// Rank r holds S_local queries, keys and values. Non-causal: contiguous shards; causal: zigzag -
// of 2w equal chunks of the sequence rank r holds chunks r and 2w - 1 - r (its two "parts"), so
// that every rank does the same work. Step j (0 .. w - 1) attends this rank's queries to the keys
// of rank s = (r - j) mod w:
//
//   step 0       the local k, v (the user's tensors, read by TMA where they are)
//   step j >= 1  slot (j - 1) % kSlots of the workspace, into which this rank's side warps copied
//                rank s's chunk (pulled from s's "home", the copy of its k, v it published)
//
//   side warps of CTA c (the producer warpgroup's warps 1-3):
//     entry barrier on channel c (every peer finished its last launch, which read this home)
//     share c of the local k, v -> home; signal kOp + c to every peer ("share c published")
//     for j = 1 .. w - 1: wait until the slot is free (done[j - kSlots] = every consumer of every
//       CTA finished step j - kSlots), wait for rank s's share c, copy it into the slot,
//       arrive[j] += 1
//   producer: before step j's first KV load, waits for arrive[j] = CTAs (the whole chunk), then
//             orders that acquire before its TMA reads (proxy fence)
//   consumers: per step, each of their query tiles against the chunk's visible blocks. A tile's
//              softmax state (O, m, l) carries across steps through the workspace (state_o,
//              state_ml: each thread its own registers, written and read back by the same
//              thread, as CTA c takes the same tiles at every step); the last step that sees
//              the tile normalises and stores O and LSE. After a step, done[j] += 1.
//
// Causal, zigzag: the query part of chunk cq and the key part of chunk ck: ck < cq all visible,
// ck == cq (step 0, same part) causal within the chunk, ck > cq nothing. So a step visits half
// the blocks of the full square at every rank.
//
// Workspace (ring_attention_workspace_bytes): home K, V; kSlots x (K, V); state_o, state_ml; the
// step counters (zeroed before each launch). None of it grows with the world size.
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>

#include <cstdint>

#include "attention/attention_kernel.cuh"
#include "mkernel/device/launch.cuh"
#include "mkernel/device/sync.cuh"
#include "mkernel/device/tma.cuh"

namespace mk::attention_engine {

constexpr int kRingSlots = 2;                // chunks in flight besides the local one
constexpr int kSideBarrier = 3;              // named barrier of the 96 side threads
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

  __device__ int num_steps() const { return comm.world_size; }
  __device__ int num_items() const { return items; }
  __device__ WorkItem item(int step, int t) const {
    WorkItem w{};
    w.step = step;
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
    int n[2] = {blocks_per_part, 0};
    if (causal) {
      const int cq = chunk_of(comm.rank, w.part), s = source(step);
      const int last_row = min(part_len, (w.m + 1) * 128) - 1;
      for (int pk = 0; pk < 2; ++pk) {
        const int ck = chunk_of(s, pk);
        n[pk] = ck < cq ? blocks_per_part : ck == cq ? last_row / 128 + 1 : 0;
      }
    }
    w.kv_split = n[0];
    w.blocks = n[0] + n[1];
    // The tile's first and last steps with blocks: step 0 always has some (the diagonal, or all).
    w.carry_in = step > 0;
    w.carry_out = step < comm.world_size - 1;
    return w;
  }

  // Producer: step j's chunk is all in its slot.
  __device__ void wait_step(int step) const {
    if (step == 0) return;
    const dev::Launch launch = dev::Launch::begin(comm);
    launch.wait_local(arrive() + step, static_cast<uint64_t>(gridDim.x),
                      static_cast<uint32_t>(step));
    dev::fence_proxy_async_global();  // the acquire above before the TMA reads of the slot
  }
  __device__ void load_q(void* dst, uint64_t* bar, const WorkItem& w) const {
#pragma unroll
    for (int c = 0; c < kHeadDim / 64; ++c) {
      dev::tma_load_5d(static_cast<uint8_t*>(dst) + c * 128 * 128, &q, bar, 64 * c, w.head,
                       w.m * 128, w.part, w.batch);
    }
  }
  // Block i: part 0's blocks from the last down, then part 1's.
  __device__ void block_of(const WorkItem& w, int i, int& part, int& n) const {
    if (i < w.kv_split) {
      part = 0;
      n = w.kv_split - 1 - i;
    } else {
      part = 1;
      n = w.blocks - 1 - i;
    }
  }
  __device__ void load_kv(void* dst, uint64_t* bar, const WorkItem& w, int i, int which) const {
    int part, n;
    block_of(w, i, part, n);
    const CUtensorMap* map = w.step == 0 ? (which == 0 ? &k_local : &v_local)
                                         : (which == 0 ? &k_slot[(w.step - 1) % kRingSlots]
                                                       : &v_slot[(w.step - 1) % kRingSlots]);
#pragma unroll
    for (int c = 0; c < kHeadDim / 64; ++c) {
      dev::tma_load_5d(static_cast<uint8_t*>(dst) + c * 128 * 128, map, bar, 64 * c, w.kv_head,
                       n * 128, part, w.batch);
    }
  }
  __device__ BlockMask mask(const WorkItem& w, int i) const {
    int part, n;
    block_of(w, i, part, n);
    const int kv_len = part_len - n * 128;
    const bool diagonal = causal && chunk_of(source(w.step), part) == chunk_of(comm.rank, w.part);
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
  // A consumer warpgroup's leader, after its last item of `step`: its TMA reads of the step's
  // slot are all consumed.
  __device__ void step_done(int step) const {
    __threadfence();
    atomicAdd(reinterpret_cast<unsigned long long*>(done() + step), 1ull);
  }

  // The copies (see the header). Vector v of a chunk is element 8 v of [B, S_local, H_kv, D].
  __device__ int64_t share_begin(int channel) const {
    return chunk_vectors * channel / static_cast<int64_t>(gridDim.x);
  }
  __device__ void side_task(int thread, int threads) const {
    const int world = comm.world_size;
    if (world == 1) return;
    const dev::Launch launch = dev::Launch::begin(comm);
    const int c = static_cast<int>(blockIdx.x);
    const uint32_t entry = dev::signal_index(SignalId::kEntry, c);
    const uint32_t published = dev::signal_index(SignalId::kOp, c);
    // Entry: every local peer has entered this launch.
    bool ok = true;
    for (int t = thread; t < comm.local_size; t += threads) {
      if (t == comm.local_rank) continue;
      dev::fence_acq_rel_sys();
      launch.signal(t, entry, 1);
    }
    for (int t = thread; t < comm.local_size; t += threads) {
      if (t != comm.local_rank) ok = launch.wait(comm.node_ranks[t], entry, 1) && ok;
    }
    if (dev::named_barrier_or(kSideBarrier, threads, !ok)) return;
    // Share c of the local k, v -> home.
    const int64_t begin = share_begin(c), end = share_begin(c + 1);
    const int d8 = kHeadDim / 8;
    uint4* home_k = reinterpret_cast<uint4*>(at(comm.local_rank, home));
    uint4* home_v = home_k + chunk_vectors;
    for (int64_t v = begin + thread; v < end; v += threads) {
      const int64_t dv = v % d8, h = v / d8 % kv_heads, s = v / d8 / kv_heads % seq_local,
                    b = v / d8 / kv_heads / seq_local;
      const int64_t e = b * kv_stride_batch + s * kv_stride_seq + h * kv_stride_head + dv * 8;
      home_k[v] = *reinterpret_cast<const uint4*>(k_src + e);
      home_v[v] = *reinterpret_cast<const uint4*>(v_src + e);
    }
    dev::named_barrier_sync(kSideBarrier, threads);
    for (int t = thread; t < comm.local_size; t += threads) {
      if (t == comm.local_rank) continue;
      dev::fence_acq_rel_sys();
      launch.signal(t, published, 1);
    }
    for (int step = 1; step < world; ++step) {
      const int slot = (step - 1) % kRingSlots;
      // The slot's last reader, step - kRingSlots, is done on every CTA; rank s published.
      ok = true;
      if (thread == 0 && step - kRingSlots >= 1) {
        ok = launch.wait_local(done() + step - kRingSlots, 2ull * gridDim.x,
                               kDoneCounter + static_cast<uint32_t>(step - kRingSlots));
      }
      const int s = source(step);  // one node: local rank = rank
      if (thread == 0 && ok) ok = launch.wait(s, published, 1);
      if (dev::named_barrier_or(kSideBarrier, threads, !ok)) return;
      const uint4* src = reinterpret_cast<const uint4*>(at(s, home));
      uint4* dst = reinterpret_cast<uint4*>(at(comm.local_rank, slots)) + 2 * chunk_vectors * slot;
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
      dev::named_barrier_sync(kSideBarrier, threads);
      if (thread == 0) {
        __threadfence();
        atomicAdd(reinterpret_cast<unsigned long long*>(arrive() + step), 1ull);
      }
    }
  }
  __device__ void finish() const { dev::Launch::begin(comm).end(); }
};

}  // namespace mk::attention_engine
