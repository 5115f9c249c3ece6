// mk::Error and the names of its codes.
#include <gtest/gtest.h>

#include <set>
#include <string>

#include "mkernel/error.h"

namespace mk {
namespace {

TEST(Error, EveryCodeHasItsOwnName) {
  const ErrorCode codes[] = {ErrorCode::kInvalidArgument,
                             ErrorCode::kNotInitialized,
                             ErrorCode::kOutOfMemory,
                             ErrorCode::kUnsupported,
                             ErrorCode::kTimeout,
                             ErrorCode::kBootstrap,
                             ErrorCode::kCuda,
                             ErrorCode::kSystem,
                             ErrorCode::kInternal};
  std::set<std::string> names;
  for (ErrorCode code : codes) {
    const std::string name = to_string(code);
    EXPECT_FALSE(name.empty());
    EXPECT_TRUE(names.insert(name).second) << "duplicate name '" << name << "'";
  }
  EXPECT_STREQ(to_string(ErrorCode::kInvalidArgument), "invalid argument");
  EXPECT_STREQ(to_string(ErrorCode::kTimeout), "timeout");
}

TEST(Error, MessageStartsWithTheCodeName) {
  const Error e(ErrorCode::kTimeout, "rank 3 waited for rank 1");
  EXPECT_EQ(e.code(), ErrorCode::kTimeout);
  EXPECT_STREQ(e.what(), "timeout: rank 3 waited for rank 1");
}

}  // namespace
}  // namespace mk
