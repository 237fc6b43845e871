// What a registration and a membership table may hold: the bounds the
// coordinator applies to each node's RegisterNodeRequest, and the check a
// node makes of the table it receives before using any index from it. Both
// are peer input: a daemon on the other end may be broken, or not ours.
//
// Pure functions, any thread.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "ciuic/peer.pb.h"

namespace ciuic::daemon {

// The largest job a coordinator forms unless told otherwise (Coordinator's
// max_world_size).
inline constexpr int kDefaultMaxWorldSize = 65536;
// As the tuning key `channels` allows.
inline constexpr int kMaxChannels = 64;
// One UCX worker address (a few hundred bytes with tcp and shm; more with
// several devices).
inline constexpr size_t kMaxTransportAddressBytes = size_t{64} << 10;
inline constexpr size_t kMaxNodeNameBytes = 255;  // as the config key `node_name` allows
inline constexpr size_t kMaxJobIdBytes = 256;     // as JoinJob allows
inline constexpr size_t kMaxRackBytes = 64;       // as the config key `rack` allows

// What this daemon speaks to the other daemons of a job: proto/ciuic/peer.proto,
// the ordering, the direct exchanges' tags and headers (run_plan.h,
// direct_exchange.h). Raised whenever a change would make daemons of two
// versions misread each other; daemons that speak different ones refuse to
// form a job together (each says both numbers) instead of timing out on
// messages the other never matches. 0 is a daemon that predates it.
inline constexpr uint32_t kPeerProtocol = 3;

// OK when a daemon that speaks kPeerProtocol (`us`, e.g. "the coordinator
// of job 'j'") can run a job with one that speaks `theirs` (`who`, e.g.
// "node n1"). FAILED_PRECONDITION else, naming both, both protocols and what
// to do.
absl::Status CheckPeerProtocol(uint32_t theirs, const std::string& who, const std::string& us);

// OK when `r` is a registration the coordinator can take for a world of at
// most `max_world_size` ranks: sizes bounded, every rank in 0..world_size-1
// and named once, one transport address per channel. INVALID_ARGUMENT
// naming the node and the problem else.
absl::Status CheckRegistration(const proto::RegisterNodeRequest& r, int max_world_size);

// OK when `m`, the table a node got from `coordinator` (host:port, for the
// message), is one this node can run with: 1..world_size nodes; every rank
// 0..world_size-1 on exactly one node; a node named `node_name` holding
// exactly `local_ranks`; `channels` as this node's, and that many transport
// addresses per node, each bounded. On success *self is this node's index.
// DATA_LOSS naming the problem and the coordinator else (INVALID_ARGUMENT
// when `local_ranks` is empty: the caller's error, not the peer's).
absl::Status CheckMembership(const proto::Membership& m, const std::string& coordinator,
                             int world_size, const std::string& node_name,
                             const std::vector<int>& local_ranks, int channels, int* self);

// Each node's rack as a number (InterNodeContext::racks): racks numbered
// 0, 1, ... in the order of their first node in the table; nodes that gave
// no rack ("") form one rack like any other name.
std::vector<int> RackIndices(const proto::Membership& m);

}  // namespace ciuic::daemon
