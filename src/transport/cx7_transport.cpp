// The cx7 backend: libibverbs RC queue pairs (ConnectX-7, InfiniBand or RoCE), one per peer.
//
// Setup: open device -> one RC QP per peer -> INIT -> allgather {qp_num, psn, lid, gid} for every
// (rank, peer) pair through the bootstrap -> RTR (peer's QP number, path, PSN) -> RTS -> receives
// posted -> progress thread. Data: RDMA write with immediate (rank, signal) per chunk of up to the
// port's max_msg_sz; signals as SEND of a SignalMessage. RC keeps order on one QP, which the
// tracker does not rely on; a later optimisation may chain a flag write behind the data instead
// (see docs/TRANSPORT.md).
//
// Not done: NIC choice by NUMA / PCIe affinity to the GPU, several QPs per peer, GPU memory by
// DMA-BUF. Untested here: no NIC on the development machines.
#include <arpa/inet.h>

#include <cstring>
#include <random>

#include "transport/backends.h"
#include "transport/verbs_common.h"

namespace mk::transport::detail {
namespace {

// One side of a connection, as published through the bootstrap.
struct RcEndpoint {
  uint32_t qp_num;
  uint32_t psn;
  uint16_t lid;
  uint8_t reserved[6];
  uint8_t gid[16];
};
static_assert(sizeof(RcEndpoint) == 32);

class Cx7Transport final : public RdmaTransport {
 public:
  Cx7Transport(Bootstrap& bootstrap, const TransportConfig& config);
  ~Cx7Transport() override { stop(); }

 private:
  void post_write(int peer, uint64_t local_addr, uint32_t lkey, uint64_t remote_addr, uint32_t rkey,
                  uint32_t bytes, uint32_t imm, uint64_t wr_id) override;
  void post_send(int peer, uint64_t local_addr, uint32_t lkey, uint32_t bytes,
                 uint64_t wr_id) override;
  uint64_t max_message_bytes() const override { return device_->port_attr.max_msg_sz; }

  void create_qps(std::vector<RcEndpoint>& mine);
  void connect(int peer, const RcEndpoint& local, const RcEndpoint& remote);
  void post(int peer, ibv_send_wr& wr);

  std::vector<VerbsPtr<ibv_qp>> qps_;  // [world_size]; null for this rank
};

Cx7Transport::Cx7Transport(Bootstrap& bootstrap, const TransportConfig& config)
    : RdmaTransport(bootstrap, config, "cx7"), qps_(static_cast<std::size_t>(world_size())) {
  std::vector<RcEndpoint> mine(static_cast<std::size_t>(world_size()));
  std::string status;
  try {
    create_qps(mine);
  } catch (const Error& e) {
    status = "rank " + std::to_string(rank()) + ": " + message_of(e);
  }
  agree_or_throw(bootstrap_, status, ErrorCode::kUnsupported, prefix() + "creating queue pairs");

  // all[r * world + p]: rank r's endpoint of its QP towards p.
  std::vector<RcEndpoint> all(mine.size() * mine.size());
  bootstrap_.allgather(mine.data(), all.data(), mine.size() * sizeof(RcEndpoint));
  try {
    for (int p = 0; p < world_size(); ++p) {
      if (is_peer(p)) connect(p, mine[p], all[static_cast<std::size_t>(p) * world_size() + rank()]);
    }
  } catch (const Error& e) {
    status = "rank " + std::to_string(rank()) + ": " + message_of(e);
  }
  agree_or_throw(bootstrap_, status, ErrorCode::kBootstrap, prefix() + "connecting queue pairs");

  std::vector<ibv_qp*> raw;
  for (auto& qp : qps_) raw.push_back(qp.get());
  start(raw, kRecvDepth);
  bootstrap_.barrier();  // every rank's receives are posted before anyone writes
}

void Cx7Transport::create_qps(std::vector<RcEndpoint>& mine) {
  const VerbsApi* a = &api();
  std::mt19937 rng(std::random_device{}());
  for (int p = 0; p < world_size(); ++p) {
    if (!is_peer(p)) continue;  // this rank, and ranks outside TransportConfig::peers
    ibv_qp_init_attr init{};
    init.send_cq = device_->send_cq.get();
    init.recv_cq = device_->recv_cq.get();
    init.qp_type = IBV_QPT_RC;
    init.cap.max_send_wr = kSendDepth;
    init.cap.max_recv_wr = kRecvDepth;
    init.cap.max_send_sge = 1;
    init.cap.max_recv_sge = 1;
    ibv_qp* qp = a->create_qp(device_->pd.get(), &init);
    if (qp == nullptr) throw_errno("ibv_create_qp (RC) for rank " + std::to_string(p), errno);
    qps_[p] = VerbsPtr<ibv_qp>(qp, [a](ibv_qp* q) { a->destroy_qp(q); });

    ibv_qp_attr attr{};
    attr.qp_state = IBV_QPS_INIT;
    attr.pkey_index = 0;
    attr.port_num = device_->port;
    attr.qp_access_flags =
        IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ;
    const int rc = a->modify_qp(
        qp, &attr, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS);
    if (rc != 0) throw_errno("ibv_modify_qp(INIT) for rank " + std::to_string(p), rc);

    RcEndpoint& e = mine[p];
    e.qp_num = qp->qp_num;
    e.psn = rng() & 0xFFFFFF;
    e.lid = device_->port_attr.lid;
    std::memcpy(e.gid, device_->gid.raw, sizeof(e.gid));
  }
}

void Cx7Transport::connect(int peer, const RcEndpoint& local, const RcEndpoint& remote) {
  const VerbsApi& a = api();
  ibv_qp* qp = qps_[peer].get();
  const bool global = device_->port_attr.link_layer == IBV_LINK_LAYER_ETHERNET ||
                      device_->port_attr.lid == 0;  // RoCE, or IB addressed by GID

  ibv_qp_attr attr{};
  attr.qp_state = IBV_QPS_RTR;
  attr.path_mtu = device_->port_attr.active_mtu;
  attr.dest_qp_num = remote.qp_num;
  attr.rq_psn = remote.psn;
  attr.max_dest_rd_atomic = 1;
  attr.min_rnr_timer = 12;
  attr.ah_attr.dlid = remote.lid;
  attr.ah_attr.sl = 0;
  attr.ah_attr.src_path_bits = 0;
  attr.ah_attr.port_num = device_->port;
  if (global) {
    attr.ah_attr.is_global = 1;
    std::memcpy(attr.ah_attr.grh.dgid.raw, remote.gid, sizeof(remote.gid));
    attr.ah_attr.grh.sgid_index = static_cast<uint8_t>(device_->gid_index);
    attr.ah_attr.grh.hop_limit = 64;
  }
  int rc = a.modify_qp(qp, &attr,
                       IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN |
                           IBV_QP_RQ_PSN | IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER);
  if (rc != 0) throw_errno("ibv_modify_qp(RTR) towards rank " + std::to_string(peer), rc);

  attr = ibv_qp_attr{};
  attr.qp_state = IBV_QPS_RTS;
  attr.timeout = 14;  // 4.096 us * 2^14 = 67 ms per retry
  attr.retry_cnt = 7;
  attr.rnr_retry = 7;  // infinite: receives are reposted by the progress thread
  attr.sq_psn = local.psn;
  attr.max_rd_atomic = 1;
  rc = a.modify_qp(qp, &attr,
                   IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY |
                       IBV_QP_SQ_PSN | IBV_QP_MAX_QP_RD_ATOMIC);
  if (rc != 0) throw_errno("ibv_modify_qp(RTS) towards rank " + std::to_string(peer), rc);
}

void Cx7Transport::post(int peer, ibv_send_wr& wr) {
  ibv_send_wr* bad = nullptr;
  const int rc = ibv_post_send(qps_[peer].get(), &wr, &bad);
  if (rc != 0) throw_errno("ibv_post_send to rank " + std::to_string(peer), rc);
}

void Cx7Transport::post_write(int peer, uint64_t local_addr, uint32_t lkey, uint64_t remote_addr,
                              uint32_t rkey, uint32_t bytes, uint32_t imm, uint64_t wr_id) {
  ibv_sge sge{local_addr, bytes, lkey};
  ibv_send_wr wr{};
  wr.wr_id = wr_id;
  wr.sg_list = &sge;
  wr.num_sge = 1;
  wr.opcode = IBV_WR_RDMA_WRITE_WITH_IMM;
  wr.send_flags = IBV_SEND_SIGNALED;
  wr.imm_data = htonl(imm);
  wr.wr.rdma.remote_addr = remote_addr;
  wr.wr.rdma.rkey = rkey;
  post(peer, wr);
}

void Cx7Transport::post_send(int peer, uint64_t local_addr, uint32_t lkey, uint32_t bytes,
                             uint64_t wr_id) {
  ibv_sge sge{local_addr, bytes, lkey};
  ibv_send_wr wr{};
  wr.wr_id = wr_id;
  wr.sg_list = &sge;
  wr.num_sge = 1;
  wr.opcode = IBV_WR_SEND;
  wr.send_flags = IBV_SEND_SIGNALED;
  post(peer, wr);
}

}  // namespace

std::unique_ptr<Transport> make_cx7_transport(Bootstrap& bootstrap, const TransportConfig& config) {
  if (static_cast<uint32_t>(bootstrap.size()) > kImmMaxRanks ||
      config.num_signals > kImmMaxSignals) {
    throw Error(ErrorCode::kUnsupported,
                "the cx7 backend carries (rank, signal) in a 32-bit immediate: at most " +
                    std::to_string(kImmMaxRanks) + " ranks and " + std::to_string(kImmMaxSignals) +
                    " signals (got " + std::to_string(bootstrap.size()) + " and " +
                    std::to_string(config.num_signals) + ")");
  }
  return std::make_unique<Cx7Transport>(bootstrap, config);
}

}  // namespace mk::transport::detail
