// What an operator sees and does: ciuicctl against a real daemon (status,
// jobs with pending operations, live tuning), config errors at start, and
// an idle daemon and idle trainer that use no CPU.
#include <gtest/gtest.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstring>
#include <fstream>
#include <iterator>

#include <signal.h>

#include <chrono>
#include <thread>
#include <vector>

#include "ciuic/control.pb.h"
#include "common.h"
#include "harness.h"

namespace ciuic::testing {
namespace {

using Clock = std::chrono::steady_clock;

std::string Ctl(const DaemonProcess& d, const std::string& args, int* code) {
  std::string out;
  *code = RunCommand(std::string(CIUICCTL_PATH) + " --socket " + d.socket() + " " + args, &out);
  return out;
}

TEST(OperabilityTest, StatusJobsAndPendingOperations) {
  auto daemon = DaemonProcess::Start();
  ASSERT_NE(daemon, nullptr);
  const std::string job = UniqueJobId("ctl");
  int ready[2], release[2];
  ASSERT_EQ(pipe(ready), 0);
  ASSERT_EQ(pipe(release), 0);
  std::vector<pid_t> pids = SpawnRanks(2, [&](int rank) {
    auto comm = JoinJob(daemon->socket(), job, rank, 2);
    CHILD_CHECK(comm != nullptr, "join");
    std::vector<float> v(1024, 1.0f);
    OpOptions o;
    o.name = "warmup";
    Status s = comm->Allreduce(v.data(), v.data(), v.size(), DataType::kFloat32, ReduceOp::kSum, o).Wait();
    CHILD_CHECK(s.ok(), "%s", s.ToString().c_str());
    o.name = "stuck.grad";
    Handle h;
    if (rank == 0) h = comm->Allreduce(v.data(), v.data(), v.size(), DataType::kFloat32, ReduceOp::kSum, o);
    CHILD_CHECK(write(ready[1], "r", 1) == 1, "pipe");
    char c;
    CHILD_CHECK(read(release[0], &c, 1) == 1, "pipe");
    if (rank == 1) h = comm->Allreduce(v.data(), v.data(), v.size(), DataType::kFloat32, ReduceOp::kSum, o);
    s = h.Wait();
    CHILD_CHECK(s.ok() && v[0] == 4.0f, "%s", s.ToString().c_str());
    return 0;
  });
  char c;
  for (int i = 0; i < 2; ++i) ASSERT_EQ(read(ready[0], &c, 1), 1);
  std::this_thread::sleep_for(std::chrono::milliseconds(100));

  int code = 0;
  std::string out = Ctl(*daemon, "status", &code);
  EXPECT_EQ(code, 0) << out;
  EXPECT_TRUE(Contains(out, "testnode")) << out;
  EXPECT_TRUE(Contains(out, job)) << out;

  out = Ctl(*daemon, "jobs", &code);
  EXPECT_EQ(code, 0) << out;
  EXPECT_TRUE(Contains(out, "stuck.grad")) << out;

  out = Ctl(*daemon, "--json jobs", &code);
  EXPECT_EQ(code, 0) << out;
  // rank 0 submitted, rank 1 is awaited; one op completed so far.
  EXPECT_TRUE(Contains(out, "\"name\":\"stuck.grad\"")) << out;
  EXPECT_TRUE(Contains(out, "\"submittedRanks\":[0]")) << out;
  EXPECT_TRUE(Contains(out, "\"waitingForRanks\":[1]")) << out;
  EXPECT_TRUE(Contains(out, "\"opsCompleted\":\"1\"")) << out;

  ASSERT_EQ(write(release[1], "gg", 2), 2);
  EXPECT_EQ(WaitChild(pids[0], std::chrono::seconds(30)), 0);
  EXPECT_EQ(WaitChild(pids[1], std::chrono::seconds(30)), 0);
  for (int fd : {ready[0], ready[1], release[0], release[1]}) close(fd);

  out = Ctl(*daemon, "--json status", &code);
  EXPECT_EQ(code, 0);
  EXPECT_TRUE(Contains(out, "\"opsCompleted\":\"2\"")) << out;
  EXPECT_EQ(daemon->Stop(), 0);
}

// `ciuicctl trace`: each rank's arrival, the phases, failures; at most
// trace_ops operations kept, none with trace_ops=0.
TEST(OperabilityTest, TraceShowsTheLateRankFailuresAndKeepsTraceOps) {
  auto daemon = DaemonProcess::Start("tuning:\n  trace_ops: 4\n  fast_path_bytes: 0\n");
  ASSERT_NE(daemon, nullptr);
  const std::string job = UniqueJobId("trace");
  constexpr int kOps = 6;
  constexpr auto kLate = std::chrono::milliseconds(50);
  std::vector<int> codes = RunRanks(2, [&](int rank) {
    auto comm = JoinJob(daemon->socket(), job, rank, 2);
    CHILD_CHECK(comm != nullptr, "join");
    std::vector<float> v(1024, 1.0f);
    OpOptions o;
    for (int i = 0; i < kOps; ++i) {
      if (rank == 1) std::this_thread::sleep_for(kLate);
      o.name = "g" + std::to_string(i);
      Status s = comm->Allreduce(v.data(), v.data(), v.size(), DataType::kFloat32, ReduceOp::kSum, o).Wait();
      CHILD_CHECK(s.ok(), "%s", s.ToString().c_str());
    }
    o.name = "bad";  // rank 1 submits half the count
    Status s = comm->Allreduce(v.data(), v.data(), rank == 0 ? v.size() : v.size() / 2,
                               DataType::kFloat32, ReduceOp::kSum, o).Wait();
    CHILD_CHECK(s.code() == StatusCode::kInvalidArgument, "%s", s.ToString().c_str());
    return 0;
  });
  EXPECT_EQ(codes, std::vector<int>({0, 0}));

  proto::TraceReply trace;
  ASSERT_EQ(ReadTrace(daemon->socket(), job, &trace), "");
  EXPECT_EQ(trace.capacity(), 4u);
  EXPECT_GE(trace.recorded(), uint64_t{kOps + 1});
  ASSERT_EQ(trace.ops_size(), 4) << trace.DebugString();
  for (int i = 0; i < 3; ++i) {
    const proto::OpTrace& op = trace.ops(i);
    EXPECT_EQ(op.name(), "g" + std::to_string(kOps - 3 + i));
    EXPECT_EQ(op.job_id(), job);
    EXPECT_EQ(op.collective(), "allreduce");
    EXPECT_EQ(op.dtype(), "float32");
    EXPECT_EQ(op.bytes(), 4096u);
    EXPECT_EQ(op.code(), 0);
    ASSERT_EQ(op.arrivals_size(), 2);
    EXPECT_EQ(op.arrivals(0).rank(), 0);
    EXPECT_EQ(op.arrivals(1).rank(), 1);
    // Rank 1 slept before submitting: the operation waited for it.
    EXPECT_GE(op.arrivals(1).after_us(), 20000u) << op.DebugString();
    ASSERT_TRUE(op.has_launched_us());
    EXPECT_GE(op.launched_us(), op.arrivals(1).after_us());
    EXPECT_GE(op.done_us(), op.launched_us());
    EXPECT_FALSE(op.has_ready_us());  // one node: no coordinator
    EXPECT_FALSE(op.has_run_start_us());
    if (i > 0) {
      EXPECT_GT(op.submitted_us(), trace.ops(i - 1).submitted_us());
    }
  }
  const proto::OpTrace& bad = trace.ops(3);
  EXPECT_EQ(bad.name(), "bad");
  EXPECT_EQ(bad.code(), static_cast<int>(StatusCode::kInvalidArgument));
  EXPECT_TRUE(Contains(bad.error(), "mismatched")) << bad.error();
  EXPECT_FALSE(bad.has_launched_us());

  int code = 0;
  std::string out = Ctl(*daemon, "trace --job " + job, &code);
  EXPECT_EQ(code, 0) << out;
  EXPECT_TRUE(Contains(out, "rank 1 last in 3 of 3")) << out;
  EXPECT_TRUE(Contains(out, "mismatched")) << out;
  const std::string chrome = daemon->dir() + "/trace.json";
  out = Ctl(*daemon, "trace --last 2 --chrome " + chrome, &code);
  EXPECT_EQ(code, 0) << out;
  EXPECT_TRUE(Contains(out, "wrote 2 operation(s)")) << out;
  std::ifstream file(chrome);
  std::string text((std::istreambuf_iterator<char>(file)), std::istreambuf_iterator<char>());
  EXPECT_TRUE(Contains(text, "\"traceEvents\"")) << text;
  EXPECT_TRUE(Contains(text, "\"name\":\"ranks submit\"")) << text;
  std::string parsed;
  EXPECT_EQ(RunCommand("/usr/bin/python3 -c 'import json, sys; "
                       "print(len(json.load(open(sys.argv[1]))[\"traceEvents\"]))' " + chrome,
                       &parsed), 0) << parsed << text;
  out = Ctl(*daemon, "trace --last x", &code);
  EXPECT_EQ(code, 64) << out;
  out = Ctl(*daemon, "status --job " + job, &code);
  EXPECT_EQ(code, 64) << out;

  out = Ctl(*daemon, "tune set trace_ops=0", &code);
  ASSERT_EQ(code, 0) << out;
  codes = RunRanks(2, [&](int rank) {
    auto comm = JoinJob(daemon->socket(), job + "b", rank, 2);
    CHILD_CHECK(comm != nullptr, "join");
    std::vector<float> v(16, 1.0f);
    Status s = comm->Allreduce(v.data(), v.data(), v.size(), DataType::kFloat32, ReduceOp::kSum).Wait();
    CHILD_CHECK(s.ok(), "%s", s.ToString().c_str());
    return 0;
  });
  EXPECT_EQ(codes, std::vector<int>({0, 0}));
  ASSERT_EQ(ReadTrace(daemon->socket(), job + "b", &trace), "");
  EXPECT_EQ(trace.capacity(), 0u);
  EXPECT_EQ(trace.ops_size(), 0);
  EXPECT_EQ(daemon->Stop(), 0);
}

// `ciuicctl trace --flight-recorder DIR`: torch flight-recorder dumps, one
// per rank, read back with Python's pickle and checked the way torch's
// fr_trace analyzer matches them: every rank lists the same collectives in
// the same order with the same sizes and dtypes (each collective's sizes
// against a reference worked out here), and an operation one rank has not
// submitted shows as "scheduled" on the others only.
TEST(OperabilityTest, FlightRecorderDumpsMatchAcrossRanksAndShowTheMissingRank) {
  auto daemon = DaemonProcess::Start("tuning:\n  fast_path_bytes: 0\n");
  ASSERT_NE(daemon, nullptr);
  const std::string job = UniqueJobId("fr");
  const std::string dir = daemon->dir() + "/fr";
  constexpr int kRanks = 3;
  std::vector<int> codes = RunRanks(kRanks, [&](int rank) {
    auto comm = JoinJob(daemon->socket(), job, rank, kRanks);
    CHILD_CHECK(comm != nullptr, "join");
    std::vector<uint8_t> a(4096), b(4096);
    Status s = comm->Allreduce(a.data(), b.data(), 7, DataType::kFloat32, ReduceOp::kSum).Wait();
    CHILD_CHECK(s.ok(), "allreduce %s", s.ToString().c_str());
    s = comm->Broadcast(a.data(), b.data(), 5, DataType::kInt64, 0).Wait();
    CHILD_CHECK(s.ok(), "broadcast %s", s.ToString().c_str());
    s = comm->Allgather(a.data(), b.data(), 4, DataType::kFloat16).Wait();
    CHILD_CHECK(s.ok(), "allgather %s", s.ToString().c_str());
    s = comm->ReduceScatter(a.data(), b.data(), 2, DataType::kBFloat16, ReduceOp::kSum).Wait();
    CHILD_CHECK(s.ok(), "reduce_scatter %s", s.ToString().c_str());
    s = comm->Alltoall(a.data(), b.data(), 3, DataType::kInt32).Wait();
    CHILD_CHECK(s.ok(), "alltoall %s", s.ToString().c_str());
    s = comm->Barrier().Wait();
    CHILD_CHECK(s.ok(), "barrier %s", s.ToString().c_str());
    if (rank == kRanks - 1) {
      // The others are stuck in the next allreduce, waiting for this rank:
      // dump (retried until both show it), then join them.
      bool seen = false;
      for (int attempt = 0; attempt < 100 && !seen; ++attempt) {
        int code = 0;
        std::string out = Ctl(*daemon, "trace --job " + job + " --flight-recorder " + dir, &code);
        CHILD_CHECK(code == 0, "ciuicctl: %s", out.c_str());
        seen = true;
        for (int r = 0; r < kRanks - 1; ++r) {
          std::ifstream f(dir + "/rank_" + std::to_string(r), std::ios::binary);
          std::string bytes((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
          // The pickled state value "scheduled" (BINUNICODE, 4-byte length 9).
          seen = seen && bytes.find(std::string("X\x09\0\0\0scheduled", 14)) != std::string::npos;
        }
        if (!seen) std::this_thread::sleep_for(std::chrono::milliseconds(100));
      }
      CHILD_CHECK(seen, "the stuck allreduce never showed as scheduled");
    }
    s = comm->Allreduce(a.data(), b.data(), 16, DataType::kFloat32, ReduceOp::kSum).Wait();
    CHILD_CHECK(s.ok(), "last allreduce %s", s.ToString().c_str());
    return 0;
  });
  ASSERT_EQ(codes, std::vector<int>({0, 0, 0}));

  const std::string script = daemon->dir() + "/check_fr.py";
  std::ofstream(script) << R"PY(
import os, pickle, sys
d = sys.argv[1]
files = sorted(os.listdir(d))
assert files == ["rank_0", "rank_1", "rank_2"], files
W = 3
# (profiling name, dtype, input numel, output numel), by the collectives'
# definitions: allgather's output is W inputs, reduce_scatter's input W outputs.
expected = [("nccl:all_reduce", "Float", 7, 7), ("nccl:broadcast", "Long", 5, 5),
            ("nccl:all_gather", "Half", 4, 4 * W), ("nccl:_reduce_scatter_base", "BFloat16", 2 * W, 2),
            ("nccl:all_to_all", "Int", 3 * W, 3 * W), ("nccl:all_reduce", "Float", 0, 0)]
dumps = {}
for f in files:
    with open(os.path.join(d, f), "rb") as fh:
        dumps[int(f[len("rank_"):])] = pickle.load(fh)
for rank, dump in dumps.items():
    assert dump["version"] == "2.4", dump["version"]
    (pg, cfg), = dump["pg_config"].items()
    assert cfg["name"] == pg and eval(cfg["ranks"]) == [0, 1, 2], cfg
    entries = dump["entries"]
    want = len(expected) + (1 if rank < W - 1 else 0)
    assert len(entries) == want, (rank, len(entries), entries)
    for i, e in enumerate(entries):
        for key in ("record_id", "pg_id", "process_group", "collective_seq_id", "p2p_seq_id",
                    "op_id", "profiling_name", "time_created_ns", "duration_ms", "input_sizes",
                    "input_dtypes", "output_sizes", "output_dtypes", "state",
                    "time_discovered_started_ns", "time_discovered_completed_ns", "retired",
                    "timeout_ms", "is_p2p", "frames"):
            assert key in e, (rank, i, key)
        assert e["record_id"] == i and e["collective_seq_id"] == i, (rank, i, e)
        assert e["process_group"] == (pg, "ciuic job"), e["process_group"]
        assert e["is_p2p"] is False and e["frames"] == [], e
        assert e["timeout_ms"] > 0, e
        if i < len(expected):
            name, dtype, n_in, n_out = expected[i]
            assert e["profiling_name"] == name, (rank, i, e["profiling_name"], name)
            assert e["input_dtypes"] == [dtype] and e["output_dtypes"] == [dtype], (rank, i, e)
            assert e["input_sizes"] == [[n_in]] and e["output_sizes"] == [[n_out]], (rank, i, e)
            assert e["state"] == "completed" and e["retired"] is True, (rank, i, e)
            assert e["duration_ms"] >= 0, e
            assert e["time_discovered_completed_ns"] >= e["time_discovered_started_ns"] >= 0, e
            if i > 0:
                assert e["time_created_ns"] >= entries[i - 1]["time_created_ns"], (rank, i)
        else:
            assert e["state"] == "scheduled" and e["retired"] is False, (rank, e)
            assert e["duration_ms"] is None and e["time_discovered_completed_ns"] is None, e
            assert e["profiling_name"] == "nccl:all_reduce" and e["input_sizes"] == [[16]], e
# What fr_trace matches across ranks: alike on every rank for every completed collective.
keys = ("collective_seq_id", "profiling_name", "input_sizes", "output_sizes", "input_dtypes", "state")
for i in range(len(expected)):
    seen = {tuple(str(dumps[r]["entries"][i][k]) for k in keys) for r in dumps}
    assert len(seen) == 1, (i, seen)
status = dumps[0]["pg_status"][pg]
assert status["last_enqueued_collective"] == len(expected), status
assert status["last_completed_collective"] == len(expected) - 1, status
print("ok")
)PY";
  std::string out;
  EXPECT_EQ(RunCommand("/usr/bin/python3 " + script + " " + dir + " 2>&1", &out), 0) << out;
  EXPECT_TRUE(Contains(out, "ok")) << out;

  int code = 0;
  out = Ctl(*daemon, "trace --flight-recorder " + dir + " --chrome x", &code);
  EXPECT_EQ(code, 64) << out;
  out = Ctl(*daemon, "trace --job nosuchjob --flight-recorder " + dir, &code);
  EXPECT_EQ(code, 1) << out;
  EXPECT_TRUE(Contains(out, "no operation of job 'nosuchjob'")) << out;
  EXPECT_EQ(daemon->Stop(), 0);
}

// A rank that always submits late: its moving skew (seconds after the
// node's first rank) in /metrics and status, `ciuicctl jobs` names it.
TEST(OperabilityTest, RankSkewNamesTheRankThatSubmitsLate) {
  auto daemon = DaemonProcess::Start("metrics_listen: \"127.0.0.1:0\"\n"
                                     "tuning:\n  fast_path_bytes: 0\n");
  ASSERT_NE(daemon, nullptr);
  const std::string job = UniqueJobId("skew");
  HeldRanks ranks(2, [&](int rank, const std::function<void()>& hold) {
    auto comm = JoinJob(daemon->socket(), job, rank, 2);
    CHILD_CHECK(comm != nullptr, "join");
    std::vector<float> v(256, 1.0f);
    for (int i = 0; i < 8; ++i) {
      if (rank == 1) std::this_thread::sleep_for(std::chrono::milliseconds(40));
      Status s = comm->Allreduce(v.data(), v.data(), v.size(), DataType::kFloat32, ReduceOp::kSum).Wait();
      CHILD_CHECK(s.ok(), "%s", s.ToString().c_str());
    }
    hold();
    return 0;
  });
  ASSERT_TRUE(ranks.Held());
  std::string metrics, address;
  ASSERT_EQ(ReadMetrics(daemon->socket(), &metrics, &address), "");
  const auto skew_of = [&](int rank) {
    const std::string key = "ciuic_rank_skew_seconds{job=\"" + job + "\",uid=\"" +
                            std::to_string(getuid()) + "\",rank=\"" + std::to_string(rank) + "\"} ";
    const size_t at = metrics.find(key);
    return at == std::string::npos ? -1.0 : std::stod(metrics.substr(at + key.size()));
  };
  // Rank 1 came about 40 ms after rank 0 every time; rank 0 came first.
  EXPECT_GE(skew_of(1), 0.02) << metrics;
  EXPECT_LT(skew_of(1), 5.0) << metrics;
  EXPECT_GE(skew_of(0), 0.0) << metrics;
  EXPECT_LT(skew_of(0), skew_of(1) / 4) << metrics;
  int code = 0;
  std::string out = Ctl(*daemon, "jobs", &code);
  EXPECT_EQ(code, 0) << out;
  EXPECT_TRUE(Contains(out, "skew: job " + job + ": rank 1 submits latest")) << out;
  out = Ctl(*daemon, "--json jobs", &code);
  EXPECT_TRUE(Contains(out, "\"rankSkew\"")) << out;
  EXPECT_EQ(ranks.Release(), std::vector<int>({0, 0}));
  EXPECT_EQ(daemon->Stop(), 0);
}

// Prometheus /metrics (metrics_listen, port 0: status names the port): the
// daemon's and the job's counters, the duration histogram, while the job
// runs; a bad address stops the daemon at start, naming the key.
TEST(OperabilityTest, PrometheusMetricsWhileAJobRuns) {
  auto daemon = DaemonProcess::Start("metrics_listen: \"127.0.0.1:0\"\n"
                                     "tuning:\n  fast_path_bytes: 0\n");
  ASSERT_NE(daemon, nullptr);
  std::string metrics, address;
  ASSERT_EQ(ReadMetrics(daemon->socket(), &metrics, &address), "");
  ASSERT_TRUE(address.rfind("127.0.0.1:", 0) == 0 && address != "127.0.0.1:0") << address;
  int code = 0;
  EXPECT_TRUE(Contains(Ctl(*daemon, "status", &code), "http://" + address + "/metrics"));
  const std::string job = UniqueJobId("metrics");
  int ready[2], release[2];
  ASSERT_EQ(pipe(ready), 0);
  ASSERT_EQ(pipe(release), 0);
  std::vector<pid_t> pids = SpawnRanks(2, [&](int rank) {
    auto comm = JoinJob(daemon->socket(), job, rank, 2);
    CHILD_CHECK(comm != nullptr, "join");
    std::vector<float> v(16 << 10, 1.0f);
    for (int i = 0; i < 3; ++i) {
      Status s = comm->Allreduce(v.data(), v.data(), v.size(), DataType::kFloat32, ReduceOp::kSum).Wait();
      CHILD_CHECK(s.ok(), "%s", s.ToString().c_str());
    }
    CHILD_CHECK(write(ready[1], "r", 1) == 1, "pipe");
    char c;
    CHILD_CHECK(read(release[0], &c, 1) == 1, "pipe");
    return 0;
  });
  char c;
  for (int i = 0; i < 2; ++i) ASSERT_EQ(read(ready[0], &c, 1), 1);
  ASSERT_EQ(ReadMetrics(daemon->socket(), &metrics, &address), "");
  const std::string labels = "{job=\"" + job + "\",uid=\"" + std::to_string(getuid()) + "\"}";
  for (const std::string& line :
       {std::string("ciuic_ops_completed_total 3\n"), std::string("ciuic_ops_failed_total 0\n"),
        std::string("ciuic_sessions 2\n"), std::string("ciuic_bytes_reduced_total 196608\n"),
        std::string("ciuic_gpu_mapped_allocations 0\n"),
        std::string("ciuic_gpu_pinned_host_bytes 0\n"),
        "ciuic_job_ops_completed_total" + labels + " 3\n",
        "ciuic_job_bytes_reduced_total" + labels + " 196608\n",
        "ciuic_job_world_size" + labels + " 2\n", "ciuic_job_pending_ops" + labels + " 0\n",
        "ciuic_job_op_duration_seconds_count" + labels + " 3\n",
        std::string("# TYPE ciuic_job_op_duration_seconds histogram\n")}) {
    EXPECT_TRUE(Contains(metrics, line)) << line << " in:\n" << metrics;
  }
  // The +Inf bucket holds all three; the buckets are cumulative.
  EXPECT_TRUE(Contains(metrics, "ciuic_job_op_duration_seconds_bucket{job=\"" + job + "\",uid=\"" +
                                    std::to_string(getuid()) + "\",le=\"+Inf\"} 3\n"))
      << metrics;
  EXPECT_TRUE(Contains(metrics, "ciuic_build_info{version=")) << metrics;
  // A second daemon cannot have the same address: it says so and exits 1.
  const std::string config = daemon->dir() + "/second.yaml";
  FILE* f = fopen(config.c_str(), "w");
  ASSERT_NE(f, nullptr);
  fprintf(f, "metrics_listen: \"%s\"\nlisten: \"127.0.0.1:0\"\n", address.c_str());
  fclose(f);
  std::string second;
  EXPECT_EQ(RunCommand("timeout 20 " + std::string(CIUICD_PATH) + " --config " + config +
                           " --socket " + daemon->dir() + "/second.sock",
                       &second),
            1)
      << second;
  EXPECT_TRUE(Contains(second, "cannot serve /metrics on " + address)) << second;
  ASSERT_EQ(write(release[1], "gg", 2), 2);
  EXPECT_EQ(WaitChild(pids[0], std::chrono::seconds(30)), 0);
  EXPECT_EQ(WaitChild(pids[1], std::chrono::seconds(30)), 0);
  for (int fd : {ready[0], ready[1], release[0], release[1]}) close(fd);
  EXPECT_EQ(daemon->Stop(), 0);
}

// The reduction kernels' instruction set (CIUIC_REDUCE_ISA, else the widest
// this CPU runs) is what status reports.
TEST(OperabilityTest, StatusNamesTheReductionKernels) {
  auto daemon = DaemonProcess::StartWith("", {}, {}, {"CIUIC_REDUCE_ISA=baseline"});
  ASSERT_NE(daemon, nullptr);
  int code = 0;
  std::string out = Ctl(*daemon, "status", &code);
  EXPECT_EQ(code, 0) << out;
  EXPECT_TRUE(Contains(out, "  reduce kernels  baseline\n")) << out;
  out = Ctl(*daemon, "--json status", &code);
  EXPECT_EQ(code, 0) << out;
  EXPECT_TRUE(Contains(out, "\"reduceKernels\":\"baseline\"")) << out;
  EXPECT_EQ(daemon->Stop(), 0);
}

// A tuning change applies from the next operation: operations keep
// producing the right answer while chunk_bytes changes under them.
TEST(OperabilityTest, LiveTuningAppliesAndIsValidated) {
  auto daemon = DaemonProcess::Start();
  ASSERT_NE(daemon, nullptr);
  int code = 0;
  std::string out = Ctl(*daemon, "tune set chunk_bytes=64K small_op_bytes=0", &code);
  EXPECT_EQ(code, 0) << out;
  out = Ctl(*daemon, "tune get chunk_bytes", &code);
  EXPECT_EQ(code, 0);
  EXPECT_TRUE(Contains(out, "64K")) << out;

  out = Ctl(*daemon, "tune set chunk_byte=1M", &code);
  EXPECT_EQ(code, 1) << out;
  EXPECT_TRUE(Contains(out, "unknown tuning key 'chunk_byte'")) << out;
  EXPECT_TRUE(Contains(out, "chunk_bytes")) << out;
  out = Ctl(*daemon, "tune set chunk_bytes=banana", &code);
  EXPECT_EQ(code, 1) << out;
  EXPECT_TRUE(Contains(out, "chunk_bytes")) << out;

  const std::string job = UniqueJobId("tune");
  std::vector<pid_t> pids = SpawnRanks(2, [&](int rank) {
    auto comm = JoinJob(daemon->socket(), job, rank, 2, 64 << 20);
    CHILD_CHECK(comm != nullptr, "join");
    Buffer b;
    const size_t n = (4 << 20) + 3;
    CHILD_CHECK(comm->Allocate(n * 4, &b).ok(), "alloc");
    for (int step = 0; step < 40; ++step) {
      for (size_t i = 0; i < n; i += 4099) b.as<int32_t>()[i] = rank + step;
      Status s = comm->Allreduce(b.data(), b.data(), n, DataType::kInt32, ReduceOp::kSum).Wait();
      CHILD_CHECK(s.ok(), "%s", s.ToString().c_str());
      for (size_t i = 0; i < n; i += 4099) {
        CHILD_CHECK(b.as<int32_t>()[i] == 1 + 2 * step, "step %d element %zu", step, i);
      }
    }
    return 0;
  });
  for (const char* v : {"1M", "4K", "16M", "256K", "4M"}) {
    out = Ctl(*daemon, std::string("tune set chunk_bytes=") + v, &code);
    EXPECT_EQ(code, 0) << out;
    std::this_thread::sleep_for(std::chrono::milliseconds(30));
  }
  EXPECT_EQ(WaitChild(pids[0], std::chrono::seconds(120)), 0);
  EXPECT_EQ(WaitChild(pids[1], std::chrono::seconds(120)), 0);
  EXPECT_EQ(daemon->Stop(), 0);
}

// A second daemon on the same socket refuses to start and leaves the first
// one's sockets alone.
TEST(OperabilityTest, SecondDaemonOnTheSameSocketLeavesTheFirstAlone) {
  auto daemon = DaemonProcess::Start();
  ASSERT_NE(daemon, nullptr);
  std::string out;
  int code = RunCommand(std::string(CIUICD_PATH) + " --socket " + daemon->socket() +
                            " --listen 127.0.0.1:0",
                        &out);
  EXPECT_NE(code, 0) << out;
  EXPECT_TRUE(Contains(out, "already listening")) << out;
  struct stat st;
  EXPECT_EQ(stat((daemon->socket() + ".session").c_str(), &st), 0) << "session socket removed";
  EXPECT_EQ(stat(daemon->socket().c_str(), &st), 0) << "control socket removed";
  auto codes = RunRanks(1, [&](int) {
    auto comm = JoinJob(daemon->socket(), UniqueJobId("first-still-serves"), 0, 1);
    CHILD_CHECK(comm != nullptr, "join");
    return comm->Barrier().Wait().ok() ? 0 : 1;
  });
  EXPECT_EQ(codes[0], 0);
  EXPECT_EQ(daemon->Stop(), 0);
}

TEST(OperabilityTest, CiuicctlWithoutADaemonSaysSo) {
  std::string out;
  int code = RunCommand(std::string(CIUICCTL_PATH) + " --socket /tmp/ciuic-no-such-dir/x.sock status", &out);
  EXPECT_EQ(code, 2) << out;
  EXPECT_TRUE(Contains(out, "cannot reach ciuicd at /tmp/ciuic-no-such-dir/x.sock")) << out;
}

TEST(OperabilityTest, ConfigErrorsStopTheDaemonWithTheKeyNamed) {
  char tmpl[] = "/tmp/ciuic-config-XXXXXX";
  ASSERT_NE(mkdtemp(tmpl), nullptr);
  const std::string dir = tmpl;
  struct Case {
    const char* yaml;
    const char* words;
  } cases[] = {
      {"tuning:\n  chunk_byts: 4M\n", "chunk_byts"},
      {"tuning:\n  chunk_bytes: lots\n", "chunk_bytes"},
      {"worker_threads: -3\n", "worker_threads"},
      {"socket_path: /tmp/x\n", "socket_path"},
      {"log_level: loud\n", "log_level"},
      {"tuning: [1, 2\n", "ciuicd.yaml"},
      {"metrics_listen: \"9464\"\n", "metrics_listen"},
      {"rack: \"row 3\"\n", "'rack'"},
  };
  for (const Case& c : cases) {
    const std::string path = dir + "/ciuicd.yaml";
    FILE* f = fopen(path.c_str(), "w");
    ASSERT_NE(f, nullptr);
    fputs(c.yaml, f);
    fclose(f);
    std::string out;
    int code = RunCommand(std::string(CIUICD_PATH) + " --config " + path + " --socket " + dir +
                              "/d.sock",
                          &out);
    EXPECT_EQ(code, 78) << c.yaml << out;
    EXPECT_TRUE(Contains(out, c.words)) << c.yaml << " -> " << out;
  }
  std::string out;
  EXPECT_EQ(RunCommand(std::string(CIUICD_PATH) + " --log-level=shouty --socket " + dir + "/d.sock", &out), 64) << out;
  EXPECT_TRUE(Contains(out, "log_level")) << out;
  EXPECT_EQ(RunCommand(std::string(CIUICD_PATH) + " --frobnicate", &out), 64) << out;
  EXPECT_TRUE(Contains(out, "--frobnicate")) << out;
  // CIUIC_RACK overrides the file's rack by the same rule.
  EXPECT_EQ(RunCommand("CIUIC_RACK='row 3/b' " + std::string(CIUICD_PATH) + " --socket " + dir +
                           "/d.sock",
                       &out),
            78)
      << out;
  EXPECT_TRUE(Contains(out, "invalid CIUIC_RACK 'row 3/b'")) << out;
  (void)!system(("rm -rf " + dir).c_str());
}

// Nobody spins while nothing is pending: an idle daemon with an idle
// session, and a trainer blocked in Wait() on an operation its partner has
// not submitted, each use well under 5% of a core over a second.
TEST(OperabilityTest, IdleDaemonAndWaitingTrainerUseNoCpu) {
  auto daemon = DaemonProcess::Start();
  ASSERT_NE(daemon, nullptr);
  const std::string job = UniqueJobId("idle");
  int ready[2], release[2];
  ASSERT_EQ(pipe(ready), 0);
  ASSERT_EQ(pipe(release), 0);
  std::vector<pid_t> pids = SpawnRanks(2, [&](int rank) {
    auto comm = JoinJob(daemon->socket(), job, rank, 2);
    CHILD_CHECK(comm != nullptr, "join");
    std::vector<float> v(16, 1.0f);
    Status s = comm->Allreduce(v.data(), v.data(), v.size(), DataType::kFloat32, ReduceOp::kSum).Wait();
    CHILD_CHECK(s.ok(), "%s", s.ToString().c_str());
    Handle h;
    if (rank == 0) h = comm->Barrier();
    CHILD_CHECK(write(ready[1], "r", 1) == 1, "pipe");
    char c;
    if (rank == 1) {
      CHILD_CHECK(read(release[0], &c, 1) == 1, "pipe");
      h = comm->Barrier();
    }
    s = h.Wait();  // rank 0 waits here through the measurement
    CHILD_CHECK(s.ok(), "%s", s.ToString().c_str());
    return 0;
  });
  char c;
  for (int i = 0; i < 2; ++i) ASSERT_EQ(read(ready[0], &c, 1), 1);
  std::this_thread::sleep_for(std::chrono::milliseconds(300));  // past every spin window
  const double d0 = ProcessCpuSeconds(daemon->pid());
  const double t0 = ProcessCpuSeconds(pids[0]);
  std::this_thread::sleep_for(std::chrono::seconds(1));
  const double daemon_cpu = ProcessCpuSeconds(daemon->pid()) - d0;
  const double trainer_cpu = ProcessCpuSeconds(pids[0]) - t0;
  EXPECT_LT(daemon_cpu, 0.05) << "idle ciuicd burned CPU";
  EXPECT_LT(trainer_cpu, 0.05) << "a waiting trainer burned CPU";
  ASSERT_EQ(write(release[1], "g", 1), 1);
  EXPECT_EQ(WaitChild(pids[0], std::chrono::seconds(30)), 0);
  EXPECT_EQ(WaitChild(pids[1], std::chrono::seconds(30)), 0);
  for (int fd : {ready[0], ready[1], release[0], release[1]}) close(fd);
  EXPECT_EQ(daemon->Stop(), 0);
}

// Under systemd (Type=notify) the daemon says READY=1 once it serves, and
// STOPPING=1 when it drains.
TEST(OperabilityTest, SignalsReadinessToSystemd) {
  char tmpl[] = "/tmp/ciuic-notify-XXXXXX";
  ASSERT_NE(mkdtemp(tmpl), nullptr);
  const std::string path = std::string(tmpl) + "/notify";
  int fd = socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, path.data(), path.size());
  ASSERT_EQ(bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  setenv("NOTIFY_SOCKET", path.c_str(), 1);
  auto daemon = DaemonProcess::Start();
  unsetenv("NOTIFY_SOCKET");
  ASSERT_NE(daemon, nullptr);
  auto next = [&]() -> std::string {
    pollfd p{fd, POLLIN, 0};
    if (poll(&p, 1, 10000) <= 0) return "(nothing)";
    char buf[256];
    ssize_t n = recv(fd, buf, sizeof(buf), 0);
    return n > 0 ? std::string(buf, n) : "(error)";
  };
  EXPECT_EQ(next(), "READY=1");
  kill(daemon->pid(), SIGTERM);
  EXPECT_EQ(next(), "STOPPING=1");
  EXPECT_EQ(daemon->Stop(), 0);
  close(fd);
  (void)!system((std::string("rm -rf ") + tmpl).c_str());
}

}  // namespace
}  // namespace ciuic::testing
