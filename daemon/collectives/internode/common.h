// Helpers shared by the algorithm files (internal).
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "ciuic/shm_layout.h"
#include "reduce/reduce.h"

namespace ciuic::daemon::internode_internal {

// dtype/op valid for Reduce, and not avg (the caller sums and divides once).
inline absl::Status CheckReduction(wire::DataType dtype, wire::ReduceOp op,
                                   const char* name) {
  if (absl::Status s = CheckReducible(dtype, op); !s.ok()) {
    return absl::Status(s.code(), absl::StrCat(name, ": ", s.message()));
  }
  if (op == wire::ReduceOp::kAvg) {
    return absl::InvalidArgumentError(
        absl::StrCat(name, ": avg is not reduced between nodes; pass sum and DivideInPlace"));
  }
  return absl::OkStatus();
}

// Where transfer callbacks (on the transport's threads) leave their events
// for the thread that runs an operation. Held by shared_ptr: a callback may
// still be unwinding after the operation returned.
template <typename E>
struct Mailbox {
  std::mutex mu;
  std::condition_variable cv;
  std::vector<E> events;  // guarded by mu

  void Post(E e) {
    std::lock_guard<std::mutex> lock(mu);
    events.push_back(std::move(e));
    cv.notify_one();
  }

  // Waits for events and appends them to *batch. Until `deadline`, or
  // without limit once the operation was `cancelled` (after FailPeer the
  // transport fires every callback). False at the deadline with none.
  bool Take(std::vector<E>* batch, bool cancelled,
            std::chrono::steady_clock::time_point deadline) {
    std::unique_lock<std::mutex> lock(mu);
    const auto has_events = [this] { return !events.empty(); };
    if (cancelled) {
      cv.wait(lock, has_events);
    } else if (!cv.wait_until(lock, deadline, has_events)) {
      return false;
    }
    for (E& e : events) batch->push_back(std::move(e));
    events.clear();
    return true;
  }
};

// "node 2 (gpu-07)", or "node 2" where `names` does not name it.
inline std::string NodeLabel(const std::vector<std::string>& names, int node) {
  if (node >= 0 && static_cast<size_t>(node) < names.size() &&
      !names[static_cast<size_t>(node)].empty()) {
    return absl::StrCat("node ", node, " (", names[static_cast<size_t>(node)], ")");
  }
  return absl::StrCat("node ", node);
}

// A run's channel table (InterNodeContext::channel_table) may name only
// channels the transport has: one past them is a bug of whoever built it.
inline absl::Status CheckChannelTable(const std::vector<uint8_t>& table, int channels,
                                      absl::string_view what) {
  for (int c : table) {
    if (c >= channels) {
      return absl::InternalError(
          absl::StrCat(what, ": channel table names channel ", c, " of ", channels));
    }
  }
  return absl::OkStatus();
}

// Peer index arithmetic on a ring of n.
inline int Mod(long long a, int n) { return static_cast<int>(((a % n) + n) % n); }

}  // namespace ciuic::daemon::internode_internal
