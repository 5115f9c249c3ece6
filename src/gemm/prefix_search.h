// Which segment of a prefix table an index falls in (host and device): the grouped GEMM's tile ->
// group, the MoE placement's walk index -> local expert.
#pragma once

#include <cstdint>

#include "mkernel/host_device.h"

namespace mk {

// The last i in [0, n) with prefix[i] x scale <= q (prefix ascending, prefix[0] x scale <= q): a
// segment with no entries shares its prefix with the next and is never the answer.
MK_HOST_DEVICE inline int last_at_or_below(const int32_t* prefix, int n, int q, int scale = 1) {
  int lo = 0, hi = n - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (prefix[mid] * scale <= q) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return lo;
}

}  // namespace mk
