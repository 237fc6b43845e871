#include "control/peer_socket.h"

#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "control/peer_auth.h"
#include "control/tls_relay.h"
#include "spdlog/spdlog.h"

namespace ciuic::daemon {
namespace {

using Clock = std::chrono::steady_clock;

std::string Errno(int e) { return std::strerror(e); }

std::string Unbracketed(const std::string& host) {
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') {
    return host.substr(1, host.size() - 2);
  }
  return host;
}

// Connects fd to `a` within the deadline (fd non-blocking). 0 or an errno.
int ConnectWithin(int fd, const addrinfo* a, Clock::time_point deadline) {
  if (connect(fd, a->ai_addr, a->ai_addrlen) == 0) return 0;
  if (errno != EINPROGRESS) return errno;
  while (true) {
    const auto left =
        std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
    pollfd p{fd, POLLOUT, 0};
    const int r = poll(&p, 1, static_cast<int>(std::max<int64_t>(0, left.count())));
    if (r == 0) return ETIMEDOUT;
    if (r < 0) {
      if (errno == EINTR) continue;
      return errno;
    }
    int error = 0;
    socklen_t len = sizeof(error);
    if (getsockopt(fd, SOL_SOCKET, SO_ERROR, &error, &len) != 0) return errno;
    return error;
  }
}

}  // namespace

void ReapDone(std::list<SocketThread>& threads) {
  for (auto it = threads.begin(); it != threads.end();) {
    if (it->done.load()) {
      it->thread.join();
      it = threads.erase(it);
    } else {
      ++it;
    }
  }
}

std::string HostOfAddress(const std::string& address) {
  if (!address.empty() && address.front() == '[') {
    const size_t close = address.find(']');
    return close == std::string::npos ? address : address.substr(1, close - 1);
  }
  const size_t colon = address.rfind(':');
  return colon == std::string::npos ? address : address.substr(0, colon);
}

int PortOfAddress(const std::string& address) {
  const size_t colon = address.rfind(':');
  const size_t close = address.rfind(']');
  if (colon == std::string::npos || (close != std::string::npos && colon < close)) return -1;
  int port = -1;
  if (!absl::SimpleAtoi(address.substr(colon + 1), &port) || port < 0 || port > 65535) return -1;
  return port;
}

void SetPeerStreamOptions(int fd) {
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  setsockopt(fd, SOL_SOCKET, SO_KEEPALIVE, &one, sizeof(one));
  int idle = 2, interval = 1, count = 3;
  setsockopt(fd, IPPROTO_TCP, TCP_KEEPIDLE, &idle, sizeof(idle));
  setsockopt(fd, IPPROTO_TCP, TCP_KEEPINTVL, &interval, sizeof(interval));
  setsockopt(fd, IPPROTO_TCP, TCP_KEEPCNT, &count, sizeof(count));
  unsigned user_timeout_ms = 5000;
  setsockopt(fd, IPPROTO_TCP, TCP_USER_TIMEOUT, &user_timeout_ms, sizeof(user_timeout_ms));
}

absl::Status CheckPeerAllowed(const std::string& host, const config::PeerList& allowed) {
  if (allowed.empty()) return absl::OkStatus();
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  const std::string name = Unbracketed(host);
  if (int e = getaddrinfo(name.c_str(), nullptr, &hints, &found); e != 0) {
    return absl::UnavailableError(absl::StrCat("cannot resolve ", host, ": ", gai_strerror(e)));
  }
  bool any = false;
  for (addrinfo* a = found; a != nullptr && !any; a = a->ai_next) any = allowed.Allows(a->ai_addr);
  freeaddrinfo(found);
  if (any) return absl::OkStatus();
  return absl::PermissionDeniedError(absl::StrCat(
      "coordinator ", host,
      " is not among this daemon's allowed peers (config key `peers`: ", allowed.ToString(), ")"));
}

absl::StatusOr<int> ConnectToPeer(const std::string& host, int port, const PeerSecurity& security,
                                  const std::string& what, Clock::time_point deadline) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  const std::string name = Unbracketed(host);
  const std::string service = std::to_string(port);
  if (int e = getaddrinfo(name.c_str(), service.c_str(), &hints, &found); e != 0) {
    return absl::UnavailableError(absl::StrCat(what, ": cannot resolve: ", gai_strerror(e)));
  }
  std::string last_error;
  int fd = -1;
  for (addrinfo* a = found; a != nullptr && fd < 0; a = a->ai_next) {
    // Checked per address actually connected to: a name that resolves
    // differently between a check and the connection cannot slip through.
    if (!security.allowed.empty() && !security.allowed.Allows(a->ai_addr)) continue;
    fd = socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, a->ai_protocol);
    if (fd < 0) {
      last_error = Errno(errno);
      continue;
    }
    if (int e = ConnectWithin(fd, a, deadline); e != 0) {
      last_error = Errno(e);
      close(fd);
      fd = -1;
    }
  }
  freeaddrinfo(found);
  if (fd < 0 && last_error.empty()) {
    return absl::PermissionDeniedError(absl::StrCat(
        what, ": ", host, " is not among this daemon's allowed peers (config key `peers`: ",
        security.allowed.ToString(), ")"));
  }
  if (fd < 0) return absl::UnavailableError(absl::StrCat(what, ": ", last_error));
  SetPeerStreamOptions(fd);  // on the TCP socket, also under TLS (its keepalive ends the relay)
  int conn = fd;             // what the token handshake and the caller use
  std::shared_ptr<TlsRelay> relay;
  if (security.tls) {
    absl::StatusOr<TlsStream> tls = TlsConnect(fd, *security.tls, what, deadline);
    if (!tls.ok()) {
      spdlog::warn("{}", std::string(tls.status().message()));
      close(fd);
      return tls.status();
    }
    conn = tls->fd;  // the relay owns fd now
    relay = std::move(tls->relay);
  }
  absl::Status auth = AuthenticateServer(conn, security.token, what, deadline);
  if (!auth.ok() && relay && absl::IsUnavailable(auth) &&
      relay->WaitEnded(std::min(deadline, Clock::now() + std::chrono::seconds(1))) &&
      !relay->end_status().ok()) {
    // TLS 1.3 ends the client's handshake before the server has checked
    // the client's certificate: a refusal comes as an alert on the first
    // read, which ended the relay.
    auth = absl::PermissionDeniedError(
        absl::StrCat(what, ": the TLS session ended: ", relay->end_status().message(),
                     " (does the server's tls_ca_file sign this daemon's certificate?)"));
  }
  if (!auth.ok()) {
    spdlog::warn("{}", std::string(auth.message()));
    close(conn);
    return auth;
  }
  fcntl(conn, F_SETFL, fcntl(conn, F_GETFL) & ~O_NONBLOCK);
  return conn;
}

absl::StatusOr<std::unique_ptr<PeerListener>> PeerListener::Start(const std::string& host, int port,
                                                                  Options options,
                                                                  Accepted accepted) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE;
  addrinfo* found = nullptr;
  const std::string name = Unbracketed(host);
  const std::string service = std::to_string(port);
  if (int e = getaddrinfo(name.empty() ? nullptr : name.c_str(), service.c_str(), &hints, &found);
      e != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(options.what, ": cannot resolve '", host, "': ", gai_strerror(e)));
  }
  std::string last_error = "no address";
  int fd = -1;
  for (addrinfo* a = found; a != nullptr && fd < 0; a = a->ai_next) {
    fd = socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
    if (fd < 0) {
      last_error = Errno(errno);
      continue;
    }
    int one = 1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (bind(fd, a->ai_addr, a->ai_addrlen) != 0 || listen(fd, 64) != 0) {
      last_error = Errno(errno);
      close(fd);
      fd = -1;
    }
  }
  freeaddrinfo(found);
  if (fd < 0) {
    return absl::UnavailableError(
        absl::StrCat(options.what, ": cannot listen on ", host, ":", port, ": ", last_error));
  }
  sockaddr_storage bound{};
  socklen_t len = sizeof(bound);
  getsockname(fd, reinterpret_cast<sockaddr*>(&bound), &len);
  const int actual =
      ntohs(bound.ss_family == AF_INET6 ? reinterpret_cast<sockaddr_in6*>(&bound)->sin6_port
                                        : reinterpret_cast<sockaddr_in*>(&bound)->sin_port);
  std::unique_ptr<PeerListener> listener(
      new PeerListener(fd, actual, std::move(options), std::move(accepted)));
  listener->acceptor_ = std::thread([l = listener.get()] { l->AcceptLoop(); });
  return listener;
}

PeerListener::~PeerListener() { Shutdown(); }

void PeerListener::Shutdown() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopping_ && !acceptor_.joinable()) return;
    stopping_ = true;
    shutdown(listen_fd_, SHUT_RDWR);  // wakes accept()
    for (SocketThread& h : handshakes_) {
      if (h.fd >= 0) shutdown(h.fd, SHUT_RDWR);  // wakes its poll
    }
  }
  if (acceptor_.joinable()) acceptor_.join();
  std::list<SocketThread> all;
  {
    std::lock_guard<std::mutex> lock(mu_);
    all.swap(handshakes_);
  }
  for (SocketThread& h : all) {
    if (h.thread.joinable()) h.thread.join();
  }
  close(listen_fd_);
}

void PeerListener::AcceptLoop() {
  pthread_setname_np(pthread_self(), "ciuic-peeraccept");
  while (true) {
    const int fd = accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
    std::lock_guard<std::mutex> lock(mu_);
    if (stopping_) {
      if (fd >= 0) close(fd);
      return;
    }
    if (fd < 0) {
      if (errno != EINTR && errno != ECONNABORTED) {
        spdlog::warn("{}: accept: {}", options_.what, Errno(errno));
        std::this_thread::sleep_for(std::chrono::milliseconds(100));  // EMFILE and the like
      }
      continue;
    }
    ReapDone(handshakes_);
    const std::string peer = PeerAddressOf(fd);
    if (static_cast<int>(handshakes_.size()) >= options_.max_handshakes) {
      // At most one line a second: a flood must not flood the log too.
      const auto now = Clock::now();
      if (now - last_refusal_log_ >= std::chrono::seconds(1)) {
        last_refusal_log_ = now;
        spdlog::warn("{}: {} connections still authenticating; closed the one from {}",
                     options_.what, options_.max_handshakes, peer);
      }
      close(fd);
      continue;
    }
    SocketThread& h = handshakes_.emplace_back();
    h.fd = fd;
    h.thread = std::thread([this, hs = &h, peer] { Authenticate(hs, peer); });
  }
}

void PeerListener::Authenticate(SocketThread* h, const std::string& peer) {
  pthread_setname_np(pthread_self(), "ciuic-peerauth");
  int fd = h->fd;
  const auto deadline = Clock::now() + options_.handshake_timeout;
  SetPeerStreamOptions(fd);  // on the TCP socket, also under TLS (its keepalive ends the relay)
  absl::Status s = absl::OkStatus();
  if (options_.tls) {
    absl::StatusOr<TlsStream> tls = TlsAccept(fd, *options_.tls, peer, deadline);
    if (tls.ok()) {
      // The relay owns the TCP socket now; Shutdown wakes the token
      // handshake through the relay's plaintext end.
      std::lock_guard<std::mutex> lock(mu_);
      h->fd = fd = tls->fd;
    } else {
      s = tls.status();
    }
  }
  if (s.ok()) s = AuthenticateClient(fd, options_.token, peer, deadline);
  bool handed = false;
  if (s.ok()) {
    std::lock_guard<std::mutex> lock(mu_);
    if (!stopping_) {
      h->fd = -1;  // no longer ours to shut down
      handed = true;
    }
  } else {
    spdlog::warn("{}: refused a connection: {}", options_.what, std::string(s.message()));
  }
  if (handed) {
    accepted_(fd, peer);
  } else {
    std::lock_guard<std::mutex> lock(mu_);
    h->fd = -1;
    close(fd);
  }
  h->done = true;
}

}  // namespace ciuic::daemon
