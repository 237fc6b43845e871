// The engine's own state, shared by the files that implement it
// (engine.cc: lifecycle and the event loop; engine_sessions.cc: the
// session acceptor; engine_jobs.cc: the job table; engine_ops.cc: the
// launcher, from a submission to its completion). Not for other users.
#pragma once

#include <sys/types.h>

#include <array>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <future>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "collectives/local.h"
#include "collectives/op.h"
#include "engine/engine.h"
#include "engine/op_matcher.h"
#include "engine/session_limits.h"
#include "shm/fast_path_segment.h"
#include "shm/rings.h"
#include "shm/session_memory.h"
#include "shm/session_socket.h"

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
  // The completion ring has two writers: the loop, and the thread that
  // ends an operation of a multi-node job (Engine::TellRanks), which writes
  // its ranks' completions at once instead of through the loop.
  std::mutex cq_mu;
  // Made when the session joins, before another thread sees it; its pushes
  // under cq_mu (its capacity is fixed).
  std::optional<CompletionWriter> cq;
  bool cq_closed ABSL_GUARDED_BY(cq_mu) = false;  // the session has closed
  bool closed = false;                 // the loop's
  std::string job_key;  // empty until joined
  int rank = -1;
  // Submitted, not yet completed: the loop adds, a completion's writer
  // (under cq_mu) takes away.
  std::atomic<uint32_t> outstanding{0};
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
  // An operation of a multi-node job is told to its ranks either by the
  // thread that ends it (Engine::TellRanks) or by the loop (FinishOnLoop),
  // whichever comes first: `parts` and `ranks_told` under end_mu once the
  // operation is in the ClusterJob.
  std::mutex end_mu;
  bool ranks_told ABSL_GUARDED_BY(end_mu) = false;
  Clock::time_point told_at ABSL_GUARDED_BY(end_mu);  // by TellRanks: the operation's end
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

// A job's key in jobs_: its owner and its id (ids are per user).
inline std::string JobKey(uid_t uid, const std::string& id) { return absl::StrCat(uid, "/", id); }

inline absl::Status Errno(absl::string_view what) {
  return absl::InternalError(absl::StrCat(what, ": ", std::strerror(errno)));
}

// epoll data: low 2 bits say which fd of which session woke us.
enum : uint64_t { kWake = 0, kSock = 1, kBell = 2 };
inline uint64_t Tag(uint64_t session_id, uint64_t kind) { return session_id << 2 | kind; }

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

}  // namespace ciuic::daemon
