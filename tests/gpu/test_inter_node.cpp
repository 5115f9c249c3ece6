// The communicator's inter-node path on the GPU (Communicator::inter_node, Launch::wait_remote):
// virtual nodes on one host (CommOptions::ranks_per_node), the socket backend over loopback.
// A kernel pushes a put+signal for its rail peer into the path's command ring and waits on the
// host-mapped pad for the peer's; the proxy's threads stage the device bytes through host memory
// while both kernels run. Three launches in a row (no reset between them), 2 x 1 and 2 x 2 ranks;
// a signal that never comes -> the time-limit error naming the peer and the inter-node signal; a
// rail peer that dies mid-wait -> the kernel stops early and check() names the lost peer.
#include <chrono>

#include "gpu_test_util.h"
#include "inter_node_kernels.h"
#include "runtime/inter_node.h"
#include "transport/socket_transport.h"

namespace mk::test {
namespace {

constexpr uint32_t kSignal = 5;

// This rank's single rail peer (two nodes).
int rail_peer(const Communicator& comm) {
  const Topology& t = comm.topology();
  return (1 - t.node) * t.local_size + t.local_rank;
}

void exchange_rounds(Communicator& comm, uint64_t bytes, int rounds) {
  const int peer = rail_peer(comm);
  detail::InterNode& path = comm.inter_node();
  EXPECT_EQ(path.peers(), std::vector<int>{peer}) << path.describe();
  uint8_t *src, *dst;
  MKT_CUDA(cudaMalloc(reinterpret_cast<void**>(&src), bytes));
  MKT_CUDA(cudaMalloc(reinterpret_cast<void**>(&dst), bytes));
  path.register_buffer(0, src, bytes, transport::MemoryKind::kDevice);
  path.register_buffer(1, dst, bytes, transport::MemoryKind::kDevice);
  unsigned long long* mismatches;
  int* status;
  MKT_CUDA(cudaMalloc(reinterpret_cast<void**>(&mismatches), sizeof(unsigned long long)));
  MKT_CUDA(cudaMalloc(reinterpret_cast<void**>(&status), sizeof(int)));
  cudaStream_t stream;
  MKT_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  preload_inter_node_kernels();
  const DeviceComm dc = comm.device_comm();
  ASSERT_NE(dc.host_signals, nullptr);
  for (int round = 0; round < rounds; ++round) {
    launch_fill_round_pattern(src, bytes, comm.rank(), round, stream);
    MKT_CUDA(cudaMemsetAsync(dst, 0, bytes, stream));
    MKT_CUDA(cudaMemsetAsync(mismatches, 0, sizeof(unsigned long long), stream));
    MKT_CUDA(cudaStreamSynchronize(stream));
    comm.bootstrap().barrier();  // the peer's dst is cleared before anything is put there
    launch_exchange_with_peer(dc, path.proxy().ring(round % path.proxy().num_rings()), peer,
                              kSignal, dst, bytes, round, mismatches, status, stream);
    comm.synchronize(stream);
    int got_status = -1;
    unsigned long long got_mismatches = 0;
    MKT_CUDA(cudaMemcpy(&got_status, status, sizeof(int), cudaMemcpyDeviceToHost));
    MKT_CUDA(
        cudaMemcpy(&got_mismatches, mismatches, sizeof(got_mismatches), cudaMemcpyDeviceToHost));
    EXPECT_EQ(got_status, 0) << "round " << round << ", rank " << comm.rank() << " (1: push "
                             << "failed, 2: wait gave up)";
    EXPECT_EQ(got_mismatches, 0u) << "round " << round << ", rank " << comm.rank();
    comm.bootstrap().barrier();
  }
  path.check();
  cudaStreamDestroy(stream);
  for (void* p : {static_cast<void*>(src), static_cast<void*>(dst), static_cast<void*>(mismatches),
                  static_cast<void*>(status)}) {
    cudaFree(p);
  }
}

TEST(InProcessInterNode, KernelsExchangeWithRailPeer2x1) {
  MKT_REQUIRE_GPU();
  run_in_process(
      2, [](Communicator& comm) { exchange_rounds(comm, 3 << 20, 3); }, virtual_nodes(1));
}

TEST(InProcessInterNode, KernelsExchangeWithRailPeer2x2) {
  MKT_REQUIRE_GPU();
  run_in_process(
      4, [](Communicator& comm) { exchange_rounds(comm, 100000, 3); }, virtual_nodes(2));
}

TEST(InProcessInterNode, OneNodeHasNoPath) {
  MKT_REQUIRE_GPU();
  run_in_process(2, [](Communicator& comm) {
    expect_error([&] { comm.inter_node(); }, ErrorCode::kInvalidArgument, "one node");
    EXPECT_EQ(comm.device_comm().host_signals, nullptr);
  });
}

// Rank 1 never signals: rank 0's wait ends at the 1-s limit and check() names rank 1 and the
// inter-node signal.
TEST(InProcessInterNode, MissingSignalTimesOut) {
  MKT_REQUIRE_GPU();
  run_in_process(
      2,
      [](Communicator& comm) {
        comm.inter_node();
        if (comm.rank() == 0) {
          int* status;
          MKT_CUDA(cudaMalloc(reinterpret_cast<void**>(&status), sizeof(int)));
          cudaStream_t stream;
          MKT_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
          preload_inter_node_kernels();
          launch_wait_remote(comm.device_comm(), 1, kSignal, status, stream);
          expect_error([&] { comm.synchronize(stream); }, ErrorCode::kTimeout,
                       "inter-node signal 5");
          expect_error([&] { comm.check(); }, ErrorCode::kTimeout, "for rank 1");
          cudaStreamDestroy(stream);
          cudaFree(status);
        }
        comm.bootstrap().barrier();
      },
      virtual_nodes(1, 1.0));
}

// Rank 1's process "dies" (its transport closes without a goodbye) while rank 0's kernel waits
// for it: the kernel gives up at once (the path's abort word), well inside the 30-s limit, and
// check() names the lost peer.
TEST(InProcessInterNode, LostPeerStopsTheWaitingKernel) {
  MKT_REQUIRE_GPU();
  run_in_process(
      2,
      [](Communicator& comm) {
        detail::InterNode& path = comm.inter_node();
        if (comm.rank() == 1) {
          comm.bootstrap().barrier();  // rank 0's kernel is running
          std::this_thread::sleep_for(std::chrono::milliseconds(200));
          dynamic_cast<transport::detail::SocketTransport&>(path.transport()).close_abruptly();
          comm.bootstrap().barrier();
          return;
        }
        int* status;
        MKT_CUDA(cudaMalloc(reinterpret_cast<void**>(&status), sizeof(int)));
        cudaStream_t stream;
        MKT_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
        preload_inter_node_kernels();
        const auto start = std::chrono::steady_clock::now();
        launch_wait_remote(comm.device_comm(), 1, kSignal, status, stream);
        comm.bootstrap().barrier();
        expect_error([&] { comm.synchronize(stream); }, ErrorCode::kBootstrap, "rank 1");
        EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(),
                  10.0);
        int got = -1;
        MKT_CUDA(cudaMemcpy(&got, status, sizeof(int), cudaMemcpyDeviceToHost));
        EXPECT_EQ(got, 2);
        comm.bootstrap().barrier();
        cudaStreamDestroy(stream);
        cudaFree(status);
      },
      virtual_nodes(1, 30.0));
}

}  // namespace
}  // namespace mk::test
