// The daemon's ends of a session's two rings (see shm_layout.h).
//
// SubmissionReader consumes what the trainer submits; CompletionWriter
// publishes results. Both keep their own copy of the index they own and
// treat the index the trainer owns as untrusted: a value that no correct
// trainer could produce is a DATA_LOSS error, after which the engine closes
// the session.
//
// Thread-safety: each object is used by the engine thread only.
#pragma once

#include <cstdint>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "ciuic/shm_layout.h"

namespace ciuic::daemon {

class SubmissionReader {
 public:
  SubmissionReader(wire::SessionHeader* header, wire::SubmissionEntry* ring, uint32_t capacity)
      : header_(header), ring_(ring), capacity_(capacity) {}

  // True when the trainer has published entries not yet taken.
  bool HasPending() const {
    return header_->sq_tail.load(std::memory_order_acquire) != head_;
  }

  // Copies the next entry into *out (so the trainer cannot change it while
  // the daemon looks at it) and returns true, or returns false when the ring
  // is empty.
  absl::StatusOr<bool> Pop(wire::SubmissionEntry* out);

 private:
  wire::SessionHeader* header_;
  wire::SubmissionEntry* ring_;
  uint32_t capacity_;
  uint32_t head_ = 0;
};

class CompletionWriter {
 public:
  CompletionWriter(wire::SessionHeader* header, wire::CompletionEntry* ring, uint32_t capacity)
      : header_(header), ring_(ring), capacity_(capacity) {}

  // Appends one completion (message truncated to wire::kMaxMessage) and
  // wakes a waiting trainer. RESOURCE_EXHAUSTED if the trainer let the ring
  // fill (it submitted more than the ring holds without reaping), DATA_LOSS
  // if its head index is impossible.
  absl::Status Push(uint64_t op_id, int status_code, absl::string_view message);
  // The ring's size as ciuicd made it (never the trainer-writable header's).
  uint32_t capacity() const { return capacity_; }

 private:
  wire::SessionHeader* header_;
  wire::CompletionEntry* ring_;
  uint32_t capacity_;
  uint32_t tail_ = 0;
};

}  // namespace ciuic::daemon
