#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace mk::test {

// out[r * n + j] = sum_k A[rows[r], k] * B(j, k) in fp64, for r < nrows; A [m, k] bf16, B [n, k]
// (b_kn false) or [k, n] (b_kn true) bf16.
void gemm_reference_rows(const void* a, const void* b, int64_t n, int64_t k, bool b_kn,
                         const int64_t* rows, int nrows, double* out, cudaStream_t s);
// Number of NaN elements among `count` bf16 values.
uint64_t count_nans_bf16(const void* p, int64_t count, cudaStream_t s);
// Fills `count` bf16 values with uniform [-1, 1) from `seed`.
void fill_random_bf16(void* p, int64_t count, uint64_t seed, cudaStream_t s);

}  // namespace mk::test
