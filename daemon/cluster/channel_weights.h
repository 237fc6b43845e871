// How an operation's chunks are spread over a job's channels when the
// channels' links differ (config channel_devices: a NIC, a rail or a path
// each): each channel's share follows the throughput its link has shown.
//
// 1. Each node measures, per channel, what its sends carried while the
//    channel had work (Transport::ChannelLoads: bytes over busy time,
//    between two readings) and keeps a moving rate (ChannelRates). It sends
//    the rates with every Ready (peer.proto, Ready.channel_rates).
// 2. The coordinator keeps each node's latest rates and, for every run it
//    announces, derives the channels' shares (ChannelShares): per channel
//    the slowest node's rate (a chunk crosses two nodes' links), in
//    kChannelSlots slots, every channel at least one, so that no channel
//    starves and a link that recovers is measured again. They travel in the
//    Run (Run.channel_shares), so every node cuts the run alike.
// 3. The run's chunk i travels on channel ChannelTable(shares)[i mod
//    kChannelSlots], whatever the step (the chunk a step receives and the
//    next forwards stays on one channel thread, as with equal shares).
//
// Until every node has measured every channel, shares are equal (no
// shares announced: chunk i on channel i mod channels). Only nodes whose
// channels have devices of their own (channel_devices) report rates:
// channels on the same devices share one link, so they keep equal shares.
#pragma once

#include <chrono>
#include <cstdint>
#include <vector>

#include "transport/transport.h"

namespace ciuic::daemon {

// The slots of a run's channel table: a channel's share is a multiple of
// 1/kChannelSlots (at least one slot each; so at most kChannelSlots channels
// get weights, more run with equal shares).
inline constexpr uint32_t kChannelSlots = 64;

// A node's moving estimate of each channel's rate (bytes per second).
// Thread-safe: the caller serializes (ClusterJob under its lock).
class ChannelRates {
 public:
  // A reading counts once the channel moved at least this much since the
  // previous one that counted (a short burst mostly measures buffering).
  static constexpr uint64_t kMinBytes = uint64_t{4} << 20;
  static constexpr uint64_t kMinBusyNs = 20'000'000;  // 20 ms
  // The newest reading's weight in the moving rate.
  static constexpr double kNewWeight = 0.5;

  // Takes the transport's cumulative loads now.
  void Update(const std::vector<Transport::ChannelLoad>& loads);
  // Per channel, bytes per second; 0: not measured yet.
  const std::vector<double>& rates() const { return rates_; }

 private:
  std::vector<Transport::ChannelLoad> last_;
  std::vector<double> rates_;
};

// The channels' shares of a run from each node's rates (rates[node][channel],
// bytes per second): empty (equal shares) unless every node reported a rate
// for each of `channels` channels, 2 <= channels <= kChannelSlots. Else
// `channels` shares summing to kChannelSlots, each >= 1, in proportion to
// the slowest node's rate per channel (largest remainder, ties to the lower
// channel).
std::vector<uint32_t> ChannelShares(const std::vector<std::vector<double>>& rates, int channels);

// The chunk -> channel table of a run with `shares` (as ChannelShares
// returns, or empty: {}): kChannelSlots entries, channel c in shares[c] of
// them, spread out (each slot goes to the channel furthest behind its
// share), the same on every node.
std::vector<uint8_t> ChannelTable(const std::vector<uint32_t>& shares);

// Whether `shares` (from a Run) are valid for `channels` channels: empty,
// or one per channel, each >= 1, summing to kChannelSlots.
bool ValidChannelShares(const std::vector<uint32_t>& shares, int channels);

}  // namespace ciuic::daemon
