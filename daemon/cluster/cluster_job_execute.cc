// ClusterJob's node executor on host memory: a run's local phase (the
// node's ranks reduced or placed into the node buffer), its exchange
// between the nodes (collectives/internode), and its results back to the
// ranks; fused runs; the codec policy (which runs are compressed, which
// keep error feedback).
#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "ciuic/collective_rules.h"
#include "cluster/cluster_job.h"
#include "cluster/run_plan.h"
#include "collectives/internode/internode.h"
#include "reduce/reduce.h"
#include "spdlog/spdlog.h"

namespace ciuic::daemon {

using Clock = std::chrono::steady_clock;

absl::StatusOr<const Codec*> ClusterJob::CodecNamed(const std::string& spec) {
  if (spec.empty()) return nullptr;
  std::lock_guard<std::mutex> lock(codecs_mu_);  // codecs are never removed: the pointer stays
  auto it = codecs_.find(spec);
  if (it == codecs_.end()) {
    auto parsed = ParseCodec(spec);
    if (!parsed.ok()) return parsed.status();
    it = codecs_.emplace(spec, MakeCodec(*parsed)).first;
  }
  return it->second.get();
}

bool ClusterJob::KeepsFeedback(const ClusterOp& op, size_t count, const config::Tuning& tuning) {
  // Unnamed operations ("#N": the SDK's reserved prefix) never recur, so a
  // residual would only cost a fresh allocation and evict others'.
  if (!tuning.error_feedback || wire::IsUnnamed(op.name)) return false;
  const bool float32 = op.sig.dtype == static_cast<uint32_t>(wire::DataType::kFloat32);
  const size_t cap = options_.feedback_bytes;
  if (!float32 || count <= cap / sizeof(float)) return true;
  feedback_.Forget(op.name);  // a residual of when it was smaller, if any
  if (feedback_too_large_.fetch_add(1) == 0) {
    spdlog::warn(
        "job '{}': operation '{}' has {} elements, more than error feedback keeps ({} float32 "
        "elements, {} bytes per job): it is compressed without error feedback, so what "
        "compression drops is not carried to its next step (ciuicctl status counts such "
        "operations as too large; said once per job)",
        options_.job_id, op.name, count, cap / sizeof(float), cap);
  }
  return false;
}

void ClusterJob::ReduceLocal(wire::DataType dtype, wire::ReduceOp op,
                             const std::vector<const void*>& inputs, void* out, size_t count) {
  OpSignature sig;
  sig.collective = static_cast<uint32_t>(wire::Collective::kAllreduce);
  sig.dtype = static_cast<uint32_t>(dtype);
  sig.reduce_op = static_cast<uint32_t>(op);
  sig.count = count;
  std::vector<const uint8_t*> send;
  send.reserve(inputs.size());
  for (const void* in : inputs) send.push_back(static_cast<const uint8_t*>(in));
  RunChunks(LocalCollective(sig, std::move(send), {static_cast<uint8_t*>(out)}, kLocalChunkBytes),
            options_.parallel);
}

void ClusterJob::FanOut(const ClusterOp& op, const uint8_t* result, size_t bytes) {
  OpSignature sig;
  sig.collective = static_cast<uint32_t>(wire::Collective::kBroadcast);
  sig.dtype = static_cast<uint32_t>(wire::DataType::kUInt8);
  sig.count = bytes;
  std::vector<uint8_t*> recv;
  for (const auto& p : op.parts) {
    if (p.recv != result) recv.push_back(p.recv);
  }
  if (recv.empty()) return;
  // A chunk writes every destination: about kLocalChunkBytes in all.
  const size_t chunk = kLocalChunkBytes / recv.size();
  RunChunks(LocalCollective(sig, {result}, std::move(recv), chunk), options_.parallel);
}

absl::Status ClusterJob::ExecuteFused(const std::vector<ClusterOp>& ops, uint64_t seq,
                                      const RunSettings& settings, Lane& lane) {
  const config::Tuning tuning = options_.tuning->Snapshot();
  const ClusterOp& head = ops.front();
  for (const ClusterOp& op : ops) {
    if (op.sig.collective != static_cast<uint32_t>(wire::Collective::kAllreduce) ||
        op.sig.dtype != head.sig.dtype || op.sig.reduce_op != head.sig.reduce_op || op.staged) {
      return absl::InternalError(absl::StrCat("coordinator fused '", op.name, "' with '", head.name,
                                              "', which do not match (or one is on a GPU)"));
    }
  }
  const auto dtype = static_cast<wire::DataType>(head.sig.dtype);
  const auto requested = static_cast<wire::ReduceOp>(head.sig.reduce_op);
  const auto wire_op = wire::CombiningOp(requested);
  const size_t es = head.sig.element_bytes();
  size_t total = 0;
  // A fused run ends by the latest of its operations' deadlines.
  Clock::time_point deadline{};
  for (const ClusterOp& op : ops) {
    total += op.sig.count;
    deadline = std::max(deadline, op.deadline);
  }
  uint8_t* node = lane.staging.Get(total * es + 1);
  if (node == nullptr) {
    return absl::ResourceExhaustedError(
        absl::StrCat("cannot map ", total * es, " bytes of staging space"));
  }
  // Pack: each operation's local reduction goes straight to its place.
  std::vector<const void*> inputs;
  size_t offset = 0;
  for (const ClusterOp& op : ops) {
    inputs.clear();
    if (op.early) {
      // Reduced before the Run came (Submit), into the first rank's buffer,
      // which may have been its input too.
      if (absl::Status s = op.early->Wait(); !s.ok()) return s;
      inputs.push_back(op.parts.front().recv);
    } else {
      for (const auto& p : op.parts) inputs.push_back(p.send);
    }
    ReduceLocal(dtype, wire_op, inputs, node + offset, op.sig.count);
    offset += op.sig.count * es;
  }
  // All compressed with the run's codec, or all uncompressed.
  auto codec = CodecNamed(settings.codec);
  if (!codec.ok()) return codec.status();
  InterNodeContext ctx = ContextFor(seq, deadline, settings, lane);
  absl::Status s;
  if (*codec != nullptr) {
    // One compressed allreduce over the packed buffer; each operation keeps
    // its own error feedback residuals (as unfused: unnamed ones and those
    // over the cap none).
    std::vector<FeedbackPiece> pieces;
    size_t at = 0;
    for (const ClusterOp& op : ops) {
      const bool keeps = KeepsFeedback(op, op.sig.count, tuning);
      pieces.push_back(FeedbackPiece{keeps ? op.name : std::string(), at, op.sig.count});
      at += op.sig.count;
    }
    CompressionStats stats;
    s = AllreduceCompressedPieces(ctx, **codec, tuning.error_feedback ? &feedback_ : nullptr,
                                  pieces, dtype, node, total, &stats);
    CountCompressed(ops.size(), stats);
  } else {
    // The run's algorithm (auto: by the packed size) where an element's bits
    // do not depend on its offset (the coordinator fused only such
    // operations), halving-doubling otherwise.
    const InterNodeAlgorithm algo = AllreduceAlgorithmOf(
        settings.algorithm, ctx.transport->num_peers(), total * es, /*fused=*/true);
    s = Allreduce(ctx, algo, dtype, wire_op, node, total);
  }
  if (!s.ok()) return s;
  if (requested == wire::ReduceOp::kAvg) DivideInPlace(dtype, node, total, options_.world_size);
  offset = 0;
  for (const ClusterOp& op : ops) {
    const size_t bytes = op.sig.count * es;
    FanOut(op, node + offset, bytes);
    offset += bytes;
  }
  fused_ops_.fetch_add(ops.size(), std::memory_order_relaxed);
  fused_runs_.fetch_add(1, std::memory_order_relaxed);
  return absl::OkStatus();
}

void ClusterJob::CountCompressed(uint64_t ops, const CompressionStats& stats) {
  compressed_ops_.fetch_add(ops, std::memory_order_relaxed);
  raw_bytes_.fetch_add(stats.raw_bytes, std::memory_order_relaxed);
  wire_bytes_.fetch_add(stats.wire_bytes, std::memory_order_relaxed);
}

absl::Status ClusterJob::Execute(const ClusterOp& op, uint64_t seq, const RunSettings& settings,
                                 Lane& lane) {
  const config::Tuning tuning = options_.tuning->Snapshot();
  const auto dtype = static_cast<wire::DataType>(op.sig.dtype);
  const auto collective = static_cast<wire::Collective>(op.sig.collective);
  if (op.parts.empty() && !op.splits_error.empty()) {
    // Failed here before it ran (its ranks disagree); a coordinator that
    // runs it anyway is of an older version.
    return absl::InvalidArgumentError(absl::StrCat("operation '", op.name,
                                                   "' mismatched across ranks: ", op.splits_error));
  }
  if (collective == wire::Collective::kBarrier) return absl::OkStatus();  // Run means all arrived
  const size_t es = op.sig.element_bytes();
  const int world = options_.world_size;
  const size_t block = op.sig.count * es;
  InterNodeContext ctx = ContextFor(seq, op.deadline, settings, lane);
  if (op.staged) return ExecuteStaged(op, ctx, seq, settings);

  // The node's buffer is the first local rank's receive buffer where it is
  // big enough (it lives in that rank's shared memory): no staging copy,
  // and that rank needs no fan-out copy either.
  const ClusterOp::Part& first = op.parts.front();
  std::vector<const void*> inputs;
  for (const auto& p : op.parts) inputs.push_back(p.send);
  if (op.early) {
    // An allreduce reduced before the Run came (Submit) into the node
    // buffer, the first rank's recv: the only input left.
    if (absl::Status s = op.early->Wait(); !s.ok()) return s;
    inputs.assign(1, first.recv);
  }
  switch (collective) {
    case wire::Collective::kAllreduce:
    case wire::Collective::kReduceScatter: {
      // Sum (for avg) or reduce locally, across nodes, divide once, fan out.
      const auto requested = static_cast<wire::ReduceOp>(op.sig.reduce_op);
      const auto wire_op = wire::CombiningOp(requested);
      const bool all = collective == wire::Collective::kAllreduce;
      const size_t count = all ? op.sig.count : op.sig.count * static_cast<size_t>(world);
      auto codec = CodecNamed(settings.codec);
      if (!codec.ok()) return codec.status();
      const bool feedback = *codec != nullptr && KeepsFeedback(op, count, tuning);
      uint8_t* node = all ? first.recv : lane.staging.Get(count * es + 1);
      // One local rank, send and receive buffers apart, uncompressed: the
      // inter-node allreduce reads the rank's input where it needs it and
      // writes the node buffer, instead of a copy of the input first.
      const void* input = nullptr;
      if (inputs.size() == 1 && *codec == nullptr) {
        input = inputs[0];
      } else if (!(inputs.size() == 1 && inputs[0] == node)) {
        ReduceLocal(dtype, wire_op, inputs, node, count);
      }
      absl::Status s;
      if (!all && *codec == nullptr) {
        // Uncompressed reduce_scatter: each node ends with its own ranks'
        // blocks only, half the bytes of an allreduce (every node takes this
        // path alike, in the same segments as a node with GPU buffers: it
        // depends on the run's settings only).
        const size_t per =
            settings.segment_bytes == 0 ? count : SegmentElements(settings.segment_bytes, count, es);
        for (size_t k = 0, at = 0; s.ok() && at < count; ++k, at += per) {
          s = CarryReduceScatter(ctx, seq, settings.segment_bytes == 0 ? -1 : static_cast<int>(k),
                                 dtype, wire_op, node + at * es, at, std::min(per, count - at),
                                 op.sig.count,
                                 input ? static_cast<const uint8_t*>(input) + at * es : nullptr);
        }
        if (!s.ok()) return s;
        for (const auto& p : op.parts) {
          uint8_t* mine = node + static_cast<size_t>(p.rank) * block;
          if (requested == wire::ReduceOp::kAvg) DivideInPlace(dtype, mine, op.sig.count, world);
          CopyBytes(p.recv, mine, block);
        }
        return absl::OkStatus();
      }
      if (settings.segment_bytes == 0 || count == 0) {
        s = CarryAllreduce(ctx, seq, -1, settings, *codec, feedback, op.name, dtype, wire_op, node,
                           count, input);
      } else {
        // Segments, as a node with GPU buffers runs them (ExecuteStaged).
        const size_t per = SegmentElements(settings.segment_bytes, count, es);
        for (size_t k = 0, at = 0; s.ok() && at < count; ++k, at += per) {
          s = CarryAllreduce(ctx, seq, static_cast<int>(k), settings, *codec, feedback, op.name,
                             dtype, wire_op, node + at * es, std::min(per, count - at),
                             input ? static_cast<const uint8_t*>(input) + at * es : nullptr);
        }
      }
      if (!s.ok()) return s;
      if (requested == wire::ReduceOp::kAvg) DivideInPlace(dtype, node, count, world);
      if (all) {
        FanOut(op, node, block);
      } else {
        for (const auto& p : op.parts) {
          CopyBytes(p.recv, node + static_cast<size_t>(p.rank) * block, block);
        }
      }
      return absl::OkStatus();
    }
    case wire::Collective::kAllgather: {
      const size_t all = block * static_cast<size_t>(world);
      uint8_t* node = first.recv;
      for (const auto& p : op.parts) {
        uint8_t* at = node + p.rank * block;
        if (p.send != at) CopyBytes(at, p.send, block);
      }
      absl::Status s = MoveInSegments(ctx, seq, settings, op, node);
      if (!s.ok()) return s;
      FanOut(op, node, all);
      return absl::OkStatus();
    }
    case wire::Collective::kBroadcast: {
      uint8_t* node = first.recv;
      for (const auto& p : op.parts) {
        if (p.rank == op.sig.root && p.send != node) CopyBytes(node, p.send, block);
      }
      absl::Status s = MoveInSegments(ctx, seq, settings, op, node);
      if (!s.ok()) return s;
      FanOut(op, node, block);
      return absl::OkStatus();
    }
    case wire::Collective::kAlltoall:
    case wire::Collective::kAlltoallv: {
      // Pairs on this node are copied here, while the others go straight
      // between the ranks' buffers and the network.
      std::vector<AlltoallBuffers> ranks(static_cast<size_t>(world));
      std::vector<RankPairs> pairs(static_cast<size_t>(world));
      std::vector<bool> local(static_cast<size_t>(world), false);
      for (const auto& p : op.parts) {
        const size_t r = static_cast<size_t>(p.rank);
        auto got = PairsOf(op, p, static_cast<size_t>(world));
        if (!got.ok()) return got.status();
        pairs[r] = *std::move(got);
        AlltoallBuffers& b = ranks[r];
        b.send = p.send;
        b.recv = p.recv;
        for (size_t j = 0; j < static_cast<size_t>(world); ++j) {
          b.send_bytes.push_back(pairs[r].send[j] * es);
          b.recv_bytes.push_back(pairs[r].recv[j] * es);
        }
        local[r] = true;
      }
      auto segments = AlltoallSegmentsOf(settings);
      if (!segments.ok()) return segments.status();
      if (*segments == 0) {
        // While the first chunks travel.
        return AlltoallPairwise(ctx, node_of_rank_, ranks, [&] { CopyLocalPairs(ranks, local); });
      }
      // Segments, as a node with GPU buffers runs them (AlltoallStaged):
      // segment k carries part k of every rank pair's piece. The pairs on
      // this node go whole, while the first segment travels.
      absl::Status s;
      for (uint64_t k = 0; s.ok() && k < *segments; ++k) {
        std::vector<AlltoallBuffers> pieces(static_cast<size_t>(world));
        bool any = false;
        for (const auto& p : op.parts) {
          const size_t r = static_cast<size_t>(p.rank);
          pieces[r] = SegmentPieces(pairs[r], *segments, k, es);
          pieces[r].send = p.send;
          pieces[r].recv = p.recv;
          for (size_t j = 0; j < static_cast<size_t>(world); ++j) {
            any = any || pieces[r].send_bytes[j] > 0 || pieces[r].recv_bytes[j] > 0;
          }
        }
        // Empty for this node: so are the other nodes' pieces for and from
        // it (and, in segment 0, its own pairs).
        if (!any) continue;
        InterNodeContext segment = ctx;
        segment.tag_base = SegmentTagBase(seq, k);
        s = AlltoallPairwise(segment, node_of_rank_, pieces, [&, k] {
          if (k == 0) CopyLocalPairs(ranks, local);
        });
      }
      return s;
    }
    case wire::Collective::kBarrier:
      break;
  }
  return absl::OkStatus();
}

}  // namespace ciuic::daemon
