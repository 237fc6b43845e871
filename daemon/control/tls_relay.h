// Optional TLS 1.3 between daemons (config keys tls_cert_file, tls_key_file,
// tls_ca_file): mutual certificate verification against the cluster's CA,
// and a relay that lets gRPC and the ordering streams keep using a plain fd.
//
// Why a relay: gRPC 1.51 cannot take an OpenSSL session over an fd (its
// posix fd entry points are insecure-only), and the ordering streams read
// and write their fd from blocked threads. So after TCP connect/accept the
// TLS handshake runs on the TCP socket, and one relay thread per
// connection moves plaintext between the TLS session and one end of a
// socketpair(AF_UNIX, SOCK_STREAM); the other end is what gRPC or the
// ordering stream get, and the rest of the code is unchanged. Without TLS
// keys none of this exists: no relay, no extra hop.
//
// Before the TLS handshake the server sends a 40-byte TLS announcement
// (kPeerTlsMagic, then zeros: the size of the plaintext ServerHello), and
// the client checks it. A daemon with TLS and one without so meet a frame
// of the other mode at once, and each tells the other (peer_auth.h) before
// failing with an error naming the tls_* keys, on both sides.
//
// The relay (one thread, the only one ever to touch its SSL object):
// non-blocking SSL_read/SSL_write under poll, bounded buffers of
// kTlsRelayBufferBytes each way allocated once (nothing the peer sends sizes
// anything). The peer's close_notify becomes EOF (SHUT_WR) on the local end
// once the data before it is delivered; the local end's EOF becomes
// SSL_shutdown (close_notify) once the data before it is sent; half-close
// works both ways. The relay ends, closing the TCP socket and its end of
// the pair, when both directions are done, when the local end is closed,
// or on any TLS or network error (a TCP close without close_notify
// included: the local end then sees EOF, and end_status() says why). Its
// owner does not join it: it ends by itself once either side is gone
// (a vanished host within the TCP keepalive of peer_socket.h).
//
// TlsAccept and TlsConnect block their caller (a PeerListener handshake
// thread, a connecting thread) until the handshake is done or the deadline.
#pragma once

#include <atomic>
#include <chrono>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

typedef struct ssl_ctx_st SSL_CTX;

namespace ciuic::daemon {

inline constexpr size_t kTlsRelayBufferBytes = 64 * 1024;

// The cluster's certificates: this daemon's certificate chain and key, and
// the CA that signs every daemon's certificate. Shared by every connection
// (an SSL_CTX is safe to share once set up).
class TlsContext {
 public:
  // Reads and checks the three PEM files (the key must match the
  // certificate). INVALID_ARGUMENT / NOT_FOUND naming the file and why.
  static absl::StatusOr<std::shared_ptr<const TlsContext>> Load(const std::string& cert_file,
                                                                const std::string& key_file,
                                                                const std::string& ca_file);
  ~TlsContext();
  TlsContext(const TlsContext&) = delete;
  TlsContext& operator=(const TlsContext&) = delete;

  SSL_CTX* ctx() const { return ctx_; }

 private:
  explicit TlsContext(SSL_CTX* ctx) : ctx_(ctx) {}
  SSL_CTX* const ctx_;
};

// A TLS connection handed to its relay thread. The thread owns the TCP
// socket and the SSL object; the holder of this only reads why it ended.
class TlsRelay {
 public:
  // Why the relay ended: OK for an orderly end (or not ended yet),
  // otherwise the TLS or socket error (e.g. the peer's alert refusing this
  // daemon's certificate). Any thread.
  absl::Status end_status() const;
  // Waits until the relay has ended or the deadline; true if it ended.
  bool WaitEnded(std::chrono::steady_clock::time_point deadline) const;

  // Relay threads running in this process (for leak tests and metrics).
  static int Running();

  struct State;  // shared with the relay thread (tls_relay.cc)
  explicit TlsRelay(std::shared_ptr<State> state) : state_(std::move(state)) {}

 private:
  std::shared_ptr<State> state_;
};

// The plaintext end of a relayed TLS connection, which its caller owns
// (close-on-exec, non-blocking), and the relay.
struct TlsStream {
  int fd = -1;
  std::shared_ptr<TlsRelay> relay;
};

// The accepting side on `tcp_fd` (non-blocking; owned by the relay on
// success, still the caller's to close on failure). Announces TLS, runs the handshake by the
// deadline and verifies the client's certificate against the CA. `peer`
// ("1.2.3.4:5") names the other end in errors. PERMISSION_DENIED when the
// peer does not use TLS or its certificate is refused, DEADLINE_EXCEEDED,
// UNAVAILABLE.
absl::StatusOr<TlsStream> TlsAccept(int tcp_fd, const TlsContext& tls, const std::string& peer,
                                    std::chrono::steady_clock::time_point deadline);

// The connecting side; `server` names the other end ("coordinator
// HOST:PORT"). Same contract.
absl::StatusOr<TlsStream> TlsConnect(int tcp_fd, const TlsContext& tls, const std::string& server,
                                     std::chrono::steady_clock::time_point deadline);

}  // namespace ciuic::daemon
