// Completion accounting (completion.h) and the host signal pad (transport.h).
#include "transport/completion.h"

#include <algorithm>
#include <chrono>
#include <cinttypes>
#include <cstdio>
#include <cstring>
#include <thread>

namespace mk::transport {
namespace detail {

// ---- SendLedger -------------------------------------------------------------------------------

SendLedger::SendLedger(uint32_t world_size, uint32_t num_signals)
    : world_size_(world_size),
      num_signals_(num_signals),
      totals_(new std::atomic<uint64_t>[static_cast<std::size_t>(world_size) * num_signals]) {
  for (std::size_t i = 0; i < static_cast<std::size_t>(world_size) * num_signals; ++i) {
    totals_[i].store(0, std::memory_order_relaxed);
  }
}

std::size_t SendLedger::index(uint32_t dst_rank, uint32_t signal) const {
  if (dst_rank >= world_size_ || signal >= num_signals_) {
    throw Error(ErrorCode::kInternal, "send ledger: (rank " + std::to_string(dst_rank) +
                                          ", signal " + std::to_string(signal) +
                                          ") out of range; world " + std::to_string(world_size_) +
                                          ", " + std::to_string(num_signals_) + " signals");
  }
  return static_cast<std::size_t>(dst_rank) * num_signals_ + signal;
}

uint64_t SendLedger::add(uint32_t dst_rank, uint32_t signal, uint64_t bytes) {
  return totals_[index(dst_rank, signal)].fetch_add(bytes, std::memory_order_acq_rel) + bytes;
}

uint64_t SendLedger::total(uint32_t dst_rank, uint32_t signal) const {
  return totals_[index(dst_rank, signal)].load(std::memory_order_acquire);
}

// ---- CompletionTracker ------------------------------------------------------------------------

CompletionTracker::CompletionTracker(uint32_t world_size, uint32_t num_signals, SignalSink& sink)
    : world_size_(world_size), num_signals_(num_signals), sink_(sink) {}

void CompletionTracker::check_range(uint32_t src_rank, uint32_t signal, const char* what) const {
  if (src_rank >= world_size_ || signal >= num_signals_) {
    throw Error(ErrorCode::kInvalidArgument,
                std::string("completion tracker: ") + what + " for rank " +
                    std::to_string(src_rank) + ", signal " + std::to_string(signal) +
                    " is out of range; world " + std::to_string(world_size_) + ", " +
                    std::to_string(num_signals_) + " signals");
  }
}

CompletionTracker::Stripe& CompletionTracker::stripe(uint32_t src_rank, uint32_t signal) const {
  return stripes_[(src_rank * 31u + signal) % kStripes];
}

void CompletionTracker::add_bytes(uint32_t src_rank, uint32_t signal, uint64_t bytes) {
  check_range(src_rank, signal, "arrival");
  Stripe& s = stripe(src_rank, signal);
  std::lock_guard<std::mutex> lock(s.mutex);
  Entry& entry = s.entries[(static_cast<uint64_t>(src_rank) << 32) | signal];
  entry.arrived += bytes;
  if (!entry.pending.empty()) release(src_rank, signal, entry);
}

void CompletionTracker::add_signal(uint32_t src_rank, uint32_t signal, uint64_t target,
                                   uint64_t value) {
  check_range(src_rank, signal, "signal");
  Stripe& s = stripe(src_rank, signal);
  std::lock_guard<std::mutex> lock(s.mutex);
  Entry& entry = s.entries[(static_cast<uint64_t>(src_rank) << 32) | signal];
  entry.pending.push_back({target, value});
  release(src_rank, signal, entry);
}

void CompletionTracker::release(uint32_t src_rank, uint32_t signal, Entry& entry) {
  bool any = false;
  uint64_t best = 0;
  auto satisfied = [&](const Pending& p) {
    if (p.target > entry.arrived) return false;
    if (!any || later(p.value, best)) best = p.value;
    any = true;
    return true;
  };
  entry.pending.erase(std::remove_if(entry.pending.begin(), entry.pending.end(), satisfied),
                      entry.pending.end());
  if (any && (!entry.has_raised || later(best, entry.raised))) {
    entry.raised = best;
    entry.has_raised = true;
    sink_.raise(src_rank, signal, best);
  }
}

uint64_t CompletionTracker::arrived(uint32_t src_rank, uint32_t signal) const {
  check_range(src_rank, signal, "query");
  Stripe& s = stripe(src_rank, signal);
  std::lock_guard<std::mutex> lock(s.mutex);
  auto it = s.entries.find((static_cast<uint64_t>(src_rank) << 32) | signal);
  return it == s.entries.end() ? 0 : it->second.arrived;
}

std::size_t CompletionTracker::pending() const {
  std::size_t n = 0;
  for (const Stripe& s : stripes_) {
    std::lock_guard<std::mutex> lock(s.mutex);
    for (const auto& [key, entry] : s.entries) n += entry.pending.size();
  }
  return n;
}

std::string CompletionTracker::describe_pending(std::size_t max) const {
  std::string out;
  std::size_t shown = 0, total = 0;
  for (const Stripe& s : stripes_) {
    std::lock_guard<std::mutex> lock(s.mutex);
    for (const auto& [key, entry] : s.entries) {
      for (const Pending& p : entry.pending) {
        if (shown++ < max) {
          char text[160];
          std::snprintf(text, sizeof(text),
                        "%srank %u signal %u = 0x%" PRIx64 " waits for %" PRIu64 " more bytes",
                        out.empty() ? "" : "; ", static_cast<unsigned>(key >> 32),
                        static_cast<unsigned>(key & 0xFFFFFFFFu), p.value,
                        p.target - entry.arrived);
          out += text;
        }
        ++total;
      }
    }
  }
  if (total > max) out += "; and " + std::to_string(total - max) + " more";
  return out;
}

}  // namespace detail

// ---- HostSignalPad ----------------------------------------------------------------------------

HostSignalPad::HostSignalPad(uint32_t world_size, uint32_t num_signals, RingAllocator memory)
    : world_size_(world_size), num_signals_(num_signals), memory_(std::move(memory)) {
  const std::size_t bytes = static_cast<std::size_t>(world_size) * num_signals * sizeof(uint64_t);
  if (!memory_.alloc) {
    memory_.alloc = [](std::size_t n) { return static_cast<void*>(new uint64_t[n / 8]); };
    memory_.free = [](void* p) { delete[] static_cast<uint64_t*>(p); };
  }
  words_ = static_cast<uint64_t*>(memory_.alloc(std::max<std::size_t>(bytes, 8)));
  if (words_ == nullptr) {
    throw Error(ErrorCode::kOutOfMemory,
                "host signal pad: no memory for " + std::to_string(bytes) + " bytes");
  }
  std::memset(words_, 0, bytes);
}

HostSignalPad::~HostSignalPad() {
  if (memory_.free) memory_.free(words_);
}

void HostSignalPad::raise(uint32_t src_rank, uint32_t signal, uint64_t value) {
  if (src_rank >= world_size_ || signal >= num_signals_) {
    throw Error(ErrorCode::kInternal, "host signal pad: raise of (rank " +
                                          std::to_string(src_rank) + ", signal " +
                                          std::to_string(signal) + ") out of range");
  }
  std::atomic_ref<uint64_t> word(words_[static_cast<std::size_t>(signal) * world_size_ + src_rank]);
  uint64_t seen = word.load(std::memory_order_relaxed);
  while (detail::later(value, seen) &&
         !word.compare_exchange_weak(seen, value, std::memory_order_release,
                                     std::memory_order_relaxed)) {
  }
}

uint64_t HostSignalPad::load(uint32_t src_rank, uint32_t signal) const {
  std::atomic_ref<uint64_t> word(words_[static_cast<std::size_t>(signal) * world_size_ + src_rank]);
  return word.load(std::memory_order_acquire);
}

bool HostSignalPad::wait(uint32_t src_rank, uint32_t signal, uint64_t value, double timeout_seconds,
                         const std::function<void()>& poll) const {
  using Clock = std::chrono::steady_clock;
  const auto start = Clock::now();
  auto next_poll = start;
  for (uint64_t spins = 0;; ++spins) {
    if (!detail::later(value, load(src_rank, signal))) return true;
    if (spins < 64) continue;
    const auto now = Clock::now();
    if (now >= next_poll) {
      if (poll) poll();
      next_poll = now + std::chrono::milliseconds(1);
    }
    if (std::chrono::duration<double>(now - start).count() > timeout_seconds) {
      return !detail::later(value, load(src_rank, signal));
    }
    std::this_thread::sleep_for(std::chrono::microseconds(spins < 1024 ? 5 : 50));
  }
}

}  // namespace mk::transport
