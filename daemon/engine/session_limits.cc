#include "engine/session_limits.h"

#include "absl/strings/str_cat.h"

namespace ciuic::daemon {

SessionLimits::SessionLimits(Limits limits)
    : limits_(limits), state_(std::make_shared<Ticket::State>()) {}

SessionLimits::Ticket::~Ticket() {
  absl::MutexLock lock(&state_->mu);
  state_->total.sessions -= 1;
  state_->total.arena_bytes -= bytes_;
  auto it = state_->by_uid.find(uid_);
  it->second.sessions -= 1;
  it->second.arena_bytes -= bytes_;
  if (it->second.sessions == 0) state_->by_uid.erase(it);
}

absl::StatusOr<std::unique_ptr<SessionLimits::Ticket>> SessionLimits::Reserve(
    uid_t uid, uint64_t arena_bytes) {
  absl::MutexLock lock(&state_->mu);
  Usage& total = state_->total;
  auto found = state_->by_uid.find(uid);
  const Usage mine = found == state_->by_uid.end() ? Usage{} : found->second;
  if (total.sessions >= limits_.sessions) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "ciuicd has ", total.sessions, " sessions open, the most it takes (max_sessions)"));
  }
  if (mine.sessions >= limits_.sessions_per_uid) {
    return absl::ResourceExhaustedError(
        absl::StrCat("uid ", uid, " has ", mine.sessions,
                     " sessions open on this ciuicd, the most one uid may (max_sessions_per_uid)"));
  }
  if (arena_bytes > limits_.arena_bytes_per_uid - mine.arena_bytes) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "a session arena of ", arena_bytes, " bytes would take uid ", uid, " over its ",
        limits_.arena_bytes_per_uid, " bytes of arenas on this ciuicd (it holds ",
        mine.arena_bytes, "; max_arena_bytes_per_uid)"));
  }
  if (arena_bytes > limits_.arena_bytes_total - total.arena_bytes) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "a session arena of ", arena_bytes, " bytes would take ciuicd over ",
        limits_.arena_bytes_total, " bytes of arenas for all users (", total.arena_bytes,
        " mapped; max_arena_bytes_total)"));
  }
  total.sessions += 1;
  total.arena_bytes += arena_bytes;
  Usage& slot = state_->by_uid[uid];
  slot.sessions += 1;
  slot.arena_bytes += arena_bytes;
  return std::unique_ptr<Ticket>(new Ticket(state_, uid, arena_bytes));
}

SessionLimits::Usage SessionLimits::Of(uid_t uid) const {
  absl::MutexLock lock(&state_->mu);
  auto it = state_->by_uid.find(uid);
  return it == state_->by_uid.end() ? Usage{} : it->second;
}

SessionLimits::Usage SessionLimits::Total() const {
  absl::MutexLock lock(&state_->mu);
  return state_->total;
}

}  // namespace ciuic::daemon
