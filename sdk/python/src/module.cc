// ciuic._ciuic: the Python binding of the C++ SDK (sdk/include/ciuic/ciuic.h).
//
// Thin on purpose: the pure-Python package `ciuic` (sdk/python/ciuic) adds
// torch support, environment handling and the friendly API; this module maps
// buffers, handles and errors.
//
// Contracts kept here:
// - Collectives take any object with the buffer protocol. The buffer must be
//   C-contiguous (and writable where results land); count and dtype come
//   from its format, or from an explicit `dtype` (for bfloat16, which has no
//   buffer format: pass the bytes as an int16/uint16 view).
// - Every object whose memory an operation uses stays exported (Py_buffer
//   held) until the operation has completed, even if the caller drops its
//   Handle: the communicator keeps a list of pending operations, pruned at
//   each submission and on close.
// - The GIL is released while submitting and while waiting; waits wake every
//   100 ms to run Python signal handlers, so Ctrl-C interrupts a wait with
//   KeyboardInterrupt (the operation itself goes on until the session ends).
// - SDK errors raise the exception built by the factory the package
//   registers (_set_error_factory), i.e. a ciuic.Error subclass per code.
//
// Threads: all entry points are called with the GIL held. close() may race
// with submissions from other threads: a shared_mutex keeps the C++
// Communicator alive while a submission (GIL released) uses it.
#include <Python.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <chrono>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <shared_mutex>
#include <string>
#include <tuple>
#include <vector>

#include "ciuic/ciuic.h"

namespace py = pybind11;

namespace ciuic {
namespace {

// Builds the exception for a Status: set by the package to
// ciuic.errors._make_error(code: int, message: str) -> Error. Leaked on
// purpose (no destructor at interpreter exit).
py::object& ErrorFactory() {
  static auto* factory = new py::object();
  return *factory;
}

[[noreturn]] void ThrowStatus(const Status& s) {
  py::object& factory = ErrorFactory();
  if (factory && !factory.is_none()) {
    py::object exc = factory(static_cast<int>(s.code()), s.message());
    PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(exc.ptr())), exc.ptr());
    throw py::error_already_set();
  }
  throw std::runtime_error(s.ToString());
}

[[noreturn]] void ThrowInvalid(const std::string& message) {
  ThrowStatus(Status(StatusCode::kInvalidArgument, message));
}

// An exported buffer, released when the last operation or handle using it
// lets go. Destroyed with the GIL held (by Python objects or by pruning).
struct View {
  Py_buffer buf{};
  bool held = false;
  View() = default;
  View(const View&) = delete;
  View& operator=(const View&) = delete;
  ~View() {
    if (held) PyBuffer_Release(&buf);
  }
  void* data() const { return buf.buf; }
  size_t bytes() const { return static_cast<size_t>(buf.len); }
};

std::string TypeName(py::handle obj) { return Py_TYPE(obj.ptr())->tp_name; }

std::shared_ptr<View> GetView(py::handle obj, bool writable, const char* what) {
  auto v = std::make_shared<View>();
  const int flags = PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0);
  if (PyObject_GetBuffer(obj.ptr(), &v->buf, flags) == 0) {
    v->held = true;
    return v;
  }
  PyErr_Clear();
  std::string prefix = std::string(what) + " (" + TypeName(obj) + ")";
  if (!PyObject_CheckBuffer(obj.ptr())) {
    ThrowInvalid(prefix +
                 " does not support the buffer protocol: pass a numpy array or a torch CPU "
                 "tensor (through the ciuic package)");
  }
  Py_buffer probe{};
  if (PyObject_GetBuffer(obj.ptr(), &probe, PyBUF_FULL_RO) == 0) {
    const bool contiguous = PyBuffer_IsContiguous(&probe, 'C');
    const bool readonly = probe.readonly;
    PyBuffer_Release(&probe);
    if (!contiguous) {
      ThrowInvalid(prefix +
                   " is not C-contiguous: use numpy.ascontiguousarray() or tensor.contiguous()");
    }
    if (writable && readonly) ThrowInvalid(prefix + " is read-only");
  }
  PyErr_Clear();
  ThrowInvalid(prefix + " cannot be exported as a contiguous buffer");
}

// The SDK dtype of a buffer format (struct module syntax, as numpy exports).
bool FormatToDataType(const char* format, ssize_t itemsize, DataType* out) {
  std::string f = format ? format : "B";
  if (!f.empty() && (f[0] == '@' || f[0] == '=' || f[0] == '<' || f[0] == '|')) f = f.substr(1);
  if (f.size() != 1) return false;
  switch (f[0]) {
    case 'f':
      if (itemsize != 4) return false;
      *out = DataType::kFloat32;
      return true;
    case 'd':
      if (itemsize != 8) return false;
      *out = DataType::kFloat64;
      return true;
    case 'e':
      if (itemsize != 2) return false;
      *out = DataType::kFloat16;
      return true;
    case 'b':
    case 'h':
    case 'i':
    case 'l':
    case 'q':
      if (itemsize == 1) *out = DataType::kInt8;
      else if (itemsize == 4) *out = DataType::kInt32;
      else if (itemsize == 8) *out = DataType::kInt64;
      else return false;
      return true;
    case 'B':
    case 'c':
      *out = DataType::kUInt8;
      return itemsize == 1;
    default:
      return false;
  }
}

// dtype and element count of `v`: from its format, or from `dtype` (a SDK
// dtype name) reading the bytes as that type.
std::pair<DataType, size_t> TypeAndCount(const View& v, const std::optional<std::string>& dtype,
                                         const char* what) {
  DataType dt;
  if (dtype) {
    if (!ParseDataType(*dtype, &dt)) ThrowInvalid("unknown dtype '" + *dtype + "'");
    const size_t size = DataTypeSize(dt);
    if (v.bytes() % size != 0) {
      ThrowInvalid(std::string(what) + ": " + std::to_string(v.bytes()) +
                   " bytes is not a whole number of " + *dtype + " elements");
    }
    return {dt, v.bytes() / size};
  }
  if (!FormatToDataType(v.buf.format, v.buf.itemsize, &dt)) {
    ThrowInvalid(std::string(what) + ": element type '" +
                 (v.buf.format ? v.buf.format : "?") + "' (" + std::to_string(v.buf.itemsize) +
                 " bytes) is not a ciuic dtype (float32, float64, float16, bfloat16, int8, "
                 "uint8, int32, int64)");
  }
  return {dt, v.bytes() / DataTypeSize(dt)};
}

// The input and output of a collective with two buffers of its own sizes:
// views, dtypes and element counts ("<what> input" / "<what> output" in
// errors).
struct InOut {
  std::shared_ptr<View> in, out;
  DataType in_dtype, out_dtype;
  size_t in_count, out_count;
};
InOut GetInOut(py::handle send, py::handle recv, const std::optional<std::string>& dtype,
               const std::string& what) {
  InOut io;
  io.in = GetView(send, false, "input");
  io.out = GetView(recv, true, "output");
  std::tie(io.in_dtype, io.in_count) = TypeAndCount(*io.in, dtype, (what + " input").c_str());
  std::tie(io.out_dtype, io.out_count) = TypeAndCount(*io.out, dtype, (what + " output").c_str());
  return io;
}

ReduceOp ParseOp(const std::string& name) {
  ReduceOp op;
  if (!ParseReduceOp(name, &op)) {
    ThrowInvalid("unknown reduce op '" + name + "' (sum, avg, min, max, prod)");
  }
  return op;
}

OpOptions MakeOptions(const std::string& name, int32_t priority, uint32_t timeout_ms,
                      const std::string& compression = "") {
  OpOptions o;
  o.name = name;
  o.priority = priority;
  o.timeout_ms = timeout_ms;
  o.compression = compression;
  return o;
}

// ------------------------------------------------------------------ Buffer

struct PyBuffer {
  Buffer buffer;
};

// ------------------------------------------------------------------ Handle

struct PyHandle {
  Handle handle;
  std::string name;
  // Keep the exported memory for as long as the handle lives (the pending
  // list keeps it until completion as well).
  std::shared_ptr<View> send;
  std::shared_ptr<View> recv;

  // True once completed (raising its error, if any); false if `timeout`
  // seconds passed first. None: no limit.
  bool Wait(std::optional<double> timeout) {
    using Clock = std::chrono::steady_clock;
    const auto start = Clock::now();
    const auto until =
        timeout ? start + std::chrono::duration_cast<Clock::duration>(
                              std::chrono::duration<double>(std::max(0.0, *timeout)))
                : Clock::time_point::max();
    while (true) {
      Status s;
      bool finished = false;
      {
        py::gil_scoped_release nogil;
        auto left = until - Clock::now();
        auto slice = std::chrono::milliseconds(100);
        if (left < slice) slice = std::chrono::ceil<std::chrono::milliseconds>(
                              std::max(left, Clock::duration::zero()));
        s = handle.WaitFor(slice);
        finished = s.code() != StatusCode::kDeadlineExceeded;
        if (!finished && handle.Test()) {
          // The operation itself ended with DEADLINE_EXCEEDED (or just now).
          s = handle.Wait();
          finished = true;
        }
      }
      if (finished) {
        if (!s.ok()) ThrowStatus(s);
        return true;
      }
      if (PyErr_CheckSignals() != 0) throw py::error_already_set();
      if (Clock::now() >= until) return false;
    }
  }

  bool Test() {
    py::gil_scoped_release nogil;
    return handle.Test();
  }
};

// ------------------------------------------------------------ Communicator

class PyComm {
 public:
  PyComm(std::unique_ptr<Communicator> comm, std::string coordinator)
      : comm_(std::move(comm)), coordinator_(std::move(coordinator)) {
    rank_ = comm_->rank();
    world_size_ = comm_->world_size();
    local_rank_ = comm_->local_rank();
    local_size_ = comm_->local_size();
    job_id_ = comm_->job_id();
    node_name_ = comm_->node_name();
  }

  int rank() const { return rank_; }
  int world_size() const { return world_size_; }
  int local_rank() const { return local_rank_; }
  int local_size() const { return local_size_; }
  const std::string& job_id() const { return job_id_; }
  const std::string& node_name() const { return node_name_; }
  const std::string& coordinator() const { return coordinator_; }
  bool closed() {
    std::shared_lock lock(mu_);
    return comm_ == nullptr;
  }

  PyBuffer Allocate(size_t bytes) {
    PyBuffer out;
    Status s;
    {
      py::gil_scoped_release nogil;
      std::shared_lock lock(mu_);
      s = comm_ ? comm_->Allocate(bytes, &out.buffer) : Closed();
    }
    if (!s.ok()) ThrowStatus(s);
    return out;
  }

  bool IsShared(py::handle obj) {
    auto v = GetView(obj, false, "buffer");
    std::shared_lock lock(mu_);
    return comm_ && v->bytes() > 0 && comm_->IsShared(v->data(), v->bytes());
  }

  PyHandle Allreduce(py::handle send, py::object recv, const std::string& op,
                     std::optional<std::string> dtype, const std::string& name,
                     int32_t priority, uint32_t timeout_ms, const std::string& compression) {
    const ReduceOp rop = ParseOp(op);
    auto rv = GetView(recv.is_none() ? send : recv, true, recv.is_none() ? "tensor" : "output");
    auto sv = recv.is_none() ? rv : GetView(send, false, "input");
    const auto [dt_, count_] = TypeAndCount(*rv, dtype, "allreduce");
    const DataType dt = dt_;
    const size_t count = count_;
    const auto [sdt_, scount_] = TypeAndCount(*sv, dtype, "allreduce");
    const DataType sdt = sdt_;
    const size_t scount = scount_;
    if (sdt != dt || scount != count) {
      ThrowInvalid("allreduce: input and output differ (" + Describe(sdt, scount) + " vs " +
                   Describe(dt, count) + ")");
    }
    const OpOptions o = MakeOptions(name, priority, timeout_ms, compression);
    return Submit(name, sv, rv, [&](Communicator& c) {
      return c.Allreduce(sv->data(), rv->data(), count, dt, rop, o);
    });
  }

  PyHandle ReduceScatter(py::handle send, py::handle recv, const std::string& op,
                         std::optional<std::string> dtype, const std::string& name,
                         int32_t priority, uint32_t timeout_ms, const std::string& compression) {
    const ReduceOp rop = ParseOp(op);
    const InOut io = GetInOut(send, recv, dtype, "reduce_scatter");
    const auto& [sv, rv, sdt, dt, scount, count] = io;
    if (sdt != dt || scount != count * world_size_) {
      ThrowInvalid("reduce_scatter: the input must hold world_size (" +
                   std::to_string(world_size_) + ") times the output's elements of the same "
                   "dtype; input " + Describe(sdt, scount) + ", output " + Describe(dt, count));
    }
    const OpOptions o = MakeOptions(name, priority, timeout_ms, compression);
    return Submit(name, sv, rv, [&](Communicator& c) {
      return c.ReduceScatter(sv->data(), rv->data(), count, dt, rop, o);
    });
  }

  PyHandle Allgather(py::handle send, py::handle recv, std::optional<std::string> dtype,
                     const std::string& name, int32_t priority, uint32_t timeout_ms) {
    const InOut io = GetInOut(send, recv, dtype, "allgather");
    const auto& [sv, rv, dt, rdt, count, rcount] = io;
    if (rdt != dt || rcount != count * world_size_) {
      ThrowInvalid("allgather: the output must hold world_size (" +
                   std::to_string(world_size_) + ") times the input's elements of the same "
                   "dtype; input " + Describe(dt, count) + ", output " + Describe(rdt, rcount));
    }
    const OpOptions o = MakeOptions(name, priority, timeout_ms);
    return Submit(name, sv, rv, [&](Communicator& c) {
      return c.Allgather(sv->data(), rv->data(), count, dt, o);
    });
  }

  PyHandle Alltoall(py::handle send, py::handle recv, std::optional<std::string> dtype,
                    const std::string& name, int32_t priority, uint32_t timeout_ms) {
    const InOut io = GetInOut(send, recv, dtype, "alltoall");
    const auto& [sv, rv, dt, rdt, scount, rcount] = io;
    const size_t world = static_cast<size_t>(world_size_);
    if (rdt != dt || rcount != scount || scount % world != 0) {
      ThrowInvalid("alltoall: input and output must hold the same number of elements of the "
                   "same dtype, a multiple of world_size (" + std::to_string(world_size_) +
                   "); input " + Describe(dt, scount) + ", output " + Describe(rdt, rcount));
    }
    const OpOptions o = MakeOptions(name, priority, timeout_ms);
    return Submit(name, sv, rv, [&](Communicator& c) {
      return c.Alltoall(sv->data(), rv->data(), scount / world, dt, o);
    });
  }

  PyHandle Alltoallv(py::handle send, py::handle recv, const std::vector<size_t>& send_counts,
                     const std::vector<size_t>& recv_counts, std::optional<std::string> dtype,
                     const std::string& name, int32_t priority, uint32_t timeout_ms) {
    const InOut io = GetInOut(send, recv, dtype, "alltoallv");
    const auto& [sv, rv, dt, rdt, scount, rcount] = io;
    const size_t world = static_cast<size_t>(world_size_);
    if (send_counts.size() != world || recv_counts.size() != world) {
      ThrowInvalid("alltoallv: one send and one recv count per rank (" +
                   std::to_string(world_size_) + "); got " + std::to_string(send_counts.size()) +
                   " and " + std::to_string(recv_counts.size()));
    }
    size_t ssum = 0, rsum = 0;
    for (size_t c : send_counts) ssum += c;
    for (size_t c : recv_counts) rsum += c;
    if (rdt != dt || ssum != scount || rsum != rcount) {
      ThrowInvalid("alltoallv: the input must hold the send counts' sum and the output the recv "
                   "counts' sum, of one dtype; input " + Describe(dt, scount) + " for " +
                   std::to_string(ssum) + ", output " + Describe(rdt, rcount) + " for " +
                   std::to_string(rsum));
    }
    const OpOptions o = MakeOptions(name, priority, timeout_ms);
    return Submit(name, sv, rv, [&](Communicator& c) {
      return c.Alltoallv(sv->data(), send_counts, rv->data(), recv_counts, dt, o);
    });
  }

  PyHandle Broadcast(py::handle buffer, int root, std::optional<std::string> dtype,
                     const std::string& name, int32_t priority, uint32_t timeout_ms) {
    if (root < 0 || root >= world_size_) {
      ThrowInvalid("broadcast: root " + std::to_string(root) + " is not in a world of size " +
                   std::to_string(world_size_));
    }
    auto v = GetView(buffer, true, "tensor");
    const auto [dt_, count_] = TypeAndCount(*v, dtype, "broadcast");
    const DataType dt = dt_;
    const size_t count = count_;
    const OpOptions o = MakeOptions(name, priority, timeout_ms);
    return Submit(name, v, v, [&](Communicator& c) {
      return c.Broadcast(v->data(), count, dt, root, o);
    });
  }

  PyHandle Barrier(const std::string& name, int32_t priority, uint32_t timeout_ms) {
    const OpOptions o = MakeOptions(name, priority, timeout_ms);
    return Submit(name, nullptr, nullptr, [&](Communicator& c) { return c.Barrier(o); });
  }

  // A collective on CUDA device memory (torch CUDA tensors: the Python
  // layer passes data_ptr(), the device index and the current stream). The
  // counts are the C++ API's: elements per rank (allreduce, broadcast), of
  // the output (reduce_scatter), of the input (allgather) or per rank pair
  // (alltoall); alltoallv takes send_counts and recv_counts instead. The
  // caller keeps the tensors alive until the operation completes.
  PyHandle DeviceOp(const std::string& collective, uintptr_t send, uintptr_t recv, int device,
                    uint64_t count, const std::string& dtype, const std::string& op, int root,
                    uintptr_t stream, const std::string& name, int32_t priority,
                    uint32_t timeout_ms, const std::string& compression,
                    const std::vector<size_t>& send_counts,
                    const std::vector<size_t>& recv_counts) {
    DataType dt;
    if (!ParseDataType(dtype, &dt)) ThrowInvalid("unknown dtype '" + dtype + "'");
    OpOptions o = MakeOptions(name, priority, timeout_ms, compression);
    o.stream = reinterpret_cast<void*>(stream);
    const DeviceBuffer sb{reinterpret_cast<void*>(send), device};
    const DeviceBuffer rb{reinterpret_cast<void*>(recv), device};
    std::function<Handle(Communicator&)> submit;
    if (collective == "allreduce") {
      const ReduceOp rop = ParseOp(op);
      submit = [=](Communicator& c) { return c.Allreduce(sb, rb, count, dt, rop, o); };
    } else if (collective == "reduce_scatter") {
      const ReduceOp rop = ParseOp(op);
      submit = [=](Communicator& c) { return c.ReduceScatter(sb, rb, count, dt, rop, o); };
    } else if (collective == "allgather") {
      submit = [=](Communicator& c) { return c.Allgather(sb, rb, count, dt, o); };
    } else if (collective == "alltoall") {
      submit = [=](Communicator& c) { return c.Alltoall(sb, rb, count, dt, o); };
    } else if (collective == "alltoallv") {
      submit = [=](Communicator& c) {
        return c.Alltoallv(sb, send_counts, rb, recv_counts, dt, o);
      };
    } else if (collective == "broadcast") {
      if (root < 0 || root >= world_size_) {
        ThrowInvalid("broadcast: root " + std::to_string(root) + " is not in a world of size " +
                     std::to_string(world_size_));
      }
      submit = [=](Communicator& c) { return c.Broadcast(sb, rb, count, dt, root, o); };
    } else {
      ThrowInvalid("unknown collective '" + collective + "' for device buffers");
    }
    return Submit(name, nullptr, nullptr, submit);
  }

  // (operations: [(name, submitted_ns, completed_ns)], dropped), on the
  // host's monotonic clock (time.monotonic_ns()): Communicator::TakeOpTimings.
  py::tuple TakeOpTimings() {
    std::vector<Communicator::OpTiming> timings;
    uint64_t dropped = 0;
    bool open = false;
    {
      py::gil_scoped_release nogil;
      std::shared_lock lock(mu_);
      open = comm_ != nullptr;
      if (open) timings = comm_->TakeOpTimings(&dropped);
    }
    if (!open) ThrowStatus(Closed());
    auto ns = [](std::chrono::steady_clock::time_point t) {
      return static_cast<int64_t>(
          std::chrono::duration_cast<std::chrono::nanoseconds>(t.time_since_epoch()).count());
    };
    py::list out;
    for (const auto& t : timings) out.append(py::make_tuple(t.name, ns(t.submitted), ns(t.completed)));
    return py::make_tuple(out, dropped);
  }

  // Ends the session: pending operations fail (CANCELLED), later calls raise.
  void Close() {
    std::unique_ptr<Communicator> doomed;
    {
      py::gil_scoped_release nogil;
      std::unique_lock lock(mu_);
      doomed = std::move(comm_);
      doomed.reset();  // MarkDead: every pending handle completes
    }
    pending_.clear();
  }

 private:
  struct Pending {
    Handle handle;
    std::shared_ptr<View> send;
    std::shared_ptr<View> recv;
  };

  static Status Closed() {
    return Status(StatusCode::kFailedPrecondition, "the communicator is closed");
  }

  static std::string Describe(DataType dt, size_t count) {
    return std::to_string(count) + " x " + DataTypeName(dt);
  }

  // Drops pending entries whose operation has completed (GIL held on entry).
  void Prune() {
    if (pending_.empty()) return;
    std::vector<Handle> handles;
    handles.reserve(pending_.size());
    for (auto& p : pending_) handles.push_back(p.handle);
    std::vector<char> done(handles.size());
    {
      py::gil_scoped_release nogil;
      for (size_t i = 0; i < handles.size(); ++i) done[i] = handles[i].Test();
    }
    size_t keep = 0;
    for (size_t i = 0; i < pending_.size(); ++i) {
      if (!done[i]) {
        if (keep != i) pending_[keep] = std::move(pending_[i]);
        ++keep;
      }
    }
    pending_.resize(keep);
  }

  template <typename F>
  PyHandle Submit(const std::string& name, std::shared_ptr<View> sv, std::shared_ptr<View> rv,
                  F&& submit) {
    Prune();
    Handle h;
    bool closed = false;
    {
      py::gil_scoped_release nogil;
      std::shared_lock lock(mu_);
      if (comm_) h = submit(*comm_);
      else closed = true;
    }
    if (closed) ThrowStatus(Closed());
    pending_.push_back(Pending{h, sv, rv});
    return PyHandle{h, name, std::move(sv), std::move(rv)};
  }

  std::shared_mutex mu_;                 // comm_: shared to use, unique to close
  std::unique_ptr<Communicator> comm_;   // null once closed
  std::vector<Pending> pending_;         // GIL-protected
  int rank_ = 0, world_size_ = 1, local_rank_ = 0, local_size_ = 1;
  std::string job_id_, node_name_;
  std::string coordinator_;  // as passed to JobOptions (empty: the SDK's default)
};

std::shared_ptr<PyComm> CreateComm(const std::string& socket, const std::string& job, int rank,
                                   int world_size, int local_rank, int local_size,
                                   uint64_t arena_bytes, const std::string& coordinator) {
  JobOptions o;
  o.socket_path = socket;
  o.job_id = job;
  o.rank = rank;
  o.world_size = world_size;
  o.local_rank = local_rank;
  o.local_size = local_size;
  o.arena_bytes = arena_bytes;
  o.coordinator = coordinator;
  std::unique_ptr<Communicator> comm;
  Status s;
  {
    py::gil_scoped_release nogil;
    s = Communicator::Create(o, &comm);
  }
  if (!s.ok()) ThrowStatus(s);
  return std::make_shared<PyComm>(std::move(comm), coordinator);
}

}  // namespace
}  // namespace ciuic

PYBIND11_MODULE(_ciuic, m) {
  using namespace ciuic;
  m.doc() = "ciuic C++ SDK binding; use the `ciuic` package instead of this module";

  m.def("_set_error_factory", [](py::object f) { ErrorFactory() = std::move(f); },
        "Registers f(code: int, message: str) -> Exception, used for every SDK error.");
  m.def("status_code_name", [](int code) {
    return std::string(StatusCodeName(static_cast<StatusCode>(code)));
  });
  m.def("default_socket_path", &DefaultSocketPath,
        "$CIUIC_SOCKET, else /run/ciuic/ciuicd.sock");
  m.def("dtype_size", [](const std::string& name) {
    DataType dt;
    if (!ParseDataType(name, &dt)) ThrowInvalid("unknown dtype '" + name + "'");
    return DataTypeSize(dt);
  });

  py::class_<PyBuffer>(m, "Buffer", py::buffer_protocol(),
                       "Shared memory of a communicator (zero copy). The memory stays valid "
                       "while this object or any view of it lives.")
      .def_buffer([](PyBuffer& b) {
        return py::buffer_info(b.buffer.data(), 1, "B", 1,
                               {static_cast<ssize_t>(b.buffer.size())}, {1});
      })
      .def_property_readonly("address",
                             [](PyBuffer& b) { return reinterpret_cast<uintptr_t>(b.buffer.data()); })
      .def_property_readonly("nbytes", [](PyBuffer& b) { return b.buffer.size(); })
      .def("__len__", [](PyBuffer& b) { return b.buffer.size(); })
      .def_property_readonly("__array_interface__", [](PyBuffer& b) {
        py::dict d;
        d["shape"] = py::make_tuple(b.buffer.size());
        d["typestr"] = "|u1";
        d["data"] = py::make_tuple(reinterpret_cast<uintptr_t>(b.buffer.data()), false);
        d["version"] = 3;
        return d;
      });

  py::class_<PyHandle>(m, "Handle", "An operation in flight.")
      .def("wait", &PyHandle::Wait, py::arg("timeout") = py::none(),
           "Waits until the operation completes (True; raises its error) or `timeout` "
           "seconds pass (False; the operation goes on). Releases the GIL; Ctrl-C interrupts.")
      .def("is_completed", &PyHandle::Test)
      .def_readonly("name", &PyHandle::name);

  py::class_<PyComm, std::shared_ptr<PyComm>>(m, "Communicator")
      .def(py::init(&CreateComm), py::kw_only(), py::arg("socket") = "", py::arg("job"),
           py::arg("rank") = 0, py::arg("world_size") = 1, py::arg("local_rank") = -1,
           py::arg("local_size") = -1, py::arg("arena_bytes") = 0,
           py::arg("coordinator") = "")
      .def_property_readonly("rank", &PyComm::rank)
      .def_property_readonly("world_size", &PyComm::world_size)
      .def_property_readonly("local_rank", &PyComm::local_rank)
      .def_property_readonly("local_size", &PyComm::local_size)
      .def_property_readonly("job_id", &PyComm::job_id)
      .def_property_readonly("node_name", &PyComm::node_name)
      .def_property_readonly("coordinator", &PyComm::coordinator)
      .def_property_readonly("closed", &PyComm::closed)
      .def("allocate", &PyComm::Allocate, py::arg("nbytes"))
      .def("is_shared", &PyComm::IsShared, py::arg("buffer"))
      .def("allreduce", &PyComm::Allreduce, py::arg("send"), py::arg("recv") = py::none(),
           py::kw_only(), py::arg("op") = "sum", py::arg("dtype") = py::none(),
           py::arg("name") = "", py::arg("priority") = 0, py::arg("timeout_ms") = 0,
           py::arg("compression") = "")
      .def("reduce_scatter", &PyComm::ReduceScatter, py::arg("send"), py::arg("recv"),
           py::kw_only(), py::arg("op") = "sum", py::arg("dtype") = py::none(),
           py::arg("name") = "", py::arg("priority") = 0, py::arg("timeout_ms") = 0,
           py::arg("compression") = "")
      .def("allgather", &PyComm::Allgather, py::arg("send"), py::arg("recv"), py::kw_only(),
           py::arg("dtype") = py::none(), py::arg("name") = "", py::arg("priority") = 0,
           py::arg("timeout_ms") = 0)
      .def("alltoall", &PyComm::Alltoall, py::arg("send"), py::arg("recv"), py::kw_only(),
           py::arg("dtype") = py::none(), py::arg("name") = "", py::arg("priority") = 0,
           py::arg("timeout_ms") = 0)
      .def("alltoallv", &PyComm::Alltoallv, py::arg("send"), py::arg("recv"),
           py::arg("send_counts"), py::arg("recv_counts"), py::kw_only(),
           py::arg("dtype") = py::none(), py::arg("name") = "", py::arg("priority") = 0,
           py::arg("timeout_ms") = 0)
      .def("broadcast", &PyComm::Broadcast, py::arg("buffer"), py::kw_only(), py::arg("root"),
           py::arg("dtype") = py::none(), py::arg("name") = "", py::arg("priority") = 0,
           py::arg("timeout_ms") = 0)
      .def("barrier", &PyComm::Barrier, py::kw_only(), py::arg("name") = "",
           py::arg("priority") = 0, py::arg("timeout_ms") = 0)
      .def("device_op", &PyComm::DeviceOp, py::arg("collective"), py::arg("send"),
           py::arg("recv"), py::kw_only(), py::arg("device"), py::arg("count"),
           py::arg("dtype"), py::arg("op") = "sum", py::arg("root") = 0, py::arg("stream") = 0,
           py::arg("name") = "", py::arg("priority") = 0, py::arg("timeout_ms") = 0,
           py::arg("compression") = "", py::arg("send_counts") = std::vector<size_t>(),
           py::arg("recv_counts") = std::vector<size_t>())
      .def("take_op_timings", &PyComm::TakeOpTimings)
      .def("close", &PyComm::Close);
  m.def(
      "device_of",
      [](uintptr_t ptr) {
        int device = 0;
        Status s = DeviceOfPointer(reinterpret_cast<const void*>(ptr), &device);
        if (!s.ok()) ThrowStatus(s);
        return device;
      },
      py::arg("ptr"), "the CUDA device ordinal of the device memory at ptr");
  m.def("sdk_supports_device_buffers", [] {
    std::string why;
    const bool yes = SdkSupportsDeviceBuffers(&why);
    return py::make_tuple(yes, why);
  }, "(True, '') if this libciuic was built with CUDA, else (False, why)");
}
