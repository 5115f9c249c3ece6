// mkernel/device/cp_async.cuh - per-thread asynchronous copies, global -> shared (cp.async),
// completing on an mbarrier: for an operand whose rows no tensor map describes (rows gathered
// from anywhere), each thread copying 16-byte pieces.
//
// A thread issues its copies, then cp_async_arrive_noinc(bar): the barrier counts one arrival
// from it once every copy it issued before has landed. (noinc: the arrival is one of the
// barrier's expected count, so mbarrier_init counts these threads.)
#pragma once

#include <cstdint>

#include "mkernel/device/mbarrier.cuh"

namespace mk::dev {

// 16 bytes from `src` (global, 16-byte aligned) to `dst` (shared, 16-byte aligned) through L2
// (.cg: not L1 - coherent with stores other SMs made while the kernel runs). `src_bytes` of them
// are read (16, or 0: none, and `src` need not be valid), the rest written as zero.
// (dst: a shared-memory address, smem_addr's.)
__device__ __forceinline__ void cp_async_16(uint32_t dst, const void* src, uint32_t src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst),
               "l"(reinterpret_cast<uint64_t>(src)), "r"(src_bytes)
               : "memory");
}

// One arrival on `bar` once every cp.async this thread issued before it has landed.
__device__ __forceinline__ void cp_async_arrive_noinc(uint64_t* bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(smem_addr(bar))
               : "memory");
}

// Waits until every cp.async this thread issued has landed (before it exits: nothing of the
// kernel may still be in flight from a thread that is gone).
__device__ __forceinline__ void cp_async_wait_all() {
  asm volatile("cp.async.wait_all;" ::: "memory");
}

}  // namespace mk::dev
