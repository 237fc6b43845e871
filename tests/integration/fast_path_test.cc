// The single-node small-operation fast path (proto/ciuic/fast_path.h) with a
// real ciuicd and real trainer processes: every collective x dtype x reduce
// op x size class (0, 1, odd, right at the limit, just above it, so both
// paths run) with the fast path on and off, against the independent
// reference; that small operations really bypass the daemon; out-of-order
// names; mismatches, also of operations on both sides of the limit (every
// rank gets the error within seconds); a trainer killed while the others wait in a fast-path
// operation; a trainer scribbling over the segment; counters in ciuicctl.
#include <dirent.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#include <cstring>
#include <fstream>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "ciuic/ciuic.h"
#include "common.h"
#include "harness.h"
#include "reference.h"

namespace ciuic::testing {
namespace {

using Clock = std::chrono::steady_clock;

constexpr uint64_t kLimit = 4096;

std::string Config(uint64_t fast_path_bytes, uint32_t op_timeout_ms = 60000) {
  return "tuning:\n  fast_path_bytes: " + std::to_string(fast_path_bytes) +
         "\n  op_timeout_ms: " + std::to_string(op_timeout_ms) + "\n";
}

std::string Ctl(const DaemonProcess& d, const std::string& args, int* code) {
  std::string out;
  *code = RunCommand(std::string(CIUICCTL_PATH) + " --socket " + d.socket() + " " + args, &out);
  return out;
}

// One operation, its whole receive buffer compared byte for byte with the
// reference. Heap buffers (the fast path copies straight from and to them)
// and shared-memory ones alternate, and so does in-place.
int RunOne(Communicator& comm, Coll coll, DataType t, ReduceOp op, size_t count, int variant) {
  CheckOptions o;
  o.name = std::string(CollName(coll)) + "/" + DataTypeName(t) + "/" + ReduceOpName(op) + "/" +
           std::to_string(count) + "/" + std::to_string(variant);
  o.zero_copy = variant % 2 == 1;
  o.in_place = variant % 3 == 2;
  o.root = (variant + 1) % comm.world_size();
  o.salt = static_cast<uint64_t>(variant);
  return RunAndCheck(comm, coll, t, op, count, o);
}

// Counts per collective: 0, 1, odd, the most that fits the limit, one more.
std::vector<size_t> Counts(Coll coll, DataType t, int world) {
  const size_t es = DataTypeSize(t);
  const size_t per =
      (coll == Coll::kReduceScatter || coll == Coll::kAllgather || coll == Coll::kAlltoall)
          ? es * world
          : es;
  const size_t at = kLimit / per;
  return {0, 1, 37, at, at + 1};
}

int RunMatrix(const std::string& socket, const std::string& job, int rank, int world) {
  auto comm = JoinJob(socket, job, rank, world, 16 << 20);
  CHILD_CHECK(comm != nullptr, "join");
  int variant = 0;
  for (Coll coll : {Coll::kAllreduce, Coll::kReduceScatter, Coll::kAllgather, Coll::kBroadcast,
                     Coll::kAlltoall}) {
    const bool reduces = coll == Coll::kAllreduce || coll == Coll::kReduceScatter;
    for (DataType t : kAllDataTypes) {
      for (ReduceOp op : kAllReduceOps) {
        if (!reduces && op != ReduceOp::kSum) continue;
        for (size_t count : Counts(coll, t, world)) {
          if (RunOne(*comm, coll, t, op, count, variant++) != 0) return 1;
        }
      }
    }
  }
  for (int i = 0; i < 3; ++i) {
    Status s = comm->Barrier().Wait();
    CHILD_CHECK(s.ok(), "barrier: %s", s.ToString().c_str());
  }
  return 0;
}

class FastPathMatrixTest : public ::testing::TestWithParam<std::tuple<int, bool>> {};

TEST_P(FastPathMatrixTest, EveryCollectiveDtypeOpAndSizeClass) {
  const auto [world, fast] = GetParam();
  auto daemon = DaemonProcess::Start(Config(fast ? kLimit : 0));
  ASSERT_NE(daemon, nullptr);
  const std::string job = UniqueJobId("fpmatrix");
  auto codes = RunRanks(world, [&](int rank) { return RunMatrix(daemon->socket(), job, rank, world); });
  for (int c : codes) EXPECT_EQ(c, 0) << daemon->Log();
  EXPECT_EQ(daemon->Stop(), 0);
}

INSTANTIATE_TEST_SUITE_P(Ranks, FastPathMatrixTest,
                         ::testing::Combine(::testing::Values(2, 3), ::testing::Bool()),
                         [](const auto& info) {
                           return std::to_string(std::get<0>(info.param)) + "ranks_" +
                                  (std::get<1>(info.param) ? "fast" : "daemon");
                         });

// With the daemon stopped (SIGSTOP), an operation within the limit still
// completes (it never touches the daemon) and one above it waits; after a
// live `tune set fast_path_bytes=0`, a job formed later waits for the
// daemon even for small operations, while the running job keeps its path.
// Whether every thread of `pid` is in the stopped state ('T' in
// /proc/PID/task/TID/stat) within `limit`.
bool AllThreadsStopped(pid_t pid, std::chrono::milliseconds limit) {
  const auto until = Clock::now() + limit;
  const std::string dir = "/proc/" + std::to_string(pid) + "/task";
  while (Clock::now() < until) {
    bool all = true;
    if (DIR* d = opendir(dir.c_str())) {
      while (dirent* e = readdir(d)) {
        if (e->d_name[0] == '.') continue;
        std::ifstream f(dir + "/" + e->d_name + "/stat");
        std::string line;
        std::getline(f, line);
        const size_t paren = line.rfind(')');
        if (paren == std::string::npos || paren + 2 >= line.size()) continue;  // thread gone
        if (line[paren + 2] != 'T' && line[paren + 2] != 't') all = false;
      }
      closedir(d);
    }
    if (all) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return false;
}

TEST(FastPathTest, SmallOperationsBypassTheDaemonAndTheLimitIsPerJob) {
  auto daemon = DaemonProcess::Start(Config(kLimit));
  ASSERT_NE(daemon, nullptr);
  for (int phase = 0; phase < 2; ++phase) {
    if (phase == 1) {
      int code = 0;
      std::string out = Ctl(*daemon, "tune set fast_path_bytes=0", &code);
      ASSERT_EQ(code, 0) << out;
    }
    const std::string job = UniqueJobId("fpbypass");
    int joined[2], go[2];
    ASSERT_EQ(pipe(joined), 0);
    ASSERT_EQ(pipe(go), 0);
    std::vector<pid_t> pids = SpawnRanks(2, [&, phase](int rank) {
      auto comm = JoinJob(daemon->socket(), job, rank, 2);
      CHILD_CHECK(comm != nullptr, "join");
      // Both joined and one op done before the daemon stops.
      std::vector<float> v(1024, rank + 1.0f);
      CHILD_CHECK(comm->Allreduce(v.data(), v.data(), v.size(), DataType::kFloat32, ReduceOp::kSum).Wait().ok(), "warm");
      CHILD_CHECK(write(joined[1], "j", 1) == 1, "pipe");
      char c;
      CHILD_CHECK(read(go[0], &c, 1) == 1, "pipe");
      std::fill(v.begin(), v.end(), rank + 1.0f);
      Handle small = comm->Allreduce(v.data(), v.data(), v.size(), DataType::kFloat32, ReduceOp::kSum);
      Status s = small.WaitFor(std::chrono::milliseconds(1500));
      if (phase == 0) {
        CHILD_CHECK(s.ok() && v[0] == 3.0f && v[1023] == 3.0f, "small op with the daemon stopped: %s",
                    s.ToString().c_str());
      } else {
        CHILD_CHECK(s.code() == StatusCode::kDeadlineExceeded, "fast path off, yet: %s",
                    s.ToString().c_str());
      }
      std::vector<float> big(1025, rank + 1.0f);
      Handle large = comm->Allreduce(big.data(), big.data(), big.size(), DataType::kFloat32, ReduceOp::kSum);
      s = large.WaitFor(std::chrono::milliseconds(500));
      CHILD_CHECK(s.code() == StatusCode::kDeadlineExceeded, "large op without the daemon: %s",
                  s.ToString().c_str());
      CHILD_CHECK(write(joined[1], "w", 1) == 1, "pipe");
      s = small.Wait();
      CHILD_CHECK(s.ok() && v[0] == 3.0f, "%s", s.ToString().c_str());
      s = large.Wait();
      CHILD_CHECK(s.ok() && big[0] == 3.0f && big[1024] == 3.0f, "%s", s.ToString().c_str());
      return 0;
    });
    // Only the ranks hold these ends: a rank that fails gives EOF, not a hang.
    close(joined[1]);
    close(go[0]);
    char c;
    for (int i = 0; i < 2; ++i) ASSERT_EQ(read(joined[0], &c, 1), 1);
    ASSERT_EQ(kill(daemon->pid(), SIGSTOP), 0);
    // kill() returns before every thread has stopped: a daemon thread still
    // running could serve the ranks' next operations.
    ASSERT_TRUE(AllThreadsStopped(daemon->pid(), std::chrono::seconds(10)));
    ASSERT_EQ(write(go[1], "gg", 2), 2);
    for (int i = 0; i < 2; ++i) EXPECT_EQ(read(joined[0], &c, 1), 1);
    ASSERT_EQ(kill(daemon->pid(), SIGCONT), 0);
    for (pid_t p : pids) EXPECT_EQ(WaitChild(p, std::chrono::seconds(60)), 0) << daemon->Log();
    for (int fd : {joined[0], go[1]}) close(fd);
  }
  EXPECT_EQ(daemon->Stop(), 0);
}

// Names submitted in opposite orders (and reused at once) on the two ranks.
TEST(FastPathTest, OutOfOrderNames) {
  auto daemon = DaemonProcess::Start(Config(kLimit));
  ASSERT_NE(daemon, nullptr);
  const std::string job = UniqueJobId("fporder");
  auto codes = RunRanks(2, [&](int rank) {
    auto comm = JoinJob(daemon->socket(), job, rank, 2);
    CHILD_CHECK(comm != nullptr, "join");
    std::mt19937 rng(rank + 11);
    for (int round = 0; round < 5; ++round) {
      constexpr int kNames = 100;
      std::vector<int> order(kNames);
      for (int i = 0; i < kNames; ++i) order[i] = i;
      if (rank == 1) std::reverse(order.begin(), order.end());
      if (round % 2 == 1) std::shuffle(order.begin(), order.end(), rng);
      std::vector<std::vector<int32_t>> data(kNames);
      std::vector<Handle> handles(kNames);
      for (int n : order) {
        data[n].assign(1 + n % 13, (rank + 1) * (n + 1) + round);
        OpOptions o;
        o.name = "grad." + std::to_string(n);
        handles[n] = comm->Allreduce(data[n].data(), data[n].data(), data[n].size(),
                                     DataType::kInt32, ReduceOp::kSum, o);
      }
      for (int n = 0; n < kNames; ++n) {
        Status s = handles[n].Wait();
        CHILD_CHECK(s.ok(), "grad.%d: %s", n, s.ToString().c_str());
        for (int32_t x : data[n]) CHILD_CHECK(x == 3 * (n + 1) + 2 * round, "grad.%d = %d", n, x);
      }
    }
    return 0;
  });
  for (int c : codes) EXPECT_EQ(c, 0) << daemon->Log();
  EXPECT_EQ(daemon->Stop(), 0);
}

// Communicator::TakeOpTimings, on both paths (fast path and daemon): rank 1
// works 100 ms before each operation, so rank 0 waits that long for each,
// rank 1 hardly at all; every completed operation is there once, by name,
// and the history keeps the newest kMaxOpTimings, counting the rest.
TEST(FastPathTest, OperationTimingsShowWhoWaited) {
  auto daemon = DaemonProcess::Start(Config(kLimit));
  ASSERT_NE(daemon, nullptr);
  const std::string job = UniqueJobId("fptiming");
  auto codes = RunRanks(2, [&](int rank) {
    auto comm = JoinJob(daemon->socket(), job, rank, 2);
    CHILD_CHECK(comm != nullptr, "join");
    CHILD_CHECK(comm->TakeOpTimings().empty(), "timings before any operation");
    const size_t counts[] = {16, 65536, 3, 100000};  // fast path, daemon, ...
    for (int i = 0; i < 4; ++i) {
      if (rank == 1) std::this_thread::sleep_for(std::chrono::milliseconds(100));
      std::vector<int32_t> v(counts[i], rank + 1);
      OpOptions o;
      o.name = "timed." + std::to_string(i);
      Status s = comm->Allreduce(v.data(), v.data(), v.size(), DataType::kInt32, ReduceOp::kSum, o)
                     .Wait();
      CHILD_CHECK(s.ok() && v[0] == 3, "%s: %s", o.name.c_str(), s.ToString().c_str());
    }
    uint64_t dropped = 99;
    std::vector<Communicator::OpTiming> t = comm->TakeOpTimings(&dropped);
    CHILD_CHECK(t.size() == 4 && dropped == 0, "%zu timings, %llu dropped", t.size(),
                static_cast<unsigned long long>(dropped));
    for (int i = 0; i < 4; ++i) {
      CHILD_CHECK(t[i].name == "timed." + std::to_string(i), "timing %d is %s", i,
                  t[i].name.c_str());
      const auto ms =
          std::chrono::duration_cast<std::chrono::milliseconds>(t[i].completed - t[i].submitted)
              .count();
      CHILD_CHECK(t[i].completed >= t[i].submitted, "%s completed before its submission",
                  t[i].name.c_str());
      if (rank == 0) CHILD_CHECK(ms >= 80, "rank 0 waited only %lld ms", (long long)ms);
      if (rank == 1) CHILD_CHECK(ms < 60, "rank 1 waited %lld ms", (long long)ms);
    }
    CHILD_CHECK(comm->TakeOpTimings().empty(), "timings handed out twice");
    // A failed operation is not timed.
    OpOptions bad;
    bad.name = "untimed";
    int32_t x = 0;
    Status s = comm->Allreduce(&x, &x, rank == 0 ? 1 : 2, DataType::kInt32, ReduceOp::kSum, bad)
                   .Wait();
    CHILD_CHECK(!s.ok(), "a mismatch succeeded");
    CHILD_CHECK(comm->TakeOpTimings().empty(), "a failed operation was timed");
    // The history's bound.
    const size_t n = Communicator::kMaxOpTimings + 10;
    for (size_t i = 0; i < n; ++i) {
      Status r = comm->Allreduce(&x, &x, 1, DataType::kInt32, ReduceOp::kSum).Wait();
      CHILD_CHECK(r.ok(), "op %zu: %s", i, r.ToString().c_str());
    }
    t = comm->TakeOpTimings(&dropped);
    CHILD_CHECK(t.size() == Communicator::kMaxOpTimings && dropped == 10,
                "%zu timings, %llu dropped", t.size(), static_cast<unsigned long long>(dropped));
    return 0;
  });
  for (int c : codes) EXPECT_EQ(c, 0) << daemon->Log();
  EXPECT_EQ(daemon->Stop(), 0);
}

// A mismatch (count, dtype, reduce op, root) fails the operation on every
// rank, naming it and both signatures, in the daemon's words; the job goes on.
TEST(FastPathTest, MismatchIsAnErrorOnEveryRank) {
  auto daemon = DaemonProcess::Start(Config(kLimit));
  ASSERT_NE(daemon, nullptr);
  const std::string job = UniqueJobId("fpmismatch");
  auto codes = RunRanks(3, [&](int rank) {
    auto comm = JoinJob(daemon->socket(), job, rank, 3);
    CHILD_CHECK(comm != nullptr, "join");
    std::vector<float> v(8, 1.0f);
    OpOptions o;
    o.name = "count";
    Status s = comm->Allreduce(v.data(), v.data(), rank == 2 ? 7 : 8, DataType::kFloat32,
                               ReduceOp::kSum, o).Wait();
    CHILD_CHECK(s.code() == StatusCode::kInvalidArgument &&
                    Contains(s.message(), "operation 'count' mismatched across ranks") &&
                    Contains(s.message(), "allreduce float32 count=8 op=sum") &&
                    Contains(s.message(), "allreduce float32 count=7 op=sum"),
                "%s", s.ToString().c_str());
    o.name = "op";
    s = comm->Allreduce(v.data(), v.data(), 8, DataType::kFloat32,
                        rank == 0 ? ReduceOp::kMax : ReduceOp::kSum, o).Wait();
    CHILD_CHECK(s.code() == StatusCode::kInvalidArgument && Contains(s.message(), "'op' mismatched") &&
                    Contains(s.message(), "op=max") && Contains(s.message(), "op=sum"),
                "%s", s.ToString().c_str());
    o.name = "root";
    s = comm->Broadcast(v.data(), 8, DataType::kFloat32, rank == 1 ? 1 : 0, o).Wait();
    CHILD_CHECK(s.code() == StatusCode::kInvalidArgument && Contains(s.message(), "root=1") &&
                    Contains(s.message(), "root=0"),
                "%s", s.ToString().c_str());
    o.name = "kind";
    if (rank == 0) {
      s = comm->Barrier(o).Wait();
    } else {
      s = comm->Allgather(v.data(), v.data(), 0, DataType::kFloat32, o).Wait();
    }
    CHILD_CHECK(s.code() == StatusCode::kInvalidArgument && Contains(s.message(), "barrier") &&
                    Contains(s.message(), "allgather float32 count=0"),
                "%s", s.ToString().c_str());
    // The job is fine afterwards.
    std::fill(v.begin(), v.end(), 1.0f);
    s = comm->Allreduce(v.data(), v.data(), 8, DataType::kFloat32, ReduceOp::kSum).Wait();
    CHILD_CHECK(s.ok() && v[7] == 3.0f, "%s", s.ToString().c_str());
    return 0;
  });
  for (int c : codes) EXPECT_EQ(c, 0) << daemon->Log();
  EXPECT_EQ(daemon->Stop(), 0);
}

uint64_t MonotonicNs() {
  timespec ts{};
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<uint64_t>(ts.tv_sec) * 1000000000ull + ts.tv_nsec;
}

// Rank 2 is SIGKILLed while blocked in a fast-path operation that the others
// never join, and while ranks 0 and 1 sleep in one it never joins: both
// get an error naming the dead rank within 2 s.
TEST(FastPathTest, KilledTrainerFailsTheOthersWithinTwoSeconds) {
  auto daemon = DaemonProcess::Start(Config(kLimit));
  ASSERT_NE(daemon, nullptr);
  const std::string job = UniqueJobId("fpkill");
  auto* when = static_cast<uint64_t*>(mmap(nullptr, 4096, PROT_READ | PROT_WRITE,
                                           MAP_SHARED | MAP_ANONYMOUS, -1, 0));
  ASSERT_NE(when, MAP_FAILED);
  int ready[2];
  ASSERT_EQ(pipe(ready), 0);
  std::vector<pid_t> pids = SpawnRanks(3, [&](int rank) {
    auto comm = JoinJob(daemon->socket(), job, rank, 3);
    CHILD_CHECK(comm != nullptr, "join");
    std::vector<float> v(16, 1.0f);
    CHILD_CHECK(comm->Allreduce(v.data(), v.data(), 16, DataType::kFloat32, ReduceOp::kSum).Wait().ok(), "warm");
    OpOptions o;
    o.name = rank == 2 ? "only.two" : "needs.two";
    Handle h = comm->Allreduce(v.data(), v.data(), 16, DataType::kFloat32, ReduceOp::kSum, o);
    CHILD_CHECK(write(ready[1], "r", 1) == 1, "pipe");
    Status s = h.Wait();
    when[rank] = MonotonicNs();
    CHILD_CHECK(s.code() == StatusCode::kAborted && Contains(s.message(), "rank 2") &&
                    Contains(s.message(), "left"),
                "%s", s.ToString().c_str());
    // Later operations fail at once with the same error.
    s = comm->Allreduce(v.data(), v.data(), 16, DataType::kFloat32, ReduceOp::kSum).Wait();
    CHILD_CHECK(s.code() == StatusCode::kAborted, "%s", s.ToString().c_str());
    return 0;
  });
  char c;
  for (int i = 0; i < 3; ++i) ASSERT_EQ(read(ready[0], &c, 1), 1);
  std::this_thread::sleep_for(std::chrono::milliseconds(300));  // all asleep in the futex
  const uint64_t killed = MonotonicNs();
  kill(pids[2], SIGKILL);
  EXPECT_EQ(WaitChild(pids[2], std::chrono::seconds(30)), 128 + SIGKILL);
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(WaitChild(pids[r], std::chrono::seconds(30)), 0) << daemon->Log();
    EXPECT_GT(when[r], killed);
    EXPECT_LT(when[r] - killed, 2000000000ull) << "rank " << r << " learned after "
                                               << (when[r] - killed) / 1e6 << " ms";
  }
  close(ready[0]);
  close(ready[1]);
  munmap(when, 4096);
  EXPECT_TRUE(daemon->Alive());
  EXPECT_EQ(daemon->Stop(), 0);
}

// The address and length of this process's mapping of the job's segment.
bool FindSegment(uint8_t** base, size_t* bytes) {
  std::ifstream maps("/proc/self/maps");
  std::string line;
  while (std::getline(maps, line)) {
    if (line.find("ciuic-fast-path") == std::string::npos) continue;
    unsigned long lo = 0, hi = 0;
    if (sscanf(line.c_str(), "%lx-%lx", &lo, &hi) != 2) return false;
    *base = reinterpret_cast<uint8_t*>(lo);
    *bytes = hi - lo;
    return true;
  }
  return false;
}

// A trainer writes garbage over its job's whole segment while another rank
// waits in it: the daemon stays up, `ciuicctl status/jobs` still answer,
// another job on the daemon keeps working on both paths, and the daemon
// still ends the scribbled job when its trainers go.
TEST(FastPathTest, GarbageInTheSegmentCannotHurtTheDaemon) {
  auto daemon = DaemonProcess::Start(Config(kLimit, 2000));
  ASSERT_NE(daemon, nullptr);
  const std::string bad = UniqueJobId("fpgarbage");
  const std::string good = UniqueJobId("fpgood");
  int ready[2], go[2];
  ASSERT_EQ(pipe(ready), 0);
  ASSERT_EQ(pipe(go), 0);
  std::vector<pid_t> bad_pids = SpawnRanks(2, [&](int rank) {
    auto comm = JoinJob(daemon->socket(), bad, rank, 2);
    CHILD_CHECK(comm != nullptr, "join");
    std::vector<float> v(16, 1.0f);
    CHILD_CHECK(comm->Allreduce(v.data(), v.data(), 16, DataType::kFloat32, ReduceOp::kSum).Wait().ok(), "warm");
    Handle waiting;
    if (rank == 1) {
      OpOptions o;
      o.name = "victim";
      waiting = comm->Allreduce(v.data(), v.data(), 16, DataType::kFloat32, ReduceOp::kSum, o);
    } else {
      uint8_t* base = nullptr;
      size_t bytes = 0;
      CHILD_CHECK(FindSegment(&base, &bytes), "no fast-path segment mapped");
      std::mt19937_64 rng(99);
      for (int pass = 0; pass < 3; ++pass) {
        for (size_t i = 0; i + 8 <= bytes; i += 8) {
          const uint64_t x = rng();
          std::memcpy(base + i, &x, 8);
        }
      }
    }
    CHILD_CHECK(write(ready[1], "r", 1) == 1, "pipe");
    char c;
    CHILD_CHECK(read(go[0], &c, 1) == 1, "pipe");
    if (rank == 1) {
      // Whatever it gets (an error, garbage), it gets it in bounded time.
      (void)waiting.WaitFor(std::chrono::seconds(10));
    }
    return 0;
  });
  char c;
  for (int i = 0; i < 2; ++i) ASSERT_EQ(read(ready[0], &c, 1), 1);
  int code = 0;
  std::string out = Ctl(*daemon, "status", &code);
  EXPECT_EQ(code, 0) << out;
  out = Ctl(*daemon, "--json jobs", &code);
  EXPECT_EQ(code, 0) << out;
  EXPECT_TRUE(Contains(out, bad)) << out;
  auto codes = RunRanks(2, [&](int rank) {
    auto comm = JoinJob(daemon->socket(), good, rank, 2);
    CHILD_CHECK(comm != nullptr, "join");
    for (size_t count : {size_t{3}, size_t{1024}, size_t{100000}}) {
      std::vector<float> v(count, rank + 1.0f);
      Status s = comm->Allreduce(v.data(), v.data(), count, DataType::kFloat32, ReduceOp::kSum).Wait();
      CHILD_CHECK(s.ok() && v[0] == 3.0f && v[count - 1] == 3.0f, "%zu: %s", count, s.ToString().c_str());
    }
    return 0;
  });
  for (int x : codes) EXPECT_EQ(x, 0) << daemon->Log();
  ASSERT_EQ(write(go[1], "gg", 2), 2);
  for (pid_t p : bad_pids) EXPECT_EQ(WaitChild(p, std::chrono::seconds(60)), 0) << daemon->Log();
  for (int fd : {ready[0], ready[1], go[0], go[1]}) close(fd);
  EXPECT_TRUE(daemon->Alive());
  out = Ctl(*daemon, "status", &code);
  EXPECT_EQ(code, 0) << out;
  EXPECT_EQ(daemon->Stop(), 0);
}

// ciuicctl counts fast-path operations and bytes and shows the pending ones
// with the ranks they wait for.
TEST(FastPathTest, CiuicctlCountsAndShowsPending) {
  auto daemon = DaemonProcess::Start(Config(kLimit));
  ASSERT_NE(daemon, nullptr);
  const std::string job = UniqueJobId("fpctl");
  int ready[2], release[2];
  ASSERT_EQ(pipe(ready), 0);
  ASSERT_EQ(pipe(release), 0);
  std::vector<pid_t> pids = SpawnRanks(2, [&](int rank) {
    auto comm = JoinJob(daemon->socket(), job, rank, 2);
    CHILD_CHECK(comm != nullptr, "join");
    std::vector<double> v(100, 1.0);
    for (int i = 0; i < 10; ++i) {
      CHILD_CHECK(comm->Allreduce(v.data(), v.data(), 100, DataType::kFloat64, ReduceOp::kSum).Wait().ok(), "op");
    }
    OpOptions o;
    o.name = "fast.stuck";
    Handle h;
    if (rank == 1) h = comm->Allreduce(v.data(), v.data(), 100, DataType::kFloat64, ReduceOp::kSum, o);
    CHILD_CHECK(write(ready[1], "r", 1) == 1, "pipe");
    char c;
    CHILD_CHECK(read(release[0], &c, 1) == 1, "pipe");
    if (rank == 0) h = comm->Allreduce(v.data(), v.data(), 100, DataType::kFloat64, ReduceOp::kSum, o);
    CHILD_CHECK(h.Wait().ok(), "stuck");
    return 0;
  });
  char c;
  for (int i = 0; i < 2; ++i) ASSERT_EQ(read(ready[0], &c, 1), 1);
  int code = 0;
  std::string out = Ctl(*daemon, "--json jobs", &code);
  EXPECT_EQ(code, 0) << out;
  EXPECT_TRUE(Contains(out, "\"opsCompleted\":\"10\"")) << out;
  EXPECT_TRUE(Contains(out, "\"bytesReduced\":\"8000\"")) << out;
  EXPECT_TRUE(Contains(out, "\"name\":\"fast.stuck\"")) << out;
  EXPECT_TRUE(Contains(out, "\"submittedRanks\":[1]")) << out;
  EXPECT_TRUE(Contains(out, "\"waitingForRanks\":[0]")) << out;
  ASSERT_EQ(write(release[1], "gg", 2), 2);
  for (pid_t p : pids) EXPECT_EQ(WaitChild(p, std::chrono::seconds(30)), 0) << daemon->Log();
  for (int fd : {ready[0], ready[1], release[0], release[1]}) close(fd);
  out = Ctl(*daemon, "--json status", &code);
  EXPECT_EQ(code, 0);
  EXPECT_TRUE(Contains(out, "\"opsCompleted\":\"11\"")) << out;
  EXPECT_EQ(daemon->Stop(), 0);
}

// The timeout holds on the fast path, naming the missing rank.
TEST(FastPathTest, TimeoutNamesTheMissingRank) {
  auto daemon = DaemonProcess::Start(Config(kLimit));
  ASSERT_NE(daemon, nullptr);
  const std::string job = UniqueJobId("fptimeout");
  auto codes = RunRanks(2, [&](int rank) {
    auto comm = JoinJob(daemon->socket(), job, rank, 2);
    CHILD_CHECK(comm != nullptr, "join");
    std::vector<int64_t> v(5, 1);
    if (rank == 0) {
      OpOptions o;
      o.name = "lonely";
      o.timeout_ms = 300;
      const auto t0 = Clock::now();
      Status s = comm->Allreduce(v.data(), v.data(), 5, DataType::kInt64, ReduceOp::kSum, o).Wait();
      const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - t0).count();
      CHILD_CHECK(s.code() == StatusCode::kDeadlineExceeded &&
                      Contains(s.message(), "operation 'lonely' of job '" + job + "' timed out") &&
                      Contains(s.message(), "waiting for rank(s) 1"),
                  "%s", s.ToString().c_str());
      CHILD_CHECK(ms >= 300 && ms < 1500, "timed out after %lld ms", static_cast<long long>(ms));
    }
    return comm->Barrier().Wait().ok() ? 0 : 1;
  });
  for (int c : codes) EXPECT_EQ(c, 0) << daemon->Log();
  EXPECT_EQ(daemon->Stop(), 0);
}

// --------------------------------------------------- paths across the limit
// Ranks whose operations of one name fall on different sides of the limit
// (count limit vs limit + 1, a dtype that doubles the size, a collective
// whose payload is world_size times larger) all get the mismatch error
// naming the operation and both signatures, within a few seconds although
// the op timeout is 60 s, in every arrival order; the job goes on.

enum class Kind { kSmall, kLargeCount, kLargeDtype, kAllgather };

// The signature as the error words it, and the submission.
const char* Words(Kind k) {
  switch (k) {
    case Kind::kSmall: return "allreduce float32 count=1024 op=sum";  // 4096 B: fits
    case Kind::kLargeCount: return "allreduce float32 count=1025 op=sum";
    case Kind::kLargeDtype: return "allreduce float64 count=1024 op=sum";
    case Kind::kAllgather: return "allgather float32 count=1024";  // 8192 B received
  }
  return "?";
}

Status SubmitKind(Communicator& comm, Kind k, const std::string& name) {
  static_assert(kLimit == 4096);
  std::vector<double> buf(1025 * 2, 1.0);
  OpOptions o;
  o.name = name;
  switch (k) {
    case Kind::kSmall:
      return comm.Allreduce(buf.data(), buf.data(), 1024, DataType::kFloat32, ReduceOp::kSum, o)
          .Wait();
    case Kind::kLargeCount:
      return comm.Allreduce(buf.data(), buf.data(), 1025, DataType::kFloat32, ReduceOp::kSum, o)
          .Wait();
    case Kind::kLargeDtype:
      return comm.Allreduce(buf.data(), buf.data(), 1024, DataType::kFloat64, ReduceOp::kSum, o)
          .Wait();
    case Kind::kAllgather: {
      std::vector<float> in(1024, 1.0f), out(1024 * comm.world_size());
      return comm.Allgather(in.data(), out.data(), 1024, DataType::kFloat32, o).Wait();
    }
  }
  return Status::Ok();
}

struct RouteCase {
  std::string name;
  std::vector<Kind> kinds;  // per rank
  std::vector<int> delay;   // per rank, in steps of 400 ms: the arrival order
};

// Runs the cases in one job, then normal traffic of small and large
// operations of many names in different orders on every rank.
int RunRouteCases(const std::string& socket, const std::string& job, int rank, int world,
                  const std::vector<RouteCase>& cases) {
  auto comm = JoinJob(socket, job, rank, world);
  CHILD_CHECK(comm != nullptr, "join");
  for (const RouteCase& c : cases) {
    // Line the ranks up first, so that the delays decide the arrival order.
    CHILD_CHECK(comm->Barrier().Wait().ok(), "barrier before %s", c.name.c_str());
    std::this_thread::sleep_for(std::chrono::milliseconds(400 * c.delay[rank]));
    const auto t0 = Clock::now();
    Status s = SubmitKind(*comm, c.kinds[rank], c.name);
    const auto ms =
        std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - t0).count();
    CHILD_CHECK(ms < 5000, "%s: the error took %lld ms", c.name.c_str(),
                static_cast<long long>(ms));
    CHILD_CHECK(s.code() == StatusCode::kInvalidArgument &&
                    Contains(s.message(), "operation '" + c.name + "' mismatched across ranks"),
                "%s rank %d: %s", c.name.c_str(), rank, s.ToString().c_str());
    for (int r = 0; r < world; ++r) {
      // Every distinct signature of the first two that differ is named.
      if (c.kinds[r] != c.kinds[0]) {
        CHILD_CHECK(Contains(s.message(), Words(c.kinds[0])) &&
                        Contains(s.message(), Words(c.kinds[r])),
                    "%s rank %d: %s", c.name.c_str(), rank, s.ToString().c_str());
        break;
      }
    }
  }
  // Normal traffic: sizes on both sides of the limit, many names, each rank
  // in its own order, names reused across rounds.
  std::mt19937 rng(rank * 7 + 3);
  for (int round = 0; round < 4; ++round) {
    constexpr int kNames = 40;
    std::vector<int> order(kNames);
    for (int i = 0; i < kNames; ++i) order[i] = i;
    std::shuffle(order.begin(), order.end(), rng);
    std::vector<std::vector<int32_t>> data(kNames);
    std::vector<Handle> handles(kNames);
    for (int n : order) {
      const size_t count = (n + round) % 3 == 0 ? 1024 + 1 + n * 17 : 1 + n * 25;  // 4 B each
      data[n].assign(count, (rank + 1) * (n + 1) + round);
      OpOptions o;
      o.name = "mixed." + std::to_string(n);
      handles[n] = comm->Allreduce(data[n].data(), data[n].data(), count, DataType::kInt32,
                                   ReduceOp::kSum, o);
    }
    const int32_t ranks_sum = world * (world + 1) / 2;
    for (int n = 0; n < kNames; ++n) {
      Status s = handles[n].Wait();
      CHILD_CHECK(s.ok(), "mixed.%d: %s", n, s.ToString().c_str());
      for (int32_t x : data[n]) {
        CHILD_CHECK(x == ranks_sum * (n + 1) + world * round, "mixed.%d = %d", n, x);
      }
    }
  }
  return 0;
}

TEST(FastPathTest, CountsDtypesAndCollectivesAcrossTheLimitFailPromptlyOnEveryRank) {
  auto daemon = DaemonProcess::Start(Config(kLimit, /*op_timeout_ms=*/60000));
  ASSERT_NE(daemon, nullptr);
  const std::string job = UniqueJobId("fproute");
  std::vector<RouteCase> cases;
  for (Kind large : {Kind::kLargeCount, Kind::kLargeDtype, Kind::kAllgather}) {
    const std::string what = large == Kind::kLargeCount   ? "count"
                             : large == Kind::kLargeDtype ? "dtype"
                                                          : "collective";
    cases.push_back({what + ".small_first", {Kind::kSmall, large}, {0, 1}});
    cases.push_back({what + ".large_first", {Kind::kSmall, large}, {1, 0}});
  }
  auto codes = RunRanks(2, [&](int rank) {
    return RunRouteCases(daemon->socket(), job, rank, 2, cases);
  });
  for (int c : codes) EXPECT_EQ(c, 0) << daemon->Log();
  EXPECT_EQ(daemon->Stop(), 0);
}

TEST(FastPathTest, AcrossTheLimitWithThreeRanksInEveryOrder) {
  auto daemon = DaemonProcess::Start(Config(kLimit, /*op_timeout_ms=*/60000));
  ASSERT_NE(daemon, nullptr);
  const std::string job = UniqueJobId("fproute3");
  const Kind S = Kind::kSmall, L = Kind::kLargeCount;
  std::vector<RouteCase> cases = {
      {"ssl", {S, S, L}, {0, 1, 2}}, {"sls", {S, S, L}, {0, 2, 1}},
      {"lss", {S, S, L}, {1, 2, 0}}, {"sll", {S, L, L}, {0, 1, 2}},
      {"lsl", {S, L, L}, {1, 0, 2}}, {"lls", {S, L, L}, {2, 0, 1}},
      {"together", {L, S, S}, {0, 0, 0}},
  };
  auto codes = RunRanks(3, [&](int rank) {
    return RunRouteCases(daemon->socket(), job, rank, 3, cases);
  });
  for (int c : codes) EXPECT_EQ(c, 0) << daemon->Log();
  EXPECT_EQ(daemon->Stop(), 0);
}

}  // namespace
}  // namespace ciuic::testing
