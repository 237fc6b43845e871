#include "config/values.h"

#include <cstdint>

#include "gtest/gtest.h"

namespace ciuic::config {
namespace {

TEST(ParseByteSizeTest, AcceptsPlainAndSuffixed) {
  EXPECT_EQ(*ParseByteSize("0"), 0u);
  EXPECT_EQ(*ParseByteSize("4096"), 4096u);
  EXPECT_EQ(*ParseByteSize("4K"), 4096u);
  EXPECT_EQ(*ParseByteSize("4k"), 4096u);
  EXPECT_EQ(*ParseByteSize("4M"), 4194304u);
  EXPECT_EQ(*ParseByteSize("4MiB"), 4194304u);
  EXPECT_EQ(*ParseByteSize("1G"), uint64_t{1} << 30);
  EXPECT_EQ(*ParseByteSize("2T"), uint64_t{2} << 40);
  EXPECT_EQ(*ParseByteSize("  8M "), uint64_t{8} << 20);
}

TEST(ParseByteSizeTest, RejectsGarbageAndOverflow) {
  for (const char* bad : {"", "M", "-1", "4X", "4MB", "4 M", "1.5M", "0x10", "abc", "99999999999G",
                          "18446744073709551616", "16777216T"}) {
    EXPECT_FALSE(ParseByteSize(bad).ok()) << bad;
  }
  EXPECT_EQ(*ParseByteSize("18446744073709551615"), UINT64_MAX);
}

TEST(FormatByteSizeTest, UsesLargestExactSuffix) {
  EXPECT_EQ(FormatByteSize(0), "0");
  EXPECT_EQ(FormatByteSize(1000), "1000");
  EXPECT_EQ(FormatByteSize(4096), "4K");
  EXPECT_EQ(FormatByteSize(1536 * kKiB), "1536K");
  EXPECT_EQ(FormatByteSize(4 * kMiB), "4M");
  EXPECT_EQ(FormatByteSize(kGiB), "1G");
  EXPECT_EQ(FormatByteSize(kTiB), "1T");
}

TEST(ParseUnsignedTest, Basics) {
  EXPECT_EQ(*ParseUnsigned("0"), 0u);
  EXPECT_EQ(*ParseUnsigned("60000"), 60000u);
  EXPECT_FALSE(ParseUnsigned("-5").ok());
  EXPECT_FALSE(ParseUnsigned("+5").ok());
  EXPECT_FALSE(ParseUnsigned("5s").ok());
  EXPECT_FALSE(ParseUnsigned("").ok());
  EXPECT_FALSE(ParseUnsigned("99999999999999999999999").ok());
}

TEST(ClosestMatchTest, SuggestsNearMissesOnly) {
  std::vector<std::string> keys = {"chunk_bytes", "small_op_bytes", "spin_us", "channels"};
  EXPECT_EQ(EditDistance("chunk_byte", "chunk_bytes"), 1);
  EXPECT_EQ(EditDistance("ABC", "abc"), 0);
  EXPECT_EQ(ClosestMatch("chunk_byte", keys), "chunk_bytes");
  EXPECT_EQ(ClosestMatch("chunk_byts", keys), "chunk_bytes");
  EXPECT_EQ(ClosestMatch("Channels", keys), "channels");
  EXPECT_EQ(ClosestMatch("spin", keys), "spin_us");
  EXPECT_EQ(ClosestMatch("zzzzzzzz", keys), std::nullopt);
  EXPECT_EQ(ClosestMatch("", keys), std::nullopt);
  EXPECT_EQ(DidYouMean("chanels", keys), " (did you mean 'channels'?)");
  EXPECT_EQ(DidYouMean("xyzzy", keys), "");
}

}  // namespace
}  // namespace ciuic::config
