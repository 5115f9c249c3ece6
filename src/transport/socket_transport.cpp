// The socket backend's data path: batched sends, receiver threads, goodbyes and lost peers.
#include "transport/socket_transport.h"

#include <limits.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/uio.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <numeric>

#include "runtime/text_util.h"
#include "transport/wire.h"

namespace mk::transport::detail {
namespace {

using mk::detail::Deadline;
using mk::detail::IoStatus;

constexpr int kMaxIov = 256;                // per sendmsg batch (headers + payloads)
constexpr double kGoodbyeGraceSeconds = 2;  // how long a leaving rank waits for peers' goodbyes

WireHeader put_header(const TransferOp& op, const Chunk& chunk) {
  WireHeader h{};
  h.kind = static_cast<uint32_t>(WireKind::kPut);
  h.signal = op.signal_id;
  h.tile_id = op.tile_id;
  h.dst_offset = chunk.dst_offset;
  h.bytes = chunk.bytes;
  h.dst_buffer = op.dst_buffer;
  return h;
}

WireHeader signal_header(const TransferOp& op) {
  WireHeader h{};
  h.kind = static_cast<uint32_t>(WireKind::kSignal);
  h.signal = op.signal_id;
  h.tile_id = op.tile_id;
  h.target = op.target;
  h.value = op.value;
  return h;
}

}  // namespace

SocketTransport::~SocketTransport() { shutdown_all(true); }

void SocketTransport::close_abruptly() { shutdown_all(false); }

Error SocketTransport::lost(Connection& c, const std::string& during) {
  const std::string peer = "rank " + std::to_string(c.peer) + " (" + c.address + ")";
  Error error(ErrorCode::kBootstrap,
              c.goodbye.load() ? prefix() + peer + " has shut down its transport; " + during +
                                     " is not possible any more"
                               : prefix() + "lost the connection to " + peer + " while " + during +
                                     ": the peer process died or closed its transport abruptly");
  fail(error);
  return error;
}

uint32_t SocketTransport::register_memory(int id, void*, uint64_t, MemoryKind kind) {
  if (kind == MemoryKind::kDevice && (!config_.copy_to_device || !config_.copy_from_device)) {
    throw Error(ErrorCode::kInvalidArgument,
                "buffer " + std::to_string(id) +
                    " is device memory but TransportConfig has no copy_to_device / "
                    "copy_from_device to stage it through host memory");
  }
  return 0;
}

// ---- sending ----------------------------------------------------------------------------------

void SocketTransport::post(std::span<const TransferOp> ops) {
  check_ops(ops);
  if (closed_.load()) {
    throw Error(ErrorCode::kNotInitialized, prefix() + "post after the transport was closed");
  }
  // Group by destination, keeping the order of each destination's ops.
  std::vector<uint32_t> order(ops.size());
  std::iota(order.begin(), order.end(), 0u);
  std::stable_sort(order.begin(), order.end(),
                   [&](uint32_t a, uint32_t b) { return ops[a].dst_rank < ops[b].dst_rank; });
  std::vector<TransferOp> run;
  for (std::size_t i = 0; i < order.size();) {
    const uint32_t dst = ops[order[i]].dst_rank;
    run.clear();
    for (; i < order.size() && ops[order[i]].dst_rank == dst; ++i) run.push_back(ops[order[i]]);
    Connection& c = *conns_[dst];
    std::lock_guard<std::mutex> lock(c.send_mutex);
    send_run(c, run);
  }
}

void SocketTransport::send_run(Connection& c, std::span<const TransferOp> ops) {
  if (c.goodbye.load() || c.broken.load()) throw lost(c, "sending");
  WireHeader headers[kMaxIov / 2];
  iovec iov[kMaxIov];
  int n_iov = 0, n_hdr = 0;
  auto flush = [&] {
    if (n_iov > 0) send_iov(c, iov, n_iov);
    n_iov = n_hdr = 0;
  };
  auto add_header = [&](const WireHeader& h) {
    if (n_iov + 2 > kMaxIov || n_hdr == kMaxIov / 2) flush();
    headers[n_hdr] = h;
    iov[n_iov++] = iovec{&headers[n_hdr++], sizeof(WireHeader)};
  };
  for (const TransferOp& op : ops) {
    if (op.kind == TransferOp::Kind::kSignal) {
      add_header(signal_header(op));
      continue;
    }
    const LocalBuffer src = local_buffer(op.src_buffer);
    const uint64_t chunks = chunk_count(op.bytes, kMaxChunk);
    for (uint64_t k = 0; k < chunks; ++k) {
      const Chunk chunk = chunk_at(op.src_offset, op.dst_offset, op.bytes, kMaxChunk, k);
      add_header(put_header(op, chunk));
      if (src.kind == MemoryKind::kHost) {
        iov[n_iov++] = iovec{src.base + chunk.src_offset, chunk.bytes};
      } else {  // device memory: stage, then send before the staging buffer is reused
        c.send_staging.resize(kMaxChunk);
        config_.copy_from_device(c.send_staging.data(), src.base + chunk.src_offset, chunk.bytes);
        iov[n_iov++] = iovec{c.send_staging.data(), chunk.bytes};
        flush();
      }
    }
  }
  flush();
}

void SocketTransport::send_iov(Connection& c, iovec* iov, int count) {
  // A failure may leave a message half sent: the stream is out of step for good. Nothing more may
  // go on it (another thread's post, the goodbye), and the peer must see it end rather than wait
  // for the rest of the message or read the next one as the rest of this one.
  auto abandon = [&](Error error) {
    fail(error);
    c.broken.store(true);
    shutdown(c.fd.get(), SHUT_RDWR);
    return error;
  };
  Deadline deadline = Deadline::after(timeout_seconds_);
  int first = 0;
  while (first < count) {
    msghdr msg{};
    msg.msg_iov = iov + first;
    msg.msg_iovlen = static_cast<std::size_t>(std::min(count - first, IOV_MAX));
    const ssize_t n = sendmsg(c.fd.get(), &msg, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n > 0) {
      std::size_t left = static_cast<std::size_t>(n);
      while (left > 0) {
        if (left >= iov[first].iov_len) {
          left -= iov[first].iov_len;
          ++first;
        } else {
          iov[first].iov_base = static_cast<char*>(iov[first].iov_base) + left;
          iov[first].iov_len -= left;
          left = 0;
        }
      }
      deadline = Deadline::after(timeout_seconds_);
      continue;
    }
    if (errno == EINTR) continue;
    if (errno == EPIPE || errno == ECONNRESET || errno == ENOTCONN) {
      throw abandon(lost(c, "sending"));
    }
    if (errno != EAGAIN && errno != EWOULDBLOCK) {
      throw abandon(Error(
          ErrorCode::kSystem,
          prefix() + "sendmsg to rank " + std::to_string(c.peer) + ": " + std::strerror(errno)));
    }
    pollfd p{c.fd.get(), POLLOUT, 0};
    const int ready = poll(&p, 1, deadline.poll_timeout_ms());
    if (ready == 0 && deadline.expired()) {
      throw abandon(Error(ErrorCode::kTimeout, prefix() + "rank " + std::to_string(c.peer) + " (" +
                                                   c.address + ") took no data for " +
                                                   mk::detail::format_seconds(timeout_seconds_) +
                                                   " s (MKERNEL_TIMEOUT_S); is it stuck?"));
    }
  }
}

// ---- receiving --------------------------------------------------------------------------------

bool SocketTransport::receive_payload(Connection& c, char* dst, uint64_t bytes, bool device) {
  const std::string what = "receiving from rank " + std::to_string(c.peer);
  if (!device) {
    return mk::detail::recv_all(c.fd.get(), dst, bytes, Deadline::never(), what) == IoStatus::kDone;
  }
  c.staging.resize(kMaxChunk);
  if (mk::detail::recv_all(c.fd.get(), c.staging.data(), bytes, Deadline::never(), what) !=
      IoStatus::kDone) {
    return false;
  }
  config_.copy_to_device(dst, c.staging.data(), bytes);
  return true;
}

void SocketTransport::receive_loop(Connection& c) {
  auto malformed = [&](const std::string& why) {
    c.broken.store(true);
    fail(Error(ErrorCode::kInternal, prefix() + "malformed message from rank " +
                                         std::to_string(c.peer) + " (" + c.address + "): " + why +
                                         "; connection dropped"));
    shutdown(c.fd.get(), SHUT_RDWR);
  };
  auto ended = [&] {
    c.broken.store(true);
    if (!stopping_.load() && !c.goodbye.load()) lost(c, "receiving");
  };
  try {
    while (true) {
      WireHeader h{};
      if (mk::detail::recv_all(c.fd.get(), &h, sizeof(h), Deadline::never(), "receiving") !=
          IoStatus::kDone) {
        ended();
        break;
      }
      if (h.kind == static_cast<uint32_t>(WireKind::kPut)) {
        std::string why = check_incoming_put(static_cast<uint32_t>(c.peer), h.dst_buffer,
                                             h.dst_offset, h.bytes, h.signal);
        if (why.empty() && h.bytes > kMaxChunk) {
          why = "a chunk of " + std::to_string(h.bytes) + " bytes; at most " +
                std::to_string(kMaxChunk);
        }
        if (!why.empty()) {
          malformed(why);
          break;
        }
        const LocalBuffer b = local_buffer(h.dst_buffer);
        if (!receive_payload(c, b.base + h.dst_offset, h.bytes, b.kind == MemoryKind::kDevice)) {
          ended();
          break;
        }
        if (h.signal != kNoSignal) tracker().add_bytes(c.peer, h.signal, h.bytes);
      } else if (h.kind == static_cast<uint32_t>(WireKind::kSignal)) {
        const std::string why = check_incoming_signal(static_cast<uint32_t>(c.peer), h.signal);
        if (!why.empty()) {
          malformed(why);
          break;
        }
        tracker().add_signal(c.peer, h.signal, h.target, h.value);
      } else if (h.kind == static_cast<uint32_t>(WireKind::kBye)) {
        c.goodbye.store(true);
      } else {
        malformed("unknown message kind " + std::to_string(h.kind));
        break;
      }
    }
  } catch (const Error& e) {
    fail(e);
  } catch (const std::exception& e) {
    fail(Error(ErrorCode::kInternal,
               prefix() + "receiver for rank " + std::to_string(c.peer) + " failed: " + e.what()));
  }
  c.receiver_done.store(true);
}

// ---- leaving ----------------------------------------------------------------------------------

void SocketTransport::shutdown_all(bool goodbye) {
  if (closed_.exchange(true)) return;
  stopping_.store(true);
  if (goodbye) {
    WireHeader bye{};
    bye.kind = static_cast<uint32_t>(WireKind::kBye);
    for (auto& c : conns_) {
      if (!c || !c->fd) continue;
      std::lock_guard<std::mutex> lock(c->send_mutex);
      try {  // (from the destructor too: nothing may leave it)
        mk::detail::send_all(c->fd.get(), &bye, sizeof(bye), Deadline::after(1), "goodbye");
      } catch (const std::exception&) {
        // The peer learns of the end when the connection closes below.
      }
      shutdown(c->fd.get(), SHUT_WR);
    }
    // Let the peers' goodbyes arrive, so that nobody closes with unread data (which would reset
    // the connection and could swallow a goodbye in flight).
    const auto until =
        std::chrono::steady_clock::now() +
        std::chrono::duration<double>(std::min(kGoodbyeGraceSeconds, timeout_seconds_));
    for (auto& c : conns_) {
      while (c && c->receiver.joinable() && !c->receiver_done.load() &&
             std::chrono::steady_clock::now() < until) {
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
      }
    }
  }
  for (auto& c : conns_) {
    if (c && c->fd) shutdown(c->fd.get(), SHUT_RDWR);
  }
  for (auto& c : conns_) {
    if (c && c->receiver.joinable()) c->receiver.join();
    if (c) c->fd.reset();  // peers still sending get a reset rather than silence
  }
}

}  // namespace mk::transport::detail
