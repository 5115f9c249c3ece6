// mkernel/device/cluster.cuh - thread-block clusters (sm_90): the cluster barrier and reads of a
// peer CTA's shared memory (distributed shared memory).
//
// A kernel launched with a cluster dimension runs its cluster's CTAs at the same time, on SMs of
// one GPC; each may read the others' shared memory through the SM-to-SM network, between two
// cluster barriers: the writer's arrive (release) and the reader's wait (acquire) order the
// writes before the reads, and a second barrier keeps a CTA's shared memory alive until its
// peers are done reading it.
#pragma once

#include <cstdint>

#include "mkernel/device/mbarrier.cuh"

namespace mk::dev {

// This CTA's rank in its cluster (0 in a launch without clusters).
__device__ __forceinline__ uint32_t cluster_rank() {
  uint32_t rank;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(rank));
  return rank;
}

// Every non-exited thread of every CTA of the cluster; this thread's earlier writes (shared and
// global) are visible to every thread of the cluster after it.
__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release;\n\tbarrier.cluster.wait.acquire;" ::: "memory");
}

// The address in CTA `rank`'s shared memory of what `p` is in this CTA's (the same layout).
__device__ __forceinline__ uint32_t peer_smem_addr(const void* p, uint32_t rank) {
  uint32_t addr;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(addr) : "r"(smem_addr(p)), "r"(rank));
  return addr;
}

// 16 bytes of a peer's shared memory (an address from peer_smem_addr, 16-byte aligned).
__device__ __forceinline__ float4 ld_peer_f4(uint32_t addr) {
  float4 v;
  asm volatile("ld.shared::cluster.v4.f32 {%0, %1, %2, %3}, [%4];"
               : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
               : "r"(addr)
               : "memory");
  return v;
}

}  // namespace mk::dev
