// mkernel/device/cluster.cuh - thread-block clusters (sm_90): the cluster barrier and stores into
// a peer CTA's shared memory (distributed shared memory).
//
// A kernel launched with a cluster dimension runs its cluster's CTAs at the same time, on SMs of
// one GPC; each may write (and read) the others' shared memory through the SM-to-SM network.
// Cluster barriers order it: the writer's arrive (release) and the reader's wait (acquire) put
// the writes before the reads; a CTA's shared memory must outlive its peers' accesses.
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

// The same barrier without the release: for a point after which peers will write into this CTA's
// shared memory that it has only read before (values already in registers) - nothing of this
// thread's needs publishing, and the release's GPU-scope fence is skipped.
__device__ __forceinline__ void cluster_sync_relaxed() {
  asm volatile("barrier.cluster.arrive.relaxed;\n\tbarrier.cluster.wait.acquire;" ::: "memory");
}

// The address in CTA `rank`'s shared memory of what `p` is in this CTA's (the same layout).
__device__ __forceinline__ uint32_t peer_smem_addr(const void* p, uint32_t rank) {
  uint32_t addr;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(addr) : "r"(smem_addr(p)), "r"(rank));
  return addr;
}

// 8 bytes into a peer's shared memory (an address from peer_smem_addr, 8-byte aligned): the
// store does not wait for the far SM; the next cluster barrier's release publishes it.
__device__ __forceinline__ void st_peer_f2(uint32_t addr, float x, float y) {
  asm volatile("st.shared::cluster.v2.f32 [%0], {%1, %2};" ::"r"(addr), "f"(x), "f"(y) : "memory");
}

}  // namespace mk::dev
