// The engine under every inter-node algorithm: a node's part of an algorithm
// is a list of steps, each sending byte ranges to one peer and/or receiving
// byte ranges from one peer; RunSchedule cuts them into chunks and moves them
// with up to max_inflight chunks in flight per direction, reducing each
// received chunk as it arrives (Transport::RecvReduce folds it into its
// destination fragment by fragment, no staging) while the others travel.
// A reducing chunk whose destination must wait for a send (see
// write_after_send_step) is received into scratch instead and folded once
// that send is done.
//
// Window: up to max_inflight sends, or one while ctx.yield says a
// higher-priority operation runs beside this one (re-read before each send).
//
// Ordering. Per channel, sends are posted in (step, chunk) order, and so
// are receives; a send or receive that must wait (for a dependency, a free
// window place or a scratch slot of its channel's own) holds back the ones
// after it on its channel. Since every node posts in the same global order,
// every dependency points to an earlier (step, chunk) of the same channel
// (below: a chunk keeps its channel from step to step), and no channel
// holds another's slots, the earliest unfinished transfer of each channel
// can always proceed: no deadlock, even over a transport whose sends
// complete only once received.
//
// Dependencies, chunk by chunk where the two sides have the same ranges (so
// the same chunking), for the whole step otherwise:
//   * send_dep: send chunk i of a step waits until receive chunk i of step
//     `send_dep_step` has been written (received, and reduced if reducing),
//     or, with kAll, until all its chunks have;
//   * write_after_send_step: receive chunk i of a step is written into its
//     destination (posted, when received directly; reduced, when received
//     into scratch) only once send chunk i of that step has completed: a
//     buffer handed to Send stays unchanged until its callback.
//
// Tags: tag = tag_base | step << chunk_bits | chunk, in the low 24 bits
// that tag_base leaves free. step_bits = bit_width(num_tag_steps - 1) (0 for
// a single step) and chunk_bits = 24 - step_bits: a ring over 8 nodes (14
// steps) has 4 step bits and 20 chunk bits (1M chunks per step). When one
// step would need more chunks than that, PlanChunkBytes grows the chunk size
// for that operation, identically on every node. Chunk i of a step travels
// on channel i % num_channels (or InterNodeContext::channel_table[i % its
// size], when the channels have weights), whatever the step: the chunk a
// step receives and the next step forwards stays on one channel thread (see
// Driver).
//
// Threads: RunSchedule posts the first transfers on the calling thread and
// then sleeps until the schedule is over or its deadline. The rest runs on
// the transport's threads as transfers complete: one of them at a time
// applies the completions, reduces what arrived into scratch and posts what
// they unblock (see Driver in schedule.cc), so a chunk costs no wakeup of
// another thread. Callbacks may therefore also come synchronously from
// within a Send or Recv call.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "ciuic/shm_layout.h"
#include "collectives/internode/internode.h"

namespace ciuic::daemon::internode_internal {

inline constexpr int kTagFieldBits = 24;
// The fewest tag bits an algorithm may be given (InterNodeContext::tag_bits).
inline constexpr int kMinTagBits = 16;

struct Range {
  uint8_t* ptr;
  size_t bytes;
};

// One direction of a step: byte ranges, cut into chunks of chunk_bytes (the
// last chunk of each range may be shorter; empty ranges have none).
class Side {
 public:
  int peer = -1;  // -1: this step has no transfer in this direction

  void Add(uint8_t* ptr, size_t bytes) {
    if (bytes > 0) ranges_.push_back({ptr, bytes});
  }
  bool empty() const { return ranges_.empty(); }
  bool SameRanges(const Side& other) const;

  // Fixes the chunk size; num_chunks and chunk are valid after it.
  void Cut(size_t chunk_bytes);
  size_t num_chunks() const { return num_chunks_; }
  Range chunk(size_t i) const;

 private:
  std::vector<Range> ranges_;
  std::vector<size_t> first_chunk_;  // per range
  size_t chunk_bytes_ = 0;
  size_t num_chunks_ = 0;
};

enum class Dep { kNone, kChunk, kAll };

struct Step {
  uint32_t tag_step = 0;  // the step field of the tag, agreed by both partners
  Side send;
  Side recv;
  // Receive into scratch and reduce into the destination (else receive in place).
  bool reduce = false;
  // Reduce order: Reduce({received, local}) if true, Reduce({local, received}) if not.
  bool received_first = true;
  // Where the local operand of a reducing receive is: at the destination
  // chunk's address plus this many bytes (0: the destination itself, in
  // place; else the same chunk of another buffer of the same layout, so an
  // out-of-place allreduce reads its input there and writes the destination).
  intptr_t local_offset = 0;
  Dep send_dep = Dep::kNone;
  int send_dep_step = -1;  // index into the schedule's steps
  int write_after_send_step = -1;
};

struct Schedule {
  const char* name;  // for error messages, e.g. "AllreduceRing"
  std::vector<Step> steps;
  uint32_t num_tag_steps = 1;
  // Reduction parameters, used by steps with reduce set.
  wire::DataType dtype = wire::DataType::kUInt8;
  wire::ReduceOp op = wire::ReduceOp::kSum;
  // Work of the caller's that overlaps the transfers: run on the calling
  // thread once the first transfers are posted, before it waits (null: none).
  // It must not touch the schedule's ranges.
  std::function<void()> meanwhile;
};

// Bits of the chunk field for a schedule with num_tag_steps steps in a tag
// field of tag_bits (InterNodeContext::tag_bits); -1 if the steps alone do
// not fit.
int ChunkBits(uint32_t num_tag_steps, int tag_bits = kTagFieldBits);

// The chunk size every node uses: `requested` rounded down to a multiple of
// `elem` (at least elem), doubled while chunks_at(size) (the most chunks any
// step of any node has at that size) exceeds 2^chunk_bits. INVALID_ARGUMENT
// if no size fits (more non-empty ranges in a step than the field holds).
absl::StatusOr<size_t> PlanChunkBytes(size_t requested, size_t elem, int chunk_bits,
                                      const std::function<size_t(size_t)>& chunks_at);

// Common argument checks: transport set, tag_bits in kMinTagBits..24 and
// tag_base's low tag_bits bits clear.
absl::Status CheckContext(const InterNodeContext& ctx, const char* name);

// Runs the schedule to the end, or to the first error or the deadline; in
// every case returns only after every posted transfer's callback has run.
absl::Status RunSchedule(const InterNodeContext& ctx, Schedule& schedule, size_t chunk_bytes,
                         int chunk_bits);

}  // namespace ciuic::daemon::internode_internal
