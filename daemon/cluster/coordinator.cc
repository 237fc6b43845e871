#include "cluster/coordinator.h"

#include <algorithm>
#include <cmath>
#include <condition_variable>
#include <deque>
#include <limits>
#include <optional>
#include <random>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "ciuic/collective_rules.h"
#include "ciuic/fast_path.h"
#include "ciuic/shm_layout.h"
#include "cluster/channel_weights.h"
#include "cluster/membership.h"
#include "cluster/run_settings.h"
#include "collectives/internode/internode.h"
#include "reduce/reduce.h"
#include "spdlog/spdlog.h"

namespace ciuic::daemon {

using Clock = std::chrono::steady_clock;

namespace {

// Bounds on what one node's Ready may make the coordinator keep.
constexpr uint64_t kMaxPendingPerJob = uint64_t{1} << 18;
constexpr size_t kMaxReadyText = 4096;

// As the engines and the SDK word signatures (fast_path.h).
std::string SignatureText(const proto::OpSignature& s) {
  return wire::SignatureString(s.collective(), s.dtype(), s.reduce_op(), s.root(), s.count(),
                               s.codec(), s.codec_ratio());
}

// The largest allreduce for which the auto rule picks halving-doubling on
// `nodes` nodes (the rule is monotone: past it the ring wins for good).
uint64_t HalvingDoublingLimit(int nodes) {
  uint64_t lo = 0, hi = uint64_t{1} << 30;
  if (ChooseAllreduceAlgorithm(nodes, 1) != InterNodeAlgorithm::kHalvingDoubling) return 0;
  while (hi - lo > 1) {
    const uint64_t mid = lo + (hi - lo) / 2;
    (ChooseAllreduceAlgorithm(nodes, mid) == InterNodeAlgorithm::kHalvingDoubling ? lo : hi) = mid;
  }
  return lo;
}

// a * b, or the largest uint64_t where that passes it: sizes from a peer's
// counts stay comparable with the thresholds instead of wrapping small.
uint64_t SaturatingMul(uint64_t a, uint64_t b) {
  uint64_t product;
  return __builtin_mul_overflow(a, b, &product) ? std::numeric_limits<uint64_t>::max() : product;
}

bool SameSignature(const proto::OpSignature& a, const proto::OpSignature& b) {
  return a.collective() == b.collective() && a.dtype() == b.dtype() &&
         a.reduce_op() == b.reduce_op() && a.root() == b.root() && a.count() == b.count() &&
         a.codec() == b.codec() && a.codec_ratio() == b.codec_ratio();
}

}  // namespace

namespace {

uint64_t NewCoordinatorId() {
  std::random_device device;
  uint64_t id = 0;
  while (id == 0) id = (uint64_t{device()} << 32) ^ device();
  return id;
}

// An ordering stream straight into a Coordinator: Write calls Attach/OnEvent
// on the writing thread, and the coordinator's Send queues for Read.
class LocalStream final : public OrderingStream, public NodeStream {
 public:
  explicit LocalStream(Coordinator* c) : c_(c) {}
  ~LocalStream() override { Close(absl::CancelledError("ordering stream destroyed")); }

  bool Write(const proto::NodeEvent& e) override {
    std::unique_lock<std::mutex> lock(mu_);
    if (closed_) return false;
    if (e.has_hello()) {
      lock.unlock();
      auto h = c_->Attach(e.hello(), this);
      lock.lock();
      if (!h.ok()) {
        closed_ = true;
        why_ = h.status();
        cv_.notify_all();
        return false;
      }
      handle_ = *h;
      attached_ = true;
      return true;
    }
    if (e.has_leave()) left_ = true;
    const uint64_t handle = handle_;
    lock.unlock();
    c_->OnEvent(handle, e);  // may call Send
    return true;
  }
  void Send(const proto::CoordinatorEvent& e) override {
    std::lock_guard<std::mutex> lock(mu_);
    events_.push_back(e);
    cv_.notify_all();
  }
  bool Read(proto::CoordinatorEvent* e) override {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return !events_.empty() || closed_; });
    if (events_.empty()) return false;
    *e = std::move(events_.front());
    events_.pop_front();
    return true;
  }
  // As over the network: the coordinator sees the stream end (cleanly after
  // a Leave), and the reading side ends once it has read what was sent.
  void WritesDone() override { Close(absl::OkStatus()); }
  absl::Status Finish() override {
    std::lock_guard<std::mutex> lock(mu_);
    return why_;
  }
  void Cancel() override { Close(absl::CancelledError("ordering stream cancelled")); }
  std::string Describe() const override { return "in-process (this daemon coordinates the job)"; }

 private:
  void Close(const absl::Status& why) {
    bool detach;
    uint64_t handle;
    absl::Status detach_why;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (closed_) return;
      detach = attached_;
      attached_ = false;
      closed_ = true;
      why_ = why;
      handle = handle_;
      // What the peer service tells the coordinator of a stream that ends.
      if (left_) {
        detach_why = absl::OkStatus();
      } else {
        detach_why = absl::UnavailableError(why.ok() ? "its stream ended"
                                                     : "its stream was cancelled");
      }
      cv_.notify_all();
    }
    if (detach) c_->Detach(handle, detach_why);
  }

  Coordinator* const c_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<proto::CoordinatorEvent> events_;  // guarded by mu_
  bool closed_ = false;                         // guarded by mu_
  bool attached_ = false;                       // guarded by mu_
  bool left_ = false;                           // guarded by mu_
  uint64_t handle_ = 0;                         // guarded by mu_
  absl::Status why_;                            // guarded by mu_
};

}  // namespace

std::unique_ptr<OrderingStream> Coordinator::OpenLocalStream() {
  return std::make_unique<LocalStream>(this);
}

Coordinator::Coordinator(config::TuningRegistry* tuning, int max_world_size)
    : tuning_(tuning), max_world_size_(max_world_size), id_(NewCoordinatorId()) {
  timer_ = std::thread([this] { TimerLoop(); });
}

Coordinator::~Coordinator() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  changed_.notify_all();
  timer_.join();
}

size_t Coordinator::num_jobs() {
  std::lock_guard<std::mutex> lock(mu_);
  return jobs_.size();
}

std::string Coordinator::NodeLabel(const Job& job, int node) const {
  if (node < 0 || node >= job.membership.nodes_size()) return absl::StrCat("node ", node);
  const auto& n = job.membership.nodes(node);
  return absl::StrCat("node ", n.node_name(), " (ranks ", absl::StrJoin(n.ranks(), ","), ")");
}

void Coordinator::Shutdown() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  changed_.notify_all();
}

absl::StatusOr<proto::Membership> Coordinator::Register(const proto::RegisterNodeRequest& r,
                                                        Clock::time_point deadline,
                                                        const std::function<bool()>& cancelled) {
  if (absl::Status s = CheckRegistration(r, max_world_size_); !s.ok()) {
    spdlog::warn("refused a registration for job '{}': {}", r.job_id().substr(0, kMaxJobIdBytes),
                 std::string(s.message()));
    return s;
  }
  std::unique_lock<std::mutex> lock(mu_);
  const std::string key = absl::StrCat(r.uid(), "/", r.job_id());
  if (absl::Status s = CheckPeerProtocol(r.protocol(), absl::StrCat("node ", r.node_name()),
                                         absl::StrCat("the coordinator of job '", r.job_id(), "'"));
      !s.ok()) {
    spdlog::warn("refused a registration for job '{}': {}", r.job_id(), std::string(s.message()));
    // The job cannot form: the nodes already waiting hear why now rather
    // than when their registration times out.
    auto it = jobs_.find(key);
    if (it != jobs_.end() && !it->second->complete && it->second->failure.ok()) {
      it->second->failure = s;
      changed_.notify_all();
    }
    return s;
  }
  auto& slot = jobs_[key];
  if (!slot) {
    slot = std::make_unique<Job>();
    slot->key = key;
    slot->id = r.job_id();
    slot->world_size = r.world_size();
    slot->channels = r.channels();
    slot->instance = next_instance_++;
    slot->rank_registered.assign(static_cast<size_t>(r.world_size()), false);
  }
  Job* job = slot.get();
  if (job->complete) {
    return absl::FailedPreconditionError(absl::StrCat(
        "job '", r.job_id(), "' is already running; a new incarnation needs a new job id or "
        "all its ranks to exit first"));
  }
  if (job->world_size != r.world_size() || job->channels != r.channels()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "job '", r.job_id(), "' has world size ", job->world_size, " and ", job->channels,
        " channels; node ", r.node_name(), " says ", r.world_size(), " and ", r.channels()));
  }
  // Each rank and node name once: a bit per rank, a set of names (a job
  // has at most world_size registrations, each with a rank of its own).
  if (job->node_names.count(r.node_name())) {
    return absl::AlreadyExistsError(
        absl::StrCat("node ", r.node_name(), " already registered for job '", r.job_id(), "'"));
  }
  for (int rank : r.ranks()) {
    if (job->rank_registered[static_cast<size_t>(rank)]) {
      std::string other = "another node";
      for (const auto& reg : job->registrations) {
        if (std::find(reg.ranks().begin(), reg.ranks().end(), rank) != reg.ranks().end()) {
          other = reg.node_name();
        }
      }
      return absl::AlreadyExistsError(absl::StrCat("rank ", rank, " of job '", r.job_id(),
                                                   "' registered by both ", other, " and ",
                                                   r.node_name()));
    }
  }
  for (int rank : r.ranks()) job->rank_registered[static_cast<size_t>(rank)] = true;
  job->node_names.insert(r.node_name());
  job->registrations.push_back(r);
  job->ranks_registered += r.ranks_size();
  spdlog::info("job '{}': node {} registered ranks {} ({}/{})", r.job_id(), r.node_name(),
               absl::StrJoin(r.ranks(), ","), job->ranks_registered, job->world_size);
  if (job->ranks_registered == job->world_size) {
    std::vector<const proto::RegisterNodeRequest*> order;
    for (const auto& reg : job->registrations) order.push_back(&reg);
    std::sort(order.begin(), order.end(), [](auto* a, auto* b) {
      return *std::min_element(a->ranks().begin(), a->ranks().end()) <
             *std::min_element(b->ranks().begin(), b->ranks().end());
    });
    job->membership.set_instance(job->instance);
    job->membership.set_coordinator(id_);
    job->membership.set_ordering_port(static_cast<uint32_t>(ordering_port_.load()));
    job->membership.set_channels(job->channels);
    job->membership.set_protocol(kPeerProtocol);
    {
      // Direct operations are never compressed: while compression is on,
      // only those that compression would leave alone go direct.
      const config::Tuning tuning = tuning_ ? tuning_->Snapshot() : config::Tuning{};
      uint64_t direct = tuning.direct_max_bytes;
      if (tuning.compression != "none") {
        direct = std::min<uint64_t>(direct, tuning.min_compress_bytes > 0
                                                ? tuning.min_compress_bytes - 1 : 0);
      }
      job->membership.set_direct_max_bytes(direct);
    }
    for (auto* reg : order) {
      auto* n = job->membership.add_nodes();
      n->set_node_name(reg->node_name());
      n->set_rack(reg->rack());
      *n->mutable_ranks() = reg->ranks();
      *n->mutable_transport_addresses() = reg->transport_addresses();
    }
    job->complete = true;
    spdlog::info("job '{}' formed: {} nodes, {} ranks", job->id, order.size(), job->world_size);
    changed_.notify_all();
  }
  bool gave_up = false;
  while (!(job->complete || !job->failure.ok() || stopping_)) {
    if (Clock::now() >= deadline) break;
    if (cancelled && cancelled()) {
      gave_up = true;
      break;
    }
    changed_.wait_until(lock, std::min(deadline, Clock::now() + std::chrono::milliseconds(100)));
  }
  if (!job->complete) {
    absl::Status why = !job->failure.ok() ? job->failure
                       : stopping_       ? absl::UnavailableError("coordinator shutting down")
                       : gave_up         ? absl::CancelledError("the registering node gave up")
                                         : absl::DeadlineExceededError(absl::StrCat(
                                               "job '", r.job_id(), "' did not form in time: ",
                                               job->ranks_registered, " of ", job->world_size,
                                               " ranks registered"));
    // Withdraw this node's registration so that it can try again.
    auto& regs = job->registrations;
    for (auto it = regs.begin(); it != regs.end(); ++it) {
      if (it->node_name() == r.node_name()) {
        job->ranks_registered -= it->ranks_size();
        for (int rank : it->ranks()) job->rank_registered[static_cast<size_t>(rank)] = false;
        job->node_names.erase(it->node_name());
        regs.erase(it);
        break;
      }
    }
    if (regs.empty() && !job->complete) jobs_.erase(key);
    return why;
  }
  return job->membership;
}

absl::StatusOr<uint64_t> Coordinator::Attach(const proto::NodeEvent::Hello& h, NodeStream* stream) {
  std::lock_guard<std::mutex> lock(mu_);
  const std::string key = absl::StrCat(h.uid(), "/", h.job_id());
  auto it = jobs_.find(key);
  if (it == jobs_.end() || !it->second->complete || it->second->instance != h.instance()) {
    return absl::NotFoundError(absl::StrCat("no formed job '", h.job_id(), "' instance ",
                                            h.instance(), " here"));
  }
  Job& job = *it->second;
  if (h.node() < 0 || h.node() >= job.membership.nodes_size() || job.streams.count(h.node())) {
    return absl::InvalidArgumentError(absl::StrCat("bad or duplicate node index ", h.node()));
  }
  if (!job.failure.ok()) return job.failure;
  const uint64_t handle = next_handle_++;
  job.streams[h.node()] = stream;
  job.handles[h.node()] = handle;
  job.heard[h.node()] = Clock::now();
  ++job.attached_ever;
  attachments_[handle] = Attachment{key, h.node()};
  return handle;
}

void Coordinator::SendAll(Job& job, const proto::CoordinatorEvent& e) {
  for (auto& [node, stream] : job.streams) stream->Send(e);
}

void Coordinator::FailJob(Job& job, int code, const std::string& message, int node) {
  if (!job.failure.ok()) return;
  job.failure = absl::Status(static_cast<absl::StatusCode>(code), message);
  bool cut_off = false;
  for (const auto& [seq, run] : job.running) {
    cut_off = cut_off || run.failed || (node >= 0 && !run.done[static_cast<size_t>(node)]);
  }
  // A node that leaves (its ranks finished) with no operation pending or
  // queued, and done with every run it was part of, is how a job ends: not
  // worth a warning (the others finish the last run without it: its part
  // is over). Anything else (a lost stream, operations cut off) is.
  const bool quiet_end = code == static_cast<int>(absl::StatusCode::kAborted) && node >= 0 &&
                         job.pending.empty() && job.backlog.empty() && !cut_off;
  if (quiet_end) {
    spdlog::info("job '{}' ended: {}", job.id, message);
  } else {
    spdlog::warn("job '{}' failed: {}{}", job.id, message,
                 cut_off ? " (runs in flight cut off)" : "");
  }
  proto::CoordinatorEvent e;
  e.mutable_job_failed()->set_code(code);
  e.mutable_job_failed()->set_message(message);
  e.mutable_job_failed()->set_runs_cut_off(cut_off);
  SendAll(job, e);
  changed_.notify_all();
}

void Coordinator::OnEvent(uint64_t handle, const proto::NodeEvent& event) {
  std::lock_guard<std::mutex> lock(mu_);
  auto at = attachments_.find(handle);
  if (at == attachments_.end()) return;
  auto jit = jobs_.find(at->second.job_key);
  if (jit == jobs_.end()) return;
  Job& job = *jit->second;
  const int node = at->second.node;
  const int nodes = job.membership.nodes_size();
  job.heard[node] = Clock::now();  // whatever it says, it is alive
  if (event.has_heartbeat()) return;
  if (event.has_leave()) {
    FailJob(job, static_cast<int>(absl::StatusCode::kAborted),
            absl::StrCat(NodeLabel(job, node), " left job '", job.id, "': ",
                         event.leave().reason()),
            node);
    return;
  }
  if (event.has_done()) {
    const auto& done = event.done();
    auto r = job.running.find(done.seq());
    if (r == job.running.end() || r->second.done[node]) return;
    r->second.done[node] = true;
    if (done.code() != 0) {
      r->second.failed = true;
      // A run's own fault on this node (a lost peer, a device fault, its
      // deadline; not a check every node makes alike) is the job's end:
      // the others hear why at once, rather than at their runs' deadline.
      if (done.code() != static_cast<int>(absl::StatusCode::kInvalidArgument)) {
        FailJob(job, done.code(),
                absl::StrCat(NodeLabel(job, node), " failed run ", done.seq(), " of job '", job.id,
                             "': ", done.message()),
                node);
      }
    }
    if (std::count(r->second.done.begin(), r->second.done.end(), true) == nodes) {
      job.running.erase(r);
      Schedule(job, Clock::now());
      changed_.notify_all();  // the timer recomputes its next decision
    }
    return;
  }
  if (!event.has_ready()) return;
  const auto& ready = event.ready();
  if (!job.failure.ok()) {
    proto::CoordinatorEvent e;
    e.mutable_fail()->set_name(ready.name());
    e.mutable_fail()->set_code(static_cast<int>(job.failure.code()));
    e.mutable_fail()->set_message(std::string(job.failure.message()));
    job.streams[node]->Send(e);
    return;
  }
  // What a node sends is bounded before the coordinator keeps any of it: a
  // name as the engine takes it, per-node split hashes for the job's nodes,
  // and no more pending names than the job's ranks can have in flight.
  if (ready.name().empty() || ready.name().size() > wire::kMaxOpName ||
      ready.split_out_size() > nodes || ready.split_in_size() > nodes ||
      ready.splits_error().size() > kMaxReadyText ||
      (ready.channel_rates_size() != 0 && ready.channel_rates_size() != job.channels) ||
      (ready.peer_rates_size() != 0 && ready.peer_rates_size() != nodes)) {
    FailJob(job, static_cast<int>(absl::StatusCode::kInvalidArgument),
            absl::StrCat(NodeLabel(job, node), " sent a malformed Ready (name of ",
                         ready.name().size(), " bytes, ", ready.split_out_size(), "/",
                         ready.split_in_size(), " split hashes for ", nodes, " nodes, ",
                         ready.channel_rates_size(), " channel rates for ", job.channels,
                         " channels, ", ready.peer_rates_size(), " peer rates)"),
            node);
    return;
  }
  if (ready.peer_rates_size() > 0 && nodes <= kMaxRackModelNodes) {
    // Rates a node got wrong (negative, NaN) count as not measured. At most
    // kMaxRackModelNodes^2 numbers per job.
    job.peer_rates.resize(static_cast<size_t>(nodes));
    auto& mine = job.peer_rates[static_cast<size_t>(node)];
    mine.clear();
    for (double r : ready.peer_rates()) mine.push_back(std::isfinite(r) && r > 0 ? r : 0.0);
  }
  if (ready.channel_rates_size() > 0) {
    job.channel_rates.resize(static_cast<size_t>(nodes));
    job.channel_rates[static_cast<size_t>(node)].assign(ready.channel_rates().begin(),
                                                        ready.channel_rates().end());
  }
  const size_t max_pending = std::min<uint64_t>(
      static_cast<uint64_t>(job.world_size) * wire::kRingCapacity, kMaxPendingPerJob);
  if (job.pending.size() >= max_pending && job.pending.count(ready.name()) == 0) {
    FailJob(job, static_cast<int>(absl::StatusCode::kResourceExhausted),
            absl::StrCat(NodeLabel(job, node), " readied more operations than the job's ranks "
                         "can have in flight (", max_pending, " pending at the coordinator)"),
            node);
    return;
  }
  // Ready on every node and queued: each node's Ready of it is in, and none
  // may ready it again before its Run (a node holds a second submission of
  // a name until the first is announced). Kept, it would run twice, or
  // fused with itself.
  if (job.pending.count(ready.name()) == 0 &&
      std::any_of(job.backlog.begin(), job.backlog.end(),
                  [&](const Queued& q) { return q.name == ready.name(); })) {
    proto::CoordinatorEvent e;
    e.mutable_fail()->set_name(ready.name());
    e.mutable_fail()->set_code(static_cast<int>(absl::StatusCode::kFailedPrecondition));
    e.mutable_fail()->set_message(absl::StrCat("operation '", ready.name(), "' readied twice by ",
                                               NodeLabel(job, node), " (it is queued to run)"));
    job.streams[node]->Send(e);
    return;
  }
  const Clock::time_point now = Clock::now();
  const auto timeout = std::chrono::milliseconds(ready.timeout_ms() ? ready.timeout_ms() : wire::kDefaultOpTimeoutMs);
  auto [it, fresh] = job.pending.try_emplace(ready.name());
  PendingRun& run = it->second;
  if (fresh) {
    run.signature = ready.signature();
    run.first_node = node;
    run.ready.assign(nodes, false);
    run.first_ready = now;
    run.deadline = now + timeout;
    run.priority = ready.priority();
  }
  run.priority = std::max(run.priority, ready.priority());
  run.device_buffers = run.device_buffers || ready.device_buffers();
  run.rank_bytes = std::max(run.rank_bytes, ready.rank_bytes());
  auto send_fail = [&](int to, const absl::Status& s) {
    proto::CoordinatorEvent e;
    e.mutable_fail()->set_name(ready.name());
    e.mutable_fail()->set_code(static_cast<int>(s.code()));
    e.mutable_fail()->set_message(std::string(s.message()));
    if (auto st = job.streams.find(to); st != job.streams.end()) st->second->Send(e);
  };
  if (run.ready[node]) {
    send_fail(node, absl::FailedPreconditionError(absl::StrCat(
                        "operation '", ready.name(), "' readied twice by ", NodeLabel(job, node))));
    return;
  }
  run.ready[node] = true;
  ++run.ready_count;
  if (ready.split_out_size() > 0 || ready.split_in_size() > 0) {
    run.split_out.resize(nodes);
    run.split_in.resize(nodes);
    run.split_out[node].assign(ready.split_out().begin(), ready.split_out().end());
    run.split_in[node].assign(ready.split_in().begin(), ready.split_in().end());
  }
  if (run.splits_error.empty()) run.splits_error = ready.splits_error();
  if (!run.failure.ok()) {
    send_fail(node, run.failure);
  } else if (!SameSignature(run.signature, ready.signature())) {
    run.failure = absl::InvalidArgumentError(absl::StrCat(
        "operation '", ready.name(), "' mismatched across nodes: ", NodeLabel(job, run.first_node),
        " submitted ", SignatureText(run.signature), ", ", NodeLabel(job, node), " submitted ",
        SignatureText(ready.signature())));
    for (int n = 0; n < nodes; ++n) {
      if (run.ready[n]) send_fail(n, run.failure);
    }
  } else if (!ready.splits_error().empty()) {
    // The node's own ranks disagree: every node fails the operation now,
    // those that ready it later as they do.
    run.failure = absl::InvalidArgumentError(absl::StrCat(
        "operation '", ready.name(), "' mismatched across ranks: ", ready.splits_error(),
        " (on ", NodeLabel(job, node), ")"));
    for (int n = 0; n < nodes; ++n) {
      if (run.ready[n]) send_fail(n, run.failure);
    }
  } else {
    run.deadline = std::min(run.deadline, now + timeout);
    if (run.ready_count == nodes &&
        run.signature.collective() == static_cast<uint32_t>(wire::Collective::kAlltoallv)) {
      absl::Status splits = CheckSplits(job, ready.name(), run);
      if (!splits.ok()) {
        run.failure = splits;
        for (int n = 0; n < nodes; ++n) send_fail(n, run.failure);
        job.pending.erase(it);
        return;
      }
    }
    if (run.ready_count == nodes) {
      Queued q;
      q.name = ready.name();
      q.signature = run.signature;
      q.priority = run.priority;
      q.bytes = SaturatingMul(run.signature.count(), wire::DataTypeSize(run.signature.dtype()));
      q.order = job.next_order++;
      q.ready_at = now;
      q.device_buffers = run.device_buffers;
      q.rank_bytes = run.rank_bytes;
      q.last_node = node;
      q.first_ready = run.first_ready;
      job.backlog.push_back(std::move(q));
      job.pending.erase(it);
      Schedule(job, now);
      changed_.notify_all();  // the timer recomputes its next decision
      return;
    }
  }
  if (run.ready_count == nodes) job.pending.erase(it);
}

absl::Status Coordinator::CheckSplits(const Job& job, const std::string& name,
                                      const PendingRun& run) {
  auto fail = [&](absl::string_view why) {
    return absl::InvalidArgumentError(
        absl::StrCat("operation '", name, "' mismatched across ranks: ", why));
  };
  if (!run.splits_error.empty()) return fail(run.splits_error);
  const size_t nodes = static_cast<size_t>(job.membership.nodes_size());
  for (size_t k = 0; k < nodes; ++k) {
    if (k >= run.split_out.size() || run.split_out[k].size() != nodes ||
        run.split_in[k].size() != nodes) {
      return fail(absl::StrCat(NodeLabel(job, static_cast<int>(k)),
                               " sent no alltoallv counts (a daemon of an older version?)"));
    }
  }
  for (size_t k = 0; k < nodes; ++k) {
    for (size_t m = 0; m < nodes; ++m) {
      if (k != m && run.split_out[k][m] != run.split_in[m][k]) {
        return fail(absl::StrCat("alltoallv counts disagree: what the ranks of ",
                                 NodeLabel(job, static_cast<int>(k)), " send to those of ",
                                 NodeLabel(job, static_cast<int>(m)),
                                 " is not what those expect from them"));
      }
    }
  }
  return absl::OkStatus();
}

Clock::time_point Coordinator::Schedule(Job& job, Clock::time_point now) {
  if (!job.failure.ok() || job.backlog.empty()) return Clock::time_point::max();
  // The run's settings come from this daemon's tuning as it is now, and go
  // to every node with the announcement (run_settings.h).
  const config::Tuning tuning = tuning_ ? tuning_->Snapshot() : config::Tuning{};
  const auto hold = std::chrono::microseconds(tuning.cycle_time_us);
  uint64_t threshold = tuning.fusion_threshold_bytes;
  const int nodes = job.membership.nodes_size();
  // Fused uncompressed runs use halving-doubling unless the ring gives the
  // same bits (two nodes: then the run's algorithm, by its packed size);
  // with the auto rule, no bigger than the rule would let halving-doubling
  // carry (with 3 nodes it costs 3 full exchanges against the ring's 4/3 of
  // the bytes: packing must not make the transfer dearer). Compressed ones
  // run the compressed allreduce, whatever their size: the threshold alone.
  const uint64_t compressed_threshold = threshold;
  if (tuning.algorithm == config::Algorithm::kAuto &&
      !OffsetIndependent(nodes, InterNodeAlgorithm::kRing)) {
    threshold = std::min(threshold, HalvingDoublingLimit(nodes));
  }
  std::sort(job.backlog.begin(), job.backlog.end(), [](const Queued& a, const Queued& b) {
    return a.priority != b.priority ? a.priority > b.priority : a.order < b.order;
  });
  // An operation's codec under the current tuning ("" uncompressed), or the
  // compression_strict refusal, which fails it on every node.
  // A reduce_scatter moves (and compresses) every rank's block.
  auto codec_of = [&tuning, &job](const Queued& q) {
    const auto& sig = q.signature;
    const bool scatter =
        sig.collective() == static_cast<uint32_t>(wire::Collective::kReduceScatter);
    const uint64_t bytes =
        scatter ? SaturatingMul(q.bytes, static_cast<uint64_t>(job.world_size)) : q.bytes;
    return ResolveCodec(
        q.name, CodecRequest{sig.codec(), sig.codec_ratio(), sig.dtype(), sig.reduce_op(), bytes},
        tuning);
  };
  auto reducing = [](const Queued& q) {
    const auto c = static_cast<wire::Collective>(q.signature.collective());
    return (c == wire::Collective::kAllreduce || c == wire::Collective::kReduceScatter) &&
           CheckReducible(q.signature.dtype(), q.signature.reduce_op()).ok();
  };
  auto allreduce = [&reducing](const Queued& q) {
    return reducing(q) &&
           q.signature.collective() == static_cast<uint32_t>(wire::Collective::kAllreduce);
  };
  while (!job.backlog.empty() && job.running.size() < static_cast<size_t>(kRunningRuns)) {
    const Queued& head = job.backlog.front();
    if (hold.count() > 0 && now < head.ready_at + hold) return head.ready_at + hold;
    std::string head_codec;
    if (reducing(head)) {
      absl::StatusOr<std::string> codec = codec_of(head);
      if (!codec.ok()) {
        proto::CoordinatorEvent e;
        e.mutable_fail()->set_name(head.name);
        e.mutable_fail()->set_code(static_cast<int>(codec.status().code()));
        e.mutable_fail()->set_message(std::string(codec.status().message()));
        SendAll(job, e);
        job.backlog.erase(job.backlog.begin());
        continue;
      }
      head_codec = *codec;
    }
    // The head, and the fusable operations like it that fit, in backlog order.
    std::vector<size_t> group = {0};
    const uint64_t limit = head_codec.empty() ? threshold : compressed_threshold;
    // Operations on GPU buffers run alone, in segments (below).
    const bool fuse = allreduce(head) && !head.device_buffers && limit > 0 && head.bytes <= limit &&
                      FusableAllreduce(head.bytes, head_codec, tuning.algorithm, nodes);
    uint64_t total = head.bytes;
    for (size_t i = 1; fuse && i < job.backlog.size(); ++i) {
      const Queued& q = job.backlog[i];
      if (!allreduce(q) || q.device_buffers || q.signature.dtype() != head.signature.dtype() ||
          q.signature.reduce_op() != head.signature.reduce_op() || q.bytes > limit - total) {
        continue;
      }
      absl::StatusOr<std::string> codec = codec_of(q);
      if (codec.ok() && *codec == head_codec &&
          FusableAllreduce(q.bytes, *codec, tuning.algorithm, nodes)) {
        group.push_back(i);
        total += q.bytes;
      }
    }
    proto::CoordinatorEvent e;
    auto* run = e.mutable_run();
    run->set_name(head.name);
    run->set_seq(job.next_seq++);
    for (size_t g = 1; g < group.size(); ++g) run->add_fused_with(job.backlog[group[g]].name);
    run->set_chunk_bytes(tuning.chunk_bytes);
    run->set_chunks_in_flight(tuning.chunks_in_flight);
    run->set_algorithm(static_cast<uint32_t>(tuning.algorithm));
    // auto, across racks: the cost model of the measured rates chooses
    // between the flat algorithm and its Racks form for an uncompressed
    // allreduce, reduce-scatter, allgather or broadcast that runs alone and
    // whole (internode.h, ModelRacks).
    std::optional<RackCollective> kind;
    uint64_t whole = head.bytes;  // every rank's block, for the scatter and gather
    const uint64_t world = static_cast<uint64_t>(job.world_size);
    switch (static_cast<wire::Collective>(head.signature.collective())) {
      case wire::Collective::kAllreduce: kind = RackCollective::kAllreduce; break;
      case wire::Collective::kReduceScatter:
        kind = RackCollective::kReduceScatter;
        whole = SaturatingMul(head.bytes, world);
        break;
      case wire::Collective::kAllgather:
        kind = RackCollective::kAllgather;
        whole = SaturatingMul(head.bytes, world);
        break;
      case wire::Collective::kBroadcast: kind = RackCollective::kBroadcast; break;
      default: break;
    }
    if (kind && tuning.algorithm == config::Algorithm::kAuto && group.size() == 1 &&
        head_codec.empty() && !head.device_buffers) {
      if (job.racks.empty()) job.racks = RackIndices(job.membership);
      int root_node = 0;
      for (int k = 0; *kind == RackCollective::kBroadcast && k < nodes; ++k) {
        for (int r : job.membership.nodes(k).ranks()) {
          if (r == head.signature.root()) root_node = k;
        }
      }
      std::optional<RackCost> cost;
      if (job.peer_rates.size() == static_cast<size_t>(nodes)) {
        cost = ModelRacks(*kind, job.racks, job.peer_rates, whole, root_node);
      }
      if (cost) {
        run->set_model_flat_us(static_cast<uint64_t>(cost->flat_s * 1e6));
        run->set_model_rack_us(static_cast<uint64_t>(cost->rack_s * 1e6));
        if (cost->rack_s < cost->flat_s) {
          run->set_algorithm(static_cast<uint32_t>(config::Algorithm::kRack));
        }
      }
    }
    run->set_codec(head_codec);
    for (uint32_t share : ChannelShares(job.channel_rates, job.channels)) {
      run->add_channel_shares(share);
    }
    // Some node stages GPU buffers through host memory: every node runs the
    // operation in the same segments, so that node overlaps one segment's
    // copies with another's transfers. Compressed ones go whole (their
    // error feedback is kept per operation element, not per segment). An
    // alltoall(v) is cut into as many segments as its busiest rank needs,
    // every pair's piece alike (Run.segments).
    const auto head_collective = static_cast<wire::Collective>(head.signature.collective());
    if (head.device_buffers && head_codec.empty() &&
        head_collective != wire::Collective::kBarrier) {
      run->set_segment_bytes(tuning.staging_segment_bytes);
      if (head_collective == wire::Collective::kAlltoall ||
          head_collective == wire::Collective::kAlltoallv) {
        run->set_segments(AlltoallSegments(head.rank_bytes, tuning.staging_segment_bytes));
      }
    }
    auto us = [](Clock::duration d) {
      return static_cast<uint64_t>(
          std::max<int64_t>(0, std::chrono::duration_cast<std::chrono::microseconds>(d).count()));
    };
    for (size_t g : group) {
      const Queued& q = job.backlog[g];
      run->add_last_ready_node(q.last_node);
      run->add_ready_spread_us(us(q.ready_at - q.first_ready));
      run->add_queued_us(us(now - q.ready_at));
    }
    job.running.emplace(run->seq(), Job::Running{std::vector<bool>(nodes, false)});
    SendAll(job, e);
    for (auto g = group.rbegin(); g != group.rend(); ++g) {
      job.backlog.erase(job.backlog.begin() + static_cast<std::ptrdiff_t>(*g));
    }
  }
  return Clock::time_point::max();
}

void Coordinator::Detach(uint64_t handle, const absl::Status& why) {
  std::lock_guard<std::mutex> lock(mu_);
  auto at = attachments_.find(handle);
  if (at == attachments_.end()) return;
  const Attachment a = at->second;
  attachments_.erase(at);
  auto jit = jobs_.find(a.job_key);
  if (jit == jobs_.end()) return;
  Job& job = *jit->second;
  job.streams.erase(a.node);
  job.handles.erase(a.node);
  if (!why.ok()) {
    FailJob(
        job, static_cast<int>(absl::StatusCode::kUnavailable),
        absl::StrCat("lost ", NodeLabel(job, a.node), " of job '", job.id, "': ", why.message()),
        a.node);
  }
  if (job.streams.empty()) {
    spdlog::info("job '{}' ended at its coordinator", job.id);
    jobs_.erase(jit);
  }
}

void Coordinator::CheckLiveness(Job& job, Clock::time_point now) {
  if (job.streams.empty() || !job.failure.ok()) return;
  const config::Tuning tuning = tuning_ ? tuning_->Snapshot() : config::Tuning{};
  const auto interval = std::chrono::milliseconds(tuning.heartbeat_interval_ms);
  if (now - job.beat >= interval) {
    job.beat = now;
    proto::CoordinatorEvent beat;
    beat.mutable_heartbeat();
    SendAll(job, beat);
  }
  for (const auto& [node, heard] : job.heard) {
    if (!job.streams.count(node) || now - heard <= interval * tuning.heartbeat_misses) continue;
    const auto silent = std::chrono::duration_cast<std::chrono::milliseconds>(now - heard);
    FailJob(job, static_cast<int>(absl::StatusCode::kUnavailable),
            absl::StrCat(NodeLabel(job, node), " of job '", job.id, "' has been silent for ",
                         silent.count(), " ms (", tuning.heartbeat_misses, " heartbeats of ",
                         tuning.heartbeat_interval_ms,
                         " ms missed): its daemon is stopped, hung or unreachable"),
            node);
    return;
  }
}

void Coordinator::TimerLoop() {
  std::unique_lock<std::mutex> lock(mu_);
  Clock::time_point wake = Clock::now();
  while (!stopping_) {
    changed_.wait_until(lock, std::min(wake, Clock::now() + std::chrono::milliseconds(100)));
    const Clock::time_point now = Clock::now();
    wake = now + std::chrono::milliseconds(100);
    for (auto& [key, job] : jobs_) {
      wake = std::min(wake, Schedule(*job, now));
      CheckLiveness(*job, now);
      for (auto& [name, run] : job->pending) {
        if (!run.failure.ok() || now < run.deadline) continue;
        std::vector<std::string> waiting;
        for (int n = 0; n < job->membership.nodes_size(); ++n) {
          if (!run.ready[n]) waiting.push_back(NodeLabel(*job, n));
        }
        auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(now - run.first_ready);
        run.failure = absl::DeadlineExceededError(absl::StrCat(
            "operation '", name, "' of job '", job->id, "' timed out after ", ms.count(),
            " ms waiting for ", absl::StrJoin(waiting, ", ")));
        proto::CoordinatorEvent e;
        e.mutable_fail()->set_name(name);
        e.mutable_fail()->set_code(static_cast<int>(absl::StatusCode::kDeadlineExceeded));
        e.mutable_fail()->set_message(std::string(run.failure.message()));
        for (int n = 0; n < job->membership.nodes_size(); ++n) {
          if (run.ready[n] && job->streams.count(n)) job->streams[n]->Send(e);
        }
      }
    }
  }
}

}  // namespace ciuic::daemon
