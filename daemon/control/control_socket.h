// The control socket and who is calling on it.
//
// gRPC's unix-socket listener does not say which user connected, and the
// control service must know: reading status shows a caller its own jobs in
// full, changing the daemon needs an administrator. So ciuicd accepts on
// the control socket itself, asks the kernel for the peer's credentials
// (SO_PEERCRED, and SO_PEERGROUPS for its supplementary groups), records
// them, and hands the connection to the gRPC server as a channel of its own
// (grpc::AddInsecureChannelFromFd). Every call on such a channel reports
// the peer "fd:N"; CallerOf() maps that back to the recorded credentials
// after checking that descriptor N is still the socket it was at accept
// (its inode): gRPC keeps a connection's descriptor open while any call on
// it runs, so N cannot have been reused by then.
//
// Threads: one acceptor thread; CallerOf from any thread (gRPC's).
#pragma once

#include <sys/types.h>

#include <atomic>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"

namespace grpc {
class Server;
}

namespace ciuic::daemon {

// Who made a call, as the kernel reported it when the caller connected.
struct Caller {
  uid_t uid = 0;
  gid_t gid = 0;
  pid_t pid = 0;
  std::vector<gid_t> groups;  // supplementary groups
};

class ControlSocket {
 public:
  // Listens on `path` (a stale socket file is replaced, a live daemon there
  // is ALREADY_EXISTS) and hands each connection to `server`, which must be
  // started and outlive this. At most `max_connections` connections at
  // once; more are closed at accept.
  static absl::StatusOr<std::unique_ptr<ControlSocket>> Start(const std::string& path,
                                                              grpc::Server* server,
                                                              int max_connections = 1024);
  ~ControlSocket();  // Shutdown()

  // The caller behind a gRPC peer string ("fd:N"); nullopt when it is not
  // one of this socket's connections.
  std::optional<Caller> CallerOf(const std::string& peer) const;

  // Stops accepting (connections already handed to gRPC stay its own).
  void Shutdown();

 private:
  struct Connection {
    Caller caller;
    dev_t dev = 0;
    ino_t ino = 0;
  };

  ControlSocket(int fd, grpc::Server* server, int max_connections)
      : listen_fd_(fd), server_(server), max_connections_(max_connections) {}
  void AcceptLoop();
  // Forgets connections whose descriptors gRPC has closed; returns how many
  // remain. mu_ held.
  size_t PruneClosedLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  int listen_fd_;
  grpc::Server* const server_;
  const int max_connections_;
  std::thread acceptor_;
  std::atomic<bool> stopping_{false};
  mutable absl::Mutex mu_;
  std::map<int, Connection> connections_ ABSL_GUARDED_BY(mu_);  // by descriptor
};

}  // namespace ciuic::daemon
