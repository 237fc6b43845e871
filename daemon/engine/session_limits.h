// What the sessions of each uid hold on this node, held against the
// config's limits before the daemon maps (and pre-faults) a session's
// arena: sessions in all and per uid, arena bytes in all and per uid.
//
// The acceptor thread reserves when a trainer asks for a session; the
// reservation (a Ticket) lives in the session and gives its share back when
// the session is destroyed, that is once its memory is unmapped. Any
// thread; a Ticket may outlive the SessionLimits that issued it.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <map>
#include <memory>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"

namespace ciuic::daemon {

class SessionLimits {
 public:
  struct Limits {
    uint32_t sessions = 4096;
    uint32_t sessions_per_uid = 512;
    uint64_t arena_bytes_total = UINT64_MAX;
    uint64_t arena_bytes_per_uid = UINT64_MAX;
  };
  struct Usage {
    uint32_t sessions = 0;
    uint64_t arena_bytes = 0;
  };

  // Gives its reservation back when destroyed.
  class Ticket {
   public:
    ~Ticket();
    Ticket(const Ticket&) = delete;
    Ticket& operator=(const Ticket&) = delete;

   private:
    friend class SessionLimits;
    struct State;
    Ticket(std::shared_ptr<State> state, uid_t uid, uint64_t bytes)
        : state_(std::move(state)), uid_(uid), bytes_(bytes) {}
    std::shared_ptr<State> state_;
    uid_t uid_;
    uint64_t bytes_;
  };

  explicit SessionLimits(Limits limits);

  // A session of `arena_bytes` for `uid`, or RESOURCE_EXHAUSTED naming the
  // limit that refuses it and its config key.
  absl::StatusOr<std::unique_ptr<Ticket>> Reserve(uid_t uid, uint64_t arena_bytes);

  Usage Of(uid_t uid) const;
  Usage Total() const;
  const Limits& limits() const { return limits_; }

 private:
  const Limits limits_;
  std::shared_ptr<Ticket::State> state_;
};

struct SessionLimits::Ticket::State {
  mutable absl::Mutex mu;
  Usage total ABSL_GUARDED_BY(mu);
  std::map<uid_t, Usage> by_uid ABSL_GUARDED_BY(mu);
};

}  // namespace ciuic::daemon
