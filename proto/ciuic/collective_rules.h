// Rules of a collective that the SDK and the daemon must apply alike: how
// many bytes each rank's buffers hold, which overlap of send and recv is the
// collective's in-place form, and the default timeout. The SDK decides with
// them whether an operation may take the fast path; the daemon validates a
// submission with them (daemon/collectives/op.cc). One definition, so that
// the fast path can never accept what the daemon would refuse, or refuse
// what it would run.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "ciuic/shm_layout.h"

namespace ciuic::wire {

// Unnamed operations: the SDK names them "#N", N counting a communicator's
// unnamed submissions from 0, and refuses a caller's name that starts with
// '#'. Ranks match them by submission order, named ones by name and
// occurrence (the daemon and the fast path both decide with these).
inline constexpr char kUnnamedPrefix = '#';
constexpr bool IsUnnamed(std::string_view name) {
  return !name.empty() && name[0] == kUnnamedPrefix;
}
// N of an unnamed operation's name "#N"; false when `name` is not the prefix
// followed by 1 to 19 decimal digits (so N fits 64 bits).
constexpr bool UnnamedNumber(std::string_view name, uint64_t* n) {
  if (!IsUnnamed(name) || name.size() < 2 || name.size() > 20) return false;
  uint64_t v = 0;
  for (char c : name.substr(1)) {
    if (c < '0' || c > '9') return false;
    v = v * 10 + static_cast<uint64_t>(c - '0');
  }
  *n = v;
  return true;
}
inline std::string UnnamedName(uint64_t n) { return kUnnamedPrefix + std::to_string(n); }

// The reduction that combines partial results of `op`: an average is summed
// (between a node's ranks and between nodes alike) and divided by the
// number of ranks once, at the end; every other op combines as itself.
inline constexpr ReduceOp CombiningOp(ReduceOp op) {
  return op == ReduceOp::kAvg ? ReduceOp::kSum : op;
}

// An operation's timeout when neither the caller nor the daemon's
// configuration names one (tuning key op_timeout_ms).
inline constexpr uint32_t kDefaultOpTimeoutMs = 60000;

// Bytes of one rank's send and recv buffers. `block` is count × element
// size; a job has `world` ranks. Alltoallv's come from its splits, and a
// barrier has none: {0, 0} for both.
struct RankBytes {
  uint64_t send = 0;
  uint64_t recv = 0;
};
constexpr RankBytes RankBytesOf(Collective c, uint64_t block, int world, int rank, int root) {
  const uint64_t all = block * static_cast<uint64_t>(world);
  switch (c) {
    case Collective::kAllreduce: return {block, block};
    case Collective::kReduceScatter: return {all, block};
    case Collective::kAllgather: return {block, all};
    case Collective::kBroadcast: return {rank == root ? block : 0, block};
    case Collective::kAlltoall: return {all, all};
    case Collective::kAlltoallv:
    case Collective::kBarrier: break;
  }
  return {};
}

// Whether [a, a + an) and [b, b + bn) share a byte (empty ranges never do).
constexpr bool Overlap(uint64_t a, uint64_t an, uint64_t b, uint64_t bn) {
  return an != 0 && bn != 0 && a < b + bn && b < a + an;
}

// Whether send at `send_at` and recv at `recv_at` (one address space), which
// overlap, are the collective's in-place form: the same buffer for allreduce
// and broadcast, recv this rank's block of send for reduce_scatter, send
// this rank's block of recv for allgather. Alltoall, alltoallv and barrier
// have none (every block is read and written by other ranks). Any other
// overlap is refused.
constexpr bool InPlace(Collective c, uint64_t send_at, uint64_t recv_at, uint64_t block,
                       int rank) {
  const uint64_t mine = static_cast<uint64_t>(rank) * block;
  switch (c) {
    case Collective::kAllreduce:
    case Collective::kBroadcast: return send_at == recv_at;
    case Collective::kReduceScatter: return recv_at == send_at + mine;
    case Collective::kAllgather: return send_at == recv_at + mine;
    case Collective::kAlltoall:
    case Collective::kAlltoallv:
    case Collective::kBarrier: break;
  }
  return false;
}

}  // namespace ciuic::wire
