// Fuzz target: the coordinator (cluster/coordinator.h), which forms jobs
// from the nodes' registrations and orders their operations from the
// events on their ordering streams: all of it another daemon's input.
//
// Input, read in this order:
//   - the coordinator's max_world_size and tuning (fusion threshold,
//     algorithm, compression: what Schedule decides by);
//   - up to 3 registrations parsed from length-prefixed bytes, for jobs of
//     their own, each registered with a deadline already past;
//   - a job of 1..8 ranks on 1..4 nodes (its ranks spread as the input
//     says): every node but the last registers on a thread; then
//     registrations that conflict with them (a name or rank taken, another
//     world size or channel count, a bad one, a part of the last node's
//     ranks), each with a past deadline; then the last node, which forms
//     the job. Each node attaches its stream (with, as chosen, a wrong
//     instance or index first);
//   - up to 512 events from the nodes: Ready of operation names from a
//     small set (so they collide), their signatures mostly alike across
//     nodes, alltoallv split hashes mostly agreeing; Done of the runs
//     seen; Leave; a stream lost or ended, and attached again; any
//     NodeEvent parsed from length-prefixed bytes; and one node readying
//     distinct names until the coordinator's bound on pending names.
// No timer fires: the operations' timeouts are long and the tuning holds
// nothing back, so every event's outcome is there when OnEvent returns.
//
// Properties:
//   - Register refuses what CheckRegistration refuses, with its status;
//     a past deadline gives the job alone formed (when the registration
//     holds every rank), ALREADY_EXISTS, INVALID_ARGUMENT,
//     FAILED_PRECONDITION or DEADLINE_EXCEEDED exactly as the registrations
//     before it imply, and leaves nothing of a job that did not form;
//   - every node of a formed job gets the same table, and it passes
//     CheckMembership for each node, at its own index;
//   - every event sent is a Run, a Fail or a JobFailed; a Fail or
//     JobFailed has a non-OK code and a message; a stream gets at most one
//     JobFailed and nothing but Fail after it, and no Run starts once the
//     job has failed;
//   - runs are numbered 0, 1, 2, ... in the order they start, each stream
//     sees them in that order, and every stream gets the same Run for a
//     seq; a Run names operations (name and fused_with, all distinct) that
//     every node readied (counted here), and a fused run carries at most
//     fusion_threshold_bytes;
//   - the coordinator keeps at most world_size * kRingCapacity (and 2^18)
//     pending names: the Ready that would pass the bound fails the job with
//     RESOURCE_EXHAUSTED, and no other does (the pending names are tracked
//     here); a malformed Ready fails the job with INVALID_ARGUMENT;
//   - Attach takes each node once, refuses a wrong instance (NOT_FOUND) or
//     index (INVALID_ARGUMENT), and a failed job's node with its failure.
#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "ciuic/shm_layout.h"
#include "cluster/coordinator.h"
#include "cluster/membership.h"
#include "config/tuning.h"
#include "fuzz_input.h"
#include "fuzz_proto.h"
#include "spdlog/spdlog.h"

namespace {

constexpr const char* kTarget = "coordinator_fuzz";
namespace cluster = ciuic::daemon;
namespace proto = ciuic::proto;
namespace wire = ciuic::wire;
using Clock = std::chrono::steady_clock;
using Code = absl::StatusCode;

constexpr uint32_t kUid = 1000;  // the job's; the parsed registrations' are below
constexpr const char* kJob = "fuzz-job";
const char* const kOpNames[] = {"grad.0", "grad.1", "grad.2", "loss", "a2a", "bcast"};

// A node's ordering stream: keeps what the coordinator sends.
class Recorder : public cluster::NodeStream {
 public:
  void Send(const proto::CoordinatorEvent& e) override {
    // The coordinator's timer sends heartbeats whenever it likes: they say
    // nothing of the job, and the properties are about the rest.
    if (e.has_heartbeat()) return;
    std::lock_guard<std::mutex> lock(mu_);
    events_.push_back(e);
  }
  std::vector<proto::CoordinatorEvent> Take() {
    std::lock_guard<std::mutex> lock(mu_);
    return std::exchange(events_, {});
  }

 private:
  std::mutex mu_;
  std::vector<proto::CoordinatorEvent> events_;
};

struct Stream {
  Recorder recorder;
  int node = -1;
  uint64_t handle = 0;
  bool job_failed = false;  // it got a JobFailed
  int64_t last_seq = -1;
};

std::string Bytes(ciuic::fuzz::Input& in, size_t n) {
  std::string s(std::min(n, in.rest_size()), '\0');
  in.Bytes(s.data(), s.size());
  return s;
}

proto::RegisterNodeRequest Registration(const std::string& name, const std::vector<int>& ranks,
                                        int world_size, int channels) {
  proto::RegisterNodeRequest r;
  r.set_job_id(kJob);
  r.set_uid(kUid);
  r.set_world_size(world_size);
  r.set_node_name(name);
  for (int rank : ranks) r.add_ranks(rank);
  for (int c = 0; c < channels; ++c)
    r.add_transport_addresses("ucx:" + name + ":" + std::to_string(c));
  r.set_channels(channels);
  r.set_protocol(cluster::kPeerProtocol);
  return r;
}

void CheckTable(const proto::Membership& m, const proto::RegisterNodeRequest& r, int world_size) {
  int self = -1;
  const std::vector<int> ranks(r.ranks().begin(), r.ranks().end());
  const absl::Status s =
      cluster::CheckMembership(m, "fuzz", world_size, r.node_name(), ranks, r.channels(), &self);
  FUZZ_CHECK(s.ok(), "a formed table fails CheckMembership for one of its nodes");
  FUZZ_CHECK(m.nodes(self).node_name() == r.node_name(), "a node is not at its index");
}

// The registrations parsed from the input, each for a job of its own,
// with a past deadline: the outcome is known from those before it.
void RegisterParsed(cluster::Coordinator& c, ciuic::fuzz::Input& in, int max_world_size) {
  std::set<std::string> formed;
  const int count = in.Byte() % 4;
  for (int i = 0; i < count; ++i) {
    const std::string bytes = Bytes(in, in.Byte());
    proto::RegisterNodeRequest r;
    if (!ciuic::fuzz::ParseProto(&r, reinterpret_cast<const uint8_t*>(bytes.data()),
                                 bytes.size())) {
      continue;
    }
    r.set_uid(r.uid() % kUid);  // never the job below
    if (in.Byte() & 1) r.set_protocol(cluster::kPeerProtocol);  // else as parsed
    const absl::Status check = cluster::CheckRegistration(r, max_world_size);
    auto m = c.Register(r, Clock::now() - std::chrono::seconds(1));
    const std::string key = std::to_string(r.uid()) + "/" + r.job_id();
    if (!check.ok()) {
      FUZZ_CHECK(m.status() == check, "Register does not refuse what CheckRegistration refuses");
    } else if (r.protocol() != cluster::kPeerProtocol) {
      FUZZ_CHECK(m.status().code() == Code::kFailedPrecondition,
                 "a registration of another peer protocol is not FAILED_PRECONDITION");
    } else if (formed.count(key)) {
      FUZZ_CHECK(m.status().code() == Code::kFailedPrecondition,
                 "a formed job took another registration");
    } else if (r.ranks_size() == r.world_size()) {
      FUZZ_CHECK(m.ok(), "a registration holding every rank did not form its job");
      FUZZ_CHECK(m->nodes_size() == 1, "a job of one registration has several nodes");
      CheckTable(*m, r, r.world_size());
      formed.insert(key);
    } else {
      FUZZ_CHECK(m.status().code() == Code::kDeadlineExceeded,
                 "a registration past its deadline is not DEADLINE_EXCEEDED");
    }
    FUZZ_CHECK(c.num_jobs() == formed.size(), "a job that did not form is kept");
  }
}

// The job under test: registered, formed and attached.
struct Job {
  int world_size = 0;
  int channels = 0;
  std::vector<proto::RegisterNodeRequest> registrations;
  proto::Membership membership;
  std::deque<Stream> streams;      // every attachment so far
  std::vector<Stream*> stream_of;  // by node: its attached stream, or null
};

// Registers the job's nodes: all but the last on threads, which wait for
// it; registrations that conflict with them in between (as the input
// chooses); then the last, which forms the job.
void FormJob(cluster::Coordinator& c, ciuic::fuzz::Input& in, Job* job) {
  const int world = job->world_size;
  const int nodes = static_cast<int>(job->registrations.size());
  std::mutex mu;
  std::condition_variable cv;
  int registered = 0;
  std::vector<absl::StatusOr<proto::Membership>> results(nodes, absl::UnknownError("not run"));
  std::vector<std::thread> threads;
  const auto deadline = Clock::now() + std::chrono::seconds(20);
  for (int n = 0; n + 1 < nodes; ++n) {
    threads.emplace_back([&, n] {
      bool told = false;
      // Called first once the registration is kept (and under the
      // coordinator's lock): the main thread may go on.
      auto kept = [&] {
        if (!told) {
          told = true;
          std::lock_guard<std::mutex> lock(mu);
          ++registered;
          cv.notify_all();
        }
        return false;
      };
      results[n] = c.Register(job->registrations[n], deadline, kept);
    });
  }
  {
    std::unique_lock<std::mutex> lock(mu);
    cv.wait(lock, [&] { return registered == nodes - 1; });
  }
  // Registrations that conflict with those kept, each refused (or, a part
  // of the last node's ranks, withdrawn at its deadline) and leaving them
  // as they were.
  const proto::RegisterNodeRequest& last = job->registrations.back();
  const uint8_t conflicts = nodes > 1 ? in.Byte() : 0;
  for (int f = 0; f < 6; ++f) {
    if ((conflicts & (1 << f)) == 0) continue;
    std::vector<int> ranks(last.ranks().begin(), last.ranks().end());
    proto::RegisterNodeRequest r = Registration("intruder", ranks, world, job->channels);
    Code want = Code::kAlreadyExists;
    switch (f) {
      case 0:  // a node name taken
        r.set_node_name(job->registrations[0].node_name());
        break;
      case 1:  // a rank taken
        r.add_ranks(job->registrations[0].ranks(0));
        break;
      case 2:  // another world size
        if (world == 1) continue;
        r = Registration("intruder", {0}, world - 1, job->channels);
        want = Code::kInvalidArgument;
        break;
      case 3:  // another channel count
        r = Registration("intruder", ranks, world, job->channels + 1);
        want = Code::kInvalidArgument;
        break;
      case 4:  // refused by CheckRegistration
        r.add_ranks(world);
        want = Code::kInvalidArgument;
        break;
      case 5:  // a part of the last node's ranks only
        if (ranks.size() < 2) continue;
        ranks.pop_back();
        r = Registration("intruder", ranks, world, job->channels);
        want = Code::kDeadlineExceeded;
        break;
    }
    auto m = c.Register(r, Clock::now() - std::chrono::seconds(1));
    FUZZ_CHECK(m.status().code() == want, "a conflicting registration got the wrong verdict");
    FUZZ_CHECK(!m.status().message().empty(), "a refused registration says no why");
  }
  results[nodes - 1] = c.Register(last, deadline);
  for (auto& t : threads) t.join();
  for (int n = 0; n < nodes; ++n) {
    FUZZ_CHECK(results[n].ok(), "a node of a job that formed did not get its table");
    FUZZ_CHECK(results[n]->SerializeAsString() == results[0]->SerializeAsString(),
               "the nodes got different tables");
    CheckTable(*results[n], job->registrations[n], world);
  }
  job->membership = *results[0];
}

// What the target tracks of the job's ordering, independently of the
// coordinator.
struct Model {
  int nodes = 0;
  size_t max_pending = 0;
  uint64_t fusion_threshold = 0;
  bool failed = false;  // a JobFailed was sent
  bool gone = false;    // every stream ended: the coordinator dropped the job
  std::map<std::string, std::vector<int>> readied;  // name -> per node, Readies not yet run
  struct Pending {
    std::set<int> nodes;
    proto::OpSignature signature;  // the first node's, as the coordinator keeps
  };
  std::map<std::string, Pending> pending;  // readied by some nodes, not all
  // Per name, the signatures of the rounds every node readied and not run.
  std::map<std::string, std::vector<proto::OpSignature>> complete;
  std::map<uint64_t, std::string> runs;  // seq -> the Run, serialized
  uint64_t next_seq = 0;
};

// What one call made the coordinator send.
struct Sent {
  std::set<int> job_failed;                                          // the JobFailed events' codes
  std::vector<std::pair<int, proto::CoordinatorEvent::Fail>> fails;  // to node, Fail
};

// Drains every stream and checks what was sent.
Sent Drain(Job& job, Model& model) {
  Sent sent;
  std::set<int>& job_failed = sent.job_failed;
  const bool failed_before = model.failed;
  for (Stream& s : job.streams) {
    for (const proto::CoordinatorEvent& e : s.recorder.Take()) {
      FUZZ_CHECK(!s.job_failed || e.has_fail(), "a stream got more than Fail after a JobFailed");
      if (e.has_fail()) {
        FUZZ_CHECK(e.fail().code() != 0, "a Fail with code OK");
        FUZZ_CHECK(!e.fail().message().empty(), "a Fail says no why");
        sent.fails.emplace_back(s.node, e.fail());
      } else if (e.has_job_failed()) {
        FUZZ_CHECK(e.job_failed().code() != 0, "a JobFailed with code OK");
        FUZZ_CHECK(!e.job_failed().message().empty(), "a JobFailed says no why");
        s.job_failed = true;
        job_failed.insert(e.job_failed().code());
      } else {
        FUZZ_CHECK(e.has_run(), "an event that is neither Run, Fail nor JobFailed");
        const proto::CoordinatorEvent::Run& run = e.run();
        FUZZ_CHECK(static_cast<int64_t>(run.seq()) > s.last_seq, "a stream's runs out of order");
        s.last_seq = static_cast<int64_t>(run.seq());
        auto [it, fresh] = model.runs.try_emplace(run.seq(), run.SerializeAsString());
        if (!fresh) {
          FUZZ_CHECK(it->second == run.SerializeAsString(), "nodes got different Runs for a seq");
          continue;
        }
        FUZZ_CHECK(!failed_before, "a Run started after the job failed");
        FUZZ_CHECK(run.seq() == model.next_seq, "runs not numbered 0, 1, 2, ...");
        ++model.next_seq;
        std::vector<std::string> names = {run.name()};
        names.insert(names.end(), run.fused_with().begin(), run.fused_with().end());
        std::set<std::string> distinct(names.begin(), names.end());
        FUZZ_CHECK(distinct.size() == names.size(), "a Run names an operation twice");
        unsigned __int128 bytes = 0;
        for (const std::string& name : names) {
          auto r = model.readied.find(name);
          FUZZ_CHECK(r != model.readied.end(), "a Run names an operation no node readied");
          for (int& count : r->second) {
            FUZZ_CHECK(count > 0, "a Run names an operation some node did not ready");
            --count;
          }
          // The round this run takes: the smallest, so as never to blame
          // the coordinator for a round it did not run.
          auto& rounds = model.complete[name];
          auto size = [](const proto::OpSignature& sig) {
            return static_cast<unsigned __int128>(sig.count()) * wire::DataTypeSize(sig.dtype());
          };
          auto least =
              std::min_element(rounds.begin(), rounds.end(),
                               [&](const auto& a, const auto& b) { return size(a) < size(b); });
          if (least != rounds.end()) {
            bytes += size(*least);
            rounds.erase(least);
          }
        }
        FUZZ_CHECK(names.size() == 1 || bytes <= model.fusion_threshold,
                   "a fused run carries more than fusion_threshold_bytes");
      }
    }
  }
  if (!job_failed.empty()) model.failed = true;
  return sent;
}

proto::OpSignature Signature(ciuic::fuzz::Input& in, int name, uint8_t salt) {
  static constexpr uint32_t kCollectives[] = {1, 1, 1, 1, 2, 4, 7, 5};
  static constexpr uint32_t kDtypes[] = {1, 3, 4, 7};
  static constexpr uint32_t kOps[] = {1, 1, 4, 2};
  static constexpr uint64_t kCounts[] = {1, 1000, 1 << 18, 1 << 22, uint64_t{1} << 62};
  static constexpr uint32_t kCodecs[] = {0, 0, 0, 1, 2, 5};
  // Mostly the same for every node readying the name; now and then not.
  const uint32_t k = (name * 7 + salt) ^ ((in.Byte() % 16 == 0) ? 1 : 0);
  proto::OpSignature s;
  s.set_collective(name == 4 ? 7 : kCollectives[k % 8]);
  s.set_dtype(kDtypes[(k / 8) % 4]);
  s.set_reduce_op(kOps[(k / 3) % 4]);
  s.set_count(kCounts[(k / 5) % 5]);
  s.set_codec(kCodecs[(k / 2) % 6]);
  if (s.codec() == 5) s.set_codec_ratio(0.01f);
  return s;
}

proto::NodeEvent Ready(ciuic::fuzz::Input& in, const Model& model, int node, uint8_t salt) {
  proto::NodeEvent e;
  auto* r = e.mutable_ready();
  const int name = in.Byte() % 6;
  r->set_name(kOpNames[name]);
  *r->mutable_signature() = Signature(in, name, salt);
  const uint8_t flags = in.Byte();
  r->set_priority(flags % 3);
  r->set_device_buffers((flags & 8) != 0);
  r->set_timeout_ms((flags & 16) ? 600000 : 0);  // never the timer's
  r->set_rank_bytes((flags & 32) ? uint64_t{1} << 30 : 4096);
  if (r->signature().collective() == static_cast<uint32_t>(wire::Collective::kAlltoallv) &&
      (flags & 64) == 0) {
    // Node k's split_out[m] agrees with node m's split_in[k], unless not.
    const bool wrong = (flags & 128) != 0 && (flags & 4) != 0;
    for (int m = 0; m < model.nodes; ++m) {
      r->add_split_out(static_cast<uint64_t>(node * 8 + m) ^ salt);
      r->add_split_in(static_cast<uint64_t>(m * 8 + node) ^ salt ^ (wrong ? 1 : 0));
    }
    if ((flags & 128) != 0 && (flags & 4) == 0) r->set_splits_error("ranks disagree");
  }
  return e;
}

bool WellFormed(const proto::NodeEvent::Ready& r, int nodes) {
  return !r.name().empty() && r.name().size() <= wire::kMaxOpName && r.split_out_size() <= nodes &&
         r.split_in_size() <= nodes && r.splits_error().size() <= 4096;
}

// Delivers `e` from `node` and checks what follows from it.
void Deliver(cluster::Coordinator& c, Job& job, Model& model, int node, const proto::NodeEvent& e) {
  Stream* s = job.stream_of[node];
  if (s == nullptr) return;
  bool exhausts = false;
  bool malformed = false;
  bool counted = false;  // counted below as taken
  bool fresh = false;    // a pending name of its own
  bool completes = false;
  const bool live = !model.gone && !model.failed;
  const auto& r = e.ready();
  if (e.has_ready() && live) {
    if (!WellFormed(r, model.nodes)) {
      malformed = true;
    } else if (model.pending.size() >= model.max_pending && !model.pending.count(r.name())) {
      exhausts = true;
    } else {
      // Taken (before the call: it may start a run), unless refused below.
      counted = true;
      auto& counts = model.readied[r.name()];
      counts.resize(model.nodes);
      ++counts[node];
      auto p = model.pending.find(r.name());
      fresh = p == model.pending.end();
      if (fresh) p = model.pending.emplace(r.name(), Model::Pending{{}, r.signature()}).first;
      p->second.nodes.insert(node);  // a second Ready of the node changes nothing
      if (static_cast<int>(p->second.nodes.size()) == model.nodes) {
        completes = true;
        model.complete[r.name()].push_back(p->second.signature);
        model.pending.erase(p);
      }
    }
  }
  c.OnEvent(s->handle, e);
  const Sent sent = Drain(job, model);
  const std::set<int>& failed = sent.job_failed;
  // Refused as readied twice (FAILED_PRECONDITION to the node): nothing of
  // it is kept. (A mismatch is kept, and fails.)
  const bool refused = std::any_of(sent.fails.begin(), sent.fails.end(), [&](const auto& f) {
    return f.first == node && f.second.name() == r.name() &&
           f.second.code() == static_cast<int>(Code::kFailedPrecondition);
  });
  if (counted && refused) {
    --model.readied[r.name()][node];
    if (completes) {
      model.complete[r.name()].pop_back();
    } else if (fresh) {
      model.pending.erase(r.name());
    }
  }
  if (e.has_ready()) {  // (a Done may carry any code, RESOURCE_EXHAUSTED too)
    FUZZ_CHECK(exhausts == (failed.count(static_cast<int>(Code::kResourceExhausted)) > 0),
               "the coordinator's bound on pending names is not world_size * kRingCapacity");
  }
  if (malformed) {
    FUZZ_CHECK(failed.count(static_cast<int>(Code::kInvalidArgument)),
               "a malformed Ready did not fail the job");
  }
  if (e.has_leave() && live) {
    FUZZ_CHECK(failed.count(static_cast<int>(Code::kAborted)), "a Leave did not end the job");
  }
}

void Attach(cluster::Coordinator& c, Job& job, Model& model, int node) {
  proto::NodeEvent::Hello h;
  h.set_job_id(kJob);
  h.set_uid(kUid);
  h.set_instance(job.membership.instance());
  h.set_node(node);
  Stream& s = job.streams.emplace_back();
  s.node = node;
  auto handle = c.Attach(h, &s.recorder);
  if (model.gone) {
    FUZZ_CHECK(handle.status().code() == Code::kNotFound, "a job whose streams all ended attached");
  } else if (job.stream_of[node] != nullptr) {
    FUZZ_CHECK(handle.status().code() == Code::kInvalidArgument, "a node attached twice");
  } else if (model.failed) {
    FUZZ_CHECK(!handle.ok(), "a failed job attached a node");
  } else {
    FUZZ_CHECK(handle.ok(), "a node of a formed job could not attach");
  }
  if (!handle.ok()) return;
  s.handle = *handle;
  job.stream_of[node] = &s;
}

void Detach(cluster::Coordinator& c, Job& job, Model& model, int node, const absl::Status& why) {
  Stream* s = job.stream_of[node];
  if (s == nullptr) return;
  c.Detach(s->handle, why);
  job.stream_of[node] = nullptr;
  Drain(job, model);
  if (std::all_of(job.stream_of.begin(), job.stream_of.end(), [](Stream* p) { return !p; })) {
    model.gone = true;
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const bool quiet = [] {
    spdlog::set_level(spdlog::level::off);  // each input forms and ends a job
    return true;
  }();
  (void)quiet;
  ciuic::fuzz::Input in(data, size);
  const uint8_t setup = in.Byte();
  const int max_world_size = setup % 4 == 0 ? cluster::kDefaultMaxWorldSize : 8 + setup % 4;
  static constexpr const char* kCompression[] = {"none", "fp16", "int8", "topk:0.01"};
  static constexpr uint64_t kThresholds[] = {0, 4096, uint64_t{4} << 20, uint64_t{1} << 30};
  ciuic::config::Tuning tuning;
  tuning.algorithm = static_cast<ciuic::config::Algorithm>((setup >> 2) % 3);
  tuning.compression = kCompression[(setup >> 4) % 4];
  tuning.compression_strict = (setup & 64) != 0;
  tuning.min_compress_bytes = (setup & 128) ? 0 : tuning.min_compress_bytes;
  tuning.fusion_threshold_bytes = kThresholds[in.Byte() % 4];
  ciuic::config::TuningRegistry registry(tuning);

  Job job;  // outlives the coordinator: it holds the streams
  Model model;
  cluster::Coordinator c(&registry, max_world_size);
  RegisterParsed(c, in, max_world_size);

  // The job: its ranks in an order the input gives, cut among its nodes.
  job.world_size = 1 + in.Byte() % 8;
  job.channels = 1 + in.Byte() % 2;
  const int nodes = 1 + in.Byte() % std::min(4, job.world_size);
  std::vector<int> order(job.world_size);
  for (int r = 0; r < job.world_size; ++r) order[r] = r;
  for (int i = job.world_size; i > 1; --i) std::swap(order[i - 1], order[in.Byte() % i]);
  std::vector<std::vector<int>> ranks(nodes);
  for (int i = 0; i < job.world_size; ++i)
    ranks[i < nodes ? i : in.Byte() % nodes].push_back(order[i]);
  for (int n = 0; n < nodes; ++n) {
    job.registrations.push_back(
        Registration("node-" + std::to_string(n), ranks[n], job.world_size, job.channels));
  }
  FormJob(c, in, &job);

  model.nodes = nodes;
  model.max_pending = std::min<uint64_t>(
      static_cast<uint64_t>(job.world_size) * wire::kRingCapacity, uint64_t{1} << 18);
  model.fusion_threshold = tuning.fusion_threshold_bytes;
  job.stream_of.assign(nodes, nullptr);
  // Hellos the coordinator must refuse: another instance, a node index out
  // of the table.
  const uint8_t hellos = in.Byte();
  if (hellos & 1) {
    proto::NodeEvent::Hello h;
    h.set_job_id(kJob);
    h.set_uid(kUid);
    h.set_instance(job.membership.instance() + 1);
    Recorder stray;
    FUZZ_CHECK(c.Attach(h, &stray).status().code() == Code::kNotFound,
               "a Hello for another instance attached");
    h.set_instance(job.membership.instance());
    h.set_node((hellos & 2) ? nodes : -1);
    FUZZ_CHECK(c.Attach(h, &stray).status().code() == Code::kInvalidArgument,
               "a Hello with a node index out of the table attached");
  }
  for (int n = 0; n < nodes; ++n) Attach(c, job, model, n);

  const uint8_t salt = in.Byte();
  for (int step = 0; step < 512 && in.rest_size() > 0; ++step) {
    const uint8_t what = in.Byte();
    const int node = in.Byte() % nodes;
    switch (what % 16) {
      default:
        Deliver(c, job, model, node, Ready(in, model, node, salt));
        break;
      case 8:
      case 9:
      case 10: {  // Done of a run seen (or not)
        proto::NodeEvent e;
        auto* d = e.mutable_done();
        const uint8_t b = in.Byte();
        d->set_seq(model.next_seq == 0 || b >= 240 ? b : model.next_seq - 1 - b % model.next_seq);
        static constexpr int32_t kCodes[] = {0, 0, 0, 0, 0, 3, 14, -7};
        d->set_code(kCodes[in.Byte() % 8]);
        if (d->code() != 0) d->set_message("the run failed here");
        Deliver(c, job, model, node, e);
        break;
      }
      case 11:
        if (what < 128) break;  // rare: the job ends
        {
          proto::NodeEvent e;
          e.mutable_leave()->set_reason("rank 3 exited");
          Deliver(c, job, model, node, e);
        }
        break;
      case 12:  // the stream ends: lost, or after its Leave
        Detach(c, job, model, node,
               what & 128 ? absl::OkStatus() : absl::UnavailableError("its stream ended"));
        break;
      case 13:
        Attach(c, job, model, node);
        break;
      case 14: {  // any NodeEvent
        proto::NodeEvent e;
        const std::string bytes = Bytes(in, in.Byte());
        if (ciuic::fuzz::ParseProto(&e, reinterpret_cast<const uint8_t*>(bytes.data()),
                                    bytes.size())) {
          if (e.has_hello()) break;  // a stream's first event only
          // No timer: an operation's timeout is long.
          if (e.has_ready()) e.mutable_ready()->set_timeout_ms(600000);
          Deliver(c, job, model, node, e);
        }
        break;
      }
      case 15: {  // a node readies new names up to (or past) the bound
        if (nodes < 2 || model.failed || model.gone || job.stream_of[node] == nullptr) break;
        // To the bound (thousands of Readies) only when the input insists.
        const uint8_t b = in.Byte();
        const size_t want = (what & 128) && b == 0xb0 ? model.max_pending + 1 : b;
        for (size_t i = 0; i < want && !model.failed; ++i) {
          proto::NodeEvent e;
          const std::string name = "flood." + std::to_string(i);
          e.mutable_ready()->set_name(name);
          e.mutable_ready()->mutable_signature()->set_collective(5);
          auto queued = model.complete.find(name);
          if (model.pending.size() + 1 >= model.max_pending || model.pending.count(name) ||
              (queued != model.complete.end() && !queued->second.empty())) {
            Deliver(c, job, model, node, e);
            continue;
          }
          // A new pending name below the bound: nothing is sent for it.
          // (Quick: no drain until the end.)
          c.OnEvent(job.stream_of[node]->handle, e);
          model.readied[name].resize(model.nodes);
          ++model.readied[name][node];
          model.pending.emplace(name, Model::Pending{{node}, e.ready().signature()});
        }
        FUZZ_CHECK(Drain(job, model).job_failed.empty(),
                   "the job failed below the bound on pending names");
        break;
      }
    }
  }
  // Streams end before the coordinator goes (as in the daemon); the job's
  // Recorders outlive it either way.
  for (int n = 0; n < nodes; ++n) Detach(c, job, model, n, absl::OkStatus());
  return 0;
}
