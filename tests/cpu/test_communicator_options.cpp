// Communicator::create's options, checked before the GPU is touched (so without one too).
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <string>

#include "mkernel/bootstrap.h"
#include "mkernel/communicator.h"
#include "mkernel/error.h"

namespace mk {
namespace {

// A time limit that is not a number of seconds is an error naming it - not NaN read as "unset"
// (60 s), nor infinity refused later by a part of the setup the caller never named.
TEST(CommunicatorOptions, RejectsATimeLimitThatIsNotANumberOfSeconds) {
  for (const double bad :
       {std::numeric_limits<double>::quiet_NaN(), std::numeric_limits<double>::infinity(),
        -std::numeric_limits<double>::infinity()}) {
    CommOptions options;
    options.timeout_seconds = bad;
    try {
      Communicator::create(
          make_callback_bootstrap(0, 1, AllgatherFn([](const void*, void*, std::size_t) {})),
          options);
      ADD_FAILURE() << "timeout_seconds " << bad << " accepted";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument) << e.what();
      EXPECT_NE(std::string(e.what()).find("CommOptions::timeout_seconds"), std::string::npos)
          << e.what();
    }
  }
}

}  // namespace
}  // namespace mk
