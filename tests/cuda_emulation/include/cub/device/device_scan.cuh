// cub::DeviceScan::ExclusiveSum for the kernel sources built against the
// CUDA emulation (simt.h): the scan runs serially on the stream, as one
// launch, reading and writing device memory through the emulation's
// aliases. It asks for a small workspace, which it checks is device memory
// of that size, so the callers' workspace arithmetic is exercised.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <string>
#include <type_traits>

#include "emulation.h"

namespace cub {

struct DeviceScan {
  static constexpr size_t kTempBytes = 1024;

  template <typename In, typename Out, typename N>
  static cudaError_t ExclusiveSum(void* temp, size_t& temp_bytes, In in, Out out, N n,
                                  cudaStream_t stream = nullptr) {
    static_assert(std::is_pointer_v<In> && std::is_pointer_v<Out>);
    using T = std::remove_cv_t<std::remove_pointer_t<In>>;
    if (temp == nullptr) {
      temp_bytes = kTempBytes;
      return cudaSuccess;
    }
    if (temp_bytes < kTempBytes || n < 0) return cudaErrorInvalidValue;
    const size_t count = static_cast<size_t>(n);
    return ciuic::cuda_emulation::Launch(stream, [=](int device) {
      using ciuic::cuda_emulation::Access;
      const auto* src = static_cast<const T*>(Access(in, count * sizeof(T), device));
      auto* dst = static_cast<T*>(Access(out, count * sizeof(T), device));
      if (Access(temp, kTempBytes, device) == nullptr ||
          (count != 0 && (src == nullptr || dst == nullptr))) {
        ciuic::cuda_emulation::Fault("cub::DeviceScan::ExclusiveSum of " + std::to_string(count) +
                                     " items: a buffer device " + std::to_string(device) +
                                     " cannot reach");
        return;
      }
      T sum{};
      for (size_t i = 0; i < count; ++i) {
        const T v = src[i];
        dst[i] = sum;
        sum += v;
      }
    });
  }
};

}  // namespace cub
