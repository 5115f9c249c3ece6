// Tiny kernels for the graph-replay tests: the inputs of replay k depend on a device counter, and
// each replay's output is appended to a history, so every one of the replays can be checked.
#include <cuda_bf16.h>

#include "graph_kernels.h"

namespace mk::test {

// value(rank, k, i): small integers, so every sum is exact in bf16.
__host__ __device__ inline float replay_value(int rank, int k, std::size_t i) {
  return static_cast<float>(static_cast<int>((rank + 1) * (k + 3) + i) % 17 - 8);
}

__global__ void fill_kernel(__nv_bfloat16* input, std::size_t count, int rank, const int* counter) {
  const int k = *counter;
  for (std::size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < count;
       i += gridDim.x * blockDim.x) {
    input[i] = __float2bfloat16_rn(replay_value(rank, k, i));
  }
}

__global__ void record_kernel(const __nv_bfloat16* output, std::size_t count,
                              __nv_bfloat16* history, int* counter) {
  const int k = *counter;
  for (std::size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < count;
       i += gridDim.x * blockDim.x) {
    history[k * count + i] = output[i];
  }
  __syncthreads();
  // One CTA: the counter is bumped after every thread read it.
  if (threadIdx.x == 0) *counter = k + 1;
}

void launch_fill(void* input, std::size_t count, int rank, const int* counter, cudaStream_t s) {
  fill_kernel<<<1, 256, 0, s>>>(static_cast<__nv_bfloat16*>(input), count, rank, counter);
}

void launch_record(const void* output, std::size_t count, void* history, int* counter,
                   cudaStream_t s) {
  record_kernel<<<1, 256, 0, s>>>(static_cast<const __nv_bfloat16*>(output), count,
                                  static_cast<__nv_bfloat16*>(history), counter);
}

float expected_replay_sum(int world, int k, std::size_t i) {
  float s = 0;
  for (int r = 0; r < world; ++r) s += replay_value(r, k, i);
  return s;
}

}  // namespace mk::test
