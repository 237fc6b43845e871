#include "collectives/op.h"

#include <gtest/gtest.h>

#include <cstring>
#include <limits>

#include "cuda/gpu_info.h"
#include "shm/session_memory.h"

namespace ciuic::daemon {
namespace {

class ValidateTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto m = SessionMemory::Create(1 << 16);
    ASSERT_TRUE(m.ok());
    mem_ = std::move(*m);
  }
  wire::SubmissionEntry Entry(wire::Collective c, uint64_t count) {
    wire::SubmissionEntry e{};
    e.op_id = 1;
    e.collective = static_cast<uint32_t>(c);
    e.dtype = static_cast<uint32_t>(wire::DataType::kFloat32);
    e.reduce_op = static_cast<uint32_t>(wire::ReduceOp::kSum);
    e.count = count;
    e.send_offset = wire::kDataOffset;
    e.recv_offset = wire::kDataOffset + 4096 * 4;
    std::memcpy(e.name, "grad", 4);
    e.name_len = 4;
    return e;
  }
  absl::Status Check(const wire::SubmissionEntry& e, int world = 2, int rank = 0) {
    return ValidateSubmission(e, *mem_, world, rank).status();
  }
  std::unique_ptr<SessionMemory> mem_;
};

TEST_F(ValidateTest, AcceptsEveryCollectiveWithGoodBuffers) {
  for (auto c : {wire::Collective::kAllreduce, wire::Collective::kReduceScatter,
                 wire::Collective::kAllgather, wire::Collective::kBroadcast}) {
    EXPECT_TRUE(Check(Entry(c, 100)).ok()) << wire::CollectiveName(static_cast<uint32_t>(c));
    EXPECT_TRUE(Check(Entry(c, 0)).ok());
  }
  EXPECT_TRUE(Check(Entry(wire::Collective::kBarrier, 0)).ok());
}

TEST_F(ValidateTest, ResolvesBuffersAndSizes) {
  auto e = Entry(wire::Collective::kReduceScatter, 10);
  auto v = ValidateSubmission(e, *mem_, 4, 1);
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_EQ(v->name, "grad");
  EXPECT_EQ(v->send_bytes, 10u * 4 * 4);
  EXPECT_EQ(v->recv_bytes, 10u * 4);
  EXPECT_EQ(v->sig.ToString(), "reduce_scatter float32 count=10 op=sum");
}

TEST_F(ValidateTest, RejectsGarbageNamingTheField) {
  auto expect_error = [&](wire::SubmissionEntry e, const char* words, int world = 2,
                          int rank = 0) {
    absl::Status s = Check(e, world, rank);
    EXPECT_FALSE(s.ok()) << words;
    EXPECT_NE(s.message().find(words), absl::string_view::npos) << s.message();
  };
  auto e = Entry(wire::Collective::kAllreduce, 10);
  e.collective = 77;
  expect_error(e, "unknown collective 77");
  e = Entry(wire::Collective::kAllreduce, 10);
  e.dtype = 0;
  expect_error(e, "unknown dtype 0");
  e = Entry(wire::Collective::kAllreduce, 10);
  e.reduce_op = 9;
  expect_error(e, "9");
  e = Entry(wire::Collective::kAllreduce, 10);
  e.flags = 4;
  expect_error(e, "reserved flags");
  // Device buffers: FAILED_PRECONDITION saying why this daemon cannot take them.
  e = Entry(wire::Collective::kAllreduce, 10);
  e.flags = wire::kSubmitFlagDeviceBuffers;
  {
    const absl::Status s = Check(e, 2, 0);
    EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
    EXPECT_NE(s.message().find("device (CUDA) buffers: "), absl::string_view::npos) << s;
    const GpuProbe& gpus = ProbeGpus();
    const char* why = !gpus.built_with_cuda      ? "built without CUDA"
                      : gpus.devices.empty()     ? "no CUDA device: "
                                                 : "not implemented yet";
    EXPECT_NE(s.message().find(why), absl::string_view::npos) << s;
  }
  e = Entry(wire::Collective::kAllreduce, 10);
  e.name_len = 0;
  expect_error(e, "name length 0");
  e.name_len = 100000;
  expect_error(e, "name length 100000");
  e = Entry(wire::Collective::kAllreduce, 10);
  e.send_offset = 0;  // the header
  expect_error(e, "send buffer");
  e = Entry(wire::Collective::kAllreduce, 10);
  e.recv_offset = mem_->size() - 8;
  expect_error(e, "recv buffer");
  e = Entry(wire::Collective::kAllreduce, std::numeric_limits<uint64_t>::max() / 2);
  expect_error(e, "too large");
  e = Entry(wire::Collective::kAllreduce, 1ull << 40);  // fits in 64 bits, not in the arena
  expect_error(e, "outside the session's arena");
  e = Entry(wire::Collective::kBroadcast, 10);
  e.root = 2;
  expect_error(e, "root 2");
  e.root = -1;
  expect_error(e, "root -1");
  e = Entry(wire::Collective::kBarrier, 3);
  expect_error(e, "barrier with count 3");
  e = Entry(wire::Collective::kAllreduce, 10);
  e.recv_offset = e.send_offset + 4;  // partial overlap
  expect_error(e, "overlap");
}

TEST_F(ValidateTest, InPlaceLayoutsAreAllowed) {
  auto e = Entry(wire::Collective::kAllreduce, 10);
  e.recv_offset = e.send_offset;
  EXPECT_TRUE(Check(e).ok());
  // reduce_scatter: recv is this rank's block of send.
  e = Entry(wire::Collective::kReduceScatter, 10);
  e.recv_offset = e.send_offset + 1 * 10 * 4;
  EXPECT_TRUE(Check(e, 4, 1).ok());
  EXPECT_FALSE(Check(e, 4, 2).ok());
  // allgather: send is this rank's block of recv.
  e = Entry(wire::Collective::kAllgather, 10);
  e.send_offset = e.recv_offset + 3 * 10 * 4;
  EXPECT_TRUE(Check(e, 4, 3).ok());
  EXPECT_FALSE(Check(e, 4, 0).ok());
}

TEST_F(ValidateTest, NonRootBroadcastNeedsNoSendBuffer) {
  auto e = Entry(wire::Collective::kBroadcast, 10);
  e.root = 0;
  e.send_offset = 12345678901ull;  // garbage, but rank 1 does not send
  auto v = ValidateSubmission(e, *mem_, 2, 1);
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_EQ(v->send, nullptr);
  EXPECT_FALSE(Check(e, 2, 0).ok());
}

}  // namespace
}  // namespace ciuic::daemon
