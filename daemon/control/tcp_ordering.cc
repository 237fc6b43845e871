#include "control/tcp_ordering.h"

#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "spdlog/spdlog.h"

namespace ciuic::daemon {
namespace {

// Bounds: a connection's Hello must come within this; a write the peer does
// not take within this breaks the connection (the coordinator writes under
// its lock); connections served at once.
constexpr int kHelloTimeoutS = 10;
constexpr int kSendTimeoutS = 10;
constexpr size_t kMaxConnections = 1024;

std::string Errno(int e) { return std::strerror(e); }

// Low latency, and a vanished host noticed like the gRPC channels do
// (keepalive after 2 s idle, 3 probes 1 s apart; unacknowledged data
// given up after 5 s).
void SetStreamOptions(int fd) {
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

void SetTimeout(int fd, int option, int seconds) {
  timeval tv{seconds, 0};
  setsockopt(fd, SOL_SOCKET, option, &tv, sizeof(tv));
}

bool WriteAll(int fd, const char* p, size_t n) {
  while (n > 0) {
    ssize_t w = send(fd, p, n, MSG_NOSIGNAL);
    if (w < 0) {
      if (errno == EINTR) continue;
      return false;
    }
    p += w;
    n -= static_cast<size_t>(w);
  }
  return true;
}

// OK; OUT_OF_RANGE at a clean end of the stream (before a frame's first
// byte); UNAVAILABLE or INVALID_ARGUMENT otherwise.
absl::Status ReadAll(int fd, char* p, size_t n, bool at_frame_start) {
  size_t got = 0;
  while (got < n) {
    ssize_t r = recv(fd, p + got, n - got, 0);
    if (r == 0) {
      if (got == 0 && at_frame_start) return absl::OutOfRangeError("end of stream");
      return absl::UnavailableError("the stream ended inside a frame");
    }
    if (r < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) return absl::DeadlineExceededError("timed out");
      return absl::UnavailableError(Errno(errno));
    }
    got += static_cast<size_t>(r);
  }
  return absl::OkStatus();
}

template <typename M>
bool WriteFrame(int fd, const M& message) {
  std::string frame(4, '\0');
  if (!message.AppendToString(&frame) || frame.size() - 4 > kMaxFrameBytes) return false;
  const uint32_t n = static_cast<uint32_t>(frame.size() - 4);
  for (int i = 0; i < 4; ++i) frame[i] = static_cast<char>((n >> (8 * i)) & 0xff);
  return WriteAll(fd, frame.data(), frame.size());
}

template <typename M>
absl::Status ReadFrame(int fd, M* message) {
  unsigned char header[4];
  if (absl::Status s = ReadAll(fd, reinterpret_cast<char*>(header), 4, true); !s.ok()) return s;
  const uint32_t n = header[0] | (header[1] << 8) | (header[2] << 16) |
                     (static_cast<uint32_t>(header[3]) << 24);
  if (n > kMaxFrameBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("frame of ", n, " bytes, more than the ", kMaxFrameBytes, " allowed"));
  }
  std::string body(n, '\0');
  if (absl::Status s = ReadAll(fd, body.data(), n, false); !s.ok()) return s;
  if (!message->ParseFromString(body)) {
    return absl::InvalidArgumentError("a frame that is not an ordering message");
  }
  return absl::OkStatus();
}

// The coordinator's side of one connection.
class TcpNodeStream final : public NodeStream {
 public:
  explicit TcpNodeStream(int fd) : fd_(fd) {}
  void Send(const proto::CoordinatorEvent& e) override {
    std::lock_guard<std::mutex> lock(mu_);
    if (broken_) return;
    if (!WriteFrame(fd_, e)) {
      // The node does not take what we send (gone, or stuck past the send
      // timeout): end the connection; its reader then detaches it.
      broken_ = true;
      shutdown(fd_, SHUT_RDWR);
    }
  }

 private:
  const int fd_;
  std::mutex mu_;
  bool broken_ = false;  // guarded by mu_
};

// A node's side.
class TcpOrderingStream final : public OrderingStream {
 public:
  TcpOrderingStream(int fd, std::string where) : fd_(fd), where_(std::move(where)) {}
  ~TcpOrderingStream() override { close(fd_); }

  bool Write(const proto::NodeEvent& event) override {
    std::lock_guard<std::mutex> lock(write_mu_);
    if (writes_done_) return false;
    return WriteFrame(fd_, event);
  }
  bool Read(proto::CoordinatorEvent* event) override {
    absl::Status s = ReadFrame(fd_, event);
    if (s.ok()) return true;
    std::lock_guard<std::mutex> lock(end_mu_);
    if (cancelled_) {
      end_ = absl::CancelledError("ordering stream cancelled");
    } else if (absl::IsOutOfRange(s)) {
      end_ = absl::OkStatus();
    } else {
      end_ = absl::UnavailableError(absl::StrCat("ordering stream broke: ", s.message()));
    }
    return false;
  }
  void WritesDone() override {
    std::lock_guard<std::mutex> lock(write_mu_);
    if (writes_done_) return;
    writes_done_ = true;
    shutdown(fd_, SHUT_WR);
  }
  absl::Status Finish() override {
    std::lock_guard<std::mutex> lock(end_mu_);
    return end_;
  }
  void Cancel() override {
    {
      std::lock_guard<std::mutex> lock(end_mu_);
      cancelled_ = true;
    }
    shutdown(fd_, SHUT_RDWR);
  }
  std::string Describe() const override { return "over TCP to " + where_; }

 private:
  const int fd_;
  const std::string where_;  // "HOST port N"
  std::mutex write_mu_;
  bool writes_done_ = false;  // guarded by write_mu_
  std::mutex end_mu_;
  bool cancelled_ = false;    // guarded by end_mu_
  absl::Status end_;          // guarded by end_mu_
};

std::string Unbracketed(const std::string& host) {
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') {
    return host.substr(1, host.size() - 2);
  }
  return host;
}

}  // namespace

std::string HostOfAddress(const std::string& address) {
  if (!address.empty() && address.front() == '[') {
    const size_t close = address.find(']');
    return close == std::string::npos ? address : address.substr(1, close - 1);
  }
  const size_t colon = address.rfind(':');
  return colon == std::string::npos ? address : address.substr(0, colon);
}

absl::StatusOr<std::unique_ptr<OrderingListener>> OrderingListener::Start(
    const std::string& host, int port, Coordinator* coordinator) {
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
        absl::StrCat("ordering listener: cannot resolve '", host, "': ", gai_strerror(e)));
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
        absl::StrCat("ordering listener: cannot listen on ", host, ":", port, ": ", last_error));
  }
  sockaddr_storage bound{};
  socklen_t len = sizeof(bound);
  getsockname(fd, reinterpret_cast<sockaddr*>(&bound), &len);
  const int actual = ntohs(bound.ss_family == AF_INET6
                               ? reinterpret_cast<sockaddr_in6*>(&bound)->sin6_port
                               : reinterpret_cast<sockaddr_in*>(&bound)->sin_port);
  std::unique_ptr<OrderingListener> listener(new OrderingListener(fd, actual, coordinator));
  listener->acceptor_ = std::thread([l = listener.get()] { l->AcceptLoop(); });
  return listener;
}

OrderingListener::~OrderingListener() { Shutdown(); }

void OrderingListener::Shutdown() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopping_ && !acceptor_.joinable()) return;
    stopping_ = true;
    shutdown(listen_fd_, SHUT_RDWR);  // wakes accept()
    for (Connection& c : connections_) {
      if (c.fd >= 0) shutdown(c.fd, SHUT_RDWR);
    }
  }
  if (acceptor_.joinable()) acceptor_.join();
  std::list<Connection> all;
  {
    std::lock_guard<std::mutex> lock(mu_);
    all.swap(connections_);
  }
  for (Connection& c : all) {
    if (c.thread.joinable()) c.thread.join();
  }
  close(listen_fd_);
}

void OrderingListener::ReapDone() {
  for (auto it = connections_.begin(); it != connections_.end();) {
    if (it->done.load()) {
      it->thread.join();
      it = connections_.erase(it);
    } else {
      ++it;
    }
  }
}

void OrderingListener::AcceptLoop() {
  pthread_setname_np(pthread_self(), "ciuic-order");
  while (true) {
    const int fd = accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
    std::lock_guard<std::mutex> lock(mu_);
    if (stopping_) {
      if (fd >= 0) close(fd);
      return;
    }
    if (fd < 0) {
      if (errno != EINTR && errno != ECONNABORTED) {
        spdlog::warn("ordering listener: accept: {}", Errno(errno));
        std::this_thread::sleep_for(std::chrono::milliseconds(100));  // EMFILE and the like
      }
      continue;
    }
    ReapDone();
    if (connections_.size() >= kMaxConnections) {
      spdlog::warn("ordering listener: {} connections open, refusing another", kMaxConnections);
      close(fd);
      continue;
    }
    SetStreamOptions(fd);
    Connection& c = connections_.emplace_back();
    c.fd = fd;
    c.thread = std::thread([this, conn = &c] { Serve(conn); });
  }
}

void OrderingListener::Serve(Connection* c) {
  pthread_setname_np(pthread_self(), "ciuic-orderconn");
  const int fd = c->fd;
  TcpNodeStream out(fd);
  const auto refuse = [&](const absl::Status& why) {
    proto::CoordinatorEvent e;
    e.mutable_job_failed()->set_code(static_cast<int>(why.code()));
    e.mutable_job_failed()->set_message(absl::StrCat("ordering stream refused: ", why.message()));
    out.Send(e);
  };
  SetTimeout(fd, SO_RCVTIMEO, kHelloTimeoutS);
  SetTimeout(fd, SO_SNDTIMEO, kSendTimeoutS);
  proto::NodeEvent first;
  absl::Status s = ReadFrame(fd, &first);
  if (s.ok() && !first.has_hello()) {
    s = absl::InvalidArgumentError("the first message must be Hello");
  }
  absl::StatusOr<uint64_t> handle = absl::UnknownError("unset");
  if (s.ok()) {
    SetTimeout(fd, SO_RCVTIMEO, 0);  // from now on a stream may idle: keepalive watches it
    handle = coordinator_->Attach(first.hello(), &out);
  } else {
    handle = s;
  }
  if (!handle.ok()) {
    if (!absl::IsOutOfRange(handle.status())) refuse(handle.status());
    // Let the refusal reach the node before the connection goes: no more
    // writes, then wait (bounded) for the node to close its side.
    shutdown(fd, SHUT_WR);
    SetTimeout(fd, SO_RCVTIMEO, 2);
    char sink[4096];
    while (recv(fd, sink, sizeof(sink), 0) > 0) {
    }
  } else {
    bool left = false;
    proto::NodeEvent e;
    while ((s = ReadFrame(fd, &e)).ok()) {
      if (e.has_leave()) left = true;
      coordinator_->OnEvent(*handle, e);
    }
    absl::Status why = absl::OkStatus();
    if (!left) {
      why = absl::UnavailableError(absl::IsOutOfRange(s)
                                       ? std::string("its stream ended")
                                       : absl::StrCat("its stream broke: ", s.message()));
    }
    coordinator_->Detach(*handle, why);  // after it, `out` is no longer used
  }
  std::lock_guard<std::mutex> lock(mu_);
  close(fd);
  c->fd = -1;
  c->done = true;
}

absl::StatusOr<std::unique_ptr<OrderingStream>> OpenTcpOrderingStream(const std::string& host,
                                                                      int port, int timeout_ms) {
  const std::string where = absl::StrCat(host, " port ", port);
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  const std::string name = Unbracketed(host);
  const std::string service = std::to_string(port);
  if (int e = getaddrinfo(name.c_str(), service.c_str(), &hints, &found); e != 0) {
    return absl::UnavailableError(
        absl::StrCat("ordering stream to ", where, ": cannot resolve: ", gai_strerror(e)));
  }
  std::string last_error = "no address";
  int fd = -1;
  for (addrinfo* a = found; a != nullptr && fd < 0; a = a->ai_next) {
    fd = socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, a->ai_protocol);
    if (fd < 0) {
      last_error = Errno(errno);
      continue;
    }
    int rc = connect(fd, a->ai_addr, a->ai_addrlen);
    if (rc != 0 && errno == EINPROGRESS) {
      pollfd p{fd, POLLOUT, 0};
      rc = poll(&p, 1, timeout_ms);
      int error = 0;
      socklen_t len = sizeof(error);
      if (rc == 1 && getsockopt(fd, SOL_SOCKET, SO_ERROR, &error, &len) == 0 && error == 0) {
        rc = 0;
      } else {
        errno = rc == 0 ? ETIMEDOUT : (error != 0 ? error : errno);
        rc = -1;
      }
    }
    if (rc != 0) {
      last_error = Errno(errno);
      close(fd);
      fd = -1;
    }
  }
  freeaddrinfo(found);
  if (fd < 0) {
    return absl::UnavailableError(absl::StrCat("ordering stream to ", where, ": ", last_error));
  }
  fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) & ~O_NONBLOCK);
  SetStreamOptions(fd);
  return std::make_unique<TcpOrderingStream>(fd, where);
}

}  // namespace ciuic::daemon
