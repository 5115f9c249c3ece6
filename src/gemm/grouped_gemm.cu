// Host side of the grouped GEMM: validate -> prep kernel (offsets, tile prefix) -> launch.
#include <cuda.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cub/block/block_scan.cuh>
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

// kPrepThreads groups at a time, by block-wide scans. Contiguous: a count clamped to the room
// left is the running sum of the (non-negative) counts capped at max_rows, differenced.
__global__ void __launch_bounds__(kPrepThreads)
    grouped_prep_kernel(const int32_t* group_rows, int groups, int64_t max_rows, int64_t capacity,
                        int row_block, int tiles_n, int32_t* row_start, int32_t* row_count,
                        int32_t* tile_prefix) {
  using Scan = cub::BlockScan<long long, kPrepThreads>;
  __shared__ typename Scan::TempStorage scan;
  __shared__ long long carry_rows, carry_tiles;  // sums over the earlier chunks
  if (threadIdx.x == 0) carry_rows = carry_tiles = 0;
  __syncthreads();
  for (int base = 0; base < groups; base += kPrepThreads) {
    const int g = base + static_cast<int>(threadIdx.x);
    const long long count = g < groups ? max(group_rows[g], 0) : 0;
    // The rows a group takes in A: its count, rounded up to the row block (padded layout).
    const long long taken = (count + row_block - 1) / row_block * row_block;
    long long upto = 0;  // rows taken by the groups <= g in this chunk
    Scan(scan).InclusiveSum(taken, upto);
    __syncthreads();
    long long first, rows;
    if (capacity > 0) {
      first = static_cast<long long>(g) * capacity;
      rows = min(count, static_cast<long long>(capacity));
    } else {
      first = min(carry_rows + upto - taken, static_cast<long long>(max_rows));
      rows = min(carry_rows + upto - taken + count, static_cast<long long>(max_rows)) - first;
    }
    const long long tiles = (rows + 127) / 128 * tiles_n;
    long long tiles_before = 0;
    Scan(scan).ExclusiveSum(tiles, tiles_before);
    if (g < groups) {
      row_start[g] = static_cast<int32_t>(first);
      row_count[g] = static_cast<int32_t>(rows);
      tile_prefix[g] = static_cast<int32_t>(carry_tiles + tiles_before);
    }
    __syncthreads();  // everyone has read the carries
    if (threadIdx.x == kPrepThreads - 1) {
      carry_rows += upto;
      carry_tiles += tiles_before + tiles;
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) tile_prefix[groups] = static_cast<int32_t>(carry_tiles);
}

}  // namespace gemm_engine

namespace {

constexpr const char* kOp = "grouped_gemm";

[[noreturn]] void invalid(const std::string& what) {
  throw Error(ErrorCode::kInvalidArgument, std::string(kOp) + ": " + what);
}

// total_rows: rows of A and C (max_rows, or groups x capacity).
template <int kBlockN, bool kTransB>
void launch(const void* a, const void* b, void* c, const int32_t* scratch, int groups,
            int64_t total_rows, int64_t n, int64_t k, int sms, cudaStream_t stream) {
  gemm_engine::GroupedGemm<kBlockN> f{};
  f.a = gemm_engine::make_map(a, total_rows, k, 128);
  f.c = gemm_engine::make_map(c, total_rows, n, 64);
  f.c_ptr = static_cast<__nv_bfloat16*>(c);
  f.row_start = scratch;
  f.row_count = scratch + groups;
  f.tile_prefix = scratch + 2 * groups;
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
                  int64_t rows, int64_t n, int64_t k, BLayout b_layout, cudaStream_t stream,
                  const GemmConfig& config, GroupedLayout layout) {
  if (groups < 1 || groups > 65536) {
    invalid("groups = " + std::to_string(groups) + "; expected 1..65536");
  }
  if (layout != GroupedLayout::kContiguous && layout != GroupedLayout::kMasked &&
      layout != GroupedLayout::kPadded) {
    invalid("unknown grouped layout");
  }
  const bool masked = layout == GroupedLayout::kMasked;
  const char* rows_name = masked ? "rows (the capacity of a group)" : "max_rows";
  if (rows < 1 || rows >= (int64_t{1} << 31)) {
    invalid(std::string(rows_name) + " = " + std::to_string(rows) + "; expected 1 .. 2^31 - 1");
  }
  const int64_t total_rows = masked ? rows * groups : rows;  // rows of A and C
  if (total_rows >= (int64_t{1} << 31)) {
    invalid("groups x rows = " + std::to_string(total_rows) + "; expected < 2^31");
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
  const auto a_rows = static_cast<std::size_t>(total_rows);
  detail::require_disjoint(
      kOp, {{"A", a, a_rows * k * 2, false},
            {"B", b, static_cast<std::size_t>(groups) * n * k * 2, false},
            {"C", c, a_rows * n * 2, true},
            {"group_rows", group_rows, static_cast<std::size_t>(groups) * 4, false}});
  const detail::Overrides& overrides = detail::process_overrides();
  int sms = config.sms;
  if (sms <= 0) MK_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  // The rows per group are unknown here: widths are chosen for the rows there is room for
  // (contiguous: max_rows; masked: all the groups' capacity), and for at least a tile-row per
  // group (each group with rows has one). Few rows per group stream the weights: the widest
  // tiles carry the most weight bytes per stage (2026-12-01, 8-128 experts of 1-16 rows: 256
  // wide 1.4-1.8x faster than the 64 the rows alone chose).
  const int64_t width_rows = std::max<int64_t>(total_rows, int64_t{groups} * 128);
  const int block_n = gemm_engine::pick_block_n(
      config.block_n != 0 ? config.block_n : overrides.block_n, width_rows, n, sms, kOp);
  if (overrides.print_config) {
    std::fprintf(stderr,
                 "[mkernel] grouped_gemm %d groups, %s %lld rows x %lld x %lld: "
                 "block 128x%dx64, %d CTAs\n",
                 groups,
                 masked                             ? "masked, capacity"
                 : layout == GroupedLayout::kPadded ? "padded, <="
                                                    : "contiguous, <=",
                 static_cast<long long>(rows), static_cast<long long>(n), static_cast<long long>(k),
                 block_n, sms);
  }
  // row_start [groups], row_count [groups], tile_prefix [groups + 1] (freed after the launch)
  const gemm_engine::StreamScratch scratch_memory(
      (3 * static_cast<std::size_t>(groups) + 1) * sizeof(int32_t), stream);
  auto* scratch = static_cast<int32_t*>(scratch_memory.get());
  const int tiles_n = static_cast<int>((n + block_n - 1) / block_n);
  gemm_engine::grouped_prep_kernel<<<1, gemm_engine::kPrepThreads, 0, stream>>>(
      group_rows, groups, total_rows, masked ? rows : 0,
      layout == GroupedLayout::kPadded ? kGroupedRowBlock : 1, tiles_n, scratch, scratch + groups,
      scratch + 2 * groups);
  gemm_engine::dispatch(block_n, b_layout == BLayout::kKN, [&]<int kBlockN, bool kTransB>() {
    launch<kBlockN, kTransB>(a, b, c, scratch, groups, total_rows, n, k, sms, stream);
  });
}

}  // namespace mk
