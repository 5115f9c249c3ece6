#include "runtime/inter_node.h"

#include <algorithm>
#include <cstdio>
#include <utility>

#include "runtime/text_util.h"

namespace mk::detail {

InterNode::InterNode(Bootstrap& bootstrap, const Topology& topo, InterNodeConfig config)
    : config_(std::move(config)), rank_(topo.rank), used_(transport::kMaxBuffers) {
  const std::string who = "inter-node path of rank " + std::to_string(topo.rank) + ": ";
  if (topo.num_nodes < 2) {
    throw Error(ErrorCode::kInvalidArgument, who + "the communicator has one node (" +
                                                 std::to_string(topo.world_size) +
                                                 " ranks); nothing lies between nodes");
  }
  if (config_.channels < 1 || config_.channels > 64) {
    throw Error(ErrorCode::kInvalidArgument,
                who + "channels = " + std::to_string(config_.channels) + "; expected 1 to 64");
  }
  if (config_.num_signals < 1) {
    throw Error(ErrorCode::kInvalidArgument, who + "num_signals must be at least 1");
  }
  const std::string& staging = config_.staging;
  if (!staging.empty() && staging != "host" && staging != "device") {
    throw Error(ErrorCode::kInvalidArgument,
                who + "staging \"" + staging + "\"; expected \"host\" or \"device\"");
  }
  peers_ = topo.rail_peers();

  pad_ = std::make_unique<transport::HostSignalPad>(topo.world_size, config_.num_signals,
                                                    config_.host_memory);
  transport::TransportConfig tc;
  tc.signals = pad_.get();
  tc.num_signals = config_.num_signals;
  tc.timeout_seconds = config_.timeout_seconds;
  tc.copy_to_device = config_.copy_to_device;
  tc.copy_from_device = config_.copy_from_device;
  tc.on_error = [this](const Error& e) { record(e); };
  tc.peers = peers_;
  tc.socket_ifname = config_.socket_ifname;
  tc.gpu_pci_bus_id = config_.gpu_pci_bus_id;
  transport_ = transport::make_transport(bootstrap, tc, config_.backend);
  host_staging_ = staging.empty() ? std::string(transport_->name()) == "socket" : staging == "host";

  transport::ProxyOptions po;
  po.num_rings = config_.channels;
  po.ring_capacity = config_.ring_capacity;
  po.allocator = config_.host_memory;
  po.on_error = [this](const Error& e) { record(e); };
  proxy_ = std::make_unique<transport::Proxy>(*transport_, std::move(po));
}

InterNode::~InterNode() {
  // What was pushed still goes out (a peer may be waiting for it); a failed path or a full
  // time-out ends the wait. Destructors throw nothing, but a time-out here has held the caller
  // for the whole limit, so it is said on stderr (what was left, on which ring).
  if (proxy_) {
    try {
      if (!failed()) proxy_->drain(config_.timeout_seconds);
    } catch (const Error& e) {
      std::fprintf(stderr, "[mkernel] inter-node teardown gave up: %s\n", e.what());
    }
    proxy_->stop();
  }
  proxy_.reset();
  transport_.reset();  // goodbyes to the peers
  pad_.reset();
  for (const Staging& s : stagings_) free_host(s.base);
}

void* InterNode::alloc_host(uint64_t bytes) const {
  if (config_.host_memory.alloc) return config_.host_memory.alloc(bytes);
  return std::aligned_alloc(kStagingAlign,
                            (bytes + kStagingAlign - 1) / kStagingAlign * kStagingAlign);
}

void InterNode::free_host(void* p) const {
  if (config_.host_memory.alloc) {
    config_.host_memory.free(p);
  } else {
    std::free(p);
  }
}

InterNode::Staging InterNode::staging(uint64_t bytes) {
  if (!host_staging_) {
    throw Error(ErrorCode::kInternal, "inter-node path of rank " + std::to_string(rank_) +
                                          ": staging() asked for on a path that stages in device "
                                          "memory");
  }
  bytes = std::max<uint64_t>(bytes, kStagingAlign);
  if (!stagings_.empty() && stagings_.back().bytes >= bytes) return stagings_.back();
  Staging s;
  s.base = static_cast<uint8_t*>(alloc_host(bytes));
  if (s.base == nullptr) {
    throw Error(ErrorCode::kOutOfMemory, "inter-node path of rank " + std::to_string(rank_) +
                                             ": cannot allocate " + std::to_string(bytes) +
                                             " bytes of pinned host staging");
  }
  s.bytes = bytes;
  try {
    s.buffer = buffer_id(s.base, bytes, transport::MemoryKind::kHost);
  } catch (...) {
    free_host(s.base);
    throw;
  }
  stagings_.push_back(s);
  return s;
}

void InterNode::record(const Error& error) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (error_) return;
    error_ = error;
  }
  if (config_.on_error) config_.on_error(error);
}

void InterNode::register_buffer(int id, void* base, uint64_t bytes, transport::MemoryKind kind) {
  transport_->register_buffer(id, base, bytes, kind);
  used_[id] = true;
}

int InterNode::buffer_id(void* base, uint64_t bytes, transport::MemoryKind kind,
                         std::weak_ptr<const void> owner) {
  // Registrations whose owner is gone: nothing may be in flight for them any more.
  bool drained = false;
  for (auto it = registered_.begin(); it != registered_.end();) {
    if (!it->owned || !it->owner.expired()) {
      ++it;
      continue;
    }
    if (!drained) {
      proxy_->drain(config_.timeout_seconds);
      drained = true;
    }
    transport_->release_buffer(it->id);
    used_[it->id] = false;
    it = registered_.erase(it);
  }
  for (const Registered& r : registered_) {
    if (r.base != base) continue;
    if (r.bytes != bytes) {
      throw Error(ErrorCode::kInvalidArgument,
                  "inter-node path of rank " + std::to_string(rank_) + ": the buffer at " +
                      std::to_string(reinterpret_cast<uintptr_t>(base)) + " was registered with " +
                      std::to_string(r.bytes) + " bytes, now asked for with " +
                      std::to_string(bytes));
    }
    return r.id;
  }
  int id = 0;
  while (id < transport::kMaxBuffers && used_[id]) ++id;
  if (id == transport::kMaxBuffers) {
    throw Error(ErrorCode::kOutOfMemory,
                "inter-node path of rank " + std::to_string(rank_) + ": all " +
                    std::to_string(transport::kMaxBuffers) +
                    " buffer ids are registered; free workspaces that are no longer used");
  }
  register_buffer(id, base, bytes, kind);
  const bool owned = owner.lock() != nullptr;
  registered_.push_back({base, bytes, id, std::move(owner), owned});
  return id;
}

void InterNode::check() const {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (error_) throw *error_;
  }
  transport_->check();
  proxy_->check();
}

bool InterNode::failed() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return error_.has_value() || transport_->failed();
}

void InterNode::wait(int src_rank, uint32_t signal, uint64_t value) const {
  const bool arrived = pad_->wait(static_cast<uint32_t>(src_rank), signal, value,
                                  config_.timeout_seconds, [this] { check(); });
  if (!arrived) {
    check();
    throw Error(ErrorCode::kTimeout,
                "rank " + std::to_string(rank_) + " waited " +
                    format_seconds(config_.timeout_seconds) + " s for signal " +
                    std::to_string(signal) + " from rank " + std::to_string(src_rank) +
                    " to reach " + std::to_string(value) + " (it is at " +
                    std::to_string(pad_->load(static_cast<uint32_t>(src_rank), signal)) + ")");
  }
}

std::string InterNode::describe() const {
  return std::string("inter-node: ") + transport_->name() + ", rail peers " + format_ranks(peers_) +
         ", " + std::to_string(config_.channels) + " channel(s) of " +
         std::to_string(config_.ring_capacity) + " commands, " +
         std::to_string(config_.num_signals) + " signals per peer, staging in " +
         (host_staging_ ? "host" : "device") + " memory";
}

}  // namespace mk::detail
