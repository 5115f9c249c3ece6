// Internal: passing POSIX file descriptors (CUDA VMM shareable handles) between the processes
// of one host.
//
// Every rank binds an abstract-namespace AF_UNIX datagram socket "\0mkernel-<session>-<rank>",
// where <session> is a random 64-bit id (hex) that rank 0 draws and shares through the bootstrap.
// A message is one datagram: a small header {magic, source rank, tag} plus one descriptor as
// SCM_RIGHTS. Messages that do not match what a call waits for (another tag, a rank not awaited)
// are kept for later calls, since a fast peer may already be in its next exchange. Anything else
// (wrong size or magic, no or several descriptors, another user) is rejected and its descriptors
// are closed.
#pragma once

#include <cstdint>
#include <deque>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "mkernel/bootstrap.h"
#include "runtime/socket_util.h"

namespace mk::detail {

// The body of one datagram; the descriptor travels beside it as SCM_RIGHTS.
struct FdMessage {
  static constexpr uint64_t kMagic = 0x6d6b2d66642d7867;  // "mk-fd-xg"
  uint64_t magic = kMagic;
  int32_t source = 0;  // sending rank
  int32_t reserved = 0;
  uint64_t tag = 0;
};

class FdExchange {
 public:
  // Collective over `bootstrap` (all ranks call it). `timeout_seconds` (> 0) limits each
  // exchange(). Throws mk::Error(kSystem) on every rank when any rank cannot bind its socket.
  FdExchange(Bootstrap& bootstrap, double timeout_seconds);
  ~FdExchange();  // closes the socket and every received-but-unclaimed descriptor
  FdExchange(const FdExchange&) = delete;
  FdExchange& operator=(const FdExchange&) = delete;

  // Sends a duplicate of `fd` to every rank in `to` (the caller keeps `fd`), and receives one
  // descriptor from every rank in `from`, both tagged with `tag`. Returns the received descriptors
  // in the order of `from` (close-on-exec set); the caller owns them. Ranks in `to` and in `from`
  // must be distinct and in [0, size). Non-blocking sends in a poll loop: a peer's queue may be
  // full (net.unix.max_dgram_qlen can be as small as 10), and the peer drains it only when it
  // runs its own exchange. Throws mk::Error(kTimeout) "rank 3: no memory handle from rank 1 after
  // 60 s (tag 7)" when the time limit passes, kSystem with strerror on socket failures; descriptors
  // received by a failing call are closed.
  std::vector<int> exchange(int fd, const std::vector<int>& to, const std::vector<int>& from,
                            uint64_t tag);

  // Printable address of `rank`'s socket, "@mkernel-<session>-<rank>" ('@' standing for the
  // leading NUL of the abstract namespace).
  std::string address(int rank) const;

 private:
  bool try_send(int fd, int to, uint64_t tag);  // false while `to`'s queue is full
  void receive_pending();                       // moves every queued datagram into stash_
  int claim(int from, uint64_t tag);            // a stashed descriptor, or -1
  [[noreturn]] void throw_timeout(const std::vector<int>& missing, const std::vector<int>& unsent,
                                  uint64_t tag) const;

  int rank_ = 0;
  int size_ = 1;
  double timeout_seconds_ = 0;
  uint64_t session_ = 0;
  UniqueFd socket_;
  std::map<std::pair<int, uint64_t>, std::deque<int>> stash_;  // (source, tag) -> fds, oldest first
  uint64_t rejected_ = 0;                                      // malformed datagrams dropped so far
};

}  // namespace mk::detail
