// ClusterJob without gRPC or UCX: a real Coordinator reached through a
// CoordinatorClient that calls it directly, and the nodes' transports from
// one InProcessHub. Each node has one local rank whose buffers are plain
// memory.
#include "cluster/cluster_job.h"

#include <gtest/gtest.h>

#include <cmath>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <vector>

#include "cluster/coordinator.h"
#include "collectives/internode/in_process_transport.h"
#include "transport/forwarding_transport.h"

namespace ciuic::daemon {
namespace {

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
  bool WaitFor(size_t n) {
    std::unique_lock<std::mutex> lock(mu);
    return cv.wait_for(lock, std::chrono::seconds(30), [&] { return ends.size() >= n; });
  }
};

// Two nodes, one rank each, their jobs and the coordinator.
class TwoNodes {
 public:
  // Each node has its own daemon tuning; node 0's daemon hosts the
  // coordinator (rank 0), so its tuning decides the runs' settings.
  TwoNodes() : coordinator_("token", &tuning_[0]), hub_(2, 1) {
    for (int k = 0; k < 2; ++k) {
      ClusterJob::Options o;
      o.job_id = "job";
      o.uid = 1;
      o.world_size = 2;
      o.local_ranks = {k};
      o.node_name = "n" + std::to_string(k);
      o.coordinator = "direct";
      o.cluster_token = "token";
      o.channels = 1;
      o.tuning = &tuning_[k];
      o.transports = [this](int) -> absl::StatusOr<std::unique_ptr<UnconnectedTransport>> {
        return std::make_unique<HubUnconnected>(&hub_);
      };
      o.coordinator_clients = [this](const std::string&) -> std::unique_ptr<CoordinatorClient> {
        return std::make_unique<DirectClient>(&coordinator_, &client_streams_);
      };
      // Node 0's daemon is the coordinator's: it orders in-process.
      if (k == 0) o.local_coordinator = &coordinator_;
      Ends* ends = &ends_[k];
      jobs_[k] = std::make_unique<ClusterJob>(
          std::move(o),
          [ends](uint64_t key, absl::Status s) {
            std::lock_guard<std::mutex> lock(ends->mu);
            ends->ends.emplace_back(key, std::move(s));
            ends->cv.notify_all();
          },
          [](absl::Status) {});
    }
  }
  ~TwoNodes() {
    for (auto& j : jobs_) j.reset();
  }
  // Sets a tuning key on both nodes' daemons.
  absl::Status SetBoth(const std::string& key, const std::string& value) {
    for (auto& t : tuning_) {
      if (absl::Status s = t.Set(key, value); !s.ok()) return s;
    }
    return absl::OkStatus();
  }
  config::TuningRegistry& tuning(int k) { return tuning_[k]; }
  ClusterJob& job(int k) { return *jobs_[k]; }
  Ends& ends(int k) { return ends_[k]; }
  int client_streams() const { return client_streams_.load(); }

 private:
  std::atomic<int> client_streams_{0};
  config::TuningRegistry tuning_[2];
  Coordinator coordinator_;
  InProcessHub hub_;
  Ends ends_[2];
  std::unique_ptr<ClusterJob> jobs_[2];
};

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
      ASSERT_EQ(std::memcmp(recv[0][k][o].data(), recv[1][k][o].data(), 4 * send[k][o].size()), 0)
          << "node " << k << " op " << o << ": fused and unfused results differ";
    }
  }
}

// Compressed allreduces fuse too (int8, fp16): many of them, of sizes over
// min_compress_bytes, sum and avg, submitted in opposite orders on the two
// nodes, beside small and max ones that go uncompressed. Compressed results
// are within the codec's bound of the float64 sum and the same bits on both
// nodes; uncompressed ones are exact (had one been packed with compressed
// ones, it would not be, and the node would refuse the run); both kinds
// fuse (counted).
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

}  // namespace
}  // namespace ciuic::daemon
