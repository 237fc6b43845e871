// Codec "topk:RATIO": sparsification. Of `count` elements only the
// k = max(1, ceil(RATIO * count)) largest in magnitude travel (k = count when
// that is not smaller), as two arrays: k uint32 indices, strictly
// increasing, then the k values in the input dtype, unchanged. So
// 4 + size bytes per kept element (8 for float32), no header: k is
// bytes / (4 + size). The receiver takes the dropped elements as zero.
//
// Magnitude is compared on the bits without the sign, whose integer order is
// numeric order with Inf above every finite value and NaN above Inf: a NaN or
// Inf is always among the kept elements (a diverging gradient is not hidden),
// and there is no comparison of NaNs to confuse the selection. Ties at the
// k-th magnitude are broken by lowest index.
//
// Selection: std::nth_element on a scratch array of magnitudes finds the
// k-th largest, the threshold; one pass over the input then writes the
// elements above it, plus the ties needed, in index order (so no sort). For chunks of 64 Ki
// elements or more the scratch array does not hold all magnitudes: a sample of 4096 gives a lower
// bound that about 2k + count/256 elements reach, only those are kept and selected among (exact as
// long as at least k pass; otherwise the full array is used). The scratch array is thread_local and
// reused, so a thread allocates only when it meets a larger need than before: typically about 4
// bytes x (2k + count/256), at most `size` bytes per element of its largest chunk (small chunks, or
// ties that defeat the sample). It is never shrunk. Decoding needs no scratch.
//
// Requires count < 2^32 (indices are uint32): chunks are far smaller.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <vector>

#include "absl/strings/str_cat.h"
#include "compression/codec_internal.h"

namespace ciuic::daemon {
namespace codec_internal {
namespace {

constexpr const char* kSupported = "float32, float64, float16, bfloat16";
constexpr size_t kIndexBytes = sizeof(uint32_t);

template <typename Bits>
std::vector<Bits>& Scratch() {
  thread_local std::vector<Bits> keys;
  return keys;
}

// Elements below which the sampled pre-filter is not worth it.
constexpr size_t kSampleFrom = 1 << 16;
constexpr size_t kSamples = 4096;

template <typename Bits>
struct Threshold {
  Bits value;    // the k-th largest magnitude
  size_t above;  // how many elements are larger (< k)
};

// Selects among keys[0, n), which hold every magnitude >= the k-th largest.
template <typename Bits>
Threshold<Bits> Select(std::vector<Bits>& keys, size_t n, size_t k) {
  std::nth_element(keys.begin(), keys.begin() + (k - 1), keys.begin() + n, std::greater<Bits>());
  const Bits value = keys[k - 1];
  // Everything larger is in keys[0, k-1) now.
  const size_t above = static_cast<size_t>(
      std::count_if(keys.begin(), keys.begin() + (k - 1), [value](Bits b) { return b > value; }));
  return {value, above};
}

// The k-th largest magnitude of x[0, count), 1 <= k < count.
template <typename F>
Threshold<typename F::AbsBits> KthLargest(const typename F::Storage* x, size_t count, size_t k) {
  using Bits = typename F::AbsBits;
  const auto magnitude = [](typename F::Storage v) {
    return static_cast<Bits>(std::bit_cast<Bits>(v) & F::kAbsMask);
  };
  std::vector<Bits>& keys = Scratch<Bits>();
  if (count >= kSampleFrom) {
    // Estimate from an evenly spaced sample a lower bound that about 2k + 16
    // count / kSamples elements reach, keep only those, and select among
    // them. Exact whenever at least k elements pass (then the k-th largest
    // passes too); otherwise, or if far too many pass (a sea of ties), fall
    // through to selecting among all.
    keys.resize(kSamples);
    for (size_t j = 0; j < kSamples; ++j) keys[j] = magnitude(x[j * (count / kSamples)]);
    const size_t rank = std::min(kSamples - 1, 2 * k * kSamples / count + 16);
    std::nth_element(keys.begin(), keys.begin() + rank, keys.end(), std::greater<Bits>());
    const Bits lower = keys[rank];
    // Branch-free compaction, a block at a time: every key is written, the
    // end moves only past those that pass.
    constexpr size_t kStep = 4096;
    const size_t limit = 4 * k + 64 * (count / kSamples);
    if (keys.size() < limit + kStep) keys.resize(limit + kStep);
    size_t kept = 0;
    for (size_t base = 0; base < count && kept < limit; base += kStep) {
      const size_t end = std::min(count, base + kStep);
      for (size_t i = base; i < end; ++i) {
        const Bits b = magnitude(x[i]);
        keys[kept] = b;
        kept += b >= lower;
      }
    }
    if (kept >= k && kept < limit) return Select(keys, kept, k);
  }
  if (keys.size() < count) keys.resize(count);
  for (size_t i = 0; i < count; ++i) keys[i] = magnitude(x[i]);
  return Select(keys, count, k);
}

template <typename F>
void EncodeAll(const typename F::Storage* x, size_t count, size_t k, unsigned char* out) {
  using Bits = typename F::AbsBits;
  using T = typename F::Storage;
  unsigned char* const indices = out;
  unsigned char* const values = out + kIndexBytes * k;
  const auto magnitude = [](T v) {
    return static_cast<Bits>(std::bit_cast<Bits>(v) & F::kAbsMask);
  };
  if (k == count) {
    for (size_t i = 0; i < count; ++i) {
      StoreAt<uint32_t>(indices + kIndexBytes * i, static_cast<uint32_t>(i));
    }
    std::memcpy(values, x, count * sizeof(T));
    return;
  }
  // Emit everything above the threshold and, in index order, as many of the
  // elements equal to it as fill k.
  const Threshold<Bits> t = KthLargest<F>(x, count, k);
  const Bits threshold = t.value;
  size_t ties = k - t.above;
  size_t j = 0;
  for (size_t i = 0; j < k; ++i) {
    const Bits b = magnitude(x[i]);
    if (b > threshold || (b == threshold && ties > 0)) {
      if (b == threshold) --ties;
      StoreAt<uint32_t>(indices + kIndexBytes * j, static_cast<uint32_t>(i));
      StoreAt<T>(values + sizeof(T) * j, x[i]);
      ++j;
    }
  }
}

template <typename F, bool kAdd>
void DecodeAll(const unsigned char* in, size_t k, size_t count, typename F::Storage* out) {
  using T = typename F::Storage;
  const unsigned char* const indices = in;
  const unsigned char* const values = in + kIndexBytes * k;
  // +0 in every float format. count == 0 may come with out == nullptr, which
  // memset must not get even for 0 bytes.
  if constexpr (!kAdd) {
    if (count > 0) std::memset(out, 0, count * sizeof(T));
  }
  for (size_t j = 0; j < k; ++j) {
    const uint32_t i = LoadAt<uint32_t>(indices + kIndexBytes * j);
    const T v = LoadAt<T>(values + sizeof(T) * j);
    if constexpr (kAdd) {
      out[i] = F::Store(F::Load(out[i]) + F::Load(v));
    } else {
      out[i] = v;
    }
  }
}

class TopKCodec final : public Codec {
 public:
  explicit TopKCodec(double ratio) : ratio_(ratio) {}

  absl::Status Supports(wire::DataType dtype) const override {
    return ElementSize(dtype) != 0 ? absl::OkStatus() : Unsupported(Name(), dtype, kSupported);
  }

  size_t MaxEncodedBytes(wire::DataType dtype, size_t count) const override {
    const size_t size = ElementSize(dtype);
    return size == 0 ? 0 : Kept(count) * (kIndexBytes + size);
  }

  size_t Encode(wire::DataType dtype, const void* in, size_t count, void* out) const override {
    const size_t size = ElementSize(dtype);
    if (size == 0) BrokenInvariant(Name(), "Encode of an unsupported dtype");
    if (count > std::numeric_limits<uint32_t>::max()) {
      BrokenInvariant(Name(), absl::StrCat("Encode of ", count, " elements (limit 2^32 - 1)"));
    }
    if (count == 0) return 0;
    const size_t k = Kept(count);
    VisitFloat(dtype, 0, [&](auto f) {
      using F = decltype(f);
      EncodeAll<F>(static_cast<const typename F::Storage*>(in), count, k,
                   static_cast<unsigned char*>(out));
      return 0;
    });
    return k * (kIndexBytes + size);
  }

  absl::Status Validate(wire::DataType dtype, const void* in, size_t bytes,
                        size_t count) const override {
    const size_t size = ElementSize(dtype);
    if (size == 0) return Unsupported(Name(), dtype, kSupported);
    const size_t pair = kIndexBytes + size;
    if (bytes % pair != 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "codec topk: ", bytes, " bytes is not a whole number of ", pair, "-byte entries"));
    }
    const size_t k = bytes / pair;
    if (k > count) {
      return absl::InvalidArgumentError(
          absl::StrCat("codec topk: ", k, " entries for ", count, " elements"));
    }
    const auto* p = static_cast<const unsigned char*>(in);
    for (size_t j = 0; j < k; ++j) {
      const uint32_t i = LoadAt<uint32_t>(p + kIndexBytes * j);
      if (i >= count || (j > 0 && i <= LoadAt<uint32_t>(p + kIndexBytes * (j - 1)))) {
        return absl::InvalidArgumentError(absl::StrCat("codec topk: entry ", j, " has index ", i,
                                                       " (indices must increase and be below ",
                                                       count, ")"));
      }
    }
    return absl::OkStatus();
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
  static size_t ElementSize(wire::DataType dtype) {
    return VisitFloat(dtype, size_t{0},
                      [](auto f) { return sizeof(typename decltype(f)::Storage); });
  }

  std::string Name() const { return CodecName({CodecKind::kTopK, ratio_}); }

  size_t Kept(size_t count) const {
    if (count == 0) return 0;
    const double k = std::ceil(ratio_ * static_cast<double>(count));
    if (!(k < static_cast<double>(count))) return count;
    return std::max<size_t>(1, static_cast<size_t>(k));
  }

  template <bool kAdd>
  absl::Status DecodeImpl(wire::DataType dtype, const void* in, size_t bytes, size_t count,
                          void* out) const {
    // Every index before anything is written.
    if (absl::Status s = Validate(dtype, in, bytes, count); !s.ok()) return s;
    const auto* p = static_cast<const unsigned char*>(in);
    const size_t k = bytes / (kIndexBytes + ElementSize(dtype));
    VisitFloat(dtype, 0, [&](auto f) {
      using F = decltype(f);
      DecodeAll<F, kAdd>(p, k, count, static_cast<typename F::Storage*>(out));
      return 0;
    });
    return absl::OkStatus();
  }

  double ratio_;
};

}  // namespace

std::unique_ptr<Codec> MakeTopKCodec(double ratio) { return std::make_unique<TopKCodec>(ratio); }

}  // namespace codec_internal
}  // namespace ciuic::daemon
