// Codecs for what crosses the network in the inter-node phase of a
// collective: each chunk a daemon sends to another daemon may be encoded by a
// Codec, and the receiver decodes it, either into a buffer (allgather) or
// added into its accumulator (reduce-scatter: DecodeAdd reduces a compressed
// chunk without a temporary buffer).
//
// Callers: the inter-node collectives, from their I/O or worker threads. A
// Codec is stateless (configuration only) and every method is const and safe
// to call concurrently from any thread. The one per-thread resource is the
// top-k selection scratch (see codec_topk.cc and README.md).
//
// The encoded bytes are self-describing given (dtype, count), which both
// sides already know from negotiation: Decode needs nothing else. Decode and
// DecodeAdd treat the bytes as untrusted network input: a wrong size, an
// impossible index, an invalid scale give INVALID_ARGUMENT and
// leave `out` / `acc` untouched; nothing is read or written out of bounds.
//
// Buffers: the element buffers (Encode's `in`, Decode's `out`, DecodeAdd's
// `acc`) must be aligned for `dtype` (the daemon's buffers always are). The
// encoded bytes (Encode's `out`, Decode's `in`) may have any alignment. Byte
// order on the wire is little endian (the only byte order ciuic supports).
//
// The wire formats and error bounds of each codec are in README.md.
#pragma once

#include <cstddef>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "ciuic/shm_layout.h"

namespace ciuic::daemon {

enum class CodecKind { kNone, kFp16, kBf16, kInt8, kTopK };

struct CodecSpec {
  CodecKind kind = CodecKind::kNone;
  double topk_ratio = 0;  // kTopK only: fraction of elements kept, 0 < ratio <= 1
};

// Parses "none", "fp16", "bf16", "int8" or "topk:RATIO" with 0 < RATIO <= 1
// (e.g. "topk:0.01"). Anything else: INVALID_ARGUMENT naming the text and
// listing the valid forms.
absl::StatusOr<CodecSpec> ParseCodec(absl::string_view text);

// The inverse of ParseCodec: "none", "fp16", "bf16", "int8", "topk:0.01".
// ParseCodec(CodecName(spec)) gives `spec` back for every valid spec.
std::string CodecName(const CodecSpec& spec);

class Codec {
 public:
  virtual ~Codec() = default;

  // OK if this codec encodes elements of `dtype`; INVALID_ARGUMENT saying why
  // not otherwise. Which dtypes each codec takes is in README.md (float32
  // always).
  virtual absl::Status Supports(wire::DataType dtype) const = 0;

  // Upper bound of Encode's result for `count` elements of `dtype`: the size
  // of the send buffer to reserve. 0 if !Supports(dtype).ok(). May exceed the
  // raw size (int8: blocks holding NaN/Inf travel raw, plus their header).
  virtual size_t MaxEncodedBytes(wire::DataType dtype, size_t count) const = 0;

  // What Encode writes for `count` elements of `dtype` in the usual case: the
  // exact size for every codec but int8, whose blocks holding NaN/Inf (or
  // values outside its scale range) travel raw and make the result larger.
  // Pipelined collectives size their fixed-length messages by this and send
  // any excess separately. <= MaxEncodedBytes; 0 if !Supports(dtype).ok().
  virtual size_t TypicalEncodedBytes(wire::DataType dtype, size_t count) const {
    return MaxEncodedBytes(dtype, count);
  }

  // g > 0 if the encoding is a concatenation: for any a that is a multiple
  // of g, Encode(x[0, n)) is byte for byte Encode(x[0, a)) followed by
  // Encode(x[a, n)). Callers may then encode (and decode) a chunk in
  // cache-sized pieces. 0: not splittable (top-k selects over the whole
  // input). none, fp16, bf16: 1; int8: its block, 256.
  virtual size_t SplitGranule() const { return 0; }

  // Encodes `count` elements of `dtype` from `in` into `out`, which has room
  // for MaxEncodedBytes(dtype, count) bytes, and returns the number of bytes
  // written (<= that bound). Requires Supports(dtype).ok() and, for top-k,
  // count < 2^32; a violation is a broken invariant (the process stops).
  // `in` and `out` must not overlap.
  virtual size_t Encode(wire::DataType dtype, const void* in, size_t count, void* out) const = 0;

  // Checks `bytes` bytes at `in` as Decode does before it writes anything:
  // OK exactly where Decode (and DecodeAdd) would succeed, with the same
  // error otherwise. For a decoder elsewhere that takes the bytes as
  // checked (a GPU's: the bytes are in host memory here, and checking them
  // on the device would wait for it).
  virtual absl::Status Validate(wire::DataType dtype, const void* in, size_t bytes,
                                size_t count) const = 0;

  // Decodes `bytes` bytes at `in` (from Encode on the sending side, with the
  // same dtype and count) into `count` elements at `out`, overwriting them.
  // On error `out` is untouched.
  virtual absl::Status Decode(wire::DataType dtype, const void* in, size_t bytes, size_t count,
                              void* out) const = 0;

  // The same, but adds the decoded values into `acc`: acc[i] = acc[i] +
  // decoded[i], with the rounding of Reduce's sum (16-bit formats widen to
  // float, add, round once). Bit-for-bit the result of Decode into a
  // temporary followed by Reduce(kSum, {acc, temporary}), except that top-k
  // leaves the elements it did not send as they are (adding +0 would turn a
  // -0 into +0). On error `acc` is untouched.
  virtual absl::Status DecodeAdd(wire::DataType dtype, const void* in, size_t bytes, size_t count,
                                 void* acc) const = 0;
};

// The codec for a valid spec (one that ParseCodec accepts); a spec with an
// out-of-range top-k ratio is a broken invariant.
std::unique_ptr<Codec> MakeCodec(const CodecSpec& spec);

}  // namespace ciuic::daemon
