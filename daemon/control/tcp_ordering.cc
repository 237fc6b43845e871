#include "control/tcp_ordering.h"

#include <fcntl.h>
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

// One frame, read as NextFrame asks: its header, then (the length checked)
// its body.
absl::Status ReadFrame(int fd, google::protobuf::MessageLite* message) {
  std::string frame(kFrameHeaderBytes, '\0');
  if (absl::Status s = ReadAll(fd, frame.data(), frame.size(), true); !s.ok()) return s;
  absl::StatusOr<FrameCut> cut = NextFrame(frame, message);
  if (cut.ok() && !cut->complete) {
    frame.resize(cut->bytes);
    if (absl::Status s =
            ReadAll(fd, frame.data() + kFrameHeaderBytes, frame.size() - kFrameHeaderBytes, false);
        !s.ok()) {
      return s;
    }
    cut = NextFrame(frame, message);
  }
  return cut.status();
}

}  // namespace

TcpNodeStream::TcpNodeStream(int fd, size_t max_queued_bytes)
    : fd_(fd),
      queue_(
          max_queued_bytes, [fd](std::string& frame) { return WriteAll(fd, frame.data(), frame.size()); },
          [fd](const std::string& why) {
            spdlog::warn("ordering stream: dropping the node: {}", why);
            shutdown(fd, SHUT_RDWR);  // its reader then detaches it
          }) {}

void TcpNodeStream::Send(const proto::CoordinatorEvent& e) {
  std::string frame(4, '\0');
  if (!e.AppendToString(&frame) || frame.size() - 4 > kMaxFrameBytes) return;
  const uint32_t n = static_cast<uint32_t>(frame.size() - 4);
  for (int i = 0; i < 4; ++i) frame[i] = static_cast<char>((n >> (8 * i)) & 0xff);
  std::lock_guard<std::mutex> lock(mu_);
  size_t sent = 0;
  if (queue_.idle()) {
    // The common case: the socket has room, and the frame goes now.
    while (sent < frame.size()) {
      const ssize_t w = send(fd_, frame.data() + sent, frame.size() - sent,
                             MSG_NOSIGNAL | MSG_DONTWAIT);
      if (w > 0) {
        sent += static_cast<size_t>(w);
      } else if (w < 0 && errno == EINTR) {
        continue;
      } else if (w < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
        break;
      } else {
        shutdown(fd_, SHUT_RDWR);  // gone: its reader detaches it
        return;
      }
    }
    if (sent == frame.size()) return;
  }
  // The rest waits its turn behind what is queued, written by the queue's
  // thread: this call never blocks on the node.
  frame.erase(0, sent);
  const size_t bytes = frame.size();
  queue_.Push(std::move(frame), bytes);
}

namespace {

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
  bool cancelled_ = false;  // guarded by end_mu_
  absl::Status end_;        // guarded by end_mu_
};

}  // namespace

absl::StatusOr<std::unique_ptr<OrderingListener>> OrderingListener::Start(
    const std::string& host, int port, Coordinator* coordinator, const std::string& token,
    std::shared_ptr<const TlsContext> tls) {
  std::unique_ptr<OrderingListener> listener(new OrderingListener(coordinator));
  PeerListener::Options options;
  options.what = "ordering listener";
  options.token = token;
  options.tls = std::move(tls);
  auto peers = PeerListener::Start(
      host, port, std::move(options),
      [l = listener.get()](int fd, const std::string& peer) { l->Accept(fd, peer); });
  if (!peers.ok()) return peers.status();
  listener->peers_ = std::move(*peers);
  return listener;
}

OrderingListener::~OrderingListener() { Shutdown(); }

int OrderingListener::port() const { return peers_->port(); }

void OrderingListener::Shutdown() {
  if (peers_) peers_->Shutdown();  // no new connection after it
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
    for (SocketThread& c : connections_) {
      if (c.fd >= 0) shutdown(c.fd, SHUT_RDWR);
    }
  }
  std::list<SocketThread> all;
  {
    std::lock_guard<std::mutex> lock(mu_);
    all.swap(connections_);
  }
  for (SocketThread& c : all) {
    if (c.thread.joinable()) c.thread.join();
  }
}

void OrderingListener::Accept(int fd, const std::string& peer) {
  std::lock_guard<std::mutex> lock(mu_);
  if (stopping_) {
    close(fd);
    return;
  }
  ReapDone(connections_);
  if (connections_.size() >= kMaxConnections) {
    spdlog::warn("ordering listener: {} connections open, refusing the one from {}",
                 kMaxConnections, peer);
    close(fd);
    return;
  }
  fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) & ~O_NONBLOCK);  // read by a blocked thread
  SocketThread& c = connections_.emplace_back();
  c.fd = fd;
  c.thread = std::thread([this, conn = &c] { Serve(conn); });
}

void OrderingListener::Serve(SocketThread* c) {
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
                                                                      int port,
                                                                      const PeerSecurity& security,
                                                                      int timeout_ms) {
  const std::string where = absl::StrCat(host, " port ", port);
  auto fd = ConnectToPeer(host, port, security, absl::StrCat("ordering stream to ", where),
                          std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms));
  if (!fd.ok()) return fd.status();
  return std::make_unique<TcpOrderingStream>(*fd, where);
}

}  // namespace ciuic::daemon
