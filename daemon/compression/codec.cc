// ParseCodec / CodecName / MakeCodec: the registry of codecs (one line per
// codec), and the helpers the codecs share.
#include "compression/codec.h"

#include <algorithm>
#include <charconv>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "compression/codec_internal.h"
#include "reduce/reduce.h"

namespace ciuic::daemon {
namespace {

constexpr absl::string_view kValidCodecs =
    "valid: none, fp16, bf16, int8, topk:RATIO with 0 < RATIO <= 1 (e.g. topk:0.01)";
constexpr absl::string_view kTopKPrefix = "topk:";

bool ValidRatio(double ratio) { return ratio > 0 && ratio <= 1; }

}  // namespace

absl::StatusOr<CodecSpec> ParseCodec(absl::string_view text) {
  const std::string lower = absl::AsciiStrToLower(absl::StripAsciiWhitespace(text));
  CodecSpec spec;
  if (lower == "none") {
    spec.kind = CodecKind::kNone;
  } else if (lower == "fp16") {
    spec.kind = CodecKind::kFp16;
  } else if (lower == "bf16") {
    spec.kind = CodecKind::kBf16;
  } else if (lower == "int8") {
    spec.kind = CodecKind::kInt8;
  } else if (absl::StartsWith(lower, kTopKPrefix)) {
    double ratio = 0;
    const absl::string_view number = absl::string_view(lower).substr(kTopKPrefix.size());
    if (!absl::SimpleAtod(number, &ratio) || !ValidRatio(ratio)) {
      return absl::InvalidArgumentError(absl::StrCat("codec \"", text, "\": top-k ratio \"", number,
                                                     "\" is not a number in (0, 1]; ",
                                                     kValidCodecs));
    }
    spec.kind = CodecKind::kTopK;
    spec.topk_ratio = ratio;
  } else {
    return absl::InvalidArgumentError(absl::StrCat("unknown codec \"", text, "\"; ", kValidCodecs));
  }
  return spec;
}

std::string CodecName(const CodecSpec& spec) {
  switch (spec.kind) {
    case CodecKind::kNone:
      return "none";
    case CodecKind::kFp16:
      return "fp16";
    case CodecKind::kBf16:
      return "bf16";
    case CodecKind::kInt8:
      return "int8";
    case CodecKind::kTopK: {
      // Shortest text that reads back as the same double.
      char buf[64];
      const auto result = std::to_chars(buf, buf + sizeof(buf), spec.topk_ratio);
      return absl::StrCat(kTopKPrefix, absl::string_view(buf, result.ptr - buf));
    }
  }
  return absl::StrCat("codec#", static_cast<int>(spec.kind));
}

std::unique_ptr<Codec> MakeCodec(const CodecSpec& spec) {
  switch (spec.kind) {
    case CodecKind::kNone:
      return codec_internal::MakeNoneCodec();
    case CodecKind::kFp16:
      return codec_internal::MakeFp16Codec();
    case CodecKind::kBf16:
      return codec_internal::MakeBf16Codec();
    case CodecKind::kInt8:
      return codec_internal::MakeInt8Codec();
    case CodecKind::kTopK:
      if (!ValidRatio(spec.topk_ratio)) {
        codec_internal::BrokenInvariant("topk",
                                        absl::StrCat("ratio ", spec.topk_ratio, " outside (0, 1]"));
      }
      return codec_internal::MakeTopKCodec(spec.topk_ratio);
  }
  codec_internal::BrokenInvariant("?", absl::StrCat("unknown kind ", static_cast<int>(spec.kind)));
}

namespace codec_internal {

void AddRaw(wire::DataType dtype, const void* in, size_t count, void* acc) {
  const size_t size = wire::DataTypeSize(static_cast<uint32_t>(dtype));
  if (count == 0) return;
  if (reinterpret_cast<uintptr_t>(in) % size == 0) {
    const void* inputs[] = {acc, in};
    Reduce(dtype, wire::ReduceOp::kSum, inputs, 2, acc, count);
    return;
  }
  // Misaligned (an encoded buffer has no alignment): stage through L1.
  alignas(64) unsigned char staged[16384];
  const size_t per_block = sizeof(staged) / size;
  const auto* src = static_cast<const unsigned char*>(in);
  auto* dst = static_cast<unsigned char*>(acc);
  for (size_t done = 0; done < count;) {
    const size_t n = std::min(per_block, count - done);
    std::memcpy(staged, src + done * size, n * size);
    void* target = dst + done * size;
    const void* inputs[] = {target, staged};
    Reduce(dtype, wire::ReduceOp::kSum, inputs, 2, target, n);
    done += n;
  }
}

absl::Status Unsupported(absl::string_view codec, wire::DataType dtype,
                         absl::string_view supported) {
  const char* name = wire::DataTypeName(static_cast<uint32_t>(dtype));
  return absl::InvalidArgumentError(absl::StrCat(
      "codec ", codec, ": dtype ",
      name != nullptr ? std::string(name) : absl::StrCat("#", static_cast<uint32_t>(dtype)),
      " is not supported (supported: ", supported, ")"));
}

void BrokenInvariant(absl::string_view codec, absl::string_view what) {
  std::fprintf(stderr, "ciuic::daemon codec %.*s: %.*s\n", static_cast<int>(codec.size()),
               codec.data(), static_cast<int>(what.size()), what.data());
  std::abort();
}

}  // namespace codec_internal
}  // namespace ciuic::daemon
