#include "collectives/internode/scratch.h"

#include <sys/mman.h>

#include <algorithm>
#include <cstring>

namespace ciuic::daemon {
namespace {

constexpr size_t kHugePage = size_t{2} << 20;

}  // namespace

ScratchBuffer::~ScratchBuffer() {
  if (data_ != nullptr) munmap(data_, capacity_);
}

uint8_t* ScratchBuffer::Get(size_t bytes) {
  if (data_ != nullptr && bytes <= capacity_) return data_;
  size_t want = std::max(bytes, std::max(capacity_ * 2, kHugePage));
  want = (want + kHugePage - 1) / kHugePage * kHugePage;
  void* p = mmap(nullptr, want, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) return nullptr;
  // Huge pages where the kernel allows them (fewer faults and TLB misses);
  // failure only means small pages.
  madvise(p, want, MADV_HUGEPAGE);
  // Pre-fault now, once, rather than on the data path: MADV_POPULATE_WRITE
  // (Linux 5.14) where available, else touch every page.
#ifdef MADV_POPULATE_WRITE
  if (madvise(p, want, MADV_POPULATE_WRITE) != 0)
#endif
  {
    auto* bytes_p = static_cast<volatile uint8_t*>(p);
    for (size_t off = 0; off < want; off += 4096) bytes_p[off] = 0;
  }
  if (data_ != nullptr) munmap(data_, capacity_);
  data_ = static_cast<uint8_t*>(p);
  capacity_ = want;
  return data_;
}

}  // namespace ciuic::daemon
