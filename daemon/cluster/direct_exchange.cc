#include "cluster/direct_exchange.h"

#include <algorithm>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "reduce/reduce.h"

namespace ciuic::daemon {
namespace {

constexpr uint32_t kMagic = 0x58444943;  // "CIDX"
constexpr uint32_t kFlagFailed = 1;
constexpr uint32_t kFlagOther = 2;
// Tag bit of a step's second message (the value, when not inline); step
// tags are below it (at most 2 + log2 of the nodes).
constexpr uint64_t kBulkTag = uint64_t{1} << (DirectExchange::kTagBits - 1);

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
  int32_t failed_code;  // with kFlagFailed: that node's status code
  uint32_t failed_text_bytes;
  char failed_text[DirectExchange::kMaxFailureText];  // and message (cut)
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
  out_.assign(kMessageBytes, 0);
  in_.assign(kMessageBytes, 0);
  element_bytes_ = payload_bytes_ == 0 ? 1 : params_.sig.element_bytes();
  const uint64_t count = payload_bytes_ == 0 ? 0 : params_.sig.count;
  steps_ = Schedule(nodes_, self_, count, element_bytes_);
  halving_ = std::any_of(steps_.begin(), steps_.end(), [](const Step& s) { return s.gather; });
}

std::vector<DirectExchange::Step> DirectExchange::Schedule(int nodes, int self, uint64_t count,
                                                           size_t element_bytes) {
  std::vector<Step> steps;
  int p = 1;
  while (p * 2 <= nodes) p *= 2;
  const int extra = nodes - p;
  int rounds = 0;
  while ((1 << rounds) < p) ++rounds;
  auto whole = [count](int send_to, int recv_from, bool fold, uint64_t tag) {
    Step s{send_to, recv_from, fold, tag};
    s.send_hi = s.recv_hi = count;
    return s;
  };
  if (self >= p) {
    steps.push_back(whole(self - p, -1, false, 0));
    steps.push_back(whole(-1, self - p, false, kHandBackTag));
    return steps;
  }
  if (self < extra) steps.push_back(whole(-1, self + p, true, 0));
  if (!Halving(p, count * element_bytes)) {
    for (int r = 0; r < rounds; ++r) {
      const int partner = self ^ (1 << r);
      steps.push_back(whole(partner, partner, true, static_cast<uint64_t>(r) + 1));
    }
  } else {
    // Round r splits the part both partners hold ([lo, hi), alike for
    // both: it depends on the lower bits only): the lower node keeps the
    // lower half and folds the partner's copy of it in, the higher node
    // the upper half. The allgather retraces the rounds backwards.
    uint64_t lo = 0, hi = count;
    std::vector<std::pair<uint64_t, uint64_t>> before;
    for (int r = 0; r < rounds; ++r) {
      const int partner = self ^ (1 << r);
      const uint64_t mid = lo + (hi - lo) / 2;
      before.emplace_back(lo, hi);
      Step s{partner, partner, true, static_cast<uint64_t>(r) + 1};
      if (((self >> r) & 1) == 0) {
        s.send_lo = mid, s.send_hi = hi, s.recv_lo = lo, s.recv_hi = mid;
        hi = mid;
      } else {
        s.send_lo = lo, s.send_hi = mid, s.recv_lo = mid, s.recv_hi = hi;
        lo = mid;
      }
      steps.push_back(s);
    }
    for (int r = rounds - 1; r >= 0; --r) {
      const int partner = self ^ (1 << r);
      const auto [parent_lo, parent_hi] = before[static_cast<size_t>(r)];
      Step s{partner, partner, false, static_cast<uint64_t>(2 * rounds - r)};
      s.gather = true;
      s.send_lo = lo, s.send_hi = hi;
      if (lo == parent_lo) {
        s.recv_lo = hi, s.recv_hi = parent_hi;
      } else {
        s.recv_lo = parent_lo, s.recv_hi = lo;
      }
      lo = parent_lo, hi = parent_hi;
      steps.push_back(s);
    }
  }
  if (self < extra) steps.push_back(whole(self + p, -1, false, kHandBackTag));
  return steps;
}

size_t DirectExchange::BytesSent(int nodes, int sender, int receiver, uint64_t tag,
                                 const OpSignature& sig) {
  if (sig.collective == static_cast<uint32_t>(wire::Collective::kBarrier)) return 0;
  // Bounded before it is multiplied: no direct operation is larger.
  if (sig.count > kMaxBulkBytes || sender < 0 || sender >= nodes) return 0;
  const size_t element_bytes = wire::DataTypeSize(sig.dtype);
  if (element_bytes == 0 || sig.count * element_bytes > kMaxBulkBytes) return 0;
  for (const Step& s : Schedule(nodes, sender, sig.count, element_bytes)) {
    if (s.tag == tag && s.send_to == receiver) return (s.send_hi - s.send_lo) * element_bytes;
  }
  return 0;
}

uint8_t* DirectExchange::Value() {
  if (value_ == nullptr && payload_bytes_ > 0) {
    value_ = std::make_unique_for_overwrite<uint8_t[]>(payload_bytes_);
  }
  return value_.get();
}

uint8_t* DirectExchange::BulkIn() {
  if (bulk_in_ == nullptr && payload_bytes_ > 0) {
    bulk_in_ = std::make_unique_for_overwrite<uint8_t[]>(payload_bytes_);
  }
  return bulk_in_.get();
}

void DirectExchange::Start() {
  // Whatever own memory the steps may land in is allocated here, on the
  // caller's thread (where a failed allocation fails the operation), not
  // in a transport callback. A single receive into the caller's output
  // needs none.
  const auto receives = std::count_if(steps_.begin(), steps_.end(),
                                      [](const Step& step) { return step.recv_from >= 0; });
  if (output_ == nullptr || halving_ || receives > 1) {
    Value();
    BulkIn();
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (input_ != nullptr && payload_bytes_ > kInlineBytes && !abandoned_) {
      current_ = input_;
    } else {
      current_ = Value();
      // A value sent inline is copied into the message anyway. (Abandoned
      // already: nothing is sent, and the rank's buffer is not read.)
      if (input_ != nullptr && payload_bytes_ > 0 && !abandoned_) {
        std::memcpy(Value(), input_, payload_bytes_);
      }
    }
  }
  if (steps_.empty()) return Finish();  // one node
  RunStep();
}

void DirectExchange::Finish() {
  absl::Status s;
  uint8_t* result = nullptr;
  {
    // Under mu_: the caller's output is written before Abandon returns, or
    // not at all (Abandon fails the outcome).
    std::lock_guard<std::mutex> lock(mu_);
    s = OutcomeLocked();
    if (s.ok()) {
      // The result goes to the caller's output if there is one, else stays
      // where the last step left it (the input of one node is copied once).
      result = output_ != nullptr                                  ? output_
               : current_ != nullptr && current_ == bulk_in_.get() ? bulk_in_.get()
                                                                   : Value();
      if (current_ != result && payload_bytes_ > 0) std::memcpy(result, current_, payload_bytes_);
    }
  }
  finished_(s, result);
}

bool DirectExchange::InCallerBuffers(const uint8_t* p) const {
  auto within = [this, p](const uint8_t* base) {
    return base != nullptr && p >= base && p < base + payload_bytes_;
  };
  return within(input_) || within(output_);
}

bool DirectExchange::Abandon(absl::Status why, std::function<void()> released) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    abandoned_ = true;
    if (transfer_error_.ok()) transfer_error_ = std::move(why);
    if (caller_transfers_ > 0) {
      released_ = std::move(released);
      return false;
    }
  }
  released();
  return true;
}

void DirectExchange::CallerTransferEnded() {
  std::function<void()> released;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (--caller_transfers_ == 0 && released_) released.swap(released_);
  }
  if (released) released();
}

uint8_t* DirectExchange::Writable(const uint8_t* p) {
  if (p == nullptr) return nullptr;
  if (p == value_.get()) return value_.get();
  if (p == bulk_in_.get()) return bulk_in_.get();
  if (p == output_) return output_;
  return nullptr;
}

uint8_t* DirectExchange::LandingFor(size_t at) {
  const Step& step = steps_[at];
  const size_t bytes = (step.recv_hi - step.recv_lo) * element_bytes_;
  const bool rounds = step.tag != 0 && step.tag != kHandBackTag;
  if (halving_ && rounds) {
    // The part this node holds; still the caller's input only when an
    // earlier round failed here (what lands is then never used).
    if (step.gather) return Writable(current_) != nullptr ? Writable(current_) : Value();
    const bool last = at + 1 < steps_.size() && steps_[at + 1].gather;
    return last && output_ != nullptr ? output_ : Value();
  }
  bool last = true;
  for (size_t later = at + 1; later < steps_.size(); ++later) {
    if (steps_[later].recv_from >= 0) last = false;
  }
  if (last && output_ != nullptr) return output_;
  // A value that travels inline was copied into the message: folded in place.
  if (bytes <= kInlineBytes && Writable(current_) != nullptr) return Writable(current_);
  return current_ != nullptr && current_ == value_.get() ? BulkIn() : Value();
}

bool DirectExchange::MismatchKnown() const {
  std::lock_guard<std::mutex> lock(mu_);
  return mismatch_;
}

void DirectExchange::RunStep() {
  const size_t at = step_.load();
  const Step step = steps_[at];
  bool failed = false;
  const uint8_t* part = current_ + step.send_lo * element_bytes_;
  const size_t part_bytes = (step.send_hi - step.send_lo) * element_bytes_;
  const bool sends = step.send_to >= 0;
  bool caller_send = false;  // the value apart goes from the caller's buffers
  {
    std::lock_guard<std::mutex> lock(mu_);
    step_error_ = absl::OkStatus();
    DirectHeader h{};
    h.magic = kMagic;
    h.sender = self_;
    h.failed_node = failed_node_;
    failed = !transfer_error_.ok() || peer_failed_;
    if (failed) h.flags |= kFlagFailed;
    if (peer_failed_) {
      h.failed_code = failed_code_;
      h.failed_text_bytes = static_cast<uint32_t>(failed_text_.size());
      std::memcpy(h.failed_text, failed_text_.data(), failed_text_.size());
    } else if (!transfer_error_.ok()) {
      h.failed_node = self_;
      h.failed_code = static_cast<int32_t>(transfer_error_.code());
      const size_t n = std::min(transfer_error_.message().size(), kMaxFailureText);
      h.failed_text_bytes = static_cast<uint32_t>(n);
      std::memcpy(h.failed_text, transfer_error_.message().data(), n);
    }
    h.own = ToWire(params_.sig);
    if (mismatch_) {
      h.flags |= kFlagOther;
      h.other = ToWire(other_);
    }
    std::memcpy(out_.data(), &h, sizeof(h));
    // A failed node's messages carry no value (nobody folds it). What is
    // read of the caller's buffers is read here, under mu_, or counted as
    // a transfer in them before Abandon can return.
    bulk_sent_ = !failed && part_bytes > kInlineBytes;
    if (!failed && !bulk_sent_ && part_bytes > 0 && sends) {
      std::memcpy(out_.data() + kHeaderBytes, part, part_bytes);
    }
    caller_send = sends && bulk_sent_ && InCallerBuffers(part);
    if (caller_send) ++caller_transfers_;
  }
  outstanding_.store((sends ? (bulk_sent_ ? 2 : 1) : 0) + (step.recv_from >= 0 ? 1 : 0));
  auto self = shared_from_this();
  const uint64_t tag = params_.tag_base | step.tag;
  if (step.recv_from >= 0) {
    std::memset(in_.data(), 0, kHeaderBytes);  // a failed receive leaves no stale header
    params_.transport->Recv(step.recv_from, params_.channel, tag, in_.data(), in_.size(),
                            [self, step, tag](absl::Status s) {
                              self->HeaderArrived(step, tag, std::move(s));
                            });
  }
  if (sends) {
    auto sent = [self](absl::Status s) {
      if (!s.ok()) {
        std::lock_guard<std::mutex> lock(self->mu_);
        if (self->transfer_error_.ok()) self->transfer_error_ = std::move(s);
      }
      self->Transferred();
    };
    params_.transport->Send(step.send_to, params_.channel, tag, out_.data(), out_.size(), sent);
    if (bulk_sent_) {
      params_.transport->Send(step.send_to, params_.channel, tag | kBulkTag, part, part_bytes,
                              [self, sent, caller_send](absl::Status s) {
                                if (caller_send) self->CallerTransferEnded();
                                sent(std::move(s));
                              });
    }
  }
}

void DirectExchange::HeaderArrived(const Step& step, uint64_t tag, absl::Status received) {
  // Set under mu_ below: where the value that follows goes, if one does.
  uint8_t* into = nullptr;
  size_t bulk = 0;
  bool fold = false;  // a reducing receive: op(value_, what arrives) lands in bulk_in_
  bool caller = false;  // the receive writes, or its fold reads, the caller's buffers
  std::shared_ptr<std::vector<uint8_t>> drain;
  {
    std::lock_guard<std::mutex> lock(mu_);
    DirectHeader h;
    std::memcpy(&h, in_.data(), sizeof(h));
    if (!received.ok()) {
      step_error_ = std::move(received);
    } else if (h.magic != kMagic || h.sender != step.recv_from) {
      step_error_ = absl::DataLossError(absl::StrCat(
          "node ", step.recv_from, " sent a message that is not a direct exchange's"));
    } else if (!(h.flags & kFlagFailed)) {
      // The value that follows: as the sender's signature says
      // (BytesSent bounds it: a value larger than any direct operation is
      // left unreceived, and the operation fails on the mismatch anyway).
      const OpSignature theirs = FromWire(h.own);
      const size_t their_bytes = BytesSent(nodes_, step.recv_from, self_, step.tag, theirs);
      if (their_bytes > kInlineBytes && their_bytes <= kMaxBulkBytes) {
        bulk = their_bytes;
        if (SameSignature(theirs, params_.sig) && !abandoned_) {
          // Folded as it arrives, fragment by fragment from the transport's
          // buffers (LandingFor: never into what may still be on its way
          // out in this step's send).
          landing_ = LandingFor(step_.load());
          into = landing_ + step.recv_lo * element_bytes_;
          fold = step.fold;
          caller = InCallerBuffers(into) ||
                   (fold && InCallerBuffers(current_ + step.recv_lo * element_bytes_));
          if (caller) ++caller_transfers_;
        } else {
          // Theirs, not ours to fold; or the operation has ended here.
          drain = std::make_shared<std::vector<uint8_t>>(bulk);
          into = drain->data();
        }
      }
    }
  }
  if (into != nullptr) {
    outstanding_.fetch_add(1);
    auto self = shared_from_this();
    auto arrived = [self, drain, caller](absl::Status s) {
      if (caller) self->CallerTransferEnded();
      if (!s.ok()) {
        std::lock_guard<std::mutex> lock(self->mu_);
        if (self->step_error_.ok()) self->step_error_ = std::move(s);
      }
      self->Transferred();
    };
    if (fold) {
      // Every fold is op(lower node's value, higher node's value).
      ReduceInto reduce_into;
      reduce_into.dtype = static_cast<wire::DataType>(params_.sig.dtype);
      reduce_into.op = params_.op;
      reduce_into.received_first = step.recv_from < self_;
      reduce_into.dest = into;
      reduce_into.local = current_ + step.recv_lo * element_bytes_;
      params_.transport->RecvReduce(step.recv_from, params_.channel, tag | kBulkTag, reduce_into,
                                    bulk, std::move(arrived));
    } else {
      params_.transport->Recv(step.recv_from, params_.channel, tag | kBulkTag, into, bulk,
                              std::move(arrived));
    }
  }
  Transferred();
}

void DirectExchange::Transferred() {
  if (outstanding_.fetch_sub(1) == 1) StepDone();
}

void DirectExchange::StepDone() {
  const size_t at = step_.load();
  const Step step = steps_[at];
  if (step.recv_from >= 0) Absorb(step);
  size_t next = at + 1;
  // A mismatch is known to every node of the rounds once the reduce-scatter
  // is over (each has heard from all): nobody gathers a result that will
  // not be given. (A node whose size chose the doubling has no such rounds.)
  if (next < steps_.size() && steps_[next].gather && MismatchKnown()) {
    while (next < steps_.size() && steps_[next].gather) ++next;
  }
  step_.store(next);
  if (next < steps_.size()) return RunStep();
  Finish();
}

void DirectExchange::Absorb(const Step& step) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!step_error_.ok()) {
    if (transfer_error_.ok()) transfer_error_ = step_error_;
    return;
  }
  DirectHeader h;
  std::memcpy(&h, in_.data(), sizeof(h));
  const OpSignature theirs = FromWire(h.own);
  if (!mismatch_) {
    if (!SameSignature(theirs, params_.sig)) {
      mismatch_ = true;
      other_ = theirs;
      other_node_ = step.recv_from;
    } else if (h.flags & kFlagOther) {
      mismatch_ = true;
      other_ = FromWire(h.other);
      other_node_ = -1;
    }
  }
  if ((h.flags & kFlagFailed) && !peer_failed_) {
    peer_failed_ = true;
    failed_node_ = h.failed_node >= 0 ? h.failed_node : step.recv_from;
    failed_code_ = h.failed_code;
    failed_text_.assign(h.failed_text, std::min<size_t>(h.failed_text_bytes, kMaxFailureText));
  }
  if (mismatch_ || peer_failed_ || !transfer_error_.ok() || payload_bytes_ == 0) return;
  const size_t count = step.recv_hi - step.recv_lo;
  const size_t bytes = count * element_bytes_;
  if (bytes > kInlineBytes) {
    // Folded as it arrived (HeaderArrived), or landed there.
    current_ = landing_;
    return;
  }
  uint8_t* land = LandingFor(step_.load());
  const size_t at = step.recv_lo * element_bytes_;
  const uint8_t* got = in_.data() + kHeaderBytes;
  if (step.fold) {
    const void* inputs[2];
    const uint8_t* mine = current_ + at;
    inputs[0] = step.recv_from < self_ ? static_cast<const void*>(got) : mine;
    inputs[1] = step.recv_from < self_ ? static_cast<const void*>(mine) : got;
    reduce::Reduce(static_cast<wire::DataType>(params_.sig.dtype), params_.op, inputs, 2,
                   land + at, count);
  } else if (bytes > 0) {
    std::memcpy(land + at, got, bytes);
  }
  current_ = land;
}

absl::Status DirectExchange::OutcomeLocked() const {
  if (mismatch_) {
    const std::string who =
        other_node_ >= 0 ? absl::StrCat("node ", other_node_) : std::string("another node");
    const std::string theirs = other_.ToString();
    return absl::InvalidArgumentError(absl::StrCat(
        "operation '", params_.name, "' mismatched across nodes: node ", self_, " submitted ",
        params_.sig.ToString(), ", ", who, " submitted ", theirs,
        params_.named ? " (a named operation is matched by its name and occurrence: every rank "
                        "must submit the same operation under a name each time)"
                      : " (unnamed operations are matched by submission order: every rank must "
                        "submit the same ones in the same order)"));
  }
  if (!transfer_error_.ok()) return transfer_error_;
  if (peer_failed_) {
    // The failing node's code: a mismatch among its ranks is INVALID_ARGUMENT
    // on every node, as the coordinator makes it; anything else says that
    // node could not take part (UNAVAILABLE).
    const bool invalid = failed_code_ == static_cast<int>(absl::StatusCode::kInvalidArgument);
    const std::string why = failed_text_.empty() ? "" : absl::StrCat(": ", failed_text_);
    if (invalid) {
      return absl::InvalidArgumentError(absl::StrCat("operation '", params_.name,
                                                     "' failed on node ", failed_node_, why));
    }
    return absl::UnavailableError(absl::StrCat("operation '", params_.name, "': node ",
                                               failed_node_, " could not take part in it", why));
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
