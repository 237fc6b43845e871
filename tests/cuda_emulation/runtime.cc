// The CUDA runtime API, emulated in host memory, for the functions ciuic
// calls (README.md). Device memory is a memfd mapped twice: an inaccessible
// mapping whose address is the "device pointer" (so host code that
// dereferences device memory faults, as it would with a GPU) and a
// read-write alias that the emulated device's copies and kernels use.
// Streams are threads that run their work in order; events are counters in
// shared memory; CUDA IPC handles name a process's memfd, opened through
// /proc/PID/fd. The rules a GPU enforces and that ciuic's code must keep are
// checked: copy directions, pageable copies being synchronous, peer access,
// one open of a handle per process and none in the exporting process, no
// CUDA call from a host function, a fault breaking the context.
#include <cuda.h>
#include <cuda_runtime_api.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "emulation.h"

using ciuic::cuda_emulation::Access;

namespace {

using Clock = std::chrono::steady_clock;

thread_local int t_device = 0;
thread_local cudaError_t t_last = cudaSuccess;
thread_local bool t_in_host_fn = false;

size_t PageRound(size_t bytes) {
  const size_t page = 4096;
  return (std::max<size_t>(bytes, 1) + page - 1) / page * page;
}

int EnvInt(const char* name, int fallback) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return fallback;
  return std::atoi(v);
}

// CIUIC_CUDA_EMULATION_JITTER_US=N: every piece of a stream's work starts up
// to N microseconds late (at random), as a GPU's work does when it is busy,
// so that work ordered by luck rather than by its streams and events shows.
void Jitter() {
  static const int max_us = std::max(0, EnvInt("CIUIC_CUDA_EMULATION_JITTER_US", 0));
  if (max_us == 0) return;
  thread_local uint64_t x = 0x9e3779b97f4a7c15ull ^ reinterpret_cast<uintptr_t>(&x);
  x ^= x << 13, x ^= x >> 7, x ^= x << 17;
  std::this_thread::sleep_for(std::chrono::microseconds(x % (max_us + 1)));
}

}  // namespace

// The opaque types of driver_types.h, defined here.
struct CUstream_st {
  int device = 0;
  bool is_default = false;
  std::mutex mu;
  std::condition_variable cv;       // work queued, or the stream destroyed
  std::condition_variable done_cv;  // a piece of work ended
  std::deque<std::function<void()>> queue;
  uint64_t queued = 0;  // pieces ever queued
  uint64_t done = 0;    // pieces ever finished
  bool destroyed = false;

  void Enqueue(std::function<void()> work) {
    std::lock_guard<std::mutex> lock(mu);
    queue.push_back(std::move(work));
    ++queued;
    cv.notify_one();
  }
  // Waits for everything queued before the call.
  void Drain() {
    std::unique_lock<std::mutex> lock(mu);
    const uint64_t want = queued;
    done_cv.wait(lock, [&] { return done >= want; });
  }
  bool Idle() {
    std::lock_guard<std::mutex> lock(mu);
    return done == queued;
  }
  void Run() {
    std::unique_lock<std::mutex> lock(mu);
    while (true) {
      cv.wait(lock, [&] { return !queue.empty() || destroyed; });
      if (queue.empty()) break;  // destroyed, and its work is over
      std::function<void()> work = std::move(queue.front());
      queue.pop_front();
      lock.unlock();
      Jitter();
      work();
      lock.lock();
      ++done;
      done_cv.notify_all();
    }
  }
};

struct EventState {
  struct Counters {
    std::atomic<uint64_t> recorded{0};
    std::atomic<uint64_t> completed{0};
    std::atomic<int64_t> completed_ns{0};  // steady clock, at the last completion (timing)
  };
  Counters* counters = nullptr;
  int fd = -1;  // interprocess: the memfd holding the counters
  bool mapped = false;
  ~EventState() {
    if (mapped) {
      munmap(counters, PageRound(sizeof(Counters)));
    } else {
      delete counters;
    }
    if (fd >= 0) close(fd);
  }
  void Complete(uint64_t seq) {
    uint64_t cur = counters->completed.load();
    while (cur < seq && !counters->completed.compare_exchange_weak(cur, seq)) {
    }
  }
  bool Done() { return counters->completed.load() >= counters->recorded.load(); }
};

struct CUevent_st {
  std::shared_ptr<EventState> state;
  unsigned flags = 0;
  int device = 0;
  uint64_t id = 0;  // interprocess: in the memfd's name
};

struct CUmemPoolHandle_st {
  int device = 0;
};

namespace ciuic::cuda_emulation {
namespace {

constexpr uint32_t kMemMagic = 0x31554d43;    // "CMU1"
constexpr uint32_t kEventMagic = 0x31564543;  // "CEV1"

struct MemHandleBytes {
  uint32_t magic;
  int32_t pid;
  int32_t fd;
  int32_t device;
  uint64_t id;
  uint64_t bytes;
  uint64_t base;  // the allocation's address in the exporting process
};
static_assert(sizeof(MemHandleBytes) <= sizeof(cudaIpcMemHandle_t));

struct EventHandleBytes {
  uint32_t magic;
  int32_t pid;
  int32_t fd;
  int32_t device;
  uint64_t id;
};
static_assert(sizeof(EventHandleBytes) <= sizeof(cudaIpcEventHandle_t));

enum class Kind { kDevice, kPool, kOpened, kPinned };

struct Range {
  uintptr_t base = 0;
  size_t bytes = 0;   // what was asked for (cuMemGetAddressRange's size)
  size_t mapped = 0;  // page-rounded
  size_t lead = 0;    // device memory: where in its mapping it starts (MapTwice)
  char* alias = nullptr;
  int device = -1;     // the owner's device (pinned: -1)
  int opened_on = -1;  // kOpened: the device whose context opened it
  Kind kind = Kind::kDevice;
  int fd = -1;  // kDevice: the memfd its IPC handle names
  uint64_t id = 0;
  // kOpened: the exporting process and the allocation's address there.
  int32_t peer_pid = 0;
  uint64_t peer_base = 0;
};

struct Global {
  std::mutex mu;
  std::map<uintptr_t, Range> ranges;  // by base
  int devices = 1;
  bool peer_capable = true;
  std::vector<std::vector<bool>> peer_enabled;  // [device][peer]
  std::atomic<int> sticky{cudaSuccess};
  std::vector<CUstream_st*> default_streams;
  std::set<CUstream_st*> streams;  // live, the default ones included
  std::set<cudaEvent_t> events;
  std::vector<CUmemPoolHandle_st> pools;
  uint64_t next_id = 1;

  Global() {
    devices = std::max(0, EnvInt("CIUIC_CUDA_EMULATION_DEVICES", 1));
    peer_capable = EnvInt("CIUIC_CUDA_EMULATION_PEER_ACCESS", 1) != 0;
    peer_enabled.assign(devices, std::vector<bool>(devices, false));
    pools.resize(devices);
    for (int d = 0; d < devices; ++d) pools[d].device = d;
  }
  uint64_t NewId() { return (static_cast<uint64_t>(getpid()) << 32) | next_id++; }
};

// Never destroyed: stream threads may outlive static destruction.
Global& G() {
  static Global* g = new Global;
  return *g;
}

cudaError_t Ret(cudaError_t e) {
  if (e != cudaSuccess) t_last = e;
  return e;
}

// What every call that touches the device checks first.
cudaError_t Check() {
  if (t_in_host_fn) {
    std::fprintf(stderr,
                 "ciuic CUDA emulation: a CUDA call from a host function "
                 "(cudaLaunchHostFunc forbids it; a GPU may deadlock)\n");
    return Ret(cudaErrorNotPermitted);
  }
  if (G().devices == 0) return Ret(cudaErrorNoDevice);
  const int sticky = G().sticky.load();
  if (sticky != cudaSuccess) return Ret(static_cast<cudaError_t>(sticky));
  if (t_device < 0 || t_device >= G().devices) return Ret(cudaErrorInvalidDevice);
  return cudaSuccess;
}

// Under G().mu.
const Range* FindLocked(const void* p) {
  auto& ranges = G().ranges;
  const auto a = reinterpret_cast<uintptr_t>(p);
  auto it = ranges.upper_bound(a);
  if (it == ranges.begin()) return nullptr;
  --it;
  if (a >= it->second.base + std::max<size_t>(it->second.bytes, 1)) return nullptr;
  return &it->second;
}

bool Find(const void* p, Range* out) {
  std::lock_guard<std::mutex> lock(G().mu);
  const Range* r = FindLocked(p);
  if (r == nullptr) return false;
  *out = *r;
  return true;
}

bool IsDeviceRange(const Range& r) { return r.kind != Kind::kPinned; }

// Under G().mu: whether `device`'s kernels reach device memory `r`: their
// own, an IPC mapping opened on them, a peer's with peer access enabled.
bool ReachesLocked(const Range& r, int device) {
  return r.device == device || (r.kind == Kind::kOpened && r.opened_on == device) ||
         (device >= 0 && device < G().devices && r.device >= 0 && r.device < G().devices &&
          G().peer_enabled[device][r.device]);
}

CUstream_st* NewStream(int device, bool is_default) {
  auto* s = new CUstream_st;
  s->device = device;
  s->is_default = is_default;
  std::thread([s] {
    s->Run();
    // Destroyed and drained: nobody refers to it any more.
    std::lock_guard<std::mutex> lock(G().mu);
    G().streams.erase(s);
    delete s;
  }).detach();
  std::lock_guard<std::mutex> lock(G().mu);
  G().streams.insert(s);
  return s;
}

// The stream a call names: nullptr and the legacy/per-thread handles are the
// current device's default stream.
cudaError_t Resolve(cudaStream_t stream, CUstream_st** out) {
  if (stream == nullptr || stream == cudaStreamLegacy || stream == cudaStreamPerThread) {
    CUstream_st* s = nullptr;
    {
      std::lock_guard<std::mutex> lock(G().mu);
      if (G().default_streams.empty()) G().default_streams.assign(G().devices, nullptr);
      s = G().default_streams[t_device];
    }
    if (s == nullptr) {
      s = NewStream(t_device, true);
      std::lock_guard<std::mutex> lock(G().mu);
      if (G().default_streams[t_device] == nullptr) {
        G().default_streams[t_device] = s;
      } else {
        // Another thread made it first: retire ours.
        std::lock_guard<std::mutex> slock(s->mu);
        s->destroyed = true;
        s->cv.notify_one();
        s = G().default_streams[t_device];
      }
    }
    *out = s;
    return cudaSuccess;
  }
  std::lock_guard<std::mutex> lock(G().mu);
  if (G().streams.count(stream) == 0) return cudaErrorInvalidResourceHandle;
  {
    std::lock_guard<std::mutex> slock(stream->mu);
    if (stream->destroyed) return cudaErrorInvalidResourceHandle;
  }
  *out = stream;
  return cudaSuccess;
}

// Where the emulated device's copy engine reads or writes [p, p + bytes):
// any device's memory (copies between devices go through the host when
// peers cannot reach each other), pinned or pageable host memory as it is.
char* CopyAddress(const void* p, size_t bytes, bool device_side) {
  if (bytes == 0) return static_cast<char*>(const_cast<void*>(p));
  Range r;
  if (!Find(p, &r)) return device_side ? nullptr : static_cast<char*>(const_cast<void*>(p));
  const auto a = reinterpret_cast<uintptr_t>(p);
  if (a + bytes > r.base + r.bytes) return nullptr;  // runs off its allocation
  if (r.kind == Kind::kPinned) return static_cast<char*>(const_cast<void*>(p));
  return r.alias + (a - r.base);
}

enum class Side { kHostPageable, kHostPinned, kDevice };

Side Classify(const void* p) {
  Range r;
  if (!Find(p, &r)) return Side::kHostPageable;
  return r.kind == Kind::kPinned ? Side::kHostPinned : Side::kDevice;
}

// Checks `kind` against what the pointers are, as a GPU's runtime would
// (cudaMemcpyDefault infers it).
cudaError_t CheckKind(cudaMemcpyKind kind, Side dst, Side src) {
  const bool dst_dev = dst == Side::kDevice;
  const bool src_dev = src == Side::kDevice;
  switch (kind) {
    case cudaMemcpyHostToDevice:
      return dst_dev && !src_dev ? cudaSuccess : cudaErrorInvalidValue;
    case cudaMemcpyDeviceToHost:
      return !dst_dev && src_dev ? cudaSuccess : cudaErrorInvalidValue;
    case cudaMemcpyDeviceToDevice:
      return dst_dev && src_dev ? cudaSuccess : cudaErrorInvalidValue;
    case cudaMemcpyHostToHost:
      return !dst_dev && !src_dev ? cudaSuccess : cudaErrorInvalidValue;
    case cudaMemcpyDefault:
      return cudaSuccess;
  }
  return cudaErrorInvalidMemcpyDirection;
}

// A copy of `height` rows of `width` bytes, enqueued on `stream`; a copy
// from or to pageable host memory is synchronous, as on a GPU.
cudaError_t Copy2D(void* dst, size_t dpitch, const void* src, size_t spitch, size_t width,
                   size_t height, cudaMemcpyKind kind, cudaStream_t stream, bool sync) {
  if (cudaError_t e = Check(); e != cudaSuccess) return e;
  if (width == 0 || height == 0) return cudaSuccess;
  if (dst == nullptr || src == nullptr || width > dpitch || width > spitch) {
    return Ret(cudaErrorInvalidValue);
  }
  const Side ds = Classify(dst);
  const Side ss = Classify(src);
  if (cudaError_t e = CheckKind(kind, ds, ss); e != cudaSuccess) {
    std::fprintf(stderr,
                 "ciuic CUDA emulation: a copy whose kind %d does not match its "
                 "pointers (dst %p, src %p)\n",
                 static_cast<int>(kind), dst, src);
    return Ret(e);
  }
  CUstream_st* s = nullptr;
  if (cudaError_t e = Resolve(stream, &s); e != cudaSuccess) return Ret(e);
  const size_t dspan = dpitch * (height - 1) + width;
  const size_t sspan = spitch * (height - 1) + width;
  s->Enqueue([=] {
    char* d = CopyAddress(dst, dspan, ds == Side::kDevice);
    const char* from = CopyAddress(src, sspan, ss == Side::kDevice);
    if (d == nullptr || from == nullptr) {
      char what[160];
      std::snprintf(what, sizeof(what),
                    "a copy of %zu x %zu bytes from %p to %p outside memory "
                    "it may touch",
                    height, width, src, dst);
      Fault(what);
      return;
    }
    for (size_t row = 0; row < height; ++row) {
      std::memmove(d + row * dpitch, from + row * spitch, width);
    }
  });
  if (sync || ds == Side::kHostPageable || ss == Side::kHostPageable) s->Drain();
  return cudaSuccess;
}

cudaError_t Memset(void* p, int value, size_t count, cudaStream_t stream, bool sync) {
  if (cudaError_t e = Check(); e != cudaSuccess) return e;
  if (count == 0) return cudaSuccess;
  if (Classify(p) != Side::kDevice) return Ret(cudaErrorInvalidValue);
  CUstream_st* s = nullptr;
  if (cudaError_t e = Resolve(stream, &s); e != cudaSuccess) return Ret(e);
  s->Enqueue([=] {
    char* d = CopyAddress(p, count, true);
    if (d == nullptr) {
      Fault("a memset outside memory it may touch");
      return;
    }
    std::memset(d, value, count);
  });
  if (sync) s->Drain();
  return cudaSuccess;
}

// The inaccessible page after every host alias of device memory.
constexpr size_t kGuardBytes = 4096;

// Maps `fd`, device memory of r->bytes, twice (see the top of the file):
// sets r->mapped, r->lead, r->base and r->alias. The memory ends where its
// mapping does, rounded up to 256 bytes (cudaMalloc's alignment), and a
// guard page follows the alias: a kernel or copy that runs past an
// allocation faults (SIGSEGV) instead of touching other memory.
cudaError_t MapTwice(int fd, Range* r) {
  r->mapped = PageRound(r->bytes);
  r->lead = r->mapped - ((r->bytes + 255) & ~size_t{255});
  void* dev = mmap(nullptr, r->mapped, PROT_NONE, MAP_SHARED, fd, 0);
  if (dev == MAP_FAILED) return cudaErrorMemoryAllocation;
  void* reserve = mmap(nullptr, r->mapped + kGuardBytes, PROT_NONE,
                       MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  void* host = reserve == MAP_FAILED ? MAP_FAILED
                                     : mmap(reserve, r->mapped, PROT_READ | PROT_WRITE,
                                            MAP_SHARED | MAP_FIXED, fd, 0);
  if (host == MAP_FAILED) {
    if (reserve != MAP_FAILED) munmap(reserve, r->mapped + kGuardBytes);
    munmap(dev, r->mapped);
    return cudaErrorMemoryAllocation;
  }
  r->base = reinterpret_cast<uintptr_t>(dev) + r->lead;
  r->alias = static_cast<char*>(host) + r->lead;
  return cudaSuccess;
}

void Unmap(const Range& r) {
  if (r.kind == Kind::kPinned) {
    munmap(reinterpret_cast<void*>(r.base), r.mapped);
    return;
  }
  munmap(reinterpret_cast<void*>(r.base - r.lead), r.mapped);
  munmap(r.alias - r.lead, r.mapped + kGuardBytes);
  if (r.fd >= 0) close(r.fd);
}

cudaError_t Allocate(void** out, size_t size, Kind kind) {
  if (out == nullptr) return Ret(cudaErrorInvalidValue);
  *out = nullptr;
  if (size == 0) return cudaSuccess;
  Range r;
  r.bytes = size;
  r.mapped = PageRound(size);
  r.device = t_device;
  r.kind = kind;
  {
    std::lock_guard<std::mutex> lock(G().mu);
    r.id = G().NewId();
  }
  const std::string name = "ciuic-cuda-mem-" + std::to_string(r.id);
  const int fd = memfd_create(name.c_str(), MFD_CLOEXEC);
  if (fd < 0) return Ret(cudaErrorMemoryAllocation);
  if (ftruncate(fd, static_cast<off_t>(r.mapped)) != 0) {
    close(fd);
    return Ret(cudaErrorMemoryAllocation);
  }
  if (cudaError_t e = MapTwice(fd, &r); e != cudaSuccess) {
    close(fd);
    return Ret(e);
  }
  if (kind == Kind::kDevice) {
    r.fd = fd;  // kept for IPC handles
  } else {
    close(fd);
  }
  std::lock_guard<std::mutex> lock(G().mu);
  G().ranges[r.base] = r;
  *out = reinterpret_cast<void*>(r.base);
  return cudaSuccess;
}

// Removes the range at `p` if it is of one of `kinds`; false otherwise.
bool Release(void* p, std::initializer_list<Kind> kinds) {
  Range r;
  {
    std::lock_guard<std::mutex> lock(G().mu);
    auto it = G().ranges.find(reinterpret_cast<uintptr_t>(p));
    if (it == G().ranges.end()) return false;
    if (std::find(kinds.begin(), kinds.end(), it->second.kind) == kinds.end()) return false;
    r = it->second;
    G().ranges.erase(it);
  }
  Unmap(r);
  return true;
}

void DrainAll(int device) {
  std::vector<CUstream_st*> streams;
  {
    std::lock_guard<std::mutex> lock(G().mu);
    for (CUstream_st* s : G().streams) {
      if (s->device == device) streams.push_back(s);
    }
  }
  // A stream destroyed meanwhile frees itself: wait only while it is live.
  for (CUstream_st* s : streams) {
    while (true) {
      {
        std::lock_guard<std::mutex> lock(G().mu);
        if (G().streams.count(s) == 0) break;
        if (s->Idle()) break;
      }
      std::this_thread::sleep_for(std::chrono::microseconds(20));
    }
  }
}

// Opens /proc/PID/fd/FD if it is the memfd called `name`.
int OpenPeerFd(int pid, int fd, const std::string& name) {
  const std::string path = "/proc/" + std::to_string(pid) + "/fd/" + std::to_string(fd);
  char link[256];
  const ssize_t n = readlink(path.c_str(), link, sizeof(link) - 1);
  if (n <= 0) return -1;
  link[n] = '\0';
  // "/memfd:NAME (deleted)": the name exactly (ids are not prefix-free).
  const std::string want = "/memfd:" + name;
  if (link != want && link != want + " (deleted)") return -1;
  return open(path.c_str(), O_RDWR | O_CLOEXEC);
}

// The driver functions that cudaGetDriverEntryPoint* hand out.
CUresult CUDAAPI EmuMemGetAddressRange(CUdeviceptr* base, size_t* size, CUdeviceptr p) {
  Range r;
  if (!Find(reinterpret_cast<void*>(p), &r) || !IsDeviceRange(r)) return CUDA_ERROR_NOT_FOUND;
  if (base != nullptr) *base = static_cast<CUdeviceptr>(r.base);
  if (size != nullptr) *size = r.bytes;
  return CUDA_SUCCESS;
}

CUresult CUDAAPI EmuPointerGetAttribute(void* data, CUpointer_attribute attr, CUdeviceptr p) {
  Range r;
  if (!Find(reinterpret_cast<void*>(p), &r)) return CUDA_ERROR_INVALID_VALUE;
  if (attr != CU_POINTER_ATTRIBUTE_BUFFER_ID || data == nullptr) return CUDA_ERROR_INVALID_VALUE;
  *static_cast<unsigned long long*>(data) = r.id;
  return CUDA_SUCCESS;
}

CUresult CUDAAPI EmuCtxGetCurrent(CUcontext* ctx) {
  if (ctx == nullptr) return CUDA_ERROR_INVALID_VALUE;
  // One context per device; a thread "has" the one of its current device.
  *ctx = reinterpret_cast<CUcontext>(static_cast<uintptr_t>(0x1000 + t_device));
  return CUDA_SUCCESS;
}

cudaError_t EntryPoint(const char* symbol, void** fn, cudaDriverEntryPointQueryResult* status) {
  if (symbol == nullptr || fn == nullptr) return Ret(cudaErrorInvalidValue);
  const std::string s = symbol;
  *fn = nullptr;
  if (s == "cuMemGetAddressRange") *fn = reinterpret_cast<void*>(&EmuMemGetAddressRange);
  if (s == "cuPointerGetAttribute") *fn = reinterpret_cast<void*>(&EmuPointerGetAttribute);
  if (s == "cuCtxGetCurrent") *fn = reinterpret_cast<void*>(&EmuCtxGetCurrent);
  if (status != nullptr) {
    *status = *fn != nullptr ? cudaDriverEntryPointSuccess : cudaDriverEntryPointSymbolNotFound;
  }
  return cudaSuccess;
}

}  // namespace

cudaError_t Launch(void* stream, std::function<void(int device)> work) {
  if (cudaError_t e = Check(); e != cudaSuccess) return e;
  CUstream_st* s = nullptr;
  if (cudaError_t e = Resolve(static_cast<cudaStream_t>(stream), &s); e != cudaSuccess) {
    return Ret(e);
  }
  const int device = s->device;
  // CIUIC_CUDA_EMULATION_FAULT_AFTER_LAUNCHES=N: the process's kernel
  // launch number N (from 0) faults when it runs, as a kernel touching
  // memory it must not would.
  static const int fault_at = EnvInt("CIUIC_CUDA_EMULATION_FAULT_AFTER_LAUNCHES", -1);
  static std::atomic<int> launches{0};
  if (fault_at >= 0 && launches.fetch_add(1) == fault_at) {
    s->Enqueue([] { Fault("an injected fault (CIUIC_CUDA_EMULATION_FAULT_AFTER_LAUNCHES)"); });
    return cudaSuccess;
  }
  s->Enqueue([device, work = std::move(work)] {
    if (G().sticky.load() != cudaSuccess) return;  // a broken context runs nothing
    work(device);
  });
  return cudaSuccess;
}

void* Access(const void* p, size_t bytes, int device) {
  if (p == nullptr) return nullptr;
  if (bytes == 0) return const_cast<void*>(p);
  std::lock_guard<std::mutex> lock(G().mu);
  const Range* r = FindLocked(p);
  if (r == nullptr) return nullptr;
  const auto a = reinterpret_cast<uintptr_t>(p);
  if (a + bytes > r->base + r->bytes) return nullptr;
  if (r->kind == Kind::kPinned) return const_cast<void*>(p);
  if (!ReachesLocked(*r, device)) return nullptr;
  return r->alias + (a - r->base);
}

namespace simt {

void* TranslateArgument(const void* p, int device, bool* known) {
  *known = false;
  std::lock_guard<std::mutex> lock(G().mu);
  auto& ranges = G().ranges;
  const auto a = reinterpret_cast<uintptr_t>(p);
  auto it = ranges.upper_bound(a);
  if (it == ranges.begin()) return const_cast<void*>(p);
  const Range& r = std::prev(it)->second;
  // A buffer may start where its allocation ends (an empty one).
  if (a > r.base + r.bytes) return const_cast<void*>(p);
  *known = true;
  if (r.kind == Kind::kPinned) return const_cast<void*>(p);
  if (!ReachesLocked(r, device)) return nullptr;
  return r.alias + (a - r.base);
}

bool BadShape(unsigned grid, unsigned block) {
  if (grid != 0 && grid <= 0x7fffffffu && block != 0 && block <= 1024) return false;
  Ret(cudaErrorInvalidConfiguration);
  return true;
}

}  // namespace simt

void Fault(const std::string& what) {
  std::fprintf(stderr, "ciuic CUDA emulation: device fault: %s; the context is broken\n",
               what.c_str());
  G().sticky.store(cudaErrorIllegalAddress);
}

}  // namespace ciuic::cuda_emulation

using namespace ciuic::cuda_emulation;  // NOLINT: the C API below
using ciuic::cuda_emulation::Check;
using ciuic::cuda_emulation::Ret;

extern "C" {

cudaError_t CUDARTAPI cudaGetLastError(void) {
  const int sticky = G().sticky.load();
  cudaError_t e = t_last;
  t_last = cudaSuccess;
  if (sticky != cudaSuccess) return static_cast<cudaError_t>(sticky);
  return e;
}

cudaError_t CUDARTAPI cudaPeekAtLastError(void) {
  const int sticky = G().sticky.load();
  return sticky != cudaSuccess ? static_cast<cudaError_t>(sticky) : t_last;
}

const char* CUDARTAPI cudaGetErrorName(cudaError_t error) {
  switch (error) {
    case cudaSuccess:
      return "cudaSuccess";
    case cudaErrorInvalidValue:
      return "cudaErrorInvalidValue";
    case cudaErrorMemoryAllocation:
      return "cudaErrorMemoryAllocation";
    case cudaErrorNoDevice:
      return "cudaErrorNoDevice";
    case cudaErrorInvalidDevice:
      return "cudaErrorInvalidDevice";
    case cudaErrorInvalidResourceHandle:
      return "cudaErrorInvalidResourceHandle";
    case cudaErrorNotReady:
      return "cudaErrorNotReady";
    case cudaErrorIllegalAddress:
      return "cudaErrorIllegalAddress";
    case cudaErrorAlreadyMapped:
      return "cudaErrorAlreadyMapped";
    case cudaErrorPeerAccessAlreadyEnabled:
      return "cudaErrorPeerAccessAlreadyEnabled";
    case cudaErrorPeerAccessUnsupported:
      return "cudaErrorPeerAccessUnsupported";
    case cudaErrorNotPermitted:
      return "cudaErrorNotPermitted";
    case cudaErrorInvalidMemcpyDirection:
      return "cudaErrorInvalidMemcpyDirection";
    case cudaErrorMapBufferObjectFailed:
      return "cudaErrorMapBufferObjectFailed";
    case cudaErrorDeviceUninitialized:
      return "cudaErrorDeviceUninitialized";
    case cudaErrorNotSupported:
      return "cudaErrorNotSupported";
    default:
      return "cudaErrorUnknown";
  }
}

const char* CUDARTAPI cudaGetErrorString(cudaError_t error) {
  switch (error) {
    case cudaSuccess:
      return "no error";
    case cudaErrorInvalidValue:
      return "invalid argument";
    case cudaErrorMemoryAllocation:
      return "out of memory";
    case cudaErrorNoDevice:
      return "no CUDA-capable device is detected";
    case cudaErrorInvalidDevice:
      return "invalid device ordinal";
    case cudaErrorInvalidResourceHandle:
      return "invalid resource handle";
    case cudaErrorNotReady:
      return "device not ready";
    case cudaErrorIllegalAddress:
      return "an illegal memory access was encountered";
    case cudaErrorAlreadyMapped:
      return "resource already mapped";
    case cudaErrorPeerAccessAlreadyEnabled:
      return "peer access is already enabled";
    case cudaErrorPeerAccessUnsupported:
      return "peer access is not supported between these two devices";
    case cudaErrorNotPermitted:
      return "operation not permitted";
    case cudaErrorInvalidMemcpyDirection:
      return "invalid copy direction for memcpy";
    case cudaErrorMapBufferObjectFailed:
      return "mapping of buffer object failed";
    case cudaErrorDeviceUninitialized:
      return "invalid device context";
    case cudaErrorNotSupported:
      return "operation not supported";
    default:
      return "unknown error (CUDA emulation)";
  }
}

cudaError_t CUDARTAPI cudaGetDeviceCount(int* count) {
  if (count == nullptr) return Ret(cudaErrorInvalidValue);
  *count = G().devices;
  return G().devices == 0 ? Ret(cudaErrorNoDevice) : cudaSuccess;
}

cudaError_t CUDARTAPI cudaDriverGetVersion(int* v) {
  if (v == nullptr) return Ret(cudaErrorInvalidValue);
  *v = CUDART_VERSION;
  return cudaSuccess;
}

cudaError_t CUDARTAPI cudaRuntimeGetVersion(int* v) {
  if (v == nullptr) return Ret(cudaErrorInvalidValue);
  *v = CUDART_VERSION;
  return cudaSuccess;
}

cudaError_t CUDARTAPI cudaGetDeviceProperties(cudaDeviceProp* prop, int device) {
  if (prop == nullptr) return Ret(cudaErrorInvalidValue);
  if (G().devices == 0) return Ret(cudaErrorNoDevice);
  if (device < 0 || device >= G().devices) return Ret(cudaErrorInvalidDevice);
  std::memset(prop, 0, sizeof(*prop));
  std::snprintf(prop->name, sizeof(prop->name), "ciuic CUDA emulation (host memory)");
  prop->totalGlobalMem = size_t{16} << 30;
  prop->major = 9;
  prop->minor = 0;
  prop->multiProcessorCount = 1;
  prop->warpSize = 32;
  prop->pciBusID = device;
  prop->unifiedAddressing = 1;
  return cudaSuccess;
}

cudaError_t CUDARTAPI cudaSetDevice(int device) {
  if (t_in_host_fn) return Check();
  if (G().devices == 0) return Ret(cudaErrorNoDevice);
  if (device < 0 || device >= G().devices) return Ret(cudaErrorInvalidDevice);
  t_device = device;
  return cudaSuccess;
}

cudaError_t CUDARTAPI cudaGetDevice(int* device) {
  if (device == nullptr) return Ret(cudaErrorInvalidValue);
  if (G().devices == 0) return Ret(cudaErrorNoDevice);
  *device = t_device;
  return cudaSuccess;
}

cudaError_t CUDARTAPI cudaDeviceSynchronize(void) {
  if (cudaError_t e = Check(); e != cudaSuccess) return e;
  DrainAll(t_device);
  return Check();
}

cudaError_t CUDARTAPI cudaDeviceCanAccessPeer(int* can, int device, int peer) {
  if (can == nullptr) return Ret(cudaErrorInvalidValue);
  if (G().devices == 0) return Ret(cudaErrorNoDevice);
  if (device < 0 || device >= G().devices || peer < 0 || peer >= G().devices) {
    return Ret(cudaErrorInvalidDevice);
  }
  *can = device != peer && G().peer_capable ? 1 : 0;
  return cudaSuccess;
}

cudaError_t CUDARTAPI cudaDeviceEnablePeerAccess(int peer, unsigned int flags) {
  if (cudaError_t e = Check(); e != cudaSuccess) return e;
  if (flags != 0) return Ret(cudaErrorInvalidValue);
  if (peer < 0 || peer >= G().devices || peer == t_device) return Ret(cudaErrorInvalidDevice);
  if (!G().peer_capable) return Ret(cudaErrorPeerAccessUnsupported);
  std::lock_guard<std::mutex> lock(G().mu);
  if (G().peer_enabled[t_device][peer]) return Ret(cudaErrorPeerAccessAlreadyEnabled);
  G().peer_enabled[t_device][peer] = true;
  return cudaSuccess;
}

cudaError_t CUDARTAPI cudaDeviceGetDefaultMemPool(cudaMemPool_t* pool, int device) {
  if (pool == nullptr) return Ret(cudaErrorInvalidValue);
  if (G().devices == 0) return Ret(cudaErrorNoDevice);
  if (device < 0 || device >= G().devices) return Ret(cudaErrorInvalidDevice);
  *pool = &G().pools[device];
  return cudaSuccess;
}

cudaError_t CUDARTAPI cudaMemPoolSetAttribute(cudaMemPool_t pool, cudaMemPoolAttr, void* value) {
  if (pool == nullptr || value == nullptr) return Ret(cudaErrorInvalidValue);
  return cudaSuccess;  // a pool of the emulation keeps nothing
}

cudaError_t CUDARTAPI cudaGetDriverEntryPoint(const char* symbol, void** fn, unsigned long long,
                                              cudaDriverEntryPointQueryResult* status) {
  return EntryPoint(symbol, fn, status);
}

cudaError_t CUDARTAPI cudaGetDriverEntryPointByVersion(const char* symbol, void** fn, unsigned int,
                                                       unsigned long long,
                                                       cudaDriverEntryPointQueryResult* status) {
  return EntryPoint(symbol, fn, status);
}

cudaError_t CUDARTAPI cudaMalloc(void** p, size_t size) {
  if (cudaError_t e = Check(); e != cudaSuccess) return e;
  return Allocate(p, size, Kind::kDevice);
}

cudaError_t CUDARTAPI cudaFree(void* p) {
  if (t_in_host_fn) return Check();
  if (p == nullptr) return cudaSuccess;
  // cudaFree synchronises the device.
  DrainAll(t_device);
  if (!Release(p, {Kind::kDevice})) return Ret(cudaErrorInvalidValue);
  return cudaSuccess;
}

cudaError_t CUDARTAPI cudaMallocAsync(void** p, size_t size, cudaStream_t stream) {
  if (cudaError_t e = Check(); e != cudaSuccess) return e;
  CUstream_st* s = nullptr;
  if (cudaError_t e = Resolve(stream, &s); e != cudaSuccess) return Ret(e);
  return Allocate(p, size, Kind::kPool);
}

cudaError_t CUDARTAPI cudaFreeAsync(void* p, cudaStream_t stream) {
  if (cudaError_t e = Check(); e != cudaSuccess) return e;
  if (p == nullptr) return cudaSuccess;
  Range r;
  if (!Find(p, &r) || r.kind != Kind::kPool || r.base != reinterpret_cast<uintptr_t>(p)) {
    return Ret(cudaErrorInvalidValue);
  }
  CUstream_st* s = nullptr;
  if (cudaError_t e = Resolve(stream, &s); e != cudaSuccess) return Ret(e);
  s->Enqueue([p] { Release(p, {Kind::kPool}); });
  return cudaSuccess;
}

cudaError_t CUDARTAPI cudaHostAlloc(void** p, size_t size, unsigned int flags) {
  if (cudaError_t e = Check(); e != cudaSuccess) return e;
  if (p == nullptr) return Ret(cudaErrorInvalidValue);
  *p = nullptr;
  if (size == 0) return cudaSuccess;
  Range r;
  r.bytes = size;
  r.mapped = PageRound(size);
  r.kind = Kind::kPinned;
  void* m = mmap(nullptr, r.mapped, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (m == MAP_FAILED) return Ret(cudaErrorMemoryAllocation);
  r.base = reinterpret_cast<uintptr_t>(m);
  r.alias = static_cast<char*>(m);
  std::lock_guard<std::mutex> lock(G().mu);
  r.id = G().NewId();
  G().ranges[r.base] = r;
  *p = m;
  return cudaSuccess;
}

cudaError_t CUDARTAPI cudaMallocHost(void** p, size_t size) { return cudaHostAlloc(p, size, 0); }

cudaError_t CUDARTAPI cudaFreeHost(void* p) {
  if (t_in_host_fn) return Check();
  if (p == nullptr) return cudaSuccess;
  DrainAll(t_device);
  if (!Release(p, {Kind::kPinned})) return Ret(cudaErrorInvalidValue);
  return cudaSuccess;
}

cudaError_t CUDARTAPI cudaPointerGetAttributes(cudaPointerAttributes* a, const void* p) {
  if (cudaError_t e = Check(); e != cudaSuccess) return e;
  if (a == nullptr) return Ret(cudaErrorInvalidValue);
  std::memset(a, 0, sizeof(*a));
  Range r;
  if (!Find(p, &r)) {
    a->type = cudaMemoryTypeUnregistered;
    a->device = -2;
    a->hostPointer = const_cast<void*>(p);
    return cudaSuccess;
  }
  if (r.kind == Kind::kPinned) {
    a->type = cudaMemoryTypeHost;
    a->device = t_device;
    a->hostPointer = const_cast<void*>(p);
    a->devicePointer = const_cast<void*>(p);
    return cudaSuccess;
  }
  a->type = cudaMemoryTypeDevice;
  a->device = r.device;
  a->devicePointer = const_cast<void*>(p);
  return cudaSuccess;
}

cudaError_t CUDARTAPI cudaMemcpy(void* dst, const void* src, size_t count, cudaMemcpyKind kind) {
  return Copy2D(dst, count, src, count, count, 1, kind, nullptr, true);
}

cudaError_t CUDARTAPI cudaMemcpyAsync(void* dst, const void* src, size_t count, cudaMemcpyKind kind,
                                      cudaStream_t stream) {
  return Copy2D(dst, count, src, count, count, 1, kind, stream, false);
}

cudaError_t CUDARTAPI cudaMemcpy2DAsync(void* dst, size_t dpitch, const void* src, size_t spitch,
                                        size_t width, size_t height, cudaMemcpyKind kind,
                                        cudaStream_t stream) {
  return Copy2D(dst, dpitch, src, spitch, width, height, kind, stream, false);
}

cudaError_t CUDARTAPI cudaMemcpyPeerAsync(void* dst, int dst_device, const void* src,
                                          int src_device, size_t count, cudaStream_t stream) {
  if (cudaError_t e = Check(); e != cudaSuccess) return e;
  if (dst_device < 0 || dst_device >= G().devices || src_device < 0 || src_device >= G().devices) {
    return Ret(cudaErrorInvalidDevice);
  }
  if (count == 0) return cudaSuccess;
  Range d, s;
  const auto on = [](const Range& r, int device) {
    return r.kind != Kind::kPinned && (r.device == device || r.opened_on == device);
  };
  if (!Find(dst, &d) || !Find(src, &s) || !on(d, dst_device) || !on(s, src_device)) {
    std::fprintf(stderr,
                 "ciuic CUDA emulation: cudaMemcpyPeerAsync with a pointer that is not "
                 "memory of the device it names\n");
    return Ret(cudaErrorInvalidValue);
  }
  return Copy2D(dst, count, src, count, count, 1, cudaMemcpyDeviceToDevice, stream, false);
}

cudaError_t CUDARTAPI cudaMemset(void* p, int value, size_t count) {
  return Memset(p, value, count, nullptr, true);
}

cudaError_t CUDARTAPI cudaMemsetAsync(void* p, int value, size_t count, cudaStream_t stream) {
  return Memset(p, value, count, stream, false);
}

cudaError_t CUDARTAPI cudaStreamCreateWithFlags(cudaStream_t* stream, unsigned int flags) {
  if (cudaError_t e = Check(); e != cudaSuccess) return e;
  if (stream == nullptr) return Ret(cudaErrorInvalidValue);
  *stream = NewStream(t_device, false);
  return cudaSuccess;
}

cudaError_t CUDARTAPI cudaStreamCreate(cudaStream_t* stream) {
  return cudaStreamCreateWithFlags(stream, cudaStreamDefault);
}

cudaError_t CUDARTAPI cudaStreamDestroy(cudaStream_t stream) {
  if (t_in_host_fn) return Check();
  CUstream_st* s = nullptr;
  if (stream == nullptr) return Ret(cudaErrorInvalidResourceHandle);
  if (cudaError_t e = Resolve(stream, &s); e != cudaSuccess) return Ret(e);
  if (s->is_default) return Ret(cudaErrorInvalidResourceHandle);
  // Its work still runs; then its thread frees it.
  std::lock_guard<std::mutex> lock(s->mu);
  s->destroyed = true;
  s->cv.notify_one();
  return cudaSuccess;
}

cudaError_t CUDARTAPI cudaStreamSynchronize(cudaStream_t stream) {
  if (cudaError_t e = Check(); e != cudaSuccess) return e;
  CUstream_st* s = nullptr;
  if (cudaError_t e = Resolve(stream, &s); e != cudaSuccess) return Ret(e);
  s->Drain();
  return Check();
}

cudaError_t CUDARTAPI cudaStreamQuery(cudaStream_t stream) {
  if (cudaError_t e = Check(); e != cudaSuccess) return e;
  CUstream_st* s = nullptr;
  if (cudaError_t e = Resolve(stream, &s); e != cudaSuccess) return Ret(e);
  return s->Idle() ? cudaSuccess : cudaErrorNotReady;
}

cudaError_t CUDARTAPI cudaLaunchHostFunc(cudaStream_t stream, cudaHostFn_t fn, void* data) {
  if (cudaError_t e = Check(); e != cudaSuccess) return e;
  if (fn == nullptr) return Ret(cudaErrorInvalidValue);
  CUstream_st* s = nullptr;
  if (cudaError_t e = Resolve(stream, &s); e != cudaSuccess) return Ret(e);
  s->Enqueue([fn, data] {
    if (G().sticky.load() != cudaSuccess) return;  // a broken context runs nothing
    t_in_host_fn = true;
    fn(data);
    t_in_host_fn = false;
  });
  return cudaSuccess;
}

cudaError_t CUDARTAPI cudaEventCreateWithFlags(cudaEvent_t* event, unsigned int flags) {
  if (cudaError_t e = Check(); e != cudaSuccess) return e;
  if (event == nullptr) return Ret(cudaErrorInvalidValue);
  auto* ev = new CUevent_st;
  ev->flags = flags;
  ev->device = t_device;
  ev->state = std::make_shared<EventState>();
  if (flags & cudaEventInterprocess) {
    if (!(flags & cudaEventDisableTiming)) {
      delete ev;
      return Ret(cudaErrorInvalidValue);  // as on a GPU
    }
    {
      std::lock_guard<std::mutex> lock(G().mu);
      ev->id = G().NewId();
    }
    const std::string name = "ciuic-cuda-event-" + std::to_string(ev->id);
    const int fd = memfd_create(name.c_str(), MFD_CLOEXEC);
    const size_t bytes = PageRound(sizeof(EventState::Counters));
    void* m = MAP_FAILED;
    if (fd >= 0 && ftruncate(fd, static_cast<off_t>(bytes)) == 0) {
      m = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    }
    if (m == MAP_FAILED) {
      if (fd >= 0) close(fd);
      delete ev;
      return Ret(cudaErrorMemoryAllocation);
    }
    ev->state->counters = new (m) EventState::Counters;
    ev->state->mapped = true;
    ev->state->fd = fd;
  } else {
    ev->state->counters = new EventState::Counters;
  }
  std::lock_guard<std::mutex> lock(G().mu);
  G().events.insert(ev);
  *event = ev;
  return cudaSuccess;
}

cudaError_t CUDARTAPI cudaEventCreate(cudaEvent_t* event) {
  return cudaEventCreateWithFlags(event, cudaEventDefault);
}

namespace {
bool LiveEvent(cudaEvent_t e) {
  std::lock_guard<std::mutex> lock(G().mu);
  return G().events.count(e) != 0;
}
}  // namespace

cudaError_t CUDARTAPI cudaEventDestroy(cudaEvent_t event) {
  if (t_in_host_fn) return Check();
  {
    std::lock_guard<std::mutex> lock(G().mu);
    if (G().events.erase(event) == 0) return Ret(cudaErrorInvalidResourceHandle);
  }
  delete event;  // the state lives on in work that still refers to it
  return cudaSuccess;
}

cudaError_t CUDARTAPI cudaEventRecord(cudaEvent_t event, cudaStream_t stream) {
  if (cudaError_t e = Check(); e != cudaSuccess) return e;
  if (!LiveEvent(event)) return Ret(cudaErrorInvalidResourceHandle);
  CUstream_st* s = nullptr;
  if (cudaError_t e = Resolve(stream, &s); e != cudaSuccess) return Ret(e);
  std::shared_ptr<EventState> st = event->state;
  const uint64_t seq = st->counters->recorded.fetch_add(1) + 1;
  s->Enqueue([st, seq] {
    if (G().sticky.load() != cudaSuccess) return;  // never completes in a broken context
    st->counters->completed_ns.store(std::chrono::steady_clock::now().time_since_epoch() /
                                     std::chrono::nanoseconds(1));
    st->Complete(seq);
  });
  return cudaSuccess;
}

// The milliseconds between the completions of two timing events' latest
// records (host time on the stream threads: nothing to read as GPU speed).
cudaError_t CUDARTAPI cudaEventElapsedTime(float* ms, cudaEvent_t start, cudaEvent_t end) {
  if (cudaError_t e = Check(); e != cudaSuccess) return e;
  if (ms == nullptr) return Ret(cudaErrorInvalidValue);
  if (!LiveEvent(start) || !LiveEvent(end)) return Ret(cudaErrorInvalidResourceHandle);
  if ((start->flags | end->flags) & cudaEventDisableTiming) {
    return Ret(cudaErrorInvalidResourceHandle);  // as on a GPU
  }
  const auto& a = *start->state->counters;
  const auto& b = *end->state->counters;
  if (a.recorded.load() == 0 || b.recorded.load() == 0) return Ret(cudaErrorInvalidResourceHandle);
  if (!start->state->Done() || !end->state->Done()) return cudaErrorNotReady;
  *ms =
      static_cast<float>(static_cast<double>(b.completed_ns.load() - a.completed_ns.load()) / 1e6);
  return cudaSuccess;
}

cudaError_t CUDARTAPI cudaEventQuery(cudaEvent_t event) {
  if (cudaError_t e = Check(); e != cudaSuccess) return e;
  if (!LiveEvent(event)) return Ret(cudaErrorInvalidResourceHandle);
  // cudaErrorNotReady is not kept as the thread's last error.
  return event->state->Done() ? cudaSuccess : cudaErrorNotReady;
}

cudaError_t CUDARTAPI cudaEventSynchronize(cudaEvent_t event) {
  if (cudaError_t e = Check(); e != cudaSuccess) return e;
  if (!LiveEvent(event)) return Ret(cudaErrorInvalidResourceHandle);
  while (!event->state->Done()) {
    if (cudaError_t e = Check(); e != cudaSuccess) return e;
    std::this_thread::sleep_for(std::chrono::microseconds(20));
  }
  return cudaSuccess;
}

cudaError_t CUDARTAPI cudaIpcGetEventHandle(cudaIpcEventHandle_t* handle, cudaEvent_t event) {
  if (cudaError_t e = Check(); e != cudaSuccess) return e;
  if (handle == nullptr) return Ret(cudaErrorInvalidValue);
  if (!LiveEvent(event) || !(event->flags & cudaEventInterprocess) || event->state->fd < 0) {
    return Ret(cudaErrorInvalidResourceHandle);
  }
  EventHandleBytes h{kEventMagic, static_cast<int32_t>(getpid()), event->state->fd, event->device,
                     event->id};
  std::memset(handle, 0, sizeof(*handle));
  std::memcpy(handle, &h, sizeof(h));
  return cudaSuccess;
}

cudaError_t CUDARTAPI cudaIpcOpenEventHandle(cudaEvent_t* event, cudaIpcEventHandle_t handle) {
  if (cudaError_t e = Check(); e != cudaSuccess) return e;
  if (event == nullptr) return Ret(cudaErrorInvalidValue);
  EventHandleBytes h;
  std::memcpy(&h, &handle, sizeof(h));
  if (h.magic != kEventMagic) return Ret(cudaErrorInvalidValue);
  if (h.pid == getpid()) return Ret(cudaErrorDeviceUninitialized);  // not in the exporting process
  const int fd = OpenPeerFd(h.pid, h.fd, "ciuic-cuda-event-" + std::to_string(h.id));
  if (fd < 0) return Ret(cudaErrorInvalidValue);
  const size_t bytes = PageRound(sizeof(EventState::Counters));
  void* m = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (m == MAP_FAILED) {
    close(fd);
    return Ret(cudaErrorMapBufferObjectFailed);
  }
  auto* ev = new CUevent_st;
  ev->flags = cudaEventInterprocess | cudaEventDisableTiming;
  ev->device = h.device;
  ev->id = h.id;
  ev->state = std::make_shared<EventState>();
  ev->state->counters = static_cast<EventState::Counters*>(m);
  ev->state->mapped = true;
  ev->state->fd = fd;
  std::lock_guard<std::mutex> lock(G().mu);
  G().events.insert(ev);
  *event = ev;
  return cudaSuccess;
}

cudaError_t CUDARTAPI cudaIpcGetMemHandle(cudaIpcMemHandle_t* handle, void* p) {
  if (cudaError_t e = Check(); e != cudaSuccess) return e;
  if (handle == nullptr) return Ret(cudaErrorInvalidValue);
  Range r;
  // Only cudaMalloc's memory can be exported (not pool memory, not an
  // opened mapping).
  if (!Find(p, &r) || r.kind != Kind::kDevice) return Ret(cudaErrorInvalidValue);
  MemHandleBytes h{kMemMagic, static_cast<int32_t>(getpid()), r.fd, r.device, r.id, r.bytes,
                   r.base};
  std::memset(handle, 0, sizeof(*handle));
  std::memcpy(handle, &h, sizeof(h));
  return cudaSuccess;
}

cudaError_t CUDARTAPI cudaIpcOpenMemHandle(void** p, cudaIpcMemHandle_t handle,
                                           unsigned int flags) {
  if (cudaError_t e = Check(); e != cudaSuccess) return e;
  if (p == nullptr || flags != cudaIpcMemLazyEnablePeerAccess) return Ret(cudaErrorInvalidValue);
  MemHandleBytes h;
  std::memcpy(&h, &handle, sizeof(h));
  if (h.magic != kMemMagic || h.device < 0 || h.device >= G().devices) {
    return Ret(cudaErrorInvalidValue);
  }
  if (h.pid == getpid()) return Ret(cudaErrorDeviceUninitialized);
  if (t_device != h.device && !G().peer_capable) return Ret(cudaErrorInvalidDevice);
  {
    std::lock_guard<std::mutex> lock(G().mu);
    for (const auto& [base, r] : G().ranges) {
      if (r.kind != Kind::kOpened) continue;
      // One open of a handle per process (CUDA_ERROR_ALREADY_MAPPED); and,
      // as the driver tells the exporter's allocations apart by their
      // addresses there, none of a new allocation whose range overlaps a
      // freed one of the same process that is still open here.
      const bool overlaps = r.peer_pid == h.pid && r.peer_base < h.base + h.bytes &&
                            h.base < r.peer_base + r.bytes;
      if (r.id == h.id || overlaps) return Ret(cudaErrorAlreadyMapped);
    }
  }
  const int fd = OpenPeerFd(h.pid, h.fd, "ciuic-cuda-mem-" + std::to_string(h.id));
  if (fd < 0) return Ret(cudaErrorInvalidValue);
  // The allocation's size is the memory's, not what a (forged) handle says:
  // mapping past the memfd's end would be SIGBUS where a GPU refuses.
  struct stat st {};
  if (fstat(fd, &st) != 0 || h.bytes == 0 || h.bytes > static_cast<uint64_t>(st.st_size)) {
    close(fd);
    return Ret(cudaErrorInvalidValue);
  }
  Range r;
  r.bytes = h.bytes;
  r.mapped = PageRound(h.bytes);
  r.device = h.device;
  r.opened_on = t_device;
  r.kind = Kind::kOpened;
  r.id = h.id;
  r.peer_pid = h.pid;
  r.peer_base = h.base;
  const cudaError_t e = MapTwice(fd, &r);
  close(fd);
  if (e != cudaSuccess) return Ret(cudaErrorMapBufferObjectFailed);
  std::lock_guard<std::mutex> lock(G().mu);
  G().ranges[r.base] = r;
  *p = reinterpret_cast<void*>(r.base);
  return cudaSuccess;
}

cudaError_t CUDARTAPI cudaIpcCloseMemHandle(void* p) {
  if (t_in_host_fn) return Check();
  if (!Release(p, {Kind::kOpened})) return Ret(cudaErrorInvalidValue);
  return cudaSuccess;
}

}  // extern "C"
