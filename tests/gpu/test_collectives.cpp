// Collective correctness at world sizes 1, 2, 4 and 8: in one process (threads; several ranks share
// a GPU when there are fewer GPUs than ranks) and as separate processes under mkrun.
#include "collective_checks.h"

namespace mk::test {
namespace {

class InProcessCollectives : public ::testing::TestWithParam<int> {};

TEST_P(InProcessCollectives, MatchReference) {
  MKT_REQUIRE_GPU();
  run_in_process(GetParam(), [](Communicator& comm) { expect_collectives(comm); });
}

INSTANTIATE_TEST_SUITE_P(World, InProcessCollectives, ::testing::Values(1, 2, 4, 8),
                         [](const auto& info) { return "w" + std::to_string(info.param); });

TEST(LaunchedCollectives, MatchReference) {
  MKT_REQUIRE_MKRUN();
  auto comm = launched_comm();
  expect_collectives(*comm);
}

// Small, quick cases for compute-sanitizer (memcheck, racecheck, synccheck).
TEST(SanitizeCollectives, SmallWorld2) {
  MKT_REQUIRE_GPU();
  run_in_process(2, [](Communicator& comm) {
    const uint64_t seed = shared_seed(comm);
    for (Case c : {Case{1000, DType::kBF16}, Case{4097, DType::kF32}}) {
      expect_all_gather(comm, c, seed, false);
      expect_reduce_scatter(comm, c, seed + 1);
      expect_all_reduce(comm, c, seed + 2, false);
      expect_all_reduce(comm, c, seed + 3, true);
    }
  });
}

}  // namespace
}  // namespace mk::test

namespace mk::test {
namespace {

// Many back-to-back launches of two ranks: on two GPUs, or both on one GPU in one process
// (MKERNEL_TEST_DEVICES=1), where the ranks' kernels must run side by side.
TEST(InProcessCollectives, ManyLaunchesTwoRanks) {
  MKT_REQUIRE_GPU();
  run_in_process(2, [](Communicator& comm) {
    SymmetricBuffer buf = comm.alloc(1 << 20);
    cudaStream_t stream;
    MKT_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    ready(comm, stream);
    for (int i = 0; i < 300; ++i) {
      all_reduce(comm, buf.data(), buf.data(), 4096, DType::kF32, stream);
      if (i % 3 == 0) comm.synchronize(stream);
    }
    comm.synchronize(stream);
    cudaStreamDestroy(stream);
  });
}

}  // namespace
}  // namespace mk::test
