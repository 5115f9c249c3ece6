// Internal: the socket backend - TCP between every pair of ranks, one connection per pair used in
// both directions, one receiver thread per connection.
//
// Setup (collective, every step ends in an allgather so a failure anywhere fails everywhere):
//   1. listen on <interface address>:0 (MKERNEL_SOCKET_IFNAME, default 127.0.0.1): ephemeral port
//   2. allgather {address, port, host id, session nonce}
//   3. connect to every higher rank, send a hello naming me and the peer's session nonce
//   4. agree: any refused / unreachable peer -> mk::Error(kBootstrap) naming rank and address
//   5. accept one connection from every lower rank (hello checked), agree again
//
// Data: a put goes out as chunks of at most kMaxChunk bytes, each a WireHeader followed by the
// payload; the receiver writes the payload straight into the registered buffer (host memory) or
// through staging and config.copy_to_device (device memory), then counts it. A signal is a
// header alone. Messages to one peer are batched into one sendmsg. Leaving sends a goodbye, so
// a connection that ends without one is reported as a lost peer.
#pragma once

#include <sys/uio.h>

#include <atomic>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "runtime/socket_util.h"
#include "transport/transport_base.h"

namespace mk::transport::detail {

// One rank's published listening address (fixed size: it travels through allgather).
struct SocketAddress {
  uint16_t family = 0;  // AF_INET or AF_INET6
  uint16_t port = 0;    // host byte order
  uint32_t scope_id = 0;
  uint8_t addr[16] = {};
  uint64_t host_id = 0;  // equal <=> same machine
  uint64_t session = 0;  // random per transport: hellos must quote it
};

std::string to_string(const SocketAddress& a);  // "127.0.0.1:40123", "[::1]:40123"
// Numeric "a.b.c.d:port" or "[v6]:port". Throws mk::Error(kInvalidArgument).
SocketAddress parse_socket_address(const std::string& text);
// The address to listen on: the first IPv4 (else IPv6) address of interface `ifname`, or
// 127.0.0.1 when empty. Throws mk::Error(kInvalidArgument) naming the interfaces that exist.
SocketAddress interface_address(const std::string& ifname);
bool is_loopback(const SocketAddress& a);

class SocketTransport final : public TransportBase {
 public:
  static constexpr uint64_t kMaxChunk = uint64_t{4} << 20;

  SocketTransport(Bootstrap& bootstrap, const TransportConfig& config);
  ~SocketTransport() override;

  void post(std::span<const TransferOp> ops) override;
  // Device buffers need config.copy_to_device / copy_from_device (staged through host memory).
  uint32_t register_memory(int id, void* base, uint64_t bytes, MemoryKind kind) override;

  // Fault injection for tests: drops every connection without a goodbye, as a crashed process
  // would; peers report the lost connection. The transport is unusable afterwards.
  void close_abruptly();

  // The address this rank listens on (after setup, for messages and tests).
  const SocketAddress& address() const { return me_; }

 private:
  struct Connection;

  void connect_peers(const std::vector<SocketAddress>& all);
  void accept_peers(int listen_fd);
  void send_run(Connection& c, std::span<const TransferOp> ops);
  void send_iov(Connection& c, iovec* iov, int count);
  void receive_loop(Connection& c);
  bool receive_payload(Connection& c, char* dst, uint64_t bytes, bool device);
  // Records (first error wins) and returns the error for a connection that ended unexpectedly.
  Error lost(Connection& c, const std::string& during);
  void shutdown_all(bool goodbye);

  SocketAddress me_;
  mk::detail::UniqueFd listener_;
  std::vector<std::unique_ptr<Connection>> conns_;  // [world_size]; null: this rank, non-peers
  std::atomic<bool> stopping_{false};
  std::atomic<bool> closed_{false};
};

struct SocketTransport::Connection {
  int peer = -1;
  std::string address;  // the peer's listening address, for messages
  mk::detail::UniqueFd fd;
  std::mutex send_mutex;             // one sender at a time; a message is never interleaved
  std::atomic<bool> goodbye{false};  // the peer said goodbye: its end of stream is expected
  std::atomic<bool> broken{false};   // the stream ended or failed: nothing more can be sent
  std::atomic<bool> receiver_done{false};
  std::thread receiver;
  std::vector<char> staging;       // receiver's staging for device buffers (kMaxChunk)
  std::vector<char> send_staging;  // sender's (under send_mutex)
};

}  // namespace mk::transport::detail
