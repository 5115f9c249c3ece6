// mkernel/device_comm.h - the communicator as kernels see it: plain data, passed by value.
#pragma once

#include <cstdint>

namespace mk {

// Signals are 64-bit words in every rank's symmetric signal pad, laid out [kNumSignals][world].
// Word (s, src) on rank r is written by rank src only - or, for a rank src of another node, by
// its relay on r's node in its stead (Launch::signal_as: moe_dispatch's forwarded counts and
// rows; src itself never writes there). Values are signal_value(epoch, step), so
// they only grow: consecutive launches need no reset. Each named range has one slot per channel
// (a channel is one CTA of a persistent kernel, grids equal on all ranks - except ring attention,
// whose channels are its copy shares, so that its ranks may run different grids).
constexpr int kMaxChannels = 160;     // >= SMs of any Hopper part
constexpr int kMaxOpSignals = 16384;  // per-op slots (fused kernels: "piece p / tile t arrived")
enum class SignalId : uint32_t {
  kEntry = 0,              // channel c: "rank src entered this launch"
  kExit = kMaxChannels,    // channel c: "rank src finished writing into / reading from me"
  kOp = 2 * kMaxChannels,  // per-op use: kMaxOpSignals slots
  // channel c: "rank src found that this launch's entry signatures differ" (written before it
  // leaves the launch: Launch::channel_barrier_agreeing)
  kVerdict = 2 * kMaxChannels + kMaxOpSignals,
  kCount = 3 * kMaxChannels + kMaxOpSignals,
};
constexpr int kNumSignals = static_cast<int>(SignalId::kCount);

// Arrivals from other nodes land in a second pad, in host-mapped memory (the communicator's
// inter-node path, runtime/inter_node.h): [kInterNodeSignals][world_size], word (s, src) raised by
// the proxy when src's puts counted on s have landed; same values (signal_value) as the device pad.
// Signal ids 0 .. kInterNodeSignals - 1, on every backend: the RDMA backends' write immediate
// has 12 bits for the signal, 0xFFF meaning none. Plans size their signals by this, so a plan
// that runs over sockets runs over RDMA too.
constexpr int kInterNodeSignals = 4095;
// A DeviceErrorRecord's signal with this bit set names a host-pad signal (the wait was for an
// arrival from another node).
constexpr uint32_t kHostPadSignalBit = 1u << 31;
// ... and with this bit set, a counter in device memory (e.g. rows of a block placed), numbered by
// the op: raised by this rank's own CTAs (Launch::wait_local) or by a peer's, in the waiter's
// memory or the peer's (Launch::wait_counter names the peer).
constexpr uint32_t kLocalCounterBit = 1u << 30;

enum class DeviceErrorCode : int32_t {
  kNone = 0,
  kTimeout = 1,    // a wait on a peer gave up (DeviceComm::error): the communicator is broken
  kCapacity = 2,   // data errors (DeviceComm::data_error), the launch completes: rows routed to
  kBadIndex = 3,   // a local expert past the layout's room / an expert id out of range
  kMismatch = 4,   // (DeviceComm::error, fatal as a time-out) a peer in the same launch entered
                   // it with another op signature: the ranks disagree on the op or its sizes
  kBadHandle = 5,  // a combine's handle row pointing outside its problem (another dispatch's)
};

// The launches whose entry barriers compare signatures (dev::entry_signature: the op in the top
// byte, a hash of the sizes every rank must share below; Launch::channel_barrier_agreeing,
// announce / agrees): a peer must be in the same one, with the same sizes.
enum class EntryOp : uint32_t {
  kMoeDispatch = 1,
  kMoeCombine = 2,
  kMoeDispatchGemm = 3,
  kMoeLayer = 4,
  kRingAttention = 5,
};
// The op a signature names (0: none - a step, which entry barriers without one signal).
constexpr uint32_t entry_op_of(uint64_t signature) {
  return static_cast<uint32_t>(signature >> 24) & 0xffu;
}

// Written by the first wait that times out (DeviceComm::error), or by the first data error of a
// launch (DeviceComm::data_error); host-mapped memory, read by Communicator::check().
// Data errors use the fields as: kCapacity - peer = the local expert, expected = the rows its
// layout holds, observed = the rows routed to it; kBadIndex - peer = the token, signal = the
// top-k slot, expected = the number of experts, observed = the index (int64 bits). kMismatch
// (in DeviceComm::error) - peer = the rank that disagreed, signal = the entry barrier's slot,
// expected = this rank's signature, observed = the peer's (Launch::channel_barrier_agreeing).
// kBadHandle - peer = the handle's row, signal = its field (0 source rank, 1 token, 2 slot),
// expected = that field's bound (world, max_tokens, top_k), observed = the value.
struct DeviceErrorRecord {
  int32_t code;        // DeviceErrorCode
  int32_t rank;        // the rank that waited
  int32_t peer;        // the rank it waited for
  uint32_t signal;     // signal slot index (SignalId + channel)
  uint64_t expected;   // value it waited for (>=)
  uint64_t observed;   // last value it saw
  uint64_t waited_ns;  // how long it waited
};

// Per-rank launch bookkeeping in device memory (not symmetric).
struct DeviceLaunchState {
  uint64_t epoch;             // launches completed by this rank on this communicator
  uint32_t blocks_done;       // CTAs of the current launch that have finished
  int32_t abort;              // set once any wait timed out: every later wait gives up at once
  uint64_t data_error_epoch;  // the last launch that elected a data error's writer (atomicMax)
};

struct DeviceComm {
  int32_t rank;
  int32_t world_size;
  int32_t node;
  int32_t local_rank;
  int32_t local_size;
  const int32_t* node_ranks;      // device [local_size]: global rank of each local rank
  uint64_t* signals;              // this rank's pad [kNumSignals][world_size]
  uint64_t* const* peer_signals;  // device [local_size]: each local peer's pad, mapped here
  DeviceLaunchState* state;       // device
  DeviceErrorRecord* error;       // host-mapped: time-outs
  DeviceErrorRecord* data_error;  // host-mapped: errors in an op's data (MoE routing), which
                                  // check() raises once without breaking the communicator
  uint64_t timeout_ns;            // 0 = wait forever
  // The inter-node path (multi-node communicators, once created; null otherwise):
  const uint64_t* host_signals;  // host-mapped pad [kInterNodeSignals][world_size]
  const int32_t* host_abort;     // host-mapped: non-zero once the path failed (lost peer, ...)
};

}  // namespace mk
