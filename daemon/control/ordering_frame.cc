#include "control/ordering_frame.h"

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace ciuic::daemon {

absl::StatusOr<FrameCut> NextFrame(absl::string_view received,
                                   google::protobuf::MessageLite* message) {
  if (received.size() < kFrameHeaderBytes) return FrameCut{false, kFrameHeaderBytes};
  const auto* h = reinterpret_cast<const unsigned char*>(received.data());
  const uint32_t n = h[0] | (h[1] << 8) | (h[2] << 16) | (static_cast<uint32_t>(h[3]) << 24);
  if (n > kMaxFrameBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("frame of ", n, " bytes, more than the ", kMaxFrameBytes, " allowed"));
  }
  const size_t frame = kFrameHeaderBytes + n;
  if (received.size() < frame) return FrameCut{false, frame};
  if (!message->ParseFromArray(received.data() + kFrameHeaderBytes, static_cast<int>(n))) {
    return absl::InvalidArgumentError("a frame that is not an ordering message");
  }
  return FrameCut{true, frame};
}

}  // namespace ciuic::daemon
