#include "engine/engine.h"

#include <sched.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "cuda/device_runner.h"
#include "engine/engine_state.h"
#include "engine/worker_pool.h"
#include "spdlog/spdlog.h"

namespace ciuic::daemon {

namespace {

// Ring polls per spinning round before the loop looks at its sockets.
constexpr int kFastPolls = 512;
// How long the loop polls after handing an operation to a multi-node job.
// Its ranks hear of its end from the thread that ends it (TellRanks), but
// a trainer's next submission follows at once, and a polling loop takes it
// without a doorbell (8 bytes between two nodes take 50-130 us here).
constexpr auto kClusterSpin = std::chrono::microseconds(300);
constexpr int kYieldMask = 3;
// Fairness between sessions: one pass of the loop takes at most this many
// submissions from each session's ring, and the spinning poll hands over to
// a full pass (posted closures, sockets, deadlines) after this many rounds
// that found work, so that a trainer that keeps its ring full cannot starve
// the others or the loop's own work.
constexpr int kSubmissionsPerPass = 32;
constexpr int kBusyRoundsPerPass = 16;

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
      // The ring's capacity as ciuicd made it, not the trainer's copy.
      if (s->outstanding.load(std::memory_order_relaxed) >= s->cq->capacity()) {
        CloseSessionOnLoop(s, "more operations in flight than the completion ring holds");
        break;
      }
      s->outstanding.fetch_add(1, std::memory_order_relaxed);
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
    // Posted closures before the events: the bookkeeping of a multi-node
    // operation is posted before its ranks hear of its end (TellRanks), so
    // it runs before the hang-up of a trainer that then exits can end the
    // job (and the operation's record with it).
    bool worked = RunPostedOnLoop();
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
    worked |= RunPostedOnLoop();
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
