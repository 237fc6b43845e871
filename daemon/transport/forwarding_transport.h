// A Transport that passes every call to another one: the base of decorators
// (byte counters, test probes) that override only what they observe.
//
// Thread-safety: as the wrapped transport's.
#pragma once

#include <cstddef>
#include <cstdint>
#include <utility>

#include "transport/transport.h"

namespace ciuic::daemon {

class ForwardingTransport : public Transport {
 public:
  // `inner` must outlive this object.
  explicit ForwardingTransport(Transport* inner) : inner_(inner) {}

  int self() const override { return inner_->self(); }
  int num_peers() const override { return inner_->num_peers(); }
  int num_channels() const override { return inner_->num_channels(); }
  void Send(int peer, int channel, uint64_t tag, const void* data, size_t bytes,
            TransferDone done) override {
    inner_->Send(peer, channel, tag, data, bytes, std::move(done));
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
  std::vector<ChannelLoad> ChannelLoads() const override { return inner_->ChannelLoads(); }

 protected:
  Transport* inner() const { return inner_; }

 private:
  Transport* const inner_;
};

}  // namespace ciuic::daemon
