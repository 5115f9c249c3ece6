// Device side of the standalone collectives. One CTA = one channel; channel c of every rank meets
// channel c of its peers at an entry barrier (peers' buffers are ready to be read / written) and an
// exit barrier (everything this channel wrote into peers, or read from them, is done).
//
//   all_gather (push):      rank r: for each vector i of its input -> output[r*count + i] on every
//   rank reduce_scatter (pull):  rank r: sum over ranks p of input_p[r*count + i] -> its output[i]
//   all_reduce:             rank r owns chunk r: pull-reduce it from every rank, push the sum to
//                           every rank's output (so all ranks hold bitwise identical results)
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "mkernel/device/launch.cuh"

namespace mk::coll {

constexpr int kUnroll = 4;  // independent vectors in flight per thread (all_gather)
// Loads in flight per thread and peer for reductions, which pull over NVLink (reads need more in
// flight than pushes). 6 x 16 B fits the register budget of 512 threads without spills.
template <int kBytes>
constexpr int kReduceUnroll = kBytes >= 8 ? 6 : 4;

// A vector of kBytes bytes: the unit of every load and store.
template <int kBytes>
struct alignas(kBytes) Vec {
  unsigned char b[kBytes];
};

template <typename T>
__device__ __forceinline__ float to_float(T v);
template <>
__device__ __forceinline__ float to_float(__nv_bfloat16 v) {
  return __bfloat162float(v);
}
template <>
__device__ __forceinline__ float to_float(__half v) {
  return __half2float(v);
}
template <>
__device__ __forceinline__ float to_float(float v) {
  return v;
}

template <typename T>
__device__ __forceinline__ T from_float(float v);
template <>
__device__ __forceinline__ __nv_bfloat16 from_float(float v) {
  return __float2bfloat16_rn(v);
}
template <>
__device__ __forceinline__ __half from_float(float v) {
  return __float2half_rn(v);
}
template <>
__device__ __forceinline__ float from_float(float v) {
  return v;
}

template <typename P>
__device__ __forceinline__ P* at(void* base, std::size_t byte_offset) {
  return reinterpret_cast<P*>(static_cast<char*>(base) + byte_offset);
}

// ---- all_gather ---------------------------------------------------------------------------------

// in: n vectors of this rank's chunk; out_peers[p] + out_offset: where the chunk goes on rank p.
template <int kBytes>
__global__ void __launch_bounds__(512)
    all_gather_kernel(DeviceComm comm, const Vec<kBytes>* in, std::size_t n, void* const* out_peers,
                      std::size_t out_offset) {
  using V = Vec<kBytes>;
  const dev::Launch launch = dev::Launch::begin(comm);
  const int channel = blockIdx.x;
  if (launch.channel_barrier(SignalId::kEntry, channel, 0)) {
    const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x * kUnroll;
    for (std::size_t base =
             static_cast<std::size_t>(blockIdx.x) * blockDim.x * kUnroll + threadIdx.x;
         base < n; base += stride) {
      V v[kUnroll];
#pragma unroll
      for (int j = 0; j < kUnroll; ++j) {
        const std::size_t i = base + static_cast<std::size_t>(j) * blockDim.x;
        if (i < n) v[j] = in[i];
      }
      // Start with the next rank so that not every rank hits the same peer at once.
      for (int k = 0; k < comm.local_size; ++k) {
        int p = comm.local_rank + 1 + k;
        if (p >= comm.local_size) p -= comm.local_size;
        V* dst = at<V>(out_peers[p], out_offset);
#pragma unroll
        for (int j = 0; j < kUnroll; ++j) {
          const std::size_t i = base + static_cast<std::size_t>(j) * blockDim.x;
          if (i < n) dst[i] = v[j];
        }
      }
    }
    launch.channel_barrier(SignalId::kExit, channel, 0);
  }
  launch.end();
}

// ---- reductions
// ----------------------------------------------------------------------------------

// Sums elements [begin, end) of every local rank's input (in_peers[p] + in_offset, in elements of
// T) in rank order, writing the result either to `out_local` (+ element index - begin) or, when
// out_peers is set, to every rank's out_peers[p] + out_offset at the same element index.
// begin is a multiple of the vector width; pointers are kBytes-aligned.
template <typename T, int kBytes>
__device__ __forceinline__ void reduce_range(const DeviceComm& comm, void* const* in_peers,
                                             std::size_t in_offset, std::size_t begin,
                                             std::size_t end, T* out_local, void* const* out_peers,
                                             std::size_t out_offset) {
  using V = Vec<kBytes>;
  constexpr int kElems = kBytes / sizeof(T);
  const std::size_t n_vec = (end - begin) / kElems;
  const std::size_t stride =
      static_cast<std::size_t>(gridDim.x) * blockDim.x * kReduceUnroll<kBytes>;
  for (std::size_t base =
           static_cast<std::size_t>(blockIdx.x) * blockDim.x * kReduceUnroll<kBytes> + threadIdx.x;
       base < n_vec; base += stride) {
    float acc[kReduceUnroll<kBytes>][kElems];
#pragma unroll
    for (int j = 0; j < kReduceUnroll<kBytes>; ++j) {
#pragma unroll
      for (int e = 0; e < kElems; ++e) acc[j][e] = 0.f;
    }
    for (int p = 0; p < comm.local_size; ++p) {
      const V* src = at<const V>(in_peers[p], in_offset + begin * sizeof(T));
      V v[kReduceUnroll<kBytes>];
#pragma unroll
      for (int j = 0; j < kReduceUnroll<kBytes>; ++j) {
        const std::size_t i = base + static_cast<std::size_t>(j) * blockDim.x;
        if (i < n_vec) v[j] = src[i];
      }
#pragma unroll
      for (int j = 0; j < kReduceUnroll<kBytes>; ++j) {
        const T* x = reinterpret_cast<const T*>(&v[j]);
#pragma unroll
        for (int e = 0; e < kElems; ++e) acc[j][e] += to_float(x[e]);
      }
    }
#pragma unroll
    for (int j = 0; j < kReduceUnroll<kBytes>; ++j) {
      const std::size_t i = base + static_cast<std::size_t>(j) * blockDim.x;
      if (i >= n_vec) continue;
      V out;
      T* y = reinterpret_cast<T*>(&out);
#pragma unroll
      for (int e = 0; e < kElems; ++e) y[e] = from_float<T>(acc[j][e]);
      if (out_peers == nullptr) {
        reinterpret_cast<V*>(out_local)[i] = out;
      } else {
        for (int k = 0; k < comm.local_size; ++k) {
          int p = comm.local_rank + 1 + k;
          if (p >= comm.local_size) p -= comm.local_size;
          at<V>(out_peers[p], out_offset + begin * sizeof(T))[i] = out;
        }
      }
    }
  }
  // Scalar tail: the last (end - begin) % kElems elements, by channel 0.
  const std::size_t tail = begin + n_vec * kElems;
  if (blockIdx.x == 0) {
    for (std::size_t e = tail + threadIdx.x; e < end; e += blockDim.x) {
      float acc = 0.f;
      for (int p = 0; p < comm.local_size; ++p) {
        acc += to_float(at<const T>(in_peers[p], in_offset)[e]);
      }
      const T y = from_float<T>(acc);
      if (out_peers == nullptr) {
        out_local[e - begin] = y;
      } else {
        for (int p = 0; p < comm.local_size; ++p) at<T>(out_peers[p], out_offset)[e] = y;
      }
    }
  }
}

// reduce_scatter: this rank's elements are [rank * count, rank * count + count) of every input.
template <typename T, int kBytes>
__global__ void __launch_bounds__(512)
    reduce_scatter_kernel(DeviceComm comm, void* const* in_peers, std::size_t in_offset,
                          std::size_t count, T* out) {
  const dev::Launch launch = dev::Launch::begin(comm);
  const int channel = blockIdx.x;
  if (launch.channel_barrier(SignalId::kEntry, channel, 0)) {
    const std::size_t begin = static_cast<std::size_t>(comm.rank) * count;
    reduce_range<T, kBytes>(comm, in_peers, in_offset, begin, begin + count, out, nullptr, 0);
    // Peers may overwrite their inputs only after we are done reading them.
    launch.channel_barrier(SignalId::kExit, channel, 0);
  }
  launch.end();
}

// all_reduce: this rank owns elements [begin, end) (its chunk), reduces and broadcasts them.
template <typename T, int kBytes>
__global__ void __launch_bounds__(512)
    all_reduce_kernel(DeviceComm comm, void* const* in_peers, std::size_t in_offset,
                      std::size_t begin, std::size_t end, void* const* out_peers,
                      std::size_t out_offset) {
  const dev::Launch launch = dev::Launch::begin(comm);
  const int channel = blockIdx.x;
  if (launch.channel_barrier(SignalId::kEntry, channel, 0)) {
    if (begin < end) {
      reduce_range<T, kBytes>(comm, in_peers, in_offset, begin, end, nullptr, out_peers,
                              out_offset);
    }
    launch.channel_barrier(SignalId::kExit, channel, 0);
  }
  launch.end();
}

}  // namespace mk::coll
