#include "control/peer_client.h"

#include <mutex>

#include "absl/strings/str_cat.h"
#include "ciuic/peer.grpc.pb.h"
#include "control/tcp_ordering.h"
#include "grpcpp/grpcpp.h"
#include "spdlog/spdlog.h"

namespace ciuic::daemon {
namespace {

std::shared_ptr<grpc::Channel> PeerChannel(const std::string& address) {
  grpc::ChannelArguments args;
  // A vanished peer host is noticed within seconds even without a RST.
  args.SetInt(GRPC_ARG_KEEPALIVE_TIME_MS, 2000);
  args.SetInt(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, 3000);
  args.SetInt(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
  args.SetInt(GRPC_ARG_HTTP2_MAX_PINGS_WITHOUT_DATA, 0);
  return grpc::CreateCustomChannel(address, grpc::InsecureChannelCredentials(), args);
}

absl::Status FromGrpc(const grpc::Status& s, const std::string& context) {
  if (s.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(s.error_code()),
                      absl::StrCat(context, s.error_message()));
}

// How long a node waits for the coordinator's ordering listener to accept.
constexpr int kOrderingConnectTimeoutMs = 5000;

class GrpcOrderingStream final : public OrderingStream {
 public:
  GrpcOrderingStream(proto::Peer::Stub* stub, std::string address)
      : address_(std::move(address)), stream_(stub->OrderStream(&ctx_)) {}
  bool Write(const proto::NodeEvent& event) override { return stream_->Write(event); }
  bool Read(proto::CoordinatorEvent* event) override { return stream_->Read(event); }
  void WritesDone() override { stream_->WritesDone(); }
  absl::Status Finish() override { return FromGrpc(stream_->Finish(), ""); }
  void Cancel() override { ctx_.TryCancel(); }
  std::string Describe() const override { return "over gRPC to " + address_; }

 private:
  const std::string address_;
  grpc::ClientContext ctx_;  // before stream_: it must outlive the stream
  std::unique_ptr<grpc::ClientReaderWriter<proto::NodeEvent, proto::CoordinatorEvent>> stream_;
};

class GrpcCoordinatorClient final : public CoordinatorClient {
 public:
  explicit GrpcCoordinatorClient(const std::string& address)
      : address_(address), stub_(proto::Peer::NewStub(PeerChannel(address))) {}

  absl::StatusOr<proto::Membership> Register(
      const proto::RegisterNodeRequest& request,
      std::chrono::system_clock::time_point deadline) override {
    grpc::ClientContext ctx;
    ctx.set_deadline(deadline);
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (cancelled_) return absl::CancelledError("registration cancelled");
      registering_ = &ctx;
    }
    proto::Membership membership;
    grpc::Status s = stub_->RegisterNode(&ctx, request, &membership);
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
                                       kOrderingConnectTimeoutMs);
      if (tcp.ok()) return tcp;
      spdlog::warn("{}; ordering over the coordinator's gRPC service instead",
                   std::string(tcp.status().message()));
    }
    return std::make_unique<GrpcOrderingStream>(stub_.get(), address_);
  }

 private:
  const std::string address_;
  std::unique_ptr<proto::Peer::Stub> stub_;
  std::mutex mu_;
  bool cancelled_ = false;                      // guarded by mu_
  grpc::ClientContext* registering_ = nullptr;  // guarded by mu_
};

}  // namespace

CoordinatorClientFactory GrpcCoordinatorClients() {
  return [](const std::string& address) -> std::unique_ptr<CoordinatorClient> {
    return std::make_unique<GrpcCoordinatorClient>(address);
  };
}

}  // namespace ciuic::daemon
