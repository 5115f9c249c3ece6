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
    changed_ = previous_ != device;
  }
  ~DeviceGuard() {
    if (changed_) cudaSetDevice(previous_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = 0;
  bool changed_ = false;
};

// Puts this thread's stream-capture mode to relaxed for a scope, restoring it after. For the
// library's one-time setup (host-pinned memory, streams, the inter-node path) when it runs on first
// use, possibly while the caller captures a CUDA graph (the allocations are not part of the graph:
// they happen once, now). (The inter-node path's own threads set relaxed once for good: their
// staging copies must not count as unsafe calls during another thread's global-mode capture.)
class RelaxedCapture {
 public:
  RelaxedCapture() { cudaThreadExchangeStreamCaptureMode(&previous_); }
  ~RelaxedCapture() { cudaThreadExchangeStreamCaptureMode(&previous_); }
  RelaxedCapture(const RelaxedCapture&) = delete;
  RelaxedCapture& operator=(const RelaxedCapture&) = delete;

 private:
  cudaStreamCaptureMode previous_ = cudaStreamCaptureModeRelaxed;
};

}  // namespace mk::detail
