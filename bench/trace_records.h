// The fused kernels' timeline records (src/fused/trace_layout.h) as the readers use them: every
// CTA's lanes, times in microseconds since the launch's first record.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <vector>

#include "fused/trace_layout.h"

namespace mk::bench {

struct TraceRecord {
  double us;  // since the launch's first record
  uint32_t event, arg;
};

using TraceLane = std::vector<TraceRecord>;  // one lane of one CTA, in order

struct Timeline {
  std::vector<std::vector<TraceLane>> lanes;  // [CTA][lane]
  double span = 0;                            // the last record's time
  int full_lanes = 0;  // lanes whose kTraceWordsPerLane are all used (later records dropped)
};

// `raw` as fused::trace_read returns it for `ctas` CTAs; every record also goes to `csv` (when not
// null) as "rank,cta,lane,us,event,arg".
inline Timeline read_timeline(const std::vector<uint64_t>& raw, int ctas, int rank = 0,
                              FILE* csv = nullptr) {
  using namespace mk::fused;
  uint64_t t0 = ~0ull;
  for (std::size_t i = 0; i + 1 < raw.size(); i += 2) {
    if (raw[i] != 0) t0 = std::min(t0, raw[i]);
  }
  Timeline t;
  t.lanes.assign(ctas, std::vector<TraceLane>(kTraceLanes));
  for (int c = 0; c < ctas; ++c) {
    for (int l = 0; l < kTraceLanes; ++l) {
      const uint64_t* row =
          raw.data() + (static_cast<std::size_t>(c) * kTraceLanes + l) * kTraceWordsPerLane;
      int r = 0;
      for (; 2 * r + 1 < kTraceWordsPerLane && row[2 * r] != 0; ++r) {
        const TraceRecord rec{(row[2 * r] - t0) / 1e3, static_cast<uint32_t>(row[2 * r + 1] & 0xff),
                              static_cast<uint32_t>(row[2 * r + 1] >> 8)};
        t.lanes[c][l].push_back(rec);
        t.span = std::max(t.span, rec.us);
        if (csv != nullptr) {
          std::fprintf(csv, "%d,%d,%d,%.3f,%u,%u\n", rank, c, l, rec.us, rec.event, rec.arg);
        }
      }
      if (2 * r + 2 > kTraceWordsPerLane) ++t.full_lanes;
    }
  }
  return t;
}

// The timelines' summaries cut a launch into kTraceBins equal bins of its span.
constexpr int kTraceBins = 10;

// Adds the part of [a, b) that falls in each bin of [0, span) to bins[] (kTraceBins of them).
inline void bin_add(std::vector<double>& bins, double a, double b, double span) {
  for (int i = 0; i < kTraceBins; ++i) {
    const double lo = span * i / kTraceBins, hi = span * (i + 1) / kTraceBins;
    const double overlap = std::min(b, hi) - std::max(a, lo);
    if (overlap > 0) bins[i] += overlap;
  }
}

}  // namespace mk::bench
