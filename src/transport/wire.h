// Internal: what travels between ranks, shared by the backends - chunking of large puts, the
// RDMA immediate word, the signal message and the socket stream's message header.
#pragma once

#include <cstdint>
#include <cstring>
#include <string>

#include "mkernel/transport/command.h"

namespace mk::transport::detail {

// ---- chunks -----------------------------------------------------------------------------------
// A put larger than a backend's largest message (socket: 4 MiB so that senders interleave; cx7:
// the port's max_msg_sz; efa: max_rdma_size) goes out as consecutive chunks. Each chunk is
// counted on the put's signal by its own bytes when it lands, so chunks may land in any order.

struct Chunk {
  uint64_t src_offset;
  uint64_t dst_offset;
  uint64_t bytes;
};

constexpr uint64_t chunk_count(uint64_t bytes, uint64_t max_chunk) {
  return bytes / max_chunk + (bytes % max_chunk != 0 ? 1 : 0);
}

// Chunk `i` (< chunk_count) of the put [src_offset, +bytes) -> [dst_offset, +bytes).
constexpr Chunk chunk_at(uint64_t src_offset, uint64_t dst_offset, uint64_t bytes,
                         uint64_t max_chunk, uint64_t i) {
  const uint64_t start = i * max_chunk;
  const uint64_t left = bytes - start;
  return Chunk{src_offset + start, dst_offset + start, left < max_chunk ? left : max_chunk};
}

// ---- RDMA immediate ---------------------------------------------------------------------------
// A write-with-immediate carries who wrote and which signal its bytes count on; the receiver's
// completion carries the byte count. 20 bits of rank (up to 1,048,575 ranks), 12 bits of signal
// (up to 4094 signals; 0xFFF = not counted).

constexpr uint32_t kImmSignalBits = 12;
constexpr uint32_t kImmNoSignal = (1u << kImmSignalBits) - 1;
constexpr uint32_t kImmMaxRanks = 1u << (32 - kImmSignalBits);
constexpr uint32_t kImmMaxSignals = kImmNoSignal;  // signal ids 0 .. kImmNoSignal - 1

constexpr uint32_t encode_imm(uint32_t src_rank, uint32_t signal) {
  return (src_rank << kImmSignalBits) | (signal == kNoSignal ? kImmNoSignal : signal);
}

struct ImmFields {
  uint32_t src_rank;
  uint32_t signal;  // kNoSignal when not counted
};

constexpr ImmFields decode_imm(uint32_t imm) {
  const uint32_t signal = imm & kImmNoSignal;
  return ImmFields{imm >> kImmSignalBits, signal == kImmNoSignal ? kNoSignal : signal};
}

// ---- signal message ---------------------------------------------------------------------------
// RDMA backends send it as a small SEND (inline); the socket stream carries it in its header.

struct SignalMessage {
  uint32_t magic;  // kSignalMagic
  uint32_t signal;
  uint32_t src_rank;  // the sender (an SRD queue pair receives from every peer)
  uint32_t reserved;
  uint64_t target;  // raise once this many bytes counted on (sender, signal) have landed
  uint64_t value;
  uint64_t tile_id;  // diagnostics
};
static_assert(sizeof(SignalMessage) == 40);
constexpr uint32_t kSignalMagic = 0x4D4B5347;  // "MKSG"

// ---- socket stream ----------------------------------------------------------------------------
// Every message on a connection starts with this header; a put's payload (`bytes`) follows it.

enum class WireKind : uint32_t { kPut = 1, kSignal = 2, kBye = 3 };

struct WireHeader {
  uint32_t kind;    // WireKind
  uint32_t signal;  // put: counted on it (kNoSignal: not counted); signal: which
  uint64_t tile_id;
  uint64_t dst_offset;  // put
  uint64_t bytes;       // put: payload bytes that follow
  uint64_t target;      // signal
  uint64_t value;       // signal
  uint8_t dst_buffer;   // put
  uint8_t reserved[7];
};
static_assert(sizeof(WireHeader) == 56);

// The first bytes on a new connection, from the connecting rank.
struct WireHello {
  uint64_t magic;    // kHelloMagic
  uint32_t version;  // kWireVersion
  uint32_t src_rank;
  uint32_t world_size;
  uint32_t reserved;
  uint64_t session;  // the acceptor's session nonce, read from its published address
};
constexpr uint64_t kHelloMagic = 0x4D4B45524E454C54ull;  // "MKERNELT"
constexpr uint32_t kWireVersion = 1;

}  // namespace mk::transport::detail
