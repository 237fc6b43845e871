// How ClusterJob lays out a run between nodes, shared by its host and
// device (staged) executors and its direct operations: the transport tags
// of runs, segments and direct operations; how long operations are cut
// into segments; an alltoall's pieces per rank pair; the staged pipeline
// through two host slots. Plain functions of an operation and its run's
// settings, so that every node cuts alike.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "cluster/cluster_job.h"
#include "cluster/run_settings.h"
#include "collectives/internode/internode.h"
#include "collectives/staged_buffer.h"

namespace ciuic::daemon {

// Tags (InterNodeContext::tag_base): bits 24..47 are the operation's, the
// low 24 the algorithm's. A whole run: bits 47 and 46 clear, its seq's low
// 22 bits. Segment k of a run announced with segment_bytes: bit 47 set, the
// seq's low 11 bits (runs in flight at once are consecutive), k's 12: at
// most kMaxSegments (run_settings.h). A direct operation: bit 47 clear, bit
// 46 set, and the low 8 bits its exchange's (DirectExchange::kTagBits);
// an unnamed one "#N": bit 45 clear, N's low 37 bits; a named one: bit 45
// set, its name's slot (12 bits: at most ClusterJob::kMaxNamedSlots) and
// its occurrence's low 25 bits. Direct ops in flight at once are bounded by
// the ranks' completion rings, far fewer than 2^25 (cluster_job_direct.cc).
static_assert(kMaxSegments == uint64_t{1} << 12);
static_assert(ClusterJob::kMaxNamedSlots <= uint64_t{1} << 12);

inline uint64_t RunTagBase(uint64_t seq) { return (seq & 0x3fffff) << 24; }

inline uint64_t SegmentTagBase(uint64_t seq, size_t segment) {
  return (uint64_t{1} << 47) | ((seq & 0x7ff) << 36) | ((segment & 0xfff) << 24);
}

inline uint64_t DirectTagBase(uint64_t number) {
  return (uint64_t{1} << 46) | ((number & ((uint64_t{1} << 37) - 1)) << 8);
}

inline uint64_t NamedDirectTagBase(uint32_t slot, uint64_t occurrence) {
  return (uint64_t{3} << 45) | (uint64_t{slot & 0xfffu} << 33) |
         ((occurrence & ((uint64_t{1} << 25) - 1)) << 8);
}

// Elements per segment of an allreduce of `count` elements of `element_bytes`
// announced with `segment_bytes` (> 0).
size_t SegmentElements(uint64_t segment_bytes, size_t count, size_t element_bytes);

// Elements of each rank's block per segment of an allgather (whose segment
// carries a piece of every rank's block) or a broadcast announced with
// `segment_bytes`; `count` (the whole block: one segment) without.
size_t MoveSegmentElements(uint64_t segment_bytes, bool gather, size_t count, size_t element_bytes,
                           int world);

// memcpy for a rank's buffer, which a 0-element operation may leave out
// (nullptr): memcpy must not get a null pointer even for 0 bytes.
void CopyBytes(void* to, const void* from, size_t bytes);

// One local rank's alltoall(v) pairs, in elements: what it sends to and
// receives from each rank of the job, and where each block lies in its
// buffers (back to back in rank order).
struct RankPairs {
  std::vector<uint64_t> send, recv;        // per rank of the job
  std::vector<uint64_t> send_at, recv_at;  // elements before
  uint64_t sent = 0, got = 0;              // in all
};

// Rank part p's pairs in op: the operation's count with every rank for an
// alltoall, its counts for an alltoallv (INTERNAL if it lacks some).
absl::StatusOr<RankPairs> PairsOf(const ClusterOp& op, const ClusterOp::Part& p, size_t world);

// Part k of a rank pair's piece of `count` elements in an alltoall(v) of
// `segments` segments (Run.segments), [first, second) elements: parts of
// ceil(count / segments), the last ones shorter or empty. Both ends of the
// pair know the count, so they cut alike.
std::pair<uint64_t, uint64_t> PartOfSegment(uint64_t count, uint64_t segments, uint64_t k);

// Segment k's pieces of a rank with `pairs`, as AlltoallPairwise takes
// them: bytes of each, at their places in the rank's buffers.
AlltoallBuffers SegmentPieces(const RankPairs& pairs, uint64_t segments, uint64_t k, size_t es);

// An alltoall(v)'s segments under the run's settings: 0 when announced
// without segments (one whole exchange), else Run.segments.
absl::StatusOr<uint64_t> AlltoallSegmentsOf(const RunSettings& settings);

// The most bytes one of op's ranks on this node sends or receives in an
// alltoall(v) (Ready.rank_bytes).
uint64_t AlltoallRankBytes(const ClusterOp& op, size_t world);

// op's parts in rank order, whatever order they came in.
std::vector<const ClusterOp::Part*> PartsInRankOrder(const ClusterOp& op);

// An alltoall(v)'s pairs on this node: each local rank's block for each
// local rank copied into that rank's block from it (`ranks` as
// AlltoallPairwise takes them; local[r]: rank r is on this node).
void CopyLocalPairs(const std::vector<AlltoallBuffers>& ranks, const std::vector<bool>& local);

// The staged pipeline of `segments` segments through the buffer's two
// slots of `slot_bytes`: segments 0 and 1 fetched into slots 0 and 1, then
// segment k carried (`carry`, on its slot's memory, once its fetch is done)
// and stored, and segment k + 2 fetched into the same slot right after the
// store (the device queue orders them), while segment k + 1 travels.
absl::Status PipelineSegments(StagedNodeBuffer& device, size_t segments, size_t slot_bytes,
                              const std::function<absl::Status(int, size_t)>& fetch,
                              const std::function<absl::Status(uint8_t*, size_t)>& carry,
                              const std::function<absl::Status(int, size_t)>& store);

}  // namespace ciuic::daemon
