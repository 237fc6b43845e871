// ReadyGate: see ready_gate.h.
#include "cuda/ready_gate.h"

#include <algorithm>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace ciuic::daemon {
namespace {

// `message` after `what` (when there is one).
std::string About(const std::string& what, absl::string_view message) {
  return what.empty() ? std::string(message) : absl::StrCat(what, ": ", message);
}

// The waits from `first` on, each named once (a rank's send and receive
// events are two waits), the first few only: "rank 1's stream, rank 2's
// stream and 5 more".
std::string Late(const std::vector<ReadyGate::Wait>& waits, size_t first) {
  constexpr size_t kNamed = 3;
  std::vector<std::string> names;
  for (size_t i = first; i < waits.size(); ++i) {
    if (std::find(names.begin(), names.end(), waits[i].who) == names.end()) {
      names.push_back(waits[i].who);
    }
  }
  if (names.size() <= kNamed) return absl::StrJoin(names, ", ");
  return absl::StrCat(absl::StrJoin(names.begin(), names.begin() + kNamed, ", "), " and ",
                      names.size() - kNamed, " more");
}

}  // namespace

void ReadyGate::Add(Entry entry) {
  if (entry.added == Clock::time_point()) entry.added = Clock::now();
  lanes_[entry.lane].push_back(Held{std::move(entry), 0});
  ++held_;
}

size_t ReadyGate::Poll(Clock::time_point now) {
  // Decided first, called after: a `pass` may call the gate.
  std::vector<std::pair<std::function<void(absl::Status)>, absl::Status>> decided;
  for (auto lane = lanes_.begin(); lane != lanes_.end();) {
    std::deque<Held>& q = lane->second;
    while (!q.empty()) {
      Held& h = q.front();
      absl::Status verdict;
      bool ready = true;
      for (; h.next_wait < h.entry.waits.size(); ++h.next_wait) {
        absl::StatusOr<bool> r = h.entry.waits[h.next_wait].reached();
        if (!r.ok()) {
          verdict = absl::Status(r.status().code(),
                                 About(h.entry.what, absl::StrCat(h.entry.waits[h.next_wait].who,
                                                                  ": ", r.status().message())));
          break;
        }
        if (!*r) {
          ready = false;
          break;
        }
      }
      if (verdict.ok() && !ready) {
        if (now < h.entry.deadline) {
          // The lane waits for its head; those behind it past their own
          // deadlines fail (nothing of them was enqueued either).
          for (auto it = std::next(q.begin()); it != q.end();) {
            if (now < it->entry.deadline) {
              ++it;
              continue;
            }
            const auto ms =
                std::chrono::duration_cast<std::chrono::milliseconds>(now - it->entry.added)
                    .count();
            decided.emplace_back(
                std::move(it->entry.pass),
                absl::DeadlineExceededError(About(
                    it->entry.what,
                    absl::StrCat("nothing of the operation ran: timed out after ", ms,
                                 " ms behind an earlier operation of its job that waits for its "
                                 "ranks' streams to reach its submission"))));
            it = q.erase(it);
            --held_;
          }
          break;
        }
        const auto ms =
            std::chrono::duration_cast<std::chrono::milliseconds>(now - h.entry.added).count();
        verdict = absl::DeadlineExceededError(About(
            h.entry.what,
            // What matters first: a trainer hears the first wire::kMessageHead
            // bytes of a long message (wire::ClipMessage).
            absl::StrCat("nothing of the operation ran: timed out after ", ms, " ms waiting for ",
                         Late(h.entry.waits, h.next_wait),
                         " to reach the submission (the work queued before it on that stream "
                         "has not finished: a kernel that does not end, or a wait for something "
                         "that never comes?)")));
      }
      decided.emplace_back(std::move(h.entry.pass), std::move(verdict));
      q.pop_front();
      --held_;
    }
    lane = q.empty() ? lanes_.erase(lane) : std::next(lane);
  }
  for (auto& [pass, status] : decided) pass(std::move(status));
  return held_;
}

void ReadyGate::FailWhere(const std::function<bool(const Held&)>& fail, const absl::Status& why) {
  std::vector<std::pair<std::function<void(absl::Status)>, absl::Status>> failed;
  for (auto lane = lanes_.begin(); lane != lanes_.end();) {
    std::deque<Held>& q = lane->second;
    for (auto it = q.begin(); it != q.end();) {
      if (fail(*it)) {
        failed.emplace_back(std::move(it->entry.pass),
                            absl::Status(why.code(), About(it->entry.what, why.message())));
        it = q.erase(it);
        --held_;
      } else {
        ++it;
      }
    }
    lane = q.empty() ? lanes_.erase(lane) : std::next(lane);
  }
  for (auto& [pass, status] : failed) pass(std::move(status));
}

void ReadyGate::FailSession(uint64_t session, const absl::Status& why) {
  FailWhere(
      [session](const Held& h) {
        for (uint64_t s : h.entry.sessions) {
          if (s == session) return true;
        }
        return false;
      },
      why);
}

void ReadyGate::FailLane(const std::string& lane, const absl::Status& why) {
  FailWhere([&lane](const Held& h) { return h.entry.lane == lane; }, why);
}

void ReadyGate::FailAll(const absl::Status& why) {
  FailWhere([](const Held&) { return true; }, why);
}

}  // namespace ciuic::daemon
