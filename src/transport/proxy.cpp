// Proxy: one consumer thread per command ring (see mkernel/transport/proxy.h).
#include "mkernel/transport/proxy.h"

#include <chrono>
#include <exception>
#include <optional>
#include <string>

#include "transport/completion.h"
#include "transport/transport_base.h"

namespace mk::transport {
namespace {

// Idle consumer: poll hot for a while, then yield, then sleep briefly between polls.
void idle_wait(uint32_t idle) {
  if (idle < 256) return;
  if (idle < 1024) {
    std::this_thread::yield();
  } else {
    std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
}

std::string ring_name(int i) { return "proxy ring " + std::to_string(i); }

}  // namespace

Proxy::Proxy(Transport& transport, ProxyOptions options)
    : transport_(transport), options_(std::move(options)) {
  if (options_.num_rings < 1 || options_.num_rings > 256) {
    throw Error(ErrorCode::kInvalidArgument, "Proxy: num_rings " +
                                                 std::to_string(options_.num_rings) +
                                                 " is not valid; expected 1 .. 256");
  }
  if (options_.max_batch < 1 || options_.max_batch > 4096) {
    throw Error(ErrorCode::kInvalidArgument, "Proxy: max_batch " +
                                                 std::to_string(options_.max_batch) +
                                                 " is not valid; expected 1 .. 4096");
  }
  const CommandLimits limits = transport_.limits();
  ledger_ = std::make_unique<detail::SendLedger>(limits.world_size, limits.num_signals);
  for (int i = 0; i < options_.num_rings; ++i) {
    rings_.push_back(std::make_unique<RingStorage>(options_.ring_capacity, 0, options_.allocator));
  }
  for (int i = 0; i < options_.num_rings; ++i) threads_.emplace_back([this, i] { run(i); });
}

Proxy::~Proxy() { stop(); }

const CommandRing& Proxy::ring(int i) const {
  if (i < 0 || i >= num_rings()) {
    throw Error(ErrorCode::kInvalidArgument, "Proxy::ring: index " + std::to_string(i) +
                                                 " is out of range; the proxy has " +
                                                 std::to_string(num_rings()) + " rings");
  }
  return rings_[i]->ring();
}

uint64_t Proxy::push(int i, const Command& c, double timeout_seconds) {
  const CommandRing& r = ring(i);
  const PushResult result = r.push(c, HostWait(timeout_seconds));
  if (result.status == PushStatus::kOk) return result.ticket;
  throw_if_failed();
  if (result.status == PushStatus::kTimedOut) {
    throw Error(ErrorCode::kTimeout, ring_name(i) + ": no free slot within " +
                                         std::to_string(timeout_seconds) + " s at ticket " +
                                         std::to_string(result.ticket) +
                                         " (is the proxy running?); the ring is now broken");
  }
  const RingBroken why = r.broken_reason();
  throw Error(ErrorCode::kNotInitialized,
              ring_name(i) + " is closed: " +
                  (why == RingBroken::kStopped          ? "the proxy was stopped"
                   : why == RingBroken::kProducerGaveUp ? "a producer gave up waiting for space"
                   : why == RingBroken::kCorrupt        ? "its memory was overwritten"
                                                        : "the proxy failed"));
}

void Proxy::drain(double timeout_seconds) {
  const auto deadline = std::chrono::steady_clock::now() +
                        std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                            std::chrono::duration<double>(timeout_seconds));
  for (int i = 0; i < num_rings(); ++i) {
    const CommandRing& r = rings_[i]->ring();
    const uint64_t issued = r.issued();
    while (r.completed() < issued) {
      if (r.broken_reason() != RingBroken::kNo) throw_if_failed();  // its consumer has stopped
      if (std::chrono::steady_clock::now() >= deadline) {
        throw Error(ErrorCode::kTimeout,
                    ring_name(i) + ": " + std::to_string(issued - r.completed()) +
                        " commands not complete after " + std::to_string(timeout_seconds) +
                        " s (completed " + std::to_string(r.completed()) + " of " +
                        std::to_string(issued) + ")");
      }
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  }
  throw_if_failed();
}

void Proxy::stop() {
  stop_.store(true, std::memory_order_release);
  for (std::thread& t : threads_) {
    if (t.joinable()) t.join();
  }
  for (auto& r : rings_) r->ring().mark_broken(RingBroken::kStopped);
}

void Proxy::check() const {
  throw_if_failed();
  transport_.check();
}

ProxyStats Proxy::stats() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return stats_;
}

void Proxy::throw_if_failed() const {
  std::lock_guard<std::mutex> lock(mutex_);
  if (error_) throw *error_;
}

void Proxy::fail(const Error& error) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (error_) return;
    error_.emplace(error);
  }
  failed_.store(true, std::memory_order_release);
  if (options_.on_error) options_.on_error(error);
}

void Proxy::reject(int ring, uint64_t ticket, const std::string& why) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    ++stats_.rejected;
  }
  fail(
      Error(ErrorCode::kInvalidArgument, ring_name(ring) + ", ticket " + std::to_string(ticket) +
                                             ": malformed command rejected, not executed: " + why));
}

void Proxy::run(int i) {
  const CommandRing r = rings_[i]->ring();
  std::vector<Command> batch(options_.max_batch);
  std::vector<TransferOp> ops;
  ops.reserve(2 * options_.max_batch);
  for (uint32_t idle = 0;; ++idle) {
    if (failed_.load(std::memory_order_acquire) &&
        r.broken_reason() == RingBroken::kConsumerFailed) {
      return;
    }
    const uint64_t first = r.consumed();
    RingFault fault;
    const uint32_t n = r.poll(batch.data(), options_.max_batch, &fault);
    if (n == 0) {
      const RingBroken broken = r.broken_reason();
      if (broken == RingBroken::kCorrupt) {
        fail(Error(ErrorCode::kInternal,
                   ring_name(i) + ": the slot of ticket " + std::to_string(fault.ticket) +
                       " holds sequence word " + std::to_string(fault.seq) + "; expected " +
                       std::to_string(fault.ticket + 1) + " or the previous lap's value; " +
                       "something other than a producer wrote into the ring"));
        return;
      }
      if (broken == RingBroken::kProducerGaveUp) {
        fail(Error(ErrorCode::kTimeout,
                   ring_name(i) + ": a producer gave up waiting for a free slot (ticket >= " +
                       std::to_string(first) + "); the ring is broken"));
        return;
      }
      if (stop_.load(std::memory_order_acquire)) return;  // everything published was executed
      idle_wait(idle);
      continue;
    }
    idle = 0;

    const CommandLimits limits = transport_.limits();
    ops.clear();
    ProxyStats delta;
    delta.commands = n;
    for (uint32_t k = 0; k < n; ++k) {
      const Command& c = batch[k];
      std::string why = validate(c, limits);
      if (why.empty() && !transport_.is_peer(static_cast<int>(c.dst_rank))) {
        why = "rank " + std::to_string(c.dst_rank) + " is not a peer of the transport";
      }
      if (!why.empty()) {
        reject(i, first + k, why);
        continue;
      }
      const auto type = static_cast<CommandType>(c.type);
      if (type != CommandType::kSignal) {
        TransferOp put;
        put.kind = TransferOp::Kind::kPut;
        put.src_buffer = c.src_buffer;
        put.dst_buffer = c.dst_buffer;
        put.dst_rank = c.dst_rank;
        put.signal_id = c.signal_id;
        put.src_offset = c.src_offset;
        put.dst_offset = c.dst_offset;
        put.bytes = c.bytes;
        put.tile_id = c.tile_id;
        ops.push_back(put);
        if (c.signal_id != kNoSignal) ledger_->add(c.dst_rank, c.signal_id, c.bytes);
        ++delta.puts;
        delta.bytes += c.bytes;
      }
      if (type != CommandType::kPut) {
        TransferOp sig;
        sig.kind = TransferOp::Kind::kSignal;
        sig.dst_rank = c.dst_rank;
        sig.signal_id = c.signal_id;
        sig.target = ledger_->total(c.dst_rank, c.signal_id);
        sig.value = c.signal_value;
        sig.tile_id = c.tile_id;
        ops.push_back(sig);
        ++delta.signals;
      }
    }
    // Nothing may leave this thread: an exception escaping it would end the process.
    std::optional<Error> failure;
    try {
      if (!ops.empty()) transport_.post(ops);
    } catch (const Error& e) {
      failure.emplace(e.code(), ring_name(i) + ": " + detail::message_of(e));
    } catch (const std::exception& e) {  // e.g. a user's copy hook, std::bad_alloc
      failure.emplace(ErrorCode::kInternal, ring_name(i) + ": post failed: " + e.what());
    } catch (...) {
      failure.emplace(ErrorCode::kInternal, ring_name(i) + ": post failed: unknown exception");
    }
    if (failure) {
      fail(*failure);
      for (auto& other : rings_) other->ring().mark_broken(RingBroken::kConsumerFailed);
      return;
    }
    r.complete(first + n);
    std::lock_guard<std::mutex> lock(mutex_);
    stats_.commands += delta.commands;
    stats_.puts += delta.puts;
    stats_.signals += delta.signals;
    stats_.bytes += delta.bytes;
    stats_.batches += ops.empty() ? 0 : 1;
  }
}

}  // namespace mk::transport
