#include "cluster/cluster_job.h"

#include <algorithm>
#include <cstring>
#include <optional>

#include "absl/strings/str_cat.h"
#include "ciuic/peer.pb.h"
#include "cluster/coordinator.h"
#include "cluster/membership.h"
#include "collectives/internode/internode.h"
#include "collectives/internode/scratch.h"
#include "reduce/reduce.h"
#include "spdlog/spdlog.h"
#include "transport/forwarding_transport.h"

namespace ciuic::daemon {

using Clock = std::chrono::steady_clock;

namespace {

// Tags (InterNodeContext::tag_base): bits 24..47 are the operation's, the
// low 24 the algorithm's. A whole run: bits 47 and 46 clear, its seq's low
// 22 bits. Segment k of a run announced with segment_bytes: bit 47 set, the
// seq's low 11 bits (runs in flight at once are consecutive), k's 12: at
// most kMaxSegments (run_settings.h). A direct operation "#N": bit 47
// clear, bit 46 set, N's low 22 bits (direct ops in flight at once are
// bounded by the ranks' completion rings, far fewer than 2^22;
// cluster_job_direct.cc).
static_assert(kMaxSegments == uint64_t{1} << 12);

uint64_t RunTagBase(uint64_t seq) { return (seq & 0x3fffff) << 24; }

uint64_t SegmentTagBase(uint64_t seq, size_t segment) {
  return (uint64_t{1} << 47) | ((seq & 0x7ff) << 36) | ((segment & 0xfff) << 24);
}

// Elements per segment of an allreduce of `count` elements of `element_bytes`
// announced with `segment_bytes` (> 0).
size_t SegmentElements(uint64_t segment_bytes, size_t count, size_t element_bytes) {
  const size_t per = std::max<size_t>(1, segment_bytes / element_bytes);
  return std::max(per, (count + kMaxSegments - 1) / kMaxSegments);
}

// Elements of each rank's block per segment of an allgather (whose segment
// carries a piece of every rank's block) or a broadcast announced with
// `segment_bytes`; `count` (the whole block: one segment) without.
size_t MoveSegmentElements(uint64_t segment_bytes, bool gather, size_t count, size_t element_bytes,
                           int world) {
  if (segment_bytes == 0) return std::max<size_t>(count, 1);
  const uint64_t piece = gather ? segment_bytes / static_cast<uint64_t>(world) : segment_bytes;
  return SegmentElements(std::max<uint64_t>(piece, element_bytes), count, element_bytes);
}

// memcpy for a rank's buffer, which a 0-element operation may leave out
// (nullptr): memcpy must not get a null pointer even for 0 bytes.
void CopyBytes(void* to, const void* from, size_t bytes) {
  if (bytes > 0) std::memcpy(to, from, bytes);
}

// One local rank's alltoall(v) pairs, in elements: what it sends to and
// receives from each rank of the job, and where each block lies in its
// buffers (back to back in rank order).
struct RankPairs {
  std::vector<uint64_t> send, recv;        // per rank of the job
  std::vector<uint64_t> send_at, recv_at;  // elements before
  uint64_t sent = 0, got = 0;              // in all
};

absl::StatusOr<RankPairs> PairsOf(const ClusterOp& op, const ClusterOp::Part& p, size_t world) {
  const bool v = op.sig.collective == static_cast<uint32_t>(wire::Collective::kAlltoallv);
  if (v && (p.send_counts.size() != world || p.recv_counts.size() != world)) {
    return absl::InternalError(
        absl::StrCat("alltoallv of rank ", p.rank, " without counts for every rank"));
  }
  RankPairs r;
  for (size_t j = 0; j < world; ++j) {
    r.send_at.push_back(r.sent);
    r.recv_at.push_back(r.got);
    r.send.push_back(v ? p.send_counts[j] : op.sig.count);
    r.recv.push_back(v ? p.recv_counts[j] : op.sig.count);
    r.sent += r.send.back();
    r.got += r.recv.back();
  }
  return r;
}

// Part k of a rank pair's piece of `count` elements in an alltoall(v) of
// `segments` segments (Run.segments), [first, second) elements: parts of
// ceil(count / segments), the last ones shorter or empty. Both ends of the
// pair know the count, so they cut alike.
std::pair<uint64_t, uint64_t> PartOfSegment(uint64_t count, uint64_t segments, uint64_t k) {
  const uint64_t q = count / segments + (count % segments != 0);
  const uint64_t at = std::min(count, q * k);
  return {at, at + std::min(q, count - at)};
}

// Segment k's pieces of a rank with `pairs`, as AlltoallPairwise takes
// them: bytes of each, at their places in the rank's buffers.
AlltoallBuffers SegmentPieces(const RankPairs& pairs, uint64_t segments, uint64_t k, size_t es) {
  AlltoallBuffers b;
  for (size_t j = 0; j < pairs.send.size(); ++j) {
    const auto [s0, s1] = PartOfSegment(pairs.send[j], segments, k);
    const auto [r0, r1] = PartOfSegment(pairs.recv[j], segments, k);
    b.send_offsets.push_back((pairs.send_at[j] + s0) * es);
    b.send_bytes.push_back((s1 - s0) * es);
    b.recv_offsets.push_back((pairs.recv_at[j] + r0) * es);
    b.recv_bytes.push_back((r1 - r0) * es);
  }
  return b;
}

// An alltoall(v)'s segments under the run's settings: 0 when announced
// without segments (one whole exchange), else Run.segments.
absl::StatusOr<uint64_t> AlltoallSegmentsOf(const RunSettings& settings) {
  if (settings.segment_bytes == 0) return 0;
  if (settings.segments == 0) {
    return absl::InternalError(
        "coordinator announced an alltoall in segments without their number (a daemon of "
        "another version?)");
  }
  return settings.segments;
}

// The most bytes one of op's ranks on this node sends or receives in an
// alltoall(v) (Ready.rank_bytes).
uint64_t AlltoallRankBytes(const ClusterOp& op, size_t world) {
  uint64_t most = 0;
  for (const ClusterOp::Part& p : op.parts) {
    auto pairs = PairsOf(op, p, world);
    if (pairs.ok()) most = std::max({most, pairs->sent, pairs->got});
  }
  return most * op.sig.element_bytes();
}

// op's parts in rank order, whatever order they came in.
std::vector<const ClusterOp::Part*> PartsInRankOrder(const ClusterOp& op) {
  std::vector<const ClusterOp::Part*> parts;
  for (const auto& p : op.parts) parts.push_back(&p);
  std::sort(parts.begin(), parts.end(), [](auto* a, auto* b) { return a->rank < b->rank; });
  return parts;
}

// An alltoall(v)'s pairs on this node: each local rank's block for each
// local rank copied into that rank's block from it (`ranks` as
// AlltoallPairwise takes them; local[r]: rank r is on this node).
void CopyLocalPairs(const std::vector<AlltoallBuffers>& ranks, const std::vector<bool>& local) {
  for (size_t from = 0; from < ranks.size(); ++from) {
    if (!local[from]) continue;
    const AlltoallBuffers& f = ranks[from];
    for (size_t to = 0; to < ranks.size(); ++to) {
      const uint64_t bytes = f.send_bytes[to];
      if (local[to] && bytes > 0) {
        const AlltoallBuffers& t = ranks[to];
        std::memcpy(t.recv + t.RecvAt(from), f.send + f.SendAt(to), bytes);
      }
    }
  }
}

// The staged pipeline of `segments` segments through the buffer's two
// slots of `slot_bytes`: segments 0 and 1 fetched into slots 0 and 1, then
// segment k carried (`carry`, on its slot's memory, once its fetch is done)
// and stored, and segment k + 2 fetched into the same slot right after the
// store (the device queue orders them), while segment k + 1 travels.
absl::Status PipelineSegments(StagedNodeBuffer& device, size_t segments, size_t slot_bytes,
                              const std::function<absl::Status(int, size_t)>& fetch,
                              const std::function<absl::Status(uint8_t*, size_t)>& carry,
                              const std::function<absl::Status(int, size_t)>& store) {
  uint8_t* slot[2] = {nullptr, nullptr};
  for (size_t k = 0; k < std::min<size_t>(2, segments); ++k) {
    auto p = device.Slot(static_cast<int>(k), slot_bytes);
    if (!p.ok()) return p.status();
    slot[k] = *p;
    if (absl::Status s = fetch(static_cast<int>(k), k); !s.ok()) return s;
  }
  for (size_t k = 0; k < segments; ++k) {
    const int sl = static_cast<int>(k % 2);
    if (absl::Status s = device.Wait(sl); !s.ok()) return s;
    absl::Status s = carry(slot[sl], k);
    if (!s.ok()) return s;
    if (s = store(sl, k); !s.ok()) return s;
    if (k + 2 < segments) {
      if (s = fetch(sl, k + 2); !s.ok()) return s;
    }
  }
  return absl::OkStatus();
}

}  // namespace

struct ClusterJob::Event {
  // kBroken: the ordering stream ended; kRunFailed: a run failed (in a
  // lane, or announced against the protocol); kCoordinator: a Fail or
  // JobFailed (Runs go to the lanes from the reader); kReadyHeld: the
  // occurrence of op.name before the first held one was announced or
  // failed, so that one is readied now.
  // kHeartbeat: time to tell the coordinator this node is alive.
  // kDirectEnd: a staged direct op's exchange ended (staged_direct_ends_),
  // its result to be stored on its device. kDirectExpired: a direct op's
  // deadline passed.
  enum Kind {
    kSubmit, kCoordinator, kBroken, kRunFailed, kAbort, kReadyHeld, kHeartbeat, kDirectEnd,
    kDirectExpired
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
    ForwardingTransport::Send(peer, channel, tag, data, bytes,
                              Counted(&sent_, peer, bytes, std::move(done)));
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
  void RecordFailure(int peer, const absl::Status& s) {
    std::lock_guard<std::mutex> lock(mu_);
    failures_.emplace(peer, std::string(s.message()));
  }
  std::unique_ptr<Transport> owned_;
  std::vector<std::atomic<uint64_t>> sent_;
  std::vector<std::atomic<uint64_t>> received_;
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

void ClusterJob::PushDirectEnd() { Push(Event{Event::kDirectEnd, {}, {}, {}}); }

void ClusterJob::Submit(ClusterOp op) {
  if (op.timeout_ms == 0) op.timeout_ms = options_.tuning->Snapshot().op_timeout_ms;
  if (op.deadline == Clock::time_point{}) {
    op.deadline = Clock::now() + std::chrono::milliseconds(op.timeout_ms);
  }
  // A direct op on host buffers starts here, on the caller's thread (the
  // engine's loop): its local phase, then the first messages. Before the
  // job has formed (direct_max_bytes_ 0), or on GPU buffers, it goes to
  // the ClusterJob's thread.
  uint64_t number = 0;
  if (!op.staged && IsDirect(op, &number) && StartDirect(op, number)) return;
  Event e{Event::kSubmit, {}, {}, {}};
  e.op = std::move(op);
  Push(std::move(e));
}

std::optional<ClusterOp> ClusterJob::TakeBackUnformed(uint64_t key) {
  std::lock_guard<std::mutex> lock(mu_);
  if (state_ != State::kForming) return std::nullopt;
  for (auto it = events_->begin(); it != events_->end(); ++it) {
    if (it->kind == Event::kSubmit && it->op.key == key) {
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
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<PeerRow> rows = peers_;
  for (size_t p = 0; p < rows.size() && transport_; ++p) {
    rows[p].bytes_sent = transport_->sent(static_cast<int>(p));
    rows[p].bytes_received = transport_->received(static_cast<int>(p));
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
  for (int r : options_.local_ranks) req.add_ranks(r);
  for (const std::string& a : (*unconnected)->Addresses()) req.add_transport_addresses(a);
  req.set_channels(options_.channels);

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
    state_ = State::kRunning;
    std::lock_guard<std::mutex> direct_lock(direct_mu_);
    direct_transport_ = transport_.get();
  }
  direct_max_bytes_.store(membership.direct_max_bytes());
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
  for (DirectOp& d : TakeDirect()) Done(d.op, why);
}

void ClusterJob::Done(ClusterOp& op, const absl::Status& status) {
  op.staged.reset();
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
  absl::Status broken;
  if (run.settings.chunk_bytes == 0 || run.settings.chunks_in_flight == 0 ||
      run.settings.chunks_in_flight > 64 || run.settings.segments > kMaxSegments ||
      r.algorithm() > static_cast<uint32_t>(config::Algorithm::kHalvingDoubling)) {
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

void ClusterJob::LaneLoop(Lane& lane) {
  while (true) {
    Announced run;
    {
      std::unique_lock<std::mutex> lock(mu_);
      lanes_cv_.wait(lock, [&] {
        if (lanes_stop_) return true;
        if (announced_.empty()) return false;
        for (const auto& op : announced_.front().ops) {
          if (running_names_.count(op.name)) return false;  // its earlier run first
        }
        return true;
      });
      if (lanes_stop_) return;
      run = std::move(announced_.front());
      announced_.pop_front();
      for (const auto& op : run.ops) ++running_names_[op.name];
      lane.busy = true;
      lane.priority = run.ops.front().priority;
      for (const auto& op : run.ops) lane.priority = std::max(lane.priority, op.priority);
      for (auto& other : lanes_) {
        if (other.get() != &lane && other->busy && other->priority < lane.priority) {
          other->yield.fetch_add(1, std::memory_order_relaxed);
          lane.yielding.push_back(other.get());
        }
      }
    }
    lanes_cv_.notify_all();  // the next run may start in another lane
    const auto start = std::chrono::steady_clock::now();
    absl::Status s = run.ops.size() == 1
                         ? Execute(run.ops.front(), run.seq, run.settings, lane)
                         : ExecuteFused(run.ops, run.seq, run.settings, lane);
    if (s.code() == absl::StatusCode::kUnavailable) s = WithVerdict(std::move(s));
    const auto end = std::chrono::steady_clock::now();
    for (const auto& op : run.ops) {
      if (op.timing) {
        op.timing->run_start = start;
        op.timing->run_end = end;
      }
    }
    // The ranks hear first (writing the Done is a system call on a TCP
    // stream). A rank that hears of its last operation may leave at once,
    // and its node's Leave must not reach the coordinator before this run's
    // Done (it would count the run as cut off, and warn): the Leave waits
    // for the Dones announced here (dones_pending_).
    {
      std::lock_guard<std::mutex> lock(write_mu_);
      ++dones_pending_;
    }
    for (auto& op : run.ops) Done(op, s);
    {
      proto::NodeEvent done;
      done.mutable_done()->set_seq(run.seq);
      done.mutable_done()->set_code(static_cast<int>(s.code()));
      done.mutable_done()->set_message(std::string(s.message()));
      std::lock_guard<std::mutex> lock(write_mu_);
      // A closed stream: the job is ending anyway.
      if (!writes_closed_ && stream_) stream_->Write(done);
      --dones_pending_;
    }
    dones_cv_.notify_all();
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (const auto& op : run.ops) {
        if (--running_names_[op.name] == 0) running_names_.erase(op.name);
      }
      for (Lane* other : lane.yielding) other->yield.fetch_sub(1, std::memory_order_relaxed);
      lane.yielding.clear();
      lane.busy = false;
      last_progress_ = Clock::now();
    }
    lanes_cv_.notify_all();
    if (!s.ok() && s.code() != absl::StatusCode::kInvalidArgument) {
      Push(Event{Event::kRunFailed, {}, {}, s});
    }
  }
}

absl::Status ClusterJob::WithVerdict(absl::Status run_status) {
  std::unique_lock<std::mutex> lock(mu_);
  lanes_cv_.wait_for(lock, kVerdictGrace, [&] { return !verdict_.ok() || lanes_stop_; });
  if (verdict_.ok()) return run_status;
  return absl::Status(verdict_.code(),
                      absl::StrCat(verdict_.message(), " (here: ", run_status.message(), ")"));
}

void ClusterJob::WaitForAnnouncedRuns() {
  std::unique_lock<std::mutex> lock(mu_);
  lanes_cv_.wait(lock, [&] {
    if (lanes_stop_ || aborted_) return true;
    if (!announced_.empty()) return false;
    for (const auto& lane : lanes_) {
      if (lane->busy) return false;
    }
    return true;
  });
}

void ClusterJob::StopLanes() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    lanes_stop_ = true;
  }
  lanes_cv_.notify_all();
  for (auto& lane : lanes_) {
    if (lane->thread.joinable()) lane->thread.join();
  }
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
    if (e.kind == Event::kDirectEnd) {
      FinishStagedDirect();
      continue;
    }
    if (e.kind == Event::kDirectExpired) {
      ExpireDirect();
      continue;
    }
    if (!formed.ok()) {
      if (e.kind == Event::kSubmit) Done(e.op, formed);
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
        uint64_t number = 0;
        if (e.kind == Event::kSubmit && IsDirect(e.op, &number)) {
          if (!StartDirect(e.op, number)) Done(e.op, absl::CancelledError("job closed"));
          break;
        }
        {
          std::lock_guard<std::mutex> lock(mu_);
          if (e.kind == Event::kReadyHeld) {
            auto h = held_.find(e.op.name);
            if (h == held_.end() || awaiting_.count(e.op.name)) break;
            e.op = std::move(h->second.front());
            h->second.pop_front();
            if (h->second.empty()) held_.erase(h);
          } else if (awaiting_.count(e.op.name) || held_.count(e.op.name)) {
            // An earlier occurrence of the name is still to be announced:
            // this one waits its turn (never dropped, never reordered).
            held_[e.op.name].push_back(std::move(e.op));
            break;
          }
        }
        const proto::NodeEvent ready = ReadyFor(e.op);
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

absl::StatusOr<const Codec*> ClusterJob::CodecNamed(const std::string& spec) {
  if (spec.empty()) return nullptr;
  std::lock_guard<std::mutex> lock(codecs_mu_);  // codecs are never removed: the pointer stays
  auto it = codecs_.find(spec);
  if (it == codecs_.end()) {
    auto parsed = ParseCodec(spec);
    if (!parsed.ok()) return parsed.status();
    it = codecs_.emplace(spec, MakeCodec(*parsed)).first;
  }
  return it->second.get();
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

bool ClusterJob::KeepsFeedback(const ClusterOp& op, size_t count, const config::Tuning& tuning) {
  // Unnamed operations ("#N": the SDK's reserved prefix) never recur, so a
  // residual would only cost a fresh allocation and evict others'.
  if (!tuning.error_feedback || (!op.name.empty() && op.name[0] == '#')) return false;
  const bool float32 = op.sig.dtype == static_cast<uint32_t>(wire::DataType::kFloat32);
  const size_t cap = options_.feedback_bytes;
  if (!float32 || count <= cap / sizeof(float)) return true;
  feedback_.Forget(op.name);  // a residual of when it was smaller, if any
  if (feedback_too_large_.fetch_add(1) == 0) {
    spdlog::warn(
        "job '{}': operation '{}' has {} elements, more than error feedback keeps ({} float32 "
        "elements, {} bytes per job): it is compressed without error feedback, so what "
        "compression drops is not carried to its next step (ciuicctl status counts such "
        "operations as too large; said once per job)",
        options_.job_id, op.name, count, cap / sizeof(float), cap);
  }
  return false;
}

absl::Status ClusterJob::StagedFetch(StagedNodeBuffer& device, int slot, size_t slot_offset,
                                     size_t offset, size_t bytes) {
  staged_bytes_.fetch_add(bytes, std::memory_order_relaxed);
  return device.Fetch(slot, slot_offset, offset, bytes);
}

absl::Status ClusterJob::StagedStore(StagedNodeBuffer& device, int slot, size_t slot_offset,
                                     size_t offset, size_t bytes) {
  staged_bytes_.fetch_add(bytes, std::memory_order_relaxed);
  return device.Store(slot, slot_offset, offset, bytes);
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
  return ctx;
}

absl::Status ClusterJob::ExecuteFused(const std::vector<ClusterOp>& ops, uint64_t seq,
                                      const RunSettings& settings, Lane& lane) {
  const config::Tuning tuning = options_.tuning->Snapshot();
  const ClusterOp& head = ops.front();
  for (const ClusterOp& op : ops) {
    if (op.sig.collective != static_cast<uint32_t>(wire::Collective::kAllreduce) ||
        op.sig.dtype != head.sig.dtype || op.sig.reduce_op != head.sig.reduce_op || op.staged) {
      return absl::InternalError(absl::StrCat("coordinator fused '", op.name, "' with '", head.name,
                                              "', which do not match (or one is on a GPU)"));
    }
  }
  const auto dtype = static_cast<wire::DataType>(head.sig.dtype);
  const auto requested = static_cast<wire::ReduceOp>(head.sig.reduce_op);
  const auto wire_op = requested == wire::ReduceOp::kAvg ? wire::ReduceOp::kSum : requested;
  const size_t es = head.sig.element_bytes();
  size_t total = 0;
  // A fused run ends by the latest of its operations' deadlines.
  Clock::time_point deadline{};
  for (const ClusterOp& op : ops) {
    total += op.sig.count;
    deadline = std::max(deadline, op.deadline);
  }
  uint8_t* node = lane.staging.Get(total * es + 1);
  if (node == nullptr) {
    return absl::ResourceExhaustedError(
        absl::StrCat("cannot map ", total * es, " bytes of staging space"));
  }
  // Pack: each operation's local reduction goes straight to its place.
  std::vector<const void*> inputs;
  size_t offset = 0;
  for (const ClusterOp& op : ops) {
    inputs.clear();
    for (const auto& p : op.parts) inputs.push_back(p.send);
    Reduce(dtype, wire_op, inputs.data(), static_cast<int>(inputs.size()), node + offset,
           op.sig.count);
    offset += op.sig.count * es;
  }
  // All compressed with the run's codec, or all uncompressed.
  auto codec = CodecNamed(settings.codec);
  if (!codec.ok()) return codec.status();
  InterNodeContext ctx = ContextFor(seq, deadline, settings, lane);
  absl::Status s;
  if (*codec != nullptr) {
    // One compressed allreduce over the packed buffer; each operation keeps
    // its own error feedback residuals (as unfused: unnamed ones and those
    // over the cap none).
    std::vector<FeedbackPiece> pieces;
    size_t at = 0;
    for (const ClusterOp& op : ops) {
      const bool keeps = KeepsFeedback(op, op.sig.count, tuning);
      pieces.push_back(FeedbackPiece{keeps ? op.name : std::string(), at, op.sig.count});
      at += op.sig.count;
    }
    CompressionStats stats;
    s = AllreduceCompressedPieces(ctx, **codec, tuning.error_feedback ? &feedback_ : nullptr,
                                  pieces, dtype, node, total, &stats);
    CountCompressed(ops.size(), stats);
  } else {
    // The run's algorithm (auto: by the packed size) where an element's bits
    // do not depend on its offset (the coordinator fused only such
    // operations), halving-doubling otherwise.
    const int nodes = ctx.transport->num_peers();
    InterNodeAlgorithm algo = InterNodeAlgorithmFor(settings.algorithm);
    if (algo == InterNodeAlgorithm::kAuto) algo = ChooseAllreduceAlgorithm(nodes, total * es);
    if (!OffsetIndependent(nodes, algo)) algo = InterNodeAlgorithm::kHalvingDoubling;
    s = Allreduce(ctx, algo, dtype, wire_op, node, total);
  }
  if (!s.ok()) return s;
  if (requested == wire::ReduceOp::kAvg) DivideInPlace(dtype, node, total, options_.world_size);
  offset = 0;
  for (const ClusterOp& op : ops) {
    const size_t bytes = op.sig.count * es;
    for (const auto& p : op.parts) CopyBytes(p.recv, node + offset, bytes);
    offset += bytes;
  }
  fused_ops_.fetch_add(ops.size(), std::memory_order_relaxed);
  fused_runs_.fetch_add(1, std::memory_order_relaxed);
  return absl::OkStatus();
}

absl::Status ClusterJob::CarryAllreduce(InterNodeContext ctx, uint64_t seq, int segment,
                                        const RunSettings& settings, const Codec* codec,
                                        bool feedback, const std::string& name,
                                        wire::DataType dtype, wire::ReduceOp op, void* data,
                                        size_t count, const void* input) {
  if (segment >= 0) ctx.tag_base = SegmentTagBase(seq, static_cast<size_t>(segment));
  if (codec == nullptr) {
    return Allreduce(ctx, InterNodeAlgorithmFor(settings.algorithm), dtype, op, data, count, input);
  }
  CompressionStats stats;
  absl::Status s = AllreduceCompressed(ctx, *codec, feedback ? &feedback_ : nullptr, name, dtype,
                                       data, count, &stats);
  CountCompressed(1, stats);
  return s;
}

std::vector<std::pair<size_t, size_t>> NodeParts(const std::vector<int>& node_of_rank, int node,
                                                 size_t at, size_t n, size_t rank_count) {
  std::vector<std::pair<size_t, size_t>> parts;
  if (rank_count == 0) return parts;
  for (int r = 0; r < static_cast<int>(node_of_rank.size()); ++r) {
    if (node_of_rank[r] != node) continue;
    const size_t from = std::max(at, static_cast<size_t>(r) * rank_count);
    const size_t to = std::min(at + n, static_cast<size_t>(r + 1) * rank_count);
    if (from < to) parts.emplace_back(from - at, to - from);
  }
  return parts;
}

absl::Status ClusterJob::CarryReduceScatter(InterNodeContext ctx, uint64_t seq, int segment,
                                            wire::DataType dtype, wire::ReduceOp op,
                                            uint8_t* data, size_t at, size_t n,
                                            size_t rank_count, const void* input) {
  if (segment >= 0) ctx.tag_base = SegmentTagBase(seq, static_cast<size_t>(segment));
  const size_t es = wire::DataTypeSize(static_cast<uint32_t>(dtype));
  std::vector<Block> blocks;
  for (int node = 0; node < ctx.transport->num_peers(); ++node) {
    for (const auto& [offset, elements] : NodeParts(node_of_rank_, node, at, n, rank_count)) {
      blocks.push_back(Block{offset * es, elements * es, node});
    }
  }
  return ReduceScatterRing(ctx, dtype, op, data, blocks, input);
}

void ClusterJob::CountCompressed(uint64_t ops, const CompressionStats& stats) {
  compressed_ops_.fetch_add(ops, std::memory_order_relaxed);
  raw_bytes_.fetch_add(stats.raw_bytes, std::memory_order_relaxed);
  wire_bytes_.fetch_add(stats.wire_bytes, std::memory_order_relaxed);
}

absl::Status ClusterJob::ExecuteStaged(const ClusterOp& op, const InterNodeContext& ctx,
                                       uint64_t seq, const RunSettings& settings) {
  staged_ops_.fetch_add(1, std::memory_order_relaxed);
  absl::Status s;
  switch (static_cast<wire::Collective>(op.sig.collective)) {
    case wire::Collective::kAllreduce:
    case wire::Collective::kReduceScatter: {
      auto codec = CodecNamed(settings.codec);
      if (!codec.ok()) return codec.status();
      s = ReduceStaged(op, ctx, seq, settings, *codec);
      break;
    }
    case wire::Collective::kAllgather:
    case wire::Collective::kBroadcast:
      s = MoveStaged(op, ctx, seq, settings);
      break;
    case wire::Collective::kAlltoall:
    case wire::Collective::kAlltoallv:
      s = AlltoallStaged(op, ctx, seq, settings);
      break;
    case wire::Collective::kBarrier:
      break;
  }
  // The ranks hear of the end once nothing is left in flight on the device.
  if (!s.ok()) op.staged->Drain().IgnoreError();
  return s;
}

absl::Status ClusterJob::MoveSegment(InterNodeContext ctx, uint64_t seq, int segment,
                                     const ClusterOp& op, uint8_t* data, size_t stride,
                                     size_t first, size_t bytes) {
  if (segment >= 0) ctx.tag_base = SegmentTagBase(seq, static_cast<size_t>(segment));
  if (op.sig.collective != static_cast<uint32_t>(wire::Collective::kAllgather)) {
    return BroadcastPipeline(ctx, data + first, bytes, node_of_rank_[op.sig.root]);
  }
  std::vector<Block> blocks;
  for (int r = 0; r < options_.world_size; ++r) {
    blocks.push_back(Block{static_cast<size_t>(r) * stride + first, bytes, node_of_rank_[r]});
  }
  return AllgatherRing(ctx, data, blocks);
}

absl::Status ClusterJob::MoveStaged(const ClusterOp& op, const InterNodeContext& ctx, uint64_t seq,
                                    const RunSettings& settings) {
  StagedNodeBuffer& device = *op.staged;
  const size_t es = op.sig.element_bytes();
  const size_t count = op.sig.count;  // elements of each rank's block
  const size_t block = count * es;
  const bool gather = op.sig.collective == static_cast<uint32_t>(wire::Collective::kAllgather);
  const int world = options_.world_size;
  const bool root_here = !gather && node_of_rank_[op.sig.root] == self_;
  if (absl::Status s = device.PlaceInputs(); !s.ok()) return s;
  if (count == 0) return device.Finish();
  // Segment k carries elements [k * per, ...) of every rank's block (a
  // broadcast: of the one block); in a slot the ranks' pieces lie back to
  // back.
  const bool segmented = settings.segment_bytes > 0;
  const size_t per = MoveSegmentElements(settings.segment_bytes, gather, count, es, world);
  const size_t segments = (count + per - 1) / per;
  const size_t pieces = gather ? static_cast<size_t>(world) : 1;
  auto range = [&](size_t k) { return std::make_pair(k * per, std::min(per, count - k * per)); };
  // What this node sends of segment k: its ranks' pieces (the root's node:
  // the piece), fetched into the slot; what it receives, stored from it.
  auto fetch = [&](int sl, size_t k) -> absl::Status {
    const auto [at, n] = range(k);
    if (!gather) return root_here ? StagedFetch(device, sl, 0, at * es, n * es) : absl::OkStatus();
    for (const auto& p : op.parts) {
      const size_t r = static_cast<size_t>(p.rank);
      if (absl::Status s = StagedFetch(device, sl, r * n * es, r * block + at * es, n * es); !s.ok()) {
        return s;
      }
    }
    return absl::OkStatus();
  };
  auto store = [&](int sl, size_t k) -> absl::Status {
    const auto [at, n] = range(k);
    if (!gather) return root_here ? absl::OkStatus() : StagedStore(device, sl, 0, at * es, n * es);
    for (int r = 0; r < world; ++r) {
      if (node_of_rank_[r] == self_) continue;
      const size_t rr = static_cast<size_t>(r);
      if (absl::Status s = StagedStore(device, sl, rr * n * es, rr * block + at * es, n * es); !s.ok()) {
        return s;
      }
    }
    return absl::OkStatus();
  };
  auto carry = [&](uint8_t* slot, size_t k) {
    const size_t n = range(k).second;
    return MoveSegment(ctx, seq, segmented ? static_cast<int>(k) : -1, op, slot, n * es, 0,
                       n * es);
  };
  absl::Status s = PipelineSegments(device, segments, pieces * per * es, fetch, carry, store);
  return s.ok() ? device.Finish() : s;
}

absl::Status ClusterJob::AlltoallStaged(const ClusterOp& op, const InterNodeContext& ctx,
                                         uint64_t seq, const RunSettings& settings) {
  StagedNodeBuffer& device = *op.staged;
  const size_t world = static_cast<size_t>(options_.world_size);
  const size_t es = op.sig.element_bytes();
  // The node buffer (staged_buffer.h): the local ranks' send buffers back
  // to back in rank order, then (alltoallv) their receive buffers likewise;
  // an alltoall receives over what it sent, segment by segment, each
  // segment's pieces fetched before the received ones are stored.
  const std::vector<const ClusterOp::Part*> parts = PartsInRankOrder(op);
  std::vector<bool> local(world, false);
  std::vector<RankPairs> pairs;
  std::vector<uint64_t> send_base, recv_base;  // each rank's, in the node buffer (elements)
  uint64_t sent = 0, got = 0;
  for (const ClusterOp::Part* p : parts) {
    local[static_cast<size_t>(p->rank)] = true;
    auto r = PairsOf(op, *p, world);
    if (!r.ok()) return r.status();
    send_base.push_back(sent);
    recv_base.push_back(got);
    sent += r->sent;
    got += r->got;
    pairs.push_back(*std::move(r));
  }
  const bool v_splits = op.sig.collective == static_cast<uint32_t>(wire::Collective::kAlltoallv);
  for (uint64_t& at : recv_base) at += v_splits ? sent : 0;
  auto announced = AlltoallSegmentsOf(settings);
  if (!announced.ok()) return announced.status();
  const uint64_t segments = std::max<uint64_t>(*announced, 1);  // none announced: one
  // Segment k's pieces: in a slot they lie back to back, rank order then
  // peer order, what the node's ranks send first, what they receive after
  // `send_half` bytes (segment 0's are the largest).
  uint64_t send_half = 0, recv_half = 0;
  for (const RankPairs& r : pairs) {
    const AlltoallBuffers b = SegmentPieces(r, segments, 0, es);
    for (size_t j = 0; j < world; ++j) {
      send_half += b.send_bytes[j];
      recv_half += b.recv_bytes[j];
    }
  }
  if (absl::Status s = device.PlaceInputs(); !s.ok()) return s;
  // Copies between the node buffer and slot `sl` of segment k's pieces.
  auto copy = [&](int sl, uint64_t k, bool fetch) {
    size_t in_slot = fetch ? 0 : send_half;
    for (size_t i = 0; i < pairs.size(); ++i) {
      AlltoallBuffers b = SegmentPieces(pairs[i], segments, k, es);
      const uint64_t base = (fetch ? send_base[i] : recv_base[i]) * es;
      std::vector<uint64_t>& offsets = fetch ? b.send_offsets : b.recv_offsets;
      for (uint64_t& o : offsets) o += base;
      absl::Status s = CopyPieces(device, fetch, sl, in_slot, offsets,
                                  fetch ? b.send_bytes : b.recv_bytes);
      if (!s.ok()) return s;
      for (uint64_t bytes : fetch ? b.send_bytes : b.recv_bytes) in_slot += bytes;
    }
    return absl::OkStatus();
  };
  auto fetch = [&](int sl, size_t k) { return copy(sl, k, true); };
  auto store = [&](int sl, size_t k) { return copy(sl, k, false); };
  // The exchange reads the slot's first part and fills its second; the
  // next fetch into the slot comes after it has returned.
  auto carry = [&](uint8_t* slot, size_t k) {
    std::vector<AlltoallBuffers> in_slot(world);
    uint8_t* send_at = slot;
    uint8_t* recv_at = slot + send_half;
    for (size_t i = 0; i < pairs.size(); ++i) {
      AlltoallBuffers b = SegmentPieces(pairs[i], segments, k, es);
      b.send_offsets.clear();  // back to back in the slot
      b.recv_offsets.clear();
      b.send = send_at;
      b.recv = recv_at;
      for (size_t j = 0; j < world; ++j) {
        send_at += b.send_bytes[j];
        recv_at += b.recv_bytes[j];
      }
      in_slot[static_cast<size_t>(parts[i]->rank)] = std::move(b);
    }
    InterNodeContext segment = ctx;
    if (*announced > 0) segment.tag_base = SegmentTagBase(seq, k);
    return AlltoallPairwise(segment, node_of_rank_, in_slot,
                            [&] { CopyLocalPairs(in_slot, local); });
  };
  // Nothing to send or receive: no segment (the other nodes' pieces for
  // and from this one are empty too).
  const size_t run = send_half + recv_half > 0 ? segments : 0;
  absl::Status s = PipelineSegments(device, run, send_half + recv_half, fetch, carry, store);
  return s.ok() ? device.Finish() : s;
}

absl::Status ClusterJob::CopyPieces(StagedNodeBuffer& device, bool fetch, int slot,
                                    size_t slot_offset, const std::vector<uint64_t>& offsets,
                                    const std::vector<uint64_t>& bytes) {
  for (size_t j = 0; j < bytes.size();) {
    const uint64_t n = bytes[j];
    if (n == 0) {
      ++j;
      continue;
    }
    // A run of pieces of one size one pitch apart: one 2-D copy.
    const uint64_t pitch =
        j + 1 < bytes.size() && offsets[j + 1] > offsets[j] ? offsets[j + 1] - offsets[j] : 0;
    size_t rows = 1;
    while (pitch >= n && j + rows < bytes.size() && bytes[j + rows] == n &&
           offsets[j + rows] == offsets[j] + rows * pitch) {
      ++rows;
    }
    absl::Status s;
    if (rows == 1) {
      s = fetch ? StagedFetch(device, slot, slot_offset, offsets[j], n)
                : StagedStore(device, slot, slot_offset, offsets[j], n);
    } else {
      staged_bytes_.fetch_add(rows * n, std::memory_order_relaxed);
      s = fetch ? device.FetchRows(slot, slot_offset, offsets[j], n, pitch, rows)
                : device.StoreRows(slot, slot_offset, offsets[j], n, pitch, rows);
    }
    if (!s.ok()) return s;
    slot_offset += rows * n;
    j += rows;
  }
  return absl::OkStatus();
}

absl::Status ClusterJob::ReduceStaged(const ClusterOp& op, const InterNodeContext& ctx,
                                      uint64_t seq, const RunSettings& settings,
                                      const Codec* codec) {
  StagedNodeBuffer& device = *op.staged;
  const auto dtype = static_cast<wire::DataType>(op.sig.dtype);
  const auto requested = static_cast<wire::ReduceOp>(op.sig.reduce_op);
  const auto wire_op = requested == wire::ReduceOp::kAvg ? wire::ReduceOp::kSum : requested;
  const size_t es = op.sig.element_bytes();
  // A reduce_scatter reduces every rank's block (the node buffer holds
  // them all); each rank then takes its own.
  const size_t count = op.sig.collective == static_cast<uint32_t>(wire::Collective::kReduceScatter)
                           ? op.sig.count * static_cast<size_t>(options_.world_size)
                           : op.sig.count;
  const bool feedback = codec != nullptr && KeepsFeedback(op, count, options_.tuning->Snapshot());
  // Segments: [at, at + n) by element. Unsegmented (compressed, or a
  // coordinator that announced none): the whole buffer as one.
  const bool segmented = settings.segment_bytes > 0;
  const size_t per = segmented ? SegmentElements(settings.segment_bytes, count, es) : count;
  const size_t segments = count == 0 ? 0 : (count + per - 1) / per;
  auto range = [&](size_t k) { return std::make_pair(k * per, std::min(per, count - k * per)); };
  uint8_t* slot[2] = {nullptr, nullptr};
  if (absl::Status s = device.ReduceLocal(wire_op); !s.ok()) return s;
  if (codec != nullptr) {
    // Compressed where the buffer lives, when it can: only encoded bytes
    // leave it, and its residuals stay there.
    auto coder = device.Coder(settings.codec, feedback ? op.name : std::string());
    if (!coder.ok()) return coder.status();
    if (*coder != nullptr) {
      CompressionStats stats;
      absl::Status s =
          AllreduceCompressedWith(ctx, *codec, **coder, dtype, device.data(), count, &stats);
      CountCompressed(1, stats);
      {
        // Read under the lock: of two lanes, the later reading is kept.
        std::lock_guard<std::mutex> lock(device_feedback_mu_);
        device_feedback_ = device.FeedbackStats();
      }
      if (!s.ok()) return s;
      if (requested == wire::ReduceOp::kAvg) {
        if (s = device.Divide(options_.world_size); !s.ok()) return s;
      }
      return device.Finish();
    }
  }
  // Fetch the first two segments, one per slot; segment k + 2 is fetched
  // into k's slot right after k's store (the device queue orders them).
  for (size_t k = 0; k < std::min<size_t>(2, segments); ++k) {
    auto p = device.Slot(static_cast<int>(k), std::min(per, count) * es);
    if (!p.ok()) return p.status();
    slot[k] = *p;
    const auto [at, n] = range(k);
    if (absl::Status s = StagedFetch(device, static_cast<int>(k), 0, at * es, n * es); !s.ok()) {
      return s;
    }
  }
  // An uncompressed reduce_scatter: each segment reduce-scattered, and only
  // this node's ranks' parts of it go back to the device.
  const bool scatter =
      op.sig.collective == static_cast<uint32_t>(wire::Collective::kReduceScatter) &&
      codec == nullptr;
  for (size_t k = 0; k < segments; ++k) {
    const int sl = static_cast<int>(k % 2);
    const auto [at, n] = range(k);
    if (absl::Status s = device.Wait(sl); !s.ok()) return s;
    const int segment = segmented ? static_cast<int>(k) : -1;
    absl::Status s;
    if (scatter) {
      s = CarryReduceScatter(ctx, seq, segment, dtype, wire_op, slot[sl], at, n, op.sig.count,
                             nullptr);
      if (!s.ok()) return s;
      for (const auto& [offset, elements] : NodeParts(node_of_rank_, self_, at, n, op.sig.count)) {
        uint8_t* part = slot[sl] + offset * es;
        if (requested == wire::ReduceOp::kAvg) {
          DivideInPlace(dtype, part, elements, options_.world_size);
        }
        if (s = StagedStore(device, sl, offset * es, (at + offset) * es, elements * es); !s.ok()) {
          return s;
        }
      }
    } else {
      s = CarryAllreduce(ctx, seq, segment, settings, codec, feedback, op.name, dtype, wire_op,
                         slot[sl], n, nullptr);
      if (!s.ok()) return s;
      if (requested == wire::ReduceOp::kAvg) {
        DivideInPlace(dtype, slot[sl], n, options_.world_size);
      }
      if (s = StagedStore(device, sl, 0, at * es, n * es); !s.ok()) return s;
    }
    if (k + 2 < segments) {
      const auto [next_at, next_n] = range(k + 2);
      if (s = StagedFetch(device, sl, 0, next_at * es, next_n * es); !s.ok()) return s;
    }
  }
  return device.Finish();
}

absl::Status ClusterJob::MoveInSegments(const InterNodeContext& ctx, uint64_t seq,
                                        const RunSettings& settings, const ClusterOp& op,
                                        uint8_t* node) {
  const size_t es = op.sig.element_bytes();
  const size_t count = op.sig.count;
  const size_t block = count * es;
  if (settings.segment_bytes == 0 || count == 0) {
    return MoveSegment(ctx, seq, -1, op, node, block, 0, block);
  }
  // As a node with GPU buffers runs them (MoveStaged), on the node buffer.
  const bool gather = op.sig.collective == static_cast<uint32_t>(wire::Collective::kAllgather);
  const size_t per =
      MoveSegmentElements(settings.segment_bytes, gather, count, es, options_.world_size);
  for (size_t k = 0, at = 0; at < count; ++k, at += per) {
    const size_t n = std::min(per, count - at);
    absl::Status s = MoveSegment(ctx, seq, static_cast<int>(k), op, node, block, at * es, n * es);
    if (!s.ok()) return s;
  }
  return absl::OkStatus();
}

absl::Status ClusterJob::Execute(const ClusterOp& op, uint64_t seq, const RunSettings& settings,
                                 Lane& lane) {
  const config::Tuning tuning = options_.tuning->Snapshot();
  const auto dtype = static_cast<wire::DataType>(op.sig.dtype);
  const auto collective = static_cast<wire::Collective>(op.sig.collective);
  if (op.parts.empty() && !op.splits_error.empty()) {
    // Failed here before it ran (its ranks disagree); a coordinator that
    // runs it anyway is of an older version.
    return absl::InvalidArgumentError(absl::StrCat("operation '", op.name,
                                                   "' mismatched across ranks: ", op.splits_error));
  }
  if (collective == wire::Collective::kBarrier) return absl::OkStatus();  // Run means all arrived
  const size_t es = op.sig.element_bytes();
  const int world = options_.world_size;
  const size_t block = op.sig.count * es;
  InterNodeContext ctx = ContextFor(seq, op.deadline, settings, lane);
  if (op.staged) return ExecuteStaged(op, ctx, seq, settings);

  // The node's buffer is the first local rank's receive buffer where it is
  // big enough (it lives in that rank's shared memory): no staging copy,
  // and that rank needs no fan-out copy either.
  const ClusterOp::Part& first = op.parts.front();
  auto fan_out = [&](const uint8_t* node_buffer, size_t bytes) {
    for (const auto& p : op.parts) {
      if (p.recv != node_buffer) CopyBytes(p.recv, node_buffer, bytes);
    }
  };
  std::vector<const void*> inputs;
  for (const auto& p : op.parts) inputs.push_back(p.send);
  switch (collective) {
    case wire::Collective::kAllreduce:
    case wire::Collective::kReduceScatter: {
      // Sum (for avg) or reduce locally, across nodes, divide once, fan out.
      const auto requested = static_cast<wire::ReduceOp>(op.sig.reduce_op);
      const auto wire_op = requested == wire::ReduceOp::kAvg ? wire::ReduceOp::kSum : requested;
      const bool all = collective == wire::Collective::kAllreduce;
      const size_t count = all ? op.sig.count : op.sig.count * static_cast<size_t>(world);
      auto codec = CodecNamed(settings.codec);
      if (!codec.ok()) return codec.status();
      const bool feedback = *codec != nullptr && KeepsFeedback(op, count, tuning);
      uint8_t* node = all ? first.recv : lane.staging.Get(count * es + 1);
      // One local rank, send and receive buffers apart, uncompressed: the
      // inter-node allreduce reads the rank's input where it needs it and
      // writes the node buffer, instead of a copy of the input first.
      const void* input = nullptr;
      if (inputs.size() == 1 && *codec == nullptr) {
        input = inputs[0];
      } else if (!(inputs.size() == 1 && inputs[0] == node)) {
        Reduce(dtype, wire_op, inputs.data(), static_cast<int>(inputs.size()), node, count);
      }
      absl::Status s;
      if (!all && *codec == nullptr) {
        // Uncompressed reduce_scatter: each node ends with its own ranks'
        // blocks only, half the bytes of an allreduce (every node takes this
        // path alike, in the same segments as a node with GPU buffers: it
        // depends on the run's settings only).
        const size_t per =
            settings.segment_bytes == 0 ? count : SegmentElements(settings.segment_bytes, count, es);
        for (size_t k = 0, at = 0; s.ok() && at < count; ++k, at += per) {
          s = CarryReduceScatter(ctx, seq, settings.segment_bytes == 0 ? -1 : static_cast<int>(k),
                                 dtype, wire_op, node + at * es, at, std::min(per, count - at),
                                 op.sig.count,
                                 input ? static_cast<const uint8_t*>(input) + at * es : nullptr);
        }
        if (!s.ok()) return s;
        for (const auto& p : op.parts) {
          uint8_t* mine = node + static_cast<size_t>(p.rank) * block;
          if (requested == wire::ReduceOp::kAvg) DivideInPlace(dtype, mine, op.sig.count, world);
          CopyBytes(p.recv, mine, block);
        }
        return absl::OkStatus();
      }
      if (settings.segment_bytes == 0 || count == 0) {
        s = CarryAllreduce(ctx, seq, -1, settings, *codec, feedback, op.name, dtype, wire_op, node,
                           count, input);
      } else {
        // Segments, as a node with GPU buffers runs them (ExecuteStaged).
        const size_t per = SegmentElements(settings.segment_bytes, count, es);
        for (size_t k = 0, at = 0; s.ok() && at < count; ++k, at += per) {
          s = CarryAllreduce(ctx, seq, static_cast<int>(k), settings, *codec, feedback, op.name,
                             dtype, wire_op, node + at * es, std::min(per, count - at),
                             input ? static_cast<const uint8_t*>(input) + at * es : nullptr);
        }
      }
      if (!s.ok()) return s;
      if (requested == wire::ReduceOp::kAvg) DivideInPlace(dtype, node, count, world);
      if (all) {
        fan_out(node, block);
      } else {
        for (const auto& p : op.parts) {
          CopyBytes(p.recv, node + static_cast<size_t>(p.rank) * block, block);
        }
      }
      return absl::OkStatus();
    }
    case wire::Collective::kAllgather: {
      const size_t all = block * static_cast<size_t>(world);
      uint8_t* node = first.recv;
      for (const auto& p : op.parts) {
        uint8_t* at = node + p.rank * block;
        if (p.send != at) CopyBytes(at, p.send, block);
      }
      absl::Status s = MoveInSegments(ctx, seq, settings, op, node);
      if (!s.ok()) return s;
      fan_out(node, all);
      return absl::OkStatus();
    }
    case wire::Collective::kBroadcast: {
      uint8_t* node = first.recv;
      for (const auto& p : op.parts) {
        if (p.rank == op.sig.root && p.send != node) CopyBytes(node, p.send, block);
      }
      absl::Status s = MoveInSegments(ctx, seq, settings, op, node);
      if (!s.ok()) return s;
      fan_out(node, block);
      return absl::OkStatus();
    }
    case wire::Collective::kAlltoall:
    case wire::Collective::kAlltoallv: {
      // Pairs on this node are copied here, while the others go straight
      // between the ranks' buffers and the network.
      std::vector<AlltoallBuffers> ranks(static_cast<size_t>(world));
      std::vector<RankPairs> pairs(static_cast<size_t>(world));
      std::vector<bool> local(static_cast<size_t>(world), false);
      for (const auto& p : op.parts) {
        const size_t r = static_cast<size_t>(p.rank);
        auto got = PairsOf(op, p, static_cast<size_t>(world));
        if (!got.ok()) return got.status();
        pairs[r] = *std::move(got);
        AlltoallBuffers& b = ranks[r];
        b.send = p.send;
        b.recv = p.recv;
        for (size_t j = 0; j < static_cast<size_t>(world); ++j) {
          b.send_bytes.push_back(pairs[r].send[j] * es);
          b.recv_bytes.push_back(pairs[r].recv[j] * es);
        }
        local[r] = true;
      }
      auto segments = AlltoallSegmentsOf(settings);
      if (!segments.ok()) return segments.status();
      if (*segments == 0) {
        // While the first chunks travel.
        return AlltoallPairwise(ctx, node_of_rank_, ranks, [&] { CopyLocalPairs(ranks, local); });
      }
      // Segments, as a node with GPU buffers runs them (AlltoallStaged):
      // segment k carries part k of every rank pair's piece. The pairs on
      // this node go whole, while the first segment travels.
      absl::Status s;
      for (uint64_t k = 0; s.ok() && k < *segments; ++k) {
        std::vector<AlltoallBuffers> pieces(static_cast<size_t>(world));
        bool any = false;
        for (const auto& p : op.parts) {
          const size_t r = static_cast<size_t>(p.rank);
          pieces[r] = SegmentPieces(pairs[r], *segments, k, es);
          pieces[r].send = p.send;
          pieces[r].recv = p.recv;
          for (size_t j = 0; j < static_cast<size_t>(world); ++j) {
            any = any || pieces[r].send_bytes[j] > 0 || pieces[r].recv_bytes[j] > 0;
          }
        }
        // Empty for this node: so are the other nodes' pieces for and from
        // it (and, in segment 0, its own pairs).
        if (!any) continue;
        InterNodeContext segment = ctx;
        segment.tag_base = SegmentTagBase(seq, k);
        s = AlltoallPairwise(segment, node_of_rank_, pieces, [&, k] {
          if (k == 0) CopyLocalPairs(ranks, local);
        });
      }
      return s;
    }
    case wire::Collective::kBarrier:
      break;
  }
  return absl::OkStatus();
}

}  // namespace ciuic::daemon
