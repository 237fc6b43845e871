#include "cluster/channel_weights.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

namespace ciuic::daemon {

void ChannelRates::Update(const std::vector<Transport::ChannelLoad>& loads) {
  if (last_.size() != loads.size()) {
    last_ = loads;
    rates_.assign(loads.size(), 0.0);
    return;
  }
  for (size_t c = 0; c < loads.size(); ++c) {
    const uint64_t bytes = loads[c].bytes_sent - last_[c].bytes_sent;
    const uint64_t busy = loads[c].busy_ns - last_[c].busy_ns;
    if (bytes < kMinBytes || busy < kMinBusyNs) continue;  // keep accumulating
    const double rate = static_cast<double>(bytes) * 1e9 / static_cast<double>(busy);
    rates_[c] = rates_[c] == 0 ? rate : rates_[c] + kNewWeight * (rate - rates_[c]);
    last_[c] = loads[c];
  }
}

std::vector<uint32_t> ChannelShares(const std::vector<std::vector<double>>& rates, int channels) {
  if (channels < 2 || channels > static_cast<int>(kChannelSlots) || rates.empty()) return {};
  std::vector<double> slowest(static_cast<size_t>(channels), std::numeric_limits<double>::max());
  for (const std::vector<double>& node : rates) {
    if (node.size() != static_cast<size_t>(channels)) return {};
    for (int c = 0; c < channels; ++c) {
      const double r = node[static_cast<size_t>(c)];
      if (!(r > 0) || !std::isfinite(r)) return {};
      slowest[static_cast<size_t>(c)] = std::min(slowest[static_cast<size_t>(c)], r);
    }
  }
  const double total = std::accumulate(slowest.begin(), slowest.end(), 0.0);
  // One slot each first; the rest in proportion to the rates.
  const uint32_t rest = kChannelSlots - static_cast<uint32_t>(channels);
  std::vector<uint32_t> shares(static_cast<size_t>(channels), 1);
  std::vector<double> exact(static_cast<size_t>(channels));
  uint32_t given = 0;
  for (size_t c = 0; c < shares.size(); ++c) {
    exact[c] = rest * slowest[c] / total;
    const auto whole = static_cast<uint32_t>(exact[c]);
    shares[c] += whole;
    given += whole;
  }
  std::vector<size_t> order(shares.size());
  std::iota(order.begin(), order.end(), size_t{0});
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    return exact[a] - std::floor(exact[a]) > exact[b] - std::floor(exact[b]);
  });
  for (size_t i = 0; given < rest; ++i, ++given) ++shares[order[i % order.size()]];
  return shares;
}

std::vector<uint8_t> ChannelTable(const std::vector<uint32_t>& shares) {
  if (shares.empty()) return {};
  std::vector<uint8_t> table;
  table.reserve(kChannelSlots);
  std::vector<uint32_t> placed(shares.size(), 0);
  for (uint32_t slot = 0; slot < kChannelSlots; ++slot) {
    // The channel furthest behind its share after this slot.
    size_t best = 0;
    double best_behind = -std::numeric_limits<double>::max();
    for (size_t c = 0; c < shares.size(); ++c) {
      const double behind = static_cast<double>(shares[c]) * (slot + 1) / kChannelSlots -
                            static_cast<double>(placed[c]);
      if (placed[c] < shares[c] && behind > best_behind) {
        best = c;
        best_behind = behind;
      }
    }
    ++placed[best];
    table.push_back(static_cast<uint8_t>(best));
  }
  return table;
}

bool ValidChannelShares(const std::vector<uint32_t>& shares, int channels) {
  if (shares.empty()) return true;
  if (channels < 2 || shares.size() != static_cast<size_t>(channels) ||
      channels > static_cast<int>(kChannelSlots)) {
    return false;
  }
  uint64_t sum = 0;
  for (uint32_t s : shares) {
    if (s == 0) return false;
    sum += s;
  }
  return sum == kChannelSlots;
}

}  // namespace ciuic::daemon
