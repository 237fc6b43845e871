// DirectExchange between "nodes" that are threads of one process
// (InProcessHub): every dtype, reduce op, size class and node count 1..5
// against a plain loop, the same bits on every node; mismatches of every
// kind fail every node naming both signatures; a node that cannot take part
// or is lost fails everyone at once, without waiting for a deadline.
#include "cluster/direct_exchange.h"

#include <gtest/gtest.h>

#include <chrono>
#include <condition_variable>
#include <cstring>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "collectives/internode/in_process_transport.h"
#include "reduce/testing/elements.h"

namespace ciuic::daemon {
namespace {

using reduce::testing::GetElement;
using reduce::testing::PutElement;
using wire::DataType;
using wire::ReduceOp;

// Small integers, so that every dtype holds every partial result exactly
// and the plain loop needs no tolerance; prod takes factors of 1 and 2 with
// signs (unsigned: no sign).
double Value(int node, size_t i, ReduceOp op, DataType t) {
  const bool unsigned_type = t == DataType::kUInt8;
  if (op == ReduceOp::kProd) {
    const int f = static_cast<int>((node * 5 + i * 3) % 4);
    const double v = f < 2 ? 1 : 2;
    return (!unsigned_type && f % 2 == 1) ? -v : v;
  }
  const double v = static_cast<double>((node * 7 + i * 3) % 11);
  return unsigned_type ? v : v - 5;
}

double Fold(ReduceOp op, double a, double b) {
  switch (op) {
    case ReduceOp::kSum:
    case ReduceOp::kAvg: return a + b;
    case ReduceOp::kMin: return std::min(a, b);
    case ReduceOp::kMax: return std::max(a, b);
    case ReduceOp::kProd: return a * b;
  }
  return 0;
}

OpSignature Sig(DataType t, ReduceOp op, uint64_t count) {
  OpSignature s;
  s.collective = static_cast<uint32_t>(wire::Collective::kAllreduce);
  s.dtype = static_cast<uint32_t>(t);
  s.reduce_op = static_cast<uint32_t>(op);
  s.count = count;
  return s;
}

struct Result {
  absl::Status status;
  std::vector<uint8_t> bytes;
  bool done = false;
  size_t own_bytes = 0;  // the exchange's own_payload_bytes() at its end
};

// Runs one exchange on `nodes` nodes: node k with signature sigs[k] and
// the Value()s; fail_local[k] makes node k fail its local phase. Waits for
// every node's end (at most 20 s) and returns them. With `buffers` >= 0,
// node k takes its value from payload(), an input buffer, or either with
// an output buffer (UseBuffers), by (k + buffers) % 4: the result must then
// be in the output buffer, and the input unchanged.
std::vector<Result> Exchange(int nodes, const std::vector<OpSignature>& sigs,
                             const std::vector<bool>& fail_local = {}, int kill_node = -1,
                             int buffers = -1) {
  InProcessHub hub(nodes, 1);
  std::mutex mu;
  std::condition_variable cv;
  std::vector<Result> results(static_cast<size_t>(nodes));
  std::vector<std::shared_ptr<DirectExchange>> exchanges;
  std::vector<std::vector<uint8_t>> inputs(static_cast<size_t>(nodes));
  std::vector<std::vector<uint8_t>> input_copies(static_cast<size_t>(nodes));
  std::vector<std::vector<uint8_t>> outputs(static_cast<size_t>(nodes));
  for (int k = 0; k < nodes; ++k) {
    DirectExchange::Params p;
    p.transport = hub.transport(k);
    p.tag_base = uint64_t{5} << 24;
    p.name = "#5";
    p.sig = sigs[static_cast<size_t>(k)];
    const auto op = static_cast<ReduceOp>(p.sig.reduce_op);
    p.op = op == ReduceOp::kAvg ? ReduceOp::kSum : op;
    const size_t bytes = p.sig.count * p.sig.element_bytes();
    const int variant = buffers < 0 ? 0 : (k + buffers) % 4;
    std::vector<uint8_t>& input = inputs[static_cast<size_t>(k)];
    std::vector<uint8_t>& output = outputs[static_cast<size_t>(k)];
    if (variant & 1) input.assign(bytes + 1, 0);  // + 1: never a null data()
    if (variant & 2) output.assign(bytes + 1, 0xAB);
    uint8_t* want_at = (variant & 2) ? output.data() : nullptr;
    auto ex = DirectExchange::Create(
        p, [&mu, &cv, &results, k, bytes, want_at](absl::Status s, uint8_t* r) {
          std::lock_guard<std::mutex> lock(mu);
          Result& res = results[static_cast<size_t>(k)];
          res.status = s;
          if (s.ok()) res.bytes.assign(r, r + bytes);
          if (s.ok() && want_at != nullptr && r != want_at) {
            res.status = absl::InternalError("the result is not in the output buffer");
          }
          res.done = true;
          cv.notify_all();
        });
    const auto t = static_cast<DataType>(p.sig.dtype);
    uint8_t* value = (variant & 1) ? input.data() : ex->payload();
    for (size_t i = 0; i < p.sig.count; ++i) PutElement(t, value, i, Value(k, i, op, t));
    if (variant != 0) {
      ex->UseBuffers((variant & 1) ? input.data() : nullptr, (variant & 2) ? output.data() : nullptr);
    }
    input_copies[static_cast<size_t>(k)] = input;
    if (static_cast<size_t>(k) < fail_local.size() && fail_local[static_cast<size_t>(k)]) {
      ex->FailLocally(absl::InternalError("device fault in the local phase"));
    }
    exchanges.push_back(ex);
  }
  if (kill_node >= 0) hub.KillNode(kill_node);
  for (auto& ex : exchanges) ex->Start();
  std::unique_lock<std::mutex> lock(mu);
  const bool all = cv.wait_for(lock, std::chrono::seconds(20), [&] {
    for (int k = 0; k < nodes; ++k) {
      if (k != kill_node && !results[static_cast<size_t>(k)].done) return false;
    }
    return true;
  });
  EXPECT_TRUE(all) << "an exchange did not end";
  for (int k = 0; k < nodes; ++k) {
    results[static_cast<size_t>(k)].own_bytes = exchanges[static_cast<size_t>(k)]->own_payload_bytes();
  }
  for (int k = 0; k < nodes; ++k) {
    EXPECT_EQ(inputs[static_cast<size_t>(k)], input_copies[static_cast<size_t>(k)])
        << "node " << k << " wrote into its input";
  }
  return results;
}

TEST(DirectExchangeTest, EveryDtypeOpSizeAndNodeCountMatchesThePlainLoop) {
  for (int nodes = 1; nodes <= 5; ++nodes) {
    for (DataType t : wire::kAllDataTypes) {
      for (ReduceOp op : wire::kAllReduceOps) {
        if (op == ReduceOp::kAvg) continue;  // the caller's division (ClusterJob)
        // 16384 and 40001 elements of 4 bytes and more go by halving from 4
        // nodes (40001: halves of uneven length).
        for (size_t count :
             {size_t{0}, size_t{1}, size_t{7}, size_t{1001}, size_t{16384}, size_t{40001}}) {
          // The value in payload() (-1), or in the caller's buffers
          // (UseBuffers): every node in every variant.
          for (int buffers = -1; buffers < 4; ++buffers) {
            SCOPED_TRACE(testing::Message() << nodes << " nodes, " << Sig(t, op, count).ToString()
                                            << ", buffers " << buffers);
            std::vector<OpSignature> sigs(static_cast<size_t>(nodes), Sig(t, op, count));
            std::vector<Result> got = Exchange(nodes, sigs, {}, -1, buffers);
            for (int k = 0; k < nodes; ++k) {
              const Result& r = got[static_cast<size_t>(k)];
              ASSERT_TRUE(r.status.ok()) << r.status;
              ASSERT_EQ(r.bytes.size(), count * wire::DataTypeSize(static_cast<uint32_t>(t)));
              // Every node ends with the same bits.
              EXPECT_EQ(r.bytes, got[0].bytes) << "node " << k;
            }
            for (size_t i = 0; i < count; ++i) {
              double want = Value(0, i, op, t);
              for (int k = 1; k < nodes; ++k) want = Fold(op, want, Value(k, i, op, t));
              ASSERT_EQ(GetElement(t, got[0].bytes.data(), i), want) << "element " << i;
            }
          }
        }
      }
    }
  }
}

TEST(DirectExchangeTest, AMismatchFailsEveryNodeNamingBothSignatures) {
  // Small values (doubling) and values of 4 nodes and more that go by
  // halving; odd ones of either kind among them, so that nodes whose
  // signatures disagree may run different algorithms.
  const OpSignature small_base = Sig(DataType::kFloat32, ReduceOp::kSum, 6);
  const OpSignature large_base = Sig(DataType::kFloat32, ReduceOp::kSum, 20000);
  for (const OpSignature& base : {small_base, large_base}) {
    OpSignature bigger = base;
    bigger.count = base.count + 3;
    OpSignature smaller = base;
    smaller.count = 2;
    OpSignature other_type = base;
    other_type.dtype = static_cast<uint32_t>(DataType::kInt32);  // same bytes
    OpSignature other_op = base;
    other_op.reduce_op = static_cast<uint32_t>(ReduceOp::kMax);
    OpSignature large = base;  // its value goes apart from the header
    large.count = 5000;
    OpSignature halving = base;  // by halving from 4 nodes
    halving.count = 30001;
    for (int nodes : {2, 3, 4, 5}) {
      for (const OpSignature& odd : {bigger, smaller, other_type, other_op, large, halving}) {
        if (odd == base) continue;
        for (int at = 0; at < nodes; ++at) {
          SCOPED_TRACE(testing::Message() << nodes << " nodes of " << base.ToString() << ", node "
                                          << at << " submits " << odd.ToString());
          std::vector<OpSignature> sigs(static_cast<size_t>(nodes), base);
          sigs[static_cast<size_t>(at)] = odd;
          std::vector<Result> got = Exchange(nodes, sigs);
          for (int k = 0; k < nodes; ++k) {
            const absl::Status& s = got[static_cast<size_t>(k)].status;
            EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << "node " << k << ": " << s;
            const std::string msg(s.message());
            EXPECT_NE(msg.find("operation '#5' mismatched across nodes"), std::string::npos) << msg;
            EXPECT_NE(msg.find(sigs[static_cast<size_t>(k)].ToString()), std::string::npos) << msg;
            // Every node read the other signature (headers are never cut).
            EXPECT_NE(msg.find(base.ToString()), std::string::npos) << msg;
            EXPECT_NE(msg.find(odd.ToString()), std::string::npos) << msg;
          }
        }
      }
    }
  }
}

TEST(DirectExchangeTest, ANodeThatCannotTakePartFailsEveryoneAtOnce) {
  for (int nodes : {2, 3, 5}) {
    for (int at = 0; at < nodes; ++at) {
      std::vector<OpSignature> sigs(static_cast<size_t>(nodes),
                                    Sig(DataType::kFloat32, ReduceOp::kSum, 3));
      std::vector<bool> fail(static_cast<size_t>(nodes), false);
      fail[static_cast<size_t>(at)] = true;
      const auto start = std::chrono::steady_clock::now();
      std::vector<Result> got = Exchange(nodes, sigs, fail);
      EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(5));
      for (int k = 0; k < nodes; ++k) {
        const absl::Status& s = got[static_cast<size_t>(k)].status;
        ASSERT_FALSE(s.ok()) << nodes << " nodes, node " << at << " failed; node " << k;
        if (k == at) {
          EXPECT_NE(s.message().find("device fault"), std::string::npos) << s;
        } else {
          EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
          EXPECT_NE(s.message().find("could not take part"), std::string::npos) << s;
        }
      }
    }
  }
}

// A node whose own ranks disagree fails its local phase with
// INVALID_ARGUMENT: every node gets INVALID_ARGUMENT with that node's words.
TEST(DirectExchangeTest, AMismatchAmongOneNodesRanksReachesEveryNode) {
  InProcessHub hub(3, 1);
  std::mutex mu;
  std::condition_variable cv;
  std::vector<absl::Status> ends(3);
  int ended = 0;
  std::vector<std::shared_ptr<DirectExchange>> exchanges;
  for (int k = 0; k < 3; ++k) {
    DirectExchange::Params p;
    p.transport = hub.transport(k);
    p.name = "#9";
    p.sig = Sig(DataType::kFloat32, ReduceOp::kSum, 4);
    exchanges.push_back(DirectExchange::Create(p, [&, k](absl::Status s, uint8_t*) {
      std::lock_guard<std::mutex> lock(mu);
      ends[static_cast<size_t>(k)] = s;
      ++ended;
      cv.notify_all();
    }));
  }
  exchanges[2]->FailLocally(absl::InvalidArgumentError("rank 4 submitted count=4, rank 5 count=6"));
  for (auto& ex : exchanges) ex->Start();
  std::unique_lock<std::mutex> lock(mu);
  ASSERT_TRUE(cv.wait_for(lock, std::chrono::seconds(20), [&] { return ended == 3; }));
  for (const absl::Status& s : ends) {
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_NE(s.message().find("rank 4 submitted count=4, rank 5 count=6"), std::string::npos) << s;
  }
}

// Also by halving (20000 elements of 8 bytes on 4 and 5 nodes), with the
// values in the caller's buffers: the survivors still gather what their
// partners send after their own round failed, into their own memory.
TEST(DirectExchangeTest, ALostNodeEndsTheOthersExchangesWithAnError) {
  for (uint64_t count : {uint64_t{100}, uint64_t{20000}}) {
    for (int nodes : {2, 3, 4, 5}) {
      for (int buffers = -1; buffers < 4; ++buffers) {
        for (int lost : {0, nodes - 1}) {
          std::vector<OpSignature> sigs(static_cast<size_t>(nodes),
                                        Sig(DataType::kInt64, ReduceOp::kMax, count));
          std::vector<Result> got = Exchange(nodes, sigs, {}, lost, buffers);
          for (int k = 0; k < nodes; ++k) {
            if (k == lost) continue;
            EXPECT_FALSE(got[static_cast<size_t>(k)].status.ok())
                << nodes << " nodes, count " << count << ", node " << k << " (lost " << lost << ")";
          }
        }
      }
    }
  }
}

// A node's single rank on two nodes (the caller's input and output, a
// value sent apart): the value is sent from the input and folded into the
// output, and the exchange allocates no value of its own. With its value in
// payload(), or on more nodes (several receives), it does.
// An exchange abandoned by its node (its operation timed out there) lets go
// of the caller's buffers: on 3 nodes node 0 waits for node 2's value when
// it abandons; node 2's value then arrives and is not folded into node 0's
// output, node 0's later messages say it failed, and nodes 1 and 2 fail
// the operation with node 0's words instead of completing it. Nothing of
// node 0's buffers was in the transport: `released` runs at once. 2000
// floats (a value sent apart) and 3 (inline).
TEST(DirectExchangeTest, AnAbandonedExchangeLeavesTheCallersBuffersAndFailsEveryNode) {
  for (size_t count : {size_t{3}, size_t{2000}}) {
    SCOPED_TRACE(count);
    InProcessHub hub(3, 1);
    std::mutex mu;
    std::condition_variable cv;
    std::vector<Result> results(3);
    std::vector<std::shared_ptr<DirectExchange>> ex;
    std::vector<float> input(count, 1.0f), output(count, -7.0f);
    for (int k = 0; k < 3; ++k) {
      DirectExchange::Params p;
      p.transport = hub.transport(k);
      p.tag_base = uint64_t{5} << 24;
      p.name = "#5";
      p.sig = Sig(DataType::kFloat32, ReduceOp::kSum, count);
      ex.push_back(DirectExchange::Create(p, [&, k](absl::Status s, uint8_t*) {
        std::lock_guard<std::mutex> lock(mu);
        results[static_cast<size_t>(k)].status = s;
        results[static_cast<size_t>(k)].done = true;
        cv.notify_all();
      }));
      if (k == 0) {
        ex[0]->UseBuffers(reinterpret_cast<const uint8_t*>(input.data()),
                          reinterpret_cast<uint8_t*>(output.data()));
      } else {
        std::memset(ex.back()->payload(), 0, count * sizeof(float));
      }
    }
    ex[0]->Start();
    ex[1]->Start();
    std::this_thread::sleep_for(std::chrono::milliseconds(50));  // node 0 waits for node 2
    bool released = false;
    EXPECT_TRUE(ex[0]->Abandon(absl::DeadlineExceededError("operation '#5' timed out here"),
                               [&released] { released = true; }));
    EXPECT_TRUE(released);
    std::fill(input.begin(), input.end(), 42.0f);  // the rank's buffers are its own again
    std::fill(output.begin(), output.end(), 42.0f);
    ex[2]->Start();
    std::unique_lock<std::mutex> lock(mu);
    ASSERT_TRUE(cv.wait_for(lock, std::chrono::seconds(20),
                            [&] { return results[0].done && results[1].done && results[2].done; }));
    EXPECT_EQ(results[0].status.code(), absl::StatusCode::kDeadlineExceeded) << results[0].status;
    for (int k = 1; k < 3; ++k) {
      const absl::Status& s = results[static_cast<size_t>(k)].status;
      EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << "node " << k << ": " << s;
      EXPECT_NE(s.message().find("node 0 could not take part in it: operation '#5' timed out here"),
                std::string::npos)
          << "node " << k << ": " << s;
    }
    EXPECT_EQ(input, std::vector<float>(count, 42.0f));
    EXPECT_EQ(output, std::vector<float>(count, 42.0f));
  }
}

// A value sent apart from the caller's input is in the transport until the
// other node takes it (the hub's sends complete when matched): Abandon
// cannot let go of it, `released` waits for the transfer to end (here: the
// peer cut off), and runs before the exchange's `finished`.
TEST(DirectExchangeTest, AbandonWaitsForATransferOfTheCallersBuffers) {
  InProcessHub hub(2, 1);
  std::vector<float> input(2000, 1.0f), output(2000, 0.0f);
  DirectExchange::Params p;
  p.transport = hub.transport(0);
  p.tag_base = uint64_t{5} << 24;
  p.name = "#5";
  p.sig = Sig(DataType::kFloat32, ReduceOp::kSum, input.size());
  std::mutex mu;
  std::condition_variable cv;
  std::vector<std::string> events;
  auto note = [&](std::string what) {
    std::lock_guard<std::mutex> lock(mu);
    events.push_back(std::move(what));
    cv.notify_all();
  };
  auto ex = DirectExchange::Create(
      p, [&](absl::Status s, uint8_t*) { note(s.ok() ? "finished ok" : "finished failed"); });
  ex->UseBuffers(reinterpret_cast<const uint8_t*>(input.data()),
                 reinterpret_cast<uint8_t*>(output.data()));
  ex->Start();
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  EXPECT_FALSE(ex->Abandon(absl::DeadlineExceededError("timed out"), [&] { note("released"); }));
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  {
    std::lock_guard<std::mutex> lock(mu);
    EXPECT_TRUE(events.empty()) << events.front();
  }
  hub.transport(0)->FailPeer(1, absl::UnavailableError("cut off"));
  std::unique_lock<std::mutex> lock(mu);
  ASSERT_TRUE(cv.wait_for(lock, std::chrono::seconds(20), [&] { return events.size() == 2; }));
  EXPECT_EQ(events, (std::vector<std::string>{"released", "finished failed"}));
  EXPECT_EQ(output, std::vector<float>(2000, 0.0f));
}

TEST(DirectExchangeTest, OneRankOnTwoNodesAllocatesNoValue) {
  for (int nodes = 1; nodes <= 3; ++nodes) {
    for (size_t count : {size_t{200}, size_t{40001}}) {  // inline, and sent apart
      for (int buffers : {-1, 3}) {  // payload(); input and output on every node
        SCOPED_TRACE(testing::Message() << nodes << " nodes, " << count << " floats, buffers "
                                        << buffers);
        const OpSignature sig = Sig(DataType::kFloat32, ReduceOp::kSum, count);
        std::vector<Result> got =
            Exchange(nodes, std::vector<OpSignature>(nodes, sig), {}, -1, buffers);
        const size_t bytes = count * sizeof(float);
        for (int k = 0; k < nodes; ++k) {
          const Result& r = got[static_cast<size_t>(k)];
          ASSERT_TRUE(r.status.ok()) << r.status;
          for (size_t i = 0; i < count; ++i) {
            double want = 0;
            for (int n = 0; n < nodes; ++n) want += Value(n, i, ReduceOp::kSum, DataType::kFloat32);
            ASSERT_EQ(GetElement(DataType::kFloat32, r.bytes.data(), i), want) << "element " << i;
          }
          // Exchange() gives node k the variant (k + buffers) % 4: with 3,
          // node 0 has both buffers, node 1 neither, node 2 the input alone.
          const int variant = buffers < 0 ? 0 : (k + buffers) % 4;
          const bool none = nodes <= 2 && variant == 3 && bytes > DirectExchange::kInlineBytes;
          if (none) {
            EXPECT_EQ(r.own_bytes, 0u) << "node " << k;
          } else if (variant == 0) {
            EXPECT_GE(r.own_bytes, bytes) << "node " << k;
          }
        }
      }
    }
  }
}

TEST(DirectExchangeTest, ABarrierCarriesHeadersOnly) {
  OpSignature barrier;
  barrier.collective = static_cast<uint32_t>(wire::Collective::kBarrier);
  for (int nodes = 1; nodes <= 5; ++nodes) {
    std::vector<Result> got = Exchange(nodes, std::vector<OpSignature>(nodes, barrier));
    for (const Result& r : got) EXPECT_TRUE(r.status.ok()) << r.status;
  }
}

}  // namespace
}  // namespace ciuic::daemon
