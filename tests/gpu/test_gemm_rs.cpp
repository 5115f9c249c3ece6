// GEMM + ReduceScatter (mk::gemm_rs) at world sizes 1, 2, 4 and 8 - in one process (threads;
// ranks share a GPU when there are fewer GPUs than ranks) and as mkrun processes. Every rank
// rebuilds all ranks' inputs from the shared seed, concatenates them along K, and checks its
// output rows against the fp64 product by the tolerance rule (within twice the error of cuBLAS on
// the concatenated operands, i.e. NCCL-free "GEMM then reduce" in fp32). Fresh random data,
// poisoned outputs, shards not a multiple of the 128-row tile, the workspace left zero (3+ ranks)
// after every call, CUDA-graph replay with new inputs, the time limit, and argument errors.
#include <chrono>

#include "across_nodes_checks.h"
#include "collective_checks.h"
#include "gemm_reference.h"
#include "mkernel/fused.h"
#include "reduce_checks.h"

namespace mk::test {
namespace {

struct RsCase {
  int64_t shard_rows, n, k_local;
  BLayout layout;
  int block_n;  // 0 = heuristic
};

void expect_gemm_rs(Communicator& comm, const RsCase& c, uint64_t seed,
                    FusedGemmConfig config = {}) {
  const int world = comm.world_size(), rank = comm.rank();
  const std::string what = "gemm_rs world " + std::to_string(world) + ", shard " +
                           std::to_string(c.shard_rows) + " x N " + std::to_string(c.n) +
                           " x K_r " + std::to_string(c.k_local) +
                           (c.layout == BLayout::kKN ? ", B [K, N]" : ", B [N, K]") + ", block_n " +
                           std::to_string(c.block_n) + ", rank " + std::to_string(rank);
  SCOPED_TRACE(what);
  config.block_n = c.block_n;
  const bool kn = c.layout == BLayout::kKN;
  RsProblem p(world, c.shard_rows * world, c.n, c.k_local, kn);
  const std::size_t ws_bytes = gemm_rs_workspace_bytes(comm, p.m, p.n);
  SymmetricBuffer ws = comm.alloc(std::max<std::size_t>(ws_bytes, 16));
  // What the kernel leaves zero: the accumulators peers add into (more than two ranks per node) -
  // one node's [S][N] fp32, or across nodes the own rows' and each relayed node's (the staging
  // and inbound node sums after them are overwritten by every call).
  const int nodes = comm.topology().num_nodes, per_node = comm.topology().local_size;
  const std::size_t one_region = gemm_rs_workspace_bytes(p.m, p.n, world);
  const std::size_t zeroed = per_node > 2 ? (nodes > 1 ? nodes * one_region : one_region) : 0;
  cudaStream_t stream;
  MKT_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  void *out, *c_blas, *zeros;
  MKT_CUDA(cudaMalloc(&out, c.shard_rows * c.n * 2));
  MKT_CUDA(cudaMalloc(&c_blas, p.m * p.n * 2));
  MKT_CUDA(cudaMalloc(&zeros, std::max<std::size_t>(ws_bytes, 16)));
  MKT_CUDA(cudaMemsetAsync(zeros, 0, std::max<std::size_t>(ws_bytes, 16), stream));
  MKT_CUDA(cudaMemsetAsync(ws.data(), 0, ws.size(), stream));  // the contract: zero at first use
  cublasHandle_t blas;
  ASSERT_EQ(cublasCreate(&blas), CUBLAS_STATUS_SUCCESS);
  cublasSetStream(blas, stream);
  // Two calls with different data: the second finds the workspace as the first left it.
  for (int call = 0; call < 2; ++call) {
    p.fill(seed + 31 * call, rank, stream);
    MKT_CUDA(cudaMemsetAsync(out, 0xFF, c.shard_rows * c.n * 2, stream));  // bf16 NaN
    ready(comm, stream);
    gemm_rs(comm, p.a_mine, p.b_mine, out, p.m, p.n, p.k_local, c.layout, ws.data(), stream,
            config);
    finished(comm, stream);
    const std::string call_what = what + ", call " + std::to_string(call);
    EXPECT_EQ(count_nans_bf16(out, c.shard_rows * c.n, stream), 0u)
        << call_what << ": output elements unwritten (or NaN)";
    // bf16 partials (two ranks) round as the sequential baseline does: its error is the bar.
    const FusedGemmPlan plan = gemm_rs_plan(comm, p.m, p.n, p.k_local, config);
    expect_rows_close(p, rank * c.shard_rows, c.shard_rows, out, blas, c_blas, seed + call, stream,
                      call_what + (plan.bf16_partials ? ", bf16 partials" : ""),
                      baseline_for(plan));
    if (zeroed > 0) {  // peers add into it: it must be zero for the next call
      EXPECT_EQ(count_different_bytes16(ws.data(), zeros, zeroed, stream), 0u)
          << call_what << ": the workspace was not left zero";
    }
    comm.bootstrap().barrier();
  }
  cublasDestroy(blas);
  for (void* q : {out, c_blas, zeros}) cudaFree(q);
  cudaStreamDestroy(stream);
}

// `base`: the config of every case (each case sets its block_n).
void expect_gemm_rs_cases(Communicator& comm, const FusedGemmConfig& base = {}) {
  const uint64_t seed = shared_seed(comm);
  const std::vector<RsCase> cases = {
      {1, 8, 8, BLayout::kNK, 0},
      {200, 264, 136, BLayout::kNK, 0},
      {200, 264, 136, BLayout::kKN, 192},
      {333, 520, 1000, BLayout::kNK, 64},
      {1000, 1024, 512, BLayout::kKN, 0},
      {1000, 1024, 512, BLayout::kNK, 256},
      {517, 2056, 256, BLayout::kNK, 128},
      {2048, 2048, 64, BLayout::kNK, 0},  // CTAs with two whole own tiles: through the outbox
  };
  for (std::size_t i = 0; i < cases.size(); ++i) {
    expect_gemm_rs(comm, cases[i], seed + 100 * i, base);
  }
}

// Across (virtual) nodes (issue 8, gemm_rs_nodes.cuh): partials of other nodes' rows meet at
// the relay of their rail and cross the socket transport once per node as fp32 sums. Tiles at
// most 128 wide there.
void expect_gemm_rs_across_nodes(Communicator& comm) {
  const uint64_t seed = shared_seed(comm);
  EXPECT_EQ(gemm_rs_plan(comm, comm.world_size() * 200, 264, 136).nodes, comm.topology().num_nodes);
  const std::vector<RsCase> cases = {
      {1, 8, 8, BLayout::kNK, 0},         {200, 264, 136, BLayout::kNK, 0},
      {333, 520, 1000, BLayout::kKN, 64}, {1000, 1024, 512, BLayout::kNK, 128},
      {517, 2056, 256, BLayout::kKN, 0},
  };
  for (std::size_t i = 0; i < cases.size(); ++i) expect_gemm_rs(comm, cases[i], seed + 100 * i);
  // bf16 on the wire (node sums; the node's partials at two ranks per node): the sequential
  // baseline's error is the bar.
  FusedGemmConfig bf16;
  bf16.bf16_partials = true;
  expect_gemm_rs(comm, cases[1], seed + 1000, bf16);
  expect_gemm_rs(comm, cases[4], seed + 1001, bf16);
}

// (ctest runs these as gpu_gemm_rs_nodes, with a time limit of their own.) 3x3: three ranks
// per node, so relays and owners add (not store) the node's partials.
class GemmRsNodes : public AcrossNodes {};
TEST_P(GemmRsNodes, MatchesReference) {
  MKT_REQUIRE_GPU();
  const auto [nodes, per_node] = GetParam();
  run_in_process(nodes * per_node, expect_gemm_rs_across_nodes, virtual_nodes(per_node, 20));
}
INSTANTIATE_TEST_SUITE_P(GemmRsAcrossNodes, GemmRsNodes,
                         ::testing::Values(NodesLayout{2, 1}, NodesLayout{2, 2}, NodesLayout{3, 2},
                                           NodesLayout{2, 4}, NodesLayout{3, 3}),
                         layout_name);

TEST(GemmRsAcrossNodes, RejectsWideTiles) {
  MKT_REQUIRE_GPU();
  run_in_process(
      2,
      [](Communicator& comm) {
        FusedGemmConfig wide;
        wide.block_n = 256;
        expect_error([&] { gemm_rs_plan(comm, 512, 512, 64, wide); }, ErrorCode::kInvalidArgument,
                     "across nodes at most 128");
        EXPECT_LE(gemm_rs_plan(comm, 4096, 8192, 4096).block_n, 128);
      },
      virtual_nodes(1));
}

class InProcessGemmRs : public ::testing::TestWithParam<int> {};

TEST_P(InProcessGemmRs, MatchesReference) {
  MKT_REQUIRE_GPU();
  run_in_process(GetParam(), [](Communicator& comm) { expect_gemm_rs_cases(comm); });
}

INSTANTIATE_TEST_SUITE_P(World, InProcessGemmRs, ::testing::Values(1, 2, 4, 8),
                         [](const auto& info) { return "w" + std::to_string(info.param); });

TEST(InProcessGemmRs, LargeWorld2) {
  MKT_REQUIRE_GPU();
  run_in_process(2, [](Communicator& comm) {
    const uint64_t seed = shared_seed(comm);
    EXPECT_TRUE(gemm_rs_plan(comm, 2048, 4096, 2048).tma_sends);  // busy slots: TMA sends
    expect_gemm_rs(comm, {2048, 4096, 2048, BLayout::kNK, 0}, seed);
    expect_gemm_rs(comm, {1000, 8192, 4096, BLayout::kKN, 0}, seed + 1);
  });
}

// FusedGemmConfig::tma_sends off: every peer's slice through the outbox (or the epilogue's own
// stores without one) - the two-rank paths TMA sends are measured against.
TEST(InProcessGemmRs, ThreadSendsWorld2) {
  MKT_REQUIRE_GPU();
  run_in_process(2, [](Communicator& comm) {
    const FusedGemmConfig threads{.tma_sends = false};
    EXPECT_FALSE(gemm_rs_plan(comm, 2048, 4096, 1024, threads).tma_sends);
    const uint64_t seed = shared_seed(comm);
    expect_gemm_rs(comm, {1000, 1024, 512, BLayout::kKN, 0}, seed, threads);
    expect_gemm_rs(comm, {2048, 4096, 2048, BLayout::kNK, 0}, seed + 1, threads);
  });
}

TEST(LaunchedGemmRs, MatchesReference) {
  MKT_REQUIRE_MKRUN();
  auto comm = launched_comm();
  expect_gemm_rs_cases(*comm);
}

TEST(SanitizeGemmRs, SmallWorld2) {
  MKT_REQUIRE_GPU();
  run_in_process(2, [](Communicator& comm) {
    const uint64_t seed = shared_seed(comm);
    expect_gemm_rs(comm, {130, 136, 72, BLayout::kNK, 0}, seed);
    expect_gemm_rs(comm, {70, 200, 64, BLayout::kKN, 64}, seed + 1);
    FusedGemmConfig four_ctas;  // two whole own tiles per CTA: the outbox, one slot per consumer
    four_ctas.sms = 4;
    expect_gemm_rs(comm, {256, 512, 64, BLayout::kNK, 128}, seed + 2, four_ctas);
    // 16 own tiles on 4 CTAs: peers' and own tiles interleave after a lag of two waves, on 3 CTAs
    // (a grid coprime to the world size)
    four_ctas.block_n = 128;
    EXPECT_EQ(gemm_rs_plan(comm, 2 * 512, 512, 64, four_ctas).ctas, 3);
    EXPECT_EQ(gemm_rs_plan(comm, 2 * 512, 512, 64, four_ctas).lag, 6);
    expect_gemm_rs(comm, {512, 512, 64, BLayout::kNK, 128}, seed + 3, four_ctas);
    four_ctas.bf16_partials = true;  // bf16 staging: two slots per footprint
    expect_gemm_rs(comm, {512, 512, 64, BLayout::kNK, 128}, seed + 4, four_ctas);
    expect_gemm_rs(comm, {130, 136, 72, BLayout::kNK, 0}, seed + 5, {.bf16_partials = true});
  });
}

// FusedGemmConfig::bf16_partials (opt-in; two ranks): the peer's partial sums travel as bf16 and
// the bar is the sequential baseline's error (reduce_checks.h) - the cases, and a large shape
// through the outbox (two bf16 staging slots per footprint).
TEST(InProcessGemmRs, PartialsBf16World2) {
  MKT_REQUIRE_GPU();
  run_in_process(2, [](Communicator& comm) {
    FusedGemmConfig bf16;
    bf16.bf16_partials = true;
    EXPECT_FALSE(gemm_rs_plan(comm, 4096, 4096, 1024).bf16_partials);
    const FusedGemmPlan plan = gemm_rs_plan(comm, 4096, 4096, 1024, bf16);
    EXPECT_TRUE(plan.bf16_partials) << plan.describe();
    expect_gemm_rs_cases(comm, bf16);
    expect_gemm_rs(comm, {4096, 8192, 256, BLayout::kNK, 0}, shared_seed(comm) + 9, bf16);
  });
}

TEST(InProcessGemmRs, InterleavedWorld4) {
  MKT_REQUIRE_GPU();
  run_in_process(4, [](Communicator& comm) {
    FusedGemmConfig four_ctas;
    four_ctas.sms = 4;
    four_ctas.block_n = 128;
    EXPECT_EQ(gemm_rs_plan(comm, 4 * 512, 512, 64, four_ctas).lag, 18);  // 3 CTAs
    expect_gemm_rs(comm, {512, 512, 64, BLayout::kKN, 128}, shared_seed(comm), four_ctas);
  });
}

// One graph = gemm_rs; before each replay a new A_r is copied in, after it the output is copied
// to a history slot; every replay's rows must match that replay's reference.
void expect_gemm_rs_graph(Communicator& comm, int replays) {
  const int world = comm.world_size(), rank = comm.rank();
  const int64_t shard = 136, n = 256, k_local = 64;
  const uint64_t seed = shared_seed(comm);
  RsProblem p(world, shard * world, n, k_local, false);
  SymmetricBuffer ws = comm.alloc(std::max<std::size_t>(gemm_rs_workspace_bytes(comm, p.m, n), 16));
  cudaStream_t stream;
  MKT_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  void *a_in, *out, *history, *c_blas;
  MKT_CUDA(cudaMalloc(&a_in, p.m * k_local * 2));
  MKT_CUDA(cudaMalloc(&out, shard * n * 2));
  MKT_CUDA(cudaMalloc(&history, replays * shard * n * 2));
  MKT_CUDA(cudaMalloc(&c_blas, p.m * n * 2));
  MKT_CUDA(cudaMemsetAsync(ws.data(), 0, ws.size(), stream));
  MKT_CUDA(cudaMemsetAsync(history, 0xFF, replays * shard * n * 2, stream));
  cublasHandle_t blas;
  ASSERT_EQ(cublasCreate(&blas), CUBLAS_STATUS_SUCCESS);
  cublasSetStream(blas, stream);
  p.fill(seed, rank, stream);  // B stays; A changes per replay
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  MKT_CUDA(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  gemm_rs(comm, a_in, p.b_mine, out, p.m, n, k_local, BLayout::kNK, ws.data(), stream);
  MKT_CUDA(cudaStreamEndCapture(stream, &graph));
  ASSERT_NO_FATAL_FAILURE(instantiate_uploaded(graph, stream, &exec));
  std::vector<uint64_t> a_seeds(replays);
  for (int i = 0; i < replays; ++i) a_seeds[i] = seed + 7919 * (i + 1);
  ready(comm, stream);
  for (int i = 0; i < replays; ++i) {
    fill_random_bf16(a_in, p.m * k_local, rank_seed(a_seeds[i], rank, 0), stream);
    MKT_CUDA(cudaGraphLaunch(exec, stream));
    MKT_CUDA(cudaMemcpyAsync(static_cast<char*>(history) + i * shard * n * 2, out, shard * n * 2,
                             cudaMemcpyDeviceToDevice, stream));
  }
  finished(comm, stream);
  for (int i = 0; i < replays; ++i) {
    p.fill(a_seeds[i], seed, rank, stream);  // replay i's A, the B the graph used
    expect_rows_close(p, rank * shard, shard, static_cast<char*>(history) + i * shard * n * 2, blas,
                      c_blas, seed + i, stream, "replay " + std::to_string(i),
                      baseline_for(gemm_rs_plan(comm, p.m, n, k_local)));
  }
  comm.bootstrap().barrier();
  cublasDestroy(blas);
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  for (void* q : {a_in, out, history, c_blas}) cudaFree(q);
  cudaStreamDestroy(stream);
}

TEST(InProcessGemmRs, GraphReplays100Times) {
  MKT_REQUIRE_GPU();
  run_in_process(2, [](Communicator& comm) { expect_gemm_rs_graph(comm, 100); });
}

// A graph of one launch across 2 x 2 virtual nodes, its first call (the inter-node path, the
// workspace's registration) inside the capture.
TEST(GemmRsAcrossNodes, GraphReplays30Times) {
  MKT_REQUIRE_GPU();
  run_in_process(
      4, [](Communicator& comm) { expect_gemm_rs_graph(comm, 30); }, virtual_nodes(2, 20));
}

TEST(LaunchedGemmRs, GraphReplays100Times) {
  MKT_REQUIRE_MKRUN();
  auto comm = launched_comm();
  expect_gemm_rs_graph(*comm, comm->topology().max_ranks_per_device > 1 ? 30 : 100);
}

void expect_gemm_rs_timeout(Communicator& comm) {
  const int world = comm.world_size();
  const int64_t shard = 256, m = shard * world, n = 256, k = 256;
  SymmetricBuffer ws = comm.alloc(gemm_rs_workspace_bytes(m, n, world));
  cudaStream_t stream;
  MKT_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  void *a, *b, *out;
  MKT_CUDA(cudaMalloc(&a, m * k * 2));
  MKT_CUDA(cudaMalloc(&b, n * k * 2));
  MKT_CUDA(cudaMalloc(&out, shard * n * 2));
  fill_random_bf16(a, m * k, 1, stream);
  fill_random_bf16(b, n * k, 2, stream);
  MKT_CUDA(cudaMemsetAsync(ws.data(), 0, ws.size(), stream));
  ready(comm, stream);
  expect_missing_rank_times_out(
      comm, stream, [&] { gemm_rs(comm, a, b, out, m, n, k, BLayout::kNK, ws.data(), stream); });
  for (void* q : {a, b, out}) cudaFree(q);
  cudaStreamDestroy(stream);
}

TEST(InProcessGemmRs, MissingRankTimesOut) {
  MKT_REQUIRE_GPU();
  CommOptions options;
  options.timeout_seconds = 1.0;
  run_in_process(2, expect_gemm_rs_timeout, options);
}

TEST(InProcessGemmRs, RejectsBadArgumentsBeforeLaunch) {
  MKT_REQUIRE_GPU();
  run_in_process(2, [](Communicator& comm) {
    SymmetricBuffer ws = comm.alloc(1 << 20);
    void* p;
    ASSERT_EQ(cudaMalloc(&p, 1 << 20), cudaSuccess);
    char* q = static_cast<char*>(p);
    char* w = static_cast<char*>(ws.data());
    cudaStream_t s = nullptr;
    auto call = [&](int64_t m, int64_t n, int64_t k, void* workspace) {
      gemm_rs(comm, q, q + 4096, q + (1 << 19), m, n, k, BLayout::kNK, workspace, s);
    };
    expect_error([&] { call(3, 8, 8, w); }, ErrorCode::kInvalidArgument,
                 "M = 3 is not a positive multiple of the world size 2");
    expect_error([&] { call(4, 12, 8, w); }, ErrorCode::kInvalidArgument, "N = 12");
    expect_error([&] { call(4, 8, 4, w); }, ErrorCode::kInvalidArgument, "K_r = 4");
    expect_error([&] { call(4, 8, 8, q + 100000); }, ErrorCode::kInvalidArgument, "workspace");
    expect_error([&] { call(1024, 1024, 8, w); }, ErrorCode::kOutOfMemory,
                 "workspace");  // 2 MiB of fp32 accumulator needed, 1 MiB there
    FusedGemmConfig bad;
    bad.block_n = 96;
    expect_error([&] { gemm_rs(comm, q, q, q + 8192, 4, 8, 8, BLayout::kNK, w, s, bad); },
                 ErrorCode::kInvalidArgument, "block_n = 96");
    comm.bootstrap().barrier();
    cudaFree(p);
  });
}

}  // namespace

void expect_gemm_rs_nodes(Communicator& comm) { expect_gemm_rs_across_nodes(comm); }

}  // namespace mk::test
