// What this daemon can do with GPUs: whether it was built with CUDA and which
// devices the CUDA runtime finds at run time (or why it finds none). Shown by
// `ciuicctl status` and logged at start.
//
// The CUDA runtime is linked statically, so ciuicd starts on machines without
// a GPU or driver; the probe then reports the runtime's reason. ProbeGpus
// probes once (the first call, from any thread) and returns the cached result
// afterwards; it is thread-safe. In a build without CUDA it reports
// "ciuicd was built without CUDA" and never touches a driver.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace ciuic::daemon {

struct GpuDevice {
  int index = 0;
  std::string name;
  uint64_t memory_bytes = 0;
  int compute_major = 0;
  int compute_minor = 0;
};

struct GpuProbe {
  bool built_with_cuda = false;
  std::vector<GpuDevice> devices;
  // Empty when `devices` is not empty; otherwise why there is none, e.g.
  // "CUDA driver version is insufficient for CUDA runtime version".
  std::string unavailable;
};

const GpuProbe& ProbeGpus();

// One line for logs and the status display: "2 x NVIDIA H200 (139.8 GiB)" or
// "none: <reason>".
std::string DescribeGpus(const GpuProbe& probe);

}  // namespace ciuic::daemon
