// The start of the benchmark tools that run one process per rank under mkrun.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdio>
#include <cstdlib>
#include <memory>

#include "bench_check.h"
#include "mkernel/bootstrap.h"

namespace mk::bench {

// This process's bootstrap from mkrun, with its GPU (rank % GPUs) made current; exits with a
// usage line (status 2) when the program was not started by mkrun.
inline std::unique_ptr<Bootstrap> mkrun_rank(const char* program) {
  if (!launched_by_mkrun()) {
    std::fprintf(stderr, "run me under mkrun: mkrun -n 2 -- %s\n", program);
    std::exit(2);
  }
  auto boot = bootstrap_from_launcher();
  int gpus = 0;
  CK(cudaGetDeviceCount(&gpus));
  CK(cudaSetDevice(boot->rank() % gpus));
  return boot;
}

}  // namespace mk::bench
