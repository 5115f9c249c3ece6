#include "mkernel/communicator.h"

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <sstream>
#include <string>

#include "mkernel/error.h"
#include "runtime/comm_state.h"
#include "runtime/cuda_check.h"
#include "runtime/device_guard.h"
#include "runtime/inter_node_rings.h"
#include "runtime/kernel_preload.h"
#include "runtime/socket_util.h"

namespace mk {
namespace {

// The kernels' limit (DeviceComm::timeout_ns, 0: none).
uint64_t timeout_ns(double seconds) {
  return seconds > 0 && seconds < detail::kForeverSeconds ? static_cast<uint64_t>(seconds * 1e9)
                                                          : 0;
}

std::string describe_value(uint64_t v) {
  return "launch " + std::to_string(v >> 32) + " step " + std::to_string(v & 0xffffffffu);
}

// The current value of this rank's signal word (signal, src), read from the host for diagnostics
// (a host-pad signal from the inter-node path's pad).
uint64_t read_signal(const detail::CommState& s, uint32_t signal, int src) {
  if (signal & kLocalCounterBit) return 0;  // the op's own memory: not read here
  if (signal & kHostPadSignalBit) {
    return s.inter_node ? s.inter_node->signals().load(src, signal & ~kHostPadSignalBit) : 0;
  }
  uint64_t value = 0;
  const auto* word = reinterpret_cast<const uint64_t*>(s.signal_pad->bases[s.topo.local_rank]) +
                     static_cast<uint64_t>(signal) * s.topo.world_size + src;
  detail::DeviceGuard guard(s.device);
  if (cudaMemcpy(&value, word, sizeof(value), cudaMemcpyDeviceToHost) != cudaSuccess) {
    cudaGetLastError();
  }
  return value;
}

}  // namespace

std::string describe_signal(uint32_t signal) {
  if (signal & kHostPadSignalBit) {
    return "inter-node signal " + std::to_string(signal & ~kHostPadSignalBit) + " (host pad)";
  }
  if (signal & kLocalCounterBit) {
    return "arrival counter " + std::to_string(signal & ~kLocalCounterBit) +
           " (a count in the op's workspace on that rank)";
  }
  if (signal >= static_cast<uint32_t>(SignalId::kVerdict)) {
    return "entry signatures' verdict, channel " +
           std::to_string(signal - static_cast<uint32_t>(SignalId::kVerdict));
  }
  if (signal >= static_cast<uint32_t>(SignalId::kOp)) {
    return "op signal " + std::to_string(signal - static_cast<uint32_t>(SignalId::kOp));
  }
  const uint32_t range = signal / kMaxChannels;
  const uint32_t channel = signal % kMaxChannels;
  return std::string(range == 0 ? "entry barrier" : "exit barrier") + ", channel " +
         std::to_string(channel);
}

// ---- SymmetricBuffer ---------------------------------------------------------------------------

void* SymmetricBuffer::data() const {
  if (!impl_) return nullptr;
  return reinterpret_cast<void*>(impl_->bases.at(impl_->local_rank));
}
std::size_t SymmetricBuffer::size() const { return impl_ ? impl_->size : 0; }
void* SymmetricBuffer::peer(int local_rank) const {
  if (!impl_ || local_rank < 0 || local_rank >= static_cast<int>(impl_->bases.size())) {
    throw Error(ErrorCode::kInvalidArgument, "SymmetricBuffer::peer: local rank " +
                                                 std::to_string(local_rank) + " out of range");
  }
  return reinterpret_cast<void*>(impl_->bases[local_rank]);
}
void* const* SymmetricBuffer::device_peers() const { return impl_ ? impl_->d_peers : nullptr; }

// ---- Communicator ------------------------------------------------------------------------------

Communicator::Communicator() : state_(std::make_unique<detail::CommState>()) {}

Communicator::~Communicator() {
  // (No device yet: create failed before it chose one, and nothing was allocated. Setting device
  // -1 would leave an error behind for the caller's next cudaGetLastError.)
  if (!state_ || state_->device < 0) return;
  int previous = 0;
  cudaGetDevice(&previous);
  cudaSetDevice(state_->device);
  cudaDeviceSynchronize();     // kernels may still use the pad; they end within the time limit
  state_->inter_node.reset();  // drains what kernels pushed, says goodbye to the rail peers
  for (cudaStream_t& stream : state_->copy_streams) {
    if (stream) cudaStreamDestroy(stream);
  }
  if (state_->host_abort) cudaFreeHost(state_->host_abort);
  state_->signal_pad.reset();
  cudaFree(state_->launch_state);
  cudaFree(state_->d_node_ranks);
  cudaFreeHost(state_->error_host);
  state_->fd_exchange.reset();
  cudaSetDevice(previous);
}

std::shared_ptr<Communicator> Communicator::create(std::unique_ptr<Bootstrap> bootstrap,
                                                   const CommOptions& options) {
  if (!bootstrap) {
    throw Error(ErrorCode::kInvalidArgument, "Communicator::create: bootstrap is null");
  }
  if (!std::isfinite(options.timeout_seconds)) {
    throw Error(ErrorCode::kInvalidArgument,
                "Communicator::create: CommOptions::timeout_seconds = " +
                    std::to_string(options.timeout_seconds) +
                    "; expected seconds >= 0 (0: none) or -1 (MKERNEL_TIMEOUT_S or 60)");
  }
  std::shared_ptr<Communicator> comm(new Communicator());
  detail::CommState& s = *comm->state_;

  int device = options.device;
  if (device < 0) MK_CUDA_CHECK(cudaGetDevice(&device));
  int device_count = 0;
  MK_CUDA_CHECK(cudaGetDeviceCount(&device_count));
  if (device >= device_count) {
    throw Error(ErrorCode::kInvalidArgument, "Communicator::create: device " +
                                                 std::to_string(device) + " does not exist (" +
                                                 std::to_string(device_count) + " visible)");
  }
  s.device = device;
  detail::DeviceGuard guard(device);

  s.overrides = detail::parse_overrides();
  s.timeout_seconds = options.timeout_seconds >= 0 ? options.timeout_seconds
                      : s.overrides.timeout_s >= 0 ? s.overrides.timeout_s
                                                   : 60.0;
  // From here on every exchange is bounded by the time limit and names its step.
  s.bootstrap = std::make_unique<detail::StepBootstrap>(std::move(bootstrap), s.timeout_seconds);
  using Step = detail::StepBootstrap::Step;
  int ranks_per_node = options.ranks_per_node;
  if (ranks_per_node < 0) ranks_per_node = std::max(s.overrides.gpus_per_node, 0);

  // Who is where.
  cudaDeviceProp prop{};
  MK_CUDA_CHECK(cudaGetDeviceProperties(&prop, device));
  RankInfo mine{};
  mine.host_id = this_host_id();
  mine.pid = static_cast<int32_t>(getpid());
  mine.device = device;
  std::memcpy(mine.device_uuid, prop.uuid.bytes, sizeof(mine.device_uuid));
  mine.sm_count = prop.multiProcessorCount;
  mine.ranks_per_node = ranks_per_node;
  std::vector<RankInfo> infos(s.bootstrap->size());
  {
    const Step step(*s.bootstrap, "Communicator::create (exchanging the ranks' GPUs and hosts)");
    s.bootstrap->allgather(&mine, infos.data(), sizeof(RankInfo));
  }
  s.topo = compute_topology(s.bootstrap->rank(), infos);
  if (prop.major < 9) {
    throw Error(ErrorCode::kUnsupported,
                "Communicator::create: GPU " + std::to_string(device) + " (" + prop.name +
                    ") has compute capability " + std::to_string(prop.major) + "." +
                    std::to_string(prop.minor) + "; mkernel needs Hopper (9.0)");
  }

  {
    const Step step(*s.bootstrap, "Communicator::create (setting up the fd exchange)");
    s.fd_exchange = std::make_unique<detail::FdExchange>(
        *s.bootstrap, s.timeout_seconds > 0 ? s.timeout_seconds : 300.0);
  }

  // Signal pad, launch state, error record.
  {
    const Step step(*s.bootstrap, "Communicator::create (allocating the signal pad)");
    s.signal_pad = detail::create_symmetric(s, sizeof(uint64_t) * kNumSignals * s.topo.world_size);
  }
  MK_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&s.launch_state), sizeof(DeviceLaunchState)));
  MK_CUDA_CHECK(cudaMemset(s.launch_state, 0, sizeof(DeviceLaunchState)));
  MK_CUDA_CHECK(
      cudaMalloc(reinterpret_cast<void**>(&s.d_node_ranks), sizeof(int32_t) * s.topo.local_size));
  std::vector<int32_t> node_ranks(s.topo.node_ranks.begin(), s.topo.node_ranks.end());
  MK_CUDA_CHECK(cudaMemcpy(s.d_node_ranks, node_ranks.data(), sizeof(int32_t) * node_ranks.size(),
                           cudaMemcpyHostToDevice));
  // Two records: [0] time-outs (DeviceComm::error), [1] data errors (DeviceComm::data_error).
  MK_CUDA_CHECK(cudaHostAlloc(reinterpret_cast<void**>(&s.error_host),
                              2 * sizeof(DeviceErrorRecord), cudaHostAllocMapped));
  std::memset(s.error_host, 0, 2 * sizeof(DeviceErrorRecord));
  MK_CUDA_CHECK(
      cudaHostGetDevicePointer(reinterpret_cast<void**>(&s.error_device), s.error_host, 0));
  detail::preload_kernels(s.topo.num_nodes > 1);  // no lazy loading behind a peer's kernel
  MK_CUDA_CHECK(cudaDeviceSynchronize());
  const Step step(*s.bootstrap, "Communicator::create (the last meeting)");
  s.bootstrap->barrier();  // nobody signals into a pad before its owner has zeroed it
  return comm;
}

const Topology& Communicator::topology() const { return state_->topo; }
const detail::Overrides& Communicator::overrides() const { return state_->overrides; }
int Communicator::device() const { return state_->device; }
double Communicator::timeout_seconds() const { return state_->timeout_seconds; }
Bootstrap& Communicator::bootstrap() { return *state_->bootstrap; }

SymmetricBuffer Communicator::alloc(std::size_t bytes) {
  ensure_usable("alloc");
  detail::DeviceGuard guard(state_->device);
  const detail::StepBootstrap::Step step(
      *state_->bootstrap,
      "Communicator::alloc (symmetric allocation of " + std::to_string(bytes) + " bytes)");
  return SymmetricBuffer(detail::create_symmetric(*state_, bytes));
}

SymmetricRange Communicator::find_symmetric(const void* ptr, std::size_t bytes) const {
  const auto p = reinterpret_cast<uintptr_t>(ptr);
  std::lock_guard<std::mutex> lock(state_->registry_mutex);
  auto& reg = state_->registry;
  for (auto it = reg.begin(); it != reg.end();) {
    auto alloc = it->lock();
    if (!alloc) {
      it = reg.erase(it);
      continue;
    }
    const uintptr_t base = alloc->bases[state_->topo.local_rank];
    if (p >= base && p + bytes <= base + alloc->size && p + bytes >= p) {
      return SymmetricRange{alloc->d_peers, static_cast<std::size_t>(p - base), alloc->size,
                            reinterpret_cast<const uintptr_t*>(alloc->bases.data())};
    }
    ++it;
  }
  return {};
}

std::weak_ptr<const void> Communicator::symmetric_owner(const void* ptr) const {
  const auto p = reinterpret_cast<uintptr_t>(ptr);
  std::lock_guard<std::mutex> lock(state_->registry_mutex);
  for (const auto& weak : state_->registry) {
    auto alloc = weak.lock();
    if (!alloc) continue;
    const uintptr_t base = alloc->bases[state_->topo.local_rank];
    if (p >= base && p < base + alloc->size) return std::shared_ptr<const void>(alloc);
  }
  return {};
}

DeviceComm Communicator::device_comm() const {
  const detail::CommState& s = *state_;
  DeviceComm d{};
  d.rank = s.topo.rank;
  d.world_size = s.topo.world_size;
  d.node = s.topo.node;
  d.local_rank = s.topo.local_rank;
  d.local_size = s.topo.local_size;
  d.node_ranks = s.d_node_ranks;
  d.signals = reinterpret_cast<uint64_t*>(s.signal_pad->bases[s.topo.local_rank]);
  d.peer_signals = reinterpret_cast<uint64_t* const*>(s.signal_pad->d_peers);
  d.state = s.launch_state;
  d.error = s.error_device;
  d.data_error = s.error_device + 1;
  d.timeout_ns = timeout_ns(s.timeout_seconds);
  if (s.inter_node) {
    d.host_signals = s.inter_node->signals().words();  // mapped pinned: the same address on the GPU
    d.host_abort = s.host_abort;
  }
  return d;
}

detail::InterNode& Communicator::inter_node() {
  detail::CommState& s = *state_;
  std::lock_guard<std::mutex> lock(s.inter_node_mutex);
  if (s.inter_node) return *s.inter_node;
  ensure_usable("inter_node");
  detail::DeviceGuard guard(s.device);
  detail::RelaxedCapture relaxed;  // first use may come inside the caller's graph capture
  if (s.host_abort == nullptr) {
    MK_CUDA_CHECK(cudaHostAlloc(reinterpret_cast<void**>(&s.host_abort), sizeof(int32_t),
                                cudaHostAllocMapped | cudaHostAllocPortable));
    *s.host_abort = 0;
  }
  for (cudaStream_t& stream : s.copy_streams) {
    if (!stream) MK_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  }
  detail::InterNodeConfig c;
  c.channels = s.overrides.inter_node_channels > 0 ? s.overrides.inter_node_channels : 4;
  c.staging = s.overrides.inter_node_staging;
  c.backend = s.overrides.transport;
  c.socket_ifname = s.overrides.socket_ifname;
  c.ring_capacity = 4096;
  c.num_signals = kInterNodeSignals;
  c.timeout_seconds =
      s.timeout_seconds > 0 ? std::min(s.timeout_seconds, detail::kForeverSeconds) : 300.0;
  c.host_memory.alloc = [](std::size_t bytes) -> void* {
    void* p = nullptr;
    if (cudaHostAlloc(&p, bytes, cudaHostAllocMapped | cudaHostAllocPortable) != cudaSuccess) {
      cudaGetLastError();
      return nullptr;
    }
    return p;
  };
  c.host_memory.free = [](void* p) { cudaFreeHost(p); };
  // The socket backend stages device buffers through host memory from its own threads: copies on
  // non-blocking streams of the communicator, never the legacy default stream, which would wait
  // for the very kernel that waits for the data.
  const int device = s.device;
  auto copier = [device](cudaStream_t stream) {
    return [device, stream](void* dst, const void* src, std::size_t bytes) {
      cudaSetDevice(device);
      // A transport thread's copies are never part of a capture: its mode relaxed once, so that
      // another thread's global-mode capture does not count them as unsafe calls.
      thread_local const bool relaxed = [] {
        cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
        return cudaThreadExchangeStreamCaptureMode(&mode) == cudaSuccess;
      }();
      (void)relaxed;
      cudaError_t err = cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, stream);
      if (err == cudaSuccess) err = cudaStreamSynchronize(stream);
      if (err != cudaSuccess) {
        throw Error(ErrorCode::kCuda, std::string("inter-node staging copy of ") +
                                          std::to_string(bytes) +
                                          " bytes failed: " + cudaGetErrorString(err));
      }
    };
  };
  c.copy_to_device = copier(s.copy_streams[0]);
  c.copy_from_device = copier(s.copy_streams[1]);
  char bus_id[32] = {};
  if (cudaDeviceGetPCIBusId(bus_id, sizeof(bus_id), device) == cudaSuccess) {
    c.gpu_pci_bus_id = bus_id;
  }
  // A failed path (lost peer, malformed command) stops the kernels waiting for arrivals.
  c.on_error = [abort = s.host_abort](const Error&) {
    __atomic_store_n(abort, 1, __ATOMIC_RELEASE);
  };
  const detail::StepBootstrap::Step step(*s.bootstrap, "setting up the inter-node path");
  s.inter_node = std::make_unique<detail::InterNode>(*s.bootstrap, s.topo, std::move(c));
  return *s.inter_node;
}

namespace {

// The op an entry signature names (dev::entry_signature), for an error.
std::string entry_op_name(uint64_t signature) {
  switch (static_cast<EntryOp>(entry_op_of(signature))) {
    case EntryOp::kMoeDispatch:
      return "moe_dispatch";
    case EntryOp::kMoeCombine:
      return "moe_combine";
    case EntryOp::kMoeDispatchGemm:
      return "moe_dispatch_gemm";
    case EntryOp::kMoeLayer:
      return "moe_layer";
    case EntryOp::kRingAttention:
      return "ring_attention";
  }
  return "";
}

// A kMismatch record: which ops the two ranks were in, and what they must share.
std::string mismatch_message(const volatile DeviceErrorRecord& rec, const std::string& where) {
  const std::string here = entry_op_name(rec.expected);
  const std::string there = rec.observed != 0 ? entry_op_name(rec.observed) : "";
  std::ostringstream msg;
  msg << "rank " << rec.rank << " and rank " << rec.peer
      << " entered the same launch with different operations or sizes: ";
  if (rec.observed == 0) {
    msg << "rank " << rec.rank << " in " << here << ", rank " << rec.peer
        << " saw the difference first";
  } else if (there.empty()) {
    msg << "rank " << rec.rank << " in " << here << ", rank " << rec.peer
        << " in another operation (one without sizes to compare: a GEMM with a collective, a "
           "collective)";
  } else if (there != here) {
    msg << "rank " << rec.rank << " in " << here << ", rank " << rec.peer << " in " << there;
  } else {
    msg << "both in " << here << ", with different sizes";
  }
  msg << " (at the " << where << ": signature " << std::hex << rec.expected << " here";
  if (rec.observed != 0) msg << ", " << rec.observed << " there";
  msg << std::dec
      << "). Every rank must issue the same operations in the same order, with the "
         "sizes they share equal - ";
  if (entry_op_of(rec.expected) == static_cast<uint32_t>(EntryOp::kRingAttention)) {
    msg << "for ring_attention B, S_local, H, H_kv, D and causal";
  } else {
    msg << "for the MoE ops max_tokens, hidden, top_k, num_experts, the layout, the capacity, "
           "the SMs and moe_layer's block_n (the token counts may differ; pass max_tokens, the "
           "largest, on every rank)";
  }
  msg << ". The communicator is broken: create a new one";
  return msg.str();
}

// The fatal error a kernel recorded: a time-out (who waited how long for whom on what), or a
// mismatch (a peer entered the same launch with another op signature).
std::string recorded_error(const detail::CommState& s) {
  const volatile DeviceErrorRecord* rec = s.error_host;
  std::ostringstream msg;
  if (rec->code == static_cast<int32_t>(DeviceErrorCode::kMismatch)) {
    msg << mismatch_message(*rec, describe_signal(rec->signal));
    return msg.str();
  }
  msg << "rank " << rec->rank << " waited " << static_cast<double>(rec->waited_ns) * 1e-9
      << " s for rank " << rec->peer << " on the " << describe_signal(rec->signal);
  if (rec->signal & kLocalCounterBit) {  // a count, not a (launch, step) value
    msg << " (expected " << rec->expected << ", last saw " << rec->observed << ")";
  } else {
    msg << " (expected " << describe_value(rec->expected) << ", last saw "
        << describe_value(rec->observed) << ", now "
        << describe_value(read_signal(s, rec->signal, rec->peer)) << ")";
  }
  msg << "; time limit " << s.timeout_seconds << " s (MKERNEL_TIMEOUT_S). Is rank " << rec->peer
      << " alive and issuing the same operations in the same order?";
  const int peer = rec->peer;
  if (s.topo.ranks_on_my_device > 1 && peer >= 0 && peer < s.topo.world_size &&
      s.topo.same_process[peer]) {
    const char* queues = std::getenv("CUDA_DEVICE_MAX_CONNECTIONS");
    msg << " (Ranks sharing a GPU in one process: their streams share CUDA_DEVICE_MAX_CONNECTIONS"
        << " hardware queues, " << (queues != nullptr ? queues : "8 - unset")
        << " here, and work queued behind a peer's waiting kernel - a launch, a copy, a graph's"
        << " first upload - waits for it to end: see mkernel/communicator.h.)";
  }
  return msg.str();
}

}  // namespace

void Communicator::check() {
  detail::CommState& s = *state_;
  const volatile DeviceErrorRecord* rec = s.error_host;
  if (s.broken.empty()) {
    // The inter-node path's first error (a lost peer stops the waits at once), if any.
    std::string path_error;
    ErrorCode path_code = ErrorCode::kInternal;
    if (s.inter_node && s.inter_node->failed()) {
      try {
        s.inter_node->check();
      } catch (const Error& e) {
        path_error = std::string("the inter-node path failed: ") + e.what();
        path_code = e.code();
      }
    }
    if (rec->code != static_cast<int32_t>(DeviceErrorCode::kNone)) {
      if (rec->code == static_cast<int32_t>(DeviceErrorCode::kMismatch)) {
        s.broken_code = ErrorCode::kInvalidArgument;
      }
      s.broken = recorded_error(s) + (path_error.empty() ? "" : "; " + path_error);
    } else if (!path_error.empty()) {
      s.broken = path_error;
      s.broken_code = path_code;
      throw Error(path_code, s.broken);
    }
  }
  if (!s.broken.empty()) throw Error(s.broken_code, s.broken);
  // A data error (an op's input or its room): raised once, the communicator stays usable - every
  // launch completed and the ranks are in step.
  volatile DeviceErrorRecord* data = s.error_host + 1;
  const int32_t code = data->code;
  if (code == static_cast<int32_t>(DeviceErrorCode::kNone)) return;
  std::ostringstream msg;
  ErrorCode error = ErrorCode::kInvalidArgument;
  if (code == static_cast<int32_t>(DeviceErrorCode::kCapacity)) {
    error = ErrorCode::kOutOfMemory;
    // (The routing contract of moe_dispatch, moe_dispatch_gemm and moe_layer alike.)
    msg << "MoE routing: rank " << data->rank << ": local expert " << data->peer << " received "
        << data->observed << " rows but its layout holds " << data->expected
        << "; the rows that did not fit were not placed (nor combined): raise the capacity";
  } else if (code == static_cast<int32_t>(DeviceErrorCode::kBadIndex)) {
    msg << "MoE routing: rank " << data->rank << ": topk_idx[" << data->peer << "][" << data->signal
        << "] = " << static_cast<int64_t>(data->observed) << " is not an expert id in [0, "
        << data->expected << ") nor -1; that slot was treated as -1";
  } else if (code == static_cast<int32_t>(DeviceErrorCode::kBadHandle)) {
    static const char* const kFields[] = {"source rank", "token", "top-k slot"};
    const uint32_t field = data->signal < 3 ? data->signal : 0;
    msg << "MoE combine: rank " << data->rank << ": the handle's row " << data->peer << " has "
        << kFields[field] << " " << static_cast<int64_t>(data->observed) << ", outside [0, "
        << data->expected << ") of this call's problem - a handle of a dispatch with other sizes? "
        << "That row was not combined";
  } else {
    msg << "a kernel recorded data error code " << code;
    error = ErrorCode::kInternal;
  }
  data->code = static_cast<int32_t>(DeviceErrorCode::kNone);  // raised once
  throw Error(error, msg.str());
}

void Communicator::synchronize(cudaStream_t stream) {
  detail::DeviceGuard guard(state_->device);
  cudaError_t err = cudaStreamSynchronize(stream);
  check();  // a recorded time-out explains a failed stream better than the CUDA error does
  if (err != cudaSuccess) {
    state_->broken = std::string("stream failed: ") + cudaGetErrorString(err);
    state_->broken_code = ErrorCode::kCuda;
    throw Error(ErrorCode::kCuda, state_->broken);
  }
}

void Communicator::ensure_usable(const char* op) const {
  // A failed exchange - a step's or the caller's own - leaves the ranks out of step.
  if (state_->broken.empty() && state_->bootstrap) state_->broken = state_->bootstrap->broken();
  if (!state_->broken.empty()) {
    throw Error(ErrorCode::kNotInitialized,
                std::string(op) + ": the communicator is broken by an earlier error (" +
                    state_->broken + "); create a new one");
  }
  const volatile DeviceErrorRecord* rec = state_->error_host;
  if (rec->code != 0) {  // an earlier launch's failure, not yet seen by check()
    throw Error(ErrorCode::kNotInitialized,
                std::string(op) + ": an earlier kernel of this communicator failed: " +
                    recorded_error(*state_) + "; create a new communicator");
  }
}

namespace detail {

InterNodeRings inter_node_rings(Communicator& comm, void* base, uint64_t bytes) {
  RelaxedCapture relaxed;  // registering (and releasing expired) buffers, possibly under capture
  InterNode& path = comm.inter_node();
  InterNodeRings r;
  r.count = std::min(path.proxy().num_rings(), kMaxKernelRings);
  for (int i = 0; i < r.count; ++i) r.ring[i] = path.proxy().ring(i);
  if (base != nullptr) {
    const StepBootstrap::Step step(
        static_cast<StepBootstrap&>(comm.bootstrap()),
        "registering a buffer of " + std::to_string(bytes) + " bytes with the inter-node path");
    r.buffer =
        path.buffer_id(base, bytes, transport::MemoryKind::kDevice, comm.symmetric_owner(base));
  }
  return r;
}

InterNodeStaging inter_node_staging(Communicator& comm, uint64_t bytes) {
  RelaxedCapture relaxed;  // allocating and registering a larger staging, possibly under capture
  InterNode& path = comm.inter_node();
  if (!path.host_staging()) return {};
  const StepBootstrap::Step step(
      static_cast<StepBootstrap&>(comm.bootstrap()),
      "growing the inter-node staging to " + std::to_string(bytes) + " bytes");
  const InterNode::Staging s = path.staging(bytes);
  return {s.base, s.buffer};
}

}  // namespace detail

}  // namespace mk
