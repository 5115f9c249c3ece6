// Host side of the grouped GEMM: validate -> prep kernel (offsets, tile prefix) -> launch.
#include <cuda.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "gemm/gemm_internal.h"
#include "gemm/grouped_gemm.cuh"
#include "gemm/launch.cuh"
#include "mkernel/error.h"
#include "mkernel/gemm.h"
#include "runtime/cuda_check.h"
#include "runtime/cuda_driver.h"
#include "runtime/overrides.h"
#include "runtime/validate.h"

namespace mk {

namespace gemm_engine {

__global__ void grouped_prep_kernel(const int32_t* group_rows, int groups, int64_t max_rows,
                                    int tiles_n, int32_t* row_offset, int32_t* tile_prefix) {
  if (threadIdx.x != 0 || blockIdx.x != 0) return;
  int64_t row = 0, tiles = 0;
  for (int g = 0; g < groups; ++g) {
    row_offset[g] = static_cast<int32_t>(row);
    tile_prefix[g] = static_cast<int32_t>(tiles);
    const int64_t rows = min(max(int64_t{group_rows[g]}, int64_t{0}), max_rows - row);
    row += rows;
    tiles += (rows + 127) / 128 * tiles_n;
  }
  row_offset[groups] = static_cast<int32_t>(row);
  tile_prefix[groups] = static_cast<int32_t>(tiles);
}

}  // namespace gemm_engine

namespace {

constexpr const char* kOp = "grouped_gemm";

[[noreturn]] void invalid(const std::string& what) {
  throw Error(ErrorCode::kInvalidArgument, std::string(kOp) + ": " + what);
}

template <int kBlockN, bool kTransB>
void launch(const void* a, const void* b, void* c, const int32_t* row_offset,
            const int32_t* tile_prefix, int groups, int64_t max_rows, int64_t n, int64_t k, int sms,
            cudaStream_t stream) {
  gemm_engine::GroupedGemm<kBlockN> f{};
  f.a = gemm_engine::make_map(a, max_rows, k, 128);
  f.c = gemm_engine::make_map(c, max_rows, n, 64);
  f.c_ptr = static_cast<__nv_bfloat16*>(c);
  f.row_offset = row_offset;
  f.tile_prefix = tile_prefix;
  f.groups = groups;
  f.tiles_n = static_cast<int>((n + kBlockN - 1) / kBlockN);
  f.n = static_cast<int>(n);
  // B [groups][N][K]: boxes of kBlockN rows x 64; [groups][K][N]: boxes of 64 K rows x 64 N.
  const CUtensorMap map_b = kTransB ? gemm_engine::make_map_3d(b, groups, k, n, 64)
                                    : gemm_engine::make_map_3d(b, groups, n, k, kBlockN);
  gemm_engine::launch<kBlockN, kTransB>(f, map_b, k, sms, stream, kOp);
}

}  // namespace

void grouped_gemm(const void* a, const void* b, void* c, const int32_t* group_rows, int groups,
                  int64_t max_rows, int64_t n, int64_t k, BLayout b_layout, cudaStream_t stream,
                  const GemmConfig& config) {
  if (groups < 1 || groups > 65536) {
    invalid("groups = " + std::to_string(groups) + "; expected 1..65536");
  }
  if (max_rows < 1 || max_rows >= (int64_t{1} << 31)) {
    invalid("max_rows = " + std::to_string(max_rows) + "; expected 1 <= max_rows < 2^31");
  }
  gemm_engine::require_multiple_of_8(n, kOp, "N");
  gemm_engine::require_multiple_of_8(k, kOp, "K");
  if (n >= (int64_t{1} << 31) || k >= (int64_t{1} << 31)) invalid("N and K must be < 2^31");
  if (b_layout != BLayout::kNK && b_layout != BLayout::kKN) invalid("unknown B layout");
  if (config.split_k != 0 && config.split_k != 1) {
    invalid("split_k = " + std::to_string(config.split_k) + "; the grouped GEMM does not split K");
  }
  int device = 0;
  MK_CUDA_CHECK(cudaGetDevice(&device));
  gemm_engine::require_device_pointer(a, kOp, "A", device);
  gemm_engine::require_device_pointer(b, kOp, "B", device);
  gemm_engine::require_device_pointer(c, kOp, "C", device);
  gemm_engine::require_device_pointer(group_rows, kOp, "group_rows", device, 4);
  const auto rows = static_cast<std::size_t>(max_rows);
  detail::require_disjoint(
      kOp, {{"A", a, rows * k * 2, false},
            {"B", b, static_cast<std::size_t>(groups) * n * k * 2, false},
            {"C", c, rows * n * 2, true},
            {"group_rows", group_rows, static_cast<std::size_t>(groups) * 4, false}});
  const detail::Overrides& overrides = detail::process_overrides();
  int sms = config.sms;
  if (sms <= 0) MK_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  // The rows per group are unknown here: widths are chosen for max_rows spread over the groups.
  const int block_n = gemm_engine::pick_block_n(
      config.block_n != 0 ? config.block_n : overrides.block_n, max_rows, n, sms, kOp);
  if (overrides.print_config) {
    std::fprintf(stderr,
                 "[mkernel] grouped_gemm %d groups, <= %lld rows x %lld x %lld: "
                 "block 128x%dx64, %d CTAs\n",
                 groups, static_cast<long long>(max_rows), static_cast<long long>(n),
                 static_cast<long long>(k), block_n, sms);
  }
  int32_t* scratch = nullptr;  // row_offset [groups + 1], tile_prefix [groups + 1]
  MK_CUDA_CHECK(cudaMallocAsync(reinterpret_cast<void**>(&scratch),
                                2 * (static_cast<std::size_t>(groups) + 1) * sizeof(int32_t),
                                stream));
  int32_t* row_offset = scratch;
  int32_t* tile_prefix = scratch + groups + 1;
  const int tiles_n = static_cast<int>((n + block_n - 1) / block_n);
  gemm_engine::grouped_prep_kernel<<<1, 32, 0, stream>>>(group_rows, groups, max_rows, tiles_n,
                                                         row_offset, tile_prefix);
  gemm_engine::dispatch(block_n, b_layout == BLayout::kKN, [&]<int kBlockN, bool kTransB>() {
    launch<kBlockN, kTransB>(a, b, c, row_offset, tile_prefix, groups, max_rows, n, k, sms, stream);
  });
  MK_CUDA_CHECK(cudaFreeAsync(scratch, stream));
}

}  // namespace mk
