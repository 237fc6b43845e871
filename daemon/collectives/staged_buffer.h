// A node's buffer for the inter-node phase that lives where the inter-node
// algorithms cannot work on it directly: GPU memory (issue 7). The daemon
// reduces the node's ranks into it where it lives (on the GPU), then moves
// it through host memory piece by piece: a piece is fetched into one of two
// host slots, carried between the nodes from there, and stored back, while
// the next piece is being fetched into the other slot; at the end the
// result goes from the node buffer to every local rank's output (an
// allreduce: all of it; a reduce_scatter, whose node buffer holds every
// rank's block: the rank's block). An allgather or a broadcast places the
// ranks' inputs in the node buffer instead of reducing them. An alltoall's
// node buffer holds the local ranks' send buffers back to back in rank
// order, and its received blocks land over them; an alltoallv's holds the
// send buffers, then room for what the ranks receive, in rank order too.
//
// Ordering: every Fetch, Store and the fan-out of Finish are enqueued on one
// in-order queue (a CUDA stream), after ReduceLocal and after the ranks'
// own work on their buffers (their IPC events). So a Fetch into a slot that
// an earlier Store reads from waits for that Store on the device, without
// the caller waiting; the caller waits (Wait) only before it reads a
// fetched slot or writes a stored one again.
//
// Threads: one caller (a ClusterJob lane) at a time. The object stays valid
// (and keeps the ranks' memory open) until it is destroyed; the destructor
// waits for whatever was enqueued, so the ranks may reuse their buffers once
// it is gone. Errors are the device's, as a status naming the step.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "ciuic/shm_layout.h"
#include "collectives/chunk_coder.h"
#include "compression/error_feedback.h"

namespace ciuic::daemon {

class StagedNodeBuffer {
 public:
  virtual ~StagedNodeBuffer() = default;

  // Enqueues the local phase of a reducing collective: the node's ranks'
  // inputs reduced with `op` (not kAvg: the caller sums and divides) into
  // the node buffer.
  virtual absl::Status ReduceLocal(wire::ReduceOp op) = 0;
  // The local phase of the others: enqueues the copies of the ranks' inputs
  // to their places in the node buffer (allgather: each rank's block;
  // broadcast: the root's, where it is on this node).
  virtual absl::Status PlaceInputs() = 0;
  // Host memory of slot `slot` (0 or 1), at least `bytes` long; the same
  // memory for the object's life unless a larger size is asked for.
  virtual absl::StatusOr<uint8_t*> Slot(int slot, size_t bytes) = 0;
  // Enqueues a copy of the node buffer's bytes [offset, offset + bytes) to
  // the slot's host memory at `slot_offset`.
  virtual absl::Status Fetch(int slot, size_t slot_offset, size_t offset, size_t bytes) = 0;
  // Enqueues a copy of the slot's bytes [slot_offset, slot_offset + bytes)
  // to the node buffer at `offset`.
  virtual absl::Status Store(int slot, size_t slot_offset, size_t offset, size_t bytes) = 0;
  // `rows` Fetches (Stores) of `bytes` each: row r between the node buffer
  // at offset + r * pitch and the slot at slot_offset + r * bytes (pieces
  // of consecutive blocks, back to back in the slot). By default one Fetch
  // (Store) per row; a GPU makes them one 2-D copy.
  virtual absl::Status FetchRows(int slot, size_t slot_offset, size_t offset, size_t bytes,
                                 size_t pitch, size_t rows) {
    return EachRow(&StagedNodeBuffer::Fetch, slot, slot_offset, offset, bytes, pitch, rows);
  }
  virtual absl::Status StoreRows(int slot, size_t slot_offset, size_t offset, size_t bytes,
                                 size_t pitch, size_t rows) {
    return EachRow(&StagedNodeBuffer::Store, slot, slot_offset, offset, bytes, pitch, rows);
  }
  // Blocks until the slot's last Fetch or Store is complete.
  virtual absl::Status Wait(int slot) = 0;
  // Enqueues the node buffer's copy to every other local rank's output and
  // blocks until everything enqueued is complete.
  virtual absl::Status Finish() = 0;
  // Blocks until everything enqueued is complete (after a failure, before
  // the ranks are told: they may reuse their buffers then).
  virtual absl::Status Drain() = 0;

  // Compressed allreduces run where the node buffer lives, without staging
  // it: a coder for codec `spec` (a ParseCodec spec) over the node buffer,
  // with error feedback under `feedback_name` (empty: none), kept there
  // too; the collective then works on data() through it. Null (not an
  // error) when this buffer cannot run that codec on its dtype: the caller
  // then stages the buffer and encodes on the CPU.
  virtual absl::StatusOr<std::unique_ptr<ChunkCoder>> Coder(const std::string& spec,
                                                            const std::string& feedback_name) = 0;
  // The error feedback residuals that this buffer's coders keep where it
  // lives (its job's, all operations'), for ciuicctl status: held, their
  // bytes, and those dropped. All zero where there are none.
  virtual ErrorFeedback::Stats FeedbackStats() const { return {}; }
  // The node buffer in its own memory (for a coder; never dereferenced by
  // the CPU).
  virtual void* data() = 0;
  // Enqueues avg's division of the node buffer by `divisor`, with
  // reduce.h's DivideInPlace semantics.
  virtual absl::Status Divide(int divisor) = 0;

 private:
  // FetchRows / StoreRows by default: `copy` (Fetch or Store) per row.
  absl::Status EachRow(absl::Status (StagedNodeBuffer::*copy)(int, size_t, size_t, size_t),
                       int slot, size_t slot_offset, size_t offset, size_t bytes, size_t pitch,
                       size_t rows) {
    for (size_t r = 0; r < rows; ++r) {
      absl::Status s = (this->*copy)(slot, slot_offset + r * bytes, offset + r * pitch, bytes);
      if (!s.ok()) return s;
    }
    return absl::OkStatus();
  }
};

}  // namespace ciuic::daemon
