// Conversions between float and the two 16-bit floating-point formats that
// trainers send: IEEE 754 binary16 ("half", float16) and bfloat16.
//
// The reduction kernels (reduce.cc) widen 16-bit elements to float, combine
// them in float and narrow once at the end, so these functions sit in the
// daemon's hot loop. They are plain bit manipulation without branches: every
// special case is computed and then chosen with a bit mask. (Written as `?:`,
// GCC turns the choices back into branches and, because a float operation
// sits in one arm, cannot if-convert them, so the loop stays scalar.) With
// masks GCC vectorises loops calling them with baseline SSE2; no -march flag
// or F16C is needed. They are constexpr and callable from any thread.
//
// Contract, for both formats:
//   * float -> 16 bits rounds to nearest, ties to even; values beyond the
//     largest finite 16-bit value (after rounding) become +-Inf.
//   * Subnormals are converted exactly in both directions (float subnormals
//     are far below the binary16 range and round to +-0 there; bfloat16 has
//     float's exponent range, and its subnormals round like normals).
//   * Inf stays Inf with its sign. NaN stays NaN, with its sign, and always
//     comes out quiet (float -> binary16 gives the canonical 0x7e00/0xfe00;
//     the other conversions keep the payload bits that fit).
// The only floating-point operations used (an exact float subtraction and a
// float addition that rounds to nearest even) assume the default
// rounding mode, which the daemon never changes. Results do not depend on
// flush-to-zero / denormals-are-zero.
#pragma once

#include <bit>
#include <cstdint>

namespace ciuic::reduce {
namespace half_internal {

// c ? a : b, computed without a branch.
constexpr uint32_t Select(bool c, uint32_t a, uint32_t b) {
  const uint32_t mask = 0u - static_cast<uint32_t>(c);
  return (a & mask) | (b & ~mask);
}

// binary16 -> float, leaving a signalling NaN signalling. The reduction
// kernels widen with this: arithmetic quiets a NaN anyway and the narrowing
// conversions always produce a quiet NaN, so the result is the same and each
// load is three operations shorter.
constexpr float HalfToFloatKeepSignaling(uint16_t h) {
  const int32_t em = h & 0x7fff;  // exponent and mantissa
  const uint32_t sign = (static_cast<uint32_t>(h) << 16) & 0x80000000u;
  // Normal: move the fields into place and rebias the exponent (15 -> 127);
  // Inf/NaN (exponent 31): rebias once more, to exponent 255.
  const uint32_t normal = (static_cast<uint32_t>(em) << 13) +
                          Select(em >= 0x7c00, 2u * ((127u - 15u) << 23), (127u - 15u) << 23);
  // Subnormal or zero: em * 2^-24. As a mantissa under the exponent of 0.5f
  // the bits read 0.5 + em * 2^-24; subtracting 0.5f is exact and leaves a
  // normal float (or zero).
  const uint32_t subnormal = std::bit_cast<uint32_t>(
      std::bit_cast<float>(static_cast<uint32_t>(em) | 0x3f000000u) - 0.5f);
  return std::bit_cast<float>(sign | Select(em < 0x0400, subnormal, normal));
}

}  // namespace half_internal

// binary16 -> float. Exact; a NaN comes out as a quiet float NaN.
constexpr float HalfToFloat(uint16_t h) {
  const float f = half_internal::HalfToFloatKeepSignaling(h);
  const bool nan = (h & 0x7fff) > 0x7c00;
  return std::bit_cast<float>(std::bit_cast<uint32_t>(f) |
                              half_internal::Select(nan, 0x00400000u, 0u));
}

// float -> binary16, round to nearest even; overflow gives +-Inf; a NaN gives
// the quiet NaN 0x7e00 with the sign of the input.
//
// Every candidate result is formed shifted left by 13 bits and the choice is
// shifted down once at the end. Otherwise GCC performs the final ORs in 16-bit
// lanes, narrowing each operand separately, and baseline SSE2 has no 32 -> 16
// bit pack: every narrowing costs a handful of shuffles.
constexpr uint16_t FloatToHalf(float f) {
  const uint32_t x = std::bit_cast<uint32_t>(f);
  const int32_t ax = static_cast<int32_t>(x & 0x7fffffffu);
  const uint32_t sign = (x >> 3) & 0x10000000u;  // bit 15 << 13
  // Normal result (|f| >= 2^-14): rebias (127 -> 15) and round the 13 bits
  // that are dropped: add just under half, plus one more when the kept
  // mantissa is odd, so that a tie carries only for an odd mantissa. A carry
  // out of the mantissa correctly bumps the exponent (up to Inf).
  const uint32_t odd = (static_cast<uint32_t>(ax) >> 13) & 1u;
  const uint32_t normal = static_cast<uint32_t>(ax) - ((127u - 15u) << 23) + 0x0fffu + odd;
  // Subnormal result (|f| < 2^-14): adding 0.5f aligns the half subnormal
  // unit 2^-24 with the last mantissa bit of the sum, so the float addition
  // itself rounds to nearest even; the mantissa of the sum is the result
  // (1024 means the smallest normal, which is also right).
  const uint32_t subnormal =
      (std::bit_cast<uint32_t>(std::bit_cast<float>(ax) + 0.5f) - 0x3f000000u) << 13;
  // 2^16 and above (Inf and NaN included) become Inf, NaN with the quiet bit;
  // just below 2^16 the normal path's carry already produces 0x7c00.
  const uint32_t small = 0u - static_cast<uint32_t>(ax < 0x38800000);
  const uint32_t big = 0u - static_cast<uint32_t>(ax >= 0x47800000);
  const uint32_t nan = 0u - static_cast<uint32_t>(ax > 0x7f800000);
  const uint32_t finite = (subnormal & small) | (normal & ~small);
  return static_cast<uint16_t>(
      (sign | (finite & ~big) | (big & (0x7c00u << 13)) | (nan & (0x0200u << 13))) >> 13);
}

// bfloat16 -> float. Exact (bfloat16 is the top half of a float); a NaN comes
// out quiet.
constexpr float BFloat16ToFloat(uint16_t b) {
  const uint32_t x = static_cast<uint32_t>(b) << 16;
  const bool nan = static_cast<int32_t>(x & 0x7fffffffu) > 0x7f800000;
  return std::bit_cast<float>(x | half_internal::Select(nan, 0x00400000u, 0u));
}

// float -> bfloat16, round to nearest even; overflow gives +-Inf; a NaN stays
// NaN (sign and top payload bits kept) and comes out quiet.
constexpr uint16_t FloatToBFloat16(float f) {
  const uint32_t x = std::bit_cast<uint32_t>(f);
  // Same rounding as in FloatToHalf, on the low 16 bits; it cannot carry into
  // the sign bit for any non-NaN value. A NaN is truncated instead (rounding
  // could carry it to Inf) and gets the quiet bit.
  const uint32_t nan = 0u - static_cast<uint32_t>(static_cast<int32_t>(x & 0x7fffffffu) > 0x7f800000);
  const uint32_t bias = (0x7fffu + ((x >> 16) & 1u)) & ~nan;
  return static_cast<uint16_t>(((x + bias) | (nan & 0x00400000u)) >> 16);  // one shift, see above
}

}  // namespace ciuic::reduce

// The daemon's code calls these unqualified from namespace ciuic::daemon.
namespace ciuic::daemon {
using reduce::BFloat16ToFloat;
using reduce::FloatToBFloat16;
using reduce::FloatToHalf;
using reduce::HalfToFloat;
}  // namespace ciuic::daemon
