// Conversions between float and the two 16-bit floating-point formats that
// trainers send: IEEE 754 binary16 ("half", float16) and bfloat16.
//
// The reduction kernels (reduce.cc) widen 16-bit elements to float, combine
// them in float and narrow once at the end, so these functions sit in the
// daemon's hot loop. They are plain bit manipulation without branches (every
// special case is a select), so that GCC vectorises loops calling them with
// baseline SSE2; no -march flag or F16C is needed. They are constexpr and
// callable from any thread.
//
// Contract, for both formats:
//   * float -> 16 bits rounds to nearest, ties to even; values beyond the
//     largest finite 16-bit value (after rounding) become +-Inf.
//   * Subnormals are converted exactly in both directions (float subnormals
//     are far below the binary16 range and round to +-0 there; bfloat16 has
//     float's exponent range, and its subnormals round like normals).
//   * Inf stays Inf with its sign. NaN stays NaN, with its sign, and always
//     comes out quiet; the top payload bits that fit are kept.
// The only floating-point operations used (an exact int -> float conversion
// and one float addition that rounds to nearest even) assume the default
// rounding mode, which the daemon never changes. Results do not depend on
// flush-to-zero / denormals-are-zero.
#pragma once

#include <bit>
#include <cstdint>

namespace ciuic::daemon {
namespace half_internal {

// c ? a : b, computed without a branch.
constexpr uint32_t Select(bool c, uint32_t a, uint32_t b) {
  const uint32_t mask = 0u - static_cast<uint32_t>(c);
  return (a & mask) | (b & ~mask);
}

}  // namespace half_internal

// binary16 -> float. Exact; a NaN comes out as a quiet float NaN.
constexpr float HalfToFloat(uint16_t h) {
  const uint32_t sign = (static_cast<uint32_t>(h) & 0x8000u) << 16;
  const uint32_t em = static_cast<uint32_t>(h) & 0x7fffu;  // exponent|mantissa
  // Normal: move the fields into place and rebias the exponent (15 -> 127).
  const uint32_t normal = (em << 13) + ((127u - 15u) << 23);
  // Inf/NaN (exponent 31): rebias once more to reach exponent 255; make NaNs
  // quiet.
  const uint32_t inf_nan = (normal + ((127u - 15u) << 23)) |
                           half_internal::Select(em > 0x7c00u, 0x00400000u, 0u);
  // Subnormal: em * 2^-24 (a normal float). float(em) is exact; lowering its
  // exponent by 24 divides by 2^24. Zero stays zero.
  const uint32_t subnormal = half_internal::Select(
      em != 0,
      std::bit_cast<uint32_t>(static_cast<float>(static_cast<int32_t>(em))) - (24u << 23),
      0u);
  const uint32_t magnitude = half_internal::Select(
      em < 0x0400u, subnormal, half_internal::Select(em >= 0x7c00u, inf_nan, normal));
  return std::bit_cast<float>(sign | magnitude);
}

// float -> binary16, round to nearest even; overflow gives +-Inf.
constexpr uint16_t FloatToHalf(float f) {
  const uint32_t x = std::bit_cast<uint32_t>(f);
  const uint32_t sign = (x >> 16) & 0x8000u;
  const uint32_t ax = x & 0x7fffffffu;
  // Normal result (|f| >= 2^-14): rebias (127 -> 15) and round the 13 bits
  // that are dropped: add just under half, plus one more when the kept
  // mantissa is odd, so that a tie carries only for an odd mantissa. A carry
  // out of the mantissa correctly bumps the exponent (up to Inf).
  const uint32_t odd = (ax >> 13) & 1u;
  const uint32_t normal = (ax - ((127u - 15u) << 23) + 0x0fffu + odd) >> 13;
  // Subnormal result (|f| < 2^-14): adding 0.5f aligns the half subnormal
  // unit 2^-24 with the last mantissa bit of the sum, so the float addition
  // itself rounds to nearest even; the mantissa of the sum is the result
  // (1024 means the smallest normal, which is also right).
  const uint32_t subnormal =
      std::bit_cast<uint32_t>(std::bit_cast<float>(ax) + 0.5f) - 0x3f000000u;
  // NaN: quiet, keep the top 9 payload bits.
  const uint32_t nan = 0x7e00u | ((ax >> 13) & 0x03ffu);
  // 2^16 and above (including Inf) round to Inf; just below 2^16 the normal
  // path's carry already produces 0x7c00.
  const uint32_t magnitude = half_internal::Select(
      ax > 0x7f800000u, nan,
      half_internal::Select(ax >= 0x47800000u, 0x7c00u,
                            half_internal::Select(ax < 0x38800000u, subnormal, normal)));
  return static_cast<uint16_t>(sign | magnitude);
}

// bfloat16 -> float. Exact (bfloat16 is the top half of a float); a NaN comes
// out quiet.
constexpr float BFloat16ToFloat(uint16_t b) {
  const uint32_t x = static_cast<uint32_t>(b) << 16;
  const uint32_t quiet =
      half_internal::Select((x & 0x7fffffffu) > 0x7f800000u, 0x00400000u, 0u);
  return std::bit_cast<float>(x | quiet);
}

// float -> bfloat16, round to nearest even; overflow gives +-Inf.
constexpr uint16_t FloatToBFloat16(float f) {
  const uint32_t x = std::bit_cast<uint32_t>(f);
  // Same rounding as in FloatToHalf, on the low 16 bits. It cannot carry into
  // the sign bit for any non-NaN value.
  const uint32_t rounded = (x + 0x7fffu + ((x >> 16) & 1u)) >> 16;
  const uint32_t nan = (x >> 16) | 0x0040u;
  return static_cast<uint16_t>(
      half_internal::Select((x & 0x7fffffffu) > 0x7f800000u, nan, rounded));
}

}  // namespace ciuic::daemon
