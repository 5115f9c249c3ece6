// The side warps' walk over a rank's layout in order (moe_dispatch_gemm.cuh, MoeDispatchGemm's
// step 3) as host / device functions of the layout tables (moe_plan.h, LayoutTables): which
// expert, source rank and index among that source's rows a walk index stands for. The CPU test
// (tests/cpu/test_moe_walk.cpp) walks random routings with them against the routing reference.
#pragma once

#include <cstdint>

#include "gemm/prefix_search.h"
#include "mkernel/host_device.h"
#include "moe/moe_plan.h"

namespace mk::moe {

// The local expert whose rows hold walk index q (the rows bound here, in layout order): the last
// e with before[e] <= q (an empty expert shares its entry with the next). before: [E_local + 1].
MK_HOST_DEVICE inline int walk_expert(const int32_t* before, int experts_local, int q) {
  return last_at_or_below(before, experts_local, q);
}

// Row `at` of local expert e (counted from the expert's first row, fitting or not): its source
// rank and its index among that source's rows bound here in layout order - by_local's index for
// this rank's own rows, recv_order's in the source's region for another's (the tables' pre and
// from).
struct WalkSource {
  int src, index;
};
MK_HOST_DEVICE inline WalkSource walk_source(const int32_t* tables, const LayoutTables& lt,
                                             int world, int experts_local, int e, int at) {
  const int el_n = experts_local;
  int src = world - 1;  // the last source whose rows start at or before `at`
  while (src > 0 && tables[lt.pre + src * el_n + e] > at) --src;
  return {src, tables[lt.from + src * (el_n + 1) + e] + at - tables[lt.pre + src * el_n + e]};
}

}  // namespace mk::moe
