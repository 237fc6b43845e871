#include "control/metrics.h"

#include <deque>
#include <exception>
#include <iterator>
#include <limits>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "cuda/gpu_info.h"
#include "engine/engine.h"
#include "prometheus/collectable.h"
#include "prometheus/exposer.h"
#include "prometheus/metric_family.h"
#include "reduce/reduce.h"

namespace ciuic::daemon {
namespace {

using prometheus::ClientMetric;
using prometheus::MetricFamily;
using prometheus::MetricType;
using Labels = std::vector<ClientMetric::Label>;

class EngineCollectable final : public prometheus::Collectable {
 public:
  EngineCollectable(Engine* engine, std::string node_name)
      : engine_(engine), node_name_(std::move(node_name)) {}

  std::vector<MetricFamily> Collect() const override {
    const EngineStatus st = engine_->Status();
    const EnginePeers peers = engine_->Peers();
    // A deque: the references family() hands out stay valid while more
    // families are added (a vector's reallocation left them dangling, and
    // samples added through one went nowhere).
    std::deque<MetricFamily> families;
    auto family = [&families](std::string name, std::string help,
                              MetricType type) -> MetricFamily& {
      families.push_back(MetricFamily{std::move(name), std::move(help), type, {}});
      return families.back();
    };
    auto add = [](MetricFamily& f, Labels labels, double value) {
      ClientMetric m;
      m.label = std::move(labels);
      if (f.type == MetricType::Counter) {
        m.counter.value = value;
      } else {
        m.gauge.value = value;
      }
      f.metric.push_back(std::move(m));
    };

    const GpuProbe& gpus = ProbeGpus();
    add(family("ciuic_build_info", "ciuicd's version, node name and build; always 1",
               MetricType::Gauge),
        {{"version", CIUIC_VERSION},
         {"node", node_name_},
         {"reduce_kernels", std::string(reduce::ActiveIsa())},
         {"cuda", gpus.built_with_cuda ? "yes" : "no"}},
        1);
    add(family("ciuic_uptime_seconds", "Seconds since ciuicd started", MetricType::Gauge), {},
        st.uptime_seconds);
    add(family("ciuic_sessions", "Trainer sessions open", MetricType::Gauge), {},
        static_cast<double>(st.sessions.size()));
    add(family("ciuic_ops_completed_total", "Operations completed on this node",
               MetricType::Counter),
        {}, static_cast<double>(st.ops_completed));
    add(family("ciuic_ops_failed_total", "Operations failed on this node", MetricType::Counter),
        {}, static_cast<double>(st.ops_failed));
    add(family("ciuic_bytes_reduced_total", "Payload bytes of completed operations",
               MetricType::Counter),
        {}, static_cast<double>(st.bytes));
    add(family("ciuic_gpu_mapped_allocations",
               "Trainers' CUDA allocations ciuicd has mapped (CUDA IPC)", MetricType::Gauge),
        {}, static_cast<double>(st.gpu_mapped_allocations));
    add(family("ciuic_gpu_mapped_bytes", "Bytes of the trainers' CUDA allocations ciuicd has mapped",
               MetricType::Gauge),
        {}, static_cast<double>(st.gpu_mapped_bytes));
    add(family("ciuic_gpu_pinned_host_bytes",
               "Pinned host memory ciuicd holds for device buffers (staging)", MetricType::Gauge),
        {}, static_cast<double>(st.gpu_pinned_bytes));

    // One family per per-job counter, each with a sample per job.
    struct JobCounter {
      const char* name;
      const char* help;
      MetricType type;
      double (*value)(const EngineStatus::JobRow&);
    };
    static const JobCounter kJobCounters[] = {
        {"ciuic_job_ops_completed_total", "Operations of the job completed on this node",
         MetricType::Counter,
         [](const EngineStatus::JobRow& j) { return double(j.ops_completed); }},
        {"ciuic_job_ops_failed_total", "Operations of the job failed on this node",
         MetricType::Counter, [](const EngineStatus::JobRow& j) { return double(j.ops_failed); }},
        {"ciuic_job_bytes_reduced_total", "Payload bytes of the job's completed operations",
         MetricType::Counter, [](const EngineStatus::JobRow& j) { return double(j.bytes); }},
        {"ciuic_job_pending_ops", "Operations waiting for ranks", MetricType::Gauge,
         [](const EngineStatus::JobRow& j) { return double(j.pending.size()); }},
        {"ciuic_job_world_size", "Ranks in the job", MetricType::Gauge,
         [](const EngineStatus::JobRow& j) { return double(j.world_size); }},
        {"ciuic_job_ops_compressed_total", "Operations whose inter-node traffic was compressed",
         MetricType::Counter,
         [](const EngineStatus::JobRow& j) { return double(j.ops_compressed); }},
        {"ciuic_job_compression_bytes_before_total",
         "Bytes this node would have sent uncompressed for them", MetricType::Counter,
         [](const EngineStatus::JobRow& j) { return double(j.bytes_before_compression); }},
        {"ciuic_job_compression_bytes_after_total", "Bytes this node sent compressed for them",
         MetricType::Counter,
         [](const EngineStatus::JobRow& j) { return double(j.bytes_after_compression); }},
        {"ciuic_job_ops_fused_total", "Operations that crossed the network fused with others",
         MetricType::Counter, [](const EngineStatus::JobRow& j) { return double(j.ops_fused); }},
        {"ciuic_job_fused_runs_total", "Fused inter-node allreduces", MetricType::Counter,
         [](const EngineStatus::JobRow& j) { return double(j.fused_runs); }},
        {"ciuic_job_ops_direct_total",
         "Multi-node operations that ran between the nodes without the coordinator",
         MetricType::Counter, [](const EngineStatus::JobRow& j) { return double(j.ops_direct); }},
        {"ciuic_job_ops_staged_total", "Multi-node operations on GPU buffers", MetricType::Counter,
         [](const EngineStatus::JobRow& j) { return double(j.ops_staged); }},
        {"ciuic_job_bytes_staged_total", "Bytes copied between GPU and host memory for them",
         MetricType::Counter, [](const EngineStatus::JobRow& j) { return double(j.bytes_staged); }},
        {"ciuic_job_feedback_residuals", "Error feedback residuals held (host and GPUs)",
         MetricType::Gauge,
         [](const EngineStatus::JobRow& j) { return double(j.feedback_residuals); }},
        {"ciuic_job_feedback_host_bytes", "Bytes of error feedback residuals in host memory",
         MetricType::Gauge,
         [](const EngineStatus::JobRow& j) { return double(j.feedback_host_bytes); }},
        {"ciuic_job_feedback_device_bytes", "Bytes of error feedback residuals on GPUs",
         MetricType::Gauge,
         [](const EngineStatus::JobRow& j) { return double(j.feedback_device_bytes); }},
        {"ciuic_job_feedback_evictions_total",
         "Error feedback residuals evicted to stay within the cap", MetricType::Counter,
         [](const EngineStatus::JobRow& j) { return double(j.feedback_evictions); }},
        {"ciuic_job_feedback_resets_total",
         "Error feedback residuals reset because an operation changed size", MetricType::Counter,
         [](const EngineStatus::JobRow& j) { return double(j.feedback_resets); }},
        {"ciuic_job_feedback_too_large_total",
         "Operations compressed without error feedback: over its cap alone", MetricType::Counter,
         [](const EngineStatus::JobRow& j) { return double(j.feedback_too_large); }},
    };
    for (const JobCounter& c : kJobCounters) {
      MetricFamily& f = family(c.name, c.help, c.type);
      for (const EngineStatus::JobRow& j : st.jobs) {
        add(f, {{"job", j.id}, {"uid", absl::StrCat(j.uid)}}, c.value(j));
      }
    }
    MetricFamily& skew = family(
        "ciuic_rank_skew_seconds",
        "How late the rank submits after the node's first rank, a moving average over the job's "
        "operations (ranks of this node; none for a job of one rank here)",
        MetricType::Gauge);
    for (const EngineStatus::JobRow& j : st.jobs) {
      for (const auto& [rank, seconds] : j.rank_skew_seconds) {
        add(skew, {{"job", j.id}, {"uid", absl::StrCat(j.uid)}, {"rank", absl::StrCat(rank)}},
            seconds);
      }
    }
    MetricFamily& durations = family(
        "ciuic_job_op_duration_seconds",
        "Completed operations (not fast-path ones) from the node's first submission to completion",
        MetricType::Histogram);
    for (const EngineStatus::JobRow& j : st.jobs) {
      ClientMetric m;
      m.label = {{"job", j.id}, {"uid", absl::StrCat(j.uid)}};
      uint64_t cumulative = 0;
      for (size_t b = 0; b < kOpDurationBuckets; ++b) {
        cumulative += j.duration_counts[b];
        ClientMetric::Bucket bucket;
        bucket.cumulative_count = cumulative;
        bucket.upper_bound = b + 1 < kOpDurationBuckets
                                 ? kOpDurationBounds[b]
                                 : std::numeric_limits<double>::infinity();
        m.histogram.bucket.push_back(bucket);
      }
      m.histogram.sample_count = cumulative;
      m.histogram.sample_sum = j.duration_sum_seconds;
      durations.metric.push_back(std::move(m));
    }

    MetricFamily& sent = family("ciuic_peer_bytes_sent_total",
                                "Bytes this node sent to the peer node for the job",
                                MetricType::Counter);
    MetricFamily& received = family("ciuic_peer_bytes_received_total",
                                    "Bytes this node received from the peer node for the job",
                                    MetricType::Counter);
    MetricFamily& connected = family("ciuic_peer_connected",
                                     "1 while the link to the peer node is up", MetricType::Gauge);
    MetricFamily& channel_rate = family(
        "ciuic_channel_rate_bytes_per_second",
        "What this node's sends reached on the channel while it had work (channels with a "
        "device of their own; 0: not measured yet)",
        MetricType::Gauge);
    MetricFamily& channel_share = family(
        "ciuic_channel_share", "The channel's share of the latest run's chunks (0..1)",
        MetricType::Gauge);
    for (const EnginePeers::Job& j : peers.jobs) {
      for (const EnginePeers::Peer& p : j.peers) {
        if (p.self) continue;
        const Labels labels = {{"job", j.id}, {"node", p.node_name}};
        add(sent, labels, static_cast<double>(p.bytes_sent));
        add(received, labels, static_cast<double>(p.bytes_received));
        add(connected, labels, p.state == "connected" ? 1 : 0);
      }
      for (size_t c = 0; c < j.channels.size(); ++c) {
        const Labels labels = {
            {"job", j.id}, {"channel", std::to_string(c)}, {"device", j.channels[c].device}};
        add(channel_rate, labels, j.channels[c].rate_bytes_per_s);
        add(channel_share, labels, j.channels[c].share);
      }
    }
    return std::vector<MetricFamily>(std::make_move_iterator(families.begin()),
                                     std::make_move_iterator(families.end()));
  }

 private:
  Engine* const engine_;
  const std::string node_name_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<MetricsEndpoint>> MetricsEndpoint::Start(
    const std::string& listen, Engine* engine, const std::string& node_name) {
  std::unique_ptr<MetricsEndpoint> m(new MetricsEndpoint());
  try {
    m->exposer_ = std::make_unique<prometheus::Exposer>(listen, /*num_threads=*/1);
  } catch (const std::exception& e) {
    return absl::UnavailableError(
        absl::StrCat("cannot serve /metrics on ", listen, " (metrics_listen): ", e.what()));
  }
  m->collectable_ = std::make_shared<EngineCollectable>(engine, node_name);
  m->exposer_->RegisterCollectable(m->collectable_);
  const std::vector<int> ports = m->exposer_->GetListeningPorts();
  const std::string host = listen.substr(0, listen.rfind(':'));
  m->address_ = absl::StrCat(host, ":", ports.empty() ? 0 : ports.front());
  return m;
}

MetricsEndpoint::~MetricsEndpoint() {
  if (exposer_) exposer_->RemoveCollectable(collectable_);
  exposer_.reset();  // stops serving before the collectable goes
}

}  // namespace ciuic::daemon
