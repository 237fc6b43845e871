// The gRPC face of CoordinatorClient (cluster/coordinator_client.h): how a
// node's ClusterJob calls the coordinator's Peer service. Thin: what to
// send and when is the ClusterJob's business.
#pragma once

#include "cluster/coordinator_client.h"

namespace ciuic::daemon {

// Clients over gRPC (insecure channel: the cluster token authenticates;
// keepalive pings notice a vanished coordinator host within seconds).
CoordinatorClientFactory GrpcCoordinatorClients();

}  // namespace ciuic::daemon
