// GEMM + AllReduce (mk::gemm_ar) at world sizes 1, 2, 4 and 8 - in one process (threads; ranks
// share a GPU when there are fewer GPUs than ranks) and as mkrun processes. Every rank rebuilds
// all ranks' inputs from the shared seed; its whole output must match the fp64 product of the
// K-concatenated operands (the sum over ranks) within twice cuBLAS's error, and be bitwise equal
// on every rank. M = 1, 7, 128, 1000 and more; fresh random data, poisoned outputs, the workspace
// left zero (3+ ranks), CUDA-graph replay with new inputs, the time limit, argument errors.
#include <chrono>

#include "across_nodes_checks.h"
#include "collective_checks.h"
#include "gemm_reference.h"
#include "mkernel/fused.h"
#include "reduce_checks.h"

namespace mk::test {
namespace {

struct ArCase {
  int64_t m, n, k_local;
  BLayout layout;
  int block_n;  // 0 = heuristic
};

// FNV-1a of a device buffer's bytes (host side; test sizes are small).
uint64_t device_hash(const void* p, std::size_t bytes, cudaStream_t stream) {
  std::vector<unsigned char> host(bytes);
  cudaMemcpyAsync(host.data(), p, bytes, cudaMemcpyDeviceToHost, stream);
  cudaStreamSynchronize(stream);
  uint64_t h = 1469598103934665603ull;
  for (unsigned char c : host) h = (h ^ c) * 1099511628211ull;
  return h;
}

void expect_same_on_all_ranks(Communicator& comm, uint64_t hash, const std::string& what) {
  std::vector<uint64_t> all(comm.world_size());
  comm.bootstrap().allgather(&hash, all.data(), sizeof(hash));
  for (int r = 0; r < comm.world_size(); ++r) {
    EXPECT_EQ(all[r], all[0]) << what << ": rank " << r << "'s output differs from rank 0's";
  }
}

void expect_gemm_ar(Communicator& comm, const ArCase& c, uint64_t seed,
                    FusedGemmConfig config = {}) {
  const int world = comm.world_size(), rank = comm.rank();
  const std::string what = "gemm_ar world " + std::to_string(world) + ", M " + std::to_string(c.m) +
                           " N " + std::to_string(c.n) + " K_r " + std::to_string(c.k_local) +
                           (c.layout == BLayout::kKN ? ", B [K, N]" : ", B [N, K]") + ", block_n " +
                           std::to_string(c.block_n) + ", rank " + std::to_string(rank);
  SCOPED_TRACE(what);
  config.block_n = c.block_n;
  RsProblem p(world, c.m, c.n, c.k_local, c.layout == BLayout::kKN);
  const std::size_t ws_bytes = gemm_ar_workspace_bytes(comm, c.m, c.n, c.k_local, config);
  const FusedGemmPlan plan = gemm_ar_plan(comm, c.m, c.n, c.k_local, config);
  // At most the sequential [M, N] bf16 intermediate (issue 7), reported before launch; the one
  // documented exception: three or more ranks and N < 128, where a rank owns a whole column tile
  // of the few there are and its fp32 accumulator is up to M x N x 4 bytes.
  const std::size_t intermediate = static_cast<std::size_t>(c.m) * c.n * 2;
  const int nodes = comm.topology().num_nodes, per_node = comm.topology().local_size;
  if (nodes > 1) {
    // Across nodes (gemm_ar_nodes.cuh): 4 x nodes - 2 regions of M x the widest owner's columns.
    EXPECT_EQ(ws_bytes % (4 * nodes - 2), 0u);
  } else if (world <= 2 || c.n >= 128) {
    EXPECT_LE(ws_bytes, intermediate) << "workspace larger than the sequential intermediate";
  } else {
    EXPECT_LE(ws_bytes, 2 * intermediate) << "workspace larger than M x N fp32";
  }
  SymmetricBuffer ws = comm.alloc(std::max<std::size_t>(ws_bytes, 16));
  SymmetricBuffer out = comm.alloc(c.m * c.n * 2);
  cudaStream_t stream;
  MKT_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  void *c_blas, *zeros;
  MKT_CUDA(cudaMalloc(&c_blas, c.m * c.n * 2));
  MKT_CUDA(cudaMalloc(&zeros, std::max<std::size_t>(ws_bytes, 16)));
  MKT_CUDA(cudaMemsetAsync(zeros, 0, std::max<std::size_t>(ws_bytes, 16), stream));
  MKT_CUDA(cudaMemsetAsync(ws.data(), 0, ws.size(), stream));
  cublasHandle_t blas;
  ASSERT_EQ(cublasCreate(&blas), CUBLAS_STATUS_SUCCESS);
  cublasSetStream(blas, stream);
  for (int call = 0; call < 2; ++call) {
    const std::string call_what = what + ", call " + std::to_string(call);
    p.fill(seed + 31 * call, rank, stream);
    MKT_CUDA(cudaMemsetAsync(out.data(), 0xFF, c.m * c.n * 2, stream));  // bf16 NaN
    ready(comm, stream);
    gemm_ar(comm, p.a_mine, p.b_mine, out.data(), c.m, c.n, c.k_local, c.layout, ws.data(), stream,
            config);
    finished(comm, stream);
    EXPECT_EQ(count_nans_bf16(out.data(), c.m * c.n, stream), 0u)
        << call_what << ": output elements unwritten (or NaN)";
    // bf16 partials (two ranks) round as the sequential baseline does: its error is the bar.
    expect_rows_close(p, 0, c.m, out.data(), blas, c_blas, seed + call, stream,
                      call_what + (plan.bf16_partials ? ", bf16 partials" : ""),
                      baseline_for(plan));
    expect_same_on_all_ranks(comm, device_hash(out.data(), c.m * c.n * 2, stream), call_what);
    // What peers add into must be zero for the next call: one node, the accumulator (more than
    // two ranks); across nodes the own and relay accumulators (more than two per node).
    const std::size_t zeroed = nodes > 1 ? (per_node > 2 ? ws_bytes / (4 * nodes - 2) * nodes : 0)
                                         : (world > 2 ? ws_bytes - plan.staging_bytes : 0);
    if (zeroed > 0) {
      EXPECT_EQ(count_different_bytes16(ws.data(), zeros, zeroed, stream), 0u)
          << call_what << ": the workspace was not left zero";
    }
    comm.bootstrap().barrier();
  }
  cublasDestroy(blas);
  cudaFree(c_blas);
  cudaFree(zeros);
  cudaStreamDestroy(stream);
}

// `base`: the config of every case (each case sets its block_n).
void expect_gemm_ar_cases(Communicator& comm, const FusedGemmConfig& base = {}) {
  const uint64_t seed = shared_seed(comm);
  const std::vector<ArCase> cases = {
      {1, 8, 8, BLayout::kNK, 0},           {7, 264, 136, BLayout::kNK, 0},
      {128, 1024, 512, BLayout::kKN, 0},    {1000, 520, 1000, BLayout::kNK, 64},
      {1000, 1024, 256, BLayout::kNK, 192}, {333, 2056, 256, BLayout::kKN, 128},
      {4096, 4096, 64, BLayout::kNK, 0},  // staging fits: through the outbox (red.add at w > 2)
  };
  for (std::size_t i = 0; i < cases.size(); ++i) {
    expect_gemm_ar(comm, cases[i], seed + 100 * i, base);
  }
}

// Across (virtual) nodes (issue 8, gemm_ar_nodes.cuh): the reduce of gemm_rs across nodes per
// owner's column block, then each finished slice to the other nodes through the owner's rail
// peers. (ctest runs these as gpu_gemm_ar_nodes.)
void expect_gemm_ar_across_nodes(Communicator& comm) {
  const uint64_t seed = shared_seed(comm);
  EXPECT_EQ(gemm_ar_plan(comm, 128, 1024, 512).nodes, comm.topology().num_nodes);
  const std::vector<ArCase> cases = {
      {1, 8, 8, BLayout::kNK, 0},          {7, 264, 136, BLayout::kNK, 0},
      {128, 1024, 512, BLayout::kKN, 0},   {1000, 520, 1000, BLayout::kNK, 64},
      {333, 2056, 256, BLayout::kKN, 128},
  };
  for (std::size_t i = 0; i < cases.size(); ++i) expect_gemm_ar(comm, cases[i], seed + 100 * i);
  // bf16 on the wire, as gemm_rs across nodes.
  FusedGemmConfig bf16;
  bf16.bf16_partials = true;
  expect_gemm_ar(comm, cases[1], seed + 1000, bf16);
  expect_gemm_ar(comm, cases[4], seed + 1001, bf16);
}

class GemmArNodes : public AcrossNodes {};
TEST_P(GemmArNodes, MatchesReference) {
  MKT_REQUIRE_GPU();
  const auto [nodes, per_node] = GetParam();
  run_in_process(nodes * per_node, expect_gemm_ar_across_nodes, virtual_nodes(per_node, 20));
}
INSTANTIATE_TEST_SUITE_P(GemmArAcrossNodes, GemmArNodes,
                         ::testing::Values(NodesLayout{2, 1}, NodesLayout{2, 2}, NodesLayout{3, 2},
                                           NodesLayout{2, 4}, NodesLayout{3, 3}),
                         layout_name);

class InProcessGemmAr : public ::testing::TestWithParam<int> {};

TEST_P(InProcessGemmAr, MatchesReference) {
  MKT_REQUIRE_GPU();
  run_in_process(GetParam(), [](Communicator& comm) { expect_gemm_ar_cases(comm); });
}

INSTANTIATE_TEST_SUITE_P(World, InProcessGemmAr, ::testing::Values(1, 2, 4, 8),
                         [](const auto& info) { return "w" + std::to_string(info.param); });

TEST(InProcessGemmAr, LargeWorld2) {
  MKT_REQUIRE_GPU();
  run_in_process(2, [](Communicator& comm) {
    const uint64_t seed = shared_seed(comm);
    expect_gemm_ar(comm, {4096, 4096, 2048, BLayout::kNK, 0}, seed);
    // the decode shape: no outbox, the epilogue's TMA sends (and with them off)
    EXPECT_TRUE(gemm_ar_plan(comm, 128, 8192, 4096).tma_sends)
        << gemm_ar_plan(comm, 128, 8192, 4096).describe();
    expect_gemm_ar(comm, {128, 8192, 4096, BLayout::kNK, 0}, seed + 1);
    expect_gemm_ar(comm, {8192, 1032, 512, BLayout::kKN, 0}, seed + 2);
    expect_gemm_ar(comm, {8192, 8192, 256, BLayout::kKN, 0}, seed + 3);  // through the outbox
  });
}

// FusedGemmConfig::tma_sends off: the epilogue's threads send with global stores (no outbox),
// and the side threads copy an own tile's result to the peer (outbox).
TEST(InProcessGemmAr, ThreadSendsWorld2) {
  MKT_REQUIRE_GPU();
  run_in_process(2, [](Communicator& comm) {
    const FusedGemmConfig threads{.tma_sends = false};
    EXPECT_FALSE(gemm_ar_plan(comm, 128, 8192, 4096, threads).tma_sends);
    const uint64_t seed = shared_seed(comm);
    expect_gemm_ar(comm, {128, 8192, 4096, BLayout::kNK, 0}, seed, threads);
    expect_gemm_ar(comm, {1000, 1024, 256, BLayout::kNK, 192}, seed + 1, threads);
    expect_gemm_ar(comm, {8192, 8192, 256, BLayout::kKN, 0}, seed + 2, threads);  // outbox
  });
}

// FusedGemmConfig::bf16_partials (opt-in; two ranks): the peer's partial slice travels as bf16
// into its footprint in the owner's C; the bar is the sequential baseline's error.
TEST(InProcessGemmAr, PartialsBf16World2) {
  MKT_REQUIRE_GPU();
  run_in_process(2, [](Communicator& comm) {
    FusedGemmConfig bf16;
    bf16.bf16_partials = true;
    EXPECT_FALSE(gemm_ar_plan(comm, 4096, 4096, 1024).bf16_partials);
    const FusedGemmPlan plan = gemm_ar_plan(comm, 4096, 4096, 1024, bf16);
    EXPECT_TRUE(plan.bf16_partials) << plan.describe();
    expect_gemm_ar_cases(comm, bf16);
    expect_gemm_ar(comm, {8192, 8192, 256, BLayout::kKN, 0}, shared_seed(comm) + 9, bf16);
  });
}

TEST(LaunchedGemmAr, MatchesReference) {
  MKT_REQUIRE_MKRUN();
  auto comm = launched_comm();
  expect_gemm_ar_cases(*comm);
}

TEST(SanitizeGemmAr, SmallWorld2) {
  MKT_REQUIRE_GPU();
  run_in_process(2, [](Communicator& comm) {
    const uint64_t seed = shared_seed(comm);
    expect_gemm_ar(comm, {130, 136, 72, BLayout::kNK, 0}, seed);
    expect_gemm_ar(comm, {7, 200, 64, BLayout::kKN, 64}, seed + 1);
    FusedGemmConfig four_ctas;  // staging fits: the outbox, two slots per consumer
    four_ctas.sms = 4;
    const FusedGemmPlan plan = gemm_ar_plan(comm, 512, 1024, 64, {.block_n = 128, .sms = 4});
    EXPECT_EQ(plan.outbox_slots, 2) << plan.describe();
    // 16 own tiles per rank on 4 CTAs: interleaved, on 3 CTAs (coprime to the world size)
    EXPECT_EQ(plan.ctas, 3) << plan.describe();
    EXPECT_EQ(plan.lag, 6) << plan.describe();
    expect_gemm_ar(comm, {512, 1024, 64, BLayout::kNK, 128}, seed + 2, four_ctas);
    four_ctas.bf16_partials = true;  // the peer's slice as bf16, into its footprint in C
    expect_gemm_ar(comm, {512, 1024, 64, BLayout::kNK, 128}, seed + 3, four_ctas);
    expect_gemm_ar(comm, {7, 200, 64, BLayout::kKN, 64}, seed + 4, {.bf16_partials = true});
    // M = 1024 on a whole H200: staging fits only beside 128-wide tiles, so the plan takes them
    if (comm.topology().sm_budget() >= 120) {
      const FusedGemmPlan rows1024 = gemm_ar_plan(comm, 1024, 8192, 4096);
      EXPECT_EQ(rows1024.block_n, 128) << rows1024.describe();
      EXPECT_GT(rows1024.outbox_slots, 0) << rows1024.describe();
    }
  });
}

// One graph = gemm_ar; a new A_r before each replay, the output copied out after it.
void expect_gemm_ar_graph(Communicator& comm, int replays) {
  const int world = comm.world_size(), rank = comm.rank();
  const int64_t m = 200, n = 256, k_local = 64;
  const uint64_t seed = shared_seed(comm);
  RsProblem p(world, m, n, k_local, false);
  SymmetricBuffer ws =
      comm.alloc(std::max<std::size_t>(gemm_ar_workspace_bytes(comm, m, n, k_local), 16));
  SymmetricBuffer out = comm.alloc(m * n * 2);
  cudaStream_t stream;
  MKT_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  void *a_in, *history, *c_blas;
  MKT_CUDA(cudaMalloc(&a_in, m * k_local * 2));
  MKT_CUDA(cudaMalloc(&history, replays * m * n * 2));
  MKT_CUDA(cudaMalloc(&c_blas, m * n * 2));
  MKT_CUDA(cudaMemsetAsync(ws.data(), 0, ws.size(), stream));
  cublasHandle_t blas;
  ASSERT_EQ(cublasCreate(&blas), CUBLAS_STATUS_SUCCESS);
  cublasSetStream(blas, stream);
  p.fill(seed, rank, stream);
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  MKT_CUDA(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  gemm_ar(comm, a_in, p.b_mine, out.data(), m, n, k_local, BLayout::kNK, ws.data(), stream);
  MKT_CUDA(cudaStreamEndCapture(stream, &graph));
  ASSERT_NO_FATAL_FAILURE(instantiate_uploaded(graph, stream, &exec));
  std::vector<uint64_t> a_seeds(replays);
  for (int i = 0; i < replays; ++i) a_seeds[i] = seed + 7919 * (i + 1);
  ready(comm, stream);
  for (int i = 0; i < replays; ++i) {
    fill_random_bf16(a_in, m * k_local, rank_seed(a_seeds[i], rank, 0), stream);
    MKT_CUDA(cudaGraphLaunch(exec, stream));
    MKT_CUDA(cudaMemcpyAsync(static_cast<char*>(history) + i * m * n * 2, out.data(), m * n * 2,
                             cudaMemcpyDeviceToDevice, stream));
  }
  finished(comm, stream);
  for (int i = 0; i < replays; ++i) {
    p.fill(a_seeds[i], seed, rank, stream);  // replay i's A, the B the graph used
    expect_rows_close(p, 0, m, static_cast<char*>(history) + i * m * n * 2, blas, c_blas, seed + i,
                      stream, "replay " + std::to_string(i),
                      baseline_for(gemm_ar_plan(comm, m, n, k_local)));
  }
  expect_same_on_all_ranks(comm, device_hash(history, replays * m * n * 2, stream), "all replays");
  comm.bootstrap().barrier();
  cublasDestroy(blas);
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  for (void* q : {a_in, history, c_blas}) cudaFree(q);
  cudaStreamDestroy(stream);
}

TEST(InProcessGemmAr, GraphReplays100Times) {
  MKT_REQUIRE_GPU();
  run_in_process(2, [](Communicator& comm) { expect_gemm_ar_graph(comm, 100); });
}

// A graph of one launch across 2 x 2 virtual nodes, its first call (the inter-node path, the
// workspace's registration or the host staging) inside the capture.
TEST(GemmArAcrossNodes, GraphReplays30Times) {
  MKT_REQUIRE_GPU();
  run_in_process(
      4, [](Communicator& comm) { expect_gemm_ar_graph(comm, 30); }, virtual_nodes(2, 20));
}

TEST(LaunchedGemmAr, GraphReplays100Times) {
  MKT_REQUIRE_MKRUN();
  auto comm = launched_comm();
  expect_gemm_ar_graph(*comm, comm->topology().max_ranks_per_device > 1 ? 30 : 100);
}

TEST(InProcessGemmAr, MissingRankTimesOut) {
  MKT_REQUIRE_GPU();
  CommOptions options;
  options.timeout_seconds = 1.0;
  run_in_process(
      2,
      [](Communicator& comm) {
        const int64_t m = 256, n = 256, k = 256;
        SymmetricBuffer ws = comm.alloc(gemm_ar_workspace_bytes(comm, m, n, k));
        SymmetricBuffer out = comm.alloc(m * n * 2);
        cudaStream_t stream;
        MKT_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
        void *a, *b;
        MKT_CUDA(cudaMalloc(&a, m * k * 2));
        MKT_CUDA(cudaMalloc(&b, n * k * 2));
        fill_random_bf16(a, m * k, 1, stream);
        fill_random_bf16(b, n * k, 2, stream);
        MKT_CUDA(cudaMemsetAsync(ws.data(), 0, ws.size(), stream));
        ready(comm, stream);
        expect_missing_rank_times_out(comm, stream, [&] {
          gemm_ar(comm, a, b, out.data(), m, n, k, BLayout::kNK, ws.data(), stream);
        });
        cudaFree(a);
        cudaFree(b);
        cudaStreamDestroy(stream);
      },
      options);
}

TEST(InProcessGemmAr, RejectsBadArgumentsBeforeLaunch) {
  MKT_REQUIRE_GPU();
  run_in_process(2, [](Communicator& comm) {
    SymmetricBuffer ws = comm.alloc(1 << 20), out = comm.alloc(1 << 20);
    void* p;
    ASSERT_EQ(cudaMalloc(&p, 1 << 20), cudaSuccess);
    char* q = static_cast<char*>(p);
    cudaStream_t s = nullptr;
    auto call = [&](int64_t m, int64_t n, int64_t k, void* o, void* w) {
      gemm_ar(comm, q, q + 4096, o, m, n, k, BLayout::kNK, w, s);
    };
    expect_error([&] { call(0, 8, 8, out.data(), ws.data()); }, ErrorCode::kInvalidArgument,
                 "M = 0");
    expect_error([&] { call(4, 12, 8, out.data(), ws.data()); }, ErrorCode::kInvalidArgument,
                 "N = 12");
    expect_error([&] { call(4, 8, 4, out.data(), ws.data()); }, ErrorCode::kInvalidArgument,
                 "K_r = 4");
    expect_error([&] { call(4, 8, 8, q + 65536, ws.data()); }, ErrorCode::kInvalidArgument,
                 "out");  // not symmetric: peers could not write into it
    expect_error([&] { call(4, 8, 8, out.data(), q + 65536); }, ErrorCode::kInvalidArgument,
                 "workspace");
    expect_error([&] { call(512, 2048, 8, out.data(), ws.data()); }, ErrorCode::kOutOfMemory,
                 "needs");  // 2 MiB of output (and of accumulator) in 1 MiB buffers
    comm.bootstrap().barrier();
    cudaFree(p);
  });
}

}  // namespace

void expect_gemm_ar_nodes(Communicator& comm) { expect_gemm_ar_across_nodes(comm); }

}  // namespace mk::test
