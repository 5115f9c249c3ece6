// Timelines of the fused kernels: where a launch spends its time, tile by tile (a diagnostic for
// the performance work; off - one test of a kernel parameter per event - unless MKERNEL_TRACE is
// set, see fused/trace_layout.h). Thread 0 of each lane of a CTA appends (globaltimer ns, event |
// argument << 8) records to its own row of the buffer: lane 0 the producer's side threads, lanes
// 1 and 2 the consumers, lane 3 the producer's TMA thread. The record counts live in shared memory,
// so tracing costs the kernels no registers. bench/trace_fused.cpp reads and summarises the
// records.
#pragma once

#include <cstdint>

#include "fused/trace_layout.h"
#include "mkernel/device/sync.cuh"

namespace mk::fused {

__device__ __forceinline__ int* trace_counts() {
  __shared__ int counts[kTraceLanes];
  return counts;
}

// Thread 0 of the CTA, before the kernel's first __syncthreads.
__device__ __forceinline__ void trace_init() {
  for (int lane = 0; lane < kTraceLanes; ++lane) trace_counts()[lane] = 0;
}

// The lane's thread 0: one record (nothing when `buffer`, the kernel's parameter, is null).
__device__ __forceinline__ void trace_mark(uint64_t* buffer, int lane, TraceEvent event,
                                           uint32_t arg = 0) {
  if (buffer == nullptr) return;
  const int n = trace_counts()[lane];
  if (2 * n + 2 > kTraceWordsPerLane) return;
  trace_counts()[lane] = n + 1;
  uint64_t* row =
      buffer + (static_cast<int64_t>(blockIdx.x) * kTraceLanes + lane) * kTraceWordsPerLane;
  row[2 * n] = dev::global_timer_ns();
  row[2 * n + 1] = (static_cast<uint64_t>(arg) << 8) | static_cast<uint64_t>(event);
}

}  // namespace mk::fused
