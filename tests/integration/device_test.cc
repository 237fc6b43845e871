// Device (CUDA) buffers through a real ciuicd: two and three trainer
// processes with cudaMalloc'd buffers, every collective x dtype x reduce op
// x size class (in place too), against the independent reference; and the
// clear error a trainer gets where there is no CUDA. The GPU tests skip
// with a message on machines without a usable GPU (CI).
//
// Multi-node (two daemons on this host): allreduces reduced on the GPU and
// staged in segments, compressed ones encoded on the GPU; the other
// collectives through pinned host copies.
//
// The test process never initialises CUDA itself (its forked ranks could
// not use it then): a forked child asks whether there is a device.
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "ciuic/ciuic.h"
#include "common.h"
#include "harness.h"
#include "raw_session.h"
#include "reference.h"

#if CIUIC_HAVE_CUDA
#include <cuda_runtime_api.h>
#endif

namespace ciuic::testing {
namespace {

// Empty if a forked child sees a CUDA device, else why not.
std::string WhyNoGpu() {
#if CIUIC_HAVE_CUDA
  auto codes = RunRanks(1, [](int) {
    int n = 0;
    return cudaGetDeviceCount(&n) == cudaSuccess && n > 0 ? 0 : 1;
  });
  return codes[0] == 0 ? "" : "no CUDA device (cudaGetDeviceCount found none usable)";
#else
  return "this build has no CUDA (CIUIC_CUDA=OFF or no toolkit)";
#endif
}

// Skips the test without a usable GPU, or fails it where one is required
// (CIUIC_REQUIRE_GPU=1, as tools/gpu-check.sh sets: a skip there would pass
// while testing nothing).
#define SKIP_WITHOUT_GPU()                                                        \
  do {                                                                            \
    const std::string why_ = WhyNoGpu();                                          \
    if (!why_.empty()) {                                                          \
      const char* required_ = std::getenv("CIUIC_REQUIRE_GPU");                   \
      if (required_ != nullptr && std::string(required_) == "1") FAIL() << why_;  \
      GTEST_SKIP() << why_;                                                       \
    }                                                                             \
  } while (0)

std::unique_ptr<Communicator> Join(const std::string& socket, const std::string& job, int rank,
                                   int world) {
  JobOptions o;
  o.socket_path = socket;
  o.job_id = job;
  o.rank = rank;
  o.world_size = world;
  o.arena_bytes = 16 << 20;
  std::unique_ptr<Communicator> c;
  Status s = Communicator::Create(o, &c);
  if (!s.ok()) fprintf(stderr, "rank %d: Create: %s\n", rank, s.ToString().c_str());
  return c;
}

// Without CUDA (in the SDK or on the machine) a device buffer gets a clear
// FAILED_PRECONDITION, and the session goes on working.
TEST(DeviceBuffersTest, ClearErrorWithoutCuda) {
  const std::string no_gpu = WhyNoGpu();
  if (no_gpu.empty()) GTEST_SKIP() << "a CUDA device is present: the GPU tests cover this path";
  auto daemon = DaemonProcess::Start();
  ASSERT_NE(daemon, nullptr);
  const std::string job = UniqueJobId("nocuda");
  auto codes = RunRanks(1, [&](int rank) {
    auto comm = Join(daemon->socket(), job, rank, 1);
    CHILD_CHECK(comm != nullptr, "join");
    float x[4] = {1, 2, 3, 4};
    OpOptions o;
    o.name = "dev";
    Status s = comm->Allreduce(DeviceBuffer{x, 0}, DeviceBuffer{x, 0}, 4, DataType::kFloat32,
                               ReduceOp::kSum, o).Wait();
    std::string why;
    const bool sdk_cuda = SdkSupportsDeviceBuffers(&why);
    const char* words = sdk_cuda ? "no CUDA device" : "built without CUDA";
    CHILD_CHECK(s.code() == StatusCode::kFailedPrecondition &&
                    s.message().find(words) != std::string::npos &&
                    s.message().find("operation 'dev'") != std::string::npos,
                "got %s", s.ToString().c_str());
    CHILD_CHECK(sdk_cuda || why.find("built without CUDA") != std::string::npos, "%s",
                why.c_str());
    // Alltoallv too (its counts staged in the arena first), named.
    float y[4] = {};
    o.name = "devv";
    s = comm->Alltoallv(DeviceBuffer{x, 0}, {4}, DeviceBuffer{y, 0}, {4}, DataType::kFloat32, o)
            .Wait();
    CHILD_CHECK(s.code() == StatusCode::kFailedPrecondition &&
                    s.message().find(words) != std::string::npos &&
                    s.message().find("operation 'devv'") != std::string::npos,
                "alltoallv got %s", s.ToString().c_str());
    // The communicator still works on host memory.
    s = comm->Allreduce(x, x, 4, DataType::kFloat32, ReduceOp::kSum).Wait();
    CHILD_CHECK(s.ok() && x[3] == 4, "host allreduce after: %s", s.ToString().c_str());
    return 0;
  });
  EXPECT_EQ(codes[0], 0);
  EXPECT_TRUE(daemon->Alive());
  EXPECT_EQ(daemon->Stop(), 0);
}

#if CIUIC_HAVE_CUDA

#define CUDA_CHECK(call)                                                                  \
  do {                                                                                    \
    cudaError_t e_ = (call);                                                              \
    CHILD_CHECK(e_ == cudaSuccess, "%s: %s", #call, cudaGetErrorString(e_));              \
  } while (0)

// `coll` on device buffers (broadcast from `root`).
Handle SubmitDevice(Communicator& comm, Coll coll, DeviceBuffer s, DeviceBuffer r, size_t count,
                    DataType t, ReduceOp op, int root, const OpOptions& opts) {
  switch (coll) {
    case Coll::kAllreduce: return comm.Allreduce(s, r, count, t, op, opts);
    case Coll::kReduceScatter: return comm.ReduceScatter(s, r, count, t, op, opts);
    case Coll::kAllgather: return comm.Allgather(s, r, count, t, opts);
    case Coll::kBroadcast: break;
    case Coll::kAlltoall: return comm.Alltoall(s, r, count, t, opts);
  }
  return comm.Broadcast(s, r, count, t, root, opts);
}

// A rank's device memory for a whole test, allocated once and reused as
// PyTorch's caching allocator reuses its segments: at least 2 MiB each (the
// driver may serve smaller cudaMallocs from a shared block, which CUDA IPC
// then shares whole; the daemon refuses those it cannot place).
struct DeviceMemory {
  uint8_t* send = nullptr;
  uint8_t* recv = nullptr;
  size_t bytes = 0;
};

int AllocateDeviceMemory(size_t bytes, DeviceMemory* m) {
  m->bytes = std::max<size_t>(bytes, size_t{2} << 20);
  CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&m->send), m->bytes));
  CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&m->recv), m->bytes));
  return 0;
}

int FreeDeviceMemory(DeviceMemory* m) {
  CUDA_CHECK(cudaFree(m->send));
  CUDA_CHECK(cudaFree(m->recv));
  *m = DeviceMemory();
  return 0;
}

// One rank, one operation on device buffers in `mem`. The input is copied
// to the device on `stream` without synchronising: the daemon must wait for
// it through the submission's event.
int RunOneDevice(Communicator& comm, int device, cudaStream_t stream, const DeviceMemory& mem,
                 Coll coll, DataType t, ReduceOp op, size_t count, bool in_place,
                 const std::string& name) {
  const int world = comm.world_size();
  const int rank = comm.rank();
  const size_t es = DataTypeSize(t);
  const bool a2a = coll == Coll::kAlltoall;
  const size_t send_count = coll == Coll::kReduceScatter || a2a ? count * world : count;
  const size_t recv_count = coll == Coll::kAllgather || a2a ? count * world : count;
  in_place = in_place && !a2a;  // alltoall is never in place
  std::vector<uint8_t> host(send_count * es + 1);
  FillInput(t, op, rank, host.data(), send_count);
  CHILD_CHECK(send_count * es <= mem.bytes && recv_count * es <= mem.bytes, "%s: %zu bytes",
              name.c_str(), mem.bytes);
  uint8_t* send = mem.send;
  uint8_t* recv = mem.recv;
  CUDA_CHECK(cudaMemsetAsync(recv, 0x5a, recv_count * es, stream));
  uint8_t* send_arg = send;
  uint8_t* recv_arg = recv;
  if (in_place) {
    if (coll == Coll::kAllreduce || coll == Coll::kBroadcast) {
      recv_arg = send;
    } else if (coll == Coll::kReduceScatter) {
      recv_arg = send + rank * count * es;
    } else {
      send_arg = recv + rank * count * es;
    }
  }
  CUDA_CHECK(cudaMemcpyAsync(send_arg, host.data(), send_count * es, cudaMemcpyHostToDevice,
                             stream));
  OpOptions opts;
  opts.name = name;
  opts.stream = stream;
  const int root = world - 1;
  const DeviceBuffer s{send_arg, device};
  const DeviceBuffer r{recv_arg, device};
  Status st = SubmitDevice(comm, coll, s, r, count, t, op, root, opts).Wait();
  CHILD_CHECK(st.ok(), "%s: %s", name.c_str(), st.ToString().c_str());
  std::vector<uint8_t> got(recv_count * es + 1);
  const uint8_t* out = in_place && coll == Coll::kAllgather ? recv : recv_arg;
  CUDA_CHECK(cudaMemcpy(got.data(), out, recv_count * es, cudaMemcpyDeviceToHost));
  const std::vector<uint8_t> want = ReferenceCollective(
      coll, t, op, world, rank, root, count,
      [&](int q, void* o, size_t n) { FillInput(t, op, q, o, n); });
  for (size_t i = 0; i < recv_count; ++i) {
    CHILD_CHECK(std::memcmp(got.data() + i * es, want.data() + i * es, es) == 0,
                "%s rank %d: element %zu of %zu differs from the reference", name.c_str(), rank,
                i, recv_count);
  }
  return 0;
}

// One rank's alltoallv on device buffers in `mem`, rank i sending
// UnevenCounts(i, j, pattern, scale) elements to rank j; checked as the host
// alltoallv is (CheckAlltoallvResult).
int RunOneDeviceAlltoallv(Communicator& comm, int device, cudaStream_t stream,
                          const DeviceMemory& mem, DataType t, int pattern, size_t scale,
                          const std::string& name) {
  const int world = comm.world_size();
  const int rank = comm.rank();
  const size_t es = DataTypeSize(t);
  auto counts = [&](int i, int j) { return UnevenCounts(i, j, pattern, scale); };
  std::vector<size_t> send_counts, recv_counts;
  size_t send_total = 0, recv_total = 0;
  AlltoallvCountsOf(counts, world, rank, &send_counts, &recv_counts, &send_total, &recv_total);
  CHILD_CHECK(send_total * es <= mem.bytes && (recv_total + 1) * es <= mem.bytes, "%s: %zu bytes",
              name.c_str(), mem.bytes);
  std::vector<uint8_t> host(send_total * es + 1);
  FillInput(t, ReduceOp::kSum, rank, host.data(), send_total, pattern);
  CUDA_CHECK(cudaMemsetAsync(mem.recv, 0x5a, (recv_total + 1) * es, stream));
  CUDA_CHECK(cudaMemcpyAsync(mem.send, host.data(), send_total * es, cudaMemcpyHostToDevice,
                             stream));
  OpOptions opts;
  opts.name = name;
  opts.stream = stream;
  Status st = comm.Alltoallv(DeviceBuffer{mem.send, device}, send_counts,
                             DeviceBuffer{mem.recv, device}, recv_counts, t, opts).Wait();
  CHILD_CHECK(st.ok(), "%s: %s", name.c_str(), st.ToString().c_str());
  std::vector<uint8_t> got((recv_total + 1) * es);
  // Read on the stream: an operation that moves nothing records no event,
  // so only the stream orders the memset above before this read (a
  // cudaMemcpy on the default stream raced it: the emulated GPU's run
  // caught the guard element unset).
  CUDA_CHECK(cudaMemcpyAsync(got.data(), mem.recv, got.size(), cudaMemcpyDeviceToHost, stream));
  CUDA_CHECK(cudaStreamSynchronize(stream));
  return CheckAlltoallvResult(t, counts, world, rank, got.data(), recv_total, pattern, name);
}

// Alltoallv on device buffers: a few dtypes, every UnevenCounts pattern
// (nothing at all, one element, empty pairs, a rank sending nothing, rank 0
// moving nothing).
int RunDeviceAlltoallvs(Communicator& comm, int device, cudaStream_t stream,
                        const DeviceMemory& mem, const std::string& prefix) {
  for (DataType t : {DataType::kFloat32, DataType::kBFloat16, DataType::kInt64}) {
    for (int pattern = 0; pattern < kUnevenPatterns; ++pattern) {
      const std::string name =
          prefix + "a2av/" + DataTypeName(t) + "/" + std::to_string(pattern);
      if (RunOneDeviceAlltoallv(comm, device, stream, mem, t, pattern, 10007, name) != 0) {
        return 1;
      }
    }
  }
  return 0;
}

int RunDeviceMatrix(const std::string& socket, const std::string& job, int rank, int world) {
  int devices = 0;
  CUDA_CHECK(cudaGetDeviceCount(&devices));
  const int device = rank % devices;
  CUDA_CHECK(cudaSetDevice(device));
  cudaStream_t stream = nullptr;
  CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  auto comm = Join(socket, job, rank, world);
  CHILD_CHECK(comm != nullptr, "join");
  const size_t kCounts[] = {0, 1, 7, 1001, 262147};
  DeviceMemory mem;
  if (AllocateDeviceMemory(262147 * 8 * static_cast<size_t>(world), &mem) != 0) return 1;
  // First, on sessions that have opened nothing yet: an alltoallv in which
  // rank 0 moves nothing (no buffer of its own to open), then everything else.
  if (RunOneDeviceAlltoallv(*comm, device, stream, mem, DataType::kFloat32, 4, 1001,
                            "a2av/first") != 0) {
    return 1;
  }
  int combo = 0;
  for (Coll coll : {Coll::kAllreduce, Coll::kReduceScatter, Coll::kAllgather, Coll::kBroadcast,
                    Coll::kAlltoall}) {
    const bool reduces = coll == Coll::kAllreduce || coll == Coll::kReduceScatter;
    for (DataType t : kAllDataTypes) {
      for (ReduceOp op : kAllReduceOps) {
        if (!reduces && op != ReduceOp::kSum) continue;
        for (size_t count : kCounts) {
          const bool in_place = ++combo % 3 == 0;
          const std::string name = std::string(CollName(coll)) + "/" + DataTypeName(t) + "/" +
                                   ReduceOpName(op) + "/" + std::to_string(count) +
                                   (in_place ? "/inplace" : "");
          if (RunOneDevice(*comm, device, stream, mem, coll, t, op, count, in_place, name) !=
              0) {
            return 1;
          }
        }
      }
    }
  }
  if (RunDeviceAlltoallvs(*comm, device, stream, mem, "") != 0) return 1;
  // A host operation after the device ones, and a mixed one: rank 0 on the
  // device, the others on the host, which fails on every rank naming it.
  float x = 1;
  Status s = comm->Allreduce(&x, &x, 1, DataType::kFloat32, ReduceOp::kSum).Wait();
  CHILD_CHECK(s.ok() && x == world, "host allreduce: %s", s.ToString().c_str());
  float* d = reinterpret_cast<float*>(mem.send);
  OpOptions o;
  o.name = "mixed";
  float xs[4] = {};
  s = rank == 0 ? comm->Allreduce(DeviceBuffer{d, device}, DeviceBuffer{d, device}, 4,
                                  DataType::kFloat32, ReduceOp::kSum, o).Wait()
                : comm->Allreduce(xs, xs, 4, DataType::kFloat32, ReduceOp::kSum, o).Wait();
  CHILD_CHECK(world == 1 || (!s.ok() && s.message().find("'mixed' mismatched") !=
                                            std::string::npos &&
                             s.message().find("in CUDA device memory") != std::string::npos),
              "mixed host/device: %s", s.ToString().c_str());
  // Nobody leaves before every rank has had its answer for 'mixed': a rank
  // that leaves fails the job, and a rank that submits 'mixed' after that
  // gets the job's failure instead of the mismatch. (The mismatch fails
  // the operation, not the job.)
  float y = 1;
  s = comm->Allreduce(&y, &y, 1, DataType::kFloat32, ReduceOp::kSum).Wait();
  CHILD_CHECK(s.ok() && y == world, "host allreduce after the mismatch: %s",
              s.ToString().c_str());
  if (FreeDeviceMemory(&mem) != 0) return 1;
  CUDA_CHECK(cudaStreamDestroy(stream));
  return 0;
}

class DeviceCollectivesTest : public ::testing::TestWithParam<int> {};

TEST_P(DeviceCollectivesTest, EveryCollectiveDtypeOpAndSizeMatchesTheReference) {
  SKIP_WITHOUT_GPU();
  auto daemon = DaemonProcess::Start();
  ASSERT_NE(daemon, nullptr);
  const int world = GetParam();
  const std::string job = UniqueJobId("device");
  auto codes = RunRanks(world, [&](int rank) {
    return RunDeviceMatrix(daemon->socket(), job, rank, world);
  });
  for (int r = 0; r < world; ++r) EXPECT_EQ(codes[r], 0) << "rank " << r;
  if (HasFailure()) fprintf(stderr, "%s\n", daemon->Log().c_str());
  EXPECT_EQ(daemon->Stop(), 0);
}

INSTANTIATE_TEST_SUITE_P(Ranks, DeviceCollectivesTest, ::testing::Values(1, 2, 3));

// Trainers free buffers and allocate new ones, which the driver may place
// at the addresses of the old ones (PyTorch does after empty_cache or an
// out-of-memory retry): the daemon, which still has the old allocations
// open, drops those no operation uses and opens the new ones. Then one
// small allocation (which the driver may serve from a shared block): a
// right result or the clear refusal, never a wrong one.
TEST(DeviceBuffersTest, NewAllocationsAtFreedAddressesAndSmallAllocations) {
  SKIP_WITHOUT_GPU();
  auto daemon = DaemonProcess::Start();
  ASSERT_NE(daemon, nullptr);
  const std::string job = UniqueJobId("realloc");
  constexpr int kWorld = 2;
  auto codes = RunRanks(kWorld, [&](int rank) {
    CUDA_CHECK(cudaSetDevice(0));
    cudaStream_t stream = nullptr;
    CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    auto comm = Join(daemon->socket(), job, rank, kWorld);
    CHILD_CHECK(comm != nullptr, "join");
    for (int i = 0; i < 24; ++i) {
      DeviceMemory mem;
      if (AllocateDeviceMemory(size_t{4} << 20, &mem) != 0) return 1;
      const std::string name = "realloc/" + std::to_string(i);
      if (RunOneDevice(*comm, 0, stream, mem, Coll::kAllreduce, DataType::kFloat32,
                       ReduceOp::kSum, 1000 + 7 * i, false, name) != 0) {
        return 1;
      }
      if (FreeDeviceMemory(&mem) != 0) return 1;
    }
    float* small = nullptr;
    CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&small), 4096));
    std::vector<float> host(1024, static_cast<float>(rank + 1));
    CUDA_CHECK(cudaMemcpy(small, host.data(), 4096, cudaMemcpyHostToDevice));
    OpOptions o;
    o.name = "small";
    Status st = comm->Allreduce(DeviceBuffer{small, 0}, DeviceBuffer{small, 0}, 1024,
                                DataType::kFloat32, ReduceOp::kSum, o).Wait();
    if (st.ok()) {
      CUDA_CHECK(cudaMemcpy(host.data(), small, 4096, cudaMemcpyDeviceToHost));
      for (float v : host) CHILD_CHECK(v == 3.0f, "small allocation: %g", v);
      fprintf(stderr, "rank %d: a 4 KiB cudaMalloc allocation works\n", rank);
    } else {
      CHILD_CHECK(st.message().find("2 MiB") != std::string::npos, "small allocation: %s",
                  st.ToString().c_str());
      fprintf(stderr, "rank %d: a 4 KiB cudaMalloc allocation is refused: %s\n", rank,
              st.ToString().c_str());
    }
    CUDA_CHECK(cudaFree(small));
    CUDA_CHECK(cudaStreamDestroy(stream));
    return 0;
  });
  for (int r = 0; r < kWorld; ++r) EXPECT_EQ(codes[r], 0) << "rank " << r;
  if (HasFailure()) fprintf(stderr, "%s\n", daemon->Log().c_str());
  EXPECT_TRUE(daemon->Alive());
  EXPECT_EQ(daemon->Stop(), 0);
}

// Holds the stream it was enqueued on until *arg (a std::atomic<bool>) is
// set, as a trainer kernel that does not end would; 30 s at most.
void CUDART_CB HoldStream(void* arg) {
  auto* release = static_cast<std::atomic<bool>*>(arg);
  for (int i = 0; i < 30000 && !release->load(); ++i) usleep(1000);
}

std::vector<float> Download(const uint8_t* p, size_t count) {
  std::vector<float> v(count);
  if (cudaMemcpy(v.data(), p, count * 4, cudaMemcpyDeviceToHost) != cudaSuccess) v.clear();
  return v;
}

// Two ranks of a job on GPU 0 of one daemon, each with a stream of its own
// and 4 MiB send and receive buffers whose first `count` floats hold
// `send_value` (rank + 1 where negative) and -7; rank 1's stream is held
// (HoldStream) until the body sets `release`. The body (0: fine) must set
// it; each rank's exit code is expected to be 0, the daemon to stop cleanly.
struct StuckRank {
  int rank = 0;
  cudaStream_t stream = nullptr;
  std::unique_ptr<Communicator> comm;
  DeviceMemory mem;
  std::atomic<bool> release{false};
};
constexpr size_t kStuckCount = 1000;

void RunWithRank1Stuck(const char* job_prefix, float send_value,
                       const std::function<int(StuckRank&)>& body) {
  auto daemon = DaemonProcess::Start();
  ASSERT_NE(daemon, nullptr);
  const std::string job = UniqueJobId(job_prefix);
  constexpr int kWorld = 2;
  auto codes = RunRanks(kWorld, [&](int rank) {
    StuckRank me;
    me.rank = rank;
    CUDA_CHECK(cudaSetDevice(0));
    CUDA_CHECK(cudaStreamCreateWithFlags(&me.stream, cudaStreamNonBlocking));
    me.comm = Join(daemon->socket(), job, rank, kWorld);
    CHILD_CHECK(me.comm != nullptr, "join");
    if (AllocateDeviceMemory(size_t{4} << 20, &me.mem) != 0) return 1;
    std::vector<float> mine(kStuckCount, send_value < 0 ? rank + 1.0f : send_value);
    std::vector<float> sentinel(kStuckCount, -7.0f);
    CUDA_CHECK(cudaMemcpy(me.mem.send, mine.data(), kStuckCount * 4, cudaMemcpyHostToDevice));
    CUDA_CHECK(cudaMemcpy(me.mem.recv, sentinel.data(), kStuckCount * 4, cudaMemcpyHostToDevice));
    if (rank == 1) CUDA_CHECK(cudaLaunchHostFunc(me.stream, HoldStream, &me.release));
    const int code = body(me);
    me.release = true;
    CUDA_CHECK(cudaStreamSynchronize(me.stream));
    if (code != 0 || FreeDeviceMemory(&me.mem) != 0) return 1;
    CUDA_CHECK(cudaStreamDestroy(me.stream));
    return 0;
  });
  for (int r = 0; r < kWorld; ++r) EXPECT_EQ(codes[r], 0) << "rank " << r;
  if (::testing::Test::HasFailure()) fprintf(stderr, "%s\n", daemon->Log().c_str());
  EXPECT_TRUE(daemon->Alive());
  EXPECT_EQ(daemon->Stop(), 0);
}

Handle AllreduceOn(StuckRank& me, const OpOptions& o) {
  return me.comm->Allreduce(DeviceBuffer{me.mem.send, 0}, DeviceBuffer{me.mem.recv, 0}, kStuckCount,
                            DataType::kFloat32, ReduceOp::kSum, o);
}

double SecondsSince(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

// A trainer whose stream never reaches its submission (here: held by a host
// function) gets DEADLINE_EXCEEDED at the operation's timeout, naming its
// stream, and so does the other rank; nothing of the operation ran (the
// receive buffers keep what they had, also once the stream goes on), and
// the job's next operation works.
TEST(DeviceBuffersTest, AStuckTrainerStreamTimesOutClearlyAndNothingRuns) {
  SKIP_WITHOUT_GPU();
  RunWithRank1Stuck("stuck", -1, [](StuckRank& me) {
    const int rank = me.rank;
    OpOptions o;
    o.name = "stuck";
    o.stream = me.stream;
    o.timeout_ms = 500;
    // Both ranks submit at about the same time (the deadline is the first
    // submission's).
    CHILD_CHECK(me.comm->Barrier().Wait().ok(), "barrier");
    const auto start = std::chrono::steady_clock::now();
    Status st = AllreduceOn(me, o).Wait();
    const double took = SecondsSince(start);
    me.release = true;
    CUDA_CHECK(cudaStreamSynchronize(me.stream));
    CHILD_CHECK(st.code() == StatusCode::kDeadlineExceeded &&
                    st.message().find("operation 'stuck'") != std::string::npos &&
                    st.message().find("rank 1's stream") != std::string::npos &&
                    st.message().find("nothing of the operation ran") != std::string::npos,
                "rank %d got %s", rank, st.ToString().c_str());
    CHILD_CHECK(took >= 0.4 && took < 20, "rank %d: failed after %.2f s (timeout 0.5 s)", rank,
                took);
    usleep(100 * 1000);  // had anything been enqueued, it would have run by now
    CHILD_CHECK(Download(me.mem.recv, kStuckCount) == std::vector<float>(kStuckCount, -7.0f),
                "rank %d: the timed-out operation wrote", rank);
    o.name = "after";
    o.timeout_ms = 0;
    st = AllreduceOn(me, o).Wait();
    CHILD_CHECK(st.ok(), "rank %d: the next operation: %s", rank, st.ToString().c_str());
    CHILD_CHECK(Download(me.mem.recv, kStuckCount) == std::vector<float>(kStuckCount, 3.0f),
                "rank %d: the next operation's result", rank);
    return 0;
  });
}

// A rank that leaves while its stream has not reached its submission: the
// other rank's operation fails at once (not at its timeout of a minute),
// nothing of it ran, and the daemon stops cleanly (it does not wait for the
// stream).
TEST(DeviceBuffersTest, ARankLeavingWithItsStreamStuckFailsTheOperationAtOnce) {
  SKIP_WITHOUT_GPU();
  RunWithRank1Stuck("stuckleft", -7.0f, [](StuckRank& me) {
    OpOptions o;
    o.name = "left";
    o.stream = me.stream;
    o.timeout_ms = 60000;
    const auto start = std::chrono::steady_clock::now();
    Handle h = AllreduceOn(me, o);
    if (me.rank == 1) {
      usleep(500 * 1000);  // rank 0 is waiting in the daemon by now
      me.comm.reset();     // the session ends, the stream still held
      usleep(200 * 1000);
      return 0;
    }
    Status st = h.Wait();
    const double took = SecondsSince(start);
    CHILD_CHECK(!st.ok() && took < 15, "rank 0 got %s after %.2f s", st.ToString().c_str(), took);
    fprintf(stderr, "rank 0: %s after %.2f s\n", st.ToString().c_str(), took);
    usleep(1000 * 1000);  // rank 1's stream has gone on by now
    CHILD_CHECK(Download(me.mem.recv, kStuckCount) == std::vector<float>(kStuckCount, -7.0f),
                "the failed operation wrote");
    return 0;
  });
}

// The "gpu memory" line of `ciuicctl status` for the daemon at `socket`
// ("" if there is none), polled until it starts with `want` for up to 10 s
// where `want` is given.
std::string GpuMemoryLine(const std::string& socket, const std::string& want = "") {
  std::string line;
  for (int i = 0; i < 100; ++i) {
    if (i > 0) usleep(100 * 1000);
    std::string out;
    line.clear();
    if (RunCommand(CiuicctlPath() + " --socket " + socket + " status", &out) == 0) {
      const size_t at = out.find("gpu memory");
      if (at != std::string::npos) line = out.substr(at, out.find('\n', at) - at);
    }
    if (want.empty() || line.rfind(want, 0) == 0) break;
  }
  return line;
}

// Two communicators of one trainer process (two jobs, as a data-parallel
// and a tensor-parallel group would be) with buffers in the same
// allocations, as PyTorch's allocator carves many tensors from one
// segment. CUDA maps a handle once per process, so ciuicd shares one
// mapping between the process's sessions: job B runs while job A's
// operation holds the allocations (held for rank 1's stream); before, B's
// open failed with cudaErrorAlreadyMapped. Then the jobs alternate; the
// trainers free their allocations and make new ones at the same addresses,
// whose open collides with the old mappings that both sessions' caches
// hold (ciuicd must drop them from both); job B goes on after job A's
// session has ended; and when every session has ended, ciuicd has let go
// of every allocation (`ciuicctl status`). Every result against the
// reference.
TEST(DeviceBuffersTest, TwoCommunicatorsOfOneProcessShareItsAllocations) {
  SKIP_WITHOUT_GPU();
  auto daemon = DaemonProcess::Start();
  ASSERT_NE(daemon, nullptr);
  const std::string job_a = UniqueJobId("shareda");
  const std::string job_b = UniqueJobId("sharedb");
  constexpr int kWorld = 2;
  auto codes = RunRanks(kWorld, [&](int rank) {
    CUDA_CHECK(cudaSetDevice(0));
    cudaStream_t stream_a = nullptr, stream_b = nullptr;
    CUDA_CHECK(cudaStreamCreateWithFlags(&stream_a, cudaStreamNonBlocking));
    CUDA_CHECK(cudaStreamCreateWithFlags(&stream_b, cudaStreamNonBlocking));
    auto a = Join(daemon->socket(), job_a, rank, kWorld);
    auto b = Join(daemon->socket(), job_b, rank, kWorld);
    CHILD_CHECK(a != nullptr && b != nullptr, "join");
    DeviceMemory mem;
    if (AllocateDeviceMemory(size_t{4} << 20, &mem) != 0) return 1;
    // Job A on the first half of each allocation, job B on the second.
    const size_t half = mem.bytes / 2;
    const DeviceMemory mem_a{mem.send, mem.recv, half};
    const DeviceMemory mem_b{mem.send + half, mem.recv + half, half};

    // Job A's operation, held for rank 1's stream with its buffers mapped.
    std::atomic<bool> release{false};
    std::vector<float> mine(kStuckCount, rank + 1.0f);
    CUDA_CHECK(cudaMemcpy(mem.send, mine.data(), kStuckCount * 4, cudaMemcpyHostToDevice));
    if (rank == 1) CUDA_CHECK(cudaLaunchHostFunc(stream_a, HoldStream, &release));
    OpOptions o;
    o.name = "held";
    o.stream = stream_a;
    Handle held = a->Allreduce(DeviceBuffer{mem.send, 0}, DeviceBuffer{mem.recv, 0}, kStuckCount,
                               DataType::kFloat32, ReduceOp::kSum, o);
    if (rank == 0) {  // until ciuicd has opened both ranks' buffers for it
      const std::string want = "gpu memory      4 trainer allocations mapped (16.0 MiB)";
      const std::string got = GpuMemoryLine(daemon->socket(), want);
      CHILD_CHECK(got.rfind(want, 0) == 0, "job A's held operation: ciuicctl status says '%s'",
                  got.c_str());
    }
    int failed = RunOneDevice(*b, 0, stream_b, mem_b, Coll::kAllreduce, DataType::kFloat32,
                              ReduceOp::kSum, 100003, false, "b/while-a-holds");
    release = true;
    Status st = held.Wait();
    CHILD_CHECK(st.ok(), "rank %d: job A's held operation: %s", rank, st.ToString().c_str());
    CHILD_CHECK(Download(mem.recv, kStuckCount) == std::vector<float>(kStuckCount, 3.0f),
                "rank %d: job A's held operation's result", rank);
    if (failed != 0) return 1;

    // The jobs alternate on the same allocations.
    const DataType kTypes[] = {DataType::kFloat16, DataType::kInt32, DataType::kFloat64};
    for (int i = 0; i < 3; ++i) {
      const DataType t = kTypes[i];
      const std::string n = std::to_string(i);
      if (RunOneDevice(*a, 0, stream_a, mem_a, Coll::kAllreduce, t, ReduceOp::kMax, 4099, i == 1,
                       "a/allreduce/" + n) != 0 ||
          RunOneDevice(*b, 0, stream_b, mem_b, Coll::kAllgather, t, ReduceOp::kSum, 1001, false,
                       "b/allgather/" + n) != 0 ||
          RunOneDevice(*a, 0, stream_a, mem_a, Coll::kReduceScatter, t, ReduceOp::kSum, 7, false,
                       "a/reduce_scatter/" + n) != 0) {
        return 1;
      }
    }
    // Each process's two allocations are mapped once, whichever jobs use
    // them (rank 1 waits for rank 0 in job B's next operation meanwhile).
    if (rank == 0) {
      const std::string want = "gpu memory      4 trainer allocations mapped (16.0 MiB)";
      const std::string got = GpuMemoryLine(daemon->socket());
      CHILD_CHECK(got.rfind(want, 0) == 0, "ciuicctl status says '%s', wanted '%s'", got.c_str(),
                  want.c_str());
    }
    // The trainer frees its allocations and makes new ones, which may lie
    // at the freed ones' addresses (PyTorch's after empty_cache()): both
    // jobs' sessions have the old mappings cached, no operation holds them,
    // so ciuicd drops them from both caches and opens the new ones.
    const auto range_of = [&mem](const uint8_t* p) {
      return std::make_pair(reinterpret_cast<uintptr_t>(p),
                            reinterpret_cast<uintptr_t>(p) + mem.bytes);
    };
    const auto old_send = range_of(mem.send), old_recv = range_of(mem.recv);
    if (FreeDeviceMemory(&mem) != 0 || AllocateDeviceMemory(size_t{4} << 20, &mem) != 0) return 1;
    bool reused = false;
    for (const uint8_t* p : {mem.send, mem.recv}) {
      for (const auto& [begin, end] : {old_send, old_recv}) {
        reused = reused || (range_of(p).first < end && begin < range_of(p).second);
      }
    }
#ifdef CIUIC_CUDA_EMULATED
    // Where the emulation places allocations as the driver does, the test
    // must show the case (else it passes having shown nothing).
    CHILD_CHECK(reused, "rank %d: no new allocation lies at a freed one's address", rank);
#endif
    if (RunOneDevice(*a, 0, stream_a, {mem.send, mem.recv, half}, Coll::kAllreduce,
                     DataType::kFloat32, ReduceOp::kSum, 4099, false, "a/realloc") != 0 ||
        RunOneDevice(*b, 0, stream_b, {mem.send + half, mem.recv + half, half}, Coll::kAllgather,
                     DataType::kInt8, ReduceOp::kSum, 1001, false, "b/realloc") != 0) {
      return 1;
    }
    // Job A's session ends; job B keeps the mapping.
    CUDA_CHECK(cudaStreamSynchronize(stream_a));
    a.reset();
    if (RunOneDevice(*b, 0, stream_b, {mem.send + half, mem.recv + half, half}, Coll::kAllreduce,
                     DataType::kBFloat16, ReduceOp::kSum, 65537, true, "b/after-a") != 0) {
      return 1;
    }
    b.reset();
    if (FreeDeviceMemory(&mem) != 0) return 1;
    CUDA_CHECK(cudaStreamDestroy(stream_a));
    CUDA_CHECK(cudaStreamDestroy(stream_b));
    return 0;
  });
  for (int r = 0; r < kWorld; ++r) EXPECT_EQ(codes[r], 0) << "rank " << r;
  // Every session has ended: ciuicd lets go of the trainers' memory (once
  // its submit thread has closed the sessions' handles).
  const std::string none = "gpu memory      0 trainer allocations mapped (0 B)";
  const std::string line = GpuMemoryLine(daemon->socket(), none);
  EXPECT_EQ(line.rfind(none, 0), 0u) << line;
  if (HasFailure()) fprintf(stderr, "%s\n", daemon->Log().c_str());
  EXPECT_TRUE(daemon->Alive());
  EXPECT_EQ(daemon->Stop(), 0);
}

// Multi-node: two daemons ("nodes", UCX over TCP on loopback) with two ranks
// each, all on the GPU(s) of this machine. Allreduces are reduced on the GPU
// and staged through pinned host memory in 64 KiB segments (1000003 float32
// elements: 62 of them, the last short); the other collectives go through
// pinned host copies around the inter-node algorithm. Small integers, so that
// any order of reduction gives the reference exactly.
int RunOneDeviceMultiNode(Communicator& comm, int device, cudaStream_t stream,
                          const DeviceMemory& mem, Coll coll, DataType t, ReduceOp op,
                          size_t count, const std::string& name) {
  const int world = comm.world_size();
  const int rank = comm.rank();
  const size_t es = DataTypeSize(t);
  const bool a2a = coll == Coll::kAlltoall;
  const size_t send_count = coll == Coll::kReduceScatter || a2a ? count * world : count;
  const size_t recv_count = coll == Coll::kAllgather || a2a ? count * world : count;
  std::vector<uint8_t> host(send_count * es + 1);
  FillSmall(t, op, rank, host.data(), send_count);
  CHILD_CHECK(send_count * es <= mem.bytes && recv_count * es <= mem.bytes, "%s: %zu bytes",
              name.c_str(), mem.bytes);
  uint8_t* send = mem.send;
  uint8_t* recv = mem.recv;
  CUDA_CHECK(cudaMemsetAsync(recv, 0x5a, recv_count * es, stream));
  CUDA_CHECK(cudaMemcpyAsync(send, host.data(), send_count * es, cudaMemcpyHostToDevice, stream));
  OpOptions opts;
  opts.name = name;
  opts.stream = stream;
  const int root = world - 1;
  const DeviceBuffer s{send, device};
  const DeviceBuffer r{recv, device};
  Status st = SubmitDevice(comm, coll, s, r, count, t, op, root, opts).Wait();
  CHILD_CHECK(st.ok(), "%s: %s", name.c_str(), st.ToString().c_str());
  std::vector<uint8_t> got(recv_count * es + 1);
  CUDA_CHECK(cudaMemcpy(got.data(), recv, recv_count * es, cudaMemcpyDeviceToHost));
  const std::vector<uint8_t> want = ReferenceCollective(
      coll, t, op, world, rank, root, count,
      [&](int q, void* o, size_t n) { FillSmall(t, op, q, o, n); });
  for (size_t i = 0; i < recv_count; ++i) {
    CHILD_CHECK(std::memcmp(got.data() + i * es, want.data() + i * es, es) == 0,
                "%s rank %d: element %zu of %zu differs from the reference", name.c_str(), rank,
                i, recv_count);
  }
  return 0;
}

// Two daemons ("nodes") with two ranks each, every rank on GPU
// local_rank % devices with a stream of its own, running `body` (0: fine;
// `node_socket`: the rank's daemon);
// each rank's exit code is expected to be 0, and the daemons' logs are
// printed on a failure.
void RunOnTwoGpuNodes(
    const std::string& config, const std::string& job_prefix, size_t arena_bytes,
    const std::function<int(Communicator&, int rank, int device, cudaStream_t stream,
                            const std::string& node_socket)>& body) {
  constexpr int kNodes = 2;
  constexpr int kPerNode = 2;
  auto cluster = Cluster::Start(kNodes, config);
  ASSERT_NE(cluster, nullptr);
  const std::string job = UniqueJobId(job_prefix);
  auto codes = RunRanks(kNodes * kPerNode, [&](int rank) {
    int devices = 0;
    CUDA_CHECK(cudaGetDeviceCount(&devices));
    const int device = (rank % kPerNode) % devices;
    CUDA_CHECK(cudaSetDevice(device));
    cudaStream_t stream = nullptr;
    CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    std::unique_ptr<Communicator> comm = cluster->Join(job, rank, kNodes, kPerNode, arena_bytes);
    CHILD_CHECK(comm != nullptr, "rank %d could not join (see stderr)", rank);
    return body(*comm, rank, device, stream, cluster->nodes[rank / kPerNode]->socket());
  });
  for (int r = 0; r < kNodes * kPerNode; ++r) EXPECT_EQ(codes[r], 0) << "rank " << r;
  if (::testing::Test::HasFailure()) {
    for (auto& d : cluster->nodes) fprintf(stderr, "%s\n", d->Log().c_str());
  }
  EXPECT_TRUE(cluster->StopAll());
}

TEST(DeviceMultiNodeTest, TwoNodesOfTwoRanksMatchTheReference) {
  SKIP_WITHOUT_GPU();
  RunOnTwoGpuNodes(
      "tuning:\n  staging_segment_bytes: 64K\n", "devmn", 16 << 20,
      [](Communicator& comm, int, int device, cudaStream_t stream, const std::string&) {
        DeviceMemory mem;
        if (AllocateDeviceMemory(size_t{1000003} * 4 * 4, &mem) != 0) return 1;
        for (Coll coll : {Coll::kAllreduce, Coll::kReduceScatter, Coll::kAllgather,
                          Coll::kBroadcast, Coll::kAlltoall}) {
          const bool reduces = coll == Coll::kAllreduce || coll == Coll::kReduceScatter;
          for (DataType t : {DataType::kFloat32, DataType::kBFloat16, DataType::kInt32}) {
            for (ReduceOp op : kAllReduceOps) {
              if (!reduces && op != ReduceOp::kSum) continue;
              for (size_t count : {size_t{0}, size_t{1}, size_t{4099}, size_t{1000003}}) {
                const std::string name = std::string(CollName(coll)) + "/" + DataTypeName(t) + "/" +
                                         ReduceOpName(op) + "/" + std::to_string(count);
                if (RunOneDeviceMultiNode(comm, device, stream, mem, coll, t, op, count, name) !=
                    0) {
                  return 1;
                }
              }
            }
          }
        }
        if (RunDeviceAlltoallvs(comm, device, stream, mem, "mn/") != 0) return 1;
        return FreeDeviceMemory(&mem);
      });
}

// Compressed allreduces on device buffers between two nodes (two ranks
// each): encoded and decoded by the GPU's codec kernels where the node
// buffer lives, error feedback kept on the device. The same operations on
// host buffers (other names, the same data) go through the CPU codecs and
// the host's residuals: every result must be the same bits, over two steps
// of each name (the second one adds the first one's residuals).
TEST(DeviceMultiNodeTest, CompressedAllreducesGiveTheHostPathsBits) {
  SKIP_WITHOUT_GPU();
  RunOnTwoGpuNodes(
      "tuning:\n  chunk_bytes: 64K\n", "devzip", 64 << 20,
      [](Communicator& comm, int rank, int device, cudaStream_t stream,
         const std::string& node_socket) {
        const size_t count = 300007;  // float32: 1.2 MB, several chunks per segment owner
        DeviceMemory mem;
        if (AllocateDeviceMemory(count * 4, &mem) != 0) return 1;
        float* send = reinterpret_cast<float*>(mem.send);
        float* recv = reinterpret_cast<float*>(mem.recv);
        for (const char* codec : {"int8", "fp16", "topk:0.05"}) {
          for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kAvg}) {
            for (int step = 0; step < 2; ++step) {
              std::vector<float> input(count);
              for (size_t i = 0; i < count; ++i) {
                input[i] = static_cast<float>(std::sin(0.001 * i + rank + 7 * step) * 100);
              }
              // int8's second step: blocks that travel raw (an encoding
              // longer than typical, its rest copied when it ends). Inf,
              // not NaN: its sums' bits are the same on GPU and CPU; last
              // step: the residual it leaves (inf - inf) is used no more.
              if (step == 1 && std::string(codec) == "int8" && rank == 0) {
                input[4321] = std::numeric_limits<float>::infinity();
                input[count - 3] = -std::numeric_limits<float>::infinity();
              }
              OpOptions opts;
              opts.compression = codec;
              opts.stream = stream;
              const std::string tag = std::string(codec) + "/" + ReduceOpName(op);
              // Device buffers.
              CUDA_CHECK(
                  cudaMemcpyAsync(send, input.data(), count * 4, cudaMemcpyHostToDevice, stream));
              opts.name = "dev/" + tag;
              Status st = comm.Allreduce(DeviceBuffer{send, device}, DeviceBuffer{recv, device},
                                         count, DataType::kFloat32, op, opts)
                              .Wait();
              CHILD_CHECK(st.ok(), "%s: %s", opts.name.c_str(), st.ToString().c_str());
              std::vector<float> on_device(count);
              CUDA_CHECK(cudaMemcpy(on_device.data(), recv, count * 4, cudaMemcpyDeviceToHost));
              // Host buffers, the same data.
              Buffer hs, hr;
              CHILD_CHECK(comm.Allocate(count * 4, &hs).ok() && comm.Allocate(count * 4, &hr).ok(),
                          "rank %d: Allocate", rank);
              std::memcpy(hs.data(), input.data(), count * 4);
              opts.name = "host/" + tag;
              opts.stream = nullptr;
              st = comm.Allreduce(hs.data(), hr.data(), count, DataType::kFloat32, op, opts).Wait();
              CHILD_CHECK(st.ok(), "%s: %s", opts.name.c_str(), st.ToString().c_str());
              CHILD_CHECK(std::memcmp(hr.data(), on_device.data(), count * 4) == 0,
                          "rank %d %s step %d: the device path's result differs from the host's",
                          rank, tag.c_str(), step);
            }
          }
        }
        if (rank % 2 == 0) {
          // Where each node keeps its residuals: one per operation name, of
          // the whole count of float32 (1200028 bytes), the device names'
          // on the GPU, the host names' in host memory; none dropped.
          std::string out;
          const int code =
              RunCommand(CiuicctlPath() + " --socket " + node_socket + " status", &out);
          const std::string want =
              ": 12 residuals, 6.9 MiB in host memory, 6.9 MiB on GPUs; dropped: 0 evicted, 0 "
              "reset (size changed); 0 operations too large for it";
          CHILD_CHECK(code == 0 && out.find(want) != std::string::npos,
                      "ciuicctl status, wanted '%s':\n%s", want.c_str(), out.c_str());
          // The staging slots and the coders' message slots are pinned host
          // memory, kept for the next operations.
          CHILD_CHECK(out.find("trainer allocations mapped") != std::string::npos &&
                          out.find(", 0 B pinned host memory") == std::string::npos,
                      "ciuicctl status, wanted pinned host memory:\n%s", out.c_str());
        }
        return FreeDeviceMemory(&mem);
      });
}

// Multi-node: a rank whose stream never reaches its submission fails its
// node's staging at the timeout (DEADLINE_EXCEEDED naming its stream), the
// other node's ranks fail too (the operation never comes from that node),
// within bounded time, and both daemons stop cleanly.
TEST(DeviceMultiNodeTest, AStuckTrainerStreamFailsTheOperationOnEveryNode) {
  SKIP_WITHOUT_GPU();
  RunOnTwoGpuNodes(
      "", "devstuck", 16 << 20,
      [](Communicator& comm, int rank, int device, cudaStream_t stream, const std::string&) {
        DeviceMemory mem;
        if (AllocateDeviceMemory(size_t{4} << 20, &mem) != 0) return 1;
        const size_t count = 4099;
        std::vector<float> sentinel(count, -7.0f);
        CUDA_CHECK(cudaMemcpy(mem.send, sentinel.data(), count * 4, cudaMemcpyHostToDevice));
        CUDA_CHECK(cudaMemcpy(mem.recv, sentinel.data(), count * 4, cudaMemcpyHostToDevice));
        std::atomic<bool> release{false};
        if (rank == 3) CUDA_CHECK(cudaLaunchHostFunc(stream, HoldStream, &release));
        OpOptions o;
        o.name = "stuck";
        o.stream = stream;
        o.timeout_ms = 1500;
        CHILD_CHECK(comm.Barrier().Wait().ok(), "barrier");
        const auto start = std::chrono::steady_clock::now();
        Status st = comm.Allreduce(DeviceBuffer{mem.send, device}, DeviceBuffer{mem.recv, device},
                                   count, DataType::kFloat32, ReduceOp::kSum, o)
                        .Wait();
        const double took =
            std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
        release = true;
        CUDA_CHECK(cudaStreamSynchronize(stream));
        fprintf(stderr, "rank %d: %s after %.2f s\n", rank, st.ToString().c_str(), took);
        CHILD_CHECK(!st.ok() && took < 25, "rank %d got %s after %.2f s", rank,
                    st.ToString().c_str(), took);
        if (rank >= 2) {  // node 1, where the stream is held
          CHILD_CHECK(st.code() == StatusCode::kDeadlineExceeded &&
                          st.message().find("rank 3's stream") != std::string::npos,
                      "rank %d got %s", rank, st.ToString().c_str());
          usleep(100 * 1000);
          CHILD_CHECK(Download(mem.recv, count) == sentinel,
                      "rank %d: the timed-out operation wrote", rank);
        }
        return FreeDeviceMemory(&mem);
      });
}

// A hostile trainer's device descriptors (written straight into its arena,
// not through the SDK): a handle of random bytes, a real allocation's handle
// that claims more bytes than the allocation has, and a buffer past the end
// of the allocation get errors naming the problem; the daemon goes on, and
// the same session's valid descriptor then gives the right result.
TEST(DeviceBuffersTest, ForgedDescriptorsGetClearErrorsAndTheDaemonGoesOn) {
  SKIP_WITHOUT_GPU();
  auto daemon = DaemonProcess::Start();
  ASSERT_NE(daemon, nullptr);
  const std::string job = UniqueJobId("forged");
  auto codes = RunRanks(1, [&](int) {
    RawSession raw;
    CHILD_CHECK(raw.Open(daemon->socket(), 1 << 20), "open");
    std::string msg;
    CHILD_CHECK(raw.Join(daemon->socket(), job, 0, 1, &msg) == 0, "join: %s", msg.c_str());
    CUDA_CHECK(cudaSetDevice(0));
    constexpr size_t kBytes = size_t{4} << 20;
    constexpr uint64_t kCount = 1024;
    void* mem = nullptr;
    CUDA_CHECK(cudaMalloc(&mem, kBytes));
    std::vector<float> in(kCount);
    for (size_t i = 0; i < kCount; ++i) in[i] = 0.5f * static_cast<float>(i);
    CUDA_CHECK(cudaMemcpy(mem, in.data(), kCount * 4, cudaMemcpyHostToDevice));
    cudaIpcMemHandle_t handle;
    CUDA_CHECK(cudaIpcGetMemHandle(&handle, mem));
    struct Case {
      const char* what;
      wire::DeviceBufferDescriptor send, recv;
      int code;           // 0: OK
      const char* words;  // in the message
    };
    wire::DeviceBufferDescriptor good{};
    std::memcpy(good.memory_handle, &handle, sizeof(handle));
    good.allocation_bytes = kBytes;
    wire::DeviceBufferDescriptor out = good;
    out.offset = kBytes / 2;  // the result beside the input
    std::vector<Case> cases;
    {
      wire::DeviceBufferDescriptor random = good;
      uint64_t x = 0x9e3779b97f4a7c15ull;
      for (uint8_t& b : random.memory_handle) {
        x ^= x << 13, x ^= x >> 7, x ^= x << 17;
        b = static_cast<uint8_t>(x);
      }
      // INVALID_ARGUMENT where the driver says the handle is invalid, as it
      // should (the emulation does); whatever a GPU's driver says, an error
      // naming the open.
#ifdef CIUIC_CUDA_EMULATED
      constexpr int kRandomHandle = 3;
#else
      constexpr int kRandomHandle = -1;
#endif
      cases.push_back(
          {"a handle of random bytes", random, out, kRandomHandle, "cudaIpcOpenMemHandle"});
    }
    {
      wire::DeviceBufferDescriptor big = good;
      big.allocation_bytes = 2 * kBytes;
      wire::DeviceBufferDescriptor big_out = out;
      big_out.allocation_bytes = 2 * kBytes;
      cases.push_back({"an allocation claimed twice its size", big, big_out, 3,
                       "the descriptor says the allocation has"});
    }
    {
      wire::DeviceBufferDescriptor past = out;
      past.offset = kBytes - 8;
      cases.push_back({"a buffer past its allocation's end", good, past, 3, "allocation"});
    }
    cases.push_back({"a valid descriptor", good, out, 0, ""});
    for (size_t i = 0; i < cases.size(); ++i) {
      const Case& c = cases[i];
      // The records at two arena offsets of their own, 8-byte aligned.
      const uint64_t at = wire::kDataOffset + 4096 * (1 + 2 * i);
      std::memcpy(raw.base + at, &c.send, sizeof(c.send));
      std::memcpy(raw.base + at + 4096, &c.recv, sizeof(c.recv));
      wire::SubmissionEntry e =
          Entry(1 + i, wire::Collective::kAllreduce, wire::DataType::kFloat32,
                wire::ReduceOp::kSum, kCount, at, at + 4096, "forged" + std::to_string(i));
      e.flags = wire::kSubmitFlagDeviceBuffers;
      raw.Submit(e);
      wire::CompletionEntry done;
      CHILD_CHECK(raw.NextCompletion(&done, 10000), "%s: no completion", c.what);
      const std::string text = MessageOf(done);
      fprintf(stderr, "%s: code %d: %s\n", c.what, done.status_code, text.c_str());
      CHILD_CHECK(done.op_id == e.op_id, "%s: completion of op %llu", c.what,
                  static_cast<unsigned long long>(done.op_id));
      CHILD_CHECK(c.code < 0 ? done.status_code != 0 : done.status_code == c.code,
                  "%s: code %d: %s", c.what, done.status_code, text.c_str());
      CHILD_CHECK(text.find(c.words) != std::string::npos, "%s: '%s' not in: %s", c.what, c.words,
                  text.c_str());
    }
    std::vector<float> got(kCount);
    CUDA_CHECK(cudaMemcpy(got.data(), static_cast<char*>(mem) + kBytes / 2, kCount * 4,
                          cudaMemcpyDeviceToHost));
    CHILD_CHECK(got == in, "the valid descriptor's result is wrong");
    CUDA_CHECK(cudaFree(mem));
    return 0;
  });
  EXPECT_EQ(codes[0], 0);
  if (::testing::Test::HasFailure()) fprintf(stderr, "%s\n", daemon->Log().c_str());
  EXPECT_TRUE(daemon->Alive());
  EXPECT_EQ(daemon->Stop(), 0);
}

// A raw device allreduce of `count` floats from `send` into `recv` (their
// descriptors at two arena offsets of their own); the completion.
bool RawDeviceAllreduce(RawSession& raw, const wire::DeviceBufferDescriptor& send,
                        const wire::DeviceBufferDescriptor& recv, uint64_t count, uint64_t op_id,
                        const std::string& name, wire::CompletionEntry* done) {
  const uint64_t at = wire::kDataOffset + 8192 * op_id;
  std::memcpy(raw.base + at, &send, sizeof(send));
  std::memcpy(raw.base + at + 4096, &recv, sizeof(recv));
  wire::SubmissionEntry e = Entry(op_id, wire::Collective::kAllreduce, wire::DataType::kFloat32,
                                  wire::ReduceOp::kSum, count, at, at + 4096, name);
  e.flags = wire::kSubmitFlagDeviceBuffers;
  raw.Submit(e);
  return raw.NextCompletion(done, 10000) && done->op_id == op_id;
}

// Another uid that names a handle of this user's, which ciuicd has mapped
// for this user's session, gets an error: the mapping is never shared
// across users, and another user's open never closes this user's idle
// mappings to take the allocation over.
TEST(DeviceBuffersTest, AnotherUsersSessionNeverReachesAMappedAllocation) {
  SKIP_WITHOUT_GPU();
  if (geteuid() != 0) GTEST_SKIP() << "needs root to run a trainer as another uid";
  auto daemon = DaemonProcess::Start();
  ASSERT_NE(daemon, nullptr);
  int handle_pipe[2], done_pipe[2];
  ASSERT_EQ(pipe(handle_pipe), 0);
  ASSERT_EQ(pipe(done_pipe), 0);
  constexpr uint64_t kCount = 1024;
  constexpr size_t kBytes = size_t{1} << 20;
  auto codes = RunRanks(2, [&](int who) {
    RawSession raw;
    if (who == 1) CHILD_CHECK(setgid(65534) == 0 && setuid(65534) == 0, "drop privileges");
    CHILD_CHECK(raw.Open(daemon->socket(), 1 << 20), "open");
    std::string msg;
    CHILD_CHECK(raw.Join(daemon->socket(), UniqueJobId(who ? "thief" : "owner"), 0, 1, &msg) == 0,
                "join: %s", msg.c_str());
    wire::CompletionEntry done{};
    if (who == 0) {
      CUDA_CHECK(cudaSetDevice(0));
      void* mem = nullptr;
      CUDA_CHECK(cudaMalloc(&mem, kBytes));
      std::vector<float> secret(kCount, 42.0f);
      CUDA_CHECK(cudaMemcpy(mem, secret.data(), kCount * 4, cudaMemcpyHostToDevice));
      cudaIpcMemHandle_t handle;
      CUDA_CHECK(cudaIpcGetMemHandle(&handle, mem));
      wire::DeviceBufferDescriptor d{};
      std::memcpy(d.memory_handle, &handle, sizeof(handle));
      d.allocation_bytes = kBytes;
      // One operation, so that ciuicd has the allocation mapped (cached).
      CHILD_CHECK(RawDeviceAllreduce(raw, d, d, kCount, 1, "mine", &done) && done.status_code == 0,
                  "owner's own operation: code %d", done.status_code);
      CHILD_CHECK(write(handle_pipe[1], &d, sizeof(d)) == sizeof(d), "pipe");
      char c;
      CHILD_CHECK(read(done_pipe[0], &c, 1) == 1, "pipe");
      std::vector<float> got(kCount);
      CUDA_CHECK(cudaMemcpy(got.data(), mem, kCount * 4, cudaMemcpyDeviceToHost));
      CHILD_CHECK(got == secret, "the other user changed this user's memory");
      CHILD_CHECK(RawDeviceAllreduce(raw, d, d, kCount, 2, "mine-again", &done) &&
                      done.status_code == 0,
                  "owner's operation after the attempt: code %d", done.status_code);
      CUDA_CHECK(cudaFree(mem));
      return 0;
    }
    wire::DeviceBufferDescriptor theirs{};
    CHILD_CHECK(read(handle_pipe[0], &theirs, sizeof(theirs)) == sizeof(theirs), "pipe");
    wire::DeviceBufferDescriptor out = theirs;  // would write into the owner's memory
    out.offset = kBytes / 2;
    const bool completed = RawDeviceAllreduce(raw, theirs, out, kCount, 1, "steal", &done);
    const std::string text = MessageOf(done);
    fprintf(stderr, "the other user's attempt: code %d: %s\n", done.status_code, text.c_str());
    CHILD_CHECK(write(done_pipe[1], "d", 1) == 1, "pipe");
    CHILD_CHECK(completed && done.status_code != 0, "another uid used the owner's mapping");
    CHILD_CHECK(text.find("another user") != std::string::npos, "%s", text.c_str());
    return 0;
  });
  EXPECT_EQ(codes, (std::vector<int>{0, 0}));
  if (::testing::Test::HasFailure()) fprintf(stderr, "%s\n", daemon->Log().c_str());
  EXPECT_TRUE(daemon->Alive());
  EXPECT_EQ(daemon->Stop(), 0);
}

// Empty where this process's CUDA devices are the CUDA emulation's
// (tests/cuda_emulation), else why not.
std::string WhyNotEmulated() {
  auto codes = RunRanks(1, [](int) {
    cudaDeviceProp p{};
    return cudaGetDeviceProperties(&p, 0) == cudaSuccess &&
                   std::string(p.name).find("ciuic CUDA emulation") != std::string::npos
               ? 0
               : 1;
  });
  return codes[0] == 0 ? "" : "needs the CUDA emulation, which can make a kernel fault";
}

// A kernel that faults on the daemon's device (the emulation's injected
// fault: the daemon's fourth kernel launch) fails its operation on every
// rank with the device's error, within seconds; the daemon's CUDA context is
// broken then, so later device operations fail too, saying so, while host
// operations go on and the daemon stops cleanly.
TEST(DeviceBuffersTest, ADeviceFaultFailsTheOperationClearlyAndTheDaemonLives) {
  SKIP_WITHOUT_GPU();
  if (const std::string why = WhyNotEmulated(); !why.empty()) GTEST_SKIP() << why;
  auto daemon =
      DaemonProcess::StartWith("", {}, {}, {"CIUIC_CUDA_EMULATION_FAULT_AFTER_LAUNCHES=3"});
  ASSERT_NE(daemon, nullptr);
  const std::string job = UniqueJobId("devfault");
  constexpr int kWorld = 2;
  auto codes = RunRanks(kWorld, [&](int rank) {
    CUDA_CHECK(cudaSetDevice(0));
    cudaStream_t stream = nullptr;
    CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    auto comm = Join(daemon->socket(), job, rank, kWorld);
    CHILD_CHECK(comm != nullptr, "join");
    DeviceMemory mem;
    if (AllocateDeviceMemory(size_t{4} << 20, &mem) != 0) return 1;
    std::vector<float> ones(1000, 1.0f);
    CUDA_CHECK(cudaMemcpy(mem.send, ones.data(), ones.size() * 4, cudaMemcpyHostToDevice));
    for (int i = 0; i < 6; ++i) {
      OpOptions o;
      o.name = "op" + std::to_string(i);
      o.stream = stream;
      const auto start = std::chrono::steady_clock::now();
      Status st = comm->Allreduce(DeviceBuffer{mem.send, 0}, DeviceBuffer{mem.recv, 0}, ones.size(),
                                  DataType::kFloat32, ReduceOp::kSum, o)
                      .Wait();
      const double took = SecondsSince(start);
      fprintf(stderr, "rank %d %s: %s\n", rank, o.name.c_str(), st.ToString().c_str());
      CHILD_CHECK(took < 10, "rank %d %s took %.1f s", rank, o.name.c_str(), took);
      if (i < 3) {
        CHILD_CHECK(st.ok(), "rank %d %s: %s", rank, o.name.c_str(), st.ToString().c_str());
        CHILD_CHECK(Download(mem.recv, ones.size()) == std::vector<float>(ones.size(), 2.0f),
                    "rank %d %s: wrong result", rank, o.name.c_str());
      } else {
        // The faulting operation and the ones after it, whichever call saw
        // the broken context.
        CHILD_CHECK(
            st.code() == StatusCode::kInternal &&
                st.message().find("ciuicd's CUDA context is broken by a device fault; "
                                  "device operations fail until ciuicd restarts") !=
                    std::string::npos &&
                (i > 3 || st.message().find("cudaErrorIllegalAddress") != std::string::npos),
            "rank %d %s: %s", rank, o.name.c_str(), st.ToString().c_str());
      }
    }
    // The daemon's device is broken, its host path is not.
    float x[3] = {1.0f + rank, 2, 3};
    OpOptions o;
    o.name = "host";
    CHILD_CHECK(comm->Allreduce(x, x, 3, DataType::kFloat32, ReduceOp::kSum, o).Wait().ok(),
                "rank %d: host allreduce", rank);
    CHILD_CHECK(x[0] == 3.0f && x[1] == 4.0f, "rank %d: host result", rank);
    return 0;
  });
  for (int r = 0; r < kWorld; ++r) EXPECT_EQ(codes[r], 0) << "rank " << r;
  if (::testing::Test::HasFailure()) fprintf(stderr, "%s\n", daemon->Log().c_str());
  EXPECT_TRUE(daemon->Alive());
  EXPECT_EQ(daemon->Stop(), 0);
}

#else

TEST(DeviceCollectivesTest, EveryCollectiveDtypeOpAndSizeMatchesTheReference) {
  SKIP_WITHOUT_GPU();
}

TEST(DeviceBuffersTest, NewAllocationsAtFreedAddressesAndSmallAllocations) {
  SKIP_WITHOUT_GPU();
}
TEST(DeviceMultiNodeTest, TwoNodesOfTwoRanksMatchTheReference) { SKIP_WITHOUT_GPU(); }
TEST(DeviceMultiNodeTest, CompressedAllreducesGiveTheHostPathsBits) { SKIP_WITHOUT_GPU(); }
TEST(DeviceBuffersTest, AStuckTrainerStreamTimesOutClearlyAndNothingRuns) { SKIP_WITHOUT_GPU(); }
TEST(DeviceBuffersTest, ARankLeavingWithItsStreamStuckFailsTheOperationAtOnce) {
  SKIP_WITHOUT_GPU();
}
TEST(DeviceBuffersTest, TwoCommunicatorsOfOneProcessShareItsAllocations) { SKIP_WITHOUT_GPU(); }
TEST(DeviceMultiNodeTest, AStuckTrainerStreamFailsTheOperationOnEveryNode) { SKIP_WITHOUT_GPU(); }
TEST(DeviceBuffersTest, ForgedDescriptorsGetClearErrorsAndTheDaemonGoesOn) { SKIP_WITHOUT_GPU(); }
TEST(DeviceBuffersTest, AnotherUsersSessionNeverReachesAMappedAllocation) { SKIP_WITHOUT_GPU(); }
TEST(DeviceBuffersTest, ADeviceFaultFailsTheOperationClearlyAndTheDaemonLives) {
  SKIP_WITHOUT_GPU();
}

#endif

}  // namespace
}  // namespace ciuic::testing
