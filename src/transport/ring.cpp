// RingStorage: the memory behind a CommandRing.
#include "mkernel/transport/ring.h"

#include <cstdlib>
#include <cstring>
#include <string>

#include "mkernel/error.h"

namespace mk::transport {
namespace {

constexpr std::size_t kLine = 64;
constexpr std::size_t kControlBytes = 4 * kLine;  // head, tail, done, broken: one line each
constexpr uint64_t kMaxCapacity = uint64_t{1} << 24;

}  // namespace

RingStorage::RingStorage(uint64_t capacity, uint64_t first_ticket, RingAllocator allocator)
    : allocator_(std::move(allocator)) {
  if (capacity < 2 || capacity > kMaxCapacity || (capacity & (capacity - 1)) != 0) {
    throw Error(ErrorCode::kInvalidArgument, "command ring capacity " + std::to_string(capacity) +
                                                 " is not valid; expected a power of two in [2, " +
                                                 std::to_string(kMaxCapacity) + "]");
  }
  const std::size_t bytes = kControlBytes + capacity * sizeof(Command);
  if (!allocator_.alloc) {
    allocator_.alloc = [](std::size_t n) { return std::aligned_alloc(kLine, n); };
    allocator_.free = [](void* p) { std::free(p); };
  }
  memory_ = allocator_.alloc(bytes);
  if (memory_ == nullptr) {
    throw Error(ErrorCode::kOutOfMemory, "command ring: could not allocate " +
                                             std::to_string(bytes) + " bytes for " +
                                             std::to_string(capacity) + " slots");
  }
  std::memset(memory_, 0, bytes);
  char* base = static_cast<char*>(memory_);
  ring_.head = reinterpret_cast<uint64_t*>(base);
  ring_.tail = reinterpret_cast<uint64_t*>(base + kLine);
  ring_.done = reinterpret_cast<uint64_t*>(base + 2 * kLine);
  ring_.broken = reinterpret_cast<uint64_t*>(base + 3 * kLine);
  ring_.slots = reinterpret_cast<Command*>(base + kControlBytes);
  ring_.capacity = capacity;
  *ring_.head = *ring_.tail = *ring_.done = first_ticket;
  // Each slot holds the sequence word of the last ticket that used it before first_ticket.
  for (uint64_t t = first_ticket >= capacity ? first_ticket - capacity : 0; t < first_ticket; ++t) {
    ring_.slots[t & (capacity - 1)].seq = t + 1;
  }
}

RingStorage::~RingStorage() {
  if (memory_ != nullptr) allocator_.free(memory_);
}

}  // namespace mk::transport
