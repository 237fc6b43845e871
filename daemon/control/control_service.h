// The gRPC face of the daemon (service ciuic.proto.Control). Thin: every
// call is translated to the Engine or the config::TuningRegistry, which know
// nothing of gRPC. Called on gRPC's threads.
#pragma once

#include <atomic>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "ciuic/control.grpc.pb.h"
#include "config/tuning.h"
#include "control/authorization.h"
#include "control/control_socket.h"
#include "engine/engine.h"

namespace ciuic::daemon {

class ControlService final : public proto::Control::Service {
 public:
  // Calls are answered for the caller that `callers` names (set before the
  // first call: set_callers); a call it cannot place is refused.
  ControlService(Engine* engine, config::TuningRegistry* tuning, Authorization authorization,
                 std::string node_name, std::string socket_path)
      : engine_(engine), tuning_(tuning), authorization_(std::move(authorization)),
        node_name_(std::move(node_name)), socket_path_(std::move(socket_path)) {}

  grpc::Status JoinJob(grpc::ServerContext*, const proto::JoinJobRequest*,
                       proto::JoinJobReply*) override;
  grpc::Status GetStatus(grpc::ServerContext*, const proto::StatusRequest*,
                         proto::StatusReply*) override;
  grpc::Status TuneGet(grpc::ServerContext*, const proto::TuneGetRequest*,
                       proto::TuneGetReply*) override;
  grpc::Status TuneSet(grpc::ServerContext*, const proto::TuneSetRequest*,
                       proto::TuneSetReply*) override;
  grpc::Status GetTrace(grpc::ServerContext*, const proto::TraceRequest*,
                        proto::TraceReply*) override;
  grpc::Status GetPeers(grpc::ServerContext*, const proto::PeersRequest*,
                        proto::PeersReply*) override;

  // Where the peer service listens (shown in status and peers).
  void set_peer_address(std::string address) { peer_address_ = std::move(address); }
  void set_ordering_port(uint32_t port) { ordering_port_ = port; }
  void set_metrics_address(std::string address) { metrics_address_ = std::move(address); }
  void set_callers(const ControlSocket* callers) { callers_.store(callers); }

 private:
  // The caller of `ctx`'s call, or UNAUTHENTICATED.
  absl::StatusOr<Caller> CallerOf(const grpc::ServerContext* ctx) const;

  Engine* engine_;
  config::TuningRegistry* tuning_;
  const Authorization authorization_;
  std::atomic<const ControlSocket*> callers_{nullptr};
  std::string node_name_;
  std::string socket_path_;
  std::string peer_address_;
  uint32_t ordering_port_ = 0;
  std::string metrics_address_;
};

// A gRPC server for `service` with no listening port of its own: its
// connections come from the control socket (control_socket.h).
absl::StatusOr<std::unique_ptr<grpc::Server>> StartControlServer(grpc::Service* service);

}  // namespace ciuic::daemon
