// A queue in front of a connection's blocking writes, for senders that
// must never block: the coordinator sends to its nodes' ordering streams
// while it holds its lock, and one node that stops reading (stopped,
// swapping, a full socket) must not stall every job it coordinates.
//
// Push() queues an item and returns at once; a writer thread, started at
// the first item, writes the queue in order with the connection's own
// blocking write (bounded by its send timeout). When the queued bytes would
// pass the bound, or a write fails, the writer is broken: the connection's
// on_break runs once (it ends the connection, and the coordinator then
// detaches the node and fails its jobs), and later pushes are dropped.
//
// Threads: Push and idle from any thread; `write` and `on_break` run on the
// writer thread (on_break also on a pushing thread when the bound is hit).
#pragma once

#include <condition_variable>
#include <cstddef>
#include <deque>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <utility>

namespace ciuic::daemon {

template <typename Item>
class BoundedWriter {
 public:
  using Write = std::function<bool(Item& item)>;  // blocking; false: the connection broke

  BoundedWriter(size_t max_bytes, Write write, std::function<void(const std::string&)> on_break)
      : max_bytes_(max_bytes), write_(std::move(write)), on_break_(std::move(on_break)) {}
  // Writes what is queued (each write bounded by the connection), then ends.
  ~BoundedWriter() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stopping_ = true;
    }
    cv_.notify_all();
    if (thread_.joinable()) thread_.join();
  }
  BoundedWriter(const BoundedWriter&) = delete;
  BoundedWriter& operator=(const BoundedWriter&) = delete;

  // False when the item was dropped: the writer is (now) broken.
  bool Push(Item item, size_t bytes) {
    std::string broke;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (broken_) return false;
      if (queued_bytes_ + bytes > max_bytes_) {
        broken_ = true;
        queue_.clear();
        broke = "more than " + std::to_string(max_bytes_) +
                " bytes queued for a peer that does not take them";
      } else {
        queue_.emplace_back(std::move(item), bytes);
        queued_bytes_ += bytes;
        if (!thread_.joinable()) thread_ = std::thread([this] { Run(); });
      }
    }
    if (!broke.empty()) {
      on_break_(broke);
      return false;
    }
    cv_.notify_one();
    return true;
  }

  // Nothing queued or being written: a caller that serialises its own
  // pushes may write directly, in order, without the queue.
  bool idle() {
    std::lock_guard<std::mutex> lock(mu_);
    return queue_.empty() && !writing_ && !broken_;
  }
  bool broken() {
    std::lock_guard<std::mutex> lock(mu_);
    return broken_;
  }

 private:
  void Run() {
    std::unique_lock<std::mutex> lock(mu_);
    while (true) {
      cv_.wait(lock, [&] { return !queue_.empty() || stopping_; });
      if (queue_.empty() || broken_) return;  // stopping, everything written
      auto [item, bytes] = std::move(queue_.front());
      queue_.pop_front();
      writing_ = true;
      lock.unlock();
      const bool ok = write_(item);
      lock.lock();
      writing_ = false;
      queued_bytes_ -= bytes;
      if (!ok) {
        broken_ = true;
        queue_.clear();
        lock.unlock();
        on_break_("a write to the peer failed or timed out");
        return;
      }
    }
  }

  const size_t max_bytes_;
  const Write write_;
  const std::function<void(const std::string&)> on_break_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::pair<Item, size_t>> queue_;  // guarded by mu_
  size_t queued_bytes_ = 0;                    // guarded by mu_
  bool writing_ = false;                       // guarded by mu_
  bool broken_ = false;                        // guarded by mu_
  bool stopping_ = false;                      // guarded by mu_
  std::thread thread_;
};

}  // namespace ciuic::daemon
