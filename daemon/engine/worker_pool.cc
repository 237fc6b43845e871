#include "engine/worker_pool.h"

#include <pthread.h>

#include <algorithm>
#include <atomic>
#include <exception>
#include <memory>
#include <string>
#include <utility>

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

void WorkerPool::ParallelFor(const std::string& owner, int32_t priority, size_t n,
                             const std::function<void(size_t)>& body) {
  if (n == 0) return;
  // Shared with the tasks, which may start after this returns: they touch
  // `body` only for an index they took, and this returns only once every
  // taken index has run.
  struct State {
    std::atomic<size_t> next{0};
    std::atomic<bool> failed{false};
    const std::function<void(size_t)>* body = nullptr;
    absl::Mutex mu;
    size_t done ABSL_GUARDED_BY(mu) = 0;
    std::exception_ptr error ABSL_GUARDED_BY(mu);
  };
  auto state = std::make_shared<State>();
  state->body = &body;
  // Every index is taken and counted, also after a body threw (the rest
  // are then skipped): the caller waits for the count, so no helper can
  // touch `body` after this returns or throws.
  auto work = [state, n] {
    size_t ran = 0;
    std::exception_ptr error;
    for (size_t i; (i = state->next.fetch_add(1)) < n; ++ran) {
      if (state->failed.load(std::memory_order_relaxed)) continue;
      try {
        (*state->body)(i);
      } catch (...) {
        error = std::current_exception();
        state->failed.store(true, std::memory_order_relaxed);
      }
    }
    if (ran > 0) {
      absl::MutexLock lock(&state->mu);
      state->done += ran;
      if (error && !state->error) state->error = error;
    }
  };
  const size_t helpers = std::min(n - 1, threads_.size());
  for (size_t h = 0; h < helpers; ++h) {
    try {
      Submit(owner, priority, work);
    } catch (...) {
      break;  // no memory for another helper's task: fewer helpers
    }
  }
  work();
  std::pair<State*, size_t> all{state.get(), n};
  absl::MutexLock lock(&state->mu);
  state->mu.Await(absl::Condition(
      +[](std::pair<State*, size_t>* p) ABSL_NO_THREAD_SAFETY_ANALYSIS {
        return p->first->done == p->second;
      },
      &all));
  if (state->error) std::rethrow_exception(state->error);
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
