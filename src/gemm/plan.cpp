// gemm()'s plan by a cost model of the H200: the width and the split of the last wave, and the
// tile height where a rule leaves two (below).
//
// The model, per width and split:
//   one k-block on a CTA = max(its wgmma, its A and B loads at the L2 rate the active CTAs share);
//   a CTA runs its full waves' k-blocks, then its piece of the last wave's;
//   the HBM floor: A + B + C at the rate that many CTAs pull (a CTA alone pulls a few tens of
//   GB/s: few tiles need split K to reach the HBM rate);
//   split K (a tile's pieces one cluster) adds the cluster's barriers and each CTA's share of
//   the sum, pushed into the owners' shared memory.
//   the wgmma rate of a width: a narrower wgmma reads more shared memory per flop (64 wide:
//   0.77 of 256's, 128: 0.95, 192: 0.97).
// Its constants are fitted to bench_gemm --candidates of 2026-12-03 (docs/PERFORMANCE.md; the
// data and the fit: bench/data/gemm_candidates-h200.csv, scripts/fit_gemm_plan.py): every
// distinct plan of 84 shapes - M 1-2048 on the sweep's six (N, K), heights 64/128/192, widths,
// 1-8 pieces - timed side by side, about 1,900 launches. The fit chose the constants whose plans
// lose least against the fastest option measured on each shape (geomean 0.5% over it, against
// 1.4% with the constants before), with a weak pull toward predicting the times themselves (rms
// error 26% -> 12.5%).
// Where the estimates of two splits of one width tie (both at the HBM rate), fewer pieces win:
// measured faster (64 x 2048 x 7168: 4 pieces 13.2 us, 6 pieces 14.2).
// The widths in steps of 16 (kStepWidths; 128-row tiles, K whole; B [K, N] kKnStepWidths) are
// weighed by the same model, their wgmma rate interpolated; one replaces the four widths'
// K-whole plan only where the model finds it kStepGain faster.
// 64-row tiles past M 64 (K whole, up to kShortTilesMaxM) are weighed against the 128- and
// 192-row plans, their wgmma rate kShortTileRate of the taller tiles' (one consumer warpgroup):
// chosen 2026-12-07 on the H100's candidates (bench/data/gemm_candidates-h100.csv, 74 shapes with
// 64-row tiles timed up to M 1024) - one constant, the others kept. (A refit of all of them on
// both cards' data lost 0.5% there instead of 0.9%, but moved most constants far - a CTA's L2
// rate 110 -> 166 GB/s, the split's peer bytes 26 -> 12 GB/s, 192 wide above 256's rate - on
// H200 data with no 64-row tiles past M 128 to check them against: not taken.) The plans lose
// 0.7% against the fastest candidate there (1.8% before); the 14 sweep points (both layouts)
// whose plan changed at 0.85 ran 3-14% faster on the H100 (docs/PERFORMANCE.md, 2026-12-07), and
// 0.86 (the scores of 256 x 4096 x 14336 were a near-tie: 54.29 against 54.26) moved that shape
// alone, of the sweep's and both cards' candidates', to 64 x 128 whole: 0.81-0.85x its time.
#include <algorithm>
#include <cstdio>
#include <string>

#include "gemm/gemm_internal.h"
#include "mkernel/error.h"

namespace mk {
namespace {

using gemm_engine::ClusterCtas;
using gemm_engine::kMaxSplit;

constexpr double kWgmmaFlopsPerSm = 5.5e12;  // bf16 dense, one SM, at 256-wide tiles
constexpr double kL2Bytes = 15e12;           // L2 to SMs, all CTAs together
constexpr double kL2BytesPerCta = 110e9;     // one CTA's loads at most
constexpr double kHbmBytes = 3.75e12;        // HBM, all CTAs together
constexpr double kLaunchSeconds = 1.4e-6;
// Split K (its pieces one cluster): the fixed cost over K whole, then each CTA's share of the
// sum - the tile's rows x width x 4 bytes over the pieces' shared memory.
constexpr double kClusterSeconds = 2.8e-6;
constexpr double kPeerBytesPerCta = 26e9;
// The library's own splits: where the last wave (or the only one) leaves at least half of the
// SMs idle, after at most kMaxWavesBeforeSplit full waves, in pieces of kMinKBlocks or more, by
// kSplitGain over K whole at least.
constexpr int kMinKBlocks = 8;
constexpr int64_t kMaxWavesBeforeSplit = 3;
constexpr double kSplitGain = 1.05;
constexpr double kStepGain = 1.05;
// 64-row tiles (one consumer warpgroup) past M 64: their wgmma rate against the taller tiles' at
// the same width (at M <= 64, where only 64-row plans are weighed, the rates fitted there stand),
// and the M up to which they are weighed against them (K whole).
constexpr double kShortTileRate = 0.86;
constexpr int64_t kShortTilesMaxM = 512;

// HBM bytes per second one CTA pulls with its ring of stages: the 64-wide tile's stages hold
// half the bytes of the wider ones'. (The step widths below 128, between the two: interpolated.)
double hbm_per_cta(int block_n) {
  return block_n >= 128 ? 72e9 : 35e9 + (72e9 - 35e9) * (block_n - 64) / 64.0;
}

// The wgmma rate of a width against 256 (a narrower wgmma reads more shared memory per flop):
// measured at the multiples of 64; a width between two of them (kStepWidths) interpolated
// linearly in 1 / width - the shared-memory bytes per flop of its B operand - not measured yet.
double wgmma_efficiency(int block_n) {
  constexpr int kWidths[] = {64, 128, 192, 256};
  constexpr double kMeasured[] = {0.77, 0.95, 0.97, 1.0};
  if (block_n <= kWidths[0]) return kMeasured[0];
  for (int i = 1; i < 4; ++i) {
    if (block_n <= kWidths[i]) {
      const double lo = 1.0 / kWidths[i - 1], hi = 1.0 / kWidths[i];
      const double t = (lo - 1.0 / block_n) / (lo - hi);
      return kMeasured[i - 1] + t * (kMeasured[i] - kMeasured[i - 1]);
    }
  }
  return kMeasured[3];
}

int64_t tile_count(int64_t m, int64_t n, int block_m, int block_n) {
  return (m + block_m - 1) / block_m * ((n + block_n - 1) / block_n);
}

// A plan's shape: CTAs, whole tiles and pieces (split 1: K whole).
struct Shape {
  int ctas;
  int64_t whole;
  int pieces;
};

// The launch split K in `pieces` needs: the full waves on every CTA of the clusters, then the
// last wave's tiles in one round of clusters. Nothing (ctas 0) where that is not possible.
Shape split_shape(int64_t tiles, int64_t k_blocks, int pieces, const ClusterCtas& clusters) {
  const int ctas = clusters[pieces];
  if (pieces < 2 || pieces > k_blocks || ctas < pieces) return {0, 0, 0};
  const int64_t last = tiles % ctas;
  if (last == 0 || last * pieces > ctas) return {0, 0, 0};
  const bool full_waves = tiles >= ctas;
  return {full_waves ? ctas : static_cast<int>(last * pieces), tiles - last, pieces};
}

double estimate_seconds(int64_t m, int64_t n, int64_t k, int block_m, int block_n,
                        const Shape& shape) {
  const int64_t tiles = tile_count(m, n, block_m, block_n);
  const int64_t k_blocks = (k + 63) / 64;
  const double a_rows = static_cast<double>(std::min<int64_t>(m, block_m));
  const auto k_block_seconds = [&](int64_t active) {
    const double rate = std::min(kL2BytesPerCta, kL2Bytes / static_cast<double>(active));
    const double loads = (a_rows + block_n) * 128 / rate;
    const double wgmma = static_cast<double>(block_m) * block_n * 64 * 2 /
                         (kWgmmaFlopsPerSm * wgmma_efficiency(block_n) *
                          (block_m == 64 && m > 64 ? kShortTileRate : 1.0));
    return std::max(loads, wgmma);
  };
  const int64_t rounds = shape.whole / shape.ctas;  // whole tiles: all K, a round at a time
  double compute = static_cast<double>(rounds * k_blocks) * k_block_seconds(shape.ctas);
  double split = 0;
  if (shape.pieces > 1) {  // one round of pieces
    const int64_t items = (tiles - shape.whole) * shape.pieces;
    compute +=
        static_cast<double>((k_blocks + shape.pieces - 1) / shape.pieces) * k_block_seconds(items);
    split = kClusterSeconds + a_rows * block_n * 4 / kPeerBytesPerCta;
  } else if (tiles % shape.ctas != 0) {  // K whole: a last, partial round
    compute += static_cast<double>(k_blocks) * k_block_seconds(tiles % shape.ctas);
  }
  const double bytes = 2.0 * static_cast<double>(m * k + n * k + m * n);
  const double hbm =
      bytes / std::min(kHbmBytes, static_cast<double>(shape.ctas) * hbm_per_cta(block_n));
  return std::max(compute, hbm) + split + kLaunchSeconds;
}

}  // namespace

ClusterCtas gemm_engine::even_clusters(int sms) {
  ClusterCtas out{};
  for (int p = 0; p <= kMaxSplit; ++p) out[p] = p < 2 ? sms : sms / p * p;
  return out;
}

GemmPlan gemm_engine::plan_gemm(int64_t m, int64_t n, int64_t k, BLayout b_layout, int sms,
                                int requested_block_m, int requested_block_n, int requested_split_k,
                                const char* op, const ClusterCtas& clusters, bool step_widths) {
  if (requested_block_m != 0 && requested_block_m != 64 && requested_block_m != 128 &&
      requested_block_m != 192) {
    throw Error(ErrorCode::kInvalidArgument,
                std::string(op) + ": block_m = " + std::to_string(requested_block_m) +
                    "; expected 0 (the library's choice), 64, 128 or 192");
  }
  if (requested_block_m == 192 && requested_block_n != 0 && requested_block_n != 64 &&
      requested_block_n != 128) {
    throw Error(
        ErrorCode::kInvalidArgument,
        std::string(op) + ": block_m = 192 with block_n = " + std::to_string(requested_block_n) +
            "; 192-row tiles are 64 or 128 wide (three consumers' accumulators; the width is "
            "GemmConfig::block_n, or MKERNEL_GEMM_BLOCK_N where that is 0)");
  }
  const bool step_asked = is_step_width(requested_block_n);
  if (requested_block_n != 0 && !step_asked && requested_block_n % 64 != 0) {
    throw Error(ErrorCode::kInvalidArgument,
                std::string(op) + ": block_n = " + std::to_string(requested_block_n) +
                    "; expected 0 (the library's choice), 64, 128, 192 or 256, or with "
                    "128-row tiles 80, 96, 112, 144, 160 or 224 (B [K, N]: 96, 144, 160, 224)");
  }
  const bool step_layout_ok = b_layout == BLayout::kNK || is_kn_step_width(requested_block_n);
  if (step_asked && (!step_layout_ok || (requested_block_m != 0 && requested_block_m != 128) ||
                     requested_split_k > 1)) {
    throw Error(ErrorCode::kInvalidArgument,
                std::string(op) + ": block_n = " + std::to_string(requested_block_n) +
                    " takes 128-row tiles and K whole, and B [N, K] where it is 80 or 112 (the "
                    "widths between 64, 128, 192 and 256 in steps of 16); asked with " +
                    (!step_layout_ok         ? std::string("B [K, N]")
                     : requested_split_k > 1 ? "split_k = " + std::to_string(requested_split_k)
                                             : "block_m = " + std::to_string(requested_block_m)));
  }
  if (requested_split_k < 0 || requested_split_k > kMaxSplit) {
    throw Error(ErrorCode::kInvalidArgument,
                std::string(op) + ": split_k = " + std::to_string(requested_split_k) +
                    "; expected 0 (the library's choice) or 1.." + std::to_string(kMaxSplit));
  }
  if (sms < 1) {
    throw Error(ErrorCode::kInvalidArgument,
                std::string(op) + ": sms = " + std::to_string(sms) + "; expected >= 1");
  }
  ClusterCtas fit = gemm_engine::even_clusters(sms);  // the clusters' CTAs within the SMs allowed
  for (int p = 2; p <= kMaxSplit; ++p) fit[p] = std::min(fit[p], clusters[p]);
  const int64_t k_blocks = (k + 63) / 64;
  const auto plan_for = [&](int block_m, int block_n, const Shape& shape) {
    GemmPlan p;
    p.block_m = block_m;
    p.block_n = block_n;
    p.ctas = shape.ctas;
    p.tiles = tile_count(m, n, block_m, block_n);
    p.whole_tiles = shape.whole;
    p.split_k = shape.pieces;
    p.estimate_us = estimate_seconds(m, n, k, block_m, block_n, shape) * 1e6;
    return p;
  };
  const auto k_whole = [&](int block_m, int block_n) {
    const int64_t tiles = tile_count(m, n, block_m, block_n);
    return plan_for(block_m, block_n, {static_cast<int>(std::min<int64_t>(sms, tiles)), tiles, 1});
  };
  // The best plan at one tile height, and the estimate it was chosen by (a split's times
  // kSplitGain, a step width's times kStepGain: the library takes either only for a clear gain -
  // over the other heights too).
  struct Choice {
    GemmPlan plan;
    double score;
  };
  const auto best_at = [&](int block_m, bool whole_only = false) -> Choice {
    const bool tall = block_m == 192;
    // The widths allowed: any at 64 and 128 rows, 64 and 128 at 192.
    const auto allowed = [&](int block_n) {
      if (requested_block_n != 0 && block_n != requested_block_n) return false;
      return !tall || block_n == 64 || block_n == 128;
    };
    // K whole: 64- and 128-row tiles of the width with the fewest estimated tile-waves
    // (pick_block_n; it validates a requested width); 192-row ones of the width the model
    // prefers.
    GemmPlan whole;
    if (tall) {
      for (int block_n : {128, 64}) {
        if (!allowed(block_n)) continue;
        const GemmPlan p = k_whole(192, block_n);
        if (whole.block_n == 0 || p.estimate_us < whole.estimate_us) whole = p;
      }
    } else if (step_asked) {
      whole = k_whole(block_m, requested_block_n);
    } else {
      whole = k_whole(block_m, pick_block_n(requested_block_n, m, n, sms, op, block_m));
      if (block_m == 128 && step_widths && requested_block_n == 0 && requested_split_k <= 1) {
        GemmPlan step;  // the best step width, taken where it is clearly better
        for (int block_n : kStepWidths) {
          if (b_layout == BLayout::kKN && !is_kn_step_width(block_n)) continue;
          const GemmPlan p = k_whole(block_m, block_n);
          if (step.block_n == 0 || p.estimate_us < step.estimate_us) step = p;
        }
        if (step.estimate_us * kStepGain < whole.estimate_us) whole = step;
      }
    }
    const double whole_score =
        whole.estimate_us * (is_step_width(whole.block_n) && !step_asked ? kStepGain : 1.0);
    if (requested_split_k == 1 || whole_only) return {whole, whole_score};
    GemmPlan split;  // the best split at any allowed width
    for (int block_n : {256, 192, 128, 64}) {
      if (!allowed(block_n)) continue;
      const int64_t tiles = tile_count(m, n, block_m, block_n);
      for (int pieces = kMaxSplit; pieces >= 2; --pieces) {
        if (requested_split_k > 1 && pieces > requested_split_k) continue;
        const Shape shape = split_shape(tiles, k_blocks, pieces, fit);
        if (shape.ctas == 0) continue;
        if (requested_split_k == 0) {  // the library's rule
          const int64_t last = tiles - shape.whole;
          if (last * 2 > fit[pieces] || tiles / fit[pieces] > kMaxWavesBeforeSplit ||
              k_blocks / pieces < kMinKBlocks) {
            continue;
          }
        }
        const GemmPlan p = plan_for(block_m, block_n, shape);
        // Ties (both at the HBM rate) go to the later: fewer pieces.
        if (split.block_n == 0 || p.estimate_us <= split.estimate_us) split = p;
        if (requested_split_k > 1) break;  // the most pieces that fit, at this width
      }
    }
    if (split.block_n == 0) return {whole, whole_score};
    if (requested_split_k > 1) return {split, split.estimate_us};
    const double split_score = split.estimate_us * kSplitGain;
    return split_score <= whole_score ? Choice{split, split_score} : Choice{whole, whole_score};
  };
  // The tile height: as asked; else 64 rows (one consumer warpgroup) for M <= 64 - no tensor
  // work on rows outside C, and half the A bytes of a stage, so more of B (the weights) in
  // flight; for M 129..192 the model's choice of one tile-row of 192 (a third less tensor work
  // than two of 128, the second mostly empty; measured 2026-12-02 at M = 192 on the six (N, K)
  // of the sweep: 0-43% faster than the best 128-row plan on 5 of 6) and 128-row tiles (the
  // sixth, 192 x 2048 x 7168: 128 x 64 tiles in 2 pieces, 18.1 us against 20.6-21.8 at 192 rows,
  // 2026-12-03); elsewhere 128, whose padding is no larger and whose widths reach 256.
  if (requested_block_m != 0) return best_at(requested_block_m).plan;
  if (step_asked) return best_at(128).plan;
  if (m <= 64) return best_at(64).plan;
  // Past M 64 the heights weighed: 192 (M 129..192, a width of 64 or 128), 128, and 64 rows with
  // K whole up to kShortTilesMaxM; the lowest score wins, ties to the earlier.
  const bool tall_fits =
      requested_block_n == 0 || requested_block_n == 64 || requested_block_n == 128;
  Choice choices[3];
  int count = 0;
  if (m > 128 && m <= 192 && tall_fits) choices[count++] = best_at(192);
  choices[count++] = best_at(128);
  if (m <= kShortTilesMaxM && requested_split_k <= 1) choices[count++] = best_at(64, true);
  // A split asked for: the heights that split, where some do.
  const bool any_split =
      std::any_of(choices, choices + count, [](const Choice& c) { return c.plan.split_k > 1; });
  const Choice* best = nullptr;
  for (int i = 0; i < count; ++i) {
    if (requested_split_k > 1 && any_split && choices[i].plan.split_k == 1) continue;
    if (best == nullptr || choices[i].score < best->score) best = &choices[i];
  }
  return best->plan;
}

std::string GemmPlan::describe() const {
  char line[256];
  const int64_t split_tiles = tiles - whole_tiles;
  if (split_tiles > 0 && split_k > 1) {
    std::snprintf(line, sizeof(line),
                  "tiles %dx%dx64: %lld, %lld whole on %d CTAs, the last wave's %lld in %d "
                  "pieces of K each, a cluster of %d CTAs a tile; model %.1f us",
                  block_m, block_n, static_cast<long long>(tiles),
                  static_cast<long long>(whole_tiles), ctas, static_cast<long long>(split_tiles),
                  split_k, split_k, estimate_us);
  } else {
    std::snprintf(line, sizeof(line), "tiles %dx%dx64: %lld on %d CTAs, K whole; model %.1f us",
                  block_m, block_n, static_cast<long long>(tiles), ctas, estimate_us);
  }
  return line;
}

}  // namespace mk
