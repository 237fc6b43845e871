// Fuzz target: wire::ClipMessage (proto/ciuic/shm_layout.h), which every
// message a trainer reads goes through (completions, fast-path aborts and
// slot errors, session refusals) and which takes names a trainer chose
// (operation names, job ids) inside the daemon's own words.
//
// Input: a mode byte, then the message. Mode bit 0 expands the message:
// 0xFF L B stands for L + 1 copies of byte B, so that short inputs make
// long messages and long quoted names. Properties: the output is at most
// kMaxMessage bytes, and is the input itself when the input fits; a valid
// UTF-8 message stays valid UTF-8 and keeps its first and last 5 bytes; a
// long message without a quote keeps its first 147 bytes or more, then
// " ... ", then at least its last 74 (whole characters either side).
#include <cstdint>
#include <cstring>
#include <string>

#include "ciuic/shm_layout.h"
#include "fuzz_input.h"

namespace {

constexpr const char* kTarget = "message_fuzz";
namespace wire = ciuic::wire;

std::string Expand(const uint8_t* p, size_t n) {
  std::string out;
  for (size_t i = 0; i < n; ++i) {
    if (p[i] == 0xFF && i + 2 < n) {
      out.append(static_cast<size_t>(p[i + 1]) + 1, static_cast<char>(p[i + 2]));
      i += 2;
    } else {
      out += static_cast<char>(p[i]);
    }
  }
  return out;
}

bool StartsWith(const std::string& s, const std::string& prefix) {
  return s.size() >= prefix.size() && s.compare(0, prefix.size(), prefix) == 0;
}

bool EndsWith(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() &&
         s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  ciuic::fuzz::Input in(data, size);
  const uint8_t mode = in.Byte();
  const std::string m = (mode & 1) != 0
                            ? Expand(in.rest(), in.rest_size())
                            : std::string(reinterpret_cast<const char*>(in.rest()), in.rest_size());
  char out[wire::kMaxMessage];
  const size_t n = wire::ClipMessage(m.data(), m.size(), out);
  if (n > wire::kMaxMessage) ciuic::fuzz::Broken(kTarget, "output longer than kMaxMessage");
  const std::string got(out, n);
  if (m.size() <= wire::kMaxMessage) {
    if (got != m) ciuic::fuzz::Broken(kTarget, "a message that fits was changed");
    return 0;
  }
  if (!wire::IsValidUtf8(m.data(), m.size())) return 0;
  if (!wire::IsValidUtf8(got.data(), got.size())) {
    ciuic::fuzz::Broken(kTarget, "valid UTF-8 in, invalid out");
  }
  if (!StartsWith(got, m.substr(0, 5)) || !EndsWith(got, m.substr(m.size() - 5))) {
    ciuic::fuzz::Broken(kTarget, "the message's first or last bytes were lost");
  }
  if (m.find('\'') == std::string::npos) {
    // The gap is at one of 147..150 (the head ends between characters);
    // the message itself may hold " ... " too.
    bool found = false;
    for (size_t gap = wire::kMessageHead - 3; gap <= wire::kMessageHead && !found; ++gap) {
      if (got.compare(gap, 5, " ... ") != 0) continue;
      const std::string tail = got.substr(gap + 5);
      found = StartsWith(m, got.substr(0, gap)) &&
              tail.size() >= wire::kMaxMessage - wire::kMessageHead - 5 - 3 && EndsWith(m, tail);
    }
    if (!found) {
      ciuic::fuzz::Broken(kTarget, "a long message without names is not its head, \" ... \", its tail");
    }
  }
  return 0;
}
