#include "engine/worker_pool.h"

#include <gtest/gtest.h>

#include <atomic>
#include <future>
#include <mutex>
#include <set>
#include <stdexcept>
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

// A body that throws, on the caller or on a worker, does not take the
// process down: ParallelFor rethrows the first exception to its caller only
// once no helper touches `body` any more (the lambda and what it captures
// die right after), skips what had not begun, and the pool goes on.
TEST(WorkerPoolTest, ParallelForRethrowsABodysExceptionAfterEveryHelperIsDone) {
  WorkerPool pool(3);
  for (int round = 0; round < 50; ++round) {
    auto in_body = std::make_shared<std::atomic<int>>(0);
    auto after_return = std::make_shared<std::atomic<int>>(0);
    auto returned = std::make_shared<std::atomic<bool>>(false);
    const size_t thrower = static_cast<size_t>(round * 7) % 200;
    try {
      pool.ParallelFor("job", 0, 200, [=](size_t i) {
        if (returned->load()) after_return->fetch_add(1);
        in_body->fetch_add(1);
        std::this_thread::sleep_for(std::chrono::microseconds(i % 5 == 0 ? 100 : 0));
        if (i == thrower) throw std::runtime_error("index " + std::to_string(i));
        in_body->fetch_sub(1);
      });
      FAIL() << "round " << round << ": no exception";
    } catch (const std::runtime_error& e) {
      returned->store(true);
      EXPECT_EQ(std::string(e.what()), "index " + std::to_string(thrower));
    }
    EXPECT_EQ(in_body->load(), 1) << "a body was still running when ParallelFor threw";
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
    EXPECT_EQ(after_return->load(), 0) << "a helper ran the body after ParallelFor threw";
  }
  std::atomic<int> ran{0};
  pool.ParallelFor("job", 0, 100, [&](size_t) { ++ran; });
  EXPECT_EQ(ran.load(), 100);
}

}  // namespace
}  // namespace ciuic::daemon
