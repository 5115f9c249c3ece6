// The RDMA backends' shared part (see verbs_common.h). Compiled in CI against Debian's
// libibverbs-dev; runs only where rdma-core and a NIC are present.
#include "transport/verbs_common.h"

#include <arpa/inet.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>

#include "runtime/cuda_driver.h"
#include "runtime/overrides.h"
#include "runtime/text_util.h"
#include "transport/nic_affinity.h"

namespace mk::transport::detail {
namespace {

constexpr int kRemoteAccess =
    IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ;

}  // namespace

// ---- device -----------------------------------------------------------------------------------

std::unique_ptr<VerbsDevice> open_verbs_device(const VerbsApi& api, const std::string& backend,
                                               const std::string& wanted_in, int recv_cq_depth,
                                               const std::string& gpu_bus_id, int spread) {
  const mk::detail::EnvLookup env = mk::detail::process_environment();
  const std::string wanted =
      wanted_in.empty() ? mk::detail::env_string(env, "MKERNEL_IB_HCA", "") : wanted_in;
  const long long gid_index = mk::detail::env_int(env, "MKERNEL_IB_GID_INDEX", 0, 255, 0);
  int count = 0;
  ibv_device** list = api.get_device_list(&count);
  if (list == nullptr || count == 0) {
    if (list != nullptr) api.free_device_list(list);
    throw Error(ErrorCode::kUnsupported,
                "the " + backend + " backend found no RDMA device (ibv_get_device_list returned " +
                    "none; is the NIC driver loaded and /dev/infiniband visible?)");
  }
  // The order to try them in: closest to the GPU first when its bus id is known.
  std::vector<int> order;
  if (wanted.empty() && !gpu_bus_id.empty()) {
    std::vector<std::optional<PciPlace>> places;
    for (int i = 0; i < count; ++i)
      places.push_back(pci_place_of_rdma_device(api.get_device_name(list[i])));
    order = nic_order(pci_place_of_bus_id(gpu_bus_id), places, spread);
  } else {
    for (int i = 0; i < count; ++i) order.push_back(i);
  }
  std::string seen;
  auto dev = std::make_unique<VerbsDevice>();
  dev->api = &api;
  for (int k = 0; k < count && !dev->context; ++k) {
    const int i = order[static_cast<std::size_t>(k)];
    const std::string name = api.get_device_name(list[i]);
    if (!wanted.empty() && name != wanted) {
      seen += (seen.empty() ? "" : ", ") + name + " (not " + wanted + ")";
      continue;
    }
    ibv_context* ctx = api.open_device(list[i]);
    if (ctx == nullptr) {
      seen += (seen.empty() ? "" : ", ") + name + " (cannot open: " + std::strerror(errno) + ")";
      continue;
    }
    VerbsPtr<ibv_context> context(ctx, [&api](ibv_context* c) { api.close_device(c); });
    ibv_device_attr attr{};
    if (api.query_device(ctx, &attr) != 0) continue;
    for (uint8_t port = 1; port <= attr.phys_port_cnt; ++port) {
      ibv_port_attr pattr{};
      if (query_port(api, ctx, port, &pattr) != 0 || pattr.state != IBV_PORT_ACTIVE) continue;
      dev->name = name;
      dev->port = port;
      dev->device_attr = attr;
      dev->port_attr = pattr;
      dev->context = std::move(context);
      break;
    }
    if (!dev->context) seen += (seen.empty() ? "" : ", ") + name + " (no active port)";
  }
  api.free_device_list(list);
  if (!dev->context) {
    throw Error(ErrorCode::kUnsupported,
                "the " + backend + " backend found no usable RDMA device; devices: " + seen);
  }
  dev->gid_index = static_cast<int>(gid_index);
  if (api.query_gid(dev->context.get(), dev->port, dev->gid_index, &dev->gid) != 0) {
    std::memset(&dev->gid, 0, sizeof(dev->gid));  // InfiniBand without a GID table entry: LID only
  }
  ibv_pd* pd = api.alloc_pd(dev->context.get());
  if (pd == nullptr) {
    throw Error(ErrorCode::kUnsupported,
                backend + ": ibv_alloc_pd on " + dev->name + ": " + std::strerror(errno));
  }
  dev->pd = VerbsPtr<ibv_pd>(pd, [&api](ibv_pd* p) { api.dealloc_pd(p); });
  auto make_cq = [&](int depth) {
    ibv_cq* cq = api.create_cq(dev->context.get(), depth, nullptr, nullptr, 0);
    if (cq == nullptr) {
      throw Error(ErrorCode::kUnsupported, backend + ": ibv_create_cq(" + std::to_string(depth) +
                                               ") on " + dev->name + ": " + std::strerror(errno));
    }
    return VerbsPtr<ibv_cq>(cq, [&api](ibv_cq* c) { api.destroy_cq(c); });
  };
  dev->send_cq = make_cq(1024);  // >= RdmaTransport::kSendDepth
  dev->recv_cq = make_cq(recv_cq_depth);
  return dev;
}

// ---- transport --------------------------------------------------------------------------------

RdmaTransport::RdmaTransport(Bootstrap& bootstrap, const TransportConfig& config, const char* name)
    : TransportBase(bootstrap, config, name) {
  std::string status;
  try {
    const VerbsApi& api = load_verbs(name, config.verbs_library);
    const int depth = static_cast<int>(kRecvDepth) * std::max(1, num_peers());
    device_ =
        open_verbs_device(api, name, config.rdma_device, depth, config.gpu_pci_bus_id, rank());
  } catch (const Error& e) {
    status = "rank " + std::to_string(rank()) + ": " + message_of(e);
  }
  agree_or_throw(bootstrap_, status, ErrorCode::kUnsupported,
                 std::string("the ") + name + " backend cannot run");
}

RdmaTransport::~RdmaTransport() { stop(); }

void RdmaTransport::throw_errno(const std::string& what, int err) const {
  throw Error(ErrorCode::kSystem,
              prefix() + what + " on " + device_->name + ": " + std::strerror(err));
}

// GPU memory through DMA-BUF: the CUDA driver exports the pages as a dma-buf file descriptor and
// the NIC maps that (Linux >= 5.12, rdma-core >= 34, the open NVIDIA kernel modules); no
// nvidia-peermem needed. Null, with the reason in *why, when any piece is missing.
ibv_mr* RdmaTransport::register_dmabuf(void* base, uint64_t bytes, std::string* why) const {
  if (api().reg_dmabuf_mr == nullptr) {
    *why = "libibverbs has no ibv_reg_dmabuf_mr (rdma-core < 34)";
    return nullptr;
  }
  const mk::detail::DriverApi& drv = mk::detail::driver();
  if (drv.MemGetHandleForAddressRange == nullptr) {
    *why = "the CUDA driver has no cuMemGetHandleForAddressRange";
    return nullptr;
  }
  // The exported range must start and end on host pages; the region starts `offset` into it.
  const uint64_t page = static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
  const uint64_t address = reinterpret_cast<uint64_t>(base);
  const uint64_t start = address & ~(page - 1);
  const uint64_t offset = address - start;
  const uint64_t span = (offset + bytes + page - 1) & ~(page - 1);
  int fd = -1;
  const CUresult r = drv.MemGetHandleForAddressRange(&fd, static_cast<CUdeviceptr>(start), span,
                                                     CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD, 0);
  if (r != CUDA_SUCCESS) {
    const char* text = nullptr;
    drv.GetErrorString(r, &text);
    *why = std::string("cuMemGetHandleForAddressRange: ") + (text ? text : "unknown error");
    return nullptr;
  }
  ibv_mr* mr = api().reg_dmabuf_mr(device_->pd.get(), offset, bytes, address, fd, kRemoteAccess);
  const int err = errno;
  close(fd);  // the registration holds its own reference
  if (mr == nullptr) *why = std::string("ibv_reg_dmabuf_mr: ") + std::strerror(err);
  return mr;
}

uint32_t RdmaTransport::register_memory(int id, void* base, uint64_t bytes, MemoryKind kind) {
  // GPU memory: DMA-BUF first, then ibv_reg_mr (works where nvidia-peermem is loaded).
  // Host memory: ibv_reg_mr.
  std::string dmabuf_why;
  ibv_mr* mr = nullptr;
  if (kind == MemoryKind::kDevice) mr = register_dmabuf(base, bytes, &dmabuf_why);
  if (mr == nullptr) mr = api().reg_mr(device_->pd.get(), base, bytes, kRemoteAccess);
  if (mr == nullptr) {
    const int err = errno;
    if (kind == MemoryKind::kDevice) {
      throw Error(ErrorCode::kUnsupported,
                  "registering GPU buffer " + std::to_string(id) + " (" + std::to_string(bytes) +
                      " bytes) with " + device_->name + " failed: DMA-BUF: " + dmabuf_why +
                      "; ibv_reg_mr: " + std::strerror(err) + " (is nvidia-peermem loaded?)");
    }
    throw_errno("ibv_reg_mr of buffer " + std::to_string(id), err);
  }
  const VerbsApi* a = &api();
  mrs_[id] = VerbsPtr<ibv_mr>(mr, [a](ibv_mr* m) { a->dereg_mr(m); });
  return mr->rkey;
}

void RdmaTransport::start(const std::vector<ibv_qp*>& qps, uint32_t slots_per_qp) {
  send_slots_.resize(kSendDepth);
  const VerbsApi* a = &api();
  auto reg = [&](void* p, std::size_t n) {
    ibv_mr* mr = a->reg_mr(device_->pd.get(), p, n, IBV_ACCESS_LOCAL_WRITE);
    if (mr == nullptr) throw_errno("ibv_reg_mr of the message slots", errno);
    return VerbsPtr<ibv_mr>(mr, [a](ibv_mr* m) { a->dereg_mr(m); });
  };
  send_mr_ = reg(send_slots_.data(), send_slots_.size() * sizeof(SignalMessage));
  for (ibv_qp* qp : qps) {
    if (qp == nullptr) continue;
    for (uint32_t k = 0; k < slots_per_qp; ++k) recv_qp_of_slot_.push_back(qp);
  }
  recv_slots_.resize(recv_qp_of_slot_.size());
  recv_mr_ = reg(recv_slots_.data(), recv_slots_.size() * sizeof(SignalMessage));
  for (uint32_t slot = 0; slot < recv_slots_.size(); ++slot) repost(slot);
  progress_ = std::thread([this] { progress_loop(); });
}

void RdmaTransport::stop() {
  stopping_.store(true);
  if (progress_.joinable()) progress_.join();
}

void RdmaTransport::repost(uint32_t slot) {
  ibv_sge sge{reinterpret_cast<uint64_t>(&recv_slots_[slot]), sizeof(SignalMessage),
              recv_mr_->lkey};
  ibv_recv_wr wr{};
  wr.wr_id = slot;
  wr.sg_list = &sge;
  wr.num_sge = 1;
  ibv_recv_wr* bad = nullptr;
  const int rc = ibv_post_recv(recv_qp_of_slot_[slot], &wr, &bad);
  if (rc != 0) throw_errno("ibv_post_recv", rc);
}

void RdmaTransport::post(std::span<const TransferOp> ops) {
  check_ops(ops);
  check();  // a transport that lost a peer sends nothing more
  std::lock_guard<std::mutex> lock(post_mutex_);
  uint32_t in_flight = 0;
  auto room = [&] {
    if (in_flight == kSendDepth) {
      wait_sends(in_flight);
      in_flight = 0;
    }
  };
  const uint64_t max_chunk = max_message_bytes();
  for (const TransferOp& op : ops) {
    if (op.kind == TransferOp::Kind::kSignal) {
      room();
      SignalMessage& m = send_slots_[in_flight];
      m = SignalMessage{kSignalMagic, op.signal_id, static_cast<uint32_t>(rank()), 0, op.target,
                        op.value,     op.tile_id};
      post_send(static_cast<int>(op.dst_rank), reinterpret_cast<uint64_t>(&m), send_mr_->lkey,
                sizeof(m), op.dst_rank);
      ++in_flight;
      continue;
    }
    const LocalBuffer src = local_buffer(op.src_buffer);
    const RemoteBuffer dst = remote_buffer(static_cast<int>(op.dst_rank), op.dst_buffer);
    const uint32_t imm = encode_imm(static_cast<uint32_t>(rank()), op.signal_id);
    for (uint64_t k = 0; k < chunk_count(op.bytes, max_chunk); ++k) {
      room();
      const Chunk c = chunk_at(op.src_offset, op.dst_offset, op.bytes, max_chunk, k);
      post_write(static_cast<int>(op.dst_rank), reinterpret_cast<uint64_t>(src.base) + c.src_offset,
                 mrs_[op.src_buffer]->lkey, dst.addr + c.dst_offset, dst.rkey,
                 static_cast<uint32_t>(c.bytes), imm, op.dst_rank);
      ++in_flight;
    }
  }
  wait_sends(in_flight);
}

void RdmaTransport::wait_sends(uint32_t count) {
  const auto limit = std::chrono::steady_clock::now() +
                     std::chrono::duration<double>(std::min(timeout_seconds_, 1e6));
  ibv_wc wc[32];
  while (count > 0) {
    const int n = ibv_poll_cq(device_->send_cq.get(), 32, wc);
    if (n < 0) throw_errno("ibv_poll_cq (send)", EIO);
    for (int i = 0; i < n; ++i) {
      if (wc[i].status != IBV_WC_SUCCESS) {
        Error error(ErrorCode::kBootstrap,
                    prefix() + "a transfer to rank " + std::to_string(wc[i].wr_id) + " failed: " +
                        wc_status_text(api(), wc[i].status) + " (peer gone or unreachable)");
        fail(error);
        throw error;
      }
    }
    count -= static_cast<uint32_t>(n);
    if (n == 0 && std::chrono::steady_clock::now() > limit) {
      Error error(ErrorCode::kTimeout, prefix() + std::to_string(count) +
                                           " RDMA work requests did not complete within " +
                                           mk::detail::format_seconds(timeout_seconds_) + " s");
      fail(error);
      throw error;
    }
  }
}

void RdmaTransport::progress_loop() {
  ibv_wc wc[32];
  uint32_t idle = 0;
  while (!stopping_.load(std::memory_order_acquire)) {
    const int n = ibv_poll_cq(device_->recv_cq.get(), 32, wc);
    if (n < 0) {
      fail(Error(ErrorCode::kSystem, prefix() + "ibv_poll_cq (receive) failed"));
      return;
    }
    if (n == 0) {
      if (++idle > 1024) std::this_thread::sleep_for(std::chrono::microseconds(20));
      continue;
    }
    idle = 0;
    try {
      for (int i = 0; i < n; ++i) handle_receive(wc[i]);
    } catch (const Error& e) {
      fail(e);
      return;
    }
  }
}

void RdmaTransport::handle_receive(const ibv_wc& wc) {
  if (wc.status != IBV_WC_SUCCESS) {
    throw Error(ErrorCode::kBootstrap, prefix() +
                                           "receive failed: " + wc_status_text(api(), wc.status) +
                                           " (a peer disconnected?)");
  }
  const uint32_t slot = static_cast<uint32_t>(wc.wr_id);
  if (wc.opcode == IBV_WC_RECV_RDMA_WITH_IMM) {
    const ImmFields f = decode_imm(ntohl(wc.imm_data));
    if (f.src_rank >= static_cast<uint32_t>(world_size()) ||
        (f.signal != kNoSignal && f.signal >= config_.num_signals)) {
      throw Error(ErrorCode::kInternal, prefix() + "malformed immediate " +
                                            std::to_string(ntohl(wc.imm_data)) + ": rank " +
                                            std::to_string(f.src_rank) + ", signal " +
                                            std::to_string(f.signal));
    }
    if (f.signal != kNoSignal) tracker().add_bytes(f.src_rank, f.signal, wc.byte_len);
  } else if (wc.opcode == IBV_WC_RECV) {
    const SignalMessage m = recv_slots_[slot];
    std::string why;
    if (m.magic != kSignalMagic || wc.byte_len != sizeof(SignalMessage)) {
      why = "not a signal message (" + std::to_string(wc.byte_len) + " bytes)";
    } else if (m.src_rank >= static_cast<uint32_t>(world_size())) {
      why = "source rank " + std::to_string(m.src_rank) + " out of range";
    } else {
      why = check_incoming_signal(m.src_rank, m.signal);
    }
    if (!why.empty()) throw Error(ErrorCode::kInternal, prefix() + "malformed message: " + why);
    tracker().add_signal(m.src_rank, m.signal, m.target, m.value);
  }
  repost(slot);
}

}  // namespace mk::transport::detail
