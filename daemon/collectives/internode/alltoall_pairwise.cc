// Pairwise alltoall between nodes (see ../README.md).
//
// N-1 steps: at step s node r sends to r+s+1 every block its ranks hold for
// that node's ranks, and receives from r-s-1 every block that node's ranks
// hold for its own. Blocks go straight from the senders' buffers into the
// receivers' (no packing, no copy): both sides list them in (sending rank,
// receiving rank) order, so they cut into the same chunks. The steps do not
// depend on each other: the send window keeps max_inflight chunks moving to
// whichever peers they are for. Each node sends (N-1)/N of its ranks' data
// once, in N-1 messages' worth of chunks rather than one per rank pair.
#include <algorithm>
#include <cstdint>

#include "collectives/internode/common.h"
#include "collectives/internode/internode.h"
#include "collectives/internode/schedule.h"

namespace ciuic::daemon {

using internode_internal::Mod;

absl::Status AlltoallPairwise(const InterNodeContext& ctx, const std::vector<int>& node_of_rank,
                              const std::vector<const uint8_t*>& send,
                              const std::vector<uint8_t*>& recv, size_t block_bytes) {
  constexpr const char* kName = "AlltoallPairwise";
  if (absl::Status s = internode_internal::CheckContext(ctx, kName); !s.ok()) return s;
  const int n = ctx.transport->num_peers();
  const int me = ctx.transport->self();
  const size_t world = node_of_rank.size();
  if (send.size() != world || recv.size() != world) {
    return absl::InvalidArgumentError(absl::StrCat(kName, ": ", send.size(), " send and ",
                                                   recv.size(), " recv buffers for ", world,
                                                   " ranks"));
  }
  std::vector<std::vector<size_t>> ranks_of(static_cast<size_t>(std::max(n, 0)));
  for (size_t r = 0; r < world; ++r) {
    const int node = node_of_rank[r];
    if (node < 0 || node >= n) {
      return absl::InvalidArgumentError(
          absl::StrCat(kName, ": rank ", r, " is on node ", node, " of ", n));
    }
    ranks_of[static_cast<size_t>(node)].push_back(r);
    if (node == me && block_bytes > 0 && (send[r] == nullptr || recv[r] == nullptr)) {
      return absl::InvalidArgumentError(
          absl::StrCat(kName, ": local rank ", r, " has no send or recv buffer"));
    }
  }
  if (n <= 1) return absl::OkStatus();

  internode_internal::Schedule sched;
  sched.name = kName;
  sched.num_tag_steps = static_cast<uint32_t>(n - 1);
  const int chunk_bits = internode_internal::ChunkBits(sched.num_tag_steps);
  // The step with the most chunks, over every pair of nodes: the same on
  // every node, since it depends on the placement of ranks alone.
  size_t most_ranks = 0, second = 0;
  for (const auto& rs : ranks_of) {
    if (rs.size() > most_ranks) {
      second = most_ranks;
      most_ranks = rs.size();
    } else {
      second = std::max(second, rs.size());
    }
  }
  absl::StatusOr<size_t> chunk = internode_internal::PlanChunkBytes(
      ctx.chunk_bytes, 1, chunk_bits, [&](size_t c) {
        return most_ranks * second * ((block_bytes + c - 1) / c);
      });
  if (!chunk.ok()) {
    return absl::Status(chunk.status().code(),
                        absl::StrCat(kName, ": ", chunk.status().message()));
  }

  const std::vector<size_t>& mine = ranks_of[static_cast<size_t>(me)];
  sched.steps.resize(static_cast<size_t>(n - 1));
  for (int s = 0; s < n - 1; ++s) {
    internode_internal::Step& st = sched.steps[static_cast<size_t>(s)];
    st.tag_step = static_cast<uint32_t>(s);
    st.send.peer = Mod(me + s + 1, n);
    for (size_t from : mine) {
      for (size_t to : ranks_of[static_cast<size_t>(st.send.peer)]) {
        // Only read: Side keeps one pointer type for both directions.
        st.send.Add(const_cast<uint8_t*>(send[from]) + to * block_bytes, block_bytes);
      }
    }
    st.recv.peer = Mod(me - s - 1, n);
    for (size_t from : ranks_of[static_cast<size_t>(st.recv.peer)]) {
      for (size_t to : mine) st.recv.Add(recv[to] + from * block_bytes, block_bytes);
    }
  }
  return internode_internal::RunSchedule(ctx, sched, *chunk, chunk_bits);
}

}  // namespace ciuic::daemon
