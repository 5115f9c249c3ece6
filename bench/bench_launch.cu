// Host time of issuing one op, piece by piece: what the CPU pays per call before the GPU works.
//   mkrun -n 2 -- bench_launch [--shape MxNxK] [--calls 200]
// For a decode-sized gemm_ar (tens of microseconds on the GPU) the host's share matters: this
// times the CUDA calls an op makes (pointer and stream queries, tensor-map encoding, the
// attribute call, kernel launches with small and large parameter blocks) and the library's
// entries (mk::gemm, mk::gemm_ar) as the host sees them: microseconds per call of `calls`
// back-to-back calls, nothing waited for in between (the GPU queue stays far from full), median
// of five rounds. Rank 0 prints the table; ranks may share a GPU (host times stay meaningful).
#include <cuda.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <functional>
#include <string>
#include <vector>

#include "bench_check.h"
#include "bench_kernels.h"
#include "bench_rank.h"
#include "gemm/gemm_internal.h"
#include "mkernel/mkernel.h"

namespace {

using namespace mk;

struct Big {
  unsigned char bytes[1024];
};

__global__ void small_params(int x, int* out) {
  if (out != nullptr && x < 0) *out = x;
}
__global__ void big_params(const __grid_constant__ Big big, int* out) {
  if (out != nullptr && big.bytes[0] == 255) *out = 1;
}

double host_us(int calls, const std::function<void()>& fn) {
  std::vector<double> rounds;
  for (int r = 0; r < 5; ++r) {
    CK(cudaDeviceSynchronize());
    const auto start = std::chrono::steady_clock::now();
    for (int i = 0; i < calls; ++i) fn();
    const auto stop = std::chrono::steady_clock::now();
    rounds.push_back(std::chrono::duration<double, std::micro>(stop - start).count() / calls);
  }
  CK(cudaDeviceSynchronize());
  std::sort(rounds.begin(), rounds.end());
  return rounds[rounds.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  int64_t m = 128, n = 8192, k = 8192;
  int calls = 200;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string key = argv[i], v = argv[i + 1];
    if (key == "--shape") {
      std::sscanf(v.c_str(), "%ldx%ldx%ld", &m, &n, &k);
    } else if (key == "--calls") {
      calls = std::atoi(v.c_str());
    }
  }
  auto comm = Communicator::create(bench::mkrun_rank(argv[0]));
  int ndev = 0;
  CK(cudaGetDeviceCount(&ndev));
  const int rank = comm->rank(), world = comm->world_size();
  const int64_t kl = k / world;
  cudaStream_t stream;
  CK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  void *a, *b, *c;
  CK(cudaMalloc(&a, m * kl * 2));
  CK(cudaMalloc(&b, n * kl * 2));
  CK(cudaMalloc(&c, m * n * 2));
  bench::launch_fill(a, m * kl, 1, rank, stream);
  bench::launch_fill(b, n * kl, 2, rank, stream);
  SymmetricBuffer ws =
      comm->alloc(std::max<std::size_t>(gemm_ar_workspace_bytes(*comm, m, n, kl), 16));
  CK(cudaMemsetAsync(ws.data(), 0, ws.size(), stream));
  SymmetricBuffer out = comm->alloc(m * n * 2);
  CK(cudaFuncSetAttribute(small_params, cudaFuncAttributeMaxDynamicSharedMemorySize, 0));
  CK(cudaStreamSynchronize(stream));
  comm->bootstrap().barrier();

  std::vector<std::pair<std::string, double>> rows;
  auto time = [&](const std::string& name, const std::function<void()>& fn) {
    fn();  // warm
    comm->bootstrap().barrier();
    rows.emplace_back(name, host_us(calls, fn));
  };
  cudaPointerAttributes attr{};
  time("cudaPointerGetAttributes", [&] { CK(cudaPointerGetAttributes(&attr, a)); });
  cudaStreamCaptureStatus capture{};
  time("cudaStreamIsCapturing", [&] { CK(cudaStreamIsCapturing(stream, &capture)); });
  int device = 0;
  time("cudaStreamGetDevice", [&] { CK(cudaStreamGetDevice(stream, &device)); });
  time("cudaGetDevice", [&] { CK(cudaGetDevice(&device)); });
  time("cudaFuncSetAttribute", [&] {
    CK(cudaFuncSetAttribute(small_params, cudaFuncAttributeMaxDynamicSharedMemorySize, 0));
  });
  time("tensor map encode (make_map)", [&] { (void)gemm_engine::make_map(a, m, kl, 128); });
  time("launch, 12 B of parameters", [&] { small_params<<<1, 32, 0, stream>>>(1, nullptr); });
  Big big{};
  time("launch, 1 KiB of parameters", [&] { big_params<<<1, 32, 0, stream>>>(big, nullptr); });
  time("launch, 1 KiB, 132 CTAs x 384", [&] { big_params<<<132, 384, 0, stream>>>(big, nullptr); });
  time("mk::gemm (" + std::to_string(m) + "x" + std::to_string(n) + "x" + std::to_string(kl) + ")",
       [&] { gemm(a, b, c, m, n, kl, BLayout::kNK, stream); });
  time("mk::gemm_ar_plan", [&] { (void)gemm_ar_plan(*comm, m, n, kl); });
  time("mk::gemm_ar (" + std::to_string(m) + "x" + std::to_string(n) + "x" + std::to_string(k) +
           ", world " + std::to_string(world) + ")",
       [&] { gemm_ar(*comm, a, b, out.data(), m, n, kl, BLayout::kNK, ws.data(), stream); });
  CK(cudaStreamSynchronize(stream));
  comm->bootstrap().barrier();
  if (rank == 0) {
    std::printf("bench_launch: %d rank(s) on %d GPU(s); host microseconds per call (%d calls)\n",
                world, ndev, calls);
    for (const auto& [name, us] : rows) std::printf("  %-44s %7.2f us\n", name.c_str(), us);
  }
  comm->bootstrap().barrier();
  return 0;
}
