// Jobs across several daemons ("nodes") on this host: every daemon forced
// onto UCX over TCP, so the inter-node path is the network path. Hierarchy:
// local reduction from shared memory, the inter-node algorithm between the
// daemons, fan-out to the local ranks.
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <fstream>
#include <map>
#include <numeric>
#include <set>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "ciuic/collective_rules.h"
#include "ciuic/control.pb.h"
#include "common.h"
#include "control/testing/test_certs.h"
#include "harness.h"
#include "raw_session.h"
#include "reference.h"

namespace ciuic::testing {
namespace {

using Clock = std::chrono::steady_clock;

// Shared-memory buffers, FillSmall's data (exact in every dtype), broadcast
// from the last rank.
int RunOne(Communicator& comm, Coll coll, DataType t, ReduceOp op, size_t count,
           const std::string& name) {
  CheckOptions o;
  o.name = name;
  o.zero_copy = true;
  o.root = comm.world_size() - 1;
  o.small_values = true;
  return RunAndCheck(comm, coll, t, op, count, o);
}


struct Shape {
  int nodes;
  int ranks_per_node;
};

// The shapes every multi-node suite runs: 2 and 3 nodes, 1 and 2 ranks each.
const auto kShapes =
    ::testing::Values(Shape{2, 1}, Shape{2, 2}, Shape{3, 1}, Shape{3, 2});

std::string ShapeName(const ::testing::TestParamInfo<Shape>& info) {
  return std::to_string(info.param.nodes) + "nodes_x" +
         std::to_string(info.param.ranks_per_node) + "ranks";
}

class MultiNodeTest : public ::testing::TestWithParam<Shape> {};

TEST_P(MultiNodeTest, EveryCollectiveDtypeOpAndSizeOverUcxTcp) {
  const Shape shape = GetParam();
  auto cluster = Cluster::Start(shape.nodes, "tuning:\n  chunk_bytes: 64K\n");
  ASSERT_NE(cluster, nullptr);
  const std::string job = UniqueJobId("multi");
  const int world = shape.nodes * shape.ranks_per_node;
  auto codes = RunRanks(world, [&](int rank) {
    auto comm = cluster->Join(job, rank, shape.nodes, shape.ranks_per_node);
    CHILD_CHECK(comm != nullptr, "join");
    const size_t kCounts[] = {0, 1, 1001, 100003};
    int combo = 0;
    for (Coll coll : {Coll::kAllreduce, Coll::kReduceScatter, Coll::kAllgather, Coll::kBroadcast,
                     Coll::kAlltoall}) {
      const bool reduces = coll == Coll::kAllreduce || coll == Coll::kReduceScatter;
      for (DataType t : kAllDataTypes) {
        for (ReduceOp op : kAllReduceOps) {
          if (!reduces && op != ReduceOp::kSum) continue;
          for (size_t count : kCounts) {
            // The largest size for a subset only, to bound the run time.
            if (count == 100003 && (combo++ % 4) != 0) continue;
            std::string name = std::to_string(static_cast<int>(coll)) + "/" + DataTypeName(t) +
                               "/" + ReduceOpName(op) + "/" + std::to_string(count);
            if (RunOne(*comm, coll, t, op, count, name) != 0) return 1;
          }
        }
      }
    }
    Status s = comm->Barrier().Wait();
    CHILD_CHECK(s.ok(), "barrier: %s", s.ToString().c_str());
    return 0;
  }, std::chrono::seconds(300));
  for (int r = 0; r < world; ++r) EXPECT_EQ(codes[r], 0) << "rank " << r;
  // Every rank finished and left: the job ends quietly. The coordinator's
  // daemon says so at info level, and no daemon warns (not "job failed",
  // not "lost peer").
  const std::string ended = "job '" + job + "' ended";
  for (int i = 0; i < 200 && cluster->nodes[0]->Log().find(ended) == std::string::npos; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(25));
  }
  EXPECT_NE(cluster->nodes[0]->Log().find(ended), std::string::npos) << cluster->nodes[0]->Log();
  std::this_thread::sleep_for(std::chrono::milliseconds(200));  // the other nodes' ends
  for (auto& node : cluster->nodes) {
    const std::string log = node->Log();
    EXPECT_EQ(log.find("[warning]"), std::string::npos) << log;
  }
  EXPECT_TRUE(cluster->StopAll());
}

TEST_P(MultiNodeTest, AlltoallvUnevenBlocksAndMismatchesOverUcxTcp) {
  const Shape shape = GetParam();
  auto cluster = Cluster::Start(shape.nodes, "tuning:\n  chunk_bytes: 64K\n");
  ASSERT_NE(cluster, nullptr);
  const std::string job = UniqueJobId("a2av");
  const int world = shape.nodes * shape.ranks_per_node;
  auto codes = RunRanks(world, [&](int rank) {
    auto comm = cluster->Join(job, rank, shape.nodes, shape.ranks_per_node);
    CHILD_CHECK(comm != nullptr, "join");
    int combo = 0;
    for (DataType t : kAllDataTypes) {
      for (int pattern = 0; pattern < kUnevenPatterns; ++pattern) {
        const size_t scale = pattern == 3 && t == DataType::kFloat32 ? 70001 : 501;
        const std::string name =
            std::string("a2av/") + DataTypeName(t) + "/" + std::to_string(pattern);
        auto counts = [&](int i, int j) { return UnevenCounts(i, j, pattern, scale); };
        if (RunAlltoallvAndCheck(*comm, t, counts, name, ++combo % 2 == 0, pattern) != 0) return 1;
      }
    }
    auto counts = [](int i, int j) { return static_cast<size_t>(3 + i + j); };
    // Between nodes: the coordinator compares the nodes' counts.
    if (ExpectAlltoallvMismatch(*comm, counts, 0, world - 1, "a2av/between",
                                "alltoallv counts disagree") != 0) {
      return 1;
    }
    // Within node 0 of a multi-node job: its daemon finds it, every node hears.
    if (shape.ranks_per_node > 1 &&
        ExpectAlltoallvMismatch(*comm, counts, 0, 1, "a2av/within",
                                "rank 0 sends 4 element(s) to rank 1, which expects 5") != 0) {
      return 1;
    }
    // The job goes on.
    if (RunAlltoallvAndCheck(*comm, DataType::kInt64, counts, "a2av/after", true) != 0) return 1;
    if (RunOne(*comm, Coll::kAlltoall, DataType::kFloat16, ReduceOp::kSum, 3001, "a2a/after") != 0) {
      return 1;
    }
    Status s = comm->Barrier().Wait();
    CHILD_CHECK(s.ok(), "barrier: %s", s.ToString().c_str());
    return 0;
  }, std::chrono::seconds(300));
  for (int r = 0; r < world; ++r) EXPECT_EQ(codes[r], 0) << "rank " << r;
  EXPECT_TRUE(cluster->StopAll());
}

INSTANTIATE_TEST_SUITE_P(Shapes, MultiNodeTest,
                         kShapes, ShapeName);

TEST(MultiNodeSemanticsTest, OutOfOrderNamesLargeBuffersAndMismatch) {
  auto cluster = Cluster::Start(2);
  ASSERT_NE(cluster, nullptr);
  const std::string job = UniqueJobId("order");
  auto codes = RunRanks(4, [&](int rank) {
    auto comm = cluster->Join(job, rank, 2, 2, 160 << 20);
    CHILD_CHECK(comm != nullptr, "join");
    constexpr int kOps = 12;
    std::vector<int> order(kOps);
    std::iota(order.begin(), order.end(), 0);
    std::rotate(order.begin(), order.begin() + rank * 3, order.end());
    if (rank % 2) std::reverse(order.begin(), order.end());
    std::vector<std::vector<int32_t>> bufs(kOps);
    std::vector<Handle> hs(kOps);
    for (int op : order) {
      bufs[op].assign(500 + op * 101, rank + op);
      OpOptions o;
      o.name = "layer" + std::to_string(op);
      hs[op] = comm->Allreduce(bufs[op].data(), bufs[op].data(), bufs[op].size(), DataType::kInt32, ReduceOp::kSum, o);
    }
    for (int op = 0; op < kOps; ++op) {
      Status s = hs[op].Wait();
      CHILD_CHECK(s.ok(), "%s", s.ToString().c_str());
      CHILD_CHECK(bufs[op].back() == 0 + 1 + 2 + 3 + 4 * op, "layer%d got %d", op, bufs[op].back());
    }
    // >= 64 MiB through the ring, default chunking, zero copy.
    if (RunOne(*comm, Coll::kAllreduce, DataType::kFloat32, ReduceOp::kSum, (64u << 20) / 4 + 5, "big") != 0) return 1;
    // A count mismatch between nodes: every rank hears of it.
    std::vector<float> v(64, 1.0f);
    OpOptions o;
    o.name = "grad.mismatch";
    Status s = comm->Allreduce(v.data(), v.data(), rank < 2 ? 32 : 48, DataType::kFloat32, ReduceOp::kSum, o).Wait();
    CHILD_CHECK(s.code() == StatusCode::kInvalidArgument && Contains(s.message(), "grad.mismatch") &&
                    Contains(s.message(), "count=32") && Contains(s.message(), "count=48"),
                "%s", s.ToString().c_str());
    s = comm->Barrier().Wait();  // the job goes on
    CHILD_CHECK(s.ok(), "%s", s.ToString().c_str());
    return 0;
  }, std::chrono::seconds(240));
  EXPECT_EQ(codes, (std::vector<int>{0, 0, 0, 0}));
  EXPECT_TRUE(cluster->StopAll());
}

// The ranks of one node disagree (rank 1's count differs from every other
// rank's), for a named operation (ordered by the coordinator) and an
// unnamed one (direct): every rank of both nodes gets INVALID_ARGUMENT within
// seconds, far before the 30 s timeout, the other node's naming the
// disagreement; the job goes on.
TEST(MultiNodeSemanticsTest, AMismatchAmongOneNodesRanksFailsEveryNodeAtOnce) {
  auto cluster = Cluster::Start(2);
  ASSERT_NE(cluster, nullptr);
  const std::string job = UniqueJobId("localmismatch");
  auto codes = RunRanks(4, [&](int rank) {
    auto comm = cluster->Join(job, rank, 2, 2);
    CHILD_CHECK(comm != nullptr, "join");
    CHILD_CHECK(comm->Barrier().Wait().ok(), "barrier");
    std::vector<float> v(64, 1.0f);
    const size_t count = rank == 1 ? 24 : 16;
    for (bool named : {true, false}) {
      OpOptions o;
      o.timeout_ms = 30000;
      if (named) o.name = "grad.local";
      const auto t0 = std::chrono::steady_clock::now();
      Status s = comm->Allreduce(v.data(), v.data(), count, DataType::kFloat32, ReduceOp::kSum, o)
                     .Wait();
      const auto took = std::chrono::steady_clock::now() - t0;
      CHILD_CHECK(s.code() == StatusCode::kInvalidArgument && Contains(s.message(), "mismatched") &&
                      Contains(s.message(), "count=16") &&
                      (rank < 2 || Contains(s.message(), "count=24")),
                  "%s: %s", named ? "named" : "unnamed", s.ToString().c_str());
      CHILD_CHECK(took < std::chrono::seconds(10), "%s: took %lld ms", named ? "named" : "unnamed",
                  (long long)std::chrono::duration_cast<std::chrono::milliseconds>(took).count());
    }
    std::vector<float> w(8, 1.0f);
    Status s = comm->Allreduce(w.data(), w.data(), w.size(), DataType::kFloat32, ReduceOp::kSum).Wait();
    CHILD_CHECK(s.ok() && w[0] == 4.0f, "after: %s", s.ToString().c_str());  // the job goes on
    return 0;
  }, std::chrono::seconds(120));
  EXPECT_EQ(codes, (std::vector<int>{0, 0, 0, 0}));
  EXPECT_TRUE(cluster->StopAll());
}

// One name submitted again and again before its earlier occurrences have
// run (node 1 comes late, so node 0 holds all of them): every occurrence
// runs, in submission order, with its own buffers. The first goes through
// the coordinator; the later ones, small enough, run direct on both nodes
// (their traces say so).
TEST(MultiNodeSemanticsTest, ANameResubmittedBeforeItRanRunsEveryOccurrenceInOrder) {
  auto cluster = Cluster::Start(2);
  ASSERT_NE(cluster, nullptr);
  const std::string job = UniqueJobId("again");
  auto codes = RunRanks(2, [&](int rank) {
    auto comm = cluster->Join(job, rank, 2, 1);
    CHILD_CHECK(comm != nullptr, "join");
    CHILD_CHECK(comm->Barrier().Wait().ok(), "barrier");
    if (rank == 1) std::this_thread::sleep_for(std::chrono::milliseconds(300));
    constexpr int kTimes = 6;
    std::vector<std::vector<int64_t>> bufs(kTimes);
    std::vector<Handle> hs(kTimes);
    for (int i = 0; i < kTimes; ++i) {
      bufs[i].assign(1000 + i, 100 * i + rank);
      OpOptions o;
      o.name = "again";
      o.timeout_ms = 20000;
      hs[i] = comm->Allreduce(bufs[i].data(), bufs[i].data(), bufs[i].size(), DataType::kInt64,
                              ReduceOp::kSum, o);
    }
    for (int i = 0; i < kTimes; ++i) {
      Status s = hs[i].WaitFor(std::chrono::seconds(30));
      CHILD_CHECK(s.ok(), "occurrence %d: %s", i, s.ToString().c_str());
      CHILD_CHECK(bufs[i].back() == 200 * i + 1, "occurrence %d got %lld", i,
                  static_cast<long long>(bufs[i].back()));
    }
    return 0;
  }, std::chrono::seconds(90));
  EXPECT_EQ(codes, (std::vector<int>{0, 0}));
  for (int node = 0; node < 2; ++node) {
    proto::TraceReply trace;
    ASSERT_EQ(ReadTrace(cluster->nodes[node]->socket(), job, &trace), "") << node;
    int direct = 0, ordered = 0;
    for (const proto::OpTrace& op : trace.ops()) {
      if (op.name() != "again") continue;
      EXPECT_EQ(op.code(), 0) << op.DebugString();
      (op.algorithm() == "direct" ? direct : ordered) += 1;
    }
    EXPECT_EQ(ordered, 1) << "node " << node << ": " << trace.DebugString();
    EXPECT_EQ(direct, 5) << "node " << node << ": " << trace.DebugString();
  }
  EXPECT_TRUE(cluster->StopAll());
}

// Two ranks on two nodes of `cluster` run float allreduces of `elements`
// (timeout 1500 ms, Wait's grace 1 s) until one fails, then exit 0 (1 if
// none ever fails); rank 0 writes a byte to `signal_fd` after step
// `signal_at`. Their pids.
std::vector<pid_t> SpawnAllreducesUntilTheJobFails(Cluster& cluster, const std::string& job,
                                                   size_t elements, int signal_at, int signal_fd) {
  return SpawnRanks(2, [&cluster, job, elements, signal_at, signal_fd](int rank) {
    setenv("CIUIC_WAIT_GRACE_MS", "1000", 1);
    auto comm = cluster.Join(job, rank, 2, 1);
    CHILD_CHECK(comm != nullptr, "join");
    std::vector<float> v(elements, 1.0f);
    for (int i = 0; i < 100000; ++i) {
      OpOptions o;
      o.name = "step";
      o.timeout_ms = 1500;
      Status s = comm->Allreduce(v.data(), v.data(), v.size(), DataType::kFloat32,
                                 ReduceOp::kSum, o).Wait();
      if (i == signal_at && rank == 0) CHILD_CHECK(write(signal_fd, "r", 1) == 1, "pipe");
      if (!s.ok()) {
        fprintf(stderr, "rank %d, step %d: %s\n", rank, i, s.ToString().c_str());
        return 0;  // the job failed, as it must; this rank leaves
      }
      v.assign(v.size(), 1.0f);
    }
    return 1;
  });
}

// Four nodes run unnamed allreduces of 64K and more directly by halving (a
// reduce-scatter, then an allgather) over UCX: sum, avg and max against the
// plain loop, in place and not, up to 1 MiB; then one rank submits another
// count, and every rank gets INVALID_ARGUMENT at once, although the nodes'
// sizes chose different algorithms.
TEST(MultiNodeSemanticsTest, FourNodesHalveLargeDirectOperations) {
  auto cluster = Cluster::Start(4);
  ASSERT_NE(cluster, nullptr);
  const std::string job = UniqueJobId("halving");
  auto codes = RunRanks(4, [&](int rank) {
    auto comm = cluster->Join(job, rank, 4, 1);
    CHILD_CHECK(comm != nullptr, "join");
    auto value = [](int r, size_t i) { return static_cast<float>((r + 1) * (static_cast<int>(i % 13) - 6)); };
    int step = 0;
    for (size_t count : {size_t{16385}, size_t{100003}, size_t{262144}}) {
      for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kAvg, ReduceOp::kMax}) {
        const bool in_place = (step++ % 2) == 1;
        std::vector<float> send(count), recv(count, -1.0f);
        for (size_t i = 0; i < count; ++i) send[i] = value(rank, i);
        float* out = in_place ? send.data() : recv.data();
        OpOptions o;
        o.timeout_ms = 20000;
        Status s = comm->Allreduce(send.data(), out, count, DataType::kFloat32, op, o).Wait();
        CHILD_CHECK(s.ok(), "count %zu: %s", count, s.ToString().c_str());
        for (size_t i = 0; i < count; ++i) {
          float want = value(0, i);
          for (int r = 1; r < 4; ++r) {
            want = op == ReduceOp::kMax ? std::max(want, value(r, i)) : want + value(r, i);
          }
          if (op == ReduceOp::kAvg) want /= 4.0f;
          CHILD_CHECK(out[i] == want, "count %zu element %zu: %g, want %g", count, i, out[i], want);
        }
      }
    }
    // Rank 3 submits 100 elements (doubling), the others 100003 (halving).
    const size_t count = rank == 3 ? 100 : 100003;
    std::vector<float> v(count, 1.0f);
    OpOptions o;
    o.timeout_ms = 20000;
    const auto start = std::chrono::steady_clock::now();
    Status s = comm->Allreduce(v.data(), v.data(), count, DataType::kFloat32, ReduceOp::kSum, o).Wait();
    CHILD_CHECK(s.code() == StatusCode::kInvalidArgument && Contains(s.message(), "mismatched"),
                "%s", s.ToString().c_str());
    CHILD_CHECK(std::chrono::steady_clock::now() - start < std::chrono::seconds(10),
                "the mismatch took until the deadline");
    return 0;
  }, std::chrono::seconds(120));
  EXPECT_EQ(codes, (std::vector<int>(4, 0)));
  EXPECT_TRUE(cluster->StopAll());
}

// A multi-node operation's ranks are told of its end either by the thread
// that ended it (a UCX thread for a direct exchange, a lane for a run) or,
// when a trainer sleeps on its ring, by the engine's loop: each rank hears
// exactly once either way. Raw sessions on 2 nodes x 2 ranks count the
// completion entries themselves (the SDK would drop a duplicate silently):
// direct (8 B, 64K) and coordinator runs (512K), with the trainer_waiters
// hint set on some operations so that both tellers take turns, and the
// results checked against the sum.
TEST(MultiNodeSemanticsTest, EveryRankHearsOfEachOperationExactlyOnce) {
  auto cluster = Cluster::Start(2);
  ASSERT_NE(cluster, nullptr);
  const std::string job = UniqueJobId("told-once");
  constexpr int kWorld = 4;
  constexpr int kOps = 45;
  auto codes = RunRanks(kWorld, [&](int rank) {
    RawSession raw;
    const std::string socket = cluster->nodes[rank / 2]->socket();
    CHILD_CHECK(raw.Open(socket, 4 << 20), "open");
    std::string msg;
    CHILD_CHECK(raw.Join(socket, job, rank, kWorld, &msg, 2, cluster->peers[0]) == 0, "join: %s",
                msg.c_str());
    const uint64_t recv_offset = wire::kDataOffset + (1 << 20);
    auto* send = reinterpret_cast<float*>(raw.base + wire::kDataOffset);
    auto* recv = reinterpret_cast<float*>(raw.base + recv_offset);
    for (int i = 0; i < kOps; ++i) {
      const uint64_t count = i % 3 == 0 ? 2 : i % 3 == 1 ? (64 << 10) / 4 : (512 << 10) / 4;
      for (uint64_t j = 0; j < count; ++j) {
        send[j] = static_cast<float>((rank + 1) * ((j + i) % 7 + 1));
        recv[j] = -1.0f;
      }
      // Some operations with the hint that this trainer sleeps: the loop
      // tells those; the others, the thread that ends them.
      raw.header()->trainer_waiters.store(i % 4 == 1 ? 1 : 0);
      wire::SubmissionEntry e =
          Entry(500 + i, wire::Collective::kAllreduce, wire::DataType::kFloat32,
                wire::ReduceOp::kSum, count, wire::kDataOffset, recv_offset,
                wire::UnnamedName(static_cast<uint64_t>(i)));
      e.timeout_ms = 20000;
      raw.Submit(e);
      wire::CompletionEntry done;
      CHILD_CHECK(raw.NextCompletion(&done, 20000), "op %d: no completion", i);
      const std::string text = MessageOf(done);
      CHILD_CHECK(done.op_id == e.op_id, "op %d: a completion for op %llu (a duplicate?)", i,
                  static_cast<unsigned long long>(done.op_id));
      CHILD_CHECK(done.status_code == 0, "op %d: code %d: %s", i, done.status_code, text.c_str());
      for (uint64_t j = 0; j < count; ++j) {
        const float want = static_cast<float>(10 * ((j + i) % 7 + 1));  // ranks 1+2+3+4
        CHILD_CHECK(recv[j] == want, "op %d element %llu: %g, want %g", i,
                    static_cast<unsigned long long>(j), recv[j], want);
      }
    }
    raw.header()->trainer_waiters.store(0);
    wire::CompletionEntry extra;
    CHILD_CHECK(!raw.NextCompletion(&extra, 500), "a completion after the last: op %llu",
                static_cast<unsigned long long>(extra.op_id));
    return 0;
  }, std::chrono::seconds(120));
  EXPECT_EQ(codes, (std::vector<int>(kWorld, 0)));
  EXPECT_TRUE(cluster->StopAll());
}

// A hung node (its daemon stopped with SIGSTOP mid-run, as a swapping or
// debugged machine is) fails the job on the healthy node, which then tears
// the job down with requests to the stopped peer still in UCX's hands: the
// healthy daemon must live through that (UCX asserted when a worker was
// destroyed with unreleased requests, aborting ciuicd in about a third of
// such runs) and serve the next job. Three rounds.
TEST(MultiNodeFaultsTest, AStoppedPeerNeverTakesTheHealthyDaemonDown) {
  for (int round = 0; round < 3; ++round) {
    SCOPED_TRACE("round " + std::to_string(round));
    auto cluster = Cluster::Start(2);
    ASSERT_NE(cluster, nullptr);
    const std::string job = UniqueJobId("hung-peer");
    int running[2];
    ASSERT_EQ(pipe(running), 0);
    std::vector<pid_t> pids =
        SpawnAllreducesUntilTheJobFails(*cluster, job, 1 << 18, 5 + round, running[1]);
    char c;
    ASSERT_EQ(read(running[0], &c, 1), 1);
    ASSERT_EQ(kill(cluster->nodes[1]->pid(), SIGSTOP), 0);
    EXPECT_EQ(WaitChild(pids[0], std::chrono::seconds(30)), 0) << "rank 0 never heard";
    // Node 0 ends the job: its transport shuts down towards a stopped peer.
    std::this_thread::sleep_for(std::chrono::seconds(3));
    EXPECT_TRUE(cluster->nodes[0]->Alive()) << cluster->nodes[0]->Log();
    if (cluster->nodes[0]->Alive()) ExpectServes(cluster->nodes[0]->socket());
    EXPECT_EQ(WaitChild(pids[1], std::chrono::seconds(30)), 0);
    kill(cluster->nodes[1]->pid(), SIGCONT);
    EXPECT_EQ(cluster->nodes[0]->Stop(), 0);
  }
}

// A rank that leaves as soon as its last operation is done ends the job on
// its node, which closes its endpoints channel by channel; the peer node may
// still be receiving that operation's last chunk on one channel when another
// (idle) channel's close arrives. That close must not fail the run there
// (found by tests/chaos: an idle channel's endpoint error failed the whole
// peer and cancelled the busy channel's receive). Many short jobs, so that
// the race shows.
TEST(MultiNodeFaultsTest, RanksLeavingRightAfterTheLastOperationNeverFailTheirPeer) {
  auto cluster = Cluster::Start(2);
  ASSERT_NE(cluster, nullptr);
  int failed = 0;
  for (int j = 0; j < 60; ++j) {
    const std::string job = UniqueJobId("leave-at-once");
    auto codes = RunRanks(2, [&](int rank) {
      auto comm = cluster->Join(job, rank, 2, 1);
      CHILD_CHECK(comm != nullptr, "join");
      std::vector<int32_t> v(1000 + 997 * j, rank + 1);
      Status s = comm->Allreduce(v.data(), v.data(), v.size(), DataType::kInt32, ReduceOp::kSum)
                     .Wait();
      CHILD_CHECK(s.ok() && v.back() == 3, "job %d: %s", j, s.ToString().c_str());
      return 0;  // and leave at once
    }, std::chrono::seconds(60));
    failed += codes != std::vector<int>({0, 0});
  }
  EXPECT_EQ(failed, 0) << "of 60 jobs";
  EXPECT_TRUE(cluster->StopAll());
}

// SIGTERM drains within a bounded time whatever its jobs are doing: here a
// run in flight towards a peer that is stopped (which would otherwise wait
// for its deadline, a minute by default).
TEST(MultiNodeFaultsTest, SigtermDrainsPromptlyWithARunStuckOnAStoppedPeer) {
  auto cluster = Cluster::Start(2);
  ASSERT_NE(cluster, nullptr);
  const std::string job = UniqueJobId("drain");
  int running[2];
  ASSERT_EQ(pipe(running), 0);
  // 4 MiB: runs take a while.
  std::vector<pid_t> pids = SpawnAllreducesUntilTheJobFails(*cluster, job, 1 << 20, 3, running[1]);
  char c;
  ASSERT_EQ(read(running[0], &c, 1), 1);
  ASSERT_EQ(kill(cluster->nodes[1]->pid(), SIGSTOP), 0);
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  const auto start = Clock::now();
  EXPECT_EQ(cluster->nodes[0]->Stop(std::chrono::seconds(20)), 0) << cluster->nodes[0]->Log();
  const double took = std::chrono::duration<double>(Clock::now() - start).count();
  EXPECT_LT(took, 10.0) << "SIGTERM took " << took << " s to drain";
  EXPECT_EQ(WaitChild(pids[0], std::chrono::seconds(30)), 0);
  kill(cluster->nodes[1]->pid(), SIGCONT);
  EXPECT_EQ(WaitChild(pids[1], std::chrono::seconds(30)), 0);
  EXPECT_EQ(cluster->nodes[1]->Stop(), 0);
}

// Heartbeats: a stopped daemon (SIGSTOP: its host still answers TCP) is
// found by the others from the silence on the ordering stream, with no
// operation in flight: the coordinator when a node stops, the node when the
// coordinator does. The job then fails with UNAVAILABLE naming the stopped
// one, within heartbeat_interval_ms x heartbeat_misses (1 s here) and
// the time for the error to travel.
class HeartbeatTest : public ::testing::TestWithParam<int> {};

TEST_P(HeartbeatTest, AStoppedDaemonFailsTheJobWhileNothingIsInFlight) {
  const int stopped = GetParam();  // 0: the coordinator's node; 1: the other
  auto cluster = Cluster::Start(
      2, "tuning:\n  heartbeat_interval_ms: 250\n  heartbeat_misses: 4\n");
  ASSERT_NE(cluster, nullptr);
  const std::string job = UniqueJobId("heartbeat");
  int idle[2];
  ASSERT_EQ(pipe(idle), 0);
  const int survivor = 1 - stopped;
  std::vector<pid_t> pids = SpawnRanks(2, [&](int rank) {
    auto comm = cluster->Join(job, rank, 2, 1);
    CHILD_CHECK(comm != nullptr, "join");
    int64_t v = rank;
    CHILD_CHECK(comm->Allreduce(&v, &v, 1, DataType::kInt64, ReduceOp::kSum).Wait().ok(), "first");
    CHILD_CHECK(write(idle[1], "i", 1) == 1, "pipe");
    if (rank != survivor) {
      pause();  // its daemon is stopped under it
      return 0;
    }
    // Idle while the peer is stopped, then the job has ended by itself.
    std::this_thread::sleep_for(std::chrono::milliseconds(2500));
    const auto start = Clock::now();
    OpOptions o;
    o.timeout_ms = 30000;
    Status s = comm->Allreduce(&v, &v, 1, DataType::kInt64, ReduceOp::kSum, o).Wait();
    const double took = std::chrono::duration<double>(Clock::now() - start).count();
    CHILD_CHECK(s.code() == StatusCode::kUnavailable &&
                    Contains(s.message(), "node" + std::to_string(stopped)),
                "%s", s.ToString().c_str());
    CHILD_CHECK(took < 1.0, "the job had not ended: the operation took %.1f s", took);
    return 0;
  });
  char c;
  ASSERT_EQ(read(idle[0], &c, 1), 1);
  ASSERT_EQ(read(idle[0], &c, 1), 1);
  ASSERT_EQ(kill(cluster->nodes[stopped]->pid(), SIGSTOP), 0);
  EXPECT_EQ(WaitChild(pids[survivor], std::chrono::seconds(30)), 0)
      << cluster->nodes[survivor]->Log();
  EXPECT_TRUE(cluster->nodes[survivor]->Alive());
  if (cluster->nodes[survivor]->Alive()) ExpectServes(cluster->nodes[survivor]->socket());
  kill(cluster->nodes[stopped]->pid(), SIGCONT);
  kill(pids[stopped], SIGKILL);
  WaitChild(pids[stopped], std::chrono::seconds(10));
  EXPECT_TRUE(cluster->StopAll());
}

INSTANTIATE_TEST_SUITE_P(CoordinatorOrNode, HeartbeatTest, ::testing::Values(0, 1),
                         [](const ::testing::TestParamInfo<int>& info) {
                           return info.param == 0 ? std::string("CoordinatorStopped")
                                                  : std::string("NodeStopped");
                         });

TEST(MultiNodeFaultsTest, KilledDaemonFailsTheJobOnTheOtherNodesNamingIt) {
  auto cluster = Cluster::Start(3);
  ASSERT_NE(cluster, nullptr);
  const std::string job = UniqueJobId("killnode");
  int ready[2];
  ASSERT_EQ(pipe(ready), 0);
  std::vector<pid_t> pids = SpawnRanks(3, [&](int rank) {
    auto comm = cluster->Join(job, rank, 3, 1);
    CHILD_CHECK(comm != nullptr, "join");
    std::vector<float> v(1024, 1.0f);
    Status s = comm->Allreduce(v.data(), v.data(), v.size(), DataType::kFloat32, ReduceOp::kSum).Wait();
    CHILD_CHECK(s.ok() && v[0] == 3.0f, "%s", s.ToString().c_str());
    if (rank == 2) {
      CHILD_CHECK(write(ready[1], "r", 1) == 1, "pipe");
      pause();
      return 0;
    }
    OpOptions o;
    o.name = "after-kill";
    Handle h = comm->Allreduce(v.data(), v.data(), v.size(), DataType::kFloat32, ReduceOp::kSum, o);
    CHILD_CHECK(write(ready[1], "r", 1) == 1, "pipe");
    auto t0 = Clock::now();
    s = h.Wait();
    auto took = Clock::now() - t0;
    CHILD_CHECK(!s.ok() && Contains(s.message(), "node2"), "%s", s.ToString().c_str());
    CHILD_CHECK(took < std::chrono::seconds(10), "took %lld ms",
                (long long)std::chrono::duration_cast<std::chrono::milliseconds>(took).count());
    return 0;
  });
  char c;
  for (int i = 0; i < 3; ++i) ASSERT_EQ(read(ready[0], &c, 1), 1);
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  kill(cluster->nodes[2]->pid(), SIGKILL);
  EXPECT_EQ(WaitChild(pids[0], std::chrono::seconds(30)), 0);
  EXPECT_EQ(WaitChild(pids[1], std::chrono::seconds(30)), 0);
  kill(pids[2], SIGKILL);
  WaitChild(pids[2], std::chrono::seconds(10));
  close(ready[0]);
  close(ready[1]);

  // The surviving daemons accept and run a new two-node job.
  const std::string job2 = UniqueJobId("survivors");
  auto codes = RunRanks(2, [&](int rank) {
    auto comm = cluster->Join(job2, rank, 2, 1);
    CHILD_CHECK(comm != nullptr, "join");
    std::vector<int64_t> v(100, rank + 1);
    Status s = comm->Allreduce(v.data(), v.data(), v.size(), DataType::kInt64, ReduceOp::kSum).Wait();
    CHILD_CHECK(s.ok() && v[0] == 3, "%s", s.ToString().c_str());
    return 0;
  });
  EXPECT_EQ(codes, (std::vector<int>{0, 0}));
  cluster->nodes[2].reset();
  EXPECT_TRUE(cluster->StopAll());
}

// A daemon killed while a run is on the wire, in a job of five nodes: its
// ring neighbours see their transfers with it fail, the others would wait
// for peers that wait for it until the run's one-minute deadline; the
// coordinator (which sees the node's stream go) says the run is cut off, so
// every surviving rank hears within seconds, naming the lost node.
TEST(MultiNodeFaultsTest, DaemonKilledMidRunFailsEveryOtherNodeWithinSeconds) {
  const int n = 5;
  auto cluster = Cluster::Start(n);
  ASSERT_NE(cluster, nullptr);
  const std::string job = UniqueJobId("killmidrun");
  int ready[2];
  ASSERT_EQ(pipe(ready), 0);
  std::vector<pid_t> pids = SpawnRanks(n, [&](int rank) {
    auto comm = cluster->Join(job, rank, n, 1);
    CHILD_CHECK(comm != nullptr, "join");
    std::vector<float> v(size_t{4} << 20, 1.0f);  // 16 MiB: the kill lands mid-run
    for (int i = 0; i < 200; ++i) {
      Status s =
          comm->Allreduce(v.data(), v.data(), v.size(), DataType::kFloat32, ReduceOp::kMax).Wait();
      if (!s.ok()) {
        CHILD_CHECK(i > 0, "the first allreduce failed: %s", s.ToString().c_str());
        if (rank == 2) return 0;  // its daemon is gone
        std::printf("rank %d: %s\n", rank, s.ToString().c_str());
        CHILD_CHECK(Contains(s.message(), "node2") || Contains(s.message(), "node 2"), "%s",
                    s.ToString().c_str());
        return 0;
      }
      CHILD_CHECK(v[0] == 1.0f && v.back() == 1.0f, "wrong result");
      if (i == 0) CHILD_CHECK(write(ready[1], "r", 1) == 1, "pipe");
    }
    CHILD_CHECK(false, "200 allreduces and no failure");
    return 0;
  });
  char c;
  for (int i = 0; i < n; ++i) ASSERT_EQ(read(ready[0], &c, 1), 1);
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  const auto killed = Clock::now();
  kill(cluster->nodes[2]->pid(), SIGKILL);
  for (int r : {0, 1, 3, 4}) EXPECT_EQ(WaitChild(pids[r], std::chrono::seconds(90)), 0) << r;
  const auto took = Clock::now() - killed;
  for (int k : {0, 1, 3, 4}) {  // the survivors live on
    if (cluster->nodes[k]->Alive()) continue;
    const std::string log = cluster->nodes[k]->Log();
    ADD_FAILURE() << "node" << k << " died; the end of its log:\n"
                  << log.substr(log.size() > 6000 ? log.size() - 6000 : 0);
  }
  EXPECT_LT(took, std::chrono::seconds(10))
      << std::chrono::duration_cast<std::chrono::milliseconds>(took).count() << " ms";
  kill(pids[2], SIGKILL);
  WaitChild(pids[2], std::chrono::seconds(10));
  close(ready[0]);
  close(ready[1]);
  cluster->nodes[2].reset();
  EXPECT_TRUE(cluster->StopAll());
}

// alltoall on device buffers in a multi-node job is checked like any device
// operation, at once, before its job has even formed: without a GPU (CI) a
// clear FAILED_PRECONDITION naming the operation; with one, these
// descriptors (zeros: no allocation) are INVALID_ARGUMENT. (On a GPU,
// DeviceMultiNodeTest runs it.)
TEST(MultiNodeFaultsTest, DeviceAlltoallAcrossNodesIsCheckedAtOnce) {
  auto cluster = Cluster::Start(2);
  ASSERT_NE(cluster, nullptr);
  const std::string job = UniqueJobId("a2adev");
  auto codes = RunRanks(1, [&](int) {
    RawSession raw;
    CHILD_CHECK(raw.Open(cluster->nodes[0]->socket(), 1 << 20), "open");
    std::string msg;
    CHILD_CHECK(raw.Join(cluster->nodes[0]->socket(), job, 0, 2, &msg, 1, cluster->peers[0]) == 0,
                "join: %s", msg.c_str());
    wire::SubmissionEntry e = Entry(7, wire::Collective::kAlltoall, wire::DataType::kFloat32,
                                    wire::ReduceOp{}, 4, wire::kDataOffset,
                                    wire::kDataOffset + 4096, "a2a");
    e.flags = wire::kSubmitFlagDeviceBuffers;
    raw.Submit(e);
    wire::CompletionEntry done;
    CHILD_CHECK(raw.NextCompletion(&done, 5000), "no completion");
    const std::string text = MessageOf(done);
    const bool no_gpu = done.status_code == 9 && Contains(text, "operation 'a2a'") &&
                        Contains(text, "device (CUDA) buffers");
    const bool bad_handle = done.status_code == 3 && Contains(text, "device");
    CHILD_CHECK(done.op_id == 7 && (no_gpu || bad_handle), "code %d: %s", done.status_code,
                text.c_str());
    return 0;
  });
  EXPECT_EQ(codes, (std::vector<int>{0}));
  EXPECT_TRUE(cluster->StopAll());
}

// A daemon with another token cannot join: the handshake fails on both
// ends, each naming the other (the token itself never crosses).
TEST(MultiNodeFaultsTest, DaemonWithoutTheClusterTokenCannotJoin) {
  TokenFile good("correct horse battery staple"), bad("guessed");
  auto cluster = Cluster::Start(2, "", {good.path(), bad.path()});
  ASSERT_NE(cluster, nullptr);
  const std::string job = UniqueJobId("token");
  auto codes = RunRanks(2, [&](int rank) {
    auto comm = cluster->Join(job, rank, 2, 1);
    CHILD_CHECK(comm != nullptr, "join");
    std::vector<float> v(8, 1.0f);
    OpOptions o;
    o.timeout_ms = 3000;
    Status s = comm->Allreduce(v.data(), v.data(), v.size(), DataType::kFloat32, ReduceOp::kSum, o).Wait();
    if (rank == 1) {
      CHILD_CHECK(s.code() == StatusCode::kPermissionDenied && Contains(s.message(), "token"),
                  "%s", s.ToString().c_str());
    } else {
      CHILD_CHECK(!s.ok(), "rank 0 completed without its partner");
    }
    return 0;
  }, std::chrono::seconds(60));
  EXPECT_EQ(codes, (std::vector<int>{0, 0}));
  EXPECT_TRUE(Contains(cluster->nodes[0]->Log(), "does not know the cluster token"))
      << cluster->nodes[0]->Log();
  EXPECT_TRUE(Contains(cluster->nodes[1]->Log(), "refused this daemon's cluster-token proof"))
      << cluster->nodes[1]->Log();
  EXPECT_TRUE(cluster->StopAll());
}

// An operation whose deadline passes while its job is still forming (the
// job's other node never comes) ends with a clear DEADLINE_EXCEEDED naming
// the forming job, and never runs later; the daemon goes on (a second one
// ends the same way).
// An unnamed direct operation that times out on node 0 (node 1's rank
// submits it only later) leaves rank 0's buffer alone once rank 0 has
// heard of it: what node 1 sends then lands in the daemon's own memory
// (in place in shared memory: 3 floats, inline in the message, and 2000,
// a value sent apart). Node 1's rank completes it with both ranks' values,
// and the job goes on.
TEST(MultiNodeFaultsTest, ADirectOperationThatTimedOutLeavesTheRanksBufferAlone) {
  auto cluster = Cluster::Start(2);
  ASSERT_NE(cluster, nullptr);
  const std::string job = UniqueJobId("abandon");
  auto codes = RunRanks(2, [&](int rank) {
    auto comm = cluster->Join(job, rank, 2, 1);
    CHILD_CHECK(comm != nullptr, "join");
    for (size_t count : {size_t{3}, size_t{2000}}) {
      Buffer buf;
      CHILD_CHECK(comm->Allocate(count * sizeof(float), &buf).ok(), "allocate");
      float* v = static_cast<float*>(buf.data());
      std::fill(v, v + count, rank == 0 ? 1.0f : 2.0f);
      if (rank == 0) {
        OpOptions o;
        o.timeout_ms = 300;
        Status s = comm->Allreduce(v, v, count, DataType::kFloat32, ReduceOp::kSum, o).Wait();
        CHILD_CHECK(s.code() == StatusCode::kDeadlineExceeded &&
                        Contains(s.message(), "nothing came from node"),
                    "%zu: %s", count, s.ToString().c_str());
        std::fill(v, v + count, 42.0f);  // the buffer is the rank's again
      } else {
        std::this_thread::sleep_for(std::chrono::milliseconds(1500));  // past rank 0's deadline
        Status s = comm->Allreduce(v, v, count, DataType::kFloat32, ReduceOp::kSum).Wait();
        CHILD_CHECK(s.ok() && v[0] == 3.0f && v[count - 1] == 3.0f, "%zu late: %s (%f)", count,
                    s.ToString().c_str(), v[0]);
      }
      // The next operation: on node 0 it ends after node 1's message for
      // the first has reached node 0's daemon (one channel, in order).
      std::vector<float> w(count, rank == 0 ? 1.0f : 2.0f);
      Status s = comm->Allreduce(w.data(), w.data(), count, DataType::kFloat32, ReduceOp::kSum)
                     .Wait();
      CHILD_CHECK(s.ok() && w[0] == 3.0f && w[count - 1] == 3.0f, "%zu next: %s", count,
                  s.ToString().c_str());
      if (rank == 0) {
        for (size_t i = 0; i < count; ++i) {
          CHILD_CHECK(v[i] == 42.0f, "%zu: element %zu of the timed-out operation's buffer "
                      "was written after it failed: %f", count, i, v[i]);
        }
      }
    }
    return 0;
  }, std::chrono::seconds(120));
  EXPECT_EQ(codes, (std::vector<int>{0, 0}));
  EXPECT_TRUE(cluster->StopAll());
}

// A 1 MiB unnamed allreduce that times out on node 0 while node 0's
// daemon is still sending it straight from rank 0's send buffer (UCX's
// rendezvous: the data moves only once node 1 asks for it, and a send
// cannot be taken back): the job ends, saying why, and rank 0 hears of its
// operation once the job's end has cut the send off, at its deadline.
// Node 1's rank, late, gets that reason (node 0's Leave carries it), not a
// result read from a buffer that rank 0 may have reused; both daemons
// serve a new job after.
TEST(MultiNodeFaultsTest, ATimeoutWhileTheRanksBufferIsBeingSentEndsTheJob) {
  auto cluster = Cluster::Start(2);
  ASSERT_NE(cluster, nullptr);
  const std::string job = UniqueJobId("abandonsend");
  auto codes = RunRanks(2, [&](int rank) {
    auto comm = cluster->Join(job, rank, 2, 1);
    CHILD_CHECK(comm != nullptr, "join");
    const size_t count = 262144;
    Buffer in, out;
    CHILD_CHECK(comm->Allocate(count * sizeof(float), &in).ok(), "allocate");
    CHILD_CHECK(comm->Allocate(count * sizeof(float), &out).ok(), "allocate");
    float* v = static_cast<float*>(in.data());
    std::fill(v, v + count, rank == 0 ? 1.0f : 2.0f);
    OpOptions o;
    o.timeout_ms = rank == 0 ? 300 : 3000;
    if (rank == 1) std::this_thread::sleep_for(std::chrono::milliseconds(1000));
    const auto t0 = Clock::now();
    Status s = comm->Allreduce(v, out.data(), count, DataType::kFloat32, ReduceOp::kSum, o).Wait();
    const double took = std::chrono::duration<double>(Clock::now() - t0).count();
    if (rank == 0) {
      CHILD_CHECK(s.code() == StatusCode::kDeadlineExceeded &&
                      Contains(s.message(), "nothing came from node"),
                  "%s", s.ToString().c_str());
      CHILD_CHECK(took < 5, "heard after %.2f s", took);
      std::vector<float> w(8, 1.0f);
      s = comm->Allreduce(w.data(), w.data(), w.size(), DataType::kFloat32, ReduceOp::kSum, o)
              .Wait();
      CHILD_CHECK(Contains(s.message(), "cannot be taken back, so the job ends"), "next: %s",
                  s.ToString().c_str());
    } else {
      CHILD_CHECK(Contains(s.message(), "cannot be taken back, so the job ends"),
                  "the late rank: %s", s.ToString().c_str());
    }
    return 0;
  }, std::chrono::seconds(120));
  EXPECT_EQ(codes, (std::vector<int>{0, 0}));
  const std::string next = UniqueJobId("abandonsend-after");
  codes = RunRanks(2, [&](int rank) {
    auto comm = cluster->Join(next, rank, 2, 1);
    CHILD_CHECK(comm != nullptr, "join");
    std::vector<float> w(262144, 1.0f);
    Status s = comm->Allreduce(w.data(), w.data(), w.size(), DataType::kFloat32, ReduceOp::kSum)
                   .Wait();
    CHILD_CHECK(s.ok() && w[0] == 2.0f && w.back() == 2.0f, "%s", s.ToString().c_str());
    return 0;
  }, std::chrono::seconds(60));
  EXPECT_EQ(codes, (std::vector<int>{0, 0}));
  EXPECT_TRUE(cluster->StopAll());
}

TEST(MultiNodeFaultsTest, AnOperationTimesOutClearlyWhileTheJobForms) {
  auto cluster = Cluster::Start(1);
  ASSERT_NE(cluster, nullptr);
  const std::string job = UniqueJobId("forming");
  auto codes = RunRanks(1, [&](int) {
    auto comm = cluster->Join(job, 0, 2, 1);  // rank 0 of 2; node 1 never joins
    CHILD_CHECK(comm != nullptr, "join");
    for (int i = 0; i < 2; ++i) {
      std::vector<float> v(8, 1.0f);
      OpOptions o;
      o.timeout_ms = 1000;
      const auto start = Clock::now();
      Status s = comm->Allreduce(v.data(), v.data(), v.size(), DataType::kFloat32,
                                 ReduceOp::kSum, o).Wait();
      const double waited =
          std::chrono::duration<double>(Clock::now() - start).count();
      CHILD_CHECK(s.code() == StatusCode::kDeadlineExceeded && Contains(s.message(), "not formed"),
                  "%s", s.ToString().c_str());
      CHILD_CHECK(waited >= 0.9 && waited < 10, "ended after %.2f s", waited);
      CHILD_CHECK(v == std::vector<float>(8, 1.0f), "the buffer was written");
    }
    return 0;
  }, std::chrono::seconds(60));
  EXPECT_EQ(codes, (std::vector<int>{0}));
  EXPECT_TRUE(cluster->StopAll());
}

TEST(MultiNodeOperabilityTest, PeersShowsNodesLinksAndBytes) {
  auto cluster = Cluster::Start(2, "metrics_listen: \"127.0.0.1:0\"\n");
  ASSERT_NE(cluster, nullptr);
  const std::string job = UniqueJobId("peers");
  int ready[2], release[2];
  ASSERT_EQ(pipe(ready), 0);
  ASSERT_EQ(pipe(release), 0);
  std::vector<pid_t> pids = SpawnRanks(2, [&](int rank) {
    auto comm = cluster->Join(job, rank, 2, 1);
    CHILD_CHECK(comm != nullptr, "join");
    std::vector<float> v(1 << 20, 1.0f);
    Status s = comm->Allreduce(v.data(), v.data(), v.size(), DataType::kFloat32, ReduceOp::kSum).Wait();
    CHILD_CHECK(s.ok(), "%s", s.ToString().c_str());
    CHILD_CHECK(write(ready[1], "r", 1) == 1, "pipe");
    char c;
    CHILD_CHECK(read(release[0], &c, 1) == 1, "pipe");
    return 0;
  });
  char c;
  for (int i = 0; i < 2; ++i) ASSERT_EQ(read(ready[0], &c, 1), 1);
  std::string out;
  int code = RunCommand(std::string(CIUICCTL_PATH) + " --socket " + cluster->nodes[0]->socket() + " peers", &out);
  EXPECT_EQ(code, 0) << out;
  EXPECT_TRUE(Contains(out, "node0 (this node)")) << out;
  EXPECT_TRUE(Contains(out, "node1")) << out;
  EXPECT_TRUE(Contains(out, "connected")) << out;
  code = RunCommand(std::string(CIUICCTL_PATH) + " --json --socket " + cluster->nodes[0]->socket() + " peers", &out);
  EXPECT_EQ(code, 0) << out;
  // The 4 MiB allreduce moved at least 2 MiB each way to node1.
  const size_t at = out.find("\"nodeName\":\"node1\"");
  ASSERT_NE(at, std::string::npos) << out;
  for (const char* key : {"\"bytesSent\":\"", "\"bytesReceived\":\""}) {
    const size_t v = out.find(key, at);
    ASSERT_NE(v, std::string::npos) << out;
    EXPECT_GE(std::stoull(out.substr(v + strlen(key))), 2u << 20) << key << " " << out;
  }
  // The same link and bytes in Prometheus's form.
  std::string metrics, address;
  ASSERT_EQ(ReadMetrics(cluster->nodes[0]->socket(), &metrics, &address), "");
  const std::string labels = "{job=\"" + job + "\",node=\"node1\"}";
  EXPECT_TRUE(Contains(metrics, "ciuic_peer_connected" + labels + " 1\n")) << metrics;
  for (const char* family : {"ciuic_peer_bytes_sent_total", "ciuic_peer_bytes_received_total"}) {
    const size_t m = metrics.find(family + labels + " ");
    ASSERT_NE(m, std::string::npos) << family << "\n" << metrics;
    EXPECT_GE(std::stod(metrics.substr(m + strlen(family) + labels.size() + 1)), 2u << 20)
        << family;
  }
  ASSERT_EQ(write(release[1], "gg", 2), 2);
  EXPECT_EQ(WaitChild(pids[0], std::chrono::seconds(30)), 0);
  EXPECT_EQ(WaitChild(pids[1], std::chrono::seconds(30)), 0);
  for (int fd : {ready[0], ready[1], release[0], release[1]}) close(fd);
  EXPECT_TRUE(cluster->StopAll());
}

// `ciuicctl trace` on both nodes: a rank of node1 submits late, so node0's
// operations wait for node1 (named as the node that came last, by how
// much), and node1's wait for that rank; every phase is in order.
TEST(MultiNodeOperabilityTest, TraceNamesTheLateNodeAndTheLateRank) {
  auto cluster = Cluster::Start(2);
  ASSERT_NE(cluster, nullptr);
  const std::string job = UniqueJobId("trace");
  constexpr int kOps = 4;
  constexpr auto kLate = std::chrono::milliseconds(50);
  std::vector<int> codes = RunRanks(4, [&](int rank) {
    auto comm = cluster->Join(job, rank, 2, 2);
    CHILD_CHECK(comm != nullptr, "join");
    std::vector<float> v(64 << 10, 1.0f);
    OpOptions o;
    // First one operation that lines the ranks up (they joined at different
    // times), not counted below.
    o.name = "warm";
    std::vector<float> w(16, 1.0f);
    Status warm = comm->Allreduce(w.data(), w.data(), w.size(), DataType::kFloat32, ReduceOp::kSum, o).Wait();
    CHILD_CHECK(warm.ok(), "%s", warm.ToString().c_str());
    for (int i = 0; i < kOps; ++i) {
      if (rank == 3) std::this_thread::sleep_for(kLate);
      o.name = "g" + std::to_string(i);
      Status s = comm->Allreduce(v.data(), v.data(), v.size(), DataType::kFloat32, ReduceOp::kSum, o).Wait();
      CHILD_CHECK(s.ok(), "%s", s.ToString().c_str());
      CHILD_CHECK(v[0] == std::pow(4.0f, i + 1), "%g", v[0]);
    }
    return 0;
  });
  EXPECT_EQ(codes, std::vector<int>({0, 0, 0, 0}));
  for (int node = 0; node < 2; ++node) {
    proto::TraceReply trace;
    ASSERT_EQ(ReadTrace(cluster->nodes[node]->socket(), job, &trace), "") << node;
    ASSERT_EQ(trace.ops_size(), kOps + 1) << trace.DebugString();
    EXPECT_EQ(trace.ops(0).name(), "warm");
    for (int i = 0; i < kOps; ++i) {
      const proto::OpTrace& op = trace.ops(i + 1);
      SCOPED_TRACE(op.DebugString());
      EXPECT_EQ(op.name(), "g" + std::to_string(i));
      EXPECT_EQ(op.code(), 0);
      ASSERT_EQ(op.arrivals_size(), 2);
      EXPECT_EQ(op.arrivals(0).rank(), 2 * node);
      EXPECT_EQ(op.arrivals(1).rank(), 2 * node + 1);
      if (node == 1) EXPECT_GE(op.arrivals(1).after_us(), 20000u);  // rank 3
      // Every phase happened, in order.
      ASSERT_TRUE(op.has_launched_us() && op.has_ready_us() && op.has_announced_us() &&
                  op.has_run_start_us() && op.has_run_end_us());
      EXPECT_LE(op.launched_us(), op.ready_us());
      EXPECT_LE(op.ready_us(), op.announced_us());
      EXPECT_LE(op.announced_us(), op.run_start_us());
      EXPECT_LE(op.run_start_us(), op.run_end_us());
      EXPECT_LE(op.run_end_us(), op.done_us());
      EXPECT_EQ(op.fused_ops(), 1u);
      EXPECT_EQ(op.run_seq(), static_cast<uint64_t>(i + 1));
      // The coordinator heard from node1 last, well after node0.
      EXPECT_EQ(op.last_node(), "node1");
      EXPECT_GE(op.ready_spread_us(), 20000u);
      // node0 waited for the coordinator's announcement that long.
      if (node == 0) EXPECT_GE(op.announced_us() - op.launched_us(), 20000u);
    }
    int code = 0;
    std::string out;
    code = RunCommand(std::string(CIUICCTL_PATH) + " --socket " + cluster->nodes[node]->socket() +
                          " trace --last 4 --job " + job, &out);
    EXPECT_EQ(code, 0) << out;
    EXPECT_TRUE(Contains(out, "node node1 last in 4 of 4")) << out;
    if (node == 1) EXPECT_TRUE(Contains(out, "rank 3 last in 4 of 4")) << out;
  }
  EXPECT_TRUE(cluster->StopAll());
}

// deploy/grafana/ciuic.json is valid JSON, and every metric it queries is
// one a daemon serves while a multi-node job with compression runs (each
// queried name, less a histogram's _bucket/_sum/_count, has its # TYPE
// line in node0's /metrics).
TEST(MultiNodeOperabilityTest, TheGrafanaDashboardQueriesOnlyServedMetrics) {
  const std::string dashboard = std::string(CIUIC_SOURCE_DIR) + "/deploy/grafana/ciuic.json";
  std::string out;
  ASSERT_EQ(RunCommand("/usr/bin/python3 -c 'import json, sys; d = json.load(open(sys.argv[1])); "
                       "print(len(d[\"panels\"]))' " + dashboard, &out), 0) << out;
  std::ifstream file(dashboard);
  const std::string text((std::istreambuf_iterator<char>(file)), std::istreambuf_iterator<char>());
  std::set<std::string> queried;
  for (size_t at = text.find("ciuic_"); at != std::string::npos; at = text.find("ciuic_", at)) {
    size_t end = at;
    while (end < text.size() && (std::islower(static_cast<unsigned char>(text[end])) ||
                                 std::isdigit(static_cast<unsigned char>(text[end])) ||
                                 text[end] == '_')) {
      ++end;
    }
    std::string name = text.substr(at, end - at);
    for (const char* suffix : {"_bucket", "_sum", "_count"}) {
      if (absl::EndsWith(name, suffix)) name.resize(name.size() - strlen(suffix));
    }
    queried.insert(name);
    at = end;
  }
  ASSERT_GE(queried.size(), 20u);

  auto cluster = Cluster::Start(2, "metrics_listen: \"127.0.0.1:0\"\n"
                                   "tuning:\n  min_compress_bytes: 1K\n");
  ASSERT_NE(cluster, nullptr);
  const std::string job = UniqueJobId("grafana");
  HeldRanks ranks(2, [&](int rank, const std::function<void()>& hold) {
    auto comm = cluster->Join(job, rank, 2, 1);
    CHILD_CHECK(comm != nullptr, "join");
    std::vector<float> v(64 << 10, 1.0f);
    OpOptions o;
    o.compression = "int8";
    Status s = comm->Allreduce(v.data(), v.data(), v.size(), DataType::kFloat32, ReduceOp::kSum, o).Wait();
    CHILD_CHECK(s.ok(), "%s", s.ToString().c_str());
    s = comm->Allreduce(v.data(), v.data(), 8, DataType::kFloat32, ReduceOp::kSum).Wait();
    CHILD_CHECK(s.ok(), "%s", s.ToString().c_str());
    hold();
    return 0;
  });
  ASSERT_TRUE(ranks.Held());
  std::string metrics, address;
  ASSERT_EQ(ReadMetrics(cluster->nodes[0]->socket(), &metrics, &address), "");
  for (const std::string& name : queried) {
    EXPECT_TRUE(Contains(metrics, "# TYPE " + name + " ")) << name << " is not served:\n" << metrics;
  }
  EXPECT_EQ(ranks.Release(), std::vector<int>({0, 0}));
  EXPECT_TRUE(cluster->StopAll());
}

// `ciuicctl trace --flight-recorder` on each node of a 2 x 2 job into one
// directory: the four ranks' dumps list the same collectives under the same
// numbers (each node counts the job's operations itself), and an operation
// that waits for rank 3 shows as "started" on node0 (its ranks are in, the
// nodes run it) and "scheduled" for rank 2 on node1.
TEST(MultiNodeOperabilityTest, FlightRecorderDumpsOfEveryNodeLineUp) {
  auto cluster = Cluster::Start(2);
  ASSERT_NE(cluster, nullptr);
  const std::string job = UniqueJobId("fr");
  const std::string dir = cluster->nodes[0]->dir() + "/fr";
  const auto dump = [&](int node) {
    std::string out;
    int code = RunCommand(std::string(CIUICCTL_PATH) + " --socket " +
                              cluster->nodes[node]->socket() + " trace --job " + job +
                              " --flight-recorder " + dir, &out);
    return code == 0 ? std::string() : out;
  };
  // Whether rank `rank`'s dump holds an entry in state `state`: the
  // pickled string value (BINUNICODE, 4-byte length), not a key that
  // contains the word ("time_discovered_started_ns").
  const auto has = [&](int rank, const std::string& state) {
    std::ifstream f(dir + "/rank_" + std::to_string(rank), std::ios::binary);
    std::string bytes((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
    std::string value = "X";
    value.push_back(static_cast<char>(state.size()));
    value.append(3, '\0');
    return bytes.find(value + state) != std::string::npos;
  };
  std::vector<int> codes = RunRanks(4, [&](int rank) {
    auto comm = cluster->Join(job, rank, 2, 2);
    CHILD_CHECK(comm != nullptr, "join");
    std::vector<float> v(1000, 1.0f);
    for (int i = 0; i < 3; ++i) {
      Status s = comm->Allreduce(v.data(), v.data(), v.size() - i, DataType::kFloat32, ReduceOp::kSum).Wait();
      CHILD_CHECK(s.ok(), "%s", s.ToString().c_str());
    }
    Status s = comm->Allgather(v.data(), v.data() + 100, 25, DataType::kFloat32).Wait();
    CHILD_CHECK(s.ok(), "%s", s.ToString().c_str());
    if (rank == 3) {
      bool seen = false;
      for (int attempt = 0; attempt < 100 && !seen; ++attempt) {
        for (int node = 0; node < 2; ++node) {
          std::string failed = dump(node);
          CHILD_CHECK(failed.empty(), "ciuicctl: %s", failed.c_str());
        }
        seen = has(0, "started") && has(1, "started") && has(2, "scheduled");
        if (!seen) std::this_thread::sleep_for(std::chrono::milliseconds(100));
      }
      CHILD_CHECK(seen, "the waiting allreduce never showed as started and scheduled");
    }
    s = comm->Allreduce(v.data(), v.data(), 16, DataType::kFloat32, ReduceOp::kSum).Wait();
    CHILD_CHECK(s.ok(), "%s", s.ToString().c_str());
    return 0;
  });
  ASSERT_EQ(codes, std::vector<int>({0, 0, 0, 0}));
  const std::string script = cluster->nodes[0]->dir() + "/check_fr.py";
  std::ofstream(script) << R"PY(
import os, pickle, sys
d = sys.argv[1]
dumps = {}
for f in sorted(os.listdir(d)):
    with open(os.path.join(d, f), "rb") as fh:
        dumps[int(f[len("rank_"):])] = pickle.load(fh)
assert sorted(dumps) == [0, 1, 2, 3], sorted(dumps)
expected = [("nccl:all_reduce", 1000, 1000), ("nccl:all_reduce", 999, 999),
            ("nccl:all_reduce", 998, 998), ("nccl:all_gather", 25, 100)]
for rank, dump in dumps.items():
    (pg, cfg), = dump["pg_config"].items()
    assert eval(cfg["ranks"]) == [0, 1, 2, 3], cfg
    e = dump["entries"]
    assert len(e) == len(expected) + (0 if rank == 3 else 1), (rank, e)
    for i, (name, n_in, n_out) in enumerate(expected):
        assert e[i]["collective_seq_id"] == i and e[i]["profiling_name"] == name, (rank, i, e[i])
        assert e[i]["input_sizes"] == [[n_in]] and e[i]["output_sizes"] == [[n_out]], (rank, i, e[i])
        assert e[i]["state"] == "completed", (rank, i, e[i])
    if rank < 3:
        last = e[len(expected)]
        assert last["collective_seq_id"] == len(expected), last
        assert last["state"] == ("started" if rank < 2 else "scheduled"), (rank, last)
        assert last["input_sizes"] == [[16]], last
print("ok")
)PY";
  std::string out;
  EXPECT_EQ(RunCommand("/usr/bin/python3 " + script + " " + dir, &out), 0) << out;
  EXPECT_TRUE(Contains(out, "ok")) << out;
  EXPECT_TRUE(cluster->StopAll());
}

// Compression applies to what crosses the network: float sum/avg results
// stay within the codec's bound and are the same bits on every rank; other
// operations go uncompressed. `ciuicctl status` shows each node's error
// feedback residuals: one per compressed float32 operation, none dropped.
TEST(MultiNodeCompressionTest, CodecsBoundedSameBitsAndCounted) {
  auto cluster = Cluster::Start(2, "tuning:\n  min_compress_bytes: 1K\n");
  ASSERT_NE(cluster, nullptr);
  const std::string job = UniqueJobId("codec");
  int pipes[2];
  ASSERT_EQ(pipe(pipes), 0);
  auto codes = RunRanks(4, [&](int rank) {
    auto comm = cluster->Join(job, rank, 2, 2);
    CHILD_CHECK(comm != nullptr, "join");
    const size_t n = 100003;
    struct Case { const char* codec; double bound; };
    for (Case c : {Case{"fp16", 2e-3}, Case{"bf16", 2e-2}, Case{"int8", 3e-2}, Case{"none", 0}}) {
      std::vector<float> v(n);
      for (size_t i = 0; i < n; ++i) v[i] = std::sin(0.001 * i + rank) * (1 + rank);
      OpOptions o;
      o.name = std::string("g/") + c.codec;
      o.compression = c.codec;
      Status s = comm->Allreduce(v.data(), v.data(), n, DataType::kFloat32, ReduceOp::kSum, o).Wait();
      CHILD_CHECK(s.ok(), "%s: %s", c.codec, s.ToString().c_str());
      double max_err = 0, max_exact = 0;
      for (size_t i = 0; i < n; ++i) {
        double exact = 0;
        for (int r = 0; r < 4; ++r) exact += static_cast<float>(std::sin(0.001 * i + r) * (1 + r));
        max_err = std::max(max_err, std::fabs(v[i] - exact));
        max_exact = std::max(max_exact, std::fabs(exact));
      }
      CHILD_CHECK(max_err / max_exact <= c.bound + 1e-6, "%s: relative error %g > %g", c.codec,
                  max_err / max_exact, c.bound);
      // Same bits everywhere: rank 0 collects a checksum from every rank.
      uint64_t h = 1469598103934665603ull;
      for (float x : v) {
        uint32_t b;
        std::memcpy(&b, &x, 4);
        h = (h ^ b) * 1099511628211ull;
      }
      CHILD_CHECK(write(pipes[1], &h, sizeof(h)) == sizeof(h), "pipe");
    }
    // Integers are not compressed: exact.
    std::vector<int32_t> w(5000, rank + 1);
    OpOptions o;
    o.compression = "int8";
    Status s = comm->Allreduce(w.data(), w.data(), w.size(), DataType::kInt32, ReduceOp::kSum, o).Wait();
    CHILD_CHECK(s.ok() && w[4999] == 10, "%s", s.ToString().c_str());
    // A bad codec name is refused by the SDK.
    o.compression = "zstd";
    s = comm->Allreduce(w.data(), w.data(), w.size(), DataType::kInt32, ReduceOp::kSum, o).Wait();
    CHILD_CHECK(s.code() == StatusCode::kInvalidArgument && Contains(s.message(), "zstd"), "%s",
                s.ToString().c_str());
    if (rank % 2 == 0) {  // one rank per node: its node's residuals, every op of it done
      std::string out;
      const int code = RunCommand(std::string(CIUICCTL_PATH) + " --socket " +
                                      cluster->nodes[rank / 2]->socket() + " status",
                                  &out);
      const std::string want = "error feedback: job " + job +
                               ": 3 residuals, 1.1 MiB in host "
                               "memory, 0 B on GPUs; dropped: 0 evicted, 0 reset (size changed); "
                               "0 operations too large for it";
      CHILD_CHECK(code == 0 && Contains(out, want), "ciuicctl status, wanted '%s':\n%s",
                  want.c_str(), out.c_str());
    }
    return comm->Barrier().Wait().ok() ? 0 : 1;
  }, std::chrono::seconds(120));
  EXPECT_EQ(codes, (std::vector<int>{0, 0, 0, 0}));
  std::vector<uint64_t> sums(16);
  ASSERT_EQ(read(pipes[0], sums.data(), 16 * sizeof(uint64_t)), static_cast<ssize_t>(16 * sizeof(uint64_t)));
  // Per codec (4 of them) every rank wrote one checksum; they arrive
  // interleaved, so compare as multisets per codec position is not possible:
  // instead, every checksum must appear exactly 4 times.
  std::map<uint64_t, int> seen;
  for (uint64_t h : sums) ++seen[h];
  for (auto& [h, k] : seen) EXPECT_EQ(k % 4, 0) << "ranks disagree on a compressed result";
  close(pipes[0]);
  close(pipes[1]);
  EXPECT_TRUE(cluster->StopAll());
}

// The operations count fused on the node of `socket` for the job, from
// `ciuicctl --json status` (-1 if the job is not listed).
long long OpsFused(const std::string& socket, const std::string& job) {
  std::string out;
  if (RunCommand(std::string(CIUICCTL_PATH) + " --json --socket " + socket + " status", &out) != 0) {
    return -1;
  }
  const size_t jobs = out.find("\"jobs\":[");
  if (jobs == std::string::npos) return -1;
  const size_t at = out.find("\"jobId\":\"" + job + "\"", jobs);
  if (at == std::string::npos) return -1;
  const size_t end = out.find("\"jobId\"", at + 1);  // the next job's, or npos
  const std::string key = "\"opsFused\":\"";
  const size_t v = out.find(key, at);
  if (v == std::string::npos || v > end) return 0;  // proto3 JSON omits zeros
  return std::stoll(out.substr(v + key.size()));
}

// Many small named allreduces, every dtype and reduce op, submitted in a
// different order on every rank, all in flight at once: with fusion on
// (the coordinator's cycle collects them) they cross the network packed;
// results equal the reference bit for bit, the same bits as the unfused
// round after `tune set fusion_threshold_bytes=0`, and ciuicctl counts them.
class MultiNodeFusionTest : public ::testing::TestWithParam<Shape> {};

TEST_P(MultiNodeFusionTest, FusedResultsEqualUnfusedAndTheReference) {
  const Shape shape = GetParam();
  auto cluster = Cluster::Start(shape.nodes, "tuning:\n  chunk_bytes: 64K\n  cycle_time_us: 20000\n");
  ASSERT_NE(cluster, nullptr);
  const std::string job = UniqueJobId("fusion");
  const int world = shape.nodes * shape.ranks_per_node;
  const std::string coordinator_socket = cluster->nodes[0]->socket();
  auto codes = RunRanks(world, [&](int rank) {
    auto comm = cluster->Join(job, rank, shape.nodes, shape.ranks_per_node);
    CHILD_CHECK(comm != nullptr, "join");
    struct Op {
      std::string name;
      DataType t;
      ReduceOp op;
      size_t count;
      bool smooth;  // sin data (rounding-sensitive) instead of small integers
      Buffer send, recv;
      Handle h;
    };
    std::vector<Op> ops;
    for (DataType t : kAllDataTypes) {
      for (ReduceOp op : kAllReduceOps) {
        for (size_t count : {size_t{0}, size_t{1}, size_t{7}, size_t{1001}, size_t{3000}}) {
          ops.push_back(Op{std::string(DataTypeName(t)) + "/" + ReduceOpName(op) + "/" +
                               std::to_string(count), t, op, count, false, {}, {}, {}});
        }
      }
    }
    for (DataType t : {DataType::kFloat32, DataType::kFloat64, DataType::kFloat16, DataType::kBFloat16}) {
      for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kAvg, ReduceOp::kMax}) {
        ops.push_back(Op{std::string("smooth/") + DataTypeName(t) + "/" + ReduceOpName(op), t, op,
                         4099, true, {}, {}, {}});
      }
    }
    // Large enough for the ring: never fused, runs among the fused ones.
    ops.push_back(Op{"ring", DataType::kFloat32, ReduceOp::kSum, 300007, false, {}, {}, {}});
    for (auto& o : ops) {
      const size_t bytes = o.count * DataTypeSize(o.t);
      Status s = comm->Allocate(bytes, &o.send);
      CHILD_CHECK(s.ok(), "%s", s.ToString().c_str());
      s = comm->Allocate(bytes, &o.recv);
      CHILD_CHECK(s.ok(), "%s", s.ToString().c_str());
    }
    auto fill = [&](const Op& o, int r, void* out, size_t n) {
      if (!o.smooth) return FillSmall(o.t, o.op, r, out, n);
      for (size_t i = 0; i < n; ++i) {
        const double v = std::sin(0.37 * i + 1.3 * r) * (1 + 0.25 * r);
        switch (o.t) {
          case DataType::kFloat32: static_cast<float*>(out)[i] = static_cast<float>(v); break;
          case DataType::kFloat64: static_cast<double*>(out)[i] = v; break;
          case DataType::kFloat16: static_cast<uint16_t*>(out)[i] = FloatToHalf(static_cast<float>(v)); break;
          case DataType::kBFloat16: static_cast<uint16_t*>(out)[i] = FloatToBFloat(static_cast<float>(v)); break;
          default: break;
        }
      }
    };
    // One round: submit everything in this rank's order, wait, check.
    std::vector<std::vector<uint8_t>> first_round;
    long long fused_in_first_round = 0;  // rank 0 only
    for (int round = 0; round < 2; ++round) {
      std::vector<size_t> order(ops.size());
      std::iota(order.begin(), order.end(), 0);
      std::rotate(order.begin(), order.begin() + (rank * 37) % ops.size(), order.end());
      if (rank % 2) std::reverse(order.begin(), order.end());
      for (size_t i : order) {
        Op& o = ops[i];
        fill(o, rank, o.send.data(), o.count);
        std::memset(o.recv.data(), 0x5a, o.count * DataTypeSize(o.t));
        OpOptions opt;
        opt.name = (round == 0 ? "on/" : "off/") + o.name;
        o.h = comm->Allreduce(o.send.data(), o.recv.data(), o.count, o.t, o.op, opt);
      }
      for (size_t i = 0; i < ops.size(); ++i) {
        Op& o = ops[i];
        Status s = o.h.Wait();
        CHILD_CHECK(s.ok(), "%s: %s", o.name.c_str(), s.ToString().c_str());
        const size_t bytes = o.count * DataTypeSize(o.t);
        const auto* got = static_cast<const uint8_t*>(o.recv.data());
        if (!o.smooth) {
          const std::vector<uint8_t> want = ReferenceCollective(
              Coll::kAllreduce, o.t, o.op, world, rank, 0, o.count,
              [&](int r, void* out, size_t n) { fill(o, r, out, n); });
          CHILD_CHECK(bytes == 0 || std::memcmp(got, want.data(), bytes) == 0,
                      "round %d %s rank %d: differs from the reference", round, o.name.c_str(),
                      rank);
        }
        if (round == 0) {
          first_round.emplace_back(got, got + bytes);
        } else {
          CHILD_CHECK(bytes == 0 || std::memcmp(got, first_round[i].data(), bytes) == 0,
                      "%s rank %d: fused and unfused results differ", o.name.c_str(), rank);
        }
      }
      Status s = comm->Barrier().Wait();
      CHILD_CHECK(s.ok(), "barrier: %s", s.ToString().c_str());
      if (rank == 0) {
        const long long fused = OpsFused(coordinator_socket, job);
        CHILD_CHECK(fused > 0, "round %d: %lld operations fused", round, fused);
        if (round == 0) {
          fused_in_first_round = fused;
          std::string out;
          CHILD_CHECK(RunCommand(std::string(CIUICCTL_PATH) + " --socket " + coordinator_socket + " status", &out) == 0 &&
                          Contains(out, "operations fused into"), "%s", out.c_str());
          // Fusion off for the job, live, at its coordinator.
          CHILD_CHECK(RunCommand(std::string(CIUICCTL_PATH) + " --socket " + coordinator_socket +
                                     " tune set fusion_threshold_bytes=0", &out) == 0, "%s", out.c_str());
        } else {
          CHILD_CHECK(fused == fused_in_first_round, "fusion off, yet %lld more operations fused",
                      fused - fused_in_first_round);
        }
      }
      s = comm->Barrier().Wait();
      CHILD_CHECK(s.ok(), "barrier: %s", s.ToString().c_str());
    }
    return 0;
  }, std::chrono::seconds(240));
  for (int r = 0; r < world; ++r) EXPECT_EQ(codes[r], 0) << "rank " << r;
  EXPECT_TRUE(cluster->StopAll());
}

INSTANTIATE_TEST_SUITE_P(Shapes, MultiNodeFusionTest,
                         kShapes, ShapeName);

// Compressed allreduces fuse too: many small named float32 allreduces (sum
// and avg, over min_compress_bytes) submitted in a different order by every
// rank, with compression int8 or fp16. Every result is within the codec's
// bound of a float64 reference, the same on every rank, and operations were
// fused.
struct CodecShape {
  const char* codec;
  int nodes;
  int ranks_per_node;
};
class MultiNodeCompressedFusionTest : public ::testing::TestWithParam<CodecShape> {};

TEST_P(MultiNodeCompressedFusionTest, FusedCompressedResultsWithinTheBound) {
  const CodecShape shape = GetParam();
  const std::string codec = shape.codec;
  auto cluster = Cluster::Start(shape.nodes, "tuning:\n  chunk_bytes: 64K\n  cycle_time_us: 20000\n"
                                             "  min_compress_bytes: 1K\n  compression: " + codec + "\n");
  ASSERT_NE(cluster, nullptr);
  const std::string job = UniqueJobId("cfusion");
  const int world = shape.nodes * shape.ranks_per_node;
  const std::string coordinator_socket = cluster->nodes[0]->socket();
  auto codes = RunRanks(world, [&](int rank) {
    auto comm = cluster->Join(job, rank, shape.nodes, shape.ranks_per_node);
    CHILD_CHECK(comm != nullptr, "join");
    struct Op {
      std::string name;
      ReduceOp op;
      size_t count;
      Buffer send, recv;
      Handle h;
    };
    std::vector<Op> ops;
    const size_t counts[] = {257, 300, 1001, 3000, 4099, 777};
    for (int j = 0; j < 24; ++j) {
      const ReduceOp op = j % 2 ? ReduceOp::kAvg : ReduceOp::kSum;
      ops.push_back(Op{"g" + std::to_string(j), op, counts[j % 6] + static_cast<size_t>(j), {}, {}, {}});
    }
    for (auto& o : ops) {
      Status s = comm->Allocate(o.count * 4, &o.send);
      CHILD_CHECK(s.ok(), "%s", s.ToString().c_str());
      s = comm->Allocate(o.count * 4, &o.recv);
      CHILD_CHECK(s.ok(), "%s", s.ToString().c_str());
    }
    // |value of rank r| <= 1 + 0.25 r.
    auto value = [](size_t o, int r, size_t i) {
      return static_cast<float>(std::sin(0.37 * i + 1.3 * r + 0.11 * o) * (1 + 0.25 * r));
    };
    std::vector<size_t> order(ops.size());
    std::iota(order.begin(), order.end(), 0);
    std::rotate(order.begin(), order.begin() + (rank * 7) % ops.size(), order.end());
    if (rank % 2) std::reverse(order.begin(), order.end());
    for (size_t i : order) {
      Op& o = ops[i];
      auto* f = static_cast<float*>(o.send.data());
      for (size_t e = 0; e < o.count; ++e) f[e] = value(i, rank, e);
      OpOptions opt;
      opt.name = o.name;
      o.h = comm->Allreduce(o.send.data(), o.recv.data(), o.count, DataType::kFloat32, o.op, opt);
    }
    double sum_m = 0;
    for (int r = 0; r < world; ++r) sum_m += 1 + 0.25 * r;
    size_t inexact_ops = 0;
    for (size_t i = 0; i < ops.size(); ++i) {
      Op& o = ops[i];
      Status s = o.h.Wait();
      CHILD_CHECK(s.ok(), "%s: %s", o.name.c_str(), s.ToString().c_str());
      const auto* got = static_cast<const float*>(o.recv.data());
      const double scale = o.op == ReduceOp::kAvg ? 1.0 / world : 1.0;
      bool inexact = false;
      for (size_t e = 0; e < o.count; ++e) {
        double exact = 0, abs_sum = 0;
        for (int r = 0; r < world; ++r) {
          exact += value(i, r, e);
          abs_sum += std::fabs(value(i, r, e));
        }
        // Node contributions are sums of their ranks' values: M_k and A_i
        // are at most the ranks' sums.
        const double arith = (shape.nodes + 2) * 0x1p-24 * (abs_sum + std::fabs(exact)) * 2;
        const double bound =
            codec == "int8" ? 2 * sum_m / 254 * 1.001 + arith
                            : 0x1p-11 * (abs_sum + std::fabs(exact)) + shape.nodes * 0x1p-25 + arith;
        const double err = std::fabs(got[e] - exact * scale);
        CHILD_CHECK(err <= bound * scale, "%s rank %d element %zu: %g, want %g (bound %g)",
                    o.name.c_str(), rank, e, got[e], exact * scale, bound * scale);
        inexact = inexact || err > 0;
      }
      inexact_ops += inexact ? 1 : 0;
    }
    CHILD_CHECK(inexact_ops > 0, "rank %d: every result exact: nothing was compressed", rank);
    // The same bits on every rank: each rank sends a hash through an
    // (exact, uncompressed: integer) allreduce max and min.
    uint64_t hash = 1469598103934665603ull;
    for (auto& o : ops) {
      const auto* b = static_cast<const uint8_t*>(o.recv.data());
      for (size_t e = 0; e < o.count * 4; ++e) hash = (hash ^ b[e]) * 1099511628211ull;
    }
    Buffer h;
    Status s = comm->Allocate(16, &h);
    CHILD_CHECK(s.ok(), "%s", s.ToString().c_str());
    auto* hv = static_cast<int64_t*>(h.data());
    hv[0] = static_cast<int64_t>(hash >> 1);
    hv[1] = -static_cast<int64_t>(hash >> 1);
    s = comm->Allreduce(hv, hv, 2, DataType::kInt64, ReduceOp::kMax, OpOptions{}).Wait();
    CHILD_CHECK(s.ok(), "%s", s.ToString().c_str());
    CHILD_CHECK(hv[0] == -hv[1] && hv[0] == static_cast<int64_t>(hash >> 1),
                "rank %d: the ranks' results differ", rank);
    s = comm->Barrier().Wait();
    CHILD_CHECK(s.ok(), "barrier: %s", s.ToString().c_str());
    if (rank == 0) {
      const long long fused = OpsFused(coordinator_socket, job);
      CHILD_CHECK(fused > 0, "%lld operations fused", fused);
    }
    s = comm->Barrier().Wait();
    CHILD_CHECK(s.ok(), "barrier: %s", s.ToString().c_str());
    return 0;
  }, std::chrono::seconds(240));
  for (int r = 0; r < world; ++r) EXPECT_EQ(codes[r], 0) << "rank " << r;
  EXPECT_TRUE(cluster->StopAll());
}

INSTANTIATE_TEST_SUITE_P(Codecs, MultiNodeCompressedFusionTest,
                         ::testing::Values(CodecShape{"int8", 2, 1}, CodecShape{"fp16", 2, 1},
                                           CodecShape{"int8", 3, 2}, CodecShape{"fp16", 3, 1}),
                         [](const auto& info) {
                           return std::string(info.param.codec) + "_" +
                                  std::to_string(info.param.nodes) + "nodes_x" +
                                  std::to_string(info.param.ranks_per_node) + "ranks";
                         });

// A small urgent operation announced after a large one runs beside it, not
// behind it: it completes while the large one is still in flight.
TEST(MultiNodePriorityTest, SmallUrgentOperationOvertakesALargeOne) {
  auto cluster = Cluster::Start(2);
  ASSERT_NE(cluster, nullptr);
  const std::string job = UniqueJobId("prio");
  auto codes = RunRanks(2, [&](int rank) {
    auto comm = cluster->Join(job, rank, 2, 1, 600 << 20);
    CHILD_CHECK(comm != nullptr, "join");
    const size_t big = (256u << 20) / 4;
    Buffer large;
    Status s = comm->Allocate(big * 4, &large);
    CHILD_CHECK(s.ok(), "%s", s.ToString().c_str());
    auto* l = static_cast<float*>(large.data());
    for (size_t i = 0; i < big; ++i) l[i] = static_cast<float>(i % 1000) + rank;
    int overtook = 0;
    for (int attempt = 0; attempt < 3; ++attempt) {
      OpOptions lo;
      lo.name = "large" + std::to_string(attempt);
      lo.priority = 0;
      Handle hl = comm->Allreduce(l, l, big, DataType::kFloat32, ReduceOp::kSum, lo);
      // Every node readies the large one before the small one, so the
      // coordinator announces it first; the pause lets it get going.
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
      std::vector<int32_t> small(1000, rank + 1);
      OpOptions so;
      so.name = "urgent" + std::to_string(attempt);
      so.priority = 100;
      s = comm->Allreduce(small.data(), small.data(), small.size(), DataType::kInt32, ReduceOp::kSum, so).Wait();
      CHILD_CHECK(s.ok() && small[999] == 3, "urgent: %s, %d", s.ToString().c_str(), small[999]);
      if (!hl.Test()) ++overtook;
      s = hl.Wait();
      CHILD_CHECK(s.ok(), "large: %s", s.ToString().c_str());
      // In place: each attempt sums the two ranks' values (exact in float32).
      for (size_t i = 0; i < big; i += 4099) {
        float base0 = static_cast<float>(i % 1000), base1 = base0 + 1;
        float v0 = base0, v1 = base1;
        for (int a = 0; a <= attempt; ++a) {
          const float sum = v0 + v1;
          v0 = v1 = sum;
        }
        CHILD_CHECK(l[i] == v0, "large[%zu] = %g, want %g", i, l[i], v0);
      }
    }
    // Behind the large one (one run at a time) it could overtake none; a
    // loaded machine may let the large one finish first once.
    CHILD_CHECK(overtook >= 2, "the urgent operation overtook the large one %d of 3 times", overtook);
    return comm->Barrier().Wait().ok() ? 0 : 1;
  }, std::chrono::seconds(180));
  EXPECT_EQ(codes, (std::vector<int>{0, 0}));
  EXPECT_TRUE(cluster->StopAll());
}

// ---- Security between nodes (README, "Security") ----

// A TCP port on 127.0.0.1 that the test reads itself: the fake coordinator.
int ListenLoopback(int* port) {
  int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(a);
  if (bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0 || listen(fd, 16) != 0) return -1;
  getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  *port = ntohs(a.sin_port);
  return fd;
}

// What the daemon's process holds in memory now (VmRSS), bytes.
uint64_t RssBytes(pid_t pid) {
  std::ifstream status("/proc/" + std::to_string(pid) + "/status");
  std::string line;
  while (std::getline(status, line)) {
    if (line.rfind("VmRSS:", 0) == 0) return std::stoull(line.substr(6)) * 1024;
  }
  return 0;
}

// The port number after `marker` in the daemon's log (0 if absent).
int PortAfter(const std::string& log, const std::string& marker) {
  const size_t at = log.find(marker);
  return at == std::string::npos ? 0 : std::atoi(log.c_str() + at + marker.size());
}

// A connection to 127.0.0.1:port with a receive timeout.
int ConnectLoopback(int port) {
  int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(port));
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0) {
    close(fd);
    return -1;
  }
  timeval tv{10, 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  return fd;
}

// Reads until the other end closes (true) or the timeout (false).
bool ReadsToTheEnd(int fd) {
  char buf[4096];
  ssize_t n;
  while ((n = recv(fd, buf, sizeof(buf), 0)) > 0) {
  }
  return n == 0 || (n < 0 && errno == ECONNRESET);
}

// One rank on each of two nodes runs an allreduce; the ranks' exit codes.
std::vector<int> AllreduceOnTwoNodes(Cluster& cluster, const std::string& job) {
  return RunRanks(
      2,
      [&](int rank) {
        auto comm = cluster.Join(job, rank, 2, 1);
        CHILD_CHECK(comm != nullptr, "join");
        return RunOne(*comm, Coll::kAllreduce, DataType::kFloat32, ReduceOp::kSum, 1001, "ar");
      },
      std::chrono::seconds(60));
}

// A trainer names as its job's coordinator a host of its own choosing
// (here a listening socket of the test). The daemon connects there, but
// nothing it sends holds the cluster token: the fake coordinator reads
// every byte of every connection and finds no trace of it, and the job
// fails naming the coordinator.
TEST(MultiNodeSecurityTest, AFakeCoordinatorNeverSeesTheToken) {
  const std::string secret = "correct horse battery staple 0123456789";
  TokenFile token(secret);
  auto daemon = DaemonProcess::Start("cluster_token_file: " + token.path() + "\n");
  ASSERT_NE(daemon, nullptr);
  int port = 0;
  const int listener = ListenLoopback(&port);
  ASSERT_GE(listener, 0);
  const std::string fake = "127.0.0.1:" + std::to_string(port);
  const std::string job = UniqueJobId("fake");
  auto pids = SpawnRanks(1, [&](int) {
    JobOptions o;
    o.socket_path = daemon->socket();
    o.job_id = job;
    o.rank = 1;
    o.world_size = 2;
    o.local_rank = 0;
    o.local_size = 1;
    o.coordinator = fake;
    o.arena_bytes = 16 << 20;
    std::unique_ptr<Communicator> comm;
    Status s = Communicator::Create(o, &comm);
    CHILD_CHECK(s.ok(), "%s", s.ToString().c_str());
    std::vector<float> v(8, 1.0f);
    OpOptions opts;
    opts.timeout_ms = 15000;
    s = comm->Allreduce(v.data(), v.data(), v.size(), DataType::kFloat32, ReduceOp::kSum, opts)
            .Wait();
    CHILD_CHECK(!s.ok() && Contains(s.message(), fake), "%s", s.ToString().c_str());
    return 0;
  });
  // Plays the server's part of the handshake (a challenge), then records
  // whatever comes, on every connection, for 8 seconds.
  std::string seen;
  int connections = 0;
  const auto end = Clock::now() + std::chrono::seconds(8);
  std::vector<int> open;
  while (Clock::now() < end) {
    std::vector<pollfd> fds = {{listener, POLLIN, 0}};
    for (int fd : open) fds.push_back({fd, POLLIN, 0});
    if (poll(fds.data(), fds.size(), 100) <= 0) continue;
    if (fds[0].revents & POLLIN) {
      const int c = accept4(listener, nullptr, nullptr, SOCK_CLOEXEC);
      if (c >= 0) {
        ++connections;
        char hello[40] = {'C', 'I', 'U', 'I', 'C', 'P', 'A', '1'};
        send(c, hello, sizeof(hello), MSG_NOSIGNAL);
        open.push_back(c);
      }
    }
    for (size_t i = 1; i < fds.size(); ++i) {
      if (!(fds[i].revents & (POLLIN | POLLHUP | POLLERR))) continue;
      char buf[4096];
      const ssize_t n = recv(fds[i].fd, buf, sizeof(buf), 0);
      if (n > 0) {
        seen.append(buf, static_cast<size_t>(n));
      } else {
        close(fds[i].fd);
        open.erase(std::find(open.begin(), open.end(), fds[i].fd));
        break;  // fds no longer matches `open`
      }
    }
  }
  for (int fd : open) close(fd);
  close(listener);
  EXPECT_EQ(WaitChild(pids[0], std::chrono::seconds(60)), 0) << daemon->Log();
  EXPECT_GE(connections, 1) << "the daemon never connected to the named coordinator";
  EXPECT_GE(seen.size(), 72u) << "the daemon sent no proof";
  EXPECT_FALSE(Contains(seen, secret)) << "the cluster token crossed the wire";
  EXPECT_FALSE(Contains(seen, secret.substr(0, 12)))
      << "part of the cluster token crossed the wire";
  EXPECT_EQ(daemon->Stop(), 0);
}

// Connections that never prove the token are closed without being read
// as what they claim to be: raw HTTP/2 to the peer service, and 16 MiB
// length prefixes to the ordering listener (which the daemon does not
// allocate). The daemons go on serving a job between them.
TEST(MultiNodeSecurityTest, UnauthenticatedConnectionsAreRefusedAndTheDaemonsServe) {
  TokenFile token("shared secret");
  auto cluster = Cluster::Start(2, "", {token.path(), token.path()});
  ASSERT_NE(cluster, nullptr);
  const std::string log = cluster->nodes[0]->Log();
  const int peer_port = std::atoi(cluster->peers[0].c_str() + cluster->peers[0].rfind(':') + 1);
  const int ordering_port = PortAfter(log, "ordering streams on port ");
  ASSERT_GT(ordering_port, 0) << log;
  const std::string preface =
      std::string("PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n") + std::string(100, '\0');
  int fd = ConnectLoopback(peer_port);
  ASSERT_GE(fd, 0);
  send(fd, preface.data(), preface.size(), MSG_NOSIGNAL);
  EXPECT_TRUE(ReadsToTheEnd(fd)) << "the peer service kept an unauthenticated connection";
  close(fd);
  const pid_t pid = cluster->nodes[0]->pid();
  const uint64_t rss_before = RssBytes(pid);
  std::vector<int> raw;
  for (int i = 0; i < 8; ++i) {
    fd = ConnectLoopback(ordering_port);
    ASSERT_GE(fd, 0);
    std::string prefix("\x00\x00\x00\x01", 4);  // a 16 MiB frame follows, says it
    prefix += std::string(100, '\x01');
    send(fd, prefix.data(), prefix.size(), MSG_NOSIGNAL);
    raw.push_back(fd);
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  const uint64_t rss_after = RssBytes(pid);
  for (int f : raw) {
    EXPECT_TRUE(ReadsToTheEnd(f)) << "the ordering listener kept an unauthenticated connection";
    close(f);
  }
  EXPECT_LT(rss_after, rss_before + (32u << 20))
      << "the daemon grew by " << ((rss_after - rss_before) >> 20) << " MiB";
  const std::vector<int> codes = AllreduceOnTwoNodes(*cluster, UniqueJobId("after-raw"));
  EXPECT_EQ(codes, (std::vector<int>{0, 0})) << cluster->nodes[0]->Log();
  EXPECT_TRUE(Contains(cluster->nodes[0]->Log(), "does not speak the ciuic peer handshake"))
      << cluster->nodes[0]->Log();
  EXPECT_TRUE(cluster->StopAll());
}

// Whether the daemon logs `text` within 5 s (it may log after its sockets
// exist, which is when DaemonProcess::Start returns).
bool LogsSoon(const DaemonProcess& daemon, const std::string& text) {
  for (int i = 0; i < 50; ++i) {
    if (Contains(daemon.Log(), text)) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  return false;
}

// A daemon reachable from other hosts needs a cluster token: without one
// it stops at start with exit code 78 and says what to do, unless
// insecure_no_auth says so (and then it warns).
TEST(MultiNodeSecurityTest, ANonLoopbackListenWithoutATokenStopsTheDaemon) {
  char tmpl[] = "/tmp/ciuic-listen-XXXXXX";
  ASSERT_NE(mkdtemp(tmpl), nullptr);
  const std::string dir = tmpl;
  std::string out;
  const int code = RunCommand(
      std::string(CIUICD_PATH) + " --socket " + dir + "/d.sock --listen 0.0.0.0:0", &out);
  EXPECT_EQ(code, 78) << out;
  EXPECT_TRUE(Contains(out, "listen: 0.0.0.0:0 is reachable from other hosts")) << out;
  EXPECT_TRUE(Contains(out, "cluster_token_file")) << out;
  EXPECT_TRUE(Contains(out, "insecure_no_auth: true")) << out;
  rmdir(dir.c_str());
  auto daemon = DaemonProcess::Start("insecure_no_auth: true\n", {"--listen", "0.0.0.0:0"});
  ASSERT_NE(daemon, nullptr);
  EXPECT_TRUE(LogsSoon(*daemon, "insecure_no_auth")) << daemon->Log();
  EXPECT_EQ(daemon->Stop(), 0);
}

// Node 1's daemon cannot reach node 0's (the job's coordinator): rank 1's
// first allreduce fails with PERMISSION_DENIED whose message holds `word`,
// rank 0's fails too. The ranks' exit codes.
std::vector<int> RefusedAtTheFirstOperation(Cluster& cluster, const std::string& job,
                                            const std::string& word) {
  return RunRanks(
      2,
      [&](int rank) {
        auto comm = cluster.Join(job, rank, 2, 1);
        CHILD_CHECK(comm != nullptr, "join");
        std::vector<float> v(8, 1.0f);
        OpOptions o;
        o.timeout_ms = 3000;
        Status s =
            comm->Allreduce(v.data(), v.data(), v.size(), DataType::kFloat32, ReduceOp::kSum, o)
                .Wait();
        if (rank == 1) {
          CHILD_CHECK(s.code() == StatusCode::kPermissionDenied && Contains(s.message(), word),
                      "%s", s.ToString().c_str());
        } else {
          CHILD_CHECK(!s.ok(), "rank 0 completed without its partner");
        }
        return 0;
      },
      std::chrono::seconds(60));
}

// Two daemons with TLS keys signed by one CA run a job: the allreduce's
// values are right, and the ordering stream ran over its own (TLS) TCP
// connection, not the gRPC fallback.
TEST(MultiNodeSecurityTest, TwoDaemonsWithTlsRunAnAllreduce) {
  std::string error;
  auto certs = ciuic::testing::TestCerts::Make({"node0", "node1"}, &error);
  ASSERT_NE(certs, nullptr) << error;
  TokenFile token("tls cluster secret");
  auto cluster = Cluster::Start(2, "", {token.path(), token.path()},
                                {certs->ConfigOf("node0"), certs->ConfigOf("node1")});
  ASSERT_NE(cluster, nullptr);
  EXPECT_TRUE(Contains(cluster->nodes[0]->Log(), "; TLS with certificates of " + certs->ca()))
      << cluster->nodes[0]->Log();
  auto codes = AllreduceOnTwoNodes(*cluster, UniqueJobId("tls"));
  EXPECT_EQ(codes, (std::vector<int>{0, 0})) << cluster->nodes[0]->Log()
                                             << cluster->nodes[1]->Log();
  EXPECT_FALSE(Contains(cluster->nodes[1]->Log(), "gRPC service instead"))
      << cluster->nodes[1]->Log();
  EXPECT_FALSE(Contains(cluster->nodes[0]->Log(), "refused a connection"))
      << cluster->nodes[0]->Log();
  EXPECT_TRUE(cluster->StopAll());
}

// A daemon with TLS keys and one without cannot form a job: the node's
// trainer hears PERMISSION_DENIED naming TLS, and each daemon's log says
// which side lacks TLS.
TEST(MultiNodeSecurityTest, ADaemonWithTlsAndOneWithoutCannotFormAJob) {
  std::string error;
  auto certs = ciuic::testing::TestCerts::Make({"node0"}, &error);
  ASSERT_NE(certs, nullptr) << error;
  TokenFile token("tls cluster secret");
  auto cluster =
      Cluster::Start(2, "", {token.path(), token.path()}, {certs->ConfigOf("node0"), ""});
  ASSERT_NE(cluster, nullptr);
  EXPECT_EQ(RefusedAtTheFirstOperation(*cluster, UniqueJobId("tlsmix"), "TLS"),
            (std::vector<int>{0, 0}));
  EXPECT_TRUE(Contains(cluster->nodes[0]->Log(), "does not use TLS and this daemon requires it"))
      << cluster->nodes[0]->Log();
  EXPECT_TRUE(Contains(cluster->nodes[0]->Log(), "refused a connection: peer 127.0.0.1:"))
      << cluster->nodes[0]->Log();
  EXPECT_TRUE(Contains(cluster->nodes[1]->Log(), "requires TLS and this daemon has no TLS keys"))
      << cluster->nodes[1]->Log();
  EXPECT_TRUE(cluster->StopAll());
}

// A daemon whose certificate another CA signed cannot join a TLS cluster:
// the coordinator's daemon refuses it and logs its address, the node's
// trainer hears PERMISSION_DENIED naming TLS.
TEST(MultiNodeSecurityTest, ADaemonWithACertificateOfAnotherCaIsRefused) {
  std::string error;
  auto certs = ciuic::testing::TestCerts::Make({"node0"}, &error);
  ASSERT_NE(certs, nullptr) << error;
  TokenFile token("tls cluster secret");
  auto cluster = Cluster::Start(2, "", {token.path(), token.path()},
                                {certs->ConfigOf("node0"), certs->ConfigOf("rogue")});
  ASSERT_NE(cluster, nullptr);
  EXPECT_EQ(RefusedAtTheFirstOperation(*cluster, UniqueJobId("tlsrogue"), "TLS"),
            (std::vector<int>{0, 0}));
  EXPECT_TRUE(Contains(cluster->nodes[0]->Log(), "refused a connection: peer 127.0.0.1:"))
      << cluster->nodes[0]->Log();
  EXPECT_TRUE(Contains(cluster->nodes[0]->Log(), "certificate is refused"))
      << cluster->nodes[0]->Log();
  EXPECT_TRUE(cluster->StopAll());
}

// TLS keys that cannot be used stop the daemon at start (exit 78) naming
// the file.
TEST(MultiNodeSecurityTest, UnusableTlsKeysStopTheDaemonNamingTheFile) {
  std::string error;
  auto certs = ciuic::testing::TestCerts::Make({"node0"}, &error);
  ASSERT_NE(certs, nullptr) << error;
  const std::string config = certs->dir() + "/bad.yaml";
  std::ofstream(config) << "tls_cert_file: " << certs->cert("node0")
                        << "\ntls_key_file: " << certs->dir() << "/missing.key\ntls_ca_file: "
                        << certs->ca() << "\n";
  std::string out;
  const int code = RunCommand(std::string(CIUICD_PATH) + " --config " + config + " --socket " +
                                  certs->dir() + "/d.sock --listen 127.0.0.1:0",
                              &out);
  EXPECT_EQ(code, 78) << out;
  EXPECT_TRUE(Contains(out, "tls_key_file '" + certs->dir() + "/missing.key' cannot be read"))
      << out;
}

// `listen: off`: no TCP port; single-node jobs run, a multi-node job is
// refused at Join saying why.
TEST(MultiNodeSecurityTest, ListenOffRunsSingleNodeJobsOnly) {
  auto daemon = DaemonProcess::Start("", {"--listen", "off"});
  ASSERT_NE(daemon, nullptr);
  EXPECT_TRUE(LogsSoon(*daemon, "listen: off")) << daemon->Log();
  EXPECT_FALSE(Contains(daemon->Log(), "peer service on")) << daemon->Log();
  const std::string job = UniqueJobId("off");
  auto codes = RunRanks(2, [&](int rank) {
    auto comm = JoinJob(daemon->socket(), job, rank, 2);
    CHILD_CHECK(comm != nullptr, "join");
    return RunOne(*comm, Coll::kAllreduce, DataType::kFloat32, ReduceOp::kSum, 1001, "ar");
  });
  EXPECT_EQ(codes, (std::vector<int>{0, 0})) << daemon->Log();
  codes = RunRanks(1, [&](int) {
    JobOptions o;
    o.socket_path = daemon->socket();
    o.job_id = UniqueJobId("off-multi");
    o.rank = 1;
    o.world_size = 2;
    o.local_rank = 0;
    o.local_size = 1;
    o.coordinator = "127.0.0.1:7361";
    std::unique_ptr<Communicator> comm;
    Status s = Communicator::Create(o, &comm);
    CHILD_CHECK(s.code() == StatusCode::kFailedPrecondition && Contains(s.message(), "listen: off"),
                "%s", s.ToString().c_str());
    return 0;
  });
  EXPECT_EQ(codes, (std::vector<int>{0}));
  EXPECT_EQ(daemon->Stop(), 0);
}

// `peers`: a daemon connects only to coordinators in its allow-list. A
// trainer naming another is refused at Join, the error naming the key; one
// in the list forms the job.
TEST(MultiNodeSecurityTest, ThePeersAllowListDecidesWhichCoordinatorsADaemonReaches) {
  TokenFile token("allow-list secret");
  {
    auto cluster =
        Cluster::Start(2, "peers: [10.0.0.0/8, \"fd00::/64\"]\n", {token.path(), token.path()});
    ASSERT_NE(cluster, nullptr);
    const std::string job = UniqueJobId("not-allowed");
    auto codes = RunRanks(1, [&](int) {
      JobOptions o;
      o.socket_path = cluster->nodes[1]->socket();
      o.job_id = job;
      o.rank = 1;
      o.world_size = 2;
      o.local_rank = 0;
      o.local_size = 1;
      o.coordinator = cluster->peers[0];
      std::unique_ptr<Communicator> comm;
      Status s = Communicator::Create(o, &comm);
      CHILD_CHECK(s.code() == StatusCode::kPermissionDenied && Contains(s.message(), "`peers`") &&
                      Contains(s.message(), "127.0.0.1"),
                  "%s", s.ToString().c_str());
      return 0;
    });
    EXPECT_EQ(codes, (std::vector<int>{0}));
    EXPECT_TRUE(cluster->StopAll());
  }
  auto cluster =
      Cluster::Start(2, "peers: \"10.0.0.0/8, 127.0.0.1\"\n", {token.path(), token.path()});
  ASSERT_NE(cluster, nullptr);
  const std::vector<int> codes = AllreduceOnTwoNodes(*cluster, UniqueJobId("allowed"));
  EXPECT_EQ(codes, (std::vector<int>{0, 0})) << cluster->nodes[1]->Log();
  EXPECT_TRUE(cluster->StopAll());
}

// Two "hosts": network namespaces joined by a veth pair, one daemon in each,
// reaching the other only through its veth address. Created and removed by
// the test (root only).
class Namespaces {
 public:
  explicit Namespaces(int n) {
    const std::string tag = std::to_string(getpid() % 100000);
    for (int i = 0; i < n; ++i) names_.push_back("ciuic-t" + tag + "-" + std::to_string(i));
    Cleanup();
    ok_ = Sh("ip netns add " + names_[0]) && Sh("ip netns add " + names_[1]) &&
          // Made in this namespace, then moved: a pair created straight into
          // two namespaces comes up without carrier on this kernel.
          Sh("ip link add cv" + tag + "a type veth peer name cv" + tag + "b") &&
          Sh("ip link set cv" + tag + "a netns " + names_[0]) &&
          Sh("ip link set cv" + tag + "b netns " + names_[1]) &&
          Sh(Exec(0) + "ip addr add 10.77.0.1/24 dev cv" + tag + "a") &&
          Sh(Exec(1) + "ip addr add 10.77.0.2/24 dev cv" + tag + "b") &&
          Sh(Exec(0) + "ip link set cv" + tag + "a up") && Sh(Exec(1) + "ip link set cv" + tag + "b up") &&
          Sh(Exec(0) + "ip link set lo up") && Sh(Exec(1) + "ip link set lo up");
    devices_ = {"cv" + tag + "a", "cv" + tag + "b"};
  }
  ~Namespaces() { Cleanup(); }
  bool ok() const { return ok_; }
  std::vector<std::string> Prefix(int i) const { return {"ip", "netns", "exec", names_[i]}; }
  std::string Exec(int i) const { return "ip netns exec " + names_[i] + " "; }
  const std::string& device(int i) const { return devices_[i]; }
  uint64_t TxBytes(int i) const {
    std::string out;
    RunCommand(Exec(i) + "cat /sys/class/net/" + devices_[i] + "/statistics/tx_bytes", &out);
    return out.empty() ? 0 : std::stoull(out);
  }

 private:
  static bool Sh(const std::string& cmd) {
    std::string out;
    int code = RunCommand(cmd, &out);
    if (code != 0) fprintf(stderr, "%s: %s\n", cmd.c_str(), out.c_str());
    return code == 0;
  }
  void Cleanup() {
    std::string out;
    for (auto& n : names_) RunCommand("ip netns del " + n, &out);  // removes its veth too
  }
  std::vector<std::string> names_;
  std::vector<std::string> devices_;
  bool ok_ = false;
};

TEST(MultiNodeNamespaceTest, TwoHostsJoinedByAVethPair) {
  if (geteuid() != 0) GTEST_SKIP() << "needs root to create network namespaces";
  Namespaces ns(2);
  if (!ns.ok()) GTEST_SKIP() << "could not create network namespaces here (see stderr)";
  std::vector<std::unique_ptr<DaemonProcess>> daemons;
  const std::string peers[2] = {"10.77.0.1:7361", "10.77.0.2:7361"};
  // Non-loopback addresses: the daemons need a cluster token; and each
  // connects only to coordinators on the namespaces' subnet.
  TokenFile token("netns secret");
  for (int i = 0; i < 2; ++i) {
    daemons.push_back(DaemonProcess::StartWith(
        "cluster_token_file: " + token.path() + "\npeers: 10.77.0.0/24\n",
        {"--listen", peers[i], "--node-name", "host" + std::to_string(i)}, ns.Prefix(i),
        {"UCX_TLS=tcp", "UCX_NET_DEVICES=" + ns.device(i), "UCX_WARN_UNUSED_ENV_VARS=n"}));
    ASSERT_NE(daemons.back(), nullptr);
  }
  const uint64_t tx0 = ns.TxBytes(0);
  const std::string job = UniqueJobId("netns");
  auto codes = RunRanks(2, [&](int rank) {
    JobOptions o;
    o.socket_path = daemons[rank]->socket();
    o.job_id = job;
    o.rank = rank;
    o.world_size = 2;
    o.local_rank = 0;
    o.local_size = 1;
    o.coordinator = peers[0];
    o.arena_bytes = 64 << 20;
    std::unique_ptr<Communicator> comm;
    Status s = Communicator::Create(o, &comm);
    CHILD_CHECK(s.ok(), "%s", s.ToString().c_str());
    for (size_t count : {size_t{1}, size_t{1001}, size_t{4} << 20}) {
      if (RunOne(*comm, Coll::kAllreduce, DataType::kFloat32, ReduceOp::kSum, count,
                 "ns" + std::to_string(count)) != 0) {
        return 1;
      }
    }
    if (RunOne(*comm, Coll::kAllgather, DataType::kInt32, ReduceOp::kSum, 5000, "ns-ag") != 0) return 1;
    return 0;
  }, std::chrono::seconds(120));
  EXPECT_EQ(codes, (std::vector<int>{0, 0})) << "host0 log:\n" << daemons[0]->Log()
                                             << "\nhost1 log:\n" << daemons[1]->Log();
  // The 16 MiB allreduce crossed the veth.
  EXPECT_GE(ns.TxBytes(0) - tx0, 8u << 20) << "traffic did not go through the veth";
  // Host 0 hosts rank 0: its daemon coordinates and orders in-process; host
  // 1 orders over TCP to host 0's veth address (not gRPC, not loopback).
  EXPECT_NE(daemons[0]->Log().find("ordering in-process"), std::string::npos) << daemons[0]->Log();
  EXPECT_NE(daemons[1]->Log().find("ordering over TCP to 10.77.0.1 port"), std::string::npos)
      << daemons[1]->Log();
  for (auto& d : daemons) EXPECT_EQ(d->Stop(), 0);
}

}  // namespace
}  // namespace ciuic::testing
