// How the node side of a multi-node job (ClusterJob) reaches the job's
// coordinator daemon: registration, then one ordering stream. The gRPC
// implementation is control/peer_client.{h,cc}; this area knows no gRPC.
//
// Threads: a ClusterJob calls Register and OpenStream from its own thread;
// CancelRegister from any thread (Abort). On a stream, one thread reads
// (Read until false, then Finish) while others write (Write, WritesDone,
// never two at once: the caller serialises them); Cancel may come from any
// thread and makes a blocked Read return false soon.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "ciuic/peer.pb.h"

namespace ciuic::daemon {

class OrderingStream {
 public:
  virtual ~OrderingStream() = default;
  // False once the stream is broken or closed.
  virtual bool Write(const proto::NodeEvent& event) = 0;
  // Blocks for the next event; false at the end of the stream.
  virtual bool Read(proto::CoordinatorEvent* event) = 0;
  // No more writes from this side.
  virtual void WritesDone() = 0;
  // After Read returned false: why the stream ended (OK: closed cleanly).
  virtual absl::Status Finish() = 0;
  virtual void Cancel() = 0;
  // How the stream travels, for the log: "in-process ...", "over TCP to
  // HOST port N", "over gRPC to HOST:PORT".
  virtual std::string Describe() const = 0;
};

class CoordinatorClient {
 public:
  virtual ~CoordinatorClient() = default;
  // Blocks until every rank of the job has registered (the membership
  // table), the deadline, an error, or CancelRegister (CANCELLED; also for
  // a Register that starts after it). Errors name the coordinator.
  virtual absl::StatusOr<proto::Membership> Register(
      const proto::RegisterNodeRequest& request,
      std::chrono::system_clock::time_point deadline) = 0;
  virtual void CancelRegister() = 0;
  // `ordering_port`: Membership.ordering_port, the coordinator daemon's
  // TCP ordering listener (0: none announced). A client uses it where it
  // can and falls back to a slower stream (logging why) where it cannot.
  virtual absl::StatusOr<std::unique_ptr<OrderingStream>> OpenStream(uint32_t ordering_port) = 0;
};

// A client for the coordinator at `address` (host:port of its peer service).
using CoordinatorClientFactory =
    std::function<std::unique_ptr<CoordinatorClient>(const std::string& address)>;

}  // namespace ciuic::daemon
