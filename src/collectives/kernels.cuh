// Device side of the standalone collectives. One CTA = one channel; channel c of every rank meets
// channel c of its peers at an entry barrier (peers' buffers are ready to be read / written) and an
// exit barrier (everything this channel wrote into peers, or read from them, is done).
//
//   all_gather (push):      rank r: for each vector i of its input -> output[r*count + i] on every
//   rank reduce_scatter (push):  rank r: input_r[q*count + i] -> staging on rank q; rank q sums its
//   own
//                           partial and the staged ones -> its output[i], pipelined per slice
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

// reduce_scatter by pushes (NVLink writes are posted; reads would spend each direction's
// bandwidth on the other rank's read requests too). Rank r's input holds its partial of every
// chunk; chunk q belongs to rank q. Each CTA (channel c) splits into two roles that never wait
// for each other, so the NVLink transfer and the local sum overlap:
//
//   pushers (threads [0, T/2)):   for slice k of this channel: write my partial of slice k of
//                                 every chunk q != r into staging_q[r] on rank q, then raise the
//                                 op signal (channel c) on every peer to k + 1
//   summers (threads [T/2, T)):   for slice k: wait until every peer's signal >= k + 1, then
//                                 out[slice k] = sum over ranks p in rank order of
//                                 (p == r ? my partial : staging_r[p])
//
// Slice j covers vectors [j * S, (j + 1) * S) of a chunk (S = T/2 * kUnroll); channel c takes
// j = c, c + C, ... . staging (symmetric workspace) on each rank: [world][count] elements, slot p
// written by rank p only; a peer writes it again only after we entered the next launch.
template <typename T, int kBytes>
__global__ void __launch_bounds__(512)
    reduce_scatter_kernel(DeviceComm comm, const T* in, std::size_t count,
                          void* const* staging_peers, std::size_t staging_offset, T* out) {
  using V = Vec<kBytes>;
  constexpr int kElems = kBytes / sizeof(T);
  __shared__ int failed;  // set by a summer whose wait timed out
  const dev::Launch launch = dev::Launch::begin(comm);
  const int channel = blockIdx.x;
  if (threadIdx.x == 0) failed = 0;
  if (!launch.channel_barrier(SignalId::kEntry, channel, 0)) {  // also orders `failed = 0`
    launch.end();
    return;
  }
  const uint32_t role_threads = blockDim.x / 2;
  const bool pusher = threadIdx.x < role_threads;
  const uint32_t tid = pusher ? threadIdx.x : threadIdx.x - role_threads;
  const std::size_t n_vec = count / kElems;
  const std::size_t chunk_vec = n_vec;  // count * sizeof(T) is a multiple of kBytes
  // A slice is kSliceRounds rounds of kUnroll vectors per thread: the release fence before each
  // signal waits for the slice's NVLink stores to land, so slices must be large enough for that
  // wait to be rare (16 KiB slices measured 2.07 ms at 512 MiB, see docs/PERFORMANCE.md).
  constexpr int kSliceRounds = 8;
  const std::size_t round = static_cast<std::size_t>(role_threads) * kUnroll;
  const std::size_t slice = round * kSliceRounds;
  const std::size_t n_slices = (n_vec + slice - 1) / slice;
  const std::size_t my_slices =
      channel < n_slices ? (n_slices - channel + gridDim.x - 1) / gridDim.x : 0;
  const uint32_t sig = dev::signal_index(SignalId::kOp, channel);
  const int me = comm.local_rank;

  if (pusher) {
    for (std::size_t k = 0; k < my_slices; ++k) {
      for (int r = 0; r < kSliceRounds; ++r) {
        for (int d = 1; d < comm.local_size; ++d) {
          const std::size_t first = (channel + k * gridDim.x) * slice + r * round;
          const int q = (me + d) % comm.local_size;  // owner of the chunk
          const V* src = reinterpret_cast<const V*>(in) + q * chunk_vec;
          V* dst = at<V>(staging_peers[q], staging_offset) + me * chunk_vec;
          V v[kUnroll];
#pragma unroll
          for (int u = 0; u < kUnroll; ++u) {
            const std::size_t i = first + u * role_threads + tid;
            if (i < n_vec) v[u] = src[i];
          }
#pragma unroll
          for (int u = 0; u < kUnroll; ++u) {
            const std::size_t i = first + u * role_threads + tid;
            if (i < n_vec) dst[i] = v[u];
          }
        }
      }
      dev::named_barrier_sync(dev::NamedBarrier::kProducers, role_threads);
      for (uint32_t t = tid; t < static_cast<uint32_t>(comm.local_size); t += role_threads) {
        if (static_cast<int>(t) == me) continue;
        dev::fence_acq_rel_sys();
        launch.signal(t, sig, static_cast<uint32_t>(k + 1));
      }
    }
  } else {
    const V* mine = reinterpret_cast<const V*>(in) + me * chunk_vec;
    const V* staged = at<const V>(staging_peers[me], staging_offset);
    for (std::size_t k = 0; k < my_slices; ++k) {
      for (uint32_t t = tid; t < static_cast<uint32_t>(comm.local_size); t += role_threads) {
        if (static_cast<int>(t) != me &&
            !launch.wait(comm.node_ranks[t], sig, static_cast<uint32_t>(k + 1))) {
          failed = 1;
        }
      }
      dev::named_barrier_sync(dev::NamedBarrier::kConsumers, role_threads);
      if (failed) break;
      for (int r = 0; r < kSliceRounds; ++r) {
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
          const std::size_t i =
              (channel + k * gridDim.x) * slice + r * round + u * role_threads + tid;
          if (i >= n_vec) continue;
          float acc[kElems];
#pragma unroll
          for (int e = 0; e < kElems; ++e) acc[e] = 0.f;
          for (int p = 0; p < comm.local_size; ++p) {
            const V v = p == me ? mine[i] : staged[p * chunk_vec + i];
            const T* x = reinterpret_cast<const T*>(&v);
#pragma unroll
            for (int e = 0; e < kElems; ++e) acc[e] += to_float(x[e]);
          }
          V y;
          T* yy = reinterpret_cast<T*>(&y);
#pragma unroll
          for (int e = 0; e < kElems; ++e) yy[e] = from_float<T>(acc[e]);
          reinterpret_cast<V*>(out)[i] = y;
        }
      }
    }
  }
  // No exit barrier: peers never read our input, and a peer pushes into our staging again only
  // after we entered its next launch (the entry barrier).
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
