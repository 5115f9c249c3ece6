#include "runtime/validate.h"

#include <cstdio>

#include "mkernel/error.h"

namespace mk::detail {

std::string hex(const void* p) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%p", p);
  return buf;
}

void require_usable(const Communicator& comm, const char* op) { comm.ensure_usable(op); }

void require_single_node(const Communicator& comm, const char* op) {
  if (comm.topology().num_nodes != 1) {
    throw Error(ErrorCode::kUnsupported,
                std::string(op) + ": the communicator spans " +
                    std::to_string(comm.topology().num_nodes) +
                    " nodes; this op runs inside one NVLink node only (expected 1 node)");
  }
}

void require_dtype(DType dtype, const char* op) {
  if (dtype != DType::kBF16 && dtype != DType::kF16 && dtype != DType::kF32) {
    throw Error(ErrorCode::kInvalidArgument, std::string(op) + ": unknown dtype " +
                                                 std::to_string(static_cast<int>(dtype)) +
                                                 "; expected bf16, f16 or f32");
  }
}

std::size_t checked_mul(std::size_t a, std::size_t b, const char* op, const char* what) {
  if (a != 0 && b > SIZE_MAX / a) {
    throw Error(ErrorCode::kInvalidArgument, std::string(op) + ": " + what + " overflows (" +
                                                 std::to_string(a) + " x " + std::to_string(b) +
                                                 ")");
  }
  return a * b;
}

void require_device_pointer(const Communicator& comm, const void* ptr, std::size_t alignment,
                            const char* op, const char* name) {
  if (ptr == nullptr) {
    throw Error(ErrorCode::kInvalidArgument, std::string(op) + ": " + name + " is null");
  }
  if (reinterpret_cast<uintptr_t>(ptr) % alignment != 0) {
    throw Error(ErrorCode::kInvalidArgument, std::string(op) + ": " + name + " " + hex(ptr) +
                                                 " is not aligned to " + std::to_string(alignment) +
                                                 " bytes");
  }
  cudaPointerAttributes attr{};
  cudaError_t err = cudaPointerGetAttributes(&attr, ptr);
  if (err != cudaSuccess) {
    cudaGetLastError();
    throw Error(ErrorCode::kInvalidArgument, std::string(op) + ": " + name + " " + hex(ptr) +
                                                 " is not a CUDA pointer (" +
                                                 cudaGetErrorString(err) + ")");
  }
  const bool on_device = attr.type == cudaMemoryTypeDevice || attr.type == cudaMemoryTypeManaged;
  if (!on_device || attr.device != comm.device()) {
    const char* kind = attr.type == cudaMemoryTypeHost           ? "pinned host memory"
                       : attr.type == cudaMemoryTypeUnregistered ? "unregistered host memory"
                                                                 : "device memory";
    throw Error(ErrorCode::kInvalidArgument,
                std::string(op) + ": " + name + " " + hex(ptr) + " is " + kind +
                    (on_device ? " of GPU " + std::to_string(attr.device) : std::string()) +
                    "; expected device memory of GPU " + std::to_string(comm.device()) +
                    " (this rank's)");
  }
}

SymmetricRange require_symmetric(const Communicator& comm, const void* ptr, std::size_t bytes,
                                 const char* op, const char* name) {
  SymmetricRange range = comm.find_symmetric(ptr, 1);
  if (range.device_peers == nullptr) {
    throw Error(ErrorCode::kInvalidArgument,
                std::string(op) + ": " + name + " " + hex(ptr) +
                    " is not inside a symmetric buffer of this communicator; allocate it with "
                    "Communicator::alloc()");
  }
  if (range.offset + bytes > range.size) {
    throw Error(ErrorCode::kOutOfMemory,
                std::string(op) + ": " + name + " needs " + std::to_string(bytes) +
                    " bytes from offset " + std::to_string(range.offset) +
                    " but its symmetric buffer has " + std::to_string(range.size) + " bytes");
  }
  return range;
}

void require_stream(const Communicator& comm, cudaStream_t stream, const char* op) {
  require_stream(comm.device(), stream, op);
}

void require_stream(int expected_device, cudaStream_t stream, const char* op) {
  // Querying a capturing stream's device would invalidate the capture: trust the caller there
  // (the capture itself fails if the stream belongs to another device).
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(stream, &capture) == cudaSuccess &&
      capture != cudaStreamCaptureStatusNone) {
    return;
  }
  cudaGetLastError();
  int device = -1;
  cudaError_t err = cudaStreamGetDevice(stream, &device);
  if (err != cudaSuccess) {
    cudaGetLastError();
    throw Error(ErrorCode::kInvalidArgument,
                std::string(op) + ": invalid stream (" + cudaGetErrorString(err) + ")");
  }
  if (device != expected_device) {
    throw Error(ErrorCode::kInvalidArgument,
                std::string(op) + ": the stream belongs to GPU " + std::to_string(device) +
                    "; expected a stream of GPU " + std::to_string(expected_device));
  }
}

bool overlaps(const void* a, std::size_t a_bytes, const void* b, std::size_t b_bytes) {
  const auto pa = reinterpret_cast<uintptr_t>(a), pb = reinterpret_cast<uintptr_t>(b);
  return pa < pb + b_bytes && pb < pa + a_bytes;
}

void require_disjoint(const char* op, std::initializer_list<Region> regions) {
  for (auto x = regions.begin(); x != regions.end(); ++x) {
    for (auto y = x + 1; y != regions.end(); ++y) {
      if (!(x->written || y->written) || x->ptr == nullptr || y->ptr == nullptr) continue;
      if (overlaps(x->ptr, x->bytes, y->ptr, y->bytes)) {
        const Region& w = x->written ? *x : *y;
        const Region& other = x->written ? *y : *x;
        throw Error(ErrorCode::kInvalidArgument, std::string(op) + ": " + w.name + " overlaps " +
                                                     other.name + " (" + w.name +
                                                     " is written while " + other.name +
                                                     (other.written ? " is written" : " is read") +
                                                     "; expected separate memory)");
      }
    }
  }
}

}  // namespace mk::detail
