// Codec "fp16": float32 -> IEEE binary16 (round to nearest even, overflow to
// +-Inf, NaN kept and quiet; see reduce/half.h). float16 input travels as is.
// Relative error <= 2^-11 in the normal range of binary16 (2^-14 <= |x| <=
// 65504); absolute error <= 2^-25 below it.
#include "compression/codec_cast.h"

namespace ciuic::daemon {
namespace codec_internal {

std::unique_ptr<Codec> MakeFp16Codec() {
  return std::make_unique<CastCodec<F16>>("fp16", "float32, float16");
}

}  // namespace codec_internal
}  // namespace ciuic::daemon
