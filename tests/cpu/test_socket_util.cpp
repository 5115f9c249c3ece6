// The internal socket and text helpers: complete transfers, time limits, closed peers.
#include <gtest/gtest.h>
#include <sys/socket.h>

#include <chrono>
#include <string>
#include <thread>
#include <vector>

#include "mkernel/error.h"
#include "runtime/socket_util.h"
#include "runtime/text_util.h"

namespace mk::detail {
namespace {

struct SocketPair {
  SocketPair() {
    int fds[2];
    EXPECT_EQ(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, fds), 0);
    a.reset(fds[0]);
    b.reset(fds[1]);
  }
  UniqueFd a, b;
};

TEST(SocketUtil, LargeTransferCompletesAcrossShortWrites) {
  SocketPair s;
  std::vector<char> sent(8 << 20);  // far more than a socket buffer holds
  for (std::size_t i = 0; i < sent.size(); ++i) sent[i] = static_cast<char>(i * 13 + (i >> 12));
  std::thread writer([&] {
    EXPECT_EQ(send_all(s.a.get(), sent.data(), sent.size(), Deadline::after(20), "w"),
              IoStatus::kDone);
  });
  std::vector<char> got(sent.size());
  EXPECT_EQ(recv_all(s.b.get(), got.data(), got.size(), Deadline::after(20), "r"), IoStatus::kDone);
  writer.join();
  EXPECT_EQ(got, sent);
}

TEST(SocketUtil, ReceiveTimesOut) {
  SocketPair s;
  char byte;
  const auto start = std::chrono::steady_clock::now();
  EXPECT_EQ(recv_all(s.b.get(), &byte, 1, Deadline::after(0.1), "r"), IoStatus::kTimedOut);
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_GE(seconds, 0.1);
  EXPECT_LT(seconds, 5.0);
}

TEST(SocketUtil, ClosedPeerIsReportedNotRaised) {
  SocketPair s;
  const char text[] = "half";
  ASSERT_EQ(send_all(s.a.get(), text, 4, Deadline::after(1), "w"), IoStatus::kDone);
  s.a.reset();
  char got[8];
  // The 4 bytes sent before the close arrive; asking for 8 finds the end of the stream.
  EXPECT_EQ(recv_all(s.b.get(), got, 8, Deadline::after(1), "r"), IoStatus::kClosed);
  // Sending to a closed peer is EPIPE, without SIGPIPE killing the test.
  EXPECT_EQ(send_all(s.b.get(), text, 4, Deadline::after(1), "w"), IoStatus::kClosed);
}

TEST(SocketUtil, SystemErrorsNameTheOperation) {
  char byte = 0;
  try {
    send_all(-1, &byte, 1, Deadline::after(1), "rank 2: mkrun launcher socket");
    ADD_FAILURE();
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kSystem);
    EXPECT_STREQ(e.what(), "system error: rank 2: mkrun launcher socket: Bad file descriptor");
  }
}

TEST(SocketUtil, Deadlines) {
  EXPECT_EQ(Deadline::never().poll_timeout_ms(), -1);
  EXPECT_FALSE(Deadline::never().expired());
  EXPECT_EQ(Deadline::after(1e12).poll_timeout_ms(), -1);  // too far to tell from never
  EXPECT_TRUE(Deadline::after(0).expired());
  EXPECT_EQ(Deadline::after(-5).poll_timeout_ms(), 0);
  const int ms = Deadline::after(2.0001).poll_timeout_ms();
  EXPECT_GE(ms, 2000);
  EXPECT_LE(ms, 2001);
}

TEST(TextUtil, FormatRanksFoldsRuns) {
  EXPECT_EQ(format_ranks({}), "[]");
  EXPECT_EQ(format_ranks({3}), "[3]");
  EXPECT_EQ(format_ranks({1, 2}), "[1, 2]");
  EXPECT_EQ(format_ranks({0, 1, 2, 3, 5, 7, 8, 9}), "[0-3, 5, 7-9]");
}

TEST(TextUtil, StrictParsing) {
  long long n = 0;
  EXPECT_TRUE(parse_int("42", 1, 100, &n));
  EXPECT_EQ(n, 42);
  for (const char* bad : {"", "0", "101", "4x", " 4", "1e2"})
    EXPECT_FALSE(parse_int(bad, 1, 100, &n)) << bad;
  double s = 0;
  EXPECT_TRUE(parse_seconds("0.25", &s));
  EXPECT_EQ(s, 0.25);
  for (const char* bad : {"", "-1", "inf", "nan", "2s"})
    EXPECT_FALSE(parse_seconds(bad, &s)) << bad;
  EXPECT_EQ(format_seconds(300), "300");
  EXPECT_EQ(format_seconds(0.2), "0.2");
}

}  // namespace
}  // namespace mk::detail
