// Internal: how tools/mkrun and the ranks it starts talk (the rank side is in bootstrap.cpp).
//
// mkrun gives every rank its own connected AF_UNIX SOCK_STREAM socket (descriptor number in
// MKERNEL_LAUNCHER_FD). An allgather is one round trip on it:
//
//   rank  -> mkrun : Header{kAllgather, bytes = B}   + B bytes (this rank's contribution)
//   mkrun -> rank  : Header{kResult, bytes = N * B}  + the N contributions in rank order
//               or : Header{kError, bytes = L}       + L bytes of text saying why it failed
//
// mkrun answers once every rank's request has arrived (kError when the byte counts differ, or when
// a rank closed its connection before joining). A rank sends its next request only after the answer
// to its previous one, so mkrun holds at most one request per rank. Both ends run on one host:
// integers travel in native byte order.
#pragma once

#include <cstdint>
#include <type_traits>

namespace mk::detail::launcher {

// Environment mkrun sets for each rank.
inline constexpr const char* kRankEnv = "MKERNEL_RANK";
inline constexpr const char* kWorldSizeEnv = "MKERNEL_WORLD_SIZE";
inline constexpr const char* kLocalRankEnv = "MKERNEL_LOCAL_RANK";
inline constexpr const char* kFdEnv = "MKERNEL_LAUNCHER_FD";

inline constexpr uint32_t kMagic = 0x6e726b6d;  // "mkrn"

enum class MessageKind : uint32_t { kAllgather = 1, kResult = 2, kError = 3 };

struct Header {
  uint32_t magic = kMagic;
  MessageKind kind = MessageKind::kAllgather;
  uint64_t bytes = 0;  // payload bytes that follow the header
};
static_assert(std::is_trivially_copyable_v<Header> && sizeof(Header) == 16);

// Largest contribution of one rank to one allgather, and largest error text. Anything larger is
// taken as a corrupt stream (the bootstrap carries small metadata, not tensors).
inline constexpr uint64_t kMaxRankBytes = uint64_t{1} << 30;
inline constexpr uint64_t kMaxErrorBytes = uint64_t{1} << 16;

}  // namespace mk::detail::launcher
