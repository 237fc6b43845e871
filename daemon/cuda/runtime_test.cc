// runtime.h: the waker that ends waits for device work when the work ends
// (DeviceWaker, WakeWhenReached) and WaitForStream. The waker's own logic
// runs anywhere; the rest needs a CUDA device (or the CUDA emulation) and
// skips without one. Labelled `gpu`.
#include "cuda/runtime.h"

#include <cuda_runtime_api.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <memory>
#include <string>
#include <thread>

#include "gtest/gtest.h"

namespace ciuic::daemon {
namespace {

using std::chrono::milliseconds;
using std::chrono::steady_clock;

TEST(DeviceWakerTest, AWakeAfterTheLookIsKeptAndNoWakeTimesOut) {
  DeviceWaker w;
  const uint64_t seen = w.generation();
  EXPECT_FALSE(w.WaitFor(seen, std::chrono::microseconds(1000)));
  w.Wake();  // between the look and the wait: not lost
  EXPECT_TRUE(w.WaitFor(seen, std::chrono::microseconds(0)));
  EXPECT_NE(w.generation(), seen);
}

TEST(DeviceWakerTest, AWakeFromAnotherThreadEndsTheWait) {
  DeviceWaker w;
  const uint64_t seen = w.generation();
  std::thread t([&] {
    std::this_thread::sleep_for(milliseconds(20));
    w.Wake();
  });
  EXPECT_TRUE(w.WaitFor(seen, std::chrono::microseconds(10'000'000)));
  t.join();
}

class StreamWakeTest : public ::testing::Test {
 protected:
  void SetUp() override {
    int n = 0;
    const cudaError_t e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess || n == 0) {
      const std::string reason = e != cudaSuccess ? cudaGetErrorString(e) : "0 devices";
      const char* required = std::getenv("CIUIC_REQUIRE_GPU");
      if (required != nullptr && std::string(required) == "1") {
        FAIL() << "no CUDA device: " << reason;
      }
      GTEST_SKIP() << "no CUDA device: " << reason;
    }
    ASSERT_EQ(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), cudaSuccess);
  }
  void TearDown() override {
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
  }

  // Holds the stream for `ms` (a host function that sleeps) and notes when
  // that work ended.
  void Busy(int ms) {
    struct Arg {
      int ms;
      std::atomic<int64_t>* ended;
    };
    auto* arg = new Arg{ms, &ended_ns_};
    ASSERT_EQ(cudaLaunchHostFunc(
                  stream_,
                  [](void* p) {
                    auto* a = static_cast<Arg*>(p);
                    std::this_thread::sleep_for(milliseconds(a->ms));
                    a->ended->store(steady_clock::now().time_since_epoch().count());
                    delete a;
                  },
                  arg),
              cudaSuccess);
  }

  cudaStream_t stream_ = nullptr;
  std::atomic<int64_t> ended_ns_{0};
};

TEST_F(StreamWakeTest, TheHostFunctionWakesOnceTheStreamGetsThere) {
  auto waker = std::make_shared<DeviceWaker>();
  const uint64_t seen = waker->generation();
  Busy(30);
  ASSERT_TRUE(WakeWhenReached(waker, stream_));
  // Bounded: the wake comes after the 30 ms of work, far within 10 s.
  EXPECT_TRUE(waker->WaitFor(seen, std::chrono::microseconds(10'000'000)));
  EXPECT_NE(ended_ns_.load(), 0) << "woken before the work before it ended";
  ASSERT_EQ(cudaStreamSynchronize(stream_), cudaSuccess);
}

TEST_F(StreamWakeTest, WaitForStreamReturnsOnlyOnceTheWorkIsDone) {
  cudaEvent_t event = nullptr;
  for (int round = 0; round < 3; ++round) {  // the thread's waker, reused
    ended_ns_ = 0;
    Busy(20);
    ASSERT_TRUE(WaitForStream(stream_, &event, "test").ok());
    EXPECT_NE(ended_ns_.load(), 0) << "round " << round;
  }
  cudaEventDestroy(event);
}

}  // namespace
}  // namespace ciuic::daemon
