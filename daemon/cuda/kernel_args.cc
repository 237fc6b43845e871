#include "cuda/kernel_args.h"

#include <cstdint>
#include <string>

#include "absl/strings/str_cat.h"

namespace ciuic::daemon::gpu {

using wire::DataType;
using wire::ReduceOp;

namespace {
constexpr const char* kFloatTypes = "float32, float64, float16, bfloat16";
constexpr size_t kIndexBytes = sizeof(uint32_t);
}  // namespace

bool AlignedTo(const void* p, size_t alignment) {
  return reinterpret_cast<uintptr_t>(p) % alignment == 0;
}

size_t FloatSize(DataType dtype) {
  switch (dtype) {
    case DataType::kFloat32:
      return 4;
    case DataType::kFloat64:
      return 8;
    case DataType::kFloat16:
    case DataType::kBFloat16:
      return 2;
    default:
      return 0;
  }
}

absl::Status NotAFloatFormat(const char* codec, DataType dtype) {
  const char* name = wire::DataTypeName(static_cast<uint32_t>(dtype));
  return absl::InvalidArgumentError(absl::StrCat(
      "codec ", codec, ": dtype ",
      name != nullptr ? std::string(name) : absl::StrCat("#", static_cast<uint32_t>(dtype)),
      " is not supported on the GPU (supported: ", kFloatTypes, ")"));
}

absl::Status CheckReduce(DataType dtype, ReduceOp op, const void* const* inputs, int num_inputs,
                         void* const* outputs, int num_outputs, size_t count) {
  const size_t size = wire::DataTypeSize(static_cast<uint32_t>(dtype));
  if (size == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("DeviceReduce: unknown data type ", static_cast<uint32_t>(dtype)));
  }
  if (wire::ReduceOpName(static_cast<uint32_t>(op)) == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("DeviceReduce: unknown reduce op ", static_cast<uint32_t>(op)));
  }
  if (num_inputs < 1 || num_inputs > kMaxReduceInputs) {
    return absl::InvalidArgumentError(
        absl::StrCat("DeviceReduce: ", num_inputs, " inputs (1 to ", kMaxReduceInputs, ")"));
  }
  if (num_outputs < 1 || num_outputs > kMaxReduceInputs) {
    return absl::InvalidArgumentError(
        absl::StrCat("DeviceReduce: ", num_outputs, " outputs (1 to ", kMaxReduceInputs, ")"));
  }
  if (count > SIZE_MAX / size) {
    return absl::InvalidArgumentError(absl::StrCat("DeviceReduce: count ", count, " too large"));
  }
  if (count == 0) return absl::OkStatus();
  if (inputs == nullptr || outputs == nullptr) {
    return absl::InvalidArgumentError("DeviceReduce: null buffer");
  }
  for (int k = 0; k < num_inputs; ++k) {
    if (inputs[k] == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat("DeviceReduce: input ", k, " is null"));
    }
    if (!AlignedTo(inputs[k], size)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "DeviceReduce: input ", k, " is not aligned to its ", size, "-byte elements"));
    }
  }
  for (int k = 0; k < num_outputs; ++k) {
    if (outputs[k] == nullptr) {
      return absl::InvalidArgumentError(num_outputs == 1
                                            ? std::string("DeviceReduce: null buffer")
                                            : absl::StrCat("DeviceReduce: output ", k, " is null"));
    }
    if (!AlignedTo(outputs[k], size)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "DeviceReduce: output", num_outputs == 1 ? std::string() : absl::StrCat(" ", k),
          " is not aligned to its ", size, "-byte elements"));
    }
  }
  return absl::OkStatus();
}

absl::Status CheckDivide(DataType dtype, const void* data, size_t count, int divisor) {
  const size_t size = wire::DataTypeSize(static_cast<uint32_t>(dtype));
  if (size == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("DeviceDivide: unknown data type ", static_cast<uint32_t>(dtype)));
  }
  if (divisor < 1) {
    return absl::InvalidArgumentError(absl::StrCat("DeviceDivide: divisor ", divisor));
  }
  if (count > SIZE_MAX / size) {
    return absl::InvalidArgumentError(absl::StrCat("DeviceDivide: count ", count, " too large"));
  }
  if (count == 0) return absl::OkStatus();
  if (data == nullptr) return absl::InvalidArgumentError("DeviceDivide: null buffer");
  if (!AlignedTo(data, size)) {
    return absl::InvalidArgumentError(
        absl::StrCat("DeviceDivide: buffer not aligned to its ", size, "-byte elements"));
  }
  return absl::OkStatus();
}

namespace {

// The cast codecs take float32 and their own 16-bit format.
absl::Status CheckCastDtype(CastFormat format, DataType dtype, DataType* narrow,
                            const char** name) {
  *name = format == CastFormat::kFp16 ? "fp16" : "bf16";
  *narrow = format == CastFormat::kFp16 ? DataType::kFloat16 : DataType::kBFloat16;
  if (dtype != DataType::kFloat32 && dtype != *narrow) {
    return absl::InvalidArgumentError(
        absl::StrCat("codec ", *name, ": dtype ", static_cast<uint32_t>(dtype),
                     " is not supported (float32 and its own format)"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status CheckCastEncode(CastFormat format, DataType dtype, const void* in, size_t count,
                             const void* out) {
  DataType narrow;
  const char* name;
  if (absl::Status s = CheckCastDtype(format, dtype, &narrow, &name); !s.ok()) return s;
  if (count > SIZE_MAX / 4) return absl::InvalidArgumentError("codec cast: count too large");
  if (count == 0) return absl::OkStatus();
  if (!AlignedTo(in, dtype == narrow ? 2 : 4) || !AlignedTo(out, 2) || in == nullptr ||
      out == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat("codec ", name, ": null or misaligned buffer"));
  }
  return absl::OkStatus();
}

absl::Status CheckCastDecode(CastFormat format, DataType dtype, const void* in, size_t bytes,
                             size_t count, const void* out) {
  DataType narrow;
  const char* name;
  if (absl::Status s = CheckCastDtype(format, dtype, &narrow, &name); !s.ok()) return s;
  if (count > SIZE_MAX / 2 || bytes != 2 * count) {
    return absl::InvalidArgumentError(absl::StrCat("codec ", name, ": ", bytes, " bytes for ",
                                                   count, " elements (expected 2 per element)"));
  }
  if (count == 0) return absl::OkStatus();
  if (!AlignedTo(in, 2) || !AlignedTo(out, dtype == narrow ? 2 : 4) || in == nullptr ||
      out == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat("codec ", name, ": null or misaligned buffer"));
  }
  return absl::OkStatus();
}

absl::Status CheckWorkspace(const char* codec, const void* workspace, size_t have, size_t need) {
  if (have < need) {
    return absl::InvalidArgumentError(
        absl::StrCat("codec ", codec, ": workspace of ", have, " bytes, ", need, " needed"));
  }
  if (need != 0 && (workspace == nullptr || !AlignedTo(workspace, 256))) {
    return absl::InvalidArgumentError(
        absl::StrCat("codec ", codec, ": workspace must be 256-byte aligned device memory"));
  }
  return absl::OkStatus();
}

absl::Status CheckInt8Encode(DataType dtype, const void* in, size_t count, const void* out,
                             const uint64_t* encoded_bytes) {
  const size_t size = FloatSize(dtype);
  if (size == 0) return NotAFloatFormat("int8", dtype);
  if (encoded_bytes == nullptr || !AlignedTo(encoded_bytes, 8)) {
    return absl::InvalidArgumentError(
        "codec int8: the encoded size needs an 8-byte aligned device word");
  }
  if (count == 0) return absl::OkStatus();
  if (in == nullptr || !AlignedTo(in, size) || out == nullptr || !AlignedTo(out, 4)) {
    return absl::InvalidArgumentError(
        "codec int8: null or misaligned buffer (input aligned to its "
        "elements, output to 4 bytes)");
  }
  return absl::OkStatus();
}

absl::Status CheckInt8Decode(DataType dtype, const void* in, size_t bytes, size_t count,
                             const void* out) {
  const size_t size = FloatSize(dtype);
  if (size == 0) return NotAFloatFormat("int8", dtype);
  if (count == 0) {
    if (bytes != 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("codec int8: ", bytes, " trailing bytes after 0 elements"));
    }
    return absl::OkStatus();
  }
  if (in == nullptr || !AlignedTo(in, 4) || out == nullptr || !AlignedTo(out, size)) {
    return absl::InvalidArgumentError(
        "codec int8: null or misaligned buffer (input aligned to 4 "
        "bytes, output to its elements)");
  }
  return absl::OkStatus();
}

absl::Status CheckTopKEncode(DataType dtype, const void* in, size_t count, size_t k,
                             const void* out) {
  const size_t size = FloatSize(dtype);
  if (size == 0) return NotAFloatFormat("topk", dtype);
  if (count > UINT32_MAX) {
    return absl::InvalidArgumentError(
        absl::StrCat("codec topk: ", count, " elements (limit 2^32 - 1)"));
  }
  if (count == 0 ? k != 0 : (k < 1 || k > count)) {
    return absl::InvalidArgumentError(
        absl::StrCat("codec topk: k = ", k, " for ", count, " elements"));
  }
  if (count == 0) return absl::OkStatus();
  if (in == nullptr || !AlignedTo(in, size) || out == nullptr || !AlignedTo(out, 4)) {
    return absl::InvalidArgumentError(
        "codec topk: null or misaligned buffer (input aligned to "
        "its elements, output to 4 bytes)");
  }
  return absl::OkStatus();
}

absl::Status CheckTopKDecode(DataType dtype, const void* in, size_t bytes, size_t count,
                             const void* out) {
  const size_t size = FloatSize(dtype);
  if (size == 0) return NotAFloatFormat("topk", dtype);
  const size_t pair = kIndexBytes + size;
  if (bytes % pair != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "codec topk: ", bytes, " bytes is not a whole number of ", pair, "-byte entries"));
  }
  const size_t k = bytes / pair;
  if (k > count) {
    return absl::InvalidArgumentError(
        absl::StrCat("codec topk: ", k, " entries for ", count, " elements"));
  }
  if (count == 0) return absl::OkStatus();
  if ((k != 0 && (in == nullptr || !AlignedTo(in, 4))) || out == nullptr || !AlignedTo(out, size)) {
    return absl::InvalidArgumentError(
        "codec topk: null or misaligned buffer (input aligned to 4 "
        "bytes, output to its elements)");
  }
  return absl::OkStatus();
}

absl::Status CheckErrorFeedback(size_t count, const void* a, const void* b, const void* c) {
  if (count != 0 && (a == nullptr || b == nullptr || c == nullptr)) {
    return absl::InvalidArgumentError("error feedback: null buffer");
  }
  return absl::OkStatus();
}

}  // namespace ciuic::daemon::gpu
