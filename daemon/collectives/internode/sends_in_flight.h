// A Transport decorator for tests: passes everything to `inner` and records
// the most sends it has seen posted and not yet completed at once (the
// window the algorithms keep, e.g. one send while yielding to a
// higher-priority operation).
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
    const int now = ++in_flight_;
    int seen = max_seen_.load();
    while (now > seen && !max_seen_.compare_exchange_weak(seen, now)) {
    }
    ForwardingTransport::Send(peer, channel, tag, data, bytes,
                              [this, done = std::move(done)](absl::Status s) {
                                --in_flight_;
                                done(std::move(s));
                              });
  }

  int max_seen() const { return max_seen_.load(); }
  void Reset() { max_seen_ = 0; }

 private:
  std::atomic<int> in_flight_{0};
  std::atomic<int> max_seen_{0};
};

}  // namespace ciuic::daemon
