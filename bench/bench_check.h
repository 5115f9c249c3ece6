// The benchmarks' CUDA runtime check: a failed call ends the program, naming the call, the error
// and the place (exit status 2).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdio>
#include <cstdlib>

#define CK(x)                                                                               \
  do {                                                                                      \
    cudaError_t e_ = (x);                                                                   \
    if (e_ != cudaSuccess) {                                                                \
      std::fprintf(stderr, "%s failed: %s (%s:%d)\n", #x, cudaGetErrorString(e_), __FILE__, \
                   __LINE__);                                                               \
      std::exit(2);                                                                         \
    }                                                                                       \
  } while (0)
