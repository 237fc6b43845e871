// The local phase of collectives on CUDA device buffers (issue 7): every
// rank of the operation is on this node and handed its buffers to the daemon
// as CUDA IPC handles (wire::DeviceBufferDescriptor).
//
// For each operation the runner, on its submit thread: opens the ranks'
// memory and event handles (once per session and handle, kept until
// CloseSession; a memory handle that another session has mapped on the
// device, which CUDA maps once per process, is shared), picks the device of rank 0's receive buffer and works on
// a stream of the job's own there (other ranks' memory is reached through
// peer access; buffers on devices without it are mirrored in memory there,
// copied in and back with cudaMemcpyPeerAsync), and holds the operation
// in its ReadyGate (ready_gate.h) until each rank's IPC event (the
// trainer's stream, up to the submission) has completed, asking
// cudaEventQuery on the host: only then is the work enqueued
// (DeviceReduceToAll / DeviceReduce from kernels.h and device-to-device
// copies; the same semantics and the same output layout as
// collectives/local.h), and an event recorded. A trainer stream that does
// not get there by the operation's deadline fails the operation with
// DEADLINE_EXCEEDED, nothing of it enqueued, and holds up nothing but its
// job's later operations meanwhile; a session that ends fails the
// operations held for it at once. (The daemon's streams never wait for a
// trainer's on the device: what they hold is the daemon's own work, which
// ends.) A completion thread polls
// every pending event and calls each operation's `done` as soon as its own
// has completed (one job's slow trainer holds up no other job), never on
// the caller's thread: the engine loop never waits for the GPU.
//
// Errors: any CUDA error (opening a handle, a launch, an asynchronous fault)
// is the status given to `done`, for every rank of the operation. An
// asynchronous fault (a bad address in a kernel) breaks the CUDA context for
// good: every later operation fails with it too (restart ciuicd).
//
// Multi-node jobs: every operation gets a StagedNodeBuffer (Stage), once
// its ranks' streams have reached it (the same gate): the
// local phase on the GPU into a node buffer in device memory, which the
// ClusterJob then moves through pinned host slots (reductions segment by
// segment, overlapping the copies with the network), and the result copied
// to the ranks on the device at the end.
//
// Threads: Run, Stage, EndJob, Dispose and CloseSession may be called from
// any one thread (the engine loop); Run's `done` runs on the runner's
// completion thread, Stage's on its submit thread (post it on; never wait
// in it: every later device operation waits behind it). The
// destructor lets queued work finish (every `done` is called) and closes
// every handle. Built without CUDA, Create returns FAILED_PRECONDITION.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "ciuic/shm_layout.h"
#include "collectives/op.h"
#include "collectives/staged_buffer.h"

namespace ciuic::daemon {

// One rank's part: its session (whose handles it may reuse) and buffers.
struct DeviceRankBuffers {
  uint64_t session_id = 0;
  uint32_t uid = 0;         // the session's: mappings are shared within a uid only
  int rank = 0;             // in the job (a reduce_scatter's block)
  uint64_t send_bytes = 0;  // ValidatedOp::send_bytes (0: no send buffer)
  uint64_t recv_bytes = 0;  // ValidatedOp::recv_bytes
  wire::DeviceBufferDescriptor send{};
  wire::DeviceBufferDescriptor recv{};
  // alltoallv: elements for / from each rank of the job (else empty).
  std::vector<uint64_t> send_counts;
  std::vector<uint64_t> recv_counts;
};

// Memory a runner holds for the trainers' device buffers: their
// allocations it has mapped over CUDA IPC (while a session's cache or an
// operation holds them, so a trainer's cudaFree does not give their device
// memory back meanwhile), and its pinned host memory (staging slots and
// the device coders' message slots, in use or kept for reuse). Not its own
// device memory (node buffers, error feedback residuals).
struct DeviceMemoryUse {
  uint64_t mapped_allocations = 0;
  uint64_t mapped_bytes = 0;  // their sizes as the trainers described them
  uint64_t pinned_bytes = 0;
};

class DeviceRunner {
 public:
  static absl::StatusOr<std::unique_ptr<DeviceRunner>> Create();
  virtual ~DeviceRunner() = default;

  using Clock = std::chrono::steady_clock;

  // Runs `sig` (validated: ValidateSubmission) on ranks[0..W-1], W being the
  // job's world size (single-node job `job`, whose operations go in order on
  // streams of its own). `done` is called exactly once; with
  // DEADLINE_EXCEEDED, and nothing of the operation run, if a rank's stream
  // has not reached the submission by `deadline`.
  virtual void Run(const OpSignature& sig, std::vector<DeviceRankBuffers> ranks,
                   const std::string& job, Clock::time_point deadline,
                   std::function<void(absl::Status)> done) = 0;

  // A multi-node operation (`sig`, validated, not a barrier) on this node's
  // ranks of a job of `world` ranks: opens their buffers and, once each
  // rank's stream has reached the submission (else DEADLINE_EXCEEDED at
  // `deadline`, as Run), calls `done`
  // with the node's StagedNodeBuffer, whose work goes on a stream of its
  // own; the node buffer is the
  // first rank's receive buffer (allreduce, allgather, broadcast) or device
  // memory of the buffer's own: every rank's block (reduce_scatter), or the
  // node's ranks' whole send buffers back to back in rank order, which the
  // results replace before they go to the ranks' receive buffers
  // (alltoall). The buffer keeps the ranks' handles open while it lives (a
  // session closed meanwhile closes them when it goes).
  // `job` names the job whose error feedback residuals (kept on the device
  // for compressed operations) the buffer uses.
  virtual void Stage(
      const OpSignature& sig, int world, std::vector<DeviceRankBuffers> ranks,
      const std::string& job, Clock::time_point deadline,
      std::function<void(absl::StatusOr<std::shared_ptr<StagedNodeBuffer>>)> done) = 0;
  // The job has failed (`why`): its operations still held for their ranks'
  // streams fail with it at once.
  virtual void FailJob(const std::string& job, const absl::Status& why) = 0;
  // The job has ended: its residuals go once its last staged buffer has;
  // its operations still held for their ranks' streams fail.
  virtual void EndJob(const std::string& job) = 0;
  // Lets go of `buffer` on the runner's submit thread (a staged buffer's
  // destructor waits for its device work): for callers that must never
  // wait for the GPU, like the engine's loop.
  virtual void Dispose(std::shared_ptr<StagedNodeBuffer> buffer) = 0;

  // Any thread.
  virtual DeviceMemoryUse MemoryUse() const = 0;

  // The session has ended: the operations held for its streams fail (ABORTED)
  // at once; once the work queued before this call is done, its handles are
  // closed.
  virtual void CloseSession(uint64_t session_id) = 0;
};

}  // namespace ciuic::daemon
