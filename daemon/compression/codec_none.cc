// Codec "none": the elements as they are (a copy), so that the collectives
// can treat compressed and uncompressed chunks alike. Every dtype; wire size
// count * element size.
#include <cstring>

#include "absl/strings/str_cat.h"
#include "compression/codec_internal.h"

namespace ciuic::daemon {
namespace codec_internal {
namespace {

class NoneCodec final : public Codec {
 public:
  absl::Status Supports(wire::DataType dtype) const override {
    if (ElementSize(dtype) == 0) return Unsupported("none", dtype, "every ciuic dtype");
    return absl::OkStatus();
  }

  size_t MaxEncodedBytes(wire::DataType dtype, size_t count) const override {
    return ElementSize(dtype) * count;
  }

  size_t SplitGranule() const override { return 1; }

  size_t Encode(wire::DataType dtype, const void* in, size_t count, void* out) const override {
    const size_t bytes = ElementSize(dtype) * count;
    if (bytes == 0 && count != 0) BrokenInvariant("none", "Encode of an unsupported dtype");
    if (bytes != 0) std::memcpy(out, in, bytes);
    return bytes;
  }

  absl::Status Validate(wire::DataType dtype, const void*, size_t bytes,
                        size_t count) const override {
    return Check(dtype, bytes, count);
  }

  absl::Status Decode(wire::DataType dtype, const void* in, size_t bytes, size_t count,
                      void* out) const override {
    if (absl::Status s = Check(dtype, bytes, count); !s.ok()) return s;
    if (bytes != 0) std::memcpy(out, in, bytes);
    return absl::OkStatus();
  }

  absl::Status DecodeAdd(wire::DataType dtype, const void* in, size_t bytes, size_t count,
                         void* acc) const override {
    if (absl::Status s = Check(dtype, bytes, count); !s.ok()) return s;
    AddRaw(dtype, in, count, acc);
    return absl::OkStatus();
  }

 private:
  static size_t ElementSize(wire::DataType dtype) {
    return wire::DataTypeSize(static_cast<uint32_t>(dtype));
  }

  absl::Status Check(wire::DataType dtype, size_t bytes, size_t count) const {
    if (absl::Status s = Supports(dtype); !s.ok()) return s;
    if (count > SIZE_MAX / ElementSize(dtype) || bytes != ElementSize(dtype) * count) {
      return absl::InvalidArgumentError(absl::StrCat("codec none: ", bytes, " bytes for ", count,
                                                     " elements of ", ElementSize(dtype),
                                                     " bytes"));
    }
    return absl::OkStatus();
  }
};

}  // namespace

std::unique_ptr<Codec> MakeNoneCodec() { return std::make_unique<NoneCodec>(); }

}  // namespace codec_internal
}  // namespace ciuic::daemon
