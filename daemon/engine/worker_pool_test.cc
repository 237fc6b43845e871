#include "engine/worker_pool.h"

#include <gtest/gtest.h>

#include <atomic>
#include <future>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

namespace ciuic::daemon {
namespace {

// One worker, held while tasks queue: the order they then run in.
std::vector<std::string> RunOrder(
    const std::vector<std::tuple<std::string, int32_t, std::string>>& tasks) {
  std::vector<std::string> order;
  std::mutex mu;
  std::promise<void> release;
  std::shared_future<void> gate = release.get_future().share();
  {
    WorkerPool pool(1);
    std::promise<void> holding;
    pool.Submit("gate", 0, [&] {
      holding.set_value();
      gate.wait();
    });
    holding.get_future().wait();
    for (const auto& [owner, priority, name] : tasks) {
      pool.Submit(owner, priority, [&order, &mu, name = name] {
        std::lock_guard<std::mutex> lock(mu);
        order.push_back(name);
      });
    }
    release.set_value();
  }  // the destructor runs what is queued
  return order;
}

TEST(WorkerPoolTest, PriorityOrdersWorkWithinAJobOnly) {
  // Job a queues four urgent chunks first, then job b two ordinary ones:
  // the jobs take turns; a's high priority does not put b behind all of a.
  auto order = RunOrder({{"a", 100, "a1"},
                         {"a", 100, "a2"},
                         {"a", 100, "a3"},
                         {"a", 100, "a4"},
                         {"b", 0, "b1"},
                         {"b", 0, "b2"}});
  EXPECT_EQ(order, (std::vector<std::string>{"a1", "b1", "a2", "b2", "a3", "a4"}));
}

TEST(WorkerPoolTest, WithinAJobHigherPriorityFirstThenOlder) {
  auto order = RunOrder({{"a", 0, "low1"}, {"a", 5, "high"}, {"a", 0, "low2"}, {"a", 5, "high2"}});
  EXPECT_EQ(order, (std::vector<std::string>{"high", "high2", "low1", "low2"}));
}

// ParallelFor runs every index exactly once, shares them with the workers,
// and finishes on the calling thread alone while every worker is held by
// another job (the tasks that start late find nothing left and return).
TEST(WorkerPoolTest, ParallelForRunsEveryIndexOnceWithOrWithoutFreeWorkers) {
  WorkerPool pool(3);
  for (size_t n : {size_t{0}, size_t{1}, size_t{7}, size_t{1000}}) {
    std::vector<std::atomic<int>> runs(n);
    std::mutex mu;
    std::set<std::thread::id> threads;
    pool.ParallelFor("job", 0, n, [&](size_t i) {
      runs[i].fetch_add(1);
      std::lock_guard<std::mutex> lock(mu);
      threads.insert(std::this_thread::get_id());
      if (n == 1000 && threads.size() < 2) std::this_thread::sleep_for(std::chrono::microseconds(50));
    });
    for (size_t i = 0; i < n; ++i) ASSERT_EQ(runs[i].load(), 1) << "n " << n << " index " << i;
    if (n == 1000) EXPECT_GE(threads.size(), 2u);
  }
  // Every worker held by another job: the caller runs all 50 itself.
  std::promise<void> release;
  std::shared_future<void> gate = release.get_future().share();
  std::atomic<int> holding{0};
  for (int w = 0; w < 3; ++w) {
    pool.Submit("other", 0, [&] {
      ++holding;
      gate.wait();
    });
  }
  while (holding.load() < 3) std::this_thread::yield();
  std::atomic<int> ran{0};
  std::set<std::thread::id> threads;
  pool.ParallelFor("job", 0, 50, [&](size_t) {
    ++ran;
    threads.insert(std::this_thread::get_id());
  });
  EXPECT_EQ(ran.load(), 50);
  EXPECT_EQ(threads, std::set<std::thread::id>{std::this_thread::get_id()});
  release.set_value();
}

}  // namespace
}  // namespace ciuic::daemon
