// Host side of the grouped GEMM: validate -> prep kernel (offsets, tile prefix) -> launch.
#include <cuda.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cub/block/block_scan.cuh>
#include <optional>
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
  if (threadIdx.x == 0) {
    tile_prefix[groups] = static_cast<int32_t>(carry_tiles);
    tile_prefix[groups + 1] = 0;  // the tile counter
  }
}

}  // namespace gemm_engine

namespace {

constexpr const char* kOp = "grouped_gemm";

[[noreturn]] void invalid(const std::string& what) {
  throw Error(ErrorCode::kInvalidArgument, std::string(kOp) + ": " + what);
}

// total_rows: rows of A and C (max_rows, or groups x capacity).
template <int kBlockN, bool kTransB>
void launch_grouped(const void* a, const void* b, void* c, int32_t* scratch, int groups,
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

namespace {

// What every grouped launch checks first (errors name `op`): groups, layout, rows. Returns the
// rows of A and C.
int64_t grouped_total_rows(const char* op, int groups, int64_t rows, GroupedLayout layout) {
  auto refuse = [&](const std::string& what) {
    throw Error(ErrorCode::kInvalidArgument, std::string(op) + ": " + what);
  };
  if (groups < 1 || groups > 65536) {
    refuse("groups = " + std::to_string(groups) + "; expected 1..65536");
  }
  if (layout != GroupedLayout::kContiguous && layout != GroupedLayout::kMasked &&
      layout != GroupedLayout::kPadded) {
    refuse("unknown grouped layout");
  }
  const bool masked = layout == GroupedLayout::kMasked;
  const char* rows_name = masked ? "rows (the capacity of a group)" : "max_rows";
  if (rows < 1 || rows >= (int64_t{1} << 31)) {
    refuse(std::string(rows_name) + " = " + std::to_string(rows) + "; expected 1 .. 2^31 - 1");
  }
  const int64_t total_rows = masked ? rows * groups : rows;  // rows of A and C
  if (total_rows >= (int64_t{1} << 31)) {
    refuse("groups x rows = " + std::to_string(total_rows) + "; expected < 2^31");
  }
  return total_rows;
}

// Then the pointers and overlaps. c_cols: columns of C; b_elems: elements of all groups' B.
void check_grouped_pointers(const char* op, const void* a, const void* b, void* c,
                            const int32_t* group_rows, int groups, int64_t total_rows,
                            int64_t c_cols, std::size_t b_elems, int64_t k, int device) {
  gemm_engine::require_device_pointer(a, op, "A", device);
  gemm_engine::require_device_pointer(b, op, "B", device);
  gemm_engine::require_device_pointer(c, op, "C", device);
  gemm_engine::require_device_pointer(group_rows, op, "group_rows", device, 4);
  const auto a_rows = static_cast<std::size_t>(total_rows);
  detail::require_disjoint(
      op, {{"A", a, a_rows * k * 2, false},
           {"B", b, b_elems * 2, false},
           {"C", c, a_rows * c_cols * 2, true},
           {"group_rows", group_rows, static_cast<std::size_t>(groups) * 4, false}});
}

// The prep kernel's tables (row_start [groups], row_count [groups], tile_prefix [groups + 1], the
// tile counter)
// for tiles_n tiles a tile-row, written into `tables` - or, when it is null, into stream-ordered
// scratch that `own` holds until the caller's launch is enqueued (then freed in stream order).
int32_t* prep_groups(int32_t* tables, std::optional<gemm_engine::StreamScratch>& own,
                     const int32_t* group_rows, int groups, int64_t total_rows, int64_t rows,
                     GroupedLayout layout, int tiles_n, cudaStream_t stream) {
  if (tables == nullptr) {
    own.emplace(gemm_engine::grouped_tables_bytes(groups), stream);
    tables = static_cast<int32_t*>(own->get());
  }
  gemm_engine::grouped_prep_kernel<<<1, gemm_engine::kPrepThreads, 0, stream>>>(
      group_rows, groups, total_rows, layout == GroupedLayout::kMasked ? rows : 0,
      layout == GroupedLayout::kPadded ? kGroupedRowBlock : 1, tiles_n, tables, tables + groups,
      tables + 2 * groups);
  return tables;
}

}  // namespace

void gemm_engine::grouped_tables(const int32_t* group_rows, int groups, int64_t rows,
                                 GroupedLayout layout, int tiles_n, int32_t* tables,
                                 cudaStream_t stream) {
  std::optional<StreamScratch> own;  // (not used: the caller gives the tables)
  const int64_t total_rows = layout == GroupedLayout::kMasked ? rows * groups : rows;
  prep_groups(tables, own, group_rows, groups, total_rows, rows, layout, tiles_n, stream);
}

void gemm_engine::require_swiglu_intermediate(int64_t intermediate, const char* op) {
  if (intermediate < 64 || intermediate % 64 != 0 || intermediate >= (int64_t{1} << 30)) {
    throw Error(ErrorCode::kInvalidArgument,
                std::string(op) + ": intermediate = " + std::to_string(intermediate) +
                    "; expected a positive multiple of 64 below 2^30 (SwiGLU tiles: 64 gate and "
                    "64 up columns side by side)");
  }
}

void gemm_engine::require_swiglu_width(int block_n, int64_t intermediate, const char* op,
                                       const char* name) {
  if (block_n != 0 && block_n != 128 && block_n != 256) {
    throw Error(ErrorCode::kInvalidArgument,
                std::string(op) + ": " + name + " = " + std::to_string(block_n) +
                    "; expected 0, 128 or 256 (the experts' GEMMs' tile width)");
  }
  if (block_n == 256 && intermediate % 128 != 0) {
    throw Error(ErrorCode::kInvalidArgument,
                std::string(op) + ": " + name + " = 256 with intermediate = " +
                    std::to_string(intermediate) + "; 256-wide tiles need a multiple of 128");
  }
}

std::size_t gemm_engine::grouped_tables_bytes(int groups) {
  return static_cast<std::size_t>(grouped_table_ints(std::max(groups, 0))) * sizeof(int32_t);
}

void grouped_gemm(const void* a, const void* b, void* c, const int32_t* group_rows, int groups,
                  int64_t rows, int64_t n, int64_t k, BLayout b_layout, cudaStream_t stream,
                  const GemmConfig& config, GroupedLayout layout) {
  gemm_engine::grouped_gemm(a, b, c, group_rows, groups, rows, n, k, b_layout, stream, config,
                            layout, nullptr);
}

void gemm_engine::grouped_gemm(const void* a, const void* b, void* c, const int32_t* group_rows,
                               int groups, int64_t rows, int64_t n, int64_t k, BLayout b_layout,
                               cudaStream_t stream, const GemmConfig& config, GroupedLayout layout,
                               int32_t* tables) {
  const int64_t total_rows = grouped_total_rows(kOp, groups, rows, layout);
  gemm_engine::require_multiple_of_8(n, kOp, "N");
  gemm_engine::require_multiple_of_8(k, kOp, "K");
  if (n >= (int64_t{1} << 31) || k >= (int64_t{1} << 31)) invalid("N and K must be < 2^31");
  if (b_layout != BLayout::kNK && b_layout != BLayout::kKN) invalid("unknown B layout");
  if (config.split_k != 0 && config.split_k != 1) {
    invalid("split_k = " + std::to_string(config.split_k) + "; the grouped GEMM does not split K");
  }
  if (config.block_m != 0 && config.block_m != 128) {
    invalid("block_m = " + std::to_string(config.block_m) +
            "; the grouped GEMM's tiles are 128 rows (expected 0 or 128)");
  }
  int device = 0;
  MK_CUDA_CHECK(cudaGetDevice(&device));
  detail::require_stream(device, stream, kOp);
  check_grouped_pointers(
      kOp, a, b, c, group_rows, groups, total_rows, n,
      static_cast<std::size_t>(groups) * static_cast<std::size_t>(n) * static_cast<std::size_t>(k),
      k, device);
  const bool masked = layout == GroupedLayout::kMasked;
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
  std::optional<StreamScratch> own;  // the prep tables, unless the caller gives them
  const int tiles_n = static_cast<int>((n + block_n - 1) / block_n);
  int32_t* scratch =
      prep_groups(tables, own, group_rows, groups, total_rows, rows, layout, tiles_n, stream);
  gemm_engine::dispatch(block_n, b_layout == BLayout::kKN, [&]<int kBlockN, bool kTransB>() {
    launch_grouped<kBlockN, kTransB>(a, b, c, scratch, groups, total_rows, n, k, sms, stream);
  });
}

void gemm_engine::preload_grouped() {
  preload_all<GroupedGemm>();
  cudaFuncAttributes attr{};
  MK_CUDA_CHECK(cudaFuncGetAttributes(&attr, grouped_prep_kernel));
}

int gemm_engine::swiglu_down_width(int block_n, int64_t total_rows, int groups,
                                   int64_t intermediate, int sms, const char* op) {
  // Tiles of 128 x 256 (gate / up: 128 h columns) where I allows and the plain GEMM of the
  // gate / up's width (2I) would take 256-wide tiles, else 128 x 128 (which ran the gate / up
  // GEMM well below the plain 256-wide one: journal, 2026-12-02); or the requested width.
  require_swiglu_width(block_n, intermediate, op, "block_n");
  const int64_t width_rows = std::max<int64_t>(total_rows, int64_t{groups} * 128);
  if (block_n != 0) return block_n;
  return intermediate % 128 == 0 && pick_block_n(0, width_rows, 2 * intermediate, sms, op) == 256
             ? 256
             : 128;
}

template <int kBlockN>
gemm_engine::GroupedSwigluDown<kBlockN> gemm_engine::swiglu_down_policy(
    const DeviceComm& comm, const void* a, const void* w13, const void* w2, void* h, void* y,
    const int32_t* tables, uint64_t* done, int groups, int64_t total_rows, int64_t intermediate,
    int64_t hidden) {
  constexpr int half = kBlockN / 2;
  // w13 [G][2][I / half][half][H]: a box is `half` rows of the gate and the same rows of the up.
  const cuuint64_t dims[5] = {static_cast<cuuint64_t>(hidden), static_cast<cuuint64_t>(half),
                              static_cast<cuuint64_t>(intermediate / half), 2,
                              static_cast<cuuint64_t>(groups)};
  const cuuint64_t strides[4] = {static_cast<cuuint64_t>(hidden) * 2,
                                 static_cast<cuuint64_t>(hidden * half) * 2,
                                 static_cast<cuuint64_t>(hidden * intermediate) * 2,
                                 static_cast<cuuint64_t>(hidden * intermediate) * 4};
  const cuuint32_t box[5] = {64, static_cast<cuuint32_t>(half), 1, 2, 1};
  GroupedSwigluDown<kBlockN> f{};
  f.comm = comm;
  f.x = make_map(a, total_rows, hidden, 128);
  f.h_a = make_map(h, total_rows, intermediate, 128);
  f.h_c = make_map(h, total_rows, intermediate, 64);
  f.y = make_map(y, total_rows, hidden, 64);
  f.w13 = encode_map(w13, 5, dims, strides, box);
  f.w2 = make_map_3d(w2, groups, hidden, intermediate, kBlockN);
  f.h_ptr = static_cast<__nv_bfloat16*>(h);
  f.y_ptr = static_cast<__nv_bfloat16*>(y);
  f.row_start = tables;
  f.row_count = tables + groups;
  f.tile_prefix = tables + 2 * groups;
  f.done = done;
  f.groups = groups;
  f.tiles_up = static_cast<int>(intermediate / half);
  f.tiles_down = static_cast<int>((hidden + kBlockN - 1) / kBlockN);
  f.inter = static_cast<int>(intermediate);
  f.hidden = static_cast<int>(hidden);
  f.kb_up = static_cast<int>((hidden + 63) / 64);
  f.kb_down = static_cast<int>((intermediate + 63) / 64);
  return f;
}
template gemm_engine::GroupedSwigluDown<128> gemm_engine::swiglu_down_policy<128>(
    const DeviceComm&, const void*, const void*, const void*, void*, void*, const int32_t*,
    uint64_t*, int, int64_t, int64_t, int64_t);
template gemm_engine::GroupedSwigluDown<256> gemm_engine::swiglu_down_policy<256>(
    const DeviceComm&, const void*, const void*, const void*, void*, void*, const int32_t*,
    uint64_t*, int, int64_t, int64_t, int64_t);

std::size_t gemm_engine::swiglu_down_counters_bytes(int groups, int64_t total_rows) {
  // Tile-rows: sum over groups of ceil(rows / 128) <= total_rows / 128 + groups.
  return static_cast<std::size_t>(total_rows / 128 + groups) * sizeof(uint64_t);
}

}  // namespace mk
