// The daemon's side of a single-node job's fast-path segment
// (proto/ciuic/fast_path.h): it makes the segment, hands out its fd, aborts
// it when the job fails, and reads its counters for `ciuicctl status`.
//
// Trust: every trainer of the job can write anything into the segment. The
// daemon never takes an offset, a length or a pointer from it: it writes the
// abort fields and wakes futexes at addresses it computed from the geometry
// it chose, and reads counters and slot fields as plain numbers (names with
// lengths clamped), so garbage there shows up as odd numbers in a status
// listing and nothing worse.
//
// Thread-safety: owned by the engine loop (the job's state); no locking.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "ciuic/fast_path.h"

namespace ciuic::daemon {

class FastPathSegment {
 public:
  // A sealed, pre-faulted memfd for `world_size` ranks and `payload_bytes`
  // per rank and operation; FAILED_PRECONDITION when such a job would need
  // more than kMaxFastPathSegmentBytes for kMinFastPathInflight operations
  // in flight per rank.
  static absl::StatusOr<std::unique_ptr<FastPathSegment>> Create(uint32_t world_size,
                                                                 uint64_t payload_bytes,
                                                                 uint32_t op_timeout_ms);
  ~FastPathSegment();
  FastPathSegment(const FastPathSegment&) = delete;
  FastPathSegment& operator=(const FastPathSegment&) = delete;

  int fd() const { return fd_; }
  uint64_t size() const { return geometry_.segment_bytes; }
  uint64_t payload_bytes() const { return payload_bytes_; }

  // Ends every pending and later fast-path operation of the job with
  // `status` (not OK). Only the first call writes; later ones are no-ops.
  void Abort(const absl::Status& status);
  bool aborted() const { return aborted_; }

  struct Counters {
    uint64_t ops_completed = 0;
    uint64_t ops_failed = 0;
    uint64_t bytes = 0;
  };
  // Sums of the ranks' counters, as the trainers wrote them.
  Counters ReadCounters() const;

  struct PendingSlot {
    std::string name;
    uint32_t collective = 0;
    uint64_t bytes = 0;
    std::vector<int> submitted;
    std::vector<int> waiting;
    double age_seconds = 0;
  };
  // Operations some ranks wait in, from a racy read of the table.
  std::vector<PendingSlot> ReadPending() const;

 private:
  FastPathSegment(int fd, uint8_t* base, const wire::FastPathGeometry& g, uint32_t world_size,
                  uint64_t payload_bytes)
      : fd_(fd), base_(base), geometry_(g), world_size_(world_size), payload_bytes_(payload_bytes) {}

  wire::FastPathHeader* header() const { return reinterpret_cast<wire::FastPathHeader*>(base_); }
  wire::FastSlot* slot(uint32_t i) const {
    return reinterpret_cast<wire::FastSlot*>(base_ + geometry_.slots_offset +
                                             uint64_t{i} * geometry_.slot_stride);
  }

  int fd_;
  uint8_t* base_;
  wire::FastPathGeometry geometry_;
  uint32_t world_size_;
  uint64_t payload_bytes_;
  bool aborted_ = false;
};

}  // namespace ciuic::daemon
