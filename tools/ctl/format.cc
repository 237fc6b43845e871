#include "format.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "google/protobuf/util/json_util.h"

namespace ciuic::ctl {
namespace {

std::string Sanitize(absl::string_view text) {
  std::string out(text);
  for (char& c : out) {
    if (absl::ascii_iscntrl(static_cast<unsigned char>(c))) c = '?';
  }
  return out;
}

std::string OrDash(absl::string_view text) { return text.empty() ? "-" : std::string(text); }

std::string Lower(absl::string_view text) { return absl::AsciiStrToLower(text); }

}  // namespace

std::string HumanBytes(uint64_t bytes) {
  static constexpr const char* kUnits[] = {"KiB", "MiB", "GiB", "TiB", "PiB", "EiB"};
  if (bytes < 1024) return absl::StrCat(bytes, " B");
  double value = static_cast<double>(bytes);
  int unit = -1;
  while (value >= 1024 && unit + 1 < static_cast<int>(std::size(kUnits))) {
    value /= 1024;
    ++unit;
  }
  // 1023.96 KiB would print as "1024.0 KiB"; step up instead.
  if (value >= 1023.95 && unit + 1 < static_cast<int>(std::size(kUnits))) {
    value /= 1024;
    ++unit;
  }
  return absl::StrFormat("%.1f %s", value, kUnits[unit]);
}

std::string HumanDuration(double seconds) {
  if (!std::isfinite(seconds) || seconds < 0) return "-";
  if (seconds < 60) return absl::StrFormat("%.1fs", std::floor(seconds * 10) / 10);
  uint64_t whole = static_cast<uint64_t>(seconds);
  if (whole < 3600) return absl::StrFormat("%dm %02ds", whole / 60, whole % 60);
  if (whole < 86400) return absl::StrFormat("%dh %02dm", whole / 3600, whole % 3600 / 60);
  return absl::StrFormat("%dd %02dh", whole / 86400, whole % 86400 / 3600);
}

std::string FormatRanks(const google::protobuf::RepeatedField<int32_t>& ranks) {
  if (ranks.empty()) return "-";
  std::vector<int32_t> sorted(ranks.begin(), ranks.end());
  std::sort(sorted.begin(), sorted.end());
  sorted.erase(std::unique(sorted.begin(), sorted.end()), sorted.end());
  std::vector<std::string> parts;
  for (size_t i = 0; i < sorted.size();) {
    size_t j = i;
    while (j + 1 < sorted.size() && sorted[j + 1] == sorted[j] + 1) ++j;
    parts.push_back(j == i ? absl::StrCat(sorted[i]) : absl::StrCat(sorted[i], "-", sorted[j]));
    i = j + 1;
  }
  return absl::StrJoin(parts, ",");
}

Table::Table(std::vector<std::string> header)
    : header_(std::move(header)), align_(header_.size(), Align::kLeft) {}

void Table::SetAlign(size_t column, Align align) {
  if (column < align_.size()) align_[column] = align;
}

void Table::AddRow(std::vector<std::string> cells) {
  cells.resize(header_.size());
  for (std::string& cell : cells) cell = Sanitize(cell);
  rows_.push_back(std::move(cells));
}

std::string Table::Render() const {
  std::vector<size_t> width(header_.size());
  for (size_t c = 0; c < header_.size(); ++c) width[c] = header_[c].size();
  for (const auto& row : rows_) {
    for (size_t c = 0; c < row.size(); ++c) width[c] = std::max(width[c], row[c].size());
  }
  std::string out;
  auto render_line = [&](const std::vector<std::string>& cells) {
    std::string line;
    for (size_t c = 0; c < cells.size(); ++c) {
      if (c > 0) line += "  ";
      std::string padding(width[c] - cells[c].size(), ' ');
      if (align_[c] == Align::kRight) {
        absl::StrAppend(&line, padding, cells[c]);
      } else {
        absl::StrAppend(&line, cells[c], padding);
      }
    }
    line.erase(line.find_last_not_of(' ') + 1);
    absl::StrAppend(&out, line, "\n");
  };
  render_line(header_);
  for (const auto& row : rows_) render_line(row);
  return out;
}

namespace {

// Per multi-node job: what compression and fusion saved on the network.
std::string FormatNetworkSavings(const proto::StatusReply& status) {
  std::string out;
  for (const proto::JobInfo& job : status.jobs()) {
    if (job.ops_compressed() != 0) {
      absl::StrAppend(&out, "compression: job ", Sanitize(job.job_id()), ": ",
                      job.ops_compressed(), " operations, ",
                      HumanBytes(job.bytes_before_compression()), " -> ",
                      HumanBytes(job.bytes_after_compression()), " on the wire\n");
    }
    if (job.ops_fused() != 0) {
      absl::StrAppend(&out, "fusion: job ", Sanitize(job.job_id()), ": ", job.ops_fused(),
                      " operations fused into ", job.fused_runs(), " allreduces\n");
    }
    if (job.ops_direct() != 0) {
      absl::StrAppend(&out, "direct: job ", Sanitize(job.job_id()), ": ", job.ops_direct(),
                      " operations ran between the nodes without the coordinator\n");
    }
    if (job.ops_staged() != 0) {
      absl::StrAppend(&out, "gpu: job ", Sanitize(job.job_id()), ": ", job.ops_staged(),
                      " operations on GPU buffers, ", HumanBytes(job.bytes_staged()),
                      " copied between the GPU and host memory\n");
    }
    const uint64_t dropped =
        job.feedback_evictions() + job.feedback_resets() + job.feedback_too_large();
    if (job.feedback_residuals() != 0 || dropped != 0) {
      absl::StrAppend(
          &out, "error feedback: job ", Sanitize(job.job_id()), ": ", job.feedback_residuals(),
          " residuals, ", HumanBytes(job.feedback_host_bytes()), " in host memory, ",
          HumanBytes(job.feedback_device_bytes()), " on GPUs; dropped: ", job.feedback_evictions(),
          " evicted, ", job.feedback_resets(), " reset (size changed); ", job.feedback_too_large(),
          " operations too large for it\n");
    }
  }
  return out;
}

}  // namespace

std::string FormatStatus(const proto::StatusReply& status) {
  std::string out = absl::StrCat("ciuicd ", Sanitize(OrDash(status.version())), " on node ",
                                 Sanitize(OrDash(status.node_name())), "\n");
  auto field = [&out](absl::string_view name, absl::string_view value) {
    absl::StrAppend(&out, absl::StrFormat("  %-15s %s\n", name, Sanitize(value)));
  };
  field("uptime", HumanDuration(status.uptime_seconds()));
  field("socket", OrDash(status.socket_path()));
  field("peer service", status.ordering_port() == 0 || status.peer_address().empty()
                            ? OrDash(status.peer_address())
                            : absl::StrCat(status.peer_address(), " (ordering streams on port ",
                                           status.ordering_port(), ")"));
  field("metrics", status.metrics_address().empty()
                       ? "off (metrics_listen)"
                       : absl::StrCat("http://", status.metrics_address(), "/metrics"));
  field("worker threads", absl::StrCat(status.worker_threads()));
  field("operations",
        absl::StrCat(status.ops_completed(), " completed, ", status.ops_failed(), " failed"));
  field("bytes reduced", HumanBytes(status.bytes_reduced()));
  field("reduce kernels", OrDash(status.reduce_kernels()));
  field("cuda", status.cuda_built() ? "built with CUDA" : "built without CUDA");
  if (status.gpus().empty()) {
    field("gpus", absl::StrCat("none: ", OrDash(status.gpus_unavailable())));
  } else {
    for (const proto::GpuInfo& gpu : status.gpus()) {
      field(gpu.index() == status.gpus(0).index() ? "gpus" : "",
            absl::StrCat(gpu.index(), ": ", gpu.name(), " (", HumanBytes(gpu.memory_bytes()),
                         ", sm_", gpu.compute_major(), gpu.compute_minor(), ")"));
    }
  }
  field("ucx cuda memory", status.ucx_cuda_memory() ? "yes (this UCX build moves CUDA memory)"
                                                    : "no (this UCX build has no CUDA support)");
  if (status.cuda_built()) {
    field("gpu memory",
          absl::StrCat(status.gpu_mapped_allocations(), " trainer allocation",
                       status.gpu_mapped_allocations() == 1 ? "" : "s", " mapped (",
                       HumanBytes(status.gpu_mapped_bytes()), "), ",
                       HumanBytes(status.gpu_pinned_host_bytes()), " pinned host memory"));
  }

  absl::StrAppend(&out, "\nSESSIONS (", status.sessions_size(), ")\n");
  if (status.other_users_sessions() > 0) {
    absl::StrAppend(&out, "  and ", status.other_users_sessions(),
                    " of other users, not shown (root, ciuicd's uid and admin_group see all)\n");
  }
  if (status.sessions().empty()) {
    out += "  (none)\n";
  } else {
    Table sessions({"ID", "UID", "PID", "JOB", "RANK", "ARENA"});
    for (size_t column : {0, 1, 2, 4, 5}) sessions.SetAlign(column, Table::Align::kRight);
    for (const proto::SessionInfo& session : status.sessions()) {
      sessions.AddRow({absl::StrCat(session.session_id()), absl::StrCat(session.uid()),
                       absl::StrCat(session.pid()), OrDash(session.job_id()),
                       session.job_id().empty() ? "-" : absl::StrCat(session.rank()),
                       HumanBytes(session.arena_bytes())});
    }
    out += sessions.Render();
  }

  absl::StrAppend(&out, "\nJOBS (", status.jobs_size(), ")\n");
  if (status.other_users_jobs() > 0) {
    absl::StrAppend(&out, "  and ", status.other_users_jobs(), " of other users, not shown\n");
  }
  if (status.jobs().empty()) {
    out += "  (none)\n";
  } else {
    Table jobs({"JOB", "UID", "WORLD", "LOCAL RANKS", "STATE", "PENDING"});
    for (size_t column : {1, 2, 5}) jobs.SetAlign(column, Table::Align::kRight);
    for (const proto::JobInfo& job : status.jobs()) {
      jobs.AddRow({OrDash(job.job_id()), absl::StrCat(job.uid()), absl::StrCat(job.world_size()),
                   FormatRanks(job.ranks()), OrDash(job.state()),
                   absl::StrCat(job.pending_size())});
    }
    out += jobs.Render();
    out += FormatNetworkSavings(status);
  }
  return out;
}

std::string FormatJobs(const proto::StatusReply& status) {
  const std::string others =
      status.other_users_jobs() == 0
          ? ""
          : absl::StrCat(status.other_users_jobs(), " job(s) of other users, not shown\n");
  if (status.jobs().empty()) return "no jobs\n" + others;
  Table jobs({"JOB", "UID", "WORLD", "LOCAL RANKS", "STATE", "COMPLETED", "FAILED", "BYTES"});
  for (size_t column : {1, 2, 5, 6, 7}) jobs.SetAlign(column, Table::Align::kRight);
  Table pending({"JOB", "OPERATION", "COLLECTIVE", "BYTES", "AGE", "SUBMITTED", "WAITING FOR"});
  for (size_t column : {3, 4}) pending.SetAlign(column, Table::Align::kRight);
  for (const proto::JobInfo& job : status.jobs()) {
    std::string local = FormatRanks(job.ranks());
    if (job.local_size() > 0) absl::StrAppend(&local, " (", job.local_size(), " on node)");
    jobs.AddRow({OrDash(job.job_id()), absl::StrCat(job.uid()), absl::StrCat(job.world_size()),
                 local, OrDash(job.state()), absl::StrCat(job.ops_completed()),
                 absl::StrCat(job.ops_failed()), HumanBytes(job.bytes_reduced())});
    for (const proto::PendingOp& op : job.pending()) {
      pending.AddRow({OrDash(job.job_id()), OrDash(op.name()), OrDash(Lower(op.collective())),
                      HumanBytes(op.bytes()), HumanDuration(op.age_seconds()),
                      FormatRanks(op.submitted_ranks()), FormatRanks(op.waiting_for_ranks())});
    }
  }
  std::string out = jobs.Render() + others;
  out += FormatNetworkSavings(status);
  // The rank that submits latest on average, per job with several ranks here.
  for (const proto::JobInfo& job : status.jobs()) {
    const proto::RankSkew* latest = nullptr;
    for (const proto::RankSkew& s : job.rank_skew()) {
      if (latest == nullptr || s.seconds() > latest->seconds()) latest = &s;
    }
    if (latest != nullptr && latest->seconds() > 0) {
      absl::StrAppend(&out, "skew: job ", Sanitize(job.job_id()), ": rank ", latest->rank(),
                      " submits latest, ",
                      HumanMicros(static_cast<uint64_t>(latest->seconds() * 1e6)),
                      " after the node's first rank on average\n");
    }
  }
  out += "\nPENDING OPERATIONS\n";
  out += pending.rows() == 0 ? "  (none)\n" : pending.Render();
  return out;
}

std::string FormatPeers(const proto::PeersReply& reply) {
  std::string out;
  if (!reply.peer_address().empty()) {
    absl::StrAppend(&out, "peer service: ", Sanitize(reply.peer_address()), "\n");
  }
  if (reply.other_users_jobs() > 0) {
    absl::StrAppend(&out, reply.other_users_jobs(), " multi-node job(s) of other users, not shown\n");
  }
  if (reply.jobs().empty()) return out + "no multi-node jobs\n";
  Table table({"JOB", "COORDINATOR", "NODE", "RANKS", "RACK", "LINK", "SENT", "RECEIVED",
               "RATE"});
  for (size_t column : {6, 7, 8}) table.SetAlign(column, Table::Align::kRight);
  for (const proto::JobPeers& job : reply.jobs()) {
    if (job.peers().empty()) {
      table.AddRow({OrDash(job.job_id()), OrDash(job.coordinator()), "-", "-", "-",
                    OrDash(job.state()), "-", "-", "-"});
    }
    for (const proto::PeerInfo& peer : job.peers()) {
      // RATE: what this node's sends to that node reached (measured in
      // jobs that span racks).
      table.AddRow({OrDash(job.job_id()), OrDash(job.coordinator()),
                    absl::StrCat(peer.node_name(), peer.self() ? " (this node)" : ""),
                    FormatRanks(peer.ranks()), OrDash(Sanitize(peer.rack())),
                    peer.self() ? "-" : OrDash(peer.state()), HumanBytes(peer.bytes_sent()),
                    HumanBytes(peer.bytes_received()),
                    peer.rate_bytes_per_second() > 0
                        ? absl::StrCat(HumanBytes(static_cast<uint64_t>(
                                           peer.rate_bytes_per_second())),
                                       "/s")
                        : "-"});
    }
  }
  out += table.Render();
  // Channels with devices of their own: each one's share of a run's chunks
  // follows the rate measured on it.
  bool any = false;
  Table channels({"JOB", "CHANNEL", "DEVICE", "RATE", "SHARE"});
  for (size_t column : {3, 4}) channels.SetAlign(column, Table::Align::kRight);
  for (const proto::JobPeers& job : reply.jobs()) {
    for (int c = 0; c < job.channels_size(); ++c) {
      const proto::ChannelInfo& ch = job.channels(c);
      any = true;
      channels.AddRow({OrDash(job.job_id()), absl::StrCat(c), OrDash(ch.device()),
                       ch.rate_bytes_per_second() > 0
                           ? absl::StrFormat("%.1f MB/s", ch.rate_bytes_per_second() / 1e6)
                           : "-",
                       absl::StrFormat("%.0f%%", 100 * ch.share())});
    }
  }
  if (any) out += "\n" + channels.Render();
  return out;
}

std::string HumanMicros(uint64_t us) {
  if (us < 1000) return absl::StrCat(us, "us");
  if (us < 1000000) return absl::StrFormat("%.2fms", static_cast<double>(us) / 1e3);
  return absl::StrFormat("%.2fs", static_cast<double>(us) / 1e6);
}

namespace {

// The median of `values` (0 when empty; the lower middle of an even count).
uint64_t Median(std::vector<uint64_t> values) {
  if (values.empty()) return 0;
  std::nth_element(values.begin(), values.begin() + (values.size() - 1) / 2, values.end());
  return values[(values.size() - 1) / 2];
}

// The local rank that submitted last, if the node has several and one was.
const proto::RankArrival* LastRank(const proto::OpTrace& op) {
  if (op.arrivals_size() < 2) return nullptr;
  const proto::RankArrival* last = &op.arrivals(0);
  for (const proto::RankArrival& a : op.arrivals()) {
    if (a.after_us() > last->after_us()) last = &a;
  }
  return last->after_us() > 0 ? last : nullptr;  // all within a microsecond: nobody
}

std::string StatusText(const proto::OpTrace& op) {
  if (op.code() == 0) return "ok";
  std::string text = absl::StrCat("code ", op.code(), ": ", op.error());
  if (text.size() > 60) text = text.substr(0, 57) + "...";
  return text;
}

// Who arrived last how often, and how late: "rank 3 last in 18 of 20 (median +1.20ms)".
struct LateCount {
  int last = 0;
  std::vector<uint64_t> lateness;
};

std::string LateLines(const std::map<std::string, LateCount>& who, int out_of,
                      absl::string_view what) {
  std::vector<std::pair<std::string, LateCount>> sorted(who.begin(), who.end());
  std::sort(sorted.begin(), sorted.end(), [](const auto& a, const auto& b) {
    return a.second.last != b.second.last ? a.second.last > b.second.last : a.first < b.first;
  });
  std::string out;
  for (size_t i = 0; i < sorted.size() && i < 3; ++i) {
    absl::StrAppend(&out, "  ", what, " ", sorted[i].first, " last in ", sorted[i].second.last,
                    " of ", out_of, " (median +", HumanMicros(Median(sorted[i].second.lateness)),
                    ")\n");
  }
  return out;
}

}  // namespace

std::string FormatTrace(const proto::TraceReply& reply) {
  std::string out = absl::StrCat(reply.ops_size(), " operation(s) shown; the daemon keeps its last ",
                                 reply.capacity(), " (trace_ops), ", reply.recorded(),
                                 " recorded since it started\n");
  if (reply.other_users_ops() > 0) {
    absl::StrAppend(&out, reply.other_users_ops(), " of other users' jobs not shown\n");
  }
  if (reply.ops().empty()) return out;
  Table table({"JOB", "OPERATION", "COLLECTIVE", "BYTES", "RANKS IN", "LAST RANK", "NODES IN",
               "LAST NODE", "QUEUED", "RUN", "TOTAL", "STATUS"});
  for (size_t column : {3, 4, 6, 8, 9, 10}) table.SetAlign(column, Table::Align::kRight);
  std::map<std::string, LateCount> ranks, nodes;
  int with_ranks = 0, with_nodes = 0;
  std::vector<uint64_t> ranks_in, order, run, total;
  for (const proto::OpTrace& op : reply.ops()) {
    const proto::RankArrival* last = LastRank(op);
    if (last != nullptr) {
      ++with_ranks;
      LateCount& c = ranks[absl::StrCat(last->rank())];
      ++c.last;
      c.lateness.push_back(last->after_us());
    }
    if (!op.last_node().empty()) {
      ++with_nodes;
      LateCount& c = nodes[op.last_node()];
      ++c.last;
      c.lateness.push_back(op.ready_spread_us());
    }
    if (op.has_launched_us()) ranks_in.push_back(op.launched_us());
    if (op.has_announced_us() && op.has_launched_us() && op.announced_us() >= op.launched_us()) {
      order.push_back(op.announced_us() - op.launched_us());
    }
    const bool ran = op.has_run_start_us() && op.has_run_end_us();
    if (ran) run.push_back(op.run_end_us() - op.run_start_us());
    total.push_back(op.done_us());
    const bool multi = op.has_ready_us();
    std::string collective = Lower(op.collective());
    if (op.device()) absl::StrAppend(&collective, " (gpu)");
    if (op.fused_ops() > 1) absl::StrAppend(&collective, " fused x", op.fused_ops());
    if (op.direct()) absl::StrAppend(&collective, " direct");
    if (!op.codec().empty()) absl::StrAppend(&collective, " ", op.codec());
    if (!op.algorithm().empty() && op.algorithm() != "direct" && op.algorithm() != "compressed") {
      absl::StrAppend(&collective, " ", Sanitize(op.algorithm()));
    }
    // Chosen by the rack cost model: the speedup it predicted for the racks.
    if (op.model_flat_us() > 0 && op.model_rack_us() > 0) {
      absl::StrAppend(&collective, absl::StrFormat(" (model %.2fx)",
                                                   static_cast<double>(op.model_flat_us()) /
                                                       static_cast<double>(op.model_rack_us())));
    }
    table.AddRow({OrDash(op.job_id()), OrDash(op.name()), collective, HumanBytes(op.bytes()),
                  op.has_launched_us() ? HumanMicros(op.launched_us()) : "-",
                  last ? absl::StrCat(last->rank()) : "-",
                  multi && !op.last_node().empty() ? HumanMicros(op.ready_spread_us()) : "-",
                  OrDash(op.last_node()),
                  op.has_announced_us() ? HumanMicros(op.queued_us()) : "-",
                  ran ? HumanMicros(op.run_end_us() - op.run_start_us()) : "-",
                  HumanMicros(op.done_us()), StatusText(op)});
  }
  absl::StrAppend(&out, table.Render());
  absl::StrAppend(&out, "\nmedians: ranks in ", HumanMicros(Median(ranks_in)));
  if (!order.empty()) {
    absl::StrAppend(&out, ", then the coordinator's announcement ", HumanMicros(Median(order)));
  }
  if (!run.empty()) absl::StrAppend(&out, ", run ", HumanMicros(Median(run)));
  absl::StrAppend(&out, ", total ", HumanMicros(Median(total)), "\n");
  if (!ranks.empty() || !nodes.empty()) absl::StrAppend(&out, "who came last:\n");
  absl::StrAppend(&out, LateLines(ranks, with_ranks, "rank"));
  absl::StrAppend(&out, LateLines(nodes, with_nodes, "node"));
  return out;
}

std::string ChromeTrace(const proto::TraceReply& reply) {
  std::string out = "{\"displayTimeUnit\":\"ms\",\"traceEvents\":[\n";
  bool first = true;
  auto event = [&](absl::string_view json) {
    absl::StrAppend(&out, first ? "" : ",\n", json);
    first = false;
  };
  auto quoted = [](absl::string_view text) {
    std::string q = "\"";
    for (char c : text) {
      if (c == '"' || c == '\\') {
        q += '\\';
        q += c;
      } else if (absl::ascii_iscntrl(static_cast<unsigned char>(c))) {
        absl::StrAppend(&q, absl::StrFormat("\\u%04x", static_cast<unsigned char>(c)));
      } else {
        q += c;
      }
    }
    return q + "\"";
  };
  std::map<std::string, int> rows;  // "job/name" -> tid
  for (const proto::OpTrace& op : reply.ops()) {
    const std::string key = absl::StrCat(op.job_id(), "/", op.name());
    auto [row, fresh] = rows.try_emplace(key, static_cast<int>(rows.size()) + 1);
    if (fresh) {
      event(absl::StrCat("{\"ph\":\"M\",\"name\":\"thread_name\",\"pid\":1,\"tid\":", row->second,
                         ",\"args\":{\"name\":", quoted(key), "}}"));
    }
    const uint64_t t0 = op.submitted_us();
    auto slice = [&](absl::string_view name, uint64_t from, uint64_t to) {
      if (to < from) return;
      event(absl::StrCat("{\"ph\":\"X\",\"pid\":1,\"tid\":", row->second, ",\"name\":",
                         quoted(name), ",\"ts\":", t0 + from, ",\"dur\":", to - from,
                         ",\"args\":{\"bytes\":", op.bytes(), ",\"collective\":",
                         quoted(op.collective()), ",\"status\":", quoted(StatusText(op)), "}}"));
    };
    const uint64_t launched = op.has_launched_us() ? op.launched_us() : op.done_us();
    slice("ranks submit", 0, launched);
    uint64_t at = launched;
    if (op.has_announced_us()) {
      slice("coordinator", at, op.announced_us());
      at = op.announced_us();
    } else if (op.has_ready_us()) {  // never announced: failed waiting
      slice("coordinator", at, op.done_us());
      at = op.done_us();
    }
    if (op.has_run_start_us() && op.has_run_end_us()) {
      slice("lane queue", at, op.run_start_us());
      slice(op.fused_ops() > 1 ? "run (fused)" : "run", op.run_start_us(), op.run_end_us());
      at = op.run_end_us();
    } else if (op.has_launched_us() && !op.has_ready_us()) {  // one node
      slice("local", at, op.done_us());
      at = op.done_us();
    }
    slice("complete", at, op.done_us());
  }
  return out + "\n]}\n";
}

std::string FormatTuneEntries(const proto::TuneGetReply& reply) {
  Table table({"KEY", "VALUE", "DESCRIPTION"});
  for (const proto::TuneEntry& entry : reply.entries()) {
    table.AddRow({entry.key(), entry.value(), entry.description()});
  }
  return table.Render();
}

std::string FormatTuneEntry(const proto::TuneEntry& entry) {
  return absl::StrCat(Sanitize(entry.key()), " = ", Sanitize(entry.value()), "\n");
}

absl::StatusOr<std::string> ToJson(const google::protobuf::Message& message) {
  google::protobuf::util::JsonPrintOptions options;
  options.always_print_primitive_fields = true;
  options.add_whitespace = false;
  std::string json;
  auto status = google::protobuf::util::MessageToJsonString(message, &json, options);
  if (!status.ok()) {
    return absl::InternalError(absl::StrCat("cannot convert reply to JSON: ", status.ToString()));
  }
  json += "\n";
  return json;
}

}  // namespace ciuic::ctl
