// PlanSingleNode on any machine: each plan run on host memory (reductions
// with the CPU kernels, which the device kernels match bit for bit, see
// kernels_test.cc; copies with memcpy) against plain loops, for every
// collective, several dtypes, sizes 0, 1, odd and larger, 1 to 3 ranks, in
// place and apart: what CudaDeviceRunner enqueues for a single-node
// operation, checked without a GPU.
#include "cuda/device_plan.h"

#include <gtest/gtest.h>

#include <cstring>
#include <functional>
#include <vector>

#include "reduce/reduce.h"

namespace ciuic::daemon {
namespace {

using Kind = DeviceStep::Kind;

double Get(wire::DataType t, const uint8_t* p, size_t i) {
  switch (t) {
    case wire::DataType::kFloat32: {
      float v;
      std::memcpy(&v, p + 4 * i, 4);
      return v;
    }
    case wire::DataType::kFloat64: {
      double v;
      std::memcpy(&v, p + 8 * i, 8);
      return v;
    }
    case wire::DataType::kInt32: {
      int32_t v;
      std::memcpy(&v, p + 4 * i, 4);
      return v;
    }
    case wire::DataType::kInt8:
      return static_cast<int8_t>(p[i]);
    default:
      ADD_FAILURE() << "dtype";
      return 0;
  }
}

void Put(wire::DataType t, uint8_t* p, size_t i, double v) {
  switch (t) {
    case wire::DataType::kFloat32: {
      float x = static_cast<float>(v);
      std::memcpy(p + 4 * i, &x, 4);
      break;
    }
    case wire::DataType::kFloat64:
      std::memcpy(p + 8 * i, &v, 8);
      break;
    case wire::DataType::kInt32: {
      int32_t x = static_cast<int32_t>(v);
      std::memcpy(p + 4 * i, &x, 4);
      break;
    }
    case wire::DataType::kInt8:
      p[i] = static_cast<uint8_t>(static_cast<int8_t>(v));
      break;
    default:
      ADD_FAILURE() << "dtype";
  }
}

// Small integers that differ from element to element and rank to rank
// (so that a wrong offset shows), exact in every dtype here, sums of 3
// within int8.
double Value(int rank, size_t i) {
  return static_cast<double>((i * 7 + static_cast<size_t>(rank) * 3) % 11) - 5;
}

void RunOnHost(const std::vector<DeviceStep>& steps, const OpSignature& sig) {
  const auto dtype = static_cast<wire::DataType>(sig.dtype);
  const auto op = static_cast<wire::ReduceOp>(sig.reduce_op);
  const size_t bytes = sig.count * sig.element_bytes();
  for (const DeviceStep& s : steps) {
    std::vector<const void*> in(s.inputs.begin(), s.inputs.end());
    switch (s.kind) {
      case Kind::kReduceToAll:
        ASSERT_FALSE(s.outputs.empty());
        reduce::Reduce(dtype, op, in.data(), static_cast<int>(in.size()), s.outputs[0], sig.count);
        for (size_t o = 1; o < s.outputs.size(); ++o) {
          if (s.outputs[o] != s.outputs[0]) std::memcpy(s.outputs[o], s.outputs[0], bytes);
        }
        break;
      case Kind::kReduce:
        ASSERT_EQ(s.outputs.size(), 1u);
        reduce::Reduce(dtype, op, in.data(), static_cast<int>(in.size()), s.outputs[0], sig.count);
        break;
      case Kind::kCopy:
        ASSERT_NE(s.to, s.from);
        ASSERT_GT(s.bytes, 0u);
        std::memcpy(s.to, s.from, s.bytes);
        break;
      case Kind::kPeerCopy:
        ADD_FAILURE() << "a copy between devices among the operation's own steps";
        break;
    }
  }
}

// Which of the ranks' buffers the tests take as far from the operation's
// device (device 0; far buffers are on device 1): the runner mirrors those.
// (kSendsButRank0 / kRecvsButRank0: only those buffers of every rank but
// rank 0, as for a rank whose two buffers are on two devices.)
enum class Far { kNone, kAllButRank0, kAll, kSendsButRank0, kRecvsButRank0 };
Far g_far = Far::kNone;

bool IsFar(int rank, bool send) {
  switch (g_far) {
    case Far::kNone:
      return false;
    case Far::kAllButRank0:
      return rank != 0;
    case Far::kAll:
      return true;
    case Far::kSendsButRank0:
      return send && rank != 0;
    case Far::kRecvsButRank0:
      return !send && rank != 0;
  }
  return false;
}

// A plan as the runner makes it: the far buffers mirrored in scratch (host
// memory here), the steps planned on the mirrors.
struct Planned {
  std::vector<DeviceStep> steps;
  Mirrors mirrors;
  std::vector<uint8_t> scratch;
  size_t size() const { return steps.size(); }
};

bool Inside(const uint8_t* p, const uint8_t* base, size_t bytes) {
  return base != nullptr && p >= base && p < base + bytes;
}

absl::StatusOr<Planned> Plan(const OpSignature& sig, std::vector<DeviceRankBuffers> ranks,
                             std::vector<uint8_t*> send, std::vector<uint8_t*> recv) {
  const size_t world = ranks.size();
  std::vector<bool> send_far(world), recv_far(world);
  for (size_t r = 0; r < world; ++r) {
    recv_far[r] = IsFar(static_cast<int>(r), false);
    // A send buffer in the receive buffer (in place) is that memory.
    const bool in_recv = send[r] != nullptr && recv[r] != nullptr && send[r] >= recv[r] &&
                         send[r] < recv[r] + ranks[r].recv_bytes;
    send_far[r] = in_recv ? recv_far[r] : IsFar(static_cast<int>(r), true);
    ranks[r].send.device = send_far[r] ? 1 : 0;
    ranks[r].recv.device = recv_far[r] ? 1 : 0;
  }
  const std::vector<uint8_t*> original_send = send, original_recv = recv;
  Planned p;
  const size_t bytes = Mirror(ranks, 0, send_far, recv_far, nullptr, &send, &recv).bytes;
  EXPECT_EQ(send, original_send) << "sizing changed the pointers";
  EXPECT_EQ(recv, original_recv) << "sizing changed the pointers";
  p.scratch.assign(bytes, 0x5a);
  p.mirrors = Mirror(ranks, 0, send_far, recv_far, p.scratch.data(), &send, &recv);
  EXPECT_EQ(p.mirrors.bytes, bytes);
  for (const DeviceStep& s : p.mirrors.in) {
    EXPECT_EQ(s.kind, Kind::kPeerCopy);
    EXPECT_EQ(s.from_device, 1);
    EXPECT_EQ(s.to_device, 0);
    EXPECT_TRUE(Inside(s.to, p.scratch.data(), bytes));
    EXPECT_EQ((s.to - p.scratch.data()) % 256, 0) << "a mirror aligned less than cudaMalloc's";
  }
  for (const DeviceStep& s : p.mirrors.out) {
    EXPECT_EQ(s.from_device, 0);
    EXPECT_EQ(s.to_device, 1);
    EXPECT_TRUE(Inside(s.from, p.scratch.data(), bytes));
  }
  auto steps = PlanSingleNode(sig, ranks, send, recv);
  if (!steps.ok()) return steps.status();
  p.steps = std::move(*steps);
  // The operation's own steps never touch far memory (kernels there could
  // not read it).
  auto near = [&](const uint8_t* q) {
    for (size_t r = 0; r < world; ++r) {
      if ((send_far[r] && Inside(q, original_send[r], ranks[r].send_bytes)) ||
          (recv_far[r] && Inside(q, original_recv[r], ranks[r].recv_bytes))) {
        return false;
      }
    }
    return true;
  };

  for (const DeviceStep& s : p.steps) {
    for (const uint8_t* q : s.inputs) EXPECT_TRUE(near(q)) << "a step reads far memory";
    for (const uint8_t* q : s.outputs) EXPECT_TRUE(near(q)) << "a step writes far memory";
    if (s.kind == Kind::kCopy) {
      EXPECT_TRUE(near(s.from) && near(s.to)) << "a far copy";
    }
  }
  return p;
}

void CopyBetweenDevices(const std::vector<DeviceStep>& steps) {
  for (const DeviceStep& s : steps) {
    ASSERT_EQ(s.kind, Kind::kPeerCopy);
    ASSERT_GT(s.bytes, 0u);
    std::memcpy(s.to, s.from, s.bytes);
  }
}

void RunOnHost(const Planned& p, const OpSignature& sig) {
  CopyBetweenDevices(p.mirrors.in);
  RunOnHost(p.steps, sig);
  CopyBetweenDevices(p.mirrors.out);
}

// The ranks' buffers: send (null where `no_send(r)`) and recv, each with a
// guard byte after it that must stay.
struct Buffers {
  std::vector<std::vector<uint8_t>> send, recv;
  std::vector<uint8_t*> send_ptr, recv_ptr;
};
constexpr uint8_t kGuard = 0xa5;

Buffers Make(int world, size_t send_bytes, size_t recv_bytes,
             const std::function<bool(int)>& no_send) {
  Buffers b;
  for (int r = 0; r < world; ++r) {
    b.send.emplace_back(send_bytes + 1, kGuard);
    b.recv.emplace_back(recv_bytes + 1, kGuard);
  }
  for (int r = 0; r < world; ++r) {
    b.send_ptr.push_back(no_send(r) ? nullptr : b.send[r].data());
    b.recv_ptr.push_back(b.recv[r].data());
  }
  return b;
}

std::vector<DeviceRankBuffers> Ranks(int world, uint64_t send_bytes, uint64_t recv_bytes) {
  std::vector<DeviceRankBuffers> ranks(world);
  for (int r = 0; r < world; ++r) {
    ranks[r].rank = r;
    ranks[r].send_bytes = send_bytes;
    ranks[r].recv_bytes = recv_bytes;
  }
  return ranks;
}

OpSignature Sig(wire::Collective c, wire::DataType t, wire::ReduceOp op, size_t count,
                int root = 0) {
  OpSignature sig;
  sig.collective = static_cast<uint32_t>(c);
  sig.dtype = static_cast<uint32_t>(t);
  sig.reduce_op = static_cast<uint32_t>(op);
  sig.count = count;
  sig.root = root;
  sig.device = true;
  return sig;
}

const wire::DataType kTypes[] = {wire::DataType::kFloat32, wire::DataType::kFloat64,
                                 wire::DataType::kInt32, wire::DataType::kInt8};
const size_t kSizes[] = {0, 1, 7, 1000};

// Every plan with the ranks' buffers near the operation's device, with
// every rank's but rank 0's far (mirrored), and with all of them far.
class DevicePlanFarTest : public testing::TestWithParam<Far> {
 protected:
  void SetUp() override { g_far = GetParam(); }
  void TearDown() override { g_far = Far::kNone; }
};
INSTANTIATE_TEST_SUITE_P(Buffers, DevicePlanFarTest,
                         testing::Values(Far::kNone, Far::kAllButRank0, Far::kAll,
                                         Far::kSendsButRank0, Far::kRecvsButRank0),
                         [](const testing::TestParamInfo<Far>& i) -> std::string {
                           switch (i.param) {
                             case Far::kNone:
                               return "Near";
                             case Far::kAllButRank0:
                               return "FarButRank0";
                             case Far::kAll:
                               return "AllFar";
                             case Far::kSendsButRank0:
                               return "SendsFarButRank0";
                             case Far::kRecvsButRank0:
                               return "RecvsFarButRank0";
                           }
                           return "?";
                         });

TEST_P(DevicePlanFarTest, ReductionsMatchThePlainLoop) {
  for (int world : {1, 2, 3}) {
    for (auto t : kTypes) {
      for (auto op : {wire::ReduceOp::kSum, wire::ReduceOp::kMax}) {
        for (size_t n : kSizes) {
          for (bool in_place : {false, true}) {
            SCOPED_TRACE(testing::Message() << world << " ranks dtype " << static_cast<int>(t)
                                            << " op " << static_cast<int>(op) << " count " << n
                                            << (in_place ? " in place" : ""));
            const size_t es = wire::DataTypeSize(static_cast<uint32_t>(t));
            // allreduce
            Buffers b = Make(world, n * es, n * es, [](int) { return false; });
            for (int r = 0; r < world; ++r) {
              for (size_t i = 0; i < n; ++i)
                Put(t, in_place ? b.recv_ptr[r] : b.send_ptr[r], i, Value(r, i));
            }
            std::vector<uint8_t*> send = in_place ? b.recv_ptr : b.send_ptr;
            const OpSignature ar = Sig(wire::Collective::kAllreduce, t, op, n);
            auto plan = Plan(ar, Ranks(world, n * es, n * es), send, b.recv_ptr);
            ASSERT_TRUE(plan.ok()) << plan.status();
            EXPECT_EQ(plan->size(), n == 0 ? 0u : 1u);
            RunOnHost(*plan, ar);
            for (int r = 0; r < world; ++r) {
              for (size_t i = 0; i < n; ++i) {
                double want = Value(0, i);
                for (int q = 1; q < world; ++q) {
                  want =
                      op == wire::ReduceOp::kSum ? want + Value(q, i) : std::max(want, Value(q, i));
                }
                ASSERT_EQ(Get(t, b.recv_ptr[r], i), want)
                    << "allreduce rank " << r << " [" << i << "]";
              }
              EXPECT_EQ(b.recv[r][n * es], kGuard);
            }
            if (in_place) continue;  // a reduce_scatter is never in place
            // reduce_scatter: rank `owner` gets block `owner` reduced.
            Buffers s = Make(world, n * es * world, n * es, [](int) { return false; });
            for (int r = 0; r < world; ++r) {
              for (size_t i = 0; i < n * world; ++i) Put(t, s.send_ptr[r], i, Value(r, i));
            }
            const OpSignature rs = Sig(wire::Collective::kReduceScatter, t, op, n);
            plan = Plan(rs, Ranks(world, n * es * world, n * es), s.send_ptr, s.recv_ptr);
            ASSERT_TRUE(plan.ok()) << plan.status();
            RunOnHost(*plan, rs);
            for (int owner = 0; owner < world; ++owner) {
              for (size_t i = 0; i < n; ++i) {
                const size_t at = owner * n + i;
                double want = Value(0, at);
                for (int q = 1; q < world; ++q) {
                  want = op == wire::ReduceOp::kSum ? want + Value(q, at)
                                                    : std::max(want, Value(q, at));
                }
                ASSERT_EQ(Get(t, s.recv_ptr[owner], i), want) << "reduce_scatter rank " << owner;
              }
              EXPECT_EQ(s.recv[owner][n * es], kGuard);
            }
          }
        }
      }
    }
  }
}

TEST_P(DevicePlanFarTest, MovesMatchThePlainLoop) {
  for (int world : {1, 2, 3}) {
    for (auto t : kTypes) {
      for (size_t n : kSizes) {
        SCOPED_TRACE(testing::Message()
                     << world << " ranks dtype " << static_cast<int>(t) << " count " << n);
        const size_t es = wire::DataTypeSize(static_cast<uint32_t>(t));
        const size_t block = n * es;
        // allgather, apart and in place (each rank's input its own block).
        for (bool in_place : {false, true}) {
          Buffers b = Make(world, block, block * world, [](int) { return false; });
          std::vector<uint8_t*> send(world);
          for (int r = 0; r < world; ++r) {
            send[r] = in_place ? b.recv_ptr[r] + r * block : b.send_ptr[r];
            for (size_t i = 0; i < n; ++i) Put(t, send[r], i, Value(r, i));
          }
          const OpSignature ag = Sig(wire::Collective::kAllgather, t, wire::ReduceOp::kSum, n);
          auto plan = Plan(ag, Ranks(world, block, block * world), send, b.recv_ptr);
          ASSERT_TRUE(plan.ok()) << plan.status();
          // In place, a rank's own block is not copied.
          EXPECT_EQ(plan->size(),
                    n == 0 ? 0u : static_cast<size_t>(world * (in_place ? world - 1 : world)));
          RunOnHost(*plan, ag);
          for (int r = 0; r < world; ++r) {
            for (int owner = 0; owner < world; ++owner) {
              for (size_t i = 0; i < n; ++i) {
                ASSERT_EQ(Get(t, b.recv_ptr[r], owner * n + i), Value(owner, i))
                    << "allgather rank " << r << " block " << owner
                    << (in_place ? " in place" : "");
              }
            }
            EXPECT_EQ(b.recv[r][block * world], kGuard);
          }
        }
        // broadcast from the last rank: only it has a send buffer (in place:
        // its receive buffer, as validation gives it).
        for (bool in_place : {false, true}) {
          const int root = world - 1;
          Buffers b = Make(world, block, block, [&](int r) { return r != root; });
          std::vector<uint8_t*> send = b.send_ptr;
          if (in_place) send[root] = b.recv_ptr[root];
          uint8_t* from = send[root];
          for (size_t i = 0; i < n; ++i) Put(t, from, i, Value(root, i));
          auto ranks = Ranks(world, 0, block);
          ranks[root].send_bytes = block;
          const OpSignature bc =
              Sig(wire::Collective::kBroadcast, t, wire::ReduceOp::kSum, n, root);
          auto plan = Plan(bc, ranks, send, b.recv_ptr);
          ASSERT_TRUE(plan.ok()) << plan.status();
          RunOnHost(*plan, bc);
          for (int r = 0; r < world; ++r) {
            for (size_t i = 0; i < n; ++i) {
              ASSERT_EQ(Get(t, b.recv_ptr[r], i), Value(root, i)) << "broadcast rank " << r;
            }
            EXPECT_EQ(b.recv[r][block], kGuard);
          }
        }
        // alltoall: rank `to` gets rank `from`'s block `to` as its block `from`.
        {
          Buffers b = Make(world, block * world, block * world, [](int) { return false; });
          for (int r = 0; r < world; ++r) {
            for (size_t i = 0; i < n * world; ++i) Put(t, b.send_ptr[r], i, Value(r, i));
          }
          const OpSignature a2a = Sig(wire::Collective::kAlltoall, t, wire::ReduceOp::kSum, n);
          auto plan = Plan(a2a, Ranks(world, block * world, block * world), b.send_ptr, b.recv_ptr);
          ASSERT_TRUE(plan.ok()) << plan.status();
          RunOnHost(*plan, a2a);
          for (int to = 0; to < world; ++to) {
            for (int from = 0; from < world; ++from) {
              for (size_t i = 0; i < n; ++i) {
                ASSERT_EQ(Get(t, b.recv_ptr[to], from * n + i), Value(from, to * n + i))
                    << "alltoall " << from << " -> " << to;
              }
            }
            EXPECT_EQ(b.recv[to][block * world], kGuard);
          }
        }
      }
    }
  }
}

// Alltoallv: rank i sends rank j counts(i, j) elements, pieces back to back
// in rank order on both sides; uneven, with empty pieces and ranks that send
// or receive nothing at all.
TEST_P(DevicePlanFarTest, AlltoallvMatchesThePlainLoop) {
  using Counts = std::function<uint64_t(int, int)>;
  const std::vector<std::pair<const char*, Counts>> shapes = {
      {"even", [](int, int) { return uint64_t{3}; }},
      {"uneven", [](int i, int j) { return static_cast<uint64_t>(1 + (j - i + 3) % 3) * 7; }},
      {"some empty", [](int i, int j) { return static_cast<uint64_t>((i + j) % 2 == 0 ? 0 : 5); }},
      {"rank 0 sends nothing",
       [](int i, int j) { return static_cast<uint64_t>(i == 0 ? 0 : 2 + j); }},
      {"rank 0 receives nothing",
       [](int i, int j) { return static_cast<uint64_t>(j == 0 ? 0 : 1 + i); }},
      {"nothing", [](int, int) { return uint64_t{0}; }},
  };
  for (int world : {1, 2, 3}) {
    for (auto t : kTypes) {
      for (const auto& [what, counts] : shapes) {
        SCOPED_TRACE(testing::Message()
                     << world << " ranks dtype " << static_cast<int>(t) << " " << what);
        const size_t es = wire::DataTypeSize(static_cast<uint32_t>(t));
        std::vector<DeviceRankBuffers> ranks(world);
        std::vector<std::vector<uint8_t>> send(world), recv(world);
        std::vector<uint8_t*> send_ptr(world, nullptr), recv_ptr(world, nullptr);
        for (int r = 0; r < world; ++r) {
          ranks[r].rank = r;
          for (int q = 0; q < world; ++q) {
            ranks[r].send_counts.push_back(counts(r, q));
            ranks[r].recv_counts.push_back(counts(q, r));
          }
          uint64_t out = 0, in = 0;
          for (int q = 0; q < world; ++q) {
            out += counts(r, q);
            in += counts(q, r);
          }
          ranks[r].send_bytes = out * es;
          ranks[r].recv_bytes = in * es;
          send[r].assign(out * es + 1, kGuard);
          recv[r].assign(in * es + 1, kGuard);
          if (out > 0) send_ptr[r] = send[r].data();
          if (in > 0) recv_ptr[r] = recv[r].data();
          for (size_t i = 0; i < out; ++i) Put(t, send[r].data(), i, Value(r, i));
        }
        const OpSignature v = Sig(wire::Collective::kAlltoallv, t, wire::ReduceOp::kSum, 0);
        auto plan = Plan(v, ranks, send_ptr, recv_ptr);
        ASSERT_TRUE(plan.ok()) << plan.status();
        RunOnHost(*plan, v);
        for (int to = 0; to < world; ++to) {
          size_t at = 0;  // in `to`'s receive buffer
          for (int from = 0; from < world; ++from) {
            size_t sent_before = 0;  // in `from`'s send buffer
            for (int k = 0; k < to; ++k) sent_before += counts(from, k);
            for (size_t i = 0; i < counts(from, to); ++i) {
              ASSERT_EQ(Get(t, recv[to].data(), at + i), Value(from, sent_before + i))
                  << "alltoallv " << from << " -> " << to << " [" << i << "]";
            }
            at += counts(from, to);
          }
          EXPECT_EQ(recv[to][at * es], kGuard) << "written past rank " << to << "'s buffer";
        }
      }
    }
  }
}

// A staged buffer's pieces (PointersFor over PlanStaged): in place, a
// rank's input is its block of its receive buffer (allgather) or the buffer
// itself; placed inputs go where the layout says; a reduce_scatter rank
// without a send buffer is refused naming it. (ClusterJobStagedTest runs
// the whole multi-node path through the same two functions.)
TEST(DevicePlanTest, StagedPointersFollowTheLayout) {
  const size_t n = 10, es = 4, block = n * es;
  std::vector<uint8_t> r1(3 * block), r2(3 * block), s2(block);
  // Node ranks 1 and 2 of 3, given in reverse; rank 1 in place.
  std::vector<DeviceRankBuffers> ranks = {Ranks(3, block, 3 * block)[2],
                                          Ranks(3, block, 3 * block)[1]};
  const OpSignature ag =
      Sig(wire::Collective::kAllgather, wire::DataType::kFloat32, wire::ReduceOp::kSum, n);
  auto layout = PlanStaged(ag, 3, ranks);
  ASSERT_TRUE(layout.ok()) << layout.status();
  EXPECT_EQ(layout->count, 3 * n);
  EXPECT_FALSE(layout->own_node);
  auto p = PointersFor(ag, *layout, {s2.data(), nullptr}, {r2.data(), r1.data()});
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->inputs, (std::vector<const void*>{s2.data(), r1.data() + block}));
  EXPECT_EQ(p->input_offsets, (std::vector<size_t>{2 * block, block}));
  EXPECT_EQ(p->input_bytes, block);
  EXPECT_EQ(p->output_bytes, 3 * block);
  EXPECT_EQ(p->output_offsets, (std::vector<size_t>{0, 0}));
  const OpSignature rs =
      Sig(wire::Collective::kReduceScatter, wire::DataType::kFloat32, wire::ReduceOp::kSum, n);
  layout = PlanStaged(rs, 3, ranks);
  ASSERT_TRUE(layout.ok()) << layout.status();
  EXPECT_TRUE(layout->own_node && layout->reduce);
  p = PointersFor(rs, *layout, {s2.data(), nullptr}, {r2.data(), r1.data()});
  EXPECT_EQ(p.status().code(), absl::StatusCode::kInternal);
  EXPECT_NE(p.status().message().find("no send buffer"), std::string::npos) << p.status();
  p = PointersFor(rs, *layout, {s2.data(), s2.data()}, {r2.data(), r1.data()});
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->output_offsets, (std::vector<size_t>{2 * block, block}));
  EXPECT_TRUE(p->input_offsets.empty()) << "reduced inputs have no places";
}

TEST(DevicePlanTest, WhatCannotBePlannedFailsClearly) {
  const OpSignature bar =
      Sig(wire::Collective::kBarrier, wire::DataType::kFloat32, wire::ReduceOp::kSum, 4);
  std::vector<uint8_t> mem(64);
  std::vector<uint8_t*> one = {mem.data()};
  auto plan = PlanSingleNode(bar, Ranks(1, 16, 16), one, one);
  EXPECT_EQ(plan.status().code(), absl::StatusCode::kInternal);
  const OpSignature ar =
      Sig(wire::Collective::kAllreduce, wire::DataType::kFloat32, wire::ReduceOp::kSum, 4);
  plan = PlanSingleNode(ar, Ranks(2, 16, 16), one, one);
  EXPECT_EQ(plan.status().code(), absl::StatusCode::kInternal) << "lists of other sizes";
  plan = PlanSingleNode(ar, Ranks(1, 16, 16), one, {nullptr});
  EXPECT_NE(plan.status().message().find("no receive buffer"), std::string::npos) << plan.status();
  const OpSignature bc =
      Sig(wire::Collective::kBroadcast, wire::DataType::kFloat32, wire::ReduceOp::kSum, 4, 3);
  plan = PlanSingleNode(bc, Ranks(1, 16, 16), one, one);
  EXPECT_NE(plan.status().message().find("root 3"), std::string::npos) << plan.status();
}

}  // namespace
}  // namespace ciuic::daemon
