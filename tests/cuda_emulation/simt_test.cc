// The SIMT executor (simt.h) itself: what it must do for the kernel sources
// to be tested on it (barriers, shuffles, the grid), and what it must refuse
// as a GPU would fault or hang: a shuffle mask that names lanes not taking
// part, threads waiting at different barriers, a pointer the device cannot
// reach, a write past an allocation (the guard page after it). A fault
// breaks the process's emulated context, so those run in death tests.
// clang-format off
#include "simt.h"
// clang-format on

#include <cuda_runtime_api.h>

#include <csignal>
#include <cstdint>
#include <cstdlib>
#include <vector>

#include "gtest/gtest.h"

namespace {

// Every thread writes its slot, waits, then reads its neighbour's: wrong
// without the barrier (the executor runs threads in a random order).
__global__ void NeighbourKernel(unsigned* out) {
  __shared__ unsigned slots[256];
  const unsigned t = threadIdx.x;
  slots[t] = t * 3 + blockIdx.x;
  __syncthreads();
  out[blockIdx.x * blockDim.x + t] = slots[(t + 1) % blockDim.x];
}

__global__ void XorKernel(unsigned* out, int lane_mask) {
  const unsigned t = threadIdx.x;
  out[t] = __shfl_xor_sync(0xffffffffu, t * 10, lane_mask);
}

__global__ void GridStrideKernel(unsigned* out, size_t n) {
  for (size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    atomicAdd(&out[i % 64], 1u);
  }
}

__global__ void HalfMaskKernel(unsigned* out) {
  out[threadIdx.x] = __shfl_xor_sync(0x0000ffffu, threadIdx.x, 16);
}

// Half of a warp waits at __syncthreads, the other half at a shuffle with
// the whole warp: on a GPU a hang (threads that ended would not count).
__global__ void DivergentKernel(unsigned* out) {
  if (threadIdx.x % 32 < 16) {
    __syncthreads();
  } else {
    out[threadIdx.x] = __shfl_xor_sync(0xffffffffu, threadIdx.x, 1);
  }
}

__global__ void WriteAtKernel(unsigned char* p, size_t at) { p[at] = 1; }

// Pointers passed in a struct, as the reduction passes its inputs.
struct Pointers {
  const unsigned* ptr[4];
};
__global__ void FirstOfKernel(Pointers in, unsigned* out) { out[threadIdx.x] = in.ptr[0][0]; }

class SimtTest : public ::testing::Test {
 protected:
  void SetUp() override { ASSERT_EQ(cudaStreamCreate(&stream_), cudaSuccess); }
  void TearDown() override { cudaStreamDestroy(stream_); }
  template <typename F>
  std::vector<unsigned> Run(size_t n, F launch) {
    unsigned* d = nullptr;
    EXPECT_EQ(cudaMalloc(&d, n * sizeof(unsigned)), cudaSuccess);
    EXPECT_EQ(cudaMemsetAsync(d, 0, n * sizeof(unsigned), stream_), cudaSuccess);
    launch(d, stream_);
    EXPECT_EQ(cudaGetLastError(), cudaSuccess);
    std::vector<unsigned> host(n);
    EXPECT_EQ(
        cudaMemcpyAsync(host.data(), d, n * sizeof(unsigned), cudaMemcpyDeviceToHost, stream_),
        cudaSuccess);
    EXPECT_EQ(cudaStreamSynchronize(stream_), cudaSuccess);
    cudaFree(d);
    return host;
  }
  cudaStream_t stream_ = nullptr;
};

TEST_F(SimtTest, SyncThreadsOrdersSharedMemoryInEveryBlock) {
  for (int round = 0; round < 20; ++round) {  // random orders
    const auto out = Run(3 * 256, [](unsigned* d, cudaStream_t s) {
      CIUIC_LAUNCH(3, 256, s, NeighbourKernel)(d);
    });
    for (unsigned b = 0; b < 3; ++b) {
      for (unsigned t = 0; t < 256; ++t) {
        ASSERT_EQ(out[b * 256 + t], ((t + 1) % 256) * 3 + b) << "block " << b << " thread " << t;
      }
    }
  }
}

TEST_F(SimtTest, ShuffleXorExchangesWithThePartnerLane) {
  for (int mask : {0, 1, 2, 16, 31}) {
    const auto x = Run(64, [mask](unsigned* d, cudaStream_t s) {
      CIUIC_LAUNCH(1, 64, s, XorKernel)(d, mask);
    });
    for (unsigned t = 0; t < 64; ++t) {
      ASSERT_EQ(x[t], (t ^ static_cast<unsigned>(mask)) * 10) << "mask " << mask << " lane " << t;
    }
  }
}

TEST_F(SimtTest, TheGridStrideLoopCoversEveryIndexOnce) {
  const auto out = Run(64, [](unsigned* d, cudaStream_t s) {
    CIUIC_LAUNCH(5, 96, s, GridStrideKernel)(d, 100000);
  });
  uint64_t total = 0;
  for (unsigned v : out) total += v;
  EXPECT_EQ(total, 100000u);
  EXPECT_EQ(out[0], 100000u / 64 + 1);  // 1563 indices i with i % 64 == 0
}

TEST_F(SimtTest, ABadLaunchShapeIsAnInvalidConfiguration) {
  unsigned* d = nullptr;
  ASSERT_EQ(cudaMalloc(&d, 64), cudaSuccess);
  CIUIC_LAUNCH(0, 32, stream_, XorKernel)(d, 1);
  EXPECT_EQ(cudaGetLastError(), cudaErrorInvalidConfiguration);
  CIUIC_LAUNCH(1, 2048, stream_, XorKernel)(d, 1);
  EXPECT_EQ(cudaGetLastError(), cudaErrorInvalidConfiguration);
  cudaFree(d);
}

// In a child: runs `launch` on a fresh stream and exits 0 if the context
// then reports a device fault.
template <typename F>
void ExpectFault(F launch) {
  cudaStream_t s;
  if (cudaStreamCreate(&s) != cudaSuccess) std::exit(2);
  void* d = nullptr;
  if (cudaMalloc(&d, 4096) != cudaSuccess) std::exit(3);
  launch(static_cast<unsigned*>(d), s);
  std::exit(cudaStreamSynchronize(s) == cudaErrorIllegalAddress ? 0 : 1);
}

// Re-executed in a child of its own (the emulation runs stream threads,
// which a plain fork would not carry).
class SimtDeathTest : public SimtTest {
 protected:
  void SetUp() override {
    GTEST_FLAG_SET(death_test_style, "threadsafe");
    SimtTest::SetUp();
  }
};

TEST_F(SimtDeathTest, AShuffleMaskNamingLanesThatDoNotTakePartIsAFault) {
  EXPECT_EXIT(
      ExpectFault([](unsigned* d, cudaStream_t s) { CIUIC_LAUNCH(1, 32, s, HalfMaskKernel)
                                                    (d); }),
      ::testing::ExitedWithCode(0), "shuffles with mask 0x0000ffff");
}

TEST_F(SimtDeathTest, ThreadsAtDifferentBarriersDeadlockAsAFault) {
  EXPECT_EXIT(
      ExpectFault([](unsigned* d, cudaStream_t s) { CIUIC_LAUNCH(1, 32, s, DivergentKernel)
                                                    (d); }),
      ::testing::ExitedWithCode(0),
      "its threads deadlock: 16 wait at __syncthreads and 16 at a warp shuffle");
}

TEST_F(SimtDeathTest, APointerTheDeviceCannotReachIsAFault) {
  EXPECT_EXIT(ExpectFault([](unsigned*, cudaStream_t s) {
                static unsigned host[64];  // pageable host memory
                CIUIC_LAUNCH(1, 64, s, XorKernel)(host, 1);
              }),
              ::testing::ExitedWithCode(0), "argument 0 points at memory device 0 cannot reach");
}

TEST_F(SimtDeathTest, APointerInAnArgumentStructIsCheckedAsOne) {
  EXPECT_EXIT(ExpectFault([](unsigned* d, cudaStream_t s) {
                static unsigned host[4] = {7, 7, 7, 7};  // pageable host memory
                Pointers in{};
                in.ptr[0] = host;
                CIUIC_LAUNCH(1, 4, s, FirstOfKernel)(in, d);
              }),
              ::testing::ExitedWithCode(0), "argument 0 points at memory device 0 cannot reach");
}

// A write just past an allocation (rounded up to 256 bytes) hits the guard
// page after its alias, as compute-sanitizer would report it on a GPU.
TEST_F(SimtDeathTest, AWritePastAnAllocationHitsItsGuardPage) {
  EXPECT_EXIT(
      {
        cudaStream_t s;
        void* d = nullptr;
        if (cudaStreamCreate(&s) != cudaSuccess || cudaMalloc(&d, 1000) != cudaSuccess) {
          std::exit(2);
        }
        CIUIC_LAUNCH(1, 1, s, WriteAtKernel)(static_cast<unsigned char*>(d), 999);  // inside
        if (cudaStreamSynchronize(s) != cudaSuccess) std::exit(3);
        CIUIC_LAUNCH(1, 1, s, WriteAtKernel)(static_cast<unsigned char*>(d), 1024);  // past
        cudaStreamSynchronize(s);
        std::exit(0);  // not reached
      },
      ::testing::KilledBySignal(SIGSEGV), "");
}

}  // namespace
