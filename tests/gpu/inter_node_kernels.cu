// Kernels of the inter-node path test (inter_node_kernels.h).
#include "inter_node_kernels.h"
#include "mkernel/device/launch.cuh"
#include "mkernel/device/sync.cuh"
#include "mkernel/transport/command.h"

namespace mk::test {
namespace {

__device__ uint8_t round_pattern(uint64_t i, int rank, int round) {
  return static_cast<uint8_t>((i * 131 + rank * 7 + round * 29 + 1) & 0xFF);
}

// Gives a push up after 10 s without ring space.
struct PushDeadline {
  uint64_t start;
  __device__ bool operator()(uint64_t) const {
    return dev::global_timer_ns() - start < 10ull * 1000 * 1000 * 1000;
  }
};

__global__ void exchange_with_peer_kernel(DeviceComm comm, transport::CommandRing ring, int peer,
                                          uint32_t signal, const uint8_t* dst, uint64_t bytes,
                                          int round, unsigned long long* mismatches, int* status) {
  const dev::Launch launch = dev::Launch::begin(comm);
  __shared__ int outcome;
  if (threadIdx.x == 0) {
    outcome = 0;
    const transport::Command put = transport::make_put_signal(
        peer, round, 0, 0, 1, 0, bytes, signal, dev::signal_value(launch.epoch, 1));
    if (ring.push(put, PushDeadline{dev::global_timer_ns()}).status != transport::PushStatus::kOk) {
      outcome = 1;
    } else if (!launch.wait_remote(peer, signal, 1)) {
      outcome = 2;
    }
    *status = outcome;
  }
  __syncthreads();
  if (outcome == 0) {
    unsigned long long bad = 0;
    for (uint64_t i = threadIdx.x; i < bytes; i += blockDim.x) {
      bad += dst[i] != round_pattern(i, peer, round);
    }
    if (bad) atomicAdd(mismatches, bad);
  }
  launch.end();
}

__global__ void wait_remote_kernel(DeviceComm comm, int src, uint32_t signal, int* status) {
  const dev::Launch launch = dev::Launch::begin(comm);
  if (threadIdx.x == 0) *status = launch.wait_remote(src, signal, 1) ? 0 : 2;
  launch.end();
}

__global__ void fill_round_pattern_kernel(uint8_t* dst, uint64_t bytes, int rank, int round) {
  for (uint64_t i = blockIdx.x * static_cast<uint64_t>(blockDim.x) + threadIdx.x; i < bytes;
       i += static_cast<uint64_t>(gridDim.x) * blockDim.x) {
    dst[i] = round_pattern(i, rank, round);
  }
}

}  // namespace

void launch_exchange_with_peer(const DeviceComm& comm, const transport::CommandRing& ring, int peer,
                               uint32_t signal, const uint8_t* dst, uint64_t bytes, int round,
                               unsigned long long* mismatches, int* status, cudaStream_t s) {
  exchange_with_peer_kernel<<<1, 256, 0, s>>>(comm, ring, peer, signal, dst, bytes, round,
                                              mismatches, status);
}

void launch_wait_remote(const DeviceComm& comm, int src, uint32_t signal, int* status,
                        cudaStream_t s) {
  wait_remote_kernel<<<1, 32, 0, s>>>(comm, src, signal, status);
}

void launch_fill_round_pattern(uint8_t* dst, uint64_t bytes, int rank, int round, cudaStream_t s) {
  fill_round_pattern_kernel<<<64, 256, 0, s>>>(dst, bytes, rank, round);
}

void preload_inter_node_kernels() {
  cudaFuncAttributes attributes;
  for (const void* kernel : {reinterpret_cast<const void*>(exchange_with_peer_kernel),
                             reinterpret_cast<const void*>(wait_remote_kernel),
                             reinterpret_cast<const void*>(fill_round_pattern_kernel)}) {
    cudaFuncGetAttributes(&attributes, kernel);
  }
}

}  // namespace mk::test
