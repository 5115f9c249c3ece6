// AllGather + GEMM (mk::ag_gemm) at world sizes 1, 2, 4 and 8 - in one process (threads; ranks
// share a GPU when there are fewer GPUs than ranks) and as mkrun processes - against:
//   - the gathered A: bitwise equal to the concatenation of every rank's shard (what NCCL's
//     all_gather returns, rebuilt locally from the shared seeds);
//   - C: bitwise equal to the plain GEMM engine on the gathered A with the same tile width, and
//     within the tolerance rule of the fp64 product (twice cuBLAS's error).
// Fresh random data each run, outputs poisoned before each call, shards of rows that are not a
// multiple of the 128-row tile. Also: CUDA-graph replay with new inputs, the time limit when a
// rank never joins, and argument errors. Across virtual nodes (issue 8): 2x1, 2x2, 3x2 and 2x4
// ranks, growing workspaces and a graph captured across nodes (as processes and with a rank
// killed mid-kernel: test_nodes_processes.cpp).
#include <stdexcept>

#include "across_nodes_checks.h"
#include "collective_checks.h"
#include "fused/plans.h"
#include "gemm/gemm_internal.h"
#include "gemm_reference.h"
#include "mkernel/fused.h"

namespace mk::test {
namespace {

struct AgCase {
  int64_t shard_rows, n, k;
  BLayout layout;
  int block_n;  // 0 = heuristic
};

std::string describe(const AgCase& c, int world) {
  return "ag_gemm world " + std::to_string(world) + ", shard " + std::to_string(c.shard_rows) +
         " x N " + std::to_string(c.n) + " x K " + std::to_string(c.k) +
         (c.layout == BLayout::kKN ? ", B [K, N]" : ", B [N, K]") + ", block_n " +
         std::to_string(c.block_n);
}

uint64_t shard_seed(uint64_t seed, int rank) { return seed * 1000003u + rank; }

// `shared_ws`: a workspace to use (at least this case's size) instead of a new one - across
// nodes, as callers do, one buffer registered with the inter-node path once.
void expect_ag_gemm(Communicator& comm, const AgCase& c, uint64_t seed, FusedGemmConfig config = {},
                    SymmetricBuffer* shared_ws = nullptr) {
  const int world = comm.world_size(), rank = comm.rank();
  SCOPED_TRACE(describe(c, world) + ", rank " + std::to_string(rank));
  const int64_t m = c.shard_rows * world, n = c.n, k = c.k;
  const bool kn = c.layout == BLayout::kKN;
  config.block_n = c.block_n;
  SymmetricBuffer own_ws;
  if (shared_ws == nullptr) own_ws = comm.alloc(ag_gemm_workspace_bytes(m, k));
  SymmetricBuffer& ws = shared_ws != nullptr ? *shared_ws : own_ws;
  cudaStream_t stream;
  MKT_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  void *a_shard, *b, *c_out, *gathered, *a_full, *c_ref, *c_blas;
  MKT_CUDA(cudaMalloc(&a_shard, c.shard_rows * k * 2));
  MKT_CUDA(cudaMalloc(&b, n * k * 2));
  MKT_CUDA(cudaMalloc(&c_out, m * n * 2));
  MKT_CUDA(cudaMalloc(&gathered, m * k * 2));
  MKT_CUDA(cudaMalloc(&a_full, m * k * 2));
  MKT_CUDA(cudaMalloc(&c_ref, m * n * 2));
  MKT_CUDA(cudaMalloc(&c_blas, m * n * 2));
  cublasHandle_t blas;
  ASSERT_EQ(cublasCreate(&blas), CUBLAS_STATUS_SUCCESS);
  cublasSetStream(blas, stream);
  fill_random_bf16(a_shard, c.shard_rows * k, shard_seed(seed, rank), stream);
  fill_random_bf16(b, n * k, seed ^ (0x77 + rank), stream);  // each rank its own B
  for (int s = 0; s < world; ++s) {
    fill_random_bf16(static_cast<char*>(a_full) + s * c.shard_rows * k * 2, c.shard_rows * k,
                     shard_seed(seed, s), stream);
  }
  MKT_CUDA(cudaMemsetAsync(c_out, 0xFF, m * n * 2, stream));  // bf16 NaN: unwritten shows
  MKT_CUDA(cudaMemsetAsync(gathered, 0xFF, m * k * 2, stream));
  // The workspace too: stale rows from an earlier case must not pass for new ones.
  MKT_CUDA(cudaMemsetAsync(ws.data(), 0xFF, ws.size(), stream));
  ready(comm, stream);

  ag_gemm(comm, a_shard, b, c_out, m, n, k, c.layout, ws.data(), stream, config, gathered);
  finished(comm, stream);

  EXPECT_EQ(count_different_bytes16(gathered, a_full, m * k * 2, stream), 0u)
      << "gathered A differs from the concatenated shards";
  EXPECT_EQ(count_nans_bf16(c_out, m * n, stream), 0u) << "C elements unwritten (or NaN)";
  GemmConfig plain;
  plain.block_n = ag_gemm_plan(comm, m, n, k, config).block_n;
  plain.split_k = 1;  // K whole, as ag_gemm computes it: the same sums, bit for bit
  gemm(a_full, b, c_ref, m, n, k, c.layout, stream, plain);
  cublas_gemm(blas, a_full, b, c_blas, m, n, k, kn);
  EXPECT_EQ(count_different_bytes16(c_out, c_ref, m * n * 2, stream), 0u)
      << "C differs from the GEMM engine on the gathered A (tile width " << plain.block_n << ")";
  const SampledErrors err = sampled_errors(c_out, c_blas, a_full, b, m, n, k, kn, seed, stream);
  EXPECT_LE(err.ours, 2 * err.cublas + 1e-6)
      << "error " << err.ours << ", cuBLAS error " << err.cublas;

  comm.bootstrap().barrier();  // no peer kernel is waiting for us while we free
  cublasDestroy(blas);
  for (void* p : {a_shard, b, c_out, gathered, a_full, c_ref, c_blas}) cudaFree(p);
  cudaStreamDestroy(stream);
}

void expect_ag_gemm_cases(Communicator& comm) {
  const uint64_t seed = shared_seed(comm);
  const std::vector<AgCase> cases = {
      {1, 8, 8, BLayout::kNK, 0},           {200, 264, 136, BLayout::kNK, 0},
      {200, 264, 136, BLayout::kKN, 192},   {333, 520, 1000, BLayout::kNK, 64},
      {1000, 1024, 1024, BLayout::kKN, 0},  {1000, 1024, 1024, BLayout::kNK, 256},
      {2048, 2048, 512, BLayout::kNK, 128},
  };
  for (std::size_t i = 0; i < cases.size(); ++i) expect_ag_gemm(comm, cases[i], seed + i);
  // Small pieces (many signals per tile) and only a few pushing CTAs.
  FusedGemmConfig few;
  few.comm_ctas = 3;
  few.piece_rows = 5;
  expect_ag_gemm(comm, {517, 384, 256, BLayout::kNK, 0}, seed + 100, few);
}

// Three calls back to back with the last rank late before each (collective_checks.h), the
// gathered A asked for (its copies follow each launch on the stream), each call on an A shard, a
// B and outputs of its own and the same workspace: none deadlocks, and each writes the bits of
// the same call made alone.
void expect_back_to_back(Communicator& comm, const AgCase& c, uint64_t seed,
                         SymmetricBuffer* shared_ws = nullptr) {
  constexpr int kCalls = 3;
  const int world = comm.world_size(), rank = comm.rank();
  SCOPED_TRACE(describe(c, world) + ", three calls back to back, the last rank late, rank " +
               std::to_string(rank));
  const int64_t m = c.shard_rows * world, n = c.n, k = c.k;
  FusedGemmConfig config;
  config.block_n = c.block_n;
  SymmetricBuffer own_ws;
  if (shared_ws == nullptr) own_ws = comm.alloc(ag_gemm_workspace_bytes(m, k));
  SymmetricBuffer& ws = shared_ws != nullptr ? *shared_ws : own_ws;
  cudaStream_t stream;
  MKT_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  struct Call {
    void *a_shard, *b, *c_out, *gathered, *c_alone, *g_alone;
  };
  std::vector<Call> calls(kCalls);
  for (int i = 0; i < kCalls; ++i) {
    Call& x = calls[i];
    MKT_CUDA(cudaMalloc(&x.a_shard, c.shard_rows * k * 2));
    MKT_CUDA(cudaMalloc(&x.b, n * k * 2));
    for (void** p : {&x.c_out, &x.c_alone}) MKT_CUDA(cudaMalloc(p, m * n * 2));
    for (void** p : {&x.gathered, &x.g_alone}) MKT_CUDA(cudaMalloc(p, m * k * 2));
    fill_random_bf16(x.a_shard, c.shard_rows * k, shard_seed(seed + 7 * i, rank), stream);
    fill_random_bf16(x.b, n * k, (seed + 7 * i) ^ (0x77 + rank), stream);
  }
  const auto call = [&](int i) {
    const Call& x = calls[i];
    ag_gemm(comm, x.a_shard, x.b, x.c_out, m, n, k, c.layout, ws.data(), stream, config,
            x.gathered);
  };
  for (int i = 0; i < kCalls; ++i) {
    const Call& x = calls[i];
    MKT_CUDA(cudaMemsetAsync(x.c_out, 0xFF, m * n * 2, stream));
    MKT_CUDA(cudaMemsetAsync(x.gathered, 0xFF, m * k * 2, stream));
    ready(comm, stream);
    call(i);
    finished(comm, stream);
    MKT_CUDA(cudaMemcpyAsync(x.c_alone, x.c_out, m * n * 2, cudaMemcpyDeviceToDevice, stream));
    MKT_CUDA(cudaMemcpyAsync(x.g_alone, x.gathered, m * k * 2, cudaMemcpyDeviceToDevice, stream));
    MKT_CUDA(cudaMemsetAsync(x.c_out, 0xFF, m * n * 2, stream));
    MKT_CUDA(cudaMemsetAsync(x.gathered, 0xFF, m * k * 2, stream));
  }
  ready(comm, stream);
  call_back_to_back_one_late(comm, stream, kCalls, call);
  for (int i = 0; i < kCalls; ++i) {
    const Call& x = calls[i];
    EXPECT_EQ(count_nans_bf16(x.c_alone, m * n, stream), 0u)
        << "call " << i << " alone: C unwritten";
    EXPECT_EQ(count_different_bytes16(x.c_out, x.c_alone, m * n * 2, stream), 0u)
        << "call " << i << ": C has other bits than the call made alone";
    EXPECT_EQ(count_different_bytes16(x.gathered, x.g_alone, m * k * 2, stream), 0u)
        << "call " << i << ": the gathered A has other bits than the call made alone";
  }
  comm.bootstrap().barrier();  // no peer kernel is waiting for us while we free
  for (const Call& x : calls) {
    for (void* p : {x.a_shard, x.b, x.c_out, x.gathered, x.c_alone, x.g_alone}) cudaFree(p);
  }
  cudaStreamDestroy(stream);
}

class InProcessAgGemm : public ::testing::TestWithParam<int> {};

TEST_P(InProcessAgGemm, MatchesReference) {
  MKT_REQUIRE_GPU();
  run_in_process(GetParam(), expect_ag_gemm_cases);
}

TEST_P(InProcessAgGemm, BackToBackCallsWithALateRank) {
  MKT_REQUIRE_GPU();
  run_in_process(GetParam(), [](Communicator& comm) {
    const uint64_t seed = shared_seed(comm);
    expect_back_to_back(comm, {200, 264, 136, BLayout::kNK, 0}, seed);
    expect_back_to_back(comm, {1000, 1024, 1024, BLayout::kKN, 0}, seed + 1);
  });
}

INSTANTIATE_TEST_SUITE_P(World, InProcessAgGemm, ::testing::Values(1, 2, 4, 8),
                         [](const auto& info) { return "w" + std::to_string(info.param); });

// Across (virtual) nodes: shards of other nodes come over the rail - the socket transport over
// loopback, staged through host memory - and are relayed inside the node (issue 8). 2 x 1, 2 x 2,
// 3 x 2 and 2 x 4 ranks (several per GPU), the cases that fit one 32-MiB workspace, twice each
// (the second launch reuses what the first left).
void expect_ag_gemm_across_nodes(Communicator& comm) {
  const uint64_t seed = shared_seed(comm);
  const FusedGemmPlan plan = ag_gemm_plan(comm, comm.world_size() * 200, 264, 136);
  EXPECT_EQ(plan.nodes, comm.topology().num_nodes) << plan.describe();
  SymmetricBuffer ws = comm.alloc(32 << 20);
  const std::vector<AgCase> cases = {
      {1, 8, 8, BLayout::kNK, 0},
      {200, 264, 136, BLayout::kNK, 0},
      {333, 520, 1000, BLayout::kKN, 64},
      {1000, 1024, 1024, BLayout::kNK, 0},
  };
  for (int round = 0; round < 2; ++round) {
    for (std::size_t i = 0; i < cases.size(); ++i) {
      expect_ag_gemm(comm, cases[i], seed + 10 * round + i, {}, &ws);
    }
  }
  FusedGemmConfig few;  // many pieces, few pushing CTAs: every unit kind shares the CTAs
  few.comm_ctas = 2;
  few.piece_rows = 7;
  expect_ag_gemm(comm, {517, 384, 256, BLayout::kNK, 0}, seed + 100, few, &ws);
}

// (ctest runs these as gpu_ag_gemm_nodes, with a time limit of their own.)
class AgGemmNodes : public AcrossNodes {};
TEST_P(AgGemmNodes, MatchesReference) {
  MKT_REQUIRE_GPU();
  const auto [nodes, per_node] = GetParam();
  run_in_process(nodes * per_node, expect_ag_gemm_across_nodes, virtual_nodes(per_node, 20));
}
TEST_P(AgGemmNodes, BackToBackCallsWithALateRank) {
  MKT_REQUIRE_GPU();
  const auto [nodes, per_node] = GetParam();
  run_in_process(
      nodes * per_node,
      [](Communicator& comm) {
        const uint64_t seed = shared_seed(comm);
        SymmetricBuffer ws = comm.alloc(32 << 20);
        expect_back_to_back(comm, {200, 264, 136, BLayout::kNK, 0}, seed, &ws);
        expect_back_to_back(comm, {1000, 1024, 1024, BLayout::kNK, 0}, seed + 1, &ws);
      },
      virtual_nodes(per_node, 20));
}
INSTANTIATE_TEST_SUITE_P(AgGemmAcrossNodes, AgGemmNodes,
                         ::testing::Values(NodesLayout{2, 1}, NodesLayout{2, 2}, NodesLayout{3, 2},
                                           NodesLayout{2, 4}),
                         layout_name);

TEST(InProcessAgGemm, LargeWorld2) {
  MKT_REQUIRE_GPU();
  run_in_process(2, [](Communicator& comm) {
    const uint64_t seed = shared_seed(comm);
    expect_ag_gemm(comm, {4096, 4096, 4096, BLayout::kNK, 0}, seed);
    expect_ag_gemm(comm, {1000, 8192, 8192, BLayout::kKN, 0}, seed + 1);
  });
}

TEST(LaunchedAgGemm, MatchesReference) {
  MKT_REQUIRE_MKRUN();
  auto comm = launched_comm();
  expect_ag_gemm_cases(*comm);
}

TEST(SanitizeAgGemm, SmallWorld2) {
  MKT_REQUIRE_GPU();
  run_in_process(2, [](Communicator& comm) {
    const uint64_t seed = shared_seed(comm);
    expect_ag_gemm(comm, {130, 136, 72, BLayout::kNK, 0}, seed);
    expect_ag_gemm(comm, {70, 200, 64, BLayout::kKN, 64}, seed + 1);
  });
}

// One graph = ag_gemm -> copy C into a history slot. Before each replay the inputs change
// (a new shard is copied in); every replay's C must match the GEMM engine on that replay's
// gathered A.
void expect_ag_gemm_graph(Communicator& comm, int replays) {
  const int world = comm.world_size(), rank = comm.rank();
  const int64_t shard = 136, m = shard * world, n = 256, k = 192;
  const uint64_t seed = shared_seed(comm);
  SymmetricBuffer ws = comm.alloc(ag_gemm_workspace_bytes(m, k));
  cudaStream_t stream;
  MKT_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  void *a_shard, *inputs, *b, *c_out, *history, *a_full, *c_ref;
  MKT_CUDA(cudaMalloc(&a_shard, shard * k * 2));
  MKT_CUDA(cudaMalloc(&inputs, replays * shard * k * 2));
  MKT_CUDA(cudaMalloc(&b, n * k * 2));
  MKT_CUDA(cudaMalloc(&c_out, m * n * 2));
  MKT_CUDA(cudaMalloc(&history, replays * m * n * 2));
  MKT_CUDA(cudaMalloc(&a_full, m * k * 2));
  MKT_CUDA(cudaMalloc(&c_ref, m * n * 2));
  auto input_seed = [&](int replay, int r) { return shard_seed(seed + 7919 * replay, r); };
  for (int i = 0; i < replays; ++i) {
    fill_random_bf16(static_cast<char*>(inputs) + i * shard * k * 2, shard * k, input_seed(i, rank),
                     stream);
  }
  fill_random_bf16(b, n * k, seed ^ rank, stream);
  MKT_CUDA(cudaMemsetAsync(history, 0xFF, replays * m * n * 2, stream));
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  MKT_CUDA(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  ag_gemm(comm, a_shard, b, c_out, m, n, k, BLayout::kNK, ws.data(), stream);
  MKT_CUDA(cudaStreamEndCapture(stream, &graph));
  ASSERT_NO_FATAL_FAILURE(instantiate_uploaded(graph, stream, &exec));
  ready(comm, stream);
  for (int i = 0; i < replays; ++i) {
    MKT_CUDA(cudaMemcpyAsync(a_shard, static_cast<char*>(inputs) + i * shard * k * 2, shard * k * 2,
                             cudaMemcpyDeviceToDevice, stream));
    MKT_CUDA(cudaGraphLaunch(exec, stream));
    MKT_CUDA(cudaMemcpyAsync(static_cast<char*>(history) + i * m * n * 2, c_out, m * n * 2,
                             cudaMemcpyDeviceToDevice, stream));
  }
  finished(comm, stream);
  GemmConfig plain;
  plain.block_n = ag_gemm_plan(comm, m, n, k).block_n;
  plain.split_k = 1;
  int bad = 0, first_bad = -1;
  for (int i = 0; i < replays; ++i) {
    for (int s = 0; s < world; ++s) {
      fill_random_bf16(static_cast<char*>(a_full) + s * shard * k * 2, shard * k, input_seed(i, s),
                       stream);
    }
    gemm(a_full, b, c_ref, m, n, k, BLayout::kNK, stream, plain);
    if (count_different_bytes16(static_cast<char*>(history) + i * m * n * 2, c_ref, m * n * 2,
                                stream) != 0 &&
        bad++ == 0) {
      first_bad = i;
    }
  }
  EXPECT_EQ(bad, 0) << "rank " << rank << ": " << bad << " wrong replays, the first " << first_bad;
  comm.bootstrap().barrier();
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  for (void* p : {a_shard, inputs, b, c_out, history, a_full, c_ref}) cudaFree(p);
  cudaStreamDestroy(stream);
}

TEST(InProcessAgGemm, GraphReplays100Times) {
  MKT_REQUIRE_GPU();
  run_in_process(2, [](Communicator& comm) { expect_ag_gemm_graph(comm, 100); });
}

TEST(LaunchedAgGemm, GraphReplays100Times) {
  MKT_REQUIRE_MKRUN();
  auto comm = launched_comm();
  expect_ag_gemm_graph(*comm, comm->topology().max_ranks_per_device > 1 ? 30 : 100);
}

// One ag_gemm call's operands (random A_r and B, seeds `a_seed` and `b_seed`), its workspace
// and stream; freed when it goes out of scope.
struct AgCall {
  AgCall(Communicator& comm, int64_t shard_rows, int64_t n, int64_t k, uint64_t a_seed,
         uint64_t b_seed)
      : comm(comm),
        shard(shard_rows),
        m(shard_rows * comm.world_size()),
        n(n),
        k(k),
        ws(comm.alloc(ag_gemm_workspace_bytes(m, k))) {
    auto check = [](cudaError_t e) {  // (a constructor cannot ASSERT: it throws instead)
      if (e != cudaSuccess) throw std::runtime_error(cudaGetErrorString(e));
    };
    check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    check(cudaMalloc(&a, shard * k * 2));
    check(cudaMalloc(&b, n * k * 2));
    check(cudaMalloc(&c, m * n * 2));
    fill_random_bf16(a, shard * k, a_seed, stream);
    fill_random_bf16(b, n * k, b_seed, stream);
  }
  ~AgCall() {
    for (void* p : {a, b, c}) cudaFree(p);
    cudaStreamDestroy(stream);
  }
  void launch() { ag_gemm(comm, a, b, c, m, n, k, BLayout::kNK, ws.data(), stream); }

  Communicator& comm;
  int64_t shard, m, n, k;
  SymmetricBuffer ws;
  cudaStream_t stream = nullptr;
  void *a = nullptr, *b = nullptr, *c = nullptr;
};

// Every rank but the last calls ag_gemm; the last never does. The others must fail with a time-out
// naming the missing rank, within the limit.
void expect_ag_gemm_timeout(Communicator& comm) {
  AgCall call(comm, 256, 256, 256, 1, 2);
  ready(comm, call.stream);
  expect_missing_rank_times_out(comm, call.stream, [&] { call.launch(); });
}

TEST(InProcessAgGemm, MissingRankTimesOut) {
  MKT_REQUIRE_GPU();
  CommOptions options;
  options.timeout_seconds = 1.0;
  run_in_process(2, expect_ag_gemm_timeout, options);
}

TEST(InProcessAgGemm, RejectsBadArgumentsBeforeLaunch) {
  MKT_REQUIRE_GPU();
  run_in_process(2, [](Communicator& comm) {
    SymmetricBuffer ws = comm.alloc(1 << 20);
    void* p;
    ASSERT_EQ(cudaMalloc(&p, 1 << 20), cudaSuccess);
    char* q = static_cast<char*>(p);
    char* w = static_cast<char*>(ws.data());
    cudaStream_t s = nullptr;
    auto call = [&](int64_t m, int64_t n, int64_t k, void* workspace, void* a = nullptr) {
      ag_gemm(comm, a ? a : q, q + 4096, q + 8192, m, n, k, BLayout::kNK, workspace, s);
    };
    expect_error([&] { call(3, 8, 8, w); }, ErrorCode::kInvalidArgument,
                 "M = 3 is not a positive multiple of the world size 2");
    expect_error([&] { call(4, 12, 8, w); }, ErrorCode::kInvalidArgument, "N = 12");
    expect_error([&] { call(4, 8, 4, w); }, ErrorCode::kInvalidArgument, "K = 4");
    expect_error([&] { call(4, 8, 8, q + 100000); }, ErrorCode::kInvalidArgument,
                 "workspace");  // not symmetric
    expect_error([&] { call(1024, 8, 1024, w); }, ErrorCode::kOutOfMemory,
                 "workspace");  // 2 MiB needed, 1 MiB there
    expect_error([&] { call(4, 8, 8, w, q + 2); }, ErrorCode::kInvalidArgument, "a_shard");
    FusedGemmConfig bad;
    bad.block_n = 96;
    expect_error([&] { ag_gemm(comm, q, q, q, 4, 8, 8, BLayout::kNK, w, s, bad); },
                 ErrorCode::kInvalidArgument, "block_n = 96");
    comm.bootstrap().barrier();
    cudaFree(p);
  });
}

// The shapes of `bench/run.sh ag_gemm check` (M / world x N x K), each with a new workspace while
// the earlier ones stay alive, as the Python package grows its workspace: each is registered with
// the inter-node path on first use.
void expect_ag_gemm_growing_workspaces(Communicator& comm) {
  const uint64_t seed = shared_seed(comm);
  const int world = comm.world_size();
  const int64_t shapes[][3] = {{512, 1024, 1024}, {1024, 2048, 2048}, {2048, 2048, 2048},
                               {1024, 512, 2048}, {1024, 7168, 2048}, {256, 2048, 2048}};
  std::vector<SymmetricBuffer> workspaces;
  for (int i = 0; i < 6; ++i) {
    const auto [m, n, k] = shapes[i];
    workspaces.push_back(comm.alloc(ag_gemm_workspace_bytes(m / world * world, k)));
    expect_ag_gemm(comm, {m / world, n, k, BLayout::kNK, 0}, seed + i, {}, &workspaces.back());
  }
}

// The compiler's resource report for every ag_gemm kernel: no local memory (no spills, no stack)
// - across nodes too, whose side warps also drive the rail.
TEST(AgGemm, KernelsDoNotSpill) {
  MKT_REQUIRE_GPU();
  const std::vector<GemmKernelResources> kernels = detail::ag_gemm_kernel_resources();
  ASSERT_EQ(kernels.size(), 16u);  // 4 widths x 2 B layouts, one node and across nodes
  for (const GemmKernelResources& k : kernels) {
    EXPECT_EQ(k.local_bytes, 0) << k.name << " uses local memory (register spills or a stack)";
    std::printf("  %-28s %3d registers\n", k.name.c_str(), k.registers);
  }
}

TEST(AgGemmAcrossNodes, GrowingWorkspaces) {
  MKT_REQUIRE_GPU();
  run_in_process(2, expect_ag_gemm_growing_workspaces, virtual_nodes(1, 20));
}

// ---- a graph across nodes (processes and a killed rank: test_nodes_processes.cpp) ----

// A graph of one launch across 2 x 2 virtual nodes: the first ag_gemm call, which creates the
// inter-node path and registers the workspace, happens inside the capture.
TEST(AgGemmAcrossNodes, GraphReplays30Times) {
  MKT_REQUIRE_GPU();
  run_in_process(
      4, [](Communicator& comm) { expect_ag_gemm_graph(comm, 30); }, virtual_nodes(2, 20));
}

}  // namespace

void expect_ag_gemm_nodes(Communicator& comm) { expect_ag_gemm_growing_workspaces(comm); }

}  // namespace mk::test
