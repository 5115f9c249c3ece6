// Run-time choice of the transport backend (MKERNEL_TRANSPORT, else MKERNEL_DEFAULT_BACKEND).
#include "runtime/overrides.h"
#include "transport/backends.h"
#include "transport/socket_transport.h"

#ifndef MKERNEL_DEFAULT_BACKEND
#define MKERNEL_DEFAULT_BACKEND "socket"
#endif

namespace mk::transport {

std::string default_backend() {
  return mk::detail::env_choice(mk::detail::process_environment(), "MKERNEL_TRANSPORT",
                                {"socket", "cx7", "efa"}, MKERNEL_DEFAULT_BACKEND);
}

std::unique_ptr<Transport> make_transport(Bootstrap& bootstrap, const TransportConfig& config,
                                          const std::string& backend) {
  const std::string name = backend.empty() ? default_backend() : backend;
  if (name == "socket") return std::make_unique<detail::SocketTransport>(bootstrap, config);
  if (name == "cx7") return detail::make_cx7_transport(bootstrap, config);
  if (name == "efa") return detail::make_efa_transport(bootstrap, config);
  const std::string source = !backend.empty() ? "argument" : "MKERNEL_DEFAULT_BACKEND";
  throw Error(ErrorCode::kInvalidArgument, "transport backend '" + name + "' (" + source +
                                               ") is not known; expected socket, cx7 or efa");
}

#if !MKERNEL_HAVE_VERBS
namespace detail {
std::unique_ptr<Transport> make_cx7_transport(Bootstrap&, const TransportConfig&) {
  throw Error(ErrorCode::kUnsupported,
              "the cx7 backend was not built: mkernel was compiled without the rdma-core headers "
              "(install libibverbs-dev and rebuild)");
}
std::unique_ptr<Transport> make_efa_transport(Bootstrap&, const TransportConfig&) {
  throw Error(ErrorCode::kUnsupported,
              "the efa backend was not built: mkernel was compiled without the rdma-core headers "
              "(install libibverbs-dev and rebuild)");
}
}  // namespace detail
#endif

}  // namespace mk::transport
