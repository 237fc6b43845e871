// The UCX (ucp tag API) implementation of Transport.
//
// One ucp context per transport; one ucp worker per channel, each owned and
// progressed by its own thread ("ciuic-ucx<N>"). Every ucp call that touches
// a worker, its endpoints or its requests is made under the channel's worker
// lock (workers are created UCS_THREAD_MODE_SERIALIZED): the thread holds it
// for each round of its loop. A Send or Recv of at most 256 KiB is posted
// by the calling thread itself when the lock is free and nothing is queued
// before it, which saves the hand-off to the channel's thread on the way to
// the wire; its callback still runs on the channel's thread. Everything
// else (larger transfers, Connect, FailPeer, Describe) goes to the thread
// through a queue and wakes it with ucp_worker_signal. An idle thread polls
// (yielding) for 300 us, then arms the worker and sleeps in poll() on the
// worker's event fd (waking once a second so that UCX's periodic work can
// run).
//
// Wire tags are 64 bits: [16 bits source peer][48 bits user tag]; a Recv
// matches with a full mask, so (source peer, channel, tag) selects exactly
// one message stream. Peers are limited to 65536.
//
// Failure: an endpoint error (peer died, connection reset), a failed send,
// or FailPeer() marks the peer failed with a sticky status ("lost peer 2:
// ..."); every channel then cancels its pending Recvs from the peer and
// force-closes its endpoint to it (which fails the pending Sends), and later
// Send/Recv with the peer fail at once, on the channel's thread. An
// endpoint error on a channel with nothing in flight to that peer fails
// only that channel's endpoint (later transfers on it fail at once): a peer
// ending its job closes its endpoints one channel at a time, and an idle
// channel's close must not cut off the last data still arriving on another.
//
// UCX configuration (UCX_TLS, UCX_NET_DEVICES, ...) comes from the
// environment, read by Create().
#pragma once

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "transport/transport.h"

namespace ciuic::daemon {

class UcxTransport final : public Transport {
 public:
  // The wire tag is (control bit, source peer, user tag): 1, 15 and
  // kTagBits bits.
  static constexpr int kMaxPeers = 1 << (63 - kTagBits);

  // Creates the ucp context and `num_channels` workers and starts their
  // progress threads. No endpoints yet: publish WorkerAddresses(), then
  // Connect() with everybody's. With `devices` (one per channel, so
  // num_channels of them), channel i gets a context of its own restricted
  // to network device devices[i] (UCX's NET_DEVICES): its worker address
  // holds only that device's addresses, and its traffic takes that link.
  static absl::StatusOr<std::unique_ptr<UcxTransport>> Create(
      int num_channels, const std::vector<std::string>& devices = {});

  // Fails every queued and pending transfer with UNAVAILABLE "transport shut
  // down", force-closes the endpoints, stops the threads and destroys the
  // workers and the context. Bounded: gives UCX at most a few seconds.
  // No call may start once destruction has begun. A Send/Recv/RecvReduce
  // or FailPeer whose transfers have all called back may still be returning
  // on another thread (a callback may be what lets the owner destroy the
  // transport): the destructor waits for such calls to leave.
  ~UcxTransport() override;

  // Tests only: `hook` runs on the calling thread inside Send/Recv/
  // RecvReduce, after the transfer is in its channel's hands and before the
  // call's last lines touch the channel. nullptr (the default) for none.
  static void SetCallerTailHookForTesting(void (*hook)());

  UcxTransport(const UcxTransport&) = delete;
  UcxTransport& operator=(const UcxTransport&) = delete;

  // One opaque ucp worker address per channel, in channel order.
  std::vector<std::string> WorkerAddresses() const;

  // addresses[peer][channel] for every member of the table, self included.
  // Creates one endpoint per (peer, channel), also to self (loopback through
  // UCX). Call once, before any Send/Recv; blocks until the endpoints exist.
  absl::Status Connect(int self, const std::vector<std::vector<std::string>>& addresses);

  int self() const override { return self_; }
  int num_peers() const override { return num_peers_; }
  int num_channels() const override { return static_cast<int>(channels_.size()); }

  void Send(int peer, int channel, uint64_t tag, const void* data, size_t bytes,
            TransferDone done) override;
  void Recv(int peer, int channel, uint64_t tag, void* data, size_t bytes,
            TransferDone done) override;
  void RecvReduce(int peer, int channel, uint64_t tag, const ReduceInto& into, size_t bytes,
                  TransferDone done) override;
  void FailPeer(int peer, const absl::Status& why) override;
  std::vector<ChannelLoad> ChannelLoads() const override;

  // The peer's sticky failure, or OK.
  absl::Status PeerStatus(int peer) const;

  // One line per channel and peer: the UCX transports (tl/device) its
  // endpoint uses, plus the UCX version and the configured UCX_TLS.
  std::string Describe() const;
  // How long an idle channel thread may poll before it sleeps (IdlePolicy):
  // 300 us, or CIUIC_UCX_POLL_US (0..1000000; anything else is refused with
  // a warning naming it). Read once per process.
  static std::chrono::microseconds PollWindow();

  static std::string UcxVersion();
  // Whether this UCX build can move CUDA memory (UCS_MEMORY_TYPE_CUDA among
  // the context's memory types). Creates a throw-away context once.
  static bool SupportsCudaMemory();

  class Channel;  // one worker and its thread (ucx_transport.cc)
  struct Op;      // one Send, Recv or RecvReduce in flight (ucx_transport.cc)

 private:
  struct Shared;  // the state the channels share with the transport

  UcxTransport();

  // Checks the op's peer and channel (an early error otherwise) and hands
  // it to its channel's thread.
  void Route(std::unique_ptr<Op> op);

  // Marks `peer` failed with `why` unless it already failed (the first
  // reason wins); tells every channel to cancel its pending work with the
  // peer. Any thread. Logs `why` as a warning if `warn` (transfers were cut
  // off), else at info level (the control plane asked, or nothing was in
  // flight: a peer that ended its job).
  void MarkPeerFailed(int peer, absl::Status why, bool warn);

  std::unique_ptr<Shared> shared_;
  std::vector<std::unique_ptr<Channel>> channels_;
  std::vector<std::string> addresses_;
  int self_ = -1;
  int num_peers_ = 0;
};

}  // namespace ciuic::daemon
