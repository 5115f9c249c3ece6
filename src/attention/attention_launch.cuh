// The attention engine's kernels from host code (the .cu files that launch them).
#pragma once

#include "attention/attention_kernel.cuh"
#include "runtime/smem_opt_in.h"

namespace mk::attention_host {

// attention_kernel<C, Policy> with its shared memory allowed on the current device (which also
// loads it).
template <class C, class Policy>
auto prepared() {
  constexpr auto kernel = attention_engine::attention_kernel<C, Policy>;
  detail::allow_dynamic_smem<kernel>(C::kSmemBytes);
  return kernel;
}

}  // namespace mk::attention_host
