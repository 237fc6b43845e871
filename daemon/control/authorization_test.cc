#include "control/authorization.h"

#include <grp.h>
#include <gtest/gtest.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include <optional>
#include <string>

#include "ciuic/control.grpc.pb.h"
#include "control/control_socket.h"
#include "grpcpp/grpcpp.h"
#include "shm/session_socket.h"

namespace ciuic::daemon {
namespace {

TEST(AuthorizationTest, AdminsAreRootTheDaemonsUidAndTheAdminGroup) {
  auto plain = Authorization::Make(/*daemon_uid=*/999, "");
  ASSERT_TRUE(plain.ok());
  EXPECT_TRUE(plain->IsAdmin(Caller{0, 0, 1, {}}));
  EXPECT_TRUE(plain->IsAdmin(Caller{999, 999, 1, {}}));
  EXPECT_FALSE(plain->IsAdmin(Caller{1000, 1000, 1, {}}));
  absl::Status denied = plain->CheckAdmin(Caller{1000, 1000, 1, {}}, "tune set");
  EXPECT_EQ(denied.code(), absl::StatusCode::kPermissionDenied);
  EXPECT_NE(denied.message().find("tune set"), std::string::npos) << denied;
  EXPECT_NE(denied.message().find("admin_group"), std::string::npos) << denied;
  EXPECT_NE(denied.message().find("uid 1000"), std::string::npos) << denied;

  // A group every Debian system has.
  const group* g = getgrnam("adm");
  ASSERT_NE(g, nullptr);
  const gid_t adm = g->gr_gid;
  auto with_group = Authorization::Make(999, "adm");
  ASSERT_TRUE(with_group.ok());
  EXPECT_TRUE(with_group->IsAdmin(Caller{1000, adm, 1, {}}));         // primary group
  EXPECT_TRUE(with_group->IsAdmin(Caller{1000, 1000, 1, {27, adm}}));  // supplementary
  EXPECT_FALSE(with_group->IsAdmin(Caller{1000, 1000, 1, {27}}));
  EXPECT_NE(with_group->CheckAdmin(Caller{1000, 1000, 1, {}}, "tune set").message().find("'adm'"),
            std::string::npos);
  EXPECT_TRUE(with_group->Sees(Caller{1000, 1000, 1, {}}, 1000));
  EXPECT_FALSE(with_group->Sees(Caller{1000, 1000, 1, {}}, 1001));
  EXPECT_TRUE(with_group->Sees(Caller{1000, adm, 1, {}}, 1001));

  auto missing = Authorization::Make(999, "no-such-group-ciuic");
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kInvalidArgument);
}

// Records who the control socket says each GetStatus call came from.
class WhoCalls final : public proto::Control::Service {
 public:
  grpc::Status GetStatus(grpc::ServerContext* ctx, const proto::StatusRequest*,
                         proto::StatusReply* reply) override {
    std::optional<Caller> c = socket_ ? socket_->CallerOf(ctx->peer()) : std::nullopt;
    if (!c) return grpc::Status(grpc::StatusCode::UNAUTHENTICATED, ctx->peer());
    reply->set_node_name(std::to_string(c->uid) + "/" + std::to_string(c->pid));
    return grpc::Status::OK;
  }
  const ControlSocket* socket_ = nullptr;
};

TEST(ControlSocketTest, EveryCallKnowsItsCallersCredentials) {
  char dir_template[] = "/tmp/ciuic-ctlsock-XXXXXX";
  ASSERT_NE(mkdtemp(dir_template), nullptr);
  const std::string dir = dir_template;
  const std::string path = dir + "/ctl.sock";
  WhoCalls service;
  grpc::ServerBuilder builder;
  builder.RegisterService(&service);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  ASSERT_NE(server, nullptr);
  auto socket = ControlSocket::Start(path, server.get());
  ASSERT_TRUE(socket.ok()) << socket.status();
  service.socket_ = socket->get();

  struct stat st {};
  ASSERT_EQ(stat(path.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0666u) << "the socket is made with its final mode";

  for (int i = 0; i < 3; ++i) {  // separate connections, each placed
    auto channel = grpc::CreateChannel("unix:" + path, grpc::InsecureChannelCredentials());
    auto stub = proto::Control::NewStub(channel);
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    proto::StatusRequest req;
    proto::StatusReply reply;
    grpc::Status s = stub->GetStatus(&ctx, req, &reply);
    ASSERT_TRUE(s.ok()) << s.error_message();
    EXPECT_EQ(reply.node_name(), std::to_string(getuid()) + "/" + std::to_string(getpid()));
  }
  EXPECT_FALSE((*socket)->CallerOf("ipv4:127.0.0.1:5").has_value());
  EXPECT_FALSE((*socket)->CallerOf("fd:").has_value());
  EXPECT_FALSE((*socket)->CallerOf("fd:99999").has_value());
  EXPECT_FALSE((*socket)->CallerOf("fd:3x").has_value());

  (*socket)->Shutdown();
  server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
  unlink(path.c_str());
  rmdir(dir.c_str());
}

TEST(ControlSocketTest, AWorldWritableRuntimeDirectoryIsRefused) {
  char dir_template[] = "/tmp/ciuic-rundir-XXXXXX";
  ASSERT_NE(mkdtemp(dir_template), nullptr);
  const std::string dir = dir_template;
  EXPECT_TRUE(CheckRuntimeDirectory(dir + "/ciuicd.sock").ok());
  ASSERT_EQ(chmod(dir.c_str(), 01777), 0);
  absl::Status s = CheckRuntimeDirectory(dir + "/ciuicd.sock");
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(s.message().find("1777"), std::string::npos) << s;
  EXPECT_NE(s.message().find(dir), std::string::npos) << s;
  if (getuid() == 0) {
    ASSERT_EQ(chmod(dir.c_str(), 0755), 0);
    ASSERT_EQ(chown(dir.c_str(), 65534, 65534), 0);
    EXPECT_EQ(CheckRuntimeDirectory(dir + "/ciuicd.sock").code(),
              absl::StatusCode::kFailedPrecondition)
        << "another uid's directory";
  }
  rmdir(dir.c_str());
}

}  // namespace
}  // namespace ciuic::daemon
