// Matching of one job's operations among the ranks of this node, by name:
// what the engine's loop decides when a rank submits (wait for the others,
// launch, refuse, a mismatch that fails the operation on every local rank)
// and when an operation's deadline passes.
//
// Pure bookkeeping, no I/O, no sessions: the engine acts on what the
// matcher returns (completes refused submissions, launches, completes the
// parts of failed operations), so that the rules can be tested in
// milliseconds (op_matcher_test.cc). Not thread-safe: the engine loop's.
//
// Op is the engine's record of an operation (a test's, in the tests); the
// matcher owns these fields of it:
//   std::string name; OpSignature sig; int32_t priority;
//   Clock::time_point first_submit, deadline;
//   std::vector<std::optional<Part>> parts;  // by rank, submitted and not failed
//   std::vector<bool> seen; int seen_count;  // ranks that submitted the name
//   int submitted;                           // parts present
//   absl::Status failure;                    // poisoned
// where Part is what the engine keeps of one rank's submission.
//
// The rules:
// - An operation launches when every local rank has submitted it with one
//   signature; its priority is the highest any rank gave, its deadline the
//   earliest of the ranks' submission plus timeout.
// - A rank that submits a name it has pending gets FAILED_PRECONDITION; the
//   first submission goes on.
// - A signature that differs from the first rank's fails the operation on
//   every local rank that submitted it, and on the submitting one, with
//   INVALID_ARGUMENT naming both signatures. The name stays poisoned (later
//   submitters of it get that error at once) until every local rank has
//   submitted it, then it is forgotten: the next use of the name is a new
//   operation.
// - An operation whose deadline passes before every rank submitted fails
//   with DEADLINE_EXCEEDED naming the ranks it waits for; also poisoned.
#pragma once

#include <algorithm>
#include <chrono>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "collectives/op.h"

namespace ciuic::daemon {

template <typename Op, typename Part>
class OpMatcher {
 public:
  using Clock = std::chrono::steady_clock;

  struct Submitted {
    enum class Kind {
      kWaiting,   // taken; other local ranks have not submitted it yet
      kLaunch,    // taken, and it was the last: `op` is complete, no longer pending
      kRefused,   // not taken: `status` is this submission's error
      kMismatch,  // not taken, and `op` has failed: fail its parts (Fail) and this one
    };
    Kind kind = Kind::kWaiting;
    std::shared_ptr<Op> op;
    absl::Status status;
    int other_rank = -1;  // kMismatch: a rank whose submission set op->sig
  };

  // `world_size` ranks in the job, `local_size` of them on this node.
  OpMatcher(int world_size, int local_size) : world_size_(world_size), local_size_(local_size) {}

  // Rank `rank` submits `name`; `make` creates the operation's record when
  // the name is not pending (the matcher fills in its own fields).
  template <typename Make>
  Submitted Submit(int rank, const std::string& name, const OpSignature& sig, int32_t priority,
                   Clock::time_point now, Clock::duration timeout, Part part, Make&& make) {
    Submitted out;
    std::shared_ptr<Op>& slot = pending_[name];
    if (!slot) {
      slot = make();
      slot->name = name;
      slot->sig = sig;
      slot->priority = priority;
      slot->first_submit = now;
      slot->deadline = now + timeout;
      slot->parts.clear();
      slot->parts.resize(world_size_);
      slot->seen.assign(world_size_, false);
      slot->seen_count = 0;
      slot->submitted = 0;
      slot->failure = absl::OkStatus();
    }
    std::shared_ptr<Op> op = slot;
    out.op = op;
    if (op->seen[rank]) {
      out.kind = Submitted::Kind::kRefused;
      out.status = absl::FailedPreconditionError(absl::StrCat(
          "operation '", name, "' submitted twice by rank ", rank, " while the first is pending"));
      return out;
    }
    op->seen[rank] = true;
    ++op->seen_count;
    if (!op->failure.ok()) {  // poisoned by a mismatch or a timeout
      out.kind = Submitted::Kind::kRefused;
      out.status = op->failure;
      ForgetIfAllSeen(*op);
      return out;
    }
    if (!(sig == op->sig)) {
      for (int r = 0; r < world_size_; ++r) {
        if (op->parts[r]) {
          out.other_rank = r;
          break;
        }
      }
      out.kind = Submitted::Kind::kMismatch;
      out.status = absl::InvalidArgumentError(absl::StrCat(
          "operation '", name, "' mismatched across ranks: rank ", out.other_rank, " submitted ",
          op->sig.ToString(), ", rank ", rank, " submitted ", sig.ToString()));
      op->failure = out.status;
      ForgetIfAllSeen(*op);
      return out;
    }
    op->priority = std::max(op->priority, priority);
    op->deadline = std::min(op->deadline, now + timeout);
    op->parts[rank] = std::move(part);
    if (++op->submitted == local_size_) {
      pending_.erase(name);
      out.kind = Submitted::Kind::kLaunch;
    }
    return out;
  }

  // Fails `op`: poisons its name (if still pending) and hands over the
  // parts submitted so far, which the caller completes with `status`.
  std::vector<Part> Fail(Op& op, const absl::Status& status) {
    op.failure = status;
    std::vector<Part> parts;
    for (auto& p : op.parts) {
      if (!p) continue;
      parts.push_back(std::move(*p));
      p.reset();
    }
    op.submitted = 0;
    return parts;
  }

  // The pending operations whose deadline has passed by `now`, not failed
  // yet, each with the DEADLINE_EXCEEDED to fail it with (Fail): it names
  // the local ranks (of `local_ranks`, the ranks that joined) it waits for.
  std::vector<std::pair<std::shared_ptr<Op>, absl::Status>> Expired(
      Clock::time_point now, const std::vector<int>& local_ranks,
      const std::string& job_id) const {
    std::vector<std::pair<std::shared_ptr<Op>, absl::Status>> out;
    for (const auto& [name, op] : pending_) {
      if (!op->failure.ok() || now < op->deadline) continue;
      std::vector<int> waiting;
      for (int r : local_ranks) {
        if (!op->seen[r]) waiting.push_back(r);
      }
      const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(now - op->first_submit);
      out.emplace_back(op, absl::DeadlineExceededError(absl::StrCat(
                               "operation '", name, "' of job '", job_id, "' timed out after ",
                               ms.count(), " ms waiting for rank(s) ",
                               waiting.empty() ? "of this node that have not joined"
                                               : absl::StrJoin(waiting, ","))));
    }
    return out;
  }

  // Takes every pending operation out (the job failed): the caller fails each.
  std::vector<std::shared_ptr<Op>> TakeAll() {
    std::vector<std::shared_ptr<Op>> out;
    for (auto& [name, op] : pending_) out.push_back(std::move(op));
    pending_.clear();
    return out;
  }

  // Operations some local rank has submitted and that have not launched,
  // by name (poisoned ones included until every local rank has seen them).
  const std::map<std::string, std::shared_ptr<Op>>& pending() const { return pending_; }
  bool empty() const { return pending_.empty(); }

 private:
  void ForgetIfAllSeen(const Op& op) {
    if (op.seen_count == local_size_) pending_.erase(op.name);
  }

  const int world_size_;
  const int local_size_;
  std::map<std::string, std::shared_ptr<Op>> pending_;
};

}  // namespace ciuic::daemon
