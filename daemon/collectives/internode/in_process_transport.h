// A Transport between "nodes" that are threads of one process, for testing
// the inter-node algorithms (and later the engine) without a network.
//
// An InProcessHub owns N InProcessTransports, one per node, with the same
// number of channels each. Send and Recv are matched by (source, destination,
// channel, tag) in posting order; a match is copied and both callbacks run on
// the hub's delivery thread, never inline in Send or Recv (as with a real
// transport, a callback may run before or after Send/Recv returns). A send
// completes when it has been matched and copied, i.e. like a rendezvous
// protocol, the strictest case for the algorithms. Sizes that disagree fail
// both transfers with DATA_LOSS. A RecvReduce is fed to a FragmentReducer in
// three pieces cut at odd byte offsets and handed over out of order (last
// piece first), as a real transport's fragments may come.
//
// Faults: InProcessTransport::FailPeer fails that transport's own pending
// and future transfers with the peer (as Transport requires); the hub's
// KillNode(k) fails every pending and future transfer that involves node k,
// on every transport, as when a daemon dies and the control plane tells
// everyone; KillNodeAfter(k, n) does so once n more transfers involving k
// have been matched (a deterministic "mid-operation"). HoldTransfersOver(b)
// keeps every matched transfer of more than b bytes undelivered until
// ReleaseHeld (a fault, FailPeer or KillNode, releases them too): a large
// operation that cannot end while a test looks at what else runs. Destroying the hub
// fails whatever is still pending with CANCELLED and runs those callbacks
// before it returns.
//
// Thread-safety: everything may be called from any thread.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <thread>
#include <tuple>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "transport/fragment_reducer.h"
#include "transport/transport.h"

namespace ciuic::daemon {

class InProcessHub;

class InProcessTransport : public Transport {
 public:
  int self() const override { return self_; }
  int num_peers() const override;
  int num_channels() const override;
  void Send(int peer, int channel, uint64_t tag, const void* data, size_t bytes,
            TransferDone done) override;
  void Recv(int peer, int channel, uint64_t tag, void* data, size_t bytes,
            TransferDone done) override;
  void RecvReduce(int peer, int channel, uint64_t tag, const ReduceInto& into, size_t bytes,
                  TransferDone done) override;
  void FailPeer(int peer, const absl::Status& why) override;

 private:
  friend class InProcessHub;
  InProcessTransport(InProcessHub* hub, int self) : hub_(hub), self_(self) {}
  InProcessHub* const hub_;
  const int self_;
};

class InProcessHub {
 public:
  InProcessHub(int num_nodes, int num_channels);
  ~InProcessHub();
  InProcessHub(const InProcessHub&) = delete;
  InProcessHub& operator=(const InProcessHub&) = delete;

  int num_nodes() const { return static_cast<int>(transports_.size()); }
  int num_channels() const { return num_channels_; }
  InProcessTransport* transport(int node) { return transports_[node].get(); }

  void KillNode(int node);
  void KillNodeAfter(int node, uint64_t matches);
  void HoldTransfersOver(size_t bytes);
  void ReleaseHeld();

  // Transfers matched so far (for tests that check traffic).
  uint64_t matched_transfers() const;
  uint64_t matched_bytes() const;

 private:
  friend class InProcessTransport;
  struct Pending {
    int owner;  // node that posted it
    void* data;
    size_t bytes;
    TransferDone done;
    std::shared_ptr<FragmentReducer> reducer;  // a RecvReduce's
  };
  using Key = std::tuple<int, int, int, uint64_t>;  // src, dst, channel, tag
  struct Queues {
    std::deque<Pending> sends;
    std::deque<Pending> recvs;
  };

  void Post(bool is_send, int self, int peer, int channel, uint64_t tag, void* data, size_t bytes,
            TransferDone done, std::shared_ptr<FragmentReducer> reducer = nullptr);
  void FailPeerOf(int self, int peer, const absl::Status& why);
  // Fails matching pending transfers; `involves(key, owner)` picks them.
  void FailPendingLocked(const std::function<bool(const Key&, int owner)>& involves,
                         const absl::Status& why) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void KillLocked(int node) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Deliver(std::function<void()> job) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void ReleaseHeldLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void DeliveryLoop();

  const int num_channels_;
  std::vector<std::unique_ptr<InProcessTransport>> transports_;

  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::map<Key, Queues> pending_ ABSL_GUARDED_BY(mu_);
  // failed_[self][peer]: the sticky error of self's transfers with peer.
  std::vector<std::vector<absl::Status>> failed_ ABSL_GUARDED_BY(mu_);
  std::vector<absl::Status> killed_ ABSL_GUARDED_BY(mu_);
  std::vector<int64_t> kill_after_ ABSL_GUARDED_BY(mu_);  // -1: none
  std::deque<std::function<void()>> jobs_ ABSL_GUARDED_BY(mu_);
  size_t hold_over_ ABSL_GUARDED_BY(mu_) = SIZE_MAX;  // HoldTransfersOver
  std::deque<std::function<void()>> held_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  uint64_t matched_transfers_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t matched_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  std::thread delivery_;
};

}  // namespace ciuic::daemon
