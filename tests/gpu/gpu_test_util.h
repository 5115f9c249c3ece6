// Shared helpers of the GPU suite: skipping without a GPU, running N ranks in-process (threads) or
// as mkrun processes, random data, and the reduction tolerance rule.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "mkernel/mkernel.h"

namespace mk::test {

#define MKT_CUDA(expr)                                                        \
  do {                                                                        \
    cudaError_t e_ = (expr);                                                  \
    if (e_ != cudaSuccess) FAIL() << #expr << ": " << cudaGetErrorString(e_); \
  } while (0)

// Empty when a Hopper GPU is usable, else the reason to skip.
inline std::string gpu_skip_reason() {
  int n = 0;
  cudaError_t err = cudaGetDeviceCount(&n);
  if (err != cudaSuccess) return std::string("no CUDA GPU: ") + cudaGetErrorString(err);
  if (n == 0) return "no CUDA GPU: none visible";
  cudaDeviceProp prop{};
  cudaGetDeviceProperties(&prop, 0);
  if (prop.major < 9) return std::string("GPU ") + prop.name + " is not Hopper (sm_90)";
  return {};
}

#define MKT_REQUIRE_GPU()                                      \
  do {                                                         \
    const std::string reason_ = ::mk::test::gpu_skip_reason(); \
    if (!reason_.empty()) GTEST_SKIP() << reason_;             \
  } while (0)

// `graph` instantiated and uploaded (on `stream`, waited for), so that its first launch has no
// work of its own. Ranks sharing a GPU in one process prepare their graphs before they meet: a
// first launch's upload, queued behind a peer's kernel that already waits for this rank, left
// both waiting until the time limit (InProcessRuntime.GraphReplays1000Times, H200, 2026-12-01).
// (Use as ASSERT_NO_FATAL_FAILURE(instantiate_uploaded(graph, stream, &exec)).)
inline void instantiate_uploaded(cudaGraph_t graph, cudaStream_t stream, cudaGraphExec_t* exec) {
  MKT_CUDA(cudaGraphInstantiate(exec, graph, 0));
  MKT_CUDA(cudaGraphUpload(*exec, stream));
  MKT_CUDA(cudaStreamSynchronize(stream));
}

inline int device_count() {
  int n = 0;
  cudaGetDeviceCount(&n);
  return n;
}

// GPUs the in-process tests spread ranks over: all, or MKERNEL_TEST_DEVICES of them.
inline int test_devices() {
  const char* env = std::getenv("MKERNEL_TEST_DEVICES");
  const int n = device_count();
  return env ? std::max(1, std::min(n, std::atoi(env))) : n;
}

// Runs fn(comm) on `world` ranks, one thread each, rank r on GPU r % device_count().
// Failures inside fn are reported through gtest (EXPECT_* is thread-safe); exceptions are
// caught and reported with the rank.
inline void run_in_process(int world, const std::function<void(Communicator&)>& fn,
                           CommOptions options = {}) {
  InProcessGroup group(world);
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r] {
      try {
        cudaSetDevice(r % test_devices());
        auto comm = Communicator::create(group.bootstrap(r), options);
        fn(*comm);
      } catch (const std::exception& e) {
        // Printed at once as well: the other ranks may now wait for this one in a collective
        // until their bootstrap time limit, and the failure report comes only after the join.
        std::fprintf(stderr, "[run_in_process] rank %d threw: %s\n", r, e.what());
        ADD_FAILURE() << "rank " << r << " threw: " << e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
}

// The process-wide mkrun bootstrap (nullptr when not launched by mkrun).
inline Bootstrap* launcher_bootstrap() {
  static std::unique_ptr<Bootstrap> boot =
      launched_by_mkrun() ? bootstrap_from_launcher() : nullptr;
  return boot.get();
}

#define MKT_REQUIRE_MKRUN()                                                    \
  do {                                                                         \
    MKT_REQUIRE_GPU();                                                         \
    if (::mk::test::launcher_bootstrap() == nullptr)                           \
      GTEST_SKIP() << "not started by mkrun (ctest runs these as mkrun -n N)"; \
  } while (0)

// Virtual nodes of `ranks_per_node` ranks (MKERNEL_GPUS_PER_NODE's option; issue 8's tests on
// one host) and a kernel time limit.
inline CommOptions virtual_nodes(int ranks_per_node, double timeout_seconds = 30) {
  CommOptions options;
  options.ranks_per_node = ranks_per_node;
  options.timeout_seconds = timeout_seconds;
  return options;
}

// Tests over (nodes, ranks per node) layouts, named "2x1", "3x2", ...
using NodesLayout = std::pair<int, int>;
class AcrossNodes : public ::testing::TestWithParam<NodesLayout> {};
inline std::string layout_name(const ::testing::TestParamInfo<NodesLayout>& info) {
  return std::to_string(info.param.first) + "x" + std::to_string(info.param.second);
}

inline std::shared_ptr<Communicator> launched_comm(CommOptions options = {}) {
  Bootstrap* boot = launcher_bootstrap();
  cudaSetDevice(boot->rank() % device_count());
  return Communicator::create(borrow_bootstrap(*boot), options);
}

// Runs fn() and expects mk::Error with `code` and a message containing `needle`.
template <typename Fn>
void expect_error(Fn&& fn, ErrorCode code, const std::string& needle) {
  try {
    fn();
    ADD_FAILURE() << "expected an error containing '" << needle << "'";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), code) << e.what();
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}

// ---- data ---------------------------------------------------------------------------------------

inline uint16_t to_bits(float f, DType t) {
  if (t == DType::kBF16) return static_cast<__nv_bfloat16_raw>(__float2bfloat16_rn(f)).x;
  return static_cast<__half_raw>(__float2half_rn(f)).x;
}

inline float from_bits(uint16_t u, DType t) {
  if (t == DType::kBF16) {
    __nv_bfloat16_raw raw;
    raw.x = u;
    return __bfloat162float(__nv_bfloat16(raw));
  }
  __half_raw raw;
  raw.x = u;
  return __half2float(__half(raw));
}

// Host image of `count` random elements of dtype t in [-1, 1), from `seed`.
inline std::vector<unsigned char> random_elements(std::size_t count, DType t, uint64_t seed) {
  std::mt19937_64 gen(seed);
  std::uniform_real_distribution<float> dist(-1.f, 1.f);
  std::vector<unsigned char> out(count * dtype_size(t));
  for (std::size_t i = 0; i < count; ++i) {
    const float f = dist(gen);
    if (t == DType::kF32) {
      std::memcpy(&out[i * 4], &f, 4);
    } else {
      const uint16_t u = to_bits(f, t);
      std::memcpy(&out[i * 2], &u, 2);
    }
  }
  return out;
}

inline double element(const std::vector<unsigned char>& data, std::size_t i, DType t) {
  if (t == DType::kF32) {
    float f;
    std::memcpy(&f, &data[i * 4], 4);
    return f;
  }
  uint16_t u;
  std::memcpy(&u, &data[i * 2], 2);
  return from_bits(u, t);
}

// Unit in the last place of |x| in dtype t (relative precision 2^-8 bf16, 2^-11 f16, 2^-24 f32).
inline double ulp(double x, DType t) {
  const int mant = t == DType::kBF16 ? 8 : t == DType::kF16 ? 11 : 24;
  const double ax = std::max(std::fabs(x), t == DType::kF16 ? 6.1e-5 : 1.2e-38);
  return std::ldexp(1.0, std::ilogb(ax) - mant + 1);
}

// The tolerance rule for sums: fp32 accumulation then one rounding to the dtype can be off from
// the exact (fp64) sum by at most one ulp of the result plus the fp32 accumulation error. (NCCL's
// bf16 reductions round after every step, so its error bound is at least this.)
inline bool sum_close(double got, double exact, double abs_sum, DType t) {
  const double tol = ulp(exact, t) + 4 * 6e-8 * abs_sum + 1e-30;
  return std::fabs(got - exact) <= tol;  // false for NaN
}

inline uint64_t fnv1a(const void* data, std::size_t bytes) {
  uint64_t h = 1469598103934665603ull;
  const auto* p = static_cast<const unsigned char*>(data);
  for (std::size_t i = 0; i < bytes; ++i) h = (h ^ p[i]) * 1099511628211ull;
  return h;
}

}  // namespace mk::test
