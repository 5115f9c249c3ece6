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

// reduce_scatter's bulk path (CollectiveConfig::bulk) against its loads, bitwise: the same
// inputs and order of adds must give the same bits. Two channels make each CTA reuse its ring
// stages (the first case: 11 chunks per CTA at 2 ranks, 43 at 8); 16-byte multiple slices (every
// rank on the bulk path) end in a short chunk; odd counts put rank 0 (and rank 4 of 8 for f32 + 5)
// on the bulk path with a < 16-byte element tail and the others on the loads.
class BulkReduceScatter : public ::testing::TestWithParam<int> {};

TEST_P(BulkReduceScatter, MatchesLoadsBitwise) {
  MKT_REQUIRE_GPU();
  struct BulkCase {
    Case c;
    int channels;  // 0: the heuristic
  };
  const std::vector<BulkCase> cases = {
      {{(1 << 18) + 1000, DType::kBF16}, 2}, {{(1 << 18) + 1000, DType::kBF16}, 0},
      {{(1 << 18) + 3, DType::kBF16}, 2},    {{(1 << 17) + 56, DType::kF16}, 2},
      {{(1 << 16) + 4, DType::kF32}, 2},     {{(1 << 16) + 5, DType::kF32}, 2}};
  const int world = GetParam();
  const uint64_t seed = std::random_device{}() * 0x100000001ull + std::random_device{}();
  std::vector<std::vector<unsigned char>> got[2];  // [bulk][rank * cases + case]
  for (int bulk : {0, 1}) {
    got[bulk].resize(world * cases.size());
    run_in_process(world, [&](Communicator& comm) {
      for (std::size_t k = 0; k < cases.size(); ++k) {
        CollectiveConfig config;
        config.channels = cases[k].channels;
        config.bulk = bulk == 1;
        expect_reduce_scatter(comm, cases[k].c, seed + k, config,
                              &got[bulk][comm.rank() * cases.size() + k]);
      }
    });
  }
  for (std::size_t i = 0; i < got[0].size(); ++i) {
    const BulkCase& bc = cases[i % cases.size()];
    EXPECT_TRUE(got[0][i] == got[1][i])
        << "reduce_scatter rank " << i / cases.size() << " world " << world << " count "
        << bc.c.count << " " << dtype_name(bc.c.dtype) << " channels " << bc.channels
        << ": the bulk path differs from the loads";
  }
}

INSTANTIATE_TEST_SUITE_P(World, BulkReduceScatter, ::testing::Values(2, 4, 8),
                         [](const auto& info) { return "w" + std::to_string(info.param); });

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
