// End-to-end tests of the ciuicctl binary against a fake Control service
// served in this process on a unix socket in a temporary directory.

#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>

#include "absl/synchronization/mutex.h"
#include "ciuic/control.grpc.pb.h"
#include "config/tuning.h"
#include "gmock/gmock.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"

namespace ciuic::ctl {
namespace {

using ::testing::HasSubstr;
using ::testing::IsEmpty;
using ::testing::Not;
using ::testing::StartsWith;

// A daemon stand-in: canned status, real tuning table.
class FakeControl final : public proto::Control::Service {
 public:
  FakeControl() {
    status_.set_version("0.1.0-fake");
    status_.set_node_name("fake-node");
    status_.set_uptime_seconds(125);
    status_.set_worker_threads(4);
    status_.set_ops_completed(42);
    status_.set_bytes_reduced(uint64_t{5} << 20);
    proto::SessionInfo* session = status_.add_sessions();
    session->set_session_id(7);
    session->set_uid(1000);
    session->set_pid(31337);
    session->set_job_id("job-a");
    session->set_rank(1);
    session->set_arena_bytes(uint64_t{1} << 30);
    proto::JobInfo* job = status_.add_jobs();
    job->set_job_id("job-a");
    job->set_uid(1000);
    job->set_world_size(4);
    job->set_local_size(2);
    job->add_ranks(0);
    job->add_ranks(1);
    job->set_state("running");
    job->set_ops_completed(42);
    proto::PendingOp* op = job->add_pending();
    op->set_name("grad.fc1");
    op->set_collective("ALLREDUCE");
    op->set_bytes(8 << 20);
    op->set_age_seconds(1.5);
    op->add_submitted_ranks(0);
    op->add_waiting_for_ranks(1);
  }

  void FailStatusWith(grpc::Status status) {
    absl::MutexLock lock(&mu_);
    status_error_ = std::move(status);
  }

  grpc::Status GetStatus(grpc::ServerContext*, const proto::StatusRequest*,
                         proto::StatusReply* reply) override {
    absl::MutexLock lock(&mu_);
    if (!status_error_.ok()) return status_error_;
    *reply = status_;
    return grpc::Status::OK;
  }

  grpc::Status TuneGet(grpc::ServerContext*, const proto::TuneGetRequest* request,
                       proto::TuneGetReply* reply) override {
    auto entries = tuning_.Get(request->key());
    if (!entries.ok()) return ToGrpc(entries.status());
    for (const config::TuningEntry& entry : *entries) {
      proto::TuneEntry* out = reply->add_entries();
      out->set_key(entry.key);
      out->set_value(entry.value);
      out->set_description(entry.description);
    }
    return grpc::Status::OK;
  }

  grpc::Status TuneSet(grpc::ServerContext*, const proto::TuneSetRequest* request,
                       proto::TuneSetReply* reply) override {
    if (absl::Status status = tuning_.Set(request->key(), request->value()); !status.ok()) {
      return ToGrpc(status);
    }
    auto entries = tuning_.Get(request->key());
    if (!entries.ok()) return ToGrpc(entries.status());
    reply->mutable_entry()->set_key((*entries)[0].key);
    reply->mutable_entry()->set_value((*entries)[0].value);
    reply->mutable_entry()->set_description((*entries)[0].description);
    return grpc::Status::OK;
  }

  config::TuningRegistry& tuning() { return tuning_; }

 private:
  static grpc::Status ToGrpc(const absl::Status& status) {
    return grpc::Status(static_cast<grpc::StatusCode>(status.code()),
                        std::string(status.message()));
  }

  absl::Mutex mu_;
  proto::StatusReply status_ ABSL_GUARDED_BY(mu_);
  grpc::Status status_error_ ABSL_GUARDED_BY(mu_);
  config::TuningRegistry tuning_;
};

struct Result {
  int exit_code = -1;
  std::string out;
  std::string err;
};

class CiuicctlTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char dir_template[] = "/tmp/ciuicctl_test.XXXXXX";
    ASSERT_NE(mkdtemp(dir_template), nullptr);
    dir_ = dir_template;
    socket_path_ = dir_ + "/ciuicd.sock";
    grpc::ServerBuilder builder;
    builder.AddListeningPort("unix:" + socket_path_, grpc::InsecureServerCredentials());
    builder.RegisterService(&service_);
    server_ = builder.BuildAndStart();
    ASSERT_NE(server_, nullptr);
  }

  void TearDown() override {
    if (server_) server_->Shutdown();
    server_.reset();
    unlink(socket_path_.c_str());
    unlink((dir_ + "/stderr").c_str());
    unlink((dir_ + "/plain").c_str());
    unlink((dir_ + "/stale.sock").c_str());
    rmdir(dir_.c_str());
  }

  // Runs ciuicctl with `args` (shell words) and CIUIC_SOCKET unset.
  Result Run(const std::string& args, const std::string& env = "") {
    std::string err_path = dir_ + "/stderr";
    std::string command =
        "env -u CIUIC_SOCKET " + env + " " + CIUICCTL_PATH + " " + args + " 2>" + err_path;
    Result result;
    FILE* pipe = popen(command.c_str(), "r");
    if (pipe == nullptr) {
      ADD_FAILURE() << "popen failed";
      return result;
    }
    char buffer[4096];
    size_t n;
    while ((n = fread(buffer, 1, sizeof(buffer), pipe)) > 0) result.out.append(buffer, n);
    int status = pclose(pipe);
    result.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
    std::ifstream err(err_path);
    std::stringstream text;
    text << err.rdbuf();
    result.err = text.str();
    return result;
  }

  std::string Socket() const { return "--socket " + socket_path_; }

  std::string dir_;
  std::string socket_path_;
  FakeControl service_;
  std::unique_ptr<grpc::Server> server_;
};

TEST_F(CiuicctlTest, Status) {
  Result result = Run(Socket() + " status");
  EXPECT_EQ(result.exit_code, 0) << result.err;
  EXPECT_THAT(result.err, IsEmpty());
  EXPECT_THAT(result.out, StartsWith("ciuicd 0.1.0-fake on node fake-node\n"));
  EXPECT_THAT(result.out, HasSubstr("uptime          2m 05s"));
  EXPECT_THAT(result.out, HasSubstr("operations      42 completed, 0 failed"));
  EXPECT_THAT(result.out, HasSubstr("bytes reduced   5.0 MiB"));
  EXPECT_THAT(result.out, HasSubstr("31337"));
  EXPECT_THAT(result.out, HasSubstr("1.0 GiB"));
  EXPECT_THAT(result.out, HasSubstr("job-a"));
}

TEST_F(CiuicctlTest, Jobs) {
  Result result = Run("jobs " + Socket());  // options may follow the command
  EXPECT_EQ(result.exit_code, 0) << result.err;
  EXPECT_THAT(result.out, HasSubstr("job-a"));
  EXPECT_THAT(result.out, HasSubstr("PENDING OPERATIONS"));
  EXPECT_THAT(result.out, HasSubstr("grad.fc1"));
  EXPECT_THAT(result.out, HasSubstr("allreduce"));
  EXPECT_THAT(result.out, HasSubstr("8.0 MiB"));
  EXPECT_THAT(result.out, HasSubstr("1.5s"));
}

TEST_F(CiuicctlTest, SocketFromEnvironment) {
  Result result = Run("status", "CIUIC_SOCKET=" + socket_path_);
  EXPECT_EQ(result.exit_code, 0) << result.err;
  EXPECT_THAT(result.out, HasSubstr("fake-node"));
  // --socket wins over the environment.
  result = Run("--socket=" + socket_path_ + " status", "CIUIC_SOCKET=/nonexistent/x.sock");
  EXPECT_EQ(result.exit_code, 0) << result.err;
}

TEST_F(CiuicctlTest, Json) {
  Result result = Run(Socket() + " --json status");
  EXPECT_EQ(result.exit_code, 0) << result.err;
  EXPECT_THAT(result.out, StartsWith("{"));
  EXPECT_EQ(result.out.find('\n'), result.out.size() - 1);  // one line, one object
  EXPECT_THAT(result.out, HasSubstr("\"nodeName\":\"fake-node\""));
  EXPECT_THAT(result.out, HasSubstr("\"opsFailed\":\"0\""));  // defaults printed too
  EXPECT_THAT(result.out, HasSubstr("\"waitingForRanks\":[1]"));

  result = Run(Socket() + " --json tune get channels");
  EXPECT_EQ(result.exit_code, 0) << result.err;
  EXPECT_THAT(result.out, StartsWith("{\"entries\":[{\"key\":\"channels\",\"value\":\"2\""));
}

TEST_F(CiuicctlTest, TuneGet) {
  Result result = Run(Socket() + " tune get");
  EXPECT_EQ(result.exit_code, 0) << result.err;
  EXPECT_THAT(result.out, StartsWith("KEY"));
  for (const std::string& key : config::TuningKeys()) EXPECT_THAT(result.out, HasSubstr(key));
  EXPECT_THAT(result.out, HasSubstr("1M"));

  result = Run(Socket() + " tune get chunk_bytes");
  EXPECT_EQ(result.exit_code, 0) << result.err;
  EXPECT_THAT(result.out, HasSubstr("chunk_bytes  1M"));
  EXPECT_THAT(result.out, Not(HasSubstr("channels")));

  result = Run(Socket() + " tune get chunk_byte");
  EXPECT_EQ(result.exit_code, 1);
  EXPECT_EQ(result.err, "error: unknown tuning key 'chunk_byte' (did you mean 'chunk_bytes'?)\n");
}

TEST_F(CiuicctlTest, TuneSet) {
  Result result = Run(Socket() + " tune set chunk_bytes=8388608 algorithm=ring");
  EXPECT_EQ(result.exit_code, 0) << result.err;
  EXPECT_EQ(result.out, "chunk_bytes = 8M\nalgorithm = ring\n");
  EXPECT_EQ(service_.tuning().Snapshot().chunk_bytes, 8u << 20);
  EXPECT_EQ(service_.tuning().Snapshot().algorithm, config::Algorithm::kRing);

  result = Run(Socket() + " tune set channels 4");  // KEY VALUE form
  EXPECT_EQ(result.exit_code, 0) << result.err;
  EXPECT_EQ(result.out, "channels = 4\n");

  result = Run(Socket() + " --json tune set spin_us=10");
  EXPECT_EQ(result.exit_code, 0) << result.err;
  EXPECT_THAT(result.out, StartsWith("{\"entries\":[{\"key\":\"spin_us\",\"value\":\"10\""));
}

TEST_F(CiuicctlTest, TuneSetErrorStopsAndReports) {
  Result result = Run(Socket() + " tune set spin_us=7 channels=0 op_timeout_ms=500");
  EXPECT_EQ(result.exit_code, 1);
  EXPECT_EQ(result.out, "spin_us = 7\n");
  EXPECT_THAT(result.err, StartsWith("error: invalid value '0' for 'channels': out of range"));
  EXPECT_THAT(result.err, HasSubstr("not applied: op_timeout_ms=500"));
  EXPECT_EQ(service_.tuning().Snapshot().channels, 2u);
  EXPECT_EQ(service_.tuning().Snapshot().op_timeout_ms, 60000u);

  result = Run(Socket() + " tune set chunk_byte=4M");
  EXPECT_EQ(result.exit_code, 1);
  EXPECT_EQ(result.err, "error: unknown tuning key 'chunk_byte' (did you mean 'chunk_bytes'?)\n");
}

TEST_F(CiuicctlTest, DaemonErrorExitsOne) {
  service_.FailStatusWith(grpc::Status(grpc::StatusCode::PERMISSION_DENIED, "not for you"));
  Result result = Run(Socket() + " status");
  EXPECT_EQ(result.exit_code, 1);
  EXPECT_EQ(result.err, "error: not for you\n");
  EXPECT_THAT(result.out, IsEmpty());
}

TEST_F(CiuicctlTest, UnreachableDaemonExitsTwo) {
  Result result = Run("--socket /nonexistent/dir/x.sock status");
  EXPECT_EQ(result.exit_code, 2);
  EXPECT_EQ(result.err,
            "cannot reach ciuicd at /nonexistent/dir/x.sock: No such file or directory\n");
  EXPECT_THAT(result.out, IsEmpty());

  result = Run("status", "CIUIC_SOCKET=/nonexistent/env.sock");
  EXPECT_EQ(result.exit_code, 2);
  EXPECT_THAT(result.err, StartsWith("cannot reach ciuicd at /nonexistent/env.sock: "));

  // A socket file nobody listens on (a daemon that died).
  std::string stale = dir_ + "/stale.sock";
  int fd = socket(AF_UNIX, SOCK_STREAM, 0);
  ASSERT_GE(fd, 0);
  sockaddr_un address = {};
  address.sun_family = AF_UNIX;
  std::snprintf(address.sun_path, sizeof(address.sun_path), "%s", stale.c_str());
  ASSERT_EQ(bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)), 0);
  close(fd);
  result = Run("--socket " + stale + " tune get");
  EXPECT_EQ(result.exit_code, 2);
  EXPECT_EQ(result.err,
            "cannot reach ciuicd at " + stale + ": connection refused (is ciuicd running?)\n");
  EXPECT_EQ(std::count(result.err.begin(), result.err.end(), '\n'), 1) << result.err;

  // A plain file is not a socket.
  std::ofstream(dir_ + "/plain") << "x";
  result = Run("--socket " + dir_ + "/plain status");
  EXPECT_EQ(result.exit_code, 2);
  EXPECT_THAT(result.err, HasSubstr("not a socket"));
}

TEST_F(CiuicctlTest, UsageErrorsExit64) {
  for (const char* args :
       {"", "frobnicate", "status extra", "tune", "tune get a b", "tune set", "tune set novalue",
        "tune set =5", "tune frob", "--bogus status", "--socket", "version now"}) {
    Result result = Run(Socket() + " " + args);
    if (std::string(args) == "--socket") result = Run("--socket");
    EXPECT_EQ(result.exit_code, 64) << args;
    EXPECT_THAT(result.err, HasSubstr("usage: ciuicctl")) << args;
    EXPECT_THAT(result.out, IsEmpty()) << args;
  }
}

TEST_F(CiuicctlTest, HelpAndVersion) {
  Result result = Run("--help");
  EXPECT_EQ(result.exit_code, 0);
  EXPECT_THAT(result.out, StartsWith("usage: ciuicctl [--socket PATH] [--json] COMMAND"));
  EXPECT_THAT(result.out, HasSubstr("tune set KEY=VALUE"));
  result = Run("version");
  EXPECT_EQ(result.exit_code, 0);
  EXPECT_EQ(result.out, std::string("ciuicctl ") + CIUIC_VERSION + "\n");
}

}  // namespace
}  // namespace ciuic::ctl
