#include "format.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace ciuic::ctl {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

google::protobuf::RepeatedField<int32_t> Ranks(std::initializer_list<int32_t> ranks) {
  return google::protobuf::RepeatedField<int32_t>(ranks.begin(), ranks.end());
}

proto::StatusReply SampleStatus() {
  proto::StatusReply status;
  status.set_version("0.1.0");
  status.set_node_name("gpu-01");
  status.set_uptime_seconds(3 * 3600 + 5 * 60 + 7);
  status.set_socket_path("/run/ciuic/ciuicd.sock");
  status.set_worker_threads(8);
  status.set_peer_address("10.0.0.1:7361");
  status.set_ordering_port(40123);
  status.set_reduce_kernels("avx512");
  status.set_metrics_address("10.0.0.1:9464");
  status.set_ops_completed(1234);
  status.set_ops_failed(2);
  status.set_bytes_reduced(uint64_t{3} << 30);
  status.set_cuda_built(true);
  status.set_gpu_mapped_allocations(12);
  status.set_gpu_mapped_bytes(uint64_t{6} << 30);
  status.set_gpu_pinned_host_bytes(uint64_t{64} << 20);
  for (int i : {0, 1}) {
    proto::GpuInfo* gpu = status.add_gpus();
    gpu->set_index(i);
    gpu->set_name("NVIDIA H200");
    gpu->set_memory_bytes(uint64_t{140} << 30);
    gpu->set_compute_major(9);
    gpu->set_compute_minor(0);
  }
  proto::SessionInfo* session = status.add_sessions();
  session->set_session_id(17);
  session->set_uid(1000);
  session->set_pid(4242);
  session->set_job_id("resnet");
  session->set_rank(3);
  session->set_arena_bytes(uint64_t{2} << 30);
  proto::SessionInfo* idle = status.add_sessions();
  idle->set_session_id(18);
  idle->set_uid(1001);
  idle->set_pid(99);
  idle->set_arena_bytes(64 << 20);
  proto::JobInfo* job = status.add_jobs();
  job->set_job_id("resnet");
  job->set_uid(1000);
  job->set_world_size(16);
  job->set_local_size(4);
  for (int rank : {2, 0, 1, 3}) job->add_ranks(rank);
  job->set_state("running");
  job->set_ops_completed(1200);
  job->set_ops_failed(1);
  job->set_bytes_reduced(1536 << 20);
  proto::PendingOp* op = job->add_pending();
  op->set_name("grad.layer4");
  op->set_collective("ALLREDUCE");
  op->set_bytes(4 << 20);
  op->set_age_seconds(2.25);
  for (int rank : {0, 1, 2}) op->add_submitted_ranks(rank);
  op->add_waiting_for_ranks(3);
  return status;
}

TEST(HumanBytesTest, BinaryUnits) {
  EXPECT_EQ(HumanBytes(0), "0 B");
  EXPECT_EQ(HumanBytes(1023), "1023 B");
  EXPECT_EQ(HumanBytes(1024), "1.0 KiB");
  EXPECT_EQ(HumanBytes(1536), "1.5 KiB");
  EXPECT_EQ(HumanBytes(4 << 20), "4.0 MiB");
  EXPECT_EQ(HumanBytes((1 << 20) - 1), "1.0 MiB");
  EXPECT_EQ(HumanBytes(uint64_t{3} << 30), "3.0 GiB");
  EXPECT_EQ(HumanBytes(uint64_t{5} << 40), "5.0 TiB");
  EXPECT_EQ(HumanBytes(std::numeric_limits<uint64_t>::max()), "16.0 EiB");
}

TEST(HumanDurationTest, Readable) {
  EXPECT_EQ(HumanDuration(0), "0.0s");
  EXPECT_EQ(HumanDuration(2.25), "2.2s");
  EXPECT_EQ(HumanDuration(59.99), "59.9s");
  EXPECT_EQ(HumanDuration(303), "5m 03s");
  EXPECT_EQ(HumanDuration(2 * 3600 + 5 * 60 + 59), "2h 05m");
  EXPECT_EQ(HumanDuration(3 * 86400 + 4 * 3600), "3d 04h");
  EXPECT_EQ(HumanDuration(-1), "-");
  EXPECT_EQ(HumanDuration(std::nan("")), "-");
  EXPECT_EQ(HumanDuration(std::numeric_limits<double>::infinity()), "-");
}

TEST(FormatRanksTest, Ranges) {
  EXPECT_EQ(FormatRanks(Ranks({})), "-");
  EXPECT_EQ(FormatRanks(Ranks({5})), "5");
  EXPECT_EQ(FormatRanks(Ranks({3, 0, 1, 2, 7})), "0-3,7");
  EXPECT_EQ(FormatRanks(Ranks({1, 3, 5, 6, 6})), "1,3,5-6");
}

TEST(TableTest, AlignsColumns) {
  Table table({"NAME", "N"});
  table.SetAlign(1, Table::Align::kRight);
  table.AddRow({"a", "1"});
  table.AddRow({"longer", "100"});
  table.AddRow({"short"});
  EXPECT_EQ(table.Render(),
            "NAME      N\n"
            "a         1\n"
            "longer  100\n"
            "short\n");
}

TEST(TableTest, SanitizesControlCharacters) {
  Table table({"JOB"});
  table.AddRow({"evil\n\x1b[31mjob"});
  EXPECT_EQ(table.Render(), "JOB\nevil??[31mjob\n");
}

TEST(FormatStatusTest, ShowsSummarySessionsAndJobs) {
  std::string text = FormatStatus(SampleStatus());
  EXPECT_THAT(text, HasSubstr("ciuicd 0.1.0 on node gpu-01\n"));
  EXPECT_THAT(text, HasSubstr("  uptime          3h 05m\n"));
  EXPECT_THAT(text, HasSubstr("  socket          /run/ciuic/ciuicd.sock\n"));
  EXPECT_THAT(text, HasSubstr("  worker threads  8\n"));
  EXPECT_THAT(text, HasSubstr("  operations      1234 completed, 2 failed\n"));
  EXPECT_THAT(text, HasSubstr("  bytes reduced   3.0 GiB\n"));
  EXPECT_THAT(text,
              HasSubstr("  peer service    10.0.0.1:7361 (ordering streams on port 40123)\n"));
  EXPECT_THAT(text, HasSubstr("  reduce kernels  avx512\n"));
  EXPECT_THAT(text, HasSubstr("  metrics         http://10.0.0.1:9464/metrics\n"));
  EXPECT_THAT(text, HasSubstr("  cuda            built with CUDA\n"));
  EXPECT_THAT(text, HasSubstr("  gpus            0: NVIDIA H200 (140.0 GiB, sm_90)\n"
                              "                  1: NVIDIA H200 (140.0 GiB, sm_90)\n"));
  EXPECT_THAT(text, HasSubstr("  ucx cuda memory no (this UCX build has no CUDA support)\n"));
  EXPECT_THAT(text, HasSubstr("  gpu memory      12 trainer allocations mapped (6.0 GiB), 64.0 MiB "
                              "pinned host memory\n"));
  EXPECT_THAT(text, HasSubstr("SESSIONS (2)\n"
                              "ID   UID   PID  JOB     RANK     ARENA\n"
                              "17  1000  4242  resnet     3   2.0 GiB\n"
                              "18  1001    99  -          -  64.0 MiB\n"));
  EXPECT_THAT(text, HasSubstr("JOBS (1)\n"
                              "JOB      UID  WORLD  LOCAL RANKS  STATE    PENDING\n"
                              "resnet  1000     16  0-3          running        1\n"));
}

TEST(FormatStatusTest, EmptyDaemon) {
  proto::StatusReply status;
  status.set_version("0.1.0");
  status.set_node_name("n");
  std::string text = FormatStatus(status);
  EXPECT_THAT(text, HasSubstr("SESSIONS (0)\n  (none)\n"));
  EXPECT_THAT(text, HasSubstr("JOBS (0)\n  (none)\n"));
  EXPECT_THAT(text, HasSubstr("bytes reduced   0 B"));
  EXPECT_THAT(text, HasSubstr("  cuda            built without CUDA\n"));
  EXPECT_THAT(text, HasSubstr("  gpus            none: -\n"));
  EXPECT_THAT(text, Not(HasSubstr("gpu memory")));  // no device buffers without CUDA
  EXPECT_THAT(text, HasSubstr("  peer service    -\n"));
  EXPECT_THAT(text, HasSubstr("  metrics         off (metrics_listen)\n"));
  EXPECT_THAT(text, HasSubstr("  reduce kernels  -\n"));
  status.set_gpus_unavailable("ciuicd was built without CUDA");
  EXPECT_THAT(FormatStatus(status), HasSubstr("  gpus            none: ciuicd was built without CUDA\n"));
}

TEST(FormatJobsTest, ShowsJobsAndPendingOperations) {
  std::string text = FormatJobs(SampleStatus());
  EXPECT_THAT(text, HasSubstr("JOB      UID  WORLD  LOCAL RANKS      STATE    COMPLETED  "
                              "FAILED    BYTES\n"
                              "resnet  1000     16  0-3 (4 on node)  running       1200       "
                              "1  1.5 GiB\n"));
  EXPECT_THAT(text, HasSubstr("PENDING OPERATIONS\n"
                              "JOB     OPERATION    COLLECTIVE    BYTES   AGE  SUBMITTED  "
                              "WAITING FOR\n"
                              "resnet  grad.layer4  allreduce   4.0 MiB  2.2s  0-2        3\n"));
}

TEST(FormatStatusTest, CompressionAndFusionCountersOfMultiNodeJobs) {
  proto::StatusReply status = SampleStatus();
  EXPECT_THAT(FormatStatus(status), Not(HasSubstr("fusion:")));
  EXPECT_THAT(FormatStatus(status), Not(HasSubstr("compression:")));
  EXPECT_THAT(FormatStatus(status), Not(HasSubstr("gpu: job")));
  EXPECT_THAT(FormatStatus(status), Not(HasSubstr("error feedback:")));
  proto::JobInfo* job = status.mutable_jobs(0);
  job->set_ops_compressed(10);
  job->set_bytes_before_compression(64 << 20);
  job->set_bytes_after_compression(16 << 20);
  job->set_ops_fused(96);
  job->set_fused_runs(7);
  job->set_ops_staged(12);
  job->set_bytes_staged(48 << 20);
  job->set_feedback_residuals(3);
  job->set_feedback_host_bytes(12 << 20);
  job->set_feedback_device_bytes(4 << 20);
  job->set_feedback_evictions(2);
  job->set_feedback_resets(1);
  job->set_feedback_too_large(5);
  job->set_ops_direct(40);
  for (const std::string& text : {FormatStatus(status), FormatJobs(status)}) {
    EXPECT_THAT(text, HasSubstr("compression: job resnet: 10 operations, 64.0 MiB -> 16.0 MiB on "
                                "the wire\n"));
    EXPECT_THAT(text, HasSubstr("fusion: job resnet: 96 operations fused into 7 allreduces\n"));
    EXPECT_THAT(text, HasSubstr("direct: job resnet: 40 operations ran between the nodes without "
                                "the coordinator\n"));
    EXPECT_THAT(text, HasSubstr("gpu: job resnet: 12 operations on GPU buffers, 48.0 MiB copied "
                                "between the GPU and host memory\n"));
    EXPECT_THAT(text, HasSubstr("error feedback: job resnet: 3 residuals, 12.0 MiB in host "
                                "memory, 4.0 MiB on GPUs; dropped: 2 evicted, 1 reset (size "
                                "changed); 5 operations too large for it\n"));
  }
  // Only dropped ones (every residual gone): still shown.
  job->set_feedback_residuals(0);
  job->set_feedback_host_bytes(0);
  job->set_feedback_device_bytes(0);
  EXPECT_THAT(FormatStatus(status), HasSubstr("error feedback: job resnet: 0 residuals"));
}

TEST(FormatJobsTest, NoJobsOrNothingPending) {
  EXPECT_EQ(FormatJobs(proto::StatusReply()), "no jobs\n");
  proto::StatusReply status = SampleStatus();
  status.mutable_jobs(0)->clear_pending();
  EXPECT_THAT(FormatJobs(status), HasSubstr("PENDING OPERATIONS\n  (none)\n"));
}

TEST(FormatTuneTest, EntriesAndSet) {
  proto::TuneGetReply reply;
  proto::TuneEntry* entry = reply.add_entries();
  entry->set_key("chunk_bytes");
  entry->set_value("4M");
  entry->set_description("Unit of work");
  entry = reply.add_entries();
  entry->set_key("channels");
  entry->set_value("2");
  entry->set_description("UCX workers");
  EXPECT_EQ(FormatTuneEntries(reply),
            "KEY          VALUE  DESCRIPTION\n"
            "chunk_bytes  4M     Unit of work\n"
            "channels     2      UCX workers\n");
  EXPECT_EQ(FormatTuneEntry(reply.entries(0)), "chunk_bytes = 4M\n");
}

TEST(ToJsonTest, OneObjectWithEveryField) {
  proto::StatusReply status;
  status.set_node_name("n1");
  absl::StatusOr<std::string> json = ToJson(status);
  ASSERT_TRUE(json.ok());
  EXPECT_EQ(json->front(), '{');
  EXPECT_EQ(json->back(), '\n');
  EXPECT_THAT(*json, HasSubstr("\"nodeName\":\"n1\""));
  EXPECT_THAT(*json, HasSubstr("\"opsFailed\":\"0\""));  // printed although default
  EXPECT_THAT(*json, HasSubstr("\"workerThreads\":0"));
  EXPECT_THAT(json->substr(0, json->size() - 1), Not(HasSubstr("\n")));
}

TEST(FormatTest, HumanMicros) {
  EXPECT_EQ(HumanMicros(0), "0us");
  EXPECT_EQ(HumanMicros(999), "999us");
  EXPECT_EQ(HumanMicros(1250), "1.25ms");
  EXPECT_EQ(HumanMicros(3400000), "3.40s");
}

// Three operations of a 2-node job seen from node0: rank 1 late twice,
// node "b" last every time; the third failed before it ran.
proto::TraceReply SampleTrace() {
  proto::TraceReply reply;
  reply.set_capacity(4096);
  reply.set_recorded(10);
  for (int i = 0; i < 3; ++i) {
    proto::OpTrace* op = reply.add_ops();
    op->set_job_id("job-a");
    op->set_name(i == 2 ? "grad\x01.bad" : "grad." + std::to_string(i));
    op->set_collective("allreduce");
    op->set_dtype("float32");
    op->set_bytes(uint64_t{4} << 20);
    op->set_submitted_us(1000000 + 10000 * i);
    proto::RankArrival* a = op->add_arrivals();
    a->set_rank(0);
    a->set_after_us(i == 1 ? 30 : 0);
    a = op->add_arrivals();
    a->set_rank(1);
    a->set_after_us(i == 1 ? 0 : 1500 + 500 * i);
    op->set_launched_us(1500 + 500 * i);
    op->set_ready_us(1510 + 500 * i);
    op->set_last_node("b");
    op->set_ready_spread_us(4000 + i);
    if (i < 2) {
      op->set_announced_us(6000);
      op->set_run_start_us(6100);
      op->set_run_end_us(8100);
      op->set_queued_us(7);
      op->set_run_seq(i);
      op->set_fused_ops(i == 1 ? 3 : 1);
      op->set_codec(i == 1 ? "int8" : "");
      op->set_direct(i == 0);
    } else {
      op->set_code(4);
      op->set_error("operation 'grad.bad' timed out waiting for node b");
    }
    op->set_done_us(i < 2 ? 8200 : 60000);
  }
  return reply;
}

TEST(FormatTest, TraceRowsMediansAndWhoCameLast) {
  const std::string out = FormatTrace(SampleTrace());
  EXPECT_THAT(out, HasSubstr("3 operation(s) shown; the daemon keeps its last 4096 (trace_ops), "
                             "10 recorded since it started\n"));
  EXPECT_THAT(out, HasSubstr("RANKS IN  LAST RANK  NODES IN  LAST NODE"));
  EXPECT_THAT(out, HasSubstr("grad.0"));
  EXPECT_THAT(out, HasSubstr("grad?.bad"));  // sanitized
  EXPECT_THAT(out, HasSubstr("allreduce fused x3 int8"));
  EXPECT_THAT(out, HasSubstr("allreduce direct"));
  EXPECT_THAT(out, HasSubstr("4.0 MiB"));
  EXPECT_THAT(out, HasSubstr("2.00ms"));  // the run
  EXPECT_THAT(out, HasSubstr("code 4: operation 'grad.bad' timed out waiting for node b"));
  // Medians: ranks in {1500, 2000, 2500}, announcement {4500, 4000}, run
  // {2000, 2000}, total {8200, 8200, 60000}.
  EXPECT_THAT(out, HasSubstr("medians: ranks in 2.00ms, then the coordinator's announcement "
                             "4.00ms, run 2.00ms, total 8.20ms\n"));
  EXPECT_THAT(out, HasSubstr("  rank 1 last in 2 of 3 (median +1.50ms)\n"));
  EXPECT_THAT(out, HasSubstr("  rank 0 last in 1 of 3 (median +30us)\n"));
  EXPECT_THAT(out, HasSubstr("  node b last in 3 of 3 (median +4.00ms)\n"));
}

TEST(FormatTest, TraceOfNothing) {
  proto::TraceReply reply;
  reply.set_capacity(0);
  EXPECT_EQ(FormatTrace(reply),
            "0 operation(s) shown; the daemon keeps its last 0 (trace_ops), 0 recorded since it "
            "started\n");
}

TEST(FormatTest, ChromeTraceHasARowPerNameAndASlicePerPhase) {
  const std::string out = ChromeTrace(SampleTrace());
  EXPECT_THAT(out, HasSubstr("\"traceEvents\":["));
  EXPECT_THAT(out, HasSubstr("{\"ph\":\"M\",\"name\":\"thread_name\",\"pid\":1,\"tid\":1,"
                             "\"args\":{\"name\":\"job-a/grad.0\"}}"));
  // The control character is escaped, not passed through.
  EXPECT_THAT(out, HasSubstr("job-a/grad\\u0001.bad"));
  // grad.0: ranks 0..1500, coordinator 1500..6000, lane queue, run 6100..8100.
  EXPECT_THAT(out, HasSubstr("\"name\":\"ranks submit\",\"ts\":1000000,\"dur\":1500"));
  EXPECT_THAT(out, HasSubstr("\"name\":\"coordinator\",\"ts\":1001500,\"dur\":4500"));
  EXPECT_THAT(out, HasSubstr("\"name\":\"lane queue\",\"ts\":1006000,\"dur\":100"));
  EXPECT_THAT(out, HasSubstr("\"name\":\"run\",\"ts\":1006100,\"dur\":2000"));
  EXPECT_THAT(out, HasSubstr("\"name\":\"run (fused)\",\"ts\":1016100,\"dur\":2000"));
  EXPECT_THAT(out, HasSubstr("\"name\":\"complete\",\"ts\":1008100,\"dur\":100"));
  // The failed one: submitted, then waited for the coordinator until it failed.
  EXPECT_THAT(out, HasSubstr("\"tid\":3,\"name\":\"ranks submit\",\"ts\":1020000,\"dur\":2500"));
  EXPECT_THAT(out, HasSubstr("\"tid\":3,\"name\":\"coordinator\",\"ts\":1022500,\"dur\":57500"));
  EXPECT_THAT(out, Not(HasSubstr("\"name\":\"local\"")));
  EXPECT_THAT(out, HasSubstr("\"status\":\"code 4: operation 'grad.bad' timed out"));
  // Braces balance (the operability test has Python parse a real one).
  EXPECT_EQ(std::count(out.begin(), out.end(), '{'), std::count(out.begin(), out.end(), '}'));
}

}  // namespace
}  // namespace ciuic::ctl
