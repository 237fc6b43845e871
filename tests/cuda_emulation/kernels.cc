// daemon/cuda/kernels.h for the CUDA emulation: each function checks its
// arguments as the device one does, then enqueues its CPU reference on the
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

bool AlignedTo(const void* p, size_t a) { return reinterpret_cast<uintptr_t>(p) % a == 0; }

size_t FloatSize(DataType dtype) {
  switch (dtype) {
    case DataType::kFloat32:
      return 4;
    case DataType::kFloat64:
      return 8;
    case DataType::kFloat16:
    case DataType::kBFloat16:
      return 2;
    default:
      return 0;
  }
}

absl::Status NotFloat(const char* codec, DataType dtype) {
  return absl::InvalidArgumentError(absl::StrCat(
      "codec ", codec, ": dtype ", static_cast<uint32_t>(dtype), " is not a float format"));
}

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

absl::Status CheckWorkspace(const char* codec, const void* workspace, size_t have, size_t need) {
  if (have < need) {
    return absl::InvalidArgumentError(
        absl::StrCat("codec ", codec, ": workspace of ", have, " bytes, ", need, " needed"));
  }
  if (need != 0 && (workspace == nullptr || !AlignedTo(workspace, 256))) {
    return absl::InvalidArgumentError(
        absl::StrCat("codec ", codec, ": workspace must be 256-byte aligned device memory"));
  }
  return absl::OkStatus();
}

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
  const size_t size = wire::DataTypeSize(static_cast<uint32_t>(dtype));
  if (size == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("DeviceReduce: unknown data type ", static_cast<uint32_t>(dtype)));
  }
  if (wire::ReduceOpName(static_cast<uint32_t>(op)) == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("DeviceReduce: unknown reduce op ", static_cast<uint32_t>(op)));
  }
  if (num_inputs < 1 || num_inputs > kMaxReduceInputs || num_outputs < 1 ||
      num_outputs > kMaxReduceInputs) {
    return absl::InvalidArgumentError(absl::StrCat("DeviceReduce: ", num_inputs, " inputs and ",
                                                   num_outputs, " outputs (1 to ", kMaxReduceInputs,
                                                   " each)"));
  }
  if (count > SIZE_MAX / size) {
    return absl::InvalidArgumentError(absl::StrCat("DeviceReduce: count ", count, " too large"));
  }
  if (count == 0) return absl::OkStatus();
  if (device_inputs == nullptr || device_outputs == nullptr) {
    return absl::InvalidArgumentError("DeviceReduce: null buffer");
  }
  std::vector<const void*> in(device_inputs, device_inputs + num_inputs);
  std::vector<void*> out(device_outputs, device_outputs + num_outputs);
  for (const void* p : in) {
    if (p == nullptr || !AlignedTo(p, size)) {
      return absl::InvalidArgumentError(
          "DeviceReduce: an input is null or not aligned to its "
          "elements");
    }
  }
  for (void* p : out) {
    if (p == nullptr || !AlignedTo(p, size)) {
      return absl::InvalidArgumentError(
          "DeviceReduce: an output is null or not aligned to its "
          "elements");
    }
  }
  const size_t bytes = count * size;
  return Launched(cuda_emulation::Launch(stream,
                                         [=](int device) {
                                           Reach reach(device, "DeviceReduce");
                                           std::vector<const void*> hin;
                                           for (const void* p : in) hin.push_back(reach(p, bytes));
                                           std::vector<void*> hout;
                                           for (void* p : out) hout.push_back(reach(p, bytes));
                                           if (!reach.ok()) return;
                                           // The first output takes the reduction (in place
                                           // allowed); the others copy it, as the device kernel
                                           // stores one value to each.
                                           std::vector<char> first(bytes);
                                           reduce::Reduce(dtype, op, hin.data(),
                                                          static_cast<int>(hin.size()),
                                                          first.data(), count);
                                           for (void* o : hout) std::memcpy(o, first.data(), bytes);
                                         }),
                  "DeviceReduce launch");
}

absl::Status DeviceDivide(DataType dtype, void* device_data, size_t count, int divisor,
                          void* stream) {
  const size_t size = wire::DataTypeSize(static_cast<uint32_t>(dtype));
  if (size == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("DeviceDivide: unknown data type ", static_cast<uint32_t>(dtype)));
  }
  if (divisor < 1)
    return absl::InvalidArgumentError(absl::StrCat("DeviceDivide: divisor ", divisor));
  if (count == 0) return absl::OkStatus();
  if (device_data == nullptr || !AlignedTo(device_data, size)) {
    return absl::InvalidArgumentError("DeviceDivide: null or misaligned buffer");
  }
  return Launched(cuda_emulation::Launch(stream,
                                         [=](int device) {
                                           Reach reach(device, "DeviceDivide");
                                           void* d = reach(device_data, count * size);
                                           if (!reach.ok()) return;
                                           reduce::DivideInPlace(dtype, d, count, divisor);
                                         }),
                  "DeviceDivide launch");
}

absl::Status DeviceCastEncode(CastFormat format, DataType dtype, const void* device_in,
                              size_t count, void* device_out, void* stream) {
  const char* name = format == CastFormat::kFp16 ? "fp16" : "bf16";
  const DataType narrow = format == CastFormat::kFp16 ? DataType::kFloat16 : DataType::kBFloat16;
  if (dtype != DataType::kFloat32 && dtype != narrow) return NotFloat(name, dtype);
  if (count == 0) return absl::OkStatus();
  if (device_in == nullptr || device_out == nullptr || !AlignedTo(device_out, 2)) {
    return absl::InvalidArgumentError(absl::StrCat("codec ", name, ": null or misaligned buffer"));
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
  const char* name = format == CastFormat::kFp16 ? "fp16" : "bf16";
  const DataType narrow = format == CastFormat::kFp16 ? DataType::kFloat16 : DataType::kBFloat16;
  if (dtype != DataType::kFloat32 && dtype != narrow) return NotFloat(name, dtype);
  if (bytes != 2 * count) {
    return absl::InvalidArgumentError(
        absl::StrCat("codec ", name, ": ", bytes, " bytes for ", count, " elements"));
  }
  if (count == 0) return absl::OkStatus();
  if (device_in == nullptr || device_out == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat("codec ", name, ": null buffer"));
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
  return 256 + ((Int8Blocks(count) + 1) * sizeof(uint64_t) + 255) / 256 * 256;
}

absl::Status DeviceInt8Encode(DataType dtype, const void* device_in, size_t count, void* device_out,
                              void* device_workspace, size_t workspace_bytes,
                              uint64_t* device_encoded_bytes, void* stream) {
  const size_t size = FloatSize(dtype);
  if (size == 0) return NotFloat("int8", dtype);
  if (device_encoded_bytes == nullptr || !AlignedTo(device_encoded_bytes, 8)) {
    return absl::InvalidArgumentError(
        "codec int8: the encoded size needs an 8-byte aligned device word");
  }
  if (count != 0) {
    if (device_in == nullptr || !AlignedTo(device_in, size) || device_out == nullptr ||
        !AlignedTo(device_out, 4)) {
      return absl::InvalidArgumentError(
          "codec int8: null or misaligned buffer (input aligned to "
          "its elements, output to 4 bytes)");
    }
    absl::StatusOr<size_t> need = Int8EncodeWorkspaceBytes(count);
    if (!need.ok()) return need.status();
    if (absl::Status s = CheckWorkspace("int8", device_workspace, workspace_bytes, *need);
        !s.ok()) {
      return s;
    }
  }
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
  return 256 + (Int8Blocks(count) * sizeof(uint64_t) + 255) / 256 * 256;
}

absl::Status DeviceInt8Decode(DataType dtype, const void* device_in, size_t bytes, size_t count,
                              void* device_out, bool add, void* device_workspace,
                              size_t workspace_bytes, void* stream, bool trusted) {
  const size_t size = FloatSize(dtype);
  if (size == 0) return NotFloat("int8", dtype);
  if (count == 0) {
    if (bytes != 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("codec int8: ", bytes, " trailing bytes after 0 elements"));
    }
    return absl::OkStatus();
  }
  if (device_in == nullptr || !AlignedTo(device_in, 4) || device_out == nullptr ||
      !AlignedTo(device_out, size)) {
    return absl::InvalidArgumentError(
        "codec int8: null or misaligned buffer (input aligned to 4 "
        "bytes, output to its elements)");
  }
  if (absl::Status s = CheckWorkspace("int8", device_workspace, workspace_bytes,
                                      Int8DecodeWorkspaceBytes(count));
      !s.ok()) {
    return s;
  }
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
  return 512 + (count * sizeof(uint64_t) + 255) / 256 * 256;
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
  const size_t size = FloatSize(dtype);
  if (size == 0) return NotFloat("topk", dtype);
  if (count > UINT32_MAX) {
    return absl::InvalidArgumentError(
        absl::StrCat("codec topk: ", count, " elements (limit 2^32 - 1)"));
  }
  if (count == 0 ? k != 0 : (k < 1 || k > count)) {
    return absl::InvalidArgumentError(
        absl::StrCat("codec topk: k = ", k, " for ", count, " elements"));
  }
  if (count == 0) return absl::OkStatus();
  if (device_in == nullptr || !AlignedTo(device_in, size) || device_out == nullptr ||
      !AlignedTo(device_out, 4)) {
    return absl::InvalidArgumentError(
        "codec topk: null or misaligned buffer (input aligned to "
        "its elements, output to 4 bytes)");
  }
  if (k != count) {
    absl::StatusOr<size_t> need = TopKEncodeWorkspaceBytes(count);
    if (!need.ok()) return need.status();
    if (absl::Status s = CheckWorkspace("topk", device_workspace, workspace_bytes, *need);
        !s.ok()) {
      return s;
    }
  }
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
  const size_t size = FloatSize(dtype);
  if (size == 0) return NotFloat("topk", dtype);
  const size_t pair = 4 + size;
  if (bytes % pair != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "codec topk: ", bytes, " bytes is not a whole number of ", pair, "-byte entries"));
  }
  if (bytes / pair > count) {
    return absl::InvalidArgumentError(
        absl::StrCat("codec topk: ", bytes / pair, " entries for ", count, " elements"));
  }
  if (count == 0) return absl::OkStatus();
  if ((bytes != 0 && (device_in == nullptr || !AlignedTo(device_in, 4))) || device_out == nullptr ||
      !AlignedTo(device_out, size)) {
    return absl::InvalidArgumentError(
        "codec topk: null or misaligned buffer (input aligned to 4 "
        "bytes, output to its elements)");
  }
  if (absl::Status s =
          CheckWorkspace("topk", device_workspace, workspace_bytes, TopKDecodeWorkspaceBytes());
      !s.ok()) {
    return s;
  }
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
  if (count == 0) return absl::OkStatus();
  if (device_residual == nullptr || device_data == nullptr) {
    return absl::InvalidArgumentError("error feedback: null buffer");
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
  if (count == 0) return absl::OkStatus();
  if (device_with_residual == nullptr || device_decoded == nullptr || device_residual == nullptr) {
    return absl::InvalidArgumentError("error feedback: null buffer");
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
