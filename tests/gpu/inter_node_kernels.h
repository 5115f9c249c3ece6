// Kernels of the inter-node path test (test_inter_node.cpp): a persistent-kernel-like exchange
// with a rail peer on another (virtual) node - the GPU pushes a put+signal command into the
// communicator's inter-node ring and waits for the peer's arrival on the host-mapped pad.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "mkernel/device_comm.h"
#include "mkernel/transport/ring.h"

namespace mk::test {

// One CTA. Thread 0 pushes "put `bytes` of my buffer 0 into the peer's buffer 1, counted on
// `signal`, then raise it to (this launch, step 1)" into `ring`; then waits for the peer's
// signal (Launch::wait_remote); then the CTA compares the peer's bytes in `dst` with the pattern
// of (peer, round). Counts mismatching bytes in *mismatches; *status: 1 = the push failed,
// 2 = the wait gave up (time limit, or the path failed), 0 otherwise.
void launch_exchange_with_peer(const DeviceComm& comm, const transport::CommandRing& ring, int peer,
                               uint32_t signal, const uint8_t* dst, uint64_t bytes, int round,
                               unsigned long long* mismatches, int* status, cudaStream_t s);

// One thread waits for (src, signal) at step 1 of this launch; *status 2 when it gave up.
void launch_wait_remote(const DeviceComm& comm, int src, uint32_t signal, int* status,
                        cudaStream_t s);

// dst[i] = the pattern of (rank, round) at i.
void launch_fill_round_pattern(uint8_t* dst, uint64_t bytes, int rank, int round, cudaStream_t s);

// Loads the kernels above (lazy loading would make a later first launch wait for a running one).
void preload_inter_node_kernels();

}  // namespace mk::test
