// A Transport decorator for tests: passes everything to `inner` and records
// the most sends it has seen posted and not yet completed at once, in all
// and on one channel (the window the algorithms keep, e.g. one send per
// channel while yielding to a higher-priority operation).
//
// Thread-safety: as the wrapped transport; the counters are atomic.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <utility>

#include "absl/status/status.h"
#include "transport/forwarding_transport.h"

namespace ciuic::daemon {

class SendsInFlight final : public ForwardingTransport {
 public:
  explicit SendsInFlight(Transport* inner) : ForwardingTransport(inner) {}
  void Send(int peer, int channel, uint64_t tag, const void* data, size_t bytes,
            TransferDone done) override {
    Raise(max_seen_, ++in_flight_);
    const size_t c = static_cast<size_t>(channel) % kChannels;
    Raise(max_on_channel_, ++on_channel_[c]);
    ForwardingTransport::Send(peer, channel, tag, data, bytes,
                              [this, c, done = std::move(done)](absl::Status s) {
                                --in_flight_;
                                --on_channel_[c];
                                done(std::move(s));
                              });
  }

  int max_seen() const { return max_seen_.load(); }
  int max_seen_on_one_channel() const { return max_on_channel_.load(); }
  void Reset() {
    max_seen_ = 0;
    max_on_channel_ = 0;
  }

 private:
  static constexpr size_t kChannels = 64;
  static void Raise(std::atomic<int>& most, int now) {
    int seen = most.load();
    while (now > seen && !most.compare_exchange_weak(seen, now)) {
    }
  }
  std::atomic<int> in_flight_{0};
  std::atomic<int> max_seen_{0};
  std::atomic<int> on_channel_[kChannels] = {};
  std::atomic<int> max_on_channel_{0};
};

}  // namespace ciuic::daemon
