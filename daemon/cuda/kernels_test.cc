// The device kernels against their CPU references (kernels.h), on a GPU:
// every dtype x reduce op, every codec and float format, sizes 0, 1, odd,
// not a multiple of the vector or block width, and large. Labelled `gpu` in
// ctest; without a usable device every test skips with "no CUDA device:
// <reason>".
#include "cuda/kernels.h"

#include <cuda_runtime_api.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "compression/codec.h"
#include "compression/error_feedback.h"
#include "gtest/gtest.h"
#include "reduce/half.h"
#include "reduce/reduce.h"

namespace ciuic::daemon::gpu {
namespace {

using wire::DataType;
using wire::ReduceOp;

constexpr auto& kAllTypes = wire::kAllDataTypes;
constexpr DataType kFloatTypes[] = {DataType::kFloat32, DataType::kFloat64, DataType::kFloat16,
                                    DataType::kBFloat16};
constexpr auto& kAllOps = wire::kAllReduceOps;
// 0, 1, odd, not a multiple of the 16-byte vectors or of the int8 blocks, and
// large (one grid pass: LargeCountsLoopOverTheGrid has several).
constexpr size_t kCounts[] = {0, 1, 7, 255, 256, 257, 4099, 1000003};

std::string NoDeviceReason() {
  int n = 0;
  const cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess) return cudaGetErrorString(e);
  if (n == 0) return "cudaGetDeviceCount found 0 devices";
  return "";
}

class GpuTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const std::string reason = NoDeviceReason();
    if (!reason.empty()) {
      // tools/gpu-check.sh sets CIUIC_REQUIRE_GPU=1: there a skip would pass
      // while testing nothing.
      const char* required = std::getenv("CIUIC_REQUIRE_GPU");
      if (required != nullptr && std::string(required) == "1") {
        FAIL() << "no CUDA device: " << reason;
      }
      GTEST_SKIP() << "no CUDA device: " << reason;
    }
    ASSERT_EQ(cudaStreamCreate(&stream_), cudaSuccess);
  }
  void TearDown() override {
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
  }
  void Sync() { ASSERT_EQ(cudaStreamSynchronize(stream_), cudaSuccess); }
  cudaStream_t stream_ = nullptr;
};

// Device memory holding a copy of host bytes; `offset` shifts the start to
// test unaligned buffers.
class DeviceBuffer {
 public:
  explicit DeviceBuffer(size_t bytes, size_t offset = 0) : bytes_(bytes) {
    EXPECT_EQ(cudaMalloc(&base_, bytes + offset + 16), cudaSuccess);
    ptr_ = static_cast<unsigned char*>(base_) + offset;
  }
  DeviceBuffer(const void* host, size_t bytes, size_t offset = 0) : DeviceBuffer(bytes, offset) {
    if (bytes != 0) {
      EXPECT_EQ(cudaMemcpy(ptr_, host, bytes, cudaMemcpyHostToDevice), cudaSuccess);
    }
  }
  ~DeviceBuffer() { cudaFree(base_); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  void* get() const { return ptr_; }
  std::vector<unsigned char> Download(size_t bytes) const {
    std::vector<unsigned char> out(bytes);
    if (bytes != 0) {
      EXPECT_EQ(cudaMemcpy(out.data(), ptr_, bytes, cudaMemcpyDeviceToHost), cudaSuccess);
    }
    return out;
  }
  std::vector<unsigned char> Download() const { return Download(bytes_); }

 private:
  void* base_ = nullptr;
  unsigned char* ptr_ = nullptr;
  size_t bytes_;
};

size_t SizeOf(DataType t) { return wire::DataTypeSize(static_cast<uint32_t>(t)); }

bool IsNaN(DataType t, const unsigned char* p) {
  switch (t) {
    case DataType::kFloat32: { float f; std::memcpy(&f, p, 4); return std::isnan(f); }
    case DataType::kFloat64: { double d; std::memcpy(&d, p, 8); return std::isnan(d); }
    case DataType::kFloat16: { uint16_t h; std::memcpy(&h, p, 2); return (h & 0x7fff) > 0x7c00; }
    case DataType::kBFloat16: { uint16_t h; std::memcpy(&h, p, 2); return (h & 0x7fff) > 0x7f80; }
    default: return false;
  }
}

// Element-wise bit equality, except that any NaN equals any NaN (kernels.h).
void ExpectSameElements(DataType t, const std::vector<unsigned char>& want,
                        const std::vector<unsigned char>& got, const std::string& what) {
  ASSERT_EQ(want.size(), got.size()) << what;
  const size_t size = SizeOf(t);
  size_t mismatches = 0;
  for (size_t i = 0; i < want.size(); i += size) {
    if (std::memcmp(&want[i], &got[i], size) == 0) continue;
    if (IsNaN(t, &want[i]) && IsNaN(t, &got[i])) continue;
    if (++mismatches <= 3) ADD_FAILURE() << what << ": element " << i / size << " differs";
  }
  EXPECT_EQ(mismatches, 0u) << what;
}

// Random elements: integers are random bits; floats are about normal with
// standard deviation `scale` (a sum of four uniforms, cheaper than
// std::normal_distribution: the large counts make millions), and with
// `specials`, one in 200 is NaN, Inf, -0, a float subnormal or a binary16
// subnormal.
std::vector<unsigned char> RandomElements(DataType t, size_t count, std::mt19937_64& rng,
                                          bool specials = true, double scale = 10) {
  std::vector<unsigned char> out(count * SizeOf(t));
  uint64_t state = rng();
  auto next = [&state] {  // splitmix64
    uint64_t z = (state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  };
  const bool floating = t == DataType::kFloat32 || t == DataType::kFloat64 ||
                        t == DataType::kFloat16 || t == DataType::kBFloat16;
  for (size_t i = 0; i < count; ++i) {
    unsigned char* p = &out[i * SizeOf(t)];
    const uint64_t bits = next();
    if (!floating) {
      std::memcpy(p, &bits, SizeOf(t));
      continue;
    }
    double sum = 0;
    for (int j = 0; j < 4; ++j) sum += static_cast<double>((bits >> (16 * j)) & 0xffff) / 65536.0;
    double v = (sum - 2.0) * 1.7320508075688772 * scale;  // variance 4/12, times 3
    if (specials) {
      const uint64_t r = next() % 1000;
      if (r == 0) v = std::numeric_limits<double>::quiet_NaN();
      else if (r == 1) v = std::numeric_limits<double>::infinity();
      else if (r == 2) v = -0.0;
      else if (r == 3) v = 1e-41;  // float subnormal; 0 in 16 bits
      else if (r == 4) v = 3e-6;   // binary16 subnormal
    }
    switch (t) {
      case DataType::kFloat32: { const float f = static_cast<float>(v); std::memcpy(p, &f, 4); break; }
      case DataType::kFloat64: std::memcpy(p, &v, 8); break;
      case DataType::kFloat16: {
        const uint16_t h = FloatToHalf(static_cast<float>(v));
        std::memcpy(p, &h, 2);
        break;
      }
      default: {
        const uint16_t h = FloatToBFloat16(static_cast<float>(v));
        std::memcpy(p, &h, 2);
        break;
      }
    }
  }
  return out;
}

std::string Name(DataType t) { return wire::DataTypeName(static_cast<uint32_t>(t)); }
std::string Name(ReduceOp op) { return wire::ReduceOpName(static_cast<uint32_t>(op)); }

// ----------------------------------------------------------------- reduce

class DeviceReduceTest : public GpuTest {
 protected:
  // Reduces `n` random inputs on the GPU and on the CPU and compares.
  // `offset` (bytes) misaligns every device buffer; in_place writes into
  // input 0.
  void Check(DataType t, ReduceOp op, int n, size_t count, size_t offset, bool in_place) {
    const std::string what = Name(t) + " " + Name(op) + " n=" + std::to_string(n) +
                             " count=" + std::to_string(count) + " offset=" + std::to_string(offset) +
                             (in_place ? " in place" : "");
    std::mt19937_64 rng(count * 131 + n * 7 + static_cast<int>(op) * 3 + static_cast<int>(t));
    const size_t bytes = count * SizeOf(t);
    std::vector<std::vector<unsigned char>> host;
    std::vector<const void*> host_ptrs;
    std::vector<std::unique_ptr<DeviceBuffer>> dev;
    std::vector<const void*> dev_ptrs;
    for (int k = 0; k < n; ++k) {
      // prod over many inputs overflows quickly: keep values near 1 there.
      host.push_back(RandomElements(t, count, rng, true, op == ReduceOp::kProd ? 1.5 : 10));
    }
    for (int k = 0; k < n; ++k) {
      host_ptrs.push_back(host[k].data());
      dev.push_back(std::make_unique<DeviceBuffer>(host[k].data(), bytes, offset));
      dev_ptrs.push_back(dev.back()->get());
    }
    std::vector<unsigned char> want(bytes);
    if (count != 0) Reduce(t, op, host_ptrs.data(), n, want.data(), count);
    DeviceBuffer out(bytes, offset);
    void* out_ptr = in_place ? dev[0]->get() : out.get();
    ASSERT_TRUE(DeviceReduce(t, op, dev_ptrs.data(), n, out_ptr, count, stream_).ok()) << what;
    Sync();
    ExpectSameElements(t, want, in_place ? dev[0]->Download() : out.Download(), what);
  }
};

TEST_F(DeviceReduceTest, EveryTypeOpAndSizeMatchesCpu) {
  for (DataType t : kAllTypes) {
    for (ReduceOp op : kAllOps) {
      for (size_t count : kCounts) {
        for (int n : {1, 2, 3, 5}) Check(t, op, n, count, 0, false);
      }
    }
  }
}

// Counts beyond one pass of the largest grid (kMaxBlocks blocks): the
// grid-stride loops run several times (float32 sum: 8.4M elements a pass,
// int8: 33.5M).
constexpr size_t kLargeCount = (size_t{72} << 20) + 3;

TEST_F(DeviceReduceTest, LargeCountsLoopOverTheGrid) {
  Check(DataType::kFloat32, ReduceOp::kSum, 2, kLargeCount, 0, false);
  Check(DataType::kInt8, ReduceOp::kSum, 2, kLargeCount, 0, false);
  Check(DataType::kBFloat16, ReduceOp::kMax, 3, kLargeCount, 0, true);
}

TEST_F(DeviceReduceTest, InPlaceAndUnaligned) {
  for (DataType t : kAllTypes) {
    for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kAvg, ReduceOp::kMax}) {
      for (size_t count : {size_t{1}, size_t{257}, size_t{100003}}) {
        Check(t, op, 3, count, 0, true);
        Check(t, op, 2, count, SizeOf(t), false);  // aligned to the element, not to 16
        Check(t, op, 4, count, SizeOf(t), true);
      }
    }
  }
}

TEST_F(DeviceReduceTest, ManyInputs) {
  for (int n : {8, 17, kMaxReduceInputs}) {
    Check(DataType::kFloat32, ReduceOp::kSum, n, 10007, 0, false);
    Check(DataType::kBFloat16, ReduceOp::kAvg, n, 10007, 0, false);
    Check(DataType::kInt32, ReduceOp::kMin, n, 10007, 0, false);
  }
}

// avg's division alone (a sum made between nodes): DivideInPlace's bits for
// every dtype, divisors 1, 2, 3, 7, aligned to 16 bytes or only to the
// element.
TEST_F(DeviceReduceTest, DivideMatchesCpu) {
  for (DataType t : kAllTypes) {
    for (size_t count : kCounts) {
      for (int divisor : {1, 2, 3, 7}) {
        for (size_t offset : {size_t{0}, SizeOf(t)}) {
          const std::string what = Name(t) + " / " + std::to_string(divisor) +
                                   " count=" + std::to_string(count) +
                                   " offset=" + std::to_string(offset);
          std::mt19937_64 rng(count * 31 + divisor + static_cast<int>(t));
          std::vector<unsigned char> want = RandomElements(t, count, rng);
          DeviceBuffer dev(want.data(), want.size(), offset);
          if (count != 0) reduce::DivideInPlace(t, want.data(), count, divisor);
          ASSERT_TRUE(DeviceDivide(t, dev.get(), count, divisor, stream_).ok()) << what;
          Sync();
          ExpectSameElements(t, want, dev.Download(), what);
        }
      }
    }
  }
  EXPECT_FALSE(DeviceDivide(DataType::kFloat32, nullptr, 4, 2, stream_).ok());
  EXPECT_FALSE(DeviceDivide(DataType::kFloat32, nullptr, 4, 0, stream_).ok());
}

// Every rank's output in one pass (the daemon's allreduce): each output
// equals the CPU reduction; in place, output k is input k.
TEST_F(DeviceReduceTest, ToAllOutputsMatchesCpu) {
  for (DataType t : kAllTypes) {
    for (ReduceOp op : kAllOps) {
      for (size_t count : {size_t{0}, size_t{1}, size_t{7}, size_t{4099}, size_t{1000003}}) {
        for (int n : {1, 2, 3}) {
          for (bool in_place : {false, true}) {
            const std::string what = Name(t) + " " + Name(op) + " n=" + std::to_string(n) +
                                     " count=" + std::to_string(count) +
                                     (in_place ? " in place" : "");
            std::mt19937_64 rng(count * 17 + n + static_cast<int>(op) * 5 + static_cast<int>(t));
            const size_t bytes = count * SizeOf(t);
            std::vector<std::vector<unsigned char>> host;
            std::vector<const void*> host_ptrs, dev_in;
            std::vector<std::unique_ptr<DeviceBuffer>> dev, outs;
            std::vector<void*> dev_out;
            for (int k = 0; k < n; ++k) {
              host.push_back(RandomElements(t, count, rng, true, op == ReduceOp::kProd ? 1.5 : 10));
            }
            for (int k = 0; k < n; ++k) {
              host_ptrs.push_back(host[k].data());
              dev.push_back(std::make_unique<DeviceBuffer>(host[k].data(), bytes, 0));
              dev_in.push_back(dev.back()->get());
              if (in_place) {
                dev_out.push_back(dev.back()->get());
              } else {
                outs.push_back(std::make_unique<DeviceBuffer>(bytes, 0));
                dev_out.push_back(outs.back()->get());
              }
            }
            std::vector<unsigned char> want(bytes);
            if (count != 0) Reduce(t, op, host_ptrs.data(), n, want.data(), count);
            ASSERT_TRUE(DeviceReduceToAll(t, op, dev_in.data(), n, dev_out.data(), n, count,
                                          stream_).ok()) << what;
            Sync();
            for (int k = 0; k < n; ++k) {
              ExpectSameElements(t, want, in_place ? dev[k]->Download() : outs[k]->Download(),
                                 what + " output " + std::to_string(k));
            }
          }
        }
      }
    }
  }
}

// ----------------------------------------------------------------- codecs

std::unique_ptr<Codec> CpuCodec(const std::string& spec) {
  absl::StatusOr<CodecSpec> parsed = ParseCodec(spec);
  EXPECT_TRUE(parsed.ok()) << parsed.status();
  return MakeCodec(*parsed);
}

class DeviceCodecTest : public GpuTest {
 protected:
  // Decodes `wire` on the GPU (into and added into a random accumulator) and
  // on the CPU, and compares; both must agree on success or failure, and a
  // failure leaves the GPU buffer untouched. Valid input decodes to the same
  // elements trusted too (a coder's own encodings: unchecked, no wait).
  void CheckDecode(const std::string& spec, DataType t, const std::vector<unsigned char>& wire,
                   size_t count, const std::string& what) {
    std::mt19937_64 rng(count + wire.size());
    const std::unique_ptr<Codec> cpu = CpuCodec(spec);
    const std::vector<unsigned char> acc0 = RandomElements(t, count, rng, false);
    const size_t bytes = count * SizeOf(t);
    for (bool add : {false, true}) {
      std::vector<unsigned char> want = acc0;
      const absl::Status cs = add ? cpu->DecodeAdd(t, wire.data(), wire.size(), count, want.data())
                                  : cpu->Decode(t, wire.data(), wire.size(), count, want.data());
      DeviceBuffer dwire(wire.data(), wire.size());
      DeviceBuffer dout(acc0.data(), bytes);
      DeviceBuffer ws(std::max<size_t>(Int8DecodeWorkspaceBytes(count), 256));
      absl::Status gs;
      if (spec == "int8") {
        gs = DeviceInt8Decode(t, dwire.get(), wire.size(), count, dout.get(), add, ws.get(),
                              Int8DecodeWorkspaceBytes(count), stream_);
      } else if (spec == "fp16" || spec == "bf16") {
        gs = DeviceCastDecode(spec == "fp16" ? CastFormat::kFp16 : CastFormat::kBf16, t, dwire.get(),
                              wire.size(), count, dout.get(), add, stream_);
      } else {
        gs = DeviceTopKDecode(t, dwire.get(), wire.size(), count, dout.get(), add, ws.get(),
                              TopKDecodeWorkspaceBytes(), stream_);
      }
      Sync();
      const std::string w = what + (add ? " decode-add" : " decode");
      ASSERT_EQ(cs.ok(), gs.ok()) << w << ": cpu " << cs << " gpu " << gs;
      if (!cs.ok()) {
        EXPECT_EQ(gs.code(), absl::StatusCode::kInvalidArgument) << w << gs;
        EXPECT_EQ(dout.Download(), acc0) << w << ": output touched on error";
      } else {
        ExpectSameElements(t, want, dout.Download(), w);
      }
      if (!cs.ok() || spec == "fp16" || spec == "bf16") continue;
      DeviceBuffer tout(acc0.data(), bytes);
      gs = spec == "int8"
               ? DeviceInt8Decode(t, dwire.get(), wire.size(), count, tout.get(), add, ws.get(),
                                  Int8DecodeWorkspaceBytes(count), stream_, /*trusted=*/true)
               : DeviceTopKDecode(t, dwire.get(), wire.size(), count, tout.get(), add, ws.get(),
                                  TopKDecodeWorkspaceBytes(), stream_, /*trusted=*/true);
      Sync();
      ASSERT_TRUE(gs.ok()) << w << " (trusted): " << gs;
      ExpectSameElements(t, want, tout.Download(), w + " (trusted)");
    }
  }

  // Encodes on both and compares the bytes exactly; then decodes the CPU's
  // bytes on the GPU. Returns the wire bytes.
  std::vector<unsigned char> CheckRoundTrip(const std::string& spec, DataType t,
                                            const std::vector<unsigned char>& host, size_t count,
                                            const std::string& what) {
    const std::unique_ptr<Codec> cpu = CpuCodec(spec);
    std::vector<unsigned char> want(cpu->MaxEncodedBytes(t, count) + 1);
    const size_t want_bytes = cpu->Encode(t, host.data(), count, want.data());
    want.resize(want_bytes);
    DeviceBuffer din(host.data(), host.size());
    DeviceBuffer dout(std::max<size_t>(cpu->MaxEncodedBytes(t, count), 4));
    size_t got_bytes = 0;
    if (spec == "int8") {
      absl::StatusOr<size_t> ws_bytes = Int8EncodeWorkspaceBytes(count);
      EXPECT_TRUE(ws_bytes.ok()) << ws_bytes.status();
      DeviceBuffer ws(*ws_bytes);
      DeviceBuffer total(8);
      EXPECT_TRUE(DeviceInt8Encode(t, din.get(), count, dout.get(), ws.get(), *ws_bytes,
                                   static_cast<uint64_t*>(total.get()), stream_)
                      .ok())
          << what;
      Sync();
      const std::vector<unsigned char> tb = total.Download();
      uint64_t n = 0;
      std::memcpy(&n, tb.data(), 8);
      got_bytes = n;
    } else if (spec == "fp16" || spec == "bf16") {
      EXPECT_TRUE(DeviceCastEncode(spec == "fp16" ? CastFormat::kFp16 : CastFormat::kBf16, t,
                                   din.get(), count, dout.get(), stream_)
                      .ok())
          << what;
      got_bytes = 2 * count;
    } else {
      const size_t k = want_bytes / (4 + SizeOf(t));
      absl::StatusOr<size_t> ws_bytes = TopKEncodeWorkspaceBytes(count);
      EXPECT_TRUE(ws_bytes.ok()) << ws_bytes.status();
      DeviceBuffer ws(*ws_bytes);
      EXPECT_TRUE(DeviceTopKEncode(t, din.get(), count, k, dout.get(), ws.get(), *ws_bytes, stream_)
                      .ok())
          << what;
      got_bytes = k * (4 + SizeOf(t));
    }
    Sync();
    EXPECT_EQ(got_bytes, want_bytes) << what;
    const std::vector<unsigned char> got = dout.Download(std::min(got_bytes, want_bytes));
    if (got != std::vector<unsigned char>(want.begin(), want.begin() + got.size())) {
      size_t first = 0;
      while (first < got.size() && got[first] == want[first]) ++first;
      ADD_FAILURE() << what << ": encoded bytes differ from the CPU codec's, first at byte " << first;
    }
    CheckDecode(spec, t, want, count, what);
    return want;
  }
};

TEST_F(DeviceCodecTest, LargeCountsLoopOverTheGrid) {
  // Cast, top-k: 2M elements a pass; int8: 16.7M.
  std::mt19937_64 rng(7);
  const auto host = RandomElements(DataType::kFloat32, kLargeCount, rng, true);
  for (const std::string spec : {"fp16", "int8", "topk:0.01"}) {
    CheckRoundTrip(spec, DataType::kFloat32, host, kLargeCount, spec + " large");
  }
}

TEST_F(DeviceCodecTest, CastCodecsMatchCpu) {
  for (const std::string spec : {"fp16", "bf16"}) {
    const DataType narrow = spec == "fp16" ? DataType::kFloat16 : DataType::kBFloat16;
    for (DataType t : {DataType::kFloat32, narrow}) {
      for (size_t count : kCounts) {
        std::mt19937_64 rng(count);
        const auto host = RandomElements(t, count, rng, true, spec == "fp16" ? 1e4 : 1e30);
        CheckRoundTrip(spec, t, host, count, spec + " " + Name(t) + " count=" + std::to_string(count));
      }
    }
  }
}

TEST_F(DeviceCodecTest, Int8MatchesCpuBitForBit) {
  for (DataType t : kFloatTypes) {
    for (size_t count : kCounts) {
      std::mt19937_64 rng(count * 3 + static_cast<int>(t));
      const std::string what = "int8 " + Name(t) + " count=" + std::to_string(count);
      // Finite values only: every block is quantised (the one-pass layout).
      CheckRoundTrip("int8", t, RandomElements(t, count, rng, false), count, what + " finite");
      // NaN/Inf/zero blocks: some blocks raw (the prefix-sum relayout).
      CheckRoundTrip("int8", t, RandomElements(t, count, rng, true), count, what + " specials");
    }
    // Blocks of zeros (scale 0) and of tiny values (raw: below 2^-100, only
    // representable in float32/float64).
    const size_t count = 256 * 5 + 3;
    std::vector<unsigned char> host(count * SizeOf(t), 0);
    if (t == DataType::kFloat32 || t == DataType::kFloat64) {
      for (size_t i = 512; i < 768; ++i) {
        if (t == DataType::kFloat32) {
          const float f = 1e-35f * static_cast<float>(i);
          std::memcpy(&host[i * 4], &f, 4);
        } else {
          const double d = 1e-300 * static_cast<double>(i);
          std::memcpy(&host[i * 8], &d, 8);
        }
      }
    }
    CheckRoundTrip("int8", t, host, count, "int8 " + Name(t) + " zero and tiny blocks");
  }
}

TEST_F(DeviceCodecTest, Int8RejectsMalformedInput) {
  for (DataType t : kFloatTypes) {
    const size_t count = 1000;
    std::mt19937_64 rng(5);
    const auto host = RandomElements(t, count, rng, false);
    const std::unique_ptr<Codec> cpu = CpuCodec("int8");
    std::vector<unsigned char> wire(cpu->MaxEncodedBytes(t, count));
    wire.resize(cpu->Encode(t, host.data(), count, wire.data()));
    const std::string what = "int8 " + Name(t);
    auto bad_scale = wire;
    const float negative = -1;
    std::memcpy(&bad_scale[260 * 2], &negative, 4);
    CheckDecode("int8", t, bad_scale, count, what + " negative scale");
    auto raw_header = wire;  // claims raw where the size says quantised
    const float inf = std::numeric_limits<float>::infinity();
    std::memcpy(&raw_header[260], &inf, 4);
    CheckDecode("int8", t, raw_header, count, what + " raw header in a quantised layout");
    auto truncated = wire;
    truncated.resize(wire.size() - 3);
    CheckDecode("int8", t, truncated, count, what + " truncated");
    auto longer = wire;
    longer.resize(wire.size() + 4 * SizeOf(t));
    CheckDecode("int8", t, longer, count, what + " trailing bytes");
  }
}

size_t TopKKept(double ratio, size_t count) {
  if (count == 0) return 0;
  const double k = std::ceil(ratio * static_cast<double>(count));
  if (!(k < static_cast<double>(count))) return count;
  return std::max<size_t>(1, static_cast<size_t>(k));
}

TEST_F(DeviceCodecTest, TopKMatchesCpuIncludingTies) {
  for (const std::string spec : {"topk:0.01", "topk:0.3", "topk:1"}) {
    for (DataType t : kFloatTypes) {
      for (size_t count : kCounts) {
        std::mt19937_64 rng(count + 11);
        const std::string what = spec + " " + Name(t) + " count=" + std::to_string(count);
        CheckRoundTrip(spec, t, RandomElements(t, count, rng, true), count, what);
        // Many equal magnitudes: the k-th largest is tied and ties go by index.
        std::vector<unsigned char> ties(count * SizeOf(t));
        std::uniform_int_distribution<int> small(-3, 3);
        for (size_t i = 0; i < count; ++i) {
          const double v = small(rng);
          switch (t) {
            case DataType::kFloat32: { const float f = v; std::memcpy(&ties[4 * i], &f, 4); break; }
            case DataType::kFloat64: std::memcpy(&ties[8 * i], &v, 8); break;
            case DataType::kFloat16: { const uint16_t h = FloatToHalf(v); std::memcpy(&ties[2 * i], &h, 2); break; }
            default: { const uint16_t h = FloatToBFloat16(v); std::memcpy(&ties[2 * i], &h, 2); break; }
          }
        }
        CheckRoundTrip(spec, t, ties, count, what + " ties");
      }
    }
  }
  EXPECT_EQ(TopKKept(0.01, 1000003), 10001u);  // what CheckRoundTrip derives from the CPU size
}

TEST_F(DeviceCodecTest, TopKRejectsBadIndices) {
  for (DataType t : kFloatTypes) {
    const size_t count = 100;
    const size_t k = 10;
    std::vector<unsigned char> wire(k * (4 + SizeOf(t)), 0);
    for (uint32_t j = 0; j < k; ++j) {
      const uint32_t i = 3 * j;
      std::memcpy(&wire[4 * j], &i, 4);
    }
    CheckDecode("topk:0.1", t, wire, count, "topk valid");
    auto repeated = wire;
    std::memcpy(&repeated[4 * 5], &repeated[4 * 4], 4);
    CheckDecode("topk:0.1", t, repeated, count, "topk repeated index");
    auto beyond = wire;
    const uint32_t big = 100;
    std::memcpy(&beyond[4 * 9], &big, 4);
    CheckDecode("topk:0.1", t, beyond, count, "topk index out of range");
  }
}

// Encodings damaged at random (bytes changed, cut short, lengthened, a
// word repeated, a special float written over one), as a faulty or hostile
// peer might send them: the device decoders must refuse
// exactly what the CPU codec refuses, leave their output untouched then,
// and decode the rest (trusted too, as the device coder does after the CPU
// codec's Validate) to the CPU's elements. tests/fuzz/codec_fuzz.cc holds
// the CPU codecs' side of this to Validate, under libFuzzer.
TEST_F(DeviceCodecTest, DamagedEncodingsAgreeWithCpu) {
  int refused = 0, accepted = 0;
  for (const std::string spec : {"fp16", "bf16", "int8", "topk:0.05", "topk:0.5"}) {
    const std::unique_ptr<Codec> cpu = CpuCodec(spec);
    for (DataType t : kFloatTypes) {
      if (!cpu->Supports(t).ok()) continue;
      for (size_t count : {size_t{1}, size_t{255}, size_t{257}, size_t{1000}}) {
        std::mt19937_64 rng(count * 31 + static_cast<int>(t) + spec.size());
        for (int variant = 0; variant < 8; ++variant) {
          // int8 with a special scale: finite values, so every block is
          // quantised and its header is at a known place (256 + 4 bytes a
          // block).
          const bool at_scale = variant == 7 && spec == "int8";
          const auto host = RandomElements(t, count, rng, !at_scale);
          std::vector<unsigned char> wire(cpu->MaxEncodedBytes(t, count));
          wire.resize(cpu->Encode(t, host.data(), count, wire.data()));
          const size_t words = wire.size() / 4;
          switch (variant) {
            case 0:
              break;  // intact
            case 1:
            case 2:
            case 3:  // bytes changed
              for (int e = 0; e < variant && !wire.empty(); ++e) {
                wire[rng() % wire.size()] = static_cast<unsigned char>(rng());
              }
              break;
            case 4:  // cut short
              wire.resize(wire.size() - 1 - rng() % std::min<size_t>(wire.size(), 8));
              break;
            case 5:  // lengthened
              wire.resize(wire.size() + 1 + rng() % 8, 0x7f);
              break;
            case 6:  // a word copied over the next (top-k: a repeated index)
              if (words >= 2) {
                const size_t w = 1 + rng() % (words - 1);
                std::memcpy(&wire[4 * w], &wire[4 * (w - 1)], 4);
              }
              break;
            case 7: {  // a special float over a word (int8: a block's scale)
              const float specials[] = {std::numeric_limits<float>::quiet_NaN(),
                                        std::numeric_limits<float>::infinity(),
                                        -1.0f,
                                        0.0f,
                                        1e38f,
                                        1e-40f};
              if (words == 0) break;
              const size_t at =
                  at_scale ? (rng() % ((count + 255) / 256)) * 260 : 4 * (rng() % words);
              std::memcpy(&wire[at], &specials[rng() % 6], 4);
              break;
            }
          }
          const std::string what = spec + " " + Name(t) + " count=" + std::to_string(count) +
                                   " variant " + std::to_string(variant);
          (cpu->Validate(t, wire.data(), wire.size(), count).ok() ? accepted : refused)++;
          CheckDecode(spec, t, wire, count, what);
          if (HasFatalFailure()) return;
        }
      }
    }
  }
  std::printf("damaged encodings: %d refused, %d accepted\n", refused, accepted);
  // Both sides of the verdict were exercised.
  EXPECT_GT(refused, 20);
  EXPECT_GT(accepted, 20);
}

TEST_F(DeviceCodecTest, ErrorFeedbackMatchesCpu) {
  for (size_t count : kCounts) {
    std::mt19937_64 rng(count + 99);
    const auto a = RandomElements(DataType::kFloat32, count, rng, true);
    const auto b = RandomElements(DataType::kFloat32, count, rng, true);
    const auto data = RandomElements(DataType::kFloat32, count, rng, true);
    const auto* fa = reinterpret_cast<const float*>(a.data());
    const auto* fb = reinterpret_cast<const float*>(b.data());
    // CPU: residual = a - b (finite), then data += residual.
    ErrorFeedback ef(size_t{1} << 30);
    ef.Update("x", fa, fb, count);
    std::vector<unsigned char> want = data;
    ef.Apply("x", reinterpret_cast<float*>(want.data()), count);
    DeviceBuffer da(a.data(), a.size()), db(b.data(), b.size()), dd(data.data(), data.size());
    DeviceBuffer residual(count * 4);
    ASSERT_TRUE(DeviceErrorFeedbackUpdate(static_cast<const float*>(da.get()),
                                          static_cast<const float*>(db.get()),
                                          static_cast<float*>(residual.get()), count, stream_)
                    .ok());
    ASSERT_TRUE(DeviceErrorFeedbackApply(static_cast<const float*>(residual.get()),
                                         static_cast<float*>(dd.get()), count, stream_)
                    .ok());
    Sync();
    ExpectSameElements(DataType::kFloat32, want, dd.Download(), "error feedback count=" + std::to_string(count));
  }
}

}  // namespace
}  // namespace ciuic::daemon::gpu
