// Internal: what the RDMA backends (cx7: RC, efa: SRD) share - the device, protection domain and
// completion queues, memory registration, the receive pool with its progress thread, and post()
// written against two hooks (one RDMA write with immediate, one small send). The queue pairs and
// their connection are the backends' business.
//
//   sender post()                                     receiver progress thread
//   put chunk -> RDMA write with imm (rank, signal) -> recv CQ: RECV_RDMA_WITH_IMM, byte_len
//                                                       -> tracker.add_bytes(rank, signal, len)
//   signal    -> SEND SignalMessage{target, value}   -> recv CQ: RECV -> tracker.add_signal(...)
//   then poll the send CQ until every WR completed (the sources may be reused)
//
// Neither side relies on the order in which writes land: the tracker counts and compares.
#pragma once

#include <atomic>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "transport/transport_base.h"
#include "transport/verbs_loader.h"
#include "transport/wire.h"

namespace mk::transport::detail {

// Owns a verbs object; released with the function given (queue pairs, AHs, MRs, ...).
template <class T>
using VerbsPtr = std::unique_ptr<T, std::function<void(T*)>>;

// The opened device with its protection domain and completion queues.
struct VerbsDevice {
  const VerbsApi* api = nullptr;
  std::string name;  // "mlx5_0"
  uint8_t port = 1;
  ibv_device_attr device_attr{};
  ibv_port_attr port_attr{};
  int gid_index = 0;
  ibv_gid gid{};
  VerbsPtr<ibv_context> context;
  VerbsPtr<ibv_pd> pd;
  VerbsPtr<ibv_cq> send_cq;
  VerbsPtr<ibv_cq> recv_cq;
};

// Opens `wanted` (else MKERNEL_IB_HCA, else the device with an active port closest to the GPU
// `gpu_bus_id` on the PCIe tree - nic_affinity.h, equally close ones taken in turn by `spread` -
// else the first with an active port); GID index from MKERNEL_IB_GID_INDEX (default 0). Throws
// mk::Error(kUnsupported) naming what it found.
std::unique_ptr<VerbsDevice> open_verbs_device(const VerbsApi& api, const std::string& backend,
                                               const std::string& wanted, int recv_cq_depth,
                                               const std::string& gpu_bus_id = "", int spread = 0);

class RdmaTransport : public TransportBase {
 public:
  ~RdmaTransport() override;
  void post(std::span<const TransferOp> ops) override;

 protected:
  static constexpr uint32_t kSendDepth = 256;  // work requests in flight per post window
  static constexpr uint32_t kRecvDepth = 256;  // receives posted per queue pair and peer

  // Loads libibverbs and opens the device on every rank; throws kUnsupported on every rank when
  // any rank cannot.
  RdmaTransport(Bootstrap& bootstrap, const TransportConfig& config, const char* name);

  // Called by the backend once its queue pairs are ready: posts `slots_per_qp` receives to each
  // of `qps` (null entries skipped) and starts the progress thread.
  void start(const std::vector<ibv_qp*>& qps, uint32_t slots_per_qp);
  void stop();  // the backend's destructor calls it before destroying its queue pairs

  // Backend hooks, called under the post lock. wr_id is returned in the send completion.
  virtual void post_write(int peer, uint64_t local_addr, uint32_t lkey, uint64_t remote_addr,
                          uint32_t rkey, uint32_t bytes, uint32_t imm, uint64_t wr_id) = 0;
  virtual void post_send(int peer, uint64_t local_addr, uint32_t lkey, uint32_t bytes,
                         uint64_t wr_id) = 0;
  virtual uint64_t max_message_bytes() const = 0;

  uint32_t register_memory(int id, void* base, uint64_t bytes, MemoryKind kind) override;
  void unregister_memory(int id) override { mrs_[id].reset(); }
  ibv_mr* register_dmabuf(void* base, uint64_t bytes, std::string* why) const;
  [[noreturn]] void throw_errno(const std::string& what, int err) const;

  const VerbsApi& api() const { return *device_->api; }
  std::unique_ptr<VerbsDevice> device_;

 private:
  void progress_loop();
  void handle_receive(const ibv_wc& wc);
  void repost(uint32_t slot);
  void wait_sends(uint32_t count);

  VerbsPtr<ibv_mr> mrs_[kMaxBuffers];
  std::vector<SignalMessage> recv_slots_;  // [qps * slots_per_qp], registered
  std::vector<ibv_qp*> recv_qp_of_slot_;
  VerbsPtr<ibv_mr> recv_mr_;
  std::vector<SignalMessage> send_slots_;  // [kSendDepth], registered
  VerbsPtr<ibv_mr> send_mr_;
  std::mutex post_mutex_;
  std::thread progress_;
  std::atomic<bool> stopping_{false};
};

}  // namespace mk::transport::detail
