#include "shm/session_memory.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <new>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace ciuic::daemon {

namespace {
absl::Status ErrnoStatus(absl::string_view what) {
  return absl::InternalError(absl::StrCat(what, ": ", std::strerror(errno)));
}
}  // namespace

absl::StatusOr<std::unique_ptr<SessionMemory>> SessionMemory::Create(uint64_t data_bytes) {
  constexpr uint64_t kPage = 4096;
  data_bytes = (data_bytes + kPage - 1) / kPage * kPage;
  const uint64_t size = wire::kDataOffset + data_bytes;
  int fd = memfd_create("ciuic-session", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  if (fd < 0) return ErrnoStatus("memfd_create");
  if (ftruncate(fd, static_cast<off_t>(size)) != 0) {
    absl::Status s = ErrnoStatus(absl::StrCat("ftruncate of session memory to ", size, " bytes"));
    close(fd);
    return s;
  }
  if (fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0) {
    absl::Status s = ErrnoStatus("sealing session memory");
    close(fd);
    return s;
  }
  void* base = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, 0);
  if (base == MAP_FAILED) {
    absl::Status s = ErrnoStatus(absl::StrCat("mmap of ", size, " bytes of session memory"));
    close(fd);
    return s;
  }
  auto* header = new (base) wire::SessionHeader();
  header->magic = wire::kSessionMagic;
  header->version = wire::kLayoutVersion;
  header->memfd_bytes = size;
  header->sq_offset = wire::kSqOffset;
  header->cq_offset = wire::kCqOffset;
  header->data_offset = wire::kDataOffset;
  header->data_bytes = data_bytes;
  header->sq_capacity = wire::kRingCapacity;
  header->cq_capacity = wire::kRingCapacity;
  return std::unique_ptr<SessionMemory>(
      new SessionMemory(fd, static_cast<uint8_t*>(base), size));
}

SessionMemory::~SessionMemory() {
  munmap(base_, size_);
  close(fd_);
}

absl::StatusOr<uint8_t*> SessionMemory::DataRange(uint64_t offset, uint64_t bytes) const {
  const uint64_t begin = wire::kDataOffset;
  if (offset < begin || offset > size_ || bytes > size_ - offset) {
    return absl::OutOfRangeError(absl::StrCat("buffer [", offset, ", +", bytes,
                                              ") is outside the session's arena [", begin, ", ",
                                              size_, ")"));
  }
  return base_ + offset;
}

}  // namespace ciuic::daemon
