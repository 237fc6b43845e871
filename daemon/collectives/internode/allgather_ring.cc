// Ring allgather of arbitrary blocks (see ../README.md).
//
// Node r sends to r+1 and receives from r-1. Step s (0..N-2): send the blocks
// owned by node r-s (its own at step 0, then what it received at step s-1),
// receive those owned by node r-s-1 in place. Each block is cut into chunks
// separately (a chunk never spans two blocks, so nothing is packed or copied),
// and chunk c is forwarded as soon as it has arrived.
#include <algorithm>

#include "collectives/internode/common.h"
#include "collectives/internode/internode.h"
#include "collectives/internode/schedule.h"

namespace ciuic::daemon {

using internode_internal::Dep;
using internode_internal::Mod;

absl::Status AllgatherRing(const InterNodeContext& ctx, void* data,
                           const std::vector<Block>& blocks) {
  constexpr const char* kName = "AllgatherRing";
  if (absl::Status s = internode_internal::CheckContext(ctx, kName); !s.ok()) return s;
  const int n = ctx.transport->num_peers();
  const int r = ctx.transport->self();
  for (const Block& b : blocks) {
    if (b.owner < 0 || b.owner >= n || b.offset + b.bytes < b.offset) {
      return absl::InvalidArgumentError(absl::StrCat(kName, ": block at ", b.offset, " (", b.bytes,
                                                     " bytes) has owner ", b.owner, " of ", n,
                                                     " nodes or wraps around"));
    }
  }
  if (n <= 1) return absl::OkStatus();

  internode_internal::Schedule sched;
  sched.name = kName;
  sched.num_tag_steps = n - 1;
  const int chunk_bits = internode_internal::ChunkBits(sched.num_tag_steps, ctx.tag_bits);
  // Chunks of the owner with the most: the same number on every node.
  absl::StatusOr<size_t> chunk = internode_internal::PlanChunkBytes(
      ctx.chunk_bytes, 1, chunk_bits, [&blocks, n](size_t c) {
        std::vector<size_t> per_owner(n, 0);
        for (const Block& b : blocks) per_owner[b.owner] += (b.bytes + c - 1) / c;
        return *std::max_element(per_owner.begin(), per_owner.end());
      });
  if (!chunk.ok()) {
    return absl::Status(chunk.status().code(),
                        absl::StrCat(kName, ": ", chunk.status().message()));
  }

  auto* bytes = static_cast<uint8_t*>(data);
  auto add_owner = [&](internode_internal::Side& side, int owner) {
    for (const Block& b : blocks) {
      if (b.owner == owner) side.Add(bytes + b.offset, b.bytes);
    }
  };
  sched.steps.resize(n - 1);
  for (int s = 0; s < n - 1; ++s) {
    internode_internal::Step& st = sched.steps[s];
    st.tag_step = s;
    st.send.peer = Mod(r + 1, n);
    add_owner(st.send, Mod(r - s, n));
    st.recv.peer = Mod(r - 1, n);
    add_owner(st.recv, Mod(r - s - 1, n));
    if (s > 0) {
      st.send_dep = Dep::kChunk;
      st.send_dep_step = s - 1;
    }
  }
  return internode_internal::RunSchedule(ctx, sched, *chunk, chunk_bits);
}

}  // namespace ciuic::daemon
