// PlanSingleNode: see device_plan.h.
#include "cuda/device_plan.h"

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

}  // namespace ciuic::daemon
