// Host side of the GEMM engine: validate -> pick config -> build tensor maps -> launch.
#include <cuda.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "gemm/gemm_internal.h"
#include "gemm/gemm_kernel.cuh"
#include "gemm/grouped_gemm.cuh"
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

}  // namespace

namespace {

// Tensor map of `rank` dimensions (innermost first), 128-byte swizzle (boxes 128 bytes wide).
CUtensorMap encode(const void* base, int rank, const cuuint64_t* dims, const cuuint64_t* strides,
                   const cuuint32_t* box,
                   CUtensorMapDataType type = CU_TENSOR_MAP_DATA_TYPE_BFLOAT16) {
  CUtensorMap map{};
  const cuuint32_t element_strides[3] = {1, 1, 1};
  MK_CU_CHECK(detail::driver().TensorMapEncodeTiled(
      &map, type, rank, const_cast<void*>(base), dims, strides, box, element_strides,
      CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
      CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE));
  return map;
}

}  // namespace

CUtensorMap gemm_engine::make_map(const void* base, int64_t rows, int64_t cols, int box_rows) {
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(cols), static_cast<cuuint64_t>(rows)};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(cols) * 2};
  const cuuint32_t box[2] = {64, static_cast<cuuint32_t>(box_rows)};
  return encode(base, 2, dims, strides, box);
}

CUtensorMap gemm_engine::make_map_fp32(void* base, int64_t rows, int64_t cols, int box_rows) {
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(cols), static_cast<cuuint64_t>(rows)};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(cols) * 4};
  const cuuint32_t box[2] = {32, static_cast<cuuint32_t>(box_rows)};
  return encode(base, 2, dims, strides, box, CU_TENSOR_MAP_DATA_TYPE_FLOAT32);
}

CUtensorMap gemm_engine::make_map_3d(const void* base, int64_t batches, int64_t rows, int64_t cols,
                                     int box_rows) {
  const cuuint64_t dims[3] = {static_cast<cuuint64_t>(cols), static_cast<cuuint64_t>(rows),
                              static_cast<cuuint64_t>(batches)};
  const cuuint64_t strides[2] = {static_cast<cuuint64_t>(cols) * 2,
                                 static_cast<cuuint64_t>(rows * cols) * 2};
  const cuuint32_t box[3] = {64, static_cast<cuuint32_t>(box_rows), 1};
  return encode(base, 3, dims, strides, box);
}

// [N, K]: boxes of block_n rows x 64 K; [K, N]: boxes of 64 K rows x 64 N.
CUtensorMap gemm_engine::make_b_map(const void* b, int64_t n, int64_t k, int block_n,
                                    bool k_major_rows) {
  return k_major_rows ? make_map(b, k, n, 64) : make_map(b, n, k, block_n);
}

namespace {

using gemm_engine::make_map;

template <int kBlockN, bool kTransB>
void launch(const void* a, const void* b, void* c, int64_t m, int64_t n, int64_t k, int sms,
            cudaStream_t stream) {
  using Cfg = gemm_engine::TileConfig<kBlockN>;
  using Fusion = gemm_engine::PlainGemm<kBlockN>;
  const CUtensorMap map_b = gemm_engine::make_b_map(b, n, k, kBlockN, kTransB);
  const Fusion fusion{make_map(a, m, k, Cfg::kBlockM),
                      make_map(c, m, n, 64),
                      {static_cast<int>((m + Cfg::kBlockM - 1) / Cfg::kBlockM),
                       static_cast<int>((n + Cfg::kBlockN - 1) / Cfg::kBlockN)},
                      static_cast<int>(n)};
  auto kernel = gemm_engine::gemm_kernel<Cfg, kTransB, Fusion>;
  MK_CUDA_CHECK(
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Cfg::kSmemBytes));
  const int tiles = fusion.raster.tiles_m * fusion.raster.tiles_n;
  const int grid = std::min(tiles, sms);
  kernel<<<grid, Cfg::kThreads, Cfg::kSmemBytes, stream>>>(map_b, static_cast<int>(k), fusion);
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) {
    throw Error(ErrorCode::kCuda, std::string(kOp) + ": launch failed: " + cudaGetErrorString(err));
  }
}

}  // namespace

// Tile width: the one with the least estimated time, waves x per-tile cost. A tile's cost grows
// with its width but wide tiles use the tensor cores better (each wgmma re-reads the A slice from
// shared memory whatever its width); the efficiencies are from the H200 sweep in
// docs/PERFORMANCE.md.
int gemm_engine::pick_block_n(int requested, int64_t m, int64_t n, int sms, const char* op) {
  int block_n = requested;
  if (block_n == 0) {
    if (const char* env = std::getenv("MKERNEL_GEMM_BLOCK_N")) block_n = std::atoi(env);
  }
  if (block_n == 0) {
    struct Option {
      int width;
      double efficiency;
    };
    constexpr Option kOptions[] = {{256, 1.0}, {192, 0.97}, {128, 0.9}, {64, 0.75}};
    double best = 0;
    for (const Option& o : kOptions) {
      const int64_t tiles = (m + 127) / 128 * ((n + o.width - 1) / o.width);
      const int64_t waves = (tiles + sms - 1) / sms;
      const double cost = static_cast<double>(waves) * o.width / o.efficiency;
      if (block_n == 0 || cost < best) block_n = o.width, best = cost;
    }
  }
  if (block_n != 64 && block_n != 128 && block_n != 192 && block_n != 256) {
    throw Error(ErrorCode::kInvalidArgument, std::string(op) +
                                                 ": block_n = " + std::to_string(block_n) +
                                                 "; expected 64, 128, 192 or 256");
  }
  return block_n;
}

namespace {

template <bool kTransB>
void launch_width(int block_n, const void* a, const void* b, void* c, int64_t m, int64_t n,
                  int64_t k, int sms, cudaStream_t stream) {
  switch (block_n) {
    case 64:
      return launch<64, kTransB>(a, b, c, m, n, k, sms, stream);
    case 128:
      return launch<128, kTransB>(a, b, c, m, n, k, sms, stream);
    case 192:
      return launch<192, kTransB>(a, b, c, m, n, k, sms, stream);
    default:
      return launch<256, kTransB>(a, b, c, m, n, k, sms, stream);
  }
}

template <int kBlockN, bool kTransB, template <int> class Fusion = gemm_engine::PlainGemm>
void add_resources(std::vector<GemmKernelResources>& out, const char* what = "gemm") {
  using Cfg = gemm_engine::TileConfig<kBlockN>;
  auto kernel = gemm_engine::gemm_kernel<Cfg, kTransB, Fusion<kBlockN>>;
  MK_CUDA_CHECK(
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Cfg::kSmemBytes));
  cudaFuncAttributes attr{};
  MK_CUDA_CHECK(cudaFuncGetAttributes(&attr, kernel));
  out.push_back(
      {std::string(what) + " 128x" + std::to_string(kBlockN) + (kTransB ? " B[K,N]" : " B[N,K]"),
       attr.numRegs, static_cast<int64_t>(attr.localSizeBytes),
       static_cast<int64_t>(attr.maxDynamicSharedSizeBytes)});
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
  const int block_n = gemm_engine::pick_block_n(config.block_n, m, n, sms, kOp);
  if (std::getenv("MKERNEL_PRINT_CONFIG") != nullptr) {
    std::fprintf(stderr, "[mkernel] gemm %lldx%lldx%lld: block 128x%dx64, %d SMs\n",
                 static_cast<long long>(m), static_cast<long long>(n), static_cast<long long>(k),
                 block_n, sms);
  }
  if (b_layout == BLayout::kKN) {
    launch_width<true>(block_n, a, b, c, m, n, k, sms, stream);
  } else {
    launch_width<false>(block_n, a, b, c, m, n, k, sms, stream);
  }
}

std::vector<GemmKernelResources> detail::gemm_kernel_resources() {
  std::vector<GemmKernelResources> out;
  add_resources<64, false>(out);
  add_resources<128, false>(out);
  add_resources<192, false>(out);
  add_resources<256, false>(out);
  add_resources<64, true>(out);
  add_resources<128, true>(out);
  add_resources<192, true>(out);
  add_resources<256, true>(out);
  add_resources<64, false, gemm_engine::GroupedGemm>(out, "grouped");
  add_resources<128, false, gemm_engine::GroupedGemm>(out, "grouped");
  add_resources<192, false, gemm_engine::GroupedGemm>(out, "grouped");
  add_resources<256, false, gemm_engine::GroupedGemm>(out, "grouped");
  add_resources<64, true, gemm_engine::GroupedGemm>(out, "grouped");
  add_resources<128, true, gemm_engine::GroupedGemm>(out, "grouped");
  add_resources<192, true, gemm_engine::GroupedGemm>(out, "grouped");
  add_resources<256, true, gemm_engine::GroupedGemm>(out, "grouped");
  return out;
}

}  // namespace mk
