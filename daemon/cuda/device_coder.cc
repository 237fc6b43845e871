// DeviceResiduals and the device ChunkCoder: see device_coder.h.
#include "cuda/device_coder.h"

#include <algorithm>
#include <deque>
#include <functional>
#include <memory>
#include <vector>

#include "absl/strings/str_cat.h"
#include "compression/codec.h"
#include "cuda/kernels.h"
#include "cuda/launch.h"
#include "cuda/runtime.h"

namespace ciuic::daemon {

// ------------------------------------------------------------- residuals

DeviceResiduals::Residual::~Residual() {
  if (data == nullptr) return;
  int current = 0;
  const bool known = cudaGetDevice(&current) == cudaSuccess;
  cudaSetDevice(device);
  // The last holder may have just enqueued kernels on it (an Apply or an
  // Update on a coder's stream): wait for the device's work before the
  // free. cudaFree "may" synchronise (CUDA's API docs), which is no promise.
  cudaDeviceSynchronize();
  cudaFree(data);
  if (known) cudaSetDevice(current);
  cudaGetLastError();
}

void DeviceResiduals::EraseLocked(std::unordered_map<std::string, Entry>::iterator it,
                                  Dropped* dropped) {
  bytes_ -= it->second.count * sizeof(float);
  lru_.erase(it->second.lru);
  // The memory goes with the last holder: if that is this, only after mu_
  // is let go (cudaFree waits for the device).
  dropped->push_back(std::move(it->second.residual));
  entries_.erase(it);
}

std::shared_ptr<DeviceResiduals::Residual> DeviceResiduals::Find(const std::string& name,
                                                                 size_t count, int device) {
  Dropped dropped;  // freed after the lock goes
  std::lock_guard<std::mutex> lock(mu_);
  auto it = entries_.find(name);
  if (it == entries_.end()) return nullptr;
  if (it->second.count != count || it->second.device != device) {
    EraseLocked(it, &dropped);  // the operation changed shape
    ++stats_.size_resets;
    return nullptr;
  }
  lru_.splice(lru_.begin(), lru_, it->second.lru);
  return it->second.residual;
}

absl::StatusOr<std::shared_ptr<DeviceResiduals::Residual>> DeviceResiduals::ForUpdate(
    const std::string& name, size_t count, int device, cudaStream_t stream) {
  const size_t bytes = count * sizeof(float);
  {
    Dropped dropped;  // freed after the lock goes, before the new allocation
    std::lock_guard<std::mutex> lock(mu_);
    auto it = entries_.find(name);
    if (it != entries_.end() && (it->second.count != count || it->second.device != device)) {
      EraseLocked(it, &dropped);
      ++stats_.size_resets;
      it = entries_.end();
    }
    if (it != entries_.end()) {
      lru_.splice(lru_.begin(), lru_, it->second.lru);
      return it->second.residual;
    }
    if (bytes > max_bytes_) {
      ++stats_.too_large;
      return nullptr;
    }
    while (bytes_ + bytes > max_bytes_ && !lru_.empty()) {
      EraseLocked(entries_.find(lru_.back()), &dropped);
      ++stats_.evictions;
    }
    bytes_ += bytes;  // the room, kept while it is allocated (without the lock)
  }
  auto residual = std::make_shared<Residual>();
  residual->device = device;
  void* p = nullptr;
  absl::Status s = Cuda(cudaMalloc(&p, std::max<size_t>(bytes, 1)), "cudaMalloc (residual)");
  if (s.ok()) {
    residual->data = static_cast<float*>(p);
    s = Cuda(cudaMemsetAsync(p, 0, bytes, stream), "cudaMemsetAsync (residual)");
  }
  Dropped dropped;
  std::lock_guard<std::mutex> lock(mu_);
  if (!s.ok()) {
    bytes_ -= bytes;
    return s;  // the memory goes with `residual`
  }
  // A name runs in one lane at a time, so another residual of it made
  // meanwhile is unlikely; this one replaces it.
  if (auto it = entries_.find(name); it != entries_.end()) EraseLocked(it, &dropped);
  Entry e;
  e.residual = residual;
  e.count = count;
  e.device = device;
  lru_.push_front(name);
  e.lru = lru_.begin();
  entries_.emplace(name, std::move(e));
  return residual;
}

ErrorFeedback::Stats DeviceResiduals::GetStats() {
  std::lock_guard<std::mutex> lock(mu_);
  ErrorFeedback::Stats s = stats_;
  s.names = entries_.size();
  s.bytes = bytes_;
  return s;
}

// ------------------------------------------------------------------ coder

namespace {

// Device memory on the coder's stream, grown when a larger size is asked
// for (stream-ordered: the driver's pool serves it again cheaply).
class StreamBuffer {
 public:
  explicit StreamBuffer(cudaStream_t stream) : stream_(stream) {}
  ~StreamBuffer() {
    if (ptr_ != nullptr) cudaFreeAsync(ptr_, stream_);
  }
  absl::StatusOr<void*> Get(size_t bytes) {
    if (bytes <= bytes_ && ptr_ != nullptr) return ptr_;
    if (ptr_ != nullptr) cudaFreeAsync(ptr_, stream_);
    ptr_ = nullptr;
    bytes_ = 0;
    const size_t want = std::max<size_t>(bytes, 256);
    if (absl::Status s = Cuda(cudaMallocAsync(&ptr_, want, stream_), "cudaMallocAsync (codec)");
        !s.ok()) {
      ptr_ = nullptr;
      return s;
    }
    bytes_ = want;
    return ptr_;
  }

 private:
  const cudaStream_t stream_;
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
};

class DeviceChunkCoder final : public ChunkCoder {
 public:
  DeviceChunkCoder(CodecSpec spec, std::unique_ptr<Codec> cpu, wire::DataType dtype, size_t count,
                   int device, cudaStream_t stream, std::shared_ptr<DeviceResiduals> residuals,
                   std::string name, PinnedAlloc pinned)
      : spec_(spec),
        cpu_(std::move(cpu)),
        dtype_(dtype),
        es_(wire::DataTypeSize(static_cast<uint32_t>(dtype))),
        count_(count),
        device_(device),
        stream_(stream),
        residuals_(dtype == wire::DataType::kFloat32 && !name.empty() ? std::move(residuals)
                                                                      : nullptr),
        name_(std::move(name)),
        pinned_(std::move(pinned)),
        received_(stream),
        decoded_(stream),
        workspace_(stream),
        size_(stream) {}
  ~DeviceChunkCoder() override {
    cudaSetDevice(device_);
    // Encodings still begun (the caller failed first, or one failed half
    // enqueued) write to host memory, and a wake may run after its
    // encoding's event completed: both go with this, so wait for the
    // stream.
    if (!begun_.empty() || !idle_.empty()) cudaStreamSynchronize(stream_);
    for (auto& e : begun_) cudaEventDestroy(e->done);
    for (auto& e : idle_) cudaEventDestroy(e->done);
    // The device buffers go back on the stream, after the work that uses
    // them.
    if (event_ != nullptr) cudaEventDestroy(event_);
    cudaGetLastError();
  }

  absl::StatusOr<uint8_t*> HostMemory(size_t bytes) override {
    if (absl::Status s = Current(); !s.ok()) return s;
    // Memory asked for before goes back to the pool once no copy uses it.
    if (host_ != nullptr) {
      if (absl::Status s = WaitForStream(stream_, &event_, "releasing host memory"); !s.ok()) {
        return s;
      }
    }
    uint8_t* data = nullptr;
    auto memory = pinned_(std::max<size_t>(bytes, 1), &data);
    if (!memory.ok()) return memory.status();
    host_ = std::move(*memory);
    return data;
  }

  // An encoding is enqueued whole where its size is known on the host
  // (fp16, bf16, top-k): the codec's kernels, the copy of the encoding to
  // `out`, what error feedback and an owner's sum do with its decoded form,
  // the completion event, the wake. int8's size is the device's: the copy
  // takes the typical size (no raw block) with the size beside it, and the
  // rest (blocks that travel raw) and the decoded form's work follow when
  // the encoding ends.
  absl::Status BeginEncode(void* data, size_t first, size_t count, bool own_sum, void* out,
                           std::function<void()> wake) override {
    if (absl::Status s = Current(); !s.ok()) return s;
    auto e = Idle();
    if (!e.ok()) return e.status();
    Encoding& en = **e;
    en.data = data;
    en.first = first;
    en.count = count;
    en.own_sum = own_sum;
    en.out = static_cast<uint8_t*>(out);
    en.bytes = 0;
    if (residuals_ != nullptr) {
      if (auto r = residuals_->Find(name_, count_, device_); r != nullptr) {
        absl::Status s = gpu::DeviceErrorFeedbackApply(r->data + first, static_cast<float*>(data),
                                                       count, stream_);
        if (!s.ok()) return Abandon(std::move(*e), s);
      }
    }
    auto room = en.room.Get(cpu_->MaxEncodedBytes(dtype_, count));
    if (!room.ok()) return Abandon(std::move(*e), room.status());
    en.encoded = static_cast<uint8_t*>(*room);
    auto bytes = EncodeOnDevice(data, count, en.encoded, en.size);
    if (!bytes.ok()) return Abandon(std::move(*e), bytes.status());
    // int8: the typical part now, the size beside it.
    const uint64_t now = !SizedOnDevice() ? *bytes
                                          : std::min(cpu_->TypicalEncodedBytes(dtype_, count),
                                                     cpu_->MaxEncodedBytes(dtype_, count));
    absl::Status s = Cuda(cudaMemcpyAsync(out, en.encoded, now, cudaMemcpyDeviceToHost, stream_),
                          "cudaMemcpyAsync of the encoding to the host");
    if (s.ok() && !SizedOnDevice()) {
      en.bytes = *bytes;
      s = Decoded(en);
    }
    // The event, then the wake: once it is called the event has completed.
    if (s.ok()) s = Cuda(cudaEventRecord(en.done, stream_), "cudaEventRecord (encoding)");
    if (s.ok()) {
      wakes_.push_back(std::make_unique<std::function<void()>>(std::move(wake)));
      s = Cuda(cudaLaunchHostFunc(stream_, &Wake, wakes_.back().get()), "cudaLaunchHostFunc");
    }
    if (!s.ok()) return Abandon(std::move(*e), s);
    begun_.push_back(std::move(*e));
    return absl::OkStatus();
  }

  absl::StatusOr<bool> EncodeDone() override {
    if (begun_.empty()) return absl::FailedPreconditionError("no encoding begun");
    if (absl::Status s = Current(); !s.ok()) return s;
    const cudaError_t e = cudaEventQuery(begun_.front()->done);
    if (e == cudaErrorNotReady) {
      cudaGetLastError();
      return false;
    }
    if (absl::Status s = Cuda(e, "encoding a chunk"); !s.ok()) return s;
    return true;
  }

  absl::StatusOr<uint64_t> EndEncode() override {
    auto done = EncodeDone();
    if (!done.ok()) return done.status();
    if (!*done) return absl::FailedPreconditionError("encoding ended before it completed");
    std::unique_ptr<Encoding> e = std::move(begun_.front());
    begun_.pop_front();
    absl::Status s;
    if (SizedOnDevice()) {  // int8: its size came with it
      const uint64_t bytes = *e->size;
      const uint64_t typical = cpu_->TypicalEncodedBytes(dtype_, e->count);
      if (bytes > cpu_->MaxEncodedBytes(dtype_, e->count)) {
        s = absl::InternalError(
            absl::StrCat("int8 encoded ", e->count, " elements into ", bytes, " bytes"));
      } else if (bytes > typical) {  // raw blocks: the rest
        s = Cuda(cudaMemcpyAsync(e->out + typical, e->encoded + typical, bytes - typical,
                                 cudaMemcpyDeviceToHost, stream_),
                 "cudaMemcpyAsync of the encoding to the host");
        if (s.ok()) s = WaitForStream(stream_, &event_, "encoding a chunk");
      }
      e->bytes = bytes;
      if (s.ok()) s = Decoded(*e);
    }
    const uint64_t bytes = e->bytes;
    idle_.push_back(std::move(e));  // its room reused on the stream, after this
    if (!s.ok()) return s;
    return bytes;
  }

  absl::Status Decode(const void* in, uint64_t bytes, size_t count, void* data, bool add) override {
    if (absl::Status s = Current(); !s.ok()) return s;
    if (bytes > cpu_->MaxEncodedBytes(dtype_, count)) {
      return absl::InvalidArgumentError(
          absl::StrCat("codec ", CodecName(spec_), ": ", bytes, " bytes for ", count, " elements"));
    }
    // Checked here, where the bytes are (host memory), with the CPU codec's
    // checks: the device then decodes them as trusted, with no check of its
    // own to wait for (the device decoders' check synchronises the stream,
    // which would also wait for the encodings begun ahead).
    if (absl::Status s = cpu_->Validate(dtype_, in, bytes, count); !s.ok()) return s;
    auto received = received_.Get(bytes);
    if (!received.ok()) return received.status();
    if (absl::Status s =
            Cuda(cudaMemcpyAsync(*received, in, bytes, cudaMemcpyHostToDevice, stream_),
                 "cudaMemcpyAsync of an encoding to the device");
        !s.ok()) {
      return s;
    }
    // The caller reuses `in` once this returns, so the host waits for the
    // copy, and with it for the work queued before on the stream (the
    // encodings begun ahead): owed, a copy stream of its own with two
    // receive rooms (daemon/cuda/README.md), once a GPU shows the cost.
    if (absl::Status s = WaitForStream(stream_, &event_, "copying a chunk in"); !s.ok()) return s;
    return DecodeOnDevice(*received, bytes, count, data, add, /*trusted=*/true);
  }

 private:
  // One encoding: its room on the device, reused once it has ended.
  struct Encoding {
    explicit Encoding(cudaStream_t stream) : room(stream) {}
    StreamBuffer room;
    uint8_t* encoded = nullptr;  // room's memory
    uint64_t* size = nullptr;    // int8's size, copied here (pinned)
    cudaEvent_t done = nullptr;  // recorded after the encoding's work
    void* data = nullptr;
    size_t first = 0, count = 0;
    bool own_sum = false;
    uint8_t* out = nullptr;
    uint64_t bytes = 0;  // known when begun, but SizedOnDevice: when ended
  };
  // int8's size is known on the device only.
  bool SizedOnDevice() const { return spec_.kind == CodecKind::kInt8; }

  // Room for another encoding: an idle one, or a new one.
  absl::StatusOr<std::unique_ptr<Encoding>> Idle() {
    if (!idle_.empty()) {
      std::unique_ptr<Encoding> e = std::move(idle_.back());
      idle_.pop_back();
      return e;
    }
    auto e = std::make_unique<Encoding>(stream_);
    if (absl::Status s = Cuda(cudaEventCreateWithFlags(&e->done, cudaEventDisableTiming),
                              "cudaEventCreateWithFlags (encoding)");
        !s.ok()) {
      e->done = nullptr;
      return s;
    }
    if (cells_left_ == 0) {  // int8's size cells, pinned, a block at a time
      uint8_t* data = nullptr;
      auto block = pinned_(kCellsPerBlock * sizeof(uint64_t), &data);
      if (!block.ok()) {
        cudaEventDestroy(e->done);
        return block.status();
      }
      cell_blocks_.push_back(std::move(*block));
      cells_ = reinterpret_cast<uint64_t*>(data);
      cells_left_ = kCellsPerBlock;
    }
    e->size = cells_++;
    --cells_left_;
    return e;
  }
  // An encoding that could not be begun: its room idle again, the error.
  absl::Status Abandon(std::unique_ptr<Encoding> e, absl::Status why) {
    idle_.push_back(std::move(e));
    return why;
  }
  // Enqueues what the encoding's decoded form does (its size known): the
  // residual's update, the owner's own copy of its sum.
  absl::Status Decoded(Encoding& e) {
    if (residuals_ == nullptr && !e.own_sum) return absl::OkStatus();
    void* target = e.data;
    if (residuals_ != nullptr) {
      auto d = decoded_.Get(e.count * es_);
      if (!d.ok()) return d.status();
      target = *d;
    }
    if (absl::Status s = DecodeOnDevice(e.encoded, e.bytes, e.count, target, /*add=*/false,
                                        /*trusted=*/true);
        !s.ok()) {
      return absl::InternalError(absl::StrCat("own encoding does not decode: ", s.message()));
    }
    if (residuals_ == nullptr) return absl::OkStatus();
    auto r = residuals_->ForUpdate(name_, count_, device_, stream_);
    if (!r.ok()) return r.status();
    if (*r != nullptr) {
      absl::Status s = gpu::DeviceErrorFeedbackUpdate(static_cast<const float*>(e.data),
                                                      static_cast<const float*>(target),
                                                      (*r)->data + e.first, e.count, stream_);
      if (!s.ok()) return s;
    }
    if (!e.own_sum) return absl::OkStatus();
    return Cuda(cudaMemcpyAsync(e.data, target, e.count * es_, cudaMemcpyDeviceToDevice, stream_),
                "cudaMemcpyAsync of the decoded sum");
  }
  // cudaLaunchHostFunc's: on the driver's thread, no CUDA calls.
  static void CUDART_CB Wake(void* wake) { (*static_cast<std::function<void()>*>(wake))(); }

  absl::Status Current() {
    return Cuda(cudaSetDevice(device_), absl::StrCat("cudaSetDevice(", device_, ")"));
  }

  // Enqueues the codec's kernels; the encoding's size, but for int8, whose
  // size is copied to *host_size (pinned) on the stream (0 returned).
  absl::StatusOr<uint64_t> EncodeOnDevice(const void* data, size_t count, void* out,
                                          uint64_t* host_size) {
    switch (spec_.kind) {
      case CodecKind::kFp16:
      case CodecKind::kBf16: {
        absl::Status s = gpu::DeviceCastEncode(Format(), dtype_, data, count, out, stream_);
        if (!s.ok()) return s;
        return uint64_t{2} * count;
      }
      case CodecKind::kInt8: {
        auto ws_bytes = gpu::Int8EncodeWorkspaceBytes(count);
        if (!ws_bytes.ok()) return ws_bytes.status();
        auto ws = workspace_.Get(*ws_bytes);
        if (!ws.ok()) return ws.status();
        auto size = size_.Get(sizeof(uint64_t));
        if (!size.ok()) return size.status();
        auto* device_size = static_cast<uint64_t*>(*size);
        absl::Status s =
            gpu::DeviceInt8Encode(dtype_, data, count, out, *ws, *ws_bytes, device_size, stream_);
        if (!s.ok()) return s;
        s = Cuda(cudaMemcpyAsync(host_size, device_size, sizeof(uint64_t), cudaMemcpyDeviceToHost,
                                 stream_),
                 "cudaMemcpyAsync of the encoded size");
        if (!s.ok()) return s;
        return uint64_t{0};
      }
      case CodecKind::kTopK: {
        const size_t k = cpu_->MaxEncodedBytes(dtype_, count) / (sizeof(uint32_t) + es_);
        auto ws_bytes = gpu::TopKEncodeWorkspaceBytes(count);
        if (!ws_bytes.ok()) return ws_bytes.status();
        auto ws = workspace_.Get(*ws_bytes);
        if (!ws.ok()) return ws.status();
        absl::Status s =
            gpu::DeviceTopKEncode(dtype_, data, count, k, out, *ws, *ws_bytes, stream_);
        if (!s.ok()) return s;
        return static_cast<uint64_t>(k * (sizeof(uint32_t) + es_));
      }
      case CodecKind::kNone:
        break;
    }
    return absl::InternalError("no device coder for an uncompressed operation");
  }

  // `in` is device memory; `trusted`: this coder's own encoding, or a
  // received one already validated on the host (Decode): enqueued
  // unchecked, without waiting for the stream.
  absl::Status DecodeOnDevice(const void* in, uint64_t bytes, size_t count, void* data, bool add,
                              bool trusted) {
    switch (spec_.kind) {
      case CodecKind::kFp16:
      case CodecKind::kBf16:
        return gpu::DeviceCastDecode(Format(), dtype_, in, bytes, count, data, add, stream_);
      case CodecKind::kInt8: {
        const size_t ws_bytes = gpu::Int8DecodeWorkspaceBytes(count);
        auto ws = workspace_.Get(ws_bytes);
        if (!ws.ok()) return ws.status();
        return gpu::DeviceInt8Decode(dtype_, in, bytes, count, data, add, *ws, ws_bytes, stream_,
                                     trusted);
      }
      case CodecKind::kTopK: {
        const size_t ws_bytes = gpu::TopKDecodeWorkspaceBytes();
        auto ws = workspace_.Get(ws_bytes);
        if (!ws.ok()) return ws.status();
        return gpu::DeviceTopKDecode(dtype_, in, bytes, count, data, add, *ws, ws_bytes, stream_,
                                     trusted);
      }
      case CodecKind::kNone:
        break;
    }
    return absl::InternalError("no device coder for an uncompressed operation");
  }

  gpu::CastFormat Format() const {
    return spec_.kind == CodecKind::kFp16 ? gpu::CastFormat::kFp16 : gpu::CastFormat::kBf16;
  }

  const CodecSpec spec_;
  const std::unique_ptr<Codec> cpu_;  // sizes, and Validate for received chunks
  const wire::DataType dtype_;
  const size_t es_;
  const size_t count_;  // the operation's, for the residuals
  const int device_;
  const cudaStream_t stream_;
  const std::shared_ptr<DeviceResiduals> residuals_;  // null: no error feedback
  const std::string name_;
  const PinnedAlloc pinned_;
  std::shared_ptr<void> host_;  // HostMemory's
  StreamBuffer received_, decoded_, workspace_, size_;
  std::deque<std::unique_ptr<Encoding>> begun_;  // in order, not ended
  std::vector<std::unique_ptr<Encoding>> idle_;
  // The wakes of every encoding begun: each called by the driver at most
  // once, after the encoding's event; kept until the coder goes.
  std::vector<std::unique_ptr<std::function<void()>>> wakes_;
  static constexpr size_t kCellsPerBlock = 512;
  std::vector<std::shared_ptr<void>> cell_blocks_;
  uint64_t* cells_ = nullptr;
  size_t cells_left_ = 0;
  cudaEvent_t event_ = nullptr;
};

}  // namespace

absl::StatusOr<std::unique_ptr<ChunkCoder>> MakeDeviceCoder(
    const std::string& spec, wire::DataType dtype, size_t count, int device, cudaStream_t stream,
    std::shared_ptr<DeviceResiduals> residuals, const std::string& feedback_name,
    PinnedAlloc pinned) {
  auto parsed = ParseCodec(spec);
  if (!parsed.ok()) return parsed.status();
  if (parsed->kind == CodecKind::kNone) return nullptr;
  std::unique_ptr<Codec> cpu = MakeCodec(*parsed);
  if (!cpu->Supports(dtype).ok()) return nullptr;
  return std::unique_ptr<ChunkCoder>(new DeviceChunkCoder(*parsed, std::move(cpu), dtype, count,
                                                          device, stream, std::move(residuals),
                                                          feedback_name, std::move(pinned)));
}

}  // namespace ciuic::daemon
