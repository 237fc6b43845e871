#include "arena.h"

#include <sys/mman.h>
#include <unistd.h>

#include <iterator>

namespace ciuic {

Buffer::Arena::Arena(int fd_in, uint8_t* base_in, uint64_t size_in)
    : fd(fd_in), base(base_in), size(size_in) {
  free_[wire::kDataOffset] = size - wire::kDataOffset;
  free_bytes_ = size - wire::kDataOffset;
}

Buffer::Arena::~Arena() {
  munmap(base, size);
  close(fd);
}

Status Buffer::Arena::Allocate(size_t bytes, uint64_t* offset) {
  const uint64_t need = Rounded(bytes);
  std::lock_guard<std::mutex> lock(mu_);
  for (auto it = free_.begin(); it != free_.end(); ++it) {
    if (it->second < need) continue;
    *offset = it->first;
    const uint64_t rest = it->second - need;
    const uint64_t rest_at = it->first + need;
    free_.erase(it);
    if (rest > 0) free_[rest_at] = rest;
    free_bytes_ -= need;
    return Status::Ok();
  }
  return Status(StatusCode::kResourceExhausted,
                "shared-memory arena exhausted: " + std::to_string(need) + " bytes asked, " +
                    std::to_string(free_bytes_) + " free (fragmented) of " +
                    std::to_string(size - wire::kDataOffset) +
                    "; raise JobOptions::arena_bytes or CIUIC_ARENA_BYTES");
}

void Buffer::Arena::Free(uint64_t offset, size_t bytes) {
  uint64_t len = Rounded(bytes);
  std::lock_guard<std::mutex> lock(mu_);
  free_bytes_ += len;
  auto next = free_.lower_bound(offset);
  if (next != free_.begin()) {
    auto prev = std::prev(next);
    if (prev->first + prev->second == offset) {
      offset = prev->first;
      len += prev->second;
      free_.erase(prev);
    }
  }
  if (next != free_.end() && offset + len == next->first) {
    len += next->second;
    free_.erase(next);
  }
  free_[offset] = len;
}

bool Buffer::Arena::Contains(const void* p, size_t bytes) const {
  const uint8_t* b = static_cast<const uint8_t*>(p);
  const uint8_t* begin = base + wire::kDataOffset;
  const uint8_t* end = base + size;
  return b >= begin && b <= end && bytes <= static_cast<size_t>(end - b);
}

Buffer::~Buffer() {
  if (arena_ && data_) arena_->Free(arena_->OffsetOf(data_), size_);
}

Buffer::Buffer(Buffer&& o) noexcept
    : arena_(std::move(o.arena_)), data_(o.data_), size_(o.size_) {
  o.data_ = nullptr;
  o.size_ = 0;
}

Buffer& Buffer::operator=(Buffer&& o) noexcept {
  if (this != &o) {
    if (arena_ && data_) arena_->Free(arena_->OffsetOf(data_), size_);
    arena_ = std::move(o.arena_);
    data_ = o.data_;
    size_ = o.size_;
    o.data_ = nullptr;
    o.size_ = 0;
  }
  return *this;
}

}  // namespace ciuic
