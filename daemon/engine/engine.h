// The engine: everything between a trainer's submission and its completion
// on one node.
//
// Threads. One event-loop thread owns every session, job and pending
// operation: it accepts nothing from other threads except closures posted
// with Post()/RunOnLoop() (the way TensorPipe's loop and Envoy's dispatcher
// work), so none of that state needs a lock. Methods and members that
// belong to the loop end in `OnLoop` or say so. An acceptor thread performs
// session handshakes (they may block on a slow trainer) and posts the new
// session to the loop. Worker threads (WorkerPool) run chunks of large
// operations and post their completion back. The one exception: the end of
// an operation of a multi-node job. The thread that ends it (a UCX thread
// for a direct exchange, a lane for a run) posts the loop's bookkeeping and
// then writes the ranks' completions itself (TellRanks), so that the
// trainer does not wait for the loop to come round: a session's completion
// ring has two writers, under Session::cq_mu, and PendingOp::end_mu lets
// whichever of the two comes first tell the ranks.
//
// The loop polls the submission rings while there is work, keeps polling
// for spin_us after the last work, then arms the doorbells and sleeps in
// epoll: an idle daemon uses no CPU.
//
// Callers: the control layer (gRPC) calls Join/Status from its threads;
// main() calls Start and Shutdown.
//
// Files, each readable alone: engine.cc (start, the event loop, status and
// shutdown), engine_sessions.cc (the session acceptor), engine_jobs.cc (the
// job table: joins, a job's ClusterJob, its end), engine_ops.cc (the
// launcher: submissions, matching with OpMatcher, launches on the workers,
// the GPU or the ClusterJob, completions and deadlines); engine_state.h
// holds the state they share (Session, PendingOp, Job).
#pragma once

#include <sys/types.h>

#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <iterator>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "ciuic/shm_layout.h"
#include "cluster/cluster_job.h"
#include "config/tuning.h"
#include "engine/op_trace.h"

namespace ciuic::daemon {

struct Session;
struct Job;
struct PendingOp;
class WorkerPool;
class SessionLimits;
class DeviceRunner;

struct JoinRequest {
  // The uid that made the JoinJob call (control_socket.h), when known: it
  // must be the session's own.
  std::optional<uid_t> caller_uid;
  std::string session_token;
  std::string job_id;
  int rank = 0;
  int world_size = 0;
  int local_rank = 0;
  int local_size = 0;
  std::string coordinator;  // host:port; required for multi-node jobs
};

struct EnginePeers {
  struct Peer {
    std::string node_name;
    std::vector<int> ranks;
    bool self = false;
    std::string state;
    uint64_t bytes_sent = 0;
    uint64_t bytes_received = 0;
    std::string rack;
    double rate_bytes_per_s = 0;  // this node's sends to it; 0 = not measured
  };
  // A channel of the job with a device of its own (channel_devices).
  struct Channel {
    std::string device;
    double rate_bytes_per_s = 0;  // measured here; 0 = not yet
    double share = 0;             // of the latest run's chunks
  };
  struct Job {
    std::string id;
    uint32_t uid = 0;
    std::string coordinator;
    std::string state;
    std::vector<Peer> peers;
    std::vector<Channel> channels;
  };
  std::vector<Job> jobs;
};

// Upper bounds (seconds) of the buckets of an operation's duration, from
// its node's first submission to its completion (Prometheus: le, then +Inf).
inline constexpr double kOpDurationBounds[] = {50e-6, 100e-6, 250e-6, 500e-6, 1e-3,  2.5e-3,
                                               5e-3,  10e-3,  25e-3,  50e-3,  0.1,   0.25,
                                               0.5,   1,      2.5,    10};
inline constexpr size_t kOpDurationBuckets = std::size(kOpDurationBounds) + 1;  // with +Inf

struct EngineStatus {
  struct SessionRow {
    uint64_t id = 0;
    uint32_t uid = 0;
    int32_t pid = 0;
    std::string job_id;
    int rank = -1;
    uint64_t arena_bytes = 0;
  };
  struct PendingRow {
    std::string name;
    std::string collective;
    uint64_t bytes = 0;
    std::vector<int> submitted;
    std::vector<int> waiting;
    double age_seconds = 0;
  };
  struct JobRow {
    std::string id;
    uint32_t uid = 0;
    int world_size = 0;
    int local_size = 0;
    std::vector<int> ranks;
    std::string state;
    uint64_t ops_completed = 0;
    uint64_t ops_failed = 0;
    uint64_t bytes = 0;
    uint64_t ops_compressed = 0;
    uint64_t bytes_before_compression = 0;
    uint64_t bytes_after_compression = 0;
    uint64_t ops_fused = 0;   // multi-node: operations fused with others
    uint64_t fused_runs = 0;  // and the fused allreduces they made
    uint64_t ops_staged = 0;    // multi-node: operations on GPU buffers
    uint64_t bytes_staged = 0;  // and the bytes copied device <-> host for them
    // Error feedback (host and GPUs together, but the bytes): residuals
    // held, their bytes, residuals dropped, and operations over the cap
    // (control.proto's JobInfo).
    uint64_t feedback_residuals = 0;
    uint64_t feedback_host_bytes = 0;
    uint64_t feedback_device_bytes = 0;
    uint64_t feedback_evictions = 0;
    uint64_t feedback_resets = 0;
    uint64_t feedback_too_large = 0;
    uint64_t ops_direct = 0;  // multi-node: ran without the coordinator
    // Completed operations (not those of the fast path) by duration:
    // per bucket of kOpDurationBounds, not cumulative (the last: longer).
    std::array<uint64_t, kOpDurationBuckets> duration_counts{};
    double duration_sum_seconds = 0;
    std::vector<PendingRow> pending;
    // (rank, seconds): how late each local rank submits after the node's
    // first, a moving average over operations (rank order; empty with one
    // local rank).
    std::vector<std::pair<int, double>> rank_skew_seconds;
  };
  double uptime_seconds = 0;
  int worker_threads = 0;
  uint64_t ops_completed = 0;
  uint64_t ops_failed = 0;
  uint64_t bytes = 0;
  // Device buffers (cuda/device_runner.h's DeviceMemoryUse; 0 before the
  // first device operation): trainers' allocations mapped, their bytes,
  // and pinned host memory.
  uint64_t gpu_mapped_allocations = 0;
  uint64_t gpu_mapped_bytes = 0;
  uint64_t gpu_pinned_bytes = 0;
  std::vector<SessionRow> sessions;
  std::vector<JobRow> jobs;
};

class Engine {
 public:
  struct Options {
    std::string session_socket_path;
    int worker_threads = 2;
    uint64_t max_arena_bytes = 8ull << 30;
    config::TuningRegistry* tuning = nullptr;  // not owned; outlives the engine
    // Multi-node jobs: this node's name, how to make a job's transport and
    // how to reach its coordinator. Without both factories, multi-node jobs
    // are refused.
    std::string node_name;
    std::string rack;  // config `rack`: announced when a job forms
    TransportFactory transports;
    // Channels of every multi-node job (the config's channel_devices, one
    // each); 0: tuning `channels` when the job starts.
    int channels = 0;
    CoordinatorClientFactory coordinator_clients;
    // May be empty. Asked, on the joining thread (it may resolve names),
    // whether a multi-node job may use the coordinator host:port its
    // trainer names; an error fails the Join with it.
    std::function<absl::Status(const std::string& coordinator)> check_coordinator;
    // This daemon's coordinator (may be null): jobs it coordinates order
    // through it in-process. Must outlive the engine.
    Coordinator* local_coordinator = nullptr;
    // What one trainer, uid or job may take (config.h's keys of the same
    // names; the byte limits already resolved from 0).
    uint32_t max_world_size = 65536;
    uint32_t max_sessions = 4096;
    uint32_t max_sessions_per_uid = 512;
    uint32_t max_jobs_per_uid = 256;
    uint64_t max_arena_bytes_per_uid = UINT64_MAX;
    uint64_t max_arena_bytes_total = UINT64_MAX;
  };

  // Listens on the session socket and starts the loop, acceptor and workers.
  static absl::StatusOr<std::unique_ptr<Engine>> Start(const Options& options);
  ~Engine();  // Shutdown() if not done

  // Binds a session (by its token) to a rank of a job. Any thread. When the
  // job has a fast-path segment, it has been sent on the session socket and
  // *fast_path_bytes is its payload limit (else 0).
  absl::Status Join(const JoinRequest& request, uint64_t* fast_path_bytes = nullptr);
  EngineStatus Status();
  EnginePeers Peers();
  // The last `last` operations (0: all recorded) of job `job_id` (empty:
  // every job), oldest first (op_trace.h); with `owner`, of that uid's jobs
  // only. With `in_flight`, then the operations not ended yet, in each
  // job's submission order: "scheduled" while a local rank has not
  // submitted, "started" while the nodes run it (a single-node job's
  // running operations are not listed: they wait for nobody).
  EngineTrace Trace(const std::string& job_id, uint32_t last,
                    std::optional<uint32_t> owner = std::nullopt, bool in_flight = false);

  // Drains: refuses new sessions, ends pending operations with UNAVAILABLE,
  // lets running ones finish, closes every session. Any thread but the loop.
  void Shutdown();

 private:
  explicit Engine(const Options& options);

  void Post(std::function<void()> fn);
  template <typename T>
  T RunOnLoop(std::function<T()> fn);

  void AcceptLoop();
  void HandshakeOnAcceptor(int fd);
  void Loop();
  bool RunPostedOnLoop();
  bool PollSubmissionsOnLoop();
  bool AnySubmissionPendingOnLoop();
  void ArmDoorbellsOnLoop(bool armed);
  void SubmitOnLoop(const std::shared_ptr<Session>& session, const wire::SubmissionEntry& entry);
  void LaunchOnLoop(Job& job, std::shared_ptr<PendingOp> op);
  void LaunchDeviceOnLoop(Job& job, std::shared_ptr<PendingOp> op);
  void SubmitToClusterOnLoop(Job& job, std::shared_ptr<PendingOp> op);
  void FinishOnLoop(const std::string& job_key, PendingOp& op, const absl::Status& status);
  // Keeps op's record for the trace, ending with `status` at `done` (unset:
  // now).
  void RecordOnLoop(PendingOp& op, const absl::Status& status,
                    std::chrono::steady_clock::time_point done = {});
  void FailPendingOnLoop(Job& job, PendingOp& op, const absl::Status& status);
  void FailJobOnLoop(Job& job, const absl::Status& status);
  void CheckDeadlinesOnLoop();
  void CompleteOnLoop(Session& session, uint64_t op_id, const absl::Status& status);
  // Writes one completion to `session`'s ring, from any thread. A write that
  // fails (the trainer broke its ring) is returned: the session must close.
  static absl::Status PushCompletion(Session& session, uint64_t op_id, const absl::Status& status);
  // Any thread: the ranks of `op`, which its ClusterJob has ended, hear of it
  // now unless the loop has told them already (PendingOp::ranks_told).
  void TellRanks(PendingOp& op, const absl::Status& status);
  void CloseSessionOnLoop(const std::shared_ptr<Session>& session, const std::string& why);
  void StartClusterOnLoop(Job& job);
  void ClusterDoneOnLoop(const std::string& job_key, uint64_t op_key, const absl::Status& status);
  void EraseJobOnLoop(const std::string& key);
  absl::Status JoinOnLoop(const JoinRequest& request, uid_t* uid_out, uint64_t* fast_out);
  EngineStatus StatusOnLoop();

  const Options options_;
  const std::chrono::steady_clock::time_point started_ = std::chrono::steady_clock::now();
  int listen_fd_ = -1;
  int epoll_fd_ = -1;
  int wake_fd_ = -1;
  std::unique_ptr<WorkerPool> workers_;
  std::unique_ptr<SessionLimits> limits_;
  // Device-buffer operations (cuda/device_runner.h): made by the loop at the
  // first one, destroyed by Shutdown after the loop has exited.
  std::unique_ptr<DeviceRunner> device_runner_;
  std::thread acceptor_;
  // Threads that destroy a finished job's ClusterJob (that can take a
  // moment) away from the loop; joined at shutdown.
  // Loop thread only; a reaper that has finished is joined when the next
  // one starts, so a daemon that runs many jobs keeps few threads.
  struct Reaper {
    std::thread thread;
    std::shared_ptr<std::atomic<bool>> done;
  };
  std::vector<Reaper> reapers_;
  std::thread loop_;
  std::atomic<bool> shutdown_started_{false};

  absl::Mutex post_mu_;
  std::vector<std::function<void()>> posted_ ABSL_GUARDED_BY(post_mu_);
  // Set when the loop has exited: Post() then runs closures itself, under
  // post_mu_, so a late gRPC call gets its (UNAVAILABLE) answer.
  bool loop_exited_ ABSL_GUARDED_BY(post_mu_) = false;
  std::atomic<int> posted_count_{0};  // lets the spinning loop skip the mutex
  // The loop may be in epoll_wait with a timeout: Post writes wake_fd_.
  std::atomic<bool> loop_blocking_{false};

  // Loop-thread state.
  uint64_t next_session_id_ = 1;
  std::map<uint64_t, std::shared_ptr<Session>> sessions_;
  std::vector<std::shared_ptr<Session>> ready_scratch_;
  std::map<std::string, std::shared_ptr<Session>> sessions_by_token_;
  std::map<std::string, std::unique_ptr<Job>> jobs_;  // key: uid + '/' + job id
  uint64_t next_op_seq_ = 0;
  int running_ops_ = 0;
  // When an operation last went to a ClusterJob: the loop keeps polling a
  // while after, so that a small one's completion finds it awake.
  std::chrono::steady_clock::time_point cluster_handoff_{};
  bool stopping_ = false;
  uint64_t ops_completed_ = 0;
  uint64_t ops_failed_ = 0;
  uint64_t bytes_ = 0;
  TraceLog trace_;
};

}  // namespace ciuic::daemon
