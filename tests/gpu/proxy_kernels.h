// Kernels of the GPU-proxy test: CTAs push commands into host-pinned command rings; a kernel
// on the receiving GPU polls the host signal pad (pinned, device-mapped) for the arrivals.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "mkernel/transport/ring.h"

namespace mk::test {

constexpr int kMaxProxyRings = 4;
struct ProxyRings {
  transport::CommandRing ring[kMaxProxyRings];
  int count;
};

// CTA b pushes puts of chunks b, b + grid, ... (chunk bytes each, buffer 0 -> the peer's buffer
// 1, same offsets) into ring b % count; its last put also raises signal b to `value` on the peer.
// Thread 0 of each CTA pushes; a push that fails (ring broken, 10 s without space) counts in
// *failures.
void launch_push_puts(const ProxyRings& rings, int ctas, uint32_t peer, uint64_t chunk,
                      uint64_t chunks, uint64_t value, int* failures, cudaStream_t s);

// Waits (one thread, up to 10 s) until pad word [signal][src] >= value for every signal < ctas,
// then compares `bytes` of dst with the pattern rank `src` sent; counts mismatching bytes in
// *mismatches and a wait that gave up in *timeouts.
void launch_await_and_check(const uint64_t* pad_words, int world, int src, int ctas, uint64_t value,
                            const uint8_t* dst, uint64_t bytes, unsigned long long* mismatches,
                            int* timeouts, cudaStream_t s);

// Loads the kernels above on the current device. With lazy module loading (CUDA's default) the
// first launch of a kernel waits for the kernels already running on the device, so a waiting
// kernel launched before its producer's first launch would wait for nothing.
void preload_proxy_kernels();

// dst[i] = the byte pattern of rank `rank` at i.
void launch_fill_pattern(uint8_t* dst, uint64_t bytes, int rank, cudaStream_t s);

}  // namespace mk::test
