// Runtime on the GPU: communicator creation, symmetric memory, leaks, argument errors, time limits
// and CUDA-graph replay without host resets.
#include <dirent.h>
#include <execinfo.h>
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <latch>

#include "collective_checks.h"
#include "graph_kernels.h"

namespace mk::test {
namespace {

int open_fds() {
  int n = 0;
  if (DIR* d = opendir("/proc/self/fd")) {
    while (readdir(d) != nullptr) ++n;
    closedir(d);
  }
  return n;
}

// ---- communicator and symmetric memory
// -----------------------------------------------------------

TEST(InProcessRuntime, TopologyAndVirtualNodes) {
  MKT_REQUIRE_GPU();
  run_in_process(4, [](Communicator& comm) {
    const Topology& t = comm.topology();
    EXPECT_EQ(t.world_size, 4);
    EXPECT_EQ(t.num_nodes, 1);
    EXPECT_EQ(t.local_size, 4);
    EXPECT_EQ(t.local_rank, t.rank);
  });
  CommOptions two_nodes;
  two_nodes.ranks_per_node = 2;
  run_in_process(
      4,
      [](Communicator& comm) {
        const Topology& t = comm.topology();
        EXPECT_EQ(t.num_nodes, 2);
        EXPECT_EQ(t.local_size, 2);
        EXPECT_EQ(t.node, comm.rank() / 2);
        // Collectives are NVLink-only for now and say so before launching.
        SymmetricBuffer buf = comm.alloc(1024);
        try {
          all_reduce(comm, buf.data(), buf.data(), 16, DType::kF32, nullptr);
          ADD_FAILURE() << "all_reduce across virtual nodes did not throw";
        } catch (const Error& e) {
          EXPECT_EQ(e.code(), ErrorCode::kUnsupported);
          EXPECT_NE(std::string(e.what()).find("2 nodes"), std::string::npos) << e.what();
        }
      },
      two_nodes);
}

// Each rank writes its own copy; every rank then reads every copy through its own mapping.
void expect_peer_visibility(Communicator& comm) {
  const Topology& t = comm.topology();
  SymmetricBuffer buf = comm.alloc(3 << 20);  // not a multiple of the 2 MiB granularity
  ASSERT_EQ(buf.size(), 3u << 20);
  MKT_CUDA(cudaMemset(buf.data(), 0x10 + t.local_rank, buf.size()));
  MKT_CUDA(cudaDeviceSynchronize());
  comm.bootstrap().barrier();
  for (int i = 0; i < t.local_size; ++i) {
    std::vector<unsigned char> host(buf.size());
    MKT_CUDA(cudaMemcpy(host.data(), buf.peer(i), host.size(), cudaMemcpyDeviceToHost));
    std::size_t bad = 0;
    for (unsigned char b : host) bad += b != 0x10 + i;
    EXPECT_EQ(bad, 0u) << "rank " << t.rank << " reading local rank " << i << "'s copy";
  }
  comm.bootstrap().barrier();  // nobody frees before everyone has read
}

TEST(InProcessRuntime, SymmetricMemoryIsVisibleToPeers) {
  MKT_REQUIRE_GPU();
  for (int world : {1, 2, 4}) run_in_process(world, expect_peer_visibility);
}

TEST(LaunchedRuntime, SymmetricMemoryIsVisibleToPeers) {
  MKT_REQUIRE_MKRUN();
  auto comm = launched_comm();
  expect_peer_visibility(*comm);
}

void create_use_destroy(int world) {
  run_in_process(world, [](Communicator& comm) {
    SymmetricBuffer a = comm.alloc(1 << 20), b = comm.alloc(5 << 20);
    // A stream of this rank's own: ranks sharing a GPU in one process share its legacy default
    // stream, which would run their kernels one after the other (the first waits for the second
    // until the time limit - seen on a one-GPU host).
    cudaStream_t stream;
    MKT_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    comm.bootstrap().barrier();
    all_reduce(comm, a.data(), a.data(), 1024, DType::kF32, stream);
    comm.synchronize(stream);
    comm.bootstrap().barrier();
    cudaStreamDestroy(stream);
  });
}

TEST(InProcessRuntime, DestroyLeaksNoFdsOrMemory) {
  MKT_REQUIRE_GPU();
  create_use_destroy(2);  // warm up: CUDA contexts and driver fds stay for the process
  size_t free_before = 0, total = 0;
  cudaSetDevice(0);
  MKT_CUDA(cudaMemGetInfo(&free_before, &total));
  const int fds_before = open_fds();
  for (int i = 0; i < 3; ++i) create_use_destroy(2);
  size_t free_after = 0;
  cudaSetDevice(0);
  MKT_CUDA(cudaMemGetInfo(&free_after, &total));
  EXPECT_EQ(open_fds(), fds_before) << "file descriptors leaked";
  EXPECT_GE(free_after + (8u << 20), free_before)
      << "GPU memory leaked: " << free_before - free_after;
}

// ---- argument errors: thrown before launch, nothing written
// ----------------------------------------

TEST(InProcessRuntime, RejectsBadArgumentsBeforeLaunch) {
  MKT_REQUIRE_GPU();
  run_in_process(2, [](Communicator& comm) {
    const std::size_t n = 1000;
    SymmetricBuffer sym = comm.alloc(4 * n * 2);
    void* plain = nullptr;
    ASSERT_EQ(cudaMalloc(&plain, 8 * n), cudaSuccess);
    MKT_CUDA(cudaMemset(sym.data(), 0x5A, sym.size()));
    MKT_CUDA(cudaMemset(plain, 0x5A, 8 * n));
    MKT_CUDA(cudaDeviceSynchronize());
    std::vector<float> host(n);
    char* s = static_cast<char*>(sym.data());

    expect_error([&] { all_gather(comm, plain, plain, n, DType::kBF16, nullptr); },
                 ErrorCode::kInvalidArgument, "not inside a symmetric buffer");
    expect_error([&] { all_gather(comm, plain, s, 4 * n, DType::kF32, nullptr); },
                 ErrorCode::kOutOfMemory, "needs 32000 bytes");
    expect_error([&] { all_gather(comm, s + 1, s + 4000, n, DType::kBF16, nullptr); },
                 ErrorCode::kInvalidArgument, "not aligned");
    expect_error([&] { all_gather(comm, host.data(), s, n, DType::kF32, nullptr); },
                 ErrorCode::kInvalidArgument, "host memory");
    expect_error([&] { all_gather(comm, plain, s, n, static_cast<DType>(7), nullptr); },
                 ErrorCode::kInvalidArgument, "unknown dtype");
    expect_error([&] { all_gather(comm, s + 8, s, n, DType::kBF16, nullptr); },
                 ErrorCode::kInvalidArgument, "overlaps");
    expect_error([&] { reduce_scatter(comm, plain, s, n, DType::kBF16, nullptr); },
                 ErrorCode::kInvalidArgument, "not inside a symmetric buffer");
    expect_error([&] { reduce_scatter(comm, s, s + 2, n, DType::kBF16, nullptr); },
                 ErrorCode::kInvalidArgument, "overlaps");
    expect_error([&] { all_reduce(comm, s, plain, n, DType::kBF16, nullptr); },
                 ErrorCode::kInvalidArgument, "output");
    expect_error([&] { all_reduce(comm, s, s, SIZE_MAX / 2, DType::kF32, nullptr); },
                 ErrorCode::kInvalidArgument, "overflows");
    CollectiveConfig bad_threads;
    bad_threads.threads = 100;
    expect_error([&] { all_reduce(comm, s, s, n, DType::kF32, nullptr, bad_threads); },
                 ErrorCode::kInvalidArgument, "threads = 100");
    if (device_count() > 1) {
      cudaStream_t other;
      cudaSetDevice((comm.device() + 1) % device_count());
      MKT_CUDA(cudaStreamCreate(&other));
      cudaSetDevice(comm.device());
      expect_error([&] { all_reduce(comm, s, s, n, DType::kF32, other); },
                   ErrorCode::kInvalidArgument, "stream belongs to GPU");
      cudaStreamDestroy(other);
    }
    // Ranks disagreeing on a symmetric size fail together.
    expect_error([&] { comm.alloc(comm.rank() == 0 ? 4096 : 8192); }, ErrorCode::kInvalidArgument,
                 "ranks disagree");

    // Nothing was written by any rejected call.
    MKT_CUDA(cudaDeviceSynchronize());
    std::vector<unsigned char> a(sym.size()), b(8 * n);
    MKT_CUDA(cudaMemcpy(a.data(), sym.data(), a.size(), cudaMemcpyDeviceToHost));
    MKT_CUDA(cudaMemcpy(b.data(), plain, b.size(), cudaMemcpyDeviceToHost));
    std::size_t changed = 0;
    for (unsigned char x : a) changed += x != 0x5A;
    for (unsigned char x : b) changed += x != 0x5A;
    EXPECT_EQ(changed, 0u) << "a rejected call wrote to its buffers";
    cudaFree(plain);
  });
}

TEST(InProcessRuntime, CreateRejectsMissingDevice) {
  MKT_REQUIRE_GPU();
  InProcessGroup group(1);
  CommOptions options;
  options.device = 1000;
  cudaGetLastError();
  expect_error([&] { Communicator::create(group.bootstrap(0), options); },
               ErrorCode::kInvalidArgument, "device 1000 does not exist");
  // The failed creation leaves no CUDA error behind for the caller's next launch check.
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
}

// An allocation that fails on one rank only (both ranks on one GPU, each asking for 60% of its
// free memory: one of them runs out) fails on both, and the rank whose memory was created and
// exported keeps neither its descriptor nor the memory; the communicator stays usable.
TEST(InProcessRuntime, AllocFailingOnOneRankLeaksNoFdsOrMemory) {
  MKT_REQUIRE_GPU();
  InProcessGroup group(2);
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; ++r) {
    threads.emplace_back([&, r] {
      try {
        cudaSetDevice(0);
        auto comm = Communicator::create(group.bootstrap(r), {});
        SymmetricBuffer warm = comm->alloc(1 << 20);  // fd exchange and driver state set up
        MKT_CUDA(cudaDeviceSynchronize());
        comm->bootstrap().barrier();
        size_t free_before = 0, total = 0;
        MKT_CUDA(cudaMemGetInfo(&free_before, &total));
        const int fds_before = open_fds();
        uint64_t bytes = free_before / 10 * 6, agreed[2] = {};
        comm->bootstrap().allgather(&bytes, agreed, sizeof(bytes));
        expect_error([&] { comm->alloc(agreed[0]); }, ErrorCode::kOutOfMemory, "out of GPU memory");
        comm->bootstrap().barrier();
        size_t free_after = 0;
        MKT_CUDA(cudaMemGetInfo(&free_after, &total));
        if (r == 0) {
          // At most as many: both ranks are threads of this process, and the driver opens and
          // closes descriptors of its own (one fewer after than before on an H100, 2026-12-06).
          EXPECT_LE(open_fds(), fds_before) << "file descriptors leaked";
          EXPECT_GE(free_after + (64u << 20), free_before)
              << "GPU memory leaked: " << free_before - free_after;
        }
        comm->bootstrap().barrier();
        SymmetricBuffer after = comm->alloc(1 << 20);  // still usable
        EXPECT_TRUE(static_cast<bool>(after));
        comm->bootstrap().barrier();
      } catch (const std::exception& e) {
        ADD_FAILURE() << "rank " << r << " threw: " << e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
}

// ---- time limits
// ------------------------------------------------------------------------------------

// Every rank but the last issues an all_gather; the last never does. The others must fail with a
// time-out naming the missing rank, inside the limit, and the communicator must refuse new work.
void expect_timeout_on_missing_rank(Communicator& comm) {
  const int world = comm.world_size(), rank = comm.rank();
  const int missing = world - 1;
  SymmetricBuffer buf = comm.alloc(1 << 20);
  cudaStream_t stream;
  MKT_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  ready(comm, stream);
  expect_missing_rank_times_out(
      comm, stream,
      [&] {
        all_gather(comm, static_cast<char*>(buf.data()) + rank * 1024, buf.data(), 256, DType::kF32,
                   stream);
      },
      "entry barrier");
  if (rank != missing) {
    expect_error([&] { all_gather(comm, buf.data(), buf.data(), 1, DType::kF32, stream); },
                 ErrorCode::kNotInitialized, "broken");
  }
  cudaStreamDestroy(stream);
  comm.bootstrap().barrier();
}

TEST(InProcessRuntime, MissingRankTimesOut) {
  MKT_REQUIRE_GPU();
  CommOptions options;
  options.timeout_seconds = 1.0;
  run_in_process(2, expect_timeout_on_missing_rank, options);
}

TEST(LaunchedRuntime, MissingRankTimesOut) {
  MKT_REQUIRE_MKRUN();
  CommOptions options;
  options.timeout_seconds = 2.0;
  auto comm = launched_comm(options);
  expect_timeout_on_missing_rank(*comm);
}

// ---- CUDA-graph replay
// ------------------------------------------------------------------------------

// One graph = fill inputs from a device counter -> all_reduce -> append output to a history.
// 1000 replays in a row without any host work in between must all be right: the signal epochs
// advance on the device.
void expect_graph_replays(Communicator& comm, int replays) {
  const std::size_t count = 4096;
  const int world = comm.world_size();
  SymmetricBuffer in = comm.alloc(count * 2), out = comm.alloc(count * 2);
  void* history = nullptr;
  int* counter = nullptr;
  MKT_CUDA(cudaMalloc(&history, count * 2 * replays));
  MKT_CUDA(cudaMalloc(reinterpret_cast<void**>(&counter), sizeof(int)));
  MKT_CUDA(cudaMemset(counter, 0, sizeof(int)));
  MKT_CUDA(cudaMemset(history, 0xFF, count * 2 * replays));
  cudaStream_t stream;
  MKT_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  MKT_CUDA(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  launch_fill(in.data(), count, comm.rank(), counter, stream);
  all_reduce(comm, in.data(), out.data(), count, DType::kBF16, stream);
  launch_record(out.data(), count, history, counter, stream);
  MKT_CUDA(cudaStreamEndCapture(stream, &graph));
  ASSERT_NO_FATAL_FAILURE(instantiate_uploaded(graph, stream, &exec));
  ready(comm, stream);
  for (int k = 0; k < replays; ++k) MKT_CUDA(cudaGraphLaunch(exec, stream));
  comm.synchronize(stream);
  std::vector<uint16_t> host(count * replays);
  MKT_CUDA(cudaMemcpy(host.data(), history, host.size() * 2, cudaMemcpyDeviceToHost));
  int bad_replays = 0, first_bad = -1;
  for (int k = 0; k < replays; ++k) {
    bool ok = true;
    for (std::size_t i = 0; i < count && ok; ++i) {
      ok = from_bits(host[k * count + i], DType::kBF16) == expected_replay_sum(world, k, i);
    }
    if (!ok && bad_replays++ == 0) first_bad = k;
  }
  EXPECT_EQ(bad_replays, 0) << "rank " << comm.rank() << ": first wrong replay " << first_bad;
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
  cudaFree(history);
  cudaFree(counter);
}

TEST(InProcessRuntime, GraphReplays1000Times) {
  MKT_REQUIRE_GPU();
  run_in_process(2, [](Communicator& comm) { expect_graph_replays(comm, 1000); });
}

TEST(LaunchedRuntime, GraphReplays1000Times) {
  MKT_REQUIRE_MKRUN();
  auto comm = launched_comm();
  // Ranks sharing a GPU across processes time-slice; keep the count moderate there.
  expect_graph_replays(*comm, comm->topology().max_ranks_per_device > 1 ? 200 : 1000);
}

}  // namespace
}  // namespace mk::test

// A crash names where it happened (a rank is a thread here: the test alone says too little).
static void print_backtrace_and_die(int sig) {
  void* frames[64];
  const int n = backtrace(frames, 64);
  const char msg[] = "\n*** mkernel_gpu_tests: fatal signal; backtrace:\n";
  (void)!write(2, msg, sizeof(msg) - 1);
  backtrace_symbols_fd(frames, n, 2);
  signal(sig, SIG_DFL);
  raise(sig);
}

int main(int argc, char** argv) {
  for (int sig : {SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGABRT}) signal(sig, print_backtrace_and_die);
  // Up to 8 in-process ranks share a GPU here, each with its stream and, across virtual nodes with
  // device staging, two copy streams: hardware queues of their own for all of them, or a launch
  // can queue behind a peer's waiting kernel (mkernel/communicator.h). Before any CUDA call.
  setenv("CUDA_DEVICE_MAX_CONNECTIONS", "32", /*overwrite=*/0);
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
