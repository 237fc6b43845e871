// The gRPC face of the Coordinator (service ciuic.proto.Peer), served on
// TCP for the other daemons. Thin: the logic is in cluster/coordinator.
#pragma once

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "ciuic/peer.grpc.pb.h"
#include "cluster/coordinator.h"

namespace ciuic::daemon {

class PeerService final : public proto::Peer::Service {
 public:
  explicit PeerService(Coordinator* coordinator) : coordinator_(coordinator) {}

  grpc::Status RegisterNode(grpc::ServerContext* ctx, const proto::RegisterNodeRequest* req,
                            proto::Membership* reply) override;
  grpc::Status OrderStream(
      grpc::ServerContext* ctx,
      grpc::ServerReaderWriter<proto::CoordinatorEvent, proto::NodeEvent>* stream) override;

 private:
  Coordinator* coordinator_;
};

// Serves `service` on TCP `listen` (host:port; port 0 picks one). Returns
// the server and the port it listens on.
absl::StatusOr<std::unique_ptr<grpc::Server>> StartPeerServer(const std::string& listen,
                                                              grpc::Service* service, int* port);

}  // namespace ciuic::daemon
