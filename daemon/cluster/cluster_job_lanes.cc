// ClusterJob's lanes: the runs the coordinator announced, taken in order
// by kLanes threads, so that a small urgent run need not wait behind a
// large one (a lane running a lower-priority run yields its chunks to a
// higher one's); each run's ranks hear first, then the coordinator.
#include <algorithm>
#include <chrono>

#include "absl/strings/match.h"
#include "cluster/cluster_job.h"
#include "spdlog/spdlog.h"

namespace ciuic::daemon {

using Clock = std::chrono::steady_clock;

void ClusterJob::LaneLoop(Lane& lane) {
  while (true) {
    Announced run;
    {
      std::unique_lock<std::mutex> lock(mu_);
      lanes_cv_.wait(lock, [&] {
        if (lanes_stop_) return true;
        if (announced_.empty()) return false;
        for (const auto& op : announced_.front().ops) {
          if (running_names_.count(op.name)) return false;  // its earlier run first
        }
        return true;
      });
      if (lanes_stop_) return;
      run = std::move(announced_.front());
      announced_.pop_front();
      for (const auto& op : run.ops) ++running_names_[op.name];
      lane.busy = true;
      lane.priority = run.ops.front().priority;
      for (const auto& op : run.ops) lane.priority = std::max(lane.priority, op.priority);
      for (auto& other : lanes_) {
        if (other.get() != &lane && other->busy && other->priority < lane.priority) {
          other->yield.fetch_add(1, std::memory_order_relaxed);
          lane.yielding.push_back(other.get());
        }
      }
    }
    lanes_cv_.notify_all();  // the next run may start in another lane
    const auto start = std::chrono::steady_clock::now();
    absl::Status s = run.ops.size() == 1
                         ? Execute(run.ops.front(), run.seq, run.settings, lane)
                         : ExecuteFused(run.ops, run.seq, run.settings, lane);
    if (!s.ok() && s.code() != absl::StatusCode::kInvalidArgument) {
      absl::Status ended = EndedByTheJob(s);
      if (ended != s) {
        spdlog::debug("run {} of job '{}' ended with the job: {}", run.seq, options_.job_id,
                      std::string(s.message()));
        s = std::move(ended);
      } else if (s.code() == absl::StatusCode::kUnavailable) {
        s = WithVerdict(std::move(s));
      }
    }
    const auto end = std::chrono::steady_clock::now();
    for (const auto& op : run.ops) {
      if (op.timing) {
        op.timing->run_start = start;
        op.timing->run_end = end;
      }
    }
    // The ranks hear first (writing the Done is a system call on a TCP
    // stream). A rank that hears of its last operation may leave at once,
    // and its node's Leave must not reach the coordinator before this run's
    // Done (it would count the run as cut off, and warn): the Leave waits
    // for the Dones announced here (dones_pending_).
    {
      std::lock_guard<std::mutex> lock(write_mu_);
      ++dones_pending_;
    }
    for (auto& op : run.ops) Done(op, s);
    {
      proto::NodeEvent done;
      done.mutable_done()->set_seq(run.seq);
      done.mutable_done()->set_code(static_cast<int>(s.code()));
      done.mutable_done()->set_message(std::string(s.message()));
      std::lock_guard<std::mutex> lock(write_mu_);
      // A closed stream: the job is ending anyway.
      if (!writes_closed_ && stream_) stream_->Write(done);
      --dones_pending_;
    }
    dones_cv_.notify_all();
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (const auto& op : run.ops) {
        if (--running_names_[op.name] == 0) running_names_.erase(op.name);
      }
      for (Lane* other : lane.yielding) other->yield.fetch_sub(1, std::memory_order_relaxed);
      lane.yielding.clear();
      lane.busy = false;
      last_progress_ = Clock::now();
    }
    lanes_cv_.notify_all();
    if (!s.ok() && s.code() != absl::StatusCode::kInvalidArgument) {
      PushRunFailed(s);
    }
  }
}

absl::Status ClusterJob::WithVerdict(absl::Status run_status) {
  std::unique_lock<std::mutex> lock(mu_);
  lanes_cv_.wait_for(lock, kVerdictGrace, [&] { return !verdict_.ok() || lanes_stop_; });
  if (verdict_.ok()) return run_status;
  return absl::Status(verdict_.code(),
                      absl::StrCat(verdict_.message(), " (here: ", run_status.message(), ")"));
}

absl::Status ClusterJob::EndedByTheJob(absl::Status run_status) {
  std::lock_guard<std::mutex> lock(mu_);
  // failure_: this node's own end (Abort, the job failed as this node
  // heard it); verdict_: the coordinator's word, which may reach the reader
  // thread before the main thread has taken it as failure_.
  for (const absl::Status* job : {&failure_, &verdict_}) {
    if (!job->ok() && !job->message().empty() &&
        absl::StrContains(run_status.message(), job->message())) {
      return *job;
    }
  }
  return run_status;
}

void ClusterJob::WaitForAnnouncedRuns() {
  std::unique_lock<std::mutex> lock(mu_);
  lanes_cv_.wait(lock, [&] {
    if (lanes_stop_ || aborted_) return true;
    if (!announced_.empty()) return false;
    for (const auto& lane : lanes_) {
      if (lane->busy) return false;
    }
    return true;
  });
}

void ClusterJob::StopLanes() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    lanes_stop_ = true;
  }
  lanes_cv_.notify_all();
  for (auto& lane : lanes_) {
    if (lane->thread.joinable()) lane->thread.join();
  }
}

}  // namespace ciuic::daemon
