// Internal: the communicator's view of its bootstrap. Every exchange inside a host-side step of
// the communicator (a Step scope) is bounded by the communicator's time limit
// (Bootstrap::allgather_within) and its errors name the step ("Communicator::alloc (symmetric
// allocation of 4096 bytes): rank 0: in-process allgather gave up after 2 s; rank 1 did not
// arrive"). The communicator's own steps, the FdExchange, the symmetric allocations and the
// inter-node transports all exchange through it inside steps, so none waits longer than the
// limit. Outside a step - the caller's own exchanges through Communicator::bootstrap() - it is
// the caller's bootstrap as it was.
//
// After a failed exchange, inside a step or not, the bootstrap may be out of step with its peers:
// every later exchange fails at once with the first failure's message, and the communicator
// refuses new work (Communicator::ensure_usable reads broken()).
#pragma once

#include <memory>
#include <string>

#include "mkernel/bootstrap.h"
#include "mkernel/error.h"

namespace mk::detail {

class StepBootstrap final : public Bootstrap {
 public:
  // limit_seconds <= 0: no limit.
  StepBootstrap(std::unique_ptr<Bootstrap> inner, double limit_seconds);

  int rank() const override { return inner_->rank(); }
  int size() const override { return inner_->size(); }
  void allgather(const void* send, void* recv, std::size_t bytes) override {
    allgather_within(send, recv, bytes, 0);  // (inside a step: the limit)
  }
  // Inside a step: at most min(seconds, the limit), errors naming the step and the limit.
  void allgather_within(const void* send, void* recv, std::size_t bytes, double seconds) override;

  // The step the exchanges of a scope belong to; steps nest (the innermost names the error).
  class Step {
   public:
    Step(StepBootstrap& b, std::string name);
    ~Step();
    Step(const Step&) = delete;
    Step& operator=(const Step&) = delete;

   private:
    StepBootstrap& b_;
    std::string previous_;
  };

  const std::string& broken() const { return broken_; }
  double limit() const { return limit_; }

 private:
  std::unique_ptr<Bootstrap> inner_;
  double limit_;
  std::string step_;
  std::string broken_;  // the first failure (empty while every exchange completed)
};

// The message of an mk::Error without its "code: " prefix.
std::string message_without_code(const Error& e);

}  // namespace mk::detail
