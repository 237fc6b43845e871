#include "shm/fast_path_segment.h"

#include <fcntl.h>
#include <linux/futex.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <climits>
#include <cstring>
#include <new>

#include "absl/strings/str_cat.h"

namespace ciuic::daemon {

namespace {

absl::Status ErrnoStatus(absl::string_view what) {
  return absl::InternalError(absl::StrCat(what, ": ", std::strerror(errno)));
}

void FutexWakeAll(std::atomic<uint32_t>* word) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
}

}  // namespace

absl::StatusOr<std::unique_ptr<FastPathSegment>> FastPathSegment::Create(uint32_t world_size,
                                                                          uint64_t payload_bytes,
                                                                          uint32_t op_timeout_ms) {
  const wire::FastPathGeometry g = wire::ComputeFastPathGeometry(world_size, payload_bytes);
  if (!g.valid || g.max_inflight_per_rank < wire::kMinFastPathInflight) {
    return absl::FailedPreconditionError(absl::StrCat(
        "a fast path for ", world_size, " ranks of ", payload_bytes,
        " bytes would need more than ", wire::kMaxFastPathSegmentBytes >> 20, " MiB"));
  }
  int fd = memfd_create("ciuic-fast-path", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  if (fd < 0) return ErrnoStatus("memfd_create");
  auto fail = [&](absl::string_view what) {
    absl::Status s = ErrnoStatus(what);
    close(fd);
    return s;
  };
  if (fchmod(fd, 0600) != 0) return fail("fchmod of the fast-path segment");
  if (ftruncate(fd, static_cast<off_t>(g.segment_bytes)) != 0) {
    return fail("ftruncate of the fast-path segment");
  }
  // Sealed size: a trainer cannot shrink it under the daemon (SIGBUS).
  if (fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0) {
    return fail("sealing the fast-path segment");
  }
  void* base = mmap(nullptr, g.segment_bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE,
                    fd, 0);
  if (base == MAP_FAILED) return fail("mmap of the fast-path segment");
  wire::InitFastPathSegment(static_cast<uint8_t*>(base), g, world_size, payload_bytes,
                            op_timeout_ms);
  return std::unique_ptr<FastPathSegment>(
      new FastPathSegment(fd, static_cast<uint8_t*>(base), g, world_size, payload_bytes));
}

FastPathSegment::~FastPathSegment() {
  munmap(base_, geometry_.segment_bytes);
  close(fd_);
}

void FastPathSegment::Abort(const absl::Status& status) {
  if (aborted_) return;
  aborted_ = true;
  wire::FastPathHeader* h = header();
  h->abort_message_len = static_cast<uint32_t>(
      wire::ClipMessage(status.message().data(), status.message().size(), h->abort_message));
  h->abort_code = status.ok() ? static_cast<int32_t>(absl::StatusCode::kAborted)
                              : static_cast<int32_t>(status.code());
  h->aborted.store(1, std::memory_order_seq_cst);
  // Wake every sleeper: they sleep on their slot's status word.
  for (uint32_t i = 0; i < geometry_.slot_count; ++i) FutexWakeAll(&slot(i)->status);
}

FastPathSegment::Counters FastPathSegment::ReadCounters() const {
  Counters out;
  const auto* c = reinterpret_cast<const wire::FastPathCounters*>(base_ + geometry_.counters_offset);
  for (uint32_t r = 0; r < world_size_; ++r) {
    out.ops_completed += c[r].ops_completed.load(std::memory_order_relaxed);
    out.ops_failed += c[r].ops_failed.load(std::memory_order_relaxed);
    out.bytes += c[r].bytes.load(std::memory_order_relaxed);
  }
  return out;
}

std::vector<FastPathSegment::PendingSlot> FastPathSegment::ReadPending() const {
  std::vector<PendingSlot> out;
  timespec ts{};
  clock_gettime(CLOCK_MONOTONIC, &ts);
  const uint64_t now_ns =
      static_cast<uint64_t>(ts.tv_sec) * 1000000000ull + static_cast<uint64_t>(ts.tv_nsec);
  for (uint32_t i = 0; i < geometry_.slot_count; ++i) {
    const wire::FastSlot* s = slot(i);
    // A kDaemon key only routes: its operation is pending in the daemon.
    if (s->state != static_cast<uint32_t>(wire::FastSlotState::kUsed) ||
        s->route == static_cast<uint32_t>(wire::FastRoute::kDaemon) ||
        s->status.load(std::memory_order_relaxed) !=
            static_cast<uint32_t>(wire::FastOpStatus::kPending)) {
      continue;
    }
    PendingSlot p;
    char name[wire::kMaxOpName];
    std::memcpy(name, s->name, sizeof(name));
    p.name.assign(name, std::min<size_t>(s->name_len, sizeof(name)));
    p.collective = s->collective;
    const uint64_t count = s->count;
    const uint64_t es = wire::DataTypeSize(s->dtype);
    p.bytes = count > (UINT64_MAX / 8) ? UINT64_MAX : count * es;
    for (uint32_t r = 0; r < world_size_; ++r) {
      (s->ranks_joined[r] != 0 ? p.submitted : p.waiting).push_back(static_cast<int>(r));
    }
    const uint64_t first = s->first_submit_ns;
    p.age_seconds = first <= now_ns ? static_cast<double>(now_ns - first) / 1e9 : 0;
    out.push_back(std::move(p));
  }
  return out;
}

}  // namespace ciuic::daemon
