// Ring allreduce: reduce-scatter then allgather (see ../README.md).
//
// The buffer is cut into N segments (count/N elements, the first count%N of
// them one more). Node r sends to r+1 and receives from r-1. Reduce-scatter
// step s (0..N-2): send segment r-s, receive segment r-s-1 and reduce it
// into place (received partial first, so segment g is folded in ring order
// g, g+1, ..., g-1). After N-1 steps node r holds segment r+1 fully reduced.
// Allgather step s: send segment r+1-s, receive segment r-s in place. Every
// send forwards what the previous step received, chunk by chunk, so chunk c
// of a segment moves on as soon as it is reduced, without a step barrier.
//
// Two nodes: each element is reduced once, by the node that owns its
// segment, and in node order, op(node 0's value, node 1's value), not ring
// order (node 0 would otherwise put node 1's value first for its segment).
// So every element's result is what recursive doubling gives too, whatever
// its offset: a 2-node allreduce fused with others (ClusterJob::ExecuteFused)
// or not, by either algorithm, gives the same bits.
//
// Out of place (`input` given): every segment but r is folded in at exactly
// one reduce-scatter step, which can read the local contribution from
// `input` and write the partial sum into `data`; segment r is sent at step 0
// straight from `input` and arrives whole in the allgather. So nothing copies
// `input` over `data` first, and the reduction order (hence the bits) is the
// in-place one.
#include <algorithm>
#include <cstdint>
#include <cstring>

#include "collectives/internode/common.h"
#include "collectives/internode/internode.h"
#include "collectives/internode/schedule.h"

namespace ciuic::daemon {

using internode_internal::Dep;
using internode_internal::Mod;

absl::Status AllreduceRing(const InterNodeContext& ctx, wire::DataType dtype, wire::ReduceOp op,
                           void* data, size_t count, const void* input) {
  constexpr const char* kName = "AllreduceRing";
  if (absl::Status s = internode_internal::CheckReduction(dtype, op, kName); !s.ok()) return s;
  if (absl::Status s = internode_internal::CheckContext(ctx, kName); !s.ok()) return s;
  const int n = ctx.transport->num_peers();
  const int r = ctx.transport->self();
  const size_t elem = wire::DataTypeSize(static_cast<uint32_t>(dtype));
  if (input == data) input = nullptr;
  if (n <= 1 || count == 0) {
    if (input != nullptr && count > 0) std::memcpy(data, input, count * elem);
    return absl::OkStatus();
  }

  const size_t base = count / n, extra = count % n;
  auto* bytes = static_cast<uint8_t*>(data);
  auto seg_ptr = [&](int g) { return bytes + (g * base + std::min<size_t>(g, extra)) * elem; };
  // The input's copy of a segment (the same offset in `input`); `data` itself in place.
  const intptr_t input_offset =
      input == nullptr ? 0
                       : static_cast<intptr_t>(reinterpret_cast<uintptr_t>(input) -
                                               reinterpret_cast<uintptr_t>(data));
  auto input_seg_ptr = [&](int g) {
    return reinterpret_cast<uint8_t*>(reinterpret_cast<uintptr_t>(seg_ptr(g)) + input_offset);
  };
  auto seg_bytes = [&](int g) { return (base + (static_cast<size_t>(g) < extra ? 1 : 0)) * elem; };

  internode_internal::Schedule sched;
  sched.name = kName;
  sched.dtype = dtype;
  sched.op = op;
  sched.num_tag_steps = 2 * (n - 1);
  const int chunk_bits = internode_internal::ChunkBits(sched.num_tag_steps, ctx.tag_bits);
  const size_t max_seg = seg_bytes(0);
  absl::StatusOr<size_t> chunk = internode_internal::PlanChunkBytes(
      ctx.chunk_bytes, elem, chunk_bits, [max_seg](size_t c) { return (max_seg + c - 1) / c; });
  if (!chunk.ok()) {
    return absl::Status(chunk.status().code(),
                        absl::StrCat(kName, ": ", chunk.status().message()));
  }

  sched.steps.resize(2 * (n - 1));
  for (int s = 0; s < n - 1; ++s) {
    internode_internal::Step& st = sched.steps[s];
    st.tag_step = s;
    st.send.peer = Mod(r + 1, n);
    // Step 0 sends this node's own contribution; later steps forward the
    // partial sums the previous step wrote into `data`.
    st.send.Add(s == 0 ? input_seg_ptr(r) : seg_ptr(Mod(r - s, n)), seg_bytes(Mod(r - s, n)));
    st.recv.peer = Mod(r - 1, n);
    st.recv.Add(seg_ptr(Mod(r - s - 1, n)), seg_bytes(Mod(r - s - 1, n)));
    st.reduce = true;
    st.received_first = n > 2 || st.recv.peer < r;  // see "Two nodes" above
    st.local_offset = input_offset;
    if (s > 0) {
      st.send_dep = Dep::kChunk;
      st.send_dep_step = s - 1;
    }
  }
  for (int s = 0; s < n - 1; ++s) {
    const int i = n - 1 + s;
    internode_internal::Step& st = sched.steps[i];
    st.tag_step = i;
    st.send.peer = Mod(r + 1, n);
    st.send.Add(seg_ptr(Mod(r + 1 - s, n)), seg_bytes(Mod(r + 1 - s, n)));
    st.recv.peer = Mod(r - 1, n);
    st.recv.Add(seg_ptr(Mod(r - s, n)), seg_bytes(Mod(r - s, n)));
    st.send_dep = Dep::kChunk;
    st.send_dep_step = i - 1;
    // Reduce-scatter step s sent segment r-s; out of place, step 0 sent it
    // from `input`, which the allgather does not write.
    if (!(s == 0 && input != nullptr)) st.write_after_send_step = s;
  }
  return internode_internal::RunSchedule(ctx, sched, *chunk, chunk_bits);
}

}  // namespace ciuic::daemon
