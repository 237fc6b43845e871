// ClusterJob without gRPC or UCX: a real Coordinator reached through a
// CoordinatorClient that calls it directly, and the nodes' transports from
// one InProcessHub. Each node has one local rank whose buffers are plain
// memory.
#include "cluster/cluster_job.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <functional>
#include <future>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <set>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "cluster/coordinator.h"
#include "cluster/membership.h"
#include "collectives/internode/in_process_transport.h"
#include "compression/codec.h"
#include "compression/error_feedback.h"
#include "cuda/device_plan.h"
#include "reduce/half.h"
#include "reduce/reduce.h"
#include "reduce/testing/elements.h"
#include "transport/forwarding_transport.h"

namespace ciuic::daemon {
namespace {

using reduce::testing::GetElement;
using reduce::testing::PutElement;
using reduce::testing::Stored;

using Clock = std::chrono::steady_clock;

// Registers with the Coordinator directly; its streams are the
// coordinator's in-process ones (standing in for gRPC), counted.
class DirectClient final : public CoordinatorClient {
 public:
  DirectClient(Coordinator* c, std::atomic<int>* streams) : c_(c), streams_(streams) {}
  absl::StatusOr<proto::Membership> Register(const proto::RegisterNodeRequest& request,
                                             std::chrono::system_clock::time_point deadline) override {
    return c_->Register(request, Clock::now() + (deadline - std::chrono::system_clock::now()),
                        [this] { return cancelled_.load(); });
  }
  void CancelRegister() override { cancelled_ = true; }
  absl::StatusOr<std::unique_ptr<OrderingStream>> OpenStream(uint32_t /*ordering_port*/) override {
    ++*streams_;
    return c_->OpenLocalStream();
  }

 private:
  Coordinator* const c_;
  std::atomic<int>* const streams_;
  std::atomic<bool> cancelled_{false};
};

class HubUnconnected final : public UnconnectedTransport {
 public:
  explicit HubUnconnected(InProcessHub* hub) : hub_(hub) {}
  std::vector<std::string> Addresses() const override { return {"hub"}; }
  absl::StatusOr<std::unique_ptr<Transport>> Connect(
      int self, const std::vector<std::vector<std::string>>&) override {
    return std::make_unique<ForwardingTransport>(hub_->transport(self));  // the hub outlives the jobs
  }

 private:
  InProcessHub* hub_;
};

// Operation ends, in the order they came.
struct Ends {
  std::mutex mu;
  std::condition_variable cv;
  std::vector<std::pair<uint64_t, absl::Status>> ends;
  std::function<void(uint64_t key)> on_end;  // set: called first, on the ending thread
  bool WaitFor(size_t n) {
    std::unique_lock<std::mutex> lock(mu);
    return cv.wait_for(lock, std::chrono::seconds(30), [&] { return ends.size() >= n; });
  }
};

// `n` nodes (two by default), `per_node` ranks each (node k's: ranks
// k * per_node onwards), their jobs and the coordinator.
class Nodes {
 public:
  // Each node has its own daemon tuning; node 0's daemon hosts the
  // coordinator (rank 0), so its tuning decides the runs' settings.
  // `tuning`: key=value settings of every daemon before the job forms.
  explicit Nodes(int n = 2, int per_node = 1, size_t feedback_bytes = ClusterJob::kFeedbackBytes,
                 const std::vector<std::pair<std::string, std::string>>& tuning = {},
                 uint64_t direct_budget_bytes = ClusterJob::kDirectBudgetBytes)
      : tuning_(n), coordinator_(&tuning_[0]), hub_(n, 1), ends_(n) {
    for (auto& t : tuning_) {
      for (const auto& [key, value] : tuning) EXPECT_TRUE(t.Set(key, value).ok()) << key;
    }
    for (int k = 0; k < n; ++k) {
      ClusterJob::Options o;
      o.job_id = "job";
      o.uid = 1;
      o.world_size = n * per_node;
      for (int i = 0; i < per_node; ++i) o.local_ranks.push_back(k * per_node + i);
      o.node_name = "n" + std::to_string(k);
      o.coordinator = "direct";
      o.channels = 1;
      o.tuning = &tuning_[k];
      o.feedback_bytes = feedback_bytes;
      o.direct_budget_bytes = direct_budget_bytes;
      o.transports = [this](int) -> absl::StatusOr<std::unique_ptr<UnconnectedTransport>> {
        return std::make_unique<HubUnconnected>(&hub_);
      };
      o.coordinator_clients = [this](const std::string&) -> std::unique_ptr<CoordinatorClient> {
        return std::make_unique<DirectClient>(&coordinator_, &client_streams_);
      };
      // Node 0's daemon is the coordinator's: it orders in-process.
      if (k == 0) o.local_coordinator = &coordinator_;
      // The local phase's chunks on the calling thread and one helper, as
      // the engine's worker pool would share them.
      o.parallel = [this](size_t n, const std::function<void(size_t)>& body) {
        std::atomic<size_t> next{0};
        auto work = [&] {
          for (size_t i; (i = next.fetch_add(1)) < n;) {
            {
              std::lock_guard<std::mutex> lock(parallel_mu_);
              parallel_threads_.insert(std::this_thread::get_id());
            }
            body(i);
          }
        };
        ++parallel_calls_;
        std::thread helper(work);
        work();
        helper.join();
      };
      Ends* ends = &ends_[k];
      jobs_.push_back(std::make_unique<ClusterJob>(
          std::move(o),
          [ends](uint64_t key, absl::Status s) {
            if (ends->on_end) ends->on_end(key);
            std::lock_guard<std::mutex> lock(ends->mu);
            ends->ends.emplace_back(key, std::move(s));
            ends->cv.notify_all();
          },
          [](absl::Status) {}));
    }
  }
  ~Nodes() {
    for (auto& j : jobs_) j.reset();
  }
  // Sets a tuning key on every node's daemon.
  absl::Status SetBoth(const std::string& key, const std::string& value) {
    for (auto& t : tuning_) {
      if (absl::Status s = t.Set(key, value); !s.ok()) return s;
    }
    return absl::OkStatus();
  }
  config::TuningRegistry& tuning(int k) { return tuning_[k]; }
  ClusterJob& job(int k) { return *jobs_[k]; }
  // Waits for `count` operation ends on every node; each must be OK.
  void ExpectEndsOk(size_t count) {
    for (size_t k = 0; k < ends_.size(); ++k) {
      ASSERT_TRUE(ends_[k].WaitFor(count)) << "node " << k;
      for (auto& [key, st] : ends_[k].ends) EXPECT_TRUE(st.ok()) << key << ": " << st;
    }
  }
  Ends& ends(int k) { return ends_[k]; }
  InProcessHub& hub() { return hub_; }
  int client_streams() const { return client_streams_.load(); }
  // The local phases that went through Options::parallel, and the threads
  // that ran their chunks.
  int parallel_calls() const { return parallel_calls_.load(); }
  size_t parallel_threads() {
    std::lock_guard<std::mutex> lock(parallel_mu_);
    return parallel_threads_.size();
  }

 private:
  std::atomic<int> parallel_calls_{0};
  std::mutex parallel_mu_;
  std::set<std::thread::id> parallel_threads_;
  std::atomic<int> client_streams_{0};
  std::deque<config::TuningRegistry> tuning_;
  Coordinator coordinator_;
  InProcessHub hub_;
  std::deque<Ends> ends_;
  std::vector<std::unique_ptr<ClusterJob>> jobs_;
};
using TwoNodes = Nodes;

ClusterOp Allreduce(uint64_t key, const std::string& name, wire::DataType t, wire::ReduceOp op,
                    size_t count, int rank, const void* send, void* recv, int32_t priority = 0) {
  ClusterOp c;
  c.key = key;
  c.name = name;
  c.sig.collective = static_cast<uint32_t>(wire::Collective::kAllreduce);
  c.sig.dtype = static_cast<uint32_t>(t);
  c.sig.reduce_op = static_cast<uint32_t>(op);
  c.sig.count = count;
  c.priority = priority;
  c.parts.push_back(ClusterOp::Part{rank, static_cast<const uint8_t*>(send),
                                    static_cast<uint8_t*>(recv)});
  return c;
}

float Value(int rank, size_t op, size_t i) {
  return static_cast<float>(std::sin(0.1 * i + 1.7 * op + 0.9 * rank) * (1 + rank));
}

// Rounds of many float32 allreduces (sum, avg, max; sizes 0..5000),
// submitted in opposite orders on the two nodes: fused with a cycle that
// collects them, then with fusion off. Every result is the plain loop's
// (two nodes: one addition, the lower node's value first), fused results
// are the unfused ones' bits, and the counters say what happened.
// Node 0's daemon is the coordinator's: it orders in-process, node 1 through
// its client's stream; the results are the same, and node 0 leaving through
// its in-process stream still fails node 1's pending operation, naming it.
TEST(ClusterJobTest, TheCoordinatorsOwnNodeOrdersInProcess) {
  TwoNodes nodes;
  const size_t count = 1001;
  std::vector<float> send[2], recv[2];
  for (int k = 0; k < 2; ++k) {
    send[k].resize(count);
    recv[k].assign(count, -1.0f);
    for (size_t i = 0; i < count; ++i) send[k][i] = Value(k, 0, i);
    nodes.job(k).Submit(Allreduce(1, "a", wire::DataType::kFloat32, wire::ReduceOp::kSum, count, k,
                                  send[k].data(), recv[k].data()));
  }
  for (int k = 0; k < 2; ++k) ASSERT_TRUE(nodes.ends(k).WaitFor(1));
  EXPECT_TRUE(nodes.job(0).ordering_in_process());
  EXPECT_FALSE(nodes.job(1).ordering_in_process());
  EXPECT_EQ(nodes.client_streams(), 1);
  for (int k = 0; k < 2; ++k) {
    ASSERT_TRUE(nodes.ends(k).ends[0].second.ok()) << nodes.ends(k).ends[0].second;
    for (size_t i = 0; i < count; ++i) ASSERT_EQ(recv[k][i], send[0][i] + send[1][i]) << i;
  }
  std::vector<float> lonely(count), out(count);
  nodes.job(1).Submit(Allreduce(2, "b", wire::DataType::kFloat32, wire::ReduceOp::kSum, count, 1,
                                lonely.data(), out.data()));
  nodes.job(0).Abort(absl::CancelledError("rank 0 left"));
  ASSERT_TRUE(nodes.ends(1).WaitFor(2));
  const absl::Status& failed = nodes.ends(1).ends[1].second;
  EXPECT_FALSE(failed.ok());
  EXPECT_NE(failed.message().find("n0"), std::string::npos) << failed;
}

TEST(ClusterJobTest, FusedRunsGiveTheUnfusedBitsAndCountThemselves) {
  TwoNodes nodes;
  ASSERT_TRUE(nodes.SetBoth("cycle_time_us", "50000").ok());
  const std::vector<size_t> sizes = {0, 1, 7, 1000, 5003, 1, 333, 4096};
  const wire::ReduceOp ops[] = {wire::ReduceOp::kSum, wire::ReduceOp::kAvg, wire::ReduceOp::kMax};
  const size_t n_ops = sizes.size() * 3;
  std::vector<std::vector<float>> send[2], recv[2][2];
  for (int k = 0; k < 2; ++k) {
    for (size_t o = 0; o < n_ops; ++o) {
      const size_t count = sizes[o % sizes.size()];
      send[k].emplace_back(count);
      for (size_t i = 0; i < count; ++i) send[k][o][i] = Value(k, o, i);
      for (int round = 0; round < 2; ++round) recv[round][k].emplace_back(count, -1.0f);
    }
  }
  for (int round = 0; round < 2; ++round) {
    if (round == 1) ASSERT_TRUE(nodes.SetBoth("fusion_threshold_bytes", "0").ok());
    for (int k = 0; k < 2; ++k) {
      for (size_t j = 0; j < n_ops; ++j) {
        const size_t o = k == 0 ? j : n_ops - 1 - j;
        const auto op = ops[o / sizes.size()];
        nodes.job(k).Submit(Allreduce(round * 1000 + o, "r" + std::to_string(round) + "/" + std::to_string(o),
                                      wire::DataType::kFloat32, op, send[k][o].size(), k,
                                      send[k][o].data(), recv[round][k][o].data()));
      }
    }
    for (int k = 0; k < 2; ++k) {
      ASSERT_TRUE(nodes.ends(k).WaitFor((round + 1) * n_ops)) << "round " << round;
    }
    if (round == 0) {
      for (int k = 0; k < 2; ++k) {
        EXPECT_GT(nodes.job(k).fusion().ops, 0u) << "node " << k;
        EXPECT_GT(nodes.job(k).fusion().ops, nodes.job(k).fusion().runs);
      }
    }
  }
  for (int k = 0; k < 2; ++k) {
    for (auto& [key, status] : nodes.ends(k).ends) EXPECT_TRUE(status.ok()) << key << ": " << status;
    for (size_t o = 0; o < n_ops; ++o) {
      const auto op = ops[o / sizes.size()];
      for (size_t i = 0; i < send[k][o].size(); ++i) {
        const float a = send[0][o][i], b = send[1][o][i];
        float want = op == wire::ReduceOp::kMax ? std::max(a, b) : a + b;
        if (op == wire::ReduceOp::kAvg) want /= 2;
        ASSERT_EQ(recv[0][k][o][i], want) << "fused round, node " << k << " op " << o << " i " << i;
      }
      ASSERT_TRUE(send[k][o].empty() || std::memcmp(recv[0][k][o].data(), recv[1][k][o].data(),
                                                    4 * send[k][o].size()) == 0)
          << "node " << k << " op " << o << ": fused and unfused results differ";
    }
  }
}

// A several-rank allreduce of up to kEarlyLocalMaxBytes that goes through
// the coordinator is reduced locally when it is submitted, before its Run
// comes: 2 nodes x 2 ranks, the first rank of each node in place (the
// early phase overwrites its input), sum, avg and max from 1 element to
// 1 MiB, fused and unfused (the same bits), and a name submitted twice
// before its first Run, whose second occurrence the ClusterJob's thread
// then starts direct from the early phase's buffer. Every result is the
// plain loop's (small integers: exact in any order).
TEST(ClusterJobTest, TheLocalPhaseRunsBeforeTheRunAndGivesThePlainLoopsBits) {
  Nodes nodes(2, 2);
  ASSERT_TRUE(nodes.SetBoth("cycle_time_us", "20000").ok());
  const std::vector<size_t> sizes = {1, 7, 1000, 5003, 65536, 262144};  // 262144: 1 MiB
  const wire::ReduceOp ops[] = {wire::ReduceOp::kSum, wire::ReduceOp::kAvg, wire::ReduceOp::kMax};
  const size_t n_ops = sizes.size() * 3;
  auto value = [](int rank, size_t o, size_t i) {
    return static_cast<float>(static_cast<int>((rank * 7 + o * 5 + i * 3) % 13) - 6);
  };
  auto want = [&](wire::ReduceOp op, size_t o, size_t i) {
    float w = value(0, o, i);
    for (int r = 1; r < 4; ++r) w = op == wire::ReduceOp::kMax ? std::max(w, value(r, o, i)) : w + value(r, o, i);
    return op == wire::ReduceOp::kAvg ? w / 4 : w;
  };
  // [round][rank][op]; rank 0 and 2 in place (their recv is their send).
  std::vector<float> send[2][4][18], recv[2][4][18];
  ASSERT_EQ(n_ops, 18u);
  uint64_t ended = 0;
  for (int round = 0; round < 2; ++round) {
    if (round == 1) ASSERT_TRUE(nodes.SetBoth("fusion_threshold_bytes", "0").ok());
    for (int k = 0; k < 2; ++k) {
      for (size_t j = 0; j < n_ops; ++j) {
        const size_t o = k == 0 ? j : n_ops - 1 - j;
        const size_t count = sizes[o % sizes.size()];
        ClusterOp op = Allreduce(round * 100 + o, "r" + std::to_string(round) + "/" + std::to_string(o),
                                 wire::DataType::kFloat32, ops[o / sizes.size()], count, 2 * k,
                                 nullptr, nullptr);
        op.parts.clear();
        for (int r = 2 * k; r < 2 * k + 2; ++r) {
          auto& in = send[round][r][o];
          auto& out = recv[round][r][o];
          out.resize(count);
          for (size_t i = 0; i < count; ++i) out[i] = value(r, o, i);
          if (r % 2 == 1) in = out;  // apart; the first rank's recv is its send
          const float* from = r % 2 == 1 ? in.data() : out.data();
          op.parts.push_back(ClusterOp::Part{r, reinterpret_cast<const uint8_t*>(from),
                                             reinterpret_cast<uint8_t*>(out.data()), {}, {}});
        }
        nodes.job(k).Submit(std::move(op));
      }
    }
    ended += n_ops;
    nodes.ExpectEndsOk(ended);
  }
  for (int round = 0; round < 2; ++round) {
    for (int r = 0; r < 4; ++r) {
      for (size_t o = 0; o < n_ops; ++o) {
        const auto& got = recv[round][r][o];
        for (size_t i = 0; i < got.size(); ++i) {
          ASSERT_EQ(got[i], want(ops[o / sizes.size()], o, i))
              << "round " << round << " rank " << r << " op " << o << " element " << i;
        }
        ASSERT_EQ(std::memcmp(got.data(), recv[0][r][o].data(), 4 * got.size()), 0)
            << "rank " << r << " op " << o << ": fused and unfused results differ";
      }
    }
  }
  for (int k = 0; k < 2; ++k) {
    EXPECT_GT(nodes.job(k).fusion().ops, 0u) << "node " << k;
    EXPECT_EQ(nodes.job(k).early_local_ops(), 2 * n_ops) << "node " << k;
  }
  // "again" twice, in place, before the first's Run: the second waits in
  // the ClusterJob's queue and starts direct once the first has its slot.
  ASSERT_TRUE(nodes.SetBoth("cycle_time_us", "50000").ok());
  std::vector<float> again[2][4];
  for (int k = 0; k < 2; ++k) {
    for (int time = 0; time < 2; ++time) {
      ClusterOp op = Allreduce(1000 + time, "again", wire::DataType::kFloat32,
                               wire::ReduceOp::kSum, 100, 2 * k, nullptr, nullptr);
      op.parts.clear();
      for (int r = 2 * k; r < 2 * k + 2; ++r) {
        auto& buf = again[time][r];
        buf.assign(100, static_cast<float>(r + 10 * time));
        op.parts.push_back(ClusterOp::Part{r, reinterpret_cast<const uint8_t*>(buf.data()),
                                           reinterpret_cast<uint8_t*>(buf.data()), {}, {}});
      }
      nodes.job(k).Submit(std::move(op));
    }
  }
  nodes.ExpectEndsOk(ended + 2);
  for (int time = 0; time < 2; ++time) {
    for (int r = 0; r < 4; ++r) {
      for (float v : again[time][r]) ASSERT_EQ(v, 6.0f + 40 * time) << "occurrence " << time << " rank " << r;
    }
  }
  for (int k = 0; k < 2; ++k) {
    EXPECT_EQ(nodes.job(k).early_local_ops(), 2 * n_ops + 2) << "node " << k;
    EXPECT_EQ(nodes.job(k).direct_ops(), 1u) << "node " << k;
  }
}

// A run whose early local phase failed (Submit finishes the latch with
// the reason, e.g. out of memory) fails on every node with that reason
// instead of running on a buffer that does not hold the node's value, and
// nothing waits for it forever. The latch is set by hand here: a node of
// one rank takes no early phase of its own, so the preset one is what the
// run finds.
TEST(ClusterJobTest, ARunWhoseEarlyLocalPhaseFailedFailsEverywhere) {
  Nodes nodes(2);
  ASSERT_TRUE(nodes.SetBoth("op_timeout_ms", "20000").ok());
  std::vector<float> send[2], recv[2];
  for (int k = 0; k < 2; ++k) {
    send[k].assign(300000, 1.0f);  // past direct_max_bytes: a run
    recv[k].assign(300000, 0.0f);
    ClusterOp op = Allreduce(1, "x", wire::DataType::kFloat32, wire::ReduceOp::kSum,
                             send[k].size(), k, send[k].data(), recv[k].data());
    if (k == 1) {
      op.early = std::make_shared<EarlyLocal>();
      op.early->Finish(absl::ResourceExhaustedError("no memory for the local phase"));
    }
    nodes.job(k).Submit(std::move(op));
  }
  for (int k = 0; k < 2; ++k) {
    ASSERT_TRUE(nodes.ends(k).WaitFor(1)) << k;
    const absl::Status& s = nodes.ends(k).ends[0].second;
    EXPECT_FALSE(s.ok()) << "node " << k;
    if (k == 1) EXPECT_NE(s.message().find("no memory for the local phase"), std::string::npos) << s;
  }
  EXPECT_EQ(recv[1][0], 0.0f);
}

// The local phase of a node with several ranks reduces in chunks that
// other threads share (Options::parallel): a 3 MiB float32 allreduce and
// reduce_scatter on 2 nodes x 2 ranks, in place and out of place, each
// rank's result the plain loop's; smaller ones stay on the lane's thread.
TEST(ClusterJobTest, TheLocalPhaseSharesItsChunksWithOtherThreads) {
  Nodes nodes(2, 2);
  const size_t count = (3 << 20) / 4;  // 6 chunks of 512 KiB
  auto value = [](int rank, size_t i) {
    return static_cast<float>(static_cast<int>((rank * 5 + i * 3) % 17) - 8);
  };
  // Op 0: allreduce, rank 0 of each node in place; op 1: reduce_scatter of
  // count / 4 per rank; op 2: a small allreduce (one chunk).
  std::vector<std::vector<float>> send(4, std::vector<float>(count)), recv(4), rs(4), small(4);
  for (int r = 0; r < 4; ++r) {
    for (size_t i = 0; i < count; ++i) send[r][i] = value(r, i);
    recv[r] = r % 2 == 0 ? send[r] : std::vector<float>(count, -1.0f);
    rs[r].assign(count / 4, -1.0f);
    small[r].assign(1000, static_cast<float>(r));
  }
  for (int k = 0; k < 2; ++k) {
    ClusterOp all = Allreduce(0, "big", wire::DataType::kFloat32, wire::ReduceOp::kSum, count,
                              2 * k, recv[2 * k].data(), recv[2 * k].data());
    all.parts.push_back(ClusterOp::Part{2 * k + 1,
                                        reinterpret_cast<const uint8_t*>(send[2 * k + 1].data()),
                                        reinterpret_cast<uint8_t*>(recv[2 * k + 1].data())});
    nodes.job(k).Submit(std::move(all));
    ClusterOp scatter = Allreduce(1, "scatter", wire::DataType::kFloat32, wire::ReduceOp::kSum,
                                  count / 4, 2 * k, send[2 * k].data(), rs[2 * k].data());
    scatter.sig.collective = static_cast<uint32_t>(wire::Collective::kReduceScatter);
    scatter.parts.push_back(ClusterOp::Part{
        2 * k + 1, reinterpret_cast<const uint8_t*>(send[2 * k + 1].data()),
        reinterpret_cast<uint8_t*>(rs[2 * k + 1].data())});
    nodes.job(k).Submit(std::move(scatter));
    ClusterOp tiny = Allreduce(2, "small", wire::DataType::kFloat32, wire::ReduceOp::kSum, 1000,
                               2 * k, small[2 * k].data(), small[2 * k].data());
    tiny.parts.push_back(ClusterOp::Part{2 * k + 1,
                                         reinterpret_cast<const uint8_t*>(small[2 * k + 1].data()),
                                         reinterpret_cast<uint8_t*>(small[2 * k + 1].data())});
    nodes.job(k).Submit(std::move(tiny));
  }
  nodes.ExpectEndsOk(3);
  for (int r = 0; r < 4; ++r) {
    for (size_t i = 0; i < count; ++i) {
      const float want = value(0, i) + value(1, i) + value(2, i) + value(3, i);
      ASSERT_EQ(recv[r][i], want) << "allreduce, rank " << r << " element " << i;
    }
    for (size_t i = 0; i < count / 4; ++i) {
      const size_t at = r * (count / 4) + i;
      const float want = value(0, at) + value(1, at) + value(2, at) + value(3, at);
      ASSERT_EQ(rs[r][i], want) << "reduce_scatter, rank " << r << " element " << i;
    }
    for (size_t i = 0; i < 1000; ++i) ASSERT_EQ(small[r][i], 6.0f) << "small, rank " << r;
  }
  // On each node the allreduce's local phase and its fan-out to the other
  // rank (LocalCollective's chunks, RunChunks) and the reduce_scatter's
  // local phase; not the small one.
  EXPECT_EQ(nodes.parallel_calls(), 6);
  EXPECT_GE(nodes.parallel_threads(), 2u);
}

// Unnamed allreduces ("#N") up to the job's direct_max_bytes (64K here)
// run without the coordinator (direct_exchange.h): float32 sum,
// avg and max, sizes 0..16384 elements, and barriers, on 2 and 3 nodes of
// 1 and 2 local ranks, every rank's result the plain loop's (small integer
// values: exact in any order); the counter says they went direct, and one
// over the bound (and a named one) still goes through the coordinator.
TEST(ClusterJobDirectTest, UnnamedSmallOperationsGoDirectAndMatchThePlainLoop) {
  for (const auto& [n, per_node] : {std::pair{2, 1}, {2, 2}, {3, 1}, {3, 2}}) {
    SCOPED_TRACE(testing::Message() << n << " nodes x " << per_node << " ranks");
    Nodes nodes(n, per_node, ClusterJob::kFeedbackBytes, {{"direct_max_bytes", "64K"}});
    const int world = n * per_node;
    const std::vector<size_t> sizes = {0, 1, 7, 1001, 16384, 16385};  // the last: 64K + 4 bytes
    const wire::ReduceOp ops[] = {wire::ReduceOp::kSum, wire::ReduceOp::kAvg, wire::ReduceOp::kMax};
    struct Case {
      size_t count;
      wire::ReduceOp op;
      std::string name;
    };
    std::vector<Case> cases;
    for (wire::ReduceOp op : ops) {
      for (size_t count : sizes) {
        cases.push_back({count, op, "#" + std::to_string(cases.size())});
      }
    }
    cases.push_back({100, wire::ReduceOp::kSum, "named"});
    auto value = [](int rank, size_t c, size_t i) {
      return static_cast<float>(static_cast<int>((rank * 7 + c * 5 + i * 3) % 13) - 6);
    };
    std::vector<std::vector<std::vector<float>>> send(world), recv(world);
    for (int r = 0; r < world; ++r) {
      for (size_t c = 0; c < cases.size(); ++c) {
        send[r].emplace_back(cases[c].count);
        for (size_t i = 0; i < cases[c].count; ++i) send[r][c][i] = value(r, c, i);
        recv[r].emplace_back(cases[c].count, -100.0f);
      }
    }
    for (int k = 0; k < n; ++k) {
      for (size_t c = 0; c < cases.size(); ++c) {
        ClusterOp op = Allreduce(c, cases[c].name, wire::DataType::kFloat32, cases[c].op,
                                 cases[c].count, k * per_node, send[k * per_node][c].data(),
                                 recv[k * per_node][c].data());
        for (int i = 1; i < per_node; ++i) {
          const int r = k * per_node + i;
          op.parts.push_back(ClusterOp::Part{r, reinterpret_cast<const uint8_t*>(send[r][c].data()),
                                             reinterpret_cast<uint8_t*>(recv[r][c].data())});
        }
        nodes.job(k).Submit(std::move(op));
      }
      ClusterOp barrier = Allreduce(1000, "#" + std::to_string(cases.size()),
                                    wire::DataType::kFloat32, wire::ReduceOp::kSum, 0, k * per_node,
                                    nullptr, nullptr);
      barrier.sig.collective = static_cast<uint32_t>(wire::Collective::kBarrier);
      barrier.sig.reduce_op = 0;
      nodes.job(k).Submit(std::move(barrier));
    }
    nodes.ExpectEndsOk(cases.size() + 1);
    for (int r = 0; r < world; ++r) {
      for (size_t c = 0; c < cases.size(); ++c) {
        for (size_t i = 0; i < cases[c].count; ++i) {
          float want = value(0, c, i);
          for (int q = 1; q < world; ++q) {
            want = cases[c].op == wire::ReduceOp::kMax ? std::max(want, value(q, c, i))
                                                       : want + value(q, c, i);
          }
          if (cases[c].op == wire::ReduceOp::kAvg) want /= static_cast<float>(world);
          ASSERT_EQ(recv[r][c][i], want) << "rank " << r << ", " << cases[c].name << " element " << i;
        }
      }
    }
    // Direct: every unnamed case but the three over 64K, and the barrier.
    const uint64_t direct = cases.size() - 1 - 3 + 1;
    for (int k = 0; k < n; ++k) {
      EXPECT_EQ(nodes.job(k).direct_ops(), direct) << "node " << k;
      EXPECT_EQ(nodes.job(k).direct_max_bytes(), 64u << 10);
    }
  }
}

// Direct operations up to 1 MiB (the default direct_max_bytes) on 2 nodes
// of one and of four ranks and on 4 nodes (by halving), some in place: a
// node of one rank sends from its buffer and folds into its recv; a node
// of four reduces in chunks shared with the pool (Options::parallel) and
// writes the other ranks' results with the pool too. Sum and avg against the plain loop, integers so that
// any order of additions gives the same bits.
TEST(ClusterJobDirectTest, DirectOperationsUpToAMegabyteMatchThePlainLoopInPlaceOrNot) {
  for (const auto& [n, per_node] : {std::pair{2, 1}, {2, 4}, {4, 1}}) {
    SCOPED_TRACE(testing::Message() << n << " nodes x " << per_node << " ranks");
    Nodes nodes(n, per_node);
    const int world = n * per_node;
    const std::vector<size_t> counts = {size_t{1} << 18, (size_t{1} << 16) + 3};  // 1 MiB, 256K + 12 B
    const wire::ReduceOp ops[] = {wire::ReduceOp::kSum, wire::ReduceOp::kAvg};
    auto value = [](int rank, size_t c, size_t i) {
      return static_cast<float>(static_cast<int>((rank * 5 + c * 3 + i * 7) % 17) - 8);
    };
    // Even ranks in place: their send is their recv.
    auto in_place = [](int rank) { return rank % 2 == 0; };
    std::vector<std::vector<std::vector<float>>> send(world), recv(world);
    for (int r = 0; r < world; ++r) {
      for (size_t c = 0; c < 4; ++c) {
        const size_t count = counts[c % 2];
        send[r].emplace_back(count);
        for (size_t i = 0; i < count; ++i) send[r][c][i] = value(r, c, i);
        recv[r].emplace_back(count, -100.0f);
      }
    }
    auto buffers = [&](int r, size_t c) {
      float* out = in_place(r) ? send[r][c].data() : recv[r][c].data();
      return ClusterOp::Part{r, reinterpret_cast<const uint8_t*>(send[r][c].data()),
                             reinterpret_cast<uint8_t*>(out)};
    };
    for (int k = 0; k < n; ++k) {
      for (size_t c = 0; c < 4; ++c) {
        const int first = k * per_node;
        ClusterOp op = Allreduce(c, "#" + std::to_string(c), wire::DataType::kFloat32, ops[c / 2],
                                 counts[c % 2], first, nullptr, nullptr);
        op.parts.clear();
        for (int i = 0; i < per_node; ++i) op.parts.push_back(buffers(first + i, c));
        nodes.job(k).Submit(std::move(op));
      }
    }
    nodes.ExpectEndsOk(4);
    for (int r = 0; r < world; ++r) {
      for (size_t c = 0; c < 4; ++c) {
        const std::vector<float>& got = in_place(r) ? send[r][c] : recv[r][c];
        for (size_t i = 0; i < got.size(); ++i) {
          float want = 0;
          for (int q = 0; q < world; ++q) want += value(q, c, i);
          if (ops[c / 2] == wire::ReduceOp::kAvg) want /= static_cast<float>(world);
          ASSERT_EQ(got[i], want) << "rank " << r << ", op " << c << " element " << i;
        }
      }
    }
    for (int k = 0; k < n; ++k) {
      EXPECT_EQ(nodes.job(k).direct_ops(), 4u) << "node " << k;
      EXPECT_EQ(nodes.job(k).direct_max_bytes(), 1u << 20) << "node " << k;
    }
    // Four ranks: the 1 MiB local phases (2 chunks) and every fan-out to
    // three ranks (768K and 3 MiB) through the pool; one rank: neither.
    EXPECT_EQ(nodes.parallel_calls(), per_node == 1 ? 0 : 2 * (2 * 2 + 2 * 1));
  }
}

// A job of a node count that is not a power of two takes direct operations
// of at most 128K whatever the coordinator's direct_max_bytes
// (ClusterJob::DirectBound): its extra nodes' fold-in and hand-back move a
// large value through their partners' links twice more. Alike on every
// node; smaller settings stand.
TEST(ClusterJobDirectTest, OnNodeCountsNotAPowerOfTwoOnlyOperationsUpTo128KGoDirect) {
  EXPECT_EQ(ClusterJob::DirectBound(1 << 20, 2), 1u << 20);
  EXPECT_EQ(ClusterJob::DirectBound(1 << 20, 4), 1u << 20);
  EXPECT_EQ(ClusterJob::DirectBound(1 << 20, 3), 128u << 10);
  EXPECT_EQ(ClusterJob::DirectBound(1 << 20, 6), 128u << 10);
  EXPECT_EQ(ClusterJob::DirectBound(64 << 10, 5), 64u << 10);
  EXPECT_EQ(ClusterJob::DirectBound(0, 4), 0u);
  Nodes nodes(3, 1);  // the default direct_max_bytes: 1M
  const size_t counts[] = {size_t{32} << 10, size_t{64} << 10};  // 128K direct, 256K not
  std::vector<std::vector<std::vector<float>>> send(3), recv(3);
  for (int k = 0; k < 3; ++k) {
    for (size_t c = 0; c < 2; ++c) {
      send[k].emplace_back(counts[c]);
      for (size_t i = 0; i < counts[c]; ++i) send[k][c][i] = static_cast<float>((k + 1) * (i % 9));
      recv[k].emplace_back(counts[c], -1.0f);
      nodes.job(k).Submit(Allreduce(c, "#" + std::to_string(c), wire::DataType::kFloat32,
                                    wire::ReduceOp::kSum, counts[c], k, send[k][c].data(),
                                    recv[k][c].data()));
    }
  }
  nodes.ExpectEndsOk(2);
  for (int k = 0; k < 3; ++k) {
    EXPECT_EQ(nodes.job(k).direct_max_bytes(), 128u << 10) << "node " << k;
    EXPECT_EQ(nodes.job(k).direct_ops(), 1u) << "node " << k;
    for (size_t c = 0; c < 2; ++c) {
      for (size_t i = 0; i < counts[c]; ++i) {
        ASSERT_EQ(recv[k][c][i], static_cast<float>(6 * (i % 9))) << "node " << k << " op " << c;
      }
    }
  }
}

// A direct op whose ranks disagree across nodes (another count, another
// dtype of the same size) fails on every node with INVALID_ARGUMENT naming
// both signatures; the job goes on, and the next operation is right.
TEST(ClusterJobDirectTest, AMismatchFailsEveryNodeAndTheJobGoesOn) {
  Nodes nodes(2);
  std::vector<float> send[2] = {std::vector<float>(6, 1.0f), std::vector<float>(6, 2.0f)};
  std::vector<float> recv[2] = {std::vector<float>(6, 0.0f), std::vector<float>(6, 0.0f)};
  for (int k = 0; k < 2; ++k) {
    nodes.job(k).Submit(Allreduce(0, "#0", wire::DataType::kFloat32, wire::ReduceOp::kSum,
                                  k == 0 ? 4 : 6, k, send[k].data(), recv[k].data()));
    nodes.job(k).Submit(Allreduce(1, "#1", k == 0 ? wire::DataType::kFloat32 : wire::DataType::kInt32,
                                  wire::ReduceOp::kSum, 6, k, send[k].data(), recv[k].data()));
  }
  for (int k = 0; k < 2; ++k) {
    ASSERT_TRUE(nodes.ends(k).WaitFor(2));
    std::lock_guard<std::mutex> lock(nodes.ends(k).mu);
    for (auto& [key, s] : nodes.ends(k).ends) {
      EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << "node " << k << ": " << s;
      EXPECT_NE(s.message().find("mismatched across nodes"), std::string::npos) << s;
      if (key == 1) {
        EXPECT_NE(s.message().find("float32"), std::string::npos) << s;
        EXPECT_NE(s.message().find("int32"), std::string::npos) << s;
      }
    }
  }
  for (int k = 0; k < 2; ++k) {
    nodes.job(k).Submit(Allreduce(2, "#2", wire::DataType::kFloat32, wire::ReduceOp::kSum, 6, k,
                                  send[k].data(), recv[k].data()));
  }
  for (int k = 0; k < 2; ++k) {
    ASSERT_TRUE(nodes.ends(k).WaitFor(3));
    EXPECT_TRUE(nodes.ends(k).ends.back().second.ok()) << nodes.ends(k).ends.back().second;
    EXPECT_EQ(recv[k], std::vector<float>(6, 3.0f));
  }
}

// A direct op that another node never submits ends at its deadline with
// DEADLINE_EXCEEDED naming that node, not later; the job goes on.
TEST(ClusterJobDirectTest, AnOperationMissingOnANodeTimesOutNamingIt) {
  Nodes nodes(2);
  std::vector<float> a(3, 1.0f), out(3, 0.0f), b(3, 2.0f), out_b(3, 0.0f);
  ClusterOp lonely = Allreduce(0, "#0", wire::DataType::kFloat32, wire::ReduceOp::kSum, 3, 0,
                               a.data(), out.data());
  lonely.timeout_ms = 300;
  const auto start = std::chrono::steady_clock::now();
  nodes.job(0).Submit(std::move(lonely));
  ASSERT_TRUE(nodes.ends(0).WaitFor(1));
  const auto took = std::chrono::steady_clock::now() - start;
  EXPECT_GE(took, std::chrono::milliseconds(290));
  EXPECT_LT(took, std::chrono::milliseconds(2000));
  const absl::Status s = nodes.ends(0).ends[0].second;
  EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
  EXPECT_NE(s.message().find("nothing came from node n1"), std::string::npos) << s;
  for (int k = 0; k < 2; ++k) {
    nodes.job(k).Submit(Allreduce(1, "#1", wire::DataType::kFloat32, wire::ReduceOp::kSum, 3, k,
                                  k == 0 ? a.data() : b.data(), k == 0 ? out.data() : out_b.data()));
  }
  ASSERT_TRUE(nodes.ends(0).WaitFor(2));
  ASSERT_TRUE(nodes.ends(1).WaitFor(1));
  EXPECT_TRUE(nodes.ends(0).ends[1].second.ok()) << nodes.ends(0).ends[1].second;
  EXPECT_EQ(out, std::vector<float>(3, 3.0f));
  EXPECT_EQ(out_b, std::vector<float>(3, 3.0f));
}

// An operation that timed out on a node leaves its ranks' buffers alone
// once they have heard: node 1 submits it only after node 0's deadline,
// and what node 1 sends then reaches node 0's exchange, which neither
// folds it into node 0's rank's recv buffer nor writes its result there
// (that buffer holds the rank's next data by then). 3 floats (inline in
// the header) and 2000 floats in place (a value sent apart, which node 0
// sent from its own copy: nothing of the rank's buffers was in flight at
// the deadline, so the job goes on). Node 1 completes it with the values
// both nodes' ranks submitted (node 0's left in its first message).
TEST(ClusterJobDirectTest, AnOperationThatTimedOutNeverWritesItsRanksBuffersAfter) {
  Nodes nodes(2);
  for (size_t count : {size_t{3}, size_t{2000}}) {
    SCOPED_TRACE(count);
    const uint64_t base = count == 3 ? 0 : 10;
    std::vector<float> mine(count, 1.0f), theirs(count, 2.0f), out_b(count, 0.0f);
    ClusterOp lonely = Allreduce(base, "#" + std::to_string(base), wire::DataType::kFloat32,
                                 wire::ReduceOp::kSum, count, 0, mine.data(), mine.data());
    lonely.timeout_ms = 200;
    nodes.job(0).Submit(std::move(lonely));
    ASSERT_TRUE(nodes.ends(0).WaitFor(base == 0 ? 1 : 3));
    EXPECT_EQ(nodes.ends(0).ends.back().second.code(), absl::StatusCode::kDeadlineExceeded)
        << nodes.ends(0).ends.back().second;
    // The rank has heard: its buffer holds something else now.
    std::fill(mine.begin(), mine.end(), 42.0f);
    nodes.job(1).Submit(Allreduce(base, "#" + std::to_string(base), wire::DataType::kFloat32,
                                  wire::ReduceOp::kSum, count, 1, theirs.data(), out_b.data()));
    ASSERT_TRUE(nodes.ends(1).WaitFor(base == 0 ? 1 : 3));
    EXPECT_TRUE(nodes.ends(1).ends.back().second.ok()) << nodes.ends(1).ends.back().second;
    EXPECT_EQ(out_b, std::vector<float>(count, 3.0f));
    EXPECT_EQ(nodes.job(0).state(), ClusterJob::State::kRunning);
    // The job goes on: the next operation on both nodes.
    std::vector<float> a(count, 1.0f), b(count, 2.0f), out_a(count, 0.0f);
    for (int k = 0; k < 2; ++k) {
      nodes.job(k).Submit(Allreduce(
          base + 1, "#" + std::to_string(base + 1), wire::DataType::kFloat32, wire::ReduceOp::kSum,
          count, k, k == 0 ? a.data() : b.data(), k == 0 ? out_a.data() : out_b.data()));
    }
    ASSERT_TRUE(nodes.ends(0).WaitFor(base == 0 ? 2 : 4));
    ASSERT_TRUE(nodes.ends(1).WaitFor(base == 0 ? 2 : 4));
    EXPECT_TRUE(nodes.ends(0).ends.back().second.ok()) << nodes.ends(0).ends.back().second;
    EXPECT_EQ(out_a, std::vector<float>(count, 3.0f));
    EXPECT_EQ(out_b, std::vector<float>(count, 3.0f));
    // The hub delivers in order on one thread: node 1's message for the
    // timed-out operation reached node 0's exchange before its message for
    // the next one, which node 0's next operation waited for.
    EXPECT_EQ(mine, std::vector<float>(count, 42.0f));
  }
}

// A value sent apart straight from a node's single rank's send buffer is
// still in the transport when the operation times out (the other node
// never took it: the hub's sends complete when matched, as a rendezvous
// does), and a transport cannot take a send back. The job ends, saying
// why, and the rank hears of its operation only once the job's failure
// has cut the transfer off (it fails its peers in the transport while it
// sets its state): never while its buffer may still be read.
TEST(ClusterJobDirectTest, ATimeoutWithTheRanksBufferInFlightEndsTheJobBeforeTheRankHears) {
  Nodes nodes(2);
  std::vector<float> mine(2000, 1.0f), out(2000, 0.0f);
  std::atomic<int> state_at_end{-1};
  nodes.ends(0).on_end = [&](uint64_t) { state_at_end = static_cast<int>(nodes.job(0).state()); };
  ClusterOp lonely = Allreduce(0, "#0", wire::DataType::kFloat32, wire::ReduceOp::kSum, mine.size(),
                               0, mine.data(), out.data());
  lonely.timeout_ms = 200;
  nodes.job(0).Submit(std::move(lonely));
  ASSERT_TRUE(nodes.ends(0).WaitFor(1));
  EXPECT_EQ(state_at_end.load(), static_cast<int>(ClusterJob::State::kFailed))
      << "the rank heard while its buffer was in flight";
  EXPECT_NE(nodes.job(0).StateText().find("cannot be taken back, so the job ends"),
            std::string::npos)
      << nodes.job(0).StateText();
  const absl::Status& s = nodes.ends(0).ends[0].second;
  EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
  EXPECT_NE(s.message().find("timed out after 200 ms: nothing came from node n1"),
            std::string::npos)
      << s;
  EXPECT_EQ(out, std::vector<float>(2000, 0.0f));
}

// Direct exchanges hold at most the job's budget of memory at once
// (ClusterJob::kDirectBudgetBytes; three 1001-element exchanges here): node
// 0 submits 40 unnamed allreduces before node 1 submits any, so most of
// them wait, and start in order as earlier ones end. Every result is the
// plain loop's, and every one ran direct.
TEST(ClusterJobDirectTest, OperationsPastTheBudgetWaitTheirTurnInOrder) {
  const size_t count = 1001;
  const uint64_t one = DirectExchange::MemoryBytes(count * sizeof(float));
  Nodes nodes(2, 1, ClusterJob::kFeedbackBytes, {}, 3 * one);
  const size_t ops = 40;
  std::vector<std::vector<float>> send(2 * ops), recv(2 * ops);
  for (int k = 0; k < 2; ++k) {
    for (size_t c = 0; c < ops; ++c) {
      send[k * ops + c].resize(count);
      for (size_t i = 0; i < count; ++i) {
        send[k * ops + c][i] = static_cast<float>(static_cast<int>((k * 7 + c * 5 + i * 3) % 13) - 6);
      }
      recv[k * ops + c].assign(count, -100.0f);
    }
  }
  for (int k = 0; k < 2; ++k) {
    for (size_t c = 0; c < ops; ++c) {
      nodes.job(k).Submit(Allreduce(c, "#" + std::to_string(c), wire::DataType::kFloat32,
                                    wire::ReduceOp::kSum, count, k, send[k * ops + c].data(),
                                    recv[k * ops + c].data()));
    }
    if (k == 0) std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  nodes.ExpectEndsOk(ops);
  for (int k = 0; k < 2; ++k) {
    for (size_t c = 0; c < ops; ++c) {
      for (size_t i = 0; i < count; ++i) {
        ASSERT_EQ(recv[k * ops + c][i], send[c][i] + send[ops + c][i])
            << "node " << k << ", op " << c << ", element " << i;
      }
    }
    EXPECT_EQ(nodes.job(k).direct_ops(), ops) << "node " << k;
  }
  EXPECT_GE(nodes.job(0).direct_waited(), ops - 3);
}

// An operation waiting for the budget ends at its own deadline, saying what
// it waited for: here node 1 never submits, node 0's first exchange times
// out and stays (its transfers cannot be taken back), so the second never
// starts.
TEST(ClusterJobDirectTest, AnOperationWaitingForTheBudgetEndsAtItsDeadline) {
  Nodes nodes(2, 1, ClusterJob::kFeedbackBytes, {}, /*direct_budget_bytes=*/1);
  std::vector<float> a(3, 1.0f), out(3, 0.0f), b(3, 1.0f), out_b(3, 0.0f);
  ClusterOp first = Allreduce(0, "#0", wire::DataType::kFloat32, wire::ReduceOp::kSum, 3, 0,
                              a.data(), out.data());
  first.timeout_ms = 200;
  ClusterOp second = Allreduce(1, "#1", wire::DataType::kFloat32, wire::ReduceOp::kSum, 3, 0,
                               b.data(), out_b.data());
  second.timeout_ms = 400;
  const auto start = std::chrono::steady_clock::now();
  nodes.job(0).Submit(std::move(first));
  nodes.job(0).Submit(std::move(second));
  ASSERT_TRUE(nodes.ends(0).WaitFor(2));
  const auto took = std::chrono::steady_clock::now() - start;
  EXPECT_GE(took, std::chrono::milliseconds(390));
  EXPECT_LT(took, std::chrono::milliseconds(3000));
  const auto& ends = nodes.ends(0).ends;
  EXPECT_EQ(ends[0].first, 0u);
  EXPECT_EQ(ends[0].second.code(), absl::StatusCode::kDeadlineExceeded) << ends[0].second;
  EXPECT_NE(ends[0].second.message().find("nothing came from node n1"), std::string::npos)
      << ends[0].second;
  EXPECT_EQ(ends[1].first, 1u);
  EXPECT_EQ(ends[1].second.code(), absl::StatusCode::kDeadlineExceeded) << ends[1].second;
  EXPECT_NE(ends[1].second.message().find(
                "timed out after 400 ms waiting to start: the job's 1 direct exchanges in flight "
                "hold"),
            std::string::npos)
      << ends[1].second;
  EXPECT_EQ(nodes.job(0).direct_ops(), 1u);
  EXPECT_EQ(nodes.job(0).direct_waited(), 1u);
  EXPECT_EQ(out_b, std::vector<float>(3, 0.0f));
}

// Named operations: the first occurrence of a name goes through the
// coordinator; once it is announced, every later occurrence of that name
// that may run direct does, numbered alike on every node. Four rounds of
// named allreduces (sum, avg, max; 0, 1, 7, 1001 elements, and one over
// direct_max_bytes, 64K here, that always goes through the coordinator) and
// a named barrier, all
// rounds submitted at once and in opposite orders on alternate nodes: the
// later rounds' occurrences wait behind the first one's Run, then run
// direct side by side. Every result is the plain loop's, per round (each
// round's values differ, so occurrences paired wrongly would show).
TEST(ClusterJobDirectTest, NamedOperationsGoDirectOnceTheCoordinatorAnnouncedThem) {
  for (const auto& [n, per_node] : {std::pair{2, 1}, {2, 2}, {3, 1}}) {
    SCOPED_TRACE(testing::Message() << n << " nodes x " << per_node << " ranks");
    Nodes nodes(n, per_node, ClusterJob::kFeedbackBytes, {{"direct_max_bytes", "64K"}});
    const int world = n * per_node;
    struct Case {
      size_t count;
      wire::ReduceOp op;
      std::string name;
    };
    const std::vector<Case> cases = {{0, wire::ReduceOp::kSum, "empty"},
                                     {1, wire::ReduceOp::kSum, "norm"},
                                     {7, wire::ReduceOp::kAvg, "loss"},
                                     {1001, wire::ReduceOp::kMax, "layer.3"},
                                     {16385, wire::ReduceOp::kSum, "big"}};
    const int rounds = 4;
    auto value = [](int rank, int round, size_t c, size_t i) {
      return static_cast<float>(static_cast<int>((rank * 7 + round * 11 + c * 5 + i * 3) % 13) - 6);
    };
    // [round][rank][case]
    std::vector<std::vector<std::vector<std::vector<float>>>> send(rounds), recv(rounds);
    for (int round = 0; round < rounds; ++round) {
      send[round].resize(world);
      recv[round].resize(world);
      for (int r = 0; r < world; ++r) {
        for (size_t c = 0; c < cases.size(); ++c) {
          send[round][r].emplace_back(cases[c].count);
          for (size_t i = 0; i < cases[c].count; ++i) send[round][r][c][i] = value(r, round, c, i);
          recv[round][r].emplace_back(cases[c].count, -100.0f);
        }
      }
    }
    uint64_t key = 0;
    for (int round = 0; round < rounds; ++round) {
      for (int k = 0; k < n; ++k) {
        for (size_t j = 0; j < cases.size(); ++j) {
          const size_t c = k % 2 == 0 ? j : cases.size() - 1 - j;
          ClusterOp op = Allreduce(key + c, cases[c].name, wire::DataType::kFloat32, cases[c].op,
                                   cases[c].count, k * per_node,
                                   send[round][k * per_node][c].data(),
                                   recv[round][k * per_node][c].data());
          for (int i = 1; i < per_node; ++i) {
            const int r = k * per_node + i;
            op.parts.push_back(
                ClusterOp::Part{r, reinterpret_cast<const uint8_t*>(send[round][r][c].data()),
                                reinterpret_cast<uint8_t*>(recv[round][r][c].data())});
          }
          nodes.job(k).Submit(std::move(op));
        }
        ClusterOp barrier = Allreduce(key + cases.size(), "step", wire::DataType::kFloat32,
                                      wire::ReduceOp::kSum, 0, k * per_node, nullptr, nullptr);
        barrier.sig.collective = static_cast<uint32_t>(wire::Collective::kBarrier);
        barrier.sig.reduce_op = 0;
        nodes.job(k).Submit(std::move(barrier));
      }
      key += cases.size() + 1;
    }
    nodes.ExpectEndsOk(rounds * (cases.size() + 1));
    for (int round = 0; round < rounds; ++round) {
      for (int r = 0; r < world; ++r) {
        for (size_t c = 0; c < cases.size(); ++c) {
          for (size_t i = 0; i < cases[c].count; ++i) {
            float want = value(0, round, c, i);
            for (int q = 1; q < world; ++q) {
              want = cases[c].op == wire::ReduceOp::kMax ? std::max(want, value(q, round, c, i))
                                                         : want + value(q, round, c, i);
            }
            if (cases[c].op == wire::ReduceOp::kAvg) want /= static_cast<float>(world);
            ASSERT_EQ(recv[round][r][c][i], want)
                << "round " << round << ", rank " << r << ", " << cases[c].name << " element " << i;
          }
        }
      }
    }
    // Direct: every round after the first, every case but "big", and the
    // barrier.
    const uint64_t direct = (rounds - 1) * cases.size();
    for (int k = 0; k < n; ++k) EXPECT_EQ(nodes.job(k).direct_ops(), direct) << "node " << k;
  }
}

// A named occurrence whose ranks disagree across nodes fails on every node
// with INVALID_ARGUMENT naming both signatures and how named operations
// are matched; the name's next occurrence is right. One that another node
// never submits ends at its deadline naming that node; other names go on.
TEST(ClusterJobDirectTest, ANamedMismatchOrMissingOccurrenceFailsClearly) {
  Nodes nodes(2);
  std::vector<float> send[2] = {std::vector<float>(6, 1.0f), std::vector<float>(6, 2.0f)};
  std::vector<float> recv[2] = {std::vector<float>(6, 0.0f), std::vector<float>(6, 0.0f)};
  auto both = [&](uint64_t key, const std::string& name, size_t count0, size_t count1) {
    for (int k = 0; k < 2; ++k) {
      nodes.job(k).Submit(Allreduce(key, name, wire::DataType::kFloat32, wire::ReduceOp::kSum,
                                    k == 0 ? count0 : count1, k, send[k].data(), recv[k].data()));
    }
  };
  both(0, "x", 6, 6);  // through the coordinator
  nodes.ExpectEndsOk(1);
  both(1, "x", 4, 6);  // direct, mismatched
  for (int k = 0; k < 2; ++k) {
    ASSERT_TRUE(nodes.ends(k).WaitFor(2));
    std::lock_guard<std::mutex> lock(nodes.ends(k).mu);
    const absl::Status s = nodes.ends(k).ends[1].second;
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << "node " << k << ": " << s;
    EXPECT_NE(s.message().find("operation 'x' mismatched across nodes"), std::string::npos) << s;
    EXPECT_NE(s.message().find("count=4"), std::string::npos) << s;
    EXPECT_NE(s.message().find("count=6"), std::string::npos) << s;
    EXPECT_NE(s.message().find("matched by its name and occurrence"), std::string::npos) << s;
  }
  both(2, "x", 6, 6);
  for (int k = 0; k < 2; ++k) {
    ASSERT_TRUE(nodes.ends(k).WaitFor(3));
    EXPECT_TRUE(nodes.ends(k).ends[2].second.ok()) << nodes.ends(k).ends[2].second;
    EXPECT_EQ(recv[k], std::vector<float>(6, 3.0f));
    EXPECT_EQ(nodes.job(k).direct_ops(), 2u);
  }
  ClusterOp lonely = Allreduce(3, "x", wire::DataType::kFloat32, wire::ReduceOp::kSum, 6, 0,
                               send[0].data(), recv[0].data());
  lonely.timeout_ms = 300;
  const auto start = Clock::now();
  nodes.job(0).Submit(std::move(lonely));
  ASSERT_TRUE(nodes.ends(0).WaitFor(4));
  EXPECT_LT(Clock::now() - start, std::chrono::milliseconds(5000));
  const absl::Status late = nodes.ends(0).ends[3].second;
  EXPECT_EQ(late.code(), absl::StatusCode::kDeadlineExceeded) << late;
  EXPECT_NE(late.message().find("nothing came from node n1"), std::string::npos) << late;
  EXPECT_NE(late.message().find("matched by its name and occurrence"), std::string::npos) << late;
  both(4, "y", 6, 6);
  ASSERT_TRUE(nodes.ends(0).WaitFor(5));
  ASSERT_TRUE(nodes.ends(1).WaitFor(4));
  EXPECT_TRUE(nodes.ends(0).ends[4].second.ok()) << nodes.ends(0).ends[4].second;
  EXPECT_TRUE(nodes.ends(1).ends[3].second.ok()) << nodes.ends(1).ends[3].second;
}

// The first kMaxNamedSlots names the coordinator announces get a slot;
// later names always go through the coordinator, alike on every node.
TEST(ClusterJobDirectTest, OnlyTheFirstNamesAnnouncedRunDirect) {
  Nodes nodes(2);
  const size_t names = ClusterJob::kMaxNamedSlots + 3;
  uint64_t key = 0;
  // In batches of at most 1000 (the coordinator takes no more operations
  // at once than the ranks' completion rings hold).
  for (int round = 0; round < 2; ++round) {
    for (size_t first = 0; first < names; first += 1000) {
      const size_t last = std::min(names, first + 1000);
      for (int k = 0; k < 2; ++k) {
        for (size_t i = first; i < last; ++i) {
          ClusterOp barrier = Allreduce(key + i, "b" + std::to_string(i), wire::DataType::kFloat32,
                                        wire::ReduceOp::kSum, 0, k, nullptr, nullptr);
          barrier.sig.collective = static_cast<uint32_t>(wire::Collective::kBarrier);
          barrier.sig.reduce_op = 0;
          nodes.job(k).Submit(std::move(barrier));
        }
      }
      nodes.ExpectEndsOk(key + last);
    }
    key += names;
  }
  for (int k = 0; k < 2; ++k) {
    EXPECT_EQ(nodes.job(k).direct_ops(), ClusterJob::kMaxNamedSlots) << "node " << k;
  }
}

// One deadline per operation (issue 32): the one the engine set when the
// node's ranks submitted it, not a timeout restarted by the ClusterJob. An
// operation whose ranks asked for a minute but that has already waited
// most of it at the engine ends at its deadline, through the direct
// exchange (unnamed) and through the coordinator (named: the Ready carries
// the time left).
TEST(ClusterJobTest, AnOperationEndsAtTheDeadlineTheEngineSet) {
  for (const std::string name : {"#0", "named"}) {
    SCOPED_TRACE(name);
    Nodes nodes(2);
    std::vector<float> a(3, 1.0f), out(3, 0.0f);
    ClusterOp lonely = Allreduce(0, name, wire::DataType::kFloat32, wire::ReduceOp::kSum, 3, 0,
                                 a.data(), out.data());
    lonely.timeout_ms = 60000;
    const auto start = std::chrono::steady_clock::now();
    lonely.deadline = start + std::chrono::milliseconds(300);
    nodes.job(0).Submit(std::move(lonely));
    ASSERT_TRUE(nodes.ends(0).WaitFor(1));
    const auto took = std::chrono::steady_clock::now() - start;
    EXPECT_GE(took, std::chrono::milliseconds(290));
    EXPECT_LT(took, std::chrono::milliseconds(5000));
    const absl::Status s = nodes.ends(0).ends[0].second;
    EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
  }
}

// An operation's own `done` (the engine's: it tells the ranks at once)
// replaces OpDone wherever the operation ends: a direct exchange, a run the
// coordinator announced, a mismatch, the job's end. It is called once, with
// the result already in the ranks' buffers, and OpDone never for it.
TEST(ClusterJobTest, AnOperationsOwnDoneReplacesOpDoneWhereverItEnds) {
  Nodes nodes(2);
  struct Told {
    std::mutex mu;
    std::map<uint64_t, std::vector<absl::Status>> calls;
    std::map<uint64_t, float> first_value;  // recv[0] when told
    std::condition_variable cv;
    size_t count = 0;
  };
  Told told[2];
  enum : uint64_t { kDirect = 1, kRun = 2, kMismatch = 3, kAborted = 4 };
  // By key; kRun: 400 KB, past direct_max_bytes.
  static constexpr size_t counts[] = {0, 100, 100000, 100, 10};
  std::vector<float> send[2][5], recv[2][5];
  for (int k = 0; k < 2; ++k) {
    for (uint64_t key = kDirect; key <= kAborted; ++key) {
      if (key == kAborted && k == 1) continue;  // node 1 never submits it
      send[k][key].assign(counts[key], static_cast<float>(k + 1));
      recv[k][key].assign(counts[key], 0.0f);
      const size_t count = key == kMismatch && k == 1 ? counts[key] - 1 : counts[key];
      const std::string name = key == kDirect ? "#0" : key == kMismatch ? "#1"
                               : key == kRun ? "large" : "lonely";
      ClusterOp op = Allreduce(key, name, wire::DataType::kFloat32, wire::ReduceOp::kSum, count, k,
                               send[k][key].data(), recv[k][key].data());
      op.timeout_ms = 20000;
      op.done = [&t = told[k], key, out = recv[k][key].data()](const absl::Status& s) {
        std::lock_guard<std::mutex> lock(t.mu);
        t.calls[key].push_back(s);
        if (t.calls[key].size() == 1) t.first_value[key] = counts[key] > 0 ? out[0] : 0;
        ++t.count;
        t.cv.notify_all();
      };
      nodes.job(k).Submit(std::move(op));
    }
  }
  auto wait_for = [](Told& t, size_t n) {
    std::unique_lock<std::mutex> lock(t.mu);
    return t.cv.wait_for(lock, std::chrono::seconds(30), [&] { return t.count >= n; });
  };
  ASSERT_TRUE(wait_for(told[1], 3));
  ASSERT_TRUE(wait_for(told[0], 3));
  nodes.job(0).Abort(absl::CancelledError("the trainer left"));
  ASSERT_TRUE(wait_for(told[0], 4));
  std::this_thread::sleep_for(std::chrono::milliseconds(50));  // a second call would show
  for (int k = 0; k < 2; ++k) {
    SCOPED_TRACE(k);
    std::lock_guard<std::mutex> lock(told[k].mu);
    EXPECT_EQ(told[k].count, k == 0 ? 4u : 3u);
    for (uint64_t key : {kDirect, kRun}) {
      ASSERT_EQ(told[k].calls[key].size(), 1u) << key;
      EXPECT_TRUE(told[k].calls[key][0].ok()) << key << ": " << told[k].calls[key][0];
      EXPECT_EQ(told[k].first_value[key], 3.0f) << key << ": the result came after `done`";
      for (float v : recv[k][key]) ASSERT_EQ(v, 3.0f) << key;
    }
    ASSERT_EQ(told[k].calls[kMismatch].size(), 1u);
    EXPECT_EQ(told[k].calls[kMismatch][0].code(), absl::StatusCode::kInvalidArgument)
        << told[k].calls[kMismatch][0];
    EXPECT_TRUE(nodes.ends(k).ends.empty()) << "OpDone was called for an operation with `done`";
  }
  EXPECT_EQ(nodes.job(0).direct_ops(), 2u);  // kDirect and kMismatch
  ASSERT_EQ(told[0].calls[kAborted].size(), 1u);
  EXPECT_EQ(told[0].calls[kAborted][0].code(), absl::StatusCode::kCancelled)
      << told[0].calls[kAborted][0];
}

// Direct ops that time out one after another (their exchanges stay,
// waiting): kMaxStaleExchanges of them end the job, naming why, so that a
// trainer cannot make the daemon hold ever more memory.
TEST(ClusterJobDirectTest, TimedOutExchangesPilingUpEndTheJob) {
  Nodes nodes(2);
  std::vector<float> a(4, 1.0f), out(4, 0.0f);
  const int n = ClusterJob::kMaxStaleExchanges;
  for (int i = 0; i < n; ++i) {
    ClusterOp lonely = Allreduce(i, "#" + std::to_string(i), wire::DataType::kFloat32,
                                 wire::ReduceOp::kSum, 4, 0, a.data(), out.data());
    lonely.timeout_ms = 100;
    nodes.job(0).Submit(std::move(lonely));
    if (i == n - 2) {
      ASSERT_TRUE(nodes.ends(0).WaitFor(n - 1));
      EXPECT_EQ(nodes.job(0).state(), ClusterJob::State::kRunning);  // one short of the bound
    }
  }
  ASSERT_TRUE(nodes.ends(0).WaitFor(n));
  for (auto& [key, s] : nodes.ends(0).ends) {
    EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
  }
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (nodes.job(0).state() != ClusterJob::State::kFailed &&
         std::chrono::steady_clock::now() < until) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_EQ(nodes.job(0).state(), ClusterJob::State::kFailed);
  EXPECT_NE(nodes.job(0).StateText().find("out of step"), std::string::npos)
      << nodes.job(0).StateText();
}

// direct_max_bytes 0 on the coordinator's daemon: every operation goes
// through the coordinator, results unchanged.
TEST(ClusterJobDirectTest, DirectMaxBytesZeroOrdersEverythingAtTheCoordinator) {
  Nodes nodes(2, 1, ClusterJob::kFeedbackBytes, {{"direct_max_bytes", "0"}});
  std::vector<float> send[2] = {std::vector<float>(5, 1.5f), std::vector<float>(5, 2.0f)};
  std::vector<float> recv[2] = {std::vector<float>(5, 0.0f), std::vector<float>(5, 0.0f)};
  for (int k = 0; k < 2; ++k) {
    nodes.job(k).Submit(Allreduce(0, "#0", wire::DataType::kFloat32, wire::ReduceOp::kSum, 5, k,
                                  send[k].data(), recv[k].data()));
  }
  nodes.ExpectEndsOk(1);
  for (int k = 0; k < 2; ++k) {
    EXPECT_EQ(recv[k], std::vector<float>(5, 3.5f));
    EXPECT_EQ(nodes.job(k).direct_ops(), 0u);
  }
}

// Compressed allreduces fuse too (int8, fp16): many of them, of sizes over
// min_compress_bytes, sum and avg, submitted in opposite orders on the two
// nodes, beside small and max ones that go uncompressed. Compressed results
// are within the codec's bound of the float64 sum and the same bits on both
// nodes; uncompressed ones are exact (had one been packed with compressed
// ones, it would not be, and the node would refuse the run); both kinds
// fuse (counted).
// 0-element operations of every copying collective, with no buffers at all
// (nullptr, as an empty tensor's data pointer may be): each ends OK without
// touching memory (under UBSan: no memcpy gets a null pointer).
TEST(ClusterJobTest, ZeroElementOperationsWithoutBuffersEndOk) {
  Nodes nodes(2);
  const wire::Collective collectives[] = {
      wire::Collective::kAllreduce, wire::Collective::kReduceScatter, wire::Collective::kAllgather,
      wire::Collective::kBroadcast};
  for (int k = 0; k < 2; ++k) {
    uint64_t key = 0;
    for (const wire::Collective c : collectives) {
      ClusterOp op = Allreduce(key, "z" + std::to_string(key), wire::DataType::kFloat32,
                               wire::ReduceOp::kSum, 0, k, nullptr, nullptr);
      op.sig.collective = static_cast<uint32_t>(c);
      nodes.job(k).Submit(std::move(op));
      ++key;
    }
  }
  nodes.ExpectEndsOk(std::size(collectives));
}

TEST(ClusterJobTest, FusedCompressedRunsWithinTheBoundNeverMixedWithUncompressed) {
  for (const char* codec : {"int8", "fp16"}) {
    SCOPED_TRACE(codec);
    TwoNodes nodes;
    ASSERT_TRUE(nodes.SetBoth("cycle_time_us", "50000").ok());
    ASSERT_TRUE(nodes.SetBoth("compression", codec).ok());
    ASSERT_TRUE(nodes.SetBoth("min_compress_bytes", "1K").ok());
    {
      // Compressed ones alone first: they fuse (not only the uncompressed).
      std::vector<float> d[2][6];
      for (int k = 0; k < 2; ++k) {
        for (int o = 0; o < 6; ++o) {
          d[k][o].assign(300 + 100 * o, static_cast<float>(k + 1));
          nodes.job(k).Submit(Allreduce(500 + o, "pre/" + std::to_string(o),
                                        wire::DataType::kFloat32, wire::ReduceOp::kSum,
                                        d[k][o].size(), k, d[k][o].data(), d[k][o].data()));
        }
      }
      for (int k = 0; k < 2; ++k) {
        ASSERT_TRUE(nodes.ends(k).WaitFor(6));
        EXPECT_EQ(nodes.job(k).compression().ops, 6u) << "node " << k;
        EXPECT_GT(nodes.job(k).fusion().ops, nodes.job(k).fusion().runs) << "node " << k;
        for (int o = 0; o < 6; ++o) {
          for (float v : d[k][o]) ASSERT_NEAR(v, 3.0f, 6.0 / 254) << "node " << k << " op " << o;
        }
      }
      for (int k = 0; k < 2; ++k) nodes.ends(k).ends.clear();
    }
    // >= 256 elements: compressed (sum, avg); fewer, or max: uncompressed.
    const std::vector<size_t> sizes = {300, 1000, 5003, 2048, 1, 7, 100, 777};
    const wire::ReduceOp ops[] = {wire::ReduceOp::kSum, wire::ReduceOp::kAvg,
                                  wire::ReduceOp::kMax};
    const size_t n_ops = sizes.size() * 3;
    std::vector<std::vector<float>> send[2], recv[2];
    for (int k = 0; k < 2; ++k) {
      for (size_t o = 0; o < n_ops; ++o) {
        const size_t count = sizes[o % sizes.size()];
        send[k].emplace_back(count);
        for (size_t i = 0; i < count; ++i) send[k][o][i] = Value(k, o, i);
        recv[k].emplace_back(count, -1.0f);
      }
    }
    for (int k = 0; k < 2; ++k) {
      for (size_t j = 0; j < n_ops; ++j) {
        const size_t o = k == 0 ? j : n_ops - 1 - j;
        nodes.job(k).Submit(Allreduce(o, "c/" + std::to_string(o), wire::DataType::kFloat32,
                                      ops[o / sizes.size()], send[k][o].size(), k,
                                      send[k][o].data(), recv[k][o].data()));
      }
    }
    for (int k = 0; k < 2; ++k) ASSERT_TRUE(nodes.ends(k).WaitFor(n_ops));
    for (int k = 0; k < 2; ++k) {
      for (auto& [key, status] : nodes.ends(k).ends) {
        EXPECT_TRUE(status.ok()) << key << ": " << status;
      }
      EXPECT_GT(nodes.job(k).fusion().ops, nodes.job(k).fusion().runs) << "node " << k;
      EXPECT_GT(nodes.job(k).compression().ops, 0u) << "node " << k;
    }
    size_t compressed_inexact = 0;
    for (size_t o = 0; o < n_ops; ++o) {
      const auto op = ops[o / sizes.size()];
      const bool compressed = op != wire::ReduceOp::kMax && sizes[o % sizes.size()] >= 256;
      const double scale = op == wire::ReduceOp::kAvg ? 0.5 : 1.0;
      ASSERT_EQ(recv[0][o], recv[1][o]) << "op " << o << ": the nodes differ";
      for (size_t i = 0; i < sizes[o % sizes.size()]; ++i) {
        const float a = send[0][o][i], b = send[1][o][i];
        if (!compressed) {
          float want = op == wire::ReduceOp::kMax ? std::max(a, b) : a + b;
          if (op == wire::ReduceOp::kAvg) want /= 2;
          ASSERT_EQ(recv[0][o][i], want) << "uncompressed op " << o << " i " << i;
          continue;
        }
        const double exact = (double{a} + double{b}) * scale;
        const double err = std::abs(recv[0][o][i] - exact);
        // |x_0| <= 1, |x_1| <= 2, |s| <= 3 (Value), whatever the op is packed with.
        const double bound = std::string(codec) == "int8"
                                 ? 6.0 / 254 * 1.001 * scale
                                 : (0x1p-11 * (std::abs(a) + std::abs(b) + std::abs(a + b)) +
                                    2 * 0x1p-25 + 3 * 0x1p-24 * 6) * scale;
        ASSERT_LE(err, bound) << "compressed op " << o << " i " << i;
        if (err > 0) ++compressed_inexact;
      }
    }
    EXPECT_GT(compressed_inexact, 0u) << "nothing was compressed";
  }
}

TEST(ClusterJobTest, FusionOffCountsNothing) {
  TwoNodes nodes;
  ASSERT_TRUE(nodes.SetBoth("cycle_time_us", "50000").ok());
  ASSERT_TRUE(nodes.SetBoth("fusion_threshold_bytes", "0").ok());
  std::vector<float> data[2][10];
  for (int k = 0; k < 2; ++k) {
    for (int o = 0; o < 10; ++o) {
      data[k][o].assign(100, static_cast<float>(k + o));
      nodes.job(k).Submit(Allreduce(o, "x" + std::to_string(o), wire::DataType::kFloat32,
                                    wire::ReduceOp::kSum, 100, k, data[k][o].data(),
                                    data[k][o].data()));
    }
  }
  for (int k = 0; k < 2; ++k) {
    ASSERT_TRUE(nodes.ends(k).WaitFor(10));
    EXPECT_EQ(nodes.job(k).fusion().ops, 0u);
    for (int o = 0; o < 10; ++o) EXPECT_EQ(data[k][o][99], static_cast<float>(2 * o + 1));
  }
}

// The settings that both nodes must apply alike come from the coordinator's
// daemon (node 0 here): node 1's own chunk size, algorithm and compression
// differ wildly and change nothing. A live change on node 0 applies to both
// nodes from the next run. (Before, each node cut and encoded with its own
// tuning, so with these settings their messages could not match.)
TEST(ClusterJobTest, RunSettingsComeFromTheCoordinatorsDaemon) {
  TwoNodes nodes;
  ASSERT_TRUE(nodes.tuning(1).Set("chunk_bytes", "4K").ok());
  ASSERT_TRUE(nodes.tuning(1).Set("chunks_in_flight", "1").ok());
  ASSERT_TRUE(nodes.tuning(1).Set("algorithm", "halving_doubling").ok());
  ASSERT_TRUE(nodes.tuning(1).Set("compression", "int8").ok());
  ASSERT_TRUE(nodes.tuning(1).Set("min_compress_bytes", "0").ok());
  ASSERT_TRUE(nodes.tuning(0).Set("chunk_bytes", "64K").ok());
  ASSERT_TRUE(nodes.tuning(0).Set("algorithm", "ring").ok());
  const size_t sizes[] = {1, 4099, 300000};
  std::vector<float> data[2][3];
  uint64_t key = 0;
  for (int k = 0; k < 2; ++k) {
    for (int o = 0; o < 3; ++o) {
      data[k][o].resize(sizes[o]);
      for (size_t i = 0; i < sizes[o]; ++i) data[k][o][i] = Value(k, o, i);
    }
  }
  for (int o = 0; o < 3; ++o, ++key) {
    for (int k = 0; k < 2; ++k) {
      nodes.job(k).Submit(Allreduce(key, "exact" + std::to_string(o), wire::DataType::kFloat32,
                                    wire::ReduceOp::kSum, sizes[o], k, data[k][o].data(),
                                    data[k][o].data()));
    }
  }
  for (int k = 0; k < 2; ++k) {
    ASSERT_TRUE(nodes.ends(k).WaitFor(3));
    for (auto& [end_key, status] : nodes.ends(k).ends) EXPECT_TRUE(status.ok()) << status;
    EXPECT_EQ(nodes.job(k).compression().ops, 0u) << "node " << k << " compressed";
    for (int o = 0; o < 3; ++o) {
      for (size_t i = 0; i < sizes[o]; ++i) {
        ASSERT_EQ(data[k][o][i], Value(0, o, i) + Value(1, o, i)) << "node " << k << " op " << o;
      }
    }
  }
  // Live, on the coordinator's daemon only: both nodes now send fp16.
  ASSERT_TRUE(nodes.tuning(0).Set("compression", "fp16").ok());
  ASSERT_TRUE(nodes.tuning(0).Set("min_compress_bytes", "0").ok());
  std::vector<float> half[2];
  for (int k = 0; k < 2; ++k) {
    half[k].resize(300000);
    for (size_t i = 0; i < half[k].size(); ++i) half[k][i] = Value(k, 7, i);
    nodes.job(k).Submit(Allreduce(key, "fp16", wire::DataType::kFloat32, wire::ReduceOp::kSum,
                                  half[k].size(), k, half[k].data(), half[k].data()));
  }
  for (int k = 0; k < 2; ++k) {
    ASSERT_TRUE(nodes.ends(k).WaitFor(4));
    EXPECT_TRUE(nodes.ends(k).ends[3].second.ok()) << nodes.ends(k).ends[3].second;
    EXPECT_EQ(nodes.job(k).compression().ops, 1u) << "node " << k;
    double worst = 0;
    for (size_t i = 0; i < half[k].size(); ++i) {
      const double exact = static_cast<double>(Value(0, 7, i)) + Value(1, 7, i);
      worst = std::max(worst, std::abs(half[k][i] - exact));
    }
    // fp16 keeps 11 significant bits of values below 3 in magnitude.
    EXPECT_LT(worst, 3.0 / 1024) << "node " << k;
    EXPECT_GT(worst, 0.0) << "node " << k << ": nothing was lost, so nothing was compressed";
  }
}

// Submits `large` (low priority) on both nodes, then, 5 ms later, a small
// allreduce of 64 floats at priority 9, and waits for both ends on both
// nodes: the small one must end first everywhere, both OK, the small sum
// right. `large[k]` is node k's buffer (in place).
void LargeThenSmallUrgent(TwoNodes& nodes, std::vector<float> (&large)[2]) {
  std::vector<float> small[2];
  for (int k = 0; k < 2; ++k) small[k].assign(64, static_cast<float>(10 * (k + 1)));
  // The large run's chunks stay undelivered until the small run has ended
  // (its 256 bytes pass): a small run queued behind the large one would
  // never end, whatever the machine's load.
  nodes.hub().HoldTransfersOver(4096);
  for (int k = 0; k < 2; ++k) {
    nodes.job(k).Submit(Allreduce(1, "large", wire::DataType::kFloat32, wire::ReduceOp::kSum,
                                  large[k].size(), k, large[k].data(), large[k].data(), 0));
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(5));
  for (int k = 0; k < 2; ++k) {
    nodes.job(k).Submit(Allreduce(2, "small", wire::DataType::kFloat32, wire::ReduceOp::kSum, 64,
                                  k, small[k].data(), small[k].data(), 9));
  }
  for (int k = 0; k < 2; ++k) {
    const bool ended = nodes.ends(k).WaitFor(1);
    if (!ended) nodes.hub().ReleaseHeld();  // the large run ends before the nodes go
    ASSERT_TRUE(ended) << "node " << k << ": the small run did not end beside the held large one";
    std::lock_guard<std::mutex> lock(nodes.ends(k).mu);
    EXPECT_EQ(nodes.ends(k).ends[0].first, 2u) << "node " << k;
  }
  nodes.hub().ReleaseHeld();
  for (int k = 0; k < 2; ++k) {
    ASSERT_TRUE(nodes.ends(k).WaitFor(2));
    const auto& ends = nodes.ends(k).ends;
    EXPECT_EQ(ends[0].first, 2u) << "node " << k << ": the small run ended after the large one";
    for (auto& [key, status] : ends) EXPECT_TRUE(status.ok()) << status;
    EXPECT_EQ(small[k][63], 30.0f);
  }
}

// A large low-priority allreduce, then a small high-priority one: the
// small one ends first on both nodes (it runs in the other lane), and both
// results are right.
TEST(ClusterJobTest, SmallUrgentRunEndsBeforeALargeOneAnnouncedFirst) {
  TwoNodes nodes;
  ASSERT_TRUE(nodes.SetBoth("chunk_bytes", "256K").ok());
  const size_t big = 24u << 20;  // 96 MiB of float32
  std::vector<float> large[2];
  for (int k = 0; k < 2; ++k) large[k].assign(big, static_cast<float>(k + 1));
  LargeThenSmallUrgent(nodes, large);
  for (int k = 0; k < 2; ++k) {
    EXPECT_EQ(large[k][big - 1], 3.0f);
    EXPECT_EQ(large[k][0], 3.0f);
  }
}

// The same with the large operation compressed (int8, the pipelined
// compressed allreduce, which yields while the urgent one runs) and the
// small one under min_compress_bytes (uncompressed): the small one ends
// first on both nodes, the large one within int8's bound.
TEST(ClusterJobTest, SmallUrgentRunEndsBeforeALargeCompressedOneAnnouncedFirst) {
  TwoNodes nodes;
  ASSERT_TRUE(nodes.SetBoth("chunk_bytes", "256K").ok());
  ASSERT_TRUE(nodes.SetBoth("compression", "int8").ok());
  ASSERT_TRUE(nodes.SetBoth("min_compress_bytes", "4K").ok());
  const size_t big = 24u << 20;  // 96 MiB of float32
  std::vector<float> large[2];
  for (int k = 0; k < 2; ++k) {
    large[k].resize(big);
    for (size_t i = 0; i < big; ++i) large[k][i] = Value(k, 0, i % 4099);
  }
  LargeThenSmallUrgent(nodes, large);
  for (int k = 0; k < 2; ++k) {
    EXPECT_EQ(nodes.job(k).compression().ops, 1u) << "node " << k;
  }
  // int8: |result - sum| <= (max|x_0| + max|x_1| + max|sum|) / 254 (+ rounding);
  // the inputs' magnitudes are at most 1 and 2, so 6/254 bounds it.
  double worst = 0;
  for (size_t i = 0; i < big; i += 7) {
    const double exact = double{Value(0, 0, i % 4099)} + double{Value(1, 0, i % 4099)};
    worst = std::max(worst, std::abs(double{large[0][i]} - exact));
  }
  EXPECT_LE(worst, 6.0 / 254 * 1.001);
  EXPECT_GT(worst, 0.0) << "int8 was not applied";
  EXPECT_EQ(0, std::memcmp(large[0].data(), large[1].data(), big * sizeof(float)));
}

// An operation whose residual alone would be over the job's error feedback
// cap is compressed without error feedback and counted (once per step);
// one that fits keeps its residual, and one that has grown past it loses
// the residual it had when smaller; alone and fused together alike. Same
// inputs twice: without a residual the second result is the first one's
// bits (alone: fused, the packing may change), with one it is not (what
// the first step dropped is added back), and both stay within int8's bound.
class FeedbackCapTest : public ::testing::TestWithParam<bool> {};

TEST_P(FeedbackCapTest, AnOperationOverTheCapRunsWithoutItAndIsCounted) {
  const bool fused = GetParam();
  const size_t small = 4000, big = 20000;  // 16 000 and 80 000 bytes of residual
  // Compression on before the job forms (so no repeated name runs direct).
  Nodes nodes(2, 1, 64 << 10, {{"compression", "int8"}, {"min_compress_bytes", "1K"}});
  // Fused: held long enough to be ordered together.
  ASSERT_TRUE(
      nodes.SetBoth(fused ? "cycle_time_us" : "fusion_threshold_bytes", fused ? "50000" : "0")
          .ok());
  const size_t counts[2] = {small, big};
  std::vector<float> send[2][2], recv[2][2][2];  // [node][op], recv[step][node][op]
  for (int k = 0; k < 2; ++k) {
    for (int o = 0; o < 2; ++o) {
      send[k][o].resize(counts[o]);
      for (size_t i = 0; i < counts[o]; ++i) send[k][o][i] = Value(k, o, i);
    }
  }
  // "big" small first: its residual, kept then, goes once it has grown.
  std::vector<float> early[2];
  for (int k = 0; k < 2; ++k) {
    early[k].assign(1000, 1.0f);
    nodes.job(k).Submit(Allreduce(99, "big", wire::DataType::kFloat32, wire::ReduceOp::kSum,
                                  early[k].size(), k, early[k].data(), early[k].data()));
  }
  for (int k = 0; k < 2; ++k) ASSERT_TRUE(nodes.ends(k).WaitFor(1));
  EXPECT_EQ(nodes.job(0).feedback().host.names, 1u);
  for (int k = 0; k < 2; ++k) nodes.ends(k).ends.clear();
  for (int step = 0; step < 2; ++step) {
    for (int k = 0; k < 2; ++k) {
      for (int o = 0; o < 2; ++o) {
        recv[step][k][o].assign(counts[o], 0.0f);
        nodes.job(k).Submit(Allreduce(step * 2 + o, o == 0 ? "small" : "big",
                                      wire::DataType::kFloat32, wire::ReduceOp::kSum, counts[o], k,
                                      send[k][o].data(), recv[step][k][o].data()));
      }
    }
    for (int k = 0; k < 2; ++k) ASSERT_TRUE(nodes.ends(k).WaitFor(2 * (step + 1)));
  }
  for (int k = 0; k < 2; ++k) {
    for (auto& [key, st] : nodes.ends(k).ends) EXPECT_TRUE(st.ok()) << key << ": " << st;
    EXPECT_EQ(nodes.job(k).compression().ops, 5u) << "node " << k;
    EXPECT_EQ(nodes.job(k).fusion().ops, fused ? 4u : 0u) << "node " << k;
    const ClusterJob::FeedbackCounters f = nodes.job(k).feedback();
    EXPECT_EQ(f.too_large_ops, 2u) << "node " << k;
    EXPECT_EQ(f.host.names, 1u) << "node " << k;
    EXPECT_EQ(f.host.bytes, small * sizeof(float)) << "node " << k;
    EXPECT_EQ(f.host.evictions + f.host.size_resets + f.host.too_large, 0u) << "node " << k;
  }
  for (int o = 0; o < 2; ++o) {
    double max_exact = 0;
    for (size_t i = 0; i < counts[o]; ++i) {
      max_exact = std::max(max_exact, std::fabs(double{Value(0, o, i)} + Value(1, o, i)));
    }
    for (int step = 0; step < 2; ++step) {
      ASSERT_EQ(recv[step][0][o], recv[step][1][o]) << "op " << o << ": the nodes differ";
      for (size_t i = 0; i < counts[o]; ++i) {
        const double exact = double{Value(0, o, i)} + Value(1, o, i);
        ASSERT_NEAR(recv[step][0][o][i], exact, 3 * max_exact / 254) << "op " << o << " " << i;
      }
    }
  }
  if (!fused) {
    EXPECT_NE(recv[0][0][0], recv[1][0][0]) << "small: the residual changed nothing";
    EXPECT_EQ(recv[0][0][1], recv[1][0][1]) << "big: a residual was applied";
  }
}

INSTANTIATE_TEST_SUITE_P(AloneAndFused, FeedbackCapTest, ::testing::Bool(),
                         [](const ::testing::TestParamInfo<bool>& i) {
                           return i.param ? "Fused" : "Alone";
                         });

// ---------------------------------------------------------------- staged

// A StagedNodeBuffer over plain memory, standing in for a GPU: its "device"
// is a thread that runs what is enqueued in order, so the lane really
// overlaps copies with transfers. Records the order of the calls (F<k> for
// the fetch of byte offset k's segment, S<k> for its store) and can fail a
// fetch on the device, as an asynchronous fault would.
class HostStagedBuffer final : public StagedNodeBuffer {
 public:
  // An allreduce's: the node buffer is the (one) rank's output.
  HostStagedBuffer(wire::DataType dtype, size_t count, std::vector<const void*> inputs,
                   std::vector<void*> outputs)
      : HostStagedBuffer(dtype, count, std::move(inputs), std::move(outputs), {0},
                         count * wire::DataTypeSize(static_cast<uint32_t>(dtype))) {}
  // A node buffer of `count` elements of its own; output r gets
  // `output_bytes` bytes from `output_offsets[r]` (a reduce_scatter's
  // blocks).
  HostStagedBuffer(wire::DataType dtype, size_t count, std::vector<const void*> inputs,
                   std::vector<void*> outputs, std::vector<size_t> output_offsets,
                   size_t output_bytes)
      : dtype_(dtype),
        count_(count),
        bytes_(count * wire::DataTypeSize(static_cast<uint32_t>(dtype))),
        inputs_(std::move(inputs)),
        outputs_(std::move(outputs)),
        output_offsets_(std::move(output_offsets)),
        output_bytes_(output_bytes),
        node_(bytes_ + 1),
        device_([this] { DeviceLoop(); }) {}
  ~HostStagedBuffer() override {
    Drain().IgnoreError();
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    device_.join();
  }

  absl::Status ReduceLocal(wire::ReduceOp op) override {
    return Enqueue(-1, "R", [this, op] {
      reduce::Reduce(dtype_, op, inputs_.data(), static_cast<int>(inputs_.size()), Node(), count_);
      return absl::OkStatus();
    });
  }
  absl::StatusOr<uint8_t*> Slot(int slot, size_t bytes) override {
    if (slot < 0 || slot > 1) return absl::InvalidArgumentError("slot");
    if (slots_[slot].size() < bytes) slots_[slot].resize(bytes);
    return slots_[slot].data();
  }
  absl::Status PlaceInputs() override {
    return Enqueue(-1, "P", [this] {
      for (size_t i = 0; i < inputs_.size() && (input_bytes_ > 0 || !input_sizes_.empty()); ++i) {
        const size_t bytes = input_sizes_.empty() ? input_bytes_ : input_sizes_[i];
        if (bytes > 0) std::memcpy(Node() + input_offsets_[i], inputs_[i], bytes);
      }
      return absl::OkStatus();
    });
  }
  absl::Status Fetch(int slot, size_t slot_offset, size_t offset, size_t bytes) override {
    if (offset + bytes > bytes_ || slot_offset + bytes > slots_[slot].size()) {
      return absl::OutOfRangeError("fetch outside the buffer");
    }
    const bool fail = fail_fetch_at >= 0 && offset == static_cast<size_t>(fail_fetch_at);
    fetched_bytes += bytes;
    return Enqueue(slot, "F" + std::to_string(offset), [=, this] {
      if (fail) return absl::InternalError("device fault (test)");
      std::memcpy(slots_[slot].data() + slot_offset, Node() + offset, bytes);
      return absl::OkStatus();
    });
  }
  absl::Status Store(int slot, size_t slot_offset, size_t offset, size_t bytes) override {
    if (offset + bytes > bytes_ || slot_offset + bytes > slots_[slot].size()) {
      return absl::OutOfRangeError("store outside the buffer");
    }
    stored_bytes += bytes;
    return Enqueue(slot, "S" + std::to_string(offset), [=, this] {
      std::memcpy(Node() + offset, slots_[slot].data() + slot_offset, bytes);
      return absl::OkStatus();
    });
  }
  // Allgather, broadcast, alltoall: input i goes to `offsets[i]` of the
  // node buffer.
  void SetInputPlaces(std::vector<size_t> offsets, size_t bytes) {
    input_offsets_ = std::move(offsets);
    input_bytes_ = bytes;
  }
  // Alltoallv: each input's and output's own size, instead of one for all.
  void SetSizes(std::vector<size_t> inputs, std::vector<size_t> outputs) {
    input_sizes_ = std::move(inputs);
    output_sizes_ = std::move(outputs);
  }
  // As a GPU's one 2-D copy would, with the default per-row copies; counted.
  absl::Status FetchRows(int slot, size_t slot_offset, size_t offset, size_t bytes, size_t pitch,
                         size_t rows) override {
    copies_in_rows += rows;
    return StagedNodeBuffer::FetchRows(slot, slot_offset, offset, bytes, pitch, rows);
  }
  absl::Status StoreRows(int slot, size_t slot_offset, size_t offset, size_t bytes, size_t pitch,
                         size_t rows) override {
    copies_in_rows += rows;
    return StagedNodeBuffer::StoreRows(slot, slot_offset, offset, bytes, pitch, rows);
  }
  absl::Status Wait(int slot) override { return WaitFor(last_[slot]); }
  absl::Status Finish() override {
    Enqueue(-1, "fan-out", [this] {
      for (size_t r = 0; r < outputs_.size(); ++r) {
        const size_t bytes = output_sizes_.empty() ? output_bytes_ : output_sizes_[r];
        if (bytes > 0) std::memcpy(outputs_[r], Node() + output_offsets_[r], bytes);
      }
      return absl::OkStatus();
    }).IgnoreError();
    Enqueue(-1, "", [this] { return Copy(mirrors_.out); }).IgnoreError();
    return Drain();
  }
  // Buffers far from the "device" (mirrored in `scratch`, as the runner's
  // Build does with device_plan.h's Mirror): their copies in run before
  // anything else of the operation, as the runner's CopyIn does once the
  // ranks' streams are there; their copies back after the fan-out.
  void SetMirrors(Mirrors mirrors, std::shared_ptr<std::vector<uint8_t>> scratch) {
    mirrors_ = std::move(mirrors);
    mirror_scratch_ = std::move(scratch);
    Enqueue(-1, "", [this] { return Copy(mirrors_.in); }).IgnoreError();
  }
  absl::Status Drain() override {
    std::unique_lock<std::mutex> lock(mu_);
    return WaitLocked(lock, enqueued_);
  }

  absl::StatusOr<std::unique_ptr<ChunkCoder>> Coder(const std::string& spec,
                                                    const std::string& feedback_name) override {
    if (residuals == nullptr) return nullptr;  // no "device codecs": staged whole
    auto parsed = ParseCodec(spec);
    if (!parsed.ok()) return parsed.status();
    Enqueue(-1, "coder " + spec, [] { return absl::OkStatus(); }).IgnoreError();
    return std::unique_ptr<ChunkCoder>(new Coding(this, MakeCodec(*parsed), feedback_name));
  }
  ErrorFeedback::Stats FeedbackStats() const override {
    return residuals != nullptr ? residuals->GetStats() : ErrorFeedback::Stats{};
  }
  void* data() override { return Node(); }
  absl::Status Divide(int divisor) override {
    return Enqueue(-1, "divide", [this, divisor] {
      reduce::DivideInPlace(dtype_, Node(), count_, divisor);
      return absl::OkStatus();
    });
  }

  std::vector<std::string> calls() {
    std::lock_guard<std::mutex> lock(mu_);
    return calls_;
  }
  int fail_fetch_at = -1;  // byte offset of the segment whose fetch fails
  int fail_encode_at = -1;  // index of the encoding (0: the first begun) that faults
  // Bytes asked to be copied, by the caller (its thread only).
  size_t fetched_bytes = 0, stored_bytes = 0;
  size_t copies_in_rows = 0;  // Fetches and Stores made by FetchRows / StoreRows
  // The slots' sizes: the most host memory asked of each.
  size_t slot_bytes(int slot) const { return slots_[slot].size(); }
  // Set: Coder runs codecs "on the device" (on its thread), keeping error
  // feedback here (shared by the buffers of one name's steps, as a daemon's
  // device residuals are).
  ErrorFeedback* residuals = nullptr;
  // Encodings begun on its coders, and the most begun and not ended at once.
  size_t encodings_begun = 0, most_encodings_ahead = 0;

 private:
  // The CPU codec and ErrorFeedback run as device work, in queue order, as
  // a GPU's kernels would on the buffer's stream: encodings begun are
  // enqueued and complete on the device's time, woken after. The host
  // memory passed in and out must be HostMemory's (as a GPU's pinned
  // memory must be for its copies to be quick).
  class Coding final : public ChunkCoder {
   public:
    Coding(HostStagedBuffer* b, std::unique_ptr<Codec> codec, std::string name)
        : b_(b), codec_(std::move(codec)), name_(std::move(name)) {}
    ~Coding() override { b_->Drain().IgnoreError(); }  // nothing begun still runs
    absl::StatusOr<uint8_t*> HostMemory(size_t bytes) override {
      host_.assign(bytes, 0);
      return host_.data();
    }
    absl::Status BeginEncode(void* data, size_t first, size_t count, bool own_sum, void* out,
                             std::function<void()> wake) override {
      if (!InHost(out, codec_->MaxEncodedBytes(b_->dtype_, count))) {
        return absl::FailedPreconditionError("encoding outside the coder's host memory");
      }
      auto e = std::make_shared<Encoding>();
      const bool fault = static_cast<int64_t>(b_->encodings_begun) == b_->fail_encode_at;
      e->ticket = b_->EnqueueWork(
          -1, "",
          [=, this] {
            if (fault) return absl::InternalError("device fault (test)");
            auto* f = static_cast<float*>(data);
            const bool fb = !name_.empty() && b_->dtype_ == wire::DataType::kFloat32;
            if (fb) b_->residuals->ApplyRange(name_, b_->count_, first, f, count);
            e->bytes = codec_->Encode(b_->dtype_, data, count, out);
            if (!fb && !own_sum) return absl::OkStatus();
            std::vector<uint8_t> decoded(count *
                                         wire::DataTypeSize(static_cast<uint32_t>(b_->dtype_)));
            absl::Status d = codec_->Decode(b_->dtype_, out, e->bytes, count, decoded.data());
            if (!d.ok()) return d;
            if (fb) {
              b_->residuals->UpdateRange(name_, b_->count_, first, f,
                                         reinterpret_cast<const float*>(decoded.data()), count);
            }
            if (own_sum) std::memcpy(data, decoded.data(), decoded.size());
            return absl::OkStatus();
          },
          std::move(wake));
      begun_.push_back(std::move(e));
      ++b_->encodings_begun;
      b_->most_encodings_ahead = std::max(b_->most_encodings_ahead, begun_.size());
      return absl::OkStatus();
    }
    absl::StatusOr<bool> EncodeDone() override {
      if (begun_.empty()) return absl::FailedPreconditionError("no encoding begun");
      return b_->Done(begun_.front()->ticket);
    }
    absl::StatusOr<uint64_t> EndEncode() override {
      absl::StatusOr<bool> done = EncodeDone();
      if (!done.ok()) return done.status();
      if (!*done) return absl::FailedPreconditionError("ended before it was done");
      const uint64_t bytes = begun_.front()->bytes;
      begun_.pop_front();
      return bytes;
    }
    absl::Status Decode(const void* in, uint64_t bytes, size_t count, void* data,
                        bool add) override {
      if (!InHost(in, bytes)) {
        return absl::FailedPreconditionError("decoding from outside the coder's host memory");
      }
      return b_->RunOnDevice([&] {
        return add ? codec_->DecodeAdd(b_->dtype_, in, bytes, count, data)
                   : codec_->Decode(b_->dtype_, in, bytes, count, data);
      });
    }

   private:
    struct Encoding {
      uint64_t ticket = 0;
      uint64_t bytes = 0;  // set on the device thread, read once Done
    };
    bool InHost(const void* p, size_t bytes) const {
      const auto* q = static_cast<const uint8_t*>(p);
      return q >= host_.data() && bytes <= host_.size() &&
             static_cast<size_t>(q - host_.data()) <= host_.size() - bytes;
    }
    HostStagedBuffer* const b_;
    const std::unique_ptr<Codec> codec_;
    const std::string name_;
    std::vector<uint8_t> host_;
    std::deque<std::shared_ptr<Encoding>> begun_;
  };

  // Runs `work` on the device thread after everything enqueued, and waits.
  absl::Status RunOnDevice(std::function<absl::Status()> work) {
    absl::Status result;
    Enqueue(-1, "", [&] {
      result = work();
      return absl::OkStatus();
    }).IgnoreError();
    if (absl::Status s = Drain(); !s.ok()) return s;
    return result;
  }

  uint8_t* Node() { return node_.data(); }
  static absl::Status Copy(const std::vector<DeviceStep>& steps) {
    for (const DeviceStep& c : steps) {
      if (c.kind != DeviceStep::Kind::kPeerCopy) return absl::InternalError("not a peer copy");
      std::memcpy(c.to, c.from, c.bytes);
    }
    return absl::OkStatus();
  }
  absl::Status Enqueue(int slot, std::string call, std::function<absl::Status()> work) {
    EnqueueWork(slot, std::move(call), std::move(work));
    return absl::OkStatus();
  }
  // Its ticket: done once the device has run it (`then` after, on the
  // device thread).
  uint64_t EnqueueWork(int slot, std::string call, std::function<absl::Status()> work,
                       std::function<void()> then = nullptr) {
    std::lock_guard<std::mutex> lock(mu_);
    if (!call.empty()) calls_.push_back(std::move(call));
    queue_.push_back({std::move(work), std::move(then)});
    ++enqueued_;
    if (slot >= 0) last_[slot] = enqueued_;
    cv_.notify_all();
    return enqueued_;
  }
  // Whether the device has run `ticket`; its error (sticky) once it has,
  // or at once after a fault.
  absl::StatusOr<bool> Done(uint64_t ticket) {
    std::lock_guard<std::mutex> lock(mu_);
    if (!error_.ok()) return error_;
    return done_ >= ticket;
  }
  absl::Status WaitFor(uint64_t ticket) {
    std::unique_lock<std::mutex> lock(mu_);
    return WaitLocked(lock, ticket);
  }
  absl::Status WaitLocked(std::unique_lock<std::mutex>& lock, uint64_t ticket) {
    cv_.wait(lock, [&] { return done_ >= ticket; });
    return error_;  // sticky, as a broken CUDA context
  }
  void DeviceLoop() {
    std::unique_lock<std::mutex> lock(mu_);
    while (true) {
      cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
      if (queue_.empty()) return;
      Work work = std::move(queue_.front());
      queue_.pop_front();
      // After a fault the device runs nothing more (a broken CUDA context).
      const bool faulted = !error_.ok();
      lock.unlock();
      std::this_thread::sleep_for(std::chrono::microseconds(200));  // a copy takes time
      absl::Status s = faulted ? absl::OkStatus() : work.run();
      lock.lock();
      if (!s.ok() && error_.ok()) error_ = s;
      ++done_;
      cv_.notify_all();
      if (work.then && !faulted) {
        lock.unlock();
        work.then();
        lock.lock();
      }
    }
  }
  const wire::DataType dtype_;
  const size_t count_;
  const size_t bytes_;
  const std::vector<const void*> inputs_;
  const std::vector<void*> outputs_;
  const std::vector<size_t> output_offsets_;
  const size_t output_bytes_;
  std::vector<uint8_t> node_;  // "device" memory
  std::vector<size_t> input_offsets_;
  size_t input_bytes_ = 0;
  std::vector<size_t> input_sizes_, output_sizes_;
  std::vector<uint8_t> slots_[2];
  Mirrors mirrors_;
  std::shared_ptr<std::vector<uint8_t>> mirror_scratch_;
  std::mutex mu_;
  std::condition_variable cv_;
  struct Work {
    std::function<absl::Status()> run;
    std::function<void()> then;
  };
  std::deque<Work> queue_;
  std::vector<std::string> calls_;
  uint64_t enqueued_ = 0, done_ = 0, last_[2] = {0, 0};
  absl::Status error_;
  bool stop_ = false;
  std::thread device_;
};

// Hands `op`'s node buffer to `b` (the rank's buffers "on the GPU"): the
// ClusterJob then reaches them only through it.
void StageOn(ClusterOp& op, std::shared_ptr<HostStagedBuffer> b) {
  op.staged = std::move(b);
  op.parts[0].send = nullptr;
  op.parts[0].recv = nullptr;
}

// The stand-in for a node's GPU buffers of an operation `sig` of `world`
// ranks, laid out as the CUDA runner lays its staged buffers out
// (PlanStaged, device_plan.h): rank i of `ranks` (this node's, in any
// order) with its send buffer `send[i]` (null: in place) and receive
// buffer `recv[i]`, through the runner's own PointersFor. The multi-node
// tests below so check the runner's layout end to end, without a GPU.
// `far`: which buffers are on GPUs that the operation's GPU cannot reach,
// mirrored as the runner's Build mirrors them (Mirror, then PointersFor
// on the mirrors): none, all, the send buffers, the receive buffers, or
// every buffer but the first rank's.
enum class Far { kNone, kAll, kSends, kRecvs, kAllButFirst };
// A far mode for case `o` of a test, so that its cases take turns.
Far FarFor(size_t o) { return static_cast<Far>(o % 5); }
std::shared_ptr<HostStagedBuffer> LaidOutAsOnAGpu(const OpSignature& sig, int world,
                                                  const std::vector<DeviceRankBuffers>& ranks,
                                                  const std::vector<const void*>& send,
                                                  const std::vector<void*>& recv,
                                                  Far far = Far::kNone) {
  absl::StatusOr<StagedLayout> layout = PlanStaged(sig, world, ranks);
  EXPECT_TRUE(layout.ok()) << layout.status();
  if (!layout.ok()) return nullptr;
  const size_t n = ranks.size();
  std::vector<uint8_t*> s(n), r(n);
  std::vector<bool> send_far(n), recv_far(n);
  for (size_t i = 0; i < n; ++i) {
    s[i] = static_cast<uint8_t*>(const_cast<void*>(send[i]));
    r[i] = static_cast<uint8_t*>(recv[i]);
    const bool all = far == Far::kAll || (far == Far::kAllButFirst && i > 0);
    send_far[i] = all || far == Far::kSends;
    recv_far[i] = all || far == Far::kRecvs;
  }
  Mirrors mirrors = Mirror(ranks, 0, send_far, recv_far, nullptr, &s, &r);
  auto scratch = std::make_shared<std::vector<uint8_t>>(mirrors.bytes, 0xcd);
  if (mirrors.bytes > 0) mirrors = Mirror(ranks, 0, send_far, recv_far, scratch->data(), &s, &r);
  absl::StatusOr<StagedPointers> p =
      PointersFor(sig, *layout, std::vector<const void*>(s.begin(), s.end()),
                  std::vector<void*>(r.begin(), r.end()));
  EXPECT_TRUE(p.ok()) << p.status();
  if (!p.ok()) return nullptr;
  auto b =
      std::make_shared<HostStagedBuffer>(static_cast<wire::DataType>(sig.dtype), layout->count,
                                         p->inputs, p->outputs, p->output_offsets, p->output_bytes);
  if (!layout->reduce) b->SetInputPlaces(p->input_offsets, p->input_bytes);
  if (sig.collective == static_cast<uint32_t>(wire::Collective::kAlltoallv)) {
    b->SetSizes(p->input_sizes, p->output_sizes);
  }
  if (mirrors.bytes > 0) b->SetMirrors(std::move(mirrors), std::move(scratch));
  return b;
}

// A rank's DeviceRankBuffers as validation sizes them (what PlanStaged reads).
DeviceRankBuffers RankBytes(int rank, uint64_t send_bytes, uint64_t recv_bytes) {
  DeviceRankBuffers b;
  b.rank = rank;
  b.send_bytes = send_bytes;
  b.recv_bytes = recv_bytes;
  return b;
}

// Small integers, so that every dtype holds every sum, product and order of
// reduction exactly (unsigned ones non-negative).
double SmallValue(wire::DataType t, int node, size_t op, size_t i) {
  const bool is_unsigned = t == wire::DataType::kUInt8;
  return static_cast<double>((i * 7 + static_cast<size_t>(node) * 3 + op) % 5) -
         (is_unsigned ? 0 : 2);
}

// The plain loop: the exact result of `op` over the nodes' values, with
// avg's documented division (reduce.h): float32 arithmetic for 16-bit floats
// and float32, double for float64, truncation toward zero for integers.
double Expected(wire::DataType t, wire::ReduceOp op, size_t o, size_t i, int nodes) {
  double acc = SmallValue(t, 0, o, i);
  for (int k = 1; k < nodes; ++k) {
    const double v = SmallValue(t, k, o, i);
    switch (op) {
      case wire::ReduceOp::kSum:
      case wire::ReduceOp::kAvg:
        acc += v;
        break;
      case wire::ReduceOp::kProd:
        acc *= v;
        break;
      case wire::ReduceOp::kMin:
        acc = std::min(acc, v);
        break;
      case wire::ReduceOp::kMax:
        acc = std::max(acc, v);
        break;
    }
  }
  if (op != wire::ReduceOp::kAvg) return acc;
  switch (t) {
    case wire::DataType::kFloat64:
      return acc / nodes;
    case wire::DataType::kFloat32:
    case wire::DataType::kFloat16:
    case wire::DataType::kBFloat16:
      return static_cast<float>(acc) / static_cast<float>(nodes);
    default:
      return std::trunc(acc / nodes);
  }
}



struct StagedCase {
  wire::DataType dtype;
  wire::ReduceOp op;
  size_t count;
};

// Allreduces on `nodes` nodes where the nodes in `staged` hold their buffers
// "on a GPU" (HostStagedBuffer, fetched and stored in 4 KiB segments) and the
// others in host memory; every node ends with the plain loop's result.
// Returns the staged buffers' call logs by case.
// With `scatter`, reduce_scatters: every node sends n blocks of `count`,
// rank k (node k) receives block k. Staged nodes' buffers take turns at
// being far from the operation's GPU (FarFor: mirrored) and, every third
// allreduce, in place.
std::vector<std::vector<std::string>> RunStaged(int n, const std::vector<int>& staged,
                                                const std::vector<StagedCase>& cases,
                                                bool scatter = false,
                                                ClusterJob::StagingCounters* counted = nullptr,
                                                const std::string& prefix = "s") {
  Nodes nodes(n);
  EXPECT_TRUE(nodes.SetBoth("staging_segment_bytes", "4K").ok());
  EXPECT_TRUE(nodes.SetBoth("chunk_bytes", "4K").ok());
  std::vector<std::vector<std::vector<uint8_t>>> send(n), recv(n);
  std::vector<std::shared_ptr<HostStagedBuffer>> buffers(cases.size());
  for (int k = 0; k < n; ++k) {
    const bool gpu = std::find(staged.begin(), staged.end(), k) != staged.end();
    for (size_t o = 0; o < cases.size(); ++o) {
      const StagedCase& c = cases[o];
      const size_t es = wire::DataTypeSize(static_cast<uint32_t>(c.dtype));
      const size_t sent = scatter ? c.count * static_cast<size_t>(n) : c.count;
      send[k].emplace_back(sent * es + 1);
      recv[k].emplace_back(c.count * es + 1, 0xee);
      for (size_t i = 0; i < sent; ++i) {
        PutElement(c.dtype, send[k][o].data(), i, SmallValue(c.dtype, k, o, i));
      }
      ClusterOp op = Allreduce(o, prefix + std::to_string(o), c.dtype, c.op, c.count, k,
                               send[k][o].data(), recv[k][o].data());
      if (scatter) op.sig.collective = static_cast<uint32_t>(wire::Collective::kReduceScatter);
      if (gpu) {
        // Every third allreduce in place: the input in the receive buffer,
        // no send buffer.
        const bool in_place = !scatter && o % 3 == 2;
        if (in_place) std::memcpy(recv[k][o].data(), send[k][o].data(), c.count * es);
        auto b = LaidOutAsOnAGpu(op.sig, n, {RankBytes(k, in_place ? 0 : sent * es, c.count * es)},
                                 {in_place ? nullptr : send[k][o].data()}, {recv[k][o].data()},
                                 FarFor(o + k));
        if (k == staged.front()) buffers[o] = b;
        StageOn(op, b);
      }
      nodes.job(k).Submit(std::move(op));
    }
  }
  for (int k = 0; k < n; ++k) EXPECT_TRUE(nodes.ends(k).WaitFor(cases.size())) << "node " << k;
  for (int k = 0; k < n; ++k) {
    for (auto& [key, status] : nodes.ends(k).ends) {
      EXPECT_TRUE(status.ok()) << "node " << k << " op " << key << ": " << status;
    }
    for (size_t o = 0; o < cases.size(); ++o) {
      const StagedCase& c = cases[o];
      const size_t es = wire::DataTypeSize(static_cast<uint32_t>(c.dtype));
      for (size_t i = 0; i < c.count; ++i) {
        const size_t at = scatter ? static_cast<size_t>(k) * c.count + i : i;
        const double want = Stored(c.dtype, Expected(c.dtype, c.op, o, at, n));
        const double got = GetElement(c.dtype, recv[k][o].data(), i);
        if (got != want) {
          ADD_FAILURE() << n << " nodes, node " << k << ", dtype " << static_cast<int>(c.dtype)
                        << " op " << static_cast<int>(c.op) << " count " << c.count << " [" << i
                        << "]: " << got << ", want " << want;
          break;
        }
      }
      EXPECT_EQ(recv[k][o][c.count * es], 0xee) << "written past the end";
    }
  }
  if (counted != nullptr) *counted = nodes.job(staged.front()).staging();
  std::vector<std::vector<std::string>> logs;
  for (auto& b : buffers) logs.push_back(b->calls());
  return logs;
}

// Direct ops ("#N", up to 64K) whose buffers are on a GPU on some nodes:
// fetched whole, exchanged, stored; every dtype x reduce op, sizes 0, 1,
// odd and several pages, on two nodes (one staged) and three (two staged).
TEST(ClusterJobStagedTest, DirectOperationsOnGpuBuffersMatchThePlainLoop) {
  std::vector<StagedCase> cases;
  for (auto t : wire::kAllDataTypes) {
    for (auto op : wire::kAllReduceOps) {
      for (size_t count : {0, 1, 7, 3001}) cases.push_back({t, op, count});
    }
  }
  ClusterJob::StagingCounters counted;
  RunStaged(2, {1}, cases, false, &counted, "#");
  // Those with bytes to stage (0 elements: nothing to copy).
  EXPECT_EQ(counted.ops, static_cast<uint64_t>(std::count_if(
                             cases.begin(), cases.end(), [](auto& c) { return c.count > 0; })));
  RunStaged(3, {0, 2}, cases, false, nullptr, "#");
}

// Every dtype x reduce op, sizes 0, 1, odd, not a multiple of the 4 KiB
// segment, several segments; two nodes (one staged) and three (two staged,
// the ring's segments then depend on the split, and the result is still the
// exact one).
TEST(ClusterJobStagedTest, EveryDtypeOpAndSizeMatchesThePlainLoop) {
  const wire::DataType dtypes[] = {wire::DataType::kFloat32, wire::DataType::kFloat64,
                                   wire::DataType::kFloat16, wire::DataType::kBFloat16,
                                   wire::DataType::kInt8,    wire::DataType::kUInt8,
                                   wire::DataType::kInt32,   wire::DataType::kInt64};
  const wire::ReduceOp ops[] = {wire::ReduceOp::kSum, wire::ReduceOp::kAvg, wire::ReduceOp::kMin,
                                wire::ReduceOp::kMax, wire::ReduceOp::kProd};
  std::vector<StagedCase> cases;
  for (auto t : dtypes) {
    for (auto op : ops) {
      for (size_t count : {0, 1, 7, 3001}) cases.push_back({t, op, count});
    }
  }
  cases.push_back({wire::DataType::kFloat32, wire::ReduceOp::kSum, 40000});
  cases.push_back({wire::DataType::kBFloat16, wire::ReduceOp::kAvg, 25001});
  cases.push_back({wire::DataType::kInt64, wire::ReduceOp::kMax, 9000});
  {
    SCOPED_TRACE("2 nodes");
    RunStaged(2, {0}, cases);
  }
  {
    SCOPED_TRACE("3 nodes");
    RunStaged(3, {0, 2}, cases);
  }
}

// A node's ranks' parts of a segment of a reduce_scatter's node buffer:
// ranks dealt to nodes out of order, segments cutting blocks.
TEST(NodePartsTest, ClipsEachRankBlockToTheSegment) {
  using Parts = std::vector<std::pair<size_t, size_t>>;
  const std::vector<int> node_of_rank = {0, 0, 1, 1, 0};  // blocks of 10 elements
  EXPECT_EQ(NodeParts(node_of_rank, 0, 15, 22, 10), (Parts{{0, 5}}));
  EXPECT_EQ(NodeParts(node_of_rank, 1, 15, 22, 10), (Parts{{5, 10}, {15, 7}}));
  EXPECT_EQ(NodeParts(node_of_rank, 0, 0, 50, 10), (Parts{{0, 10}, {10, 10}, {40, 10}}));
  EXPECT_EQ(NodeParts(node_of_rank, 0, 40, 10, 10), (Parts{{0, 10}}));
  EXPECT_EQ(NodeParts(node_of_rank, 1, 40, 10, 10), Parts{});
  EXPECT_EQ(NodeParts(node_of_rank, 2, 0, 50, 10), Parts{});  // no ranks there
  EXPECT_EQ(NodeParts(node_of_rank, 0, 0, 50, 0), Parts{});   // empty blocks
  // Across two of its own ranks: a part each.
  EXPECT_EQ(NodeParts(node_of_rank, 0, 9, 2, 10), (Parts{{0, 1}, {1, 1}}));
}

// reduce_scatter the same way: the node buffer holds every rank's block
// (segments run over all of it), each rank gets its own block.
TEST(ClusterJobStagedTest, ReduceScatterMatchesThePlainLoop) {
  std::vector<StagedCase> cases;
  for (auto t : {wire::DataType::kFloat32, wire::DataType::kBFloat16, wire::DataType::kInt32}) {
    for (auto op : {wire::ReduceOp::kSum, wire::ReduceOp::kAvg, wire::ReduceOp::kMax}) {
      for (size_t count : {0, 1, 7, 3001}) cases.push_back({t, op, count});
    }
  }
  {
    SCOPED_TRACE("2 nodes");
    RunStaged(2, {1}, cases, true);
  }
  {
    SCOPED_TRACE("3 nodes");
    RunStaged(3, {0, 1}, cases, true);
  }
}

// Allgather and broadcast with some nodes' buffers "on a GPU": the ranks'
// inputs placed in the node buffer there, then segment by segment this
// node's pieces fetched (the broadcast root's node: the piece), the
// collective carried from a host slot, the other nodes' pieces stored back;
// the result copied to the rank. The host node runs the same segments on
// its buffer. Bytes travel as they are; sizes 0, 1, odd, large (up to 137
// segments); 2 and 3 nodes, every root.
TEST(ClusterJobStagedTest, AllgatherAndBroadcastMoveTheBytes) {
  for (int n : {2, 3}) {
    SCOPED_TRACE(std::to_string(n) + " nodes");
    Nodes nodes(n);
    // 4 KiB segments: an allgather's carry 4K / n of each rank's block.
    ASSERT_TRUE(nodes.SetBoth("staging_segment_bytes", "4K").ok());
    const std::vector<size_t> counts = {0, 1, 7, 3001, 70001};
    struct Case {
      bool gather;
      wire::DataType dtype;
      size_t count;
      int root;
    };
    std::vector<Case> cases;
    for (size_t c : counts) {
      cases.push_back({true, wire::DataType::kFloat32, c, 0});
      cases.push_back({true, wire::DataType::kBFloat16, c, 0});
      for (int root = 0; root < n; ++root)
        cases.push_back({false, wire::DataType::kInt64, c, root});
    }
    std::vector<std::vector<std::vector<uint8_t>>> send(n), recv(n);
    std::vector<std::shared_ptr<HostStagedBuffer>> node0(cases.size());
    for (int k = 0; k < n; ++k) {
      const bool gpu = k != 1;  // node 1 keeps host buffers
      for (size_t o = 0; o < cases.size(); ++o) {
        const Case& c = cases[o];
        const size_t es = wire::DataTypeSize(static_cast<uint32_t>(c.dtype));
        const size_t out = c.gather ? c.count * n : c.count;
        send[k].emplace_back(c.count * es + 1);
        recv[k].emplace_back(out * es + 1, 0xee);
        for (size_t i = 0; i < c.count; ++i) {
          PutElement(c.dtype, send[k][o].data(), i, SmallValue(c.dtype, k, o, i));
        }
        ClusterOp op = Allreduce(o, "m" + std::to_string(o), c.dtype, wire::ReduceOp::kSum, c.count,
                                 k, send[k][o].data(), recv[k][o].data());
        op.sig.collective = static_cast<uint32_t>(c.gather ? wire::Collective::kAllgather
                                                           : wire::Collective::kBroadcast);
        op.sig.root = c.root;
        if (gpu) {
          const bool has_input = c.gather || k == c.root;
          auto b = LaidOutAsOnAGpu(
              op.sig, n, {RankBytes(k, has_input ? c.count * es : 0, out * es)},
              {has_input ? send[k][o].data() : nullptr}, {recv[k][o].data()}, FarFor(o + k));
          if (k == 0) node0[o] = b;
          StageOn(op, b);
        }
        nodes.job(k).Submit(std::move(op));
      }
    }
    nodes.ExpectEndsOk(cases.size());
    if (HasFatalFailure()) return;
    for (int k = 0; k < n; ++k) {
      for (size_t o = 0; o < cases.size(); ++o) {
        const Case& c = cases[o];
        const size_t es = wire::DataTypeSize(static_cast<uint32_t>(c.dtype));
        std::vector<uint8_t> want;
        if (c.gather) {
          for (int j = 0; j < n; ++j) {
            want.insert(want.end(), send[j][o].begin(), send[j][o].begin() + c.count * es);
          }
        } else {
          want.assign(send[c.root][o].begin(), send[c.root][o].begin() + c.count * es);
        }
        want.push_back(0xee);  // nothing written past the end
        EXPECT_EQ(recv[k][o], want) << "node " << k << (c.gather ? " allgather" : " broadcast")
                                    << " count " << c.count << " root " << c.root;
      }
    }
    // The largest allgather went in many segments: node 0 fetched its piece
    // of each (F) and stored the other nodes' pieces (S) of each.
    for (size_t o = 0; o < cases.size(); ++o) {
      if (!cases[o].gather || cases[o].count != counts.back()) continue;
      size_t fetches = 0, stores = 0;
      for (const std::string& call : node0[o]->calls()) {
        fetches += call[0] == 'F';
        stores += call[0] == 'S';
      }
      const size_t per = 4096 / n / wire::DataTypeSize(static_cast<uint32_t>(cases[o].dtype));
      const size_t segments = (counts.back() + per - 1) / per;
      EXPECT_EQ(fetches, segments) << "dtype " << static_cast<int>(cases[o].dtype);
      EXPECT_EQ(stores, segments * (n - 1)) << "dtype " << static_cast<int>(cases[o].dtype);
    }
  }
}

// Alltoall(v) between nodes whose ranks' buffers are "on the GPU" (staged)
// and a node whose are not: every rank's block for every rank lands where
// it belongs, pairs on one node included, in segments (each pair's piece
// cut alike on every node) that bound the host memory staged at once, every
// byte fetched and stored once, the next segment fetched while one travels.
TEST(ClusterJobStagedTest, AlltoallMovesEveryBlock) {
  for (auto [n, per] : {std::pair{2, 1}, std::pair{3, 1}, std::pair{2, 2}, std::pair{3, 2}}) {
    SCOPED_TRACE(std::to_string(n) + " nodes x " + std::to_string(per) + " ranks");
    Nodes nodes(n, per);
    // 4 KiB segments per rank: 3001-element blocks go in many.
    constexpr size_t kSegment = 4096;
    ASSERT_TRUE(nodes.SetBoth("staging_segment_bytes", "4K").ok());
    const int world = n * per;
    struct Case {
      wire::DataType dtype;
      size_t count;  // elements of each block (alltoallv: a scale)
      bool v;
      bool idle_last = false;  // alltoallv: the last node's ranks send and receive nothing
    };
    std::vector<Case> cases;
    for (size_t c : {size_t{0}, size_t{1}, size_t{7}, size_t{3001}}) {
      cases.push_back({wire::DataType::kFloat32, c, false});
      cases.push_back({wire::DataType::kInt64, c, false});
      cases.push_back({wire::DataType::kBFloat16, c, false});
      cases.push_back({wire::DataType::kFloat32, c, true});
      cases.push_back({wire::DataType::kBFloat16, c, true});
    }
    cases.push_back({wire::DataType::kFloat32, 3001, true, true});
    // Elements rank a sends rank b in case o: alltoallv's differ per pair
    // (up to 6x the scale, one rank's row far longer than the others'),
    // zero for some.
    auto pair = [&](size_t o, int a, int b) -> size_t {
      const Case& c = cases[o];
      if (!c.v) return c.count;
      if (c.idle_last && (a / per == n - 1 || b / per == n - 1)) return 0;
      const size_t f = static_cast<size_t>((a * 3 + b * 5 + static_cast<int>(o)) % 4);
      return (a == 1 ? 2 * f : f) * c.count;
    };
    auto sum = [&](size_t o, int r, bool sending) {
      size_t t = 0;
      for (int q = 0; q < world; ++q) t += sending ? pair(o, r, q) : pair(o, q, r);
      return t;
    };
    // [rank][case]: what it sends, then a guard byte; what it receives, too.
    std::vector<std::vector<std::vector<uint8_t>>> send(world), recv(world);
    std::vector<std::vector<std::shared_ptr<HostStagedBuffer>>> staged(n);
    for (int r = 0; r < world; ++r) {
      for (size_t o = 0; o < cases.size(); ++o) {
        const Case& c = cases[o];
        const size_t es = wire::DataTypeSize(static_cast<uint32_t>(c.dtype));
        send[r].emplace_back(sum(o, r, true) * es + 1);
        recv[r].emplace_back(sum(o, r, false) * es + 1, 0xee);
        for (size_t i = 0; i < sum(o, r, true); ++i) {
          PutElement(c.dtype, send[r][o].data(), i, SmallValue(c.dtype, r, o, i));
        }
      }
    }
    for (int k = 0; k < n; ++k) {
      const bool gpu = k != 1;  // node 1 keeps host buffers
      staged[k].resize(cases.size());
      for (size_t o = 0; o < cases.size(); ++o) {
        const Case& c = cases[o];
        const size_t es = wire::DataTypeSize(static_cast<uint32_t>(c.dtype));
        ClusterOp op;
        op.key = o;
        op.name = "a2a" + std::to_string(o);
        op.sig.collective = static_cast<uint32_t>(c.v ? wire::Collective::kAlltoallv
                                                      : wire::Collective::kAlltoall);
        op.sig.dtype = static_cast<uint32_t>(c.dtype);
        op.sig.count = c.v ? 0 : c.count;
        // The parts come in reverse: the node buffer is in rank order
        // whatever order they come in.
        for (int i = per - 1; i >= 0; --i) {
          const int r = k * per + i;
          ClusterOp::Part part{r, gpu ? nullptr : send[r][o].data(),
                               gpu ? nullptr : recv[r][o].data(), {}, {}};
          for (int q = 0; c.v && q < world; ++q) {
            part.send_counts.push_back(pair(o, r, q));
            part.recv_counts.push_back(pair(o, q, r));
          }
          op.parts.push_back(std::move(part));
        }
        if (gpu) {
          // The runner gets the ranks in the parts' order, too.
          std::vector<DeviceRankBuffers> ranks;
          std::vector<const void*> ins;
          std::vector<void*> outs;
          for (int i = per - 1; i >= 0; --i) {
            const int r = k * per + i;
            ranks.push_back(RankBytes(r, sum(o, r, true) * es, sum(o, r, false) * es));
            ins.push_back(send[r][o].data());
            outs.push_back(recv[r][o].data());
          }
          auto b = LaidOutAsOnAGpu(op.sig, world, ranks, ins, outs, FarFor(o + k));
          staged[k][o] = b;
          op.staged = b;
        }
        nodes.job(k).Submit(std::move(op));
      }
    }
    nodes.ExpectEndsOk(cases.size());
    if (HasFatalFailure()) return;
    for (size_t o = 0; o < cases.size(); ++o) {
      const Case& c = cases[o];
      const size_t es = wire::DataTypeSize(static_cast<uint32_t>(c.dtype));
      const std::string what = "dtype " + std::to_string(static_cast<int>(c.dtype)) + " count " +
                               std::to_string(c.count) + (c.v ? " alltoallv" : "") +
                               (c.idle_last ? " (last node idle)" : "");
      for (int r = 0; r < world; ++r) {
        std::vector<uint8_t> want;  // the plain loop: from every rank, in rank order
        for (int from = 0; from < world; ++from) {
          size_t at = 0;
          for (int q = 0; q < r; ++q) at += pair(o, from, q);
          const uint8_t* b = send[from][o].data() + at * es;
          want.insert(want.end(), b, b + pair(o, from, r) * es);
        }
        want.push_back(0xee);  // nothing written past the end
        EXPECT_EQ(recv[r][o], want) << "rank " << r << " " << what;
      }
      for (int k = 0; k < n; ++k) {
        if (!staged[k][o]) continue;
        HostStagedBuffer& b = *staged[k][o];
        size_t sent = 0, got = 0, busiest = 0;  // bytes of node k's ranks
        for (int r = k * per; r < (k + 1) * per; ++r) {
          sent += sum(o, r, true) * es;
          got += sum(o, r, false) * es;
          busiest = std::max({busiest, sum(o, r, true) * es, sum(o, r, false) * es});
        }
        EXPECT_EQ(b.fetched_bytes, sent) << "node " << k << " " << what;
        EXPECT_EQ(b.stored_bytes, got) << "node " << k << " " << what;
        const std::vector<std::string> calls = b.calls();
        ASSERT_GE(calls.size(), 2u);
        EXPECT_EQ(calls.front(), "P");
        EXPECT_EQ(calls.back(), "fan-out");
        if (!c.v) {  // an alltoall's pieces, one size one block apart: 2-D copies only
          EXPECT_EQ(b.copies_in_rows, calls.size() - 2) << "node " << k << " " << what;
        }
        // Host memory: a slot holds a segment's pieces, at most a segment
        // (and an element per pair, parts rounding up) per rank each way.
        for (int sl = 0; sl < 2; ++sl) {
          EXPECT_LE(b.slot_bytes(sl), 2 * per * (kSegment + world * es)) << "node " << k << " "
                                                                           << what;
        }
        if (busiest > 2 * kSegment) {
          // Segments: the second's first fetch comes before the first's store.
          EXPECT_GT(b.slot_bytes(1), 0u) << what;
          const auto first_store = std::find_if(calls.begin(), calls.end(),
                                                [](const std::string& x) { return x[0] == 'S'; });
          const auto fetches = std::count_if(calls.begin(), first_store,
                                             [](const std::string& x) { return x[0] == 'F'; });
          EXPECT_GT(static_cast<size_t>(fetches), c.v ? 1u : size_t(per * world)) << what;
        }
      }
    }
  }
}

// The pipeline: the local reduction first, then segment k + 1 is fetched
// before segment k is stored (it travels while k's copy runs), each slot's
// next fetch comes right after its store, and every segment is stored once.
TEST(ClusterJobStagedTest, TheNextSegmentIsFetchedWhileThisOneTravels) {
  const size_t count = 10 * 1024 + 5;  // 11 segments of 4 KiB float32, the last short
  ClusterJob::StagingCounters counted;
  auto logs = RunStaged(2, {1}, {{wire::DataType::kFloat32, wire::ReduceOp::kSum, count}}, false,
                        &counted);
  // Counted for ciuicctl status: one operation, every byte fetched and stored.
  EXPECT_EQ(counted.ops, 1u);
  EXPECT_EQ(counted.bytes, 2 * count * sizeof(float));
  ASSERT_EQ(logs.size(), 1u);
  const std::vector<std::string>& calls = logs[0];
  std::vector<std::string> want = {"R", "F0", "F4096"};
  const size_t segments = 11;
  for (size_t k = 0; k < segments; ++k) {
    want.push_back("S" + std::to_string(k * 4096));
    if (k + 2 < segments) want.push_back("F" + std::to_string((k + 2) * 4096));
  }
  want.push_back("fan-out");
  EXPECT_EQ(calls, want);
}

// A fault on the device mid-operation (the fetch of the third segment) fails
// that node's operation with the device's error, after what was enqueued has
// drained; the job fails, and the other node's operation ends with an error
// too, not a hang.
TEST(ClusterJobStagedTest, ADeviceFaultFailsTheOperationEverywhere) {
  Nodes nodes(2);
  ASSERT_TRUE(nodes.SetBoth("staging_segment_bytes", "4K").ok());
  ASSERT_TRUE(nodes.SetBoth("op_timeout_ms", "3000").ok());
  const size_t count = 8 * 1024;
  std::vector<float> send[2], recv[2];
  std::shared_ptr<HostStagedBuffer> gpu;
  for (int k = 0; k < 2; ++k) {
    send[k].assign(count, 1.0f);
    recv[k].assign(count, 0.0f);
    ClusterOp op = Allreduce(1, "f", wire::DataType::kFloat32, wire::ReduceOp::kSum, count, k,
                             send[k].data(), recv[k].data());
    if (k == 0) {
      gpu = std::make_shared<HostStagedBuffer>(wire::DataType::kFloat32, count,
                                               std::vector<const void*>{send[0].data()},
                                               std::vector<void*>{recv[0].data()});
      gpu->fail_fetch_at = 2 * 4096;
      StageOn(op, gpu);
    }
    nodes.job(k).Submit(std::move(op));
  }
  for (int k = 0; k < 2; ++k) ASSERT_TRUE(nodes.ends(k).WaitFor(1)) << "node " << k;
  const absl::Status& s0 = nodes.ends(0).ends[0].second;
  EXPECT_EQ(s0.code(), absl::StatusCode::kInternal) << s0;
  EXPECT_NE(s0.message().find("device fault"), std::string::npos) << s0;
  EXPECT_FALSE(nodes.ends(1).ends[0].second.ok());
  // Nothing of the failed operation is left running on the "device".
  EXPECT_TRUE(absl::IsInternal(gpu->Drain()));
}

// A fault on one node's device, with four nodes and the default one-minute
// deadline: the failing node reports its run failed, the coordinator fails
// the job saying the run is cut off, and every node ends the run within
// seconds, naming the fault (before, the other nodes waited for the run's
// deadline). Uncompressed (the fault in the third segment's copy) and
// compressed (in the device's third encoding, and in its eighteenth, among
// the owner's phase-2 chunks).
TEST(ClusterJobStagedTest, AFaultOnOneNodeEndsTheRunEverywhereLongBeforeItsDeadline) {
  for (int fault_at : {-1, 2, 17}) {
    const bool compressed = fault_at >= 0;
    SCOPED_TRACE(compressed ? "int8 on the device" : "uncompressed");
    SCOPED_TRACE(fault_at);
    const int n = 4;
    Nodes nodes(n);
    ASSERT_TRUE(nodes.SetBoth("staging_segment_bytes", "4K").ok());
    ASSERT_TRUE(nodes.SetBoth("op_timeout_ms", "60000").ok());
    if (compressed) {
      ASSERT_TRUE(nodes.SetBoth("compression", "int8").ok());
      ASSERT_TRUE(nodes.SetBoth("chunk_bytes", "4K").ok());
    }
    ErrorFeedback residuals(1 << 20);
    const size_t count = 20000;
    std::vector<std::vector<float>> send(n), recv(n);
    std::shared_ptr<HostStagedBuffer> gpu;
    const auto start = Clock::now();
    for (int k = 0; k < n; ++k) {
      send[k].assign(count, 1.0f + k);
      recv[k].assign(count, 0.0f);
      ClusterOp op = Allreduce(1, "f", wire::DataType::kFloat32, wire::ReduceOp::kSum, count, k,
                               send[k].data(), recv[k].data());
      if (k == 1) {
        gpu = std::make_shared<HostStagedBuffer>(wire::DataType::kFloat32, count,
                                                 std::vector<const void*>{send[k].data()},
                                                 std::vector<void*>{recv[k].data()});
        if (compressed) {
          gpu->residuals = &residuals;
          gpu->fail_encode_at = fault_at;
        } else {
          gpu->fail_fetch_at = 2 * 4096;
        }
        StageOn(op, gpu);
      }
      nodes.job(k).Submit(std::move(op));
    }
    for (int k = 0; k < n; ++k) ASSERT_TRUE(nodes.ends(k).WaitFor(1)) << "node " << k;
    const auto took = Clock::now() - start;
    EXPECT_LT(took, std::chrono::seconds(10))
        << std::chrono::duration_cast<std::chrono::milliseconds>(took).count() << " ms";
    if (compressed) EXPECT_GT(gpu->encodings_begun, size_t(fault_at));  // the coder's fault
    for (int k = 0; k < n; ++k) {
      const absl::Status& st = nodes.ends(k).ends[0].second;
      EXPECT_FALSE(st.ok()) << "node " << k;
      EXPECT_NE(st.message().find("device fault (test)"), std::string::npos)
          << "node " << k << ": " << st;
      if (k == 1) EXPECT_EQ(st.code(), absl::StatusCode::kInternal) << st;
    }
  }
}

// However an operation on a staged node ends (run, failed on the device,
// refused by the coordinator, left unrun when the job is left), its staged
// buffer is gone before the ranks hear: it keeps their memory open, and a
// rank may free its buffers and allocate new ones at the same address as
// soon as it hears (a GPU daemon then could not open them while the old
// mappings are still held).
TEST(ClusterJobStagedTest, TheStagedBufferIsGoneBeforeTheRanksHear) {
  enum Case { kRun, kDeviceFault, kMismatch, kLeft };
  for (Case c : {kRun, kDeviceFault, kMismatch, kLeft}) {
    SCOPED_TRACE(c);
    Nodes nodes(2);
    ASSERT_TRUE(nodes.SetBoth("staging_segment_bytes", "4K").ok());
    ASSERT_TRUE(nodes.SetBoth("op_timeout_ms", "3000").ok());
    const size_t count = 3000;
    std::vector<float> send[2], recv[2];
    std::weak_ptr<HostStagedBuffer> staged;
    std::atomic<int> ended_alive{0}, ended{0};
    nodes.ends(0).on_end = [&](uint64_t) {
      ++ended;
      if (!staged.expired()) ++ended_alive;
    };
    for (int k = 0; k < 2; ++k) {
      send[k].assign(count, 1.0f);
      recv[k].assign(count, 0.0f);
      if (k == 1 && c == kLeft) break;  // node 1 never submits
      const size_t n = c == kMismatch && k == 1 ? count - 1 : count;
      ClusterOp op = Allreduce(1, "x", wire::DataType::kFloat32, wire::ReduceOp::kSum, n, k,
                               send[k].data(), recv[k].data());
      if (k == 0) {
        auto b = std::make_shared<HostStagedBuffer>(wire::DataType::kFloat32, count,
                                                    std::vector<const void*>{send[0].data()},
                                                    std::vector<void*>{recv[0].data()});
        if (c == kDeviceFault) b->fail_fetch_at = 4096;
        staged = b;
        StageOn(op, std::move(b));
      }
      nodes.job(k).Submit(std::move(op));
    }
    if (c == kLeft) {
      // Once the Ready is with the coordinator, the node leaves.
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
      nodes.job(0).Abort(absl::CancelledError("the trainer left"));
    }
    ASSERT_TRUE(nodes.ends(0).WaitFor(1));
    const absl::Status& s = nodes.ends(0).ends[0].second;
    EXPECT_EQ(s.ok(), c == kRun) << s;
    if (c == kMismatch) EXPECT_NE(s.message().find("mismatched"), std::string::npos) << s;
    if (c == kRun) EXPECT_EQ(recv[0][count - 1], 2.0f);
    EXPECT_EQ(ended.load(), 1);
    EXPECT_EQ(ended_alive.load(), 0) << "the ranks heard while the staged buffer was alive";
    if (c != kLeft) ASSERT_TRUE(nodes.ends(1).WaitFor(1));
  }
}

// Compressed allreduces on a staged node run through its coder where the
// buffer lives (int8, fp16, top-k; error feedback kept by the "device" under
// the operation's name across steps): results are the bits of the same
// operations with every node on the host, and so are they when the buffer
// offers no coder (staged whole, encoded on the CPU with the job's error
// feedback). Two steps of each name, so the residuals matter; a bf16
// allreduce beside (float32 only has error feedback) and an avg (divided
// where the buffer lives).
TEST(ClusterJobStagedTest, CompressedRunsWhereTheBufferLivesAndMatchesTheHostBits) {
  struct Op {
    std::string name;
    wire::DataType dtype;
    wire::ReduceOp op;
    size_t count;
  };
  const std::vector<Op> ops = {{"g", wire::DataType::kFloat32, wire::ReduceOp::kSum, 20000},
                               {"h", wire::DataType::kFloat32, wire::ReduceOp::kAvg, 30001},
                               {"b", wire::DataType::kBFloat16, wire::ReduceOp::kSum, 40000}};
  enum Mode { kAllHost, kCoder, kStagedWhole };
  for (const char* codec : {"int8", "fp16", "topk:0.1"}) {
    SCOPED_TRACE(codec);
    // results[mode][step][op][node]
    std::vector<std::vector<uint8_t>> results[3][2][3];
    for (Mode mode : {kAllHost, kCoder, kStagedWhole}) {
      // Compression on before the job forms: its direct_max_bytes then
      // stays under min_compress_bytes, so the names' second occurrences
      // (80 000 bytes and more) are compressed too, not run direct.
      Nodes nodes(2, 1, ClusterJob::kFeedbackBytes, {{"compression", codec}, {"chunk_bytes", "16K"}});
      ErrorFeedback residuals(64 << 20);
      bool coded = false;
      size_t ahead = 0;
      for (int step = 0; step < 2; ++step) {
        std::vector<std::vector<uint8_t>> send[2];
        std::vector<std::shared_ptr<HostStagedBuffer>> gpu;
        for (int k = 0; k < 2; ++k) {
          for (size_t o = 0; o < ops.size(); ++o) {
            const size_t es = wire::DataTypeSize(static_cast<uint32_t>(ops[o].dtype));
            send[k].emplace_back(ops[o].count * es);
            results[mode][step][o].resize(2);
            results[mode][step][o][k].assign(ops[o].count * es, 0);
            for (size_t i = 0; i < ops[o].count; ++i) {
              const float v = Value(k, o + 10 * step, i) * 100;
              if (ops[o].dtype == wire::DataType::kFloat32) {
                std::memcpy(send[k][o].data() + 4 * i, &v, 4);
              } else {
                const uint16_t h = reduce::FloatToBFloat16(v);
                std::memcpy(send[k][o].data() + 2 * i, &h, 2);
              }
            }
            ClusterOp op =
                Allreduce(step * 10 + o, ops[o].name, ops[o].dtype, ops[o].op, ops[o].count, k,
                          send[k][o].data(), results[mode][step][o][k].data());
            if (k == 0 && mode != kAllHost) {
              auto b = std::make_shared<HostStagedBuffer>(
                  ops[o].dtype, ops[o].count, std::vector<const void*>{send[k][o].data()},
                  std::vector<void*>{results[mode][step][o][k].data()});
              if (mode == kCoder) b->residuals = &residuals;
              gpu.push_back(b);
              StageOn(op, b);
            }
            nodes.job(k).Submit(std::move(op));
          }
        }
        for (int k = 0; k < 2; ++k) {
          ASSERT_TRUE(nodes.ends(k).WaitFor((step + 1) * ops.size())) << "node " << k;
        }
        for (auto& b : gpu) {
          for (const std::string& call : b->calls())
            coded = coded || call == "coder " + std::string(codec);
          ahead = std::max(ahead, b->most_encodings_ahead);
        }
      }
      for (int k = 0; k < 2; ++k) {
        for (auto& [key, st] : nodes.ends(k).ends) EXPECT_TRUE(st.ok()) << key << ": " << st;
      }
      EXPECT_EQ(coded, mode == kCoder);
      // The "device" encoded chunks ahead of those being sent.
      if (mode == kCoder) EXPECT_GE(ahead, 2u);
      // g and h twice; b too where the codec takes bfloat16 (fp16 does not).
      const uint64_t compressed = std::string(codec) == "fp16" ? 4 : 6;
      EXPECT_EQ(nodes.job(0).compression().ops, compressed);
      // For ciuicctl status: g's and h's residuals (bfloat16 keeps none),
      // on the "device" where it encodes, else in host memory; none dropped.
      const size_t bytes = (ops[0].count + ops[1].count) * sizeof(float);
      for (int k = 0; k < 2; ++k) {
        const ClusterJob::FeedbackCounters f = nodes.job(k).feedback();
        const bool on_device = k == 0 && mode == kCoder;
        EXPECT_EQ(f.host.names, on_device ? 0u : 2u) << "node " << k << " mode " << mode;
        EXPECT_EQ(f.host.bytes, on_device ? 0u : bytes) << "node " << k << " mode " << mode;
        EXPECT_EQ(f.device.names, on_device ? 2u : 0u) << "node " << k << " mode " << mode;
        EXPECT_EQ(f.device.bytes, on_device ? bytes : 0u) << "node " << k << " mode " << mode;
        for (const ErrorFeedback::Stats& s : {f.host, f.device}) {
          EXPECT_EQ(s.evictions + s.size_resets + s.too_large, 0u) << "node " << k;
        }
      }
    }
    for (int step = 0; step < 2; ++step) {
      for (size_t o = 0; o < ops.size(); ++o) {
        for (int k = 0; k < 2; ++k) {
          EXPECT_EQ(results[kCoder][step][o][k], results[kAllHost][step][o][k])
              << "coder: step " << step << " " << ops[o].name << " node " << k;
          EXPECT_EQ(results[kStagedWhole][step][o][k], results[kAllHost][step][o][k])
              << "staged whole: step " << step << " " << ops[o].name << " node " << k;
        }
      }
    }
    // Compression did something: g's result is not the exact sum everywhere.
    size_t inexact = 0;
    for (size_t i = 0; i < ops[0].count; ++i) {
      float got;
      std::memcpy(&got, results[kCoder][0][0][0].data() + 4 * i, 4);
      inexact += got != Value(0, 0, i) * 100 + Value(1, 0, i) * 100;
    }
    EXPECT_GT(inexact, 0u);
  }
}

// ------------------------------------------------- a coordinator that lies

// The coordinator's side of one node's ordering stream, played by the test:
// what the node writes is kept (Written), what the test sends (Send) is what
// the node reads.
class ScriptedStream final : public OrderingStream {
 public:
  bool Write(const proto::NodeEvent& event) override {
    std::lock_guard<std::mutex> lock(mu_);
    written_.push_back(event);
    cv_.notify_all();
    return true;
  }
  bool Read(proto::CoordinatorEvent* event) override {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return !to_read_.empty() || closed_; });
    if (to_read_.empty()) return false;
    *event = std::move(to_read_.front());
    to_read_.pop_front();
    return true;
  }
  void WritesDone() override {}
  absl::Status Finish() override { return absl::OkStatus(); }
  void Cancel() override {
    std::lock_guard<std::mutex> lock(mu_);
    closed_ = true;
    cv_.notify_all();
  }
  std::string Describe() const override { return "scripted (test)"; }

  int ReadiesLocked(const std::string& name) {
    int n = 0;
    for (const auto& e : written_) n += e.has_ready() && e.ready().name() == name;
    return n;
  }

  void Send(proto::CoordinatorEvent e) {
    std::lock_guard<std::mutex> lock(mu_);
    to_read_.push_back(std::move(e));
    cv_.notify_all();
  }
  // The message of the Done the node wrote for run `seq` (none: not written).
  std::optional<std::string> DoneMessage(uint64_t seq) {
    std::lock_guard<std::mutex> lock(mu_);
    for (const auto& e : written_) {
      if (e.has_done() && e.done().seq() == seq) return e.done().message();
    }
    return std::nullopt;
  }
  // Whether the node has written a Ready for `name` by now.
  bool Readied(const std::string& name) {
    std::lock_guard<std::mutex> lock(mu_);
    for (const auto& e : written_) {
      if (e.has_ready() && e.ready().name() == name) return true;
    }
    return false;
  }
  // Waits until the node has written a Ready for `name` (`count` of them).
  bool WaitForReady(const std::string& name, int count = 1) {
    std::unique_lock<std::mutex> lock(mu_);
    return cv_.wait_for(lock, std::chrono::seconds(10),
                        [&] { return ReadiesLocked(name) >= count; });
  }
  int Readies(const std::string& name) {
    std::lock_guard<std::mutex> lock(mu_);
    return ReadiesLocked(name);
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<proto::NodeEvent> written_;
  std::deque<proto::CoordinatorEvent> to_read_;
  bool closed_ = false;
};

// Registers once `formed` is ready (node 0 of two, the other node a
// stand-in that never speaks) and hands the ClusterJob the scripted stream.
class ScriptedClient final : public CoordinatorClient {
 public:
  ScriptedClient(std::shared_ptr<ScriptedStream> stream, std::shared_future<void> formed)
      : stream_(std::move(stream)), formed_(std::move(formed)) {}
  absl::StatusOr<proto::Membership> Register(const proto::RegisterNodeRequest& request,
                                             std::chrono::system_clock::time_point) override {
    formed_.wait();
    proto::Membership m;
    m.set_instance(1);
    m.set_channels(1);
    m.set_protocol(kPeerProtocol);
    auto* self = m.add_nodes();
    self->set_node_name(request.node_name());
    self->add_ranks(0);
    self->add_transport_addresses("hub");
    auto* other = m.add_nodes();
    other->set_node_name("other");
    other->add_ranks(1);
    other->add_transport_addresses("hub");
    return m;
  }
  void CancelRegister() override {}
  absl::StatusOr<std::unique_ptr<OrderingStream>> OpenStream(uint32_t) override {
    // The job owns what it gets; the test keeps talking through its copy.
    struct Shared final : OrderingStream {
      explicit Shared(std::shared_ptr<ScriptedStream> s) : s(std::move(s)) {}
      bool Write(const proto::NodeEvent& e) override { return s->Write(e); }
      bool Read(proto::CoordinatorEvent* e) override { return s->Read(e); }
      void WritesDone() override { s->WritesDone(); }
      absl::Status Finish() override { return s->Finish(); }
      void Cancel() override { s->Cancel(); }
      std::string Describe() const override { return s->Describe(); }
      std::shared_ptr<ScriptedStream> s;
    };
    return std::unique_ptr<OrderingStream>(new Shared(stream_));
  }

 private:
  std::shared_ptr<ScriptedStream> stream_;
  std::shared_future<void> formed_;
};

// One node (rank 0 of 2) ordered by the test; with `hold`, its job forms
// only at Form().
class ScriptedNode {
 public:
  explicit ScriptedNode(bool hold = false,
                        std::chrono::milliseconds announce_grace = std::chrono::seconds(5))
      : hub_(2, 1), stream_(std::make_shared<ScriptedStream>()), formed_(gate_.get_future()) {
    if (!hold) Form();
    ClusterJob::Options o;
    o.job_id = "job";
    o.uid = 1;
    o.world_size = 2;
    o.local_ranks = {0};
    o.node_name = "n0";
    o.coordinator = "scripted";
    o.channels = 1;
    o.tuning = &tuning_;
    o.announce_grace = announce_grace;
    o.transports = [this](int) -> absl::StatusOr<std::unique_ptr<UnconnectedTransport>> {
      return std::make_unique<HubUnconnected>(&hub_);
    };
    o.coordinator_clients = [this](const std::string&) -> std::unique_ptr<CoordinatorClient> {
      return std::make_unique<ScriptedClient>(stream_, formed_);
    };
    job_ = std::make_unique<ClusterJob>(
        std::move(o),
        [this](uint64_t key, absl::Status s) {
          std::lock_guard<std::mutex> lock(ends_.mu);
          ends_.ends.emplace_back(key, std::move(s));
          ends_.cv.notify_all();
        },
        [this](absl::Status s) {
          std::lock_guard<std::mutex> lock(ends_.mu);
          job_failure_ = std::move(s);
          ends_.cv.notify_all();
        });
  }
  ~ScriptedNode() {
    Form();  // a held registration ends
    job_.reset();
  }
  void Form() {
    if (!gate_set_) gate_.set_value();
    gate_set_ = true;
  }

  ClusterJob& job() { return *job_; }
  ScriptedStream& stream() { return *stream_; }
  InProcessHub& hub() { return hub_; }
  Ends& ends() { return ends_; }
  absl::Status job_failure() {
    std::lock_guard<std::mutex> lock(ends_.mu);
    return job_failure_;
  }
  // The job's failure once reported (OK if none within 10 s).
  absl::Status WaitForJobFailure() {
    std::unique_lock<std::mutex> lock(ends_.mu);
    ends_.cv.wait_for(lock, std::chrono::seconds(10), [&] { return !job_failure_.ok(); });
    return job_failure_;
  }
  absl::Status EndOf(uint64_t key) {
    std::lock_guard<std::mutex> lock(ends_.mu);
    for (auto& [k, s] : ends_.ends) {
      if (k == key) return s;
    }
    return absl::UnknownError("not ended");
  }

  // The coordinator's events.
  static proto::CoordinatorEvent Run(const std::string& name, uint64_t seq,
                                     std::vector<std::string> fused = {}) {
    proto::CoordinatorEvent e;
    e.mutable_run()->set_name(name);
    e.mutable_run()->set_seq(seq);
    for (auto& f : fused) e.mutable_run()->add_fused_with(f);
    e.mutable_run()->set_chunk_bytes(1 << 20);
    e.mutable_run()->set_chunks_in_flight(8);
    return e;
  }
  static proto::CoordinatorEvent JobFailed(absl::StatusCode code, const std::string& message) {
    proto::CoordinatorEvent e;
    e.mutable_job_failed()->set_code(static_cast<int>(code));
    e.mutable_job_failed()->set_message(message);
    e.mutable_job_failed()->set_runs_cut_off(true);
    return e;
  }
  static proto::CoordinatorEvent Fail(const std::string& name, absl::StatusCode code,
                                      const std::string& message) {
    proto::CoordinatorEvent e;
    e.mutable_fail()->set_name(name);
    e.mutable_fail()->set_code(static_cast<int>(code));
    e.mutable_fail()->set_message(message);
    return e;
  }

 private:
  config::TuningRegistry tuning_;
  InProcessHub hub_;
  std::shared_ptr<ScriptedStream> stream_;
  std::promise<void> gate_;
  std::shared_future<void> formed_;
  bool gate_set_ = false;
  Ends ends_;
  absl::Status job_failure_;
  std::unique_ptr<ClusterJob> job_;
};

ClusterOp Barrier(uint64_t key, const std::string& name) {
  ClusterOp c;
  c.key = key;
  c.name = name;
  c.sig.collective = static_cast<uint32_t>(wire::Collective::kBarrier);
  c.parts.push_back(ClusterOp::Part{0, nullptr, nullptr});
  return c;
}

// An operation whose deadline passes while the job forms is taken back by
// the engine (which ends it): it is never readied and never ends here; one
// not taken back goes on once the job has formed, and can no longer be
// taken back then.
TEST(ClusterJobProtocolTest, AnOperationTakenBackWhileTheJobFormsNeverRuns) {
  ScriptedNode node(/*hold=*/true);
  node.job().Submit(Barrier(1, "a"));
  node.job().Submit(Barrier(2, "b"));
  EXPECT_EQ(node.job().state(), ClusterJob::State::kForming);
  std::optional<ClusterOp> back = node.job().TakeBackUnformed(1);
  ASSERT_TRUE(back.has_value());
  EXPECT_EQ(back->name, "a");
  EXPECT_FALSE(node.job().TakeBackUnformed(1).has_value()) << "taken back twice";
  EXPECT_FALSE(node.job().TakeBackUnformed(7).has_value()) << "never submitted";
  node.Form();
  ASSERT_TRUE(node.stream().WaitForReady("b"));
  EXPECT_FALSE(node.job().TakeBackUnformed(2).has_value()) << "taken back after it was readied";
  node.stream().Send(ScriptedNode::Run("b", 0));
  ASSERT_TRUE(node.ends().WaitFor(1));
  EXPECT_TRUE(node.EndOf(2).ok()) << node.EndOf(2);
  EXPECT_FALSE(node.stream().Readied("a"));
  EXPECT_EQ(node.EndOf(1).code(), absl::StatusCode::kUnknown) << "ended here too";
}

// What the coordinator says is done: a Run completes the operation, a Fail
// ends it with the coordinator's code and message, and the job goes on.
TEST(ClusterJobProtocolTest, RunsCompleteAndFailsEndTheNamedOperation) {
  ScriptedNode node;
  node.job().Submit(Barrier(1, "b"));
  ASSERT_TRUE(node.stream().WaitForReady("b"));
  node.stream().Send(ScriptedNode::Run("b", 0));
  ASSERT_TRUE(node.ends().WaitFor(1));
  EXPECT_TRUE(node.EndOf(1).ok()) << node.EndOf(1);
  node.job().Submit(Barrier(2, "x"));
  ASSERT_TRUE(node.stream().WaitForReady("x"));
  node.stream().Send(ScriptedNode::Fail("x", absl::StatusCode::kInvalidArgument,
                                        "operation 'x' mismatched across nodes"));
  ASSERT_TRUE(node.ends().WaitFor(2));
  EXPECT_EQ(node.EndOf(2).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(node.EndOf(2).message().find("mismatched"), std::string::npos);
  node.job().Submit(Barrier(3, "c"));
  ASSERT_TRUE(node.stream().WaitForReady("c"));
  node.stream().Send(ScriptedNode::Run("c", 1));
  ASSERT_TRUE(node.ends().WaitFor(3));
  EXPECT_TRUE(node.EndOf(3).ok()) << node.EndOf(3);
  EXPECT_TRUE(node.job_failure().ok());
}

// A name submitted again before its earlier occurrence was announced
// waits its turn: one Ready per name at a time (the coordinator knows one
// occurrence of a name), the next once the earlier one has run or failed;
// none is lost and each ends in submission order.
TEST(ClusterJobProtocolTest, ANameResubmittedBeforeItRanWaitsItsTurn) {
  ScriptedNode node;
  node.job().Submit(Barrier(1, "x"));
  node.job().Submit(Barrier(2, "x"));
  node.job().Submit(Barrier(3, "x"));
  node.job().Submit(Barrier(4, "other"));
  ASSERT_TRUE(node.stream().WaitForReady("other"));  // after both x's submits
  EXPECT_EQ(node.stream().Readies("x"), 1);
  node.stream().Send(ScriptedNode::Run("x", 0));
  ASSERT_TRUE(node.stream().WaitForReady("x", 2));
  ASSERT_TRUE(node.ends().WaitFor(1));
  EXPECT_TRUE(node.EndOf(1).ok()) << node.EndOf(1);
  EXPECT_EQ(node.EndOf(2).code(), absl::StatusCode::kUnknown) << "not ended yet";
  node.stream().Send(ScriptedNode::Fail("x", absl::StatusCode::kDeadlineExceeded, "timed out"));
  ASSERT_TRUE(node.stream().WaitForReady("x", 3));
  ASSERT_TRUE(node.ends().WaitFor(2));
  EXPECT_EQ(node.EndOf(2).code(), absl::StatusCode::kDeadlineExceeded);
  node.stream().Send(ScriptedNode::Run("x", 1));
  node.stream().Send(ScriptedNode::Run("other", 2));
  ASSERT_TRUE(node.ends().WaitFor(4));
  EXPECT_TRUE(node.EndOf(3).ok()) << node.EndOf(3);
  EXPECT_TRUE(node.EndOf(4).ok()) << node.EndOf(4);
  EXPECT_EQ(node.stream().Readies("x"), 3);
  EXPECT_TRUE(node.job_failure().ok());
}

// A coordinator that neither announces nor fails a readied operation
// (stopped, hung) ends the job on this node once the operation's timeout
// and the grace have passed since the node last heard from it, naming the
// coordinator and the operation; one that answers in time does not.
TEST(ClusterJobProtocolTest, ACoordinatorThatGoesSilentEndsTheJobAfterTheTimeout) {
  ScriptedNode node(/*hold=*/false, std::chrono::milliseconds(200));
  ClusterOp answered = Barrier(1, "answered");
  answered.timeout_ms = 300;
  node.job().Submit(std::move(answered));
  ASSERT_TRUE(node.stream().WaitForReady("answered"));
  std::this_thread::sleep_for(std::chrono::milliseconds(250));  // within 300 + 200 ms
  node.stream().Send(ScriptedNode::Run("answered", 0));
  ASSERT_TRUE(node.ends().WaitFor(1));
  EXPECT_TRUE(node.EndOf(1).ok()) << node.EndOf(1);

  ClusterOp silent = Barrier(2, "silent");
  silent.timeout_ms = 300;
  const auto start = std::chrono::steady_clock::now();
  node.job().Submit(std::move(silent));
  ASSERT_TRUE(node.stream().WaitForReady("silent"));
  absl::Status failed = node.WaitForJobFailure();
  const auto took = std::chrono::steady_clock::now() - start;
  EXPECT_EQ(failed.code(), absl::StatusCode::kUnavailable) << failed;
  EXPECT_NE(failed.message().find("(scripted)"), std::string::npos) << failed;
  EXPECT_NE(failed.message().find("'silent'"), std::string::npos) << failed;
  EXPECT_GE(took, std::chrono::milliseconds(500));
  EXPECT_LT(took, std::chrono::seconds(5));
  ASSERT_TRUE(node.ends().WaitFor(2));
  EXPECT_EQ(node.EndOf(2).code(), absl::StatusCode::kUnavailable);
}

// Occurrences still held when the job fails end with the job's failure.
TEST(ClusterJobProtocolTest, HeldOccurrencesEndWithTheJob) {
  ScriptedNode node;
  node.job().Submit(Barrier(1, "x"));
  node.job().Submit(Barrier(2, "x"));
  ASSERT_TRUE(node.stream().WaitForReady("x"));
  node.stream().Send(ScriptedNode::JobFailed(absl::StatusCode::kUnavailable, "lost node other"));
  ASSERT_TRUE(node.ends().WaitFor(2));
  EXPECT_EQ(node.EndOf(1).code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(node.EndOf(2).code(), absl::StatusCode::kUnavailable);
}

// Submits allreduce "a" (key 1) of `data` on `node` and has the coordinator
// announce it (run 0): it then waits for the other node, which is silent.
void RunWaitingForTheSilentNode(ScriptedNode& node, std::vector<float>& data) {
  node.job().Submit(Allreduce(1, "a", wire::DataType::kFloat32, wire::ReduceOp::kSum, data.size(),
                              0, data.data(), data.data()));
  ASSERT_TRUE(node.stream().WaitForReady("a"));
  node.stream().Send(ScriptedNode::Run("a", 0));
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
}

// A run cut off by its peer (the transport's UNAVAILABLE: here the other
// node's transfers fail, as when a node whose job failed closes its
// endpoints) ends with the coordinator's verdict when that follows within
// the grace, naming the node that really failed, and this node's own
// reason after it; without a verdict, with its own reason once the grace
// is over.
TEST(ClusterJobProtocolTest, ARunCutOffByAPeerEndsWithTheCoordinatorsVerdict) {
  for (const bool verdict : {true, false}) {
    SCOPED_TRACE(verdict ? "with a verdict" : "without one");
    ScriptedNode node;
    std::vector<float> data(1000, 1.0f);
    RunWaitingForTheSilentNode(node, data);
    if (HasFatalFailure()) return;
    const auto cut = std::chrono::steady_clock::now();
    node.hub().KillNode(1);
    if (verdict) {
      std::this_thread::sleep_for(std::chrono::milliseconds(30));
      node.stream().Send(ScriptedNode::JobFailed(
          absl::StatusCode::kUnavailable, "lost node n2 of job 'job': its stream ended"));
    }
    ASSERT_TRUE(node.ends().WaitFor(1));
    const auto took = std::chrono::steady_clock::now() - cut;
    const absl::Status s = node.EndOf(1);
    EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
    EXPECT_NE(s.message().find("node 1 is gone"), std::string::npos) << s;
    if (verdict) {
      EXPECT_EQ(s.message().find("lost node n2 of job 'job': its stream ended (here: "), 0u) << s;
    } else {
      EXPECT_EQ(s.message().find("n2"), std::string::npos) << s;
      EXPECT_GE(took, ClusterJob::kVerdictGrace) << "ended before the grace was over";
    }
    EXPECT_LT(took, std::chrono::seconds(5));
  }
}

// A run cut off by the job's own end fails with that end's reason alone,
// not wrapped in the transport's words ("AllreduceRing: receive from node 1
// ... failed: lost peer 1: <reason>"): a trainer hears wire::kMaxMessage
// bytes, and with the other nodes' messages nested in front the reason fell
// past them. Its end here (a rank left: Abort) and the coordinator's
// (JobFailed); the Done the node writes, if it still writes one, says the
// same.
TEST(ClusterJobProtocolTest, ARunCutOffByTheJobsEndFailsWithItsReasonAlone) {
  for (const bool here : {true, false}) {
    SCOPED_TRACE(here ? "a rank here left" : "the coordinator failed the job");
    ScriptedNode node;
    std::vector<float> data(1000, 1.0f);
    RunWaitingForTheSilentNode(node, data);
    if (HasFatalFailure()) return;
    const std::string why =
        here ? "rank 0 (pid 7) of job 'job' left: trainer disconnected"
             : "node other (rank 1) failed run 0 of job 'job': rank 1 (pid 8) of job 'job' left: "
               "trainer disconnected";
    if (here) {
      node.job().Abort(absl::AbortedError(why));
    } else {
      node.stream().Send(ScriptedNode::JobFailed(absl::StatusCode::kAborted, why));
    }
    ASSERT_TRUE(node.ends().WaitFor(1));
    const absl::Status s = node.EndOf(1);
    EXPECT_EQ(s.code(), absl::StatusCode::kAborted) << s;
    EXPECT_EQ(std::string(s.message()), why);
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    if (auto done = node.stream().DoneMessage(0)) EXPECT_EQ(*done, why);
  }
}

// A coordinator that breaks the protocol (another version, a bug) fails the
// job with a message naming what it did, and every pending operation with
// it; the daemon does not crash or hang: a Run of an operation this node
// never readied, Runs without valid settings (each kind), a fused Run that
// packs operations that cannot be packed.
TEST(ClusterJobProtocolTest, ACoordinatorThatBreaksTheProtocolFailsTheJobClearly) {
  struct Case {
    std::string what;
    std::function<proto::CoordinatorEvent()> event;
    std::string message;
  };
  const std::vector<Case> cases = {
      {"unknown name", [] { return ScriptedNode::Run("ghost", 0); }, "never readied"},
      {"no chunk size",
       [] {
         auto e = ScriptedNode::Run("p", 0);
         e.mutable_run()->set_chunk_bytes(0);
         return e;
       },
       "without valid settings"},
      {"too many chunks in flight",
       [] {
         auto e = ScriptedNode::Run("p", 0);
         e.mutable_run()->set_chunks_in_flight(65);
         return e;
       },
       "without valid settings"},
      {"unknown algorithm",
       [] {
         auto e = ScriptedNode::Run("p", 0);
         e.mutable_run()->set_algorithm(9);
         return e;
       },
       "without valid settings"},
      {"too many segments",
       [] {
         auto e = ScriptedNode::Run("p", 0);
         e.mutable_run()->set_segment_bytes(4096);
         e.mutable_run()->set_segments(4097);
         return e;
       },
       "without valid settings"},
      {"a barrier fused with an allreduce", [] { return ScriptedNode::Run("p", 0, {"q"}); },
       "do not match"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    ScriptedNode node;
    float in = 1, out = 0;
    node.job().Submit(Barrier(1, "p"));
    node.job().Submit(
        Allreduce(2, "q", wire::DataType::kFloat32, wire::ReduceOp::kSum, 1, 0, &in, &out));
    ASSERT_TRUE(node.stream().WaitForReady("q"));
    node.stream().Send(c.event());
    ASSERT_TRUE(node.ends().WaitFor(2));
    for (uint64_t key : {1, 2}) {
      const absl::Status s = node.EndOf(key);
      EXPECT_FALSE(s.ok()) << key;
    }
    const absl::Status failure = node.WaitForJobFailure();
    EXPECT_FALSE(failure.ok());
    EXPECT_NE(failure.message().find(c.message), std::string::npos) << failure;
    EXPECT_EQ(node.job().state(), ClusterJob::State::kFailed);
  }
}

// An alltoall announced in segments without their number (a coordinator of
// another version) fails that operation, saying so, instead of guessing a
// cut its peers may not share.
TEST(ClusterJobProtocolTest, AnAlltoallInSegmentsWithoutTheirNumberFailsClearly) {
  ScriptedNode node;
  std::vector<float> in(4, 1), out(4, 0);
  ClusterOp op;
  op.key = 1;
  op.name = "a2a";
  op.sig.collective = static_cast<uint32_t>(wire::Collective::kAlltoall);
  op.sig.dtype = static_cast<uint32_t>(wire::DataType::kFloat32);
  op.sig.count = 2;
  op.parts.push_back(ClusterOp::Part{0, reinterpret_cast<const uint8_t*>(in.data()),
                                     reinterpret_cast<uint8_t*>(out.data()), {}, {}});
  node.job().Submit(std::move(op));
  ASSERT_TRUE(node.stream().WaitForReady("a2a"));
  auto run = ScriptedNode::Run("a2a", 0);
  run.mutable_run()->set_segment_bytes(4096);  // and no segments
  node.stream().Send(run);
  ASSERT_TRUE(node.ends().WaitFor(1));
  const absl::Status s = node.EndOf(1);
  EXPECT_EQ(s.code(), absl::StatusCode::kInternal) << s;
  EXPECT_NE(s.message().find("in segments without their number"), std::string::npos) << s;
}

// A coordinator that answers registration with a table given by the test,
// and counts what the job does after it.
class TableClient final : public CoordinatorClient {
 public:
  TableClient(proto::Membership table, std::atomic<int>* streams)
      : table_(std::move(table)), streams_(streams) {}
  absl::StatusOr<proto::Membership> Register(const proto::RegisterNodeRequest&,
                                             std::chrono::system_clock::time_point) override {
    return table_;
  }
  void CancelRegister() override {}
  absl::StatusOr<std::unique_ptr<OrderingStream>> OpenStream(uint32_t) override {
    ++*streams_;
    return absl::UnavailableError("no stream here");
  }

 private:
  const proto::Membership table_;
  std::atomic<int>* const streams_;
};

// Node "n0" hosts ranks 0 and 1 of 4 with one channel; `edit` spoils the
// good table (n0: 0,1; n1: 2,3).
proto::Membership Table(const std::function<void(proto::Membership&)>& edit) {
  proto::Membership m;
  m.set_instance(1);
  m.set_channels(1);
  m.set_protocol(kPeerProtocol);
  for (int n = 0; n < 2; ++n) {
    auto* node = m.add_nodes();
    node->set_node_name("n" + std::to_string(n));
    node->add_ranks(2 * n);
    node->add_ranks(2 * n + 1);
    node->add_transport_addresses("hub");
  }
  edit(m);
  return m;
}

// A table the coordinator sends is checked before any index from it is
// used: a missing rank, a rank on two nodes, another channel count, too few
// transport addresses, this node absent or with other ranks, too many
// nodes, each fails the job with DATA_LOSS naming the problem and the
// coordinator (it never opens an ordering stream). A coordinator of another
// peer protocol (another ciuicd version) fails it with FAILED_PRECONDITION
// naming both protocols.
TEST(ClusterJobTest, ABadMembershipTableFailsTheJobNamingIt) {
  struct Case {
    std::string why;
    std::function<void(proto::Membership&)> edit;
    absl::StatusCode code = absl::StatusCode::kDataLoss;
  };
  const std::vector<Case> cases = {
      {"rank 3 is on no node",
       [](proto::Membership& m) { m.mutable_nodes(1)->mutable_ranks()->RemoveLast(); }},
      {"rank 1 is on node n0 and on node n1",
       [](proto::Membership& m) { m.mutable_nodes(1)->set_ranks(1, 1); }},
      {"2 channels where this node has 1", [](proto::Membership& m) { m.set_channels(2); }},
      {"node n1 has 2 transport addresses for 1 channels",
       [](proto::Membership& m) { m.mutable_nodes(1)->add_transport_addresses("hub"); }},
      {"has rank 7, not in a world of size 4",
       [](proto::Membership& m) { m.mutable_nodes(1)->set_ranks(1, 7); }},
      {"has rank -1", [](proto::Membership& m) { m.mutable_nodes(0)->set_ranks(1, -1); }},
      {"this node (n0, ranks 0,1) appears as node n9",
       [](proto::Membership& m) { m.mutable_nodes(0)->set_node_name("n9"); }},
      {"5 nodes for 4 ranks",
       [](proto::Membership& m) {
         for (int i = 0; i < 3; ++i) *m.add_nodes() = m.nodes(1);
       }},
      {"0 nodes for 4 ranks", [](proto::Membership& m) { m.clear_nodes(); }},
      {absl::StrCat("coordinator 10.0.0.9:7361 runs peer protocol ", kPeerProtocol + 1,
                    " and node n0 runs peer protocol ", kPeerProtocol,
                    ": the daemons of one job must speak the same protocol"),
       [](proto::Membership& m) { m.set_protocol(kPeerProtocol + 1); },
       absl::StatusCode::kFailedPrecondition},
      {"coordinator 10.0.0.9:7361 runs a ciuicd that predates peer protocol numbers",
       [](proto::Membership& m) { m.clear_protocol(); }, absl::StatusCode::kFailedPrecondition},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.why);
    config::TuningRegistry tuning;
    InProcessHub hub(2, 1);
    std::atomic<int> streams{0};
    Ends ends;
    std::mutex mu;
    absl::Status failed;
    ClusterJob::Options o;
    o.job_id = "job";
    o.uid = 1;
    o.world_size = 4;
    o.local_ranks = {0, 1};
    o.node_name = "n0";
    o.coordinator = "10.0.0.9:7361";
    o.channels = 1;
    o.tuning = &tuning;
    o.transports = [&](int) -> absl::StatusOr<std::unique_ptr<UnconnectedTransport>> {
      return std::make_unique<HubUnconnected>(&hub);
    };
    const proto::Membership table = Table(c.edit);
    o.coordinator_clients = [&](const std::string&) -> std::unique_ptr<CoordinatorClient> {
      return std::make_unique<TableClient>(table, &streams);
    };
    auto job = std::make_unique<ClusterJob>(
        std::move(o),
        [&](uint64_t key, absl::Status s) {
          std::lock_guard<std::mutex> lock(ends.mu);
          ends.ends.emplace_back(key, std::move(s));
          ends.cv.notify_all();
        },
        [&](absl::Status s) {
          std::lock_guard<std::mutex> lock(mu);
          failed = std::move(s);
        });
    std::vector<float> v(4, 1.0f), w(4, 1.0f);
    ClusterOp op = Allreduce(1, "a", wire::DataType::kFloat32, wire::ReduceOp::kSum, v.size(), 0,
                             v.data(), v.data());
    op.parts.push_back(ClusterOp::Part{1, reinterpret_cast<const uint8_t*>(w.data()),
                                       reinterpret_cast<uint8_t*>(w.data())});
    job->Submit(std::move(op));
    ASSERT_TRUE(ends.WaitFor(1));
    const absl::Status s = ends.ends[0].second;
    EXPECT_EQ(s.code(), c.code) << s;
    EXPECT_NE(s.message().find(c.why), std::string::npos) << s;
    if (c.code == absl::StatusCode::kDataLoss) {
      EXPECT_NE(s.message().find("coordinator 10.0.0.9:7361 sent a bad membership table"),
                std::string::npos)
          << s;
    }
    EXPECT_EQ(job->state(), ClusterJob::State::kFailed);
    EXPECT_EQ(streams.load(), 0);
    job.reset();
  }
}

}  // namespace
}  // namespace ciuic::daemon
