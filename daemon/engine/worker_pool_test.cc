#include "engine/worker_pool.h"

#include <gtest/gtest.h>

#include <future>
#include <mutex>
#include <string>
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

}  // namespace
}  // namespace ciuic::daemon
