// A fixed set of threads that run chunks of operations, shared fairly by
// the jobs on this node: workers take tasks from the jobs with queued work
// in turn (round robin, one task at a time), and within one job the highest
// priority first (then first come, first served), so that a small urgent
// operation overtakes a large one of the same job at the next chunk
// boundary. A trainer's priority thus orders only its own job's work: no
// job's priority, however high, puts its chunks ahead of another job's.
// Idle workers sleep on a condition variable: no spinning.
#pragma once

#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <queue>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

namespace ciuic::daemon {

class WorkerPool {
 public:
  explicit WorkerPool(int threads);
  ~WorkerPool();  // runs what is queued, then joins

  // Queues `task` for `owner` (a job's key). Any thread.
  void Submit(const std::string& owner, int32_t priority, std::function<void()> task);
  int size() const { return static_cast<int>(threads_.size()); }

  // Runs body(i) for every i in [0, n) and returns once all have run: the
  // calling thread takes indices too, and up to size() workers join it
  // through tasks queued for `owner` (so the job's turn in the pool is
  // kept). A worker whose task starts after every index was taken does
  // nothing, so the caller finishes alone when the pool is busy with other
  // jobs. If a body throws, the indices not yet begun are skipped, and the
  // first exception is rethrown here once every helper is done with `body`.
  // Not from a worker thread (its own task could be the one it waits for:
  // harmless, but it then runs alone).
  void ParallelFor(const std::string& owner, int32_t priority, size_t n,
                   const std::function<void(size_t)>& body);

 private:
  struct Task {
    int32_t priority;
    uint64_t seq;
    std::function<void()> fn;
    bool operator<(const Task& o) const {  // max-heap: higher priority, then older
      if (priority != o.priority) return priority < o.priority;
      return seq > o.seq;
    }
  };
  void Run();

  absl::Mutex mu_;
  // Queued tasks by owner; an owner is in turn_ exactly while it has some.
  std::map<std::string, std::priority_queue<Task>> queues_ ABSL_GUARDED_BY(mu_);
  std::deque<std::string> turn_ ABSL_GUARDED_BY(mu_);
  uint64_t next_seq_ ABSL_GUARDED_BY(mu_) = 0;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<std::thread> threads_;
};

}  // namespace ciuic::daemon
