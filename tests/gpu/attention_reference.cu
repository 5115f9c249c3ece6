// fp32 reference rows for the attention tests (one CTA per query row and head; simple, not fast).
#include <cuda_bf16.h>

#include <cmath>

#include "attention_reference.h"

namespace mk::test {
namespace {

constexpr int kThreads = 128;

struct View {
  const __nv_bfloat16* p;
  int64_t sb, ss, sh;
  __device__ const __nv_bfloat16* row(int64_t b, int64_t s, int64_t h) const {
    return p + b * sb + s * ss + h * sh;
  }
};

View view(const AttentionTensor& t, int64_t seq, int64_t heads, int64_t d) {
  return {static_cast<const __nv_bfloat16*>(t.data),
          t.stride_batch ? t.stride_batch : seq * heads * d,
          t.stride_seq ? t.stride_seq : heads * d, t.stride_head ? t.stride_head : d};
}

__device__ float round_bf16(float x) { return __bfloat162float(__float2bfloat16_rn(x)); }

__device__ float block_reduce(float x, bool is_max, float* tmp) {
  for (int o = 16; o > 0; o /= 2) {
    const float y = __shfl_xor_sync(0xffffffffu, x, o);
    x = is_max ? fmaxf(x, y) : x + y;
  }
  __syncthreads();
  if (threadIdx.x % 32 == 0) tmp[threadIdx.x / 32] = x;
  __syncthreads();
  x = tmp[0];
  for (int w = 1; w < kThreads / 32; ++w) x = is_max ? fmaxf(x, tmp[w]) : x + tmp[w];
  return x;
}

// grid (nrows, H, B). Scores s_j = scale q . k_j (fp32); exact: softmax in fp32, O = sum p_j v_j;
// lowp: s_j rounded to bf16, p_j = exp(s_j - max) / sum rounded to bf16, O accumulated in fp32
// then rounded to bf16.
__global__ void reference_kernel(View q, View k, View v, int64_t seq_q, int64_t seq_kv,
                                 int64_t heads, int group, int d, bool causal, float scale,
                                 const int32_t* rows, int nrows, float* exact, float* lowp,
                                 float* lse) {
  __shared__ float qs[128];
  __shared__ float p_exact[kThreads], p_low[kThreads];
  __shared__ float tmp[kThreads / 32];
  const int r = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
  const int64_t i = rows[r];
  const int kvh = h / group;
  for (int c = threadIdx.x; c < d; c += kThreads) qs[c] = __bfloat162float(q.row(b, i, h)[c]);
  __syncthreads();
  const int64_t limit = causal ? min(seq_kv - 1, i + seq_kv - seq_q) : seq_kv - 1;
  const int64_t out = ((static_cast<int64_t>(b) * nrows + r) * heads + h) * d;
  auto score = [&](int64_t j) {
    const __nv_bfloat16* kr = k.row(b, j, kvh);
    float acc = 0.f;
    for (int c = 0; c < d; ++c) acc = fmaf(qs[c], __bfloat162float(kr[c]), acc);
    return acc * scale;
  };
  float m = -INFINITY, m_low = -INFINITY;
  for (int64_t j = threadIdx.x; j <= limit; j += kThreads) {
    const float s = score(j);
    m = fmaxf(m, s);
    m_low = fmaxf(m_low, round_bf16(s));
  }
  m = block_reduce(m, true, tmp);
  m_low = block_reduce(m_low, true, tmp);
  float l = 0.f, l_low = 0.f;
  for (int64_t j = threadIdx.x; j <= limit; j += kThreads) {
    const float s = score(j);
    l += expf(s - m);
    l_low += expf(round_bf16(s) - m_low);
  }
  l = block_reduce(l, false, tmp);
  l_low = block_reduce(l_low, false, tmp);
  if (threadIdx.x == 0)
    lse[(static_cast<int64_t>(b) * heads + h) * nrows + r] = limit < 0 ? -INFINITY : m + logf(l);
  float o_exact = 0.f, o_low = 0.f;  // column d = threadIdx.x
  for (int64_t j0 = 0; j0 <= limit; j0 += kThreads) {
    const int64_t j = j0 + threadIdx.x;
    __syncthreads();
    if (j <= limit) {
      const float s = score(j);
      p_exact[threadIdx.x] = expf(s - m) / l;
      p_low[threadIdx.x] = round_bf16(expf(round_bf16(s) - m_low) / l_low);
    } else {
      p_exact[threadIdx.x] = p_low[threadIdx.x] = 0.f;
    }
    __syncthreads();
    if (threadIdx.x < d) {
      const int64_t n = limit + 1 - j0 < kThreads ? limit + 1 - j0 : kThreads;
      for (int64_t t = 0; t < n; ++t) {
        const float vv = __bfloat162float(v.row(b, j0 + t, kvh)[threadIdx.x]);
        o_exact = fmaf(p_exact[t], vv, o_exact);
        o_low = fmaf(p_low[t], vv, o_low);
      }
    }
  }
  if (threadIdx.x < d) {
    exact[out + threadIdx.x] = o_exact;
    lowp[out + threadIdx.x] = round_bf16(o_low);
  }
}

__global__ void fill_kernel(__nv_bfloat16* p, int64_t count, float amplitude, uint64_t seed) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < count;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    uint64_t x = seed ^ (static_cast<uint64_t>(i) * 0x9e3779b97f4a7c15ull);
    x ^= x >> 31;
    x *= 0xbf58476d1ce4e5b9ull;
    x ^= x >> 29;
    p[i] = __float2bfloat16_rn(amplitude * (static_cast<float>(x & 0xffffff) / 8388608.f - 1.f));
  }
}

}  // namespace

void attention_reference(const AttentionProblem& p, const AttentionTensor& q,
                         const AttentionTensor& k, const AttentionTensor& v, const int32_t* rows,
                         int nrows, float* exact, float* lowp, float* lse, cudaStream_t s) {
  const int d = static_cast<int>(p.head_dim);
  const float scale = p.softmax_scale > 0 ? p.softmax_scale : 1.0f / std::sqrt(float(d));
  const dim3 grid(nrows, static_cast<unsigned>(p.heads), static_cast<unsigned>(p.batch));
  reference_kernel<<<grid, kThreads, 0, s>>>(
      view(q, p.seq_q, p.heads, d), view(k, p.seq_kv, p.kv_heads, d),
      view(v, p.seq_kv, p.kv_heads, d), p.seq_q, p.seq_kv, p.heads,
      static_cast<int>(p.heads / p.kv_heads), d, p.causal, scale, rows, nrows, exact, lowp, lse);
}

void fill_random_bf16_scaled(void* p, int64_t count, float amplitude, uint64_t seed,
                             cudaStream_t s) {
  fill_kernel<<<528, 256, 0, s>>>(static_cast<__nv_bfloat16*>(p), count, amplitude, seed);
}

}  // namespace mk::test
