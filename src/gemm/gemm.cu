// Host side of the GEMM engine: validate -> pick config -> build tensor maps -> launch.
#include <cuda.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "gemm/gemm_internal.h"
#include "gemm/gemm_kernel.cuh"
#include "gemm/grouped_gemm.cuh"
#include "gemm/launch.cuh"
#include "mkernel/error.h"
#include "mkernel/gemm.h"
#include "runtime/cuda_check.h"
#include "runtime/cuda_driver.h"
#include "runtime/overrides.h"
#include "runtime/validate.h"

namespace mk {
namespace {

constexpr const char* kOp = "gemm";

[[noreturn]] void invalid(const std::string& what) {
  throw Error(ErrorCode::kInvalidArgument, std::string(kOp) + ": " + what);
}

}  // namespace

CUtensorMap gemm_engine::encode_map(const void* base, int rank, const cuuint64_t* dims,
                                    const cuuint64_t* strides, const cuuint32_t* box,
                                    CUtensorMapDataType type, CUtensorMapSwizzle swizzle) {
  CUtensorMap map{};
  const cuuint32_t element_strides[5] = {1, 1, 1, 1, 1};
  MK_CU_CHECK(detail::driver().TensorMapEncodeTiled(
      &map, type, rank, const_cast<void*>(base), dims, strides, box, element_strides,
      CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
      CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE));
  return map;
}

CUtensorMap gemm_engine::make_map(const void* base, int64_t rows, int64_t cols, int box_rows,
                                  int box_cols) {
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(cols), static_cast<cuuint64_t>(rows)};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(cols) * 2};
  const cuuint32_t box[2] = {static_cast<cuuint32_t>(box_cols), static_cast<cuuint32_t>(box_rows)};
  const CUtensorMapSwizzle swizzle = box_cols == 64   ? CU_TENSOR_MAP_SWIZZLE_128B
                                     : box_cols == 32 ? CU_TENSOR_MAP_SWIZZLE_64B
                                                      : CU_TENSOR_MAP_SWIZZLE_32B;
  return encode_map(base, 2, dims, strides, box, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, swizzle);
}

CUtensorMap gemm_engine::make_map_fp32(void* base, int64_t rows, int64_t cols, int box_rows) {
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(cols), static_cast<cuuint64_t>(rows)};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(cols) * 4};
  const cuuint32_t box[2] = {32, static_cast<cuuint32_t>(box_rows)};
  return encode_map(base, 2, dims, strides, box, CU_TENSOR_MAP_DATA_TYPE_FLOAT32);
}

CUtensorMap gemm_engine::make_map_fp32_row_pairs(void* base, int64_t rows, int64_t cols) {
  const cuuint64_t dims[3] = {static_cast<cuuint64_t>(cols / 2), 2,
                              static_cast<cuuint64_t>(rows / 2)};
  const cuuint64_t strides[2] = {static_cast<cuuint64_t>(cols) * 2,
                                 static_cast<cuuint64_t>(cols) * 4};
  const cuuint32_t box[3] = {32, 1, 64};
  return encode_map(base, 3, dims, strides, box, CU_TENSOR_MAP_DATA_TYPE_FLOAT32);
}

CUtensorMap gemm_engine::make_map_3d(const void* base, int64_t batches, int64_t rows, int64_t cols,
                                     int box_rows) {
  const cuuint64_t dims[3] = {static_cast<cuuint64_t>(cols), static_cast<cuuint64_t>(rows),
                              static_cast<cuuint64_t>(batches)};
  const cuuint64_t strides[2] = {static_cast<cuuint64_t>(cols) * 2,
                                 static_cast<cuuint64_t>(rows * cols) * 2};
  const cuuint32_t box[3] = {64, static_cast<cuuint32_t>(box_rows), 1};
  return encode_map(base, 3, dims, strides, box);
}

// [N, K]: boxes of block_n rows x 64 K; [K, N]: boxes of 64 K rows x 64 N.
CUtensorMap gemm_engine::make_b_map(const void* b, int64_t n, int64_t k, int block_n,
                                    bool k_major_rows) {
  return k_major_rows ? make_map(b, k, n, 64) : make_map(b, n, k, block_n);
}

static_assert(gemm_engine::kMaxSplit == gemm_engine::SplitSchedule::kMaxPieces);
// device_clusters measures the cluster capacity once, with the 128-row split kernel, for every
// tile shape: true while each of them holds an SM alone (more than half its shared memory).
template <int kBlockN, int kBlockM>
constexpr bool holds_an_sm() {
  using Cfg = typename gemm_engine::PlainGemm<kBlockN, true, kBlockM>::Cfg;
  return Cfg::kSmemBytes > Cfg::kSmemLimit / 2;
}
static_assert(holds_an_sm<64, 64>() && holds_an_sm<128, 64>() && holds_an_sm<192, 64>() &&
              holds_an_sm<256, 64>() && holds_an_sm<64, 128>() && holds_an_sm<128, 128>() &&
              holds_an_sm<192, 128>() && holds_an_sm<256, 128>() && holds_an_sm<64, 192>() &&
              holds_an_sm<128, 192>());

namespace {

using gemm_engine::make_map;

template <int kBlockM, int kBlockN, bool kTransB, bool kSplitK>
void launch(const void* a, const void* b, void* c, int64_t m, int64_t n, int64_t k,
            const GemmPlan& plan, cudaStream_t stream) {
  using Fusion = gemm_engine::PlainGemm<kBlockN, kSplitK, kBlockM>;
  const int last_rows = gemm_engine::last_tile_rows(m, kBlockM);
  gemm_engine::SplitSchedule split{static_cast<int>(plan.whole_tiles), plan.split_k,
                                   static_cast<int>((k + 63) / 64), static_cast<__nv_bfloat16*>(c)};
  // Split K: one round of pieces after the whole tiles, each tile's pieces one cluster.
  if (kSplitK &&
      (plan.split_k < 2 || plan.split_k > split.k_iters || plan.split_k > split.kMaxPieces ||
       plan.whole_tiles % plan.ctas != 0 || plan.ctas % plan.split_k != 0 ||
       (plan.tiles - plan.whole_tiles) * plan.split_k > plan.ctas)) {
    throw Error(ErrorCode::kInternal,
                "gemm: a split plan the kernel cannot run: " + plan.describe());
  }
  const Fusion fusion{
      make_map(a, m, k, kBlockM),
      make_map(c, m, n, 64),
      {static_cast<int>((m + kBlockM - 1) / kBlockM),
       static_cast<int>((n + kBlockN - 1) / kBlockN)},
      static_cast<int>(n),
      make_map(a, m, k, last_rows),
      last_rows,
      static_cast<int>(m),
      split,
      // B [K, N] at a step width: its last 16 or 32 columns
      kTransB && kBlockN % 64 != 0 ? make_map(b, k, n, 64, kBlockN % 64) : CUtensorMap{}};
  gemm_engine::launch<kBlockN, kTransB, Fusion, kBlockM>(
      fusion, gemm_engine::make_b_map(b, n, k, kBlockN, kTransB), k, plan.ctas, stream, kOp,
      kSplitK ? plan.split_k : 1);
}

// Calls fn.template operator()<kBlockN>() for a width of kStepWidths.
template <class Fn>
void dispatch_step_width(int block_n, Fn&& fn) {
  static_assert(sizeof(gemm_engine::kStepWidths) / sizeof(int) == 6 &&
                    gemm_engine::kStepWidths[0] == 80 && gemm_engine::kStepWidths[1] == 96 &&
                    gemm_engine::kStepWidths[2] == 112 && gemm_engine::kStepWidths[3] == 144 &&
                    gemm_engine::kStepWidths[4] == 160 && gemm_engine::kStepWidths[5] == 224,
                "the cases below are kStepWidths");
  switch (block_n) {
    case 80:
      return fn.template operator()<80>();
    case 96:
      return fn.template operator()<96>();
    case 112:
      return fn.template operator()<112>();
    case 144:
      return fn.template operator()<144>();
    case 160:
      return fn.template operator()<160>();
    case 224:
      return fn.template operator()<224>();
    default:
      throw Error(ErrorCode::kInternal, "gemm: not a step width: " + std::to_string(block_n));
  }
}

// The plan's kernel: its tile height, width, B layout and whether it splits K.
void launch_plan(const void* a, const void* b, void* c, int64_t m, int64_t n, int64_t k,
                 bool trans_b, const GemmPlan& plan, cudaStream_t stream) {
  const bool split = plan.split_k > 1 && plan.whole_tiles < plan.tiles;
  if (gemm_engine::is_step_width(plan.block_n)) {  // 128 rows, K whole (the plan's)
    if ((trans_b && !gemm_engine::is_kn_step_width(plan.block_n)) || split || plan.block_m != 128) {
      throw Error(ErrorCode::kInternal, "gemm: a plan the kernels cannot run: " + plan.describe());
    }
    dispatch_step_width(plan.block_n, [&]<int kBlockN>() {
      if (!trans_b) return launch<128, kBlockN, false, false>(a, b, c, m, n, k, plan, stream);
      if constexpr (gemm_engine::is_kn_step_width(kBlockN)) {
        launch<128, kBlockN, true, false>(a, b, c, m, n, k, plan, stream);
      }
    });
    return;
  }
  gemm_engine::dispatch(plan.block_n, trans_b, [&]<int kBlockN, bool kTransB>() {
    auto run = [&]<int kBlockM>() {
      if (split) {
        launch<kBlockM, kBlockN, kTransB, true>(a, b, c, m, n, k, plan, stream);
      } else {
        launch<kBlockM, kBlockN, kTransB, false>(a, b, c, m, n, k, plan, stream);
      }
    };
    if constexpr (kBlockN == 64 || kBlockN == 128) {  // the widths of 192-row tiles
      if (plan.block_m == 192) return run.template operator()<192>();
    }
    if (plan.block_m == 64) return run.template operator()<64>();
    if (plan.block_m != 128) {
      throw Error(ErrorCode::kInternal, "gemm: a plan the kernels cannot run: " + plan.describe());
    }
    run.template operator()<128>();
  });
}

}  // namespace

void gemm_engine::require_device_pointer(const void* p, const char* op, const char* name,
                                         int device, std::size_t alignment) {
  const std::string what = std::string(op) + ": " + name;
  if (p == nullptr) throw Error(ErrorCode::kInvalidArgument, what + " is null");
  if (reinterpret_cast<uintptr_t>(p) % alignment != 0) {
    throw Error(ErrorCode::kInvalidArgument, what + " is not " + std::to_string(alignment) +
                                                 "-byte aligned (the tensor copy engine needs 16)");
  }
  cudaPointerAttributes attr{};
  if (cudaPointerGetAttributes(&attr, p) != cudaSuccess) {
    cudaGetLastError();
    throw Error(ErrorCode::kInvalidArgument, what + " is not a CUDA pointer");
  }
  if ((attr.type != cudaMemoryTypeDevice && attr.type != cudaMemoryTypeManaged) ||
      attr.device != device) {
    throw Error(ErrorCode::kInvalidArgument,
                what + " is not device memory of the current GPU " + std::to_string(device));
  }
}

void gemm_engine::require_multiple_of_8(int64_t value, const char* op, const char* what) {
  if (value < 8 || value % 8 != 0) {
    throw Error(ErrorCode::kInvalidArgument, std::string(op) + ": " + what + " = " +
                                                 std::to_string(value) +
                                                 "; expected a multiple of 8");
  }
}

// Tile width: the one with the least estimated time, waves x per-tile cost. A tile's cost grows
// with its width but wide tiles use the tensor cores better (each wgmma re-reads the A slice from
// shared memory whatever its width); the efficiencies are from the H200 sweep in
// docs/PERFORMANCE.md.
int gemm_engine::pick_block_n(int requested, int64_t m, int64_t n, int sms, const char* op,
                              int block_m) {
  int block_n = requested;
  if (block_n == 0) {
    struct Option {
      int width;
      double efficiency;
    };
    constexpr Option kOptions[] = {{256, 1.0}, {192, 0.97}, {128, 0.9}, {64, 0.75}};
    double best = 0;
    for (const Option& o : kOptions) {
      const int64_t tiles = (m + block_m - 1) / block_m * ((n + o.width - 1) / o.width);
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

template <int kBlockN, bool kTransB, template <int> class Fusion = gemm_engine::PlainGemm,
          int kBlockM = 128>
void add_resources(std::vector<GemmKernelResources>& out, const char* what = "gemm") {
  out.push_back(detail::kernel_resources(
      std::string(what) + " " + std::to_string(kBlockM) + "x" + std::to_string(kBlockN) +
          (kTransB ? " B[K,N]" : " B[N,K]"),
      reinterpret_cast<const void*>(
          gemm_engine::prepared_kernel<kBlockN, kTransB, Fusion<kBlockN>, kBlockM>())));
}

}  // namespace

namespace {

// M, N and K as gemm() and gemm_plan() take them.
void require_shape(int64_t m, int64_t n, int64_t k) {
  if (m < 1) invalid("M = " + std::to_string(m) + "; expected M >= 1");
  gemm_engine::require_multiple_of_8(n, kOp, "N");
  gemm_engine::require_multiple_of_8(k, kOp, "K");
  constexpr int64_t kMax = int64_t{1} << 31;
  if (m >= kMax || n >= kMax || k >= kMax) invalid("M, N and K must each be < 2^31");
}

// The current device's CTAs in clusters of 2..8 split GEMM CTAs (asked once per device: every
// tile shape's kernel takes all of an SM's shared memory alike, one CTA an SM).
const gemm_engine::ClusterCtas& device_clusters(int device) {
  static std::mutex mutex;
  static std::map<int, gemm_engine::ClusterCtas> known;
  const std::lock_guard<std::mutex> lock(mutex);
  auto it = known.find(device);
  if (it == known.end()) {
    gemm_engine::ClusterCtas ctas{};
    for (int p = 2; p <= gemm_engine::kMaxSplit; ++p) {
      ctas[p] = gemm_engine::cluster_ctas<128, false, gemm_engine::SplitGemm<128>>(p);
    }
    it = known.emplace(device, ctas).first;
  }
  return it->second;
}

// gemm_plan() for a checked shape: the config's SMs (or the device's) and width (or
// MKERNEL_GEMM_BLOCK_N).
GemmPlan plan_checked(int64_t m, int64_t n, int64_t k, BLayout b_layout, const GemmConfig& config) {
  int device = 0;
  MK_CUDA_CHECK(cudaGetDevice(&device));
  int sms = config.sms;
  if (sms <= 0) MK_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  const int block_n = config.block_n != 0 ? config.block_n : detail::process_overrides().block_n;
  return gemm_engine::plan_gemm(m, n, k, b_layout, sms, config.block_m, block_n, config.split_k,
                                kOp, device_clusters(device));
}

}  // namespace

void gemm(const void* a, const void* b, void* c, int64_t m, int64_t n, int64_t k, BLayout b_layout,
          cudaStream_t stream, const GemmConfig& config) {
  require_shape(m, n, k);
  if (b_layout != BLayout::kNK && b_layout != BLayout::kKN) invalid("unknown B layout");
  int device = 0;
  MK_CUDA_CHECK(cudaGetDevice(&device));
  detail::require_stream(device, stream, kOp);
  gemm_engine::require_device_pointer(a, kOp, "A", device);
  gemm_engine::require_device_pointer(b, kOp, "B", device);
  gemm_engine::require_device_pointer(c, kOp, "C", device);
  detail::require_disjoint(kOp, {{"A", a, static_cast<std::size_t>(m) * k * 2, false},
                                 {"B", b, static_cast<std::size_t>(n) * k * 2, false},
                                 {"C", c, static_cast<std::size_t>(m) * n * 2, true}});
  const GemmPlan plan = plan_checked(m, n, k, b_layout, config);
  if (detail::process_overrides().print_config) {
    std::fprintf(stderr, "[mkernel] gemm %lldx%lldx%lld: %s\n", static_cast<long long>(m),
                 static_cast<long long>(n), static_cast<long long>(k), plan.describe().c_str());
  }
  launch_plan(a, b, c, m, n, k, b_layout == BLayout::kKN, plan, stream);
}

GemmPlan gemm_plan(int64_t m, int64_t n, int64_t k, const GemmConfig& config, BLayout b_layout) {
  require_shape(m, n, k);
  if (b_layout != BLayout::kNK && b_layout != BLayout::kKN) invalid("unknown B layout");
  return plan_checked(m, n, k, b_layout, config);
}

GemmKernelResources detail::kernel_resources(std::string name, const void* kernel) {
  cudaFuncAttributes attr{};
  MK_CUDA_CHECK(cudaFuncGetAttributes(&attr, kernel));
  return {std::move(name), attr.numRegs, static_cast<int64_t>(attr.localSizeBytes),
          static_cast<int64_t>(attr.maxDynamicSharedSizeBytes)};
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
  add_resources<64, false, gemm_engine::SplitGemm>(out, "split");
  add_resources<128, false, gemm_engine::SplitGemm>(out, "split");
  add_resources<192, false, gemm_engine::SplitGemm>(out, "split");
  add_resources<256, false, gemm_engine::SplitGemm>(out, "split");
  add_resources<64, true, gemm_engine::SplitGemm>(out, "split");
  add_resources<128, true, gemm_engine::SplitGemm>(out, "split");
  add_resources<192, true, gemm_engine::SplitGemm>(out, "split");
  add_resources<256, true, gemm_engine::SplitGemm>(out, "split");
  gemm_engine::for_each_width([&]<int kBlockN, bool kTransB>() {
    if constexpr (kBlockN <= 128) {  // 192-row tiles: widths 64 and 128
      add_resources<kBlockN, kTransB, gemm_engine::TallGemm, 192>(out);
      add_resources<kBlockN, kTransB, gemm_engine::TallSplitGemm, 192>(out, "split");
    }
    add_resources<kBlockN, kTransB, gemm_engine::ShortGemm, 64>(out);
    add_resources<kBlockN, kTransB, gemm_engine::ShortSplitGemm, 64>(out, "split");
  });
  for (int block_n : gemm_engine::kStepWidths) {
    dispatch_step_width(block_n, [&]<int kBlockN>() {
      add_resources<kBlockN, false>(out);
      if constexpr (gemm_engine::is_kn_step_width(kBlockN)) add_resources<kBlockN, true>(out);
    });
  }
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
