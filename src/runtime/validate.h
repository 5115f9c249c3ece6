// Internal: argument checks shared by every op. Each throws mk::Error naming the op, the argument,
// what it was and what was expected. All run on the host before anything is launched.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <string>

#include "mkernel/communicator.h"
#include "mkernel/types.h"

namespace mk::detail {

std::string hex(const void* p);

// The communicator is usable and single-node (the NVLink-only paths).
void require_usable(const Communicator& comm, const char* op);
void require_single_node(const Communicator& comm, const char* op);
void require_dtype(DType dtype, const char* op);

// a * b without overflow, else kInvalidArgument naming `what`.
std::size_t checked_mul(std::size_t a, std::size_t b, const char* op, const char* what);

// `ptr` is device memory of the communicator's GPU (or a symmetric buffer of it) and aligned to
// `alignment` bytes.
void require_device_pointer(const Communicator& comm, const void* ptr, std::size_t alignment,
                            const char* op, const char* name);
// [ptr, ptr + bytes) lies in one symmetric buffer of `comm`: returns where.
SymmetricRange require_symmetric(const Communicator& comm, const void* ptr, std::size_t bytes,
                                 const char* op, const char* name);
// The stream belongs to the communicator's GPU (or to GPU `expected_device`: the ops without a
// communicator, which run on the current device). A capturing stream is trusted (see there).
void require_stream(const Communicator& comm, cudaStream_t stream, const char* op);
void require_stream(int expected_device, cudaStream_t stream, const char* op);

bool overlaps(const void* a, std::size_t a_bytes, const void* b, std::size_t b_bytes);

// One argument's memory: what the op reads, or writes (itself or its peers).
struct Region {
  const char* name;
  const void* ptr;  // nullptr: absent (an optional output)
  std::size_t bytes;
  bool written;
};
// No region that is written shares memory with another region: kInvalidArgument naming both.
void require_disjoint(const char* op, std::initializer_list<Region> regions);

}  // namespace mk::detail
