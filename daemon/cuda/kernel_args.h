// The kernels' argument checks (kernels.h: "arguments are checked before
// anything is enqueued"), in plain C++: the device kernels call them, and so
// do the CUDA emulation's host kernels (tests/cuda_emulation), so that both
// refuse the same arguments with the same INVALID_ARGUMENT messages.
// Internal to daemon/cuda.
#pragma once

#include <cstddef>
#include <cstdint>

#include "absl/status/status.h"
#include "ciuic/shm_layout.h"
#include "cuda/kernels.h"

namespace ciuic::daemon::gpu {

bool AlignedTo(const void* p, size_t alignment);
// Element bytes of the float formats the codecs take, 0 for any other dtype.
size_t FloatSize(wire::DataType dtype);
constexpr size_t RoundUp256(size_t n) { return (n + 255) / 256 * 256; }
// The codecs' refusal of a dtype that is not a float format.
absl::Status NotAFloatFormat(const char* codec, wire::DataType dtype);

// DeviceReduceToAll's arguments (DeviceReduce's with one output). OK with
// count == 0 once dtype, op and the counts of pointers are valid.
absl::Status CheckReduce(wire::DataType dtype, wire::ReduceOp op, const void* const* inputs,
                         int num_inputs, void* const* outputs, int num_outputs, size_t count);
absl::Status CheckDivide(wire::DataType dtype, const void* data, size_t count, int divisor);

absl::Status CheckCastEncode(CastFormat format, wire::DataType dtype, const void* in, size_t count,
                             const void* out);
absl::Status CheckCastDecode(CastFormat format, wire::DataType dtype, const void* in, size_t bytes,
                             size_t count, const void* out);

// A workspace of `have` bytes where `need` are needed (256-byte aligned).
absl::Status CheckWorkspace(const char* codec, const void* workspace, size_t have, size_t need);
// The buffers of an int8 encode of count > 0 (the size word is checked for
// every count).
absl::Status CheckInt8Encode(wire::DataType dtype, const void* in, size_t count, const void* out,
                             const uint64_t* encoded_bytes);
// An int8 decode: dtype, trailing bytes after 0 elements, the buffers.
absl::Status CheckInt8Decode(wire::DataType dtype, const void* in, size_t bytes, size_t count,
                             const void* out);
absl::Status CheckTopKEncode(wire::DataType dtype, const void* in, size_t count, size_t k,
                             const void* out);
// A top-k decode: whole entries, no more than `count` of them, the buffers.
absl::Status CheckTopKDecode(wire::DataType dtype, const void* in, size_t bytes, size_t count,
                             const void* out);
absl::Status CheckErrorFeedback(size_t count, const void* a, const void* b, const void* c);

}  // namespace ciuic::daemon::gpu
