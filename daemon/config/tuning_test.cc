#include "config/tuning.h"

#include <atomic>
#include <string>
#include <thread>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace ciuic::config {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

absl::Status SetOne(absl::string_view key, absl::string_view value, Tuning* out = nullptr) {
  TuningRegistry registry;
  absl::Status status = registry.Set(key, value);
  if (out != nullptr) *out = registry.Snapshot();
  return status;
}

std::string ValueOf(const TuningRegistry& registry, absl::string_view key) {
  absl::StatusOr<std::vector<TuningEntry>> entries = registry.Get(key);
  EXPECT_TRUE(entries.ok()) << entries.status().ToString();
  if (!entries.ok() || entries->size() != 1) return "<error>";
  return (*entries)[0].value;
}

TEST(TuningTest, Defaults) {
  Tuning tuning;
  EXPECT_EQ(tuning.chunk_bytes, 1u << 20);
  EXPECT_EQ(tuning.small_op_bytes, 256u << 10);
  EXPECT_EQ(tuning.spin_us, 50u);
  EXPECT_EQ(tuning.op_timeout_ms, 60000u);
  EXPECT_EQ(tuning.channels, 2u);
  EXPECT_EQ(tuning.algorithm, Algorithm::kAuto);
  EXPECT_EQ(TuningRegistry().Snapshot(), Tuning{});
}

TEST(TuningTest, GetAllListsEveryKeyInStableOrder) {
  TuningRegistry registry;
  absl::StatusOr<std::vector<TuningEntry>> entries = registry.Get("");
  ASSERT_TRUE(entries.ok());
  std::vector<std::string> keys, values;
  for (const TuningEntry& entry : *entries) {
    keys.push_back(entry.key);
    values.push_back(entry.value);
    EXPECT_FALSE(entry.description.empty()) << entry.key;
  }
  EXPECT_THAT(keys,
              ElementsAre("chunk_bytes", "small_op_bytes", "spin_us", "op_timeout_ms", "channels",
                          "chunks_in_flight", "algorithm", "compression", "min_compress_bytes",
                          "error_feedback", "compression_strict", "fast_path_bytes",
                          "fusion_threshold_bytes", "cycle_time_us", "direct_max_bytes",
                          "staging_segment_bytes",
                          "trace_ops", "heartbeat_interval_ms", "heartbeat_misses"));
  EXPECT_THAT(values, ElementsAre("1M", "256K", "50", "60000", "2", "8", "auto", "none", "64K",
                                  "on", "off", "4K", "4M", "0", "1M", "16M", "4096", "2000", "4"));
  EXPECT_EQ(keys, TuningKeys());
  EXPECT_THAT((*entries)[0].description, HasSubstr("4K..1G"));
  EXPECT_THAT((*entries)[0].description, HasSubstr("default 1M"));
}

TEST(TuningTest, GetOneKey) {
  TuningRegistry registry;
  EXPECT_EQ(ValueOf(registry, "channels"), "2");
  absl::StatusOr<std::vector<TuningEntry>> missing = registry.Get("chanels");
  ASSERT_FALSE(missing.ok());
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(missing.status().message(), "unknown tuning key 'chanels' (did you mean 'channels'?)");
}

TEST(TuningTest, ChunkBytes) {
  Tuning tuning;
  EXPECT_TRUE(SetOne("chunk_bytes", "4K", &tuning).ok());
  EXPECT_EQ(tuning.chunk_bytes, 4096u);
  EXPECT_TRUE(SetOne("chunk_bytes", "1G", &tuning).ok());
  EXPECT_EQ(tuning.chunk_bytes, 1u << 30);
  EXPECT_TRUE(SetOne("chunk_bytes", "1048576", &tuning).ok());
  EXPECT_EQ(tuning.chunk_bytes, 1u << 20);
  EXPECT_FALSE(SetOne("chunk_bytes", "4095").ok());
  EXPECT_FALSE(SetOne("chunk_bytes", "1025M").ok());
  EXPECT_FALSE(SetOne("chunk_bytes", "lots").ok());
  EXPECT_FALSE(SetOne("chunk_bytes", "-4M").ok());
  absl::Status overflow = SetOne("chunk_bytes", "99999999999G");
  EXPECT_EQ(overflow.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(overflow.message(), HasSubstr("'99999999999G'"));
  EXPECT_THAT(overflow.message(), HasSubstr("too large"));
  absl::Status small = SetOne("chunk_bytes", "1K");
  EXPECT_EQ(small.message(),
            "invalid value '1K' for 'chunk_bytes': out of range; expected a size in 4K..1G");
}

TEST(TuningTest, SmallOpBytes) {
  Tuning tuning;
  EXPECT_TRUE(SetOne("small_op_bytes", "0", &tuning).ok());
  EXPECT_EQ(tuning.small_op_bytes, 0u);
  EXPECT_TRUE(SetOne("small_op_bytes", "1g", &tuning).ok());
  EXPECT_EQ(tuning.small_op_bytes, 1u << 30);
  EXPECT_FALSE(SetOne("small_op_bytes", "1073741825").ok());
  EXPECT_FALSE(SetOne("small_op_bytes", "2G").ok());
  EXPECT_FALSE(SetOne("small_op_bytes", "").ok());
}

TEST(TuningTest, SpinUs) {
  Tuning tuning;
  EXPECT_TRUE(SetOne("spin_us", "0", &tuning).ok());
  EXPECT_EQ(tuning.spin_us, 0u);
  EXPECT_TRUE(SetOne("spin_us", "100000", &tuning).ok());
  EXPECT_EQ(tuning.spin_us, 100000u);
  EXPECT_FALSE(SetOne("spin_us", "100001").ok());
  EXPECT_FALSE(SetOne("spin_us", "-1").ok());
  EXPECT_FALSE(SetOne("spin_us", "10K").ok());  // durations take no suffix
  EXPECT_FALSE(SetOne("spin_us", "99999999999999999999999").ok());
}

TEST(TuningTest, OpTimeoutMs) {
  Tuning tuning;
  EXPECT_TRUE(SetOne("op_timeout_ms", "100", &tuning).ok());
  EXPECT_EQ(tuning.op_timeout_ms, 100u);
  EXPECT_TRUE(SetOne("op_timeout_ms", "86400000", &tuning).ok());
  EXPECT_EQ(tuning.op_timeout_ms, 86400000u);
  absl::Status low = SetOne("op_timeout_ms", "99");
  EXPECT_EQ(low.message(),
            "invalid value '99' for 'op_timeout_ms': out of range; expected an integer in "
            "100..86400000");
  EXPECT_FALSE(SetOne("op_timeout_ms", "86400001").ok());
  EXPECT_FALSE(SetOne("op_timeout_ms", "4294967296").ok());  // > uint32
  EXPECT_FALSE(SetOne("op_timeout_ms", "1.5").ok());
}

TEST(TuningTest, Channels) {
  Tuning tuning;
  EXPECT_TRUE(SetOne("channels", "1", &tuning).ok());
  EXPECT_EQ(tuning.channels, 1u);
  EXPECT_TRUE(SetOne("channels", "64", &tuning).ok());
  EXPECT_EQ(tuning.channels, 64u);
  EXPECT_FALSE(SetOne("channels", "0").ok());
  EXPECT_FALSE(SetOne("channels", "65").ok());
  EXPECT_FALSE(SetOne("channels", "two").ok());
}

TEST(TuningTest, Algorithm) {
  TuningRegistry registry;
  for (const char* name : {"ring", "halving_doubling", "rack", "auto"}) {
    ASSERT_TRUE(registry.Set("algorithm", name).ok()) << name;
    EXPECT_EQ(ValueOf(registry, "algorithm"), name);
  }
  ASSERT_TRUE(registry.Set("algorithm", "Halving-Doubling").ok());
  EXPECT_EQ(registry.Snapshot().algorithm, Algorithm::kHalvingDoubling);
  absl::Status bad = registry.Set("algorithm", "fastest");
  EXPECT_EQ(bad.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(bad.message(),
            "invalid value 'fastest' for 'algorithm': expected one of auto, ring, "
            "halving_doubling, rack");
  EXPECT_EQ(registry.Snapshot().algorithm, Algorithm::kHalvingDoubling);
  // No tree allreduce: refused, saying why, not run as something else.
  bad = registry.Set("algorithm", "tree");
  EXPECT_EQ(bad.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(bad.message()), HasSubstr("there is no tree allreduce"));
  EXPECT_EQ(registry.Snapshot().algorithm, Algorithm::kHalvingDoubling);
}

TEST(TuningTest, FailedSetChangesNothing) {
  TuningRegistry registry;
  ASSERT_TRUE(registry.Set("chunk_bytes", "8M").ok());
  EXPECT_FALSE(registry.Set("chunk_bytes", "8X").ok());
  EXPECT_EQ(ValueOf(registry, "chunk_bytes"), "8M");
}

TEST(TuningTest, ValuesAreFormattedCanonically) {
  TuningRegistry registry;
  ASSERT_TRUE(registry.Set("chunk_bytes", "8388608").ok());
  EXPECT_EQ(ValueOf(registry, "chunk_bytes"), "8M");
  ASSERT_TRUE(registry.Set("chunk_bytes", "1536K").ok());
  EXPECT_EQ(ValueOf(registry, "chunk_bytes"), "1536K");
  ASSERT_TRUE(registry.Set("chunk_bytes", "5000").ok());
  EXPECT_EQ(ValueOf(registry, "chunk_bytes"), "5000");
  ASSERT_TRUE(registry.Set("small_op_bytes", "0").ok());
  EXPECT_EQ(ValueOf(registry, "small_op_bytes"), "0");
}

TEST(TuningTest, UnknownKeySuggestsClosest) {
  TuningRegistry registry;
  absl::Status status = registry.Set("chunk_byte", "4M");
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(status.message(), "unknown tuning key 'chunk_byte' (did you mean 'chunk_bytes'?)");
  EXPECT_EQ(registry.Set("op_timeout", "5").message(),
            "unknown tuning key 'op_timeout' (did you mean 'op_timeout_ms'?)");
  EXPECT_EQ(registry.Set("algoritm", "ring").message(),
            "unknown tuning key 'algoritm' (did you mean 'algorithm'?)");
  EXPECT_EQ(registry.Set("fusion", "1").message(),
            "unknown tuning key 'fusion' (did you mean 'fusion_threshold_bytes'?)");
  EXPECT_EQ(registry.Set("quantum", "1").message(), "unknown tuning key 'quantum'");
  EXPECT_EQ(registry.Set("", "1").message(), "unknown tuning key ''");
}

TEST(TuningTest, CompressionKeys) {
  Tuning tuning;
  EXPECT_TRUE(SetOne("compression", "INT8", &tuning).ok());
  EXPECT_EQ(tuning.compression, "int8");
  EXPECT_TRUE(SetOne("compression", "topk:0.01", &tuning).ok());
  EXPECT_EQ(tuning.compression, "topk:0.01");
  absl::Status bad = SetOne("compression", "zstd", &tuning);
  EXPECT_EQ(bad.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(bad.message(), HasSubstr("'compression'"));
  EXPECT_THAT(bad.message(), HasSubstr("int8"));
  TuningRegistry registry;
  ASSERT_TRUE(registry.Set("compression", "topk:0.01").ok());
  EXPECT_FALSE(registry.Set("compression", "topk:0").ok());
  EXPECT_FALSE(registry.Set("compression", "topk:1.5").ok());
  EXPECT_EQ(registry.Snapshot().compression, "topk:0.01") << "a bad value changed the setting";
  EXPECT_TRUE(SetOne("error_feedback", "off", &tuning).ok());
  EXPECT_FALSE(tuning.error_feedback);
  EXPECT_FALSE(SetOne("error_feedback", "maybe", &tuning).ok());
  EXPECT_TRUE(SetOne("min_compress_bytes", "1M", &tuning).ok());
  EXPECT_EQ(tuning.min_compress_bytes, 1u << 20);
  EXPECT_TRUE(SetOne("fusion_threshold_bytes", "0", &tuning).ok());
  EXPECT_EQ(tuning.fusion_threshold_bytes, 0u);
  EXPECT_TRUE(SetOne("fusion_threshold_bytes", "64M", &tuning).ok());
  EXPECT_EQ(tuning.fusion_threshold_bytes, 64u << 20);
  EXPECT_FALSE(SetOne("fusion_threshold_bytes", "2G", &tuning).ok());
  EXPECT_TRUE(SetOne("cycle_time_us", "500", &tuning).ok());
  EXPECT_EQ(tuning.cycle_time_us, 500u);
  EXPECT_FALSE(SetOne("cycle_time_us", "-1", &tuning).ok());
  EXPECT_FALSE(SetOne("cycle_time_us", "2000000", &tuning).ok());
  EXPECT_TRUE(SetOne("staging_segment_bytes", "4K", &tuning).ok());
  EXPECT_EQ(tuning.staging_segment_bytes, 4096u);
  EXPECT_FALSE(SetOne("staging_segment_bytes", "1K", &tuning).ok());
  EXPECT_FALSE(SetOne("staging_segment_bytes", "0", &tuning).ok());
  EXPECT_TRUE(SetOne("trace_ops", "0", &tuning).ok());
  EXPECT_EQ(tuning.trace_ops, 0u);
  EXPECT_TRUE(SetOne("trace_ops", "100000", &tuning).ok());
  EXPECT_FALSE(SetOne("trace_ops", "100001", &tuning).ok());
}

TEST(TuningTest, ConcurrentSetAndSnapshot) {
  TuningRegistry registry;
  std::atomic<bool> torn{false};
  std::vector<std::thread> threads;
  // Writers keep chunk_bytes and channels in lock step through separate Set
  // calls; readers check that every snapshot holds valid values only.
  for (int w = 0; w < 2; ++w) {
    threads.emplace_back([&registry, w] {
      for (int i = 0; i < 2000; ++i) {
        uint32_t channels = 1 + (i + w) % 64;
        ASSERT_TRUE(registry.Set("channels", std::to_string(channels)).ok());
        ASSERT_TRUE(registry.Set("chunk_bytes", std::to_string(channels * 4) + "K").ok());
      }
    });
  }
  for (int r = 0; r < 2; ++r) {
    threads.emplace_back([&registry, &torn] {
      for (int i = 0; i < 2000; ++i) {
        Tuning tuning = registry.Snapshot();
        if (tuning.channels < 1 || tuning.channels > 64 || tuning.chunk_bytes < 4096 ||
            tuning.chunk_bytes % 4096 != 0) {
          torn = true;
        }
        ASSERT_TRUE(registry.Get("").ok());
      }
    });
  }
  for (std::thread& thread : threads) thread.join();
  EXPECT_FALSE(torn);
  Tuning final_tuning = registry.Snapshot();
  EXPECT_GE(final_tuning.channels, 1u);
  EXPECT_LE(final_tuning.channels, 64u);
}

}  // namespace
}  // namespace ciuic::config
