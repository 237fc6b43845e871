#include "engine/engine.h"

#include <fcntl.h>
#include <sched.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <future>
#include <map>
#include <optional>
#include <system_error>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "ciuic/collective_rules.h"
#include "collectives/local.h"
#include "collectives/op.h"
#include "cuda/device_runner.h"
#include "engine/op_matcher.h"
#include "engine/session_limits.h"
#include "engine/worker_pool.h"
#include "shm/fast_path_segment.h"
#include "shm/rings.h"
#include "shm/session_memory.h"
#include "shm/session_socket.h"
#include "spdlog/spdlog.h"

namespace ciuic::daemon {

using Clock = std::chrono::steady_clock;

// One trainer's data-plane session. Owned by the loop (sessions_); running
// operations keep a reference so that the memory they read and write stays
// mapped if the trainer dies under them.
struct Session {
  uint64_t id = 0;
  PeerCredentials peer;
  int sock_fd = -1;
  int doorbell_fd = -1;
  std::string token;
  std::shared_ptr<SessionMemory> memory;
  std::optional<SubmissionReader> sq;
  std::optional<CompletionWriter> cq;
  bool closed = false;
  std::string job_key;  // empty until joined
  int rank = -1;
  uint32_t outstanding = 0;  // submitted, not yet completed
  // This session's share of the uid's limits, given back when the session
  // (and so its memory) goes.
  std::unique_ptr<SessionLimits::Ticket> reserved;

  ~Session() {
    if (sock_fd >= 0) close(sock_fd);
    if (doorbell_fd >= 0) close(doorbell_fd);
  }
};

// One rank's part in an operation.
struct RankPart {
  std::shared_ptr<Session> session;
  ValidatedOp op;
};

// An operation of a job on this node. The fields up to `failure` are the
// matcher's (op_matcher.h).
struct PendingOp {
  std::string name;
  OpSignature sig;
  int32_t priority = 0;
  Clock::time_point first_submit;
  Clock::time_point deadline;
  std::vector<std::optional<RankPart>> parts;  // by rank
  std::vector<bool> seen;                      // ranks that submitted this name
  int seen_count = 0;
  int submitted = 0;
  absl::Status failure;  // set: poisoned, later submitters get it at once
  uint64_t seq = 0;
  // Device buffers in a multi-node job: the node buffer on the GPU, which
  // the ClusterJob stages through host memory.
  std::shared_ptr<StagedNodeBuffer> staged;
  OpRecord trace;  // for `ciuicctl trace`
  // alltoallv in a multi-node job whose local ranks' counts disagree: the
  // coordinator fails it on every node with this.
  std::string splits_error;
  // While running:
  std::unique_ptr<LocalCollective> collective;
  std::atomic<size_t> chunks_left{0};
};

struct Job {
  std::string key;
  std::string id;
  uid_t uid = 0;
  int world_size = 0;
  int local_size = 0;
  std::string coordinator;               // multi-node jobs only
  std::unique_ptr<ClusterJob> cluster;   // multi-node jobs, once all local ranks joined
  std::unique_ptr<FastPathSegment> fast;  // single-node jobs with fast_path_bytes > 0
  std::map<uint64_t, std::shared_ptr<PendingOp>> in_cluster;  // handed to `cluster`
  uint64_t next_cluster_key = 1;
  uint64_t next_trace_seq = 0;  // OpRecord::job_seq
  std::map<int, std::shared_ptr<Session>> ranks;
  absl::Status failure;  // sticky once set
  // The operations some local rank submitted that have not launched.
  std::optional<OpMatcher<PendingOp, RankPart>> matcher;
  uint64_t ops_completed = 0;
  uint64_t ops_failed = 0;
  uint64_t bytes = 0;
  std::array<uint64_t, kOpDurationBuckets> duration_counts{};  // EngineStatus::JobRow's
  double duration_sum_seconds = 0;
  // Per local rank: how late it submits after the node's first rank, a
  // moving average (EngineStatus::JobRow::rank_skew_seconds).
  std::map<int, double> skew_seconds;
};

namespace {

// The weight of the newest operation in a rank's moving skew: about the
// last ten operations count.
constexpr double kSkewWeight = 0.1;

void RecordSkew(Job& job, const OpRecord& trace) {
  if (job.local_size < 2 || trace.arrivals.empty()) return;
  for (const OpRecord::Arrival& a : trace.arrivals) {
    const double late = std::chrono::duration<double>(a.at - trace.submitted).count();
    auto [it, first] = job.skew_seconds.emplace(a.rank, late);
    if (!first) it->second += kSkewWeight * (late - it->second);
  }
}

}  // namespace

namespace {

std::string JobKey(uid_t uid, const std::string& id) { return absl::StrCat(uid, "/", id); }

// The larger of a rank's buffers for `sig` (what status counts as bytes).
uint64_t OpBytes(const OpSignature& sig, int world_size) {
  const wire::RankBytes b = wire::RankBytesOf(static_cast<wire::Collective>(sig.collective),
                                              sig.count * sig.element_bytes(), world_size, 0, 0);
  return std::max(b.send, b.recv);
}

// The device buffers of `op`'s local ranks, in rank order.
std::vector<DeviceRankBuffers> DeviceRanksOf(const PendingOp& op) {
  std::vector<DeviceRankBuffers> ranks;
  for (const auto& part : op.parts) {
    if (!part) continue;
    DeviceRankBuffers b;
    b.session_id = part->session->id;
    b.uid = part->session->peer.uid;
    b.rank = part->session->rank;
    b.send_bytes = part->op.send_bytes;
    b.recv_bytes = part->op.recv_bytes;
    b.send = part->op.send_device;
    b.recv = part->op.recv_device;
    b.send_counts = part->op.send_counts;
    b.recv_counts = part->op.recv_counts;
    ranks.push_back(std::move(b));
  }
  return ranks;
}

absl::Status Named(const PendingOp& op, const absl::Status& s) {
  if (s.ok()) return s;
  return absl::Status(s.code(), absl::StrCat("operation '", op.name, "': ", s.message()));
}

absl::Status Errno(absl::string_view what) {
  return absl::InternalError(absl::StrCat(what, ": ", std::strerror(errno)));
}

// Ring polls per spinning round before the loop looks at its sockets.
constexpr int kFastPolls = 512;
// How long the loop polls after handing an operation to a multi-node job:
// a small one comes back within about this (8 bytes between two nodes:
// ~130 us here), and its completion then costs no wakeup.
constexpr auto kClusterSpin = std::chrono::microseconds(300);
constexpr int kYieldMask = 3;
// Fairness between sessions: one pass of the loop takes at most this many
// submissions from each session's ring, and the spinning poll hands over to
// a full pass (posted closures, sockets, deadlines) after this many rounds
// that found work, so that a trainer that keeps its ring full cannot starve
// the others or the loop's own work.
constexpr int kSubmissionsPerPass = 32;
constexpr int kBusyRoundsPerPass = 16;

// epoll data: low 2 bits say which fd of which session woke us.
enum : uint64_t { kWake = 0, kSock = 1, kBell = 2 };
uint64_t Tag(uint64_t session_id, uint64_t kind) { return session_id << 2 | kind; }

}  // namespace

Engine::Engine(const Options& options) : options_(options) {}

absl::StatusOr<std::unique_ptr<Engine>> Engine::Start(const Options& options) {
  if (options.tuning == nullptr) return absl::InvalidArgumentError("Engine needs a config::TuningRegistry");
  std::unique_ptr<Engine> e(new Engine(options));
  auto listen_fd = ListenSeqpacket(options.session_socket_path);
  if (!listen_fd.ok()) return listen_fd.status();
  e->listen_fd_ = *listen_fd;
  e->epoll_fd_ = epoll_create1(EPOLL_CLOEXEC);
  if (e->epoll_fd_ < 0) return Errno("epoll_create1");
  e->wake_fd_ = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  if (e->wake_fd_ < 0) return Errno("eventfd");
  epoll_event ev{};
  ev.events = EPOLLIN;
  ev.data.u64 = Tag(0, kWake);
  epoll_ctl(e->epoll_fd_, EPOLL_CTL_ADD, e->wake_fd_, &ev);
  e->workers_ = std::make_unique<WorkerPool>(std::max(1, options.worker_threads));
  e->limits_ = std::make_unique<SessionLimits>(SessionLimits::Limits{
      options.max_sessions, options.max_sessions_per_uid, options.max_arena_bytes_total,
      options.max_arena_bytes_per_uid});
  e->loop_ = std::thread([p = e.get()] { p->Loop(); });
  pthread_setname_np(e->loop_.native_handle(), "ciuic-loop");
  e->acceptor_ = std::thread([p = e.get()] { p->AcceptLoop(); });
  pthread_setname_np(e->acceptor_.native_handle(), "ciuic-accept");
  return e;
}

Engine::~Engine() {
  Shutdown();
  if (epoll_fd_ >= 0) close(epoll_fd_);
  if (wake_fd_ >= 0) close(wake_fd_);
}

void Engine::Post(std::function<void()> fn) {
  {
    absl::MutexLock lock(&post_mu_);
    if (loop_exited_) {
      fn();
      return;
    }
    posted_.push_back(std::move(fn));
    posted_count_.fetch_add(1);  // seq_cst: pairs with loop_blocking_ (Loop)
  }
  // A spinning loop sees posted_count_ by itself: the eventfd (a write here,
  // a wakeup and a read there) only for one that may block in epoll_wait.
  if (loop_blocking_.load()) {
    uint64_t one = 1;
    (void)!write(wake_fd_, &one, sizeof(one));
  }
}

template <typename T>
T Engine::RunOnLoop(std::function<T()> fn) {
  auto promise = std::make_shared<std::promise<T>>();
  std::future<T> result = promise->get_future();
  Post([promise, fn = std::move(fn)] {
    try {
      promise->set_value(fn());
    } catch (...) {  // std::bad_alloc and the like: the caller's, not the loop's
      promise->set_exception(std::current_exception());
    }
  });
  return result.get();
}

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
    const size_t n = std::min(s.message().size(), wire::kMaxMessage);
    std::memcpy(reply.message, s.message().data(), n);
    reply.message_len = static_cast<uint32_t>(n);
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

// -------------------------------------------------------------------- join

absl::Status Engine::Join(const JoinRequest& request, uint64_t* fast_path_bytes) {
  uid_t uid = 0;
  uint64_t fast = 0;
  // Off the loop: the check may wait on name resolution.
  if (options_.check_coordinator && request.local_size != request.world_size &&
      !request.coordinator.empty()) {
    if (absl::Status allowed = options_.check_coordinator(request.coordinator); !allowed.ok()) {
      spdlog::warn("rank {} of job '{}' refused: {}", request.rank, request.job_id,
                   std::string(allowed.message()));
      return allowed;
    }
  }
  absl::Status s;
  try {
    s = RunOnLoop<absl::Status>([&] { return JoinOnLoop(request, &uid, &fast); });
  } catch (const std::exception& e) {
    // Out of memory or threads: this join fails, the daemon goes on.
    s = absl::ResourceExhaustedError(absl::StrCat("joining job '", request.job_id, "': ", e.what()));
    spdlog::error("{}", std::string(s.message()));
  }
  if (fast_path_bytes != nullptr) *fast_path_bytes = s.ok() ? fast : 0;
  if (s.ok()) {
    spdlog::info("rank {}/{} (local {}/{}) of job '{}' (uid {}) joined", request.rank,
                 request.world_size, request.local_rank, request.local_size, request.job_id,
                 uid);
  }
  return s;
}

absl::Status Engine::JoinOnLoop(const JoinRequest& r, uid_t* uid_out, uint64_t* fast_out) {
  if (stopping_) return absl::UnavailableError("ciuicd is shutting down");
  auto sit = sessions_by_token_.find(r.session_token);
  if (sit == sessions_by_token_.end()) {
    return absl::UnauthenticatedError(
        "unknown session token: open a session on the session socket first");
  }
  Session& session = *sit->second;
  *uid_out = session.peer.uid;
  if (r.caller_uid && *r.caller_uid != session.peer.uid) {
    return absl::PermissionDeniedError(absl::StrCat("the session belongs to uid ", session.peer.uid,
                                                    ", not to the caller's uid ", *r.caller_uid));
  }
  if (!session.job_key.empty()) {
    return absl::FailedPreconditionError(
        absl::StrCat("this session already joined a job as rank ", session.rank));
  }
  if (r.job_id.empty() || r.job_id.size() > 256) {
    return absl::InvalidArgumentError("job id must be 1 to 256 bytes");
  }
  if (r.world_size < 1 || r.rank < 0 || r.rank >= r.world_size) {
    return absl::InvalidArgumentError(
        absl::StrCat("rank ", r.rank, " is not in a world of size ", r.world_size));
  }
  if (static_cast<uint64_t>(r.world_size) > options_.max_world_size) {
    return absl::InvalidArgumentError(absl::StrCat("world size ", r.world_size,
                                                   " is over this ciuicd's limit of ",
                                                   options_.max_world_size,
                                                   " ranks (max_world_size)"));
  }
  if (r.local_size < 1 || r.local_size > r.world_size || r.local_rank < 0 ||
      r.local_rank >= r.local_size) {
    return absl::InvalidArgumentError(absl::StrCat("local rank ", r.local_rank, " of local size ",
                                                   r.local_size, " does not fit world size ",
                                                   r.world_size));
  }
  if (static_cast<uint64_t>(r.local_size) > options_.max_sessions_per_uid) {
    return absl::InvalidArgumentError(absl::StrCat(
        "local size ", r.local_size, " is over the ", options_.max_sessions_per_uid,
        " sessions one uid may open on this ciuicd (max_sessions_per_uid)"));
  }
  const bool multi_node = r.local_size != r.world_size;
  if (multi_node && r.coordinator.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "job '", r.job_id, "' spans several nodes (world size ", r.world_size, ", local size ",
        r.local_size, ") but names no coordinator (CIUIC_COORDINATOR=host:port, or "
        "MASTER_ADDR and MASTER_PORT)"));
  }
  if (multi_node && (!options_.transports || !options_.coordinator_clients)) {
    return absl::UnimplementedError("this ciuicd has no inter-node transport");
  }
  const std::string key = JobKey(session.peer.uid, r.job_id);
  if (jobs_.count(key) == 0) {
    uint32_t mine = 0;
    for (const auto& [k, j] : jobs_) mine += j->uid == session.peer.uid;
    if (mine >= options_.max_jobs_per_uid) {
      return absl::ResourceExhaustedError(
          absl::StrCat("uid ", session.peer.uid, " has ", mine,
                       " jobs on this ciuicd, the most one uid may (max_jobs_per_uid)"));
    }
  }
  auto& slot = jobs_[key];
  if (!slot) {
    slot = std::make_unique<Job>();
    slot->key = key;
    slot->id = r.job_id;
    slot->uid = session.peer.uid;
    slot->world_size = r.world_size;
    slot->local_size = r.local_size;
    slot->matcher.emplace(r.world_size, r.local_size);
    const config::Tuning tuning = options_.tuning->Snapshot();
    if (!multi_node && tuning.fast_path_bytes > 0) {
      // Fixed here for the job's life, so that every rank routes alike.
      auto fast = FastPathSegment::Create(static_cast<uint32_t>(r.world_size),
                                          tuning.fast_path_bytes, tuning.op_timeout_ms);
      if (fast.ok()) {
        slot->fast = std::move(*fast);
      } else {
        spdlog::info("job '{}' runs without a fast path: {}", r.job_id,
                     std::string(fast.status().message()));
      }
    }
  }
  Job& job = *slot;
  if (job.ranks.empty()) job.coordinator = multi_node ? r.coordinator : "";
  auto drop_if_empty = [&] {
    if (job.ranks.empty()) jobs_.erase(key);
  };
  if (multi_node && job.coordinator != r.coordinator) {
    absl::Status s = absl::InvalidArgumentError(absl::StrCat(
        "job '", r.job_id, "' has coordinator ", job.coordinator, "; rank ", r.rank, " says ",
        r.coordinator));
    drop_if_empty();
    return s;
  }
  if (job.world_size != r.world_size || job.local_size != r.local_size) {
    absl::Status s = absl::InvalidArgumentError(absl::StrCat(
        "job '", r.job_id, "' has world size ", job.world_size, " and local size ",
        job.local_size, "; rank ", r.rank, " says ", r.world_size, " and ", r.local_size));
    drop_if_empty();
    return s;
  }
  if (!job.failure.ok()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "job '", r.job_id, "' failed (", job.failure.message(),
        "); start it again once all its ranks have exited"));
  }
  if (auto it = job.ranks.find(r.rank); it != job.ranks.end()) {
    return absl::AlreadyExistsError(absl::StrCat("rank ", r.rank, " of job '", r.job_id,
                                                 "' is already joined by pid ",
                                                 it->second->peer.pid));
  }
  if (job.fast) {
    // The segment goes out before the JoinJob reply, so the SDK finds it
    // waiting on its session socket once the reply says it is there.
    wire::FastPathHello hello{};
    hello.magic = wire::kFastPathMagic;
    hello.segment_bytes = job.fast->size();
    hello.payload_bytes = job.fast->payload_bytes();
    const int fd = job.fast->fd();
    absl::Status sent = SendWithFds(session.sock_fd, &hello, sizeof(hello), &fd, 1);
    if (!sent.ok()) {
      drop_if_empty();
      return sent;
    }
    *fast_out = job.fast->payload_bytes();
  }
  job.ranks[r.rank] = sit->second;
  session.job_key = key;
  session.rank = r.rank;
  if (multi_node && static_cast<int>(job.ranks.size()) == job.local_size) {
    try {
      StartClusterOnLoop(job);
    } catch (const std::exception& e) {  // no memory or no thread for it: this job fails
      job.cluster.reset();
      FailJobOnLoop(job, absl::ResourceExhaustedError(absl::StrCat(
                             "job '", job.id, "' cannot start its inter-node part: ", e.what())));
    }
  }
  return absl::OkStatus();
}

void Engine::StartClusterOnLoop(Job& job) {
  ClusterJob::Options o;
  o.job_id = job.id;
  o.uid = job.uid;
  o.world_size = job.world_size;
  for (auto& [rank, s] : job.ranks) o.local_ranks.push_back(rank);
  o.node_name = options_.node_name;
  o.rack = options_.rack;
  // The local phase's reductions share the node's workers, in this job's
  // turn (WorkerPool serves jobs round robin).
  o.parallel = [pool = workers_.get(), key = job.key](
                   size_t n, const std::function<void(size_t)>& body) {
    pool->ParallelFor(key, 0, n, body);
  };
  o.coordinator = job.coordinator;
  o.channels = options_.channels > 0 ? options_.channels
                                     : static_cast<int>(options_.tuning->Snapshot().channels);
  o.tuning = options_.tuning;
  o.transports = options_.transports;
  o.coordinator_clients = options_.coordinator_clients;
  o.local_coordinator = options_.local_coordinator;
  const std::string key = job.key;
  job.cluster = std::make_unique<ClusterJob>(
      std::move(o),
      [this, key](uint64_t op_key, absl::Status s) {
        Post([this, key, op_key, s] { ClusterDoneOnLoop(key, op_key, s); });
      },
      [this, key](absl::Status s) {
        Post([this, key, s] {
          auto it = jobs_.find(key);
          if (it != jobs_.end()) FailJobOnLoop(*it->second, s);
        });
      });
}

void Engine::ClusterDoneOnLoop(const std::string& job_key, uint64_t op_key,
                               const absl::Status& status) {
  auto it = jobs_.find(job_key);
  if (it == jobs_.end()) return;
  Job& job = *it->second;
  auto op = job.in_cluster.find(op_key);
  if (op == job.in_cluster.end()) return;
  std::shared_ptr<PendingOp> p = std::move(op->second);
  job.in_cluster.erase(op);
  --running_ops_;
  FinishOnLoop(job_key, *p, status);
}

void Engine::EraseJobOnLoop(const std::string& key) {
  auto it = jobs_.find(key);
  if (it == jobs_.end()) return;
  running_ops_ -= static_cast<int>(it->second->in_cluster.size());
  if (it->second->cluster) {
    // Its destructor waits for its threads: not on the loop.
    for (auto r = reapers_.begin(); r != reapers_.end();) {
      if (r->done->load()) {
        r->thread.join();
        r = reapers_.erase(r);
      } else {
        ++r;
      }
    }
    auto done = std::make_shared<std::atomic<bool>>(false);
    try {
      // The operations still in the job keep their ranks' sessions, and so
      // the shared memory that lanes and UCX threads may still be reading
      // or writing, mapped until the job's threads have ended.
      std::thread t([cluster = std::move(it->second->cluster),
                     ops = std::move(it->second->in_cluster), done]() mutable {
        cluster.reset();
        ops.clear();
        done->store(true);
      });
      reapers_.push_back(Reaper{std::move(t), std::move(done)});
    } catch (const std::system_error& e) {
      // No thread to spare: the job's threads are ended here, on the loop.
      spdlog::warn("no thread to end job '{}' apart ({}): ending it on the loop",
                   it->second->id, e.what());
    }
  }
  if (device_runner_) device_runner_->EndJob(key);
  if (it->second->fast) {  // the totals keep what the job did on its fast path
    const FastPathSegment::Counters c = it->second->fast->ReadCounters();
    ops_completed_ += c.ops_completed;
    ops_failed_ += c.ops_failed;
    bytes_ += c.bytes;
  }
  jobs_.erase(it);
}

// -------------------------------------------------------------------- loop

bool Engine::RunPostedOnLoop() {
  if (posted_count_.load(std::memory_order_acquire) == 0) return false;
  std::vector<std::function<void()>> batch;
  {
    absl::MutexLock lock(&post_mu_);
    batch.swap(posted_);
    posted_count_.store(0, std::memory_order_relaxed);
  }
  for (auto& fn : batch) fn();
  return !batch.empty();
}

bool Engine::AnySubmissionPendingOnLoop() {
  for (auto& [id, s] : sessions_) {
    if (s->sq->HasPending()) return true;
  }
  return false;
}

void Engine::ArmDoorbellsOnLoop(bool armed) {
  for (auto& [id, s] : sessions_) {
    s->memory->header()->daemon_armed.store(armed ? 1 : 0, std::memory_order_seq_cst);
  }
}

bool Engine::PollSubmissionsOnLoop() {
  bool worked = false;
  // Copy: handling a submission may close sessions.
  std::vector<std::shared_ptr<Session>>& ready = ready_scratch_;
  ready.clear();
  for (auto& [id, s] : sessions_) {
    if (s->sq->HasPending()) ready.push_back(s);
  }
  if (ready.empty()) return false;
  for (auto& s : ready) {
    wire::SubmissionEntry entry;
    for (int taken = 0; taken < kSubmissionsPerPass && !s->closed; ++taken) {
      auto got = s->sq->Pop(&entry);
      if (!got.ok()) {
        CloseSessionOnLoop(s, got.status().ToString());
        break;
      }
      if (!*got) break;
      worked = true;
      if (s->outstanding >= s->cq->capacity()) {  // ciuicd's copy, not the trainer's
        CloseSessionOnLoop(s, "more operations in flight than the completion ring holds");
        break;
      }
      ++s->outstanding;
      try {
        SubmitOnLoop(s, entry);
      } catch (const std::exception& e) {  // out of memory: this operation fails
        spdlog::error("session {}: submission refused: {}", s->id, e.what());
        CompleteOnLoop(*s, entry.op_id,
                       absl::ResourceExhaustedError(absl::StrCat("ciuicd: ", e.what())));
      }
    }
  }
  ready.clear();
  return worked;
}

void Engine::Loop() {
  std::vector<epoll_event> events(64);
  Clock::time_point last_work = Clock::now();
  bool armed = false;
  while (true) {
    const config::Tuning tuning = options_.tuning->Snapshot();
    int timeout_ms = 0;
    const Clock::time_point now = Clock::now();
    const bool spinning = now - last_work < std::chrono::microseconds(tuning.spin_us) ||
                          (running_ops_ > 0 && now - cluster_handoff_ < kClusterSpin);
    if (spinning) {
      // The latency path: poll the rings alone for a while; socket events,
      // posted closures and deadlines are looked at between rounds.
      int busy_rounds = 0;
      for (int i = 0; i < kFastPolls; ++i) {
        if (PollSubmissionsOnLoop()) {
          last_work = Clock::now();
          if (++busy_rounds == kBusyRoundsPerPass) break;
          i = 0;
          continue;
        }
        if (posted_count_.load(std::memory_order_relaxed) != 0) break;
        wire::CpuRelax();
        if ((i & kYieldMask) == kYieldMask) sched_yield();  // let a trainer on this core run
      }
    } else {
      ArmDoorbellsOnLoop(true);
      armed = true;
      std::atomic_thread_fence(std::memory_order_seq_cst);
      if (AnySubmissionPendingOnLoop()) {
        timeout_ms = 0;
      } else {
        bool any_pending = false;
        for (auto& [key, job] : jobs_) {
          any_pending |= !job->matcher->empty() || !job->in_cluster.empty();
        }
        timeout_ms = any_pending ? 100 : -1;
      }
      // About to block: from here Post wakes the loop. A closure posted
      // before this store is seen below (both seq_cst), one after it writes
      // the eventfd.
      loop_blocking_.store(true);
      if (posted_count_.load() != 0) timeout_ms = 0;
    }
    int n = epoll_wait(epoll_fd_, events.data(), static_cast<int>(events.size()), timeout_ms);
    loop_blocking_.store(false, std::memory_order_relaxed);
    if (armed) {
      ArmDoorbellsOnLoop(false);
      armed = false;
    }
    for (int i = 0; i < n; ++i) {
      const uint64_t tag = events[i].data.u64;
      const uint64_t kind = tag & 3;
      if (kind == kWake) {
        uint64_t v;
        (void)!read(wake_fd_, &v, sizeof(v));
        continue;
      }
      auto it = sessions_.find(tag >> 2);
      if (it == sessions_.end()) continue;
      std::shared_ptr<Session> s = it->second;
      if (kind == kBell) {
        uint64_t v;
        (void)!read(s->doorbell_fd, &v, sizeof(v));
      } else {
        char byte;
        ssize_t got = recv(s->sock_fd, &byte, 1, MSG_DONTWAIT);
        if (got == 0 || (events[i].events & (EPOLLHUP | EPOLLRDHUP | EPOLLERR))) {
          CloseSessionOnLoop(s, "trainer disconnected");
        } else if (got > 0) {
          CloseSessionOnLoop(s, "unexpected data on the session socket");
        }
      }
    }
    bool worked = RunPostedOnLoop();
    worked |= PollSubmissionsOnLoop();
    CheckDeadlinesOnLoop();
    if (worked) last_work = Clock::now();
    if (stopping_ && running_ops_ == 0) break;
  }
  // Drained: close what is left, answer what was posted meanwhile.
  std::vector<std::shared_ptr<Session>> left;
  for (auto& [id, s] : sessions_) left.push_back(s);
  for (auto& s : left) CloseSessionOnLoop(s, "ciuicd is shutting down");
  absl::MutexLock lock(&post_mu_);
  loop_exited_ = true;
  for (auto& fn : posted_) fn();
  posted_.clear();
}

// ------------------------------------------------------------- operations

void Engine::CompleteOnLoop(Session& session, uint64_t op_id, const absl::Status& status) {
  if (session.closed) return;
  if (session.outstanding > 0) --session.outstanding;
  absl::Status pushed =
      session.cq->Push(op_id, static_cast<int>(status.code()), status.message());
  if (!pushed.ok()) {
    auto it = sessions_.find(session.id);
    if (it != sessions_.end()) CloseSessionOnLoop(it->second, pushed.ToString());
  }
}

void Engine::SubmitOnLoop(const std::shared_ptr<Session>& s, const wire::SubmissionEntry& entry) {
  auto job_it = jobs_.find(s->job_key);
  if (s->job_key.empty() || job_it == jobs_.end()) {
    ++ops_failed_;
    return CompleteOnLoop(*s, entry.op_id,
                          absl::FailedPreconditionError("the session has not joined a job"));
  }
  Job& job = *job_it->second;
  if (!job.failure.ok()) {
    ++ops_failed_;
    ++job.ops_failed;
    return CompleteOnLoop(*s, entry.op_id, job.failure);
  }
  auto valid = ValidateSubmission(entry, *s->memory, job.world_size, s->rank);
  if (!valid.ok()) {
    ++ops_failed_;
    ++job.ops_failed;
    spdlog::warn("job '{}' rank {}: rejected submission: {}", job.id, s->rank,
                 std::string(valid.status().message()));
    return CompleteOnLoop(*s, entry.op_id, valid.status());
  }
  ValidatedOp& v = *valid;
  const Clock::time_point now = Clock::now();
  const uint32_t timeout_ms =
      v.timeout_ms != 0 ? v.timeout_ms : options_.tuning->Snapshot().op_timeout_ms;

  const int rank = s->rank;
  const uint64_t op_id = v.op_id;
  const std::string name = v.name;
  const OpSignature sig = v.sig;
  const int32_t priority = v.priority;
  using Kind = OpMatcher<PendingOp, RankPart>::Submitted::Kind;
  auto got = job.matcher->Submit(
      rank, name, sig, priority, now, std::chrono::milliseconds(timeout_ms),
      RankPart{s, std::move(v)}, [&] {
        auto op = std::make_shared<PendingOp>();
        op->seq = next_op_seq_++;
        op->trace.uid = job.uid;
        op->trace.job_id = job.id;
        op->trace.name = name;
        op->trace.sig = sig;
        op->trace.bytes = OpBytes(sig, job.world_size);
        op->trace.submitted = now;
        op->trace.job_seq = job.next_trace_seq++;
        op->trace.world_size = job.world_size;
        op->trace.timeout_ms = timeout_ms;
        return op;
      });
  std::shared_ptr<PendingOp> op = std::move(got.op);
  switch (got.kind) {
    case Kind::kRefused:
      ++ops_failed_;
      ++job.ops_failed;
      return CompleteOnLoop(*s, op_id, got.status);
    case Kind::kMismatch: {
      spdlog::warn("job '{}': {}", job.id, std::string(got.status.message()));
      ++ops_failed_;
      ++job.ops_failed;
      CompleteOnLoop(*s, op_id, got.status);
      FailPendingOnLoop(job, *op, got.status);
      if (job.cluster) {
        // The other nodes' ranks must hear of it too, at once rather than at
        // the operation's deadline: the operation goes on without buffers,
        // carrying the mismatch (the coordinator fails it on every node; a
        // direct one fails everywhere through its exchange). Nobody here
        // waits for its end.
        ClusterOp c;
        c.key = job.next_cluster_key++;
        c.name = op->name;
        c.sig = op->sig;
        c.splits_error = absl::StrCat("rank ", got.other_rank, " submitted ", op->sig.ToString(),
                                      ", rank ", rank, " submitted ", sig.ToString());
        job.cluster->Submit(std::move(c));
      }
      return;
    }
    case Kind::kWaiting:
      op->trace.arrivals.push_back(OpRecord::Arrival{rank, now});
      return;
    case Kind::kLaunch:
      op->trace.arrivals.push_back(OpRecord::Arrival{rank, now});
      RecordSkew(job, op->trace);
      op->trace.launched = now;
      return LaunchOnLoop(job, std::move(op));
  }
}

void Engine::FailPendingOnLoop(Job& job, PendingOp& op, const absl::Status& status) {
  if (op.submitted > 0) {
    ++ops_failed_;
    ++job.ops_failed;
    RecordOnLoop(op, status);
  }
  for (RankPart& part : job.matcher->Fail(op, status)) {
    CompleteOnLoop(*part.session, part.op.op_id, status);
  }
}

void Engine::FailJobOnLoop(Job& job, const absl::Status& status) {
  if (job.failure.ok()) {
    job.failure = status;
    if (job.matcher->empty()) {
      spdlog::info("job '{}' ends: {}", job.id, std::string(status.message()));
    } else {
      spdlog::warn("job '{}' failed with {} operation(s) pending: {}", job.id,
                   job.matcher->pending().size(), std::string(status.message()));
    }
  }
  for (auto& op : job.matcher->TakeAll()) FailPendingOnLoop(job, *op, status);
  // Its device operations still waiting for their ranks' streams.
  if (device_runner_) device_runner_->FailJob(job.key, job.failure);
  if (job.fast) job.fast->Abort(job.failure);
  if (job.cluster) job.cluster->Abort(status);  // its operations come back failed
}

void Engine::CheckDeadlinesOnLoop() {
  const Clock::time_point now = Clock::now();
  // Operations handed to a multi-node job that has not formed yet: nobody
  // else times them out (after formation the coordinator does).
  std::vector<std::pair<std::string, uint64_t>> expired;
  for (auto& [key, job] : jobs_) {
    if (!job->cluster || job->in_cluster.empty() ||
        job->cluster->state() != ClusterJob::State::kForming) {
      continue;
    }
    for (auto& [op_key, op] : job->in_cluster) {
      if (now >= op->deadline) expired.emplace_back(key, op_key);
    }
  }
  for (auto& [key, op_key] : expired) {
    Job& job = *jobs_[key];
    // Only an operation the job has not taken up yet: one it has, it ends
    // itself. Its staged buffer goes (on the runner's thread: it may wait
    // for the device) before the ranks hear, so that nothing of it is left
    // to touch their buffers.
    std::optional<ClusterOp> back = job.cluster->TakeBackUnformed(op_key);
    if (!back) continue;
    if (back->staged && device_runner_) device_runner_->Dispose(std::move(back->staged));
    back.reset();
    ClusterDoneOnLoop(key, op_key, absl::DeadlineExceededError(absl::StrCat(
        "job '", job.id, "' has not formed: not every node has registered its ranks with the "
        "coordinator ", job.coordinator, " yet")));
  }
  for (auto& [key, job] : jobs_) {
    if (job->matcher->empty()) continue;
    std::vector<int> joined;
    for (auto& [r, session] : job->ranks) joined.push_back(r);
    for (auto& [op, s] : job->matcher->Expired(now, joined, job->id)) {
      spdlog::warn("{}", std::string(s.message()));
      FailPendingOnLoop(*job, *op, s);
    }
  }
}

void Engine::LaunchOnLoop(Job& job, std::shared_ptr<PendingOp> op) {
  const bool v_splits =
      op->sig.collective == static_cast<uint32_t>(wire::Collective::kAlltoallv);
  if (v_splits) {
    // The counts of this node's pairs (the coordinator checks the others').
    std::vector<int> local;
    std::vector<const std::vector<uint64_t>*> send_counts(job.world_size, nullptr);
    std::vector<const std::vector<uint64_t>*> recv_counts(job.world_size, nullptr);
    for (auto& part : op->parts) {
      if (!part) continue;
      const int r = part->session->rank;
      local.push_back(r);
      send_counts[r] = &part->op.send_counts;
      recv_counts[r] = &part->op.recv_counts;
      op->trace.bytes = std::max(op->trace.bytes, part->op.send_bytes);
    }
    absl::Status agree = AlltoallvMismatch(local, send_counts, recv_counts);
    if (!agree.ok()) {
      absl::Status mismatch = absl::InvalidArgumentError(absl::StrCat(
          "operation '", op->name, "' mismatched across ranks: ", agree.message()));
      spdlog::warn("job '{}': {}", job.id, std::string(mismatch.message()));
      if (!job.cluster) return FailPendingOnLoop(job, *op, mismatch);
      // The other nodes' ranks must hear of it too: through the coordinator.
      op->splits_error = std::string(agree.message());
    }
  }
  if (op->sig.device) return LaunchDeviceOnLoop(job, std::move(op));
  if (job.cluster) return SubmitToClusterOnLoop(job, std::move(op));
  const config::Tuning tuning = options_.tuning->Snapshot();  // fixed for this operation
  std::vector<const uint8_t*> send(job.world_size);
  std::vector<uint8_t*> recv(job.world_size);
  for (int r = 0; r < job.world_size; ++r) {
    send[r] = op->parts[r]->op.send;
    recv[r] = op->parts[r]->op.recv;
  }
  std::vector<std::vector<uint64_t>> send_counts;
  if (v_splits) {
    for (int r = 0; r < job.world_size; ++r) send_counts.push_back(op->parts[r]->op.send_counts);
  }
  op->collective = std::make_unique<LocalCollective>(op->sig, std::move(send), std::move(recv),
                                                     tuning.chunk_bytes, std::move(send_counts));
  const size_t chunks = op->collective->num_chunks();
  const uint64_t bytes = op->collective->payload_bytes();
  if (chunks <= 1 || bytes <= tuning.small_op_bytes || workers_->size() == 0) {
    for (size_t i = 0; i < chunks; ++i) op->collective->RunChunk(i);
    return FinishOnLoop(job.key, *op, absl::OkStatus());
  }
  ++running_ops_;
  op->chunks_left.store(chunks);
  for (size_t i = 0; i < chunks; ++i) {
    workers_->Submit(job.key, op->priority, [this, op, i, key = job.key] {
      op->collective->RunChunk(i);
      if (op->chunks_left.fetch_sub(1) == 1) {
        Post([this, op, key] {
          --running_ops_;
          FinishOnLoop(key, *op, absl::OkStatus());
        });
      }
    });
  }
}

// Hands `op` to the job's ClusterJob: the ranks' buffers, or (device
// buffers) the node buffer on the GPU, op->staged.
void Engine::SubmitToClusterOnLoop(Job& job, std::shared_ptr<PendingOp> op) {
  ClusterOp c;
  c.key = job.next_cluster_key++;
  c.name = op->name;
  c.sig = op->sig;
  c.priority = op->priority;
  c.staged = std::move(op->staged);  // the ClusterOp's alone: it goes with the run
  c.splits_error = op->splits_error;
  op->trace.cluster = std::make_shared<ClusterOp::Timing>();
  c.timing = op->trace.cluster;
  for (auto& part : op->parts) {
    if (!part) continue;
    if (c.staged) {  // the buffers are the staged buffer's; alltoallv's counts still count
      c.parts.push_back(ClusterOp::Part{part->session->rank, nullptr, nullptr,
                                        part->op.send_counts, part->op.recv_counts});
    } else {
      c.parts.push_back(ClusterOp::Part{part->session->rank, part->op.send, part->op.recv,
                                        part->op.send_counts, part->op.recv_counts});
    }
    if (part->op.timeout_ms) c.timeout_ms = part->op.timeout_ms;
  }
  c.deadline = op->deadline;  // one deadline from here on (ClusterOp::deadline)
  ++running_ops_;
  cluster_handoff_ = Clock::now();
  job.in_cluster[c.key] = std::move(op);
  job.cluster->Submit(std::move(c));
}

// Device buffers: the local phase on the GPU (single-node jobs). In a
// multi-node job the local phase goes on the GPU into a node buffer there,
// which the ClusterJob stages through host memory (Stage).
void Engine::LaunchDeviceOnLoop(Job& job, std::shared_ptr<PendingOp> op) {
  if (!device_runner_) {
    auto runner = DeviceRunner::Create();
    if (!runner.ok()) {
      return FinishOnLoop(job.key, *op, absl::Status(runner.status().code(), absl::StrCat(
          "operation '", op->name, "': ", runner.status().message())));
    }
    device_runner_ = std::move(*runner);
  }
  ++running_ops_;
  if (job.cluster) {
    device_runner_->Stage(
        op->sig, job.world_size, DeviceRanksOf(*op), job.key, op->deadline,
        [this, op, key = job.key](absl::StatusOr<std::shared_ptr<StagedNodeBuffer>> staged) {
          Post([this, op, key, staged = std::move(staged)]() mutable {
            --running_ops_;
            if (!staged.ok()) return FinishOnLoop(key, *op, Named(*op, staged.status()));
            auto it = jobs_.find(key);
            absl::Status ended;
            if (it == jobs_.end()) {
              ended = absl::AbortedError(
                  absl::StrCat("operation '", op->name, "': the job ended"));
            } else if (!it->second->failure.ok()) {
              ended = it->second->failure;
            }
            if (!ended.ok()) {
              // Its destructor waits for the device: not on the loop. (Once
              // the loop has exited, this runs on the runner's own thread.)
              if (device_runner_) device_runner_->Dispose(std::move(*staged));
              return FinishOnLoop(key, *op, ended);
            }
            op->staged = std::move(*staged);
            SubmitToClusterOnLoop(*it->second, op);
          });
        });
    return;
  }
  device_runner_->Run(op->sig, DeviceRanksOf(*op), job.key, op->deadline,
                      [this, op, key = job.key](absl::Status s) {
                        Post([this, op, key, s] {
                          --running_ops_;
                          FinishOnLoop(key, *op, Named(*op, s));
                        });
                      });
}

void Engine::FinishOnLoop(const std::string& job_key, PendingOp& op, const absl::Status& status) {
  auto it = jobs_.find(job_key);
  Job* job = it == jobs_.end() ? nullptr : it->second.get();
  const uint64_t bytes = op.trace.bytes;
  const double took = std::chrono::duration<double>(Clock::now() - op.trace.submitted).count();
  RecordOnLoop(op, status);
  if (status.ok()) {
    ++ops_completed_;
    bytes_ += bytes;
    if (job) {
      ++job->ops_completed;
      job->bytes += bytes;
      const size_t bucket = static_cast<size_t>(
          std::lower_bound(std::begin(kOpDurationBounds), std::end(kOpDurationBounds), took) -
          std::begin(kOpDurationBounds));
      ++job->duration_counts[bucket];
      job->duration_sum_seconds += took;
    }
  } else {
    ++ops_failed_;
    if (job) ++job->ops_failed;
  }
  for (auto& part : op.parts) {
    if (part) CompleteOnLoop(*part->session, part->op.op_id, status);
  }
  op.parts.clear();
  op.collective.reset();
}

void Engine::RecordOnLoop(PendingOp& op, const absl::Status& status) {
  const uint32_t capacity = options_.tuning->Snapshot().trace_ops;
  op.trace.done = Clock::now();
  op.trace.status = status;
  trace_.Add(std::move(op.trace), capacity);
  op.trace = OpRecord();
}

// ------------------------------------------------------------ status, stop

EngineTrace Engine::Trace(const std::string& job_id, uint32_t last,
                          std::optional<uint32_t> owner, bool in_flight) {
  if (shutdown_started_.load()) return EngineTrace{};
  return RunOnLoop<EngineTrace>([this, job_id, last, owner, in_flight] {
    EngineTrace trace =
        trace_.Select(job_id, last, started_, options_.tuning->Snapshot().trace_ops, owner);
    trace.now_us = static_cast<uint64_t>(
        std::chrono::duration_cast<std::chrono::microseconds>(Clock::now() - started_).count());
    if (!in_flight) return trace;
    for (const auto& [key, job] : jobs_) {
      if ((owner && job->uid != *owner) || (!job_id.empty() && job->id != job_id)) continue;
      std::vector<std::pair<const PendingOp*, const char*>> live;
      for (const auto& [name, op] : job->matcher->pending()) {
        live.emplace_back(op.get(), "scheduled");
      }
      for (const auto& [k, op] : job->in_cluster) live.emplace_back(op.get(), "started");
      std::sort(live.begin(), live.end(), [](const auto& a, const auto& b) {
        return a.first->trace.job_seq < b.first->trace.job_seq;
      });
      for (const auto& [op, state] : live) {
        OpTraceRow row = RowOf(op->trace, started_);
        row.done_us = 0;
        row.state = state;
        trace.ops.push_back(std::move(row));
      }
    }
    return trace;
  });
}

EngineStatus Engine::Status() {
  if (shutdown_started_.load()) return EngineStatus{};
  return RunOnLoop<EngineStatus>([this] { return StatusOnLoop(); });
}

EngineStatus Engine::StatusOnLoop() {
  EngineStatus st;
  const Clock::time_point now = Clock::now();
  st.uptime_seconds = std::chrono::duration<double>(now - started_).count();
  st.worker_threads = workers_->size();
  st.ops_completed = ops_completed_;
  st.ops_failed = ops_failed_;
  st.bytes = bytes_;
  for (auto& [id, s] : sessions_) {
    EngineStatus::SessionRow row;
    row.id = id;
    row.uid = s->peer.uid;
    row.pid = s->peer.pid;
    if (auto it = jobs_.find(s->job_key); it != jobs_.end()) row.job_id = it->second->id;
    row.rank = s->rank;
    row.arena_bytes = s->memory->data_bytes();
    st.sessions.push_back(std::move(row));
  }
  for (auto& [key, job] : jobs_) {
    EngineStatus::JobRow row;
    row.id = job->id;
    row.uid = job->uid;
    row.world_size = job->world_size;
    row.local_size = job->local_size;
    for (auto& [rank, s] : job->ranks) row.ranks.push_back(rank);
    if (!job->failure.ok()) {
      row.state = absl::StrCat("failed: ", job->failure.message());
    } else if (static_cast<int>(job->ranks.size()) < job->local_size) {
      row.state = "forming";
    } else if (job->cluster) {
      row.state = job->cluster->StateText();
    } else {
      row.state = "running";
    }
    row.ops_completed = job->ops_completed;
    row.ops_failed = job->ops_failed;
    row.bytes = job->bytes;
    if (job->fast) {  // counted by the trainers; plain numbers
      const FastPathSegment::Counters c = job->fast->ReadCounters();
      row.ops_completed += c.ops_completed;
      row.ops_failed += c.ops_failed;
      row.bytes += c.bytes;
      st.ops_completed += c.ops_completed;
      st.ops_failed += c.ops_failed;
      st.bytes += c.bytes;
    }
    if (job->cluster) {
      const ClusterJob::CompressionCounters c = job->cluster->compression();
      row.ops_compressed = c.ops;
      row.bytes_before_compression = c.raw_bytes;
      row.bytes_after_compression = c.wire_bytes;
      const ClusterJob::FusionCounters f = job->cluster->fusion();
      row.ops_fused = f.ops;
      row.fused_runs = f.runs;
      const ClusterJob::StagingCounters g = job->cluster->staging();
      row.ops_staged = g.ops;
      row.bytes_staged = g.bytes;
      const ClusterJob::FeedbackCounters e = job->cluster->feedback();
      row.feedback_residuals = e.host.names + e.device.names;
      row.feedback_host_bytes = e.host.bytes;
      row.feedback_device_bytes = e.device.bytes;
      row.feedback_evictions = e.host.evictions + e.device.evictions;
      row.feedback_resets = e.host.size_resets + e.device.size_resets;
      row.feedback_too_large = e.too_large_ops;
      row.ops_direct = job->cluster->direct_ops();
    }
    row.rank_skew_seconds.assign(job->skew_seconds.begin(), job->skew_seconds.end());
    row.duration_counts = job->duration_counts;
    row.duration_sum_seconds = job->duration_sum_seconds;
    std::vector<std::shared_ptr<PendingOp>> ops;
    for (auto& [name, op] : job->matcher->pending()) ops.push_back(op);
    std::sort(ops.begin(), ops.end(), [](auto& a, auto& b) { return a->seq < b->seq; });
    for (auto& op : ops) {
      EngineStatus::PendingRow p;
      p.name = op->name;
      const char* c = wire::CollectiveName(op->sig.collective);
      p.collective = c ? c : "?";
      p.bytes = op->sig.count * op->sig.element_bytes();
      for (int r = 0; r < job->world_size; ++r) {
        (op->seen[r] ? p.submitted : p.waiting).push_back(r);
      }
      p.age_seconds = std::chrono::duration<double>(now - op->first_submit).count();
      row.pending.push_back(std::move(p));
    }
    if (job->fast && !job->fast->aborted()) {
      for (auto& f : job->fast->ReadPending()) {
        EngineStatus::PendingRow p;
        p.name = std::move(f.name);
        const char* c = wire::CollectiveName(f.collective);
        p.collective = c ? c : "?";
        p.bytes = f.bytes;
        p.submitted = std::move(f.submitted);
        p.waiting = std::move(f.waiting);
        p.age_seconds = f.age_seconds;
        row.pending.push_back(std::move(p));
      }
    }
    st.jobs.push_back(std::move(row));
  }
  if (device_runner_) {
    const DeviceMemoryUse use = device_runner_->MemoryUse();
    st.gpu_mapped_allocations = use.mapped_allocations;
    st.gpu_mapped_bytes = use.mapped_bytes;
    st.gpu_pinned_bytes = use.pinned_bytes;
  }
  return st;
}

EnginePeers Engine::Peers() {
  if (shutdown_started_.load()) return EnginePeers{};
  return RunOnLoop<EnginePeers>([this] {
    EnginePeers out;
    for (auto& [key, job] : jobs_) {
      if (job->coordinator.empty()) continue;
      EnginePeers::Job j;
      j.id = job->id;
      j.uid = job->uid;
      j.coordinator = job->coordinator;
      j.state = job->cluster ? job->cluster->StateText() : "forming";
      if (job->cluster) {
        for (auto& row : job->cluster->Peers()) {
          j.peers.push_back(EnginePeers::Peer{row.node_name, row.ranks, row.self, row.state,
                                              row.bytes_sent, row.bytes_received, row.rack,
                                              row.rate_bytes_per_s});
        }
        for (auto& c : job->cluster->Channels()) {
          j.channels.push_back(EnginePeers::Channel{c.device, c.rate_bytes_per_s, c.share});
        }
      }
      out.jobs.push_back(std::move(j));
    }
    return out;
  });
}

void Engine::Shutdown() {
  if (shutdown_started_.exchange(true)) return;
  spdlog::info("engine draining");
  if (listen_fd_ >= 0) {  // only remove a socket this engine listens on
    shutdown(listen_fd_, SHUT_RDWR);
    if (acceptor_.joinable()) acceptor_.join();
    close(listen_fd_);
    unlink(options_.session_socket_path.c_str());
  }
  Post([this] {
    stopping_ = true;
    for (auto& [key, job] : jobs_) {
      FailJobOnLoop(*job, absl::UnavailableError(
          "ciuicd is stopping or restarting (SIGTERM): join again once it is back"));
    }
  });
  if (loop_.joinable()) loop_.join();
  device_runner_.reset();  // idle: the loop waited for every running operation
  for (auto& r : reapers_) r.thread.join();
  reapers_.clear();
  workers_.reset();
}

}  // namespace ciuic::daemon
