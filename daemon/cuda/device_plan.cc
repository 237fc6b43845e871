// PlanSingleNode: see device_plan.h.
#include "cuda/device_plan.h"

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace ciuic::daemon {

absl::StatusOr<std::vector<DeviceStep>> PlanSingleNode(const OpSignature& sig,
                                                       const std::vector<DeviceRankBuffers>& ranks,
                                                       const std::vector<uint8_t*>& send,
                                                       const std::vector<uint8_t*>& recv) {
  const size_t world = ranks.size();
  if (send.size() != world || recv.size() != world) {
    return absl::InternalError("device plan: a buffer list of another size than the ranks'");
  }
  std::vector<DeviceStep> steps;
  const uint64_t block = sig.count * sig.element_bytes();
  // A copy of `bytes` (in place: none).
  auto copy = [&steps](uint8_t* to, const uint8_t* from, uint64_t bytes) {
    if (to == from || bytes == 0) return;
    DeviceStep s;
    s.kind = DeviceStep::Kind::kCopy;
    s.to = to;
    s.from = from;
    s.bytes = bytes;
    steps.push_back(std::move(s));
  };
  // The rank's send buffer, or its receive buffer where it works in place.
  auto input = [&](size_t r) -> const uint8_t* { return send[r] != nullptr ? send[r] : recv[r]; };
  const auto collective = static_cast<wire::Collective>(sig.collective);
  if (collective == wire::Collective::kAlltoallv) {
    // Rank `from`'s piece for `to` into `to`'s piece from `from`, at the sums
    // of the counts before them (the engine checked that the pairs agree).
    const size_t es = sig.element_bytes();
    for (size_t from = 0; from < world; ++from) {
      if (ranks[from].send_counts.size() != world) {
        return absl::InternalError(absl::StrCat("device plan: rank ", from, " has ",
                                                ranks[from].send_counts.size(), " send counts for ",
                                                world, " ranks"));
      }
      uint64_t at = 0;
      for (size_t to = 0; to < world; ++to) {
        if (ranks[to].recv_counts.size() != world) {
          return absl::InternalError(absl::StrCat("device plan: rank ", to, " has ",
                                                  ranks[to].recv_counts.size(),
                                                  " receive counts for ", world, " ranks"));
        }
        const uint64_t bytes = ranks[from].send_counts[to] * es;
        uint64_t into = 0;
        for (size_t k = 0; k < from; ++k) into += ranks[to].recv_counts[k] * es;
        if (bytes > 0) {
          if (send[from] == nullptr || recv[to] == nullptr) {
            return absl::InternalError(absl::StrCat("device plan: alltoallv piece of rank ", from,
                                                    " for rank ", to, " without its buffers"));
          }
          copy(recv[to] + into, send[from] + at, bytes);
        }
        at += bytes;
      }
    }
    return steps;
  }
  if (sig.count == 0) return steps;
  for (size_t r = 0; r < world; ++r) {
    if (recv[r] == nullptr) {
      return absl::InternalError(absl::StrCat("device plan: rank ", r, " has no receive buffer"));
    }
  }
  switch (collective) {
    case wire::Collective::kAllreduce: {
      // One pass: every input read once, every output written once.
      DeviceStep s;
      s.kind = DeviceStep::Kind::kReduceToAll;
      for (size_t r = 0; r < world; ++r) s.inputs.push_back(input(r));
      s.outputs = recv;
      steps.push_back(std::move(s));
      break;
    }
    case wire::Collective::kReduceScatter:
      // Block `owner` of every send buffer reduces into owner's output.
      for (size_t owner = 0; owner < world; ++owner) {
        DeviceStep s;
        s.kind = DeviceStep::Kind::kReduce;
        for (size_t r = 0; r < world; ++r) {
          if (send[r] == nullptr) {
            return absl::InternalError(
                absl::StrCat("device plan: reduce_scatter rank ", r, " has no send buffer"));
          }
          s.inputs.push_back(send[r] + owner * block);
        }
        s.outputs = {recv[owner]};
        steps.push_back(std::move(s));
      }
      break;
    case wire::Collective::kAllgather:
      // In place, a rank's input is its own block of its receive buffer.
      for (size_t owner = 0; owner < world; ++owner) {
        const uint8_t* from = send[owner] != nullptr ? send[owner] : recv[owner] + owner * block;
        for (size_t r = 0; r < world; ++r) copy(recv[r] + owner * block, from, block);
      }
      break;
    case wire::Collective::kBroadcast: {
      const auto root = static_cast<size_t>(sig.root);
      if (sig.root < 0 || root >= world) {
        return absl::InternalError(
            absl::StrCat("device plan: broadcast root ", sig.root, " of ", world, " ranks"));
      }
      const uint8_t* from = input(root);
      for (size_t r = 0; r < world; ++r) copy(recv[r], from, block);
      break;
    }
    case wire::Collective::kAlltoall:
      // Rank `from`'s block for rank `to` into `to`'s block from `from`.
      for (size_t from = 0; from < world; ++from) {
        if (send[from] == nullptr) {
          return absl::InternalError(
              absl::StrCat("device plan: alltoall rank ", from, " has no send buffer"));
        }
        for (size_t to = 0; to < world; ++to) {
          copy(recv[to] + from * block, send[from] + to * block, block);
        }
      }
      break;
    default:
      return absl::InternalError(
          absl::StrCat("device plan: no device buffers for collective ", sig.collective));
  }
  return steps;
}

absl::StatusOr<StagedLayout> PlanStaged(const OpSignature& sig, int world,
                                        const std::vector<DeviceRankBuffers>& ranks) {
  const auto collective = static_cast<wire::Collective>(sig.collective);
  if (collective == wire::Collective::kBarrier) {
    return absl::InternalError("a barrier has no device buffers");
  }
  const bool scatter = collective == wire::Collective::kReduceScatter;
  const bool gather = collective == wire::Collective::kAllgather;
  const bool broadcast = collective == wire::Collective::kBroadcast;
  const bool v_splits = collective == wire::Collective::kAlltoallv;
  const bool a2a = collective == wire::Collective::kAlltoall || v_splits;
  const size_t es = sig.element_bytes();
  const size_t block = sig.count * es;
  const size_t all = block * static_cast<size_t>(world);
  // An alltoall's node buffer: the local ranks' send buffers back to back in
  // rank order (alltoall: `all` bytes each; alltoallv: the sums of each
  // rank's counts), where an alltoall's received blocks land too; an
  // alltoallv's land after them, in rank order (staged_buffer.h).
  auto send_size = [&](const DeviceRankBuffers& b) {
    return v_splits ? static_cast<size_t>(b.send_bytes) : all;
  };
  auto recv_size = [&](const DeviceRankBuffers& b) {
    return v_splits ? static_cast<size_t>(b.recv_bytes) : all;
  };
  auto place = [&ranks](const DeviceRankBuffers& b, auto size) {
    size_t before = 0;
    for (const DeviceRankBuffers& o : ranks) before += o.rank < b.rank ? size(o) : 0;
    return before;
  };
  size_t sent = 0, got = 0;  // an alltoall's, by the node's ranks
  for (const DeviceRankBuffers& b : ranks) {
    sent += a2a ? send_size(b) : 0;
    got += a2a ? recv_size(b) : 0;
  }
  const size_t recv_base = v_splits ? sent : 0;
  StagedLayout l;
  l.count = a2a                 ? (v_splits ? sent + got : std::max(sent, got)) / es
            : scatter || gather ? sig.count * static_cast<size_t>(world)
                                : sig.count;
  l.own_node = scatter || a2a;
  l.reduce = !a2a && !gather && !broadcast;
  const size_t output_bytes = gather || a2a ? all : block;
  const size_t input_bytes = a2a ? all : gather || broadcast ? block : 0;
  for (const DeviceRankBuffers& b : ranks) {
    StagedLayout::Rank r;
    r.has_input = !broadcast || b.rank == sig.root;
    r.input_offset = a2a ? place(b, send_size) : gather ? static_cast<size_t>(b.rank) * block : 0;
    r.in_place_offset = gather ? static_cast<size_t>(b.rank) * block : 0;
    r.needs_send = scatter || (a2a && !v_splits);
    r.output_offset = a2a       ? recv_base + place(b, recv_size)
                      : scatter ? static_cast<size_t>(b.rank) * block
                                : 0;
    r.input_size = v_splits ? send_size(b) : input_bytes;
    r.output_size = v_splits ? recv_size(b) : output_bytes;
    l.ranks.push_back(r);
  }
  return l;
}

Mirrors Mirror(const std::vector<DeviceRankBuffers>& ranks, int device,
               const std::vector<bool>& send_far, const std::vector<bool>& recv_far,
               uint8_t* scratch, std::vector<uint8_t*>* send, std::vector<uint8_t*>* recv) {
  constexpr size_t kAlign = 256;  // every mirror starts as cudaMalloc'd memory does
  Mirrors m;
  auto place = [&](size_t bytes) {
    const size_t at = m.bytes;
    m.bytes += (bytes + kAlign - 1) / kAlign * kAlign;
    return at;
  };
  auto copy = [&](std::vector<DeviceStep>* steps, uint8_t* to, int to_device, const uint8_t* from,
                  int from_device, size_t bytes) {
    DeviceStep s;
    s.kind = DeviceStep::Kind::kPeerCopy;
    s.to = to;
    s.from = from;
    s.bytes = bytes;
    s.to_device = to_device;
    s.from_device = from_device;
    steps->push_back(std::move(s));
  };
  for (size_t r = 0; r < ranks.size(); ++r) {
    const DeviceRankBuffers& b = ranks[r];
    uint8_t* const recv_at = (*recv)[r];
    uint8_t* const send_at = (*send)[r];
    const bool has_recv = recv_at != nullptr && b.recv_bytes > 0;
    const bool has_send = send_at != nullptr && b.send_bytes > 0;
    const bool inside_recv = has_send && has_recv && send_at >= recv_at &&
                             static_cast<size_t>(send_at - recv_at) <= b.recv_bytes &&
                             b.send_bytes <= b.recv_bytes - static_cast<size_t>(send_at - recv_at);
    if (has_recv && recv_far[r]) {
      const size_t at = place(b.recv_bytes);
      if (scratch != nullptr) {
        // Every collective writes the whole receive buffer: its old
        // contents matter only where the rank's input is in it (in place).
        if (!has_send || inside_recv) {
          copy(&m.in, scratch + at, device, recv_at, b.recv.device, b.recv_bytes);
        }
        copy(&m.out, recv_at, b.recv.device, scratch + at, device, b.recv_bytes);
        (*recv)[r] = scratch + at;
      }
    }
    if (!has_send || !send_far[r]) continue;
    if (inside_recv && recv_far[r]) {
      if (scratch != nullptr) (*send)[r] = (*recv)[r] + (send_at - recv_at);
      continue;
    }
    const size_t at = place(b.send_bytes);
    if (scratch != nullptr) {
      copy(&m.in, scratch + at, device, send_at, b.send.device, b.send_bytes);
      (*send)[r] = scratch + at;
    }
  }
  return m;
}

absl::StatusOr<StagedPointers> PointersFor(const OpSignature& sig, const StagedLayout& layout,
                                           const std::vector<const void*>& send,
                                           const std::vector<void*>& recv) {
  const size_t n = layout.ranks.size();
  if (send.size() != n || recv.size() != n || n == 0) {
    return absl::InternalError("staged pointers: buffer lists of another size than the ranks'");
  }
  const bool v_splits = sig.collective == static_cast<uint32_t>(wire::Collective::kAlltoallv);
  StagedPointers p;
  if (!v_splits) {
    p.input_bytes = layout.ranks[0].input_size;
    p.output_bytes = layout.ranks[0].output_size;
  }
  for (size_t i = 0; i < n; ++i) {
    const StagedLayout::Rank& at = layout.ranks[i];
    if (at.needs_send && send[i] == nullptr) {
      // Validation gives every reduce_scatter and alltoall rank a send
      // buffer of world blocks (alltoall is never in place).
      return absl::InternalError(
          absl::StrCat("rank ", i, " of the node's ", sig.ToString(), " has no send buffer"));
    }
    p.outputs.push_back(recv[i]);
    p.output_offsets.push_back(at.output_offset);
    if (v_splits) {
      p.input_sizes.push_back(at.input_size);
      p.output_sizes.push_back(at.output_size);
    }
    if (!at.has_input) continue;
    // In place, without a send buffer: its input is in its receive buffer.
    const void* input = send[i];
    if (input == nullptr && recv[i] != nullptr) {
      input = static_cast<const uint8_t*>(recv[i]) + at.in_place_offset;
    }
    p.inputs.push_back(input);
    if (!layout.reduce) p.input_offsets.push_back(at.input_offset);
  }
  return p;
}

}  // namespace ciuic::daemon
