// Ring reduce-scatter (see ../README.md): the first half of the ring
// allreduce (allreduce_ring.cc), with each node's segment being the blocks
// it must end with rather than an even cut of the buffer. Segment g is the
// region of node g-1, so that after N-1 steps (step s: send segment r-s,
// receive segment r-s-1 and fold it in) node r holds segment r+1: its own
// region, reduced over every node. Every node sends (N-1)/N of the buffer
// once: half of what an allreduce followed by keeping one's own blocks
// costs. Two nodes reduce in node order (op(node 0, node 1)), like the ring
// and recursive doubling there, so the bits are those of the allreduce.
#include <algorithm>
#include <cstdint>
#include <cstring>

#include "collectives/internode/common.h"
#include "collectives/internode/internode.h"
#include "collectives/internode/schedule.h"

namespace ciuic::daemon {

using internode_internal::Dep;
using internode_internal::Mod;

absl::Status ReduceScatterRing(const InterNodeContext& ctx, wire::DataType dtype,
                               wire::ReduceOp op, void* data, const std::vector<Block>& blocks,
                               const void* input) {
  constexpr const char* kName = "ReduceScatterRing";
  if (absl::Status s = internode_internal::CheckReduction(dtype, op, kName); !s.ok()) return s;
  if (absl::Status s = internode_internal::CheckContext(ctx, kName); !s.ok()) return s;
  const int n = ctx.transport->num_peers();
  const int r = ctx.transport->self();
  const size_t elem = wire::DataTypeSize(static_cast<uint32_t>(dtype));
  for (const Block& b : blocks) {
    if (b.owner < 0 || b.owner >= n || b.offset % elem != 0 || b.bytes % elem != 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          kName, ": block at ", b.offset, " of ", b.bytes, " bytes for node ", b.owner,
          " is not whole elements of a node of ", n));
    }
  }
  if (input == data) input = nullptr;
  auto* bytes = static_cast<uint8_t*>(data);
  if (n <= 1) {
    if (input != nullptr) {
      for (const Block& b : blocks) {
        std::memcpy(bytes + b.offset, static_cast<const uint8_t*>(input) + b.offset, b.bytes);
      }
    }
    return absl::OkStatus();
  }
  const intptr_t input_offset =
      input == nullptr ? 0
                       : static_cast<intptr_t>(reinterpret_cast<uintptr_t>(input) -
                                               reinterpret_cast<uintptr_t>(data));
  // Segment g: the blocks of node g-1, from `data` or (at step 0) `input`.
  auto add_segment = [&](internode_internal::Side& side, int g, bool from_input) {
    const int owner = Mod(g - 1, n);
    for (const Block& b : blocks) {
      if (b.owner != owner) continue;
      side.Add(bytes + b.offset + (from_input ? input_offset : 0), b.bytes);
    }
  };

  internode_internal::Schedule sched;
  sched.name = kName;
  sched.dtype = dtype;
  sched.op = op;
  sched.num_tag_steps = n - 1;
  const int chunk_bits = internode_internal::ChunkBits(sched.num_tag_steps, ctx.tag_bits);
  absl::StatusOr<size_t> chunk = internode_internal::PlanChunkBytes(
      ctx.chunk_bytes, elem, chunk_bits, [&blocks, n](size_t c) {
        // The most chunks any one segment (node's region) is cut into.
        std::vector<size_t> chunks(n, 0);
        for (const Block& b : blocks) chunks[b.owner] += (b.bytes + c - 1) / c;
        return *std::max_element(chunks.begin(), chunks.end());
      });
  if (!chunk.ok()) {
    return absl::Status(chunk.status().code(),
                        absl::StrCat(kName, ": ", chunk.status().message()));
  }
  sched.steps.resize(n - 1);
  for (int s = 0; s < n - 1; ++s) {
    internode_internal::Step& st = sched.steps[s];
    st.tag_step = s;
    st.send.peer = Mod(r + 1, n);
    // Step 0 sends this node's own contribution; later steps forward the
    // partial sums the previous step wrote into `data`.
    add_segment(st.send, Mod(r - s, n), s == 0);
    st.recv.peer = Mod(r - 1, n);
    add_segment(st.recv, Mod(r - s - 1, n), false);
    st.reduce = true;
    st.received_first = n > 2 || st.recv.peer < r;  // two nodes: node order
    st.local_offset = input_offset;
    if (s > 0) {
      st.send_dep = Dep::kChunk;
      st.send_dep_step = s - 1;
    }
  }
  return internode_internal::RunSchedule(ctx, sched, *chunk, chunk_bits);
}

}  // namespace ciuic::daemon
