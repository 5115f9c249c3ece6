// The side warps' walk over a rank's layout (moe_dispatch_gemm.cuh, MoeDispatchGemm's step 3):
// walk_expert / walk_source (src/moe/moe_walk.h, the code the kernel runs) over the tables as
// notify_kernel and the senders fill them (pre, from, before; by_local; recv_order written by each
// source at its `sent` prefix + the pair's position), on random routings - every row of the
// routing reference found at its walk index, in layout order, once; the rows past an expert's
// room met too (counted done at their source), and nothing else.
#include <gtest/gtest.h>

#include <cstdint>
#include <random>
#include <vector>

#include "moe/moe_plan.h"
#include "moe/moe_walk.h"
#include "moe_reference.h"

namespace mk::test {
namespace {

using moe::LayoutTables;

struct Case {
  int world, e_local, k;
  MoeRefLayout layout;
  int64_t room;  // padded: the layout's rows; masked: rows per local expert
  std::vector<std::vector<int64_t>> topk;
};

// Rank `me`'s walk against the reference's layout; returns the rows it placed.
int64_t walk_rank(const Case& c, const MoeRouting& ref, int me) {
  const int world = c.world, el_n = c.e_local, k = c.k, experts = world * el_n;
  // The pairs each source sends here, per local expert, in (token, slot) order: what the route
  // kernels count and number (pos) at the source.
  std::vector<std::vector<std::vector<std::pair<int, int>>>> pairs(
      world, std::vector<std::vector<std::pair<int, int>>>(el_n));
  for (int src = 0; src < world; ++src) {
    const int tokens = static_cast<int>(c.topk[src].size()) / k;
    for (int t = 0; t < tokens; ++t) {
      for (int j = 0; j < k; ++j) {
        const int64_t e = c.topk[src][static_cast<size_t>(t) * k + j];
        if (e >= 0 && e < experts && e / el_n == me) pairs[src][e % el_n].push_back({t, j});
      }
    }
  }
  // The tables notify_kernel writes (only the walk's: start, pre, row_count, before, from).
  const LayoutTables lt = moe::layout_tables(world, el_n);
  std::vector<int32_t> tables(static_cast<size_t>(lt.ints), -7);
  int32_t before = 0, next = 0;
  for (int e = 0; e < el_n; ++e) {
    int32_t total = 0;
    for (int src = 0; src < world; ++src) {
      tables[lt.pre + src * el_n + e] = total;
      total += static_cast<int32_t>(pairs[src][e].size());
    }
    const int64_t start = c.layout == MoeRefLayout::kMasked ? e * c.room : next;
    next += (total + 127) / 128 * 128;
    const int64_t held =
        c.layout == MoeRefLayout::kMasked ? c.room : std::max<int64_t>(0, c.room - start);
    tables[lt.start + e] = static_cast<int32_t>(start);
    tables[lt.row_count + e] = static_cast<int32_t>(std::min<int64_t>(total, held));
    tables[lt.before + e] = before;
    before += total;
  }
  tables[lt.before + el_n] = before;
  for (int src = 0; src < world; ++src) {
    int32_t sum = 0;
    for (int e = 0; e <= el_n; ++e) {
      tables[lt.from + src * (el_n + 1) + e] = sum;
      if (e < el_n) sum += static_cast<int32_t>(pairs[src][e].size());
    }
  }
  // by_local: this rank's own pairs in layout order (token x k + slot); recv_order: another
  // source's, as send slot x k + slot, where that source writes them (its own prefix over this
  // rank's experts - `from` here - plus the pair's position).
  std::vector<int32_t> by_local;
  for (int e = 0; e < el_n; ++e) {
    for (const auto& [t, j] : pairs[me][e]) by_local.push_back(t * k + j);
  }
  std::vector<std::vector<int32_t>> order(world);
  for (int src = 0; src < world; ++src) {
    if (src == me) continue;
    const std::vector<int32_t>& sent = ref.sent[src].tokens[me];
    std::vector<int32_t> slot_of(c.topk[src].size() / k + 1, -1);
    for (size_t s = 0; s < sent.size(); ++s) slot_of[sent[s]] = static_cast<int32_t>(s);
    order[src].assign(static_cast<size_t>(tables[lt.from + src * (el_n + 1) + el_n]), -1);
    for (int e = 0; e < el_n; ++e) {
      for (size_t pos = 0; pos < pairs[src][e].size(); ++pos) {
        const auto& [t, j] = pairs[src][e][pos];
        EXPECT_GE(slot_of[t], 0) << "a token sent here has a send slot";
        order[src][tables[lt.from + src * (el_n + 1) + e] + pos] = slot_of[t] * k + j;
      }
    }
  }
  // The walk.
  const MoeReceived& r = ref.received[me];
  int64_t placed = 0, dropped = 0, last_row = -1;
  for (int q = 0; q < before; ++q) {
    const int e = moe::walk_expert(tables.data() + lt.before, el_n, q);
    const int at = q - tables[lt.before + e];
    EXPECT_GE(at, 0);
    EXPECT_LT(at, r.expert_rows[e]) << "q " << q << " past expert " << e << "'s rows";
    const moe::WalkSource w = moe::walk_source(tables.data(), lt, world, el_n, e, at);
    MoeRow row;
    if (w.src == me) {
      const int32_t p = by_local.at(static_cast<size_t>(w.index));
      row = {me, p / k, p % k};
    } else {
      const int32_t v = order.at(w.src).at(static_cast<size_t>(w.index));
      row = {w.src, ref.sent[w.src].tokens[me].at(static_cast<size_t>(v / k)), v % k};
    }
    if (at < tables[lt.row_count + e]) {
      const int64_t at_row = tables[lt.start + e] + at;
      EXPECT_EQ(row, r.rows.at(static_cast<size_t>(at_row)))
          << "rank " << me << " expert " << e << " row " << at;
      EXPECT_GT(at_row, last_row) << "layout order";
      last_row = at_row;
      ++placed;
    } else {  // past the room: the reference lists the expert as overflowed
      EXPECT_NE(std::find(r.overflowed.begin(), r.overflowed.end(), e), r.overflowed.end());
      EXPECT_EQ(row.src, w.src);
      ++dropped;
    }
  }
  int64_t want = 0;
  for (const MoeRow& row : r.rows) want += row.src >= 0;
  EXPECT_EQ(placed, want) << "rank " << me;
  int64_t bound = 0;
  for (int32_t n : r.expert_rows) bound += n;
  EXPECT_EQ(placed + dropped, bound);
  return placed;
}

TEST(MoeWalk, EveryRowAtItsWalkIndexInLayoutOrder) {
  std::mt19937_64 gen(20261203);
  int64_t walked = 0;
  for (int trial = 0; trial < 300; ++trial) {
    Case c;
    c.world = 1 + static_cast<int>(gen() % 8);
    c.e_local =
        1 + static_cast<int>(gen() % (trial % 3 == 0 ? 40 : 6));  // deep binary searches too
    const int experts = c.world * c.e_local;
    c.k = 1 + static_cast<int>(gen() % std::min(8, experts));
    c.topk.resize(c.world);
    int64_t max_tokens = 0;
    const int hot = static_cast<int>(gen() % experts);  // skew: some experts get most rows
    for (auto& t : c.topk) {
      const int tokens = static_cast<int>(gen() % 48);
      max_tokens = std::max<int64_t>(max_tokens, tokens);
      for (int i = 0; i < tokens * c.k; ++i) {
        const uint64_t u = gen() % 10;
        t.push_back(u == 0 ? -1 : u < 4 ? hot : static_cast<int64_t>(gen() % experts));
      }
    }
    c.layout = trial % 2 == 0 ? MoeRefLayout::kPadded : MoeRefLayout::kMasked;
    const int64_t worst = c.layout == MoeRefLayout::kPadded
                              ? c.world * max_tokens * c.k + c.e_local * 127
                              : c.world * max_tokens;
    // Every third case a room that some experts overflow.
    c.room = trial % 3 == 1 ? std::max<int64_t>(1, worst / (2 + static_cast<int64_t>(gen() % 6)))
                            : std::max<int64_t>(1, worst);
    const MoeRouting ref = moe_route_reference(c.topk, c.k, experts, c.layout, c.room);
    for (int me = 0; me < c.world; ++me) walked += walk_rank(c, ref, me);
    if (HasFailure()) {
      ADD_FAILURE() << "trial " << trial << ": world " << c.world << ", E_local " << c.e_local
                    << ", k " << c.k << ", room " << c.room;
      return;
    }
  }
  EXPECT_GT(walked, 10000);
}

}  // namespace
}  // namespace mk::test
