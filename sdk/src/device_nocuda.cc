// DeviceExporter in a libciuic built without CUDA: every call says so.
#include "device.h"

namespace ciuic {

namespace {
constexpr char kNoCuda[] =
    "device (CUDA) buffers: this libciuic was built without CUDA (configure with "
    "-DCIUIC_CUDA=ON on a machine with the CUDA toolkit)";
}  // namespace

struct DeviceExporter::State {};

bool SdkSupportsDeviceBuffers(std::string* why) {
  if (why != nullptr) *why = kNoCuda;
  return false;
}

Status DeviceOfPointer(const void*, int*) {
  return Status(StatusCode::kFailedPrecondition, kNoCuda);
}

DeviceExporter::DeviceExporter() = default;
DeviceExporter::~DeviceExporter() = default;

Status DeviceExporter::Describe(const void*, size_t, int, wire::DeviceBufferDescriptor*) {
  return Status(StatusCode::kFailedPrecondition, kNoCuda);
}

Status DeviceExporter::RecordEvent(void*, int, uint8_t*, std::shared_ptr<void>*) {
  return Status(StatusCode::kFailedPrecondition, kNoCuda);
}

}  // namespace ciuic
