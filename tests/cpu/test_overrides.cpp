// The MKERNEL_* overrides (runtime/overrides.h): one parser that validates every value, a table
// that README lists, and the readers the layers below the communicator use.
#include <gtest/gtest.h>

#include <fstream>
#include <map>
#include <set>
#include <sstream>
#include <string>

#include "mkernel/error.h"
#include "runtime/overrides.h"

namespace {

using mk::Error;
using mk::ErrorCode;
using mk::detail::EnvLookup;
using mk::detail::Overrides;
using mk::detail::parse_overrides;

// An environment of its own: nothing of the process's leaks in.
EnvLookup env_of(const std::map<std::string, std::string>& vars) {
  return [vars](const char* name) -> const char* {
    const auto it = vars.find(name);
    return it == vars.end() ? nullptr : it->second.c_str();
  };
}

bool contains(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}

TEST(Overrides, NothingSetMeansNothingOverridden) {
  const Overrides o = parse_overrides(env_of({}));
  EXPECT_LT(o.timeout_s, 0);
  EXPECT_EQ(o.gpus_per_node, -1);
  EXPECT_FALSE(o.print_config);
  EXPECT_FALSE(o.trace);
  EXPECT_EQ(o.block_n, 0);
  EXPECT_EQ(o.comm_ctas, 0);
  EXPECT_EQ(o.piece_rows, 0);
  EXPECT_EQ(o.bf16_partials, -1);
  EXPECT_EQ(o.channels, 0);
  EXPECT_EQ(o.inter_node_channels, 0);
  EXPECT_EQ(o.inter_node_staging, "");
  EXPECT_EQ(o.transport, "");
  EXPECT_EQ(o.ib_gid_index, -1);
  // An empty value counts as unset.
  EXPECT_EQ(parse_overrides(env_of({{"MKERNEL_GEMM_BLOCK_N", ""}})).block_n, 0);
}

TEST(Overrides, ValidValuesAreParsed) {
  const Overrides o = parse_overrides(env_of({
      {"MKERNEL_TIMEOUT_S", "2.5"},
      {"MKERNEL_GPUS_PER_NODE", "2"},
      {"MKERNEL_PRINT_CONFIG", "1"},
      {"MKERNEL_TRACE", "1"},
      {"MKERNEL_GEMM_BLOCK_N", "192"},
      {"MKERNEL_COMM_CTAS", "16"},
      {"MKERNEL_PIECE_ROWS", "64"},
      {"MKERNEL_BF16_PARTIALS", "0"},
      {"MKERNEL_COLL_CHANNELS", "32"},
      {"MKERNEL_INTER_NODE_CHANNELS", "2"},
      {"MKERNEL_INTER_NODE_STAGING", "device"},
      {"MKERNEL_TRANSPORT", "efa"},
      {"MKERNEL_SOCKET_IFNAME", "lo"},
      {"MKERNEL_IB_HCA", "mlx5_0"},
      {"MKERNEL_IB_GID_INDEX", "3"},
  }));
  EXPECT_DOUBLE_EQ(o.timeout_s, 2.5);
  EXPECT_EQ(o.gpus_per_node, 2);
  EXPECT_TRUE(o.print_config);
  EXPECT_TRUE(o.trace);
  EXPECT_EQ(o.block_n, 192);
  EXPECT_EQ(o.comm_ctas, 16);
  EXPECT_EQ(o.piece_rows, 64);
  EXPECT_EQ(o.bf16_partials, 0);
  EXPECT_EQ(o.channels, 32);
  EXPECT_EQ(o.inter_node_channels, 2);
  EXPECT_EQ(o.inter_node_staging, "device");
  EXPECT_EQ(o.transport, "efa");
  EXPECT_EQ(o.socket_ifname, "lo");
  EXPECT_EQ(o.ib_hca, "mlx5_0");
  EXPECT_EQ(o.ib_gid_index, 3);
  EXPECT_EQ(parse_overrides(env_of({{"MKERNEL_BF16_PARTIALS", "1"}})).bf16_partials, 1);
}

// Every malformed value is an error that names the variable, the value and what it accepts -
// never a silent 0 (atoi) or "anything but 0 means on".
TEST(Overrides, MalformedValuesAreErrorsNamingTheVariable) {
  const std::map<std::string, std::vector<std::string>> bad = {
      {"MKERNEL_TIMEOUT_S", {"-1", "soon", "1e400", "nan", " 5"}},
      {"MKERNEL_GPUS_PER_NODE", {"-2", "two", "1.5"}},
      {"MKERNEL_PRINT_CONFIG", {"yes", "2", "true"}},
      {"MKERNEL_TRACE", {"on", "00"}},
      {"MKERNEL_GEMM_BLOCK_N", {"96", "abc", "0", "512"}},
      {"MKERNEL_COMM_CTAS", {"0", "-3", "1000000"}},
      {"MKERNEL_PIECE_ROWS", {"0", "x"}},
      {"MKERNEL_BF16_PARTIALS", {"yes", "2"}},
      {"MKERNEL_COLL_CHANNELS", {"0", "161", "many"}},
      {"MKERNEL_INTER_NODE_CHANNELS", {"0", "65"}},
      {"MKERNEL_INTER_NODE_STAGING", {"nvme", "HOST"}},
      {"MKERNEL_TRANSPORT", {"ib", "tcp"}},
      {"MKERNEL_IB_GID_INDEX", {"256", "-1", "one"}},
  };
  int cases = 0;
  for (const auto& [name, values] : bad) {
    for (const std::string& value : values) {
      try {
        parse_overrides(env_of({{name, value}}));
        ADD_FAILURE() << name << "='" << value << "' accepted";
      } catch (const Error& e) {
        EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument) << e.what();
        EXPECT_TRUE(contains(e.what(), name + "='" + value + "' is not valid; expected"))
            << e.what();
      }
      ++cases;
    }
  }
  EXPECT_GT(cases, 30);
}

// The table holds every variable the parser reads (each malformed one above names a table
// entry), each once, and README's table lists every one of them.
TEST(Overrides, TableAndReadmeListEveryVariable) {
  std::set<std::string> names;
  for (const mk::detail::OverrideInfo& info : mk::detail::override_table()) {
    EXPECT_TRUE(names.insert(info.name).second) << info.name << " twice";
    EXPECT_NE(std::string(info.accepts), "") << info.name;
    EXPECT_NE(std::string(info.meaning), "") << info.name;
  }
  for (const char* parsed :
       {"MKERNEL_TIMEOUT_S", "MKERNEL_GPUS_PER_NODE", "MKERNEL_PRINT_CONFIG", "MKERNEL_TRACE",
        "MKERNEL_GEMM_BLOCK_N", "MKERNEL_COMM_CTAS", "MKERNEL_PIECE_ROWS", "MKERNEL_BF16_PARTIALS",
        "MKERNEL_COLL_CHANNELS", "MKERNEL_INTER_NODE_CHANNELS", "MKERNEL_INTER_NODE_STAGING",
        "MKERNEL_TRANSPORT", "MKERNEL_SOCKET_IFNAME", "MKERNEL_IB_HCA", "MKERNEL_IB_GID_INDEX",
        "MKERNEL_BOOTSTRAP_TIMEOUT_S"}) {
    EXPECT_EQ(names.count(parsed), 1u) << parsed << " is read but not in the table";
  }
  std::ifstream readme(std::string(MKERNEL_SOURCE_DIR) + "/README.md");
  ASSERT_TRUE(readme) << "README.md not found under " << MKERNEL_SOURCE_DIR;
  std::stringstream text;
  text << readme.rdbuf();
  for (const std::string& name : names) {
    EXPECT_TRUE(contains(text.str(), "| `" + name + "` |")) << name << " is not in README's table";
  }
}

// A variable the library no longer reads is an error naming what to do instead, not silence.
TEST(Overrides, RemovedVariablesAreRejectedNamingTheirReplacement) {
  EXPECT_GE(mk::detail::removed_overrides().size(), 8u);
  for (const mk::detail::RemovedOverride& r : mk::detail::removed_overrides()) {
    for (const mk::detail::OverrideInfo& info : mk::detail::override_table()) {
      EXPECT_NE(std::string(info.name), r.name) << r.name << " is both read and removed";
    }
    try {
      parse_overrides(env_of({{r.name, "0"}}));
      ADD_FAILURE() << r.name << " accepted";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument) << e.what();
      EXPECT_TRUE(contains(e.what(), std::string(r.name) +
                                         "='0': this variable is no longer "
                                         "read; " +
                                         r.instead))
          << e.what();
    }
  }
  try {
    parse_overrides(env_of({{"MKERNEL_TMA_SENDS", "0"}}));
  } catch (const Error& e) {
    EXPECT_TRUE(contains(e.what(), "FusedGemmConfig::tma_sends")) << e.what();
  }
  EXPECT_NO_THROW(parse_overrides(env_of({{"MKERNEL_OUTBOX", ""}})));  // empty counts as unset
}

TEST(Overrides, ReadersKeepTheirFallbackAndCheckTheirRange) {
  const EnvLookup env = env_of({{"A", "7"}, {"B", "0.25"}, {"C", "lo"}, {"E", ""}});
  EXPECT_EQ(mk::detail::env_int(env, "A", 0, 10, -1), 7);
  EXPECT_EQ(mk::detail::env_int(env, "E", 0, 10, -1), -1);
  EXPECT_EQ(mk::detail::env_int(env, "unset", 0, 10, 4), 4);
  EXPECT_THROW(mk::detail::env_int(env, "A", 0, 5, -1), Error);
  EXPECT_DOUBLE_EQ(mk::detail::env_seconds(env, "B", 1), 0.25);
  EXPECT_THROW(mk::detail::env_seconds(env_of({{"B", "0"}}), "B", 1, /*positive=*/true), Error);
  EXPECT_EQ(mk::detail::env_choice(env, "C", {"lo", "hi"}, "hi"), "lo");
  EXPECT_EQ(mk::detail::env_string(env, "C", ""), "lo");
}

}  // namespace
