// The fused GEMMs' plans - tile width, CTAs, pieces, workspace, staging, tile order - as host
// functions of what they need of the communicator (PlanContext), so that they are tested without
// GPUs (tests/cpu/test_fused_plans.cpp). mk::ag_gemm_plan and friends call these.
#pragma once

#include <cstdint>
#include <vector>

#include "fused/fused_common.h"
#include "mkernel/fused.h"

namespace mk::fused {

FusedGemmPlan plan_ag_gemm(const PlanContext& ctx, int64_t m, int64_t n, int64_t k,
                           const FusedGemmConfig& config);
FusedGemmPlan plan_gemm_rs(const PlanContext& ctx, int64_t m, int64_t n, int64_t k_local,
                           const FusedGemmConfig& config);
FusedGemmPlan plan_gemm_ar(const PlanContext& ctx, int64_t m, int64_t n, int64_t k_local,
                           const FusedGemmConfig& config);

}  // namespace mk::fused

namespace mk {
struct GemmKernelResources;  // gemm/gemm_internal.h
}
namespace mk::detail {
// Every ag_gemm kernel (widths x B layouts, one node and across nodes), with its compiled
// resources.
std::vector<GemmKernelResources> ag_gemm_kernel_resources();
}  // namespace mk::detail
