// mkernel/attention.h - the attention engine on one GPU: a FlashAttention-style forward (TMA,
// wgmma, a producer warpgroup and two consumer warpgroups, online softmax). Ring attention feeds
// the same mainloop chunk by chunk (src/attention/attention_kernel.cuh has the hooks).
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <string>

#include "mkernel/communicator.h"

namespace mk {

// A [batch, seq, heads, head_dim] bf16 tensor (the flash-attn layout). Strides in elements, the
// last dimension contiguous; a stride of 0 means the contiguous layout's. The tensor copy engine
// needs the pointer 16-byte aligned and every stride a multiple of 8 elements.
struct AttentionTensor {
  const void* data = nullptr;
  int64_t stride_batch = 0;
  int64_t stride_seq = 0;
  int64_t stride_head = 0;
};

struct AttentionProblem {
  int64_t batch = 1;
  int64_t seq_q = 0;        // query rows S_q (>= 1)
  int64_t seq_kv = 0;       // keys S_kv (>= 1)
  int64_t heads = 0;        // query heads H
  int64_t kv_heads = 0;     // key / value heads H_kv, dividing H (GQA; 1: MQA); query head h reads
                            // key head h / (H / H_kv)
  int64_t head_dim = 128;   // D: 64 or 128
  bool causal = false;      // bottom-right aligned (flash-attn's convention): query i sees the
                            // keys j <= i + S_kv - S_q
  float softmax_scale = 0;  // 0: 1 / sqrt(D)
};

struct AttentionConfig {
  int sms = 0;  // persistent CTAs at most; 0 = every SM of the device
};

// What attention() will run for a problem (describe() prints it; MKERNEL_PRINT_CONFIG=1 too).
struct AttentionPlan {
  int head_dim = 0;
  int block_m = 0;    // query rows per work item (two consumer warpgroups x 64)
  int block_n = 0;    // keys per KV block
  int stages = 0;     // K / V blocks in flight per CTA
  int ctas = 0;       // persistent CTAs
  int64_t items = 0;  // work items: (batch, head, query tile)
  // The last wave split: when the items past the last whole wave fill at most half of it, they
  // run apart, each cut into split_pieces runs of KV blocks on their own CTAs, and a merge
  // writes their O and LSE (three launches; 0 / 0: one launch, nothing split).
  int64_t split_items = 0;
  int split_pieces = 0;
  int smem_bytes = 0;  // shared memory per CTA
  std::string describe() const;
};
// Throws mk::Error on the problems attention() rejects (the tensors aside).
AttentionPlan attention_plan(const AttentionProblem& problem, const AttentionConfig& config = {});

// O = softmax(scale * Q K^T, masked if causal) V for every batch and head, bf16 in and out, fp32
// accumulation, on `stream` (no host synchronisation).
//   q: [B, S_q, H, D]; k, v: [B, S_kv, H_kv, D] (AttentionTensor: their strides)
//   o: [B, S_q, H, D] bf16, contiguous; not overlapping the inputs
//   lse: [B, H, S_q] fp32 contiguous, or nullptr: log(sum_j exp(scale * q_i . k_j)) over the
//        keys row i sees (natural log)
// A row that sees no key (causal with S_q > S_kv) gets O = 0 and LSE = -inf. Throws mk::Error
// before launching on a bad shape, pointer or stride, naming it.
void attention(const AttentionProblem& problem, const AttentionTensor& q, const AttentionTensor& k,
               const AttentionTensor& v, void* o, float* lse, cudaStream_t stream,
               const AttentionConfig& config = {});

// ---- ring attention: sequence parallelism over the communicator's ranks ----------------------
//
// Every rank holds S_local = problem.seq_q = problem.seq_kv consecutive positions of q, k and v
// (non-causal: rank r holds positions [r S_local, (r + 1) S_local)) or, causal, its zigzag share:
// of 2 w equal chunks of the sequence, chunks r and 2 w - 1 - r, in that order (S_local even;
// every rank then does the same work). O [B, S_local, H, D] and LSE [B, H, S_local] are attention
// of this rank's queries over the whole sequence, in the same order. One launch per call: key /
// value chunks travel between the ranks (NVLink: each rank writes its own into its peers'
// kRingSlots = 2 workspace slots, in the order the queries need them)
// while the attention engine works on the chunk that has arrived; each query tile's softmax state
// carries across the chunks, so no merge pass follows. Across nodes, one such launch a node: the
// node's ranks are the ring, and between two launches every rank's chunk moves one node on to
// its rail peer there over the inter-node path (each chunk crosses each link between nodes
// once), the softmax state carried from launch to launch. Stream-ordered, no host
// synchronisation, CUDA graphs. Calls on one communicator must be issued in the same order on
// every rank.
//
// Workspace: symmetric memory (Communicator::alloc) of ring_attention_workspace_bytes(), at the
// same offset on every rank: 4 x the local K (two slots of K and V), and from world 4 on (more
// chunks than the slots hold: the steps go in rounds) 2 x the local O in fp32 (the state carried
// between rounds or node launches; across nodes also 6 x the local K: the chunk a launch holds
// and the exchange's two buffers) - bounded whatever the world size. Every peer write into it
// has landed before the call's last kernel ends, and peers read it only before then: once the
// stream reaches the call's end (without a time-out: after one, peers may still be writing), the
// workspace is the caller's again. The problem must be the same on every rank; the config (sms)
// may differ (the copies go in a fixed number of shares, whatever each rank's CTA count).
std::size_t ring_attention_workspace_bytes(const Communicator& comm, const AttentionProblem& local);
// What ring_attention() will run (the engine's tiles; ctas = the communicator's SM budget).
AttentionPlan ring_attention_plan(const Communicator& comm, const AttentionProblem& local,
                                  const AttentionConfig& config = {});
// Throws mk::Error before launching on a bad argument (naming it); kUnsupported across more
// than 64 nodes or with more than 16 ranks a node.
void ring_attention(Communicator& comm, const AttentionProblem& local, const AttentionTensor& q,
                    const AttentionTensor& k, const AttentionTensor& v, void* o, float* lse,
                    void* workspace, cudaStream_t stream, const AttentionConfig& config = {});

}  // namespace mk
