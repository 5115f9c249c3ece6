// mkernel/device/sync.cuh - memory operations with explicit scope and order.
//
// Names say what they are: ld_acquire_sys is an acquire load at system scope (it sees stores of
// other GPUs released at system scope), st_release_sys a release store at system scope.
#pragma once

#include <cstdint>

namespace mk::dev {

__device__ __forceinline__ uint64_t ld_acquire_sys(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ void st_release_sys(uint64_t* p, uint64_t v) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

// Relaxed (strong) load at system scope: sees other GPUs' stores, orders nothing by itself. Follow
// it with fence_acq_rel_sys() to acquire what a release store it observed published.
__device__ __forceinline__ uint64_t ld_relaxed_sys(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.relaxed.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ int32_t ld_relaxed_sys(const int32_t* p) {
  int32_t v;
  asm volatile("ld.relaxed.sys.global.s32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ uint64_t ld_relaxed_gpu(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.relaxed.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ int32_t ld_relaxed_gpu(const int32_t* p) {
  int32_t v;
  asm volatile("ld.relaxed.gpu.global.s32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ void fence_acq_rel_sys() {
  asm volatile("fence.acq_rel.sys;" ::: "memory");
}

// A count in shared memory handed between warps of a CTA: adds with release (the adding thread's
// earlier stores, and those ordered before them, are visible to whoever acquires the sum) and
// an acquire load.
__device__ __forceinline__ void red_add_release_cta(uint32_t* shared, uint32_t v) {
  asm volatile("red.release.cta.shared::cta.add.u32 [%0], %1;" ::"r"(
                   static_cast<uint32_t>(__cvta_generic_to_shared(shared))),
               "r"(v)
               : "memory");
}

__device__ __forceinline__ uint32_t ld_acquire_cta(const uint32_t* shared) {
  uint32_t v;
  asm volatile("ld.acquire.cta.shared::cta.u32 %0, [%1];"
               : "=r"(v)
               : "r"(static_cast<uint32_t>(__cvta_generic_to_shared(shared)))
               : "memory");
  return v;
}

// 16 bytes from L2 (ld.global.cg): coherent, for memory written while the kernel runs (by
// other SMs or other GPUs).
__device__ __forceinline__ uint4 load_l2(const void* p) {
  uint4 v;
  asm volatile("ld.global.cg.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p)
               : "memory");
  return v;
}

// Nanoseconds since an arbitrary origin, comparable across the SMs of one GPU.
__device__ __forceinline__ uint64_t global_timer_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t));
  return t;
}

}  // namespace mk::dev
