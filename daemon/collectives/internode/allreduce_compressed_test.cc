// AllreduceCompressed over the in-process hub: every node gets the same
// bits, the error against the exact sum stays within the codec's bound, and
// error feedback makes the running sum of results track the exact one.
#include <gtest/gtest.h>

#include <atomic>
#include <cctype>
#include <cmath>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <functional>
#include <limits>
#include <memory>
#include <mutex>
#include <random>
#include <thread>
#include <vector>

#include "collectives/internode/in_process_transport.h"
#include "collectives/internode/internode.h"
#include "collectives/internode/sends_in_flight.h"
#include "reduce/half.h"

namespace ciuic::daemon {
namespace {

struct Outcome {
  std::vector<std::vector<float>> data;  // per node, in and out
  std::vector<absl::Status> status;
  CompressionStats stats;
};

// One compressed allreduce of data[k] on every node k.
void RunOnce(InProcessHub& hub, const Codec& codec,
             std::vector<std::unique_ptr<ErrorFeedback>>* fb,
             const std::string& name, Outcome* run, uint64_t seq) {
  const int n = hub.num_nodes();
  run->status.assign(n, absl::OkStatus());
  std::vector<ScratchBuffer> scratch(n);
  std::vector<CompressionStats> stats(n);
  std::vector<std::thread> threads;
  for (int k = 0; k < n; ++k) {
    threads.emplace_back([&, k] {
      InterNodeContext ctx{hub.transport(k), seq << 24, 1 << 16, 4,
                           std::chrono::steady_clock::now() + std::chrono::seconds(20),
                           &scratch[k]};
      run->status[k] = AllreduceCompressed(ctx, codec, fb ? (*fb)[k].get() : nullptr, name,
                                           wire::DataType::kFloat32, run->data[k].data(),
                                           run->data[k].size(), &stats[k]);
    });
  }
  for (auto& t : threads) t.join();
  run->stats = stats[0];
}

std::vector<float> Gradient(int node, size_t count, uint32_t seed) {
  std::mt19937 rng(seed * 131 + node);
  std::normal_distribution<float> d(0.0f, 1.0f);
  std::vector<float> v(count);
  for (auto& x : v) x = d(rng);
  return v;
}

struct Case {
  const char* codec;
  int nodes;
  size_t count;
  double max_rel_error;  // against max |exact|
};

class CompressedAllreduceTest : public ::testing::TestWithParam<Case> {};

TEST_P(CompressedAllreduceTest, SameBitsEverywhereAndBoundedError) {
  const Case c = GetParam();
  auto spec = ParseCodec(c.codec);
  ASSERT_TRUE(spec.ok());
  auto codec = MakeCodec(*spec);
  InProcessHub hub(c.nodes, 2);
  Outcome run;
  std::vector<double> exact(c.count, 0.0);
  for (int k = 0; k < c.nodes; ++k) {
    run.data.push_back(Gradient(k, c.count, 7));
    for (size_t i = 0; i < c.count; ++i) exact[i] += run.data[k][i];
  }
  RunOnce(hub, *codec, nullptr, "g", &run, 1);
  for (int k = 0; k < c.nodes; ++k) ASSERT_TRUE(run.status[k].ok()) << run.status[k];
  for (int k = 1; k < c.nodes; ++k) {
    ASSERT_TRUE(c.count == 0 ||
                std::memcmp(run.data[0].data(), run.data[k].data(), c.count * 4) == 0)
        << "node " << k << " differs from node 0";
  }
  double max_exact = 0, max_err = 0;
  for (size_t i = 0; i < c.count; ++i) {
    max_exact = std::max(max_exact, std::fabs(exact[i]));
    max_err = std::max(max_err, std::fabs(run.data[0][i] - exact[i]));
  }
  if (c.count > 0) EXPECT_LE(max_err / max_exact, c.max_rel_error) << c.codec;
  if (std::string(c.codec) != "none" && std::string(c.codec) != "topk:1" && c.count > 1000) {
    EXPECT_LT(run.stats.wire_bytes, run.stats.raw_bytes) << "nothing was saved on the wire";
  }
}

INSTANTIATE_TEST_SUITE_P(
    Codecs, CompressedAllreduceTest,
    ::testing::Values(Case{"none", 3, 100003, 1e-6}, Case{"fp16", 2, 100003, 2e-3},
                      Case{"fp16", 4, 4099, 2e-3}, Case{"bf16", 3, 100003, 2e-2},
                      Case{"int8", 2, 100003, 3e-2}, Case{"int8", 5, 1001, 3e-2},
                      Case{"int8", 3, 0, 0}, Case{"int8", 4, 3, 3e-2},
                      Case{"topk:1", 3, 5000, 1e-6}));

// Over many steps of the same gradient, what error feedback hands back makes
// the sum of the results track the exact sum: the gap stays about one step's
// error instead of growing with the number of steps.
TEST(CompressedAllreduceFeedbackTest, RunningSumTracksTheExactSum) {
  for (const char* name : {"int8", "topk:0.05"}) {
    auto codec = MakeCodec(*ParseCodec(name));
    const int n = 2;
    const size_t count = 20000;
    InProcessHub hub(n, 1);
    std::vector<std::unique_ptr<ErrorFeedback>> fb;
    for (int k = 0; k < n; ++k) fb.push_back(std::make_unique<ErrorFeedback>(64 << 20));
    std::vector<std::vector<float>> g;
    std::vector<double> exact(count, 0.0);
    for (int k = 0; k < n; ++k) {
      g.push_back(Gradient(k, count, 3));
      for (size_t i = 0; i < count; ++i) exact[i] += g[k][i];
    }
    std::vector<double> applied(count, 0.0);
    double gap_10 = 0, gap_100 = 0;
    for (int step = 1; step <= 100; ++step) {
      Outcome run;
      run.data = g;
      RunOnce(hub, *codec, &fb, "w", &run, step);
      ASSERT_TRUE(run.status[0].ok()) << run.status[0];
      double gap = 0, norm = 0;
      for (size_t i = 0; i < count; ++i) {
        applied[i] += run.data[0][i];
        gap += std::pow(applied[i] - step * exact[i], 2);
        norm += exact[i] * exact[i];
      }
      gap = std::sqrt(gap / norm);  // relative to one step's exact sum
      if (step == 10) gap_10 = gap;
      if (step == 100) gap_100 = gap;
    }
    // Without feedback the gap would grow ~linearly (x10 from step 10 to 100).
    EXPECT_LT(gap_100, 3 * gap_10 + 0.05) << name << ": " << gap_10 << " -> " << gap_100;
    EXPECT_LT(gap_100, 30.0) << name;
  }
}

// ---------------------------------------------------------------------------
// The pipelined algorithm over every codec, dtype, node count and size class.
//
// Error bound tested, per element i, with x_k the node inputs (as stored),
// A_i = sum_k |x_k,i|, s_i = sum_k x_k,i, M_k = max_i |x_k,i|, u_d the
// dtype's unit roundoff (float32 2^-24, float64 2^-53, float16 2^-11,
// bfloat16 2^-8) and u_c the cast codec's (fp16 2^-11, bf16 2^-8, 0 when the
// dtype travels as it is):
//   |result_i - s_i| <= (N+1) u_d (A_i + |s_i|) + u_c (A_i + |s_i|) + N 2^-25
//                       [+ int8: (sum_k M_k + max|s|) / 254]
// i.e. one compression of each contribution plus one of the sum, however
// many nodes: relative to the contributions, the bound does not grow with N.
// top-k: ||result - s||_2 <= sqrt(1 - R) (sum_k ||x_k||_2 + ||s||_2) plus the
// same arithmetic term (per chunk, top-k drops at most a 1 - k/m share of
// the squared norm, and k/m >= R).

struct DtypeInfo {
  wire::DataType dtype;
  const char* name;
  double u;  // unit roundoff
};

const DtypeInfo kDtypes[] = {{wire::DataType::kFloat32, "float32", 0x1p-24},
                             {wire::DataType::kFloat64, "float64", 0x1p-53},
                             {wire::DataType::kFloat16, "float16", 0x1p-11},
                             {wire::DataType::kBFloat16, "bfloat16", 0x1p-8}};

// Values as stored in `dtype` (raw bytes) and as doubles.
struct Buffer {
  std::vector<uint8_t> bytes;
  std::vector<double> values;
};

Buffer MakeBuffer(wire::DataType dtype, size_t count, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> d(0.0f, 1.0f);
  const size_t es = wire::DataTypeSize(static_cast<uint32_t>(dtype));
  Buffer b;
  b.bytes.resize(count * es + 8);  // + 8: never a zero-sized vector's nullptr
  b.values.resize(count);
  for (size_t i = 0; i < count; ++i) {
    const float x = d(rng);
    uint8_t* at = b.bytes.data() + i * es;
    switch (dtype) {
      case wire::DataType::kFloat32: std::memcpy(at, &x, 4); b.values[i] = x; break;
      case wire::DataType::kFloat64: {
        const double v = static_cast<double>(x) * (1.0 + 1e-9 * (i % 7));
        std::memcpy(at, &v, 8);
        b.values[i] = v;
        break;
      }
      case wire::DataType::kFloat16: {
        const uint16_t h = FloatToHalf(x);
        std::memcpy(at, &h, 2);
        b.values[i] = HalfToFloat(h);
        break;
      }
      case wire::DataType::kBFloat16: {
        const uint16_t h = FloatToBFloat16(x);
        std::memcpy(at, &h, 2);
        b.values[i] = BFloat16ToFloat(h);
        break;
      }
      default: ADD_FAILURE() << "dtype";
    }
  }
  return b;
}

double ValueAt(wire::DataType dtype, const uint8_t* p, size_t i) {
  switch (dtype) {
    case wire::DataType::kFloat32: { float v; std::memcpy(&v, p + 4 * i, 4); return v; }
    case wire::DataType::kFloat64: { double v; std::memcpy(&v, p + 8 * i, 8); return v; }
    case wire::DataType::kFloat16: { uint16_t h; std::memcpy(&h, p + 2 * i, 2); return HalfToFloat(h); }
    case wire::DataType::kBFloat16: { uint16_t h; std::memcpy(&h, p + 2 * i, 2); return BFloat16ToFloat(h); }
    default: return 0;
  }
}

// Runs one compressed allreduce of bufs[k] on node k (in place), with
// chunk_bytes[k] (all equal unless a test wants a disagreement).
std::vector<absl::Status> RunCompressed(InProcessHub& hub, const Codec& codec,
                                        std::vector<std::unique_ptr<ErrorFeedback>>* fb,
                                        const std::string& name, wire::DataType dtype,
                                        std::vector<std::vector<uint8_t>>& bufs, size_t count,
                                        uint64_t chunk_bytes, uint64_t seq, int max_inflight = 3,
                                        std::vector<ScratchBuffer>* keep_scratch = nullptr,
                                        std::vector<CompressionStats>* stats_out = nullptr) {
  const int n = hub.num_nodes();
  std::vector<absl::Status> status(n);
  std::vector<ScratchBuffer> local_scratch(keep_scratch ? 0 : n);
  std::vector<ScratchBuffer>& scratch = keep_scratch ? *keep_scratch : local_scratch;
  std::vector<CompressionStats> stats(n);
  std::vector<std::thread> threads;
  for (int k = 0; k < n; ++k) {
    threads.emplace_back([&, k] {
      InterNodeContext ctx{hub.transport(k), seq << 24, chunk_bytes, max_inflight,
                           std::chrono::steady_clock::now() + std::chrono::seconds(30),
                           &scratch[k]};
      status[k] = AllreduceCompressed(ctx, codec, fb ? (*fb)[k].get() : nullptr, name, dtype,
                                      bufs[k].data(), count, &stats[k]);
    });
  }
  for (auto& t : threads) t.join();
  if (stats_out) *stats_out = stats;
  return status;
}

struct MatrixCase {
  std::string codec;
  wire::DataType dtype;
};

std::string MatrixName(const ::testing::TestParamInfo<MatrixCase>& info) {
  std::string c = info.param.codec;
  for (char& ch : c) {
    if (!isalnum(static_cast<unsigned char>(ch))) ch = '_';
  }
  for (const DtypeInfo& d : kDtypes) {
    if (d.dtype == info.param.dtype) return c + "_" + d.name;
  }
  return c;
}

class PipelinedCompressedTest : public ::testing::TestWithParam<MatrixCase> {};

TEST_P(PipelinedCompressedTest, EveryNodeCountSizeAndOp) {
  const MatrixCase mc = GetParam();
  auto codec = MakeCodec(*ParseCodec(mc.codec));
  ASSERT_TRUE(codec->Supports(mc.dtype).ok());
  const DtypeInfo* di = nullptr;
  for (const DtypeInfo& d : kDtypes) {
    if (d.dtype == mc.dtype) di = &d;
  }
  const size_t es = wire::DataTypeSize(static_cast<uint32_t>(mc.dtype));
  const auto spec = *ParseCodec(mc.codec);
  const bool passthrough16 = (spec.kind == CodecKind::kFp16 && mc.dtype == wire::DataType::kFloat16) ||
                             (spec.kind == CodecKind::kBf16 && mc.dtype == wire::DataType::kBFloat16);
  double uc = 0;
  if (spec.kind == CodecKind::kFp16 && !passthrough16) uc = 0x1p-11;
  if (spec.kind == CodecKind::kBf16 && !passthrough16) uc = 0x1p-8;
  const bool int8 = spec.kind == CodecKind::kInt8;
  const bool topk = spec.kind == CodecKind::kTopK;
  // 1 KiB chunks: the large size is tens of chunks per segment.
  const uint64_t chunk_bytes = 1024;
  uint64_t seq = 1;
  for (int n : {2, 3, 4, 5}) {
    InProcessHub hub(n, 2);
    for (size_t count : {size_t{0}, size_t{1}, size_t{7}, size_t{1003}, size_t{40011}}) {
      for (bool avg : {false, true}) {
        SCOPED_TRACE(::testing::Message() << mc.codec << " " << di->name << " nodes " << n
                                          << " count " << count << (avg ? " avg" : " sum"));
        std::vector<Buffer> in;
        std::vector<std::vector<uint8_t>> bufs;
        for (int k = 0; k < n; ++k) {
          in.push_back(MakeBuffer(mc.dtype, count, 1000 * n + 17 * k + count));
          bufs.push_back(in.back().bytes);
        }
        std::vector<absl::Status> st = RunCompressed(hub, *codec, nullptr, "t", mc.dtype, bufs,
                                                     count, chunk_bytes, seq++);
        for (int k = 0; k < n; ++k) ASSERT_TRUE(st[k].ok()) << "node " << k << ": " << st[k];
        if (avg) {
          for (int k = 0; k < n; ++k) DivideInPlace(mc.dtype, bufs[k].data(), count, n);
        }
        for (int k = 1; k < n; ++k) {
          ASSERT_EQ(0, std::memcmp(bufs[0].data(), bufs[k].data(), count * es))
              << "node " << k << " differs from node 0";
        }
        double sum_m = 0, max_s = 0, sum_l2 = 0;
        std::vector<double> exact(count, 0.0), abs_sum(count, 0.0);
        for (int k = 0; k < n; ++k) {
          double m = 0, l2 = 0;
          for (size_t i = 0; i < count; ++i) {
            const double v = in[k].values[i];
            exact[i] += v;
            abs_sum[i] += std::fabs(v);
            m = std::max(m, std::fabs(v));
            l2 += v * v;
          }
          sum_m += m;
          sum_l2 += std::sqrt(l2);
        }
        double s_l2 = 0;
        for (size_t i = 0; i < count; ++i) {
          max_s = std::max(max_s, std::fabs(exact[i]));
          s_l2 += exact[i] * exact[i];
        }
        s_l2 = std::sqrt(s_l2);
        const double scale = avg ? 1.0 / n : 1.0;
        double err_l2 = 0, worst = 0, arith_l2 = 0;
        for (size_t i = 0; i < count; ++i) {
          const double got = ValueAt(mc.dtype, bufs[0].data(), i);
          ASSERT_TRUE(std::isfinite(got)) << "element " << i;
          const double err = std::fabs(got - exact[i] * scale);
          const double mag = abs_sum[i] + std::fabs(exact[i]);
          const double arith = (n + 1) * di->u * mag * scale + (avg ? 2 * di->u * std::fabs(got) : 0);
          arith_l2 += arith * arith;
          err_l2 += err * err;
          if (topk) continue;
          double bound = arith + (uc * mag + n * 0x1p-25) * scale;
          if (int8) bound += (sum_m + max_s) / 254.0 * scale;
          bound *= 1.01;
          worst = std::max(worst, err / bound);
          ASSERT_LE(err, bound) << "element " << i << ": got " << got << ", exact "
                                << exact[i] * scale;
        }
        if (topk && count > 0) {
          const double ratio = spec.topk_ratio;
          const double bound = (std::sqrt(std::max(0.0, 1.0 - ratio)) * (sum_l2 + s_l2) * scale +
                                std::sqrt(arith_l2)) * 1.01;
          EXPECT_LE(std::sqrt(err_l2), bound);
        }
      }
    }
  }
}

std::vector<MatrixCase> AllSupported() {
  std::vector<MatrixCase> out;
  for (const char* c : {"none", "fp16", "bf16", "int8", "topk:0.01", "topk:0.3", "topk:1"}) {
    auto codec = MakeCodec(*ParseCodec(c));
    for (const DtypeInfo& d : kDtypes) {
      if (codec->Supports(d.dtype).ok()) out.push_back({c, d.dtype});
    }
  }
  return out;
}

INSTANTIATE_TEST_SUITE_P(AllCodecsAndDtypes, PipelinedCompressedTest,
                         ::testing::ValuesIn(AllSupported()), MatrixName);

// The same input on every node: the exact sum is N x, and the error relative
// to it stays within two compressions' worth whatever N is (a ring that
// re-compressed partial sums at each hop would add a compression per hop).
TEST(PipelinedCompressedBoundTest, RelativeErrorDoesNotGrowWithNodeCount) {
  for (const char* c : {"fp16", "bf16", "int8"}) {
    auto codec = MakeCodec(*ParseCodec(c));
    const double bound = std::string(c) == "int8" ? 2.0 / 254 * 1.01
                         : std::string(c) == "fp16" ? 2 * 0x1p-11 * 1.01
                                                    : 2 * 0x1p-8 * 1.01;
    const size_t count = 30001;
    for (int n : {2, 3, 4, 5, 6}) {
      InProcessHub hub(n, 2);
      Buffer x = MakeBuffer(wire::DataType::kFloat32, count, 5);
      std::vector<std::vector<uint8_t>> bufs(n, x.bytes);
      auto st = RunCompressed(hub, *codec, nullptr, "same", wire::DataType::kFloat32, bufs,
                              count, 4096, 1);
      for (int k = 0; k < n; ++k) ASSERT_TRUE(st[k].ok()) << st[k];
      double max_err = 0, max_s = 0;
      for (size_t i = 0; i < count; ++i) {
        const double s = n * x.values[i];
        max_s = std::max(max_s, std::fabs(s));
        max_err = std::max(max_err, std::fabs(ValueAt(wire::DataType::kFloat32, bufs[0].data(), i) - s));
      }
      EXPECT_LE(max_err / max_s, bound) << c << " nodes " << n;
    }
  }
}

// Chunk size changes between operations (every node agrees on each one),
// error feedback keeps tracking (residuals are kept per element, not per
// chunk), and the scratch buffer is reused across operations. Over T steps
// the running sum of results differs from T x the exact sum by the last
// residuals only: sum_k r_k + r_owner, each one compression's error, so
//   int8: |gap_i| <= (sum_k max|x_k + r_k| + max|s + r_o|) / 254, which we
//         bound by 1.05 (sum_k M_k + max|s|) / 254, plus float rounding of
//         the running sums (T * 2^-22 * A_i);
//   topk:R: ||gap||_2 <= q/(1-q) (sum_k ||x_k||_2 + ||s||_2), q = sqrt(1-R)
//         (README of compression/), and it must not grow with T.
// The residual cap holds one residual of the operation and not two: the
// contributions and the owner's sums share it, and nothing is evicted.
TEST(PipelinedCompressedFeedbackTest, RunningSumTracksExactSumWhileChunkSizeChanges) {
  const uint64_t chunk_sizes[] = {4096, 1024, 65536, 256, 3000, 1 << 20};
  for (const char* c : {"int8", "fp16", "topk:0.05"}) {
    for (int n : {2, 3}) {
      SCOPED_TRACE(::testing::Message() << c << " nodes " << n);
      auto codec = MakeCodec(*ParseCodec(c));
      const size_t count = 12345;
      InProcessHub hub(n, 2);
      std::vector<std::unique_ptr<ErrorFeedback>> fb;
      std::vector<ScratchBuffer> scratch(n);
      std::vector<Buffer> g;
      std::vector<double> exact(count, 0.0), abs_sum(count, 0.0);
      double sum_m = 0, sum_l2 = 0;
      const size_t cap = count * sizeof(float) * 3 / 2;
      for (int k = 0; k < n; ++k) {
        fb.push_back(std::make_unique<ErrorFeedback>(cap));
        g.push_back(MakeBuffer(wire::DataType::kFloat32, count, 77 + k));
        double m = 0, l2 = 0;
        for (size_t i = 0; i < count; ++i) {
          exact[i] += g[k].values[i];
          abs_sum[i] += std::fabs(g[k].values[i]);
          m = std::max(m, std::fabs(g[k].values[i]));
          l2 += g[k].values[i] * g[k].values[i];
        }
        sum_m += m;
        sum_l2 += std::sqrt(l2);
      }
      double max_s = 0, s_l2 = 0;
      for (double e : exact) {
        max_s = std::max(max_s, std::fabs(e));
        s_l2 += e * e;
      }
      s_l2 = std::sqrt(s_l2);
      std::vector<double> applied(count, 0.0);
      double gap_20 = 0;
      const int steps = 60;
      for (int step = 1; step <= steps; ++step) {
        std::vector<std::vector<uint8_t>> bufs;
        for (int k = 0; k < n; ++k) bufs.push_back(g[k].bytes);
        const uint64_t chunk = chunk_sizes[step % 6];
        auto st = RunCompressed(hub, *codec, &fb, "w", wire::DataType::kFloat32, bufs, count,
                                chunk, step, 2 + step % 3, &scratch);
        for (int k = 0; k < n; ++k) ASSERT_TRUE(st[k].ok()) << st[k];
        for (int k = 1; k < n; ++k) {
          ASSERT_EQ(0, std::memcmp(bufs[0].data(), bufs[k].data(), count * 4));
        }
        double gap2 = 0, worst = 0;
        for (size_t i = 0; i < count; ++i) {
          applied[i] += ValueAt(wire::DataType::kFloat32, bufs[0].data(), i);
          const double gap = applied[i] - step * exact[i];
          gap2 += gap * gap;
          worst = std::max(worst, std::fabs(gap) - step * 0x1p-22 * abs_sum[i]);
        }
        const double gap_l2 = std::sqrt(gap2);
        if (std::string(c) == "int8") {
          ASSERT_LE(worst, 1.05 * (sum_m + max_s) / 254) << "step " << step;
        } else if (std::string(c) == "fp16") {
          ASSERT_LE(worst, 1.05 * 0x1p-11 * (sum_m + max_s)) << "step " << step;
        } else {
          const double q = std::sqrt(1 - 0.05);
          ASSERT_LE(gap_l2, q / (1 - q) * (sum_l2 + s_l2)) << "step " << step;
        }
        if (step == 20) gap_20 = gap_l2;
        if (step == steps) {
          // Without feedback the gap grows linearly (x3 from step 20 to 60).
          EXPECT_LT(gap_l2, 1.5 * gap_20 + 1e-3) << gap_20 << " -> " << gap_l2;
        }
      }
      for (int k = 0; k < n; ++k) {
        const ErrorFeedback::Stats s = fb[k]->GetStats();
        EXPECT_EQ(s.size_resets, 0u);
        EXPECT_EQ(s.evictions, 0u);
        EXPECT_EQ(s.too_large, 0u);
        EXPECT_EQ(s.names, 1u);
        EXPECT_EQ(s.bytes, count * sizeof(float));
      }
    }
  }
}

// NaN and Inf reach every node (int8 sends their blocks raw: the overflow
// message path), and the result is the same on all nodes.
TEST(PipelinedCompressedTest, NonFiniteValuesTravelAndOverflowMessagesWork) {
  auto codec = MakeCodec(*ParseCodec("int8"));
  for (int n : {2, 3}) {
    InProcessHub hub(n, 2);
    const size_t count = 5000;
    std::vector<std::vector<uint8_t>> bufs;
    for (int k = 0; k < n; ++k) {
      Buffer b = MakeBuffer(wire::DataType::kFloat32, count, 3 + k);
      float* f = reinterpret_cast<float*>(b.bytes.data());
      if (k == 0) {
        for (size_t i = 0; i < count; i += 97) f[i] = std::numeric_limits<float>::infinity();
      }
      if (k == n - 1) f[4321] = std::numeric_limits<float>::quiet_NaN();
      bufs.push_back(b.bytes);
    }
    std::vector<CompressionStats> stats;
    auto st = RunCompressed(hub, *codec, nullptr, "nf", wire::DataType::kFloat32, bufs, count,
                            2048, 9, 3, nullptr, &stats);
    for (int k = 0; k < n; ++k) ASSERT_TRUE(st[k].ok()) << st[k];
    for (int k = 1; k < n; ++k) ASSERT_EQ(0, std::memcmp(bufs[0].data(), bufs[k].data(), count * 4));
    const float* r = reinterpret_cast<const float*>(bufs[0].data());
    for (size_t i = 0; i < count; i += 97) {
      if (i != 4321) EXPECT_TRUE(std::isinf(r[i]) && r[i] > 0) << i;
    }
    EXPECT_TRUE(std::isnan(r[4321]));
    // Raw blocks: more than the typical 1.016 bytes per element went out.
    EXPECT_GT(stats[0].wire_bytes, stats[0].raw_bytes / 4 * 1.03);
  }
}

// Nodes that disagree on the chunk size see messages of other sizes: an
// error on every node (the transport's DATA_LOSS), not a hang or a crash.
TEST(PipelinedCompressedTest, DisagreeingChunkSizesGiveAnError) {
  auto codec = MakeCodec(*ParseCodec("fp16"));
  InProcessHub hub(2, 1);
  const size_t count = 10000;
  std::vector<std::vector<uint8_t>> bufs(2, MakeBuffer(wire::DataType::kFloat32, count, 1).bytes);
  std::vector<absl::Status> status(2);
  std::vector<ScratchBuffer> scratch(2);
  std::vector<std::thread> threads;
  for (int k = 0; k < 2; ++k) {
    threads.emplace_back([&, k] {
      InterNodeContext ctx{hub.transport(k), uint64_t{3} << 24, k == 0 ? 4096u : 8192u, 2,
                           std::chrono::steady_clock::now() + std::chrono::seconds(3),
                           &scratch[k]};
      CompressionStats stats;
      status[k] = AllreduceCompressed(ctx, *codec, nullptr, "x", wire::DataType::kFloat32,
                                      bufs[k].data(), count, &stats);
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_FALSE(status[0].ok());
  EXPECT_FALSE(status[1].ok());
}

TEST(PipelinedCompressedTest, UnsupportedDtypeIsAClearError) {
  auto codec = MakeCodec(*ParseCodec("fp16"));
  InProcessHub hub(2, 1);
  ScratchBuffer scratch;
  InterNodeContext ctx{hub.transport(0), uint64_t{1} << 24, 4096, 2,
                       std::chrono::steady_clock::now() + std::chrono::seconds(3), &scratch};
  std::vector<double> d(10, 1.0);
  CompressionStats stats;
  absl::Status s = AllreduceCompressed(ctx, *codec, nullptr, "x", wire::DataType::kFloat64,
                                       d.data(), d.size(), &stats);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("float64"), absl::string_view::npos) << s;
}

// Fused operations (AllreduceCompressedPieces) on every node k: bufs[k]
// holds the packed buffer.
std::vector<absl::Status> RunPieces(InProcessHub& hub, const Codec& codec,
                                    std::vector<std::unique_ptr<ErrorFeedback>>* fb,
                                    const std::vector<FeedbackPiece>& pieces,
                                    std::vector<std::vector<float>>& bufs, uint64_t chunk_bytes,
                                    uint64_t seq, std::vector<ScratchBuffer>& scratch) {
  const int n = hub.num_nodes();
  std::vector<absl::Status> status(n);
  std::vector<std::thread> threads;
  for (int k = 0; k < n; ++k) {
    threads.emplace_back([&, k] {
      InterNodeContext ctx{hub.transport(k), seq << 24, chunk_bytes, 3,
                           std::chrono::steady_clock::now() + std::chrono::seconds(30),
                           &scratch[k]};
      CompressionStats stats;
      status[k] = AllreduceCompressedPieces(ctx, codec, fb ? (*fb)[k].get() : nullptr, pieces,
                                            wire::DataType::kFloat32, bufs[k].data(),
                                            bufs[k].size(), &stats);
    });
  }
  for (auto& t : threads) t.join();
  return status;
}

std::vector<FeedbackPiece> Pack(const std::vector<std::pair<std::string, size_t>>& ops) {
  std::vector<FeedbackPiece> pieces;
  size_t at = 0;
  for (const auto& [name, count] : ops) {
    pieces.push_back(FeedbackPiece{name, at, count});
    at += count;
  }
  return pieces;
}

// Several operations of different sizes (0, 1, odd, across chunks) and
// scales packed in one compressed allreduce: the same bits on every node,
// each element within the codec's bound against a float64 sum, where M_k
// and max|s| are taken over the packed buffer (an int8 block or a top-k
// chunk may span operations).
TEST(FusedCompressedTest, PackedOperationsWithinTheBoundAndTheSameEverywhere) {
  const std::vector<std::pair<std::string, size_t>> ops = {
      {"a", 1}, {"b", 0}, {"c", 777}, {"d", 5003}, {"e", 256}, {"#3", 300}};
  for (const char* c : {"int8", "fp16", "bf16", "topk:0.05"}) {
    for (int n : {2, 3, 4}) {
      SCOPED_TRACE(::testing::Message() << c << " nodes " << n);
      auto codec = MakeCodec(*ParseCodec(c));
      const auto pieces = Pack(ops);
      const size_t count = pieces.back().offset + pieces.back().count;
      InProcessHub hub(n, 2);
      std::vector<ScratchBuffer> scratch(n);
      std::vector<std::unique_ptr<ErrorFeedback>> fb;
      std::vector<std::vector<float>> bufs(n, std::vector<float>(count));
      std::vector<double> exact(count, 0.0), abs_sum(count, 0.0);
      double sum_m = 0, sum_l2 = 0;
      for (int k = 0; k < n; ++k) {
        fb.push_back(std::make_unique<ErrorFeedback>(64 << 20));
        std::vector<float> g = Gradient(k, count, 5);
        double m = 0, l2 = 0;
        for (size_t p = 0; p < pieces.size(); ++p) {
          for (size_t i = pieces[p].offset; i < pieces[p].offset + pieces[p].count; ++i) {
            bufs[k][i] = g[i] * static_cast<float>(p + 1);
          }
        }
        for (size_t i = 0; i < count; ++i) {
          exact[i] += bufs[k][i];
          abs_sum[i] += std::fabs(bufs[k][i]);
          m = std::max(m, double{std::fabs(bufs[k][i])});
          l2 += double{bufs[k][i]} * bufs[k][i];
        }
        sum_m += m;
        sum_l2 += std::sqrt(l2);
      }
      double max_s = 0, s_l2 = 0;
      for (double e : exact) {
        max_s = std::max(max_s, std::fabs(e));
        s_l2 += e * e;
      }
      s_l2 = std::sqrt(s_l2);
      auto st = RunPieces(hub, *codec, &fb, pieces, bufs, 4096, 1, scratch);
      for (int k = 0; k < n; ++k) ASSERT_TRUE(st[k].ok()) << st[k];
      for (int k = 1; k < n; ++k) ASSERT_EQ(bufs[k], bufs[0]) << "node " << k;
      double err2 = 0;
      for (size_t i = 0; i < count; ++i) {
        const double err = std::fabs(bufs[0][i] - exact[i]);
        const double arith = (n + 1) * 0x1p-24 * (abs_sum[i] + std::fabs(exact[i]));
        err2 += err * err;
        if (std::string(c) == "int8") {
          ASSERT_LE(err, (sum_m + max_s) / 254 * 1.001 + arith) << i;
        } else if (std::string(c) == "fp16") {
          ASSERT_LE(err, 0x1p-11 * (abs_sum[i] + std::fabs(exact[i])) + n * 0x1p-25 + arith) << i;
        } else if (std::string(c) == "bf16") {
          ASSERT_LE(err, 0x1p-8 * (abs_sum[i] + std::fabs(exact[i])) + arith) << i;
        }
      }
      if (std::string(c) == "topk:0.05") {
        EXPECT_LE(std::sqrt(err2), std::sqrt(1 - 0.05) * (sum_l2 + s_l2) * 1.001);
      }
      // Residuals under each named operation's own names, none for "#3".
      for (int k = 0; k < n; ++k) {
        EXPECT_EQ(fb[k]->GetStats().size_resets, 0u);
      }
    }
  }
}

// The pieces must cover the buffer: a clear error otherwise.
TEST(FusedCompressedTest, PiecesThatDoNotCoverTheBufferAreAnError) {
  auto codec = MakeCodec(*ParseCodec("int8"));
  InProcessHub hub(2, 1);
  ScratchBuffer scratch;
  InterNodeContext ctx{hub.transport(0), uint64_t{1} << 24, 4096, 2,
                       std::chrono::steady_clock::now() + std::chrono::seconds(3), &scratch};
  std::vector<float> d(100, 1.0f);
  for (const auto& pieces : {Pack({{"a", 40}, {"b", 50}}), Pack({{"a", 40}, {"b", 70}})}) {
    absl::Status s = AllreduceCompressedPieces(ctx, *codec, nullptr, pieces,
                                               wire::DataType::kFloat32, d.data(), d.size(),
                                               nullptr);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_NE(s.message().find("cover"), absl::string_view::npos) << s;
  }
  auto gap = Pack({{"a", 40}, {"b", 60}});
  gap[1].offset = 41;
  absl::Status s = AllreduceCompressedPieces(ctx, *codec, nullptr, gap, wire::DataType::kFloat32,
                                             d.data(), d.size(), nullptr);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
}

// Error feedback stays with each operation whatever it is fused with: three
// operations of fixed inputs, over 30 steps packed in changing groups and
// orders (an operation fused in one step runs alone, or fused at another
// offset, in the next). Each one's running sum of results tracks T times its
// exact sum within a bound that does not grow with T (the residuals left on
// the nodes, one per element and node: a contribution's on every node but
// the element's last owner, its sum's there; the unfused bound), checked at
// every step, and no residual is ever reset. Without feedback (or with residuals lost when the
// grouping changes) the gap grows with T: fixed inputs round the same way
// every step.
TEST(FusedCompressedTest, ErrorFeedbackStaysPerOperationAcrossFusionGroups) {
  const std::vector<std::pair<std::string, size_t>> all = {{"A", 1000}, {"B", 3000}, {"C", 517}};
  // Groups per step (each a list of indices into `all`, packed in that order).
  const std::vector<std::vector<std::vector<int>>> schedules = {
      {{0, 1}, {2}}, {{0}, {2, 1}}, {{1, 2, 0}}, {{2, 0}, {1}}};
  for (const char* c : {"int8", "fp16"}) {
    for (int n : {2, 3}) {
      SCOPED_TRACE(::testing::Message() << c << " nodes " << n);
      auto codec = MakeCodec(*ParseCodec(c));
      InProcessHub hub(n, 2);
      std::vector<ScratchBuffer> scratch(n);
      std::vector<std::unique_ptr<ErrorFeedback>> fb;
      for (int k = 0; k < n; ++k) fb.push_back(std::make_unique<ErrorFeedback>(64 << 20));
      // inputs[o][k]: operation o's input on node k.
      std::vector<std::vector<std::vector<float>>> inputs(all.size());
      std::vector<std::vector<double>> exact(all.size()), applied(all.size());
      double sum_m = 0, max_s = 0;
      std::vector<double> node_m(n, 0.0);
      for (size_t o = 0; o < all.size(); ++o) {
        exact[o].assign(all[o].second, 0.0);
        applied[o].assign(all[o].second, 0.0);
        for (int k = 0; k < n; ++k) {
          inputs[o].push_back(Gradient(k, all[o].second, 20 + static_cast<uint32_t>(o)));
          for (size_t i = 0; i < all[o].second; ++i) {
            exact[o][i] += inputs[o][k][i];
            node_m[k] = std::max(node_m[k], double{std::fabs(inputs[o][k][i])});
          }
        }
        for (double e : exact[o]) max_s = std::max(max_s, std::fabs(e));
      }
      for (double m : node_m) sum_m += m;
      const double bound = std::string(c) == "int8" ? 1.05 * (sum_m + max_s) / 254
                                                    : 1.05 * 0x1p-11 * (sum_m + max_s);
      const int steps = 30;
      uint64_t seq = 1;
      for (int step = 1; step <= steps; ++step) {
        for (const auto& group : schedules[step % schedules.size()]) {
          std::vector<std::pair<std::string, size_t>> ops;
          for (int o : group) ops.push_back(all[o]);
          const auto pieces = Pack(ops);
          const size_t count = pieces.back().offset + pieces.back().count;
          std::vector<std::vector<float>> bufs(n, std::vector<float>(count));
          for (int k = 0; k < n; ++k) {
            for (size_t g = 0; g < group.size(); ++g) {
              std::memcpy(bufs[k].data() + pieces[g].offset, inputs[group[g]][k].data(),
                          pieces[g].count * sizeof(float));
            }
          }
          auto st = RunPieces(hub, *codec, &fb, pieces, bufs, 2048 + 1024 * (step % 3), seq++,
                              scratch);
          for (int k = 0; k < n; ++k) ASSERT_TRUE(st[k].ok()) << st[k];
          for (int k = 1; k < n; ++k) ASSERT_EQ(bufs[k], bufs[0]);
          for (size_t g = 0; g < group.size(); ++g) {
            for (size_t i = 0; i < pieces[g].count; ++i) {
              applied[group[g]][i] += bufs[0][pieces[g].offset + i];
            }
          }
        }
        double worst = 0;
        for (size_t o = 0; o < all.size(); ++o) {
          for (size_t i = 0; i < exact[o].size(); ++i) {
            const double gap = std::fabs(applied[o][i] - step * exact[o][i]);
            worst = std::max(worst, gap - step * 0x1p-22 * (sum_m + max_s));
          }
        }
        ASSERT_LE(worst, bound) << "step " << step;
      }
      for (int k = 0; k < n; ++k) EXPECT_EQ(fb[k]->GetStats().size_resets, 0u) << "node " << k;
    }
  }
}

// Per node: never yields, yields throughout, or a flag that another thread
// flips on and off while the operation runs.
enum class YieldMode { kNo, kAlways, kToggling };

std::vector<absl::Status> RunYielding(InProcessHub& hub,
                                      std::vector<std::unique_ptr<SendsInFlight>>& wrapped,
                                      const Codec& codec, std::vector<std::vector<uint8_t>>& bufs,
                                      size_t count, const std::vector<YieldMode>& modes,
                                      uint64_t seq,
                                      std::function<std::unique_ptr<ChunkCoder>(int)> coder = {}) {
  const int n = hub.num_nodes();
  std::vector<absl::Status> status(n);
  std::vector<ScratchBuffer> scratch(n);
  std::vector<std::atomic<int>> flags(n);
  std::atomic<bool> stop{false};
  for (int k = 0; k < n; ++k) flags[k] = modes[k] == YieldMode::kAlways ? 1 : 0;
  std::thread toggler([&] {
    for (int i = 0; !stop.load(); ++i) {
      for (int k = 0; k < n; ++k) {
        if (modes[k] == YieldMode::kToggling) flags[k] = i & 1;
      }
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  });
  std::vector<std::thread> threads;
  for (int k = 0; k < n; ++k) {
    threads.emplace_back([&, k] {
      InterNodeContext ctx{wrapped[k].get(), seq << 24, 4096, 4,
                           std::chrono::steady_clock::now() + std::chrono::seconds(30),
                           &scratch[k]};
      ctx.yield = &flags[k];
      CompressionStats stats;
      if (coder) {  // node k's data "on a device"
        std::unique_ptr<ChunkCoder> c = coder(k);
        status[k] = AllreduceCompressedWith(ctx, codec, *c, wire::DataType::kFloat32,
                                            bufs[k].data(), count, &stats);
        return;
      }
      status[k] = AllreduceCompressed(ctx, codec, nullptr, "y", wire::DataType::kFloat32,
                                      bufs[k].data(), count, &stats);
    });
  }
  for (auto& t : threads) t.join();
  stop = true;
  toggler.join();
  return status;
}

// While yielding, at most one send is in flight; results are bit for bit
// those of the operation that does not yield, also when nodes disagree about
// yielding (some always, some never, some flipping during the operation).
TEST(PipelinedCompressedYieldTest, YieldingKeepsOneSendInFlightAndTheSameBits) {
  const size_t count = 20011;  // 1024-element chunks (4096 bytes): many per segment
  for (const char* name : {"none", "fp16", "int8", "topk:0.05"}) {
    auto codec = MakeCodec(*ParseCodec(name));
    for (int n : {2, 3, 4}) {
      SCOPED_TRACE(testing::Message() << name << " n=" << n);
      InProcessHub hub(n, 2);
      std::vector<std::unique_ptr<SendsInFlight>> wrapped;
      for (int k = 0; k < n; ++k) wrapped.push_back(std::make_unique<SendsInFlight>(hub.transport(k)));
      std::vector<std::vector<uint8_t>> inputs;
      for (int k = 0; k < n; ++k) {
        inputs.push_back(MakeBuffer(wire::DataType::kFloat32, count, 40 + k).bytes);
      }
      // Reference: nobody yields (and the counter must see more than one).
      auto ref = inputs;
      auto st = RunYielding(hub, wrapped, *codec, ref, count,
                            std::vector<YieldMode>(n, YieldMode::kNo), 1);
      for (int k = 0; k < n; ++k) ASSERT_TRUE(st[k].ok()) << st[k];
      int most = 0;
      for (auto& w : wrapped) most = std::max(most, w->max_seen());
      EXPECT_GT(most, 1) << "the counter sees the window when nobody yields";

      for (auto& w : wrapped) w->Reset();
      auto yielded = inputs;
      st = RunYielding(hub, wrapped, *codec, yielded, count,
                       std::vector<YieldMode>(n, YieldMode::kAlways), 2);
      for (int k = 0; k < n; ++k) ASSERT_TRUE(st[k].ok()) << st[k];
      for (int k = 0; k < n; ++k) {
        EXPECT_EQ(wrapped[k]->max_seen(), 1) << "node " << k << " had more than one send in flight";
        EXPECT_EQ(yielded[k], ref[k]) << "node " << k;
      }

      std::vector<YieldMode> mixed(n);
      for (int k = 0; k < n; ++k) {
        mixed[k] = k == 0 ? YieldMode::kToggling : (k % 2 ? YieldMode::kAlways : YieldMode::kNo);
      }
      for (auto& w : wrapped) w->Reset();
      auto disagreeing = inputs;
      st = RunYielding(hub, wrapped, *codec, disagreeing, count, mixed, 3);
      for (int k = 0; k < n; ++k) ASSERT_TRUE(st[k].ok()) << st[k];
      for (int k = 0; k < n; ++k) {
        if (mixed[k] == YieldMode::kAlways) EXPECT_EQ(wrapped[k]->max_seen(), 1) << "node " << k;
        EXPECT_EQ(disagreeing[k], ref[k]) << "node " << k;
      }
    }
  }
}

// A ChunkCoder standing in for a device's: the CPU codec (and ErrorFeedback)
// runs on a thread of its own, each encoding after a short random delay,
// so encodings complete while the pipeline goes on and it must wait for
// them in order. Encodings and decodings must use HostMemory's memory.
// `fault_at`: the encoding of that index (0-based) fails as a device fault
// would, 300 ms after it began: never woken, EncodeDone an error from
// then on, no encoding runs
// after (decodings still do: the fault is seen through EncodeDone only).
class ThreadCoder final : public ChunkCoder {
 public:
  ThreadCoder(const Codec& codec, ErrorFeedback* fb, std::string name, size_t count, uint32_t seed,
              int fault_at = -1)
      : codec_(codec),
        fb_(fb),
        name_(std::move(name)),
        count_(count),
        rng_(seed),
        fault_at_(fault_at),
        thread_([this] { Loop(); }) {}
  ~ThreadCoder() override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }

  absl::StatusOr<uint8_t*> HostMemory(size_t bytes) override {
    host_.assign(bytes, 0);
    return host_.data();
  }
  absl::Status BeginEncode(void* data, size_t first, size_t count, bool own_sum, void* out,
                           std::function<void()> wake) override {
    if (!InHost(out, codec_.MaxEncodedBytes(wire::DataType::kFloat32, count))) {
      return absl::FailedPreconditionError("encoding outside the coder's host memory");
    }
    auto job = std::make_shared<Job>();
    job->run = [=, this, job = job.get()] {
      auto* f = static_cast<float*>(data);
      if (fb_ != nullptr) fb_->ApplyRange(name_, count_, first, f, count);
      job->bytes = codec_.Encode(wire::DataType::kFloat32, data, count, out);
      if (fb_ == nullptr && !own_sum) return;
      std::vector<float> decoded(count);
      if (!codec_.Decode(wire::DataType::kFloat32, out, job->bytes, count, decoded.data()).ok()) {
        job->bytes = ~uint64_t{0};  // EndEncode's caller sees the size refused
        return;
      }
      if (fb_ != nullptr) fb_->UpdateRange(name_, count_, first, f, decoded.data(), count);
      if (own_sum) std::memcpy(data, decoded.data(), count * sizeof(float));
    };
    job->wake = std::move(wake);
    std::lock_guard<std::mutex> lock(mu_);
    job->fault = begun_count_++ == fault_at_;
    job->delay = std::chrono::microseconds(std::uniform_int_distribution<int>(0, 300)(rng_));
    queue_.push_back(job);
    begun_.push_back(job);
    most_ahead = std::max(most_ahead, begun_.size());
    cv_.notify_all();
    return absl::OkStatus();
  }
  absl::StatusOr<bool> EncodeDone() override {
    std::lock_guard<std::mutex> lock(mu_);
    if (begun_.empty()) return absl::FailedPreconditionError("no encoding begun");
    if (faulted_) return absl::InternalError("device fault (test)");
    return begun_.front()->done;
  }
  absl::StatusOr<uint64_t> EndEncode() override {
    std::lock_guard<std::mutex> lock(mu_);
    if (begun_.empty() || !begun_.front()->done) {
      return absl::FailedPreconditionError("ended before it was done");
    }
    const uint64_t bytes = begun_.front()->bytes;
    begun_.pop_front();
    ++ended;
    return bytes;
  }
  absl::Status Decode(const void* in, uint64_t bytes, size_t count, void* data, bool add) override {
    if (!InHost(in, bytes)) {
      return absl::FailedPreconditionError("decoding from outside the coder's host memory");
    }
    std::unique_lock<std::mutex> lock(mu_);  // after the encodings begun
    cv_.wait(lock, [&] { return (queue_.empty() || fault_pending_) && !running_; });
    return add ? codec_.DecodeAdd(wire::DataType::kFloat32, in, bytes, count, data)
               : codec_.Decode(wire::DataType::kFloat32, in, bytes, count, data);
  }

  size_t most_ahead = 0;  // encodings begun and not ended at once, at most
  size_t ended = 0;

 private:
  struct Job {
    std::function<void()> run;
    std::function<void()> wake;
    std::chrono::microseconds delay{0};
    bool fault = false;
    bool done = false;  // guarded by mu_
    uint64_t bytes = 0;
  };
  bool InHost(const void* p, size_t bytes) const {
    const auto* q = static_cast<const uint8_t*>(p);
    return q >= host_.data() && bytes <= host_.size() &&
           static_cast<size_t>(q - host_.data()) <= host_.size() - bytes;
  }
  void Loop() {
    std::unique_lock<std::mutex> lock(mu_);
    while (true) {
      cv_.wait(lock, [&] { return stop_ || (!queue_.empty() && !faulted_); });
      if (stop_) return;
      std::shared_ptr<Job> job = queue_.front();
      queue_.pop_front();
      if (job->fault) {
        // Late, after the transfers it could have been seen beside (the
        // decodings go on meanwhile): only the pipeline asking on its own
        // finds it.
        fault_pending_ = true;
        cv_.notify_all();
        cv_.wait_for(lock, std::chrono::milliseconds(300), [&] { return stop_; });
        faulted_ = true;
        queue_.clear();
        cv_.notify_all();
        continue;
      }
      running_ = true;
      lock.unlock();
      std::this_thread::sleep_for(job->delay);
      job->run();
      lock.lock();
      job->done = true;
      running_ = false;
      cv_.notify_all();
      lock.unlock();
      job->wake();
      lock.lock();
    }
  }

  const Codec& codec_;
  ErrorFeedback* const fb_;
  const std::string name_;
  const size_t count_;
  std::mt19937 rng_;
  const int fault_at_;
  std::vector<uint8_t> host_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::shared_ptr<Job>> queue_, begun_;  // guarded by mu_
  int begun_count_ = 0;
  bool running_ = false, fault_pending_ = false, faulted_ = false, stop_ = false;
  std::thread thread_;  // last: started once the rest is there
};

// One compressed allreduce of bufs[k] (float32) on every node k: through a
// ThreadCoder each (coders[k], made here) or, with coders null, the CPU
// codec; error feedback in fb[k] (null: none).
std::vector<absl::Status> RunCoded(InProcessHub& hub, const Codec& codec,
                                   std::vector<std::vector<float>>& bufs,
                                   std::vector<std::unique_ptr<ErrorFeedback>>* fb,
                                   std::vector<std::unique_ptr<ThreadCoder>>* coders, uint64_t seq,
                                   std::chrono::milliseconds timeout, int fault_node = -1,
                                   int fault_at = -1,
                                   std::vector<std::chrono::milliseconds>* took = nullptr) {
  const int n = hub.num_nodes();
  std::vector<absl::Status> status(n);
  std::vector<ScratchBuffer> scratch(n);
  if (coders != nullptr) {
    coders->clear();
    for (int k = 0; k < n; ++k) {
      coders->push_back(std::make_unique<ThreadCoder>(codec, fb ? (*fb)[k].get() : nullptr, "c",
                                                      bufs[k].size(), 100 * seq + k,
                                                      k == fault_node ? fault_at : -1));
    }
  }
  std::vector<std::thread> threads;
  if (took != nullptr) took->assign(n, std::chrono::milliseconds(0));
  for (int k = 0; k < n; ++k) {
    threads.emplace_back([&, k] {
      const auto start = std::chrono::steady_clock::now();
      InterNodeContext ctx{hub.transport(k), seq << 24, 4096, 4, start + timeout, &scratch[k]};
      CompressionStats stats;
      status[k] = coders != nullptr
                      ? AllreduceCompressedWith(ctx, codec, *(*coders)[k], wire::DataType::kFloat32,
                                                bufs[k].data(), bufs[k].size(), &stats)
                      : AllreduceCompressed(ctx, codec, fb ? (*fb)[k].get() : nullptr, "c",
                                            wire::DataType::kFloat32, bufs[k].data(),
                                            bufs[k].size(), &stats);
      if (took != nullptr) {
        (*took)[k] = std::chrono::duration_cast<std::chrono::milliseconds>(
            std::chrono::steady_clock::now() - start);
      }
    });
  }
  for (auto& t : threads) t.join();
  return status;
}

// With a coder whose encodings complete later, on their own time, the
// pipeline encodes ahead (more than one begun at once) and every node ends
// with the bits of the same operation encoded on the CPU: every codec, 2 to
// 5 nodes, sizes of 1, odd, one chunk and many chunks (1024 elements each),
// int8 with blocks that travel raw (NaN, Inf: overflow messages), and two
// steps with error feedback (the residuals of the first matter).
TEST(CompressedCoderTest, EncodingAheadGivesTheCpuBits) {
  for (const char* name : {"fp16", "bf16", "int8", "topk:0.05"}) {
    auto codec = MakeCodec(*ParseCodec(name));
    for (int n : {2, 3, 5}) {
      for (size_t count : {size_t{1}, size_t{1001}, size_t{20011}}) {
        for (bool feedback : {false, true}) {
          SCOPED_TRACE(testing::Message() << name << " n=" << n << " count=" << count
                                          << (feedback ? " feedback" : ""));
          InProcessHub hub(n, 2);
          std::vector<std::unique_ptr<ErrorFeedback>> fb[2];
          for (auto& f : fb) {
            for (int k = 0; k < n; ++k) f.push_back(std::make_unique<ErrorFeedback>(64 << 20));
          }
          size_t most = 0;
          for (int step = 0; step < 2; ++step) {
            std::vector<std::vector<float>> in;
            for (int k = 0; k < n; ++k) in.push_back(Gradient(k, count, 11 + step));
            if (count > 5000 && std::string(name) == "int8") {
              in[0][4321] = std::numeric_limits<float>::quiet_NaN();
              in[n - 1][count - 7] = std::numeric_limits<float>::infinity();
            }
            auto cpu = in, coded = in;
            const uint64_t seq = 2 * step + 1;
            auto st = RunCoded(hub, *codec, cpu, feedback ? &fb[0] : nullptr, nullptr, seq,
                               std::chrono::seconds(30));
            for (int k = 0; k < n; ++k) ASSERT_TRUE(st[k].ok()) << st[k];
            std::vector<std::unique_ptr<ThreadCoder>> coders;
            st = RunCoded(hub, *codec, coded, feedback ? &fb[1] : nullptr, &coders, seq + 1,
                          std::chrono::seconds(30));
            for (int k = 0; k < n; ++k) {
              ASSERT_TRUE(st[k].ok()) << "node " << k << ": " << st[k];
              ASSERT_EQ(0, std::memcmp(cpu[k].data(), coded[k].data(), count * 4))
                  << "node " << k << ", step " << step;
              EXPECT_GT(coders[k]->ended, 0u);
              most = std::max(most, coders[k]->most_ahead);
            }
          }
          if (count > 5000) {
            EXPECT_GE(most, 2u) << "nothing was encoded ahead";
          }
        }
      }
    }
  }
}

// Through coders that encode ahead, yielding still keeps one send in
// flight (nothing is encoded ahead then) and gives the bits of the
// operation that does not yield, also when nodes disagree about yielding.
TEST(CompressedCoderTest, YieldingKeepsOneSendInFlightAndTheSameBits) {
  const size_t count = 20011;
  for (const char* name : {"fp16", "int8"}) {
    auto codec = MakeCodec(*ParseCodec(name));
    const int n = 3;
    SCOPED_TRACE(name);
    InProcessHub hub(n, 2);
    std::vector<std::unique_ptr<SendsInFlight>> wrapped;
    for (int k = 0; k < n; ++k)
      wrapped.push_back(std::make_unique<SendsInFlight>(hub.transport(k)));
    std::vector<std::vector<uint8_t>> inputs;
    for (int k = 0; k < n; ++k) {
      inputs.push_back(MakeBuffer(wire::DataType::kFloat32, count, 60 + k).bytes);
    }
    auto ref = inputs;
    auto st =
        RunYielding(hub, wrapped, *codec, ref, count, std::vector<YieldMode>(n, YieldMode::kNo), 1);
    for (int k = 0; k < n; ++k) ASSERT_TRUE(st[k].ok()) << st[k];
    uint32_t round = 0;  // the nodes' threads make their coders: seeds by node
    auto coder = [&](int k) {
      return std::make_unique<ThreadCoder>(*codec, nullptr, "y", count, 100 * round + k);
    };
    const std::vector<YieldMode> modes[] = {
        std::vector<YieldMode>(n, YieldMode::kAlways),
        {YieldMode::kToggling, YieldMode::kAlways, YieldMode::kNo}};
    for (const auto& mode : modes) {
      for (auto& w : wrapped) w->Reset();
      auto coded = inputs;
      ++round;
      st = RunYielding(hub, wrapped, *codec, coded, count, mode, 1 + round, coder);
      for (int k = 0; k < n; ++k) {
        ASSERT_TRUE(st[k].ok()) << st[k];
        if (mode[k] == YieldMode::kAlways) {
          EXPECT_EQ(wrapped[k]->max_seen(), 1) << "node " << k;
        }
        EXPECT_EQ(coded[k], ref[k]) << "node " << k;
      }
    }
  }
}

// A coder's device that faults mid-way (its encoding never completes, no
// wake comes) fails that node's operation with the device's error, well
// before the deadline (the pipeline asks the coder again on its own, then
// cancels what it has posted); the other nodes fail too, none hangs.
TEST(CompressedCoderTest, ADeviceFaultFailsTheOperationNotAHang) {
  auto codec = MakeCodec(*ParseCodec("int8"));
  const int n = 3;
  // The third encoding and the fourteenth, of about twenty.
  for (int fault_at : {2, 13}) {
    SCOPED_TRACE(fault_at);
    InProcessHub hub(n, 1);
    std::vector<std::vector<float>> bufs;
    for (int k = 0; k < n; ++k) bufs.push_back(Gradient(k, 20011, 5));
    std::vector<std::unique_ptr<ThreadCoder>> coders;
    const auto start = std::chrono::steady_clock::now();
    std::vector<std::chrono::milliseconds> took;
    auto st = RunCoded(hub, *codec, bufs, nullptr, &coders, 1, std::chrono::milliseconds(4000),
                       /*fault_node=*/1, /*fault_at=*/fault_at, &took);
    EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(10));
    // The failing node cancels its transfers at once rather than waiting for
    // them to the deadline (the others learn of it through their job, which
    // is not part of this test: here they end at the deadline).
    EXPECT_LT(took[1], std::chrono::milliseconds(2000)) << took[1].count() << " ms";
    EXPECT_EQ(st[1].code(), absl::StatusCode::kInternal) << st[1];
    EXPECT_NE(st[1].message().find("device fault (test)"), std::string::npos) << st[1];
    EXPECT_NE(st[1].message().find("encoding chunk"), std::string::npos) << st[1];
    for (int k = 0; k < n; ++k) EXPECT_FALSE(st[k].ok()) << "node " << k;
  }
}

TEST(CompressedAllreduceFaultTest, KilledNodeGivesAnErrorNotAHang) {
  auto codec = MakeCodec(*ParseCodec("int8"));
  InProcessHub hub(3, 1);
  hub.KillNode(2);
  Outcome run;
  for (int k = 0; k < 3; ++k) run.data.push_back(Gradient(k, 5000, 1));
  RunOnce(hub, *codec, nullptr, "x", &run, 1);
  EXPECT_FALSE(run.status[0].ok());
  EXPECT_FALSE(run.status[1].ok());
}

}  // namespace
}  // namespace ciuic::daemon
