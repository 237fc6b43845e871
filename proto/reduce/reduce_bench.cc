// Reduce float32 sum of two inputs against memcpy of the same size, at a
// cache-resident size (256 KiB) and two memory-bound ones (16, 64 MiB).
// bytes_per_second counts the bytes of one buffer (as in busbw), for both.
//   reduce_bench --benchmark_min_time=0.2
#include <benchmark/benchmark.h>

#include <cstdint>
#include <cstring>
#include <vector>

#include "reduce/reduce.h"

namespace ciuic::reduce {
namespace {

void BM_ReduceFloat32Sum2(benchmark::State& state) {
  const size_t bytes = static_cast<size_t>(state.range(0));
  const size_t count = bytes / sizeof(float);
  std::vector<float> a(count, 1.0f), b(count, 2.0f), out(count, 0.0f);
  const void* inputs[] = {a.data(), b.data()};
  for (auto _ : state) {
    Reduce(wire::DataType::kFloat32, wire::ReduceOp::kSum, inputs, 2, out.data(), count);
    benchmark::DoNotOptimize(out.data());
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * bytes));
}

void BM_ReduceFloat32Sum2InPlace(benchmark::State& state) {
  const size_t bytes = static_cast<size_t>(state.range(0));
  const size_t count = bytes / sizeof(float);
  std::vector<float> a(count, 0.0f), b(count, 0.0f);
  const void* inputs[] = {a.data(), b.data()};
  for (auto _ : state) {
    Reduce(wire::DataType::kFloat32, wire::ReduceOp::kSum, inputs, 2, a.data(), count);
    benchmark::DoNotOptimize(a.data());
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * bytes));
}

// The 16-bit formats convert to float and back per element: this shows
// whether the conversions keep up with memory.
void BM_ReduceSixteenBitSum2(benchmark::State& state, wire::DataType dtype) {
  const size_t bytes = static_cast<size_t>(state.range(0));
  const size_t count = bytes / sizeof(uint16_t);
  std::vector<uint16_t> a(count, 0x3c00), b(count, 0x3c00), out(count, 0);
  const void* inputs[] = {a.data(), b.data()};
  for (auto _ : state) {
    Reduce(dtype, wire::ReduceOp::kSum, inputs, 2, out.data(), count);
    benchmark::DoNotOptimize(out.data());
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * bytes));
}

void BM_Memcpy(benchmark::State& state) {
  const size_t bytes = static_cast<size_t>(state.range(0));
  std::vector<char> src(bytes, 1), dst(bytes, 0);
  for (auto _ : state) {
    std::memcpy(dst.data(), src.data(), bytes);
    benchmark::DoNotOptimize(dst.data());
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * bytes));
}

#define CIUIC_SIZES Arg(256 << 10)->Arg(16 << 20)->Arg(64 << 20)
BENCHMARK(BM_ReduceFloat32Sum2)->CIUIC_SIZES;
BENCHMARK(BM_ReduceFloat32Sum2InPlace)->CIUIC_SIZES;
BENCHMARK_CAPTURE(BM_ReduceSixteenBitSum2, float16, wire::DataType::kFloat16)->CIUIC_SIZES;
BENCHMARK_CAPTURE(BM_ReduceSixteenBitSum2, bfloat16, wire::DataType::kBFloat16)->CIUIC_SIZES;
BENCHMARK(BM_Memcpy)->CIUIC_SIZES;
#undef CIUIC_SIZES

}  // namespace
}  // namespace ciuic::reduce

BENCHMARK_MAIN();
