// DeviceReduce / DeviceReduceToAll (kernels.h): one element-wise kernel per
// dtype x op, each thread folding a 16-byte vector of elements of every input
// and storing the result to every output.
#include <cuda_runtime.h>

#include <cstdint>

#include "absl/strings/str_cat.h"
#include "cuda/device_formats.cuh"
#include "cuda/kernel_args.h"
#include "cuda/kernels.h"
#include "cuda/launch.h"

namespace ciuic::daemon::gpu {
namespace {

using namespace cuda_internal;  // NOLINT: the formats and ops
using wire::DataType;
using wire::ReduceOp;

// The input and output pointers travel by value as kernel parameters.
struct Inputs {
  const void* ptr[kMaxReduceInputs];
};
struct Outputs {
  void* ptr[kMaxReduceInputs];
};

template <typename T>
struct alignas(16) Vec {
  static constexpr int kN = 16 / sizeof(T);
  T v[kN];
};

// Work item `item` covers elements [item * V, item * V + V) (V = 16 bytes of
// elements); the last item may be short and so may the whole buffer be
// unaligned: those take the element-by-element branch. Every thread reads all
// inputs of its elements before it writes them to the `m` outputs, so an
// output equal to an input (in place) is safe. avg divides by `divisor` (n,
// or the world size for DeviceDivide's single input).
template <typename F, typename Op>
__global__ void ReduceKernel(Inputs in, int n, Outputs out, int m, size_t count, bool aligned,
                             int divisor) {
  using T = typename F::Storage;
  using A = typename F::Acc;
  constexpr int V = Vec<T>::kN;
  const size_t items = ItemsFor(count, V);
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  for (size_t item = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; item < items;
       item += stride) {
    const size_t base = item * V;
    if (aligned && base + V <= count) {
      A acc[V];
      {
        const Vec<T> x = *reinterpret_cast<const Vec<T>*>(static_cast<const T*>(in.ptr[0]) + base);
#pragma unroll
        for (int j = 0; j < V; ++j) acc[j] = F::Load(x.v[j]);
      }
      for (int k = 1; k < n; ++k) {
        const Vec<T> x = *reinterpret_cast<const Vec<T>*>(static_cast<const T*>(in.ptr[k]) + base);
#pragma unroll
        for (int j = 0; j < V; ++j) acc[j] = Op::Combine(acc[j], F::Load(x.v[j]));
      }
      Vec<T> o;
#pragma unroll
      for (int j = 0; j < V; ++j) o.v[j] = Op::template Finish<F>(acc[j], divisor);
      for (int k = 0; k < m; ++k) *reinterpret_cast<Vec<T>*>(static_cast<T*>(out.ptr[k]) + base) = o;
    } else {
      const size_t end = base + V < count ? base + V : count;
      for (size_t i = base; i < end; ++i) {
        A acc = F::Load(static_cast<const T*>(in.ptr[0])[i]);
        for (int k = 1; k < n; ++k) {
          acc = Op::Combine(acc, F::Load(static_cast<const T*>(in.ptr[k])[i]));
        }
        const T o = Op::template Finish<F>(acc, divisor);
        for (int k = 0; k < m; ++k) static_cast<T*>(out.ptr[k])[i] = o;
      }
    }
  }
}

template <typename F, typename Op>
absl::Status Launch(const Inputs& in, int n, const Outputs& out, int m, size_t count,
                    bool aligned, cudaStream_t stream, int divisor = 0) {
  using T = typename F::Storage;
  const LaunchShape shape = GridFor(ItemsFor(count, Vec<T>::kN));
  CIUIC_LAUNCH(shape.blocks, shape.threads, stream, ReduceKernel<F, Op>)
  (in, n, out, m, count, aligned, divisor > 0 ? divisor : n);
  return CudaStatus(cudaGetLastError(), "DeviceReduce launch");
}

template <typename F>
absl::Status DispatchOp(ReduceOp op, const Inputs& in, int n, const Outputs& out, int m,
                        size_t count, bool aligned, cudaStream_t stream) {
  switch (op) {
    case ReduceOp::kSum: return Launch<F, SumOp>(in, n, out, m, count, aligned, stream);
    case ReduceOp::kAvg: return Launch<F, AvgOp>(in, n, out, m, count, aligned, stream);
    case ReduceOp::kMin: return Launch<F, MinOp>(in, n, out, m, count, aligned, stream);
    case ReduceOp::kMax: return Launch<F, MaxOp>(in, n, out, m, count, aligned, stream);
    case ReduceOp::kProd: return Launch<F, ProdOp>(in, n, out, m, count, aligned, stream);
  }
  return absl::InvalidArgumentError(
      absl::StrCat("DeviceReduce: unknown reduce op ", static_cast<uint32_t>(op)));
}

bool Aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// avg's final division alone: the one input is the output.
template <typename F>
absl::Status LaunchDivide(void* data, size_t count, int divisor, cudaStream_t stream) {
  Inputs in{};
  Outputs out{};
  in.ptr[0] = data;
  out.ptr[0] = data;
  return Launch<F, AvgOp>(in, 1, out, 1, count, Aligned16(data), stream, divisor);
}

}  // namespace

absl::Status DeviceDivide(DataType dtype, void* device_data, size_t count, int divisor,
                          void* stream) {
  if (absl::Status st = CheckDivide(dtype, device_data, count, divisor); !st.ok() || count == 0) {
    return st;
  }
  auto* s = static_cast<cudaStream_t>(stream);
  switch (dtype) {
    case DataType::kFloat32: return LaunchDivide<Plain<float>>(device_data, count, divisor, s);
    case DataType::kFloat64: return LaunchDivide<Plain<double>>(device_data, count, divisor, s);
    case DataType::kFloat16: return LaunchDivide<HalfReduce>(device_data, count, divisor, s);
    case DataType::kBFloat16: return LaunchDivide<BFloat16Reduce>(device_data, count, divisor, s);
    case DataType::kInt8: return LaunchDivide<Plain<int8_t>>(device_data, count, divisor, s);
    case DataType::kUInt8: return LaunchDivide<Plain<uint8_t>>(device_data, count, divisor, s);
    case DataType::kInt32: return LaunchDivide<Plain<int32_t>>(device_data, count, divisor, s);
    case DataType::kInt64: return LaunchDivide<Plain<int64_t>>(device_data, count, divisor, s);
  }
  return absl::InvalidArgumentError("DeviceDivide: unknown data type");
}

absl::Status DeviceReduce(DataType dtype, ReduceOp op, const void* const* device_inputs,
                          int num_inputs, void* device_out, size_t count, void* stream) {
  // One output; a null output must fail the argument check, not the array.
  void* const outputs[1] = {device_out};
  return DeviceReduceToAll(dtype, op, device_inputs, num_inputs, outputs, 1, count, stream);
}

absl::Status DeviceReduceToAll(DataType dtype, ReduceOp op, const void* const* device_inputs,
                               int num_inputs, void* const* device_outputs, int num_outputs,
                               size_t count, void* stream) {
  if (absl::Status st =
          CheckReduce(dtype, op, device_inputs, num_inputs, device_outputs, num_outputs, count);
      !st.ok() || count == 0) {
    return st;
  }
  const size_t size = wire::DataTypeSize(static_cast<uint32_t>(dtype));
  Inputs in{};
  Outputs out{};
  bool aligned = true;
  for (int k = 0; k < num_inputs; ++k) {
    in.ptr[k] = device_inputs[k];
    aligned = aligned && Aligned16(device_inputs[k]);
  }
  for (int k = 0; k < num_outputs; ++k) {
    out.ptr[k] = device_outputs[k];
    aligned = aligned && Aligned16(device_outputs[k]);
  }
  auto* s = static_cast<cudaStream_t>(stream);
  if (num_inputs == 1 && op != ReduceOp::kAvg) {  // copies, as on the CPU
    for (int k = 0; k < num_outputs; ++k) {
      if (device_outputs[k] == device_inputs[0]) continue;
      absl::Status st = CudaStatus(cudaMemcpyAsync(device_outputs[k], device_inputs[0],
                                                   count * size, cudaMemcpyDeviceToDevice, s),
                                   "DeviceReduce copy");
      if (!st.ok()) return st;
    }
    return absl::OkStatus();
  }
  const int n = num_inputs;
  const int m = num_outputs;
  switch (dtype) {
    case DataType::kFloat32: return DispatchOp<Plain<float>>(op, in, n, out, m, count, aligned, s);
    case DataType::kFloat64: return DispatchOp<Plain<double>>(op, in, n, out, m, count, aligned, s);
    case DataType::kFloat16: return DispatchOp<HalfReduce>(op, in, n, out, m, count, aligned, s);
    case DataType::kBFloat16: return DispatchOp<BFloat16Reduce>(op, in, n, out, m, count, aligned, s);
    case DataType::kInt8: return DispatchOp<Plain<int8_t>>(op, in, n, out, m, count, aligned, s);
    case DataType::kUInt8: return DispatchOp<Plain<uint8_t>>(op, in, n, out, m, count, aligned, s);
    case DataType::kInt32: return DispatchOp<Plain<int32_t>>(op, in, n, out, m, count, aligned, s);
    case DataType::kInt64: return DispatchOp<Plain<int64_t>>(op, in, n, out, m, count, aligned, s);
  }
  return absl::InvalidArgumentError("DeviceReduce: unknown data type");
}

}  // namespace ciuic::daemon::gpu
