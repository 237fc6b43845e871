// What the compressed allreduce (collectives/internode/internode.h,
// AllreduceCompressedWith) does to the operation's own data, chunk by chunk,
// when that data is somewhere the CPU must not touch it: a GPU's memory. The
// coder runs the codec there (the device's kernels) and keeps that
// operation's error feedback residuals there too; only encoded bytes pass
// through host memory. Data on the host uses the CPU codecs directly
// (AllreduceCompressedPieces) and needs no coder.
//
// Threads: one caller (the thread running the allreduce) at a time.
#pragma once

#include <cstddef>
#include <cstdint>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace ciuic::daemon {

class ChunkCoder {
 public:
  virtual ~ChunkCoder() = default;

  // Encodes `count` elements at `data` (in the coder's memory), elements
  // [first, first + count) of the operation, into host memory `out` (room
  // for the codec's MaxEncodedBytes) and returns the encoded size. With error
  // feedback the residual kept for these elements is added to the data
  // first and replaced after by what the encoding dropped: the operation's
  // contributions under its name, with `own_sum` (the segment owner's sums)
  // under "name#owner". With `own_sum` the data is then replaced by its
  // decoded form (the owner ends with what everybody else gets).
  virtual absl::StatusOr<uint64_t> Encode(void* data, size_t first, size_t count, bool own_sum,
                                          void* out) = 0;
  // Decodes `bytes` encoded bytes at host memory `in` (untrusted: checked,
  // INVALID_ARGUMENT leaves `data` untouched) into `count` elements at
  // `data`, or adds them into it (the codec's DecodeAdd).
  virtual absl::Status Decode(const void* in, uint64_t bytes, size_t count, void* data,
                              bool add) = 0;
};

}  // namespace ciuic::daemon
