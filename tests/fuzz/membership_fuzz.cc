// Fuzz target: the checks of what formation takes from another daemon
// (cluster/membership.h): CheckRegistration, which the coordinator applies
// to each node's RegisterNodeRequest, and CheckMembership, which a node
// applies to the table the coordinator sends back.
//
// Input: a selector byte, the parameters (max_world_size; or this node's
// world size, name, local ranks and channels), then the message. The
// message is either the rest of the input parsed as protobuf, or built
// from fields (a registration or a table that is nearly right, with a few
// chosen faults), so that coverage reaches the checks past the first.
//
// Properties: each verdict is recomputed here, independently: a check
// accepts exactly what the header promises (every rank 0..world_size-1 on
// exactly one node, 1..world_size nodes, this node present with exactly
// its local ranks and *self its index, channels and per-node address
// counts equal, sizes within the documented bounds). A refusal is
// INVALID_ARGUMENT (CheckRegistration) or DATA_LOSS naming the coordinator
// (CheckMembership; INVALID_ARGUMENT for a caller with no local rank) with
// a message, and leaves *self alone.
#include <algorithm>
#include <cstdint>
#include <set>
#include <string>
#include <vector>

#include "cluster/membership.h"
#include "fuzz_input.h"
#include "fuzz_proto.h"

namespace {

constexpr const char* kTarget = "membership_fuzz";
namespace cluster = ciuic::daemon;
namespace proto = ciuic::proto;

const char* const kNames[] = {"a", "b", "node-c", "", "a"};
constexpr const char* kCoordinator = "coord.example:7077";

bool AddressOk(const std::string& a) {
  return !a.empty() && a.size() <= cluster::kMaxTransportAddressBytes;
}

// A string the fuzzer sizes: mostly short, sometimes at or just past a bound.
std::string SizedString(ciuic::fuzz::Input& in, size_t bound, char fill) {
  const uint8_t b = in.Byte();
  switch (b % 8) {
    case 0:
      return "";
    case 1:
      return std::string(bound, fill);
    case 2:
      return std::string(bound + 1, fill);
    default:
      return std::string(1 + b % 16, fill);
  }
}

// CheckRegistration's promise, recomputed.
bool RegistrationValid(const proto::RegisterNodeRequest& r, int max_world_size) {
  if (r.node_name().empty() || r.node_name().size() > cluster::kMaxNodeNameBytes) return false;
  if (r.job_id().empty() || r.job_id().size() > cluster::kMaxJobIdBytes) return false;
  if (r.world_size() < 1 || r.world_size() > max_world_size) return false;
  if (r.ranks_size() < 1 || r.ranks_size() > r.world_size()) return false;
  if (r.channels() < 1 || r.channels() > cluster::kMaxChannels) return false;
  if (r.transport_addresses_size() != r.channels()) return false;
  for (const std::string& a : r.transport_addresses()) {
    if (!AddressOk(a)) return false;
  }
  std::set<int> ranks(r.ranks().begin(), r.ranks().end());
  if (static_cast<int>(ranks.size()) != r.ranks_size()) return false;  // a rank twice
  return *ranks.begin() >= 0 && *ranks.rbegin() < r.world_size();
}

// CheckMembership's promise, recomputed: the index of this node, or -1
// when the table is not one this node can run with.
int MembershipSelf(const proto::Membership& m, int world_size, const std::string& node_name,
                   const std::vector<int>& local_ranks, int channels) {
  if (m.protocol() != cluster::kPeerProtocol) return -1;
  if (m.nodes_size() < 1 || m.nodes_size() > world_size || m.channels() != channels) return -1;
  std::multiset<int> all;
  for (const proto::NodeEntry& n : m.nodes()) {
    if (n.node_name().size() > cluster::kMaxNodeNameBytes || n.ranks_size() == 0 ||
        n.transport_addresses_size() != channels) {
      return -1;
    }
    for (const std::string& a : n.transport_addresses()) {
      if (!AddressOk(a)) return -1;
    }
    all.insert(n.ranks().begin(), n.ranks().end());
  }
  // Every rank 0..world_size-1 exactly once, and nothing else.
  if (static_cast<int64_t>(all.size()) != world_size) return -1;
  int expect = 0;
  for (int r : all) {
    if (r != expect++) return -1;
  }
  const std::multiset<int> mine(local_ranks.begin(), local_ranks.end());
  for (int i = 0; i < m.nodes_size(); ++i) {
    const proto::NodeEntry& n = m.nodes(i);
    if (n.node_name() == node_name &&
        std::multiset<int>(n.ranks().begin(), n.ranks().end()) == mine) {
      return i;
    }
  }
  return -1;
}

void FuzzRegistration(ciuic::fuzz::Input& in, bool structured) {
  const uint8_t pick = in.Byte();
  const int max_world_size = pick < 200   ? 1 + pick % 16
                             : pick < 250 ? cluster::kDefaultMaxWorldSize
                                          : static_cast<int>(in.U32());
  proto::RegisterNodeRequest r;
  if (structured) {
    r.set_node_name(SizedString(in, cluster::kMaxNodeNameBytes, 'n'));
    r.set_job_id(SizedString(in, cluster::kMaxJobIdBytes, 'j'));
    r.set_uid(in.U32());
    r.set_world_size(static_cast<int8_t>(in.Byte()));
    const int ranks = in.Byte() % 20;
    for (int i = 0; i < ranks; ++i) r.add_ranks(static_cast<int8_t>(in.Byte()));
    r.set_channels(static_cast<int8_t>(in.Byte()));
    const int addresses = in.Byte() % 70;
    for (int i = 0; i < addresses; ++i) {
      // Long addresses are costly to build: most are short.
      const uint8_t b = in.Byte();
      r.add_transport_addresses(
          b < 250 ? std::string(b % 8, 'x')
                  : std::string(cluster::kMaxTransportAddressBytes + (b == 255 ? 1 : 0), 'y'));
    }
  } else if (!ciuic::fuzz::ParseProto(&r, in.rest(), in.rest_size())) {
    return;
  }
  const bool valid = RegistrationValid(r, max_world_size);
  const absl::Status s = cluster::CheckRegistration(r, max_world_size);
  FUZZ_CHECK(s.ok() == valid, "CheckRegistration's verdict is not the documented one");
  if (!s.ok()) {
    FUZZ_CHECK(s.code() == absl::StatusCode::kInvalidArgument,
               "a refused registration is not INVALID_ARGUMENT");
    FUZZ_CHECK(!s.message().empty(), "a refused registration says no why");
  }
}

void FuzzMembership(ciuic::fuzz::Input& in, bool structured) {
  // This node: its job's size (the caller's own, from its trainers: at
  // most kDefaultMaxWorldSize), channels, name and ranks.
  const uint8_t w = in.Byte();
  const int world_size = w < 250 ? static_cast<int>(w % 12) - 1
                                 : static_cast<int>(in.U32() % (cluster::kDefaultMaxWorldSize + 1));
  const int channels = static_cast<int>(in.Byte() % 5) - 1;
  std::string node_name = kNames[in.Byte() % 5];
  std::vector<int> local_ranks;

  proto::Membership m;
  if (structured) {
    // A table that is right but for the faults chosen below.
    m.set_instance(in.U64());
    m.set_channels(channels);
    // Mostly this daemon's protocol; now and then another version's.
    const uint8_t protocol = in.Byte();
    m.set_protocol(protocol < 240 ? cluster::kPeerProtocol : protocol % 4);
    const int ws = std::clamp(world_size, 0, 64);
    const int nodes = ws == 0 ? 0 : 1 + in.Byte() % ws;
    for (int n = 0; n < nodes; ++n) {
      auto* e = m.add_nodes();
      e->set_node_name(kNames[in.Byte() % 5]);
      for (int c = 0; c < channels; ++c) e->add_transport_addresses("addr");
    }
    for (int r = 0; r < ws; ++r) {
      // The first ranks give every node one; the rest go where the input says.
      const int n = r < nodes ? r : in.Byte() % nodes;
      m.mutable_nodes(n)->add_ranks(r);
    }
    if (nodes > 0) {
      const auto& me = m.nodes(in.Byte() % nodes);
      local_ranks.assign(me.ranks().begin(), me.ranks().end());
      std::reverse(local_ranks.begin(), local_ranks.end());  // any order
      node_name = me.node_name();
    }
    const uint8_t faults = in.Byte();
    for (int f = 0; f < 8; ++f) {
      if ((faults & (1 << f)) == 0 || m.nodes_size() == 0) continue;
      auto* e = m.mutable_nodes(in.Byte() % m.nodes_size());
      const int32_t value = static_cast<int8_t>(in.Byte());
      switch (f) {
        case 0:  // a rank moved, repeated or out of range
          if (e->ranks_size() > 0) e->set_ranks(in.Byte() % e->ranks_size(), value);
          break;
        case 1:
          e->add_ranks(value);
          break;
        case 2:  // an address too long, or empty
          if (e->transport_addresses_size() > 0) {
            e->set_transport_addresses(
                0,
                std::string(value < 0 ? cluster::kMaxTransportAddressBytes + (value & 1) : 0, 'z'));
          }
          break;
        case 3:
          e->add_transport_addresses("extra");
          break;
        case 4:  // a name at or past its bound
          e->set_node_name(std::string(cluster::kMaxNodeNameBytes + (value & 1), 'n'));
          break;
        case 5:
          m.set_channels(value);
          break;
        case 6:  // this node's own view differs
          if (value & 1) {
            local_ranks.push_back(value >> 1);
          } else if (!local_ranks.empty()) {
            local_ranks.pop_back();
          }
          break;
        case 7:
          node_name = kNames[value & 3];
          break;
      }
    }
  } else {
    const int count = in.Byte() % 6;
    for (int i = 0; i < count; ++i) local_ranks.push_back(static_cast<int8_t>(in.Byte()));
    if (!ciuic::fuzz::ParseProto(&m, in.rest(), in.rest_size())) return;
  }

  int self = -7;
  const absl::Status s = cluster::CheckMembership(m, kCoordinator, world_size, node_name,
                                                  local_ranks, channels, &self);
  if (local_ranks.empty()) {
    // Not the peer's fault: this node hosts no rank to look for.
    FUZZ_CHECK(s.code() == absl::StatusCode::kInvalidArgument ||
                   s.code() == absl::StatusCode::kDataLoss ||
                   s.code() == absl::StatusCode::kFailedPrecondition,
               "a node with no rank is not refused");
    FUZZ_CHECK(!s.message().empty(), "a refusal says no why");
    return;
  }
  const int want = MembershipSelf(m, world_size, node_name, local_ranks, channels);
  FUZZ_CHECK(s.ok() == (want >= 0), "CheckMembership's verdict is not the documented one");
  if (s.ok()) {
    FUZZ_CHECK(self == want, "*self is not this node's index");
  } else {
    // Another version's coordinator first; then a table broken otherwise.
    FUZZ_CHECK(s.code() == (m.protocol() != cluster::kPeerProtocol
                                ? absl::StatusCode::kFailedPrecondition
                                : absl::StatusCode::kDataLoss),
               "a table of another peer protocol is not FAILED_PRECONDITION, or a bad table "
               "not DATA_LOSS");
    FUZZ_CHECK(s.message().find(kCoordinator) != absl::string_view::npos,
               "a bad table's refusal does not name the coordinator");
    FUZZ_CHECK(self == -7, "a refused table set *self");
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  ciuic::fuzz::Input in(data, size);
  const uint8_t mode = in.Byte();
  const bool structured = (mode & 2) == 0;
  if (mode & 1) {
    FuzzMembership(in, structured);
  } else {
    FuzzRegistration(in, structured);
  }
  return 0;
}
