// When an idle progress thread polls and when it sleeps.
//
// A channel thread that finds no work either polls again (yielding its core
// between rounds) or arms its worker and sleeps on the event fd. Polling
// catches a reply to a small message without a wakeup; it only pays when
// work comes back within the polling window. So the thread keeps a moving
// average of its idle gaps (from going idle to the next work, whether it
// polled or slept meanwhile) and polls only while that average is within
// the window, and then for at most the window:
//   * a fast link (gaps of microseconds): it polls;
//   * a slow one (a 64 KiB fragment every 0.5 ms at 1 Gbit/s): it would
//     poll in vain after every fragment, so it sleeps at once and leaves the
//     core to the trainers (measured: DDP over a 1 Gbit/s link, the daemons'
//     CPU time fell from 4.6 s to 2.5 s for 36 steps with no polling);
//   * gaps count capped at 4 windows, so that one long pause (a training
//     step's compute) costs a few sleeps, not many.
// A window of zero never polls. Not thread-safe: one per channel thread.
#pragma once

#include <algorithm>
#include <chrono>

namespace ciuic::daemon {

class IdlePolicy {
 public:
  using Clock = std::chrono::steady_clock;
  static constexpr double kGapWeight = 0.25;  // of the newest gap in the average
  static constexpr double kGapCapWindows = 4;

  explicit IdlePolicy(std::chrono::microseconds window)
      : window_us_(static_cast<double>(window.count())) {}

  // The thread found work at `now`.
  void Worked(Clock::time_point now) {
    if (!idle_) return;
    const double gap = std::chrono::duration<double, std::micro>(now - idle_since_).count();
    average_gap_us_ += kGapWeight * (std::min(gap, kGapCapWindows * window_us_) - average_gap_us_);
    idle_ = false;
  }

  // The thread found no work at `now`: true to poll again, false to sleep.
  bool KeepPolling(Clock::time_point now) {
    if (!idle_) {
      idle_ = true;
      idle_since_ = now;
    }
    return window_us_ > 0 && average_gap_us_ <= window_us_ &&
           std::chrono::duration<double, std::micro>(now - idle_since_).count() < window_us_;
  }

  double average_gap_us() const { return average_gap_us_; }

 private:
  const double window_us_;
  double average_gap_us_ = 0;
  bool idle_ = false;
  Clock::time_point idle_since_{};
};

}  // namespace ciuic::daemon
