// Host side of GEMM + AllReduce: validate -> plan -> tensor maps -> launch.
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "fused/fused_common.h"
#include "fused/gemm_ar.cuh"
#include "fused/gemm_ar_nodes.cuh"
#include "fused/node_links_host.cuh"
#include "fused/plans.h"
#include "fused/trace_layout.h"
#include "gemm/gemm_internal.h"
#include "gemm/launch.cuh"
#include "mkernel/error.h"
#include "mkernel/fused.h"
#include "runtime/device_guard.h"
#include "runtime/kernel_preload.h"
#include "runtime/validate.h"

namespace mk {
namespace {

constexpr const char* kOp = "gemm_ar";

[[noreturn]] void invalid(const std::string& what) {
  throw Error(ErrorCode::kInvalidArgument, std::string(kOp) + ": " + what);
}

// Columns (elements) owned by rank o: column tiles [o * T / w, (o + 1) * T / w), T = tiles_n.
int64_t owned_cols(int owner, int world, int64_t tiles_n, int block_n, int64_t n) {
  const int64_t first = owner * tiles_n / world, last = (owner + 1) * tiles_n / world;
  return std::min(last * block_n, n) - first * block_n;
}

}  // namespace

FusedGemmPlan fused::plan_gemm_ar(const fused::PlanContext& comm, int64_t m, int64_t n, int64_t k,
                                  const FusedGemmConfig& config) {
  const int world = comm.world_size();
  if (m < 1) invalid("M = " + std::to_string(m) + "; expected M >= 1");
  gemm_engine::require_multiple_of_8(n, kOp, "N");
  gemm_engine::require_multiple_of_8(k, kOp, "K_r");
  if (m >= (int64_t{1} << 31) || n >= (int64_t{1} << 31) || k >= (int64_t{1} << 31)) {
    invalid("M, N and K_r must each be < 2^31");
  }
  if (comm.local_size > fused::kMaxLocalRanks) {
    invalid("at most " + std::to_string(fused::kMaxLocalRanks) + " ranks per node are supported");
  }
  if (config.comm_ctas < 0 || config.piece_rows < 0) invalid("negative comm_ctas or piece_rows");
  FusedGemmPlan p{};
  p.shard_rows = m;  // every rank computes all rows (of the columns it does not own first)
  const int64_t tiles_m = (m + 127) / 128;
  const int budget = fused::sm_budget(comm, config.sms, kOp);
  // The accumulator (gemm_ar.cuh, slice_at): M x (the most columns a rank owns) in bf16-sized
  // words with two ranks, in fp32 with more. Prefer the engine's tile width; else the widest
  // one that keeps it within the sequential [M, N] bf16 intermediate (one exists for N >= 128).
  const int64_t word_bytes = world == 2 ? 2 : 4;
  auto max_owned = [&](int block_n) {
    const int64_t tiles_n = (n + block_n - 1) / block_n;
    int64_t cols = 0;
    for (int o = 0; o < world; ++o)
      cols = std::max(cols, owned_cols(o, world, tiles_n, block_n, n));
    return cols;
  };
  if (comm.nodes > 1) {
    // Across nodes (gemm_ar_nodes.cuh): tiles at most 128 wide (as gemm_rs across nodes), the
    // blocked order, fp32 partials and node sums, no outbox; 4 x nodes - 2 workspace regions of
    // M x the widest owner's columns fp32; signals of a column block in both pads.
    p.nodes = comm.nodes;
    if (world > fused::kMaxReduceRanks) {
      invalid("across nodes at most " + std::to_string(fused::kMaxReduceRanks) + " ranks; got " +
              std::to_string(world));
    }
    if (config.block_n > fused::kMaxReduceBlockN) {
      invalid("block_n = " + std::to_string(config.block_n) + ": across nodes at most " +
              std::to_string(fused::kMaxReduceBlockN));
    }
    p.block_n = std::min(gemm_engine::pick_block_n(config.block_n, m, n, budget, kOp),
                         fused::kMaxReduceBlockN);
    const int64_t tiles_n = (n + p.block_n - 1) / p.block_n;
    int64_t max_col_tiles = 0;
    for (int o = 0; o < world; ++o) {
      max_col_tiles = std::max(max_col_tiles, (o + 1) * tiles_n / world - o * tiles_n / world);
    }
    const int64_t slices = 2 * tiles_m * max_col_tiles;
    if (p.nodes * slices > kMaxOpSignals || 1 + 2 * slices > kInterNodeSignals) {
      invalid("across " + std::to_string(p.nodes) + " nodes " + std::to_string(slices / 2) +
              " tiles of 128 x " + std::to_string(p.block_n) + " per rank; at most " +
              std::to_string(
                  std::min<int64_t>(kMaxOpSignals / p.nodes, (kInterNodeSignals - 1) / 2) / 2) +
              " are supported across nodes (use fewer rows or columns per call)");
    }
    p.ctas = static_cast<int>(std::min<int64_t>(tiles_m * tiles_n, budget));
    p.workspace_bytes = static_cast<std::size_t>(4 * p.nodes - 2) *
                        static_cast<std::size_t>(m * max_owned(p.block_n)) * 4;
    p.lag = -1;
    // bf16 on the wire when asked, as gemm_rs across nodes (NodeLinks::bf16_sums / bf16_local).
    p.bf16_partials = config.bf16_partials;
    return p;
  }
  p.block_n = gemm_engine::pick_block_n(config.block_n, m, n, budget, kOp);
  if (world > 2 && config.block_n == 0 && max_owned(p.block_n) * word_bytes > 2 * n) {
    for (int w : {256, 192, 128, 64}) {
      if (max_owned(w) * word_bytes <= 2 * n) {
        p.block_n = w;
        break;
      }
    }
  }
  // Column tiles per rank fit the op signals (two per tile)?
  auto signals_fit = [&](int block_n) {
    const int64_t tiles_n = (n + block_n - 1) / block_n;
    int64_t max_col_tiles = 0;
    for (int o = 0; o < world; ++o) {
      max_col_tiles = std::max(max_col_tiles, (o + 1) * tiles_n / world - o * tiles_n / world);
    }
    return 2 * tiles_m * max_col_tiles <= kMaxOpSignals;
  };
  if (!signals_fit(p.block_n)) {
    const int64_t tiles_n = (n + p.block_n - 1) / p.block_n;
    invalid(std::to_string(tiles_m * ((tiles_n + world - 1) / world)) + " tiles of 128 x " +
            std::to_string(p.block_n) + " per rank; at most " + std::to_string(kMaxOpSignals / 2) +
            " are supported (use a wider block_n or fewer rows per call)");
  }
  // The rest of the plan for a tile width.
  auto with_width = [&](int block_n) {
    FusedGemmPlan q = p;
    q.block_n = block_n;
    const int64_t tiles_n = (n + block_n - 1) / block_n;
    q.ctas = static_cast<int>(std::min<int64_t>(tiles_m * tiles_n, budget));
    q.comm_ctas = 0;  // the consumers' epilogues (or the outbox's side threads) move the data
    q.piece_rows = 0;
    q.pieces = 0;
    q.workspace_bytes =
        world == 1 ? 0 : static_cast<std::size_t>(m * max_owned(block_n) * word_bytes);
    // Staging slots of the outbox (partials.cuh) behind the accumulator, when they fit within
    // the intermediate's size too: two slots per consumer, else one, with every CTA of the
    // budget, else with up to 1/8 of the CTAs given up for them (the epilogue's own sends cost
    // far more); else the epilogue sends the partials itself (small M, tiny N).
    const auto bound = static_cast<std::size_t>(m * n * 2);
    if (world > 1 && q.workspace_bytes < bound) {
      const auto slot_bytes = static_cast<std::size_t>(std::min<int64_t>(64, m) * block_n * 4);
      const std::size_t room = bound - q.workspace_bytes;
      for (const int min_ctas : {q.ctas, q.ctas - q.ctas / 8}) {
        for (const int slots : {fused::kMaxOutboxSlots, 1}) {
          const auto ctas = static_cast<int>(std::min<std::size_t>(
              q.ctas, room / (2 * static_cast<std::size_t>(slots) * slot_bytes)));
          if (q.outbox_slots == 0 && ctas >= std::max(min_ctas, 1)) {
            q.ctas = ctas;
            q.outbox_slots = slots;
            q.staging_bytes = static_cast<std::size_t>(ctas) * 2 * slots * slot_bytes;
          }
        }
      }
      q.workspace_bytes += q.staging_bytes;
    }
    // Peers' tiles and own tiles interleaved (reduce_order.h), lag two waves, when the outbox
    // carries the traffic, the column tiles split evenly (the same count for every owner) and
    // each rank owns at least kInterleaveWaves waves of tiles; on a grid coprime to the world
    // size, so that every CTA sends its share (fewer staging slots). With fewer own tiles the
    // blocked order (all peers' tiles first) measured faster, from eight waves the interleaved
    // one (docs/PERFORMANCE.md, 2026-11-30).
    constexpr int kInterleaveWaves = 4;
    q.lag = -1;
    if (q.outbox_slots > 0 && tiles_n % world == 0 &&
        tiles_m * (tiles_n / world) >= kInterleaveWaves * static_cast<int64_t>(q.ctas)) {
      const std::size_t per_cta = q.staging_bytes / q.ctas;
      q.workspace_bytes -= q.staging_bytes;
      q.ctas = fused::ReduceOrder::interleave_grid(q.ctas, world);
      q.staging_bytes = per_cta * q.ctas;
      q.workspace_bytes += q.staging_bytes;
      q.lag = 2 * (world - 1) * q.ctas;
    }
    return q;
  };
  p = with_width(p.block_n);
  // Narrower tiles when only they let the outbox's staging fit (M around 1024: the slots are
  // half as large at 128 wide; the epilogue's own sends cost far more than the narrower tile).
  if (p.outbox_slots == 0 && world > 1 && config.block_n == 0 && p.block_n > 128 &&
      signals_fit(128) && static_cast<int64_t>(max_owned(128)) * word_bytes <= 2 * n) {
    const FusedGemmPlan narrow = with_width(128);
    if (narrow.outbox_slots > 0) p = narrow;
  }
  // Two ranks, when asked: the one peer partial of a slice travels as bf16, into its footprint in
  // the owner's C (gemm_ar.cuh); the workspace's accumulator part then goes unused.
  p.bf16_partials = world == 2 && config.bf16_partials;
  // Two ranks, fp32 partials: the peer's partials of whole own tiles reach the epilogue through
  // the stage ring (gemm_ar.cuh). Their workspace halves must start at multiples of half the tile
  // width (64 N % block_n == 0: always but at 192 wide), and a whole tile must exist (M >= 128,
  // N >= block_n) for the tensor maps to have their 64-row boxes.
  p.tma_partials =
      world == 2 && !p.bf16_partials && (64 * n) % p.block_n == 0 && m >= 128 && n >= p.block_n;
  // Two ranks: an own tile's bf16 result leaves for the peer's C by a TMA store beside its local
  // one (not through the outbox's side threads), and without an outbox (small M) a peer's
  // tile's fp32 slice too, through tensor maps of the peer's C and accumulator laid out as the
  // ring's (tma_partials) - a CTA's copy engine pushes an order of magnitude more over NVLink
  // than its threads' stores from the epilogue (bench_p2p; docs/PERFORMANCE.md, 2026-12-01).
  p.tma_sends = world == 2 && config.tma_sends;
  return p;
}

namespace {

template <int kBlockN, bool kTransB>
void launch(const Communicator& comm, const FusedGemmPlan& p, const void* a, const void* b,
            void* out, int64_t m, int64_t n, int64_t k, const SymmetricRange& out_range,
            const SymmetricRange& ws, cudaStream_t stream) {
  const Topology& topo = comm.topology();
  fused::GemmArFusion<kBlockN> f{};
  f.a = gemm_engine::make_map(a, m, k, 128);
  f.a_last = gemm_engine::make_map(a, m, k, gemm_engine::last_tile_rows(m));
  f.out = gemm_engine::make_map(out, m, n, 64);
  for (int i = 0; i < topo.local_size; ++i) {
    f.out_peers[i] = reinterpret_cast<__nv_bfloat16*>(out_range.host_peers[i] + out_range.offset);
    f.accum_peers[i] = reinterpret_cast<float*>(ws.host_peers[i] + ws.offset);
  }
  f.comm = comm.device_comm();
  f.m = static_cast<int>(m);
  f.n = static_cast<int>(n);
  f.tiles_m = static_cast<int>((m + 127) / 128);
  f.tiles_n = static_cast<int>((n + kBlockN - 1) / kBlockN);
  f.single_peer = topo.world_size == 2;
  f.bf16_partials = p.bf16_partials && f.single_peer;
  f.tma_partials = p.tma_partials;
  if (p.tma_partials) {
    f.partials_c = gemm_engine::make_map_fp32(out, m, n / 2, 64);
    const std::size_t accum_floats = (p.workspace_bytes - p.staging_bytes) / 4;
    f.partials_ws = gemm_engine::make_map_fp32(f.accum_peers[topo.local_rank],
                                               static_cast<int64_t>(accum_floats / (kBlockN / 2)),
                                               kBlockN / 2, 64);
    if (p.tma_sends) {  // the same two views of the one peer's buffers, mapped here
      const int peer = 1 - topo.local_rank;
      f.peer_partials_c = gemm_engine::make_map_fp32(f.out_peers[peer], m, n / 2, 64);
      f.peer_partials_ws = gemm_engine::make_map_fp32(
          f.accum_peers[peer], static_cast<int64_t>(accum_floats / (kBlockN / 2)), kBlockN / 2, 64);
    }
  }
  f.tma_sends = p.tma_sends;
  if (p.tma_sends) f.peer_out = gemm_engine::make_map(f.out_peers[1 - topo.local_rank], m, n, 64);
  f.slot_floats = std::min<int64_t>(64, m) * kBlockN;
  f.slots = p.outbox_slots;
  f.trace = fused::trace_arm(comm, p.ctas, stream);
  f.order = {topo.world_size, static_cast<int>(f.tiles_m * (f.tiles_n / topo.world_size)), p.lag};
  f.staging = p.staging_bytes == 0
                  ? nullptr
                  : reinterpret_cast<float*>(ws.host_peers[topo.local_rank] + ws.offset +
                                             (p.workspace_bytes - p.staging_bytes));
  const CUtensorMap map_b = gemm_engine::make_b_map(b, n, k, kBlockN, kTransB);
  gemm_engine::launch<kBlockN, kTransB>(f, map_b, k, p.ctas, stream, kOp);
}

// Across nodes (gemm_ar_nodes.cuh): the rail routes, the inter-node rings, the workspace's
// allocation registered with the inter-node path.
template <int kBlockN, bool kTransB>
void launch_across_nodes(Communicator& comm, const FusedGemmPlan& p, const void* a, const void* b,
                         void* out, int64_t m, int64_t n, int64_t k,
                         const SymmetricRange& out_range, const SymmetricRange& ws,
                         cudaStream_t stream) {
  const Topology& topo = comm.topology();
  fused::GemmArAcrossNodes<kBlockN> f{};
  f.a = gemm_engine::make_map(a, m, k, 128);
  f.a_last = gemm_engine::make_map(a, m, k, gemm_engine::last_tile_rows(m));
  f.out = gemm_engine::make_map(out, m, n, 64);
  for (int i = 0; i < topo.local_size; ++i) {
    f.c_local[i] = reinterpret_cast<__nv_bfloat16*>(out_range.host_peers[i] + out_range.offset);
    f.ws_local[i] = reinterpret_cast<float*>(ws.host_peers[i] + ws.offset);
  }
  f.my_ws = f.ws_local[topo.local_rank];
  f.m = static_cast<int>(m);
  f.n = static_cast<int>(n);
  f.tiles_m = static_cast<int>((m + 127) / 128);
  f.tiles_n = static_cast<int>((n + kBlockN - 1) / kBlockN);
  int max_col_tiles = 0;
  for (int o = 0; o < topo.world_size; ++o) {
    const int first = o * f.tiles_n / topo.world_size;
    const int last = (o + 1) * f.tiles_n / topo.world_size;
    max_col_tiles = std::max(max_col_tiles, last - first);
    f.max_cols = std::max<int>(f.max_cols, std::min<int64_t>(last * kBlockN, n) - first * kBlockN);
  }
  f.num_slices = 2 * f.tiles_m * max_col_tiles;
  f.links = fused::node_links(comm, ws, static_cast<uint64_t>(m) * f.max_cols * 4,
                              4 * topo.num_nodes - 2);  // reduce_routes.h's and the final ones
  f.links.bf16_sums = p.bf16_partials;
  f.links.bf16_local = p.bf16_partials && topo.local_size == 2;
  f.comm = comm.device_comm();  // (after the inter-node path exists: its host pad)
  f.trace = fused::trace_arm(comm, p.ctas, stream);
  const CUtensorMap map_b = gemm_engine::make_b_map(b, n, k, kBlockN, kTransB);
  gemm_engine::launch<kBlockN, kTransB, fused::GemmArAcrossNodes<kBlockN>>(f, map_b, k, p.ctas,
                                                                           stream, kOp);
}

}  // namespace

std::size_t gemm_ar_workspace_bytes(const Communicator& comm, int64_t m, int64_t n, int64_t k_local,
                                    const FusedGemmConfig& config) {
  return fused::plan_gemm_ar(fused::plan_context(comm), m, n, k_local,
                             fused::with_reduce_overrides(comm, config))
      .workspace_bytes;
}

FusedGemmPlan gemm_ar_plan(const Communicator& comm, int64_t m, int64_t n, int64_t k_local,
                           const FusedGemmConfig& config) {
  return fused::plan_gemm_ar(fused::plan_context(comm), m, n, k_local,
                             fused::with_reduce_overrides(comm, config));
}

void gemm_ar(Communicator& comm, const void* a, const void* b, void* out, int64_t m, int64_t n,
             int64_t k, BLayout b_layout, void* workspace, cudaStream_t stream,
             const FusedGemmConfig& config) {
  detail::DeviceGuard guard(comm.device());
  fused::check_call(comm, stream, b_layout, kOp, /*across_nodes=*/true);
  const FusedGemmPlan p = fused::plan_gemm_ar(fused::plan_context(comm), m, n, k,
                                              fused::with_reduce_overrides(comm, config));
  detail::require_device_pointer(comm, a, 16, kOp, "A");
  detail::require_device_pointer(comm, b, 16, kOp, "B");
  detail::require_device_pointer(comm, out, 16, kOp, "out");
  const std::size_t out_bytes = static_cast<std::size_t>(m) * n * 2;
  const detail::Region a_region{"A", a, static_cast<std::size_t>(m) * k * 2, false};
  const detail::Region b_region{"B", b, static_cast<std::size_t>(n) * k * 2, false};
  const detail::Region out_region{"out", out, out_bytes, true};
  if (comm.world_size() == 1) detail::require_disjoint(kOp, {a_region, b_region, out_region});
  fused::print_plan(comm, kOp, m, n, k, p);
  if (comm.world_size() == 1) {  // nothing to reduce: the GEMM alone
    GemmConfig plain;
    plain.block_n = p.block_n;
    plain.sms = p.ctas;
    gemm(a, b, out, m, n, k, b_layout, stream, plain);
    return;
  }
  const SymmetricRange out_range = detail::require_symmetric(comm, out, out_bytes, kOp, "out");
  detail::require_device_pointer(comm, workspace, 16, kOp, "workspace");
  const SymmetricRange ws =
      detail::require_symmetric(comm, workspace, p.workspace_bytes, kOp, "workspace");
  if (ws.offset % 16 != 0 || out_range.offset % 16 != 0) {
    invalid("out and workspace must be 16-byte aligned inside their symmetric buffers");
  }
  detail::require_disjoint(
      kOp, {a_region, b_region, out_region, {"workspace", workspace, p.workspace_bytes, true}});
  gemm_engine::dispatch(p.block_n, b_layout == BLayout::kKN, [&]<int kBlockN, bool kTransB>() {
    if (p.nodes > 1) {
      if constexpr (kBlockN <= fused::kMaxReduceBlockN) {
        launch_across_nodes<kBlockN, kTransB>(comm, p, a, b, out, m, n, k, out_range, ws, stream);
      } else {
        throw Error(ErrorCode::kInternal, "gemm_ar: across nodes with block_n " +
                                              std::to_string(kBlockN) + " (the plan caps it)");
      }
    } else {
      launch<kBlockN, kTransB>(comm, p, a, b, out, m, n, k, out_range, ws, stream);
    }
  });
}

namespace detail {
namespace {

// Every gemm_ar kernel the plans can pick (runtime/kernel_preload.h).
void preload_gemm_ar_kernels(bool across_nodes) {
  gemm_engine::preload_all<fused::GemmArFusion>();
  if (across_nodes) {  // the widths the plan allows across nodes
    gemm_engine::prepared_kernel<64, false, fused::GemmArAcrossNodes<64>>();
    gemm_engine::prepared_kernel<64, true, fused::GemmArAcrossNodes<64>>();
    gemm_engine::prepared_kernel<128, false, fused::GemmArAcrossNodes<128>>();
    gemm_engine::prepared_kernel<128, true, fused::GemmArAcrossNodes<128>>();
  }
}

const bool kPreloadRegistered = register_kernel_preload(&preload_gemm_ar_kernels);

}  // namespace
}  // namespace detail

}  // namespace mk
