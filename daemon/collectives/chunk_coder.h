// What the compressed allreduce (collectives/internode/internode.h,
// AllreduceCompressedWith) does to the operation's own data, chunk by chunk,
// when that data is somewhere the CPU must not touch it: a GPU's memory. The
// coder runs the codec there (the device's kernels) and keeps that
// operation's error feedback residuals there too; only encoded bytes pass
// through host memory. Data on the host uses the CPU codecs directly
// (AllreduceCompressedPieces) and needs no coder.
//
// Encoding ahead: an encoding is begun (enqueued on the device) and ended
// later, in the order begun, so that the device encodes the next chunks
// while the caller sends and receives the earlier ones.
//
// Threads: one caller (the thread running the allreduce) at a time; only
// BeginEncode's `wake` is called from elsewhere.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace ciuic::daemon {

class ChunkCoder {
 public:
  virtual ~ChunkCoder() = default;

  // Host memory of at least `bytes` for the encodings that pass between the
  // caller and the coder (BeginEncode's `out`, Decode's `in`: the caller's
  // slots), held until the coder goes or the next call: memory that the
  // coder's copies reach at full speed without blocking the caller (a GPU's
  // pinned memory; from pageable memory a device-to-host copy is
  // synchronous and goes through the driver's own staging). Null: any host
  // memory will do.
  virtual absl::StatusOr<uint8_t*> HostMemory(size_t bytes) { return nullptr; }

  // Begins encoding `count` elements at `data` (in the coder's memory),
  // elements [first, first + count) of the operation, into host memory
  // `out` (room for the codec's MaxEncodedBytes) and returns at once: the
  // elements and `out` are the coder's until the encoding ends (EndEncode).
  // With error feedback the residual kept for these elements is added to
  // the data first and replaced after by what the encoding dropped, in one
  // residual of the operation's whole count under its name (an element is
  // either a contribution to another node's segment or, with `own_sum`, the
  // segment owner's sum, never both in one operation). With `own_sum` the
  // data is then
  // replaced by its decoded form (the owner ends with what everybody else
  // gets). `wake` is called once the encoding may have completed, from any
  // thread and without calling into the coder; perhaps never if the device
  // failed, so the caller asks EncodeDone again after a while anyway.
  virtual absl::Status BeginEncode(void* data, size_t first, size_t count, bool own_sum, void* out,
                                   std::function<void()> wake) = 0;
  // Whether the oldest encoding begun and not ended is complete (an error:
  // it failed, the device's error).
  virtual absl::StatusOr<bool> EncodeDone() = 0;
  // Ends the oldest encoding begun (EncodeDone said it is complete): its
  // size in bytes, the encoding in its `out`.
  virtual absl::StatusOr<uint64_t> EndEncode() = 0;
  // Decodes `bytes` encoded bytes at host memory `in` (untrusted: checked,
  // INVALID_ARGUMENT leaves `data` untouched) into `count` elements at
  // `data`, or adds them into it (the codec's DecodeAdd), after the
  // encodings begun before it (on a device: in its order). `in` may be
  // reused once this returns.
  virtual absl::Status Decode(const void* in, uint64_t bytes, size_t count, void* data,
                              bool add) = 0;
};

}  // namespace ciuic::daemon
