// Recursive-doubling allreduce with the standard fold for N not a power of
// two (see ../README.md).
//
// P = the largest power of two <= N, E = N - P. Fold: among nodes 0..2E-1,
// each even node r sends its whole buffer to r+1, which reduces it in
// (r's value first) and takes part for both; the even nodes wait. The P
// remaining nodes get virtual ranks v (r/2 for the odd fold nodes, r-E
// beyond them) and do log2(P) exchanges: at round k, v and v^2^k swap their
// whole buffers and both compute Reduce({lower v's buffer, higher v's
// buffer}), the same operands in the same order on both sides, hence the
// same bits. Finally each odd fold node sends the result to its even node.
// Every exchange is pipelined in chunks; a node reduces chunk c of round k
// into its buffer only after its own send of chunk c of round k completed,
// and sends chunk c of round k+1 as soon as it is reduced.
//
// Tag steps: 0 fold, 1..log2(P) rounds, log2(P)+1 unfold.
#include <bit>

#include "collectives/internode/common.h"
#include "collectives/internode/internode.h"
#include "collectives/internode/schedule.h"

namespace ciuic::daemon {

using internode_internal::Dep;

absl::Status AllreduceHalvingDoubling(const InterNodeContext& ctx, wire::DataType dtype,
                                      wire::ReduceOp op, void* data, size_t count) {
  constexpr const char* kName = "AllreduceHalvingDoubling";
  if (absl::Status s = internode_internal::CheckReduction(dtype, op, kName); !s.ok()) return s;
  if (absl::Status s = internode_internal::CheckContext(ctx, kName); !s.ok()) return s;
  const int n = ctx.transport->num_peers();
  const int r = ctx.transport->self();
  if (n <= 1 || count == 0) return absl::OkStatus();

  const size_t elem = wire::DataTypeSize(static_cast<uint32_t>(dtype));
  const size_t total = count * elem;
  auto* bytes = static_cast<uint8_t*>(data);
  const int p = static_cast<int>(std::bit_floor(static_cast<unsigned>(n)));
  const int rounds = std::countr_zero(static_cast<unsigned>(p));
  const int extra = n - p;

  internode_internal::Schedule sched;
  sched.name = kName;
  sched.dtype = dtype;
  sched.op = op;
  sched.num_tag_steps = rounds + 2;
  const int chunk_bits = internode_internal::ChunkBits(sched.num_tag_steps, ctx.tag_bits);
  absl::StatusOr<size_t> chunk = internode_internal::PlanChunkBytes(
      ctx.chunk_bytes, elem, chunk_bits, [total](size_t c) { return (total + c - 1) / c; });
  if (!chunk.ok()) {
    return absl::Status(chunk.status().code(),
                        absl::StrCat(kName, ": ", chunk.status().message()));
  }

  auto real = [extra](int v) { return v < extra ? 2 * v + 1 : v + extra; };
  if (r < 2 * extra && r % 2 == 0) {
    // Folded away: hand the buffer over, get the result back.
    sched.steps.resize(2);
    internode_internal::Step& fold = sched.steps[0];
    fold.tag_step = 0;
    fold.send.peer = r + 1;
    fold.send.Add(bytes, total);
    internode_internal::Step& unfold = sched.steps[1];
    unfold.tag_step = rounds + 1;
    unfold.recv.peer = r + 1;
    unfold.recv.Add(bytes, total);
    unfold.write_after_send_step = 0;
    return internode_internal::RunSchedule(ctx, sched, *chunk, chunk_bits);
  }

  const int v = r < 2 * extra ? r / 2 : r - extra;
  const bool folds = r < 2 * extra;
  int prev = -1;  // the step whose result the next send forwards
  if (folds) {
    internode_internal::Step& fold = sched.steps.emplace_back();
    fold.tag_step = 0;
    fold.recv.peer = r - 1;
    fold.recv.Add(bytes, total);
    fold.reduce = true;
    fold.received_first = true;  // r-1 < r
    prev = 0;
  }
  for (int k = 0; k < rounds; ++k) {
    const int pv = v ^ (1 << k);
    const int i = static_cast<int>(sched.steps.size());
    internode_internal::Step& st = sched.steps.emplace_back();
    st.tag_step = k + 1;
    st.send.peer = real(pv);
    st.send.Add(bytes, total);
    st.recv.peer = real(pv);
    st.recv.Add(bytes, total);
    st.reduce = true;
    st.received_first = pv < v;
    st.write_after_send_step = i;
    if (prev >= 0) {
      st.send_dep = Dep::kChunk;
      st.send_dep_step = prev;
    }
    prev = i;
  }
  if (folds) {
    internode_internal::Step& unfold = sched.steps.emplace_back();
    unfold.tag_step = rounds + 1;
    unfold.send.peer = r - 1;
    unfold.send.Add(bytes, total);
    unfold.send_dep = Dep::kChunk;
    unfold.send_dep_step = prev;
  }
  return internode_internal::RunSchedule(ctx, sched, *chunk, chunk_bits);
}

}  // namespace ciuic::daemon
