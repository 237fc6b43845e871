// The 16-bit cast codecs (codec_fp16.cc, codec_bf16.cc) share this template:
// float32 elements travel as 16-bit floats (2 bytes each, no header), rounded
// to nearest even by half.h; elements already in the 16-bit format travel
// unchanged. Internal to the area.
#pragma once

#include <cstdint>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "compression/codec_internal.h"

namespace ciuic::daemon {
namespace codec_internal {

// Narrow is F16 or BF16 (codec_internal.h).
template <typename Narrow>
class CastCodec final : public Codec {
 public:
  // name: "fp16"; supported: the text Supports() lists.
  CastCodec(const char* name, const char* supported) : name_(name), supported_(supported) {}

  absl::Status Supports(wire::DataType dtype) const override {
    if (dtype == wire::DataType::kFloat32 || dtype == Narrow::kType) return absl::OkStatus();
    return Unsupported(name_, dtype, supported_);
  }

  size_t MaxEncodedBytes(wire::DataType dtype, size_t count) const override {
    return Supports(dtype).ok() ? 2 * count : 0;
  }

  size_t SplitGranule() const override { return 1; }

  size_t Encode(wire::DataType dtype, const void* in, size_t count, void* out) const override {
    if (dtype == Narrow::kType) {
      if (count != 0) std::memcpy(out, in, 2 * count);
    } else if (dtype == wire::DataType::kFloat32) {
      EncodeFloat32(static_cast<const float*>(in), count, static_cast<unsigned char*>(out));
    } else {
      BrokenInvariant(name_, "Encode of an unsupported dtype");
    }
    return 2 * count;
  }

  absl::Status Validate(wire::DataType dtype, const void*, size_t bytes,
                        size_t count) const override {
    return Check(dtype, bytes, count);
  }

  absl::Status Decode(wire::DataType dtype, const void* in, size_t bytes, size_t count,
                      void* out) const override {
    if (absl::Status s = Check(dtype, bytes, count); !s.ok()) return s;
    if (dtype == Narrow::kType) {
      if (count != 0) std::memcpy(out, in, bytes);
    } else {
      DecodeFloat32(static_cast<const unsigned char*>(in), count, static_cast<float*>(out));
    }
    return absl::OkStatus();
  }

  absl::Status DecodeAdd(wire::DataType dtype, const void* in, size_t bytes, size_t count,
                         void* acc) const override {
    if (absl::Status s = Check(dtype, bytes, count); !s.ok()) return s;
    if (dtype == Narrow::kType) {
      AddRaw(dtype, in, count, acc);
    } else {
      DecodeAddFloat32(static_cast<const unsigned char*>(in), count, static_cast<float*>(acc));
    }
    return absl::OkStatus();
  }

 private:
  absl::Status Check(wire::DataType dtype, size_t bytes, size_t count) const {
    if (absl::Status s = Supports(dtype); !s.ok()) return s;
    if (count > SIZE_MAX / 2 || bytes != 2 * count) {
      return absl::InvalidArgumentError(absl::StrCat("codec ", name_, ": ", bytes, " bytes for ",
                                                     count, " elements (expected 2 per element)"));
    }
    return absl::OkStatus();
  }

  // The hot loops (vectorised with baseline SSE2, see README.md).
  static void EncodeFloat32(const float* in, size_t count, unsigned char* out) {
    for (size_t i = 0; i < count; ++i) StoreAt<uint16_t>(out + 2 * i, Narrow::Store(in[i]));
  }
  static void DecodeFloat32(const unsigned char* in, size_t count, float* out) {
    for (size_t i = 0; i < count; ++i) out[i] = Narrow::Load(LoadAt<uint16_t>(in + 2 * i));
  }
  static void DecodeAddFloat32(const unsigned char* in, size_t count, float* acc) {
    for (size_t i = 0; i < count; ++i) acc[i] += Narrow::Load(LoadAt<uint16_t>(in + 2 * i));
  }

  const char* name_;
  const char* supported_;
};

}  // namespace codec_internal
}  // namespace ciuic::daemon
