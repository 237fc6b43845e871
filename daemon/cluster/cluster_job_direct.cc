// ClusterJob's direct operations: unnamed allreduces and barriers of at
// most the job's direct_max_bytes, run between the nodes without the
// coordinator (direct_exchange.h; README.md, "Direct operations").
//
// Threads: an op starts on Submit's caller (the engine's loop), or on the
// ClusterJob's thread when it came before the job formed or has GPU
// buffers; its exchange ends on a transport thread, which writes the
// result to the ranks' buffers and ends the op there (Done: the engine's
// ClusterOp::done tells the ranks from that thread); a GPU op's result
// goes back to the ClusterJob's thread to be stored. The table direct_ decides who ends an op: whoever
// takes it out (the exchange's end, its deadline, the job's failure).
#include <algorithm>
#include <cstring>
#include <optional>

#include "absl/strings/str_cat.h"
#include "ciuic/collective_rules.h"
#include "cluster/cluster_job.h"
#include "cluster/run_plan.h"
#include "reduce/reduce.h"
#include "spdlog/spdlog.h"

namespace ciuic::daemon {
namespace {

using Clock = std::chrono::steady_clock;

wire::ReduceOp BetweenNodes(const OpSignature& sig) {
  return wire::CombiningOp(static_cast<wire::ReduceOp>(sig.reduce_op));
}

bool IsAvg(const OpSignature& sig) {
  return sig.collective == static_cast<uint32_t>(wire::Collective::kAllreduce) &&
         static_cast<wire::ReduceOp>(sig.reduce_op) == wire::ReduceOp::kAvg;
}

size_t PayloadBytes(const OpSignature& sig) {
  if (sig.collective == static_cast<uint32_t>(wire::Collective::kBarrier)) return 0;
  return sig.count * sig.element_bytes();
}

}  // namespace

bool ClusterJob::DirectSignature(const ClusterOp& op) const {
  const uint64_t max = direct_max_bytes_.load(std::memory_order_relaxed);
  if (max == 0) return false;
  const auto collective = static_cast<wire::Collective>(op.sig.collective);
  if (collective != wire::Collective::kAllreduce && collective != wire::Collective::kBarrier) {
    return false;
  }
  // An operation that asks for a codec goes through the coordinator, which
  // applies it; the count bounds the bytes before they are multiplied.
  if (op.sig.codec != 0 || op.sig.count > max) return false;
  return PayloadBytes(op.sig) <= max;
}

bool ClusterJob::IsUnnamedDirect(const ClusterOp& op, uint64_t* tag_base) const {
  uint64_t number = 0;
  if (!wire::UnnamedNumber(op.name, &number) || !DirectSignature(op)) return false;
  *tag_base = DirectTagBase(number);
  return true;
}

bool ClusterJob::TakeNamedDirectLocked(const ClusterOp& op, uint64_t* tag_base) {
  if (op.name.empty() || wire::IsUnnamed(op.name)) return false;
  auto it = named_slots_.find(op.name);
  if (it == named_slots_.end() || !DirectSignature(op)) return false;
  *tag_base = NamedDirectTagBase(it->second.slot, it->second.next++);
  return true;
}

void ClusterJob::AssignNamedSlotsLocked(const std::vector<std::string>& names) {
  for (const std::string& name : names) {
    if (named_slots_.size() >= kMaxNamedSlots) return;
    if (name.empty() || wire::IsUnnamed(name) || named_slots_.count(name)) continue;
    const auto slot = static_cast<uint32_t>(named_slots_.size());
    named_slots_.emplace(name, NamedSlot{slot, 0});
  }
}

bool ClusterJob::StartDirect(ClusterOp& op, uint64_t tag_base) {
  const uint64_t bytes = DirectExchange::MemoryBytes(PayloadBytes(op.sig));
  bool fits = false;
  {
    std::lock_guard<std::mutex> lock(direct_mu_);
    if (direct_transport_ == nullptr) return false;
    // In order behind those waiting; alone, whatever its size.
    fits = direct_waiting_.empty() &&
           (direct_bytes_ == 0 || direct_bytes_ + bytes <= options_.direct_budget_bytes);
    if (fits) {
      direct_bytes_ += bytes;
    } else {
      direct_waiting_.push_back(WaitingDirect{std::move(op), tag_base, bytes});
      direct_waited_.fetch_add(1, std::memory_order_relaxed);
    }
  }
  if (fits) {
    LaunchDirect(op, tag_base, bytes);
  } else {
    // Its deadline may be the next one the ClusterJob's thread watches.
    std::lock_guard<std::mutex> lock(mu_);
    cv_.notify_all();
  }
  return true;
}

void ClusterJob::StartWaitingDirect() {
  while (true) {
    WaitingDirect w;
    {
      std::lock_guard<std::mutex> lock(direct_mu_);
      if (direct_waiting_.empty() || direct_transport_ == nullptr) return;
      const uint64_t bytes = direct_waiting_.front().bytes;
      if (direct_bytes_ != 0 && direct_bytes_ + bytes > options_.direct_budget_bytes) return;
      w = std::move(direct_waiting_.front());
      direct_waiting_.pop_front();
      direct_bytes_ += w.bytes;
    }
    LaunchDirect(w.op, w.tag_base, w.bytes);
  }
}

void ClusterJob::LaunchDirect(ClusterOp& op, uint64_t tag_base, uint64_t bytes) {
  const Clock::time_point now = Clock::now();
  const uint32_t timeout_ms = op.timeout_ms;
  DirectExchange::Params params;
  params.channel = 0;
  params.tag_base = tag_base;
  params.name = op.name;
  params.named = !wire::IsUnnamed(op.name);
  params.sig = op.sig;
  params.op = BetweenNodes(op.sig);
  const uint64_t key = op.key;
  std::shared_ptr<DirectExchange> exchange;
  {
    std::lock_guard<std::mutex> lock(direct_mu_);
    if (direct_transport_ != nullptr) {
      params.transport = direct_transport_;
      exchange = DirectExchange::Create(
          std::move(params), [this, key, bytes](absl::Status s, uint8_t* r) {
            EndDirect(key, bytes, std::move(s), r);
          });
      ++live_exchanges_;
    } else {
      direct_bytes_ -= bytes;  // the job closed while it waited
    }
  }
  if (!exchange) return Done(op, absl::CancelledError("job closed"));
  // The local phase: the node's ranks reduced into the exchange's value.
  const size_t payload = PayloadBytes(op.sig);
  if (!op.splits_error.empty()) {
    exchange->FailLocally(absl::InvalidArgumentError(absl::StrCat(
        "operation '", op.name, "' mismatched across ranks: ", op.splits_error, " (on ",
        options_.node_name, ")")));
  } else if (payload > 0) {
    // The exchange allocates its own value on first use only: a rank's
    // buffers used in place of it cost no allocation.
    auto value = [&exchange] { return exchange->payload(); };
    if (op.staged) {
      staged_ops_.fetch_add(1, std::memory_order_relaxed);
      StagedNodeBuffer& device = *op.staged;
      absl::Status s = device.ReduceLocal(BetweenNodes(op.sig));
      absl::StatusOr<uint8_t*> slot = s.ok() ? device.Slot(0, payload) : s;
      if (slot.ok()) s = device.Fetch(0, 0, 0, payload);
      if (slot.ok() && s.ok()) s = device.Wait(0);
      if (!slot.ok()) s = slot.status();
      if (s.ok()) {
        std::memcpy(value(), *slot, payload);
        staged_bytes_.fetch_add(payload, std::memory_order_relaxed);
      } else {
        exchange->FailLocally(s);
      }
    } else if (op.early) {
      // Reduced when it was submitted, before it could be known to run
      // direct (a named occurrence the ClusterJob's thread starts).
      if (absl::Status s = op.early->Wait(); s.ok()) {
        std::memcpy(value(), op.parts.front().recv, payload);
        exchange->UseBuffers(nullptr, op.parts.front().recv);
      } else {
        exchange->FailLocally(s);
      }
    } else if (op.parts.size() == 1) {
      // One rank: the exchange reads its send buffer and leaves the result
      // in its recv buffer, with no copy in or out. In place, the value is
      // copied first (the buffer is written while the value may still be
      // on its way out).
      const ClusterOp::Part& only = op.parts.front();
      if (only.send == only.recv) {
        std::memcpy(value(), only.send, payload);
        exchange->UseBuffers(nullptr, only.recv);
      } else {
        exchange->UseBuffers(only.send, only.recv);
      }
    } else {
      // In chunks shared with the worker pool (ReduceLocal). The ranks'
      // sends are read before the exchange starts: the first rank's recv
      // can take the result.
      std::vector<const void*> inputs;
      for (const auto& p : op.parts) inputs.push_back(p.send);
      try {
        ReduceLocal(static_cast<wire::DataType>(op.sig.dtype), BetweenNodes(op.sig), inputs,
                    value(), op.sig.count);
        exchange->UseBuffers(nullptr, op.parts.front().recv);
      } catch (const std::exception& e) {  // out of memory: every node fails it at once
        exchange->FailLocally(absl::ResourceExhaustedError(
            absl::StrCat("the local phase of operation '", op.name, "' failed on ",
                         options_.node_name, ": ", e.what())));
      }
    }
  }
  if (ClusterOp::Timing* t = op.timing.get()) {
    t->ready = t->announced = t->run_start = now;
    t->fused_ops = 1;
    t->direct = true;
    t->algorithm = "direct";
  }
  direct_ops_.fetch_add(1, std::memory_order_relaxed);
  const Clock::time_point deadline = op.deadline;
  {
    std::lock_guard<std::mutex> lock(direct_mu_);
    direct_.emplace(key, DirectOp{std::move(op), exchange, now, deadline, timeout_ms});
  }
  exchange->Start();
  // The ClusterJob's thread watches the deadlines: it may be asleep until
  // a later one.
  if (deadline < Clock::time_point(Clock::duration(direct_wake_ns_.load()))) {
    std::lock_guard<std::mutex> lock(mu_);
    cv_.notify_all();
  }
}

void ClusterJob::EndDirect(uint64_t key, uint64_t bytes, absl::Status status, uint8_t* result) {
  std::optional<DirectOp> d;
  {
    std::lock_guard<std::mutex> lock(direct_mu_);
    auto it = direct_.find(key);
    if (it != direct_.end()) {
      d.emplace(std::move(it->second));
      direct_.erase(it);
    }
  }
  if (d) {
    if (ClusterOp::Timing* t = d->op.timing.get()) t->run_end = Clock::now();
    const size_t payload = PayloadBytes(d->op.sig);
    if (d->op.staged) {
      StagedDirectEnd end{std::move(d->op), status, {}};
      if (status.ok()) end.result.assign(result, result + payload);
      {
        std::lock_guard<std::mutex> lock(direct_mu_);
        staged_direct_ends_.push_back(std::move(end));
      }
      PushDirectEnd();
    } else {
      if (status.ok() && payload > 0) {
        if (IsAvg(d->op.sig)) {
          DivideInPlace(static_cast<wire::DataType>(d->op.sig.dtype), result, d->op.sig.count,
                        options_.world_size);
        }
        FanOut(d->op, result, payload);
      }
      Done(d->op, status);
    }
    // A lost peer ends the job, as a run cut off does.
    if (status.code() == absl::StatusCode::kUnavailable) {
      PushRunFailed(status);
    }
  }
  bool waiting = false;
  {
    std::lock_guard<std::mutex> lock(direct_mu_);
    --live_exchanges_;
    direct_bytes_ -= bytes;
    waiting = !direct_waiting_.empty();
  }
  direct_cv_.notify_all();
  // The ClusterJob's thread starts what now fits (StartWaitingDirect).
  if (waiting) PushDirectEnd();
}

void ClusterJob::FinishStagedDirect() {
  while (true) {
    StagedDirectEnd end;
    {
      std::lock_guard<std::mutex> lock(direct_mu_);
      if (staged_direct_ends_.empty()) return;
      end = std::move(staged_direct_ends_.front());
      staged_direct_ends_.pop_front();
    }
    ClusterOp& op = end.op;
    absl::Status s = end.status;
    const size_t bytes = PayloadBytes(op.sig);
    if (s.ok() && bytes > 0) {
      StagedNodeBuffer& device = *op.staged;
      if (IsAvg(op.sig)) {
        DivideInPlace(static_cast<wire::DataType>(op.sig.dtype), end.result.data(), op.sig.count,
                      options_.world_size);
      }
      absl::StatusOr<uint8_t*> slot = device.Slot(0, bytes);
      if (!slot.ok()) s = slot.status();
      if (s.ok()) {
        std::memcpy(*slot, end.result.data(), bytes);
        s = device.Store(0, 0, 0, bytes);
        staged_bytes_.fetch_add(bytes, std::memory_order_relaxed);
      }
      if (s.ok()) s = device.Finish();
    }
    if (!s.ok()) op.staged->Drain().IgnoreError();
    Done(op, s);
  }
}

Clock::time_point ClusterJob::NextDirectDeadline() {
  std::lock_guard<std::mutex> lock(direct_mu_);
  Clock::time_point next = Clock::time_point::max();
  for (const auto& [key, d] : direct_) next = std::min(next, d.deadline);
  for (const WaitingDirect& w : direct_waiting_) next = std::min(next, w.op.deadline);
  direct_wake_ns_.store(next.time_since_epoch().count());
  return next;
}

void ClusterJob::ExpireDirect() {
  const Clock::time_point now = Clock::now();
  std::vector<DirectOp> expired;
  std::vector<WaitingDirect> expired_waiting;
  int stale = 0;  // exchanges whose op has ended and whose transfers have not
  int live = 0;
  uint64_t held = 0;
  {
    std::lock_guard<std::mutex> lock(direct_mu_);
    for (auto it = direct_.begin(); it != direct_.end();) {
      if (it->second.deadline <= now) {
        expired.push_back(std::move(it->second));
        it = direct_.erase(it);
      } else {
        ++it;
      }
    }
    for (auto it = direct_waiting_.begin(); it != direct_waiting_.end();) {
      if (it->op.deadline <= now) {
        expired_waiting.push_back(std::move(*it));
        it = direct_waiting_.erase(it);
      } else {
        ++it;
      }
    }
    stale = live_exchanges_ - static_cast<int>(direct_.size());
    live = live_exchanges_;
    held = direct_bytes_;
  }
  for (WaitingDirect& w : expired_waiting) {
    absl::Status late = absl::DeadlineExceededError(absl::StrCat(
        "operation '", w.op.name, "' of job '", options_.job_id, "' timed out after ",
        w.op.timeout_ms, " ms waiting to start: the job's ", live,
        " direct exchanges in flight hold ", held, " bytes of the ",
        options_.direct_budget_bytes,
        " they may hold at once, and wait for other nodes (operations start in order as "
        "exchanges end)"));
    spdlog::warn("job '{}': {}", options_.job_id, std::string(late.message()));
    if (w.op.staged) w.op.staged->Drain().IgnoreError();
    Done(w.op, late);
  }
  // A waiting op that ended may have been in the way of the next.
  if (!expired_waiting.empty()) StartWaitingDirect();
  for (DirectOp& d : expired) {
    const int waiting = d.exchange->Waiting();
    std::string from = "the other nodes";
    if (waiting >= 0) {
      std::lock_guard<std::mutex> lock(mu_);
      from = absl::StrCat("node ", waiting < static_cast<int>(peers_.size())
                                       ? peers_[static_cast<size_t>(waiting)].node_name
                                       : std::to_string(waiting));
    }
    absl::Status late = absl::DeadlineExceededError(absl::StrCat(
        "operation '", d.op.name, "' of job '", options_.job_id, "' timed out after ",
        d.timeout_ms, " ms: nothing came from ", from,
        " for it (its ranks have not submitted it, or submitted other operations first: ",
        !wire::IsUnnamed(d.op.name)
            ? "a named operation is matched by its name and occurrence)"
            : "unnamed operations are matched by submission order)"));
    spdlog::warn("job '{}': {}", options_.job_id, std::string(late.message()));
    if (d.op.staged) d.op.staged->Drain().IgnoreError();
    // The exchange stays (its receives cannot be taken back) but lets go
    // of the ranks' buffers before they hear. One that the transport
    // still reads or writes (a value sent from the rank's buffer that
    // the other node never took, a value arriving into it) ends the job:
    // the job's end cuts those transfers off, and the ranks hear then.
    const std::string name = d.op.name;
    if (!AbandonDirect(std::move(d), late)) {
      PushGiveUp(absl::DeadlineExceededError(absl::StrCat(
          "operation '", name, "' of job '", options_.job_id,
          "' timed out while the transport was still moving its ranks' buffers to or from ", from,
          "; such a transfer cannot be taken back, so the job ends")));
    }
  }
  if (!expired.empty() && stale >= kMaxStaleExchanges) {
    PushGiveUp(absl::DeadlineExceededError(absl::StrCat(
        stale, " direct operations of job '", options_.job_id,
        "' have timed out with other nodes never sending their part: the nodes' operations are "
        "out of step, and the job ends (each such exchange holds memory until "
        "it does)")));
  }
}

bool ClusterJob::AbandonDirect(DirectOp d, const absl::Status& why) {
  if (d.exchange == nullptr) {  // waited for the budget: never started
    Done(d.op, why);
    return true;
  }
  auto op = std::make_shared<ClusterOp>(std::move(d.op));
  // `released` runs before the exchange's `finished` (EndDirect), which
  // CloseDirect waits for: the ClusterJob is still there.
  return d.exchange->Abandon(why, [this, op, why] { Done(*op, why); });
}

std::vector<ClusterJob::DirectOp> ClusterJob::TakeDirect() {
  std::vector<DirectOp> taken;
  std::lock_guard<std::mutex> lock(direct_mu_);
  for (auto& [key, d] : direct_) taken.push_back(std::move(d));
  direct_.clear();
  for (WaitingDirect& w : direct_waiting_) {
    DirectOp d;
    d.deadline = w.op.deadline;
    d.timeout_ms = w.op.timeout_ms;
    d.op = std::move(w.op);
    taken.push_back(std::move(d));
  }
  direct_waiting_.clear();
  return taken;
}

void ClusterJob::WaitForDirectOps() {
  std::unique_lock<std::mutex> lock(direct_mu_);
  direct_cv_.wait_for(lock, kDirectGrace, [&] { return direct_.empty(); });
}

void ClusterJob::CloseDirect() {
  Transport* transport = nullptr;
  {
    std::lock_guard<std::mutex> lock(direct_mu_);
    transport = direct_transport_;
    direct_transport_ = nullptr;
    if (live_exchanges_ == 0 || transport == nullptr) return;
  }
  for (int p = 0; p < transport->num_peers(); ++p) {
    if (p != transport->self()) transport->FailPeer(p, absl::CancelledError("job closed"));
  }
  std::unique_lock<std::mutex> lock(direct_mu_);
  if (direct_cv_.wait_for(lock, kDirectGrace, [&] { return live_exchanges_ == 0; })) return;
  // A transport that never completes a transfer: its callbacks would run
  // into a destroyed ClusterJob. Leaked rather than destroyed.
  spdlog::error("job '{}': {} direct exchange(s) still in flight {} ms after their transfers "
                "were cut off; the job's transport is left open",
                options_.job_id, live_exchanges_, kDirectGrace.count());
  lock.unlock();
  std::lock_guard<std::mutex> job_lock(mu_);
  (void)transport_.release();  // NOLINT: deliberately leaked
}

}  // namespace ciuic::daemon
