// ClusterJob's lifecycle and its ordering protocol with the coordinator:
// formation (registration, membership, the transport), the ordering
// stream (Ready out; Run, Fail and JobFailed in; heartbeats), timeouts of
// readied operations, and the job's end. The rest of the class lives in
// cluster_job_lanes.cc (the runs' scheduler), cluster_job_execute.cc (the
// host executor and codec policy), cluster_job_staged.cc (the device
// executor) and cluster_job_direct.cc (operations without the
// coordinator); run_plan.h has the layout of a run that they share.
#include "cluster/cluster_job.h"

#include <algorithm>
#include <cstring>
#include <optional>

#include "absl/strings/str_cat.h"
#include "ciuic/collective_rules.h"
#include "ciuic/peer.pb.h"
#include "cluster/coordinator.h"
#include "cluster/membership.h"
#include "cluster/run_plan.h"
#include "collectives/internode/internode.h"
#include "collectives/internode/scratch.h"
#include "reduce/reduce.h"
#include "spdlog/spdlog.h"
#include "transport/forwarding_transport.h"

namespace ciuic::daemon {

using Clock = std::chrono::steady_clock;

struct ClusterJob::Event {
  // kBroken: the ordering stream ended; kRunFailed: a run failed (in a
  // lane, or announced against the protocol); kCoordinator: a Fail or
  // JobFailed (Runs go to the lanes from the reader); kReadyHeld: the
  // occurrence of op.name before the first held one was announced or
  // failed, so that one is readied now.
  // kHeartbeat: time to tell the coordinator this node is alive.
  // kDirectEnd: a staged direct op's exchange ended (staged_direct_ends_),
  // its result to be stored on its device. kDirectExpired: a direct op's
  // deadline passed. kGiveUp: this node ends the job for a reason of its
  // own (its direct operations out of step with the other nodes'), which
  // it tells the coordinator in its Leave so that the other nodes hear it.
  enum Kind {
    kSubmit, kCoordinator, kBroken, kRunFailed, kAbort, kReadyHeld, kHeartbeat, kDirectEnd,
    kDirectExpired, kGiveUp
  } kind;
  ClusterOp op;
  proto::CoordinatorEvent coordinator;
  absl::Status status;
};

// Counts bytes per peer on their way through the job's transport.
class ClusterJob::CountingTransport final : public ForwardingTransport {
 public:
  explicit CountingTransport(std::unique_ptr<Transport> inner)
      : ForwardingTransport(inner.get()),
        owned_(std::move(inner)),
        sent_(owned_->num_peers()),
        received_(owned_->num_peers()) {}
  void Send(int peer, int channel, uint64_t tag, const void* data, size_t bytes,
            TransferDone done) override {
    if (peer >= 0 && static_cast<size_t>(peer) < sent_.size()) {
      Busy& b = busy_[peer];
      std::lock_guard<std::mutex> lock(b.mu);
      if (b.in_flight++ == 0) b.since = std::chrono::steady_clock::now();
    }
    ForwardingTransport::Send(peer, channel, tag, data, bytes,
                              Counted(&sent_, peer, bytes, [this, peer, bytes, done = std::move(done)](
                                                               absl::Status s) {
                                SendEnded(peer, s.ok() ? bytes : 0);
                                done(std::move(s));
                              }));
  }
  void Recv(int peer, int channel, uint64_t tag, void* data, size_t bytes,
            TransferDone done) override {
    ForwardingTransport::Recv(peer, channel, tag, data, bytes,
                              Counted(&received_, peer, bytes, std::move(done)));
  }
  void RecvReduce(int peer, int channel, uint64_t tag, const ReduceInto& into, size_t bytes,
                  TransferDone done) override {
    ForwardingTransport::RecvReduce(peer, channel, tag, into, bytes,
                                    Counted(&received_, peer, bytes, std::move(done)));
  }

  uint64_t sent(int peer) const { return sent_[peer].load(std::memory_order_relaxed); }
  // Per peer: bytes of sends completed and the time with at least one send
  // to it in flight (periods that have ended), as Transport::ChannelLoads
  // counts per channel: bytes over busy time is what the path to that peer
  // carries while it has work.
  std::vector<ChannelLoad> PeerLoads() const {
    std::vector<ChannelLoad> out(sent_.size());
    for (size_t p = 0; p < out.size(); ++p) {
      std::lock_guard<std::mutex> lock(busy_[p].mu);
      out[p].bytes_sent = busy_[p].bytes;
      out[p].busy_ns = busy_[p].busy_ns;
    }
    return out;
  }
  uint64_t received(int peer) const { return received_[peer].load(std::memory_order_relaxed); }
  std::string failure(int peer) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = failures_.find(peer);
    return it == failures_.end() ? "" : it->second;
  }

 private:
  // Wraps a transfer's callback: adds its bytes to `counter`, or records
  // its failure.
  TransferDone Counted(std::vector<std::atomic<uint64_t>>* counter, int peer, size_t bytes,
                       TransferDone done) {
    return [this, counter, peer, bytes, done = std::move(done)](absl::Status s) {
      if (s.ok()) (*counter)[peer].fetch_add(bytes, std::memory_order_relaxed);
      else RecordFailure(peer, s);
      done(std::move(s));
    };
  }
  void SendEnded(int peer, size_t bytes) {
    if (peer < 0 || static_cast<size_t>(peer) >= sent_.size()) return;
    Busy& b = busy_[peer];
    std::lock_guard<std::mutex> lock(b.mu);
    b.bytes += bytes;
    if (--b.in_flight == 0) {
      b.busy_ns += static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                             std::chrono::steady_clock::now() - b.since)
                                             .count());
    }
  }
  void RecordFailure(int peer, const absl::Status& s) {
    std::lock_guard<std::mutex> lock(mu_);
    failures_.emplace(peer, std::string(s.message()));
  }
  std::unique_ptr<Transport> owned_;
  std::vector<std::atomic<uint64_t>> sent_;
  std::vector<std::atomic<uint64_t>> received_;
  struct Busy {
    mutable std::mutex mu;
    int in_flight = 0;
    std::chrono::steady_clock::time_point since;
    uint64_t bytes = 0;
    uint64_t busy_ns = 0;
  };
  std::unique_ptr<Busy[]> busy_{new Busy[sent_.size()]};
  std::mutex mu_;
  std::map<int, std::string> failures_;
};

ClusterJob::ClusterJob(Options options, OpDone op_done, JobFailed job_failed)
    : options_(std::move(options)),
      op_done_(std::move(op_done)),
      job_failed_(std::move(job_failed)),
      events_(new std::deque<Event>()) {
  client_ = options_.coordinator_clients(options_.coordinator);
  thread_ = std::thread([this] { Run(); });
  pthread_setname_np(thread_.native_handle(), "ciuic-cluster");
}

ClusterJob::~ClusterJob() {
  Abort(absl::CancelledError("job closed"));
  thread_.join();
  delete events_;
}

void ClusterJob::Push(Event e) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    events_->push_back(std::move(e));
  }
  cv_.notify_all();
}

void ClusterJob::PushRunFailed(absl::Status status) {
  Push(Event{Event::kRunFailed, {}, {}, std::move(status)});
}

void ClusterJob::PushGiveUp(absl::Status status) {
  Push(Event{Event::kGiveUp, {}, {}, std::move(status)});
}

void ClusterJob::PushDirectEnd() { Push(Event{Event::kDirectEnd, {}, {}, {}}); }

void ClusterJob::Submit(ClusterOp op) {
  if (op.timeout_ms == 0) op.timeout_ms = options_.tuning->Snapshot().op_timeout_ms;
  if (op.deadline == Clock::time_point{}) {
    op.deadline = Clock::now() + std::chrono::milliseconds(op.timeout_ms);
  }
  // A direct op on host buffers starts here, on the caller's thread (the
  // engine's loop): its local phase, then the first messages. Before the
  // job has formed (direct_max_bytes_ 0), or on GPU buffers, it goes to
  // the ClusterJob's thread. A named one only when no earlier occurrence
  // of its name is still to be decided there.
  uint64_t tag_base = 0;
  if (!op.staged && IsUnnamedDirect(op, &tag_base) && StartDirect(op, tag_base)) return;
  bool direct = false;
  // What the early local phase reduces, taken before the op moves on.
  std::shared_ptr<EarlyLocal> early = EarlyLocalFor(op);
  std::vector<const void*> inputs;
  uint8_t* out = nullptr;
  std::string name;  // for its error
  const auto dtype = static_cast<wire::DataType>(op.sig.dtype);
  const auto requested = static_cast<wire::ReduceOp>(op.sig.reduce_op);
  const size_t count = op.sig.count;
  {
    std::lock_guard<std::mutex> lock(mu_);
    const bool named = !op.name.empty() && !wire::IsUnnamed(op.name);
    if (named && !op.staged && !queued_named_.count(op.name) && !held_.count(op.name) &&
        !awaiting_.count(op.name)) {
      direct = TakeNamedDirectLocked(op, &tag_base);
    }
    if (!direct) {
      if (early) {
        op.early = early;
        for (const auto& p : op.parts) inputs.push_back(p.send);
        out = op.parts.front().recv;
        name = op.name;
      }
      if (named) ++queued_named_[op.name];
      Event e{Event::kSubmit, {}, {}, {}};
      e.op = std::move(op);
      events_->push_back(std::move(e));
    }
  }
  if (!direct) {
    cv_.notify_all();
    // The local phase while the Ready travels and the coordinator waits for
    // the other nodes; the run waits for it (Execute) and so does the op's
    // end (Done): the ranks' buffers are written here until Finish.
    if (out != nullptr) {
      absl::Status reduced;
      try {
        ReduceLocal(dtype, wire::CombiningOp(requested),
                    inputs, out, count);
      } catch (const std::exception& e) {  // out of memory: the run fails, nobody waits forever
        reduced = absl::ResourceExhaustedError(absl::StrCat(
            "the local phase of operation '", name, "' failed on ", options_.node_name, ": ",
            e.what()));
      }
      early->Finish(std::move(reduced));
      early_local_ops_.fetch_add(1, std::memory_order_relaxed);
    }
    return;
  }
  // Its occurrence is taken: it runs direct or ends here.
  if (!StartDirect(op, tag_base)) Done(op, absl::CancelledError("job closed"));
}

void ClusterJob::UnqueueNamedLocked(const std::string& name) {
  auto it = queued_named_.find(name);
  if (it != queued_named_.end() && --it->second <= 0) queued_named_.erase(it);
}

std::optional<ClusterOp> ClusterJob::TakeBackUnformed(uint64_t key) {
  std::lock_guard<std::mutex> lock(mu_);
  if (state_ != State::kForming) return std::nullopt;
  for (auto it = events_->begin(); it != events_->end(); ++it) {
    if (it->kind == Event::kSubmit && it->op.key == key) {
      UnqueueNamedLocked(it->op.name);
      std::optional<ClusterOp> op(std::move(it->op));
      events_->erase(it);
      return op;
    }
  }
  return std::nullopt;
}

proto::NodeEvent ClusterJob::ReadyFor(const ClusterOp& op) const {
  proto::NodeEvent ready;
  auto* r = ready.mutable_ready();
  r->set_name(op.name);
  auto* sig = r->mutable_signature();
  sig->set_collective(op.sig.collective);
  sig->set_dtype(op.sig.dtype);
  sig->set_reduce_op(op.sig.reduce_op);
  sig->set_root(op.sig.root);
  sig->set_count(op.sig.count);
  sig->set_codec(op.sig.codec);
  sig->set_codec_ratio(op.sig.codec_ratio);
  r->set_priority(op.priority);
  r->set_device_buffers(op.staged != nullptr);
  // The coordinator's clock is not this node's: the time left, at least 1 ms.
  const auto left = std::chrono::ceil<std::chrono::milliseconds>(op.deadline - Clock::now());
  r->set_timeout_ms(static_cast<uint32_t>(
      std::clamp<int64_t>(left.count(), 1, std::numeric_limits<uint32_t>::max())));
  if (op.sig.collective == static_cast<uint32_t>(wire::Collective::kAlltoall) ||
      op.sig.collective == static_cast<uint32_t>(wire::Collective::kAlltoallv)) {
    r->set_rank_bytes(AlltoallRankBytes(op, static_cast<size_t>(options_.world_size)));
  }
  if (op.sig.collective == static_cast<uint32_t>(wire::Collective::kAlltoallv)) {
    // Per node m: this node's ranks' counts for m's ranks, and those they
    // expect from m's, each folded in (sender, receiver) order (coordinator.h).
    const int nodes = *std::max_element(node_of_rank_.begin(), node_of_rank_.end()) + 1;
    std::vector<uint64_t> out(static_cast<size_t>(nodes), kSplitsSeed);
    std::vector<uint64_t> in(static_cast<size_t>(nodes), kSplitsSeed);
    const std::vector<const ClusterOp::Part*> parts = PartsInRankOrder(op);
    for (const ClusterOp::Part* p : parts) {
      for (int b = 0; b < options_.world_size; ++b) {
        uint64_t& h = out[static_cast<size_t>(node_of_rank_[b])];
        h = HashSplits(h, p->send_counts[static_cast<size_t>(b)]);
      }
    }
    for (int a = 0; a < options_.world_size; ++a) {
      uint64_t& h = in[static_cast<size_t>(node_of_rank_[a])];
      for (const ClusterOp::Part* p : parts) {
        h = HashSplits(h, p->recv_counts[static_cast<size_t>(a)]);
      }
    }
    for (int m = 0; m < nodes; ++m) {
      r->add_split_out(out[static_cast<size_t>(m)]);
      r->add_split_in(in[static_cast<size_t>(m)]);
    }
  }
  r->set_splits_error(op.splits_error);
  return ready;
}

void ClusterJob::Abort(const absl::Status& why) {
  std::lock_guard<std::mutex> lock(mu_);
  if (aborted_) return;
  aborted_ = true;
  if (failure_.ok()) failure_ = why;
  events_->push_back(Event{Event::kAbort, {}, {}, why});
  lanes_cv_.notify_all();  // WaitForAnnouncedRuns gives up
  client_->CancelRegister();
  if (transport_) {
    for (int p = 0; p < transport_->num_peers(); ++p) {
      if (p != transport_->self()) transport_->FailPeer(p, why);
    }
  }
  cv_.notify_all();
}

ClusterJob::State ClusterJob::state() {
  std::lock_guard<std::mutex> lock(mu_);
  return state_;
}

std::string ClusterJob::StateText() {
  std::lock_guard<std::mutex> lock(mu_);
  switch (state_) {
    case State::kForming: return "forming";
    case State::kRunning: return "running";
    case State::kFailed: break;
  }
  return absl::StrCat("failed: ", failed_why_);
}

std::vector<ClusterJob::PeerRow> ClusterJob::Peers() {
  std::vector<double> rates;
  {
    std::lock_guard<std::mutex> lock(channels_mu_);
    rates = peer_rates_.rates();
  }
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<PeerRow> rows = peers_;
  for (size_t p = 0; p < rows.size() && transport_; ++p) {
    rows[p].bytes_sent = transport_->sent(static_cast<int>(p));
    rows[p].bytes_received = transport_->received(static_cast<int>(p));
    if (p < rates.size()) rows[p].rate_bytes_per_s = rates[p];
    std::string f = transport_->failure(static_cast<int>(p));
    if (!f.empty()) rows[p].state = "failed: " + f;
    else if (!failure_.ok()) rows[p].state = "closed";
  }
  return rows;
}

absl::Status ClusterJob::Form() {
  auto unconnected = options_.transports(options_.channels);
  if (!unconnected.ok()) return unconnected.status();
  proto::RegisterNodeRequest req;
  req.set_job_id(options_.job_id);
  req.set_uid(options_.uid);
  req.set_world_size(options_.world_size);
  req.set_node_name(options_.node_name);
  req.set_rack(options_.rack);
  for (int r : options_.local_ranks) req.add_ranks(r);
  for (const std::string& a : (*unconnected)->Addresses()) req.add_transport_addresses(a);
  req.set_channels(options_.channels);
  req.set_protocol(kPeerProtocol);

  const uint32_t timeout_ms = std::max<uint32_t>(options_.tuning->Snapshot().op_timeout_ms, 10000);
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!failure_.ok()) return failure_;
  }
  // Abort cancels it (also before it starts).
  auto registered = client_->Register(
      req, std::chrono::system_clock::now() + std::chrono::milliseconds(timeout_ms));
  if (!registered.ok()) return registered.status();
  const proto::Membership& membership = *registered;
  // Every index below comes from this table: checked first.
  int self = -1;
  if (absl::Status s =
          CheckMembership(membership, options_.coordinator, options_.world_size, options_.node_name,
                          options_.local_ranks, options_.channels, &self);
      !s.ok()) {
    return s;
  }

  std::vector<std::vector<std::string>> addresses;
  node_of_rank_.assign(options_.world_size, -1);
  std::vector<PeerRow> rows;
  for (int n = 0; n < membership.nodes_size(); ++n) {
    const auto& node = membership.nodes(n);
    addresses.emplace_back(node.transport_addresses().begin(), node.transport_addresses().end());
    PeerRow row;
    row.node_name = node.node_name();
    row.rack = node.rack();
    for (int r : node.ranks()) {
      row.ranks.push_back(r);
      node_of_rank_[r] = n;
    }
    rows.push_back(std::move(row));
  }
  self_ = self;
  rows[self_].self = true;
  auto connected = (*unconnected)->Connect(self_, addresses);
  if (!connected.ok()) return connected.status();
  for (auto& row : rows) row.state = "connected";
  {
    std::lock_guard<std::mutex> lock(mu_);
    transport_ = std::make_unique<CountingTransport>(std::move(*connected));
    peers_ = std::move(rows);
    racks_ = RackIndices(membership);
    // Rates to every node only where the coordinator's model can use them.
    spans_racks_ = std::any_of(racks_.begin(), racks_.end(), [](int r) { return r != 0; }) &&
                   racks_.size() <= static_cast<size_t>(kMaxRackModelNodes);
    state_ = State::kRunning;
    std::lock_guard<std::mutex> direct_lock(direct_mu_);
    direct_transport_ = transport_.get();
  }
  direct_max_bytes_.store(DirectBound(membership.direct_max_bytes(), membership.nodes_size()));
  // The ordering stream, read by its own thread: in-process when this
  // daemon is the job's coordinator, else the client's (over TCP to the
  // coordinator's ordering listener where it can).
  std::shared_ptr<OrderingStream> stream;
  if (options_.local_coordinator != nullptr &&
      membership.coordinator() == options_.local_coordinator->id()) {
    stream = options_.local_coordinator->OpenLocalStream();
    in_process_ordering_ = true;
  } else {
    auto opened = client_->OpenStream(membership.ordering_port());
    if (!opened.ok()) return opened.status();
    stream = std::move(*opened);
  }
  spdlog::info("job '{}': node {} of {} in the membership table, {} channel(s), ordering {}",
               options_.job_id, self_, membership.nodes_size(), options_.channels,
               stream->Describe());
  proto::NodeEvent hello;
  auto* h = hello.mutable_hello();
  h->set_job_id(options_.job_id);
  h->set_uid(options_.uid);
  h->set_instance(membership.instance());
  h->set_node(self_);
  if (!stream->Write(hello)) {
    return absl::UnavailableError(absl::StrCat("coordinator ", options_.coordinator,
                                               " closed the ordering stream"));
  }
  reader_ = std::thread([this, stream] {
    proto::CoordinatorEvent e;
    while (stream->Read(&e)) {
      heard_ns_.store(Clock::now().time_since_epoch().count(), std::memory_order_relaxed);
      if (e.has_heartbeat()) continue;
      // A Run goes to the lanes from here: one thread hand-off less on
      // every operation's path (the other events keep their order behind
      // it on the main thread).
      if (e.has_run()) {
        Announce(e.run());
      } else {
        if (e.has_job_failed()) {
          {
            std::lock_guard<std::mutex> lock(mu_);
            if (verdict_.ok()) {
              verdict_ = absl::Status(static_cast<absl::StatusCode>(e.job_failed().code()),
                                      e.job_failed().message());
            }
          }
          lanes_cv_.notify_all();  // runs cut off meanwhile end with it (WithVerdict)
        }
        Push(Event{Event::kCoordinator, {}, e, {}});
      }
    }
    absl::Status s = stream->Finish();
    Push(Event{Event::kBroken, {}, {}, absl::UnavailableError(absl::StrCat(
        "lost the coordinator ", options_.coordinator, " of job '", options_.job_id, "': ",
        s.ok() ? "stream closed" : s.message()))});
  });
  stream_ = stream;
  return absl::OkStatus();
}

void ClusterJob::FailAll(const absl::Status& why) {
  std::map<std::string, ClusterOp> waiting;
  std::deque<Announced> unstarted;
  {
    std::lock_guard<std::mutex> lock(mu_);
    waiting.swap(awaiting_);
    readied_at_.clear();
    unstarted.swap(announced_);
  }
  std::map<std::string, std::deque<ClusterOp>> held;
  {
    std::lock_guard<std::mutex> lock(mu_);
    held.swap(held_);
  }
  for (auto& [name, op] : waiting) Done(op, why);
  for (auto& [name, ops] : held) {
    for (auto& op : ops) Done(op, why);
  }
  for (auto& a : unstarted) {
    for (auto& op : a.ops) Done(op, why);
  }
  // Their ranks hear once the exchanges have let go of their buffers: at
  // once, or when the transport's transfers in them end (the job's end
  // cuts them off).
  for (DirectOp& d : TakeDirect()) AbandonDirect(std::move(d), why);
}

std::shared_ptr<EarlyLocal> ClusterJob::EarlyLocalFor(const ClusterOp& op) const {
  if (op.staged || !op.splits_error.empty() || op.parts.size() < 2 ||
      op.sig.collective != static_cast<uint32_t>(wire::Collective::kAllreduce) ||
      op.sig.count == 0 || op.sig.count > kEarlyLocalMaxBytes ||
      op.sig.count * op.sig.element_bytes() > kEarlyLocalMaxBytes) {
    return nullptr;
  }
  for (const auto& p : op.parts) {
    if (p.send == nullptr || p.recv == nullptr) return nullptr;
  }
  return std::make_shared<EarlyLocal>();
}

void ClusterJob::Done(ClusterOp& op, const absl::Status& status) {
  // Its early local phase may still be writing the first rank's buffer.
  if (op.early) op.early->Wait().IgnoreError();
  op.staged.reset();  // its device work ends before the ranks hear
  if (op.done) {
    std::function<void(const absl::Status&)> done = std::move(op.done);
    op.done = nullptr;
    return done(status);
  }
  op_done_(op.key, status);
}

void ClusterJob::Announce(const proto::CoordinatorEvent::Run& r) {
  Announced run;
  run.seq = r.seq();
  run.settings.chunk_bytes = r.chunk_bytes();
  run.settings.chunks_in_flight = r.chunks_in_flight();
  run.settings.algorithm = static_cast<config::Algorithm>(r.algorithm());
  run.settings.codec = r.codec();
  run.settings.segment_bytes = r.segment_bytes();
  run.settings.segments = r.segments();
  run.settings.channel_shares.assign(r.channel_shares().begin(), r.channel_shares().end());
  absl::Status broken;
  if (run.settings.chunk_bytes == 0 || run.settings.chunks_in_flight == 0 ||
      run.settings.chunks_in_flight > 64 || run.settings.segments > kMaxSegments ||
      r.algorithm() > static_cast<uint32_t>(config::Algorithm::kRack) ||
      !ValidChannelShares(run.settings.channel_shares, options_.channels)) {
    broken = absl::InternalError(
        absl::StrCat("coordinator announced run ", run.seq, " of '", r.name(),
                     "' without valid settings (a daemon of another version?)"));
  }
  std::vector<std::string> names = {r.name()};
  names.insert(names.end(), r.fused_with().begin(), r.fused_with().end());
  const auto now = std::chrono::steady_clock::now();
  {
    std::lock_guard<std::mutex> lock(mu_);
    last_progress_ = now;
    // Before the next occurrences of these names are decided (the held
    // ones are readied below, the later ones wait for awaiting_).
    if (broken.ok()) AssignNamedSlotsLocked(names);
    // The run's payload per node (a fused run's, packed), for the name of
    // the algorithm it runs with.
    uint64_t run_bytes = 0;
    for (const std::string& name : names) {
      auto it = awaiting_.find(name);
      if (it == awaiting_.end()) continue;
      const ClusterOp& op = it->second;
      uint64_t bytes = op.sig.count * op.sig.element_bytes();
      if (op.sig.collective == static_cast<uint32_t>(wire::Collective::kReduceScatter) ||
          op.sig.collective == static_cast<uint32_t>(wire::Collective::kAllgather)) {
        bytes *= static_cast<uint64_t>(options_.world_size);  // every rank's block
      }
      run_bytes += bytes;
    }
    for (size_t i = 0; i < names.size(); ++i) {
      auto it = awaiting_.find(names[i]);
      if (it == awaiting_.end()) {
        if (broken.ok()) {
          broken = absl::InternalError(
              absl::StrCat("coordinator ran '", names[i], "', which this node never readied"));
        }
        continue;
      }
      if (ClusterOp::Timing* t = it->second.timing.get()) {
        t->announced = now;
        t->run_seq = run.seq;
        t->fused_ops = static_cast<uint32_t>(names.size());
        t->codec = run.settings.codec;
        t->algorithm = RunAlgorithmName(run.settings, it->second.sig.collective,
                                        static_cast<int>(peers_.size()), run_bytes,
                                        names.size() > 1);
        t->model_flat_us = r.model_flat_us();
        t->model_rack_us = r.model_rack_us();
        // The coordinator's account of the wait (absent from older ones).
        const int at = static_cast<int>(i);
        if (at < r.last_ready_node_size() && r.last_ready_node(at) >= 0 &&
            static_cast<size_t>(r.last_ready_node(at)) < peers_.size()) {
          t->last_node = peers_[r.last_ready_node(at)].node_name;
        }
        if (at < r.ready_spread_us_size()) t->ready_spread_us = r.ready_spread_us(at);
        if (at < r.queued_us_size()) t->queued_us = r.queued_us(at);
      }
      run.ops.push_back(std::move(it->second));
      awaiting_.erase(it);
      readied_at_.erase(names[i]);
      if (held_.count(names[i])) {
        Event next{Event::kReadyHeld, {}, {}, {}};
        next.op.name = names[i];
        events_->push_back(std::move(next));
        cv_.notify_all();
      }
    }
    if (broken.ok()) announced_.push_back(std::move(run));
  }
  if (broken.ok()) {
    lanes_cv_.notify_all();
    return;
  }
  for (auto& op : run.ops) Done(op, broken);
  Push(Event{Event::kRunFailed, {}, {}, broken});
}

bool ClusterJob::Write(const proto::NodeEvent& event) {
  std::lock_guard<std::mutex> lock(write_mu_);
  if (writes_closed_ || !stream_) return false;
  return stream_->Write(event);
}

void ClusterJob::CloseWrites() {
  std::lock_guard<std::mutex> lock(write_mu_);
  if (writes_closed_ || !stream_) return;
  writes_closed_ = true;
  stream_->WritesDone();
}

std::string ClusterJob::CoordinatorLabelLocked() const {
  // The coordinator is the daemon of rank 0's node.
  if (!node_of_rank_.empty() && node_of_rank_[0] >= 0 &&
      static_cast<size_t>(node_of_rank_[0]) < peers_.size()) {
    return absl::StrCat(peers_[node_of_rank_[0]].node_name, " (", options_.coordinator, ")");
  }
  return options_.coordinator;
}

Clock::time_point ClusterJob::NextOverdueLocked() const {
  Clock::time_point next = Clock::time_point::max();
  for (const auto& [name, readied] : readied_at_) {
    next = std::min(next, std::max(readied.first, last_progress_ +
                                                      std::chrono::milliseconds(readied.second)) +
                              options_.announce_grace);
  }
  if (next == Clock::time_point::max()) return next;
  // Runs here may hold the coordinator's next announcement back: look again
  // a grace after they have ended.
  bool running = !announced_.empty();
  for (const auto& lane : lanes_) running |= lane->busy;
  return running ? std::max(next, Clock::now() + options_.announce_grace) : next;
}

absl::Status ClusterJob::OverdueLocked() const {
  const Clock::time_point now = Clock::now();
  if (!announced_.empty()) return absl::OkStatus();
  for (const auto& lane : lanes_) {
    if (lane->busy) return absl::OkStatus();
  }
  for (const auto& [name, readied] : readied_at_) {
    const Clock::time_point due =
        std::max(readied.first, last_progress_ + std::chrono::milliseconds(readied.second)) +
        options_.announce_grace;
    if (now < due) continue;
    return absl::UnavailableError(absl::StrCat(
        "the coordinator ", CoordinatorLabelLocked(), " of job '", options_.job_id,
        "' has neither announced nor failed operation '", name, "' within its timeout (",
        readied.second, " ms) and ", options_.announce_grace.count(),
        " ms more: it is stopped, hung or unreachable"));
  }
  return absl::OkStatus();
}

void ClusterJob::Run() {
  absl::Status formed = Form();
  if (!formed.ok()) {
    spdlog::warn("job '{}': {}", options_.job_id, formed.ToString());
    {
      std::lock_guard<std::mutex> lock(mu_);
      state_ = State::kFailed;
      failed_why_ = std::string(formed.message());
      if (failure_.ok()) failure_ = formed;
    }
  }
  if (formed.ok()) {
    {
      const config::Tuning tuning = options_.tuning->Snapshot();
      std::lock_guard<std::mutex> lock(mu_);
      heartbeat_interval_ms_ = tuning.heartbeat_interval_ms;
      heartbeat_misses_ = tuning.heartbeat_misses;
      beat_sent_ = Clock::now() - std::chrono::milliseconds(heartbeat_interval_ms_);  // one now
      heard_ns_.store(Clock::now().time_since_epoch().count(), std::memory_order_relaxed);
    }
    // All lanes exist before any starts: a lane reads the others' state.
    for (int i = 0; i < kLanes; ++i) lanes_.push_back(std::make_unique<Lane>());
    for (auto& lane : lanes_) {
      Lane* l = lane.get();
      lane->thread = std::thread([this, l] { LaneLoop(*l); });
      pthread_setname_np(lane->thread.native_handle(), "ciuic-lane");
    }
  }
  bool left = false;
  while (true) {
    Event e;
    {
      std::unique_lock<std::mutex> lock(mu_);
      // Waits for the next event, or until an operation readied here is
      // overdue: the coordinator has neither announced nor failed it.
      // Waits for the next event, the next heartbeat to send, or until the
      // coordinator has been silent too long or an operation readied here
      // is overdue.
      const bool alive_checks = formed.ok() && !left;
      while (events_->empty()) {
        const Clock::time_point direct_deadline = NextDirectDeadline();
        if (direct_deadline <= Clock::now()) {
          events_->push_back(Event{Event::kDirectExpired, {}, {}, {}});
          break;
        }
        Clock::time_point next = std::min(NextOverdueLocked(), direct_deadline);
        const auto interval = std::chrono::milliseconds(heartbeat_interval_ms_);
        const Clock::time_point heard{Clock::duration(heard_ns_.load(std::memory_order_relaxed))};
        if (alive_checks) {
          next = std::min({next, beat_sent_ + interval, heard + interval * heartbeat_misses_});
        }
        if (next == Clock::time_point::max()) {
          cv_.wait(lock);
          continue;
        }
        cv_.wait_until(lock, next);
        if (!events_->empty()) continue;
        const Clock::time_point now = Clock::now();
        if (alive_checks && now - heard > interval * heartbeat_misses_) {
          const auto silent = std::chrono::duration_cast<std::chrono::milliseconds>(now - heard);
          events_->push_back(Event{
              Event::kRunFailed, {}, {},
              absl::UnavailableError(absl::StrCat(
                  "the coordinator ", CoordinatorLabelLocked(), " of job '", options_.job_id,
                  "' has been silent for ", silent.count(), " ms (", heartbeat_misses_,
                  " heartbeats of ", heartbeat_interval_ms_,
                  " ms missed): its daemon is stopped, hung or unreachable"))});
          break;
        }
        if (alive_checks && now >= beat_sent_ + interval) {
          beat_sent_ = now;
          events_->push_back(Event{Event::kHeartbeat, {}, {}, {}});
          break;
        }
        if (NextDirectDeadline() <= now) {
          events_->push_back(Event{Event::kDirectExpired, {}, {}, {}});
          break;
        }
        if (now < NextOverdueLocked()) continue;
        absl::Status overdue = OverdueLocked();
        if (overdue.ok()) continue;
        readied_at_.clear();  // the job ends with it
        events_->push_back(Event{Event::kRunFailed, {}, {}, std::move(overdue)});
      }
      e = std::move(events_->front());
      events_->pop_front();
    }
    absl::Status job_failure;
    bool give_up = false;  // job_failure is this node's own reason (kGiveUp)
    if (e.kind == Event::kDirectEnd) {
      FinishStagedDirect();
      StartWaitingDirect();
      continue;
    }
    if (e.kind == Event::kDirectExpired) {
      ExpireDirect();
      continue;
    }
    if (!formed.ok()) {
      if (e.kind == Event::kSubmit) {
        {
          std::lock_guard<std::mutex> lock(mu_);
          UnqueueNamedLocked(e.op.name);
        }
        Done(e.op, formed);
      }
      if (e.kind == Event::kAbort) break;
      if (!left) {
        left = true;
        job_failed_(formed);
      }
      continue;
    }
    switch (e.kind) {
      case Event::kSubmit:
      case Event::kReadyHeld: {
        uint64_t tag_base = 0;
        if (e.kind == Event::kSubmit && IsUnnamedDirect(e.op, &tag_base)) {
          if (!StartDirect(e.op, tag_base)) Done(e.op, absl::CancelledError("job closed"));
          break;
        }
        bool direct = false;
        {
          std::lock_guard<std::mutex> lock(mu_);
          if (e.kind == Event::kReadyHeld) {
            auto h = held_.find(e.op.name);
            if (h == held_.end() || awaiting_.count(e.op.name)) break;
            e.op = std::move(h->second.front());
            h->second.pop_front();
            if (h->second.empty()) held_.erase(h);
          } else {
            UnqueueNamedLocked(e.op.name);
            if (awaiting_.count(e.op.name) || held_.count(e.op.name)) {
              // An earlier occurrence of the name is still to be announced:
              // this one waits its turn (never dropped, never reordered).
              held_[e.op.name].push_back(std::move(e.op));
              break;
            }
          }
          // Every earlier occurrence of the name is decided: a named one
          // with a slot runs direct, and the next held one (no Run will
          // come for this one) is decided after it.
          direct = TakeNamedDirectLocked(e.op, &tag_base);
          if (direct && held_.count(e.op.name)) {
            Event next{Event::kReadyHeld, {}, {}, {}};
            next.op.name = e.op.name;
            events_->push_back(std::move(next));
          }
        }
        if (direct) {
          if (!StartDirect(e.op, tag_base)) Done(e.op, absl::CancelledError("job closed"));
          break;
        }
        proto::NodeEvent ready = ReadyFor(e.op);
        AddChannelRates(ready);
        const std::string name = e.op.name;
        // Stamped before the Ready goes: once it has, the Run may come (and
        // the timing be read) before this thread runs again.
        if (e.op.timing) e.op.timing->ready = std::chrono::steady_clock::now();
        {
          std::lock_guard<std::mutex> lock(mu_);
          readied_at_[name] = {e.op.deadline, e.op.timeout_ms};
          awaiting_.emplace(name, std::move(e.op));
        }
        if (!Write(ready)) {
          job_failure = absl::UnavailableError(absl::StrCat(
              "lost the coordinator ", options_.coordinator, " of job '", options_.job_id, "'"));
        }
        break;
      }
      case Event::kCoordinator: {
        const auto& c = e.coordinator;
        if (c.has_fail()) {
          std::optional<ClusterOp> failed;
          {
            std::lock_guard<std::mutex> lock(mu_);
            last_progress_ = Clock::now();
            auto it = awaiting_.find(c.fail().name());
            if (it != awaiting_.end()) {
              failed = std::move(it->second);
              awaiting_.erase(it);
              readied_at_.erase(c.fail().name());
              if (held_.count(c.fail().name())) {
                Event next{Event::kReadyHeld, {}, {}, {}};
                next.op.name = c.fail().name();
                events_->push_back(std::move(next));
              }
            }
          }
          if (failed) {
            Done(*failed,
                 absl::Status(static_cast<absl::StatusCode>(c.fail().code()), c.fail().message()));
          }
        } else if (c.has_job_failed()) {
          // Runs that can still complete (the node that left had done its
          // part) end first; cut-off ones are failed below, through the
          // transport, rather than left to their deadline.
          if (!c.job_failed().runs_cut_off()) {
            WaitForAnnouncedRuns();
            WaitForDirectOps();
          }
          job_failure = absl::Status(static_cast<absl::StatusCode>(c.job_failed().code()),
                                     c.job_failed().message());
        }
        break;
      }
      case Event::kHeartbeat: {
        proto::NodeEvent beat;
        beat.mutable_heartbeat();
        if (!Write(beat)) {
          job_failure = absl::UnavailableError(absl::StrCat(
              "lost the coordinator ", options_.coordinator, " of job '", options_.job_id, "'"));
        }
        const config::Tuning tuning = options_.tuning->Snapshot();  // changes apply from here
        std::lock_guard<std::mutex> lock(mu_);
        heartbeat_interval_ms_ = tuning.heartbeat_interval_ms;
        heartbeat_misses_ = tuning.heartbeat_misses;
        break;
      }
      case Event::kDirectEnd:
      case Event::kDirectExpired:
        break;  // handled above
      case Event::kBroken:
        WaitForAnnouncedRuns();
        job_failure = e.status;
        break;
      case Event::kRunFailed:
        job_failure = e.status;
        break;
      case Event::kGiveUp:
        job_failure = e.status;
        give_up = true;
        break;
      case Event::kAbort: {
        if (!left) {
          proto::NodeEvent leave;
          leave.mutable_leave()->set_reason(std::string(e.status.message()));
          {
            // After the Dones of runs whose operations have completed.
            std::unique_lock<std::mutex> lock(write_mu_);
            dones_cv_.wait(lock, [&] { return dones_pending_ == 0; });
            if (!writes_closed_ && stream_) stream_->Write(leave);
          }
          CloseWrites();
        }
        FailAll(e.status);
        left = true;
        break;
      }
    }
    if (!job_failure.ok() && !left) {
      left = true;
      {
        std::lock_guard<std::mutex> lock(mu_);
        if (failure_.ok()) failure_ = job_failure;
        state_ = State::kFailed;
        failed_why_ = std::string(job_failure.message());
        for (int p = 0; p < transport_->num_peers(); ++p) {
          if (p != self_) transport_->FailPeer(p, job_failure);
        }
      }
      FailAll(job_failure);
      job_failed_(job_failure);
      if (give_up) {
        proto::NodeEvent leave;
        leave.mutable_leave()->set_reason(std::string(job_failure.message()));
        // After the Dones of runs whose operations have completed (as an
        // Abort's Leave); the runs still going were cut off above.
        std::unique_lock<std::mutex> lock(write_mu_);
        dones_cv_.wait_for(lock, kDirectGrace, [&] { return dones_pending_ == 0; });
        if (!writes_closed_ && stream_) stream_->Write(leave);
      }
      CloseWrites();
    }
    if (left && e.kind == Event::kAbort) break;
  }
  StopLanes();  // the transport failed every peer: running runs end at once
  absl::Status why;
  {
    std::lock_guard<std::mutex> lock(mu_);
    why = failure_.ok() ? absl::CancelledError("job closed") : failure_;
  }
  FailAll(why);
  if (stream_) stream_->Cancel();
  if (reader_.joinable()) reader_.join();
  {
    std::lock_guard<std::mutex> lock(write_mu_);
    writes_closed_ = true;
    stream_.reset();
  }
  CloseDirect();
  std::lock_guard<std::mutex> lock(mu_);
  transport_.reset();
}

ClusterJob::CompressionCounters ClusterJob::compression() const {
  return CompressionCounters{compressed_ops_.load(), raw_bytes_.load(), wire_bytes_.load()};
}

ClusterJob::FusionCounters ClusterJob::fusion() const {
  return FusionCounters{fused_ops_.load(), fused_runs_.load()};
}

ClusterJob::StagingCounters ClusterJob::staging() const {
  return StagingCounters{staged_ops_.load(), staged_bytes_.load()};
}

ClusterJob::FeedbackCounters ClusterJob::feedback() const {
  FeedbackCounters c;
  c.host = feedback_.GetStats();
  c.too_large_ops = feedback_too_large_.load();
  std::lock_guard<std::mutex> lock(device_feedback_mu_);
  c.device = device_feedback_;
  return c;
}

InterNodeContext ClusterJob::ContextFor(uint64_t seq, Clock::time_point deadline,
                                        const RunSettings& settings, Lane& lane) {
  InterNodeContext ctx;
  ctx.transport = transport_.get();
  ctx.tag_base = RunTagBase(seq);
  ctx.chunk_bytes = settings.chunk_bytes;
  ctx.max_inflight = static_cast<int>(settings.chunks_in_flight);
  ctx.deadline = deadline;
  ctx.scratch = &lane.scratch;
  ctx.yield = &lane.yield;
  ctx.channel_table = ChannelTable(settings.channel_shares);
  // Rack by rack (internode.h): the run's algorithm says so.
  if (settings.algorithm == config::Algorithm::kRack) ctx.racks = racks_;
  {
    std::lock_guard<std::mutex> lock(mu_);
    ctx.node_names.reserve(peers_.size());
    for (const PeerRow& p : peers_) ctx.node_names.push_back(p.node_name);
  }
  if (!settings.channel_shares.empty()) {
    std::lock_guard<std::mutex> lock(channels_mu_);
    channel_shares_ = settings.channel_shares;
  }
  return ctx;
}

void ClusterJob::AddChannelRates(proto::NodeEvent& ready) {
  CountingTransport* t = nullptr;
  {
    std::lock_guard<std::mutex> lock(mu_);
    t = transport_.get();
  }
  if (t == nullptr) return;
  if (spans_racks_) {
    // The rack cost model's input: this node's rate to each other node.
    std::vector<Transport::ChannelLoad> per_peer = t->PeerLoads();
    std::lock_guard<std::mutex> lock(channels_mu_);
    peer_rates_.Update(per_peer);
    for (double r : peer_rates_.rates()) ready.mutable_ready()->add_peer_rates(r);
  }
  std::vector<Transport::ChannelLoad> loads = t->ChannelLoads();
  // Weights only where the channels have links of their own: channels on
  // the same devices share their links, and weighing them would only follow
  // noise.
  if (loads.size() < 2 || loads[0].device.empty()) return;
  std::lock_guard<std::mutex> lock(channels_mu_);
  channel_rates_.Update(loads);
  channel_devices_.clear();
  for (const auto& l : loads) channel_devices_.push_back(l.device);
  for (double r : channel_rates_.rates()) ready.mutable_ready()->add_channel_rates(r);
}

std::vector<ClusterJob::ChannelRow> ClusterJob::Channels() const {
  std::lock_guard<std::mutex> lock(channels_mu_);
  std::vector<ChannelRow> rows;
  const std::vector<double>& rates = channel_rates_.rates();
  for (size_t c = 0; c < rates.size(); ++c) {
    ChannelRow row;
    row.device = c < channel_devices_.size() ? channel_devices_[c] : "";
    row.rate_bytes_per_s = rates[c];
    row.share = c < channel_shares_.size()
                    ? static_cast<double>(channel_shares_[c]) / kChannelSlots
                    : 1.0 / static_cast<double>(rates.size());
    rows.push_back(std::move(row));
  }
  return rows;
}

}  // namespace ciuic::daemon
