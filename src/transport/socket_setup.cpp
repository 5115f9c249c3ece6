// The socket backend's setup: addresses, listening, connecting and accepting, all agreed through
// the bootstrap (see socket_transport.h for the sequence).
#include <arpa/inet.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <optional>
#include <random>
#include <set>

#include "mkernel/topology.h"
#include "runtime/overrides.h"
#include "runtime/text_util.h"
#include "transport/socket_transport.h"
#include "transport/wire.h"

namespace mk::transport::detail {
namespace {

using mk::detail::Deadline;
using mk::detail::IoStatus;
using mk::detail::UniqueFd;

socklen_t to_sockaddr(const SocketAddress& a, sockaddr_storage* out) {
  std::memset(out, 0, sizeof(*out));
  if (a.family == AF_INET6) {
    auto* in6 = reinterpret_cast<sockaddr_in6*>(out);
    in6->sin6_family = AF_INET6;
    in6->sin6_port = htons(a.port);
    in6->sin6_scope_id = a.scope_id;
    std::memcpy(&in6->sin6_addr, a.addr, 16);
    return sizeof(sockaddr_in6);
  }
  auto* in4 = reinterpret_cast<sockaddr_in*>(out);
  in4->sin_family = AF_INET;
  in4->sin_port = htons(a.port);
  std::memcpy(&in4->sin_addr, a.addr, 4);
  return sizeof(sockaddr_in);
}

SocketAddress from_sockaddr(const sockaddr* sa) {
  SocketAddress a;
  if (sa->sa_family == AF_INET6) {
    const auto* in6 = reinterpret_cast<const sockaddr_in6*>(sa);
    a.family = AF_INET6;
    a.port = ntohs(in6->sin6_port);
    a.scope_id = in6->sin6_scope_id;
    std::memcpy(a.addr, &in6->sin6_addr, 16);
  } else {
    const auto* in4 = reinterpret_cast<const sockaddr_in*>(sa);
    a.family = AF_INET;
    a.port = ntohs(in4->sin_port);
    std::memcpy(a.addr, &in4->sin_addr, 4);
  }
  return a;
}

std::string errno_text(int err) { return std::strerror(err); }

// Connects to `a` before `deadline`. On failure returns an empty fd and sets *why.
UniqueFd connect_to(const SocketAddress& a, const Deadline& deadline, std::string* why) {
  UniqueFd fd(socket(a.family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
  if (!fd) {
    *why = "socket(): " + errno_text(errno);
    return {};
  }
  sockaddr_storage sa;
  const socklen_t len = to_sockaddr(a, &sa);
  if (connect(fd.get(), reinterpret_cast<sockaddr*>(&sa), len) != 0 && errno != EINPROGRESS) {
    *why = errno_text(errno);
    return {};
  }
  while (true) {
    pollfd p{fd.get(), POLLOUT, 0};
    const int n = poll(&p, 1, deadline.poll_timeout_ms());
    if (n > 0) break;
    if (n < 0 && errno != EINTR) {
      *why = "poll(): " + errno_text(errno);
      return {};
    }
    if (n == 0 && deadline.expired()) {
      *why = "no answer before the time limit";
      return {};
    }
  }
  int err = 0;
  socklen_t err_len = sizeof(err);
  if (getsockopt(fd.get(), SOL_SOCKET, SO_ERROR, &err, &err_len) != 0) err = errno;
  if (err != 0) {
    *why = errno_text(err);
    return {};
  }
  return fd;
}

void tune(int fd) {
  const int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
}

}  // namespace

// ---- addresses --------------------------------------------------------------------------------

std::string to_string(const SocketAddress& a) {
  char text[INET6_ADDRSTRLEN] = "?";
  inet_ntop(a.family == AF_INET6 ? AF_INET6 : AF_INET, a.addr, text, sizeof(text));
  std::string out;
  if (a.family == AF_INET6) out += '[';
  out += text;
  if (a.family == AF_INET6) out += ']';
  out += ':';
  out += std::to_string(a.port);
  return out;
}

SocketAddress parse_socket_address(const std::string& text) {
  auto bad = [&](const char* why) {
    return Error(ErrorCode::kInvalidArgument, "socket address '" + text + "' is not valid (" + why +
                                                  "); expected a.b.c.d:port or [v6]:port");
  };
  SocketAddress a;
  std::string host, port;
  if (!text.empty() && text[0] == '[') {
    const std::size_t close = text.find("]:");
    if (close == std::string::npos) throw bad("no ']:'");
    host = text.substr(1, close - 1);
    port = text.substr(close + 2);
    a.family = AF_INET6;
  } else {
    const std::size_t colon = text.rfind(':');
    if (colon == std::string::npos) throw bad("no port");
    host = text.substr(0, colon);
    port = text.substr(colon + 1);
    a.family = AF_INET;
  }
  long long value = 0;
  if (!mk::detail::parse_int(port.c_str(), 0, 65535, &value)) throw bad("port not in 0..65535");
  a.port = static_cast<uint16_t>(value);
  if (inet_pton(a.family, host.c_str(), a.addr) != 1) throw bad("not a numeric address");
  return a;
}

bool is_loopback(const SocketAddress& a) {
  if (a.family == AF_INET) return a.addr[0] == 127;
  static const uint8_t kLoop6[16] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1};
  return std::memcmp(a.addr, kLoop6, 16) == 0;
}

SocketAddress interface_address(const std::string& ifname) {
  if (ifname.empty()) return parse_socket_address("127.0.0.1:0");
  ifaddrs* list = nullptr;
  if (getifaddrs(&list) != 0) {
    throw Error(ErrorCode::kSystem,
                "getifaddrs() for MKERNEL_SOCKET_IFNAME='" + ifname + "': " + errno_text(errno));
  }
  std::optional<SocketAddress> v4, v6;
  std::set<std::string> names;
  for (const ifaddrs* i = list; i != nullptr; i = i->ifa_next) {
    if (i->ifa_addr == nullptr) continue;
    const int family = i->ifa_addr->sa_family;
    if (family != AF_INET && family != AF_INET6) continue;
    names.insert(i->ifa_name);
    if (ifname != i->ifa_name) continue;
    if (family == AF_INET && !v4) v4 = from_sockaddr(i->ifa_addr);
    if (family == AF_INET6 && !v6) v6 = from_sockaddr(i->ifa_addr);
  }
  freeifaddrs(list);
  if (!v4 && !v6) {
    std::string known;
    for (const std::string& n : names) known += (known.empty() ? "" : ", ") + n;
    throw Error(
        ErrorCode::kInvalidArgument,
        "MKERNEL_SOCKET_IFNAME='" + ifname +
            "': no interface of that name with an IPv4 or IPv6 address; interfaces: " + known);
  }
  SocketAddress a = v4 ? *v4 : *v6;
  a.port = 0;
  return a;
}

// ---- setup ------------------------------------------------------------------------------------

SocketTransport::SocketTransport(Bootstrap& bootstrap, const TransportConfig& config)
    : TransportBase(bootstrap, config, "socket"), conns_(static_cast<std::size_t>(world_size())) {
  // 1. Listen on an ephemeral port of the chosen interface.
  std::string status;
  try {
    std::string ifname = config.socket_ifname;
    if (ifname.empty()) {
      ifname =
          mk::detail::env_string(mk::detail::process_environment(), "MKERNEL_SOCKET_IFNAME", "");
    }
    me_ = interface_address(ifname);
    listener_.reset(socket(me_.family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
    if (!listener_) throw Error(ErrorCode::kSystem, "socket(): " + errno_text(errno));
    sockaddr_storage sa;
    socklen_t len = to_sockaddr(me_, &sa);
    if (bind(listener_.get(), reinterpret_cast<sockaddr*>(&sa), len) != 0) {
      throw Error(ErrorCode::kSystem, "bind(" + to_string(me_) + "): " + errno_text(errno));
    }
    if (listen(listener_.get(), std::min(world_size(), SOMAXCONN)) != 0) {
      throw Error(ErrorCode::kSystem, "listen(" + to_string(me_) + "): " + errno_text(errno));
    }
    len = sizeof(sa);
    getsockname(listener_.get(), reinterpret_cast<sockaddr*>(&sa), &len);
    me_.port = from_sockaddr(reinterpret_cast<sockaddr*>(&sa)).port;
  } catch (const Error& e) {
    status = "rank " + std::to_string(rank()) + ": " + message_of(e);
  }
  SocketAddress published = me_;
  if (status.empty() && !config.socket_advertise.empty()) {
    try {
      const SocketAddress ad = parse_socket_address(config.socket_advertise);
      std::memcpy(published.addr, ad.addr, sizeof(ad.addr));
      published.family = ad.family;
      published.port = ad.port;
    } catch (const Error& e) {
      status = "rank " + std::to_string(rank()) + ": socket_advertise: " + message_of(e);
    }
  }
  published.host_id = mk::this_host_id();
  published.session = std::random_device{}() * 0x100000001ull ^ std::random_device{}();
  me_.host_id = published.host_id;
  me_.session = published.session;
  agree_or_throw(bootstrap_, status, ErrorCode::kBootstrap, prefix() + "listening failed");

  // 2. Everyone's address.
  std::vector<SocketAddress> all(static_cast<std::size_t>(world_size()));
  bootstrap_.allgather(&published, all.data(), sizeof(SocketAddress));
  for (int r = 0; r < world_size() && status.empty(); ++r) {
    if (is_peer(r) && all[r].host_id != me_.host_id && is_loopback(all[r])) {
      status = "rank " + std::to_string(r) + " is on another host but listens on loopback " +
               to_string(all[r]) + "; set MKERNEL_SOCKET_IFNAME to an interface both can reach";
    }
  }
  for (int r = 0; r < world_size(); ++r) {
    if (!is_peer(r)) continue;  // this rank, and ranks outside TransportConfig::peers
    conns_[r] = std::make_unique<Connection>();
    conns_[r]->peer = r;
    conns_[r]->address = to_string(all[r]);
  }
  agree_or_throw(bootstrap_, status, ErrorCode::kBootstrap, prefix() + "address exchange failed");

  // 3-4. Connect to every higher peer; agree.
  try {
    connect_peers(all);
  } catch (const Error& e) {
    status = message_of(e);
  }
  agree_or_throw(bootstrap_, status, ErrorCode::kBootstrap, prefix() + "connecting failed");

  // 5. Accept every lower peer; agree.
  try {
    accept_peers(listener_.get());
  } catch (const Error& e) {
    status = message_of(e);
  }
  listener_.reset();
  agree_or_throw(bootstrap_, status, ErrorCode::kBootstrap, prefix() + "accepting failed");

  for (auto& c : conns_) {
    if (!c) continue;
    tune(c->fd.get());
    c->receiver = std::thread([this, conn = c.get()] { receive_loop(*conn); });
  }
}

void SocketTransport::connect_peers(const std::vector<SocketAddress>& all) {
  const Deadline deadline = Deadline::after(timeout_seconds_);
  for (int r = rank() + 1; r < world_size(); ++r) {
    if (!is_peer(r)) continue;
    Connection& c = *conns_[r];
    std::string why;
    c.fd = connect_to(all[r], deadline, &why);
    if (!c.fd) {
      throw Error(ErrorCode::kBootstrap, "rank " + std::to_string(rank()) +
                                             " could not connect to rank " + std::to_string(r) +
                                             " at " + c.address + ": " + why);
    }
    const WireHello hello{kHelloMagic,
                          kWireVersion,
                          static_cast<uint32_t>(rank()),
                          static_cast<uint32_t>(world_size()),
                          0,
                          all[r].session};
    if (mk::detail::send_all(c.fd.get(), &hello, sizeof(hello), deadline, "hello") !=
        IoStatus::kDone) {
      throw Error(ErrorCode::kBootstrap, "rank " + std::to_string(rank()) + " connected to rank " +
                                             std::to_string(r) + " at " + c.address +
                                             " but could not send its hello");
    }
  }
}

void SocketTransport::accept_peers(int listen_fd) {
  const Deadline deadline = Deadline::after(timeout_seconds_);
  int missing = 0;
  for (int r = 0; r < rank(); ++r) missing += is_peer(r) ? 1 : 0;
  while (missing > 0) {
    pollfd p{listen_fd, POLLIN, 0};
    const int n = poll(&p, 1, deadline.poll_timeout_ms());
    if (n < 0 && errno != EINTR)
      mk::detail::throw_system_error("poll on the listening socket", errno);
    // Expiry is checked whether or not a connection is pending: strays arriving one after the
    // other must not keep this loop going past the time limit.
    if (n <= 0 || deadline.expired()) {
      if (!deadline.expired()) continue;
      std::vector<int> ranks;
      for (int r = 0; r < rank(); ++r) {
        if (is_peer(r) && !conns_[r]->fd) ranks.push_back(r);
      }
      throw Error(ErrorCode::kBootstrap,
                  "rank " + std::to_string(rank()) + " (" + to_string(me_) + ") timed out after " +
                      mk::detail::format_seconds(timeout_seconds_) +
                      " s waiting for connections from " + mk::detail::format_rank_list(ranks));
    }
    UniqueFd fd(accept4(listen_fd, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK));
    if (!fd) {
      // Out of descriptors or memory: the connection stays queued and poll() reports it at once
      // again, so retrying would spin until the time limit. Say why now.
      if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM) {
        mk::detail::throw_system_error(
            "rank " + std::to_string(rank()) + ": accept() on " + to_string(me_), errno);
      }
      continue;  // the connection went away again; keep waiting
    }
    WireHello hello{};
    const Deadline hello_deadline =
        Deadline::earlier(deadline, Deadline::after(std::min(timeout_seconds_, 10.0)));
    if (mk::detail::recv_all(fd.get(), &hello, sizeof(hello), hello_deadline, "hello") !=
        IoStatus::kDone) {
      continue;  // not one of ours (or it died): ignore it
    }
    const bool ours = hello.magic == kHelloMagic && hello.session == me_.session;
    if (!ours) continue;
    if (hello.version != kWireVersion || hello.world_size != static_cast<uint32_t>(world_size()) ||
        hello.src_rank >= static_cast<uint32_t>(rank()) ||
        !is_peer(static_cast<int>(hello.src_rank)) || conns_[hello.src_rank]->fd) {
      throw Error(ErrorCode::kBootstrap,
                  "rank " + std::to_string(rank()) + " got an unexpected hello: version " +
                      std::to_string(hello.version) + " (expected " + std::to_string(kWireVersion) +
                      "), world " + std::to_string(hello.world_size) + ", from rank " +
                      std::to_string(hello.src_rank));
    }
    conns_[hello.src_rank]->fd = std::move(fd);
    --missing;
  }
}

}  // namespace mk::transport::detail
