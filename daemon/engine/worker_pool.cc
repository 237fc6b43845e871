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

void WorkerPool::Submit(const std::string& owner, int32_t priority, std::function<void()> task) {
  absl::MutexLock lock(&mu_);
  auto& queue = queues_[owner];
  if (queue.empty()) turn_.push_back(owner);
  queue.push(Task{priority, next_seq_++, std::move(task)});
}

void WorkerPool::Run() {
  while (true) {
    std::function<void()> fn;
    {
      absl::MutexLock lock(&mu_);
      mu_.Await(absl::Condition(
          +[](WorkerPool* p) ABSL_EXCLUSIVE_LOCKS_REQUIRED(p->mu_) {
            return p->stopping_ || !p->turn_.empty();
          },
          this));
      if (turn_.empty()) return;  // stopping and drained
      std::string owner = std::move(turn_.front());
      turn_.pop_front();
      auto it = queues_.find(owner);
      fn = std::move(const_cast<Task&>(it->second.top()).fn);
      it->second.pop();
      if (it->second.empty()) {
        queues_.erase(it);
      } else {
        turn_.push_back(std::move(owner));
      }
    }
    fn();
  }
}

}  // namespace ciuic::daemon
