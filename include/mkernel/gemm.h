// mkernel/gemm.h - the GEMM engine on its own (the fused kernels compose the same pieces).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace mk {

enum class BLayout {
  kNK,  // B is [N, K] row-major (a torch.nn.Linear weight): C = A @ B^T
  kKN,  // B is [K, N] row-major: C = A @ B
};

struct GemmConfig {
  int block_n = 0;  // 128 or 256; 0 = heuristic (MKERNEL_GEMM_BLOCK_N overrides)
  int sms = 0;      // persistent CTAs; 0 = every SM of the device
};

// C[M, N] = A[M, K] @ op(B), bf16 in and out, fp32 accumulation, on `stream`.
//   A: [M, K] row-major bf16, 16-byte aligned; any M >= 1.
//   B: [N, K] (BLayout::kNK) or [K, N] (kKN) row-major bf16, 16-byte aligned.
//   C: [M, N] row-major bf16 (leading dimension N).
//   N and K multiples of 8 (16-byte rows); partial tiles are handled.
// Throws mk::Error before launching on anything else.
void gemm(const void* a, const void* b, void* c, int64_t m, int64_t n, int64_t k, BLayout b_layout,
          cudaStream_t stream, const GemmConfig& config = {});

}  // namespace mk
