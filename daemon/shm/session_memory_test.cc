#include "shm/session_memory.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <cstdint>
#include <limits>

namespace ciuic::daemon {
namespace {

TEST(SessionMemoryTest, LayoutIsInitialised) {
  auto mem = SessionMemory::Create(100000);
  ASSERT_TRUE(mem.ok()) << mem.status();
  const wire::SessionHeader* h = (*mem)->header();
  EXPECT_EQ(h->magic, wire::kSessionMagic);
  EXPECT_EQ(h->version, wire::kLayoutVersion);
  EXPECT_EQ(h->data_offset, wire::kDataOffset);
  EXPECT_EQ(h->data_bytes % 4096, 0u);
  EXPECT_GE(h->data_bytes, 100000u);
  EXPECT_EQ(h->memfd_bytes, (*mem)->size());
  EXPECT_EQ(h->sq_tail.load(), 0u);
  EXPECT_EQ(h->cq_tail.load(), 0u);
}

TEST(SessionMemoryTest, DataRangeRejectsEverythingOutside) {
  auto mem = SessionMemory::Create(8192);
  ASSERT_TRUE(mem.ok());
  const SessionMemory& m = **mem;
  const uint64_t begin = m.data_offset();
  const uint64_t end = m.size();
  EXPECT_TRUE(m.DataRange(begin, 0).ok());
  EXPECT_TRUE(m.DataRange(begin, end - begin).ok());
  EXPECT_TRUE(m.DataRange(end, 0).ok());
  EXPECT_TRUE(m.DataRange(end - 1, 1).ok());
  // Header and rings are not data.
  EXPECT_EQ(m.DataRange(0, 8).status().code(), absl::StatusCode::kOutOfRange);
  EXPECT_EQ(m.DataRange(begin - 1, 1).status().code(), absl::StatusCode::kOutOfRange);
  EXPECT_FALSE(m.DataRange(end - 1, 2).ok());
  EXPECT_FALSE(m.DataRange(end + 1, 0).ok());
  constexpr uint64_t kMax = std::numeric_limits<uint64_t>::max();
  EXPECT_FALSE(m.DataRange(begin, kMax).ok());
  EXPECT_FALSE(m.DataRange(kMax, 2).ok());
  EXPECT_FALSE(m.DataRange(begin + 16, kMax - 8).ok());  // offset + bytes wraps
}

TEST(SessionMemoryTest, SizeIsSealed) {
  auto mem = SessionMemory::Create(8192);
  ASSERT_TRUE(mem.ok());
  int fd = (*mem)->fd();
  EXPECT_NE(ftruncate(fd, 4096), 0) << "a trainer could shrink the memfd under the daemon";
  EXPECT_NE(ftruncate(fd, (*mem)->size() * 2), 0);
  int seals = fcntl(fd, F_GET_SEALS);
  EXPECT_TRUE(seals & F_SEAL_SHRINK);
  EXPECT_TRUE(seals & F_SEAL_SEAL);
}

}  // namespace
}  // namespace ciuic::daemon
