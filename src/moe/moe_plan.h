// Internal: the MoE ops' plan - sizes checked, the layout's rows, the CTAs, the workspace laid out
// (a pure host function of the problem, the world size and the SM budget:
// tests/cpu/test_moe_plan.cpp).
#pragma once

#include <cstdint>

#include "mkernel/moe.h"

namespace mk::moe {

// Byte offsets in the workspace (each 256-byte aligned), and its size.
struct Offsets {
  uint64_t recv_meta = 0;   // int32 [world][max_tokens][meta_ints]
  uint64_t recv_x = 0;      // bf16 [world][max_tokens][hidden]
  uint64_t comb_x = 0;      // bf16 [max_tokens][top_k][hidden]
  uint64_t comb_flag = 0;   // uint32 [max_tokens][top_k]
  uint64_t chunk_cnt = 0;   // int32 [max_chunks][experts]
  uint64_t chunk_dcnt = 0;  // int32 [max_chunks][world]
  uint64_t pos = 0;         // int32 [max_tokens][top_k]
  uint64_t send_list = 0;   // int32 [world][max_tokens]
  uint64_t totals = 0;      // int32 [experts + world]
  uint64_t bytes = 0;
};

// Shared memory of the dispatch kernel: [world][E_local + 1] counts (then prefixes over
// sources), [E_local] totals, [E_local + 1] starts; and the most any plan may ask for (the
// kernel's limit is raised to it once, when a communicator loads it).
constexpr int64_t dispatch_smem_bytes(int world, int experts_local) {
  return 4 * (static_cast<int64_t>(world) * (experts_local + 1) + 2 * experts_local + 1);
}
constexpr int64_t kDispatchSmemMax = dispatch_smem_bytes(1, kMoeMaxExperts) + 4 * 160;

constexpr int64_t kMinChunkTokens = 64;  // tokens per route chunk, at least
constexpr int kMaxChunks = 128;          // route chunks (CTAs), at most

struct Plan {
  MoePlan plan;
  Offsets offsets;
  int64_t chunk_tokens = 0;  // route chunks of this many tokens
  int meta_ints = 0;         // per received row: token, then (local expert, position) per slot
  // Route chunks for `tokens` of this rank (at least 1: the last chunk writes the totals).
  int chunks(int64_t tokens) const;
};

// Throws mk::Error(kInvalidArgument) naming `op` and what is wrong with the problem or config.
Plan plan_moe(int world, int sm_budget, const MoeProblem& problem, const MoeConfig& config,
              const char* op);

}  // namespace mk::moe
