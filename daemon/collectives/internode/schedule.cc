#include "collectives/internode/schedule.h"

#include <algorithm>
#include <bit>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <utility>

#include "absl/strings/str_cat.h"
#include "collectives/internode/common.h"
#include "reduce/reduce.h"

namespace ciuic::daemon::internode_internal {

bool Side::SameRanges(const Side& other) const {
  if (ranges_.size() != other.ranges_.size()) return false;
  for (size_t i = 0; i < ranges_.size(); ++i) {
    if (ranges_[i].bytes != other.ranges_[i].bytes) return false;
  }
  return true;
}

void Side::Cut(size_t chunk_bytes) {
  chunk_bytes_ = chunk_bytes;
  first_chunk_.resize(ranges_.size());
  num_chunks_ = 0;
  for (size_t r = 0; r < ranges_.size(); ++r) {
    first_chunk_[r] = num_chunks_;
    num_chunks_ += (ranges_[r].bytes + chunk_bytes - 1) / chunk_bytes;
  }
}

Range Side::chunk(size_t i) const {
  // Almost always a single range; several only for allgather blocks.
  const size_t r =
      std::upper_bound(first_chunk_.begin(), first_chunk_.end(), i) - first_chunk_.begin() - 1;
  const size_t offset = (i - first_chunk_[r]) * chunk_bytes_;
  return {ranges_[r].ptr + offset, std::min(chunk_bytes_, ranges_[r].bytes - offset)};
}

int ChunkBits(uint32_t num_tag_steps, int tag_bits) {
  const int step_bits = num_tag_steps <= 1 ? 0 : std::bit_width(num_tag_steps - 1);
  return step_bits > tag_bits ? -1 : tag_bits - step_bits;
}

absl::StatusOr<size_t> PlanChunkBytes(size_t requested, size_t elem, int chunk_bits,
                                      const std::function<size_t(size_t)>& chunks_at) {
  if (chunk_bits < 0) return absl::InvalidArgumentError("too many steps for the tag field");
  const size_t max_chunks = size_t{1} << chunk_bits;
  size_t chunk = std::max(elem, requested / elem * elem);
  while (chunks_at(chunk) > max_chunks) {
    if (chunk > (SIZE_MAX >> 2)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "more ranges in one step than the tag's chunk field holds (", max_chunks, ")"));
    }
    chunk *= 2;
  }
  return chunk;
}

absl::Status CheckContext(const InterNodeContext& ctx, const char* name) {
  if (ctx.transport == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(name, ": no transport"));
  }
  if (ctx.tag_bits < kMinTagBits || ctx.tag_bits > kTagFieldBits) {
    return absl::InvalidArgumentError(absl::StrCat(name, ": tag_bits ", ctx.tag_bits,
                                                   " is outside ", kMinTagBits, "..",
                                                   kTagFieldBits));
  }
  if ((ctx.tag_base & ((uint64_t{1} << ctx.tag_bits) - 1)) != 0) {
    return absl::InvalidArgumentError(absl::StrCat(name, ": tag_base ", ctx.tag_base,
                                                   " has some of its low ", ctx.tag_bits,
                                                   " bits set"));
  }
  return absl::OkStatus();
}

namespace {

enum : uint8_t { kIdle = 0, kPosted = 1, kArrived = 2, kDone = 3 };

// A reducing step folds each chunk into its destination as it arrives
// (Transport::RecvReduce) unless the destination must wait for a send to
// complete first (write_after_send_step): such a chunk is received into
// scratch and folded once the send is done. Posting the receive itself only
// after that send could deadlock, since a rendezvous send completes only
// once its receive is posted on the other side.
bool FoldsOnArrival(const Step& st) { return st.reduce && st.write_after_send_step < 0; }

// A finished transfer, queued by its callback for the running thread.
struct Event {
  uint32_t step;
  bool is_send;
  int slot;  // scratch slot of a reducing receive, else -1
  size_t chunk;
  absl::Status status;
};

class Runner;

// What the transfer callbacks share with the runner: a queue of finished
// transfers and a "driver" token. The thread that queues an event while no
// thread drives takes the token and runs the runner on the queue (applies
// the events, reduces, posts what they unblock) until the queue is empty;
// an event that arrives meanwhile (from another channel's thread, or from
// within a transport call of the driver itself) is left for the driver. So
// the schedule advances on the transport's threads as transfers complete,
// with no hop to another thread per chunk, and the calling thread sleeps
// once per schedule. Held by shared_ptr: a callback may still be unwinding
// after the runner finished.
struct Driver {
  std::mutex mu;
  std::condition_variable finished_cv;
  std::vector<Event> events;      // guarded by mu
  bool driving = false;           // guarded by mu
  bool deadline_passed = false;   // guarded by mu: for the driver to act on
  bool finished = false;          // guarded by mu
  Runner* runner = nullptr;       // used by the driving thread until finished
};

struct StepState {
  std::vector<uint8_t> send;  // kIdle, kPosted, kDone per chunk
  std::vector<uint8_t> recv;  // kIdle, kPosted, kArrived (in scratch), kDone (written)
  size_t recvs_done = 0;
};

struct Arrived {
  uint32_t step;
  int slot;
  size_t chunk;
};

class Runner {
 public:
  Runner(const InterNodeContext& ctx, Schedule& s, size_t chunk_bytes, int chunk_bits)
      : ctx_(ctx),
        s_(s),
        chunk_bytes_(chunk_bytes),
        chunk_bits_(chunk_bits),
        max_inflight_(std::max(1, ctx.max_inflight)),
        num_channels_(std::max(1, ctx.transport->num_channels())),
        elem_(wire::DataTypeSize(static_cast<uint32_t>(s.dtype))),
        driver_(std::make_shared<Driver>()) {}

  absl::Status Run();
  // One round on the driving thread: applies `events`, acts on a passed
  // deadline, posts and reduces what can go now. True once the schedule is
  // over (every transfer's callback has run).
  bool Advance(std::vector<Event>& events, bool deadline_passed);

 private:
  // Where a channel's next send or receive is in the schedule, and how
  // many of its transfers are in flight. Each channel walks its own chunks
  // (ChannelOf) in schedule order with its own window of max_inflight_, so
  // that a slow link never holds back a fast one's chunks (channels with
  // weights, channel_table).
  struct Cursor {
    size_t step = 0;
    size_t chunk = 0;
    int in_flight = 0;
  };

  absl::Status Prepare();
  // Moves `cur` to the first chunk of `channel` at or after it, in this or
  // a later step (step == steps.size() at the end); `recv`: receive sides.
  void Seek(Cursor& cur, int channel, bool recv) const;
  bool PostSends();
  bool PostRecvs();
  bool ReduceArrived();
  void Apply(Event& e);
  // At the deadline, or once the schedule has failed (a transfer, a
  // reduction): fails the peers of the transfers still posted on the
  // transport (sticky: a job-level fault), so that they end at once rather
  // than wait for peers that wait for this node. error_ names the first
  // transfer awaited when nothing failed before.
  void Cancel();
  bool AllDone();
  absl::Status Named(const absl::Status& s, uint32_t step, bool is_send, size_t chunk) const;
  TransferDone Callback(uint32_t step, bool is_send, size_t chunk, int slot);
  uint64_t Tag(const Step& st, size_t chunk) const {
    return ctx_.tag_base | (uint64_t{st.tag_step} << chunk_bits_) | chunk;
  }
  int ChannelOf(size_t chunk) const {
    const std::vector<uint8_t>& table = ctx_.channel_table;
    if (!table.empty()) return table[chunk % table.size()];
    return static_cast<int>(chunk % num_channels_);
  }

  const InterNodeContext& ctx_;
  Schedule& s_;
  const size_t chunk_bytes_;
  const int chunk_bits_;
  const int max_inflight_;
  const int num_channels_;
  const size_t elem_;
  std::shared_ptr<Driver> driver_;

  std::vector<StepState> state_;
  std::vector<Cursor> sends_, recvs_;  // by channel
  // Per channel, its sends in flight at most: max_inflight_, or with a
  // channel table in proportion to the channel's share (at least 2), so
  // that a slow link's queue holds no more time's worth of chunks than a
  // fast one's: a deep queue on a slow link delays whatever else uses it
  // (the ordering stream, another job) and the operation's last chunks.
  std::vector<int> send_window_;
  int sends_in_flight_ = 0, recvs_in_flight_ = 0;  // all channels
  std::vector<Arrived> arrived_;  // received into scratch, not yet reduced
  uint8_t* scratch_ = nullptr;
  size_t slot_bytes_ = 0;
  // Per channel: channel c's slots are c * max_inflight_ .. + max_inflight_
  // - 1. A pool shared by the channels can deadlock: one channel's chunks,
  // received ahead and waiting for this node's own sends of them, hold
  // every slot, so that the other channel's earliest receive cannot be
  // posted, and the peer's send of it, which the peer's slots in turn wait
  // for, never completes. With
  // slots of its own each channel is a pipeline in the global order of its
  // own, whose earliest unfinished transfer can always proceed.
  std::vector<std::vector<int>> free_slots_;
  void FreeSlot(int slot) {
    free_slots_[static_cast<size_t>(slot / max_inflight_)].push_back(slot);
  }
  absl::Status error_;
  bool cancelled_ = false;
};

absl::Status Runner::Prepare() {
  state_.resize(s_.steps.size());
  sends_.assign(static_cast<size_t>(num_channels_), Cursor{});
  recvs_.assign(static_cast<size_t>(num_channels_), Cursor{});
  send_window_.assign(static_cast<size_t>(num_channels_), max_inflight_);
  if (!ctx_.channel_table.empty()) {
    std::vector<int> slots(static_cast<size_t>(num_channels_), 0);
    for (int c : ctx_.channel_table) {
      if (c < num_channels_) ++slots[static_cast<size_t>(c)];
    }
    const int most = *std::max_element(slots.begin(), slots.end());
    for (size_t c = 0; c < slots.size() && most > 0; ++c) {
      send_window_[c] = std::min(max_inflight_,
                                 std::max(2, (max_inflight_ * slots[c] + most - 1) / most));
    }
  }
  if (absl::Status s = internode_internal::CheckChannelTable(ctx_.channel_table, num_channels_,
                                                              s_.name);
      !s.ok()) {
    return s;
  }
  size_t reduce_chunk = 0;
  for (size_t i = 0; i < s_.steps.size(); ++i) {
    Step& st = s_.steps[i];
    if (st.send.peer < 0 && !st.send.empty()) return absl::InternalError("send without a peer");
    if (st.recv.peer < 0 && !st.recv.empty()) return absl::InternalError("receive without a peer");
    st.send.Cut(chunk_bytes_);
    st.recv.Cut(chunk_bytes_);
    if (chunk_bits_ < 0 ||
        uint64_t{st.tag_step} >= (uint64_t{1} << (ctx_.tag_bits - chunk_bits_))) {
      return absl::InternalError(absl::StrCat(s_.name, ": tag step out of range"));
    }
    state_[i].send.assign(st.send.num_chunks(), kIdle);
    state_[i].recv.assign(st.recv.num_chunks(), kIdle);
    if (st.send_dep == Dep::kChunk &&
        !s_.steps[st.send_dep_step].recv.SameRanges(st.send)) {
      return absl::InternalError(absl::StrCat(s_.name, ": chunk dependency between unequal sides"));
    }
    if (st.write_after_send_step >= 0 &&
        !s_.steps[st.write_after_send_step].send.SameRanges(st.recv)) {
      return absl::InternalError(absl::StrCat(s_.name, ": write dependency between unequal sides"));
    }
    if (st.reduce && !FoldsOnArrival(st)) {
      for (size_t c = 0; c < st.recv.num_chunks(); ++c) {
        reduce_chunk = std::max(reduce_chunk, st.recv.chunk(c).bytes);
      }
    }
  }
  if (reduce_chunk > 0) {
    if (ctx_.scratch == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat(s_.name, ": no scratch buffer"));
    }
    slot_bytes_ = (reduce_chunk + 63) / 64 * 64;
    // A window of receives per channel, each channel's its own.
    const int slots = max_inflight_ * num_channels_;
    scratch_ = ctx_.scratch->Get(slot_bytes_ * slots);
    if (scratch_ == nullptr) {
      return absl::ResourceExhaustedError(absl::StrCat(
          s_.name, ": cannot map ", slot_bytes_ * slots, " bytes of scratch space"));
    }
    free_slots_.resize(static_cast<size_t>(num_channels_));
    for (int i = slots - 1; i >= 0; --i) FreeSlot(i);
  }
  return absl::OkStatus();
}

absl::Status Runner::Named(const absl::Status& s, uint32_t step, bool is_send,
                           size_t chunk) const {
  const Step& st = s_.steps[step];
  return absl::Status(
      s.code(), absl::StrCat(s_.name, ": ", is_send ? "send to " : "receive from ",
                             NodeLabel(ctx_.node_names, is_send ? st.send.peer : st.recv.peer),
                             " (step ", st.tag_step,
                             ", chunk ", chunk, ") failed: ", s.message()));
}

// Holding the token (driving set, lock held): runs rounds while there is
// something to act on, then gives the token back (or marks the schedule
// finished and wakes the caller). `first`: run one round even with nothing
// queued (the caller's initial posting).
void Drive(Driver& d, std::unique_lock<std::mutex>& lock, bool first) {
  std::vector<Event> batch;
  while (first || !d.events.empty() || d.deadline_passed) {
    first = false;
    batch.clear();
    batch.swap(d.events);
    const bool deadline_passed = std::exchange(d.deadline_passed, false);
    lock.unlock();
    const bool over = d.runner->Advance(batch, deadline_passed);
    lock.lock();
    if (over) {
      // Nothing is in flight, so no callback will queue anything: the runner
      // (on the caller's stack) must not be touched after this.
      d.finished = true;
      d.runner = nullptr;
      d.finished_cv.notify_all();
      break;
    }
  }
  d.driving = false;
}

TransferDone Runner::Callback(uint32_t step, bool is_send, size_t chunk, int slot) {
  return [driver = driver_, step, is_send, chunk, slot](absl::Status status) {
    Driver& d = *driver;
    std::unique_lock<std::mutex> lock(d.mu);
    d.events.push_back(Event{step, is_send, slot, chunk, std::move(status)});
    if (d.driving) return;
    d.driving = true;
    Drive(d, lock, false);
  };
}

void Runner::Seek(Cursor& cur, int channel, bool recv) const {
  while (cur.step < s_.steps.size()) {
    const Side& side = recv ? s_.steps[cur.step].recv : s_.steps[cur.step].send;
    const size_t n = side.num_chunks();
    while (cur.chunk < n && ChannelOf(cur.chunk) != channel) ++cur.chunk;
    if (cur.chunk < n) return;
    ++cur.step;
    cur.chunk = 0;
  }
}

bool Runner::PostSends() {
  bool posted = false;
  const bool yielding = ctx_.yield != nullptr && ctx_.yield->load(std::memory_order_relaxed) > 0;
  for (int c = 0; c < num_channels_; ++c) {
    Cursor& cur = sends_[static_cast<size_t>(c)];
    const int window = yielding ? 1 : send_window_[static_cast<size_t>(c)];
    while (true) {
      Seek(cur, c, false);
      if (cur.step >= s_.steps.size() || cur.in_flight >= window) break;
      const Step& st = s_.steps[cur.step];
      if (st.send_dep == Dep::kChunk && state_[st.send_dep_step].recv[cur.chunk] != kDone) break;
      if (st.send_dep == Dep::kAll &&
          state_[st.send_dep_step].recvs_done != state_[st.send_dep_step].recv.size()) {
        break;
      }
      const Range r = st.send.chunk(cur.chunk);
      state_[cur.step].send[cur.chunk] = kPosted;
      ++cur.in_flight;
      ++sends_in_flight_;
      ctx_.transport->Send(st.send.peer, c, Tag(st, cur.chunk), r.ptr, r.bytes,
                           Callback(static_cast<uint32_t>(cur.step), true, cur.chunk, -1));
      ++cur.chunk;
      posted = true;
    }
  }
  return posted;
}

bool Runner::PostRecvs() {
  bool posted = false;
  for (int c = 0; c < num_channels_; ++c) {
    Cursor& cur = recvs_[static_cast<size_t>(c)];
    while (true) {
      Seek(cur, c, true);
      if (cur.step >= s_.steps.size() || cur.in_flight >= max_inflight_) break;
      const Step& st = s_.steps[cur.step];
      const Range r = st.recv.chunk(cur.chunk);
      const auto step = static_cast<uint32_t>(cur.step);
      uint8_t* into = r.ptr;
      int slot = -1;
      auto mark_posted = [&] {
        state_[cur.step].recv[cur.chunk] = kPosted;
        ++cur.in_flight;
        ++recvs_in_flight_;
      };
      if (FoldsOnArrival(st)) {
        mark_posted();
        ReduceInto fold;
        fold.dtype = s_.dtype;
        fold.op = s_.op;
        fold.received_first = st.received_first;
        fold.dest = r.ptr;
        fold.local =
            reinterpret_cast<const void*>(reinterpret_cast<uintptr_t>(r.ptr) + st.local_offset);
        ctx_.transport->RecvReduce(st.recv.peer, c, Tag(st, cur.chunk), fold, r.bytes,
                                   Callback(step, false, cur.chunk, -1));
        ++cur.chunk;
        posted = true;
        continue;
      }
      if (st.reduce) {
        std::vector<int>& free = free_slots_[static_cast<size_t>(c)];
        if (free.empty()) break;
        slot = free.back();
        free.pop_back();
        into = scratch_ + static_cast<size_t>(slot) * slot_bytes_;
      } else if (st.write_after_send_step >= 0 &&
                 state_[st.write_after_send_step].send[cur.chunk] != kDone) {
        break;
      }
      mark_posted();
      ctx_.transport->Recv(st.recv.peer, c, Tag(st, cur.chunk), into, r.bytes,
                           Callback(step, false, cur.chunk, slot));
      ++cur.chunk;
      posted = true;
    }
  }
  return posted;
}

bool Runner::ReduceArrived() {
  bool reduced = false;
  for (size_t i = 0; i < arrived_.size();) {
    const Arrived a = arrived_[i];
    const Step& st = s_.steps[a.step];
    if (st.write_after_send_step >= 0 &&
        state_[st.write_after_send_step].send[a.chunk] != kDone) {
      ++i;
      continue;
    }
    const Range r = st.recv.chunk(a.chunk);
    const void* received = scratch_ + static_cast<size_t>(a.slot) * slot_bytes_;
    const void* local =
        reinterpret_cast<const void*>(reinterpret_cast<uintptr_t>(r.ptr) + st.local_offset);
    const void* inputs[2] = {received, local};
    if (!st.received_first) std::swap(inputs[0], inputs[1]);
    Reduce(s_.dtype, s_.op, inputs, 2, r.ptr, r.bytes / elem_);
    state_[a.step].recv[a.chunk] = kDone;
    ++state_[a.step].recvs_done;
    FreeSlot(a.slot);
    arrived_[i] = arrived_.back();
    arrived_.pop_back();
    reduced = true;
  }
  return reduced;
}

void Runner::Apply(Event& e) {
  const auto channel = static_cast<size_t>(ChannelOf(e.chunk));
  if (e.is_send) {
    --sends_[channel].in_flight;
    --sends_in_flight_;
    state_[e.step].send[e.chunk] = kDone;
  } else {
    --recvs_[channel].in_flight;
    --recvs_in_flight_;
    if (!e.status.ok() || !error_.ok()) {
      if (e.slot >= 0) FreeSlot(e.slot);
      state_[e.step].recv[e.chunk] = kArrived;  // not written, not outstanding
    } else if (e.slot >= 0) {
      state_[e.step].recv[e.chunk] = kArrived;
      arrived_.push_back({e.step, e.slot, e.chunk});
    } else {
      state_[e.step].recv[e.chunk] = kDone;
      ++state_[e.step].recvs_done;
    }
  }
  if (!e.status.ok() && error_.ok()) error_ = Named(e.status, e.step, e.is_send, e.chunk);
}

bool Runner::AllDone() {
  for (int c = 0; c < num_channels_; ++c) {
    Seek(sends_[static_cast<size_t>(c)], c, false);
    Seek(recvs_[static_cast<size_t>(c)], c, true);
    if (sends_[static_cast<size_t>(c)].step != s_.steps.size() ||
        recvs_[static_cast<size_t>(c)].step != s_.steps.size()) {
      return false;
    }
  }
  return sends_in_flight_ == 0 && recvs_in_flight_ == 0 && arrived_.empty();
}

void Runner::Cancel() {
  cancelled_ = true;
  // Name the first transfer still awaited: receives first (a send usually
  // waits on the same peer's progress), in schedule order.
  std::vector<int> peers;
  bool named = !error_.ok();
  for (bool sends : {false, true}) {
    for (size_t i = 0; i < s_.steps.size(); ++i) {
      const std::vector<uint8_t>& st = sends ? state_[i].send : state_[i].recv;
      const auto it = std::find(st.begin(), st.end(), kPosted);
      if (it == st.end()) continue;
      const int peer = sends ? s_.steps[i].send.peer : s_.steps[i].recv.peer;
      if (!named) {
        error_ = absl::DeadlineExceededError(absl::StrCat(
            s_.name, ": deadline exceeded waiting for ", NodeLabel(ctx_.node_names, peer), " (",
            sends ? "send" : "receive", ", step ", s_.steps[i].tag_step, ", chunk ",
            it - st.begin(), ")"));
        named = true;
      }
      if (std::find(peers.begin(), peers.end(), peer) == peers.end()) peers.push_back(peer);
    }
  }
  if (!named) {
    error_ = absl::DeadlineExceededError(absl::StrCat(s_.name, ": deadline exceeded"));
  }
  for (int peer : peers) ctx_.transport->FailPeer(peer, error_);
}

bool Runner::Advance(std::vector<Event>& events, bool deadline_passed) {
  for (Event& e : events) Apply(e);
  if (deadline_passed) Cancel();
  if (error_.ok()) {
    // Reduce first: it frees scratch slots and satisfies send dependencies.
    while (ReduceArrived() | PostSends() | PostRecvs()) {
    }
  } else {
    for (const Arrived& a : arrived_) FreeSlot(a.slot);
    arrived_.clear();
  }
  const bool idle = sends_in_flight_ == 0 && recvs_in_flight_ == 0;
  if (!error_.ok() && !cancelled_ && !idle) Cancel();
  if (!idle) return false;
  if (error_.ok() && !AllDone()) {
    // Nothing outstanding and nothing can start: a schedule bug, not a hang.
    error_ = absl::InternalError(absl::StrCat(s_.name, ": schedule cannot progress"));
  }
  return true;
}

absl::Status Runner::Run() {
  if (absl::Status s = Prepare(); !s.ok()) return s;
  Driver& d = *driver_;
  std::unique_lock<std::mutex> lock(d.mu);
  d.runner = this;
  d.driving = true;
  Drive(d, lock, true);
  if (s_.meanwhile) {
    lock.unlock();  // the transport's threads drive the schedule meanwhile
    s_.meanwhile();
    lock.lock();
  }
  // Until the deadline; after it, until the cancelled transfers' callbacks
  // have all come (the transport fires every one after FailPeer).
  bool cancelled = false;
  while (!d.finished) {
    if (cancelled) {
      d.finished_cv.wait(lock);
    } else if (d.finished_cv.wait_until(lock, ctx_.deadline) == std::cv_status::timeout &&
               !d.finished) {
      cancelled = true;
      d.deadline_passed = true;
      if (!d.driving) {
        d.driving = true;
        Drive(d, lock, false);
      }
    }
  }
  return error_;
}

}  // namespace

absl::Status RunSchedule(const InterNodeContext& ctx, Schedule& schedule, size_t chunk_bytes,
                         int chunk_bits) {
  Runner runner(ctx, schedule, chunk_bytes, chunk_bits);
  return runner.Run();
}

}  // namespace ciuic::daemon::internode_internal
