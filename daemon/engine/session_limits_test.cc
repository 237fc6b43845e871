#include "engine/session_limits.h"

#include <gtest/gtest.h>

#include <memory>
#include <vector>

namespace ciuic::daemon {
namespace {

TEST(SessionLimitsTest, EachLimitRefusesWithItsConfigKeyAndTicketsGiveTheirShareBack) {
  SessionLimits limits({/*sessions=*/4, /*sessions_per_uid=*/2, /*arena_bytes_total=*/1000,
                        /*arena_bytes_per_uid=*/600});
  auto a = limits.Reserve(1000, 100);
  auto b = limits.Reserve(1000, 100);
  ASSERT_TRUE(a.ok() && b.ok());
  auto c = limits.Reserve(1000, 1);
  ASSERT_EQ(c.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(c.status().message().find("max_sessions_per_uid"), std::string::npos);
  EXPECT_EQ(limits.Of(1000).sessions, 2u);
  EXPECT_EQ(limits.Of(1000).arena_bytes, 200u);

  auto big = limits.Reserve(2000, 601);
  ASSERT_FALSE(big.ok());
  EXPECT_NE(big.status().message().find("max_arena_bytes_per_uid"), std::string::npos);
  auto d = limits.Reserve(2000, 600);
  ASSERT_TRUE(d.ok());
  auto total = limits.Reserve(3000, 201);  // 800 mapped, 1000 in all
  ASSERT_FALSE(total.ok());
  EXPECT_NE(total.status().message().find("max_arena_bytes_total"), std::string::npos);
  auto e = limits.Reserve(3000, 200);
  ASSERT_TRUE(e.ok());
  auto f = limits.Reserve(4000, 0);
  ASSERT_FALSE(f.ok());
  EXPECT_NE(f.status().message().find("max_sessions)"), std::string::npos);
  EXPECT_EQ(limits.Total().sessions, 4u);
  EXPECT_EQ(limits.Total().arena_bytes, 1000u);

  a->reset();  // a session of uid 1000 ends
  EXPECT_EQ(limits.Of(1000).sessions, 1u);
  EXPECT_EQ(limits.Of(1000).arena_bytes, 100u);
  auto again = limits.Reserve(1000, 100);  // and its share is free again
  EXPECT_TRUE(again.ok());
  EXPECT_EQ(limits.Total().sessions, 4u);
  again->reset();
  EXPECT_EQ(limits.Total().sessions, 3u);
}

TEST(SessionLimitsTest, ATicketMayOutliveItsLimits) {
  std::unique_ptr<SessionLimits::Ticket> kept;
  {
    SessionLimits limits({});
    auto t = limits.Reserve(5, 10);
    ASSERT_TRUE(t.ok());
    kept = std::move(*t);
  }
  kept.reset();  // no use after free (ASan would say)
}

TEST(SessionLimitsTest, NoOverflowNearTheLimits) {
  SessionLimits limits({10, 10, UINT64_MAX, UINT64_MAX - 5});
  auto a = limits.Reserve(1, UINT64_MAX - 10);
  ASSERT_TRUE(a.ok());
  EXPECT_FALSE(limits.Reserve(1, 6).ok());
  EXPECT_FALSE(limits.Reserve(2, 11).ok());  // the total would wrap
  EXPECT_TRUE(limits.Reserve(2, 10).ok());
}

}  // namespace
}  // namespace ciuic::daemon
