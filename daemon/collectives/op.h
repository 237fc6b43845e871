// An operation as the daemon understands it once a submission has passed
// validation: trusted fields only, buffers resolved to daemon addresses.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "ciuic/shm_layout.h"

namespace ciuic::daemon {

class SessionMemory;

// What every rank must agree on for the same operation name.
struct OpSignature {
  uint32_t collective = 0;
  uint32_t dtype = 0;
  uint32_t reduce_op = 0;  // 0 for collectives that do not reduce
  int32_t root = 0;        // broadcast only, else 0
  uint64_t count = 0;
  uint32_t codec = 0;       // wire::Codec, 0 = the daemon's setting
  float codec_ratio = 0;    // topk only
  bool device = false;      // CUDA device buffers (kSubmitFlagDeviceBuffers)

  bool operator==(const OpSignature&) const = default;
  // "allreduce float32 count=100 op=sum" style, for error messages.
  std::string ToString() const;
  size_t element_bytes() const { return wire::DataTypeSize(dtype); }
};

struct ValidatedOp {
  uint64_t op_id = 0;
  std::string name;
  OpSignature sig;
  uint8_t* send = nullptr;  // nullptr when the rank sends nothing (or sig.device)
  uint8_t* recv = nullptr;  // nullptr when the rank receives nothing (or sig.device)
  // sig.device: copies of the descriptor records, checked by
  // ValidateDeviceBuffer (meaningful where send_bytes / recv_bytes > 0).
  wire::DeviceBufferDescriptor send_device{};
  wire::DeviceBufferDescriptor recv_device{};
  uint64_t send_bytes = 0;
  uint64_t recv_bytes = 0;
  uint32_t timeout_ms = 0;  // 0: the daemon's default
  int32_t priority = 0;
  // alltoallv: elements for / from each rank (world_size entries each),
  // copied out of the arena; empty for every other collective.
  std::vector<uint64_t> send_counts;
  std::vector<uint64_t> recv_counts;
};

// Checks one submission copied out of a session's ring against everything
// a correct SDK guarantees: known collective, dtype and reduce op, a name,
// no reserved flags, sizes that do not overflow, both buffers inside the
// session's data region, buffers that alias only the ways the collective
// allows (in place), a root within the job. The error names the field.
//
// Device buffers (kSubmitFlagDeviceBuffers): the descriptor records are
// copied out of the arena and checked with ValidateDeviceBuffer against the
// devices ProbeGpus() found; a daemon without CUDA or without a device
// answers FAILED_PRECONDITION saying so (after the checks that need no GPU).
absl::StatusOr<ValidatedOp> ValidateSubmission(const wire::SubmissionEntry& entry,
                                               const SessionMemory& memory, int world_size,
                                               int rank);

// One device buffer of `bytes` bytes described by `d`, on a daemon that sees
// `device_count` devices: no reserved flag, a non-empty allocation, the
// buffer inside it (no overflow), device in [0, device_count). The error
// (INVALID_ARGUMENT) names the field; `what` ("send", "recv") prefixes it.
absl::Status ValidateDeviceBuffer(const wire::DeviceBufferDescriptor& d, uint64_t bytes,
                                  int device_count, absl::string_view what);

}  // namespace ciuic::daemon
