// Internal interface of the attention engine: the host pieces attention() and ring_attention()
// share, and the tests' view of the kernels.
#pragma once

#include <cuda.h>
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <vector>

#include "gemm/gemm_internal.h"  // GemmKernelResources, encode_map
#include "mkernel/attention.h"
#include "runtime/cuda_check.h"

namespace mk {

namespace attention_host {

// Element strides of a [batch, seq, heads, D] tensor.
struct Strides {
  int64_t batch, seq, head;
};
// The checks every attention op makes on a problem (errors name `op`).
void require_problem(const AttentionProblem& p, const char* op);
// The tensor's strides (the contiguous layout's where 0) after checking what the copy engine
// needs; `bytes` gets the span it covers.
Strides require_tensor(const AttentionTensor& t, const char* op, const char* name, int64_t seq,
                       int64_t heads, int64_t batch, int64_t head_dim, int device,
                       std::size_t& bytes);
// (D, heads, seq, batch) over the tensor: boxes of 64 x 1 x box_rows x 1.
CUtensorMap make_map(const void* base, const Strides& s, int64_t batch, int64_t seq, int64_t heads,
                     int64_t head_dim, int box_rows);
// (D, heads, part_len, parts, batch): the sequence as `parts` parts of part_len rows (boxes clip
// at a part's end).
CUtensorMap make_map_parts(const void* base, const Strides& s, int64_t batch, int64_t parts,
                           int64_t part_len, int64_t heads, int64_t head_dim, int box_rows);
// softmax_scale (or 1 / sqrt(D)) x log2(e).
float scale_log2(const AttentionProblem& p);
// The engine's tiles for a checked problem on `sms` CTAs (items: query tiles of seq_q).
AttentionPlan plan(const AttentionProblem& p, int sms);

// q, k, v (element strides) and the outputs o (contiguous [B, S_q, H, D]) and lse (or null)
// checked, and no output overlapping an input or `workspace` (when given).
struct Operands {
  Strides q, k, v;
};
Operands require_operands(const AttentionProblem& p, const AttentionTensor& q,
                          const AttentionTensor& k, const AttentionTensor& v, void* o, float* lse,
                          const char* op, int device, const void* workspace = nullptr,
                          std::size_t workspace_bytes = 0);

}  // namespace attention_host

namespace detail {
// Every attention kernel instantiation the library launches (plain and ring), with its compiled
// resources.
std::vector<GemmKernelResources> attention_kernel_resources();
void add_ring_attention_resources(std::vector<GemmKernelResources>& out);
}  // namespace detail

}  // namespace mk
