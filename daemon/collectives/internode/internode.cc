// Algorithm choice and avg's final division.
#include <bit>
#include <cstdlib>
#include <cstring>
#include <type_traits>

#include "collectives/internode/internode.h"
#include "reduce/half.h"

namespace ciuic::daemon {
namespace {

// alpha * beta of the inter-node links in bytes: a message of this size
// spends as long on the wire as on its fixed per-message cost (~5 us at
// ~12.5 GB/s). Only the order of magnitude matters for the choice.
constexpr double kAlphaBetaBytes = 64 * 1024;
// Recursive doubling reduces the whole buffer on every node at every round;
// above this its compute cost outweighs the latency it saves.
constexpr size_t kHalvingDoublingMaxBytes = size_t{1} << 20;

template <typename T, typename W>
void DivideIntegers(void* data, size_t count, uint64_t divisor) {
  auto* p = static_cast<T*>(data);
  const W d = static_cast<W>(divisor);
  for (size_t i = 0; i < count; ++i) p[i] = static_cast<T>(static_cast<W>(p[i]) / d);
}

template <typename T>
void DivideFloats(void* data, size_t count, uint64_t divisor) {
  auto* p = static_cast<T*>(data);
  const T d = static_cast<T>(divisor);
  for (size_t i = 0; i < count; ++i) p[i] = p[i] / d;
}

template <float (*Load)(uint16_t), uint16_t (*Store)(float)>
void DivideHalves(void* data, size_t count, uint64_t divisor) {
  auto* p = static_cast<uint16_t*>(data);
  const float d = static_cast<float>(divisor);
  for (size_t i = 0; i < count; ++i) p[i] = Store(Load(p[i]) / d);
}

}  // namespace

InterNodeAlgorithm ChooseAllreduceAlgorithm(int num_nodes, size_t bytes) {
  if (num_nodes <= 1 || bytes > kHalvingDoublingMaxBytes) return InterNodeAlgorithm::kRing;
  const double n = num_nodes;
  const double s = static_cast<double>(bytes);
  const double a = kAlphaBetaBytes;
  const unsigned p = std::bit_floor(static_cast<unsigned>(num_nodes));
  const double hd_steps = std::countr_zero(p) + (p == static_cast<unsigned>(num_nodes) ? 0 : 2);
  const double ring = 2 * (n - 1) * a + 2 * (n - 1) / n * s;
  const double hd = hd_steps * (a + s);
  return hd < ring ? InterNodeAlgorithm::kHalvingDoubling : InterNodeAlgorithm::kRing;
}

absl::Status Allreduce(const InterNodeContext& ctx, InterNodeAlgorithm algo, wire::DataType dtype,
                       wire::ReduceOp op, void* data, size_t count, const void* input) {
  if (algo == InterNodeAlgorithm::kAuto && ctx.transport != nullptr) {
    algo = ChooseAllreduceAlgorithm(ctx.transport->num_peers(),
                                    count * wire::DataTypeSize(static_cast<uint32_t>(dtype)));
  }
  if (algo == InterNodeAlgorithm::kHalvingDoubling) {
    if (input != nullptr && input != data) {
      std::memcpy(data, input, count * wire::DataTypeSize(static_cast<uint32_t>(dtype)));
    }
    return AllreduceHalvingDoubling(ctx, dtype, op, data, count);
  }
  return AllreduceRing(ctx, dtype, op, data, count, input);
}

void DivideInPlace(wire::DataType dtype, void* data, size_t count, uint64_t divisor) {
  if (divisor == 0) std::abort();  // a broken invariant: avg over no contributor
  switch (dtype) {
    case wire::DataType::kFloat32: return DivideFloats<float>(data, count, divisor);
    case wire::DataType::kFloat64: return DivideFloats<double>(data, count, divisor);
    case wire::DataType::kFloat16:
      return DivideHalves<HalfToFloat, FloatToHalf>(data, count, divisor);
    case wire::DataType::kBFloat16:
      return DivideHalves<BFloat16ToFloat, FloatToBFloat16>(data, count, divisor);
    case wire::DataType::kInt8: return DivideIntegers<int8_t, int64_t>(data, count, divisor);
    case wire::DataType::kUInt8: return DivideIntegers<uint8_t, uint64_t>(data, count, divisor);
    case wire::DataType::kInt32: return DivideIntegers<int32_t, int64_t>(data, count, divisor);
    case wire::DataType::kInt64: return DivideIntegers<int64_t, int64_t>(data, count, divisor);
  }
  std::abort();  // not a DataType: callers validate with CheckReducible first
}

}  // namespace ciuic::daemon
