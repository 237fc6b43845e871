#include "harness.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>
#include <thread>

#include "ciuic/control.pb.h"
#include "google/protobuf/util/json_util.h"

namespace ciuic::testing {

using Clock = std::chrono::steady_clock;

std::unique_ptr<DaemonProcess> DaemonProcess::Start(const std::string& config_yaml,
                                                    const std::vector<std::string>& extra_args) {
  return StartWith(config_yaml, extra_args, {}, {});
}

std::unique_ptr<DaemonProcess> DaemonProcess::StartWith(const std::string& config_yaml,
                                                        const std::vector<std::string>& extra_args,
                                                        const std::vector<std::string>& prefix,
                                                        const std::vector<std::string>& env) {
  auto d = std::unique_ptr<DaemonProcess>(new DaemonProcess());
  char tmpl[] = "/tmp/ciuic-test-XXXXXX";
  if (mkdtemp(tmpl) == nullptr) return nullptr;
  d->dir_ = tmpl;
  chmod(d->dir_.c_str(), 0755);
  d->socket_ = d->dir_ + "/ciuicd.sock";
  // $CIUICD_FOR_TESTS: a ciuicd elsewhere (tools/gpu-check.sh's bundle).
  const char* binary = std::getenv("CIUICD_FOR_TESTS");
  std::vector<std::string> args = {binary && *binary ? binary : CIUICD_PATH, "--socket",
                                   d->socket_, "--node-name",
                                   "testnode", "--log-level", "info", "--listen",
                                   "127.0.0.1:0"};
  if (!config_yaml.empty()) {
    std::string path = d->dir_ + "/ciuicd.yaml";
    std::ofstream(path) << config_yaml;
    args.push_back("--config");
    args.push_back(path);
  }
  args.insert(args.end(), extra_args.begin(), extra_args.end());
  args.insert(args.begin(), prefix.begin(), prefix.end());
  d->args_ = std::move(args);
  d->env_ = env;
  if (!d->Launch(/*append_log=*/false)) return nullptr;
  return d;
}

bool DaemonProcess::Launch(bool append_log) {
  std::string log = dir_ + "/ciuicd.log";
  pid_ = fork();
  if (pid_ == 0) {
    int fd = open(log.c_str(), O_WRONLY | O_CREAT | (append_log ? O_APPEND : O_TRUNC), 0644);
    if (fd >= 0) {
      dup2(fd, 2);
      dup2(fd, 1);
    }
    for (const std::string& e : env_) putenv(strdup(e.c_str()));
    std::vector<char*> argv;
    for (auto& a : args_) argv.push_back(a.data());
    argv.push_back(nullptr);
    execvp(argv[0], argv.data());
    _exit(127);
  }
  const Clock::time_point until = Clock::now() + std::chrono::seconds(20);
  while (Clock::now() < until) {
    struct stat st;
    if (stat(socket_.c_str(), &st) == 0 && stat((socket_ + ".session").c_str(), &st) == 0) {
      return true;
    }
    if (!Alive()) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  std::ifstream in(log);
  std::stringstream ss;
  ss << in.rdbuf();
  fprintf(stderr, "ciuicd did not start; its log:\n%s\n", ss.str().c_str());
  return false;
}

bool DaemonProcess::Restart(int* exit_code) {
  const int code = Stop();
  if (exit_code != nullptr) *exit_code = code;
  return Launch(/*append_log=*/true);
}

std::string DaemonProcess::Log() const {
  std::ifstream in(dir_ + "/ciuicd.log");
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

bool DaemonProcess::Alive() const {
  if (pid_ <= 0) return false;
  int status;
  return waitpid(pid_, &status, WNOHANG) == 0;
}

int DaemonProcess::Stop(std::chrono::seconds timeout) {
  if (pid_ <= 0) return -1;
  kill(pid_, SIGTERM);
  int code = WaitChild(pid_, timeout);
  pid_ = -1;
  return code;
}

DaemonProcess::~DaemonProcess() {
  if (pid_ > 0) {
    kill(pid_, SIGKILL);
    int status;
    waitpid(pid_, &status, 0);
  }
  if (!dir_.empty()) {
    std::string cmd = "rm -rf '" + dir_ + "'";
    (void)!system(cmd.c_str());
  }
}

std::vector<pid_t> SpawnRanks(int n, const std::function<int(int)>& fn) {
  fflush(stdout);
  fflush(stderr);
  std::vector<pid_t> pids;
  for (int r = 0; r < n; ++r) {
    pid_t pid = fork();
    if (pid == 0) {
      int code = fn(r);
      fflush(stdout);
      fflush(stderr);
      _exit(code);
    }
    pids.push_back(pid);
  }
  return pids;
}

HeldRanks::HeldRanks(int n,
                     const std::function<int(int, const std::function<void()>&)>& fn) {
  if (pipe(ready_) != 0 || pipe(release_) != 0) return;  // Held() reports it
  pids_ = SpawnRanks(n, [&](int rank) {
    close(ready_[0]);
    close(release_[1]);  // the test's copy alone: its close is the release
    const std::function<void()> hold = [this] {
      if (write(ready_[1], "r", 1) != 1) return;
      char c;
      while (read(release_[0], &c, 1) < 0 && errno == EINTR) {
      }  // returns at the release (end of file)
    };
    return fn(rank, hold);
  });
  close(ready_[1]);  // every rank gone without a word: end of file
  ready_[1] = -1;
}

bool HeldRanks::Held(std::chrono::seconds timeout) {
  if (ready_[0] < 0 || pids_.empty()) return false;
  const Clock::time_point until = Clock::now() + timeout;
  for (size_t got = 0; got < pids_.size();) {
    const auto left =
        std::chrono::duration_cast<std::chrono::milliseconds>(until - Clock::now()).count();
    if (left <= 0) return false;
    pollfd p{ready_[0], POLLIN, 0};
    if (poll(&p, 1, static_cast<int>(left)) <= 0) continue;
    char c;
    if (read(ready_[0], &c, 1) != 1) return false;  // every rank has exited
    ++got;
  }
  return true;
}

std::vector<int> HeldRanks::Release(std::chrono::seconds timeout) {
  if (released_) return codes_;
  released_ = true;
  if (release_[1] >= 0) close(release_[1]);
  release_[1] = -1;
  for (pid_t pid : pids_) codes_.push_back(WaitChild(pid, timeout));
  return codes_;
}

HeldRanks::~HeldRanks() {
  Release();
  for (int fd : {ready_[0], ready_[1], release_[0], release_[1]}) {
    if (fd >= 0) close(fd);
  }
}

int WaitChild(pid_t pid, std::chrono::seconds timeout) {
  const Clock::time_point until = Clock::now() + timeout;
  while (true) {
    int status = 0;
    pid_t got = waitpid(pid, &status, WNOHANG);
    if (got == pid) {
      if (WIFEXITED(status)) return WEXITSTATUS(status);
      if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
      return -1;
    }
    if (got < 0) return -1;
    if (Clock::now() > until) {
      kill(pid, SIGKILL);
      waitpid(pid, &status, 0);
      return -1;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
}

std::vector<int> RunRanks(int n, const std::function<int(int)>& fn, std::chrono::seconds timeout) {
  std::vector<pid_t> pids = SpawnRanks(n, fn);
  std::vector<int> codes;
  for (pid_t p : pids) codes.push_back(WaitChild(p, timeout));
  return codes;
}

int RunCommand(const std::string& command, std::string* output) {
  output->clear();
  FILE* p = popen((command + " 2>&1").c_str(), "r");
  if (p == nullptr) return -1;
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof(buf), p)) > 0) output->append(buf, n);
  int status = pclose(p);
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

std::string CiuicctlPath() {
  const char* ctl = std::getenv("CIUICCTL_FOR_TESTS");
  return ctl != nullptr && *ctl != '\0' ? ctl : CIUICCTL_PATH;
}

std::string ReadTrace(const std::string& socket, const std::string& job, proto::TraceReply* reply) {
  std::string out;
  const int code = RunCommand(CiuicctlPath() + " --json --socket " + socket +
                                  " trace --last 0 --job " + job,
                              &out);
  if (code != 0) return "ciuicctl trace exited " + std::to_string(code) + ": " + out;
  reply->Clear();
  auto parsed = google::protobuf::util::JsonStringToMessage(out, reply);
  if (!parsed.ok()) return "cannot parse ciuicctl's JSON (" + parsed.ToString() + "): " + out;
  return "";
}

std::string ReadMetrics(const std::string& socket, std::string* text, std::string* address) {
  std::string out;
  proto::StatusReply status;
  // The control socket answers before the daemon has started its metrics
  // endpoint (DaemonProcess::Start waits for the sockets only): ask again
  // for a few seconds.
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  while (true) {
    const int code =
        RunCommand(CiuicctlPath() + " --json --socket " + socket + " status", &out);
    if (code != 0) return "ciuicctl status exited " + std::to_string(code) + ": " + out;
    status.Clear();
    auto parsed = google::protobuf::util::JsonStringToMessage(out, &status);
    if (!parsed.ok()) return "cannot parse ciuicctl's JSON (" + parsed.ToString() + "): " + out;
    if (!status.metrics_address().empty() || std::chrono::steady_clock::now() > until) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  if (status.metrics_address().empty()) return "the daemon serves no /metrics: " + out;
  *address = status.metrics_address();
  const int fetched =
      RunCommand("/usr/bin/python3 -c 'import sys, urllib.request; "
                 "sys.stdout.write(urllib.request.urlopen(sys.argv[1], timeout=10).read()"
                 ".decode())' http://" + *address + "/metrics",
                 text);
  if (fetched != 0) return "GET /metrics failed: " + *text;
  return "";
}

std::string UniqueJobId(const std::string& what) {
  static std::atomic<int> seq{0};
  return what + "-" + std::to_string(getpid()) + "-" + std::to_string(seq++);
}

double ProcessCpuSeconds(pid_t pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/stat");
  std::string line;
  std::getline(in, line);
  auto close_paren = line.rfind(')');
  if (close_paren == std::string::npos) return -1;
  std::istringstream rest(line.substr(close_paren + 2));
  std::string field;
  // Fields after the name: state(3) ... utime(14) stime(15).
  std::vector<std::string> fields;
  while (rest >> field) fields.push_back(field);
  if (fields.size() < 13) return -1;
  const double ticks = static_cast<double>(sysconf(_SC_CLK_TCK));
  return (std::stod(fields[11]) + std::stod(fields[12])) / ticks;
}

}  // namespace ciuic::testing
