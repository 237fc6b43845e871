#include "control/peer_service.h"

#include <chrono>
#include <mutex>

#include "absl/strings/str_cat.h"
#include "grpcpp/grpcpp.h"
#include "spdlog/spdlog.h"

namespace ciuic::daemon {

namespace {

grpc::Status ToGrpc(const absl::Status& s) {
  if (s.ok()) return grpc::Status::OK;
  return grpc::Status(static_cast<grpc::StatusCode>(s.code()), std::string(s.message()));
}

// Writes to one node's stream; the coordinator calls Send from any thread.
class GrpcNodeStream final : public NodeStream {
 public:
  explicit GrpcNodeStream(
      grpc::ServerReaderWriter<proto::CoordinatorEvent, proto::NodeEvent>* stream)
      : stream_(stream) {}
  void Send(const proto::CoordinatorEvent& e) override {
    std::lock_guard<std::mutex> lock(mu_);
    stream_->Write(e);
  }

 private:
  std::mutex mu_;
  grpc::ServerReaderWriter<proto::CoordinatorEvent, proto::NodeEvent>* stream_;
};

}  // namespace

grpc::Status PeerService::RegisterNode(grpc::ServerContext* ctx,
                                       const proto::RegisterNodeRequest* req,
                                       proto::Membership* reply) {
  auto left = ctx->deadline() - std::chrono::system_clock::now();
  auto deadline = std::chrono::steady_clock::now() +
                  std::min<std::chrono::system_clock::duration>(left, std::chrono::hours(1));
  auto membership = coordinator_->Register(*req, deadline, [ctx] { return ctx->IsCancelled(); });
  if (!membership.ok()) return ToGrpc(membership.status());
  *reply = std::move(*membership);
  return grpc::Status::OK;
}

grpc::Status PeerService::OrderStream(
    grpc::ServerContext* ctx,
    grpc::ServerReaderWriter<proto::CoordinatorEvent, proto::NodeEvent>* stream) {
  proto::NodeEvent first;
  if (!stream->Read(&first) || !first.has_hello()) {
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "ordering stream must start with Hello");
  }
  GrpcNodeStream out(stream);
  auto handle = coordinator_->Attach(first.hello(), &out);
  if (!handle.ok()) return ToGrpc(handle.status());
  proto::NodeEvent e;
  bool left = false;
  while (stream->Read(&e)) {
    if (e.has_leave()) left = true;
    coordinator_->OnEvent(*handle, e);
  }
  coordinator_->Detach(*handle, left ? absl::OkStatus()
                                     : absl::UnavailableError(ctx->IsCancelled()
                                                                  ? "its stream was cancelled"
                                                                  : "its stream ended"));
  return grpc::Status::OK;
}

absl::StatusOr<std::unique_ptr<grpc::Server>> StartPeerServer(const std::string& listen,
                                                              grpc::Service* service, int* port) {
  grpc::ServerBuilder builder;
  builder.AddListeningPort(listen, grpc::InsecureServerCredentials(), port);
  builder.RegisterService(service);
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIME_MS, 2000);
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, 3000);
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
  builder.AddChannelArgument(GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS, 1000);
  builder.AddChannelArgument(GRPC_ARG_HTTP2_MAX_PING_STRIKES, 0);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (!server || *port == 0) {
    return absl::UnavailableError(absl::StrCat("cannot listen for peers on ", listen,
                                               " (address in use or not local?)"));
  }
  return server;
}

}  // namespace ciuic::daemon
