// Proxy + socket transport between ranks of one process (InProcessGroup): real bytes at 2, 3
// and 4 ranks, offsets beyond 4 GiB, device-memory hooks, and the failures: refused and
// unreachable peers at setup, a peer that disappears mid-run, malformed messages.
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "cpu_test_util.h"
#include "mkernel/transport/proxy.h"
#include "runtime/socket_util.h"
#include "test_transport_util.h"
#include "transport/socket_transport.h"

namespace mk::transport {
namespace {

using mk::test::contains;
using mk::test::Outcome;

constexpr uint64_t kMiB = uint64_t{1} << 20;
constexpr uint64_t kGiB = uint64_t{1} << 30;

TransportConfig config_for(HostSignalPad& pad, uint32_t num_signals = 8, double timeout = 10) {
  TransportConfig c;
  c.signals = &pad;
  c.num_signals = num_signals;
  c.timeout_seconds = timeout;
  return c;
}

uint64_t seed_of(int src, int dst) { return static_cast<uint64_t>(src) * 1000 + dst + 1; }

void expect_all_ok(const std::vector<Outcome>& outcomes) {
  for (std::size_t r = 0; r < outcomes.size(); ++r) {
    EXPECT_FALSE(outcomes[r].threw) << "rank " << r << ": " << outcomes[r].message;
  }
}

// Every rank sends `bytes` to every other rank (half as a put on ring 0, half as a put+signal on
// ring 1, both counted on signal 1) and checks what it received from each.
void exchange(int world, uint64_t bytes) {
  const auto outcomes = mk::test::run_group(world, [&](Bootstrap& b) {
    const int me = b.rank();
    HostSignalPad pad(world, 8);
    auto t = make_transport(b, config_for(pad), "socket");
    EXPECT_STREQ(t->name(), "socket");
    std::vector<char> src(bytes * world), dst(bytes * world, 0);
    for (int p = 0; p < world; ++p) mk::test::fill_pattern(&src[bytes * p], bytes, seed_of(me, p));
    t->register_buffer(0, src.data(), src.size());
    t->register_buffer(1, dst.data(), dst.size());
    ProxyOptions options;
    options.num_rings = 2;
    Proxy proxy(*t, options);
    const uint64_t half = bytes / 2;
    for (int p = 0; p < world; ++p) {
      if (p == me) continue;
      // A signal covers the puts before it on its ring: both halves on one ring per peer.
      proxy.push(p % 2, make_put(p, 1, 0, bytes * p, 1, bytes * me, half, 1));
      proxy.push(p % 2, make_put_signal(p, 2, 0, bytes * p + half, 1, bytes * me + half,
                                        bytes - half, 1, 100 + p));
    }
    auto healthy = [&] {
      t->check();
      proxy.check();
    };
    for (int p = 0; p < world; ++p) {
      if (p == me) continue;
      ASSERT_TRUE(pad.wait(p, 1, 100 + me, 20, healthy)) << "no signal from rank " << p;
      EXPECT_EQ(mk::test::first_mismatch(&dst[bytes * p], bytes, seed_of(p, me)), -1)
          << "rank " << me << " from rank " << p;
    }
    proxy.drain(20);
    b.barrier();  // everyone received everything before anyone leaves
  });
  expect_all_ok(outcomes);
}

TEST(TransportSocket, TwoRanksMoveBytes) { exchange(2, 9 * kMiB + 123); }  // 3 chunks per half
TEST(TransportSocket, ThreeRanksMoveBytes) { exchange(3, 3 * kMiB + 7); }
TEST(TransportSocket, FourRanksMoveBytes) { exchange(4, 2 * kMiB + 5); }

// TransportConfig::peers: four ranks as two nodes of two ({0, 1}, {2, 3}); each connects only
// to the other node's ranks (as the multi-node kernels' transport does), moves bytes to them,
// and an op for a rank of its own node is refused before anything is sent.
TEST(TransportSocket, PeersOnOtherNodesOnly) {
  constexpr int kWorld = 4;
  constexpr uint64_t kBytes = kMiB + 24;
  const auto outcomes = mk::test::run_group(kWorld, [&](Bootstrap& b) {
    const int me = b.rank(), node = me / 2;
    HostSignalPad pad(kWorld, 8);
    TransportConfig config = config_for(pad);
    for (int r = 0; r < kWorld; ++r) {
      if (r / 2 != node) config.peers.push_back(r);
    }
    auto t = make_transport(b, config, "socket");
    for (int r = 0; r < kWorld; ++r) EXPECT_EQ(t->is_peer(r), r / 2 != node) << "rank " << r;
    std::vector<char> src(kBytes * kWorld), dst(kBytes * kWorld, 0);
    for (int p = 0; p < kWorld; ++p)
      mk::test::fill_pattern(&src[kBytes * p], kBytes, seed_of(me, p));
    t->register_buffer(0, src.data(), src.size());
    t->register_buffer(1, dst.data(), dst.size());
    const int neighbour = node * 2 + (1 - me % 2);  // this node's other rank
    TransferOp local;
    local.kind = TransferOp::Kind::kPut;
    local.dst_rank = static_cast<uint32_t>(neighbour);
    local.src_buffer = 0;
    local.dst_buffer = 1;
    local.bytes = 8;
    local.signal_id = kNoSignal;
    try {
      t->post(std::span<const TransferOp>(&local, 1));
      ADD_FAILURE() << "a put to rank " << neighbour << " (same node) was not refused";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
      EXPECT_TRUE(contains(e.what(), "rank " + std::to_string(neighbour) + " is not a peer"))
          << e.what();
    }
    ProxyOptions options;
    Proxy proxy(*t, options);
    for (const int p : config.peers) {
      proxy.push(0, make_put_signal(p, 1, 0, kBytes * p, 1, kBytes * me, kBytes, 1, 100 + p));
    }
    auto healthy = [&] {
      t->check();
      proxy.check();
    };
    for (const int p : config.peers) {
      ASSERT_TRUE(pad.wait(p, 1, 100 + me, 20, healthy)) << "no signal from rank " << p;
      EXPECT_EQ(mk::test::first_mismatch(&dst[kBytes * p], kBytes, seed_of(p, me)), -1)
          << "rank " << me << " from rank " << p;
    }
    proxy.drain(20);
    b.barrier();
  });
  expect_all_ok(outcomes);
}

// A peer set that is not symmetric, or names the rank itself: an error on every rank, at setup.
TEST(TransportSocket, BadPeerSetsAreRefusedOnEveryRank) {
  const auto asymmetric = mk::test::run_group(3, [&](Bootstrap& b) {
    HostSignalPad pad(3, 8);
    TransportConfig config = config_for(pad);
    config.peers = b.rank() == 0 ? std::vector<int>{1} : std::vector<int>{0};  // 2 lists 0 alone
    auto t = make_transport(b, config, "socket");
  });
  for (const Outcome& o : asymmetric) {
    EXPECT_TRUE(o.threw);
    EXPECT_EQ(o.code, ErrorCode::kInvalidArgument);
    EXPECT_TRUE(
        contains(o.message, "rank 2 lists rank 0 as a peer but rank 0 does not list rank 2"))
        << o.message;
  }
  const auto itself = mk::test::run_group(2, [&](Bootstrap& b) {
    HostSignalPad pad(2, 8);
    TransportConfig config = config_for(pad);
    config.peers = {1};  // right for rank 0; rank 1 names itself
    auto t = make_transport(b, config, "socket");
  });
  for (const Outcome& o : itself) {
    EXPECT_TRUE(o.threw);
    EXPECT_EQ(o.code, ErrorCode::kInvalidArgument);
    EXPECT_TRUE(contains(o.message, "rank 1: peers lists rank 1 (itself)")) << o.message;
  }
}

TEST(TransportSocket, ManySmallPutsAcrossRings) {
  constexpr int kWorld = 3, kPuts = 2000;
  constexpr uint64_t kSize = 256;
  const auto outcomes = mk::test::run_group(kWorld, [&](Bootstrap& b) {
    const int me = b.rank();
    HostSignalPad pad(kWorld, 8);
    auto t = make_transport(b, config_for(pad), "socket");
    std::vector<char> src(kSize * kPuts), dst(kSize * kPuts * kWorld, 0);
    mk::test::fill_pattern(src.data(), src.size(), seed_of(me, 0));
    t->register_buffer(0, src.data(), dst.size());  // symmetric size; src is the prefix
    t->register_buffer(1, dst.data(), dst.size());
    ProxyOptions options;
    options.num_rings = 4;
    options.ring_capacity = 32;
    Proxy proxy(*t, options);
    for (int i = 0; i < kPuts; ++i) {
      for (int p = 0; p < kWorld; ++p) {
        if (p == me) continue;
        proxy.push(i % 4, make_put(p, i, 0, kSize * i, 1, kSize * (kPuts * me + i), kSize, 2));
      }
    }
    // A signal covers what the proxy counted before it: once every ring drained, that is every
    // put, whichever ring carried it.
    proxy.drain(20);
    for (int p = 0; p < kWorld; ++p) {
      if (p != me) proxy.push(p % 4, make_signal(p, kPuts, 2, 1));
    }
    for (int p = 0; p < kWorld; ++p) {
      if (p != me) ASSERT_TRUE(pad.wait(p, 2, 1, 20, [&] { t->check(); }));
    }
    for (int p = 0; p < kWorld; ++p) {
      if (p == me) continue;
      EXPECT_EQ(mk::test::first_mismatch(&dst[kSize * kPuts * p], kSize * kPuts, seed_of(p, 0)),
                -1);
    }
    b.barrier();
  });
  expect_all_ok(outcomes);
}

TEST(TransportSocket, OffsetsBeyondFourGiB) {
  constexpr uint64_t kSize = 6 * kGiB;
  const uint64_t src_off = 4 * kGiB + kGiB / 2 + 3, dst_off = 5 * kGiB + 17;
  const uint64_t bytes = kMiB + 5;
  mk::test::SparseBuffer probe(kSize);
  if (probe.data() == nullptr) GTEST_SKIP() << "cannot map 6 GiB of address space here";
  const auto outcomes = mk::test::run_group(2, [&](Bootstrap& b) {
    const int me = b.rank(), peer = 1 - me;
    mk::test::SparseBuffer buffer(kSize);
    ASSERT_NE(buffer.data(), nullptr);
    mk::test::fill_pattern(buffer.data() + src_off, bytes, seed_of(me, peer));
    HostSignalPad pad(2, 8);
    auto t = make_transport(b, config_for(pad), "socket");
    t->register_buffer(0, buffer.data(), kSize);
    Proxy proxy(*t);
    proxy.push(0, make_put_signal(peer, uint64_t{1} << 33, 0, src_off, 0, dst_off, bytes, 0, 5));
    ASSERT_TRUE(pad.wait(peer, 0, 5, 20, [&] { t->check(); }));
    EXPECT_EQ(mk::test::first_mismatch(buffer.data() + dst_off, bytes, seed_of(peer, me)), -1);
    proxy.drain(20);
    b.barrier();
  });
  expect_all_ok(outcomes);
}

TEST(TransportSocket, DeviceBuffersGoThroughTheCopyHooks) {
  std::atomic<int> to_device{0}, from_device{0};
  const uint64_t bytes = 5 * kMiB;
  const auto outcomes = mk::test::run_group(2, [&](Bootstrap& b) {
    const int me = b.rank(), peer = 1 - me;
    HostSignalPad pad(2, 8);
    TransportConfig c = config_for(pad);
    c.copy_to_device = [&](void* d, const void* s, std::size_t n) {
      ++to_device;
      std::memcpy(d, s, n);
    };
    c.copy_from_device = [&](void* d, const void* s, std::size_t n) {
      ++from_device;
      std::memcpy(d, s, n);
    };
    auto t = make_transport(b, c, "socket");
    std::vector<char> src(bytes), dst(bytes, 0);
    mk::test::fill_pattern(src.data(), bytes, seed_of(me, peer));
    t->register_buffer(0, src.data(), bytes, MemoryKind::kDevice);
    t->register_buffer(1, dst.data(), bytes, MemoryKind::kDevice);
    Proxy proxy(*t);
    proxy.push(0, make_put_signal(peer, 0, 0, 0, 1, 0, bytes, 0, 1));
    ASSERT_TRUE(pad.wait(peer, 0, 1, 20, [&] { t->check(); }));
    EXPECT_EQ(mk::test::first_mismatch(dst.data(), bytes, seed_of(peer, me)), -1);
    proxy.drain(20);
    b.barrier();
  });
  expect_all_ok(outcomes);
  EXPECT_EQ(to_device.load(), 4);  // 2 ranks x 2 chunks of <= 4 MiB
  EXPECT_EQ(from_device.load(), 4);
}

TEST(TransportSocket, DeviceBufferWithoutHooksIsRefused) {
  const auto outcomes = mk::test::run_group(2, [&](Bootstrap& b) {
    HostSignalPad pad(2, 8);
    auto t = make_transport(b, config_for(pad), "socket");
    std::vector<char> buffer(64);
    t->register_buffer(0, buffer.data(), buffer.size(), MemoryKind::kDevice);
  });
  for (const Outcome& o : outcomes) {
    EXPECT_EQ(o.code, ErrorCode::kInvalidArgument);
    EXPECT_TRUE(contains(o.message,
                         "buffer 0 is device memory but TransportConfig has no "
                         "copy_to_device"))
        << o.message;
  }
}

// A port nothing listens on: bind, read the port, close.
int closed_port() {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a));
  socklen_t len = sizeof(a);
  getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  close(fd);
  return ntohs(a.sin_port);
}

// Setup where rank 1 publishes `advertise`: every rank must fail with kBootstrap.
std::vector<Outcome> setup_with_bad_peer(const std::string& advertise, double timeout) {
  return mk::test::run_group(2, [&](Bootstrap& b) {
    HostSignalPad pad(2, 8);
    TransportConfig c = config_for(pad, 8, timeout);
    if (b.rank() == 1) c.socket_advertise = advertise;
    auto t = make_transport(b, c, "socket");
  });
}

TEST(TransportSocket, RefusedConnectionIsAClearErrorOnEveryRank) {
  const std::string address = "127.0.0.1:" + std::to_string(closed_port());
  const mk::test::Stopwatch clock;
  const auto outcomes = setup_with_bad_peer(address, 30);
  EXPECT_LT(clock.seconds(), 5.0);  // refused at once, not after the 30 s limit
  for (const Outcome& o : outcomes) {
    EXPECT_TRUE(o.threw);
    EXPECT_EQ(o.code, ErrorCode::kBootstrap);
    EXPECT_TRUE(contains(
        o.message, "rank 0 could not connect to rank 1 at " + address + ": Connection refused"))
        << o.message;
  }
}

// A listener whose accept queue is full: the kernel drops further SYNs, so connecting to it
// gets no answer at all - an unreachable peer without needing a network.
struct BlackHole {
  BlackHole() {
    listener = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    bind(listener, reinterpret_cast<sockaddr*>(&a), sizeof(a));
    listen(listener, 0);
    socklen_t len = sizeof(a);
    getsockname(listener, reinterpret_cast<sockaddr*>(&a), &len);
    port = ntohs(a.sin_port);
    for (int i = 0; i < 3; ++i) {  // fill the queue; nobody accepts
      const int fd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK, 0);
      connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a));
      fillers.push_back(fd);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  ~BlackHole() {
    for (int fd : fillers) close(fd);
    close(listener);
  }
  int listener = -1;
  int port = 0;
  std::vector<int> fillers;
};

TEST(TransportSocket, UnreachablePeerFailsWithinTheTimeLimit) {
  BlackHole hole;
  const std::string address = "127.0.0.1:" + std::to_string(hole.port);
  const mk::test::Stopwatch clock;
  const auto outcomes = setup_with_bad_peer(address, 1);
  EXPECT_GE(clock.seconds(), 0.9);  // it did wait for the limit
  EXPECT_LT(clock.seconds(), 5.0);  // and no longer
  for (const Outcome& o : outcomes) {
    EXPECT_TRUE(o.threw);
    EXPECT_EQ(o.code, ErrorCode::kBootstrap);
    EXPECT_TRUE(contains(o.message, "rank 0 could not connect to rank 1 at " + address +
                                        ": no answer before the time limit"))
        << o.message;
  }
}

TEST(TransportSocket, UnknownInterfaceIsNamed) {
  mk::test::ScopedEnv env("MKERNEL_SOCKET_IFNAME", "mk-no-such-if0");
  const auto outcomes = mk::test::run_group(2, [&](Bootstrap& b) {
    HostSignalPad pad(2, 8);
    auto t = make_transport(b, config_for(pad), "socket");
  });
  for (const Outcome& o : outcomes) {
    EXPECT_EQ(o.code, ErrorCode::kBootstrap);
    EXPECT_TRUE(contains(o.message, "MKERNEL_SOCKET_IFNAME='mk-no-such-if0': no interface"))
        << o.message;
    EXPECT_TRUE(contains(o.message, "interfaces: ")) << o.message;
  }
}

TEST(TransportSocket, PeerThatDisappearsIsReportedNotWaitedFor) {
  const auto outcomes = mk::test::run_group(2, [&](Bootstrap& b) {
    HostSignalPad pad(2, 8);
    auto t = make_transport(b, config_for(pad, 8, 30), "socket");
    std::vector<char> buffer(kMiB);
    t->register_buffer(0, buffer.data(), buffer.size());
    b.barrier();
    if (b.rank() == 1) {
      static_cast<detail::SocketTransport&>(*t).close_abruptly();  // as if the process died
      b.barrier();
      return;
    }
    const mk::test::Stopwatch clock;
    try {
      pad.wait(1, 0, 1, 30, [&] { t->check(); });  // rank 1 will never signal
      ADD_FAILURE() << "the wait returned";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kBootstrap);
      EXPECT_TRUE(contains(e.what(), "transport socket, rank 0: lost the connection to rank 1"))
          << e.what();
    }
    EXPECT_LT(clock.seconds(), 5.0);
    const TransferOp put{TransferOp::Kind::kPut, 0, 0, 1, kNoSignal, 0, 0, 64, 0, 0, 0};
    auto post = [&] { t->post(std::span<const TransferOp>(&put, 1)); };
    EXPECT_THROW(post(), Error);
    b.barrier();
  });
  expect_all_ok(outcomes);
}

// A rank in another process that is killed (SIGKILL) mid-run: the survivor's wait ends with an
// error naming it instead of hanging. The two processes bootstrap over a socket pair.
TEST(TransportSocket, KilledPeerProcessIsReported) {
  int sv[2];
  ASSERT_EQ(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv), 0);
  auto pair_allgather = [](int fd, int rank) {
    return [fd, rank](const void* send, void* recv, std::size_t bytes) {
      using mk::detail::Deadline;
      using mk::detail::IoStatus;
      char* out = static_cast<char*>(recv);
      std::memcpy(out + rank * bytes, send, bytes);
      if (mk::detail::send_all(fd, send, bytes, Deadline::after(20), "pair") != IoStatus::kDone ||
          mk::detail::recv_all(fd, out + (1 - rank) * bytes, bytes, Deadline::after(20), "pair") !=
              IoStatus::kDone) {
        throw Error(ErrorCode::kBootstrap, "pair allgather: the other process is gone");
      }
    };
  };
  auto setup = [&](int rank, std::unique_ptr<Bootstrap>& b, HostSignalPad& pad,
                   std::vector<char>& buffer) {
    b = make_callback_bootstrap(rank, 2, pair_allgather(sv[rank], rank));
    auto t = make_transport(*b, config_for(pad, 8, 20), "socket");
    t->register_buffer(0, buffer.data(), buffer.size());
    b->barrier();
    return t;
  };
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {  // rank 1: set up, then wait to be killed
    close(sv[0]);
    try {
      std::unique_ptr<Bootstrap> b;
      HostSignalPad pad(2, 8);
      std::vector<char> buffer(kMiB);
      auto t = setup(1, b, pad, buffer);
      std::this_thread::sleep_for(std::chrono::seconds(30));
    } catch (...) {
    }
    _exit(0);
  }
  close(sv[1]);
  std::unique_ptr<Bootstrap> b;
  HostSignalPad pad(2, 8);
  std::vector<char> buffer(kMiB);
  std::unique_ptr<Transport> t;
  try {
    t = setup(0, b, pad, buffer);
  } catch (const Error& e) {
    ADD_FAILURE() << e.what();
  }
  kill(child, SIGKILL);
  waitpid(child, nullptr, 0);
  close(sv[0]);
  ASSERT_NE(t, nullptr);
  const mk::test::Stopwatch clock;
  try {
    pad.wait(1, 0, 1, 20, [&] { t->check(); });
    ADD_FAILURE() << "the wait for the killed rank returned";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kBootstrap);
    EXPECT_TRUE(contains(e.what(), "rank 0: lost the connection to rank 1")) << e.what();
  }
  EXPECT_LT(clock.seconds(), 5.0);
}

TEST(TransportSocket, GoodbyeIsNotAnError) {
  const auto outcomes = mk::test::run_group(2, [&](Bootstrap& b) {
    HostSignalPad pad(2, 8);
    auto t = make_transport(b, config_for(pad, 8, 1), "socket");
    std::vector<char> buffer(kMiB);
    t->register_buffer(0, buffer.data(), buffer.size());
    b.barrier();
    if (b.rank() == 1) {
      t.reset();  // leaves properly
      b.barrier();
      return;
    }
    b.barrier();
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    EXPECT_NO_THROW(t->check());
    const TransferOp put{TransferOp::Kind::kPut, 0, 0, 1, kNoSignal, 0, 0, 64, 0, 0, 0};
    try {
      t->post(std::span<const TransferOp>(&put, 1));
      ADD_FAILURE() << "post to a rank that left succeeded";
    } catch (const Error& e) {
      EXPECT_TRUE(contains(e.what(), "rank 1 (127.0.0.1:")) << e.what();
      EXPECT_TRUE(contains(e.what(), "has shut down its transport")) << e.what();
    }
  });
  expect_all_ok(outcomes);
}

TEST(TransportSocket, MalformedIncomingMessageIsReported) {
  // Rank 1 knows 8 signals, rank 0 16: rank 0's signal 12 is out of range at rank 1.
  const auto outcomes = mk::test::run_group(2, [&](Bootstrap& b) {
    HostSignalPad pad(2, 16);
    auto t = make_transport(b, config_for(pad, b.rank() == 0 ? 16 : 8), "socket");
    if (b.rank() == 0) {
      TransferOp sig;
      sig.kind = TransferOp::Kind::kSignal;
      sig.dst_rank = 1;
      sig.signal_id = 12;
      sig.value = 1;
      t->post(std::span<const TransferOp>(&sig, 1));
    } else {
      try {
        pad.wait(0, 0, 1, 10, [&] { t->check(); });
        ADD_FAILURE() << "no error";
      } catch (const Error& e) {
        EXPECT_EQ(e.code(), ErrorCode::kInternal);
        EXPECT_TRUE(contains(e.what(), "malformed message from rank 0")) << e.what();
        EXPECT_TRUE(contains(e.what(), "signal 12 out of range (8 signals)")) << e.what();
      }
    }
    b.barrier();
  });
  expect_all_ok(outcomes);
}

// release_buffer: ops naming the id are refused, and the id can be registered again (another size).
TEST(TransportSocket, ReleasedBufferIsRefusedThenReusable) {
  expect_all_ok(mk::test::run_group(2, [&](Bootstrap& b) {
    const int peer = 1 - b.rank();
    HostSignalPad pad(2, 8);
    auto t = make_transport(b, config_for(pad), "socket");
    std::vector<char> first(4096), second(8192, 0);
    t->register_buffer(3, first.data(), first.size());
    t->release_buffer(3);
    t->release_buffer(3);  // an unregistered id: ignored
    EXPECT_EQ(t->limits().buffer_bytes[3], 0u);
    TransferOp put;
    put.dst_rank = static_cast<uint32_t>(peer);
    put.src_buffer = put.dst_buffer = 3;
    put.bytes = 64;
    try {
      t->post(std::span<const TransferOp>(&put, 1));
      ADD_FAILURE() << "a put naming a released buffer was sent";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument) << e.what();
    }
    t->register_buffer(3, second.data(), second.size());
    EXPECT_EQ(t->limits().buffer_bytes[3], second.size());
    b.barrier();
  }));
}

TEST(TransportSocket, RegistrationChecksAgreeAcrossRanks) {
  const auto outcomes = mk::test::run_group(2, [&](Bootstrap& b) {
    HostSignalPad pad(2, 8);
    auto t = make_transport(b, config_for(pad), "socket");
    std::vector<char> buffer(8192);
    t->register_buffer(0, buffer.data(), b.rank() == 0 ? 4096 : 8192);
  });
  for (const Outcome& o : outcomes) {
    EXPECT_EQ(o.code, ErrorCode::kInvalidArgument);
    EXPECT_TRUE(contains(o.message, "buffer 0 has 4096 bytes on rank 0 but 8192 on rank 1"))
        << o.message;
  }
  const auto bad_id = mk::test::run_group(2, [&](Bootstrap& b) {
    HostSignalPad pad(2, 8);
    auto t = make_transport(b, config_for(pad), "socket");
    std::vector<char> buffer(64);
    t->register_buffer(b.rank() == 1 ? 16 : 0, buffer.data(), buffer.size());
  });
  for (const Outcome& o : bad_id) {
    EXPECT_TRUE(contains(o.message, "rank 1: buffer id 16 is out of range")) << o.message;
  }
  // Valid ids that differ between ranks: puts would land in the wrong buffer - refused everywhere.
  const auto other_id = mk::test::run_group(2, [&](Bootstrap& b) {
    HostSignalPad pad(2, 8);
    auto t = make_transport(b, config_for(pad), "socket");
    std::vector<char> buffer(64);
    t->register_buffer(b.rank() == 1 ? 3 : 2, buffer.data(), buffer.size());
  });
  for (const Outcome& o : other_id) {
    EXPECT_EQ(o.code, ErrorCode::kInvalidArgument) << o.message;
    EXPECT_TRUE(contains(o.message, "rank 0 registers this buffer as id 2 but rank 1 as id 3"))
        << o.message;
  }
}

TEST(TransportSocket, PostRefusesOpsOutsideTheLimits) {
  const auto outcomes = mk::test::run_group(2, [&](Bootstrap& b) {
    HostSignalPad pad(2, 8);
    auto t = make_transport(b, config_for(pad), "socket");
    std::vector<char> buffer(4096);
    t->register_buffer(0, buffer.data(), buffer.size());
    const TransferOp put{TransferOp::Kind::kPut,
                         0,
                         0,
                         static_cast<uint32_t>(1 - b.rank()),
                         kNoSignal,
                         4000,
                         0,
                         200,
                         0,
                         0,
                         0};
    try {
      t->post(std::span<const TransferOp>(&put, 1));
      ADD_FAILURE();
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
      EXPECT_TRUE(contains(e.what(), "source range [4000, +200) is beyond the end")) << e.what();
    }
    b.barrier();
  });
  expect_all_ok(outcomes);
}

// A send that times out half-way through a message leaves the stream out of step: the sender
// must not put anything more on it (a later post would be read as the rest of the cut message)
// and the receiver must see the stream end instead of waiting for the missing bytes.
TEST(TransportSocket, StreamCutMidMessageIsClosedNotReused) {
  constexpr uint64_t kBytes = 256 * kMiB;  // far more than the sockets buffer: the send stalls
  std::atomic<bool> release{false};
  const auto outcomes = mk::test::run_group(2, [&](Bootstrap& b) {
    const int me = b.rank();
    HostSignalPad pad(2, 8);
    TransportConfig c = config_for(pad, 8, me == 0 ? 1 : 10);
    c.copy_to_device = [&](void* d, const void* s, std::size_t n) {
      // Rank 1's receiver stalls in its first copy until rank 0 is done.
      const mk::test::Stopwatch clock;
      while (!release.load() && clock.seconds() < 30) {
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
      }
      std::memcpy(d, s, n);
    };
    c.copy_from_device = [](void* d, const void* s, std::size_t n) { std::memcpy(d, s, n); };
    auto t = make_transport(b, c, "socket");
    mk::test::SparseBuffer src(kBytes), dst(kBytes);
    ASSERT_NE(src.data(), nullptr);
    ASSERT_NE(dst.data(), nullptr);
    t->register_buffer(0, src.data(), kBytes);
    t->register_buffer(1, dst.data(), kBytes, MemoryKind::kDevice);
    if (me == 0) {
      TransferOp put;
      put.dst_rank = 1;
      put.src_buffer = 0;
      put.dst_buffer = 1;
      put.bytes = kBytes;
      put.signal_id = 0;
      try {
        t->post(std::span<const TransferOp>(&put, 1));
        ADD_FAILURE() << "a put into a stalled receiver completed";
      } catch (const Error& e) {
        EXPECT_EQ(e.code(), ErrorCode::kTimeout) << e.what();
      }
      TransferOp sig;
      sig.kind = TransferOp::Kind::kSignal;
      sig.dst_rank = 1;
      sig.signal_id = 0;
      sig.target = 0;
      sig.value = 1;
      const mk::test::Stopwatch clock;
      EXPECT_THROW(t->post(std::span<const TransferOp>(&sig, 1)), Error);
      EXPECT_LT(clock.seconds(), 0.5) << "the second post waited on the cut stream";
      release = true;
    } else {
      try {
        pad.wait(0, 0, 1, 10, [&] { t->check(); });
        ADD_FAILURE() << "rank 1 saw neither the signal nor an error";
      } catch (const Error& e) {
        EXPECT_EQ(e.code(), ErrorCode::kBootstrap) << e.what();
        EXPECT_TRUE(contains(e.what(), "lost the connection to rank 0")) << e.what();
      }
      EXPECT_EQ(pad.load(0, 0), 0u);
    }
    b.barrier();
  });
  release = true;
  expect_all_ok(outcomes);
}

// A post whose copy hook throws something other than mk::Error: the proxy reports it instead of
// letting it escape its thread (std::terminate).
TEST(TransportSocket, CopyHookThrowingStdExceptionIsReportedByTheProxy) {
  const auto outcomes = mk::test::run_group(2, [&](Bootstrap& b) {
    const int me = b.rank(), peer = 1 - me;
    HostSignalPad pad(2, 8);
    TransportConfig c = config_for(pad);
    c.copy_to_device = [](void* d, const void* s, std::size_t n) { std::memcpy(d, s, n); };
    c.copy_from_device = [](void*, const void*, std::size_t) {
      throw std::runtime_error("copy hook: device lost");
    };
    auto t = make_transport(b, c, "socket");
    std::vector<char> src(4096), dst(4096);
    t->register_buffer(0, src.data(), src.size(), MemoryKind::kDevice);
    t->register_buffer(1, dst.data(), dst.size());
    b.barrier();
    if (me == 0) {
      Proxy proxy(*t);
      proxy.push(0, make_put_signal(peer, 0, 0, 0, 1, 0, 4096, 0, 1));
      try {
        proxy.drain(10);
        ADD_FAILURE() << "drain succeeded";
      } catch (const Error& e) {
        EXPECT_EQ(e.code(), ErrorCode::kInternal) << e.what();
        EXPECT_TRUE(contains(e.what(), "copy hook: device lost")) << e.what();
      }
      EXPECT_THROW(proxy.check(), Error);
    }
    b.barrier();
  });
  expect_all_ok(outcomes);
}

// Connections that never send a hello (port scanners, health checks) must not stretch the wait
// for the real peers past the time limit. Rank 1 is the transport under test; the test plays
// rank 0 in the allgathers, and never connects.
TEST(TransportSocket, SilentStrayConnectionsDoNotExtendTheAcceptLimit) {
  std::atomic<int> port{0};
  std::atomic<bool> done{false};
  auto allgather = [&](const void* send, void* recv, std::size_t bytes) {
    char* out = static_cast<char*>(recv);
    std::memcpy(out + bytes, send, bytes);  // rank 1: itself
    if (bytes == 2) {                       // the peer rows: rank 0 lists rank 1
      out[0] = 0;
      out[1] = 1;
    } else if (bytes == sizeof(detail::SocketAddress)) {  // addresses: start the strays
      detail::SocketAddress a;
      std::memcpy(&a, send, sizeof(a));
      std::memcpy(out, send, bytes);
      port = a.port;
    } else {
      std::memset(out, 0, bytes);  // statuses: rank 0 is fine
    }
  };
  std::thread strays([&] {
    std::vector<int> fds;
    const mk::test::Stopwatch clock;
    while (!done.load() && clock.seconds() < 8) {
      if (port.load() != 0) {
        const int fd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK, 0);
        sockaddr_in a{};
        a.sin_family = AF_INET;
        a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
        a.sin_port = htons(static_cast<uint16_t>(port.load()));
        connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a));
        fds.push_back(fd);
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
    for (int fd : fds) close(fd);
  });
  auto b = make_callback_bootstrap(1, 2, AllgatherFn(allgather));
  HostSignalPad pad(2, 8);
  const mk::test::Stopwatch clock;
  try {
    auto t = make_transport(*b, config_for(pad, 8, 1), "socket");
    ADD_FAILURE() << "setup succeeded without rank 0";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kBootstrap) << e.what();
    EXPECT_TRUE(contains(e.what(), "waiting for connections from rank 0")) << e.what();
  }
  const double seconds = clock.seconds();
  done = true;
  strays.join();
  EXPECT_GE(seconds, 0.9);
  EXPECT_LT(seconds, 3.0) << "stray connections kept the accept loop going";
}

// Rank 1 runs out of descriptors while a peer's connection waits to be accepted: a clear error
// at once on every rank, not a spin until the time limit (nor, as before, forever: the queued
// connection kept poll() ready, so the limit was never looked at). In a child process, whose
// descriptor table the test fills up; the test plays rank 0 in the allgathers.
TEST(TransportSocket, AcceptOutOfDescriptorsIsReportedAtOnce) {
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    auto allgather = [](const void* send, void* recv, std::size_t bytes) {
      char* out = static_cast<char*>(recv);
      std::memcpy(out + bytes, send, bytes);
      if (bytes == 2) {
        out[0] = 0;
        out[1] = 1;
      } else if (bytes == sizeof(detail::SocketAddress)) {
        detail::SocketAddress a;
        std::memcpy(&a, send, sizeof(a));
        std::memcpy(out, send, bytes);
        // A connection in rank 1's accept queue, then no descriptor left to accept it with.
        const int fd = socket(AF_INET, SOCK_STREAM, 0);
        sockaddr_in in{};
        in.sin_family = AF_INET;
        in.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
        in.sin_port = htons(a.port);
        if (connect(fd, reinterpret_cast<sockaddr*>(&in), sizeof(in)) != 0) _exit(10);
        while (dup(fd) >= 0) {
        }
        if (errno != EMFILE) _exit(11);
      } else {
        std::memset(out, 0, bytes);
      }
    };
    auto b = make_callback_bootstrap(1, 2, AllgatherFn(allgather));
    HostSignalPad pad(2, 8);
    const mk::test::Stopwatch clock;
    try {
      auto t = make_transport(*b, config_for(pad, 8, 5), "socket");
      _exit(12);
    } catch (const Error& e) {
      const bool named = e.code() == ErrorCode::kBootstrap &&
                         contains(e.what(), "rank 1: accept() on 127.0.0.1:") &&
                         contains(e.what(), "Too many open files");
      _exit(!named ? 13 : clock.seconds() < 2 ? 0 : 14);
    }
  }
  int status = 0;
  const mk::test::Stopwatch clock;
  while (waitpid(child, &status, WNOHANG) == 0 && clock.seconds() < 15) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  if (clock.seconds() >= 15) {
    kill(child, SIGKILL);
    waitpid(child, &status, 0);
    FAIL() << "setup did not end within 15 s (limit 5 s)";
  }
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0)
      << "10/11: test setup failed, 12: no error, 13: error not naming accept / EMFILE, "
         "14: error only after the time limit";
}

TEST(TransportSocket, AddressesParseAndPrint) {
  using detail::parse_socket_address;
  EXPECT_EQ(detail::to_string(parse_socket_address("10.1.2.3:4567")), "10.1.2.3:4567");
  EXPECT_EQ(detail::to_string(parse_socket_address("[::1]:80")), "[::1]:80");
  EXPECT_TRUE(detail::is_loopback(parse_socket_address("127.0.0.2:1")));
  EXPECT_FALSE(detail::is_loopback(parse_socket_address("10.0.0.1:1")));
  for (const char* bad : {"10.1.2.3", "host:80", "1.2.3.4:99999", "[::1:80", ""}) {
    EXPECT_THROW(parse_socket_address(bad), Error) << bad;
  }
}

}  // namespace
}  // namespace mk::transport
