// A Transport among some of another transport's peers: peer i of the view
// is peer members[i] of the inner transport. A hierarchical algorithm runs
// an ordinary one among a rack's nodes, or among the racks' leaders,
// through it. Errors come from the inner transport and so name the real
// peers.
//
// Thread-safety: as the wrapped transport's.
#pragma once

#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

#include "transport/transport.h"

namespace ciuic::daemon {

class SubTransport : public Transport {
 public:
  // `inner` must outlive this object; `members` are distinct peers of it,
  // including inner->self().
  SubTransport(Transport* inner, std::vector<int> members)
      : inner_(inner), members_(std::move(members)) {
    for (size_t i = 0; i < members_.size(); ++i) {
      if (members_[i] == inner_->self()) self_ = static_cast<int>(i);
    }
  }

  // -1 if the inner transport's self is not a member.
  int self() const override { return self_; }
  int num_peers() const override { return static_cast<int>(members_.size()); }
  // Peer i here is peer members()[i] of the inner transport.
  const std::vector<int>& members() const { return members_; }
  int num_channels() const override { return inner_->num_channels(); }
  void Send(int peer, int channel, uint64_t tag, const void* data, size_t bytes,
            TransferDone done) override {
    inner_->Send(members_[peer], channel, tag, data, bytes, std::move(done));
  }
  void Recv(int peer, int channel, uint64_t tag, void* data, size_t bytes,
            TransferDone done) override {
    inner_->Recv(members_[peer], channel, tag, data, bytes, std::move(done));
  }
  void RecvReduce(int peer, int channel, uint64_t tag, const ReduceInto& into, size_t bytes,
                  TransferDone done) override {
    inner_->RecvReduce(members_[peer], channel, tag, into, bytes, std::move(done));
  }
  void FailPeer(int peer, const absl::Status& why) override {
    inner_->FailPeer(members_[peer], why);
  }

 private:
  Transport* const inner_;
  const std::vector<int> members_;
  int self_ = -1;
};

}  // namespace ciuic::daemon
