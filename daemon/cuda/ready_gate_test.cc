// ReadyGate on any machine: the waits are flags the test sets (what
// cudaEventQuery on a trainer's IPC event says on a GPU).
#include "cuda/ready_gate.h"

#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <vector>

#include "ciuic/shm_layout.h"

namespace ciuic::daemon {
namespace {

using Clock = ReadyGate::Clock;
using namespace std::chrono_literals;

// What a trainer hears of a message (the completion's bytes).
std::string Heard(const std::string& m) {
  char out[wire::kMaxMessage];
  return std::string(out, wire::ClipMessage(m.data(), m.size(), out));
}

// A trainer stream's point: not reached until the test says so; counts how
// often it was asked.
struct Point {
  bool reached = false;
  absl::Status error;
  int asked = 0;
};

ReadyGate::Wait WaitOn(const std::string& who, std::shared_ptr<Point> p) {
  return ReadyGate::Wait{who, [p]() -> absl::StatusOr<bool> {
                           ++p->asked;
                           if (!p->error.ok()) return p->error;
                           return p->reached;
                         }};
}

// What each entry's `pass` was told, in the order told.
struct Log {
  std::vector<std::pair<std::string, absl::Status>> told;
  int Count(const std::string& name) const {
    int n = 0;
    for (auto& [who, s] : told) n += who == name;
    return n;
  }
};

ReadyGate::Entry EntryOf(const std::string& lane, const std::string& name, Log* log,
                         std::vector<ReadyGate::Wait> waits, Clock::time_point deadline,
                         std::vector<uint64_t> sessions = {}) {
  ReadyGate::Entry e;
  e.lane = lane;
  e.what = "operation '" + name + "'";
  e.waits = std::move(waits);
  e.sessions = std::move(sessions);
  e.deadline = deadline;
  e.pass = [log, name](absl::Status s) { log->told.emplace_back(name, std::move(s)); };
  return e;
}

const Clock::time_point kT0 = Clock::now();
const Clock::time_point kLater = kT0 + 1h;

TEST(ReadyGateTest, AnEntryWithoutWaitsPassesAtOnce) {
  ReadyGate gate;
  Log log;
  gate.Add(EntryOf("job", "a", &log, {}, kLater));
  EXPECT_EQ(gate.held(), 1u);
  EXPECT_EQ(gate.Poll(kT0), 0u);
  ASSERT_EQ(log.told.size(), 1u);
  EXPECT_TRUE(log.told[0].second.ok());
}

TEST(ReadyGateTest, AnEntryPassesOnceEveryWaitIsReachedAndAsksEachUntilItIs) {
  ReadyGate gate;
  Log log;
  auto r0 = std::make_shared<Point>(), r1 = std::make_shared<Point>();
  gate.Add(EntryOf("job", "a", &log, {WaitOn("rank 0's stream", r0), WaitOn("rank 1's stream", r1)},
                   kLater));
  EXPECT_EQ(gate.Poll(kT0), 1u);
  EXPECT_EQ(r0->asked, 1);
  EXPECT_EQ(r1->asked, 0);  // not before rank 0's
  r0->reached = true;
  EXPECT_EQ(gate.Poll(kT0), 1u);
  EXPECT_EQ(r0->asked, 2);
  EXPECT_EQ(r1->asked, 1);
  EXPECT_TRUE(log.told.empty());
  r1->reached = true;
  EXPECT_EQ(gate.Poll(kT0), 0u);
  EXPECT_EQ(r0->asked, 2);  // once reached, not asked again
  ASSERT_EQ(log.told.size(), 1u);
  EXPECT_TRUE(log.told[0].second.ok());
  EXPECT_EQ(gate.Poll(kT0), 0u);
  EXPECT_EQ(log.told.size(), 1u);  // exactly once
}

TEST(ReadyGateTest, ALanePassesInOrderAndALaneHeldUpHoldsUpNoOther) {
  ReadyGate gate;
  Log log;
  auto first = std::make_shared<Point>(), second = std::make_shared<Point>(),
       other = std::make_shared<Point>();
  second->reached = true;
  other->reached = true;
  gate.Add(EntryOf("job", "first", &log, {WaitOn("rank 0's stream", first)}, kLater));
  gate.Add(EntryOf("job", "second", &log, {WaitOn("rank 0's stream", second)}, kLater));
  gate.Add(EntryOf("other job", "other", &log, {WaitOn("rank 0's stream", other)}, kLater));
  EXPECT_EQ(gate.Poll(kT0), 2u);
  ASSERT_EQ(log.told.size(), 1u);
  EXPECT_EQ(log.told[0].first, "other");
  EXPECT_EQ(second->asked, 0);  // behind its lane's head
  first->reached = true;
  EXPECT_EQ(gate.Poll(kT0), 0u);
  ASSERT_EQ(log.told.size(), 3u);
  EXPECT_EQ(log.told[1].first, "first");
  EXPECT_EQ(log.told[2].first, "second");  // in the same poll, after its head
}

TEST(ReadyGateTest, AHeadPastItsDeadlineFailsNamingTheStreamsNotReachedAndTheNextGoesOn) {
  ReadyGate gate;
  Log log;
  auto r0 = std::make_shared<Point>(), r1 = std::make_shared<Point>(),
       r2 = std::make_shared<Point>(), next = std::make_shared<Point>();
  r0->reached = true;
  next->reached = true;
  ReadyGate::Entry e = EntryOf(
      "job", "a", &log,
      {WaitOn("rank 0's stream", r0), WaitOn("rank 1's stream", r1), WaitOn("rank 2's stream", r2)},
      kT0 + 100ms);
  e.added = kT0;
  gate.Add(std::move(e));
  gate.Add(EntryOf("job", "b", &log, {WaitOn("rank 0's stream", next)}, kLater));
  EXPECT_EQ(gate.Poll(kT0 + 99ms), 2u);
  EXPECT_TRUE(log.told.empty());
  EXPECT_EQ(gate.Poll(kT0 + 100ms), 0u);
  ASSERT_EQ(log.told.size(), 2u);
  EXPECT_EQ(log.told[0].first, "a");
  const absl::Status& s = log.told[0].second;
  EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded);
  const std::string m(s.message());
  EXPECT_NE(m.find("operation 'a'"), std::string::npos) << m;
  EXPECT_NE(m.find("100 ms"), std::string::npos) << m;
  EXPECT_NE(m.find("rank 1's stream, rank 2's stream"), std::string::npos) << m;
  EXPECT_EQ(m.find("rank 0's"), std::string::npos) << m;  // it was reached
  // A trainer hears wire::ClipMessage of it: the verdict is in that.
  const std::string verdict = "nothing of the operation ran";
  ASSERT_NE(m.find(verdict), std::string::npos) << m;
  EXPECT_NE(Heard(m).find(verdict), std::string::npos) << Heard(m);
  EXPECT_EQ(log.told[1].first, "b");
  EXPECT_TRUE(log.told[1].second.ok());
}

// Eight ranks not reached (a node's GPUs), each with a send and a receive
// event, under the longest name a trainer may give (kMaxOpName): the verdict still comes
// within what the trainer hears, after the engine's "operation '<name>': ".
TEST(ReadyGateTest, TheTimeoutVerdictFitsWithManyStreamsAndALongName) {
  ReadyGate gate;
  Log log;
  std::vector<ReadyGate::Wait> waits;
  for (int rank = 16; rank < 24; ++rank) {
    for (int event = 0; event < 2; ++event) {
      waits.push_back(
          WaitOn("rank " + std::to_string(rank) + "'s stream", std::make_shared<Point>()));
    }
  }
  // The device runner names nothing: the engine puts the operation's name
  // in front.
  ReadyGate::Entry a = EntryOf("job", "a", &log, std::move(waits), kT0 + 30s);
  a.what.clear();
  a.added = kT0;
  gate.Add(std::move(a));
  ReadyGate::Entry b =
      EntryOf("job", "b", &log, {WaitOn("rank 16's stream", std::make_shared<Point>())}, kT0 + 1s);
  b.what.clear();
  b.added = kT0;
  gate.Add(std::move(b));
  EXPECT_EQ(gate.Poll(kT0 + 1s), 1u);  // b, behind a
  EXPECT_EQ(gate.Poll(kT0 + 30s), 0u);
  ASSERT_EQ(log.told.size(), 2u);
  EXPECT_EQ(log.told[0].first, "b");
  EXPECT_EQ(log.told[1].first, "a");
  const std::string prefix = "operation '" + std::string(wire::kMaxOpName, 'n') + "': ";
  for (const auto& [name, status] : log.told) {
    const std::string m = prefix + std::string(status.message());
    const std::string verdict = "nothing of the operation ran";
    ASSERT_NE(m.find(verdict), std::string::npos) << m;
    EXPECT_NE(Heard(m).find(verdict), std::string::npos) << Heard(m);
  }
  EXPECT_NE(log.told[0].second.message().find("behind an earlier operation"), std::string::npos)
      << log.told[0].second;
  const std::string head(log.told[1].second.message());
  EXPECT_NE(head.find("30000 ms waiting for rank 16's stream, rank 17's stream, rank 18's stream "
                      "and 5 more to reach"),
            std::string::npos)
      << head;
}

TEST(ReadyGateTest, AnEntryBehindAHeldHeadFailsAtItsOwnDeadline) {
  ReadyGate gate;
  Log log;
  auto head = std::make_shared<Point>(), behind = std::make_shared<Point>();
  behind->reached = true;
  gate.Add(EntryOf("job", "head", &log, {WaitOn("rank 0's stream", head)}, kLater));
  ReadyGate::Entry e =
      EntryOf("job", "short", &log, {WaitOn("rank 0's stream", behind)}, kT0 + 50ms);
  e.added = kT0;
  gate.Add(std::move(e));
  gate.Add(EntryOf("job", "long", &log, {WaitOn("rank 0's stream", behind)}, kLater));
  EXPECT_EQ(gate.Poll(kT0 + 49ms), 3u);
  EXPECT_EQ(gate.Poll(kT0 + 50ms), 2u);
  ASSERT_EQ(log.told.size(), 1u);
  EXPECT_EQ(log.told[0].first, "short");
  EXPECT_EQ(log.told[0].second.code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_NE(log.told[0].second.message().find("behind an earlier operation"), std::string::npos)
      << log.told[0].second;
  EXPECT_EQ(behind->asked, 0);  // never asked: not at the head
  head->reached = true;
  EXPECT_EQ(gate.Poll(kT0 + 60ms), 0u);
  ASSERT_EQ(log.told.size(), 3u);
  EXPECT_EQ(log.told[1].first, "head");
  EXPECT_EQ(log.told[2].first, "long");
  EXPECT_TRUE(log.told[2].second.ok());
}

TEST(ReadyGateTest, AnEntryReachedAtItsDeadlinePasses) {
  ReadyGate gate;
  Log log;
  auto r0 = std::make_shared<Point>();
  r0->reached = true;
  gate.Add(EntryOf("job", "a", &log, {WaitOn("rank 0's stream", r0)}, kT0));
  EXPECT_EQ(gate.Poll(kT0 + 1h), 0u);
  ASSERT_EQ(log.told.size(), 1u);
  EXPECT_TRUE(log.told[0].second.ok());
}

TEST(ReadyGateTest, AWaitThatFailsFailsItsEntryWithItsError) {
  ReadyGate gate;
  Log log;
  auto r0 = std::make_shared<Point>(), r1 = std::make_shared<Point>();
  r1->error = absl::InternalError("an illegal memory access was encountered");
  gate.Add(EntryOf("job", "a", &log, {WaitOn("rank 0's stream", r0), WaitOn("rank 1's stream", r1)},
                   kLater));
  EXPECT_EQ(gate.Poll(kT0), 1u);  // rank 0's not reached: rank 1's not asked
  r0->reached = true;
  EXPECT_EQ(gate.Poll(kT0), 0u);
  ASSERT_EQ(log.told.size(), 1u);
  const absl::Status& s = log.told[0].second;
  EXPECT_EQ(s.code(), absl::StatusCode::kInternal);
  EXPECT_EQ(s.message(),
            "operation 'a': rank 1's stream: an illegal memory access was encountered");
}

TEST(ReadyGateTest, ASessionThatEndsFailsItsEntriesOnly) {
  ReadyGate gate;
  Log log;
  auto stuck = std::make_shared<Point>(), other = std::make_shared<Point>();
  gate.Add(EntryOf("job", "a", &log, {WaitOn("rank 1's stream", stuck)}, kLater, {10, 11}));
  gate.Add(EntryOf("job", "b", &log, {WaitOn("rank 1's stream", stuck)}, kLater, {10, 11}));
  gate.Add(EntryOf("other job", "c", &log, {WaitOn("rank 0's stream", other)}, kLater, {12}));
  gate.FailSession(11, absl::AbortedError("rank 1's session ended"));
  EXPECT_EQ(gate.held(), 1u);
  ASSERT_EQ(log.told.size(), 2u);
  EXPECT_EQ(log.told[0].first, "a");
  EXPECT_EQ(log.told[1].first, "b");
  EXPECT_EQ(log.told[0].second.code(), absl::StatusCode::kAborted);
  EXPECT_EQ(log.told[0].second.message(), "operation 'a': rank 1's session ended");
  gate.FailSession(99, absl::AbortedError("unknown"));
  EXPECT_EQ(gate.held(), 1u);
  other->reached = true;
  EXPECT_EQ(gate.Poll(kT0), 0u);
  EXPECT_EQ(log.Count("c"), 1);
  EXPECT_TRUE(log.told.back().second.ok());
}

TEST(ReadyGateTest, ALaneOrTheWholeGateShutFailsWhatItHolds) {
  ReadyGate gate;
  Log log;
  auto stuck = std::make_shared<Point>();
  gate.Add(EntryOf("job", "a", &log, {WaitOn("rank 0's stream", stuck)}, kLater));
  gate.Add(EntryOf("job", "b", &log, {}, kLater));
  gate.Add(EntryOf("job 2", "c", &log, {WaitOn("rank 0's stream", stuck)}, kLater));
  gate.Add(EntryOf("job 3", "d", &log, {WaitOn("rank 0's stream", stuck)}, kLater));
  gate.FailLane("job", absl::AbortedError("the job ended"));
  ASSERT_EQ(log.told.size(), 2u);
  EXPECT_EQ(log.told[0].first, "a");
  EXPECT_EQ(log.told[1].first, "b");
  EXPECT_EQ(log.told[1].second.code(), absl::StatusCode::kAborted);
  EXPECT_EQ(gate.held(), 2u);
  gate.FailAll(absl::UnavailableError("ciuicd is shutting down"));
  EXPECT_EQ(gate.held(), 0u);
  ASSERT_EQ(log.told.size(), 4u);
  EXPECT_EQ(log.told[3].second.message(), "operation 'd': ciuicd is shutting down");
  EXPECT_EQ(gate.Poll(kLater), 0u);
  EXPECT_EQ(log.told.size(), 4u);
}

TEST(ReadyGateTest, APassMayAddToTheGate) {
  ReadyGate gate;
  Log log;
  ReadyGate::Entry e = EntryOf("job", "a", &log, {}, kLater);
  e.pass = [&](absl::Status s) {
    log.told.emplace_back("a", s);
    gate.Add(EntryOf("job", "b", &log, {}, kLater));
  };
  gate.Add(std::move(e));
  EXPECT_EQ(gate.Poll(kT0), 1u);  // b is held: added after this poll looked
  EXPECT_EQ(gate.Poll(kT0), 0u);
  EXPECT_EQ(log.Count("a"), 1);
  EXPECT_EQ(log.Count("b"), 1);
}

}  // namespace
}  // namespace ciuic::daemon
