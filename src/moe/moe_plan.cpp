// The MoE ops' plan (moe_plan.h).
#include "moe/moe_plan.h"

#include <algorithm>
#include <cstdio>
#include <limits>
#include <string>

#include "mkernel/device_comm.h"
#include "mkernel/error.h"

namespace mk::moe {
namespace {

[[noreturn]] void invalid(const char* op, const std::string& what) {
  throw Error(ErrorCode::kInvalidArgument, std::string(op) + ": " + what);
}

uint64_t align(uint64_t bytes) { return (bytes + 255) / 256 * 256; }

}  // namespace

int Plan::chunks(int64_t tokens) const {
  return static_cast<int>(std::max<int64_t>(1, (tokens + chunk_tokens - 1) / chunk_tokens));
}

Plan plan_moe(int world, int sm_budget, const MoeProblem& p, const MoeConfig& config,
              const char* op, int nodes) {
  const auto str = [](int64_t v) { return std::to_string(v); };
  if (world < 1) invalid(op, "world size " + str(world) + "; expected >= 1");
  if (nodes < 1 || world % nodes != 0) {
    invalid(op, str(nodes) + " nodes for world size " + str(world) +
                    "; expected equal nodes (a divisor of the world size)");
  }
  if (nodes > 1 && world > kMoeMaxNodeRanks) {
    invalid(op, "world size " + str(world) + " across " + str(nodes) + " nodes; at most " +
                    str(kMoeMaxNodeRanks) + " ranks across nodes");
  }
  if (p.num_experts < 1 || p.num_experts > kMoeMaxExperts || p.num_experts % world != 0) {
    invalid(op, "num_experts = " + str(p.num_experts) + "; expected a multiple of the world size " +
                    str(world) + " in [1, " + str(kMoeMaxExperts) + "]");
  }
  if (p.top_k < 1 || p.top_k > kMoeMaxTopK) {
    invalid(op, "top_k = " + str(p.top_k) + "; expected 1.." + str(kMoeMaxTopK));
  }
  if (p.hidden < 8 || p.hidden % 8 != 0) {
    invalid(op, "hidden = " + str(p.hidden) + "; expected a positive multiple of 8 (16-byte rows)");
  }
  if (p.max_tokens < 1 || p.tokens < 0 || p.tokens > p.max_tokens) {
    invalid(op, "tokens = " + str(p.tokens) + ", max_tokens = " + str(p.max_tokens) +
                    "; expected 0 <= tokens <= max_tokens and max_tokens >= 1 (the same on every "
                    "rank: it sizes the workspace)");
  }
  if (p.layout != MoeLayout::kPadded && p.layout != MoeLayout::kMasked) {
    invalid(op, "layout " + str(static_cast<int>(p.layout)) + "; expected kPadded or kMasked");
  }
  if (p.capacity < 0)
    invalid(op, "capacity = " + str(p.capacity) + "; expected >= 0 (0: worst case)");
  if (config.sms < 0) invalid(op, "config.sms = " + str(config.sms) + "; expected >= 0");
  constexpr int64_t kMaxRows = std::numeric_limits<int32_t>::max();
  const int e_local = p.num_experts / world;
  // Bounded above so that every product below fits in 64 bits.
  if (p.max_tokens > kMaxRows / world || p.hidden > (int64_t{1} << 24)) {
    invalid(op, "max_tokens = " + str(p.max_tokens) + " x world " + str(world) +
                    " or hidden = " + str(p.hidden) + " too large (rows below 2^31, hidden 2^24)");
  }
  if (dispatch_smem_bytes(world, e_local) > kDispatchSmemMax) {
    invalid(op, "world size " + str(world) + " with " + str(p.num_experts) +
                    " experts: the routing tables exceed the dispatch's shared memory");
  }
  Plan plan;
  MoePlan& out = plan.plan;
  out.experts_local = e_local;
  out.layout = p.layout;
  const int64_t every_row = static_cast<int64_t>(world) * p.max_tokens * std::min(p.top_k, e_local);
  // (token, slot) pairs are int32 on the GPU: a rank's own pair index, the pairs bound for a rank.
  if (p.max_tokens * p.top_k > kMaxRows || every_row > kMaxRows) {
    invalid(op, "max_tokens = " + str(p.max_tokens) + " x top_k " + str(p.top_k) +
                    " or the pairs a rank may receive (" + str(every_row) +
                    ") exceed 2^31 - 1; give fewer max_tokens");
  }
  // (Before the products below: a capacity near 2^63 would wrap the masked layout's rows.)
  if (p.capacity > kMaxRows) {
    invalid(op, "capacity = " + str(p.capacity) + " exceeds 2^31 - 1 rows");
  }
  if (p.layout == MoeLayout::kPadded) {
    out.capacity = p.capacity > 0 ? p.capacity
                                  : every_row + static_cast<int64_t>(e_local) * (kMoeRowBlock - 1);
    out.rows = out.capacity;
  } else {
    out.capacity = p.capacity > 0 ? p.capacity : static_cast<int64_t>(world) * p.max_tokens;
    out.rows = out.capacity * e_local;
  }
  if (out.rows > kMaxRows || out.rows / std::max(e_local, 1) > kMaxRows) {
    invalid(op, "the layout's rows (" + str(out.rows) +
                    ") exceed 2^31 - 1; give a smaller "
                    "capacity or fewer max_tokens");
  }
  const int budget = std::max(1, std::min(sm_budget, kMaxChannels));
  out.ctas = config.sms > 0 ? std::min(config.sms, budget) : budget;

  plan.chunk_tokens =
      std::max<int64_t>(kMinChunkTokens, (p.max_tokens + kMaxChunks - 1) / kMaxChunks);
  plan.meta_ints = 1 + 2 * p.top_k;
  const uint64_t w = static_cast<uint64_t>(world), t = static_cast<uint64_t>(p.max_tokens);
  const uint64_t k = static_cast<uint64_t>(p.top_k), h = static_cast<uint64_t>(p.hidden);
  const uint64_t chunks = static_cast<uint64_t>(plan.chunks(p.max_tokens));
  Offsets& o = plan.offsets;
  uint64_t at = 0;
  const auto take = [&](uint64_t& field, uint64_t bytes) {
    field = at;
    at += align(bytes);
  };
  take(o.recv_meta, w * t * static_cast<uint64_t>(plan.meta_ints) * 4);
  take(o.recv_x, w * t * h * 2);
  take(o.comb_x, t * k * h * 2);
  take(o.comb_flag, t * k * 4);
  take(o.chunk_cnt, chunks * static_cast<uint64_t>(p.num_experts) * 4);
  take(o.chunk_dcnt, chunks * w * 4);
  take(o.pos, t * k * 4);
  take(o.send_list, w * t * 4);
  take(o.totals, (static_cast<uint64_t>(p.num_experts) + w + static_cast<uint64_t>(nodes)) * 4);
  take(o.by_local, t * k * 4);
  take(o.recv_order, w * t * k * 4);
  take(o.layout, static_cast<uint64_t>(layout_tables(world, e_local).ints) * 4);
  if (p.layout == MoeLayout::kMasked) {
    plan.blocks_per_expert = (out.capacity + kMoeRowBlock - 1) / kMoeRowBlock;
    plan.blocks = plan.blocks_per_expert * e_local;
  } else {
    plan.blocks = (out.rows + kMoeRowBlock - 1) / kMoeRowBlock;
  }
  take(o.counters, static_cast<uint64_t>(plan.blocks) * 8);
  take(o.row_src, static_cast<uint64_t>(out.rows) * 4);
  take(o.comb_count, t * static_cast<uint64_t>(comb_count_stride(p.hidden)) * 8);
  const uint64_t n = static_cast<uint64_t>(nodes);
  take(o.chunk_ncnt, chunks * n * 4);
  take(o.cross_list, n * t * 4);
  take(o.send_slot, t * k * 4);
  plan.nodes = nodes;
  if (nodes > 1) {
    CrossRegion& r = plan.cross;
    r.cross_ints = 1 + 3 * p.top_k;
    const uint64_t per_node = w / n;
    r.meta_at = align(per_node * (static_cast<uint64_t>(e_local) + 1) * 4 + 4);
    r.rows_at = r.meta_at + align(t * static_cast<uint64_t>(r.cross_ints) * 4);
    r.bytes = r.rows_at + align(t * h * 2);
    CombRegion& cr = plan.comb;
    cr.rows_at = align(t * k * 4);
    cr.bytes = cr.rows_at + align(t * k * h * 2);
    take(o.slot_route, t * k * 4);
    take(o.recv_cross, w * t * 4);
    take(o.row_cross, static_cast<uint64_t>(out.rows) * 4);
    take(o.relay_y, n * t * k * h * 2);
    take(o.relay_flag, n * t * k * 4);
    take(o.relay_rows, n * 4);
    take(o.xfer, 2 * n * (r.bytes + cr.bytes));
  }
  o.bytes = at;
  out.workspace_bytes = at;
  return plan;
}

}  // namespace mk::moe

namespace mk {
std::string MoePlan::describe() const {
  char line[256];
  std::snprintf(line, sizeof(line),
                "%s layout: %lld rows (%lld %s), %d local experts, %d CTAs, workspace %.1f MiB",
                layout == MoeLayout::kMasked ? "masked" : "padded", static_cast<long long>(rows),
                static_cast<long long>(capacity),
                layout == MoeLayout::kMasked ? "per local expert" : "in all", experts_local, ctas,
                static_cast<double>(workspace_bytes) / (1 << 20));
  return line;
}
}  // namespace mk
