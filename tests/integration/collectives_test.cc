// Every collective x dtype x reduce op x size class, on 1, 2, 3 and 4
// trainer processes of a real ciuicd, against the independent reference.
// The daemon runs with small chunks and no inline path, so that sizes cross
// chunk boundaries (a count that is not a multiple of the chunk) and the
// worker pool is exercised.
#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <vector>

#include "ciuic/ciuic.h"
#include "common.h"
#include "harness.h"
#include "reference.h"

namespace ciuic::testing {
namespace {

constexpr char kSmallChunks[] =
    "tuning:\n"
    "  chunk_bytes: 64K\n"
    "  small_op_bytes: 0\n";

// One rank, one operation against the reference; `zero_copy` chooses
// shared-memory buffers or plain heap ones (staged by the SDK).
int RunOne(Communicator& comm, Coll coll, DataType t, ReduceOp op, size_t count, bool zero_copy,
           bool in_place, const std::string& name) {
  CheckOptions o;
  o.name = name;
  o.zero_copy = zero_copy;
  o.in_place = in_place;
  o.root = comm.world_size() - 1;
  return RunAndCheck(comm, coll, t, op, count, o);
}

int RunMatrix(const std::string& socket, const std::string& job, int rank, int world) {
  auto comm = JoinJob(socket, job, rank, world, 64 << 20);
  CHILD_CHECK(comm != nullptr, "join");
  const size_t kCounts[] = {0, 1, 1001, 262147};  // 262147 float32: 16 chunks and a bit
  int combo = 0;
  for (Coll coll : {Coll::kAllreduce, Coll::kReduceScatter, Coll::kAllgather, Coll::kBroadcast,
                     Coll::kAlltoall}) {
    const bool reduces = coll == Coll::kAllreduce || coll == Coll::kReduceScatter;
    for (DataType t : kAllDataTypes) {
      for (ReduceOp op : kAllReduceOps) {
        if (!reduces && op != ReduceOp::kSum) continue;
        for (size_t count : kCounts) {
          ++combo;
          const bool zero_copy = combo % 2 == 0;
          const bool in_place = combo % 3 == 0;
          std::string name = std::string(CollName(coll)) + "/" + DataTypeName(t) + "/" +
                             ReduceOpName(op) + "/" + std::to_string(count) +
                             (zero_copy ? "/shm" : "/heap") + (in_place ? "/inplace" : "");
          if (RunOne(*comm, coll, t, op, count, zero_copy, in_place, name) != 0) return 1;
        }
      }
    }
  }
  Status s = comm->Barrier().Wait();
  CHILD_CHECK(s.ok(), "barrier: %s", s.ToString().c_str());
  return 0;
}

// alltoallv: every dtype, uneven counts (none, one, odd, empty pairs, a
// rank sending nothing, rank 0 moving nothing, large), zero copy and staged; then counts that
// disagree between two ranks fail on every rank, and the job goes on.
int RunAlltoallvMatrix(const std::string& socket, const std::string& job, int rank, int world) {
  auto comm = JoinJob(socket, job, rank, world, 64 << 20);
  CHILD_CHECK(comm != nullptr, "join");
  int combo = 0;
  for (DataType t : kAllDataTypes) {
    for (int pattern = 0; pattern < kUnevenPatterns; ++pattern) {
      const size_t scale = pattern == 3 && t == DataType::kInt8 ? 150001 : 1001;
      const std::string name = std::string("a2av/") + DataTypeName(t) + "/" + std::to_string(pattern);
      auto counts = [&](int i, int j) { return UnevenCounts(i, j, pattern, scale); };
      if (RunAlltoallvAndCheck(*comm, t, counts, name, ++combo % 2 == 0, pattern) != 0) return 1;
    }
  }
  if (world > 1) {
    // Rank 1 expects one element more from rank 0 than rank 0 sends it.
    auto counts = [](int i, int j) { return static_cast<size_t>(3 + i + j); };
    if (ExpectAlltoallvMismatch(*comm, counts, 0, 1, "a2av/mismatch",
                                "rank 0 sends 4 element(s) to rank 1, which expects 5") != 0) {
      return 1;
    }
    // Wrong number of counts: refused by the SDK at once.
    std::vector<size_t> one(world, 1);
    std::vector<int32_t> in(world), out(world);
    Status s = comm->Alltoallv(in.data(), {1}, out.data(), one, DataType::kInt32).Wait();
    CHILD_CHECK(s.code() == StatusCode::kInvalidArgument && Contains(s.message(), "one per rank"),
                "%s", s.ToString().c_str());
    std::vector<size_t> huge(world, SIZE_MAX / 2);
    s = comm->Alltoallv(in.data(), huge, out.data(), one, DataType::kInt32).Wait();
    CHILD_CHECK(s.code() == StatusCode::kInvalidArgument &&
                    Contains(s.message(), "send counts add up to more bytes"),
                "%s", s.ToString().c_str());
  }
  auto after = [](int i, int j) { return static_cast<size_t>(i * 2 + j); };
  if (RunAlltoallvAndCheck(*comm, DataType::kFloat32, after, "a2av/after", true) != 0) return 1;
  Status s = comm->Barrier().Wait();
  CHILD_CHECK(s.ok(), "barrier: %s", s.ToString().c_str());
  return 0;
}

class CollectivesTest : public ::testing::TestWithParam<int> {};

TEST_P(CollectivesTest, AlltoallvUnevenBlocksAndMismatchedCounts) {
  auto daemon = DaemonProcess::Start(kSmallChunks);
  ASSERT_NE(daemon, nullptr);
  const int world = GetParam();
  const std::string job = UniqueJobId("a2av");
  auto codes = RunRanks(world, [&](int rank) {
    return RunAlltoallvMatrix(daemon->socket(), job, rank, world);
  });
  for (int r = 0; r < world; ++r) EXPECT_EQ(codes[r], 0) << "rank " << r;
  EXPECT_EQ(daemon->Stop(), 0);
}

TEST_P(CollectivesTest, EveryCollectiveDtypeOpAndSizeMatchesTheReference) {
  auto daemon = DaemonProcess::Start(kSmallChunks);
  ASSERT_NE(daemon, nullptr);
  const int world = GetParam();
  const std::string job = UniqueJobId("matrix");
  auto codes = RunRanks(world, [&](int rank) { return RunMatrix(daemon->socket(), job, rank, world); });
  for (int r = 0; r < world; ++r) EXPECT_EQ(codes[r], 0) << "rank " << r;
  EXPECT_EQ(daemon->Stop(), 0);
}

INSTANTIATE_TEST_SUITE_P(Ranks, CollectivesTest, ::testing::Values(1, 2, 3, 4));

// >= 64 MiB per rank with the default tuning: the worker pool, many chunks,
// both zero-copy and staged buffers.
TEST(LargeCollectivesTest, SixtyFourMiBAllreduceReduceScatterAllgather) {
  auto daemon = DaemonProcess::Start();
  ASSERT_NE(daemon, nullptr);
  for (int world : {2, 4}) {
    const std::string job = UniqueJobId("large");
    auto codes = RunRanks(world, [&](int rank) {
      auto comm = JoinJob(daemon->socket(), job, rank, world, 192ull << 20);
      CHILD_CHECK(comm != nullptr, "join");
      const size_t n = (64ull << 20) / 4 + 3;  // just over 64 MiB of float32
      if (RunOne(*comm, Coll::kAllreduce, DataType::kFloat32, ReduceOp::kSum, n, true, false, "ar-shm")) return 1;
      if (RunOne(*comm, Coll::kAllreduce, DataType::kFloat32, ReduceOp::kSum, n, false, true, "ar-heap")) return 1;
      if (RunOne(*comm, Coll::kReduceScatter, DataType::kBFloat16, ReduceOp::kMax, n / world, true, false, "rs")) return 1;
      if (RunOne(*comm, Coll::kAllgather, DataType::kInt32, ReduceOp::kSum, n / world, true, true, "ag")) return 1;
      return 0;
    });
    for (int r = 0; r < world; ++r) EXPECT_EQ(codes[r], 0) << "world " << world << " rank " << r;
  }
  EXPECT_EQ(daemon->Stop(), 0);
}

}  // namespace
}  // namespace ciuic::testing
