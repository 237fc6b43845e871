#include "engine/op_trace.h"

#include <algorithm>

#include "ciuic/shm_layout.h"

namespace ciuic::daemon {
namespace {

using Clock = OpRecord::Clock;

uint64_t Micros(Clock::duration d) {
  return static_cast<uint64_t>(
      std::max<int64_t>(0, std::chrono::duration_cast<std::chrono::microseconds>(d).count()));
}

// `at` after `from`, or -1 for a phase that did not happen.
int64_t After(Clock::time_point at, Clock::time_point from) {
  if (at == Clock::time_point{}) return -1;
  return static_cast<int64_t>(Micros(at - from));
}

}  // namespace

OpTraceRow RowOf(const OpRecord& r, Clock::time_point origin) {
  OpTraceRow row;
  row.job_id = r.job_id;
  row.name = r.name;
  const char* collective = wire::CollectiveName(r.sig.collective);
  row.collective = collective ? collective : "?";
  const char* dtype = wire::DataTypeName(r.sig.dtype);
  row.dtype = dtype ? dtype : "?";
  row.bytes = r.bytes;
  row.device = r.sig.device;
  row.submitted_us = Micros(r.submitted - origin);
  for (const OpRecord::Arrival& a : r.arrivals) {
    row.arrivals.emplace_back(a.rank, Micros(a.at - r.submitted));
  }
  std::sort(row.arrivals.begin(), row.arrivals.end());
  row.launched_us = After(r.launched, r.submitted);
  if (const ClusterOp::Timing* t = r.cluster.get()) {
    row.ready_us = After(t->ready, r.submitted);
    row.announced_us = After(t->announced, r.submitted);
    row.run_start_us = After(t->run_start, r.submitted);
    row.run_end_us = After(t->run_end, r.submitted);
    row.last_node = t->last_node;
    row.ready_spread_us = t->ready_spread_us;
    row.queued_us = t->queued_us;
    row.run_seq = t->run_seq;
    row.fused_ops = t->fused_ops;
    row.direct = t->direct;
    row.codec = t->codec;
    row.algorithm = t->algorithm;
    row.model_flat_us = t->model_flat_us;
    row.model_rack_us = t->model_rack_us;
  }
  row.job_seq = r.job_seq;
  row.count = r.sig.count;
  row.world_size = static_cast<uint32_t>(r.world_size);
  row.timeout_ms = r.timeout_ms;
  row.done_us = Micros(r.done - r.submitted);
  row.code = static_cast<int>(r.status.code());
  row.error = std::string(r.status.message());
  return row;
}

void TraceLog::Add(OpRecord record, size_t capacity) {
  ++recorded_;
  if (capacity == 0) {
    records_.clear();
    return;
  }
  while (records_.size() >= capacity) records_.pop_front();
  records_.push_back(std::move(record));
}

EngineTrace TraceLog::Select(const std::string& job_id, size_t last, Clock::time_point origin,
                             uint32_t capacity, std::optional<uint32_t> owner) const {
  EngineTrace out;
  out.capacity = capacity;
  out.recorded = recorded_;
  std::vector<const OpRecord*> picked;
  for (auto it = records_.rbegin(); it != records_.rend(); ++it) {
    if (owner && it->uid != *owner) {
      ++out.other_users;
      continue;
    }
    if (last != 0 && picked.size() == last) continue;
    if (job_id.empty() || it->job_id == job_id) picked.push_back(&*it);
  }
  for (auto it = picked.rbegin(); it != picked.rend(); ++it) out.ops.push_back(RowOf(**it, origin));
  return out;
}

}  // namespace ciuic::daemon
