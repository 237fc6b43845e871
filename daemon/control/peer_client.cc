#include "control/peer_client.h"

#include <mutex>

#include "absl/strings/str_cat.h"
#include "ciuic/peer.grpc.pb.h"
#include "control/tcp_ordering.h"
#include "grpcpp/create_channel_posix.h"
#include "grpcpp/grpcpp.h"
#include "spdlog/spdlog.h"

namespace ciuic::daemon {
namespace {

// A channel on an authenticated socket (peer_socket.h), which it owns.
std::shared_ptr<grpc::Channel> PeerChannel(const std::string& address, int fd) {
  grpc::ChannelArguments args;
  // A vanished peer host is noticed within seconds even without a RST.
  args.SetInt(GRPC_ARG_KEEPALIVE_TIME_MS, 2000);
  args.SetInt(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, 3000);
  args.SetInt(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
  args.SetInt(GRPC_ARG_HTTP2_MAX_PINGS_WITHOUT_DATA, 0);
  return grpc::CreateCustomInsecureChannelFromFd(address, fd, args);
}

absl::Status FromGrpc(const grpc::Status& s, const std::string& context) {
  if (s.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(s.error_code()),
                      absl::StrCat(context, s.error_message()));
}

// How long a node waits for a coordinator's listener to accept and
// authenticate it.
constexpr int kConnectTimeoutMs = 5000;

class GrpcOrderingStream final : public OrderingStream {
 public:
  GrpcOrderingStream(std::shared_ptr<proto::Peer::Stub> stub, std::string address)
      : address_(std::move(address)), stub_(std::move(stub)), stream_(stub_->OrderStream(&ctx_)) {}
  bool Write(const proto::NodeEvent& event) override { return stream_->Write(event); }
  bool Read(proto::CoordinatorEvent* event) override { return stream_->Read(event); }
  void WritesDone() override { stream_->WritesDone(); }
  absl::Status Finish() override { return FromGrpc(stream_->Finish(), ""); }
  void Cancel() override { ctx_.TryCancel(); }
  std::string Describe() const override { return "over gRPC to " + address_; }

 private:
  const std::string address_;
  const std::shared_ptr<proto::Peer::Stub> stub_;  // its channel carries the stream
  grpc::ClientContext ctx_;  // before stream_: it must outlive the stream
  std::unique_ptr<grpc::ClientReaderWriter<proto::NodeEvent, proto::CoordinatorEvent>> stream_;
};

class GrpcCoordinatorClient final : public CoordinatorClient {
 public:
  GrpcCoordinatorClient(const std::string& address, PeerSecurity security)
      : address_(address), security_(std::move(security)) {}

  absl::StatusOr<proto::Membership> Register(
      const proto::RegisterNodeRequest& request,
      std::chrono::system_clock::time_point deadline) override {
    grpc::ClientContext ctx;
    ctx.set_deadline(deadline);
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (cancelled_) return absl::CancelledError("registration cancelled");
    }
    auto stub = Stub();
    if (!stub.ok()) return stub.status();
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (cancelled_) return absl::CancelledError("registration cancelled");
      registering_ = &ctx;
    }
    proto::Membership membership;
    grpc::Status s = (*stub)->RegisterNode(&ctx, request, &membership);
    {
      std::lock_guard<std::mutex> lock(mu_);
      registering_ = nullptr;
    }
    if (!s.ok()) {
      return FromGrpc(s, absl::StrCat("registering with coordinator ", address_, ": "));
    }
    return membership;
  }

  void CancelRegister() override {
    std::lock_guard<std::mutex> lock(mu_);
    cancelled_ = true;
    if (registering_ != nullptr) registering_->TryCancel();
  }

  // Over TCP to the coordinator's ordering listener where one is announced
  // and reachable (tcp_ordering.h: a message costs tens of microseconds
  // instead of gRPC's 50-100 per side); else the Peer service's stream.
  absl::StatusOr<std::unique_ptr<OrderingStream>> OpenStream(uint32_t ordering_port) override {
    if (ordering_port != 0) {
      auto tcp = OpenTcpOrderingStream(HostOfAddress(address_), static_cast<int>(ordering_port),
                                       security_, kConnectTimeoutMs);
      if (tcp.ok()) return tcp;
      // A refused handshake is no reason to try another way in.
      if (absl::IsPermissionDenied(tcp.status())) return tcp.status();
      spdlog::warn("{}; ordering over the coordinator's gRPC service instead",
                   std::string(tcp.status().message()));
    }
    auto stub = Stub();
    if (!stub.ok()) return stub.status();
    return std::make_unique<GrpcOrderingStream>(*stub, address_);
  }

 private:
  // The stub on an authenticated connection to the coordinator's peer
  // service: made on first use, and again once the connection has broken
  // (a channel on a socket does not reconnect by itself).
  absl::StatusOr<std::shared_ptr<proto::Peer::Stub>> Stub() {
    std::lock_guard<std::mutex> connect_lock(connect_mu_);
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (stub_ && channel_->GetState(false) != GRPC_CHANNEL_TRANSIENT_FAILURE &&
          channel_->GetState(false) != GRPC_CHANNEL_SHUTDOWN) {
        return stub_;
      }
    }
    const int port = PortOfAddress(address_);
    if (port < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("coordinator address '", address_, "' has no port"));
    }
    auto fd = ConnectToPeer(
        HostOfAddress(address_), port, security_, absl::StrCat("coordinator ", address_),
        std::chrono::steady_clock::now() + std::chrono::milliseconds(kConnectTimeoutMs));
    if (!fd.ok()) return fd.status();
    std::shared_ptr<grpc::Channel> channel = PeerChannel(address_, *fd);
    std::shared_ptr<proto::Peer::Stub> stub = proto::Peer::NewStub(channel);
    std::lock_guard<std::mutex> lock(mu_);
    channel_ = std::move(channel);
    stub_ = stub;
    return stub;
  }

  const std::string address_;
  const PeerSecurity security_;
  std::mutex connect_mu_;  // one connection attempt at a time
  std::mutex mu_;
  std::shared_ptr<grpc::Channel> channel_;      // guarded by mu_
  std::shared_ptr<proto::Peer::Stub> stub_;     // guarded by mu_
  bool cancelled_ = false;                      // guarded by mu_
  grpc::ClientContext* registering_ = nullptr;  // guarded by mu_
};

}  // namespace

CoordinatorClientFactory GrpcCoordinatorClients(PeerSecurity security) {
  return [security = std::move(security)](
             const std::string& address) -> std::unique_ptr<CoordinatorClient> {
    return std::make_unique<GrpcCoordinatorClient>(address, security);
  };
}

}  // namespace ciuic::daemon
