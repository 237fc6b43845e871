// The inter-node algorithms with nodes as threads over InProcessHub: results
// against plain loops (integer-valued data, so every result is exact), bitwise
// agreement between nodes on arbitrary floats, allgather layouts, broadcast
// from every root, and faults (a node killed mid-operation, sizes that
// disagree, a node that never shows up): errors, never hangs.
#include "collectives/internode/internode.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "collectives/internode/in_process_transport.h"
#include "collectives/internode/sends_in_flight.h"
#include "collectives/internode/schedule.h"
#include "reduce/half.h"
#include "transport/forwarding_transport.h"
#include "reduce/reduce.h"

namespace ciuic::daemon {
namespace {

using std::chrono::milliseconds;
using wire::DataType;
using wire::ReduceOp;
using Clock = std::chrono::steady_clock;

constexpr DataType kTypes[] = {DataType::kFloat32, DataType::kFloat64, DataType::kFloat16,
                               DataType::kBFloat16, DataType::kInt8,   DataType::kUInt8,
                               DataType::kInt32,   DataType::kInt64};
constexpr ReduceOp kOps[] = {ReduceOp::kSum, ReduceOp::kMin, ReduceOp::kMax, ReduceOp::kProd};

size_t Size(DataType t) { return wire::DataTypeSize(static_cast<uint32_t>(t)); }
std::string Name(DataType t) { return wire::DataTypeName(static_cast<uint32_t>(t)); }
std::string Name(ReduceOp op) { return wire::ReduceOpName(static_cast<uint32_t>(op)); }
bool IsUnsigned(DataType t) { return t == DataType::kUInt8; }

// Stores integer-valued v (exactly representable) as element i.
void Put(DataType t, void* p, size_t i, int64_t v) {
  switch (t) {
    case DataType::kFloat32: static_cast<float*>(p)[i] = static_cast<float>(v); return;
    case DataType::kFloat64: static_cast<double*>(p)[i] = static_cast<double>(v); return;
    case DataType::kFloat16:
      static_cast<uint16_t*>(p)[i] = FloatToHalf(static_cast<float>(v));
      return;
    case DataType::kBFloat16:
      static_cast<uint16_t*>(p)[i] = FloatToBFloat16(static_cast<float>(v));
      return;
    case DataType::kInt8: static_cast<int8_t*>(p)[i] = static_cast<int8_t>(v); return;
    case DataType::kUInt8: static_cast<uint8_t*>(p)[i] = static_cast<uint8_t>(v); return;
    case DataType::kInt32: static_cast<int32_t*>(p)[i] = static_cast<int32_t>(v); return;
    case DataType::kInt64: static_cast<int64_t*>(p)[i] = v; return;
  }
}

// Deterministic small integers for (node, element), in a range where every
// result of `op` over 8 nodes is exact in every dtype (products are powers
// of two up to 2^8, which int8/uint8 wrap the same way in both computations).
int64_t Value(ReduceOp op, DataType t, int node, size_t i) {
  uint64_t h = (i + 1) * 0x9E3779B97F4A7C15ull ^ (static_cast<uint64_t>(node) + 7) * 0xC2B2AE3D27D4EB4Full;
  h ^= h >> 29;
  h *= 0xBF58476D1CE4E5B9ull;
  h ^= h >> 32;
  switch (op) {
    case ReduceOp::kProd: {
      const int64_t mag = (h & 1) ? 2 : 1;
      return IsUnsigned(t) || (h & 2) ? mag : -mag;
    }
    case ReduceOp::kMin:
    case ReduceOp::kMax:
      return IsUnsigned(t) ? static_cast<int64_t>(h % 201) : static_cast<int64_t>(h % 201) - 100;
    default:
      return IsUnsigned(t) ? static_cast<int64_t>(h % 17) : static_cast<int64_t>(h % 17) - 8;
  }
}

// N nodes as threads over one hub; each Run is one operation with its own tag_base.
class Cluster {
 public:
  Cluster(int nodes, int channels) : hub_(nodes, channels), scratch_(nodes) {}

  InProcessHub& hub() { return hub_; }
  int nodes() const { return hub_.num_nodes(); }
  // Every Run's InterNodeContext::racks.
  void set_racks(std::vector<int> racks) { racks_ = std::move(racks); }

  std::vector<absl::Status> Run(
      const std::function<absl::Status(int node, const InterNodeContext&)>& body,
      uint64_t chunk_bytes, int max_inflight = 4, milliseconds timeout = milliseconds(30000)) {
    const uint64_t tag_base = ++ops_ << 24;
    const Clock::time_point deadline = Clock::now() + timeout;
    std::vector<absl::Status> result(nodes());
    std::vector<std::thread> threads;
    for (int k = 0; k < nodes(); ++k) {
      threads.emplace_back([&, k] {
        InterNodeContext ctx{hub_.transport(k), tag_base, chunk_bytes, max_inflight, deadline,
                             &scratch_[k]};
        ctx.racks = racks_;
        result[k] = body(k, ctx);
      });
    }
    for (std::thread& t : threads) t.join();
    return result;
  }

 private:
  InProcessHub hub_;
  std::vector<ScratchBuffer> scratch_;
  std::vector<int> racks_;
  uint64_t ops_ = 0;
};

void ExpectAllOk(const std::vector<absl::Status>& statuses, const std::string& what) {
  for (size_t k = 0; k < statuses.size(); ++k) {
    EXPECT_TRUE(statuses[k].ok()) << what << " node " << k << ": " << statuses[k].ToString();
  }
}

// ---------------------------------------------------------------------------
// Allreduce: every dtype x op, exact against a reference.

using AllreduceParam = std::tuple<int, int, InterNodeAlgorithm>;  // nodes, channels, algorithm

class AllreduceTest : public ::testing::TestWithParam<AllreduceParam> {};

std::string AlgoName(InterNodeAlgorithm a) {
  return a == InterNodeAlgorithm::kRing               ? "Ring"
         : a == InterNodeAlgorithm::kHalvingDoubling ? "HalvingDoubling"
         : a == InterNodeAlgorithm::kRack            ? "Rack"
                                                     : "Auto";
}

// The racks the parameterized tests give kRack: k % (n/2), so racks are
// interleaved in node order and of unequal sizes (5 nodes: 3 and 2; 8
// nodes: 4 racks of 2; up to 3 nodes: one rack).
std::vector<int> TestRacks(int n) {
  std::vector<int> racks(static_cast<size_t>(n));
  for (int k = 0; k < n; ++k) racks[k] = k % std::max(1, n / 2);
  return racks;
}

TEST_P(AllreduceTest, EveryDtypeAndOpMatchesPlainLoops) {
  const auto [n, channels, algo] = GetParam();
  Cluster cluster(n, channels);
  if (algo == InterNodeAlgorithm::kRack) cluster.set_racks(TestRacks(n));
  for (size_t count : {size_t{0}, size_t{1}, size_t{1001}, size_t{100003}}) {
    // Small chunks: 1001 elements span several chunks per segment even for
    // 8 nodes and int8; 100003 elements span several chunks per step.
    const uint64_t chunk = count <= 1001 ? 64 : 4096;
    for (DataType t : kTypes) {
      for (ReduceOp op : kOps) {
        const std::string what = absl::StrCat(Name(t), " ", Name(op), " count ", count);
        const size_t es = Size(t);
        std::vector<std::vector<uint8_t>> data(n, std::vector<uint8_t>(count * es + 1));
        std::vector<int64_t> ref(count);
        for (size_t i = 0; i < count; ++i) {
          for (int k = 0; k < n; ++k) {
            const int64_t v = Value(op, t, k, i);
            Put(t, data[k].data(), i, v);
            if (k == 0) {
              ref[i] = v;
            } else if (op == ReduceOp::kSum) {
              ref[i] += v;
            } else if (op == ReduceOp::kProd) {
              ref[i] *= v;
            } else if (op == ReduceOp::kMin) {
              ref[i] = std::min(ref[i], v);
            } else {
              ref[i] = std::max(ref[i], v);
            }
          }
        }
        for (int k = 0; k < n; ++k) data[k][count * es] = 0xA5;  // guard byte
        ExpectAllOk(cluster.Run(
                        [&](int k, const InterNodeContext& ctx) {
                          return Allreduce(ctx, algo, t, op, data[k].data(), count);
                        },
                        chunk, count <= 1001 ? 3 : 4),
                    what);
        std::vector<uint8_t> expected(count * es + 1, 0xA5);
        for (size_t i = 0; i < count; ++i) Put(t, expected.data(), i, ref[i]);
        for (int k = 0; k < n; ++k) {
          ASSERT_EQ(data[k], expected) << what << " node " << k;
        }
        if (op != ReduceOp::kSum) continue;
        // avg = the sum across nodes, divided once at the end.
        for (size_t i = 0; i < count; ++i) {
          const float fq = static_cast<float>(ref[i]) / static_cast<float>(n);
          switch (t) {
            case DataType::kFloat32: reinterpret_cast<float*>(expected.data())[i] = fq; break;
            case DataType::kFloat64:
              reinterpret_cast<double*>(expected.data())[i] = static_cast<double>(ref[i]) / n;
              break;
            case DataType::kFloat16:
              reinterpret_cast<uint16_t*>(expected.data())[i] = FloatToHalf(fq);
              break;
            case DataType::kBFloat16:
              reinterpret_cast<uint16_t*>(expected.data())[i] = FloatToBFloat16(fq);
              break;
            default:
              // The wrapped sum, divided truncating toward zero.
              int64_t wrapped = ref[i];
              if (t == DataType::kInt8) wrapped = static_cast<int8_t>(ref[i]);
              if (t == DataType::kUInt8) wrapped = static_cast<uint8_t>(ref[i]);
              if (t == DataType::kInt32) wrapped = static_cast<int32_t>(ref[i]);
              Put(t, expected.data(), i, wrapped / n);
          }
        }
        for (int k = 0; k < n; ++k) {
          DivideInPlace(t, data[k].data(), count, n);
          ASSERT_EQ(data[k], expected) << what << " avg node " << k;
        }
      }
    }
  }
}

bool IsNaN(DataType t, const uint8_t* p) {
  switch (t) {
    case DataType::kFloat32: {
      float f;
      std::memcpy(&f, p, 4);
      return f != f;
    }
    case DataType::kFloat64: {
      double d;
      std::memcpy(&d, p, 8);
      return d != d;
    }
    case DataType::kFloat16: {
      uint16_t h;
      std::memcpy(&h, p, 2);
      return (h & 0x7c00) == 0x7c00 && (h & 0x03ff) != 0;
    }
    case DataType::kBFloat16: {
      uint16_t b;
      std::memcpy(&b, p, 2);
      return (b & 0x7f80) == 0x7f80 && (b & 0x007f) != 0;
    }
    default: return false;
  }
}

// Floats in [-3, 3], with -0 and +0 (min/max: which one wins a tie shows
// the operand order) and NaNs whose payload names node k (1 in 16 each).
void FillArbitrary(DataType t, ReduceOp op, int k, uint8_t* data, size_t count,
                   std::mt19937_64& rng) {
  std::uniform_real_distribution<double> dist(-3.0, 3.0);
  const size_t es = Size(t);
  for (size_t i = 0; i < count; ++i) {
    double v = dist(rng);
    const int special = static_cast<int>(rng() % 16);
    if (op == ReduceOp::kMin || op == ReduceOp::kMax) {
      if (special == 0) v = -0.0;
      if (special == 1) v = 0.0;
    }
    uint8_t* p = data + i * es;
    switch (t) {
      case DataType::kFloat32: {
        float f = static_cast<float>(v);
        uint32_t nan = 0x7fc00000u | static_cast<uint32_t>(k + 1);
        if (special == 2) std::memcpy(&f, &nan, 4);
        std::memcpy(p, &f, 4);
        break;
      }
      case DataType::kFloat64: {
        uint64_t nan = 0x7ff8000000000000ull | static_cast<uint64_t>(k + 1);
        if (special == 2) {
          std::memcpy(p, &nan, 8);
        } else {
          std::memcpy(p, &v, 8);
        }
        break;
      }
      case DataType::kFloat16: {
        uint16_t h = FloatToHalf(static_cast<float>(v));
        if (special == 2) h = static_cast<uint16_t>(0x7e00 | (k + 1));
        std::memcpy(p, &h, 2);
        break;
      }
      default: {
        uint16_t b = FloatToBFloat16(static_cast<float>(v));
        if (special == 2) b = static_cast<uint16_t>(0x7fc0 | (k + 1));
        std::memcpy(p, &b, 2);
      }
    }
  }
}

// Arbitrary floats (and, for min/max, NaNs with different payloads and
// signed zeros, where the order of operands decides the bits): every node
// must end with the same bits.
TEST_P(AllreduceTest, AllNodesAgreeBitwiseOnArbitraryFloats) {
  const auto [n, channels, algo] = GetParam();
  Cluster cluster(n, channels);
  if (algo == InterNodeAlgorithm::kRack) cluster.set_racks(TestRacks(n));
  std::mt19937_64 rng(n * 100 + channels);
  for (DataType t : {DataType::kFloat32, DataType::kFloat64, DataType::kFloat16,
                     DataType::kBFloat16}) {
    for (ReduceOp op : kOps) {
      const size_t count = 20011;
      const size_t es = Size(t);
      std::vector<std::vector<uint8_t>> data(n, std::vector<uint8_t>(count * es));
      for (int k = 0; k < n; ++k) FillArbitrary(t, op, k, data[k].data(), count, rng);
      ExpectAllOk(cluster.Run(
                      [&](int k, const InterNodeContext& ctx) {
                        return Allreduce(ctx, algo, t, op, data[k].data(), count);
                      },
                      1024),
                  Name(t) + " " + Name(op));
      for (int k = 1; k < n; ++k) {
        ASSERT_EQ(data[k], data[0]) << Name(t) << " " << Name(op) << " node " << k;
      }
    }
  }
}

// Two nodes: the ring and halving-doubling give every element the same bits,
// and halving-doubling's do not depend on the element's offset in the buffer
// (the one run here carries other data in front, as a fused run does), so
// an allreduce gives the same result fused or not, by either algorithm
// (allreduce_ring.cc, ../../cluster/README.md). Exception: which payload
// comes out of NaN + NaN (sum, avg, prod) is unspecified (reduce.h); any NaN
// is accepted there.
TEST(TwoNodesTest, RingAndHalvingDoublingAgreeBitwiseAtAnyOffset) {
  Cluster cluster(2, 2);
  std::mt19937_64 rng(4242);
  for (DataType t : {DataType::kFloat32, DataType::kFloat64, DataType::kFloat16,
                     DataType::kBFloat16}) {
    for (ReduceOp op : kOps) {
      const size_t es = Size(t);
      for (size_t count : {size_t{1}, size_t{1001}, size_t{70001}}) {
        const size_t front = 37;  // elements of other operations before this one
        std::vector<std::vector<uint8_t>> ring(2, std::vector<uint8_t>(count * es));
        std::vector<std::vector<uint8_t>> packed(2, std::vector<uint8_t>((front + count) * es));
        for (int k = 0; k < 2; ++k) {
          FillArbitrary(t, op, k, packed[k].data(), front + count, rng);
          std::memcpy(ring[k].data(), packed[k].data() + front * es, count * es);
        }
        const std::string what = Name(t) + " " + Name(op) + " count " + std::to_string(count);
        ExpectAllOk(cluster.Run(
                        [&](int k, const InterNodeContext& ctx) {
                          return Allreduce(ctx, InterNodeAlgorithm::kRing, t, op, ring[k].data(),
                                           count);
                        },
                        4096),
                    what + " ring");
        ExpectAllOk(cluster.Run(
                        [&](int k, const InterNodeContext& ctx) {
                          return Allreduce(ctx, InterNodeAlgorithm::kHalvingDoubling, t, op,
                                           packed[k].data(), front + count);
                        },
                        4096),
                    what + " halving-doubling");
        const bool nan_payload_free = op == ReduceOp::kMin || op == ReduceOp::kMax;
        for (size_t i = 0; i < count; ++i) {
          const uint8_t* a = ring[0].data() + i * es;
          const uint8_t* b = packed[0].data() + (front + i) * es;
          if (std::memcmp(a, b, es) == 0) continue;
          const bool both_nan = !nan_payload_free && IsNaN(t, a) && IsNaN(t, b);
          ASSERT_TRUE(both_nan) << what << ": element " << i << " differs";
        }
        ASSERT_EQ(ring[0], ring[1]) << what;
      }
    }
  }
}

// Out of place (input apart from the output): the same bits as in place,
// the input untouched, every byte of the output written (it starts as junk).
TEST_P(AllreduceTest, OutOfPlaceMatchesInPlaceBitwise) {
  const auto [n, channels, algo] = GetParam();
  Cluster cluster(n, channels);
  if (algo == InterNodeAlgorithm::kRack) cluster.set_racks(TestRacks(n));
  std::mt19937_64 rng(n * 7 + channels);
  for (size_t count : {size_t{0}, size_t{1}, size_t{7}, size_t{1001}, size_t{100003}}) {
    for (DataType t : {DataType::kFloat32, DataType::kFloat16, DataType::kBFloat16,
                       DataType::kFloat64, DataType::kInt8, DataType::kInt64}) {
      for (ReduceOp op : kOps) {
        const std::string what = absl::StrCat(Name(t), " ", Name(op), " count ", count);
        const size_t es = Size(t);
        std::vector<std::vector<uint8_t>> in_place(n), input(n), output(n);
        for (int k = 0; k < n; ++k) {
          input[k].resize(count * es);
          for (size_t i = 0; i < count; ++i) Put(t, input[k].data(), i, Value(op, t, k, i));
          in_place[k] = input[k];
          output[k].assign(count * es + 1, 0x5A);  // junk, and a guard byte
        }
        const std::vector<std::vector<uint8_t>> original = input;
        const uint64_t chunk = count <= 1001 ? 64 : 4096;
        ExpectAllOk(cluster.Run(
                        [&](int k, const InterNodeContext& ctx) {
                          return Allreduce(ctx, algo, t, op, in_place[k].data(), count);
                        },
                        chunk, 3),
                    what + " in place");
        ExpectAllOk(cluster.Run(
                        [&](int k, const InterNodeContext& ctx) {
                          return Allreduce(ctx, algo, t, op, output[k].data(), count,
                                           input[k].data());
                        },
                        chunk, 3),
                    what + " out of place");
        for (int k = 0; k < n; ++k) {
          ASSERT_EQ(input[k], original[k]) << what << ": input written, node " << k;
          ASSERT_EQ(output[k].back(), 0x5A) << what << ": guard byte, node " << k;
          output[k].pop_back();
          ASSERT_EQ(output[k], in_place[k]) << what << " node " << k;
        }
      }
    }
  }
}

TEST_P(AllreduceTest, OneChunkInFlight) {
  const auto [n, channels, algo] = GetParam();
  Cluster cluster(n, channels);
  if (algo == InterNodeAlgorithm::kRack) cluster.set_racks(TestRacks(n));
  const size_t count = 5003;
  std::vector<std::vector<int32_t>> data(n, std::vector<int32_t>(count));
  std::vector<int32_t> ref(count, 0);
  for (int k = 0; k < n; ++k) {
    for (size_t i = 0; i < count; ++i) {
      data[k][i] = static_cast<int32_t>(i * 3 + k);
      ref[i] += data[k][i];
    }
  }
  ExpectAllOk(cluster.Run(
                  [&](int k, const InterNodeContext& ctx) {
                    return Allreduce(ctx, algo, DataType::kInt32, ReduceOp::kSum,
                                     data[k].data(), count);
                  },
                  100, 1),
              "inflight 1");
  for (int k = 0; k < n; ++k) ASSERT_EQ(data[k], ref) << "node " << k;
}

TEST_P(AllreduceTest, YieldingKeepsOneSendInFlight) {
  const auto [n, channels, algo] = GetParam();
  InProcessHub hub(n, channels);
  std::vector<std::unique_ptr<SendsInFlight>> counters;
  for (int k = 0; k < n; ++k) counters.push_back(std::make_unique<SendsInFlight>(hub.transport(k)));
  std::vector<ScratchBuffer> scratch(n);
  const size_t count = 20011;
  std::vector<int32_t> ref(count, 0);
  for (int yield : {1, 0}) {
    std::atomic<int> flag{yield};
    std::vector<std::vector<int32_t>> data(n, std::vector<int32_t>(count));
    for (int k = 0; k < n; ++k) {
      for (size_t i = 0; i < count; ++i) data[k][i] = static_cast<int32_t>(i * 3 + k);
    }
    if (yield) {
      for (size_t i = 0; i < count; ++i) {
        for (int k = 0; k < n; ++k) ref[i] += data[k][i];
      }
    }
    std::vector<absl::Status> result(n);
    std::vector<std::thread> threads;
    const auto deadline = Clock::now() + std::chrono::seconds(30);
    for (int k = 0; k < n; ++k) {
      threads.emplace_back([&, k] {
        InterNodeContext ctx{counters[k].get(), uint64_t{1 + static_cast<uint64_t>(yield == 0)} << 24,
                             400, 4, deadline, &scratch[k]};
        ctx.yield = &flag;
        result[k] = Allreduce(ctx, algo, DataType::kInt32, ReduceOp::kSum, data[k].data(), count);
      });
    }
    for (auto& t : threads) t.join();
    ExpectAllOk(result, yield ? "yielding" : "not yielding");
    for (int k = 0; k < n; ++k) ASSERT_EQ(data[k], ref) << "node " << k;
    int most = 0, most_on_one = 0;
    for (auto& c : counters) {
      most = std::max(most, c->max_seen());
      most_on_one = std::max(most_on_one, c->max_seen_on_one_channel());
    }
    if (yield) {
      // One per channel: each channel walks its own chunks (schedule.h).
      EXPECT_EQ(most_on_one, n > 1 ? 1 : 0)
          << "a yielding operation had more than one send in flight on a channel";
      EXPECT_LE(most, channels);
    } else if (n > 1) {
      // The counter sees more than one when nobody yields (the test can fail).
      EXPECT_GT(most, 1);
    }
  }
}

// Holds every send on channel `held` (of 2) until this node has completed
// `release_after` sends on the other channel. With one window for all
// channels, channel 1's held chunks would fill it and channel 0 would stop
// too (the run would end at its deadline); with a window per channel,
// channel 0 goes on.
class HoldsChannelOne final : public ForwardingTransport {
 public:
  HoldsChannelOne(Transport* inner, int release_after, int held = 1)
      : ForwardingTransport(inner), release_after_(release_after), held_channel_(held) {}
  void Send(int peer, int channel, uint64_t tag, const void* data, size_t bytes,
            TransferDone done) override {
    if (channel == held_channel_) {
      std::lock_guard<std::mutex> lock(mu_);
      if (!released_) {
        held_.push_back([=, done = std::move(done)]() mutable {
          ForwardingTransport::Send(peer, channel, tag, data, bytes, std::move(done));
        });
        return;
      }
    } else {
      auto counted = [this, done = std::move(done)](absl::Status s) {
        std::vector<std::function<void()>> release;
        {
          std::lock_guard<std::mutex> lock(mu_);
          if (++channel0_done_ == release_after_) {
            released_ = true;
            release.swap(held_);
          }
        }
        for (auto& send : release) send();
        done(std::move(s));
      };
      return ForwardingTransport::Send(peer, channel, tag, data, bytes, std::move(counted));
    }
    ForwardingTransport::Send(peer, channel, tag, data, bytes, std::move(done));
  }
  // A run that gives up (its deadline) fails the peer: what is held goes
  // then, to fail like every other transfer, so that the run can end.
  void FailPeer(int peer, const absl::Status& why) override {
    ForwardingTransport::FailPeer(peer, why);
    std::vector<std::function<void()>> release;
    {
      std::lock_guard<std::mutex> lock(mu_);
      release.swap(held_);
    }
    for (auto& send : release) send();
  }
  bool released() {
    std::lock_guard<std::mutex> lock(mu_);
    return released_;
  }

 private:
  const int release_after_;
  const int held_channel_;
  std::mutex mu_;
  int channel0_done_ = 0;  // sends done on the channel not held
  bool released_ = false;
  std::vector<std::function<void()>> held_;
};

// An allreduce of 20011 int32 in 400-byte chunks on two nodes, node k
// through transports[k], with a window of `window` and a 5 s deadline:
// every node must end well with the plain sum.
void AllreduceTwoNodesThrough(const std::vector<Transport*>& transports, InterNodeAlgorithm algo,
                              int window, const std::string& what) {
  constexpr int kNodes = 2;
  std::vector<ScratchBuffer> scratch(kNodes);
  const size_t count = 20011;
  std::vector<std::vector<int32_t>> data(kNodes, std::vector<int32_t>(count));
  std::vector<int32_t> ref(count, 0);
  for (int k = 0; k < kNodes; ++k) {
    for (size_t i = 0; i < count; ++i) {
      data[k][i] = static_cast<int32_t>(i * 7 + k);
      ref[i] += data[k][i];
    }
  }
  std::vector<absl::Status> result(kNodes);
  std::vector<std::thread> threads;
  const auto deadline = Clock::now() + std::chrono::seconds(5);
  for (int k = 0; k < kNodes; ++k) {
    threads.emplace_back([&, k] {
      InterNodeContext ctx{transports[k], uint64_t{1} << 24, 400, window, deadline, &scratch[k]};
      result[k] = Allreduce(ctx, algo, DataType::kInt32, ReduceOp::kSum, data[k].data(), count);
    });
  }
  for (auto& t : threads) t.join();
  ExpectAllOk(result, what + ", " + AlgoName(algo));
  for (int k = 0; k < kNodes; ++k) EXPECT_EQ(data[k], ref) << "node " << k;
}

TEST(ChannelWindowTest, ASlowChannelNeverHoldsBackAnotherOne) {
  for (InterNodeAlgorithm algo : {InterNodeAlgorithm::kRing, InterNodeAlgorithm::kHalvingDoubling}) {
    constexpr int kWindow = 4;
    InProcessHub hub(2, 2);
    HoldsChannelOne held0(hub.transport(0), 3 * kWindow), held1(hub.transport(1), 3 * kWindow);
    AllreduceTwoNodesThrough({&held0, &held1}, algo, kWindow, "channel 1 held back");
    EXPECT_TRUE(held0.released());
    EXPECT_TRUE(held1.released());
  }
}

// Scratch slots are each channel's own. Node 0's sends on channel 0 are held
// until its channel 1 has completed 3 windows of sends: meanwhile the chunks
// node 0 receives on channel 0 wait in scratch for node 0's own sends of
// them (write after send), and its channel-0 cursor posts receives as they
// arrive. With one pool of slots for both channels they took every slot,
// node 0 could post no receive on channel 1, node 1's channel-1 sends and
// so node 0's stopped, and the run ended at its deadline; with slots per
// channel, channel 1 goes on.
TEST(ChannelWindowTest, ChunksWaitingOnOneChannelNeverTakeAnotherOnesScratch) {
  for (InterNodeAlgorithm algo : {InterNodeAlgorithm::kRing, InterNodeAlgorithm::kHalvingDoubling}) {
    constexpr int kWindow = 4;
    InProcessHub hub(2, 2);
    HoldsChannelOne held(hub.transport(0), 3 * kWindow, /*held=*/0);
    AllreduceTwoNodesThrough({&held, hub.transport(1)}, algo, kWindow,
                             "node 0's channel 0 held back");
    EXPECT_TRUE(held.released());
  }
}

// Counts each channel's sends.
class SendsPerChannel final : public ForwardingTransport {
 public:
  using ForwardingTransport::ForwardingTransport;
  void Send(int peer, int channel, uint64_t tag, const void* data, size_t bytes,
            TransferDone done) override {
    ++sends_[static_cast<size_t>(channel)];
    ForwardingTransport::Send(peer, channel, tag, data, bytes, std::move(done));
  }
  int sends(int channel) const { return sends_[static_cast<size_t>(channel)].load(); }

 private:
  std::atomic<int> sends_[4] = {};
};

// A run with a channel table puts chunk i on table[i mod size], the same
// bits as without one; a table naming a channel the transport lacks is an
// error, not a send on it.
TEST(ChannelWindowTest, ChunksFollowTheChannelTable) {
  constexpr int kNodes = 3;
  InProcessHub hub(kNodes, 2);
  std::vector<std::unique_ptr<SendsPerChannel>> counted;
  for (int k = 0; k < kNodes; ++k) counted.push_back(std::make_unique<SendsPerChannel>(hub.transport(k)));
  std::vector<ScratchBuffer> scratch(kNodes);
  // Three of every four chunks on channel 0.
  const std::vector<uint8_t> table = {0, 0, 0, 1};
  const size_t count = 40000;
  std::vector<std::vector<int32_t>> data(kNodes, std::vector<int32_t>(count));
  std::vector<int32_t> ref(count, 0);
  for (int k = 0; k < kNodes; ++k) {
    for (size_t i = 0; i < count; ++i) {
      data[k][i] = static_cast<int32_t>(i * 5 - k);
      ref[i] += data[k][i];
    }
  }
  std::vector<absl::Status> result(kNodes);
  std::vector<std::thread> threads;
  const auto deadline = Clock::now() + std::chrono::seconds(30);
  for (int k = 0; k < kNodes; ++k) {
    threads.emplace_back([&, k] {
      InterNodeContext ctx{counted[k].get(), uint64_t{1} << 24, 400, 4, deadline, &scratch[k]};
      ctx.channel_table = table;
      result[k] = Allreduce(ctx, InterNodeAlgorithm::kRing, DataType::kInt32, ReduceOp::kSum,
                            data[k].data(), count);
    });
  }
  for (auto& t : threads) t.join();
  ExpectAllOk(result, "with a channel table");
  for (int k = 0; k < kNodes; ++k) {
    EXPECT_EQ(data[k], ref) << "node " << k;
    const int zero = counted[k]->sends(0), one = counted[k]->sends(1);
    // Every step's chunks 0..n-1: about three on channel 0 per one on 1.
    EXPECT_GT(one, 0);
    EXPECT_NEAR(static_cast<double>(zero) / one, 3.0, 0.2) << zero << " / " << one;
  }
  InterNodeContext bad{counted[0].get(), uint64_t{2} << 24, 400, 4, deadline, &scratch[0]};
  bad.channel_table = {0, 2};
  absl::Status s = Allreduce(bad, InterNodeAlgorithm::kRing, DataType::kInt32, ReduceOp::kSum,
                             data[0].data(), count);
  EXPECT_EQ(s.code(), absl::StatusCode::kInternal) << s;
  EXPECT_NE(s.message().find("channel table names channel 2 of 2"), std::string::npos) << s;
}

// The compressed allreduce follows the run's channel table too: about three
// of every four chunk messages on channel 0, the bits of the same run
// without a table (only the channels differ), and a table naming a channel
// the transport lacks is an error.
TEST(ChannelWindowTest, CompressedChunksFollowTheChannelTable) {
  constexpr int kNodes = 3;
  const auto codec = MakeCodec(*ParseCodec("int8"));
  const size_t count = 100003;
  const auto deadline = Clock::now() + std::chrono::seconds(30);
  // One compressed allreduce on every node through a counting transport.
  auto run = [&](const std::vector<uint8_t>& table, std::vector<std::vector<float>>* data,
                 std::vector<std::pair<int, int>>* sends) {
    InProcessHub hub(kNodes, 2);
    std::vector<std::unique_ptr<SendsPerChannel>> counted;
    for (int k = 0; k < kNodes; ++k) {
      counted.push_back(std::make_unique<SendsPerChannel>(hub.transport(k)));
    }
    std::vector<ScratchBuffer> scratch(kNodes);
    data->assign(kNodes, std::vector<float>(count));
    for (int k = 0; k < kNodes; ++k) {
      for (size_t i = 0; i < count; ++i) (*data)[k][i] = std::sin(0.001f * i + k);
    }
    std::vector<absl::Status> result(kNodes);
    std::vector<std::thread> threads;
    for (int k = 0; k < kNodes; ++k) {
      threads.emplace_back([&, k] {
        InterNodeContext ctx{counted[k].get(), uint64_t{1} << 24, 4096, 4, deadline, &scratch[k]};
        ctx.channel_table = table;
        result[k] = AllreduceCompressed(ctx, *codec, nullptr, "", DataType::kFloat32,
                                        (*data)[k].data(), count, nullptr);
      });
    }
    for (auto& t : threads) t.join();
    ExpectAllOk(result, table.empty() ? "without a table" : "with a channel table");
    sends->clear();
    for (auto& c : counted) sends->emplace_back(c->sends(0), c->sends(1));
  };
  std::vector<std::vector<float>> plain, weighted;
  std::vector<std::pair<int, int>> plain_sends, weighted_sends;
  run({}, &plain, &plain_sends);
  run({0, 0, 0, 1}, &weighted, &weighted_sends);
  for (int k = 0; k < kNodes; ++k) {
    EXPECT_EQ(std::memcmp(weighted[k].data(), plain[k].data(), count * sizeof(float)), 0)
        << "node " << k;
    const auto [zero, one] = weighted_sends[k];
    EXPECT_GT(one, 0);
    EXPECT_NEAR(static_cast<double>(zero) / one, 3.0, 0.3) << zero << " / " << one;
    EXPECT_EQ(zero + one, plain_sends[k].first + plain_sends[k].second) << "node " << k;
  }
  InProcessHub hub(2, 2);  // node 0 alone: the table is refused before any transfer
  ScratchBuffer scratch;
  InterNodeContext bad{hub.transport(0), uint64_t{2} << 24, 4096, 4, deadline, &scratch};
  bad.channel_table = {0, 2};
  absl::Status s = AllreduceCompressed(bad, *codec, nullptr, "", DataType::kFloat32,
                                       plain[0].data(), count, nullptr);
  EXPECT_EQ(s.code(), absl::StatusCode::kInternal) << s;
  EXPECT_NE(s.message().find("channel table names channel 2 of 2"), std::string::npos) << s;
}

INSTANTIATE_TEST_SUITE_P(
    Nodes, AllreduceTest,
    ::testing::Combine(::testing::Values(1, 2, 3, 4, 5, 8), ::testing::Values(1, 2),
                       ::testing::Values(InterNodeAlgorithm::kRing,
                                         InterNodeAlgorithm::kHalvingDoubling,
                                         InterNodeAlgorithm::kRack)),
    [](const ::testing::TestParamInfo<AllreduceParam>& info) {
      return absl::StrCat(std::get<0>(info.param), "Nodes", std::get<1>(info.param), "Channels",
                          AlgoName(std::get<2>(info.param)));
    });

// ---------------------------------------------------------------------------
// Racks: AllreduceRacks on layouts the parameterized tests lack, the bytes
// each node pair carries, and the cost model.

// Bytes this node's sends carried to each peer.
class BytesPerPeer final : public ForwardingTransport {
 public:
  using ForwardingTransport::ForwardingTransport;
  void Send(int peer, int channel, uint64_t tag, const void* data, size_t bytes,
            TransferDone done) override {
    bytes_[static_cast<size_t>(peer)] += bytes;
    ForwardingTransport::Send(peer, channel, tag, data, bytes, std::move(done));
  }
  uint64_t to(int peer) const { return bytes_[static_cast<size_t>(peer)].load(); }

 private:
  std::atomic<uint64_t> bytes_[8] = {};
};

// Runs `algo` on n nodes with `racks` through byte counters; returns each
// node's result, and bytes[a][b] sent from a to b.
std::vector<std::vector<float>> RunCounted(const std::vector<int>& racks, InterNodeAlgorithm algo,
                                           const std::vector<std::vector<float>>& input,
                                           std::vector<std::vector<uint64_t>>* bytes) {
  const int n = static_cast<int>(racks.size());
  InProcessHub hub(n, 2);
  std::vector<std::unique_ptr<BytesPerPeer>> counted;
  for (int k = 0; k < n; ++k) counted.push_back(std::make_unique<BytesPerPeer>(hub.transport(k)));
  std::vector<ScratchBuffer> scratch(static_cast<size_t>(n));
  std::vector<std::vector<float>> data = input;
  std::vector<absl::Status> result(static_cast<size_t>(n));
  std::vector<std::thread> threads;
  const auto deadline = Clock::now() + std::chrono::seconds(30);
  for (int k = 0; k < n; ++k) {
    threads.emplace_back([&, k] {
      InterNodeContext ctx{counted[k].get(), uint64_t{1} << 24, 4096, 4, deadline, &scratch[k]};
      ctx.racks = racks;
      result[k] = Allreduce(ctx, algo, DataType::kFloat32, ReduceOp::kSum, data[k].data(),
                            data[k].size());
    });
  }
  for (auto& t : threads) t.join();
  ExpectAllOk(result, AlgoName(algo));
  bytes->assign(static_cast<size_t>(n), std::vector<uint64_t>(static_cast<size_t>(n)));
  for (int a = 0; a < n; ++a) {
    for (int b = 0; b < n; ++b) (*bytes)[a][b] = counted[a]->to(b);
  }
  return data;
}

// Layouts beyond TestRacks': racks numbered out of node order, a rack of
// one node, every node its own rack, one rack for all. Exact int32 sums
// against a loop, and the same float bits on every node.
TEST(RackTest, EveryLayoutMatchesPlainLoopsAndAgreesBitwise) {
  const std::vector<std::vector<int>> layouts = {
      {0, 0, 0, 1, 1, 2}, {1, 1, 0, 0, 0}, {0, 1, 2, 3}, {2, 2, 2, 2}, {0, 1, 1}, {3, 0, 3, 0}};
  std::mt19937_64 rng(33);
  for (const std::vector<int>& racks : layouts) {
    const int n = static_cast<int>(racks.size());
    Cluster cluster(n, 2);
    cluster.set_racks(racks);
    const std::string what = "racks " + absl::StrJoin(racks, ",");
    for (size_t count : {size_t{1}, size_t{7}, size_t{1001}, size_t{65537}}) {
      std::vector<std::vector<int32_t>> data(n, std::vector<int32_t>(count));
      std::vector<int32_t> ref(count, 0);
      for (int k = 0; k < n; ++k) {
        for (size_t i = 0; i < count; ++i) {
          data[k][i] = static_cast<int32_t>(Value(ReduceOp::kSum, DataType::kInt32, k, i));
          ref[i] += data[k][i];
        }
      }
      ExpectAllOk(cluster.Run(
                      [&](int k, const InterNodeContext& ctx) {
                        return Allreduce(ctx, InterNodeAlgorithm::kRack, DataType::kInt32,
                                         ReduceOp::kSum, data[k].data(), count);
                      },
                      count <= 1001 ? 64 : 4096),
                  what);
      for (int k = 0; k < n; ++k) ASSERT_EQ(data[k], ref) << what << " count " << count;
    }
    for (ReduceOp op : kOps) {
      const size_t count = 20011;
      std::vector<std::vector<uint8_t>> data(n, std::vector<uint8_t>(count * 4));
      for (int k = 0; k < n; ++k) FillArbitrary(DataType::kFloat32, op, k, data[k].data(), count, rng);
      ExpectAllOk(cluster.Run(
                      [&](int k, const InterNodeContext& ctx) {
                        return Allreduce(ctx, InterNodeAlgorithm::kRack, DataType::kFloat32, op,
                                         data[k].data(), count);
                      },
                      1024),
                  what);
      for (int k = 1; k < n; ++k) ASSERT_EQ(data[k], data[0]) << what << " " << Name(op);
    }
  }
}

// Two racks of two: only the leaders' pair crosses racks, S each way (the
// flat ring sends 1.5 S over each crossing edge); inside a rack the buffer
// goes up once and down once. Same sums as the ring.
TEST(RackTest, InterRackLinksCarryOneStreamPerRackPair) {
  const std::vector<int> racks = {0, 0, 1, 1};
  const size_t count = 100000;
  const uint64_t s = count * 4;
  std::vector<std::vector<float>> input(4, std::vector<float>(count));
  for (int k = 0; k < 4; ++k) {
    for (size_t i = 0; i < count; ++i) input[k][i] = static_cast<float>((i * 7 + k) % 13);
  }
  std::vector<std::vector<uint64_t>> rack_bytes, ring_bytes;
  const auto by_rack = RunCounted(racks, InterNodeAlgorithm::kRack, input, &rack_bytes);
  const auto by_ring = RunCounted(racks, InterNodeAlgorithm::kRing, input, &ring_bytes);
  for (int k = 0; k < 4; ++k) EXPECT_EQ(by_rack[k], by_ring[0]) << "node " << k;
  for (int a = 0; a < 4; ++a) {
    for (int b = 0; b < 4; ++b) {
      uint64_t want = 0;
      if ((a == 0 && b == 2) || (a == 2 && b == 0)) want = s;  // the leaders' ring
      if ((a == 1 && b == 0) || (a == 3 && b == 2)) want = s;  // up to the leader
      if ((a == 0 && b == 1) || (a == 2 && b == 3)) want = s;  // down from it
      EXPECT_EQ(rack_bytes[a][b], want) << a << " -> " << b;
    }
  }
  EXPECT_EQ(ring_bytes[1][2], s * 3 / 2);
  EXPECT_EQ(ring_bytes[3][0], s * 3 / 2);
}

TEST(RackTest, BadRacksAreAnError) {
  Cluster cluster(3, 1);
  std::vector<float> data(10, 1.0f);
  for (const std::vector<int>& racks : {std::vector<int>{0, 0}, std::vector<int>{0, 3, 0},
                                        std::vector<int>{0, -1, 0}}) {
    const std::vector<absl::Status> result = cluster.Run(
        [&](int k, const InterNodeContext& ctx) {
          if (k != 0) return absl::OkStatus();
          return AllreduceRacks(ctx, racks, DataType::kFloat32, ReduceOp::kSum, data.data(), 10);
        },
        64, 4, milliseconds(200));
    EXPECT_EQ(result[0].code(), absl::StatusCode::kInvalidArgument) << result[0];
    EXPECT_NE(result[0].message().find("AllreduceRacks"), std::string::npos) << result[0];
  }
  const std::vector<absl::Status> few_bits = cluster.Run(
      [&](int k, const InterNodeContext& ctx) {
        if (k != 0) return absl::OkStatus();
        InterNodeContext c = ctx;
        c.tag_bits = 17;
        c.tag_base = uint64_t{1} << 17;
        return AllreduceRacks(c, {0, 0, 1}, DataType::kFloat32, ReduceOp::kSum, data.data(), 10);
      },
      64);
  EXPECT_EQ(few_bits[0].code(), absl::StatusCode::kInvalidArgument) << few_bits[0];
}

// A node that never takes part: its rack's phase ends at the deadline, and
// the error says which phase and which nodes.
TEST(RackTest, AMissingNodeEndsTheOperationNamingThePhase) {
  Cluster cluster(4, 1);
  cluster.set_racks({0, 0, 1, 1});
  std::vector<std::vector<float>> data(4, std::vector<float>(1000, 1.0f));
  const std::vector<absl::Status> result = cluster.Run(
      [&](int k, const InterNodeContext& ctx) {
        if (k == 3) return absl::OkStatus();
        return Allreduce(ctx, InterNodeAlgorithm::kRack, DataType::kFloat32, ReduceOp::kSum,
                         data[k].data(), 1000);
      },
      256, 4, milliseconds(300));
  EXPECT_EQ(result[2].code(), absl::StatusCode::kDeadlineExceeded) << result[2];
  EXPECT_NE(result[2].message().find("reduce in the rack (nodes 2,3)"), std::string::npos)
      << result[2];
  for (int k = 0; k < 3; ++k) EXPECT_FALSE(result[k].ok()) << "node " << k;
}

TEST(RackModelTest, PredictsTheFlatRingsSharedLinkAndTheRackPhases) {
  constexpr double kStep = 25e-6;  // racks.cc's kStepSeconds
  const double intra = 500e6, inter = 25e6, s = 16 << 20;
  auto rates = [&](const std::vector<int>& racks) {
    std::vector<std::vector<double>> r(racks.size(), std::vector<double>(racks.size()));
    for (size_t a = 0; a < racks.size(); ++a) {
      for (size_t b = 0; b < racks.size(); ++b) {
        if (a != b) r[a][b] = racks[a] == racks[b] ? intra : inter;
      }
    }
    return r;
  };
  // Racks contiguous in node order: the ring crosses each way once.
  std::optional<RackCost> c = ModelRacks(RackCollective::kAllreduce, {0, 0, 1, 1}, rates({0, 0, 1, 1}), 16 << 20);
  ASSERT_TRUE(c.has_value());
  EXPECT_NEAR(c->flat_s, 6 * kStep + 1.5 * s / inter, 1e-9);
  EXPECT_NEAR(c->rack_s, 2 * (kStep + s / intra) + 2 * kStep + s / inter, 1e-9);
  EXPECT_GT(c->flat_s / c->rack_s, 1.3);
  // Interleaved: each crossing direction carries two ring edges.
  c = ModelRacks(RackCollective::kAllreduce, {0, 1, 0, 1}, rates({0, 1, 0, 1}), 16 << 20);
  ASSERT_TRUE(c.has_value());
  EXPECT_NEAR(c->flat_s, 6 * kStep + 1.5 * s / (inter / 2), 1e-9);
  // Links alike: the flat ring wins.
  std::vector<std::vector<double>> even(4, std::vector<double>(4, intra));
  c = ModelRacks(RackCollective::kAllreduce, {0, 0, 1, 1}, even, 16 << 20);
  ASSERT_TRUE(c.has_value());
  EXPECT_LT(c->flat_s, c->rack_s);
  // The slowest measured pair of each kind counts; unmeasured pairs do not.
  std::vector<std::vector<double>> some = rates({0, 0, 1, 1});
  some[1][3] = inter / 2;
  some[3][1] = 0;
  c = ModelRacks(RackCollective::kAllreduce, {0, 0, 1, 1}, some, 16 << 20);
  ASSERT_TRUE(c.has_value());
  EXPECT_NEAR(c->rack_s, 2 * (kStep + s / intra) + 2 * kStep + s / (inter / 2), 1e-9);
  // No decision: nothing measured between racks, one rack, racks of one
  // node, two nodes, rates of the wrong shape.
  std::vector<std::vector<double>> no_inter = even;
  for (int a : {0, 1}) {
    for (int b : {2, 3}) no_inter[a][b] = no_inter[b][a] = 0;
  }
  EXPECT_FALSE(ModelRacks(RackCollective::kAllreduce, {0, 0, 1, 1}, no_inter, 1 << 20).has_value());
  EXPECT_FALSE(ModelRacks(RackCollective::kAllreduce, {0, 0, 0, 0}, even, 1 << 20).has_value());
  EXPECT_FALSE(ModelRacks(RackCollective::kAllreduce, {0, 1, 2, 3}, even, 1 << 20).has_value());
  EXPECT_FALSE(ModelRacks(RackCollective::kAllreduce, {0, 1}, rates({0, 1}), 1 << 20).has_value());
  EXPECT_FALSE(ModelRacks(RackCollective::kAllreduce, {0, 0, 1, 1}, rates({0, 0, 1}), 1 << 20).has_value());
  // A node that reported nothing (an empty row) leaves the others' rates.
  std::vector<std::vector<double>> partial = rates({0, 0, 1, 1});
  partial[3].clear();
  EXPECT_TRUE(ModelRacks(RackCollective::kAllreduce, {0, 0, 1, 1}, partial, 1 << 20).has_value());
  // More nodes than the model takes: no decision.
  std::vector<int> many(kMaxRackModelNodes + 1);
  for (size_t k = 0; k < many.size(); ++k) many[k] = k < many.size() / 2 ? 0 : 1;
  std::vector<std::vector<double>> many_rates(many.size());
  EXPECT_FALSE(ModelRacks(RackCollective::kAllreduce, many, many_rates, 1 << 20).has_value());
}

// One large float32 buffer (4M elements) through both algorithms and auto.
TEST(AllreduceLargeTest, FourMillionFloats) {
  const int n = 4;
  const size_t count = size_t{4} << 20;
  Cluster cluster(n, 2);
  std::vector<std::vector<float>> data(n, std::vector<float>(count));
  for (InterNodeAlgorithm algo : {InterNodeAlgorithm::kRing, InterNodeAlgorithm::kHalvingDoubling,
                                  InterNodeAlgorithm::kAuto}) {
    for (int k = 0; k < n; ++k) {
      for (size_t i = 0; i < count; ++i) data[k][i] = static_cast<float>((i + 3 * k) % 1000);
    }
    const Clock::time_point start = Clock::now();
    ExpectAllOk(cluster.Run(
                    [&](int k, const InterNodeContext& ctx) {
                      return Allreduce(ctx, algo, DataType::kFloat32, ReduceOp::kSum,
                                       data[k].data(), count);
                    },
                    256 * 1024),
                AlgoName(algo));
    const double ms = std::chrono::duration<double, std::milli>(Clock::now() - start).count();
    std::cout << AlgoName(algo) << ": 16 MiB over 4 in-process nodes in " << ms << " ms\n";
    for (int k = 0; k < n; ++k) {
      for (size_t i = 0; i < count; ++i) {
        float want = 0;
        for (int j = 0; j < n; ++j) want += static_cast<float>((i + 3 * j) % 1000);
        if (data[k][i] != want) {
          FAIL() << AlgoName(algo) << " node " << k << " element " << i << ": " << data[k][i]
                 << " != " << want;
        }
      }
    }
  }
}

// ---------------------------------------------------------------------------
// DivideInPlace against the local reduction's avg.

TEST(DivideInPlaceTest, MatchesLocalAvg) {
  const size_t count = 4099;
  for (DataType t : kTypes) {
    for (int n : {1, 2, 3, 7}) {
      const size_t es = Size(t);
      std::vector<std::vector<uint8_t>> in(n, std::vector<uint8_t>(count * es));
      std::mt19937_64 rng(static_cast<uint64_t>(t) * 10 + n);
      for (int k = 0; k < n; ++k) {
        for (size_t i = 0; i < count; ++i) {
          // Integer-valued floats (so the 16-bit sums are exact); any integers.
          const bool fl = t == DataType::kFloat32 || t == DataType::kFloat64 ||
                          t == DataType::kFloat16 || t == DataType::kBFloat16;
          const int64_t v = fl ? static_cast<int64_t>(rng() % 61) - 30 : static_cast<int64_t>(rng());
          Put(t, in[k].data(), i, v);
        }
      }
      std::vector<const void*> ptrs;
      for (auto& b : in) ptrs.push_back(b.data());
      std::vector<uint8_t> avg(count * es), sum(count * es);
      Reduce(t, ReduceOp::kAvg, ptrs.data(), n, avg.data(), count);
      Reduce(t, ReduceOp::kSum, ptrs.data(), n, sum.data(), count);
      DivideInPlace(t, sum.data(), count, n);
      EXPECT_EQ(sum, avg) << Name(t) << " n " << n;
    }
  }
  // Truncation toward zero for negative integers.
  int8_t v[2] = {-3, 3};
  DivideInPlace(DataType::kInt8, v, 2, 2);
  EXPECT_EQ(v[0], -1);
  EXPECT_EQ(v[1], 1);
}

// ---------------------------------------------------------------------------
// Allgather of arbitrary block layouts.

using NodesChannels = std::tuple<int, int>;

class AllgatherTest : public ::testing::TestWithParam<NodesChannels> {};

uint8_t Pattern(int owner, size_t offset) {
  return static_cast<uint8_t>(owner * 31 + offset * 7 + (offset >> 8));
}

void CheckAllgather(Cluster& cluster, const std::vector<Block>& blocks, size_t size,
                    uint64_t chunk, const std::string& what) {
  const int n = cluster.nodes();
  std::vector<std::vector<uint8_t>> data(n, std::vector<uint8_t>(size, 0xEE));
  std::vector<uint8_t> expected(size, 0xEE);
  for (const Block& b : blocks) {
    for (size_t i = b.offset; i < b.offset + b.bytes; ++i) {
      expected[i] = Pattern(b.owner, i);
      data[b.owner][i] = Pattern(b.owner, i);
    }
  }
  ExpectAllOk(cluster.Run(
                  [&](int k, const InterNodeContext& ctx) {
                    return Allgather(ctx, data[k].data(), blocks);
                  },
                  chunk, 3),
              what);
  for (int k = 0; k < n; ++k) ASSERT_EQ(data[k], expected) << what << " node " << k;
}

// Blocks of every shape on `cluster`'s n nodes (flat, or rack by rack when
// the cluster has racks).
void AllgatherLayouts(Cluster& cluster, int n) {
  // One block per node, uneven and some empty, in node order.
  {
    std::vector<Block> blocks;
    size_t off = 0;
    for (int k = 0; k < n; ++k) {
      const size_t bytes = (k % 3 == 1) ? 0 : 1000 + 337 * k;
      blocks.push_back({off, bytes, k});
      off += bytes;
    }
    CheckAllgather(cluster, blocks, off, 64, "one block each");
  }
  // Three blocks per owner, interleaved in reverse order, one of them empty,
  // with gaps between blocks that must stay untouched.
  {
    std::vector<Block> blocks;
    size_t off = 5;
    for (int j = 0; j < 3 * n; ++j) {
      const int owner = (n - 1) - (j % n);
      const size_t bytes = j == 1 ? 0 : 1 + (j * 577) % 3001;
      blocks.push_back({off, bytes, owner});
      off += bytes + 3;
    }
    CheckAllgather(cluster, blocks, off, 100, "interleaved");
  }
  // Everything owned by the last node; a large single block.
  CheckAllgather(cluster, {{0, 100003, n - 1}}, 100003, 4096, "single owner");
  // No blocks at all.
  CheckAllgather(cluster, {}, 16, 64, "no blocks");
}

TEST_P(AllgatherTest, UnevenEmptyAndManyBlocksPerOwner) {
  const auto [n, channels] = GetParam();
  Cluster cluster(n, channels);
  AllgatherLayouts(cluster, n);
}

TEST_P(AllgatherTest, RackByRack) {
  const auto [n, channels] = GetParam();
  Cluster cluster(n, channels);
  cluster.set_racks(TestRacks(n));
  AllgatherLayouts(cluster, n);
}

INSTANTIATE_TEST_SUITE_P(Nodes, AllgatherTest,
                         ::testing::Combine(::testing::Values(1, 2, 3, 4, 5, 8),
                                            ::testing::Values(1, 2)),
                         [](const ::testing::TestParamInfo<NodesChannels>& info) {
                           return absl::StrCat(std::get<0>(info.param), "Nodes",
                                               std::get<1>(info.param), "Channels");
                         });

// ---------------------------------------------------------------------------
// Reduce-scatter: each node's own blocks reduced over every node, every
// dtype and op, for block layouts like a job's (ranks of a node contiguous,
// or dealt round-robin, uneven and empty blocks), in place and out of
// place (the input never written).

class ReduceScatterTest : public ::testing::TestWithParam<NodesChannels> {};

void CheckReduceScatter(Cluster& cluster, DataType t, ReduceOp op,
                        const std::vector<Block>& blocks, size_t count, bool out_of_place,
                        const std::string& what) {
  const int n = cluster.nodes();
  const size_t es = Size(t);
  std::vector<std::vector<uint8_t>> data(n, std::vector<uint8_t>(count * es));
  for (int k = 0; k < n; ++k) {
    for (size_t i = 0; i < count; ++i) Put(t, data[k].data(), i, Value(op, t, k, i));
  }
  const std::vector<std::vector<uint8_t>> inputs = data;
  std::vector<const void*> ptrs;
  for (const auto& d : inputs) ptrs.push_back(d.data());
  std::vector<uint8_t> want(count * es);
  if (count > 0) Reduce(t, op, ptrs.data(), n, want.data(), count);
  std::vector<std::vector<uint8_t>> out = data;
  if (out_of_place) {
    for (auto& o : out) std::fill(o.begin(), o.end(), 0xEE);
  }
  ExpectAllOk(cluster.Run(
                  [&](int k, const InterNodeContext& ctx) {
                    return ReduceScatter(ctx, t, op, out[k].data(), blocks,
                                             out_of_place ? data[k].data() : nullptr);
                  },
                  64, 3),
              what);
  for (int k = 0; k < n; ++k) {
    for (const Block& b : blocks) {
      if (b.owner != k) continue;
      ASSERT_EQ(std::memcmp(out[k].data() + b.offset, want.data() + b.offset, b.bytes), 0)
          << what << " node " << k << " block at " << b.offset;
    }
    if (out_of_place) EXPECT_EQ(data[k], inputs[k]) << what << ": input written";
  }
}

void ReduceScatterLayouts(Cluster& cluster, int n) {
  for (DataType t : kTypes) {
    const size_t es = Size(t);
    // Two ranks per node, node k's ranks 2k, 2k+1 (a job's usual layout);
    // then ranks dealt round-robin to the nodes, one of them empty.
    const size_t per = 1001;
    std::vector<Block> contiguous, dealt;
    for (int rank = 0; rank < 2 * n; ++rank) {
      contiguous.push_back({rank * per * es, per * es, rank / 2});
      const size_t bytes = rank == 1 ? 0 : (per + 13 * rank) * es;
      const size_t at = dealt.empty() ? 0 : dealt.back().offset + dealt.back().bytes;
      dealt.push_back({at, bytes, rank % n});
    }
    const size_t dealt_count = (dealt.back().offset + dealt.back().bytes) / es;
    for (ReduceOp op : kOps) {
      const std::string what = Name(t) + " " + Name(op);
      CheckReduceScatter(cluster, t, op, contiguous, 2 * n * per, false, what + " contiguous");
      CheckReduceScatter(cluster, t, op, dealt, dealt_count, true, what + " dealt, out of place");
    }
  }
  // Nothing to move.
  CheckReduceScatter(cluster, DataType::kFloat32, ReduceOp::kSum, {}, 0, false, "empty");
}

TEST_P(ReduceScatterTest, OwnBlocksReducedForEveryTypeOpAndLayout) {
  const auto [n, channels] = GetParam();
  Cluster cluster(n, channels);
  ReduceScatterLayouts(cluster, n);
}

TEST_P(ReduceScatterTest, RackByRack) {
  const auto [n, channels] = GetParam();
  Cluster cluster(n, channels);
  cluster.set_racks(TestRacks(n));
  ReduceScatterLayouts(cluster, n);
}

INSTANTIATE_TEST_SUITE_P(Nodes, ReduceScatterTest,
                         ::testing::Combine(::testing::Values(1, 2, 3, 5),
                                            ::testing::Values(1, 2)),
                         [](const ::testing::TestParamInfo<NodesChannels>& info) {
                           return absl::StrCat(std::get<0>(info.param), "Nodes",
                                               std::get<1>(info.param), "Channels");
                         });

// Two nodes: the reduce-scatter gives each element the bits the ring
// allreduce gives it (node order), also for arbitrary floats, NaN and -0.
TEST(TwoNodesTest, ReduceScatterGivesTheAllreducesBits) {
  Cluster cluster(2, 2);
  const size_t count = 40001;
  std::mt19937 rng(5);
  std::uniform_real_distribution<float> dist(-1e3f, 1e3f);
  std::vector<std::vector<float>> a(2, std::vector<float>(count));
  for (auto& v : a) {
    for (float& x : v) x = dist(rng);
    v[7] = std::numeric_limits<float>::quiet_NaN();
    v[8] = -0.0f;
  }
  for (ReduceOp op : kOps) {
    std::vector<std::vector<float>> all = a, rs = a;
    ExpectAllOk(cluster.Run(
                    [&](int k, const InterNodeContext& ctx) {
                      return AllreduceRing(ctx, DataType::kFloat32, op, all[k].data(), count);
                    },
                    4096),
                "allreduce");
    const std::vector<Block> blocks = {{0, 20000 * 4, 1}, {20000 * 4, 20001 * 4, 0}};
    ExpectAllOk(cluster.Run(
                    [&](int k, const InterNodeContext& ctx) {
                      return ReduceScatterRing(ctx, DataType::kFloat32, op, rs[k].data(), blocks);
                    },
                    4096),
                "reduce-scatter");
    EXPECT_EQ(std::memcmp(rs[1].data(), all[1].data(), 20000 * 4), 0) << Name(op);
    EXPECT_EQ(std::memcmp(rs[0].data() + 20000, all[0].data() + 20000, 20001 * 4), 0) << Name(op);
  }
}

// ---------------------------------------------------------------------------
// Broadcast from every root: tree (one chunk) and chain (several).

class BroadcastTest : public ::testing::TestWithParam<NodesChannels> {};

void BroadcastFromEveryRoot(Cluster& cluster, int n) {
  for (size_t bytes : {size_t{0}, size_t{1}, size_t{1000}, size_t{100003}}) {
    for (int root = 0; root < n; ++root) {
      std::vector<std::vector<uint8_t>> data(n, std::vector<uint8_t>(bytes + 1, 0));
      for (size_t i = 0; i < bytes; ++i) data[root][i] = Pattern(root, i);
      const std::vector<uint8_t> expected = data[root];
      ExpectAllOk(cluster.Run(
                      [&](int k, const InterNodeContext& ctx) {
                        return Broadcast(ctx, data[k].data(), bytes, root);
                      },
                      4096),
                  absl::StrCat("bytes ", bytes, " root ", root));
      for (int k = 0; k < n; ++k) {
        ASSERT_EQ(data[k], expected) << "bytes " << bytes << " root " << root << " node " << k;
      }
    }
  }
}

TEST_P(BroadcastTest, FromEveryRoot) {
  const auto [n, channels] = GetParam();
  Cluster cluster(n, channels);
  BroadcastFromEveryRoot(cluster, n);
}

TEST_P(BroadcastTest, RackByRack) {
  const auto [n, channels] = GetParam();
  Cluster cluster(n, channels);
  cluster.set_racks(TestRacks(n));
  BroadcastFromEveryRoot(cluster, n);
}

INSTANTIATE_TEST_SUITE_P(Nodes, BroadcastTest,
                         ::testing::Combine(::testing::Values(1, 2, 3, 4, 5, 8),
                                            ::testing::Values(1, 2)),
                         [](const ::testing::TestParamInfo<NodesChannels>& info) {
                           return absl::StrCat(std::get<0>(info.param), "Nodes",
                                               std::get<1>(info.param), "Channels");
                         });

// Reduce-scatter, allgather and broadcast rack by rack on the layouts
// TestRacks lacks: a rack of one node, racks numbered out of node order.
TEST(RackTest, ReduceScatterAllgatherAndBroadcastOnEveryLayout) {
  for (const std::vector<int>& racks :
       {std::vector<int>{0, 0, 0, 1, 1, 2}, std::vector<int>{1, 1, 0, 0, 0}}) {
    const int n = static_cast<int>(racks.size());
    Cluster cluster(n, 2);
    cluster.set_racks(racks);
    ReduceScatterLayouts(cluster, n);
    AllgatherLayouts(cluster, n);
    BroadcastFromEveryRoot(cluster, n);
  }
}

// The other collectives' models: two racks of two, 500 and 25 MB/s.
TEST(RackModelTest, ReduceScatterAllgatherAndBroadcast) {
  constexpr double kStep = 25e-6;
  const double intra = 500e6, inter = 25e6, s = 16 << 20;
  std::vector<std::vector<double>> rates(4, std::vector<double>(4));
  for (int a = 0; a < 4; ++a) {
    for (int b = 0; b < 4; ++b) rates[a][b] = a == b ? 0 : (a < 2) == (b < 2) ? intra : inter;
  }
  const std::vector<int> racks = {0, 0, 1, 1};
  auto c = ModelRacks(RackCollective::kReduceScatter, racks, rates, 16 << 20);
  ASSERT_TRUE(c.has_value());
  EXPECT_NEAR(c->flat_s, 3 * kStep + 0.75 * s / inter, 1e-9);
  EXPECT_NEAR(c->rack_s, kStep + s / intra + kStep + 0.5 * s / inter + kStep + s / 2 / intra,
              1e-9);
  c = ModelRacks(RackCollective::kAllgather, racks, rates, 16 << 20);
  ASSERT_TRUE(c.has_value());
  EXPECT_NEAR(c->rack_s, kStep + s / 2 / intra + kStep + 0.5 * s / inter + kStep + s / 2 / intra,
              1e-9);
  EXPECT_LT(c->rack_s, c->flat_s);
  // A broadcast's flat chain from node 0 crosses the racks once: its only
  // slow edge carries the buffer once, as the racks' would, so the flat
  // chain (no extra phase) wins; from node 1, the chain 1 -> 2 -> 3 -> 0
  // crosses twice, in opposite directions.
  c = ModelRacks(RackCollective::kBroadcast, racks, rates, 16 << 20, 0);
  ASSERT_TRUE(c.has_value());
  EXPECT_NEAR(c->flat_s, 3 * kStep + s / inter, 1e-9);
  EXPECT_LT(c->flat_s, c->rack_s);
  // Interleaved racks: the chain's crossings share each direction's link.
  const std::vector<int> interleaved = {0, 1, 0, 1};
  for (int a = 0; a < 4; ++a) {
    for (int b = 0; b < 4; ++b) {
      rates[a][b] = a == b ? 0 : interleaved[a] == interleaved[b] ? intra : inter;
    }
  }
  c = ModelRacks(RackCollective::kBroadcast, interleaved, rates, 16 << 20, 0);
  ASSERT_TRUE(c.has_value());
  EXPECT_NEAR(c->flat_s, 3 * kStep + s / (inter / 2), 1e-9);
  EXPECT_GT(c->flat_s, c->rack_s);
}

// ---------------------------------------------------------------------------
// Faults.

constexpr milliseconds kFaultDeadline(1000);

bool Names(const absl::Status& s, int node) {
  return std::string(s.message()).find(absl::StrCat("node ", node)) != std::string::npos;
}

// ---------------------------------------------------------------------------
// Alltoall between nodes: every rank's block for every rank on another node
// lands where a plain loop puts it, for ranks contiguous or dealt unevenly
// to the nodes and blocks of 0, 1, odd, not-a-chunk-multiple and large sizes.

class AlltoallTest : public ::testing::TestWithParam<NodesChannels> {};

uint8_t AlltoallByte(size_t from, size_t to, size_t i) {
  return static_cast<uint8_t>(from * 61 + to * 17 + i * 7 + (i >> 9));
}

// Every rank's buffers, its blocks `bytes(from, to)` long, each node as a
// caller does it: its own pairs copied, the others through AlltoallPairwise.
void CheckAlltoallv(Cluster& cluster, const std::vector<int>& node_of_rank,
                    const std::function<size_t(size_t, size_t)>& bytes, uint64_t chunk,
                    const std::string& what) {
  const size_t world = node_of_rank.size();
  std::vector<AlltoallBuffers> ranks(world);
  std::vector<std::vector<uint8_t>> send(world), recv(world);
  for (size_t r = 0; r < world; ++r) {
    for (size_t j = 0; j < world; ++j) {
      ranks[r].send_bytes.push_back(bytes(r, j));
      ranks[r].recv_bytes.push_back(bytes(j, r));
      for (size_t i = 0; i < bytes(r, j); ++i) send[r].push_back(AlltoallByte(r, j, i));
    }
    size_t in = 0;
    for (size_t j = 0; j < world; ++j) in += bytes(j, r);
    recv[r].assign(in + 1, 0xEE);  // one byte past the end: must stay untouched
    ranks[r].send = send[r].data();
    ranks[r].recv = recv[r].data();
  }
  const std::vector<std::vector<uint8_t>> inputs = send;
  ExpectAllOk(cluster.Run(
                  [&](int k, const InterNodeContext& ctx) {
                    std::vector<AlltoallBuffers> mine(world);
                    for (size_t r = 0; r < world; ++r) {
                      if (node_of_rank[r] == k) mine[r] = ranks[r];
                    }
                    // Pairs on one node are the caller's, done meanwhile.
                    bool copied = false;
                    auto local = [&] {
                      copied = true;
                      for (size_t a = 0; a < world; ++a) {
                        size_t at = 0;
                        for (size_t b = 0; b < world; ++b) {
                          if (node_of_rank[a] == k && node_of_rank[b] == k && bytes(a, b) > 0) {
                            size_t into = 0;
                            for (size_t c = 0; c < a; ++c) into += bytes(c, b);
                            std::memcpy(recv[b].data() + into, send[a].data() + at, bytes(a, b));
                          }
                          at += bytes(a, b);
                        }
                      }
                    };
                    absl::Status s = AlltoallPairwise(ctx, node_of_rank, mine, local);
                    if (!copied) return absl::InternalError("meanwhile never ran");
                    return s;
                  },
                  chunk, 3),
              what);
  for (size_t to = 0; to < world; ++to) {
    size_t at = 0;
    for (size_t from = 0; from < world; ++from) {
      for (size_t i = 0; i < bytes(from, to); ++i) {
        ASSERT_EQ(recv[to][at + i], AlltoallByte(from, to, i))
            << what << ": rank " << to << " from " << from << " byte " << i;
      }
      at += bytes(from, to);
    }
    EXPECT_EQ(recv[to][at], 0xEE) << what << ": rank " << to << " written past its end";
    EXPECT_EQ(send[to], inputs[to]) << what << ": input of rank " << to << " written";
  }
}

void CheckAlltoall(Cluster& cluster, const std::vector<int>& node_of_rank, size_t block,
                   uint64_t chunk, const std::string& what) {
  CheckAlltoallv(cluster, node_of_rank, [block](size_t, size_t) { return block; }, chunk, what);
}

TEST_P(AlltoallTest, EveryBlockLandsForEveryLayoutAndSize) {
  const auto [n, channels] = GetParam();
  Cluster cluster(n, channels);
  std::vector<int> one_each, contiguous, dealt;
  for (int k = 0; k < n; ++k) one_each.push_back(k);
  for (int r = 0; r < 2 * n; ++r) contiguous.push_back(r / 2);
  // 3n-1 ranks dealt round-robin: the last node has one rank fewer.
  for (int r = 0; r < 3 * n - 1; ++r) dealt.push_back(n == 1 ? 0 : r % n);
  for (size_t block : {size_t{0}, size_t{1}, size_t{1001}, size_t{4 * 1001 + 3}}) {
    const std::string size = absl::StrCat(" block ", block);
    CheckAlltoall(cluster, one_each, block, 64, "one rank per node" + size);
    CheckAlltoall(cluster, contiguous, block, 64, "two ranks per node" + size);
    CheckAlltoall(cluster, dealt, block, 100, "dealt" + size);
  }
  CheckAlltoall(cluster, contiguous, 100003, 4096, "two ranks per node, large");
  // alltoallv: every pair its own size, many of them empty, some crossing
  // chunks; whole pairs of nodes with nothing between them.
  std::mt19937 rng(n * 7 + channels);
  for (const auto* layout : {&one_each, &contiguous, &dealt}) {
    const size_t world = layout->size();
    std::vector<size_t> sizes(world * world);
    for (size_t& x : sizes) x = rng() % 3 == 0 ? 0 : rng() % 700;
    CheckAlltoallv(cluster, *layout, [&](size_t a, size_t b) { return sizes[a * world + b]; },
                   64, "alltoallv");
    CheckAlltoallv(cluster, *layout,
                   [&](size_t a, size_t b) {
                     return (*layout)[a] == 0 || (*layout)[b] == 0 ? sizes[a * world + b] : 0;
                   },
                   100, "alltoallv, only node 0's pairs");
  }
}

INSTANTIATE_TEST_SUITE_P(Nodes, AlltoallTest,
                         ::testing::Combine(::testing::Values(1, 2, 3, 5),
                                            ::testing::Values(1, 2)),
                         [](const ::testing::TestParamInfo<NodesChannels>& info) {
                           return absl::StrCat(std::get<0>(info.param), "Nodes",
                                               std::get<1>(info.param), "Channels");
                         });

TEST(AlltoallArgumentTest, RejectsBadPlacementAndMissingBuffers) {
  Cluster cluster(2, 1);
  uint8_t a[8] = {}, b[8] = {};
  const AlltoallBuffers good{a, b, {4, 4}, {4, 4}};
  const std::vector<absl::Status> st = cluster.Run(
      [&](int k, const InterNodeContext& ctx) {
        if (k == 0) return AlltoallPairwise(ctx, {0, 2}, {good, good});  // node 2 of 2
        return AlltoallPairwise(ctx, {0, 1}, {good, AlltoallBuffers{nullptr, b, {4, 4}, {4, 4}}});
      },
      64, 4, milliseconds(2000));
  EXPECT_EQ(st[0].code(), absl::StatusCode::kInvalidArgument) << st[0];
  EXPECT_NE(st[0].message().find("rank 1 is on node 2 of 2"), std::string::npos) << st[0];
  EXPECT_EQ(st[1].code(), absl::StatusCode::kInvalidArgument) << st[1];
  EXPECT_NE(st[1].message().find("local rank 1"), std::string::npos) << st[1];
  // The caller's overlapped work runs once even when the schedule cannot.
  int ran = 0;
  const std::vector<absl::Status> again = cluster.Run(
      [&](int k, const InterNodeContext& ctx) {
        if (k != 0) return absl::OkStatus();
        return AlltoallPairwise(ctx, {0, 2}, {good, good}, [&ran] { ++ran; });
      },
      64, 4, milliseconds(2000));
  EXPECT_FALSE(again[0].ok());
  EXPECT_EQ(ran, 1);
}

// Kills `victim` after `after` matched transfers involving it, while all run
// `op`; every node must fail within the deadline (plus scheduling slack), the
// victim's ring neighbours naming it, and well before the deadline, nobody
// else succeeding — except the
// nodes in `may_succeed`: a broadcast's root is done once its last chunk was
// taken by its successor, which can happen before the victim dies further
// down the chain.
void KillMidOperation(int n, int victim, uint64_t after,
                      const std::function<absl::Status(int, const InterNodeContext&,
                                                       std::vector<uint8_t>&)>& op,
                      std::vector<int> must_name, std::vector<int> may_succeed = {}) {
  Cluster cluster(n, 2);
  std::vector<std::vector<uint8_t>> data(n, std::vector<uint8_t>(size_t{1} << 20, 1));
  cluster.hub().KillNodeAfter(victim, after);
  const Clock::time_point start = Clock::now();
  std::vector<milliseconds> took(n);
  const std::vector<absl::Status> st = cluster.Run(
      [&](int k, const InterNodeContext& ctx) {
        absl::Status s = op(k, ctx, data[k]);
        took[k] = std::chrono::duration_cast<milliseconds>(Clock::now() - start);
        return s;
      },
      8192, 4, kFaultDeadline);
  const auto elapsed = Clock::now() - start;
  EXPECT_LT(elapsed, kFaultDeadline + milliseconds(1000));
  // A node whose own transfer with the victim failed cancels the rest at
  // once (the others, whose peers wait for it, hear of the fault from their
  // job in a daemon; here they end at the deadline).
  for (int k : must_name) {
    EXPECT_LT(took[k], kFaultDeadline / 2) << "node " << k << ": " << took[k].count() << " ms";
  }
  for (int k = 0; k < n; ++k) {
    if (st[k].ok() &&
        std::find(may_succeed.begin(), may_succeed.end(), k) != may_succeed.end()) {
      continue;
    }
    EXPECT_FALSE(st[k].ok()) << "node " << k;
    if (k != victim) {
      EXPECT_TRUE(Names(st[k], victim) || st[k].code() == absl::StatusCode::kDeadlineExceeded)
          << "node " << k << ": " << st[k].ToString();
    }
  }
  for (int k : must_name) {
    EXPECT_TRUE(Names(st[k], victim)) << "node " << k << ": " << st[k].ToString();
    EXPECT_EQ(st[k].code(), absl::StatusCode::kUnavailable) << st[k].ToString();
  }
}

TEST(FaultTest, KillNodeMidRing) {
  for (int n : {3, 5, 8}) {
    SCOPED_TRACE(n);
    const int victim = n / 2;
    KillMidOperation(
        n, victim, 20,
        [](int, const InterNodeContext& ctx, std::vector<uint8_t>& d) {
          return AllreduceRing(ctx, DataType::kFloat32, ReduceOp::kSum, d.data(), d.size() / 4);
        },
        {victim - 1, victim + 1});
  }
}

TEST(FaultTest, KillNodeMidHalvingDoubling) {
  for (int n : {4, 5, 8}) {
    SCOPED_TRACE(n);
    KillMidOperation(
        n, 1, 30,
        [](int, const InterNodeContext& ctx, std::vector<uint8_t>& d) {
          return AllreduceHalvingDoubling(ctx, DataType::kInt32, ReduceOp::kMax, d.data(),
                                          d.size() / 4);
        },
        {0});
  }
}

TEST(FaultTest, KillNodeMidAllgatherAndBroadcast) {
  KillMidOperation(
      5, 2, 10,
      [](int, const InterNodeContext& ctx, std::vector<uint8_t>& d) {
        std::vector<Block> blocks;
        for (int k = 0; k < 5; ++k) blocks.push_back({k * (d.size() / 5), d.size() / 5, k});
        return AllgatherRing(ctx, d.data(), blocks);
      },
      {1, 3});
  KillMidOperation(
      5, 2, 10,
      [](int, const InterNodeContext& ctx, std::vector<uint8_t>& d) {
        return BroadcastPipeline(ctx, d.data(), d.size(), 0);
      },
      {1, 3}, /*may_succeed=*/{0});
}

// Strided pieces (a segment of an alltoall): the blocks' first and second
// parts moved by two calls with their own tags land where whole blocks would,
// and nothing between a rank's pieces is touched by the call for the other.
TEST(AlltoallOffsetsTest, PiecesOfEveryBlockLandWhereTheBlocksWould) {
  const int n = 3;
  Cluster cluster(n, 2);
  const size_t block = 5001, first = 2000;  // pieces of 2000 and 3001 bytes
  std::vector<std::vector<uint8_t>> send(n), recv(n, std::vector<uint8_t>(n * block + 1, 0xEE));
  for (int r = 0; r < n; ++r) {
    for (int j = 0; j < n; ++j) {
      for (size_t i = 0; i < block; ++i) send[r].push_back(AlltoallByte(r, j, i));
    }
  }
  ExpectAllOk(cluster.Run(
                  [&](int k, const InterNodeContext& ctx) {
                    for (int part = 0; part < 2; ++part) {
                      const size_t at = part == 0 ? 0 : first;
                      const uint64_t bytes = part == 0 ? first : block - first;
                      std::vector<uint64_t> offsets;  // one block apart
                      for (int j = 0; j < n; ++j) offsets.push_back(j * block);
                      std::vector<AlltoallBuffers> ranks(n);
                      ranks[k] = AlltoallBuffers{send[k].data() + at, recv[k].data() + at,
                                                 std::vector<uint64_t>(n, bytes),
                                                 std::vector<uint64_t>(n, bytes), offsets,
                                                 offsets};
                      InterNodeContext c = ctx;
                      c.tag_base += static_cast<uint64_t>(part) << 44;  // apart from every op's
                      // One rank per node: its own block for itself is the caller's.
                      std::memcpy(recv[k].data() + k * block + at, send[k].data() + k * block + at,
                                  bytes);
                      absl::Status s = AlltoallPairwise(c, {0, 1, 2}, ranks);
                      if (!s.ok()) return s;
                    }
                    return absl::OkStatus();
                  },
                  1024, 3),
              "strided");
  for (int to = 0; to < n; ++to) {
    for (int from = 0; from < n; ++from) {
      for (size_t i = 0; i < block; ++i) {
        ASSERT_EQ(recv[to][from * block + i], AlltoallByte(from, to, i))
            << "rank " << to << " from " << from << " byte " << i;
      }
    }
    EXPECT_EQ(recv[to][n * block], 0xEE) << "rank " << to << " written past its end";
  }
  // Pieces to receive that overlap, and offsets not one per rank, are refused.
  for (bool overlap : {true, false}) {
    std::vector<AlltoallBuffers> bad(n);
    bad[0] = AlltoallBuffers{send[0].data(), recv[0].data(), std::vector<uint64_t>(n, 10),
                             std::vector<uint64_t>(n, 10), {0, 10, 20}, {0, 10, 20}};
    if (overlap) {
      bad[0].recv_offsets = {0, 19, 9};
    } else {
      bad[0].send_offsets.pop_back();
    }
    const std::vector<absl::Status> st = cluster.Run(
        [&](int k, const InterNodeContext& ctx) {
          if (k != 0) return absl::OkStatus();
          return AlltoallPairwise(ctx, {0, 1, 2}, bad);
        },
        1024, 3);
    EXPECT_EQ(st[0].code(), absl::StatusCode::kInvalidArgument) << st[0];
    EXPECT_NE(st[0].message().find(overlap ? "blocks to receive overlap" : "offsets for every"),
              std::string::npos)
        << st[0];
  }
}

TEST(FaultTest, KillNodeMidAlltoall) {
  // One rank per node: the first half of a node's data is its send buffer,
  // the second half its recv buffer.
  KillMidOperation(
      5, 2, 10,
      [](int k, const InterNodeContext& ctx, std::vector<uint8_t>& d) {
        const size_t half = d.size() / 2;
        std::vector<AlltoallBuffers> ranks(5);
        ranks[k] = AlltoallBuffers{d.data(), d.data() + half, std::vector<uint64_t>(5, half / 5),
                                   std::vector<uint64_t>(5, half / 5)};
        return AlltoallPairwise(ctx, {0, 1, 2, 3, 4}, ranks);
      },
      {});
}

TEST(FaultTest, AlltoallBlockSizesThatDisagreeFailEverywhere) {
  Cluster cluster(3, 2);
  std::vector<std::vector<uint8_t>> send(3, std::vector<uint8_t>(3 * 5000, 1));
  std::vector<std::vector<uint8_t>> recv(3, std::vector<uint8_t>(3 * 5000, 0));
  const Clock::time_point start = Clock::now();
  const std::vector<absl::Status> st = cluster.Run(
      [&](int k, const InterNodeContext& ctx) {
        const uint64_t block = k == 1 ? 4999 : 5000;
        std::vector<AlltoallBuffers> ranks(3);
        ranks[k] = AlltoallBuffers{send[k].data(), recv[k].data(), std::vector<uint64_t>(3, block),
                                   std::vector<uint64_t>(3, block)};
        return AlltoallPairwise(ctx, {0, 1, 2}, ranks);
      },
      1024, 4, kFaultDeadline);
  EXPECT_LT(Clock::now() - start, kFaultDeadline + milliseconds(1000));
  for (int k = 0; k < 3; ++k) EXPECT_FALSE(st[k].ok()) << "node " << k;
}

TEST(FaultTest, MismatchedCountsFailEverywhere) {
  for (InterNodeAlgorithm algo : {InterNodeAlgorithm::kRing, InterNodeAlgorithm::kHalvingDoubling}) {
    for (int n : {2, 3, 5}) {
      Cluster cluster(n, 2);
      std::vector<std::vector<float>> data(n, std::vector<float>(20000, 1.0f));
      const Clock::time_point start = Clock::now();
      const std::vector<absl::Status> st = cluster.Run(
          [&](int k, const InterNodeContext& ctx) {
            const size_t count = k == 1 ? 19999 : 20000;
            return Allreduce(ctx, algo, DataType::kFloat32, ReduceOp::kSum, data[k].data(), count);
          },
          1024, 4, kFaultDeadline);
      EXPECT_LT(Clock::now() - start, kFaultDeadline + milliseconds(1000));
      for (int k = 0; k < n; ++k) {
        EXPECT_FALSE(st[k].ok()) << AlgoName(algo) << " n " << n << " node " << k;
      }
    }
  }
}

// With the nodes' names in the context (a daemon's cluster job gives them),
// errors name the node by index and name; inside a rack's phase, by its
// index there and its own name.
TEST(FaultTest, ErrorsNameTheAwaitedNodeByItsName) {
  Cluster cluster(3, 1);
  std::vector<std::vector<float>> data(3, std::vector<float>(1000, 1.0f));
  const std::vector<std::string> names = {"gpu-a", "gpu-b", "gpu-c", "gpu-d"};
  std::vector<absl::Status> st = cluster.Run(
      [&](int k, const InterNodeContext& ctx) {
        if (k == 2) return absl::OkStatus();  // never takes part
        InterNodeContext c = ctx;
        c.node_names.assign(names.begin(), names.begin() + 3);
        return AllreduceRing(c, DataType::kFloat32, ReduceOp::kSum, data[k].data(), 1000);
      },
      256, 4, milliseconds(300));
  EXPECT_EQ(st[0].code(), absl::StatusCode::kDeadlineExceeded) << st[0].ToString();
  EXPECT_NE(st[0].message().find("node 2 (gpu-c)"), std::string::npos) << st[0].ToString();

  Cluster racked(4, 1);
  racked.set_racks({0, 0, 1, 1});
  std::vector<std::vector<float>> more(4, std::vector<float>(1000, 1.0f));
  st = racked.Run(
      [&](int k, const InterNodeContext& ctx) {
        if (k == 3) return absl::OkStatus();
        InterNodeContext c = ctx;
        c.node_names = names;
        return Allreduce(c, InterNodeAlgorithm::kRack, DataType::kFloat32, ReduceOp::kSum,
                         more[k].data(), 1000);
      },
      256, 4, milliseconds(300));
  EXPECT_EQ(st[2].code(), absl::StatusCode::kDeadlineExceeded) << st[2];
  // Node 3 is node 1 of its rack's phase.
  EXPECT_NE(st[2].message().find("node 1 (gpu-d)"), std::string::npos) << st[2];
}

TEST(FaultTest, AbsentNodeGivesDeadlineNamingTheAwaitedNode) {
  Cluster cluster(3, 1);
  std::vector<std::vector<float>> data(3, std::vector<float>(1000, 1.0f));
  const std::vector<absl::Status> st = cluster.Run(
      [&](int k, const InterNodeContext& ctx) {
        if (k == 2) return absl::OkStatus();  // never takes part
        return AllreduceRing(ctx, DataType::kFloat32, ReduceOp::kSum, data[k].data(), 1000);
      },
      256, 4, milliseconds(300));
  EXPECT_EQ(st[0].code(), absl::StatusCode::kDeadlineExceeded) << st[0].ToString();
  EXPECT_TRUE(Names(st[0], 2)) << st[0].ToString();  // node 0 receives from node 2
  EXPECT_EQ(st[1].code(), absl::StatusCode::kDeadlineExceeded) << st[1].ToString();
}

TEST(ArgumentTest, RejectsAvgAndBadTagBase) {
  InProcessHub hub(1, 1);
  ScratchBuffer scratch;
  InterNodeContext ctx{hub.transport(0), 1u << 24, 1024, 4, Clock::now() + milliseconds(100),
                       &scratch};
  float x = 1;
  EXPECT_EQ(AllreduceRing(ctx, DataType::kFloat32, ReduceOp::kAvg, &x, 1).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(AllreduceHalvingDoubling(ctx, DataType::kFloat32, ReduceOp::kAvg, &x, 1).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(AllreduceRing(ctx, static_cast<DataType>(99), ReduceOp::kSum, &x, 1).code(),
            absl::StatusCode::kInvalidArgument);
  ctx.tag_base = 5;
  EXPECT_EQ(AllreduceRing(ctx, DataType::kFloat32, ReduceOp::kSum, &x, 1).code(),
            absl::StatusCode::kInvalidArgument);
  ctx.tag_base = 1u << 24;
  EXPECT_EQ(BroadcastPipeline(ctx, &x, 4, 1).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(AllgatherRing(ctx, &x, {{0, 4, 3}}).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ReduceScatterRing(ctx, DataType::kFloat32, ReduceOp::kSum, &x, {{0, 4, 3}}).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ReduceScatterRing(ctx, DataType::kFloat32, ReduceOp::kSum, &x, {{0, 3, 0}}).code(),
            absl::StatusCode::kInvalidArgument);
}

// ---------------------------------------------------------------------------
// Tags and the automatic choice.

TEST(TagTest, ChunkFieldAndGrowth) {
  EXPECT_EQ(internode_internal::ChunkBits(1), 24);
  EXPECT_EQ(internode_internal::ChunkBits(2), 23);
  EXPECT_EQ(internode_internal::ChunkBits(14), 20);  // ring over 8 nodes
  EXPECT_EQ(internode_internal::ChunkBits(4096), 12);
  // 1 MiB in 4-byte chunks with a 12-bit field: grows to 256 bytes.
  absl::StatusOr<size_t> c = internode_internal::PlanChunkBytes(
      4, 4, 12, [](size_t c) { return ((size_t{1} << 20) + c - 1) / c; });
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(*c, 256u);
  // Rounded down to whole elements, at least one.
  EXPECT_EQ(*internode_internal::PlanChunkBytes(1001, 8, 24, [](size_t) { return 1; }), 1000u);
  EXPECT_EQ(*internode_internal::PlanChunkBytes(3, 8, 24, [](size_t) { return 1; }), 8u);
}

TEST(AutoTest, Rule) {
  EXPECT_EQ(ChooseAllreduceAlgorithm(1, 100), InterNodeAlgorithm::kRing);
  EXPECT_EQ(ChooseAllreduceAlgorithm(2, 1000), InterNodeAlgorithm::kHalvingDoubling);
  EXPECT_EQ(ChooseAllreduceAlgorithm(2, 32 << 10), InterNodeAlgorithm::kHalvingDoubling);
  EXPECT_EQ(ChooseAllreduceAlgorithm(2, 64 << 10), InterNodeAlgorithm::kRing);
  EXPECT_EQ(ChooseAllreduceAlgorithm(2, 1 << 20), InterNodeAlgorithm::kRing);
  EXPECT_EQ(ChooseAllreduceAlgorithm(8, 64 << 10), InterNodeAlgorithm::kHalvingDoubling);
  EXPECT_EQ(ChooseAllreduceAlgorithm(8, 256 << 10), InterNodeAlgorithm::kRing);
  EXPECT_EQ(ChooseAllreduceAlgorithm(2, (1 << 20) + 1), InterNodeAlgorithm::kRing);
  EXPECT_EQ(ChooseAllreduceAlgorithm(8, 4096), InterNodeAlgorithm::kHalvingDoubling);
  EXPECT_EQ(ChooseAllreduceAlgorithm(8, 1 << 20), InterNodeAlgorithm::kRing);
  EXPECT_EQ(ChooseAllreduceAlgorithm(3, 64 << 10), InterNodeAlgorithm::kRing);
  EXPECT_EQ(ChooseAllreduceAlgorithm(3, 16 << 10), InterNodeAlgorithm::kHalvingDoubling);
}

// What fusion may pack (TwoNodesTest above shows the ring's 2-node bits).
TEST(AutoTest, OffsetIndependence) {
  for (int n : {2, 3, 5, 8}) {
    EXPECT_TRUE(OffsetIndependent(n, InterNodeAlgorithm::kHalvingDoubling)) << n;
    EXPECT_EQ(OffsetIndependent(n, InterNodeAlgorithm::kRing), n == 2) << n;
  }
}

}  // namespace
}  // namespace ciuic::daemon
