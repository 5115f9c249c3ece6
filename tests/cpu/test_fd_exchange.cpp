// FdExchange between threads of one process and between forked processes, with descriptor-leak
// checks. (Between processes started by mkrun: MkrunTest.FdExchangeAcrossRanks.)
#include <fcntl.h>
#include <gtest/gtest.h>
#include <poll.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstddef>
#include <cstdio>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "cpu_test_util.h"
#include "mkernel/bootstrap.h"
#include "mkernel/error.h"
#include "runtime/fd_exchange.h"
#include "runtime/socket_util.h"

namespace mk {
namespace {

using detail::FdExchange;
using detail::FdMessage;
using detail::UniqueFd;

bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

UniqueFd make_memfd(const std::string& content) {
  UniqueFd fd(memfd_create("mkernel-test", MFD_CLOEXEC));
  if (!fd ||
      pwrite(fd.get(), content.data(), content.size(), 0) != static_cast<ssize_t>(content.size())) {
    throw std::runtime_error("memfd_create/pwrite failed");
  }
  return fd;
}

std::string read_at(int fd, off_t offset, std::size_t bytes) {
  std::string text(bytes, '\0');
  const ssize_t n = pread(fd, text.data(), bytes, offset);
  text.resize(n > 0 ? static_cast<std::size_t>(n) : 0);
  return text;
}

void write_at(int fd, off_t offset, const std::string& text) {
  ASSERT_EQ(pwrite(fd, text.data(), text.size(), offset), static_cast<ssize_t>(text.size()));
}

std::vector<int> all_but(int rank, int size) {
  std::vector<int> others;
  for (int r = 0; r < size; ++r) {
    if (r != rank) others.push_back(r);
  }
  return others;
}

void close_all(const std::vector<int>& fds) {
  for (int fd : fds) close(fd);
}

TEST(FdExchange, ThreadsShareMemfdsAllToAll) {
  const int before = test::count_open_fds();
  const auto outcomes = test::run_group(4, [](Bootstrap& b) {
    FdExchange exchange(b, 10);
    const int me = b.rank();
    UniqueFd mine = make_memfd("memfd of rank " + std::to_string(me));
    const std::vector<int> others = all_but(me, b.size());
    const std::vector<int> got = exchange.exchange(mine.get(), others, others, /*tag=*/1);
    ASSERT_EQ(got.size(), others.size());
    for (std::size_t i = 0; i < got.size(); ++i) {
      const std::string expected = "memfd of rank " + std::to_string(others[i]);
      EXPECT_EQ(read_at(got[i], 0, expected.size()), expected);
      write_at(got[i], 64 + 8 * me, "from " + std::to_string(me));  // into the peer's memory
    }
    close_all(got);
    b.barrier();
    for (int peer : others) {
      EXPECT_EQ(read_at(mine.get(), 64 + 8 * peer, 6), "from " + std::to_string(peer));
    }
  });
  for (const auto& o : outcomes) EXPECT_FALSE(o.threw) << o.message;
  EXPECT_EQ(test::count_open_fds(), before) << "descriptors leaked";
}

TEST(FdExchange, ManyRoundsAllToAllOfEightRanks) {
  // 7 messages per rank and round, and fast ranks run ahead: receive queues fill up
  // (net.unix.max_dgram_qlen may be 10), which the non-blocking sends must ride out.
  const int before = test::count_open_fds();
  const auto outcomes = test::run_group(8, [](Bootstrap& b) {
    FdExchange exchange(b, 20);
    const std::vector<int> others = all_but(b.rank(), b.size());
    for (uint64_t round = 0; round < 6; ++round) {
      const std::string text = std::to_string(b.rank()) + "/" + std::to_string(round);
      UniqueFd mine = make_memfd(text);
      const std::vector<int> got = exchange.exchange(mine.get(), others, others, 100 + round);
      for (std::size_t i = 0; i < got.size(); ++i) {
        EXPECT_EQ(read_at(got[i], 0, 16), std::to_string(others[i]) + "/" + std::to_string(round));
      }
      close_all(got);
    }
    b.barrier();  // keep every socket open until all ranks are done
  });
  for (const auto& o : outcomes) EXPECT_FALSE(o.threw) << o.message;
  EXPECT_EQ(test::count_open_fds(), before) << "descriptors leaked";
}

TEST(FdExchange, MessagesForLaterCallsAreKept) {
  const auto outcomes = test::run_group(2, [](Bootstrap& b) {
    FdExchange exchange(b, 10);
    if (b.rank() == 0) {
      for (const char* text : {"tag 1", "tag 2", "tag 5 first", "tag 5 second"}) {
        UniqueFd fd = make_memfd(text);
        const uint64_t tag = text[4] - '0';
        EXPECT_TRUE(exchange.exchange(fd.get(), {1}, {}, tag).empty());
      }
    } else {
      // Ask in another order than rank 0 sends; equal tags come out in the order sent.
      for (auto [tag, text] : std::vector<std::pair<uint64_t, std::string>>{
               {2, "tag 2"}, {5, "tag 5 first"}, {1, "tag 1"}, {5, "tag 5 second"}}) {
        const std::vector<int> got = exchange.exchange(-1, {}, {0}, tag);
        ASSERT_EQ(got.size(), 1u);
        EXPECT_EQ(read_at(got[0], 0, 32), text);
        close(got[0]);
      }
    }
    b.barrier();
  });
  for (const auto& o : outcomes) EXPECT_FALSE(o.threw) << o.message;
}

TEST(FdExchange, TimeoutNamesPeerAndTagAndClosesWhatArrived) {
  const int before = test::count_open_fds();
  const auto start = std::chrono::steady_clock::now();
  const auto outcomes = test::run_group(3, [](Bootstrap& b) {
    FdExchange exchange(b, 0.2);
    if (b.rank() == 1) {
      // Rank 2 delivers, rank 0 never sends: the call fails and closes rank 2's descriptor.
      try {
        exchange.exchange(-1, {}, {0, 2}, 9);
        ADD_FAILURE() << "exchange without a sender returned";
      } catch (const Error& e) {
        EXPECT_EQ(e.code(), ErrorCode::kTimeout);
        EXPECT_TRUE(contains(e.what(), "rank 1: no memory handle from rank 0 after 0.2 s (tag 9)"))
            << e.what();
      }
    } else if (b.rank() == 2) {
      UniqueFd fd = make_memfd("x");
      exchange.exchange(fd.get(), {1}, {}, 9);
    }
    b.barrier();
  });
  for (const auto& o : outcomes) EXPECT_FALSE(o.threw) << o.message;
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(), 5.0);
  EXPECT_EQ(test::count_open_fds(), before) << "descriptors leaked";
}

// Sends a datagram with `fds` attached to `address` ("@name") from an unbound socket.
void send_raw(const std::string& address, const void* body, std::size_t bytes,
              const std::vector<int>& fds) {
  UniqueFd s(socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0));
  ASSERT_TRUE(s);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path + 1, address.data() + 1, address.size() - 1);
  iovec iov{const_cast<void*>(body), bytes};
  std::vector<char> control(CMSG_SPACE(sizeof(int) * fds.size()));
  msghdr msg{};
  msg.msg_name = &addr;
  msg.msg_namelen = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + address.size());
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  if (!fds.empty()) {
    msg.msg_control = control.data();
    msg.msg_controllen = control.size();
    cmsghdr* c = CMSG_FIRSTHDR(&msg);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int) * fds.size());
    std::memcpy(CMSG_DATA(c), fds.data(), sizeof(int) * fds.size());
  }
  ASSERT_EQ(sendmsg(s.get(), &msg, 0), static_cast<ssize_t>(bytes)) << std::strerror(errno);
}

// True once every copy of the pipe's write end is closed (read sees EOF within a second).
bool pipe_closed(int read_end) {
  pollfd p{read_end, POLLIN, 0};
  char byte;
  return poll(&p, 1, 1000) == 1 && read(read_end, &byte, 1) == 0;
}

TEST(FdExchange, MalformedMessagesAreRejectedAndUnclaimedOnesClosed) {
  const int before = test::count_open_fds();
  InProcessGroup group(1);
  auto b = group.bootstrap(0);
  int p[2];
  ASSERT_EQ(pipe2(p, O_CLOEXEC), 0);
  UniqueFd read_end(p[0]), write_end(p[1]);
  {
    FdExchange exchange(*b, 0.2);
    const std::string to = exchange.address(0);
    ASSERT_EQ(to.rfind("@mkernel-", 0), 0u) << to;

    FdMessage bad_magic;
    bad_magic.magic = 1;
    FdMessage bad_source;
    bad_source.source = 7;
    FdMessage good;
    send_raw(to, &bad_magic, sizeof(bad_magic), {write_end.get()});
    send_raw(to, &bad_source, sizeof(bad_source), {write_end.get()});
    send_raw(to, &good, sizeof(good), {write_end.get(), write_end.get()});  // two descriptors
    send_raw(to, &good, sizeof(good), {});                                  // none
    send_raw(to, &good, 4, {write_end.get()});                              // short body
    FdMessage unclaimed;
    unclaimed.tag = 1234;  // well formed, but nobody asks for it
    send_raw(to, &unclaimed, sizeof(unclaimed), {write_end.get()});
    write_end.reset();

    // A valid exchange (with itself) still works and sweeps the malformed ones out.
    UniqueFd memfd = make_memfd("self");
    const std::vector<int> got = exchange.exchange(memfd.get(), {0}, {0}, 3);
    ASSERT_EQ(got.size(), 1u);
    EXPECT_EQ(read_at(got[0], 0, 4), "self");
    close(got[0]);
    try {
      exchange.exchange(-1, {}, {0}, 4);
      ADD_FAILURE();
    } catch (const Error& e) {
      EXPECT_TRUE(contains(e.what(), "5 malformed messages rejected")) << e.what();
    }
  }  // the destructor closes the unclaimed descriptor
  EXPECT_TRUE(pipe_closed(read_end.get())) << "a received descriptor was not closed";
  read_end.reset();
  EXPECT_EQ(test::count_open_fds(), before) << "descriptors leaked";
}

TEST(FdExchange, RejectsBadArguments) {
  InProcessGroup group(1);
  auto b = group.bootstrap(0);
  for (double bad : {0.0, -1.0}) {
    try {
      FdExchange exchange(*b, bad);
      ADD_FAILURE() << "timeout " << bad << " accepted";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
      EXPECT_TRUE(contains(e.what(), "expected a finite number > 0")) << e.what();
    }
  }
  FdExchange exchange(*b, 1);
  auto expect_invalid = [&](int fd, std::vector<int> to, std::vector<int> from, const char* part) {
    try {
      exchange.exchange(fd, to, from, 1);
      ADD_FAILURE() << "accepted; expected '" << part << "'";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
      EXPECT_TRUE(contains(e.what(), part)) << e.what();
    }
  };
  expect_invalid(0, {1}, {}, "`to` holds rank 1; expected 0 <= rank < 1");
  expect_invalid(0, {}, {-1}, "`from` holds rank -1");
  expect_invalid(0, {0, 0}, {}, "holds rank 0 twice");
  expect_invalid(-1, {0}, {}, "fd -1 is not a descriptor");
}

// ---- between processes ------------------------------------------------------------------------

// A 2-rank Bootstrap over a connected socket (one process on each end).
std::unique_ptr<Bootstrap> pair_bootstrap(int rank, int fd) {
  return make_callback_bootstrap(
      rank, 2, [rank, fd](const void* send, void* recv, std::size_t bytes) {
        const auto deadline = detail::Deadline::after(10);
        char* out = static_cast<char*>(recv);
        std::memcpy(out + rank * bytes, send, bytes);
        if (detail::send_all(fd, send, bytes, deadline, "pair") != detail::IoStatus::kDone ||
            detail::recv_all(fd, out + (1 - rank) * bytes, bytes, deadline, "pair") !=
                detail::IoStatus::kDone) {
          throw std::runtime_error("the other process is gone");
        }
      });
}

// Rank 1, in the forked child: sends the write end of a pipe, receives rank 0's memfd, writes
// into it, and reads what rank 0 wrote through the pipe. Returns the exit code (0 = all good).
int forked_rank(int socket) {
  try {
    const int before = test::count_open_fds();
    {
      auto b = pair_bootstrap(1, socket);
      FdExchange exchange(*b, 10);
      int p[2];
      if (pipe2(p, O_CLOEXEC) != 0) return 2;
      UniqueFd read_end(p[0]), write_end(p[1]);
      const std::vector<int> got = exchange.exchange(write_end.get(), {0}, {0}, 1);
      write_end.reset();
      UniqueFd memfd(got.at(0));
      if (read_at(memfd.get(), 0, 64) != "memfd of rank 0") return 3;
      const std::string reply = "written by rank 1";
      if (pwrite(memfd.get(), reply.data(), reply.size(), 100) !=
          static_cast<ssize_t>(reply.size()))
        return 4;
      b->barrier();
      std::string through_pipe;
      char chunk[64];
      for (ssize_t n; (n = read(read_end.get(), chunk, sizeof(chunk))) > 0;)
        through_pipe.append(chunk, n);
      if (through_pipe != "hello through the pipe") return 5;
    }
    return test::count_open_fds() == before ? 0 : 6;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "forked rank 1: %s\n", e.what());
    return 1;
  }
}

TEST(FdExchange, ForkedProcessesShareMemfdAndPipe) {
  const int before = test::count_open_fds();
  int pair[2];
  ASSERT_EQ(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, pair), 0);
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    close(pair[0]);
    _exit(forked_rank(pair[1]));
  }
  close(pair[1]);
  UniqueFd socket(pair[0]);
  {
    auto b = pair_bootstrap(0, socket.get());
    FdExchange exchange(*b, 10);
    UniqueFd memfd = make_memfd("memfd of rank 0");
    const std::vector<int> got = exchange.exchange(memfd.get(), {1}, {1}, 1);
    ASSERT_EQ(got.size(), 1u);
    UniqueFd pipe_write(got[0]);
    b->barrier();  // rank 1 has written into the memfd
    EXPECT_EQ(read_at(memfd.get(), 100, 17), "written by rank 1");
    const std::string text = "hello through the pipe";
    EXPECT_EQ(write(pipe_write.get(), text.data(), text.size()), static_cast<ssize_t>(text.size()));
  }
  socket.reset();
  int status = 0;
  pid_t done = 0;
  for (int i = 0; i < 200 && (done = waitpid(child, &status, WNOHANG)) == 0; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  if (done == 0) {  // still running after 10 s
    kill(child, SIGKILL);
    waitpid(child, &status, 0);
    FAIL() << "the forked rank hung";
  }
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0) << "forked rank failed (see forked_rank for the code)";
  EXPECT_EQ(test::count_open_fds(), before) << "descriptors leaked";
}

}  // namespace
}  // namespace mk
