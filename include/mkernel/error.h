// mkernel/error.h - typed errors thrown across the public C++ API.
//
// Every public entry point validates its arguments before touching a GPU and throws mk::Error
// with a message that names the argument, what it was, and what was expected. Asynchronous
// failures (a peer that never arrives) are recorded on the device and raised by
// Communicator::check() / Communicator::synchronize().
#pragma once

#include <stdexcept>
#include <string>

namespace mk {

enum class ErrorCode {
  kInvalidArgument,  // wrong shape, dtype, alignment, stride, device or pointer
  kNotInitialized,   // communicator missing, destroyed or failed earlier
  kOutOfMemory,      // a buffer (symmetric or not) is too small, or an allocation failed
  kUnsupported,      // the hardware or build cannot do what was asked (e.g. no P2P)
  kTimeout,          // a wait on a peer exceeded the communicator's time limit
  kBootstrap,        // the out-of-band exchange failed (peer gone, mismatch between ranks)
  kCuda,             // a CUDA runtime / driver call failed
  kSystem,           // an OS call failed (sockets, file descriptors)
  kInternal,         // a bug in mkernel
};

const char* to_string(ErrorCode code);

class Error : public std::runtime_error {
 public:
  Error(ErrorCode code, const std::string& message)
      : std::runtime_error(std::string(to_string(code)) + ": " + message), code_(code) {}
  ErrorCode code() const noexcept { return code_; }

 private:
  ErrorCode code_;
};

}  // namespace mk
