// Host side of the GEMM engine: validate -> pick config -> build tensor maps -> launch.
#include <cuda.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "gemm/gemm_kernel.cuh"
#include "mkernel/error.h"
#include "mkernel/gemm.h"
#include "runtime/cuda_check.h"
#include "runtime/cuda_driver.h"

namespace mk {
namespace {

constexpr const char* kOp = "gemm";

[[noreturn]] void invalid(const std::string& what) {
  throw Error(ErrorCode::kInvalidArgument, std::string(kOp) + ": " + what);
}

void require_pointer(const void* p, const char* name, int device) {
  if (p == nullptr) invalid(std::string(name) + " is null");
  if (reinterpret_cast<uintptr_t>(p) % 16 != 0) {
    invalid(std::string(name) + " is not 16-byte aligned (the tensor copy engine needs it)");
  }
  cudaPointerAttributes attr{};
  if (cudaPointerGetAttributes(&attr, p) != cudaSuccess) {
    cudaGetLastError();
    invalid(std::string(name) + " is not a CUDA pointer");
  }
  if ((attr.type != cudaMemoryTypeDevice && attr.type != cudaMemoryTypeManaged) ||
      attr.device != device) {
    invalid(std::string(name) + " is not device memory of the current GPU " +
            std::to_string(device));
  }
}

// 2-D tensor map over a row-major [rows, cols] bf16 matrix, boxes of [box_rows, 64 cols],
// 128-byte swizzle; out-of-bounds reads as zero.
CUtensorMap make_map(const void* base, int64_t rows, int64_t cols, int box_rows) {
  CUtensorMap map{};
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(cols), static_cast<cuuint64_t>(rows)};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(cols) * 2};
  const cuuint32_t box[2] = {64, static_cast<cuuint32_t>(box_rows)};
  const cuuint32_t element_strides[2] = {1, 1};
  MK_CU_CHECK(detail::driver().TensorMapEncodeTiled(
      &map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, const_cast<void*>(base), dims, strides, box,
      element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
      CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE));
  return map;
}

template <int kBlockN, bool kTransB>
void launch(const void* a, const void* b, void* c, int64_t m, int64_t n, int64_t k, int sms,
            cudaStream_t stream) {
  using Cfg = gemm_engine::TileConfig<kBlockN>;
  const CUtensorMap map_a = make_map(a, m, k, Cfg::kBlockM);
  // [N, K]: boxes of kBlockN rows x 64 K; [K, N]: boxes of 64 K rows x 64 N.
  const CUtensorMap map_b = kTransB ? make_map(b, k, n, 64) : make_map(b, n, k, Cfg::kBlockN);
  gemm_engine::TileScheduler scheduler{static_cast<int>((m + Cfg::kBlockM - 1) / Cfg::kBlockM),
                                       static_cast<int>((n + Cfg::kBlockN - 1) / Cfg::kBlockN)};
  gemm_engine::StoreEpilogue epilogue{static_cast<__nv_bfloat16*>(c), n, static_cast<int>(m),
                                      static_cast<int>(n)};
  auto kernel = gemm_engine::gemm_kernel<Cfg, kTransB, gemm_engine::StoreEpilogue>;
  MK_CUDA_CHECK(
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Cfg::kSmemBytes));
  const int tiles = scheduler.tiles_m * scheduler.tiles_n;
  const int grid = std::min(tiles, sms);
  kernel<<<grid, Cfg::kThreads, Cfg::kSmemBytes, stream>>>(map_a, map_b, static_cast<int>(k),
                                                           scheduler, epilogue);
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) {
    throw Error(ErrorCode::kCuda, std::string(kOp) + ": launch failed: " + cudaGetErrorString(err));
  }
}

// 256-wide tiles unless they leave too many SMs idle in the last wave.
int pick_block_n(const GemmConfig& config, int64_t m, int64_t n, int sms) {
  int block_n = config.block_n;
  if (block_n == 0) {
    if (const char* env = std::getenv("MKERNEL_GEMM_BLOCK_N")) block_n = std::atoi(env);
  }
  if (block_n == 0) {
    const int64_t tiles_256 = (m + 127) / 128 * ((n + 255) / 256);
    block_n = tiles_256 >= 2 * sms ? 256 : 128;
  }
  if (block_n != 128 && block_n != 256) {
    invalid("block_n = " + std::to_string(block_n) + "; expected 128 or 256");
  }
  return block_n;
}

}  // namespace

void gemm(const void* a, const void* b, void* c, int64_t m, int64_t n, int64_t k, BLayout b_layout,
          cudaStream_t stream, const GemmConfig& config) {
  if (m < 1) invalid("M = " + std::to_string(m) + "; expected M >= 1");
  if (n < 8 || n % 8 != 0) invalid("N = " + std::to_string(n) + "; expected a multiple of 8");
  if (k < 8 || k % 8 != 0) invalid("K = " + std::to_string(k) + "; expected a multiple of 8");
  constexpr int64_t kMax = int64_t{1} << 31;
  if (m >= kMax || n >= kMax || k >= kMax) invalid("M, N and K must each be < 2^31");
  if (b_layout != BLayout::kNK && b_layout != BLayout::kKN) invalid("unknown B layout");
  int device = 0;
  MK_CUDA_CHECK(cudaGetDevice(&device));
  require_pointer(a, "A", device);
  require_pointer(b, "B", device);
  require_pointer(c, "C", device);
  int sms = config.sms;
  if (sms <= 0) MK_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  const int block_n = pick_block_n(config, m, n, sms);
  if (std::getenv("MKERNEL_PRINT_CONFIG") != nullptr) {
    std::fprintf(stderr, "[mkernel] gemm %lldx%lldx%lld: block 128x%dx64, %d SMs\n",
                 static_cast<long long>(m), static_cast<long long>(n), static_cast<long long>(k),
                 block_n, sms);
  }
  const bool trans_b = b_layout == BLayout::kKN;
  if (block_n == 256) {
    trans_b ? launch<256, true>(a, b, c, m, n, k, sms, stream)
            : launch<256, false>(a, b, c, m, n, k, sms, stream);
  } else {
    trans_b ? launch<128, true>(a, b, c, m, n, k, sms, stream)
            : launch<128, false>(a, b, c, m, n, k, sms, stream);
  }
}

}  // namespace mk
