// The fast path's slot table and protocol with ranks as threads over one
// shared mapping: random submission orders of many names, repeated names,
// collisions forced with a tiny table, mismatch, timeout, abort, a name
// submitted twice, and the routes of operations on both sides of the limit
// (every arrival order of 2 and 3 ranks).
#include "fast_path.h"

#include <sys/mman.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <random>
#include <thread>
#include <vector>

#include "gtest/gtest.h"

namespace ciuic {
namespace {

using Clock = std::chrono::steady_clock;

class Segment {
 public:
  Segment(uint32_t world_size, uint64_t payload, uint32_t max_inflight,
          uint32_t timeout_ms = 60000)
      : geometry_(wire::ComputeFastPathGeometry(world_size, payload, max_inflight)),
        world_size_(world_size) {
    EXPECT_TRUE(geometry_.valid);
    base_ = static_cast<uint8_t*>(mmap(nullptr, geometry_.segment_bytes, PROT_READ | PROT_WRITE,
                                       MAP_SHARED | MAP_ANONYMOUS, -1, 0));
    EXPECT_NE(base_, MAP_FAILED);
    wire::InitFastPathSegment(base_, geometry_, world_size, payload, timeout_ms);
  }
  ~Segment() { munmap(base_, geometry_.segment_bytes); }

  std::unique_ptr<FastPath> Rank(int rank) {
    std::unique_ptr<FastPath> fp;
    Status s = FastPath::Attach(base_, geometry_.segment_bytes, rank, world_size_, "job", &fp);
    EXPECT_TRUE(s.ok()) << s.ToString();
    return fp;
  }
  // What the daemon does when a trainer of the job dies.
  void Abort(const std::string& why) {
    auto* h = reinterpret_cast<wire::FastPathHeader*>(base_);
    std::memcpy(h->abort_message, why.data(), why.size());
    h->abort_message_len = static_cast<uint32_t>(why.size());
    h->abort_code = static_cast<int>(StatusCode::kAborted);
    h->aborted.store(1, std::memory_order_release);
  }
  uint32_t used_slots() const {
    uint32_t n = 0;
    for (uint32_t i = 0; i < geometry_.slot_count; ++i) {
      auto* s = reinterpret_cast<const wire::FastSlot*>(base_ + geometry_.slots_offset +
                                                        uint64_t{i} * geometry_.slot_stride);
      n += s->state == static_cast<uint32_t>(wire::FastSlotState::kUsed);
    }
    return n;
  }
  const wire::FastPathGeometry& geometry() const { return geometry_; }
  uint8_t* base() const { return base_; }

 private:
  wire::FastPathGeometry geometry_;
  uint32_t world_size_;
  uint8_t* base_ = nullptr;
};

FastPath::Signature AllreduceInt64(uint64_t count) {
  FastPath::Signature sig;
  sig.collective = static_cast<uint32_t>(wire::Collective::kAllreduce);
  sig.dtype = static_cast<uint32_t>(wire::DataType::kInt64);
  sig.reduce_op = static_cast<uint32_t>(wire::ReduceOp::kSum);
  sig.count = count;
  return sig;
}

Status WaitOp(FastPath& fp, FastOp& op) {
  fp.Wait(op, Clock::time_point::max(), 20, [] { return Status::Ok(); });
  return op.status;
}

TEST(FastPathGeometryTest, FitsAndRefusesTooBig) {
  auto g = wire::ComputeFastPathGeometry(2, 4096);
  ASSERT_TRUE(g.valid);
  EXPECT_EQ(g.max_inflight_per_rank, wire::kMaxFastPathInflight);
  EXPECT_GE(g.slot_count, 2u * 2 * g.max_inflight_per_rank);
  EXPECT_LE(g.segment_bytes, wire::kMaxFastPathSegmentBytes);
  auto big = wire::ComputeFastPathGeometry(64, 1 << 20);
  EXPECT_FALSE(big.valid && big.max_inflight_per_rank >= wire::kMinFastPathInflight);
  EXPECT_FALSE(wire::ComputeFastPathGeometry(0, 4096).valid);
  EXPECT_FALSE(wire::ComputeFastPathGeometry(65, 4096).valid);
  EXPECT_FALSE(wire::ComputeFastPathGeometry(2, 0).valid);
}

TEST(FastPathTest, AttachRefusesAForeignHeader) {
  Segment seg(2, 256, 4);
  std::unique_ptr<FastPath> fp;
  EXPECT_FALSE(FastPath::Attach(seg.base(), seg.geometry().segment_bytes, 0, 3, "j", &fp).ok());
  EXPECT_FALSE(FastPath::Attach(seg.base(), seg.geometry().segment_bytes + 4096, 0, 2, "j", &fp).ok());
  reinterpret_cast<wire::FastPathHeader*>(seg.base())->slot_count = 1 << 20;
  EXPECT_FALSE(FastPath::Attach(seg.base(), seg.geometry().segment_bytes, 0, 2, "j", &fp).ok());
}

// Each rank submits the same (name, round) keys in its own random order,
// `window` at a time, then waits for them; values tell every rank and key
// apart, so a key split over two slots or matched with the wrong one shows.
void RunRandomOrders(int world, uint32_t max_inflight, int names, int rounds, int window,
                     Segment& seg) {
  std::vector<std::thread> threads;
  std::atomic<int> failures{0};
  for (int rank = 0; rank < world; ++rank) {
    threads.emplace_back([&, rank] {
      auto fp = seg.Rank(rank);
      std::mt19937 rng(1234 + rank);
      for (int round = 0; round < rounds; ++round) {
        for (int start = 0; start < names; start += window) {
          const int end = std::min(names, start + window);
          // Each window holds the same names on every rank (shuffled within).
          std::vector<int> batch;
          for (int i = start; i < end; ++i) batch.push_back(i);
          std::shuffle(batch.begin(), batch.end(), rng);
          struct Pending {
            int name;
            std::vector<int64_t> data;
            std::shared_ptr<FastOp> op;
          };
          std::vector<Pending> pending;
          pending.reserve(batch.size());
          for (int n : batch) {
            const uint64_t count = 1 + n % 7;
            Pending p{n, std::vector<int64_t>(count), nullptr};
            for (uint64_t i = 0; i < count; ++i) p.data[i] = (rank + 1) * 1000003LL * (n + 1) + i + round;
            pending.push_back(std::move(p));
            Pending& q = pending.back();
            Status s = fp->Start("n" + std::to_string(n), AllreduceInt64(count), q.data.data(),
                                 count * 8, q.data.data(), 0, &q.op);
            if (!s.ok()) {
              ADD_FAILURE() << s.ToString();
              ++failures;
            }
          }
          for (auto& p : pending) {
            if (!p.op) continue;
            Status s = WaitOp(*fp, *p.op);
            if (!s.ok()) {
              ADD_FAILURE() << "rank " << rank << " name " << p.name << ": " << s.ToString();
              ++failures;
              continue;
            }
            int64_t ranks_sum = 0;
            for (int r = 0; r < world; ++r) ranks_sum += r + 1;
            for (size_t i = 0; i < p.data.size(); ++i) {
              const int64_t want = ranks_sum * 1000003LL * (p.name + 1) +
                                   world * static_cast<int64_t>(i + round);
              if (p.data[i] != want) {
                ADD_FAILURE() << "rank " << rank << " name " << p.name << " elem " << i << ": "
                              << p.data[i] << " != " << want;
                ++failures;
                break;
              }
            }
          }
        }
        (void)max_inflight;
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(failures.load(), 0);
  EXPECT_EQ(seg.used_slots(), 0u) << "every slot is freed once all ranks have left it";
}

TEST(FastPathTest, RandomOrdersManyNamesRepeated) {
  Segment seg(4, 1024, 64);
  RunRandomOrders(4, 64, 64, 20, 64, seg);
}

TEST(FastPathTest, TinyTableForcesCollisionsAndTombstones) {
  // 2 ranks, at most 4 in flight each: 16 slots, up to 8 live keys, so
  // probe chains are long and tombstones are made and cleared all the time.
  Segment seg(2, 128, 4);
  ASSERT_EQ(seg.geometry().slot_count, 16u);
  RunRandomOrders(2, 4, 40, 30, 4, seg);
}

TEST(FastPathTest, TinyTableThreeRanks) {
  Segment seg(3, 64, 2);
  RunRandomOrders(3, 2, 12, 40, 2, seg);
}

TEST(FastPathTest, InflightLimitHoldsWithoutWaits) {
  // A rank that never waits: Start completes its oldest operations itself
  // once it has max_inflight in flight.
  Segment seg(2, 64, 4);
  std::vector<std::thread> threads;
  for (int rank = 0; rank < 2; ++rank) {
    threads.emplace_back([&, rank] {
      auto fp = seg.Rank(rank);
      // Ten names, each reused every ten submissions: a reuse of a name is
      // allowed once its previous operation is no longer pending, which the
      // in-flight limit of 4 guarantees here.
      std::vector<std::vector<int64_t>> data(100, std::vector<int64_t>(1, rank + 1));
      std::vector<std::shared_ptr<FastOp>> ops(100);
      for (int i = 0; i < 100; ++i) {
        ASSERT_TRUE(fp->Start("n" + std::to_string(i % 10), AllreduceInt64(1), data[i].data(), 8, data[i].data(), 0,
                              &ops[i]).ok());
        EXPECT_LE(fp->inflight(), fp->max_inflight());
      }
      for (int i = 0; i < 100; ++i) {
        ASSERT_TRUE(WaitOp(*fp, *ops[i]).ok());
        EXPECT_EQ(data[i][0], 3);
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(seg.used_slots(), 0u);
}

TEST(FastPathTest, MismatchFailsEveryRankNamingBoth) {
  Segment seg(2, 256, 16);
  Status got[2];
  std::vector<std::thread> threads;
  for (int rank = 0; rank < 2; ++rank) {
    threads.emplace_back([&, rank] {
      auto fp = seg.Rank(rank);
      std::vector<int64_t> d(4, 1);
      std::shared_ptr<FastOp> op;
      ASSERT_TRUE(fp->Start("w", AllreduceInt64(rank == 0 ? 4 : 3), d.data(), 8 * (rank == 0 ? 4 : 3),
                            d.data(), 0, &op).ok());
      got[rank] = WaitOp(*fp, *op);
      // The name is usable again afterwards.
      std::shared_ptr<FastOp> again;
      ASSERT_TRUE(fp->Start("w", AllreduceInt64(2), d.data(), 16, d.data(), 0, &again).ok());
      EXPECT_TRUE(WaitOp(*fp, *again).ok());
      EXPECT_EQ(d[0], 2);
    });
  }
  for (auto& t : threads) t.join();
  for (const Status& s : got) {
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
    EXPECT_NE(s.message().find("operation 'w' mismatched across ranks"), std::string::npos) << s.ToString();
    EXPECT_NE(s.message().find("allreduce int64 count=4 op=sum"), std::string::npos) << s.ToString();
    EXPECT_NE(s.message().find("allreduce int64 count=3 op=sum"), std::string::npos) << s.ToString();
  }
}

TEST(FastPathTest, TimeoutNamesTheMissingRankAndPoisonsTheName) {
  Segment seg(2, 256, 16, /*timeout_ms=*/200);
  auto r0 = seg.Rank(0);
  auto r1 = seg.Rank(1);
  std::vector<int64_t> d(2, 1);
  std::shared_ptr<FastOp> op;
  const auto t0 = Clock::now();
  ASSERT_TRUE(r0->Start("late", AllreduceInt64(2), d.data(), 16, d.data(), 0, &op).ok());
  Status s = WaitOp(*r0, *op);
  EXPECT_GE(Clock::now() - t0, std::chrono::milliseconds(200));
  EXPECT_LT(Clock::now() - t0, std::chrono::milliseconds(2000));
  EXPECT_EQ(s.code(), StatusCode::kDeadlineExceeded);
  EXPECT_NE(s.message().find("operation 'late' of job 'job' timed out after"), std::string::npos)
      << s.ToString();
  EXPECT_NE(s.message().find("waiting for rank(s) 1"), std::string::npos) << s.ToString();
  // The late rank gets the same error at once.
  std::shared_ptr<FastOp> late;
  ASSERT_TRUE(r1->Start("late", AllreduceInt64(2), d.data(), 16, d.data(), 0, &late).ok());
  EXPECT_TRUE(r1->Poll(*late));
  EXPECT_EQ(late->status.code(), StatusCode::kDeadlineExceeded);
  EXPECT_EQ(seg.used_slots(), 0u);
}

TEST(FastPathTest, SubmittedTwiceWhilePending) {
  Segment seg(2, 256, 16);
  auto r0 = seg.Rank(0);
  auto r1 = seg.Rank(1);
  std::vector<int64_t> a(1, 1), b(1, 5), c(1, 2);
  std::shared_ptr<FastOp> first, second, other;
  ASSERT_TRUE(r0->Start("t", AllreduceInt64(1), a.data(), 8, a.data(), 0, &first).ok());
  Status s = r0->Start("t", AllreduceInt64(1), b.data(), 8, b.data(), 0, &second);
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(s.message().find("submitted twice by rank 0"), std::string::npos) << s.ToString();
  ASSERT_TRUE(r1->Start("t", AllreduceInt64(1), c.data(), 8, c.data(), 0, &other).ok());
  EXPECT_TRUE(WaitOp(*r0, *first).ok());
  EXPECT_TRUE(WaitOp(*r1, *other).ok());
  EXPECT_EQ(a[0], 3);
  EXPECT_EQ(c[0], 3);
}

TEST(FastPathTest, AbortWakesASleepingWaiter) {
  Segment seg(2, 256, 16);
  auto r0 = seg.Rank(0);
  std::vector<int64_t> d(1, 1);
  std::shared_ptr<FastOp> op;
  ASSERT_TRUE(r0->Start("x", AllreduceInt64(1), d.data(), 8, d.data(), 0, &op).ok());
  std::thread aborter([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(150));
    seg.Abort("rank 1 (pid 7) of job 'job' left: trainer disconnected");
  });
  const auto t0 = Clock::now();
  Status s = WaitOp(*r0, *op);
  aborter.join();
  EXPECT_LT(Clock::now() - t0, std::chrono::milliseconds(1000));
  EXPECT_EQ(s.code(), StatusCode::kAborted);
  EXPECT_EQ(s.message(), "rank 1 (pid 7) of job 'job' left: trainer disconnected");
  // Later submissions fail at once with the same error.
  std::shared_ptr<FastOp> later;
  ASSERT_TRUE(r0->Start("y", AllreduceInt64(1), d.data(), 8, d.data(), 0, &later).ok());
  EXPECT_TRUE(later->finished.load());
  EXPECT_EQ(later->status.code(), StatusCode::kAborted);
}

TEST(FastPathTest, EveryCollectiveSmall) {
  // Reduce_scatter, allgather, broadcast and barrier across 3 thread ranks.
  Segment seg(3, 512, 16);
  std::vector<std::thread> threads;
  std::atomic<int> failures{0};
  for (int rank = 0; rank < 3; ++rank) {
    threads.emplace_back([&, rank] {
      auto fp = seg.Rank(rank);
      auto check = [&](bool ok, const char* what) {
        if (!ok) {
          ADD_FAILURE() << "rank " << rank << ": " << what;
          ++failures;
        }
      };
      // reduce_scatter int32 sum, 2 per rank
      FastPath::Signature rs;
      rs.collective = static_cast<uint32_t>(wire::Collective::kReduceScatter);
      rs.dtype = static_cast<uint32_t>(wire::DataType::kInt32);
      rs.reduce_op = static_cast<uint32_t>(wire::ReduceOp::kSum);
      rs.count = 2;
      int32_t send[6], recv[2] = {0, 0};
      for (int i = 0; i < 6; ++i) send[i] = (rank + 1) * 10 + i;
      std::shared_ptr<FastOp> op;
      check(fp->Start("rs", rs, send, sizeof(send), recv, 0, &op).ok(), "start rs");
      check(WaitOp(*fp, *op).ok(), "rs");
      for (int i = 0; i < 2; ++i) check(recv[i] == 60 + 3 * (rank * 2 + i), "rs value");
      // allgather uint8, 3 per rank
      FastPath::Signature ag;
      ag.collective = static_cast<uint32_t>(wire::Collective::kAllgather);
      ag.dtype = static_cast<uint32_t>(wire::DataType::kUInt8);
      ag.count = 3;
      uint8_t mine[3], all[9] = {};
      for (int i = 0; i < 3; ++i) mine[i] = static_cast<uint8_t>(rank * 3 + i);
      check(fp->Start("ag", ag, mine, 3, all, 0, &op).ok(), "start ag");
      check(WaitOp(*fp, *op).ok(), "ag");
      for (int i = 0; i < 9; ++i) check(all[i] == i, "ag value");
      // broadcast float64 from root 2
      FastPath::Signature bc;
      bc.collective = static_cast<uint32_t>(wire::Collective::kBroadcast);
      bc.dtype = static_cast<uint32_t>(wire::DataType::kFloat64);
      bc.root = 2;
      bc.count = 2;
      double v[2] = {rank + 0.5, rank + 1.5};
      check(fp->Start("bc", bc, rank == 2 ? v : nullptr, rank == 2 ? 16 : 0, v, 0, &op).ok(),
            "start bc");
      check(WaitOp(*fp, *op).ok(), "bc");
      check(v[0] == 2.5 && v[1] == 3.5, "bc value");
      // barrier
      FastPath::Signature br;
      br.collective = static_cast<uint32_t>(wire::Collective::kBarrier);
      check(fp->Start("br", br, nullptr, 0, nullptr, 0, &op).ok(), "start barrier");
      check(WaitOp(*fp, *op).ok(), "barrier");
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(failures.load(), 0);
}

// ---------------------------------------------------------------- routes
// Ranks whose operations of one (name, n) fall on different sides of the
// limit (proto/ciuic/fast_path.h, "Ranks that would take different paths").
// Start never blocks for a small operation, so one thread can play every
// rank's arrival in a chosen order.

enum class Outcome { kRan, kDaemon, kMismatch };

// pattern[i]: 'S' (fits) or 'L' (large) for the i-th arrival; arrival i is
// rank order[i]. Checks what the key's rules promise for that order.
void RunArrivalOrder(const std::string& pattern, const std::vector<int>& order) {
  SCOPED_TRACE("pattern " + pattern);
  const int world = static_cast<int>(pattern.size());
  Segment seg(world, 256, 16);
  std::vector<std::unique_ptr<FastPath>> ranks;
  for (int r = 0; r < world; ++r) ranks.push_back(seg.Rank(r));
  const uint64_t kSmall = 32, kLarge = 33;  // 256 and 264 bytes of int64
  Outcome expect = Outcome::kRan;
  if (pattern[0] == 'L') {
    expect = Outcome::kDaemon;
  } else if (pattern.find('L') != std::string::npos) {
    expect = Outcome::kMismatch;
  }
  std::vector<std::vector<int64_t>> data(world, std::vector<int64_t>(kSmall));
  std::vector<std::shared_ptr<FastOp>> ops(world);
  std::vector<bool> to_daemon(world, false);
  const auto t0 = Clock::now();
  for (int i = 0; i < world; ++i) {
    const int r = order[i];
    const bool fits = pattern[i] == 'S';
    for (uint64_t k = 0; k < kSmall; ++k) data[r][k] = (r + 1) * 100 + static_cast<int64_t>(k);
    bool daemon = false;
    ASSERT_TRUE(ranks[r]
                    ->Start("op", AllreduceInt64(fits ? kSmall : kLarge),
                            fits ? data[r].data() : nullptr, fits ? kSmall * 8 : 0,
                            data[r].data(), 0, &ops[r], fits, &daemon)
                    .ok());
    to_daemon[r] = daemon;
    if (expect == Outcome::kDaemon) {
      EXPECT_TRUE(daemon) << "arrival " << i;
      EXPECT_EQ(ops[r], nullptr);
    } else {
      EXPECT_FALSE(daemon) << "arrival " << i;
      ASSERT_NE(ops[r], nullptr);
      // Once a large rank has come, this and every later arrival is over.
      if (pattern.substr(0, i + 1).find('L') != std::string::npos) {
        EXPECT_TRUE(ranks[r]->Poll(*ops[r])) << "arrival " << i;
      }
    }
  }
  for (int r = 0; r < world; ++r) {
    if (expect == Outcome::kDaemon) continue;
    Status s = WaitOp(*ranks[r], *ops[r]);
    if (expect == Outcome::kRan) {
      EXPECT_TRUE(s.ok()) << s.ToString();
      for (uint64_t k = 0; k < kSmall; ++k) {
        int64_t want = 0;
        for (int q = 0; q < world; ++q) want += (q + 1) * 100 + static_cast<int64_t>(k);
        ASSERT_EQ(data[r][k], want) << "rank " << r << " k " << k;
      }
      continue;
    }
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.ToString();
    const std::string first = "rank " + std::to_string(order[0]) +
                              " submitted allreduce int64 count=32 op=sum, rank ";
    const size_t l = pattern.find('L');
    const std::string large = "rank " + std::to_string(order[l]) +
                              " submitted allreduce int64 count=33 op=sum";
    EXPECT_NE(s.message().find("operation 'op' mismatched across ranks: " + first),
              std::string::npos)
        << s.ToString();
    EXPECT_NE(s.message().find(large), std::string::npos) << s.ToString();
  }
  EXPECT_LT(Clock::now() - t0, std::chrono::seconds(5));
  // Every key is gone once every rank has left it, whatever the route.
  EXPECT_EQ(seg.used_slots(), 0u);
  // The name goes on with n + 1 on every rank: a plain small round works.
  for (int r = 0; r < world; ++r) {
    std::fill(data[r].begin(), data[r].end(), r + 1);
    ASSERT_TRUE(ranks[r]->Start("op", AllreduceInt64(kSmall), data[r].data(), kSmall * 8,
                                data[r].data(), 0, &ops[r]).ok());
  }
  for (int r = 0; r < world; ++r) {
    EXPECT_TRUE(WaitOp(*ranks[r], *ops[r]).ok());
    EXPECT_EQ(data[r][0], world * (world + 1) / 2);
  }
  EXPECT_EQ(seg.used_slots(), 0u);
}

TEST(FastPathRouteTest, EveryArrivalOrderOfTwoAndThreeRanks) {
  for (int world : {2, 3}) {
    std::vector<int> order(world);
    for (int i = 0; i < world; ++i) order[i] = i;
    do {
      for (int bits = 0; bits < (1 << world); ++bits) {
        std::string pattern;
        for (int i = 0; i < world; ++i) pattern += (bits >> i) & 1 ? 'L' : 'S';
        std::string o;
        for (int r : order) o += std::to_string(r);
        SCOPED_TRACE("order " + o);
        RunArrivalOrder(pattern, order);
      }
    } while (std::next_permutation(order.begin(), order.end()));
  }
}

// A waiter asleep on the futex wakes with the mismatch as soon as a rank
// with a large operation arrives, long before its 60 s timeout.
TEST(FastPathRouteTest, LargeArrivalWakesASleepingSmallWaiter) {
  Segment seg(2, 256, 16, /*timeout_ms=*/60000);
  auto r0 = seg.Rank(0);
  auto r1 = seg.Rank(1);
  std::vector<int64_t> d(32, 1);
  std::shared_ptr<FastOp> op;
  ASSERT_TRUE(r0->Start("w", AllreduceInt64(32), d.data(), 256, d.data(), 0, &op).ok());
  const auto t0 = Clock::now();
  std::thread late([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    std::shared_ptr<FastOp> big;
    bool daemon = true;
    ASSERT_TRUE(r1->Start("w", AllreduceInt64(1000), nullptr, 0, nullptr, 0, &big, false,
                          &daemon).ok());
    EXPECT_FALSE(daemon);
    ASSERT_NE(big, nullptr);
    EXPECT_TRUE(big->finished.load());
    EXPECT_EQ(big->status.code(), StatusCode::kInvalidArgument);
  });
  Status s = WaitOp(*r0, *op);  // sleeps on the futex after its spin
  late.join();
  EXPECT_LT(Clock::now() - t0, std::chrono::seconds(2));
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.ToString();
  EXPECT_NE(s.message().find("rank 1 submitted allreduce int64 count=1000"), std::string::npos)
      << s.ToString();
  EXPECT_EQ(seg.used_slots(), 0u);
}

// A dtype that moves the size across the limit, and a different collective.
TEST(FastPathRouteTest, DtypeAndCollectiveDifferences) {
  Segment seg(2, 256, 16);
  auto r0 = seg.Rank(0);
  auto r1 = seg.Rank(1);
  std::vector<int64_t> d(64, 1);
  FastPath::Signature i32 = AllreduceInt64(64);
  i32.dtype = static_cast<uint32_t>(wire::DataType::kInt32);  // 256 bytes: fits
  FastPath::Signature i64 = AllreduceInt64(64);               // 512 bytes: large
  std::shared_ptr<FastOp> a, b;
  bool daemon = false;
  ASSERT_TRUE(r0->Start("d", i32, d.data(), 256, d.data(), 0, &a, true, &daemon).ok());
  ASSERT_TRUE(r1->Start("d", i64, nullptr, 0, nullptr, 0, &b, false, &daemon).ok());
  EXPECT_FALSE(daemon);
  for (auto* op : {a.get(), b.get()}) {
    EXPECT_TRUE(op->finished.load() || r0->Poll(*op));
    EXPECT_NE(op->status.message().find(
                  "operation 'd' mismatched across ranks: rank 0 submitted allreduce int32 "
                  "count=64 op=sum, rank 1 submitted allreduce int64 count=64 op=sum"),
              std::string::npos)
        << op->status.ToString();
  }
  // Allgather of 64 int32 per rank (512 bytes received: large) against an
  // allreduce of 64 int32 that fits; the large one first this time.
  FastPath::Signature ag = i32;
  ag.collective = static_cast<uint32_t>(wire::Collective::kAllgather);
  ag.reduce_op = 0;
  ASSERT_TRUE(r0->Start("c", ag, nullptr, 0, nullptr, 0, &a, false, &daemon).ok());
  EXPECT_TRUE(daemon);
  ASSERT_TRUE(r1->Start("c", i32, d.data(), 256, d.data(), 0, &b, true, &daemon).ok());
  EXPECT_TRUE(daemon);  // the daemon's matching reports it to both
  EXPECT_EQ(seg.used_slots(), 0u);
}

// The same signature routed to the daemon by its caller for another reason
// than its size (the client never does that today) still fails both ranks.
TEST(FastPathRouteTest, SameSignatureOnTwoPathsFailsBoth) {
  Segment seg(2, 256, 16);
  auto r0 = seg.Rank(0);
  auto r1 = seg.Rank(1);
  std::vector<int64_t> d(4, 1);
  std::shared_ptr<FastOp> a, b;
  bool daemon = false;
  ASSERT_TRUE(r0->Start("p", AllreduceInt64(4), d.data(), 32, d.data(), 0, &a, true, &daemon).ok());
  ASSERT_TRUE(r1->Start("p", AllreduceInt64(4), nullptr, 0, nullptr, 0, &b, false, &daemon).ok());
  EXPECT_FALSE(daemon);
  for (auto* op : {a.get(), b.get()}) {
    EXPECT_TRUE(op->finished.load() || r0->Poll(*op));
    EXPECT_EQ(op->status.code(), StatusCode::kInvalidArgument);
    EXPECT_NE(op->status.message().find("rank 1 submitted allreduce int64 count=4 op=sum, which "
                                        "does not take the fast path"),
              std::string::npos)
        << op->status.ToString();
  }
  EXPECT_EQ(seg.used_slots(), 0u);
}

// Device buffers always go to the daemon and are part of the signature, as
// the daemon words it; host-first fails both, device-first sends both there.
TEST(FastPathRouteTest, DeviceAndHostBuffersOfOneOperation) {
  Segment seg(2, 256, 16);
  auto r0 = seg.Rank(0);
  auto r1 = seg.Rank(1);
  std::vector<int64_t> d(4, 1);
  FastPath::Signature dev = AllreduceInt64(4);
  dev.device = 1;
  std::shared_ptr<FastOp> a, b;
  bool daemon = false;
  ASSERT_TRUE(r0->Start("h", AllreduceInt64(4), d.data(), 32, d.data(), 0, &a, true, &daemon).ok());
  ASSERT_TRUE(r1->Start("h", dev, nullptr, 0, nullptr, 0, &b, false, &daemon).ok());
  EXPECT_FALSE(daemon);
  for (auto* op : {a.get(), b.get()}) {
    EXPECT_TRUE(op->finished.load() || r0->Poll(*op));
    EXPECT_NE(op->status.message().find(
                  "operation 'h' mismatched across ranks: rank 0 submitted allreduce int64 "
                  "count=4 op=sum, rank 1 submitted allreduce int64 count=4 op=sum in CUDA "
                  "device memory"),
              std::string::npos)
        << op->status.ToString();
  }
  ASSERT_TRUE(r1->Start("h", dev, nullptr, 0, nullptr, 0, &b, false, &daemon).ok());
  EXPECT_TRUE(daemon);
  ASSERT_TRUE(r0->Start("h", AllreduceInt64(4), d.data(), 32, d.data(), 0, &a, true, &daemon).ok());
  EXPECT_TRUE(daemon);
  EXPECT_EQ(seg.used_slots(), 0u);
}

// Without a way to the daemon, a route there is an error, not a crash.
TEST(FastPathRouteTest, DaemonRouteNeedsACaller) {
  Segment seg(2, 256, 16);
  auto r0 = seg.Rank(0);
  std::shared_ptr<FastOp> op;
  ASSERT_TRUE(r0->Start("x", AllreduceInt64(100), nullptr, 0, nullptr, 0, &op, false).ok());
  ASSERT_NE(op, nullptr);
  EXPECT_EQ(op->status.code(), StatusCode::kInternal);
}

// Daemon-bound operations count in the in-flight limit until the daemon
// completes them, so their keys cannot fill the table; normal traffic of
// small and large operations of many names in random orders stays correct
// and leaves the table empty.
TEST(FastPathRouteTest, DaemonBoundOpsCountInTheInflightLimit) {
  Segment seg(2, 256, 4);
  auto r0 = seg.Rank(0);
  std::atomic<int> waits{0};
  r0->SetDaemonWait([&](const std::atomic<bool>& done, Clock::time_point until) {
    ++waits;
    while (!done.load() && Clock::now() < until) std::this_thread::yield();
  });
  std::vector<std::shared_ptr<std::atomic<bool>>> flags;
  for (int i = 0; i < 4; ++i) {
    std::shared_ptr<FastOp> op;
    bool daemon = false;
    ASSERT_TRUE(r0->Start("n" + std::to_string(i), AllreduceInt64(100), nullptr, 0, nullptr, 0,
                          &op, false, &daemon).ok());
    ASSERT_TRUE(daemon);
    flags.push_back(std::make_shared<std::atomic<bool>>(false));
    r0->TrackDaemon(flags.back());
  }
  EXPECT_EQ(waits.load(), 0);
  std::thread completer([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    flags[0]->store(true);
  });
  const auto t0 = Clock::now();
  std::shared_ptr<FastOp> op;
  bool daemon = false;
  ASSERT_TRUE(r0->Start("n4", AllreduceInt64(100), nullptr, 0, nullptr, 0, &op, false, &daemon)
                  .ok());
  completer.join();
  EXPECT_GE(Clock::now() - t0, std::chrono::milliseconds(150));
  EXPECT_GE(waits.load(), 1);
  EXPECT_TRUE(daemon);
}

// A window full of daemon-bound operations that do not complete and one
// fast-path operation that does: the next submission goes on once the fast
// one is over, without waiting for the daemon.
TEST(FastPathRouteTest, FastOpCompletingFreesRoomBesideStuckDaemonOps) {
  Segment seg(2, 256, 4);
  auto r0 = seg.Rank(0);
  auto r1 = seg.Rank(1);
  r0->SetDaemonWait([](const std::atomic<bool>& done, Clock::time_point until) {
    while (!done.load() && Clock::now() < until) std::this_thread::yield();
  });
  auto never = std::make_shared<std::atomic<bool>>(false);
  for (int i = 0; i < 3; ++i) {
    std::shared_ptr<FastOp> op;
    bool daemon = false;
    ASSERT_TRUE(r0->Start("big" + std::to_string(i), AllreduceInt64(100), nullptr, 0, nullptr, 0,
                          &op, false, &daemon).ok());
    ASSERT_TRUE(daemon);
    r0->TrackDaemon(never);
  }
  std::vector<int64_t> a(1, 1), b(1, 2), c(1, 3);
  std::shared_ptr<FastOp> f, g, next;
  ASSERT_TRUE(r0->Start("f", AllreduceInt64(1), a.data(), 8, a.data(), 0, &f).ok());
  std::thread other([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    ASSERT_TRUE(r1->Start("f", AllreduceInt64(1), b.data(), 8, b.data(), 0, &g).ok());
    EXPECT_TRUE(WaitOp(*r1, *g).ok());
  });
  const auto t0 = Clock::now();
  ASSERT_TRUE(r0->Start("g", AllreduceInt64(1), c.data(), 8, c.data(), 0, &next).ok());
  other.join();
  EXPECT_LT(Clock::now() - t0, std::chrono::seconds(2));
  EXPECT_TRUE(f->finished.load());
  EXPECT_EQ(a[0], 3);
  EXPECT_FALSE(next->finished.load());  // waits for rank 1's "g"
}

TEST(FastPathRouteTest, RandomMixOfSmallAndLargeManyNames) {
  constexpr int kWorld = 3, kNames = 12, kRounds = 40;
  Segment seg(kWorld, 256, 16);  // room for every name at once
  std::vector<std::thread> threads;
  std::atomic<int> failures{0};
  for (int rank = 0; rank < kWorld; ++rank) {
    threads.emplace_back([&, rank] {
      auto fp = seg.Rank(rank);
      // The "daemon": large operations complete when every rank has sent
      // theirs, which this test does not model; count them as done at once.
      std::mt19937 rng(1234 + rank);
      for (int round = 0; round < kRounds; ++round) {
        std::vector<int> order(kNames);
        for (int i = 0; i < kNames; ++i) order[i] = i;
        std::shuffle(order.begin(), order.end(), rng);
        std::vector<std::shared_ptr<FastOp>> ops(kNames);
        std::vector<std::vector<int64_t>> data(kNames);
        for (int name : order) {
          // Same size class for every rank: name and round decide it.
          const bool fits = (name * 7 + round) % 3 != 0;
          const uint64_t count = fits ? 1 + (name + round) % 32 : 33 + name;
          data[name].assign(count, (rank + 1) * (name + 1) + round);
          bool daemon = false;
          Status s = fp->Start("k" + std::to_string(name), AllreduceInt64(count),
                               fits ? data[name].data() : nullptr, fits ? count * 8 : 0,
                               data[name].data(), 0, &ops[name], fits, &daemon);
          if (!s.ok() || daemon == fits) {
            ADD_FAILURE() << "rank " << rank << " name " << name << ": " << s.ToString();
            ++failures;
          }
        }
        for (int name = 0; name < kNames; ++name) {
          if (ops[name] == nullptr) continue;
          Status s = WaitOp(*fp, *ops[name]);
          const int64_t want = (1 + 2 + 3) * (name + 1) + kWorld * round;
          if (!s.ok() || data[name][0] != want || data[name].back() != want) {
            ADD_FAILURE() << "rank " << rank << " name " << name << " round " << round << ": "
                          << s.ToString();
            ++failures;
          }
        }
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(failures.load(), 0);
  EXPECT_EQ(seg.used_slots(), 0u);
}

}  // namespace
}  // namespace ciuic

namespace ciuic {
namespace {

// A rank stopped (SIGSTOP, a debugger) while it holds the table lock: the
// others give up after the limit with an error naming it, instead of
// spinning for ever.
TEST(FastPathTest, ARankThatKeepsTheTableLockIsGivenUpOnNamingIt) {
  Segment seg(3, 4096, 16);
  auto fp = seg.Rank(0);
  fp->set_table_lock_limit(std::chrono::milliseconds(300));
  auto* h = reinterpret_cast<wire::FastPathHeader*>(seg.base());
  h->table_lock.store(3);  // rank 2 holds it, and never lets go
  int64_t v = 1;
  std::shared_ptr<FastOp> op;
  const auto start = Clock::now();
  Status s = fp->Start("x", AllreduceInt64(1), &v, sizeof(v), &v, 0, &op);
  const auto waited = Clock::now() - start;
  ASSERT_TRUE(s.ok()) << s.ToString();
  ASSERT_NE(op, nullptr);
  ASSERT_TRUE(op->finished.load());
  EXPECT_EQ(op->status.code(), StatusCode::kUnavailable) << op->status.ToString();
  EXPECT_NE(op->status.message().find("rank 2"), std::string::npos) << op->status.ToString();
  EXPECT_GE(waited, std::chrono::milliseconds(300));
  EXPECT_LT(waited, std::chrono::seconds(5));
  // Let go: the next operation takes the lock as usual.
  h->table_lock.store(0);
  std::shared_ptr<FastOp> next;
  ASSERT_TRUE(fp->Start("y", AllreduceInt64(1), &v, sizeof(v), &v, 0, &next).ok());
  ASSERT_NE(next, nullptr);
  EXPECT_FALSE(next->finished.load() && !next->status.ok()) << next->status.ToString();
  EXPECT_EQ(h->table_lock.load(), 0u) << "released after the probe";
}

}  // namespace
}  // namespace ciuic
