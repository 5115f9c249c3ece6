// Internal: the MKERNEL_* environment overrides, read and validated in one place.
//
// Every variable the library reads is in override_table() (README's table lists the same). A
// communicator parses them once, when it is created (Communicator::overrides()); the ops fold
// them into their Config (a value the caller set in the Config wins, but for bf16 partials, where
// the variable overrides either way) and the plan sees only the Config. Ops without a communicator
// (gemm, grouped_gemm) use the environment as parsed at their first call (process_overrides()).
// The layers below the communicator (bootstrap, transport) read their few variables through the
// same readers, at the time they need them. A malformed value is an mk::Error(kInvalidArgument)
// naming the variable, its value and what it accepts. An empty value counts as unset.
#pragma once

#include <functional>
#include <string>
#include <vector>

namespace mk::detail {

// Where a parse reads variables: name -> value, or nullptr when unset (std::getenv by default).
using EnvLookup = std::function<const char*(const char*)>;
EnvLookup process_environment();

struct Overrides {
  // The communicator.
  double timeout_s = -1;   // MKERNEL_TIMEOUT_S: limit of every wait on a peer (-1: unset)
  int gpus_per_node = -1;  // MKERNEL_GPUS_PER_NODE: virtual nodes (-1: unset; 0: by host)
  // Every op.
  bool print_config = false;  // MKERNEL_PRINT_CONFIG: print each launch's choices (rank 0)
  bool trace = false;         // MKERNEL_TRACE: record the fused kernels' timelines
  // The GEMMs (0: unset).
  int block_n = 0;         // MKERNEL_GEMM_BLOCK_N: tile width
  int comm_ctas = 0;       // MKERNEL_COMM_CTAS: ag_gemm's pushing CTAs
  int piece_rows = 0;      // MKERNEL_PIECE_ROWS: ag_gemm's rows per signalled piece
  int bf16_partials = -1;  // MKERNEL_BF16_PARTIALS: 1 / 0 overrides the config (-1: unset)
  // The collectives.
  int channels = 0;  // MKERNEL_COLL_CHANNELS: CTAs per rank (0: unset)
  // The path between nodes.
  int inter_node_channels = 0;     // MKERNEL_INTER_NODE_CHANNELS (0: unset)
  std::string inter_node_staging;  // MKERNEL_INTER_NODE_STAGING: "host" or "device" ("": unset)
  std::string transport;           // MKERNEL_TRANSPORT: socket, cx7 or efa ("": the build's)
  std::string socket_ifname;       // MKERNEL_SOCKET_IFNAME ("": any)
  std::string ib_hca;              // MKERNEL_IB_HCA ("": the NIC nearest the GPU)
  int ib_gid_index = -1;           // MKERNEL_IB_GID_INDEX (-1: unset, i.e. 0)
};

// All of them from `env`; throws on the first malformed value.
Overrides parse_overrides(const EnvLookup& env = process_environment());

// The environment as parsed at the first call (thread-safe; a malformed value throws at every
// call until it is fixed): for the ops that run without a communicator.
const Overrides& process_overrides();

// One variable, for README's table and the tests: its name, what it accepts, what it does.
struct OverrideInfo {
  const char* name;
  const char* accepts;
  const char* meaning;
};
const std::vector<OverrideInfo>& override_table();

// A variable the library read once and reads no more, and what to do instead: set, the parse
// rejects it (so that a script setting it learns it does nothing).
struct RemovedOverride {
  const char* name;
  const char* instead;
};
const std::vector<RemovedOverride>& removed_overrides();

// The readers (the parse uses them; so do the bootstrap and the transports for their variables).
// Each returns `fallback` when the variable is unset or empty, and throws kInvalidArgument naming
// it otherwise unless the value is valid:
//   env_int:     a decimal integer in [min, max]
//   env_seconds: a finite number of seconds >= 0 (> 0 when `positive`)
//   env_flag:    "0" or "1"
//   env_choice:  one of `choices`
//   env_string:  anything
long long env_int(const EnvLookup& env, const char* name, long long min, long long max,
                  long long fallback);
double env_seconds(const EnvLookup& env, const char* name, double fallback, bool positive = false);
bool env_flag(const EnvLookup& env, const char* name, bool fallback);
std::string env_choice(const EnvLookup& env, const char* name,
                       const std::vector<std::string>& choices, const std::string& fallback);
std::string env_string(const EnvLookup& env, const char* name, const std::string& fallback);

}  // namespace mk::detail
