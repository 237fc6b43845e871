#include "cluster/coordinator.h"

#include <gtest/gtest.h>

#include <functional>
#include <future>
#include <mutex>
#include <optional>
#include <sstream>
#include <thread>
#include <vector>

#include "ciuic/collective_rules.h"
#include "ciuic/shm_layout.h"
#include "absl/strings/str_cat.h"
#include "cluster/channel_weights.h"
#include "cluster/membership.h"
#include "collectives/internode/internode.h"
#include "config/tuning.h"
#include "spdlog/sinks/ostream_sink.h"
#include "spdlog/spdlog.h"

namespace ciuic::daemon {
namespace {

using Clock = std::chrono::steady_clock;

class RecordingStream : public NodeStream {
 public:
  void Send(const proto::CoordinatorEvent& e) override {
    std::lock_guard<std::mutex> lock(mu_);
    if (e.has_heartbeat()) {
      ++heartbeats_;
      return;  // the tests here look at what the job says
    }
    events_.push_back(e);
  }
  int heartbeats() {
    std::lock_guard<std::mutex> lock(mu_);
    return heartbeats_;
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
  int heartbeats_ = 0;
};

proto::RegisterNodeRequest Reg(const std::string& node, std::vector<int> ranks, int world,
                               int channels = 1) {
  proto::RegisterNodeRequest r;
  r.set_job_id("job");
  r.set_uid(1000);
  r.set_world_size(world);
  r.set_node_name(node);
  for (int x : ranks) r.add_ranks(x);
  for (int c = 0; c < channels; ++c) r.add_transport_addresses("addr-" + node);
  r.set_channels(channels);
  r.set_protocol(kPeerProtocol);
  return r;
}

// A sum over `count` elements of `dtype`: an allreduce when `fusable` (the
// coordinator may fuse it with others like it), else a reduce_scatter (never
// fused).
proto::NodeEvent Ready(const std::string& name, uint64_t count, uint32_t timeout_ms = 0,
                       int32_t priority = 0, bool fusable = false, uint32_t dtype = 1,
                       uint32_t reduce_op = 1, uint32_t codec = 0) {
  proto::NodeEvent e;
  e.mutable_ready()->set_name(name);
  e.mutable_ready()->mutable_signature()->set_collective(fusable ? 1 : 2);
  e.mutable_ready()->mutable_signature()->set_dtype(dtype);
  e.mutable_ready()->mutable_signature()->set_reduce_op(reduce_op);
  e.mutable_ready()->mutable_signature()->set_count(count);
  e.mutable_ready()->mutable_signature()->set_codec(codec);
  e.mutable_ready()->set_timeout_ms(timeout_ms);
  e.mutable_ready()->set_priority(priority);
  return e;
}

proto::NodeEvent Done(uint64_t seq) {
  proto::NodeEvent e;
  e.mutable_done()->set_seq(seq);
  return e;
}

// "name" or "name+other+..." for a Run, "fail:name" for a Fail.
std::vector<std::string> Runs(const std::vector<proto::CoordinatorEvent>& events) {
  std::vector<std::string> out;
  for (const auto& e : events) {
    if (e.has_run()) {
      std::string s = e.run().name();
      for (const auto& n : e.run().fused_with()) s += "+" + n;
      out.push_back(s);
    } else if (e.has_fail()) {
      out.push_back("fail:" + e.fail().name());
    } else {
      out.push_back("job_failed");
    }
  }
  return out;
}

// Two nodes form a job: ranks {2,3} and {0,1}; the table lists rank 0's node first.
// Declare it before the Coordinator: the streams must outlive it (its timer
// thread may still send to them until it is destroyed; the tests do not
// Detach).
struct Formed {
  proto::Membership membership;
  RecordingStream streams[2];
  uint64_t handles[2];
};

void Form(Coordinator& c, Formed* f, int channels = 1) {
  auto deadline = Clock::now() + std::chrono::seconds(5);
  auto b = std::async(std::launch::async,
                      [&] { return c.Register(Reg("b", {2, 3}, 4, channels), deadline); });
  auto a = c.Register(Reg("a", {0, 1}, 4, channels), deadline);
  ASSERT_TRUE(a.ok()) << a.status();
  auto bm = b.get();
  ASSERT_TRUE(bm.ok()) << bm.status();
  EXPECT_EQ(a->SerializeAsString(), bm->SerializeAsString()) << "nodes got different tables";
  f->membership = *a;
  for (int n = 0; n < 2; ++n) {
    proto::NodeEvent::Hello h;
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
  Formed f;
  Coordinator c;
  Form(c, &f);
  ASSERT_EQ(f.membership.nodes_size(), 2);
  EXPECT_EQ(f.membership.nodes(0).node_name(), "a");
  EXPECT_EQ(f.membership.nodes(1).node_name(), "b");
  EXPECT_EQ(f.membership.nodes(1).transport_addresses(0), "addr-b");
}

// What a registration may hold is bounded before anything is kept of it
// (the sender is another daemon, perhaps broken): each refusal names its
// problem, and nothing of the job stays behind.
TEST(CoordinatorTest, RegistrationsOutOfBoundsAreRefused) {
  Coordinator c(nullptr, /*max_world_size=*/1024);
  const auto deadline = Clock::now() + std::chrono::seconds(1);
  const auto refused = [&](const proto::RegisterNodeRequest& r, const std::string& why) {
    auto m = c.Register(r, deadline);
    EXPECT_EQ(m.status().code(), absl::StatusCode::kInvalidArgument) << m.status();
    EXPECT_NE(m.status().message().find(why), absl::string_view::npos) << m.status();
  };
  refused(Reg("a", {0}, 1025), "world size 1025 is not in 1..1024");
  refused(Reg("a", {1, 1}, 4), "names rank 1 twice");
  refused(Reg("a", {4}, 4), "rank 4 is not in a world of size 4");
  refused(Reg(std::string(256, 'n'), {0}, 4), "node name of 256 bytes");
  auto r = Reg("a", {0}, 4);
  r.set_job_id(std::string(257, 'j'));
  refused(r, "job id of 257 bytes");
  r = Reg("a", {0}, 4);
  r.set_channels(2);
  refused(r, "1 transport addresses for 2 channels");
  r = Reg("a", {0}, 4);
  r.set_transport_addresses(0, std::string((64 << 10) + 1, 'x'));
  refused(r, "transport address of 65537 bytes");
  r = Reg("a", {0}, 4);
  r.set_channels(65);
  refused(r, "65 channels");
  r = Reg("a", {0}, 4);
  r.set_rack(std::string(65, 'r'));
  refused(r, "rack name of 65 bytes");
  EXPECT_EQ(c.num_jobs(), 0u);
}

// Daemons that speak different peer protocols (two ciuicd versions) never
// form a job: the registration of the odd one out is refused naming both
// protocols, and a node already waiting hears the same at once instead of
// when its registration times out.
TEST(CoordinatorTest, ANodeOfAnotherPeerProtocolIsRefusedAndTheJobFailsAtOnce) {
  Coordinator c;
  const auto deadline = Clock::now() + std::chrono::seconds(30);
  auto older = Reg("old", {0}, 1);
  older.clear_protocol();  // a daemon that predates the field
  auto refused = c.Register(older, deadline);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition) << refused.status();
  EXPECT_NE(refused.status().message().find(
                "node old runs a ciuicd that predates peer protocol numbers and the "
                "coordinator of job 'job' runs peer protocol "),
            absl::string_view::npos)
      << refused.status();
  EXPECT_EQ(c.num_jobs(), 0u);

  const auto start = Clock::now();
  auto waiting = std::async(std::launch::async, [&] { return c.Register(Reg("a", {0}, 2), deadline); });
  for (int i = 0; i < 5000 && c.num_jobs() == 0; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  ASSERT_EQ(c.num_jobs(), 1u);
  auto newer = Reg("b", {1}, 2);
  newer.set_protocol(kPeerProtocol + 1);
  auto b = c.Register(newer, deadline);
  EXPECT_EQ(b.status().code(), absl::StatusCode::kFailedPrecondition) << b.status();
  EXPECT_NE(b.status().message().find(absl::StrCat("node b runs peer protocol ",
                                                   kPeerProtocol + 1)),
            absl::string_view::npos)
      << b.status();
  auto a = waiting.get();
  EXPECT_EQ(a.status(), b.status());
  EXPECT_LT(Clock::now() - start, std::chrono::seconds(10));
  EXPECT_EQ(c.num_jobs(), 0u);

  // The same job id forms once every node speaks one protocol.
  auto again = std::async(std::launch::async, [&] { return c.Register(Reg("a", {0}, 2), deadline); });
  auto b2 = c.Register(Reg("b", {1}, 2), deadline);
  ASSERT_TRUE(b2.ok()) << b2.status();
  EXPECT_EQ(b2->protocol(), kPeerProtocol);
  ASSERT_TRUE(again.get().ok());
}

// Each rank is registered once across the nodes; a node whose registration
// times out withdraws its ranks, which another node may then take.
TEST(CoordinatorTest, ARankFreedByAWithdrawnRegistrationCanBeTakenAgain) {
  Coordinator c;
  auto first = c.Register(Reg("a", {0, 1}, 3), Clock::now() + std::chrono::milliseconds(100));
  EXPECT_EQ(first.status().code(), absl::StatusCode::kDeadlineExceeded);
  const auto deadline = Clock::now() + std::chrono::seconds(5);
  auto b = std::async(std::launch::async, [&] {
    return c.Register(Reg("b", {1, 2}, 3), deadline);
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  EXPECT_EQ(c.Register(Reg("c", {2}, 3), deadline).status().code(),
            absl::StatusCode::kAlreadyExists);
  auto a = c.Register(Reg("a", {0}, 3), deadline);
  ASSERT_TRUE(a.ok()) << a.status();
  ASSERT_TRUE(b.get().ok());
  EXPECT_EQ(a->nodes_size(), 2);
}

TEST(CoordinatorTest, DuplicateRanksAndWorldMismatchAreRefused) {
  Coordinator c;
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
  Formed f;
  Coordinator c;
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

// Channel weights (channel_weights.h): no shares until every node reported
// its channels' rates; then each run carries the shares of the slowest
// node's rates; a Ready with rates for the wrong number of channels ends
// the job as malformed.
TEST(CoordinatorTest, RunsCarryTheChannelSharesOfTheNodesRates) {
  Formed f;
  Coordinator c;
  Form(c, &f, 2);
  auto with_rates = [](const std::string& name, std::vector<double> rates) {
    proto::NodeEvent e = Ready(name, 10);
    for (double r : rates) e.mutable_ready()->add_channel_rates(r);
    return e;
  };
  c.OnEvent(f.handles[0], with_rates("x", {800, 200}));
  c.OnEvent(f.handles[1], Ready("x", 10));  // node b has not measured yet
  c.OnEvent(f.handles[0], with_rates("y", {800, 200}));
  c.OnEvent(f.handles[1], with_rates("y", {700, 210}));
  auto ev = f.streams[0].WaitFor(2);
  ASSERT_EQ(ev.size(), 2u);
  EXPECT_EQ(ev[0].run().channel_shares_size(), 0);
  EXPECT_EQ(std::vector<uint32_t>(ev[1].run().channel_shares().begin(),
                                  ev[1].run().channel_shares().end()),
            ChannelShares({{800, 200}, {700, 210}}, 2));
  EXPECT_EQ(ev[1].run().channel_shares_size(), 2);
  c.OnEvent(f.handles[1], with_rates("z", {1, 2, 3}));
  auto failed = f.streams[0].WaitFor(3);
  ASSERT_EQ(failed.size(), 3u);
  ASSERT_TRUE(failed[2].has_job_failed());
  EXPECT_NE(failed[2].job_failed().message().find("3 channel rates for 2 channels"),
            std::string::npos)
      << failed[2].job_failed().message();
}

// Four nodes of one rank each in racks r1, r1, r2, r2. Under auto, an
// uncompressed allreduce that runs alone goes rack by rack once the nodes'
// measured rates make the cost model say so; the Run carries both
// predictions; no rates, or links alike, leave it flat; rates of the wrong
// shape end the job.
TEST(CoordinatorTest, AutoChoosesTheRacksByTheCostModelOfTheMeasuredRates) {
  RecordingStream streams[4];
  Coordinator c;
  const auto deadline = Clock::now() + std::chrono::seconds(5);
  std::vector<std::future<absl::StatusOr<proto::Membership>>> regs;
  for (int n = 0; n < 4; ++n) {
    regs.push_back(std::async(std::launch::async, [&c, n, deadline] {
      proto::RegisterNodeRequest r = Reg(absl::StrCat("n", n), {n}, 4);
      r.set_rack(n < 2 ? "r1" : "r2");
      return c.Register(r, deadline);
    }));
  }
  std::vector<proto::Membership> tables;
  for (auto& r : regs) {
    auto m = r.get();
    ASSERT_TRUE(m.ok()) << m.status();
    tables.push_back(*m);
  }
  const proto::Membership& m = tables[0];
  ASSERT_EQ(m.nodes_size(), 4);
  for (int n = 0; n < 4; ++n) EXPECT_EQ(m.nodes(n).rack(), n < 2 ? "r1" : "r2") << n;
  EXPECT_EQ(RackIndices(m), (std::vector<int>{0, 0, 1, 1}));
  uint64_t handles[4];
  for (int n = 0; n < 4; ++n) {
    proto::NodeEvent::Hello h;
    h.set_job_id("job");
    h.set_uid(1000);
    h.set_instance(m.instance());
    h.set_node(n);
    auto handle = c.Attach(h, &streams[n]);
    ASSERT_TRUE(handle.ok()) << handle.status();
    handles[n] = *handle;
  }
  const uint64_t count = 4 << 20;  // float32: 16 MiB
  const double intra = 500e6, inter = 25e6;
  // Node n's rates to every node: fast in its rack, slow across (or `even`).
  auto ready = [&](const std::string& name, int n, bool rates, bool even = false) {
    proto::NodeEvent e = Ready(name, count, 0, 0, /*fusable=*/true);
    for (int b = 0; rates && b < 4; ++b) {
      e.mutable_ready()->add_peer_rates(b == n ? 0 : (even || (b < 2) == (n < 2)) ? intra : inter);
    }
    return e;
  };
  for (int n = 0; n < 4; ++n) c.OnEvent(handles[n], ready("unmeasured", n, false));
  for (int n = 0; n < 4; ++n) c.OnEvent(handles[n], ready("measured", n, true));
  ASSERT_EQ(streams[0].WaitFor(2).size(), 2u);
  for (int n = 0; n < 4; ++n) {
    c.OnEvent(handles[n], Done(0));  // at most two runs at once
    c.OnEvent(handles[n], Done(1));
  }
  for (int n = 0; n < 4; ++n) c.OnEvent(handles[n], ready("alike", n, true, true));
  auto ev = streams[0].WaitFor(3);
  ASSERT_EQ(Runs(ev), (std::vector<std::string>{"unmeasured", "measured", "alike"}));
  EXPECT_EQ(ev[0].run().algorithm(), static_cast<uint32_t>(config::Algorithm::kAuto));
  EXPECT_EQ(ev[0].run().model_flat_us(), 0u);
  EXPECT_EQ(ev[1].run().algorithm(), static_cast<uint32_t>(config::Algorithm::kRack));
  std::vector<std::vector<double>> rates(4, std::vector<double>(4));
  for (int a = 0; a < 4; ++a) {
    for (int b = 0; b < 4; ++b) rates[a][b] = a == b ? 0 : (a < 2) == (b < 2) ? intra : inter;
  }
  const std::optional<RackCost> want = ModelRacks(RackCollective::kAllreduce, {0, 0, 1, 1}, rates, count * 4);
  ASSERT_TRUE(want.has_value());
  EXPECT_EQ(ev[1].run().model_flat_us(), static_cast<uint64_t>(want->flat_s * 1e6));
  EXPECT_EQ(ev[1].run().model_rack_us(), static_cast<uint64_t>(want->rack_s * 1e6));
  EXPECT_GT(ev[1].run().model_flat_us(), ev[1].run().model_rack_us());
  EXPECT_EQ(ev[2].run().algorithm(), static_cast<uint32_t>(config::Algorithm::kAuto));
  EXPECT_GT(ev[2].run().model_rack_us(), ev[2].run().model_flat_us());
  proto::NodeEvent bad = Ready("bad", count, 0, 0, true);
  bad.mutable_ready()->add_peer_rates(1);
  c.OnEvent(handles[2], bad);
  auto failed = streams[0].WaitFor(4);
  ASSERT_EQ(failed.size(), 4u);
  ASSERT_TRUE(failed[3].has_job_failed());
  EXPECT_NE(failed[3].job_failed().message().find("1 peer rates"), std::string::npos)
      << failed[3].job_failed().message();
  for (int n = 0; n < 4; ++n) c.Detach(handles[n], absl::OkStatus());
}

TEST(CoordinatorTest, MismatchFailsOnEveryNodeNamingBoth) {
  Formed f;
  Coordinator c;
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
  Formed f;
  Coordinator c;
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
  Formed f;
  Coordinator c;
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

// Both nodes ready `name` with the same arguments.
void BothReady(Coordinator& c, Formed& f, const std::string& name, uint64_t count,
               int32_t priority = 0, bool fusable = false, uint32_t dtype = 1,
               uint32_t reduce_op = 1) {
  for (int n = 0; n < 2; ++n) {
    c.OnEvent(f.handles[n], Ready(name, count, 0, priority, fusable, dtype, reduce_op));
  }
}

void BothDone(Coordinator& c, Formed& f, uint64_t seq) {
  for (int n = 0; n < 2; ++n) c.OnEvent(f.handles[n], Done(seq));
}

// A formed job with run `name` (seq 0) announced to both nodes.
struct JobWithARun {
  Formed f;  // before the Coordinator (see Formed)
  Coordinator c;
  explicit JobWithARun(const std::string& name) {
    Form(c, &f);
    BothReady(c, f, name, 10);
    EXPECT_EQ(f.streams[0].WaitFor(1).size(), 1u);
    EXPECT_EQ(f.streams[1].WaitFor(1).size(), 1u);
  }
};

// What the coordinator logs while `body` runs (the default logger, swapped
// for one writing to a string).
std::string LogOf(const std::function<void()>& body) {
  std::ostringstream out;
  auto previous = spdlog::default_logger();
  spdlog::set_default_logger(std::make_shared<spdlog::logger>(
      "test", std::make_shared<spdlog::sinks::ostream_sink_mt>(out)));
  body();
  spdlog::set_default_logger(previous);
  return out.str();
}

// A node that leaves once it has reported every run it was part of ends the
// job quietly (info), even when another node has not reported the last run
// yet (it finishes without the leaver, whose part is over); a node that
// leaves with a run of its own unfinished cuts it off: a warning. Either
// way the other node hears that the job failed.
TEST(CoordinatorTest, ALeaveAfterTheNodesLastDoneEndsTheJobQuietly) {
  for (bool done_first : {true, false}) {
    SCOPED_TRACE(done_first ? "Done, then Leave" : "Leave before Done");
    JobWithARun job("last");
    Formed& f = job.f;
    Coordinator& c = job.c;
    proto::NodeEvent leave;
    leave.mutable_leave()->set_reason("rank 2 left");
    const std::string log = LogOf([&] {
      if (done_first) c.OnEvent(f.handles[1], Done(0));
      c.OnEvent(f.handles[1], leave);
    });
    if (done_first) {
      EXPECT_NE(log.find("ended"), std::string::npos) << log;
      EXPECT_EQ(log.find("warning"), std::string::npos) << log;
    } else {
      EXPECT_NE(log.find("[warning]"), std::string::npos) << log;
    }
    auto ev = f.streams[0].WaitFor(2);
    ASSERT_EQ(ev.size(), 2u);
    EXPECT_TRUE(ev[1].has_job_failed());
    // The other node finishes the run (the leaver's part is over), or ends
    // it at once (the leaver never did its part).
    EXPECT_EQ(ev[1].job_failed().runs_cut_off(), !done_first);
  }
}

proto::NodeEvent FailedDone(uint64_t seq, absl::StatusCode code, const std::string& why) {
  proto::NodeEvent e = Done(seq);
  e.mutable_done()->set_code(static_cast<int>(code));
  e.mutable_done()->set_message(why);
  return e;
}

// A run that cannot complete anywhere is said to be cut off, so that the
// nodes end it at once rather than at its deadline: its node's stream lost
// before that node's Done, or a failed Done (which ends the job then and
// there, naming the node and its reason). A node lost after doing its part
// of every run cuts nothing off; a run refused alike by every node's checks
// (INVALID_ARGUMENT) does not end the job.
TEST(CoordinatorTest, AJobFailureSaysWhetherTheRunsInFlightAreCutOff) {
  for (bool done_first : {true, false}) {
    SCOPED_TRACE(done_first ? "Done, then lost" : "lost before Done");
    JobWithARun job("r");
    Formed& f = job.f;
    Coordinator& c = job.c;
    if (done_first) c.OnEvent(f.handles[1], Done(0));
    c.Detach(f.handles[1], absl::UnavailableError("its stream ended"));
    auto ev = f.streams[0].WaitFor(2);
    ASSERT_EQ(ev.size(), 2u);
    ASSERT_TRUE(ev[1].has_job_failed());
    EXPECT_NE(ev[1].job_failed().message().find("lost node b"), std::string::npos);
    EXPECT_EQ(ev[1].job_failed().runs_cut_off(), !done_first);
  }
  {
    SCOPED_TRACE("a failed Done");
    JobWithARun job("r");
    Formed& f = job.f;
    Coordinator& c = job.c;
    c.OnEvent(f.handles[1], FailedDone(0, absl::StatusCode::kInternal, "device fault (test)"));
    auto ev = f.streams[0].WaitFor(2);
    ASSERT_EQ(ev.size(), 2u);
    ASSERT_TRUE(ev[1].has_job_failed());
    EXPECT_EQ(ev[1].job_failed().code(), static_cast<int>(absl::StatusCode::kInternal));
    const std::string& m = ev[1].job_failed().message();
    EXPECT_NE(m.find("node b (ranks 2,3) failed run 0 of job 'job': device fault (test)"),
              std::string::npos)
        << m;
    EXPECT_TRUE(ev[1].job_failed().runs_cut_off());
    // The failing node hears it too (its own stream may be the way it ends).
    auto own = f.streams[1].WaitFor(2);
    ASSERT_EQ(own.size(), 2u);
    EXPECT_TRUE(own[1].has_job_failed());
  }
  {
    SCOPED_TRACE("refused alike by every node");
    JobWithARun job("bad");
    Formed& f = job.f;
    Coordinator& c = job.c;
    for (int n = 0; n < 2; ++n) {
      c.OnEvent(f.handles[n], FailedDone(0, absl::StatusCode::kInvalidArgument, "bad buffers"));
    }
    BothReady(c, f, "next", 10);
    auto ev = f.streams[0].WaitFor(2);
    ASSERT_EQ(Runs(ev), (std::vector<std::string>{"bad", "next"}));
  }
}

TEST(CoordinatorTest, BacklogRunsHighestPriorityFirstTiesInReadyOrder) {
  Formed f;
  Coordinator c;
  Form(c, &f);
  BothReady(c, f, "busy0", 10);
  BothReady(c, f, "busy1", 10);  // both lanes taken
  BothReady(c, f, "low", 10, -3);
  BothReady(c, f, "tie_a", 10, 2);
  BothReady(c, f, "high", 10, 7);
  BothReady(c, f, "tie_b", 10, 2);
  EXPECT_EQ(Runs(f.streams[0].WaitFor(2)), (std::vector<std::string>{"busy0", "busy1"}));
  c.OnEvent(f.handles[0], Done(0));  // one node done is not enough
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  EXPECT_EQ(f.streams[0].events().size(), 2u);
  c.OnEvent(f.handles[1], Done(0));
  c.OnEvent(f.handles[1], Done(0));  // repeated: ignored
  EXPECT_EQ(Runs(f.streams[1].WaitFor(3)), (std::vector<std::string>{"busy0", "busy1", "high"}));
  BothDone(c, f, 1);
  BothDone(c, f, 2);
  BothDone(c, f, 3);
  const std::vector<std::string> want = {"busy0", "busy1", "high", "tie_a", "tie_b", "low"};
  for (auto& s : f.streams) {
    auto ev = s.WaitFor(6);
    EXPECT_EQ(Runs(ev), want);
    for (size_t i = 0; i < ev.size(); ++i) EXPECT_EQ(ev[i].run().seq(), i);
  }
}

TEST(CoordinatorTest, FusesQueuedAllreducesOfOneDtypeUpToTheThreshold) {
  config::TuningRegistry tuning;
  ASSERT_TRUE(tuning.Set("fusion_threshold_bytes", "12K").ok());
  Formed f;
  Coordinator c(&tuning);
  Form(c, &f);
  BothReady(c, f, "busy0", 10, 0, true);
  BothReady(c, f, "busy1", 10, 0, true);
  BothReady(c, f, "a", 1024, 0, true);         // 4 KiB float32
  BothReady(c, f, "i", 1024, 0, true, 7);      // int32: another dtype
  BothReady(c, f, "b", 1024, 0, true);
  for (int n = 0; n < 2; ++n) {  // max, not sum: another reduce op
    c.OnEvent(f.handles[n], Ready("m", 1024, 0, 0, true, 1, 4));
  }
  BothReady(c, f, "d", 1024, 0, true);
  BothReady(c, f, "e", 1024, 0, true);  // would pass 12 KiB
  BothReady(c, f, "big", 4096, 0, true);  // 16 KiB alone: over the threshold
  BothDone(c, f, 0);
  BothDone(c, f, 1);
  BothDone(c, f, 2);
  BothDone(c, f, 3);
  BothDone(c, f, 4);
  BothDone(c, f, 5);
  const std::vector<std::string> want = {"busy0", "busy1", "a+b+d", "i", "m", "e", "big"};
  for (auto& s : f.streams) EXPECT_EQ(Runs(s.WaitFor(want.size())), want);
}

// What each node gets when `queue` readies operations behind two runs that
// are running (seq 0 and 1), and then both runs are done: at least `n`
// events each (waited for, bounded).
std::vector<std::vector<proto::CoordinatorEvent>> BehindTwoRuns(
    const std::function<void(Coordinator&, Formed&)>& queue, size_t n) {
  Formed f;
  Coordinator c;
  Form(c, &f);
  BothReady(c, f, "busy0", 10, 0, true);
  BothReady(c, f, "busy1", 10, 0, true);
  queue(c, f);
  BothDone(c, f, 0);
  BothDone(c, f, 1);
  return {f.streams[0].WaitFor(n), f.streams[1].WaitFor(n)};
}

// An operation ready on every node and queued behind the running ones is in
// flight once: a node that readies it again before its Run (no daemon of
// ours does; a broken one might) is refused, and the queued one runs once,
// not fused with itself (found by tests/fuzz/coordinator_fuzz).
TEST(CoordinatorTest, AnOperationReadiedAgainWhileQueuedIsRefused) {
  const std::vector<std::string> want = {"busy0", "busy1", "fail:a", "a"};
  const auto got = BehindTwoRuns(
      [](Coordinator& c, Formed& f) {
        BothReady(c, f, "a", 1024, 0, true);  // queued: two runs are running
        BothReady(c, f, "a", 1024, 0, true);  // again, before its Run
      },
      want.size());
  for (const auto& events : got) {
    EXPECT_EQ(Runs(events), want);
    ASSERT_EQ(events.size(), want.size());
    EXPECT_EQ(events[2].fail().code(), static_cast<int>(absl::StatusCode::kFailedPrecondition));
    EXPECT_NE(events[2].fail().message().find("readied twice"), std::string::npos)
        << events[2].fail().message();
  }
}

// A count whose size in bytes passes 2^64 (no daemon of ours readies one:
// counts are bounded by the arena; a broken one might) is as large as it
// gets, not the wrapped few bytes: such an operation is never fused (found
// with tests/fuzz/coordinator_fuzz's fused-size property).
TEST(CoordinatorTest, ACountWhoseBytesPass64BitsIsNeverFused) {
  const std::vector<std::string> want = {"busy0", "busy1", "huge", "a"};
  const auto got = BehindTwoRuns(
      [](Coordinator& c, Formed& f) {
        BothReady(c, f, "huge", uint64_t{1} << 62, 0, true);  // float32: 2^64 bytes
        BothReady(c, f, "a", 1024, 0, true);
      },
      want.size());
  for (const auto& events : got) EXPECT_EQ(Runs(events), want);
}

// On two nodes every uncompressed allreduce fuses, up to the threshold
// alone: the ring, which auto picks for all but small sizes there, gives the
// same bits as halving-doubling at any offset (allreduce_ring.cc).
TEST(CoordinatorTest, TwoNodesFuseUpToTheThresholdWhateverTheAutoRulePicks) {
  for (const char* threshold : {"4M", "1M"}) {
    SCOPED_TRACE(threshold);
    config::TuningRegistry tuning;  // algorithm auto: the ring from ~43 KiB on 2 nodes
    ASSERT_TRUE(tuning.Set("fusion_threshold_bytes", threshold).ok());
    Formed f;
    Coordinator c(&tuning);
    Form(c, &f);
    for (const char* name : {"busy0", "busy1", "a", "b", "c"}) {
      BothReady(c, f, name, 96 * 1024, 0, true);  // 384 KiB of float32 each
    }
    BothDone(c, f, 0);
    BothDone(c, f, 1);
    // a+b is 768 KiB; with c, 1152 KiB.
    const std::vector<std::string> want =
        std::string(threshold) == "4M" ? std::vector<std::string>{"busy0", "busy1", "a+b+c"}
                                       : std::vector<std::string>{"busy0", "busy1", "a+b", "c"};
    EXPECT_EQ(Runs(f.streams[0].WaitFor(want.size())), want);
  }
}

// Compressed operations fuse only with operations of the same codec, never
// with uncompressed ones; the halving-doubling cap of the auto rule does not
// limit them (they run the compressed allreduce). Each Run names its codec.
TEST(CoordinatorTest, FusesOnlyWithinOneCodec) {
  config::TuningRegistry tuning;  // 4M threshold, algorithm auto: 1 MiB on 2 nodes
  ASSERT_TRUE(tuning.Set("min_compress_bytes", "0").ok());
  Formed f;
  Coordinator c(&tuning);
  Form(c, &f);
  constexpr uint32_t kNone = 1, kFp16 = 2, kInt8 = 4;
  auto both = [&](const std::string& name, uint64_t count, uint32_t codec) {
    for (int n = 0; n < 2; ++n) c.OnEvent(f.handles[n], Ready(name, count, 0, 0, true, 1, 1, codec));
  };
  both("busy0", 10, kNone);
  both("busy1", 10, kNone);
  both("i1", 96 * 1024, kInt8);  // 384 KiB each: 3 of them pass 1 MiB, not 4 MiB
  both("u1", 100, kNone);
  both("f1", 100, kFp16);
  both("i2", 96 * 1024, kInt8);
  both("u2", 100, kNone);
  both("i3", 96 * 1024, kInt8);
  both("f2", 100, kFp16);
  BothDone(c, f, 0);
  BothDone(c, f, 1);
  BothDone(c, f, 2);
  BothDone(c, f, 3);
  const std::vector<std::string> want = {"busy0", "busy1", "i1+i2+i3", "u1+u2", "f1+f2"};
  const std::vector<std::string> codecs = {"", "", "int8", "", "fp16"};
  for (auto& s : f.streams) {
    auto ev = s.WaitFor(want.size());
    EXPECT_EQ(Runs(ev), want);
    for (size_t i = 0; i < ev.size() && i < codecs.size(); ++i) {
      EXPECT_EQ(ev[i].run().codec(), codecs[i]) << i;
    }
  }
}

// Every Run carries the coordinator daemon's settings of the moment: chunk
// size, chunks in flight, algorithm and the codec resolved for the operation (the tuning's
// compression for operations that ask for the default; none below
// min_compress_bytes or for what the codec cannot take; with
// compression_strict, the latter fails on every node instead).
TEST(CoordinatorTest, RunsCarryTheCoordinatorsSettings) {
  config::TuningRegistry tuning;
  ASSERT_TRUE(tuning.Set("chunk_bytes", "256K").ok());
  ASSERT_TRUE(tuning.Set("chunks_in_flight", "16").ok());
  ASSERT_TRUE(tuning.Set("algorithm", "ring").ok());
  ASSERT_TRUE(tuning.Set("compression", "int8").ok());
  ASSERT_TRUE(tuning.Set("min_compress_bytes", "1K").ok());
  ASSERT_TRUE(tuning.Set("fusion_threshold_bytes", "0").ok());
  Formed f;
  Coordinator c(&tuning);
  Form(c, &f);
  BothReady(c, f, "big", 4096, 0, true);          // 16 KiB float32: int8
  BothReady(c, f, "small", 16, 0, true);          // 64 bytes: below min_compress_bytes
  BothDone(c, f, 0);
  BothDone(c, f, 1);
  BothReady(c, f, "ints", 4096, 0, true, 7);      // int32: int8 cannot take it, sent as is
  BothReady(c, f, "max", 4096, 0, true, 1, 4);    // max: compression is for sum/avg
  BothDone(c, f, 2);
  BothDone(c, f, 3);
  ASSERT_TRUE(tuning.Set("chunk_bytes", "1M").ok());  // live: the next run has it
  ASSERT_TRUE(tuning.Set("algorithm", "auto").ok());
  ASSERT_TRUE(tuning.Set("compression_strict", "on").ok());
  BothReady(c, f, "strict_ints", 4096, 0, true, 7);  // now refused on every node
  BothReady(c, f, "after", 4096, 0, true);
  for (auto& s : f.streams) {
    auto ev = s.WaitFor(6);
    ASSERT_EQ(Runs(ev), (std::vector<std::string>{"big", "small", "ints", "max",
                                                  "fail:strict_ints", "after"}));
    for (int i = 0; i < 4; ++i) {
      EXPECT_EQ(ev[i].run().chunk_bytes(), 256u * 1024) << i;
      EXPECT_EQ(ev[i].run().chunks_in_flight(), 16u) << i;
      EXPECT_EQ(ev[i].run().algorithm(), static_cast<uint32_t>(config::Algorithm::kRing)) << i;
    }
    EXPECT_EQ(ev[0].run().codec(), "int8");
    EXPECT_EQ(ev[1].run().codec(), "");
    EXPECT_EQ(ev[2].run().codec(), "");
    EXPECT_EQ(ev[3].run().codec(), "");
    EXPECT_NE(ev[4].fail().message().find("operation 'strict_ints': compression int8"),
              std::string::npos)
        << ev[4].fail().message();
    EXPECT_EQ(ev[4].fail().code(), static_cast<int>(absl::StatusCode::kInvalidArgument));
    EXPECT_EQ(ev[5].run().chunk_bytes(), 1024u * 1024);
    EXPECT_EQ(ev[5].run().algorithm(), static_cast<uint32_t>(config::Algorithm::kAuto));
    EXPECT_EQ(ev[5].run().codec(), "int8");
  }
}

// An operation whose buffers are on a GPU on some node (Ready.device_buffers,
// from one node is enough) is announced alone, never fused with others, and
// with segment_bytes (staging_segment_bytes) when it goes uncompressed; host
// ones and compressed ones get no segments.
TEST(CoordinatorTest, GpuOperationsRunAloneInSegments) {
  config::TuningRegistry tuning;
  ASSERT_TRUE(tuning.Set("staging_segment_bytes", "64K").ok());
  Formed f;
  Coordinator c(&tuning);
  Form(c, &f);
  auto ready = [&](const std::string& name, uint64_t count, int gpu_node, uint32_t codec = 0,
                   bool allreduce = true) {
    for (int n = 0; n < 2; ++n) {
      proto::NodeEvent e = Ready(name, count, 0, 0, allreduce, 1, 1, codec);
      e.mutable_ready()->set_device_buffers(n == gpu_node);
      c.OnEvent(f.handles[n], e);
    }
  };
  ready("busy0", 10, -1);
  ready("busy1", 10, -1);  // both lanes taken: what follows queues up
  ready("h1", 16, -1);
  ready("g", 16, 1);
  ready("h2", 16, -1);
  ready("h3", 16, -1);
  ready("gz", 100000, 0, 4);      // int8 (wire::Codec 4): whole, compressed
  ready("rs", 100, 0, 0, false);  // reduce_scatter: in segments too
  ready("hrs", 100, -1, 0, false);
  for (int n = 0; n < 2; ++n) {  // an allgather on a GPU: in segments too
    proto::NodeEvent e = Ready("ag", 100, 0, 0, false);
    e.mutable_ready()->mutable_signature()->set_collective(
        static_cast<uint32_t>(wire::Collective::kAllgather));
    e.mutable_ready()->set_device_buffers(n == 1);
    c.OnEvent(f.handles[n], e);
  }
  for (uint64_t seq = 0; seq < 8; ++seq) BothDone(c, f, seq);
  for (auto& s : f.streams) {
    auto ev = s.WaitFor(8);
    ASSERT_EQ(Runs(ev), (std::vector<std::string>{"busy0", "busy1", "h1+h2+h3", "g", "gz", "rs",
                                                  "hrs", "ag"}));
    for (size_t i = 0; i < ev.size(); ++i) {
      const std::string& name = ev[i].run().name();
      const bool segmented = name == "g" || name == "rs" || name == "ag";
      EXPECT_EQ(ev[i].run().segment_bytes(), segmented ? 65536u : 0u) << name;
    }
    EXPECT_EQ(ev[4].run().codec(), "int8");
  }
}

// An alltoall(v) with GPU buffers on some node is announced in as many
// segments as the busiest rank of any node needs (the largest
// Ready.rank_bytes over segment_bytes, 1 .. 4096); a host one in none.
TEST(CoordinatorTest, AlltoallSegmentsFollowTheBusiestRank) {
  config::TuningRegistry tuning;
  ASSERT_TRUE(tuning.Set("staging_segment_bytes", "64K").ok());
  Formed f;
  Coordinator c(&tuning);
  Form(c, &f);
  struct Op {
    std::string name;
    wire::Collective collective;
    uint64_t rank_bytes[2];
    int gpu_node;
    uint64_t segments;  // expected; 0: not in segments
  };
  const std::vector<Op> ops = {
      {"a", wire::Collective::kAlltoall, {3 * 65536, 3 * 65536}, 0, 3},
      {"v", wire::Collective::kAlltoallv, {70000, 200000}, 1, 4},  // node 1's busiest rank
      {"v0", wire::Collective::kAlltoallv, {0, 0}, 0, 1},          // nothing moves: one
      {"huge", wire::Collective::kAlltoall, {uint64_t{1} << 40, uint64_t{1} << 40}, 1, 4096},
      {"host", wire::Collective::kAlltoallv, {200000, 200000}, -1, 0},
  };
  for (const Op& op : ops) {
    for (int n = 0; n < 2; ++n) {
      proto::NodeEvent e = Ready(op.name, 0, 0, 0, false);
      auto* r = e.mutable_ready();
      r->mutable_signature()->set_collective(static_cast<uint32_t>(op.collective));
      r->mutable_signature()->set_count(op.collective == wire::Collective::kAlltoall ? 8 : 0);
      r->set_device_buffers(n == op.gpu_node);
      r->set_rank_bytes(op.rank_bytes[n]);
      for (int m = 0; m < 2 && op.collective == wire::Collective::kAlltoallv; ++m) {
        r->add_split_out(7);  // agreeing counts
        r->add_split_in(7);
      }
      c.OnEvent(f.handles[n], e);
    }
  }
  for (uint64_t seq = 0; seq < ops.size(); ++seq) BothDone(c, f, seq);
  for (auto& s : f.streams) {
    auto ev = s.WaitFor(ops.size());
    ASSERT_EQ(ev.size(), ops.size());
    for (size_t i = 0; i < ops.size(); ++i) {
      ASSERT_TRUE(ev[i].has_run()) << ops[i].name << ": " << ev[i].DebugString();
      EXPECT_EQ(ev[i].run().name(), ops[i].name);
      EXPECT_EQ(ev[i].run().segments(), ops[i].segments) << ops[i].name;
      EXPECT_EQ(ev[i].run().segment_bytes(), ops[i].segments > 0 ? 65536u : 0u) << ops[i].name;
    }
  }
}

TEST(CoordinatorTest, ZeroThresholdDisablesFusion) {
  config::TuningRegistry tuning;
  ASSERT_TRUE(tuning.Set("fusion_threshold_bytes", "0").ok());
  Formed f;
  Coordinator c(&tuning);
  Form(c, &f);
  for (const char* name : {"busy0", "busy1", "a", "b"}) BothReady(c, f, name, 8, 0, true);
  BothDone(c, f, 0);
  BothDone(c, f, 1);
  const std::vector<std::string> want = {"busy0", "busy1", "a", "b"};
  EXPECT_EQ(Runs(f.streams[0].WaitFor(want.size())), want);
}

TEST(CoordinatorTest, CycleTimeHoldsAnOperationToMeetOthers) {
  config::TuningRegistry tuning;
  ASSERT_TRUE(tuning.Set("cycle_time_us", "400000").ok());
  Formed f;
  Coordinator c(&tuning);
  Form(c, &f);
  const auto start = Clock::now();
  BothReady(c, f, "a", 8, 0, true);
  BothReady(c, f, "b", 8, 1, true);
  BothReady(c, f, "c", 8, 0, false);
  // Held: nothing announced although both lanes are free (the test would
  // need 400 ms between these lines to see otherwise).
  if (Clock::now() - start < std::chrono::milliseconds(300)) {
    EXPECT_TRUE(f.streams[0].events().empty());
  }
  // After the hold: the highest priority first, with what fuses with it.
  const std::vector<std::string> want = {"b+a", "c"};
  EXPECT_EQ(Runs(f.streams[0].WaitFor(2)), want);
  EXPECT_GE(Clock::now() - start, std::chrono::milliseconds(400));
}

TEST(CoordinatorTest, WithoutCycleTimeAnIsolatedOperationStartsAtOnce) {
  Formed f;
  Coordinator c;  // defaults: cycle_time_us 0
  Form(c, &f);
  BothReady(c, f, "alone", 8, 0, true);
  auto ev = f.streams[0].events();  // synchronously, no wait
  ASSERT_EQ(ev.size(), 1u);
  EXPECT_EQ(ev[0].run().name(), "alone");
  EXPECT_EQ(ev[0].run().fused_with_size(), 0);
}

}  // namespace
}  // namespace ciuic::daemon

namespace ciuic::daemon {
namespace {

// The job_failed event a stream got, if any.
const proto::CoordinatorEvent* JobFailedIn(const std::vector<proto::CoordinatorEvent>& events) {
  for (const auto& e : events) {
    if (e.has_job_failed()) return &e;
  }
  return nullptr;
}

TEST(CoordinatorTest, ANodeCannotMakeTheCoordinatorKeepUnboundedPendingNames) {
  Formed f;
  Coordinator c;
  Form(c, &f);
  // 4 ranks with 1024 operations in flight each at most: 4096 pending names.
  for (int i = 0; i < 4096; ++i) c.OnEvent(f.handles[1], Ready("op" + std::to_string(i), 10));
  EXPECT_EQ(JobFailedIn(f.streams[0].events()), nullptr) << "within what the ranks can submit";
  c.OnEvent(f.handles[1], Ready("one-too-many", 10));
  for (auto& s : f.streams) {
    auto events = s.WaitFor(1);
    const proto::CoordinatorEvent* failed = JobFailedIn(events);
    ASSERT_NE(failed, nullptr);
    EXPECT_EQ(failed->job_failed().code(), static_cast<int>(absl::StatusCode::kResourceExhausted));
    EXPECT_NE(failed->job_failed().message().find("node b"), std::string::npos)
        << failed->job_failed().message();
  }
}

TEST(CoordinatorTest, AMalformedReadyFailsTheJobNamingTheNode) {
  Formed f;
  Coordinator c;
  Form(c, &f);
  proto::NodeEvent e = Ready(std::string(wire::kMaxOpName + 1, 'n'), 10);
  c.OnEvent(f.handles[0], e);
  auto events = f.streams[1].WaitFor(1);
  const proto::CoordinatorEvent* failed = JobFailedIn(events);
  ASSERT_NE(failed, nullptr);
  EXPECT_EQ(failed->job_failed().code(), static_cast<int>(absl::StatusCode::kInvalidArgument));
  EXPECT_NE(failed->job_failed().message().find("malformed Ready"), std::string::npos);

  Formed g;
  Coordinator d;
  Form(d, &g);
  proto::NodeEvent splits = Ready("v", 10);
  for (int i = 0; i < 3; ++i) splits.mutable_ready()->add_split_out(i);  // 2 nodes
  d.OnEvent(g.handles[1], splits);
  ASSERT_NE(JobFailedIn(g.streams[0].WaitFor(1)), nullptr);
}

// A Ready without a timeout waits the default that the SDK's fast path and
// the daemon's tuning assume too (proto/ciuic/collective_rules.h).
TEST(CoordinatorTest, TheDefaultTimeoutIsTheDaemonsAndTheSdks) {
  EXPECT_EQ(config::Tuning{}.op_timeout_ms, wire::kDefaultOpTimeoutMs);
}

}  // namespace
}  // namespace ciuic::daemon
