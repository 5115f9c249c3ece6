// Internal: turn CUDA runtime failures into mk::Error.
#pragma once

#include <cuda_runtime_api.h>

#include <string>

#include "mkernel/error.h"

namespace mk::detail {

[[noreturn]] inline void throw_cuda(cudaError_t err, const char* what, const char* file, int line) {
  throw Error(ErrorCode::kCuda, std::string(what) + " failed: " + cudaGetErrorName(err) + " (" +
                                    cudaGetErrorString(err) + ") at " + file + ":" +
                                    std::to_string(line));
}

}  // namespace mk::detail

#define MK_CUDA_CHECK(expr)                                         \
  do {                                                              \
    cudaError_t mk_err_ = (expr);                                   \
    if (mk_err_ != cudaSuccess) {                                   \
      ::mk::detail::throw_cuda(mk_err_, #expr, __FILE__, __LINE__); \
    }                                                               \
  } while (0)
