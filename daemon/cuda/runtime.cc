#include "cuda/runtime.h"

#include <chrono>
#include <thread>

#include "cuda/launch.h"

namespace ciuic::daemon {

absl::Status Cuda(cudaError_t e, absl::string_view what) {
  if (e != cudaSuccess) cudaGetLastError();
  return gpu::CudaStatus(static_cast<int>(e), what);
}

bool WakeWhenReached(const std::shared_ptr<DeviceWaker>& waker, cudaStream_t stream) {
  auto* hold = new std::shared_ptr<DeviceWaker>(waker);
  const cudaError_t e = cudaLaunchHostFunc(
      stream,
      [](void* data) {
        // On CUDA's host-function thread: no CUDA call here.
        auto* w = static_cast<std::shared_ptr<DeviceWaker>*>(data);
        (*w)->Wake();
        delete w;
      },
      hold);
  if (e == cudaSuccess) return true;
  // (A stream whose context broke never runs it: that hold stays.)
  delete hold;
  cudaGetLastError();
  return false;
}

namespace {

// WaitForEvent's loop; with `stream`, the host function that wakes `waker`
// is enqueued on it only once the yielding is over (work that ends within
// it goes without one: the stream waits for a host function).
absl::Status Wait(cudaEvent_t event, absl::string_view what, cudaStream_t stream,
                  const std::shared_ptr<DeviceWaker>& waker) {
  const auto start = std::chrono::steady_clock::now();
  DeviceWaker* w = nullptr;  // once its host function is enqueued
  while (true) {
    const uint64_t seen = w != nullptr ? w->generation() : 0;
    const cudaError_t e = cudaEventQuery(event);
    if (e == cudaSuccess) return absl::OkStatus();
    if (e != cudaErrorNotReady) return Cuda(e, what);
    // Not an error, but the runtime may keep it as this thread's last one,
    // which the next launch check (cudaGetLastError) would then report.
    cudaGetLastError();
    if (std::chrono::steady_clock::now() - start < std::chrono::microseconds(200)) {
      std::this_thread::yield();
      continue;
    }
    if (w == nullptr && stream != nullptr && WakeWhenReached(waker, stream)) {
      w = waker.get();
      continue;  // look again (the wake may already have come): then wait for it
    }
    if (w != nullptr) {
      w->WaitFor(seen, std::chrono::milliseconds(1));
    } else {
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  }
}

}  // namespace

absl::Status WaitForEvent(cudaEvent_t event, absl::string_view what) {
  return Wait(event, what, nullptr, nullptr);
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
  // One waker a thread: a wake left from an earlier wait only makes this
  // one look again.
  thread_local const std::shared_ptr<DeviceWaker> waker = std::make_shared<DeviceWaker>();
  return Wait(*event, what, stream, waker);
}

}  // namespace ciuic::daemon
