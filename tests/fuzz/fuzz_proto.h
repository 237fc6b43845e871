// What the fuzz targets that take peer messages share: parsing protobuf
// from a fuzzer's bytes without protobuf's log lines (invalid UTF-8 in a
// string field is an ordinary refusal here, not news).
#pragma once

#include <cstddef>
#include <cstdint>

#include "google/protobuf/message_lite.h"
#include "google/protobuf/stubs/logging.h"

namespace ciuic::fuzz {

// Parses `m` from `data`; false when the bytes are not such a message.
inline bool ParseProto(google::protobuf::MessageLite* m, const uint8_t* data, size_t size) {
  static const bool quiet = [] {
    google::protobuf::SetLogHandler(nullptr);
    return true;
  }();
  (void)quiet;
  return m->ParseFromArray(data, static_cast<int>(size));
}

}  // namespace ciuic::fuzz
