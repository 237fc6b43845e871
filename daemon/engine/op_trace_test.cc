#include "engine/op_trace.h"

#include "gtest/gtest.h"

namespace ciuic::daemon {
namespace {

using Clock = OpRecord::Clock;
using std::chrono::microseconds;

OpRecord Record(const std::string& job, const std::string& name, Clock::time_point at) {
  OpRecord r;
  r.job_id = job;
  r.name = name;
  r.sig.collective = static_cast<uint32_t>(wire::Collective::kAllreduce);
  r.sig.dtype = static_cast<uint32_t>(wire::DataType::kFloat32);
  r.sig.count = 4;
  r.bytes = 16;
  r.submitted = at;
  r.arrivals = {{1, at + microseconds(30)}, {0, at}};
  r.launched = at + microseconds(30);
  r.done = at + microseconds(100);
  return r;
}

TEST(TraceLogTest, KeepsTheLastCapacityRecordsOldestFirst) {
  TraceLog log;
  const Clock::time_point origin = Clock::now();
  for (int i = 0; i < 10; ++i) {
    log.Add(Record("a", "op" + std::to_string(i), origin + microseconds(1000 * i)), 4);
  }
  EXPECT_EQ(log.recorded(), 10u);
  EngineTrace t = log.Select("", 0, origin, 4);
  ASSERT_EQ(t.ops.size(), 4u);
  EXPECT_EQ(t.ops[0].name, "op6");
  EXPECT_EQ(t.ops[3].name, "op9");
  EXPECT_EQ(t.ops[0].submitted_us, 6000u);
  EXPECT_EQ(t.capacity, 4u);
  EXPECT_EQ(t.recorded, 10u);
  // A smaller capacity applies at the next record; 0 keeps nothing.
  log.Add(Record("a", "op10", origin), 2);
  EXPECT_EQ(log.Select("", 0, origin, 2).ops.size(), 2u);
  log.Add(Record("a", "op11", origin), 0);
  EXPECT_TRUE(log.Select("", 0, origin, 0).ops.empty());
  EXPECT_EQ(log.recorded(), 12u);
}

TEST(TraceLogTest, SelectsByJobAndLast) {
  TraceLog log;
  const Clock::time_point origin = Clock::now();
  for (int i = 0; i < 6; ++i) {
    log.Add(Record(i % 2 ? "b" : "a", "op" + std::to_string(i), origin), 100);
  }
  EngineTrace b = log.Select("b", 0, origin, 100);
  ASSERT_EQ(b.ops.size(), 3u);
  EXPECT_EQ(b.ops[0].name, "op1");
  EXPECT_EQ(b.ops[2].name, "op5");
  EngineTrace last = log.Select("a", 2, origin, 100);
  ASSERT_EQ(last.ops.size(), 2u);
  EXPECT_EQ(last.ops[0].name, "op2");
  EXPECT_EQ(last.ops[1].name, "op4");
  EXPECT_TRUE(log.Select("c", 0, origin, 100).ops.empty());
}

TEST(TraceLogTest, AnOwnerSeesOnlyItsOwnJobsAndCountsTheOthers) {
  TraceLog log;
  const Clock::time_point origin = Clock::now();
  for (int i = 0; i < 6; ++i) {
    OpRecord r = Record("same-id", "op" + std::to_string(i), origin);
    r.uid = i % 3 == 0 ? 1000 : 2000;  // two users, one job id
    log.Add(std::move(r), 100);
  }
  EngineTrace mine = log.Select("", 0, origin, 100, 1000u);
  ASSERT_EQ(mine.ops.size(), 2u);
  EXPECT_EQ(mine.ops[0].name, "op0");
  EXPECT_EQ(mine.ops[1].name, "op3");
  EXPECT_EQ(mine.other_users, 4u);
  EngineTrace last = log.Select("same-id", 1, origin, 100, 2000u);
  ASSERT_EQ(last.ops.size(), 1u);
  EXPECT_EQ(last.ops[0].name, "op5");
  EXPECT_EQ(last.other_users, 2u);
  EngineTrace all = log.Select("", 0, origin, 100);
  EXPECT_EQ(all.ops.size(), 6u);
  EXPECT_EQ(all.other_users, 0u);
}

TEST(TraceLogTest, RowTimesAreAfterTheFirstSubmission) {
  const Clock::time_point origin = Clock::now();
  OpRecord r = Record("a", "x", origin + microseconds(500));
  OpTraceRow row = RowOf(r, origin);
  EXPECT_EQ(row.collective, "allreduce");
  EXPECT_EQ(row.dtype, "float32");
  EXPECT_EQ(row.submitted_us, 500u);
  // Rank order, each after the first submission.
  ASSERT_EQ(row.arrivals.size(), 2u);
  EXPECT_EQ(row.arrivals[0], std::make_pair(0, uint64_t{0}));
  EXPECT_EQ(row.arrivals[1], std::make_pair(1, uint64_t{30}));
  EXPECT_EQ(row.launched_us, 30);
  EXPECT_EQ(row.done_us, 100u);
  // Single node: no cluster phases.
  EXPECT_EQ(row.ready_us, -1);
  EXPECT_EQ(row.run_start_us, -1);
  // Multi-node: the phases that happened, -1 for those that did not.
  r.cluster = std::make_shared<ClusterOp::Timing>();
  r.cluster->ready = r.submitted + microseconds(35);
  r.cluster->announced = r.submitted + microseconds(60);
  r.cluster->last_node = "n1";
  r.cluster->ready_spread_us = 20;
  r.cluster->fused_ops = 3;
  r.status = absl::DeadlineExceededError("late");
  row = RowOf(r, origin);
  EXPECT_EQ(row.ready_us, 35);
  EXPECT_EQ(row.announced_us, 60);
  EXPECT_EQ(row.run_start_us, -1);
  EXPECT_EQ(row.last_node, "n1");
  EXPECT_EQ(row.fused_ops, 3u);
  EXPECT_EQ(row.code, static_cast<int>(absl::StatusCode::kDeadlineExceeded));
  EXPECT_EQ(row.error, "late");
}

}  // namespace
}  // namespace ciuic::daemon
