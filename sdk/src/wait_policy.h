// How long a thread that waits for an operation polls the completion ring
// before it sleeps on the futex (Handle::Wait). Polling catches a quick
// completion without a wake-up; it also takes a core that the daemon's
// threads may need to finish the operation.
#pragma once

#include <algorithm>
#include <cstdint>

#include "ciuic/collective_rules.h"

namespace ciuic::internal {

// Between nodes, an operation of more bytes than this per rank takes
// hundreds of microseconds, most of it the daemons' work (transfers,
// reductions): a wake-up costs little beside it, and a waiter that polls
// takes a core from the threads doing that work when cores are few.
// Measured on 2 loopback nodes x 1 rank on 2 cores, interleaved, 14 runs
// of 1000 operations each: polling 50 us before sleeping against sleeping
// at once, 256 KiB 207 -> 183 us and 1 MiB 427 -> 368 us (medians); 8 B
// and 64 KiB within the runs' spread (51 / 48 us, 89 / 86 us).
inline constexpr uint64_t kPollMaxBytesBetweenNodes = uint64_t{64} << 10;

// The microseconds to poll for an operation of `collective` on `block`
// bytes per rank (count x element size) of a job of `world` ranks, `local`
// of them on this node, given the communicator's poll window `spin_us`
// (CIUIC_SPIN_US, default 50). Jobs on one node always poll: there the
// daemon's part is short and the wake-up a large share of it. Alltoallv's
// sizes are its splits', not known here: it polls.
inline uint32_t PollMicros(uint32_t spin_us, wire::Collective collective, uint64_t block, int world,
                           int local) {
  if (local >= world) return spin_us;
  // The larger of send and recv: which rank is the root does not matter.
  const wire::RankBytes bytes = wire::RankBytesOf(collective, block, world, 0, 0);
  return std::max(bytes.send, bytes.recv) > kPollMaxBytesBetweenNodes ? 0 : spin_us;
}

}  // namespace ciuic::internal
