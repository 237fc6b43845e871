#include "cluster/membership.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace ciuic::daemon {

absl::Status CheckPeerProtocol(uint32_t theirs, const std::string& who, const std::string& us) {
  if (theirs == kPeerProtocol) return absl::OkStatus();
  const std::string what =
      theirs == 0 ? std::string("a ciuicd that predates peer protocol numbers")
                  : absl::StrCat("peer protocol ", theirs);
  return absl::FailedPreconditionError(absl::StrCat(
      who, " runs ", what, " and ", us, " runs peer protocol ", kPeerProtocol,
      ": the daemons of one job must speak the same protocol (run one ciuicd version on all "
      "of the job's nodes)"));
}

absl::Status CheckRegistration(const proto::RegisterNodeRequest& r, int max_world_size) {
  if (r.node_name().empty() || r.node_name().size() > kMaxNodeNameBytes) {
    return absl::InvalidArgumentError(absl::StrCat("registration with a node name of ",
                                                   r.node_name().size(), " bytes (1..",
                                                   kMaxNodeNameBytes, ")"));
  }
  const std::string who = absl::StrCat("node ", r.node_name());
  if (r.rack().size() > kMaxRackBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat(who, " registered a rack name of ", r.rack().size(), " bytes (0..",
                     kMaxRackBytes, ")"));
  }
  if (r.job_id().empty() || r.job_id().size() > kMaxJobIdBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat(who, ": a job id of ", r.job_id().size(), " bytes (1..", kMaxJobIdBytes, ")"));
  }
  if (r.world_size() < 1 || r.world_size() > max_world_size) {
    return absl::InvalidArgumentError(absl::StrCat(who, ": world size ", r.world_size(),
                                                   " is not in 1..", max_world_size,
                                                   " (this coordinator's max_world_size)"));
  }
  if (r.ranks_size() == 0 || r.ranks_size() > r.world_size()) {
    return absl::InvalidArgumentError(
        absl::StrCat(who, ": ", r.ranks_size(), " ranks in a world of ", r.world_size()));
  }
  if (r.channels() < 1 || r.channels() > kMaxChannels) {
    return absl::InvalidArgumentError(
        absl::StrCat(who, ": ", r.channels(), " channels (1..", kMaxChannels, ")"));
  }
  if (r.transport_addresses_size() != r.channels()) {
    return absl::InvalidArgumentError(absl::StrCat(who, ": ", r.transport_addresses_size(),
                                                   " transport addresses for ", r.channels(),
                                                   " channels"));
  }
  for (const std::string& a : r.transport_addresses()) {
    if (a.empty() || a.size() > kMaxTransportAddressBytes) {
      return absl::InvalidArgumentError(absl::StrCat(who, ": a transport address of ", a.size(),
                                                     " bytes (1..", kMaxTransportAddressBytes,
                                                     ")"));
    }
  }
  std::vector<bool> seen(static_cast<size_t>(r.world_size()), false);
  for (int rank : r.ranks()) {
    if (rank < 0 || rank >= r.world_size()) {
      return absl::InvalidArgumentError(
          absl::StrCat(who, ": rank ", rank, " is not in a world of size ", r.world_size()));
    }
    if (seen[static_cast<size_t>(rank)]) {
      return absl::InvalidArgumentError(absl::StrCat(who, " names rank ", rank, " twice"));
    }
    seen[static_cast<size_t>(rank)] = true;
  }
  return absl::OkStatus();
}

absl::Status CheckMembership(const proto::Membership& m, const std::string& coordinator,
                             int world_size, const std::string& node_name,
                             const std::vector<int>& local_ranks, int channels, int* self) {
  const auto bad = [&](const std::string& what) {
    return absl::DataLossError(
        absl::StrCat("coordinator ", coordinator, " sent a bad membership table: ", what));
  };
  if (absl::Status s = CheckPeerProtocol(m.protocol(), absl::StrCat("coordinator ", coordinator),
                                         absl::StrCat("node ", node_name));
      !s.ok()) {
    return s;
  }
  if (m.nodes_size() < 1 || m.nodes_size() > world_size) {
    return bad(absl::StrCat(m.nodes_size(), " nodes for ", world_size, " ranks"));
  }
  if (m.channels() != channels) {
    return bad(absl::StrCat(m.channels(), " channels where this node has ", channels));
  }
  std::vector<int> node_of_rank(static_cast<size_t>(world_size), -1);
  for (int n = 0; n < m.nodes_size(); ++n) {
    const proto::NodeEntry& node = m.nodes(n);
    if (node.node_name().size() > kMaxNodeNameBytes) {
      return bad(absl::StrCat("node ", n, " has a name of ", node.node_name().size(), " bytes"));
    }
    if (node.ranks_size() == 0) return bad(absl::StrCat("node ", node.node_name(), " has no rank"));
    if (node.rack().size() > kMaxRackBytes) {
      return bad(absl::StrCat("node ", node.node_name(), " has a rack name of ",
                              node.rack().size(), " bytes"));
    }
    if (node.transport_addresses_size() != channels) {
      return bad(absl::StrCat("node ", node.node_name(), " has ", node.transport_addresses_size(),
                              " transport addresses for ", channels, " channels"));
    }
    for (const std::string& a : node.transport_addresses()) {
      if (a.empty() || a.size() > kMaxTransportAddressBytes) {
        return bad(absl::StrCat("node ", node.node_name(), " has a transport address of ", a.size(),
                                " bytes"));
      }
    }
    for (int r : node.ranks()) {
      if (r < 0 || r >= world_size) {
        return bad(absl::StrCat("node ", node.node_name(), " has rank ", r,
                                ", not in a world of size ", world_size));
      }
      if (node_of_rank[static_cast<size_t>(r)] >= 0) {
        return bad(absl::StrCat("rank ", r, " is on node ",
                                m.nodes(node_of_rank[static_cast<size_t>(r)]).node_name(),
                                " and on node ", node.node_name()));
      }
      node_of_rank[static_cast<size_t>(r)] = n;
    }
  }
  for (int r = 0; r < world_size; ++r) {
    if (node_of_rank[static_cast<size_t>(r)] < 0) {
      return bad(absl::StrCat("rank ", r, " is on no node"));
    }
  }
  if (local_ranks.empty()) return absl::InvalidArgumentError("this node hosts no rank");
  const int front = local_ranks.front();
  const int me = front >= 0 && front < world_size ? node_of_rank[static_cast<size_t>(front)] : -1;
  if (me < 0) return bad(absl::StrCat("this node's rank ", front, " is missing"));
  std::vector<int> mine(m.nodes(me).ranks().begin(), m.nodes(me).ranks().end());
  std::vector<int> want = local_ranks;
  std::sort(mine.begin(), mine.end());
  std::sort(want.begin(), want.end());
  if (mine != want || m.nodes(me).node_name() != node_name) {
    return bad(absl::StrCat("this node (", node_name, ", ranks ", absl::StrJoin(want, ","),
                            ") appears as node ", m.nodes(me).node_name(), " with ranks ",
                            absl::StrJoin(mine, ",")));
  }
  *self = me;
  return absl::OkStatus();
}

std::vector<int> RackIndices(const proto::Membership& m) {
  std::vector<int> racks;
  std::vector<const std::string*> names;  // rack k's name
  for (const proto::NodeEntry& node : m.nodes()) {
    int k = 0;
    while (k < static_cast<int>(names.size()) && *names[k] != node.rack()) ++k;
    if (k == static_cast<int>(names.size())) names.push_back(&node.rack());
    racks.push_back(k);
  }
  return racks;
}

}  // namespace ciuic::daemon
