// daemon/cuda/kernels.h for the CUDA emulation: each function checks its
// arguments with the device one's checks (kernel_args.h), then enqueues its
// CPU reference on the
// stream (reduce/reduce.h, compression's codecs, error feedback's loops),
// reading and writing device memory through the emulation's aliases. So
// results are the CPU's bits, which the real kernels reproduce
// (kernels_test on a GPU); what this tests is everything around them.
#include "cuda/kernels.h"

#include <algorithm>
#include <bit>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "compression/codec.h"
#include "cuda/kernel_args.h"
#include "cuda/launch.h"
#include "emulation.h"
#include "reduce/reduce.h"

namespace ciuic::daemon::gpu {
namespace {

using cuda_emulation::Access;
using cuda_emulation::Fault;
using wire::DataType;
using wire::ReduceOp;

// Every pointer of a piece of work, resolved on its device at run time; a
// fault names `what` when one is out of the device's reach.
class Reach {
 public:
  Reach(int device, const char* what) : device_(device), what_(what) {}
  template <typename T>
  T* operator()(T* p, size_t bytes) {
    void* h = Access(p, bytes, device_);
    if (h == nullptr && bytes != 0) {
      if (ok_) {
        Fault(absl::StrCat(what_, " touched ", bytes, " bytes at ",
                           absl::Hex(reinterpret_cast<uintptr_t>(p)), ", which device ", device_,
                           " cannot reach"));
      }
      ok_ = false;
    }
    return static_cast<T*>(h);
  }
  bool ok() const { return ok_; }

 private:
  int device_;
  const char* what_;
  bool ok_ = true;
};

absl::Status Launched(cudaError_t e, const char* what) { return CudaStatus(e, what); }

const Codec& Int8() {
  static const std::unique_ptr<Codec> c = MakeCodec({CodecKind::kInt8, 0});
  return *c;
}
const Codec& Cast(CastFormat f) {
  static const std::unique_ptr<Codec> fp16 = MakeCodec({CodecKind::kFp16, 0});
  static const std::unique_ptr<Codec> bf16 = MakeCodec({CodecKind::kBf16, 0});
  return f == CastFormat::kFp16 ? *fp16 : *bf16;
}
const Codec& TopKDecoder() {
  static const std::unique_ptr<Codec> c = MakeCodec({CodecKind::kTopK, 1.0});
  return *c;
}

size_t Int8Blocks(size_t count) { return ItemsFor(count, 256); }

// A decoder of untrusted bytes: runs on the stream and waits for its verdict,
// as the device decoders do.
absl::Status DecodeAndWait(void* stream, const char* what,
                           std::function<absl::Status(int device)> decode) {
  auto verdict = std::make_shared<absl::Status>();
  if (absl::Status s = Launched(
          cuda_emulation::Launch(stream, [verdict, decode](int d) { *verdict = decode(d); }), what);
      !s.ok()) {
    return s;
  }
  if (absl::Status s = CudaStatus(cudaStreamSynchronize(static_cast<cudaStream_t>(stream)), what);
      !s.ok()) {
    return s;
  }
  return *verdict;
}

// A decoder of trusted bytes: enqueued, not waited for; a failure is a
// broken invariant, shown as a device fault.
absl::Status DecodeTrusted(void* stream, const char* what,
                           std::function<absl::Status(int device)> decode) {
  return Launched(
      cuda_emulation::Launch(stream,
                             [decode, what](int d) {
                               absl::Status s = decode(d);
                               if (!s.ok()) {
                                 Fault(absl::StrCat(what, " of trusted input: ", s.ToString()));
                               }
                             }),
      what);
}

}  // namespace

absl::Status DeviceReduce(DataType dtype, ReduceOp op, const void* const* device_inputs,
                          int num_inputs, void* device_out, size_t count, void* stream) {
  void* const outputs[1] = {device_out};
  return DeviceReduceToAll(dtype, op, device_inputs, num_inputs, outputs, 1, count, stream);
}

absl::Status DeviceReduceToAll(DataType dtype, ReduceOp op, const void* const* device_inputs,
                               int num_inputs, void* const* device_outputs, int num_outputs,
                               size_t count, void* stream) {
  if (absl::Status s =
          CheckReduce(dtype, op, device_inputs, num_inputs, device_outputs, num_outputs, count);
      !s.ok() || count == 0) {
    return s;
  }
  std::vector<const void*> in(device_inputs, device_inputs + num_inputs);
  std::vector<void*> out(device_outputs, device_outputs + num_outputs);
  const size_t bytes = count * wire::DataTypeSize(static_cast<uint32_t>(dtype));
  return Launched(cuda_emulation::Launch(stream,
                                         [=](int device) {
                                           Reach reach(device, "DeviceReduce");
                                           std::vector<const void*> hin;
                                           for (const void* p : in) hin.push_back(reach(p, bytes));
                                           std::vector<void*> hout;
                                           for (void* p : out) hout.push_back(reach(p, bytes));
                                           if (!reach.ok()) return;
                                           // Reduced once (in place allowed), then stored to every
                                           // output, as the device kernel stores one value to each.
                                           std::vector<char> result(bytes);
                                           reduce::Reduce(dtype, op, hin.data(),
                                                          static_cast<int>(hin.size()),
                                                          result.data(), count);
                                           for (void* o : hout)
                                             std::memcpy(o, result.data(), bytes);
                                         }),
                  "DeviceReduce launch");
}

absl::Status DeviceDivide(DataType dtype, void* device_data, size_t count, int divisor,
                          void* stream) {
  if (absl::Status s = CheckDivide(dtype, device_data, count, divisor); !s.ok() || count == 0) {
    return s;
  }
  const size_t bytes = count * wire::DataTypeSize(static_cast<uint32_t>(dtype));
  return Launched(cuda_emulation::Launch(stream,
                                         [=](int device) {
                                           Reach reach(device, "DeviceDivide");
                                           void* d = reach(device_data, bytes);
                                           if (!reach.ok()) return;
                                           reduce::DivideInPlace(dtype, d, count, divisor);
                                         }),
                  "DeviceDivide launch");
}

absl::Status DeviceCastEncode(CastFormat format, DataType dtype, const void* device_in,
                              size_t count, void* device_out, void* stream) {
  if (absl::Status s = CheckCastEncode(format, dtype, device_in, count, device_out);
      !s.ok() || count == 0) {
    return s;
  }
  const size_t in_bytes = count * wire::DataTypeSize(static_cast<uint32_t>(dtype));
  return Launched(cuda_emulation::Launch(stream,
                                         [=](int device) {
                                           Reach reach(device, "DeviceCastEncode");
                                           const void* in = reach(device_in, in_bytes);
                                           void* out = reach(device_out, 2 * count);
                                           if (!reach.ok()) return;
                                           Cast(format).Encode(dtype, in, count, out);
                                         }),
                  "cast encode launch");
}

absl::Status DeviceCastDecode(CastFormat format, DataType dtype, const void* device_in,
                              size_t bytes, size_t count, void* device_out, bool add,
                              void* stream) {
  if (absl::Status s = CheckCastDecode(format, dtype, device_in, bytes, count, device_out);
      !s.ok() || count == 0) {
    return s;
  }
  const size_t out_bytes = count * wire::DataTypeSize(static_cast<uint32_t>(dtype));
  return DecodeTrusted(stream, "cast decode", [=](int device) -> absl::Status {
    Reach reach(device, "DeviceCastDecode");
    const void* in = reach(device_in, bytes);
    void* out = reach(device_out, out_bytes);
    if (!reach.ok()) return absl::OkStatus();  // faulted already
    return add ? Cast(format).DecodeAdd(dtype, in, bytes, count, out)
               : Cast(format).Decode(dtype, in, bytes, count, out);
  });
}

size_t Int8MaxEncodedBytes(DataType dtype, size_t count) {
  const size_t size = FloatSize(dtype);
  return size == 0 ? 0 : Int8Blocks(count) * 4 + count * size;
}

absl::StatusOr<size_t> Int8EncodeWorkspaceBytes(size_t count) {
  int devices = 0;
  if (absl::Status s = CudaStatus(cudaGetDeviceCount(&devices), "int8 workspace sizing"); !s.ok()) {
    return s;
  }
  return 256 + RoundUp256((Int8Blocks(count) + 1) * sizeof(uint64_t));
}

absl::Status DeviceInt8Encode(DataType dtype, const void* device_in, size_t count, void* device_out,
                              void* device_workspace, size_t workspace_bytes,
                              uint64_t* device_encoded_bytes, void* stream) {
  if (absl::Status s = CheckInt8Encode(dtype, device_in, count, device_out, device_encoded_bytes);
      !s.ok()) {
    return s;
  }
  if (count != 0) {
    absl::StatusOr<size_t> need = Int8EncodeWorkspaceBytes(count);
    if (!need.ok()) return need.status();
    if (absl::Status s = CheckWorkspace("int8", device_workspace, workspace_bytes, *need);
        !s.ok()) {
      return s;
    }
  }
  const size_t size = FloatSize(dtype);
  const size_t max_bytes = Int8MaxEncodedBytes(dtype, count);
  return Launched(
      cuda_emulation::Launch(stream,
                             [=](int device) {
                               Reach reach(device, "DeviceInt8Encode");
                               auto* word = reach(device_encoded_bytes, sizeof(uint64_t));
                               const void* in = reach(device_in, count * size);
                               void* out = reach(device_out, max_bytes);
                               if (!reach.ok()) return;
                               *word = count == 0 ? 0 : Int8().Encode(dtype, in, count, out);
                             }),
      "int8 encode launch");
}

size_t Int8DecodeWorkspaceBytes(size_t count) {
  return 256 + RoundUp256(Int8Blocks(count) * sizeof(uint64_t));
}

absl::Status DeviceInt8Decode(DataType dtype, const void* device_in, size_t bytes, size_t count,
                              void* device_out, bool add, void* device_workspace,
                              size_t workspace_bytes, void* stream, bool trusted) {
  if (absl::Status s = CheckInt8Decode(dtype, device_in, bytes, count, device_out);
      !s.ok() || count == 0) {
    return s;
  }
  if (absl::Status s = CheckWorkspace("int8", device_workspace, workspace_bytes,
                                      Int8DecodeWorkspaceBytes(count));
      !s.ok()) {
    return s;
  }
  const size_t size = FloatSize(dtype);
  auto decode = [=](int device) -> absl::Status {
    Reach reach(device, "DeviceInt8Decode");
    const void* in = reach(device_in, bytes);
    void* out = reach(device_out, count * size);
    if (!reach.ok()) return absl::OkStatus();  // faulted already
    return add ? Int8().DecodeAdd(dtype, in, bytes, count, out)
               : Int8().Decode(dtype, in, bytes, count, out);
  };
  return trusted ? DecodeTrusted(stream, "int8 decode", decode)
                 : DecodeAndWait(stream, "int8 decode", decode);
}

absl::StatusOr<size_t> TopKEncodeWorkspaceBytes(size_t count) {
  int devices = 0;
  if (absl::Status s = CudaStatus(cudaGetDeviceCount(&devices), "topk workspace sizing"); !s.ok()) {
    return s;
  }
  return 512 + RoundUp256(count * sizeof(uint64_t));
}

namespace {

// The k largest magnitudes (ties: lowest index), in index order: the device
// encoder's selection, written plainly.
template <typename Storage, typename Bits, Bits kAbsMask>
void TopK(const void* in_v, size_t count, size_t k, unsigned char* out) {
  const auto* in = static_cast<const Storage*>(in_v);
  std::vector<Bits> mag(count);
  for (size_t i = 0; i < count; ++i) {
    Bits b;
    std::memcpy(&b, &in[i], sizeof(b));
    mag[i] = static_cast<Bits>(b & kAbsMask);
  }
  std::vector<Bits> sorted = mag;
  std::nth_element(sorted.begin(), sorted.begin() + static_cast<ptrdiff_t>(k - 1), sorted.end(),
                   [](Bits a, Bits b) { return a > b; });
  const Bits threshold = sorted[k - 1];
  size_t above = 0;
  for (Bits m : mag) above += m > threshold ? 1 : 0;
  size_t ties = k - above;
  size_t j = 0;
  auto* idx = reinterpret_cast<uint32_t*>(out);
  auto* val = reinterpret_cast<Storage*>(out + 4 * k);
  for (size_t i = 0; i < count && j < k; ++i) {
    const bool take = mag[i] > threshold || (mag[i] == threshold && ties > 0);
    if (!take) continue;
    if (mag[i] == threshold) --ties;
    idx[j] = static_cast<uint32_t>(i);
    val[j] = in[i];
    ++j;
  }
}

}  // namespace

absl::Status DeviceTopKEncode(DataType dtype, const void* device_in, size_t count, size_t k,
                              void* device_out, void* device_workspace, size_t workspace_bytes,
                              void* stream) {
  if (absl::Status s = CheckTopKEncode(dtype, device_in, count, k, device_out);
      !s.ok() || count == 0) {
    return s;
  }
  if (k != count) {
    absl::StatusOr<size_t> need = TopKEncodeWorkspaceBytes(count);
    if (!need.ok()) return need.status();
    if (absl::Status s = CheckWorkspace("topk", device_workspace, workspace_bytes, *need);
        !s.ok()) {
      return s;
    }
  }
  const size_t size = FloatSize(dtype);
  return Launched(cuda_emulation::Launch(
                      stream,
                      [=](int device) {
                        Reach reach(device, "DeviceTopKEncode");
                        const void* in = reach(device_in, count * size);
                        auto* out = reach(static_cast<unsigned char*>(device_out), k * (4 + size));
                        if (!reach.ok()) return;
                        switch (dtype) {
                          case DataType::kFloat32:
                            return TopK<float, uint32_t, 0x7fffffffu>(in, count, k, out);
                          case DataType::kFloat64:
                            return TopK<double, uint64_t, 0x7fffffffffffffffull>(in, count, k, out);
                          default:
                            return TopK<uint16_t, uint16_t, 0x7fff>(in, count, k, out);
                        }
                      }),
                  "topk encode launch");
}

size_t TopKDecodeWorkspaceBytes() { return 256; }

absl::Status DeviceTopKDecode(DataType dtype, const void* device_in, size_t bytes, size_t count,
                              void* device_out, bool add, void* device_workspace,
                              size_t workspace_bytes, void* stream, bool trusted) {
  if (absl::Status s = CheckTopKDecode(dtype, device_in, bytes, count, device_out);
      !s.ok() || count == 0) {
    return s;
  }
  if (absl::Status s =
          CheckWorkspace("topk", device_workspace, workspace_bytes, TopKDecodeWorkspaceBytes());
      !s.ok()) {
    return s;
  }
  const size_t size = FloatSize(dtype);
  auto decode = [=](int device) -> absl::Status {
    Reach reach(device, "DeviceTopKDecode");
    const void* in = reach(device_in, bytes);
    void* out = reach(device_out, count * size);
    if (!reach.ok()) return absl::OkStatus();  // faulted already
    return add ? TopKDecoder().DecodeAdd(dtype, in, bytes, count, out)
               : TopKDecoder().Decode(dtype, in, bytes, count, out);
  };
  return trusted ? DecodeTrusted(stream, "topk decode", decode)
                 : DecodeAndWait(stream, "topk decode", decode);
}

absl::Status DeviceErrorFeedbackApply(const float* device_residual, float* device_data,
                                      size_t count, void* stream) {
  if (absl::Status s = CheckErrorFeedback(count, device_residual, device_data, device_data);
      !s.ok() || count == 0) {
    return s;
  }
  return Launched(cuda_emulation::Launch(stream,
                                         [=](int device) {
                                           Reach reach(device, "DeviceErrorFeedbackApply");
                                           const float* r = reach(device_residual, 4 * count);
                                           float* d = reach(device_data, 4 * count);
                                           if (!reach.ok()) return;
                                           for (size_t i = 0; i < count; ++i) d[i] += r[i];
                                         }),
                  "error feedback apply launch");
}

absl::Status DeviceErrorFeedbackUpdate(const float* device_with_residual,
                                       const float* device_decoded, float* device_residual,
                                       size_t count, void* stream) {
  if (absl::Status s =
          CheckErrorFeedback(count, device_with_residual, device_decoded, device_residual);
      !s.ok() || count == 0) {
    return s;
  }
  return Launched(cuda_emulation::Launch(stream,
                                         [=](int device) {
                                           Reach reach(device, "DeviceErrorFeedbackUpdate");
                                           const float* a = reach(device_with_residual, 4 * count);
                                           const float* b = reach(device_decoded, 4 * count);
                                           float* r = reach(device_residual, 4 * count);
                                           if (!reach.ok()) return;
                                           for (size_t i = 0; i < count; ++i) {
                                             const float d = a[i] - b[i];
                                             const uint32_t bits = std::bit_cast<uint32_t>(d);
                                             r[i] = (bits & 0x7f800000u) != 0x7f800000u ? d : 0.0f;
                                           }
                                         }),
                  "error feedback update launch");
}

}  // namespace ciuic::daemon::gpu
