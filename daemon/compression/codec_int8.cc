// Codec "int8": block-wise scaled quantisation.
//
// The elements are cut into blocks of kBlock = 256 (the last block may be
// shorter). Each block travels as a float32 header followed by its payload:
//   * header = scale s, finite and >= 0: n int8 values q, decoded as q * s.
//     s = max|x| / 127 (rounded to float) and q = x / s rounded to nearest
//     (ties to even), so |x - q*s| <= s/2 = max|x|/254, plus float rounding
//     (a relative 2^-22 of that bound). 4 + n bytes.
//   * header = +Inf: the n elements raw, in the input dtype (4 + n * size
//     bytes). Used for a block holding a NaN or an Inf, so that they reach
//     the receiver unchanged (the rest of such a block is exact too), and for
//     a block whose max|x| lies outside [2^-100, 2^126] (the scale or its
//     inverse would leave float's normal range). An all-zero block is
//     quantised (s = 0).
//   * any other header (NaN, negative, -Inf) is malformed input.
// float32, float64, float16 and bfloat16 are accepted; the arithmetic is done
// in float (double for float64) and a 16-bit result is rounded once more to
// its format (adding half an ulp of it to the bound).
//
// MaxEncodedBytes is the all-raw size, 4 * ceil(n/256) + n * size: more than
// the input, which only a chunk full of NaN/Inf needs.
#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "absl/strings/str_cat.h"
#include "compression/codec_internal.h"

namespace ciuic::daemon {
namespace codec_internal {
namespace {

constexpr size_t kBlock = 256;
constexpr size_t kHeader = sizeof(float);
constexpr float kRawBlock = std::numeric_limits<float>::infinity();
// A block is quantised when max|x| is 0 or in [kMinQuantized, kMaxQuantized].
constexpr double kMinQuantized = 0x1p-100;
constexpr double kMaxQuantized = 0x1p126;

// Rounds to nearest, ties to even, for |y| <= 2^22 (2^51 for double): adding
// 1.5 * 2^mantissa_bits pushes the fraction out of the sum, which the FPU
// rounds in the default mode; subtracting it again is exact. (std::nearbyint
// is not vectorised with baseline SSE2; this is.)
inline float RoundToInt(float y) { return (y + 0x1.8p23f) - 0x1.8p23f; }
inline double RoundToInt(double y) { return (y + 0x1.8p52) - 0x1.8p52; }

template <typename F>
typename F::Acc MaxAbs(const typename F::Storage* x, size_t n) {
  using Bits = typename F::AbsBits;
  Bits m = 0;
  for (size_t j = 0; j < n; ++j) {
    const Bits b = static_cast<Bits>(std::bit_cast<Bits>(x[j]) & F::kAbsMask);
    m = b > m ? b : m;
  }
  // Integer order of the magnitude bits is numeric order (NaN the largest).
  return F::Load(std::bit_cast<typename F::Storage>(m));
}

template <typename F>
void Quantize(const typename F::Storage* x, size_t n, typename F::Acc inv, signed char* q) {
  // |x| <= max|x| and inv ~ 127 / max|x| give |y| <= 127 * (1 + 3 * 2^-24)
  // < 127.5, so the rounded value is already within [-127, 127]; the integer
  // clamp only guards that reasoning (a float clamp written with ?: becomes
  // a branch and stops the vectoriser, see reduce/half.h).
  for (size_t j = 0; j < n; ++j) {
    int32_t v = static_cast<int32_t>(RoundToInt(F::Load(x[j]) * inv));
    v = v < -127 ? -127 : v;
    v = v > 127 ? 127 : v;
    q[j] = static_cast<signed char>(v);
  }
}

template <typename F>
void Dequantize(const signed char* q, size_t n, float scale, typename F::Storage* out) {
  using A = typename F::Acc;
  const A s = scale;
  for (size_t j = 0; j < n; ++j) out[j] = F::Store(static_cast<A>(q[j]) * s);
}

template <typename F>
void DequantizeAdd(const signed char* q, size_t n, float scale, typename F::Storage* acc) {
  using A = typename F::Acc;
  const A s = scale;
  // Store then Load rounds the decoded value to the element format first,
  // exactly as Decode followed by a reduction would (a no-op for float32/64).
  for (size_t j = 0; j < n; ++j) {
    acc[j] = F::Store(F::Load(acc[j]) + F::Load(F::Store(static_cast<A>(q[j]) * s)));
  }
}

template <typename F>
size_t EncodeAll(const typename F::Storage* in, size_t count, unsigned char* out) {
  using A = typename F::Acc;
  unsigned char* p = out;
  for (size_t base = 0; base < count; base += kBlock) {
    const size_t n = std::min(kBlock, count - base);
    const typename F::Storage* x = in + base;
    const A amax = MaxAbs<F>(x, n);
    if (amax == A(0) || (amax >= A(kMinQuantized) && amax <= A(kMaxQuantized))) {
      const float scale = static_cast<float>(amax / A(127));
      const A inv = scale > 0 ? A(1) / static_cast<A>(scale) : A(0);
      StoreAt<float>(p, scale);
      Quantize<F>(x, n, inv, reinterpret_cast<signed char*>(p + kHeader));
      p += kHeader + n;
    } else {  // NaN, Inf, or out of the quantisable range: raw
      StoreAt<float>(p, kRawBlock);
      std::memcpy(p + kHeader, x, n * sizeof(*x));
      p += kHeader + n * sizeof(*x);
    }
  }
  return static_cast<size_t>(p - out);
}

// Walks the block headers of untrusted input without touching the output.
template <typename F>
absl::Status ValidateBlocks(const unsigned char* in, size_t bytes, size_t count) {
  size_t pos = 0;
  for (size_t base = 0; base < count; base += kBlock) {
    const size_t n = std::min(kBlock, count - base);
    if (bytes - pos < kHeader) {
      return absl::InvalidArgumentError(absl::StrCat("codec int8: truncated at block ",
                                                     base / kBlock, " (", bytes, " bytes for ",
                                                     count, " elements)"));
    }
    const float scale = LoadAt<float>(in + pos);
    size_t payload;
    if (scale == kRawBlock) {
      payload = n * sizeof(typename F::Storage);
    } else if (scale >= 0 && scale <= FLT_MAX) {
      payload = n;
    } else {
      return absl::InvalidArgumentError(
          absl::StrCat("codec int8: block ", base / kBlock, " has invalid scale ", scale));
    }
    pos += kHeader;
    if (bytes - pos < payload) {
      return absl::InvalidArgumentError(absl::StrCat("codec int8: truncated in block ",
                                                     base / kBlock, " (", bytes, " bytes for ",
                                                     count, " elements)"));
    }
    pos += payload;
  }
  if (pos != bytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("codec int8: ", bytes - pos, " trailing bytes after ", count, " elements"));
  }
  return absl::OkStatus();
}

// Decodes validated input: into `out` (kAdd false) or added into it.
template <typename F, bool kAdd>
void DecodeAll(const unsigned char* in, size_t count, typename F::Storage* out) {
  const unsigned char* p = in;
  for (size_t base = 0; base < count; base += kBlock) {
    const size_t n = std::min(kBlock, count - base);
    const float scale = LoadAt<float>(p);
    p += kHeader;
    if (scale == kRawBlock) {
      if constexpr (kAdd) {
        AddRaw(F::kType, p, n, out + base);
      } else {
        std::memcpy(out + base, p, n * sizeof(*out));
      }
      p += n * sizeof(*out);
    } else {
      const auto* q = reinterpret_cast<const signed char*>(p);
      if constexpr (kAdd) {
        DequantizeAdd<F>(q, n, scale, out + base);
      } else {
        Dequantize<F>(q, n, scale, out + base);
      }
      p += n;
    }
  }
}

constexpr const char* kSupported = "float32, float64, float16, bfloat16";

class Int8Codec final : public Codec {
 public:
  absl::Status Supports(wire::DataType dtype) const override {
    const bool ok = VisitFloat(dtype, false, [](auto) { return true; });
    return ok ? absl::OkStatus() : Unsupported("int8", dtype, kSupported);
  }

  size_t MaxEncodedBytes(wire::DataType dtype, size_t count) const override {
    const size_t size =
        VisitFloat(dtype, size_t{0}, [](auto f) { return sizeof(typename decltype(f)::Storage); });
    if (size == 0) return 0;
    return (count + kBlock - 1) / kBlock * kHeader + count * size;
  }

  size_t SplitGranule() const override { return kBlock; }

  size_t TypicalEncodedBytes(wire::DataType dtype, size_t count) const override {
    if (MaxEncodedBytes(dtype, count) == 0) return 0;
    return (count + kBlock - 1) / kBlock * kHeader + count;  // every block quantised
  }

  size_t Encode(wire::DataType dtype, const void* in, size_t count, void* out) const override {
    constexpr size_t kBad = SIZE_MAX;
    const size_t bytes = VisitFloat(dtype, kBad, [&](auto f) {
      using F = decltype(f);
      return EncodeAll<F>(static_cast<const typename F::Storage*>(in), count,
                          static_cast<unsigned char*>(out));
    });
    if (bytes == kBad) BrokenInvariant("int8", "Encode of an unsupported dtype");
    return bytes;
  }

  absl::Status Validate(wire::DataType dtype, const void* in, size_t bytes,
                        size_t count) const override {
    if (absl::Status s = Supports(dtype); !s.ok()) return s;
    return VisitFloat(dtype, absl::OkStatus(), [&](auto f) {
      return ValidateBlocks<decltype(f)>(static_cast<const unsigned char*>(in), bytes, count);
    });
  }

  absl::Status Decode(wire::DataType dtype, const void* in, size_t bytes, size_t count,
                      void* out) const override {
    return DecodeImpl<false>(dtype, in, bytes, count, out);
  }

  absl::Status DecodeAdd(wire::DataType dtype, const void* in, size_t bytes, size_t count,
                         void* acc) const override {
    return DecodeImpl<true>(dtype, in, bytes, count, acc);
  }

 private:
  template <bool kAdd>
  absl::Status DecodeImpl(wire::DataType dtype, const void* in, size_t bytes, size_t count,
                          void* out) const {
    if (absl::Status s = Supports(dtype); !s.ok()) return s;
    return VisitFloat(dtype, absl::OkStatus(), [&](auto f) {
      using F = decltype(f);
      const auto* p = static_cast<const unsigned char*>(in);
      if (absl::Status s = ValidateBlocks<F>(p, bytes, count); !s.ok()) return s;
      DecodeAll<F, kAdd>(p, count, static_cast<typename F::Storage*>(out));
      return absl::OkStatus();
    });
  }
};

}  // namespace

std::unique_ptr<Codec> MakeInt8Codec() { return std::make_unique<Int8Codec>(); }

}  // namespace codec_internal
}  // namespace ciuic::daemon
