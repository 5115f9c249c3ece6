// mkernel/transport/proxy.h - host threads that turn ring commands into network operations.
//
// A Proxy owns `num_rings` CommandRings and one consumer thread per ring. Each thread reads the
// published commands of its ring in ticket order, in batches of up to `max_batch`:
//
//   poll ring -> validate each command (malformed: reported, counted, never executed)
//             -> put:        TransferOp put, its bytes counted on (dst, signal) in the send ledger
//                put+signal: the put, then a signal op whose target is the ledger's new total
//                signal:     a signal op whose target is the ledger's current total
//             -> transport.post(batch) -> ring.complete(last ticket + 1)
//
// A signal thus covers every put counted on the same (destination, signal) that the proxy
// processed before it: everything enqueued before it on the same ring, and whatever other rings
// happened to process earlier (which only delays the signal, never releases it early).
//
// Errors: a malformed command is skipped and recorded (check() throws it); a transport failure
// stops the proxy: every ring is marked broken so producers stop instead of waiting for space.
// Either way on_error is called once with the first error.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <thread>
#include <vector>

#include "mkernel/error.h"
#include "mkernel/transport/ring.h"
#include "mkernel/transport/transport.h"

namespace mk::transport {

namespace detail {
class SendLedger;
}

struct ProxyOptions {
  int num_rings = 1;
  uint64_t ring_capacity = 1024;  // slots per ring, power of two
  uint32_t max_batch = 64;        // commands read and posted together
  RingAllocator allocator;        // ring memory (default: host memory)
  std::function<void(const Error&)> on_error;
};

struct ProxyStats {
  uint64_t commands = 0;  // read from the rings (executed + rejected)
  uint64_t rejected = 0;  // malformed, not executed
  uint64_t puts = 0;
  uint64_t signals = 0;
  uint64_t bytes = 0;    // put bytes handed to the transport
  uint64_t batches = 0;  // transport.post calls
};

class Proxy {
 public:
  // Starts the consumer threads. `transport` must outlive the proxy; one proxy per transport
  // (the send ledger that signal targets come from is the proxy's).
  explicit Proxy(Transport& transport, ProxyOptions options = {});
  ~Proxy();  // stop()
  Proxy(const Proxy&) = delete;
  Proxy& operator=(const Proxy&) = delete;

  int num_rings() const { return static_cast<int>(rings_.size()); }
  // The ring producers push into (copy it into a kernel's arguments, or push from host threads).
  const CommandRing& ring(int i) const;

  // Host producer: pushes `c` into ring `i`, waiting at most `timeout_seconds` for space. Returns
  // the ticket. Throws mk::Error(kTimeout) when the ring stayed full, or the proxy's error when
  // the ring is broken.
  uint64_t push(int i, const Command& c, double timeout_seconds = 60);
  // Waits until every command published so far on every ring is complete (executed or rejected).
  // Throws the proxy's error if it failed, kTimeout after `timeout_seconds`.
  void drain(double timeout_seconds = 60);

  // Executes what is already published, then stops the threads; later pushes return kBroken.
  void stop();
  // Throws the first error (malformed command, transport failure), if any.
  void check() const;
  ProxyStats stats() const;

 private:
  void run(int i);
  void reject(int ring, uint64_t ticket, const std::string& why);
  void fail(const Error& error);
  void throw_if_failed() const;

  Transport& transport_;
  ProxyOptions options_;
  std::vector<std::unique_ptr<RingStorage>> rings_;
  std::unique_ptr<detail::SendLedger> ledger_;
  std::vector<std::thread> threads_;
  std::atomic<bool> stop_{false};
  std::atomic<bool> failed_{false};

  mutable std::mutex mutex_;  // guards error_ and the stats
  std::optional<Error> error_;
  ProxyStats stats_;
};

}  // namespace mk::transport
