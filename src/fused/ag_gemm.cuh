// AllGather + GEMM as a Fusion policy of the GEMM engine (src/gemm/gemm_kernel.cuh).
//
// Rank r's output rows come in shards: shard s = rows [s * S, (s + 1) * S) of C, computed from
// rank s's A rows. Work items walk the shards in the order r, r + 1, ..., r - 1 (mod world): the
// own shard first, read straight from the caller's A_r, so the tensor cores start at once.
//
// Meanwhile the producer warpgroup's three spare warps push A_r into every peer's workspace
// (slot r of [world][S][K]), piece by piece (piece_rows rows, 128-512 KiB), the peer that needs
// it soonest first (rank r - 1 reads shard r right after its own), and raise the op signal of
// each piece on the receiver. Pushing CTA c takes pieces c, c + comm_ctas, ...: a shard arrives
// in rounds of comm_ctas pieces, front rows first. Before a peer-shard tile's first load the
// producer waits for the signals of the pieces under the tile's 128 rows, then orders that
// acquire before its TMA reads (fence.proxy.async.global).
//
// Reuse: pushing into a peer's workspace is safe once the peer has entered this launch (its
// previous launch, which read the workspace, is over): CTA 0 raises "entered" to every peer at
// the start, and the pushers wait for it from their destination before the first piece.
// Signals carry the launch epoch, so no flag is ever reset.
//
// Across nodes (docs/design/multinode.md section 2) shards follow the rail routes of
// fused/rail_routes.h: rank r = (node n, local l) sends its shard over its NIC to its rail peers
// (n', l) only - piece by piece, one put+signal command each into the communicator's inter-node
// rings, from a copy of A_r in its own workspace slot (commands name registered buffers) - and
// pushes it over NVLink to the node's other ranks as on one node. It relays what its rail peers
// send it: once a piece's host-pad signal arrives, the side threads copy it on to the node's other
// ranks over NVLink. The producer waits for a shard's pieces where they are announced:
// GatherRoutes::source[q] raises them - q itself (same node: device pad; a rail peer: the host
// pad, DeviceComm::host_signals) or the local relay (device pad). A shard's piece signals sit at
// node_of(q) x pieces + p, so a relay's own pieces and those it relays never share a word.
// Reuse across nodes: a rail peer announces "entered" with a signal command (host-pad signal 0)
// and this rank waits for it before it overwrites its own slot (the source of the last launch's
// puts) or sends anything. Where the path stages in host memory (InterNode::host_staging: the
// socket backend) the puts go from and into the pinned host staging instead (one slot per node,
// GatherRoutes::xfer), and the relay also copies each arrived piece into its own workspace slot
// and raises its own device-pad signal, which its producer waits for.
#pragma once

#include <cstdint>

#include "fused/across_nodes.cuh"  // load_l2, announce_entry
#include "fused/trace.cuh"
#include "gemm/gemm_kernel.cuh"
#include "mkernel/device/launch.cuh"
#include "mkernel/device/push.cuh"
#include "mkernel/device_comm.h"
#include "mkernel/transport/command.h"
#include "mkernel/transport/ring.h"

namespace mk::fused {

constexpr int kMaxGatherRanks = 64;  // world across nodes (one node: up to kMaxGatherRanks too)
constexpr int kMaxGatherRings = 4;
constexpr int kMaxRailPeers = kMaxGatherRanks / 2;
constexpr uint32_t kHostEntrySignal = 0;   // host pad: "my rail peer entered this launch"
constexpr uint32_t kHostPieceSignal0 = 1;  // host pad: piece signals from here on

// Where each shard comes from and in which order the tiles take them (host: ag_gemm.cu, from
// fused/rail_routes.h; one node: shard q from q over NVLink, order r, r + 1, ...).
struct GatherRoutes {
  int16_t order[kMaxGatherRanks];        // the shards in compute order (own first)
  int16_t source[kMaxGatherRanks];       // the rank that raises shard q's piece signals
  int16_t signal_base[kMaxGatherRanks];  // node_of(q) x pieces
  uint64_t remote_mask;                  // bit q: q's pieces arrive over this rank's NIC
  int16_t rail[kMaxRailPeers];           // this rank's rail peers (0 of them on one node)
  int16_t rail_node[kMaxRailPeers];
  int rails;
  int node;
  transport::CommandRing rings[kMaxGatherRings];  // the communicator's inter-node rings
  int num_rings;
  // Where what crosses the network is staged (InterNode::host_staging): null - in the
  // workspace's slots; else this rank's pinned host staging, mapped here, one shard slot per
  // node ([nodes][S][K]: the own node's holds A_r, node m's the shard of the rail peer there).
  uint8_t* xfer;
  int xfer_buffer;  // the registered id of the workspace, or of the host staging
};

// 16 bytes read once: no L1 allocation (L1 shares its storage with the GEMM's shared memory).
// Through the read-only (non-coherent) path: for memory nothing writes while the kernel runs.
__device__ __forceinline__ uint4 load_streaming(const uint8_t* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

// Copies `bytes` (a multiple of 16) from src to dst with `threads` threads, kUnroll 16-byte
// vectors in flight per thread. kWrittenDuringKernel: src changed after the kernel started
// (load_l2).
template <bool kWrittenDuringKernel = false, int kUnroll = 2>
__device__ __forceinline__ void copy_bytes(const uint8_t* src, uint8_t* dst, uint64_t bytes,
                                           int thread, int threads) {
  auto load = [](const uint8_t* p) {
    return kWrittenDuringKernel ? load_l2(p) : load_streaming(p);
  };
  const uint64_t step = static_cast<uint64_t>(threads) * 16;
  uint64_t i = static_cast<uint64_t>(thread) * 16;
  for (; i + (kUnroll - 1) * step < bytes; i += kUnroll * step) {
    uint4 v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) v[u] = load(src + i + u * step);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) *reinterpret_cast<uint4*>(dst + i + u * step) = v[u];
  }
  for (; i < bytes; i += step) {
    *reinterpret_cast<uint4*>(dst + i) = load(src + i);
  }
}

// kAcrossNodes: the multi-node kernel (GatherRoutes, the rail); its own instantiations, so that
// the one-node kernels carry none of its code (and keep their register split and spill report).
template <int kBlockN, bool kAcrossNodes = false>
struct AgGemmFusion {
  // Producer warpgroup: the pushes (four 16-byte loads in flight per thread) and waits with
  // their timeline marks - 48 registers spilled; the consumers' 224 are what is left. Across
  // nodes also the rail's commands and relays: 56 spilled 20 bytes there, so 72 (the consumers'
  // 216 still hold the widest tile's accumulators).
  static constexpr gemm_engine::FusionTraits kTraits{.a_rows = true,
                                                     .init_shared = true,
                                                     .producer_regs = kAcrossNodes ? 72 : 56,
                                                     .consumer_regs = kAcrossNodes ? 216 : 224};
  CUtensorMap a_local;          // this rank's shard [S, K] (caller's memory), boxes 128 x 64
  CUtensorMap a_gathered;       // workspace [world][S][K], boxes 128 x 64 x 1 (rows clip per shard)
  CUtensorMap c;                // C as [world][S][N], boxes 64 x 64 x 1
  CUtensorMap a_local_last;     // a_local and a_gathered again, boxes of the shard's last
  CUtensorMap a_gathered_last;  // tile-row's rows (gemm_kernel.cuh: a_rows)
  DeviceComm comm;
  const uint8_t* a_shard;  // this rank's shard, source of the pushes
  void* const* ws_peers;   // device [local_size]: base of the workspace's buffer on each rank
  uint64_t ws_offset;      // byte offset of the workspace in that buffer
  uint64_t row_bytes;      // K * 2
  int shard_rows;          // S
  int n;
  gemm_engine::GroupedRaster raster;  // tiles of one shard
  int piece_rows;
  int pieces;  // per shard
  int comm_ctas;
  uint64_t* trace;  // timeline records (fused/trace.cuh), or null
  GatherRoutes routes;

  __device__ int num_tiles() const { return comm.world_size * raster.num_tiles(); }

  __device__ gemm_engine::Tile tile(int t) const {
    const int per_shard = raster.num_tiles();
    gemm_engine::Tile tile;
    if constexpr (kAcrossNodes) {
      tile.shard = routes.order[t / per_shard];
    } else {
      tile.shard = (comm.rank + t / per_shard) % comm.world_size;
    }
    raster.tile(t % per_shard, tile.m, tile.n);
    return tile;
  }

  // The pieces under the tile's rows have arrived: one pass of relaxed loads over their signals
  // (independent loads, in flight together), the slow timed wait only for those not there yet,
  // then one acquire fence for all of them and the proxy fence before the TMA reads.
  __device__ void wait_operands(const gemm_engine::Tile& tile) const {
    if (tile.shard == comm.rank) return;
    trace_mark(trace, kTraceProducer, kTraceOperandsWait, tile.shard);
    const dev::Launch launch = dev::Launch::begin(comm);
    const uint64_t expected = dev::signal_value(launch.epoch, 1);
    const int first = tile.m * 128 / piece_rows;
    const int last = (min(tile.m * 128 + 128, shard_rows) - 1) / piece_rows;
    // One node: from the shard's owner, signals kOp + p. Across nodes: GatherRoutes.
    const int src = kAcrossNodes ? routes.source[tile.shard] : tile.shard;
    const int base = kAcrossNodes ? routes.signal_base[tile.shard] : 0;
    if (kAcrossNodes && ((routes.remote_mask >> tile.shard) & 1)) {  // over the NIC: host pad
      for (int p = first; p <= last; ++p) {
        if (!launch.wait_remote(src, kHostPieceSignal0 + base + p, 1)) break;
      }
    } else {
      const uint64_t* words = comm.signals + src;
      const uint64_t stride = comm.world_size;
      for (int p = first; p <= last; ++p) {
        const uint32_t signal = dev::signal_index(SignalId::kOp, base + p);
        if (dev::reached(dev::ld_relaxed_sys(words + signal * stride), expected)) continue;
        // On a time-out the error is recorded and every later wait returns at once; the tile is
        // computed from whatever is there and the host reports the error.
        if (!launch.wait(src, signal, 1)) break;
      }
    }
    dev::fence_acq_rel_sys();
    dev::fence_proxy_async_global();
    trace_mark(trace, kTraceProducer, kTraceOperandsIn, tile.shard);
  }

  // A box inside the shard: its last tile-row (S not a multiple of 128) loads its rows alone.
  __device__ bool last_row(const gemm_engine::Tile& tile) const {
    return tile.m == raster.tiles_m - 1;
  }
  __device__ int a_rows(const gemm_engine::Tile& tile) const {
    return last_row(tile) ? gemm_engine::last_tile_rows(shard_rows) : 128;
  }
  __device__ void load_a(void* dst, uint64_t* bar, const gemm_engine::Tile& tile, int k0) const {
    const bool last = last_row(tile);
    if (tile.shard == comm.rank) {
      dev::tma_load_2d(dst, last ? &a_local_last : &a_local, bar, k0, tile.m * 128);
    } else {
      dev::tma_load_3d(dst, last ? &a_gathered_last : &a_gathered, bar, k0, tile.m * 128,
                       tile.shard);
    }
  }

  struct ConsumerState {};

  __device__ void init_shared() const { trace_init(); }

  template <int kRegs>
  __device__ void store(const float (&acc)[kRegs], const gemm_engine::Tile& tile, int consumer,
                        uint8_t* scratch, ConsumerState&) const {
    const bool leader = threadIdx.x % 128 == 0;
    if (leader) {
      trace_mark(trace, kTraceConsumer0 + consumer, kTraceStoreBegin, tile.shard != comm.rank);
    }
    const int row0 = tile.m * 128 + consumer * 64;
    const int col0 = tile.n * kBlockN;
    gemm_engine::store_slice(acc, col0, n, consumer, scratch, [&](const uint8_t* buf, int j) {
      dev::tma_store_3d(&c, buf, col0 + 64 * j, row0, tile.shard);
    });
    if (leader) trace_mark(trace, kTraceConsumer0 + consumer, kTraceStoreEnd);
  }

  __device__ void consumer_done(ConsumerState&) const {}

  // Producer warps 1..3: announce this launch to the peers (CTA 0), then push pieces of A_r.
  __device__ void side_task(int thread, int threads) const {
    if constexpr (kAcrossNodes) {
      side_task_across_nodes(thread, threads);
      return;
    }
    const dev::Launch launch = dev::Launch::begin(comm);
    const int world = comm.world_size;
    if (thread == 0) trace_mark(trace, kTraceSide, kTraceSideStart);
    if (blockIdx.x == 0) announce_entry(comm, launch, thread, threads);
    if (static_cast<int>(blockIdx.x) >= comm_ctas) return;
    constexpr int kBarrier = 3;  // named barrier of the 96 pushing threads
    int ready_dest = -1;
    const int units = (world - 1) * pieces;
    for (int u = blockIdx.x; u < units; u += comm_ctas) {
      const int d = u / pieces + 1;  // distance: rank - d reads this shard d-th
      const int p = u % pieces;
      const int dest = (comm.rank - d + world) % world;  // one node: global rank = local rank
      if (dest != ready_dest) {
        bool failed = false;
        if (thread == 0) failed = !launch.wait(dest, dev::signal_index(SignalId::kEntry, 0), 1);
        if (dev::named_barrier_or(kBarrier, threads, failed)) return;  // the same on all threads
        ready_dest = dest;
      }
      const int row0 = p * piece_rows;
      const int rows = min(piece_rows, shard_rows - row0);
      const uint64_t src_offset = static_cast<uint64_t>(row0) * row_bytes;
      if (thread == 0) trace_mark(trace, kTraceSide, kTraceItem, dest);
      uint8_t* dst = static_cast<uint8_t*>(ws_peers[dest]) + ws_offset +
                     (static_cast<uint64_t>(comm.rank) * shard_rows + row0) * row_bytes;
      copy_bytes<false, 4>(a_shard + src_offset, dst, rows * row_bytes, thread, threads);
      dev::named_barrier_sync(kBarrier, threads);
      if (thread == 0) {
        dev::fence_acq_rel_sys();
        launch.signal(dest, dev::signal_index(SignalId::kOp, p), 1);
        trace_mark(trace, kTraceSide, kTraceSent, dest);
      }
    }
  }

  // ---- across nodes ----
  static constexpr int kSideBarrier = 3;  // named barrier of the 96 side threads

  // Copies piece p of shard q from `src` (a buffer laid out as the workspace, or A_r itself when
  // q is this rank) into local rank `dest`'s workspace and raises its signal there, once `dest`
  // has entered this launch (thread 0 waits; `entered`: bit per local rank). False: a wait failed
  // (the same on every thread).
  __device__ bool push_local(const dev::Launch& launch, int dest, int q, int p, const uint8_t* src,
                             uint32_t& entered, int thread, int threads) const {
    bool failed = false;
    if (thread == 0 && !((entered >> dest) & 1)) {
      failed = !launch.wait(comm.node_ranks[dest], dev::signal_index(SignalId::kEntry, 0), 1);
      entered |= 1u << dest;
    }
    if (dev::named_barrier_or(kSideBarrier, threads, failed)) return false;
    const int row0 = p * piece_rows;
    const int rows = min(piece_rows, shard_rows - row0);
    uint8_t* dst = static_cast<uint8_t*>(ws_peers[dest]) + ws_offset +
                   (static_cast<uint64_t>(q) * shard_rows + row0) * row_bytes;
    // Coherent loads: a relayed piece was written by the transport after the kernel started.
    copy_bytes<true>(src, dst, rows * row_bytes, thread, threads);
    dev::named_barrier_sync(kSideBarrier, threads);
    if (thread == 0) {
      dev::fence_acq_rel_sys();
      launch.signal(dest, dev::signal_index(SignalId::kOp, routes.signal_base[q] + p), 1);
      trace_mark(trace, kTraceSide, kTraceSent, comm.node_ranks[dest]);
    }
    return true;
  }

  // Work units, spread over the pushing CTAs in this order: (1) pieces of A_r to the rail peers
  // (copied into this rank's own workspace slot, then one put+signal command per rail peer - the
  // longest way first), (2) pieces of A_r to the node's other ranks over NVLink, (3) the rail
  // peers' pieces, once arrived, on to the node's other ranks.
  // (Inlined on purpose: a call out of a warpgroup whose registers setmaxnreg lowered is not
  // known to stay within them. The first version called it - to keep the one-node kernels
  // spill-free, before they got their own instantiations - and hung; the cause is not known.)
  __device__ void side_task_across_nodes(int thread, int threads) const {
    const dev::Launch launch = dev::Launch::begin(comm);
    const int g = comm.local_size;
    const uint64_t entry_value = dev::signal_value(launch.epoch, 1);
    auto push = [&](int ring, const transport::Command& c) {
      return dev::push_command(comm, routes.rings[ring % routes.num_rings], c);
    };
    if (thread == 0) trace_mark(trace, kTraceSide, kTraceSideStart);
    if (blockIdx.x == 0) {
      announce_entry(comm, launch, thread, threads);
      for (int i = thread; i < routes.rails; i += threads) {  // "entered", over the rail
        push(i, transport::make_signal(routes.rail[i], 0, kHostEntrySignal, entry_value));
      }
    }
    if (static_cast<int>(blockIdx.x) >= comm_ctas) return;
    const int sends = pieces, pushes = (g - 1) * pieces, relays = routes.rails * pieces;
    uint8_t* my_ws = static_cast<uint8_t*>(ws_peers[comm.local_rank]) + ws_offset;
    uint32_t entered_local = 1u << comm.local_rank;  // thread 0's (this rank: entered)
    bool rails_entered = false;                      // thread 0's
    for (int u = blockIdx.x; u < sends + pushes + relays; u += comm_ctas) {
      if (u < sends) {
        // (1) Every rail peer has entered (its last launch, which read what this rank sent from
        // its own slot, is over): refill the slot, then one command per rail peer.
        const int p = u;
        bool failed = false;
        if (thread == 0 && !rails_entered) {
          for (int i = 0; i < routes.rails && !failed; ++i) {
            failed = !launch.wait_remote(routes.rail[i], kHostEntrySignal, 1);
          }
          rails_entered = true;
        }
        if (dev::named_barrier_or(kSideBarrier, threads, failed)) return;
        const int row0 = p * piece_rows;
        const int rows = min(piece_rows, shard_rows - row0);
        // Staged in this rank's workspace slot, or its node's slot of the host staging; the
        // offset in the registered buffer is the same at the rail peers.
        const int slot = routes.xfer != nullptr ? routes.node : comm.rank;
        const uint64_t in_slots = (static_cast<uint64_t>(slot) * shard_rows + row0) * row_bytes;
        const uint64_t offset = routes.xfer != nullptr ? in_slots : ws_offset + in_slots;
        copy_bytes(a_shard + static_cast<uint64_t>(row0) * row_bytes,
                   (routes.xfer != nullptr ? routes.xfer : my_ws) + in_slots, rows * row_bytes,
                   thread, threads);
        dev::named_barrier_sync(kSideBarrier, threads);
        if (thread == 0) {
          dev::fence_acq_rel_sys();  // the copy, before the proxy reads it
          const uint32_t signal = kHostPieceSignal0 + routes.signal_base[comm.rank] + p;
          for (int i = 0; i < routes.rails && !failed; ++i) {
            failed = !push(p + i,
                           transport::make_put_signal(routes.rail[i], p, routes.xfer_buffer, offset,
                                                      routes.xfer_buffer, offset, rows * row_bytes,
                                                      signal, dev::signal_value(launch.epoch, 1)));
          }
          trace_mark(trace, kTraceSide, kTraceSent, routes.rail[0]);
        }
        if (dev::named_barrier_or(kSideBarrier, threads, failed)) return;
      } else if (u < sends + pushes) {
        // (2) A_r to the node's other ranks, the one that reads it soonest first.
        const int v = u - sends;
        const int dest = (comm.local_rank - (v / pieces + 1) + g) % g;
        const int p = v % pieces;
        if (!push_local(launch, dest, comm.rank, p,
                        a_shard + static_cast<uint64_t>(p) * piece_rows * row_bytes, entered_local,
                        thread, threads)) {
          return;
        }
      } else {
        // (3) A rail peer's piece has arrived here: on to every other rank of the node.
        const int v = u - sends - pushes;
        const int i = v / pieces, p = v % pieces;
        const int q = routes.rail[i];
        bool failed = false;
        if (thread == 0) {
          failed = !launch.wait_remote(q, kHostPieceSignal0 + routes.signal_base[q] + p, 1);
          dev::fence_acq_rel_sys();
        }
        if (dev::named_barrier_or(kSideBarrier, threads, failed)) return;
        const uint64_t piece = static_cast<uint64_t>(p) * piece_rows * row_bytes;
        const uint64_t shard_bytes = static_cast<uint64_t>(shard_rows) * row_bytes;
        const uint8_t* src = routes.xfer != nullptr
                                 ? routes.xfer + routes.rail_node[i] * shard_bytes + piece
                                 : my_ws + q * shard_bytes + piece;
        // Out of the host staging also into this rank's own slot (d = 0), where its producer
        // waits for it on the device pad (GatherRoutes::source[q] is this rank then).
        for (int d = routes.xfer != nullptr ? 0 : 1; d < g; ++d) {
          if (!push_local(launch, (comm.local_rank + d) % g, q, p, src, entered_local, thread,
                          threads)) {
            return;
          }
        }
      }
    }
  }

  __device__ void finish() const { dev::Launch::begin(comm).end(); }
};

template <int kBlockN>
using AgGemmAcrossNodes = AgGemmFusion<kBlockN, true>;
static_assert(gemm_engine::check_fusion_widths<AgGemmFusion>() &&
              gemm_engine::check_fusion_widths<AgGemmAcrossNodes>());

}  // namespace mk::fused
