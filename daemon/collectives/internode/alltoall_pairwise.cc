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
// Blocks may differ in size (alltoallv): each side knows its own pairs'.
#include <algorithm>
#include <cstdint>
#include <functional>
#include <utility>
#include <vector>

#include "collectives/internode/common.h"
#include "collectives/internode/internode.h"
#include "collectives/internode/schedule.h"

namespace ciuic::daemon {

using internode_internal::Mod;

namespace {

constexpr const char* kName = "AlltoallPairwise";

// Whether any two non-empty blocks [offsets[j], offsets[j] + bytes[j]) overlap.
bool Overlap(const std::vector<uint64_t>& offsets, const std::vector<uint64_t>& bytes) {
  std::vector<std::pair<uint64_t, uint64_t>> blocks;
  for (size_t j = 0; j < offsets.size(); ++j) {
    if (bytes[j] > 0) blocks.emplace_back(offsets[j], bytes[j]);
  }
  std::sort(blocks.begin(), blocks.end());
  for (size_t j = 1; j < blocks.size(); ++j) {
    if (blocks[j - 1].first + blocks[j - 1].second > blocks[j].first) return true;
  }
  return false;
}

// AlltoallPairwise's schedule, run with `meanwhile` as its overlapped work
// (which it may also never run: on an early error, or with one node).
absl::Status Pairwise(const InterNodeContext& ctx, const std::vector<int>& node_of_rank,
                      const std::vector<AlltoallBuffers>& ranks,
                      std::function<void()> meanwhile) {
  if (absl::Status s = internode_internal::CheckContext(ctx, kName); !s.ok()) return s;
  const int n = ctx.transport->num_peers();
  const int me = ctx.transport->self();
  const size_t world = node_of_rank.size();
  if (ranks.size() != world) {
    return absl::InvalidArgumentError(
        absl::StrCat(kName, ": buffers for ", ranks.size(), " ranks in a job of ", world));
  }
  std::vector<std::vector<size_t>> ranks_of(static_cast<size_t>(std::max(n, 0)));
  // Where each local rank's block for / from each rank starts.
  std::vector<std::vector<size_t>> send_at(world), recv_at(world);
  for (size_t r = 0; r < world; ++r) {
    const int node = node_of_rank[r];
    if (node < 0 || node >= n) {
      return absl::InvalidArgumentError(
          absl::StrCat(kName, ": rank ", r, " is on node ", node, " of ", n));
    }
    ranks_of[static_cast<size_t>(node)].push_back(r);
    if (node != me) continue;
    const AlltoallBuffers& b = ranks[r];
    if (b.send_bytes.size() != world || b.recv_bytes.size() != world) {
      return absl::InvalidArgumentError(
          absl::StrCat(kName, ": local rank ", r, " has no byte counts for every rank"));
    }
    if ((!b.send_offsets.empty() && b.send_offsets.size() != world) ||
        (!b.recv_offsets.empty() && b.recv_offsets.size() != world)) {
      return absl::InvalidArgumentError(
          absl::StrCat(kName, ": local rank ", r, " has no offsets for every rank"));
    }
    uint64_t sent = 0, got = 0;
    for (size_t j = 0; j < world; ++j) {  // SendAt / RecvAt, without summing again
      send_at[r].push_back(b.send_offsets.empty() ? sent : b.send_offsets[j]);
      recv_at[r].push_back(b.recv_offsets.empty() ? got : b.recv_offsets[j]);
      sent += b.send_bytes[j];
      got += b.recv_bytes[j];
    }
    if ((sent > 0 && b.send == nullptr) || (got > 0 && b.recv == nullptr)) {
      return absl::InvalidArgumentError(
          absl::StrCat(kName, ": local rank ", r, " has no send or recv buffer"));
    }
    if (!b.recv_offsets.empty() && Overlap(b.recv_offsets, b.recv_bytes)) {
      return absl::InvalidArgumentError(
          absl::StrCat(kName, ": local rank ", r, "'s blocks to receive overlap"));
    }
  }
  if (n <= 1) return absl::OkStatus();

  internode_internal::Schedule sched;
  sched.name = kName;
  sched.meanwhile = std::move(meanwhile);
  sched.num_tag_steps = static_cast<uint32_t>(n - 1);
  const int chunk_bits = internode_internal::ChunkBits(sched.num_tag_steps, ctx.tag_bits);
  const std::vector<size_t>& mine = ranks_of[static_cast<size_t>(me)];
  sched.steps.resize(static_cast<size_t>(n - 1));
  for (int s = 0; s < n - 1; ++s) {
    internode_internal::Step& st = sched.steps[static_cast<size_t>(s)];
    st.tag_step = static_cast<uint32_t>(s);
    st.send.peer = Mod(me + s + 1, n);
    for (size_t from : mine) {
      for (size_t to : ranks_of[static_cast<size_t>(st.send.peer)]) {
        // Only read: Side keeps one pointer type for both directions.
        st.send.Add(const_cast<uint8_t*>(ranks[from].send) + send_at[from][to],
                    ranks[from].send_bytes[to]);
      }
    }
    st.recv.peer = Mod(me - s - 1, n);
    for (size_t from : ranks_of[static_cast<size_t>(st.recv.peer)]) {
      for (size_t to : mine) {
        st.recv.Add(ranks[to].recv + recv_at[to][from], ranks[to].recv_bytes[from]);
      }
    }
  }
  // A fixed chunk size: a node knows the sizes of its own pairs only, and
  // both sides of a pair cut the same list the same way. A step whose
  // chunks would overflow the tag's chunk field fails on both of its sides.
  const size_t chunk = std::max<uint64_t>(1, ctx.chunk_bytes);
  for (const internode_internal::Step& st : sched.steps) {
    for (const internode_internal::Side* side : {&st.send, &st.recv}) {
      internode_internal::Side probe = *side;
      probe.Cut(chunk);
      if (chunk_bits < 0 || probe.num_chunks() > (size_t{1} << chunk_bits)) {
        return absl::InvalidArgumentError(absl::StrCat(
            kName, ": ", probe.num_chunks(), " chunks of ", chunk,
            " bytes between two nodes exceed the tag's chunk field; raise chunk_bytes"));
      }
    }
  }
  return internode_internal::RunSchedule(ctx, sched, chunk, chunk_bits);
}

}  // namespace

absl::Status AlltoallPairwise(const InterNodeContext& ctx, const std::vector<int>& node_of_rank,
                              const std::vector<AlltoallBuffers>& ranks,
                              const std::function<void()>& meanwhile) {
  bool ran = false;
  auto once = [&] {
    if (!ran && meanwhile) meanwhile();
    ran = true;
  };
  absl::Status s = Pairwise(ctx, node_of_rank, ranks, once);
  once();  // whatever happened, the caller's work is done on return
  return s;
}

}  // namespace ciuic::daemon
