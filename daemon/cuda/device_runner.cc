// DeviceRunner with CUDA: see device_runner.h.
#include "cuda/device_runner.h"

#include <cuda.h>  // driver types only; cuMemGetAddressRange comes through the runtime
#include <cuda_runtime_api.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <list>
#include <map>
#include <tuple>
#include <mutex>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "cuda/device_coder.h"
#include "cuda/device_plan.h"
#include "cuda/kernels.h"
#include "cuda/launch.h"
#include "cuda/ready_gate.h"
#include "cuda/runtime.h"

namespace ciuic::daemon {
namespace {

using IpcBytes = std::array<uint8_t, wire::kCudaIpcHandleBytes>;

IpcBytes BytesOf(const uint8_t* p) {
  IpcBytes b;
  std::memcpy(b.data(), p, b.size());
  return b;
}

// Session handles the runner keeps open at most; past that the session's
// handles are closed (after its queued work) and opened again when used.
constexpr size_t kMaxOpenPerSession = 1024;
// Device memory for one job's error feedback residuals (as the host's,
// ClusterJob's ErrorFeedback).
constexpr size_t kResidualBytesPerJob = size_t{256} << 20;

// Single-node operations of at least this many bytes a rank get a host
// function behind their completion event that wakes the completion thread
// (DeviceWaker) when they end. Long ones outlast its 200 us of yielding and
// would otherwise be seen up to a 50 us look (plus the kernel's timer
// slack) late: an allreduce of 1 GiB on two ranks reads and writes 4 GiB,
// about 0.9 ms at an H200's 4.8 TB/s; of 64 MiB on eight, about 0.2 ms.
// Below, the stream does without the host function (which it waits for,
// a few microseconds).
constexpr uint64_t kWakeAfterBytes = uint64_t{64} << 20;

// A blocking FIFO; Pop returns false once Stop() was called and it is empty.
template <typename T>
class Queue {
 public:
  void Push(T v) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      items_.push_back(std::move(v));
    }
    cv_.notify_one();
  }
  // Without waiting: false when empty.
  bool TryPop(T* out) {
    std::lock_guard<std::mutex> lock(mu_);
    if (items_.empty()) return false;
    *out = std::move(items_.front());
    items_.pop_front();
    return true;
  }
  bool Pop(T* out) {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return !items_.empty() || stopped_; });
    if (items_.empty()) return false;
    *out = std::move(items_.front());
    items_.pop_front();
    return true;
  }
  // Waits at most `wait` for an item: false without one (stopped or not).
  bool PopFor(T* out, std::chrono::microseconds wait) {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait_for(lock, wait, [&] { return !items_.empty() || stopped_; });
    if (items_.empty()) return false;
    *out = std::move(items_.front());
    items_.pop_front();
    return true;
  }
  bool stopped() {
    std::lock_guard<std::mutex> lock(mu_);
    return stopped_;
  }
  void Stop() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stopped_ = true;
    }
    cv_.notify_all();
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<T> items_;
  bool stopped_ = false;
};

using MemGetAddressRangeFn = CUresult (*)(CUdeviceptr*, size_t*, CUdeviceptr);

// The single-node operations' completion events, kept for reuse: taken on
// the submit thread, given back by the completion thread once complete
// (an event whose record or query failed is destroyed instead).
class EventPool {
 public:
  EventPool() = default;
  EventPool(const EventPool&) = delete;
  EventPool& operator=(const EventPool&) = delete;
  ~EventPool() {
    for (auto& [device, events] : free_) {
      cudaSetDevice(device);
      for (cudaEvent_t e : events) cudaEventDestroy(e);
    }
  }
  // An event of `device` (the current one), without timing.
  cudaError_t Take(int device, cudaEvent_t* out) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto& events = free_[device];
      if (!events.empty()) {
        *out = events.back();
        events.pop_back();
        return cudaSuccess;
      }
    }
    return cudaEventCreateWithFlags(out, cudaEventDisableTiming);
  }
  void Give(int device, cudaEvent_t e) {
    std::lock_guard<std::mutex> lock(mu_);
    free_[device].push_back(e);
  }

 private:
  std::mutex mu_;
  std::map<int, std::vector<cudaEvent_t>> free_;
};

// Pinned host buffers for staging, allocated once and reused: a released
// buffer goes back here (from any thread) and serves a later request of at
// most its size and at least half of it, unless the pool already keeps
// kKeepBytes. Freed when the pool goes (after the runner, as the buffers
// handed out keep it alive).
class PinnedPool : public std::enable_shared_from_this<PinnedPool> {
 public:
  ~PinnedPool() {
    for (auto& [bytes, p] : free_) cudaFreeHost(p);
  }

  // Pinned bytes allocated and not freed: handed out or kept. Any thread.
  uint64_t allocated_bytes() const { return allocated_.load(std::memory_order_relaxed); }

  // A buffer of at least `bytes` (> 0) bytes at *data, held by the result.
  absl::StatusOr<std::shared_ptr<void>> Take(uint64_t bytes, uint8_t** data) {
    constexpr uint64_t kGranule = 2 << 20;
    uint8_t* p = nullptr;
    uint64_t size = 0;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = free_.lower_bound(bytes);
      if (it != free_.end() && it->first <= std::max<uint64_t>(2 * bytes, kGranule)) {
        size = it->first;
        p = it->second;
        free_.erase(it);
        kept_ -= size;
      }
    }
    if (p == nullptr) {
      size = (bytes + kGranule - 1) / kGranule * kGranule;
      void* v = nullptr;
      cudaError_t e = cudaHostAlloc(&v, size, cudaHostAllocPortable);
      if (e != cudaSuccess) {
        return Cuda(e, absl::StrCat("cudaHostAlloc of ", size, " bytes (staging)"));
      }
      p = static_cast<uint8_t*>(v);
      allocated_ += size;
    }
    *data = p;
    std::shared_ptr<PinnedPool> self = shared_from_this();
    return std::shared_ptr<void>(p, [self, size](void* q) {
      {
        std::lock_guard<std::mutex> lock(self->mu_);
        if (self->kept_ + size <= kKeepBytes) {
          self->free_.emplace(size, static_cast<uint8_t*>(q));
          self->kept_ += size;
          return;
        }
      }
      // Beyond what the pool keeps (a large alltoall's slots): back to the
      // system.
      cudaFreeHost(q);
      cudaGetLastError();
      self->allocated_ -= size;
    });
  }

 private:
  // Pinned memory kept for reuse at most (every segment's slots fit many
  // times over; whole alltoall slots may not).
  static constexpr uint64_t kKeepBytes = uint64_t{1} << 30;
  std::mutex mu_;
  std::multimap<uint64_t, uint8_t*> free_;  // by size
  uint64_t kept_ = 0;  // the sizes in free_
  std::atomic<uint64_t> allocated_{0};
};

// The trainers' allocations mapped now (MemoryUse), counted by the
// mappings themselves: a mapping may outlive the runner in a staged buffer.
struct MappedCounters {
  std::atomic<uint64_t> allocations{0};
  std::atomic<uint64_t> bytes{0};
};

// One opened IPC memory handle, closed (on the device it was opened on)
// when the last holder lets go: the session caches that hold it and every
// operation queued on it. CUDA opens a handle once per (importing) process
// and device (a second open is cudaErrorAlreadyMapped), so every session
// that names a handle shares ciuicd's one mapping of it (the runner's
// `mappings_`): the two communicators of a trainer process, say a
// data-parallel and a tensor-parallel group, whose tensors PyTorch's
// allocator carves from the same segments. A trainer that frees an
// allocation and gets its address back in a new one makes the daemon open
// a new handle for a range it may still have mapped
// (cudaErrorAlreadyMapped): the mappings no operation holds are then
// dropped from every session's cache and the open tried again.
struct Mapping {
  uint8_t* base = nullptr;  // the trainer's allocation, in this process
  uint64_t bytes = 0;       // its size
  void* opened = nullptr;   // what cudaIpcOpenMemHandle returned
  int device = 0;           // current when it was opened
  // The runner's counters, once the mapping has passed its checks and is
  // counted in them (until it closes).
  std::shared_ptr<MappedCounters> counted;
  Mapping() = default;
  Mapping(const Mapping&) = delete;
  Mapping& operator=(const Mapping&) = delete;
  ~Mapping() {
    if (counted) {
      counted->allocations -= 1;
      counted->bytes -= bytes;
    }
    int current = 0;
    const bool known = cudaGetDevice(&current) == cudaSuccess;
    cudaSetDevice(device);
    cudaIpcCloseMemHandle(opened);
    if (known) cudaSetDevice(current);
    cudaGetLastError();
  }
};

using Holds = std::vector<std::shared_ptr<void>>;

// One session's opened handles. The events go when the last holder lets go
// (the runner until the session ends or its cache is full, the staged
// buffers and the operations queued before the session ended).
struct SessionHandles {
  // By handle and the device it was opened on (the operation's, or the
  // buffer's own where that one cannot reach it): CUDA allows one open of
  // a handle per device.
  std::map<std::pair<IpcBytes, int>, std::shared_ptr<Mapping>> memory;
  std::map<IpcBytes, cudaEvent_t> events;
  uint32_t uid = 0;  // the session's (set at its first buffer)
  SessionHandles() = default;
  SessionHandles(const SessionHandles&) = delete;
  SessionHandles& operator=(const SessionHandles&) = delete;
  ~SessionHandles() {
    memory.clear();
    for (auto& [key, ev] : events) cudaEventDestroy(ev);
    cudaGetLastError();
  }
};

// A multi-node allreduce's node buffer on the GPU (staged_buffer.h): rank
// 0's receive buffer, on its device, with a stream of its own.
class CudaStagedBuffer final : public StagedNodeBuffer {
 public:
  struct Parts {
    int device = 0;
    cudaStream_t stream = nullptr;  // owned from here on
    wire::DataType dtype{};
    size_t count = 0;                 // elements of the node buffer
    uint8_t* node = nullptr;          // the node buffer
    bool owns_node = false;           // allocated on `stream` (reduce_scatter)
    std::vector<const void*> inputs;  // the ranks' send buffers
    // Allgather, broadcast: where in the node buffer each input goes.
    std::vector<size_t> input_offsets;
    size_t input_bytes = 0;
    std::vector<uint8_t*> outputs;       // every rank's receive buffer
    std::vector<size_t> output_offsets;  // where in the node buffer each output's bytes are
    size_t output_bytes = 0;
    // Alltoallv: each input's and output's own size (then the two above
    // are unused).
    std::vector<size_t> input_sizes;
    std::vector<size_t> output_sizes;
    // Ranks' buffers far from `device` (no peer access): mirrored in
    // `scratch` (allocated on `stream`), copied in by CopyIn and the
    // receive buffers back by Finish.
    Mirrors mirrors;
    uint8_t* scratch = nullptr;
    Holds holds;  // the ranks' mappings and sessions (their events)
    std::shared_ptr<DeviceResiduals> residuals;  // the job's error feedback
  };
  CudaStagedBuffer(Parts parts, std::shared_ptr<PinnedPool> pool)
      : p_(std::move(parts)), pool_(std::move(pool)) {}
  ~CudaStagedBuffer() override {
    if (p_.stream == nullptr) return;
    Drain().IgnoreError();
    cudaSetDevice(p_.device);
    for (cudaEvent_t e : events_) {
      if (e != nullptr) cudaEventDestroy(e);
    }
    if (p_.owns_node) cudaFreeAsync(p_.node, p_.stream);
    if (p_.scratch != nullptr) cudaFreeAsync(p_.scratch, p_.stream);
    cudaStreamDestroy(p_.stream);
    cudaGetLastError();
    // Then the pinned slots go back to the pool and the handles may close.
  }

  // The far buffers into their mirrors: once the ranks' streams have
  // reached the submission, before anything else of the operation.
  absl::Status CopyIn() {
    if (p_.mirrors.in.empty()) return absl::OkStatus();
    if (absl::Status s = Current(); !s.ok()) return s;
    return CopyBetweenDevices(p_.mirrors.in);
  }

  absl::Status ReduceLocal(wire::ReduceOp op) override {
    if (p_.count == 0) return absl::OkStatus();
    if (p_.inputs.size() == 1 && p_.inputs[0] == p_.node) return absl::OkStatus();
    if (absl::Status s = Current(); !s.ok()) return s;
    return gpu::DeviceReduce(p_.dtype, op, p_.inputs.data(), static_cast<int>(p_.inputs.size()),
                             p_.node, p_.count, p_.stream);
  }
  absl::Status PlaceInputs() override {
    // Reducing collectives have inputs, but no places for them.
    if (p_.stream == nullptr || (p_.input_bytes == 0 && p_.input_sizes.empty())) {
      return absl::OkStatus();
    }
    if (absl::Status s = Current(); !s.ok()) return s;
    for (size_t i = 0; i < p_.inputs.size(); ++i) {
      uint8_t* to = p_.node + p_.input_offsets[i];
      const size_t bytes = p_.input_sizes.empty() ? p_.input_bytes : p_.input_sizes[i];
      if (p_.inputs[i] == to || bytes == 0) continue;  // in place, or nothing
      absl::Status s = Cuda(
          cudaMemcpyAsync(to, p_.inputs[i], bytes, cudaMemcpyDeviceToDevice, p_.stream),
          "cudaMemcpyAsync device to device (inputs to the node buffer)");
      if (!s.ok()) return s;
    }
    return absl::OkStatus();
  }
  absl::StatusOr<uint8_t*> Slot(int slot, size_t bytes) override {
    if (slot < 0 || slot > 1) return absl::InternalError("staging slot out of range");
    if (slot_bytes_[slot] < bytes) {
      // On a lane's thread: the buffer's device, not a context on GPU 0.
      if (absl::Status s = Current(); !s.ok()) return s;
      // A smaller slot goes back to the pool only once no copy uses it.
      if (absl::Status s = Wait(slot); !s.ok()) return s;
      uint8_t* data = nullptr;
      auto memory = pool_->Take(bytes, &data);
      if (!memory.ok()) return memory.status();
      slot_memory_[slot] = std::move(*memory);
      slot_[slot] = data;
      slot_bytes_[slot] = bytes;
    }
    return slot_[slot];
  }
  absl::Status Fetch(int slot, size_t slot_offset, size_t offset, size_t bytes) override {
    if (absl::Status s = Check(slot, slot_offset, offset, bytes); !s.ok()) return s;
    absl::Status s = Cuda(cudaMemcpyAsync(slot_[slot] + slot_offset, p_.node + offset, bytes,
                                          cudaMemcpyDeviceToHost, p_.stream),
                          "cudaMemcpyAsync device to host (staging)");
    return s.ok() ? Record(slot) : s;
  }
  absl::Status Store(int slot, size_t slot_offset, size_t offset, size_t bytes) override {
    if (absl::Status s = Check(slot, slot_offset, offset, bytes); !s.ok()) return s;
    absl::Status s = Cuda(cudaMemcpyAsync(p_.node + offset, slot_[slot] + slot_offset, bytes,
                                          cudaMemcpyHostToDevice, p_.stream),
                          "cudaMemcpyAsync host to device (staging)");
    return s.ok() ? Record(slot) : s;
  }
  // One 2-D copy, unless the pitch is beyond what one may have (devices
  // report about 2^31: memPitch); then a copy per row.
  absl::Status FetchRows(int slot, size_t slot_offset, size_t offset, size_t bytes, size_t pitch,
                         size_t rows) override {
    if (pitch > kMaxPitch) {
      return StagedNodeBuffer::FetchRows(slot, slot_offset, offset, bytes, pitch, rows);
    }
    return Rows(slot, slot_offset, offset, bytes, pitch, rows, cudaMemcpyDeviceToHost);
  }
  absl::Status StoreRows(int slot, size_t slot_offset, size_t offset, size_t bytes, size_t pitch,
                         size_t rows) override {
    if (pitch > kMaxPitch) {
      return StagedNodeBuffer::StoreRows(slot, slot_offset, offset, bytes, pitch, rows);
    }
    return Rows(slot, slot_offset, offset, bytes, pitch, rows, cudaMemcpyHostToDevice);
  }
  absl::Status Wait(int slot) override {
    if (slot < 0 || slot > 1 || events_[slot] == nullptr) return absl::OkStatus();
    if (absl::Status s = Current(); !s.ok()) return s;
    return WaitForEvent(events_[slot], "staging copy");
  }
  absl::Status Finish() override {
    if (p_.stream == nullptr) return absl::OkStatus();
    if (absl::Status s = Current(); !s.ok()) return s;
    for (size_t r = 0; r < p_.outputs.size(); ++r) {
      const uint8_t* from = p_.node + p_.output_offsets[r];
      const size_t bytes = p_.output_sizes.empty() ? p_.output_bytes : p_.output_sizes[r];
      if (p_.outputs[r] == from || bytes == 0) continue;
      absl::Status s = Cuda(cudaMemcpyAsync(p_.outputs[r], from, bytes,
                                            cudaMemcpyDeviceToDevice, p_.stream),
                            "cudaMemcpyAsync device to device (result to the ranks)");
      if (!s.ok()) return s;
    }
    if (absl::Status s = CopyBetweenDevices(p_.mirrors.out); !s.ok()) return s;
    return Drain();
  }
  absl::Status Drain() override {
    if (p_.stream == nullptr) return absl::OkStatus();
    if (absl::Status s = Current(); !s.ok()) return s;
    absl::Status s = WaitForStream(p_.stream, &events_[2], "the operation's device work");
    if (!s.ok()) cudaStreamSynchronize(p_.stream);
    return s;
  }
  absl::StatusOr<std::unique_ptr<ChunkCoder>> Coder(const std::string& spec,
                                                    const std::string& feedback_name) override {
    if (p_.stream == nullptr) return nullptr;  // count 0: nothing to encode
    if (absl::Status s = Current(); !s.ok()) return s;
    return MakeDeviceCoder(
        spec, p_.dtype, p_.count, p_.device, p_.stream, p_.residuals, feedback_name,
        [pool = pool_](uint64_t bytes, uint8_t** data) { return pool->Take(bytes, data); });
  }
  ErrorFeedback::Stats FeedbackStats() const override {
    return p_.residuals != nullptr ? p_.residuals->GetStats() : ErrorFeedback::Stats{};
  }
  void* data() override { return p_.node; }
  absl::Status Divide(int divisor) override {
    if (p_.stream == nullptr) return absl::OkStatus();
    if (absl::Status s = Current(); !s.ok()) return s;
    return gpu::DeviceDivide(p_.dtype, p_.node, p_.count, divisor, p_.stream);
  }

 private:
  absl::Status Current() {
    return Cuda(cudaSetDevice(p_.device), absl::StrCat("cudaSetDevice(", p_.device, ")"));
  }
  absl::Status CopyBetweenDevices(const std::vector<DeviceStep>& copies) {
    for (const DeviceStep& c : copies) {
      absl::Status s =
          Cuda(cudaMemcpyPeerAsync(c.to, c.to_device, c.from, c.from_device, c.bytes, p_.stream),
               absl::StrCat("cudaMemcpyPeerAsync from device ", c.from_device, " to device ",
                            c.to_device, " (a buffer mirrored)"));
      if (!s.ok()) return s;
    }
    return absl::OkStatus();
  }
  absl::Status Check(int slot, size_t slot_offset, size_t offset, size_t bytes) {
    const size_t total = p_.count * wire::DataTypeSize(static_cast<uint32_t>(p_.dtype));
    if (slot < 0 || slot > 1 || slot_offset > slot_bytes_[slot] ||
        bytes > slot_bytes_[slot] - slot_offset || offset > total || bytes > total - offset) {
      return absl::InternalError(absl::StrCat("staging copy of ", bytes, " bytes at ", offset,
                                              " outside the buffer or the slot"));
    }
    return Current();
  }
  // FetchRows / StoreRows: one cudaMemcpy2DAsync, rows back to back in the
  // slot and `pitch` apart in the node buffer.
  absl::Status Rows(int slot, size_t slot_offset, size_t offset, size_t bytes, size_t pitch,
                    size_t rows, cudaMemcpyKind kind) {
    if (rows == 0 || bytes == 0) return absl::OkStatus();
    const size_t total = p_.count * wire::DataTypeSize(static_cast<uint32_t>(p_.dtype));
    const size_t span = pitch * (rows - 1) + bytes;  // of the node buffer
    if (slot < 0 || slot > 1 || pitch < bytes || (rows > 1 && pitch > total / (rows - 1)) ||
        slot_offset > slot_bytes_[slot] || rows > (slot_bytes_[slot] - slot_offset) / bytes ||
        offset > total || span > total - offset) {
      return absl::InternalError(absl::StrCat("staging copy of ", rows, " rows of ", bytes,
                                              " bytes ", pitch, " apart at ", offset,
                                              " outside the buffer or the slot"));
    }
    if (absl::Status s = Current(); !s.ok()) return s;
    uint8_t* host = slot_[slot] + slot_offset;
    uint8_t* node = p_.node + offset;
    const bool down = kind == cudaMemcpyDeviceToHost;
    absl::Status s = Cuda(cudaMemcpy2DAsync(down ? host : node, down ? bytes : pitch,
                                            down ? node : host, down ? pitch : bytes, bytes, rows,
                                            kind, p_.stream),
                          down ? "cudaMemcpy2DAsync device to host (staging)"
                               : "cudaMemcpy2DAsync host to device (staging)");
    return s.ok() ? Record(slot) : s;
  }
  // Records events_[which] (0, 1: the slots; 2 is Drain's).
  absl::Status Record(int which) {
    if (events_[which] == nullptr) {
      absl::Status s = Cuda(cudaEventCreateWithFlags(&events_[which], cudaEventDisableTiming),
                            "cudaEventCreateWithFlags");
      if (!s.ok()) {
        events_[which] = nullptr;
        return s;
      }
    }
    return Cuda(cudaEventRecord(events_[which], p_.stream), "cudaEventRecord");
  }

  static constexpr size_t kMaxPitch = (size_t{1} << 31) - 1;
  Parts p_;
  const std::shared_ptr<PinnedPool> pool_;
  uint8_t* slot_[2] = {nullptr, nullptr};
  size_t slot_bytes_[2] = {0, 0};
  std::shared_ptr<void> slot_memory_[2];
  cudaEvent_t events_[3] = {nullptr, nullptr, nullptr};
};

class CudaDeviceRunner final : public DeviceRunner {
 public:
  explicit CudaDeviceRunner(MemGetAddressRangeFn mem_get_address_range)
      : mem_get_address_range_(mem_get_address_range) {
    submit_thread_ = std::thread([this] { SubmitLoop(); });
    completion_thread_ = std::thread([this] { CompletionLoop(); });
  }

  ~CudaDeviceRunner() override {
    tasks_.Stop();
    submit_thread_.join();  // runs what was queued
    completions_.Stop();
    completion_thread_.join();  // every `done` called
    // Both threads are gone: their state is this thread's now. Every
    // operation has let go of its handles; the staged buffers still alive
    // keep theirs.
    sessions_.clear();
    for (auto& [key, stream] : streams_) {
      cudaSetDevice(key.second);
      cudaStreamDestroy(stream);
    }
  }

  void Run(const OpSignature& sig, std::vector<DeviceRankBuffers> ranks, const std::string& job,
           Clock::time_point deadline, std::function<void(absl::Status)> done) override {
    tasks_.Push(
        [this, sig, ranks = std::move(ranks), job, deadline, done = std::move(done)]() mutable {
          RunOnSubmit(sig, ranks, job, deadline, std::move(done));
        });
  }

  void Stage(const OpSignature& sig, int world, std::vector<DeviceRankBuffers> ranks,
             const std::string& job, Clock::time_point deadline,
             std::function<void(absl::StatusOr<std::shared_ptr<StagedNodeBuffer>>)> done) override {
    tasks_.Push([this, sig, world, ranks = std::move(ranks), job, deadline,
                 done = std::move(done)]() mutable {
      StageOnSubmit(sig, world, ranks, job, deadline, std::move(done));
    });
  }

  void FailJob(const std::string& job, const absl::Status& why) override {
    tasks_.Push([this, job, why] { gate_.FailLane(job, why); });
  }

  void EndJob(const std::string& job) override {
    tasks_.Push([this, job] {
      gate_.FailLane(job, absl::AbortedError("its job ended while the operation waited for its "
                                             "ranks' streams; nothing of it ran"));
      residuals_.erase(job);
      // Its streams go once their queued work is done (cudaStreamDestroy
      // does not wait).
      for (auto it = streams_.begin(); it != streams_.end();) {
        if (it->first.first == job) {
          cudaSetDevice(it->first.second);
          cudaStreamDestroy(it->second);
          it = streams_.erase(it);
        } else {
          ++it;
        }
      }
      cudaGetLastError();
    });
  }

  void Dispose(std::shared_ptr<StagedNodeBuffer> buffer) override {
    tasks_.Push([buffer = std::move(buffer)]() mutable { buffer.reset(); });
  }

  DeviceMemoryUse MemoryUse() const override {
    DeviceMemoryUse use;
    use.mapped_allocations = mapped_->allocations.load(std::memory_order_relaxed);
    use.mapped_bytes = mapped_->bytes.load(std::memory_order_relaxed);
    use.pinned_bytes = pool_->allocated_bytes();
    return use;
  }

  void CloseSession(uint64_t session_id) override {
    tasks_.Push([this, session_id] {
      gate_.FailSession(session_id,
                        absl::AbortedError("a rank's session ended while the operation waited for "
                                           "its ranks' streams; nothing of it ran"));
      CloseSessionOnSubmit(session_id);
    });
  }

 private:
  // An operation handed to the completion thread: `event` (recorded after
  // its work on `device`; null: none), then `status` if it is an error (the
  // operation failed, after what it had enqueued).
  struct Completion {
    cudaEvent_t event = nullptr;
    int device = 0;
    absl::Status status;
    std::function<void(absl::Status)> done;  // may be null
    Holds holds;  // let go once the event has completed
  };

  // Runs the tasks in order and, while the gate holds operations, polls it
  // between them: yielding a while after progress, then waiting for a task
  // in short steps.
  void SubmitLoop() {
    std::function<void()> task;
    auto progress = std::chrono::steady_clock::now();
    while (true) {
      if (gate_.held() == 0) {
        if (!tasks_.Pop(&task)) break;  // stopped, and nothing queued
        task();
        progress = std::chrono::steady_clock::now();
      }
      while (tasks_.TryPop(&task)) task();
      if (gate_.held() == 0) continue;
      const size_t before = gate_.held();
      const auto now = std::chrono::steady_clock::now();
      if (gate_.Poll(now) < before) progress = now;
      if (gate_.held() == 0) continue;
      if (tasks_.stopped()) break;
      if (now - progress < std::chrono::microseconds(200)) {
        std::this_thread::yield();
      } else if (tasks_.PopFor(&task, std::chrono::microseconds(50))) {
        task();
        progress = std::chrono::steady_clock::now();
      }
    }
    while (tasks_.TryPop(&task)) task();
    gate_.FailAll(absl::UnavailableError(
        "ciuicd is shutting down: the operation was still waiting for its ranks' streams; "
        "nothing of it ran"));
  }

  // Polls every pending operation's event, and completes each as soon as
  // its own is done: a job whose trainer's stream is slow (or stuck) holds
  // up only its own operations (each job has its own streams).
  void CompletionLoop() {
    std::list<Completion> pending;
    auto progress = std::chrono::steady_clock::now();
    while (true) {
      const uint64_t seen = completion_waker_->generation();
      Completion c;
      if (pending.empty()) {
        if (!completions_.Pop(&c)) return;  // stopped, and nothing pending
        pending.push_back(std::move(c));
        progress = std::chrono::steady_clock::now();
      }
      while (completions_.TryPop(&c)) pending.push_back(std::move(c));
      for (auto it = pending.begin(); it != pending.end();) {
        absl::Status s;
        if (it->event != nullptr) {
          cudaSetDevice(it->device);
          const cudaError_t e = cudaEventQuery(it->event);
          if (e == cudaErrorNotReady) {
            cudaGetLastError();  // not an error (see WaitForEvent)
            ++it;
            continue;
          }
          s = Cuda(e, "the operation's device work");
          if (e == cudaSuccess) {
            completion_events_.Give(it->device, it->event);
          } else {
            cudaEventDestroy(it->event);
          }
        }
        if (!it->status.ok()) s = it->status;
        it->holds.clear();  // before the ranks hear (they may free their buffers then)
        if (it->done) it->done(s);
        it = pending.erase(it);
        progress = std::chrono::steady_clock::now();
      }
      if (pending.empty()) continue;
      // Small operations end within microseconds: yield a while; then wait
      // for a large one's host function (Launch) or a new completion to
      // wake the loop, looking again every 50 us at most (operations too
      // small for a host function, failed ones, a broken context).
      if (std::chrono::steady_clock::now() - progress < std::chrono::microseconds(200)) {
        std::this_thread::yield();
      } else {
        completion_waker_->WaitFor(seen, std::chrono::microseconds(50));
      }
    }
  }

  // A single-node operation, opened and planned, held in the gate until
  // its ranks' streams have reached it.
  struct PreparedRun {
    OpSignature sig;
    int device = 0;
    cudaStream_t stream = nullptr;  // null: nothing to do
    std::vector<DeviceStep> steps;
    // Buffers far from `device` (no peer access): mirrored in `scratch`
    // (allocated on `stream`, freed there after the work or when the
    // operation does not run).
    Mirrors mirrors;
    uint8_t* scratch = nullptr;
    Holds holds;  // the ranks' mappings and sessions (their events)
    PreparedRun() = default;
    PreparedRun(const PreparedRun&) = delete;
    PreparedRun& operator=(const PreparedRun&) = delete;
    ~PreparedRun() { FreeScratch(); }  // every path frees it already
    void FreeScratch() {
      if (scratch == nullptr) return;
      cudaSetDevice(device);
      cudaFreeAsync(scratch, stream);
      cudaGetLastError();
      scratch = nullptr;
    }
  };

  void RunOnSubmit(const OpSignature& sig, const std::vector<DeviceRankBuffers>& ranks,
                   const std::string& job, Clock::time_point deadline,
                   std::function<void(absl::Status)> done) {
    auto run = std::make_shared<PreparedRun>();
    run->sig = sig;
    std::vector<ReadyGate::Wait> waits;
    absl::Status s = Prepare(ranks, job, run.get(), &waits);
    if (!s.ok()) {
      run->FreeScratch();
      // Nothing enqueued: no event to wait for.
      Completion c;
      c.status = s;
      c.done = std::move(done);
      c.holds = std::move(run->holds);
      PushCompletion(std::move(c));
      return;
    }
    ReadyGate::Entry e;
    e.lane = job;
    e.waits = std::move(waits);
    for (const DeviceRankBuffers& b : ranks) e.sessions.push_back(b.session_id);
    e.deadline = deadline;
    e.pass = [this, run, done = std::move(done)](absl::Status ready) mutable {
      Completion c;
      c.done = std::move(done);
      if (ready.ok()) {
        if (run->stream != nullptr) Launch(*run, &c);  // else it moves nothing
      } else {
        run->FreeScratch();
        c.status = ready;
      }
      c.holds = std::move(run->holds);
      PushCompletion(std::move(c));
    };
    gate_.Add(std::move(e));
    gate_.Poll(Clock::now());  // streams already there: at once
  }

  void PushCompletion(Completion c) {
    completions_.Push(std::move(c));
    completion_waker_->Wake();
  }

  // Enqueues `run`'s steps and the event that ends it (c->event). On a
  // failure, c->status; whatever was enqueued must be over before the ranks
  // hear of it (they may reuse their buffers then): the completion thread
  // then waits for a fresh event behind it.
  void Launch(PreparedRun& run, Completion* c) {
    c->device = run.device;
    absl::Status s =
        Cuda(cudaSetDevice(run.device), absl::StrCat("cudaSetDevice(", run.device, ")"));
    if (s.ok()) s = Steps(run.sig, run.mirrors.in, run.stream);
    if (s.ok()) s = Steps(run.sig, run.steps, run.stream);
    if (s.ok()) s = Steps(run.sig, run.mirrors.out, run.stream);
    run.FreeScratch();  // after the work, on its stream
    if (s.ok()) s = Finish(run.device, run.stream, &c->event);
    if (s.ok()) {
      // Work long enough to outlast the completion thread's yielding wakes
      // it when it ends (small operations' streams do without the host
      // function, which the stream waits for).
      if (run.sig.count * run.sig.element_bytes() >= kWakeAfterBytes) {
        WakeWhenReached(completion_waker_, run.stream);
      }
      return;
    }
    if (c->event != nullptr) cudaEventDestroy(c->event);
    c->event = nullptr;
    c->status = s;
    if (Finish(run.device, run.stream, &c->event).ok()) return;  // c->event is recorded
    if (c->event != nullptr) cudaEventDestroy(c->event);
    c->event = nullptr;
    cudaStreamSynchronize(run.stream);
    cudaGetLastError();
  }

  // Enqueues `steps` of an operation `sig` on `stream` (current).
  static absl::Status Steps(const OpSignature& sig, const std::vector<DeviceStep>& steps,
                            cudaStream_t stream) {
    const auto dtype = static_cast<wire::DataType>(sig.dtype);
    const auto op = static_cast<wire::ReduceOp>(sig.reduce_op);
    for (const DeviceStep& step : steps) {
      absl::Status s;
      std::vector<const void*> inputs(step.inputs.begin(), step.inputs.end());
      std::vector<void*> outputs(step.outputs.begin(), step.outputs.end());
      switch (step.kind) {
        case DeviceStep::Kind::kReduceToAll:
          s = gpu::DeviceReduceToAll(dtype, op, inputs.data(), static_cast<int>(inputs.size()),
                                     outputs.data(), static_cast<int>(outputs.size()), sig.count,
                                     stream);
          break;
        case DeviceStep::Kind::kReduce:
          s = gpu::DeviceReduce(dtype, op, inputs.data(), static_cast<int>(inputs.size()),
                                outputs[0], sig.count, stream);
          break;
        case DeviceStep::Kind::kCopy:
          s = Cuda(
              cudaMemcpyAsync(step.to, step.from, step.bytes, cudaMemcpyDeviceToDevice, stream),
              "cudaMemcpyAsync device to device");
          break;
        case DeviceStep::Kind::kPeerCopy:
          s = Cuda(cudaMemcpyPeerAsync(step.to, step.to_device, step.from, step.from_device,
                                       step.bytes, stream),
                   absl::StrCat("cudaMemcpyPeerAsync from device ", step.from_device, " to device ",
                                step.to_device, " (a buffer mirrored)"));
          break;
      }
      if (!s.ok()) return s;
    }
    return absl::OkStatus();
  }

  // Opens the ranks' buffers and events (the waits for their streams) and
  // plans the operation into *run; enqueues nothing. run->stream stays null
  // for an operation that moves nothing.
  absl::Status Prepare(const std::vector<DeviceRankBuffers>& ranks, const std::string& job,
                       PreparedRun* run, std::vector<ReadyGate::Wait>* waits) {
    const OpSignature& sig = run->sig;
    const int world = static_cast<int>(ranks.size());
    const bool v_splits = sig.collective == static_cast<uint32_t>(wire::Collective::kAlltoallv);
    bool empty = sig.count == 0;
    if (v_splits) {
      empty = true;
      for (const DeviceRankBuffers& b : ranks) empty = empty && b.send_bytes == 0;
    }
    if (empty) return absl::OkStatus();  // nothing to read or write
    if (absl::Status s = Begin(ranks, &run->device); !s.ok()) return s;
    const int device = run->device;
    auto stream = StreamFor(device, job);
    if (!stream.ok()) return stream.status();

    std::vector<uint8_t*> send(world, nullptr);
    std::vector<uint8_t*> recv(world, nullptr);
    std::vector<bool> send_far(world, false), recv_far(world, false);
    for (int r = 0; r < world; ++r) {
      const DeviceRankBuffers& b = ranks[r];
      if (b.recv_bytes == 0 && !v_splits) {
        return absl::InternalError(absl::StrCat("rank ", r, " has no receive buffer"));
      }
      bool far = false;
      if (b.send_bytes > 0) {
        auto p =
            OpenBuffer(b.session_id, b.uid, b.send, b.send_bytes, device, r, "send", &run->holds, &far);
        if (!p.ok()) return p.status();
        send[r] = *p;
        send_far[r] = far;
      }
      if (b.recv_bytes > 0) {  // alltoallv may receive nothing
        auto p =
            OpenBuffer(b.session_id, b.uid, b.recv, b.recv_bytes, device, r, "recv", &run->holds, &far);
        if (!p.ok()) return p.status();
        recv[r] = *p;
        recv_far[r] = far;
      }
      run->holds.push_back(SessionHold(b.session_id));  // its events
      if (absl::Status s = WaitsForRank(b, r, device, waits); !s.ok()) return s;
    }
    run->stream = *stream;  // from here on, a failure frees the scratch there
    if (absl::Status s = MirrorFar(ranks, device, send_far, recv_far, *stream, &run->scratch,
                                   &run->mirrors, &send, &recv);
        !s.ok()) {
      return s;
    }
    auto plan = PlanSingleNode(sig, ranks, send, recv);
    if (!plan.ok()) return plan.status();
    run->steps = std::move(*plan);
    return absl::OkStatus();
  }

  // Where buffers are far from `device` (current): scratch for their
  // mirrors allocated on `stream` (*scratch) and the pointers replaced
  // (device_plan.h's Mirror).
  static absl::Status MirrorFar(const std::vector<DeviceRankBuffers>& ranks, int device,
                                const std::vector<bool>& send_far,
                                const std::vector<bool>& recv_far, cudaStream_t stream,
                                uint8_t** scratch, Mirrors* mirrors, std::vector<uint8_t*>* send,
                                std::vector<uint8_t*>* recv) {
    const size_t bytes = Mirror(ranks, device, send_far, recv_far, nullptr, send, recv).bytes;
    if (bytes == 0) return absl::OkStatus();
    void* p = nullptr;
    absl::Status s = Cuda(cudaMallocAsync(&p, bytes, stream),
                          absl::StrCat("cudaMallocAsync of ", bytes,
                                       " bytes (mirrors of buffers without peer access)"));
    if (!s.ok()) return s;
    *scratch = static_cast<uint8_t*>(p);
    *mirrors = Mirror(ranks, device, send_far, recv_far, *scratch, send, recv);
    return absl::OkStatus();
  }

  // The points rank `r` (rank b.rank of the job) submitted at on its
  // stream(s), as its IPC event(s), opened on `device` (current): the
  // gate's waits, asked with cudaEventQuery. The events belong to the
  // session's handles, which the operation holds.
  absl::Status WaitsForRank(const DeviceRankBuffers& b, int r, int device,
                            std::vector<ReadyGate::Wait>* waits) {
    for (const wire::DeviceBufferDescriptor* d : {&b.send, &b.recv}) {
      const uint64_t bytes = d == &b.send ? b.send_bytes : b.recv_bytes;
      if (bytes == 0 || (d->flags & wire::kDeviceDescriptorEventValid) == 0) continue;
      if (d == &b.recv && b.send_bytes > 0 &&
          (b.send.flags & wire::kDeviceDescriptorEventValid) != 0 &&
          std::memcmp(b.send.event_handle, b.recv.event_handle, wire::kCudaIpcHandleBytes) == 0) {
        continue;  // the same event as the send buffer's
      }
      auto ev = OpenEvent(b.session_id, d->event_handle, r);
      if (!ev.ok()) return ev.status();
      const cudaEvent_t event = *ev;
      waits->push_back(ReadyGate::Wait{absl::StrCat("rank ", b.rank, "'s stream"),
                                       [event, device] { return Reached(event, device); }});
    }
    return absl::OkStatus();
  }

  // Whether the trainer's `event` (opened on `device`) has completed; the
  // error its work failed with.
  static absl::StatusOr<bool> Reached(cudaEvent_t event, int device) {
    cudaSetDevice(device);
    const cudaError_t e = cudaEventQuery(event);
    if (e == cudaSuccess) return true;
    if (e == cudaErrorNotReady) {
      cudaGetLastError();  // not an error (see WaitForEvent)
      return false;
    }
    return Cuda(e, "its work before the submission");
  }

  // Checks the ranks and makes the operation's device (rank 0's) current (*device_out); the
  // event to record at the end is created by Finish.
  absl::Status Begin(const std::vector<DeviceRankBuffers>& ranks, int* device_out) {
    if (ranks.empty() || static_cast<int>(ranks.size()) > gpu::kMaxReduceInputs) {
      return absl::InvalidArgumentError(absl::StrCat("device buffers: ", ranks.size(),
                                                     " ranks on one node (1 to ",
                                                     gpu::kMaxReduceInputs, ")"));
    }
    for (const DeviceRankBuffers& r : ranks) {
      auto it = sessions_.find(r.session_id);
      if (it != sessions_.end() && it->second->memory.size() >= kMaxOpenPerSession) {
        CloseSessionOnSubmit(r.session_id);
      }
    }
    // Rank 0's device; in an alltoallv, whose ranks may send or receive
    // nothing (no descriptor then), the first buffer's there is.
    int device = ranks[0].recv.device;
    for (const DeviceRankBuffers& r : ranks) {
      if (r.recv_bytes > 0 || r.send_bytes > 0) {
        device = r.recv_bytes > 0 ? r.recv.device : r.send.device;
        break;
      }
    }
    *device_out = device;
    return Cuda(cudaSetDevice(device), absl::StrCat("cudaSetDevice(", device, ")"));
  }

  // Records the event that tells the completion thread the work is done
  // (one of `device`'s, the current one, from the pool).
  absl::Status Finish(int device, cudaStream_t stream, cudaEvent_t* event) {
    cudaError_t e = completion_events_.Take(device, event);
    if (e != cudaSuccess) {
      *event = nullptr;
      return Cuda(e, "cudaEventCreateWithFlags");
    }
    return Cuda(cudaEventRecord(*event, stream), "cudaEventRecord");
  }

  // Builds the staged buffer (Build) and hands it to `done` once the
  // ranks' streams have reached the submission (the gate).
  void StageOnSubmit(const OpSignature& sig, int world, const std::vector<DeviceRankBuffers>& ranks,
                     const std::string& job, Clock::time_point deadline,
                     std::function<void(absl::StatusOr<std::shared_ptr<StagedNodeBuffer>>)> done) {
    std::vector<ReadyGate::Wait> waits;
    absl::StatusOr<std::shared_ptr<CudaStagedBuffer>> buffer =
        Build(sig, world, ranks, job, &waits);
    // Even without waits through the gate: the job's staged buffers reach
    // the ClusterJob in the order submitted. (One that could not be built
    // fails at once, ahead of the job's held ones: it goes nowhere.)
    if (!buffer.ok()) return done(buffer.status());
    ReadyGate::Entry e;
    e.lane = job;
    e.waits = std::move(waits);
    for (const DeviceRankBuffers& b : ranks) e.sessions.push_back(b.session_id);
    e.deadline = deadline;
    e.pass = [buffer = std::move(*buffer), done = std::move(done)](absl::Status ready) mutable {
      // Failed: the buffer goes first (on the submit thread; its stream
      // holds nothing of the ranks'), and with it the ranks' mappings,
      // before they hear (they may free their buffers then).
      if (ready.ok()) ready = buffer->CopyIn();
      if (!ready.ok()) {
        buffer.reset();
        return done(ready);
      }
      done(std::shared_ptr<StagedNodeBuffer>(std::move(buffer)));
    };
    gate_.Add(std::move(e));
    gate_.Poll(Clock::now());  // streams already there: at once
  }

  // The staged buffer of an operation, its ranks' buffers opened; the waits
  // for their streams go to *waits (nothing on the buffer's stream waits
  // for them).
  absl::StatusOr<std::shared_ptr<CudaStagedBuffer>> Build(
      const OpSignature& sig, int world, const std::vector<DeviceRankBuffers>& ranks,
      const std::string& job, std::vector<ReadyGate::Wait>* waits) {
    CudaStagedBuffer::Parts parts;
    parts.dtype = static_cast<wire::DataType>(sig.dtype);
    const bool v_splits = sig.collective == static_cast<uint32_t>(wire::Collective::kAlltoallv);
    auto planned = PlanStaged(sig, world, ranks);
    if (!planned.ok()) return planned.status();
    const StagedLayout& layout = *planned;
    parts.count = layout.count;
    std::shared_ptr<DeviceResiduals>& residuals = residuals_[job];
    if (!residuals) residuals = std::make_shared<DeviceResiduals>(kResidualBytesPerJob);
    parts.residuals = residuals;
    if (parts.count == 0) return std::make_shared<CudaStagedBuffer>(std::move(parts), pool_);
    if (absl::Status current = Begin(ranks, &parts.device); !current.ok()) return current;
    absl::Status s = Cuda(cudaStreamCreateWithFlags(&parts.stream, cudaStreamNonBlocking),
                          "cudaStreamCreateWithFlags");
    if (!s.ok()) return s;
    // Until the buffer owns it, a failure drops the stream. Nothing on it
    // reads or writes a rank's memory: no need to wait for it.
    auto fail = [&parts](absl::Status why) {
      if (parts.scratch != nullptr) cudaFreeAsync(parts.scratch, parts.stream);
      cudaStreamDestroy(parts.stream);
      cudaGetLastError();
      return why;
    };
    const size_t n = ranks.size();
    std::vector<uint8_t*> send(n, nullptr);
    std::vector<uint8_t*> recv(n, nullptr);  // alltoallv may receive nothing
    std::vector<bool> send_far(n, false), recv_far(n, false);
    for (int r = 0; r < static_cast<int>(n); ++r) {
      const DeviceRankBuffers& b = ranks[r];
      bool far = false;
      if (b.recv_bytes > 0 || !v_splits) {
        auto p = OpenBuffer(b.session_id, b.uid, b.recv, b.recv_bytes, parts.device, r, "recv",
                            &parts.holds, &far);
        if (!p.ok()) return fail(p.status());
        recv[r] = *p;
        recv_far[r] = far;
      }
      if (b.send_bytes > 0) {
        auto p = OpenBuffer(b.session_id, b.uid, b.send, b.send_bytes, parts.device, r, "send",
                            &parts.holds, &far);
        if (!p.ok()) return fail(p.status());
        send[r] = *p;
        send_far[r] = far;
      }
      if (s = WaitsForRank(b, r, parts.device, waits); !s.ok()) return fail(s);
      parts.holds.push_back(SessionHold(b.session_id));  // its events
    }
    s = MirrorFar(ranks, parts.device, send_far, recv_far, parts.stream, &parts.scratch,
                  &parts.mirrors, &send, &recv);
    if (!s.ok()) return fail(s);
    auto pointers = PointersFor(sig, layout, std::vector<const void*>(send.begin(), send.end()),
                                std::vector<void*>(recv.begin(), recv.end()));
    if (!pointers.ok()) return fail(pointers.status());
    for (const void* in : pointers->inputs) parts.inputs.push_back(in);
    for (void* out : pointers->outputs) parts.outputs.push_back(static_cast<uint8_t*>(out));
    parts.input_offsets = std::move(pointers->input_offsets);
    parts.output_offsets = std::move(pointers->output_offsets);
    parts.input_sizes = std::move(pointers->input_sizes);
    parts.output_sizes = std::move(pointers->output_sizes);
    parts.input_bytes = pointers->input_bytes;
    parts.output_bytes = pointers->output_bytes;
    if (layout.own_node) {
      // Every rank's block, reduced, or the node's ranks' buffers: memory
      // of its own, on the stream.
      void* node = nullptr;
      s = Cuda(cudaMallocAsync(&node, parts.count * sig.element_bytes(), parts.stream),
               "cudaMallocAsync (the node buffer of " + sig.ToString() + ")");
      if (!s.ok()) return fail(s);
      parts.node = static_cast<uint8_t*>(node);
      parts.owns_node = true;
    } else {
      parts.node = parts.outputs[0];
    }
    return std::make_shared<CudaStagedBuffer>(std::move(parts), pool_);
  }

  // The runner's stream for `job` on `device` (current).
  absl::StatusOr<cudaStream_t> StreamFor(int device, const std::string& job) {
    auto it = streams_.find({job, device});
    if (it != streams_.end()) return it->second;
    cudaStream_t s = nullptr;
    cudaError_t e = cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
    if (e != cudaSuccess) return Cuda(e, "cudaStreamCreateWithFlags");
    streams_[{job, device}] = s;
    return s;
  }

  // Rank `rank`'s buffer of `bytes` bytes described by `d` (validated), as a
  // pointer; its mapping is added to `holds`. *far: `device` (current, the
  // operation's) has no peer access to the buffer's device, whose memory
  // its kernels then cannot read: the buffer is opened there and reached
  // by copies only (mirrored, device_plan.h). Else the kernels on `device`
  // may read it (peer access enabled).
  absl::StatusOr<uint8_t*> OpenBuffer(uint64_t session_id, uint32_t uid,
                                      const wire::DeviceBufferDescriptor& d,
                                      uint64_t bytes, int device, int rank, absl::string_view what,
                                      Holds* holds, bool* far) {
    const std::string who = absl::StrCat("rank ", rank, "'s ", what, " buffer");
    *far = false;
    if (d.device != device) {
      auto reach = Reach(device, d.device);
      if (!reach.ok()) return reach.status();
      *far = !*reach;
    }
    SessionHandles& session = Session(session_id);
    session.uid = uid;
    auto& cache = session.memory;
    const auto key = std::make_pair(BytesOf(d.memory_handle), *far ? d.device : device);
    auto it = cache.find(key);
    if (it == cache.end()) {
      // Shared only among the sessions of the uid that opened it: a handle
      // another user's trainer names never reaches this user's mapping
      // (its own open then fails, as CUDA maps a handle once per process).
      const SharedKey shared_key{uid, key.first, key.second};
      std::shared_ptr<Mapping> shared = OpenMapping(shared_key);
      if (!shared) {
        // A far buffer is opened on its own device (without peer access
        // there is no mapping of it on `device`).
        if (*far) {
          absl::Status s =
              Cuda(cudaSetDevice(d.device), absl::StrCat("cudaSetDevice(", d.device, ")"));
          if (!s.ok()) return s;
        }
        auto m = Open(d, who, uid);
        if (*far) cudaSetDevice(device);
        if (!m.ok()) return m.status();
        shared = std::move(*m);
        // Forget the mappings closed since (an open costs far more).
        for (auto at = mappings_.begin(); at != mappings_.end();) {
          at = at->second.expired() ? mappings_.erase(at) : std::next(at);
        }
        mappings_[shared_key] = shared;
      }
      it = cache.emplace(key, std::move(shared)).first;
    }
    const Mapping& m = *it->second;
    // Validation checked these against the descriptor; the allocation is
    // the real one now, so check again against it.
    if (d.offset > m.bytes || bytes > m.bytes - d.offset) {
      return absl::InvalidArgumentError(absl::StrCat(
          who, ": ", bytes, " bytes at offset ", d.offset, " do not fit in its allocation of ",
          m.bytes, " bytes"));
    }
    holds->push_back(it->second);
    return m.base + d.offset;
  }

  // Opens the allocation of `d` (on the current device) and checks it
  // against what the trainer said of it.
  absl::StatusOr<std::shared_ptr<Mapping>> Open(const wire::DeviceBufferDescriptor& d,
                                                const std::string& who, uint32_t uid) {
    cudaIpcMemHandle_t h;
    std::memcpy(&h, d.memory_handle, sizeof(h));
    void* p = nullptr;
    cudaError_t e = cudaIpcOpenMemHandle(&p, h, cudaIpcMemLazyEnablePeerAccess);
    if (e == cudaErrorAlreadyMapped) {
      cudaGetLastError();
      DropIdleMappings(uid);
      e = cudaIpcOpenMemHandle(&p, h, cudaIpcMemLazyEnablePeerAccess);
      // The operation that last held the mapping may be closing it right
      // now, on the completion thread: a few short waits for that.
      for (int i = 0; i < 3 && e == cudaErrorAlreadyMapped; ++i) {
        cudaGetLastError();
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
        e = cudaIpcOpenMemHandle(&p, h, cudaIpcMemLazyEnablePeerAccess);
      }
    }
    if (e == cudaErrorInvalidValue || e == cudaErrorMapBufferObjectFailed ||
        e == cudaErrorInvalidResourceHandle) {
      // The trainer's descriptor, not the daemon: a handle that names no
      // allocation this process can open.
      cudaGetLastError();
      return absl::InvalidArgumentError(absl::StrCat(
          "opening ", who, " (cudaIpcOpenMemHandle): ", cudaGetErrorName(e),
          ": the descriptor's handle is no CUDA IPC handle of a live allocation on this machine "
          "(freed, corrupted, or not one), or ciuicd could not map it"));
    }
    if (e != cudaSuccess) {
      // What it means first: a trainer hears at most wire::kMaxMessage bytes.
      return Cuda(e, absl::StrCat("opening ", who,
                                  e == cudaErrorAlreadyMapped
                                      ? ": mapped for another user's sessions, or a freed "
                                        "allocation at its address is still in use here"
                                      : "",
                                  " (cudaIpcOpenMemHandle)"));
    }
    auto m = std::make_shared<Mapping>();
    m->opened = p;
    cudaGetDevice(&m->device);
    // The real allocation: the trainer's word for its size is not trusted.
    // The driver may serve small cudaMallocs from a bigger block and share
    // the whole block: the opened pointer is then inside a bigger range.
    CUdeviceptr base = 0;
    size_t size = 0;
    const auto at = reinterpret_cast<CUdeviceptr>(p);
    cudaPointerAttributes a{};
    if (mem_get_address_range_(&base, &size, at) != CUDA_SUCCESS || base > at ||
        at - base >= size) {
      return absl::InternalError(absl::StrCat(who, ": cannot find the opened allocation's size"));
    }
    const uint64_t usable = size - (at - base);
    if (cudaPointerGetAttributes(&a, p) != cudaSuccess) {
      cudaGetLastError();
      return absl::InternalError(absl::StrCat(who, ": cudaPointerGetAttributes failed"));
    }
    if (a.device != d.device) {
      return absl::FailedPreconditionError(absl::StrCat(
          who, ": the trainer's device ", d.device, " is this ciuicd's device ", a.device,
          " (give the trainer and ciuicd the same CUDA_VISIBLE_DEVICES)"));
    }
    // At the start of a bigger range, the block's start or the allocation's
    // cannot be told apart: refuse rather than guess. Except where the
    // range is the allocation rounded up to the driver's 2 MiB pages (the
    // mapping of a cudaMalloc of 1 GiB + 64 bytes may be 1 GiB + 2 MiB
    // long): the driver shares blocks between allocations below 2 MiB only,
    // so one of 2 MiB or more starts its range.
    constexpr uint64_t kPage = uint64_t{2} << 20;
    const uint64_t rounded = (d.allocation_bytes + kPage - 1) / kPage * kPage;
    const bool whole =
        usable == d.allocation_bytes ||
        (d.allocation_bytes >= kPage && usable > d.allocation_bytes && usable <= rounded);
    if (base == at ? !whole : usable < d.allocation_bytes) {
      return absl::InvalidArgumentError(absl::StrCat(
          who, ": the descriptor says the allocation has ", d.allocation_bytes,
          " bytes, the memory opened has ", usable,
          " (the driver shares small cudaMalloc allocations as part of a bigger block; give "
          "ciuic buffers in allocations of 2 MiB or more, as PyTorch's allocator does)"));
    }
    m->base = static_cast<uint8_t*>(p);
    m->bytes = d.allocation_bytes;
    mapped_->allocations += 1;
    mapped_->bytes += m->bytes;
    m->counted = mapped_;
    return m;
  }

  // Whether kernels on `device` (current) may read memory of `peer`: peer
  // access, enabled the first time (for every mapping, wherever it was
  // opened). False: copies only.
  absl::StatusOr<bool> Reach(int device, int peer) {
    auto known = reach_.find({device, peer});
    if (known != reach_.end()) return known->second;
    int can = 0;
    cudaError_t e = cudaDeviceCanAccessPeer(&can, device, peer);
    if (e != cudaSuccess) return Cuda(e, "cudaDeviceCanAccessPeer");
    if (can) {
      e = cudaDeviceEnablePeerAccess(peer, 0);
      // Already enabled: fine. Refused (too many peers...): copies only.
      if (e != cudaSuccess && e != cudaErrorPeerAccessAlreadyEnabled) can = 0;
      cudaGetLastError();
    }
    reach_[{device, peer}] = can != 0;
    return can != 0;
  }

  // ciuicd's mapping of `key` if one is open (another session's, or one
  // that an operation still holds), else null.
  using SharedKey = std::tuple<uint32_t, IpcBytes, int>;  // uid, handle, device
  std::shared_ptr<Mapping> OpenMapping(const SharedKey& key) {
    auto it = mappings_.find(key);
    return it == mappings_.end() ? nullptr : it->second.lock();
  }

  // Closes every mapping that only caches of `uid`'s sessions hold (no
  // operation, no other user): those whose holders are all such caches are
  // found first, then dropped from every cache that shares them. Another
  // user's open never closes this user's mappings.
  void DropIdleMappings(uint32_t uid) {
    struct Holders {
      long caches = 0;
      long all = 0;
      bool foreign = false;  // cached by another uid's session
    };
    std::map<const Mapping*, Holders> held;
    for (auto& [id, session] : sessions_) {
      for (auto& [key, m] : session->memory) {
        Holders& h = held[m.get()];
        ++h.caches;
        h.all = m.use_count();
        h.foreign |= session->uid != uid;
      }
    }
    for (auto& [id, session] : sessions_) {
      for (auto it = session->memory.begin(); it != session->memory.end();) {
        const Holders& h = held[it->second.get()];
        it = h.all == h.caches && !h.foreign ? session->memory.erase(it) : std::next(it);
      }
    }
  }

  absl::StatusOr<cudaEvent_t> OpenEvent(uint64_t session_id, const uint8_t* handle, int rank) {
    auto& cache = Session(session_id).events;
    const IpcBytes key = BytesOf(handle);
    auto it = cache.find(key);
    if (it != cache.end()) return it->second;
    cudaIpcEventHandle_t h;
    std::memcpy(&h, handle, sizeof(h));
    cudaEvent_t ev = nullptr;
    cudaError_t e = cudaIpcOpenEventHandle(&ev, h);
    if (e != cudaSuccess) {
      return Cuda(e, absl::StrCat("opening rank ", rank, "'s event (cudaIpcOpenEventHandle)"));
    }
    cache.emplace(key, ev);
    return ev;
  }

  // A session's handles, made at its first use (also by an operation whose
  // ranks open nothing, an alltoallv's that move no bytes: never null).
  const std::shared_ptr<SessionHandles>& SessionHold(uint64_t session_id) {
    std::shared_ptr<SessionHandles>& s = sessions_[session_id];
    if (!s) s = std::make_shared<SessionHandles>();
    return s;
  }
  SessionHandles& Session(uint64_t session_id) { return *SessionHold(session_id); }

  // The handles close now, or when the last operation using them (queued,
  // or a staged buffer) has let go: no wait here.
  void CloseSessionOnSubmit(uint64_t session_id) { sessions_.erase(session_id); }

  const MemGetAddressRangeFn mem_get_address_range_;
  const std::shared_ptr<PinnedPool> pool_ = std::make_shared<PinnedPool>();
  const std::shared_ptr<MappedCounters> mapped_ = std::make_shared<MappedCounters>();
  Queue<std::function<void()>> tasks_;
  Queue<Completion> completions_;
  EventPool completion_events_;
  // Woken by the host functions behind large operations and by every new
  // completion (PushCompletion).
  const std::shared_ptr<DeviceWaker> completion_waker_ = std::make_shared<DeviceWaker>();
  // Submit-thread state.
  // The runner's own streams, per job and device: one job's stuck trainer
  // stream holds up no other job's work.
  std::map<std::pair<std::string, int>, cudaStream_t> streams_;
  std::map<uint64_t, std::shared_ptr<SessionHandles>> sessions_;
  // Every open mapping by the uid of the sessions that use it, handle and
  // device, whichever of that uid's sessions opened it: CUDA maps a handle
  // once per process and device.
  std::map<SharedKey, std::weak_ptr<Mapping>> mappings_;
  // Operations waiting for their ranks' streams (per job: in order).
  ReadyGate gate_;
  // (operation's device, buffer's device): peer access (enabled), or none.
  std::map<std::pair<int, int>, bool> reach_;
  // Error feedback kept on the device, per job (EndJob drops the runner's
  // hold; the memory goes with the job's last staged buffer).
  std::map<std::string, std::shared_ptr<DeviceResiduals>> residuals_;
  std::thread submit_thread_;
  std::thread completion_thread_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<DeviceRunner>> DeviceRunner::Create() {
  int devices = 0;
  cudaError_t e = cudaGetDeviceCount(&devices);
  if (e != cudaSuccess) return Cuda(e, "cudaGetDeviceCount");
  if (devices == 0) return absl::FailedPreconditionError("no CUDA device: none found");
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult q{};
  e = cudaGetDriverEntryPointByVersion("cuMemGetAddressRange", &fn, 12000, cudaEnableDefault, &q);
  if (e != cudaSuccess || q != cudaDriverEntryPointSuccess || fn == nullptr) {
    cudaGetLastError();
    return absl::FailedPreconditionError("device (CUDA) buffers: the CUDA driver has no "
                                         "cuMemGetAddressRange");
  }
  // Device memory the runner allocates per operation (a reduce_scatter's
  // node buffer, the codecs' buffers) comes from each device's stream-ordered
  // pool: keep up to 2 GiB of it cached across operations instead of giving
  // it back to the driver at every synchronisation (the default).
  for (int d = 0; d < devices; ++d) {
    cudaMemPool_t pool = nullptr;
    uint64_t keep = uint64_t{2} << 30;
    if (cudaDeviceGetDefaultMemPool(&pool, d) == cudaSuccess) {
      cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &keep);
    }
    cudaGetLastError();
  }
  return std::unique_ptr<DeviceRunner>(
      new CudaDeviceRunner(reinterpret_cast<MemGetAddressRangeFn>(fn)));
}

}  // namespace ciuic::daemon
