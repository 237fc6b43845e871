// The launcher: a rank's submission is validated and matched with the
// other local ranks' (OpMatcher), launched on the worker pool, the GPU or
// the job's ClusterJob, and completed on every rank's ring; deadlines and
// the trace. Part of Engine (engine_state.h).
#include "engine/engine_state.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "ciuic/collective_rules.h"
#include "cuda/device_runner.h"
#include "engine/worker_pool.h"
#include "spdlog/spdlog.h"

namespace ciuic::daemon {

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

}  // namespace

// ------------------------------------------------------------- operations

absl::Status Engine::PushCompletion(Session& session, uint64_t op_id,
                                    const absl::Status& status) {
  std::lock_guard<std::mutex> lock(session.cq_mu);
  if (session.cq_closed) return absl::OkStatus();
  // Checked and taken under cq_mu; the loop only adds.
  if (session.outstanding.load(std::memory_order_relaxed) > 0) {
    session.outstanding.fetch_sub(1, std::memory_order_relaxed);
  }
  return session.cq->Push(op_id, static_cast<int>(status.code()), status.message());
}

void Engine::CompleteOnLoop(Session& session, uint64_t op_id, const absl::Status& status) {
  if (session.closed) return;
  absl::Status pushed = PushCompletion(session, op_id, status);
  if (!pushed.ok()) {
    auto it = sessions_.find(session.id);
    if (it != sessions_.end()) CloseSessionOnLoop(it->second, pushed.ToString());
  }
}

void Engine::TellRanks(PendingOp& op, const absl::Status& status) {
  std::vector<std::pair<std::shared_ptr<Session>, std::string>> broken;
  {
    std::lock_guard<std::mutex> lock(op.end_mu);
    if (op.ranks_told) return;
    // A trainer asleep on its ring is left to the loop: woken from here, it
    // would take the core of the thread that still has this exchange (and
    // the next one's sends) to finish. Measured on 2 cores: 256K between two
    // nodes took 403 us instead of 344 with every rank told from here, and
    // its p99 1.6 ms instead of 0.6. A trainer that polls hears at once.
    // (trainer_waiters is the trainer's to write: a hint only.)
    for (auto& part : op.parts) {
      if (part && part->session->memory->header()->trainer_waiters.load(
                      std::memory_order_relaxed) != 0) {
        return;
      }
    }
    op.ranks_told = true;
    op.told_at = Clock::now();
    for (auto& part : op.parts) {
      if (!part) continue;
      absl::Status pushed = PushCompletion(*part->session, part->op.op_id, status);
      if (!pushed.ok()) broken.emplace_back(part->session, pushed.ToString());
    }
  }
  for (auto& [session, why] : broken) {
    Post([this, session = std::move(session), why = std::move(why)] {
      CloseSessionOnLoop(session, why);
    });
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
  // Where the operation ends (a transport thread for a direct one, a lane
  // for a run): the loop's bookkeeping is posted first, so that whatever a
  // rank asks the loop after its completion sees it, and then the ranks
  // hear at once, without waiting for the loop to come round. The parts
  // and the buffers they point to stay alive with `op`.
  c.done = [this, key = job.key, op_key = c.key, op](const absl::Status& s) {
    Post([this, key, op_key, s] { ClusterDoneOnLoop(key, op_key, s); });
    TellRanks(*op, s);
  };
  ++running_ops_;
  cluster_handoff_ = Clock::now();
  job.in_cluster[c.key] = std::move(op);
  // A direct op's local phase, and that of a several-rank allreduce of up
  // to ClusterJob::kEarlyLocalMaxBytes, run in here, on the loop.
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
  // An operation of a multi-node job may have been told to its ranks by the
  // thread that ended it (TellRanks), which may still be at it: end_mu. Its
  // end is then when they were told.
  std::vector<std::optional<RankPart>> parts;
  Clock::time_point ended;
  {
    std::lock_guard<std::mutex> lock(op.end_mu);
    if (op.ranks_told) {
      ended = op.told_at;
    } else {
      op.ranks_told = true;
      parts.swap(op.parts);
      ended = Clock::now();
    }
    op.parts.clear();
  }
  const uint64_t bytes = op.trace.bytes;
  const double took = std::chrono::duration<double>(ended - op.trace.submitted).count();
  RecordOnLoop(op, status, ended);
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
  for (auto& part : parts) {
    if (part) CompleteOnLoop(*part->session, part->op.op_id, status);
  }
  op.collective.reset();
}

void Engine::RecordOnLoop(PendingOp& op, const absl::Status& status, Clock::time_point done) {
  const uint32_t capacity = options_.tuning->Snapshot().trace_ops;
  op.trace.done = done == Clock::time_point() ? Clock::now() : done;
  op.trace.status = status;
  trace_.Add(std::move(op.trace), capacity);
  op.trace = OpRecord();
}

}  // namespace ciuic::daemon
