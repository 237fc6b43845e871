#include "format.h"

#include <algorithm>
#include <cmath>
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
    if (job.ops_staged() != 0) {
      absl::StrAppend(&out, "gpu: job ", Sanitize(job.job_id()), ": ", job.ops_staged(),
                      " operations on GPU buffers, ", HumanBytes(job.bytes_staged()),
                      " copied between the GPU and host memory\n");
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

  absl::StrAppend(&out, "\nSESSIONS (", status.sessions_size(), ")\n");
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
  if (status.jobs().empty()) return "no jobs\n";
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
  std::string out = jobs.Render();
  out += FormatNetworkSavings(status);
  out += "\nPENDING OPERATIONS\n";
  out += pending.rows() == 0 ? "  (none)\n" : pending.Render();
  return out;
}

std::string FormatPeers(const proto::PeersReply& reply) {
  std::string out;
  if (!reply.peer_address().empty()) {
    absl::StrAppend(&out, "peer service: ", Sanitize(reply.peer_address()), "\n");
  }
  if (reply.jobs().empty()) return out + "no multi-node jobs\n";
  Table table({"JOB", "COORDINATOR", "NODE", "RANKS", "LINK", "SENT", "RECEIVED"});
  for (size_t column : {5, 6}) table.SetAlign(column, Table::Align::kRight);
  for (const proto::JobPeers& job : reply.jobs()) {
    if (job.peers().empty()) {
      table.AddRow({OrDash(job.job_id()), OrDash(job.coordinator()), "-", "-",
                    OrDash(job.state()), "-", "-"});
    }
    for (const proto::PeerInfo& peer : job.peers()) {
      table.AddRow({OrDash(job.job_id()), OrDash(job.coordinator()),
                    absl::StrCat(peer.node_name(), peer.self() ? " (this node)" : ""),
                    FormatRanks(peer.ranks()), peer.self() ? "-" : OrDash(peer.state()),
                    HumanBytes(peer.bytes_sent()), HumanBytes(peer.bytes_received())});
    }
  }
  return out + table.Render();
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
