#include "shm/rings.h"

#include <linux/futex.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <climits>
#include <cstring>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace ciuic::daemon {

absl::StatusOr<bool> SubmissionReader::Pop(wire::SubmissionEntry* out) {
  const uint32_t tail = header_->sq_tail.load(std::memory_order_acquire);
  if (tail == head_) return false;
  if (tail - head_ > capacity_) {
    return absl::DataLossError(absl::StrCat("submission ring corrupt: tail ", tail, " is ",
                                            tail - head_, " entries ahead of head ", head_,
                                            " (capacity ", capacity_, ")"));
  }
  std::memcpy(out, &ring_[head_ & (capacity_ - 1)], sizeof(*out));
  ++head_;
  header_->sq_head.store(head_, std::memory_order_release);
  return true;
}

absl::Status CompletionWriter::Push(uint64_t op_id, int status_code, absl::string_view message) {
  const uint32_t head = header_->cq_head.load(std::memory_order_acquire);
  const uint32_t used = tail_ - head;
  if (used > capacity_) {
    return absl::DataLossError(
        absl::StrCat("completion ring corrupt: head ", head, " is ahead of tail ", tail_));
  }
  if (used == capacity_) {
    return absl::ResourceExhaustedError("completion ring full: the trainer does not reap");
  }
  wire::CompletionEntry& e = ring_[tail_ & (capacity_ - 1)];
  e.op_id = op_id;
  e.status_code = status_code;
  e.message_len = static_cast<uint32_t>(wire::ClipMessage(message.data(), message.size(), e.message));
  timespec now{};
  clock_gettime(CLOCK_MONOTONIC, &now);
  e.completed_ns = static_cast<uint64_t>(now.tv_sec) * 1000000000ULL +
                   static_cast<uint64_t>(now.tv_nsec);
  ++tail_;
  header_->cq_tail.store(tail_, std::memory_order_seq_cst);
  if (header_->trainer_waiters.load(std::memory_order_seq_cst) != 0) {
    syscall(SYS_futex, reinterpret_cast<uint32_t*>(&header_->cq_tail), FUTEX_WAKE, INT_MAX,
            nullptr, nullptr, 0);
  }
  return absl::OkStatus();
}

}  // namespace ciuic::daemon
