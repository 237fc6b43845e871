// What the integration tests share: a real ciuicd process of their own, and
// trainer ranks as real forked processes.
//
// The test process itself never opens a communicator or a gRPC channel, so
// forking it is safe: each child starts with one thread.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <cstdio>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace ciuic::proto {
class TraceReply;
}

namespace ciuic::testing {

class DaemonProcess {
 public:
  // Starts CIUICD_PATH with its sockets in a fresh temporary directory
  // (mode 0755, so a child dropped to another uid can reach them), the
  // given YAML as its config file (if not empty) and extra arguments; waits
  // until both sockets exist. Returns nullptr (and prints why) on failure.
  static std::unique_ptr<DaemonProcess> Start(const std::string& config_yaml = "",
                                              const std::vector<std::string>& extra_args = {});
  // The same, run through `prefix` (e.g. {"ip", "netns", "exec", "ns1"})
  // with extra environment variables ("NAME=value").
  static std::unique_ptr<DaemonProcess> StartWith(const std::string& config_yaml,
                                                  const std::vector<std::string>& extra_args,
                                                  const std::vector<std::string>& prefix,
                                                  const std::vector<std::string>& env);
  ~DaemonProcess();  // SIGKILL if still running; removes the directory

  const std::string& socket() const { return socket_; }
  const std::string& dir() const { return dir_; }
  pid_t pid() const { return pid_; }
  bool Alive() const;
  // What the daemon has logged so far (for failure messages).
  std::string Log() const;
  // SIGTERM and wait (bounded); the exit code, or 128 + signal, or -1 on
  // timeout (then killed).
  int Stop(std::chrono::seconds timeout = std::chrono::seconds(20));
  // Stop() (its exit code into *exit_code), then the same daemon again on
  // the same sockets and config, as `systemctl restart` does; its log goes
  // on in the same file. False (and why on stderr) if it does not start.
  bool Restart(int* exit_code = nullptr);

 private:
  bool Launch(bool append_log);

  std::vector<std::string> args_;
  std::vector<std::string> env_;
  pid_t pid_ = -1;
  std::string dir_;
  std::string socket_;
};

// Runs fn(rank) for rank 0..n-1, each in its own forked process; returns
// each child's exit code (fn's return value; 128 + signal if it died; -1 if
// it outlived `timeout`, after which it is killed).
std::vector<int> RunRanks(int n, const std::function<int(int rank)>& fn,
                          std::chrono::seconds timeout = std::chrono::seconds(180));

// Starts fn(rank) children and returns their pids without waiting.
std::vector<pid_t> SpawnRanks(int n, const std::function<int(int rank)>& fn);
// Waits for one child, bounded; exit code as in RunRanks.
int WaitChild(pid_t pid, std::chrono::seconds timeout);

// Rank processes for a test that inspects a running job: each runs
// fn(rank, hold), which calls hold() where it is to wait (its communicator
// alive, so its job stays formed): hold() tells the test and returns at
// Release(). The destructor releases and reaps them, so a test that returns
// early (a failed ASSERT) never leaves them blocked.
class HeldRanks {
 public:
  HeldRanks(int n, const std::function<int(int rank, const std::function<void()>& hold)>& fn);
  ~HeldRanks();
  HeldRanks(const HeldRanks&) = delete;
  HeldRanks& operator=(const HeldRanks&) = delete;
  // True once every rank has called hold(); false if they all ended before,
  // or `timeout` passed first.
  bool Held(std::chrono::seconds timeout = std::chrono::seconds(60));
  // Lets the ranks exit; their exit codes, as RunRanks's.
  std::vector<int> Release(std::chrono::seconds timeout = std::chrono::seconds(30));

 private:
  int ready_[2] = {-1, -1};
  int release_[2] = {-1, -1};
  std::vector<pid_t> pids_;
  std::vector<int> codes_;
  bool released_ = false;
};

// Runs a command line and returns its exit code and output (stdout+stderr).
int RunCommand(const std::string& command, std::string* output);

// The ciuicctl to run: $CIUICCTL_FOR_TESTS (tools/gpu-check.sh's bundle,
// whose tests run elsewhere than they were built), else this build's.
std::string CiuicctlPath();

// `ciuicctl --json trace --last 0 --job JOB` against the daemon at `socket`,
// parsed into *reply. Returns "" or what went wrong (with the output).
std::string ReadTrace(const std::string& socket, const std::string& job, proto::TraceReply* reply);

// GET /metrics of the daemon at `socket` (its address from `ciuicctl
// --json status`; the daemon needs metrics_listen) into *text, and the
// address into *address. Returns "" or what went wrong.
std::string ReadMetrics(const std::string& socket, std::string* text, std::string* address);

// A job id no other test in any concurrent run uses.
std::string UniqueJobId(const std::string& what);

// CPU time (user + system) of a process so far, in seconds.
double ProcessCpuSeconds(pid_t pid);

}  // namespace ciuic::testing

// In a child: report and fail the rank.
#define CHILD_CHECK(cond, ...)                                                   \
  do {                                                                           \
    if (!(cond)) {                                                               \
      fprintf(stderr, "%s:%d: rank check failed: %s: ", __FILE__, __LINE__, #cond); \
      fprintf(stderr, __VA_ARGS__);                                              \
      fprintf(stderr, "\n");                                                     \
      return 1;                                                                  \
    }                                                                            \
  } while (0)
