#include "control/tls_relay.h"

#include <fcntl.h>
#include <openssl/err.h>
#include <openssl/ssl.h>
#include <openssl/x509.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <thread>

#include "absl/strings/str_cat.h"
#include "control/peer_auth.h"

namespace ciuic::daemon {

struct TlsRelay::State {
  mutable std::mutex mu;
  mutable std::condition_variable cv;
  bool ended = false;   // guarded by mu
  absl::Status status;  // guarded by mu
};

namespace {

using Clock = std::chrono::steady_clock;

std::atomic<int> g_running{0};

constexpr unsigned char kTlsHandshakeRecord = 0x16;  // first byte of a TLS ClientHello

// OpenSSL writes to the TCP socket with write(2), which raises SIGPIPE
// when the peer has gone. While one of these lives, the calling thread has
// SIGPIPE blocked (the write then fails with EPIPE); a SIGPIPE raised
// meanwhile is taken off the thread before the old mask comes back.
class ScopedNoSigpipe {
 public:
  ScopedNoSigpipe() {
    sigset_t pipe;
    sigemptyset(&pipe);
    sigaddset(&pipe, SIGPIPE);
    sigset_t pending;
    sigpending(&pending);
    was_pending_ = sigismember(&pending, SIGPIPE) == 1;
    pthread_sigmask(SIG_BLOCK, &pipe, &old_);
  }
  ~ScopedNoSigpipe() {
    sigset_t pending;
    sigpending(&pending);
    if (!was_pending_ && sigismember(&pending, SIGPIPE) == 1) {
      sigset_t pipe;
      sigemptyset(&pipe);
      sigaddset(&pipe, SIGPIPE);
      const timespec now{0, 0};
      sigtimedwait(&pipe, nullptr, &now);
    }
    pthread_sigmask(SIG_SETMASK, &old_, nullptr);
  }

 private:
  sigset_t old_;
  bool was_pending_ = false;
};

// What OpenSSL's error queue of this thread says (reasons only), emptied.
std::string SslErrors() {
  std::string out;
  while (unsigned long e = ERR_get_error()) {
    const char* reason = ERR_reason_error_string(e);
    absl::StrAppend(&out, out.empty() ? "" : "; ",
                    reason != nullptr ? reason : absl::StrCat("OpenSSL error ", e));
  }
  return out.empty() ? std::string("no OpenSSL detail") : out;
}

// Why an SSL call that returned `r` failed, for a status.
std::string SslFailure(SSL* ssl, int r, int error) {
  if (error == SSL_ERROR_SYSCALL) {
    std::string queue = ERR_peek_error() != 0 ? SslErrors() : std::string();
    if (r == 0 || errno == 0) return queue.empty() ? "the connection closed" : queue;
    return queue.empty() ? std::strerror(errno)
                         : absl::StrCat(queue, " (", std::strerror(errno), ")");
  }
  if (error == SSL_ERROR_ZERO_RETURN) return "the peer ended the TLS session";
  return SslErrors();
}

absl::Status CheckReadable(const std::string& key, const std::string& path) {
  FILE* f = std::fopen(path.c_str(), "r");
  if (f == nullptr) {
    const int e = errno;
    const std::string why = absl::StrCat(key, " '", path, "' cannot be read: ", std::strerror(e));
    return e == ENOENT ? absl::NotFoundError(why) : absl::PermissionDeniedError(why);
  }
  std::fclose(f);
  return absl::OkStatus();
}

absl::Status Unusable(const std::string& key, const std::string& path, const std::string& what) {
  return absl::InvalidArgumentError(absl::StrCat(key, " '", path, "': ", what, ": ", SslErrors()));
}

// Runs SSL_accept or SSL_connect on the non-blocking socket by the deadline.
absl::Status Handshake(SSL* ssl, int fd, bool server, const std::string& who,
                       Clock::time_point deadline) {
  while (true) {
    ERR_clear_error();
    errno = 0;
    const int r = server ? SSL_accept(ssl) : SSL_connect(ssl);
    if (r == 1) return absl::OkStatus();
    const int error = SSL_get_error(ssl, r);
    short events = 0;
    if (error == SSL_ERROR_WANT_READ) {
      events = POLLIN;
    } else if (error == SSL_ERROR_WANT_WRITE) {
      events = POLLOUT;
    } else {
      const long verify = SSL_get_verify_result(ssl);
      const std::string why = SslFailure(ssl, r, error);
      if (verify != X509_V_OK) {
        return absl::PermissionDeniedError(absl::StrCat(
            who, ": TLS: its certificate is refused: ", X509_verify_cert_error_string(verify),
            " (certificates must be signed by the CA of tls_ca_file)"));
      }
      if (error == SSL_ERROR_SSL) {
        return absl::PermissionDeniedError(absl::StrCat(who, ": TLS handshake failed: ", why));
      }
      return absl::UnavailableError(absl::StrCat(who, ": TLS handshake: ", why));
    }
    if (absl::Status s = WaitForSocket(fd, events, deadline); !s.ok()) {
      return absl::Status(s.code(), absl::StrCat(who, ": TLS handshake: ", s.message()));
    }
  }
}

// Moves bytes between the TLS session on `net` and the plaintext socket
// `local` until both directions are done or either side breaks (the
// contract is in tls_relay.h). Owns ssl, net and local.
class Relay {
 public:
  Relay(SSL* ssl, int net, int local, std::shared_ptr<TlsRelay::State> state)
      : ssl_(ssl),
        net_(net),
        local_(local),
        state_(std::move(state)),
        in_(new unsigned char[kTlsRelayBufferBytes]),
        out_(new unsigned char[kTlsRelayBufferBytes]) {}

  void Run() {
    pthread_setname_np(pthread_self(), "ciuic-tlsrelay");
    ScopedNoSigpipe no_sigpipe;
    absl::Status status;
    while (status.ok()) {
      Wants wants;
      bool progress = true;
      while (progress && status.ok()) {
        wants = Wants();
        progress = Pass(&wants, &status);
      }
      if (!status.ok() || Finished()) break;
      pollfd p[2] = {{net_, 0, 0}, {local_, 0, 0}};
      if (wants.net_read) p[0].events |= POLLIN;
      if (wants.net_write) p[0].events |= POLLOUT;
      if (p[0].events == 0) p[0].fd = -1;  // a full buffer: the local side must move first
      if (wants.local_read) p[1].events |= POLLIN;
      if (wants.local_write) p[1].events |= POLLOUT;
      if (local_eof_ && (local_gone_ || local_write_shut_)) p[1].fd = -1;  // nothing more there
      // No timeout: the TCP socket's keepalive and user timeout end a
      // vanished peer, and the local owner's close ends the local side.
      const int r = poll(p, 2, -1);
      if (r < 0 && errno != EINTR) {
        status = absl::InternalError(absl::StrCat("TLS relay: poll: ", std::strerror(errno)));
      }
      if (r > 0 && p[1].fd >= 0 && (p[1].revents & (POLLHUP | POLLERR)) && local_eof_ &&
          !local_write_shut_) {
        local_gone_ = true;  // the owner closed its end: nothing more can be delivered
      }
    }
    // Best effort, never waited for; not after a fatal TLS error (OpenSSL
    // forbids it).
    if (status.ok() && !close_notify_sent_) SSL_shutdown(ssl_);
    SSL_free(ssl_);
    close(net_);
    close(local_);
    {
      std::lock_guard<std::mutex> lock(state_->mu);
      state_->ended = true;
      state_->status = status;
    }
    state_->cv.notify_all();
    g_running.fetch_sub(1);
  }

 private:
  struct Wants {
    bool net_read = false, net_write = false, local_read = false, local_write = false;
  };

  bool Finished() const {
    const bool to_net_done = local_eof_ && out_start_ == out_end_ && close_notify_sent_;
    const bool to_local_done =
        local_gone_ || (net_eof_ && in_start_ == in_end_ && local_write_shut_);
    return to_net_done && to_local_done;
  }

  // One attempt at each of the four moves; true if any moved something.
  bool Pass(Wants* wants, absl::Status* status) {
    bool progress = false;
    // The network into in_.
    if (!net_eof_ && !local_gone_ && in_end_ < kTlsRelayBufferBytes) {
      ERR_clear_error();
      errno = 0;
      const int r =
          SSL_read(ssl_, in_.get() + in_end_, static_cast<int>(kTlsRelayBufferBytes - in_end_));
      if (r > 0) {
        in_end_ += static_cast<size_t>(r);
        progress = true;
      } else {
        const int error = SSL_get_error(ssl_, r);
        if (error == SSL_ERROR_WANT_READ) {
          wants->net_read = true;
        } else if (error == SSL_ERROR_WANT_WRITE) {
          wants->net_write = true;
        } else if (error == SSL_ERROR_ZERO_RETURN) {
          net_eof_ = true;  // the peer's close_notify
          progress = true;
        } else {
          *status = absl::UnavailableError(absl::StrCat("TLS: ", SslFailure(ssl_, r, error)));
          return false;
        }
      }
    }
    // in_ to the local end.
    if (in_start_ < in_end_ && !local_gone_) {
      const ssize_t w =
          send(local_, in_.get() + in_start_, in_end_ - in_start_, MSG_NOSIGNAL | MSG_DONTWAIT);
      if (w > 0) {
        in_start_ += static_cast<size_t>(w);
        if (in_start_ == in_end_) in_start_ = in_end_ = 0;
        progress = true;
      } else if (errno == EAGAIN || errno == EWOULDBLOCK) {
        wants->local_write = true;
      } else if (errno != EINTR) {
        local_gone_ = true;  // closed by its owner: drop what was for it
        local_eof_ = true;
        in_start_ = in_end_ = 0;
        progress = true;
      }
    }
    if (in_start_ > 0 && in_end_ == kTlsRelayBufferBytes) {
      std::memmove(in_.get(), in_.get() + in_start_, in_end_ - in_start_);
      in_end_ -= in_start_;
      in_start_ = 0;
      progress = true;
    }
    // The peer's end, after everything before it: EOF for the local reader.
    if (net_eof_ && in_start_ == in_end_ && !local_write_shut_ && !local_gone_) {
      shutdown(local_, SHUT_WR);
      local_write_shut_ = true;
      progress = true;
    }
    // The local end into out_.
    if (!local_eof_ && out_end_ < kTlsRelayBufferBytes) {
      const ssize_t r =
          recv(local_, out_.get() + out_end_, kTlsRelayBufferBytes - out_end_, MSG_DONTWAIT);
      if (r > 0) {
        out_end_ += static_cast<size_t>(r);
        progress = true;
      } else if (r == 0) {
        local_eof_ = true;
        progress = true;
      } else if (errno == EAGAIN || errno == EWOULDBLOCK) {
        wants->local_read = true;
      } else if (errno != EINTR) {
        local_eof_ = local_gone_ = true;
        progress = true;
      }
    }
    // out_ to the network. A write that wanted to wait is retried with the
    // same length (OpenSSL's rule); the bytes stay where they were.
    if (out_start_ < out_end_ && !close_notify_sent_) {
      const size_t len = retry_len_ != 0 ? retry_len_ : out_end_ - out_start_;
      ERR_clear_error();
      errno = 0;
      const int w = SSL_write(ssl_, out_.get() + out_start_, static_cast<int>(len));
      if (w > 0) {
        retry_len_ = 0;
        out_start_ += static_cast<size_t>(w);
        if (out_start_ == out_end_) out_start_ = out_end_ = 0;
        progress = true;
      } else {
        const int error = SSL_get_error(ssl_, w);
        if (error == SSL_ERROR_WANT_READ || error == SSL_ERROR_WANT_WRITE) {
          retry_len_ = len;
          (error == SSL_ERROR_WANT_READ ? wants->net_read : wants->net_write) = true;
        } else {
          *status = absl::UnavailableError(absl::StrCat("TLS: ", SslFailure(ssl_, w, error)));
          return false;
        }
      }
    }
    if (retry_len_ == 0 && out_start_ > 0 && out_end_ == kTlsRelayBufferBytes) {
      std::memmove(out_.get(), out_.get() + out_start_, out_end_ - out_start_);
      out_end_ -= out_start_;
      out_start_ = 0;
      progress = true;
    }
    // The local end's EOF, after everything before it: close_notify.
    if (local_eof_ && out_start_ == out_end_ && !close_notify_sent_) {
      ERR_clear_error();
      const int r = SSL_shutdown(ssl_);
      if (r >= 0) {
        close_notify_sent_ = true;
        progress = true;
      } else {
        const int error = SSL_get_error(ssl_, r);
        if (error == SSL_ERROR_WANT_WRITE || error == SSL_ERROR_WANT_READ) {
          (error == SSL_ERROR_WANT_READ ? wants->net_read : wants->net_write) = true;
        } else {
          *status = absl::UnavailableError(absl::StrCat("TLS: ", SslFailure(ssl_, r, error)));
          return false;
        }
      }
    }
    return progress;
  }

  SSL* const ssl_;
  const int net_;
  const int local_;
  const std::shared_ptr<TlsRelay::State> state_;
  // in_: network to local; out_: local to network. [start, end) is pending.
  const std::unique_ptr<unsigned char[]> in_, out_;
  size_t in_start_ = 0, in_end_ = 0, out_start_ = 0, out_end_ = 0;
  size_t retry_len_ = 0;            // length of an SSL_write to retry, 0 = none
  bool net_eof_ = false;            // the peer's close_notify came
  bool local_eof_ = false;          // the local end will send nothing more
  bool local_write_shut_ = false;   // EOF delivered to the local end
  bool local_gone_ = false;         // the local end can take nothing more
  bool close_notify_sent_ = false;  // SSL_shutdown sent ours
};

// The handshake done: the socketpair and the relay thread.
absl::StatusOr<TlsStream> StartRelay(SSL* ssl, int tcp_fd, const std::string& who) {
  int pair[2];
  if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0, pair) != 0) {
    return absl::UnavailableError(
        absl::StrCat(who, ": TLS relay: socketpair: ", std::strerror(errno)));
  }
  auto state = std::make_shared<TlsRelay::State>();
  g_running.fetch_add(1);
  auto relay = std::make_unique<Relay>(ssl, tcp_fd, pair[0], state);
  std::thread([r = std::move(relay)] { r->Run(); }).detach();
  TlsStream stream;
  stream.fd = pair[1];
  stream.relay = std::make_shared<TlsRelay>(std::move(state));
  return stream;
}

absl::StatusOr<TlsStream> Start(int tcp_fd, const TlsContext& tls, bool server,
                                const std::string& who, Clock::time_point deadline) {
  fcntl(tcp_fd, F_SETFL, fcntl(tcp_fd, F_GETFL) | O_NONBLOCK);
  ScopedNoSigpipe no_sigpipe;  // the handshake writes too
  SSL* ssl = SSL_new(tls.ctx());
  if (ssl == nullptr || SSL_set_fd(ssl, tcp_fd) != 1) {
    SSL_free(ssl);
    return absl::InternalError(absl::StrCat(who, ": TLS: cannot make a session: ", SslErrors()));
  }
  if (absl::Status s = Handshake(ssl, tcp_fd, server, who, deadline); !s.ok()) {
    SSL_free(ssl);  // leaves tcp_fd open (SSL_set_fd's BIO does not close it)
    return s;
  }
  auto stream = StartRelay(ssl, tcp_fd, who);
  if (!stream.ok()) SSL_free(ssl);
  return stream;
}

}  // namespace

absl::StatusOr<std::shared_ptr<const TlsContext>> TlsContext::Load(const std::string& cert_file,
                                                                   const std::string& key_file,
                                                                   const std::string& ca_file) {
  for (const auto& [key, path] : {std::pair<std::string, std::string>{"tls_cert_file", cert_file},
                                  {"tls_key_file", key_file},
                                  {"tls_ca_file", ca_file}}) {
    if (absl::Status s = CheckReadable(key, path); !s.ok()) return s;
  }
  // Relay threads are not joined (tls_relay.h) and may still run while
  // the process exits: OpenSSL must not free its state under them then.
  OPENSSL_init_ssl(OPENSSL_INIT_NO_ATEXIT, nullptr);
  ERR_clear_error();
  SSL_CTX* ctx = SSL_CTX_new(TLS_method());
  if (ctx == nullptr) return absl::InternalError(absl::StrCat("TLS: ", SslErrors()));
  std::shared_ptr<const TlsContext> tls(new TlsContext(ctx));
  if (SSL_CTX_set_min_proto_version(ctx, TLS1_3_VERSION) != 1) {
    return absl::InternalError(absl::StrCat("TLS 1.3 is not available: ", SslErrors()));
  }
  if (SSL_CTX_use_certificate_chain_file(ctx, cert_file.c_str()) != 1) {
    return Unusable("tls_cert_file", cert_file, "not a PEM certificate");
  }
  if (SSL_CTX_use_PrivateKey_file(ctx, key_file.c_str(), SSL_FILETYPE_PEM) != 1) {
    return Unusable("tls_key_file", key_file, "not a PEM private key");
  }
  if (SSL_CTX_check_private_key(ctx) != 1) {
    return Unusable(
        "tls_key_file", key_file,
        absl::StrCat("not the key of the certificate in tls_cert_file '", cert_file, "'"));
  }
  if (SSL_CTX_load_verify_locations(ctx, ca_file.c_str(), nullptr) != 1) {
    return Unusable("tls_ca_file", ca_file, "no PEM CA certificate in it");
  }
  // Both sides present a certificate and verify the other's.
  SSL_CTX_set_verify(ctx, SSL_VERIFY_PEER | SSL_VERIFY_FAIL_IF_NO_PEER_CERT, nullptr);
  // The relay writes what it has (partial writes) and may append to its
  // buffer between a write that waited and its retry.
  SSL_CTX_set_mode(ctx, SSL_MODE_ENABLE_PARTIAL_WRITE | SSL_MODE_ACCEPT_MOVING_WRITE_BUFFER);
  // Connections live for a job: no session tickets, no cache to bound.
  SSL_CTX_set_num_tickets(ctx, 0);
  SSL_CTX_set_session_cache_mode(ctx, SSL_SESS_CACHE_OFF);
  return tls;
}

TlsContext::~TlsContext() { SSL_CTX_free(ctx_); }

absl::Status TlsRelay::end_status() const {
  std::lock_guard<std::mutex> lock(state_->mu);
  return state_->status;
}

bool TlsRelay::WaitEnded(Clock::time_point deadline) const {
  std::unique_lock<std::mutex> lock(state_->mu);
  return state_->cv.wait_until(lock, deadline, [&] { return state_->ended; });
}

int TlsRelay::Running() { return g_running.load(); }

absl::StatusOr<TlsStream> TlsAccept(int tcp_fd, const TlsContext& tls, const std::string& peer,
                                    Clock::time_point deadline) {
  const std::string who = absl::StrCat("peer ", peer);
  // The announcement: what a plaintext client reads as its ServerHello.
  unsigned char announce[kServerHelloBytes] = {};
  std::memcpy(announce, kPeerTlsMagic, sizeof(kPeerTlsMagic));
  if (absl::Status s = SendExactly(tcp_fd, announce, sizeof(announce), deadline); !s.ok()) {
    return absl::Status(s.code(), absl::StrCat(who, ": TLS announcement: ", s.message()));
  }
  // A TLS client answers with a ClientHello; anything else is read (8
  // bytes, fixed) to say what it is.
  if (absl::Status s = WaitForSocket(tcp_fd, POLLIN, deadline); !s.ok()) {
    return absl::Status(s.code(), absl::StrCat(who, ": waiting for its TLS hello: ", s.message()));
  }
  unsigned char first = 0;
  const ssize_t n = recv(tcp_fd, &first, 1, MSG_PEEK | MSG_DONTWAIT);
  if (n <= 0) {
    return absl::UnavailableError(absl::StrCat(who, " closed the connection before its TLS hello"));
  }
  if (first != kTlsHandshakeRecord) {
    unsigned char magic[sizeof(kPeerAuthMagic)];
    absl::Status s = ReceiveExactly(tcp_fd, magic, sizeof(magic), deadline);
    if (s.ok() && std::memcmp(magic, kPeerAuthMagic, sizeof(magic)) == 0) {
      return TlsModeMismatch(who, " does not use TLS and this daemon requires it");
    }
    return absl::InvalidArgumentError(
        absl::StrCat(who, " speaks neither TLS nor the ciuic peer handshake"));
  }
  return Start(tcp_fd, tls, /*server=*/true, who, deadline);
}

absl::StatusOr<TlsStream> TlsConnect(int tcp_fd, const TlsContext& tls, const std::string& server,
                                     Clock::time_point deadline) {
  unsigned char hello[kServerHelloBytes];
  if (absl::Status s = ReceiveExactly(tcp_fd, hello, sizeof(hello), deadline); !s.ok()) {
    return absl::Status(s.code(),
                        absl::StrCat(server, ": waiting for its TLS announcement: ", s.message()));
  }
  if (std::memcmp(hello, kPeerAuthMagic, sizeof(kPeerAuthMagic)) == 0) {
    return RefuseOtherTlsMode(tcp_fd, kPeerTlsMagic, server,
                              " does not use TLS and this daemon does", deadline);
  }
  if (std::memcmp(hello, kPeerTlsMagic, sizeof(kPeerTlsMagic)) != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        server, " does not speak the ciuic peer handshake (not a ciuicd of this version?)"));
  }
  return Start(tcp_fd, tls, /*server=*/false, server, deadline);
}

}  // namespace ciuic::daemon
