// The waiter's poll window (wait_policy.h): jobs on one node always poll;
// between nodes, operations past kPollMaxBytesBetweenNodes per rank (what
// the rank sends or receives) sleep at once.
#include "wait_policy.h"

#include <gtest/gtest.h>

namespace ciuic::internal {
namespace {

using wire::Collective;

TEST(WaitPolicyTest, OneNodeAlwaysPolls) {
  for (Collective c : {Collective::kAllreduce, Collective::kAllgather, Collective::kAlltoall}) {
    EXPECT_EQ(PollMicros(50, c, uint64_t{1} << 30, 4, 4), 50u);
  }
}

TEST(WaitPolicyTest, BetweenNodesOnlySmallOperationsPoll) {
  const uint64_t limit = kPollMaxBytesBetweenNodes;
  EXPECT_EQ(PollMicros(50, Collective::kAllreduce, 8, 2, 1), 50u);
  EXPECT_EQ(PollMicros(50, Collective::kAllreduce, limit, 2, 1), 50u);
  EXPECT_EQ(PollMicros(50, Collective::kAllreduce, limit + 1, 2, 1), 0u);
  EXPECT_EQ(PollMicros(50, Collective::kBarrier, 0, 2, 1), 50u);
  // What the rank receives (allgather) or sends (reduce_scatter) counts:
  // 4 ranks of a quarter of the limit each is the limit.
  EXPECT_EQ(PollMicros(50, Collective::kAllgather, limit / 4, 4, 2), 50u);
  EXPECT_EQ(PollMicros(50, Collective::kAllgather, limit / 4 + 1, 4, 2), 0u);
  EXPECT_EQ(PollMicros(50, Collective::kReduceScatter, limit / 4 + 1, 4, 2), 0u);
  EXPECT_EQ(PollMicros(50, Collective::kAlltoall, limit / 4 + 1, 4, 2), 0u);
  EXPECT_EQ(PollMicros(50, Collective::kBroadcast, limit + 1, 2, 1), 0u);
  // Alltoallv's sizes are in its splits: it polls.
  EXPECT_EQ(PollMicros(50, Collective::kAlltoallv, limit * 8, 2, 1), 50u);
  // CIUIC_SPIN_US=0: never.
  EXPECT_EQ(PollMicros(0, Collective::kAllreduce, 8, 2, 1), 0u);
}

}  // namespace
}  // namespace ciuic::internal
