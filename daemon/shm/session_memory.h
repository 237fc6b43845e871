// The shared memory of one trainer session, as the daemon sees it.
//
// The daemon creates a memfd per session (never a name in /dev/shm, so
// nothing outlives the session), seals its size so the trainer cannot shrink
// it under the daemon's feet (which would turn a daemon read into SIGBUS),
// maps and pre-faults it once, and lays out the SessionHeader and rings of
// shm_layout.h. Every pointer into the data region the daemon uses comes
// from DataRange(), which checks the range against the region.
//
// Thread-safety: immutable after Create() except through the header's
// atomics; shared (shared_ptr) between the engine thread and the workers
// that run an operation on it, so the mapping outlives a session that dies
// mid-operation.
#pragma once

#include <cstdint>
#include <memory>

#include "absl/status/statusor.h"
#include "ciuic/shm_layout.h"

namespace ciuic::daemon {

class SessionMemory {
 public:
  // Creates and maps a memfd with `data_bytes` of arena after the header and
  // rings; the pages are faulted in now, not on the data path.
  static absl::StatusOr<std::unique_ptr<SessionMemory>> Create(uint64_t data_bytes);

  ~SessionMemory();
  SessionMemory(const SessionMemory&) = delete;
  SessionMemory& operator=(const SessionMemory&) = delete;

  int fd() const { return fd_; }
  uint64_t size() const { return size_; }
  uint64_t data_offset() const { return wire::kDataOffset; }
  uint64_t data_bytes() const { return size_ - wire::kDataOffset; }

  wire::SessionHeader* header() const { return reinterpret_cast<wire::SessionHeader*>(base_); }
  wire::SubmissionEntry* submissions() const {
    return reinterpret_cast<wire::SubmissionEntry*>(base_ + wire::kSqOffset);
  }
  wire::CompletionEntry* completions() const {
    return reinterpret_cast<wire::CompletionEntry*>(base_ + wire::kCqOffset);
  }

  // The address of [offset, offset + bytes) in the data region, or
  // OUT_OF_RANGE naming the range if any byte of it lies outside. Overflow
  // safe for any 64-bit inputs.
  absl::StatusOr<uint8_t*> DataRange(uint64_t offset, uint64_t bytes) const;

 private:
  SessionMemory(int fd, uint8_t* base, uint64_t size) : fd_(fd), base_(base), size_(size) {}

  int fd_;
  uint8_t* base_;
  uint64_t size_;
};

}  // namespace ciuic::daemon
