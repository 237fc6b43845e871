#include "cluster/direct_exchange.h"

#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "reduce/reduce.h"

namespace ciuic::daemon {
namespace {

constexpr uint32_t kMagic = 0x58444943;  // "CIDX"
constexpr uint32_t kFlagFailed = 1;
constexpr uint32_t kFlagOther = 2;

struct WireSignature {
  uint32_t collective;
  uint32_t dtype;
  uint32_t reduce_op;
  int32_t root;
  uint64_t count;
  uint32_t codec;
  float codec_ratio;
};
static_assert(sizeof(WireSignature) == 32);

struct DirectHeader {
  uint32_t magic;
  uint32_t flags;
  int32_t failed_node;  // with kFlagFailed: whose exchange failed first (-1: unknown)
  int32_t sender;
  WireSignature own;
  WireSignature other;  // with kFlagOther
  uint8_t reserved[16];
};
static_assert(sizeof(DirectHeader) == DirectExchange::kHeaderBytes);

WireSignature ToWire(const OpSignature& s) {
  return WireSignature{s.collective, s.dtype, s.reduce_op, s.root, s.count, s.codec, s.codec_ratio};
}

OpSignature FromWire(const WireSignature& w) {
  OpSignature s;
  s.collective = w.collective;
  s.dtype = w.dtype;
  s.reduce_op = w.reduce_op;
  s.root = w.root;
  s.count = w.count;
  s.codec = w.codec;
  s.codec_ratio = w.codec_ratio;
  return s;
}

// What every node must agree on: the signature without `device` (a node's
// buffers may be on a GPU while another's are in host memory).
bool SameSignature(const OpSignature& a, const OpSignature& b) {
  OpSignature x = a, y = b;
  x.device = y.device = false;
  return x == y;
}

// A size mismatch, as the transports report it (UCX: INVALID_ARGUMENT;
// the in-process hub: DATA_LOSS).
bool IsSizeMismatch(const absl::Status& s) {
  return s.code() == absl::StatusCode::kInvalidArgument || s.code() == absl::StatusCode::kDataLoss;
}

}  // namespace

std::shared_ptr<DirectExchange> DirectExchange::Create(Params params, Finished finished) {
  return std::shared_ptr<DirectExchange>(new DirectExchange(std::move(params), std::move(finished)));
}

DirectExchange::DirectExchange(Params params, Finished finished)
    : params_(std::move(params)), finished_(std::move(finished)) {
  nodes_ = params_.transport->num_peers();
  self_ = params_.transport->self();
  payload_bytes_ = params_.sig.count * params_.sig.element_bytes();
  if (params_.sig.collective == static_cast<uint32_t>(wire::Collective::kBarrier)) {
    payload_bytes_ = 0;
  }
  value_.assign(kHeaderBytes + payload_bytes_, 0);
  inbox_.assign(kHeaderBytes + payload_bytes_, 0);
  int p = 1;
  while (p * 2 <= nodes_) p *= 2;
  const int extra = nodes_ - p;
  int rounds = 0;
  while ((1 << rounds) < p) ++rounds;
  const uint64_t hand_back = static_cast<uint64_t>(rounds) + 1;
  if (self_ >= p) {
    steps_.push_back(Step{self_ - p, -1, false, 0});
    steps_.push_back(Step{-1, self_ - p, false, hand_back});
    return;
  }
  if (self_ < extra) steps_.push_back(Step{-1, self_ + p, true, 0});
  for (int r = 0; r < rounds; ++r) {
    const int partner = self_ ^ (1 << r);
    steps_.push_back(Step{partner, partner, true, static_cast<uint64_t>(r) + 1});
  }
  if (self_ < extra) steps_.push_back(Step{self_ + p, -1, false, hand_back});
}

void DirectExchange::Start() {
  if (steps_.empty()) {  // one node
    absl::Status s = Outcome();
    finished_(s, s.ok() ? payload() : nullptr);
    return;
  }
  RunStep();
}

void DirectExchange::RunStep() {
  const size_t at = step_.load();
  const Step step = steps_[at];
  {
    std::lock_guard<std::mutex> lock(mu_);
    step_error_ = absl::OkStatus();
    DirectHeader h{};
    h.magic = kMagic;
    h.sender = self_;
    h.failed_node = failed_node_;
    if (!transfer_error_.ok() || peer_failed_) h.flags |= kFlagFailed;
    if (!transfer_error_.ok() && failed_node_ < 0) h.failed_node = self_;
    h.own = ToWire(params_.sig);
    if (mismatch_) {
      h.flags |= kFlagOther;
      h.other = ToWire(other_);
    }
    std::memcpy(value_.data(), &h, sizeof(h));
  }
  outstanding_.store((step.send_to >= 0 ? 1 : 0) + (step.recv_from >= 0 ? 1 : 0));
  auto self = shared_from_this();
  const uint64_t tag = params_.tag_base | step.tag;
  if (step.recv_from >= 0) {
    std::memset(inbox_.data(), 0, kHeaderBytes);  // a failed receive leaves no stale header
    params_.transport->Recv(step.recv_from, params_.channel, tag, inbox_.data(), inbox_.size(),
                            [self](absl::Status s) {
                              if (!s.ok()) {
                                std::lock_guard<std::mutex> lock(self->mu_);
                                self->step_error_ = std::move(s);
                              }
                              if (self->outstanding_.fetch_sub(1) == 1) self->StepDone();
                            });
  }
  if (step.send_to >= 0) {
    params_.transport->Send(step.send_to, params_.channel, tag, value_.data(), value_.size(),
                            [self](absl::Status s) {
                              // A size mismatch is the receiver's to report
                              // (it may read the sender's header).
                              if (!s.ok() && !IsSizeMismatch(s)) {
                                std::lock_guard<std::mutex> lock(self->mu_);
                                if (self->transfer_error_.ok()) self->transfer_error_ = std::move(s);
                              }
                              if (self->outstanding_.fetch_sub(1) == 1) self->StepDone();
                            });
  }
}

void DirectExchange::StepDone() {
  const Step step = steps_[step_.load()];
  if (step.recv_from >= 0) Absorb(step, inbox_.data());
  if (step_.fetch_add(1) + 1 < steps_.size()) return RunStep();
  absl::Status s = Outcome();
  finished_(s, s.ok() ? payload() : nullptr);
}

void DirectExchange::Absorb(const Step& step, uint8_t* message) {
  std::lock_guard<std::mutex> lock(mu_);
  DirectHeader h;
  std::memcpy(&h, message, sizeof(h));
  const bool header = h.magic == kMagic && h.sender == step.recv_from;
  if (!step_error_.ok()) {
    if (!IsSizeMismatch(step_error_)) {
      if (transfer_error_.ok()) transfer_error_ = step_error_;
      return;
    }
    // Another size: the operations differ. A shorter message has landed
    // (header first) and names the sender's signature.
    if (!mismatch_) {
      mismatch_ = true;
      other_node_ = step.recv_from;
      other_known_ = header;
      if (header) other_ = FromWire(h.own);
    }
    return;
  }
  if (!header) {
    if (transfer_error_.ok()) {
      transfer_error_ = absl::DataLossError(
          absl::StrCat("node ", step.recv_from, " sent a message that is not a direct exchange's"));
    }
    return;
  }
  const OpSignature theirs = FromWire(h.own);
  if (!mismatch_) {
    if (!SameSignature(theirs, params_.sig)) {
      mismatch_ = true;
      other_ = theirs;
      other_known_ = true;
      other_node_ = step.recv_from;
    } else if (h.flags & kFlagOther) {
      mismatch_ = true;
      other_ = FromWire(h.other);
      other_known_ = true;
      other_node_ = -1;
    }
  }
  if ((h.flags & kFlagFailed) && !peer_failed_) {
    peer_failed_ = true;
    failed_node_ = h.failed_node >= 0 ? h.failed_node : step.recv_from;
  }
  if (mismatch_ || peer_failed_ || !transfer_error_.ok() || payload_bytes_ == 0) return;
  uint8_t* mine = payload();
  const uint8_t* got = message + kHeaderBytes;
  if (!step.fold) {
    std::memcpy(mine, got, payload_bytes_);
    return;
  }
  const void* inputs[2];
  inputs[0] = step.recv_from < self_ ? static_cast<const void*>(got) : mine;
  inputs[1] = step.recv_from < self_ ? static_cast<const void*>(mine) : got;
  reduce::Reduce(static_cast<wire::DataType>(params_.sig.dtype), params_.op, inputs, 2, mine,
                 params_.sig.count);
}

absl::Status DirectExchange::Outcome() const {
  std::lock_guard<std::mutex> lock(mu_);
  if (mismatch_) {
    const std::string who =
        other_node_ >= 0 ? absl::StrCat("node ", other_node_) : std::string("another node");
    const std::string theirs =
        other_known_ ? other_.ToString() : std::string("an operation of another size");
    return absl::InvalidArgumentError(absl::StrCat(
        "operation '", params_.name, "' mismatched across nodes: node ", self_, " submitted ",
        params_.sig.ToString(), ", ", who, " submitted ", theirs,
        " (unnamed operations are matched by submission order: every rank must submit the same "
        "ones in the same order)"));
  }
  if (!transfer_error_.ok()) return transfer_error_;
  if (peer_failed_) {
    return absl::UnavailableError(absl::StrCat("operation '", params_.name, "': node ",
                                               failed_node_, " could not take part in it"));
  }
  return absl::OkStatus();
}

int DirectExchange::Waiting() const {
  const size_t at = step_.load();
  if (at >= steps_.size()) return -1;
  return steps_[at].recv_from;
}

void DirectExchange::FailLocally(absl::Status why) {
  std::lock_guard<std::mutex> lock(mu_);
  if (transfer_error_.ok()) transfer_error_ = std::move(why);
}

}  // namespace ciuic::daemon
