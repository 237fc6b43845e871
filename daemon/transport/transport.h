// Moving bytes between the daemons of a job's nodes.
//
// A Transport connects this daemon to the other members of a membership
// table (peers are numbered 0..num_peers-1 in table order; this daemon is
// one of them) over `num_channels` independent channels. On UCX each
// channel is one ucp worker progressed by its own thread; several channels
// let the chunks of one operation travel in parallel.
//
// Messages are matched by (source peer, channel, tag), never by arrival
// order: a Recv for (peer, channel, tag) completes with the Send from that
// peer on that channel with that tag, whichever was posted first. Tags are
// the caller's business (the inter-node algorithms build them from the
// operation, step and chunk); only their low kTagBits bits are carried.
//
// Completion callbacks run on a channel's progress thread; they must be
// short and must not call back into the transport synchronously with a
// blocking wait. Every Send/Recv gets exactly one callback: OK, or an error
// naming the peer (the peer is gone, the transport is shutting down, sizes
// disagree). A peer that failed stays failed: later operations with it fail
// at once with the same error.
//
// RecvReduce is a Recv that folds the message into a destination as it
// arrives instead of landing it there: for each element i,
// dest[i] = op(received[i], local[i]) (op(local[i], received[i]) when
// received_first is false), with ciuic::reduce's kernels and semantics. The
// UCX transport does it straight from its receive buffers, fragment by
// fragment on the channel's thread, so a reducing receive costs no copy into
// a staging buffer and no pass over it afterwards. `dest` may equal `local`
// (in place); the two must not otherwise overlap. `bytes` is a multiple of
// the element size. On failure, dest may hold a mix of reduced and old
// elements.
//
// Thread-safety: Send, Recv and RecvReduce may be called from any thread.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "ciuic/shm_layout.h"

namespace ciuic::daemon {

using TransferDone = std::function<void(absl::Status)>;

// Where and how a RecvReduce folds what it receives.
struct ReduceInto {
  wire::DataType dtype = wire::DataType::kUInt8;
  wire::ReduceOp op = wire::ReduceOp::kSum;
  bool received_first = true;  // op(received, local) rather than op(local, received)
  void* dest = nullptr;
  const void* local = nullptr;  // the same layout as dest; may be dest itself
};

class Transport {
 public:
  static constexpr int kTagBits = 48;

  virtual ~Transport() = default;

  virtual int self() const = 0;       // this daemon's peer index
  virtual int num_peers() const = 0;
  virtual int num_channels() const = 0;

  // `data` must stay valid (and unchanged, for Send) until `done` runs.
  // A Recv's size must equal the matching Send's size.
  virtual void Send(int peer, int channel, uint64_t tag, const void* data, size_t bytes,
                    TransferDone done) = 0;
  virtual void Recv(int peer, int channel, uint64_t tag, void* data, size_t bytes,
                    TransferDone done) = 0;
  virtual void RecvReduce(int peer, int channel, uint64_t tag, const ReduceInto& into,
                          size_t bytes, TransferDone done) = 0;

  // Fails every pending and future transfer with `peer` (used when the
  // control plane learns first that a node is gone).
  virtual void FailPeer(int peer, const absl::Status& why) = 0;

  // How much each channel has carried, cumulative since the transport was
  // made: bytes of sends completed successfully, and the time with at least
  // one send in flight (periods that have ended). bytes / busy time is what
  // the channel's link carries while it has work (the channels' weights,
  // daemon/cluster/channel_weights.h). `device`: the channel's network
  // device ("" = whichever UCX picks). Empty: not measured.
  struct ChannelLoad {
    uint64_t bytes_sent = 0;
    uint64_t busy_ns = 0;
    std::string device;
  };
  virtual std::vector<ChannelLoad> ChannelLoads() const { return {}; }
};

}  // namespace ciuic::daemon
