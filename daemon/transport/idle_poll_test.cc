#include "transport/idle_poll.h"

#include <gtest/gtest.h>

#include <chrono>

namespace ciuic::daemon {
namespace {

using std::chrono::microseconds;
using Clock = IdlePolicy::Clock;

// Drives a policy on a made-up clock: idle periods of given lengths, each
// ended by work.
class IdlePolicyTest : public ::testing::Test {
 protected:
  // Idle for `gap`, polling every microsecond while the policy says so;
  // returns how long it polled before choosing to sleep (gap if it polled
  // throughout). Work arrives at the end of the gap.
  microseconds IdleFor(IdlePolicy& p, microseconds gap) {
    microseconds polled = gap;
    for (microseconds t{0}; t < gap; t += microseconds(1)) {
      if (!p.KeepPolling(now_ + t)) {
        polled = t;
        break;
      }
    }
    now_ += gap;
    p.Worked(now_);
    return polled;
  }

  Clock::time_point now_ = Clock::time_point{} + std::chrono::hours(1);
};

TEST_F(IdlePolicyTest, PollsForTheWindowWhileGapsAreShort) {
  IdlePolicy p(microseconds(100));
  for (int i = 0; i < 50; ++i) EXPECT_EQ(IdleFor(p, microseconds(10)), microseconds(10));
  EXPECT_NEAR(p.average_gap_us(), 10, 0.5);
  // A gap longer than the window: it polls for the window, then sleeps.
  EXPECT_EQ(IdleFor(p, microseconds(300)), microseconds(100));
}

TEST_F(IdlePolicyTest, SleepsAtOnceWhenWorkComesBackSlowerThanTheWindow) {
  IdlePolicy p(microseconds(100));
  // A slow link: a fragment every 500 us. The first gaps are polled in vain
  // (for the window), then the average passes the window and it sleeps at
  // once.
  int polled_in_vain = 0;
  for (int i = 0; i < 20; ++i) {
    if (IdleFor(p, microseconds(500)) > microseconds(0)) ++polled_in_vain;
  }
  EXPECT_GE(polled_in_vain, 1);
  EXPECT_LE(polled_in_vain, 3);
  EXPECT_EQ(IdleFor(p, microseconds(500)), microseconds(0));
  EXPECT_GT(p.average_gap_us(), 100);
}

TEST_F(IdlePolicyTest, OneLongPauseCostsOnlyAFewSleeps) {
  IdlePolicy p(microseconds(100));
  for (int i = 0; i < 20; ++i) IdleFor(p, microseconds(5));
  // A training step's compute: a second of nothing, counted as 4 windows.
  EXPECT_EQ(IdleFor(p, std::chrono::seconds(1)), microseconds(100));
  EXPECT_LE(p.average_gap_us(), 0.25 * 400 + 0.75 * 5 + 1e-9);
  // Fast work again: polling resumes within a few gaps.
  int sleeps = 0;
  for (int i = 0; i < 10; ++i) {
    if (IdleFor(p, microseconds(5)) == microseconds(0)) ++sleeps;
  }
  EXPECT_LE(sleeps, 2);
  EXPECT_EQ(IdleFor(p, microseconds(5)), microseconds(5));
}

TEST_F(IdlePolicyTest, AZeroWindowNeverPolls) {
  IdlePolicy p(microseconds(0));
  for (int i = 0; i < 5; ++i) EXPECT_EQ(IdleFor(p, microseconds(3)), microseconds(0));
}

TEST_F(IdlePolicyTest, WorkWithoutIdleChangesNothing) {
  IdlePolicy p(microseconds(100));
  for (int i = 0; i < 10; ++i) p.Worked(now_ + microseconds(i * 1000));
  EXPECT_EQ(p.average_gap_us(), 0);
  EXPECT_TRUE(p.KeepPolling(now_));
}

}  // namespace
}  // namespace ciuic::daemon
