// Device helpers of the benchmarks: reproducible random fill, error against an fp64 reference
// rebuilt from the generator, and bitwise comparison.
#include <cuda_bf16.h>

#include <cstring>

#include "bench_check.h"
#include "bench_kernels.h"

namespace mk::bench {
namespace {

__host__ __device__ inline float gen_value(uint64_t seed, int rank, std::size_t i) {
  uint64_t x = seed ^ (0x9e3779b97f4a7c15ull * (rank + 1)) ^ (i * 0xbf58476d1ce4e5b9ull);
  x ^= x >> 31;
  x *= 0x94d049bb133111ebull;
  x ^= x >> 29;
  return static_cast<float>(x & 0xffffff) / 8388608.f - 1.f;  // [-1, 1)
}

__global__ void fill_kernel(__nv_bfloat16* p, std::size_t n, uint64_t seed, int rank) {
  for (std::size_t i = blockIdx.x * (std::size_t)blockDim.x + threadIdx.x; i < n;
       i += (std::size_t)gridDim.x * blockDim.x)
    p[i] = __float2bfloat16_rn(gen_value(seed, rank, i));
}

// Max |got - exact| where exact[i] = sum_r bf16(gen(seed, r, base + i)) in fp64.
__global__ void error_kernel(const __nv_bfloat16* got, std::size_t n, std::size_t base,
                             uint64_t seed, int world, unsigned long long* max_err_bits) {
  double local = 0;
  for (std::size_t i = blockIdx.x * (std::size_t)blockDim.x + threadIdx.x; i < n;
       i += (std::size_t)gridDim.x * blockDim.x) {
    double exact = 0;
    for (int r = 0; r < world; ++r)
      exact += __bfloat162float(__float2bfloat16_rn(gen_value(seed, r, base + i)));
    const double g = __bfloat162float(got[i]);
    local = fmax(local, g == g ? fabs(g - exact) : 1e30);
  }
  atomicMax(max_err_bits, __double_as_longlong(local));
}

__global__ void diff_kernel(const uint4* a, const uint4* b, std::size_t n,
                            unsigned long long* diffs) {
  unsigned long long local = 0;
  for (std::size_t i = blockIdx.x * (std::size_t)blockDim.x + threadIdx.x; i < n;
       i += (std::size_t)gridDim.x * blockDim.x) {
    const uint4 x = a[i], y = b[i];
    local += (x.x != y.x) | (x.y != y.y) | (x.z != y.z) | (x.w != y.w);
  }
  atomicAdd(diffs, local);
}

__global__ void max_diff_kernel(const __nv_bfloat16* a, const __nv_bfloat16* b, std::size_t n,
                                unsigned int* out) {
  float diff = 0.f, mag = 0.f;
  for (std::size_t i = blockIdx.x * (std::size_t)blockDim.x + threadIdx.x; i < n;
       i += (std::size_t)gridDim.x * blockDim.x) {
    const float x = __bfloat162float(a[i]), y = __bfloat162float(b[i]);
    const float d = fabsf(x - y);
    diff = fmaxf(diff, d == d ? d : 3e38f);
    mag = fmaxf(mag, fabsf(y));
  }
  atomicMax(&out[0], __float_as_uint(diff));  // non-negative floats order like their bits
  atomicMax(&out[1], __float_as_uint(mag));
}

// Whether |x - y| > 4 bf16 steps at `scale`, plus 1e-4 (a rounding's worth near 0).
__device__ inline bool is_far(float x, float y, float scale) {
  const float step = scale == 0.f ? 0.f : ldexpf(1.f, ilogbf(fabsf(scale)) - 7);
  return !(fabsf(x - y) <= 4.f * step + 1e-4f);
}

// Elements where |a - b| is far at |b|.
__global__ void far_kernel(const __nv_bfloat16* a, const __nv_bfloat16* b, std::size_t n,
                           unsigned long long* far) {
  unsigned long long mine = 0;
  for (std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::size_t>(gridDim.x) * blockDim.x) {
    const float y = __bfloat162float(b[i]);
    mine += is_far(__bfloat162float(a[i]), y, y);
  }
  if (mine != 0) atomicAdd(far, mine);
}

// The same bound at the row's largest |b| instead of each element's own: one warp a row of
// `row_len` values. (Two computations of the same precision in another order differ by roundings
// that scale with the row's values: an element small by cancellation may differ by more than
// 4 steps of itself.)
__global__ void far_rows_kernel(const __nv_bfloat16* a, const __nv_bfloat16* b, std::size_t rows,
                                int row_len, unsigned long long* far) {
  const int lane = threadIdx.x % 32;
  const std::size_t warps = static_cast<std::size_t>(gridDim.x) * (blockDim.x / 32);
  unsigned long long mine = 0;
  for (std::size_t r = (blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x) / 32;
       r < rows; r += warps) {
    const __nv_bfloat16 *ar = a + r * row_len, *br = b + r * row_len;
    float row_max = 0.f;
    for (int i = lane; i < row_len; i += 32)
      row_max = fmaxf(row_max, fabsf(__bfloat162float(br[i])));
    for (int o = 16; o > 0; o /= 2) row_max = fmaxf(row_max, __shfl_xor_sync(~0u, row_max, o));
    for (int i = lane; i < row_len; i += 32)
      mine += is_far(__bfloat162float(ar[i]), __bfloat162float(br[i]), row_max);
  }
  if (mine != 0) atomicAdd(far, mine);
}

}  // namespace

void launch_count_far(const void* a, const void* b, std::size_t n, unsigned long long* far,
                      cudaStream_t s) {
  far_kernel<<<264, 256, 0, s>>>(static_cast<const __nv_bfloat16*>(a),
                                 static_cast<const __nv_bfloat16*>(b), n, far);
}

namespace {
// Zeroes a device counter, runs `count(counter)` on `s` and returns the counter's value.
template <class Count>
unsigned long long read_count(cudaStream_t s, Count&& count) {
  unsigned long long* far;
  CK(cudaMalloc(reinterpret_cast<void**>(&far), sizeof(*far)));
  CK(cudaMemsetAsync(far, 0, sizeof(*far), s));
  count(far);
  unsigned long long value = 0;
  CK(cudaMemcpyAsync(&value, far, sizeof(value), cudaMemcpyDeviceToHost, s));
  CK(cudaStreamSynchronize(s));
  CK(cudaFree(far));
  return value;
}
}  // namespace

unsigned long long count_far(const void* a, const void* b, std::size_t n, cudaStream_t s) {
  return read_count(s, [&](unsigned long long* far) { launch_count_far(a, b, n, far, s); });
}

unsigned long long count_far_rows(const void* a, const void* b, std::size_t rows, int row_len,
                                  cudaStream_t s) {
  return read_count(s, [&](unsigned long long* far) {
    far_rows_kernel<<<264, 256, 0, s>>>(static_cast<const __nv_bfloat16*>(a),
                                        static_cast<const __nv_bfloat16*>(b), rows, row_len, far);
  });
}

void launch_max_diff_bf16(const void* a, const void* b, std::size_t n, unsigned int* out,
                          cudaStream_t s) {
  max_diff_kernel<<<528, 256, 0, s>>>(static_cast<const __nv_bfloat16*>(a),
                                      static_cast<const __nv_bfloat16*>(b), n, out);
}

MaxDiff max_diff_bf16(const void* a, const void* b, std::size_t n) {
  unsigned int* out;
  CK(cudaMalloc(reinterpret_cast<void**>(&out), 8));
  CK(cudaMemset(out, 0, 8));
  launch_max_diff_bf16(a, b, n, out, nullptr);
  unsigned int bits[2];
  CK(cudaMemcpy(bits, out, 8, cudaMemcpyDeviceToHost));
  CK(cudaFree(out));
  MaxDiff r;
  std::memcpy(&r.diff, &bits[0], 4);
  std::memcpy(&r.mag, &bits[1], 4);
  return r;
}

void launch_fill(void* p, std::size_t n, uint64_t seed, int rank, cudaStream_t s) {
  fill_kernel<<<264, 512, 0, s>>>(static_cast<__nv_bfloat16*>(p), n, seed, rank);
}

void launch_max_error(const void* got, std::size_t n, std::size_t base, uint64_t seed, int world,
                      unsigned long long* max_err_bits, cudaStream_t s) {
  error_kernel<<<264, 256, 0, s>>>(static_cast<const __nv_bfloat16*>(got), n, base, seed, world,
                                   max_err_bits);
}

void launch_count_diff(const void* a, const void* b, std::size_t n16, unsigned long long* diffs,
                       cudaStream_t s) {
  diff_kernel<<<264, 256, 0, s>>>(static_cast<const uint4*>(a), static_cast<const uint4*>(b), n16,
                                  diffs);
}

}  // namespace mk::bench
