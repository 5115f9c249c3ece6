// Internal: constructors of the RDMA backends (cx7_transport.cpp, efa_transport.cpp; stubs that
// report kUnsupported when mkernel is built without the rdma-core headers).
#pragma once

#include <memory>

#include "mkernel/transport/transport.h"

namespace mk::transport::detail {

// Collective. Throw mk::Error(kUnsupported) on every rank when any rank cannot run the backend
// (libibverbs / libefa missing, no device, no active port, missing capability).
std::unique_ptr<Transport> make_cx7_transport(Bootstrap& bootstrap, const TransportConfig& config);
std::unique_ptr<Transport> make_efa_transport(Bootstrap& bootstrap, const TransportConfig& config);

}  // namespace mk::transport::detail
