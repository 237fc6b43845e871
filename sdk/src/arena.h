// The SDK's view of a session's shared memory: the mapping and a first-fit
// allocator over its data region. Shared (shared_ptr) by the communicator
// and every Buffer, so the mapping outlives whichever goes last.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>

#include "ciuic/ciuic.h"
#include "ciuic/shm_layout.h"

namespace ciuic {

struct Buffer::Arena {
  Arena(int fd, uint8_t* base, uint64_t size);
  ~Arena();

  // Offsets are from the start of the memfd, as the daemon wants them.
  Status Allocate(size_t bytes, uint64_t* offset);
  void Free(uint64_t offset, size_t bytes);
  bool Contains(const void* p, size_t bytes) const;
  uint64_t OffsetOf(const void* p) const { return static_cast<const uint8_t*>(p) - base; }
  static size_t Rounded(size_t bytes) { return bytes == 0 ? 64 : (bytes + 63) / 64 * 64; }

  int fd;
  uint8_t* base;
  uint64_t size;
  wire::SessionHeader* header() const { return reinterpret_cast<wire::SessionHeader*>(base); }

 private:
  std::mutex mu_;
  std::map<uint64_t, uint64_t> free_;  // offset -> length, coalesced
  uint64_t free_bytes_ = 0;
};

// Builds Buffers over arena memory (Buffer's fields are private).
struct BufferAccess {
  static Buffer Make(std::shared_ptr<Buffer::Arena> arena, uint64_t offset, size_t bytes) {
    Buffer b;
    b.data_ = arena->base + offset;
    b.size_ = bytes;
    b.arena_ = std::move(arena);
    return b;
  }
};

}  // namespace ciuic
