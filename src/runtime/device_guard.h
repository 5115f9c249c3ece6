// Internal: make a device current for a scope, restoring the previous one.
#pragma once

#include <cuda_runtime_api.h>

#include "runtime/cuda_check.h"

namespace mk::detail {

class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    MK_CUDA_CHECK(cudaGetDevice(&previous_));
    if (previous_ != device) MK_CUDA_CHECK(cudaSetDevice(device));
  }
  ~DeviceGuard() { cudaSetDevice(previous_); }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = 0;
};

}  // namespace mk::detail
