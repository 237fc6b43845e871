// The TransportFactory that multi-node jobs use in ciuicd: one UCX
// transport (channels = ucp workers) per job.
#pragma once

#include "cluster/cluster_job.h"

namespace ciuic::daemon {

TransportFactory UcxTransportFactory();

}  // namespace ciuic::daemon
