// Algorithm choice and avg's final division.
#include <bit>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <type_traits>

#include "collectives/internode/internode.h"
#include "reduce/reduce.h"

namespace ciuic::daemon {
namespace {

// alpha * beta of the inter-node links in bytes: a message of this size
// spends as long on the wire as on its fixed per-message cost (~5 us at
// ~12.5 GB/s). Only the order of magnitude matters for the choice.
constexpr double kAlphaBetaBytes = 64 * 1024;
// Recursive doubling reduces the whole buffer on every node at every round;
// above this its compute cost outweighs the latency it saves.
constexpr size_t kHalvingDoublingMaxBytes = size_t{1} << 20;
// What reducing one byte costs, in bytes on the wire: about one on these
// machines (loopback TCP copies and the reduction run at similar speeds; on
// a 100 Gbit/s link with AVX-512 reductions it is of the same order).
// Recursive doubling pays it twice per round (the chunk lands in scratch,
// because its destination is still being sent, and is folded from there),
// the ring once per byte of its reduce-scatter. Measured on loopback with
// 2 nodes: the ring beat recursive doubling from 32 KiB up (85 against
// 91-140 us at 32 KiB, 470-490 against 620-1120 us at 1 MiB), which a model
// of latency and wire bytes alone (recursive doubling below 1 MiB) missed.
constexpr double kReduceCostBytes = 1.0;

}  // namespace

InterNodeAlgorithm ChooseAllreduceAlgorithm(int num_nodes, size_t bytes) {
  if (num_nodes <= 1 || bytes > kHalvingDoublingMaxBytes) return InterNodeAlgorithm::kRing;
  const double n = num_nodes;
  const double s = static_cast<double>(bytes);
  const double a = kAlphaBetaBytes;
  const unsigned p = std::bit_floor(static_cast<unsigned>(num_nodes));
  const double rounds = std::countr_zero(p);
  const double hd_steps = rounds + (p == static_cast<unsigned>(num_nodes) ? 0 : 2);
  const double g = kReduceCostBytes;
  const double ring = 2 * (n - 1) * a + 2 * (n - 1) / n * s + (n - 1) / n * s * g;
  const double hd = hd_steps * (a + s) + rounds * 2 * s * g;
  return hd < ring ? InterNodeAlgorithm::kHalvingDoubling : InterNodeAlgorithm::kRing;
}

bool OffsetIndependent(int num_nodes, InterNodeAlgorithm algo) {
  return algo == InterNodeAlgorithm::kHalvingDoubling ||
         (algo == InterNodeAlgorithm::kRing && num_nodes == 2);
}

absl::Status Allreduce(const InterNodeContext& ctx, InterNodeAlgorithm algo, wire::DataType dtype,
                       wire::ReduceOp op, void* data, size_t count, const void* input) {
  if (algo == InterNodeAlgorithm::kAuto && ctx.transport != nullptr) {
    algo = ChooseAllreduceAlgorithm(ctx.transport->num_peers(),
                                    count * wire::DataTypeSize(static_cast<uint32_t>(dtype)));
  }
  if (algo == InterNodeAlgorithm::kRack) {
    std::vector<int> one_rack;
    if (ctx.racks.empty() && ctx.transport != nullptr) {
      one_rack.assign(static_cast<size_t>(ctx.transport->num_peers()), 0);
    }
    return AllreduceRacks(ctx, ctx.racks.empty() ? one_rack : ctx.racks, dtype, op, data, count,
                          input);
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
  // A broken invariant, not bad input: avg over no contributor, or more
  // contributors than ranks can number.
  if (divisor == 0 || divisor > static_cast<uint64_t>(std::numeric_limits<int>::max())) {
    std::abort();
  }
  reduce::DivideInPlace(dtype, data, count, static_cast<int>(divisor));
}

}  // namespace ciuic::daemon
