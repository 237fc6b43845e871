#pragma once

// ciuicd's startup configuration, read once from a YAML file (by default
// /etc/ciuic/ciuicd.yaml) before any thread starts. Every mistake in the file
// — unknown key, bad value, wrong node type, YAML syntax — is returned as an
// INVALID_ARGUMENT status whose message starts with "FILE:LINE: ", so that
// ciuicd can print it and refuse to start. deploy/ciuicd.yaml at the root of the repository
// header documents every key.

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "config/tuning.h"

namespace ciuic::config {

// This host's name (gethostname()), or "localhost" if that fails.
std::string DefaultNodeName();

struct DaemonConfig {
  // Unix socket of the local control service (YAML key `socket`).
  std::string socket_path = "/run/ciuic/ciuicd.sock";
  // Name of this node in the cluster.
  std::string node_name = DefaultNodeName();
  // The rack (or any group of nodes behind one switch) this node is in,
  // announced when it joins a job: allreduces may then run rack by rack
  // (tuning `algorithm`, daemon/cluster/README.md "Racks"). "" = none
  // given (every such node counts as one rack). The environment variable
  // CIUIC_RACK, when set, overrides it. Up to 64 characters from letters,
  // digits, '-', '.', '_'.
  std::string rack;
  // trace|debug|info|warn|error|critical|off (spdlog level names).
  std::string log_level = "info";
  // Worker pool size; 0 = number of cores. 0..256.
  int worker_threads = 0;
  // Largest shared-memory arena a session may map. 1M..1T.
  uint64_t max_arena_bytes = uint64_t{8} << 30;
  // host:port of the peer service (TCP, for the other daemons); "auto"
  // (the default): 0.0.0.0:7361 with a cluster_token_file, 127.0.0.1:7361
  // without; "off": no TCP port at all (single-node jobs only). See
  // PeerListenAddress.
  std::string listen = "auto";
  // Lets `listen` be a non-loopback address without a cluster_token_file:
  // any host that reaches the port can then join this daemon's jobs.
  bool insecure_no_auth = false;
  // The hosts this daemon may connect to as a job's coordinator (addresses,
  // CIDR ranges, host names; config/peer_list.h); empty: any host, the
  // cluster-token handshake alone protects the token. A YAML list or a
  // comma-separated string.
  std::vector<std::string> peers;
  // One network device per inter-node channel (UCX's NET_DEVICES of that
  // channel's context, e.g. eth1, mlx5_0:1): channel i sends only through
  // device i, so that a node pair joined by several links uses each. Sets
  // the channel count (tuning `channels` is then not used); every node of
  // a job needs as many. Empty: every channel uses every device UCX picks.
  // A YAML list or a comma-separated string.
  std::vector<std::string> channel_devices;
  // TCP port of the ordering streams that the other nodes' daemons open to
  // this one for the jobs it coordinates, on the host of `listen`; 0 = a
  // free port, announced to the nodes when a job forms. 0..65535.
  int ordering_port = 0;
  // host:port where Prometheus scrapes /metrics over HTTP; "" = no
  // metrics endpoint (the default). Port 0: a free one (`ciuicctl status`
  // shows it).
  std::string metrics_listen;
  // File holding the secret shared by the cluster's daemons; "" = none.
  std::string cluster_token_file;
  // TLS between daemons (peer service and ordering streams): this daemon's
  // certificate (PEM, chain allowed), its private key, and the CA that
  // signs every daemon's certificate. All three or none ("" = no TLS);
  // ciuicd reads and checks them at start.
  std::string tls_cert_file;
  std::string tls_key_file;
  std::string tls_ca_file;
  // Group (name) whose members may change the daemon (`ciuicctl tune set`)
  // and see every user's jobs, as root and the daemon's own uid may; "" =
  // none. Must exist when set.
  std::string admin_group;
  // What one trainer, uid or job may take (daemon/README's "Security"):
  // every number a trainer sends is held against these before the daemon
  // allocates for it. 0 in a byte limit: a share of physical memory.
  uint32_t max_world_size = 65536;       // ranks of one job, 1..16777216
  uint32_t max_sessions = 4096;          // sessions open at once, all uids
  uint32_t max_sessions_per_uid = 512;   // sessions open at once, one uid
  uint32_t max_jobs_per_uid = 256;       // jobs with a rank on this node, one uid
  uint64_t max_arena_bytes_per_uid = 0;  // arenas mapped for one uid; 0: 1/2 of RAM
  uint64_t max_arena_bytes_total = 0;    // arenas mapped for all uids; 0: 3/4 of RAM
  // Initial live-tunable settings (YAML map `tuning`).
  Tuning tuning;
};

// Whether `rack` is a valid `rack` value (or CIUIC_RACK): up to 64
// characters from letters, digits, '-', '.', '_'; empty is valid (none).
bool ValidRackName(absl::string_view rack);

// Parses a config document. `source_name` (usually the file path) prefixes
// error messages. An empty document gives the defaults.
absl::StatusOr<DaemonConfig> ParseConfigYaml(absl::string_view text, absl::string_view source_name);

// The address the peer service listens on: `listen` with "auto" made
// concrete, or "" for "off". FAILED_PRECONDITION (ciuicd exits 78) when it
// is not a loopback address (127.0.0.0/8, ::1, localhost) and there is
// neither a cluster_token_file nor insecure_no_auth.
absl::StatusOr<std::string> PeerListenAddress(const DaemonConfig& config);

// Whether `host` (of host:port, brackets allowed) is a loopback host.
bool IsLoopbackHost(absl::string_view host);

// Reads and parses `path`. An unreadable file is NOT_FOUND or
// PERMISSION_DENIED (naming the path and the OS error).
absl::StatusOr<DaemonConfig> LoadConfigFile(const std::string& path);

}  // namespace ciuic::config
