// CPU-side logic of the CUDA kernels, tested on every machine (no GPU
// needed): launch geometry, argument checks (which happen before any CUDA
// call), the CUDA error mapping, and the error a kernel gives without a
// device.
#include "cuda/launch.h"

#include <cuda_runtime_api.h>

#include <cstdint>
#include <string>

#include "cuda/kernels.h"
#include "gtest/gtest.h"

namespace ciuic::daemon::gpu {
namespace {

using wire::DataType;
using wire::ReduceOp;

TEST(GridForTest, NothingToDo) {
  const LaunchShape s = GridFor(0);
  EXPECT_EQ(s.blocks, 0u);
  EXPECT_EQ(s.threads, 0u);
}

TEST(GridForTest, RoundsUpAndCaps) {
  EXPECT_EQ(GridFor(1).blocks, 1u);
  EXPECT_EQ(GridFor(1).threads, kThreadsPerBlock);
  EXPECT_EQ(GridFor(kThreadsPerBlock).blocks, 1u);
  EXPECT_EQ(GridFor(kThreadsPerBlock + 1).blocks, 2u);
  EXPECT_EQ(GridFor(size_t{kThreadsPerBlock} * kMaxBlocks).blocks, kMaxBlocks);
  EXPECT_EQ(GridFor(size_t{1} << 40).blocks, kMaxBlocks);  // the kernels loop
  EXPECT_EQ(GridFor(1000, 128, 4).blocks, 4u);
  EXPECT_EQ(GridFor(1000, 128, 4).threads, 128u);
}

TEST(ItemsForTest, CeilingDivision) {
  EXPECT_EQ(ItemsFor(0, 4), 0u);
  EXPECT_EQ(ItemsFor(1, 4), 1u);
  EXPECT_EQ(ItemsFor(4, 4), 1u);
  EXPECT_EQ(ItemsFor(5, 4), 2u);
  EXPECT_EQ(ItemsFor(1001, 16), 63u);
}

TEST(CudaStatusTest, MapsCodes) {
  EXPECT_TRUE(CudaStatus(cudaSuccess, "x").ok());
  const absl::Status none = CudaStatus(cudaErrorNoDevice, "probe");
  EXPECT_EQ(none.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(std::string(none.message()).find("no CUDA device: "), std::string::npos) << none;
  EXPECT_EQ(CudaStatus(cudaErrorInsufficientDriver, "probe").code(),
            absl::StatusCode::kFailedPrecondition);
  // A device that cannot do this is not a missing device.
  const absl::Status unsupported = CudaStatus(cudaErrorNotSupported, "cudaIpcGetMemHandle");
  EXPECT_EQ(unsupported.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(std::string(unsupported.message()).find("no CUDA device"), std::string::npos)
      << unsupported;
  const std::string says = "cudaIpcGetMemHandle: CUDA error cudaErrorNotSupported";
  EXPECT_NE(std::string(unsupported.message()).find(says), std::string::npos) << unsupported;
  EXPECT_EQ(std::string(CudaStatus(cudaErrorInvalidDevice, "cudaSetDevice(7)").message())
                .find("no CUDA device"),
            std::string::npos);
  const absl::Status other = CudaStatus(cudaErrorMemoryAllocation, "my launch");
  EXPECT_EQ(other.code(), absl::StatusCode::kInternal);
  EXPECT_NE(std::string(other.message()).find("my launch"), std::string::npos) << other;
  EXPECT_NE(std::string(other.message()).find("cudaErrorMemoryAllocation"), std::string::npos)
      << other;
  // A device fault breaks the context: said first, whatever call saw it.
  for (cudaError_t fault : {cudaErrorIllegalAddress, cudaErrorLaunchFailure, cudaErrorAssert}) {
    const std::string m(CudaStatus(fault, "cudaEventQuery").message());
    EXPECT_EQ(m.find("ciuicd's CUDA context is broken by a device fault; device operations "
                     "fail until ciuicd restarts ("),
              0u)
        << m;
    EXPECT_NE(m.find(cudaGetErrorName(fault)), std::string::npos) << m;
    EXPECT_NE(m.find("seen in cudaEventQuery"), std::string::npos) << m;
  }
}

// Aligned addresses that are never dereferenced: every case below fails its
// argument check before any CUDA call.
void* Fake(uintptr_t a) { return reinterpret_cast<void*>(a); }

TEST(ArgumentTest, ReduceRejectsBadArguments) {
  const void* in[kMaxReduceInputs + 1] = {};
  for (auto& p : in) p = Fake(0x10000);
  auto expect_invalid = [](absl::Status s, const char* what) {
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_NE(std::string(s.message()).find(what), std::string::npos) << s;
  };
  expect_invalid(DeviceReduce(static_cast<DataType>(99), ReduceOp::kSum, in, 2, Fake(0x20000), 8,
                              nullptr),
                 "unknown data type 99");
  expect_invalid(DeviceReduce(DataType::kFloat32, static_cast<ReduceOp>(0), in, 2, Fake(0x20000),
                              8, nullptr),
                 "unknown reduce op 0");
  expect_invalid(DeviceReduce(DataType::kFloat32, ReduceOp::kSum, in, 0, Fake(0x20000), 8, nullptr),
                 "0 inputs");
  expect_invalid(DeviceReduce(DataType::kFloat32, ReduceOp::kSum, in, kMaxReduceInputs + 1,
                              Fake(0x20000), 8, nullptr),
                 "65 inputs");
  expect_invalid(DeviceReduce(DataType::kFloat32, ReduceOp::kSum, in, 2, nullptr, 8, nullptr),
                 "null");
  const void* with_null[] = {Fake(0x10000), nullptr};
  expect_invalid(DeviceReduce(DataType::kFloat32, ReduceOp::kSum, with_null, 2, Fake(0x20000), 8,
                              nullptr),
                 "input 1 is null");
  const void* misaligned[] = {Fake(0x10000), Fake(0x10002)};
  expect_invalid(DeviceReduce(DataType::kFloat32, ReduceOp::kSum, misaligned, 2, Fake(0x20000), 8,
                              nullptr),
                 "input 1 is not aligned");
  expect_invalid(DeviceReduce(DataType::kInt64, ReduceOp::kSum, in, 2, Fake(0x20004), 8, nullptr),
                 "output is not aligned");
  // Nothing to do: OK without touching anything (or needing a device).
  EXPECT_TRUE(DeviceReduce(DataType::kFloat32, ReduceOp::kSum, nullptr, 2, nullptr, 0, nullptr).ok());

  // Several outputs.
  void* outs[kMaxReduceInputs + 1];
  for (auto& p : outs) p = Fake(0x20000);
  expect_invalid(DeviceReduceToAll(DataType::kFloat32, ReduceOp::kSum, in, 2, outs, 0, 8, nullptr),
                 "0 outputs");
  expect_invalid(DeviceReduceToAll(DataType::kFloat32, ReduceOp::kSum, in, 2, outs,
                                   kMaxReduceInputs + 1, 8, nullptr),
                 "65 outputs");
  void* outs_null[] = {Fake(0x20000), nullptr};
  expect_invalid(DeviceReduceToAll(DataType::kFloat32, ReduceOp::kSum, in, 2, outs_null, 2, 8,
                                   nullptr),
                 "output 1 is null");
  void* outs_misaligned[] = {Fake(0x20000), Fake(0x20002)};
  expect_invalid(DeviceReduceToAll(DataType::kFloat32, ReduceOp::kSum, in, 2, outs_misaligned, 2,
                                   8, nullptr),
                 "output 1 is not aligned");
  expect_invalid(DeviceReduceToAll(DataType::kFloat32, ReduceOp::kSum, in, 2, nullptr, 2, 8,
                                   nullptr),
                 "null buffer");
  EXPECT_TRUE(
      DeviceReduceToAll(DataType::kFloat32, ReduceOp::kSum, nullptr, 2, nullptr, 2, 0, nullptr).ok());
}

TEST(ArgumentTest, CodecsRejectBadArguments) {
  // Unsupported dtypes.
  EXPECT_EQ(DeviceCastEncode(CastFormat::kFp16, DataType::kInt32, Fake(0x100), 4, Fake(0x200), nullptr)
                .code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(DeviceInt8Decode(DataType::kInt8, Fake(0x100), 8, 4, Fake(0x200), false, Fake(0x300),
                             1 << 20, nullptr)
                .code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Int8MaxEncodedBytes(DataType::kInt32, 100), 0u);
  EXPECT_EQ(Int8MaxEncodedBytes(DataType::kFloat32, 257), 2 * 4 + 257 * 4u);
  // Sizes that do not match.
  EXPECT_EQ(DeviceCastDecode(CastFormat::kBf16, DataType::kFloat32, Fake(0x100), 7, 4, Fake(0x200),
                             false, nullptr)
                .code(),
            absl::StatusCode::kInvalidArgument);
  const absl::Status trailing =
      DeviceInt8Decode(DataType::kFloat32, Fake(0x100), 4, 0, Fake(0x200), false, nullptr, 0, nullptr);
  EXPECT_EQ(trailing.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(std::string(trailing.message()).find("trailing"), std::string::npos) << trailing;
  EXPECT_EQ(DeviceTopKDecode(DataType::kFloat32, Fake(0x100), 12, 10, Fake(0x200), false,
                             Fake(0x300), 256, nullptr)
                .code(),
            absl::StatusCode::kInvalidArgument);  // 12 bytes: not whole 8-byte entries
  EXPECT_EQ(DeviceTopKDecode(DataType::kFloat32, Fake(0x100), 8 * 11, 10, Fake(0x200), false,
                             Fake(0x300), 256, nullptr)
                .code(),
            absl::StatusCode::kInvalidArgument);  // 11 entries for 10 elements
  EXPECT_EQ(DeviceTopKEncode(DataType::kFloat32, Fake(0x100), 10, 0, Fake(0x200), Fake(0x300),
                             1 << 20, nullptr)
                .code(),
            absl::StatusCode::kInvalidArgument);  // k = 0
  EXPECT_EQ(DeviceTopKEncode(DataType::kFloat32, Fake(0x100), 10, 11, Fake(0x200), Fake(0x300),
                             1 << 20, nullptr)
                .code(),
            absl::StatusCode::kInvalidArgument);  // k > count
  // Too small a workspace.
  EXPECT_EQ(DeviceInt8Decode(DataType::kFloat32, Fake(0x100), 4 + 10, 10, Fake(0x200), false,
                             Fake(0x300), 8, nullptr)
                .code(),
            absl::StatusCode::kInvalidArgument);
  // Empty inputs are fine.
  EXPECT_TRUE(DeviceTopKDecode(DataType::kFloat32, nullptr, 0, 0, nullptr, false, nullptr, 0, nullptr).ok());
  EXPECT_TRUE(DeviceErrorFeedbackApply(nullptr, nullptr, 0, nullptr).ok());
}

// Without a usable device every kernel says so (FAILED_PRECONDITION "no CUDA
// device: ..."); on a machine with a GPU this case cannot be produced.
TEST(NoDeviceTest, KernelsSayNoDevice) {
  int devices = 0;
  const cudaError_t probe = cudaGetDeviceCount(&devices);
  if (probe == cudaSuccess && devices > 0) {
    GTEST_SKIP() << "a CUDA device is present (" << devices << "): the no-device error cannot be tested";
  }
  const void* in[] = {Fake(0x10000), Fake(0x20000)};
  const absl::Status s =
      DeviceReduce(DataType::kFloat32, ReduceOp::kSum, in, 2, Fake(0x30000), 1024, nullptr);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_NE(std::string(s.message()).find("no CUDA device: "), std::string::npos) << s;
  const absl::StatusOr<size_t> ws = Int8EncodeWorkspaceBytes(1000);
  if (!ws.ok()) {  // CUB asks the device while sizing its scratch
    EXPECT_EQ(ws.status().code(), absl::StatusCode::kFailedPrecondition) << ws.status();
  }
  const absl::Status ef = DeviceErrorFeedbackApply(static_cast<const float*>(Fake(0x10000)),
                                                   static_cast<float*>(Fake(0x20000)), 10, nullptr);
  EXPECT_EQ(ef.code(), absl::StatusCode::kFailedPrecondition) << ef;
}

}  // namespace
}  // namespace ciuic::daemon::gpu
