// The settings of a run that every node of a job must apply alike: how the
// bytes are cut into chunks, which inter-node algorithm carries them, and
// what goes on the wire (the codec). A node that cut or encoded differently
// from its peers would send messages they do not expect, so these are not
// each daemon's own business: the job's coordinator decides them from its
// daemon's tuning when it announces a run, and sends them with the
// announcement (peer.proto, CoordinatorEvent.Run). `ciuicctl tune set
// chunk_bytes=...` (or chunks_in_flight, algorithm, compression,
// min_compress_bytes, compression_strict) on the coordinator's daemon (the one hosting rank 0)
// therefore changes them for the whole job from its next run; the other
// daemons' values for these keys do not matter for that job.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "collectives/internode/internode.h"
#include "config/tuning.h"

namespace ciuic::daemon {

struct RunSettings {
  uint64_t chunk_bytes = 0;      // 0: not announced
  uint32_t chunks_in_flight = 0;  // per direction; 1..64
  config::Algorithm algorithm = config::Algorithm::kAuto;
  std::string codec;  // "" uncompressed, else a codec spec for ParseCodec ("int8", "topk:0.01")
  // > 0: the operation runs in consecutive segments of about this many
  // bytes, each its own operation (some node stages GPU buffers through host
  // memory and overlaps the copies of one segment with the transfers of
  // another).
  uint64_t segment_bytes = 0;
  // An alltoall(v) with segment_bytes: how many segments (AlltoallSegments).
  uint64_t segments = 0;
  // Each channel's share of the chunks (channel_weights.h); empty: equal.
  std::vector<uint32_t> channel_shares;
};

// At most this many segments per operation (their number is part of the
// tags): a bigger operation gets bigger segments, on every node alike.
inline constexpr uint64_t kMaxSegments = uint64_t{1} << 12;

// The segments of an alltoall(v) whose ranks send or receive at most
// `rank_bytes` each (the largest over the nodes), in segments of about
// `segment_bytes` per rank: 1 .. kMaxSegments.
uint64_t AlltoallSegments(uint64_t rank_bytes, uint64_t segment_bytes);

// What an operation's signature says about compression, for ResolveCodec.
struct CodecRequest {
  uint32_t codec = 0;  // wire::Codec; kDefault (0): tuning.compression
  float codec_ratio = 0;
  uint32_t dtype = 0;
  uint32_t reduce_op = 0;
  uint64_t bytes = 0;  // the operation's payload per rank
};

// The codec spec the operation travels with under `tuning`: "" when it goes
// uncompressed (asked for none, below min_compress_bytes, or a dtype or
// reduce op the codec cannot take with compression_strict off), else the
// spec. With compression_strict on, a codec that cannot take the operation
// is INVALID_ARGUMENT naming the operation and why.
absl::StatusOr<std::string> ResolveCodec(const std::string& op_name, const CodecRequest& request,
                                         const config::Tuning& tuning);

// Whether an allreduce of `bytes` with `codec` may run fused with others:
// compressed ones always (within the codec's per-element bound), and
// uncompressed ones whose algorithm would be OffsetIndependent (internode.h:
// halving-doubling, or the ring on two nodes), so that packing changes no
// bit.
bool FusableAllreduce(uint64_t bytes, const std::string& codec, config::Algorithm algorithm,
                      int num_nodes);

InterNodeAlgorithm InterNodeAlgorithmFor(config::Algorithm algorithm);

// The allreduce algorithm an uncompressed run of `bytes` per node (per
// segment, for a run in segments) uses under `algorithm` on `num_nodes`
// nodes, as ClusterJob runs it: auto by ChooseAllreduceAlgorithm; a fused
// run (`fused`) with an algorithm whose bits depend on offsets runs
// halving-doubling instead (OffsetIndependent).
InterNodeAlgorithm AllreduceAlgorithmOf(config::Algorithm algorithm, int num_nodes,
                                        uint64_t bytes, bool fused);

// What `ciuicctl trace` shows as a run's algorithm: "compressed" with a
// codec; for an allreduce the name of AllreduceAlgorithmOf ("ring",
// "halving_doubling", "rack"); "ring" for a reduce_scatter or allgather,
// "tree" or "chain" for a broadcast (by BroadcastPipeline's rule), "rack"
// for those three under kRack,
// "pairwise" for an alltoall(v), "" for a barrier.
std::string RunAlgorithmName(const RunSettings& settings, uint32_t collective, int num_nodes,
                             uint64_t bytes, bool fused);

}  // namespace ciuic::daemon
