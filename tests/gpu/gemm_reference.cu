// fp64 reference rows and helpers for the GEMM tests (simple, not fast).
#include <cuda_bf16.h>

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

}  // namespace

void gemm_reference_rows(const void* a, const void* b, int64_t n, int64_t k, bool b_kn,
                         const int64_t* rows, int nrows, double* out, cudaStream_t s) {
  const int64_t total = nrows * n;
  reference_kernel<<<static_cast<unsigned>((total + 255) / 256), 256, 0, s>>>(
      static_cast<const __nv_bfloat16*>(a), static_cast<const __nv_bfloat16*>(b), n, k, b_kn, rows,
      nrows, out);
}

uint64_t count_nans_bf16(const void* p, int64_t count, cudaStream_t s) {
  unsigned long long* d = nullptr;
  cudaMalloc(&d, sizeof(*d));
  cudaMemsetAsync(d, 0, sizeof(*d), s);
  nan_kernel<<<528, 256, 0, s>>>(static_cast<const __nv_bfloat16*>(p), count, d);
  unsigned long long h = 0;
  cudaMemcpyAsync(&h, d, sizeof(h), cudaMemcpyDeviceToHost, s);
  cudaStreamSynchronize(s);
  cudaFree(d);
  return h;
}

void fill_random_bf16(void* p, int64_t count, uint64_t seed, cudaStream_t s) {
  fill_kernel<<<528, 256, 0, s>>>(static_cast<__nv_bfloat16*>(p), count, seed);
}

}  // namespace mk::test
