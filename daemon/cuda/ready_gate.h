// Device operations held on the host until the trainers' streams have
// reached their submissions (issue 7).
//
// A trainer submits a device buffer with an IPC event recorded on its
// stream: the daemon must not touch the buffer before the trainer's work
// queued ahead of the submission is done. Making the daemon's stream wait
// for that event on the device (cudaStreamWaitEvent) cannot be taken back:
// a trainer stream that never gets there (a hung kernel, a trainer that
// died) would hold the daemon's stream, and whatever waits for it (a
// multi-node job's lane, a staged buffer's release on the runner's thread,
// the daemon's shutdown), for ever; and an operation timed out meanwhile
// would still run later, on buffers its ranks had been told were theirs
// again. So the runner asks here instead: an entry passes once every one of
// its waits has been reached, and only then is its work enqueued. It fails,
// with nothing enqueued, at its deadline, when a wait reports an error, when
// a session it names ends, or when its lane (the job) or the gate is shut.
//
// Entries of one lane pass in the order they were added (a job's operations
// go in order); an entry held up holds up only its own lane.
//
// Plain C++ (no CUDA: the waits are callbacks), owned by one thread (the
// runner's submit thread) and tested on any machine (ready_gate_test.cc).
// Every entry's `pass` is called exactly once, on the calling thread, after
// the gate's own state is updated: it may call the gate again.
#pragma once

#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace ciuic::daemon {

class ReadyGate {
 public:
  using Clock = std::chrono::steady_clock;

  // One point on a trainer's stream: `reached` says whether the stream has
  // got there (it is asked again until it has; once true, never again), or
  // the error the stream's work failed with.
  struct Wait {
    std::string who;  // for messages: "rank 1's stream"
    std::function<absl::StatusOr<bool>()> reached;
  };

  struct Entry {
    std::string lane;  // entries of one lane pass in order
    std::string what;  // before its messages, unless empty: "operation 'grad0'"
    std::vector<Wait> waits;
    std::vector<uint64_t> sessions;  // whose end fails the entry
    Clock::time_point added;         // for messages (set by Add when unset)
    Clock::time_point deadline = Clock::time_point::max();
    // OK: every wait was reached, the work may go. Else why it may not
    // (nothing of it was enqueued).
    std::function<void(absl::Status)> pass;
  };

  // Holds `entry` behind its lane's earlier ones; Poll decides.
  void Add(Entry entry);

  // Passes or fails what can be decided at `now`: the head of each lane,
  // and the next one when a head is gone. An entry's waits are asked in
  // order, each until reached. Fails an entry past its deadline with
  // DEADLINE_EXCEEDED naming the streams not reached (behind a head still
  // held: saying so); one whose wait reports an error, with that error.
  // Returns how many entries are held.
  size_t Poll(Clock::time_point now);

  // Fails every held entry that names `session`, in lane order, with `why`
  // (its message after the entry's `what`).
  void FailSession(uint64_t session, const absl::Status& why);
  // Fails every held entry of `lane`, in order.
  void FailLane(const std::string& lane, const absl::Status& why);
  // Fails every held entry.
  void FailAll(const absl::Status& why);

  size_t held() const { return held_; }

 private:
  struct Held {
    Entry entry;
    size_t next_wait = 0;  // the waits before it were reached
  };
  // Removes the entries `fail` picks from every lane (in order), then calls
  // their `pass` with `why`.
  void FailWhere(const std::function<bool(const Held&)>& fail, const absl::Status& why);

  std::map<std::string, std::deque<Held>> lanes_;  // no empty lane
  size_t held_ = 0;
};

}  // namespace ciuic::daemon
