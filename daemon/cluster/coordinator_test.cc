#include "cluster/coordinator.h"

#include <gtest/gtest.h>

#include <future>
#include <mutex>
#include <thread>
#include <vector>

namespace ciuic::daemon {
namespace {

using Clock = std::chrono::steady_clock;

class RecordingStream : public NodeStream {
 public:
  void Send(const proto::CoordinatorEvent& e) override {
    std::lock_guard<std::mutex> lock(mu_);
    events_.push_back(e);
  }
  std::vector<proto::CoordinatorEvent> events() {
    std::lock_guard<std::mutex> lock(mu_);
    return events_;
  }
  // Waits (bounded) until at least n events arrived.
  std::vector<proto::CoordinatorEvent> WaitFor(size_t n) {
    for (int i = 0; i < 300; ++i) {
      auto e = events();
      if (e.size() >= n) return e;
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    return events();
  }

 private:
  std::mutex mu_;
  std::vector<proto::CoordinatorEvent> events_;
};

proto::RegisterNodeRequest Reg(const std::string& node, std::vector<int> ranks, int world,
                               const std::string& token = "secret") {
  proto::RegisterNodeRequest r;
  r.set_cluster_token(token);
  r.set_job_id("job");
  r.set_uid(1000);
  r.set_world_size(world);
  r.set_node_name(node);
  for (int x : ranks) r.add_ranks(x);
  r.add_transport_addresses("addr-" + node);
  r.set_channels(1);
  return r;
}

proto::NodeEvent Ready(const std::string& name, uint64_t count, uint32_t timeout_ms = 0) {
  proto::NodeEvent e;
  e.mutable_ready()->set_name(name);
  e.mutable_ready()->mutable_signature()->set_collective(1);
  e.mutable_ready()->mutable_signature()->set_dtype(1);
  e.mutable_ready()->mutable_signature()->set_reduce_op(1);
  e.mutable_ready()->mutable_signature()->set_count(count);
  e.mutable_ready()->set_timeout_ms(timeout_ms);
  return e;
}

// Two nodes form a job: ranks {2,3} and {0,1}; the table lists rank 0's node first.
struct Formed {
  proto::Membership membership;
  RecordingStream streams[2];
  uint64_t handles[2];
};

void Form(Coordinator& c, Formed* f) {
  auto deadline = Clock::now() + std::chrono::seconds(5);
  auto b = std::async(std::launch::async, [&] { return c.Register(Reg("b", {2, 3}, 4), deadline); });
  auto a = c.Register(Reg("a", {0, 1}, 4), deadline);
  ASSERT_TRUE(a.ok()) << a.status();
  auto bm = b.get();
  ASSERT_TRUE(bm.ok()) << bm.status();
  EXPECT_EQ(a->SerializeAsString(), bm->SerializeAsString()) << "nodes got different tables";
  f->membership = *a;
  for (int n = 0; n < 2; ++n) {
    proto::NodeEvent::Hello h;
    h.set_cluster_token("secret");
    h.set_job_id("job");
    h.set_uid(1000);
    h.set_instance(a->instance());
    h.set_node(n);
    auto handle = c.Attach(h, &f->streams[n]);
    ASSERT_TRUE(handle.ok()) << handle.status();
    f->handles[n] = *handle;
  }
}

TEST(CoordinatorTest, MembershipOrdersNodesByLowestRank) {
  Coordinator c("secret");
  Formed f;
  Form(c, &f);
  ASSERT_EQ(f.membership.nodes_size(), 2);
  EXPECT_EQ(f.membership.nodes(0).node_name(), "a");
  EXPECT_EQ(f.membership.nodes(1).node_name(), "b");
  EXPECT_EQ(f.membership.nodes(1).transport_addresses(0), "addr-b");
}

TEST(CoordinatorTest, WrongTokenIsRefused) {
  Coordinator c("secret");
  auto r = c.Register(Reg("a", {0}, 2, "guess"), Clock::now() + std::chrono::seconds(1));
  EXPECT_EQ(r.status().code(), absl::StatusCode::kPermissionDenied);
}

TEST(CoordinatorTest, DuplicateRanksAndWorldMismatchAreRefused) {
  Coordinator c("secret");
  auto deadline = Clock::now() + std::chrono::milliseconds(300);
  auto first = std::async(std::launch::async, [&] { return c.Register(Reg("a", {0, 1}, 4), deadline); });
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  EXPECT_EQ(c.Register(Reg("b", {1, 2}, 4), deadline).status().code(), absl::StatusCode::kAlreadyExists);
  EXPECT_EQ(c.Register(Reg("c", {2, 3}, 8), deadline).status().code(), absl::StatusCode::kInvalidArgument);
  // Nobody completes the job: the first registration times out naming the count.
  auto r = first.get();
  EXPECT_EQ(r.status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_NE(r.status().message().find("2 of 4 ranks"), absl::string_view::npos) << r.status();
  EXPECT_EQ(c.num_jobs(), 0u);
}

TEST(CoordinatorTest, RunsWhenEveryNodeIsReadyInOneGlobalOrder) {
  Coordinator c("secret");
  Formed f;
  Form(c, &f);
  c.OnEvent(f.handles[0], Ready("x", 10));
  c.OnEvent(f.handles[1], Ready("y", 10));
  EXPECT_TRUE(f.streams[0].events().empty());
  c.OnEvent(f.handles[1], Ready("x", 10));
  c.OnEvent(f.handles[0], Ready("y", 10));
  for (auto& s : f.streams) {
    auto ev = s.WaitFor(2);
    ASSERT_EQ(ev.size(), 2u);
    EXPECT_EQ(ev[0].run().name(), "x");
    EXPECT_EQ(ev[0].run().seq(), 0u);
    EXPECT_EQ(ev[1].run().name(), "y");
    EXPECT_EQ(ev[1].run().seq(), 1u);
  }
}

TEST(CoordinatorTest, MismatchFailsOnEveryNodeNamingBoth) {
  Coordinator c("secret");
  Formed f;
  Form(c, &f);
  c.OnEvent(f.handles[0], Ready("g", 10));
  c.OnEvent(f.handles[1], Ready("g", 12));
  for (auto& s : f.streams) {
    auto ev = s.WaitFor(1);
    ASSERT_EQ(ev.size(), 1u);
    ASSERT_TRUE(ev[0].has_fail());
    EXPECT_EQ(ev[0].fail().code(), static_cast<int>(absl::StatusCode::kInvalidArgument));
    EXPECT_NE(ev[0].fail().message().find("count=10"), std::string::npos) << ev[0].fail().message();
    EXPECT_NE(ev[0].fail().message().find("count=12"), std::string::npos);
    EXPECT_NE(ev[0].fail().message().find("node b"), std::string::npos);
  }
}

TEST(CoordinatorTest, TimeoutFailsTheReadyNodesAndLateComers) {
  Coordinator c("secret");
  Formed f;
  Form(c, &f);
  c.OnEvent(f.handles[0], Ready("slow", 1, 200));
  auto ev = f.streams[0].WaitFor(1);
  ASSERT_EQ(ev.size(), 1u);
  EXPECT_EQ(ev[0].fail().code(), static_cast<int>(absl::StatusCode::kDeadlineExceeded));
  EXPECT_NE(ev[0].fail().message().find("node b (ranks 2,3)"), std::string::npos) << ev[0].fail().message();
  c.OnEvent(f.handles[1], Ready("slow", 1));
  auto late = f.streams[1].WaitFor(1);
  ASSERT_EQ(late.size(), 1u);
  EXPECT_EQ(late[0].fail().code(), static_cast<int>(absl::StatusCode::kDeadlineExceeded));
}

TEST(CoordinatorTest, LostNodeFailsTheJobOnTheOthers) {
  Coordinator c("secret");
  Formed f;
  Form(c, &f);
  c.Detach(f.handles[1], absl::UnavailableError("its stream ended"));
  auto ev = f.streams[0].WaitFor(1);
  ASSERT_EQ(ev.size(), 1u);
  ASSERT_TRUE(ev[0].has_job_failed());
  EXPECT_NE(ev[0].job_failed().message().find("lost node b"), std::string::npos);
  c.OnEvent(f.handles[0], Ready("after", 1));
  ev = f.streams[0].WaitFor(2);
  ASSERT_EQ(ev.size(), 2u);
  EXPECT_TRUE(ev[1].has_fail());
  c.Detach(f.handles[0], absl::OkStatus());
  EXPECT_EQ(c.num_jobs(), 0u);
}

}  // namespace
}  // namespace ciuic::daemon
