// mkernel/collectives.h - standalone collectives over symmetric memory and NVLink.
//
// No NCCL inside and no NVLink multicast: each rank's CTAs load and store peer memory directly.
// All are stream-ordered, never synchronise the host, and can be captured in CUDA graphs.
// Errors in the arguments throw mk::Error before anything is launched or written.
// One node: the communicator's ranks must all share NVLink (the fused GEMMs run across nodes).
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>

#include "mkernel/communicator.h"
#include "mkernel/types.h"

namespace mk {

struct CollectiveConfig {
  int channels = 0;   // CTAs per rank; 0 = heuristic (or MKERNEL_COLL_CHANNELS, when set)
  int threads = 512;  // per CTA (reduce_scatter's bulk path runs 256)
  // reduce_scatter: pull the peers' slices by bulk copies into a shared-memory ring where the
  // slices are 16-byte aligned (else the threads' loads). On by default; a field until it is
  // measured over NVLink against the loads (bench_collectives compares both).
  bool bulk = true;
};

// output[r * count + i] = input_of_rank_r[i] for every rank r.
//   input:  `count` elements on this rank's GPU (any device memory; may be output + rank * count)
//   output: `world * count` elements inside a symmetric buffer (same offset on every rank)
// Bitwise copy (dtype only sets the element size).
void all_gather(Communicator& comm, const void* input, void* output, std::size_t count, DType dtype,
                cudaStream_t stream, const CollectiveConfig& config = {});

// output[i] = sum over ranks r of input_of_rank_r[rank * count + i], summed in fp32 in rank order.
//   input:  `world * count` elements inside a symmetric buffer
//   output: `count` elements, any device memory of this rank's GPU (not overlapping input)
void reduce_scatter(Communicator& comm, const void* input, void* output, std::size_t count,
                    DType dtype, cudaStream_t stream, const CollectiveConfig& config = {});

// output[i] = sum over ranks r of input_of_rank_r[i]; bitwise identical on every rank.
//   input, output: `count` elements, both inside symmetric buffers; output may equal input.
void all_reduce(Communicator& comm, const void* input, void* output, std::size_t count, DType dtype,
                cudaStream_t stream, const CollectiveConfig& config = {});

}  // namespace mk
