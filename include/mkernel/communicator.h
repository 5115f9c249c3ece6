// mkernel/communicator.h - ranks, symmetric memory, time limits.
//
// A Communicator is created collectively by every rank from a Bootstrap, on the rank's GPU.
// It owns the signal pad the kernels synchronise through and hands out symmetric buffers:
// same-size allocations on every rank, each mapped into every rank of the same node.
//
// Stream semantics: operations on one communicator must be issued in the same order on every
// rank, one at a time (as with NCCL); they are stream-ordered and never synchronise the host,
// so they can be captured in CUDA graphs and replayed. One at a time also on the GPU: ops of one
// communicator on two streams must be ordered by the caller (an event), since they share the
// communicator's signals and workspaces - use a communicator per stream to overlap them.
//
// Several ranks may share one GPU. In one process (InProcessGroup) their persistent kernels run
// side by side, and a rank must not make an implicitly synchronising CUDA call (cudaMalloc,
// cudaFree, cudaMemset, ...) while a peer's kernel may already wait for its next launch: the GPU
// would hold the rank's launch behind the waiting kernel until the time limit. Finish setup, then
// meet (e.g. bootstrap().barrier()), then launch. Separate processes sharing a GPU are not
// affected. The process's streams also share CUDA_DEVICE_MAX_CONNECTIONS hardware queues per GPU
// (8 unless set before the first CUDA call): two streams in one queue run in order, so a rank's
// launch or copy can wait behind a peer's persistent kernel that waits for it. Each rank uses its
// own stream, plus two for copies on the socket path with device staging - with more than 8 in
// all (8 ranks on a GPU, or 3 with device staging), set CUDA_DEVICE_MAX_CONNECTIONS=32. Likewise
// upload CUDA graphs (cudaGraphUpload) before meeting: a first launch's upload can queue behind a
// peer's waiting kernel too.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "mkernel/bootstrap.h"
#include "mkernel/device_comm.h"
#include "mkernel/topology.h"

namespace mk {

namespace detail {
struct CommState;
struct SymAllocation;
class InterNode;
struct Overrides;
}  // namespace detail

struct CommOptions {
  int device = -1;  // CUDA device of this rank; -1 = the current device
  double timeout_seconds =
      -1;  // limit of every wait on a peer; -1 = MKERNEL_TIMEOUT_S or 60 s; 0 = none
  int ranks_per_node =
      -1;  // virtual nodes of this many ranks; -1 = MKERNEL_GPUS_PER_NODE or by host
};

// A buffer of the same size on every rank of a communicator, mapped into every rank of the node.
// Movable handle; the memory is unmapped and released when the last handle goes away (peers keep
// their own mapping alive until they release theirs).
class SymmetricBuffer {
 public:
  SymmetricBuffer() = default;
  void* data() const;        // this rank's copy (device pointer on this rank's GPU)
  std::size_t size() const;  // bytes, equal on every rank
  // Local rank `local_rank`'s copy as mapped into this rank's address space (device pointer).
  void* peer(int local_rank) const;
  // Device array [local_size] of all copies (peer(i) for each i), for kernels.
  void* const* device_peers() const;
  explicit operator bool() const { return impl_ != nullptr; }

 private:
  friend class Communicator;
  explicit SymmetricBuffer(std::shared_ptr<detail::SymAllocation> impl) : impl_(std::move(impl)) {}
  std::shared_ptr<detail::SymAllocation> impl_;
};

// Where a device pointer lies inside a symmetric buffer.
struct SymmetricRange {
  void* const* device_peers = nullptr;  // device array [local_size] of the buffer's base addresses
  std::size_t offset = 0;               // byte offset of the pointer from the base
  std::size_t size = 0;                 // bytes of the buffer
  const uintptr_t* host_peers = nullptr;  // the same addresses in host memory (valid while the
                                          // buffer lives)
};

class Communicator {
 public:
  // Collective: every rank of the bootstrap calls it. Throws mk::Error on bad input, no P2P
  // between GPUs of a node, or a failed exchange.
  static std::shared_ptr<Communicator> create(std::unique_ptr<Bootstrap> bootstrap,
                                              const CommOptions& options = {});
  ~Communicator();
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;

  const Topology& topology() const;
  int rank() const { return topology().rank; }
  int world_size() const { return topology().world_size; }
  int device() const;
  double timeout_seconds() const;
  Bootstrap& bootstrap();
  // The MKERNEL_* overrides as parsed when this communicator was created (README's table); the
  // ops fold them into their configs.
  const detail::Overrides& overrides() const;

  // Collective: a symmetric buffer of `bytes` on every rank (all ranks must pass the same size).
  SymmetricBuffer alloc(std::size_t bytes);
  // The symmetric buffer holding [ptr, ptr + bytes), or nullopt-like (device_peers == nullptr).
  SymmetricRange find_symmetric(const void* ptr, std::size_t bytes) const;

  // What kernels need; valid while the communicator lives.
  DeviceComm device_comm() const;

  // Non-blocking: throws the error a kernel of this communicator recorded (e.g. a timeout naming
  // the rank and signal it waited for), and from then on the communicator refuses new work.
  void check();
  // Waits for `stream`, then check(). Throws mk::Error(kCuda) if the stream failed.
  void synchronize(cudaStream_t stream);
  // Throws mk::Error(kNotInitialized) if an earlier error broke the communicator.
  void ensure_usable(const char* op) const;

  // Collective on its first call, multi-node communicators only: the path between nodes - a
  // transport to this rank's rail peers, a proxy whose command rings kernels push into, and the
  // host-mapped signal pad arrivals raise (DeviceComm::host_signals from then on). The multi-node
  // ops create it. Throws mk::Error(kInvalidArgument) on one node, and the transport's errors
  // (unknown or unavailable backend: MKERNEL_TRANSPORT; an unreachable peer) on every rank.
  detail::InterNode& inter_node();
  // A token that expires when the symmetric buffer holding `ptr` is freed (empty when `ptr` is in
  // none): what keys the inter-node path's buffer registrations to the buffer's life.
  std::weak_ptr<const void> symmetric_owner(const void* ptr) const;

 private:
  Communicator();
  std::unique_ptr<detail::CommState> state_;
};

// Name of a signal slot for messages ("entry barrier, channel 3").
std::string describe_signal(uint32_t signal);

}  // namespace mk
