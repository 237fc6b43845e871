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
#include "transport/transport.h"

namespace ciuic::daemon {

class SendsInFlight final : public Transport {
 public:
  explicit SendsInFlight(Transport* inner) : inner_(inner) {}
  int self() const override { return inner_->self(); }
  int num_peers() const override { return inner_->num_peers(); }
  int num_channels() const override { return inner_->num_channels(); }
  void Send(int peer, int channel, uint64_t tag, const void* data, size_t bytes,
            TransferDone done) override {
    const int now = ++in_flight_;
    int seen = max_seen_.load();
    while (now > seen && !max_seen_.compare_exchange_weak(seen, now)) {
    }
    inner_->Send(peer, channel, tag, data, bytes, [this, done = std::move(done)](absl::Status s) {
      --in_flight_;
      done(std::move(s));
    });
  }
  void Recv(int peer, int channel, uint64_t tag, void* data, size_t bytes,
            TransferDone done) override {
    inner_->Recv(peer, channel, tag, data, bytes, std::move(done));
  }
  void RecvReduce(int peer, int channel, uint64_t tag, const ReduceInto& into, size_t bytes,
                  TransferDone done) override {
    inner_->RecvReduce(peer, channel, tag, into, bytes, std::move(done));
  }
  void FailPeer(int peer, const absl::Status& why) override { inner_->FailPeer(peer, why); }

  int max_seen() const { return max_seen_.load(); }
  void Reset() { max_seen_ = 0; }

 private:
  Transport* inner_;
  std::atomic<int> in_flight_{0};
  std::atomic<int> max_seen_{0};
};

}  // namespace ciuic::daemon
