// Internal interface of the GEMM engine, shared by the fused kernels and the tests.
#pragma once

#include <cuda.h>

#include <cstdint>
#include <string>
#include <vector>

namespace mk {

namespace gemm_engine {
// 2-D tensor map over a row-major [rows, cols] bf16 matrix, boxes of [box_rows, 64 cols] with
// 128-byte swizzling; out-of-bounds reads as zero, out-of-bounds writes are dropped.
CUtensorMap make_map(const void* base, int64_t rows, int64_t cols, int box_rows);
}  // namespace gemm_engine

struct GemmKernelResources {
  std::string name;
  int registers;          // per thread, as compiled (setmaxnreg moves them between roles)
  int64_t local_bytes;    // local memory per thread: spills or stack; must be 0
  int64_t max_dynamic_smem;
};

namespace detail {
// Every GEMM kernel instantiation the library launches, with its compiled resources.
std::vector<GemmKernelResources> gemm_kernel_resources();
}  // namespace detail

}  // namespace mk
