// The coordinator side of multi-node jobs: membership and global order.
//
// Every ciuicd runs one Coordinator; it is used for the jobs whose rank 0
// this daemon hosts (trainers name it as their job's coordinator). Each
// daemon hosting ranks of such a job:
//   1. Register()s its ranks and transport addresses, and waits until every
//      rank of the job is registered; all get the same membership table;
//   2. Attach()es its ordering stream and reports, per operation name, that
//      all its local ranks have submitted it (Ready). When every node is
//      ready the coordinator sends Run(name, seq) to all nodes, so all run
//      operations in one global order whatever order ranks submitted them
//      in. A signature that differs between nodes, or an operation some
//      node never readies before its timeout, is sent as Fail to every node;
//      a node that arrives later gets the same Fail at once.
//      Scheduling (see README.md): at most kRunningRuns runs are announced
//      and not yet Done on every node; operations ready beyond that wait in
//      a backlog, from which the highest priority goes first (ties: the
//      order they became ready), and fusable allreduces of one dtype,
//      reduce op and fuse_class (the codec, or none) are packed into one Run
//      up to fusion_threshold_bytes. With
//      cycle_time_us > 0 a ready operation also waits that long in the
//      backlog before it may start, to meet others.
//   3. A stream that ends without Leave, or a Leave, fails the job on every
//      other node (JobFailed, naming the node).
//
// Jobs are keyed by (uid, job id), so users never share a job. No gRPC
// here: control/peer_service.cc adapts it.
//
// Thread-safety: every method may be called from any thread; NodeStream
// callbacks are made with no Coordinator lock held... except Send, which is
// called under the lock and must not block for long.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "ciuic/peer.pb.h"
#include "cluster/coordinator_client.h"
#include "cluster/membership.h"
#include "config/tuning.h"

namespace ciuic::daemon {

// alltoallv's check between nodes: a hash of element counts, folded in
// order (start from kSplitsSeed). The same on every daemon (no per-process
// seed), so nodes compare hashes instead of sending world_size^2 counts.
inline constexpr uint64_t kSplitsSeed = 0x6a09e667f3bcc908ull;
inline uint64_t HashSplits(uint64_t h, uint64_t count) {
  uint64_t z = h ^ (count + 0x9e3779b97f4a7c15ull);  // splitmix64's finaliser
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

// How the coordinator speaks to one node's ordering stream.
class NodeStream {
 public:
  virtual ~NodeStream() = default;
  virtual void Send(const proto::CoordinatorEvent& event) = 0;
};

class Coordinator {
 public:
  // Runs announced and not yet Done on every node, per job: two, so that a
  // small urgent operation starts beside a large one instead of behind it,
  // and the next run is announced while the previous one still runs.
  static constexpr int kRunningRuns = 2;

  // `tuning` (may be null: defaults) gives fusion_threshold_bytes and
  // cycle_time_us, read at every scheduling decision; it must outlive this.
  // Jobs of more than `max_world_size` ranks are refused at registration.
  // Who may call is decided before (control/peer_socket.h authenticates
  // every connection between daemons; this daemon's own jobs call
  // in-process).
  explicit Coordinator(config::TuningRegistry* tuning = nullptr,
                       int max_world_size = kDefaultMaxWorldSize);
  ~Coordinator();

  // Blocks until the job has formed, `deadline`, `cancelled()` turns true
  // (checked every 100 ms; the caller gave up) or Shutdown().
  absl::StatusOr<proto::Membership> Register(const proto::RegisterNodeRequest& request,
                                             std::chrono::steady_clock::time_point deadline,
                                             const std::function<bool()>& cancelled = nullptr);
  // Ends every wait in Register with UNAVAILABLE; for daemon shutdown.
  void Shutdown();

  // A node's stream said Hello. Returns a handle for OnEvent/Detach.
  absl::StatusOr<uint64_t> Attach(const proto::NodeEvent::Hello& hello, NodeStream* stream);
  void OnEvent(uint64_t handle, const proto::NodeEvent& event);
  // The stream ended (`why` OK after a Leave). After Detach returns, the
  // coordinator no longer uses the stream.
  void Detach(uint64_t handle, const absl::Status& why);

  // Jobs known (for status): "uid/job" -> nodes registered.
  size_t num_jobs();

  // This coordinator (random, never 0), as memberships carry it: a node
  // whose own daemon formed its job opens its ordering stream with
  // OpenLocalStream, in-process, instead of over the network. Its events
  // then reach the coordinator on the writing thread and its runs come
  // without a round trip through gRPC's threads.
  uint64_t id() const { return id_; }
  std::unique_ptr<OrderingStream> OpenLocalStream();

  // The port of this daemon's OrderingListener (control/tcp_ordering.h), announced
  // in memberships formed from now on; 0 (the default): none, the nodes
  // order through the peer service's gRPC stream.
  void set_ordering_port(int port) { ordering_port_.store(port); }

 private:
  struct PendingRun {
    proto::OpSignature signature;
    int first_node = -1;
    std::vector<bool> ready;
    int ready_count = 0;
    std::chrono::steady_clock::time_point first_ready;
    std::chrono::steady_clock::time_point deadline;
    absl::Status failure;  // poisoned: later nodes get it at once
    int32_t priority = 0;  // the highest any node gave
    bool device_buffers = false;  // some node's buffers are in GPU memory
    uint64_t rank_bytes = 0;      // alltoall(v): the largest Ready.rank_bytes
    // alltoallv: each node's Ready.split_out / split_in, and the first
    // splits_error a node reported.
    std::vector<std::vector<uint64_t>> split_out;
    std::vector<std::vector<uint64_t>> split_in;
    std::string splits_error;
  };
  // Ready on every node, waiting to be announced.
  struct Queued {
    std::string name;
    proto::OpSignature signature;
    int32_t priority = 0;
    uint64_t bytes = 0;
    uint64_t order = 0;   // when it became ready, for ties
    std::chrono::steady_clock::time_point ready_at;
    bool device_buffers = false;  // announced in segments, never fused
    uint64_t rank_bytes = 0;      // alltoall(v): cut into Run.segments by it
    // For the trace (Run.last_ready_node, ready_spread_us): the node whose
    // Ready came last, and when the first node's came.
    int last_node = -1;
    std::chrono::steady_clock::time_point first_ready;
  };
  struct Job {
    std::string key;
    std::string id;
    int world_size = 0;
    uint64_t instance = 0;
    int channels = 0;
    std::vector<proto::RegisterNodeRequest> registrations;
    int ranks_registered = 0;
    std::vector<bool> rank_registered;  // world_size bits
    std::set<std::string> node_names;   // of the registrations
    bool complete = false;
    proto::Membership membership;
    std::map<int, NodeStream*> streams;  // by node index
    std::map<int, uint64_t> handles;     // node -> handle
    // Liveness (tuning heartbeat_*): when each attached node was last heard
    // from, and when the coordinator last sent its heartbeat to them.
    std::map<int, std::chrono::steady_clock::time_point> heard;
    std::chrono::steady_clock::time_point beat{};
    absl::Status failure;
    std::map<std::string, PendingRun> pending;
    std::vector<Queued> backlog;
    uint64_t next_order = 0;
    struct Running {
      std::vector<bool> done;  // a Done from each node
      bool failed = false;     // some node's Done said it failed
    };
    std::map<uint64_t, Running> running;  // by seq
    uint64_t next_seq = 0;
    // Per node, its channels' rates from its latest Ready that had them
    // (bytes per second): the runs' channel shares (channel_weights.h).
    std::vector<std::vector<double>> channel_rates;
    // Per node, its rates to each node from its latest Ready that had them
    // (bytes per second, 0: not measured), and each node's rack
    // (RackIndices): the rack cost model's input.
    std::vector<std::vector<double>> peer_rates;
    std::vector<int> racks;
    int attached_ever = 0;
  };
  struct Attachment {
    std::string job_key;
    int node;
  };

  void SendAll(Job& job, const proto::CoordinatorEvent& e);
  // Announces what may start now; returns when the next decision is due
  // (time_point::max() if none waits on a clock).
  std::chrono::steady_clock::time_point Schedule(Job& job, std::chrono::steady_clock::time_point now);
  // `node`: the node whose Leave, lost stream or failed run ends the job
  // (-1: none). The runs in flight are cut off (JobFailed.runs_cut_off) when
  // that node has not finished one of them, or one failed somewhere.
  void FailJob(Job& job, int code, const std::string& message, int node = -1);
  void MaybeErase(const std::string& key);
  std::string NodeLabel(const Job& job, int node) const;
  // alltoallv, once every node is ready: INVALID_ARGUMENT when a node
  // reported its own ranks' counts disagreeing, or when what node k's ranks
  // send to node m's differs from what those expect (their hashes).
  absl::Status CheckSplits(const Job& job, const std::string& name, const PendingRun& run);
  void TimerLoop();
  // Sends the job's heartbeat when due and fails the job when an attached
  // node has been silent for heartbeat_misses intervals. mu_ held.
  void CheckLiveness(Job& job, std::chrono::steady_clock::time_point now);

  config::TuningRegistry* const tuning_;
  const int max_world_size_;
  const uint64_t id_;
  std::atomic<int> ordering_port_{0};
  std::mutex mu_;
  std::condition_variable changed_;
  std::map<std::string, std::unique_ptr<Job>> jobs_;
  std::map<uint64_t, Attachment> attachments_;
  uint64_t next_handle_ = 1;
  uint64_t next_instance_ = 1;
  bool stopping_ = false;
  std::thread timer_;
};

}  // namespace ciuic::daemon
