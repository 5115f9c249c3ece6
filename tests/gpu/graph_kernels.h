#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>

namespace mk::test {

// input[i] = value(rank, *counter, i) (bf16)
void launch_fill(void* input, std::size_t count, int rank, const int* counter, cudaStream_t s);
// history[*counter][i] = output[i]; then ++*counter
void launch_record(const void* output, std::size_t count, void* history, int* counter,
                   cudaStream_t s);
// Sum over ranks of value(rank, k, i).
float expected_replay_sum(int world, int k, std::size_t i);

}  // namespace mk::test
