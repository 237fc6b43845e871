// Channel weights (channel_weights.h): the moving rates from transport
// loads, the shares from every node's rates, the chunk table of a run.
#include "cluster/channel_weights.h"

#include <gtest/gtest.h>

#include <numeric>
#include <vector>

namespace ciuic::daemon {
namespace {

Transport::ChannelLoad Load(uint64_t bytes, uint64_t busy_ns) {
  Transport::ChannelLoad l;
  l.bytes_sent = bytes;
  l.busy_ns = busy_ns;
  return l;
}

constexpr uint64_t kMiB = uint64_t{1} << 20;
constexpr uint64_t kSecond = 1'000'000'000;

TEST(ChannelRatesTest, RatesFollowBytesOverBusyTimeAsAMovingEstimate) {
  ChannelRates r;
  r.Update({Load(0, 0), Load(0, 0)});
  EXPECT_EQ(r.rates(), (std::vector<double>{0, 0}));
  // 100 MiB in 1 s on channel 0, 25 MiB in 1 s on channel 1.
  r.Update({Load(100 * kMiB, kSecond), Load(25 * kMiB, kSecond)});
  EXPECT_DOUBLE_EQ(r.rates()[0], 100.0 * kMiB);
  EXPECT_DOUBLE_EQ(r.rates()[1], 25.0 * kMiB);
  // Channel 1 speeds up to 75 MiB/s: the estimate moves half way.
  r.Update({Load(200 * kMiB, 2 * kSecond), Load(100 * kMiB, 2 * kSecond)});
  EXPECT_DOUBLE_EQ(r.rates()[0], 100.0 * kMiB);
  EXPECT_DOUBLE_EQ(r.rates()[1], 50.0 * kMiB);
}

TEST(ChannelRatesTest, ShortBurstsAccumulateUntilTheyCount) {
  ChannelRates r;
  r.Update({Load(0, 0), Load(0, 0)});
  // 1 MiB in 1 ms: too little to say anything (socket buffers).
  r.Update({Load(kMiB, 1'000'000), Load(0, 0)});
  EXPECT_EQ(r.rates()[0], 0);
  // More of the same until 4 MiB and 20 ms have passed: 8 MiB in 40 ms.
  r.Update({Load(8 * kMiB, 40'000'000), Load(0, 0)});
  EXPECT_DOUBLE_EQ(r.rates()[0], 8.0 * kMiB / 0.04);
  EXPECT_EQ(r.rates()[1], 0);
}

TEST(ChannelSharesTest, SharesFollowTheSlowestNodesRatePerChannel) {
  // Two nodes, 800 and 200 units on two channels; node 1's channel 0 slower.
  std::vector<uint32_t> s = ChannelShares({{800, 200}, {700, 210}}, 2);
  ASSERT_EQ(s.size(), 2u);
  EXPECT_EQ(s[0] + s[1], kChannelSlots);
  // 700 : 200 of the 62 free slots, one each first: 1 + 48.2, 1 + 13.8.
  EXPECT_EQ(s, (std::vector<uint32_t>{49, 15}));
  EXPECT_EQ(ChannelShares({{1, 1, 1}}, 3), (std::vector<uint32_t>{22, 21, 21}));
}

TEST(ChannelSharesTest, NoChannelStarves) {
  std::vector<uint32_t> s = ChannelShares({{1e12, 1}}, 2);
  EXPECT_EQ(s, (std::vector<uint32_t>{63, 1}));
}

TEST(ChannelSharesTest, EqualSharesUntilEveryNodeMeasuredEveryChannel) {
  EXPECT_TRUE(ChannelShares({}, 2).empty());
  EXPECT_TRUE(ChannelShares({{800, 200}, {}}, 2).empty());  // node 1 never reported
  EXPECT_TRUE(ChannelShares({{800, 0}}, 2).empty());        // channel 1 not measured
  EXPECT_TRUE(ChannelShares({{800}}, 1).empty());           // one channel
  EXPECT_TRUE(ChannelShares({std::vector<double>(65, 1.0)}, 65).empty());
  EXPECT_TRUE(ChannelShares({{800, 200, 5}}, 2).empty());   // wrong count
}

TEST(ChannelTableTest, EachChannelGetsItsShareSpreadOut) {
  EXPECT_TRUE(ChannelTable({}).empty());
  std::vector<uint8_t> t = ChannelTable({48, 16});
  ASSERT_EQ(t.size(), kChannelSlots);
  EXPECT_EQ(std::count(t.begin(), t.end(), 1), 16);
  // Spread: every window of 4 slots holds exactly one of channel 1's.
  for (size_t i = 0; i + 4 <= t.size(); ++i) {
    EXPECT_EQ(std::count(t.begin() + i, t.begin() + i + 4, 1), 1) << i;
  }
  std::vector<uint8_t> three = ChannelTable({22, 21, 21});
  for (uint8_t c = 0; c < 3; ++c) {
    EXPECT_EQ(std::count(three.begin(), three.end(), c), c == 0 ? 22 : 21);
  }
}

TEST(ChannelTableTest, ValidSharesAreOnePerChannelSummingToTheSlots) {
  EXPECT_TRUE(ValidChannelShares({}, 1));
  EXPECT_TRUE(ValidChannelShares({}, 4));
  EXPECT_TRUE(ValidChannelShares({48, 16}, 2));
  EXPECT_FALSE(ValidChannelShares({48, 16}, 3));
  EXPECT_FALSE(ValidChannelShares({64, 0}, 2));
  EXPECT_FALSE(ValidChannelShares({40, 16}, 2));
  EXPECT_FALSE(ValidChannelShares({64}, 1));
}

}  // namespace
}  // namespace ciuic::daemon
