// The daemon's CUDA kernels: the local reduction of device buffers and the
// codecs of daemon/compression for data that lives on a GPU. Each function
// has a CPU reference whose results it reproduces:
//   DeviceReduce            reduce/reduce.h Reduce (bit for bit, see below)
//   DeviceCast{Encode,Decode}  compression codec "fp16" / "bf16"
//   DeviceInt8{Encode,Decode}  compression codec "int8" (same wire format)
//   DeviceTopK{Encode,Decode}  compression codec "topk:RATIO" (same format)
//   DeviceErrorFeedback{Apply,Update}  compression/error_feedback.h's loops
// so a node that encodes on its GPU and one that decodes on its CPU (or the
// reverse) interoperate. kernels_test.cc compares every function with its
// reference on a GPU, for every dtype, op and size class.
//
// Bit-for-bit: the kernels do the same float operations in the same order as
// the CPU code (widen 16-bit floats to float, accumulate left to right, round
// once; no fused multiply-add). The one difference: a NaN produced by
// arithmetic (sum, avg, prod of a NaN) is the GPU's canonical NaN, whose
// payload and sign may differ from the CPU's; it is a NaN in both.
//
// Threads and streams: every function enqueues its work on `stream` (a
// cudaStream_t passed as void*, nullptr for the legacy default stream) of the
// calling thread's current device, and returns once it is enqueued, except
// the decoders, which validate untrusted input on the device and wait for
// that (they synchronise `stream`). Pointers named device_* must be
// accessible from the current device (its own memory, or a peer's with peer
// access enabled, or an opened IPC handle). The functions keep no state and
// may be called concurrently from any threads on different buffers.
//
// Errors: arguments are checked before anything is enqueued (INVALID_ARGUMENT
// naming the problem). Without a usable device the result is
// FAILED_PRECONDITION "no CUDA device: <reason>". A failed launch or copy is
// INTERNAL with CUDA's message. count == 0 enqueues nothing and touches no
// pointer.
#pragma once

#include <cstddef>
#include <cstdint>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "ciuic/shm_layout.h"

namespace ciuic::daemon::gpu {

// The most inputs one DeviceReduce takes (the pointers travel as a kernel
// parameter): far more than the GPUs of one node.
inline constexpr int kMaxReduceInputs = 64;

// out[i] = inputs[0][i] op ... op inputs[n-1][i], with Reduce's semantics
// (reduce.h) for every DataType x ReduceOp. `device_out` may equal an input
// (in place) but must not partially overlap one. Buffers aligned to 16 bytes
// (as cudaMalloc's are) take the vectorised path; others work too, slower.
absl::Status DeviceReduce(wire::DataType dtype, wire::ReduceOp op,
                          const void* const* device_inputs, int num_inputs, void* device_out,
                          size_t count, void* stream);

// The same reduction stored to every one of `num_outputs` (1 to
// kMaxReduceInputs) outputs in the same pass: a node's allreduce reads every
// rank's input once and writes every rank's output once. An output may equal
// an input (in place) but must not partially overlap an input or another
// output.
absl::Status DeviceReduceToAll(wire::DataType dtype, wire::ReduceOp op,
                               const void* const* device_inputs, int num_inputs,
                               void* const* device_outputs, int num_outputs, size_t count,
                               void* stream);

// avg's division on its own, in place: data[i] = data[i] / divisor with
// reduce.h DivideInPlace's rounding and integer truncation (for a sum made
// elsewhere: between nodes). divisor >= 1.
absl::Status DeviceDivide(wire::DataType dtype, void* device_data, size_t count, int divisor,
                          void* stream);

// The 16-bit cast codecs: kFp16 (IEEE binary16) or kBf16.
enum class CastFormat { kFp16, kBf16 };

// float32 -> 16-bit (2 bytes per element), or a copy when `dtype` is already
// the 16-bit format. `device_out` (2 * count bytes) must be 2-byte aligned.
absl::Status DeviceCastEncode(CastFormat format, wire::DataType dtype, const void* device_in,
                              size_t count, void* device_out, void* stream);

// The inverse: `bytes` must be 2 * count. add=false overwrites `device_out`,
// add=true adds into it with Reduce's sum. Needs no device validation, so it
// does not synchronise.
absl::Status DeviceCastDecode(CastFormat format, wire::DataType dtype, const void* device_in,
                              size_t bytes, size_t count, void* device_out, bool add,
                              void* stream);

// int8: the block format of compression/codec_int8.cc (blocks of 256, a float
// scale header each, raw blocks for NaN/Inf/out-of-range). float32, float64,
// float16, bfloat16. The encoded buffer must be 4-byte aligned.
//
// The encoder writes every block at its quantised position in one pass and,
// only if some block must travel raw, rewrites the buffer with the raw
// blocks' offsets (a prefix sum) in a second pass. The encoded size is
// written to device memory (*device_encoded_bytes, 8-byte aligned); the
// caller reads it after the stream reaches it.
size_t Int8MaxEncodedBytes(wire::DataType dtype, size_t count);  // 0 if unsupported
// Scratch for one encode of `count` elements (device memory, 256-byte
// aligned, owned by the caller and untouched by others until the stream is
// past the encode). Needs the device (CUB sizes its scratch there).
absl::StatusOr<size_t> Int8EncodeWorkspaceBytes(size_t count);
absl::Status DeviceInt8Encode(wire::DataType dtype, const void* device_in, size_t count,
                              void* device_out, void* device_workspace, size_t workspace_bytes,
                              uint64_t* device_encoded_bytes, void* stream);
// Decode (add=false) or add into (add=true) `count` elements from `bytes`
// encoded bytes. The input is validated on the device first (a parallel
// check when every block is quantised; a serial walk of the headers when the
// size says that some block is raw, as in the CPU decoder) and the stream is
// synchronised to read the verdict; on INVALID_ARGUMENT `device_out` is
// untouched. The decode itself is enqueued and not waited for.
// `trusted`: the input is an encoding this process made (a coder's own, to
// learn its decoded form): nothing is checked on the device and nothing
// waited for; data with raw blocks still has its headers walked on the
// device, for their offsets.
size_t Int8DecodeWorkspaceBytes(size_t count);
absl::Status DeviceInt8Decode(wire::DataType dtype, const void* device_in, size_t bytes,
                              size_t count, void* device_out, bool add, void* device_workspace,
                              size_t workspace_bytes, void* stream, bool trusted = false);

// top-k: the format of compression/codec_topk.cc (k uint32 indices, strictly
// increasing, then k values; ties at the k-th magnitude broken by lowest
// index). `k` is the codec's kept count for `count` (1 <= k <= count, or 0
// for count 0). Selection: an 8-bit radix select of the k-th largest
// magnitude (one histogram pass per byte of the element) and then a stable
// compaction through one prefix sum. The encoded buffer (k * (4 + size)
// bytes) must be 4-byte aligned. Enqueued, not waited for.
absl::StatusOr<size_t> TopKEncodeWorkspaceBytes(size_t count);
absl::Status DeviceTopKEncode(wire::DataType dtype, const void* device_in, size_t count, size_t k,
                              void* device_out, void* device_workspace, size_t workspace_bytes,
                              void* stream);
// Validates the indices on the device (synchronising the stream), then
// decodes: add=false zeroes `device_out` and scatters the values, add=true
// adds them into it. On INVALID_ARGUMENT `device_out` is untouched.
// `trusted` (an encoding this process made): no check, no synchronisation.
size_t TopKDecodeWorkspaceBytes();
absl::Status DeviceTopKDecode(wire::DataType dtype, const void* device_in, size_t bytes,
                              size_t count, void* device_out, bool add, void* device_workspace,
                              size_t workspace_bytes, void* stream, bool trusted = false);

// Error feedback's arithmetic on device residuals (float32):
// Apply: data[i] += residual[i].
// Update: residual[i] = with_residual[i] - decoded[i], or 0 when that is not
// finite.
absl::Status DeviceErrorFeedbackApply(const float* device_residual, float* device_data,
                                      size_t count, void* stream);
absl::Status DeviceErrorFeedbackUpdate(const float* device_with_residual,
                                       const float* device_decoded, float* device_residual,
                                       size_t count, void* stream);

}  // namespace ciuic::daemon::gpu
