#include "cluster/run_plan.h"

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace ciuic::daemon {

size_t SegmentElements(uint64_t segment_bytes, size_t count, size_t element_bytes) {
  const size_t per = std::max<size_t>(1, segment_bytes / element_bytes);
  return std::max(per, (count + kMaxSegments - 1) / kMaxSegments);
}

size_t MoveSegmentElements(uint64_t segment_bytes, bool gather, size_t count, size_t element_bytes,
                           int world) {
  if (segment_bytes == 0) return std::max<size_t>(count, 1);
  const uint64_t piece = gather ? segment_bytes / static_cast<uint64_t>(world) : segment_bytes;
  return SegmentElements(std::max<uint64_t>(piece, element_bytes), count, element_bytes);
}

void CopyBytes(void* to, const void* from, size_t bytes) {
  if (bytes > 0) std::memcpy(to, from, bytes);
}

absl::StatusOr<RankPairs> PairsOf(const ClusterOp& op, const ClusterOp::Part& p, size_t world) {
  const bool v = op.sig.collective == static_cast<uint32_t>(wire::Collective::kAlltoallv);
  if (v && (p.send_counts.size() != world || p.recv_counts.size() != world)) {
    return absl::InternalError(
        absl::StrCat("alltoallv of rank ", p.rank, " without counts for every rank"));
  }
  RankPairs r;
  for (size_t j = 0; j < world; ++j) {
    r.send_at.push_back(r.sent);
    r.recv_at.push_back(r.got);
    r.send.push_back(v ? p.send_counts[j] : op.sig.count);
    r.recv.push_back(v ? p.recv_counts[j] : op.sig.count);
    r.sent += r.send.back();
    r.got += r.recv.back();
  }
  return r;
}

std::pair<uint64_t, uint64_t> PartOfSegment(uint64_t count, uint64_t segments, uint64_t k) {
  const uint64_t q = count / segments + (count % segments != 0);
  const uint64_t at = std::min(count, q * k);
  return {at, at + std::min(q, count - at)};
}

AlltoallBuffers SegmentPieces(const RankPairs& pairs, uint64_t segments, uint64_t k, size_t es) {
  AlltoallBuffers b;
  for (size_t j = 0; j < pairs.send.size(); ++j) {
    const auto [s0, s1] = PartOfSegment(pairs.send[j], segments, k);
    const auto [r0, r1] = PartOfSegment(pairs.recv[j], segments, k);
    b.send_offsets.push_back((pairs.send_at[j] + s0) * es);
    b.send_bytes.push_back((s1 - s0) * es);
    b.recv_offsets.push_back((pairs.recv_at[j] + r0) * es);
    b.recv_bytes.push_back((r1 - r0) * es);
  }
  return b;
}

absl::StatusOr<uint64_t> AlltoallSegmentsOf(const RunSettings& settings) {
  if (settings.segment_bytes == 0) return 0;
  if (settings.segments == 0) {
    return absl::InternalError(
        "coordinator announced an alltoall in segments without their number (a daemon of "
        "another version?)");
  }
  return settings.segments;
}

uint64_t AlltoallRankBytes(const ClusterOp& op, size_t world) {
  uint64_t most = 0;
  for (const ClusterOp::Part& p : op.parts) {
    auto pairs = PairsOf(op, p, world);
    if (pairs.ok()) most = std::max({most, pairs->sent, pairs->got});
  }
  return most * op.sig.element_bytes();
}

std::vector<const ClusterOp::Part*> PartsInRankOrder(const ClusterOp& op) {
  std::vector<const ClusterOp::Part*> parts;
  for (const auto& p : op.parts) parts.push_back(&p);
  std::sort(parts.begin(), parts.end(), [](auto* a, auto* b) { return a->rank < b->rank; });
  return parts;
}

void CopyLocalPairs(const std::vector<AlltoallBuffers>& ranks, const std::vector<bool>& local) {
  for (size_t from = 0; from < ranks.size(); ++from) {
    if (!local[from]) continue;
    const AlltoallBuffers& f = ranks[from];
    for (size_t to = 0; to < ranks.size(); ++to) {
      const uint64_t bytes = f.send_bytes[to];
      if (local[to] && bytes > 0) {
        const AlltoallBuffers& t = ranks[to];
        std::memcpy(t.recv + t.RecvAt(from), f.send + f.SendAt(to), bytes);
      }
    }
  }
}

absl::Status PipelineSegments(StagedNodeBuffer& device, size_t segments, size_t slot_bytes,
                              const std::function<absl::Status(int, size_t)>& fetch,
                              const std::function<absl::Status(uint8_t*, size_t)>& carry,
                              const std::function<absl::Status(int, size_t)>& store) {
  uint8_t* slot[2] = {nullptr, nullptr};
  for (size_t k = 0; k < std::min<size_t>(2, segments); ++k) {
    auto p = device.Slot(static_cast<int>(k), slot_bytes);
    if (!p.ok()) return p.status();
    slot[k] = *p;
    if (absl::Status s = fetch(static_cast<int>(k), k); !s.ok()) return s;
  }
  for (size_t k = 0; k < segments; ++k) {
    const int sl = static_cast<int>(k % 2);
    if (absl::Status s = device.Wait(sl); !s.ok()) return s;
    absl::Status s = carry(slot[sl], k);
    if (!s.ok()) return s;
    if (s = store(sl, k); !s.ok()) return s;
    if (k + 2 < segments) {
      if (s = fetch(sl, k + 2); !s.ok()) return s;
    }
  }
  return absl::OkStatus();
}

}  // namespace ciuic::daemon
