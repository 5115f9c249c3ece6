// Ring attention across nodes (ring_attention.cu): one ring launch a node, the node's ranks the
// ring, and between two launches every rank's chunk moves one node on, to its rail peer there.
//
// Rank (n, l) - node n of N, local index l - holds at launch i (i = 0 .. N - 1) the chunk of
// rank (n - i, l): at i = 0 its own, from i = 1 on what its rail peer on node n - 1 held at
// launch i - 1. Launch i is the one-node ring over the node's ranks on those chunks (the zigzag's
// chunk numbers are the owners' global ranks: RingAttention::chunk_rank), the softmax state
// carried from launch i - 1 to i through the workspace. So every query meets every key chunk
// once, and each chunk crosses each link between nodes once.
//
// The exchange before launch i >= 1, two launches of a thread's work (every wait is for a
// signal of the same launch on the other side: the signal values carry the launch's epoch):
//   ready   "my inbound region B is free" to the rail peer on node n - 1 (this rank's stream has
//           copied B's last chunk out), then wait for the same word from the rail peer on node
//           n + 1 - its B is free, and it has passed the last data launch, so the last put out of
//           this rank's A has landed
//   (kernel) the chunk to send into A: the user's k, v at i = 1 (gather_chunk_kernel), else the
//           one held at launch i - 1 (copy_chunk_kernel)
//   data    A put into node n + 1's rail peer's B with a signal; wait for node n - 1's into B;
//           after the last launch's exchange also "landed" both ways (no put out of A in flight
//           once the call ends)
// The call's first "ready" goes to and comes from every rail peer: the ops before the call may
// have put out of, or into, the bytes of the shared staging that A and B now occupy.
//   (kernel) B copied to the launch's local chunk (device memory, contiguous [B, S, H_kv, D]:
//           K, then V), the ring's counters zeroed in the same kernel (copy_chunk_kernel)
// Everything the call puts on the stream is a kernel (no stream copy, no memset): ranks that are
// threads of one process share the GPU's queues, and a copy or memset queued behind a peer's
// copy that waits for the peer's waiting exchange kernel does not start. At 3+ nodes that closes
// a cycle (the exchange before launch i >= 2 waits for every node's launch i - 1, which waits for
// the copy before it). RingNodes.LateRankDoesNotDeadlock/3x2 hung with stream copies and a memset
// here and passes with the kernels (2026-12-07, an H100).
// A and B sit in the workspace (device staging) or in the inter-node path's pinned host staging.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "mkernel/device/launch.cuh"
#include "mkernel/device/push.cuh"
#include "mkernel/device_comm.h"
#include "mkernel/transport/command.h"
#include "mkernel/transport/ring.h"

namespace mk::attention_engine {

// Host-pad signals of the exchange (< kInterNodeSignals).
constexpr uint32_t kXchgReadySignal = 0;
constexpr uint32_t kXchgDataSignal = 1;
constexpr uint32_t kXchgLandedSignal = 2;  // the last exchange: "your put has landed"
constexpr int kMaxRingNodes = 64;

struct RingXchg {
  transport::CommandRing ring;  // the inter-node path's first command ring
  int buffer;                   // registered id of the buffer holding A and B
  uint64_t a_offset;            // byte offsets of A and B in it (the same on every rank)
  uint64_t b_offset;
  uint64_t bytes;  // a chunk: K then V
  int to;          // global ranks: the rail peers on the next node and on the previous one
  int from;
  int16_t rails[kMaxRingNodes];  // every rail peer (this rank's local index on the other nodes)
  int num_rails;
};

// "My B is free" to `from`; then wait for `to`'s word. `all` (a call's first exchange): to and
// from every rail peer instead - every one has entered this call, so the puts of the ops before
// it out of this rank's staging have landed (their receivers waited for them) and their inbound
// regions are read, whatever region of the shared staging A and B now overlap (as MoE's
// rail_entered). A lane a rail peer.
__global__ void __launch_bounds__(32)
    ring_xchg_ready_kernel(DeviceComm comm, RingXchg x, bool all) {
  const dev::Launch launch = dev::Launch::begin(comm);
  const int n = all ? x.num_rails : 1;
  for (int i = threadIdx.x; i < n; i += 32) {
    const int tell = all ? x.rails[i] : x.from, hear = all ? x.rails[i] : x.to;
    if (dev::push_command(comm, x.ring,
                          transport::make_signal(static_cast<uint32_t>(tell), 0, kXchgReadySignal,
                                                 dev::signal_value(launch.epoch, 1)))) {
      launch.wait_remote(hear, kXchgReadySignal, 1);
    }
  }
  launch.end();
}

// A into `to`'s B (the put's signal raised once its bytes landed); then wait for `from`'s put
// into this rank's B. `last` (a call's last exchange): then "landed" to `from` and wait for
// `to`'s - no put out of A is in flight once the call ends (A may be in the workspace, the
// caller's again then). One thread works.
__global__ void __launch_bounds__(32)
    ring_xchg_data_kernel(DeviceComm comm, RingXchg x, bool last) {
  const dev::Launch launch = dev::Launch::begin(comm);
  if (threadIdx.x == 0) {
    dev::fence_acq_rel_sys();
    const auto buf = static_cast<uint8_t>(x.buffer);
    const uint64_t value = dev::signal_value(launch.epoch, 1);
    if (dev::push_command(
            comm, x.ring,
            transport::make_put_signal(static_cast<uint32_t>(x.to), 0, buf, x.a_offset, buf,
                                       x.b_offset, x.bytes, kXchgDataSignal, value)) &&
        launch.wait_remote(x.from, kXchgDataSignal, 1) && last &&
        dev::push_command(
            comm, x.ring,
            transport::make_signal(static_cast<uint32_t>(x.from), 0, kXchgLandedSignal, value))) {
      launch.wait_remote(x.to, kXchgLandedSignal, 1);
    }
  }
  launch.end();
}

// The user's k and v ([B, S, H_kv, D], element strides; D a multiple of 8) into dst, contiguous:
// K then V, each [B, S, H_kv, D]. 16 bytes a thread and step.
__global__ void gather_chunk_kernel(const __nv_bfloat16* k, const __nv_bfloat16* v,
                                    int64_t stride_batch, int64_t stride_seq, int64_t stride_head,
                                    int64_t seq, int64_t kv_heads, int64_t head_dim, uint4* dst) {
  const int64_t d8 = head_dim / 8;
  const int64_t vectors = static_cast<int64_t>(gridDim.y) * seq * kv_heads * d8;  // one of K, V
  const __nv_bfloat16* src = blockIdx.z == 0 ? k : v;
  uint4* out = dst + blockIdx.z * vectors;
  const int64_t per_batch = seq * kv_heads * d8;
  const int64_t b = blockIdx.y;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < per_batch;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t s = i / (kv_heads * d8), h = i / d8 % kv_heads, c = i % d8;
    out[b * per_batch + i] = *reinterpret_cast<const uint4*>(
        src + b * stride_batch + s * stride_seq + h * stride_head + 8 * c);
  }
}

// dst <- src (`vectors` 16-byte vectors; either side may be mapped pinned host memory), then
// `words` 8-byte words at `zero` set to 0 (the ring's counters before its launch; null: none).
// The exchange's copies as a kernel on the rank's stream (see the header).
__global__ void copy_chunk_kernel(uint4* dst, const uint4* src, int64_t vectors,
                                  unsigned long long* zero, int64_t words) {
  const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = first; i < vectors; i += stride) dst[i] = src[i];
  for (int64_t i = first; i < words; i += stride) zero[i] = 0;
}

}  // namespace mk::attention_engine
