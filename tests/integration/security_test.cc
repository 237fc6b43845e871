// A daemon that every local user shares (README, "Security"): what one user
// can do to it and to the others. Each test plays a hostile or careless
// user and checks the daemon refuses with a clear error naming the rule or
// limit, and goes on serving everyone else.
#include <grp.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <fstream>
#include <thread>
#include <vector>

#include "ciuic/control.grpc.pb.h"
#include "common.h"
#include "grpcpp/grpcpp.h"
#include "harness.h"
#include "raw_session.h"

namespace ciuic::testing {
namespace {

using Clock = std::chrono::steady_clock;
constexpr uid_t kNobody = 65534;

bool DropToNobody() { return setgid(kNobody) == 0 && setuid(kNobody) == 0; }

std::unique_ptr<proto::Control::Stub> Stub(const std::string& socket) {
  return proto::Control::NewStub(
      grpc::CreateChannel("unix:" + socket, grpc::InsecureChannelCredentials()));
}

grpc::Status TuneSet(const std::string& socket, const std::string& key, const std::string& value) {
  auto stub = Stub(socket);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  proto::TuneSetRequest req;
  req.set_key(key);
  req.set_value(value);
  proto::TuneSetReply reply;
  return stub->TuneSet(&ctx, req, &reply);
}

grpc::Status GetStatus(const std::string& socket, proto::StatusReply* reply) {
  auto stub = Stub(socket);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  return stub->GetStatus(&ctx, proto::StatusRequest(), reply);
}


TEST(SecurityTest, AHugeWorldSizeIsRefusedAtJoinAndTheDaemonLives) {
  auto daemon = DaemonProcess::Start();
  ASSERT_NE(daemon, nullptr);
  const std::string job = UniqueJobId("huge-world");
  auto codes = RunRanks(1, [&](int) {
    RawSession raw;
    CHILD_CHECK(raw.Open(daemon->socket(), 1 << 20), "open");
    std::string msg;
    int code = raw.Join(daemon->socket(), job, 0, 2000000000, &msg);
    CHILD_CHECK(code == static_cast<int>(grpc::StatusCode::INVALID_ARGUMENT) &&
                    msg.find("max_world_size") != std::string::npos &&
                    msg.find("2000000000") != std::string::npos,
                "join: code %d: %s", code, msg.c_str());
    // The session has no job: a submission fails cleanly.
    wire::SubmissionEntry e{};
    e.op_id = 7;
    e.collective = static_cast<uint32_t>(wire::Collective::kBarrier);
    raw.Submit(e);
    wire::CompletionEntry c{};
    CHILD_CHECK(raw.NextCompletion(&c, 5000) && c.op_id == 7 && c.status_code != 0,
                "no clean refusal of the barrier");
    // Within the limit but above what one uid may run on a node.
    code = raw.Join(daemon->socket(), job, 0, 60000, &msg);
    CHILD_CHECK(code == static_cast<int>(grpc::StatusCode::INVALID_ARGUMENT) &&
                    msg.find("max_sessions_per_uid") != std::string::npos,
                "join 60000 local ranks: code %d: %s", code, msg.c_str());
    return 0;
  });
  EXPECT_EQ(codes, (std::vector<int>{0}));
  ASSERT_TRUE(daemon->Alive()) << daemon->Log();
  ExpectServes(daemon->socket());
}

TEST(SecurityTest, OnlyAdministratorsTuneAndTheLogSaysWho) {
  if (geteuid() != 0) GTEST_SKIP() << "needs root to call as another uid";
  auto daemon = DaemonProcess::Start();
  ASSERT_NE(daemon, nullptr);
  auto codes = RunRanks(1, [&](int) {
    CHILD_CHECK(DropToNobody(), "drop privileges");
    grpc::Status s = TuneSet(daemon->socket(), "op_timeout_ms", "100");
    CHILD_CHECK(s.error_code() == grpc::StatusCode::PERMISSION_DENIED &&
                    s.error_message().find("admin_group") != std::string::npos &&
                    s.error_message().find("uid 65534") != std::string::npos,
                "nobody's tune set: %d %s", s.error_code(), s.error_message().c_str());
    s = TuneSet(daemon->socket(), "compression", "topk:0.01");
    CHILD_CHECK(s.error_code() == grpc::StatusCode::PERMISSION_DENIED, "compression: %s",
                s.error_message().c_str());
    return 0;
  });
  EXPECT_EQ(codes, (std::vector<int>{0}));
  // Nothing changed; root may change it, and the log names both callers.
  std::string out;
  ASSERT_EQ(RunCommand(CiuicctlPath() + " --socket " + daemon->socket() + " tune get op_timeout_ms", &out), 0) << out;
  EXPECT_TRUE(Contains(out, "60000")) << out;
  ASSERT_EQ(RunCommand(CiuicctlPath() + " --socket " + daemon->socket() + " tune set op_timeout_ms=30000", &out), 0) << out;
  ASSERT_EQ(RunCommand(CiuicctlPath() + " --socket " + daemon->socket() + " tune get op_timeout_ms", &out), 0) << out;
  EXPECT_TRUE(Contains(out, "30000")) << out;
  const std::string log = daemon->Log();
  EXPECT_TRUE(Contains(log, "tuning refused: uid 65534")) << log;
  EXPECT_TRUE(Contains(log, "tuning: uid 0")) << log;
  EXPECT_EQ(daemon->Stop(), 0);
}

TEST(SecurityTest, TheAdminGroupMayTune) {
  if (geteuid() != 0) GTEST_SKIP() << "needs root to call as another uid";
  const group* adm = getgrnam("adm");
  ASSERT_NE(adm, nullptr);
  const gid_t adm_gid = adm->gr_gid;
  auto daemon = DaemonProcess::Start("admin_group: adm\n");
  ASSERT_NE(daemon, nullptr);
  auto codes = RunRanks(1, [&](int) {
    CHILD_CHECK(setgroups(1, &adm_gid) == 0 && setgid(kNobody) == 0 && setuid(kNobody) == 0,
                "become nobody in group adm");
    grpc::Status s = TuneSet(daemon->socket(), "spin_us", "10");
    CHILD_CHECK(s.ok(), "adm member's tune set: %s", s.error_message().c_str());
    return 0;
  });
  EXPECT_EQ(codes, (std::vector<int>{0}));
  EXPECT_EQ(daemon->Stop(), 0);
}

TEST(SecurityTest, OtherUsersJobsShowOnlyAsCounts) {
  if (geteuid() != 0) GTEST_SKIP() << "needs root to call as another uid";
  auto daemon = DaemonProcess::Start();
  ASSERT_NE(daemon, nullptr);
  const std::string job = UniqueJobId("private-job");
  int go[2], joined[2];
  ASSERT_EQ(pipe(go), 0);
  ASSERT_EQ(pipe(joined), 0);
  // Root's job: two ranks that run one operation, then wait for the test.
  std::vector<pid_t> ranks = SpawnRanks(2, [&](int rank) {
    auto comm = JoinJob(daemon->socket(), job, rank, 2);
    CHILD_CHECK(comm != nullptr, "join");
    std::vector<float> v(4096, 1.0f);
    OpOptions o;
    o.name = "secret-layer";
    Status s = comm->Allreduce(v.data(), v.data(), v.size(), DataType::kFloat32, ReduceOp::kSum, o).Wait();
    CHILD_CHECK(s.ok(), "%s", s.ToString().c_str());
    CHILD_CHECK(write(joined[1], "j", 1) == 1, "pipe");
    char c;
    CHILD_CHECK(read(go[0], &c, 1) == 1, "pipe");
    return 0;
  });
  char c;
  ASSERT_EQ(read(joined[0], &c, 1), 1);
  ASSERT_EQ(read(joined[0], &c, 1), 1);
  auto codes = RunRanks(2, [&](int who) {
    const bool nobody = who == 1;
    if (nobody) CHILD_CHECK(DropToNobody(), "drop privileges");
    proto::StatusReply st;
    grpc::Status s = GetStatus(daemon->socket(), &st);
    CHILD_CHECK(s.ok(), "status: %s", s.error_message().c_str());
    auto stub = Stub(daemon->socket());
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    proto::TraceReply trace;
    s = stub->GetTrace(&ctx, proto::TraceRequest(), &trace);
    CHILD_CHECK(s.ok(), "trace: %s", s.error_message().c_str());
    if (nobody) {
      CHILD_CHECK(st.jobs_size() == 0 && st.sessions_size() == 0, "nobody sees root's job");
      CHILD_CHECK(st.other_users_jobs() == 1 && st.other_users_sessions() == 2,
                  "counts %u jobs, %u sessions", st.other_users_jobs(), st.other_users_sessions());
      CHILD_CHECK(trace.ops_size() == 0 && trace.other_users_ops() >= 1,
                  "nobody's trace: %d ops, %u hidden", trace.ops_size(), trace.other_users_ops());
      for (const auto& op : trace.ops()) {
        CHILD_CHECK(op.name() != "secret-layer", "nobody read root's operation name");
      }
    } else {
      bool found = false;
      for (const auto& j : st.jobs()) found |= j.job_id() == job;
      CHILD_CHECK(found && st.other_users_jobs() == 0, "root does not see its job in full");
      bool named = false;
      for (const auto& op : trace.ops()) named |= op.name() == "secret-layer";
      CHILD_CHECK(named, "root's trace lacks its operation");
    }
    return 0;
  });
  EXPECT_EQ(codes, (std::vector<int>{0, 0}));
  ASSERT_EQ(write(go[1], "gg", 2), 2);
  for (pid_t p : ranks) EXPECT_EQ(WaitChild(p, std::chrono::seconds(30)), 0);
  EXPECT_EQ(daemon->Stop(), 0);
}

TEST(SecurityTest, SessionAndArenaLimitsPerUidNameTheirKeys) {
  auto daemon = DaemonProcess::Start(
      "max_sessions_per_uid: 2\nmax_arena_bytes_per_uid: 40M\nmax_jobs_per_uid: 1\n");
  ASSERT_NE(daemon, nullptr);
  auto codes = RunRanks(1, [&](int) {
    auto a = std::make_unique<RawSession>();
    RawSession too_big, b, third;
    CHILD_CHECK(a->Open(daemon->socket(), 16 << 20), "first session");
    CHILD_CHECK(!too_big.Open(daemon->socket(), 32 << 20) &&
                    too_big.refusal.find("max_arena_bytes_per_uid") != std::string::npos,
                "arena over the uid's share: '%s'", too_big.refusal.c_str());
    CHILD_CHECK(b.Open(daemon->socket(), 16 << 20), "second session");
    CHILD_CHECK(!third.Open(daemon->socket(), 1 << 20) &&
                    third.refusal.find("max_sessions_per_uid") != std::string::npos,
                "third session: '%s'", third.refusal.c_str());
    std::string msg;
    CHILD_CHECK(a->Join(daemon->socket(), "limits-a", 0, 2, &msg) == 0, "join: %s", msg.c_str());
    const int code = b.Join(daemon->socket(), "limits-b", 0, 1, &msg);
    CHILD_CHECK(code == static_cast<int>(grpc::StatusCode::RESOURCE_EXHAUSTED) &&
                    msg.find("max_jobs_per_uid") != std::string::npos,
                "second job: %d %s", code, msg.c_str());
    // A session's share comes back once the daemon has closed it.
    a.reset();
    bool reopened = false;
    for (int i = 0; i < 50 && !reopened; ++i) {
      RawSession again;
      reopened = again.Open(daemon->socket(), 1 << 20);
      if (!reopened) std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
    CHILD_CHECK(reopened, "no session after another closed");
    return 0;
  });
  EXPECT_EQ(codes, (std::vector<int>{0}));
  ASSERT_TRUE(daemon->Alive()) << daemon->Log();
  if (geteuid() == 0) {  // another uid keeps its own share
    codes = RunRanks(1, [&](int) {
      CHILD_CHECK(DropToNobody(), "drop privileges");
      RawSession s;
      CHILD_CHECK(s.Open(daemon->socket(), 32 << 20), "nobody: '%s'", s.refusal.c_str());
      return 0;
    });
    EXPECT_EQ(codes, (std::vector<int>{0}));
  }
  EXPECT_EQ(daemon->Stop(), 0);
}

// Seconds that a fresh 2-rank job takes to join and run 200 8-byte
// allreduces (rank 0's view), or a negative number if it failed.
double SmallAllreduceSeconds(const DaemonProcess& daemon) {
  auto* seconds = static_cast<double*>(
      mmap(nullptr, sizeof(double), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0));
  if (seconds == MAP_FAILED) return -1;
  *seconds = -1;
  const std::string job = UniqueJobId("victim");
  auto codes = RunRanks(2, [&](int rank) {
    const auto start = Clock::now();
    auto comm = JoinJob(daemon.socket(), job, rank, 2);
    CHILD_CHECK(comm != nullptr, "join");
    OpOptions o;
    o.timeout_ms = 20000;
    int64_t v = 0;
    for (int i = 0; i < 200; ++i) {
      v = rank + i;
      Status s = comm->Allreduce(&v, &v, 1, DataType::kInt64, ReduceOp::kSum, o).Wait();
      CHILD_CHECK(s.ok() && v == 1 + 2 * i, "op %d: %s", i, s.ToString().c_str());
    }
    if (rank == 0) *seconds = std::chrono::duration<double>(Clock::now() - start).count();
    return 0;
  }, std::chrono::seconds(60));
  const double result = codes == std::vector<int>{0, 0} ? *seconds : -1;
  munmap(seconds, sizeof(double));
  return result;
}

// One trainer keeps its ring full of submissions that fail at once (and
// reaps their completions): another job's small allreduces keep their pace.
// (Before the engine took a bounded number of submissions per session and
// pass, this flood made them 5 to 100 times slower here: 0.36 to 6 s.)
TEST(SecurityTest, AFloodedRingDoesNotStarveOtherJobs) {
  auto daemon = DaemonProcess::Start();
  ASSERT_NE(daemon, nullptr);
  const double quiet = SmallAllreduceSeconds(*daemon);
  ASSERT_GT(quiet, 0) << daemon->Log();
  auto* stop = static_cast<std::atomic<bool>*>(mmap(nullptr, sizeof(std::atomic<bool>),
                                                    PROT_READ | PROT_WRITE,
                                                    MAP_SHARED | MAP_ANONYMOUS, -1, 0));
  ASSERT_NE(stop, MAP_FAILED);
  new (stop) std::atomic<bool>(false);
  std::vector<pid_t> flooder = SpawnRanks(1, [&](int) {
    RawSession raw;
    CHILD_CHECK(raw.Open(daemon->socket(), 1 << 20), "open");
    std::string msg;
    CHILD_CHECK(raw.Join(daemon->socket(), UniqueJobId("flood"), 0, 1, &msg) == 0, "%s", msg.c_str());
    wire::SubmissionEntry e{};
    e.collective = 999;  // refused at once: completes immediately
    uint64_t submitted = 0, completed = 0;
    const auto end = Clock::now() + std::chrono::seconds(60);
    while (!stop->load() && Clock::now() < end) {
      while (submitted - completed < wire::kRingCapacity / 2) {
        e.op_id = ++submitted;
        raw.Submit(e);
      }
      wire::CompletionEntry c{};
      while (raw.NextCompletion(&c, 0)) ++completed;
    }
    return 0;
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(300));  // the flood is on
  const double flooded = SmallAllreduceSeconds(*daemon);
  stop->store(true);
  EXPECT_GT(flooded, 0) << "the victim's operations failed\n" << daemon->Log();
  std::printf("a fresh job joined and ran 200 small allreduces in %.3f s beside the flood, %.3f s without\n", flooded, quiet);
  // Generous against a busy machine, far below what starvation costs.
  EXPECT_LT(flooded, std::max(1.0, 8 * quiet))
      << "200 small allreduces took " << flooded << " s beside the flood, " << quiet
      << " s without";
  EXPECT_EQ(WaitChild(flooder[0], std::chrono::seconds(10)), 0);
  EXPECT_TRUE(daemon->Alive());
  EXPECT_EQ(daemon->Stop(), 0);
  munmap(stop, sizeof(std::atomic<bool>));
}

TEST(SecurityTest, TheSdkRefusesADaemonImpostor) {
  if (geteuid() != 0) GTEST_SKIP() << "needs root to serve a socket as another uid";
  char dir_template[] = "/tmp/ciuic-impostor-XXXXXX";
  ASSERT_NE(mkdtemp(dir_template), nullptr);
  const std::string dir = dir_template;
  ASSERT_EQ(chmod(dir.c_str(), 0755), 0);
  const std::string path = dir + "/ciuicd.sock";
  int ready[2];
  ASSERT_EQ(pipe(ready), 0);
  // The socket file sits in root's directory, but the process that listens
  // on it (and so answers for it) runs as nobody.
  pid_t impostor = fork();
  ASSERT_GE(impostor, 0);
  if (impostor == 0) {
    int fd = socket(AF_UNIX, SOCK_SEQPACKET, 0);
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    const std::string session = path + ".session";
    std::memcpy(addr.sun_path, session.data(), session.size());
    if (bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) _exit(2);
    if (!DropToNobody() || listen(fd, 4) != 0) _exit(3);
    if (write(ready[1], "r", 1) != 1) _exit(4);
    int conn = accept(fd, nullptr, nullptr);
    char buf[256];
    (void)!read(conn, buf, sizeof(buf));  // takes whatever the trainer would send
    pause();
    _exit(0);
  }
  char c;
  ASSERT_EQ(read(ready[0], &c, 1), 1);
  auto codes = RunRanks(1, [&](int) {
    std::unique_ptr<Communicator> comm;
    Status s = CreateComm(path, "victim", 0, 1, 1 << 20, &comm);
    CHILD_CHECK(s.code() == StatusCode::kPermissionDenied &&
                    s.message().find("impostor") != std::string::npos &&
                    s.message().find("uid 65534") != std::string::npos,
                "%s", s.ToString().c_str());
    return 0;
  });
  EXPECT_EQ(codes, (std::vector<int>{0}));
  kill(impostor, SIGKILL);
  waitpid(impostor, nullptr, 0);
  unlink((path + ".session").c_str());
  rmdir(dir.c_str());
}

TEST(SecurityTest, TheDaemonRefusesASocketDirectoryOthersCanWrite) {
  char dir_template[] = "/tmp/ciuic-opendir-XXXXXX";
  ASSERT_NE(mkdtemp(dir_template), nullptr);
  const std::string dir = dir_template;
  ASSERT_EQ(chmod(dir.c_str(), 01777), 0);
  std::string out;
  const int rc = RunCommand("timeout 20 " + std::string(CIUICD_PATH) + " --socket " + dir + "/ciuicd.sock", &out);
  EXPECT_EQ(rc, 78) << out;
  EXPECT_TRUE(Contains(out, "writable by no one else")) << out;
  struct stat st {};
  EXPECT_NE(stat((dir + "/ciuicd.sock").c_str(), &st), 0) << "it must not have listened";
  rmdir(dir.c_str());
}

}  // namespace
}  // namespace ciuic::testing
