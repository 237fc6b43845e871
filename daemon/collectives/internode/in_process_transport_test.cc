// InProcessTransport: matching, asynchrony, size mismatch, FailPeer, KillNode.
#include "collectives/internode/in_process_transport.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <future>
#include <string>
#include <thread>
#include <vector>

#include "collectives/internode/scratch.h"

namespace ciuic::daemon {
namespace {

// Collects one callback's status.
struct Done {
  std::promise<absl::Status> promise;
  std::future<absl::Status> future = promise.get_future();
  TransferDone fn() {
    return [this](absl::Status s) { promise.set_value(std::move(s)); };
  }
  absl::Status Get() {
    EXPECT_EQ(future.wait_for(std::chrono::seconds(5)), std::future_status::ready);
    return future.get();
  }
};

TEST(InProcessTransportTest, MatchesByTagAndChannelInAnyOrder) {
  InProcessHub hub(2, 2);
  std::vector<int> a{1, 2, 3}, b{4, 5, 6}, ra(3), rb(3);
  Done s1, s2, r1, r2;
  // Receive first for tag 7, send first for tag 8; channel 1 for both.
  hub.transport(1)->Recv(0, 1, 7, ra.data(), 12, r1.fn());
  hub.transport(0)->Send(1, 1, 8, b.data(), 12, s2.fn());
  hub.transport(0)->Send(1, 1, 7, a.data(), 12, s1.fn());
  hub.transport(1)->Recv(0, 1, 8, rb.data(), 12, r2.fn());
  EXPECT_TRUE(s1.Get().ok());
  EXPECT_TRUE(s2.Get().ok());
  EXPECT_TRUE(r1.Get().ok());
  EXPECT_TRUE(r2.Get().ok());
  EXPECT_EQ(ra, a);
  EXPECT_EQ(rb, b);
  EXPECT_EQ(hub.matched_transfers(), 2u);
}

TEST(InProcessTransportTest, CallbacksRunOnTheDeliveryThread) {
  InProcessHub hub(2, 1);
  int x = 5, y = 0;
  std::atomic<bool> inline_call{false};
  const std::thread::id me = std::this_thread::get_id();
  Done s, r;
  hub.transport(0)->Send(1, 0, 1, &x, 4, [&](absl::Status st) {
    inline_call = std::this_thread::get_id() == me;
    s.promise.set_value(st);
  });
  hub.transport(1)->Recv(0, 0, 1, &y, 4, r.fn());
  EXPECT_TRUE(s.Get().ok());
  EXPECT_TRUE(r.Get().ok());
  EXPECT_FALSE(inline_call);
  EXPECT_EQ(y, 5);
}

TEST(InProcessTransportTest, SizeMismatchFailsBothNamingThePeer) {
  InProcessHub hub(2, 1);
  char buf[8] = {};
  Done s, r;
  hub.transport(0)->Send(1, 0, 3, buf, 8, s.fn());
  hub.transport(1)->Recv(0, 0, 3, buf, 4, r.fn());
  const absl::Status ss = s.Get(), rs = r.Get();
  EXPECT_EQ(ss.code(), absl::StatusCode::kDataLoss);
  EXPECT_NE(std::string(ss.message()).find("node 1"), std::string::npos) << ss.ToString();
  EXPECT_NE(std::string(rs.message()).find("node 0"), std::string::npos) << rs.ToString();
}

TEST(InProcessTransportTest, FailPeerIsStickyAndLocal) {
  InProcessHub hub(3, 1);
  char buf[4] = {};
  Done pending, later, other;
  hub.transport(0)->Recv(1, 0, 1, buf, 4, pending.fn());
  hub.transport(0)->FailPeer(1, absl::AbortedError("gone"));
  EXPECT_EQ(pending.Get().code(), absl::StatusCode::kAborted);
  hub.transport(0)->Send(1, 0, 2, buf, 4, later.fn());
  const absl::Status ls = later.Get();
  EXPECT_EQ(ls.code(), absl::StatusCode::kAborted);
  EXPECT_NE(std::string(ls.message()).find("node 1"), std::string::npos);
  // Node 2 still talks to node 0.
  Done s, r;
  hub.transport(2)->Send(0, 0, 1, buf, 4, s.fn());
  hub.transport(0)->Recv(2, 0, 1, buf, 4, r.fn());
  EXPECT_TRUE(s.Get().ok());
  EXPECT_TRUE(r.Get().ok());
}

TEST(InProcessTransportTest, KillNodeFailsEverythingInvolvingIt) {
  InProcessHub hub(3, 1);
  char buf[4] = {};
  Done r0, s2, after, unrelated_s, unrelated_r;
  hub.transport(0)->Recv(1, 0, 1, buf, 4, r0.fn());
  hub.transport(2)->Send(1, 0, 1, buf, 4, s2.fn());
  hub.KillNode(1);
  for (Done* d : {&r0, &s2}) {
    const absl::Status st = d->Get();
    EXPECT_EQ(st.code(), absl::StatusCode::kUnavailable);
    EXPECT_NE(std::string(st.message()).find("node 1"), std::string::npos);
  }
  hub.transport(1)->Send(0, 0, 9, buf, 4, after.fn());
  EXPECT_FALSE(after.Get().ok());
  hub.transport(0)->Send(2, 0, 1, buf, 4, unrelated_s.fn());
  hub.transport(2)->Recv(0, 0, 1, buf, 4, unrelated_r.fn());
  EXPECT_TRUE(unrelated_s.Get().ok());
  EXPECT_TRUE(unrelated_r.Get().ok());
}

TEST(InProcessTransportTest, DestructionCancelsPending) {
  Done r;
  char buf[4];
  {
    InProcessHub hub(2, 1);
    hub.transport(0)->Recv(1, 0, 1, buf, 4, r.fn());
  }
  EXPECT_EQ(r.Get().code(), absl::StatusCode::kCancelled);
}

TEST(ScratchBufferTest, GrowsAndIsReused) {
  ScratchBuffer s;
  uint8_t* a = s.Get(100);
  ASSERT_NE(a, nullptr);
  EXPECT_GE(s.capacity(), 100u);
  a[99] = 1;
  EXPECT_EQ(s.Get(s.capacity()), a);  // no growth, same memory
  uint8_t* b = s.Get(s.capacity() + 1);
  ASSERT_NE(b, nullptr);
  EXPECT_GT(s.capacity(), size_t{2} << 20);
  b[s.capacity() - 1] = 2;
  EXPECT_EQ(reinterpret_cast<uintptr_t>(b) % 64, 0u);
}

}  // namespace
}  // namespace ciuic::daemon
