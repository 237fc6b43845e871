// ciuic-bench: measured bandwidth and latency of ciuic collectives, in the
// nccl-tests format.
//
//   ciuic-bench --op allreduce --nodes 1 --ranks-per-node 2 --sizes 8,64K,16M,256M
//               --dtype float32 --iters 20 --warmup 5 --check [--json] [--socket PATH]
//
// Without --socket it starts a ciuicd of its own (in a temporary directory)
// and stops it at the end. Ranks are processes forked from this one; each
// allocates its buffers once, in shared memory (zero copy), before timing.
// Per size: the median (and the 99th percentile, nearest rank) over
// iterations of the slowest rank's time per operation, algbw = bytes / time, busbw = algbw * the nccl-tests factor
// (allreduce 2(n-1)/n, reduce_scatter, allgather, alltoall and alltoallv
// (n-1)/n, broadcast 1).
// --op alltoallv: a size is what each rank sends in all, cut unevenly as
// routed tokens are between experts: rank i sends rank j a share
// proportional to 1 + ((j - i) mod n), so each rank's largest piece is n
// times its smallest, and every rank still sends and receives the size.
// The first (cold) iteration is reported apart. With --burst K each
// iteration submits K operations of the size at once (each on its own slice
// of the buffers, each with its own name) and waits for all: the time is per
// burst and the bytes are K times the size (tensor fusion's case: many small
// gradients ready together). With --check every rank
// compares its result, element by element, with an expectation computed
// here by plain loops (never by ciuic code).
//
// --device cuda: each rank's buffers are cudaMalloc'd on device
// local_rank % device_count (so both ranks share the GPU of a one-GPU
// machine) and handed to the daemon as device buffers, with the rank's own
// stream; --check copies the inputs up and the results back to the host.
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <signal.h>
#include <sys/stat.h>
#include <sched.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "ciuic/ciuic.h"

#if CIUIC_HAVE_CUDA
#include <cuda_runtime_api.h>
#endif

namespace {

using Clock = std::chrono::steady_clock;

struct Flags {
  std::string op = "allreduce";
  int nodes = 1;
  int ranks_per_node = 2;
  std::vector<uint64_t> sizes = {8, 64 << 10, 16 << 20, 256 << 20};
  ciuic::DataType dtype = ciuic::DataType::kFloat32;
  ciuic::ReduceOp reduce_op = ciuic::ReduceOp::kSum;
  int iters = 20;
  int warmup = 5;
  bool check = false;
  bool json = false;
  std::string socket;
  std::string ciuicd;
  std::string daemon_config;  // --config for the daemons ciuic-bench starts
  std::string compression;    // OpOptions::compression; empty: the daemon's
  bool cuda = false;          // --device cuda
  bool bind_to_core = false;  // --bind-to core: rank r on CPU r mod online CPUs
  // --bind-daemons core: the daemon of node n (started here) on the n-th
  // CPU this process may use, mod their count.
  bool bind_daemons = false;
  int burst = 1;              // operations submitted together per iteration
  bool named = false;         // --named: each operation named by its size and place
};

[[noreturn]] void Usage(const std::string& error) {
  if (!error.empty()) fprintf(stderr, "ciuic-bench: %s\n", error.c_str());
  fprintf(stderr,
          "usage: ciuic-bench [--op allreduce|reduce_scatter|allgather|alltoall|alltoallv|\n"
          "                         broadcast|barrier]\n"
          "                   [--nodes 1] [--ranks-per-node R] [--sizes 8,64K,16M,256M]\n"
          "                   [--dtype float32|float64|float16|bfloat16|int8|uint8|int32|int64]\n"
          "                   [--reduce-op sum|avg|min|max|prod] [--iters N] [--warmup N]\n"
          "                   [--check] [--json] [--socket PATH] [--ciuicd PATH]\n"
          "                   [--daemon-config FILE] [--compression none|fp16|bf16|int8|topk:R]\n"
          "                   [--device cpu|cuda] [--bind-to none|core] [--burst K] [--named]\n"
          "                   [--bind-daemons none|core]\n"
          "Without --socket it starts one ciuicd per node (--ciuicd, $CIUICD, or the build\n"
          "tree's), with --daemon-config as their config file; --bind-daemons core pins\n"
          "node n's daemon to the n-th CPU it may use (several nodes on one host).\n");
  exit(error.empty() ? 0 : 64);
}

bool ParseSize(const std::string& s, uint64_t* out) {
  if (s.empty()) return false;
  char* end = nullptr;
  errno = 0;
  unsigned long long v = strtoull(s.c_str(), &end, 10);
  if (errno != 0 || end == s.c_str()) return false;
  uint64_t mult = 1;
  std::string suffix(end);
  if (suffix == "K" || suffix == "k") mult = 1ull << 10;
  else if (suffix == "M" || suffix == "m") mult = 1ull << 20;
  else if (suffix == "G" || suffix == "g") mult = 1ull << 30;
  else if (!suffix.empty()) return false;
  if (v > std::numeric_limits<uint64_t>::max() / mult) return false;
  *out = v * mult;
  return true;
}

Flags ParseFlags(int argc, char** argv) {
  Flags f;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    std::string v;
    auto eq = a.find('=');
    if (a.rfind("--", 0) == 0 && eq != std::string::npos) {
      v = a.substr(eq + 1);
      a = a.substr(0, eq);
    }
    auto value = [&]() -> std::string {
      if (!v.empty()) return v;
      if (i + 1 >= argc) Usage(a + " needs a value");
      return argv[++i];
    };
    auto integer = [&](int lo, int hi) {
      std::string s = value();
      char* end = nullptr;
      long n = strtol(s.c_str(), &end, 10);
      if (s.empty() || *end != '\0' || n < lo || n > hi) {
        Usage(a + " must be an integer in " + std::to_string(lo) + ".." + std::to_string(hi) +
              ", not '" + s + "'");
      }
      return static_cast<int>(n);
    };
    if (a == "--help" || a == "-h") Usage("");
    else if (a == "--op") f.op = value();
    else if (a == "--nodes") f.nodes = integer(1, 1024);
    else if (a == "--ranks-per-node") f.ranks_per_node = integer(1, 256);
    else if (a == "--iters") f.iters = integer(1, 1000000);
    else if (a == "--warmup") f.warmup = integer(0, 1000000);
    else if (a == "--check") f.check = true;
    else if (a == "--json") f.json = true;
    else if (a == "--socket") f.socket = value();
    else if (a == "--ciuicd") f.ciuicd = value();
    else if (a == "--daemon-config") f.daemon_config = value();
    else if (a == "--burst") f.burst = integer(1, 4096);
    else if (a == "--named") f.named = true;
    else if (a == "--bind-daemons") {
      const std::string v = value();
      if (v != "none" && v != "core") Usage("--bind-daemons takes none or core");
      f.bind_daemons = v == "core";
    }
    else if (a == "--bind-to") {
      const std::string v = value();
      if (v != "none" && v != "core") Usage("--bind-to takes none or core");
      f.bind_to_core = v == "core";
    }
    else if (a == "--device") {
      const std::string d = value();
      if (d != "cpu" && d != "cuda") Usage("unknown device '" + d + "' (cpu, cuda)");
      f.cuda = d == "cuda";
#if !CIUIC_HAVE_CUDA
      if (f.cuda) Usage("--device cuda: this ciuic-bench was built without CUDA");
#endif
    }
    else if (a == "--compression") {
      f.compression = value();
      const std::string& c = f.compression;
      bool ok = c == "none" || c == "fp16" || c == "bf16" || c == "int8";
      if (c.rfind("topk:", 0) == 0) {
        char* end = nullptr;
        double r = strtod(c.c_str() + 5, &end);
        ok = end != c.c_str() + 5 && *end == '\0' && r > 0 && r <= 1;
      }
      if (!ok) Usage("unknown compression codec '" + c + "' (none, fp16, bf16, int8, topk:RATIO)");
    }
    else if (a == "--dtype") {
      std::string s = value();
      if (!ciuic::ParseDataType(s, &f.dtype)) Usage("unknown dtype '" + s + "'");
    } else if (a == "--reduce-op") {
      std::string s = value();
      if (!ciuic::ParseReduceOp(s, &f.reduce_op)) Usage("unknown reduce op '" + s + "'");
    } else if (a == "--sizes") {
      f.sizes.clear();
      std::string s = value();
      size_t pos = 0;
      while (pos <= s.size()) {
        size_t comma = s.find(',', pos);
        std::string item = s.substr(pos, comma == std::string::npos ? std::string::npos
                                                                    : comma - pos);
        uint64_t n;
        if (!ParseSize(item, &n)) Usage("bad size '" + item + "' in --sizes");
        f.sizes.push_back(n);
        if (comma == std::string::npos) break;
        pos = comma + 1;
      }
    } else {
      Usage("unknown argument '" + a + "'");
    }
  }
  static const char* kOps[] = {"allreduce", "reduce_scatter", "allgather", "alltoall",
                               "alltoallv", "broadcast", "barrier"};
  if (std::find_if(std::begin(kOps), std::end(kOps),
                   [&](const char* o) { return f.op == o; }) == std::end(kOps)) {
    Usage("unknown op '" + f.op + "'");
  }
  if (f.nodes > 1 && !f.socket.empty()) {
    Usage("--socket names one daemon; with --nodes > 1 ciuic-bench starts its own daemons");
  }
  if (f.bind_daemons && !f.socket.empty()) {
    Usage("--bind-daemons pins the daemons ciuic-bench starts; with --socket it starts none");
  }
  return f;
}

// ------------------------------------------------------------ reference

// Small integers: exact in every dtype, and their sums over up to 256 ranks
// stay exact in float16/bfloat16 too.
int64_t Pattern(int rank, uint64_t i) {
  return static_cast<int64_t>((i * 2654435761u + static_cast<uint64_t>(rank) * 40503u) % 9) - 4;
}
int64_t PositivePattern(int rank, uint64_t i) {  // for prod: 1 or 2, products stay small
  return ((i + static_cast<uint64_t>(rank)) % 5 == 0) ? 2 : 1;
}

// float16 / bfloat16 encodings of small integers, built by hand.
uint16_t HalfOfSmallInt(int64_t v) {
  if (v == 0) return 0;
  uint16_t sign = v < 0 ? 0x8000 : 0;
  uint64_t m = static_cast<uint64_t>(v < 0 ? -v : v);
  int e = 63 - __builtin_clzll(m);  // m = 1.f * 2^e, exact for |v| < 2048
  uint16_t frac = static_cast<uint16_t>((m << (10 - e)) & 0x3ff);
  return sign | static_cast<uint16_t>((e + 15) << 10) | frac;
}
uint16_t BFloatOfSmallInt(int64_t v) {
  float f = static_cast<float>(v);
  uint32_t bits;
  memcpy(&bits, &f, 4);
  return static_cast<uint16_t>(bits >> 16);  // exact for |v| < 256
}
double HalfToDouble(uint16_t h) {
  int e = (h >> 10) & 0x1f;
  int f = h & 0x3ff;
  double v = e == 0 ? std::ldexp(f, -24) : std::ldexp(1024 + f, e - 25);
  return (h & 0x8000) ? -v : v;
}
double BFloatToDouble(uint16_t b) {
  uint32_t bits = static_cast<uint32_t>(b) << 16;
  float f;
  memcpy(&f, &bits, 4);
  return f;
}

void Store(ciuic::DataType t, void* base, uint64_t i, int64_t v) {
  switch (t) {
    case ciuic::DataType::kFloat32: static_cast<float*>(base)[i] = static_cast<float>(v); break;
    case ciuic::DataType::kFloat64: static_cast<double*>(base)[i] = static_cast<double>(v); break;
    case ciuic::DataType::kFloat16: static_cast<uint16_t*>(base)[i] = HalfOfSmallInt(v); break;
    case ciuic::DataType::kBFloat16: static_cast<uint16_t*>(base)[i] = BFloatOfSmallInt(v); break;
    case ciuic::DataType::kInt8: static_cast<int8_t*>(base)[i] = static_cast<int8_t>(v); break;
    case ciuic::DataType::kUInt8: static_cast<uint8_t*>(base)[i] = static_cast<uint8_t>(v); break;
    case ciuic::DataType::kInt32: static_cast<int32_t*>(base)[i] = static_cast<int32_t>(v); break;
    case ciuic::DataType::kInt64: static_cast<int64_t*>(base)[i] = v; break;
  }
}

double Load(ciuic::DataType t, const void* base, uint64_t i) {
  switch (t) {
    case ciuic::DataType::kFloat32: return static_cast<const float*>(base)[i];
    case ciuic::DataType::kFloat64: return static_cast<const double*>(base)[i];
    case ciuic::DataType::kFloat16: return HalfToDouble(static_cast<const uint16_t*>(base)[i]);
    case ciuic::DataType::kBFloat16: return BFloatToDouble(static_cast<const uint16_t*>(base)[i]);
    case ciuic::DataType::kInt8: return static_cast<const int8_t*>(base)[i];
    case ciuic::DataType::kUInt8: return static_cast<const uint8_t*>(base)[i];
    case ciuic::DataType::kInt32: return static_cast<const int32_t*>(base)[i];
    case ciuic::DataType::kInt64: return static_cast<double>(static_cast<const int64_t*>(base)[i]);
  }
  return 0;
}

bool Unsigned(ciuic::DataType t) { return t == ciuic::DataType::kUInt8; }
bool IsFloat(ciuic::DataType t) {
  return t == ciuic::DataType::kFloat32 || t == ciuic::DataType::kFloat64 ||
         t == ciuic::DataType::kFloat16 || t == ciuic::DataType::kBFloat16;
}

int64_t Input(const Flags& f, int rank, uint64_t i) {
  int64_t v = f.reduce_op == ciuic::ReduceOp::kProd ? PositivePattern(rank, i) : Pattern(rank, i);
  if (Unsigned(f.dtype) && v < 0) v = -v;
  return v;
}

// The expected reduction of element i over all ranks, computed in double.
double Expected(const Flags& f, int ranks, uint64_t i) {
  double acc = static_cast<double>(Input(f, 0, i));
  for (int r = 1; r < ranks; ++r) {
    double v = static_cast<double>(Input(f, r, i));
    switch (f.reduce_op) {
      case ciuic::ReduceOp::kSum:
      case ciuic::ReduceOp::kAvg: acc += v; break;
      case ciuic::ReduceOp::kMin: acc = std::min(acc, v); break;
      case ciuic::ReduceOp::kMax: acc = std::max(acc, v); break;
      case ciuic::ReduceOp::kProd: acc *= v; break;
    }
  }
  if (f.reduce_op == ciuic::ReduceOp::kAvg) {
    acc = IsFloat(f.dtype) ? acc / ranks : std::trunc(acc / ranks);
  }
  return acc;
}

bool Matches(const Flags& f, double got, double want) {
  if (f.reduce_op != ciuic::ReduceOp::kAvg || !IsFloat(f.dtype)) return got == want;
  // avg divides: allow the dtype's rounding.
  double eps = f.dtype == ciuic::DataType::kFloat16 ? 1e-3
               : f.dtype == ciuic::DataType::kBFloat16 ? 8e-3
               : f.dtype == ciuic::DataType::kFloat32 ? 1e-6 : 1e-12;
  return std::fabs(got - want) <= eps * std::max(1.0, std::fabs(want));
}

// ---------------------------------------------------------------- ranks

struct SizeResult {
  double times_us[1];  // variable length: iters entries follow in the pipe
};

// --op alltoallv: elements rank i sends rank j out of `total` that each
// rank sends: shares 1 + ((j - i) mod n) of n(n+1)/2, rounded down, and what
// rounding leaves over to the largest (d = n - 1). Every rank's pieces, and
// every rank's receipts, are then the same multiset: totals of `total`.
uint64_t UnevenCount(int world, uint64_t total, int i, int j) {
  const uint64_t n = static_cast<uint64_t>(world);
  const uint64_t d = static_cast<uint64_t>(((j - i) % world + world) % world);
  const uint64_t shares = n * (n + 1) / 2;
  auto piece = [&](uint64_t w) { return total / shares * w + total % shares * w / shares; };
  uint64_t given = 0;
  for (uint64_t w = 1; w <= n; ++w) given += piece(w);
  return piece(d + 1) + (d == n - 1 ? total - given : 0);
}

// Rank `rank`'s alltoallv counts (send: to each rank; recv: from each).
void UnevenCounts(int world, uint64_t total, int rank, std::vector<size_t>* send,
                  std::vector<size_t>* recv) {
  send->clear();
  recv->clear();
  for (int j = 0; j < world; ++j) {
    send->push_back(UnevenCount(world, total, rank, j));
    recv->push_back(UnevenCount(world, total, j, rank));
  }
}

uint64_t CountFor(const Flags& f, uint64_t bytes, int world) {
  const uint64_t es = ciuic::DataTypeSize(f.dtype);
  uint64_t count = bytes / es;
  if (f.op == "reduce_scatter" || f.op == "allgather" || f.op == "alltoall") {
    count /= static_cast<uint64_t>(world);
  }
  return count;
}

// A rank's two buffers: shared memory (zero copy), or device memory.
struct RankBuffers {
  ciuic::Buffer send_shm, recv_shm;
  void* send_dev = nullptr;
  void* recv_dev = nullptr;
  int device = -1;  // >= 0: device buffers
  void* stream = nullptr;
  bool on_device() const { return device >= 0; }
};

// `offset`: bytes into both buffers (a burst's k-th operation).
ciuic::Handle Launch(ciuic::Communicator& c, const Flags& f, const RankBuffers& b,
                     uint64_t count, uint64_t offset = 0) {
  ciuic::OpOptions o;
  o.compression = f.compression;
  // The same name for the same size and place in every iteration, as a
  // training step names its tensors.
  if (f.named) o.name = "bench." + std::to_string(count) + "." + std::to_string(offset);
  if (b.on_device()) {
    o.stream = b.stream;
    const ciuic::DeviceBuffer send{static_cast<uint8_t*>(b.send_dev) + offset, b.device};
    const ciuic::DeviceBuffer recv{static_cast<uint8_t*>(b.recv_dev) + offset, b.device};
    if (f.op == "allreduce") return c.Allreduce(send, recv, count, f.dtype, f.reduce_op, o);
    if (f.op == "reduce_scatter") return c.ReduceScatter(send, recv, count, f.dtype, f.reduce_op, o);
    if (f.op == "allgather") return c.Allgather(send, recv, count, f.dtype, o);
    if (f.op == "alltoall") return c.Alltoall(send, recv, count, f.dtype, o);
    if (f.op == "alltoallv") {
      std::vector<size_t> sc, rc;
      UnevenCounts(c.world_size(), count, c.rank(), &sc, &rc);
      return c.Alltoallv(send, sc, recv, rc, f.dtype, o);
    }
    if (f.op == "broadcast") return c.Broadcast(send, recv, count, f.dtype, 0, o);
    return c.Barrier(o);
  }
  void* send = static_cast<uint8_t*>(b.send_shm.data()) + offset;
  void* recv = static_cast<uint8_t*>(b.recv_shm.data()) + offset;
  if (f.op == "allreduce") {
    return c.Allreduce(send, recv, count, f.dtype, f.reduce_op, o);
  } else if (f.op == "reduce_scatter") {
    return c.ReduceScatter(send, recv, count, f.dtype, f.reduce_op, o);
  }
  ciuic::OpOptions named;  // what moves data without reducing it takes no codec
  named.name = o.name;
  if (f.op == "allgather") {
    return c.Allgather(send, recv, count, f.dtype, named);
  } else if (f.op == "alltoall") {
    return c.Alltoall(send, recv, count, f.dtype, named);
  } else if (f.op == "alltoallv") {
    std::vector<size_t> sc, rc;
    UnevenCounts(c.world_size(), count, c.rank(), &sc, &rc);
    return c.Alltoallv(send, sc, recv, rc, f.dtype, named);
  } else if (f.op == "broadcast") {
    return c.Broadcast(send, recv, count, f.dtype, 0, named);
  }
  return c.Barrier(named);
}

// Host <-> device copies for --check (synchronous); false and a message on error.
bool CopyToDevice(void* dst, const void* src, size_t bytes) {
#if CIUIC_HAVE_CUDA
  const cudaError_t e = cudaMemcpy(dst, src, bytes, cudaMemcpyHostToDevice);
  if (e == cudaSuccess) return true;
  fprintf(stderr, "ciuic-bench: cudaMemcpy to the device: %s\n", cudaGetErrorString(e));
#endif
  return false;
}
bool CopyToHost(void* dst, const void* src, size_t bytes) {
#if CIUIC_HAVE_CUDA
  const cudaError_t e = cudaMemcpy(dst, src, bytes, cudaMemcpyDeviceToHost);
  if (e == cudaSuccess) return true;
  fprintf(stderr, "ciuic-bench: cudaMemcpy to the host: %s\n", cudaGetErrorString(e));
#endif
  return false;
}

// Fills send with the pattern, runs once, counts wrong elements in recv.
uint64_t CheckOnce(ciuic::Communicator& c, const Flags& f, const RankBuffers& b, uint64_t count,
                   std::string* error, double* rel_error) {
  const int world = c.world_size();
  const int rank = c.rank();
  const uint64_t es = ciuic::DataTypeSize(f.dtype);
  const bool all_to_all = f.op == "alltoall";
  const uint64_t send_elems = f.op == "reduce_scatter" || all_to_all ? count * world : count;
  const uint64_t recv_elems = f.op == "allgather" || all_to_all ? count * world : count;
  // alltoallv: where each sender's piece for this rank lies in its buffer
  // (from) and in this rank's (into); count is each rank's total.
  std::vector<uint64_t> from_at(world, 0), into_at(world + 1, 0);
  for (int i = 0; i < world; ++i) {
    for (int j = 0; j < rank; ++j) from_at[i] += UnevenCount(world, count, i, j);
    into_at[i + 1] = into_at[i] + UnevenCount(world, count, i, rank);
  }
  // Device buffers: the pattern is built here and copied up, the result down.
  std::vector<uint8_t> host_send, host_recv;
  void* send = b.send_shm.data();
  void* recv = b.recv_shm.data();
  if (b.on_device()) {
    host_send.resize(send_elems * es + 1);
    host_recv.resize(recv_elems * es + 1);
    send = host_send.data();
    recv = host_recv.data();
  }
  for (uint64_t i = 0; i < send_elems; ++i) Store(f.dtype, send, i, Input(f, rank, i));
  for (uint64_t i = 0; i < recv_elems; ++i) Store(f.dtype, recv, i, 99);
  if (b.on_device() && (!CopyToDevice(b.send_dev, send, send_elems * es) ||
                        !CopyToDevice(b.recv_dev, recv, recv_elems * es))) {
    *error = "copying the pattern to the device failed";
    return recv_elems;
  }
  ciuic::Status s = Launch(c, f, b, count).Wait();
  if (!s.ok()) {
    *error = s.ToString();
    return recv_elems;
  }
  if (b.on_device() && !CopyToHost(recv, b.recv_dev, recv_elems * es)) {
    *error = "copying the result to the host failed";
    return recv_elems;
  }
  uint64_t wrong = 0;
  double max_err = 0, max_want = 0;
  for (uint64_t i = 0; i < recv_elems; ++i) {
    double want;
    if (f.op == "allreduce") want = Expected(f, world, i);
    else if (f.op == "reduce_scatter") want = Expected(f, world, rank * count + i);
    else if (f.op == "allgather") want = static_cast<double>(Input(f, static_cast<int>(i / count), i % count));
    else if (f.op == "broadcast") want = static_cast<double>(Input(f, 0, i));
    else if (all_to_all) {  // block r from rank r's block for this rank
      want = static_cast<double>(Input(f, static_cast<int>(i / count), rank * count + i % count));
    } else if (f.op == "alltoallv") {  // the piece from rank `from`, in rank order
      const int from = static_cast<int>(
          std::upper_bound(into_at.begin(), into_at.end(), i) - into_at.begin() - 1);
      want = static_cast<double>(Input(f, from, from_at[from] + i - into_at[from]));
    } else break;
    const double got = Load(f.dtype, recv, i);
    if (!Matches(f, got, want)) ++wrong;
    max_err = std::max(max_err, std::fabs(got - want));
    max_want = std::max(max_want, std::fabs(want));
  }
  if (rel_error != nullptr) *rel_error = max_want > 0 ? max_err / max_want : max_err;
  return wrong;
}

// Device buffers of `bytes` each on device local_rank % device_count, zeroed,
// and a stream of the rank's own.
bool AllocateDevice(int local_rank, uint64_t bytes, RankBuffers* b) {
#if CIUIC_HAVE_CUDA
  int devices = 0;
  cudaError_t e = cudaGetDeviceCount(&devices);
  if (e != cudaSuccess || devices == 0) {
    fprintf(stderr, "ciuic-bench: no CUDA device: %s\n",
            e != cudaSuccess ? cudaGetErrorString(e) : "none found");
    return false;
  }
  b->device = local_rank % devices;
  // Whole 2 MiB pages, as PyTorch's caching allocator hands them out.
  bytes = (bytes + (uint64_t{2} << 20) - 1) / (uint64_t{2} << 20) * (uint64_t{2} << 20);
  cudaStream_t stream = nullptr;
  if ((e = cudaSetDevice(b->device)) != cudaSuccess ||
      (e = cudaMalloc(&b->send_dev, bytes)) != cudaSuccess ||
      (e = cudaMalloc(&b->recv_dev, bytes)) != cudaSuccess ||
      (e = cudaMemset(b->send_dev, 0, bytes)) != cudaSuccess ||
      (e = cudaMemset(b->recv_dev, 0, bytes)) != cudaSuccess ||
      (e = cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking)) != cudaSuccess) {
    fprintf(stderr, "ciuic-bench: device buffers of %llu bytes on device %d: %s\n",
            static_cast<unsigned long long>(bytes), b->device, cudaGetErrorString(e));
    return false;
  }
  b->stream = stream;
  return true;
#else
  return false;
#endif
}

// One rank: a child process. Writes, per size, iters+1 doubles (cold time
// first) and one count of wrong elements to `out_fd`.
int RunRank(const Flags& f, const std::string& socket, const std::string& coordinator,
            const std::string& job, int rank, int world, int out_fd) {
  const uint64_t es = ciuic::DataTypeSize(f.dtype);
  uint64_t max_bytes = 0;
  for (uint64_t s : f.sizes) max_bytes = std::max(max_bytes, s);
  max_bytes = max_bytes / es * es + 64;
  ciuic::JobOptions o;
  o.socket_path = socket;
  o.job_id = job;
  o.rank = rank;
  o.world_size = world;
  o.local_rank = rank % f.ranks_per_node;
  o.local_size = f.ranks_per_node;
  o.coordinator = coordinator;
  o.arena_bytes = f.cuda ? (4 << 20) : 2 * max_bytes * f.burst + (4 << 20);
  std::unique_ptr<ciuic::Communicator> comm;
  ciuic::Status s = ciuic::Communicator::Create(o, &comm);
  if (!s.ok()) {
    fprintf(stderr, "ciuic-bench rank %d: %s\n", rank, s.ToString().c_str());
    return 1;
  }
  RankBuffers b;
  if (f.cuda) {
    if (!AllocateDevice(o.local_rank, max_bytes * f.burst, &b)) return 1;
  } else {
    if (!(s = comm->Allocate(max_bytes * f.burst, &b.send_shm)).ok() ||
        !(s = comm->Allocate(max_bytes * f.burst, &b.recv_shm)).ok()) {
      fprintf(stderr, "ciuic-bench rank %d: %s\n", rank, s.ToString().c_str());
      return 1;
    }
    memset(b.send_shm.data(), 0, max_bytes * f.burst);
    memset(b.recv_shm.data(), 0, max_bytes * f.burst);
  }
  for (uint64_t bytes : f.sizes) {
    const uint64_t count = f.op == "barrier" ? 0 : CountFor(f, bytes, world);
    std::vector<double> times;
    times.reserve(f.iters + 1);
    for (int it = 0; it < f.warmup + f.iters + 1; ++it) {
      Clock::time_point t0 = Clock::now();
      if (f.burst == 1) {
        s = Launch(*comm, f, b, count).Wait();
      } else {
        std::vector<ciuic::Handle> burst;
        for (int k = 0; k < f.burst; ++k) {
          burst.push_back(Launch(*comm, f, b, count, static_cast<uint64_t>(k) * max_bytes));
        }
        for (auto& h : burst) {
          ciuic::Status st = h.Wait();
          if (s.ok()) s = st;
        }
      }
      double us = std::chrono::duration<double, std::micro>(Clock::now() - t0).count();
      if (!s.ok()) {
        fprintf(stderr, "ciuic-bench rank %d: %s\n", rank, s.ToString().c_str());
        return 1;
      }
      if (it == 0 || it > f.warmup) times.push_back(us);  // cold, then timed
    }
    double wrong = 0;
    if (f.check) {
      std::string error;
      double rel = 0;
      wrong = static_cast<double>(CheckOnce(*comm, f, b, count, &error, &rel));
      if (!f.compression.empty() && f.compression != "none" && error.empty()) wrong = rel;
      if (!error.empty()) fprintf(stderr, "ciuic-bench rank %d: %s\n", rank, error.c_str());
    }
    times.push_back(wrong);
    const size_t n = times.size() * sizeof(double);
    if (write(out_fd, times.data(), n) != static_cast<ssize_t>(n)) return 1;
  }
  return 0;
}

bool ReadFull(int fd, void* p, size_t n) {
  auto* b = static_cast<uint8_t*>(p);
  while (n > 0) {
    ssize_t got = read(fd, b, n);
    if (got < 0 && errno == EINTR) continue;
    if (got <= 0) return false;
    b += got;
    n -= static_cast<size_t>(got);
  }
  return true;
}

// --------------------------------------------------------------- daemon

std::string SelfDir() {
  char buf[4096];
  ssize_t n = readlink("/proc/self/exe", buf, sizeof(buf) - 1);
  if (n <= 0) return ".";
  buf[n] = '\0';
  std::string p(buf);
  return p.substr(0, p.rfind('/'));
}

std::string FindCiuicd(const Flags& f) {
  if (!f.ciuicd.empty()) return f.ciuicd;
  if (const char* env = getenv("CIUICD"); env && env[0]) return env;
  const std::string dir = SelfDir();
  for (const std::string& c : {dir + "/../../daemon/ciuicd", dir + "/ciuicd"}) {
    if (access(c.c_str(), X_OK) == 0) return c;
  }
  return "ciuicd";  // from PATH
}

// A TCP port on the loopback that nobody listens on right now.
int FreePort() {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(a);
  int port = 0;
  if (bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0 &&
      getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) == 0) {
    port = ntohs(a.sin_port);
  }
  close(fd);
  return port;
}

struct OwnDaemon {
  pid_t pid = -1;
  std::string dir;
  std::string socket;
  std::string peer;  // 127.0.0.1:port

  // `cpu` >= 0: the daemon runs on that CPU alone (all its threads).
  bool Start(const std::string& binary, const std::string& node_name,
             const std::string& config, int cpu) {
    char tmpl[] = "/tmp/ciuic-bench-XXXXXX";
    if (mkdtemp(tmpl) == nullptr) return false;
    dir = tmpl;
    socket = dir + "/ciuicd.sock";
    peer = "127.0.0.1:" + std::to_string(FreePort());
    pid = fork();
    if (pid == 0) {
      if (cpu >= 0) {
        cpu_set_t set;
        CPU_ZERO(&set);
        CPU_SET(cpu, &set);
        if (sched_setaffinity(0, sizeof(set), &set) != 0) {
          fprintf(stderr, "ciuic-bench: cannot pin the daemon to CPU %d: %s\n", cpu,
                  strerror(errno));
          _exit(127);
        }
      }
      std::vector<const char*> argv = {binary.c_str(), "--socket", socket.c_str(), "--node-name",
                                       node_name.c_str(), "--listen", peer.c_str(),
                                       "--log-level", "warn"};
      if (!config.empty()) {
        argv.push_back("--config");
        argv.push_back(config.c_str());
      }
      argv.push_back(nullptr);
      execvp(binary.c_str(), const_cast<char* const*>(argv.data()));
      fprintf(stderr, "ciuic-bench: cannot run %s: %s\n", binary.c_str(), strerror(errno));
      _exit(127);
    }
    // Ready once both sockets exist.
    for (int i = 0; i < 200; ++i) {
      struct stat st;
      if (stat(socket.c_str(), &st) == 0 && stat((socket + ".session").c_str(), &st) == 0) {
        return true;
      }
      int status;
      if (waitpid(pid, &status, WNOHANG) == pid) {
        pid = -1;
        return false;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    return false;
  }

  ~OwnDaemon() {
    if (pid > 0) {
      kill(pid, SIGTERM);
      int status;
      waitpid(pid, &status, 0);
    }
    if (!dir.empty()) rmdir(dir.c_str());
  }
};

double BusFactor(const std::string& op, int n) {
  if (op == "allreduce") return 2.0 * (n - 1) / n;
  if (op == "reduce_scatter" || op == "allgather" || op == "alltoall" || op == "alltoallv") {
    return static_cast<double>(n - 1) / n;
  }
  if (op == "broadcast") return 1.0;
  return 0.0;
}

std::string HumanSize(uint64_t b) {
  char buf[32];
  if (b >= (1ull << 30) && b % (1ull << 30) == 0) snprintf(buf, sizeof(buf), "%lluG", (unsigned long long)(b >> 30));
  else if (b >= (1ull << 20) && b % (1ull << 20) == 0) snprintf(buf, sizeof(buf), "%lluM", (unsigned long long)(b >> 20));
  else if (b >= (1ull << 10) && b % (1ull << 10) == 0) snprintf(buf, sizeof(buf), "%lluK", (unsigned long long)(b >> 10));
  else snprintf(buf, sizeof(buf), "%llu", (unsigned long long)b);
  return buf;
}

}  // namespace

int main(int argc, char** argv) {
  Flags f = ParseFlags(argc, argv);
  const int world = f.nodes * f.ranks_per_node;
  signal(SIGPIPE, SIG_IGN);

  // One daemon per node: the given one, or our own.
  std::vector<std::unique_ptr<OwnDaemon>> own;
  std::vector<std::string> sockets;
  std::string coordinator;
  if (!f.socket.empty()) {
    sockets.push_back(f.socket);
  } else {
    std::string binary = FindCiuicd(f);
    // The CPUs this process may use, in order (--bind-daemons core).
    std::vector<int> cpus;
    if (f.bind_daemons) {
      cpu_set_t mine;
      CPU_ZERO(&mine);
      if (sched_getaffinity(0, sizeof(mine), &mine) == 0) {
        for (int c = 0; c < CPU_SETSIZE; ++c) {
          if (CPU_ISSET(c, &mine)) cpus.push_back(c);
        }
      }
      if (cpus.empty()) {
        fprintf(stderr, "ciuic-bench: --bind-daemons core: cannot read this process's CPUs: %s\n",
                strerror(errno));
        return 1;
      }
    }
    for (int n = 0; n < f.nodes; ++n) {
      own.push_back(std::make_unique<OwnDaemon>());
      const int cpu = cpus.empty() ? -1 : cpus[static_cast<size_t>(n) % cpus.size()];
      if (!own.back()->Start(binary, "bench-node" + std::to_string(n), f.daemon_config, cpu)) {
        fprintf(stderr, "ciuic-bench: could not start %s (use --ciuicd PATH or --socket PATH)\n",
                binary.c_str());
        return 1;
      }
      sockets.push_back(own.back()->socket);
      fprintf(stderr, "ciuic-bench: started %s on %s (peer service %s%s)\n", binary.c_str(),
              own.back()->socket.c_str(), own.back()->peer.c_str(),
              cpu >= 0 ? (", CPU " + std::to_string(cpu)).c_str() : "");
    }
    if (f.nodes > 1) coordinator = own[0]->peer;
  }
  const std::string job = "ciuic-bench-" + std::to_string(getpid()) + "-" +
                          std::to_string(Clock::now().time_since_epoch().count());

  std::vector<pid_t> pids;
  std::vector<int> fds;
  for (int r = 0; r < world; ++r) {
    int p[2];
    if (pipe(p) != 0) return 1;
    pid_t pid = fork();
    if (pid == 0) {
      close(p[0]);
      if (f.bind_to_core) {  // as mpirun --bind-to core places its ranks
        cpu_set_t set;
        CPU_ZERO(&set);
        CPU_SET(r % std::max<long>(1, sysconf(_SC_NPROCESSORS_ONLN)), &set);
        sched_setaffinity(0, sizeof(set), &set);
      }
      _exit(RunRank(f, sockets[r / f.ranks_per_node], coordinator, job, r, world, p[1]));
    }
    close(p[1]);
    pids.push_back(pid);
    fds.push_back(p[0]);
  }

  if (!f.json) {
    printf("# ciuic-bench: op %s, %d node(s) x %d rank(s), dtype %s, reduce op %s, "
           "%d iters after %d warmup, %s buffers\n",
           f.op.c_str(), f.nodes, f.ranks_per_node, ciuic::DataTypeName(f.dtype),
           ciuic::ReduceOpName(f.reduce_op), f.iters, f.warmup,
           f.cuda ? "CUDA device" : "shared-memory");
    printf("# %12s %12s %9s %7s %12s %12s %12s %11s %11s %8s\n", "size(B)", "count", "type",
           "redop", "time(us)", "p99(us)", "cold(us)", "algbw(GB/s)", "busbw(GB/s)",
           (!f.compression.empty() && f.compression != "none") ? "relerr" : "#wrong");
  }
  int failures = 0;
  bool ok = true;
  for (uint64_t bytes : f.sizes) {
    const size_t per_rank = static_cast<size_t>(f.iters) + 2;
    std::vector<double> slowest(f.iters, 0.0);
    double cold = 0;
    double wrong = 0;
    const bool lossy = !f.compression.empty() && f.compression != "none";
    for (int r = 0; r < world && ok; ++r) {
      std::vector<double> v(per_rank);
      if (!ReadFull(fds[r], v.data(), v.size() * sizeof(double))) {
        ok = false;
        break;
      }
      cold = std::max(cold, v[0]);
      for (int i = 0; i < f.iters; ++i) slowest[i] = std::max(slowest[i], v[1 + i]);
      wrong = lossy ? std::max(wrong, v[per_rank - 1]) : wrong + v[per_rank - 1];
    }
    if (!ok) break;
    std::vector<double> sorted = slowest;
    std::sort(sorted.begin(), sorted.end());
    const double med = sorted.size() % 2 ? sorted[sorted.size() / 2]
                                         : (sorted[sorted.size() / 2 - 1] + sorted[sorted.size() / 2]) / 2;
    const size_t rank99 = (99 * sorted.size() + 99) / 100;  // ceil(0.99 n), nearest rank
    const double p99 = sorted[std::max<size_t>(rank99, 1) - 1];
    const uint64_t count = f.op == "barrier" ? 0 : CountFor(f, bytes, world);
    const uint64_t es = ciuic::DataTypeSize(f.dtype);
    const uint64_t moved = f.burst * (f.op == "barrier" ? 0
                                      : (f.op == "reduce_scatter" || f.op == "allgather" ||
                                         f.op == "alltoall")
                                          ? count * es * world
                                          : count * es);
    const double algbw = med > 0 ? moved / (med * 1e3) : 0;  // bytes/us /1e3 = GB/s
    const double busbw = algbw * BusFactor(f.op, world);
    if (f.check && !lossy && wrong > 0) ++failures;
    char check_json[64], check_text[32];
    if (!f.check) {
      snprintf(check_json, sizeof(check_json), "\"errors\":null");
      snprintf(check_text, sizeof(check_text), "n/a");
    } else if (lossy) {
      snprintf(check_json, sizeof(check_json), "\"max_rel_error\":%.3e", wrong);
      snprintf(check_text, sizeof(check_text), "%.2e", wrong);
    } else {
      snprintf(check_json, sizeof(check_json), "\"errors\":%llu", (unsigned long long)wrong);
      snprintf(check_text, sizeof(check_text), "%llu", (unsigned long long)wrong);
    }
    if (f.json) {
      printf("{\"op\":\"%s\",\"dtype\":\"%s\",\"reduce_op\":\"%s\",\"bytes\":%llu,\"count\":%llu,"
             "\"ranks\":%d,\"nodes\":%d,\"time_us\":%.3f,\"p99_us\":%.3f,\"cold_us\":%.3f,"
             "\"algbw_gbps\":%.6g,"
             "\"busbw_gbps\":%.6g,\"compression\":\"%s\",%s}\n",
             f.op.c_str(), ciuic::DataTypeName(f.dtype), ciuic::ReduceOpName(f.reduce_op),
             (unsigned long long)moved, (unsigned long long)count, world, f.nodes, med, p99, cold,
             algbw, busbw, f.compression.empty() ? "default" : f.compression.c_str(), check_json);
    } else {
      printf("  %12llu %12llu %9s %7s %12.2f %12.2f %12.2f %11.3f %11.3f %8s\n",
             (unsigned long long)moved, (unsigned long long)count, ciuic::DataTypeName(f.dtype),
             ciuic::ReduceOpName(f.reduce_op), med, p99, cold, algbw, busbw, check_text);
    }
    fflush(stdout);
    fprintf(stderr, "ciuic-bench: %s done\n", HumanSize(bytes).c_str());
  }
  int rank_failures = 0;
  for (pid_t pid : pids) {
    int status = 0;
    waitpid(pid, &status, 0);
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) ++rank_failures;
  }
  for (int fd : fds) close(fd);
  if (!ok || rank_failures > 0) {
    fprintf(stderr, "ciuic-bench: %d rank(s) failed\n", rank_failures);
    return 1;
  }
  if (failures > 0) {
    fprintf(stderr, "ciuic-bench: %d size(s) with wrong results\n", failures);
    return 2;
  }
  return 0;
}
