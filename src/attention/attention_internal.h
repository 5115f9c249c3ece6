// Internal interface of the attention engine, for the tests.
#pragma once

#include <vector>

#include "gemm/gemm_internal.h"  // GemmKernelResources

namespace mk::detail {
// Every attention kernel instantiation the library launches, with its compiled resources.
std::vector<GemmKernelResources> attention_kernel_resources();
}  // namespace mk::detail
