// The trace buffer's layout and events, shared by the kernels (fused/trace.cuh), the host side that
// arms it (fused/trace.cpp) and the reader (bench/trace_fused.cpp). Internal: not installed.
//
// Buffer: [CTA][lane][kTraceWordsPerLane] uint64; a lane's records are word pairs (globaltimer ns,
// event | argument << 8), in order, zero after the last.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <vector>

#include "mkernel/communicator.h"

namespace mk::fused {

constexpr int kTraceSide = 0;       // the producer warpgroup's side threads (thread 32)
constexpr int kTraceConsumer0 = 1;  // consumer c: lane 1 + c (its thread 0)
constexpr int kTraceProducer = 3;   // the producer's TMA thread (ag_gemm: waits for operands)
constexpr int kTraceLanes = 4;
// 1024 records: moe_layer's CTAs run ~200 tiles (2 records each on a consumer or producer lane)
// at DeepSeek-V3 4096 tokens a rank.
constexpr int kTraceWordsPerLane = 2048;

enum TraceEvent : uint32_t {
  kTraceNone = 0,
  // consumers (argument: 1 a peer's tile, 0 an own tile)
  kTraceStoreBegin = 1,  // the tile's mainloop is done, its epilogue starts
  kTraceWaited = 2,      // own: the peers' partials are in; peer's: the outbox slot is free
  kTraceStoreEnd = 3,    // the epilogue is done (the next mainloop starts)
  kTraceDone = 4,        // after the last tile (the outbox closed)
  kTraceAdded = 5,       // own: the peers' partials are added (the bf16 stores follow)
  // side threads (argument: the consumer whose item it is)
  kTraceSideStart = 10,  // the CTA's side threads begin (about when the CTA starts)
  kTraceItem = 11,       // an item arrived
  kTraceSent = 12,       // its copies are issued and signalled
  kTraceSideEnd = 13,
  // MoE side threads (moe_dispatch_gemm, moe_layer; argument 0)
  kTraceLanded = 14,  // every other rank's rows have landed (the walk may start)
  kTracePlaced = 15,  // the walk is done: every row bound here placed
  // moe_layer, consumer 0's leader: kTraceDone when the CTA's tiles are done (its combine sums
  // start), then
  kTraceSummed = 16,  // its warp's share of the combine sums is done
  // producer (ag_gemm: argument the tile's shard; MoE: the local expert, + 1 << 16 for a down
  // tile of moe_layer waiting for its gate / up tiles)
  kTraceOperandsWait = 20,  // a peer's tile: waiting for its rows to arrive
  kTraceOperandsIn = 21,    // they have: its loads start
};

// Host: the buffer for the next launch of a fused kernel on `stream` with `ctas` CTAs, zeroed on
// that stream; nullptr unless the communicator was created with MKERNEL_TRACE=1. One buffer per
// host thread (grown as needed): a trace holds the thread's last armed launch only.
uint64_t* trace_arm(const Communicator& comm, int ctas, cudaStream_t stream);

// Host: the last armed launch's records (synchronises the device); `ctas` receives its CTA count.
std::vector<uint64_t> trace_read(int& ctas);

}  // namespace mk::fused
