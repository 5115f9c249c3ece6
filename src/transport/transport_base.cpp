// TransportBase: buffer table, checks, completion accounting and errors shared by the backends.
#include "transport/transport_base.h"

#include <cstdlib>
#include <cstring>

#include "runtime/overrides.h"
#include "runtime/socket_util.h"
#include "runtime/text_util.h"

namespace mk::transport::detail {
namespace {

constexpr std::size_t kStatusBytes = 512;

// What one rank publishes when a buffer is registered.
struct PublishedBuffer {
  uint64_t addr;
  uint64_t bytes;
  uint32_t rkey;
  uint32_t kind;
  int32_t id;  // the id this rank registers it under (all must agree)
  uint32_t unused;
  char status[kStatusBytes];  // empty = registered
};

}  // namespace

std::string message_of(const Error& e) {
  const std::string prefix = std::string(to_string(e.code())) + ": ";
  const std::string text = e.what();
  return text.compare(0, prefix.size(), prefix) == 0 ? text.substr(prefix.size()) : text;
}

namespace {

void copy_status(char (&out)[kStatusBytes], const std::string& text) {
  std::memset(out, 0, kStatusBytes);
  std::memcpy(out, text.data(), std::min(text.size(), kStatusBytes - 1));
}

}  // namespace

double resolve_timeout(double configured) {
  double seconds = configured;
  if (seconds < 0) {
    seconds = mk::detail::env_seconds(mk::detail::process_environment(), "MKERNEL_TIMEOUT_S", 60);
  }
  return seconds == 0 ? mk::detail::kForeverSeconds : seconds;  // 0 = no limit
}

void agree_or_throw(Bootstrap& bootstrap, const std::string& my_status, ErrorCode code,
                    const std::string& what) {
  char mine[kStatusBytes];
  copy_status(mine, my_status);
  std::vector<char> all(kStatusBytes * static_cast<std::size_t>(bootstrap.size()));
  bootstrap.allgather(mine, all.data(), kStatusBytes);
  std::string message;
  for (int r = 0; r < bootstrap.size(); ++r) {
    const char* status = &all[kStatusBytes * r];
    if (*status == '\0') continue;
    message += (message.empty() ? "" : "; ") + std::string(status);
  }
  if (!message.empty()) throw Error(code, what + ": " + message);
}

static SignalSink& checked_sink(const TransportConfig& config, const char* name) {
  if (config.signals == nullptr) {
    throw Error(ErrorCode::kInvalidArgument,
                std::string("transport ") + name +
                    ": TransportConfig::signals is null; pass the "
                    "SignalSink that arrivals raise (e.g. a HostSignalPad)");
  }
  if (config.num_signals == 0 || config.num_signals >= kNoSignal) {
    throw Error(ErrorCode::kInvalidArgument, std::string("transport ") + name + ": num_signals " +
                                                 std::to_string(config.num_signals) +
                                                 " is not valid; expected 1 .. 2^32 - 2");
  }
  return *config.signals;
}

TransportBase::TransportBase(Bootstrap& bootstrap, const TransportConfig& config, const char* name)
    : bootstrap_(bootstrap),
      config_(config),
      timeout_seconds_(resolve_timeout(config.timeout_seconds)),
      name_(name),
      rank_(bootstrap.rank()),
      world_size_(bootstrap.size()),
      tracker_(static_cast<uint32_t>(bootstrap.size()), config.num_signals,
               checked_sink(config, name)),
      remote_(static_cast<std::size_t>(bootstrap.size()) * kMaxBuffers) {
  // The peer set: checked here, then agreed (symmetric) through one allgather of every rank's row.
  std::string status;
  peer_.assign(static_cast<std::size_t>(world_size_), config.peers.empty() ? 1 : 0);
  if (config.peers.empty()) {
    peer_[static_cast<std::size_t>(rank_)] = 0;
  } else {
    for (const int r : config.peers) {
      if (r < 0 || r >= world_size_ || r == rank_ || peer_[static_cast<std::size_t>(r)] != 0) {
        status = "rank " + std::to_string(rank_) + ": peers lists rank " + std::to_string(r) +
                 (r == rank_                  ? " (itself)"
                  : r < 0 || r >= world_size_ ? " (world size " + std::to_string(world_size_) + ")"
                                              : " twice");
        break;
      }
      peer_[static_cast<std::size_t>(r)] = 1;
    }
  }
  std::vector<uint8_t> rows(static_cast<std::size_t>(world_size_) * world_size_);
  bootstrap.allgather(peer_.data(), rows.data(), peer_.size());
  // A bad entry is known to its rank only: agree on it. Every rank sees the same rows, so the
  // symmetry verdict is the same everywhere without another exchange.
  const std::string what = std::string("transport ") + name + ": bad peer set";
  agree_or_throw(bootstrap, status, ErrorCode::kInvalidArgument, what);
  const auto row = [&](int a, int b) {
    return rows[static_cast<std::size_t>(a) * world_size_ + b] != 0;
  };
  for (int r = 0; r < world_size_; ++r) {
    for (int s = 0; s < world_size_; ++s) {
      if (row(r, s) && !row(s, r)) {
        throw Error(ErrorCode::kInvalidArgument,
                    what + ": rank " + std::to_string(r) + " lists rank " + std::to_string(s) +
                        " as a peer but rank " + std::to_string(s) + " does not list rank " +
                        std::to_string(r) + " (TransportConfig::peers must be symmetric)");
      }
    }
  }
  for (const uint8_t p : peer_) num_peers_ += p;
}

TransportBase::~TransportBase() = default;

std::string TransportBase::prefix() const {
  return std::string("transport ") + name_ + ", rank " + std::to_string(rank_) + ": ";
}

uint32_t TransportBase::register_memory(int, void*, uint64_t, MemoryKind) { return 0; }
void TransportBase::unregister_memory(int) {}

void TransportBase::release_buffer(int id) {
  if (id < 0 || id >= kMaxBuffers) return;
  {
    std::unique_lock<std::shared_mutex> lock(buffers_mutex_);
    if (local_[id].bytes == 0) return;
    local_[id] = LocalBuffer{};
    for (int r = 0; r < world_size_; ++r) {
      remote_[static_cast<std::size_t>(r) * kMaxBuffers + id] = RemoteBuffer{};
    }
  }
  unregister_memory(id);
}

void TransportBase::register_buffer(int id, void* base, uint64_t bytes, MemoryKind kind) {
  const std::string where = "rank " + std::to_string(rank_) + ": ";
  std::string status;
  if (id < 0 || id >= kMaxBuffers) {
    status = where + "buffer id " + std::to_string(id) + " is out of range; expected 0 .. " +
             std::to_string(kMaxBuffers - 1);
  } else if (base == nullptr || bytes == 0) {
    status = where + "buffer " + std::to_string(id) + " is empty (base " +
             (base == nullptr ? "null" : "set") + ", " + std::to_string(bytes) +
             " bytes); expected memory of at least one byte";
  } else if (local_buffer(id).bytes != 0) {
    status = where + "buffer id " + std::to_string(id) + " is already registered";
  }
  uint32_t rkey = 0;
  if (status.empty()) {
    try {
      rkey = register_memory(id, base, bytes, kind);
    } catch (const Error& e) {
      status = where + message_of(e);
    }
  }
  PublishedBuffer mine{
      reinterpret_cast<uint64_t>(base), bytes, rkey, static_cast<uint32_t>(kind), id, 0, {}};
  copy_status(mine.status, status);
  std::vector<PublishedBuffer> all(static_cast<std::size_t>(world_size_));
  bootstrap_.allgather(&mine, all.data(), sizeof(PublishedBuffer));

  std::string message;
  for (const PublishedBuffer& p : all) {
    if (p.status[0] != '\0') message += (message.empty() ? "" : "; ") + std::string(p.status);
  }
  for (int r = 1; r < world_size_ && message.empty(); ++r) {
    if (all[r].id != all[0].id) {
      message = "rank 0 registers this buffer as id " + std::to_string(all[0].id) + " but rank " +
                std::to_string(r) + " as id " + std::to_string(all[r].id) +
                "; every rank must register its copy of a buffer under the same id";
    } else if (all[r].bytes != all[0].bytes) {
      message = "buffer " + std::to_string(id) + " has " + std::to_string(all[0].bytes) +
                " bytes on rank 0 but " + std::to_string(all[r].bytes) + " on rank " +
                std::to_string(r) + "; a symmetric buffer has the same size on every rank";
    }
  }
  if (!message.empty()) {
    throw Error(ErrorCode::kInvalidArgument,
                prefix() + "register_buffer(" + std::to_string(id) + ") failed: " + message);
  }
  {
    std::unique_lock<std::shared_mutex> lock(buffers_mutex_);
    local_[id] = LocalBuffer{static_cast<char*>(base), bytes, kind};
    for (int r = 0; r < world_size_; ++r) {
      remote_[static_cast<std::size_t>(r) * kMaxBuffers + id] =
          RemoteBuffer{all[r].addr, all[r].bytes, all[r].rkey, all[r].kind};
    }
  }
  // Nobody may send into the buffer before every rank has entered it in its table.
  bootstrap_.barrier();
}

TransportBase::LocalBuffer TransportBase::local_buffer(int id) const {
  std::shared_lock<std::shared_mutex> lock(buffers_mutex_);
  return id >= 0 && id < kMaxBuffers ? local_[id] : LocalBuffer{};
}

TransportBase::RemoteBuffer TransportBase::remote_buffer(int rank, int id) const {
  std::shared_lock<std::shared_mutex> lock(buffers_mutex_);
  if (rank < 0 || rank >= world_size_ || id < 0 || id >= kMaxBuffers) return {};
  return remote_[static_cast<std::size_t>(rank) * kMaxBuffers + id];
}

CommandLimits TransportBase::limits() const {
  CommandLimits l;
  l.rank = static_cast<uint32_t>(rank_);
  l.world_size = static_cast<uint32_t>(world_size_);
  l.num_signals = config_.num_signals;
  std::shared_lock<std::shared_mutex> lock(buffers_mutex_);
  for (int i = 0; i < kMaxBuffers; ++i) l.buffer_bytes[i] = local_[i].bytes;
  return l;
}

std::string TransportBase::check_op(const TransferOp& op) const {
  const Command c = op.kind == TransferOp::Kind::kPut
                        ? make_put(op.dst_rank, op.tile_id, op.src_buffer, op.src_offset,
                                   op.dst_buffer, op.dst_offset, op.bytes, op.signal_id)
                        : make_signal(op.dst_rank, op.tile_id, op.signal_id, op.value);
  std::string why = validate(c, limits());
  if (why.empty() && !is_peer(static_cast<int>(op.dst_rank))) {
    why = "rank " + std::to_string(op.dst_rank) +
          " is not a peer of this transport (TransportConfig::peers; ranks of one node use NVLink)";
  }
  return why;
}

void TransportBase::check_ops(std::span<const TransferOp> ops) const {
  for (std::size_t i = 0; i < ops.size(); ++i) {
    const std::string why = check_op(ops[i]);
    if (!why.empty()) {
      throw Error(ErrorCode::kInvalidArgument, prefix() + "post: op " + std::to_string(i) + " of " +
                                                   std::to_string(ops.size()) + " refused (" +
                                                   "nothing of the batch was sent): " + why);
    }
  }
}

std::string TransportBase::check_incoming_put(uint32_t src, uint8_t dst_buffer, uint64_t dst_offset,
                                              uint64_t bytes, uint32_t signal) const {
  const LocalBuffer b = local_buffer(dst_buffer);
  const std::string what = "put from rank " + std::to_string(src) + " into buffer " +
                           std::to_string(dst_buffer) + " @ " + std::to_string(dst_offset) + ", " +
                           std::to_string(bytes) + " bytes";
  if (!is_peer(static_cast<int>(src)))
    return what + ": rank " + std::to_string(src) + " is not a peer";
  if (b.bytes == 0) return what + ": no buffer is registered under that id here";
  if (bytes == 0) return what + ": empty put";
  if (dst_offset > b.bytes || bytes > b.bytes - dst_offset) {
    return what + ": beyond the buffer's " + std::to_string(b.bytes) + " bytes";
  }
  if (signal != kNoSignal && signal >= config_.num_signals) {
    return what + ": signal " + std::to_string(signal) + " out of range (" +
           std::to_string(config_.num_signals) + " signals)";
  }
  return {};
}

std::string TransportBase::check_incoming_signal(uint32_t src, uint32_t signal) const {
  if (!is_peer(static_cast<int>(src))) {
    return "signal from rank " + std::to_string(src) + ": not a peer of this transport";
  }
  if (signal >= config_.num_signals) {
    return "signal from rank " + std::to_string(src) + ": signal " + std::to_string(signal) +
           " out of range (" + std::to_string(config_.num_signals) + " signals)";
  }
  return {};
}

void TransportBase::fail(const Error& error) {
  {
    std::lock_guard<std::mutex> lock(error_mutex_);
    if (error_) return;
    error_.emplace(error);
    failed_.store(true, std::memory_order_release);
  }
  if (config_.on_error) config_.on_error(error);
}

void TransportBase::check() const {
  if (!failed()) return;
  std::lock_guard<std::mutex> lock(error_mutex_);
  throw *error_;
}

}  // namespace mk::transport::detail
