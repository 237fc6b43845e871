#include "engine/worker_pool.h"

#include <pthread.h>

#include <string>

namespace ciuic::daemon {

WorkerPool::WorkerPool(int threads) {
  for (int i = 0; i < threads; ++i) {
    threads_.emplace_back([this] { Run(); });
    pthread_setname_np(threads_.back().native_handle(), ("ciuic-work" + std::to_string(i)).c_str());
  }
}

WorkerPool::~WorkerPool() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  for (auto& t : threads_) t.join();
}

void WorkerPool::Submit(int32_t priority, std::function<void()> task) {
  absl::MutexLock lock(&mu_);
  queue_.push(Task{priority, next_seq_++, std::move(task)});
}

void WorkerPool::Run() {
  while (true) {
    std::function<void()> fn;
    {
      absl::MutexLock lock(&mu_);
      mu_.Await(absl::Condition(
          +[](WorkerPool* p) ABSL_EXCLUSIVE_LOCKS_REQUIRED(p->mu_) {
            return p->stopping_ || !p->queue_.empty();
          },
          this));
      if (queue_.empty()) return;  // stopping and drained
      fn = std::move(const_cast<Task&>(queue_.top()).fn);
      queue_.pop();
    }
    fn();
  }
}

}  // namespace ciuic::daemon
