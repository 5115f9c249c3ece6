// Host side of AllGather + GEMM: validate -> pick the configuration -> tensor maps -> launch.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "fused/ag_gemm.cuh"
#include "fused/fused_common.h"
#include "fused/plans.h"
#include "fused/rail_routes.h"
#include "fused/trace_layout.h"
#include "gemm/gemm_internal.h"
#include "gemm/launch.cuh"
#include "mkernel/error.h"
#include "mkernel/fused.h"
#include "runtime/cuda_check.h"
#include "runtime/device_guard.h"
#include "runtime/inter_node_rings.h"
#include "runtime/kernel_preload.h"
#include "runtime/validate.h"

namespace mk {
namespace {

constexpr const char* kOp = "ag_gemm";

[[noreturn]] void invalid(const std::string& what) {
  throw Error(ErrorCode::kInvalidArgument, std::string(kOp) + ": " + what);
}

using AgGemmPlan = FusedGemmPlan;

}  // namespace

FusedGemmPlan fused::plan_ag_gemm(const fused::PlanContext& comm, int64_t m, int64_t n, int64_t k,
                                  const FusedGemmConfig& config) {
  const int world = comm.world_size();
  fused::check_shapes(comm, m, n, k, kOp, "K");
  FusedGemmPlan p{};
  p.shard_rows = m / world;
  const int64_t tiles_m = (p.shard_rows + 127) / 128;
  const int budget = fused::sm_budget(comm, config.sms, kOp);
  p.block_n = gemm_engine::pick_block_n(config.block_n, world * tiles_m * 128, n, budget, kOp);
  const int64_t tiles = world * tiles_m * ((n + p.block_n - 1) / p.block_n);
  p.ctas = static_cast<int>(std::min<int64_t>(tiles, budget));
  if (config.comm_ctas < 0) invalid("comm_ctas = " + std::to_string(config.comm_ctas));
  const int64_t row_bytes = k * 2;
  if (config.comm_ctas > 0) {
    p.comm_ctas = std::min(config.comm_ctas, p.ctas);
  } else {
    // Push no faster than needed: pushing saturates HBM and NVLink and slows the GEMM's own loads
    // (a few dozen pushers beat all of them wherever the GEMM is long: docs/PERFORMANCE.md).
    // Peer r - d reads this shard after d shards of its own work, so the pushes keep up when
    // they run at shard * world / T_gemm. Each pushing CTA moves about kPushRate; take twice the
    // CTAs that rate asks for, at least kMinPushers, and no more than the link carries: beyond
    // that they only contend (docs/PERFORMANCE.md, 2026-12-01, at 9f2f94f).
    constexpr double kGemmFlops = 650e12;  // what the engine sustains on large shapes (H200)
    constexpr double kPushRate = 5e9;      // bytes/s of one CTA's three pushing warps
    constexpr double kLinkRate = 360e9;    // bytes/s one way over NVLink (H200, NV18)
    constexpr int kMinPushers = 16;
    const double t_gemm = 2.0 * static_cast<double>(m) * n * k / kGemmFlops;
    const double need = static_cast<double>(p.shard_rows * row_bytes) * world / t_gemm;
    const int link = static_cast<int>(std::ceil(kLinkRate / kPushRate));
    const int want = std::min(static_cast<int>(std::ceil(2 * need / kPushRate)), link);
    p.comm_ctas = std::clamp(want, std::min(kMinPushers, p.ctas), p.ctas);
  }
  int64_t piece_rows = config.piece_rows;
  if (piece_rows < 0) invalid("piece_rows = " + std::to_string(piece_rows));
  if (piece_rows == 0) {
    // Pushing CTA c takes pieces c, c + comm_ctas, ...: the shard arrives in rounds of comm_ctas
    // pieces, so its front rows come early only if it spans several rounds (one round of large
    // pieces lands all at once: docs/PERFORMANCE.md, 2026-12-01, at f51f0fb). About kRounds
    // rounds, of pieces of 128-512 KiB (a piece's fence and signal cost a few microseconds).
    constexpr int64_t kRounds = 4, kMinPiece = int64_t{128} << 10, kMaxPiece = int64_t{512} << 10;
    const int64_t want = p.shard_rows * row_bytes / (int64_t{p.comm_ctas} * kRounds);
    piece_rows = std::max<int64_t>(1, std::clamp(want, kMinPiece, kMaxPiece) / row_bytes);
  }
  piece_rows = std::min(piece_rows, p.shard_rows);
  // One op signal per piece and node (a shard's signals sit at node_of(shard) x pieces): at most
  // kMaxOpSignals / nodes pieces per shard; across nodes also one host-pad signal per piece and
  // node after the entry signal (kInterNodeSignals).
  p.nodes = comm.nodes;
  // GatherRoutes holds kMaxGatherRanks shards (on one node too) and kMaxRailPeers rail peers (one
  // per other node).
  if (world > fused::kMaxGatherRanks) {
    invalid(std::string(p.nodes > 1 ? "across nodes " : "") + "at most " +
            std::to_string(fused::kMaxGatherRanks) + " ranks; got " + std::to_string(world));
  }
  if (p.nodes - 1 > fused::kMaxRailPeers) {
    invalid("at most " + std::to_string(fused::kMaxRailPeers + 1) + " nodes; got " +
            std::to_string(p.nodes));
  }
  const int64_t max_pieces =
      p.nodes > 1 ? (kInterNodeSignals - 1) / p.nodes : int64_t{kMaxOpSignals};
  piece_rows = std::max(piece_rows, (p.shard_rows + max_pieces - 1) / max_pieces);
  p.piece_rows = static_cast<int>(piece_rows);
  p.pieces = static_cast<int>((p.shard_rows + piece_rows - 1) / piece_rows);
  p.workspace_bytes = ag_gemm_workspace_bytes(m, k);
  return p;
}

namespace {

// Where each shard comes from (ag_gemm.cuh, GatherRoutes). One node: from its owner over NVLink,
// in the order r, r + 1, .... Across nodes: the rail routes (fused/rail_routes.h), the inter-node
// rings, and where what crosses the network is staged: the workspace (its symmetric allocation
// registered with the inter-node path) or the path's host staging, one shard of `shard_bytes`
// per node (InterNode::host_staging).
fused::GatherRoutes gather_routes(Communicator& comm, const AgGemmPlan& p, const SymmetricRange& ws,
                                  uint64_t shard_bytes) {
  const Topology& t = comm.topology();
  const int world = t.world_size, r = t.rank;
  fused::GatherRoutes g{};
  if (t.num_nodes == 1) {
    for (int i = 0; i < world; ++i) {
      g.order[i] = static_cast<int16_t>((r + i) % world);
      g.source[i] = static_cast<int16_t>(i);
    }
    return g;
  }
  const fused::RailRoutes routes(t.node_of, t.local_rank_of);
  const std::vector<int> order = routes.gather_order(r);
  for (int i = 0; i < world; ++i) g.order[i] = static_cast<int16_t>(order[i]);
  const detail::InterNodeStaging staging =
      detail::inter_node_staging(comm, shard_bytes * static_cast<uint64_t>(t.num_nodes));
  const std::vector<fused::RailRoutes::ShardSource> sources = routes.gather_sources(r, p.pieces);
  for (int q = 0; q < world; ++q) {
    g.source[q] = static_cast<int16_t>(sources[q].rank);
    g.signal_base[q] = static_cast<int16_t>(sources[q].signal_base);
    if (!sources[q].over_nic) continue;
    if (staging.base == nullptr) {
      g.remote_mask |= uint64_t{1} << q;  // the producer waits for the host pad
    } else {
      g.source[q] = static_cast<int16_t>(r);  // for its own relay's copy out of the staging
    }
  }
  const std::vector<int> rails = routes.rail_peers(r);
  g.rails = static_cast<int>(rails.size());
  for (int i = 0; i < g.rails; ++i) {
    g.rail[i] = static_cast<int16_t>(rails[i]);
    g.rail_node[i] = static_cast<int16_t>(routes.node_of(rails[i]));
  }
  g.node = t.node;
  const detail::InterNodeRings path = detail::inter_node_rings(
      comm,
      staging.base == nullptr ? reinterpret_cast<void*>(ws.host_peers[t.local_rank]) : nullptr,
      ws.size);
  g.num_rings = std::min(path.count, fused::kMaxGatherRings);
  for (int i = 0; i < g.num_rings; ++i) g.rings[i] = path.ring[i];
  g.xfer = staging.base;
  g.xfer_buffer = staging.base == nullptr ? path.buffer : staging.buffer;
  return g;
}

template <int kBlockN, bool kTransB, bool kAcrossNodes>
void launch(Communicator& comm, const AgGemmPlan& p, const void* a_shard, const void* b, void* c,
            int64_t n, int64_t k, const SymmetricRange& ws, void* workspace, cudaStream_t stream) {
  using Fusion = fused::AgGemmFusion<kBlockN, kAcrossNodes>;
  const int world = comm.world_size();
  Fusion f{};
  f.a_local = gemm_engine::make_map(a_shard, p.shard_rows, k, 128);
  f.a_gathered = gemm_engine::make_map_3d(workspace, world, p.shard_rows, k, 128);
  f.c = gemm_engine::make_map_3d(c, world, p.shard_rows, n, 64);
  const int last_rows = gemm_engine::last_tile_rows(p.shard_rows);
  f.a_local_last = gemm_engine::make_map(a_shard, p.shard_rows, k, last_rows);
  f.a_gathered_last = gemm_engine::make_map_3d(workspace, world, p.shard_rows, k, last_rows);
  f.comm = comm.device_comm();
  f.a_shard = static_cast<const uint8_t*>(a_shard);
  f.ws_peers = ws.device_peers;
  f.ws_offset = ws.offset;
  f.row_bytes = static_cast<uint64_t>(k) * 2;
  f.shard_rows = static_cast<int>(p.shard_rows);
  f.n = static_cast<int>(n);
  f.raster = {static_cast<int>((p.shard_rows + 127) / 128),
              static_cast<int>((n + kBlockN - 1) / kBlockN)};
  f.piece_rows = p.piece_rows;
  f.pieces = p.pieces;
  f.comm_ctas = p.comm_ctas;
  f.routes = gather_routes(comm, p, ws, static_cast<uint64_t>(p.shard_rows) * k * 2);
  f.comm = comm.device_comm();  // (again: the inter-node path may have just been created)
  f.trace = fused::trace_arm(comm, p.ctas, stream);
  const CUtensorMap map_b = gemm_engine::make_b_map(b, n, k, kBlockN, kTransB);
  gemm_engine::launch<kBlockN, kTransB, Fusion>(f, map_b, k, p.ctas, stream, kOp);
}

}  // namespace

std::size_t ag_gemm_workspace_bytes(int64_t m, int64_t k) {
  if (m < 0 || k < 0) invalid("negative M or K");
  return static_cast<std::size_t>(m) * static_cast<std::size_t>(k) * 2;
}

FusedGemmPlan ag_gemm_plan(const Communicator& comm, int64_t m, int64_t n, int64_t k,
                           const FusedGemmConfig& config) {
  return fused::plan_ag_gemm(fused::plan_context(comm), m, n, k,
                             fused::with_overrides(config, comm.overrides()));
}

std::string FusedGemmPlan::describe() const {
  char line[256];
  std::snprintf(line, sizeof(line),
                "shards of %lld rows, tiles 128x%d, %d CTAs (%d moving data), pieces of %d rows "
                "(%d per shard), workspace %zu bytes (staging %zu: %d outbox slots per consumer), "
                "lag %d%s%s%s%s%s",
                static_cast<long long>(shard_rows), block_n, ctas, comm_ctas, piece_rows, pieces,
                workspace_bytes, staging_bytes, outbox_slots, lag,
                bf16_partials ? ", bf16 partials" : "", tma_partials ? ", TMA partials" : "",
                tma_staging ? ", TMA staging" : "", tma_sends ? ", TMA sends" : "",
                nodes > 1 ? (", across " + std::to_string(nodes) + " nodes").c_str() : "");
  return line;
}

void ag_gemm(Communicator& comm, const void* a_shard, const void* b, void* c, int64_t m, int64_t n,
             int64_t k, BLayout b_layout, void* workspace, cudaStream_t stream,
             const FusedGemmConfig& config, void* gathered_a) {
  detail::DeviceGuard guard(comm.device());
  fused::check_call(comm, stream, b_layout, kOp, /*across_nodes=*/true);
  const AgGemmPlan p = fused::plan_ag_gemm(fused::plan_context(comm), m, n, k,
                                           fused::with_overrides(config, comm.overrides()));
  const std::size_t shard_bytes = static_cast<std::size_t>(p.shard_rows) * k * 2;
  const std::size_t ws_bytes = ag_gemm_workspace_bytes(m, k);
  detail::require_device_pointer(comm, a_shard, 16, kOp, "a_shard");
  detail::require_device_pointer(comm, b, 16, kOp, "B");
  detail::require_device_pointer(comm, c, 16, kOp, "C");
  detail::require_device_pointer(comm, workspace, 16, kOp, "workspace");
  const SymmetricRange ws = detail::require_symmetric(comm, workspace, ws_bytes, kOp, "workspace");
  if (ws.offset % 16 != 0)
    invalid("workspace offset in its symmetric buffer is not 16-byte aligned");
  if (gathered_a != nullptr)
    detail::require_device_pointer(comm, gathered_a, 16, kOp, "gathered_a");
  const std::size_t c_bytes = static_cast<std::size_t>(m) * n * 2;
  const std::size_t b_bytes = static_cast<std::size_t>(n) * k * 2;
  detail::require_disjoint(kOp, {{"a_shard", a_shard, shard_bytes, false},
                                 {"B", b, b_bytes, false},
                                 {"C", c, c_bytes, true},
                                 {"workspace", workspace, ws_bytes, true},
                                 {"gathered_a", gathered_a, ws_bytes, true}});
  fused::print_plan(comm, kOp, m, n, k, p);
  gemm_engine::dispatch(p.block_n, b_layout == BLayout::kKN, [&]<int kBlockN, bool kTransB>() {
    if (p.nodes > 1) {
      launch<kBlockN, kTransB, true>(comm, p, a_shard, b, c, n, k, ws, workspace, stream);
    } else {
      launch<kBlockN, kTransB, false>(comm, p, a_shard, b, c, n, k, ws, workspace, stream);
    }
  });
  if (gathered_a != nullptr) {
    // The peers' shards from the workspace, this rank's from a_shard (not in the workspace).
    const int r = comm.rank();
    auto* out = static_cast<char*>(gathered_a);
    const auto* in = static_cast<const char*>(workspace);
    if (r > 0)
      MK_CUDA_CHECK(cudaMemcpyAsync(out, in, r * shard_bytes, cudaMemcpyDeviceToDevice, stream));
    MK_CUDA_CHECK(cudaMemcpyAsync(out + r * shard_bytes, a_shard, shard_bytes,
                                  cudaMemcpyDeviceToDevice, stream));
    const std::size_t rest = (comm.world_size() - 1 - r) * shard_bytes;
    if (rest > 0) {
      MK_CUDA_CHECK(cudaMemcpyAsync(out + (r + 1) * shard_bytes, in + (r + 1) * shard_bytes, rest,
                                    cudaMemcpyDeviceToDevice, stream));
    }
  }
}

namespace detail {

std::vector<GemmKernelResources> ag_gemm_kernel_resources() {
  std::vector<GemmKernelResources> out;
  gemm_engine::for_each_width([&]<int kBlockN, bool kTransB>() {
    const std::string name = std::to_string(kBlockN) + (kTransB ? " B[K,N]" : " B[N,K]");
    out.push_back(kernel_resources(
        "ag_gemm " + name,
        reinterpret_cast<const void*>(
            gemm_engine::prepared_kernel<kBlockN, kTransB, fused::AgGemmFusion<kBlockN>>())));
    out.push_back(kernel_resources(
        "ag_gemm nodes " + name,
        reinterpret_cast<const void*>(
            gemm_engine::prepared_kernel<kBlockN, kTransB, fused::AgGemmAcrossNodes<kBlockN>>())));
  });
  return out;
}

namespace {

// Every ag_gemm kernel the plans can pick (runtime/kernel_preload.h).
void preload_ag_gemm_kernels(bool across_nodes) {
  gemm_engine::preload_all<fused::AgGemmFusion>();
  if (across_nodes) gemm_engine::preload_all<fused::AgGemmAcrossNodes>();
}

const bool kPreloadRegistered = register_kernel_preload(&preload_ag_gemm_kernels);

}  // namespace
}  // namespace detail

}  // namespace mk
