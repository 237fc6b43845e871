#include "reduce/reduce.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <string>
#include <string_view>
#include <tuple>
#include <type_traits>
#include <vector>

#include "reduce/half.h"

namespace ciuic::reduce {
namespace {

using wire::DataType;
using wire::ReduceOp;

// Every instruction-set build of the kernels this CPU can run (reduce.h):
// the result tests run each of them against the same reference. Restores
// the process's build when it goes out of scope.
class ForEachIsa {
 public:
  ForEachIsa() : saved_(ActiveIsa()) {}
  ~ForEachIsa() { EXPECT_TRUE(SetIsa(saved_).ok()); }
  std::vector<std::string_view> names() const { return SupportedIsas(); }
  // Switches to `isa`; false (with a test failure) if that did not work.
  bool Use(std::string_view isa) {
    const absl::Status s = SetIsa(isa);
    EXPECT_TRUE(s.ok()) << s;
    return s.ok() && ActiveIsa() == isa;
  }

 private:
  std::string_view saved_;
};

constexpr auto& kAllTypes = wire::kAllDataTypes;
constexpr auto& kAllOps = wire::kAllReduceOps;

// ---------------------------------------------------------------------------
// Reference conversions: plain arithmetic on doubles (ldexp, nearbyint), no
// bit tricks, written independently of half.h.

struct SmallFloat {
  int mant_bits;
  int exp_bits;
  int bias;
};
constexpr SmallFloat kBinary16{10, 5, 15};
constexpr SmallFloat kBFloat16Format{7, 8, 127};

float RefToFloat(uint16_t bits, SmallFloat f) {
  const bool negative = (bits >> 15) != 0;
  const int e = (bits >> f.mant_bits) & ((1 << f.exp_bits) - 1);
  const int m = bits & ((1 << f.mant_bits) - 1);
  double v;
  if (e == (1 << f.exp_bits) - 1) {
    v = m == 0 ? std::numeric_limits<double>::infinity()
               : std::numeric_limits<double>::quiet_NaN();
  } else if (e == 0) {
    v = std::ldexp(m, 1 - f.bias - f.mant_bits);
  } else {
    v = std::ldexp(m + (1 << f.mant_bits), e - f.bias - f.mant_bits);
  }
  return static_cast<float>(negative ? -v : v);
}

// Rounds to nearest even (nearbyint in the default rounding mode).
uint16_t RefFromFloat(float x, SmallFloat f) {
  const uint16_t sign = std::signbit(x) ? 0x8000 : 0;
  const uint16_t inf = static_cast<uint16_t>(((1 << f.exp_bits) - 1) << f.mant_bits);
  if (std::isnan(x)) return sign | inf | static_cast<uint16_t>(1 << (f.mant_bits - 1));
  if (std::isinf(x)) return sign | inf;
  const double a = std::fabs(static_cast<double>(x));
  const int emin = 1 - f.bias;                          // smallest normal exponent
  const int emax = (1 << f.exp_bits) - 2 - f.bias;      // largest exponent
  const int e = a == 0 ? emin : std::max(std::ilogb(a), emin);
  const double quantum = std::ldexp(1.0, e - f.mant_bits);
  const double r = std::nearbyint(a / quantum) * quantum;  // exact in double
  if (r >= std::ldexp(1.0, emax + 1)) return sign | inf;
  if (r < std::ldexp(1.0, emin)) {
    return sign | static_cast<uint16_t>(r / std::ldexp(1.0, emin - f.mant_bits));
  }
  const int re = std::ilogb(r);
  const int mant = static_cast<int>(r / std::ldexp(1.0, re - f.mant_bits)) - (1 << f.mant_bits);
  return sign | static_cast<uint16_t>(((re + f.bias) << f.mant_bits) | mant);
}

uint32_t Bits(float f) { return std::bit_cast<uint32_t>(f); }
float FromBits(uint32_t b) { return std::bit_cast<float>(b); }
bool IsHalfNaN(uint16_t h) { return (h & 0x7c00) == 0x7c00 && (h & 0x03ff) != 0; }
bool IsBf16NaN(uint16_t b) { return (b & 0x7f80) == 0x7f80 && (b & 0x007f) != 0; }

// ---------------------------------------------------------------------------
// Conversions.

static_assert(HalfToFloat(0x3c00) == 1.0f);
static_assert(HalfToFloat(0xc000) == -2.0f);
static_assert(HalfToFloat(0x0001) == 0x1p-24f);
static_assert(FloatToHalf(1.0f) == 0x3c00);
static_assert(FloatToHalf(65504.0f) == 0x7bff);
static_assert(FloatToHalf(65520.0f) == 0x7c00);
static_assert(BFloat16ToFloat(0x3f80) == 1.0f);
static_assert(FloatToBFloat16(1.0f) == 0x3f80);

TEST(HalfTest, HalfToFloatMatchesReferenceForAllPatterns) {
  for (uint32_t i = 0; i < 0x10000; ++i) {
    const uint16_t h = static_cast<uint16_t>(i);
    const float got = HalfToFloat(h);
    if (IsHalfNaN(h)) {
      ASSERT_TRUE(std::isnan(got)) << std::hex << i;
      ASSERT_NE(Bits(got) & 0x00400000u, 0u) << "NaN not quiet " << std::hex << i;
      ASSERT_EQ(std::signbit(got), (h & 0x8000) != 0) << std::hex << i;
    } else {
      ASSERT_EQ(Bits(got), Bits(RefToFloat(h, kBinary16))) << std::hex << i;
    }
  }
}

TEST(HalfTest, BFloat16ToFloatMatchesReferenceForAllPatterns) {
  for (uint32_t i = 0; i < 0x10000; ++i) {
    const uint16_t b = static_cast<uint16_t>(i);
    const float got = BFloat16ToFloat(b);
    if (IsBf16NaN(b)) {
      ASSERT_TRUE(std::isnan(got)) << std::hex << i;
      ASSERT_NE(Bits(got) & 0x00400000u, 0u) << "NaN not quiet " << std::hex << i;
    } else {
      ASSERT_EQ(Bits(got), Bits(RefToFloat(b, kBFloat16Format))) << std::hex << i;
    }
  }
}

TEST(HalfTest, RoundTripIsIdentityForAllPatterns) {
  for (uint32_t i = 0; i < 0x10000; ++i) {
    const uint16_t h = static_cast<uint16_t>(i);
    const uint16_t half_back = FloatToHalf(HalfToFloat(h));
    const uint16_t bf16_back = FloatToBFloat16(BFloat16ToFloat(h));
    if (IsHalfNaN(h)) {
      ASSERT_TRUE(IsHalfNaN(half_back)) << std::hex << i;
      ASSERT_NE(half_back & 0x0200, 0) << "NaN not quiet " << std::hex << i;
      ASSERT_EQ(half_back & 0x8000, h & 0x8000) << std::hex << i;
    } else {
      ASSERT_EQ(half_back, h) << std::hex << i;
    }
    if (IsBf16NaN(h)) {
      ASSERT_TRUE(IsBf16NaN(bf16_back)) << std::hex << i;
      ASSERT_NE(bf16_back & 0x0040, 0) << "NaN not quiet " << std::hex << i;
    } else {
      ASSERT_EQ(bf16_back, h) << std::hex << i;
    }
  }
}

// Every tie between two neighbouring finite values (both signs, subnormals
// included) and the floats just beside it; the step past the largest finite
// value is the one to Inf.
TEST(HalfTest, TiesRoundToEvenAndNeighboursToNearest) {
  struct Case {
    SmallFloat format;
    uint16_t (*convert)(float);
    uint16_t inf;
  };
  for (const Case& c : {Case{kBinary16, &FloatToHalf, 0x7c00},
                        Case{kBFloat16Format, &FloatToBFloat16, 0x7f80}}) {
    for (uint16_t h = 0; h < c.inf; ++h) {
      const double lo = RefToFloat(h, c.format);
      const double hi = h + 1 == c.inf
                            ? std::ldexp(1.0, (1 << c.format.exp_bits) - 1 - c.format.bias)
                            : RefToFloat(static_cast<uint16_t>(h + 1), c.format);
      const float mid = static_cast<float>((lo + hi) / 2);
      ASSERT_EQ(static_cast<double>(mid), (lo + hi) / 2) << "tie not exact in float";
      const uint16_t even = (h & 1) == 0 ? h : static_cast<uint16_t>(h + 1);
      for (const float sign : {1.0f, -1.0f}) {
        const uint16_t s = sign < 0 ? 0x8000 : 0;
        ASSERT_EQ(c.convert(sign * mid), s | even) << std::hex << h;
        ASSERT_EQ(c.convert(sign * std::nextafter(mid, 0.0f)), s | h) << std::hex << h;
        ASSERT_EQ(c.convert(sign * std::nextafter(mid, std::numeric_limits<float>::infinity())), s | (h + 1)) << std::hex << h;
        ASSERT_EQ(c.convert(sign * static_cast<float>(lo)), s | h) << std::hex << h;
      }
    }
  }
}

// A strided sweep of all float bit patterns against the reference.
TEST(HalfTest, FloatToHalfAndBFloat16MatchReferenceOnSweep) {
  for (uint64_t i = 0; i < (uint64_t{1} << 32); i += 2053) {
    const float f = FromBits(static_cast<uint32_t>(i));
    const uint16_t h = FloatToHalf(f);
    const uint16_t b = FloatToBFloat16(f);
    if (std::isnan(f)) {
      ASSERT_TRUE(IsHalfNaN(h) && (h & 0x0200)) << std::hex << i;
      ASSERT_TRUE(IsBf16NaN(b) && (b & 0x0040)) << std::hex << i;
    } else {
      ASSERT_EQ(h, RefFromFloat(f, kBinary16)) << std::hex << i;
      ASSERT_EQ(b, RefFromFloat(f, kBFloat16Format)) << std::hex << i;
    }
  }
}

TEST(HalfTest, SpecialValues) {
  const float inf = std::numeric_limits<float>::infinity();
  const float max = std::numeric_limits<float>::max();
  EXPECT_EQ(FloatToHalf(inf), 0x7c00);
  EXPECT_EQ(FloatToHalf(-inf), 0xfc00);
  EXPECT_EQ(FloatToHalf(max), 0x7c00);
  EXPECT_EQ(FloatToHalf(-1e10f), 0xfc00);
  EXPECT_EQ(FloatToHalf(65519.996f), 0x7bff);
  EXPECT_EQ(FloatToHalf(-0.0f), 0x8000);
  EXPECT_EQ(FloatToHalf(0x1p-25f), 0x0000);                 // tie with 0: even
  EXPECT_EQ(FloatToHalf(0x1.000002p-25f), 0x0001);          // just above the tie
  EXPECT_EQ(FloatToHalf(0x1.8p-24f), 0x0002);               // tie 1 vs 2: even
  EXPECT_EQ(FloatToHalf(std::numeric_limits<float>::denorm_min()), 0x0000);
  EXPECT_EQ(FloatToHalf(0x1.ff8p-15f), 0x03ff);             // largest subnormal
  EXPECT_EQ(FloatToHalf(0x1.ffap-15f), 0x03ff);
  EXPECT_EQ(FloatToHalf(0x1.ffcp-15f), 0x0400);             // tie: up to the normal
  EXPECT_EQ(FloatToHalf(0x1.ff4p-15f), 0x03fe);             // tie: down, even
  EXPECT_EQ(HalfToFloat(0x7c00), inf);
  EXPECT_EQ(HalfToFloat(0xfc00), -inf);
  EXPECT_EQ(HalfToFloat(0x03ff), 0x1.ff8p-15f);
  // Signalling NaNs come out quiet.
  EXPECT_EQ(FloatToHalf(FromBits(0x7f800001u)), 0x7e00);
  EXPECT_EQ(FloatToHalf(FromBits(0xffa00000u)), 0xfe00);
  EXPECT_EQ(Bits(HalfToFloat(0x7c01)), 0x7fc02000u);
  EXPECT_EQ(FloatToBFloat16(FromBits(0x7f800001u)), 0x7fc0);
  EXPECT_EQ(Bits(BFloat16ToFloat(0x7f81)), 0x7fc10000u);

  EXPECT_EQ(FloatToBFloat16(inf), 0x7f80);
  EXPECT_EQ(FloatToBFloat16(-inf), 0xff80);
  EXPECT_EQ(FloatToBFloat16(max), 0x7f80);  // above the last tie
  EXPECT_EQ(FloatToBFloat16(FromBits(0x7f7f7fffu)), 0x7f7f);
  EXPECT_EQ(FloatToBFloat16(FromBits(0x00008000u)), 0x0000);  // subnormal tie
  EXPECT_EQ(FloatToBFloat16(FromBits(0x00018000u)), 0x0002);
  EXPECT_EQ(FloatToBFloat16(FromBits(0x80008001u)), 0x8001);
}

// ---------------------------------------------------------------------------
// CheckReducible.

TEST(CheckReducibleTest, AcceptsEveryTypeAndOp) {
  for (DataType dtype : kAllTypes) {
    for (ReduceOp op : kAllOps) {
      EXPECT_TRUE(CheckReducible(dtype, op).ok());
      EXPECT_TRUE(CheckReducible(static_cast<uint32_t>(dtype), static_cast<uint32_t>(op)).ok());
    }
  }
}

TEST(CheckReducibleTest, RejectsGarbageNamingTheValue) {
  struct Case {
    uint32_t dtype, op;
    std::string expected;
  };
  for (const Case& c : {Case{0, 1, "0"}, Case{9, 1, "9"}, Case{4294967295u, 1, "4294967295"},
                        Case{1, 0, "0"}, Case{1, 6, "6"}, Case{8, 0xdeadbeef, "3735928559"},
                        Case{0x80000001u, 0x80000001u, "2147483649"}}) {
    const absl::Status status = CheckReducible(c.dtype, c.op);
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << c.dtype << " " << c.op;
    EXPECT_NE(status.message().find(c.expected), std::string::npos) << status;
  }
  EXPECT_EQ(CheckReducible(static_cast<DataType>(42), ReduceOp::kSum).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(CheckReducible(DataType::kFloat32, static_cast<ReduceOp>(42)).code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(ReduceDeathTest, InvalidValuesStopTheProcess) {
  float a[1] = {1}, out[1];
  const void* in[] = {a};
  EXPECT_DEATH(Reduce(static_cast<DataType>(9), ReduceOp::kSum, in, 1, out, 1), "data type 9");
  EXPECT_DEATH(Reduce(DataType::kFloat32, static_cast<ReduceOp>(0), in, 1, out, 1), "op 0");
  EXPECT_DEATH(Reduce(DataType::kFloat32, ReduceOp::kSum, in, 0, out, 1), "num_inputs");
}

// ---------------------------------------------------------------------------
// The reference reduction: one element at a time, in the obvious way.

template <typename T>
T RefFloatFold(ReduceOp op, const std::vector<T>& v) {
  if (op == ReduceOp::kMin || op == ReduceOp::kMax) {
    for (T x : v) {
      if (std::isnan(x)) return std::numeric_limits<T>::quiet_NaN();
    }
    T r = v[0];
    for (size_t k = 1; k < v.size(); ++k) {
      if (op == ReduceOp::kMin ? v[k] < r : v[k] > r) r = v[k];
    }
    return r;
  }
  T acc = v[0];
  for (size_t k = 1; k < v.size(); ++k) acc = op == ReduceOp::kProd ? acc * v[k] : acc + v[k];
  if (op == ReduceOp::kAvg) acc = acc / static_cast<T>(v.size());
  return acc;
}

// Accumulates in 64 bits and wraps once at the end (the same modulo 2^bits).
template <typename T>
T RefIntFold(ReduceOp op, const std::vector<T>& v) {
  using W = std::conditional_t<std::is_signed_v<T>, int64_t, uint64_t>;
  switch (op) {
    case ReduceOp::kSum:
    case ReduceOp::kAvg: {
      uint64_t s = 0;
      for (T x : v) s += static_cast<uint64_t>(static_cast<W>(x));
      const T wrapped = static_cast<T>(s);
      if (op == ReduceOp::kSum) return wrapped;
      return static_cast<T>(static_cast<W>(wrapped) / static_cast<W>(v.size()));
    }
    case ReduceOp::kProd: {
      uint64_t p = 1;
      for (T x : v) p *= static_cast<uint64_t>(static_cast<W>(x));
      return static_cast<T>(p);
    }
    case ReduceOp::kMin: return *std::min_element(v.begin(), v.end());
    case ReduceOp::kMax: return *std::max_element(v.begin(), v.end());
  }
  return 0;
}

template <typename T, typename Fold>
void RefFold(const std::vector<const void*>& in, void* out, size_t count, Fold fold) {
  std::vector<T> column(in.size());
  for (size_t i = 0; i < count; ++i) {
    for (size_t k = 0; k < in.size(); ++k) column[k] = static_cast<const T*>(in[k])[i];
    static_cast<T*>(out)[i] = fold(column);
  }
}

// Converts through a table built from RefToFloat (65536 entries, for speed).
void RefFold16(SmallFloat format, ReduceOp op, const std::vector<const void*>& in, void* out,
               size_t count) {
  static std::vector<float> tables[2];
  std::vector<float>& table = tables[format.mant_bits == 10 ? 0 : 1];
  if (table.empty()) {
    for (uint32_t i = 0; i < 0x10000; ++i) table.push_back(RefToFloat(i, format));
  }
  std::vector<float> column(in.size());
  for (size_t i = 0; i < count; ++i) {
    for (size_t k = 0; k < in.size(); ++k) column[k] = table[static_cast<const uint16_t*>(in[k])[i]];
    static_cast<uint16_t*>(out)[i] = RefFromFloat(RefFloatFold(op, column), format);
  }
}

void RefReduce(DataType dtype, ReduceOp op, const std::vector<const void*>& in, void* out,
               size_t count) {
  const auto f = [op](const auto& v) { return RefFloatFold(op, v); };
  const auto i = [op](const auto& v) { return RefIntFold(op, v); };
  switch (dtype) {
    case DataType::kFloat32: return RefFold<float>(in, out, count, f);
    case DataType::kFloat64: return RefFold<double>(in, out, count, f);
    case DataType::kFloat16: return RefFold16(kBinary16, op, in, out, count);
    case DataType::kBFloat16: return RefFold16(kBFloat16Format, op, in, out, count);
    case DataType::kInt8: return RefFold<int8_t>(in, out, count, i);
    case DataType::kUInt8: return RefFold<uint8_t>(in, out, count, i);
    case DataType::kInt32: return RefFold<int32_t>(in, out, count, i);
    case DataType::kInt64: return RefFold<int64_t>(in, out, count, i);
  }
}

size_t SizeOf(DataType dtype) { return wire::DataTypeSize(static_cast<uint32_t>(dtype)); }

// Equal bits, except that any two NaNs of a floating type are equal (which
// NaN an addition of two NaNs returns depends on the operand order the
// compiler picks; the NaN tests below check NaNs separately).
bool SameElement(DataType dtype, const uint8_t* a, const uint8_t* b) {
  switch (dtype) {
    case DataType::kFloat32: {
      float x, y;
      std::memcpy(&x, a, 4);
      std::memcpy(&y, b, 4);
      if (std::isnan(x) && std::isnan(y)) return true;
      break;
    }
    case DataType::kFloat64: {
      double x, y;
      std::memcpy(&x, a, 8);
      std::memcpy(&y, b, 8);
      if (std::isnan(x) && std::isnan(y)) return true;
      break;
    }
    case DataType::kFloat16:
    case DataType::kBFloat16: {
      uint16_t x, y;
      std::memcpy(&x, a, 2);
      std::memcpy(&y, b, 2);
      const auto is_nan = dtype == DataType::kFloat16 ? IsHalfNaN : IsBf16NaN;
      if (is_nan(x) && is_nan(y)) return true;
      break;
    }
    default:
      break;
  }
  return std::memcmp(a, b, SizeOf(dtype)) == 0;
}

// Random inputs: full-range bits for integers; finite values for floats,
// with exponents wide enough to reach subnormals, overflow and rounding.
class Rng {
 public:
  explicit Rng(uint64_t seed) : state_(seed) {}
  uint64_t Next() {  // splitmix64
    uint64_t z = (state_ += 0x9e3779b97f4a7c15ULL);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
  }

 private:
  uint64_t state_;
};

void FillRandom(DataType dtype, uint8_t* p, size_t count, Rng& rng) {
  for (size_t i = 0; i < count; ++i) {
    const uint64_t r = rng.Next();
    switch (dtype) {
      case DataType::kFloat32: {
        const uint32_t exponent = 127 - 24 + static_cast<uint32_t>((r >> 32) % 49);
        const uint32_t bits = (static_cast<uint32_t>(r) & 0x807fffffu) | (exponent << 23);
        std::memcpy(p + 4 * i, &bits, 4);
        break;
      }
      case DataType::kFloat64: {
        const uint64_t exponent = 1023 - 100 + (r >> 52) % 201;
        const uint64_t bits = (r & 0x800fffffffffffffULL) | (exponent << 52);
        std::memcpy(p + 8 * i, &bits, 8);
        break;
      }
      case DataType::kFloat16: {
        uint16_t bits = static_cast<uint16_t>(r);
        if ((bits & 0x7c00) == 0x7c00) bits &= 0xbfff;  // no Inf/NaN
        std::memcpy(p + 2 * i, &bits, 2);
        break;
      }
      case DataType::kBFloat16: {
        uint16_t bits = static_cast<uint16_t>(r);
        if ((r >> 16) % 8 != 0) {  // mostly exponents near 1, some full range
          const uint16_t exponent = static_cast<uint16_t>(127 - 20 + (r >> 24) % 41);
          bits = static_cast<uint16_t>((bits & 0x807f) | (exponent << 7));
        }
        if ((bits & 0x7f80) == 0x7f80) bits &= 0xbfff;
        std::memcpy(p + 2 * i, &bits, 2);
        break;
      }
      default:
        std::memcpy(p + SizeOf(dtype) * i, &r, SizeOf(dtype));
        break;
    }
  }
}

constexpr int kInputCounts[] = {1, 2, 3, 4, 7};
constexpr size_t kCounts[] = {0, 1, 7, 1000, 4099, size_t{1} << 20};
constexpr int kMaxInputs = 7;
constexpr size_t kMaxCount = size_t{1} << 20;
constexpr size_t kGuard = 16;  // elements after `count` that must stay untouched

class ReduceMatrixTest : public ::testing::TestWithParam<std::tuple<DataType, ReduceOp>> {};

// Every dtype x op, for every number of inputs and count: out of place, in
// place on the first and on the last input, and with inputs at different
// alignments, against the reference bit for bit.
TEST_P(ReduceMatrixTest, MatchesReference) {
  const auto [dtype, op] = GetParam();
  const size_t size = SizeOf(dtype);
  Rng rng(static_cast<uint64_t>(dtype) * 131 + static_cast<uint64_t>(op));
  // Input k starts k % 3 elements into its allocation, so that the inputs
  // and the output are misaligned relative to each other.
  std::vector<std::vector<uint8_t>> pool(kMaxInputs);
  std::vector<const uint8_t*> data(kMaxInputs);
  for (int k = 0; k < kMaxInputs; ++k) {
    pool[k].resize((kMaxCount + 2) * size);
    data[k] = pool[k].data() + (k % 3) * size;
    FillRandom(dtype, pool[k].data(), kMaxCount + 2, rng);
  }
  std::vector<uint8_t> expected((kMaxCount + kGuard) * size);
  std::vector<uint8_t> out((kMaxCount + kGuard) * size);
  std::vector<uint8_t> inplace((kMaxCount + kGuard + 2) * size);

  for (const int n : kInputCounts) {
    for (const size_t count : kCounts) {
      SCOPED_TRACE(testing::Message() << "num_inputs=" << n << " count=" << count);
      std::vector<const void*> in(data.begin(), data.begin() + n);
      RefReduce(dtype, op, in, expected.data(), count);

      const auto check = [&](const uint8_t* got, const char* what) {
        for (size_t i = 0; i < count; ++i) {
          if (!SameElement(dtype, got + i * size, expected.data() + i * size)) {
            FAIL() << what << ": first mismatch at element " << i;
          }
        }
      };

      ForEachIsa isas;
      for (const std::string_view isa : isas.names()) {
        SCOPED_TRACE(testing::Message() << "kernels " << isa);
        ASSERT_TRUE(isas.Use(isa));
        // Out of place, with a guard after the end.
        std::fill(out.begin(), out.end(), 0xa5);
        Reduce(dtype, op, in.data(), n, out.data(), count);
        check(out.data(), "out of place");
        for (size_t i = count * size; i < (count + kGuard) * size; ++i) {
          ASSERT_EQ(out[i], 0xa5) << "wrote past the end";
        }

        // In place on the first input, then on the last (same alignment as
        // the input it replaces).
        for (const int target : {0, n - 1}) {
          const size_t offset = (target % 3) * size;
          std::memcpy(inplace.data() + offset, data[target], count * size);
          std::vector<const void*> aliased = in;
          aliased[target] = inplace.data() + offset;
          Reduce(dtype, op, aliased.data(), n, inplace.data() + offset, count);
          check(inplace.data() + offset,
                target == 0 ? "in place on inputs[0]" : "in place on last");
        }
        if (HasFailure()) return;
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    AllTypesAndOps, ReduceMatrixTest,
    ::testing::Combine(::testing::ValuesIn(kAllTypes), ::testing::ValuesIn(kAllOps)),
    [](const auto& info) {
      return std::string(wire::DataTypeName(static_cast<uint32_t>(std::get<0>(info.param)))) +
             "_" + wire::ReduceOpName(static_cast<uint32_t>(std::get<1>(info.param)));
    });

// The reference's avg step alone (RefFloatFold and RefIntFold divide the
// same way): x / d, rounded once to the type; integers truncate toward zero.
template <typename T>
void RefDivideFloat(const uint8_t* in, uint8_t* out, size_t i, int d) {
  T x;
  std::memcpy(&x, in + sizeof(T) * i, sizeof(T));
  x = x / static_cast<T>(d);
  std::memcpy(out + sizeof(T) * i, &x, sizeof(T));
}

void RefDivide(DataType dtype, const uint8_t* in, uint8_t* out, size_t count, int d) {
  for (size_t i = 0; i < count; ++i) {
    switch (dtype) {
      case DataType::kFloat32: RefDivideFloat<float>(in, out, i, d); break;
      case DataType::kFloat64: RefDivideFloat<double>(in, out, i, d); break;
      case DataType::kFloat16:
      case DataType::kBFloat16: {
        const SmallFloat f = dtype == DataType::kFloat16 ? kBinary16 : kBFloat16Format;
        uint16_t x;
        std::memcpy(&x, in + 2 * i, 2);
        x = RefFromFloat(RefToFloat(x, f) / static_cast<float>(d), f);
        std::memcpy(out + 2 * i, &x, 2);
        break;
      }
      case DataType::kInt8:
      case DataType::kInt32:
      case DataType::kInt64: {
        int64_t x = 0;
        const size_t n = SizeOf(dtype);
        std::memcpy(&x, in + n * i, n);
        if (n < 8) x = (x << (64 - 8 * n)) >> (64 - 8 * n);  // sign-extend
        x /= d;
        std::memcpy(out + n * i, &x, n);
        break;
      }
      case DataType::kUInt8: out[i] = static_cast<uint8_t>(in[i] / d); break;
    }
  }
}

// DivideInPlace (avg's division of a sum made between nodes): every dtype,
// size class and a few divisors, against the reference bit for bit; the
// elements past `count` stay untouched.
TEST(DivideInPlaceTest, MatchesTheReferencesAvgStep) {
  Rng rng(77);
  for (DataType dtype : kAllTypes) {
    const size_t es = SizeOf(dtype);
    for (size_t count : kCounts) {
      for (int d : {1, 2, 3, 7, 1000}) {
        std::vector<uint8_t> in((count + kGuard) * es), got, want((count + kGuard) * es);
        FillRandom(dtype, in.data(), count + kGuard, rng);
        want = in;
        RefDivide(dtype, in.data(), want.data(), count, d);
        ForEachIsa isas;
        for (const std::string_view isa : isas.names()) {
          ASSERT_TRUE(isas.Use(isa));
          got = in;
          DivideInPlace(dtype, got.data(), count, d);
          for (size_t i = 0; i < count + kGuard; ++i) {
            ASSERT_TRUE(SameElement(dtype, got.data() + i * es, want.data() + i * es))
                << wire::DataTypeName(static_cast<uint32_t>(dtype)) << " count " << count
                << " divisor " << d << " element " << i << " kernels " << isa;
          }
        }
      }
    }
  }
}

TEST(DivideInPlaceDeathTest, ADivisorBelowOneStopsTheProcess) {
  float x = 1;
  EXPECT_DEATH(DivideInPlace(DataType::kFloat32, &x, 1, 0), "DivideInPlace by 0");
}

// Inputs at any byte address (a transport hands over fragments where its
// receive buffer has them): every dtype x op, inputs misaligned by 1..7
// bytes, against the reference; the output stays aligned (the contract).
TEST(ReduceAlignmentTest, InputsAtAnyAddress) {
  Rng rng(99);
  for (DataType dtype : kAllTypes) {
    const size_t size = SizeOf(dtype);
    for (ReduceOp op : kAllOps) {
      for (const int n : {1, 2, 3}) {
        for (const size_t count : {size_t{1}, size_t{7}, size_t{4099}}) {
          SCOPED_TRACE(testing::Message() << wire::DataTypeName(static_cast<uint32_t>(dtype))
                                          << " op " << static_cast<int>(op) << " n " << n
                                          << " count " << count);
          // The reference reads aligned copies of the same bytes.
          std::vector<std::vector<uint64_t>> aligned(n);
          std::vector<std::vector<uint8_t>> pool(n);
          std::vector<const void*> in(n), ref_in(n);
          for (int k = 0; k < n; ++k) {
            aligned[k].resize(count + 1);
            FillRandom(dtype, reinterpret_cast<uint8_t*>(aligned[k].data()), count, rng);
            pool[k].resize(count * size + 16);
            uint8_t* at = pool[k].data() + 1 + (k * 3) % 7;  // 1..7 bytes off
            std::memcpy(at, aligned[k].data(), count * size);
            in[k] = at;
            ref_in[k] = aligned[k].data();
          }
          std::vector<uint8_t> expected(count * size), out(count * size);
          RefReduce(dtype, op, ref_in, expected.data(), count);
          ForEachIsa isas;
          for (const std::string_view isa : isas.names()) {
            ASSERT_TRUE(isas.Use(isa));
            Reduce(dtype, op, in.data(), n, out.data(), count);
            for (size_t i = 0; i < count; ++i) {
              ASSERT_TRUE(SameElement(dtype, out.data() + i * size, expected.data() + i * size))
                  << "element " << i << " kernels " << isa;
            }
          }
        }
      }
    }
  }
}

// ---------------------------------------------------------------------------
// Semantics pinned by hand.

// Reduces columns: inputs[k][i] = columns[i][k]. Returns out.
template <typename T>
std::vector<T> ReduceColumns(DataType dtype, ReduceOp op,
                             const std::vector<std::vector<T>>& columns) {
  const size_t n = columns[0].size();
  std::vector<std::vector<T>> rows(n, std::vector<T>(columns.size()));
  for (size_t i = 0; i < columns.size(); ++i) {
    for (size_t k = 0; k < n; ++k) rows[k][i] = columns[i][k];
  }
  std::vector<const void*> in;
  for (const auto& row : rows) in.push_back(row.data());
  // Every build must give these bits; the baseline's are returned.
  std::vector<T> out(columns.size());
  ForEachIsa isas;
  for (const std::string_view isa : isas.names()) {
    if (!isas.Use(isa)) break;
    std::vector<T> got(columns.size());
    Reduce(dtype, op, in.data(), static_cast<int>(n), got.data(), got.size());
    if (isa == "baseline") {
      out = got;
      continue;
    }
    for (size_t i = 0; i < out.size(); ++i) {
      EXPECT_TRUE(SameElement(dtype, reinterpret_cast<const uint8_t*>(&got[i]),
                              reinterpret_cast<const uint8_t*>(&out[i])))
          << "kernels " << isa << " differ from baseline at element " << i;
    }
  }
  return out;
}

// The same column repeated, so that vector bodies and scalar tails both see it.
template <typename T>
T ReduceOne(DataType dtype, ReduceOp op, const std::vector<T>& column) {
  const std::vector<T> out = ReduceColumns(dtype, op, std::vector<std::vector<T>>(37, column));
  for (size_t i = 1; i < out.size(); ++i) {
    EXPECT_TRUE(SameElement(dtype, reinterpret_cast<const uint8_t*>(&out[i]),
                            reinterpret_cast<const uint8_t*>(&out[0])))
        << "element " << i;
  }
  return out[0];
}

TEST(ReduceSemanticsTest, Float32FoldsLeftToRight) {
  EXPECT_EQ(ReduceOne<float>(DataType::kFloat32, ReduceOp::kSum, {1e8f, 1, -1e8f}), 0.0f);
  EXPECT_EQ(ReduceOne<float>(DataType::kFloat32, ReduceOp::kSum, {1e8f, -1e8f, 1}), 1.0f);
  EXPECT_EQ(ReduceOne<float>(DataType::kFloat32, ReduceOp::kSum, {1, 1e8f, -1e8f}), 0.0f);
  EXPECT_EQ(ReduceOne<float>(DataType::kFloat32, ReduceOp::kAvg, {1e8f, 1, -1e8f, 1}), 0.25f);
  EXPECT_EQ(ReduceOne<float>(DataType::kFloat32, ReduceOp::kAvg, {1, 2}), 1.5f);
  EXPECT_EQ(ReduceOne<float>(DataType::kFloat32, ReduceOp::kProd, {1e30f, 1e30f, 1e-30f}),
            std::numeric_limits<float>::infinity());
  EXPECT_EQ(ReduceOne<double>(DataType::kFloat64, ReduceOp::kSum, {1e17, 1, -1e17}), 0.0);
  EXPECT_EQ(ReduceOne<double>(DataType::kFloat64, ReduceOp::kSum, {1e17, -1e17, 1}), 1.0);
  EXPECT_EQ(ReduceOne<double>(DataType::kFloat64, ReduceOp::kAvg, {1, 2, 4}), 7.0 / 3);
  EXPECT_EQ(ReduceOne<float>(DataType::kFloat32, ReduceOp::kAvg, {1, 2, 4}), 7.0f / 3);
}

TEST(ReduceSemanticsTest, SixteenBitAccumulatesInFloatAndRoundsOnce) {
  const auto h = [](float f) { return FloatToHalf(f); };
  const auto b = [](float f) { return FloatToBFloat16(f); };
  // Step by step in half, 2048 + 1 would round back to 2048 each time.
  EXPECT_EQ(ReduceOne<uint16_t>(DataType::kFloat16, ReduceOp::kSum, {h(2048), h(1), h(1)}),
            h(2050));
  EXPECT_EQ(ReduceOne<uint16_t>(DataType::kBFloat16, ReduceOp::kSum, {b(256), b(1), b(1)}),
            b(258));
  // avg: the float sum divided, then rounded: 5/3 rounded once.
  EXPECT_EQ(ReduceOne<uint16_t>(DataType::kFloat16, ReduceOp::kAvg, {h(1), h(2), h(2)}),
            h(5.0f / 3));
  EXPECT_EQ(ReduceOne<uint16_t>(DataType::kBFloat16, ReduceOp::kAvg, {b(1), b(2), b(2)}),
            b(5.0f / 3));
  // Ties to even: (1 + (1 + 2^-10)) / 2 = 1 + 2^-11 lies halfway between
  // 0x3c00 (even) and 0x3c01.
  EXPECT_EQ(ReduceOne<uint16_t>(DataType::kFloat16, ReduceOp::kAvg, {0x3c00, 0x3c01}), 0x3c00);
  EXPECT_EQ(ReduceOne<uint16_t>(DataType::kFloat16, ReduceOp::kAvg, {0x3c01, 0x3c02}), 0x3c02);
  EXPECT_EQ(ReduceOne<uint16_t>(DataType::kBFloat16, ReduceOp::kAvg, {0x3f80, 0x3f81}), 0x3f80);
  EXPECT_EQ(ReduceOne<uint16_t>(DataType::kBFloat16, ReduceOp::kAvg, {0x3f81, 0x3f82}), 0x3f82);
  // Overflow to Inf.
  EXPECT_EQ(ReduceOne<uint16_t>(DataType::kFloat16, ReduceOp::kSum, {0x7bff, 0x7bff}), 0x7c00);
  EXPECT_EQ(ReduceOne<uint16_t>(DataType::kFloat16, ReduceOp::kSum, {0xfbff, 0xfbff}), 0xfc00);
  EXPECT_EQ(ReduceOne<uint16_t>(DataType::kFloat16, ReduceOp::kProd, {h(300), h(300)}), 0x7c00);
  EXPECT_EQ(ReduceOne<uint16_t>(DataType::kBFloat16, ReduceOp::kSum, {0x7f7f, 0x7f7f}), 0x7f80);
  // ... but not when the float sum comes back in range.
  EXPECT_EQ(ReduceOne<uint16_t>(DataType::kFloat16, ReduceOp::kSum, {0x7bff, 0x7bff, 0xfbff}),
            0x7bff);
  EXPECT_EQ(ReduceOne<uint16_t>(DataType::kFloat16, ReduceOp::kAvg, {0x7bff, 0x7bff}), 0x7bff);
  // Subnormals.
  EXPECT_EQ(ReduceOne<uint16_t>(DataType::kFloat16, ReduceOp::kSum, {0x0001, 0x0001}), 0x0002);
  EXPECT_EQ(ReduceOne<uint16_t>(DataType::kFloat16, ReduceOp::kSum, {0x03ff, 0x0001}), 0x0400);
  EXPECT_EQ(ReduceOne<uint16_t>(DataType::kFloat16, ReduceOp::kAvg, {0x0001, 0x0000}), 0x0000);
  EXPECT_EQ(ReduceOne<uint16_t>(DataType::kFloat16, ReduceOp::kAvg, {0x0003, 0x0000}), 0x0002);
  EXPECT_EQ(ReduceOne<uint16_t>(DataType::kFloat16, ReduceOp::kProd, {0x0400, h(0.5f)}), 0x0200);
  EXPECT_EQ(ReduceOne<uint16_t>(DataType::kFloat16, ReduceOp::kMin, {0x0001, 0x8001}), 0x8001);
  EXPECT_EQ(ReduceOne<uint16_t>(DataType::kBFloat16, ReduceOp::kSum, {0x0001, 0x0001}), 0x0002);
  EXPECT_EQ(ReduceOne<uint16_t>(DataType::kBFloat16, ReduceOp::kAvg, {0x0001, 0x0000}), 0x0000);
}

TEST(ReduceSemanticsTest, FloatNaNPropagatesThroughEveryOp) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float inf = std::numeric_limits<float>::infinity();
  for (const ReduceOp op : kAllOps) {
    SCOPED_TRACE(wire::ReduceOpName(static_cast<uint32_t>(op)));
    for (const std::vector<float>& column :
         {std::vector<float>{nan, 1, -inf}, {1, nan, -inf}, {-inf, inf, nan}, {nan, nan, 0},
          {nan}, {-5, nan}, {5, nan}}) {
      EXPECT_TRUE(std::isnan(ReduceOne<float>(DataType::kFloat32, op, column)));
      std::vector<double> d(column.begin(), column.end());
      EXPECT_TRUE(std::isnan(ReduceOne<double>(DataType::kFloat64, op, d)));
      std::vector<uint16_t> h, b;
      for (float f : column) {
        h.push_back(FloatToHalf(f));
        b.push_back(FloatToBFloat16(f));
      }
      const uint16_t hr = ReduceOne<uint16_t>(DataType::kFloat16, op, h);
      EXPECT_TRUE(IsHalfNaN(hr)) << std::hex << hr;
      const uint16_t br = ReduceOne<uint16_t>(DataType::kBFloat16, op, b);
      EXPECT_TRUE(IsBf16NaN(br)) << std::hex << br;
    }
  }
  // A signalling NaN comes out quiet where the value is computed.
  const uint16_t snan = 0x7c01;
  EXPECT_EQ(ReduceOne<uint16_t>(DataType::kFloat16, ReduceOp::kMax, {snan, 0x3c00}) & 0x0200,
            0x0200);
  EXPECT_EQ(ReduceOne<uint16_t>(DataType::kFloat16, ReduceOp::kAvg, {snan}) & 0x0200, 0x0200);
}

TEST(ReduceSemanticsTest, FloatInfinities) {
  const float inf = std::numeric_limits<float>::infinity();
  EXPECT_EQ(ReduceOne<float>(DataType::kFloat32, ReduceOp::kSum, {inf, 1, 2}), inf);
  EXPECT_TRUE(std::isnan(ReduceOne<float>(DataType::kFloat32, ReduceOp::kSum, {inf, -inf})));
  EXPECT_TRUE(std::isnan(ReduceOne<float>(DataType::kFloat32, ReduceOp::kProd, {0, inf})));
  EXPECT_EQ(ReduceOne<float>(DataType::kFloat32, ReduceOp::kProd, {-2, inf}), -inf);
  EXPECT_EQ(ReduceOne<float>(DataType::kFloat32, ReduceOp::kMin, {1, -inf, 3}), -inf);
  EXPECT_EQ(ReduceOne<float>(DataType::kFloat32, ReduceOp::kMax, {1, inf, 3}), inf);
  EXPECT_EQ(ReduceOne<float>(DataType::kFloat32, ReduceOp::kAvg, {inf, 1}), inf);
  EXPECT_EQ(ReduceOne<uint16_t>(DataType::kFloat16, ReduceOp::kMax, {0xfc00, 0x7c00}), 0x7c00);
  EXPECT_EQ(ReduceOne<uint16_t>(DataType::kFloat16, ReduceOp::kMin, {0xfc00, 0x7c00}), 0xfc00);
}

TEST(ReduceSemanticsTest, MinMaxTiesKeepTheEarlierInput) {
  EXPECT_TRUE(std::signbit(ReduceOne<float>(DataType::kFloat32, ReduceOp::kMin, {-0.0f, 0.0f})));
  EXPECT_FALSE(std::signbit(ReduceOne<float>(DataType::kFloat32, ReduceOp::kMin, {0.0f, -0.0f})));
  EXPECT_TRUE(std::signbit(ReduceOne<float>(DataType::kFloat32, ReduceOp::kMax, {-0.0f, 0.0f})));
  EXPECT_EQ(ReduceOne<float>(DataType::kFloat32, ReduceOp::kMin, {3, -1, 2, -7, 5}), -7.0f);
  EXPECT_EQ(ReduceOne<float>(DataType::kFloat32, ReduceOp::kMax, {3, -1, 2, -7, 5}), 5.0f);
}

TEST(ReduceSemanticsTest, IntegersWrap) {
  EXPECT_EQ(ReduceOne<int8_t>(DataType::kInt8, ReduceOp::kSum, {100, 100}), -56);
  EXPECT_EQ(ReduceOne<int8_t>(DataType::kInt8, ReduceOp::kSum, {-128, -1}), 127);
  EXPECT_EQ(ReduceOne<uint8_t>(DataType::kUInt8, ReduceOp::kSum, {200, 100}), 44);
  EXPECT_EQ(ReduceOne<int32_t>(DataType::kInt32, ReduceOp::kSum,
                               {std::numeric_limits<int32_t>::max(), 1}),
            std::numeric_limits<int32_t>::min());
  EXPECT_EQ(ReduceOne<int64_t>(DataType::kInt64, ReduceOp::kSum,
                               {std::numeric_limits<int64_t>::max(), 1, 1}),
            std::numeric_limits<int64_t>::min() + 1);
  EXPECT_EQ(ReduceOne<int8_t>(DataType::kInt8, ReduceOp::kProd, {16, 16}), 0);
  EXPECT_EQ(ReduceOne<int8_t>(DataType::kInt8, ReduceOp::kProd, {-128, -1}), -128);
  EXPECT_EQ(ReduceOne<int8_t>(DataType::kInt8, ReduceOp::kProd, {3, 50, 3}), -62);  // 450
  EXPECT_EQ(ReduceOne<uint8_t>(DataType::kUInt8, ReduceOp::kProd, {255, 255}), 1);
  EXPECT_EQ(ReduceOne<int32_t>(DataType::kInt32, ReduceOp::kProd, {65536, 65536}), 0);
  EXPECT_EQ(ReduceOne<int32_t>(DataType::kInt32, ReduceOp::kProd, {65537, 65537}), 131073);
  EXPECT_EQ(ReduceOne<int64_t>(DataType::kInt64, ReduceOp::kProd, {int64_t{1} << 32, int64_t{1} << 32}),
            0);
  EXPECT_EQ(ReduceOne<int64_t>(DataType::kInt64, ReduceOp::kProd,
                               {std::numeric_limits<int64_t>::min(), -1}),
            std::numeric_limits<int64_t>::min());
  EXPECT_EQ(ReduceOne<int8_t>(DataType::kInt8, ReduceOp::kMin, {5, -128, 127}), -128);
  EXPECT_EQ(ReduceOne<uint8_t>(DataType::kUInt8, ReduceOp::kMax, {5, 255, 127}), 255);
  EXPECT_EQ(ReduceOne<int64_t>(DataType::kInt64, ReduceOp::kMin, {5, -(int64_t{1} << 40), 7}),
            -(int64_t{1} << 40));
  EXPECT_EQ(ReduceOne<int64_t>(DataType::kInt64, ReduceOp::kMax, {5, int64_t{1} << 40, 7}),
            int64_t{1} << 40);
}

TEST(ReduceSemanticsTest, IntegerAvgTruncatesTheWrappedSumTowardZero) {
  EXPECT_EQ(ReduceOne<int8_t>(DataType::kInt8, ReduceOp::kAvg, {-3, 0}), -1);  // not -2
  EXPECT_EQ(ReduceOne<int8_t>(DataType::kInt8, ReduceOp::kAvg, {-3, 1, 0}), 0);
  EXPECT_EQ(ReduceOne<int8_t>(DataType::kInt8, ReduceOp::kAvg, {-7, 0, 0}), -2);
  EXPECT_EQ(ReduceOne<int8_t>(DataType::kInt8, ReduceOp::kAvg, {100, 100, 100}), 14);  // 44 / 3
  EXPECT_EQ(ReduceOne<int8_t>(DataType::kInt8, ReduceOp::kAvg, {-100, -100, -100}), -14);
  EXPECT_EQ(ReduceOne<int8_t>(DataType::kInt8, ReduceOp::kAvg, {100, 100}), -28);  // -56 / 2
  EXPECT_EQ(ReduceOne<uint8_t>(DataType::kUInt8, ReduceOp::kAvg, {200, 100}), 22);
  EXPECT_EQ(ReduceOne<uint8_t>(DataType::kUInt8, ReduceOp::kAvg, {255, 254, 1}), 84);  // 254/3
  EXPECT_EQ(ReduceOne<int32_t>(DataType::kInt32, ReduceOp::kAvg, {-7, 0, 0, 0}), -1);
  EXPECT_EQ(ReduceOne<int32_t>(DataType::kInt32, ReduceOp::kAvg, {-7, 0}), -3);
  EXPECT_EQ(ReduceOne<int32_t>(DataType::kInt32, ReduceOp::kAvg,
                               {std::numeric_limits<int32_t>::min(), 0, 0, 0, 0, 0, 1}),
            -306783378);  // (-2^31 + 1) / 7
  EXPECT_EQ(ReduceOne<int32_t>(DataType::kInt32, ReduceOp::kAvg,
                               {std::numeric_limits<int32_t>::max(), 1, 0}),
            -715827882);  // INT32_MIN / 3 after wrapping
  EXPECT_EQ(ReduceOne<int64_t>(DataType::kInt64, ReduceOp::kAvg, {-7, 0, 0}), -2);
  EXPECT_EQ(ReduceOne<int64_t>(DataType::kInt64, ReduceOp::kAvg, {-7, 0}), -3);
  EXPECT_EQ(ReduceOne<int64_t>(DataType::kInt64, ReduceOp::kAvg,
                               {std::numeric_limits<int64_t>::max(), 1, 0}),
            std::numeric_limits<int64_t>::min() / 3);
  EXPECT_EQ(ReduceOne<int32_t>(DataType::kInt32, ReduceOp::kAvg, {-5}), -5);
}

TEST(ReduceSemanticsTest, InputsMayAliasEachOtherAndTheOutput) {
  std::vector<float> a(5000);
  for (size_t i = 0; i < a.size(); ++i) a[i] = static_cast<float>(i);
  const void* in[] = {a.data(), a.data(), a.data()};
  Reduce(DataType::kFloat32, ReduceOp::kSum, in, 3, a.data(), a.size());
  for (size_t i = 0; i < a.size(); ++i) ASSERT_EQ(a[i], 3.0f * i) << i;
  Reduce(DataType::kFloat32, ReduceOp::kSum, in, 2, a.data(), a.size());
  for (size_t i = 0; i < a.size(); ++i) ASSERT_EQ(a[i], 6.0f * i) << i;
}

TEST(ReduceSemanticsTest, ZeroCountTouchesNothing) {
  const void* in[] = {nullptr, nullptr, nullptr};
  for (DataType dtype : kAllTypes) {
    for (ReduceOp op : kAllOps) {
      for (int n : kInputCounts) Reduce(dtype, op, in, std::min(n, 3), nullptr, 0);
    }
  }
}


// ---------------------------------------------------------------------------
// Choosing the kernels' instruction set.

TEST(IsaTest, BaselineAlwaysAndTheActiveBuildIsSupported) {
  const std::vector<std::string_view> isas = SupportedIsas();
  ASSERT_FALSE(isas.empty());
  EXPECT_EQ(isas.front(), "baseline");
  EXPECT_NE(std::find(isas.begin(), isas.end(), ActiveIsa()), isas.end()) << ActiveIsa();
}

TEST(IsaTest, SetIsaRefusesUnknownNamesAndKeepsTheBuild) {
  const std::string before(ActiveIsa());
  const absl::Status s = SetIsa("sse9");
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("sse9"), std::string_view::npos) << s;
  EXPECT_EQ(ActiveIsa(), before);
}

// CIUIC_REDUCE_ISA, read once per process: ctest runs this test again with
// it set to each build and to a bad name (proto/reduce/CMakeLists.txt).
// Unset, the widest build runs; set to a build this CPU has, that one;
// otherwise the widest, with a note naming the variable and the value.
TEST(IsaTest, FollowsTheEnvironment) {
  const std::vector<std::string_view> isas = SupportedIsas();
  const char* env = std::getenv("CIUIC_REDUCE_ISA");
  if (env == nullptr || env[0] == '\0') {
    EXPECT_EQ(ActiveIsa(), isas.back());
    EXPECT_EQ(IsaNote(), "");
    return;
  }
  if (std::find(isas.begin(), isas.end(), std::string_view(env)) != isas.end()) {
    EXPECT_EQ(ActiveIsa(), env);
    EXPECT_EQ(IsaNote(), "");
    return;
  }
  EXPECT_EQ(ActiveIsa(), isas.back());
  EXPECT_NE(IsaNote().find(std::string("CIUIC_REDUCE_ISA=") + env), std::string::npos)
      << IsaNote();
}

}  // namespace
}  // namespace ciuic::reduce
