// A fixed set of threads that run chunks of operations, highest priority
// first (then first come, first served), so that a small urgent operation
// overtakes a large one at the next chunk boundary. Idle workers sleep on a
// condition variable: no spinning.
#pragma once

#include <cstdint>
#include <functional>
#include <queue>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

namespace ciuic::daemon {

class WorkerPool {
 public:
  explicit WorkerPool(int threads);
  ~WorkerPool();  // runs what is queued, then joins

  void Submit(int32_t priority, std::function<void()> task);
  int size() const { return static_cast<int>(threads_.size()); }

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
  std::priority_queue<Task> queue_ ABSL_GUARDED_BY(mu_);
  uint64_t next_seq_ ABSL_GUARDED_BY(mu_) = 0;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<std::thread> threads_;
};

}  // namespace ciuic::daemon
