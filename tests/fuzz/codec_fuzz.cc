// Fuzz target: the codecs (daemon/compression) on what another node's
// daemon sends, which they must treat as untrusted network input, and on
// any data a trainer hands them.
//
// Input: codec, dtype, top-k ratio, element count, mode, then the payload.
// Mode "decode": the payload is a received encoding. Validate, Decode and
// DecodeAdd must agree exactly (the device path decodes what Validate
// passed as trusted, so a Validate that passes what Decode refuses would
// let a peer fault the daemon's GPU); a refused encoding leaves the output
// untouched; an accepted one fits MaxEncodedBytes, decodes to the same
// elements whatever the output held before, and DecodeAdd is Decode
// followed by Reduce's sum, bit for bit. Mode "round trip": the payload is
// elements (any bits: NaN, Inf, denormals). The encoding fits
// MaxEncodedBytes (an exact-size buffer, so a sanitizer sees any write
// past it), validates, decodes, is refused when one byte short, and splits
// at any multiple of SplitGranule into the concatenation of its parts'
// encodings. Mode "damaged": a real encoding with bytes changed, cut short
// or lengthened, checked as in "decode" (the cases a random payload rarely
// reaches: valid headers, plausible indices).
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "compression/codec.h"
#include "fuzz_input.h"
#include "reduce/half.h"
#include "reduce/reduce.h"

namespace {

constexpr const char* kTarget = "codec_fuzz";
constexpr size_t kMaxCount = 2048;

using ciuic::daemon::Codec;
using ciuic::daemon::CodecKind;
using ciuic::daemon::CodecSpec;
namespace wire = ciuic::wire;

bool SameStatus(const absl::Status& a, const absl::Status& b) {
  return a.code() == b.code() && a.message() == b.message();
}

// Finite, non-zero elements of `dtype` (so that adding +0 leaves them as
// they are, bit for bit), different for every `salt`.
std::vector<uint8_t> Accumulator(wire::DataType dtype, size_t count, unsigned salt) {
  const size_t es = wire::DataTypeSize(static_cast<uint32_t>(dtype));
  std::vector<uint8_t> out(count * es);
  for (size_t i = 0; i < count; ++i) {
    const int v = static_cast<int>((i * 7 + salt) % 13) + 1;  // 1..13
    uint8_t* p = out.data() + i * es;
    switch (dtype) {
      case wire::DataType::kFloat32: {
        const float f = static_cast<float>(v) * 0.375f;
        std::memcpy(p, &f, 4);
        break;
      }
      case wire::DataType::kFloat64: {
        const double d = v * 0.375;
        std::memcpy(p, &d, 8);
        break;
      }
      case wire::DataType::kFloat16: {  // 1.0 .. 13.0: exact in 16 bits
        const uint16_t h = ciuic::reduce::FloatToHalf(static_cast<float>(v));
        std::memcpy(p, &h, 2);
        break;
      }
      case wire::DataType::kBFloat16: {
        const uint16_t b = ciuic::reduce::FloatToBFloat16(static_cast<float>(v));
        std::memcpy(p, &b, 2);
        break;
      }
      default: {  // integers: v in the low byte, the rest zero
        std::memset(p, 0, es);
        p[0] = static_cast<uint8_t>(v);
        break;
      }
    }
  }
  return out;
}

void CheckDecode(const Codec& codec, wire::DataType dtype, size_t count, const uint8_t* in,
                 size_t bytes) {
  const size_t es = wire::DataTypeSize(static_cast<uint32_t>(dtype));
  const absl::Status valid = codec.Validate(dtype, in, bytes, count);

  std::vector<uint8_t> out_a = Accumulator(dtype, count, 1);
  std::vector<uint8_t> out_b = Accumulator(dtype, count, 5);
  const std::vector<uint8_t> before_a = out_a, before_b = out_b;
  const absl::Status da = codec.Decode(dtype, in, bytes, count, out_a.data());
  const absl::Status db = codec.Decode(dtype, in, bytes, count, out_b.data());
  FUZZ_CHECK(SameStatus(valid, da), "Validate and Decode disagree");
  FUZZ_CHECK(SameStatus(da, db), "Decode's verdict depends on what the output held");

  std::vector<uint8_t> acc = Accumulator(dtype, count, 3);
  const std::vector<uint8_t> acc0 = acc;
  const absl::Status add = codec.DecodeAdd(dtype, in, bytes, count, acc.data());
  FUZZ_CHECK(SameStatus(valid, add), "Validate and DecodeAdd disagree");

  if (!valid.ok()) {
    FUZZ_CHECK(!valid.message().empty(), "a refusal without a message");
    FUZZ_CHECK(out_a == before_a && out_b == before_b, "a refused Decode wrote its output");
    FUZZ_CHECK(acc == acc0, "a refused DecodeAdd wrote its accumulator");
    return;
  }
  FUZZ_CHECK(bytes <= codec.MaxEncodedBytes(dtype, count), "accepted more than MaxEncodedBytes");
  FUZZ_CHECK(out_a == out_b, "Decode left elements depending on what the output held");
  // DecodeAdd = Decode, then Reduce's sum (acc is finite and non-zero, so
  // top-k's untouched elements are acc + 0 = acc too).
  std::vector<uint8_t> want(count * es);
  const void* inputs[2] = {acc0.data(), out_a.data()};
  if (count > 0) {
    ciuic::reduce::Reduce(dtype, wire::ReduceOp::kSum, inputs, 2, want.data(), count);
  }
  FUZZ_CHECK(acc == want, "DecodeAdd is not Decode followed by Reduce's sum");
}

std::vector<uint8_t> Encode(const Codec& codec, wire::DataType dtype, const uint8_t* elements,
                            size_t count) {
  std::vector<uint8_t> out(codec.MaxEncodedBytes(dtype, count));  // exact: overflow is seen
  const size_t n = codec.Encode(dtype, elements, count, out.data());
  FUZZ_CHECK(n <= out.size(), "Encode wrote more than MaxEncodedBytes");
  out.resize(n);
  return out;
}

void CheckRoundTrip(const Codec& codec, wire::DataType dtype, size_t count,
                    const std::vector<uint8_t>& elements, size_t split_choice) {
  const std::vector<uint8_t> enc = Encode(codec, dtype, elements.data(), count);
  FUZZ_CHECK(codec.TypicalEncodedBytes(dtype, count) <= codec.MaxEncodedBytes(dtype, count),
             "TypicalEncodedBytes above MaxEncodedBytes");
  FUZZ_CHECK(codec.Validate(dtype, enc.data(), enc.size(), count).ok(),
             "an encoding of Encode's does not validate");
  CheckDecode(codec, dtype, count, enc.data(), enc.size());
  if (!enc.empty()) {
    FUZZ_CHECK(!codec.Validate(dtype, enc.data(), enc.size() - 1, count).ok(),
               "an encoding one byte short validates");
  }
  const size_t g = codec.SplitGranule();
  if (g > 0 && count > 0) {
    const size_t a = std::min(count, split_choice % (count / g + 1) * g);
    const size_t es = wire::DataTypeSize(static_cast<uint32_t>(dtype));
    std::vector<uint8_t> joined = Encode(codec, dtype, elements.data(), a);
    const std::vector<uint8_t> tail = Encode(codec, dtype, elements.data() + a * es, count - a);
    joined.insert(joined.end(), tail.begin(), tail.end());
    FUZZ_CHECK(joined == enc, "the encoding is not the concatenation of its parts' (SplitGranule)");
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  ciuic::fuzz::Input input(data, size);
  static constexpr CodecKind kKinds[] = {CodecKind::kNone, CodecKind::kFp16, CodecKind::kBf16,
                                         CodecKind::kInt8, CodecKind::kTopK};
  CodecSpec spec;
  spec.kind = kKinds[input.Byte() % 5];
  const wire::DataType dtype = wire::kAllDataTypes[input.Byte() % 8];
  const uint8_t ratio = input.Byte();
  if (spec.kind == CodecKind::kTopK) spec.topk_ratio = (ratio % 100 + 1) / 100.0;
  size_t count = input.U16() % (kMaxCount + 1);
  const uint8_t mode = input.Byte();
  const std::unique_ptr<Codec> codec = ciuic::daemon::MakeCodec(spec);
  const size_t es = wire::DataTypeSize(static_cast<uint32_t>(dtype));

  if (!codec->Supports(dtype).ok()) {
    FUZZ_CHECK(
        codec->MaxEncodedBytes(dtype, count) == 0 && codec->TypicalEncodedBytes(dtype, count) == 0,
        "sizes for a dtype the codec does not take");
    FUZZ_CHECK(!codec->Validate(dtype, input.rest(), input.rest_size(), count).ok(),
               "an encoding of a dtype the codec does not take validates");
    CheckDecode(*codec, dtype, count, input.rest(), input.rest_size());
    return 0;
  }
  switch (mode % 3) {
    case 0: {
      // Received bytes, at an offset of 0..7 from an aligned address.
      const size_t offset = (mode / 3) % 8;
      std::vector<uint8_t> in(offset + input.rest_size());
      if (input.rest_size() > 0) std::memcpy(in.data() + offset, input.rest(), input.rest_size());
      CheckDecode(*codec, dtype, count, in.data() + offset, input.rest_size());
      break;
    }
    case 1: {
      count = std::min(count, input.rest_size() / es);
      std::vector<uint8_t> elements(count * es);
      if (!elements.empty()) std::memcpy(elements.data(), input.rest(), elements.size());
      CheckRoundTrip(*codec, dtype, count, elements, mode / 3);
      break;
    }
    case 2: {
      // A real encoding, damaged: up to 7 bytes changed, then cut short or
      // lengthened by up to 127 bytes.
      const int edits = mode / 3 % 8;
      uint16_t at[8];
      uint8_t value[8];
      for (int i = 0; i < edits; ++i) {
        at[i] = input.U16();
        value[i] = input.Byte();
      }
      const int8_t resize = static_cast<int8_t>(input.Byte());
      count = std::min(count, input.rest_size() / es);
      std::vector<uint8_t> elements(count * es);
      if (!elements.empty()) std::memcpy(elements.data(), input.rest(), elements.size());
      std::vector<uint8_t> enc = Encode(*codec, dtype, elements.data(), count);
      for (int i = 0; i < edits && !enc.empty(); ++i) enc[at[i] % enc.size()] = value[i];
      if (resize < 0) {
        enc.resize(enc.size() - std::min<size_t>(enc.size(), static_cast<size_t>(-resize)));
      } else {
        enc.resize(enc.size() + static_cast<size_t>(resize), static_cast<uint8_t>(resize));
      }
      CheckDecode(*codec, dtype, count, enc.data(), enc.size());
      break;
    }
  }
  return 0;
}
