#include "shm/fast_path_segment.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstring>
#include <random>

#include "gtest/gtest.h"

namespace ciuic::daemon {
namespace {

TEST(FastPathSegmentTest, SealedPrivateAndLaidOut) {
  auto seg = FastPathSegment::Create(2, 4096, 1234);
  ASSERT_TRUE(seg.ok()) << seg.status();
  struct stat st {};
  ASSERT_EQ(fstat((*seg)->fd(), &st), 0);
  EXPECT_EQ(static_cast<uint64_t>(st.st_size), (*seg)->size());
  EXPECT_EQ(st.st_mode & 0777, 0600u);
  const int seals = fcntl((*seg)->fd(), F_GET_SEALS);
  EXPECT_TRUE(seals & F_SEAL_SHRINK);
  EXPECT_TRUE(seals & F_SEAL_GROW);
  EXPECT_NE(ftruncate((*seg)->fd(), 4096), 0) << "the size is sealed";
  void* p = mmap(nullptr, (*seg)->size(), PROT_READ, MAP_SHARED, (*seg)->fd(), 0);
  ASSERT_NE(p, MAP_FAILED);
  const auto* h = static_cast<const wire::FastPathHeader*>(p);
  const auto g = wire::ComputeFastPathGeometry(2, 4096);
  EXPECT_EQ(h->magic, wire::kFastPathMagic);
  EXPECT_EQ(h->world_size, 2u);
  EXPECT_EQ(h->payload_bytes, 4096u);
  EXPECT_EQ(h->slot_count, g.slot_count);
  EXPECT_EQ(h->op_timeout_ms, 1234u);
  EXPECT_EQ(h->aborted.load(), 0u);
  munmap(p, (*seg)->size());
  const auto c = (*seg)->ReadCounters();
  EXPECT_EQ(c.ops_completed + c.ops_failed + c.bytes, 0u);
  EXPECT_TRUE((*seg)->ReadPending().empty());
}

TEST(FastPathSegmentTest, RefusesJobsTooBigForIt) {
  auto seg = FastPathSegment::Create(64, 1 << 20, 1000);
  EXPECT_EQ(seg.status().code(), absl::StatusCode::kFailedPrecondition);
}

TEST(FastPathSegmentTest, AbortWritesOnceAndGarbageIsHarmless) {
  auto seg = FastPathSegment::Create(4, 1024, 1000);
  ASSERT_TRUE(seg.ok()) << seg.status();
  // A hostile trainer writes garbage over every byte.
  void* p = mmap(nullptr, (*seg)->size(), PROT_READ | PROT_WRITE, MAP_SHARED, (*seg)->fd(), 0);
  ASSERT_NE(p, MAP_FAILED);
  std::mt19937_64 rng(7);
  auto* words = static_cast<uint64_t*>(p);
  for (uint64_t i = 0; i < (*seg)->size() / 8; ++i) words[i] = rng();
  // Reading is still safe (numbers are just numbers, names are clamped).
  (void)(*seg)->ReadCounters();
  for (const auto& row : (*seg)->ReadPending()) EXPECT_LE(row.name.size(), wire::kMaxOpName);
  // Every slot marked used and pending, with absurd lengths.
  const auto g = wire::ComputeFastPathGeometry(4, 1024);
  for (uint32_t i = 0; i < g.slot_count; ++i) {
    auto* s = reinterpret_cast<wire::FastSlot*>(static_cast<uint8_t*>(p) + g.slots_offset +
                                                uint64_t{i} * g.slot_stride);
    s->state = static_cast<uint32_t>(wire::FastSlotState::kUsed);
    s->status.store(0);
    s->name_len = 0xffffffff;
    s->count = ~0ull;
    s->dtype = 8;
  }
  auto rows = (*seg)->ReadPending();
  EXPECT_EQ(rows.size(), g.slot_count);
  for (const auto& row : rows) EXPECT_EQ(row.name.size(), wire::kMaxOpName);
  // Keys that only route an operation to the daemon are not pending here
  // (the daemon lists the operation itself).
  reinterpret_cast<wire::FastSlot*>(static_cast<uint8_t*>(p) + g.slots_offset)->route =
      static_cast<uint32_t>(wire::FastRoute::kDaemon);
  EXPECT_EQ((*seg)->ReadPending().size(), g.slot_count - 1);
  (*seg)->Abort(absl::AbortedError("rank 1 left"));
  (*seg)->Abort(absl::UnavailableError("second"));
  const auto* h = static_cast<const wire::FastPathHeader*>(p);
  EXPECT_EQ(h->aborted.load(), 1u);
  EXPECT_EQ(h->abort_code, static_cast<int>(absl::StatusCode::kAborted));
  EXPECT_EQ(std::string(h->abort_message, h->abort_message_len), "rank 1 left");
  munmap(p, (*seg)->size());
}

}  // namespace
}  // namespace ciuic::daemon
