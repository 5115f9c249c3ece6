// References and checks for the GEMM tests (plain and fused). Everything is stream-ordered and
// allocates with cudaMallocAsync, so it can run while a peer rank's kernel shares the GPU.
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <cstdint>

namespace mk::test {

// out[r * n + j] = sum_k A[rows[r], k] * B(j, k) in fp64, for r < nrows; A [m, k] bf16, B [n, k]
// (b_kn false) or [k, n] (b_kn true) bf16.
void gemm_reference_rows(const void* a, const void* b, int64_t n, int64_t k, bool b_kn,
                         const int64_t* rows, int nrows, double* out, cudaStream_t s);
// C[m, n] = A[m, k] op(B) through cuBLAS (bf16, fp32 accumulation), on the handle's stream.
void cublas_gemm(cublasHandle_t h, const void* a, const void* b, void* c, int64_t m, int64_t n,
                 int64_t k, bool b_kn);
// Max |C - exact| over sampled rows (first, last, random ones from `seed`) of our C and of
// cuBLAS's: the tolerance rule (../shared/STYLE.md) is ours <= 2 * cublas + 1e-6.
struct SampledErrors {
  double ours;
  double cublas;
  double largest = 0;  // max |exact| over the sampled elements
};
SampledErrors sampled_errors(const void* c, const void* c_blas, const void* a, const void* b,
                             int64_t m, int64_t n, int64_t k, bool b_kn, uint64_t seed,
                             cudaStream_t s);
// Loads this file's kernels on the current device now. Under CUDA's lazy loading a helper's
// first launch loads its kernel, and the load waits for the GPU: after an op across nodes on
// ranks sharing a GPU (device staging), a peer's kernel may still wait for a staging copy of
// this process's transport threads, which the load holds up - a stall until the time limit.
// Call before the ranks meet (ready()).
void preload_reference_kernels();
// Number of 16-byte words that differ between x and y (bytes a multiple of 16).
uint64_t count_different_bytes16(const void* x, const void* y, int64_t bytes, cudaStream_t s);
// Number of NaN elements among `count` bf16 values.
uint64_t count_nans_bf16(const void* p, int64_t count, cudaStream_t s);
// Fills `count` bf16 values with uniform [-1, 1) from `seed`.
void fill_random_bf16(void* p, int64_t count, uint64_t seed, cudaStream_t s);
// dst[i] = bf16(float(dst[i]) + float(src[i])) for `count` bf16 values: one step of a reduction
// of bf16 data (as NCCL's ring adds a received chunk to its own).
void add_bf16(void* dst, const void* src, int64_t count, cudaStream_t s);

}  // namespace mk::test
