// Codec "bf16": float32 -> bfloat16 (the top 16 bits, round to nearest even,
// overflow to +-Inf, NaN kept and quiet; see reduce/half.h). bfloat16 input
// travels as is. Relative error <= 2^-8 for normal floats (float32's whole
// exponent range; 8 significant bits).
#include "compression/codec_cast.h"

namespace ciuic::daemon {
namespace codec_internal {

std::unique_ptr<Codec> MakeBf16Codec() {
  return std::make_unique<CastCodec<BF16>>("bf16", "float32, bfloat16");
}

}  // namespace codec_internal
}  // namespace ciuic::daemon
