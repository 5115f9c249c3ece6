// The problem every rank of a reducing fused GEMM test (gemm_rs, gemm_ar) builds: each rank's
// A_r [M, K_r] and B_r from a shared seed, and their concatenations along K, whose product is the
// sum over ranks; plus the check of output rows against it (fp64, tolerance rule).
#pragma once

#include <algorithm>
#include <string>

#include "gemm_reference.h"
#include "gpu_test_util.h"
#include "mkernel/fused.h"

namespace mk::test {

inline uint64_t rank_seed(uint64_t seed, int rank, int which) {
  return seed * 1000003u + 17 * rank + which;
}

// The problem on every rank's device: each rank's A_s, B_s and their concatenations along K.
struct RsProblem {  // (named for reduce-scatter; gemm_ar uses it too)
  int world;
  int64_t m, n, k_local, k;
  bool kn;
  void* a_mine = nullptr;  // A_r [M, K_r]
  void* b_mine = nullptr;  // B_r
  void* a_cat = nullptr;   // [M, K]
  void* b_cat = nullptr;   // [N, K] or [K, N]
  void* scratch = nullptr;
  uint64_t a_seed = 0, b_seed = 0;  // of the last fill

  // m_: all rows (the sum's); k_local_: each rank's slice of K.
  RsProblem(int world_, int64_t m_, int64_t n_, int64_t k_local_, bool kn_)
      : world(world_), m(m_), n(n_), k_local(k_local_), k(k_local_ * world_), kn(kn_) {
    cudaMalloc(&a_mine, m * k_local * 2);
    cudaMalloc(&b_mine, n * k_local * 2);
    cudaMalloc(&a_cat, m * k * 2);
    cudaMalloc(&b_cat, n * k * 2);
    cudaMalloc(&scratch, std::max(m * k_local, n * k_local) * 2);
  }
  ~RsProblem() {
    for (void* p : {a_mine, b_mine, a_cat, b_cat, scratch}) cudaFree(p);
  }

  // Fills every rank's A from `seed` and B from `b_seed`, keeps this rank's, and builds the
  // concatenations.
  void fill(uint64_t seed, int rank, cudaStream_t s) { fill(seed, seed, rank, s); }
  void fill(uint64_t seed, uint64_t b_seed_, int rank, cudaStream_t s) {
    a_seed = seed;
    b_seed = b_seed_;
    for (int src = 0; src < world; ++src) {
      fill_random_bf16(scratch, m * k_local, rank_seed(seed, src, 0), s);
      if (src == rank) cudaMemcpyAsync(a_mine, scratch, m * k_local * 2, cudaMemcpyDefault, s);
      cudaMemcpy2DAsync(static_cast<char*>(a_cat) + src * k_local * 2, k * 2, scratch, k_local * 2,
                        k_local * 2, m, cudaMemcpyDefault, s);
      fill_random_bf16(scratch, n * k_local, rank_seed(b_seed_, src, 1), s);
      if (src == rank) cudaMemcpyAsync(b_mine, scratch, n * k_local * 2, cudaMemcpyDefault, s);
      if (kn) {  // [K_r, N] blocks stacked along K
        cudaMemcpyAsync(static_cast<char*>(b_cat) + src * k_local * n * 2, scratch, k_local * n * 2,
                        cudaMemcpyDefault, s);
      } else {  // [N, K_r] blocks side by side
        cudaMemcpy2DAsync(static_cast<char*>(b_cat) + src * k_local * 2, k * 2, scratch,
                          k_local * 2, k_local * 2, n, cudaMemcpyDefault, s);
      }
    }
  }
};

// The sequential baseline's sum (cuBLAS, then NCCL) into c_seq [M, N] bf16: each rank's partial
// A_s op(B_s) through cuBLAS in bf16, added up in rank order with a bf16 rounding after each add,
// as a ring reduction of the bf16 partials does.
inline void sequential_sum(const RsProblem& p, cublasHandle_t blas, void* c_seq,
                           cudaStream_t stream) {
  void *a, *b, *part;
  MKT_CUDA(cudaMalloc(&a, p.m * p.k_local * 2));
  MKT_CUDA(cudaMalloc(&b, p.n * p.k_local * 2));
  MKT_CUDA(cudaMalloc(&part, p.m * p.n * 2));
  for (int src = 0; src < p.world; ++src) {
    fill_random_bf16(a, p.m * p.k_local, rank_seed(p.a_seed, src, 0), stream);
    fill_random_bf16(b, p.n * p.k_local, rank_seed(p.b_seed, src, 1), stream);
    cublas_gemm(blas, a, b, src == 0 ? c_seq : part, p.m, p.n, p.k_local, p.kn);
    if (src > 0) add_bf16(c_seq, part, p.m * p.n, stream);
  }
  MKT_CUDA(cudaStreamSynchronize(stream));
  for (void* q : {a, b, part}) cudaFree(q);
}

// What the tolerance rule compares with: cuBLAS on the concatenated operands (one fp32 sum, one
// rounding: the stricter reference, for kernels that reduce in fp32), or the sequential baseline
// (cuBLAS then NCCL: bf16 partials, for kernels that round their partials to bf16 as it does).
enum class Baseline { kCublasConcatenated, kSequential };
inline Baseline baseline_for(const FusedGemmPlan& plan) {
  return plan.bf16_partials ? Baseline::kSequential : Baseline::kCublasConcatenated;
}

// Rows [first, first + rows) of A_cat @ op(B_cat) (the sum over ranks): `out` (those rows)
// against the fp64 product, within twice the baseline's error on the same operands. Against the
// sequential baseline, plus one bf16 rounding of the largest sampled value (2^-8 of it) as the
// rule's small atol: its error is a max over three roundings per element and at tiny shapes
// (16 sampled elements) it can come out lucky - 0.0051 at one row, N 8, K 16 on the H200, where
// ours, two roundings, was 0.0106.
inline void expect_rows_close(const RsProblem& p, int64_t first, int64_t rows, const void* out,
                              cublasHandle_t blas, void* c_blas, uint64_t seed, cudaStream_t stream,
                              const std::string& what,
                              Baseline baseline = Baseline::kCublasConcatenated) {
  if (baseline == Baseline::kSequential) {
    sequential_sum(p, blas, c_blas, stream);
  } else {
    cublas_gemm(blas, p.a_cat, p.b_cat, c_blas, p.m, p.n, p.k, p.kn);
  }
  const SampledErrors err = sampled_errors(out, static_cast<char*>(c_blas) + first * p.n * 2,
                                           static_cast<char*>(p.a_cat) + first * p.k * 2, p.b_cat,
                                           rows, p.n, p.k, p.kn, seed, stream);
  const double atol = baseline == Baseline::kSequential ? err.largest / 256 : 1e-6;
  EXPECT_LE(err.ours, 2 * err.cublas + atol)
      << what << ": error " << err.ours
      << (baseline == Baseline::kSequential ? ", sequential (cuBLAS + NCCL) error "
                                            : ", cuBLAS error ")
      << err.cublas;
}

}  // namespace mk::test
