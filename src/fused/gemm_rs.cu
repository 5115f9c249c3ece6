// Host side of GEMM + ReduceScatter: validate -> plan -> tensor maps -> launch.
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "fused/fused_common.h"
#include "fused/gemm_rs.cuh"
#include "fused/gemm_rs_nodes.cuh"
#include "fused/node_links_host.cuh"
#include "fused/plans.h"
#include "fused/trace_layout.h"
#include "gemm/gemm_internal.h"
#include "gemm/launch.cuh"
#include "mkernel/error.h"
#include "mkernel/fused.h"
#include "runtime/cuda_check.h"
#include "runtime/device_guard.h"
#include "runtime/kernel_preload.h"
#include "runtime/validate.h"

namespace mk {
namespace {

constexpr const char* kOp = "gemm_rs";

[[noreturn]] void invalid(const std::string& what) {
  throw Error(ErrorCode::kInvalidArgument, std::string(kOp) + ": " + what);
}

}  // namespace

FusedGemmPlan fused::plan_gemm_rs(const fused::PlanContext& comm, int64_t m, int64_t n, int64_t k,
                                  const FusedGemmConfig& config) {
  const int world = comm.world_size();
  fused::check_shapes(comm, m, n, k, kOp, "K_r");
  if (comm.local_size > fused::kMaxLocalRanks) {
    invalid("at most " + std::to_string(fused::kMaxLocalRanks) + " ranks per node are supported");
  }
  if (config.comm_ctas < 0 || config.piece_rows < 0) invalid("negative comm_ctas or piece_rows");
  FusedGemmPlan p{};
  p.shard_rows = m / world;
  const int64_t tiles_m = (p.shard_rows + 127) / 128;
  const int budget = fused::sm_budget(comm, config.sms, kOp);
  p.nodes = comm.nodes;
  p.block_n = gemm_engine::pick_block_n(config.block_n, world * tiles_m * 128, n, budget, kOp);
  if (p.nodes > 1) {
    // Across nodes the relay's and the owner's epilogues (several partial sums, a command) do
    // not fit next to a 128 x 192 or 128 x 256 accumulator (they spilled 64 and 580 bytes).
    if (config.block_n > fused::kMaxReduceBlockN) {
      invalid("block_n = " + std::to_string(config.block_n) + ": across nodes at most " +
              std::to_string(fused::kMaxReduceBlockN));
    }
    p.block_n = std::min(p.block_n, fused::kMaxReduceBlockN);
  }
  const int64_t tiles_n = (n + p.block_n - 1) / p.block_n;
  // One op signal per consumer slice of a tile (two per tile) of a shard.
  if (2 * tiles_m * tiles_n > kMaxOpSignals) {
    invalid("a shard of " + std::to_string(p.shard_rows) + " x " + std::to_string(n) + " has " +
            std::to_string(tiles_m * tiles_n) + " tiles of 128 x " + std::to_string(p.block_n) +
            "; at most " + std::to_string(kMaxOpSignals / 2) +
            " are supported (use a wider block_n or fewer rows per call)");
  }
  p.ctas = static_cast<int>(std::min<int64_t>(world * tiles_m * tiles_n, budget));
  p.comm_ctas = 0;  // the consumers' epilogues move the data
  p.piece_rows = 128;
  p.pieces = static_cast<int>(tiles_m);
  p.workspace_bytes = gemm_rs_workspace_bytes(m, n, world);
  if (p.nodes > 1) {
    // Across nodes (gemm_rs_nodes.cuh, reduce_routes.h): 3 x nodes - 2 regions of S x N fp32;
    // op signals for the own rows and each relayed node, host-pad signals for one node's sums.
    if (world > kMaxReduceRanks) {
      invalid("across nodes at most " + std::to_string(kMaxReduceRanks) + " ranks; got " +
              std::to_string(world));
    }
    const int64_t slices = 2 * tiles_m * tiles_n;
    if (p.nodes * slices > kMaxOpSignals || slices + 1 > kInterNodeSignals) {
      invalid(
          "across " + std::to_string(p.nodes) + " nodes a shard of " +
          std::to_string(p.shard_rows) + " x " + std::to_string(n) + " has " +
          std::to_string(slices / 2) + " tiles of 128 x " + std::to_string(p.block_n) +
          "; at most " +
          std::to_string(std::min<int64_t>(kMaxOpSignals / p.nodes, kInterNodeSignals - 1) / 2) +
          " are supported across nodes (use fewer rows or columns per call)");
    }
    p.workspace_bytes *= static_cast<std::size_t>(3 * p.nodes - 2);
    // bf16 on the wire when asked: the node sums, and the node's partials at two ranks per node
    // (one sender per region; more are added in fp32) - NodeLinks::bf16_sums / bf16_local.
    p.bf16_partials = config.bf16_partials;
    p.lag = -1;  // blocked order along the rail routes, no outbox
    return p;
  }
  p.bf16_partials = world == 2 && config.bf16_partials;
  // Two ranks, fp32 partials, and the accumulator seen as 64-row views of whole slices (the
  // `partials` tensor maps): the slices must start at a multiple of the tile width
  // (64 N % block_n == 0: always but at 192 wide), and a whole tile must exist (S >= 128,
  // N >= block_n) for the maps to have their 64-row boxes.
  const bool slice_views = world == 2 && !p.bf16_partials && (64 * n) % p.block_n == 0 &&
                           p.shard_rows >= 128 && n >= p.block_n;
  // Through those views the peer's partials of whole own tiles reach the epilogue by the stage
  // ring (gemm_rs.cuh).
  p.tma_partials = slice_views;
  // fp32 partials through the outbox: staged by TMA stores into the output footprints of whole
  // own tiles (gemm_rs.cuh, store_staged_chunk) - the outbox needs such tiles anyway.
  p.tma_staging = world > 1 && !p.bf16_partials && p.shard_rows >= 128 && n >= p.block_n;
  // And a whole slice whose staging slot is busy (or that has none) goes straight into the peer's
  // accumulator by TMA stores (gemm_rs.cuh), through the same view of the peer's.
  p.tma_sends = slice_views && config.tma_sends;
  // Peers' tiles and own tiles interleaved (reduce_order.h) when every CTA still gets two own
  // tiles after the last remote one for its outbox staging: lag = two waves of remote tiles, on
  // a grid coprime to the world size (every CTA then sends its share).
  p.lag = -1;
  if (world > 1 && tiles_m * tiles_n >= 2 * static_cast<int64_t>(p.ctas)) {
    p.ctas = fused::ReduceOrder::interleave_grid(p.ctas, world);
    p.lag = 2 * (world - 1) * p.ctas;
  }
  return p;
}

namespace {

template <int kBlockN, bool kTransB>
void launch(const Communicator& comm, const FusedGemmPlan& p, const void* a, const void* b,
            void* out, int64_t n, int64_t k, const SymmetricRange& ws, void* workspace,
            cudaStream_t stream) {
  using Fusion = fused::GemmRsFusion<kBlockN>;
  const Topology& topo = comm.topology();
  Fusion f{};
  f.a = gemm_engine::make_map_3d(a, topo.world_size, p.shard_rows, k, 128);
  f.a_last = gemm_engine::make_map_3d(a, topo.world_size, p.shard_rows, k,
                                      gemm_engine::last_tile_rows(p.shard_rows));
  f.out = gemm_engine::make_map(out, p.shard_rows, n, 64);
  // The accumulators as mapped here: each rank's buffer base plus the workspace's offset.
  for (int i = 0; i < topo.local_size; ++i) {
    f.accum_peers[i] = reinterpret_cast<float*>(ws.host_peers[i] + ws.offset);
  }
  f.comm = comm.device_comm();
  f.my_accum = static_cast<float*>(workspace);
  f.single_peer = topo.world_size == 2;
  f.bf16_partials = p.bf16_partials && f.single_peer;
  f.tma_partials = p.tma_partials;
  if (p.tma_partials) {
    f.partials = gemm_engine::make_map_fp32(workspace, p.shard_rows * n / kBlockN, kBlockN, 64);
  }
  f.tma_staging = p.tma_staging;
  f.tma_sends = p.tma_sends;
  if (p.tma_sends) {
    f.peer_partials = gemm_engine::make_map_fp32(f.accum_peers[1 - topo.local_rank],
                                                 p.shard_rows * n / kBlockN, kBlockN, 64);
  }
  if (p.tma_staging) f.staging = gemm_engine::make_map_fp32_row_pairs(out, p.shard_rows, n);
  f.out_local = static_cast<__nv_bfloat16*>(out);
  f.shard_rows = static_cast<int>(p.shard_rows);
  f.n = static_cast<int>(n);
  f.raster = {static_cast<int>((p.shard_rows + 127) / 128),
              static_cast<int>((n + kBlockN - 1) / kBlockN)};
  f.order = {topo.world_size, f.raster.tiles_m * f.raster.tiles_n, p.lag};
  f.trace = fused::trace_arm(comm, p.ctas, stream);
  const CUtensorMap map_b = gemm_engine::make_b_map(b, n, k, kBlockN, kTransB);
  gemm_engine::launch<kBlockN, kTransB>(f, map_b, k, p.ctas, stream, kOp);
}

// Across nodes (gemm_rs_nodes.cuh): the rail routes as the kernel's ReduceRoutes, the
// communicator's inter-node rings, and the workspace's allocation registered with its path.
template <int kBlockN, bool kTransB>
void launch_across_nodes(Communicator& comm, const FusedGemmPlan& p, const void* a, const void* b,
                         void* out, int64_t n, int64_t k, const SymmetricRange& ws, void* workspace,
                         cudaStream_t stream) {
  using Fusion = fused::GemmRsAcrossNodes<kBlockN>;
  const Topology& topo = comm.topology();
  Fusion f{};
  f.a = gemm_engine::make_map_3d(a, topo.world_size, p.shard_rows, k, 128);
  f.a_last = gemm_engine::make_map_3d(a, topo.world_size, p.shard_rows, k,
                                      gemm_engine::last_tile_rows(p.shard_rows));
  f.out = gemm_engine::make_map(out, p.shard_rows, n, 64);
  for (int i = 0; i < topo.local_size; ++i) {
    f.ws_local[i] = reinterpret_cast<float*>(ws.host_peers[i] + ws.offset);
  }
  f.my_ws = static_cast<float*>(workspace);
  f.links = fused::node_links(comm, ws, static_cast<uint64_t>(p.shard_rows) * n * 4,
                              3 * topo.num_nodes - 2);  // reduce_routes.h's regions
  f.links.bf16_sums = p.bf16_partials;
  f.links.bf16_local = p.bf16_partials && topo.local_size == 2;
  f.comm = comm.device_comm();  // (after the inter-node path exists: its host pad)
  f.shard_rows = static_cast<int>(p.shard_rows);
  f.n = static_cast<int>(n);
  f.raster = {static_cast<int>((p.shard_rows + 127) / 128),
              static_cast<int>((n + kBlockN - 1) / kBlockN)};
  f.trace = fused::trace_arm(comm, p.ctas, stream);
  const CUtensorMap map_b = gemm_engine::make_b_map(b, n, k, kBlockN, kTransB);
  gemm_engine::launch<kBlockN, kTransB, Fusion>(f, map_b, k, p.ctas, stream, kOp);
}

}  // namespace

std::size_t gemm_rs_workspace_bytes(const Communicator& comm, int64_t m, int64_t n) {
  const int nodes = comm.topology().num_nodes;
  const std::size_t one_node = gemm_rs_workspace_bytes(m, n, comm.world_size());
  return nodes > 1 ? one_node * static_cast<std::size_t>(3 * nodes - 2) : one_node;
}

std::size_t gemm_rs_workspace_bytes(int64_t m, int64_t n, int world_size) {
  if (m < 0 || n < 0 || world_size < 1) invalid("negative M or N, or world size < 1");
  if (world_size == 1) return 0;  // one rank: a plain GEMM, no accumulator
  return static_cast<std::size_t>(m / world_size) * static_cast<std::size_t>(n) * 4;
}

FusedGemmPlan gemm_rs_plan(const Communicator& comm, int64_t m, int64_t n, int64_t k_local,
                           const FusedGemmConfig& config) {
  return fused::plan_gemm_rs(fused::plan_context(comm), m, n, k_local,
                             fused::with_reduce_overrides(comm, config));
}

void gemm_rs(Communicator& comm, const void* a, const void* b, void* out, int64_t m, int64_t n,
             int64_t k, BLayout b_layout, void* workspace, cudaStream_t stream,
             const FusedGemmConfig& config) {
  detail::DeviceGuard guard(comm.device());
  fused::check_call(comm, stream, b_layout, kOp, /*across_nodes=*/true);
  const FusedGemmPlan p = fused::plan_gemm_rs(fused::plan_context(comm), m, n, k,
                                              fused::with_reduce_overrides(comm, config));
  detail::require_device_pointer(comm, a, 16, kOp, "A");
  detail::require_device_pointer(comm, b, 16, kOp, "B");
  detail::require_device_pointer(comm, out, 16, kOp, "out");
  const std::size_t out_bytes = static_cast<std::size_t>(p.shard_rows) * n * 2;
  const detail::Region a_region{"A", a, static_cast<std::size_t>(m) * k * 2, false};
  const detail::Region b_region{"B", b, static_cast<std::size_t>(n) * k * 2, false};
  const detail::Region out_region{"out", out, out_bytes, true};
  if (comm.world_size() == 1) detail::require_disjoint(kOp, {a_region, b_region, out_region});
  fused::print_plan(comm, kOp, m, n, k, p);
  if (comm.world_size() == 1) {  // nothing to reduce or scatter
    GemmConfig plain;
    plain.block_n = p.block_n;
    plain.sms = p.ctas;
    gemm(a, b, out, m, n, k, b_layout, stream, plain);
    return;
  }
  detail::require_device_pointer(comm, workspace, 16, kOp, "workspace");
  const SymmetricRange ws =
      detail::require_symmetric(comm, workspace, p.workspace_bytes, kOp, "workspace");
  if (ws.offset % 16 != 0)
    invalid("workspace offset in its symmetric buffer is not 16-byte aligned");
  detail::require_disjoint(
      kOp, {a_region, b_region, out_region, {"workspace", workspace, p.workspace_bytes, true}});
  gemm_engine::dispatch(p.block_n, b_layout == BLayout::kKN, [&]<int kBlockN, bool kTransB>() {
    if (p.nodes > 1) {
      if constexpr (kBlockN <= fused::kMaxReduceBlockN) {
        launch_across_nodes<kBlockN, kTransB>(comm, p, a, b, out, n, k, ws, workspace, stream);
      } else {
        throw Error(ErrorCode::kInternal, "gemm_rs: across nodes with block_n " +
                                              std::to_string(kBlockN) + " (the plan caps it)");
      }
    } else {
      launch<kBlockN, kTransB>(comm, p, a, b, out, n, k, ws, workspace, stream);
    }
  });
}

namespace detail {
namespace {

// Every gemm_rs kernel the plans can pick (runtime/kernel_preload.h).
void preload_gemm_rs_kernels(bool across_nodes) {
  gemm_engine::preload_all<fused::GemmRsFusion>();
  if (across_nodes) {  // the widths the plan allows across nodes
    gemm_engine::prepared_kernel<64, false, fused::GemmRsAcrossNodes<64>>();
    gemm_engine::prepared_kernel<64, true, fused::GemmRsAcrossNodes<64>>();
    gemm_engine::prepared_kernel<128, false, fused::GemmRsAcrossNodes<128>>();
    gemm_engine::prepared_kernel<128, true, fused::GemmRsAcrossNodes<128>>();
  }
}

const bool kPreloadRegistered = register_kernel_preload(&preload_gemm_rs_kernels);

}  // namespace
}  // namespace detail

}  // namespace mk
