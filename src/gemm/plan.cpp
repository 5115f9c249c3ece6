// gemm()'s plan: the tile width and the split of the last wave, by a cost model of the H200.
//
// Fitted to bench_gemm's sweep of 2026-12-01 (docs/PERFORMANCE.md; 96 shapes x 4 widths): it
// ranks the widths within 0.5% of the best measured one (geomean), where the fixed efficiency
// table before it lost up to 64% at few tiles. The model, per width and split:
//   one k-block on a CTA = max(its wgmma, its A and B loads at the L2 rate the active CTAs share);
//   a CTA runs its full waves' k-blocks, then its piece of the last wave's;
//   the HBM floor: A + B + C at the rate that many CTAs pull (a CTA alone pulls a few tens of
//   GB/s: few tiles need split K to reach the HBM rate);
//   split K adds its partial sums (written and read in L2) and the counters' clearing.
#include <algorithm>
#include <cstdio>
#include <string>

#include "gemm/gemm_internal.h"
#include "mkernel/error.h"

namespace mk {
namespace {

constexpr double kWgmmaFlopsPerSm = 5.6e12;  // bf16 dense, one SM (8192^3 at 128 x 256 tiles)
constexpr double kL2Bytes = 10.3e12;         // L2 to SMs, all CTAs together
constexpr double kL2BytesPerCta = 110e9;     // one CTA's loads at most
constexpr double kHbmBytes = 3.6e12;         // HBM, all CTAs together
constexpr double kLaunchSeconds = 3e-6;
constexpr double kSplitSeconds = 1.5e-6;  // the counters' clearing and the last pieces' reads
constexpr int kMaxSplit = 32;
// The library's own splits, by the sweeps of 2026-12-01 (the journal), where the model expects
// the rule's gain:
//   few tiles (no full wave, at most two tile-rows, tiles for at most a quarter of the SMs): the
//     loads bound the time; pieces of 16 k-blocks or more (shorter ones lost), 25%;
//   more rows without a full wave, where K whole leaves a quarter of the SMs or more idle: pieces
//   of
//     32 k-blocks or more (384 and 512 x 2048 x 7168 lost in pieces of 28-37 k-blocks against K
//     whole on 96-128 of the 132 SMs), 10%; their work items may take several rounds of the CTAs;
//   the last of one to three full waves: in one round of pieces of 16 k-blocks or more, 10%.
constexpr int64_t kFewTilesRows = 256;
constexpr int kMinKBlocks = 16;
constexpr int kMidMinKBlocks = 32;
constexpr double kFewTilesGain = 1.25;
constexpr int64_t kMaxWavesBeforeSplit = 3;
constexpr double kSplitGain = 1.10;

// HBM bytes per second one CTA pulls with its ring of stages (wider tiles: more bytes in flight).
double hbm_per_cta(int block_n) {
  switch (block_n) {
    case 64:
      return 25e9;
    case 128:
      return 34e9;
    case 192:
      return 36e9;
    default:
      return 38e9;
  }
}

struct Estimate {
  double seconds;
  int64_t whole;
  int ctas;
};

int64_t tile_count(int64_t m, int64_t n, int block_n) {
  return (m + 127) / 128 * ((n + block_n - 1) / block_n);
}

Estimate estimate(int64_t m, int64_t n, int64_t k, int block_n, int pieces, int sms) {
  const int64_t tiles = tile_count(m, n, block_n);
  const int64_t k_blocks = (k + 63) / 64;
  const int64_t full_waves = tiles / sms, last = tiles % sms;
  if (last == 0) pieces = 1;
  const double a_rows = static_cast<double>(std::min<int64_t>(m, 128));
  const auto k_block_seconds = [&](int64_t active) {
    const double rate = std::min(kL2BytesPerCta, kL2Bytes / static_cast<double>(active));
    const double loads = (a_rows + block_n) * 128 / rate;
    const double wgmma = 128.0 * block_n * 64 * 2 / kWgmmaFlopsPerSm;
    return std::max(loads, wgmma);
  };
  double compute = static_cast<double>(full_waves * k_blocks) * k_block_seconds(sms);
  if (last > 0) {  // the last wave's tiles, or their pieces: in rounds of `sms` work items
    const int64_t items = last * pieces, active = std::min<int64_t>(sms, items);
    compute += static_cast<double>((items + sms - 1) / sms * ((k_blocks + pieces - 1) / pieces)) *
               k_block_seconds(active);
  }
  const int64_t ctas = std::min<int64_t>(sms, full_waves > 0 ? tiles : last * pieces);
  const double bytes = 2.0 * static_cast<double>(m * k + n * k + m * n);
  const double hbm = bytes / std::min(kHbmBytes, static_cast<double>(ctas) * hbm_per_cta(block_n));
  double split = 0;
  if (pieces > 1) {
    split =
        kSplitSeconds + static_cast<double>(last * pieces) * a_rows * block_n * 4 * 2 / kL2Bytes;
  }
  return {std::max(compute, hbm) + split + kLaunchSeconds, tiles - last * (pieces > 1),
          static_cast<int>(ctas)};
}

}  // namespace

GemmPlan gemm_engine::plan_gemm(int64_t m, int64_t n, int64_t k, int sms, int requested_block_n,
                                int requested_split_k, const char* op) {
  if (requested_split_k < 0 || requested_split_k > kMaxSplit) {
    throw Error(ErrorCode::kInvalidArgument,
                std::string(op) + ": split_k = " + std::to_string(requested_split_k) +
                    "; expected 0 (the library's choice) or 1.." + std::to_string(kMaxSplit));
  }
  if (sms < 1) {
    throw Error(ErrorCode::kInvalidArgument,
                std::string(op) + ": sms = " + std::to_string(sms) + "; expected >= 1");
  }
  const int64_t k_blocks = (k + 63) / 64;
  const auto plan_for = [&](int block_n, int pieces) {
    const Estimate e = estimate(m, n, k, block_n, pieces, sms);
    GemmPlan p;
    p.block_n = block_n;
    p.ctas = e.ctas;
    p.tiles = tile_count(m, n, block_n);
    p.whole_tiles = e.whole;
    p.split_k = p.whole_tiles < p.tiles ? pieces : 1;
    p.estimate_us = e.seconds * 1e6;
    return p;
  };
  // K whole: the width with the fewest estimated tile-waves (pick_block_n; it validates a
  // requested width).
  const int whole_width = pick_block_n(requested_block_n, m, n, sms, op);
  if (requested_split_k == 1) return plan_for(whole_width, 1);
  const int64_t whole_tiles = tile_count(m, n, whole_width);
  GemmPlan split;  // the best split, at any allowed width, by its estimate times its required gain
  double split_cost = 0;
  for (int block_n : {256, 192, 128, 64}) {
    if (requested_block_n != 0 && block_n != requested_block_n) continue;
    const int64_t tiles = tile_count(m, n, block_n);
    const int64_t full_waves = tiles / sms, last = tiles % sms;
    if (last == 0) continue;  // whole waves: nothing to split
    int first = 2, most = 1;
    // Which rule allows a split here, and its shortest piece and required gain.
    const bool few_tiles = full_waves == 0 && m <= kFewTilesRows && tiles <= sms / 4;
    const bool mid = full_waves == 0 && m > kFewTilesRows && whole_tiles * 4 <= sms * 3;
    const bool last_wave = full_waves > 0 && full_waves <= kMaxWavesBeforeSplit;
    const int min_piece = mid ? kMidMinKBlocks : kMinKBlocks;
    if (requested_split_k != 0) {
      first = most = static_cast<int>(std::min<int64_t>(requested_split_k, k_blocks));
    } else if (few_tiles || mid || last_wave) {  // the last of full waves: one round of pieces
      most = static_cast<int>(std::clamp<int64_t>(
          std::min<int64_t>(k_blocks / min_piece, last_wave ? sms / last : kMaxSplit), 1,
          kMaxSplit));
    }
    const double gain = requested_split_k > 1 ? 1.0 : few_tiles ? kFewTilesGain : kSplitGain;
    for (int pieces = std::max(first, 2); pieces <= most; ++pieces) {
      const GemmPlan p = plan_for(block_n, pieces);
      if (split.block_n == 0 || p.estimate_us * gain < split_cost) {
        split = p;
        split_cost = p.estimate_us * gain;
      }
    }
  }
  const GemmPlan whole = plan_for(whole_width, 1);
  if (split.block_n == 0) return whole;
  if (requested_split_k > 1) return split;
  return split_cost <= whole.estimate_us ? split : whole;
}

std::string GemmPlan::describe() const {
  char line[256];
  const int64_t split_tiles = tiles - whole_tiles;
  if (split_tiles > 0 && split_k > 1) {
    std::snprintf(line, sizeof(line),
                  "tiles 128x%dx64: %lld, %lld whole on %d CTAs, the last wave's %lld in %d "
                  "pieces of K each (%lld work items); model %.1f us",
                  block_n, static_cast<long long>(tiles), static_cast<long long>(whole_tiles), ctas,
                  static_cast<long long>(split_tiles), split_k,
                  static_cast<long long>(whole_tiles + split_tiles * split_k), estimate_us);
  } else {
    std::snprintf(line, sizeof(line), "tiles 128x%dx64: %lld on %d CTAs, K whole; model %.1f us",
                  block_n, static_cast<long long>(tiles), ctas, estimate_us);
  }
  return line;
}

}  // namespace mk
