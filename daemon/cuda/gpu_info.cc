#include "cuda/gpu_info.h"

#include <cstdio>

#if CIUIC_HAVE_CUDA
#include <cuda_runtime_api.h>
#endif

namespace ciuic::daemon {
namespace {

GpuProbe Probe() {
  GpuProbe probe;
#if CIUIC_HAVE_CUDA
  probe.built_with_cuda = true;
  int count = 0;
  if (const cudaError_t e = cudaGetDeviceCount(&count); e != cudaSuccess) {
    probe.unavailable = cudaGetErrorString(e);
    return probe;
  }
  if (count == 0) {
    probe.unavailable = "the CUDA runtime found no device";
    return probe;
  }
  for (int i = 0; i < count; ++i) {
    cudaDeviceProp prop{};
    if (const cudaError_t e = cudaGetDeviceProperties(&prop, i); e != cudaSuccess) {
      probe.unavailable = std::string("device ") + std::to_string(i) + ": " + cudaGetErrorString(e);
      probe.devices.clear();
      return probe;
    }
    probe.devices.push_back({i, prop.name, prop.totalGlobalMem, prop.major, prop.minor});
  }
#else
  probe.unavailable = "ciuicd was built without CUDA";
#endif
  return probe;
}

}  // namespace

const GpuProbe& ProbeGpus() {
  static const GpuProbe probe = Probe();
  return probe;
}

std::string DescribeGpus(const GpuProbe& probe) {
  if (probe.devices.empty()) return "none: " + probe.unavailable;
  std::string out;
  for (const GpuDevice& d : probe.devices) {
    char memory[32];
    std::snprintf(memory, sizeof(memory), "%.1f GiB",
                  static_cast<double>(d.memory_bytes) / (1024.0 * 1024.0 * 1024.0));
    if (!out.empty()) out += ", ";
    out += std::to_string(d.index) + ": " + d.name + " (" + memory + ", sm_" +
           std::to_string(d.compute_major) + std::to_string(d.compute_minor) + ")";
  }
  return out;
}

}  // namespace ciuic::daemon
