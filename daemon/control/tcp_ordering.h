// Ordering streams over plain TCP: what a node's daemon and the coordinator
// daemon of its job exchange once per operation (Ready, Run, Done), without
// gRPC's threads in between.
//
// Why not the gRPC stream: on these machines one message through a gRPC
// bidirectional stream costs 50-100 µs of thread hand-offs on each side, and
// every multi-node operation needs two on its critical path (a node's Ready
// to the coordinator, the Run back). A TCP connection read by a blocked
// thread on each side carries the same messages in tens of microseconds.
// Registration (once per job) stays on gRPC; the membership table tells the
// nodes this listener's port (Membership.ordering_port), and a node that
// cannot reach it falls back to the gRPC stream.
//
// The stream has the gRPC stream's semantics: ordered and reliable, the
// first NodeEvent must be Hello, the node half-closes with WritesDone, and
// either side's end (close, reset, the daemon killed, TCP keepalive giving
// up after ~5 s of silence from a vanished host) ends it for the other.
// Frames: a 4-byte little-endian length, then the serialized message
// (NodeEvent towards the coordinator, CoordinatorEvent back), at most
// kMaxFrameBytes (ordering_frame.h). A connection that breaks the protocol
// (no Hello, a frame too large, bytes that do not parse, a Hello the
// coordinator refuses) gets a JobFailed naming the problem and is closed;
// the listener goes on.
//
// Every connection is authenticated first (peer_auth.h: both daemons prove
// they know the cluster token; with TLS keys, inside mutual TLS, whose relay
// hands this code a plaintext socket: tls_relay.h) by a PeerListener,
// before any frame is read from it; a node's OpenTcpOrderingStream does its
// side of it.
//
// Threads: the PeerListener accepts and authenticates on its own threads;
// each authenticated connection is read by a thread of its own (a job has a
// handful of nodes); the coordinator
// writes to a connection from its own threads, under its lock, bounded by a
// send timeout.
#pragma once

#include <atomic>
#include <cstdint>
#include <list>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "cluster/coordinator.h"
#include "cluster/coordinator_client.h"
#include "control/bounded_writer.h"
#include "control/ordering_frame.h"
#include "control/peer_socket.h"

namespace ciuic::daemon {

// The coordinator's side of one ordering connection. Send never blocks
// (the coordinator sends under its lock): a frame goes straight to the
// socket when it has room, else behind the others into a queue of at most
// `max_queued_bytes` that a thread of the connection writes with the
// socket's send timeout. A node that lets its queue fill, or takes nothing
// for the send timeout, is cut off: the connection is shut down, its
// reader ends, and the coordinator detaches the node and fails its jobs.
class TcpNodeStream final : public NodeStream {
 public:
  static constexpr size_t kMaxQueuedBytes = size_t{64} << 20;
  explicit TcpNodeStream(int fd, size_t max_queued_bytes = kMaxQueuedBytes);
  // Writes what is queued (bounded by the send timeout) before it goes.
  ~TcpNodeStream() override = default;
  void Send(const proto::CoordinatorEvent& event) override;

 private:
  const int fd_;
  std::mutex mu_;  // orders direct writes against the queue
  BoundedWriter<std::string> queue_;
};

class OrderingListener {
 public:
  // Listens on host:port (host as in `listen`: a name, an IPv4 address, or
  // an IPv6 address with or without brackets; port 0: a free one) for the
  // ordering streams of the jobs `coordinator` serves, from daemons that
  // know `token` (and, with `tls`, present a certificate of its CA). The
  // coordinator must outlive this.
  static absl::StatusOr<std::unique_ptr<OrderingListener>> Start(
      const std::string& host, int port, Coordinator* coordinator, const std::string& token,
      std::shared_ptr<const TlsContext> tls = nullptr);
  ~OrderingListener();  // Shutdown()

  int port() const;
  // Stops accepting and ends every connection (the coordinator sees their
  // streams end); returns once their threads are done.
  void Shutdown();

 private:
  explicit OrderingListener(Coordinator* coordinator) : coordinator_(coordinator) {}
  // An authenticated connection (PeerListener's handshake thread).
  void Accept(int fd, const std::string& peer);
  void Serve(SocketThread* c);

  Coordinator* const coordinator_;
  std::unique_ptr<PeerListener> peers_;
  std::mutex mu_;
  bool stopping_ = false;                // guarded by mu_
  std::list<SocketThread> connections_;  // guarded by mu_
};

// Connects to the ordering listener at host:port (within `timeout_ms`,
// handshake included) as `security` allows.
absl::StatusOr<std::unique_ptr<OrderingStream>> OpenTcpOrderingStream(const std::string& host,
                                                                      int port,
                                                                      const PeerSecurity& security,
                                                                      int timeout_ms);

}  // namespace ciuic::daemon
