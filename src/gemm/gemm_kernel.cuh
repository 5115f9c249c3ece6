// The GEMM engine's kernel: persistent, warp-specialised, TMA + wgmma (sm_90a).
//
//   C (bf16) = A (bf16, row-major, K-major tiles) * B^T, fp32 accumulation, where B is [N, K]
//   row-major (the nn.Linear weight layout, K-major tiles) or, with kTransB, [K, N] row-major
//   (N-major tiles: the B stage holds kBlockN / 64 boxes of [64 K rows][64 N values]).
//
// One CTA per SM. Warpgroup 0 is the producer (one thread issues TMA loads of A and B tiles into
// a ring of kStages shared-memory stages; its other three warps are free for a fused kernel's side
// task, e.g. pushing this rank's rows to its peers - with gather_a all four warps copy A's rows,
// the three others once their side task is done: produce_gathered); warpgroups 1..kConsumers are
// consumers, each owning 64 rows of the kBlockM-row tile (128; the plain GEMM also 64 and 192)
// and issuing wgmma on them.
//
// The kernel is the mainloop; a Fusion policy supplies everything else, so that the plain GEMM and
// the fused kernels share it (see PlainGemm below for the trivial one). Every policy has
//   num_tiles(), tile(t)          scheduler: which output tile the t-th work item is (and
//                                 which of its k-blocks: Tile::kb_begin, kb_end)
//   wait_operands(tile)           producer, before the tile's first load (fused: "rows arrived")
//   load_a(dst, bar, tile, k0)    TMA of the tile's A box (the policy knows where A lives);
//                                 not with gather_a (below), whose A comes from a_row
//   store(acc, tile, consumer, scratch, state)   epilogue: where a consumer's 64 x kBlockN slice
//                                 goes (state: the policy's ConsumerState, kept across tiles)
//   consumer_done(state)          each consumer warpgroup, after its last tile
//   side_task(thread, threads)    producer warps 1..3 (96 threads): communication, or nothing
//   finish()                      every thread, last (fused: end of the launch's bookkeeping)
// and declares in `static constexpr FusionTraits kTraits` which of these it also provides:
// (kTraits.split_k: the scheduler's tiles carry their k-blocks - Tile::kb_begin, kb_end - and
// the epilogue adds up the pieces: SplitSchedule below; otherwise every item runs all of K)
//   a_rows(tile)                  rows of the tile's A box (default kBlockM); a tile-row at the
//                                 matrix edge loads only its rows (below)
//   init_shared()                 thread 0, before the first __syncthreads (mbarriers)
//   mid_tile(state)               a consumer's thread 0 halfway through each tile's k-blocks
//                                 (e.g. to signal what its previous epilogue sent, once landed,
//                                 without waiting for the next one)
//   epilogue_loads(tile)          stages of the ring the tile's epilogue reads after its
//   load_epilogue(dst, bar, tile, i)  k-blocks - the producer fills stage i (arms `bar` and
//                                 issues its TMA loads, e.g. a peer's partial sums) - and
//                                 store(..., ring) gets them as an EpilogueRing (below)
//   tile_counter()                dynamic_tiles: a zeroed int the CTAs take work items from
//   consumer_prologue(thread, threads)  every consumer thread (128 x kConsumers), before its
//                                 first tile: work for warps that would only wait for the first
//                                 tile's operands (moe_dispatch_gemm: the sends to its peers)
//   a_row(tile, r)                gather_a: where row r of the tile's A starts (K contiguous,
//                                 16-byte aligned), or null for a row with nothing to load; A is
//                                 then gathered row by row (produce_gathered, below), not loaded
//                                 with load_a
// with its batched B and register split. check_fusion<Cfg, Fusion>() holds the declaration
// against the members: a misspelt or missing hook, or one present but not declared, fails to
// compile (each policy static_asserts it for its widths; the kernel once more).
//
//   smem:     [ stage 0 | ... | stage S-1 | epilogue buffers | full[S] | empty[S] | tile ring ]
//   stage s:  [ A tile (kBlockM x 64) | B tile (kBlockN x 64) ]   both 128-byte swizzled
//   producer: wait empty[s] -> arm full[s] with the stage's bytes -> TMA A, TMA B
//             (gather_a: the warpgroup's four warps, the side warps once their side task is
//             done - warp 0's lane 0 arms full[s] with B's bytes, TMA B; every thread copies its
//             pieces of A's rows and arrives on full[s] once they land)
//   consumer: wait full[s] -> 4 x wgmma k16 -> commit; once the previous stage's group retired,
//             arrive empty[prev]
// Partial tiles: TMA reads out-of-bounds elements as zero (K, M and N tails), and the epilogue's
// TMA stores clip at the matrix edge. A box that crosses the edge loads far more slowly than one
// inside it (about half as fast: docs/PERFORMANCE.md, 2026-12-01), so a policy whose last tile-row
// is short loads it with a box of its rows alone (a_rows): the rest of the stage's A keeps stale
// data, whose output rows lie below C and are never stored.
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>

#include <concepts>
#include <cstdint>

#include "gemm/gather_layout.h"
#include "mkernel/device/cluster.cuh"
#include "mkernel/device/cp_async.cuh"
#include "mkernel/device/mbarrier.cuh"
#include "mkernel/device/tma.cuh"
#include "mkernel/device/wgmma.cuh"

namespace mk::gemm_engine {

// kMaxStages: a cap on the stage ring below what fits (bench/bench_stages.cu measures what a
// stage is worth; the library's is EngineTileConfig's, below). kBlockM: 128 rows (two consumer
// warpgroups), or for the plain GEMM 64 (one: decode batches, M <= 64 - half the A bytes of a
// stage, so more of B in flight) or 192 (three: M 129..192 in one tile-row instead of two).
template <int kBlockN_, int kMaxStages = 8, int kBlockM_ = 128, int kEpilogueBuffers_ = 2>
struct TileConfig {
  static constexpr int kBlockM = kBlockM_;  // 64 rows per consumer warpgroup
  static constexpr int kBlockN = kBlockN_;  // 64, 128, 192 or 256 (the plain GEMM: kStepWidths)
  static constexpr int kBlockK = 64;        // 64 bf16 = 128 bytes = one swizzle row
  static constexpr int kConsumers = kBlockM / 64;
  static constexpr int kThreads = 128 * (1 + kConsumers);
  // Registers per thread the CTA is launched with (64 K over its threads, in steps of 8), which
  // setmaxnreg moves between the producer and the consumers: 168 at 384 threads, 128 at 512.
  static constexpr int kRegsPerThread = 65536 / kThreads / 8 * 8;
  static constexpr int kABytes = kBlockM * kBlockK * 2;
  static constexpr int kBBytes = kBlockN * kBlockK * 2;
  static constexpr int kStageBytes = kABytes + kBBytes;
  // Epilogue staging: per consumer, two 64 x 64 bf16 buffers (one filling while one is stored),
  // or one (store_slice packs a chunk once the last one's store has read it).
  static constexpr int kEpilogueBuffers = kEpilogueBuffers_;
  static constexpr int kEpilogueBytes = kConsumers * kEpilogueBuffers * 64 * 64 * 2;
  // As many stages as fit (at most kMaxStages) next to the epilogue buffers, the barriers and
  // the 1024 bytes spent aligning everything to the swizzle atom.
  static constexpr int kSmemLimit = 227 * 1024;
  // The tile ring (dynamic tiles): kTileSlots full and empty barriers and work items.
  static constexpr int kTileSlots = 4;
  static constexpr int kTileRingBytes = kTileSlots * (2 * 8 + 4);
  static constexpr int kStages =
      (kSmemLimit - 1024 - kEpilogueBytes - 256 - kTileRingBytes) / kStageBytes < kMaxStages
          ? (kSmemLimit - 1024 - kEpilogueBytes - 256 - kTileRingBytes) / kStageBytes
          : kMaxStages;
  // Barriers: full[kStages], empty[kStages]; then the tile ring.
  static constexpr int kSmemBytes =
      1024 + kStages * kStageBytes + kEpilogueBytes + 2 * kStages * 8 + kTileRingBytes;
  static constexpr int kAccRegs = kBlockN / 2;  // fp32 accumulators per consumer thread
  static_assert(kStages >= 3, "too few pipeline stages fit");
  static_assert(kSmemBytes <= kSmemLimit, "shared memory per CTA on sm_90");
  static_assert(kBlockN % 16 == 0 && kBlockN >= 64 && kBlockN <= 256,
                "tile widths of wgmma_ops.cuh");
  static_assert(kBlockM == 64 || kBlockM == 128 || kBlockM == 192,
                "one, two or three consumer warpgroups");
  static_assert(kEpilogueBuffers == 1 || kEpilogueBuffers == 2, "one or two epilogue buffers");
};

// The lean epilogue: one buffer a consumer where the second one's bytes would buy the ring a
// stage and the tile is narrow (at most 80 columns: 80 at 128 rows, 64 at 192), else two. A
// stage more keeps more of the operands in flight where a stage is small; one buffer costs a
// wait a chunk past the first, once a tile. Of the wider tiles that would gain a stage, 96 and
// 192 at 128 rows measured slower with it, 144 at 128 rows and 128 at 192 no faster, and 128 at
// 64 rows was not measured (docs/design/gemm_decode.md, "The lean epilogue").
template <int kBlockN, int kMaxStages, int kBlockM>
constexpr int lean_epilogue_buffers() {
  return kBlockN <= 80 && TileConfig<kBlockN, kMaxStages, kBlockM, 1>::kStages >
                              TileConfig<kBlockN, kMaxStages, kBlockM, 2>::kStages
             ? 1
             : 2;
}

// The tile configurations the library launches: at most 8 stages, or at 64 rows as many as fit
// up to 16 (their stages are small; a CTA streaming weights wants its bytes in flight); the lean
// epilogue's buffers where asked (FusionTraits::lean_epilogue).
constexpr int engine_max_stages(int block_m) { return block_m == 64 ? 16 : 8; }
template <int kBlockN, int kBlockM = 128, bool kLeanEpilogue = false>
using EngineTileConfig =
    TileConfig<kBlockN, engine_max_stages(kBlockM), kBlockM,
               kLeanEpilogue ? lean_epilogue_buffers<kBlockN, engine_max_stages(kBlockM), kBlockM>()
                             : 2>;
// A policy's configuration at a width and height: its traits say whether the epilogue is lean.
template <int kBlockN, class Fusion, int kBlockM = 128>
using FusionTileConfig = EngineTileConfig<kBlockN, kBlockM, Fusion::kTraits.lean_epilogue>;

// The stage ring's start: the dynamic shared memory, aligned to the 1024 bytes of the 128-byte
// swizzle's atom.
__device__ __forceinline__ uint8_t* stage_ring() {
  extern __shared__ uint8_t smem_raw[];
  return reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) &
                                    ~uintptr_t{1023});
}

// Persistent tile order: CTAs walk work items t = blockIdx.x, blockIdx.x + gridDim.x, ... (or,
// with dynamic tiles, blockIdx.x and then whichever item is next when the CTA is free);
// tiles are numbered in groups of kGroupM tile-rows, column by column inside a group, so the CTAs
// running at the same time share A rows and B columns in L2.
struct GroupedRaster {
  static constexpr int kGroupM = 16;
  int tiles_m;
  int tiles_n;

  __device__ int num_tiles() const { return tiles_m * tiles_n; }
  __device__ void tile(int t, int& tm, int& tn) const {
    const int per_group = kGroupM * tiles_n;
    const int first_m = (t / per_group) * kGroupM;
    const int rows = min(tiles_m - first_m, kGroupM);
    const int in_group = t % per_group;
    tm = first_m + in_group % rows;
    tn = in_group / rows;
  }
};

// One output tile: tile-row m (of `shard`'s rows, for kernels whose A comes in shards) and
// tile-column n.
struct Tile {
  int m;
  int n;
  int shard;      // or, for a grouped GEMM, the group (B's third coordinate)
  int row = 0;    // grouped GEMM: the tile's first row in A and C
  int rows = 0;   // grouped GEMM: rows of the tile inside its group (<= 128 means a partial tile)
  int next = -1;  // epilogue: the position (work item t) of this consumer's next tile, or -1
  int position = -1;  // epilogue: this tile's position (work item t)
  int kb_begin = 0;   // the work item's k-blocks [kb_begin, kb_end): a piece of K (split K);
  int kb_end = -1;    // -1: to the last
};

// The stages of the ring that follow a tile's k-blocks for its epilogue (Fusion::epilogue_loads):
// `count` of them from ring position `first`. Every consumer waits for each stage, reads what it
// needs and releases it (the stage's empty barrier counts them all). count 0: none.
struct EpilogueRing {
  uint8_t* stages = nullptr;
  uint64_t* full = nullptr;
  uint64_t* empty = nullptr;
  int stage_bytes = 0;
  int num_stages = 0;
  int first = 0;
  int count = 0;

  // All threads of a consumer: waits for stage i's loads and returns its shared memory.
  __device__ const uint8_t* wait(int i) const {
    const int it = first + i, s = it % num_stages;
    dev::mbarrier_wait(&full[s], (it / num_stages) & 1);
    return stages + s * stage_bytes;
  }
  // All threads of a consumer, done reading stage i: the producer may refill it.
  __device__ void release(int i, int consumer) const {
    dev::named_barrier_sync(1 + consumer, 128);
    if (threadIdx.x % 128 == 0) dev::mbarrier_arrive(&empty[(first + i) % num_stages]);
  }
};

// Rows of the last tile-row of an M-row matrix (1..block_m).
__host__ __device__ constexpr int last_tile_rows(int64_t m, int block_m = 128) {
  return static_cast<int>(m - (m - 1) / block_m * block_m);
}

// What a Fusion policy declares about itself (`static constexpr FusionTraits kTraits`): the
// optional hooks it provides (signatures in the header above), whether its B is batched
// ([batches][...], the tile's `shard` picks the batch: 3-D boxes) or loaded by the policy itself
// (load_b(dst, bar, tile, k0): a stage's kBBytes of B, as the engine's boxes would lay it out -
// e.g. rows gathered from two places of one matrix), and the registers per thread
// of the producer and the consumer warpgroups (side work may need more than the defaults).
// setmaxnreg moves registers within what the CTA was launched with - TileConfig::kRegsPerThread,
// 168 at two consumer warpgroups - so producer + 2 x consumer must stay within 3 x 168 = 504
// (4 x 128 = 512 with three), or the consumers' allocation waits forever.
struct FusionTraits {
  bool a_rows = false;
  bool init_shared = false;
  bool mid_tile = false;
  bool epilogue_loads = false;
  bool batched_b = false;
  bool load_b = false;
  bool split_k = false;  // work items may be pieces of a tile's k-blocks (Tile::kb_begin, kb_end)
  // Work items after a CTA's first taken in order from a counter (tile_counter(): zero before the
  // launch) by whichever CTA is free, instead of t += gridDim.x: from their second tile on, the
  // tiles that run side by side stay neighbours in the order - sharing their rows' and weights'
  // tiles in L2 - however long each takes or late each CTA got going. The producer takes an item
  // and hands it to the consumers through a ring in shared memory; Tile::next is then -1. Not
  // for a policy whose finish() or shared-memory setup counts on the static order (PlainGemm's
  // split K, gemm_rs).
  bool dynamic_tiles = false;
  bool consumer_prologue = false;
  // A's rows from a_row(tile, r), copied by the producer warpgroup's four warps (warps 1..3
  // after side_task; produce_gathered). Needs dynamic_tiles.
  bool gather_a = false;
  // The lean epilogue (EngineTileConfig): for a policy whose stores all go through
  // store_slice<Cfg::kEpilogueBuffers>, the only user of the epilogue's shared memory.
  bool lean_epilogue = false;
  int producer_regs = 40;
  int consumer_regs = 232;
};

// The hooks every policy has, with their signatures (kRegs: a consumer's accumulator registers).
template <class F, int kRegs>
concept FusionBase = requires(const F f, const Tile& tile, int i, float (&acc)[kRegs],
                              uint8_t* scratch, typename F::ConsumerState& state) {
  { F::kTraits } -> std::convertible_to<FusionTraits>;
  { f.num_tiles() } -> std::same_as<int>;
  { f.tile(i) } -> std::same_as<Tile>;
  { f.wait_operands(tile) } -> std::same_as<void>;
  { f.consumer_done(state) } -> std::same_as<void>;
  { f.side_task(i, i) } -> std::same_as<void>;
  { f.finish() } -> std::same_as<void>;
};

// Whether F provides each optional hook, as the engine calls it. (load_a: every policy whose A
// is not gathered.)
template <class F>
concept HasLoadA = requires(const F f, void* dst, uint64_t* bar, const Tile& tile, int k0) {
  { f.load_a(dst, bar, tile, k0) } -> std::same_as<void>;
};
template <class F>
concept HasARows = requires(const F f, const Tile& tile) {
  { f.a_rows(tile) } -> std::same_as<int>;
};
template <class F>
concept HasLoadB = requires(const F f, void* dst, uint64_t* bar, const Tile& tile, int k0) {
  { f.load_b(dst, bar, tile, k0) } -> std::same_as<void>;
};
// load_b_tail(dst, bar, tile, k0): B [K, N]'s last 16 or 32 columns of a step-width tile (the
// plain GEMM's; the engine loads the 64-wide boxes before them).
template <class F>
concept HasLoadBTail = requires(const F f, void* dst, uint64_t* bar, const Tile& tile, int k0) {
  { f.load_b_tail(dst, bar, tile, k0) } -> std::same_as<void>;
};
template <class F>
concept HasARow = requires(const F f, const Tile& tile, int r) {
  { f.a_row(tile, r) } -> std::same_as<const __nv_bfloat16*>;
};
template <class F>
concept HasInitShared = requires(const F f) {
  { f.init_shared() } -> std::same_as<void>;
};
template <class F>
concept HasTileCounter = requires(const F f) {
  { f.tile_counter() } -> std::same_as<int*>;
};
template <class F>
concept HasConsumerPrologue = requires(const F f, int i) {
  { f.consumer_prologue(i, i) } -> std::same_as<void>;
};
template <class F>
concept HasMidTile = requires(const F f, typename F::ConsumerState& state) {
  { f.mid_tile(state) } -> std::same_as<void>;
};
template <class F>
concept HasEpilogueLoads = requires(const F f, const Tile& tile, void* dst, uint64_t* bar, int i) {
  { f.epilogue_loads(tile) } -> std::same_as<int>;
  { f.load_epilogue(dst, bar, tile, i) } -> std::same_as<void>;
};
// store() without ring operands, or with them (an EpilogueRing last).
template <class F, int kRegs>
concept HasStore = requires(const F f, float (&acc)[kRegs], const Tile& tile, int consumer,
                            uint8_t* scratch, typename F::ConsumerState& state) {
  { f.store(acc, tile, consumer, scratch, state) } -> std::same_as<void>;
};
template <class F, int kRegs>
concept HasRingStore = requires(const F f, float (&acc)[kRegs], const Tile& tile, int consumer,
                                uint8_t* scratch, typename F::ConsumerState& state,
                                const EpilogueRing& ring) {
  { f.store(acc, tile, consumer, scratch, state, ring) } -> std::same_as<void>;
};

// Whether the policy matches its declaration, for tiles of Cfg (no error: what check_fusion
// asserts, part by part; tests/gpu/test_fusion_traits.cu holds it against policies that do not).
template <class Cfg, class F>
constexpr bool fusion_matches() {
  if constexpr (!FusionBase<F, Cfg::kAccRegs>) {
    return false;
  } else {
    constexpr FusionTraits t = F::kTraits;
    return t.a_rows == HasARows<F> && t.load_b == HasLoadB<F> &&
           t.init_shared == HasInitShared<F> && t.mid_tile == HasMidTile<F> &&
           t.epilogue_loads == HasEpilogueLoads<F> && t.dynamic_tiles == HasTileCounter<F> &&
           t.consumer_prologue == HasConsumerPrologue<F> &&
           !(t.dynamic_tiles && t.epilogue_loads) &&
           (t.epilogue_loads ? HasRingStore<F, Cfg::kAccRegs>
                             : HasStore<F, Cfg::kAccRegs>)&&t.producer_regs %
                   8 ==
               0 &&
           t.consumer_regs % 8 == 0 &&
           t.producer_regs + Cfg::kConsumers * t.consumer_regs <=
               (1 + Cfg::kConsumers) * Cfg::kRegsPerThread &&
           t.gather_a == HasARow<F> && t.gather_a != HasLoadA<F> &&
           !(t.gather_a && (t.a_rows || t.epilogue_loads || !t.dynamic_tiles));
  }
}

// The policy against its declaration, for tiles of Cfg (true, or a compile error naming the
// mismatch). Each policy static_asserts it; the kernel does again.
template <class Cfg, class F>
constexpr bool check_fusion() {
  constexpr int kRegs = Cfg::kAccRegs;
  static_assert(FusionBase<F, kRegs>,
                "a Fusion policy needs kTraits, num_tiles, tile, wait_operands, "
                "consumer_done, side_task and finish with the engine's signatures");
  constexpr FusionTraits traits = F::kTraits;
  static_assert(traits.a_rows == HasARows<F>, "kTraits.a_rows does not match an a_rows(tile)");
  static_assert(traits.load_b == HasLoadB<F>,
                "kTraits.load_b does not match a load_b(dst, bar, tile, k0)");
  static_assert(traits.init_shared == HasInitShared<F>,
                "kTraits.init_shared does not match an init_shared()");
  static_assert(traits.mid_tile == HasMidTile<F>,
                "kTraits.mid_tile does not match a mid_tile(state)");
  static_assert(traits.epilogue_loads == HasEpilogueLoads<F>,
                "kTraits.epilogue_loads does not match epilogue_loads(tile) + load_epilogue(...)");
  static_assert(traits.dynamic_tiles == HasTileCounter<F>,
                "kTraits.dynamic_tiles does not match a tile_counter()");
  static_assert(traits.consumer_prologue == HasConsumerPrologue<F>,
                "kTraits.consumer_prologue does not match a consumer_prologue(thread, threads)");
  static_assert(!(traits.dynamic_tiles && traits.epilogue_loads),
                "dynamic tiles have no Tile::next for an epilogue's loads");
  static_assert(traits.epilogue_loads ? HasRingStore<F, kRegs> : HasStore<F, kRegs>,
                "store(acc, tile, consumer, scratch, state[, ring]): with epilogue_loads it "
                "takes the EpilogueRing");
  static_assert(traits.producer_regs % 8 == 0 && traits.consumer_regs % 8 == 0 &&
                    traits.producer_regs + Cfg::kConsumers * traits.consumer_regs <=
                        (1 + Cfg::kConsumers) * Cfg::kRegsPerThread,
                "setmaxnreg split beyond the CTA's registers");
  static_assert(Cfg::kEpilogueBuffers == 2 || traits.lean_epilogue,
                "one epilogue buffer a consumer for a policy whose stores expect two "
                "(FusionTraits::lean_epilogue)");
  static_assert(traits.gather_a == HasARow<F>,
                "kTraits.gather_a does not match an a_row(tile, r) returning const __nv_bfloat16*");
  static_assert(traits.gather_a != HasLoadA<F>,
                "load_a(dst, bar, tile, k0): every policy but a gathering one (gather_a) has one");
  static_assert(!(traits.gather_a && (traits.a_rows || traits.epilogue_loads)),
                "a gathered A has no TMA box to shorten (a_rows), and its stages' full barriers "
                "count the gathering lanes (no epilogue loads through them)");
  static_assert(!traits.gather_a || traits.dynamic_tiles,
                "a gathered A's side warps take the tiles from the tile ring (dynamic_tiles)");
  static_assert(fusion_matches<Cfg, F>());
  return true;
}

// check_fusion for every tile width of a policy template.
template <template <int> class Policy>
constexpr bool check_fusion_widths() {
  return check_fusion<TileConfig<64>, Policy<64>>() &&
         check_fusion<TileConfig<128>, Policy<128>>() &&
         check_fusion<TileConfig<192>, Policy<192>>() &&
         check_fusion<TileConfig<256>, Policy<256>>();
}

// Bytes of a stage's A box for a tile: a_rows(tile) rows, or the whole kBlockM.
template <class Cfg, class Fusion>
__device__ __forceinline__ int a_stage_bytes(const Fusion& fusion, const Tile& tile) {
  if constexpr (Fusion::kTraits.a_rows) {
    return fusion.a_rows(tile) * Cfg::kBlockK * 2;
  } else {
    return Cfg::kABytes;
  }
}

__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}

// The epilogue's data path: a consumer's 64 x (2 kRegs) accumulator slice goes out as bf16 in
// 64-column chunks. Each chunk is packed into a 128-byte-swizzled 64 x 64 buffer (conflict-free
// 4-byte stores), then thread 0 of the warpgroup calls issue(buf, j) - a TMA store (or reduce)
// of chunk j wherever the policy wants it - and the warpgroup moves on. kBuffers = 2 (the
// scratch of the engine's default): two buffers alternate, so packing chunk j overlaps the store
// of chunk j - 1; 1 (the lean epilogue's scratch): chunk j waits for chunk j - 1's store to have
// read the buffer. Either way the last stores overlap the next tile's mainloop. Chunks at column
// >= n are skipped. All 128 threads of the warpgroup call.
// The kernel waits for the last stores before it exits.
struct NoEach {
  __device__ void operator()(const uint8_t*, int) const {}
};

// `each(buf, j)`, if given, runs on all 128 threads once chunk j is packed (e.g. to push it to
// other GPUs with ordinary stores); buf stays valid until the warpgroup's next barrier.
template <int kBuffers = 2, int kRegs, class Issue, class Each = NoEach>
__device__ __forceinline__ void store_slice(const float (&acc)[kRegs], int col0, int n,
                                            int consumer, uint8_t* scratch, Issue&& issue,
                                            Each&& each = {}) {
  constexpr int kChunks = kRegs / 32;  // 64 columns = 8 column blocks of 4 registers
  constexpr int kChunkBytes = 64 * 64 * 2;
  const int t = threadIdx.x % 128;
  const int r = (t / 32) * 16 + (t % 32) / 4;  // this thread's rows: r and r + 8
  const int word = (t % 4) * 4;                // byte offset inside a 16-byte chunk
  const int barrier = 1 + consumer;
#pragma unroll
  for (int j = 0; j < kChunks; ++j) {
    if (col0 + 64 * j >= n) break;  // the same on every thread of the warpgroup
    uint8_t* buf = scratch + (j % kBuffers) * kChunkBytes;
    // The store that last read `buf` is done: chunk j - 2's (one buffer: chunk j - 1's), or for
    // chunk 0 any of the previous call's (whose last chunk may have used either buffer: a tile at
    // the N edge has one chunk, and the ping-pong schedule stores its two halves back to back).
    if (t == 0) {
      if (j == 0 || kBuffers == 1) {
        dev::bulk_wait_group_read<0>();
      } else {
        dev::bulk_wait_group_read<1>();
      }
    }
    dev::named_barrier_sync(barrier, 128);
#pragma unroll
    for (int b = 0; b < 8; ++b) {
      const float* v = &acc[32 * j + 4 * b];
      dev::st_shared_u32(buf + r * 128 + ((b ^ (r % 8)) * 16) + word, pack_bf16(v[0], v[1]));
      dev::st_shared_u32(buf + (r + 8) * 128 + ((b ^ ((r + 8) % 8)) * 16) + word,
                         pack_bf16(v[2], v[3]));
    }
    dev::fence_proxy_async_shared();
    dev::named_barrier_sync(barrier, 128);
    if (t == 0) {
      issue(buf, j);
      dev::bulk_commit_group();
    }
    each(buf, j);
  }
}

// The columns of a slice past its whole 64-column chunks (store_slice's), for widths that are not
// a multiple of 64 (16, 32 or 48 columns): each thread's column pairs straight to C [m, n] with
// 4-byte stores - no TMA box in the staging buffers' layout is that narrow, and they are at most
// a fifth of the tile's bytes. col0: the first of these columns; rows outside C are skipped.
template <int kRegs>
__device__ __forceinline__ void store_slice_tail(const float (&acc)[kRegs], __nv_bfloat16* c,
                                                 int64_t row0, int col0, int64_t m, int n) {
  constexpr int kWhole = kRegs / 32 * 32;  // the whole chunks' registers
  const int t = threadIdx.x % 128;
  const int64_t r = row0 + (t / 32) * 16 + (t % 32) / 4;  // this thread's rows: r and r + 8
#pragma unroll
  for (int b = 0; b < (kRegs - kWhole) / 4; ++b) {
    const int col = col0 + 8 * b + 2 * (t % 4);  // even, and n a multiple of 8: col + 1 < n too
    if (col >= n) break;
    const float* v = &acc[kWhole + 4 * b];
    if (r < m) {
      *reinterpret_cast<uint32_t*>(c + r * n + col) = pack_bf16(v[0], v[1]);
    }
    if (r + 8 < m) {
      *reinterpret_cast<uint32_t*>(c + (r + 8) * n + col) = pack_bf16(v[2], v[3]);
    }
  }
}

// Split K for the tiles of a launch's last, partial wave (few tiles: all of them): those tiles
// are computed in `pieces` pieces of their k-blocks, in the launch's last round, each tile's
// pieces on the CTAs of one thread-block cluster (the launch's cluster size is `pieces`, its
// grid a multiple of it, and `whole` a multiple of the grid: the last round's work item
// whole + b is CTA b's, piece b % pieces = its cluster rank). The tile's R rows inside C are
// dealt out in blocks of Q = ceil(R / P): CTA j owns rows [jQ, jQ + Q). After its k-blocks,
// and a cluster barrier that says every piece's mainloop is done (the stage rings are free),
// each piece's consumers store their fp32 sums of the rows inside C straight into the owners'
// stage rings (push: remote stores, nothing waits for them); past a second barrier every owner
// adds up its rows from its own shared memory, in piece order - deterministic - and stores them
// as bf16 (sum). No memory outside the CTAs, no counters, nothing for the host to allocate.
struct SplitSchedule {
  static constexpr int kMaxPieces = 8;  // the portable cluster size
  int whole = 0;                        // work items [0, whole): tiles (raster order), K whole
  int pieces = 1;                       // every later tile: this many pieces of its k-blocks
  int k_iters = 0;
  __nv_bfloat16* out = nullptr;  // C [m, n] row-major

  __device__ int items(int tiles) const { return whole + (tiles - whole) * pieces; }
  // Work item t's tile (in raster order), and its k-blocks into `tile`.
  __device__ int tile_of(int t) const { return t < whole ? t : whole + (t - whole) / pieces; }
  __device__ void k_range(int t, Tile& tile) const {
    if (t < whole || pieces == 1) return;
    const int piece = (t - whole) % pieces;
    tile.kb_begin = piece * k_iters / pieces;
    tile.kb_end = (piece + 1) * k_iters / pieces;
  }
  // Whether work item t is a piece of a tile (else a whole tile, stored as usual).
  __device__ bool is_piece(int t) const { return t >= whole && pieces > 1; }

  // An owner's ring: [piece][Q rows][kBlockN + 8 floats] - rows padded by 8 floats, so that a
  // warp's float2 stores (8 rows x 32 bytes) take the two wavefronts their 256 bytes need.
  template <int kBlockN>
  static constexpr int kRowFloats = kBlockN + 8;
  __device__ int rows_per_owner(int rows) const { return (rows + pieces - 1) / pieces; }

  // Every consumer warpgroup, a piece's sums (slice rows [64 consumer, + 64) of the kBlockM-row
  // tile whose first row is row0): the first cluster barrier, then each pair of the rows inside C
  // into its owner's ring. (16-byte stores - lanes swapping pairs by shuffles - measured the
  // same, 2026-12-02: the count of remote stores is not what the sum waits for.)
  template <int kBlockN, int kBlockM, int kRegs>
  __device__ void push(const float (&acc)[kRegs], int consumer, int row0, int m,
                       uint8_t* ring) const {
    dev::cluster_sync_relaxed();  // every piece's mainloop done: the rings are free
    const int rows = min(kBlockM, m - row0), per_owner = rows_per_owner(rows);
    const uint32_t piece = dev::cluster_rank();
    const int tid = threadIdx.x % 128;
    // Pair i: tile row r + 8 (i % 2), columns 8 (i / 2) + 2 (tid % 4) and + 1.
    const int r = consumer * 64 + (tid / 32) * 16 + (tid % 32) / 4;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int row = r + 8 * half;
      if (row >= rows) continue;
      const int owner = row / per_owner;
      const uint8_t* at =
          ring +
          ((piece * per_owner + row - owner * per_owner) * kRowFloats<kBlockN> + 2 * (tid % 4)) * 4;
      const uint32_t base = dev::peer_smem_addr(at, owner);
#pragma unroll
      for (int i = half; i < kRegs / 2; i += 2) {
        dev::st_peer_f2(base + 32 * (i / 2), acc[2 * i], acc[2 * i + 1]);
      }
    }
  }

  // Every thread of the CTA, last: the first cluster barrier unless this thread's push passed
  // it, the second; then the consumers' threads (2 kBlockM) add up the CTA's rows of its tile
  // (tm, tn).
  template <int kBlockN, int kBlockM>
  __device__ void sum(bool has_piece, int tm, int tn, int m, int n, const uint8_t* ring) const {
    constexpr int kConsumerThreads = 2 * kBlockM;  // 128 a warpgroup of 64 rows
    const bool consumer = threadIdx.x >= 128;
    if (!(has_piece && consumer)) dev::cluster_sync_relaxed();  // (the pushers' first)
    dev::cluster_sync();                                        // every push has landed
    if (!has_piece || !consumer) return;
    const int row0 = tm * kBlockM, col0 = tn * kBlockN;
    const int rows = min(kBlockM, m - row0), quads = min(kBlockN, n - col0) / 4;
    const int per_owner = rows_per_owner(rows);
    const int first = static_cast<int>(dev::cluster_rank()) * per_owner;
    const int mine = max(0, min(per_owner, rows - first));
    const int piece_floats = per_owner * kRowFloats<kBlockN>;
#pragma unroll 1
    for (int e = threadIdx.x - 128; e < mine * quads; e += kConsumerThreads) {
      const int r = e / quads, c = 4 * (e % quads);
      const float* at = reinterpret_cast<const float*>(ring) + r * kRowFloats<kBlockN> + c;
      float4 s = *reinterpret_cast<const float4*>(at);
#pragma unroll 1
      for (int p = 1; p < pieces; ++p) {
        const float4 v = *reinterpret_cast<const float4*>(at + p * piece_floats);
        s.x += v.x, s.y += v.y, s.z += v.z, s.w += v.w;
      }
      const uint2 packed{pack_bf16(s.x, s.y), pack_bf16(s.z, s.w)};
      *reinterpret_cast<uint2*>(out + static_cast<int64_t>(row0 + first + r) * n + col0 + c) =
          packed;
    }
  }
};

// The plain GEMM: C[M, N] = A[M, K] B^T, the grouped raster, local TMA stores; with kSplitK, the
// last wave's tiles in pieces of K (SplitSchedule) - a kernel of its own, so that whole-K
// launches run exactly the kernel they ran before split K existed.
template <int kBlockN, bool kSplitK = false, int kBlockM = 128>
struct PlainGemm {
  // Three consumer warpgroups share 512 threads' registers: 152 each (accumulators of at most
  // 128 columns) beside the producer's 40.
  static constexpr FusionTraits kTraits{.a_rows = true,
                                        .split_k = kSplitK,
                                        .lean_epilogue = true,
                                        .consumer_regs = kBlockM == 192 ? 152 : 232};
  using Cfg = EngineTileConfig<kBlockN, kBlockM, kTraits.lean_epilogue>;
  static_assert((kBlockM + SplitSchedule::kMaxPieces) * SplitSchedule::kRowFloats<kBlockN> * 4 <=
                    Cfg::kStages * Cfg::kStageBytes,
                "a split tile's sums fit in the stage ring");
  CUtensorMap a;  // A [M, K], boxes of kBlockM rows x 64
  CUtensorMap c;  // C [M, N], boxes of 64 rows x 64 columns
  GroupedRaster raster;
  int n;
  CUtensorMap a_last;   // A again, boxes of the last tile-row's rows x 64
  int last_rows;        // rows of the last tile-row (1..kBlockM)
  int m;                // C's rows
  SplitSchedule split;  // split K; its `out` is C, where a step width's last columns go too
  CUtensorMap b_tail;   // B [K, N] at a step width: boxes of 64 K rows x its last 16 or 32
                        // columns (make_map with box_cols 16 or 32); unused otherwise

  __device__ int num_tiles() const {
    return kSplitK ? split.items(raster.num_tiles()) : raster.num_tiles();
  }
  __device__ void load_b_tail(void* dst, uint64_t* bar, const Tile& tile, int k0) const {
    dev::tma_load_2d(dst, &b_tail, bar, tile.n * kBlockN + kBlockN / 64 * 64, k0);
  }
  __device__ Tile tile(int t) const {
    Tile tile{0, 0, 0};
    if constexpr (kSplitK) {
      raster.tile(split.tile_of(t), tile.m, tile.n);
      split.k_range(t, tile);
    } else {
      raster.tile(t, tile.m, tile.n);
    }
    return tile;
  }
  struct ConsumerState {};

  __device__ void wait_operands(const Tile&) const {}
  __device__ bool last_row(const Tile& tile) const { return tile.m == raster.tiles_m - 1; }
  __device__ int a_rows(const Tile& tile) const { return last_row(tile) ? last_rows : kBlockM; }
  __device__ void load_a(void* dst, uint64_t* bar, const Tile& tile, int k0) const {
    dev::tma_load_2d(dst, last_row(tile) ? &a_last : &a, bar, k0, tile.m * kBlockM);
  }
  template <int kRegs>
  __device__ void store(float (&acc)[kRegs], const Tile& tile, int consumer, uint8_t* scratch,
                        ConsumerState&) const {
    const int row0 = tile.m * kBlockM + consumer * 64, col0 = tile.n * kBlockN;
    if constexpr (kSplitK) {
      if (split.is_piece(tile.position)) {  // the cluster adds the pieces up (finish)
        split.template push<kBlockN, kBlockM>(acc, consumer, tile.m * kBlockM, m, stage_ring());
        return;
      }
    }
    store_slice<Cfg::kEpilogueBuffers>(
        acc, col0, n, consumer, scratch,
        [&](const uint8_t* buf, int j) { dev::tma_store_2d(&c, buf, col0 + 64 * j, row0); });
    if constexpr (kBlockN % 64 != 0) {  // a step width: its last 16-48 columns
      store_slice_tail(acc, split.out, row0, col0 + kBlockN / 64 * 64, m, n);
    }
  }
  __device__ void consumer_done(ConsumerState&) const {}
  __device__ void side_task(int, int) const {}
  __device__ void finish() const {
    if constexpr (kSplitK) {  // CTA b's last work item, whole + b, is a piece if any is
      const int t = split.whole + static_cast<int>(blockIdx.x);
      const bool has_piece = t < num_tiles();
      int tm = 0, tn = 0;
      if (has_piece) raster.tile(split.tile_of(t), tm, tn);
      split.template sum<kBlockN, kBlockM>(has_piece, tm, tn, m, n, stage_ring());
    }
  }
};
template <int kBlockN>
using SplitGemm = PlainGemm<kBlockN, true>;
// The tall tiles (192 rows): widths 64 and 128 (a consumer's accumulators within 152 registers).
template <int kBlockN>
using TallGemm = PlainGemm<kBlockN, false, 192>;
template <int kBlockN>
using TallSplitGemm = PlainGemm<kBlockN, true, 192>;
// The short tiles (64 rows, one consumer warpgroup): every width.
template <int kBlockN>
using ShortGemm = PlainGemm<kBlockN, false, 64>;
template <int kBlockN>
using ShortSplitGemm = PlainGemm<kBlockN, true, 64>;
static_assert(check_fusion_widths<PlainGemm>());
static_assert(check_fusion_widths<SplitGemm>());
// The configurations launched (FusionTileConfig: the lean epilogue's where it applies).
// The step widths (gemm_internal.h's kStepWidths: B [N, K], 128 rows, K whole).
static_assert(check_fusion<FusionTileConfig<80, PlainGemm<80>>, PlainGemm<80>>() &&
              check_fusion<FusionTileConfig<96, PlainGemm<96>>, PlainGemm<96>>() &&
              check_fusion<FusionTileConfig<112, PlainGemm<112>>, PlainGemm<112>>() &&
              check_fusion<FusionTileConfig<144, PlainGemm<144>>, PlainGemm<144>>() &&
              check_fusion<FusionTileConfig<160, PlainGemm<160>>, PlainGemm<160>>() &&
              check_fusion<FusionTileConfig<224, PlainGemm<224>>, PlainGemm<224>>());
static_assert(check_fusion<FusionTileConfig<64, TallGemm<64>, 192>, TallGemm<64>>() &&
              check_fusion<FusionTileConfig<128, TallGemm<128>, 192>, TallGemm<128>>() &&
              check_fusion<FusionTileConfig<64, TallSplitGemm<64>, 192>, TallSplitGemm<64>>() &&
              check_fusion<FusionTileConfig<128, TallSplitGemm<128>, 192>, TallSplitGemm<128>>());
template <template <int> class Policy>
constexpr bool check_short_widths() {
  return check_fusion<FusionTileConfig<64, Policy<64>, 64>, Policy<64>>() &&
         check_fusion<FusionTileConfig<128, Policy<128>, 64>, Policy<128>>() &&
         check_fusion<FusionTileConfig<192, Policy<192>, 64>, Policy<192>>() &&
         check_fusion<FusionTileConfig<256, Policy<256>, 64>, Policy<256>>();
}
static_assert(check_short_widths<ShortGemm>() && check_short_widths<ShortSplitGemm>());

// B box of an N-major stage: 64 K rows x 64 N values (128 bytes a row).
constexpr int kMnBoxBytes = 64 * 128;

// One stage's B for a tile's k-block at k0: the policy's load_b, or the engine's boxes of tma_b
// (B [N, K], K-major; with kTransB [K, N]: kBlockN / 64 boxes of 64 K rows x 64 N values, and
// at a step width the policy's box of the last 16 or 32; batched: one more coordinate, the
// tile's shard). Completes on `bar`.
template <class Cfg, bool kTransB, class Fusion>
__device__ __forceinline__ void load_b_stage(const Fusion& fusion, const CUtensorMap* tma_b,
                                             uint8_t* dst, uint64_t* bar, const Tile& tile,
                                             int k0) {
  constexpr FusionTraits kTraits = Fusion::kTraits;
  const int n0 = tile.n * Cfg::kBlockN;
  // (The tail of a step width with B [K, N] - the mainloop's second wgmma - only the plain
  // path below loads.)
  static_assert(!(kTransB && Cfg::kBlockN % 64 != 0 && (kTraits.load_b || kTraits.batched_b)),
                "B [K, N] at a step width: a policy's own B or batched B has no tail load");
  if constexpr (kTraits.load_b) {
    fusion.load_b(dst, bar, tile, k0);
  } else if constexpr (kTraits.batched_b) {  // B [batches][...]: 3-D boxes, batch = shard
    if constexpr (kTransB) {
#pragma unroll
      for (int j = 0; j < Cfg::kBlockN / 64; ++j) {
        dev::tma_load_3d(dst + j * kMnBoxBytes, tma_b, bar, n0 + j * 64, k0, tile.shard);
      }
    } else {
      dev::tma_load_3d(dst, tma_b, bar, k0, n0, tile.shard);
    }
  } else if constexpr (kTransB) {
#pragma unroll
    for (int j = 0; j < Cfg::kBlockN / 64; ++j) {
      dev::tma_load_2d(dst + j * kMnBoxBytes, tma_b, bar, n0 + j * 64, k0);
    }
    if constexpr (Cfg::kBlockN % 64 != 0) {  // a step width: its last 16 or 32 columns
      static_assert(HasLoadBTail<Fusion>, "B [K, N] at a step width: the policy loads the tail");
      fusion.load_b_tail(dst + Cfg::kBlockN / 64 * kMnBoxBytes, bar, tile, k0);
    }
  } else {
    dev::tma_load_2d(dst, tma_b, bar, k0, n0);
  }
}

// A gathered stage (kTraits.gather_a): this thread's share of the kBlockM rows x 64 K values
// of A at column k0, each row from its own address, into the stage at shared address `stage` in
// the layout a TMA box with the 128-byte swizzle leaves (row r's 16-byte piece c at
// r * 128 + (c ^ r % 8) * 16). Lane l of gathering warp w copies piece l % 8 of rows
// 16 i + 4 w + l / 8 (gather_layout.h) - rows[i], looked up once per tile: each instruction of
// a warp moves four whole 128-byte rows, and no address crosses lanes. Pieces past K are zero
// (B's are: the TMA's fill); null rows are left as they are (their output rows are not stored).
// The copies complete on the stage's full barrier (cp_async_arrive_noinc, by the caller).
template <class Cfg>
__device__ __forceinline__ void gather_a_stage(
    const __nv_bfloat16* const (&rows)[Cfg::kBlockM / kGatherRowsPerStep], uint32_t stage, int k0,
    int k) {
  const int lane = threadIdx.x % 32, warp = (threadIdx.x / 32) % kGatherWarps;
  const int col = k0 + 8 * (lane % 8);
  const uint32_t bytes = col < k ? 16 : 0;  // K is a multiple of 8: a piece is in or out
  const int src_col = bytes != 0 ? col : 0;
  const uint32_t at = stage + gather_base(warp, lane);  // + 2048 i: an immediate
#pragma unroll
  for (int i = 0; i < Cfg::kBlockM / kGatherRowsPerStep; ++i) {
    if (rows[i] == nullptr) continue;
    dev::cp_async_16(at + kGatherRowsPerStep * 128 * i, rows[i] + src_col, bytes);
  }
}

// The producer of a gather_a policy: the producer warpgroup's kGatherWarps warps, 32 lanes
// each. Warp 0 runs from the start: its lane 0 takes the work items, waits for each tile's
// operands (wait_operands), then hands the tile to the consumers and to the other gathering
// warps through the tile ring and asks the counter for the next (dynamic tiles, required), and
// loads B's boxes. Warps 1..3 join once the policy's side task is done (the kernel calls this
// after side_task): they take the tiles from the ring as the consumers do - its arrival orders
// lane 0's acquire of the operands before their look-ups - from the first item on, so every
// gathering thread walks the same stages. Each thread looks its tile's rows up once (a_row) and,
// stage by stage, copies its pieces of A (gather_a_stage). A stage's full barrier completes on
// lane 0's arrival with B's bytes and the 32 x kGatherWarps copy arrivals (it was initialised
// for 1 + 32 x kGatherWarps); until the side warps join, the stages wait for them.
template <class Cfg, bool kTransB, class Fusion>
__device__ __forceinline__ void produce_gathered(const Fusion& fusion, const CUtensorMap* tma_b,
                                                 int k, uint8_t* smem, uint64_t* full,
                                                 uint64_t* empty, uint64_t* tile_full,
                                                 uint64_t* tile_empty, int* tile_items) {
  constexpr FusionTraits kTraits = Fusion::kTraits;  // (check_fusion: gather_a has dynamic tiles)
  static_assert(Cfg::kBlockM % kGatherRowsPerStep == 0, "whole steps of the gathering warps");
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int k_iters = (k + Cfg::kBlockK - 1) / Cfg::kBlockK;
  int it = 0;  // k-iterations issued by this CTA, across tiles: position in the stage ring
  int t = blockIdx.x, next = 0;
  for (int item = 0;; ++item) {
    const int r = item % Cfg::kTileSlots;
    const uint32_t lap = (item / Cfg::kTileSlots) & 1;
    if (warp == 0) {  // (t: the same on every lane)
      const bool past = t >= fusion.num_tiles();
      if (lane == 0) {
        // The operands before the hand-over: the tile ring's release and the side warps'
        // acquire carry this acquire to their look-ups (and the consumers' wait for the stage
        // covers them anyway).
        if (!past) fusion.wait_operands(fusion.tile(t));
        dev::mbarrier_wait(&tile_empty[r], lap ^ 1);
        tile_items[r] = past ? -1 : t;
        dev::mbarrier_arrive(&tile_full[r]);
        // The next item, asked for now: the counter's latency hides behind this tile's loads.
        if (!past) next = static_cast<int>(gridDim.x) + atomicAdd(fusion.tile_counter(), 1);
      }
      __syncwarp();  // lane 0's acquire before its lanes' look-ups (a barrier orders memory)
      if (past) break;
    } else {  // a side warp: the item warp 0 handed over (-1: no more)
      dev::mbarrier_wait(&tile_full[r], lap);
      t = tile_items[r];
      dev::mbarrier_arrive(&tile_empty[r]);
      if (t < 0) break;
    }
    const Tile tile = fusion.tile(t);
    const __nv_bfloat16* rows[Cfg::kBlockM / kGatherRowsPerStep];
#pragma unroll
    for (int i = 0; i < Cfg::kBlockM / kGatherRowsPerStep; ++i) {
      rows[i] = fusion.a_row(tile, gather_row(warp, lane, i));
    }
    const int kb_begin = kTraits.split_k ? tile.kb_begin : 0;
    const int kb_end = kTraits.split_k && tile.kb_end >= 0 ? tile.kb_end : k_iters;
    for (int kb = kb_begin; kb < kb_end; ++kb, ++it) {
      const int s = it % Cfg::kStages;
      const uint32_t phase = (it / Cfg::kStages) & 1;
      uint8_t* stage = smem + s * Cfg::kStageBytes;
      dev::mbarrier_wait(&empty[s], phase ^ 1);  // (every thread: its copies overwrite the stage)
      if (warp == 0 && lane == 0) {
        dev::mbarrier_arrive_expect_tx(&full[s], Cfg::kBBytes);
        load_b_stage<Cfg, kTransB>(fusion, tma_b, stage + Cfg::kABytes, &full[s], tile,
                                   kb * Cfg::kBlockK);
      }
      gather_a_stage<Cfg>(rows, dev::smem_addr(stage), kb * Cfg::kBlockK, k);
      dev::cp_async_arrive_noinc(&full[s]);
    }
    if (warp == 0) t = __shfl_sync(~0u, next, 0);  // (lane 0's, asked for above)
  }
  dev::cp_async_wait_all();
}

template <class Cfg, bool kTransB, class Fusion>
__global__ void __launch_bounds__(Cfg::kThreads, 1)
    gemm_kernel(const __grid_constant__ CUtensorMap tma_b, int k,
                const __grid_constant__ Fusion fusion) {
  static_assert(check_fusion<Cfg, Fusion>());
  constexpr FusionTraits kTraits = Fusion::kTraits;
  uint8_t* smem = stage_ring();
  uint8_t* epilogue_smem = smem + Cfg::kStages * Cfg::kStageBytes;
  uint64_t* full = reinterpret_cast<uint64_t*>(epilogue_smem + Cfg::kEpilogueBytes);
  uint64_t* empty = full + Cfg::kStages;
  uint64_t* tile_full = empty + Cfg::kStages;  // (dynamic tiles)
  uint64_t* tile_empty = tile_full + Cfg::kTileSlots;
  int* tile_items = reinterpret_cast<int*>(tile_empty + Cfg::kTileSlots);
  auto stage_a = [&](int s) { return smem + s * Cfg::kStageBytes; };
  auto stage_b = [&](int s) { return smem + s * Cfg::kStageBytes + Cfg::kABytes; };

  if (threadIdx.x == 0) {
    for (int s = 0; s < Cfg::kStages; ++s) {
      // (A gathered: the arrival with B's bytes and the gathering threads' copies.)
      dev::mbarrier_init(&full[s], kTraits.gather_a ? 1 + 32 * kGatherWarps : 1);
      dev::mbarrier_init(&empty[s], Cfg::kConsumers);
    }
    if constexpr (kTraits.dynamic_tiles) {
      for (int r = 0; r < Cfg::kTileSlots; ++r) {
        dev::mbarrier_init(&tile_full[r], 1);
        // Every consumer thread (and with a gathered A the side warps' threads, which take
        // the tiles from the ring as well).
        constexpr int kSideReaders = kTraits.gather_a ? 32 * (kGatherWarps - 1) : 0;
        dev::mbarrier_init(&tile_empty[r], Cfg::kConsumers * 128 + kSideReaders);
      }
    }
    if constexpr (kTraits.init_shared) fusion.init_shared();
    dev::mbarrier_init_fence();
  }
  __syncthreads();

  const int k_iters = (k + Cfg::kBlockK - 1) / Cfg::kBlockK;
  const int warpgroup = threadIdx.x / 128;

  if (warpgroup == 0) {
    // ---- producer ----
    dev::warpgroup_reg_dealloc<kTraits.producer_regs>();
    if constexpr (kTraits.gather_a) {  // warps 1..3: their side task, then they gather too
      if (threadIdx.x == 0) dev::tma_prefetch_descriptor(&tma_b);
      if (threadIdx.x >= 32) fusion.side_task(threadIdx.x - 32, 96);
      produce_gathered<Cfg, kTransB>(fusion, &tma_b, k, smem, full, empty, tile_full, tile_empty,
                                     tile_items);
    } else if (threadIdx.x == 0) {
      dev::tma_prefetch_descriptor(&tma_b);
      int it = 0;  // k-iterations issued by this CTA, across tiles: position in the stage ring
      int next = 0;
      for (int item = 0, t = blockIdx.x;; ++item, t = next) {
        const bool past = t >= fusion.num_tiles();
        if constexpr (kTraits.dynamic_tiles) {  // to the consumers (-1: no more)
          const int r = item % Cfg::kTileSlots;
          dev::mbarrier_wait(&tile_empty[r], ((item / Cfg::kTileSlots) & 1) ^ 1);
          tile_items[r] = past ? -1 : t;
          dev::mbarrier_arrive(&tile_full[r]);
        }
        if (past) break;
        const Tile tile = fusion.tile(t);
        fusion.wait_operands(tile);
        // The next item, asked for once this one's operands are in (a CTA waiting for them holds
        // no other): the counter's latency hides behind this tile's loads.
        if constexpr (kTraits.dynamic_tiles) {
          next = static_cast<int>(gridDim.x) + atomicAdd(fusion.tile_counter(), 1);
        } else {
          next = t + static_cast<int>(gridDim.x);
        }
        const int stage_bytes = a_stage_bytes<Cfg>(fusion, tile) + Cfg::kBBytes;
        const int kb_begin = kTraits.split_k ? tile.kb_begin : 0;
        const int kb_end = kTraits.split_k && tile.kb_end >= 0 ? tile.kb_end : k_iters;
        for (int kb = kb_begin; kb < kb_end; ++kb, ++it) {
          const int s = it % Cfg::kStages;
          const uint32_t phase = (it / Cfg::kStages) & 1;
          dev::mbarrier_wait(&empty[s], phase ^ 1);  // first lap passes at once
          dev::mbarrier_arrive_expect_tx(&full[s], stage_bytes);
          fusion.load_a(stage_a(s), &full[s], tile, kb * Cfg::kBlockK);
          load_b_stage<Cfg, kTransB>(fusion, &tma_b, stage_b(s), &full[s], tile, kb * Cfg::kBlockK);
        }
        if constexpr (kTraits.epilogue_loads) {  // the policy's stages behind the k-blocks
          const int count = fusion.epilogue_loads(tile);
          for (int i = 0; i < count; ++i, ++it) {
            const int s = it % Cfg::kStages;
            dev::mbarrier_wait(&empty[s], ((it / Cfg::kStages) & 1) ^ 1);
            fusion.load_epilogue(stage_a(s), &full[s], tile, i);
          }
        }
      }
    } else if (threadIdx.x >= 32) {
      fusion.side_task(threadIdx.x - 32, 96);
    }
  } else {
    // ---- consumers ----
    dev::warpgroup_reg_alloc<kTraits.consumer_regs>();
    if constexpr (kTraits.consumer_prologue) {
      fusion.consumer_prologue(threadIdx.x - 128, 128 * Cfg::kConsumers);
    }
    const int consumer = warpgroup - 1;  // rows [64 * consumer, 64 * consumer + 64) of the tile
    // Its rows' offset in a stage's A, through a shuffle so that the compiler knows it is the same
    // on every lane: A's descriptors then live in uniform registers (as a per-thread value, each
    // wgmma's took two register-to-uniform moves).
    const uint32_t a_offset = __shfl_sync(0xffffffffu, consumer * 64 * 128, 0);
    const bool leader = threadIdx.x % 128 == 0;
    float acc[Cfg::kAccRegs];
    typename Fusion::ConsumerState state{};
    int it = 0;
    for (int item = 0, t = blockIdx.x;; ++item, t += gridDim.x) {
      if constexpr (kTraits.dynamic_tiles) {  // the producer's item (every thread reads it)
        const int r = item % Cfg::kTileSlots;
        dev::mbarrier_wait(&tile_full[r], (item / Cfg::kTileSlots) & 1);
        t = tile_items[r];
        dev::mbarrier_arrive(&tile_empty[r]);
      }
      if ((kTraits.dynamic_tiles && t < 0) || t >= fusion.num_tiles()) break;
      Tile tile = fusion.tile(t);
      tile.position = t;
      const int next = kTraits.dynamic_tiles ? -1 : t + static_cast<int>(gridDim.x);
      tile.next = next < fusion.num_tiles() ? next : -1;
      const int kb_begin = kTraits.split_k ? tile.kb_begin : 0;
      const int kb_end = kTraits.split_k && tile.kb_end >= 0 ? tile.kb_end : k_iters;
      for (int kb = kb_begin; kb < kb_end; ++kb, ++it) {
        const int s = static_cast<int>(static_cast<unsigned>(it) % Cfg::kStages);
        const uint32_t phase = (static_cast<unsigned>(it) / Cfg::kStages) & 1;
        dev::mbarrier_wait(&full[s], phase);
        // A gathered: its rows came by cp.async, which writes through the generic proxy - the
        // PTX ISA asks for a proxy fence before wgmma (the async proxy) reads them.
        if constexpr (kTraits.gather_a) dev::fence_proxy_async_shared();
        dev::wgmma_fence_operands(acc);
        dev::wgmma_fence();
        // The stage's descriptors once; a k16 slice's are theirs moved on (wgmma_desc_advance):
        // A's and B [N, K]'s start 32 bytes further, B [K, N]'s 16 rows further.
        const uint64_t da0 = dev::wgmma_desc_sw128(stage_a(s) + a_offset);
        const uint64_t db0 = kTransB ? dev::wgmma_desc_sw128_mn(stage_b(s), kMnBoxBytes)
                                     : dev::wgmma_desc_sw128(stage_b(s));
#pragma unroll
        for (int kk = 0; kk < Cfg::kBlockK / 16; ++kk) {
          const uint64_t da = dev::wgmma_desc_advance(da0, kk * 32);
          const bool accumulate = kb > kb_begin || kk > 0;
          const uint64_t db = dev::wgmma_desc_advance(db0, kTransB ? kk * 16 * 128 : kk * 32);
          if constexpr (kTransB && Cfg::kBlockN % 64 != 0) {
            // B [K, N] at a step width: the 64-wide chunks, then the last 16 or 32 columns
            // (their own swizzle) into the accumulators that follow - the fragment of an
            // N-wide wgmma is its 8-column blocks in order, so the two are one tile's.
            constexpr int kMain = Cfg::kBlockN / 64 * 64, kTail = Cfg::kBlockN - kMain;
            static_assert(kTail == 16 || kTail == 32, "B [K, N]: a 16- or 32-column tail");
            const uint64_t dt = dev::wgmma_desc_advance(
                dev::wgmma_desc_mn_tail<2 * kTail>(stage_b(s) + kMain / 64 * kMnBoxBytes),
                kk * 16 * (2 * kTail));
            dev::wgmma_bf16<kMain, true>(*reinterpret_cast<float(*)[kMain / 2]>(&acc[0]), da, db,
                                         accumulate);
            dev::wgmma_bf16<kTail, true>(*reinterpret_cast<float(*)[kTail / 2]>(&acc[kMain / 2]),
                                         da, dt, accumulate);
          } else {
            dev::wgmma_bf16<Cfg::kBlockN, kTransB>(acc, da, db, accumulate);
          }
        }
        dev::wgmma_commit();
        dev::wgmma_fence_operands(acc);
        // The group of the previous stage has retired once at most this one is pending.
        dev::wgmma_wait<1>();
        if (kb > kb_begin && leader) {
          dev::mbarrier_arrive(&empty[static_cast<unsigned>(it - 1) % Cfg::kStages]);
        }
        if constexpr (kTraits.mid_tile) {
          if (kb == (kb_begin + kb_end) / 2 && leader) fusion.mid_tile(state);
        }
      }
      dev::wgmma_wait<0>();
      dev::wgmma_fence_operands(acc);
      if (leader && kb_end > kb_begin) dev::mbarrier_arrive(&empty[(it - 1) % Cfg::kStages]);
      uint8_t* scratch = epilogue_smem + consumer * (Cfg::kEpilogueBytes / Cfg::kConsumers);
      if constexpr (kTraits.epilogue_loads) {
        const EpilogueRing ring{
            smem, full, empty, Cfg::kStageBytes, Cfg::kStages, it, fusion.epilogue_loads(tile)};
        fusion.store(acc, tile, consumer, scratch, state, ring);
        it += ring.count;
      } else {
        fusion.store(acc, tile, consumer, scratch, state);
      }
    }
    fusion.consumer_done(state);
    if (leader) dev::bulk_wait_group<0>();  // the last stores have landed
  }
  fusion.finish();
}

}  // namespace mk::gemm_engine
