#include "compression/codec.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "compression/error_feedback.h"
#include "reduce/half.h"
#include "reduce/reduce.h"

namespace ciuic::daemon {
namespace {

using wire::DataType;

constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
constexpr DataType kFloatTypes[] = {DataType::kFloat32, DataType::kFloat64, DataType::kFloat16,
                                    DataType::kBFloat16};

size_t SizeOf(DataType dtype) { return wire::DataTypeSize(static_cast<uint32_t>(dtype)); }

std::unique_ptr<Codec> Make(const std::string& name) {
  absl::StatusOr<CodecSpec> spec = ParseCodec(name);
  EXPECT_TRUE(spec.ok()) << spec.status();
  return MakeCodec(*spec);
}

// Element buffers of any float dtype, held as bytes, read and written as
// double. 8-byte aligned (std::vector<double> storage).
class Elements {
 public:
  Elements(DataType dtype, size_t count) : dtype_(dtype), count_(count), storage_(count + 1) {}
  void* data() { return storage_.data(); }
  const void* data() const { return storage_.data(); }
  size_t count() const { return count_; }
  size_t bytes() const { return count_ * SizeOf(dtype_); }

  double Get(size_t i) const {
    const auto* p = reinterpret_cast<const unsigned char*>(storage_.data());
    switch (dtype_) {
      case DataType::kFloat32: {
        float v;
        std::memcpy(&v, p + 4 * i, 4);
        return v;
      }
      case DataType::kFloat64: {
        double v;
        std::memcpy(&v, p + 8 * i, 8);
        return v;
      }
      case DataType::kFloat16: {
        uint16_t v;
        std::memcpy(&v, p + 2 * i, 2);
        return HalfToFloat(v);
      }
      case DataType::kBFloat16: {
        uint16_t v;
        std::memcpy(&v, p + 2 * i, 2);
        return BFloat16ToFloat(v);
      }
      default:
        ADD_FAILURE();
        return 0;
    }
  }
  // Stores v rounded to the dtype (to nearest even).
  void Set(size_t i, double v) {
    auto* p = reinterpret_cast<unsigned char*>(storage_.data());
    switch (dtype_) {
      case DataType::kFloat32: {
        float f = static_cast<float>(v);
        std::memcpy(p + 4 * i, &f, 4);
        break;
      }
      case DataType::kFloat64:
        std::memcpy(p + 8 * i, &v, 8);
        break;
      case DataType::kFloat16: {
        uint16_t h = FloatToHalf(static_cast<float>(v));
        std::memcpy(p + 2 * i, &h, 2);
        break;
      }
      case DataType::kBFloat16: {
        uint16_t h = FloatToBFloat16(static_cast<float>(v));
        std::memcpy(p + 2 * i, &h, 2);
        break;
      }
      default:
        ADD_FAILURE();
    }
  }
  // Every byte, the guard element past the end included.
  bool SameBytes(const Elements& other) const {
    return std::memcmp(storage_.data(), other.storage_.data(), (count_ + 1) * sizeof(double)) == 0;
  }
  // The bytes past the last element (at least 8) all equal b.
  bool TailIs(unsigned char b) const {
    const auto* p = reinterpret_cast<const unsigned char*>(storage_.data());
    for (size_t i = bytes(); i < (count_ + 1) * sizeof(double); ++i) {
      if (p[i] != b) return false;
    }
    return true;
  }
  void FillBytes(unsigned char b) {
    std::memset(storage_.data(), b, (count_ + 1) * sizeof(double));
  }

 private:
  DataType dtype_;
  size_t count_;
  std::vector<double> storage_;
};

// Gradient-like values: normal, with magnitudes that vary from block to block.
Elements RandomElements(DataType dtype, size_t count, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<double> normal(0, 1);
  Elements e(dtype, count);
  for (size_t i = 0; i < count; ++i)
    e.Set(i, normal(rng) * std::ldexp(1.0, static_cast<int>((i / 97) % 9) - 4));
  return e;
}

std::vector<unsigned char> Encode(const Codec& codec, DataType dtype, const Elements& in) {
  const size_t max = codec.MaxEncodedBytes(dtype, in.count());
  std::vector<unsigned char> out(max + 64, 0xab);
  const size_t bytes = codec.Encode(dtype, in.data(), in.count(), out.data());
  EXPECT_LE(bytes, max);
  for (size_t i = max; i < out.size(); ++i)
    EXPECT_EQ(out[i], 0xab) << "Encode wrote past its bound";
  out.resize(bytes);
  return out;
}

// ---------------------------------------------------------------------------
// ParseCodec / CodecName

TEST(ParseCodecTest, ValidNames) {
  for (const char* name :
       {"none", "fp16", "bf16", "int8", "topk:0.01", "topk:1", "topk:0.1234567"}) {
    absl::StatusOr<CodecSpec> spec = ParseCodec(name);
    ASSERT_TRUE(spec.ok()) << name << ": " << spec.status();
    EXPECT_EQ(CodecName(*spec), name);
  }
  EXPECT_EQ(ParseCodec("topk:0.01")->kind, CodecKind::kTopK);
  EXPECT_EQ(ParseCodec("topk:0.01")->topk_ratio, 0.01);
  EXPECT_EQ(ParseCodec(" INT8 ")->kind, CodecKind::kInt8);
  EXPECT_EQ(ParseCodec("topk:1e-3")->topk_ratio, 1e-3);
}

TEST(ParseCodecTest, Errors) {
  for (const char* name : {"", "gzip", "fp32", "topk", "topk:", "topk:0", "topk:-0.1", "topk:1.5",
                           "topk:abc", "topk:nan", "topk:inf", "topk:0.1x"}) {
    absl::StatusOr<CodecSpec> spec = ParseCodec(name);
    ASSERT_FALSE(spec.ok()) << name;
    EXPECT_EQ(spec.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(spec.status().message().find(std::string("\"") + name + "\""), std::string::npos)
        << spec.status();
    EXPECT_NE(spec.status().message().find("none, fp16, bf16, int8, topk:RATIO"), std::string::npos)
        << spec.status();
  }
}

TEST(CodecTest, SupportedTypes) {
  const auto none = Make("none");
  for (uint32_t t = 1; t <= 8; ++t) EXPECT_TRUE(none->Supports(static_cast<DataType>(t)).ok());
  EXPECT_FALSE(none->Supports(static_cast<DataType>(99)).ok());
  const auto fp16 = Make("fp16");
  EXPECT_TRUE(fp16->Supports(DataType::kFloat32).ok());
  EXPECT_TRUE(fp16->Supports(DataType::kFloat16).ok());
  EXPECT_EQ(fp16->Supports(DataType::kFloat64).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_FALSE(fp16->Supports(DataType::kBFloat16).ok());
  EXPECT_EQ(fp16->MaxEncodedBytes(DataType::kFloat64, 10), 0u);
  const auto bf16 = Make("bf16");
  EXPECT_TRUE(bf16->Supports(DataType::kBFloat16).ok());
  EXPECT_FALSE(bf16->Supports(DataType::kFloat16).ok());
  for (const char* name : {"int8", "topk:0.5"}) {
    const auto codec = Make(name);
    for (DataType t : kFloatTypes) EXPECT_TRUE(codec->Supports(t).ok()) << name;
    absl::Status s = codec->Supports(DataType::kInt32);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(s.message().find("int32"), std::string::npos) << s;
    char in[8] = {};
    char out[8] = {};
    EXPECT_FALSE(codec->Decode(DataType::kInt32, in, 0, 0, out).ok());
  }
}

// ---------------------------------------------------------------------------
// Properties every codec has, for every dtype it takes and awkward sizes.

struct Case {
  std::string codec;
  DataType dtype;
  size_t count;
};

std::string CaseName(const testing::TestParamInfo<Case>& info) {
  std::string codec = info.param.codec;
  std::replace(codec.begin(), codec.end(), ':', '_');
  std::replace(codec.begin(), codec.end(), '.', '_');
  return codec + "_" + wire::DataTypeName(static_cast<uint32_t>(info.param.dtype)) + "_" +
         std::to_string(info.param.count);
}

std::vector<Case> AllCases() {
  std::vector<Case> cases;
  for (const char* codec : {"none", "fp16", "bf16", "int8", "topk:0.01", "topk:0.3", "topk:1"}) {
    for (DataType dtype : kFloatTypes) {
      if (!Make(codec)->Supports(dtype).ok()) continue;
      for (size_t count : {0, 1, 7, 255, 256, 257, 1000, 4099})
        cases.push_back({codec, dtype, count});
    }
  }
  return cases;
}

class CodecPropertyTest : public testing::TestWithParam<Case> {};

TEST_P(CodecPropertyTest, RoundTripDecodeAddAndMalformedInput) {
  const Case& c = GetParam();
  const auto codec = Make(c.codec);
  const Elements in = RandomElements(c.dtype, c.count, 7);
  const std::vector<unsigned char> wire = Encode(*codec, c.dtype, in);

  // Decode, also from a misaligned copy of the bytes.
  Elements decoded(c.dtype, c.count);
  decoded.FillBytes(0x5a);
  ASSERT_TRUE(codec->Decode(c.dtype, wire.data(), wire.size(), c.count, decoded.data()).ok());
  EXPECT_TRUE(codec->Validate(c.dtype, wire.data(), wire.size(), c.count).ok());
  std::vector<unsigned char> shifted(wire.size() + 1);
  if (!wire.empty()) std::memcpy(shifted.data() + 1, wire.data(), wire.size());
  Elements decoded2(c.dtype, c.count);
  decoded2.FillBytes(0x5a);
  ASSERT_TRUE(
      codec->Decode(c.dtype, shifted.data() + 1, wire.size(), c.count, decoded2.data()).ok());
  EXPECT_TRUE(decoded.SameBytes(decoded2));
  if (c.codec == "none" || c.codec == "topk:1") {
    EXPECT_EQ(std::memcmp(decoded.data(), in.data(), in.bytes()), 0);
  }

  // DecodeAdd == Decode, then Reduce's sum (bit for bit).
  Elements acc = RandomElements(c.dtype, c.count, 11);
  Elements expected = acc;
  const void* inputs[] = {expected.data(), decoded.data()};
  Reduce(c.dtype, wire::ReduceOp::kSum, inputs, 2, expected.data(), c.count);
  Elements acc2 = acc;
  ASSERT_TRUE(codec->DecodeAdd(c.dtype, wire.data(), wire.size(), c.count, acc.data()).ok());
  EXPECT_TRUE(acc.SameBytes(expected));
  ASSERT_TRUE(
      codec->DecodeAdd(c.dtype, shifted.data() + 1, wire.size(), c.count, acc2.data()).ok());
  EXPECT_TRUE(acc2.SameBytes(expected));

  // Malformed input: an error, and the output untouched (the guard element
  // past the end included).
  const auto expect_rejected = [&](const unsigned char* bytes, size_t size, size_t count,
                                   const char* what) {
    Elements out(c.dtype, std::max(count, c.count));
    out.FillBytes(0x5a);
    const Elements before = out;
    absl::Status s = codec->Decode(c.dtype, bytes, size, count, out.data());
    EXPECT_FALSE(s.ok()) << what;
    EXPECT_TRUE(out.SameBytes(before)) << what;
    EXPECT_EQ(codec->Validate(c.dtype, bytes, size, count), s) << what;  // the same verdict
    s = codec->DecodeAdd(c.dtype, bytes, size, count, out.data());
    EXPECT_FALSE(s.ok()) << what;
    EXPECT_TRUE(out.SameBytes(before)) << what;
  };
  std::vector<unsigned char> longer = wire;
  longer.push_back(0);
  expect_rejected(longer.data(), longer.size(), c.count, "one byte too many");
  if (!wire.empty()) {
    expect_rejected(wire.data(), wire.size() - 1, c.count, "truncated by one byte");
    if (c.codec.rfind("topk", 0) != 0 || (wire.size() / 2) % (4 + SizeOf(c.dtype)) != 0) {
      // (Half of a top-k message can be a valid shorter one.)
      expect_rejected(wire.data(), wire.size() / 2, c.count, "truncated by half");
    }
    if (c.codec.rfind("topk", 0) != 0) {
      // top-k bytes are valid for any count above the largest index kept
      // (TopKCodecTest.BadIndices covers a count below it).
      expect_rejected(wire.data(), wire.size(), c.count + 1, "count one too large");
      expect_rejected(wire.data(), wire.size(), c.count - 1, "count one too small");
    }
  }
}

TEST_P(CodecPropertyTest, GarbageNeverCrashes) {
  const Case& c = GetParam();
  const auto codec = Make(c.codec);
  std::mt19937 rng(c.count);
  const size_t max = codec->MaxEncodedBytes(c.dtype, c.count);
  for (int trial = 0; trial < 50; ++trial) {
    std::vector<unsigned char> bytes(rng() % (max + 16));
    for (auto& b : bytes) b = static_cast<unsigned char>(rng());
    Elements out(c.dtype, c.count);
    out.FillBytes(0x5a);
    const absl::Status s = codec->Decode(c.dtype, bytes.data(), bytes.size(), c.count, out.data());
    // Validate says what Decode and DecodeAdd do, for any bytes.
    EXPECT_EQ(codec->Validate(c.dtype, bytes.data(), bytes.size(), c.count), s);
    EXPECT_EQ(codec->DecodeAdd(c.dtype, bytes.data(), bytes.size(), c.count, out.data()), s);
    EXPECT_TRUE(out.TailIs(0x5a)) << "wrote past the end";
  }
}

INSTANTIATE_TEST_SUITE_P(All, CodecPropertyTest, testing::ValuesIn(AllCases()), CaseName);

// ---------------------------------------------------------------------------
// fp16 / bf16

std::vector<float> Floats(std::initializer_list<float> v) { return std::vector<float>(v); }

std::vector<float> RoundTrip(const Codec& codec, const std::vector<float>& in) {
  std::vector<unsigned char> wire(codec.MaxEncodedBytes(DataType::kFloat32, in.size()));
  const size_t bytes = codec.Encode(DataType::kFloat32, in.data(), in.size(), wire.data());
  std::vector<float> out(in.size(), 12345.0f);
  EXPECT_TRUE(codec.Decode(DataType::kFloat32, wire.data(), bytes, in.size(), out.data()).ok());
  return out;
}

// Logarithmically spread positive and negative values in [lo, hi].
std::vector<float> Spread(double lo, double hi, size_t n) {
  std::vector<float> v;
  for (size_t i = 0; i < n; ++i) {
    const double x = lo * std::pow(hi / lo, static_cast<double>(i) / (n - 1));
    v.push_back(static_cast<float>(i % 2 ? -x : x));
  }
  return v;
}

TEST(Fp16CodecTest, ErrorBounds) {
  const auto codec = Make("fp16");
  EXPECT_EQ(codec->MaxEncodedBytes(DataType::kFloat32, 10), 20u);
  // Normal range of binary16: relative error <= 2^-11.
  std::vector<float> in = Spread(0x1p-14, 65504, 100001);
  std::vector<float> out = RoundTrip(*codec, in);
  for (size_t i = 0; i < in.size(); ++i) {
    ASSERT_LE(std::fabs(out[i] - in[i]), std::ldexp(std::fabs(in[i]), -11)) << in[i];
  }
  // Below it (subnormal halves): absolute error <= 2^-25.
  in = Spread(1e-12, 0x1p-14, 10001);
  out = RoundTrip(*codec, in);
  for (size_t i = 0; i < in.size(); ++i) ASSERT_LE(std::fabs(out[i] - in[i]), 0x1p-25) << in[i];
  // Ties to even, overflow to Inf, Inf and NaN kept.
  in = Floats(
      {1 + 0x1p-11f, 1 + 3 * 0x1p-11f, 65519.0f, 65520.0f, -1e6f, kInf, -kInf, kNaN, -kNaN, -0.0f});
  out = RoundTrip(*codec, in);
  EXPECT_EQ(out[0], 1.0f);
  EXPECT_EQ(out[1], 1 + 4 * 0x1p-11f);
  EXPECT_EQ(out[2], 65504.0f);
  EXPECT_EQ(out[3], kInf);
  EXPECT_EQ(out[4], -kInf);
  EXPECT_EQ(out[5], kInf);
  EXPECT_EQ(out[6], -kInf);
  EXPECT_TRUE(std::isnan(out[7]));
  EXPECT_TRUE(std::isnan(out[8]) && std::signbit(out[8]));
  EXPECT_TRUE(out[9] == 0 && std::signbit(out[9]));
}

TEST(Bf16CodecTest, ErrorBounds) {
  const auto codec = Make("bf16");
  std::vector<float> in = Spread(1e-37, 3e38, 100001);
  std::vector<float> out = RoundTrip(*codec, in);
  for (size_t i = 0; i < in.size(); ++i) {
    ASSERT_LE(std::fabs(out[i] - in[i]), std::ldexp(std::fabs(in[i]), -8)) << in[i];
  }
  in = Floats({std::numeric_limits<float>::max(), kInf, -kInf, kNaN, -0.0f, 1 + 0x1p-8f});
  out = RoundTrip(*codec, in);
  EXPECT_EQ(out[0], kInf);  // rounds up past the largest bfloat16
  EXPECT_EQ(out[1], kInf);
  EXPECT_EQ(out[2], -kInf);
  EXPECT_TRUE(std::isnan(out[3]));
  EXPECT_TRUE(out[4] == 0 && std::signbit(out[4]));
  EXPECT_EQ(out[5], 1.0f);  // tie to even
}

// ---------------------------------------------------------------------------
// int8

TEST(Int8CodecTest, ErrorBoundPerBlock) {
  const auto codec = Make("int8");
  for (DataType dtype : kFloatTypes) {
    for (size_t count : {1, 255, 256, 257, 5000}) {
      const Elements in = RandomElements(dtype, count, 3);
      const std::vector<unsigned char> wire = Encode(*codec, dtype, in);
      const size_t blocks = (count + 255) / 256;
      EXPECT_EQ(wire.size(), 4 * blocks + count) << "every block quantised";
      Elements out(dtype, count);
      ASSERT_TRUE(codec->Decode(dtype, wire.data(), wire.size(), count, out.data()).ok());
      // The element format's own rounding of the decoded value, for 16 bits.
      const double format_ulp = dtype == DataType::kFloat16    ? 0x1p-11
                                : dtype == DataType::kBFloat16 ? 0x1p-8
                                                               : 0;
      for (size_t base = 0; base < count; base += 256) {
        const size_t end = std::min(count, base + 256);
        double max = 0;
        for (size_t i = base; i < end; ++i) max = std::max(max, std::fabs(in.Get(i)));
        for (size_t i = base; i < end; ++i) {
          ASSERT_LE(std::fabs(out.Get(i) - in.Get(i)),
                    max / 254 * (1 + 0x1p-20) + format_ulp * std::fabs(out.Get(i)))
              << "dtype " << static_cast<int>(dtype) << " element " << i;
        }
      }
    }
  }
}

TEST(Int8CodecTest, NonFiniteBlocksTravelRaw) {
  const auto codec = Make("int8");
  std::vector<float> in(1000);
  for (size_t i = 0; i < in.size(); ++i) in[i] = std::sin(static_cast<float>(i)) * 3;
  in[300] = kNaN;   // block 1
  in[600] = -kInf;  // block 2
  in[999] = kInf;   // block 3 (short)
  std::vector<unsigned char> wire(codec->MaxEncodedBytes(DataType::kFloat32, in.size()));
  const size_t bytes = codec->Encode(DataType::kFloat32, in.data(), in.size(), wire.data());
  EXPECT_EQ(bytes, 4 * 4 + 256 + 4 * (256 + 256 + 232));
  std::vector<float> out(in.size());
  ASSERT_TRUE(codec->Decode(DataType::kFloat32, wire.data(), bytes, in.size(), out.data()).ok());
  for (size_t i = 256; i < in.size(); ++i) {
    if (std::isnan(in[i])) {
      EXPECT_TRUE(std::isnan(out[i]));
    } else {
      EXPECT_EQ(out[i], in[i]) << i;  // raw blocks are exact
    }
  }
  for (size_t i = 0; i < 256; ++i) EXPECT_LE(std::fabs(out[i] - in[i]), 3.0 / 254 * (1 + 0x1p-20));
}

TEST(Int8CodecTest, ZeroTinyAndHugeBlocks) {
  const auto codec = Make("int8");
  std::vector<float> in(768, 0.0f);
  in[256] = 1e-35f;  // block 1: below 2^-100, raw
  in[257] = -3e-36f;
  in[512] = 3e38f;  // block 2: above 2^126, raw
  in[513] = -1.0f;
  std::vector<unsigned char> wire(codec->MaxEncodedBytes(DataType::kFloat32, in.size()));
  const size_t bytes = codec->Encode(DataType::kFloat32, in.data(), in.size(), wire.data());
  EXPECT_EQ(bytes, 4 + 256 + 2 * (4 + 1024));
  std::vector<float> out(in.size(), 1.0f);
  ASSERT_TRUE(codec->Decode(DataType::kFloat32, wire.data(), bytes, in.size(), out.data()).ok());
  EXPECT_EQ(out, in);
  // All zeros: scale 0, quantised.
  EXPECT_EQ(codec->Encode(DataType::kFloat32, in.data(), 256, wire.data()), 4u + 256u);
}

TEST(Int8CodecTest, InvalidScales) {
  const auto codec = Make("int8");
  std::vector<float> in(300, 1.0f);
  std::vector<unsigned char> wire(codec->MaxEncodedBytes(DataType::kFloat32, in.size()));
  const size_t bytes = codec->Encode(DataType::kFloat32, in.data(), in.size(), wire.data());
  ASSERT_EQ(bytes, 4 + 256 + 4 + 44u);
  for (float bad : {kNaN, -kNaN, -1.0f, -kInf}) {
    for (size_t at : {size_t{0}, size_t{260}}) {
      std::vector<unsigned char> broken(wire.begin(), wire.begin() + bytes);
      std::memcpy(broken.data() + at, &bad, 4);
      std::vector<float> out(in.size(), 7.0f);
      absl::Status s =
          codec->Decode(DataType::kFloat32, broken.data(), bytes, in.size(), out.data());
      EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << bad;
      EXPECT_NE(s.message().find("invalid scale"), std::string::npos) << s;
      EXPECT_EQ(codec->Validate(DataType::kFloat32, broken.data(), bytes, in.size()), s);
      EXPECT_EQ(out, std::vector<float>(in.size(), 7.0f));
    }
  }
  // A raw marker where a quantised block was: now too short.
  std::vector<unsigned char> broken(wire.begin(), wire.begin() + bytes);
  std::memcpy(broken.data(), &kInf, 4);
  std::vector<float> out(in.size());
  EXPECT_FALSE(codec->Decode(DataType::kFloat32, broken.data(), bytes, in.size(), out.data()).ok());
}

// ---------------------------------------------------------------------------
// top-k

TEST(TopKCodecTest, KeepsTheLargestExactly) {
  for (DataType dtype : kFloatTypes) {
    for (const char* name : {"topk:0.01", "topk:0.1", "topk:0.5"}) {
      const auto codec = Make(name);
      const double ratio = ParseCodec(name)->topk_ratio;
      // 70000 and more: the sampled pre-selection (codec_topk.cc).
      for (size_t count : {1, 99, 100, 101, 4099, 70000}) {
        Elements in = RandomElements(dtype, count, 5);
        // Ties in magnitude, broken by lowest index.
        if (count > 50) {
          for (size_t i = 10; i < 50; ++i) in.Set(i, i % 2 ? 100.0 : -100.0);
        }
        const size_t k = std::max<size_t>(1, static_cast<size_t>(std::ceil(ratio * count)));
        const std::vector<unsigned char> wire = Encode(*codec, dtype, in);
        EXPECT_EQ(wire.size(), k * (4 + SizeOf(dtype)));
        Elements out(dtype, count);
        out.FillBytes(0x77);
        ASSERT_TRUE(codec->Decode(dtype, wire.data(), wire.size(), count, out.data()).ok());
        std::vector<size_t> order(count);
        std::iota(order.begin(), order.end(), 0);
        std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
          return std::fabs(in.Get(a)) > std::fabs(in.Get(b));
        });
        std::vector<bool> kept(count, false);
        for (size_t j = 0; j < k; ++j) kept[order[j]] = true;
        for (size_t i = 0; i < count; ++i) {
          if (kept[i]) {
            ASSERT_EQ(out.Get(i), in.Get(i)) << name << " " << i;
          } else {
            ASSERT_EQ(std::bit_cast<uint64_t>(out.Get(i)), 0u) << name << " " << i;  // +0
          }
        }
      }
    }
  }
}

TEST(TopKCodecTest, NonFiniteAlwaysKept) {
  const auto codec = Make("topk:0.01");
  std::vector<float> in(1000, 5.0f);
  in[3] = 1.0f;  // smaller than the rest, but NaN/Inf outrank everything
  in[500] = kNaN;
  in[999] = -kInf;
  std::vector<unsigned char> wire(codec->MaxEncodedBytes(DataType::kFloat32, in.size()));
  const size_t bytes = codec->Encode(DataType::kFloat32, in.data(), in.size(), wire.data());
  ASSERT_EQ(bytes, 10 * 8u);
  std::vector<float> out(in.size());
  ASSERT_TRUE(codec->Decode(DataType::kFloat32, wire.data(), bytes, in.size(), out.data()).ok());
  EXPECT_TRUE(std::isnan(out[500]));
  EXPECT_EQ(out[999], -kInf);
  // The other 8 are ties at 5, taken by lowest index (skipping the 1 at 3).
  for (size_t i = 0; i < 9; ++i) EXPECT_EQ(out[i], i == 3 ? 0.0f : 5.0f) << i;
  EXPECT_EQ(out[9], 0.0f);
}

TEST(TopKCodecTest, SeaOfTies) {
  // The sample sees only 1.0: too many elements reach it, and the selection
  // falls back to all elements.
  const auto codec = Make("topk:0.01");
  std::vector<float> in(100000, 1.0f);
  for (size_t i = 0; i < 10; ++i) in[99990 - 1000 * i] = -2.0f;
  std::vector<unsigned char> wire(codec->MaxEncodedBytes(DataType::kFloat32, in.size()));
  const size_t bytes = codec->Encode(DataType::kFloat32, in.data(), in.size(), wire.data());
  ASSERT_EQ(bytes, 1000 * 8u);
  std::vector<float> out(in.size());
  ASSERT_TRUE(codec->Decode(DataType::kFloat32, wire.data(), bytes, in.size(), out.data()).ok());
  size_t ones = 0;
  for (size_t i = 0; i < in.size(); ++i) {
    if (in[i] == -2.0f) {
      EXPECT_EQ(out[i], -2.0f);
    } else {
      EXPECT_EQ(out[i], i < 990 ? 1.0f : 0.0f) << i;
      ones += out[i] == 1.0f;
    }
  }
  EXPECT_EQ(ones, 990u);
}

TEST(TopKCodecTest, BadIndices) {
  const auto codec = Make("topk:0.01");
  std::vector<float> in(1000);
  for (size_t i = 0; i < in.size(); ++i) in[i] = static_cast<float>(i);
  std::vector<unsigned char> wire(codec->MaxEncodedBytes(DataType::kFloat32, in.size()));
  const size_t bytes = codec->Encode(DataType::kFloat32, in.data(), in.size(), wire.data());
  ASSERT_EQ(bytes, 80u);
  uint32_t first;
  std::memcpy(&first, wire.data(), 4);
  EXPECT_EQ(first, 990u);
  const auto rejects = [&](uint32_t index, size_t at, size_t count) {
    std::vector<unsigned char> broken(wire.begin(), wire.begin() + bytes);
    std::memcpy(broken.data() + 4 * at, &index, 4);
    std::vector<float> out(count, 7.0f);
    absl::Status s = codec->Decode(DataType::kFloat32, broken.data(), bytes, count, out.data());
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << index << " at " << at;
    EXPECT_EQ(codec->Validate(DataType::kFloat32, broken.data(), bytes, count), s);
    s = codec->DecodeAdd(DataType::kFloat32, broken.data(), bytes, count, out.data());
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << index << " at " << at;
    EXPECT_EQ(out, std::vector<float>(count, 7.0f));
  };
  rejects(1000, 9, 1000);  // past the end
  rejects(0xffffffffu, 9, 1000);
  rejects(990, 1, 1000);  // duplicate
  rejects(995, 0, 1000);  // not increasing
  rejects(990, 0, 995);   // indices beyond a smaller count
  std::vector<float> out(5);
  EXPECT_FALSE(codec->Decode(DataType::kFloat32, wire.data(), bytes, 5, out.data()).ok())
      << "more entries than elements";
}

// SplitGranule: where a codec says it is splittable, encoding two pieces
// cut at a multiple of the granule gives the bytes of encoding the whole
// (also with NaN/Inf, tiny and huge blocks, which int8 sends raw), and the
// typical size is exact unless something travels raw.
TEST(CodecTest, SplitGranuleConcatenatesAndTypicalSizeHolds) {
  for (const char* name : {"none", "fp16", "bf16", "int8", "topk:0.01"}) {
    auto codec = Make(name);
    const size_t g = codec->SplitGranule();
    if (std::string(name) == "topk:0.01") {
      EXPECT_EQ(g, 0u);
      continue;
    }
    ASSERT_GT(g, 0u) << name;
    for (DataType dtype : kFloatTypes) {
      if (!codec->Supports(dtype).ok()) continue;
      for (size_t count : {size_t{1}, size_t{300}, size_t{1000}, size_t{4099}}) {
        for (bool special : {false, true}) {
          Elements in = RandomElements(dtype, count, 11 + count);
          if (special && count > 600) {
            in.Set(3, kNaN);
            in.Set(count - 1, -kInf);
            for (size_t i = 256; i < 512; ++i) in.Set(i, 1e-35 * (i % 3));  // tiny block
          }
          const std::vector<unsigned char> whole = Encode(*codec, dtype, in);
          if (!special) {
            EXPECT_EQ(whole.size(), codec->TypicalEncodedBytes(dtype, count)) << name;
          }
          EXPECT_LE(codec->TypicalEncodedBytes(dtype, count), codec->MaxEncodedBytes(dtype, count));
          for (size_t a = 0; a <= count; a += g * (count > 1000 ? 3 : 1)) {
            Elements head(dtype, a), tail(dtype, count - a);
            for (size_t i = 0; i < a; ++i) head.Set(i, in.Get(i));
            for (size_t i = a; i < count; ++i) tail.Set(i - a, in.Get(i));
            std::vector<unsigned char> joined = Encode(*codec, dtype, head);
            const std::vector<unsigned char> t = Encode(*codec, dtype, tail);
            joined.insert(joined.end(), t.begin(), t.end());
            ASSERT_EQ(joined, whole) << name << " count " << count << " split at " << a;
          }
        }
      }
    }
  }
}

TEST(CodecTest, ZeroLength) {
  for (const char* name : {"none", "fp16", "bf16", "int8", "topk:0.01"}) {
    const auto codec = Make(name);
    EXPECT_EQ(codec->MaxEncodedBytes(DataType::kFloat32, 0), 0u) << name;
    EXPECT_EQ(codec->Encode(DataType::kFloat32, nullptr, 0, nullptr), 0u) << name;
    EXPECT_TRUE(codec->Decode(DataType::kFloat32, nullptr, 0, 0, nullptr).ok()) << name;
    EXPECT_TRUE(codec->DecodeAdd(DataType::kFloat32, nullptr, 0, 0, nullptr).ok()) << name;
    const unsigned char junk[8] = {};
    EXPECT_FALSE(codec->Decode(DataType::kFloat32, junk, 8, 0, nullptr).ok()) << name;
  }
}

TEST(NoneCodecTest, IntegersAddWithWraparound) {
  const auto codec = Make("none");
  const int8_t in[3] = {100, -100, 5};
  unsigned char wire[4];
  ASSERT_EQ(codec->Encode(DataType::kInt8, in, 3, wire + 1), 3u);
  int8_t acc[3] = {100, -100, 1};
  ASSERT_TRUE(codec->DecodeAdd(DataType::kInt8, wire + 1, 3, 3, acc).ok());
  EXPECT_EQ(acc[0], static_cast<int8_t>(200 - 256));
  EXPECT_EQ(acc[1], static_cast<int8_t>(-200 + 256));
  EXPECT_EQ(acc[2], 6);
  std::vector<int64_t> big(5000, 3), sum(5000, 4);
  std::vector<unsigned char> wire2(big.size() * 8 + 1);
  codec->Encode(DataType::kInt64, big.data(), big.size(), wire2.data() + 1);  // misaligned
  ASSERT_TRUE(
      codec->DecodeAdd(DataType::kInt64, wire2.data() + 1, big.size() * 8, big.size(), sum.data())
          .ok());
  EXPECT_EQ(sum, std::vector<int64_t>(5000, 7));
}

// ---------------------------------------------------------------------------
// Error feedback

// One sender's steps with error feedback; returns what the receivers summed
// (in double, so that the sum itself adds no rounding).
struct FeedbackRun {
  std::vector<double> sum;
  std::vector<float> residual;  // the last residual, as original - decoded
};

FeedbackRun RunSteps(const Codec& codec, ErrorFeedback* ef, const std::vector<float>& g,
                     int steps) {
  const size_t n = g.size();
  FeedbackRun run{std::vector<double>(n, 0), std::vector<float>(n, 0)};
  std::vector<unsigned char> wire(codec.MaxEncodedBytes(DataType::kFloat32, n));
  std::vector<float> data(n), decoded(n);
  for (int step = 0; step < steps; ++step) {
    data = g;
    if (ef != nullptr) ef->Apply("grad", data.data(), n);
    const size_t bytes = codec.Encode(DataType::kFloat32, data.data(), n, wire.data());
    EXPECT_TRUE(codec.Decode(DataType::kFloat32, wire.data(), bytes, n, decoded.data()).ok());
    if (ef != nullptr) ef->Update("grad", data.data(), decoded.data(), n);
    for (size_t i = 0; i < n; ++i) {
      run.sum[i] += decoded[i];
      run.residual[i] = data[i] - decoded[i];
    }
  }
  return run;
}

std::vector<float> Gradient(size_t n) {
  std::mt19937 rng(42);
  std::normal_distribution<float> normal(0, 1);
  std::vector<float> g(n);
  for (size_t i = 0; i < n; ++i) g[i] = normal(rng) * static_cast<float>(1 + i % 7) * 1e-3f;
  return g;
}

// int8: sum of decoded = 200 g - r_200 (the residuals telescope), and each
// residual is one quantisation error of g + r: |r| <= (max|g_block| + |r|)/254,
// so |r| <= max|g_block| / 253 at every step. Float rounding of the
// additions adds about 200 * 2^-24 |g| (asserted with 2x margin).
TEST(ErrorFeedbackTest, Int8SumTracksExactSum) {
  const auto codec = Make("int8");
  const std::vector<float> g = Gradient(4096);
  for (int steps : {100, 200}) {
    ErrorFeedback ef(1 << 20);
    const FeedbackRun run = RunSteps(*codec, &ef, g, steps);
    const FeedbackRun plain = RunSteps(*codec, nullptr, g, steps);
    double worst = 0, worst_plain = 0;
    for (size_t base = 0; base < g.size(); base += 256) {
      double max = 0;
      for (size_t i = base; i < base + 256; ++i) max = std::max(max, std::fabs(double{g[i]}));
      for (size_t i = base; i < base + 256; ++i) {
        const double err = std::fabs(run.sum[i] - steps * double{g[i]});
        ASSERT_LE(err, max / 253 + steps * 0x1p-23 * std::fabs(g[i])) << i << " after " << steps;
        worst = std::max(worst, err / max);
        worst_plain = std::max(worst_plain, std::fabs(plain.sum[i] - steps * double{g[i]}) / max);
      }
    }
    // Without error feedback the error grows with the steps.
    EXPECT_GT(worst_plain, 10 * worst) << steps;
  }
}

// top-k: ||x - topk(x)||^2 <= (1 - k/n) ||x||^2, so with q = sqrt(1 - k/n)
// every residual satisfies ||r|| <= q (||g|| + ||r_prev||), hence
// ||r|| <= q / (1 - q) ||g|| at every step, and ||sum - T g|| = ||r_T|| is
// bounded by that, whatever T. (For k/n = 41/4096 that is ~198 ||g||; in
// practice it is far smaller, which the second bound checks: every element is
// sent once its accumulated value reaches the k-th largest, about
// ||g||_1 / k, so |r_i| stays below ||g||_1 / k + 2 max|g|.)
TEST(ErrorFeedbackTest, TopKSumTracksExactSum) {
  const auto codec = Make("topk:0.01");
  const std::vector<float> g = Gradient(4096);
  const double k = 41;
  double norm = 0, l1 = 0, max = 0;
  for (float v : g) {
    norm += double{v} * v;
    l1 += std::fabs(v);
    max = std::max(max, std::fabs(double{v}));
  }
  norm = std::sqrt(norm);
  const double q = std::sqrt(1 - k / g.size());
  double error_at[2] = {};
  int index = 0;
  for (int steps : {200, 400}) {
    ErrorFeedback ef(1 << 20);
    const FeedbackRun run = RunSteps(*codec, &ef, g, steps);
    double err2 = 0, err_max = 0;
    for (size_t i = 0; i < g.size(); ++i) {
      const double err = run.sum[i] - steps * double{g[i]};
      err2 += err * err;
      err_max = std::max(err_max, std::fabs(err));
    }
    const double err = std::sqrt(err2);
    EXPECT_LE(err, q / (1 - q) * norm * (1 + 1e-3)) << steps;
    EXPECT_LE(err_max, l1 / k + 2 * max) << steps;
    error_at[index++] = err;
  }
  EXPECT_LT(error_at[1], 1.5 * error_at[0]) << "error grows with the steps";
  // Without error feedback, the dropped 99% never arrive.
  const FeedbackRun plain = RunSteps(*codec, nullptr, g, 200);
  double plain2 = 0;
  for (size_t i = 0; i < g.size(); ++i) plain2 += std::pow(plain.sum[i] - 200.0 * g[i], 2);
  EXPECT_GT(std::sqrt(plain2), 5 * error_at[0]);
}

TEST(ErrorFeedbackTest, ResidualIsWhatWasDropped) {
  ErrorFeedback ef(1024);
  std::vector<float> data = {1, 2, 3, kInf};
  ef.Apply("a", data.data(), 4);  // no residual yet: unchanged
  EXPECT_EQ(data, Floats({1, 2, 3, kInf}));
  const std::vector<float> decoded = {0.5f, 2, 4, kInf};
  ef.Update("a", data.data(), decoded.data(), 4);
  std::vector<float> next = {10, 10, 10, 10};
  ef.Apply("a", next.data(), 4);
  EXPECT_EQ(next, Floats({10.5f, 10, 9, 10}));  // Inf - Inf stored as 0
  // A count change drops the residual.
  std::vector<float> other = {10, 10, 10};
  ef.Apply("a", other.data(), 3);
  EXPECT_EQ(other, Floats({10, 10, 10}));
  EXPECT_EQ(ef.GetStats().size_resets, 1u);
  EXPECT_EQ(ef.GetStats().names, 0u);
  ef.Update("a", data.data(), decoded.data(), 4);
  ef.Forget("a");
  ef.Apply("a", next.data(), 4);
  EXPECT_EQ(next, Floats({10.5f, 10, 9, 10}));
  EXPECT_EQ(ef.GetStats().bytes, 0u);
}

// ApplyRange / UpdateRange over the pieces of a buffer give what Apply /
// Update over the whole give, in any piece order; a new residual starts at
// zero outside the written range; a count change resets.
TEST(ErrorFeedbackTest, RangesMatchWholeBufferOperations) {
  std::mt19937 rng(4);
  std::normal_distribution<float> normal(0, 1);
  const size_t n = 1000;
  std::vector<float> data(n), decoded(n);
  for (size_t i = 0; i < n; ++i) {
    data[i] = normal(rng);
    decoded[i] = data[i] + 0.01f * normal(rng);
  }
  ErrorFeedback whole(1 << 20), ranges(1 << 20);
  whole.Update("w", data.data(), decoded.data(), n);
  const size_t cuts[] = {0, 1, 300, 301, 777, 1000};
  for (int k = 4; k >= 0; --k) {  // pieces in reverse order
    const size_t a = cuts[k], b = cuts[k + 1];
    ranges.UpdateRange("w", n, a, data.data() + a, decoded.data() + a, b - a);
  }
  std::vector<float> x(n, 1.0f), y(n, 1.0f);
  whole.Apply("w", x.data(), n);
  for (int k = 0; k < 5; ++k) ranges.ApplyRange("w", n, cuts[k], y.data() + cuts[k], cuts[k + 1] - cuts[k]);
  EXPECT_EQ(x, y);
  // A fresh residual written only on [10, 20): zero elsewhere.
  ErrorFeedback part(1 << 20);
  part.UpdateRange("p", n, 10, data.data(), decoded.data(), 10);
  std::vector<float> z(n, 2.0f);
  part.ApplyRange("p", n, 0, z.data(), n);
  for (size_t i = 0; i < n; ++i) {
    const float want = i >= 10 && i < 20 ? 2.0f + (data[i - 10] - decoded[i - 10]) : 2.0f;
    ASSERT_EQ(z[i], want) << i;
  }
  // Another count for the same name resets it.
  std::vector<float> w(10, 3.0f);
  part.ApplyRange("p", n + 1, 0, w.data(), 10);
  EXPECT_EQ(w, std::vector<float>(10, 3.0f));
  EXPECT_EQ(part.GetStats().size_resets, 1u);
  EXPECT_EQ(part.GetStats().names, 0u);
}

TEST(ErrorFeedbackTest, LeastRecentlyUsedWithinTheCap) {
  ErrorFeedback ef(3 * 400);  // three residuals of 100 floats
  const std::vector<float> zero(100, 0), one(100, 1);
  for (const char* name : {"a", "b", "c"}) ef.Update(name, one.data(), zero.data(), 100);
  std::vector<float> data(100, 0);
  ef.Apply("a", data.data(), 100);               // "a" becomes the most recent
  ef.Update("d", one.data(), zero.data(), 100);  // evicts "b"
  ErrorFeedback::Stats stats = ef.GetStats();
  EXPECT_EQ(stats.names, 3u);
  EXPECT_EQ(stats.bytes, 1200u);
  EXPECT_EQ(stats.evictions, 1u);
  for (const char* name : {"a", "b", "c", "d"}) {
    std::vector<float> probe(100, 0);
    ef.Apply(name, probe.data(), 100);
    EXPECT_EQ(probe[0], std::string(name) == "b" ? 0.0f : 1.0f) << name;
  }
  const std::vector<float> huge(301, 1), huge_zero(301, 0);
  ef.Update("e", huge.data(), huge_zero.data(), 301);  // larger than the cap: not kept
  EXPECT_EQ(ef.GetStats().too_large, 1u);
  EXPECT_EQ(ef.GetStats().names, 3u);
}

}  // namespace
}  // namespace ciuic::daemon
