// The daemon's record of its last operations, for `ciuicctl trace`: when
// each local rank submitted, when the node launched the operation, and for
// multi-node jobs when the coordinator announced it, why it waited (the
// node whose Ready came last) and how long the run took. Operators find
// stragglers and slow phases with it, the way Horovod's timeline and NCCL's
// debug logs are used, but live and without a restart.
//
// The engine's loop thread owns the log (no lock): it adds an operation when
// the operation ends, and answers queries on the loop. A record costs a few
// hundred bytes; the tuning key trace_ops bounds how many are kept.
#pragma once

#include <chrono>
#include <cstdint>
#include <deque>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "cluster/cluster_job.h"
#include "collectives/op.h"

namespace ciuic::daemon {

struct OpRecord {
  using Clock = std::chrono::steady_clock;
  uint32_t uid = 0;  // the job's owner
  std::string job_id;
  std::string name;
  OpSignature sig;
  uint64_t bytes = 0;  // payload per rank
  Clock::time_point submitted;  // the node's first rank
  struct Arrival {
    int rank = 0;
    Clock::time_point at;
  };
  std::vector<Arrival> arrivals;  // in submission order
  Clock::time_point launched;     // every local rank in (epoch: never)
  std::shared_ptr<ClusterOp::Timing> cluster;  // multi-node jobs
  Clock::time_point done;
  absl::Status status;
  uint64_t job_seq = 0;  // the job's operations on this node, from 0
  int world_size = 0;
  uint32_t timeout_ms = 0;
};

// One record as the control service reports it: microseconds, `submitted`
// since the daemon started, the phases after `submitted` (-1: did not
// happen).
struct OpTraceRow {
  std::string job_id;
  std::string name;
  std::string collective;
  std::string dtype;
  uint64_t bytes = 0;
  bool device = false;
  uint64_t submitted_us = 0;
  std::vector<std::pair<int, uint64_t>> arrivals;  // (rank, after), rank order
  int64_t launched_us = -1;
  int64_t ready_us = -1;
  int64_t announced_us = -1;
  int64_t run_start_us = -1;
  int64_t run_end_us = -1;
  std::string last_node;
  uint64_t ready_spread_us = 0;
  uint64_t queued_us = 0;
  uint64_t run_seq = 0;
  uint32_t fused_ops = 0;
  bool direct = false;
  std::string codec;
  std::string algorithm;  // ClusterOp::Timing's
  uint64_t model_flat_us = 0;
  uint64_t model_rack_us = 0;
  uint64_t done_us = 0;
  int code = 0;
  std::string error;
  uint64_t job_seq = 0;
  uint64_t count = 0;
  uint32_t world_size = 0;
  uint32_t timeout_ms = 0;
  std::string state = "completed";  // or "scheduled", "started" (not ended yet)
};

struct EngineTrace {
  std::vector<OpTraceRow> ops;  // oldest first
  uint32_t capacity = 0;
  uint64_t recorded = 0;
  uint32_t other_users = 0;  // records of other uids' jobs left out
  uint64_t now_us = 0;       // since the daemon started, as submitted_us
};

class TraceLog {
 public:
  // Keeps `record` and at most `capacity` records in all, dropping the
  // oldest (capacity 0 drops everything).
  void Add(OpRecord record, size_t capacity);
  // The last `last` records (0: all) of job `job_id` (empty: every job),
  // oldest first, with times relative to `origin` (the daemon's start).
  // With `owner`, only that uid's jobs (the others are counted).
  EngineTrace Select(const std::string& job_id, size_t last, OpRecord::Clock::time_point origin,
                     uint32_t capacity, std::optional<uint32_t> owner = std::nullopt) const;
  uint64_t recorded() const { return recorded_; }

 private:
  std::deque<OpRecord> records_;
  uint64_t recorded_ = 0;
};

// `record` as the control service reports it (exposed for tests).
OpTraceRow RowOf(const OpRecord& record, OpRecord::Clock::time_point origin);

}  // namespace ciuic::daemon
