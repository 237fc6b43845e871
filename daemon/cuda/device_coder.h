// The codecs on the GPU for a multi-node allreduce whose node buffer is in
// device memory (issue 7): a ChunkCoder (collectives/chunk_coder.h) over
// that buffer that encodes and decodes with kernels.h's kernels on the
// buffer's stream, and error feedback residuals kept in device memory
// (DeviceResiduals, one set per job). Only encoded bytes cross to the host.
// Built with CUDA only; used by CudaDeviceRunner's staged buffers.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <list>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "ciuic/shm_layout.h"
#include "collectives/chunk_coder.h"
#include "compression/error_feedback.h"

namespace ciuic::daemon {

// Error feedback residuals in device memory, with ErrorFeedback's
// semantics (compression/error_feedback.h): float32, keyed by name, a
// residual of another size is dropped (Find) or replaced (ForUpdate), the
// total bytes bounded with least recently used names evicted. One per job:
// the job's staged buffers hold it, so it goes (its memory freed) when the
// job and its last operation have. Thread-safe; a residual is used by one
// operation at a time (a name runs in one lane at a time), but another
// lane's operation may evict it meanwhile: the caller's hold keeps the
// memory until it lets go, and the memory is freed (cudaFree, after the
// work queued on it) when the last holder does.
class DeviceResiduals {
 public:
  // Device memory of one residual.
  struct Residual {
    float* data = nullptr;
    int device = 0;
    Residual() = default;
    Residual(const Residual&) = delete;
    Residual& operator=(const Residual&) = delete;
    ~Residual();
  };

  explicit DeviceResiduals(size_t max_bytes) : max_bytes_(max_bytes) {}
  DeviceResiduals(const DeviceResiduals&) = delete;
  DeviceResiduals& operator=(const DeviceResiduals&) = delete;

  // The residual of `name` if it has `count` elements on `device`, else
  // null (a residual of another shape is dropped).
  std::shared_ptr<Residual> Find(const std::string& name, size_t count, int device);
  // The residual to update: the one there, or a new one of zeros (set on
  // `stream`), evicting others to stay within the bound; null when `count`
  // alone exceeds it (that operation then runs without error feedback).
  absl::StatusOr<std::shared_ptr<Residual>> ForUpdate(const std::string& name, size_t count,
                                                      int device, cudaStream_t stream);
  // ErrorFeedback's counters, for the residuals here (bytes: those held and
  // those being allocated).
  ErrorFeedback::Stats GetStats();

 private:
  struct Entry {
    std::shared_ptr<Residual> residual;
    size_t count = 0;
    int device = 0;
    std::list<std::string>::iterator lru;
  };
  using Dropped = std::vector<std::shared_ptr<Residual>>;
  void EraseLocked(std::unordered_map<std::string, Entry>::iterator it, Dropped* dropped);

  const size_t max_bytes_;
  std::mutex mu_;
  std::unordered_map<std::string, Entry> entries_;  // guarded by mu_
  std::list<std::string> lru_;                      // guarded by mu_: front most recent
  size_t bytes_ = 0;                                // guarded by mu_
  ErrorFeedback::Stats stats_;                      // guarded by mu_ (names, bytes: above)
};

// Pinned host memory of at least `bytes` at *data, held by the result (the
// runner's pool of staging memory).
using PinnedAlloc =
    std::function<absl::StatusOr<std::shared_ptr<void>>(uint64_t bytes, uint8_t** data)>;

// A coder for codec `spec` over `count` elements of `dtype` on `device`,
// working on `stream`; error feedback (float32 only) under `feedback_name`
// in `residuals` (empty name or null residuals: none); its HostMemory from
// `pinned`. Null when the codec cannot take the dtype (as the CPU codec
// would refuse it).
absl::StatusOr<std::unique_ptr<ChunkCoder>> MakeDeviceCoder(
    const std::string& spec, wire::DataType dtype, size_t count, int device, cudaStream_t stream,
    std::shared_ptr<DeviceResiduals> residuals, const std::string& feedback_name,
    PinnedAlloc pinned);

}  // namespace ciuic::daemon
