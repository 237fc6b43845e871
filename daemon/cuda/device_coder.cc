// DeviceResiduals and the device ChunkCoder: see device_coder.h.
#include "cuda/device_coder.h"

#include <algorithm>

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
  cudaFree(data);  // synchronises the device: no kernel still uses it
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
      it = entries_.end();
    }
    if (it != entries_.end()) {
      lru_.splice(lru_.begin(), lru_, it->second.lru);
      return it->second.residual;
    }
    if (bytes > max_bytes_) return nullptr;
    while (bytes_ + bytes > max_bytes_ && !lru_.empty()) {
      EraseLocked(entries_.find(lru_.back()), &dropped);
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
                   std::string name)
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
        encoded_(stream),
        received_(stream),
        decoded_(stream),
        workspace_(stream),
        size_(stream) {}
  ~DeviceChunkCoder() override {
    cudaSetDevice(device_);
    // The buffers go back on the stream, after the work that uses them.
    if (event_ != nullptr) cudaEventDestroy(event_);
  }

  absl::StatusOr<uint64_t> Encode(void* data, size_t first, size_t count, bool own_sum,
                                  void* out) override {
    if (absl::Status s = Current(); !s.ok()) return s;
    const std::string key = own_sum ? name_ + "#owner" : name_;
    if (residuals_ != nullptr) {
      if (auto r = residuals_->Find(key, count_, device_); r != nullptr) {
        absl::Status s = gpu::DeviceErrorFeedbackApply(r->data + first, static_cast<float*>(data),
                                                       count, stream_);
        if (!s.ok()) return s;
      }
    }
    auto encoded = encoded_.Get(cpu_->MaxEncodedBytes(dtype_, count));
    if (!encoded.ok()) return encoded.status();
    auto bytes = EncodeOnDevice(data, count, *encoded);
    if (!bytes.ok()) return bytes.status();
    if (absl::Status s =
            Cuda(cudaMemcpyAsync(out, *encoded, *bytes, cudaMemcpyDeviceToHost, stream_),
                 "cudaMemcpyAsync of the encoding to the host");
        !s.ok()) {
      return s;
    }
    if (absl::Status s = WaitForStream(stream_, &event_, "encoding a chunk"); !s.ok()) return s;
    if (residuals_ == nullptr && !own_sum) return *bytes;
    // What the receivers will see: the residual's other half, and the
    // owner's own copy of its sum.
    void* target = data;
    if (residuals_ != nullptr) {
      auto d = decoded_.Get(count * es_);
      if (!d.ok()) return d.status();
      target = *d;
    }
    if (absl::Status s = DecodeOnDevice(*encoded, *bytes, count, target, false); !s.ok()) {
      return absl::InternalError(absl::StrCat("own encoding does not decode: ", s.message()));
    }
    if (residuals_ != nullptr) {
      auto r = residuals_->ForUpdate(key, count_, device_, stream_);
      if (!r.ok()) return r.status();
      if (*r != nullptr) {
        absl::Status s = gpu::DeviceErrorFeedbackUpdate(static_cast<const float*>(data),
                                                        static_cast<const float*>(target),
                                                        (*r)->data + first, count, stream_);
        if (!s.ok()) return s;
      }
      if (own_sum) {
        absl::Status s =
            Cuda(cudaMemcpyAsync(data, target, count * es_, cudaMemcpyDeviceToDevice, stream_),
                 "cudaMemcpyAsync of the decoded sum");
        if (!s.ok()) return s;
      }
    }
    return *bytes;
  }

  absl::Status Decode(const void* in, uint64_t bytes, size_t count, void* data, bool add) override {
    if (absl::Status s = Current(); !s.ok()) return s;
    if (bytes > cpu_->MaxEncodedBytes(dtype_, count)) {
      return absl::InvalidArgumentError(
          absl::StrCat("codec ", CodecName(spec_), ": ", bytes, " bytes for ", count, " elements"));
    }
    auto received = received_.Get(bytes);
    if (!received.ok()) return received.status();
    if (absl::Status s =
            Cuda(cudaMemcpyAsync(*received, in, bytes, cudaMemcpyHostToDevice, stream_),
                 "cudaMemcpyAsync of an encoding to the device");
        !s.ok()) {
      return s;
    }
    // The caller reuses `in` once this returns.
    if (absl::Status s = WaitForStream(stream_, &event_, "copying a chunk in"); !s.ok()) return s;
    return DecodeOnDevice(*received, bytes, count, data, add);
  }

 private:
  absl::Status Current() {
    return Cuda(cudaSetDevice(device_), absl::StrCat("cudaSetDevice(", device_, ")"));
  }

  absl::StatusOr<uint64_t> EncodeOnDevice(const void* data, size_t count, void* out) {
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
        uint64_t bytes = 0;
        s = Cuda(
            cudaMemcpyAsync(&bytes, device_size, sizeof(bytes), cudaMemcpyDeviceToHost, stream_),
            "cudaMemcpyAsync of the encoded size");
        if (!s.ok()) return s;
        if (s = WaitForStream(stream_, &event_, "int8 encoding"); !s.ok()) return s;
        if (bytes > cpu_->MaxEncodedBytes(dtype_, count)) {
          return absl::InternalError(
              absl::StrCat("int8 encoded ", count, " elements into ", bytes, " bytes"));
        }
        return bytes;
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

  // `in` is device memory.
  absl::Status DecodeOnDevice(const void* in, uint64_t bytes, size_t count, void* data, bool add) {
    switch (spec_.kind) {
      case CodecKind::kFp16:
      case CodecKind::kBf16:
        return gpu::DeviceCastDecode(Format(), dtype_, in, bytes, count, data, add, stream_);
      case CodecKind::kInt8: {
        const size_t ws_bytes = gpu::Int8DecodeWorkspaceBytes(count);
        auto ws = workspace_.Get(ws_bytes);
        if (!ws.ok()) return ws.status();
        return gpu::DeviceInt8Decode(dtype_, in, bytes, count, data, add, *ws, ws_bytes, stream_);
      }
      case CodecKind::kTopK: {
        const size_t ws_bytes = gpu::TopKDecodeWorkspaceBytes();
        auto ws = workspace_.Get(ws_bytes);
        if (!ws.ok()) return ws.status();
        return gpu::DeviceTopKDecode(dtype_, in, bytes, count, data, add, *ws, ws_bytes, stream_);
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
  const std::unique_ptr<Codec> cpu_;  // sizes only
  const wire::DataType dtype_;
  const size_t es_;
  const size_t count_;  // the operation's, for the residuals
  const int device_;
  const cudaStream_t stream_;
  const std::shared_ptr<DeviceResiduals> residuals_;  // null: no error feedback
  const std::string name_;
  StreamBuffer encoded_, received_, decoded_, workspace_, size_;
  cudaEvent_t event_ = nullptr;
};

}  // namespace

absl::StatusOr<std::unique_ptr<ChunkCoder>> MakeDeviceCoder(
    const std::string& spec, wire::DataType dtype, size_t count, int device, cudaStream_t stream,
    std::shared_ptr<DeviceResiduals> residuals, const std::string& feedback_name) {
  auto parsed = ParseCodec(spec);
  if (!parsed.ok()) return parsed.status();
  if (parsed->kind == CodecKind::kNone) return nullptr;
  std::unique_ptr<Codec> cpu = MakeCodec(*parsed);
  if (!cpu->Supports(dtype).ok()) return nullptr;
  return std::unique_ptr<ChunkCoder>(new DeviceChunkCoder(
      *parsed, std::move(cpu), dtype, count, device, stream, std::move(residuals), feedback_name));
}

}  // namespace ciuic::daemon
