// The MoE routing contract on the CPU (docs/design/moe.md): where every routed row lands, what
// travels, and the combine's sum. Test-only. The CPU tests hold it against hand-worked cases;
// the GPU tests of moe_dispatch / moe_combine compare the kernels with it exactly.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace mk::test {

enum class MoeRefLayout { kPadded, kMasked };

constexpr int64_t kMoeRowBlock = 128;  // the grouped GEMM's row block (padded layout)

// One (source rank, token, slot) pair: a row of a receiving rank's layout.
struct MoeRow {
  int32_t src = -1;  // -1: padding, or a masked block's rows past its count
  int32_t token = -1;
  int32_t slot = -1;
  bool operator==(const MoeRow&) const = default;
};

// What one rank receives.
struct MoeReceived {
  std::vector<int32_t> expert_rows;   // [E_local] rows routed to each local expert (all of them)
  std::vector<int64_t> expert_start;  // [E_local] first row of each local expert in the layout
  std::vector<MoeRow> rows;           // the layout's rows (padded: up to `room`; masked:
                                      // E_local x capacity)
  std::vector<int32_t> overflowed;    // local experts with rows that did not fit, ascending
};

// What one source rank sends: for each destination rank, its tokens in send order, each once
// however many of its experts that rank holds.
struct MoeSent {
  std::vector<std::vector<int32_t>> tokens;  // [world][rows to that rank]
};

struct MoeRouting {
  std::vector<MoeReceived> received;  // [world]
  std::vector<MoeSent> sent;          // [world]
  // Slots whose index is neither -1 nor in [0, E): (rank, token, slot); treated as -1.
  std::vector<MoeRow> bad_indices;
};

// topk[r]: rank r's topk_idx, row-major [T_r][k] (T_r may differ between ranks). Padded: room =
// rows of the layout (default: W * T_max * k + E_local * 127); masked: capacity = rows per local
// expert. Rows within an expert are in (source rank, token, slot) order; in the padded layout
// expert e starts at the sum of round_up(rows(e'), 128) over e' < e. Rows that do not fit (an
// expert past the room, or past the capacity) are not placed, and their expert is listed in
// `overflowed`.
inline MoeRouting moe_route_reference(const std::vector<std::vector<int64_t>>& topk, int k,
                                      int num_experts, MoeRefLayout layout, int64_t room) {
  const int world = static_cast<int>(topk.size());
  const int e_local = num_experts / world;
  MoeRouting out;
  out.received.resize(world);
  out.sent.resize(world);
  // rows[dst][local expert]: (src, token, slot) in order.
  std::vector<std::vector<std::vector<MoeRow>>> by_expert(
      world, std::vector<std::vector<MoeRow>>(e_local));
  for (int src = 0; src < world; ++src) {
    out.sent[src].tokens.resize(world);
    const int64_t tokens = static_cast<int64_t>(topk[src].size()) / k;
    for (int32_t t = 0; t < tokens; ++t) {
      std::vector<bool> to_rank(world, false);
      for (int32_t j = 0; j < k; ++j) {
        const int64_t e = topk[src][static_cast<size_t>(t) * k + j];
        if (e == -1) continue;
        if (e < -1 || e >= num_experts) {
          out.bad_indices.push_back({src, t, j});
          continue;
        }
        const int dst = static_cast<int>(e / e_local);
        by_expert[dst][e % e_local].push_back({src, t, j});
        if (!to_rank[dst]) out.sent[src].tokens[dst].push_back(t);
        to_rank[dst] = true;
      }
    }
  }
  for (int dst = 0; dst < world; ++dst) {
    MoeReceived& r = out.received[dst];
    r.expert_rows.resize(e_local);
    r.expert_start.resize(e_local);
    int64_t next = 0;
    for (int e = 0; e < e_local; ++e) {
      const auto& rows = by_expert[dst][e];
      r.expert_rows[e] = static_cast<int32_t>(rows.size());
      r.expert_start[e] = layout == MoeRefLayout::kMasked ? e * room : next;
      next += (static_cast<int64_t>(rows.size()) + kMoeRowBlock - 1) / kMoeRowBlock * kMoeRowBlock;
    }
    const int64_t total = layout == MoeRefLayout::kMasked ? e_local * room : room;
    r.rows.assign(static_cast<size_t>(total), MoeRow{});
    for (int e = 0; e < e_local; ++e) {
      const auto& rows = by_expert[dst][e];
      const int64_t end = layout == MoeRefLayout::kMasked ? r.expert_start[e] + room : total;
      bool fits = true;
      for (size_t i = 0; i < rows.size(); ++i) {
        const int64_t at = r.expert_start[e] + static_cast<int64_t>(i);
        if (at >= end) {
          fits = false;
          break;
        }
        r.rows[static_cast<size_t>(at)] = rows[i];
      }
      if (!fits) r.overflowed.push_back(e);
    }
  }
  return out;
}

// Across nodes (docs/design/moe.md, "Across nodes"): ranks_per_node consecutive ranks a node. A
// token crosses the network once per destination node, to its rail peer there (the rank of that
// node with the source's local index), which forwards it over NVLink to the ranks of its node
// holding its experts (keeping its own rows). Rows to the source's own node go over NVLink
// directly, as within one node. The received layout is moe_route_reference's whatever the path.
struct MoeRelayed {
  int32_t src = -1;    // the source rank
  int32_t token = -1;  // its token
  bool operator==(const MoeRelayed&) const = default;
};
struct MoeNodeTraffic {
  // [src][dst node]: the tokens src sends over the network to its rail peer on that node, in
  // token order, each once whatever it holds there; empty for src's own node.
  std::vector<std::vector<std::vector<int32_t>>> crossing;
  // [relay][dst rank]: what the rail peer forwards to rank dst of its node (itself included: the
  // rows it keeps), in (source, token) order, each token once a destination rank.
  std::vector<std::vector<std::vector<MoeRelayed>>> relayed;
  // [src][dst rank]: tokens sent over NVLink directly (dst on src's node), as MoeSent's.
  std::vector<std::vector<std::vector<int32_t>>> direct;
};

inline MoeNodeTraffic moe_node_traffic_reference(const std::vector<std::vector<int64_t>>& topk,
                                                 int k, int num_experts, int ranks_per_node) {
  const int world = static_cast<int>(topk.size());
  const int nodes = world / ranks_per_node;
  const int e_local = num_experts / world;
  MoeNodeTraffic out;
  out.crossing.assign(world, std::vector<std::vector<int32_t>>(nodes));
  out.relayed.assign(world, std::vector<std::vector<MoeRelayed>>(world));
  out.direct.assign(world, std::vector<std::vector<int32_t>>(world));
  for (int src = 0; src < world; ++src) {
    const int home = src / ranks_per_node;
    const int64_t tokens = static_cast<int64_t>(topk[src].size()) / k;
    for (int32_t t = 0; t < tokens; ++t) {
      std::vector<bool> to_rank(world, false);
      for (int j = 0; j < k; ++j) {
        const int64_t e = topk[src][static_cast<size_t>(t) * k + j];
        if (e >= 0 && e < num_experts) to_rank[e / e_local] = true;
      }
      for (int node = 0; node < nodes; ++node) {
        bool any = false;
        for (int d = node * ranks_per_node; d < (node + 1) * ranks_per_node; ++d) {
          if (!to_rank[d]) continue;
          any = true;
          if (node == home) {
            out.direct[src][d].push_back(t);
          } else {
            out.relayed[node * ranks_per_node + src % ranks_per_node][d].push_back({src, t});
          }
        }
        if (any && node != home) out.crossing[src][node].push_back(t);
      }
    }
  }
  return out;
}

// bf16 <-> float, round to nearest even (as __float2bfloat16_rn).
inline float bf16_to_float(uint16_t v) {
  const uint32_t bits = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}
inline uint16_t float_to_bf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  if (std::isnan(f)) return static_cast<uint16_t>((bits >> 16) | 0x40);
  bits += 0x7fff + ((bits >> 16) & 1);
  return static_cast<uint16_t>(bits >> 16);
}

// The combine at one source rank: out[t] = bf16(sum over slots j, in order, of w[t][j] *
// y(t, j)) in fp32 (fused multiply-adds, the kernel's __fmaf_rn), where y(t, j) is the row its
// expert returned (bf16) and empty or bad slots add nothing. y_of(t, j) returns a pointer to H bf16
// values, or nullptr for no row.
template <class RowOf>
std::vector<uint16_t> moe_combine_reference(int64_t tokens, int k, int64_t hidden,
                                            const std::vector<float>& weights, RowOf y_of) {
  std::vector<uint16_t> out(static_cast<size_t>(tokens * hidden));
  std::vector<float> acc(static_cast<size_t>(hidden));
  for (int64_t t = 0; t < tokens; ++t) {
    std::fill(acc.begin(), acc.end(), 0.f);
    for (int j = 0; j < k; ++j) {
      const uint16_t* y = y_of(t, j);
      if (y == nullptr) continue;
      const float w = weights[static_cast<size_t>(t * k + j)];
      for (int64_t h = 0; h < hidden; ++h) acc[h] = std::fma(w, bf16_to_float(y[h]), acc[h]);
    }
    for (int64_t h = 0; h < hidden; ++h) out[t * hidden + h] = float_to_bf16(acc[h]);
  }
  return out;
}

}  // namespace mk::test
