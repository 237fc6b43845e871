// Reusable receive space for the inter-node algorithms.
//
// A reducing step receives a chunk into scratch memory and reduces it into
// the destination; allocating that memory per operation would cost a page
// fault per 4 KiB page touched (~10 us each on the daemon's machines), more
// than moving the bytes. A ScratchBuffer therefore keeps one mapping that
// only grows: it is mmap'ed, advised MADV_HUGEPAGE and pre-faulted once, and
// handed out again to every later operation.
//
// Owned by the thread that runs a job's inter-node phase; not thread-safe.
// A pointer returned by Get stays valid until the next Get that grows the
// buffer or the buffer's destruction; the algorithms call Get once per
// operation, before any transfer is posted.
#pragma once

#include <cstddef>
#include <cstdint>

namespace ciuic::daemon {

class ScratchBuffer {
 public:
  ScratchBuffer() = default;
  ~ScratchBuffer();
  ScratchBuffer(const ScratchBuffer&) = delete;
  ScratchBuffer& operator=(const ScratchBuffer&) = delete;

  // At least `bytes` bytes (64-byte aligned; page aligned in fact). Grows the
  // mapping (to the next multiple of 2 MiB, at least doubling) when too small;
  // never shrinks. Returns nullptr only if the mapping cannot be made (out of
  // memory); Get(0) returns a valid pointer too.
  uint8_t* Get(size_t bytes);

  size_t capacity() const { return capacity_; }

 private:
  uint8_t* data_ = nullptr;
  size_t capacity_ = 0;
};

}  // namespace ciuic::daemon
