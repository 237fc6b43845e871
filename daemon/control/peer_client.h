// The gRPC face of CoordinatorClient (cluster/coordinator_client.h): how a
// node's ClusterJob calls the coordinator's Peer service. Thin: what to
// send and when is the ClusterJob's business.
#pragma once

#include "cluster/coordinator_client.h"
#include "control/peer_socket.h"

namespace ciuic::daemon {

// Clients over gRPC on connections authenticated with `security.token`
// (peer_socket.h), made only to hosts `security.allowed` admits; keepalive
// pings notice a vanished coordinator host within seconds.
CoordinatorClientFactory GrpcCoordinatorClients(PeerSecurity security);

}  // namespace ciuic::daemon
