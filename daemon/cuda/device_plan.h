// What a single-node operation on device buffers does, as a list of steps
// over the ranks' (opened) buffers: the plan is made here, in plain C++,
// and tested on any machine by running it on host memory
// (device_plan_test.cc); CudaDeviceRunner runs it with its kernels and
// cudaMemcpyAsync on its stream. Pure functions, callable from any thread.
#pragma once

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "collectives/op.h"
#include "cuda/device_runner.h"

namespace ciuic::daemon {

struct DeviceStep {
  enum class Kind {
    kReduceToAll,  // inputs reduced, the result stored to every output (one pass)
    kReduce,       // inputs reduced into outputs[0]
    kCopy,         // bytes from `from` to `to` (never the same place)
    // As kCopy, between memory of two devices (from_device, to_device),
    // which need no peer access (cudaMemcpyPeerAsync).
    kPeerCopy,
  };
  Kind kind = Kind::kCopy;
  std::vector<const uint8_t*> inputs;  // reductions: sig.count elements each
  std::vector<uint8_t*> outputs;
  const uint8_t* from = nullptr;
  uint8_t* to = nullptr;
  uint64_t bytes = 0;
  int from_device = 0, to_device = 0;  // kPeerCopy
};

// The steps of `sig` (validated: ValidateSubmission; not a barrier) on the
// job's ranks, `ranks[r]` being rank r with its send and receive buffers at
// send[r] and recv[r] (null where it has none: no send buffer is in place;
// an alltoallv rank may send or receive nothing). Reductions run in rank
// order (the CPU's order); copies are listed in any order (they never
// overlap). Empty for an operation that moves nothing.
absl::StatusOr<std::vector<DeviceStep>> PlanSingleNode(const OpSignature& sig,
                                                       const std::vector<DeviceRankBuffers>& ranks,
                                                       const std::vector<uint8_t*>& send,
                                                       const std::vector<uint8_t*>& recv);

// Buffers on devices that the operation's device cannot reach (no peer
// access between the two: kernels there cannot read them) are mirrored in
// scratch memory on the operation's device: each send buffer copied in
// (kPeerCopy) before the operation's steps, a receive buffer too where the
// rank works in place (every collective writes its whole receive buffer),
// and each receive buffer copied back, whole, after them.
// The steps, planned on the mirrors, never touch the far memory itself. A
// send buffer inside its rank's receive buffer (in place) is mirrored as
// that place in the receive buffer's mirror.
struct Mirrors {
  size_t bytes = 0;  // of scratch (0: nothing is far)
  std::vector<DeviceStep> in, out;
};
// `send_far[i]` / `recv_far[i]`: whether rank i's send / receive buffer
// (ranks[i].send_bytes / recv_bytes at send[i] / recv[i], on the devices
// its descriptors name; null or 0 bytes: none) is far from `device`. With
// `scratch` null: only `bytes`. Else `scratch` (that long, on `device`)
// holds the mirrors, whose places replace the far pointers in *send and
// *recv.
Mirrors Mirror(const std::vector<DeviceRankBuffers>& ranks, int device,
               const std::vector<bool>& send_far, const std::vector<bool>& recv_far,
               uint8_t* scratch, std::vector<uint8_t*>* send, std::vector<uint8_t*>* recv);

// A multi-node operation's node buffer on the GPU (staged_buffer.h's
// contract), laid out for this node's ranks: how large it is, whose memory
// it is, and where each rank's input goes into it and its result comes
// from. CudaDeviceRunner::Stage builds its staged buffers from it; the
// ClusterJob tests build their stand-in device from it too, so that the
// whole multi-node path checks it without a GPU.
struct StagedLayout {
  struct Rank {
    // Contributes an input: reduced into the node buffer (allreduce,
    // reduce_scatter) or placed at input_offset (the others).
    bool has_input = false;
    size_t input_offset = 0;
    // Without a send buffer (in place): where its input is in its receive
    // buffer.
    size_t in_place_offset = 0;
    // Must have a send buffer (reduce_scatter, alltoall).
    bool needs_send = false;
    size_t output_offset = 0;  // its result in the node buffer
    // Bytes placed from its input and copied to its output (alltoallv: its
    // own; else the layout's input_bytes and output_bytes).
    size_t input_size = 0;
    size_t output_size = 0;
  };
  size_t count = 0;  // elements of the node buffer
  // Device memory of its own (reduce_scatter: every rank's block;
  // alltoall(v)); else the first rank's receive buffer.
  bool own_node = false;
  bool reduce = false;      // the inputs are reduced (else placed)
  std::vector<Rank> ranks;  // in the order of the `ranks` given
};

// The layout for `sig` (validated; not a barrier) on this node's `ranks`
// of a job of `world` ranks (DeviceRankBuffers::rank, send_bytes,
// recv_bytes; the descriptors are not looked at).
absl::StatusOr<StagedLayout> PlanStaged(const OpSignature& sig, int world,
                                        const std::vector<DeviceRankBuffers>& ranks);

// A staged buffer's pieces from its layout and the ranks' opened buffers
// (rank i of the layout: send[i], null without a send buffer; recv[i], null
// where an alltoallv rank receives nothing): the inputs (reduced, or placed
// at input_offsets), the outputs and where their results are, and the bytes
// each moves (alltoallv: per rank, input_sizes / output_sizes; else
// input_bytes / output_bytes).
struct StagedPointers {
  std::vector<const void*> inputs;
  std::vector<size_t> input_offsets;  // placing collectives only
  std::vector<void*> outputs;
  std::vector<size_t> output_offsets;
  size_t input_bytes = 0, output_bytes = 0;
  std::vector<size_t> input_sizes, output_sizes;  // alltoallv
};
// INTERNAL naming the rank when one that needs a send buffer has none.
absl::StatusOr<StagedPointers> PointersFor(const OpSignature& sig, const StagedLayout& layout,
                                           const std::vector<const void*>& send,
                                           const std::vector<void*>& recv);

}  // namespace ciuic::daemon
