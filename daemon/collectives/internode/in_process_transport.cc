#include "collectives/internode/in_process_transport.h"

#include <algorithm>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"

namespace ciuic::daemon {
namespace {

constexpr uint64_t kTagMask = (uint64_t{1} << Transport::kTagBits) - 1;

absl::Status Killed(int node) {
  return absl::UnavailableError(absl::StrCat("node ", node, " is gone (killed)"));
}

}  // namespace

int InProcessTransport::num_peers() const { return hub_->num_nodes(); }
int InProcessTransport::num_channels() const { return hub_->num_channels(); }

void InProcessTransport::Send(int peer, int channel, uint64_t tag, const void* data, size_t bytes,
                              TransferDone done) {
  hub_->Post(true, self_, peer, channel, tag, const_cast<void*>(data), bytes, std::move(done));
}

void InProcessTransport::Recv(int peer, int channel, uint64_t tag, void* data, size_t bytes,
                              TransferDone done) {
  hub_->Post(false, self_, peer, channel, tag, data, bytes, std::move(done));
}

void InProcessTransport::RecvReduce(int peer, int channel, uint64_t tag, const ReduceInto& into,
                                    size_t bytes, TransferDone done) {
  hub_->Post(false, self_, peer, channel, tag, into.dest, bytes, std::move(done),
             std::make_shared<FragmentReducer>(into, bytes));
}

void InProcessTransport::FailPeer(int peer, const absl::Status& why) {
  hub_->FailPeerOf(self_, peer, why);
}

InProcessHub::InProcessHub(int num_nodes, int num_channels) : num_channels_(num_channels) {
  for (int i = 0; i < num_nodes; ++i) {
    transports_.push_back(std::unique_ptr<InProcessTransport>(new InProcessTransport(this, i)));
  }
  failed_.assign(num_nodes, std::vector<absl::Status>(num_nodes));
  killed_.assign(num_nodes, absl::OkStatus());
  kill_after_.assign(num_nodes, -1);
  delivery_ = std::thread([this] { DeliveryLoop(); });
}

InProcessHub::~InProcessHub() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
    ReleaseHeldLocked();
    FailPendingLocked([](const Key&, int) { return true; },
                      absl::CancelledError("in-process transport shutting down"));
    cv_.notify_all();
  }
  delivery_.join();
  // Anything queued while the delivery thread was exiting.
  while (true) {
    std::function<void()> job;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (jobs_.empty()) break;
      job = std::move(jobs_.front());
      jobs_.pop_front();
    }
    job();
  }
}

void InProcessHub::Deliver(std::function<void()> job) {
  jobs_.push_back(std::move(job));
  cv_.notify_all();
}

void InProcessHub::DeliveryLoop() {
  while (true) {
    std::function<void()> job;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [this] { return !jobs_.empty() || stopping_; });
      if (jobs_.empty()) return;
      job = std::move(jobs_.front());
      jobs_.pop_front();
    }
    job();
  }
}

void InProcessHub::Post(bool is_send, int self, int peer, int channel, uint64_t tag, void* data,
                        size_t bytes, TransferDone done, std::shared_ptr<FragmentReducer> reducer) {
  std::lock_guard<std::mutex> lock(mu_);
  auto fail = [&](absl::Status why) {
    Deliver([done = std::move(done), why = std::move(why)] { done(why); });
  };
  if (peer < 0 || peer >= num_nodes() || channel < 0 || channel >= num_channels_) {
    return fail(absl::InvalidArgumentError(
        absl::StrCat("node ", peer, " channel ", channel, ": no such peer or channel")));
  }
  if (stopping_) return fail(absl::CancelledError("in-process transport shutting down"));
  if (!killed_[self].ok()) return fail(killed_[self]);
  if (!killed_[peer].ok()) return fail(killed_[peer]);
  if (!failed_[self][peer].ok()) return fail(failed_[self][peer]);

  const Key key = is_send ? Key{self, peer, channel, tag & kTagMask}
                          : Key{peer, self, channel, tag & kTagMask};
  Queues& q = pending_[key];
  std::deque<Pending>& other = is_send ? q.recvs : q.sends;
  if (other.empty()) {
    (is_send ? q.sends : q.recvs)
        .push_back(Pending{self, data, bytes, std::move(done), std::move(reducer)});
    return;
  }
  Pending mine{self, data, bytes, std::move(done), std::move(reducer)};
  Pending theirs = std::move(other.front());
  other.pop_front();
  if (q.sends.empty() && q.recvs.empty()) pending_.erase(key);
  Pending send = is_send ? std::move(mine) : std::move(theirs);
  Pending recv = is_send ? std::move(theirs) : std::move(mine);
  ++matched_transfers_;
  matched_bytes_ += send.bytes;
  const int src = std::get<0>(key), dst = std::get<1>(key);
  const bool hold = send.bytes > hold_over_;
  auto deliver = [send = std::move(send), recv = std::move(recv), src, dst] {
    if (send.bytes == recv.bytes && recv.reducer != nullptr) {
      const size_t n = send.bytes;
      const auto* src = static_cast<const uint8_t*>(send.data);
      const size_t a = std::min(n, n / 3 | 1);
      const size_t b = std::min(n, std::max(a, 2 * n / 3 | 1));
      FragmentReducer& fr = *recv.reducer;
      fr.Consume(b, src + b, n - b);
      fr.Consume(0, src, a);
      fr.Consume(a, src + a, b - a);
      send.done(absl::OkStatus());
      recv.done(fr.complete() ? absl::OkStatus()
                              : absl::InternalError("reducing receive left elements unfolded"));
      return;
    }
    if (send.bytes == recv.bytes) {
      if (send.bytes > 0) std::memcpy(recv.data, send.data, send.bytes);
      send.done(absl::OkStatus());
      recv.done(absl::OkStatus());
      return;
    }
    const std::string sizes =
        absl::StrCat(": sizes disagree (send ", send.bytes, " bytes, receive ", recv.bytes, ")");
    send.done(absl::DataLossError(absl::StrCat("node ", dst, sizes)));
    recv.done(absl::DataLossError(absl::StrCat("node ", src, sizes)));
  };
  if (hold) {
    held_.push_back(std::move(deliver));
  } else {
    Deliver(std::move(deliver));
  }
  for (int node : {src, dst}) {
    if (kill_after_[node] > 0 && --kill_after_[node] == 0) KillLocked(node);
  }
}

void InProcessHub::FailPendingLocked(const std::function<bool(const Key&, int owner)>& involves,
                                     const absl::Status& why) {
  for (auto it = pending_.begin(); it != pending_.end();) {
    for (std::deque<Pending>* d : {&it->second.sends, &it->second.recvs}) {
      std::deque<Pending> keep;
      for (Pending& p : *d) {
        if (involves(it->first, p.owner)) {
          Deliver([done = std::move(p.done), why] { done(why); });
        } else {
          keep.push_back(std::move(p));
        }
      }
      d->swap(keep);
    }
    if (it->second.sends.empty() && it->second.recvs.empty()) {
      it = pending_.erase(it);
    } else {
      ++it;
    }
  }
}

void InProcessHub::FailPeerOf(int self, int peer, const absl::Status& why) {
  std::lock_guard<std::mutex> lock(mu_);
  if (peer < 0 || peer >= num_nodes()) return;
  if (failed_[self][peer].ok()) {
    failed_[self][peer] = absl::Status(
        why.ok() ? absl::StatusCode::kUnavailable : why.code(),
        absl::StrCat("node ", peer, " failed: ", why.message()));
  }
  const absl::Status status = failed_[self][peer];
  ReleaseHeldLocked();
  FailPendingLocked(
      [self, peer](const Key& key, int owner) {
        return owner == self && (std::get<0>(key) == peer || std::get<1>(key) == peer);
      },
      status);
}

void InProcessHub::HoldTransfersOver(size_t bytes) {
  std::lock_guard<std::mutex> lock(mu_);
  hold_over_ = bytes;
}

void InProcessHub::ReleaseHeld() {
  std::lock_guard<std::mutex> lock(mu_);
  ReleaseHeldLocked();
}

void InProcessHub::ReleaseHeldLocked() {
  hold_over_ = SIZE_MAX;
  for (auto& job : held_) Deliver(std::move(job));
  held_.clear();
}

void InProcessHub::KillLocked(int node) {
  ReleaseHeldLocked();
  if (!killed_[node].ok()) return;
  killed_[node] = Killed(node);
  kill_after_[node] = -1;
  FailPendingLocked(
      [node](const Key& key, int) { return std::get<0>(key) == node || std::get<1>(key) == node; },
      killed_[node]);
}

void InProcessHub::KillNode(int node) {
  std::lock_guard<std::mutex> lock(mu_);
  KillLocked(node);
}

void InProcessHub::KillNodeAfter(int node, uint64_t matches) {
  std::lock_guard<std::mutex> lock(mu_);
  if (matches == 0) {
    KillLocked(node);
  } else {
    kill_after_[node] = static_cast<int64_t>(matches);
  }
}

uint64_t InProcessHub::matched_transfers() const {
  std::lock_guard<std::mutex> lock(mu_);
  return matched_transfers_;
}

uint64_t InProcessHub::matched_bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  return matched_bytes_;
}

}  // namespace ciuic::daemon
