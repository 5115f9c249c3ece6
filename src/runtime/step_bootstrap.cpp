// The communicator's bounded, step-naming bootstrap (runtime/step_bootstrap.h).
#include "runtime/step_bootstrap.h"

#include <chrono>
#include <utility>

#include "runtime/text_util.h"

namespace mk::detail {

std::string message_without_code(const Error& e) {
  const std::string what = e.what(), prefix = std::string(to_string(e.code())) + ": ";
  return what.compare(0, prefix.size(), prefix) == 0 ? what.substr(prefix.size()) : what;
}

StepBootstrap::StepBootstrap(std::unique_ptr<Bootstrap> inner, double limit_seconds)
    : inner_(std::move(inner)), limit_(limit_seconds) {}

void StepBootstrap::allgather_within(const void* send, void* recv, std::size_t bytes,
                                     double seconds) {
  // Outside a step: the caller's own exchange (Communicator::bootstrap()), as the caller asked.
  const bool in_step = !step_.empty();
  const std::string where = in_step ? step_ + ": " : "";
  if (!broken_.empty()) {
    throw Error(ErrorCode::kBootstrap,
                where + "rank " + std::to_string(rank()) +
                    ": the bootstrap is out of step with the other ranks after an earlier "
                    "failure (" +
                    broken_ + "); create a new communicator");
  }
  const double limit =
      in_step && limit_ > 0 && (seconds <= 0 || seconds > limit_) ? limit_ : seconds;
  const auto start = std::chrono::steady_clock::now();
  try {
    inner_->allgather_within(send, recv, bytes, limit);
  } catch (const Error& e) {
    const std::string text = where + message_without_code(e);
    if (e.code() == ErrorCode::kInvalidArgument) throw Error(e.code(), text);  // still in step
    broken_ = text;
    // Name the communicator's limit only where it is what ran out: this rank waited for all of
    // it (not a smaller bootstrap limit, not a peer's failure passed on).
    const double waited =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (e.code() == ErrorCode::kTimeout && in_step && limit == limit_ && limit_ > 0 &&
        waited >= 0.9 * limit_) {
      throw Error(ErrorCode::kTimeout, text + "; time limit " + format_seconds(limit_) +
                                           " s (the communicator's, MKERNEL_TIMEOUT_S)");
    }
    throw Error(e.code(), text);
  }
}

StepBootstrap::Step::Step(StepBootstrap& b, std::string name) : b_(b), previous_(b.step_) {
  b_.step_ = std::move(name);
}

StepBootstrap::Step::~Step() { b_.step_ = std::move(previous_); }

}  // namespace mk::detail
