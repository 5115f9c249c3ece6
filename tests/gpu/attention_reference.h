// The attention tests' reference: attention over sampled query rows in fp32 (simple, not fast),
// and the same computed the way a bf16 implementation does (scores and probabilities rounded to
// bf16, output rounded to bf16) - the "same precision" error of the tolerance rule.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "mkernel/attention.h"

namespace mk::test {

// For each query position rows[r] (r < nrows), every batch b and head h:
//   exact[((b * nrows + r) * H + h) * D + d]  fp32 attention output
//   lowp[...]                                  the bf16-rounded computation's output
//   lse[(b * H + h) * nrows + r]               natural-log LSE (-inf: the row sees no key)
// q, k, v: [B, S, H(_kv), D] bf16 with the AttentionTensor strides (0: contiguous).
void attention_reference(const AttentionProblem& p, const AttentionTensor& q,
                         const AttentionTensor& k, const AttentionTensor& v, const int32_t* rows,
                         int nrows, float* exact, float* lowp, float* lse, cudaStream_t s);

// Fills `count` bf16 values with uniform [-amplitude, amplitude) from `seed`.
void fill_random_bf16_scaled(void* p, int64_t count, float amplitude, uint64_t seed,
                             cudaStream_t s);

}  // namespace mk::test
