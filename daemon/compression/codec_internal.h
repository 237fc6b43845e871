// Pieces shared by the codec implementations (codec_*.cc); not part of the
// area's interface. Everything here is stateless and callable from any thread.
#pragma once

#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <type_traits>

#include "absl/strings/string_view.h"
#include "compression/codec.h"
#include "reduce/half.h"

namespace ciuic::daemon {
namespace codec_internal {

static_assert(std::endian::native == std::endian::little,
              "the codec wire formats are written in host order, which must be little endian");

// The floating-point element formats the lossy codecs accept. Storage is the
// element as it sits in memory, Acc the type arithmetic is done in, AbsBits
// an unsigned integer of Storage's width: for |x| (the bits without the sign)
// integer order is magnitude order, with Inf above every finite value and
// NaN above Inf.
struct F32 {
  using Storage = float;
  using Acc = float;
  using AbsBits = uint32_t;
  static constexpr AbsBits kAbsMask = 0x7fffffffu;
  static constexpr wire::DataType kType = wire::DataType::kFloat32;
  static Acc Load(float x) { return x; }
  static float Store(Acc a) { return a; }
};

struct F64 {
  using Storage = double;
  using Acc = double;
  using AbsBits = uint64_t;
  static constexpr AbsBits kAbsMask = 0x7fffffffffffffffull;
  static constexpr wire::DataType kType = wire::DataType::kFloat64;
  static Acc Load(double x) { return x; }
  static double Store(Acc a) { return a; }
};

struct F16 {
  using Storage = uint16_t;
  using Acc = float;
  using AbsBits = uint16_t;
  static constexpr AbsBits kAbsMask = 0x7fff;
  static constexpr wire::DataType kType = wire::DataType::kFloat16;
  static Acc Load(uint16_t x) { return HalfToFloat(x); }
  static uint16_t Store(Acc a) { return FloatToHalf(a); }
};

struct BF16 {
  using Storage = uint16_t;
  using Acc = float;
  using AbsBits = uint16_t;
  static constexpr AbsBits kAbsMask = 0x7fff;
  static constexpr wire::DataType kType = wire::DataType::kBFloat16;
  static Acc Load(uint16_t x) { return BFloat16ToFloat(x); }
  static uint16_t Store(Acc a) { return FloatToBFloat16(a); }
};

// Calls fn(F{}) with the format of a floating dtype and returns its result,
// or returns `otherwise` for any other dtype.
template <typename R, typename Fn>
R VisitFloat(wire::DataType dtype, R otherwise, Fn&& fn) {
  switch (dtype) {
    case wire::DataType::kFloat32:
      return fn(F32{});
    case wire::DataType::kFloat64:
      return fn(F64{});
    case wire::DataType::kFloat16:
      return fn(F16{});
    case wire::DataType::kBFloat16:
      return fn(BF16{});
    default:
      return otherwise;
  }
}

// Loads and stores at any alignment (the encoded bytes have none); GCC turns
// these into plain (unaligned) moves and vectorises loops using them.
template <typename T>
inline T LoadAt(const unsigned char* p) {
  T v;
  std::memcpy(&v, p, sizeof(T));
  return v;
}
template <typename T>
inline void StoreAt(unsigned char* p, T v) {
  std::memcpy(p, &v, sizeof(T));
}

// acc[i] = acc[i] + in[i] for `count` elements of `dtype`, with Reduce's sum
// semantics; `in` may have any alignment (it is staged through an aligned
// stack buffer when it is not aligned for dtype). Used for data that travels
// uncompressed (codec none, the pass-through dtypes, raw int8 blocks).
void AddRaw(wire::DataType dtype, const void* in, size_t count, void* acc);

// "codec fp16: dtype int8 is not supported (supported: float32, float16)".
absl::Status Unsupported(absl::string_view codec, wire::DataType dtype,
                         absl::string_view supported);

// Stops the process: a caller broke a documented precondition.
[[noreturn]] void BrokenInvariant(absl::string_view codec, absl::string_view what);

// The registry (codec.cc) builds codecs through these, one per codec_*.cc.
std::unique_ptr<Codec> MakeNoneCodec();
std::unique_ptr<Codec> MakeFp16Codec();
std::unique_ptr<Codec> MakeBf16Codec();
std::unique_ptr<Codec> MakeInt8Codec();
std::unique_ptr<Codec> MakeTopKCodec(double ratio);

}  // namespace codec_internal
}  // namespace ciuic::daemon
