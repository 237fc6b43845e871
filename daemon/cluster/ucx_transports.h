// The TransportFactory that multi-node jobs use in ciuicd: one UCX
// transport (channels = ucp workers) per job; with `devices` (the config's
// channel_devices), channel i on network device i.
#pragma once

#include <string>
#include <vector>

#include "cluster/cluster_job.h"

namespace ciuic::daemon {

TransportFactory UcxTransportFactory(std::vector<std::string> devices = {});

}  // namespace ciuic::daemon
