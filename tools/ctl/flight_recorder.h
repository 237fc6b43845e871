// `ciuicctl trace --flight-recorder DIR`: the daemon's operation trace in
// the layout of torch.distributed's flight recorder, so that torch's own
// analyzer (tools/flight_recorder/fr_trace.py, torch 2.4 and later) reads
// it: one file per rank, `rank_<R>` (fr_trace's default --prefix), each a
// Python pickle of
//
//   {"version": "2.4",
//    "pg_config": {job: {"name": job, "desc": "ciuic job", "ranks": "[0, 1, ...]"}},
//    "pg_status": {job: {"last_enqueued_collective": .., "last_started_collective": ..,
//                        "last_completed_collective": ..}},
//    "entries": [one dict per operation the rank submitted, oldest first]}
//
// with each entry's fields as torch's recorder writes them (record_id,
// pg_id, process_group, collective_seq_id, p2p_seq_id, op_id,
// profiling_name, time_created_ns, duration_ms, input_sizes,
// input_dtypes, output_sizes, output_dtypes, state,
// time_discovered_started_ns, time_discovered_completed_ns, retired,
// timeout_ms, is_p2p, frames). The job is the process group, the job's
// operation number (alike on every node) the collective_seq_id. The
// analyzer only accepts profiling names "nccl:<collective>", so the
// collectives are named that way; a barrier is an all_reduce there, as in
// ProcessGroupNCCL. One daemon writes the files of its own ranks: gather
// every node's files into one directory for a multi-node job.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "ciuic/control.pb.h"

namespace ciuic::ctl {

// A Python value, for Pickle().
struct PyValue {
  enum class Kind { kNone, kBool, kInt, kFloat, kStr, kList, kTuple, kDict };
  Kind kind = Kind::kNone;
  bool b = false;
  int64_t i = 0;
  double f = 0;
  std::string s;
  std::vector<PyValue> items;  // list and tuple items; dict: key, value, key, value, ...

  static PyValue None() { return PyValue(); }
  static PyValue Bool(bool v);
  static PyValue Int(int64_t v);
  static PyValue Float(double v);
  static PyValue Str(std::string v);
  static PyValue List(std::vector<PyValue> v);
  static PyValue Tuple(std::vector<PyValue> v);
  static PyValue Dict();
  // Adds key -> value to a dict (keys are strings here).
  PyValue& Set(std::string key, PyValue value);
};

// `value` as a pickle (protocol 2) that Python's pickle.load reads.
std::string Pickle(const PyValue& value);

// The flight-recorder files of job `job` (empty: the only job in `reply`;
// an error naming them if there are several) from a trace taken with
// in_flight: rank -> file contents. `wall_now_ns` is the wall clock
// (ns since the epoch) when the reply came, which maps the daemon's times
// (reply.now_us) to time_created_ns.
absl::StatusOr<std::map<int, std::string>> FlightRecorderFiles(const proto::TraceReply& reply,
                                                               const std::string& job,
                                                               int64_t wall_now_ns);

}  // namespace ciuic::ctl
