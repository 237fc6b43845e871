// The node side of a job that spans several nodes.
//
// The engine creates one ClusterJob per multi-node job once all of the
// job's local ranks have joined. Its thread:
//   1. creates the job's transport (channels) and registers this node's
//      ranks and transport addresses with the job's coordinator daemon,
//      waiting for the membership table; connects to the other nodes;
//   2. opens the ordering stream, reports each operation that all local
//      ranks have submitted (Submit) and runs operations in the order the
//      coordinator announces: local reduction straight from the ranks'
//      shared memory into a node buffer, the inter-node algorithm between
//      the daemons, and the result written back to every local rank;
//   3. reports each operation's end (OpDone) and the job's failure
//      (JobFailed) through callbacks that the engine posts onto its loop.
//
// Runs go to kLanes lane threads, each with its own scratch and staging
// buffers (grown once, reused). Lanes start runs strictly in announced
// order (a run whose operation name is still running in another lane waits,
// and so does everything behind it), so a small urgent run announced after
// a large one runs beside it, and the earliest unfinished run is always
// started on every node: no deadlock. Each run's transfers carry its
// sequence number in their tags. A run announced with fused_with is one
// allreduce over the operations packed back to back in the lane's staging
// buffer; each lane reports Done(seq) to the coordinator. A run announced
// with segment_bytes is an allreduce in consecutive segments, each with its
// own tags: a node whose buffers are in GPU memory (ClusterOp::staged)
// copies one segment to host memory while another travels.
//
// Threads: the main one (formation, Submit's Ready, the coordinator's Fail
// and JobFailed, the job's end), the ordering stream's reader (which hands
// each Run straight to the lanes: one thread hand-off less per operation,
// 10-15 us here) and the lanes. Submit, Abort, state and Peers may be
// called from any thread; the callbacks run on the ClusterJob's threads.
// (Writing the Ready on Submit's caller's thread instead measured no
// different here: 8 B 2-node medians within the noise, 12 rounds.)
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "cluster/channel_weights.h"
#include "cluster/coordinator.h"
#include "cluster/coordinator_client.h"
#include "cluster/direct_exchange.h"
#include "cluster/run_settings.h"
#include "collectives/internode/internode.h"
#include "collectives/internode/scratch.h"
#include "collectives/local.h"
#include "collectives/op.h"
#include "collectives/staged_buffer.h"
#include "compression/codec.h"
#include "compression/error_feedback.h"
#include "config/tuning.h"
#include "transport/transport.h"


namespace ciuic::daemon {

// A transport before it knows its peers: publish Addresses() in the
// membership table, then Connect() with everybody's.
class UnconnectedTransport {
 public:
  virtual ~UnconnectedTransport() = default;
  virtual std::vector<std::string> Addresses() const = 0;
  // addresses[peer][channel]; `self` is this node's index.
  virtual absl::StatusOr<std::unique_ptr<Transport>> Connect(
      int self, const std::vector<std::vector<std::string>>& addresses) = 0;
};

using TransportFactory =
    std::function<absl::StatusOr<std::unique_ptr<UnconnectedTransport>>(int channels)>;

// The parts of node `node`'s ranks (node_of_rank[r] == node) in elements
// [at, at + n) of a reduce_scatter's node buffer, where rank r's block is
// elements [r * rank_count, (r + 1) * rank_count): (offset from `at`,
// elements) pairs, in rank order.
std::vector<std::pair<size_t, size_t>> NodeParts(const std::vector<int>& node_of_rank, int node,
                                                 size_t at, size_t n, size_t rank_count);

// The local phase of an operation run before the coordinator's Run came
// (ClusterJob::Submit): set once the node's ranks are reduced into the
// first part's recv buffer. Those who would read the ranks' buffers or let
// the ranks have them back wait for it.
struct EarlyLocal {
  // Waits for the reduction's end (it always ends: Submit finishes it even
  // when the reduction throws): OK, or why the buffer does not hold it.
  absl::Status Wait() const {
    while (!done_.load(std::memory_order_acquire)) done_.wait(false, std::memory_order_acquire);
    return failure_;
  }
  void Finish(absl::Status failure = absl::OkStatus()) {
    failure_ = std::move(failure);  // published by the release below
    done_.store(true, std::memory_order_release);
    done_.notify_all();
  }

 private:
  absl::Status failure_;
  std::atomic<bool> done_{false};
};

struct ClusterOp {
  uint64_t key = 0;  // the engine's, echoed in OpDone
  std::string name;
  OpSignature sig;
  int32_t priority = 0;
  // The operation's one deadline (issue 32): absolute, set once by the
  // engine when the node's last rank submitted it (the earliest of its
  // ranks' timeouts), and carried unchanged to the coordinator's Ready (as
  // the time left), the direct exchange and the run's algorithms. Unset
  // (a test's, a mismatch notice): Submit sets it from timeout_ms, else
  // the daemon's op_timeout_ms.
  std::chrono::steady_clock::time_point deadline{};
  uint32_t timeout_ms = 0;  // the timeout the deadline came from, for messages
  struct Part {
    int rank;
    const uint8_t* send;
    uint8_t* recv;
    // alltoallv: elements for / from each rank of the job (else empty).
    std::vector<uint64_t> send_counts;
    std::vector<uint64_t> recv_counts;
  };
  std::vector<Part> parts;  // one per local rank
  // An operation whose local ranks disagree (the engine's words: alltoallv
  // counts, or signatures): the Ready carries it, and the coordinator fails
  // the operation on every node; a direct one's exchange does. With
  // signatures that disagree the engine hands it over without parts (its
  // ranks have been told) and ignores its end.
  std::string splits_error;
  // An operation on GPU buffers: the node buffer lives on the device and is
  // staged through host memory (parts' send and recv are then null).
  // Released with the op, which waits for its device work.
  std::shared_ptr<StagedNodeBuffer> staged;
  // When its phases happened, for `ciuicctl trace` (may be null). The
  // ClusterJob's threads fill it in before OpDone; the caller reads it
  // after.
  struct Timing {
    std::chrono::steady_clock::time_point ready;      // Ready written
    std::chrono::steady_clock::time_point announced;  // Run received
    std::chrono::steady_clock::time_point run_start;  // a lane started it
    std::chrono::steady_clock::time_point run_end;    // and ended it
    std::string last_node;         // whose Ready the coordinator got last
    uint64_t ready_spread_us = 0;  // after the first node's
    uint64_t queued_us = 0;        // then held at the coordinator
    uint64_t run_seq = 0;
    uint32_t fused_ops = 0;
    std::string codec;
    bool direct = false;  // ran without the coordinator (DirectExchange)
    std::string algorithm;  // RunAlgorithmName, or "direct"
    uint64_t model_flat_us = 0;  // Run.model_flat_us, model_rack_us
    uint64_t model_rack_us = 0;
  };
  std::shared_ptr<Timing> timing;
  // Called once where the operation ends, on that thread (a transport
  // thread for a direct one, a lane, the ClusterJob's thread, Abort's
  // caller), in place of the ClusterJob's OpDone: the engine's tells the
  // ranks at once instead of through its loop. Unset: OpDone.
  std::function<void(const absl::Status&)> done;
  // Set: the node's ranks are reduced (or being reduced) into parts[0].recv
  // ahead of the run, which then takes that buffer as its only input.
  std::shared_ptr<EarlyLocal> early;
};

class ClusterJob {
 public:
  // The residual bytes the host keeps per job by default. A GPU keeps as
  // many (DeviceRunner's kResidualBytesPerJob, the same 256 MiB), and the
  // staged path checks operations against feedback_bytes too: the two are
  // equal but where a test makes feedback_bytes small.
  static constexpr size_t kFeedbackBytes = size_t{256} << 20;

  struct Options {
    std::string job_id;
    uint32_t uid = 0;
    int world_size = 0;
    std::vector<int> local_ranks;
    std::string node_name;
    std::string rack;  // announced at registration (config `rack`)
    std::string coordinator;  // host:port of the coordinator's peer service
    int channels = 1;
    config::TuningRegistry* tuning = nullptr;
    TransportFactory transports;
    CoordinatorClientFactory coordinator_clients;  // control/peer_client.h's in ciuicd
    // This daemon's coordinator, if any: when the membership names it (the
    // job's rank 0 is local), the ordering stream is in-process.
    Coordinator* local_coordinator = nullptr;
    // Error feedback's residual bytes in host memory (tests make it small).
    size_t feedback_bytes = kFeedbackBytes;
    // How long past an operation's timeout this node waits for the
    // coordinator to announce or fail it before it ends the job, the
    // coordinator taken for stopped or unreachable (the coordinator fails
    // an operation not ready everywhere at its timeout itself).
    std::chrono::milliseconds announce_grace{5000};
    // Runs body(0..n-1), some of it on other threads, and returns once all
    // have run (the engine's WorkerPool::ParallelFor): the local phase's
    // reduction is cut into chunks that the node's workers share. Null:
    // all on the lane's thread.
    ParallelChunks parallel;
    // The most bytes the job's direct exchanges may hold at once
    // (kDirectBudgetBytes; tests make it small).
    uint64_t direct_budget_bytes = kDirectBudgetBytes;
  };
  using OpDone = std::function<void(uint64_t key, absl::Status status)>;
  using JobFailed = std::function<void(absl::Status status)>;

  ClusterJob(Options options, OpDone op_done, JobFailed job_failed);
  ~ClusterJob();  // Abort()s if needed and joins its threads

  void Submit(ClusterOp op);
  // While the job forms, operation `key` waits, submitted but not yet
  // readied: taken back (it will not run; the caller ends it, letting go of
  // its staged buffer first). Null once the job has formed or the
  // operation has gone on (the job then ends it, OpDone).
  std::optional<ClusterOp> TakeBackUnformed(uint64_t key);
  // Leaves the job (the coordinator tells the other nodes); pending and
  // future operations end with `why`.
  void Abort(const absl::Status& why);

  // Lanes: runs in progress at once on this node (the coordinator allows
  // Coordinator::kRunningRuns).
  static constexpr int kLanes = 2;
  // How long a run cut off by a peer waits for the coordinator's verdict
  // on the job (WithVerdict).
  static constexpr std::chrono::milliseconds kVerdictGrace{300};
  // How long direct operations in flight may take to end when the job ends
  // without cutting them off (WaitForDirectOps), and how long the job's end
  // waits for their transfers' callbacks once cut off (CloseDirect).
  static constexpr std::chrono::milliseconds kDirectGrace{2000};
  // A direct op that times out leaves its exchange waiting (a transport
  // receive cannot be taken back), holding its buffers until the job ends.
  // This many such exchanges end the job: its nodes' operations are out of
  // step, and a trainer must not make the daemon hold memory without bound.
  static constexpr int kMaxStaleExchanges = 64;
  // The most bytes a job's direct exchanges hold at once (their buffers,
  // DirectExchange::MemoryBytes): without it a trainer could make the
  // daemon allocate two buffers per operation in flight, up to 1024
  // operations of direct_max_bytes each. An operation that would go past it
  // waits, in order, until exchanges end (at most until its deadline); one
  // always fits while none is in flight.
  static constexpr uint64_t kDirectBudgetBytes = uint64_t{64} << 20;
  // Named operations that may run direct once the coordinator has announced
  // one occurrence of them (README.md, "Direct operations"): the first this
  // many names announced in a job get a slot; others always go through the
  // coordinator. Bounds what a trainer's names hold here (kMaxOpName each).
  static constexpr size_t kMaxNamedSlots = 4096;

  // Whether the ordering stream is in-process (Options::local_coordinator).
  bool ordering_in_process() const { return in_process_ordering_.load(); }

  enum class State { kForming, kRunning, kFailed };
  State state();
  // "forming", "running", "failed: <why>".
  std::string StateText();

  struct PeerRow {
    std::string node_name;
    std::vector<int> ranks;
    bool self = false;
    std::string state;  // "connected", "failed: ..."
    uint64_t bytes_sent = 0;
    uint64_t bytes_received = 0;
    std::string rack;  // as the node registered it
    // What this node's sends to it reached while they had work (bytes per
    // second, a moving estimate; 0: not measured). Measured only in a job
    // whose nodes span racks (the coordinator's rack cost model reads it).
    double rate_bytes_per_s = 0;
  };
  std::vector<PeerRow> Peers();

  // The job's channels (more than one): device, the rate this node has
  // measured on it, and its share of the latest run's chunks
  // (channel_weights.h). Empty with one channel, or before any Ready.
  struct ChannelRow {
    std::string device;  // "" = whichever UCX picks
    double rate_bytes_per_s = 0;  // 0: not measured yet
    double share = 0;             // of a run's chunks, 0..1
  };
  std::vector<ChannelRow> Channels() const;

  struct CompressionCounters {
    uint64_t ops = 0;         // operations that went compressed
    uint64_t raw_bytes = 0;   // what they would have sent uncompressed
    uint64_t wire_bytes = 0;  // what they sent
  };
  CompressionCounters compression() const;

  struct FusionCounters {
    uint64_t ops = 0;   // operations that crossed the network fused with others
    uint64_t runs = 0;  // fused allreduces they made
  };
  FusionCounters fusion() const;

  // The largest direct operation of a job of `nodes` nodes whose
  // coordinator's direct_max_bytes is `configured`: all of it when `nodes`
  // is a power of two, at most kDirectMaxBytesOtherNodeCounts otherwise.
  // There each node past the power of two hands its whole value to a
  // partner and gets the result back, so the partner's link carries the
  // value twice more than in the ring (DirectExchange's halving carries it
  // 2 (p - 1) / p times, as the ring does). 4 network namespaces on 1
  // Gbit/s links (compare.py --scenario netns --nodes 4, 2026-12-07): with
  // the halving, direct 128K 3.4 ms against 5.0 through the coordinator,
  // 512K 7.5 against 8.3, 1M 17.0 against 16.3 (by recursive doubling of
  // the whole value it had been 32.7 ms at 1M). Alike on every node: both
  // come from the membership.
  static uint64_t DirectBound(uint64_t configured, int nodes) {
    const bool power_of_two = nodes > 0 && (nodes & (nodes - 1)) == 0;
    return power_of_two ? configured : std::min(configured, kDirectMaxBytesOtherNodeCounts);
  }
  static constexpr uint64_t kDirectMaxBytesOtherNodeCounts = uint64_t{128} << 10;

  // Operations that ran between the nodes without the coordinator
  // (direct_exchange.h), and the bound the job formed with (0: none;
  // DirectBound).
  uint64_t direct_ops() const { return direct_ops_.load(std::memory_order_relaxed); }
  // Direct operations that waited for exchanges to end (kDirectBudgetBytes).
  uint64_t direct_waited() const { return direct_waited_.load(std::memory_order_relaxed); }
  uint64_t direct_max_bytes() const { return direct_max_bytes_.load(std::memory_order_relaxed); }
  // Runs whose local phase ran before their Run came (kEarlyLocalMaxBytes).
  uint64_t early_local_ops() const { return early_local_ops_.load(std::memory_order_relaxed); }

  struct StagingCounters {
    uint64_t ops = 0;    // operations whose node buffer was on a GPU (staged)
    uint64_t bytes = 0;  // copied between it and host memory (fetched + stored)
  };
  StagingCounters staging() const;

  // Error feedback's residuals (compression/error_feedback.h) and what was
  // dropped of them: in host memory, and on this node's GPUs (as the staged
  // buffers last reported them, after a compressed operation encoded there).
  struct FeedbackCounters {
    ErrorFeedback::Stats host;
    ErrorFeedback::Stats device;
    uint64_t too_large_ops = 0;  // compressed without: over Options::feedback_bytes alone
  };
  FeedbackCounters feedback() const;

 private:
  struct Event;
  class CountingTransport;

  struct Lane {
    std::thread thread;
    ScratchBuffer scratch;  // the algorithms' receive space
    ScratchBuffer staging;  // the node's buffer when no rank's buffer serves
    // > 0 while a run of higher priority runs in another lane: this lane's
    // run keeps one send in flight (InterNodeContext::yield).
    std::atomic<int> yield{0};
    bool busy = false;             // guarded by mu_
    int32_t priority = 0;          // guarded by mu_, of the run in progress
    std::vector<Lane*> yielding;   // guarded by mu_: the lanes this run slowed
  };
  struct Announced {
    uint64_t seq = 0;
    std::vector<ClusterOp> ops;  // one, or several fused
    RunSettings settings;        // the coordinator's, for every node alike
  };

  void Run();
  // Direct operations (README.md, "Direct operations"; direct_exchange.h).
  struct DirectOp {
    ClusterOp op;
    std::shared_ptr<DirectExchange> exchange;
    std::chrono::steady_clock::time_point start;
    std::chrono::steady_clock::time_point deadline;
    uint32_t timeout_ms = 0;
  };
  // Whether `op`'s signature lets it run direct (the same answer on every
  // node: from its signature and the job's direct_max_bytes).
  bool DirectSignature(const ClusterOp& op) const;
  // Whether `op` is an unnamed operation that runs direct, and its tag base
  // (from its number, "#N").
  bool IsUnnamedDirect(const ClusterOp& op, uint64_t* tag_base) const;
  // Whether named `op` runs direct, and its tag base, taking its name's
  // next occurrence. The caller makes sure that no earlier occurrence of
  // the name waits to be decided (queued, held or awaiting its Run), so
  // that every node numbers a name's direct occurrences alike. With mu_
  // held.
  bool TakeNamedDirectLocked(const ClusterOp& op, uint64_t* tag_base);
  // Gives the names of run `names` (announced in this order on every node)
  // their slots while there is room (named_slots_). With mu_ held.
  void AssignNamedSlotsLocked(const std::vector<std::string>& names);
  // A kSubmit of `name` left events_ (queued_named_). With mu_ held.
  void UnqueueNamedLocked(const std::string& name);
  // Starts `op` direct (LaunchDirect), or queues it behind the ops waiting
  // for the budget (direct_waiting_); false (op untouched) when the
  // transport is not there yet, so that the op waits for the job to form.
  // A staged op only on the ClusterJob's thread (its device copies block).
  bool StartDirect(ClusterOp& op, uint64_t tag_base);
  // Reduces the local ranks' inputs and starts the exchange, whose `bytes`
  // (MemoryBytes) the caller has added to direct_bytes_.
  void LaunchDirect(ClusterOp& op, uint64_t tag_base, uint64_t bytes);
  // Starts the waiting ops that now fit, in order. On the ClusterJob's thread.
  void StartWaitingDirect();
  // The exchange of operation `key` ended: its ranks get the result (or
  // the error), unless it was ended already (its deadline, the job's end).
  // On a transport thread; a staged op goes on through the ClusterJob's.
  void EndDirect(uint64_t key, uint64_t bytes, absl::Status status, uint8_t* result);
  // Stores the ended staged direct ops' results on their devices and ends
  // them (staged_direct_ends_). On the ClusterJob's thread.
  void FinishStagedDirect();
  // Push() of a kRunFailed and of a kDirectEnd event, for the files that do
  // not see Event.
  void PushRunFailed(absl::Status status);
  // Ends the job for a reason of this node's own, which the other nodes
  // hear (the Leave carries it).
  void PushGiveUp(absl::Status status);
  void PushDirectEnd();
  // The earliest deadline of the direct ops running or waiting (max: none).
  std::chrono::steady_clock::time_point NextDirectDeadline();
  // Ends the direct ops whose deadline has passed (DEADLINE_EXCEEDED naming
  // the node not heard from, or the budget a waiting one waited for). Their
  // exchanges stay until the job ends.
  void ExpireDirect();
  // Takes every direct op still running or waiting, to be ended by the caller.
  std::vector<DirectOp> TakeDirect();
  // Ends a direct operation taken out of direct_ with `why`: its exchange
  // lets go of the ranks' buffers (DirectExchange::Abandon), and Done runs
  // once it has, at once (true) or from the transport thread that ends
  // the last transfer in them (false).
  bool AbandonDirect(DirectOp d, const absl::Status& why);
  // At the job's end, before the transport goes: cuts off the transfers of
  // exchanges still in flight and waits for their last callback.
  void CloseDirect();
  // A job failure that cuts nothing off (the node that ended it had done
  // its part): direct ops in flight get up to kDirectGrace to end with
  // their data.
  void WaitForDirectOps();
  // When the next operation readied here becomes overdue (max: none), and
  // the error that ends the job once one is (OK: none is). mu_ held.
  std::chrono::steady_clock::time_point NextOverdueLocked() const;
  absl::Status OverdueLocked() const;
  // "NODE (HOST:PORT)": the coordinator's node name once the job formed.
  std::string CoordinatorLabelLocked() const;
  absl::Status Form();
  void LaneLoop(Lane& lane);
  // A run cut off by the transport (UNAVAILABLE: a peer lost) is often the
  // echo of a failure elsewhere: a node whose job has failed closes its
  // endpoints, and its neighbours see "lost peer" before the coordinator's
  // JobFailed, which names the node that really failed, reaches them. So
  // such a run's status waits up to kVerdictGrace for that verdict and, if
  // it comes, becomes the verdict (code and message) with this node's own
  // reason after it. From a lane.
  absl::Status WithVerdict(absl::Status run_status);
  // A run cut off by the job's own end (a rank here left, the coordinator
  // failed the job) fails with the transport's words around that end's
  // reason ("AllreduceRing: receive from node 1 (n1) (step 1, chunk 1)
  // failed: lost peer 1: <reason>"), and the other nodes get this node's
  // message inside theirs: the reason ends up past the wire::kMaxMessage
  // bytes a trainer hears. Such a run fails with the job's failure itself,
  // its code and message; any other status stays. From a lane.
  absl::Status EndedByTheJob(absl::Status run_status);
  void StopLanes();
  // Before a job failure from the coordinator or its stream is acted on:
  // runs announced before it still run to their end, everywhere (a node
  // whose rank finished and left must not cut off its partners' last
  // transfers). Not when the coordinator says they are cut off (the node
  // that ended the job had not finished one, or one failed): the job's
  // failure then fails every peer on the transport, which ends them at
  // once. Abort ends the wait.
  void WaitForAnnouncedRuns();
  // Writes to the ordering stream (from the main thread and the lanes);
  // false once the stream is closed.
  bool Write(const proto::NodeEvent& event);
  void CloseWrites();
  absl::Status Execute(const ClusterOp& op, uint64_t seq, const RunSettings& settings,
                       Lane& lane);
  // The host local phase, as a single-node job's (LocalCollective, in
  // chunks of kLocalChunkBytes through Options::parallel from 2 chunks up,
  // RunChunks): ReduceLocal reduces the node's ranks' `inputs` into `out`
  // (which may be one of them: element by element); FanOut writes a result
  // to every rank's recv buffer of `op` that does not hold it already (in
  // chunks that write about kLocalChunkBytes each, to all those ranks).
  static constexpr size_t kLocalChunkBytes = size_t{512} << 10;
  // The largest allreduce whose local phase Submit runs on its caller's
  // thread (the engine's loop, helped by the worker pool) while the Ready
  // travels: larger ones keep the loop too long, and the round trip is a
  // small part of their time.
  static constexpr size_t kEarlyLocalMaxBytes = size_t{1} << 20;
  // Submit's caller: the early local phase of `op`, when it qualifies.
  std::shared_ptr<EarlyLocal> EarlyLocalFor(const ClusterOp& op) const;
  void ReduceLocal(wire::DataType dtype, wire::ReduceOp op, const std::vector<const void*>& inputs,
                   void* out, size_t count);
  void FanOut(const ClusterOp& op, const uint8_t* result, size_t bytes);
  absl::Status ExecuteFused(const std::vector<ClusterOp>& ops, uint64_t seq,
                            const RunSettings& settings, Lane& lane);
  // An operation whose node buffer is on a GPU (op.staged; see
  // staged_buffer.h); on a failure it waits for the device work it started.
  absl::Status ExecuteStaged(const ClusterOp& op, const InterNodeContext& ctx, uint64_t seq,
                             const RunSettings& settings);
  // Its reductions: segment by segment through two host slots, or (with a
  // codec the device runs) compressed where the buffer lives.
  absl::Status ReduceStaged(const ClusterOp& op, const InterNodeContext& ctx, uint64_t seq,
                            const RunSettings& settings, const Codec* codec);
  // Allgather and broadcast: the same way, without a reduction (a segment
  // of an allgather carries a piece of every rank's block).
  absl::Status MoveStaged(const ClusterOp& op, const InterNodeContext& ctx, uint64_t seq,
                          const RunSettings& settings);
  // Alltoall(v): in the run's segments (Run.segments; unannounced: one),
  // segment k carrying part k of every rank pair's piece, so that nodes
  // with host buffers cut alike. The node's ranks' pieces of a segment are
  // fetched into the first part of a host slot, exchanged into its second
  // (pairs on this node copied there) and stored, while the next segment's
  // are fetched into the other slot.
  absl::Status AlltoallStaged(const ClusterOp& op, const InterNodeContext& ctx, uint64_t seq,
                              const RunSettings& settings);
  // Fetches (Stores) of pieces bytes[j] at node buffer offsets[j], back to
  // back in the slot from slot_offset; consecutive pieces of one size one
  // pitch apart (an alltoall's) go as one FetchRows (StoreRows). Counted.
  absl::Status CopyPieces(StagedNodeBuffer& device, bool fetch, int slot, size_t slot_offset,
                          const std::vector<uint64_t>& offsets,
                          const std::vector<uint64_t>& bytes);
  // The host's allgather or broadcast on the node buffer, in the run's
  // segments (or whole).
  absl::Status MoveInSegments(const InterNodeContext& ctx, uint64_t seq,
                              const RunSettings& settings, const ClusterOp& op, uint8_t* node);
  // One segment (-1: the whole operation) of an allgather or broadcast on
  // `data`: rank r's piece is `bytes` at r * stride + first (a broadcast's:
  // at first).
  absl::Status MoveSegment(InterNodeContext ctx, uint64_t seq, int segment, const ClusterOp& op,
                           uint8_t* data, size_t stride, size_t first, size_t bytes);
  void CountCompressed(uint64_t ops, const CompressionStats& stats);
  // Whether operation `op` (`count` elements reduced across nodes) keeps
  // error feedback: not one whose residual alone would be over
  // Options::feedback_bytes (counted, said in the log once per job, and
  // its residual of an earlier, smaller size dropped from host memory).
  bool KeepsFeedback(const ClusterOp& op, size_t count, const config::Tuning& tuning);
  // The staged buffer's copies to and from host memory, counted (staging()).
  absl::Status StagedFetch(StagedNodeBuffer& device, int slot, size_t slot_offset, size_t offset,
                           size_t bytes);
  absl::Status StagedStore(StagedNodeBuffer& device, int slot, size_t slot_offset, size_t offset,
                           size_t bytes);
  // The inter-node part of an allreduce of `count` elements in `data`
  // (segment `segment` of a run announced with segment_bytes, else the
  // whole): compressed with `codec` (may be null; `input` must then be
  // null), or by the run's algorithm (`input`: Allreduce's).
  absl::Status CarryAllreduce(InterNodeContext ctx, uint64_t seq, int segment,
                              const RunSettings& settings, const Codec* codec, bool feedback,
                              const std::string& name, wire::DataType dtype, wire::ReduceOp op,
                              void* data, size_t count, const void* input);
  // The inter-node part of an uncompressed reduce_scatter, on elements
  // [at, at + n) of the node buffer (every rank's block of `rank_count`
  // elements, back to back) held at `data` (`input`: the same elements of
  // the one local rank's send buffer, or null): afterwards this node's
  // ranks' parts of that range are reduced over every node (ReduceScatterRing;
  // segment `segment` of a run announced with segment_bytes, else -1).
  absl::Status CarryReduceScatter(InterNodeContext ctx, uint64_t seq, int segment,
                                  wire::DataType dtype, wire::ReduceOp op, uint8_t* data,
                                  size_t at, size_t n, size_t rank_count, const void* input);
  InterNodeContext ContextFor(uint64_t seq, std::chrono::steady_clock::time_point deadline,
                              const RunSettings& settings,
                              Lane& lane);
  // Adds this node's channel rates to a Ready (ChannelRates, from the
  // transport's loads now).
  void AddChannelRates(proto::NodeEvent& ready);
  // The announced codec (nullptr: uncompressed); an error for a spec this
  // daemon cannot parse.
  absl::StatusOr<const Codec*> CodecNamed(const std::string& spec);
  void FailAll(const absl::Status& why);
  // Ends `op` with `status`: its staged buffer goes first (its destructor
  // waits for the device work it enqueued, and keeps the ranks' memory
  // open until then), so that a rank that hears of the end may free or
  // reuse its buffers at once. Never on the engine's loop.
  void Done(ClusterOp& op, const absl::Status& status);
  // A Run from the coordinator, on the stream's reader thread: its
  // operations go to the lanes; one that breaks the protocol fails them and
  // the job.
  void Announce(const proto::CoordinatorEvent::Run& run);
  // The Ready that tells the coordinator `op` is ready on this node.
  proto::NodeEvent ReadyFor(const ClusterOp& op) const;
  void Push(Event e);

  Options options_;
  OpDone op_done_;
  JobFailed job_failed_;

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Event>* events_;  // guarded by mu_
  State state_ = State::kForming;  // guarded by mu_
  std::string failed_why_;         // guarded by mu_, with kFailed
  absl::Status failure_;           // guarded by mu_, sticky
  bool aborted_ = false;           // guarded by mu_
  std::vector<PeerRow> peers_;     // guarded by mu_ (counters read live)
  // Each node's rack (RackIndices): set once when the job forms, before any
  // lane starts, and read-only after.
  std::vector<int> racks_;
  bool spans_racks_ = false;
  // Created before mu_ is first taken by Form; CancelRegister under mu_.
  std::unique_ptr<CoordinatorClient> client_;

  // Owned by the ClusterJob thread (transport_ is also read under mu_).
  std::unique_ptr<CountingTransport> transport_;
  std::shared_ptr<OrderingStream> stream_;  // written under write_mu_ once lanes run
  std::atomic<bool> in_process_ordering_{false};
  std::thread reader_;
  std::mutex write_mu_;
  bool writes_closed_ = false;        // guarded by write_mu_
  // Runs whose operations were reported done and whose Done is not written
  // yet (guarded by write_mu_); a Leave waits for 0 on dones_cv_.
  int dones_pending_ = 0;
  std::condition_variable dones_cv_;
  std::condition_variable lanes_cv_;  // with mu_
  std::deque<Announced> announced_;   // guarded by mu_: not yet started, in seq order
  std::map<std::string, int> running_names_;  // guarded by mu_
  bool lanes_stop_ = false;                   // guarded by mu_
  // The coordinator's JobFailed, as the reader got it (lanes_cv_ wakes on it).
  absl::Status verdict_;  // guarded by mu_
  std::vector<std::unique_ptr<Lane>> lanes_;
  std::mutex codecs_mu_;
  std::map<std::string, std::unique_ptr<Codec>> codecs_;  // guarded by codecs_mu_
  ErrorFeedback feedback_{options_.feedback_bytes};
  mutable std::mutex device_feedback_mu_;
  // The channels' weights (channel_weights.h), guarded by channels_mu_:
  // rates measured here (updated on the ClusterJob thread at each Ready),
  // the devices, the shares of the latest run with shares (set by lanes).
  mutable std::mutex channels_mu_;
  ChannelRates channel_rates_;
  // Per peer node, the same moving rate of this node's sends to it
  // (Ready.peer_rates), kept only where the job spans racks.
  ChannelRates peer_rates_;
  std::vector<std::string> channel_devices_;
  std::vector<uint32_t> channel_shares_;
  ErrorFeedback::Stats device_feedback_;  // guarded by device_feedback_mu_
  std::atomic<uint64_t> feedback_too_large_{0};
  std::atomic<uint64_t> compressed_ops_{0};
  std::atomic<uint64_t> raw_bytes_{0};
  std::atomic<uint64_t> wire_bytes_{0};
  std::atomic<uint64_t> fused_ops_{0};
  std::atomic<uint64_t> fused_runs_{0};
  std::atomic<uint64_t> staged_ops_{0};
  std::atomic<uint64_t> direct_ops_{0};
  std::atomic<uint64_t> early_local_ops_{0};
  // The job's direct_max_bytes (Membership), set once it formed.
  std::atomic<uint64_t> direct_max_bytes_{0};
  std::mutex direct_mu_;  // never held while taking mu_ or calling the transport
  std::condition_variable direct_cv_;  // with direct_mu_: live_exchanges_ fell
  // The transport while direct ops may start on it (guarded by direct_mu_).
  Transport* direct_transport_ = nullptr;
  std::map<uint64_t, DirectOp> direct_;  // guarded by direct_mu_: running, by key
  int live_exchanges_ = 0;  // guarded by direct_mu_: started, last callback not yet run
  // guarded by direct_mu_: the bytes of those exchanges (MemoryBytes), and
  // the ops waiting for them to fall (kDirectBudgetBytes), in the order
  // they came.
  uint64_t direct_bytes_ = 0;
  struct WaitingDirect {
    ClusterOp op;
    uint64_t tag_base = 0;
    uint64_t bytes = 0;
  };
  std::deque<WaitingDirect> direct_waiting_;
  std::atomic<uint64_t> direct_waited_{0};
  // guarded by direct_mu_: staged direct ops whose exchange ended, with its
  // status and result, for the ClusterJob's thread (Event::kDirectEnd).
  struct StagedDirectEnd {
    ClusterOp op;
    absl::Status status;
    std::vector<uint8_t> result;
  };
  std::deque<StagedDirectEnd> staged_direct_ends_;
  // When the ClusterJob's thread looks at the direct deadlines next (ns of
  // steady_clock): an op due earlier wakes it.
  std::atomic<int64_t> direct_wake_ns_{0};
  std::atomic<uint64_t> staged_bytes_{0};
  // guarded by mu_: the names that may run direct, each with its slot
  // (given in the order the coordinator announced the names) and the
  // number of its next direct occurrence. A name's occurrences are decided
  // in submission order (queued_named_, held_, awaiting_), so every node
  // gives the same occurrence the same number and tag.
  struct NamedSlot {
    uint32_t slot = 0;
    uint64_t next = 0;
  };
  std::map<std::string, NamedSlot> named_slots_;
  // guarded by mu_: named kSubmit events in events_ not yet decided, by name.
  std::map<std::string, int> queued_named_;
  std::map<std::string, ClusterOp> awaiting_;  // guarded by mu_: readied, awaiting Run/Fail
  // guarded by mu_: later occurrences of a name in awaiting_, in submission
  // order. The coordinator knows one occurrence of a name at a time, so the
  // next is readied once the one before has been announced or failed.
  std::map<std::string, std::deque<ClusterOp>> held_;
  // guarded by mu_: each name in awaiting_: its deadline and its timeout.
  // It is overdue once announce_grace has passed since its deadline, and
  // since its timeout after last_progress_, with no run of this node's in
  // progress or announced (those may hold the coordinator's next Run back).
  std::map<std::string, std::pair<std::chrono::steady_clock::time_point, uint32_t>> readied_at_;
  // Liveness (tuning heartbeat_*): when this node last sent its heartbeat
  // (guarded by mu_), when it last heard from the coordinator (the reader
  // writes it), and the settings in force (guarded by mu_).
  std::chrono::steady_clock::time_point beat_sent_{};
  std::atomic<int64_t> heard_ns_{0};
  uint32_t heartbeat_interval_ms_ = 2000;
  uint32_t heartbeat_misses_ = 4;
  // guarded by mu_: when the coordinator last spoke, or a run here ended.
  std::chrono::steady_clock::time_point last_progress_{};
  int self_ = -1;
  std::vector<int> node_of_rank_;

  std::thread thread_;
};

}  // namespace ciuic::daemon
