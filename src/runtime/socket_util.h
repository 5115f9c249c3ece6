// Internal: file descriptors, deadlines and complete sends/receives on stream sockets.
//
// Shared by the launcher bootstrap (bootstrap.cpp), FdExchange and tools/mkrun. Includes no other
// internal header, so that tools/mkrun can use it without the library's private include path.
#pragma once

#include <chrono>
#include <cstddef>
#include <string>

namespace mk::detail {

// Owns one POSIX file descriptor (-1 = none) and closes it on destruction.
class UniqueFd {
 public:
  UniqueFd() = default;
  explicit UniqueFd(int fd) : fd_(fd) {}
  ~UniqueFd() { reset(); }
  UniqueFd(UniqueFd&& other) noexcept : fd_(other.release()) {}
  UniqueFd& operator=(UniqueFd&& other) noexcept {
    if (this != &other) reset(other.release());
    return *this;
  }
  UniqueFd(const UniqueFd&) = delete;
  UniqueFd& operator=(const UniqueFd&) = delete;

  int get() const { return fd_; }
  explicit operator bool() const { return fd_ >= 0; }
  int release() {
    const int fd = fd_;
    fd_ = -1;
    return fd;
  }
  void reset(int fd = -1);  // closes the current descriptor, if any, then holds `fd`

 private:
  int fd_ = -1;
};

// A time limit at least this long is none (~30 years): its nanoseconds would overflow the clocks'
// and the kernels' 64-bit counts. Deadline::after, the bootstraps and the communicator share it.
constexpr double kForeverSeconds = 1e9;

// A point in time after which waits give up. Deadline::never() does not expire.
class Deadline {
 public:
  using Clock = std::chrono::steady_clock;
  static Deadline after(double seconds);
  static Deadline never() { return Deadline(Clock::time_point::max()); }
  static Deadline earlier(const Deadline& a, const Deadline& b) { return a.at_ < b.at_ ? a : b; }

  bool expired() const { return Clock::now() >= at_; }
  // Milliseconds left, rounded up so that a poll() does not wake before the deadline; -1 for never.
  int poll_timeout_ms() const;

 private:
  explicit Deadline(Clock::time_point at) : at_(at) {}
  Clock::time_point at_;
};

enum class IoStatus {
  kDone,      // every byte was transferred
  kClosed,    // the peer closed the connection (EOF, EPIPE, ECONNRESET)
  kTimedOut,  // the deadline passed first
};

// Sends all `bytes` at `data` on the connected stream socket `fd` (blocking or not), resuming after
// short writes and EINTR, waiting in poll() while the socket is full. Never raises SIGPIPE.
// Throws mk::Error(kSystem) "<what>: <strerror>" on any other failure.
IoStatus send_all(int fd, const void* data, std::size_t bytes, const Deadline& deadline,
                  const std::string& what);
// Receives exactly `bytes` into `data`, with the same rules as send_all.
IoStatus recv_all(int fd, void* data, std::size_t bytes, const Deadline& deadline,
                  const std::string& what);

// Throws mk::Error(kSystem) "<what>: <strerror(err)>".
[[noreturn]] void throw_system_error(const std::string& what, int err);

// FD_CLOEXEC on or off; O_NONBLOCK on. Throw mk::Error(kSystem) on failure.
void set_cloexec(int fd, bool on);
void set_nonblocking(int fd);

}  // namespace mk::detail
