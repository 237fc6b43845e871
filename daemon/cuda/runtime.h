// CUDA runtime helpers shared by the daemon's device code: an error as a
// status, and waiting for device work without a blocking CUDA call (small
// operations finish within microseconds, so poll the event, yielding, for a
// short while, then sleep in short steps). Built with CUDA only.
#pragma once

#include <cuda_runtime_api.h>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace ciuic::daemon {

// OK for cudaSuccess; else the error as gpu::CudaStatus gives it, naming
// `what`, and cleared so that it does not surface in the next call.
absl::Status Cuda(cudaError_t e, absl::string_view what);

// OK once `event` (recorded on some stream) has completed; the CUDA error,
// as a status naming `what`, if the work before it failed.
absl::Status WaitForEvent(cudaEvent_t event, absl::string_view what);

// Records `*event` on `stream` (creating it the first time, without
// timing) and waits for it: everything enqueued on `stream` so far is done.
absl::Status WaitForStream(cudaStream_t stream, cudaEvent_t* event, absl::string_view what);

}  // namespace ciuic::daemon
