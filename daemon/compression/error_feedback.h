// Error feedback for lossy codecs: what compression dropped from a tensor in
// one step is added back into the same tensor before it is compressed in the
// next step, so that over many steps the receivers see the exact sum (the
// error does not accumulate; training converges as without compression).
//
// One step for an operation `name` (on the sending daemon):
//   ef.Apply(name, data, n);              // data += residual
//   bytes = codec.Encode(kFloat32, data, n, wire);
//   codec.Decode(kFloat32, wire, bytes, n, decoded);   // what receivers get
//   ef.Update(name, data, decoded, n);    // residual = data - decoded
// Apply does not consume the residual: call it once per step, then Update.
// Residuals are float32 (gradients are compressed as float32).
//
// Keys are operation names (the collectives may append a chunk number). A
// residual whose size does not match `count` belongs to an operation that
// changed shape: Apply drops it and leaves `data` as it is, Update replaces
// it; both count the reset in Stats::size_resets (the only note kept, since
// the area logs nothing itself).
//
// Memory is bounded: the residual bytes (4 per element; names and bookkeeping
// not counted) of all names stay within `max_bytes`. Update evicts the least
// recently used names (Apply and Update both count as a use) to make room;
// a residual larger than `max_bytes` on its own is not kept at all (that
// operation then runs without error feedback). An evicted operation restarts
// from a zero residual, which costs accuracy for one step, nothing more.
//
// Non-finite differences (the data held NaN or Inf) are stored as 0, so one
// bad step does not poison every later one.
//
// Thread-safe: every method takes the one internal mutex; the arithmetic on
// `data` runs under it too (so two threads must not pass the same `data`
// concurrently, which they would not do for one operation anyway).
#pragma once

#include <cstddef>
#include <list>
#include <string>
#include <unordered_map>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

namespace ciuic::daemon {

class ErrorFeedback {
 public:
  explicit ErrorFeedback(size_t max_bytes);
  ErrorFeedback(const ErrorFeedback&) = delete;
  ErrorFeedback& operator=(const ErrorFeedback&) = delete;

  // data[i] += residual[i] if `name` has a residual of `count` elements.
  void Apply(const std::string& name, float* data, size_t count);

  // residual = original_with_residual - decoded (element-wise, non-finite
  // differences stored as 0), evicting least recently used names as needed.
  void Update(const std::string& name, const float* original_with_residual, const float* decoded,
              size_t count);

  // The same for the elements [offset, offset + n) of an operation of
  // `count` elements, so that a pipelined collective can apply and update
  // its residual chunk by chunk (each chunk: ApplyRange, encode, decode,
  // UpdateRange). A residual whose size is not `count` resets as above;
  // UpdateRange creates a missing residual as zeros and writes only its
  // range. Requires offset + n <= count.
  void ApplyRange(const std::string& name, size_t count, size_t offset, float* data, size_t n);
  void UpdateRange(const std::string& name, size_t count, size_t offset,
                   const float* original_with_residual, const float* decoded, size_t n);

  // Drops the residual of `name` (an operation that will not come back).
  void Forget(const std::string& name);

  struct Stats {
    size_t names = 0;        // residuals held
    size_t bytes = 0;        // their total size, <= max_bytes
    size_t evictions = 0;    // residuals dropped to stay within max_bytes
    size_t size_resets = 0;  // residuals dropped because the count changed
    size_t too_large = 0;    // Updates not kept because one residual > max_bytes
  };
  Stats GetStats() const;

 private:
  struct Entry {
    std::vector<float> residual;
    std::list<std::string>::iterator lru;  // position in lru_
  };

  void EraseLocked(std::unordered_map<std::string, Entry>::iterator it)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The residual of `name` sized `count` (created as zeros, evicting others,
  // if missing or of another size); nullptr if count alone exceeds the cap.
  std::vector<float>* ResidualForUpdateLocked(const std::string& name, size_t count)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const size_t max_bytes_;
  mutable absl::Mutex mu_;
  std::unordered_map<std::string, Entry> entries_ ABSL_GUARDED_BY(mu_);
  std::list<std::string> lru_ ABSL_GUARDED_BY(mu_);  // front: most recently used
  Stats stats_ ABSL_GUARDED_BY(mu_);
};

}  // namespace ciuic::daemon
