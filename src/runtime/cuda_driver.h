// Internal: the few CUDA driver API calls mkernel needs (virtual memory management, tensor maps),
// resolved at run time through the runtime's entry-point query, so nothing links libcuda directly.
#pragma once

#include <cuda.h>

namespace mk::detail {

struct DriverApi {
  decltype(&::cuGetErrorString) GetErrorString;
  decltype(&::cuDeviceGet) DeviceGet;
  decltype(&::cuDeviceGetAttribute) DeviceGetAttribute;
  decltype(&::cuMemGetAllocationGranularity) MemGetAllocationGranularity;
  decltype(&::cuMemCreate) MemCreate;
  decltype(&::cuMemRelease) MemRelease;
  decltype(&::cuMemExportToShareableHandle) MemExportToShareableHandle;
  decltype(&::cuMemImportFromShareableHandle) MemImportFromShareableHandle;
  decltype(&::cuMemAddressReserve) MemAddressReserve;
  decltype(&::cuMemAddressFree) MemAddressFree;
  decltype(&::cuMemMap) MemMap;
  decltype(&::cuMemUnmap) MemUnmap;
  decltype(&::cuMemSetAccess) MemSetAccess;
  decltype(&::cuTensorMapEncodeTiled) TensorMapEncodeTiled;
  // Optional (nullptr when the driver lacks it): DMA-BUF export of GPU memory for RDMA NICs.
  decltype(&::cuMemGetHandleForAddressRange) MemGetHandleForAddressRange;
};

// Loaded once; throws mk::Error(kCuda) if the driver lacks an entry point.
const DriverApi& driver();

// Throws mk::Error(kCuda) naming `what` and the driver's message when `result` is not success.
void check_cu(CUresult result, const char* what);

}  // namespace mk::detail

#define MK_CU_CHECK(expr) ::mk::detail::check_cu((expr), #expr)
