// The session acceptor: a trainer connects to the session socket, proves
// who it is (SO_PEERCRED) and gets its shared memory and rings; the loop
// closes sessions. Part of Engine (engine_state.h).
#include "engine/engine_state.h"

#include <fcntl.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <future>

#include "absl/strings/str_cat.h"
#include "cuda/device_runner.h"
#include "spdlog/spdlog.h"

namespace ciuic::daemon {

// ---------------------------------------------------------------- sessions

void Engine::AcceptLoop() {
  while (true) {
    int fd = accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
    if (fd < 0) {
      if (errno == EINTR || errno == ECONNABORTED) continue;
      if (shutdown_started_.load()) return;
      if (errno == EMFILE || errno == ENFILE) {
        spdlog::error("accept on session socket: {}; retrying", std::strerror(errno));
        std::this_thread::sleep_for(std::chrono::milliseconds(100));
        continue;
      }
      return;
    }
    HandshakeOnAcceptor(fd);
  }
}

void Engine::HandshakeOnAcceptor(int fd) {
  wire::HelloReply reply{};
  reply.magic = wire::kSessionMagic;
  auto refuse = [&](absl::Status s) {
    spdlog::warn("session refused: {}", s.ToString());
    reply.status_code = static_cast<int>(s.code());
    reply.message_len =
        static_cast<uint32_t>(wire::ClipMessage(s.message().data(), s.message().size(),
                                                reply.message));
    (void)SendWithFds(fd, &reply, sizeof(reply), nullptr, 0);
    close(fd);
  };

  timeval tv{5, 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
  auto peer = GetPeerCredentials(fd);
  if (!peer.ok()) return refuse(peer.status());
  wire::HelloRequest hello{};
  // Plain recv: any fds a client attaches are dropped by the kernel.
  ssize_t n = recv(fd, &hello, sizeof(hello), 0);
  if (n != static_cast<ssize_t>(sizeof(hello)) || hello.magic != wire::kSessionMagic) {
    return refuse(absl::InvalidArgumentError("bad session hello (not a ciuic SDK?)"));
  }
  if (hello.version != wire::kLayoutVersion) {
    return refuse(absl::FailedPreconditionError(absl::StrCat(
        "SDK speaks shared-memory layout ", hello.version, ", this ciuicd speaks ",
        wire::kLayoutVersion)));
  }
  if (hello.arena_bytes == 0 || hello.arena_bytes > options_.max_arena_bytes) {
    return refuse(absl::ResourceExhaustedError(absl::StrCat(
        "session arena of ", hello.arena_bytes, " bytes asked; this ciuicd allows 1 to ",
        options_.max_arena_bytes, " bytes per session (max_arena_bytes)")));
  }
  // Counted before the arena is mapped and pre-faulted.
  auto reserved = limits_->Reserve(peer->uid, hello.arena_bytes);
  if (!reserved.ok()) return refuse(reserved.status());
  auto memory = SessionMemory::Create(hello.arena_bytes);
  if (!memory.ok()) return refuse(memory.status());
  int bell = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  if (bell < 0) return refuse(Errno("eventfd"));

  auto session = std::make_shared<Session>();
  session->reserved = std::move(*reserved);
  session->peer = *peer;
  session->sock_fd = fd;
  session->doorbell_fd = bell;
  session->memory = std::move(*memory);
  wire::SessionHeader* h = session->memory->header();
  session->sq.emplace(h, session->memory->submissions(), h->sq_capacity);
  session->cq.emplace(h, session->memory->completions(), h->cq_capacity);
  session->token.resize(wire::kTokenBytes);
  if (getrandom(session->token.data(), session->token.size(), 0) !=
      static_cast<ssize_t>(session->token.size())) {
    session->sock_fd = -1;  // refuse() closes it
    return refuse(Errno("getrandom"));
  }
  std::memcpy(reply.token, session->token.data(), wire::kTokenBytes);
  reply.memfd_bytes = session->memory->size();

  // Register before replying, so a Join that follows the reply finds it.
  auto registered = std::make_shared<std::promise<uint64_t>>();
  std::future<uint64_t> id = registered->get_future();
  Post([this, session, registered] {
    if (stopping_) {
      registered->set_value(0);
      return;
    }
    session->id = next_session_id_++;
    sessions_[session->id] = session;
    sessions_by_token_[session->token] = session;
    epoll_event ev{};
    ev.events = EPOLLIN | EPOLLRDHUP;
    ev.data.u64 = Tag(session->id, kSock);
    epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, session->sock_fd, &ev);
    ev.events = EPOLLIN;
    ev.data.u64 = Tag(session->id, kBell);
    epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, session->doorbell_fd, &ev);
    registered->set_value(session->id);
  });
  reply.session_id = id.get();
  if (reply.session_id == 0) {
    session->sock_fd = -1;
    return refuse(absl::UnavailableError("ciuicd is shutting down"));
  }
  int fds[2] = {session->memory->fd(), bell};
  absl::Status sent = SendWithFds(fd, &reply, sizeof(reply), fds, 2);
  if (!sent.ok()) {
    Post([this, session, sent] { CloseSessionOnLoop(session, sent.ToString()); });
    return;
  }
  spdlog::info("session {} opened: uid {} pid {}, arena {} bytes", reply.session_id,
               peer->uid, peer->pid, session->memory->data_bytes());
}

void Engine::CloseSessionOnLoop(const std::shared_ptr<Session>& session, const std::string& why) {
  if (session->closed) return;
  session->closed = true;
  {
    std::lock_guard<std::mutex> lock(session->cq_mu);
    session->cq_closed = true;  // no thread writes its ring from here on
  }
  epoll_ctl(epoll_fd_, EPOLL_CTL_DEL, session->sock_fd, nullptr);
  epoll_ctl(epoll_fd_, EPOLL_CTL_DEL, session->doorbell_fd, nullptr);
  sessions_.erase(session->id);
  sessions_by_token_.erase(session->token);
  spdlog::info("session {} (pid {}) closed: {}", session->id, session->peer.pid, why);
  if (device_runner_) device_runner_->CloseSession(session->id);
  if (!session->job_key.empty()) {
    auto it = jobs_.find(session->job_key);
    if (it != jobs_.end()) {
      Job& job = *it->second;
      job.ranks.erase(session->rank);
      FailJobOnLoop(job, absl::AbortedError(absl::StrCat(
                             "rank ", session->rank, " (pid ", session->peer.pid, ") of job '",
                             job.id, "' left: ", why)));
      if (job.ranks.empty()) EraseJobOnLoop(job.key);
    }
  }
  // The fds close with the last reference (running operations may hold one).
}

}  // namespace ciuic::daemon
