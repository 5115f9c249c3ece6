// The MKERNEL_* environment overrides: one table, one set of readers (runtime/overrides.h).
#include "runtime/overrides.h"

#include <cstdlib>
#include <optional>

#include "mkernel/device_comm.h"
#include "mkernel/error.h"
#include "runtime/text_util.h"

namespace mk::detail {
namespace {

// The value of `name`, or nothing when unset or empty.
std::optional<std::string> lookup(const EnvLookup& env, const char* name) {
  const char* v = env(name);
  if (v == nullptr || *v == '\0') return std::nullopt;
  return std::string(v);
}

[[noreturn]] void malformed(const char* name, const std::string& value,
                            const std::string& accepts) {
  throw Error(ErrorCode::kInvalidArgument,
              std::string(name) + "='" + value + "' is not valid; expected " + accepts);
}

}  // namespace

EnvLookup process_environment() {
  return [](const char* name) -> const char* { return std::getenv(name); };
}

long long env_int(const EnvLookup& env, const char* name, long long min, long long max,
                  long long fallback) {
  const std::optional<std::string> v = lookup(env, name);
  if (!v) return fallback;
  long long value = 0;
  if (!parse_int(v->c_str(), min, max, &value)) {
    malformed(name, *v, "an integer in [" + std::to_string(min) + ", " + std::to_string(max) + "]");
  }
  return value;
}

double env_seconds(const EnvLookup& env, const char* name, double fallback, bool positive) {
  const std::optional<std::string> v = lookup(env, name);
  if (!v) return fallback;
  double value = 0;
  if (!parse_seconds(v->c_str(), &value) || (positive && value <= 0)) {
    malformed(name, *v,
              positive ? "a positive number of seconds" : "a non-negative number of seconds");
  }
  return value;
}

bool env_flag(const EnvLookup& env, const char* name, bool fallback) {
  const std::optional<std::string> v = lookup(env, name);
  if (!v) return fallback;
  if (*v != "0" && *v != "1") malformed(name, *v, "0 or 1");
  return *v == "1";
}

std::string env_choice(const EnvLookup& env, const char* name,
                       const std::vector<std::string>& choices, const std::string& fallback) {
  const std::optional<std::string> v = lookup(env, name);
  if (!v) return fallback;
  std::string accepts;
  for (const std::string& c : choices) {
    if (*v == c) return c;
    accepts += (accepts.empty() ? "" : ", ") + c;
  }
  malformed(name, *v, "one of " + accepts);
}

std::string env_string(const EnvLookup& env, const char* name, const std::string& fallback) {
  return lookup(env, name).value_or(fallback);
}

const std::vector<OverrideInfo>& override_table() {
  static const std::vector<OverrideInfo> table = {
      {"MKERNEL_TIMEOUT_S", "seconds >= 0 (0: none)",
       "limit of every wait on a peer, in kernels and in the communicator's host-side "
       "collective steps (default 60)"},
      {"MKERNEL_BOOTSTRAP_TIMEOUT_S", "seconds > 0",
       "limit of one exchange of the in-process and mkrun bootstraps (default 300)"},
      {"MKERNEL_GPUS_PER_NODE", "integer >= 0 (0: by host)",
       "split the ranks into virtual nodes of this many ranks"},
      {"MKERNEL_PRINT_CONFIG", "0 or 1", "print the configuration each launch picks (rank 0)"},
      {"MKERNEL_TRACE", "0 or 1",
       "record the fused kernels' timelines (bench/trace_fused, bench/bench_moe_ranks --trace)"},
      {"MKERNEL_GEMM_BLOCK_N", "64, 128, 192 or 256",
       "GEMM tile width, where the call's config leaves it to the library"},
      {"MKERNEL_COMM_CTAS", "integer >= 1", "ag_gemm: CTAs whose spare warps push the shard"},
      {"MKERNEL_PIECE_ROWS", "integer >= 1", "ag_gemm: rows per signalled piece of a shard"},
      {"MKERNEL_BF16_PARTIALS", "0 or 1",
       "gemm_rs / gemm_ar: partial sums travel as bf16 (1) or fp32 (0), whatever the config says"},
      {"MKERNEL_COLL_CHANNELS", "1 to 160", "collectives: CTAs per rank"},
      {"MKERNEL_INTER_NODE_CHANNELS", "1 to 64", "proxy rings of the path between nodes (4)"},
      {"MKERNEL_INTER_NODE_STAGING", "host or device",
       "where bytes crossing the network wait (socket: host, RDMA: device)"},
      {"MKERNEL_TRANSPORT", "socket, cx7 or efa",
       "the transport between nodes (the build's default)"},
      {"MKERNEL_SOCKET_IFNAME", "an interface name", "the socket transport's interface"},
      {"MKERNEL_IB_HCA", "an RDMA device name", "the NIC of the RDMA transports (nearest the GPU)"},
      {"MKERNEL_IB_GID_INDEX", "0 to 255", "the GID index of the RDMA transports (0)"},
  };
  return table;
}

const std::vector<RemovedOverride>& removed_overrides() {
  static const std::vector<RemovedOverride> table = {
      {"MKERNEL_TMA_SENDS", "set FusedGemmConfig::tma_sends (Python: tma_sends=False)"},
      {"MKERNEL_COLL_RS_BULK", "set CollectiveConfig::bulk"},
      {"MKERNEL_OUTBOX", "the outbox is used wherever the plan fits one; there is no switch"},
      {"MKERNEL_INTERLEAVE",
       "the reducing kernels interleave wherever the plan allows; there is no switch"},
      {"MKERNEL_TMA_PARTIALS",
       "the stage ring carries partials wherever the plan allows; there "
       "is no switch"},
      {"MKERNEL_TMA_STAGING",
       "outbox slices are staged by TMA wherever the plan allows; there "
       "is no switch"},
      {"MKERNEL_GEMM_SCHEDULE",
       "the ping-pong schedule was retired (slower on every measured "
       "shape; docs/PERFORMANCE.md)"},
      {"MKERNEL_PARTIALS_FIRST",
       "the partials-first path was retired (measured no better; "
       "docs/PERFORMANCE.md)"},
  };
  return table;
}

Overrides parse_overrides(const EnvLookup& env) {
  for (const RemovedOverride& r : removed_overrides()) {
    if (const std::optional<std::string> v = lookup(env, r.name)) {
      throw Error(
          ErrorCode::kInvalidArgument,
          std::string(r.name) + "='" + *v + "': this variable is no longer read; " + r.instead);
    }
  }
  Overrides o;
  o.timeout_s = env_seconds(env, "MKERNEL_TIMEOUT_S", -1);
  o.gpus_per_node = static_cast<int>(env_int(env, "MKERNEL_GPUS_PER_NODE", 0, 1 << 20, -1));
  o.print_config = env_flag(env, "MKERNEL_PRINT_CONFIG", false);
  o.trace = env_flag(env, "MKERNEL_TRACE", false);
  o.block_n = std::stoi(env_choice(env, "MKERNEL_GEMM_BLOCK_N", {"64", "128", "192", "256"}, "0"));
  o.comm_ctas = static_cast<int>(env_int(env, "MKERNEL_COMM_CTAS", 1, kMaxChannels, 0));
  o.piece_rows = static_cast<int>(env_int(env, "MKERNEL_PIECE_ROWS", 1, int64_t{1} << 30, 0));
  const std::string bf16 = env_choice(env, "MKERNEL_BF16_PARTIALS", {"0", "1"}, "");
  o.bf16_partials = bf16.empty() ? -1 : bf16 == "1";
  o.channels = static_cast<int>(env_int(env, "MKERNEL_COLL_CHANNELS", 1, kMaxChannels, 0));
  o.inter_node_channels = static_cast<int>(env_int(env, "MKERNEL_INTER_NODE_CHANNELS", 1, 64, 0));
  o.inter_node_staging = env_choice(env, "MKERNEL_INTER_NODE_STAGING", {"host", "device"}, "");
  o.transport = env_choice(env, "MKERNEL_TRANSPORT", {"socket", "cx7", "efa"}, "");
  o.socket_ifname = env_string(env, "MKERNEL_SOCKET_IFNAME", "");
  o.ib_hca = env_string(env, "MKERNEL_IB_HCA", "");
  o.ib_gid_index = static_cast<int>(env_int(env, "MKERNEL_IB_GID_INDEX", 0, 255, -1));
  return o;
}

const Overrides& process_overrides() {
  static const Overrides parsed = parse_overrides();  // (a throw leaves it for the next call)
  return parsed;
}

}  // namespace mk::detail
