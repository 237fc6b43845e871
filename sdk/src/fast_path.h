// The SDK's side of the single-node small-operation fast path: runs small
// collectives among the ranks of a job directly in the job's shared segment
// (the layout and the protocol are in proto/ciuic/fast_path.h).
//
// A FastPath belongs to one Communicator (one rank). Start() matches the
// operation with the other ranks' submissions of the same (name, n), copies
// the input in and returns at once (the last rank to arrive computes the
// result); Poll() and Wait() complete it: the result is copied out into the
// caller's recv buffer, and the operation's status is final. Operations the
// caller never waits for are completed by later calls (Start, Poll, Wait).
// In a job with a segment every operation passes Start, large ones too: it
// takes the operation's key and says which path it takes, so that ranks
// whose operations would take different paths get a mismatch error rather
// than wait for each other on both paths (proto/ciuic/fast_path.h).
//
// Threads: every method may be called from any thread; a FastPath's own
// state is under a mutex, each operation's completion under its own, and the
// segment's table under its spinlock (held for a lookup and a few stores,
// never across a copy, a reduction or a wait).
#pragma once

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "ciuic/fast_path.h"
#include "ciuic/status.h"

namespace ciuic {

class FastPath;

// One operation of this rank on the fast path.
struct FastOp {
  using Clock = std::chrono::steady_clock;

  uint32_t slot = 0;
  wire::Collective collective{};
  uint32_t dtype = 0;
  uint64_t count = 0;
  int32_t root = 0;
  std::string name;
  void* recv = nullptr;  // the caller's, written at completion
  std::chrono::milliseconds timeout{0};
  Clock::time_point started;   // set once it has to wait for other ranks
  Clock::time_point deadline;

  std::mutex mu;  // completion
  std::atomic<bool> finished{false};
  Status status;  // final once `finished`
  // When the operation completed (the slot's done_ns, steady_clock's
  // epoch), once `finished` with OK; 0 if unknown.
  uint64_t completed_ns = 0;
};

class FastPath {
 public:
  using Clock = std::chrono::steady_clock;

  struct Signature {
    uint32_t collective = 0;
    uint32_t dtype = 0;
    uint32_t reduce_op = 0;  // 0 unless the collective reduces
    int32_t root = 0;        // broadcast only, else 0
    uint64_t count = 0;
    uint32_t codec = 0;
    float codec_ratio = 0;
    uint32_t device = 0;  // 1: CUDA device buffers; such an operation never fits
  };

  // Maps the segment `fd` (as received from the daemon, `bytes` long) and
  // checks its header against the geometry computed here from world_size
  // and the header's payload limit. Takes ownership of fd.
  static Status Open(int fd, uint64_t bytes, int rank, int world_size, std::string job_id,
                     std::unique_ptr<FastPath>* out);
  // Over memory mapped by the caller (tests: ranks as threads); the memory
  // must hold a header written by wire::InitFastPathSegment and outlive the FastPath.
  static Status Attach(uint8_t* base, uint64_t bytes, int rank, int world_size,
                       std::string job_id, std::unique_ptr<FastPath>* out);

  ~FastPath();
  FastPath(const FastPath&) = delete;
  FastPath& operator=(const FastPath&) = delete;

  // Payload bytes per rank (max of send and recv) up to which operations go here.
  uint64_t payload_limit() const { return payload_limit_; }
  uint32_t max_inflight() const { return max_inflight_; }

  // Submits, or routes to the daemon. The signature has passed the checks
  // the daemon makes of a submission. `fits`: its payload per rank (max of
  // send and recv bytes, as the daemon counts them, see shm_layout.h) is at
  // most payload_limit(); then `send` holds send_bytes for the fast path.
  // Returns either the operation in *out, which may already be finished
  // (mismatch, abort, a poisoned name), or *to_daemon = true and no
  // operation: the caller sends it to the daemon, then hands its completion
  // flag to TrackDaemon (see proto/ciuic/fast_path.h on routes; a large
  // operation may get an *out that failed, a small one *to_daemon). A
  // caller that passes no to_daemon gets an error instead of that route. An
  // error return (nothing submitted): the name is pending already on this
  // rank.
  Status Start(const std::string& name, const Signature& sig, const void* send,
               uint64_t send_bytes, void* recv, uint32_t timeout_ms,
               std::shared_ptr<FastOp>* out, bool fits = true, bool* to_daemon = nullptr);
  // An operation Start sent to the daemon; `done` turns true when the
  // daemon has completed it. Counted in the in-flight limit until then.
  void TrackDaemon(std::shared_ptr<const std::atomic<bool>> done);
  // How long a rank waits for another that holds the table lock before it
  // gives up (10 s; tests shorten it).
  void set_table_lock_limit(Clock::duration limit) { table_lock_limit_ = limit; }
  // How Start waits for the oldest daemon-bound operation when the
  // in-flight limit is reached: until `done` or `until`. Set before the
  // first Start (the client reaps its completion ring here).
  using DaemonWait =
      std::function<void(const std::atomic<bool>& done, Clock::time_point until)>;
  void SetDaemonWait(DaemonWait wait) { daemon_wait_ = std::move(wait); }
  // Completes `op` if it can without waiting; true once it is finished.
  // Also fails it (for every rank) once its deadline has passed.
  bool Poll(FastOp& op) { return Progress(op, true); }
  // Completes `op`, waiting until `until` (spins up to spin_us, then sleeps
  // on the slot's futex in slices of at most 100 ms). `check` is called once
  // per slice; an error from it (daemon gone) fails the operation. True
  // once finished.
  bool Wait(FastOp& op, Clock::time_point until, uint32_t spin_us,
            const std::function<Status()>& check);
  // Fails every unfinished operation with `why` (communicator destroyed).
  void CancelAll(const Status& why);

  // Ops this rank has in flight (submitted, not yet finished).
  size_t inflight();

 private:
  FastPath(uint8_t* base, uint64_t bytes, bool owned, int fd, int rank, int world_size,
           std::string job_id);

  wire::FastPathHeader* header() const { return reinterpret_cast<wire::FastPathHeader*>(base_); }
  wire::FastSlot* SlotAt(uint32_t i) const {
    return reinterpret_cast<wire::FastSlot*>(base_ + slots_offset_ + uint64_t{i} * slot_stride_);
  }
  uint8_t* InputArea(uint32_t slot, int rank) const;
  uint8_t* ResultArea(uint32_t slot) const;
  wire::FastPathCounters* counters() const;

  bool Aborted(Status* why) const;
  // Whether another rank last submitted from the CPU we run on.
  bool PeerOnMyCpu() const;
  // Takes the table lock. False when the segment was aborted meanwhile
  // (*why: the abort), or when another rank has held the lock for
  // table_lock_limit_ (stopped or hung while holding it: *why UNAVAILABLE
  // naming that rank). Spins briefly, then sleeps in growing steps: a
  // waiter never burns a core for long.
  bool LockTable(Status* why);
  void UnlockTable();
  void FailSlotLocked(wire::FastSlot& s, StatusCode code, const std::string& message);
  void Depart(uint32_t slot);
  // Finishes `op` from its slot's final state; op.mu held.
  void FinishLocked(FastOp& op, Status status);
  // Drops `op` from the in-flight list (takes mu_).
  void Forget(const FastOp& op);
  void CheckDeadlineLocked(FastOp& op);
  // Poll(), optionally without the deadline check (it reads the clock).
  bool Progress(FastOp& op, bool check_deadline);

  uint8_t* base_;
  uint64_t bytes_;
  bool owned_;
  int fd_;
  const int rank_;
  const int world_size_;
  const std::string job_id_;
  uint64_t payload_limit_ = 0;
  uint64_t area_bytes_ = 0;
  uint32_t slot_count_ = 0;
  uint64_t slot_stride_ = 0;
  uint64_t slots_offset_ = 0;
  uint64_t counters_offset_ = 0;
  uint32_t max_inflight_ = 0;
  uint32_t default_timeout_ms_ = 0;

  struct NameState {
    uint64_t next_seq = 0;
    std::weak_ptr<FastOp> last;
  };
  // Daemon-bound operations not yet complete (for the in-flight limit).
  size_t LiveDaemonOpsLocked();

  Clock::duration table_lock_limit_ = std::chrono::seconds(10);
  std::mutex mu_;  // names_, inflight_, daemon_inflight_
  std::unordered_map<std::string, NameState> names_;
  std::vector<std::shared_ptr<FastOp>> inflight_;
  std::vector<std::shared_ptr<const std::atomic<bool>>> daemon_inflight_;
  DaemonWait daemon_wait_;
};

}  // namespace ciuic
