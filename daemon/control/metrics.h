// The Prometheus endpoint of ciuicd (config key metrics_listen): GET
// /metrics over HTTP (prometheus-cpp's exposer). It keeps no counters of its
// own: every scrape reads the engine's status and peers, the same numbers
// `ciuicctl status` and `peers` show, in the text exposition format:
//
//   ciuic_build_info{version,node,reduce_kernels,cuda}   1
//   ciuic_uptime_seconds, ciuic_sessions
//   ciuic_ops_completed_total, ciuic_ops_failed_total, ciuic_bytes_reduced_total
//   device buffers: ciuic_gpu_mapped_allocations, ciuic_gpu_mapped_bytes (the
//     trainers' CUDA allocations ciuicd has mapped), ciuic_gpu_pinned_host_bytes
//   per job {job, uid}: ciuic_job_ops_completed_total, ..._failed_total,
//     ciuic_job_bytes_reduced_total, ciuic_job_pending_ops, ciuic_job_world_size,
//     compression (ops, bytes before/after), fusion (ops, runs), staging
//     (ops, bytes), error feedback (ciuic_job_feedback_residuals, _host_bytes,
//     _device_bytes; _evictions_total, _resets_total, _too_large_total),
//     and ciuic_job_op_duration_seconds (histogram: first
//     submission on this node to completion; fast-path operations are not in it)
//   per job and local rank {job, uid, rank}: ciuic_rank_skew_seconds (how late
//     the rank submits after the node's first, a moving average)
//   per peer node {job, node}: ciuic_peer_bytes_sent_total,
//     ciuic_peer_bytes_received_total, ciuic_peer_connected
//   per job and channel with a device of its own {job, channel, device}:
//     ciuic_channel_rate_bytes_per_second, ciuic_channel_share
//
// Jobs and peers appear while the daemon knows them (a job's series end
// with it).
#pragma once

#include <memory>
#include <string>

#include "absl/status/statusor.h"

namespace prometheus {
class Exposer;
class Collectable;
}  // namespace prometheus

namespace ciuic::daemon {

class Engine;

class MetricsEndpoint {
 public:
  // Serves /metrics on `listen` (host:port; port 0: a free one). The engine
  // must outlive the endpoint.
  static absl::StatusOr<std::unique_ptr<MetricsEndpoint>> Start(const std::string& listen,
                                                                Engine* engine,
                                                                const std::string& node_name);
  ~MetricsEndpoint();

  // host:port it listens on (the port it got).
  const std::string& address() const { return address_; }

 private:
  MetricsEndpoint() = default;
  std::shared_ptr<prometheus::Collectable> collectable_;
  std::unique_ptr<prometheus::Exposer> exposer_;
  std::string address_;
};

}  // namespace ciuic::daemon
