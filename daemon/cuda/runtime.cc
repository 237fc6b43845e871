#include "cuda/runtime.h"

#include <chrono>
#include <thread>

#include "cuda/launch.h"

namespace ciuic::daemon {

absl::Status Cuda(cudaError_t e, absl::string_view what) {
  if (e != cudaSuccess) cudaGetLastError();
  return gpu::CudaStatus(static_cast<int>(e), what);
}

absl::Status WaitForEvent(cudaEvent_t event, absl::string_view what) {
  const auto start = std::chrono::steady_clock::now();
  while (true) {
    const cudaError_t e = cudaEventQuery(event);
    if (e == cudaSuccess) return absl::OkStatus();
    if (e != cudaErrorNotReady) return Cuda(e, what);
    // Not an error, but the runtime may keep it as this thread's last one,
    // which the next launch check (cudaGetLastError) would then report.
    cudaGetLastError();
    if (std::chrono::steady_clock::now() - start < std::chrono::microseconds(200)) {
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  }
}

absl::Status WaitForStream(cudaStream_t stream, cudaEvent_t* event, absl::string_view what) {
  if (*event == nullptr) {
    const cudaError_t e = cudaEventCreateWithFlags(event, cudaEventDisableTiming);
    if (e != cudaSuccess) {
      *event = nullptr;
      return Cuda(e, "cudaEventCreateWithFlags");
    }
  }
  if (absl::Status s = Cuda(cudaEventRecord(*event, stream), "cudaEventRecord"); !s.ok()) return s;
  return WaitForEvent(*event, what);
}

}  // namespace ciuic::daemon
