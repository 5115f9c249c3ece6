#include "runtime/fd_exchange.h"

#include <poll.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstddef>
#include <cstdio>
#include <cstring>

#include "mkernel/error.h"
#include "runtime/text_util.h"

namespace mk::detail {
namespace {

// While a peer's queue is full, how often to retry the send (its owner drains it in its own loop).
constexpr int kSendRetryMs = 1;

// Room for the ancillary data of one received datagram: our one descriptor and the sender's
// credentials, plus some slack so that a misbehaving sender's extra descriptors are seen (and
// closed) rather than silently truncated.
constexpr int kMaxFdsSeen = 8;
constexpr std::size_t kControlBytes =
    CMSG_SPACE(sizeof(int) * kMaxFdsSeen) + CMSG_SPACE(sizeof(ucred));

struct SocketAddress {
  sockaddr_un addr{};
  socklen_t length = 0;
};

std::string socket_name(uint64_t session, int rank) {
  char hex[17];
  std::snprintf(hex, sizeof(hex), "%016llx", static_cast<unsigned long long>(session));
  return std::string("mkernel-") + hex + "-" + std::to_string(rank);
}

SocketAddress abstract_address(const std::string& name) {
  SocketAddress a;
  a.addr.sun_family = AF_UNIX;
  a.addr.sun_path[0] = '\0';  // abstract namespace: no file, gone when the socket closes
  std::memcpy(a.addr.sun_path + 1, name.data(), name.size());
  a.length = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + name.size());
  return a;
}

uint64_t random_session_id() {
  uint64_t id = 0;
  if (getrandom(&id, sizeof(id), 0) != static_cast<ssize_t>(sizeof(id))) {
    throw_system_error("FdExchange: getrandom for the session id", errno);
  }
  return id;
}

void close_all(const std::vector<int>& fds) {
  for (int fd : fds) {
    if (fd >= 0) close(fd);
  }
}

void check_ranks(const char* what, const std::vector<int>& ranks, int size) {
  for (std::size_t i = 0; i < ranks.size(); ++i) {
    if (ranks[i] < 0 || ranks[i] >= size) {
      throw Error(ErrorCode::kInvalidArgument,
                  std::string("FdExchange::exchange: ") + what + " holds rank " +
                      std::to_string(ranks[i]) + "; expected 0 <= rank < " + std::to_string(size));
    }
    if (std::find(ranks.begin(), ranks.begin() + i, ranks[i]) != ranks.begin() + i) {
      throw Error(ErrorCode::kInvalidArgument, std::string("FdExchange::exchange: ") + what +
                                                   " holds rank " + std::to_string(ranks[i]) +
                                                   " twice; expected distinct ranks");
    }
  }
}

}  // namespace

FdExchange::FdExchange(Bootstrap& bootstrap, double timeout_seconds)
    : rank_(bootstrap.rank()), size_(bootstrap.size()), timeout_seconds_(timeout_seconds) {
  if (!(timeout_seconds > 0) || !std::isfinite(timeout_seconds)) {
    throw Error(ErrorCode::kInvalidArgument, "FdExchange: timeout_seconds " +
                                                 format_seconds(timeout_seconds) +
                                                 " is not valid; expected a finite number > 0");
  }
  const uint64_t drawn = rank_ == 0 ? random_session_id() : 0;
  std::vector<uint64_t> drawn_by(size_);
  bootstrap.allgather(&drawn, drawn_by.data(), sizeof(drawn));
  session_ = drawn_by[0];

  // Bind, then agree: nobody may send before every socket exists, and a rank that cannot bind
  // must not leave the others waiting in their first exchange.
  int32_t bind_errno = 0;
  socket_.reset(socket(AF_UNIX, SOCK_DGRAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
  const int on = 1;
  const SocketAddress self = abstract_address(socket_name(session_, rank_));
  if (!socket_ || setsockopt(socket_.get(), SOL_SOCKET, SO_PASSCRED, &on, sizeof(on)) != 0 ||
      bind(socket_.get(), reinterpret_cast<const sockaddr*>(&self.addr), self.length) != 0) {
    bind_errno = errno;
  }
  std::vector<int32_t> errno_of(size_);
  bootstrap.allgather(&bind_errno, errno_of.data(), sizeof(bind_errno));
  for (int r = 0; r < size_; ++r) {
    if (errno_of[r] != 0) {
      throw Error(ErrorCode::kSystem, "rank " + std::to_string(rank_) + ": FdExchange: rank " +
                                          std::to_string(r) + " could not set up socket " +
                                          address(r) + ": " + std::strerror(errno_of[r]));
    }
  }
}

FdExchange::~FdExchange() {
  for (const auto& [key, fds] : stash_) close_all({fds.begin(), fds.end()});
}

std::string FdExchange::address(int rank) const {
  std::string address = "@";  // (appending avoids a false -Wrestrict of GCC 12 on "@" + string)
  address += socket_name(session_, rank);
  return address;
}

std::vector<int> FdExchange::exchange(int fd, const std::vector<int>& to,
                                      const std::vector<int>& from, uint64_t tag) {
  check_ranks("`to`", to, size_);
  check_ranks("`from`", from, size_);
  if (!to.empty() && fd < 0) {
    throw Error(ErrorCode::kInvalidArgument, "FdExchange::exchange: fd " + std::to_string(fd) +
                                                 " is not a descriptor; expected fd >= 0");
  }
  const Deadline deadline = Deadline::after(timeout_seconds_);
  std::vector<int> unsent = to;
  std::vector<int> received(from.size(), -1);
  try {
    while (true) {
      std::erase_if(unsent, [&](int peer) { return try_send(fd, peer, tag); });
      receive_pending();
      std::vector<int> missing;
      for (std::size_t i = 0; i < from.size(); ++i) {
        if (received[i] < 0) received[i] = claim(from[i], tag);
        if (received[i] < 0) missing.push_back(from[i]);
      }
      if (unsent.empty() && missing.empty()) return received;
      if (deadline.expired()) throw_timeout(missing, unsent, tag);

      int wait_ms = deadline.poll_timeout_ms();
      if (!unsent.empty()) wait_ms = std::min(wait_ms, kSendRetryMs);
      pollfd p{socket_.get(), POLLIN, 0};
      if (poll(&p, 1, wait_ms) < 0 && errno != EINTR) {
        throw_system_error("rank " + std::to_string(rank_) + ": FdExchange poll", errno);
      }
    }
  } catch (...) {
    close_all(received);
    throw;
  }
}

bool FdExchange::try_send(int fd, int to, uint64_t tag) {
  FdMessage body;
  body.source = rank_;
  body.tag = tag;
  iovec iov{&body, sizeof(body)};
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))] = {};
  const SocketAddress peer = abstract_address(socket_name(session_, to));
  msghdr msg{};
  msg.msg_name = const_cast<sockaddr_un*>(&peer.addr);
  msg.msg_namelen = peer.length;
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  msg.msg_control = control;
  msg.msg_controllen = sizeof(control);
  cmsghdr* c = CMSG_FIRSTHDR(&msg);
  c->cmsg_level = SOL_SOCKET;
  c->cmsg_type = SCM_RIGHTS;
  c->cmsg_len = CMSG_LEN(sizeof(int));
  std::memcpy(CMSG_DATA(c), &fd, sizeof(int));

  while (sendmsg(socket_.get(), &msg, MSG_DONTWAIT | MSG_NOSIGNAL) < 0) {
    if (errno == EINTR) continue;
    if (errno == EAGAIN || errno == EWOULDBLOCK) return false;
    const int err = errno;
    std::string hint;
    if (err == ECONNREFUSED || err == ENOENT) {
      hint = "; has rank " + std::to_string(to) +
             " exited or destroyed its FdExchange (or is it in another network namespace)?";
    }
    throw Error(ErrorCode::kSystem, "rank " + std::to_string(rank_) +
                                        ": cannot send memory handle to rank " +
                                        std::to_string(to) + " (" + address(to) + ", tag " +
                                        std::to_string(tag) + "): " + std::strerror(err) + hint);
  }
  return true;
}

void FdExchange::receive_pending() {
  while (true) {
    FdMessage body;
    body.magic = 0;
    iovec iov{&body, sizeof(body)};
    alignas(cmsghdr) char control[kControlBytes] = {};
    msghdr msg{};
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control;
    msg.msg_controllen = sizeof(control);
    const ssize_t n = recvmsg(socket_.get(), &msg, MSG_DONTWAIT | MSG_CMSG_CLOEXEC);
    if (n < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) return;
      throw_system_error("rank " + std::to_string(rank_) + ": FdExchange recvmsg", errno);
    }

    std::vector<int> fds;
    bool same_user = false;
    for (cmsghdr* c = CMSG_FIRSTHDR(&msg); c != nullptr; c = CMSG_NXTHDR(&msg, c)) {
      if (c->cmsg_level != SOL_SOCKET) continue;
      if (c->cmsg_type == SCM_RIGHTS) {
        const std::size_t count = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
        for (std::size_t i = 0; i < count; ++i) {
          int received = -1;
          std::memcpy(&received, CMSG_DATA(c) + i * sizeof(int), sizeof(int));
          fds.push_back(received);
        }
      } else if (c->cmsg_type == SCM_CREDENTIALS) {
        ucred cred{};
        std::memcpy(&cred, CMSG_DATA(c), sizeof(cred));
        same_user = cred.uid == geteuid();
      }
    }
    const bool well_formed = n == static_cast<ssize_t>(sizeof(body)) &&
                             (msg.msg_flags & (MSG_TRUNC | MSG_CTRUNC)) == 0 &&
                             body.magic == FdMessage::kMagic && body.source >= 0 &&
                             body.source < size_ && fds.size() == 1 && same_user;
    if (!well_formed) {
      close_all(fds);
      ++rejected_;
      continue;
    }
    stash_[{body.source, body.tag}].push_back(fds[0]);
  }
}

int FdExchange::claim(int from, uint64_t tag) {
  const auto it = stash_.find({from, tag});
  if (it == stash_.end()) return -1;
  const int fd = it->second.front();
  it->second.pop_front();
  if (it->second.empty()) stash_.erase(it);
  return fd;
}

void FdExchange::throw_timeout(const std::vector<int>& missing, const std::vector<int>& unsent,
                               uint64_t tag) const {
  const std::string after = " after " + format_seconds(timeout_seconds_) + " s";
  std::string message = "rank " + std::to_string(rank_) + ": ";
  if (!missing.empty()) {
    message += "no memory handle from " + format_rank_list(missing) + after;
    if (!unsent.empty()) message += ", and ";
  }
  if (!unsent.empty()) {
    message += "could not deliver a memory handle to " + format_rank_list(unsent) +
               (missing.empty() ? after : "") + " (receive queue full)";
  }
  message += " (tag " + std::to_string(tag) + ")";
  if (rejected_ > 0) message += "; " + std::to_string(rejected_) + " malformed messages rejected";
  throw Error(ErrorCode::kTimeout, message);
}

}  // namespace mk::detail
