#include "collectives/op.h"

#include <gtest/gtest.h>

#include <cstring>
#include <limits>

#include "ciuic/collective_rules.h"
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
                 wire::Collective::kAllgather, wire::Collective::kBroadcast,
                 wire::Collective::kAlltoall}) {
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
  e = Entry(wire::Collective::kAllreduce, 10);
  e.name_len = 0;
  expect_error(e, "name length 0");
  e.name_len = 100000;
  expect_error(e, "name length 100000");
  // Names travel in protobuf strings: only UTF-8.
  for (const char* bad : {"\xff", "a\xc3", "\xc0\xaf", "\xed\xa0\x80", "\xf4\x90\x80\x80"}) {
    e.name_len = static_cast<uint32_t>(std::strlen(bad));
    std::memcpy(e.name, bad, e.name_len);
    expect_error(e, "not valid UTF-8");
  }
  e.name_len = 7;
  std::memcpy(e.name, "gr\xc3\xa4" "d\xe2\x82", 7);  // "gräd" and a cut 3-byte sequence
  expect_error(e, "not valid UTF-8");
  e.name_len = 5;  // "gräd" alone
  EXPECT_TRUE(Check(e, 2, 0).ok()) << Check(e, 2, 0);
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

// Device buffers: descriptor records in the arena, copied out and checked;
// a daemon without a GPU says why it cannot take them.
TEST_F(ValidateTest, DeviceDescriptorsAreCheckedAndNeedAGpu) {
  wire::DeviceBufferDescriptor d{};
  std::memset(d.memory_handle, 0xab, sizeof(d.memory_handle));
  d.allocation_bytes = 1 << 20;
  d.offset = 256;
  d.device = 0;
  auto e = Entry(wire::Collective::kAllreduce, 10);
  e.flags = wire::kSubmitFlagDeviceBuffers;
  e.send_offset = wire::kDataOffset;
  e.recv_offset = wire::kDataOffset + 256;
  auto put = [&](uint64_t offset, const wire::DeviceBufferDescriptor& x) {
    auto p = mem_->DataRange(offset, sizeof(x));
    ASSERT_TRUE(p.ok());
    std::memcpy(*p, &x, sizeof(x));
  };
  put(e.send_offset, d);
  wire::DeviceBufferDescriptor r = d;
  r.offset = 4096;
  put(e.recv_offset, r);

  const GpuProbe& gpus = ProbeGpus();
  const absl::Status s = Check(e);
  if (!gpus.built_with_cuda || gpus.devices.empty()) {
    EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
    EXPECT_NE(s.message().find("operation 'grad': device (CUDA) buffers: "),
              absl::string_view::npos) << s;
    EXPECT_NE(s.message().find(!gpus.built_with_cuda ? "built without CUDA" : "no CUDA device: "),
              absl::string_view::npos) << s;
  } else {
    ASSERT_TRUE(s.ok()) << s;
    auto v = ValidateSubmission(e, *mem_, 2, 0);
    EXPECT_TRUE(v->sig.device);
    EXPECT_EQ(v->send, nullptr);
    EXPECT_EQ(v->send_device.offset, 256u);
    EXPECT_EQ(v->recv_device.offset, 4096u);
    EXPECT_EQ(v->sig.ToString(), "allreduce float32 count=10 op=sum in CUDA device memory");
  }

  // Checks that need no GPU come first, on every daemon.
  auto expect_invalid = [&](wire::SubmissionEntry x, const char* words) {
    const absl::Status st = Check(x);
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
    EXPECT_NE(st.message().find(words), absl::string_view::npos) << st;
  };
  auto x = e;
  x.send_offset += 4;
  expect_invalid(x, "send device descriptor at offset");
  x = e;
  x.recv_offset = 64;  // the header
  expect_invalid(x, "recv device descriptor: ");
  x = e;
  x.recv_offset = mem_->size() - 8;
  expect_invalid(x, "outside the session's arena");
  x = e;
  x.flags = wire::kSubmitFlagDeviceBuffers | 2;
  expect_invalid(x, "reserved flags 0x3");
  x = Entry(wire::Collective::kBarrier, 0);
  x.flags = wire::kSubmitFlagDeviceBuffers;
  expect_invalid(x, "device-buffer flag does not apply");
}

TEST(ValidateDeviceBufferTest, NamesEveryProblem) {
  wire::DeviceBufferDescriptor d{};
  d.allocation_bytes = 1000;
  d.offset = 200;
  d.device = 1;
  EXPECT_TRUE(ValidateDeviceBuffer(d, 800, 2, "send").ok());
  EXPECT_TRUE(ValidateDeviceBuffer(d, 0, 2, "send").ok());
  auto expect = [](const wire::DeviceBufferDescriptor& x, uint64_t bytes, int devices,
                   const char* words) {
    const absl::Status s = ValidateDeviceBuffer(x, bytes, devices, "recv");
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << words;
    EXPECT_NE(s.message().find(words), absl::string_view::npos) << s;
    EXPECT_NE(s.message().find("recv device buffer: "), absl::string_view::npos) << s;
  };
  expect(d, 801, 2, "801 bytes at offset 200 do not fit in the allocation of 1000 bytes");
  auto x = d;
  x.offset = ~0ull - 10;  // offset + bytes would wrap around
  expect(x, 100, 2, "do not fit");
  x = d;
  x.offset = 1001;
  expect(x, 0, 2, "do not fit");
  x = d;
  x.allocation_bytes = 0;
  expect(x, 0, 2, "allocation of 0 bytes");
  expect(d, 8, 1, "device 1 is not one of this ciuicd's 1 CUDA device(s)");
  x = d;
  x.device = -1;
  expect(x, 8, 2, "device -1");
  x = d;
  x.flags = 6;
  expect(x, 8, 2, "reserved descriptor flags 0x6");
  x.flags = wire::kDeviceDescriptorEventValid;
  EXPECT_TRUE(ValidateDeviceBuffer(x, 8, 2, "send").ok());
}

TEST_F(ValidateTest, DeviceInPlaceMeansSameAllocationAndOffset) {
  // Aliasing rules apply inside one allocation (same IPC handle); buffers in
  // different allocations never overlap. Needs a device to get that far.
  const GpuProbe& gpus = ProbeGpus();
  if (!gpus.built_with_cuda || gpus.devices.empty()) {
    GTEST_SKIP() << "no CUDA device: the aliasing checks come after the device check";
  }
  wire::DeviceBufferDescriptor d{};
  d.allocation_bytes = 1 << 20;
  auto e = Entry(wire::Collective::kAllreduce, 10);
  e.flags = wire::kSubmitFlagDeviceBuffers;
  e.send_offset = wire::kDataOffset;
  e.recv_offset = wire::kDataOffset + 256;
  auto put = [&](uint64_t offset, uint64_t at, uint8_t handle) {
    wire::DeviceBufferDescriptor x = d;
    x.offset = at;
    std::memset(x.memory_handle, handle, sizeof(x.memory_handle));
    std::memcpy(*mem_->DataRange(offset, sizeof(x)), &x, sizeof(x));
  };
  put(e.send_offset, 0, 1);
  put(e.recv_offset, 0, 1);
  EXPECT_TRUE(Check(e).ok());  // in place
  put(e.recv_offset, 4, 1);
  EXPECT_NE(Check(e).message().find("overlap"), absl::string_view::npos);
  put(e.recv_offset, 4, 2);  // another allocation
  EXPECT_TRUE(Check(e).ok());
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

TEST_F(ValidateTest, AlltoallTakesWholeBuffersNeverInPlace) {
  auto e = Entry(wire::Collective::kAlltoall, 10);
  e.reduce_op = 0;
  auto v = ValidateSubmission(e, *mem_, 3, 1);
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_EQ(v->send_bytes, 10u * 4 * 3);
  EXPECT_EQ(v->recv_bytes, 10u * 4 * 3);
  EXPECT_EQ(v->sig.reduce_op, 0u);
  EXPECT_EQ(v->sig.ToString(), "alltoall float32 count=10");
  // Same buffer, or any overlap: refused.
  for (uint64_t shift : {uint64_t{0}, uint64_t{40}, uint64_t{119}}) {
    e.recv_offset = e.send_offset + shift;
    absl::Status s = Check(e, 3, 1);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << shift;
    EXPECT_NE(s.message().find("overlap"), std::string::npos) << s;
  }
  e.recv_offset = e.send_offset + 120;  // just apart
  EXPECT_TRUE(Check(e, 3, 1).ok());
  // Past the arena: named.
  e.recv_offset = wire::kDataOffset + (1 << 16) - 100;
  EXPECT_NE(Check(e, 3, 1).message().find("recv"), std::string::npos);
}

TEST_F(ValidateTest, AlltoallvReadsItsCountsAndChecksThem) {
  // Counts at 8 KiB into the arena: send {3, 0, 5}, recv {1, 2, 4}.
  const uint64_t at = wire::kDataOffset + 8192;
  auto put = [&](std::vector<uint64_t> counts) {
    std::memcpy(*mem_->DataRange(at, counts.size() * 8), counts.data(), counts.size() * 8);
  };
  put({3, 0, 5, 1, 2, 4});
  auto e = Entry(wire::Collective::kAlltoallv, 0);
  e.reduce_op = 0;
  e.splits_offset = at;
  auto v = ValidateSubmission(e, *mem_, 3, 1);
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_EQ(v->send_counts, (std::vector<uint64_t>{3, 0, 5}));
  EXPECT_EQ(v->recv_counts, (std::vector<uint64_t>{1, 2, 4}));
  EXPECT_EQ(v->send_bytes, 8u * 4);
  EXPECT_EQ(v->recv_bytes, 7u * 4);
  EXPECT_EQ(v->sig.ToString(), "alltoallv float32 count=0");
  auto expect_error = [&](wire::SubmissionEntry bad, const char* words,
                          absl::StatusCode code = absl::StatusCode::kInvalidArgument) {
    absl::Status s = Check(bad, 3, 1);
    EXPECT_EQ(s.code(), code) << words << ": " << s;
    EXPECT_NE(s.message().find(words), absl::string_view::npos) << s.message();
  };
  auto bad = e;
  bad.count = 4;
  expect_error(bad, "alltoallv with count 4 (must be 0)");
  bad = e;
  bad.splits_offset = at + 4;
  expect_error(bad, "not 8-byte aligned");
  bad = e;
  bad.splits_offset = wire::kDataOffset + (1 << 16) - 16;  // 48 bytes do not fit
  expect_error(bad, "alltoallv counts");
  bad = e;
  bad.splits_offset = 8;  // the header
  expect_error(bad, "alltoallv counts");
  put({3, std::numeric_limits<uint64_t>::max() / 8, 5, 1, 2, 4});
  expect_error(e, "send counts add up to too many elements");
  put({3, 0, 5, 1, 2, uint64_t{1} << 61});
  expect_error(e, "recv counts add up to too many elements");
  put({3, 0, 5, 1, 2, 1 << 20});  // adds up, but not in the arena
  expect_error(e, "recv");
  put({3, 0, 5, 1, 2, 4});
  bad = e;
  bad.recv_offset = bad.send_offset + 31;  // 32 bytes sent: overlaps by one
  expect_error(bad, "overlap");
  bad.recv_offset = bad.send_offset + 32;
  EXPECT_TRUE(Check(bad, 3, 1).ok());
  // On device buffers (the last case: descriptors replace the data): the
  // counts still come from the arena, and the allocations must hold their
  // sums (32 bytes sent).
  bad = e;
  bad.flags = wire::kSubmitFlagDeviceBuffers;
  wire::DeviceBufferDescriptor d{};
  d.allocation_bytes = 24;
  std::memcpy(*mem_->DataRange(bad.send_offset, sizeof(d)), &d, sizeof(d));
  d.allocation_bytes = 28;
  std::memcpy(*mem_->DataRange(bad.recv_offset, sizeof(d)), &d, sizeof(d));
  const GpuProbe& gpus = ProbeGpus();
  if (!gpus.built_with_cuda || gpus.devices.empty()) {
    expect_error(bad, "device (CUDA) buffers: ", absl::StatusCode::kFailedPrecondition);
  } else {
    expect_error(bad, "send device buffer: 32 bytes at offset 0 do not fit in the allocation of 24");
  }
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

// The SDK's numbering of unnamed operations and the daemon's reading of it
// (collective_rules.h): what is unnamed, and which names carry a number.
TEST(UnnamedNamesTest, NumberedAsTheSdkNamesThemAndNothingElse) {
  uint64_t n = 7;
  for (uint64_t v : {uint64_t{0}, uint64_t{1}, uint64_t{4097}, uint64_t{9999999999999999999u}}) {
    const std::string name = wire::UnnamedName(v);
    EXPECT_TRUE(wire::IsUnnamed(name)) << name;
    ASSERT_TRUE(wire::UnnamedNumber(name, &n)) << name;
    EXPECT_EQ(n, v);
  }
  for (const char* bad : {"", "#", "#x", "#12a", "#-1", "# 1", "12", "grad#1",
                          "#00000000000000000000"}) {
    n = 7;
    EXPECT_FALSE(wire::UnnamedNumber(bad, &n)) << bad;
    EXPECT_EQ(n, 7u) << bad;
  }
  EXPECT_TRUE(wire::IsUnnamed("#"));
  EXPECT_TRUE(wire::IsUnnamed("#x"));
  EXPECT_FALSE(wire::IsUnnamed(""));
  EXPECT_FALSE(wire::IsUnnamed("grad"));
  EXPECT_FALSE(wire::IsUnnamed("grad#1"));
}

}  // namespace
}  // namespace ciuic::daemon
