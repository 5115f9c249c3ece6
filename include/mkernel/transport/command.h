// mkernel/transport/command.h - the inter-node command: what a kernel asks the proxy to do.
//
// A kernel that needs bytes on another node writes a Command into a CommandRing (ring.h); a host
// proxy thread reads it, checks it against the registered buffers (validate / check_command) and
// hands it to the transport. One command is one 64-byte slot (one cache line, one PCIe write
// burst from the GPU):
//
//   byte  0  src_offset    u64  byte offset into this rank's registered buffer `src_buffer`
//         8  dst_offset    u64  byte offset into `dst_rank`'s registered buffer `dst_buffer`
//        16  bytes         u64  bytes to move (put, put+signal); 0 for signal-only
//        24  signal_value  u64  value the signal is raised to (values only grow, see launch.cuh)
//        32  tile_id       u64  the kernel's tile / chunk number (diagnostics, RDMA immediates)
//        40  dst_rank      u32  destination rank (global)
//        44  signal_id     u32  signal slot at dst_rank (kNoSignal: a put that no signal covers)
//        48  type          u8   CommandType
//        49  src_buffer    u8   registered buffer id (< kMaxBuffers)
//        50  dst_buffer    u8
//        51  flags         u8   must be 0 (reserved)
//        52  check         u32  command_check() of bytes 0-51: catches garbage and torn writes
//        56  seq           u64  ring sequence word, written last with release (ticket + 1)
//
// Everything is 64-bit where it can grow with the problem: offsets and sizes are bytes, tile ids
// count tiles across all ranks (the original's 16-bit ids / 32-bit offsets overflowed at 3+ nodes).
//
// Completion semantics (see docs/TRANSPORT.md): a put carrying signal s counts its bytes on
// (this rank, s) at the destination when they have landed; a signal raises (this rank, s) at the
// destination to `signal_value` once every byte counted on (this rank, s) by puts this rank issued
// before it has landed. No ordering between different writes is assumed.
//
// Usable from device code: every function is constexpr and __host__ __device__ under nvcc.
#pragma once

#include <cstddef>
#include <cstdint>

#include "mkernel/host_device.h"

namespace mk::transport {

constexpr uint32_t kNoSignal = 0xFFFFFFFFu;  // signal_id of a put that no signal covers
constexpr int kMaxBuffers = 16;              // registered buffer ids are 0 .. kMaxBuffers - 1

enum class CommandType : uint8_t {
  kInvalid = 0,    // zeroed memory is never a command
  kPut = 1,        // move bytes; counted on signal_id at the destination unless kNoSignal
  kPutSignal = 2,  // move bytes counted on signal_id, then raise signal_id to signal_value
  kSignal = 3,     // raise signal_id to signal_value once earlier puts counted on it landed
};
constexpr uint8_t kNumCommandTypes = 4;

struct alignas(64) Command {
  uint64_t src_offset;
  uint64_t dst_offset;
  uint64_t bytes;
  uint64_t signal_value;
  uint64_t tile_id;
  uint32_t dst_rank;
  uint32_t signal_id;
  uint8_t type;
  uint8_t src_buffer;
  uint8_t dst_buffer;
  uint8_t flags;
  uint32_t check;
  uint64_t seq;
};
static_assert(sizeof(Command) == 64, "a command is one 64-byte slot");
static_assert(offsetof(Command, dst_rank) == 40 && offsetof(Command, type) == 48 &&
                  offsetof(Command, check) == 52 && offsetof(Command, seq) == 56,
              "the layout above is the wire format between GPU producers and host proxies");

namespace detail {
MK_HOST_DEVICE constexpr uint64_t mix64(uint64_t h, uint64_t x) {
  h ^= x + 0x9E3779B97F4A7C15ull + (h << 6) + (h >> 2);
  h *= 0xFF51AFD7ED558CCDull;
  return h ^ (h >> 33);
}
}  // namespace detail

// Check word over bytes 0-51 (everything but `check` and `seq`).
MK_HOST_DEVICE constexpr uint32_t command_check(const Command& c) {
  uint64_t h = 0x6D6B65726E656C31ull;  // "mkernel1"
  h = detail::mix64(h, c.src_offset);
  h = detail::mix64(h, c.dst_offset);
  h = detail::mix64(h, c.bytes);
  h = detail::mix64(h, c.signal_value);
  h = detail::mix64(h, c.tile_id);
  h = detail::mix64(h, (static_cast<uint64_t>(c.dst_rank) << 32) | c.signal_id);
  h = detail::mix64(h, static_cast<uint64_t>(c.type) | (static_cast<uint64_t>(c.src_buffer) << 8) |
                           (static_cast<uint64_t>(c.dst_buffer) << 16) |
                           (static_cast<uint64_t>(c.flags) << 24));
  return static_cast<uint32_t>(h ^ (h >> 32));
}

MK_HOST_DEVICE constexpr Command sealed(const Command& in) {
  Command c = in;
  c.check = command_check(c);
  c.seq = 0;
  return c;
}

// ---- encoding ---------------------------------------------------------------------------------

// Put `bytes` from [src_offset, +bytes) of this rank's buffer `src_buffer` to [dst_offset, +bytes)
// of dst_rank's buffer `dst_buffer`; counted on `signal_id` at dst_rank unless kNoSignal.
MK_HOST_DEVICE constexpr Command make_put(uint32_t dst_rank, uint64_t tile_id, uint8_t src_buffer,
                                          uint64_t src_offset, uint8_t dst_buffer,
                                          uint64_t dst_offset, uint64_t bytes,
                                          uint32_t signal_id = kNoSignal) {
  return sealed(Command{src_offset, dst_offset, bytes, 0, tile_id, dst_rank, signal_id,
                        static_cast<uint8_t>(CommandType::kPut), src_buffer, dst_buffer, 0, 0, 0});
}

// The put above, counted on `signal_id`, then `signal_id` raised to `value` at dst_rank.
MK_HOST_DEVICE constexpr Command make_put_signal(uint32_t dst_rank, uint64_t tile_id,
                                                 uint8_t src_buffer, uint64_t src_offset,
                                                 uint8_t dst_buffer, uint64_t dst_offset,
                                                 uint64_t bytes, uint32_t signal_id,
                                                 uint64_t value) {
  return sealed(Command{src_offset, dst_offset, bytes, value, tile_id, dst_rank, signal_id,
                        static_cast<uint8_t>(CommandType::kPutSignal), src_buffer, dst_buffer, 0, 0,
                        0});
}

// Raise `signal_id` at dst_rank to `value` once the puts this rank counted on it have landed.
MK_HOST_DEVICE constexpr Command make_signal(uint32_t dst_rank, uint64_t tile_id,
                                             uint32_t signal_id, uint64_t value) {
  return sealed(Command{0, 0, 0, value, tile_id, dst_rank, signal_id,
                        static_cast<uint8_t>(CommandType::kSignal), 0, 0, 0, 0, 0});
}

// ---- validation -------------------------------------------------------------------------------

// What a command is checked against: this rank, the world and the registered symmetric buffers
// (equal size on every rank, so one size serves as source and destination limit).
struct CommandLimits {
  uint32_t rank = 0;
  uint32_t world_size = 0;
  uint32_t num_signals = 0;
  uint32_t reserved = 0;
  uint64_t buffer_bytes[kMaxBuffers] = {};  // 0 = no buffer registered under that id
};

enum class CommandError : uint8_t {
  kOk = 0,                 // valid
  kBadCheck,               // check word mismatch: torn, corrupted, not from make_*
  kUnknownType,            // type is not put, put+signal or signal
  kBadFlags,               // reserved bits set
  kRankOutOfRange,         // dst_rank >= world_size
  kRankIsSelf,             // dst_rank == this rank: local copies never go through the proxy
  kSrcBufferUnregistered,  // src_buffer >= kMaxBuffers or nothing registered under it
  kDstBufferUnregistered,  // the same for dst_buffer
  kSrcOutOfRange,          // src_offset + bytes beyond the source buffer
  kDstOutOfRange,          // dst_offset + bytes beyond the destination buffer
  kZeroBytes,              // a put of 0 bytes
  kBytesOnSignal,          // a signal-only command with bytes or offsets set
  kSignalOutOfRange,       // signal_id >= num_signals (and not kNoSignal on a plain put)
  kSignalMissing,          // put+signal / signal with kNoSignal
};

namespace detail {
MK_HOST_DEVICE constexpr bool range_ok(uint64_t offset, uint64_t bytes, uint64_t size) {
  return offset <= size && bytes <= size - offset;  // no overflow for any 64-bit values
}
}  // namespace detail

// First problem found in `c`, or kOk. Pure, so producers may check before pushing as well.
MK_HOST_DEVICE constexpr CommandError check_command(const Command& c, const CommandLimits& l) {
  if (c.check != command_check(c)) return CommandError::kBadCheck;
  if (c.type == 0 || c.type >= kNumCommandTypes) return CommandError::kUnknownType;
  if (c.flags != 0) return CommandError::kBadFlags;
  if (c.dst_rank >= l.world_size) return CommandError::kRankOutOfRange;
  if (c.dst_rank == l.rank) return CommandError::kRankIsSelf;
  const auto type = static_cast<CommandType>(c.type);
  if (type != CommandType::kPut && c.signal_id == kNoSignal) return CommandError::kSignalMissing;
  if (c.signal_id != kNoSignal && c.signal_id >= l.num_signals) {
    return CommandError::kSignalOutOfRange;
  }
  if (type == CommandType::kSignal) {
    const bool empty = c.bytes == 0 && c.src_offset == 0 && c.dst_offset == 0 &&
                       c.src_buffer == 0 && c.dst_buffer == 0;
    return empty ? CommandError::kOk : CommandError::kBytesOnSignal;
  }
  if (c.src_buffer >= kMaxBuffers || l.buffer_bytes[c.src_buffer] == 0) {
    return CommandError::kSrcBufferUnregistered;
  }
  if (c.dst_buffer >= kMaxBuffers || l.buffer_bytes[c.dst_buffer] == 0) {
    return CommandError::kDstBufferUnregistered;
  }
  if (c.bytes == 0) return CommandError::kZeroBytes;
  if (!detail::range_ok(c.src_offset, c.bytes, l.buffer_bytes[c.src_buffer])) {
    return CommandError::kSrcOutOfRange;
  }
  if (!detail::range_ok(c.dst_offset, c.bytes, l.buffer_bytes[c.dst_buffer])) {
    return CommandError::kDstOutOfRange;
  }
  return CommandError::kOk;
}

}  // namespace mk::transport

#if !defined(__CUDA_ARCH__)
#include <string>

namespace mk::transport {

const char* to_string(CommandType type);  // "put", "put+signal", "signal", "type 7"
const char* to_string(CommandError error);

// One line naming every field: "put+signal to rank 70000: tile 65537, buffer 1 @ 5368709120 ->
// buffer 2 @ 4294967296, 1048576 bytes, signal 3 = 0x100000002".
std::string describe(const Command& c);

// Empty when `c` is valid; otherwise why not, naming the command and the offending values
// ("put to rank 5 (tile 12, ...): destination rank 5 is out of range; the world has 4 ranks").
std::string validate(const Command& c, const CommandLimits& limits);

}  // namespace mk::transport
#endif
