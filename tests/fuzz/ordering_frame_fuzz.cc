// Fuzz target: the frames of the TCP ordering stream
// (control/ordering_frame.h, NextFrame), which cut and parse what another
// daemon writes on the stream before the coordinator or a node uses it.
//
// Input: a selector byte (NodeEvent or CoordinatorEvent; bytes as they
// are, or frames built here), then either the received bytes themselves,
// or up to 8 messages parsed from length-prefixed chunks, each framed here
// (a 4-byte little-endian length, the serialized message), concatenated,
// with the rest of the input after them.
//
// Properties, the received bytes cut frame by frame from the front:
//   - fewer bytes than a header: "need more", 4 bytes;
//   - a length over kMaxFrameBytes is refused (INVALID_ARGUMENT naming the
//     length) from its 4 header bytes alone, before a frame's worth of
//     bytes exists (libFuzzer's malloc limit would catch an allocation of
//     it);
//   - a header with fewer body bytes behind it than it says, at any point
//     of the body: "need more", the whole frame's size;
//   - a whole frame: its size is header plus length, and the message is
//     what the body parses to here, independently; bytes that do not parse
//     are INVALID_ARGUMENT naming the problem;
//   - frames built here come back one by one, each the message framed.
#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "ciuic/peer.pb.h"
#include "control/ordering_frame.h"
#include "fuzz_input.h"
#include "fuzz_proto.h"

namespace {

constexpr const char* kTarget = "ordering_frame_fuzz";
using ciuic::daemon::FrameCut;
using ciuic::daemon::kMaxFrameBytes;
using ciuic::daemon::NextFrame;

uint32_t LengthOf(const std::string& b) {
  const auto* h = reinterpret_cast<const unsigned char*>(b.data());
  return h[0] | (h[1] << 8) | (h[2] << 16) | (static_cast<uint32_t>(h[3]) << 24);
}

std::string Framed(const std::string& body) {
  std::string f(4, '\0');
  const auto n = static_cast<uint32_t>(body.size());
  for (int i = 0; i < 4; ++i) f[i] = static_cast<char>((n >> (8 * i)) & 0xff);
  return f + body;
}

// Cuts `received` into frames of message type M; the first `built` of them
// must be `expected` (serialized).
template <typename M>
void Cut(const std::string& received, const std::vector<std::string>& expected) {
  size_t at = 0;
  for (size_t frame = 0;; ++frame) {
    const std::string rest = received.substr(at);
    M message;
    const absl::StatusOr<FrameCut> cut = NextFrame(rest, &message);
    if (rest.size() < 4) {
      FUZZ_CHECK(cut.ok() && !cut->complete && cut->bytes == 4,
                 "less than a header is not \"need 4 bytes\"");
      FUZZ_CHECK(frame >= expected.size(), "a frame built here was not cut");
      return;
    }
    const uint32_t n = LengthOf(rest);
    if (n > kMaxFrameBytes) {
      FUZZ_CHECK(!cut.ok() && cut.status().code() == absl::StatusCode::kInvalidArgument,
                 "a frame over kMaxFrameBytes is not refused");
      FUZZ_CHECK(cut.status().message().find(std::to_string(n)) != absl::string_view::npos,
                 "the refusal of a frame too large does not name its length");
      M other;
      const auto header_only = NextFrame(rest.substr(0, 4), &other);
      FUZZ_CHECK(!header_only.ok() && header_only.status() == cut.status(),
                 "a frame over kMaxFrameBytes is not refused from its header alone");
      FUZZ_CHECK(frame >= expected.size(), "a frame built here was refused as too large");
      return;
    }
    const size_t whole = 4 + static_cast<size_t>(n);
    if (rest.size() < whole) {
      FUZZ_CHECK(cut.ok() && !cut->complete && cut->bytes == whole,
                 "a truncated frame is not \"need the whole frame\"");
      FUZZ_CHECK(frame >= expected.size(), "a frame built here was not cut");
      return;
    }
    // Whole: every shorter cut of it needs more (the header, or the frame).
    for (size_t len : {size_t{0}, size_t{3}, size_t{4}, whole / 2, whole - 1}) {
      if (len >= whole) continue;
      M partial;
      const auto need = NextFrame(rest.substr(0, len), &partial);
      FUZZ_CHECK(need.ok() && !need->complete && need->bytes == (len < 4 ? 4 : whole),
                 "a frame cut short is not \"need more\"");
    }
    M independent;
    const bool parses =
        ciuic::fuzz::ParseProto(&independent, reinterpret_cast<const uint8_t*>(rest.data()) + 4, n);
    if (!parses) {
      FUZZ_CHECK(!cut.ok() && cut.status().code() == absl::StatusCode::kInvalidArgument &&
                     !cut.status().message().empty(),
                 "a body that does not parse is not refused by name");
      FUZZ_CHECK(frame >= expected.size(), "a frame built here did not parse");
      return;
    }
    FUZZ_CHECK(cut.ok() && cut->complete && cut->bytes == whole,
               "a whole frame that parses is not cut at its length");
    FUZZ_CHECK(message.SerializeAsString() == independent.SerializeAsString(),
               "a frame's message is not what its body parses to");
    if (frame < expected.size()) {
      FUZZ_CHECK(message.SerializeAsString() == expected[frame],
                 "a frame built here came back different");
    }
    at += cut->bytes;
  }
}

template <typename M>
void Run(ciuic::fuzz::Input& in, bool build) {
  std::string received;
  std::vector<std::string> expected;
  if (build) {
    const int count = in.Byte() % 9;
    for (int i = 0; i < count; ++i) {
      std::string chunk(std::min<size_t>(in.Byte(), in.rest_size()), '\0');
      in.Bytes(chunk.data(), chunk.size());
      M m;
      if (!ciuic::fuzz::ParseProto(&m, reinterpret_cast<const uint8_t*>(chunk.data()),
                                   chunk.size())) {
        continue;
      }
      expected.push_back(m.SerializeAsString());
      received += Framed(expected.back());
    }
  }
  received.append(reinterpret_cast<const char*>(in.rest()), in.rest_size());
  Cut<M>(received, expected);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  ciuic::fuzz::Input in(data, size);
  const uint8_t mode = in.Byte();
  const bool build = (mode & 2) != 0;
  if (mode & 1) {
    Run<ciuic::proto::CoordinatorEvent>(in, build);
  } else {
    Run<ciuic::proto::NodeEvent>(in, build);
  }
  return 0;
}
