#include "cluster/ucx_transports.h"

#include "transport/ucx_transport.h"

namespace ciuic::daemon {

namespace {

class UcxUnconnected final : public UnconnectedTransport {
 public:
  explicit UcxUnconnected(std::unique_ptr<UcxTransport> t) : t_(std::move(t)) {}
  std::vector<std::string> Addresses() const override { return t_->WorkerAddresses(); }
  absl::StatusOr<std::unique_ptr<Transport>> Connect(
      int self, const std::vector<std::vector<std::string>>& addresses) override {
    absl::Status s = t_->Connect(self, addresses);
    if (!s.ok()) return s;
    return std::unique_ptr<Transport>(std::move(t_));
  }

 private:
  std::unique_ptr<UcxTransport> t_;
};

}  // namespace

TransportFactory UcxTransportFactory(std::vector<std::string> devices) {
  return [devices](int channels) -> absl::StatusOr<std::unique_ptr<UnconnectedTransport>> {
    auto t = UcxTransport::Create(channels, devices);
    if (!t.ok()) return t.status();
    return std::unique_ptr<UnconnectedTransport>(new UcxUnconnected(std::move(*t)));
  };
}

}  // namespace ciuic::daemon
