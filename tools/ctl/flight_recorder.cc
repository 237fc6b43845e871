#include "flight_recorder.h"

#include <algorithm>
#include <cstring>
#include <set>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace ciuic::ctl {

PyValue PyValue::Bool(bool v) {
  PyValue p;
  p.kind = Kind::kBool;
  p.b = v;
  return p;
}
PyValue PyValue::Int(int64_t v) {
  PyValue p;
  p.kind = Kind::kInt;
  p.i = v;
  return p;
}
PyValue PyValue::Float(double v) {
  PyValue p;
  p.kind = Kind::kFloat;
  p.f = v;
  return p;
}
PyValue PyValue::Str(std::string v) {
  PyValue p;
  p.kind = Kind::kStr;
  p.s = std::move(v);
  return p;
}
PyValue PyValue::List(std::vector<PyValue> v) {
  PyValue p;
  p.kind = Kind::kList;
  p.items = std::move(v);
  return p;
}
PyValue PyValue::Tuple(std::vector<PyValue> v) {
  PyValue p;
  p.kind = Kind::kTuple;
  p.items = std::move(v);
  return p;
}
PyValue PyValue::Dict() {
  PyValue p;
  p.kind = Kind::kDict;
  return p;
}
PyValue& PyValue::Set(std::string key, PyValue value) {
  items.push_back(Str(std::move(key)));
  items.push_back(std::move(value));
  return *this;
}

namespace {

// Pickle protocol 2 opcodes (Python's Lib/pickletools.py documents them).
constexpr char kProto = '\x80';
constexpr char kStop = '.';
constexpr char kNone = 'N';
constexpr char kTrue = '\x88';
constexpr char kFalse = '\x89';
constexpr char kBinInt = 'J';    // 4-byte signed little-endian
constexpr char kLong1 = '\x8a';  // 1-byte length, two's complement little-endian
constexpr char kBinFloat = 'G';  // 8-byte big-endian IEEE 754
constexpr char kBinUnicode = 'X';  // 4-byte little-endian length, UTF-8
constexpr char kEmptyList = ']';
constexpr char kEmptyDict = '}';
constexpr char kMark = '(';
constexpr char kAppends = 'e';
constexpr char kSetItems = 'u';
constexpr char kTuple = 't';

void PutLittle(std::string& out, uint64_t v, int bytes) {
  for (int k = 0; k < bytes; ++k) out.push_back(static_cast<char>((v >> (8 * k)) & 0xff));
}

void Emit(const PyValue& v, std::string& out) {
  using Kind = PyValue::Kind;
  switch (v.kind) {
    case Kind::kNone:
      out.push_back(kNone);
      return;
    case Kind::kBool:
      out.push_back(v.b ? kTrue : kFalse);
      return;
    case Kind::kInt:
      if (v.i >= INT32_MIN && v.i <= INT32_MAX) {
        out.push_back(kBinInt);
        PutLittle(out, static_cast<uint64_t>(static_cast<uint32_t>(static_cast<int32_t>(v.i))), 4);
      } else {
        out.push_back(kLong1);
        out.push_back(8);
        PutLittle(out, static_cast<uint64_t>(v.i), 8);
      }
      return;
    case Kind::kFloat: {
      uint64_t bits;
      static_assert(sizeof(bits) == sizeof(v.f));
      std::memcpy(&bits, &v.f, sizeof(bits));
      out.push_back(kBinFloat);
      for (int k = 7; k >= 0; --k) out.push_back(static_cast<char>((bits >> (8 * k)) & 0xff));
      return;
    }
    case Kind::kStr:
      out.push_back(kBinUnicode);
      PutLittle(out, v.s.size(), 4);
      out += v.s;
      return;
    case Kind::kList:
    case Kind::kDict:
      // An empty container, then (if any) its items from a mark, appended
      // or set in one opcode.
      out.push_back(v.kind == Kind::kList ? kEmptyList : kEmptyDict);
      if (v.items.empty()) return;
      [[fallthrough]];
    case Kind::kTuple: {
      out.push_back(kMark);
      for (const PyValue& item : v.items) Emit(item, out);
      out.push_back(v.kind == Kind::kList ? kAppends : v.kind == Kind::kDict ? kSetItems : kTuple);
      return;
    }
  }
}

// torch's ScalarType names, as the recorder writes dtypes.
const char* TorchDtype(const std::string& dtype) {
  if (dtype == "float32") return "Float";
  if (dtype == "float64") return "Double";
  if (dtype == "float16") return "Half";
  if (dtype == "bfloat16") return "BFloat16";
  if (dtype == "int8") return "Char";
  if (dtype == "uint8") return "Byte";
  if (dtype == "int32") return "Int";
  if (dtype == "int64") return "Long";
  return nullptr;
}

// The profiling name's collective, and the element counts of one rank's
// input and output.
struct Shape {
  const char* name;
  uint64_t in;
  uint64_t out;
};

Shape ShapeOf(const proto::OpTrace& op) {
  // The signature's count is per rank pair for alltoall, the gathered
  // block for allgather and the scattered one for reduce_scatter (as the
  // daemon counts a rank's bytes: engine.cc's OpBytes).
  const std::string& c = op.collective();
  const uint64_t n = op.count();
  const uint64_t all = n * op.world_size();
  if (c == "allreduce" || c == "barrier") return {"all_reduce", n, n};
  if (c == "broadcast") return {"broadcast", n, n};
  if (c == "allgather") return {"all_gather", n, all};
  if (c == "reduce_scatter") return {"_reduce_scatter_base", all, n};
  if (c == "alltoall") return {"all_to_all", all, all};
  if (c == "alltoallv") return {"all_to_all", n, n};
  return {nullptr, 0, 0};
}

PyValue Sizes(uint64_t n) {
  return PyValue::List({PyValue::List({PyValue::Int(static_cast<int64_t>(n))})});
}

}  // namespace

std::string Pickle(const PyValue& value) {
  std::string out;
  out.push_back(kProto);
  out.push_back(2);
  Emit(value, out);
  out.push_back(kStop);
  return out;
}

absl::StatusOr<std::map<int, std::string>> FlightRecorderFiles(const proto::TraceReply& reply,
                                                               const std::string& job,
                                                               int64_t wall_now_ns) {
  std::set<std::string> jobs;
  for (const auto& op : reply.ops()) jobs.insert(op.job_id());
  std::string id = job;
  if (id.empty()) {
    if (jobs.empty()) return absl::NotFoundError("the trace holds no operation");
    if (jobs.size() > 1) {
      return absl::InvalidArgumentError(
          absl::StrCat("the trace holds several jobs (", absl::StrJoin(jobs, ", "),
                       "): name one with --job (the flight-recorder layout is one job's ranks)"));
    }
    id = *jobs.begin();
  } else if (jobs.count(id) == 0) {
    return absl::NotFoundError(absl::StrCat("no operation of job '", id, "' in the trace"));
  }

  // Daemon microseconds -> wall-clock nanoseconds.
  const auto wall_ns = [&](uint64_t daemon_us) {
    return wall_now_ns - (static_cast<int64_t>(reply.now_us()) - static_cast<int64_t>(daemon_us)) *
                             1000;
  };
  std::map<int, std::vector<PyValue>> entries;  // by rank
  uint32_t world_size = 0;
  int64_t last_enqueued = -1, last_started = -1, last_completed = -1;
  std::vector<const proto::OpTrace*> ops;
  for (const auto& op : reply.ops()) {
    if (op.job_id() == id) ops.push_back(&op);
  }
  std::stable_sort(ops.begin(), ops.end(), [](const proto::OpTrace* a, const proto::OpTrace* b) {
    return a->job_seq() < b->job_seq();
  });
  for (const proto::OpTrace* op : ops) {
    world_size = std::max(world_size, op->world_size());
    // A barrier carries no data (its dtype is whatever the SDK left).
    const char* dtype = op->collective() == "barrier" ? "Float" : TorchDtype(op->dtype());
    if (dtype == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat("operation '", op->name(), "': unknown dtype '", op->dtype(), "'"));
    }
    const Shape shape = ShapeOf(*op);
    if (shape.name == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat("operation '", op->name(),
                                                     "': unknown collective '",
                                                     op->collective(), "'"));
    }
    const std::string state = op->state().empty() ? "completed" : op->state();
    const bool completed = state == "completed";
    const auto seq = static_cast<int64_t>(op->job_seq());
    last_enqueued = std::max(last_enqueued, seq);
    if (state != "scheduled") last_started = std::max(last_started, seq);
    if (completed) last_completed = std::max(last_completed, seq);
    for (const auto& arrival : op->arrivals()) {
      std::vector<PyValue>& list = entries[arrival.rank()];
      PyValue e = PyValue::Dict();
      e.Set("record_id", PyValue::Int(static_cast<int64_t>(list.size())));
      e.Set("pg_id", PyValue::Int(0));
      e.Set("process_group", PyValue::Tuple({PyValue::Str(id), PyValue::Str("ciuic job")}));
      e.Set("collective_seq_id", PyValue::Int(seq));
      e.Set("p2p_seq_id", PyValue::Int(0));
      e.Set("op_id", PyValue::Int(seq));
      e.Set("profiling_name", PyValue::Str(absl::StrCat("nccl:", shape.name)));
      e.Set("time_created_ns", PyValue::Int(wall_ns(op->submitted_us() + arrival.after_us())));
      e.Set("duration_ms", completed ? PyValue::Float(static_cast<double>(op->done_us()) / 1000.0)
                                     : PyValue::None());
      e.Set("input_sizes", Sizes(shape.in));
      e.Set("input_dtypes", PyValue::List({PyValue::Str(dtype)}));
      e.Set("output_sizes", Sizes(shape.out));
      e.Set("output_dtypes", PyValue::List({PyValue::Str(dtype)}));
      e.Set("state", PyValue::Str(state));
      e.Set("time_discovered_started_ns",
            op->has_launched_us() ? PyValue::Int(wall_ns(op->submitted_us() + op->launched_us()))
                                  : PyValue::None());
      e.Set("time_discovered_completed_ns",
            completed ? PyValue::Int(wall_ns(op->submitted_us() + op->done_us()))
                      : PyValue::None());
      e.Set("retired", PyValue::Bool(completed));
      e.Set("timeout_ms", PyValue::Int(op->timeout_ms()));
      e.Set("is_p2p", PyValue::Bool(false));
      e.Set("frames", PyValue::List({}));
      list.push_back(std::move(e));
    }
  }
  std::vector<std::string> ranks;
  for (uint32_t r = 0; r < world_size; ++r) ranks.push_back(std::to_string(r));
  PyValue pg = PyValue::Dict();
  pg.Set("name", PyValue::Str(id));
  pg.Set("desc", PyValue::Str("ciuic job"));
  pg.Set("ranks", PyValue::Str(absl::StrCat("[", absl::StrJoin(ranks, ", "), "]")));
  PyValue pg_config = PyValue::Dict();
  pg_config.Set(id, pg);
  PyValue status = PyValue::Dict();
  status.Set("last_enqueued_collective", PyValue::Int(last_enqueued));
  status.Set("last_started_collective", PyValue::Int(last_started));
  status.Set("last_completed_collective", PyValue::Int(last_completed));
  PyValue pg_status = PyValue::Dict();
  pg_status.Set(id, status);

  std::map<int, std::string> files;
  for (auto& [rank, list] : entries) {
    PyValue dump = PyValue::Dict();
    dump.Set("version", PyValue::Str("2.4"));
    dump.Set("pg_config", pg_config);
    dump.Set("pg_status", pg_status);
    dump.Set("entries", PyValue::List(std::move(list)));
    files[rank] = Pickle(dump);
  }
  return files;
}

}  // namespace ciuic::ctl
