// mkernel/transport/transport.h - moving bytes and signals between ranks on different nodes.
//
// A Transport does one thing: "put these bytes from my buffer b at offset o into rank r's buffer
// b' at offset o', counted on signal s; raise signal s at rank r to value v once every byte I
// counted on it has landed". Kernels never call it directly: they write Commands into a ring and
// a Proxy (proxy.h) turns them into TransferOps. Backends, chosen at run time:
//
//   socket  TCP between ranks; works everywhere (tests, virtual nodes on one host)
//   cx7     libibverbs RC queue pairs (ConnectX-7 / InfiniBand / RoCE), RDMA write with immediate
//   efa     libibverbs + libefa SRD queue pairs (AWS EFA), RDMA write with immediate
//
// libibverbs and libefa are loaded with dlopen when asked for; the library builds and runs
// without them. Setup (addresses, queue pairs, buffer keys) goes through the communicator's
// Bootstrap allgather; no fixed ports.
//
// Arrivals become signals through a SignalSink: the receiving side counts the bytes of each put
// per (source rank, signal) and raises a signal only when the count reaches the target the sender
// attached to it, so nothing relies on the order in which different writes land.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>

#include "mkernel/bootstrap.h"
#include "mkernel/device_comm.h"
#include "mkernel/error.h"
#include "mkernel/transport/command.h"
#include "mkernel/transport/ring.h"

namespace mk::transport {

enum class MemoryKind : uint8_t {
  kHost = 0,    // host memory: the socket backend reads / writes it directly
  kDevice = 1,  // GPU memory: staged through the copy hooks (socket) or registered (RDMA)
};

// One network operation, as the proxy hands it to a transport.
struct TransferOp {
  enum class Kind : uint8_t { kPut, kSignal };
  Kind kind = Kind::kPut;
  uint8_t src_buffer = 0;  // put: registered buffer ids
  uint8_t dst_buffer = 0;
  uint32_t dst_rank = 0;
  uint32_t signal_id = kNoSignal;  // put: count the bytes on it (kNoSignal: not counted)
  uint64_t src_offset = 0;         // put
  uint64_t dst_offset = 0;         // put
  uint64_t bytes = 0;              // put
  uint64_t target = 0;             // signal: raise once this many bytes counted on it arrived
  uint64_t value = 0;              // signal
  uint64_t tile_id = 0;            // diagnostics, carried to the receiver
};

// Where arrivals become flags. raise() is called from transport threads; values for one
// (src, signal) are raised in increasing order (wrap-safe), never twice.
class SignalSink {
 public:
  virtual ~SignalSink() = default;
  virtual void raise(uint32_t src_rank, uint32_t signal, uint64_t value) = 0;
};

// A signal pad in host memory with the device pad's layout: uint64 [num_signals][world],
// word (s, src) written only by arrivals from src. raise() stores with release and never lowers
// a word; load() reads with acquire.
class HostSignalPad final : public SignalSink {
 public:
  // `memory` holds the words (default: the host heap). Give it pinned, device-mapped memory
  // (cudaHostAlloc with cudaHostAllocMapped) and kernels can poll arrivals with system-scope
  // acquire loads at words().
  HostSignalPad(uint32_t world_size, uint32_t num_signals, RingAllocator memory = {});
  ~HostSignalPad() override;
  HostSignalPad(const HostSignalPad&) = delete;
  HostSignalPad& operator=(const HostSignalPad&) = delete;
  void raise(uint32_t src_rank, uint32_t signal, uint64_t value) override;
  uint64_t load(uint32_t src_rank, uint32_t signal) const;
  // Waits until word (signal, src) >= value (wrap-safe). Calls `poll` about every millisecond
  // (it may throw, e.g. Transport::check()). False when `timeout_seconds` passed first.
  bool wait(uint32_t src_rank, uint32_t signal, uint64_t value, double timeout_seconds,
            const std::function<void()>& poll = {}) const;
  uint64_t* words() { return words_; }  // [num_signals][world_size]

 private:
  uint32_t world_size_;
  uint32_t num_signals_;
  RingAllocator memory_;
  uint64_t* words_;
};

// Copies between host staging and a kDevice buffer (the GPU path passes cudaMemcpy).
using CopyFn = std::function<void(void* dst, const void* src, std::size_t bytes)>;

struct TransportConfig {
  SignalSink* signals = nullptr;       // required; must outlive the transport
  uint32_t num_signals = kNumSignals;  // signal ids are 0 .. num_signals - 1
  double timeout_seconds = -1;         // setup and stalled transfers; -1: MKERNEL_TIMEOUT_S or 60
  CopyFn copy_to_device;               // staging -> kDevice buffer (receiving side)
  CopyFn copy_from_device;             // kDevice buffer -> staging (sending side)
  // Called once, from a transport thread, with the first asynchronous error (peer lost,
  // malformed message); check() throws the same error afterwards.
  std::function<void(const Error&)> on_error;
  // The ranks this one exchanges data with (empty: every other rank) - for the multi-node
  // kernels, the ranks on other nodes (ranks of one node use NVLink). Must be symmetric: r lists
  // s exactly when s lists r. Connections, queue pairs and receive buffers exist only for these;
  // an op for another rank is refused before anything of its batch is sent, and a message from
  // one is treated as malformed.
  std::vector<int> peers;

  // socket: interface whose address to listen on (empty: MKERNEL_SOCKET_IFNAME, else 127.0.0.1),
  // and an address to publish instead of the bound one ("host:port"; NAT, fault tests).
  std::string socket_ifname;
  std::string socket_advertise;
  // cx7 / efa: library paths (empty: libibverbs.so.1 / libefa.so.1) and the device to use
  // (empty: MKERNEL_IB_HCA, else the active device closest on the PCIe tree to the GPU
  // `gpu_pci_bus_id` names - as cudaDeviceGetPCIBusId writes it - else the first active one).
  std::string verbs_library;
  std::string efa_library;
  std::string rdma_device;
  std::string gpu_pci_bus_id;
};

class Transport {
 public:
  virtual ~Transport() = default;
  virtual const char* name() const = 0;  // "socket", "cx7", "efa"
  virtual int rank() const = 0;
  virtual int world_size() const = 0;

  // Collective: every rank registers its copy of one symmetric buffer, same id and same size on
  // every rank. Throws mk::Error(kInvalidArgument) on a bad id, a reused id or sizes that differ
  // between ranks (naming them), kBootstrap when the exchange fails.
  virtual void register_buffer(int id, void* base, uint64_t bytes,
                               MemoryKind kind = MemoryKind::kHost) = 0;
  // Forgets buffer `id` on this rank (each rank releases its own copy): ops naming it are refused
  // from then on, a put arriving for it is malformed, and the id may be registered again
  // (collectively). RDMA backends deregister its memory. Only once nothing is in flight for it
  // (Proxy::drain) and no rank will use it again. An unregistered id is ignored.
  virtual void release_buffer(int id) = 0;
  // What commands are validated against (this rank, world, signals, registered buffer sizes).
  virtual CommandLimits limits() const = 0;
  // Whether this transport carries data to and from `rank` (TransportConfig::peers).
  virtual bool is_peer(int rank) const = 0;

  // Thread-safe. Sends the ops (in order per destination rank); returns once their source bytes
  // may be reused. Throws mk::Error(kInvalidArgument) for an op outside the limits (nothing of
  // the batch is sent), or the transport's error when the destination is unreachable.
  virtual void post(std::span<const TransferOp> ops) = 0;

  // Throws the first asynchronous error (a lost peer, a malformed message), if any.
  virtual void check() const = 0;
  virtual bool failed() const = 0;
};

// The backend named by `backend`, or when empty by MKERNEL_TRANSPORT, or else the build's
// MKERNEL_DEFAULT_BACKEND. Collective over the bootstrap's ranks. Throws
// mk::Error(kInvalidArgument) for an unknown name, kUnsupported when the backend cannot run here
// (no libibverbs, no RDMA device), kBootstrap when a peer cannot be reached.
std::unique_ptr<Transport> make_transport(Bootstrap& bootstrap, const TransportConfig& config,
                                          const std::string& backend = "");

// The backend make_transport picks when none is named ("socket", "cx7" or "efa").
std::string default_backend();

}  // namespace mk::transport
