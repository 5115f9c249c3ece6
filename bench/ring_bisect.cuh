// bench_ring_bisect's variants: the ring attention kernel at world 1 with one piece at a time
// of its policy replaced by what the plain engine does there (issue 32: the ring launch runs
// 5-11% longer than the engine on the same work even at world 1, where it exchanges nothing;
// docs/design/attention.md). At world 1 every replacement computes the same thing, so each
// variant's time against the ring's says what that piece costs, and the variant with all of them
// against the engine says what is left outside the policy.
//
// A variant is RingVariant<D, bits>, a RingAttention<D> whose hooks the kernel finds first
// (the derived struct's names hide the base's):
//   kEngineRegs   setmaxnreg split 40 / 232 (the engine's) instead of 56 / 224
//   kEngineOrder  the producer loads K(i), V(i) (the engine's) instead of K(i), V(i - 1)
//   kOneStep      num_steps() a constant 1: the kernel's step loop compiled away
//   kClosedWalk   item() and kv_block() without the walk over the round's steps (one step)
//   kEngineMask   mask() as the engine's block_mask (on the part's block)
//   kNoCarry      load_state / store_state empty, carry_in / carry_out false: the carried
//                 softmax state's paths compiled away
//   kNoSide       side_task, step_done and finish empty (the side warps, the done counters and
//                 the launch's end)
//   kMaps4d       Q, K, V and O through the engine's 4-D maps (D, H, S, B) instead of the 5-D
//                 (D, H, L, P, B)
//   kEngineBlocks a causal tile of the later part visits its own part's keys first, from the
//                 diagonal down, then the earlier part's - the engine's order (the ring's visits
//                 the earlier part first); O then differs from the ring's in rounding only
// kClosedWalk, kEngineMask and kEngineBlocks work a block out in closed form at world 1 (no step
// walk, no read of the communicator's tables: neither kernel's loop has one).
#pragma once

#include <cuda.h>
#include <cuda_runtime_api.h>

#include <vector>

#include "attention/attention_kernel.cuh"
#include "attention/ring_attention.cuh"
#include "mkernel/device/tma.cuh"

namespace mk::bench::ring_bisect {

enum Bits : int {
  kEngineRegs = 1,
  kEngineOrder = 2,
  kOneStep = 4,
  kClosedWalk = 8,
  kEngineMask = 16,
  kNoCarry = 32,
  kNoSide = 64,
  kMaps4d = 128,
  kEngineBlocks = 256,
  kAllBits = 511,
};
constexpr int kEngine = -1;  // the plain engine (PlainAttention), the baseline
// The library's one-round ring (RingAttention<D, true>: the carried state compiled out), which
// ring_attention launches on one node up to 1 + kRingSlots ranks.
constexpr int kOneRoundRing = -2;

template <int kHeadDim, int kBits>
struct RingVariant : attention_engine::RingAttention<kHeadDim> {
  using Base = attention_engine::RingAttention<kHeadDim>;
  using WorkItem = attention_engine::WorkItem;
  using BlockMask = attention_engine::BlockMask;
  using KvBlock = typename Base::Block;
  static constexpr int kORegs = kHeadDim / 2;
  static constexpr int kProducerRegs = (kBits & kEngineRegs) ? 40 : Base::kProducerRegs;
  static constexpr int kConsumerRegs = (kBits & kEngineRegs) ? 232 : Base::kConsumerRegs;
  static constexpr bool kKeysAhead = (kBits & kEngineOrder) ? false : Base::kKeysAhead;

  // (kMaps4d) The user's tensors as the plain engine maps them.
  CUtensorMap q4, k4, v4, o4;

  __device__ int num_steps() const {
    if constexpr ((kBits & kOneStep) != 0) {
      return 1;
    } else {
      return Base::num_steps();
    }
  }

  // World 1, one round of one step: the blocks a tile of part `part` sees in key part 0 and 1
  // (causal zigzag of one rank: part 0 is rows [0, L), part 1 rows [L, 2L)).
  __device__ void counts(int part, int m, int& n0, int& n1) const {
    n0 = this->causal && part == 0 ? m + 1 : this->blocks_per_part;
    n1 = this->causal && part == 1 ? m + 1 : 0;
  }
  __device__ KvBlock closed_block(const WorkItem& w, int i) const {
    int n0, n1;
    counts(w.part, w.m, n0, n1);
    const bool first = i == 0;
    if constexpr ((kBits & kEngineBlocks) != 0) {  // own part first, from the diagonal down
      return i < n1 ? KvBlock{0, 1, n1 - 1 - i, first} : KvBlock{0, 0, n0 + n1 - 1 - i, first};
    } else {
      return i < n0 ? KvBlock{0, 0, n0 - 1 - i, first} : KvBlock{0, 1, n0 + n1 - 1 - i, first};
    }
  }
  static constexpr bool kClosed = (kBits & (kClosedWalk | kEngineBlocks)) != 0;

  __device__ WorkItem item(int round, int t) const {
    if constexpr ((kBits & (kClosedWalk | kNoCarry | kEngineBlocks)) == 0) {
      return Base::item(round, t);
    } else {
      WorkItem w{};
      w.step = round;
      w.index = t;
      const int per_head = this->parts * this->tiles_per_part;
      const int bh = t / per_head;
      const int in_head = this->causal ? per_head - 1 - t % per_head : t % per_head;
      w.batch = bh / this->heads;
      w.head = bh % this->heads;
      w.kv_head = w.head / this->group;
      w.part = in_head / this->tiles_per_part;
      w.m = in_head % this->tiles_per_part;
      if constexpr (kClosed) {
        int n0, n1;
        counts(w.part, w.m, n0, n1);
        w.blocks = n0 + n1;
      } else {
        for (int j = this->first_step(round); j <= this->last_step(round); ++j) {
          int n[2];
          this->step_blocks(w.part, w.m, j, n);
          w.blocks += n[0] + n[1];
        }
      }
      if constexpr ((kBits & kNoCarry) == 0) {
        w.carry_in = round > 0 || this->carry_first;
        w.carry_out = round < this->rounds - 1 || this->carry_last;
      }
      w.mask_hint = this->diagonal_block(w);
      return w;
    }
  }
  __device__ KvBlock kv_block(const WorkItem& w, int i) const {
    if constexpr (kClosed) {
      return closed_block(w, i);
    } else {
      return Base::kv_block(w, i);
    }
  }
  // The engine's arithmetic on the block's part and number (world 1: key part p holds the
  // sequence's rows [p part_len, (p + 1) part_len), the query part likewise).
  __device__ BlockMask mask(const WorkItem& w, int i) const {
    if constexpr ((kBits & (kEngineMask | kEngineBlocks)) != 0) {
      const KvBlock blk = closed_block(w, i);
      const int key0 = blk.part * this->part_len + blk.n * 128;
      const int row0 = w.part * this->part_len + w.m * 128;
      const int kv_len = (blk.part + 1) * this->part_len - key0;
      const int diag = this->causal ? row0 - key0 : (1 << 30);
      return {kv_len < 128 || diag < 127, kv_len, diag};
    } else {
      return Base::mask(w, i);
    }
  }
  __device__ void load_state(float (&acc)[kORegs], float (&m)[2], float (&l)[2], const WorkItem& w,
                             int consumer) const {
    if constexpr ((kBits & kNoCarry) == 0) Base::load_state(acc, m, l, w, consumer);
  }
  __device__ void store_state(const float (&acc)[kORegs], const float (&m)[2], const float (&l)[2],
                              const WorkItem& w, int consumer) const {
    if constexpr ((kBits & kNoCarry) == 0) Base::store_state(acc, m, l, w, consumer);
  }
  __device__ void side_task(int thread, int threads) const {
    if constexpr ((kBits & kNoSide) == 0) Base::side_task(thread, threads);
  }
  __device__ void step_done(int round) const {
    if constexpr ((kBits & kNoSide) == 0) Base::step_done(round);
  }
  __device__ void finish() const {
    if constexpr ((kBits & kNoSide) == 0) Base::finish();
  }
  __device__ void load_q(void* dst, uint64_t* bar, const WorkItem& w) const {
    if constexpr ((kBits & kMaps4d) != 0) {
#pragma unroll
      for (int c = 0; c < kHeadDim / 64; ++c) {
        dev::tma_load_4d(static_cast<uint8_t*>(dst) + c * 128 * 128, &q4, bar, 64 * c, w.head,
                         w.part * this->part_len + w.m * 128, w.batch);
      }
    } else {
      Base::load_q(dst, bar, w);
    }
  }
  __device__ void load_kv(void* dst, uint64_t* bar, const WorkItem& w, const KvBlock& blk,
                          int which) const {
    if constexpr ((kBits & kMaps4d) != 0) {
#pragma unroll
      for (int c = 0; c < kHeadDim / 64; ++c) {
        dev::tma_load_4d(static_cast<uint8_t*>(dst) + c * 128 * 128, which == 0 ? &k4 : &v4, bar,
                         64 * c, w.kv_head, blk.part * this->part_len + blk.n * 128, w.batch);
      }
    } else {
      Base::load_kv(dst, bar, w, blk, which);
    }
  }
  __device__ void store(const float (&acc)[kORegs], const float (&row_lse)[2], const WorkItem& w,
                        int consumer, uint8_t* scratch) const {
    if constexpr ((kBits & kMaps4d) != 0) {
      const int row0 = w.part * this->part_len + w.m * 128 + consumer * 64;
      gemm_engine::store_slice(acc, 0, kHeadDim, consumer, scratch, [&](const uint8_t* buf, int j) {
        dev::tma_store_4d(&o4, buf, 64 * j, w.head, row0, w.batch);
      });
    } else {
      Base::store(acc, row_lse, w, consumer, scratch);
    }
  }
};

// One problem at world 1 (the user's q, k, v, o contiguous [B, S, H, D]), its maps and the
// ring policy's fields, filled by the driver (bench_ring_bisect.cpp); the variants' launchers
// (ring_bisect_variant.cu, one object a variant) copy it into their policy.
struct Setup {
  attention_engine::RingAttention<128> ring;    // the library's fields, at world 1
  attention_engine::PlainAttention<128> plain;  // the engine on the same problem
  CUtensorMap q4, k4, v4, o4;                   // the engine's maps (kMaps4d)
  float scale_log2;
  int ctas;
};

// A variant's launch on `stream` (bits: kEngine or a RingVariant's).
using LaunchFn = void (*)(const Setup&, cudaStream_t);
struct Entry {
  int bits;
  LaunchFn launch;
};
// Every variant linked in (each object registers its own before main).
std::vector<Entry>& registry();

}  // namespace mk::bench::ring_bisect
