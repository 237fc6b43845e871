#include "reduce/reduce.h"

#include <algorithm>
#include <atomic>
#include <bit>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include "absl/strings/str_cat.h"
#include "reduce/half.h"

namespace ciuic::reduce {
namespace {

using wire::DataType;
using wire::ReduceOp;

// Elements per block when more than two inputs are folded: the running
// results of one block (at most 16 KiB) stay in L1 while each input streams
// past once, so memory sees one read per input and one write of `out`, and
// `out` is written only after every input of the block has been read (which
// makes out == inputs[k] safe for any k). reduce_test.cc uses counts that
// are not multiples of it.
constexpr size_t kBlock = 2048;

// Element formats: how a stored element widens to the accumulator type and
// narrows back.
template <typename T>
struct Plain {
  using Storage = T;
  using Acc = T;
  static Acc Load(T x) { return x; }
  static T Store(Acc a) { return a; }
};

struct Half {
  using Storage = uint16_t;
  using Acc = float;
  // Signalling NaNs need not be quieted on the way in: see half.h.
  static Acc Load(uint16_t x) { return half_internal::HalfToFloatKeepSignaling(x); }
  static uint16_t Store(Acc a) { return FloatToHalf(a); }
};

struct BFloat16 {
  using Storage = uint16_t;
  using Acc = float;
  static Acc Load(uint16_t x) { return std::bit_cast<float>(static_cast<uint32_t>(x) << 16); }
  static uint16_t Store(Acc a) { return FloatToBFloat16(a); }
};

// Integer arithmetic is done on the unsigned type of the same width, which
// wraps instead of overflowing (converting back to the signed type is modular
// since C++20).
template <typename A>
A WrapAdd(A a, A b) {
  if constexpr (std::is_integral_v<A>) {
    using U = std::make_unsigned_t<A>;
    return static_cast<A>(static_cast<U>(static_cast<U>(a) + static_cast<U>(b)));
  } else {
    return a + b;
  }
}

template <typename A>
A WrapMul(A a, A b) {
  if constexpr (std::is_integral_v<A>) {
    using U = std::make_unsigned_t<A>;
    // For 8-bit types the operands promote to int; 255 * 255 still fits.
    return static_cast<A>(static_cast<U>(static_cast<U>(a) * static_cast<U>(b)));
  } else {
    return a * b;
  }
}

// Ops: Combine folds the next input into the running value; Finish turns the
// running value into the stored result.
struct SumOp {
  template <typename A>
  static A Combine(A acc, A x) { return WrapAdd(acc, x); }
  template <typename F, typename A>
  static typename F::Storage Finish(A acc, int /*n*/) { return F::Store(acc); }
};

struct ProdOp {
  template <typename A>
  static A Combine(A acc, A x) { return WrapMul(acc, x); }
  template <typename F, typename A>
  static typename F::Storage Finish(A acc, int /*n*/) { return F::Store(acc); }
};

struct AvgOp {
  template <typename A>
  static A Combine(A acc, A x) { return WrapAdd(acc, x); }
  template <typename F, typename A>
  static typename F::Storage Finish(A acc, int n) {
    if constexpr (std::is_integral_v<A> && sizeof(A) <= 4) {
      // Same result as the int64 division below, but SIMD has no integer
      // division and has a double one. Exact: for |s| < 2^31 and n >= 1 the
      // quotient s/n is either an integer (exact in double) or at least 1/n
      // away from one, while the rounding error of s/n in double is below
      // 2^31/n * 2^-53; so truncating the rounded quotient gives s/n
      // truncated. (For n == 2 GCC turns the division below into shifts
      // anyway, but the block loop does not know n.)
      return F::Store(static_cast<A>(static_cast<int32_t>(
          static_cast<double>(acc) / static_cast<double>(n))));
    } else if constexpr (std::is_integral_v<A>) {
      // The wrapped sum, widened; C++ division truncates toward zero. The
      // quotient's magnitude is at most the sum's, so it fits in A.
      using W = std::conditional_t<std::is_signed_v<A>, int64_t, uint64_t>;
      return F::Store(static_cast<A>(static_cast<W>(acc) / static_cast<W>(n)));
    } else {
      return F::Store(acc / static_cast<A>(n));
    }
  }
};

// Floating min/max: a NaN input makes the result NaN (the accumulator keeps a
// NaN because every comparison with it is false; a NaN x is taken
// explicitly). On a tie the earlier value stays.
struct MinOp {
  template <typename A>
  static A Combine(A acc, A x) {
    if constexpr (std::is_integral_v<A>) {
      return x < acc ? x : acc;
    } else {
      return (x < acc || x != x) ? x : acc;
    }
  }
  template <typename F, typename A>
  static typename F::Storage Finish(A acc, int /*n*/) { return F::Store(acc); }
};

struct MaxOp {
  template <typename A>
  static A Combine(A acc, A x) {
    if constexpr (std::is_integral_v<A>) {
      return x > acc ? x : acc;
    } else {
      return (x > acc || x != x) ? x : acc;
    }
  }
  template <typename F, typename A>
  static typename F::Storage Finish(A acc, int /*n*/) { return F::Store(acc); }
};

// The loops below are element-wise: iteration i reads inputs[k][i] and then
// writes out[i], and out is either disjoint from an input or exactly equal to
// it. So there is no dependence between iterations even in place, which
// `#pragma GCC ivdep` tells the vectoriser (saving its runtime overlap
// checks, which would send the in-place case to the scalar loop).
//
// Inputs are read through an under-aligned view of T (GCC's aligned(1)), so
// they may sit at any address: the vector loop loads them with unaligned
// loads anyway (movups; the same instructions as for aligned data), and the
// compiler may not assume alignment in the scalar ends either. `out` is T*.
template <typename F, typename Op>
[[gnu::always_inline]] inline void KernelBody(const void* const* inputs, int n, void* out_void,
                                              size_t count) {
  using T = typename F::Storage;
  using A = typename F::Acc;
  typedef T __attribute__((aligned(1))) In;
  T* const out = static_cast<T*>(out_void);
  const auto input = [inputs](int k) { return static_cast<const In*>(inputs[k]); };

  if (n == 1) {
    const In* a = input(0);
#pragma GCC ivdep
    for (size_t i = 0; i < count; ++i) {
      out[i] = Op::template Finish<F>(F::Load(a[i]), n);
    }
    return;
  }
  if (n == 2) {  // The common case, in one pass without a block buffer.
    const In* a = input(0);
    const In* b = input(1);
#pragma GCC ivdep
    for (size_t i = 0; i < count; ++i) {
      out[i] = Op::template Finish<F>(Op::Combine(F::Load(a[i]), F::Load(b[i])), n);
    }
    return;
  }

  alignas(64) A acc[kBlock];
  for (size_t base = 0; base < count; base += kBlock) {
    const size_t len = std::min(kBlock, count - base);
    {
      const In* a = input(0) + base;
      const In* b = input(1) + base;
      for (size_t j = 0; j < len; ++j) {
        acc[j] = Op::Combine(F::Load(a[j]), F::Load(b[j]));
      }
    }
    for (int k = 2; k < n - 1; ++k) {
      const In* c = input(k) + base;
      for (size_t j = 0; j < len; ++j) {
        acc[j] = Op::Combine(acc[j], F::Load(c[j]));
      }
    }
    const In* c = input(n - 1) + base;
    T* o = out + base;
#pragma GCC ivdep
    for (size_t j = 0; j < len; ++j) {
      o[j] = Op::template Finish<F>(Op::Combine(acc[j], F::Load(c[j])), n);
    }
  }
}

template <typename F>
[[gnu::always_inline]] inline void DivideBody(void* data, size_t count, int n) {
  using T = typename F::Storage;
  T* const p = static_cast<T*>(data);
#pragma GCC ivdep
  for (size_t i = 0; i < count; ++i) p[i] = AvgOp::template Finish<F>(F::Load(p[i]), n);
}

// The kernels, built once per instruction set. Each set's functions carry a
// target attribute and inline the bodies above, so the vectoriser uses that
// set inside them. They are templates in an unnamed namespace: no copy built
// for a wider set can stand in for a baseline one at link time (compiling
// whole files with -mavx2 risks that for every inline function they share).
// Only ISA flags change, never the architecture, so the default-target
// bodies may be inlined into them. No FMA is enabled and the file is built
// with -ffp-contract=off: every build rounds the same operations in the same
// order and gives the same bits.
struct BaselineIsa {
  static constexpr const char* kName = "baseline";
  template <typename F, typename Op>
  static void Kernel(const void* const* inputs, int n, void* out, size_t count) {
    KernelBody<F, Op>(inputs, n, out, count);
  }
  template <typename F>
  static void Divide(void* data, size_t count, int n) {
    DivideBody<F>(data, count, n);
  }
};

#if defined(__x86_64__)
struct Avx2Isa {
  static constexpr const char* kName = "avx2";
  template <typename F, typename Op>
  [[gnu::target("avx2")]] static void Kernel(const void* const* inputs, int n, void* out,
                                             size_t count) {
    KernelBody<F, Op>(inputs, n, out, count);
  }
  template <typename F>
  [[gnu::target("avx2")]] static void Divide(void* data, size_t count, int n) {
    DivideBody<F>(data, count, n);
  }
};

// 512-bit vectors: GCC's generic tuning would keep AVX-512 code at 256 bits.
#define CIUIC_AVX512_TARGET \
  gnu::target("avx2,avx512f,avx512bw,avx512dq,avx512vl,prefer-vector-width=512")
struct Avx512Isa {
  static constexpr const char* kName = "avx512";
  template <typename F, typename Op>
  [[CIUIC_AVX512_TARGET]] static void Kernel(const void* const* inputs, int n, void* out,
                                             size_t count) {
    KernelBody<F, Op>(inputs, n, out, count);
  }
  template <typename F>
  [[CIUIC_AVX512_TARGET]] static void Divide(void* data, size_t count, int n) {
    DivideBody<F>(data, count, n);
  }
};
#undef CIUIC_AVX512_TARGET
#endif

template <typename Isa, typename F>
void DispatchOp(ReduceOp op, const void* const* inputs, int n, void* out, size_t count) {
  switch (op) {
    case ReduceOp::kSum: return Isa::template Kernel<F, SumOp>(inputs, n, out, count);
    case ReduceOp::kAvg: return Isa::template Kernel<F, AvgOp>(inputs, n, out, count);
    case ReduceOp::kMin: return Isa::template Kernel<F, MinOp>(inputs, n, out, count);
    case ReduceOp::kMax: return Isa::template Kernel<F, MaxOp>(inputs, n, out, count);
    case ReduceOp::kProd: return Isa::template Kernel<F, ProdOp>(inputs, n, out, count);
  }
}

template <typename Isa>
void ReduceWith(DataType dtype, ReduceOp op, const void* const* in, int n, void* out,
                size_t count) {
  switch (dtype) {
    case DataType::kFloat32: return DispatchOp<Isa, Plain<float>>(op, in, n, out, count);
    case DataType::kFloat64: return DispatchOp<Isa, Plain<double>>(op, in, n, out, count);
    case DataType::kFloat16: return DispatchOp<Isa, Half>(op, in, n, out, count);
    case DataType::kBFloat16: return DispatchOp<Isa, BFloat16>(op, in, n, out, count);
    case DataType::kInt8: return DispatchOp<Isa, Plain<int8_t>>(op, in, n, out, count);
    case DataType::kUInt8: return DispatchOp<Isa, Plain<uint8_t>>(op, in, n, out, count);
    case DataType::kInt32: return DispatchOp<Isa, Plain<int32_t>>(op, in, n, out, count);
    case DataType::kInt64: return DispatchOp<Isa, Plain<int64_t>>(op, in, n, out, count);
  }
}

template <typename Isa>
void DivideWith(DataType dtype, void* data, size_t count, int n) {
  switch (dtype) {
    case DataType::kFloat32: return Isa::template Divide<Plain<float>>(data, count, n);
    case DataType::kFloat64: return Isa::template Divide<Plain<double>>(data, count, n);
    case DataType::kFloat16: return Isa::template Divide<Half>(data, count, n);
    case DataType::kBFloat16: return Isa::template Divide<BFloat16>(data, count, n);
    case DataType::kInt8: return Isa::template Divide<Plain<int8_t>>(data, count, n);
    case DataType::kUInt8: return Isa::template Divide<Plain<uint8_t>>(data, count, n);
    case DataType::kInt32: return Isa::template Divide<Plain<int32_t>>(data, count, n);
    case DataType::kInt64: return Isa::template Divide<Plain<int64_t>>(data, count, n);
  }
}

struct Kernels {
  const char* name;
  void (*reduce)(DataType, ReduceOp, const void* const*, int, void*, size_t);
  void (*divide)(DataType, void*, size_t, int);
  bool (*supported)();
};

template <typename Isa>
constexpr Kernels KernelsOf(bool (*supported)()) {
  return {Isa::kName, &ReduceWith<Isa>, &DivideWith<Isa>, supported};
}

// Narrowest first. __builtin_cpu_supports also checks that the operating
// system saves the wider registers.
constexpr Kernels kAllKernels[] = {
    KernelsOf<BaselineIsa>([] { return true; }),
#if defined(__x86_64__)
    KernelsOf<Avx2Isa>([] { return __builtin_cpu_supports("avx2") != 0; }),
    KernelsOf<Avx512Isa>([] {
      return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("avx512f") &&
             __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq") &&
             __builtin_cpu_supports("avx512vl");
    }),
#endif
};

struct Choice {
  const Kernels* kernels;
  std::string note;  // why CIUIC_REDUCE_ISA was not followed; empty if it was or is unset
};

// The widest supported build, or CIUIC_REDUCE_ISA's when this CPU has it.
Choice Choose() {
#if defined(__x86_64__)
  __builtin_cpu_init();
#endif
  const Kernels* best = &kAllKernels[0];
  for (const Kernels& k : kAllKernels) {
    if (k.supported()) best = &k;
  }
  const char* env = std::getenv("CIUIC_REDUCE_ISA");
  if (env == nullptr || env[0] == '\0') return {best, ""};
  std::string known;
  for (const Kernels& k : kAllKernels) {
    if (std::string_view(env) == k.name) {
      if (k.supported()) return {&k, ""};
      return {best, absl::StrCat("CIUIC_REDUCE_ISA=", env, ": this CPU lacks it; using ",
                                 best->name)};
    }
    absl::StrAppend(&known, known.empty() ? "" : ", ", k.name);
  }
  return {best, absl::StrCat("CIUIC_REDUCE_ISA=", env, " is not one of ", known, "; using ",
                             best->name)};
}

const Choice& InitialChoice() {
  static const Choice choice = Choose();
  return choice;
}

std::atomic<const Kernels*> active_kernels{nullptr};

const Kernels& Active() {
  const Kernels* k = active_kernels.load(std::memory_order_acquire);
  if (k == nullptr) {
    k = InitialChoice().kernels;
    const Kernels* expected = nullptr;
    // A concurrent SetIsa wins over the initial choice.
    if (!active_kernels.compare_exchange_strong(expected, k, std::memory_order_acq_rel)) {
      k = expected;
    }
  }
  return *k;
}

[[noreturn]] void Die(const std::string& message) {
  std::fprintf(stderr, "ciuic::reduce::Reduce: %s\n", message.c_str());
  std::fflush(stderr);
  std::abort();
}

}  // namespace

absl::Status CheckReducible(uint32_t dtype, uint32_t op) {
  if (wire::DataTypeName(dtype) == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("unknown data type ", dtype, " for a reduction"));
  }
  if (wire::ReduceOpName(op) == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat("unknown reduce op ", op));
  }
  return absl::OkStatus();
}

absl::Status CheckReducible(DataType dtype, ReduceOp op) {
  return CheckReducible(static_cast<uint32_t>(dtype), static_cast<uint32_t>(op));
}

void Reduce(DataType dtype, ReduceOp op, const void* const* inputs,
            int num_inputs, void* out, size_t count) {
  if (absl::Status status = CheckReducible(dtype, op); !status.ok()) {
    Die(std::string(status.message()));
  }
  if (num_inputs < 1) Die(absl::StrCat("num_inputs is ", num_inputs));
  if (count == 0) return;
  if (num_inputs == 1 && op != ReduceOp::kAvg) {
    if (out != inputs[0]) {
      std::memcpy(out, inputs[0], count * wire::DataTypeSize(static_cast<uint32_t>(dtype)));
    }
    return;
  }
  Active().reduce(dtype, op, inputs, num_inputs, out, count);
}

void DivideInPlace(DataType dtype, void* data, size_t count, int divisor) {
  if (divisor < 1) Die(absl::StrCat("DivideInPlace by ", divisor));
  if (wire::DataTypeName(static_cast<uint32_t>(dtype)) == nullptr) {
    Die(absl::StrCat("DivideInPlace: unknown data type ", static_cast<uint32_t>(dtype)));
  }
  if (count == 0) return;
  Active().divide(dtype, data, count, divisor);
}

std::string_view ActiveIsa() { return Active().name; }

std::vector<std::string_view> SupportedIsas() {
  InitialChoice();  // __builtin_cpu_init
  std::vector<std::string_view> names;
  for (const Kernels& k : kAllKernels) {
    if (k.supported()) names.push_back(k.name);
  }
  return names;
}

std::string IsaNote() { return InitialChoice().note; }

absl::Status SetIsa(std::string_view name) {
  InitialChoice();
  for (const Kernels& k : kAllKernels) {
    if (name != k.name) continue;
    if (!k.supported()) {
      return absl::FailedPreconditionError(absl::StrCat("this CPU lacks ", std::string(name)));
    }
    active_kernels.store(&k, std::memory_order_release);
    return absl::OkStatus();
  }
  return absl::InvalidArgumentError(
      absl::StrCat("unknown instruction set '", std::string(name), "'"));
}

}  // namespace ciuic::reduce
