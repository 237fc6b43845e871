// ClusterJob's staged (device) executor: operations on GPU buffers whose
// local phase ran on the device into a node buffer there; the node buffer
// crosses the network in segments through two pinned host slots, the next
// segment's copy overlapping this one's transfer (run_plan.h,
// PipelineSegments), and its result goes back to the device.
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

absl::Status ClusterJob::StagedFetch(StagedNodeBuffer& device, int slot, size_t slot_offset,
                                     size_t offset, size_t bytes) {
  staged_bytes_.fetch_add(bytes, std::memory_order_relaxed);
  return device.Fetch(slot, slot_offset, offset, bytes);
}

absl::Status ClusterJob::StagedStore(StagedNodeBuffer& device, int slot, size_t slot_offset,
                                     size_t offset, size_t bytes) {
  staged_bytes_.fetch_add(bytes, std::memory_order_relaxed);
  return device.Store(slot, slot_offset, offset, bytes);
}

absl::Status ClusterJob::CarryAllreduce(InterNodeContext ctx, uint64_t seq, int segment,
                                        const RunSettings& settings, const Codec* codec,
                                        bool feedback, const std::string& name,
                                        wire::DataType dtype, wire::ReduceOp op, void* data,
                                        size_t count, const void* input) {
  if (segment >= 0) ctx.tag_base = SegmentTagBase(seq, static_cast<size_t>(segment));
  if (codec == nullptr) {
    return Allreduce(ctx, InterNodeAlgorithmFor(settings.algorithm), dtype, op, data, count, input);
  }
  CompressionStats stats;
  absl::Status s = AllreduceCompressed(ctx, *codec, feedback ? &feedback_ : nullptr, name, dtype,
                                       data, count, &stats);
  CountCompressed(1, stats);
  return s;
}

std::vector<std::pair<size_t, size_t>> NodeParts(const std::vector<int>& node_of_rank, int node,
                                                 size_t at, size_t n, size_t rank_count) {
  std::vector<std::pair<size_t, size_t>> parts;
  if (rank_count == 0) return parts;
  for (int r = 0; r < static_cast<int>(node_of_rank.size()); ++r) {
    if (node_of_rank[r] != node) continue;
    const size_t from = std::max(at, static_cast<size_t>(r) * rank_count);
    const size_t to = std::min(at + n, static_cast<size_t>(r + 1) * rank_count);
    if (from < to) parts.emplace_back(from - at, to - from);
  }
  return parts;
}

absl::Status ClusterJob::CarryReduceScatter(InterNodeContext ctx, uint64_t seq, int segment,
                                            wire::DataType dtype, wire::ReduceOp op,
                                            uint8_t* data, size_t at, size_t n,
                                            size_t rank_count, const void* input) {
  if (segment >= 0) ctx.tag_base = SegmentTagBase(seq, static_cast<size_t>(segment));
  const size_t es = wire::DataTypeSize(static_cast<uint32_t>(dtype));
  std::vector<Block> blocks;
  for (int node = 0; node < ctx.transport->num_peers(); ++node) {
    for (const auto& [offset, elements] : NodeParts(node_of_rank_, node, at, n, rank_count)) {
      blocks.push_back(Block{offset * es, elements * es, node});
    }
  }
  return ReduceScatter(ctx, dtype, op, data, blocks, input);
}

absl::Status ClusterJob::ExecuteStaged(const ClusterOp& op, const InterNodeContext& ctx,
                                       uint64_t seq, const RunSettings& settings) {
  staged_ops_.fetch_add(1, std::memory_order_relaxed);
  absl::Status s;
  switch (static_cast<wire::Collective>(op.sig.collective)) {
    case wire::Collective::kAllreduce:
    case wire::Collective::kReduceScatter: {
      auto codec = CodecNamed(settings.codec);
      if (!codec.ok()) return codec.status();
      s = ReduceStaged(op, ctx, seq, settings, *codec);
      break;
    }
    case wire::Collective::kAllgather:
    case wire::Collective::kBroadcast:
      s = MoveStaged(op, ctx, seq, settings);
      break;
    case wire::Collective::kAlltoall:
    case wire::Collective::kAlltoallv:
      s = AlltoallStaged(op, ctx, seq, settings);
      break;
    case wire::Collective::kBarrier:
      break;
  }
  // The ranks hear of the end once nothing is left in flight on the device.
  if (!s.ok()) op.staged->Drain().IgnoreError();
  return s;
}

absl::Status ClusterJob::MoveSegment(InterNodeContext ctx, uint64_t seq, int segment,
                                     const ClusterOp& op, uint8_t* data, size_t stride,
                                     size_t first, size_t bytes) {
  if (segment >= 0) ctx.tag_base = SegmentTagBase(seq, static_cast<size_t>(segment));
  if (op.sig.collective != static_cast<uint32_t>(wire::Collective::kAllgather)) {
    return Broadcast(ctx, data + first, bytes, node_of_rank_[op.sig.root]);
  }
  std::vector<Block> blocks;
  for (int r = 0; r < options_.world_size; ++r) {
    blocks.push_back(Block{static_cast<size_t>(r) * stride + first, bytes, node_of_rank_[r]});
  }
  return Allgather(ctx, data, blocks);
}

absl::Status ClusterJob::MoveStaged(const ClusterOp& op, const InterNodeContext& ctx, uint64_t seq,
                                    const RunSettings& settings) {
  StagedNodeBuffer& device = *op.staged;
  const size_t es = op.sig.element_bytes();
  const size_t count = op.sig.count;  // elements of each rank's block
  const size_t block = count * es;
  const bool gather = op.sig.collective == static_cast<uint32_t>(wire::Collective::kAllgather);
  const int world = options_.world_size;
  const bool root_here = !gather && node_of_rank_[op.sig.root] == self_;
  if (absl::Status s = device.PlaceInputs(); !s.ok()) return s;
  if (count == 0) return device.Finish();
  // Segment k carries elements [k * per, ...) of every rank's block (a
  // broadcast: of the one block); in a slot the ranks' pieces lie back to
  // back.
  const bool segmented = settings.segment_bytes > 0;
  const size_t per = MoveSegmentElements(settings.segment_bytes, gather, count, es, world);
  const size_t segments = (count + per - 1) / per;
  const size_t pieces = gather ? static_cast<size_t>(world) : 1;
  auto range = [&](size_t k) { return std::make_pair(k * per, std::min(per, count - k * per)); };
  // What this node sends of segment k: its ranks' pieces (the root's node:
  // the piece), fetched into the slot; what it receives, stored from it.
  auto fetch = [&](int sl, size_t k) -> absl::Status {
    const auto [at, n] = range(k);
    if (!gather) return root_here ? StagedFetch(device, sl, 0, at * es, n * es) : absl::OkStatus();
    for (const auto& p : op.parts) {
      const size_t r = static_cast<size_t>(p.rank);
      if (absl::Status s = StagedFetch(device, sl, r * n * es, r * block + at * es, n * es); !s.ok()) {
        return s;
      }
    }
    return absl::OkStatus();
  };
  auto store = [&](int sl, size_t k) -> absl::Status {
    const auto [at, n] = range(k);
    if (!gather) return root_here ? absl::OkStatus() : StagedStore(device, sl, 0, at * es, n * es);
    for (int r = 0; r < world; ++r) {
      if (node_of_rank_[r] == self_) continue;
      const size_t rr = static_cast<size_t>(r);
      if (absl::Status s = StagedStore(device, sl, rr * n * es, rr * block + at * es, n * es); !s.ok()) {
        return s;
      }
    }
    return absl::OkStatus();
  };
  auto carry = [&](uint8_t* slot, size_t k) {
    const size_t n = range(k).second;
    return MoveSegment(ctx, seq, segmented ? static_cast<int>(k) : -1, op, slot, n * es, 0,
                       n * es);
  };
  absl::Status s = PipelineSegments(device, segments, pieces * per * es, fetch, carry, store);
  return s.ok() ? device.Finish() : s;
}

absl::Status ClusterJob::AlltoallStaged(const ClusterOp& op, const InterNodeContext& ctx,
                                         uint64_t seq, const RunSettings& settings) {
  StagedNodeBuffer& device = *op.staged;
  const size_t world = static_cast<size_t>(options_.world_size);
  const size_t es = op.sig.element_bytes();
  // The node buffer (staged_buffer.h): the local ranks' send buffers back
  // to back in rank order, then (alltoallv) their receive buffers likewise;
  // an alltoall receives over what it sent, segment by segment, each
  // segment's pieces fetched before the received ones are stored.
  const std::vector<const ClusterOp::Part*> parts = PartsInRankOrder(op);
  std::vector<bool> local(world, false);
  std::vector<RankPairs> pairs;
  std::vector<uint64_t> send_base, recv_base;  // each rank's, in the node buffer (elements)
  uint64_t sent = 0, got = 0;
  for (const ClusterOp::Part* p : parts) {
    local[static_cast<size_t>(p->rank)] = true;
    auto r = PairsOf(op, *p, world);
    if (!r.ok()) return r.status();
    send_base.push_back(sent);
    recv_base.push_back(got);
    sent += r->sent;
    got += r->got;
    pairs.push_back(*std::move(r));
  }
  const bool v_splits = op.sig.collective == static_cast<uint32_t>(wire::Collective::kAlltoallv);
  for (uint64_t& at : recv_base) at += v_splits ? sent : 0;
  auto announced = AlltoallSegmentsOf(settings);
  if (!announced.ok()) return announced.status();
  const uint64_t segments = std::max<uint64_t>(*announced, 1);  // none announced: one
  // Segment k's pieces: in a slot they lie back to back, rank order then
  // peer order, what the node's ranks send first, what they receive after
  // `send_half` bytes (segment 0's are the largest).
  uint64_t send_half = 0, recv_half = 0;
  for (const RankPairs& r : pairs) {
    const AlltoallBuffers b = SegmentPieces(r, segments, 0, es);
    for (size_t j = 0; j < world; ++j) {
      send_half += b.send_bytes[j];
      recv_half += b.recv_bytes[j];
    }
  }
  if (absl::Status s = device.PlaceInputs(); !s.ok()) return s;
  // Copies between the node buffer and slot `sl` of segment k's pieces.
  auto copy = [&](int sl, uint64_t k, bool fetch) {
    size_t in_slot = fetch ? 0 : send_half;
    for (size_t i = 0; i < pairs.size(); ++i) {
      AlltoallBuffers b = SegmentPieces(pairs[i], segments, k, es);
      const uint64_t base = (fetch ? send_base[i] : recv_base[i]) * es;
      std::vector<uint64_t>& offsets = fetch ? b.send_offsets : b.recv_offsets;
      for (uint64_t& o : offsets) o += base;
      absl::Status s = CopyPieces(device, fetch, sl, in_slot, offsets,
                                  fetch ? b.send_bytes : b.recv_bytes);
      if (!s.ok()) return s;
      for (uint64_t bytes : fetch ? b.send_bytes : b.recv_bytes) in_slot += bytes;
    }
    return absl::OkStatus();
  };
  auto fetch = [&](int sl, size_t k) { return copy(sl, k, true); };
  auto store = [&](int sl, size_t k) { return copy(sl, k, false); };
  // The exchange reads the slot's first part and fills its second; the
  // next fetch into the slot comes after it has returned.
  auto carry = [&](uint8_t* slot, size_t k) {
    std::vector<AlltoallBuffers> in_slot(world);
    uint8_t* send_at = slot;
    uint8_t* recv_at = slot + send_half;
    for (size_t i = 0; i < pairs.size(); ++i) {
      AlltoallBuffers b = SegmentPieces(pairs[i], segments, k, es);
      b.send_offsets.clear();  // back to back in the slot
      b.recv_offsets.clear();
      b.send = send_at;
      b.recv = recv_at;
      for (size_t j = 0; j < world; ++j) {
        send_at += b.send_bytes[j];
        recv_at += b.recv_bytes[j];
      }
      in_slot[static_cast<size_t>(parts[i]->rank)] = std::move(b);
    }
    InterNodeContext segment = ctx;
    if (*announced > 0) segment.tag_base = SegmentTagBase(seq, k);
    return AlltoallPairwise(segment, node_of_rank_, in_slot,
                            [&] { CopyLocalPairs(in_slot, local); });
  };
  // Nothing to send or receive: no segment (the other nodes' pieces for
  // and from this one are empty too).
  const size_t run = send_half + recv_half > 0 ? segments : 0;
  absl::Status s = PipelineSegments(device, run, send_half + recv_half, fetch, carry, store);
  return s.ok() ? device.Finish() : s;
}

absl::Status ClusterJob::CopyPieces(StagedNodeBuffer& device, bool fetch, int slot,
                                    size_t slot_offset, const std::vector<uint64_t>& offsets,
                                    const std::vector<uint64_t>& bytes) {
  for (size_t j = 0; j < bytes.size();) {
    const uint64_t n = bytes[j];
    if (n == 0) {
      ++j;
      continue;
    }
    // A run of pieces of one size one pitch apart: one 2-D copy.
    const uint64_t pitch =
        j + 1 < bytes.size() && offsets[j + 1] > offsets[j] ? offsets[j + 1] - offsets[j] : 0;
    size_t rows = 1;
    while (pitch >= n && j + rows < bytes.size() && bytes[j + rows] == n &&
           offsets[j + rows] == offsets[j] + rows * pitch) {
      ++rows;
    }
    absl::Status s;
    if (rows == 1) {
      s = fetch ? StagedFetch(device, slot, slot_offset, offsets[j], n)
                : StagedStore(device, slot, slot_offset, offsets[j], n);
    } else {
      staged_bytes_.fetch_add(rows * n, std::memory_order_relaxed);
      s = fetch ? device.FetchRows(slot, slot_offset, offsets[j], n, pitch, rows)
                : device.StoreRows(slot, slot_offset, offsets[j], n, pitch, rows);
    }
    if (!s.ok()) return s;
    slot_offset += rows * n;
    j += rows;
  }
  return absl::OkStatus();
}

absl::Status ClusterJob::ReduceStaged(const ClusterOp& op, const InterNodeContext& ctx,
                                      uint64_t seq, const RunSettings& settings,
                                      const Codec* codec) {
  StagedNodeBuffer& device = *op.staged;
  const auto dtype = static_cast<wire::DataType>(op.sig.dtype);
  const auto requested = static_cast<wire::ReduceOp>(op.sig.reduce_op);
  const auto wire_op = wire::CombiningOp(requested);
  const size_t es = op.sig.element_bytes();
  // A reduce_scatter reduces every rank's block (the node buffer holds
  // them all); each rank then takes its own.
  const size_t count = op.sig.collective == static_cast<uint32_t>(wire::Collective::kReduceScatter)
                           ? op.sig.count * static_cast<size_t>(options_.world_size)
                           : op.sig.count;
  const bool feedback = codec != nullptr && KeepsFeedback(op, count, options_.tuning->Snapshot());
  // Segments: [at, at + n) by element. Unsegmented (compressed, or a
  // coordinator that announced none): the whole buffer as one.
  const bool segmented = settings.segment_bytes > 0;
  const size_t per = segmented ? SegmentElements(settings.segment_bytes, count, es) : count;
  const size_t segments = count == 0 ? 0 : (count + per - 1) / per;
  auto range = [&](size_t k) { return std::make_pair(k * per, std::min(per, count - k * per)); };
  uint8_t* slot[2] = {nullptr, nullptr};
  if (absl::Status s = device.ReduceLocal(wire_op); !s.ok()) return s;
  if (codec != nullptr) {
    // Compressed where the buffer lives, when it can: only encoded bytes
    // leave it, and its residuals stay there.
    auto coder = device.Coder(settings.codec, feedback ? op.name : std::string());
    if (!coder.ok()) return coder.status();
    if (*coder != nullptr) {
      CompressionStats stats;
      absl::Status s =
          AllreduceCompressedWith(ctx, *codec, **coder, dtype, device.data(), count, &stats);
      CountCompressed(1, stats);
      {
        // Read under the lock: of two lanes, the later reading is kept.
        std::lock_guard<std::mutex> lock(device_feedback_mu_);
        device_feedback_ = device.FeedbackStats();
      }
      if (!s.ok()) return s;
      if (requested == wire::ReduceOp::kAvg) {
        if (s = device.Divide(options_.world_size); !s.ok()) return s;
      }
      return device.Finish();
    }
  }
  // Fetch the first two segments, one per slot; segment k + 2 is fetched
  // into k's slot right after k's store (the device queue orders them).
  for (size_t k = 0; k < std::min<size_t>(2, segments); ++k) {
    auto p = device.Slot(static_cast<int>(k), std::min(per, count) * es);
    if (!p.ok()) return p.status();
    slot[k] = *p;
    const auto [at, n] = range(k);
    if (absl::Status s = StagedFetch(device, static_cast<int>(k), 0, at * es, n * es); !s.ok()) {
      return s;
    }
  }
  // An uncompressed reduce_scatter: each segment reduce-scattered, and only
  // this node's ranks' parts of it go back to the device.
  const bool scatter =
      op.sig.collective == static_cast<uint32_t>(wire::Collective::kReduceScatter) &&
      codec == nullptr;
  for (size_t k = 0; k < segments; ++k) {
    const int sl = static_cast<int>(k % 2);
    const auto [at, n] = range(k);
    if (absl::Status s = device.Wait(sl); !s.ok()) return s;
    const int segment = segmented ? static_cast<int>(k) : -1;
    absl::Status s;
    if (scatter) {
      s = CarryReduceScatter(ctx, seq, segment, dtype, wire_op, slot[sl], at, n, op.sig.count,
                             nullptr);
      if (!s.ok()) return s;
      for (const auto& [offset, elements] : NodeParts(node_of_rank_, self_, at, n, op.sig.count)) {
        uint8_t* part = slot[sl] + offset * es;
        if (requested == wire::ReduceOp::kAvg) {
          DivideInPlace(dtype, part, elements, options_.world_size);
        }
        if (s = StagedStore(device, sl, offset * es, (at + offset) * es, elements * es); !s.ok()) {
          return s;
        }
      }
    } else {
      s = CarryAllreduce(ctx, seq, segment, settings, codec, feedback, op.name, dtype, wire_op,
                         slot[sl], n, nullptr);
      if (!s.ok()) return s;
      if (requested == wire::ReduceOp::kAvg) {
        DivideInPlace(dtype, slot[sl], n, options_.world_size);
      }
      if (s = StagedStore(device, sl, 0, at * es, n * es); !s.ok()) return s;
    }
    if (k + 2 < segments) {
      const auto [next_at, next_n] = range(k + 2);
      if (s = StagedFetch(device, sl, 0, next_at * es, next_n * es); !s.ok()) return s;
    }
  }
  return device.Finish();
}

absl::Status ClusterJob::MoveInSegments(const InterNodeContext& ctx, uint64_t seq,
                                        const RunSettings& settings, const ClusterOp& op,
                                        uint8_t* node) {
  const size_t es = op.sig.element_bytes();
  const size_t count = op.sig.count;
  const size_t block = count * es;
  if (settings.segment_bytes == 0 || count == 0) {
    return MoveSegment(ctx, seq, -1, op, node, block, 0, block);
  }
  // As a node with GPU buffers runs them (MoveStaged), on the node buffer.
  const bool gather = op.sig.collective == static_cast<uint32_t>(wire::Collective::kAllgather);
  const size_t per =
      MoveSegmentElements(settings.segment_bytes, gather, count, es, options_.world_size);
  for (size_t k = 0, at = 0; at < count; ++k, at += per) {
    const size_t n = std::min(per, count - at);
    absl::Status s = MoveSegment(ctx, seq, static_cast<int>(k), op, node, block, at * es, n * es);
    if (!s.ok()) return s;
  }
  return absl::OkStatus();
}

}  // namespace ciuic::daemon
