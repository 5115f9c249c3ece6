// The communicator's inter-node path (runtime/inter_node.h) over the socket backend, between
// threads of one process split into virtual nodes: rail peers only, bytes and signals through the
// proxy's rings at 2 x 2, 3 x 2 and 2 x 4 ranks, and the failures - a command for a rank of the
// same node or another rail, a one-node topology, a wait that times out, a lost peer.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "cpu_test_util.h"
#include "mkernel/topology.h"
#include "runtime/inter_node.h"
#include "test_transport_util.h"
#include "transport/socket_transport.h"

namespace mk::detail {
namespace {

using mk::test::contains;
using mk::test::Outcome;
using transport::make_put_signal;

// `nodes` x `per_node` ranks of one process, virtual nodes of `per_node` consecutive ranks.
Topology virtual_topology(int rank, int nodes, int per_node) {
  std::vector<RankInfo> infos(nodes * per_node);
  for (int r = 0; r < nodes * per_node; ++r) {
    infos[r].host_id = 7;
    infos[r].pid = 1;
    infos[r].device = r % 2;
    infos[r].device_uuid[0] = static_cast<uint8_t>(r % 2);
    infos[r].sm_count = 132;
    infos[r].ranks_per_node = per_node;
  }
  return compute_topology(rank, infos);
}

InterNodeConfig test_config(double timeout = 10) {
  InterNodeConfig c;
  c.backend = "socket";
  c.channels = 2;
  c.ring_capacity = 64;
  c.num_signals = 8;
  c.timeout_seconds = timeout;
  return c;
}

uint64_t seed_of(int src, int dst) { return static_cast<uint64_t>(src) * 1000 + dst + 1; }

// Runs fn, then meets the other ranks at a barrier whether fn threw or not (a rank that leaves
// early would hold the others at theirs), then rethrows.
void then_barrier(Bootstrap& b, const std::function<void()>& fn) {
  std::exception_ptr error;
  try {
    fn();
  } catch (...) {
    error = std::current_exception();
  }
  b.barrier();
  if (error) std::rethrow_exception(error);
}

void expect_all_ok(const std::vector<Outcome>& outcomes) {
  for (std::size_t r = 0; r < outcomes.size(); ++r) {
    EXPECT_FALSE(outcomes[r].threw) << "rank " << r << ": " << outcomes[r].message;
  }
}

// Every rank puts `bytes` (with a signal) to each rail peer through the proxy, channel by peer,
// and checks what each rail peer put into its buffer; the peer set is the rail.
void exchange_on_rails(int nodes, int per_node, uint64_t bytes) {
  const int world = nodes * per_node;
  expect_all_ok(mk::test::run_group(world, [&](Bootstrap& b) {
    const int me = b.rank();
    const Topology topo = virtual_topology(me, nodes, per_node);
    InterNode path(b, topo, test_config());
    std::vector<int> want;
    for (int n = 0; n < nodes; ++n) {
      if (n != topo.node) want.push_back(n * per_node + topo.local_rank);
    }
    EXPECT_EQ(path.peers(), want) << path.describe();
    EXPECT_TRUE(contains(path.describe(), "socket")) << path.describe();
    for (int r = 0; r < world; ++r)
      EXPECT_EQ(path.is_peer(r), r != me && r % per_node == me % per_node);

    std::vector<char> src(bytes * world), dst(bytes * world, 0);
    for (int p : path.peers()) mk::test::fill_pattern(&src[bytes * p], bytes, seed_of(me, p));
    path.register_buffer(0, src.data(), src.size(), transport::MemoryKind::kHost);
    path.register_buffer(1, dst.data(), dst.size(), transport::MemoryKind::kHost);
    for (std::size_t i = 0; i < path.peers().size(); ++i) {
      const int p = path.peers()[i];
      path.proxy().push(static_cast<int>(i % 2),
                        make_put_signal(p, 1, 0, bytes * p, 1, bytes * me, bytes, 3, 40 + me));
    }
    for (int p : path.peers()) {
      path.wait(p, 3, 40 + p);
      EXPECT_EQ(mk::test::first_mismatch(&dst[bytes * p], bytes, seed_of(p, me)), -1)
          << "bytes from rank " << p;
    }
    path.check();
    b.barrier();  // nobody leaves while a peer still waits
  }));
}

// The ag_gemm rail protocol (ag_gemm.cuh, across nodes) without a GPU, many launches in a row:
// each launch a rank announces "entered" (signal 0), then `pieces` producer threads - two per
// ring - each wait for the peer's "entered", write a piece with this launch's pattern into the
// rank's slot of a "device" buffer (staged through the copy hooks, as the socket backend stages
// GPU memory) and push put+signal (1 + node x pieces + p); the rank then waits for every piece of
// its peer and checks it. Every `grow` launches a new, larger buffer is registered while the old
// ones stay (as the Python package grows its workspace) and the pieces per shard change - so
// signal words are reused across buffers, piece counts and launches with epoch-stamped values.
void stress_rail_pieces(int launches, int pieces0, int grow) {
  constexpr int kNodes = 2;
  expect_all_ok(mk::test::run_group(kNodes, [&](Bootstrap& b) {
    const int me = b.rank(), peer = 1 - me;
    const Topology topo = virtual_topology(me, kNodes, 1);
    InterNodeConfig config = test_config(20);
    config.channels = 4;
    config.ring_capacity = 256;
    config.num_signals = 4096;
    config.copy_to_device = [](void* dst, const void* src, std::size_t n) {
      std::memcpy(dst, src, n);
    };
    config.copy_from_device = config.copy_to_device;
    InterNode path(b, topo, config);
    std::vector<std::unique_ptr<std::vector<char>>> buffers;  // all kept, as Python keeps them
    int id = -1, pieces = pieces0;
    uint64_t piece_bytes = 0;
    for (int launch = 1; launch <= launches; ++launch) {
      if ((launch - 1) % grow == 0) {  // a new, larger workspace
        pieces = pieces0 + (launch - 1) / grow;
        piece_bytes = 4096 * (1 + (launch - 1) / grow);
        buffers.push_back(std::make_unique<std::vector<char>>(kNodes * pieces * piece_bytes));
        id = path.buffer_id(buffers.back()->data(), buffers.back()->size(),
                            transport::MemoryKind::kDevice);
      }
      std::vector<char>& ws = *buffers.back();
      const uint64_t value = (static_cast<uint64_t>(launch) << 32) | 1;
      path.proxy().push(0, transport::make_signal(peer, 0, 0, value));  // entered
      std::vector<std::thread> producers;
      for (int p = 0; p < pieces; ++p) {
        producers.emplace_back([&, p] {
          path.wait(peer, 0, value);  // its last launch has read what we sent it
          const uint64_t offset = (static_cast<uint64_t>(me) * pieces + p) * piece_bytes;
          mk::test::fill_pattern(&ws[offset], piece_bytes, launch * 1000003u + me * 1009u + p);
          path.proxy().push(p % config.channels,
                            make_put_signal(peer, p, id, offset, id, offset, piece_bytes,
                                            1 + me * pieces + p, value));
        });
      }
      for (std::thread& t : producers) t.join();
      for (int p = 0; p < pieces; ++p) {
        path.wait(peer, 1 + peer * pieces + p, value);
        const uint64_t offset = (static_cast<uint64_t>(peer) * pieces + p) * piece_bytes;
        ASSERT_EQ(mk::test::first_mismatch(&ws[offset], piece_bytes,
                                           launch * 1000003u + peer * 1009u + p),
                  -1)
            << "launch " << launch << ", piece " << p << " of rank " << peer;
      }
    }
    path.check();
    b.barrier();
  }));
}

// MKERNEL_TEST_STRESS_LAUNCHES: more launches (a longer hunt for a lost piece).
TEST(InterNode, RailPiecesManyLaunchesGrowingBuffers) {
  const char* env = std::getenv("MKERNEL_TEST_STRESS_LAUNCHES");
  const int launches = env != nullptr ? std::atoi(env) : 300;
  stress_rail_pieces(launches, 8, std::max(40, launches / 10));  // at most 10 buffers of 16 ids
}

TEST(InterNode, RailPeersCarryBytesAndSignals2x2) { exchange_on_rails(2, 2, 1 << 20); }
TEST(InterNode, RailPeersCarryBytesAndSignals3x2) { exchange_on_rails(3, 2, 300000); }
TEST(InterNode, RailPeersCarryBytesAndSignals2x4) { exchange_on_rails(2, 4, 65536); }
TEST(InterNode, OneRankPerNode) { exchange_on_rails(3, 1, 4096); }

// A command for a rank that is not a rail peer (same node, or another node's other rail) is
// rejected by the proxy, never sent; check() then names it on that rank.
TEST(InterNode, CommandOffTheRailIsRejected) {
  const auto outcomes = mk::test::run_group(4, [&](Bootstrap& b) {
    const int me = b.rank();
    InterNode path(b, virtual_topology(me, 2, 2), test_config());
    std::vector<char> buf(4096);
    path.register_buffer(0, buf.data(), buf.size(), transport::MemoryKind::kHost);
    then_barrier(b, [&] {
      if (me != 0) return;
      // One ring: its thread meets them in this order, so the first error names rank 1.
      path.proxy().push(0, make_put_signal(1, 9, 0, 0, 0, 0, 64, 2, 1));  // same node
      path.proxy().push(0, make_put_signal(3, 9, 0, 0, 0, 0, 64, 2, 1));  // other rail
      path.proxy().drain(10);
      EXPECT_EQ(path.proxy().stats().rejected, 2u);
      path.check();  // throws the first rejection
    });
  });
  ASSERT_TRUE(outcomes[0].threw);
  EXPECT_EQ(outcomes[0].code, ErrorCode::kInvalidArgument) << outcomes[0].message;
  EXPECT_TRUE(contains(outcomes[0].message, "rank 1")) << outcomes[0].message;
  for (int r = 1; r < 4; ++r) EXPECT_FALSE(outcomes[r].threw) << outcomes[r].message;
}

// buffer_id: the same ids on every rank for the same allocations in the same order, the same id
// again for a base seen before, an error for a known base with another size; puts name the ids.
TEST(InterNode, BufferIdsRegisterOnFirstUse) {
  expect_all_ok(mk::test::run_group(2, [&](Bootstrap& b) {
    const int me = b.rank(), peer = 1 - me;
    InterNode path(b, virtual_topology(me, 2, 1), test_config());
    std::vector<char> scratch(64), src(8192), dst(8192, 0);
    path.register_buffer(2, scratch.data(), scratch.size(), transport::MemoryKind::kHost);
    const int s = path.buffer_id(src.data(), src.size(), transport::MemoryKind::kHost);
    const int d = path.buffer_id(dst.data(), dst.size(), transport::MemoryKind::kHost);
    EXPECT_EQ(s, 0);  // the lowest ids register_buffer left free
    EXPECT_EQ(d, 1);
    EXPECT_EQ(path.buffer_id(src.data(), src.size(), transport::MemoryKind::kHost), s);
    try {
      path.buffer_id(src.data(), 4096, transport::MemoryKind::kHost);
      ADD_FAILURE() << "no error for a known base with another size";
    } catch (const Error& e) {
      EXPECT_TRUE(contains(e.what(), "8192")) << e.what();
    }
    mk::test::fill_pattern(src.data(), src.size(), seed_of(me, peer));
    path.proxy().push(0, make_put_signal(peer, 0, s, 0, d, 0, src.size(), 1, 9));
    path.wait(peer, 1, 9);
    EXPECT_EQ(mk::test::first_mismatch(dst.data(), dst.size(), seed_of(peer, me)), -1);
    b.barrier();
  }));
}

// An owner that expires frees its id at the next buffer_id call: a command naming the freed id is
// rejected, and the id serves the next buffer (another size, same or other address).
TEST(InterNode, ExpiredOwnersFreeTheirIds) {
  expect_all_ok(mk::test::run_group(2, [&](Bootstrap& b) {
    const int me = b.rank(), peer = 1 - me;
    InterNode path(b, virtual_topology(me, 2, 1), test_config());
    std::vector<char> x(8192), y(4096), z(2048, 0);
    auto x_owner = std::make_shared<int>(0);
    auto y_owner = std::make_shared<int>(1);
    const auto host = transport::MemoryKind::kHost;
    EXPECT_EQ(path.buffer_id(x.data(), x.size(), host, x_owner), 0);
    EXPECT_EQ(path.buffer_id(y.data(), y.size(), host, y_owner), 1);
    x_owner.reset();
    EXPECT_EQ(path.buffer_id(y.data(), y.size(), host, y_owner), 1);  // releases id 0
    if (me == 0) {
      path.proxy().push(0, make_put_signal(peer, 0, 0, 0, 1, 0, 64, 1, 1));
      try {
        path.proxy().drain(10);  // throws the rejection
        ADD_FAILURE() << "a put naming a released buffer was executed";
      } catch (const Error& e) {
        EXPECT_TRUE(contains(e.what(), "no buffer is registered under id 0")) << e.what();
      }
      EXPECT_EQ(path.proxy().stats().rejected, 1u);
    }
    b.barrier();
    auto z_owner = std::make_shared<int>(2);
    EXPECT_EQ(path.buffer_id(z.data(), z.size(), host, z_owner), 0);  // the freed id again
    b.barrier();
  }));
}

// Where the kernels stage what crosses the network: in host memory over the socket backend
// unless the config says "device" (the communicator passes MKERNEL_INTER_NODE_STAGING there);
// anything else is refused.
TEST(InterNode, StagingIsHostForSocketsUnlessToldOtherwise) {
  for (const char* asked : {"", "host", "device"}) {
    expect_all_ok(mk::test::run_group(2, [&](Bootstrap& b) {
      InterNodeConfig c = test_config();
      c.staging = asked;
      InterNode path(b, virtual_topology(b.rank(), 2, 1), c);
      const bool host = std::string(asked) != "device";
      EXPECT_EQ(path.host_staging(), host) << "staging \"" << asked << "\"";
      EXPECT_TRUE(
          contains(path.describe(), host ? "staging in host memory" : "staging in device memory"))
          << path.describe();
      if (!host) {
        try {
          path.staging(64);
          ADD_FAILURE() << "staging() on a path that stages in device memory";
        } catch (const Error& e) {
          EXPECT_EQ(e.code(), ErrorCode::kInternal) << e.what();
        }
      }
    }));
  }
  const auto outcomes = mk::test::run_group(2, [&](Bootstrap& b) {
    InterNodeConfig c = test_config();
    c.staging = "nvme";
    InterNode path(b, virtual_topology(b.rank(), 2, 1), c);
  });
  for (const Outcome& o : outcomes) {
    ASSERT_TRUE(o.threw);
    EXPECT_EQ(o.code, ErrorCode::kInvalidArgument) << o.message;
    EXPECT_TRUE(contains(o.message, "\"nvme\"")) << o.message;
  }
}

// Host staging grows on demand (the same buffer for a smaller ask, a new one and a new id for a
// larger), puts carry bytes from one rank's staging into another's, and an earlier staging stays
// registered (a kernel still in flight may use it).
TEST(InterNode, HostStagingGrowsAndCarriesPuts) {
  expect_all_ok(mk::test::run_group(2, [&](Bootstrap& b) {
    const int me = b.rank(), peer = 1 - me;
    InterNode path(b, virtual_topology(me, 2, 1), test_config());
    const InterNode::Staging small = path.staging(1000);
    EXPECT_GE(small.bytes, 1000u);
    EXPECT_EQ(path.staging(small.bytes).base, small.base);
    const InterNode::Staging large = path.staging(small.bytes + 20000);
    EXPECT_GE(large.bytes, small.bytes + 20000);
    EXPECT_NE(large.buffer, small.buffer);
    EXPECT_EQ(path.staging(10).base, large.base);  // the largest serves smaller asks
    uint8_t* out = large.base + 4096;              // this rank's bytes, at the same offset there
    uint8_t* in = large.base + 12288;
    mk::test::fill_pattern(out, 8192, seed_of(me, peer));
    std::memset(in, 0, 8192);
    b.barrier();
    path.proxy().push(
        0, make_put_signal(peer, 0, large.buffer, 4096, large.buffer, 12288, 8192, 1, 3));
    path.wait(peer, 1, 3);
    EXPECT_EQ(mk::test::first_mismatch(in, 8192, seed_of(peer, me)), -1);
    mk::test::fill_pattern(small.base, 512, seed_of(me, peer) + 1);  // the earlier one still works
    b.barrier();
    path.proxy().push(1, make_put_signal(peer, 0, small.buffer, 0, large.buffer, 0, 512, 2, 4));
    path.wait(peer, 2, 4);
    EXPECT_EQ(mk::test::first_mismatch(large.base, 512, seed_of(peer, me) + 1), -1);
    b.barrier();
  }));
}

TEST(InterNode, OneNodeIsRefused) {
  const auto outcomes = mk::test::run_group(
      2, [&](Bootstrap& b) { InterNode path(b, virtual_topology(b.rank(), 1, 2), test_config()); });
  for (const Outcome& o : outcomes) {
    ASSERT_TRUE(o.threw);
    EXPECT_EQ(o.code, ErrorCode::kInvalidArgument);
    EXPECT_TRUE(contains(o.message, "one node")) << o.message;
  }
}

TEST(InterNode, UnknownBackendIsRefusedOnEveryRank) {
  const auto outcomes = mk::test::run_group(2, [&](Bootstrap& b) {
    InterNodeConfig c = test_config();
    c.backend = "carrier-pigeon";
    InterNode path(b, virtual_topology(b.rank(), 2, 1), c);
  });
  for (const Outcome& o : outcomes) {
    ASSERT_TRUE(o.threw);
    EXPECT_EQ(o.code, ErrorCode::kInvalidArgument) << o.message;
    EXPECT_TRUE(contains(o.message, "carrier-pigeon")) << o.message;
  }
}

// A signal that never comes: the wait ends after the time limit with an error naming the peer,
// the signal and the value.
TEST(InterNode, WaitTimesOutNamingPeerAndSignal) {
  const auto outcomes = mk::test::run_group(2, [&](Bootstrap& b) {
    InterNode path(b, virtual_topology(b.rank(), 2, 1), test_config(0.3));
    then_barrier(b, [&] {
      if (b.rank() == 0) path.wait(1, 5, 7);
    });
  });
  ASSERT_TRUE(outcomes[0].threw);
  EXPECT_EQ(outcomes[0].code, ErrorCode::kTimeout) << outcomes[0].message;
  for (const char* part : {"signal 5", "from rank 1", "reach 7"}) {
    EXPECT_TRUE(contains(outcomes[0].message, part)) << outcomes[0].message;
  }
  EXPECT_FALSE(outcomes[1].threw) << outcomes[1].message;
}

// A rail peer whose process dies (its transport closed abruptly, no goodbye) while the other
// waits for its signal: the wait fails with the transport's error naming the lost peer, well
// inside the time limit; on_error saw it first.
TEST(InterNode, LostPeerFailsTheWait) {
  std::vector<std::string> seen(2);
  const auto outcomes = mk::test::run_group(2, [&](Bootstrap& b) {
    const int me = b.rank();
    InterNodeConfig c = test_config(20);
    c.on_error = [&seen, me](const Error& e) { seen[me] = e.what(); };
    InterNode path(b, virtual_topology(me, 2, 1), c);
    b.barrier();
    if (me == 1) {
      dynamic_cast<transport::detail::SocketTransport&>(path.transport()).close_abruptly();
      return;
    }
    const auto start = std::chrono::steady_clock::now();
    try {
      path.wait(1, 0, 1);
    } catch (const Error&) {
      EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(),
                10);
      throw;
    }
  });
  ASSERT_TRUE(outcomes[0].threw);
  EXPECT_TRUE(contains(outcomes[0].message, "rank 1")) << outcomes[0].message;
  EXPECT_FALSE(contains(outcomes[0].message, "waited")) << outcomes[0].message;
  EXPECT_TRUE(contains(seen[0], "rank 1")) << seen[0];
  EXPECT_FALSE(outcomes[1].threw) << outcomes[1].message;
}

}  // namespace
}  // namespace mk::detail
