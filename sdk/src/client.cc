// The SDK's session with ciuicd: handshake on the session socket, join over
// gRPC, then submissions and completions through the shared-memory rings.
#include <linux/futex.h>
#include <poll.h>
#include <sched.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <climits>
#include <cstdio>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <mutex>
#include <optional>
#include <unordered_map>
#include <vector>

#include "arena.h"
#include "fast_path.h"
#include "device.h"
#include "wait_policy.h"
#include "ciuic/ciuic.h"
#include "ciuic/control.grpc.pb.h"
#include "ciuic/collective_rules.h"
#include "ciuic/shm_layout.h"
#include "grpcpp/grpcpp.h"
#include "reduce/reduce.h"

namespace ciuic {

namespace {

using Clock = std::chrono::steady_clock;

Status ErrnoStatus(StatusCode code, const std::string& what) {
  return Status(code, what + ": " + std::strerror(errno));
}

uint64_t ArenaBytesFromEnv() {
  const char* env = std::getenv("CIUIC_ARENA_BYTES");
  if (env == nullptr || env[0] == '\0') return 512ull << 20;
  char* end = nullptr;
  unsigned long long v = std::strtoull(env, &end, 10);
  uint64_t mult = 1;
  if (end && (*end == 'K' || *end == 'k')) mult = 1ull << 10;
  if (end && (*end == 'M' || *end == 'm')) mult = 1ull << 20;
  if (end && (*end == 'G' || *end == 'g')) mult = 1ull << 30;
  return v == 0 ? (512ull << 20) : v * mult;
}

// Spin-wait granularity: a pause is ~40 ns, so the trainer offers its core
// to others (the daemon, when cores are few) every ~0.5 us.
constexpr int kPausesPerYield = 12;

std::string CoordinatorFromEnv() {
  const char* c = std::getenv("CIUIC_COORDINATOR");
  if (c != nullptr && c[0] != '\0') return c;
  const char* addr = std::getenv("MASTER_ADDR");
  if (addr == nullptr || addr[0] == '\0') return "";
  const char* port = std::getenv("CIUIC_PEER_PORT");
  return std::string(addr) + ":" + (port && port[0] ? port : "7361");
}

// CIUIC_SPIN_US: how long a waiter polls before it sleeps (default 50;
// between nodes only for small operations: wait_policy.h).
uint32_t SpinMicrosFromEnv() {
  const char* env = std::getenv("CIUIC_SPIN_US");
  if (env == nullptr || env[0] == '\0') return 50;
  return static_cast<uint32_t>(std::strtoul(env, nullptr, 10));
}

// CIUIC_WAIT_GRACE_MS: what GiveUpAfter adds to twice an operation's
// timeout (default 30000; fault tests shorten it). 0..86400000.
uint32_t WaitGraceMillisFromEnv() {
  const char* env = std::getenv("CIUIC_WAIT_GRACE_MS");
  if (env == nullptr || env[0] == '\0') return 30000;
  char* end = nullptr;
  const unsigned long v = std::strtoul(env, &end, 10);
  if (*end != '\0' || v > 86400000ul) return 30000;
  return static_cast<uint32_t>(v);
}

// "none", "fp16", "bf16", "int8" or "topk:RATIO" (0 < RATIO <= 1).
Status ParseCompression(const std::string& text, uint32_t* codec, float* ratio) {
  static const std::pair<const char*, wire::Codec> kNames[] = {
      {"none", wire::Codec::kNone}, {"fp16", wire::Codec::kFp16},
      {"bf16", wire::Codec::kBf16}, {"int8", wire::Codec::kInt8}};
  for (const auto& [n, c] : kNames) {
    if (text == n) {
      *codec = static_cast<uint32_t>(c);
      *ratio = 0;
      return Status::Ok();
    }
  }
  if (text.rfind("topk:", 0) == 0) {
    char* end = nullptr;
    const double r = std::strtod(text.c_str() + 5, &end);
    if (end != text.c_str() + 5 && *end == '\0' && r > 0 && r <= 1) {
      *codec = static_cast<uint32_t>(wire::Codec::kTopK);
      *ratio = static_cast<float>(r);
      return Status::Ok();
    }
  }
  return Status(StatusCode::kInvalidArgument,
                "unknown compression '" + text + "' (none, fp16, bf16, int8, topk:RATIO with "
                "0 < RATIO <= 1)");
}

}  // namespace

// Shared by the communicator and its handles.
struct Core;

struct Handle::State {
  std::shared_ptr<Core> core;
  uint64_t op_id = 0;
  std::string name;
  // Past this, Wait() stops waiting for a daemon that should have ended
  // the operation long before (GiveUpAfter).
  std::chrono::steady_clock::time_point give_up = std::chrono::steady_clock::time_point::max();
  std::atomic<bool> done{false};
  Status status;  // written before done is set
  std::chrono::steady_clock::time_point submitted = std::chrono::steady_clock::now();
  uint32_t poll_us = 0;  // how long Wait() polls before it sleeps (wait_policy.h)
  std::atomic<bool> timed{false};  // its timing is recorded (Core::RecordTiming)
  // Staging for buffers outside shared memory: copied out at completion.
  Buffer staging;      // send (or send and recv, when they overlap)
  Buffer staging_out;  // recv, when apart from send
  Buffer splits;       // alltoallv's counts, read by the daemon
  const uint8_t* staging_recv = nullptr;
  void* user_recv = nullptr;
  size_t recv_bytes = 0;
  // Set for an operation on the job's fast path (fast_path.h) instead of
  // the daemon's rings; `done` and `status` are then unused.
  std::shared_ptr<FastOp> fast;
  // Device buffers: the IPC event the daemon waits on, back to its pool at
  // completion (the descriptor records live in `staging`).
  std::shared_ptr<void> device_event;
};

struct Core {
  std::shared_ptr<Buffer::Arena> arena;
  int sock_fd = -1;
  int doorbell_fd = -1;
  uint32_t spin_us = 50;
  uint32_t op_timeout_ms = wire::kDefaultOpTimeoutMs;  // the daemon's when this rank joined
  uint32_t wait_grace_ms = 30000;  // CIUIC_WAIT_GRACE_MS
  wire::SessionHeader* header = nullptr;
  wire::SubmissionEntry* sq = nullptr;
  wire::CompletionEntry* cq = nullptr;

  std::mutex submit_mu;  // the submission ring's producer side
  uint32_t sq_tail = 0;
  std::atomic<uint64_t> next_op_id{1};

  std::mutex reap_mu;  // the completion ring's consumer side and `inflight`
  uint32_t cq_head = 0;
  std::unordered_map<uint64_t, std::shared_ptr<Handle::State>> inflight;
  std::atomic<uint32_t> inflight_count{0};
  Status dead;  // set once the session is gone; guarded by reap_mu

  // The job's fast path, when the daemon gave it one (set before the
  // Communicator is returned, constant afterwards).
  std::unique_ptr<FastPath> fast;

  // Timings of the operations completed since the last TakeOpTimings.
  std::mutex timing_mu;
  std::deque<Communicator::OpTiming> timings;
  uint64_t timings_dropped = 0;

  // Keeps the timing of an operation that completed successfully, once.
  void RecordTiming(Handle::State& st, Clock::time_point completed) {
    if (st.timed.exchange(true)) return;
    std::lock_guard<std::mutex> lock(timing_mu);
    if (timings.size() >= Communicator::kMaxOpTimings) {
      timings.pop_front();
      ++timings_dropped;
    }
    timings.push_back(Communicator::OpTiming{st.name, st.submitted, completed});
  }

  // The daemon's completion stamp (CLOCK_MONOTONIC, steady_clock's clock on
  // Linux), or now where it is missing or not plausible (a daemon in another
  // time namespace).
  static Clock::time_point CompletedAt(uint64_t completed_ns, Clock::time_point submitted) {
    const Clock::time_point now = Clock::now();
    const Clock::time_point stamp{std::chrono::nanoseconds(completed_ns)};
    return completed_ns != 0 && stamp >= submitted && stamp <= now ? stamp : now;
  }

  ~Core() {
    if (sock_fd >= 0) close(sock_fd);
    if (doorbell_fd >= 0) close(doorbell_fd);
  }

  static void Finish(Handle::State& st, Status status) {
    if (status.ok() && st.user_recv != nullptr && st.recv_bytes > 0) {
      std::memcpy(st.user_recv, st.staging_recv, st.recv_bytes);
    }
    st.staging = Buffer();
    st.staging_out = Buffer();
    st.splits = Buffer();
    st.device_event.reset();
    st.status = std::move(status);
    st.done.store(true, std::memory_order_release);
  }

  // Drains the completion ring. Returns true if anything completed.
  bool Reap() {
    std::lock_guard<std::mutex> lock(reap_mu);
    bool any = false;
    const uint32_t tail = header->cq_tail.load(std::memory_order_acquire);
    while (cq_head != tail) {
      const wire::CompletionEntry& e = cq[cq_head & (header->cq_capacity - 1)];
      auto it = inflight.find(e.op_id);
      if (it != inflight.end()) {
        const uint32_t n = std::min<uint32_t>(e.message_len, wire::kMaxMessage);
        if (e.status_code == 0) {
          RecordTiming(*it->second, CompletedAt(e.completed_ns, it->second->submitted));
        }
        Finish(*it->second, Status(static_cast<StatusCode>(e.status_code),
                                   std::string(e.message, n)));
        inflight.erase(it);
        inflight_count.fetch_sub(1, std::memory_order_relaxed);
      }
      ++cq_head;
      header->cq_head.store(cq_head, std::memory_order_release);
      any = true;
    }
    return any;
  }

  // Ends every operation in flight with `why` (daemon gone or session closed).
  void MarkDead(const Status& why) {
    std::lock_guard<std::mutex> lock(reap_mu);
    if (dead.ok()) dead = why;
    for (auto& [id, st] : inflight) Finish(*st, dead);
    inflight.clear();
    inflight_count.store(0);
  }

  Status DeadStatus() {
    std::lock_guard<std::mutex> lock(reap_mu);
    return dead;
  }

  // A hang-up on the session socket means the daemon is gone.
  void CheckDaemon() {
    pollfd p{sock_fd, POLLIN, 0};
    if (poll(&p, 1, 0) > 0 && (p.revents & (POLLHUP | POLLERR | POLLIN))) {
      MarkDead(Status(StatusCode::kUnavailable,
                      "ciuicd closed the session (daemon stopped or restarted?)"));
    }
  }

  // Sleeps until the completion ring moves past `seen`, or `until`.
  void SleepForCompletion(uint32_t seen, Clock::time_point until) {
    auto left = until - Clock::now();
    if (left <= Clock::duration::zero()) return;
    auto slice = std::min<Clock::duration>(left, std::chrono::milliseconds(100));
    timespec ts{};
    auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(slice).count();
    ts.tv_sec = ns / 1000000000;
    ts.tv_nsec = ns % 1000000000;
    header->trainer_waiters.fetch_add(1, std::memory_order_seq_cst);
    if (header->cq_tail.load(std::memory_order_seq_cst) == seen) {
      syscall(SYS_futex, reinterpret_cast<uint32_t*>(&header->cq_tail), FUTEX_WAIT, seen, &ts,
              nullptr, 0);
    }
    header->trainer_waiters.fetch_sub(1, std::memory_order_seq_cst);
    CheckDaemon();
  }

  // Waits until `pred()` or `until`; spins briefly first (`poll_us`, else
  // spin_us), then sleeps.
  template <typename Pred>
  bool WaitUntil(Pred pred, Clock::time_point until, std::optional<uint32_t> poll_us = {}) {
    const Clock::time_point spin_end =
        Clock::now() + std::chrono::microseconds(poll_us.value_or(spin_us));
    while (true) {
      Reap();
      if (pred()) return true;
      const Clock::time_point now = Clock::now();
      if (now >= until) return false;
      if (now < spin_end) {
        // Watch the ring without locks or syscalls; yield now and then so
        // the daemon gets a core when cores are few.
        for (int i = 0; i < kPausesPerYield; ++i) {
          if (header->cq_tail.load(std::memory_order_acquire) !=
              header->cq_head.load(std::memory_order_relaxed)) {
            break;
          }
          wire::CpuRelax();
        }
        sched_yield();
        continue;
      }
      uint32_t seen = header->cq_tail.load(std::memory_order_acquire);
      {
        std::lock_guard<std::mutex> lock(reap_mu);
        if (seen != cq_head || !dead.ok()) continue;
      }
      SleepForCompletion(seen, until);
    }
  }
};

// ------------------------------------------------------------------ Handle

// How long after its submission an operation of `timeout_ms` (0: the
// daemon's default) may go unanswered before the SDK gives up on the
// daemon: every phase in ciuicd has a deadline of that timeout (waiting
// for the ranks, for the coordinator, the transfer itself), so a daemon
// that has said nothing by twice the timeout and 30 s (CIUIC_WAIT_GRACE_MS)
// is stopped or hung.
static Clock::duration GiveUpAfter(uint32_t timeout_ms, const Core& core) {
  const uint64_t t = timeout_ms != 0 ? timeout_ms : core.op_timeout_ms;
  return std::chrono::milliseconds(2 * t + core.wait_grace_ms);
}

static Status GaveUp(const Handle::State& st) {
  return Status(StatusCode::kDeadlineExceeded,
                "ciuicd has not completed operation '" + st.name +
                    "' long after its deadlines (twice its timeout and a grace): the daemon is "
                    "stopped or hung; it may still write the operation's output buffers");
}

static Status WaitState(Handle::State* st, Clock::time_point until) {
  if (st == nullptr) return Status(StatusCode::kFailedPrecondition, "invalid (empty) handle");
  if (st->fast) {
    Core& c = *st->core;
    if (!c.fast->Wait(*st->fast, until, c.spin_us, [&c] {
          c.CheckDaemon();
          return c.DeadStatus();
        })) {
      return Status(StatusCode::kDeadlineExceeded, "operation still in progress");
    }
    if (st->fast->status.ok()) {
      c.RecordTiming(*st, Core::CompletedAt(st->fast->completed_ns, st->submitted));
    }
    return st->fast->status;
  }
  if (!st->done.load(std::memory_order_acquire)) {
    bool done = st->core->WaitUntil([st] { return st->done.load(std::memory_order_acquire); },
                                    std::min(until, st->give_up), st->poll_us);
    if (!done) {
      if (until > st->give_up) return GaveUp(*st);
      return Status(StatusCode::kDeadlineExceeded, "operation still in progress");
    }
  }
  return st->status;
}

Status Handle::Wait() { return WaitState(state_.get(), Clock::time_point::max()); }

Status Handle::WaitFor(std::chrono::milliseconds timeout) {
  return WaitState(state_.get(), Clock::now() + timeout);
}

bool Handle::Test() {
  if (!state_) return false;
  if (state_->fast) {
    if (!state_->core->fast->Poll(*state_->fast)) return false;
    if (state_->fast->status.ok()) {
      state_->core->RecordTiming(
          *state_, Core::CompletedAt(state_->fast->completed_ns, state_->submitted));
    }
    return true;
  }
  if (state_->done.load(std::memory_order_acquire)) return true;
  state_->core->Reap();
  return state_->done.load(std::memory_order_acquire) || Clock::now() >= state_->give_up;
}

// ------------------------------------------------------------ Communicator

class Communicator::Impl {
 public:
  JobOptions options;
  std::string node_name;
  std::shared_ptr<Core> core;
  std::atomic<uint64_t> unnamed_seq{0};

  Handle Failed(Status s) {
    auto st = std::make_shared<Handle::State>();
    st->core = core;
    st->status = std::move(s);
    st->done.store(true);
    return Handle(st);
  }

  struct Span {
    const void* ptr;
    size_t bytes;
  };

  // `splits` (alltoallv only): send_counts then recv_counts, 2 * world_size.
  Handle Submit(wire::Collective collective, DataType dtype, uint32_t reduce_op, int root,
                size_t count, Span send, Span recv, void* user_recv, const OpOptions& opts,
                const std::vector<uint64_t>* splits = nullptr);

  // Whether a submission goes on the job's fast path: small enough, and
  // valid the way the daemon checks a submission (ValidateSubmission), so
  // that whatever the daemon would refuse still goes to the daemon and gets
  // the daemon's error. Every rank of a job decides alike for the same
  // (valid, matching) operation: the limit is the job's.
  // The operation's signature as the fast path compares it (fields a
  // collective does not use are 0, as the daemon ignores them).
  static FastPath::Signature FastSignature(const wire::SubmissionEntry& e, bool device) {
    const auto collective = static_cast<wire::Collective>(e.collective);
    FastPath::Signature sig;
    sig.collective = e.collective;
    sig.dtype = collective == wire::Collective::kBarrier ? 0 : e.dtype;
    sig.reduce_op = collective == wire::Collective::kAllreduce ||
                            collective == wire::Collective::kReduceScatter
                        ? e.reduce_op
                        : 0;
    sig.root = collective == wire::Collective::kBroadcast ? e.root : 0;
    sig.count = e.count;
    sig.codec = e.codec;
    sig.codec_ratio = e.codec_ratio;
    sig.device = device ? 1 : 0;
    return sig;
  }

  // Whether the operation's payload per rank fits the fast path; depends on
  // the signature alone, so ranks that agree on it take the same path.
  bool FastFits(const wire::SubmissionEntry& e) const {
    const auto collective = static_cast<wire::Collective>(e.collective);
    if (collective == wire::Collective::kBarrier) return true;
    // Counts that differ per rank: the daemon matches them (a kDaemon key).
    if (collective == wire::Collective::kAlltoallv) return false;
    const uint64_t es = wire::DataTypeSize(e.dtype);
    const uint64_t limit = core->fast->payload_limit();
    // limit <= 64 MiB, so once count <= limit none of the products overflow.
    if (es == 0 || e.count > limit) return false;
    const uint64_t block = e.count * es;
    uint64_t payload = block;
    if (collective == wire::Collective::kReduceScatter ||
        collective == wire::Collective::kAllgather || collective == wire::Collective::kAlltoall) {
      payload = block * static_cast<uint64_t>(options.world_size);
    }
    return payload <= limit;
  }

  // Whether the daemon would accept the operation as far as the fast path
  // can tell (known dtype, reducible, root in range, buffers in place or
  // apart). Those it would refuse go to it without taking a key, so that
  // they shift no rank's (name, n) (proto/ciuic/fast_path.h).
  bool FastValid(const wire::SubmissionEntry& e, Span send, Span recv) const {
    const int w = options.world_size;
    const auto collective = static_cast<wire::Collective>(e.collective);
    if (collective == wire::Collective::kBarrier) return true;
    if (collective != wire::Collective::kAllreduce &&
        collective != wire::Collective::kReduceScatter &&
        collective != wire::Collective::kAllgather &&
        collective != wire::Collective::kBroadcast && collective != wire::Collective::kAlltoall &&
        collective != wire::Collective::kAlltoallv) {
      return false;
    }
    const uint64_t es = wire::DataTypeSize(e.dtype);
    if (es == 0) return false;
    const uint64_t block = e.count * es;
    if (collective == wire::Collective::kAllreduce ||
        collective == wire::Collective::kReduceScatter) {
      if (!reduce::CheckReducible(e.dtype, e.reduce_op).ok()) return false;
    }
    if (collective == wire::Collective::kBroadcast && (e.root < 0 || e.root >= w)) return false;
    // Aliasing as the daemon allows it: exactly in place, or apart.
    const auto sp = reinterpret_cast<uintptr_t>(send.ptr);
    const auto rp = reinterpret_cast<uintptr_t>(recv.ptr);
    return !wire::Overlap(sp, send.bytes, rp, recv.bytes) ||
           wire::InPlace(collective, sp, rp, block, options.rank);
  }
  Handle SubmitDevice(wire::Collective collective, DataType dtype, uint32_t reduce_op, int root,
                      size_t count, DeviceBuffer send, size_t send_bytes, DeviceBuffer recv,
                      size_t recv_bytes, const OpOptions& opts,
                      const std::vector<uint64_t>* splits = nullptr);
  // Puts alltoallv's counts in the arena for the daemon (held by `st`).
  Status StageSplits(const std::vector<uint64_t>& splits, Handle::State& st,
                     wire::SubmissionEntry& e);

  // The entry's fields but the buffers; `*name` is the operation's name.
  Status MakeEntry(wire::Collective collective, DataType dtype, uint32_t reduce_op, int root,
                   size_t count, const OpOptions& opts, wire::SubmissionEntry* e,
                   std::string* name);
  // Publishes `e` on the ring for `st` (which then waits for its completion).
  Handle Publish(const std::shared_ptr<Handle::State>& st, wire::SubmissionEntry& e);

  DeviceExporter device;
};

Communicator::Communicator(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

Communicator::~Communicator() {
  if (impl_ && impl_->core) {
    // Our own pending handles fail first, with CANCELLED; then closing the
    // socket tells the daemon. (The other order let a thread waiting on a
    // handle meanwhile take the daemon's answer to the hang-up, ABORTED
    // "trainer disconnected", or see the hang-up itself, UNAVAILABLE.)
    const Status cancelled(StatusCode::kCancelled, "the communicator was destroyed");
    impl_->core->MarkDead(cancelled);
    if (impl_->core->fast) impl_->core->fast->CancelAll(cancelled);
    shutdown(impl_->core->sock_fd, SHUT_RDWR);
  }
}

int Communicator::rank() const { return impl_->options.rank; }

std::vector<Communicator::OpTiming> Communicator::TakeOpTimings(uint64_t* dropped) {
  Core& c = *impl_->core;
  c.Reap();  // completions the daemon has written, even if nobody waited yet
  std::lock_guard<std::mutex> lock(c.timing_mu);
  std::vector<OpTiming> out(std::make_move_iterator(c.timings.begin()),
                            std::make_move_iterator(c.timings.end()));
  c.timings.clear();
  if (dropped != nullptr) *dropped = c.timings_dropped;
  c.timings_dropped = 0;
  return out;
}
int Communicator::world_size() const { return impl_->options.world_size; }
int Communicator::local_rank() const { return impl_->options.local_rank; }
int Communicator::local_size() const { return impl_->options.local_size; }
const std::string& Communicator::job_id() const { return impl_->options.job_id; }
const std::string& Communicator::node_name() const { return impl_->node_name; }

// The process behind the session socket must run as the uid that owns the
// socket's directory, a directory nobody else may write: ciuicd refuses to
// start anywhere else, so a socket elsewhere, or served by another uid, is
// an impostor's that would receive this trainer's tensors.
static Status CheckDaemonIsGenuine(int fd, const std::string& path) {
  ucred cred{};
  socklen_t len = sizeof(cred);
  if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0) {
    return ErrnoStatus(StatusCode::kInternal, "SO_PEERCRED on " + path);
  }
  const auto slash = path.rfind('/');
  const std::string dir = slash == std::string::npos ? "."
                          : slash == 0              ? "/"
                                                    : path.substr(0, slash);
  struct stat st {};
  if (stat(dir.c_str(), &st) != 0) return ErrnoStatus(StatusCode::kInternal, "stat " + dir);
  if (cred.uid != st.st_uid || (st.st_mode & (S_IWGRP | S_IWOTH)) != 0) {
    char mode[8];
    std::snprintf(mode, sizeof(mode), "%04o", static_cast<unsigned>(st.st_mode & 07777));
    return Status(StatusCode::kPermissionDenied,
                  "refusing the daemon at " + path + ": it runs as uid " +
                      std::to_string(cred.uid) + " (pid " + std::to_string(cred.pid) +
                      "), but " + dir + " belongs to uid " + std::to_string(st.st_uid) +
                      " with mode " + mode +
                      "; ciuicd serves only from a directory of its own uid that no one else "
                      "may write, so this one may be an impostor");
  }
  return Status::Ok();
}

static Status OpenSession(const std::string& path, uint64_t arena_bytes, Core* core,
                          std::string* token) {
  sockaddr_un addr{};
  if (path.size() >= sizeof(addr.sun_path)) {
    return Status(StatusCode::kInvalidArgument, "socket path too long: " + path);
  }
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, path.data(), path.size());
  int fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
  if (fd < 0) return ErrnoStatus(StatusCode::kInternal, "socket");
  core->sock_fd = fd;
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    return ErrnoStatus(StatusCode::kUnavailable,
                       "cannot reach ciuicd at " + path + " (is it running?)");
  }
  if (Status genuine = CheckDaemonIsGenuine(fd, path); !genuine.ok()) return genuine;
  timeval tv{30, 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  wire::HelloRequest hello{};
  hello.magic = wire::kSessionMagic;
  hello.version = wire::kLayoutVersion;
  hello.arena_bytes = arena_bytes;
  if (send(fd, &hello, sizeof(hello), MSG_NOSIGNAL) != static_cast<ssize_t>(sizeof(hello))) {
    return ErrnoStatus(StatusCode::kUnavailable, "session hello to " + path);
  }
  wire::HelloReply reply{};
  iovec iov{&reply, sizeof(reply)};
  alignas(cmsghdr) char control[CMSG_SPACE(2 * sizeof(int))];
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  msg.msg_control = control;
  msg.msg_controllen = sizeof(control);
  ssize_t n = recvmsg(fd, &msg, MSG_CMSG_CLOEXEC);
  if (n <= 0) return ErrnoStatus(StatusCode::kUnavailable, "no session reply from " + path);
  int fds[2] = {-1, -1};
  int nfds = 0;
  for (cmsghdr* c = CMSG_FIRSTHDR(&msg); c != nullptr; c = CMSG_NXTHDR(&msg, c)) {
    if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS) {
      nfds = static_cast<int>((c->cmsg_len - CMSG_LEN(0)) / sizeof(int));
      std::memcpy(fds, CMSG_DATA(c), sizeof(int) * std::min(nfds, 2));
    }
  }
  if (n != static_cast<ssize_t>(sizeof(reply)) || reply.magic != wire::kSessionMagic) {
    for (int f : fds) if (f >= 0) close(f);
    return Status(StatusCode::kInternal, "malformed session reply from " + path);
  }
  if (reply.status_code != 0) {
    for (int f : fds) if (f >= 0) close(f);
    return Status(static_cast<StatusCode>(reply.status_code),
                  std::string(reply.message, std::min<size_t>(reply.message_len,
                                                              wire::kMaxMessage)));
  }
  if (nfds != 2) {
    for (int f : fds) if (f >= 0) close(f);
    return Status(StatusCode::kInternal, "session reply without its descriptors");
  }
  core->doorbell_fd = fds[1];
  void* base = mmap(nullptr, reply.memfd_bytes, PROT_READ | PROT_WRITE,
                    MAP_SHARED | MAP_POPULATE, fds[0], 0);
  if (base == MAP_FAILED) {
    close(fds[0]);
    return ErrnoStatus(StatusCode::kResourceExhausted, "mapping the session's shared memory");
  }
  core->arena = std::make_shared<Buffer::Arena>(fds[0], static_cast<uint8_t*>(base),
                                                reply.memfd_bytes);
  core->header = core->arena->header();
  if (core->header->magic != wire::kSessionMagic ||
      core->header->sq_capacity != wire::kRingCapacity ||
      core->header->cq_capacity != wire::kRingCapacity) {
    return Status(StatusCode::kInternal, "unexpected session memory layout");
  }
  core->sq = reinterpret_cast<wire::SubmissionEntry*>(core->arena->base + wire::kSqOffset);
  core->cq = reinterpret_cast<wire::CompletionEntry*>(core->arena->base + wire::kCqOffset);
  token->assign(reinterpret_cast<const char*>(reply.token), wire::kTokenBytes);
  return Status::Ok();
}

// The job's fast-path segment, sent by the daemon on the session socket
// before it answered JoinJob (proto/ciuic/fast_path.h).
static Status ReceiveFastPath(int sock, uint64_t payload_bytes, const JobOptions& o,
                              std::unique_ptr<FastPath>* out) {
  wire::FastPathHello hello{};
  iovec iov{&hello, sizeof(hello)};
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))];
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  msg.msg_control = control;
  msg.msg_controllen = sizeof(control);
  ssize_t n = recvmsg(sock, &msg, MSG_CMSG_CLOEXEC);
  int fd = -1;
  for (cmsghdr* c = CMSG_FIRSTHDR(&msg); n > 0 && c != nullptr; c = CMSG_NXTHDR(&msg, c)) {
    if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS &&
        c->cmsg_len == CMSG_LEN(sizeof(int))) {
      std::memcpy(&fd, CMSG_DATA(c), sizeof(int));
    }
  }
  if (n != static_cast<ssize_t>(sizeof(hello)) || fd < 0 || hello.magic != wire::kFastPathMagic ||
      hello.payload_bytes != payload_bytes) {
    if (fd >= 0) close(fd);
    return Status(StatusCode::kInternal,
                  "ciuicd announced a fast-path segment for job '" + o.job_id +
                      "' but did not send a valid one");
  }
  return FastPath::Open(fd, hello.segment_bytes, o.rank, o.world_size, o.job_id, out);
}

Status Communicator::Create(const JobOptions& in, std::unique_ptr<Communicator>* out) {
  auto impl = std::make_unique<Impl>();
  impl->options = in;
  JobOptions& o = impl->options;
  if (o.socket_path.empty()) o.socket_path = DefaultSocketPath();
  if (o.local_rank < 0) o.local_rank = o.rank;
  if (o.local_size < 0) o.local_size = o.world_size;
  if (o.arena_bytes == 0) o.arena_bytes = ArenaBytesFromEnv();
  if (o.coordinator.empty() && o.local_size != o.world_size) o.coordinator = CoordinatorFromEnv();
  if (o.job_id.empty()) return Status(StatusCode::kInvalidArgument, "job_id is empty");
  if (o.world_size < 1 || o.rank < 0 || o.rank >= o.world_size) {
    return Status(StatusCode::kInvalidArgument, "rank " + std::to_string(o.rank) +
                                                    " is not in a world of size " +
                                                    std::to_string(o.world_size));
  }
  impl->core = std::make_shared<Core>();
  impl->core->spin_us = SpinMicrosFromEnv();
  impl->core->wait_grace_ms = WaitGraceMillisFromEnv();
  std::string token;
  Status s = OpenSession(o.socket_path + ".session", o.arena_bytes, impl->core.get(), &token);
  if (!s.ok()) return s;

  auto channel = grpc::CreateChannel("unix:" + o.socket_path, grpc::InsecureChannelCredentials());
  auto stub = proto::Control::NewStub(channel);
  proto::JoinJobRequest req;
  req.set_session_token(token);
  req.set_job_id(o.job_id);
  req.set_rank(o.rank);
  req.set_world_size(o.world_size);
  req.set_local_rank(o.local_rank);
  req.set_local_size(o.local_size);
  req.set_coordinator(o.coordinator);
  proto::JoinJobReply reply;
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
  grpc::Status gs = stub->JoinJob(&ctx, req, &reply);
  if (!gs.ok()) {
    std::string msg = gs.error_message();
    if (gs.error_code() == grpc::StatusCode::UNAVAILABLE) {
      msg = "cannot reach ciuicd at " + o.socket_path + ": " + msg;
    }
    return Status(static_cast<StatusCode>(gs.error_code()), msg);
  }
  impl->node_name = reply.node_name();
  if (reply.op_timeout_ms() != 0) impl->core->op_timeout_ms = reply.op_timeout_ms();
  if (reply.fast_path_bytes() > 0) {
    s = ReceiveFastPath(impl->core->sock_fd, reply.fast_path_bytes(), o, &impl->core->fast);
    if (!s.ok()) return s;
    // The core owns the fast path, so it outlives this.
    Core* core = impl->core.get();
    core->fast->SetDaemonWait([core](const std::atomic<bool>& done, Clock::time_point until) {
      core->WaitUntil([&done] { return done.load(std::memory_order_acquire); }, until);
    });
  }
  out->reset(new Communicator(std::move(impl)));
  return Status::Ok();
}

Status Communicator::Allocate(size_t bytes, Buffer* out) {
  uint64_t offset = 0;
  Status s = impl_->core->arena->Allocate(bytes, &offset);
  if (!s.ok()) return s;
  *out = BufferAccess::Make(impl_->core->arena, offset, bytes);
  return Status::Ok();
}

bool Communicator::IsShared(const void* ptr, size_t bytes) const {
  return impl_->core->arena->Contains(ptr, bytes);
}

Status Communicator::Impl::MakeEntry(wire::Collective collective, DataType dtype,
                                     uint32_t reduce_op, int root, size_t count,
                                     const OpOptions& opts, wire::SubmissionEntry* out,
                                     std::string* name_out) {
  std::string& name = *name_out;
  name = opts.name;
  if (name.empty()) {
    name = wire::UnnamedName(unnamed_seq.fetch_add(1));
  } else if (wire::IsUnnamed(name)) {
    return Status(StatusCode::kInvalidArgument,
                  "operation name '" + name + "' may not start with '#' (reserved)");
  }
  if (name.size() > wire::kMaxOpName) {
    return Status(StatusCode::kInvalidArgument,
                  "operation name longer than " + std::to_string(wire::kMaxOpName) +
                      " bytes: " + name);
  }
  if (!wire::IsValidUtf8(name.data(), name.size())) {
    return Status(StatusCode::kInvalidArgument, "operation name is not valid UTF-8");
  }
  wire::SubmissionEntry& e = *out;
  e = wire::SubmissionEntry{};
  e.collective = static_cast<uint32_t>(collective);
  e.dtype = static_cast<uint32_t>(dtype);
  e.reduce_op = reduce_op;
  e.root = root;
  e.count = count;
  e.timeout_ms = opts.timeout_ms;
  e.priority = opts.priority;
  if (!opts.compression.empty()) {
    Status parsed = ParseCompression(opts.compression, &e.codec, &e.codec_ratio);
    if (!parsed.ok()) return Status(parsed.code(), "operation '" + name + "': " + parsed.message());
  }
  e.name_len = static_cast<uint32_t>(name.size());
  std::memcpy(e.name, name.data(), name.size());
  return Status::Ok();
}

Handle Communicator::Impl::Submit(wire::Collective collective, DataType dtype,
                                  uint32_t reduce_op, int root, size_t count, Span send,
                                  Span recv, void* user_recv, const OpOptions& opts,
                                  const std::vector<uint64_t>* splits) {
  Core& c = *core;
  std::string name;
  wire::SubmissionEntry e;
  Status made = MakeEntry(collective, dtype, reduce_op, root, count, opts, &e, &name);
  if (!made.ok()) return Failed(made);
  if ((send.bytes > 0 && send.ptr == nullptr) || (recv.bytes > 0 && recv.ptr == nullptr)) {
    return Failed(Status(StatusCode::kInvalidArgument, "operation '" + name +
                                                           "': null buffer"));
  }
  auto st = std::make_shared<Handle::State>();
  st->core = core;
  st->name = name;
  st->give_up = Clock::now() + GiveUpAfter(e.timeout_ms, c);
  if (splits != nullptr) {
    Status s = StageSplits(*splits, *st, e);
    if (!s.ok()) return Failed(Status(s.code(), "operation '" + name + "': " + s.message()));
  }

  // In a job with a fast path every valid operation takes its key there,
  // large ones too, and learns its route (proto/ciuic/fast_path.h).
  bool daemon_bound_key = false;
  if (c.fast && FastValid(e, send, recv)) {
    Status started = c.fast->Start(name, FastSignature(e, false), send.ptr, send.bytes,
                                   user_recv, e.timeout_ms, &st->fast, FastFits(e),
                                   &daemon_bound_key);
    if (!started.ok()) return Failed(started);
    if (!daemon_bound_key) return Handle(st);
  }

  // Buffers outside shared memory go through one staging region that
  // covers both (so in-place layouts stay in place).
  const bool send_shared = send.bytes == 0 || c.arena->Contains(send.ptr, send.bytes);
  const bool recv_shared = recv.bytes == 0 || c.arena->Contains(recv.ptr, recv.bytes);
  if (send_shared && recv_shared) {
    if (send.bytes > 0) e.send_offset = c.arena->OffsetOf(send.ptr);
    if (recv.bytes > 0) e.recv_offset = c.arena->OffsetOf(recv.ptr);
  } else {
    // Buffers outside shared memory are copied through staging buffers; if
    // send and recv overlap (in place), one staging buffer covers both so
    // that the layout stays in place.
    auto* sp = static_cast<const uint8_t*>(send.ptr);
    auto* rp = static_cast<const uint8_t*>(recv.ptr);
    const bool overlap = send.bytes > 0 && recv.bytes > 0 && sp < rp + recv.bytes &&
                         rp < sp + send.bytes;
    auto stage = [&](const uint8_t* lo, size_t bytes, Buffer* into, uint64_t* off) -> Status {
      Status s = c.arena->Allocate(bytes, off);
      if (!s.ok()) return Status(s.code(), "operation '" + name + "': " + s.message());
      *into = BufferAccess::Make(c.arena, *off, bytes);
      return Status::Ok();
    };
    if (overlap) {
      const uint8_t* lo = std::min(sp, rp);
      const uint8_t* hi = std::max(sp + send.bytes, rp + recv.bytes);
      uint64_t off = 0;
      Status s = stage(lo, hi - lo, &st->staging, &off);
      if (!s.ok()) return Failed(s);
      uint8_t* base = c.arena->base + off;
      std::memcpy(base + (sp - lo), sp, send.bytes);
      e.send_offset = off + (sp - lo);
      e.recv_offset = off + (rp - lo);
      st->staging_recv = base + (rp - lo);
      st->user_recv = user_recv;
      st->recv_bytes = recv.bytes;
    } else {
      if (send.bytes > 0 && !send_shared) {
        uint64_t off = 0;
        Status s = stage(sp, send.bytes, &st->staging, &off);
        if (!s.ok()) return Failed(s);
        std::memcpy(c.arena->base + off, sp, send.bytes);
        e.send_offset = off;
      } else if (send.bytes > 0) {
        e.send_offset = c.arena->OffsetOf(send.ptr);
      }
      if (recv.bytes > 0 && !recv_shared) {
        uint64_t off = 0;
        Status s = stage(rp, recv.bytes, &st->staging_out, &off);
        if (!s.ok()) return Failed(s);
        e.recv_offset = off;
        st->staging_recv = c.arena->base + off;
        st->user_recv = user_recv;
        st->recv_bytes = recv.bytes;
      } else if (recv.bytes > 0) {
        e.recv_offset = c.arena->OffsetOf(recv.ptr);
      }
    }
  }

  Handle h = Publish(st, e);
  if (daemon_bound_key) {
    c.fast->TrackDaemon(std::shared_ptr<const std::atomic<bool>>(st, &st->done));
  }
  return h;
}

Handle Communicator::Impl::Publish(const std::shared_ptr<Handle::State>& st,
                                   wire::SubmissionEntry& e) {
  Core& c = *core;
  std::lock_guard<std::mutex> lock(c.submit_mu);
  // At most a ring's worth in flight, so the daemon never meets a full
  // completion ring.
  if (c.inflight_count.load() >= c.header->sq_capacity &&
      !c.WaitUntil([&c] { return c.inflight_count.load() < c.header->sq_capacity; },
                   st->give_up)) {
    Core::Finish(*st, Status(StatusCode::kDeadlineExceeded,
                             "operation '" + st->name + "': ciuicd has completed none of the " +
                                 std::to_string(c.inflight_count.load()) +
                                 " operations in flight long after this one's deadlines: "
                                 "the daemon is stopped or hung"));
    return Handle(st);
  }
  {
    std::lock_guard<std::mutex> reap_lock(c.reap_mu);
    if (!c.dead.ok()) {
      Core::Finish(*st, c.dead);
      return Handle(st);
    }
    st->op_id = c.next_op_id.fetch_add(1);
    e.op_id = st->op_id;
    st->poll_us = internal::PollMicros(
        c.spin_us, static_cast<wire::Collective>(e.collective),
        e.count * wire::DataTypeSize(e.dtype), options.world_size, options.local_size);
    c.inflight.emplace(st->op_id, st);
    c.inflight_count.fetch_add(1);
  }
  std::memcpy(&c.sq[c.sq_tail & (c.header->sq_capacity - 1)], &e, sizeof(e));
  ++c.sq_tail;
  c.header->sq_tail.store(c.sq_tail, std::memory_order_seq_cst);
  if (c.header->daemon_armed.exchange(0, std::memory_order_seq_cst) != 0) {
    uint64_t one = 1;
    (void)!write(c.doorbell_fd, &one, sizeof(one));
  }
  return Handle(st);
}

Status Communicator::Impl::StageSplits(const std::vector<uint64_t>& splits, Handle::State& st,
                                       wire::SubmissionEntry& e) {
  // The counts live in the arena until the operation completes.
  const size_t bytes = splits.size() * sizeof(uint64_t);
  uint64_t off = 0;
  Status s = core->arena->Allocate(bytes, &off);
  if (!s.ok()) return s;
  st.splits = BufferAccess::Make(core->arena, off, bytes);
  std::memcpy(core->arena->base + off, splits.data(), bytes);
  e.splits_offset = off;
  return Status::Ok();
}

Handle Communicator::Impl::SubmitDevice(wire::Collective collective, DataType dtype,
                                        uint32_t reduce_op, int root, size_t count,
                                        DeviceBuffer send, size_t send_bytes, DeviceBuffer recv,
                                        size_t recv_bytes, const OpOptions& opts,
                                        const std::vector<uint64_t>* splits) {
  Core& c = *core;
  std::string name;
  wire::SubmissionEntry e;
  Status made = MakeEntry(collective, dtype, reduce_op, root, count, opts, &e, &name);
  if (!made.ok()) return Failed(made);
  auto fail = [&](const Status& s) {
    return Failed(Status(s.code(), "operation '" + name + "': " + s.message()));
  };
  std::string why;
  if (!SdkSupportsDeviceBuffers(&why)) return fail(Status(StatusCode::kFailedPrecondition, why));
  if ((send_bytes > 0 && send.ptr == nullptr) || (recv_bytes > 0 && recv.ptr == nullptr)) {
    return fail(Status(StatusCode::kInvalidArgument, "null device buffer"));
  }
  if (send_bytes > 0 && recv_bytes > 0 && send.device != recv.device) {
    return fail(Status(StatusCode::kInvalidArgument,
                       "send buffer on device " + std::to_string(send.device) +
                           " and recv buffer on device " + std::to_string(recv.device) +
                           ": one rank's buffers must be on one device"));
  }
  wire::DeviceBufferDescriptor records[2] = {};  // send, recv
  if (send_bytes > 0) {
    Status s = device.Describe(send.ptr, send_bytes, send.device, &records[0]);
    if (!s.ok()) return fail(s);
  }
  if (recv_bytes > 0) {
    Status s = device.Describe(recv.ptr, recv_bytes, recv.device, &records[1]);
    if (!s.ok()) return fail(s);
  }
  auto st = std::make_shared<Handle::State>();
  st->core = core;
  st->name = name;
  st->give_up = Clock::now() + GiveUpAfter(e.timeout_ms, c);
  if (splits != nullptr) {
    Status s = StageSplits(*splits, *st, e);
    if (!s.ok()) return fail(s);
  }
  if (send_bytes > 0 || recv_bytes > 0) {
    // One event on the trainer's stream orders the daemon after everything
    // enqueued there so far, for both buffers.
    uint8_t event[wire::kCudaIpcHandleBytes];
    Status s = device.RecordEvent(opts.stream, recv_bytes > 0 ? recv.device : send.device, event,
                                  &st->device_event);
    if (!s.ok()) return fail(s);
    for (auto& r : records) {
      std::memcpy(r.event_handle, event, sizeof(event));
      r.flags |= wire::kDeviceDescriptorEventValid;
    }
  }
  // The records live in the arena until the operation completes.
  uint64_t off = 0;
  Status s = c.arena->Allocate(sizeof(records), &off);
  if (!s.ok()) return fail(s);
  st->staging = BufferAccess::Make(c.arena, off, sizeof(records));
  std::memcpy(c.arena->base + off, records, sizeof(records));
  e.flags = wire::kSubmitFlagDeviceBuffers;
  e.send_offset = off;
  e.recv_offset = off + sizeof(records[0]);
  // Device operations always go to the daemon, but in a job with a fast
  // path they take their key too (as a large one does), so that a rank with
  // host buffers for the same operation learns it (proto/ciuic/fast_path.h).
  bool daemon_bound_key = false;
  if (c.fast && FastValid(e, Span{nullptr, 0}, Span{nullptr, 0})) {
    Status started = c.fast->Start(name, FastSignature(e, true), nullptr, 0, nullptr,
                                   e.timeout_ms, &st->fast, /*fits=*/false, &daemon_bound_key);
    if (!started.ok()) return Failed(started);
    if (!daemon_bound_key) return Handle(st);  // failed: a host rank waits on the fast path
  }
  Handle h = Publish(st, e);
  if (daemon_bound_key) {
    c.fast->TrackDaemon(std::shared_ptr<const std::atomic<bool>>(st, &st->done));
  }
  return h;
}

Handle Communicator::Allreduce(DeviceBuffer send, DeviceBuffer recv, size_t count,
                               DataType dtype, ReduceOp op, const OpOptions& options) {
  const size_t bytes = count * DataTypeSize(dtype);
  return impl_->SubmitDevice(wire::Collective::kAllreduce, dtype, static_cast<uint32_t>(op), 0,
                             count, send, bytes, recv, bytes, options);
}

Handle Communicator::ReduceScatter(DeviceBuffer send, DeviceBuffer recv, size_t recv_count,
                                   DataType dtype, ReduceOp op, const OpOptions& options) {
  const size_t block = recv_count * DataTypeSize(dtype);
  return impl_->SubmitDevice(wire::Collective::kReduceScatter, dtype, static_cast<uint32_t>(op),
                             0, recv_count, send, block * world_size(), recv, block, options);
}

Handle Communicator::Allgather(DeviceBuffer send, DeviceBuffer recv, size_t send_count,
                               DataType dtype, const OpOptions& options) {
  const size_t block = send_count * DataTypeSize(dtype);
  return impl_->SubmitDevice(wire::Collective::kAllgather, dtype, 0, 0, send_count, send, block,
                             recv, block * world_size(), options);
}

Handle Communicator::Broadcast(DeviceBuffer send, DeviceBuffer recv, size_t count,
                               DataType dtype, int root, const OpOptions& options) {
  const size_t bytes = count * DataTypeSize(dtype);
  return impl_->SubmitDevice(wire::Collective::kBroadcast, dtype, 0, root, count, send,
                             root == rank() ? bytes : 0, recv, bytes, options);
}

Handle Communicator::Alltoall(DeviceBuffer send, DeviceBuffer recv, size_t count,
                              DataType dtype, const OpOptions& options) {
  const size_t all = count * DataTypeSize(dtype) * world_size();
  return impl_->SubmitDevice(wire::Collective::kAlltoall, dtype, 0, 0, count, send, all, recv,
                             all, options);
}

Handle Communicator::Allreduce(const void* send, void* recv, size_t count, DataType dtype,
                               ReduceOp op, const OpOptions& options) {
  const size_t bytes = count * DataTypeSize(dtype);
  return impl_->Submit(wire::Collective::kAllreduce, dtype, static_cast<uint32_t>(op), 0, count,
                       {send, bytes}, {recv, bytes}, recv, options);
}

Handle Communicator::ReduceScatter(const void* send, void* recv, size_t recv_count,
                                   DataType dtype, ReduceOp op, const OpOptions& options) {
  const size_t block = recv_count * DataTypeSize(dtype);
  return impl_->Submit(wire::Collective::kReduceScatter, dtype, static_cast<uint32_t>(op), 0,
                       recv_count, {send, block * world_size()}, {recv, block}, recv, options);
}

Handle Communicator::Allgather(const void* send, void* recv, size_t send_count, DataType dtype,
                               const OpOptions& options) {
  const size_t block = send_count * DataTypeSize(dtype);
  return impl_->Submit(wire::Collective::kAllgather, dtype, 0, 0, send_count, {send, block},
                       {recv, block * world_size()}, recv, options);
}

Handle Communicator::Broadcast(const void* send, void* recv, size_t count, DataType dtype,
                               int root, const OpOptions& options) {
  const size_t bytes = count * DataTypeSize(dtype);
  const size_t send_bytes = root == rank() ? bytes : 0;
  return impl_->Submit(wire::Collective::kBroadcast, dtype, 0, root, count,
                       {send, send_bytes}, {recv, bytes}, recv, options);
}

Handle Communicator::Alltoall(const void* send, void* recv, size_t count, DataType dtype,
                              const OpOptions& options) {
  const size_t all = count * DataTypeSize(dtype) * world_size();
  return impl_->Submit(wire::Collective::kAlltoall, dtype, 0, 0, count, {send, all},
                       {recv, all}, recv, options);
}

namespace {

// Alltoallv's counts as the daemon reads them (send_counts then
// recv_counts) and the bytes they make (send, recv), or why they are wrong.
Status AlltoallvSplits(int world_size, const std::vector<size_t>& send_counts,
                       const std::vector<size_t>& recv_counts, DataType dtype,
                       std::vector<uint64_t>* splits, size_t bytes[2]) {
  const size_t w = static_cast<size_t>(world_size);
  if (send_counts.size() != w || recv_counts.size() != w) {
    return Status(StatusCode::kInvalidArgument,
                  "alltoallv: " + std::to_string(send_counts.size()) + " send and " +
                      std::to_string(recv_counts.size()) + " recv counts for " +
                      std::to_string(w) + " ranks (one per rank each)");
  }
  splits->assign(send_counts.begin(), send_counts.end());
  splits->insert(splits->end(), recv_counts.begin(), recv_counts.end());
  const size_t es = DataTypeSize(dtype);
  bytes[0] = bytes[1] = 0;
  for (size_t k = 0; k < splits->size(); ++k) {
    size_t b = 0;
    if (__builtin_mul_overflow((*splits)[k], es, &b) ||
        __builtin_add_overflow(bytes[k / w], b, &bytes[k / w])) {
      return Status(StatusCode::kInvalidArgument,
                    std::string("alltoallv: the ") + (k < w ? "send" : "recv") +
                        " counts add up to more bytes than memory holds");
    }
  }
  return Status::Ok();
}

}  // namespace

Handle Communicator::Alltoallv(const void* send, const std::vector<size_t>& send_counts,
                               void* recv, const std::vector<size_t>& recv_counts,
                               DataType dtype, const OpOptions& options) {
  std::vector<uint64_t> splits;
  size_t bytes[2];
  Status s = AlltoallvSplits(world_size(), send_counts, recv_counts, dtype, &splits, bytes);
  if (!s.ok()) return impl_->Failed(s);
  return impl_->Submit(wire::Collective::kAlltoallv, dtype, 0, 0, 0, {send, bytes[0]},
                       {recv, bytes[1]}, recv, options, &splits);
}

Handle Communicator::Alltoallv(DeviceBuffer send, const std::vector<size_t>& send_counts,
                               DeviceBuffer recv, const std::vector<size_t>& recv_counts,
                               DataType dtype, const OpOptions& options) {
  std::vector<uint64_t> splits;
  size_t bytes[2];
  Status s = AlltoallvSplits(world_size(), send_counts, recv_counts, dtype, &splits, bytes);
  if (!s.ok()) return impl_->Failed(s);
  return impl_->SubmitDevice(wire::Collective::kAlltoallv, dtype, 0, 0, 0, send, bytes[0], recv,
                             bytes[1], options, &splits);
}

Handle Communicator::Barrier(const OpOptions& options) {
  return impl_->Submit(wire::Collective::kBarrier, DataType::kFloat32, 0, 0, 0, {nullptr, 0},
                       {nullptr, 0}, nullptr, options);
}

}  // namespace ciuic
