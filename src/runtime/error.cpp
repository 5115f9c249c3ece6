#include "mkernel/error.h"

namespace mk {

const char* to_string(ErrorCode code) {
  switch (code) {
    case ErrorCode::kInvalidArgument:
      return "invalid argument";
    case ErrorCode::kNotInitialized:
      return "not initialized";
    case ErrorCode::kOutOfMemory:
      return "out of memory";
    case ErrorCode::kUnsupported:
      return "unsupported";
    case ErrorCode::kTimeout:
      return "timeout";
    case ErrorCode::kBootstrap:
      return "bootstrap error";
    case ErrorCode::kCuda:
      return "CUDA error";
    case ErrorCode::kSystem:
      return "system error";
    case ErrorCode::kInternal:
      return "internal error";
  }
  return "unknown error";
}

}  // namespace mk
