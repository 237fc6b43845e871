#pragma once

// Presentation layer of ciuicctl: turns the daemon's replies (control.proto)
// into the tables operators read, or into JSON for scripts. Pure functions
// with no I/O, so that every layout is unit-tested without a daemon.

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "ciuic/control.pb.h"
#include "google/protobuf/message.h"
#include "google/protobuf/repeated_field.h"

namespace ciuic::ctl {

// Bytes in binary units with one decimal: "0 B", "512 B", "1.5 KiB",
// "4.0 MiB", "2.0 TiB".
std::string HumanBytes(uint64_t bytes);

// A duration in seconds, short and readable: "0.4s", "12.3s", "5m 03s",
// "2h 05m", "3d 04h". Negative or not finite: "-".
std::string HumanDuration(double seconds);

// A rank list as ranges, sorted: {3,0,1,2,7} -> "0-3,7"; empty -> "-".
std::string FormatRanks(const google::protobuf::RepeatedField<int32_t>& ranks);

// Column-aligned text table. Cells are sanitized (control characters become
// '?') because they may come from untrusted job names.
class Table {
 public:
  enum class Align { kLeft, kRight };

  explicit Table(std::vector<std::string> header);
  // Sets the alignment of column `column` (default left).
  void SetAlign(size_t column, Align align);
  // A row with fewer cells than the header is padded with "".
  void AddRow(std::vector<std::string> cells);
  size_t rows() const { return rows_.size(); }
  // The header and rows, two spaces between columns, no trailing blanks,
  // each line ending in '\n'.
  std::string Render() const;

 private:
  std::vector<std::string> header_;
  std::vector<Align> align_;
  std::vector<std::vector<std::string>> rows_;
};

// `ciuicctl status`: daemon summary, sessions and a one-line-per-job summary.
std::string FormatStatus(const proto::StatusReply& status);

// `ciuicctl jobs`: the jobs, then every pending operation of every job.
std::string FormatJobs(const proto::StatusReply& status);

// `ciuicctl tune get`: KEY VALUE DESCRIPTION table.
std::string FormatTuneEntries(const proto::TuneGetReply& reply);

// `ciuicctl peers`: per multi-node job, its nodes, link state and bytes.
std::string FormatPeers(const proto::PeersReply& reply);

// A duration in microseconds, short: "85us", "1.25ms", "3.40s".
std::string HumanMicros(uint64_t us);

// `ciuicctl trace`: one row per operation (oldest first) with the wait for
// the node's ranks, for the other nodes (and which came last), the run and
// the total, then who was late most often and the median phases.
std::string FormatTrace(const proto::TraceReply& reply);

// The same operations in the Trace Event Format (chrome://tracing,
// ui.perfetto.dev): one row per operation name, one slice per phase.
std::string ChromeTrace(const proto::TraceReply& reply);

// `ciuicctl tune set`: "key = value" for the value now in force.
std::string FormatTuneEntry(const proto::TuneEntry& entry);

// The message as one JSON object on one line, every field printed (also
// those at their default), followed by '\n'.
absl::StatusOr<std::string> ToJson(const google::protobuf::Message& message);

}  // namespace ciuic::ctl
