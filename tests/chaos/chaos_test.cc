// The chaos suite of issue 31: "No hang, no crash: a hung or lost peer ends
// one job with a clear error, never a healthy daemon".
//
// Two "hosts" (network namespaces joined by a veth pair, created and removed
// by each test), one ciuicd in each, with short heartbeats and timeouts. Each
// scenario repeats one fault kRepetitions times with random timing (a fixed
// seed: CIUIC_CHAOS_SEED, default 1) and checks, each time:
//   - every rank that survives gets an error (not a hang) within kBound,
//     and a rank on a healthy daemon gets one naming the failed node, the
//     coordinator or the killed rank; where a daemon was stopped, a rank on
//     the healthy one hears within kStoppedBound (the heartbeats find a
//     stopped daemon in 4 x 100 ms; its operation's own timeout, or the
//     stopped daemon running again, must not be what ends it);
//   - every daemon is still alive; the next repetition's first allreduce (a
//     fresh job over both daemons) shows it serves, and after the last one a
//     fresh job runs on each daemon alone and on both together;
//   - no leak: each daemon's threads and open descriptors (its shared memory
//     is memfd) come back to what they were before the scenario, within a
//     small slack (kThreadSlack, kFdSlack) that a leak growing with the
//     repetitions passes; no /dev/shm entry of ours is left behind.
// The daemons are reused across the repetitions of a scenario (each fault
// here leaves them healthy), which keeps the suite within minutes.
//
// Per scenario a line: name, repetitions, passed, median and max time from
// the fault to the last healthy rank's error; with CIUIC_CHAOS_JSON set, the
// same as one JSON object per line appended to that file. To investigate:
// CIUIC_CHAOS_OUTAGE_MS fixes how long a daemon stays stopped or a link
// down (else 600..1500 ms), and CIUIC_CHAOS_SLOW_LOGS=S prints both
// daemons' logs of every repetition slower than S seconds (a failed one's
// are printed anyway).
#include <dirent.h>
#include <gtest/gtest.h>
#include <poll.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <random>
#include <set>
#include <sstream>
#include <thread>
#include <vector>

#include "integration/common.h"
#include "harness.h"

namespace ciuic::testing {
namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

constexpr int kRepetitions = 20;
constexpr double kBound = 10.0;  // seconds from the fault to each rank's error
// ... for a rank on a healthy daemon when the other was stopped: the
// heartbeats' 400 ms, the idle scenarios' submissions up to 800 ms after
// the fault, and slack; below the operations' own timeout (kOpTimeoutMs).
constexpr double kStoppedBound = 1.2;
constexpr int kOpTimeoutMs = 1500;
constexpr int kThreadSlack = 4;  // threads a daemon may keep over its baseline
constexpr int kFdSlack = 8;      // descriptors likewise
constexpr const char* kTuning =
    "tuning:\n  heartbeat_interval_ms: 100\n  heartbeat_misses: 4\n";

int64_t NowNs() { return Clock::now().time_since_epoch().count(); }

uint32_t Seed() {
  const char* s = std::getenv("CIUIC_CHAOS_SEED");
  return s != nullptr && *s != 0 ? static_cast<uint32_t>(std::strtoul(s, nullptr, 10)) : 1;
}

bool Sh(const std::string& cmd) {
  std::string out;
  const int code = RunCommand(cmd, &out);
  if (code != 0) fprintf(stderr, "%s: %s\n", cmd.c_str(), out.c_str());
  return code == 0;
}

int CountDir(const std::string& dir) {
  int n = 0;
  if (DIR* d = opendir(dir.c_str())) {
    while (dirent* e = readdir(d)) n += e->d_name[0] != '.';
    closedir(d);
  }
  return n;
}

std::set<std::string> ShmNames() {
  std::set<std::string> names;
  if (DIR* d = opendir("/dev/shm")) {
    while (dirent* e = readdir(d)) {
      if (e->d_name[0] != '.') names.insert(e->d_name);
    }
    closedir(d);
  }
  return names;
}

// Two hosts: namespaces joined by a veth pair, 10.78.0.1 and 10.78.0.2 (a
// range only these namespaces see). Removed in the destructor, which runs
// on a failed assertion too.
class Hosts {
 public:
  Hosts() {
    const std::string tag = std::to_string(getpid() % 100000);
    names_ = {"ciuic-chaos" + tag + "-0", "ciuic-chaos" + tag + "-1"};
    devices_ = {"cx" + tag + "a", "cx" + tag + "b"};
    Cleanup();
    ok_ = Sh("ip netns add " + names_[0]) && Sh("ip netns add " + names_[1]) &&
          // Made here, then moved: a pair created straight into two
          // namespaces comes up without carrier on this kernel.
          Sh("ip link add " + devices_[0] + " type veth peer name " + devices_[1]) &&
          Sh("ip link set " + devices_[0] + " netns " + names_[0]) &&
          Sh("ip link set " + devices_[1] + " netns " + names_[1]) &&
          Sh(Exec(0) + "ip addr add 10.78.0.1/24 dev " + devices_[0]) &&
          Sh(Exec(1) + "ip addr add 10.78.0.2/24 dev " + devices_[1]) && SetLink(0, true) &&
          SetLink(1, true) && Sh(Exec(0) + "ip link set lo up") &&
          Sh(Exec(1) + "ip link set lo up");
  }
  ~Hosts() { Cleanup(); }
  bool ok() const { return ok_; }
  std::vector<std::string> Prefix(int i) const { return {"ip", "netns", "exec", names_[i]}; }
  std::string Exec(int i) const { return "ip netns exec " + names_[i] + " "; }
  const std::string& device(int i) const { return devices_[i]; }
  bool SetLink(int i, bool up) {
    return Sh(Exec(i) + "ip link set " + devices_[i] + (up ? " up" : " down"));
  }

 private:
  void Cleanup() {
    std::string out;
    for (auto& n : names_) RunCommand("ip netns del " + n + " 2>/dev/null", &out);
  }
  std::vector<std::string> names_, devices_;
  bool ok_ = false;
};

enum class Fault {
  kStopPeerIdle,
  kStopPeerMidRun,
  kStopCoordinatorIdle,
  kStopCoordinatorMidRun,
  kStopCoordinatorBetweenReadyAndRun,
  kLinkDownMidRun,
  kKillOneTrainerMidRun,
  kKillNodeTrainersMidRun,
};

struct ScenarioSpec {
  const char* name;
  Fault fault;
  int ranks_per_node;
};

void PrintTo(const ScenarioSpec& spec, std::ostream* os) { *os << spec.name; }

// What each rank reports to the test, in shared memory.
struct RankReport {
  int state;  // 0: nothing yet; 1: an error; 2: no error at all (a failure)
  int code;
  int64_t error_ns;
  char message[512];
};
struct Board {
  int64_t fault_ns;
  int submit_delay_ms[4];  // idle scenarios: when each rank submits after "go"
  RankReport ranks[4];
};

bool ReadBytes(int fd, int n, int timeout_ms) {
  const auto until = Clock::now() + milliseconds(timeout_ms);
  while (n > 0) {
    const int left = static_cast<int>(
        std::chrono::duration_cast<milliseconds>(until - Clock::now()).count());
    if (left <= 0) return false;
    pollfd p{fd, POLLIN, 0};
    if (poll(&p, 1, left) <= 0) continue;
    char buf[8];
    const ssize_t got = read(fd, buf, std::min(n, 8));
    if (got <= 0) return false;
    n -= static_cast<int>(got);
  }
  return true;
}

class ChaosTest : public ::testing::TestWithParam<ScenarioSpec> {
 protected:
  void SetUp() override {
    if (geteuid() != 0) {
      GTEST_SKIP() << "needs root to create network namespaces";
    }
    hosts_ = std::make_unique<Hosts>();
    if (!hosts_->ok()) {
      GTEST_SKIP() << "could not create network namespaces here (see stderr)";
    }
    token_ = std::make_unique<TokenFile>("chaos secret " + std::to_string(getpid()));
    const std::string yaml =
        "cluster_token_file: " + token_->path() + "\npeers: 10.78.0.0/24\n" + kTuning;
    for (int i = 0; i < 2; ++i) {
      daemons_.push_back(DaemonProcess::StartWith(
          yaml, {"--listen", peers_[i], "--node-name", "host" + std::to_string(i)},
          hosts_->Prefix(i),
          {"UCX_TLS=tcp", "UCX_NET_DEVICES=" + hosts_->device(i), "UCX_WARN_UNUSED_ENV_VARS=n"}));
      ASSERT_NE(daemons_.back(), nullptr);
    }
    board_ = static_cast<Board*>(
        mmap(nullptr, sizeof(Board), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0));
    ASSERT_NE(board_, MAP_FAILED);
  }
  void TearDown() override {
    for (auto& d : daemons_) {
      if (d && d->pid() > 0) kill(d->pid(), SIGCONT);
    }
    if (hosts_ && hosts_->ok()) {
      hosts_->SetLink(0, true);
      hosts_->SetLink(1, true);
    }
    for (auto& d : daemons_) {
      if (d && d->Alive()) {
        EXPECT_EQ(d->Stop(), 0) << d->Log();
      }
    }
    daemons_.clear();  // before the namespaces go
    if (board_ != nullptr && board_ != MAP_FAILED) munmap(board_, sizeof(Board));
    token_.reset();
    hosts_.reset();
  }

  std::unique_ptr<Communicator> Join(const std::string& job, int rank, int nodes,
                                     int ranks_per_node, DaemonProcess* alone = nullptr) {
    JobOptions o;
    o.socket_path = alone ? alone->socket() : daemons_[rank / ranks_per_node]->socket();
    o.job_id = job;
    o.rank = rank;
    o.world_size = nodes * ranks_per_node;
    o.local_rank = rank % ranks_per_node;
    o.local_size = ranks_per_node;
    if (alone == nullptr) o.coordinator = peers_[0];
    o.arena_bytes = 16 << 20;
    std::unique_ptr<Communicator> comm;
    Status s = Communicator::Create(o, &comm);
    if (!s.ok()) fprintf(stderr, "rank %d: Create: %s\n", rank, s.ToString().c_str());
    return comm;
  }

  // A fresh job: 2 ranks on `alone`, or one rank on each daemon. True if
  // its small allreduce gives the right sum.
  bool Serves(DaemonProcess* alone) {
    const std::string job = UniqueJobId("chaos-fresh");
    auto codes = RunRanks(2, [&](int rank) {
      setenv("CIUIC_WAIT_GRACE_MS", "1000", 1);
      auto comm = Join(job, rank, alone ? 1 : 2, alone ? 2 : 1, alone);
      CHILD_CHECK(comm != nullptr, "join");
      std::vector<int32_t> v(1000, rank + 1);
      OpOptions o;
      o.timeout_ms = 5000;
      Status s = comm->Allreduce(v.data(), v.data(), v.size(), DataType::kInt32, ReduceOp::kSum, o)
                     .Wait();
      CHILD_CHECK(s.ok() && v[999] == 3, "%s", s.ToString().c_str());
      return 0;
    }, std::chrono::seconds(30));
    return codes == std::vector<int>({0, 0});
  }

  int Threads(int i) const { return CountDir("/proc/" + std::to_string(daemons_[i]->pid()) + "/task"); }
  int Fds(int i) const { return CountDir("/proc/" + std::to_string(daemons_[i]->pid()) + "/fd"); }

  // One repetition; "" or why it failed. *time_to_error: the fault to the
  // last error of a rank on a healthy daemon, in seconds.
  std::string RunOnce(const ScenarioSpec& spec, std::mt19937& rng, int rep,
                      double* time_to_error, std::string* heard);

  const std::string peers_[2] = {"10.78.0.1:7361", "10.78.0.2:7361"};
  std::unique_ptr<Hosts> hosts_;
  std::unique_ptr<TokenFile> token_;
  std::vector<std::unique_ptr<DaemonProcess>> daemons_;
  Board* board_ = nullptr;
};

int Uniform(std::mt19937& rng, int lo, int hi) {
  return std::uniform_int_distribution<int>(lo, hi)(rng);
}

std::string ChaosTest::RunOnce(const ScenarioSpec& spec, std::mt19937& rng, int rep,
                               double* time_to_error, std::string* heard) {
  const Fault fault = spec.fault;
  const int rpn = spec.ranks_per_node;
  const int world = 2 * rpn;
  const bool idle = fault == Fault::kStopPeerIdle || fault == Fault::kStopCoordinatorIdle;
  const bool late_peer = fault == Fault::kStopCoordinatorBetweenReadyAndRun;
  const bool stop = fault != Fault::kLinkDownMidRun && fault != Fault::kKillOneTrainerMidRun &&
                    fault != Fault::kKillNodeTrainersMidRun;
  // The node the fault hits: the coordinator's (host0, rank 0's) or the other.
  const int hit = fault == Fault::kStopCoordinatorIdle || fault == Fault::kStopCoordinatorMidRun ||
                          late_peer
                      ? 0
                      : 1;
  std::vector<int> killed;  // ranks the test kills
  if (fault == Fault::kKillOneTrainerMidRun) killed = {world - 1};
  if (fault == Fault::kKillNodeTrainersMidRun) {
    for (int r = rpn; r < world; ++r) killed.push_back(r);
  }
  // Random timing, drawn before the fork so that it follows the seed alone.
  const size_t elements = static_cast<size_t>(Uniform(rng, 1 << 18, 1 << 20));  // 1-4 MiB of float
  const int steps_before = Uniform(rng, 1, 4);     // allreduces run before the fault
  const int fault_delay_ms = Uniform(rng, 0, 300);  // then this long
  int outage_ms = Uniform(rng, 600, 1500);  // stopped / link down this long
  if (const char* o = std::getenv("CIUIC_CHAOS_OUTAGE_MS"); o != nullptr && *o != 0) {
    outage_ms = std::atoi(o);
  }
  std::memset(board_, 0, sizeof(Board));
  for (int r = 0; r < world; ++r) board_->submit_delay_ms[r] = Uniform(rng, 0, 800);

  const std::string job = UniqueJobId("chaos-" + std::to_string(rep));
  int ready[2], go[2], late[2];
  if (pipe(ready) != 0 || pipe(go) != 0 || pipe(late) != 0) return "pipe";
  Board* board = board_;
  std::vector<pid_t> pids = SpawnRanks(world, [&](int rank) {
    setenv("CIUIC_WAIT_GRACE_MS", "1000", 1);
    RankReport& me = board->ranks[rank];
    auto comm = Join(job, rank, 2, rpn);
    CHILD_CHECK(comm != nullptr, "join");
    OpOptions o;
    o.timeout_ms = kOpTimeoutMs;
    std::vector<float> v(elements, 1.0f);
    // The first allreduce: the daemons serve a fresh job.
    o.name = "first";
    Status s = comm->Allreduce(v.data(), v.data(), v.size(), DataType::kFloat32, ReduceOp::kSum, o)
                   .Wait();
    CHILD_CHECK(s.ok() && v[0] == world, "first allreduce: %s", s.ToString().c_str());
    const auto report = [&](const Status& st) {
      me.error_ns = NowNs();
      me.code = static_cast<int>(st.code());
      snprintf(me.message, sizeof(me.message), "%s", st.ToString().c_str());
      me.state = st.ok() ? 2 : 1;
      return 0;
    };
    o.name = "after";
    if (idle || late_peer) {
      CHILD_CHECK(write(ready[1], "r", 1) == 1, "pipe");
      char c;
      if (late_peer && rank >= rpn) {
        // The peer's ranks submit late: after the coordinator's daemon has
        // been stopped.
        CHILD_CHECK(read(late[0], &c, 1) == 1, "pipe");
      } else {
        CHILD_CHECK(read(go[0], &c, 1) == 1, "pipe");
      }
      if (idle) std::this_thread::sleep_for(milliseconds(board->submit_delay_ms[rank]));
      Handle h =
          comm->Allreduce(v.data(), v.data(), v.size(), DataType::kFloat32, ReduceOp::kSum, o);
      if (late_peer && rank < rpn) CHILD_CHECK(write(ready[1], "s", 1) == 1, "pipe");
      return report(h.Wait());
    }
    const auto until = Clock::now() + std::chrono::seconds(60);
    for (int i = 0; Clock::now() < until; ++i) {
      if (i == steps_before) CHILD_CHECK(write(ready[1], "r", 1) == 1, "pipe");
      s = comm->Allreduce(v.data(), v.data(), v.size(), DataType::kFloat32, ReduceOp::kSum, o)
              .Wait();
      if (!s.ok()) return report(s);
    }
    return report(Status());
  });
  close(ready[1]);
  std::string why;
  const auto fail = [&](const std::string& w) {
    if (why.empty()) why = w;
  };
  if (!ReadBytes(ready[0], world, 30000)) fail("the ranks never got going (join or first allreduce failed)");
  if (why.empty()) {
    std::this_thread::sleep_for(milliseconds(fault_delay_ms));
    const pid_t target = daemons_[hit]->pid();
    if (late_peer) {
      // The coordinator's ranks submit; it is stopped right after; then the
      // peer's ranks submit.
      for (int r = 0; r < rpn; ++r) {
        if (write(go[1], "g", 1) != 1) fail("pipe");
      }
      if (!ReadBytes(ready[0], rpn, 10000)) fail("the coordinator's ranks did not submit");
      board_->fault_ns = NowNs();
      kill(target, SIGSTOP);
      std::this_thread::sleep_for(milliseconds(Uniform(rng, 0, 200)));
      for (int r = rpn; r < world; ++r) {
        if (write(late[1], "l", 1) != 1) fail("pipe");
      }
    } else {
      board_->fault_ns = NowNs();
      if (stop) {
        kill(target, SIGSTOP);
      } else if (fault == Fault::kLinkDownMidRun) {
        if (!hosts_->SetLink(hit, false)) fail("ip link set down failed");
      } else {
        for (int r : killed) kill(pids[r], SIGKILL);
      }
      if (idle) {
        for (int r = 0; r < world; ++r) {
          if (write(go[1], "g", 1) != 1) fail("pipe");
        }
      }
    }
    if (stop || fault == Fault::kLinkDownMidRun) {
      std::this_thread::sleep_for(milliseconds(outage_ms));
      if (stop) {
        kill(target, SIGCONT);
      } else if (!hosts_->SetLink(hit, true)) {
        fail("ip link set up failed");
      }
    }
  } else {
    for (pid_t p : pids) kill(p, SIGKILL);
  }
  // Every rank ends, bounded: kBound from the fault, and slack for exiting.
  std::vector<int> codes;
  for (pid_t p : pids) codes.push_back(WaitChild(p, std::chrono::seconds(static_cast<int>(kBound) + 5)));
  close(ready[0]);
  close(go[0]);
  close(go[1]);
  close(late[0]);
  close(late[1]);
  if (!why.empty()) return why;

  *time_to_error = 0;
  std::ostringstream problems;
  for (int r = 0; r < world; ++r) {
    if (std::find(killed.begin(), killed.end(), r) != killed.end()) continue;
    const RankReport& rr = board_->ranks[r];
    if (codes[r] != 0 || rr.state != 1) {
      problems << "rank " << r << ": "
               << (rr.state == 2   ? std::string("no error: ") + rr.message
                   : codes[r] == -1 ? std::string("hung (killed after the bound)")
                                    : "exit code " + std::to_string(codes[r]))
               << "; ";
      continue;
    }
    const double took = (rr.error_ns - board_->fault_ns) / 1e9;
    if (took > kBound) problems << "rank " << r << ": error after " << took << " s; ";
    // A rank on a stopped daemon hears only when that daemon runs again (or
    // when its SDK gives up): an error, whatever its words. A rank on a
    // healthy daemon must hear what failed.
    const bool on_hit = r / rpn == hit;
    if (stop && on_hit) continue;
    if (stop && took > kStoppedBound) {
      problems << "rank " << r << ": heard only " << took << " s after the other daemon stopped; ";
    }
    const std::string m = rr.message;
    bool named;
    if (!killed.empty()) {
      named = false;
      for (int k : killed) named = named || Contains(m, "rank " + std::to_string(k));
    } else {
      named = Contains(m, "host" + std::to_string(hit)) ||
              (hit == 0 && Contains(m, "coordinator")) ||
              // Link down cuts both ways: each side may name the other.
              (fault == Fault::kLinkDownMidRun &&
               (Contains(m, "host" + std::to_string(1 - hit)) || Contains(m, "coordinator")));
    }
    if (!named) problems << "rank " << r << ": the error names nothing that failed: " << m << "; ";
    if (took >= *time_to_error) *heard = "rank " + std::to_string(r) + ": " + m;
    *time_to_error = std::max(*time_to_error, took);
  }
  for (int i = 0; i < 2; ++i) {
    if (!daemons_[i]->Alive()) problems << "host" << i << "'s daemon died; ";
  }
  return problems.str();
}

TEST_P(ChaosTest, EveryRankHearsWithinTheBoundAndTheDaemonsServeAndDoNotLeak) {
  const ScenarioSpec spec = GetParam();
  const uint32_t seed = Seed();
  std::mt19937 rng(seed);
  printf("chaos %s: seed %u (CIUIC_CHAOS_SEED)\n", spec.name, seed);
  // The baseline: after a first job, so that what the daemons keep for
  // their life (UCX workers, thread pools) exists already.
  ASSERT_TRUE(Serves(nullptr)) << daemons_[0]->Log() << daemons_[1]->Log();
  std::this_thread::sleep_for(milliseconds(500));
  const int threads0[2] = {Threads(0), Threads(1)};
  const int fds0[2] = {Fds(0), Fds(1)};
  const std::set<std::string> shm0 = ShmNames();

  const auto start = Clock::now();
  std::vector<double> times;
  int passed = 0;
  for (int rep = 0; rep < kRepetitions; ++rep) {
    double took = 0;
    std::string heard;
    const size_t logged[2] = {daemons_[0]->Log().size(), daemons_[1]->Log().size()};
    const std::string why = RunOnce(spec, rng, rep, &took, &heard);
    // A failed repetition shows what both daemons logged during it.
    EXPECT_EQ(why, "") << spec.name << ", repetition " << rep << "\nhost0 during it:\n"
                       << daemons_[0]->Log().substr(logged[0]) << "\nhost1 during it:\n"
                       << daemons_[1]->Log().substr(logged[1]);
    if (const char* slow = std::getenv("CIUIC_CHAOS_SLOW_LOGS");
        why.empty() && slow != nullptr && *slow != 0 && took > std::atof(slow)) {
      printf("slow repetition %d, host0:\n%s\nhost1:\n%s\n", rep,
             daemons_[0]->Log().substr(logged[0]).c_str(),
             daemons_[1]->Log().substr(logged[1]).c_str());
    }
    if (why.empty()) {
      ++passed;
      times.push_back(took);
    }
    if (!daemons_[0]->Alive() || !daemons_[1]->Alive()) {
      ADD_FAILURE() << "a daemon died:\n" << daemons_[0]->Log() << "\n" << daemons_[1]->Log();
      break;
    }
    printf("  rep %2d: %s %.3f s, threads %d/%d, fds %d/%d; %s\n", rep,
           why.empty() ? "ok" : "FAILED", took, Threads(0), Threads(1), Fds(0), Fds(1),
           heard.substr(0, 200).c_str());
  }
  const double total = std::chrono::duration<double>(Clock::now() - start).count();

  // Each daemon serves a fresh job alone and both together.
  for (int i = 0; i < 2; ++i) {
    if (daemons_[i]->Alive()) {
      EXPECT_TRUE(Serves(daemons_[i].get())) << "host" << i;
    }
  }
  EXPECT_TRUE(Serves(nullptr)) << "the two daemons no longer run a job together\nhost0:\n"
                               << daemons_[0]->Log() << "\nhost1:\n" << daemons_[1]->Log();

  // Nothing leaked: threads and descriptors come back (their jobs' threads
  // end a little after the jobs), no /dev/shm entry of ours stays.
  for (int i = 0; i < 2; ++i) {
    if (!daemons_[i]->Alive()) continue;
    const auto until = Clock::now() + std::chrono::seconds(10);
    while (Clock::now() < until &&
           (Threads(i) > threads0[i] + kThreadSlack || Fds(i) > fds0[i] + kFdSlack)) {
      std::this_thread::sleep_for(milliseconds(100));
    }
    EXPECT_LE(Threads(i), threads0[i] + kThreadSlack) << "host" << i << "'s threads grew";
    EXPECT_LE(Fds(i), fds0[i] + kFdSlack) << "host" << i << "'s open descriptors grew";
    printf("chaos %s: host%d threads %d -> %d, fds %d -> %d\n", spec.name, i, threads0[i],
           Threads(i), fds0[i], Fds(i));
  }
  for (const std::string& name : ShmNames()) {
    if (shm0.count(name) != 0) continue;
    bool ours = Contains(name, "ciuic") || Contains(name, "ucx");
    for (auto& d : daemons_) {
      std::ifstream maps("/proc/" + std::to_string(d->pid()) + "/maps");
      std::stringstream text;
      text << maps.rdbuf();
      ours = ours || Contains(text.str(), "/dev/shm/" + name);
    }
    EXPECT_FALSE(ours) << "/dev/shm/" << name << " left behind";
  }

  std::sort(times.begin(), times.end());
  const double median = times.empty() ? 0 : times[times.size() / 2];
  const double max = times.empty() ? 0 : times.back();
  printf("chaos | %-40s | %2d reps | %2d passed | median %.3f s | max %.3f s | %.1f s total\n",
         spec.name, kRepetitions, passed, median, max, total);
  if (const char* path = std::getenv("CIUIC_CHAOS_JSON"); path != nullptr && *path != 0) {
    std::ofstream out(path, std::ios::app);
    out << "{\"scenario\": \"" << spec.name << "\", \"repetitions\": " << kRepetitions
        << ", \"passed\": " << passed << ", \"median_s\": " << median << ", \"max_s\": " << max
        << ", \"seconds\": " << total << ", \"seed\": " << seed << ", \"times_s\": [";
    for (size_t i = 0; i < times.size(); ++i) out << (i ? ", " : "") << times[i];
    out << "]}\n";
  }
}

INSTANTIATE_TEST_SUITE_P(
    Faults, ChaosTest,
    ::testing::Values(ScenarioSpec{"StopPeerIdle", Fault::kStopPeerIdle, 1},
                      ScenarioSpec{"StopPeerMidRun", Fault::kStopPeerMidRun, 1},
                      ScenarioSpec{"StopCoordinatorIdle", Fault::kStopCoordinatorIdle, 1},
                      ScenarioSpec{"StopCoordinatorMidRun", Fault::kStopCoordinatorMidRun, 1},
                      ScenarioSpec{"StopCoordinatorBetweenReadyAndRun",
                                   Fault::kStopCoordinatorBetweenReadyAndRun, 1},
                      ScenarioSpec{"LinkDownMidRun", Fault::kLinkDownMidRun, 1},
                      ScenarioSpec{"KillOneTrainerMidRun", Fault::kKillOneTrainerMidRun, 2},
                      ScenarioSpec{"KillNodeTrainersMidRun", Fault::kKillNodeTrainersMidRun, 2}),
    [](const ::testing::TestParamInfo<ScenarioSpec>& info) {
      return std::string(info.param.name);
    });

}  // namespace
}  // namespace ciuic::testing
