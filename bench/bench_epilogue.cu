// How long does a consumer warpgroup take for the reducing GEMMs' epilogue memory work on an
// otherwise idle GPU? The timelines (MKERNEL_TRACE) show ~10 us to add a 64 x 256 fp32 partial
// slice (64 KiB) and ~6 us to stage one, inside gemm_rs at 8192^3; this separates the code's own
// speed from contention with the GEMM. One CTA = one warpgroup (128 threads), two per SM as in
// the fused kernel; each works on its own slices:
//   add        add_and_clear (src/fused/partials.cuh) without clearing (two ranks)
//   add+clear  the same, zeroing the slice (three or more ranks)
//   stage      the outbox's staging write (float2 stores into a bf16 tile footprint)
//   read4      a coalesced float4 read of the slice (the best case for 64 KiB)
// "hot": the same slice every repetition (L2); "cold": a new slice each time (HBM).
// --beside-gemm S: the same while the GEMM engine (mk::gemm, 8192 x 8192 x 4096, persistent on S
// SMs, back to back) runs on another stream; the operations then run on the SMs the GEMM leaves
// free. Slow there as well: the contention is in L2 / the memory system (TMA multicast would
// relieve it); fast: it is inside the SM (multicast would not help).
//
//   build/bench/bench_epilogue [--ctas N] [--beside-gemm S]   (default 2 x the SM count CTAs)
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "bench_check.h"
#include "fused/partials.cuh"
#include "mkernel/gemm.h"

namespace {

constexpr int kRows = 64, kWidth = 256, kRegs = 128;  // a consumer's slice at 128 x 256 tiles
constexpr int kSliceFloats = kRows * kWidth;
constexpr int kReps = 16;

enum Mode { kAdd, kAddClear, kStage, kRead4, kModes };
const char* mode_name(int m) {
  static const char* names[] = {"add", "add+clear", "stage", "read4"};
  return names[m];
}

// times[cta * kReps + rep] = ns of repetition rep. Slice of (cta, rep): cold ? cta * kReps + rep
// : cta. sink keeps the work alive.
template <int kMode>
__global__ void __launch_bounds__(128)
    epilogue(float* slices, bool cold, uint64_t* times, float* sink) {
  const int t = threadIdx.x;
  float acc[kRegs];
#pragma unroll
  for (int i = 0; i < kRegs; ++i) acc[i] = 0.001f * (i + t);
  for (int rep = 0; rep < kReps; ++rep) {
    const long long index = cold ? static_cast<long long>(blockIdx.x) * kReps + rep : blockIdx.x;
    float* slice = slices + index * kSliceFloats;
    __syncthreads();
    const uint64_t t0 = mk::dev::global_timer_ns();
    if constexpr (kMode == kAdd || kMode == kAddClear) {
      mk::fused::add_and_clear(
          acc, [&](int r, int c) { return slice + r * kWidth + c; }, kRows, kWidth,
          kMode == kAddClear ? slice : nullptr, 1);
    } else if constexpr (kMode == kStage) {
      // outbox_post's loop: fp32 row r of the slot = bf16 rows 2r and 2r + 1 of a 128 x 256 tile
      const mk::fused::PartialAt at{slice, kWidth, slice + kWidth / 2, kWidth, kWidth / 2};
      const int r = (t / 32) * 16 + (t % 32) / 4, c = 2 * (t % 4);
#pragma unroll
      for (int b = 0; b < kRegs / 4; ++b) {
        const int col = c + 8 * b;
        *reinterpret_cast<float2*>(at(r, col)) = make_float2(acc[4 * b], acc[4 * b + 1]);
        *reinterpret_cast<float2*>(at(r + 8, col)) = make_float2(acc[4 * b + 2], acc[4 * b + 3]);
      }
    } else {
      const float4* p = reinterpret_cast<const float4*>(slice);
      float4 v[8];
      for (int u0 = t; u0 < kSliceFloats / 4; u0 += 128 * 8) {
#pragma unroll
        for (int i = 0; i < 8; ++i) v[i] = __ldcg(p + u0 + 128 * i);
#pragma unroll
        for (int i = 0; i < 8; ++i) acc[(4 * i) % kRegs] += v[i].x + v[i].y + v[i].z + v[i].w;
      }
    }
    __syncthreads();  // every thread's loads are back (stores: issued)
    if (t == 0) times[blockIdx.x * kReps + rep] = mk::dev::global_timer_ns() - t0;
  }
  float s = 0;
#pragma unroll
  for (int i = 0; i < kRegs; ++i) s += acc[i];
  if (s == 12345.f) sink[t] = s;
}

void launch(int mode, int ctas, float* slices, bool cold, uint64_t* times, float* sink,
            cudaStream_t s) {
  switch (mode) {
    case kAdd:
      epilogue<kAdd><<<ctas, 128, 0, s>>>(slices, cold, times, sink);
      break;
    case kAddClear:
      epilogue<kAddClear><<<ctas, 128, 0, s>>>(slices, cold, times, sink);
      break;
    case kStage:
      epilogue<kStage><<<ctas, 128, 0, s>>>(slices, cold, times, sink);
      break;
    default:
      epilogue<kRead4><<<ctas, 128, 0, s>>>(slices, cold, times, sink);
      break;
  }
}

}  // namespace

int main(int argc, char** argv) {
  int sms = 0;
  if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0) != cudaSuccess) {
    std::fprintf(stderr, "bench_epilogue: no GPU; nothing measured\n");
    return 3;
  }
  int ctas = 2 * sms, gemm_sms = 0;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--ctas") == 0 && i + 1 < argc) {
      ctas = std::atoi(argv[++i]);
    } else if (std::strcmp(argv[i], "--beside-gemm") == 0 && i + 1 < argc) {
      gemm_sms = std::atoi(argv[++i]);
    } else {
      std::fprintf(stderr, "usage: bench_epilogue [--ctas N] [--beside-gemm SMS]\n");
      return 2;
    }
  }
  // The GEMM beside the operations (--beside-gemm): its operands and a stream of its own.
  const int64_t gm = 8192, gn = 8192, gk = 4096;
  void *ga = nullptr, *gb = nullptr, *gc = nullptr;
  cudaStream_t gemm_stream = nullptr, ops_stream = nullptr;
  cudaEvent_t first_gemm = nullptr;
  CK(cudaStreamCreateWithFlags(&ops_stream, cudaStreamNonBlocking));
  mk::GemmConfig gemm_config;
  gemm_config.sms = gemm_sms;
  if (gemm_sms > 0) {
    CK(cudaMalloc(&ga, gm * gk * 2));
    CK(cudaMalloc(&gb, gn * gk * 2));
    CK(cudaMalloc(&gc, gm * gn * 2));
    CK(cudaMemset(ga, 0x3c, gm * gk * 2));  // bf16 ~1.2: finite products
    CK(cudaMemset(gb, 0x3c, gn * gk * 2));
    CK(cudaStreamCreateWithFlags(&gemm_stream, cudaStreamNonBlocking));
    CK(cudaEventCreate(&first_gemm));
    mk::gemm(ga, gb, gc, gm, gn, gk, mk::BLayout::kNK, gemm_stream, gemm_config);  // loads it
    CK(cudaDeviceSynchronize());
  }
  // ~25 GEMMs back to back (tens of ms, far longer than one measurement); returns once the
  // first is done, i.e. while the others hold their SMs.
  auto start_gemms = [&]() {
    if (gemm_sms == 0) return;
    mk::gemm(ga, gb, gc, gm, gn, gk, mk::BLayout::kNK, gemm_stream, gemm_config);
    CK(cudaEventRecord(first_gemm, gemm_stream));
    for (int i = 0; i < 24; ++i) {
      mk::gemm(ga, gb, gc, gm, gn, gk, mk::BLayout::kNK, gemm_stream, gemm_config);
    }
    CK(cudaEventSynchronize(first_gemm));
  };
  const size_t slices_count = static_cast<size_t>(ctas) * kReps;
  float* slices = nullptr;
  uint64_t* times = nullptr;
  float* sink = nullptr;
  CK(cudaMalloc(&slices, slices_count * kSliceFloats * 4));
  CK(cudaMemset(slices, 0, slices_count * kSliceFloats * 4));
  CK(cudaMalloc(&times, slices_count * 8));
  CK(cudaMalloc(&sink, 128 * 4));
  // A buffer larger than L2 to evict the slices between cold runs.
  const size_t flush_bytes = size_t{512} << 20;
  void* flush = nullptr;
  CK(cudaMalloc(&flush, flush_bytes));
  std::printf(
      "%d CTAs of 128 threads, a 64 x 256 fp32 slice (64 KiB) per operation; us per "
      "operation over all CTAs and repetitions 1..%d\n",
      ctas, kReps - 1);
  if (gemm_sms > 0) {
    std::printf("beside the GEMM engine (8192 x 8192 x 4096) persistent on %d of %d SMs\n",
                gemm_sms, sms);
  }
  std::printf("%-10s %-5s %8s %8s %8s %12s\n", "op", "data", "p10", "median", "p90", "GB/s per WG");
  std::vector<uint64_t> host(slices_count);
  for (int mode = 0; mode < kModes; ++mode) {
    for (bool cold : {false, true}) {
      CK(cudaMemset(flush, mode, flush_bytes));
      CK(cudaDeviceSynchronize());
      start_gemms();
      launch(mode, ctas, slices, cold, times, sink, ops_stream);
      CK(cudaStreamSynchronize(ops_stream));
      CK(cudaDeviceSynchronize());
      CK(cudaGetLastError());
      CK(cudaMemcpy(host.data(), times, slices_count * 8, cudaMemcpyDeviceToHost));
      std::vector<double> us;
      for (int c = 0; c < ctas; ++c) {
        for (int r = 1; r < kReps; ++r) us.push_back(host[c * kReps + r] / 1e3);
      }
      std::sort(us.begin(), us.end());
      const double med = us[us.size() / 2];
      std::printf("%-10s %-5s %8.2f %8.2f %8.2f %12.1f\n", mode_name(mode), cold ? "cold" : "hot",
                  us[us.size() / 10], med, us[us.size() * 9 / 10], kSliceFloats * 4 / (med * 1e3));
    }
  }
  cudaFree(slices);
  cudaFree(times);
  cudaFree(sink);
  cudaFree(flush);
  return 0;
}
