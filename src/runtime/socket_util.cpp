#include "runtime/socket_util.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <climits>
#include <cstring>

#include "mkernel/error.h"

namespace mk::detail {
namespace {

// Waits until `fd` reports `events` (or an error / hang-up, which the next call then surfaces).
IoStatus wait_for(int fd, short events, const Deadline& deadline, const std::string& what) {
  while (true) {
    pollfd p{fd, events, 0};
    const int n = poll(&p, 1, deadline.poll_timeout_ms());
    if (n > 0) return IoStatus::kDone;
    if (n < 0 && errno != EINTR) throw_system_error(what + ": poll", errno);
    if (n == 0 && deadline.expired()) return IoStatus::kTimedOut;
  }
}

bool is_disconnect(int err) { return err == EPIPE || err == ECONNRESET; }

}  // namespace

void UniqueFd::reset(int fd) {
  if (fd_ >= 0) close(fd_);  // Linux closes the descriptor even when close() reports EINTR
  fd_ = fd;
}

Deadline Deadline::after(double seconds) {
  if (!(seconds < kForeverSeconds)) return never();
  const auto span =
      std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(seconds));
  return Deadline(Clock::now() + span);
}

int Deadline::poll_timeout_ms() const {
  if (at_ == Clock::time_point::max()) return -1;
  const auto left = at_ - Clock::now();
  if (left <= Clock::duration::zero()) return 0;
  const auto ms = std::chrono::ceil<std::chrono::milliseconds>(left).count();
  return ms > INT_MAX ? INT_MAX : static_cast<int>(ms);
}

IoStatus send_all(int fd, const void* data, std::size_t bytes, const Deadline& deadline,
                  const std::string& what) {
  const char* p = static_cast<const char*>(data);
  while (bytes > 0) {
    const ssize_t n = send(fd, p, bytes, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n > 0) {
      p += n;
      bytes -= static_cast<std::size_t>(n);
    } else if (errno == EAGAIN || errno == EWOULDBLOCK) {
      const IoStatus status = wait_for(fd, POLLOUT, deadline, what);
      if (status != IoStatus::kDone) return status;
    } else if (is_disconnect(errno)) {
      return IoStatus::kClosed;
    } else if (errno != EINTR) {
      throw_system_error(what, errno);
    }
  }
  return IoStatus::kDone;
}

IoStatus recv_all(int fd, void* data, std::size_t bytes, const Deadline& deadline,
                  const std::string& what) {
  char* p = static_cast<char*>(data);
  while (bytes > 0) {
    const ssize_t n = recv(fd, p, bytes, MSG_DONTWAIT);
    if (n > 0) {
      p += n;
      bytes -= static_cast<std::size_t>(n);
    } else if (n == 0) {
      return IoStatus::kClosed;
    } else if (errno == EAGAIN || errno == EWOULDBLOCK) {
      const IoStatus status = wait_for(fd, POLLIN, deadline, what);
      if (status != IoStatus::kDone) return status;
    } else if (is_disconnect(errno)) {
      return IoStatus::kClosed;
    } else if (errno != EINTR) {
      throw_system_error(what, errno);
    }
  }
  return IoStatus::kDone;
}

void throw_system_error(const std::string& what, int err) {
  throw Error(ErrorCode::kSystem, what + ": " + std::strerror(err));
}

void set_cloexec(int fd, bool on) {
  const int flags = fcntl(fd, F_GETFD);
  if (flags < 0) throw_system_error("fcntl(F_GETFD) on fd " + std::to_string(fd), errno);
  const int wanted = on ? (flags | FD_CLOEXEC) : (flags & ~FD_CLOEXEC);
  if (wanted != flags && fcntl(fd, F_SETFD, wanted) < 0) {
    throw_system_error("fcntl(F_SETFD) on fd " + std::to_string(fd), errno);
  }
}

void set_nonblocking(int fd) {
  const int flags = fcntl(fd, F_GETFL);
  if (flags < 0) throw_system_error("fcntl(F_GETFL) on fd " + std::to_string(fd), errno);
  if ((flags & O_NONBLOCK) == 0 && fcntl(fd, F_SETFL, flags | O_NONBLOCK) < 0) {
    throw_system_error("fcntl(F_SETFL) on fd " + std::to_string(fd), errno);
  }
}

}  // namespace mk::detail
