// Element formats and reduce ops for the device kernels (reduce_kernels.cu,
// codec_kernels.cu); internal to daemon/cuda.
//
// They mirror, operation for operation, the CPU kernels' formats and ops
// (reduce/reduce.cc, compression/codec_internal.h): 16-bit floats widen to
// float with reduce/half.h's own constexpr functions (compiled for the device
// with --expt-relaxed-constexpr), everything accumulates in the same type and
// in the same order and is narrowed once. The target is compiled with
// --fmad=false, so no multiply-add is contracted and each float operation
// rounds exactly as on the CPU. kernels_test.cc checks the results bit for bit
// against the CPU kernels; the one documented difference is the payload and
// sign of a NaN produced by arithmetic (the GPU gives the canonical NaN).
#pragma once

#include <cstdint>
#include <type_traits>

#include "ciuic/shm_layout.h"
#include "reduce/half.h"

// A kernel launch: CIUIC_LAUNCH(grid, block, stream, kernel)(arguments...),
// kernel<<<grid, block, 0, stream>>>(arguments...) under nvcc. The CUDA
// emulation's SIMT executor (tests/cuda_emulation/simt.h) defines it first,
// to run the same kernel source on the host.
#ifndef CIUIC_LAUNCH
#define CIUIC_LAUNCH(grid, block, stream, ...) __VA_ARGS__<<<(grid), (block), 0, (stream)>>>
#endif

namespace ciuic::daemon::cuda_internal {

template <typename T>
struct Plain {
  using Storage = T;
  using Acc = T;
  __device__ static Acc Load(T x) { return x; }
  __device__ static T Store(Acc a) { return a; }
};

// Reduce's 16-bit formats: the load keeps a signalling NaN (see half.h).
struct HalfReduce {
  using Storage = uint16_t;
  using Acc = float;
  __device__ static Acc Load(uint16_t x) { return reduce::half_internal::HalfToFloatKeepSignaling(x); }
  __device__ static uint16_t Store(Acc a) { return FloatToHalf(a); }
};

struct BFloat16Reduce {
  using Storage = uint16_t;
  using Acc = float;
  __device__ static Acc Load(uint16_t x) { return __uint_as_float(static_cast<uint32_t>(x) << 16); }
  __device__ static uint16_t Store(Acc a) { return FloatToBFloat16(a); }
};

// The codecs' floating formats (codec_internal.h): AbsBits is an unsigned
// integer of the storage width whose order on |x| is magnitude order.
struct F32 {
  using Storage = float;
  using Acc = float;
  using AbsBits = uint32_t;
  static constexpr AbsBits kAbsMask = 0x7fffffffu;
  __device__ static Acc Load(float x) { return x; }
  __device__ static float Store(Acc a) { return a; }
  __device__ static AbsBits Magnitude(float x) { return __float_as_uint(x) & kAbsMask; }
  __device__ static Storage FromBits(AbsBits b) { return __uint_as_float(b); }
};

struct F64 {
  using Storage = double;
  using Acc = double;
  using AbsBits = uint64_t;
  static constexpr AbsBits kAbsMask = 0x7fffffffffffffffull;
  __device__ static Acc Load(double x) { return x; }
  __device__ static double Store(Acc a) { return a; }
  __device__ static AbsBits Magnitude(double x) {
    return static_cast<uint64_t>(__double_as_longlong(x)) & kAbsMask;
  }
  __device__ static Storage FromBits(AbsBits b) {
    return __longlong_as_double(static_cast<long long>(b));
  }
};

struct F16 {
  using Storage = uint16_t;
  using Acc = float;
  using AbsBits = uint16_t;
  static constexpr AbsBits kAbsMask = 0x7fff;
  __device__ static Acc Load(uint16_t x) { return HalfToFloat(x); }
  __device__ static uint16_t Store(Acc a) { return FloatToHalf(a); }
  __device__ static AbsBits Magnitude(uint16_t x) { return x & kAbsMask; }
  __device__ static Storage FromBits(AbsBits b) { return b; }
};

struct BF16 {
  using Storage = uint16_t;
  using Acc = float;
  using AbsBits = uint16_t;
  static constexpr AbsBits kAbsMask = 0x7fff;
  __device__ static Acc Load(uint16_t x) { return BFloat16ToFloat(x); }
  __device__ static uint16_t Store(Acc a) { return FloatToBFloat16(a); }
  __device__ static AbsBits Magnitude(uint16_t x) { return x & kAbsMask; }
  __device__ static Storage FromBits(AbsBits b) { return b; }
};

// Integer arithmetic wraps (done on the unsigned type of the same width).
template <typename A>
__device__ A WrapAdd(A a, A b) {
  if constexpr (std::is_integral_v<A>) {
    using U = std::make_unsigned_t<A>;
    return static_cast<A>(static_cast<U>(static_cast<U>(a) + static_cast<U>(b)));
  } else {
    return a + b;
  }
}

template <typename A>
__device__ A WrapMul(A a, A b) {
  if constexpr (std::is_integral_v<A>) {
    using U = std::make_unsigned_t<A>;
    return static_cast<A>(static_cast<U>(static_cast<U>(a) * static_cast<U>(b)));
  } else {
    return a * b;
  }
}

struct SumOp {
  template <typename A>
  __device__ static A Combine(A acc, A x) { return WrapAdd(acc, x); }
  template <typename F, typename A>
  __device__ static typename F::Storage Finish(A acc, int) { return F::Store(acc); }
};

struct ProdOp {
  template <typename A>
  __device__ static A Combine(A acc, A x) { return WrapMul(acc, x); }
  template <typename F, typename A>
  __device__ static typename F::Storage Finish(A acc, int) { return F::Store(acc); }
};

struct AvgOp {
  template <typename A>
  __device__ static A Combine(A acc, A x) { return WrapAdd(acc, x); }
  template <typename F, typename A>
  __device__ static typename F::Storage Finish(A acc, int n) {
    if constexpr (std::is_integral_v<A> && sizeof(A) <= 4) {
      // reduce.cc divides in double and truncates (exact, see there).
      return F::Store(static_cast<A>(static_cast<int32_t>(
          static_cast<double>(acc) / static_cast<double>(n))));
    } else if constexpr (std::is_integral_v<A>) {
      using W = std::conditional_t<std::is_signed_v<A>, int64_t, uint64_t>;
      return F::Store(static_cast<A>(static_cast<W>(acc) / static_cast<W>(n)));
    } else {
      return F::Store(acc / static_cast<A>(n));
    }
  }
};

struct MinOp {
  template <typename A>
  __device__ static A Combine(A acc, A x) {
    if constexpr (std::is_integral_v<A>) {
      return x < acc ? x : acc;
    } else {
      return (x < acc || x != x) ? x : acc;
    }
  }
  template <typename F, typename A>
  __device__ static typename F::Storage Finish(A acc, int) { return F::Store(acc); }
};

struct MaxOp {
  template <typename A>
  __device__ static A Combine(A acc, A x) {
    if constexpr (std::is_integral_v<A>) {
      return x > acc ? x : acc;
    } else {
      return (x > acc || x != x) ? x : acc;
    }
  }
  template <typename F, typename A>
  __device__ static typename F::Storage Finish(A acc, int) { return F::Store(acc); }
};

}  // namespace ciuic::daemon::cuda_internal
