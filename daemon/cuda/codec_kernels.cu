// The codecs of daemon/compression as device kernels (kernels.h). Each
// section names the CPU file whose wire format and arithmetic it reproduces.
#include <cuda_runtime.h>

#include <cfloat>
#include <cstdint>
#include <cub/device/device_scan.cuh>
#include <limits>

#include "absl/strings/str_cat.h"
#include "cuda/device_formats.cuh"
#include "cuda/kernel_args.h"
#include "cuda/kernels.h"
#include "cuda/launch.h"

namespace ciuic::daemon::gpu {
namespace {

using namespace cuda_internal;  // NOLINT: the formats
using wire::DataType;

// Calls fn(F{}) with the codec format of a floating dtype; INVALID_ARGUMENT
// for any other dtype.
template <typename Fn>
absl::Status VisitFloat(DataType dtype, const char* codec, Fn&& fn) {
  switch (dtype) {
    case DataType::kFloat32: return fn(F32{});
    case DataType::kFloat64: return fn(F64{});
    case DataType::kFloat16: return fn(F16{});
    case DataType::kBFloat16: return fn(BF16{});
    default: break;
  }
  return NotAFloatFormat(codec, dtype);
}

cudaStream_t AsStream(void* stream) { return static_cast<cudaStream_t>(stream); }

absl::Status LastLaunch(const char* what) { return CudaStatus(cudaGetLastError(), what); }

// Loads and stores of an element at an address aligned only to 4 bytes (the
// encoded buffers put 8-byte elements at such addresses): 8-byte elements go
// as two 32-bit words.
template <typename T>
__device__ T LoadWords(const unsigned char* p) {
  if constexpr (sizeof(T) == 8) {
    const auto* w = reinterpret_cast<const uint32_t*>(p);
    const uint64_t bits = static_cast<uint64_t>(w[0]) | (static_cast<uint64_t>(w[1]) << 32);
    return __longlong_as_double(static_cast<long long>(bits));
  } else {
    return *reinterpret_cast<const T*>(p);
  }
}
template <typename T>
__device__ void StoreWords(unsigned char* p, T v) {
  if constexpr (sizeof(T) == 8) {
    const auto bits = static_cast<uint64_t>(__double_as_longlong(v));
    auto* w = reinterpret_cast<uint32_t*>(p);
    w[0] = static_cast<uint32_t>(bits);
    w[1] = static_cast<uint32_t>(bits >> 32);
  } else {
    *reinterpret_cast<T*>(p) = v;
  }
}

// The thread's first index and the grid's stride, for grid-stride loops.
__device__ size_t FirstIndex() { return static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; }
__device__ size_t GridStride() { return static_cast<size_t>(gridDim.x) * blockDim.x; }

// ---------------------------------------------------------------------------
// fp16 / bf16 casts (codec_cast.h).

template <typename Narrow>
__global__ void CastEncodeKernel(const float* in, size_t count, uint16_t* out) {
  for (size_t i = FirstIndex(); i < count; i += GridStride()) out[i] = Narrow::Store(in[i]);
}

template <typename Narrow, bool kAdd>
__global__ void CastDecodeKernel(const uint16_t* in, size_t count, float* out) {
  for (size_t i = FirstIndex(); i < count; i += GridStride()) {
    if constexpr (kAdd) {
      out[i] += Narrow::Load(in[i]);
    } else {
      out[i] = Narrow::Load(in[i]);
    }
  }
}

// ---------------------------------------------------------------------------
// int8 (codec_int8.cc): blocks of 256 elements, one warp per block, lane l
// handling elements l, l + 32, ... (coalesced loads and byte stores).

constexpr size_t kInt8Block = 256;
constexpr size_t kInt8Header = sizeof(float);
constexpr size_t kInt8PerLane = kInt8Block / 32;
constexpr double kMinQuantized = 0x1p-100;
constexpr double kMaxQuantized = 0x1p126;
// Blocks of the relayout pass (a few per SM of the largest GPUs).
constexpr unsigned kRelayoutBlocks = 512;

// Round to nearest even as codec_int8.cc does it (exact for |y| <= 2^22).
__device__ inline float RoundToInt(float y) { return (y + 0x1.8p23f) - 0x1.8p23f; }
__device__ inline double RoundToInt(double y) { return (y + 0x1.8p52) - 0x1.8p52; }

template <typename Bits>
__device__ Bits WarpMax(Bits v) {
  using Wide = std::conditional_t<sizeof(Bits) == 8, unsigned long long, unsigned>;
  Wide w = v;
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
    const Wide other = __shfl_xor_sync(0xffffffffu, w, offset);
    w = other > w ? other : w;
  }
  return static_cast<Bits>(w);
}

// Everything about one block that the encoder decides: whether it is
// quantised, and its scale and inverse.
template <typename F>
struct BlockPlan {
  bool quantized;
  float scale;
  typename F::Acc inv;
};

// Loads the lane's elements of block `b` and plans the block (warp-uniform).
template <typename F>
__device__ BlockPlan<F> PlanBlock(const typename F::Storage* x, size_t n, unsigned lane,
                                  typename F::Storage (&v)[kInt8PerLane]) {
  using A = typename F::Acc;
  typename F::AbsBits m = 0;
#pragma unroll
  for (size_t t = 0; t < kInt8PerLane; ++t) {
    const size_t j = lane + 32 * t;
    if (j < n) {
      v[t] = x[j];
      const auto b = F::Magnitude(v[t]);
      m = b > m ? b : m;
    }
  }
  m = WarpMax(m);
  const A amax = F::Load(F::FromBits(m));
  BlockPlan<F> plan;
  plan.quantized = amax == A(0) || (amax >= A(kMinQuantized) && amax <= A(kMaxQuantized));
  plan.scale = static_cast<float>(amax / A(127));
  plan.inv = plan.scale > 0 ? A(1) / static_cast<A>(plan.scale) : A(0);
  return plan;
}

template <typename F>
__device__ void WriteQuantized(const BlockPlan<F>& plan, const typename F::Storage (&v)[kInt8PerLane],
                               size_t n, unsigned lane, unsigned char* p) {
  if (lane == 0) *reinterpret_cast<float*>(p) = plan.scale;
#pragma unroll
  for (size_t t = 0; t < kInt8PerLane; ++t) {
    const size_t j = lane + 32 * t;
    if (j < n) {
      int32_t q = static_cast<int32_t>(RoundToInt(F::Load(v[t]) * plan.inv));
      q = q < -127 ? -127 : q;
      q = q > 127 ? 127 : q;
      p[kInt8Header + j] = static_cast<unsigned char>(static_cast<signed char>(q));
    }
  }
}

// Pass 1: every block at its all-quantised position b * 260; records each
// block's encoded size (a raw block's is larger), and 0 in the extra last
// entry, so that the exclusive prefix sum of the sizes ends with the total.
template <typename F>
__global__ void Int8QuantizeKernel(const typename F::Storage* x, size_t count, size_t nblocks,
                                   unsigned char* out, uint64_t* block_bytes) {
  if (FirstIndex() == 0) block_bytes[nblocks] = 0;
  const unsigned lane = threadIdx.x & 31u;
  const size_t warps = GridStride() / 32;
  for (size_t b = FirstIndex() / 32; b < nblocks; b += warps) {
    const size_t base = b * kInt8Block;
    const size_t n = count - base < kInt8Block ? count - base : kInt8Block;
    typename F::Storage v[kInt8PerLane];
    const BlockPlan<F> plan = PlanBlock<F>(x + base, n, lane, v);
    if (lane == 0) {
      block_bytes[b] = kInt8Header + (plan.quantized ? n : n * sizeof(typename F::Storage));
    }
    if (plan.quantized) WriteQuantized<F>(plan, v, n, lane, out + b * (kInt8Header + kInt8Block));
  }
}

// Pass 2: publishes the total size and, only when some block is raw (the
// total is then more than the all-quantised 4 * nblocks + count: a raw
// block takes 2 to 8 bytes an element instead of 1), writes every block
// again at the offsets of the prefix sum of the block sizes.
template <typename F>
__global__ void Int8RelayoutKernel(const typename F::Storage* x, size_t count, size_t nblocks,
                                   unsigned char* out, const uint64_t* offsets,
                                   uint64_t* encoded_bytes) {
  const uint64_t total = offsets[nblocks];
  if (blockIdx.x == 0 && threadIdx.x == 0) *encoded_bytes = total;
  if (total == nblocks * kInt8Header + count) return;
  using T = typename F::Storage;
  const unsigned lane = threadIdx.x & 31u;
  const size_t warps = GridStride() / 32;
  for (size_t b = FirstIndex() / 32; b < nblocks; b += warps) {
    const size_t base = b * kInt8Block;
    const size_t n = count - base < kInt8Block ? count - base : kInt8Block;
    T v[kInt8PerLane];
    const BlockPlan<F> plan = PlanBlock<F>(x + base, n, lane, v);
    unsigned char* p = out + offsets[b];
    if (plan.quantized) {
      WriteQuantized<F>(plan, v, n, lane, p);
    } else {
      if (lane == 0) *reinterpret_cast<float*>(p) = std::numeric_limits<float>::infinity();
      const auto* src = reinterpret_cast<const unsigned char*>(x + base);
      for (size_t i = lane; i < n * sizeof(T); i += 32) p[kInt8Header + i] = src[i];
    }
  }
}

// Validation, fast case (bytes is the all-quantised size, so every header
// sits at b * 260 and must be a finite scale >= 0): the lowest bad block.
__global__ void Int8CheckFixedKernel(const unsigned char* in, size_t nblocks,
                                     unsigned long long* bad_block) {
  for (size_t b = FirstIndex(); b < nblocks; b += GridStride()) {
    const float scale = *reinterpret_cast<const float*>(in + b * (kInt8Header + kInt8Block));
    if (!(scale >= 0 && scale <= FLT_MAX)) atomicMin(bad_block, static_cast<unsigned long long>(b));
  }
}

// What the serial walk found (codec_int8.cc Validate, step for step).
enum Int8Verdict : uint64_t { kOk = 0, kTruncatedAt = 1, kBadScale = 2, kTruncatedIn = 3, kTrailing = 4 };
struct Int8Walk {
  uint64_t verdict;
  uint64_t block;
  uint64_t pos;
  float scale;
};

// Validation, general case: one thread walks the headers as the CPU decoder
// does and records every block's offset. Serial (a header's position depends
// on every earlier block), so it costs about a memory latency per block; it
// runs only for data with raw blocks (NaN/Inf or out-of-range values).
template <typename T>
__global__ void Int8WalkKernel(const unsigned char* in, size_t bytes, size_t count,
                               uint64_t* offsets, Int8Walk* walk) {
  size_t pos = 0;
  for (size_t base = 0, b = 0; base < count; base += kInt8Block, ++b) {
    const size_t n = count - base < kInt8Block ? count - base : kInt8Block;
    if (bytes - pos < kInt8Header) {
      *walk = {kTruncatedAt, b, pos, 0};
      return;
    }
    const float scale = *reinterpret_cast<const float*>(in + pos);
    size_t payload;
    if (scale == std::numeric_limits<float>::infinity()) {
      payload = n * sizeof(T);
    } else if (scale >= 0 && scale <= FLT_MAX) {
      payload = n;
    } else {
      *walk = {kBadScale, b, pos, scale};
      return;
    }
    offsets[b] = pos;
    pos += kInt8Header;
    if (bytes - pos < payload) {
      *walk = {kTruncatedIn, b, pos, 0};
      return;
    }
    pos += payload;
  }
  *walk = {pos != bytes ? kTrailing : kOk, 0, pos, 0};
}

// Decode of validated input: block b's header at b * 260 (fixed) or at
// offsets[b].
template <typename F, bool kAdd>
__global__ void Int8DecodeKernel(const unsigned char* in, size_t count, size_t nblocks,
                                 const uint64_t* offsets, typename F::Storage* out) {
  using T = typename F::Storage;
  using A = typename F::Acc;
  const unsigned lane = threadIdx.x & 31u;
  const size_t warps = GridStride() / 32;
  for (size_t b = FirstIndex() / 32; b < nblocks; b += warps) {
    const size_t base = b * kInt8Block;
    const size_t n = count - base < kInt8Block ? count - base : kInt8Block;
    const unsigned char* p = in + (offsets != nullptr ? offsets[b] : b * (kInt8Header + kInt8Block));
    const float scale = *reinterpret_cast<const float*>(p);
    if (scale == std::numeric_limits<float>::infinity()) {
      for (size_t j = lane; j < n; j += 32) {
        const T v = LoadWords<T>(p + kInt8Header + j * sizeof(T));
        if constexpr (kAdd) {
          out[base + j] = F::Store(F::Load(out[base + j]) + F::Load(v));
        } else {
          out[base + j] = v;
        }
      }
    } else {
      const A s = scale;
      for (size_t j = lane; j < n; j += 32) {
        const auto q = static_cast<signed char>(p[kInt8Header + j]);
        if constexpr (kAdd) {
          out[base + j] = F::Store(F::Load(out[base + j]) + F::Load(F::Store(static_cast<A>(q) * s)));
        } else {
          out[base + j] = F::Store(static_cast<A>(q) * s);
        }
      }
    }
  }
}

size_t Int8Blocks(size_t count) { return ItemsFor(count, kInt8Block); }

// Encode workspace: [block sizes / offsets, nblocks + 1] [CUB scratch].
struct Int8EncodeLayout {
  size_t sizes_bytes, scan_offset, scan_bytes, total;
};

absl::StatusOr<Int8EncodeLayout> Int8Layout(size_t count) {
  const size_t items = Int8Blocks(count) + 1;
  size_t scan_bytes = 0;
  const cudaError_t e = cub::DeviceScan::ExclusiveSum(
      nullptr, scan_bytes, static_cast<uint64_t*>(nullptr), static_cast<uint64_t*>(nullptr),
      static_cast<int64_t>(items));
  if (absl::Status s = CudaStatus(e, "int8 workspace sizing"); !s.ok()) return s;
  Int8EncodeLayout l;
  l.sizes_bytes = RoundUp256(items * sizeof(uint64_t));
  l.scan_offset = l.sizes_bytes;
  l.scan_bytes = scan_bytes;
  l.total = l.scan_offset + RoundUp256(scan_bytes);
  return l;
}

// ---------------------------------------------------------------------------
// top-k (codec_topk.cc).

constexpr size_t kIndexBytes = sizeof(uint32_t);

// The radix select's state, on the device: candidates are the elements whose
// magnitude bits under `mask` equal `prefix`; `remaining` is the rank of the
// k-th largest among them. At the end prefix is the threshold and remaining
// the number of elements equal to it that are kept.
struct SelectState {
  unsigned long long prefix;
  unsigned long long mask;
  unsigned long long remaining;
};

__global__ void SelectInitKernel(SelectState* state, size_t k) { *state = {0, 0, k}; }

template <typename F>
__global__ void HistogramKernel(const typename F::Storage* x, size_t count,
                                const SelectState* state, unsigned shift, unsigned* hist) {
  __shared__ unsigned local[256];
  for (unsigned d = threadIdx.x; d < 256; d += blockDim.x) local[d] = 0;
  __syncthreads();
  const unsigned long long prefix = state->prefix;
  const unsigned long long mask = state->mask;
  for (size_t i = FirstIndex(); i < count; i += GridStride()) {
    const unsigned long long b = F::Magnitude(x[i]);
    if ((b & mask) == prefix) atomicAdd(&local[(b >> shift) & 0xffu], 1u);
  }
  __syncthreads();
  for (unsigned d = threadIdx.x; d < 256; d += blockDim.x) {
    if (local[d] != 0) atomicAdd(&hist[d], local[d]);
  }
}

// One thread: the digit of this pass, from the top bucket down.
__global__ void SelectDigitKernel(const unsigned* hist, unsigned shift, SelectState* state) {
  unsigned long long above = 0;
  for (int d = 255; d >= 0; --d) {
    if (above + hist[d] >= state->remaining) {
      state->prefix |= static_cast<unsigned long long>(d) << shift;
      state->mask |= 0xffull << shift;
      state->remaining -= above;
      return;
    }
    above += hist[d];
  }
}

// (above << 32) | tie per element: a prefix sum of it gives, for each
// element, how many larger and how many equal elements come before it.
template <typename F>
__global__ void TopKFlagKernel(const typename F::Storage* x, size_t count,
                               const SelectState* state, uint64_t* flags) {
  const unsigned long long threshold = state->prefix;
  for (size_t i = FirstIndex(); i < count; i += GridStride()) {
    const unsigned long long b = F::Magnitude(x[i]);
    flags[i] = (static_cast<uint64_t>(b > threshold) << 32) | static_cast<uint64_t>(b == threshold);
  }
}

template <typename F>
__global__ void TopKCompactKernel(const typename F::Storage* x, size_t count, size_t k,
                                  const SelectState* state, const uint64_t* before,
                                  unsigned char* out) {
  using T = typename F::Storage;
  const unsigned long long threshold = state->prefix;
  const uint64_t ties = state->remaining;
  for (size_t i = FirstIndex(); i < count; i += GridStride()) {
    const unsigned long long b = F::Magnitude(x[i]);
    const uint64_t above_before = before[i] >> 32;
    const uint64_t ties_before = before[i] & 0xffffffffu;
    size_t j;
    if (b > threshold) {
      j = above_before + (ties_before < ties ? ties_before : ties);
    } else if (b == threshold && ties_before < ties) {
      j = above_before + ties_before;
    } else {
      continue;
    }
    *reinterpret_cast<uint32_t*>(out + kIndexBytes * j) = static_cast<uint32_t>(i);
    StoreWords<T>(out + kIndexBytes * k + sizeof(T) * j, x[i]);
  }
}

__global__ void IotaKernel(uint32_t* out, size_t count) {
  for (size_t i = FirstIndex(); i < count; i += GridStride()) out[i] = static_cast<uint32_t>(i);
}

__global__ void TopKCheckKernel(const unsigned char* in, size_t k, size_t count,
                                unsigned long long* bad_entry) {
  const auto* idx = reinterpret_cast<const uint32_t*>(in);
  for (size_t j = FirstIndex(); j < k; j += GridStride()) {
    const uint32_t i = idx[j];
    if (i >= count || (j > 0 && i <= idx[j - 1])) {
      atomicMin(bad_entry, static_cast<unsigned long long>(j));
    }
  }
}

template <typename F, bool kAdd>
__global__ void TopKScatterKernel(const unsigned char* in, size_t k, typename F::Storage* out) {
  using T = typename F::Storage;
  const auto* idx = reinterpret_cast<const uint32_t*>(in);
  for (size_t j = FirstIndex(); j < k; j += GridStride()) {
    const uint32_t i = idx[j];
    const T v = LoadWords<T>(in + kIndexBytes * k + sizeof(T) * j);
    if constexpr (kAdd) {
      out[i] = F::Store(F::Load(out[i]) + F::Load(v));
    } else {
      out[i] = v;
    }
  }
}

// Encode workspace: [state] [histogram] [flags / prefix sums, count] [CUB].
struct TopKLayout {
  size_t hist_offset, flags_offset, scan_offset, scan_bytes, total;
};

absl::StatusOr<TopKLayout> TopKLayoutFor(size_t count) {
  size_t scan_bytes = 0;
  const cudaError_t e = cub::DeviceScan::ExclusiveSum(
      nullptr, scan_bytes, static_cast<uint64_t*>(nullptr), static_cast<uint64_t*>(nullptr),
      static_cast<int64_t>(count));
  if (absl::Status s = CudaStatus(e, "topk workspace sizing"); !s.ok()) return s;
  TopKLayout l;
  l.hist_offset = 256;
  l.flags_offset = l.hist_offset + 256 * sizeof(unsigned);
  l.scan_offset = l.flags_offset + RoundUp256(count * sizeof(uint64_t));
  l.scan_bytes = scan_bytes;
  l.total = l.scan_offset + RoundUp256(scan_bytes);
  return l;
}

// ---------------------------------------------------------------------------
// Error feedback (error_feedback.cc).

__global__ void EfApplyKernel(const float* residual, float* data, size_t count) {
  for (size_t i = FirstIndex(); i < count; i += GridStride()) data[i] += residual[i];
}

__global__ void EfUpdateKernel(const float* a, const float* b, float* residual, size_t count) {
  for (size_t i = FirstIndex(); i < count; i += GridStride()) {
    const float d = a[i] - b[i];
    const uint32_t bits = __float_as_uint(d);
    residual[i] = (bits & 0x7f800000u) != 0x7f800000u ? d : 0.0f;
  }
}

// Reads a small value back from the device after the stream reaches it.
template <typename T>
absl::Status ReadBack(const T* device, T* host, cudaStream_t stream, const char* what) {
  if (absl::Status s = CudaStatus(cudaMemcpyAsync(host, device, sizeof(T),
                                                  cudaMemcpyDeviceToHost, stream), what);
      !s.ok()) {
    return s;
  }
  return CudaStatus(cudaStreamSynchronize(stream), what);
}

}  // namespace

// ---------------------------------------------------------------------------

absl::Status DeviceCastEncode(CastFormat format, DataType dtype, const void* device_in,
                              size_t count, void* device_out, void* stream) {
  if (absl::Status st = CheckCastEncode(format, dtype, device_in, count, device_out); !st.ok()) {
    return st;
  }
  if (count == 0) return absl::OkStatus();
  const DataType narrow = format == CastFormat::kFp16 ? DataType::kFloat16 : DataType::kBFloat16;
  const cudaStream_t s = AsStream(stream);
  if (dtype == narrow) {
    return CudaStatus(cudaMemcpyAsync(device_out, device_in, 2 * count, cudaMemcpyDeviceToDevice, s),
                      "cast encode copy");
  }
  const LaunchShape g = GridFor(count);
  const auto* in = static_cast<const float*>(device_in);
  auto* out = static_cast<uint16_t*>(device_out);
  if (format == CastFormat::kFp16) {
    CIUIC_LAUNCH(g.blocks, g.threads, s, CastEncodeKernel<F16>)(in, count, out);
  } else {
    CIUIC_LAUNCH(g.blocks, g.threads, s, CastEncodeKernel<BF16>)(in, count, out);
  }
  return LastLaunch("cast encode launch");
}

absl::Status DeviceCastDecode(CastFormat format, DataType dtype, const void* device_in,
                              size_t bytes, size_t count, void* device_out, bool add,
                              void* stream) {
  if (absl::Status st = CheckCastDecode(format, dtype, device_in, bytes, count, device_out);
      !st.ok()) {
    return st;
  }
  if (count == 0) return absl::OkStatus();
  const DataType narrow = format == CastFormat::kFp16 ? DataType::kFloat16 : DataType::kBFloat16;
  const cudaStream_t s = AsStream(stream);
  if (dtype == narrow) {
    if (!add) {
      return CudaStatus(cudaMemcpyAsync(device_out, device_in, bytes, cudaMemcpyDeviceToDevice, s),
                        "cast decode copy");
    }
    const void* inputs[] = {device_out, device_in};
    return DeviceReduce(dtype, wire::ReduceOp::kSum, inputs, 2, device_out, count, stream);
  }
  const LaunchShape g = GridFor(count);
  const auto* in = static_cast<const uint16_t*>(device_in);
  auto* out = static_cast<float*>(device_out);
  if (format == CastFormat::kFp16) {
    if (add) {
      CIUIC_LAUNCH(g.blocks, g.threads, s, CastDecodeKernel<F16, true>)(in, count, out);
    } else {
      CIUIC_LAUNCH(g.blocks, g.threads, s, CastDecodeKernel<F16, false>)(in, count, out);
    }
  } else {
    if (add) {
      CIUIC_LAUNCH(g.blocks, g.threads, s, CastDecodeKernel<BF16, true>)(in, count, out);
    } else {
      CIUIC_LAUNCH(g.blocks, g.threads, s, CastDecodeKernel<BF16, false>)(in, count, out);
    }
  }
  return LastLaunch("cast decode launch");
}

size_t Int8MaxEncodedBytes(DataType dtype, size_t count) {
  const size_t size = FloatSize(dtype);
  if (size == 0) return 0;
  return Int8Blocks(count) * kInt8Header + count * size;
}

absl::StatusOr<size_t> Int8EncodeWorkspaceBytes(size_t count) {
  absl::StatusOr<Int8EncodeLayout> l = Int8Layout(count);
  if (!l.ok()) return l.status();
  return l->total;
}

absl::Status DeviceInt8Encode(DataType dtype, const void* device_in, size_t count,
                              void* device_out, void* device_workspace, size_t workspace_bytes,
                              uint64_t* device_encoded_bytes, void* stream) {
  return VisitFloat(dtype, "int8", [&](auto f) -> absl::Status {
    using F = decltype(f);
    using T = typename F::Storage;
    if (absl::Status st =
            CheckInt8Encode(dtype, device_in, count, device_out, device_encoded_bytes);
        !st.ok()) {
      return st;
    }
    const cudaStream_t s = AsStream(stream);
    if (count == 0) {
      return CudaStatus(cudaMemsetAsync(device_encoded_bytes, 0, sizeof(uint64_t), s),
                        "int8 encode");
    }
    absl::StatusOr<Int8EncodeLayout> layout = Int8Layout(count);
    if (!layout.ok()) return layout.status();
    if (absl::Status st = CheckWorkspace("int8", device_workspace, workspace_bytes, layout->total);
        !st.ok()) {
      return st;
    }
    auto* ws = static_cast<unsigned char*>(device_workspace);
    auto* sizes = reinterpret_cast<uint64_t*>(ws);
    const size_t nblocks = Int8Blocks(count);
    const auto* in = static_cast<const T*>(device_in);
    auto* out = static_cast<unsigned char*>(device_out);
    const LaunchShape g = GridFor(nblocks * 32);
    CIUIC_LAUNCH(g.blocks, g.threads, s, Int8QuantizeKernel<F>)(in, count, nblocks, out, sizes);
    if (absl::Status st = LastLaunch("int8 quantize launch"); !st.ok()) return st;
    size_t scan_bytes = layout->scan_bytes;
    if (absl::Status st = CudaStatus(
            cub::DeviceScan::ExclusiveSum(ws + layout->scan_offset, scan_bytes, sizes, sizes,
                                          static_cast<int64_t>(nblocks + 1), s),
            "int8 offsets");
        !st.ok()) {
      return st;
    }
    // It exits at once unless some block is raw (rare: NaN, Inf, values
    // out of int8's range): a small grid, which loops over the blocks then.
    const LaunchShape r = GridFor(nblocks * 32, kThreadsPerBlock, kRelayoutBlocks);
    CIUIC_LAUNCH(r.blocks, r.threads, s, Int8RelayoutKernel<F>)
    (in, count, nblocks, out, sizes, device_encoded_bytes);
    return LastLaunch("int8 relayout launch");
  });
}

size_t Int8DecodeWorkspaceBytes(size_t count) {
  return 256 + RoundUp256(Int8Blocks(count) * sizeof(uint64_t));
}

absl::Status DeviceInt8Decode(DataType dtype, const void* device_in, size_t bytes, size_t count,
                              void* device_out, bool add, void* device_workspace,
                              size_t workspace_bytes, void* stream, bool trusted) {
  return VisitFloat(dtype, "int8", [&](auto f) -> absl::Status {
    using F = decltype(f);
    using T = typename F::Storage;
    if (absl::Status st = CheckInt8Decode(dtype, device_in, bytes, count, device_out); !st.ok()) {
      return st;
    }
    if (count == 0) return absl::OkStatus();
    if (absl::Status st = CheckWorkspace("int8", device_workspace, workspace_bytes,
                                         Int8DecodeWorkspaceBytes(count));
        !st.ok()) {
      return st;
    }
    const cudaStream_t s = AsStream(stream);
    auto* ws = static_cast<unsigned char*>(device_workspace);
    auto* offsets = reinterpret_cast<uint64_t*>(ws + 256);
    const size_t nblocks = Int8Blocks(count);
    const auto* in = static_cast<const unsigned char*>(device_in);
    const bool fixed = bytes == nblocks * kInt8Header + count;
    // Trusted input at fixed offsets needs nothing before the decode.
    if (fixed && !trusted) {
      auto* bad = reinterpret_cast<unsigned long long*>(ws);
      if (absl::Status st = CudaStatus(cudaMemsetAsync(bad, 0xff, sizeof(*bad), s), "int8 check");
          !st.ok()) {
        return st;
      }
      const LaunchShape g = GridFor(nblocks);
      CIUIC_LAUNCH(g.blocks, g.threads, s, Int8CheckFixedKernel)(in, nblocks, bad);
      if (absl::Status st = LastLaunch("int8 check launch"); !st.ok()) return st;
      unsigned long long bad_block = 0;
      if (absl::Status st = ReadBack(bad, &bad_block, s, "int8 check"); !st.ok()) return st;
      if (bad_block != ~0ull) {
        float scale = 0;
        if (absl::Status st = ReadBack(reinterpret_cast<const float*>(
                                           in + bad_block * (kInt8Header + kInt8Block)),
                                       &scale, s, "int8 check");
            !st.ok()) {
          return st;
        }
        return absl::InvalidArgumentError(
            absl::StrCat("codec int8: block ", bad_block, " has invalid scale ", scale));
      }
    } else if (!fixed) {
      auto* walk = reinterpret_cast<Int8Walk*>(ws);
      CIUIC_LAUNCH(1, 1, s, Int8WalkKernel<T>)(in, bytes, count, offsets, walk);
      if (absl::Status st = LastLaunch("int8 walk launch"); !st.ok()) return st;
      if (!trusted) {  // a trusted input needs only the offsets
        Int8Walk w{};
        if (absl::Status st = ReadBack(walk, &w, s, "int8 check"); !st.ok()) return st;
        switch (w.verdict) {
          case kOk:
            break;
          case kTruncatedAt:
            return absl::InvalidArgumentError(absl::StrCat("codec int8: truncated at block ",
                                                           w.block, " (", bytes, " bytes for ",
                                                           count, " elements)"));
          case kBadScale:
            return absl::InvalidArgumentError(
                absl::StrCat("codec int8: block ", w.block, " has invalid scale ", w.scale));
          case kTruncatedIn:
            return absl::InvalidArgumentError(absl::StrCat("codec int8: truncated in block ",
                                                           w.block, " (", bytes, " bytes for ",
                                                           count, " elements)"));
          default:
            return absl::InvalidArgumentError(absl::StrCat(
                "codec int8: ", bytes - w.pos, " trailing bytes after ", count, " elements"));
        }
      }
    }
    const LaunchShape g = GridFor(nblocks * 32);
    const uint64_t* table = fixed ? nullptr : offsets;
    auto* out = static_cast<T*>(device_out);
    if (add) {
      CIUIC_LAUNCH(g.blocks, g.threads, s, Int8DecodeKernel<F, true>)
      (in, count, nblocks, table, out);
    } else {
      CIUIC_LAUNCH(g.blocks, g.threads, s, Int8DecodeKernel<F, false>)
      (in, count, nblocks, table, out);
    }
    return LastLaunch("int8 decode launch");
  });
}

absl::StatusOr<size_t> TopKEncodeWorkspaceBytes(size_t count) {
  absl::StatusOr<TopKLayout> l = TopKLayoutFor(count);
  if (!l.ok()) return l.status();
  return l->total;
}

absl::Status DeviceTopKEncode(DataType dtype, const void* device_in, size_t count, size_t k,
                              void* device_out, void* device_workspace, size_t workspace_bytes,
                              void* stream) {
  return VisitFloat(dtype, "topk", [&](auto f) -> absl::Status {
    using F = decltype(f);
    using T = typename F::Storage;
    if (absl::Status st = CheckTopKEncode(dtype, device_in, count, k, device_out); !st.ok()) {
      return st;
    }
    if (count == 0) return absl::OkStatus();
    const cudaStream_t s = AsStream(stream);
    const auto* in = static_cast<const T*>(device_in);
    auto* out = static_cast<unsigned char*>(device_out);
    const LaunchShape g = GridFor(count);
    if (k == count) {
      CIUIC_LAUNCH(g.blocks, g.threads, s, IotaKernel)(reinterpret_cast<uint32_t*>(out), count);
      if (absl::Status st = LastLaunch("topk launch"); !st.ok()) return st;
      return CudaStatus(cudaMemcpyAsync(out + kIndexBytes * count, in, count * sizeof(T),
                                        cudaMemcpyDeviceToDevice, s),
                        "topk copy");
    }
    absl::StatusOr<TopKLayout> layout = TopKLayoutFor(count);
    if (!layout.ok()) return layout.status();
    if (absl::Status st = CheckWorkspace("topk", device_workspace, workspace_bytes, layout->total);
        !st.ok()) {
      return st;
    }
    auto* ws = static_cast<unsigned char*>(device_workspace);
    auto* state = reinterpret_cast<SelectState*>(ws);
    auto* hist = reinterpret_cast<unsigned*>(ws + layout->hist_offset);
    auto* flags = reinterpret_cast<uint64_t*>(ws + layout->flags_offset);
    CIUIC_LAUNCH(1, 1, s, SelectInitKernel)(state, k);
    if (absl::Status st = LastLaunch("topk launch"); !st.ok()) return st;
    constexpr unsigned kBits = 8 * sizeof(typename F::AbsBits);
    for (unsigned shift = kBits - 8;; shift -= 8) {
      if (absl::Status st = CudaStatus(cudaMemsetAsync(hist, 0, 256 * sizeof(unsigned), s),
                                       "topk histogram");
          !st.ok()) {
        return st;
      }
      CIUIC_LAUNCH(g.blocks, g.threads, s, HistogramKernel<F>)(in, count, state, shift, hist);
      CIUIC_LAUNCH(1, 1, s, SelectDigitKernel)(hist, shift, state);
      if (absl::Status st = LastLaunch("topk select launch"); !st.ok()) return st;
      if (shift == 0) break;
    }
    CIUIC_LAUNCH(g.blocks, g.threads, s, TopKFlagKernel<F>)(in, count, state, flags);
    if (absl::Status st = LastLaunch("topk flag launch"); !st.ok()) return st;
    size_t scan_bytes = layout->scan_bytes;
    if (absl::Status st = CudaStatus(
            cub::DeviceScan::ExclusiveSum(ws + layout->scan_offset, scan_bytes, flags, flags,
                                          static_cast<int64_t>(count), s),
            "topk positions");
        !st.ok()) {
      return st;
    }
    CIUIC_LAUNCH(g.blocks, g.threads, s, TopKCompactKernel<F>)(in, count, k, state, flags, out);
    return LastLaunch("topk compact launch");
  });
}

size_t TopKDecodeWorkspaceBytes() { return 256; }

absl::Status DeviceTopKDecode(DataType dtype, const void* device_in, size_t bytes, size_t count,
                              void* device_out, bool add, void* device_workspace,
                              size_t workspace_bytes, void* stream, bool trusted) {
  return VisitFloat(dtype, "topk", [&](auto f) -> absl::Status {
    using F = decltype(f);
    using T = typename F::Storage;
    if (absl::Status st = CheckTopKDecode(dtype, device_in, bytes, count, device_out); !st.ok()) {
      return st;
    }
    if (count == 0) return absl::OkStatus();
    const size_t k = bytes / (kIndexBytes + sizeof(T));
    if (absl::Status st = CheckWorkspace("topk", device_workspace, workspace_bytes,
                                         TopKDecodeWorkspaceBytes());
        !st.ok()) {
      return st;
    }
    const cudaStream_t s = AsStream(stream);
    const auto* in = static_cast<const unsigned char*>(device_in);
    if (k != 0 && !trusted) {
      auto* bad = static_cast<unsigned long long*>(device_workspace);
      if (absl::Status st = CudaStatus(cudaMemsetAsync(bad, 0xff, sizeof(*bad), s), "topk check");
          !st.ok()) {
        return st;
      }
      const LaunchShape g = GridFor(k);
      CIUIC_LAUNCH(g.blocks, g.threads, s, TopKCheckKernel)(in, k, count, bad);
      if (absl::Status st = LastLaunch("topk check launch"); !st.ok()) return st;
      unsigned long long bad_entry = 0;
      if (absl::Status st = ReadBack(bad, &bad_entry, s, "topk check"); !st.ok()) return st;
      if (bad_entry != ~0ull) {
        uint32_t index = 0;
        if (absl::Status st = ReadBack(reinterpret_cast<const uint32_t*>(in) + bad_entry, &index, s,
                                       "topk check");
            !st.ok()) {
          return st;
        }
        return absl::InvalidArgumentError(absl::StrCat("codec topk: entry ", bad_entry,
                                                       " has index ", index,
                                                       " (indices must increase and be below ",
                                                       count, ")"));
      }
    }
    auto* out = static_cast<T*>(device_out);
    if (!add) {
      if (absl::Status st = CudaStatus(cudaMemsetAsync(out, 0, count * sizeof(T), s), "topk decode");
          !st.ok()) {
        return st;
      }
    }
    if (k == 0) return absl::OkStatus();
    const LaunchShape g = GridFor(k);
    if (add) {
      CIUIC_LAUNCH(g.blocks, g.threads, s, TopKScatterKernel<F, true>)(in, k, out);
    } else {
      CIUIC_LAUNCH(g.blocks, g.threads, s, TopKScatterKernel<F, false>)(in, k, out);
    }
    return LastLaunch("topk scatter launch");
  });
}

absl::Status DeviceErrorFeedbackApply(const float* device_residual, float* device_data,
                                      size_t count, void* stream) {
  if (absl::Status st = CheckErrorFeedback(count, device_residual, device_data, device_data);
      !st.ok() || count == 0) {
    return st;
  }
  const LaunchShape g = GridFor(count);
  CIUIC_LAUNCH(g.blocks, g.threads, AsStream(stream), EfApplyKernel)
  (device_residual, device_data, count);
  return LastLaunch("error feedback apply launch");
}

absl::Status DeviceErrorFeedbackUpdate(const float* device_with_residual,
                                       const float* device_decoded, float* device_residual,
                                       size_t count, void* stream) {
  if (absl::Status st =
          CheckErrorFeedback(count, device_with_residual, device_decoded, device_residual);
      !st.ok() || count == 0) {
    return st;
  }
  const LaunchShape g = GridFor(count);
  CIUIC_LAUNCH(g.blocks, g.threads, AsStream(stream), EfUpdateKernel)
  (device_with_residual, device_decoded, device_residual, count);
  return LastLaunch("error feedback update launch");
}

}  // namespace ciuic::daemon::gpu
