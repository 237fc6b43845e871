// The TCP ends of every connection between daemons, authenticated before
// any protocol runs on them (peer_auth.h):
//   - PeerListener accepts on `listen`'s host, runs the handshake of each
//     connection on a bounded set of threads, and hands the sockets that
//     passed to its owner (the gRPC peer service, the ordering listener);
//   - ConnectToPeer connects to another daemon within a deadline, only to
//     addresses the `peers` allow-list admits, and runs the handshake.
//
// Why the gRPC service takes sockets from here rather than listening itself:
// gRPC 1.51 has no hook to run a handshake of our own before HTTP/2, and its
// insecure credentials carry nothing; grpc::AddInsecureChannelFromFd and
// grpc::CreateCustomInsecureChannelFromFd (grpcpp/server_posix.h,
// create_channel_posix.h) put gRPC on a socket that is already
// authenticated. A channel made so does not reconnect: a peer client makes
// a new connection (and handshake) when its channel breaks.
//
// With TLS keys (PeerSecurity::tls, Options::tls) each connection first
// runs mutual TLS 1.3 on the TCP socket (tls_relay.h), and the
// cluster-token handshake then runs inside the TLS session, on the relayed
// plaintext socket that gRPC or the ordering stream later get. Inside
// rather than before it because: an eavesdropper then never sees the
// handshake's nonces and HMACs (no offline guessing of a weak token from a
// recording), only daemons with a certificate of the cluster's CA ever
// reach the token check, and the proof is bound to this TLS session (not
// replayable on another connection). The cost is one TLS handshake for a
// peer without the token, which the CA already keeps out.
#pragma once

#include <atomic>
#include <chrono>
#include <functional>
#include <list>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "config/peer_list.h"
#include "control/tls_relay.h"

namespace ciuic::daemon {

// A thread serving one socket, that ends on its own: its owner joins it
// once `done` (ReapDone) or when shutting down.
struct SocketThread {
  int fd = -1;  // -1 once closed or handed on
  std::thread thread;
  std::atomic<bool> done{false};
};
// Joins and removes the threads of `threads` that are done (the owner's
// lock held).
void ReapDone(std::list<SocketThread>& threads);

// How a daemon proves itself to others and which others it may reach.
struct PeerSecurity {
  std::string token;                      // "" = none (the empty key)
  config::PeerList allowed;               // empty: any host
  std::shared_ptr<const TlsContext> tls;  // null: plain TCP
};

class PeerListener {
 public:
  struct Options {
    std::string what;  // "peer service", "ordering listener": for the log and errors
    std::string token;
    std::shared_ptr<const TlsContext> tls;  // null: plain TCP
    // Handshakes in progress at once; a connection beyond them is closed
    // at once (a daemon's peers connect a few times per job).
    int max_handshakes = 32;
    std::chrono::milliseconds handshake_timeout = std::chrono::milliseconds(5000);
  };
  // Called on a handshake thread with a socket that passed (non-blocking,
  // as gRPC wants it; close-on-exec; with TLS the plaintext end of the
  // connection's relay), which it now owns, and its remote address. Must not block for long: it
  // holds a handshake slot.
  using Accepted = std::function<void(int fd, const std::string& peer)>;

  // Listens on host:port (host: a name, an IPv4 address, or an IPv6
  // address with or without brackets; port 0: a free one).
  static absl::StatusOr<std::unique_ptr<PeerListener>> Start(const std::string& host, int port,
                                                             Options options, Accepted accepted);
  ~PeerListener();  // Shutdown()

  int port() const { return port_; }
  // Stops accepting, breaks the handshakes in progress and returns once
  // every thread is done (no Accepted call after it).
  void Shutdown();

 private:
  PeerListener(int fd, int port, Options options, Accepted accepted)
      : listen_fd_(fd), port_(port), options_(std::move(options)), accepted_(std::move(accepted)) {}
  void AcceptLoop();
  void Authenticate(SocketThread* h, const std::string& peer);

  const int listen_fd_;
  const int port_;
  const Options options_;
  const Accepted accepted_;
  std::thread acceptor_;
  std::mutex mu_;
  bool stopping_ = false;                                   // guarded by mu_
  std::list<SocketThread> handshakes_;                      // guarded by mu_
  std::chrono::steady_clock::time_point last_refusal_log_;  // guarded by mu_
};

// Connects to host:port within the deadline, trying the addresses the host
// resolves to that `security.allowed` admits (all when it is empty), and
// authenticates (with `security.tls`: TLS, then the token inside it).
// `what` names the other end in errors ("coordinator 10.0.0.1:7361").
// Returns the connected socket (blocking mode, close-on-exec; with TLS the
// plaintext end of the relay), which the caller owns. PERMISSION_DENIED when no address
// is allowed (naming the config key `peers`) or the handshake fails.
absl::StatusOr<int> ConnectToPeer(const std::string& host, int port, const PeerSecurity& security,
                                  const std::string& what,
                                  std::chrono::steady_clock::time_point deadline);

// OK when host resolves to at least one address the allow-list admits (or
// the list is empty); PERMISSION_DENIED naming the host and `peers` else.
absl::Status CheckPeerAllowed(const std::string& host, const config::PeerList& allowed);

// "host" of "host:port" or "[v6]:port", without brackets; and the port
// (-1 when there is none).
std::string HostOfAddress(const std::string& address);
int PortOfAddress(const std::string& address);

// Low latency, and a vanished host noticed like the gRPC channels do
// (keepalive after 2 s idle, 3 probes 1 s apart; unacknowledged data given
// up after 5 s).
void SetPeerStreamOptions(int fd);

}  // namespace ciuic::daemon
