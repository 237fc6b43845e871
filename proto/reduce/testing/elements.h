// For tests: element i of a buffer of any wire::DataType, written from and
// read as a double (16-bit floats through float32, integers truncated), so
// that a test can fill buffers and compare results with a plain loop in
// double, for every dtype alike. Header-only; not part of the daemon.
#pragma once

#include <cstddef>
#include <cstdint>

#include "ciuic/shm_layout.h"
#include "reduce/half.h"

namespace ciuic::reduce::testing {

inline void PutElement(wire::DataType t, void* buf, size_t i, double v) {
  switch (t) {
    case wire::DataType::kFloat32: static_cast<float*>(buf)[i] = static_cast<float>(v); return;
    case wire::DataType::kFloat64: static_cast<double*>(buf)[i] = v; return;
    case wire::DataType::kFloat16:
      static_cast<uint16_t*>(buf)[i] = FloatToHalf(static_cast<float>(v));
      return;
    case wire::DataType::kBFloat16:
      static_cast<uint16_t*>(buf)[i] = FloatToBFloat16(static_cast<float>(v));
      return;
    case wire::DataType::kInt8: static_cast<int8_t*>(buf)[i] = static_cast<int8_t>(v); return;
    case wire::DataType::kUInt8: static_cast<uint8_t*>(buf)[i] = static_cast<uint8_t>(v); return;
    case wire::DataType::kInt32: static_cast<int32_t*>(buf)[i] = static_cast<int32_t>(v); return;
    case wire::DataType::kInt64: static_cast<int64_t*>(buf)[i] = static_cast<int64_t>(v); return;
  }
}

inline double GetElement(wire::DataType t, const void* buf, size_t i) {
  switch (t) {
    case wire::DataType::kFloat32: return static_cast<const float*>(buf)[i];
    case wire::DataType::kFloat64: return static_cast<const double*>(buf)[i];
    case wire::DataType::kFloat16: return HalfToFloat(static_cast<const uint16_t*>(buf)[i]);
    case wire::DataType::kBFloat16: return BFloat16ToFloat(static_cast<const uint16_t*>(buf)[i]);
    case wire::DataType::kInt8: return static_cast<const int8_t*>(buf)[i];
    case wire::DataType::kUInt8: return static_cast<const uint8_t*>(buf)[i];
    case wire::DataType::kInt32: return static_cast<const int32_t*>(buf)[i];
    case wire::DataType::kInt64: return static_cast<double>(static_cast<const int64_t*>(buf)[i]);
  }
  return 0;
}

// v as the dtype stores it, read back.
inline double Stored(wire::DataType t, double v) {
  alignas(8) uint8_t b[8];
  PutElement(t, b, 0, v);
  return GetElement(t, b, 0);
}

}  // namespace ciuic::reduce::testing
