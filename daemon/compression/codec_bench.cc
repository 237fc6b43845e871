// Encode, Decode and DecodeAdd throughput of every codec on 64 MiB of float32
// beside memcpy of the same 64 MiB. bytes_per_second counts the float32
// input (64 MiB per iteration) for every row, so the rows compare directly.
//   codec_bench --benchmark_min_time=0.5
#include <benchmark/benchmark.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "compression/codec.h"

namespace ciuic::daemon {
namespace {

constexpr size_t kBytes = size_t{64} << 20;
constexpr size_t kCount = kBytes / sizeof(float);

const std::vector<float>& Gradient() {
  static const std::vector<float> g = [] {
    std::vector<float> v(kCount);
    std::mt19937 rng(1);
    std::normal_distribution<float> normal(0, 1);
    for (float& x : v) x = normal(rng) * 1e-3f;
    return v;
  }();
  return g;
}

std::unique_ptr<Codec> Make(const std::string& name) { return MakeCodec(*ParseCodec(name)); }

void BM_Memcpy(benchmark::State& state) {
  const std::vector<float>& in = Gradient();
  std::vector<float> out(kCount, 0.0f);
  for (auto _ : state) {
    std::memcpy(out.data(), in.data(), kBytes);
    benchmark::DoNotOptimize(out.data());
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * kBytes));
}

void BM_Encode(benchmark::State& state, const std::string& name) {
  const auto codec = Make(name);
  const std::vector<float>& in = Gradient();
  std::vector<unsigned char> wire(codec->MaxEncodedBytes(wire::DataType::kFloat32, kCount), 0);
  size_t bytes = 0;
  for (auto _ : state) {
    bytes = codec->Encode(wire::DataType::kFloat32, in.data(), kCount, wire.data());
    benchmark::DoNotOptimize(wire.data());
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * kBytes));
  state.counters["wire_ratio"] = static_cast<double>(bytes) / kBytes;
}

void BM_Decode(benchmark::State& state, const std::string& name, bool add) {
  const auto codec = Make(name);
  const std::vector<float>& in = Gradient();
  std::vector<unsigned char> wire(codec->MaxEncodedBytes(wire::DataType::kFloat32, kCount));
  const size_t bytes = codec->Encode(wire::DataType::kFloat32, in.data(), kCount, wire.data());
  std::vector<float> out(kCount, 0.0f);
  for (auto _ : state) {
    const absl::Status s =
        add ? codec->DecodeAdd(wire::DataType::kFloat32, wire.data(), bytes, kCount, out.data())
            : codec->Decode(wire::DataType::kFloat32, wire.data(), bytes, kCount, out.data());
    if (!s.ok()) state.SkipWithError(std::string(s.message()).c_str());
    benchmark::DoNotOptimize(out.data());
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * kBytes));
}

void Register() {
  benchmark::RegisterBenchmark("memcpy", BM_Memcpy)->Unit(benchmark::kMillisecond);
  for (const char* name : {"none", "fp16", "bf16", "int8", "topk:0.01"}) {
    benchmark::RegisterBenchmark((std::string("encode/") + name).c_str(), BM_Encode, name)
        ->Unit(benchmark::kMillisecond);
    benchmark::RegisterBenchmark((std::string("decode/") + name).c_str(), BM_Decode, name, false)
        ->Unit(benchmark::kMillisecond);
    benchmark::RegisterBenchmark((std::string("decode_add/") + name).c_str(), BM_Decode, name, true)
        ->Unit(benchmark::kMillisecond);
  }
}

}  // namespace
}  // namespace ciuic::daemon

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  ciuic::daemon::Register();
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
