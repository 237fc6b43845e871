// DeviceRunner in a ciuicd built without CUDA (validation refuses device
// buffers before anything gets here; this is the second line).
#include "cuda/device_runner.h"

namespace ciuic::daemon {

absl::StatusOr<std::unique_ptr<DeviceRunner>> DeviceRunner::Create() {
  return absl::FailedPreconditionError("device (CUDA) buffers: this ciuicd was built without CUDA");
}

}  // namespace ciuic::daemon
