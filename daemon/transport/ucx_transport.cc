#include "transport/ucx_transport.h"

#include <poll.h>
#include <pthread.h>
#include <ucp/api/ucp.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cinttypes>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <future>
#include <list>
#include <mutex>
#include <set>
#include <sstream>
#include <thread>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "reduce/reduce.h"
#include "spdlog/spdlog.h"
#include "transport/fragment_reducer.h"
#include "transport/idle_poll.h"

namespace ciuic::daemon {
namespace {

using Clock = std::chrono::steady_clock;

constexpr uint64_t kUserTagMask = (uint64_t{1} << Transport::kTagBits) - 1;
// How long an idle progress thread keeps polling (yielding the core between
// rounds) before it arms the worker and sleeps: long enough to catch a reply
// to a small message without a wakeup, short enough not to burn a core.
// CIUIC_UCX_POLL_US overrides it (0: sleep as soon as idle). Whether an idle
// thread polls at all: IdlePolicy (idle_poll.h). 300 us covers the gap
// between back-to-back operations (the daemons' ordering and hand-offs take
// ~100-150 us), which 100 us did not: the threads then slept between
// operations and every one paid wake-ups. Measured, 2 nodes x 1 rank on
// loopback, interleaved: 8 B 137-152 -> 109-128 us, 64 KiB 170-182 ->
// 150-159 us, 1 MiB 692-818 -> 592-620 us; in DDP over a 1 Gbit/s link the
// daemons' CPU for 36 steps stayed 2.4 s (gaps there exceed the window).
constexpr std::chrono::microseconds kDefaultPollWindow{300};

// The largest transfer a caller posts to UCX itself instead of queueing it
// for the channel's thread (Channel::Submit): up to the largest direct
// operation (direct_max_bytes), whose first messages leave from the
// engine's thread. Larger ones (a run's chunks) stay on the channel's
// thread, where the copy into the socket does not hold up a lane or the
// engine's loop. Measured in daemon/transport/README.md ("Posting from the
// caller's thread").
constexpr size_t kInlinePostMaxBytes = size_t{256} << 10;


// The longest an idle thread sleeps: UCX does periodic work (keepalive,
// timers) from ucp_worker_progress, so a sleeping worker wakes now and then.
constexpr int kSleepMs = 1000;
// Bound on the work the destructor waits for (forced endpoint closes,
// cancelled requests).
constexpr auto kShutdownGrace = std::chrono::seconds(2);
// Bound on Connect/Describe waiting for a channel thread.
constexpr auto kTaskWait = std::chrono::seconds(10);

uint64_t WireTag(int source_peer, uint64_t tag) {
  return (static_cast<uint64_t>(source_peer) << Transport::kTagBits) | (tag & kUserTagMask);
}

// The channels' own messages to each other (the farewell below), apart from
// every user tag: the wire tag's top bit (peer numbers stay below 2^15).
constexpr uint64_t kControlBit = uint64_t{1} << 63;
constexpr uint64_t kFarewell = 1;  // "I am closing: I need nothing more from you"
// Matches a control message from any peer.
constexpr uint64_t kControlMask = kControlBit;
uint64_t ControlTag(int source_peer, uint64_t kind) {
  return kControlBit | (static_cast<uint64_t>(source_peer) << Transport::kTagBits) | kind;
}
int ControlSource(uint64_t wire_tag) {
  return static_cast<int>((wire_tag & ~kControlBit) >> Transport::kTagBits);
}
// How long a closing channel waits for the farewells of the peers it sent
// to (a peer ending the job at the same time says it within milliseconds;
// one still running its part, stopped or gone does not).
constexpr auto kFarewellGrace = std::chrono::seconds(1);
// How often an idle channel with lingering endpoints looks at their grace.
constexpr int kLingerPollMs = 50;

std::string UcsError(ucs_status_t st) {
  return std::string(ucs_status_string(st)) + " (" + std::to_string(static_cast<int>(st)) + ")";
}

absl::Status Annotate(const absl::Status& s, const std::string& what) {
  return absl::Status(s.code(), std::string(s.message()) + " [" + what + "]");
}

}  // namespace

// ---------------------------------------------------------------------------

struct UcxTransport::Shared {
  // One context for every channel, or one per channel when each has its
  // own network device (Create's `devices`).
  std::vector<ucp_context_h> contexts;
  std::vector<std::string> devices;
  ucp_datatype_t reducer_dt = 0;  // kReducerOps; valid when has_reducer_dt
  bool has_reducer_dt = false;
  std::string tls;  // UCX_TLS as configured, for Describe

  std::atomic<bool> shutting_down{false};
  // Send/Recv/RecvReduce/FailPeer calls in progress (CallerScope). A call's
  // last lines (signalling the channel's thread) may run after the
  // transfer's callback, and that callback may be what lets the owner
  // destroy the transport: the destructor waits for this to fall to 0
  // before the channels go.
  std::atomic<int> callers{0};

  // Peer failure: sticky. `failed` lets the data path skip the mutex.
  mutable std::mutex mu;
  std::vector<absl::Status> peer_status ABSL_GUARDED_BY(mu);
  std::unique_ptr<std::atomic<bool>[]> failed;

  absl::Status PeerStatus(int peer) const {
    if (peer < 0 || !failed || !failed[peer].load(std::memory_order_acquire)) {
      return absl::OkStatus();
    }
    std::lock_guard<std::mutex> lock(mu);
    return peer_status[peer];
  }
};

enum class OpKind { kSend, kRecv };

namespace {

std::atomic<void (*)()> caller_tail_hook{nullptr};  // SetCallerTailHookForTesting

void RunCallerTailHook() {
  if (void (*hook)() = caller_tail_hook.load(std::memory_order_relaxed)) hook();
}

// Counts a caller in UcxTransport::Shared::callers for its scope.
class CallerScope {
 public:
  explicit CallerScope(std::atomic<int>& callers) : callers_(callers) { callers_.fetch_add(1); }
  ~CallerScope() { callers_.fetch_sub(1, std::memory_order_release); }
  CallerScope(const CallerScope&) = delete;
  CallerScope& operator=(const CallerScope&) = delete;

 private:
  std::atomic<int>& callers_;
};

}  // namespace

// One Send or Recv, from the call until its callback. Owned by the channel's
// queue, then by its in-flight list; touched only under its channel's
// work_mu_ once queued or posted.
struct UcxTransport::Op {
  OpKind kind;
  int peer;
  int channel;
  uint64_t tag;
  void* data;
  size_t bytes;
  TransferDone done;
  UcxTransport::Channel* owner = nullptr;  // the channel that runs it
  // RecvReduce: folds what arrives (the generic datatype below hands it the
  // fragments); null for Send and Recv.
  std::unique_ptr<FragmentReducer> reducer;

  absl::Status early;       // set: fail with this instead of posting
  absl::Status override;    // set: the reason it was cancelled
  void* request = nullptr;  // the ucp request while in flight
  bool posted = false;      // the nbx call has returned
  bool fired = false;       // the ucp callback ran
  bool abandoned = false;   // completed by the shutdown deadline, ucp still holds it
  bool timed = false;       // a send counted in its channel's load (ChannelLoads)
  ucs_status_t ucs = UCS_OK;
  size_t received = 0;
  std::list<Op*>::iterator pos;

  std::string What() const {
    char tag_hex[32];
    std::snprintf(tag_hex, sizeof(tag_hex), "0x%" PRIx64, tag);
    return std::string(kind == OpKind::kSend ? "send to"
                       : reducer != nullptr    ? "reducing recv from"
                                               : "recv from") +
           " peer " +
           std::to_string(peer) + " channel " + std::to_string(channel) + " tag " + tag_hex + ", " +
           std::to_string(bytes) + " bytes";
  }
};

namespace {

using Op = UcxTransport::Op;

// The ucp datatype of a reducing receive: a generic datatype whose unpack
// folds each fragment into the destination straight from UCX's receive
// buffer (FragmentReducer), instead of a contiguous receive into staging
// memory followed by a reduce over it. The receive's "buffer" is the
// FragmentReducer itself. Only ever used to receive: ciuic never sends with
// it, so packing reports nothing to pack.
void* ReducerStart(void* /*context*/, void* buffer, size_t /*count*/) { return buffer; }
void* ReducerStartPack(void* /*context*/, const void* /*buffer*/, size_t /*count*/) {
  return nullptr;
}
size_t ReducerPackedSize(void* state) {
  return state == nullptr ? 0 : static_cast<FragmentReducer*>(state)->bytes();
}
size_t ReducerPack(void* /*state*/, size_t /*offset*/, void* /*dest*/, size_t /*max_length*/) {
  return 0;
}
ucs_status_t ReducerUnpack(void* state, size_t offset, const void* src, size_t length) {
  return static_cast<FragmentReducer*>(state)->Consume(offset, src, length)
             ? UCS_OK
             : UCS_ERR_MESSAGE_TRUNCATED;
}
void ReducerFinish(void* /*state*/) {}

constexpr ucp_generic_dt_ops_t kReducerOps = {
    ReducerStartPack, ReducerStart, ReducerPackedSize, ReducerPack, ReducerUnpack, ReducerFinish,
};

struct EpContext {
  UcxTransport::Channel* channel;
  int peer;
};

}  // namespace

// ---------------------------------------------------------------------------
// A channel: one worker, its endpoints and its progress thread. Everything
// below "thread-owned" is touched only under work_mu_: by the thread in its
// rounds, or by a caller that posts a small transfer itself (Submit).

class UcxTransport::Channel {
 public:
  Channel(UcxTransport* owner, int index) : owner_(owner), index_(index) {}

  ~Channel() {
    if (thread_.joinable()) thread_.join();
  }

  absl::Status Init(ucp_context_h context) {
    ucp_worker_params_t wp{};
    wp.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
    // One thread at a time, under work_mu_: the channel's thread, or a
    // caller posting a small transfer itself (Submit).
    wp.thread_mode = UCS_THREAD_MODE_SERIALIZED;
    ucs_status_t st = ucp_worker_create(context, &wp, &worker_);
    if (st != UCS_OK) {
      return absl::InternalError("ucp_worker_create for channel " + std::to_string(index_) + ": " +
                                 UcsError(st));
    }
    st = ucp_worker_get_efd(worker_, &efd_);
    if (st != UCS_OK) {
      return absl::InternalError("ucp_worker_get_efd: " + UcsError(st));
    }
    ucp_address_t* addr = nullptr;
    size_t len = 0;
    st = ucp_worker_get_address(worker_, &addr, &len);
    if (st != UCS_OK) {
      return absl::InternalError("ucp_worker_get_address: " + UcsError(st));
    }
    address_.assign(reinterpret_cast<const char*>(addr), len);
    ucp_worker_release_address(worker_, addr);
    return absl::OkStatus();
  }

  // The worker was created on the caller's thread; from here on it belongs
  // to the progress thread (thread start orders the two).
  void Start() {
    thread_ = std::thread([this] { Run(); });
  }

  // Destroys a worker whose thread never started (Create failed half way).
  void DestroyUnstarted() {
    if (worker_ != nullptr && !thread_.joinable()) {
      ucp_worker_destroy(worker_);
      worker_ = nullptr;
    }
  }

  const std::string& address() const { return address_; }

  // Any thread. A transfer of at most kInlinePostMaxBytes is posted to
  // UCX by the caller itself when the worker is free (its thread between
  // rounds, or asleep) and nothing queued is waiting: the caller saves the
  // hand-off to the channel's thread and its wake-up. Its callback still
  // runs on the channel's thread (deferred_). Anything else is queued.
  void Submit(std::unique_ptr<Op> op) {
    if (op->bytes <= kInlinePostMaxBytes && std::this_thread::get_id() != thread_.get_id() &&
        pending_.load() == 0 && work_mu_.try_lock()) {
      std::unique_lock<std::mutex> lock(work_mu_, std::adopt_lock);
      // Re-checked under the lock: a producer's queued op goes first (one
      // thread's transfers reach UCX in the order it made them), and a
      // worker that shut down is gone.
      if (worker_ != nullptr && !stop_.load() && pending_.load() == 0) {
        posting_inline_ = true;
        Post(std::move(op));
        posting_inline_ = false;
        lock.unlock();
        RunCallerTailHook();
        // seq_cst, paired with sleeping_ in Run as Wake's: either the thread
        // sees the post before it sleeps, or it is signalled.
        inline_posts_.fetch_add(1);
        if (sleeping_.load()) Signal();
        return;
      }
    }
    Enqueue(std::move(op));
  }

  // Any thread.
  void Enqueue(std::unique_ptr<Op> op) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      ops_.push_back(op.release());
    }
    RunCallerTailHook();
    Wake();
  }

  // Runs `task` on the thread. Any thread.
  void RunOnThread(std::function<void()> task) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      tasks_.push_back(std::move(task));
    }
    Wake();
  }

  void Stop() {
    stop_.store(true);
    pending_.fetch_add(1);
    // The thread may see stop_ and destroy the worker before this line.
    Signal();
  }

  void Join() {
    if (thread_.joinable()) thread_.join();
  }

  // --- thread-owned, called from tasks ---

  absl::Status ConnectOnThread(const std::vector<std::vector<std::string>>& addresses) {
    eps_.assign(addresses.size(), nullptr);
    ep_failed_.assign(addresses.size(), absl::OkStatus());
    ep_contexts_.resize(addresses.size());
    for (size_t peer = 0; peer < addresses.size(); ++peer) {
      const std::string& addr = addresses[peer][index_];
      ep_contexts_[peer] = std::make_unique<EpContext>(EpContext{this, static_cast<int>(peer)});
      ucp_ep_params_t ep{};
      ep.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                      UCP_EP_PARAM_FIELD_ERR_HANDLER;
      ep.address = reinterpret_cast<const ucp_address_t*>(addr.data());
      // Peer error handling makes UCX 1.13 leave out the transports that
      // cannot report a dead peer: self, cma, and shared memory unless
      // UCX_MM_ERROR_HANDLING=y. This process cannot die apart from itself,
      // so the loopback endpoint goes without and gets the self transport.
      ep.err_mode = peer == static_cast<size_t>(owner_->self_) ? UCP_ERR_HANDLING_MODE_NONE
                                                               : UCP_ERR_HANDLING_MODE_PEER;
      ep.err_handler.cb = &Channel::OnEpError;
      ep.err_handler.arg = ep_contexts_[peer].get();
      ucs_status_t st = ucp_ep_create(worker_, &ep, &eps_[peer]);
      if (st != UCS_OK) {
        eps_[peer] = nullptr;
        return absl::UnavailableError("ucp_ep_create to peer " + std::to_string(peer) +
                                      " channel " + std::to_string(index_) + ": " + UcsError(st));
      }
    }
    sent_to_.assign(addresses.size(), false);
    talked_.assign(addresses.size(), false);
    departed_.assign(addresses.size(), false);
    farewell_sent_.assign(addresses.size(), false);
    lingering_.assign(addresses.size(), false);
    linger_until_.assign(addresses.size(), Clock::time_point());
    control_open_ = true;
    PostControlRecv();
    ServiceControl();
    return absl::OkStatus();
  }

  // Cancels the pending work with `peer` and closes its endpoint. With
  // nothing in flight to it (a job closing after its last operation ended:
  // ClusterJob fails every peer as it closes), the peer may still be reading
  // what this channel sent: it gets a farewell, and the endpoint lingers
  // until the peer's own farewell or the grace (ServiceLingering), as at
  // Shutdown. With transfers in flight they are cut off, and the endpoint
  // is force-closed at once.
  void FailPeerOnThread(int peer) {
    absl::Status why = owner_->shared_->PeerStatus(peer);
    const bool busy = BusyWith(peer);
    // (Before Connect there is no endpoint, and nothing to say farewell on.)
    if (!busy && static_cast<size_t>(peer) < eps_.size() && BidFarewell(peer)) {
      if (!lingering_[peer]) ++lingering_count_;
      lingering_[peer] = true;
      linger_until_[peer] = Clock::now() + kFarewellGrace;
      return;
    }
    CutOff(peer, why);
  }

  std::string DescribeOnThread() {
    std::string out;
    for (size_t peer = 0; peer < eps_.size(); ++peer) {
      out += "channel " + std::to_string(index_) + " peer " + std::to_string(peer) + ": ";
      if (eps_[peer] == nullptr) {
        absl::Status s = owner_->shared_->PeerStatus(static_cast<int>(peer));
        out += s.ok() ? "no endpoint" : "failed (" + std::string(s.message()) + ")";
      } else {
        out += EndpointTransports(eps_[peer]);
      }
      out += "\n";
    }
    return out;
  }

 private:
  void Wake() {
    pending_.fetch_add(1);  // seq_cst: pairs with sleeping_ below
    if (sleeping_.load()) Signal();
  }

  // ucp_worker_signal from any thread, never on a destroyed worker: the
  // thread destroys it (Shutdown) under signal_mu_ as soon as it sees stop_.
  void Signal() {
    std::lock_guard<std::mutex> lock(signal_mu_);
    if (worker_ != nullptr) ucp_worker_signal(worker_);
  }

  void Run() {
    std::string name = "ciuic-ucx" + std::to_string(index_);
    pthread_setname_np(pthread_self(), name.c_str());
    IdlePolicy idle(UcxTransport::PollWindow());
    while (true) {
      bool worked = inline_posts_.exchange(0) != 0;
      unsigned progressed = 0;
      {
        // The round owns the worker; callers post between rounds (Submit).
        std::lock_guard<std::mutex> lock(work_mu_);
        worked = RunDeferred() || worked;
        // Nothing queued: no queue lock (the thread comes here every round
        // while it polls, and producers take the same mutex). What a
        // producer queues and counts (Wake) after this load is drained on
        // the next round.
        worked = (pending_.load() != 0 && DrainQueue()) || worked;
        if (stop_.load()) {
          Shutdown();
          return;
        }
        while (progressed < 64 && ucp_worker_progress(worker_) != 0) ++progressed;
        worked = ServiceControl() || worked;
        ServiceLingering();
        ReapCloseRequests();
      }
      if (worked || progressed != 0) {
        idle.Worked(Clock::now());
        continue;
      }
      if (idle.KeepPolling(Clock::now())) {
        std::this_thread::yield();  // a core shared with the other side's thread
        continue;
      }
      // Idle: arm the worker and sleep on its fd. A producer that saw
      // sleeping_ == false queued before our pending_ check below; one that
      // saw true signals the worker, which either makes arm() busy or wakes
      // the poll.
      sleeping_.store(true);
      if (pending_.load() != 0 || inline_posts_.load() != 0) {
        sleeping_.store(false);
        continue;
      }
      ucs_status_t st;
      {
        std::lock_guard<std::mutex> lock(work_mu_);
        st = ucp_worker_arm(worker_);
      }
      if (st == UCS_OK) {
        pollfd pfd{efd_, POLLIN, 0};
        poll(&pfd, 1, lingering_count_ > 0 ? kLingerPollMs : kSleepMs);
      } else if (st != UCS_ERR_BUSY) {
        spdlog::error("ucx channel {}: ucp_worker_arm: {}", index_, UcsError(st));
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
      }
      sleeping_.store(false);
    }
  }

  // Runs the callbacks of transfers that a caller posted and that ended
  // inside its nbx call. Returns whether there were any.
  bool RunDeferred() {
    if (deferred_.empty()) return false;
    std::vector<std::function<void()>> calls;
    calls.swap(deferred_);
    for (auto& call : calls) call();
    return true;
  }

  // Runs queued tasks and posts queued ops. Returns whether there were any.
  bool DrainQueue() {
    std::vector<std::function<void()>> tasks;
    std::vector<Op*> ops;
    {
      std::lock_guard<std::mutex> lock(mu_);
      tasks.swap(tasks_);
      ops.swap(ops_);
      pending_.store(0);
    }
    for (auto& t : tasks) t();
    for (Op* op : ops) Post(std::unique_ptr<Op>(op));
    return !tasks.empty() || !ops.empty();
  }

  void Post(std::unique_ptr<Op> owned) {
    Op* op = owned.get();
    const Shared& shared = *owner_->shared_;
    if (!op->early.ok()) return Finish(std::move(owned), op->early);
    if (shared.shutting_down.load()) {
      return Finish(std::move(owned), absl::UnavailableError("transport shut down"));
    }
    if (absl::Status s = shared.PeerStatus(op->peer); !s.ok()) {
      return Finish(std::move(owned), s);
    }
    if (static_cast<size_t>(op->peer) < ep_failed_.size() && !ep_failed_[op->peer].ok() &&
        !(op->kind == OpKind::kRecv && ArrivedBeforeFarewell(op->peer, op->tag))) {
      return Finish(std::move(owned), ep_failed_[op->peer]);
    }
    if (static_cast<size_t>(op->peer) < talked_.size()) talked_[op->peer] = true;
    ucp_request_param_t param{};
    param.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
    param.user_data = op;
    // A zero-byte transfer still needs a valid pointer for some transports.
    static char empty;
    void* buffer = op->bytes == 0 ? &empty : op->data;
    in_flight_.push_back(owned.release());
    op->pos = std::prev(in_flight_.end());
    ucs_status_ptr_t ptr;
    if (op->kind == OpKind::kSend) {
      ucp_ep_h ep = static_cast<size_t>(op->peer) < eps_.size() ? eps_[op->peer] : nullptr;
      if (ep == nullptr) {
        in_flight_.erase(op->pos);
        return Finish(std::unique_ptr<Op>(op),
                      absl::FailedPreconditionError("transport not connected to peer"));
      }
      param.cb.send = &Channel::OnSendDone;
      sent_to_[op->peer] = true;
      op->timed = true;
      if (sends_in_flight_++ == 0) busy_since_ = std::chrono::steady_clock::now();
      ptr = ucp_tag_send_nbx(ep, buffer, op->bytes, WireTag(owner_->self_, op->tag), &param);
    } else {
      // No immediate completion: the length then always comes through the
      // callback (UCX 1.13 reported length 0 in param.recv_info for some
      // completions that happened inside the call).
      param.op_attr_mask |= UCP_OP_ATTR_FLAG_NO_IMM_CMPL;
      param.cb.recv = &Channel::OnRecvDone;
      size_t count = op->bytes;
      if (op->reducer != nullptr) {
        param.op_attr_mask |= UCP_OP_ATTR_FIELD_DATATYPE;
        param.datatype = shared.reducer_dt;
        buffer = op->reducer.get();
        count = 1;  // the size is the reducer's (packed_size)
      }
      ptr = ucp_tag_recv_nbx(worker_, buffer, count, WireTag(op->peer, op->tag), ~uint64_t{0},
                             &param);
    }
    op->posted = true;
    if (ptr == nullptr) {
      // A send completed at once; ucp does not call the callback.
      op->ucs = UCS_OK;
      op->received = op->bytes;
      return Complete(op);
    }
    if (UCS_PTR_IS_ERR(ptr)) {
      op->ucs = UCS_PTR_STATUS(ptr);
      return Complete(op);
    }
    op->request = ptr;
    if (op->fired) Complete(op);  // the callback ran inside the nbx call
  }

  static void OnSendDone(void* request, ucs_status_t status, void* user_data) {
    auto* op = static_cast<Op*>(user_data);
    op->fired = true;
    op->ucs = status;
    op->received = op->bytes;
    if (op->posted) op->owner->Complete(op);  // else Post() completes it
  }

  static void OnRecvDone(void* request, ucs_status_t status, const ucp_tag_recv_info_t* info,
                         void* user_data) {
    auto* op = static_cast<Op*>(user_data);
    op->fired = true;
    op->ucs = status;
    op->received = status == UCS_OK && info != nullptr ? info->length : 0;
    if (op->posted) op->owner->Complete(op);  // else Post() completes it
  }

  static void OnEpError(void* arg, ucp_ep_h ep, ucs_status_t status) {
    auto* ctx = static_cast<EpContext*>(arg);
    Channel* self = ctx->channel;
    const int peer = ctx->peer;
    const bool known = static_cast<size_t>(peer) < self->ep_failed_.size();
    if (self->owner_->shared_->shutting_down.load()) {
      // Shutdown closes every endpoint; its farewell stops waiting for this one.
      if (known && self->ep_failed_[peer].ok()) {
        self->ep_failed_[peer] = absl::UnavailableError(ucs_status_string(status));
      }
      return;
    }
    if (known && self->departed_[peer]) {
      // The peer said farewell on this channel: it has ended its part of the
      // job, and closes once this side says farewell too or after its
      // grace, so what it sent here has long arrived. A receive still
      // waiting is for something it never sent; what arrived stays
      // receivable (ArrivedBeforeFarewell).
      spdlog::info("ucx channel {}: peer {} closed its endpoint after its farewell", self->index_,
                   peer);
      absl::Status gone = absl::UnavailableError(
          "lost peer " + std::to_string(peer) +
          ": it ended its part of the job and closed its endpoint (channel " +
          std::to_string(self->index_) + ")");
      if (self->ep_failed_[peer].ok()) self->ep_failed_[peer] = gone;
      self->RunOnThread([self, peer, gone] { self->CutOff(peer, gone); });
      return;
    }
    // With transfers in flight the loss cuts them off: a warning. With none,
    // the peer has most likely ended its job and closed its endpoints before
    // the control plane told us; that plane says whether it was a failure.
    const bool cut_off = self->BusyWith(peer);
    spdlog::log(cut_off ? spdlog::level::warn : spdlog::level::info,
                "ucx channel {}: endpoint to peer {} failed: {}{}", self->index_, peer,
                UcsError(status), cut_off ? "" : " (nothing in flight)");
    absl::Status lost = absl::UnavailableError("lost peer " + std::to_string(peer) + ": " +
                                               ucs_status_string(status) + " (channel " +
                                               std::to_string(self->index_) + ")");
    if (cut_off) {
      self->owner_->MarkPeerFailed(peer, std::move(lost), /*warn=*/true);
      return;
    }
    // Nothing in flight here: only this channel's endpoint is failed. A
    // peer that ends its job closes each channel's endpoint once its sends
    // there are flushed; an idle channel's close can reach us before the
    // last data on a busy one, and failing the whole peer would cancel that
    // receive (the job's last run would then fail here although the peer
    // sent everything). A peer that is really gone fails the busy channels'
    // endpoints too; later transfers on this channel fail at once.
    if (static_cast<size_t>(peer) < self->ep_failed_.size() && self->ep_failed_[peer].ok()) {
      self->ep_failed_[peer] = std::move(lost);
    }
    // Not inside UCX's callback: the close runs as a task on this thread.
    self->RunOnThread([self, peer] { self->ClosePeerEndpoint(peer); });
  }

  // The op's ucp part is over: free the request and run the callback.
  void Complete(Op* op) {
    // Its callback already ran (its peer was cut off, or the shutdown
    // deadline passed); Shutdown gives its request back.
    if (op->abandoned) return;
    in_flight_.erase(op->pos);
    if (op->request != nullptr) ucp_request_free(op->request);
    op->request = nullptr;
    std::unique_ptr<Op> owned(op);
    absl::Status result = ResultOf(*op);
    if (op->timed) EndTimedSend(result.ok(), op->bytes);
    Finish(std::move(owned), result);
  }

  // A timed send's end: its bytes count if it succeeded; the busy time
  // ends with the last one in flight.
  void EndTimedSend(bool ok, size_t bytes) {
    if (ok) sent_bytes_.fetch_add(bytes, std::memory_order_relaxed);
    if (--sends_in_flight_ == 0) {
      busy_ns_.fetch_add(std::chrono::duration_cast<std::chrono::nanoseconds>(
                             std::chrono::steady_clock::now() - busy_since_)
                             .count(),
                         std::memory_order_relaxed);
    }
  }

  absl::Status ResultOf(const Op& op) {
    const Shared& shared = *owner_->shared_;
    if (!op.override.ok()) return op.override;
    if (op.ucs == UCS_OK) {
      if (op.kind == OpKind::kRecv && op.reducer != nullptr && !op.reducer->complete()) {
        return absl::InvalidArgumentError("size mismatch: received " +
                                          std::to_string(op.reducer->consumed()) + " of " +
                                          std::to_string(op.bytes) + " bytes");
      }
      if (op.kind == OpKind::kRecv && op.received != op.bytes) {
        return absl::InvalidArgumentError("size mismatch: received " + std::to_string(op.received) +
                                          " bytes");
      }
      return absl::OkStatus();
    }
    if (op.ucs == UCS_ERR_MESSAGE_TRUNCATED) {
      return absl::InvalidArgumentError(
          "message truncated: the message is larger than the Recv buffer");
    }
    if (op.ucs == UCS_ERR_CANCELED && shared.shutting_down.load()) {
      return absl::UnavailableError("transport shut down");
    }
    if (absl::Status s = shared.PeerStatus(op.peer); !s.ok()) return s;
    if (op.kind == OpKind::kSend) {
      // A send fails only when the connection does: the peer is lost.
      absl::Status lost = absl::UnavailableError("lost peer " + std::to_string(op.peer) + ": " +
                                                 ucs_status_string(op.ucs) + " (channel " +
                                                 std::to_string(index_) + ")");
      owner_->MarkPeerFailed(op.peer, lost, /*warn=*/true);
      return shared.PeerStatus(op.peer);
    }
    return absl::InternalError("UCX error: " + UcsError(op.ucs));
  }

  // Runs the callback (exactly once per op) on this thread: a caller
  // posting inline leaves it to the thread's next round, so that no
  // callback runs inside Send or Recv (transport.h).
  void Finish(std::unique_ptr<Op> op, const absl::Status& status) {
    TransferDone done = std::move(op->done);
    absl::Status result = status.ok() ? status : Annotate(status, op->What());
    op.reset();
    Call(std::move(done), std::move(result));
  }

  void Call(TransferDone done, absl::Status result) {
    if (!done) return;
    if (posting_inline_) {
      deferred_.push_back([done = std::move(done), result = std::move(result)]() mutable {
        done(std::move(result));
      });
      return;
    }
    done(std::move(result));
  }

  // Gives every in-flight op matching `pred` the reason `why` and cancels
  // it: recvs through ucp_request_cancel (completes them now), sends through
  // the forced close of their endpoint that the caller does next.
  template <typename Pred>
  void CancelInFlight(Pred pred, const absl::Status& why) {
    std::vector<Op*> victims;
    for (Op* op : in_flight_) {
      if (!op->abandoned && pred(*op)) victims.push_back(op);
    }
    for (Op* op : victims) {
      if (op->override.ok()) op->override = why;
    }
    for (Op* op : victims) {
      if (op->kind == OpKind::kRecv && op->request != nullptr) {
        ucp_request_cancel(worker_, op->request);  // may complete (and delete) op
      }
    }
  }

  // With transfers to the peer still in flight (a failure cuts them off),
  // the endpoint closes at once (forced). With none, it is flushed first:
  // a send that completed here may still sit in UCX's buffer for the
  // socket (an eager message is complete once copied), and a forced close
  // would drop it, so that a peer still finishing the job's last run
  // (while this node's rank has left) would lose it.
  void ClosePeerEndpoint(int peer) {
    if (static_cast<size_t>(peer) >= eps_.size() || eps_[peer] == nullptr) return;
    ucp_ep_h ep = eps_[peer];
    eps_[peer] = nullptr;
    const bool busy = BusyWith(peer);
    ucp_request_param_t param{};
    param.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    param.flags = busy ? UCP_EP_CLOSE_FLAG_FORCE : 0;
    ucs_status_ptr_t req = ucp_ep_close_nbx(ep, &param);
    if (req != nullptr && !UCS_PTR_IS_ERR(req)) close_requests_.push_back(req);
  }

  // Ends everything this channel has in flight with `peer`, now: receives
  // not yet matched are cancelled, the endpoint closes (forced), and what
  // UCX still holds after that gets its callback with `why` at once. That
  // is a receive UCX has matched and partly filled when its sender stopped
  // mid-message: ucp_request_cancel cannot cancel it, and the forced close
  // does not complete it (openucx/ucx#10873, #11154), so that it would end
  // only when the stopped peer runs again (never, if it does not), holding
  // its operation meanwhile. Such an op is abandoned: it stays in
  // in_flight_ with its request, which Shutdown gives back to UCX before
  // the worker goes. UCX may still write the rest of the message into its
  // buffer if the peer runs again before that (the data arrives on the
  // peer's own socket, which the close of our endpoint leaves to the
  // interface): so the op keeps its callback, and with it whatever the
  // callback holds (a direct exchange keeps its buffers so), until the
  // worker is destroyed; the callback is called through a copy.
  void CutOff(int peer, const absl::Status& why) {
    CancelInFlight([peer](const Op& op) { return op.peer == peer; }, why);
    ClosePeerEndpoint(peer);
    // The forced close and the cancellations complete most requests on the
    // worker's next rounds (their callbacks then end the ops as usual);
    // only what UCX still holds after them is abandoned. From a task, not
    // from inside a progress call.
    for (int round = 0; round < 64 && ucp_worker_progress(worker_) != 0; ++round) {
    }
    std::vector<Op*> stuck;
    for (Op* op : in_flight_) {
      if (op->peer == peer && !op->abandoned) stuck.push_back(op);
    }
    for (Op* op : stuck) {
      op->abandoned = true;
      if (op->timed) EndTimedSend(/*ok=*/false, op->bytes);
      TransferDone done = op->done;
      Call(std::move(done), Annotate(op->override.ok() ? why : op->override, op->What()));
    }
    if (!stuck.empty()) {
      spdlog::info("ucx channel {}: {} transfer(s) with peer {} cut off in UCX's hands (first: {})",
                   index_, stuck.size(), peer, stuck.front()->What());
    }
  }

  // --- the farewell ---
  //
  // An eager send is complete here once UCX has copied it, and over TCP one
  // endpoint pair may use several sockets (lanes): a peer can see this
  // side's endpoint close on one socket before it has read the data sent on
  // another, and its endpoint then fails with "Endpoint timeout", taking
  // that data with it. An acknowledgement sent on reading a farewell does
  // not help (it may overtake data on another lane). What does
  // is knowing that the peer needs nothing more: a closing channel tells
  // every peer it exchanged anything with (kFarewell: "I need nothing more
  // from you") and, before closing, waits at most kFarewellGrace for the
  // same word from each peer it sent to. Nodes that end a job together
  // close within milliseconds; one that ends first lingers until the other
  // ends too, or for the grace. A peer whose endpoint fails after its
  // farewell fails only what still waits on that channel, and keeps what
  // arrived receivable (ArrivedBeforeFarewell).

  // Says farewell to the peers and waits for theirs, at most the grace.
  // Peers with transfers in flight are left out: their endpoints are
  // force-closed (their transfers are cut off anyway). So are failed peers,
  // apart from those whose endpoint lingers (FailPeerOnThread).
  void SayFarewell() {
    const Shared& shared = *owner_->shared_;
    std::vector<int> waiting;
    for (size_t p = 0; p < eps_.size(); ++p) {
      const int peer = static_cast<int>(p);
      if (peer == owner_->self_ || (!lingering_[p] && !shared.PeerStatus(peer).ok()) ||
          BusyWith(peer)) {
        continue;
      }
      if (BidFarewell(peer)) waiting.push_back(peer);
    }
    const auto deadline = Clock::now() + kFarewellGrace;
    while (!waiting.empty() && Clock::now() < deadline) {
      DrainQueue();
      const bool progressed = ucp_worker_progress(worker_) != 0;
      ServiceControl();
      ReapCloseRequests();
      std::erase_if(waiting, [&](int peer) {
        return departed_[peer] || !ep_failed_[peer].ok() || eps_[peer] == nullptr ||
               (!lingering_[peer] && !shared.PeerStatus(peer).ok());
      });
      if (!progressed) std::this_thread::yield();
    }
    if (!waiting.empty()) {
      spdlog::info("ucx channel {}: {} peer(s) still running after {} ms (first: peer {}); "
                   "closing anyway",
                   index_, waiting.size(),
                   std::chrono::duration_cast<std::chrono::milliseconds>(kFarewellGrace).count(),
                   waiting.front());
    }
  }

  // Says farewell to `peer` (once) if this channel exchanged anything with
  // it and its endpoint is sound. Returns whether the peer's own farewell
  // is still to come (this channel sent it something: it may still be
  // reading that).
  bool BidFarewell(int peer) {
    if (!talked_[peer] || eps_[peer] == nullptr || !ep_failed_[peer].ok()) return false;
    if (!farewell_sent_[peer]) {
      if (!SendControl(peer, kFarewell)) return false;
      farewell_sent_[peer] = true;
    }
    return sent_to_[peer] && !departed_[peer];
  }

  bool BusyWith(int peer) const {
    return std::any_of(in_flight_.begin(), in_flight_.end(),
                       [peer](const Op* op) { return op->peer == peer && !op->abandoned; });
  }

  // Closes the lingering endpoints whose peer has said farewell, failed, or
  // outlasted the grace.
  void ServiceLingering() {
    if (lingering_count_ == 0) return;
    const auto now = Clock::now();
    for (size_t p = 0; p < lingering_.size(); ++p) {
      if (!lingering_[p]) continue;
      if (eps_[p] != nullptr && !departed_[p] && ep_failed_[p].ok() && now < linger_until_[p]) {
        continue;
      }
      lingering_[p] = false;
      --lingering_count_;
      ClosePeerEndpoint(static_cast<int>(p));
    }
  }

  // A 0-byte control message to `peer`; false if it cannot go.
  bool SendControl(int peer, uint64_t kind) {
    if (static_cast<size_t>(peer) >= eps_.size() || eps_[peer] == nullptr ||
        !ep_failed_[peer].ok()) {
      return false;
    }
    static char empty;
    ucp_request_param_t param{};
    ucs_status_ptr_t ptr =
        ucp_tag_send_nbx(eps_[peer], &empty, 0, ControlTag(owner_->self_, kind), &param);
    if (UCS_PTR_IS_ERR(ptr)) return false;
    if (ptr != nullptr) close_requests_.push_back(ptr);  // freed once complete
    return true;
  }

  // The standing receive for control messages from any peer.
  void PostControlRecv() {
    ucp_request_param_t param{};
    param.op_attr_mask =
        UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FLAG_NO_IMM_CMPL;
    param.cb.recv = &Channel::OnControlRecv;
    param.user_data = this;
    control_fired_ = false;
    ucs_status_ptr_t ptr = ucp_tag_recv_nbx(worker_, &control_buf_, sizeof(control_buf_),
                                            kControlBit, kControlMask, &param);
    if (UCS_PTR_IS_ERR(ptr)) {
      spdlog::error("ucx channel {}: cannot receive control messages: {}", index_,
                    UcsError(UCS_PTR_STATUS(ptr)));
      control_open_ = false;
      return;
    }
    control_req_ = ptr;
  }

  static void OnControlRecv(void* /*request*/, ucs_status_t status, const ucp_tag_recv_info_t* info,
                            void* user_data) {
    auto* self = static_cast<Channel*>(user_data);
    self->control_fired_ = true;
    self->control_status_ = status;
    self->control_tag_ = status == UCS_OK && info != nullptr ? info->sender_tag : 0;
    // Taken note of at once: an endpoint error for this peer may come in
    // the same ucp_worker_progress call, before ServiceControl runs.
    if (status == UCS_OK) self->NoteControl(self->control_tag_);
  }

  void NoteControl(uint64_t wire_tag) {
    const int peer = ControlSource(wire_tag);
    const uint64_t kind = wire_tag & kUserTagMask;
    if (peer != owner_->self_ && static_cast<size_t>(peer) < departed_.size() &&
        kind == kFarewell) {
      departed_[peer] = true;
    }
  }

  // Handles a control message that arrived and posts the next receive.
  // Returns whether one did.
  bool ServiceControl() {
    bool any = false;
    while (control_req_ != nullptr && control_fired_) {
      ucp_request_free(control_req_);
      control_req_ = nullptr;
      any = true;
      if (control_status_ != UCS_OK && control_status_ != UCS_ERR_CANCELED) {
        spdlog::warn("ucx channel {}: control message: {}", index_, UcsError(control_status_));
      }
      if (control_open_) PostControlRecv();
    }
    return any;
  }

  void CloseControlRecv() {
    control_open_ = false;
    if (control_req_ == nullptr) return;
    if (!control_fired_) ucp_request_cancel(worker_, control_req_);  // completes it now
    ServiceControl();
    if (control_req_ != nullptr) {  // not completed by the cancel: released anyway
      ucp_request_free(control_req_);
      control_req_ = nullptr;
    }
  }

  // Whether a message from `peer` with `tag` has arrived unreceived, for a
  // peer that said farewell here and whose endpoint has since failed.
  bool ArrivedBeforeFarewell(int peer, uint64_t tag) {
    if (!departed_[peer]) return false;
    ucp_tag_recv_info_t info{};
    return ucp_tag_probe_nb(worker_, WireTag(peer, tag), ~uint64_t{0}, 0, &info) != nullptr;
  }

  void ReapCloseRequests() {
    if (close_requests_.empty()) return;
    std::erase_if(close_requests_, [](void* req) {
      if (ucp_request_check_status(req) == UCS_INPROGRESS) return false;
      ucp_request_free(req);
      return true;
    });
  }

  void Shutdown() {
    const absl::Status down = absl::UnavailableError("transport shut down");
    DrainQueue();  // ops fail (shutting_down is set), tasks run
    SayFarewell();
    CloseControlRecv();
    CancelInFlight([](const Op&) { return true; }, down);
    for (size_t peer = 0; peer < eps_.size(); ++peer) ClosePeerEndpoint(static_cast<int>(peer));
    const auto deadline = Clock::now() + kShutdownGrace;
    const auto unfinished = [this] {
      return std::any_of(in_flight_.begin(), in_flight_.end(),
                         [](const Op* op) { return !op->abandoned; });
    };
    while ((unfinished() || !close_requests_.empty()) && Clock::now() < deadline) {
      DrainQueue();  // callbacks may have queued more: they fail at once
      ucp_worker_progress(worker_);
      ReapCloseRequests();
    }
    DrainQueue();
    // Whatever UCX did not finish in time still gets its one callback; the
    // op stays allocated until the worker (which may still call back) is gone.
    // (Those cut off with their peer had theirs already.)
    std::vector<Op*> abandoned(in_flight_.begin(), in_flight_.end());
    size_t unanswered = 0;
    for (Op* op : abandoned) {
      if (op->abandoned) continue;
      ++unanswered;
      TransferDone done = std::move(op->done);
      op->abandoned = true;
      if (done) done(Annotate(down, op->What()));
    }
    if (unanswered != 0 || !close_requests_.empty()) {
      spdlog::warn("ucx channel {}: {} transfers and {} endpoint closes unfinished at shutdown",
                   index_, unanswered, close_requests_.size());
    }
    // Every request still in progress (a peer that is stopped or gone never
    // acknowledges a flush or a transfer) goes back to UCX before the worker
    // is destroyed: ucp_request_free releases it whatever its state, and no
    // callback comes for it after. Destroying a worker whose endpoints
    // still hold unreleased requests trips UCX's assertion in
    // ucp_ep_destroy_base and aborts the whole daemon.
    for (Op* op : abandoned) {
      if (op->request != nullptr) ucp_request_free(op->request);
      op->request = nullptr;
    }
    for (void* req : close_requests_) ucp_request_free(req);
    close_requests_.clear();
    {
      // Not mu_: callbacks made during the destruction may Enqueue.
      std::lock_guard<std::mutex> lock(signal_mu_);
      ucp_worker_destroy(worker_);
      worker_ = nullptr;
    }
    for (Op* op : abandoned) delete op;
    in_flight_.clear();
    // Anything queued after the last drain (a callback of the above).
    std::vector<Op*> late;
    {
      std::lock_guard<std::mutex> lock(mu_);
      late.swap(ops_);
    }
    for (Op* op : late) Finish(std::unique_ptr<Op>(op), down);
  }

  static std::string EndpointTransports(ucp_ep_h ep) {
    char* buf = nullptr;
    size_t len = 0;
    FILE* f = open_memstream(&buf, &len);
    if (f == nullptr) return "?";
    ucp_ep_print_info(ep, f);
    std::fclose(f);
    std::string text(buf, len);
    std::free(buf);
    // Lines look like "#   lane[0]:  8:tcp/lo.0 md[4] ..."; keep "tcp/lo".
    std::set<std::string> tls;
    std::istringstream in(text);
    std::string line;
    while (std::getline(in, line)) {
      auto lane = line.find("lane[");
      if (lane == std::string::npos) continue;
      auto colon = line.find(':', lane);
      if (colon == std::string::npos) continue;
      std::istringstream rest(line.substr(colon + 1));
      std::string word;
      rest >> word;  // "8:tcp/lo.0"
      auto c = word.find(':');
      if (c != std::string::npos) word = word.substr(c + 1);
      auto dot = word.rfind('.');
      if (dot != std::string::npos) word = word.substr(0, dot);
      if (!word.empty()) tls.insert(word);
    }
    std::string out;
    for (const auto& t : tls) out += (out.empty() ? "" : ",") + t;
    return out.empty() ? "(no lanes)" : out;
  }

  UcxTransport* const owner_;
  const int index_;
  // Written by the thread only (Shutdown, under signal_mu_); other threads
  // read it only in Signal.
  ucp_worker_h worker_ = nullptr;
  std::mutex signal_mu_;
  int efd_ = -1;
  std::string address_;
  std::thread thread_;

  std::atomic<bool> stop_{false};
  std::atomic<bool> sleeping_{false};
  std::atomic<uint64_t> pending_{0};  // work queued since the last drain
  std::atomic<uint64_t> inline_posts_{0};  // transfers callers posted since the last round
  // Whoever touches the worker, its endpoints, its requests or anything
  // below "thread-owned" holds it: the thread for each round of its loop
  // (and its shutdown), a caller for one inline post (Submit).
  std::mutex work_mu_;
  bool posting_inline_ = false;                  // under work_mu_
  std::vector<std::function<void()>> deferred_;  // under work_mu_
  std::mutex mu_;
  std::vector<std::function<void()>> tasks_ ABSL_GUARDED_BY(mu_);
  std::vector<Op*> ops_ ABSL_GUARDED_BY(mu_);  // owned

  // Thread-owned.
  std::vector<ucp_ep_h> eps_;
  // Per peer: why this channel's endpoint failed while nothing was in
  // flight on it (the peer as a whole is not failed then; see OnEpError).
  std::vector<absl::Status> ep_failed_;
  std::vector<std::unique_ptr<EpContext>> ep_contexts_;
  std::list<Op*> in_flight_;  // owned
  // Endpoint closes and control sends still in progress.
  std::vector<void*> close_requests_;
  // Per peer: this channel sent it something (its farewell is awaited);
  // sent it or received from it something (it gets a farewell); it said
  // farewell here.
  std::vector<bool> sent_to_, talked_, departed_;
  // Per peer: this channel said farewell to it; its endpoint lingers after
  // the peer was failed with nothing in flight (FailPeerOnThread), until
  // linger_until_ at the latest.
  std::vector<bool> farewell_sent_, lingering_;
  std::vector<Clock::time_point> linger_until_;
  int lingering_count_ = 0;
  // The standing control receive (written by its callback, on this thread).
  bool control_open_ = false;
  void* control_req_ = nullptr;
  bool control_fired_ = false;
  ucs_status_t control_status_ = UCS_OK;
  uint64_t control_tag_ = 0;
  uint64_t control_buf_ = 0;
  // The channel's load (ChannelLoads): sends in flight and since when
  // (thread-owned), and the totals other threads read.
  int sends_in_flight_ = 0;
  Clock::time_point busy_since_;
  std::atomic<uint64_t> sent_bytes_{0};
  std::atomic<uint64_t> busy_ns_{0};

 public:
  Transport::ChannelLoad Load() const {
    Transport::ChannelLoad load;
    load.bytes_sent = sent_bytes_.load(std::memory_order_relaxed);
    load.busy_ns = busy_ns_.load(std::memory_order_relaxed);
    return load;
  }
};

// ---------------------------------------------------------------------------

namespace {

// Runs `fn` on `channel`'s thread and waits (bounded) for its result.
template <typename T>
absl::StatusOr<T> CallOnThread(UcxTransport::Channel& channel, std::function<T()> fn) {
  auto promise = std::make_shared<std::promise<T>>();
  std::future<T> future = promise->get_future();
  channel.RunOnThread([promise, fn = std::move(fn)] { promise->set_value(fn()); });
  if (future.wait_for(kTaskWait) != std::future_status::ready) {
    return absl::DeadlineExceededError("UCX progress thread did not answer");
  }
  return future.get();
}

}  // namespace

UcxTransport::UcxTransport() : shared_(std::make_unique<Shared>()) {}

absl::StatusOr<std::unique_ptr<UcxTransport>> UcxTransport::Create(
    int num_channels, const std::vector<std::string>& devices) {
  if (num_channels < 1) {
    return absl::InvalidArgumentError("need at least one channel, got " +
                                      std::to_string(num_channels));
  }
  if (!devices.empty() && devices.size() != static_cast<size_t>(num_channels)) {
    return absl::InvalidArgumentError("channel_devices names " + std::to_string(devices.size()) +
                                      " device(s) for " + std::to_string(num_channels) +
                                      " channel(s)");
  }
  std::unique_ptr<UcxTransport> t(new UcxTransport());
  PollWindow();  // a bad CIUIC_UCX_POLL_US is reported now, not from a channel thread
  const int contexts = devices.empty() ? 1 : num_channels;
  for (int i = 0; i < contexts; ++i) {
    ucp_config_t* config = nullptr;
    ucs_status_t st = ucp_config_read(nullptr, nullptr, &config);
    if (st != UCS_OK) return absl::InternalError("ucp_config_read: " + UcsError(st));
    // UCX's tcp transport cuts messages into 8 KiB segments by default;
    // 256 KiB ones measured 10-25% faster for bulk chunks on loopback here.
    // An operator's UCX_TCP_*_SEG_SIZE wins. ucp_config_modify takes the
    // transport's own field name without its "TCP_" prefix: UCX 1.13 keeps
    // "TCP_TX_SEG_SIZE" as an unknown key, ignores it and warns "invalid
    // configuration" when the worker starts (checked with ucp_ep_print_info:
    // eager sends stay at 8 KiB then). No other transport has these fields.
    for (const char* key : {"TX_SEG_SIZE", "RX_SEG_SIZE"}) {
      if (getenv((std::string("UCX_TCP_") + key).c_str()) == nullptr) {
        ucp_config_modify(config, key, "256k");
      }
    }
    if (!devices.empty()) {
      st = ucp_config_modify(config, "NET_DEVICES", devices[i].c_str());
      if (st != UCS_OK) {
        ucp_config_release(config);
        return absl::InvalidArgumentError("channel " + std::to_string(i) + ": network device '" +
                                          devices[i] + "': " + UcsError(st));
      }
    }
    ucp_params_t params{};
    params.field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_MT_WORKERS_SHARED;
    params.features = UCP_FEATURE_TAG | UCP_FEATURE_WAKEUP;
    params.mt_workers_shared = 0;  // each worker has its own thread
    ucp_context_h context = nullptr;
    st = ucp_init(&params, config, &context);
    ucp_config_release(config);
    if (st != UCS_OK) {
      return absl::UnavailableError("ucp_init" +
                                    (devices.empty() ? "" : " for device '" + devices[i] + "'") +
                                    ": " + UcsError(st));
    }
    t->shared_->contexts.push_back(context);
  }
  t->shared_->devices = devices;
  ucs_status_t st = ucp_dt_create_generic(&kReducerOps, nullptr, &t->shared_->reducer_dt);
  if (st != UCS_OK) return absl::InternalError("ucp_dt_create_generic: " + UcsError(st));
  t->shared_->has_reducer_dt = true;
  if (const char* mm = std::getenv("UCX_MM_ERROR_HANDLING"); mm != nullptr && mm[0] == 'y') {
    spdlog::warn(
        "ucx transport: UCX_MM_ERROR_HANDLING=y puts co-located peers on shared "
        "memory, where UCX 1.13 does not notice a killed peer (see "
        "daemon/transport/README.md)");
  }
  const char* tls = std::getenv("UCX_TLS");
  t->shared_->tls = tls != nullptr ? tls : "all (default)";
  for (int i = 0; i < num_channels; ++i) {
    auto channel = std::make_unique<Channel>(t.get(), i);
    absl::Status s = channel->Init(t->shared_->contexts[devices.empty() ? 0 : i]);
    t->channels_.push_back(std::move(channel));
    if (!s.ok()) {
      if (devices.empty()) return s;  // the destructor cleans up what exists
      return absl::Status(s.code(), "channel " + std::to_string(i) + " on device '" + devices[i] +
                                        "': " + std::string(s.message()));
    }
    t->addresses_.push_back(t->channels_.back()->address());
  }
  for (auto& channel : t->channels_) channel->Start();
  std::string on;
  for (const std::string& d : devices) on += (on.empty() ? " on devices " : ",") + d;
  spdlog::info("ucx transport: UCX {}, UCX_TLS={}, {} channel(s){}", UcxVersion(),
               t->shared_->tls, num_channels, on);
  return t;
}

std::vector<Transport::ChannelLoad> UcxTransport::ChannelLoads() const {
  std::vector<ChannelLoad> out;
  for (size_t i = 0; i < channels_.size(); ++i) {
    ChannelLoad load = channels_[i]->Load();
    if (i < shared_->devices.size()) load.device = shared_->devices[i];
    out.push_back(std::move(load));
  }
  return out;
}

UcxTransport::~UcxTransport() {
  shared_->shutting_down.store(true);
  for (auto& channel : channels_) channel->Stop();
  for (auto& channel : channels_) {
    channel->Join();
    channel->DestroyUnstarted();
  }
  // Another thread may still be in the last lines of a Send or FailPeer
  // whose callbacks have all run (Shared::callers): a few instructions,
  // bounded anyway.
  const auto until = Clock::now() + kShutdownGrace;
  while (shared_->callers.load(std::memory_order_acquire) != 0 && Clock::now() < until) {
    std::this_thread::yield();
  }
  if (const int left = shared_->callers.load(std::memory_order_acquire); left != 0) {
    spdlog::error("ucx transport: {} call(s) from other threads still inside the transport {} s "
                  "after its threads stopped; its channels and contexts are left allocated",
                  left, std::chrono::duration_cast<std::chrono::seconds>(kShutdownGrace).count());
    // The callers still decrement Shared::callers and read the channels:
    // both stay allocated.
    for (auto& channel : channels_) (void)channel.release();  // NOLINT: deliberately leaked
    (void)shared_.release();                                  // NOLINT: deliberately leaked
    return;
  }
  channels_.clear();
  for (ucp_context_h context : shared_->contexts) ucp_cleanup(context);
  if (shared_->has_reducer_dt) ucp_dt_destroy(shared_->reducer_dt);
}

void UcxTransport::SetCallerTailHookForTesting(void (*hook)()) { caller_tail_hook.store(hook); }

std::vector<std::string> UcxTransport::WorkerAddresses() const { return addresses_; }

absl::Status UcxTransport::Connect(int self,
                                   const std::vector<std::vector<std::string>>& addresses) {
  if (num_peers_ != 0) return absl::FailedPreconditionError("Connect called twice");
  const int n = static_cast<int>(addresses.size());
  if (n < 1 || n > kMaxPeers) {
    return absl::InvalidArgumentError("membership table of " + std::to_string(n) + " peers (1.." +
                                      std::to_string(kMaxPeers) + ")");
  }
  if (self < 0 || self >= n) {
    return absl::InvalidArgumentError("self " + std::to_string(self) + " not in a table of " +
                                      std::to_string(n) + " peers");
  }
  for (int peer = 0; peer < n; ++peer) {
    if (addresses[peer].size() != channels_.size()) {
      return absl::InvalidArgumentError(
          "peer " + std::to_string(peer) + " has " + std::to_string(addresses[peer].size()) +
          " channel addresses, this transport has " + std::to_string(channels_.size()));
    }
    for (const auto& a : addresses[peer]) {
      if (a.empty()) {
        return absl::InvalidArgumentError("empty address for peer " + std::to_string(peer));
      }
    }
  }
  if (addresses[self] != addresses_) {
    return absl::InvalidArgumentError("addresses[self] are not this transport's addresses");
  }
  {
    std::lock_guard<std::mutex> lock(shared_->mu);
    shared_->peer_status.assign(n, absl::OkStatus());
    shared_->failed = std::make_unique<std::atomic<bool>[]>(n);
    for (int i = 0; i < n; ++i) shared_->failed[i].store(false);
  }
  self_ = self;
  num_peers_ = n;
  for (auto& channel : channels_) {
    Channel* ch = channel.get();
    // A copy: the task may outlive this call if the thread does not answer.
    absl::StatusOr<absl::Status> s =
        CallOnThread<absl::Status>(*ch, [ch, addresses] { return ch->ConnectOnThread(addresses); });
    if (!s.ok()) return s.status();
    if (!s->ok()) return *s;
  }
  return absl::OkStatus();
}

namespace {

std::unique_ptr<Op> NewOp(OpKind kind, int peer, int channel, uint64_t tag, void* data,
                          size_t bytes, TransferDone done) {
  auto op = std::make_unique<Op>();
  op->kind = kind;
  op->peer = peer;
  op->channel = channel;
  op->tag = tag & kUserTagMask;
  op->data = data;
  op->bytes = bytes;
  op->done = std::move(done);
  return op;
}

}  // namespace

void UcxTransport::Route(std::unique_ptr<Op> op) {
  int channel = op->channel;
  if (channel < 0 || channel >= num_channels()) {
    op->early = absl::InvalidArgumentError("no such channel");
    channel = 0;
  } else if (op->peer < 0 || op->peer >= num_peers_) {
    op->early =
        absl::InvalidArgumentError(num_peers_ == 0 ? "transport not connected" : "no such peer");
  }
  op->owner = channels_[channel].get();
  CallerScope scope(shared_->callers);
  channels_[channel]->Submit(std::move(op));
}

void UcxTransport::Send(int peer, int channel, uint64_t tag, const void* data, size_t bytes,
                        TransferDone done) {
  Route(NewOp(OpKind::kSend, peer, channel, tag, const_cast<void*>(data), bytes,
              std::move(done)));
}

void UcxTransport::Recv(int peer, int channel, uint64_t tag, void* data, size_t bytes,
                        TransferDone done) {
  Route(NewOp(OpKind::kRecv, peer, channel, tag, data, bytes, std::move(done)));
}

void UcxTransport::RecvReduce(int peer, int channel, uint64_t tag, const ReduceInto& into,
                              size_t bytes, TransferDone done) {
  auto op = NewOp(OpKind::kRecv, peer, channel, tag, into.dest, bytes, std::move(done));
  const size_t elem = wire::DataTypeSize(static_cast<uint32_t>(into.dtype));
  if (absl::Status s = reduce::CheckReducible(into.dtype, into.op); !s.ok()) {
    op->early = s;
  } else if (bytes % elem != 0) {
    op->early = absl::InvalidArgumentError("reducing receive of " + std::to_string(bytes) +
                                           " bytes, not a multiple of the element size " +
                                           std::to_string(elem));
  }
  op->reducer = std::make_unique<FragmentReducer>(into, bytes);
  Route(std::move(op));
}

void UcxTransport::FailPeer(int peer, const absl::Status& why) {
  if (peer < 0 || peer >= num_peers_) return;
  absl::Status status = why.ok() ? absl::UnavailableError("failed by the control plane") : why;
  MarkPeerFailed(peer,
                 absl::Status(status.code(), "lost peer " + std::to_string(peer) + ": " +
                                                 std::string(status.message())),
                 /*warn=*/false);  // the control plane reports its reasons itself
}

void UcxTransport::MarkPeerFailed(int peer, absl::Status why, bool warn) {
  CallerScope scope(shared_->callers);
  {
    std::lock_guard<std::mutex> lock(shared_->mu);
    if (shared_->failed[peer].load()) return;  // sticky: the first reason wins
    shared_->peer_status[peer] = why;
    shared_->failed[peer].store(true, std::memory_order_release);
  }
  spdlog::log(warn ? spdlog::level::warn : spdlog::level::info, "ucx transport: {}",
              why.ToString());
  for (auto& channel : channels_) {
    Channel* ch = channel.get();
    ch->RunOnThread([ch, peer] { ch->FailPeerOnThread(peer); });
  }
}

absl::Status UcxTransport::PeerStatus(int peer) const {
  if (peer < 0 || peer >= num_peers_) return absl::InvalidArgumentError("no such peer");
  return shared_->PeerStatus(peer);
}

std::string UcxTransport::Describe() const {
  std::string out = "UCX " + UcxVersion() + ", UCX_TLS=" + shared_->tls + ", " +
                    std::to_string(channels_.size()) + " channel(s), poll window " +
                    std::to_string(PollWindow().count()) + " us";
  if (num_peers_ == 0) return out + ", not connected\n";
  out += ", peer " + std::to_string(self_) + " of " + std::to_string(num_peers_) + "\n";
  for (const auto& channel : channels_) {
    Channel* ch = channel.get();
    absl::StatusOr<std::string> s =
        CallOnThread<std::string>(*ch, [ch] { return ch->DescribeOnThread(); });
    out += s.ok() ? *s : "channel: " + s.status().ToString() + "\n";
  }
  return out;
}

std::chrono::microseconds UcxTransport::PollWindow() {
  static const std::chrono::microseconds window = [] {
    const char* env = std::getenv("CIUIC_UCX_POLL_US");
    if (env == nullptr) return kDefaultPollWindow;
    char* end = nullptr;
    errno = 0;
    const long v = std::strtol(env, &end, 10);
    if (errno != 0 || end == env || *end != '\0' || v < 0 || v > 1000000) {
      spdlog::warn("CIUIC_UCX_POLL_US='{}' is not a number of microseconds in 0..1000000; "
                   "using {}",
                   env, kDefaultPollWindow.count());
      return kDefaultPollWindow;
    }
    return std::chrono::microseconds(v);
  }();
  return window;
}

std::string UcxTransport::UcxVersion() { return ucp_get_version_string(); }

bool UcxTransport::SupportsCudaMemory() {
  static const bool supported = [] {
    ucp_config_t* config = nullptr;
    if (ucp_config_read(nullptr, nullptr, &config) != UCS_OK) return false;
    ucp_params_t params{};
    params.field_mask = UCP_PARAM_FIELD_FEATURES;
    params.features = UCP_FEATURE_TAG;
    ucp_context_h context = nullptr;
    ucs_status_t st = ucp_init(&params, config, &context);
    ucp_config_release(config);
    if (st != UCS_OK) return false;
    ucp_context_attr_t attr{};
    attr.field_mask = UCP_ATTR_FIELD_MEMORY_TYPES;
    bool cuda = ucp_context_query(context, &attr) == UCS_OK &&
                (attr.memory_types & UCS_BIT(UCS_MEMORY_TYPE_CUDA)) != 0;
    ucp_cleanup(context);
    return cuda;
  }();
  return supported;
}

}  // namespace ciuic::daemon
