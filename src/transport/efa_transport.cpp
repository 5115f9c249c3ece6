// The efa backend: one SRD queue pair (AWS EFA, through efadv), address handles per peer.
//
// Setup: load libibverbs and libefa -> open device -> efadv_query_device: RDMA write capability
// and max_rdma_size (the chunk size) -> SRD QP via efadv_create_qp_ex with the extended send
// ops (write with immediate, send) -> INIT (qkey) / RTR / RTS -> allgather {gid, qpn, qkey} ->
// an address handle per peer -> receives posted -> progress thread. Data: RDMA write with
// immediate (rank, signal); signals as SEND. SRD delivers out of order; completion accounting
// (completion.h) never assumes otherwise.
//
// Not done: several NICs (rails) per GPU, GPU memory by DMA-BUF, batching several work requests
// in one ibv_wr_start / ibv_wr_complete. Untested here: no EFA device on the development machines.
#include <arpa/inet.h>

#include <cstdio>
#include <cstring>

#include "transport/backends.h"
#include "transport/verbs_common.h"

namespace mk::transport::detail {
namespace {

// EFADV_DEVICE_ATTR_CAPS_RDMA_WRITE of newer rdma-core (Debian 12's efadv.h predates it).
constexpr uint32_t kEfaCapsRdmaWrite = 1u << 3;
constexpr uint32_t kQkey = 0x4D4B4E4C;

struct EfaEndpoint {
  uint8_t gid[16];
  uint32_t qpn;
  uint32_t qkey;
};
static_assert(sizeof(EfaEndpoint) == 24);

class EfaTransport final : public RdmaTransport {
 public:
  EfaTransport(Bootstrap& bootstrap, const TransportConfig& config);
  ~EfaTransport() override { stop(); }

 private:
  void post_write(int peer, uint64_t local_addr, uint32_t lkey, uint64_t remote_addr, uint32_t rkey,
                  uint32_t bytes, uint32_t imm, uint64_t wr_id) override;
  void post_send(int peer, uint64_t local_addr, uint32_t lkey, uint32_t bytes,
                 uint64_t wr_id) override;
  uint64_t max_message_bytes() const override { return max_rdma_size_; }

  void create_qp();
  void make_address_handles(const std::vector<EfaEndpoint>& all);

  uint64_t max_rdma_size_ = 0;
  VerbsPtr<ibv_qp> qp_;
  ibv_qp_ex* qpx_ = nullptr;
  std::vector<VerbsPtr<ibv_ah>> ahs_;  // [world_size]
  std::vector<uint32_t> remote_qpn_;   // [world_size]
};

EfaTransport::EfaTransport(Bootstrap& bootstrap, const TransportConfig& config)
    : RdmaTransport(bootstrap, config, "efa"),
      ahs_(static_cast<std::size_t>(world_size())),
      remote_qpn_(static_cast<std::size_t>(world_size())) {
  std::string status;
  try {
    create_qp();
  } catch (const Error& e) {
    status = "rank " + std::to_string(rank()) + ": " + message_of(e);
  }
  agree_or_throw(bootstrap_, status, ErrorCode::kUnsupported, prefix() + "creating the SRD QP");

  EfaEndpoint mine{};
  std::memcpy(mine.gid, device_->gid.raw, sizeof(mine.gid));
  mine.qpn = qp_->qp_num;
  mine.qkey = kQkey;
  std::vector<EfaEndpoint> all(static_cast<std::size_t>(world_size()));
  bootstrap_.allgather(&mine, all.data(), sizeof(EfaEndpoint));
  try {
    make_address_handles(all);
  } catch (const Error& e) {
    status = "rank " + std::to_string(rank()) + ": " + message_of(e);
  }
  agree_or_throw(bootstrap_, status, ErrorCode::kBootstrap, prefix() + "address handles");

  const uint32_t slots =
      std::min<uint32_t>(kRecvDepth * static_cast<uint32_t>(std::max(1, num_peers())),
                         static_cast<uint32_t>(device_->device_attr.max_qp_wr));
  start({qp_.get()}, slots);
  bootstrap_.barrier();  // every rank's receives are posted before anyone writes
}

void EfaTransport::create_qp() {
  const EfaApi& efa = load_efa(config_.efa_library);
  ibv_context* ctx = device_->context.get();
  efadv_device_attr eattr{};
  if (const int rc = efa.query_device(ctx, &eattr, sizeof(eattr)); rc != 0) {
    throw_errno("efadv_query_device (is " + device_->name + " an EFA device?)", rc);
  }
  if ((eattr.device_caps & kEfaCapsRdmaWrite) == 0) {
    char caps[16];
    std::snprintf(caps, sizeof(caps), "0x%x", eattr.device_caps);
    throw Error(ErrorCode::kUnsupported,
                "EFA device " + device_->name + " cannot do RDMA write (device_caps " + caps +
                    "); it needs a recent EFA driver and rdma-core (write support, 2023+)");
  }
  max_rdma_size_ = eattr.max_rdma_size;
  if (max_rdma_size_ == 0) max_rdma_size_ = device_->port_attr.max_msg_sz;
  if (api().qp_to_qp_ex == nullptr) {
    throw Error(ErrorCode::kUnsupported, "the efa backend needs ibv_qp_to_qp_ex from " +
                                             api().path + " (rdma-core too old)");
  }

  ibv_qp_init_attr_ex init{};
  init.send_cq = device_->send_cq.get();
  init.recv_cq = device_->recv_cq.get();
  init.cap.max_send_wr = kSendDepth;
  init.cap.max_recv_wr =
      std::min<uint32_t>(kRecvDepth * static_cast<uint32_t>(std::max(1, num_peers())),
                         static_cast<uint32_t>(device_->device_attr.max_qp_wr));
  init.cap.max_send_sge = 1;
  init.cap.max_recv_sge = 1;
  init.qp_type = IBV_QPT_DRIVER;
  init.pd = device_->pd.get();
  init.comp_mask = IBV_QP_INIT_ATTR_PD | IBV_QP_INIT_ATTR_SEND_OPS_FLAGS;
  init.send_ops_flags = IBV_QP_EX_WITH_RDMA_WRITE_WITH_IMM | IBV_QP_EX_WITH_SEND;
  efadv_qp_init_attr efa_init{};
  efa_init.driver_qp_type = EFADV_QP_DRIVER_TYPE_SRD;
  ibv_qp* qp = efa.create_qp_ex(ctx, &init, &efa_init, sizeof(efa_init));
  if (qp == nullptr) throw_errno("efadv_create_qp_ex (SRD)", errno);
  const VerbsApi* a = &api();
  qp_ = VerbsPtr<ibv_qp>(qp, [a](ibv_qp* q) { a->destroy_qp(q); });
  qpx_ = a->qp_to_qp_ex(qp);

  ibv_qp_attr attr{};
  attr.qp_state = IBV_QPS_INIT;
  attr.pkey_index = 0;
  attr.port_num = device_->port;
  attr.qkey = kQkey;
  if (int rc =
          a->modify_qp(qp, &attr, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_QKEY);
      rc != 0) {
    throw_errno("ibv_modify_qp(INIT)", rc);
  }
  attr = ibv_qp_attr{};
  attr.qp_state = IBV_QPS_RTR;
  if (int rc = a->modify_qp(qp, &attr, IBV_QP_STATE); rc != 0)
    throw_errno("ibv_modify_qp(RTR)", rc);
  attr = ibv_qp_attr{};
  attr.qp_state = IBV_QPS_RTS;
  attr.sq_psn = 0;
  if (int rc = a->modify_qp(qp, &attr, IBV_QP_STATE | IBV_QP_SQ_PSN); rc != 0) {
    throw_errno("ibv_modify_qp(RTS)", rc);
  }
}

void EfaTransport::make_address_handles(const std::vector<EfaEndpoint>& all) {
  const VerbsApi* a = &api();
  for (int p = 0; p < world_size(); ++p) {
    if (!is_peer(p)) continue;  // this rank, and ranks outside TransportConfig::peers
    ibv_ah_attr attr{};
    attr.port_num = device_->port;
    attr.is_global = 1;
    std::memcpy(attr.grh.dgid.raw, all[p].gid, sizeof(all[p].gid));
    ibv_ah* ah = a->create_ah(device_->pd.get(), &attr);
    if (ah == nullptr) throw_errno("ibv_create_ah for rank " + std::to_string(p), errno);
    ahs_[p] = VerbsPtr<ibv_ah>(ah, [a](ibv_ah* h) { a->destroy_ah(h); });
    remote_qpn_[p] = all[p].qpn;
  }
}

void EfaTransport::post_write(int peer, uint64_t local_addr, uint32_t lkey, uint64_t remote_addr,
                              uint32_t rkey, uint32_t bytes, uint32_t imm, uint64_t wr_id) {
  ibv_wr_start(qpx_);
  qpx_->wr_id = wr_id;
  qpx_->wr_flags = IBV_SEND_SIGNALED;
  ibv_wr_rdma_write_imm(qpx_, rkey, remote_addr, htonl(imm));
  ibv_wr_set_sge(qpx_, lkey, local_addr, bytes);
  ibv_wr_set_ud_addr(qpx_, ahs_[peer].get(), remote_qpn_[peer], kQkey);
  if (const int rc = ibv_wr_complete(qpx_); rc != 0) {
    throw_errno("RDMA write to rank " + std::to_string(peer), rc);
  }
}

void EfaTransport::post_send(int peer, uint64_t local_addr, uint32_t lkey, uint32_t bytes,
                             uint64_t wr_id) {
  ibv_wr_start(qpx_);
  qpx_->wr_id = wr_id;
  qpx_->wr_flags = IBV_SEND_SIGNALED;
  ibv_wr_send(qpx_);
  ibv_wr_set_sge(qpx_, lkey, local_addr, bytes);
  ibv_wr_set_ud_addr(qpx_, ahs_[peer].get(), remote_qpn_[peer], kQkey);
  if (const int rc = ibv_wr_complete(qpx_); rc != 0) {
    throw_errno("send to rank " + std::to_string(peer), rc);
  }
}

}  // namespace

std::unique_ptr<Transport> make_efa_transport(Bootstrap& bootstrap, const TransportConfig& config) {
  if (static_cast<uint32_t>(bootstrap.size()) > kImmMaxRanks ||
      config.num_signals > kImmMaxSignals) {
    throw Error(ErrorCode::kUnsupported,
                "the efa backend carries (rank, signal) in a 32-bit immediate: at most " +
                    std::to_string(kImmMaxRanks) + " ranks and " + std::to_string(kImmMaxSignals) +
                    " signals (got " + std::to_string(bootstrap.size()) + " and " +
                    std::to_string(config.num_signals) + ")");
  }
  return std::make_unique<EfaTransport>(bootstrap, config);
}

}  // namespace mk::transport::detail
