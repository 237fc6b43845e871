// The small-operation fast path of single-node jobs: one shared segment per
// job in which the job's trainers run small collectives among themselves,
// without a round trip through ciuicd.
//
// Who makes it. When the first rank of a job whose ranks all live on this
// node (local_size == world_size) joins, and the daemon's `fast_path_bytes`
// setting is not 0, ciuicd creates one memfd for the job (mode 0600, size
// sealed, mapped once and pre-faulted), writes the FastPathHeader, and sends
// the fd to every session that joins the job (SCM_RIGHTS on its session
// socket, one FastPathHello datagram, before the JoinJob reply goes out;
// JoinJobReply.fast_path_bytes says it is there). The uid check of Join keeps
// other users out of the job, hence out of its segment. The limit is fixed
// into the header when the segment is made, so every rank of a job decides
// identically which operations take the fast path; a later change of the
// setting applies to jobs formed later. So does op_timeout_ms, the timeout
// of fast-path operations that set none.
//
// Which operations. Those whose payload per rank (max of send and recv
// bytes, as the daemon counts them) is at most header.payload_bytes, of every
// collective, dtype and reduce op. Larger ones, and every operation of a job
// without a segment, go through the daemon's rings as before.
//
// How an operation runs (the SDK, sdk/src/fast_path.h). Operations are keyed
// by (name, n) where n counts this rank's submissions of that name, on
// either path, so ranks may submit names in any order and a name may be
// reused at once. (Submissions the SDK knows the daemon will refuse, such as
// an unknown dtype, take no key and are not counted.)
// Under the table lock a rank finds the key's slot or claims one (open
// addressing, linear probing, tombstones; the whole table is probed under one
// lock, so a key is never in two slots), compares the operation's signature
// with the slot's (a mismatch fails the slot for every rank), copies its
// input into the slot, and arrives. The last arriver computes the result
// with the same reduction kernels as the daemon (proto/reduce) and marks the
// slot done; the others spin briefly, then sleep on the slot's status futex.
// Every rank copies its result out and departs; the last to depart frees the
// slot (stores kTombstone, no lock needed: nobody looks for a key all ranks
// have left); a claimer that walks into an empty slot turns the tombstones
// just before it back into empty ones. The table has room for 2 * world_size * max_inflight_per_rank keys;
// a rank keeps at most max_inflight_per_rank operations in flight (fast-path
// ones, and daemon-bound ones that took a key),
// so a rank never finds the table full of live operations.
//
// Ranks that would take different paths. Whether an operation fits depends
// only on its signature, so ranks that submit the same signature take the
// same path; ranks that do not (a count on each side of the limit, a dtype
// or a collective that changes the size) must all get the mismatch error,
// at once, not a timeout. So in a job with a segment every operation, large
// ones too, takes its (name, n) key in the table, with its signature and its
// route: kFast (it runs here) or kDaemon (it went to the daemon). A rank
// arriving at a key:
//  1. no key yet: it claims it with its own signature and route. A large
//     operation, or one in CUDA device memory (kDaemon), joins, leaves at
//     once and goes to the daemon.
//  2. kFast key, own operation fits, signatures equal: it runs here.
//  3. kFast key, anything else (signatures differ, or ours goes to the
//     daemon: large, or in device memory, which is part of the signature): the
//     key fails with the daemon's mismatch wording, naming the operation and
//     both signatures; every waiter wakes with it, our operation fails with
//     it locally (a large one is then never sent to the daemon), and so does
//     every later arrival, whatever its size. A key failed earlier (timeout)
//     fails a large arrival the same way.
//  4. kDaemon key: some rank went to the daemon, so this one does too,
//     whatever its size, and leaves at once; the daemon's own matching then
//     reports the mismatch to every rank (or runs the operation when the
//     signatures agree).
// Every arrival order of 2 or 3+ ranks ends in one of: every rank runs it
// here (all fit and agree), every rank goes to the daemon (the first
// arriver was large), or every rank fails with the mismatch (a large or a
// mismatching rank came while the key was kFast); a kFast key never turns
// into kDaemon, so no rank waits here for one that went to the daemon.
// A key is freed when all world_size ranks have left it, as before; a rank
// arriving at a kDaemon key leaves at once (the last to join frees it, under
// the lock; such a key uses only the fields on its first two cache lines, so
// a large operation costs one short locked probe and few shared lines). The
// in-flight limit (above) counts a rank's daemon-bound operations too, until
// the daemon completes them (a success comes only once every rank has
// submitted, hence arrived here and left), so kDaemon keys cannot fill the
// table either; a failed one may keep its key until the late ranks come,
// as a failed fast-path key does.
//
// Faults. A rank whose wait passes its operation's deadline fails the slot
// (timeout) for every rank. When a session of the job closes (trainer died),
// or the job fails, the daemon writes abort_code/abort_message, sets
// `aborted`, and wakes every slot's futex: every rank's pending and later
// fast-path operations fail with that error.
//
// Trust. Any trainer of the job can write anything here. The daemon never
// follows or trusts anything in the segment: it writes the abort fields and
// FUTEX_WAKEs addresses it computed itself, and reads counters and slot
// fields only as plain numbers and bounded bytes for `ciuicctl status`.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <new>
#include <string>

#include "ciuic/shm_layout.h"

namespace ciuic::wire {

inline constexpr uint64_t kFastPathMagic = 0x31765f7473616663ULL;  // "cfast_v1"
inline constexpr uint32_t kFastPathVersion = 3;  // 2: FastSlot.route; 3: FastSlot.done_ns
inline constexpr uint32_t kMaxFastPathRanks = 32;
// The segment never exceeds this; jobs that would need more get none.
inline constexpr uint64_t kMaxFastPathSegmentBytes = 64ull << 20;
inline constexpr uint32_t kMaxFastPathInflight = 256;  // per rank
inline constexpr uint32_t kMinFastPathInflight = 16;

struct alignas(64) FastPathHeader {
  uint64_t magic;  // kFastPathMagic
  uint32_t version;
  uint32_t world_size;
  uint64_t segment_bytes;
  uint64_t payload_bytes;          // per rank and operation
  uint32_t slot_count;             // power of two
  uint32_t max_inflight_per_rank;
  uint64_t slot_stride;
  uint64_t slots_offset;
  uint64_t counters_offset;
  uint32_t op_timeout_ms;          // for operations without their own timeout
  uint32_t reserved0;

  // Written by the daemon only: abort_code and abort_message first, then
  // `aborted` = 1 (release), then FUTEX_WAKE on every slot's status.
  alignas(64) std::atomic<uint32_t> aborted;
  int32_t abort_code;
  uint32_t abort_message_len;
  char abort_message[kMaxMessage];

  alignas(64) std::atomic<uint32_t> table_lock;  // 0 free, 1 held (SDK only)
};
static_assert(sizeof(FastPathHeader) <= 4096);

// Per-rank counters, bumped by that rank's SDK, read by the daemon.
struct alignas(64) FastPathCounters {
  std::atomic<uint64_t> ops_completed;
  std::atomic<uint64_t> ops_failed;
  std::atomic<uint64_t> bytes;  // counted like the daemon's bytes_reduced
  // The CPU the rank last submitted from: a waiter whose peer runs on its
  // own CPU yields at once instead of spinning (SDK only).
  std::atomic<int32_t> cpu;
};

enum class FastSlotState : uint32_t { kEmpty = 0, kUsed = 1, kTombstone = 2 };
enum class FastOpStatus : uint32_t { kPending = 0, kDone = 1, kFailed = 2 };
// Which path the key's first rank took (see "Ranks that would take
// different paths" above).
enum class FastRoute : uint32_t { kFast = 0, kDaemon = 1 };

// One key of the table, followed in the segment by its data: world_size
// input areas of payload_bytes each, then one result area of payload_bytes.
// Fields marked "lock" change only under the table lock. What a submission
// touches comes first, packed into few cache lines (ranks on different cores
// pay a line transfer for each); the error text comes last.
struct alignas(64) FastSlot {
  // Line 0: the key's state and the signature of the first rank that
  // claimed the slot (lock).
  uint32_t state;        // FastSlotState (lock; the last rank to leave
                         // stores kTombstone without it, see fast_path.h)
  uint32_t name_len;
  uint64_t seq;          // the n of (name, n)
  uint32_t collective;
  uint32_t dtype;
  uint32_t reduce_op;
  int32_t root;
  uint64_t count;
  uint32_t codec;
  float codec_ratio;
  int32_t first_rank;
  uint32_t route;                  // FastRoute of the first rank (lock)
  uint32_t device;                 // 1: CUDA device buffers (always kDaemon)
  uint32_t joined;                 // ranks that joined (lock)
  uint64_t first_submit_ns;        // CLOCK_MONOTONIC (lock)
  char name[kMaxOpName];           // (lock)
  // Its own line: what the ranks of an operation update as they go.
  alignas(64) std::atomic<uint32_t> arrived;   // inputs copied in
  std::atomic<uint32_t> departed;              // results copied out / gave up
  std::atomic<uint32_t> status;                // FastOpStatus; futex word
  std::atomic<uint32_t> waiters;               // ranks asleep on `status`
  uint64_t done_ns;  // CLOCK_MONOTONIC when the last rank completed it (before status = kDone)
  uint8_t ranks_joined[kMaxFastPathRanks];     // 1: that rank joined (lock)
  int32_t error_code;                          // written before status = kFailed
  uint32_t error_len;
  char error[kMaxMessage];
};
static_assert(std::atomic<uint32_t>::is_always_lock_free);
static_assert(std::atomic<uint64_t>::is_always_lock_free);

// Where everything goes for a job of `world_size` ranks and `payload_bytes`
// per rank. Both sides compute it from those two numbers alone, so neither
// trusts the other's offsets. valid == false: the job gets no segment.
struct FastPathGeometry {
  bool valid = false;
  uint32_t slot_count = 0;
  uint32_t max_inflight_per_rank = 0;
  uint64_t slot_stride = 0;
  uint64_t slots_offset = 0;
  uint64_t counters_offset = 0;
  uint64_t segment_bytes = 0;
};

inline constexpr uint64_t AlignUp(uint64_t v, uint64_t a) { return (v + a - 1) / a * a; }

// The most operations in flight per rank, at most `max_inflight`, for which
// the segment stays within kMaxFastPathSegmentBytes. The daemon makes no
// segment when that is below kMinFastPathInflight (tests go lower to force
// collisions in a tiny table).
inline FastPathGeometry ComputeFastPathGeometry(uint32_t world_size, uint64_t payload_bytes,
                                                uint32_t max_inflight = kMaxFastPathInflight) {
  FastPathGeometry g;
  if (world_size < 1 || world_size > kMaxFastPathRanks || payload_bytes == 0 ||
      payload_bytes > kMaxFastPathSegmentBytes || max_inflight < 1 ||
      max_inflight > kMaxFastPathInflight) {
    return g;
  }
  payload_bytes = AlignUp(payload_bytes, 64);
  g.slot_stride = AlignUp(sizeof(FastSlot), 64) + (uint64_t{world_size} + 1) * payload_bytes;
  g.counters_offset = 4096;
  g.slots_offset = AlignUp(g.counters_offset + sizeof(FastPathCounters) * world_size, 4096);
  uint32_t inflight = max_inflight;
  while (inflight >= 1) {
    uint64_t slots = 1;
    while (slots < 2ull * world_size * inflight) slots <<= 1;
    const uint64_t bytes = AlignUp(g.slots_offset + slots * g.slot_stride, 4096);
    if (bytes <= kMaxFastPathSegmentBytes) {
      g.valid = true;
      g.slot_count = static_cast<uint32_t>(slots);
      g.max_inflight_per_rank = inflight;
      g.segment_bytes = bytes;
      return g;
    }
    inflight /= 2;
  }
  return g;
}

// Writes the header of an empty segment of geometry `g` at `base` and marks
// every slot empty: what ciuicd does when a job forms (the SDK's unit tests
// do the same over memory of their own).
inline void InitFastPathSegment(uint8_t* base, const FastPathGeometry& g, uint32_t world_size,
                                uint64_t payload_bytes, uint32_t op_timeout_ms) {
  std::memset(base, 0, g.slots_offset);
  auto* h = new (base) FastPathHeader();
  h->magic = kFastPathMagic;
  h->version = kFastPathVersion;
  h->world_size = world_size;
  h->segment_bytes = g.segment_bytes;
  h->payload_bytes = payload_bytes;
  h->slot_count = g.slot_count;
  h->max_inflight_per_rank = g.max_inflight_per_rank;
  h->slot_stride = g.slot_stride;
  h->slots_offset = g.slots_offset;
  h->counters_offset = g.counters_offset;
  h->op_timeout_ms = op_timeout_ms;
  for (uint32_t i = 0; i < g.slot_count; ++i) {
    std::memset(base + g.slots_offset + uint64_t{i} * g.slot_stride, 0, sizeof(FastSlot));
  }
}

// Sent on the session socket with the segment's fd (SCM_RIGHTS).
struct FastPathHello {
  uint64_t magic;          // kFastPathMagic
  uint64_t segment_bytes;
  uint64_t payload_bytes;
};

// "allreduce float32 count=100 op=sum" style, for error messages; the daemon
// and the SDK word mismatches the same way.
inline std::string SignatureString(uint32_t collective, uint32_t dtype, uint32_t reduce_op,
                                   int32_t root, uint64_t count, uint32_t codec,
                                   float codec_ratio, bool device = false) {
  const char* c = CollectiveName(collective);
  std::string out = c ? c : "collective#" + std::to_string(collective);
  if (static_cast<Collective>(collective) == Collective::kBarrier) return out;
  const char* d = DataTypeName(dtype);
  out += " ";
  out += d ? d : "dtype#" + std::to_string(dtype);
  out += " count=" + std::to_string(count);
  if (reduce_op != 0) {
    const char* r = ReduceOpName(reduce_op);
    out += " op=";
    out += r ? r : "#" + std::to_string(reduce_op);
  }
  if (static_cast<Collective>(collective) == Collective::kBroadcast) {
    out += " root=" + std::to_string(root);
  }
  static const char* kCodecs[] = {"", "none", "fp16", "bf16", "int8", "topk"};
  if (codec != 0) {
    out += " compression=";
    out += codec < 6 ? kCodecs[codec] : "?";
    if (static_cast<Codec>(codec) == Codec::kTopK) {
      char buf[32];
      std::snprintf(buf, sizeof(buf), ":%g", static_cast<double>(codec_ratio));
      out += buf;
    }
  }
  if (device) out += " in CUDA device memory";  // as collectives/op.cc
  return out;
}

}  // namespace ciuic::wire
