// ciuicctl: inspect and tune the local ciuicd through its control socket.
//
// Exit codes: 0 success, 1 the daemon answered with an error, 2 the daemon
// could not be reached, 64 usage error (EX_USAGE).

#include <sys/stat.h>

#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "ciuic/control.grpc.pb.h"
#include "ciuic/control.pb.h"
#include "flight_recorder.h"
#include "format.h"
#include "grpcpp/grpcpp.h"

#ifndef CIUIC_VERSION
#define CIUIC_VERSION "unknown"
#endif

namespace ciuic::ctl {
namespace {

constexpr int kExitOk = 0;
constexpr int kExitDaemonError = 1;
constexpr int kExitUnreachable = 2;
constexpr int kExitUsage = 64;
constexpr auto kCallTimeout = std::chrono::seconds(5);
constexpr const char* kDefaultSocket = "/run/ciuic/ciuicd.sock";

constexpr const char* kUsage =
    R"(usage: ciuicctl [--socket PATH] [--json] COMMAND [ARGS]

Inspect and tune the local ciuicd.

commands:
  status                      daemon summary, sessions and jobs
  jobs                        jobs and their pending operations
  peers                       nodes of multi-node jobs: link state, bytes sent/received
  tune get [KEY]              show one tuning key, or all of them
  tune set KEY=VALUE...       change tuning keys (applies from the next operation)
  trace [--job ID] [--last N] [--chrome FILE] [--flight-recorder DIR]
                              the last N operations (default 20, 0: all the
                              daemon kept): when the ranks and the other nodes
                              came, which came last, how long each phase took;
                              --chrome writes them for chrome://tracing or
                              ui.perfetto.dev; --flight-recorder writes one
                              job's operations (all kept, and those not ended
                              yet) as torch flight-recorder dumps DIR/rank_<R>
                              for torch's fr_trace analyzer
  version                     print ciuicctl's version

options:
  --socket PATH   control socket of ciuicd (default: $CIUIC_SOCKET, else
                  /run/ciuic/ciuicd.sock)
  --json          print the daemon's reply as one JSON object
  -h, --help      show this help

Multi-node jobs take chunk_bytes, chunks_in_flight, algorithm, compression,
min_compress_bytes and compression_strict from the daemon hosting their rank 0 (the job's
coordinator), which announces them to every node with each operation: tune
that daemon to change them for a running job.

exit codes: 0 ok, 1 the daemon reported an error, 2 ciuicd not reachable,
64 usage error
)";

struct Options {
  std::string socket_path;
  bool json = false;
  bool help = false;
  // trace's options
  std::string job;
  uint32_t last = 20;
  std::string chrome;
  std::string flight_recorder;
  bool last_given = false;
  bool trace_options = false;
  std::vector<std::string> args;  // command and its arguments
};

int UsageError(absl::string_view problem) {
  std::cerr << "ciuicctl: " << problem << "\n\n" << kUsage;
  return kExitUsage;
}

// Parses global options anywhere on the command line ("--" ends them).
// Returns a usage problem, or "" when the command line is well formed.
std::string ParseArgs(int argc, char** argv, Options& options) {
  const char* env_socket = std::getenv("CIUIC_SOCKET");
  options.socket_path = env_socket != nullptr && *env_socket != '\0' ? env_socket : kDefaultSocket;
  bool options_done = false;
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i];
    if (options_done || arg.empty() || arg[0] != '-' || arg == "-") {
      options.args.push_back(arg);
    } else if (arg == "--") {
      options_done = true;
    } else if (arg == "--json") {
      options.json = true;
    } else if (arg == "-h" || arg == "--help") {
      options.help = true;
    } else if (arg == "--socket") {
      if (i + 1 >= argc) return "--socket needs a PATH";
      options.socket_path = argv[++i];
    } else if (absl::StartsWith(arg, "--socket=")) {
      options.socket_path = arg.substr(std::strlen("--socket="));
    } else if (arg == "--job" || arg == "--last" || arg == "--chrome" ||
               arg == "--flight-recorder") {
      if (i + 1 >= argc) return absl::StrCat(arg, " needs a value");
      const std::string value = argv[++i];
      options.trace_options = true;
      if (arg == "--job") {
        options.job = value;
      } else if (arg == "--chrome") {
        if (value.empty()) return "--chrome needs a FILE";
        options.chrome = value;
      } else if (arg == "--flight-recorder") {
        if (value.empty()) return "--flight-recorder needs a DIR";
        options.flight_recorder = value;
      } else if (!absl::SimpleAtoi(value, &options.last)) {
        return absl::StrCat("--last needs a count (0 or more), got '", value, "'");
      } else {
        options.last_given = true;
      }
    } else {
      return absl::StrCat("unknown option '", arg, "'");
    }
  }
  if (options.socket_path.empty()) return "--socket needs a non-empty PATH";
  return "";
}

// Talks to one daemon; every call has a 5 s deadline and reports failures
// with the exit code ciuicctl should end with.
class Client {
 public:
  struct Failure {
    int exit_code;
    std::string message;
  };

  explicit Client(std::string socket_path)
      : socket_path_(std::move(socket_path)),
        stub_(proto::Control::NewStub(grpc::CreateCustomChannel(
            absl::StrCat("unix:", socket_path_), grpc::InsecureChannelCredentials(),
            UnlimitedReplies()))) {}

  // A whole trace (trace_ops up to 100000 records) is bigger than gRPC's
  // default 4 MiB reply limit.
  static grpc::ChannelArguments UnlimitedReplies() {
    grpc::ChannelArguments args;
    args.SetMaxReceiveMessageSize(-1);
    return args;
  }

  // Fails early, with the OS's words, when the socket is not there at all.
  std::optional<Failure> CheckSocket() const {
    struct stat info;
    if (stat(socket_path_.c_str(), &info) != 0) {
      return Unreachable(std::strerror(errno));
    }
    if (!S_ISSOCK(info.st_mode)) return Unreachable("not a socket");
    return std::nullopt;
  }

  template <typename Request, typename Reply, typename Method>
  std::optional<Failure> Call(Method method, const Request& request, Reply& reply) {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + kCallTimeout);
    grpc::Status status = ((*stub_).*method)(&context, request, &reply);
    if (status.ok()) return std::nullopt;
    switch (status.error_code()) {
      case grpc::StatusCode::UNAVAILABLE:
        // gRPC's text repeats the address; the OS's reason is what matters.
        if (absl::StrContains(status.error_message(), "Connection refused")) {
          return Unreachable("connection refused (is ciuicd running?)");
        }
        if (absl::StrContains(status.error_message(), "Permission denied")) {
          return Unreachable("permission denied");
        }
        return Unreachable(status.error_message());
      case grpc::StatusCode::DEADLINE_EXCEEDED:
        return Unreachable("no answer within 5 s");
      default:
        return Failure{kExitDaemonError, absl::StrCat("error: ", status.error_message())};
    }
  }

 private:
  Failure Unreachable(absl::string_view why) const {
    return Failure{kExitUnreachable,
                   absl::StrCat("cannot reach ciuicd at ", socket_path_, ": ", why)};
  }

  std::string socket_path_;
  std::unique_ptr<proto::Control::Stub> stub_;
};

int Fail(const Client::Failure& failure) {
  std::cerr << failure.message << "\n";
  return failure.exit_code;
}

// Prints `message` as JSON, or `text` otherwise.
int Print(const Options& options, const google::protobuf::Message& message,
          const std::string& text) {
  if (!options.json) {
    std::cout << text;
    return kExitOk;
  }
  absl::StatusOr<std::string> json = ToJson(message);
  if (!json.ok()) {
    std::cerr << "ciuicctl: " << json.status().message() << "\n";
    return kExitDaemonError;
  }
  std::cout << *json;
  return kExitOk;
}

int RunStatus(const Options& options, Client& client, bool jobs_view) {
  proto::StatusReply reply;
  if (auto failure = client.Call(&proto::Control::Stub::GetStatus, proto::StatusRequest(), reply)) {
    return Fail(*failure);
  }
  return Print(options, reply, jobs_view ? FormatJobs(reply) : FormatStatus(reply));
}

int RunPeers(const Options& options, Client& client) {
  proto::PeersReply reply;
  if (auto failure = client.Call(&proto::Control::Stub::GetPeers, proto::PeersRequest(), reply)) {
    return Fail(*failure);
  }
  return Print(options, reply, FormatPeers(reply));
}

// Writes the flight-recorder files (flight_recorder.h) into the directory.
int WriteFlightRecorder(const Options& options, const proto::TraceReply& reply,
                        int64_t wall_now_ns) {
  auto files = FlightRecorderFiles(reply, options.job, wall_now_ns);
  if (!files.ok()) {
    std::cerr << "ciuicctl: " << files.status().message() << "\n";
    return kExitDaemonError;
  }
  std::error_code ec;
  std::filesystem::create_directories(options.flight_recorder, ec);
  if (ec) {
    std::cerr << "ciuicctl: cannot create " << options.flight_recorder << ": " << ec.message()
              << "\n";
    return kExitDaemonError;
  }
  proto::TraceReply written;  // for --json: what went into the files
  for (const auto& [rank, bytes] : *files) {
    const std::string path =
        (std::filesystem::path(options.flight_recorder) / absl::StrCat("rank_", rank)).string();
    std::ofstream file(path, std::ios::binary | std::ios::trunc);
    file << bytes;
    file.close();
    if (!file) {
      std::cerr << "ciuicctl: cannot write " << path << ": " << std::strerror(errno) << "\n";
      return kExitDaemonError;
    }
  }
  for (const auto& op : reply.ops()) {
    if (options.job.empty() || op.job_id() == options.job) *written.add_ops() = op;
  }
  written.set_now_us(reply.now_us());
  std::string ranks;
  for (const auto& [rank, bytes] : *files) absl::StrAppend(&ranks, ranks.empty() ? "" : " ", rank);
  return Print(options, written,
               absl::StrCat("wrote ", files->size(), " flight-recorder file(s) (ranks ", ranks,
                            ") with ", written.ops_size(), " operation(s) to ",
                            options.flight_recorder,
                            "; read them with torch's tools/flight_recorder/fr_trace.py -d ",
                            options.flight_recorder, "\n"));
}

int RunTrace(const Options& options, Client& client) {
  proto::TraceRequest request;
  request.set_job_id(options.job);
  const bool recorder = !options.flight_recorder.empty();
  // The flight recorder takes all the daemon kept unless told otherwise.
  request.set_last(recorder && !options.last_given ? 0 : options.last);
  request.set_in_flight(recorder);
  proto::TraceReply reply;
  if (auto failure = client.Call(&proto::Control::Stub::GetTrace, request, reply)) {
    return Fail(*failure);
  }
  if (recorder) {
    const int64_t now_ns = std::chrono::duration_cast<std::chrono::nanoseconds>(
                               std::chrono::system_clock::now().time_since_epoch())
                               .count();
    return WriteFlightRecorder(options, reply, now_ns);
  }
  if (!options.chrome.empty()) {
    std::ofstream file(options.chrome, std::ios::trunc);
    file << ChromeTrace(reply);
    file.close();
    if (!file) {
      std::cerr << "ciuicctl: cannot write " << options.chrome << ": " << std::strerror(errno)
                << "\n";
      return kExitDaemonError;
    }
    if (!options.json) {
      std::cout << "wrote " << reply.ops_size() << " operation(s) to " << options.chrome
                << " (open it in ui.perfetto.dev or chrome://tracing)\n";
      return kExitOk;
    }
  }
  return Print(options, reply, FormatTrace(reply));
}

int RunTuneGet(const Options& options, Client& client, const std::string& key) {
  proto::TuneGetRequest request;
  request.set_key(key);
  proto::TuneGetReply reply;
  if (auto failure = client.Call(&proto::Control::Stub::TuneGet, request, reply)) {
    return Fail(*failure);
  }
  return Print(options, reply, FormatTuneEntries(reply));
}

// Sets the pairs in order and stops at the first error; the keys after it
// are not applied (and are named as such).
int RunTuneSet(const Options& options, Client& client,
               const std::vector<std::pair<std::string, std::string>>& pairs) {
  proto::TuneGetReply applied;  // for --json: every entry now in force
  for (size_t i = 0; i < pairs.size(); ++i) {
    proto::TuneSetRequest request;
    request.set_key(pairs[i].first);
    request.set_value(pairs[i].second);
    proto::TuneSetReply reply;
    if (auto failure = client.Call(&proto::Control::Stub::TuneSet, request, reply)) {
      int code = Fail(*failure);
      for (size_t j = i + 1; j < pairs.size(); ++j) {
        std::cerr << "not applied: " << pairs[j].first << "=" << pairs[j].second << "\n";
      }
      return code;
    }
    if (!options.json) std::cout << FormatTuneEntry(reply.entry());
    *applied.add_entries() = reply.entry();
  }
  return options.json ? Print(options, applied, "") : kExitOk;
}

int Run(int argc, char** argv) {
  Options options;
  if (std::string problem = ParseArgs(argc, argv, options); !problem.empty()) {
    return UsageError(problem);
  }
  if (options.help) {
    std::cout << kUsage;
    return kExitOk;
  }
  const std::vector<std::string>& args = options.args;
  if (args.empty()) return UsageError("no command given");
  const std::string& command = args[0];

  if (command == "version") {
    if (args.size() != 1) return UsageError("'version' takes no arguments");
    std::cout << "ciuicctl " << CIUIC_VERSION << "\n";
    return kExitOk;
  }
  if (command == "help") {
    std::cout << kUsage;
    return kExitOk;
  }

  // Check the command line completely before touching the network.
  enum class Action { kStatus, kJobs, kPeers, kTuneGet, kTuneSet, kTrace } action;
  if (options.trace_options && command != "trace") {
    return UsageError("--job, --last, --chrome and --flight-recorder go with 'trace'");
  }
  std::string get_key;
  std::vector<std::pair<std::string, std::string>> set_pairs;
  if (command == "status" || command == "jobs" || command == "peers") {
    if (args.size() != 1) return UsageError(absl::StrCat("'", command, "' takes no arguments"));
    action = command == "status" ? Action::kStatus
             : command == "jobs" ? Action::kJobs
                                 : Action::kPeers;
  } else if (command == "trace") {
    if (args.size() != 1) return UsageError("'trace' takes no arguments, only options");
    if (!options.chrome.empty() && !options.flight_recorder.empty()) {
      return UsageError("--chrome and --flight-recorder: one at a time");
    }
    action = Action::kTrace;
  } else if (command == "tune") {
    if (args.size() < 2) return UsageError("'tune' needs 'get' or 'set'");
    if (args[1] == "get") {
      if (args.size() > 3) return UsageError("'tune get' takes at most one KEY");
      action = Action::kTuneGet;
      if (args.size() == 3) get_key = args[2];
    } else if (args[1] == "set") {
      action = Action::kTuneSet;
      if (args.size() < 3) return UsageError("'tune set' needs KEY=VALUE");
      if (args.size() == 4 && args[2].find('=') == std::string::npos &&
          args[3].find('=') == std::string::npos) {
        set_pairs.emplace_back(args[2], args[3]);  // "tune set KEY VALUE"
      } else {
        for (size_t i = 2; i < args.size(); ++i) {
          size_t equals = args[i].find('=');
          if (equals == std::string::npos || equals == 0) {
            return UsageError(absl::StrCat("expected KEY=VALUE, got '", args[i], "'"));
          }
          set_pairs.emplace_back(args[i].substr(0, equals), args[i].substr(equals + 1));
        }
      }
    } else {
      return UsageError(absl::StrCat("unknown tune command '", args[1], "'"));
    }
  } else {
    return UsageError(absl::StrCat("unknown command '", command, "'"));
  }

  Client client(options.socket_path);
  if (auto failure = client.CheckSocket()) return Fail(*failure);
  switch (action) {
    case Action::kStatus:
      return RunStatus(options, client, /*jobs_view=*/false);
    case Action::kJobs:
      return RunStatus(options, client, /*jobs_view=*/true);
    case Action::kPeers:
      return RunPeers(options, client);
    case Action::kTuneGet:
      return RunTuneGet(options, client, get_key);
    case Action::kTuneSet:
      return RunTuneSet(options, client, set_pairs);
    case Action::kTrace:
      return RunTrace(options, client);
  }
  return kExitUsage;
}

}  // namespace
}  // namespace ciuic::ctl

int main(int argc, char** argv) {
  // gRPC logs connection failures on stderr by itself; ciuicctl reports them
  // in one line instead. An operator can still set GRPC_VERBOSITY to debug.
  setenv("GRPC_VERBOSITY", "NONE", /*overwrite=*/0);
  return ciuic::ctl::Run(argc, argv);
}
