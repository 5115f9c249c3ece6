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
//     bf16 to the output. Reductions stay fp32 until that one rounding.
// Reuse: a peer adds into o's accumulator only after o entered the launch (o's previous launch,
// which read and zeroed it, is over). The workspace must be zero before the first launch.
#pragma once

#include <cstdint>

#include "gemm/gemm_kernel.cuh"
#include "mkernel/device/launch.cuh"
#include "mkernel/device_comm.h"

namespace mk::fused {

constexpr int kMaxLocalRanks = 8;  // tensor maps of the peers' accumulators travel in the params

template <int kBlockN>
struct GemmRsFusion {
  CUtensorMap a;                       // A_r as [world][S][K_r], boxes 128 x 64 x 1
  CUtensorMap out;                     // this rank's output [S][N] bf16, boxes 64 x 64
  float* accum_peers[kMaxLocalRanks];  // each local rank's accumulator [S][N] fp32, mapped here
  DeviceComm comm;
  float* my_accum;   // this rank's accumulator (local address)
  int debug;         // DIAGNOSTIC (branch wip/gemm-rs-diagnose): MKERNEL_RS_DEBUG bits
                     //   1 skip sends, 2 skip add_and_clear, 4 skip the flush fence,
                     //   8 skip the own tiles' waits (results wrong with 1, 2 or 8)
  bool single_peer;  // two ranks: the one peer stores its partial (a sum onto zero) instead of
                     // adding it - plain NVLink writes, no remote read-modify-write
  int shard_rows;    // S
  int n;
  gemm_engine::GroupedRaster raster;  // tiles of one shard

  __device__ int num_tiles() const { return comm.world_size * raster.num_tiles(); }

  __device__ gemm_engine::Tile tile(int t) const {
    const int per_shard = raster.num_tiles();
    gemm_engine::Tile tile;
    tile.shard = (comm.rank + 1 + t / per_shard) % comm.world_size;  // own rows last
    raster.tile(t % per_shard, tile.m, tile.n);
    return tile;
  }

  __device__ void wait_operands(const gemm_engine::Tile&) const {}

  __device__ void load_a(void* dst, uint64_t* bar, const gemm_engine::Tile& tile, int k0) const {
    dev::tma_load_3d(dst, &a, bar, k0, tile.m * 128, tile.shard);
  }

  // Signal slot of a consumer's slice of a tile, in the owner's numbering.
  __device__ uint32_t slot(const gemm_engine::Tile& tile, int consumer) const {
    return dev::signal_index(SignalId::kOp, 2 * (tile.m * raster.tiles_n + tile.n) + consumer);
  }

  // The accumulator is laid out slice by slice (not row-major), so that the 64 x kBlockN slice a
  // consumer sends is one contiguous block (64 KiB at kBlockN = 256) instead of 64 rows 4*N
  // bytes apart: band = 64 rows of a tile-row (the last band of the shard may be shorter), and
  // inside a band the tiles' slices follow each other, each [h][w] row-major with
  // h = rows of the band, w = columns of the tile. Total exactly S x N floats.
  __device__ int64_t slice_offset(int m, int tile_n, int consumer) const {
    const int row0 = m * 128 + consumer * 64;
    const int h = min(64, shard_rows - row0);
    return static_cast<int64_t>(row0) * n + static_cast<int64_t>(h) * tile_n * kBlockN;
  }
  __device__ int slice_width(int tile_n) const { return min(kBlockN, n - tile_n * kBlockN); }

  // Per consumer warpgroup, thread 0's bookkeeping between epilogues.
  struct ConsumerState {
    int owner = -1;  // a reduce whose signal is still owed, or -1
    uint32_t signal = 0;
    uint32_t entered = 0;  // bit o: owner o has been seen in this launch
  };

  template <int kRegs>
  __device__ void store(float (&acc)[kRegs], const gemm_engine::Tile& tile, int consumer,
                        uint8_t* scratch, ConsumerState& pending) const {
    const dev::Launch launch = dev::Launch::begin(comm);
    const int t = threadIdx.x % 128;
    if (t == 0) flush(pending, launch);
    const int row0 = tile.m * 128 + consumer * 64, col0 = tile.n * kBlockN;
    if (tile.shard != comm.rank) {
      const int owner = tile.shard;  // one node: global rank = local rank
      if (t == 0 && !(pending.entered & (1u << owner))) {
        launch.wait(owner, dev::signal_index(SignalId::kEntry, 0), 1);  // it may be reused
        pending.entered |= 1u << owner;
      }
      if (row0 < shard_rows && !(debug & 1)) {
        send_slice(acc, row0, col0, consumer, scratch,
                   accum_peers[owner] + slice_offset(tile.m, tile.n, consumer),
                   slice_width(tile.n));
      }
      if (t == 0) {
        pending.owner = owner;
        pending.signal = slot(tile, consumer);
      }
      return;
    }
    // Own rows: the peers' partial sums of this slice, then one rounding to bf16.
    if (t == 0 && !(debug & 8)) {
      const uint32_t signal = slot(tile, consumer);
      for (int src = 0; src < comm.world_size; ++src) {
        if (src == comm.rank) continue;
        if (!dev::reached(dev::ld_relaxed_sys(comm.signals + signal * comm.world_size + src),
                          dev::signal_value(launch.epoch, 1))) {
          if (!launch.wait(src, signal, 1)) break;  // time-out recorded: finish with what is there
        }
      }
      dev::fence_acq_rel_sys();
    }
    dev::named_barrier_sync(1 + consumer, 128);
    if (row0 < shard_rows && !(debug & 2)) {
      add_and_clear(acc, row0, my_accum + slice_offset(tile.m, tile.n, consumer),
                    slice_width(tile.n));
    }
    gemm_engine::store_slice(acc, col0, n, consumer, scratch, [&](const uint8_t* buf, int j) {
      dev::tma_store_2d(&out, buf, col0 + 64 * j, row0);
    });
  }

  // Thread 0 of a consumer: the previous reduce has landed -> tell its owner.
  __device__ void flush(ConsumerState& pending, const dev::Launch& launch) const {
    if (pending.owner < 0) return;
    if (!(debug & 4))
      dev::fence_acq_rel_sys();  // after the warpgroup's stores (send_slice ends
                                 // with a barrier)
    launch.signal(pending.owner, pending.signal, 1);
    pending.owner = -1;
  }

  __device__ void consumer_done(ConsumerState& pending) const {
    if (threadIdx.x % 128 == 0) flush(pending, dev::Launch::begin(comm));
  }

  // acc += this thread's words of the slice (at `slice`, rows of `width` floats), and those words
  // become 0. Two column blocks at a time (more spill at 128 x 256): their loads are all issued
  // before any add or store, so they are in flight together (one loop of load-add-store would wait
  // for each load in turn: the compiler cannot prove that the rows r and r + 8 differ from the ones
  // it stores to).
  template <int kRegs>
  __device__ void add_and_clear(float (&acc)[kRegs], int row0, float* slice, int width) const {
    const int t = threadIdx.x % 128;
    const int r = (t / 32) * 16 + (t % 32) / 4;  // row in the slice; and r + 8
    const int c = 2 * (t % 4);                   // column in the tile of block 0
    const int rows = shard_rows - row0;          // rows of this slice that exist
    constexpr int kBatch = 2;
#pragma unroll
    for (int b0 = 0; b0 < kRegs / 4; b0 += kBatch) {
      float2 v[2 * kBatch];
#pragma unroll
      for (int i = 0; i < kBatch; ++i) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int col = c + 8 * (b0 + i), row = r + 8 * h;
          v[2 * i + h] = row < rows && col < width
                             ? __ldcg(reinterpret_cast<const float2*>(slice + row * width + col))
                             : make_float2(0.f, 0.f);
        }
      }
#pragma unroll
      for (int i = 0; i < kBatch; ++i) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          acc[4 * (b0 + i) + 2 * h] += v[2 * i + h].x;
          acc[4 * (b0 + i) + 2 * h + 1] += v[2 * i + h].y;
          const int col = c + 8 * (b0 + i), row = r + 8 * h;
          if (row < rows && col < width) {
            __stcg(reinterpret_cast<float2*>(slice + row * width + col), make_float2(0.f, 0.f));
          }
        }
      }
    }
  }

  // Sends a consumer's 64 x kBlockN fp32 slice to its place in an owner's accumulator (see
  // slice_offset) over NVLink: 32-column
  // chunks are transposed through a 128-byte-swizzled 64 x 32 buffer in shared memory (two
  // alternating), then every thread writes whole 16-byte pieces of accumulator rows - coalesced
  // 128-byte rows, posted writes; with two ranks plain stores (the accumulator receives one
  // partial), else vector reductions (red.add.v4.f32). Ends with a barrier of the warpgroup, so
  // that thread 0's release afterwards covers every thread's writes. (TMA stores and reduces to
  // the peer, tried first, ran at ~30 GB/s: each waited for the remote write before its shared
  // memory could be reused.)
  template <int kRegs>
  __device__ void send_slice(const float (&acc)[kRegs], int row0, int col0, int consumer,
                             uint8_t* scratch, float* slice, int width) const {
    constexpr int kChunks = kRegs / 16;  // 32 columns = 4 column blocks of 4 registers
    constexpr int kChunkBytes = 64 * 32 * 4;
    const int t = threadIdx.x % 128;
    const int r = (t / 32) * 16 + (t % 32) / 4;
    const int barrier = 1 + consumer;
    const int my_row = t / 2;          // the row this thread writes out
    const int my_units = 4 * (t % 2);  // its four 16-byte units of the row's 128 bytes
    const bool row_ok = row0 + my_row < shard_rows;
    float* dst_row = slice + my_row * width;
    if (t == 0) dev::bulk_wait_group_read<0>();  // the buffers' earlier TMA stores have read them
#pragma unroll
    for (int j = 0; j < kChunks; ++j) {
      if (col0 + 32 * j >= n) break;
      uint8_t* buf = scratch + (j % 2) * kChunkBytes;
      dev::named_barrier_sync(barrier, 128);  // everyone is done reading buf (chunk j - 2)
#pragma unroll
      for (int b = 0; b < 4; ++b) {
        const float* v = &acc[16 * j + 4 * b];
        const int unit = 2 * b + (t % 4) / 2;  // 16-byte unit of the 128-byte row
        const int offset = 8 * (t % 2);
        st_shared_f32x2(buf + r * 128 + ((unit ^ (r % 8)) * 16) + offset, v[0], v[1]);
        st_shared_f32x2(buf + (r + 8) * 128 + ((unit ^ ((r + 8) % 8)) * 16) + offset, v[2], v[3]);
      }
      dev::named_barrier_sync(barrier, 128);
#pragma unroll
      for (int u = my_units; u < my_units + 4; ++u) {
        const int col = 32 * j + 4 * u;  // in the tile
        if (!row_ok || col >= width) continue;
        const float4 v =
            *reinterpret_cast<const float4*>(buf + my_row * 128 + ((u ^ (my_row % 8)) * 16));
        if (single_peer) {
          *reinterpret_cast<float4*>(dst_row + col) = v;
        } else {
          red_add_f32x4(dst_row + col, v);
        }
      }
    }
    dev::named_barrier_sync(barrier, 128);
  }

  __device__ static void red_add_f32x4(float* p, float4 v) {
    asm volatile("red.relaxed.sys.global.add.v4.f32 [%0], {%1, %2, %3, %4};" ::"l"(p), "f"(v.x),
                 "f"(v.y), "f"(v.z), "f"(v.w)
                 : "memory");
  }

  __device__ static void st_shared_f32x2(void* p, float x, float y) {
    asm volatile("st.shared.v2.f32 [%0], {%1, %2};" ::"r"(dev::smem_addr(p)), "f"(x), "f"(y)
                 : "memory");
  }

  // Producer warps 1..3 of CTA 0: announce this launch to the peers.
  __device__ void side_task(int thread, int threads) const {
    if (blockIdx.x != 0) return;
    const dev::Launch launch = dev::Launch::begin(comm);
    for (int peer = thread; peer < comm.local_size; peer += threads) {
      if (peer != comm.local_rank) launch.signal(peer, dev::signal_index(SignalId::kEntry, 0), 1);
    }
  }

  __device__ void finish() const { dev::Launch::begin(comm).end(); }
};

}  // namespace mk::fused
