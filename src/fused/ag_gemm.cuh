// AllGather + GEMM as a Fusion policy of the GEMM engine (src/gemm/gemm_kernel.cuh).
//
// Rank r's output rows come in shards: shard s = rows [s * S, (s + 1) * S) of C, computed from
// rank s's A rows. Work items walk the shards in the order r, r + 1, ..., r - 1 (mod world): the
// own shard first, read straight from the caller's A_r, so the tensor cores start at once.
//
// Meanwhile the producer warpgroup's three spare warps push A_r into every peer's workspace
// (slot r of [world][S][K]), piece by piece (piece_rows rows, ~512 KiB), the peer that needs it
// soonest first (rank r - 1 reads shard r right after its own), and raise the op signal of each
// piece on the receiver. Before a peer-shard tile's first load the producer waits for the signals
// of the pieces under the tile's 128 rows, then orders that acquire before its TMA reads
// (fence.proxy.async.global).
//
// Reuse: pushing into a peer's workspace is safe once the peer has entered this launch (its
// previous launch, which read the workspace, is over): CTA 0 raises "entered" to every peer at
// the start, and the pushers wait for it from their destination before the first piece.
// Signals carry the launch epoch, so no flag is ever reset.
#pragma once

#include <cstdint>

#include "fused/trace.cuh"
#include "gemm/gemm_kernel.cuh"
#include "mkernel/device/launch.cuh"
#include "mkernel/device_comm.h"

namespace mk::fused {

// 16 bytes read once: no L1 allocation (L1 shares its storage with the GEMM's shared memory).
__device__ __forceinline__ uint4 load_streaming(const uint8_t* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

// Copies `bytes` (a multiple of 16) from src to dst with `threads` threads, four 16-byte vectors
// in flight per thread.
__device__ __forceinline__ void copy_bytes(const uint8_t* src, uint8_t* dst, uint64_t bytes,
                                           int thread, int threads) {
  constexpr int kUnroll = 2;
  const uint64_t step = static_cast<uint64_t>(threads) * 16;
  uint64_t i = static_cast<uint64_t>(thread) * 16;
  for (; i + (kUnroll - 1) * step < bytes; i += kUnroll * step) {
    uint4 v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) v[u] = load_streaming(src + i + u * step);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) *reinterpret_cast<uint4*>(dst + i + u * step) = v[u];
  }
  for (; i < bytes; i += step) {
    *reinterpret_cast<uint4*>(dst + i) = load_streaming(src + i);
  }
}

template <int kBlockN>
struct AgGemmFusion {
  static constexpr int kProducerRegs = 48;   // the pushes and waits with their timeline marks
  static constexpr int kConsumerRegs = 224;  // (40 spilled); 48 + 2 x 224 <= 3 x 168
  CUtensorMap a_local;     // this rank's shard [S, K] (caller's memory), boxes 128 x 64
  CUtensorMap a_gathered;  // workspace [world][S][K], boxes 128 x 64 x 1 (rows clip per shard)
  CUtensorMap c;           // C as [world][S][N], boxes 64 x 64 x 1
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

  __device__ int num_tiles() const { return comm.world_size * raster.num_tiles(); }

  __device__ gemm_engine::Tile tile(int t) const {
    const int per_shard = raster.num_tiles();
    gemm_engine::Tile tile;
    tile.shard = (comm.rank + t / per_shard) % comm.world_size;
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
    const uint64_t* words = comm.signals + tile.shard;
    const uint64_t stride = comm.world_size;
    for (int p = first; p <= last; ++p) {
      const uint32_t signal = dev::signal_index(SignalId::kOp, p);
      if (dev::reached(dev::ld_relaxed_sys(words + signal * stride), expected)) continue;
      // On a time-out the error is recorded and every later wait returns at once; the tile is
      // computed from whatever is there and the host reports the error.
      if (!launch.wait(tile.shard, signal, 1)) break;
    }
    dev::fence_acq_rel_sys();
    dev::fence_proxy_async_global();
    trace_mark(trace, kTraceProducer, kTraceOperandsIn, tile.shard);
  }

  __device__ void load_a(void* dst, uint64_t* bar, const gemm_engine::Tile& tile, int k0) const {
    if (tile.shard == comm.rank) {
      dev::tma_load_2d(dst, &a_local, bar, k0, tile.m * 128);
    } else {
      dev::tma_load_3d(dst, &a_gathered, bar, k0, tile.m * 128, tile.shard);
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
    const int row0 = tile.m * 128 + gemm_engine::slice_half(tile, consumer) * 64;
    const int col0 = tile.n * kBlockN;
    gemm_engine::store_slice(acc, col0, n, consumer, scratch, [&](const uint8_t* buf, int j) {
      dev::tma_store_3d(&c, buf, col0 + 64 * j, row0, tile.shard);
    });
    if (leader) trace_mark(trace, kTraceConsumer0 + consumer, kTraceStoreEnd);
  }

  __device__ void consumer_done(ConsumerState&) const {}

  // Producer warps 1..3: announce this launch to the peers (CTA 0), then push pieces of A_r.
  __device__ void side_task(int thread, int threads) const {
    const dev::Launch launch = dev::Launch::begin(comm);
    const int world = comm.world_size;
    if (thread == 0) trace_mark(trace, kTraceSide, kTraceSideStart);
    if (blockIdx.x == 0) {
      for (int peer = thread; peer < comm.local_size; peer += threads) {
        if (peer != comm.local_rank) launch.signal(peer, dev::signal_index(SignalId::kEntry, 0), 1);
      }
    }
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
      copy_bytes(a_shard + src_offset, dst, rows * row_bytes, thread, threads);
      dev::named_barrier_sync(kBarrier, threads);
      if (thread == 0) {
        dev::fence_acq_rel_sys();
        launch.signal(dest, dev::signal_index(SignalId::kOp, p), 1);
        trace_mark(trace, kTraceSide, kTraceSent, dest);
      }
    }
  }

  __device__ void finish() const { dev::Launch::begin(comm).end(); }
};

}  // namespace mk::fused
