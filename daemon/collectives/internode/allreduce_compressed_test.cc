// AllreduceCompressed over the in-process hub: every node gets the same
// bits, the error against the exact sum stays within the codec's bound, and
// error feedback makes the running sum of results track the exact one.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <memory>
#include <random>
#include <thread>
#include <vector>

#include "collectives/internode/in_process_transport.h"
#include "collectives/internode/internode.h"

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
    ASSERT_EQ(0, std::memcmp(run.data[0].data(), run.data[k].data(), c.count * 4))
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
