// How fast can one CTA move data over point-to-point NVLink, and how many CTAs does the link
// take? The fused kernels size their communication from these numbers (docs/PERFORMANCE.md):
// a CTA of T threads with V 16-byte vectors in flight per thread pushes (st.global to the peer),
// reduces (red.global.add.v4.f32 to the peer) or pulls (ld.global from the peer) B bytes; GPU 0
// talks to GPU 1, one direction - or, with --both, both directions at once (GPU 1 runs the same
// kernel towards GPU 0 meanwhile, as the reducing fused GEMMs do; GPU 0's time is reported).
//
//   build/bench/bench_p2p [--mib-per-cta N] [--both] [--bulk-only]
//   (default 2 MiB; needs two GPUs with P2P; --bulk-only: the bulk stores below only)
//
// Prints one line per (op, CTAs, threads, V): GB/s per CTA and in total, median of 5 runs.
// Then the copy engine of the SM (TMA): one thread per CTA pushes shared-memory buffers to the
// peer with bulk stores (cp.async.bulk.global.shared::cta), `bufs` buffers of `chunk` bytes in
// rotation, each reused once the store that last read it has read it (wait_group.read) - what
// an epilogue storing its slice straight into a peer's memory through its scratch buffers gets.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <utility>
#include <vector>

#include "bench_check.h"

namespace {

enum class Op { kPush, kReduce, kPull };
const char* name(Op op) {
  return op == Op::kPush ? "push" : op == Op::kReduce ? "red.add" : "pull";
}

// CTA b moves vectors [b * per_cta, (b + 1) * per_cta): each step every thread handles V
// vectors blockDim.x apart (coalesced), all V loads issued before the V stores.
template <int V, Op kOp>
__global__ void move(float4* remote, float4* local, long long per_cta) {
  const long long base = blockIdx.x * per_cta;
  const long long step = static_cast<long long>(blockDim.x) * V;
  for (long long i = threadIdx.x; i < per_cta; i += step) {
    float4 v[V];
#pragma unroll
    for (int j = 0; j < V; ++j) {
      const long long k = i + j * static_cast<long long>(blockDim.x);
      if (k < per_cta) v[j] = kOp == Op::kPull ? remote[base + k] : local[base + k];
    }
#pragma unroll
    for (int j = 0; j < V; ++j) {
      const long long k = i + j * static_cast<long long>(blockDim.x);
      if (k >= per_cta) break;
      if (kOp == Op::kPush) {
        remote[base + k] = v[j];
      } else if (kOp == Op::kPull) {
        local[base + k] = v[j];
      } else {
        float* p = reinterpret_cast<float*>(remote + base + k);
        asm volatile("red.relaxed.sys.global.add.v4.f32 [%0], {%1, %2, %3, %4};" ::"l"(p),
                     "f"(v[j].x), "f"(v[j].y), "f"(v[j].z), "f"(v[j].w)
                     : "memory");
      }
    }
  }
}

// One thread per CTA: CTA b stores bytes [b * per_cta, (b + 1) * per_cta) of `remote` from
// `bufs` shared buffers of `chunk` bytes in turn (contents irrelevant: the rate is measured).
__global__ void bulk_push(uint8_t* remote, long long per_cta, int chunk, int bufs) {
  extern __shared__ __align__(128) uint8_t smem[];
  if (threadIdx.x != 0) return;
  uint8_t* base = remote + blockIdx.x * per_cta;
  const long long chunks = per_cta / chunk;
  for (long long i = 0; i < chunks; ++i) {
    // at most bufs - 1 older groups may still be reading: buffer i % bufs is free
    if (bufs == 2) asm volatile("cp.async.bulk.wait_group.read 1;" ::: "memory");
    if (bufs == 4) asm volatile("cp.async.bulk.wait_group.read 3;" ::: "memory");
    if (bufs == 8) asm volatile("cp.async.bulk.wait_group.read 7;" ::: "memory");
    const uint32_t src = static_cast<uint32_t>(__cvta_generic_to_shared(smem + (i % bufs) * chunk));
    asm volatile(
        "cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(base + i * chunk),
        "r"(src), "r"(chunk)
        : "memory");
    asm volatile("cp.async.bulk.commit_group;" ::: "memory");
  }
  asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
}

template <Op kOp>
void launch(int v, int ctas, int threads, float4* remote, float4* local, long long per_cta,
            cudaStream_t stream) {
  switch (v) {
    case 1:
      move<1, kOp><<<ctas, threads, 0, stream>>>(remote, local, per_cta);
      break;
    case 2:
      move<2, kOp><<<ctas, threads, 0, stream>>>(remote, local, per_cta);
      break;
    case 4:
      move<4, kOp><<<ctas, threads, 0, stream>>>(remote, local, per_cta);
      break;
    default:
      move<8, kOp><<<ctas, threads, 0, stream>>>(remote, local, per_cta);
      break;
  }
}

void run(Op op, int v, int ctas, int threads, float4* remote, float4* local, long long per_cta,
         cudaStream_t stream = nullptr) {
  if (op == Op::kPush) launch<Op::kPush>(v, ctas, threads, remote, local, per_cta, stream);
  if (op == Op::kReduce) launch<Op::kReduce>(v, ctas, threads, remote, local, per_cta, stream);
  if (op == Op::kPull) launch<Op::kPull>(v, ctas, threads, remote, local, per_cta, stream);
}

}  // namespace

int main(int argc, char** argv) {
  double mib_per_cta = 2;
  bool both = false, bulk_only = false;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--mib-per-cta") == 0 && i + 1 < argc) {
      mib_per_cta = std::atof(argv[++i]);
    } else if (std::strcmp(argv[i], "--both") == 0) {
      both = true;
    } else if (std::strcmp(argv[i], "--bulk-only") == 0) {
      bulk_only = true;
    } else {
      std::fprintf(stderr, "usage: bench_p2p [--mib-per-cta N] [--both] [--bulk-only]\n");
      return 2;
    }
  }
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices < 2) {
    std::fprintf(stderr, "bench_p2p: needs two GPUs (found %d); nothing measured\n", devices);
    return 3;
  }
  int can = 0;
  CK(cudaDeviceCanAccessPeer(&can, 0, 1));
  if (!can) {
    std::fprintf(stderr, "bench_p2p: GPU 0 cannot access GPU 1 (no P2P); nothing measured\n");
    return 3;
  }
  const int kMaxCtas = 132;
  const long long per_cta = static_cast<long long>(mib_per_cta * (1 << 20)) / 16;
  const size_t bytes = static_cast<size_t>(per_cta) * 16 * kMaxCtas;
  float4 *remote = nullptr, *local = nullptr;
  CK(cudaSetDevice(1));
  CK(cudaMalloc(&remote, bytes));
  CK(cudaMemset(remote, 0, bytes));
  CK(cudaSetDevice(0));
  CK(cudaDeviceEnablePeerAccess(1, 0));
  CK(cudaMalloc(&local, bytes));
  CK(cudaMemset(local, 0, bytes));
  // --both: GPU 1's own pair of buffers, pushing / pulling towards GPU 0 at the same time.
  float4 *remote1 = nullptr, *local1 = nullptr;
  cudaStream_t stream1 = nullptr;
  if (both) {
    CK(cudaMalloc(&remote1, bytes));  // on GPU 0
    CK(cudaMemset(remote1, 0, bytes));
    CK(cudaSetDevice(1));
    CK(cudaDeviceEnablePeerAccess(0, 0));
    CK(cudaMalloc(&local1, bytes));
    CK(cudaMemset(local1, 0, bytes));
    CK(cudaStreamCreateWithFlags(&stream1, cudaStreamNonBlocking));
    CK(cudaDeviceSynchronize());
    CK(cudaSetDevice(0));
  }
  // GPU 1's run in the other direction (a few times GPU 0's work, so that it covers it).
  auto other = [&](Op op, int v, int ctas, int threads) {
    if (!both) return;
    CK(cudaSetDevice(1));
    for (int i = 0; i < 3; ++i) run(op, v, ctas, threads, remote1, local1, per_cta, stream1);
    CK(cudaSetDevice(0));
  };
  auto other_done = [&]() {
    if (!both) return;
    CK(cudaSetDevice(1));
    CK(cudaStreamSynchronize(stream1));
    CK(cudaSetDevice(0));
  };
  cudaEvent_t start, stop;
  CK(cudaEventCreate(&start));
  CK(cudaEventCreate(&stop));
  // The median of five timed runs of `kernel` on GPU 0 (after a warm-up), each with `other`
  // queued first on GPU 1 (the other direction, --both) and waited for after.
  auto median_ms = [&](auto&& kernel, auto&& other_first) {
    kernel();  // warm-up
    std::vector<float> ms(5);
    for (float& t : ms) {
      other_first();
      CK(cudaEventRecord(start));
      kernel();
      CK(cudaEventRecord(stop));
      CK(cudaEventSynchronize(stop));
      CK(cudaEventElapsedTime(&t, start, stop));
      other_done();
    }
    CK(cudaGetLastError());
    std::sort(ms.begin(), ms.end());
    return ms[2];
  };
  std::printf("%-8s %5s %7s %2s %12s %12s%s\n", "op", "CTAs", "threads", "V", "GB/s per CTA",
              "GB/s total", both ? "  (both directions at once)" : "");
  const std::vector<int> all_ctas = {1, 4, 16, 33, 66, 132}, all_threads = {96, 128, 256, 512};
  const std::vector<int> some_ctas = {66, 131, 132}, some_threads = {96};
  for (Op op : {Op::kPush, Op::kReduce, Op::kPull}) {
    if (bulk_only) break;
    for (int ctas : both ? some_ctas : all_ctas) {
      for (int threads : both ? some_threads : all_threads) {
        for (int v : {1, 2, 4, 8}) {
          const float ms = median_ms([&] { run(op, v, ctas, threads, remote, local, per_cta); },
                                     [&] { other(op, v, ctas, threads); });
          const double per_cta_gbs = static_cast<double>(per_cta) * 16 / (ms * 1e6);
          std::printf("%-8s %5d %7d %2d %12.2f %12.1f\n", name(op), ctas, threads, v, per_cta_gbs,
                      per_cta_gbs * ctas);
        }
      }
    }
  }
  // The SM's bulk copies (TMA) into the peer, one issuing thread per CTA.
  CK(cudaFuncSetAttribute(bulk_push, cudaFuncAttributeMaxDynamicSharedMemorySize, 200 * 1024));
  const long long per_cta_bytes = per_cta * 16;
  std::printf("\n%-8s %5s %7s %5s %12s %12s\n", "op", "CTAs", "chunk", "bufs", "GB/s per CTA",
              "GB/s total");
  for (int ctas : both ? some_ctas : all_ctas) {
    for (const auto [chunk, bufs] : {std::pair{8192, 2}, std::pair{8192, 4}, std::pair{16384, 2},
                                     std::pair{16384, 4}, std::pair{32768, 4}}) {
      auto go = [&](cudaStream_t s, uint8_t* dst) {
        bulk_push<<<ctas, 32, chunk * bufs, s>>>(dst, per_cta_bytes, chunk, bufs);
      };
      const float ms =
          median_ms([&] { go(nullptr, reinterpret_cast<uint8_t*>(remote)); },
                    [&] {
                      if (!both) return;
                      CK(cudaSetDevice(1));
                      CK(cudaFuncSetAttribute(
                          bulk_push, cudaFuncAttributeMaxDynamicSharedMemorySize, 200 * 1024));
                      for (int i = 0; i < 3; ++i) go(stream1, reinterpret_cast<uint8_t*>(remote1));
                      CK(cudaSetDevice(0));
                    });
      const double per_cta_gbs = static_cast<double>(per_cta_bytes) / (ms * 1e6);
      std::printf("%-8s %5d %7d %5d %12.2f %12.1f\n", "bulk", ctas, chunk, bufs, per_cta_gbs,
                  per_cta_gbs * ctas);
    }
  }
  cudaFree(local);
  CK(cudaSetDevice(1));
  cudaFree(remote);
  return 0;
}
