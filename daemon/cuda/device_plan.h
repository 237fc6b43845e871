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
  };
  Kind kind = Kind::kCopy;
  std::vector<const uint8_t*> inputs;  // reductions: sig.count elements each
  std::vector<uint8_t*> outputs;
  const uint8_t* from = nullptr;
  uint8_t* to = nullptr;
  uint64_t bytes = 0;
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

}  // namespace ciuic::daemon
