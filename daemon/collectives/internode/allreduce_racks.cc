// Rack-hierarchical allreduce and the cost model that chooses it (see
// ../README.md, "Racks").
//
// Three phases, each an ordinary algorithm run through a SubTransport:
//   1. in each rack, a ring reduce-scatter whose one block belongs to the
//      rack's leader (its lowest node): the buffer travels the rack's chain
//      once, pipelined, and the leader ends with the rack's sum;
//   2. the leaders' ring allreduce (racks in the order of their leaders);
//   3. in each rack, the leader broadcasts the result (chain or tree).
// So an inter-rack link carries only the leaders' ring: one stream per rack
// pair, 2(R-1)/R of the buffer, where the flat ring over the nodes sends
// 2(N-1)/N of it over every ring edge that crosses racks. Each phase has its
// own tags (two bits of the algorithm's field), so a rack's phases 1 and 3,
// which use the same node pairs, never match each other's messages.
//
// Every element is reduced along one path (the rack's chain in a fixed
// order, then the leaders' ring) and copied from there: the same bits on
// every node.
#include <algorithm>
#include <cstring>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "collectives/internode/common.h"
#include "collectives/internode/internode.h"
#include "collectives/internode/schedule.h"
#include "collectives/internode/sub_transport.h"

namespace ciuic::daemon {
namespace {

// A step's fixed cost, seconds (a message's latency and the schedule's
// turn): only the order of magnitude matters, for small operations.
constexpr double kStepSeconds = 25e-6;

struct RackLayout {
  std::vector<int> members;  // this node's rack, in node order (the leader first)
  std::vector<int> leaders;  // every rack's leader, in node order
};

absl::StatusOr<RackLayout> Layout(const std::vector<int>& racks, int n, int self) {
  if (racks.size() != static_cast<size_t>(n)) {
    return absl::InvalidArgumentError(
        absl::StrCat("AllreduceRacks: ", racks.size(), " racks given for ", n, " nodes"));
  }
  RackLayout out;
  std::vector<bool> seen(static_cast<size_t>(n), false);
  for (int k = 0; k < n; ++k) {
    const int rack = racks[k];
    if (rack < 0 || rack >= n) {
      return absl::InvalidArgumentError(
          absl::StrCat("AllreduceRacks: node ", k, " has rack ", rack, " of 0..", n - 1));
    }
    if (!seen[rack]) {
      seen[rack] = true;
      out.leaders.push_back(k);
    }
    if (rack == racks[self]) out.members.push_back(k);
  }
  return out;
}

InterNodeContext PhaseContext(const InterNodeContext& ctx, Transport* sub, uint64_t phase) {
  InterNodeContext c = ctx;
  c.transport = sub;
  c.tag_bits = ctx.tag_bits - 2;
  c.tag_base = ctx.tag_base | (phase << c.tag_bits);
  return c;
}

absl::Status InPhase(absl::Status s, const char* phase, const std::vector<int>& nodes) {
  if (s.ok()) return s;
  return absl::Status(s.code(), absl::StrCat("AllreduceRacks, ", phase, " (nodes ",
                                             absl::StrJoin(nodes, ","), "): ", s.message()));
}

}  // namespace

absl::Status AllreduceRacks(const InterNodeContext& ctx, const std::vector<int>& racks,
                            wire::DataType dtype, wire::ReduceOp op, void* data, size_t count,
                            const void* input) {
  constexpr const char* kName = "AllreduceRacks";
  if (absl::Status s = internode_internal::CheckReduction(dtype, op, kName); !s.ok()) return s;
  if (absl::Status s = internode_internal::CheckContext(ctx, kName); !s.ok()) return s;
  if (ctx.tag_bits - 2 < internode_internal::kMinTagBits) {
    return absl::InvalidArgumentError(
        absl::StrCat(kName, ": needs ", internode_internal::kMinTagBits + 2, " tag bits"));
  }
  const int n = ctx.transport->num_peers();
  const int self = ctx.transport->self();
  absl::StatusOr<RackLayout> layout = Layout(racks, n, self);
  if (!layout.ok()) return layout.status();
  const size_t bytes = count * wire::DataTypeSize(static_cast<uint32_t>(dtype));
  if (input == data) input = nullptr;
  if (n <= 1 || count == 0) {
    if (input != nullptr && count > 0) std::memcpy(data, input, bytes);
    return absl::OkStatus();
  }

  SubTransport rack(ctx.transport, layout->members);
  const bool leader = layout->members.front() == self;
  {
    // Phase 1: the leader (rack node 0) owns the whole buffer.
    const InterNodeContext c = PhaseContext(ctx, &rack, 0);
    absl::Status s = ReduceScatterRing(c, dtype, op, data, {Block{0, bytes, 0}}, input);
    if (!s.ok()) return InPhase(s, "reduce in the rack", layout->members);
  }
  if (leader && layout->leaders.size() > 1) {
    SubTransport leaders(ctx.transport, layout->leaders);
    const InterNodeContext c = PhaseContext(ctx, &leaders, 1);
    absl::Status s = AllreduceRing(c, dtype, op, data, count);
    if (!s.ok()) return InPhase(s, "allreduce among the racks' leaders", layout->leaders);
  }
  {
    const InterNodeContext c = PhaseContext(ctx, &rack, 2);
    absl::Status s = BroadcastPipeline(c, data, bytes, 0);
    if (!s.ok()) return InPhase(s, "broadcast in the rack", layout->members);
  }
  return absl::OkStatus();
}

std::optional<RackCost> ModelRackAllreduce(const std::vector<int>& racks,
                                           const std::vector<std::vector<double>>& rates,
                                           uint64_t bytes) {
  const int n = static_cast<int>(racks.size());
  if (n < 3 || rates.size() != racks.size()) return std::nullopt;
  std::vector<int> size(static_cast<size_t>(n), 0);
  for (int r : racks) {
    if (r < 0 || r >= n) return std::nullopt;
    ++size[r];
  }
  const int num_racks = static_cast<int>(std::count_if(size.begin(), size.end(),
                                                       [](int k) { return k > 0; }));
  const int largest = *std::max_element(size.begin(), size.end());
  if (num_racks < 2 || largest < 2) return std::nullopt;  // nothing to gain: flat it is
  // The slowest measured pair inside a rack and between racks.
  double intra = 0, inter = 0;
  for (int a = 0; a < n; ++a) {
    if (rates[a].size() != racks.size()) return std::nullopt;
    for (int b = 0; b < n; ++b) {
      const double rate = rates[a][b];
      if (a == b || !(rate > 0)) continue;
      double& cls = racks[a] == racks[b] ? intra : inter;
      cls = cls == 0 ? rate : std::min(cls, rate);
    }
  }
  if (intra == 0 || inter == 0) return std::nullopt;  // not measured yet

  const double s = static_cast<double>(bytes);
  // The flat ring in node order: every edge carries 2(N-1)/N of the buffer;
  // the edges that cross from one rack to another share that rack pair's
  // link (in that direction).
  double slowest_edge = intra;
  for (int k = 0; k < n; ++k) {
    const int a = racks[k], b = racks[(k + 1) % n];
    if (a == b) continue;
    int sharing = 0;
    for (int j = 0; j < n; ++j) sharing += racks[j] == a && racks[(j + 1) % n] == b;
    slowest_edge = std::min(slowest_edge, inter / sharing);
  }
  RackCost cost;
  cost.flat_s = 2.0 * (n - 1) * kStepSeconds + 2.0 * (n - 1) / n * s / slowest_edge;
  // Rack phases: the chain of the largest rack, there and back; the
  // leaders' ring over one link per rack pair and direction.
  const double r = num_racks;
  cost.rack_s = 2 * ((largest - 1) * kStepSeconds + s / intra) +
                2.0 * (r - 1) * kStepSeconds + 2.0 * (r - 1) / r * s / inter;
  return cost;
}

}  // namespace ciuic::daemon
