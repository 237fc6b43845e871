#include "compression/error_feedback.h"

#include <bit>
#include <cstdint>
#include <utility>

namespace ciuic::daemon {
namespace {

constexpr size_t BytesOf(size_t count) { return count * sizeof(float); }

// The hot loops (vectorised, see README.md).
void AddInto(const float* residual, float* data, size_t count) {
  for (size_t i = 0; i < count; ++i) data[i] += residual[i];
}

void Difference(const float* a, const float* b, float* out, size_t count) {
  for (size_t i = 0; i < count; ++i) {
    const float d = a[i] - b[i];
    // Finite iff the exponent bits are not all ones; a mask, not a branch.
    const uint32_t bits = std::bit_cast<uint32_t>(d);
    const uint32_t finite = 0u - static_cast<uint32_t>((bits & 0x7f800000u) != 0x7f800000u);
    out[i] = std::bit_cast<float>(bits & finite);
  }
}

}  // namespace

ErrorFeedback::ErrorFeedback(size_t max_bytes) : max_bytes_(max_bytes) {}

void ErrorFeedback::Apply(const std::string& name, float* data, size_t count) {
  ApplyRange(name, count, 0, data, count);
}

void ErrorFeedback::Update(const std::string& name, const float* original_with_residual,
                           const float* decoded, size_t count) {
  UpdateRange(name, count, 0, original_with_residual, decoded, count);
}

void ErrorFeedback::ApplyRange(const std::string& name, size_t count, size_t offset, float* data,
                               size_t n) {
  absl::MutexLock lock(&mu_);
  auto it = entries_.find(name);
  if (it == entries_.end()) return;
  if (it->second.residual.size() != count) {
    ++stats_.size_resets;
    EraseLocked(it);
    return;
  }
  lru_.splice(lru_.begin(), lru_, it->second.lru);
  AddInto(it->second.residual.data() + offset, data, n);
}

void ErrorFeedback::UpdateRange(const std::string& name, size_t count, size_t offset,
                                const float* original_with_residual, const float* decoded,
                                size_t n) {
  absl::MutexLock lock(&mu_);
  std::vector<float>* residual = ResidualForUpdateLocked(name, count);
  if (residual != nullptr) {
    Difference(original_with_residual, decoded, residual->data() + offset, n);
  }
}

std::vector<float>* ErrorFeedback::ResidualForUpdateLocked(const std::string& name,
                                                           size_t count) {
  auto it = entries_.find(name);
  if (it != entries_.end() && it->second.residual.size() != count) {
    ++stats_.size_resets;
    EraseLocked(it);
    it = entries_.end();
  }
  if (BytesOf(count) > max_bytes_) {
    if (it != entries_.end()) EraseLocked(it);
    ++stats_.too_large;
    return nullptr;
  }
  if (it == entries_.end()) {
    // Make room first, then insert (never evicts the entry being written).
    while (stats_.bytes + BytesOf(count) > max_bytes_ && !lru_.empty()) {
      EraseLocked(entries_.find(lru_.back()));
      ++stats_.evictions;
    }
    lru_.push_front(name);
    it = entries_.emplace(name, Entry{std::vector<float>(count), lru_.begin()}).first;
    stats_.bytes += BytesOf(count);
    ++stats_.names;
  } else {
    lru_.splice(lru_.begin(), lru_, it->second.lru);
  }
  return &it->second.residual;
}

void ErrorFeedback::Forget(const std::string& name) {
  absl::MutexLock lock(&mu_);
  auto it = entries_.find(name);
  if (it != entries_.end()) EraseLocked(it);
}

ErrorFeedback::Stats ErrorFeedback::GetStats() const {
  absl::MutexLock lock(&mu_);
  return stats_;
}

void ErrorFeedback::EraseLocked(std::unordered_map<std::string, Entry>::iterator it) {
  stats_.bytes -= BytesOf(it->second.residual.size());
  --stats_.names;
  lru_.erase(it->second.lru);
  entries_.erase(it);
}

}  // namespace ciuic::daemon
