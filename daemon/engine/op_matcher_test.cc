// The engine's matching rules (op_matcher.h), without sessions or a loop:
// wait and launch, priority and deadline, double submission, mismatch and
// its poisoning, deadlines, a failed job.
#include "engine/op_matcher.h"

#include <gtest/gtest.h>

#include <chrono>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "ciuic/shm_layout.h"

namespace ciuic::daemon {
namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

struct TestOp {
  std::string name;
  OpSignature sig;
  int32_t priority = 0;
  Clock::time_point first_submit;
  Clock::time_point deadline;
  std::vector<std::optional<uint64_t>> parts;  // the part: the rank's op id
  std::vector<bool> seen;
  int seen_count = 0;
  int submitted = 0;
  absl::Status failure;
  int made = 0;  // the engine's own fields: set by make()
};

using Matcher = OpMatcher<TestOp, uint64_t>;
using Kind = Matcher::Submitted::Kind;

OpSignature Sig(uint64_t count, uint32_t dtype = 1) {
  OpSignature s;
  s.collective = 1;
  s.dtype = dtype;
  s.reduce_op = 1;
  s.count = count;
  return s;
}

class OpMatcherTest : public ::testing::Test {
 protected:
  // World of 4, ranks 0..2 on this node.
  Matcher m_{4, 3};
  Clock::time_point t0_ = Clock::now();
  int made_ = 0;

  Matcher::Submitted Submit(int rank, const std::string& name, OpSignature sig,
                            int32_t priority = 0, milliseconds at = milliseconds(0),
                            milliseconds timeout = milliseconds(1000)) {
    return m_.Submit(rank, name, sig, priority, t0_ + at, timeout, uint64_t(100 + rank), [&] {
      auto op = std::make_shared<TestOp>();
      op->made = ++made_;
      return op;
    });
  }
};

TEST_F(OpMatcherTest, LaunchesWhenEveryLocalRankSubmittedInAnyOrder) {
  EXPECT_EQ(Submit(2, "g", Sig(8)).kind, Kind::kWaiting);
  EXPECT_EQ(Submit(0, "g", Sig(8)).kind, Kind::kWaiting);
  EXPECT_EQ(m_.pending().size(), 1u);
  auto last = Submit(1, "g", Sig(8));
  ASSERT_EQ(last.kind, Kind::kLaunch);
  EXPECT_TRUE(m_.empty());
  EXPECT_EQ(last.op->submitted, 3);
  EXPECT_EQ(last.op->made, 1);
  EXPECT_EQ(*last.op->parts[0], 100u);
  EXPECT_EQ(*last.op->parts[2], 102u);
  EXPECT_FALSE(last.op->parts[3].has_value());  // another node's rank
  // The name is free again: a new operation.
  EXPECT_EQ(Submit(0, "g", Sig(8)).op->made, 2);
}

TEST_F(OpMatcherTest, NamesAreIndependent) {
  EXPECT_EQ(Submit(0, "a", Sig(8)).kind, Kind::kWaiting);
  EXPECT_EQ(Submit(0, "b", Sig(16)).kind, Kind::kWaiting);
  EXPECT_EQ(Submit(1, "b", Sig(16)).kind, Kind::kWaiting);
  EXPECT_EQ(Submit(2, "b", Sig(16)).kind, Kind::kLaunch);
  EXPECT_EQ(m_.pending().count("a"), 1u);
}

TEST_F(OpMatcherTest, HighestPriorityAndEarliestDeadlineWin) {
  Submit(0, "p", Sig(8), 1, milliseconds(0), milliseconds(5000));
  Submit(1, "p", Sig(8), 7, milliseconds(10), milliseconds(100));
  auto last = Submit(2, "p", Sig(8), 3, milliseconds(20), milliseconds(5000));
  ASSERT_EQ(last.kind, Kind::kLaunch);
  EXPECT_EQ(last.op->priority, 7);
  EXPECT_EQ(last.op->deadline, t0_ + milliseconds(110));
  EXPECT_EQ(last.op->first_submit, t0_);
}

TEST_F(OpMatcherTest, ASecondSubmissionOfAPendingNameIsRefusedAndTheFirstGoesOn) {
  Submit(0, "d", Sig(8));
  auto again = Submit(0, "d", Sig(8));
  EXPECT_EQ(again.kind, Kind::kRefused);
  EXPECT_EQ(again.status.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(again.status.message(),
            "operation 'd' submitted twice by rank 0 while the first is pending");
  Submit(1, "d", Sig(8));
  auto last = Submit(2, "d", Sig(8));
  EXPECT_EQ(last.kind, Kind::kLaunch);
  EXPECT_EQ(*last.op->parts[0], 100u);
}

TEST_F(OpMatcherTest, AMismatchFailsTheOperationAndPoisonsTheNameUntilEveryRankSawIt) {
  Submit(0, "m", Sig(8));
  auto bad = Submit(1, "m", Sig(9));
  ASSERT_EQ(bad.kind, Kind::kMismatch);
  EXPECT_EQ(bad.status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(bad.other_rank, 0);
  EXPECT_EQ(bad.status.message(),
            "operation 'm' mismatched across ranks: rank 0 submitted " + Sig(8).ToString() +
                ", rank 1 submitted " + Sig(9).ToString());
  // The engine fails the parts submitted so far: rank 0's.
  std::vector<uint64_t> parts = m_.Fail(*bad.op, bad.status);
  EXPECT_EQ(parts, std::vector<uint64_t>{100});
  EXPECT_EQ(bad.op->submitted, 0);
  // Rank 2 comes later, with either signature: the same error at once.
  auto late = Submit(2, "m", Sig(8));
  EXPECT_EQ(late.kind, Kind::kRefused);
  EXPECT_EQ(late.status, bad.status);
  // Every local rank has seen it: the name is forgotten, a new operation.
  EXPECT_TRUE(m_.empty());
  EXPECT_EQ(Submit(0, "m", Sig(8)).kind, Kind::kWaiting);
}

TEST_F(OpMatcherTest, DtypeMismatchNamesBothSignatures) {
  Submit(2, "t", Sig(8, 1));
  auto bad = Submit(0, "t", Sig(8, 2));
  ASSERT_EQ(bad.kind, Kind::kMismatch);
  EXPECT_EQ(bad.other_rank, 2);
  EXPECT_NE(bad.status.message().find(Sig(8, 2).ToString()), std::string::npos);
}

// What a trainer hears of a mismatch (the message clipped to a completion's
// wire::kMaxMessage bytes) names both signatures also when the operation's
// name is as long as a trainer may give (wire::kMaxOpName).
TEST_F(OpMatcherTest, AMismatchOfALongNameStillShowsBothSignatures) {
  const std::string name(wire::kMaxOpName, 'n');
  OpSignature a = Sig(1048576, 1), b = Sig(1048577, 2);
  a.codec = b.codec = static_cast<uint32_t>(wire::Codec::kInt8);
  Submit(2, name, a);
  auto bad = Submit(0, name, b);
  ASSERT_EQ(bad.kind, Kind::kMismatch);
  const std::string full(bad.status.message());
  ASSERT_GT(full.size(), wire::kMaxMessage);
  char out[wire::kMaxMessage];
  const std::string heard(out, wire::ClipMessage(full.data(), full.size(), out));
  EXPECT_NE(heard.find("rank 2 submitted " + a.ToString()), std::string::npos) << heard;
  EXPECT_NE(heard.find("rank 0 submitted " + b.ToString()), std::string::npos) << heard;
  EXPECT_EQ(heard.find("operation '" + name.substr(0, wire::kNameHead) + "..."), 0u) << heard;
}

TEST_F(OpMatcherTest, ExpiredNamesTheRanksItWaitsFor) {
  Submit(0, "slow", Sig(8), 0, milliseconds(0), milliseconds(300));
  Submit(2, "slow", Sig(8), 0, milliseconds(50), milliseconds(300));
  Submit(0, "later", Sig(8), 0, milliseconds(0), milliseconds(5000));
  EXPECT_TRUE(m_.Expired(t0_ + milliseconds(299), {0, 1, 2}, "job").empty());
  auto expired = m_.Expired(t0_ + milliseconds(300), {0, 1, 2}, "job");
  ASSERT_EQ(expired.size(), 1u);
  EXPECT_EQ(expired[0].first->name, "slow");
  EXPECT_EQ(expired[0].second.code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_EQ(expired[0].second.message(),
            "operation 'slow' of job 'job' timed out after 300 ms waiting for rank(s) 1");
  // Ranks that never joined are not named; failed ones are not expired again.
  auto unjoined = m_.Expired(t0_ + milliseconds(300), {0, 2}, "job");
  EXPECT_EQ(unjoined[0].second.message(),
            "operation 'slow' of job 'job' timed out after 300 ms waiting for rank(s) of this "
            "node that have not joined");
  EXPECT_EQ(m_.Fail(*expired[0].first, expired[0].second), (std::vector<uint64_t>{100, 102}));
  EXPECT_TRUE(m_.Expired(t0_ + milliseconds(400), {0, 1, 2}, "job").empty());
  // The latecomer gets the timeout at once, and the name is then forgotten.
  auto late = Submit(1, "slow", Sig(8));
  EXPECT_EQ(late.kind, Kind::kRefused);
  EXPECT_EQ(late.status.code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_EQ(m_.pending().count("slow"), 0u);
}

TEST_F(OpMatcherTest, TakeAllEmptiesTheTable) {
  Submit(0, "a", Sig(8));
  Submit(1, "b", Sig(8));
  auto all = m_.TakeAll();
  EXPECT_EQ(all.size(), 2u);
  EXPECT_TRUE(m_.empty());
  EXPECT_EQ(m_.Fail(*all[1], absl::CancelledError("job over")), std::vector<uint64_t>{101});
}

TEST(OpMatcherSingleRank, EverySubmissionLaunchesAtOnce) {
  Matcher m(1, 1);
  auto r = m.Submit(0, "x", Sig(1), 0, Clock::now(), milliseconds(10), uint64_t{5},
                    [] { return std::make_shared<TestOp>(); });
  EXPECT_EQ(r.kind, Kind::kLaunch);
  EXPECT_TRUE(m.empty());
}

}  // namespace
}  // namespace ciuic::daemon
