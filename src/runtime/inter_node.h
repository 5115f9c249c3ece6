// Internal: a communicator's path between nodes (docs/design/multinode.md section 1).
//
// One transport whose peers are this rank's rail peers (the same local index on every other node:
// the hierarchical kernels send nothing else over the network: Topology::rail_peers), one proxy
// with a command ring per channel, and the host signal pad the arrivals raise. Kernels push
// commands into the rings and poll the pad; both live in the memory `host_memory` gives (the
// communicator passes pinned, device-mapped memory; CPU tests the heap).
//
// Errors: the first asynchronous error of the transport or the proxy (a lost peer, a malformed
// command) is kept, passed to config.on_error once (the communicator raises its abort flag there,
// so polling kernels stop), and thrown by check(). Teardown drains what was pushed (bounded by
// the time limit), stops the proxy and closes the transport with a goodbye to every peer.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "mkernel/bootstrap.h"
#include "mkernel/error.h"
#include "mkernel/topology.h"
#include "mkernel/transport/proxy.h"
#include "mkernel/transport/transport.h"

namespace mk::detail {

struct InterNodeConfig {
  std::string backend;            // "socket", "cx7", "efa"; empty: transport::default_backend()
  int channels = 1;               // command rings, one proxy thread each
  uint64_t ring_capacity = 1024;  // commands per ring (a power of two)
  uint32_t num_signals = 64;      // signal ids 0 .. num_signals - 1 per source rank
  double timeout_seconds = 60;    // setup, waits, stalled transfers, teardown's drain
  transport::RingAllocator host_memory;  // rings and the signal pad (default: the heap)
  transport::CopyFn copy_to_device;      // socket backend, kDevice buffers (TransportConfig)
  transport::CopyFn copy_from_device;
  // Where the kernels stage what crosses the network (InterNode::host_staging): "host", "device",
  // or empty: "host" for the socket backend, "device" for RDMA (the communicator passes
  // MKERNEL_INTER_NODE_STAGING).
  std::string staging;
  std::string gpu_pci_bus_id;  // picks the NIC (cx7 / efa)
  std::string socket_ifname;   // socket: the interface to listen on (empty: the environment's)
  std::function<void(const Error&)> on_error;  // once, from a transport or proxy thread
};

class InterNode {
 public:
  // Collective over every rank of `bootstrap`. Throws mk::Error(kInvalidArgument) when the
  // topology has one node (nothing lies between nodes) or the channels / signals are out of
  // range, and what transport::make_transport throws (unknown or unsupported backend, an
  // unreachable peer - on every rank).
  InterNode(Bootstrap& bootstrap, const Topology& topo, InterNodeConfig config);
  ~InterNode();
  InterNode(const InterNode&) = delete;
  InterNode& operator=(const InterNode&) = delete;

  const std::vector<int>& peers() const { return peers_; }  // rail peers, ascending
  bool is_peer(int rank) const { return transport_->is_peer(rank); }
  transport::Transport& transport() { return *transport_; }
  transport::Proxy& proxy() { return *proxy_; }
  transport::HostSignalPad& signals() { return *pad_; }
  const transport::HostSignalPad& signals() const { return *pad_; }
  const InterNodeConfig& config() const { return config_; }

  // Collective: registers every rank's copy of one symmetric buffer under `id` (same id, same
  // size on every rank); commands name it.
  void register_buffer(int id, void* base, uint64_t bytes, transport::MemoryKind kind);
  // The id of the buffer at `base` (this rank's copy of a symmetric allocation), registering it
  // under the lowest free id on first use - collective then, so every rank must ask for its copy
  // of the same allocations in the same order (ops do: they are collective; the transport refuses
  // ids that differ between ranks). `owner` (e.g. the allocation) ends the registration: once it
  // has expired, the next buffer_id call releases the id (after draining the proxy), so a freed
  // workspace's id serves the next one. A live base asked for with another size is an error.
  int buffer_id(void* base, uint64_t bytes, transport::MemoryKind kind,
                std::weak_ptr<const void> owner = {});

  // Where the kernels stage what crosses the network. true: in pinned host memory mapped into the
  // device (staging(); InterNodeConfig::host_memory), which the kernels write and read over PCIe
  // and the transport sends from and receives into in place, so that its threads make no CUDA
  // call - a call there can wait on a driver lock that another thread of the process holds while
  // it waits for the GPU (a device-wide synchronisation, a pageable copy, a module load), whose
  // kernel waits for that very transfer. The socket backend's default; RDMA without GPUDirect.
  // false: in the kernels' device workspace (GPUDirect RDMA; the socket backend then copies
  // through host memory with config.copy_to_device / copy_from_device - the hazard above, so
  // over sockets this is for tests of the RDMA layout, not for applications).
  bool host_staging() const { return host_staging_; }

  struct Staging {
    uint8_t* base = nullptr;  // host memory, at the same address in the device (mapped, UVA)
    uint64_t bytes = 0;
    int buffer = -1;  // its registered id
  };
  // This rank's host staging of at least `bytes` (host_staging() paths), shared by the
  // communicator's ops (they run one at a time, communicator.h). Collective when it grows: a larger
  // buffer is allocated and registered, so every rank must ask for the same sizes in the same order
  // (ops do: they are collective). Earlier buffers stay allocated and registered until the path is
  // destroyed: commands or kernels in flight may still use them.
  Staging staging(uint64_t bytes);

  // Throws the first error of the transport or the proxy, if any.
  void check() const;
  bool failed() const;

  // Host wait until word (signal, src_rank) of the pad reaches `value` (wrap-safe), checking the
  // path's health meanwhile. Throws that error, or mk::Error(kTimeout) naming the peer, the
  // signal and the value after the time limit.
  void wait(int src_rank, uint32_t signal, uint64_t value) const;

  // One line: backend, peers, channels, signals, staging.
  std::string describe() const;

 private:
  void record(const Error& error);
  void* alloc_host(uint64_t bytes) const;  // config.host_memory, else the heap
  void free_host(void* p) const;
  static constexpr uint64_t kStagingAlign = 4096;

  InterNodeConfig config_;
  int rank_;
  std::vector<int> peers_;
  std::unique_ptr<transport::HostSignalPad> pad_;
  std::unique_ptr<transport::Transport> transport_;
  std::unique_ptr<transport::Proxy> proxy_;

  mutable std::mutex mutex_;  // guards error_
  std::optional<Error> error_;
  struct Registered {
    void* base;
    uint64_t bytes;
    int id;
    std::weak_ptr<const void> owner;
    bool owned;  // owner was given: the registration ends with it
  };
  std::vector<Registered> registered_;  // buffer_id's
  std::vector<bool> used_;              // [transport::kMaxBuffers] ids taken
  bool host_staging_ = false;
  std::vector<Staging> stagings_;  // staging()'s, the largest last
};

}  // namespace mk::detail
