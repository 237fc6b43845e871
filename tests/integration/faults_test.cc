// What trainers and the outside world can do to the daemon: die mid-
// operation, write garbage into shared memory, speak garbage on the
// sockets, run as another user; and what trainers see when the daemon goes.
// The daemon must survive all of it and keep serving other jobs.
#include <dirent.h>
#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <random>
#include <set>
#include <thread>
#include <vector>

#include "common.h"
#include "harness.h"
#include "raw_session.h"
#include "cuda/gpu_info.h"

namespace ciuic::testing {
namespace {

using Clock = std::chrono::steady_clock;

int64_t MonotonicNs() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<int64_t>(ts.tv_sec) * 1000000000 + ts.tv_nsec;
}

std::set<std::string> DevShm() {
  std::set<std::string> names;
  if (DIR* d = opendir("/dev/shm")) {
    while (dirent* e = readdir(d)) names.insert(e->d_name);
    closedir(d);
  }
  return names;
}

TEST(FaultsTest, KilledTrainerFailsItsJobOnEveryOtherRankWithinTwoSeconds) {
  auto daemon = DaemonProcess::Start();
  ASSERT_NE(daemon, nullptr);
  const auto shm_before = DevShm();
  const std::string job = UniqueJobId("kill");
  int ready[2], report[2];
  ASSERT_EQ(pipe(ready), 0);
  ASSERT_EQ(pipe(report), 0);
  std::vector<pid_t> pids = SpawnRanks(3, [&](int rank) {
    auto comm = JoinJob(daemon->socket(), job, rank, 3);
    CHILD_CHECK(comm != nullptr, "join");
    std::vector<float> v(1 << 16, 1.0f);
    OpOptions o;
    o.name = "doomed";
    Handle h;
    if (rank < 2) h = comm->Allreduce(v.data(), v.data(), v.size(), DataType::kFloat32, ReduceOp::kSum, o);
    CHILD_CHECK(write(ready[1], "r", 1) == 1, "pipe");
    if (rank == 2) {
      pause();  // killed here, mid-operation for the others
      return 0;
    }
    Status s = h.Wait();
    int64_t at = MonotonicNs();
    CHILD_CHECK(write(report[1], &at, sizeof(at)) == sizeof(at), "pipe");
    CHILD_CHECK(s.code() == StatusCode::kAborted && Contains(s.message(), "rank 2") &&
                    Contains(s.message(), job),
                "%s", s.ToString().c_str());
    // Later operations of the failed job fail at once, too.
    s = comm->Barrier().Wait();
    CHILD_CHECK(s.code() == StatusCode::kAborted, "%s", s.ToString().c_str());
    return 0;
  });
  char c;
  for (int i = 0; i < 3; ++i) ASSERT_EQ(read(ready[0], &c, 1), 1);
  std::this_thread::sleep_for(std::chrono::milliseconds(200));  // both submissions reach the daemon
  const int64_t killed_at = MonotonicNs();
  kill(pids[2], SIGKILL);
  for (int i = 0; i < 2; ++i) {
    int64_t at = 0;
    ASSERT_EQ(read(report[0], &at, sizeof(at)), static_cast<ssize_t>(sizeof(at)));
    EXPECT_LT(at - killed_at, 2'000'000'000) << "rank learned of the death too late";
  }
  EXPECT_EQ(WaitChild(pids[0], std::chrono::seconds(30)), 0);
  EXPECT_EQ(WaitChild(pids[1], std::chrono::seconds(30)), 0);
  EXPECT_EQ(WaitChild(pids[2], std::chrono::seconds(30)), 128 + SIGKILL);
  for (int fd : {ready[0], ready[1], report[0], report[1]}) close(fd);

  EXPECT_TRUE(daemon->Alive());
  ExpectServes(daemon->socket());
  EXPECT_EQ(DevShm(), shm_before) << "something was left in /dev/shm";
  EXPECT_EQ(daemon->Stop(), 0);
}

// Garbage in the submission ring gives that session errors, never a crash;
// an impossible ring index closes that session; other jobs carry on.
TEST(FaultsTest, GarbageDescriptorsAndRingIndicesNeverHurtTheDaemon) {
  auto daemon = DaemonProcess::Start();
  ASSERT_NE(daemon, nullptr);
  const std::string job = UniqueJobId("garbage");
  auto codes = RunRanks(1, [&](int) {
    RawSession raw;
    CHILD_CHECK(raw.Open(daemon->socket(), 1 << 20), "open");
    std::string msg;
    CHILD_CHECK(raw.Join(daemon->socket(), job, 0, 2, &msg) == 0, "join: %s", msg.c_str());

    // Targeted garbage: each must come back as INVALID_ARGUMENT naming the
    // problem (device buffers: FAILED_PRECONDITION saying why not).
    auto base = [] {
      return Entry(0, wire::Collective::kAllreduce, wire::DataType::kFloat32,
                   wire::ReduceOp::kSum, 16, wire::kDataOffset, wire::kDataOffset, "g");
    };
    struct Case {
      wire::SubmissionEntry e;
      const char* words;
      int code;
    };
    std::vector<Case> cases;
    auto add = [&](auto mutate, const char* words, int code = 3) {
      wire::SubmissionEntry e = base();
      mutate(e);
      e.op_id = 1000 + cases.size();
      cases.push_back({e, words, code});
    };
    add([](auto& e) { e.dtype = 99; }, "unknown dtype 99");
    add([](auto& e) { e.collective = 0; }, "unknown collective 0");
    add([](auto& e) { e.reduce_op = 77; }, "77");
    add([](auto& e) { e.send_offset = 0; }, "outside the session's arena");
    add([](auto& e) { e.recv_offset = ~0ull - 8; }, "outside the session's arena");
    add([](auto& e) { e.count = ~0ull / 2; }, "too large");
    add([](auto& e) { e.count = 1ull << 40; }, "outside the session's arena");
    add([](auto& e) { e.name_len = 5000; }, "name length");
    add([](auto& e) { e.flags = 4; }, "reserved flags");
    add([](auto& e) { e.name[0] = '\xff'; }, "not valid UTF-8");
    // Device buffers: a descriptor record at kDataOffset + 4096 naming
    // device 1000. A daemon without a GPU says why it takes no device
    // buffers (FAILED_PRECONDITION); one with a GPU refuses the device.
    wire::DeviceBufferDescriptor d{};
    d.allocation_bytes = 1 << 20;
    d.device = 1000;
    std::memcpy(raw.base + wire::kDataOffset + 4096, &d, sizeof(d));
    const daemon::GpuProbe& gpus = daemon::ProbeGpus();
    const bool has_gpu = gpus.built_with_cuda && !gpus.devices.empty();
    add([](auto& e) {
          e.flags = wire::kSubmitFlagDeviceBuffers;
          e.send_offset = e.recv_offset = wire::kDataOffset + 4096;
        },
        has_gpu ? "device 1000 is not one of" : "device (CUDA) buffers: ", has_gpu ? 3 : 9);
    add([](auto& e) {
          e.flags = wire::kSubmitFlagDeviceBuffers;
          e.send_offset = wire::kDataOffset + 4;
        }, "send device descriptor at offset");
    add([](auto& e) {
          e.flags = wire::kSubmitFlagDeviceBuffers;
          e.recv_offset = 8;
        }, "recv device descriptor: ");
    add([](auto& e) {
          e.flags = wire::kSubmitFlagDeviceBuffers;
          e.collective = static_cast<uint32_t>(wire::Collective::kBarrier);
          e.count = 0;
        }, "device-buffer flag does not apply");
    add([](auto& e) { e.recv_offset += 4; }, "overlap");
    // alltoallv: its counts (2 x world 2) read out of the arena and checked.
    const uint64_t counts[4] = {~0ull / 4, 1, 1, 1};
    std::memcpy(raw.base + wire::kDataOffset + 8192, counts, sizeof(counts));
    auto v = [](uint64_t at) {
      return [at](auto& e) {
        e.collective = static_cast<uint32_t>(wire::Collective::kAlltoallv);
        e.count = 0;
        e.splits_offset = at;
      };
    };
    add(v(wire::kDataOffset + 8192 + 4), "not 8-byte aligned");
    add(v(16), "alltoallv counts: ");
    add(v(~0ull - 7), "alltoallv counts: ");
    add(v(wire::kDataOffset + 8192), "send counts add up to too many elements");
    // On device buffers the counts are checked alike.
    add([v](auto& e) {
          v(wire::kDataOffset + 8192)(e);
          e.flags = wire::kSubmitFlagDeviceBuffers;
        }, "send counts add up to too many elements");
    for (auto& c : cases) raw.Submit(c.e);
    for (size_t i = 0; i < cases.size(); ++i) {
      wire::CompletionEntry done;
      CHILD_CHECK(raw.NextCompletion(&done, 5000), "no completion for case %zu", i);
      std::string text = MessageOf(done);
      CHILD_CHECK(done.op_id == cases[done.op_id - 1000].e.op_id, "op id");
      CHILD_CHECK(done.status_code == cases[done.op_id - 1000].code &&
                      Contains(text, cases[done.op_id - 1000].words),
                  "case %llu: code %d: %s", (unsigned long long)done.op_id, done.status_code,
                  text.c_str());
    }

    // Random bytes: whatever happens, the daemon answers or hangs up.
    std::mt19937_64 rng(42);
    for (int i = 0; i < 300; ++i) {
      wire::SubmissionEntry e;
      for (size_t b = 0; b < sizeof(e); b += 8) {
        uint64_t r = rng();
        std::memcpy(reinterpret_cast<char*>(&e) + b, &r, std::min<size_t>(8, sizeof(e) - b));
      }
      raw.Submit(e);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(300));

    // An impossible tail: the daemon drops the session.
    raw.header()->sq_tail.store(raw.header()->sq_tail.load() + 100000);
    uint64_t one = 1;
    CHILD_CHECK(write(raw.doorbell, &one, sizeof(one)) == sizeof(one), "doorbell");
    CHILD_CHECK(raw.HungUp(5000), "daemon kept a session with a corrupt ring");
    return 0;
  }, std::chrono::seconds(60));
  EXPECT_EQ(codes[0], 0);
  EXPECT_TRUE(daemon->Alive());

  // Garbage on the session socket and the control socket.
  for (int i = 0; i < 3; ++i) {
    int fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    std::string path = daemon->socket() + ".session";
    std::memcpy(addr.sun_path, path.data(), path.size());
    ASSERT_EQ(connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
    const char junk[] = "GET / HTTP/1.0\r\n\r\n this is not a hello";
    if (i < 2) send(fd, junk, i == 0 ? sizeof(junk) : 3, MSG_NOSIGNAL);
    close(fd);  // i == 2: connect and say nothing
  }
  {
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    std::memcpy(addr.sun_path, daemon->socket().data(), daemon->socket().size());
    ASSERT_EQ(connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
    const char junk[] = "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\xff\xff\xff\x00garbage frames";
    send(fd, junk, sizeof(junk), MSG_NOSIGNAL);
    close(fd);
  }
  EXPECT_TRUE(daemon->Alive());
  ExpectServes(daemon->socket());
  EXPECT_EQ(daemon->Stop(), 0);
}

TEST(FaultsTest, UnknownSessionTokenCannotJoin) {
  auto daemon = DaemonProcess::Start();
  ASSERT_NE(daemon, nullptr);
  auto codes = RunRanks(1, [&](int) {
    RawSession raw;
    CHILD_CHECK(raw.Open(daemon->socket(), 1 << 20), "open");
    raw.token[0] ^= 1;  // a guess, not the token the daemon handed out
    std::string msg;
    int code = raw.Join(daemon->socket(), UniqueJobId("token"), 0, 1, &msg);
    CHILD_CHECK(code == 16 && Contains(msg, "session token"), "code %d: %s", code, msg.c_str());
    return 0;
  });
  EXPECT_EQ(codes[0], 0);
  EXPECT_EQ(daemon->Stop(), 0);
}

TEST(FaultsTest, TrainersLearnWhenTheDaemonStopsOrDies) {
  for (int sig : {SIGTERM, SIGKILL}) {
    auto daemon = DaemonProcess::Start();
    ASSERT_NE(daemon, nullptr);
    const std::string job = UniqueJobId("daemon-gone");
    int ready[2];
    ASSERT_EQ(pipe(ready), 0);
    std::vector<pid_t> pids = SpawnRanks(1, [&](int) {
      auto comm = JoinJob(daemon->socket(), job, 0, 2);
      CHILD_CHECK(comm != nullptr, "join");
      std::vector<float> v(8, 1.0f);
      Handle h = comm->Allreduce(v.data(), v.data(), 8, DataType::kFloat32, ReduceOp::kSum);
      CHILD_CHECK(write(ready[1], "r", 1) == 1, "pipe");
      auto t0 = Clock::now();
      Status s = h.Wait();
      CHILD_CHECK(s.code() == StatusCode::kUnavailable, "%s", s.ToString().c_str());
      CHILD_CHECK(Clock::now() - t0 < std::chrono::seconds(5), "noticed too late");
      return 0;
    });
    char c;
    ASSERT_EQ(read(ready[0], &c, 1), 1);
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    if (sig == SIGTERM) {
      EXPECT_EQ(daemon->Stop(), 0) << "SIGTERM must drain and exit 0";
    } else {
      kill(daemon->pid(), SIGKILL);
    }
    EXPECT_EQ(WaitChild(pids[0], std::chrono::seconds(30)), 0) << "signal " << sig;
    close(ready[0]);
    close(ready[1]);
  }
}

// Jobs are per user: the same job id under two uids is two jobs that never
// exchange data; a user cannot reach another's session memory through /proc.
// A daemon stopped (SIGSTOP: a debugger, a swapping node) with an
// operation in flight: Wait() without a timeout still returns, once the
// operation is long past its deadlines (twice its timeout and the grace,
// shortened here), saying the daemon is stopped or hung.
TEST(FaultsTest, WaitReturnsWhenTheDaemonIsStopped) {
  auto daemon = DaemonProcess::Start("tuning:\n  op_timeout_ms: 500\n");
  ASSERT_NE(daemon, nullptr);
  const std::string job = UniqueJobId("stopped-daemon");
  int submitted[2], release[2];
  ASSERT_EQ(pipe(submitted), 0);
  ASSERT_EQ(pipe(release), 0);
  std::vector<pid_t> pids = SpawnRanks(2, [&](int rank) {
    setenv("CIUIC_WAIT_GRACE_MS", "1000", 1);
    auto comm = JoinJob(daemon->socket(), job, rank, 2);
    CHILD_CHECK(comm != nullptr, "join");
    if (rank == 1) {  // joins, never submits
      char c;
      CHILD_CHECK(read(release[0], &c, 1) == 1, "pipe");
      return 0;
    }
    std::vector<float> v(1 << 14, 1.0f);
    OpOptions o;
    o.name = "lonely";
    Handle h = comm->Allreduce(v.data(), v.data(), v.size(), DataType::kFloat32, ReduceOp::kSum, o);
    CHILD_CHECK(write(submitted[1], "s", 1) == 1, "pipe");
    const auto start = Clock::now();
    Status s = h.Wait();
    const double took = std::chrono::duration<double>(Clock::now() - start).count();
    CHILD_CHECK(s.code() == StatusCode::kDeadlineExceeded &&
                    Contains(s.message(), "stopped or hung") && Contains(s.message(), "lonely"),
                "%s", s.ToString().c_str());
    CHILD_CHECK(took > 1.0 && took < 10.0, "Wait() returned after %.1f s", took);
    return 0;
  });
  char c;
  ASSERT_EQ(read(submitted[0], &c, 1), 1);
  ASSERT_EQ(kill(daemon->pid(), SIGSTOP), 0);
  EXPECT_EQ(WaitChild(pids[0], std::chrono::seconds(30)), 0);
  ASSERT_EQ(kill(daemon->pid(), SIGCONT), 0);
  ASSERT_EQ(write(release[1], "r", 1), 1);
  EXPECT_EQ(WaitChild(pids[1], std::chrono::seconds(30)), 0);
  EXPECT_TRUE(daemon->Alive());
  ExpectServes(daemon->socket());
  EXPECT_EQ(daemon->Stop(), 0);
}

// `systemctl restart ciuicd` under running trainers: an operation in
// flight ends with UNAVAILABLE saying the daemon went, every later call on
// the old communicator fails the same way at once, and a trainer that joins
// again (as torchrun's elastic agent restarts its workers, or a trainer
// calls ciuic.init() again) runs on the new daemon.
TEST(FaultsTest, TrainersRejoinADaemonRestartedUnderThem) {
  auto daemon = DaemonProcess::Start();
  ASSERT_NE(daemon, nullptr);
  const std::string job = UniqueJobId("restart");
  int submitted[2], restarted[2];
  ASSERT_EQ(pipe(submitted), 0);
  ASSERT_EQ(pipe(restarted), 0);
  std::vector<pid_t> pids = SpawnRanks(2, [&](int rank) {
    auto comm = JoinJob(daemon->socket(), job, rank, 2);
    CHILD_CHECK(comm != nullptr, "join");
    std::vector<int32_t> v(1000, rank + 1);
    Status s = comm->Allreduce(v.data(), v.data(), v.size(), DataType::kInt32, ReduceOp::kSum).Wait();
    CHILD_CHECK(s.ok() && v[0] == 3, "before: %s", s.ToString().c_str());
    Handle pending;
    if (rank == 0) {  // waits for rank 1, which never submits it
      OpOptions o;
      o.name = "across-the-restart";
      pending = comm->Allreduce(v.data(), v.data(), v.size(), DataType::kInt32, ReduceOp::kSum, o);
    }
    CHILD_CHECK(write(submitted[1], "s", 1) == 1, "pipe");
    if (rank == 0) {
      s = pending.WaitFor(std::chrono::seconds(20));
      CHILD_CHECK(s.code() == StatusCode::kUnavailable, "in flight: %s", s.ToString().c_str());
      fprintf(stderr, "in flight across the restart: %s\n", s.ToString().c_str());
    }
    char c;
    CHILD_CHECK(read(restarted[0], &c, 1) == 1, "pipe");
    s = comm->Allreduce(v.data(), v.data(), v.size(), DataType::kInt32, ReduceOp::kSum).Wait();
    CHILD_CHECK(s.code() == StatusCode::kUnavailable, "old communicator: %s", s.ToString().c_str());
    comm.reset();
    comm = JoinJob(daemon->socket(), job, rank, 2);
    CHILD_CHECK(comm != nullptr, "join the new daemon");
    v.assign(1000, 10 * (rank + 1));
    s = comm->Allreduce(v.data(), v.data(), v.size(), DataType::kInt32, ReduceOp::kSum).Wait();
    CHILD_CHECK(s.ok() && v[999] == 30, "after: %s", s.ToString().c_str());
    return 0;
  });
  char c;
  ASSERT_EQ(read(submitted[0], &c, 1), 1);
  ASSERT_EQ(read(submitted[0], &c, 1), 1);
  int stopped = -1;
  ASSERT_TRUE(daemon->Restart(&stopped));
  EXPECT_EQ(stopped, 0) << "the old daemon did not drain cleanly";
  ASSERT_EQ(write(restarted[1], "rr", 2), 2);
  for (pid_t p : pids) EXPECT_EQ(WaitChild(p, std::chrono::seconds(60)), 0) << daemon->Log();
  EXPECT_EQ(daemon->Stop(), 0);
}

TEST(FaultsTest, TwoUsersNeverShareAJobOrMemory) {
  if (geteuid() != 0) GTEST_SKIP() << "needs root to run a trainer as another uid";
  auto daemon = DaemonProcess::Start();
  ASSERT_NE(daemon, nullptr);
  const std::string job = UniqueJobId("shared-name");
  const uid_t kNobody = 65534;
  // Ranks 0,1 as root and ranks 0,1 as nobody, all naming the same job.
  auto codes = RunRanks(4, [&](int child) {
    const bool nobody = child >= 2;
    const int rank = child % 2;
    if (nobody) {
      CHILD_CHECK(setgid(kNobody) == 0 && setuid(kNobody) == 0, "drop privileges");
    }
    auto comm = JoinJob(daemon->socket(), job, rank, 2);
    CHILD_CHECK(comm != nullptr, "join as %s", nobody ? "nobody" : "root");
    const int32_t mine = (nobody ? 100 : 1) * (rank + 1);
    std::vector<int32_t> v(64, mine);
    OpOptions o;
    o.name = "w";
    o.timeout_ms = 10000;
    Status s = comm->Allreduce(v.data(), v.data(), v.size(), DataType::kInt32, ReduceOp::kSum, o).Wait();
    CHILD_CHECK(s.ok(), "%s", s.ToString().c_str());
    const int32_t want = nobody ? 300 : 3;  // only this user's two ranks
    CHILD_CHECK(v[0] == want, "got %d, want %d: data crossed users", v[0], want);
    if (nobody) {
      // The daemon's fds (every session memfd among them) are out of reach.
      std::string dir = "/proc/" + std::to_string(daemon->pid()) + "/fd";
      for (int fd = 0; fd < 64; ++fd) {
        int got = open((dir + "/" + std::to_string(fd)).c_str(), O_RDONLY);
        CHILD_CHECK(got < 0, "nobody opened ciuicd's fd %d", fd);
      }
    }
    return 0;
  });
  EXPECT_EQ(codes, (std::vector<int>{0, 0, 0, 0}));
  EXPECT_EQ(daemon->Stop(), 0);
}

}  // namespace
}  // namespace ciuic::testing
