// CUDA runtime helpers shared by the daemon's device code: an error as a
// status, and waiting for device work without a blocking CUDA call (small
// operations finish within microseconds, so poll the event, yielding, for a
// short while; then wait to be woken by a host function that the stream
// runs when it gets there, or sleep in short steps where there is none).
// Built with CUDA only.
#pragma once

#include <cuda_runtime_api.h>

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace ciuic::daemon {

// OK for cudaSuccess; else the error as gpu::CudaStatus gives it, naming
// `what`, and cleared so that it does not surface in the next call.
absl::Status Cuda(cudaError_t e, absl::string_view what);

// Wakes a thread that waits for device work, from the host function a
// stream runs once its work before it is done (WakeWhenReached): the wait
// then ends with the work, not at the next of its polls. A generation
// count, so that a wake between a look at the work and the wait is kept.
class DeviceWaker {
 public:
  uint64_t generation() {
    std::lock_guard<std::mutex> lock(mu_);
    return generation_;
  }
  void Wake() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      ++generation_;
    }
    cv_.notify_all();
  }
  // Waits for a wake after generation `seen`, at most `timeout`; true if
  // woken.
  bool WaitFor(uint64_t seen, std::chrono::microseconds timeout) {
    std::unique_lock<std::mutex> lock(mu_);
    return cv_.wait_for(lock, timeout, [&] { return generation_ != seen; });
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  uint64_t generation_ = 0;
};

// Enqueues on `stream` a host function that wakes `waker` when the stream
// gets there (it holds the waker until then). False, with nothing
// enqueued, where CUDA refuses (the waiter then relies on its timeout).
// The stream waits for the host function, which only wakes: a few
// microseconds on a GPU, so not worth it after work that ends within a
// waiter's yielding.
bool WakeWhenReached(const std::shared_ptr<DeviceWaker>& waker, cudaStream_t stream);

// OK once `event` (recorded on some stream) has completed; the CUDA error,
// as a status naming `what`, if the work before it failed. After the first
// 200 us of yielding it sleeps in 50 us steps (the stream is not known
// here: WaitForStream is woken instead).
absl::Status WaitForEvent(cudaEvent_t event, absl::string_view what);

// Records `*event` on `stream` (creating it the first time, without
// timing) and waits for it: everything enqueued on `stream` so far is done.
// Past the first 200 us it enqueues a host function that wakes it
// (WakeWhenReached) and waits for that wake.
absl::Status WaitForStream(cudaStream_t stream, cudaEvent_t* event, absl::string_view what);

}  // namespace ciuic::daemon
