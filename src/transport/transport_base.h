// Internal: what every backend shares - the registered buffer table (exchanged through the
// bootstrap), limits, checks of outgoing ops and incoming messages, completion accounting and
// the first-error record. Backends add the wire.
#pragma once

#include <atomic>
#include <mutex>
#include <optional>
#include <shared_mutex>
#include <string>
#include <vector>

#include "mkernel/transport/transport.h"
#include "transport/completion.h"

namespace mk::transport::detail {

// Resolved configuration value: MKERNEL_TIMEOUT_S or 60 s when config.timeout_seconds < 0.
double resolve_timeout(double configured);

class TransportBase : public Transport {
 public:
  TransportBase(Bootstrap& bootstrap, const TransportConfig& config, const char* name);
  ~TransportBase() override;

  const char* name() const override { return name_; }
  int rank() const override { return rank_; }
  int world_size() const override { return world_size_; }
  void register_buffer(int id, void* base, uint64_t bytes, MemoryKind kind) override;
  void release_buffer(int id) override;
  CommandLimits limits() const override;
  void check() const override;
  bool failed() const override { return failed_.load(std::memory_order_acquire); }

  CompletionTracker& tracker() { return tracker_; }
  // Whether this transport exchanges data with rank r (TransportConfig::peers), and how many.
  bool is_peer(int r) const override {
    return r >= 0 && r < world_size_ && peer_[static_cast<std::size_t>(r)] != 0;
  }
  int num_peers() const { return num_peers_; }

 protected:
  struct LocalBuffer {
    char* base = nullptr;
    uint64_t bytes = 0;
    MemoryKind kind = MemoryKind::kHost;
  };
  // What every rank publishes about its copy of a buffer.
  struct RemoteBuffer {
    uint64_t addr = 0;   // base address in the owner's address space (RDMA remote address)
    uint64_t bytes = 0;  // 0 = not registered
    uint32_t rkey = 0;   // the backend's remote key (0 for socket)
    uint32_t kind = 0;   // MemoryKind
  };

  // Backend hook, called by register_buffer before the exchange: make the memory reachable by
  // the network (RDMA: register a memory region). Returns the key peers use.
  virtual uint32_t register_memory(int id, void* base, uint64_t bytes, MemoryKind kind);
  // Backend hook, called by release_buffer after the tables forgot `id` (RDMA: deregister).
  virtual void unregister_memory(int id);

  LocalBuffer local_buffer(int id) const;
  RemoteBuffer remote_buffer(int rank, int id) const;

  // Why `op` cannot be sent (empty if it can): the same checks as validate(Command).
  std::string check_op(const TransferOp& op) const;
  // Throws mk::Error(kInvalidArgument) naming the first op of `ops` that check_op refuses.
  void check_ops(std::span<const TransferOp> ops) const;
  // Why an incoming put from `src` into [dst_offset, +bytes) of buffer `dst_buffer` counted on
  // `signal` must not be applied (empty if fine).
  std::string check_incoming_put(uint32_t src, uint8_t dst_buffer, uint64_t dst_offset,
                                 uint64_t bytes, uint32_t signal) const;
  std::string check_incoming_signal(uint32_t src, uint32_t signal) const;

  // Records the first asynchronous error and calls config.on_error once. Thread-safe.
  void fail(const Error& error);
  std::string prefix() const;  // "transport socket, rank 3: "

  Bootstrap& bootstrap_;
  TransportConfig config_;
  const double timeout_seconds_;

 private:
  const char* name_;
  int rank_;
  int world_size_;
  std::vector<uint8_t> peer_;  // [world]: 1 = a peer
  int num_peers_ = 0;
  CompletionTracker tracker_;

  mutable std::shared_mutex buffers_mutex_;
  LocalBuffer local_[kMaxBuffers];
  std::vector<RemoteBuffer> remote_;  // [world_size * kMaxBuffers]

  std::atomic<bool> failed_{false};
  mutable std::mutex error_mutex_;
  std::optional<Error> error_;
};

// The message of `e` without the "<code>: " prefix that Error::what() starts with.
std::string message_of(const Error& e);

// Allgathers a status string (empty = ok) and throws mk::Error(code) naming every rank that
// reported a problem, so that a failure on one rank is an error on every rank, not a hang.
void agree_or_throw(Bootstrap& bootstrap, const std::string& my_status, ErrorCode code,
                    const std::string& what);

}  // namespace mk::transport::detail
