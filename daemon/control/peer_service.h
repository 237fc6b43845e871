// The gRPC face of the Coordinator (service ciuic.proto.Peer), served on
// TCP for the other daemons. Thin: the logic is in cluster/coordinator.
// Every connection is authenticated before gRPC sees a byte of it
// (peer_socket.h says how, and why gRPC takes sockets from us).
#pragma once

#include <chrono>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "ciuic/peer.grpc.pb.h"
#include "cluster/coordinator.h"
#include "control/peer_socket.h"

namespace ciuic::daemon {

class PeerService final : public proto::Peer::Service {
 public:
  // An ordering stream whose first message (Hello) does not come within
  // `hello_timeout` is ended (DEADLINE_EXCEEDED).
  explicit PeerService(Coordinator* coordinator,
                       std::chrono::milliseconds hello_timeout = std::chrono::seconds(10))
      : coordinator_(coordinator), hello_timeout_(hello_timeout) {}

  grpc::Status RegisterNode(grpc::ServerContext* ctx, const proto::RegisterNodeRequest* req,
                            proto::Membership* reply) override;
  grpc::Status OrderStream(
      grpc::ServerContext* ctx,
      grpc::ServerReaderWriter<proto::CoordinatorEvent, proto::NodeEvent>* stream) override;

 private:
  Coordinator* coordinator_;
  const std::chrono::milliseconds hello_timeout_;
};

// `service` on TCP: a PeerListener authenticates each connection and hands
// it to a gRPC server that listens on no port of its own.
class PeerServer {
 public:
  // Listens on `listen` (host:port; port 0 picks one) for daemons that know
  // `token` (and, with `tls`, present a certificate of its CA). `service`
  // must outlive this.
  static absl::StatusOr<std::unique_ptr<PeerServer>> Start(
      const std::string& listen, const std::string& token, grpc::Service* service,
      std::shared_ptr<const TlsContext> tls = nullptr);
  ~PeerServer();  // Shutdown() with no grace

  int port() const { return listener_->port(); }
  // Stops accepting connections, then ends the calls in progress by
  // `deadline`.
  void Shutdown(std::chrono::system_clock::time_point deadline = std::chrono::system_clock::now());

 private:
  PeerServer() = default;
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<PeerListener> listener_;
  bool shut_down_ = false;
};

}  // namespace ciuic::daemon
