// The frames of the TCP ordering stream (tcp_ordering.h): a 4-byte
// little-endian length, then that many bytes of a serialized message
// (NodeEvent towards the coordinator, CoordinatorEvent back), at most
// kMaxFrameBytes. What a peer sends: its length is checked before anything
// is allocated for the frame, and its bytes must parse.
//
// Pure functions, any thread. tcp_ordering.cc reads each frame through
// NextFrame; tests/fuzz/ordering_frame_fuzz.cc holds it to its contract.
#pragma once

#include <cstddef>
#include <cstdint>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "google/protobuf/message_lite.h"

namespace ciuic::daemon {

inline constexpr uint32_t kMaxFrameBytes = 16u << 20;
inline constexpr size_t kFrameHeaderBytes = 4;

struct FrameCut {
  // true: the buffer's first `bytes` bytes are a whole frame, now parsed
  // into the message. false: the buffer holds less than a frame; `bytes`
  // is how many it must hold before the next call can say more (the header,
  // or the whole frame once the header is in).
  bool complete = false;
  size_t bytes = 0;
};

// The next frame at the front of `received` (the bytes read from the
// stream so far, from a frame's start). INVALID_ARGUMENT naming the
// problem for a length over kMaxFrameBytes (as soon as the header is in)
// or a body that does not parse as `message`'s type (then `message` holds
// no meaning).
absl::StatusOr<FrameCut> NextFrame(absl::string_view received,
                                   google::protobuf::MessageLite* message);

}  // namespace ciuic::daemon
