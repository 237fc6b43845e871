// The job table: ranks join jobs, a job's multi-node part (ClusterJob)
// starts once its local ranks have joined, and jobs go when their last
// rank does. Part of Engine (engine_state.h).
#include "engine/engine_state.h"

#include <algorithm>
#include <system_error>

#include "absl/strings/str_cat.h"
#include "cuda/device_runner.h"
#include "engine/worker_pool.h"
#include "spdlog/spdlog.h"

namespace ciuic::daemon {

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

}  // namespace ciuic::daemon
