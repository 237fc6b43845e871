#include "control/peer_service.h"

#include <chrono>
#include <condition_variable>
#include <mutex>
#include <thread>

#include "absl/strings/str_cat.h"
#include "control/bounded_writer.h"
#include "grpcpp/grpcpp.h"
#include "grpcpp/server_posix.h"
#include "spdlog/spdlog.h"

namespace ciuic::daemon {

namespace {

grpc::Status ToGrpc(const absl::Status& s) {
  if (s.ok()) return grpc::Status::OK;
  return grpc::Status(static_cast<grpc::StatusCode>(s.code()), std::string(s.message()));
}

// Writes to one node's stream; the coordinator calls Send from any thread,
// under its lock, so Send only queues (bounded_writer.h): a gRPC Write
// blocks while the node does not read. A node whose queue fills is cut off
// (its call cancelled), which ends the handler's reads and detaches it.
class GrpcNodeStream final : public NodeStream {
 public:
  static constexpr size_t kMaxQueuedBytes = size_t{64} << 20;
  GrpcNodeStream(grpc::ServerContext* ctx,
                 grpc::ServerReaderWriter<proto::CoordinatorEvent, proto::NodeEvent>* stream)
      : queue_(
            kMaxQueuedBytes,
            [stream](proto::CoordinatorEvent& e) { return stream->Write(e); },
            [ctx](const std::string& why) {
              spdlog::warn("ordering stream of {}: dropping the node: {}", ctx->peer(), why);
              ctx->TryCancel();
            }) {}
  void Send(const proto::CoordinatorEvent& e) override {
    const size_t bytes = e.ByteSizeLong();
    queue_.Push(e, bytes);
  }

 private:
  BoundedWriter<proto::CoordinatorEvent> queue_;
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
  // The first message must come within hello_timeout_: a stream that says
  // nothing is cancelled rather than holding a server thread for ever.
  proto::NodeEvent first;
  bool read = false;
  bool timed_out = false;  // written by the watchdog, read after joining it
  {
    std::mutex mu;
    std::condition_variable cv;
    bool first_read = false;  // guarded by mu
    std::thread watchdog([&] {
      std::unique_lock<std::mutex> lock(mu);
      if (!cv.wait_for(lock, hello_timeout_, [&] { return first_read; })) {
        timed_out = true;
        ctx->TryCancel();
      }
    });
    read = stream->Read(&first);
    {
      std::lock_guard<std::mutex> lock(mu);
      first_read = true;
    }
    cv.notify_all();
    watchdog.join();
  }
  if (timed_out) {
    return grpc::Status(
        grpc::StatusCode::DEADLINE_EXCEEDED,
        absl::StrCat("no Hello on the ordering stream within ", hello_timeout_.count(), " ms"));
  }
  if (!read || !first.has_hello()) {
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                        "ordering stream must start with Hello");
  }
  GrpcNodeStream out(ctx, stream);
  auto handle = coordinator_->Attach(first.hello(), &out);
  if (!handle.ok()) return ToGrpc(handle.status());
  proto::NodeEvent e;
  bool left = false;
  while (stream->Read(&e)) {
    if (e.has_leave()) left = true;
    coordinator_->OnEvent(*handle, e);
  }
  coordinator_->Detach(*handle,
                       left ? absl::OkStatus()
                            : absl::UnavailableError(ctx->IsCancelled() ? "its stream was cancelled"
                                                                        : "its stream ended"));
  return grpc::Status::OK;
}

absl::StatusOr<std::unique_ptr<PeerServer>> PeerServer::Start(
    const std::string& listen, const std::string& token, grpc::Service* service,
    std::shared_ptr<const TlsContext> tls) {
  const int port = PortOfAddress(listen);
  if (port < 0) {
    return absl::InvalidArgumentError(absl::StrCat("peer service: '", listen, "' has no port"));
  }
  grpc::ServerBuilder builder;
  builder.RegisterService(service);
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIME_MS, 2000);
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, 3000);
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
  builder.AddChannelArgument(GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS, 1000);
  builder.AddChannelArgument(GRPC_ARG_HTTP2_MAX_PING_STRIKES, 0);
  std::unique_ptr<PeerServer> server(new PeerServer());
  server->server_ = builder.BuildAndStart();
  if (!server->server_) return absl::InternalError("peer service: gRPC server did not start");
  PeerListener::Options options;
  options.what = "peer service";
  options.token = token;
  options.tls = std::move(tls);
  grpc::Server* grpc_server = server->server_.get();
  auto listener = PeerListener::Start(HostOfAddress(listen), port, std::move(options),
                                      // gRPC owns the socket from here (and closes it).
                                      [grpc_server](int fd, const std::string&) {
                                        grpc::AddInsecureChannelFromFd(grpc_server, fd);
                                      });
  if (!listener.ok()) return listener.status();  // ~PeerServer stops the gRPC server
  server->listener_ = std::move(*listener);
  return server;
}

PeerServer::~PeerServer() { Shutdown(); }

void PeerServer::Shutdown(std::chrono::system_clock::time_point deadline) {
  if (shut_down_) return;
  shut_down_ = true;
  if (listener_) listener_->Shutdown();  // no new channel after it
  server_->Shutdown(deadline);
}

}  // namespace ciuic::daemon
