#pragma once

// Live-tunable settings of ciuicd.
//
// `Tuning` is a plain value: the engine takes a Snapshot() when it starts an
// operation and uses it for that whole operation, so a change made through
// `ciuicctl tune set` (control thread) applies from the next operation and
// never corrupts one in flight. The same key table parses the `tuning:`
// section of the config file, so the file and the live interface accept
// exactly the same keys and values.

#include <cstdint>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"

namespace ciuic::config {

// Inter-node collective algorithm; kAuto lets the engine pick per operation.
// (No tree: a tree allreduce takes 2 log2 N rounds where halving-doubling
// takes log2 N, and moves more bytes than the ring; "tree" is refused.)
// kRack: allreduces rack by rack (config `rack`; daemon/cluster/README.md,
// "Racks"); auto chooses it where the coordinator's cost model of the
// measured link rates says it is faster.
enum class Algorithm { kAuto, kRing, kHalvingDoubling, kRack };

// "auto", "ring", "halving_doubling", "rack".
absl::string_view AlgorithmName(Algorithm algorithm);

struct Tuning {
  // Unit of work the engine splits large operations into, and the chunk of
  // the inter-node pipeline. 4K..1G. 1M: in DDP training over a 1 Gbit/s
  // link (4 MB buckets, one chunk per ring step at 4M) a step took 9% less,
  // and a 2-node 16 MiB allreduce on loopback was 5-20% faster, than with 4M.
  uint64_t chunk_bytes = uint64_t{1} << 20;
  // Operations at most this big run inline on the engine thread instead of
  // the worker pool. 0..1G.
  uint64_t small_op_bytes = uint64_t{256} << 10;
  // How long the engine polls for more work before sleeping. 0..100000.
  uint32_t spin_us = 50;
  // How long an operation waits for all ranks. 100..86400000.
  uint32_t op_timeout_ms = 60000;
  // UCX workers for the inter-node phase. 1..64.
  uint32_t channels = 2;
  // Chunks of a multi-node run in flight per direction (each one a UCX
  // rendezvous: enough of them keep a link with queueing delay busy through
  // the handshakes). 1..64.
  uint32_t chunks_in_flight = 8;
  Algorithm algorithm = Algorithm::kAuto;
  // Codec for what crosses the network in float sum/avg operations of
  // multi-node jobs: none, fp16, bf16, int8, topk:RATIO. Operations may
  // override it (OpOptions::compression).
  std::string compression = "none";
  // Operations smaller than this are never compressed. 0..1G.
  uint64_t min_compress_bytes = uint64_t{64} << 10;
  // Keep what compression dropped per operation name and add it to the next
  // submission of that name.
  bool error_feedback = true;
  // What to do with an operation the codec cannot take (integer dtypes,
  // min/max/prod): skip compression for it, or fail it.
  bool compression_strict = false;
  // Single-node jobs run operations of at most this many payload bytes per
  // rank among their trainers, in a segment shared by the job, without the
  // daemon (proto/ciuic/fast_path.h). Fixed per job when it forms: a change
  // applies to jobs formed later. 0 = off. 0..256K.
  uint64_t fast_path_bytes = uint64_t{4} << 10;
  // Tensor fusion across nodes (decided by the job's coordinator daemon, for
  // the whole job): ready allreduces of one dtype and reduce op that queue up
  // behind running operations are packed into one inter-node allreduce of at
  // most this many bytes. 0 disables fusion. 0..1G.
  uint64_t fusion_threshold_bytes = uint64_t{4} << 20;
  // How long the coordinator holds an operation that could start at once, to
  // collect others that become ready meanwhile (fusion, priority order).
  // 0: never wait (an isolated operation starts at once; only operations
  // that queue behind running ones are fused and ordered). 0..1000000.
  uint32_t cycle_time_us = 0;
  // Unnamed allreduces and barriers (matched by submission order) of at most
  // this many payload bytes go between the nodes of a multi-node job
  // without the coordinator: each node starts one as soon as its own ranks
  // have submitted it, and the exchange itself carries the signatures that
  // detect a mismatch. Never compressed. The coordinator's setting when the
  // job forms decides for the job (while its compression is on, only
  // operations under min_compress_bytes). 0 = off. 0..1M. 1M: on 2
  // loopback nodes direct beats the coordinator's runs at every size up to
  // 1M (512K 1.6-1.8x, 1M 1.1-1.6x, with 1 and 2 ranks per node), is even
  // at 2M and loses at 4M (daemon/cluster/README.md, "Why 1M").
  uint64_t direct_max_bytes = uint64_t{1} << 20;
  // Multi-node operations whose buffers are in GPU memory on some node go
  // between the nodes in pieces of about this many bytes, each one an
  // operation of its own (decided by the coordinator, for every node
  // alike): a GPU node copies piece k+1 to host memory while piece k is on
  // the network, and piece k back while piece k+1 is. 4K..1G.
  uint64_t staging_segment_bytes = uint64_t{16} << 20;
  // How many of its last operations the daemon keeps a record of, for
  // `ciuicctl trace` (when each rank submitted, each phase). 0: none.
  // 0..100000.
  uint32_t trace_ops = 4096;
  // Liveness between the daemons of a multi-node job, above the kernel's
  // (which a stopped process's host still answers): each node and the
  // coordinator send a heartbeat on the job's ordering stream every
  // heartbeat_interval_ms, and one that has heard nothing from the other
  // side for heartbeat_misses intervals ends the job with UNAVAILABLE
  // naming it. 100..60000 and 2..100; the defaults find a stopped peer
  // within 8 s.
  uint32_t heartbeat_interval_ms = 2000;
  uint32_t heartbeat_misses = 4;

  friend bool operator==(const Tuning&, const Tuning&) = default;
};

// One key as shown to operators.
struct TuningEntry {
  std::string key;
  std::string value;        // canonical form, e.g. "4M", "60000", "ring"
  std::string description;  // what it does, its range and default
};

// Every tuning key, in the stable order used by listings.
const std::vector<std::string>& TuningKeys();

bool IsTuningKey(absl::string_view key);

// Sets one key of `tuning` from its text form. Unknown key or invalid value:
// INVALID_ARGUMENT with a message naming the key, the value and what is
// allowed (plus a "did you mean" for a near-miss key); `tuning` is then left
// unchanged.
absl::Status SetTuningValue(Tuning& tuning, absl::string_view key, absl::string_view value);

// The entry for `key`, or every key in TuningKeys() order when `key` is
// empty. Unknown key: INVALID_ARGUMENT.
absl::StatusOr<std::vector<TuningEntry>> GetTuningEntries(const Tuning& tuning,
                                                          absl::string_view key);

// The daemon's current Tuning, shared between the control service (Set/Get,
// from gRPC threads) and the engine (Snapshot, per operation). All methods
// are thread-safe; each Set is atomic.
class TuningRegistry {
 public:
  TuningRegistry() = default;
  explicit TuningRegistry(const Tuning& initial);

  TuningRegistry(const TuningRegistry&) = delete;
  TuningRegistry& operator=(const TuningRegistry&) = delete;

  // A copy of the settings in force now.
  Tuning Snapshot() const;

  // Replaces every setting at once (e.g. after a config reload).
  void Replace(const Tuning& tuning);

  // See SetTuningValue(). On error nothing changes.
  absl::Status Set(absl::string_view key, absl::string_view value);

  // See GetTuningEntries().
  absl::StatusOr<std::vector<TuningEntry>> Get(absl::string_view key) const;

 private:
  mutable absl::Mutex mu_;
  Tuning tuning_ ABSL_GUARDED_BY(mu_);
};

}  // namespace ciuic::config
