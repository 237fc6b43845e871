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
#include "harness.h"
#include "reference.h"

namespace ciuic::testing {
namespace {

constexpr char kSmallChunks[] =
    "tuning:\n"
    "  chunk_bytes: 64K\n"
    "  small_op_bytes: 0\n";

const char* Name(Coll c) {
  switch (c) {
    case Coll::kAllreduce: return "allreduce";
    case Coll::kReduceScatter: return "reduce_scatter";
    case Coll::kAllgather: return "allgather";
    case Coll::kBroadcast: return "broadcast";
  }
  return "?";
}

std::unique_ptr<Communicator> Join(const std::string& socket, const std::string& job, int rank,
                                   int world, uint64_t arena = 64 << 20) {
  JobOptions o;
  o.socket_path = socket;
  o.job_id = job;
  o.rank = rank;
  o.world_size = world;
  o.arena_bytes = arena;
  std::unique_ptr<Communicator> c;
  Status s = Communicator::Create(o, &c);
  if (!s.ok()) fprintf(stderr, "rank %d: Create: %s\n", rank, s.ToString().c_str());
  return c;
}

// One rank: runs one operation and compares the whole receive buffer, byte
// for byte, with the reference. `zero_copy` chooses shared-memory buffers or
// plain heap ones (staged by the SDK).
int RunOne(Communicator& comm, Coll coll, DataType t, ReduceOp op, size_t count, bool zero_copy,
           bool in_place, const std::string& name) {
  const int world = comm.world_size();
  const int rank = comm.rank();
  const size_t es = DataTypeSize(t);
  const size_t send_count = coll == Coll::kReduceScatter ? count * world : count;
  const size_t recv_count = coll == Coll::kAllgather ? count * world : count;

  Buffer sb, rb;
  std::vector<uint8_t> sh, rh;
  uint8_t* send;
  uint8_t* recv;
  if (zero_copy) {
    Status s = comm.Allocate(send_count * es, &sb);
    CHILD_CHECK(s.ok(), "%s", s.ToString().c_str());
    s = comm.Allocate(recv_count * es, &rb);
    CHILD_CHECK(s.ok(), "%s", s.ToString().c_str());
    send = static_cast<uint8_t*>(sb.data());
    recv = static_cast<uint8_t*>(rb.data());
  } else {
    sh.resize(send_count * es + 1);
    rh.resize(recv_count * es + 1);
    send = sh.data();
    recv = rh.data();
  }
  FillInput(t, op, rank, send, send_count);
  std::memset(recv, 0x5a, recv_count * es);

  // In place: allreduce/broadcast into send; reduce_scatter out of its own
  // block of send; allgather from its own block of recv.
  const uint8_t* send_arg = send;
  uint8_t* recv_arg = recv;
  if (in_place) {
    if (coll == Coll::kAllreduce || coll == Coll::kBroadcast) {
      recv_arg = send;
    } else if (coll == Coll::kReduceScatter) {
      recv_arg = send + rank * count * es;
    } else {
      std::memcpy(recv + rank * count * es, send, count * es);
      send_arg = recv + rank * count * es;
    }
  }

  OpOptions opts;
  opts.name = name;
  const int root = world - 1;
  Handle h;
  switch (coll) {
    case Coll::kAllreduce: h = comm.Allreduce(send_arg, recv_arg, count, t, op, opts); break;
    case Coll::kReduceScatter: h = comm.ReduceScatter(send_arg, recv_arg, count, t, op, opts); break;
    case Coll::kAllgather: h = comm.Allgather(send_arg, recv_arg, count, t, opts); break;
    case Coll::kBroadcast: h = comm.Broadcast(send_arg, recv_arg, count, t, root, opts); break;
  }
  Status s = h.Wait();
  CHILD_CHECK(s.ok(), "%s: %s", name.c_str(), s.ToString().c_str());

  // Expected output, from every rank's regenerated input.
  const std::vector<uint8_t> want = ReferenceCollective(
      coll, t, op, world, rank, root, count,
      [&](int r, void* out, size_t n) { FillInput(t, op, r, out, n); });
  const uint8_t* got = recv_arg;
  if (in_place && coll == Coll::kAllgather) got = recv;
  for (size_t i = 0; i < recv_count; ++i) {
    if (std::memcmp(got + i * es, want.data() + i * es, es) != 0) {
      CHILD_CHECK(false, "%s rank %d: element %zu of %zu differs from the reference",
                  name.c_str(), rank, i, recv_count);
    }
  }
  return 0;
}

int RunMatrix(const std::string& socket, const std::string& job, int rank, int world) {
  auto comm = Join(socket, job, rank, world);
  CHILD_CHECK(comm != nullptr, "join");
  const size_t kCounts[] = {0, 1, 1001, 262147};  // 262147 float32: 16 chunks and a bit
  int combo = 0;
  for (Coll coll : {Coll::kAllreduce, Coll::kReduceScatter, Coll::kAllgather, Coll::kBroadcast}) {
    const bool reduces = coll == Coll::kAllreduce || coll == Coll::kReduceScatter;
    for (DataType t : kAllDataTypes) {
      for (ReduceOp op : kAllReduceOps) {
        if (!reduces && op != ReduceOp::kSum) continue;
        for (size_t count : kCounts) {
          ++combo;
          const bool zero_copy = combo % 2 == 0;
          const bool in_place = combo % 3 == 0;
          std::string name = std::string(Name(coll)) + "/" + DataTypeName(t) + "/" +
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

class CollectivesTest : public ::testing::TestWithParam<int> {};

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
      auto comm = Join(daemon->socket(), job, rank, world, 192ull << 20);
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
