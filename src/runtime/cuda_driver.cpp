#include "runtime/cuda_driver.h"

#include <cuda_runtime_api.h>

#include <mutex>
#include <string>

#include "mkernel/error.h"

namespace mk::detail {
namespace {

template <typename Fn>
void resolve(Fn& fn, const char* symbol) {
  void* ptr = nullptr;
  cudaDriverEntryPointQueryResult status{};
  // 12000: the ABI version of every entry point used here (all exist since CUDA 12.0).
  cudaError_t err =
      cudaGetDriverEntryPointByVersion(symbol, &ptr, 12000, cudaEnableDefault, &status);
  if (err != cudaSuccess || status != cudaDriverEntryPointSuccess || ptr == nullptr) {
    throw Error(ErrorCode::kCuda, std::string("CUDA driver entry point ") + symbol +
                                      " is unavailable (runtime error " + cudaGetErrorName(err) +
                                      "); is an NVIDIA driver >= 525 installed?");
  }
  fn = reinterpret_cast<Fn>(ptr);
}

// The same for an entry point mkernel can do without: nullptr when it is missing.
template <typename Fn>
void resolve_optional(Fn& fn, const char* symbol) {
  void* ptr = nullptr;
  cudaDriverEntryPointQueryResult status{};
  if (cudaGetDriverEntryPointByVersion(symbol, &ptr, 12000, cudaEnableDefault, &status) !=
          cudaSuccess ||
      status != cudaDriverEntryPointSuccess) {
    cudaGetLastError();
    ptr = nullptr;
  }
  fn = reinterpret_cast<Fn>(ptr);
}

DriverApi load() {
  DriverApi api{};
  resolve(api.GetErrorString, "cuGetErrorString");
  resolve(api.DeviceGet, "cuDeviceGet");
  resolve(api.DeviceGetAttribute, "cuDeviceGetAttribute");
  resolve(api.MemGetAllocationGranularity, "cuMemGetAllocationGranularity");
  resolve(api.MemCreate, "cuMemCreate");
  resolve(api.MemRelease, "cuMemRelease");
  resolve(api.MemExportToShareableHandle, "cuMemExportToShareableHandle");
  resolve(api.MemImportFromShareableHandle, "cuMemImportFromShareableHandle");
  resolve(api.MemAddressReserve, "cuMemAddressReserve");
  resolve(api.MemAddressFree, "cuMemAddressFree");
  resolve(api.MemMap, "cuMemMap");
  resolve(api.MemUnmap, "cuMemUnmap");
  resolve(api.MemSetAccess, "cuMemSetAccess");
  resolve(api.TensorMapEncodeTiled, "cuTensorMapEncodeTiled");
  resolve_optional(api.MemGetHandleForAddressRange, "cuMemGetHandleForAddressRange");
  return api;
}

}  // namespace

const DriverApi& driver() {
  static const DriverApi api = load();
  return api;
}

void check_cu(CUresult result, const char* what) {
  if (result == CUDA_SUCCESS) return;
  const char* msg = nullptr;
  if (driver().GetErrorString(result, &msg) != CUDA_SUCCESS || msg == nullptr)
    msg = "unknown error";
  throw Error(ErrorCode::kCuda, std::string(what) + " failed: " + msg + " (CUresult " +
                                    std::to_string(static_cast<int>(result)) + ")");
}

}  // namespace mk::detail
