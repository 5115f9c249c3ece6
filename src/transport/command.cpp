// Messages for commands: names, one-line descriptions and validation errors.
#include "mkernel/transport/command.h"

#include <cinttypes>
#include <cstdio>
#include <string>

namespace mk::transport {
namespace {

std::string u64(uint64_t v) { return std::to_string(v); }

std::string hex(uint64_t v) {
  char text[24];
  std::snprintf(text, sizeof(text), "0x%" PRIx64, v);
  return text;
}

std::string signal_name(uint32_t id) { return id == kNoSignal ? "none" : std::to_string(id); }

std::string buffer_limit(const CommandLimits& l, uint8_t id) {
  if (id >= kMaxBuffers) {
    return "buffer ids go up to " + std::to_string(kMaxBuffers - 1);
  }
  if (l.buffer_bytes[id] == 0) return "no buffer is registered under id " + std::to_string(id);
  return "buffer " + std::to_string(id) + " has " + u64(l.buffer_bytes[id]) + " bytes";
}

}  // namespace

const char* to_string(CommandType type) {
  switch (type) {
    case CommandType::kInvalid:
      return "invalid";
    case CommandType::kPut:
      return "put";
    case CommandType::kPutSignal:
      return "put+signal";
    case CommandType::kSignal:
      return "signal";
  }
  return "unknown type";
}

const char* to_string(CommandError error) {
  switch (error) {
    case CommandError::kOk:
      return "ok";
    case CommandError::kBadCheck:
      return "check word mismatch";
    case CommandError::kUnknownType:
      return "unknown type";
    case CommandError::kBadFlags:
      return "reserved flags set";
    case CommandError::kRankOutOfRange:
      return "rank out of range";
    case CommandError::kRankIsSelf:
      return "put to self";
    case CommandError::kSrcBufferUnregistered:
      return "source buffer not registered";
    case CommandError::kDstBufferUnregistered:
      return "destination buffer not registered";
    case CommandError::kSrcOutOfRange:
      return "source range beyond the buffer";
    case CommandError::kDstOutOfRange:
      return "destination range beyond the buffer";
    case CommandError::kZeroBytes:
      return "zero-length put";
    case CommandError::kBytesOnSignal:
      return "signal-only command with a payload";
    case CommandError::kSignalOutOfRange:
      return "signal id out of range";
    case CommandError::kSignalMissing:
      return "signal id missing";
  }
  return "unknown error";
}

std::string describe(const Command& c) {
  const bool known = c.type > 0 && c.type < kNumCommandTypes;
  std::string out =
      known ? to_string(static_cast<CommandType>(c.type)) : "type " + std::to_string(c.type);
  out += " to rank " + std::to_string(c.dst_rank) + ": tile " + u64(c.tile_id);
  if (c.type != static_cast<uint8_t>(CommandType::kSignal)) {
    out += ", buffer " + std::to_string(c.src_buffer) + " @ " + u64(c.src_offset) + " -> buffer " +
           std::to_string(c.dst_buffer) + " @ " + u64(c.dst_offset) + ", " + u64(c.bytes) +
           " bytes";
  }
  out += ", signal " + signal_name(c.signal_id);
  if (c.type != static_cast<uint8_t>(CommandType::kPut)) out += " = " + hex(c.signal_value);
  return out;
}

std::string validate(const Command& c, const CommandLimits& l) {
  const CommandError error = check_command(c, l);
  if (error == CommandError::kOk) return {};
  std::string why;
  switch (error) {
    case CommandError::kOk:
      break;
    case CommandError::kBadCheck:
      why = "check word is " + hex(c.check) + " but the fields give " + hex(command_check(c)) +
            ": the slot was torn, overwritten or not built with make_put / make_signal";
      break;
    case CommandError::kUnknownType:
      why = "type " + std::to_string(c.type) + " is not a command; expected 1 (put), " +
            "2 (put+signal) or 3 (signal)";
      break;
    case CommandError::kBadFlags:
      why = "flags are " + hex(c.flags) + "; reserved, must be 0";
      break;
    case CommandError::kRankOutOfRange:
      why = "destination rank " + std::to_string(c.dst_rank) + " is out of range; the world has " +
            std::to_string(l.world_size) + " ranks";
      break;
    case CommandError::kRankIsSelf:
      why = "destination rank " + std::to_string(c.dst_rank) +
            " is this rank; local copies do not go through the proxy";
      break;
    case CommandError::kSrcBufferUnregistered:
      why = "source buffer " + std::to_string(c.src_buffer) + ": " + buffer_limit(l, c.src_buffer);
      break;
    case CommandError::kDstBufferUnregistered:
      why = "destination buffer " + std::to_string(c.dst_buffer) + ": " +
            buffer_limit(l, c.dst_buffer);
      break;
    case CommandError::kSrcOutOfRange:
      why = "source range [" + u64(c.src_offset) + ", +" + u64(c.bytes) + ") is beyond the end; " +
            buffer_limit(l, c.src_buffer);
      break;
    case CommandError::kDstOutOfRange:
      why = "destination range [" + u64(c.dst_offset) + ", +" + u64(c.bytes) +
            ") is beyond the end; " + buffer_limit(l, c.dst_buffer);
      break;
    case CommandError::kZeroBytes:
      why = "a put of 0 bytes; use a signal-only command to raise a signal without data";
      break;
    case CommandError::kBytesOnSignal:
      why = "a signal-only command must have bytes, offsets and buffers 0 (has " + u64(c.bytes) +
            " bytes)";
      break;
    case CommandError::kSignalOutOfRange:
      why = "signal " + std::to_string(c.signal_id) + " is out of range; there are " +
            std::to_string(l.num_signals) + " signals";
      break;
    case CommandError::kSignalMissing:
      why = std::string(to_string(static_cast<CommandType>(c.type))) +
            " needs a signal id; got none (kNoSignal)";
      break;
  }
  return describe(c) + ": " + why;
}

}  // namespace mk::transport
