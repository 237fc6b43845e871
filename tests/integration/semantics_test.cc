// Matching of named operations across ranks: any submission order, the
// mismatch error on every rank, duplicates, timeouts, handle behaviour.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <numeric>
#include <thread>
#include <vector>

#include "common.h"
#include "harness.h"

namespace ciuic::testing {
namespace {

using Clock = std::chrono::steady_clock;

class SemanticsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    daemon_ = DaemonProcess::Start();
    ASSERT_NE(daemon_, nullptr);
  }
  void TearDown() override {
    if (daemon_) EXPECT_EQ(daemon_->Stop(), 0) << "ciuicd did not drain cleanly";
  }
  void ExpectAllZero(const std::vector<int>& codes) {
    for (size_t r = 0; r < codes.size(); ++r) EXPECT_EQ(codes[r], 0) << "rank " << r;
  }
  std::unique_ptr<DaemonProcess> daemon_;
};

// Each rank submits the same 24 named operations in its own order (rotated
// and, on odd ranks, reversed), all before waiting for any.
TEST_F(SemanticsTest, NamedOperationsInAnyOrderNeverMixUp) {
  for (int world : {2, 4}) {
    const std::string job = UniqueJobId("order");
    ExpectAllZero(RunRanks(world, [&](int rank) {
      auto comm = JoinJob(daemon_->socket(), job, rank, world);
      CHILD_CHECK(comm != nullptr, "join");
      constexpr int kOps = 24;
      std::vector<int> order(kOps);
      std::iota(order.begin(), order.end(), 0);
      std::rotate(order.begin(), order.begin() + (rank * 5) % kOps, order.end());
      if (rank % 2) std::reverse(order.begin(), order.end());
      std::vector<Buffer> bufs(kOps);
      std::vector<Handle> handles(kOps);
      for (int op : order) {
        const size_t n = 100 + op * 37;  // each name has its own size
        Status s = comm->Allocate(n * sizeof(int64_t), &bufs[op]);
        CHILD_CHECK(s.ok(), "%s", s.ToString().c_str());
        for (size_t i = 0; i < n; ++i) bufs[op].as<int64_t>()[i] = op * 1000000 + rank * 1000 + i;
        OpOptions o;
        o.name = "layer" + std::to_string(op);
        handles[op] = comm->Allreduce(bufs[op].data(), bufs[op].data(), n, DataType::kInt64,
                                      ReduceOp::kSum, o);
      }
      for (int op = 0; op < kOps; ++op) {
        Status s = handles[op].Wait();
        CHILD_CHECK(s.ok(), "layer%d: %s", op, s.ToString().c_str());
        const size_t n = 100 + op * 37;
        for (size_t i = 0; i < n; ++i) {
          int64_t want = 0;
          for (int r = 0; r < world; ++r) want += op * 1000000 + r * 1000 + i;
          CHILD_CHECK(bufs[op].as<int64_t>()[i] == want, "layer%d element %zu", op, i);
        }
      }
      return 0;
    }));
  }
}

TEST_F(SemanticsTest, UnnamedOperationsMatchBySubmissionOrder) {
  const std::string job = UniqueJobId("unnamed");
  ExpectAllZero(RunRanks(3, [&](int rank) {
    auto comm = JoinJob(daemon_->socket(), job, rank, 3);
    CHILD_CHECK(comm != nullptr, "join");
    for (int step = 0; step < 50; ++step) {
      std::vector<float> v(7, static_cast<float>(rank + step));
      Status s = comm->Allreduce(v.data(), v.data(), v.size(), DataType::kFloat32, ReduceOp::kMax).Wait();
      CHILD_CHECK(s.ok(), "%s", s.ToString().c_str());
      CHILD_CHECK(v[6] == static_cast<float>(2 + step), "step %d got %f", step, v[6]);
    }
    return 0;
  }));
}

// The same name with a different signature fails on every rank with a
// message naming the operation and both signatures; the job goes on.
TEST_F(SemanticsTest, MismatchIsAClearErrorOnEveryRank) {
  const std::string job = UniqueJobId("mismatch");
  ExpectAllZero(RunRanks(2, [&](int rank) {
    auto comm = JoinJob(daemon_->socket(), job, rank, 2);
    CHILD_CHECK(comm != nullptr, "join");
    std::vector<float> f(16, 1.0f);
    std::vector<int32_t> i32(16, 1);
    OpOptions o;
    auto expect_mismatch = [&](Handle h, const std::string& name, const std::string& a,
                               const std::string& b) -> int {
      Status s = h.Wait();
      CHILD_CHECK(s.code() == StatusCode::kInvalidArgument, "%s: %s", name.c_str(),
                  s.ToString().c_str());
      CHILD_CHECK(Contains(s.message(), "'" + name + "'") && Contains(s.message(), "mismatch") &&
                      Contains(s.message(), a) && Contains(s.message(), b),
                  "%s", s.message().c_str());
      return 0;
    };
    o.name = "grad.count";
    if (expect_mismatch(comm->Allreduce(f.data(), f.data(), rank == 0 ? 10 : 12,
                                        DataType::kFloat32, ReduceOp::kSum, o),
                        o.name, "count=10", "count=12")) return 1;
    o.name = "grad.dtype";
    if (expect_mismatch(rank == 0 ? comm->Allreduce(f.data(), f.data(), 16, DataType::kFloat32, ReduceOp::kSum, o)
                                  : comm->Allreduce(i32.data(), i32.data(), 16, DataType::kInt32, ReduceOp::kSum, o),
                        o.name, "float32", "int32")) return 1;
    o.name = "grad.op";
    if (expect_mismatch(comm->Allreduce(f.data(), f.data(), 16, DataType::kFloat32,
                                        rank == 0 ? ReduceOp::kSum : ReduceOp::kMax, o),
                        o.name, "op=sum", "op=max")) return 1;
    o.name = "grad.collective";
    if (expect_mismatch(rank == 0 ? comm->Allreduce(f.data(), f.data(), 16, DataType::kFloat32, ReduceOp::kSum, o)
                                  : comm->Broadcast(f.data(), 16, DataType::kFloat32, 0, o),
                        o.name, "allreduce", "broadcast")) return 1;
    o.name = "grad.root";
    if (expect_mismatch(comm->Broadcast(f.data(), 16, DataType::kFloat32, rank, o), o.name,
                        "root=0", "root=1")) return 1;
    // The job is still usable.
    o.name = "after";
    Status s = comm->Allreduce(f.data(), f.data(), 16, DataType::kFloat32, ReduceOp::kSum, o).Wait();
    CHILD_CHECK(s.ok(), "%s", s.ToString().c_str());
    return 0;
  }));
}

TEST_F(SemanticsTest, SameNameTwiceWhilePendingIsRefused) {
  const std::string job = UniqueJobId("dup");
  int pipe_fds[2];
  ASSERT_EQ(pipe(pipe_fds), 0);
  ExpectAllZero(RunRanks(2, [&](int rank) {
    auto comm = JoinJob(daemon_->socket(), job, rank, 2);
    CHILD_CHECK(comm != nullptr, "join");
    std::vector<float> a(4, 1.0f), b(4, 1.0f);
    OpOptions o;
    o.name = "dup";
    if (rank == 0) {
      Handle first = comm->Allreduce(a.data(), a.data(), 4, DataType::kFloat32, ReduceOp::kSum, o);
      Status second = comm->Allreduce(b.data(), b.data(), 4, DataType::kFloat32, ReduceOp::kSum, o).Wait();
      CHILD_CHECK(second.code() == StatusCode::kFailedPrecondition && Contains(second.message(), "twice"),
                  "%s", second.ToString().c_str());
      CHILD_CHECK(write(pipe_fds[1], "x", 1) == 1, "pipe");
      Status s = first.Wait();
      CHILD_CHECK(s.ok() && a[0] == 2.0f, "%s", s.ToString().c_str());
    } else {
      char c;
      CHILD_CHECK(read(pipe_fds[0], &c, 1) == 1, "pipe");
      Status s = comm->Allreduce(a.data(), a.data(), 4, DataType::kFloat32, ReduceOp::kSum, o).Wait();
      CHILD_CHECK(s.ok() && a[0] == 2.0f, "%s", s.ToString().c_str());
    }
    return 0;
  }));
  close(pipe_fds[0]);
  close(pipe_fds[1]);
}

// A name that is not UTF-8 (it could not travel in the protobuf messages
// that carry names) is refused by the SDK, naming the problem; the session
// goes on.
TEST_F(SemanticsTest, NonUtf8NameIsRefused) {
  const std::string job = UniqueJobId("utf8");
  ExpectAllZero(RunRanks(1, [&](int rank) {
    auto comm = JoinJob(daemon_->socket(), job, rank, 1);
    CHILD_CHECK(comm != nullptr, "join");
    std::vector<float> a(4, 1.0f);
    OpOptions o;
    o.name = "grad\xff";
    Status s = comm->Allreduce(a.data(), a.data(), 4, DataType::kFloat32, ReduceOp::kSum, o).Wait();
    CHILD_CHECK(s.code() == StatusCode::kInvalidArgument && Contains(s.message(), "UTF-8"), "%s",
                s.ToString().c_str());
    o.name = "gr\xc3\xa4" "d";  // UTF-8: fine
    s = comm->Allreduce(a.data(), a.data(), 4, DataType::kFloat32, ReduceOp::kSum, o).Wait();
    CHILD_CHECK(s.ok(), "%s", s.ToString().c_str());
    return 0;
  }));
}

// WaitFor gives up without cancelling; Test never blocks; an operation that
// outlives its timeout fails on the ranks that submitted it, naming the
// missing rank, and a late submitter gets the same error at once.
TEST_F(SemanticsTest, HandlesAndTimeouts) {
  const std::string job = UniqueJobId("handles");
  int go[2], done[2];
  ASSERT_EQ(pipe(go), 0);
  ASSERT_EQ(pipe(done), 0);
  ExpectAllZero(RunRanks(2, [&](int rank) {
    auto comm = JoinJob(daemon_->socket(), job, rank, 2);
    CHILD_CHECK(comm != nullptr, "join");
    std::vector<double> v(3, rank + 1.0);
    OpOptions o;
    o.name = "late";
    if (rank == 0) {
      Handle h = comm->Allreduce(v.data(), v.data(), 3, DataType::kFloat64, ReduceOp::kSum, o);
      CHILD_CHECK(!h.Test(), "completed without its partner");
      Status s = h.WaitFor(std::chrono::milliseconds(200));
      CHILD_CHECK(s.code() == StatusCode::kDeadlineExceeded, "%s", s.ToString().c_str());
      CHILD_CHECK(write(go[1], "x", 1) == 1, "pipe");
      char c;
      s = h.Wait();
      CHILD_CHECK(s.ok() && v[0] == 3.0 && h.Test(), "%s", s.ToString().c_str());

      o.name = "never";
      o.timeout_ms = 300;
      auto t0 = Clock::now();
      s = comm->Allreduce(v.data(), v.data(), 3, DataType::kFloat64, ReduceOp::kSum, o).Wait();
      auto waited = Clock::now() - t0;
      CHILD_CHECK(s.code() == StatusCode::kDeadlineExceeded &&
                      Contains(s.message(), "'never'") && Contains(s.message(), "rank(s) 1"),
                  "%s", s.ToString().c_str());
      CHILD_CHECK(waited < std::chrono::seconds(3), "timeout took too long");
      CHILD_CHECK(write(go[1], "y", 1) == 1, "pipe");
      CHILD_CHECK(read(done[0], &c, 1) == 1, "pipe");  // stay joined until rank 1 checked
    } else {
      char c;
      CHILD_CHECK(read(go[0], &c, 1) == 1, "pipe");
      Status s = comm->Allreduce(v.data(), v.data(), 3, DataType::kFloat64, ReduceOp::kSum, o).Wait();
      CHILD_CHECK(s.ok() && v[0] == 3.0, "%s", s.ToString().c_str());
      CHILD_CHECK(read(go[0], &c, 1) == 1, "pipe");
      o.name = "never";
      s = comm->Allreduce(v.data(), v.data(), 3, DataType::kFloat64, ReduceOp::kSum, o).Wait();
      CHILD_CHECK(s.code() == StatusCode::kDeadlineExceeded, "late submitter: %s",
                  s.ToString().c_str());
      CHILD_CHECK(write(done[1], "z", 1) == 1, "pipe");
    }
    return 0;
  }));
  for (int fd : {go[0], go[1], done[0], done[1]}) close(fd);
}

TEST_F(SemanticsTest, BarrierWaitsForTheSlowestRank) {
  const std::string job = UniqueJobId("barrier");
  ExpectAllZero(RunRanks(3, [&](int rank) {
    auto comm = JoinJob(daemon_->socket(), job, rank, 3);
    CHILD_CHECK(comm != nullptr, "join");
    if (rank == 2) std::this_thread::sleep_for(std::chrono::milliseconds(400));
    auto t0 = Clock::now();
    Status s = comm->Barrier().Wait();
    CHILD_CHECK(s.ok(), "%s", s.ToString().c_str());
    if (rank == 0) {
      CHILD_CHECK(Clock::now() - t0 > std::chrono::milliseconds(250), "barrier did not wait");
    }
    return 0;
  }));
}

// Buffers outside shared memory are staged one by one: two private buffers
// far apart in memory need only their own sizes in the arena.
TEST_F(SemanticsTest, PrivateBuffersFarApartAreStagedSeparately) {
  const std::string job = UniqueJobId("apart");
  ExpectAllZero(RunRanks(2, [&](int rank) {
    auto comm = JoinJob(daemon_->socket(), job, rank, 2, 8 << 20);
    CHILD_CHECK(comm != nullptr, "join");
    std::vector<float> memory((48 << 20) / 4);  // send at the start, recv 40 MiB further
    const size_t n = 1 << 18;                    // 1 MiB per rank
    float* send = memory.data();
    float* recv = memory.data() + (40 << 20) / 4;
    for (size_t i = 0; i < n; ++i) send[i] = static_cast<float>(rank * 10 + i % 7);
    Status s = comm->Allgather(send, recv, n, DataType::kFloat32).Wait();
    CHILD_CHECK(s.ok(), "%s", s.ToString().c_str());
    for (int r = 0; r < 2; ++r) {
      for (size_t i = 0; i < n; i += 4097) {
        CHILD_CHECK(recv[r * n + i] == static_cast<float>(r * 10 + i % 7), "block %d element %zu", r, i);
      }
    }
    return 0;
  }));
}

TEST_F(SemanticsTest, JoinErrorsAreClear) {
  const std::string job = UniqueJobId("join");
  ExpectAllZero(RunRanks(1, [&](int) {
    JobOptions o;
    o.socket_path = daemon_->socket();
    o.job_id = job;
    o.world_size = 2;
    o.rank = 0;
    o.arena_bytes = 1 << 20;
    std::unique_ptr<Communicator> a, b;
    Status s = Communicator::Create(o, &a);
    CHILD_CHECK(s.ok(), "%s", s.ToString().c_str());
    s = Communicator::Create(o, &b);  // same rank again
    CHILD_CHECK(s.code() == StatusCode::kAlreadyExists && Contains(s.message(), "rank 0"), "%s",
                s.ToString().c_str());
    o.rank = 1;
    o.world_size = 3;  // disagrees with the job
    s = Communicator::Create(o, &b);
    CHILD_CHECK(s.code() == StatusCode::kInvalidArgument && Contains(s.message(), "world size"),
                "%s", s.ToString().c_str());
    o.world_size = 2;
    o.rank = 5;
    s = Communicator::Create(o, &b);
    CHILD_CHECK(s.code() == StatusCode::kInvalidArgument, "%s", s.ToString().c_str());
    o.rank = 1;
    o.arena_bytes = 1ull << 50;  // more than max_arena_bytes
    s = Communicator::Create(o, &b);
    CHILD_CHECK(s.code() == StatusCode::kResourceExhausted && Contains(s.message(), "max_arena_bytes"),
                "%s", s.ToString().c_str());
    o.arena_bytes = 1 << 20;
    o.socket_path = daemon_->dir() + "/nobody-here.sock";
    s = Communicator::Create(o, &b);
    CHILD_CHECK(s.code() == StatusCode::kUnavailable && Contains(s.message(), "nobody-here"),
                "%s", s.ToString().c_str());
    return 0;
  }));
}

}  // namespace
}  // namespace ciuic::testing
