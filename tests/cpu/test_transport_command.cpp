// The inter-node command: layout, encoding at large values, validation of every malformed case.
#include <gtest/gtest.h>

#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "mkernel/transport/command.h"
#include "test_transport_util.h"

namespace mk::transport {
namespace {

using mk::test::contains;

constexpr uint64_t kGiB = uint64_t{1} << 30;

CommandLimits big_limits() {
  CommandLimits l;
  l.rank = 3;
  l.world_size = 100000;
  l.num_signals = 480;
  l.buffer_bytes[1] = 64 * kGiB;
  l.buffer_bytes[2] = 64 * kGiB;
  l.buffer_bytes[15] = 4096;
  return l;
}

// Compile-time: the encoder and the checks are constexpr (so they also run on the GPU).
static_assert(check_command(make_put(1, 7, 1, 0, 2, 0, 64), [] {
                CommandLimits l;
                l.world_size = 2;
                l.num_signals = 1;
                l.buffer_bytes[1] = l.buffer_bytes[2] = 64;
                return l;
              }()) == CommandError::kOk);

TEST(TransportCommand, RoundTripAtLargeValues) {
  const uint64_t src_off = 5 * kGiB + 3;              // > 4 GiB
  const uint64_t dst_off = 37 * kGiB + 12345;         // > 32 bits
  const uint64_t bytes = 5 * kGiB + 1;                // > 4 GiB in one command
  const uint64_t tile = (uint64_t{1} << 40) + 70000;  // > 65536, > 32 bits
  const uint32_t rank = 70001;                        // > 65536
  const uint64_t value = (uint64_t{0xFFFFFFF0} << 32) | 0xFFFFFFFE;
  const Command c = make_put_signal(rank, tile, 1, src_off, 2, dst_off, bytes, 479, value);

  // Through raw bytes, as it crosses PCIe into host memory.
  unsigned char raw[sizeof(Command)];
  std::memcpy(raw, &c, sizeof(raw));
  Command d;
  std::memcpy(&d, raw, sizeof(raw));
  EXPECT_EQ(d.type, static_cast<uint8_t>(CommandType::kPutSignal));
  EXPECT_EQ(d.dst_rank, rank);
  EXPECT_EQ(d.tile_id, tile);
  EXPECT_EQ(d.src_buffer, 1);
  EXPECT_EQ(d.src_offset, src_off);
  EXPECT_EQ(d.dst_buffer, 2);
  EXPECT_EQ(d.dst_offset, dst_off);
  EXPECT_EQ(d.bytes, bytes);
  EXPECT_EQ(d.signal_id, 479u);
  EXPECT_EQ(d.signal_value, value);
  EXPECT_EQ(d.flags, 0);
  EXPECT_EQ(d.check, command_check(d));
  EXPECT_EQ(validate(d, big_limits()), "");

  // The documented byte layout (little-endian words at fixed offsets).
  uint64_t word;
  std::memcpy(&word, raw + 0, 8);
  EXPECT_EQ(word, src_off);
  std::memcpy(&word, raw + 8, 8);
  EXPECT_EQ(word, dst_off);
  std::memcpy(&word, raw + 16, 8);
  EXPECT_EQ(word, bytes);
  std::memcpy(&word, raw + 24, 8);
  EXPECT_EQ(word, value);
  std::memcpy(&word, raw + 32, 8);
  EXPECT_EQ(word, tile);
  uint32_t half;
  std::memcpy(&half, raw + 40, 4);
  EXPECT_EQ(half, rank);
  std::memcpy(&half, raw + 44, 4);
  EXPECT_EQ(half, 479u);
  EXPECT_EQ(raw[48], 2);
  EXPECT_EQ(raw[49], 1);
  EXPECT_EQ(raw[50], 2);
}

TEST(TransportCommand, EveryTypeValidates) {
  const CommandLimits l = big_limits();
  EXPECT_EQ(validate(make_put(0, 1, 1, 0, 2, 64 * kGiB - 8, 8), l), "");  // ends exactly at the end
  EXPECT_EQ(validate(make_put(99999, 1, 1, 0, 2, 0, 8, 0), l), "");       // counted on signal 0
  EXPECT_EQ(validate(make_signal(4, 9, 479, 1), l), "");
  EXPECT_EQ(validate(make_put_signal(4, 9, 15, 0, 15, 0, 4096, 3, 7), l), "");
}

TEST(TransportCommand, DescribeNamesEveryField) {
  const Command c =
      make_put_signal(70000, 65537, 1, 5 * kGiB, 2, 4 * kGiB, 1 << 20, 3, (uint64_t{1} << 32) | 2);
  EXPECT_EQ(describe(c),
            "put+signal to rank 70000: tile 65537, buffer 1 @ 5368709120 -> buffer 2 @ "
            "4294967296, 1048576 bytes, signal 3 = 0x100000002");
  EXPECT_EQ(describe(make_signal(5, 6, 7, 8)), "signal to rank 5: tile 6, signal 7 = 0x8");
  EXPECT_EQ(describe(make_put(5, 6, 0, 1, 0, 2, 3)),
            "put to rank 5: tile 6, buffer 0 @ 1 -> buffer 0 @ 2, 3 bytes, signal none");
}

struct Malformed {
  const char* name;
  std::function<Command()> make;
  CommandError error;
  const char* message;  // part of validate()'s text
};

TEST(TransportCommand, EveryMalformedCaseIsReported) {
  const CommandLimits l = big_limits();
  auto resealed = [](const Command& in, const std::function<void(Command&)>& change) {
    Command c = in;
    change(c);
    return sealed(c);
  };
  const Command good = make_put(4, 77, 1, 0, 2, 0, 4096, 5);
  const std::vector<Malformed> cases = {
      {"torn (a field changed after sealing)",
       [&] {
         Command c = good;
         c.bytes = 8192;
         return c;
       },
       CommandError::kBadCheck, "check word"},
      {"garbage",
       [] {
         Command c;
         std::memset(&c, 0xAB, sizeof(c));
         return c;
       },
       CommandError::kBadCheck, "check word"},
      {"zeroed",
       [] {
         Command c;
         std::memset(&c, 0, sizeof(c));
         return c;
       },
       CommandError::kBadCheck, "check word"},
      {"type 0", [&] { return resealed(good, [](Command& c) { c.type = 0; }); },
       CommandError::kUnknownType, "type 0 is not a command"},
      {"type 9", [&] { return resealed(good, [](Command& c) { c.type = 9; }); },
       CommandError::kUnknownType, "type 9 is not a command"},
      {"flags", [&] { return resealed(good, [](Command& c) { c.flags = 1; }); },
       CommandError::kBadFlags, "reserved"},
      {"rank out of range", [] { return make_put(100000, 1, 1, 0, 2, 0, 8); },
       CommandError::kRankOutOfRange,
       "destination rank 100000 is out of range; the world has "
       "100000 ranks"},
      {"rank is self", [] { return make_put(3, 1, 1, 0, 2, 0, 8); }, CommandError::kRankIsSelf,
       "destination rank 3 is this rank"},
      {"source buffer id too large", [] { return make_put(4, 1, 16, 0, 2, 0, 8); },
       CommandError::kSrcBufferUnregistered, "buffer ids go up to 15"},
      {"source buffer not registered", [] { return make_put(4, 1, 3, 0, 2, 0, 8); },
       CommandError::kSrcBufferUnregistered, "no buffer is registered under id 3"},
      {"destination buffer not registered", [] { return make_put(4, 1, 1, 0, 0, 0, 8); },
       CommandError::kDstBufferUnregistered, "destination buffer 0"},
      {"source past the end", [] { return make_put(4, 1, 1, 64 * kGiB - 4, 2, 0, 8); },
       CommandError::kSrcOutOfRange, "source range [68719476732, +8) is beyond the end"},
      {"destination past the end", [] { return make_put(4, 1, 15, 0, 15, 4000, 97); },
       CommandError::kDstOutOfRange, "buffer 15 has 4096 bytes"},
      {"offset + bytes overflows 64 bits",
       [] { return make_put(4, 1, 1, 0, 2, ~uint64_t{0} - 3, 8); }, CommandError::kDstOutOfRange,
       "beyond the end"},
      {"zero-length put", [] { return make_put(4, 1, 1, 0, 2, 0, 0); }, CommandError::kZeroBytes,
       "a put of 0 bytes"},
      {"signal out of range", [] { return make_signal(4, 1, 480, 1); },
       CommandError::kSignalOutOfRange, "signal 480 is out of range; there are 480 signals"},
      {"put counted on a signal out of range", [] { return make_put(4, 1, 1, 0, 2, 0, 8, 1000); },
       CommandError::kSignalOutOfRange, "signal 1000"},
      {"put+signal without a signal",
       [] { return make_put_signal(4, 1, 1, 0, 2, 0, 8, kNoSignal, 1); },
       CommandError::kSignalMissing, "needs a signal id"},
      {"signal without a signal", [] { return make_signal(4, 1, kNoSignal, 1); },
       CommandError::kSignalMissing, "needs a signal id"},
      {"signal with a payload",
       [&] { return resealed(make_signal(4, 1, 2, 1), [](Command& c) { c.bytes = 8; }); },
       CommandError::kBytesOnSignal, "must have bytes, offsets and buffers 0"},
  };
  for (const Malformed& m : cases) {
    SCOPED_TRACE(m.name);
    const Command c = m.make();
    EXPECT_EQ(check_command(c, l), m.error) << to_string(check_command(c, l));
    const std::string why = validate(c, l);
    EXPECT_TRUE(contains(why, m.message)) << why;
  }
}

}  // namespace
}  // namespace mk::transport
