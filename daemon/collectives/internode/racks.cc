// Rack-hierarchical collectives and the cost model that chooses them (see
// ../README.md, "Racks").
//
// The allreduce:
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
// every node. Reduce-scatter, allgather and broadcast follow the same
// three phases with their own kind of step (see each function).
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

// `root`: the node that leads its rack whatever its number (broadcast);
// -1: every rack's lowest node leads.
absl::StatusOr<RackLayout> Layout(const char* name, const std::vector<int>& racks, int n,
                                  int self, int root = -1) {
  if (racks.size() != static_cast<size_t>(n)) {
    return absl::InvalidArgumentError(
        absl::StrCat(name, ": ", racks.size(), " racks given for ", n, " nodes"));
  }
  RackLayout out;
  std::vector<bool> seen(static_cast<size_t>(n), false);
  for (int k = 0; k < n; ++k) {
    const int rack = racks[k];
    if (rack < 0 || rack >= n) {
      return absl::InvalidArgumentError(
          absl::StrCat(name, ": node ", k, " has rack ", rack, " of 0..", n - 1));
    }
    if (!seen[rack]) {
      seen[rack] = true;
      out.leaders.push_back(k);
    }
    if (rack == racks[self]) out.members.push_back(k);
  }
  if (root >= 0) {
    // The root leads its rack: first among its members, and in the leaders'
    // list in its rack's place.
    for (int& leader : out.leaders) {
      if (racks[leader] == racks[root]) leader = root;
    }
    if (racks[self] == racks[root]) {
      std::erase(out.members, root);
      out.members.insert(out.members.begin(), root);
    }
  }
  return out;
}

// Node k's index among `nodes`, -1 if absent.
int IndexOf(const std::vector<int>& nodes, int k) {
  auto it = std::find(nodes.begin(), nodes.end(), k);
  return it == nodes.end() ? -1 : static_cast<int>(it - nodes.begin());
}

InterNodeContext PhaseContext(const InterNodeContext& ctx, SubTransport* sub, uint64_t phase) {
  InterNodeContext c = ctx;
  c.transport = sub;
  if (!ctx.node_names.empty()) {
    c.node_names.clear();
    for (int m : sub->members()) {
      c.node_names.push_back(static_cast<size_t>(m) < ctx.node_names.size()
                                 ? ctx.node_names[static_cast<size_t>(m)]
                                 : std::string());
    }
  }
  c.tag_bits = ctx.tag_bits - 2;
  c.tag_base = ctx.tag_base | (phase << c.tag_bits);
  return c;
}

// `blocks` with each owner replaced by its rack's index among `leaders`.
std::vector<Block> ByRack(const std::vector<Block>& blocks, const std::vector<int>& racks,
                          const std::vector<int>& leaders) {
  std::vector<Block> out;
  for (const Block& b : blocks) {
    int q = 0;
    while (racks[leaders[q]] != racks[b.owner]) ++q;
    out.push_back(Block{b.offset, b.bytes, q});
  }
  return out;
}

absl::Status InPhase(absl::Status s, const char* name, const char* phase,
                     const std::vector<int>& nodes) {
  if (s.ok()) return s;
  return absl::Status(s.code(), absl::StrCat(name, ", ", phase, " (nodes ",
                                             absl::StrJoin(nodes, ","), "): ", s.message()));
}

absl::Status CheckOwners(const char* name, const std::vector<Block>& blocks, int n) {
  for (const Block& b : blocks) {
    if (b.owner < 0 || b.owner >= n) {
      return absl::InvalidArgumentError(
          absl::StrCat(name, ": a block for node ", b.owner, " of ", n));
    }
  }
  return absl::OkStatus();
}

absl::Status CheckRackContext(const InterNodeContext& ctx, const char* name) {
  if (absl::Status s = internode_internal::CheckContext(ctx, name); !s.ok()) return s;
  if (ctx.tag_bits - 2 < internode_internal::kMinTagBits) {
    return absl::InvalidArgumentError(
        absl::StrCat(name, ": needs ", internode_internal::kMinTagBits + 2, " tag bits"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status AllreduceRacks(const InterNodeContext& ctx, const std::vector<int>& racks,
                            wire::DataType dtype, wire::ReduceOp op, void* data, size_t count,
                            const void* input) {
  constexpr const char* kName = "AllreduceRacks";
  if (absl::Status s = internode_internal::CheckReduction(dtype, op, kName); !s.ok()) return s;
  if (absl::Status s = CheckRackContext(ctx, kName); !s.ok()) return s;
  const int n = ctx.transport->num_peers();
  const int self = ctx.transport->self();
  absl::StatusOr<RackLayout> layout = Layout(kName, racks, n, self);
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
    if (!s.ok()) return InPhase(s, kName, "reduce in the rack", layout->members);
  }
  if (leader && layout->leaders.size() > 1) {
    SubTransport leaders(ctx.transport, layout->leaders);
    const InterNodeContext c = PhaseContext(ctx, &leaders, 1);
    absl::Status s = AllreduceRing(c, dtype, op, data, count);
    if (!s.ok()) return InPhase(s, kName, "allreduce among the racks' leaders", layout->leaders);
  }
  {
    const InterNodeContext c = PhaseContext(ctx, &rack, 2);
    absl::Status s = BroadcastPipeline(c, data, bytes, 0);
    if (!s.ok()) return InPhase(s, kName, "broadcast in the rack", layout->members);
  }
  return absl::OkStatus();
}

absl::Status ReduceScatterRacks(const InterNodeContext& ctx, const std::vector<int>& racks,
                                wire::DataType dtype, wire::ReduceOp op, void* data,
                                const std::vector<Block>& blocks, const void* input) {
  constexpr const char* kName = "ReduceScatterRacks";
  if (absl::Status s = internode_internal::CheckReduction(dtype, op, kName); !s.ok()) return s;
  if (absl::Status s = CheckRackContext(ctx, kName); !s.ok()) return s;
  const int n = ctx.transport->num_peers();
  const int self = ctx.transport->self();
  absl::StatusOr<RackLayout> layout = Layout(kName, racks, n, self);
  if (!layout.ok()) return layout.status();
  if (absl::Status s = CheckOwners(kName, blocks, n); !s.ok()) return s;
  SubTransport rack(ctx.transport, layout->members);
  const bool leader = layout->members.front() == self;
  // Phase 1: the rack's contributions to every block, reduced into its leader.
  std::vector<Block> all = blocks;
  for (Block& b : all) b.owner = 0;
  absl::Status s = ReduceScatterRing(PhaseContext(ctx, &rack, 0), dtype, op, data, all, input);
  if (!s.ok()) return InPhase(s, kName, "reduce in the rack", layout->members);
  // Phase 2: among the leaders, each rack's blocks reduced into its leader.
  if (leader && layout->leaders.size() > 1) {
    SubTransport leaders(ctx.transport, layout->leaders);
    s = ReduceScatterRing(PhaseContext(ctx, &leaders, 1), dtype, op, data,
                          ByRack(blocks, racks, layout->leaders));
    if (!s.ok()) return InPhase(s, kName, "reduce-scatter among the racks' leaders",
                                layout->leaders);
  }
  // Phase 3: the leader hands its rack's blocks to the rack.
  std::vector<Block> mine;
  for (const Block& b : blocks) {
    if (racks[b.owner] == racks[self]) mine.push_back(Block{b.offset, b.bytes, 0});
  }
  s = AllgatherRing(PhaseContext(ctx, &rack, 2), data, mine);
  if (!s.ok()) return InPhase(s, kName, "the rack's blocks from its leader", layout->members);
  return absl::OkStatus();
}

absl::Status AllgatherRacks(const InterNodeContext& ctx, const std::vector<int>& racks,
                            void* data, const std::vector<Block>& blocks) {
  constexpr const char* kName = "AllgatherRacks";
  if (absl::Status s = CheckRackContext(ctx, kName); !s.ok()) return s;
  const int n = ctx.transport->num_peers();
  const int self = ctx.transport->self();
  absl::StatusOr<RackLayout> layout = Layout(kName, racks, n, self);
  if (!layout.ok()) return layout.status();
  if (absl::Status s = CheckOwners(kName, blocks, n); !s.ok()) return s;
  SubTransport rack(ctx.transport, layout->members);
  const bool leader = layout->members.front() == self;
  // Phase 1: the rack's blocks to every node of the rack (its leader
  // included), a ring inside the rack.
  std::vector<Block> inside, outside;
  for (const Block& b : blocks) {
    if (racks[b.owner] == racks[self]) {
      inside.push_back(Block{b.offset, b.bytes, IndexOf(layout->members, b.owner)});
    } else {
      outside.push_back(Block{b.offset, b.bytes, 0});  // from the leader, in phase 3
    }
  }
  absl::Status s = AllgatherRing(PhaseContext(ctx, &rack, 0), data, inside);
  if (!s.ok()) return InPhase(s, kName, "allgather in the rack", layout->members);
  // Phase 2: the leaders exchange their racks' blocks.
  if (leader && layout->leaders.size() > 1) {
    SubTransport leaders(ctx.transport, layout->leaders);
    s = AllgatherRing(PhaseContext(ctx, &leaders, 1), data, ByRack(blocks, racks, layout->leaders));
    if (!s.ok()) return InPhase(s, kName, "allgather among the racks' leaders", layout->leaders);
  }
  // Phase 3: the other racks' blocks from the leader to its rack.
  s = AllgatherRing(PhaseContext(ctx, &rack, 2), data, outside);
  if (!s.ok()) return InPhase(s, kName, "the other racks' blocks from the leader", layout->members);
  return absl::OkStatus();
}

absl::Status BroadcastRacks(const InterNodeContext& ctx, const std::vector<int>& racks, void* data,
                            size_t bytes, int root) {
  constexpr const char* kName = "BroadcastRacks";
  if (absl::Status s = CheckRackContext(ctx, kName); !s.ok()) return s;
  const int n = ctx.transport->num_peers();
  const int self = ctx.transport->self();
  if (root < 0 || root >= n) {
    return absl::InvalidArgumentError(absl::StrCat(kName, ": root ", root, " of ", n, " nodes"));
  }
  absl::StatusOr<RackLayout> layout = Layout(kName, racks, n, self, root);
  if (!layout.ok()) return layout.status();
  if (n <= 1 || bytes == 0) return absl::OkStatus();
  const bool leader = layout->members.front() == self;
  // Phase 1: from the root to the other racks' leaders.
  if (leader && layout->leaders.size() > 1) {
    SubTransport leaders(ctx.transport, layout->leaders);
    absl::Status s = BroadcastPipeline(PhaseContext(ctx, &leaders, 0), data, bytes,
                                       IndexOf(layout->leaders, root));
    if (!s.ok()) return InPhase(s, kName, "broadcast among the racks' leaders", layout->leaders);
  }
  // Phase 2: each leader to its rack.
  SubTransport rack(ctx.transport, layout->members);
  absl::Status s = BroadcastPipeline(PhaseContext(ctx, &rack, 1), data, bytes, 0);
  if (!s.ok()) return InPhase(s, kName, "broadcast in the rack", layout->members);
  return absl::OkStatus();
}

absl::Status ReduceScatter(const InterNodeContext& ctx, wire::DataType dtype, wire::ReduceOp op,
                           void* data, const std::vector<Block>& blocks, const void* input) {
  if (!ctx.racks.empty()) return ReduceScatterRacks(ctx, ctx.racks, dtype, op, data, blocks, input);
  return ReduceScatterRing(ctx, dtype, op, data, blocks, input);
}

absl::Status Allgather(const InterNodeContext& ctx, void* data, const std::vector<Block>& blocks) {
  if (!ctx.racks.empty()) return AllgatherRacks(ctx, ctx.racks, data, blocks);
  return AllgatherRing(ctx, data, blocks);
}

absl::Status Broadcast(const InterNodeContext& ctx, void* data, size_t bytes, int root) {
  if (!ctx.racks.empty()) return BroadcastRacks(ctx, ctx.racks, data, bytes, root);
  return BroadcastPipeline(ctx, data, bytes, root);
}

std::optional<RackCost> ModelRacks(RackCollective collective, const std::vector<int>& racks,
                                   const std::vector<std::vector<double>>& rates, uint64_t bytes,
                                   int root) {
  const int n = static_cast<int>(racks.size());
  if (n < 3 || n > kMaxRackModelNodes || rates.size() != racks.size() || root < 0 ||
      root >= n) {
    return std::nullopt;
  }
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
    if (rates[a].empty()) continue;
    if (rates[a].size() != racks.size()) return std::nullopt;
    for (int b = 0; b < n; ++b) {
      const double rate = rates[a][b];
      if (a == b || !(rate > 0)) continue;
      double& cls = racks[a] == racks[b] ? intra : inter;
      cls = cls == 0 ? rate : std::min(cls, rate);
    }
  }
  if (intra == 0 || inter == 0) return std::nullopt;  // not measured yet

  // The flat algorithm's edges: the ring k -> k+1, or the chain from the
  // root (every such edge but the one into the root). Edges that cross
  // from one rack to another share that rack pair's link in that direction.
  const bool chain = collective == RackCollective::kBroadcast;
  auto used = [&](int k) { return !chain || (k + 1) % n != root; };
  double slowest_edge = intra;
  for (int k = 0; k < n; ++k) {
    const int a = racks[k], b = racks[(k + 1) % n];
    if (a == b || !used(k)) continue;
    int sharing = 0;
    for (int j = 0; j < n; ++j) sharing += used(j) && racks[j] == a && racks[(j + 1) % n] == b;
    slowest_edge = std::min(slowest_edge, inter / sharing);
  }
  const double s = static_cast<double>(bytes);
  const double nn = n, r = num_racks, k = largest;
  const double a = kStepSeconds;
  // Inside a rack a chain of k nodes costs k-1 steps plus the bytes at the
  // rack's rate (pipelined); between racks, the leaders' ring or chain.
  RackCost cost;
  switch (collective) {
    case RackCollective::kAllreduce:
      cost.flat_s = 2 * (nn - 1) * a + 2 * (nn - 1) / nn * s / slowest_edge;
      cost.rack_s = 2 * ((k - 1) * a + s / intra) + 2 * (r - 1) * a + 2 * (r - 1) / r * s / inter;
      break;
    case RackCollective::kReduceScatter:
      // Every block up the rack's chain; the leaders' reduce-scatter; the
      // rack's blocks (about 1/R of the buffer) from the leader.
      cost.flat_s = (nn - 1) * a + (nn - 1) / nn * s / slowest_edge;
      cost.rack_s = (k - 1) * a + s / intra + (r - 1) * a + (r - 1) / r * s / inter +
                    (k - 1) * a + s / r / intra;
      break;
    case RackCollective::kAllgather:
      // The rack's blocks around the rack; the leaders' allgather; the
      // other racks' blocks from the leader.
      cost.flat_s = (nn - 1) * a + (nn - 1) / nn * s / slowest_edge;
      cost.rack_s = (k - 1) * a + s / r / intra + (r - 1) * a + (r - 1) / r * s / inter +
                    (k - 1) * a + (r - 1) / r * s / intra;
      break;
    case RackCollective::kBroadcast:
      cost.flat_s = (nn - 1) * a + s / slowest_edge;
      cost.rack_s = (r - 1) * a + s / inter + (k - 1) * a + s / intra;
      break;
  }
  return cost;
}

}  // namespace ciuic::daemon
