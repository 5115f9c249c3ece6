// mkernel/transport/ring.h - the lock-free command ring between producers (GPU CTAs, or host
// threads in tests) and one proxy consumer thread.
//
//   producer p                                   consumer (proxy thread)
//   t = head.fetch_add(1)          (relaxed)     t = tail (its own position)
//   wait while t >= tail + capacity (acquire)    wait for slots[t % cap].seq == t + 1 (acquire)
//   slots[t % cap] = body (plain stores)         copy the body out
//   slots[t % cap].seq = t + 1     (release)     tail = t + 1                  (release)
//                                                ... execute ...  done = t + 1 (release)
//
// Tickets are 64-bit and never wrap in practice (2^64 commands); slot indices wrap every
// `capacity` tickets. The consumer tells a published slot from an old one by its sequence word:
// when it looks for ticket t the slot holds t + 1 (published) or t + 1 - capacity (last lap's,
// 0 on the first lap); any other value means the slot was overwritten by something that is not a
// producer, and is reported as a fault rather than executed.
//
// Placement: the words may live in different memories. For GPU producers all of them are in
// host-pinned memory mapped into the GPU (one allocation). Accesses use cuda::atomic_ref at
// system scope, so this header compiles for host and device; but a kernel does no system-scope
// read-modify-write here. A system-scope read-modify-write on mapped host memory is atomic towards
// other devices and the host only where the device reports cudaDevAttrHostNativeAtomicSupported
// (not on PCIe hosts), and compute-sanitizer's memcheck stops the kernel there (2026-12-07, an
// H100: RingNodes 2x1). So a GPU producer takes its ticket (head's fetch_add) at device scope:
// only producers read-modify-write head, and a ring's producers are all host threads (Proxy::push,
// the CPU tests) or all kernels of one GPU, never both; the host only reads head (drain). And a
// kernel marks a ring broken with a load and a store (mark_broken).
#pragma once

#include <cstdint>
#include <cuda/atomic>

#include "mkernel/transport/command.h"

namespace mk::transport {

namespace detail {
template <class T>
MK_HOST_DEVICE cuda::atomic_ref<T, cuda::thread_scope_system> sys_ref(T& word) {
  return cuda::atomic_ref<T, cuda::thread_scope_system>(word);
}
}  // namespace detail

// Why a ring stopped being usable (value of the `broken` word; 0 = usable).
enum class RingBroken : uint64_t {
  kNo = 0,
  kProducerGaveUp = 1,  // a producer holding a ticket timed out waiting for space
  kConsumerFailed = 2,  // the proxy failed (transport error) and consumes no more
  kCorrupt = 3,         // a slot held a sequence word no producer writes
  kStopped = 4,         // the proxy was stopped
};

enum class PushStatus : uint8_t { kOk, kBroken, kTimedOut };
struct PushResult {
  PushStatus status;
  uint64_t ticket;  // the ticket taken (when status != kBroken)
};

// A slot whose sequence word is neither of the values the consumer may see.
struct RingFault {
  uint64_t ticket = 0;  // the ticket the consumer expected next
  uint64_t seq = 0;     // what the slot held
};

// A view of one ring (plain pointers; copy it to producers, including kernels).
struct CommandRing {
  Command* slots = nullptr;    // [capacity]
  uint64_t* head = nullptr;    // next ticket to hand out
  uint64_t* tail = nullptr;    // tickets < tail are consumed: their slots may be reused
  uint64_t* done = nullptr;    // tickets < done are complete at the sender: sources reusable
  uint64_t* broken = nullptr;  // RingBroken
  uint64_t capacity = 0;       // power of two

  // ---- producers (any number, concurrently) ----------------------------------------------------

  // Publishes `c` (its seq is ignored). `wait(spins)` is called while the ring is full and returns
  // false to give up; a producer that gives up holds a ticket it cannot publish, so the ring is
  // marked broken (the proxy reports it) and every later push returns kBroken.
  template <class Wait>
  MK_HOST_DEVICE PushResult push(const Command& c, Wait&& wait) const {
    if (detail::sys_ref(*broken).load(cuda::std::memory_order_relaxed) != 0) {
      return {PushStatus::kBroken, 0};
    }
#if defined(__CUDA_ARCH__)
    const uint64_t t = cuda::atomic_ref<uint64_t, cuda::thread_scope_device>(*head).fetch_add(
        1, cuda::std::memory_order_relaxed);  // device scope: see the header
#else
    const uint64_t t = detail::sys_ref(*head).fetch_add(1, cuda::std::memory_order_relaxed);
#endif
    for (uint64_t spins = 0;; ++spins) {
      if (t < detail::sys_ref(*tail).load(cuda::std::memory_order_acquire) + capacity) break;
      if (detail::sys_ref(*broken).load(cuda::std::memory_order_relaxed) != 0) {
        return {PushStatus::kBroken, t};
      }
      if (!wait(spins)) {
        mark_broken(RingBroken::kProducerGaveUp);
        return {PushStatus::kTimedOut, t};
      }
    }
    Command& slot = slots[t & (capacity - 1)];
    slot.src_offset = c.src_offset;
    slot.dst_offset = c.dst_offset;
    slot.bytes = c.bytes;
    slot.signal_value = c.signal_value;
    slot.tile_id = c.tile_id;
    slot.dst_rank = c.dst_rank;
    slot.signal_id = c.signal_id;
    slot.type = c.type;
    slot.src_buffer = c.src_buffer;
    slot.dst_buffer = c.dst_buffer;
    slot.flags = c.flags;
    slot.check = c.check;
    detail::sys_ref(slot.seq).store(t + 1, cuda::std::memory_order_release);
    return {PushStatus::kOk, t};
  }

  // Tickets below this are complete at the sender (the proxy executed them, or rejected them).
  MK_HOST_DEVICE uint64_t completed() const {
    return detail::sys_ref(*done).load(cuda::std::memory_order_acquire);
  }

  MK_HOST_DEVICE RingBroken broken_reason() const {
    return static_cast<RingBroken>(detail::sys_ref(*broken).load(cuda::std::memory_order_acquire));
  }

  MK_HOST_DEVICE void mark_broken(RingBroken why) const {
#if defined(__CUDA_ARCH__)
    // No read-modify-write on the host's memory from a kernel (see the header): a load and a
    // store. A reason the host or another producer wrote in between may be replaced by this one;
    // the word never returns to 0 (no one stores 0), so the ring stays broken either way.
    if (detail::sys_ref(*broken).load(cuda::std::memory_order_acquire) == 0) {
      detail::sys_ref(*broken).store(static_cast<uint64_t>(why), cuda::std::memory_order_release);
    }
#else
    uint64_t expected = 0;
    detail::sys_ref(*broken).compare_exchange_strong(expected, static_cast<uint64_t>(why),
                                                     cuda::std::memory_order_acq_rel);
#endif
  }

  // ---- the consumer (one thread) ----------------------------------------------------------------

  // Copies up to `max` published commands, in ticket order, into `out` and frees their slots.
  // Returns how many; stops early at the first unpublished slot. When a slot holds a sequence word
  // no producer writes, stops there, fills *fault and marks the ring broken (kCorrupt).
  MK_HOST_DEVICE uint32_t poll(Command* out, uint32_t max, RingFault* fault) const {
    const uint64_t first = detail::sys_ref(*tail).load(cuda::std::memory_order_relaxed);
    uint32_t n = 0;
    for (; n < max; ++n) {
      const uint64_t t = first + n;
      Command& slot = slots[t & (capacity - 1)];
      const uint64_t seq = detail::sys_ref(slot.seq).load(cuda::std::memory_order_acquire);
      if (seq != t + 1) {
        const uint64_t previous = t >= capacity ? t + 1 - capacity : 0;
        if (seq != previous) {
          if (fault != nullptr) *fault = RingFault{t, seq};
          mark_broken(RingBroken::kCorrupt);
        }
        break;
      }
      out[n] = slot;
    }
    if (n > 0) detail::sys_ref(*tail).store(first + n, cuda::std::memory_order_release);
    return n;
  }

  // The consumer's position: the next ticket it will read.
  MK_HOST_DEVICE uint64_t consumed() const {
    return detail::sys_ref(*tail).load(cuda::std::memory_order_acquire);
  }
  // Tickets handed out so far (some may not be published yet).
  MK_HOST_DEVICE uint64_t issued() const {
    return detail::sys_ref(*head).load(cuda::std::memory_order_relaxed);
  }
  // Reports tickets < upto complete (the consumer calls it in ticket order).
  MK_HOST_DEVICE void complete(uint64_t upto) const {
    detail::sys_ref(*done).store(upto, cuda::std::memory_order_release);
  }
};

}  // namespace mk::transport

#if !defined(__CUDA_ARCH__)
#include <chrono>
#include <cstddef>
#include <functional>
#include <thread>

namespace mk::transport {

// How a RingStorage gets its memory: host memory by default; the GPU path passes cudaHostAlloc
// (mapped) and cudaFreeHost. `alloc` returns 64-byte-aligned memory or nullptr.
struct RingAllocator {
  std::function<void*(std::size_t bytes)> alloc;
  std::function<void(void*)> free;
};

// Owns the memory of one ring: four control words (one cache line each) and `capacity` slots.
// `first_ticket` starts the ring as if that many commands had passed through it (tests use it to
// run across 2^32 and beyond). Throws mk::Error(kInvalidArgument) for a capacity that is not a
// power of two in [2, 2^24], kOutOfMemory when the allocation fails.
class RingStorage {
 public:
  explicit RingStorage(uint64_t capacity, uint64_t first_ticket = 0, RingAllocator allocator = {});
  ~RingStorage();
  RingStorage(const RingStorage&) = delete;
  RingStorage& operator=(const RingStorage&) = delete;

  const CommandRing& ring() const { return ring_; }

 private:
  RingAllocator allocator_;
  void* memory_ = nullptr;
  CommandRing ring_;
};

// A producer's wait for a full ring on the host: spin briefly, then yield, then sleep; gives up
// after `seconds` (0 = never).
class HostWait {
 public:
  explicit HostWait(double seconds)
      : deadline_(seconds > 0 ? std::chrono::steady_clock::now() +
                                    std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                                        std::chrono::duration<double>(seconds))
                              : std::chrono::steady_clock::time_point::max()) {}

  bool operator()(uint64_t spins) const {
    if (spins < 64) return true;
    if ((spins & 63) == 0 && std::chrono::steady_clock::now() >= deadline_) return false;
    if (spins < 4096) {
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(std::chrono::microseconds(20));
    }
    return true;
  }

 private:
  std::chrono::steady_clock::time_point deadline_;
};

}  // namespace mk::transport
#endif
