// LocalCollective against plain loops, with chunks small enough that every
// size class crosses chunk and cache-block boundaries.
#include "collectives/local.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <functional>
#include <vector>

namespace ciuic::daemon {
namespace {

struct Param {
  int ranks;
  uint64_t count;
  uint64_t chunk_bytes;
};

class LocalCollectiveTest : public ::testing::TestWithParam<Param> {};

int32_t Value(int rank, uint64_t i) { return static_cast<int32_t>((i * 7 + rank * 13) % 101) - 50; }

void RunAll(const LocalCollective& c) {
  for (size_t i = 0; i < c.num_chunks(); ++i) c.RunChunk(i);
}

TEST_P(LocalCollectiveTest, AllreduceSumInt32AndInPlace) {
  const auto [ranks, count, chunk] = GetParam();
  for (bool in_place : {false, true}) {
    std::vector<std::vector<int32_t>> send(ranks), recv(ranks);
    std::vector<const uint8_t*> sp(ranks);
    std::vector<uint8_t*> rp(ranks);
    for (int r = 0; r < ranks; ++r) {
      send[r].resize(count);
      recv[r].assign(count, -7);
      for (uint64_t i = 0; i < count; ++i) send[r][i] = Value(r, i);
      sp[r] = reinterpret_cast<const uint8_t*>(send[r].data());
      rp[r] = in_place ? reinterpret_cast<uint8_t*>(send[r].data())
                       : reinterpret_cast<uint8_t*>(recv[r].data());
    }
    OpSignature sig{static_cast<uint32_t>(wire::Collective::kAllreduce),
                    static_cast<uint32_t>(wire::DataType::kInt32),
                    static_cast<uint32_t>(wire::ReduceOp::kSum), 0, count};
    LocalCollective c(sig, sp, rp, chunk);
    RunAll(c);
    for (int r = 0; r < ranks; ++r) {
      const int32_t* out = reinterpret_cast<const int32_t*>(rp[r]);
      for (uint64_t i = 0; i < count; ++i) {
        int32_t want = 0;
        for (int k = 0; k < ranks; ++k) want += Value(k, i);
        ASSERT_EQ(out[i], want) << "rank " << r << " i " << i << " in_place " << in_place;
      }
    }
  }
}

// A multi-node job's host local phase (ClusterJob::ReduceLocal, FanOut):
// every rank's input reduced into one node buffer, then that buffer
// broadcast to the ranks' outputs (the first rank's output may be the node
// buffer itself), through RunChunks with a runner that counts its calls.
TEST_P(LocalCollectiveTest, ReduceIntoOneBufferThenFanOutThroughRunChunks) {
  const auto [ranks, count, chunk] = GetParam();
  for (bool node_is_first_output : {false, true}) {
    std::vector<std::vector<int32_t>> send(ranks), recv(ranks);
    std::vector<const uint8_t*> sp(ranks);
    for (int r = 0; r < ranks; ++r) {
      send[r].resize(count);
      recv[r].assign(count, -7);
      for (uint64_t i = 0; i < count; ++i) send[r][i] = Value(r, i);
      sp[r] = reinterpret_cast<const uint8_t*>(send[r].data());
    }
    std::vector<int32_t> staging(count, -9);
    uint8_t* node = node_is_first_output ? reinterpret_cast<uint8_t*>(recv[0].data())
                                         : reinterpret_cast<uint8_t*>(staging.data());
    int calls = 0;
    size_t chunks_run = 0;
    ParallelChunks parallel = [&](size_t n, const std::function<void(size_t)>& body) {
      ++calls;
      for (size_t i = n; i-- > 0;) body(i);  // any order
      chunks_run += n;
    };
    OpSignature sum{static_cast<uint32_t>(wire::Collective::kAllreduce),
                    static_cast<uint32_t>(wire::DataType::kInt32),
                    static_cast<uint32_t>(wire::ReduceOp::kSum), 0, count};
    LocalCollective reduce(sum, sp, {node}, chunk);
    RunChunks(reduce, parallel);
    std::vector<uint8_t*> outputs;
    for (int r = 0; r < ranks; ++r) {
      uint8_t* out = reinterpret_cast<uint8_t*>(recv[r].data());
      if (out != node) outputs.push_back(out);
    }
    OpSignature copy{static_cast<uint32_t>(wire::Collective::kBroadcast),
                     static_cast<uint32_t>(wire::DataType::kUInt8), 0, 0, count * 4};
    LocalCollective fan_out(copy, {node}, outputs, chunk);
    RunChunks(fan_out, parallel);
    // Through the runner from two chunks up, on the caller below.
    const int want_calls = (reduce.num_chunks() >= 2) + (fan_out.num_chunks() >= 2);
    EXPECT_EQ(calls, want_calls);
    EXPECT_EQ(chunks_run, (reduce.num_chunks() >= 2 ? reduce.num_chunks() : 0) +
                              (fan_out.num_chunks() >= 2 ? fan_out.num_chunks() : 0));
    for (int r = 0; r < ranks; ++r) {
      for (uint64_t i = 0; i < count; ++i) {
        int32_t want = 0;
        for (int k = 0; k < ranks; ++k) want += Value(k, i);
        ASSERT_EQ(recv[r][i], want) << "rank " << r << " i " << i << " node buffer is rank 0's "
                                    << node_is_first_output;
      }
    }
    // Inputs untouched.
    for (int r = 0; r < ranks; ++r) {
      for (uint64_t i = 0; i < count; ++i) ASSERT_EQ(send[r][i], Value(r, i));
    }
  }
}

TEST_P(LocalCollectiveTest, ReduceScatterMaxFloat) {
  const auto [ranks, count, chunk] = GetParam();
  std::vector<std::vector<float>> send(ranks), recv(ranks);
  std::vector<const uint8_t*> sp(ranks);
  std::vector<uint8_t*> rp(ranks);
  for (int r = 0; r < ranks; ++r) {
    send[r].resize(count * ranks);
    recv[r].assign(count, -1);
    for (uint64_t i = 0; i < count * ranks; ++i) send[r][i] = static_cast<float>(Value(r, i));
    sp[r] = reinterpret_cast<const uint8_t*>(send[r].data());
    rp[r] = reinterpret_cast<uint8_t*>(recv[r].data());
  }
  OpSignature sig{static_cast<uint32_t>(wire::Collective::kReduceScatter),
                  static_cast<uint32_t>(wire::DataType::kFloat32),
                  static_cast<uint32_t>(wire::ReduceOp::kMax), 0, count};
  LocalCollective c(sig, sp, rp, chunk);
  EXPECT_EQ(c.payload_bytes(), count * 4 * ranks);
  RunAll(c);
  for (int r = 0; r < ranks; ++r) {
    for (uint64_t i = 0; i < count; ++i) {
      float want = static_cast<float>(Value(0, r * count + i));
      for (int k = 1; k < ranks; ++k) want = std::max(want, static_cast<float>(Value(k, r * count + i)));
      ASSERT_EQ(recv[r][i], want) << "rank " << r << " i " << i;
    }
  }
}

TEST_P(LocalCollectiveTest, AllgatherAndBroadcastCopyExactly) {
  const auto [ranks, count, chunk] = GetParam();
  std::vector<std::vector<int32_t>> send(ranks), recv(ranks);
  std::vector<const uint8_t*> sp(ranks);
  std::vector<uint8_t*> rp(ranks);
  for (int r = 0; r < ranks; ++r) {
    send[r].resize(count);
    recv[r].assign(count * ranks, 0);
    for (uint64_t i = 0; i < count; ++i) send[r][i] = Value(r, i);
    sp[r] = reinterpret_cast<const uint8_t*>(send[r].data());
    rp[r] = reinterpret_cast<uint8_t*>(recv[r].data());
  }
  OpSignature ag{static_cast<uint32_t>(wire::Collective::kAllgather),
                 static_cast<uint32_t>(wire::DataType::kInt32), 0, 0, count};
  RunAll(LocalCollective(ag, sp, rp, chunk));
  for (int r = 0; r < ranks; ++r) {
    for (int k = 0; k < ranks; ++k) {
      for (uint64_t i = 0; i < count; ++i) ASSERT_EQ(recv[r][k * count + i], Value(k, i));
    }
  }
  const int root = ranks - 1;
  OpSignature bc{static_cast<uint32_t>(wire::Collective::kBroadcast),
                 static_cast<uint32_t>(wire::DataType::kInt32), 0, root, count};
  for (int r = 0; r < ranks; ++r) std::fill(recv[r].begin(), recv[r].end(), 0);
  RunAll(LocalCollective(bc, sp, rp, chunk));
  for (int r = 0; r < ranks; ++r) {
    for (uint64_t i = 0; i < count; ++i) ASSERT_EQ(recv[r][i], Value(root, i));
  }
}

TEST_P(LocalCollectiveTest, AlltoallEveryDtypeMatchesPlainLoop) {
  const auto [ranks, count, chunk] = GetParam();
  for (wire::DataType dtype : wire::kAllDataTypes) {
    const uint64_t es = wire::DataTypeSize(static_cast<uint32_t>(dtype));
    const uint64_t block = count * es;
    const uint64_t all = block * static_cast<uint64_t>(ranks);
    std::vector<std::vector<uint8_t>> send(ranks), recv(ranks);
    std::vector<const uint8_t*> sp(ranks);
    std::vector<uint8_t*> rp(ranks);
    for (int r = 0; r < ranks; ++r) {
      send[r].resize(all);
      recv[r].assign(all, 0xEE);
      for (uint64_t i = 0; i < all; ++i) send[r][i] = static_cast<uint8_t>(Value(r, i) + 50);
      sp[r] = send[r].data();
      rp[r] = recv[r].data();
    }
    OpSignature sig{static_cast<uint32_t>(wire::Collective::kAlltoall),
                    static_cast<uint32_t>(dtype), 0, 0, count};
    LocalCollective c(sig, sp, rp, chunk);
    EXPECT_EQ(c.payload_bytes(), all);
    RunAll(c);
    for (int to = 0; to < ranks; ++to) {
      for (int from = 0; from < ranks; ++from) {
        for (uint64_t i = 0; i < block; ++i) {
          ASSERT_EQ(recv[to][from * block + i], send[from][to * block + i])
              << wire::DataTypeName(static_cast<uint32_t>(dtype)) << " rank " << to << " from "
              << from << " byte " << i;
        }
      }
    }
  }
}

TEST_P(LocalCollectiveTest, AlltoallvUnevenBlocksMatchPlainLoop) {
  const auto [ranks, count, chunk] = GetParam();
  const size_t w = static_cast<size_t>(ranks);
  for (wire::DataType dtype : {wire::DataType::kFloat64, wire::DataType::kBFloat16,
                               wire::DataType::kUInt8}) {
    const uint64_t es = wire::DataTypeSize(static_cast<uint32_t>(dtype));
    // Pair (i, j) sends a size derived from count: some empty, some large.
    std::vector<std::vector<uint64_t>> counts(w, std::vector<uint64_t>(w));
    for (size_t i = 0; i < w; ++i) {
      for (size_t j = 0; j < w; ++j) counts[i][j] = (i + 2 * j) % 3 == 0 ? 0 : count / (1 + i + j);
    }
    std::vector<std::vector<uint8_t>> send(w), recv(w);
    std::vector<const uint8_t*> sp(w);
    std::vector<uint8_t*> rp(w);
    for (size_t r = 0; r < w; ++r) {
      uint64_t out = 0, in = 0;
      for (size_t j = 0; j < w; ++j) {
        out += counts[r][j] * es;
        in += counts[j][r] * es;
      }
      send[r].resize(out);
      for (uint64_t i = 0; i < out; ++i) send[r][i] = static_cast<uint8_t>(r * 31 + i * 7);
      recv[r].assign(in + 1, 0xEE);
      sp[r] = send[r].data();
      rp[r] = recv[r].data();
    }
    OpSignature sig{static_cast<uint32_t>(wire::Collective::kAlltoallv),
                    static_cast<uint32_t>(dtype), 0, 0, 0};
    LocalCollective c(sig, sp, rp, chunk, counts);
    RunAll(c);
    for (size_t to = 0; to < w; ++to) {
      uint64_t at = 0;
      for (size_t from = 0; from < w; ++from) {
        uint64_t src = 0;
        for (size_t k = 0; k < to; ++k) src += counts[from][k] * es;
        for (uint64_t i = 0; i < counts[from][to] * es; ++i) {
          ASSERT_EQ(recv[to][at + i], send[from][src + i])
              << "rank " << to << " from " << from << " byte " << i;
        }
        at += counts[from][to] * es;
      }
      EXPECT_EQ(recv[to][at], 0xEE) << "rank " << to << " written past its end";
    }
  }
}

TEST(AlltoallvMismatchTest, NamesTheFirstPairThatDisagrees) {
  const std::vector<uint64_t> s0{1, 2, 3}, s1{4, 5, 6}, s2{7, 8, 9};
  const std::vector<uint64_t> r0{1, 4, 7}, r1{2, 5, 8}, r2{3, 6, 9};
  std::vector<const std::vector<uint64_t>*> send{&s0, &s1, &s2}, recv{&r0, &r1, &r2};
  EXPECT_TRUE(AlltoallvMismatch({0, 1, 2}, send, recv).ok());
  const std::vector<uint64_t> r2_bad{3, 60, 9};
  recv[2] = &r2_bad;
  absl::Status s = AlltoallvMismatch({0, 1, 2}, send, recv);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(s.message(),
            "alltoallv counts disagree: rank 1 sends 6 element(s) to rank 2, which expects 60 "
            "from it");
  // Only the ranks given are compared (a node's own).
  EXPECT_TRUE(AlltoallvMismatch({0, 1}, send, recv).ok());
}

INSTANTIATE_TEST_SUITE_P(
    SizesRanksChunks, LocalCollectiveTest,
    ::testing::Values(Param{1, 5, 64}, Param{2, 0, 64}, Param{2, 1, 64}, Param{2, 1001, 64},
                      Param{3, 1001, 4096}, Param{4, 50000, 4096 * 3},
                      Param{4, 100003, 1 << 20}, Param{5, 17, 8}));

}  // namespace
}  // namespace ciuic::daemon
