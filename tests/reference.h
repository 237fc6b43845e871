// Independent reference for the integration tests: plain loops, the
// compiler's own _Float16 for float16, and a textbook round-to-nearest-even
// for bfloat16. Never calls ciuic code.
//
// Semantics (the daemon's contract, daemon/reduce/README.md): inputs are
// folded left to right in rank order; float32/float64 accumulate in their
// own type, float16/bfloat16 in float32 and round once; integers wrap; avg
// is sum / n (integers: truncating division of the wrapped sum).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "ciuic/ciuic.h"

namespace ciuic::testing {

inline float BFloatToFloat(uint16_t b) {
  uint32_t bits = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline uint16_t FloatToBFloat(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  if (std::isnan(f)) return static_cast<uint16_t>((bits >> 16) | 0x40);
  uint32_t lsb = (bits >> 16) & 1;
  bits += 0x7fff + lsb;
  return static_cast<uint16_t>(bits >> 16);
}

inline float HalfToFloat(uint16_t h) {
  _Float16 v;
  std::memcpy(&v, &h, 2);
  return static_cast<float>(v);
}

inline uint16_t FloatToHalf(float f) {
  _Float16 v = static_cast<_Float16>(f);
  uint16_t h;
  std::memcpy(&h, &v, 2);
  return h;
}

template <typename T, typename Acc, typename Load, typename StoreFn>
void FoldFloat(ReduceOp op, const std::vector<const void*>& in, void* out, size_t count,
               Load load, StoreFn store) {
  const size_t n = in.size();
  for (size_t i = 0; i < count; ++i) {
    Acc acc = load(static_cast<const T*>(in[0])[i]);
    for (size_t k = 1; k < n; ++k) {
      Acc v = load(static_cast<const T*>(in[k])[i]);
      switch (op) {
        case ReduceOp::kSum:
        case ReduceOp::kAvg: acc = acc + v; break;
        case ReduceOp::kProd: acc = acc * v; break;
        case ReduceOp::kMin: acc = (std::isnan(acc) || std::isnan(v)) ? NAN : (v < acc ? v : acc); break;
        case ReduceOp::kMax: acc = (std::isnan(acc) || std::isnan(v)) ? NAN : (v > acc ? v : acc); break;
      }
    }
    if (op == ReduceOp::kAvg) acc = acc / static_cast<Acc>(n);
    static_cast<T*>(out)[i] = store(acc);
  }
}

template <typename T>
void FoldInt(ReduceOp op, const std::vector<const void*>& in, void* out, size_t count) {
  using U = std::make_unsigned_t<T>;
  const size_t n = in.size();
  for (size_t i = 0; i < count; ++i) {
    T acc = static_cast<const T*>(in[0])[i];
    for (size_t k = 1; k < n; ++k) {
      T v = static_cast<const T*>(in[k])[i];
      switch (op) {
        case ReduceOp::kSum:
        case ReduceOp::kAvg: acc = static_cast<T>(static_cast<U>(acc) + static_cast<U>(v)); break;
        case ReduceOp::kProd: acc = static_cast<T>(static_cast<U>(acc) * static_cast<U>(v)); break;
        case ReduceOp::kMin: acc = v < acc ? v : acc; break;
        case ReduceOp::kMax: acc = v > acc ? v : acc; break;
      }
    }
    if (op == ReduceOp::kAvg) {
      if constexpr (std::is_signed_v<T>) {
        acc = static_cast<T>(static_cast<int64_t>(acc) / static_cast<int64_t>(n));
      } else {
        acc = static_cast<T>(static_cast<uint64_t>(acc) / static_cast<uint64_t>(n));
      }
    }
    static_cast<T*>(out)[i] = acc;
  }
}

inline void ReferenceReduce(DataType t, ReduceOp op, const std::vector<const void*>& in,
                            void* out, size_t count) {
  switch (t) {
    case DataType::kFloat32:
      return FoldFloat<float, float>(op, in, out, count, [](float v) { return v; },
                                     [](float v) { return v; });
    case DataType::kFloat64:
      return FoldFloat<double, double>(op, in, out, count, [](double v) { return v; },
                                       [](double v) { return v; });
    case DataType::kFloat16:
      return FoldFloat<uint16_t, float>(op, in, out, count, HalfToFloat, FloatToHalf);
    case DataType::kBFloat16:
      return FoldFloat<uint16_t, float>(op, in, out, count, BFloatToFloat, FloatToBFloat);
    case DataType::kInt8: return FoldInt<int8_t>(op, in, out, count);
    case DataType::kUInt8: return FoldInt<uint8_t>(op, in, out, count);
    case DataType::kInt32: return FoldInt<int32_t>(op, in, out, count);
    case DataType::kInt64: return FoldInt<int64_t>(op, in, out, count);
  }
}

// Deterministic test data for rank `rank`, element i: varied fractions for
// floats (so accumulation order and rounding matter), small integers that
// wrap int8/uint8 sums, values near 1 for prod.
inline void FillInput(DataType t, ReduceOp op, int rank, void* out, size_t count,
                      uint64_t salt = 0) {
  for (size_t i = 0; i < count; ++i) {
    const uint64_t h = (i + salt) * 2654435761u + static_cast<uint64_t>(rank) * 97u + 13;
    const bool prod = op == ReduceOp::kProd;
    const double f = prod ? ((h % 4 == 0) ? 2.0 : (h % 4 == 1 ? 0.5 : (h % 4 == 2 ? -1.0 : 1.0)))
                          : (static_cast<double>(h % 20011) - 10005.0) / 97.0;
    const int64_t k = prod ? ((h % 3 == 0) ? 3 : (h % 3 == 1 ? -1 : 1))
                           : static_cast<int64_t>(h % 251) - 125;
    switch (t) {
      case DataType::kFloat32: static_cast<float*>(out)[i] = static_cast<float>(f); break;
      case DataType::kFloat64: static_cast<double*>(out)[i] = f; break;
      case DataType::kFloat16: static_cast<uint16_t*>(out)[i] = FloatToHalf(static_cast<float>(f)); break;
      case DataType::kBFloat16: static_cast<uint16_t*>(out)[i] = FloatToBFloat(static_cast<float>(f)); break;
      case DataType::kInt8: static_cast<int8_t*>(out)[i] = static_cast<int8_t>(k); break;
      case DataType::kUInt8: static_cast<uint8_t*>(out)[i] = static_cast<uint8_t>(k); break;
      case DataType::kInt32: static_cast<int32_t*>(out)[i] = static_cast<int32_t>(k * 1000003); break;
      case DataType::kInt64: static_cast<int64_t*>(out)[i] = k * 1000000007LL; break;
    }
  }
}

// Small integers: exact in every dtype and through any order of reduction,
// so every rank's result must equal the reference bit for bit, whatever
// path (fused, staged through the host, several nodes) the data took.
inline void FillSmall(DataType t, ReduceOp op, int rank, void* out, size_t count) {
  for (size_t i = 0; i < count; ++i) {
    const uint64_t h = i * 2654435761u + static_cast<uint64_t>(rank) * 97u + 13;
    int64_t v = op == ReduceOp::kProd ? ((h % 5 == 0) ? 2 : ((h % 7 == 0) ? -1 : 1))
                                      : static_cast<int64_t>(h % 15) - 7;
    if (t == DataType::kUInt8 && v < 0) v = -v;
    switch (t) {
      case DataType::kFloat32: static_cast<float*>(out)[i] = static_cast<float>(v); break;
      case DataType::kFloat64: static_cast<double*>(out)[i] = static_cast<double>(v); break;
      case DataType::kFloat16: static_cast<uint16_t*>(out)[i] = FloatToHalf(static_cast<float>(v)); break;
      case DataType::kBFloat16: static_cast<uint16_t*>(out)[i] = FloatToBFloat(static_cast<float>(v)); break;
      case DataType::kInt8: static_cast<int8_t*>(out)[i] = static_cast<int8_t>(v); break;
      case DataType::kUInt8: static_cast<uint8_t*>(out)[i] = static_cast<uint8_t>(v); break;
      case DataType::kInt32: static_cast<int32_t*>(out)[i] = static_cast<int32_t>(v); break;
      case DataType::kInt64: static_cast<int64_t*>(out)[i] = v; break;
    }
  }
}

enum class Coll { kAllreduce, kReduceScatter, kAllgather, kBroadcast, kAlltoall };

inline const char* CollName(Coll c) {
  switch (c) {
    case Coll::kAllreduce: return "allreduce";
    case Coll::kReduceScatter: return "reduce_scatter";
    case Coll::kAllgather: return "allgather";
    case Coll::kBroadcast: return "broadcast";
    case Coll::kAlltoall: return "alltoall";
  }
  return "?";
}

// What rank `rank` of `world` must receive from `coll` of `count` elements
// (per rank block for reduce_scatter / allgather / alltoall) when rank r's send buffer
// is what fill(r, out, elements) writes; root is broadcast's.
template <typename Fill>
std::vector<uint8_t> ReferenceCollective(Coll coll, DataType t, ReduceOp op, int world, int rank,
                                         int root, size_t count, Fill fill) {
  const size_t es = DataTypeSize(t);
  const size_t send_count = coll == Coll::kReduceScatter || coll == Coll::kAlltoall ? count * world : count;
  const size_t recv_count = coll == Coll::kAllgather || coll == Coll::kAlltoall ? count * world : count;
  std::vector<std::vector<uint8_t>> in(world);
  for (int r = 0; r < world; ++r) {
    in[r].resize(send_count * es + 1);
    fill(r, in[r].data(), send_count);
  }
  std::vector<uint8_t> want(recv_count * es + 1);
  std::vector<const void*> ptrs;
  switch (coll) {
    case Coll::kAllreduce:
    case Coll::kReduceScatter: {
      const size_t offset = coll == Coll::kReduceScatter ? rank * count * es : 0;
      for (int r = 0; r < world; ++r) ptrs.push_back(in[r].data() + offset);
      ReferenceReduce(t, op, ptrs, want.data(), count);
      break;
    }
    case Coll::kAllgather:
      for (int r = 0; r < world; ++r) std::memcpy(want.data() + r * count * es, in[r].data(), count * es);
      break;
    case Coll::kBroadcast:
      std::memcpy(want.data(), in[root].data(), count * es);
      break;
    case Coll::kAlltoall:  // block r from rank r's block for this rank
      for (int r = 0; r < world; ++r) {
        std::memcpy(want.data() + r * count * es, in[r].data() + rank * count * es, count * es);
      }
      break;
  }
  return want;
}

inline constexpr DataType kAllDataTypes[] = {
    DataType::kFloat32, DataType::kFloat64, DataType::kFloat16, DataType::kBFloat16,
    DataType::kInt8,    DataType::kUInt8,   DataType::kInt32,   DataType::kInt64};
inline constexpr ReduceOp kAllReduceOps[] = {ReduceOp::kSum, ReduceOp::kAvg, ReduceOp::kMin,
                                             ReduceOp::kMax, ReduceOp::kProd};

}  // namespace ciuic::testing
