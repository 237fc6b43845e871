// ProbeGpus on whatever machine runs the test: in a build without CUDA it
// must say so; with CUDA it lists the devices or gives the runtime's reason.
#include "cuda/gpu_info.h"

#include "gtest/gtest.h"

namespace ciuic::daemon {
namespace {

TEST(GpuInfoTest, ProbeIsConsistent) {
  const GpuProbe& probe = ProbeGpus();
  EXPECT_EQ(&probe, &ProbeGpus());  // probed once
#if CIUIC_HAVE_CUDA
  EXPECT_TRUE(probe.built_with_cuda);
#else
  EXPECT_FALSE(probe.built_with_cuda);
  EXPECT_EQ(probe.unavailable, "ciuicd was built without CUDA");
#endif
  if (probe.devices.empty()) {
    EXPECT_FALSE(probe.unavailable.empty());
    EXPECT_EQ(DescribeGpus(probe), "none: " + probe.unavailable);
  } else {
    EXPECT_TRUE(probe.unavailable.empty());
    for (const GpuDevice& d : probe.devices) {
      EXPECT_FALSE(d.name.empty());
      EXPECT_GT(d.memory_bytes, 0u);
      EXPECT_NE(DescribeGpus(probe).find(d.name), std::string::npos);
    }
  }
}

TEST(GpuInfoTest, DescribesDevices) {
  GpuProbe probe;
  probe.built_with_cuda = true;
  probe.devices.push_back({0, "NVIDIA H200", uint64_t{150} << 30, 9, 0});
  probe.devices.push_back({1, "NVIDIA A100", uint64_t{40} << 30, 8, 0});
  EXPECT_EQ(DescribeGpus(probe),
            "0: NVIDIA H200 (150.0 GiB, sm_90), 1: NVIDIA A100 (40.0 GiB, sm_80)");
  GpuProbe none;
  none.unavailable = "no driver";
  EXPECT_EQ(DescribeGpus(none), "none: no driver");
}

}  // namespace
}  // namespace ciuic::daemon
