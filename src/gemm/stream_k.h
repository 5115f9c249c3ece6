// Stream-K's schedule for the plain GEMM (docs/design/gemm_decode.md, "Stream-K across CTAs"):
// which k-blocks of which tiles each persistent CTA runs, and who adds up a tile cut in pieces.
//
// The k-blocks of every tile form one sequence, tile by tile (iteration g = tile x k_iters + kb),
// cut into `ctas` contiguous ranges whose lengths differ by at most one - every CTA runs the
// same number of k-blocks, however few the tiles. A tile whose k-blocks fall in several ranges
// is computed in pieces; its owner is the CTA holding its last k-block, and stores it.
//
// Each CTA walks its range backward, its last tile first:
//   - its first work is the start of its highest tile, a piece it does not own unless the range
//     ends at that tile's end: it writes that partial sum first thing;
//   - its last work is the end of its lowest tile, which it owns: the lower CTAs holding that
//     tile's other k-blocks each wrote their piece as their own first work, long before.
// So a CTA writes at most one partial, an owner waits only for lower-numbered CTAs - which start
// no later than it does (a grid's CTAs are dispatched in order, which CUB's single-pass scan
// relies on too: a lower one is resident or done whenever a higher one runs, even where the grid
// has more CTAs than the GPU has SMs) - and it adds the pieces in CTA order: the same bits on
// every run.
#pragma once

#include <cstdint>

#include "mkernel/host_device.h"

namespace mk::gemm_engine {

// 1 <= ctas <= tiles x k_iters: every range holds at least one k-block (the plan runs no more
// CTAs than that), so a tile's pieces come from every CTA from its first to its owner.
struct StreamKSchedule {
  int64_t tiles = 0;
  int k_iters = 0;  // k-blocks a tile
  int ctas = 0;

  // A CTA's piece of work: k-blocks [kb_begin, kb_end) of a tile.
  struct Segment {
    int64_t tile = 0;
    int kb_begin = 0;
    int kb_end = 0;
    int first_cta = 0;   // the lowest CTA with k-blocks of this tile (this CTA: no piece below)
    bool owner = false;  // holds the tile's last k-block: adds the pieces of CTAs first_cta ..
                         // this one - 1 to its own and stores the tile
  };

  MK_HOST_DEVICE int64_t total() const { return tiles * k_iters; }
  // The first iteration of CTA c's range; range_begin(ctas) is the end.
  MK_HOST_DEVICE int64_t range_begin(int c) const { return total() * c / ctas; }
  // The CTA whose range holds iteration g (0 <= g < total()): the last c with range_begin(c) <= g.
  MK_HOST_DEVICE int cta_of(int64_t g) const {
    return static_cast<int>(((g + 1) * ctas + total() - 1) / total() - 1);
  }
  // Segments of CTA c: the tiles its range touches (0 for an empty range).
  MK_HOST_DEVICE int segments(int c) const {
    const int64_t lo = range_begin(c), hi = range_begin(c + 1);
    return lo < hi ? static_cast<int>((hi - 1) / k_iters - lo / k_iters + 1) : 0;
  }
  // The most segments a CTA has: a range of at most ceil(total / ctas) iterations touches at
  // most that many over k_iters, plus one, tiles.
  MK_HOST_DEVICE int max_segments() const {
    const int64_t longest = (total() + ctas - 1) / ctas;
    return static_cast<int>((longest + k_iters - 1) / k_iters + 1);
  }
  // CTA c's segment j (j < segments(c)) in the order it runs them: 0 is its range's last tile.
  MK_HOST_DEVICE Segment segment(int c, int j) const {
    const int64_t lo = range_begin(c), hi = range_begin(c + 1);
    Segment s;
    s.tile = (hi - 1) / k_iters - j;
    const int64_t first = s.tile * k_iters, end = first + k_iters;
    s.kb_begin = static_cast<int>((lo > first ? lo : first) - first);
    s.kb_end = static_cast<int>((hi < end ? hi : end) - first);
    s.owner = hi >= end;
    s.first_cta = cta_of(first);
    return s;
  }
};

}  // namespace mk::gemm_engine
