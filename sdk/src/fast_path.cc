#include "fast_path.h"

#include <linux/futex.h>
#include <sched.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <climits>
#include <cstring>
#include <thread>

#include "ciuic/collective_rules.h"
#include "reduce/reduce.h"

namespace ciuic {

namespace {

// Microseconds a waiter spins without yielding (see Wait).
constexpr int kQuietSpinUs = 5;
// The table lock is held for a probe of a few slots: microseconds. Waiters
// yield for kTableLockSpin, then sleep; a holder that has kept it for
// table_lock_limit_ (10 s) is stopped or hung, and the waiter gives up.
constexpr auto kTableLockSpin = std::chrono::milliseconds(2);

uint64_t MonotonicNs() {
  timespec ts{};
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<uint64_t>(ts.tv_sec) * 1000000000ull + static_cast<uint64_t>(ts.tv_nsec);
}

// The key's home slot. It leaves out n, so that the operations of a name
// used again and again keep landing on the same few slots, which stay in
// cache. Unnamed operations ("#N", numbered by the SDK in submission order)
// cycle through 8 homes spread over the table: back-to-back operations reuse
// slots still in cache, and many in flight spread over 8 chains.
uint32_t HomeSlot(const std::string& name, uint32_t slot_count) {
  if (uint64_t n = 0; wire::UnnamedNumber(name, &n)) {
    const uint32_t groups = std::min<uint32_t>(8, slot_count);
    return static_cast<uint32_t>(n % groups) * (slot_count / groups);
  }
  uint64_t h = 1469598103934665603ull;  // FNV-1a
  for (unsigned char c : name) {
    h ^= c;
    h *= 1099511628211ull;
  }
  return static_cast<uint32_t>(h ^ (h >> 32)) & (slot_count - 1);
}

void FutexWake(std::atomic<uint32_t>* word) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
}

void FutexWait(std::atomic<uint32_t>* word, uint32_t expected, std::chrono::nanoseconds left) {
  timespec ts{};
  ts.tv_sec = left.count() / 1000000000;
  ts.tv_nsec = left.count() % 1000000000;
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAIT, expected, &ts, nullptr, 0);
}

bool Reduces(wire::Collective c) {
  return c == wire::Collective::kAllreduce || c == wire::Collective::kReduceScatter;
}

// Bytes counted for ciuicctl, like the daemon's FinishOnLoop.
uint64_t CountedBytes(wire::Collective c, uint64_t block, int world_size) {
  if (c == wire::Collective::kReduceScatter || c == wire::Collective::kAllgather ||
      c == wire::Collective::kAlltoall) {
    return block * static_cast<uint64_t>(world_size);
  }
  return c == wire::Collective::kBarrier ? 0 : block;
}

}  // namespace

// ----------------------------------------------------------------- set-up

FastPath::FastPath(uint8_t* base, uint64_t bytes, bool owned, int fd, int rank, int world_size,
                   std::string job_id)
    : base_(base), bytes_(bytes), owned_(owned), fd_(fd), rank_(rank), world_size_(world_size),
      job_id_(std::move(job_id)) {}

FastPath::~FastPath() {
  if (owned_) munmap(base_, bytes_);
  if (fd_ >= 0) close(fd_);
}

Status FastPath::Open(int fd, uint64_t bytes, int rank, int world_size, std::string job_id,
                      std::unique_ptr<FastPath>* out) {
  struct stat st {};
  if (fstat(fd, &st) != 0 || static_cast<uint64_t>(st.st_size) != bytes ||
      bytes < sizeof(wire::FastPathHeader)) {
    close(fd);
    return Status(StatusCode::kInternal, "the fast-path segment from ciuicd has the wrong size");
  }
  void* base = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, 0);
  if (base == MAP_FAILED) {
    close(fd);
    return Status(StatusCode::kResourceExhausted, "mapping the job's fast-path segment: " +
                                                      std::string(std::strerror(errno)));
  }
  std::unique_ptr<FastPath> fp;
  Status s = Attach(static_cast<uint8_t*>(base), bytes, rank, world_size, std::move(job_id), &fp);
  if (!s.ok()) {
    munmap(base, bytes);
    close(fd);
    return s;
  }
  fp->owned_ = true;
  fp->fd_ = fd;
  *out = std::move(fp);
  return Status::Ok();
}

Status FastPath::Attach(uint8_t* base, uint64_t bytes, int rank, int world_size,
                        std::string job_id, std::unique_ptr<FastPath>* out) {
  auto bad = [](const std::string& what) {
    return Status(StatusCode::kInternal, "the job's fast-path segment is not usable: " + what);
  };
  const auto* h = reinterpret_cast<const wire::FastPathHeader*>(base);
  if (h->magic != wire::kFastPathMagic || h->version != wire::kFastPathVersion) {
    return bad("unknown magic or version");
  }
  if (world_size < 1 || h->world_size != static_cast<uint32_t>(world_size) || rank < 0 ||
      rank >= world_size) {
    return bad("it is for " + std::to_string(h->world_size) + " ranks");
  }
  const wire::FastPathGeometry g = wire::ComputeFastPathGeometry(
      h->world_size, h->payload_bytes, h->max_inflight_per_rank);
  if (!g.valid || g.segment_bytes != bytes || h->segment_bytes != bytes ||
      h->slot_count != g.slot_count || h->slot_stride != g.slot_stride ||
      h->slots_offset != g.slots_offset || h->counters_offset != g.counters_offset ||
      h->max_inflight_per_rank != g.max_inflight_per_rank) {
    return bad("its geometry does not match its size");
  }
  std::unique_ptr<FastPath> fp(
      new FastPath(base, bytes, false, -1, rank, world_size, std::move(job_id)));
  fp->payload_limit_ = h->payload_bytes;
  fp->area_bytes_ = wire::AlignUp(h->payload_bytes, 64);
  fp->slot_count_ = g.slot_count;
  fp->slot_stride_ = g.slot_stride;
  fp->slots_offset_ = g.slots_offset;
  fp->counters_offset_ = g.counters_offset;
  fp->max_inflight_ = g.max_inflight_per_rank;
  fp->default_timeout_ms_ = h->op_timeout_ms == 0 ? wire::kDefaultOpTimeoutMs : h->op_timeout_ms;
  *out = std::move(fp);
  return Status::Ok();
}

uint8_t* FastPath::InputArea(uint32_t slot, int rank) const {
  return reinterpret_cast<uint8_t*>(SlotAt(slot)) + wire::AlignUp(sizeof(wire::FastSlot), 64) +
         static_cast<uint64_t>(rank) * area_bytes_;
}

uint8_t* FastPath::ResultArea(uint32_t slot) const { return InputArea(slot, world_size_); }

wire::FastPathCounters* FastPath::counters() const {
  return reinterpret_cast<wire::FastPathCounters*>(base_ + counters_offset_) + rank_;
}

size_t FastPath::inflight() {
  std::lock_guard<std::mutex> lock(mu_);
  return inflight_.size();
}

// ------------------------------------------------------------------ table

bool FastPath::Aborted(Status* why) const {
  const wire::FastPathHeader* h = header();
  if (h->aborted.load(std::memory_order_acquire) == 0) return false;
  if (why != nullptr) {
    const uint32_t n = std::min<uint32_t>(h->abort_message_len, wire::kMaxMessage);
    int code = h->abort_code;
    if (code <= 0 || code > 16) code = static_cast<int>(StatusCode::kAborted);
    *why = Status(static_cast<StatusCode>(code), std::string(h->abort_message, n));
  }
  return true;
}

bool FastPath::LockTable(Status* why) {
  std::atomic<uint32_t>& lock = header()->table_lock;
  const uint32_t mine = static_cast<uint32_t>(rank_) + 1;  // the word names its holder
  const Clock::time_point start = Clock::now();
  auto sleep = std::chrono::microseconds(20);
  for (uint64_t i = 0;; ++i) {
    uint32_t seen = lock.load(std::memory_order_relaxed);
    if (seen == 0 && lock.compare_exchange_strong(seen, mine, std::memory_order_acquire)) {
      return true;
    }
    wire::CpuRelax();
    if ((i & 63) != 63) continue;
    // The holder may be descheduled (cores are few), stopped or dead: a
    // dead one's daemon aborts the segment; a stopped one is given up on.
    if (Aborted(why)) return false;
    const Clock::time_point now = Clock::now();
    if (now - start < kTableLockSpin) {
      sched_yield();
      continue;
    }
    if (now - start >= table_lock_limit_) {
      if (why != nullptr) {
        const uint32_t holder = lock.load(std::memory_order_relaxed);
        *why = Status(StatusCode::kUnavailable,
                      "job '" + job_id_ + "': rank " +
                          (holder == 0 ? std::string("?") : std::to_string(holder - 1)) +
                          " has held the fast path's table lock for over " +
                          std::to_string(std::chrono::duration_cast<std::chrono::milliseconds>(
                                             table_lock_limit_)
                                             .count()) +
                          " ms (stopped or hung?)");
      }
      return false;
    }
    std::this_thread::sleep_for(sleep);
    sleep = std::min<std::chrono::microseconds>(sleep * 2, std::chrono::milliseconds(1));
  }
}

void FastPath::UnlockTable() { header()->table_lock.store(0, std::memory_order_release); }

void FastPath::FailSlotLocked(wire::FastSlot& s, StatusCode code, const std::string& message) {
  if (s.status.load(std::memory_order_acquire) != static_cast<uint32_t>(wire::FastOpStatus::kPending)) {
    return;
  }
  s.error_len = static_cast<uint32_t>(wire::ClipMessage(message.data(), message.size(), s.error));
  s.error_code = static_cast<int32_t>(code);
  uint32_t expected = static_cast<uint32_t>(wire::FastOpStatus::kPending);
  if (s.status.compare_exchange_strong(expected, static_cast<uint32_t>(wire::FastOpStatus::kFailed),
                                       std::memory_order_acq_rel)) {
    // Counted once per operation, like the daemon's ops_failed.
    counters()->ops_failed.fetch_add(1, std::memory_order_relaxed);
  }
  FutexWake(&s.status);
}

// The last rank to leave a slot frees it: a tombstone, so that probe chains
// through it stay intact. No lock: no rank looks for this key again, and a
// claimer under the lock that reads the old state sees a used slot with a
// key nobody asks for, or the tombstone; either is right.
void FastPath::Depart(uint32_t slot) {
  wire::FastSlot& s = *SlotAt(slot);
  if (s.departed.fetch_add(1, std::memory_order_acq_rel) + 1 !=
      static_cast<uint32_t>(world_size_)) {
    return;
  }
  std::atomic_ref<uint32_t>(s.state).store(static_cast<uint32_t>(wire::FastSlotState::kTombstone),
                                           std::memory_order_release);
}

// --------------------------------------------------------------- operations

size_t FastPath::LiveDaemonOpsLocked() {
  daemon_inflight_.erase(std::remove_if(daemon_inflight_.begin(), daemon_inflight_.end(),
                                        [](const auto& d) {
                                          return d->load(std::memory_order_acquire);
                                        }),
                         daemon_inflight_.end());
  return daemon_inflight_.size();
}

void FastPath::TrackDaemon(std::shared_ptr<const std::atomic<bool>> done) {
  std::lock_guard<std::mutex> lock(mu_);
  daemon_inflight_.push_back(std::move(done));
}

Status FastPath::Start(const std::string& name, const Signature& sig, const void* send,
                       uint64_t send_bytes, void* recv, uint32_t timeout_ms,
                       std::shared_ptr<FastOp>* out, bool fits, bool* to_daemon) {
  if (to_daemon != nullptr) *to_daemon = false;
  // A daemon-bound operation usually needs no FastOp: made when needed.
  std::shared_ptr<FastOp> op;
  auto make_op = [&] {
    op = std::make_shared<FastOp>();
    op->collective = static_cast<wire::Collective>(sig.collective);
    op->dtype = sig.dtype;
    op->count = sig.count;
    op->root = sig.root;
    op->name = name;
    op->recv = recv;
    op->timeout = std::chrono::milliseconds(timeout_ms != 0 ? timeout_ms : default_timeout_ms_);
  };
  if (fits) make_op();
  auto finish_now = [&](Status s) {
    if (!op) make_op();
    op->status = std::move(s);
    op->finished.store(true, std::memory_order_release);
    *out = op;
    return Status::Ok();
  };
  Status why;
  if (Aborted(&why)) return finish_now(why);
  if (fits) counters()->cpu.store(sched_getcpu(), std::memory_order_relaxed);

  // At most max_inflight_ of ours in flight, daemon-bound ones included, so
  // the table never fills with live keys (see fast_path.h).
  std::unique_lock<std::mutex> lock(mu_);
  // Fast-path operations finish on the slot without us; Poll reaps them.
  // Otherwise the oldest of each kind is waited for in turn, in short
  // slices, so that neither kind holds up the other.
  for (int turn = 0; inflight_.size() + (daemon_inflight_.empty() ? 0 : LiveDaemonOpsLocked()) >=
                     max_inflight_;
       ++turn) {
    if (turn > 0 && !inflight_.empty()) {
      std::vector<std::shared_ptr<FastOp>> ours = inflight_;
      lock.unlock();
      for (auto& o : ours) Poll(*o);
      lock.lock();
      if (inflight_.size() + LiveDaemonOpsLocked() < max_inflight_) break;
    }
    const auto until = Clock::now() + std::chrono::milliseconds(10);
    if (!daemon_inflight_.empty() && (inflight_.empty() || turn % 2 == 1)) {
      std::shared_ptr<const std::atomic<bool>> oldest = daemon_inflight_.front();
      lock.unlock();
      if (daemon_wait_) {
        daemon_wait_(*oldest, until);
      } else {
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
      }
      lock.lock();
      continue;
    }
    std::shared_ptr<FastOp> oldest = inflight_.front();
    lock.unlock();
    Wait(*oldest, until, 0, [] { return Status::Ok(); });
    lock.lock();
  }
  // Unnamed operations ("#N", numbered by the SDK) never repeat a name:
  // their n is always 0 and they need no entry.
  NameState unnamed;
  NameState& ns = wire::IsUnnamed(name) ? unnamed : names_[name];
  // Only the fast path checks this; the daemon checks its own.
  if (auto last = ns.last.lock(); fits && last && !last->finished.load(std::memory_order_acquire) &&
                                  SlotAt(last->slot)->status.load(std::memory_order_acquire) ==
                                      static_cast<uint32_t>(wire::FastOpStatus::kPending)) {
    return Status(StatusCode::kFailedPrecondition,
                  "operation '" + name + "' submitted twice by rank " + std::to_string(rank_) +
                      " while the first is pending");
  }
  const uint64_t seq = ns.next_seq;

  if (!LockTable(&why)) return finish_now(why);
  // Find (name, seq) or the first reusable slot on its probe chain. The
  // whole chain is walked under the lock up to an empty slot, so a key is
  // never claimed twice.
  const uint32_t mask = slot_count_ - 1;
  uint32_t i = HomeSlot(name, slot_count_);
  int64_t found = -1, reusable = -1;
  // The run of tombstones seen last on this walk (`run` of them, ending just
  // before slot i). Only slots this walk saw as tombstones may become empty:
  // a slot it saw in use may have been freed since (departures take no
  // lock), and emptying it would cut the chain of a key placed after it —
  // possibly the key this walk is about to place at the empty slot.
  uint32_t run = 0;
  for (uint32_t n = 0; n < slot_count_; ++n, i = (i + 1) & mask) {
    wire::FastSlot& s = *SlotAt(i);
    const auto state = static_cast<wire::FastSlotState>(
        std::atomic_ref<uint32_t>(s.state).load(std::memory_order_acquire));
    if (state == wire::FastSlotState::kEmpty) {
      // No chain goes past an empty slot: the tombstones just before it
      // belong to none, and become empty (except the one we may claim).
      for (uint32_t t = (i - 1) & mask, k = 0; k < run; ++k, t = (t - 1) & mask) {
        if (static_cast<int64_t>(t) == reusable) break;
        std::atomic_ref<uint32_t>(SlotAt(t)->state)
            .store(static_cast<uint32_t>(wire::FastSlotState::kEmpty), std::memory_order_release);
      }
      if (reusable < 0) reusable = i;
      break;
    }
    if (state == wire::FastSlotState::kTombstone) {
      if (reusable < 0) reusable = i;
      ++run;
      continue;
    }
    run = 0;
    if (s.seq == seq && s.name_len == name.size() &&
        std::memcmp(s.name, name.data(), name.size()) == 0) {
      found = i;
      break;
    }
  }
  if (found < 0 && reusable < 0) {
    // Cannot happen while every rank keeps its in-flight limit; a rank of
    // this job broke the protocol (or wrote over the table).
    UnlockTable();
    return finish_now(Status(StatusCode::kResourceExhausted,
                             "operation '" + name + "': the fast-path table of job '" + job_id_ +
                                 "' is full (has a rank of the job written over it?)"));
  }
  ns.next_seq = seq + 1;
  uint32_t slot;
  // Goes to the daemon after all (rule 4 of fast_path.h) or because it is
  // large (rule 1): joins the key and leaves it at once; the last rank to
  // join frees it, under the lock. A kDaemon key uses only its first two
  // lines (lock-protected fields, the name), so that a large operation pays
  // for few cache lines shared with the other ranks.
  auto route_to_daemon = [&](uint32_t at) {
    wire::FastSlot& s = *SlotAt(at);
    if (++s.joined == static_cast<uint32_t>(world_size_)) {
      std::atomic_ref<uint32_t>(s.state).store(
          static_cast<uint32_t>(wire::FastSlotState::kTombstone), std::memory_order_release);
    }
    UnlockTable();
    lock.unlock();
    *to_daemon = true;
    out->reset();
    return Status::Ok();
  };
  const bool found_daemon_bound =
      found >= 0 && SlotAt(static_cast<uint32_t>(found))->route ==
                        static_cast<uint32_t>(wire::FastRoute::kDaemon);
  if ((found_daemon_bound || (found < 0 && !fits)) && to_daemon == nullptr) {
    UnlockTable();
    return finish_now(Status(StatusCode::kInternal,
                             "operation '" + name + "' must go through ciuicd"));
  }
  if (found_daemon_bound) return route_to_daemon(static_cast<uint32_t>(found));
  if (fits) ns.last = op;
  if (!op && found >= 0) make_op();  // large, at a kFast key: fails below
  if (found >= 0) {
    slot = static_cast<uint32_t>(found);
  } else {
    slot = static_cast<uint32_t>(reusable);
    wire::FastSlot& s = *SlotAt(slot);
    s.name_len = static_cast<uint32_t>(name.size());
    std::memcpy(s.name, name.data(), name.size());
    s.seq = seq;
    s.collective = sig.collective;
    s.dtype = sig.dtype;
    s.reduce_op = sig.reduce_op;
    s.root = sig.root;
    s.count = sig.count;
    s.codec = sig.codec;
    s.codec_ratio = sig.codec_ratio;
    s.device = sig.device;
    s.first_rank = rank_;
    s.route = static_cast<uint32_t>(fits ? wire::FastRoute::kFast : wire::FastRoute::kDaemon);
    s.joined = 0;
    if (!fits) {
      std::atomic_ref<uint32_t>(s.state).store(static_cast<uint32_t>(wire::FastSlotState::kUsed),
                                               std::memory_order_release);
      return route_to_daemon(slot);
    }
    s.first_submit_ns = MonotonicNs();
    s.arrived.store(0, std::memory_order_relaxed);
    s.departed.store(0, std::memory_order_relaxed);
    s.waiters.store(0, std::memory_order_relaxed);
    s.error_len = 0;
    s.error_code = 0;
    std::memset(s.ranks_joined, 0, sizeof(s.ranks_joined));
    s.status.store(static_cast<uint32_t>(wire::FastOpStatus::kPending), std::memory_order_release);
    std::atomic_ref<uint32_t>(s.state).store(static_cast<uint32_t>(wire::FastSlotState::kUsed),
                                             std::memory_order_release);
  }
  op->slot = slot;
  wire::FastSlot& s = *SlotAt(slot);
  s.ranks_joined[rank_] = 1;
  ++s.joined;
  const bool matches = s.collective == sig.collective && s.dtype == sig.dtype &&
                       s.reduce_op == sig.reduce_op && s.root == sig.root &&
                       s.count == sig.count && s.codec == sig.codec &&
                       s.codec_ratio == sig.codec_ratio && s.device == sig.device;
  if (!matches || !fits) {
    // Worded as the daemon words it (engine.cc). A large operation with the
    // signature of the key's cannot happen (whether it fits depends on the
    // signature alone), but if it did it must fail here too (rule 3).
    FailSlotLocked(
        s, StatusCode::kInvalidArgument,
        "operation '" + name + "' mismatched across ranks: rank " + std::to_string(s.first_rank) +
            " submitted " +
            wire::SignatureString(s.collective, s.dtype, s.reduce_op, s.root, s.count, s.codec,
                                  s.codec_ratio, s.device != 0) +
            ", rank " + std::to_string(rank_) + " submitted " +
            wire::SignatureString(sig.collective, sig.dtype, sig.reduce_op, sig.root, sig.count,
                                  sig.codec, sig.codec_ratio, sig.device != 0) +
            (matches ? ", which does not take the fast path" : ""));
  }
  const bool failed = s.status.load(std::memory_order_acquire) ==
                      static_cast<uint32_t>(wire::FastOpStatus::kFailed);
  UnlockTable();
  inflight_.push_back(op);
  lock.unlock();
  *out = op;
  if (failed) {  // mismatched, or poisoned earlier (timeout)
    Poll(*op);
    return Status::Ok();
  }

  // Input in, then arrive; the last arriver computes.
  const uint64_t es = wire::DataTypeSize(sig.dtype);
  const uint64_t block = sig.count * es;
  switch (op->collective) {
    case wire::Collective::kAllreduce:
    case wire::Collective::kReduceScatter:
    case wire::Collective::kAlltoall:  // each rank takes its blocks from every input
      if (send_bytes > 0) std::memcpy(InputArea(slot, rank_), send, send_bytes);
      break;
    case wire::Collective::kAllgather:
      if (block > 0) std::memcpy(ResultArea(slot) + static_cast<uint64_t>(rank_) * block, send, block);
      break;
    case wire::Collective::kBroadcast:
      if (rank_ == sig.root && block > 0) std::memcpy(ResultArea(slot), send, block);
      break;
    case wire::Collective::kBarrier:
    // Never on a slot: its counts differ per rank, so it never fits (the
    // client's FastFits), and its key is daemon-bound on every rank.
    case wire::Collective::kAlltoallv:
      break;
  }
  if (s.arrived.fetch_add(1, std::memory_order_acq_rel) + 1 == static_cast<uint32_t>(world_size_)) {
    if (Reduces(op->collective) && sig.count > 0) {
      const uint64_t elems =
          op->collective == wire::Collective::kReduceScatter ? sig.count * world_size_ : sig.count;
      const void* inputs[wire::kMaxFastPathRanks];
      for (int r = 0; r < world_size_; ++r) inputs[r] = InputArea(slot, r);
      reduce::Reduce(static_cast<wire::DataType>(sig.dtype),
                     static_cast<wire::ReduceOp>(sig.reduce_op), inputs, world_size_,
                     ResultArea(slot), elems);
    }
    s.done_ns = static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                          Clock::now().time_since_epoch())
                                          .count());
    uint32_t expected = static_cast<uint32_t>(wire::FastOpStatus::kPending);
    if (s.status.compare_exchange_strong(expected, static_cast<uint32_t>(wire::FastOpStatus::kDone),
                                         std::memory_order_acq_rel)) {
      // Counted once per operation (by the rank that completed it), as the
      // daemon counts its own.
      wire::FastPathCounters* c = counters();
      c->ops_completed.fetch_add(1, std::memory_order_relaxed);
      c->bytes.fetch_add(CountedBytes(op->collective, sig.count * es, world_size_),
                         std::memory_order_relaxed);
    }
    if (s.waiters.load(std::memory_order_seq_cst) != 0) FutexWake(&s.status);
    Poll(*op);
  } else {
    // Only an operation that waits needs the clock (a read costs as much as
    // a cache miss in a VM); its arrival is within a microsecond of its
    // submission.
    op->started = Clock::now();
    op->deadline = op->started + op->timeout;
  }
  return Status::Ok();
}

void FastPath::FinishLocked(FastOp& op, Status status) {
  op.status = std::move(status);
  op.finished.store(true, std::memory_order_release);
  Depart(op.slot);
  Forget(op);
}

void FastPath::Forget(const FastOp& op) {
  std::lock_guard<std::mutex> lock(mu_);
  inflight_.erase(std::remove_if(inflight_.begin(), inflight_.end(),
                                 [&](const auto& p) { return p.get() == &op; }),
                  inflight_.end());
}

void FastPath::CheckDeadlineLocked(FastOp& op) {
  const Clock::time_point now = Clock::now();
  if (now < op.deadline) return;
  wire::FastSlot& s = *SlotAt(op.slot);
  if (!LockTable(nullptr)) return;
  std::string waiting;
  for (int r = 0; r < world_size_; ++r) {
    if (s.ranks_joined[r] == 0) waiting += (waiting.empty() ? "" : ",") + std::to_string(r);
  }
  if (waiting.empty()) waiting = "that have not arrived";
  const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(now - op.started).count();
  // Worded as the daemon words it (engine.cc).
  FailSlotLocked(s, StatusCode::kDeadlineExceeded,
                 "operation '" + op.name + "' of job '" + job_id_ + "' timed out after " +
                     std::to_string(ms) + " ms waiting for rank(s) " + waiting);
  UnlockTable();
}

bool FastPath::Progress(FastOp& op, bool check_deadline) {
  if (op.finished.load(std::memory_order_acquire)) return true;
  std::lock_guard<std::mutex> lock(op.mu);
  if (op.finished.load(std::memory_order_acquire)) return true;
  wire::FastSlot& s = *SlotAt(op.slot);
  auto status = static_cast<wire::FastOpStatus>(s.status.load(std::memory_order_acquire));
  if (status == wire::FastOpStatus::kPending) {
    Status why;
    if (Aborted(&why)) {
      // The job is over; the slot is not reused (the daemon drops the segment).
      op.status = why;
      op.finished.store(true, std::memory_order_release);
      Forget(op);
      return true;
    }
    if (!check_deadline) return false;
    CheckDeadlineLocked(op);
    status = static_cast<wire::FastOpStatus>(s.status.load(std::memory_order_acquire));
    if (status == wire::FastOpStatus::kPending) return false;
  }
  if (status == wire::FastOpStatus::kFailed) {
    const uint32_t n = std::min<uint32_t>(s.error_len, wire::kMaxMessage);
    int code = s.error_code;
    if (code <= 0 || code > 16) code = static_cast<int>(StatusCode::kInternal);
    FinishLocked(op, Status(static_cast<StatusCode>(code), std::string(s.error, n)));
    return true;
  }
  // Done: copy this rank's result out.
  op.completed_ns = s.done_ns;
  const uint64_t block = op.count * wire::DataTypeSize(op.dtype);
  const uint8_t* result = ResultArea(op.slot);
  switch (op.collective) {
    case wire::Collective::kAllreduce:
    case wire::Collective::kBroadcast:
      if (block > 0) std::memcpy(op.recv, result, block);
      break;
    case wire::Collective::kReduceScatter:
      if (block > 0) std::memcpy(op.recv, result + static_cast<uint64_t>(rank_) * block, block);
      break;
    case wire::Collective::kAllgather:
      if (block > 0) std::memcpy(op.recv, result, block * static_cast<uint64_t>(world_size_));
      break;
    case wire::Collective::kAlltoall:
      // The inputs stay until every rank has departed (after its copy).
      for (int from = 0; block > 0 && from < world_size_; ++from) {
        std::memcpy(static_cast<uint8_t*>(op.recv) + static_cast<uint64_t>(from) * block,
                    InputArea(op.slot, from) + static_cast<uint64_t>(rank_) * block, block);
      }
      break;
    case wire::Collective::kBarrier:
    case wire::Collective::kAlltoallv:  // never on a slot (above)
      break;
  }
  FinishLocked(op, Status::Ok());
  return true;
}

bool FastPath::Wait(FastOp& op, Clock::time_point until, uint32_t spin_us,
                    const std::function<Status()>& check) {
  if (Progress(op, false)) return true;
  wire::FastSlot& s = *SlotAt(op.slot);
  const uint32_t pending = static_cast<uint32_t>(wire::FastOpStatus::kPending);
  // Spin: loads and pauses (a pause is ~40 ns), the clock read every 64
  // pauses. For the first few microseconds nothing else: a peer on another
  // core answers within that, and a yield would hand our core to an
  // unrelated process. After that, a yield every 64 pauses, so that a peer
  // that shares our core (cores are few) gets it. The deadline is looked at
  // once the spin is over (Poll).
  if (spin_us > 0) {
    Clock::time_point quiet_end{}, spin_end{};
    for (bool first = true;; first = false) {
      for (int i = 0; i < 64; ++i) {
        if (s.status.load(std::memory_order_acquire) != pending) return Progress(op, false);
        wire::CpuRelax();
      }
      const Clock::time_point now = Clock::now();
      if (first) {
        // A peer on our own CPU cannot answer while we spin: yield at once.
        quiet_end = PeerOnMyCpu() ? now : now + std::chrono::microseconds(kQuietSpinUs);
        spin_end = now + std::chrono::microseconds(spin_us);
      }
      if (now >= spin_end || now >= until) break;
      if (now >= quiet_end) sched_yield();
    }
  }
  while (true) {
    if (Poll(op)) return true;
    Status alive = check();
    if (!alive.ok()) {
      std::lock_guard<std::mutex> lock(op.mu);
      if (!op.finished.load(std::memory_order_acquire)) {
        op.status = alive;
        op.finished.store(true, std::memory_order_release);
        Forget(op);
      }
      return true;
    }
    const Clock::time_point now = Clock::now();
    if (now >= until) return false;
    const Clock::time_point wake = std::min({until, op.deadline + std::chrono::milliseconds(1),
                                             now + std::chrono::milliseconds(100)});
    s.waiters.fetch_add(1, std::memory_order_seq_cst);
    if (s.status.load(std::memory_order_seq_cst) == pending &&
        header()->aborted.load(std::memory_order_seq_cst) == 0) {
      FutexWait(&s.status, pending, std::max<Clock::duration>(wake - now, std::chrono::microseconds(1)));
    }
    s.waiters.fetch_sub(1, std::memory_order_seq_cst);
  }
}

bool FastPath::PeerOnMyCpu() const {
  const int me = sched_getcpu();
  const auto* c = reinterpret_cast<const wire::FastPathCounters*>(base_ + counters_offset_);
  for (int r = 0; r < world_size_; ++r) {
    if (r != rank_ && c[r].cpu.load(std::memory_order_relaxed) == me) return true;
  }
  return false;
}

void FastPath::CancelAll(const Status& why) {
  std::vector<std::shared_ptr<FastOp>> ops;
  {
    std::lock_guard<std::mutex> lock(mu_);
    ops.swap(inflight_);
  }
  for (auto& op : ops) {
    std::lock_guard<std::mutex> lock(op->mu);
    if (op->finished.load(std::memory_order_acquire)) continue;
    op->status = why;
    op->finished.store(true, std::memory_order_release);
  }
}

}  // namespace ciuic
