// fp64 reference rows and helpers for the GEMM tests (simple, not fast).
#include <cuda_bf16.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "gemm_reference.h"

namespace mk::test {
namespace {

__global__ void reference_kernel(const __nv_bfloat16* a, const __nv_bfloat16* b, int64_t n,
                                 int64_t k, bool b_kn, const int64_t* rows, int nrows,
                                 double* out) {
  const int64_t idx = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (idx >= nrows * n) return;
  const int64_t r = idx / n, j = idx % n;
  const __nv_bfloat16* ar = a + rows[r] * k;
  double acc = 0;
  for (int64_t i = 0; i < k; ++i) {
    const __nv_bfloat16 bv = b_kn ? b[i * n + j] : b[j * k + i];
    acc += static_cast<double>(__bfloat162float(ar[i])) * __bfloat162float(bv);
  }
  out[idx] = acc;
}

__global__ void nan_kernel(const __nv_bfloat16* p, int64_t count, unsigned long long* nans) {
  unsigned long long local = 0;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < count;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float v = __bfloat162float(p[i]);
    local += v != v;
  }
  if (local) atomicAdd(nans, local);
}

__global__ void fill_kernel(__nv_bfloat16* p, int64_t count, uint64_t seed) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < count;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    uint64_t x = seed ^ (static_cast<uint64_t>(i) * 0x9e3779b97f4a7c15ull);
    x ^= x >> 31;
    x *= 0xbf58476d1ce4e5b9ull;
    x ^= x >> 29;
    p[i] = __float2bfloat16_rn(static_cast<float>(x & 0xffffff) / 8388608.f - 1.f);
  }
}

__global__ void add_kernel(__nv_bfloat16* dst, const __nv_bfloat16* src, int64_t count) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < count;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    dst[i] = __float2bfloat16_rn(__bfloat162float(dst[i]) + __bfloat162float(src[i]));
  }
}

__global__ void diff_kernel(const uint4* x, const uint4* y, int64_t count,
                            unsigned long long* diffs) {
  unsigned long long local = 0;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < count;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const uint4 a = x[i], b = y[i];
    local += a.x != b.x || a.y != b.y || a.z != b.z || a.w != b.w;
  }
  if (local) atomicAdd(diffs, local);
}

// Max |c[rows[r], j] - ref[r, j]| over the sampled rows (bf16 c, fp64 ref), NaN counted as huge;
// and, if `largest` is given, max |ref|.
__global__ void error_kernel(const __nv_bfloat16* c, int64_t n, const int64_t* rows, int nrows,
                             const double* ref, unsigned long long* worst,
                             unsigned long long* largest) {
  const int64_t idx = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (idx >= nrows * n) return;
  const double x = __bfloat162float(c[rows[idx / n] * n + idx % n]);
  double e = fabs(x - ref[idx]);
  if (!(e == e)) e = 1e300;
  atomicMax(worst, static_cast<unsigned long long>(__double_as_longlong(e)));  // e >= 0: ordered
  if (largest != nullptr) {
    atomicMax(largest, static_cast<unsigned long long>(__double_as_longlong(fabs(ref[idx]))));
  }
}

}  // namespace

void cublas_gemm(cublasHandle_t h, const void* a, const void* b, void* c, int64_t m, int64_t n,
                 int64_t k, bool b_kn) {
  // Row-major [m, n] is column-major [n, m]: C_cm = op(B_cm) A_cm, with B_cm [k, n] transposed
  // for B [n, k] and used as is for B [k, n].
  const float one = 1.f, zero = 0.f;
  cublasGemmEx(h, b_kn ? CUBLAS_OP_N : CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(n),
               static_cast<int>(m), static_cast<int>(k), &one, b, CUDA_R_16BF,
               static_cast<int>(b_kn ? n : k), a, CUDA_R_16BF, static_cast<int>(k), &zero, c,
               CUDA_R_16BF, static_cast<int>(n), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
}

SampledErrors sampled_errors(const void* c, const void* c_blas, const void* a, const void* b,
                             int64_t m, int64_t n, int64_t k, bool b_kn, uint64_t seed,
                             cudaStream_t s) {
  std::mt19937_64 gen(seed);
  std::vector<int64_t> rows = {0, m - 1};
  const int samples = m * n > (int64_t{1} << 26) ? 6 : 14;
  for (int i = 0; i < samples; ++i) rows.push_back(static_cast<int64_t>(gen() % m));
  std::sort(rows.begin(), rows.end());
  rows.erase(std::unique(rows.begin(), rows.end()), rows.end());
  const int nrows = static_cast<int>(rows.size());
  int64_t* d_rows = nullptr;
  double* d_ref = nullptr;
  unsigned long long* d_worst = nullptr;
  cudaMallocAsync(reinterpret_cast<void**>(&d_rows), rows.size() * sizeof(int64_t), s);
  cudaMallocAsync(reinterpret_cast<void**>(&d_ref), rows.size() * n * sizeof(double), s);
  cudaMallocAsync(reinterpret_cast<void**>(&d_worst), 3 * sizeof(unsigned long long), s);
  cudaMemcpyAsync(d_rows, rows.data(), rows.size() * sizeof(int64_t), cudaMemcpyHostToDevice, s);
  cudaMemsetAsync(d_worst, 0, 3 * sizeof(unsigned long long), s);
  gemm_reference_rows(a, b, n, k, b_kn, d_rows, nrows, d_ref, s);
  const unsigned blocks = static_cast<unsigned>((nrows * n + 255) / 256);
  error_kernel<<<blocks, 256, 0, s>>>(static_cast<const __nv_bfloat16*>(c), n, d_rows, nrows, d_ref,
                                      d_worst, d_worst + 2);
  error_kernel<<<blocks, 256, 0, s>>>(static_cast<const __nv_bfloat16*>(c_blas), n, d_rows, nrows,
                                      d_ref, d_worst + 1, nullptr);
  unsigned long long h[3] = {0, 0, 0};
  cudaMemcpyAsync(h, d_worst, sizeof(h), cudaMemcpyDeviceToHost, s);
  cudaFreeAsync(d_rows, s);
  cudaFreeAsync(d_ref, s);
  cudaFreeAsync(d_worst, s);
  cudaStreamSynchronize(s);
  SampledErrors e;
  std::memcpy(&e.ours, &h[0], 8);
  std::memcpy(&e.cublas, &h[1], 8);
  std::memcpy(&e.largest, &h[2], 8);
  return e;
}

void preload_reference_kernels() {
  cudaFuncAttributes attributes;
  for (const void* kernel :
       {reinterpret_cast<const void*>(reference_kernel), reinterpret_cast<const void*>(nan_kernel),
        reinterpret_cast<const void*>(fill_kernel), reinterpret_cast<const void*>(add_kernel),
        reinterpret_cast<const void*>(diff_kernel), reinterpret_cast<const void*>(error_kernel)}) {
    cudaFuncGetAttributes(&attributes, kernel);
  }
}

uint64_t count_different_bytes16(const void* x, const void* y, int64_t bytes, cudaStream_t s) {
  unsigned long long* d = nullptr;
  cudaMallocAsync(reinterpret_cast<void**>(&d), sizeof(*d), s);
  cudaMemsetAsync(d, 0, sizeof(*d), s);
  diff_kernel<<<528, 256, 0, s>>>(static_cast<const uint4*>(x), static_cast<const uint4*>(y),
                                  bytes / 16, d);
  unsigned long long h = 0;
  cudaMemcpyAsync(&h, d, sizeof(h), cudaMemcpyDeviceToHost, s);
  cudaFreeAsync(d, s);
  cudaStreamSynchronize(s);
  return h;
}

void gemm_reference_rows(const void* a, const void* b, int64_t n, int64_t k, bool b_kn,
                         const int64_t* rows, int nrows, double* out, cudaStream_t s) {
  const int64_t total = nrows * n;
  reference_kernel<<<static_cast<unsigned>((total + 255) / 256), 256, 0, s>>>(
      static_cast<const __nv_bfloat16*>(a), static_cast<const __nv_bfloat16*>(b), n, k, b_kn, rows,
      nrows, out);
}

uint64_t count_nans_bf16(const void* p, int64_t count, cudaStream_t s) {
  unsigned long long* d = nullptr;
  cudaMallocAsync(reinterpret_cast<void**>(&d), sizeof(*d), s);  // stream-ordered: no device sync
  cudaMemsetAsync(d, 0, sizeof(*d), s);
  nan_kernel<<<528, 256, 0, s>>>(static_cast<const __nv_bfloat16*>(p), count, d);
  unsigned long long h = 0;
  cudaMemcpyAsync(&h, d, sizeof(h), cudaMemcpyDeviceToHost, s);
  cudaFreeAsync(d, s);
  cudaStreamSynchronize(s);
  return h;
}

void fill_random_bf16(void* p, int64_t count, uint64_t seed, cudaStream_t s) {
  fill_kernel<<<528, 256, 0, s>>>(static_cast<__nv_bfloat16*>(p), count, seed);
}

void add_bf16(void* dst, const void* src, int64_t count, cudaStream_t s) {
  add_kernel<<<528, 256, 0, s>>>(static_cast<__nv_bfloat16*>(dst),
                                 static_cast<const __nv_bfloat16*>(src), count);
}

}  // namespace mk::test
