#include "shm/rings.h"

#include <gtest/gtest.h>

#include <time.h>

#include <cstring>
#include <string>

#include "shm/session_memory.h"

namespace ciuic::daemon {
namespace {

class RingsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto mem = SessionMemory::Create(1 << 16);
    ASSERT_TRUE(mem.ok()) << mem.status();
    mem_ = std::move(*mem);
    h_ = mem_->header();
  }
  // What a trainer does to submit.
  void TrainerSubmit(uint64_t op_id) {
    uint32_t tail = h_->sq_tail.load();
    wire::SubmissionEntry& e = mem_->submissions()[tail & (h_->sq_capacity - 1)];
    std::memset(&e, 0, sizeof(e));
    e.op_id = op_id;
    h_->sq_tail.store(tail + 1);
  }
  std::unique_ptr<SessionMemory> mem_;
  wire::SessionHeader* h_;
};

TEST_F(RingsTest, SubmissionsComeOutInOrderAcrossWraparound) {
  SubmissionReader reader(h_, mem_->submissions(), h_->sq_capacity);
  EXPECT_FALSE(reader.HasPending());
  uint64_t next_expected = 0;
  uint64_t next_submit = 0;
  // 3.5 laps of the ring in uneven batches.
  for (int round = 0; round < 100; ++round) {
    int batch = (round * 37) % 90 + 1;
    for (int i = 0; i < batch; ++i) TrainerSubmit(next_submit++);
    EXPECT_TRUE(reader.HasPending());
    wire::SubmissionEntry e;
    while (true) {
      auto got = reader.Pop(&e);
      ASSERT_TRUE(got.ok()) << got.status();
      if (!*got) break;
      EXPECT_EQ(e.op_id, next_expected++);
    }
    EXPECT_EQ(h_->sq_head.load(), static_cast<uint32_t>(next_submit));
  }
  EXPECT_EQ(next_expected, next_submit);
  EXPECT_GT(next_submit, 3u * h_->sq_capacity);
}

TEST_F(RingsTest, ImpossibleTailIsDataLoss) {
  SubmissionReader reader(h_, mem_->submissions(), h_->sq_capacity);
  h_->sq_tail.store(h_->sq_capacity + 1);
  wire::SubmissionEntry e;
  auto got = reader.Pop(&e);
  EXPECT_EQ(got.status().code(), absl::StatusCode::kDataLoss);
  // A tail "behind" the head (wrapped negative) is just as impossible.
  h_->sq_tail.store(0xffffffffu);
  EXPECT_EQ(reader.Pop(&e).status().code(), absl::StatusCode::kDataLoss);
}

TEST_F(RingsTest, CompletionsCarryStatusAndTruncatedMessage) {
  CompletionWriter writer(h_, mem_->completions(), h_->cq_capacity);
  timespec before{};
  clock_gettime(CLOCK_MONOTONIC, &before);
  ASSERT_TRUE(writer.Push(7, 0, "").ok());
  std::string long_message(1000, 'x');
  ASSERT_TRUE(writer.Push(8, 3, long_message).ok());
  // What the engine passes for a success: an empty view with no data.
  ASSERT_TRUE(writer.Push(9, 0, absl::OkStatus().message()).ok());
  EXPECT_EQ(h_->cq_tail.load(), 3u);
  const wire::CompletionEntry& a = mem_->completions()[0];
  const wire::CompletionEntry& b = mem_->completions()[1];
  EXPECT_EQ(a.op_id, 7u);
  EXPECT_EQ(a.status_code, 0);
  EXPECT_EQ(a.message_len, 0u);
  // Stamped with the host's monotonic clock, which the SDK reads too.
  EXPECT_GE(a.completed_ns, static_cast<uint64_t>(before.tv_sec) * 1000000000ULL +
                                static_cast<uint64_t>(before.tv_nsec));
  EXPECT_LE(a.completed_ns, b.completed_ns);
  EXPECT_EQ(b.op_id, 8u);
  EXPECT_EQ(b.status_code, 3);
  EXPECT_EQ(b.message_len, wire::kMaxMessage);
  EXPECT_EQ(mem_->completions()[2].op_id, 9u);
  EXPECT_EQ(mem_->completions()[2].message_len, 0u);
}

TEST_F(RingsTest, FullCompletionRingIsAnErrorNotAnOverwrite) {
  CompletionWriter writer(h_, mem_->completions(), h_->cq_capacity);
  for (uint32_t i = 0; i < h_->cq_capacity; ++i) ASSERT_TRUE(writer.Push(i, 0, "").ok());
  EXPECT_EQ(writer.Push(99, 0, "").code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(mem_->completions()[0].op_id, 0u);
  h_->cq_head.store(1);  // trainer reaps one
  EXPECT_TRUE(writer.Push(100, 0, "").ok());
  h_->cq_head.store(h_->cq_capacity + 50);  // head ahead of tail: garbage
  EXPECT_EQ(writer.Push(101, 0, "").code(), absl::StatusCode::kDataLoss);
}

// A message past kMaxMessage keeps its head and its tail, where a nested
// error's root cause is; cuts never split a UTF-8 character; shorter
// messages pass whole.
TEST(ClipMessageTest, KeepsTheHeadAndTheRootCauseAndWholeCharacters) {
  char out[wire::kMaxMessage];
  auto clip = [&](const std::string& m) {
    return std::string(out, wire::ClipMessage(m.data(), m.size(), out));
  };
  EXPECT_EQ(clip(""), "");
  const std::string fits(wire::kMaxMessage, 'a');
  EXPECT_EQ(clip(fits), fits);
  const std::string head = "AllreduceRing: receive from node 1 (host1) failed: lost peer 1: ";
  const std::string cause = "rank 3 (pid 24680) left: trainer disconnected";
  const std::string m = head + std::string(300, 'm') + cause;
  const std::string got = clip(m);
  EXPECT_EQ(got.size(), wire::kMaxMessage);
  EXPECT_EQ(got.find(head), 0u) << got;
  EXPECT_EQ(got.substr(wire::kMessageHead, 5), " ... ") << got;
  EXPECT_EQ(got.substr(got.size() - cause.size()), cause) << got;
  // Two-byte characters (U+00E9) across both cuts: the head ends before the
  // character the cut would split, the tail starts after it.
  for (size_t shift : {0, 1}) {
    std::string wide(shift, 'x');
    while (wide.size() < 400) wide += "\xc3\xa9";
    const std::string w = clip(wide);
    EXPECT_LE(w.size(), wire::kMaxMessage);
    EXPECT_TRUE(wire::IsValidUtf8(w.data(), w.size())) << shift;
    EXPECT_NE(w.find(" ... "), std::string::npos);
  }
}

// A long message's quoted names (operation names, job ids) are shortened
// first, so that what surrounds them fits: a mismatch of an operation with
// a name of kMaxOpName bytes keeps both ranks' signatures whole and the
// start and end of the name, and a lost node's message with a 256-byte job
// id twice keeps the rank that left. Quoted text with a space is never
// shortened (the middle is cut instead), names of kNameKeep bytes stay whole,
// shortening cuts between characters, and a message that fits is left as
// it is whatever its names.
TEST(ClipMessageTest, ShortensLongQuotedNamesBeforeCuttingTheMiddle) {
  char out[wire::kMaxMessage];
  auto clip = [&](const std::string& m) {
    return std::string(out, wire::ClipMessage(m.data(), m.size(), out));
  };
  std::string name = "grads.layer";
  while (name.size() < wire::kMaxOpName) name += static_cast<char>('a' + name.size() % 26);
  const std::string sig0 = "allreduce float32 count=1048576 op=sum compression=int8";
  const std::string sig1 = "allreduce bfloat16 count=1048577 op=avg compression=int8";
  const std::string m = "operation '" + name + "' mismatched across ranks: rank 0 submitted " +
                        sig0 + ", rank 3 submitted " + sig1;
  ASSERT_GT(m.size(), wire::kMaxMessage);
  const std::string got = clip(m);
  EXPECT_LE(got.size(), wire::kMaxMessage);
  EXPECT_EQ(got.find(" ... "), std::string::npos) << got;  // nothing cut from the middle
  EXPECT_NE(got.find("rank 0 submitted " + sig0 + ", rank 3 submitted " + sig1), std::string::npos)
      << got;
  const std::string short_name =
      name.substr(0, wire::kNameHead) + "..." + name.substr(name.size() - wire::kNameTail);
  EXPECT_EQ(got.find("operation '" + short_name + "' mismatched"), 0u) << got;
  // A job id of 256 bytes and the rank that left, whole.
  const std::string job = "train-" + std::string(250, 'j');
  const std::string left = "node host1 (ranks 2,3) left job '" + job +
                           "': rank 3 (pid 24680) of job '" + job + "' left: trainer disconnected";
  const std::string left_got = clip(left);
  const std::string short_job = job.substr(0, wire::kNameHead) + "..." + std::string(8, 'j');
  EXPECT_EQ(left_got, "node host1 (ranks 2,3) left job '" + short_job +
                          "': rank 3 (pid 24680) of job '" + short_job +
                          "' left: trainer disconnected");

  // Quoted text with a space is not shortened: the middle is cut. A name
  // of kNameKeep bytes stays whole.
  const std::string spaced =
      "operation '" + std::string(150, 'x') + " " + std::string(150, 'y') + "' failed: rank 3 left";
  const std::string spaced_got = clip(spaced);
  EXPECT_EQ(spaced_got.find("operation '" + std::string(139, 'x') + " ... "), 0u) << spaced_got;
  EXPECT_EQ(spaced_got.substr(spaced_got.size() - 21), "' failed: rank 3 left") << spaced_got;
  const std::string keep(wire::kNameKeep, 'k');
  const std::string with_keep = "operation '" + keep + "' failed: " + std::string(300, 'r');
  EXPECT_EQ(clip(with_keep).find("operation '" + keep + "' failed: "), 0u);

  // Two-byte characters (U+00E9) in a name: the shortened name is whole
  // characters, at either alignment.
  for (size_t shift : {0, 1}) {
    std::string wide(shift, 'x');
    while (wide.size() < wire::kMaxOpName) wide += "\xc3\xa9";
    const std::string w = clip("operation '" + wide + "': " + std::string(300, 'e'));
    EXPECT_TRUE(wire::IsValidUtf8(w.data(), w.size())) << shift;
    const size_t dots = w.find("...");
    ASSERT_NE(dots, std::string::npos) << w;
    EXPECT_EQ(w.find("': "), dots + 3 + wire::kNameTail) << w;
    EXPECT_EQ(dots, std::string("operation '").size() + wire::kNameHead - shift) << w;
  }
  // A message that fits keeps its names whole.
  const std::string fits = "operation '" + name + "' failed";
  ASSERT_LE(fits.size(), wire::kMaxMessage);
  EXPECT_EQ(clip(fits), fits);
}

}  // namespace
}  // namespace ciuic::daemon
