// Host side of ring attention: validate -> plan -> workspace layout -> tensor maps -> launch.
#include <cuda.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <string>

#include "attention/attention_internal.h"
#include "attention/attention_launch.cuh"
#include "attention/ring_attention.cuh"
#include "attention/ring_nodes.cuh"
#include "mkernel/attention.h"
#include "mkernel/error.h"
#include "runtime/cuda_check.h"
#include "runtime/device_guard.h"
#include "runtime/inter_node_rings.h"
#include "runtime/kernel_preload.h"
#include "runtime/overrides.h"
#include "runtime/validate.h"

namespace mk {
namespace {

constexpr const char* kOp = "ring_attention";

[[noreturn]] void invalid(const std::string& what) {
  throw Error(ErrorCode::kInvalidArgument, std::string(kOp) + ": " + what);
}

template <int kHeadDim>
using Cfg = attention_engine::AttentionConfig<kHeadDim>;
template <int kHeadDim, bool kOneRound>
using Policy = attention_engine::RingAttention<kHeadDim, kOneRound>;

constexpr std::size_t align256(std::size_t x) { return (x + 255) / 256 * 256; }

// The rounds (ring_attention.cuh) cover steps 0 .. w - 1 once each, in order; a round holds at
// most kRingSlots peer steps, so a slot is used once a round; ring_round_of agrees.
constexpr bool rounds_consistent(int world) {
  using namespace attention_engine;
  int next = 0;
  for (int q = 0; q < ring_rounds(world); ++q) {
    const int first = ring_first_step(q);
    const int last = std::min(world - 1, ring_first_step(q + 1) - 1);
    if (first != next || last < first) return false;
    if (last - std::max(first, 1) + 1 > kRingSlots) return false;
    for (int j = first; j <= last; ++j) {
      if (ring_round_of(j) != q) return false;
    }
    next = last + 1;
  }
  return next == world;
}
static_assert(rounds_consistent(1) && rounds_consistent(2) && rounds_consistent(3) &&
              rounds_consistent(4) && rounds_consistent(5) && rounds_consistent(8) &&
              rounds_consistent(9) && rounds_consistent(64));

// The workspace's regions (byte offsets) for a checked problem.
struct Layout {
  int parts = 1;
  int64_t part_len = 0;
  int64_t tiles_per_part = 0;
  int64_t items = 0;
  int rounds = 1;
  int units = 0;          // (batch, kv head) pairs: the copies' order
  int nodes = 1;          // launches a call (ring_nodes.cuh)
  std::size_t chunk = 0;  // bytes of the local K (or V)
  std::size_t slots = 0, state_o = 0, state_ml = 0, counters = 0, total = 0;
  // Across nodes: the chunk a launch holds (K then V, contiguous) and the exchange's A and B
  // (used in the workspace when the inter-node path stages in device memory).
  std::size_t held = 0, xchg = 0;
  // arrive[kRingSlots][units], done[rounds]
  std::size_t counters_bytes() const {
    return (static_cast<std::size_t>(attention_engine::kRingSlots) * units + rounds) * 8;
  }
};

// The ring is a node's ranks (`ring` of them); `nodes` launches a call.
Layout layout_of(const AttentionProblem& p, int ring, int nodes) {
  Layout l;
  l.nodes = nodes;
  l.parts = p.causal ? 2 : 1;
  l.part_len = p.seq_q / l.parts;
  l.tiles_per_part = (l.part_len + 127) / 128;
  l.items = p.batch * p.heads * l.parts * l.tiles_per_part;
  l.rounds = attention_engine::ring_rounds(ring);
  l.units = static_cast<int>(p.batch * p.kv_heads);
  l.chunk = static_cast<std::size_t>(p.batch * p.seq_kv * p.kv_heads * p.head_dim) * 2;
  std::size_t at = 0;
  auto take = [&](std::size_t bytes) {
    const std::size_t here = at;
    at += align256(bytes);
    return here;
  };
  l.slots = take(2 * attention_engine::kRingSlots * l.chunk);
  // The softmax state between rounds and launches: none with one of each (one node, world <= 1 +
  // kRingSlots).
  const std::size_t carried = l.rounds > 1 || nodes > 1 ? static_cast<std::size_t>(l.items) : 0;
  l.state_o = take(carried * 128 * p.head_dim * 4);
  l.state_ml = take(carried * 2 * 128 * 16);
  l.counters = take(l.counters_bytes());
  if (nodes > 1) {
    l.held = take(2 * l.chunk);
    l.xchg = take(4 * l.chunk);
  }
  l.total = at;
  return l;
}

Layout layout_for(const Communicator& comm, const AttentionProblem& p) {
  return layout_of(p, comm.topology().local_size, comm.topology().num_nodes);
}

// The checks every entry makes on the communicator and the problem.
void require_ring_problem(const Communicator& comm, const AttentionProblem& p, const char* op) {
  detail::require_usable(comm, op);
  const Topology& topo = comm.topology();
  if (topo.num_nodes > 1 && (topo.local_size > attention_engine::kMaxRingLocal ||
                             topo.num_nodes > attention_engine::kMaxRingNodes)) {
    throw Error(ErrorCode::kUnsupported,
                std::string(op) + ": " + std::to_string(topo.num_nodes) + " nodes of " +
                    std::to_string(topo.local_size) + " ranks; across nodes at most " +
                    std::to_string(attention_engine::kMaxRingNodes) + " nodes of " +
                    std::to_string(attention_engine::kMaxRingLocal) + " ranks");
  }
  attention_host::require_problem(p, op);
  if (p.seq_q != p.seq_kv) {
    throw Error(ErrorCode::kInvalidArgument,
                std::string(op) + ": seq_q = " + std::to_string(p.seq_q) +
                    " and seq_kv = " + std::to_string(p.seq_kv) +
                    "; expected both = S_local, this rank's share of the sequence");
  }
  if (p.seq_kv * p.head_dim / 8 > INT32_MAX) {  // a unit's 16-byte vectors (ring_attention.cuh)
    throw Error(ErrorCode::kInvalidArgument, std::string(op) +
                                                 ": S_local = " + std::to_string(p.seq_kv) +
                                                 " too long; expected S_local x D / 8 < 2^31");
  }
  if (p.causal && p.seq_q % 2 != 0) {
    throw Error(ErrorCode::kInvalidArgument,
                std::string(op) + ": causal with S_local = " + std::to_string(p.seq_q) +
                    "; expected an even S_local (the zigzag share: two chunks of S_local / 2)");
  }
}

int ring_ctas(const Communicator& comm, const AttentionConfig& config) {
  if (config.sms < 0) invalid("config.sms = " + std::to_string(config.sms) + "; expected >= 0");
  const int budget = comm.topology().sm_budget();
  if (budget < 1) {  // (the ranks' launches must all be resident at once: a CTA each at least)
    invalid("more ranks share a GPU (" + std::to_string(comm.topology().max_ranks_per_device) +
            ") than it has SMs (" + std::to_string(comm.topology().min_sm_count) + ")");
  }
  return config.sms > 0 ? std::min(config.sms, budget) : budget;
}

// One ring launch over the node's ranks. `held`: the chunk this rank holds for it - the user's k,
// v (strides sk) on one node and in launch 0 across nodes, else the exchanged chunk (contiguous,
// K then V); `src_node`: whose chunks the node holds (its ranks' global ranks number them);
// carry_first / carry_last: the softmax state from the launch before / to the next.
struct NodeLaunch {
  const void* k;
  const void* v;
  attention_host::Strides sk;
  int src_node = 0;
  bool carry_first = false;
  bool carry_last = false;
};

// The global rank with local index `local` on node `node`.
int rank_at(const Topology& topo, int node, int local) {
  for (int r = 0; r < topo.world_size; ++r) {
    if (topo.node_of[r] == node && topo.local_rank_of[r] == local) return r;
  }
  throw Error(ErrorCode::kInternal, std::string(kOp) + ": no rank " + std::to_string(local) +
                                        " on node " + std::to_string(node));
}

// kOneRound: the call is this one launch of one round (RingAttention: the carried state's paths
// compiled out).
template <int kHeadDim, bool kOneRound>
void launch(Communicator& comm, const AttentionProblem& p, const AttentionTensor& q,
            const attention_host::Strides& sq, const NodeLaunch& nl, void* o, float* lse,
            void* workspace, const SymmetricRange& ws, const Layout& l, int ctas,
            cudaStream_t stream, bool zero_counters = true) {
  if (kOneRound && (l.rounds != 1 || nl.carry_first || nl.carry_last)) {
    throw Error(ErrorCode::kInternal, std::string(kOp) + ": a one-round kernel for " +
                                          std::to_string(l.rounds) + " rounds or a carried state");
  }
  using C = Cfg<kHeadDim>;
  using attention_host::make_map_parts;
  Policy<kHeadDim, kOneRound> policy{};
  policy.comm = comm.device_comm();
  const attention_host::Strides so{p.seq_q * p.heads * p.head_dim, p.heads * p.head_dim,
                                   p.head_dim};
  // The workspace's K and V: head-major [B, H_kv, S_local, D] (a unit of the copies contiguous).
  const attention_host::Strides sw{p.kv_heads * p.seq_kv * p.head_dim, p.head_dim,
                                   p.seq_kv * p.head_dim};
  const attention_host::Strides& sk = nl.sk;
  policy.q = make_map_parts(q.data, sq, p.batch, l.parts, l.part_len, p.heads, kHeadDim, 128);
  policy.o = make_map_parts(o, so, p.batch, l.parts, l.part_len, p.heads, kHeadDim, 64);
  policy.k_local =
      make_map_parts(nl.k, sk, p.batch, l.parts, l.part_len, p.kv_heads, kHeadDim, 128);
  policy.v_local =
      make_map_parts(nl.v, sk, p.batch, l.parts, l.part_len, p.kv_heads, kHeadDim, 128);
  auto* base = static_cast<uint8_t*>(workspace);  // this rank's copy
  for (int i = 0; i < attention_engine::kRingSlots; ++i) {
    uint8_t* slot = base + l.slots + 2 * i * l.chunk;
    policy.k_slot[i] =
        make_map_parts(slot, sw, p.batch, l.parts, l.part_len, p.kv_heads, kHeadDim, 128);
    policy.v_slot[i] =
        make_map_parts(slot + l.chunk, sw, p.batch, l.parts, l.part_len, p.kv_heads, kHeadDim, 128);
  }
  policy.lse = lse;
  policy.peers = reinterpret_cast<uint8_t* const*>(ws.device_peers);
  policy.offset = ws.offset;
  policy.slots = l.slots;
  policy.state_o = l.state_o;
  policy.state_ml = l.state_ml;
  policy.counters = l.counters;
  policy.k_src = static_cast<const __nv_bfloat16*>(nl.k);
  policy.v_src = static_cast<const __nv_bfloat16*>(nl.v);
  policy.kv_stride_batch = sk.batch;
  policy.kv_stride_seq = sk.seq;
  policy.kv_stride_head = sk.head;
  policy.chunk_vectors = static_cast<int64_t>(l.chunk / 16);
  policy.unit_vectors = static_cast<int>(p.seq_kv * p.head_dim / 8);
  policy.units = l.units;
  policy.batch = static_cast<int>(p.batch);
  policy.heads = static_cast<int>(p.heads);
  policy.kv_heads = static_cast<int>(p.kv_heads);
  policy.group = static_cast<int>(p.heads / p.kv_heads);
  policy.seq_local = static_cast<int>(p.seq_q);
  policy.parts = l.parts;
  policy.part_len = static_cast<int>(l.part_len);
  policy.tiles_per_part = static_cast<int>(l.tiles_per_part);
  policy.blocks_per_part = static_cast<int>((l.part_len + C::kBlockN - 1) / C::kBlockN);
  policy.items = static_cast<int>(l.items);
  policy.rounds = l.rounds;
  policy.causal = p.causal;
  const Topology& topo = comm.topology();
  for (int i = 0; nl.carry_first && i < topo.local_size; ++i) {  // (launches after the first)
    policy.chunk_rank[i] = static_cast<int16_t>(rank_at(topo, nl.src_node, i));
  }
  policy.world = topo.world_size;
  policy.carry_first = nl.carry_first;
  policy.carry_last = nl.carry_last;
  // Everything that lays out the slots and counts or sets a count a peer waits for: ranks that
  // disagree stop at the entry with an error naming them (Launch::agrees).
  policy.signature = dev::entry_signature(
      EntryOp::kRingAttention,
      {p.batch, p.seq_q, p.seq_kv, p.heads, p.kv_heads, p.head_dim, p.causal ? 1 : 0});
  // The counters start at zero (a memset node in a captured graph; across nodes the caller's
  // copy_chunk_kernel zeroes them instead).
  if (zero_counters) {
    MK_CUDA_CHECK(cudaMemsetAsync(base + l.counters, 0, l.counters_bytes(), stream));
  }
  auto kernel = attention_host::prepared<C, Policy<kHeadDim, kOneRound>>();
  kernel<<<ctas, C::kThreads, C::kSmemBytes, stream>>>(policy, attention_host::scale_log2(p));
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) {
    throw Error(ErrorCode::kCuda, std::string(kOp) + ": launch failed: " + cudaGetErrorString(err));
  }
}

void launch_check() {
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) {
    throw Error(ErrorCode::kCuda, std::string(kOp) + ": launch failed: " + cudaGetErrorString(err));
  }
}

// Across nodes (ring_nodes.cuh): launch i on the chunks of node (n - i), the chunks moving one
// node on between launches.
template <int kHeadDim>
void launch_nodes(Communicator& comm, const AttentionProblem& p, const AttentionTensor& q,
                  const attention_host::Strides& sq, const AttentionTensor& k,
                  const attention_host::Strides& sk, const AttentionTensor& v, void* o, float* lse,
                  void* workspace, const SymmetricRange& ws, const Layout& l, int ctas,
                  cudaStream_t stream) {
  const Topology& topo = comm.topology();
  const int nodes = topo.num_nodes, node = topo.node, local = topo.local_rank;
  const uint64_t bytes = 2 * static_cast<uint64_t>(l.chunk);  // K then V
  // A and B: in the path's pinned host staging, or in the workspace (registered with the path).
  const detail::InterNodeStaging staging = detail::inter_node_staging(comm, 2 * bytes);
  auto* alloc = reinterpret_cast<uint8_t*>(ws.host_peers[topo.local_rank]);
  const detail::InterNodeRings path =
      detail::inter_node_rings(comm, staging.base == nullptr ? alloc : nullptr, ws.size);
  attention_engine::RingXchg x{};
  x.ring = path.ring[0];
  x.bytes = bytes;
  x.to = rank_at(topo, (node + 1) % nodes, local);
  x.from = rank_at(topo, (node + nodes - 1) % nodes, local);
  for (int m = 0; m < nodes; ++m) {
    if (m != node) x.rails[x.num_rails++] = static_cast<int16_t>(rank_at(topo, m, local));
  }
  uint8_t* a = nullptr;
  if (staging.base != nullptr) {
    x.buffer = staging.buffer;
    x.a_offset = 0;
    a = staging.base;
  } else {
    x.buffer = path.buffer;
    x.a_offset = ws.offset + l.xchg;
    a = alloc + x.a_offset;
  }
  x.b_offset = x.a_offset + bytes;
  uint8_t* b = a + bytes;
  uint8_t* held = static_cast<uint8_t*>(workspace) + l.held;
  const DeviceComm dc = comm.device_comm();  // (after the inter-node path exists: its host pad)
  // The held chunk's strides: contiguous [B, S, H_kv, D].
  const attention_host::Strides sh{p.seq_kv * p.kv_heads * p.head_dim, p.kv_heads * p.head_dim,
                                   p.head_dim};
  // The copies and the counters' zeroing as kernels on the stream (ring_nodes.cuh's header: a
  // stream copy or memset can queue behind a peer's that waits for this rank).
  auto* counters =
      reinterpret_cast<unsigned long long*>(static_cast<uint8_t*>(workspace) + l.counters);
  const int64_t words = static_cast<int64_t>(l.counters_bytes() / 8);
  const auto copy = [&](void* dst, const void* src, uint64_t n, bool zero) {
    const int64_t vectors = static_cast<int64_t>(n / 16);
    const int64_t work = std::max<int64_t>(vectors, zero ? words : 0);
    const int blocks = static_cast<int>(std::clamp<int64_t>((work + 255) / 256, 1, 1024));
    attention_engine::copy_chunk_kernel<<<blocks, 256, 0, stream>>>(
        static_cast<uint4*>(dst), static_cast<const uint4*>(src), vectors,
        zero ? counters : nullptr, zero ? words : 0);
    launch_check();
  };
  for (int i = 0; i < nodes; ++i) {
    NodeLaunch nl{k.data, v.data, sk, (node + nodes - i) % nodes, i > 0, i < nodes - 1};
    if (i > 0) {
      attention_engine::ring_xchg_ready_kernel<<<1, 32, 0, stream>>>(dc, x, i == 1);
      launch_check();
      if (i == 1) {  // this rank's own chunk, gathered from the user's k, v
        const dim3 grid(static_cast<unsigned>(std::min<int64_t>(
                            1024, (p.seq_kv * p.kv_heads * p.head_dim / 8 + 255) / 256)),
                        static_cast<unsigned>(p.batch), 2);
        attention_engine::gather_chunk_kernel<<<grid, 256, 0, stream>>>(
            static_cast<const __nv_bfloat16*>(k.data), static_cast<const __nv_bfloat16*>(v.data),
            sk.batch, sk.seq, sk.head, p.seq_kv, p.kv_heads, p.head_dim,
            reinterpret_cast<uint4*>(a));
        launch_check();
      } else {  // the chunk the last launch held
        copy(a, held, bytes, false);
      }
      attention_engine::ring_xchg_data_kernel<<<1, 32, 0, stream>>>(dc, x, i == nodes - 1);
      launch_check();
      copy(held, b, bytes, true);
      nl.k = held;
      nl.v = held + l.chunk;
      nl.sk = sh;
    } else {
      copy(nullptr, nullptr, 0, true);  // the counters alone
    }
    launch<kHeadDim, false>(comm, p, q, sq, nl, o, lse, workspace, ws, l, ctas, stream, false);
  }
}

}  // namespace

std::size_t ring_attention_workspace_bytes(const Communicator& comm,
                                           const AttentionProblem& local) {
  require_ring_problem(comm, local, "ring_attention_workspace_bytes");
  return layout_for(comm, local).total;
}

AttentionPlan ring_attention_plan(const Communicator& comm, const AttentionProblem& local,
                                  const AttentionConfig& config) {
  require_ring_problem(comm, local, "ring_attention_plan");
  AttentionPlan plan = attention_host::plan(local, ring_ctas(comm, config));
  const Layout l = layout_for(comm, local);
  plan.items = l.items * l.rounds * l.nodes;
  return plan;
}

void ring_attention(Communicator& comm, const AttentionProblem& local, const AttentionTensor& q,
                    const AttentionTensor& k, const AttentionTensor& v, void* o, float* lse,
                    void* workspace, cudaStream_t stream, const AttentionConfig& config) {
  detail::DeviceGuard guard(comm.device());
  require_ring_problem(comm, local, kOp);
  detail::require_stream(comm, stream, kOp);
  const AttentionProblem& p = local;
  const int device = comm.device();
  const Layout l = layout_for(comm, p);
  detail::require_device_pointer(comm, workspace, 256, kOp, "workspace");
  const SymmetricRange ws = detail::require_symmetric(comm, workspace, l.total, kOp, "workspace");
  if (ws.offset % 256 != 0) {
    invalid("the workspace's offset in its symmetric buffer (" + std::to_string(ws.offset) +
            ") is not a multiple of 256");
  }
  const attention_host::Operands io =
      attention_host::require_operands(p, q, k, v, o, lse, kOp, device, workspace, l.total);
  if (io.k.batch != io.v.batch || io.k.seq != io.v.seq || io.k.head != io.v.head) {
    invalid("k and v have different strides; expected the same layout");
  }
  const int ctas = ring_ctas(comm, config);
  if (comm.overrides().print_config && comm.rank() == 0) {
    std::fprintf(stderr, "[mkernel] ring_attention w%d B%lld H%lld/%lld S_local %lld%s: %s\n",
                 comm.world_size(), static_cast<long long>(p.batch),
                 static_cast<long long>(p.heads), static_cast<long long>(p.kv_heads),
                 static_cast<long long>(p.seq_q), p.causal ? " causal (zigzag)" : "",
                 ring_attention_plan(comm, p, config).describe().c_str());
  }
  const auto run = [&]<int kHeadDim>() {
    if (l.nodes > 1) {
      launch_nodes<kHeadDim>(comm, p, q, io.q, k, io.k, v, o, lse, workspace, ws, l, ctas, stream);
    } else if (l.rounds == 1 && !p.causal) {
      // The one-round kernel (no carried state, no step loop) only where it measured faster:
      // non-causal 1.6-2.9%, causal 0.2-4% slower (bench_ring_bisect, H100, 2026-12-06).
      launch<kHeadDim, true>(comm, p, q, io.q, {k.data, v.data, io.k}, o, lse, workspace, ws, l,
                             ctas, stream);
    } else {
      launch<kHeadDim, false>(comm, p, q, io.q, {k.data, v.data, io.k}, o, lse, workspace, ws, l,
                              ctas, stream);
    }
  };
  if (p.head_dim == 64) {
    run.template operator()<64>();
  } else {
    run.template operator()<128>();
  }
}

namespace detail {
namespace {

template <int kHeadDim>
void prepare() {
  attention_host::prepared<Cfg<kHeadDim>, Policy<kHeadDim, true>>();
  attention_host::prepared<Cfg<kHeadDim>, Policy<kHeadDim, false>>();
}

// The ring kernels, loaded up front (runtime/kernel_preload.h).
const bool kPreloadRegistered = register_kernel_preload([](bool across_nodes) {
  prepare<64>();
  prepare<128>();
  if (!across_nodes) return;
  // The exchange's kernels (a first load would wait behind the peers' waiting kernels).
  cudaFuncAttributes attributes;
  cudaFuncGetAttributes(&attributes, attention_engine::ring_xchg_ready_kernel);
  cudaFuncGetAttributes(&attributes, attention_engine::ring_xchg_data_kernel);
  cudaFuncGetAttributes(&attributes, attention_engine::gather_chunk_kernel);
  cudaFuncGetAttributes(&attributes, attention_engine::copy_chunk_kernel);
});

}  // namespace

void add_ring_attention_resources(std::vector<GemmKernelResources>& out) {
  auto add = [&]<int kHeadDim, bool kOneRound>() {
    prepare<kHeadDim>();
    out.push_back(kernel_resources(
        "ring_attention D" + std::to_string(kHeadDim) + (kOneRound ? " one round" : ""),
        reinterpret_cast<const void*>(
            attention_engine::attention_kernel<Cfg<kHeadDim>, Policy<kHeadDim, kOneRound>>)));
  };
  add.template operator()<64, true>();
  add.template operator()<64, false>();
  add.template operator()<128, true>();
  add.template operator()<128, false>();
}

}  // namespace detail

}  // namespace mk
