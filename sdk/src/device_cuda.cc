// DeviceExporter with CUDA: see device.h.
#include <cuda.h>  // driver types only; the functions come from cudaGetDriverEntryPoint*
#include <cuda_runtime_api.h>

#include <atomic>
#include <cstdint>
#include <cstring>
#include <map>
#include <mutex>
#include <sstream>
#include <vector>

#include "device.h"

namespace ciuic {

static_assert(sizeof(cudaIpcMemHandle_t) == wire::kCudaIpcHandleBytes);
static_assert(sizeof(cudaIpcEventHandle_t) == wire::kCudaIpcHandleBytes);

namespace {

std::string CudaError(cudaError_t e) {
  return std::string(cudaGetErrorName(e)) + ": " + cudaGetErrorString(e);
}

std::string Hex(uintptr_t p) {
  std::ostringstream o;
  o << "0x" << std::hex << p;
  return o.str();
}

using CtxGetCurrentFn = CUresult (*)(CUcontext*);

// Makes `device` the calling thread's current one for the scope, and
// restores the one before on exit where it differs. A thread that never
// chose a device (no current context: `ctx_get_current`, when known) reads
// as device 0, and is left with `device`: setting 0 back would make a
// context on GPU 0 in a trainer that uses another one.
class CurrentDeviceGuard {
 public:
  cudaError_t Set(int device, CtxGetCurrentFn ctx_get_current) {
    if (cudaGetDevice(&saved_) != cudaSuccess) saved_ = -1;
    if (saved_ == device) return cudaSuccess;
    CUcontext current = nullptr;
    if (ctx_get_current != nullptr && ctx_get_current(&current) == CUDA_SUCCESS &&
        current == nullptr) {
      saved_ = -1;
    }
    const cudaError_t e = cudaSetDevice(device);
    changed_ = e == cudaSuccess && saved_ >= 0;
    return e;
  }
  ~CurrentDeviceGuard() {
    if (changed_) cudaSetDevice(saved_);
  }

 private:
  int saved_ = -1;
  bool changed_ = false;
};

using MemGetAddressRangeFn = CUresult (*)(CUdeviceptr*, size_t*, CUdeviceptr);
using PointerGetAttributeFn = CUresult (*)(void*, CUpointer_attribute, CUdeviceptr);

}  // namespace

bool SdkSupportsDeviceBuffers(std::string* why) {
  if (why != nullptr) why->clear();
  return true;
}

namespace {

// How many devices this process sees; FAILED_PRECONDITION for none.
Status CountDevices(int* devices) {
  *devices = 0;
  const cudaError_t e = cudaGetDeviceCount(devices);
  if (e == cudaSuccess && *devices > 0) return Status::Ok();
  cudaGetLastError();
  return Status(StatusCode::kFailedPrecondition,
                "device (CUDA) buffers: no CUDA device: " +
                    (e != cudaSuccess ? CudaError(e) : std::string("none found")));
}

}  // namespace

Status DeviceOfPointer(const void* ptr, int* device) {
  int devices = 0;
  if (Status s = CountDevices(&devices); !s.ok()) return s;
  cudaPointerAttributes a{};
  cudaError_t e = cudaPointerGetAttributes(&a, ptr);
  if (e != cudaSuccess) {
    cudaGetLastError();
    return Status(StatusCode::kInvalidArgument,
                  "buffer " + Hex(reinterpret_cast<uintptr_t>(ptr)) + ": " + CudaError(e));
  }
  if (a.type != cudaMemoryTypeDevice) {
    return Status(StatusCode::kInvalidArgument,
                  "buffer " + Hex(reinterpret_cast<uintptr_t>(ptr)) +
                      " is not CUDA device memory (host, managed or unregistered memory)");
  }
  *device = a.device;
  return Status::Ok();
}

namespace {

// The allocations this process has exported, by base. Shared by all the
// process's communicators, so that an allocation goes to ciuicd under one
// handle whichever communicator names it: ciuicd maps a handle once and
// shares that mapping between the sessions that name it. (CUDA seems to
// give one allocation the same handle at every export anyway; this makes
// it so whatever the driver does, and exports each allocation once.)
struct Exports {
  struct Allocation {
    CUdeviceptr base = 0;
    size_t bytes = 0;
    unsigned long long buffer_id = 0;
    cudaIpcMemHandle_t handle{};
  };
  std::mutex mu;
  std::map<CUdeviceptr, Allocation> by_base;  // guarded by mu
};

// The process's Exports while any communicator holds them.
std::shared_ptr<Exports> ProcessExports() {
  static std::mutex mu;
  static std::weak_ptr<Exports> current;
  std::lock_guard<std::mutex> lock(mu);
  std::shared_ptr<Exports> e = current.lock();
  if (!e) {
    e = std::make_shared<Exports>();
    current = e;
  }
  return e;
}

}  // namespace

struct DeviceExporter::State {
  struct PooledEvent {
    cudaEvent_t event = nullptr;
    cudaIpcEventHandle_t handle{};
  };

  std::mutex mu;
  bool resolved = false;  // the driver functions below were looked up
  Status resolve_status;
  MemGetAddressRangeFn mem_get_address_range = nullptr;
  PointerGetAttributeFn pointer_get_attribute = nullptr;
  // Read without mu (Record): set once by Resolve.
  std::atomic<CtxGetCurrentFn> ctx_get_current{nullptr};
  const std::shared_ptr<Exports> exports = ProcessExports();
  std::map<int, std::vector<PooledEvent>> free_events;  // by device; guarded by mu

  ~State() {
    // At process exit the runtime may already be gone; errors are moot then.
    for (auto& [device, events] : free_events) {
      for (auto& e : events) cudaEventDestroy(e.event);
    }
  }

  // Looks the two driver functions up once (under mu).
  Status Resolve() {
    if (resolved) return resolve_status;
    resolved = true;
    auto find = [](const char* name, void** fn) -> Status {
      cudaDriverEntryPointQueryResult q{};
      cudaError_t e = cudaGetDriverEntryPointByVersion(name, fn, 12000, cudaEnableDefault, &q);
      if (e != cudaSuccess || q != cudaDriverEntryPointSuccess || *fn == nullptr) {
        cudaGetLastError();
        return Status(StatusCode::kFailedPrecondition,
                      std::string("device (CUDA) buffers: no CUDA driver function ") + name +
                          (e != cudaSuccess ? " (" + CudaError(e) + ")" : std::string()));
      }
      return Status::Ok();
    };
    void* fn = nullptr;
    resolve_status = find("cuMemGetAddressRange", &fn);
    if (!resolve_status.ok()) return resolve_status;
    mem_get_address_range = reinterpret_cast<MemGetAddressRangeFn>(fn);
    fn = nullptr;
    resolve_status = find("cuPointerGetAttribute", &fn);
    if (!resolve_status.ok()) return resolve_status;
    pointer_get_attribute = reinterpret_cast<PointerGetAttributeFn>(fn);
    fn = nullptr;
    // Optional: without it, a device is restored whenever it was changed.
    if (find("cuCtxGetCurrent", &fn).ok()) ctx_get_current = reinterpret_cast<CtxGetCurrentFn>(fn);
    return resolve_status;
  }
};

DeviceExporter::DeviceExporter() : state_(std::make_shared<State>()) {}
DeviceExporter::~DeviceExporter() = default;

Status DeviceExporter::Describe(const void* ptr, size_t bytes, int device,
                                wire::DeviceBufferDescriptor* out) {
  State& s = *state_;
  std::lock_guard<std::mutex> lock(s.mu);
  int devices = 0;
  if (Status counted = CountDevices(&devices); !counted.ok()) return counted;
  Status resolved = s.Resolve();
  if (!resolved.ok()) return resolved;
  const auto p = reinterpret_cast<uintptr_t>(ptr);
  if (device < 0 || device >= devices) {
    return Status(StatusCode::kInvalidArgument,
                  "device buffer " + Hex(p) + " on device " + std::to_string(device) +
                      ": this process sees " + std::to_string(devices) + " CUDA device(s)");
  }
  // The buffer's device current first: cudaPointerGetAttributes makes a
  // context on the current device of a thread that has none.
  CurrentDeviceGuard guard;
  cudaError_t e = guard.Set(device, s.ctx_get_current.load());
  if (e != cudaSuccess) return Status(StatusCode::kInternal, "cudaSetDevice: " + CudaError(e));
  cudaPointerAttributes a{};
  e = cudaPointerGetAttributes(&a, ptr);
  if (e != cudaSuccess) {
    cudaGetLastError();  // clear the sticky-free error for the caller's next call
    return Status(e == cudaErrorNoDevice || e == cudaErrorInsufficientDriver
                      ? StatusCode::kFailedPrecondition
                      : StatusCode::kInvalidArgument,
                  "device buffer " + Hex(p) + ": " + CudaError(e));
  }
  if (a.type != cudaMemoryTypeDevice) {
    return Status(StatusCode::kInvalidArgument,
                  "device buffer " + Hex(p) + " is not CUDA device memory (host, managed or "
                  "unregistered memory)");
  }
  if (a.device != device) {
    return Status(StatusCode::kInvalidArgument,
                  "device buffer " + Hex(p) + " is on device " + std::to_string(a.device) +
                      ", not on device " + std::to_string(device));
  }
  CUdeviceptr base = 0;
  size_t size = 0;
  CUresult r = s.mem_get_address_range(&base, &size, static_cast<CUdeviceptr>(p));
  if (r != CUDA_SUCCESS) {
    return Status(StatusCode::kInvalidArgument, "device buffer " + Hex(p) +
                                                    ": cuMemGetAddressRange failed (error " +
                                                    std::to_string(static_cast<int>(r)) + ")");
  }
  const uint64_t offset = static_cast<uint64_t>(p - base);
  if (offset > size || bytes > size - offset) {
    return Status(StatusCode::kInvalidArgument,
                  "device buffer of " + std::to_string(bytes) + " bytes at " + Hex(p) +
                      " runs past the end of its allocation (" + std::to_string(size) +
                      " bytes at " + Hex(base) + ")");
  }
  unsigned long long buffer_id = 0;
  r = s.pointer_get_attribute(&buffer_id, CU_POINTER_ATTRIBUTE_BUFFER_ID, base);
  if (r != CUDA_SUCCESS) buffer_id = 0;  // then only base and size tell allocations apart
  Exports& exports = *s.exports;
  std::lock_guard<std::mutex> exports_lock(exports.mu);
  auto it = exports.by_base.find(base);
  if (it == exports.by_base.end() || it->second.buffer_id != buffer_id ||
      it->second.bytes != size) {
    Exports::Allocation alloc;
    alloc.base = base;
    alloc.bytes = size;
    alloc.buffer_id = buffer_id;
    e = cudaIpcGetMemHandle(&alloc.handle, reinterpret_cast<void*>(base));
    if (e != cudaSuccess) {
      cudaGetLastError();
      return Status(StatusCode::kFailedPrecondition,
                    "device buffer " + Hex(p) + ": cannot export its allocation over CUDA IPC "
                    "(memory from cudaMallocAsync pools or cuMemCreate cannot be): " +
                        CudaError(e));
    }
    it = exports.by_base.insert_or_assign(base, alloc).first;
  }
  std::memcpy(out->memory_handle, &it->second.handle, wire::kCudaIpcHandleBytes);
  out->offset = offset;
  out->allocation_bytes = size;
  out->device = device;
  return Status::Ok();
}

Status DeviceExporter::RecordEvent(void* stream, int device, uint8_t* handle,
                                   std::shared_ptr<void>* hold) {
  std::shared_ptr<State> st = state_;
  State::PooledEvent ev;
  {
    std::lock_guard<std::mutex> lock(st->mu);
    auto& pool = st->free_events[device];
    if (!pool.empty()) {
      ev = pool.back();
      pool.pop_back();
    }
  }
  CurrentDeviceGuard guard;
  cudaError_t e = guard.Set(device, st->ctx_get_current.load());
  if (e != cudaSuccess) return Status(StatusCode::kInternal, "cudaSetDevice: " + CudaError(e));
  if (ev.event == nullptr) {
    e = cudaEventCreateWithFlags(&ev.event, cudaEventInterprocess | cudaEventDisableTiming);
    if (e != cudaSuccess) {
      return Status(StatusCode::kInternal, "cudaEventCreateWithFlags: " + CudaError(e));
    }
    e = cudaIpcGetEventHandle(&ev.handle, ev.event);
    if (e != cudaSuccess) {
      cudaEventDestroy(ev.event);
      return Status(StatusCode::kInternal, "cudaIpcGetEventHandle: " + CudaError(e));
    }
  }
  auto give_back = [st, device](State::PooledEvent x) {
    std::lock_guard<std::mutex> lock(st->mu);
    st->free_events[device].push_back(x);
  };
  e = cudaEventRecord(ev.event, static_cast<cudaStream_t>(stream));
  if (e != cudaSuccess) {
    cudaGetLastError();
    give_back(ev);
    return Status(StatusCode::kInvalidArgument,
                  "recording an event on the given stream (device " + std::to_string(device) +
                      "): " + CudaError(e));
  }
  std::memcpy(handle, &ev.handle, wire::kCudaIpcHandleBytes);
  *hold = std::shared_ptr<void>(nullptr, [give_back, ev](void*) { give_back(ev); });
  return Status::Ok();
}

}  // namespace ciuic
