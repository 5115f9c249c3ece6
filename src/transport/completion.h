// Internal: completion accounting that does not depend on the order in which writes land.
//
// Sender (SendLedger, one per proxy): for every (destination, signal) the running total of put
// bytes counted on it. A put adds its bytes; a signal carries the total at the moment it is
// issued as its target. Totals only grow, like signal values, so nothing is ever reset.
//
// Receiver (CompletionTracker, one per transport): for every (source, signal) the bytes that
// have landed, and the signals that arrived before their bytes did. A signal is raised once
// arrived >= target. Puts, chunks of puts and signals may arrive in any order (EFA SRD, several
// queue pairs or connections per peer): the count is a sum, the comparison a threshold.
//
//   sender                      wire (any order)             receiver (src 0, signal 3)
//   put A 4 KiB  total = 4096   signal target 8192 v=7  -->  pending {8192: 7}
//   put B 4 KiB  total = 8192   put B 4096 bytes        -->  arrived 4096
//   signal s=3 v=7 target 8192  put A 4096 bytes        -->  arrived 8192 -> raise 7
#pragma once

#include <array>
#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "mkernel/transport/transport.h"

namespace mk::transport::detail {

// Wrap-safe "a is later than b" for signal values.
inline bool later(uint64_t a, uint64_t b) { return static_cast<int64_t>(a - b) > 0; }

class SendLedger {
 public:
  SendLedger(uint32_t world_size, uint32_t num_signals);
  // Counts `bytes` more on (dst, signal); returns the new total.
  uint64_t add(uint32_t dst_rank, uint32_t signal, uint64_t bytes);
  uint64_t total(uint32_t dst_rank, uint32_t signal) const;

 private:
  std::size_t index(uint32_t dst_rank, uint32_t signal) const;
  uint32_t world_size_;
  uint32_t num_signals_;
  std::unique_ptr<std::atomic<uint64_t>[]> totals_;
};

class CompletionTracker {
 public:
  CompletionTracker(uint32_t world_size, uint32_t num_signals, SignalSink& sink);

  // `bytes` counted on (src, signal) have landed. Thread-safe.
  void add_bytes(uint32_t src_rank, uint32_t signal, uint64_t bytes);
  // Raise (src, signal) to `value` once `target` bytes counted on it have landed. Thread-safe.
  void add_signal(uint32_t src_rank, uint32_t signal, uint64_t target, uint64_t value);

  uint64_t arrived(uint32_t src_rank, uint32_t signal) const;
  std::size_t pending() const;  // signals waiting for their bytes
  // "rank 1 signal 3 = 0x7 waits for 4096 more bytes; ..." (at most `max` entries).
  std::string describe_pending(std::size_t max = 8) const;

 private:
  struct Pending {
    uint64_t target;
    uint64_t value;
  };
  struct Entry {
    uint64_t arrived = 0;
    uint64_t raised = 0;
    bool has_raised = false;
    std::vector<Pending> pending;
  };
  struct Stripe {
    mutable std::mutex mutex;
    std::unordered_map<uint64_t, Entry> entries;  // key: src << 32 | signal
  };
  static constexpr std::size_t kStripes = 64;

  void check_range(uint32_t src_rank, uint32_t signal, const char* what) const;
  Stripe& stripe(uint32_t src_rank, uint32_t signal) const;
  // Raises the latest satisfied pending value, drops every satisfied entry. Stripe lock held.
  void release(uint32_t src_rank, uint32_t signal, Entry& entry);

  uint32_t world_size_;
  uint32_t num_signals_;
  SignalSink& sink_;
  mutable std::array<Stripe, kStripes> stripes_;
};

}  // namespace mk::transport::detail
