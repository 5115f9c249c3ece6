// gemm()'s plan: the tiles (128 rows of M, or at decode sizes the tokens on the narrow side of
// swapped-operand tiles), their width and the split of the last wave, by a cost model of the H200.
//
// Fitted to bench_gemm's sweep of 2026-12-01 (docs/PERFORMANCE.md; 96 shapes x 4 widths): it
// ranks the widths within 0.5% of the best measured one (geomean), where the fixed efficiency
// table before it lost up to 64% at few tiles. The model, per width and split:
//   one k-block on a CTA = max(its wgmma, its A and B loads at the L2 rate the active CTAs share);
//   a CTA runs its full waves' k-blocks, then its piece of the last wave's;
//   the HBM floor: A + B + C at the rate that many CTAs pull (a CTA alone pulls a few tens of
//   GB/s: few tiles need split K to reach the HBM rate);
//   split K adds its partial sums (written and read in L2) and the counters' clearing.
// The swapped tiles (docs/design/gemm_decode.md) stream the weights: a k-block's wgmma shrinks
// with the tokens' width (a sixteenth of a 128 x 128 tile's at 8), so the same model makes them
// HBM-bound on B's bytes over min(HBM rate, CTAs x one CTA's rate); they split K wherever a wave
// is partial.
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
// Swapped tiles (not yet measured; bench_gemm --sweep times them against the 128-row tiles):
//   a CTA's ring holds 10-13 stages of 16 KB of weights (TileConfig: 8-32 tokens wide), against
//   4-8 stages of 8-32 KB at the 128-row widths, whose CTAs pulled 25-38 GB/s: assumed 40;
//   a piece's fp32 slice is 128 x width x 4 bytes (4 KB at 8 tokens) against 16 KB of weights a
//   k-block, so pieces may be shorter than the 128-row tiles' 16 k-blocks: 8 (half a ring) or more.
constexpr double kNarrowHbmPerCta = 40e9;
constexpr int kNarrowMinKBlocks = 8;

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

// One launch's tiles, for estimate(): `tiles` of 128 rows on the wgmma's A side (C's rows, or
// with swapped operands B's) by `width` on its N side, and the rows of the A side's box a k-block
// loads (the last tile-row loads only its rows: PlainGemm's a_rows).
struct TileShape {
  int64_t tiles;
  double box_rows;
  int width;
  double hbm_per_cta;
};

// 128 rows of M by block_n of N.
TileShape row_tiles(int64_t m, int64_t n, int block_n) {
  return {tile_count(m, n, block_n), static_cast<double>(std::min<int64_t>(m, 128)), block_n,
          hbm_per_cta(block_n)};
}

// Swapped: 128 rows of N by `width` tokens.
TileShape narrow_tiles(int64_t m, int64_t n, int width) {
  return {tile_count(n, m, width), static_cast<double>(std::min<int64_t>(n, 128)), width,
          kNarrowHbmPerCta};
}

Estimate estimate(const TileShape& shape, int64_t m, int64_t n, int64_t k, int pieces, int sms) {
  const int64_t tiles = shape.tiles;
  const int64_t k_blocks = (k + 63) / 64;
  const int64_t full_waves = tiles / sms, last = tiles % sms;
  if (last == 0) pieces = 1;
  const auto k_block_seconds = [&](int64_t active) {
    const double rate = std::min(kL2BytesPerCta, kL2Bytes / static_cast<double>(active));
    const double loads = (shape.box_rows + shape.width) * 128 / rate;
    const double wgmma = 128.0 * shape.width * 64 * 2 / kWgmmaFlopsPerSm;
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
  const double hbm = bytes / std::min(kHbmBytes, static_cast<double>(ctas) * shape.hbm_per_cta);
  double split = 0;
  if (pieces > 1) {
    split = kSplitSeconds +
            static_cast<double>(last * pieces) * shape.box_rows * shape.width * 4 * 2 / kL2Bytes;
  }
  return {std::max(compute, hbm) + split + kLaunchSeconds, tiles - last * (pieces > 1),
          static_cast<int>(ctas)};
}

// The plan of `shape` in `pieces` pieces of K.
GemmPlan make_plan(const TileShape& shape, int64_t m, int64_t n, int64_t k, int pieces, int sms,
                   bool swapped) {
  const Estimate e = estimate(shape, m, n, k, pieces, sms);
  GemmPlan p;
  p.block_n = shape.width;
  p.swapped = swapped;
  p.ctas = e.ctas;
  p.tiles = shape.tiles;
  p.whole_tiles = e.whole;
  p.split_k = p.whole_tiles < p.tiles ? pieces : 1;
  p.estimate_us = e.seconds * 1e6;
  return p;
}

// The best split so far: the least estimate times its required gain (block_n 0: none yet).
struct SplitChoice {
  GemmPlan plan;
  double cost = 0;

  // Splits of `shape` in [first, most] pieces (from 2), each at its estimate x gain.
  void consider(const TileShape& shape, int64_t m, int64_t n, int64_t k, int sms, bool swapped,
                int first, int most, double gain) {
    for (int pieces = std::max(first, 2); pieces <= most; ++pieces) {
      const GemmPlan p = make_plan(shape, m, n, k, pieces, sms, swapped);
      if (plan.block_n == 0 || p.estimate_us * gain < cost) {
        plan = p;
        cost = p.estimate_us * gain;
      }
    }
  }
  // The split or K whole: a requested split (requested_split_k > 1) wins, else the cheaper.
  GemmPlan against(const GemmPlan& whole, int requested_split_k) const {
    if (plan.block_n == 0) return whole;
    if (requested_split_k > 1) return plan;
    return cost <= whole.estimate_us ? plan : whole;
  }
};

// Swapped tiles (the tokens on the narrow side): K whole, or the last of at most
// kMaxWavesBeforeSplit full waves (or of none) in one round of pieces of kNarrowMinKBlocks or
// more, where the model expects kSplitGain; a requested split as asked.
GemmPlan plan_narrow(int64_t m, int64_t n, int64_t k, int sms, int requested_split_k) {
  const TileShape shape = narrow_tiles(m, n, gemm_engine::narrow_width(m));
  const GemmPlan whole = make_plan(shape, m, n, k, 1, sms, true);
  const int64_t full_waves = shape.tiles / sms, last = shape.tiles % sms;
  if (requested_split_k == 1 || last == 0) return whole;
  const int64_t k_blocks = (k + 63) / 64;
  int first = 2, most = 1;
  if (requested_split_k != 0) {
    first = most = static_cast<int>(std::min<int64_t>(requested_split_k, k_blocks));
  } else if (full_waves <= kMaxWavesBeforeSplit) {
    most = static_cast<int>(std::clamp<int64_t>(
        std::min<int64_t>(k_blocks / kNarrowMinKBlocks, sms / last), 1, kMaxSplit));
  }
  SplitChoice split;
  split.consider(shape, m, n, k, sms, true, first, most, requested_split_k > 1 ? 1.0 : kSplitGain);
  return split.against(whole, requested_split_k);
}

[[noreturn]] void invalid(const char* op, const std::string& what) {
  throw Error(ErrorCode::kInvalidArgument, std::string(op) + ": " + what);
}

}  // namespace

int gemm_engine::narrow_width(int64_t m) { return m <= 8 ? 8 : m <= 16 ? 16 : m <= 32 ? 32 : 64; }

GemmPlan gemm_engine::plan_gemm(int64_t m, int64_t n, int64_t k, BLayout b_layout,
                                const GemmConfig& config, const char* op) {
  const int sms = config.sms, requested_block_n = config.block_n;
  const int requested_split_k = config.split_k;
  if (requested_split_k < 0 || requested_split_k > kMaxSplit) {
    invalid(op, "split_k = " + std::to_string(requested_split_k) +
                    "; expected 0 (the library's choice) or 1.." + std::to_string(kMaxSplit));
  }
  if (sms < 1) invalid(op, "sms = " + std::to_string(sms) + "; expected >= 1");
  if (config.tiles != GemmTiles::kAuto && config.tiles != GemmTiles::kRows &&
      config.tiles != GemmTiles::kTokensNarrow) {
    invalid(op, "unknown tiles (GemmTiles) " + std::to_string(static_cast<int>(config.tiles)));
  }
  if (config.tiles == GemmTiles::kTokensNarrow) {
    if (b_layout != BLayout::kNK) {
      invalid(op,
              "tiles = kTokensNarrow needs B [N, K] (BLayout::kNK); B [K, N] computes in 128-row "
              "tiles");
    }
    if (requested_block_n != 0) {
      invalid(op, "block_n = " + std::to_string(requested_block_n) +
                      " is a width of 128-row tiles; with tiles = kTokensNarrow the width follows "
                      "M (leave block_n 0)");
    }
  }
  const bool narrow = config.tiles == GemmTiles::kTokensNarrow ||
                      (config.tiles == GemmTiles::kAuto && b_layout == BLayout::kNK &&
                       requested_block_n == 0 && m <= kMaxNarrowTokens);
  if (narrow) return plan_narrow(m, n, k, sms, requested_split_k);
  const int64_t k_blocks = (k + 63) / 64;
  // K whole: the width with the fewest estimated tile-waves (pick_block_n; it validates a
  // requested width).
  const int whole_width = pick_block_n(requested_block_n, m, n, sms, op);
  const GemmPlan whole = make_plan(row_tiles(m, n, whole_width), m, n, k, 1, sms, false);
  if (requested_split_k == 1) return whole;
  const int64_t whole_tiles = tile_count(m, n, whole_width);
  SplitChoice split;  // the best split, at any allowed width
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
    split.consider(row_tiles(m, n, block_n), m, n, k, sms, false, first, most,
                   requested_split_k > 1 ? 1.0
                   : few_tiles           ? kFewTilesGain
                                         : kSplitGain);
  }
  return split.against(whole, requested_split_k);
}

std::string GemmPlan::describe() const {
  char tiles_text[96];
  if (swapped) {
    std::snprintf(tiles_text, sizeof(tiles_text),
                  "tokens on the narrow side: 128 x %d tiles (N x M) of 64 of K", block_n);
  } else {
    std::snprintf(tiles_text, sizeof(tiles_text), "tiles 128x%dx64", block_n);
  }
  char line[320];
  const int64_t split_tiles = tiles - whole_tiles;
  if (split_tiles > 0 && split_k > 1) {
    std::snprintf(line, sizeof(line),
                  "%s: %lld, %lld whole on %d CTAs, the last wave's %lld in %d pieces of K each "
                  "(%lld work items); model %.1f us",
                  tiles_text, static_cast<long long>(tiles), static_cast<long long>(whole_tiles),
                  ctas, static_cast<long long>(split_tiles), split_k,
                  static_cast<long long>(whole_tiles + split_tiles * split_k), estimate_us);
  } else {
    std::snprintf(line, sizeof(line), "%s: %lld on %d CTAs, K whole; model %.1f us", tiles_text,
                  static_cast<long long>(tiles), ctas, estimate_us);
  }
  return line;
}

}  // namespace mk
