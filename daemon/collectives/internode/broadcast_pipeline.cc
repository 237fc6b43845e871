// Broadcast: binomial tree for a message of one chunk, chunked chain
// otherwise (see ../README.md). Positions are relative to the root:
// v = (r - root) mod N.
//
// Tree (bytes <= chunk size): at round k = 0..ceil(log2 N)-1 every v < 2^k
// sends to v + 2^k; ceil(log2 N) hops instead of the chain's N-1, which
// matters when a chunk cannot be pipelined anyway.
// Chain (more than one chunk): v receives from v-1 and forwards each chunk to
// v+1 as soon as it has it; N-1 + chunks-1 chunk times, every node sends and
// receives the message once (the root only sends, the last only receives).
#include <algorithm>
#include <bit>

#include "collectives/internode/common.h"
#include "collectives/internode/internode.h"
#include "collectives/internode/schedule.h"

namespace ciuic::daemon {

using internode_internal::Dep;
using internode_internal::Mod;

absl::Status BroadcastPipeline(const InterNodeContext& ctx, void* data, size_t bytes, int root) {
  constexpr const char* kName = "BroadcastPipeline";
  if (absl::Status s = internode_internal::CheckContext(ctx, kName); !s.ok()) return s;
  const int n = ctx.transport->num_peers();
  const int r = ctx.transport->self();
  if (root < 0 || root >= n) {
    return absl::InvalidArgumentError(absl::StrCat(kName, ": root ", root, " of ", n, " nodes"));
  }
  if (n <= 1 || bytes == 0) return absl::OkStatus();

  const int rounds = std::bit_width(static_cast<unsigned>(n - 1));  // ceil(log2 n)
  const bool tree = bytes <= std::max<uint64_t>(1, ctx.chunk_bytes);
  internode_internal::Schedule sched;
  sched.name = kName;
  sched.num_tag_steps = tree ? rounds : 1;
  const int chunk_bits = internode_internal::ChunkBits(sched.num_tag_steps, ctx.tag_bits);
  absl::StatusOr<size_t> chunk = internode_internal::PlanChunkBytes(
      ctx.chunk_bytes, 1, chunk_bits, [bytes](size_t c) { return (bytes + c - 1) / c; });
  if (!chunk.ok()) {
    return absl::Status(chunk.status().code(),
                        absl::StrCat(kName, ": ", chunk.status().message()));
  }
  auto* buf = static_cast<uint8_t*>(data);
  const int v = Mod(r - root, n);
  auto real = [root, n](int pos) { return Mod(pos + root, n); };

  if (tree) {
    // Binomial tree: v receives at round bit_width(v)-1 from v - 2^round and
    // sends at every later round k to v + 2^k.
    int recv_step = -1;
    if (v > 0) {
      const int k = std::bit_width(static_cast<unsigned>(v)) - 1;
      internode_internal::Step& st = sched.steps.emplace_back();
      st.tag_step = k;
      st.recv.peer = real(v - (1 << k));
      st.recv.Add(buf, bytes);
      recv_step = 0;
    }
    for (int k = std::bit_width(static_cast<unsigned>(v)); k < rounds; ++k) {
      if (v + (1 << k) >= n) break;
      internode_internal::Step& st = sched.steps.emplace_back();
      st.tag_step = k;
      st.send.peer = real(v + (1 << k));
      st.send.Add(buf, bytes);
      if (recv_step >= 0) {
        st.send_dep = Dep::kChunk;
        st.send_dep_step = recv_step;
      }
    }
    return internode_internal::RunSchedule(ctx, sched, *chunk, chunk_bits);
  }

  internode_internal::Step& st = sched.steps.emplace_back();
  st.tag_step = 0;
  if (v > 0) {
    st.recv.peer = real(v - 1);
    st.recv.Add(buf, bytes);
  }
  if (v < n - 1) {
    st.send.peer = real(v + 1);
    st.send.Add(buf, bytes);
    if (v > 0) {
      st.send_dep = Dep::kChunk;
      st.send_dep_step = 0;
    }
  }
  return internode_internal::RunSchedule(ctx, sched, *chunk, chunk_bits);
}

}  // namespace ciuic::daemon
