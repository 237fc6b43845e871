#include "control/control_socket.h"

#include <fcntl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <charconv>
#include <chrono>
#include <cstring>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "grpcpp/server.h"
#include "grpcpp/server_posix.h"
#include "shm/session_socket.h"
#include "spdlog/spdlog.h"

namespace ciuic::daemon {
namespace {

constexpr char kPeerPrefix[] = "fd:";

// The peer's supplementary groups (SO_PEERGROUPS, Linux 4.13+): empty if
// the kernel cannot say.
std::vector<gid_t> PeerGroups(int fd) {
  std::vector<gid_t> groups(64);
  for (int attempt = 0; attempt < 4; ++attempt) {
    socklen_t len = static_cast<socklen_t>(groups.size() * sizeof(gid_t));
    if (getsockopt(fd, SOL_SOCKET, SO_PEERGROUPS, groups.data(), &len) == 0) {
      groups.resize(len / sizeof(gid_t));
      return groups;
    }
    if (errno != ERANGE || len / sizeof(gid_t) > 65536) break;
    groups.resize(len / sizeof(gid_t));
  }
  return {};
}

}  // namespace

absl::StatusOr<std::unique_ptr<ControlSocket>> ControlSocket::Start(const std::string& path,
                                                                    grpc::Server* server,
                                                                    int max_connections) {
  auto fd = ListenUnix(path, SOCK_STREAM);
  if (!fd.ok()) return fd.status();
  std::unique_ptr<ControlSocket> s(new ControlSocket(*fd, server, max_connections));
  s->acceptor_ = std::thread([p = s.get()] { p->AcceptLoop(); });
  pthread_setname_np(s->acceptor_.native_handle(), "ciuic-ctl-accept");
  return s;
}

ControlSocket::~ControlSocket() { Shutdown(); }

void ControlSocket::Shutdown() {
  if (stopping_.exchange(true)) return;
  // Wakes the acceptor out of accept().
  ::shutdown(listen_fd_, SHUT_RDWR);
  if (acceptor_.joinable()) acceptor_.join();
  close(listen_fd_);
}

size_t ControlSocket::PruneClosedLocked() {
  for (auto it = connections_.begin(); it != connections_.end();) {
    struct stat st {};
    if (fstat(it->first, &st) != 0 || st.st_dev != it->second.dev ||
        st.st_ino != it->second.ino) {
      it = connections_.erase(it);
    } else {
      ++it;
    }
  }
  return connections_.size();
}

void ControlSocket::AcceptLoop() {
  while (!stopping_.load()) {
    int fd = accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
    if (fd < 0) {
      if (stopping_.load()) return;
      if (errno == EINTR || errno == ECONNABORTED) continue;
      if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM) {
        spdlog::error("accept on the control socket: {}; retrying", std::strerror(errno));
        std::this_thread::sleep_for(std::chrono::milliseconds(100));
        continue;
      }
      spdlog::error("accept on the control socket: {}; no more control connections",
                    std::strerror(errno));
      return;
    }
    ucred cred{};
    socklen_t len = sizeof(cred);
    struct stat st {};
    if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0 || fstat(fd, &st) != 0) {
      spdlog::warn("control connection refused: {}", std::strerror(errno));
      close(fd);
      continue;
    }
    {
      absl::MutexLock lock(&mu_);
      if (connections_.size() >= static_cast<size_t>(max_connections_) &&
          PruneClosedLocked() >= static_cast<size_t>(max_connections_)) {
        spdlog::warn("control connection of uid {} pid {} refused: {} connections open already",
                     cred.uid, cred.pid, max_connections_);
        close(fd);
        continue;
      }
      Connection& c = connections_[fd];
      c.caller = Caller{cred.uid, cred.gid, cred.pid, PeerGroups(fd)};
      c.dev = st.st_dev;
      c.ino = st.st_ino;
    }
    // gRPC owns the descriptor from here and closes it with the connection.
    grpc::AddInsecureChannelFromFd(server_, fd);
  }
}

std::optional<Caller> ControlSocket::CallerOf(const std::string& peer) const {
  if (!absl::StartsWith(peer, kPeerPrefix)) return std::nullopt;
  int fd = -1;
  const char* begin = peer.data() + sizeof(kPeerPrefix) - 1;
  const char* end = peer.data() + peer.size();
  auto [ptr, ec] = std::from_chars(begin, end, fd);
  if (ec != std::errc() || ptr != end || fd < 0) return std::nullopt;
  absl::MutexLock lock(&mu_);
  auto it = connections_.find(fd);
  if (it == connections_.end()) return std::nullopt;
  struct stat st {};
  if (fstat(fd, &st) != 0 || st.st_dev != it->second.dev || st.st_ino != it->second.ino) {
    return std::nullopt;
  }
  return it->second.caller;
}

}  // namespace ciuic::daemon
