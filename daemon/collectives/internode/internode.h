// Inter-node collective algorithms: what runs between the daemons of a job
// once the node-local phase has left one buffer per node.
//
// Each function is blocking and is called by the daemon thread dedicated to
// a job's inter-node phase. Every node of the job calls the same functions
// for the same operations in the same order, with the same arguments except
// `data`'s contents (same count, dtype, op, blocks, root, and the same
// InterNodeContext values apart from `transport`, `deadline` and `scratch`):
// the chunking, the tags and the channel of every chunk are derived from
// them, so nodes that disagree see transfers whose sizes differ (an error) or
// that never match (the deadline).
//
// Results are bitwise identical on every node: each element is combined along
// exactly one path and copied from there (ring), or both partners of an
// exchange combine the same two values in the same order (recursive doubling:
// the lower node's value first; this matters for NaN payloads and -0/+0 ties
// in min/max). 16-bit floats are rounded after every combination between
// nodes (each node's buffer is already a rounded 16-bit value).
//
// Errors: a failed transfer, or the deadline, ends the operation with a
// status naming the node involved ("node 3"): the transport's code for a
// failed transfer, DEADLINE_EXCEEDED naming the node whose transfer was
// awaited. Before returning, every function waits until every transfer it
// posted has had its callback, so `data` and the scratch space may be reused
// at once. At the deadline it cancels what is still outstanding with
// Transport::FailPeer (which makes those peers fail for later operations
// too: a deadline is a job-level fault) and then waits for the callbacks the
// transport then guarantees.
//
// The steps, bytes on the wire and busbw formula of each algorithm are in
// ../README.md; the tag layout is in schedule.h.
#pragma once

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "ciuic/shm_layout.h"
#include "collectives/chunk_coder.h"
#include "collectives/internode/scratch.h"
#include "compression/codec.h"
#include "compression/error_feedback.h"
#include "transport/transport.h"

namespace ciuic::daemon {

struct InterNodeContext {
  Transport* transport;  // peers are the job's nodes; transport->self() is this node
  uint64_t tag_base;     // distinct per operation, low tag_bits bits are zero: ours to use
  uint64_t chunk_bytes;  // pipeline granularity (tunable live, e.g. 64K..64M); rounded
                         // down to whole elements (at least one), grown if needed so
                         // that the chunks of one step fit in the tag's chunk field
  int max_inflight;      // chunks in flight per direction and channel (values < 1 mean 1)
  std::chrono::steady_clock::time_point deadline;  // give up with DEADLINE_EXCEEDED
  ScratchBuffer* scratch;  // reusable receive space (reducing algorithms only)
  // While *yield > 0 (set by another thread: an operation of higher priority
  // runs beside this one), at most one send of this operation is in flight
  // per channel (the compressed allreduce: one in all), so the other's
  // chunks wait behind at most one of this one's per link.
  // Null: never yield.
  const std::atomic<int>* yield = nullptr;
  // Chunk i of a step travels on channel channel_table[i mod size] (each
  // entry < the transport's channels; cluster/channel_weights.h); empty:
  // on channel i mod channels. The compressed allreduce: chunk c of node
  // o's segment on channel_table[(c + o) mod size].
  std::vector<uint8_t> channel_table = {};
  // The low bits of the tag that are the algorithm's (16..24): fewer when
  // an algorithm runs as a phase of another (the rack-hierarchical one
  // gives each phase its own tags). The compressed allreduce needs all 24.
  int tag_bits = 24;
  // Node k's rack (0..N-1, the same on every node) when the operation goes
  // rack by rack (the caller's choice: ClusterJob sets it for runs whose
  // algorithm is kRack). ReduceScatter, Allgather and Broadcast below then
  // run their Racks forms, and Allreduce with kRack uses it (empty: one
  // rack). Empty: flat.
  std::vector<int> racks = {};
  // Node k's name (its daemon's node name), for error messages: "node 2
  // (gpu-07)". Empty: node indices alone.
  std::vector<std::string> node_names = {};
};

// A byte range of `data` that node `owner` holds before an allgather, or
// ends with after a reduce-scatter.
struct Block {
  size_t offset;
  size_t bytes;
  int owner;
};

enum class InterNodeAlgorithm { kAuto, kRing, kHalvingDoubling, kRack };

// Bandwidth-optimal ring: reduce-scatter then allgather, 2(N-1) steps, each
// step's segment pipelined in chunks over the transport's channels. Any
// count (segments may be uneven or empty). `op` must not be kAvg (sum, then
// DivideInPlace); INVALID_ARGUMENT otherwise. N == 1 returns at once.
struct CompressionStats {
  uint64_t raw_bytes = 0;   // payload bytes this node would have sent uncompressed
  uint64_t wire_bytes = 0;  // what it sent
};

// Sum-allreduce whose traffic between nodes is compressed with `codec`: a
// direct reduce-scatter (each segment encoded once, sent to its owner, which
// decodes and adds the contributions exactly, in node order) then an
// allgather of each owner's sum, encoded once. Two compressions per element
// whatever the node count; every node ends with the same bits. Pipelined in
// chunks of min(chunk_bytes, 1 MiB) raw bytes with max(max_inflight, N-1)
// chunks in flight per direction: a chunk is encoded while earlier ones
// travel and decoded as it arrives; the allgather of a chunk starts as soon
// as its sum is complete. With `feedback` (float32 only), what each
// compression dropped is kept in one residual under `name`, indexed by
// element of the operation (an element's: what was dropped of this node's
// contribution to it or, in its own segment, of its sum), and added to the
// next operation of that name. `stats` (may be null) gets raw and wire
// bytes sent. Steps, bytes on the wire and error bounds: ../README.md;
// codecs: daemon/compression/README.md.
absl::Status AllreduceCompressed(const InterNodeContext& ctx, const Codec& codec,
                                 ErrorFeedback* feedback, const std::string& name,
                                 wire::DataType dtype, void* data, size_t count,
                                 CompressionStats* stats);

// Elements [offset, offset + count) of a fused buffer belong to operation
// `name`: its error feedback residual is `name`, indexed by element of that
// operation, whatever it is packed with. An empty name:
// no error feedback for those elements (an unnamed operation).
struct FeedbackPiece {
  std::string name;
  size_t offset;
  size_t count;
};

// AllreduceCompressed over several operations packed in one buffer (tensor
// fusion): `pieces` cover [0, count) in order, without gaps. Each piece
// keeps its own residuals (as if it had run alone, so an operation fused in
// one step and alone or fused differently in the next keeps them); chunks,
// segments and top-k's selection are over the packed buffer (see
// ../README.md). The single-operation form is this with one piece.
absl::Status AllreduceCompressedPieces(const InterNodeContext& ctx, const Codec& codec,
                                       ErrorFeedback* feedback,
                                       const std::vector<FeedbackPiece>& pieces,
                                       wire::DataType dtype, void* data, size_t count,
                                       CompressionStats* stats);

// AllreduceCompressed on data the CPU must not touch (a node buffer in GPU
// memory): `coder` does every encode and decode where the data lives, with
// its own error feedback (chunk_coder.h); `codec` is the same codec's CPU
// form, for the sizes of the messages. Same messages on the wire, so nodes
// with a coder and nodes without one interoperate.
absl::Status AllreduceCompressedWith(const InterNodeContext& ctx, const Codec& codec,
                                     ChunkCoder& coder, wire::DataType dtype, void* data,
                                     size_t count, CompressionStats* stats);

// `input` (null or `data`: in place) is read and never written: the ring
// then reads each segment's local contribution from `input` where it folds it
// in and writes the results into `data`, which saves copying the input over
// first (one pass over the buffer: what a node with a single local rank whose
// send and receive buffers differ would otherwise pay). Same bits either way.
absl::Status AllreduceRing(const InterNodeContext& ctx, wire::DataType dtype, wire::ReduceOp op,
                           void* data, size_t count, const void* input = nullptr);

// Latency-oriented recursive doubling: ceil(log2 N) exchanges of the whole
// buffer (pipelined in chunks), plus, when N is not a power of two, one fold
// step before (the extra nodes hand their buffer to a partner) and one after
// (the partner returns the result). Same contract as AllreduceRing.
absl::Status AllreduceHalvingDoubling(const InterNodeContext& ctx, wire::DataType dtype,
                                      wire::ReduceOp op, void* data, size_t count);

// Rack-hierarchical: in each rack (racks[k]: node k's rack, 0..N-1) the
// nodes reduce into the rack's leader, its lowest node, along a pipelined
// chain; the leaders run a ring allreduce; each leader broadcasts the
// result in its rack. Each inter-rack link carries one stream per rack
// pair. Same contract as AllreduceRing; needs 18 tag bits (each phase gets
// two of its own).
absl::Status AllreduceRacks(const InterNodeContext& ctx, const std::vector<int>& racks,
                            wire::DataType dtype, wire::ReduceOp op, void* data, size_t count,
                            const void* input = nullptr);

// Rack-hierarchical reduce-scatter (same contract as ReduceScatterRing):
// each rack reduces every block into its leader (a pipelined chain), the
// leaders reduce-scatter the blocks by rack, each leader hands its rack's
// blocks to the rack (a ring allgather inside it).
absl::Status ReduceScatterRacks(const InterNodeContext& ctx, const std::vector<int>& racks,
                                wire::DataType dtype, wire::ReduceOp op, void* data,
                                const std::vector<Block>& blocks, const void* input = nullptr);

// Rack-hierarchical allgather (same contract as AllgatherRing): a ring
// allgather of the rack's blocks inside each rack, the leaders' ring
// allgather of every rack's blocks, then the other racks' blocks from each
// leader to its rack.
absl::Status AllgatherRacks(const InterNodeContext& ctx, const std::vector<int>& racks, void* data,
                            const std::vector<Block>& blocks);

// Rack-hierarchical broadcast (same contract as BroadcastPipeline): the
// root leads its rack; it broadcasts to the other racks' leaders, and each
// leader to its rack.
absl::Status BroadcastRacks(const InterNodeContext& ctx, const std::vector<int>& racks, void* data,
                            size_t bytes, int root);

// ReduceScatterRing, AllgatherRing, BroadcastPipeline, or their Racks forms
// when ctx.racks is set.
absl::Status ReduceScatter(const InterNodeContext& ctx, wire::DataType dtype, wire::ReduceOp op,
                           void* data, const std::vector<Block>& blocks,
                           const void* input = nullptr);
absl::Status Allgather(const InterNodeContext& ctx, void* data, const std::vector<Block>& blocks);
absl::Status Broadcast(const InterNodeContext& ctx, void* data, size_t bytes, int root);

// What the model below predicts, in seconds.
struct RackCost {
  double flat_s = 0;  // the flat algorithm over all nodes, in node order
  double rack_s = 0;  // its Racks form
};

enum class RackCollective { kAllreduce, kReduceScatter, kAllgather, kBroadcast };

// The most nodes a job may have for its nodes to measure and report their
// rates to each other (N*N numbers at the coordinator): larger jobs run
// flat under auto (algorithm: rack still runs rack by rack).
inline constexpr int kMaxRackModelNodes = 1024;

// The cost model that chooses between a flat algorithm (the ring; for a
// broadcast the chain from `root`) and its Racks form for `bytes` (the
// whole buffer: every block of a reduce-scatter or allgather):
// rates[a][b] is the rate (bytes per second) node a's sends to node b have
// reached (0: not measured; an empty row: node a reported none). Inside a rack the slowest measured pair's rate
// counts, between racks the slowest inter-rack pair's, and flat edges
// crossing the same rack pair in the same direction share its link.
// Nullopt when it cannot tell or there is nothing to gain: fewer than 2
// racks, no rack of 2 nodes, or no rate measured inside a rack or between
// racks. Terms in ../README.md, "Racks".
std::optional<RackCost> ModelRacks(RackCollective collective, const std::vector<int>& racks,
                                   const std::vector<std::vector<double>>& rates, uint64_t bytes,
                                   int root = 0);

// kRing, kHalvingDoubling or kRack (with ctx.racks) as asked; kAuto chooses
// with ChooseAllreduceAlgorithm.
// `input` as for AllreduceRing (the other algorithms copy it into `data` first).
absl::Status Allreduce(const InterNodeContext& ctx, InterNodeAlgorithm algo, wire::DataType dtype,
                       wire::ReduceOp op, void* data, size_t count, const void* input = nullptr);

// kAuto's rule (never returns kAuto): halving-doubling for at most 1 MiB when
// an alpha-beta model with alpha*beta = 64 KiB, plus the reductions' cost,
// says it is faster than the ring, the ring otherwise. See ../README.md.
InterNodeAlgorithm ChooseAllreduceAlgorithm(int num_nodes, size_t bytes);

// Whether `algo` (kRing or kHalvingDoubling) on `num_nodes` nodes gives every
// element a result that depends on the nodes' values alone, never on where
// the element lies in the buffer, so that packing allreduces into one
// (fusion) changes no bit: halving-doubling always, the ring on two nodes
// (allreduce_ring.cc).
bool OffsetIndependent(int num_nodes, InterNodeAlgorithm algo);

// Reduce-scatter: node k ends with the blocks whose owner is k reduced over
// every node's `data` (the bytes outside its own blocks are left partial;
// bytes in no block are not reduced). Blocks must be whole elements, must
// not overlap and must lie inside `data`; a node may own any number of them
// (its local ranks' blocks). Ring order, N-1 steps, pipelined in chunks:
// each node sends (N-1)/N of the blocks' bytes, half of an allreduce's. Two
// nodes reduce in node order, as AllreduceRing does. `input` as for
// AllreduceRing (read, never written; the results go to `data`).
absl::Status ReduceScatterRing(const InterNodeContext& ctx, wire::DataType dtype,
                               wire::ReduceOp op, void* data, const std::vector<Block>& blocks,
                               const void* input = nullptr);

// Every node ends up with every block. Blocks may be empty and a node may own
// any number of them; blocks must not overlap and must lie inside `data`
// (not checked: `data`'s size is the caller's). Ring order, pipelined in
// chunks; a block's bytes travel only as that block (no packing).
absl::Status AllgatherRing(const InterNodeContext& ctx, void* data,
                           const std::vector<Block>& blocks);

// One rank's buffers for AlltoallPairwise: its blocks for (send) and from
// (recv) each rank of the job lie back to back in rank order, of the given
// sizes in bytes (alltoall: all equal), or where the offsets say (one piece
// of each block of an alltoall(v)'s buffers: a segment).
struct AlltoallBuffers {
  const uint8_t* send = nullptr;
  uint8_t* recv = nullptr;
  std::vector<uint64_t> send_bytes;  // one per rank of the job
  std::vector<uint64_t> recv_bytes;
  // Empty: back to back; else one per rank of the job, where its block
  // starts (the blocks received must not overlap).
  std::vector<uint64_t> send_offsets;
  std::vector<uint64_t> recv_offsets;

  // Where the block for / from rank j starts.
  uint64_t SendAt(size_t j) const { return At(send_bytes, send_offsets, j); }
  uint64_t RecvAt(size_t j) const { return At(recv_bytes, recv_offsets, j); }

 private:
  static uint64_t At(const std::vector<uint64_t>& bytes, const std::vector<uint64_t>& offsets,
                     size_t j) {
    if (!offsets.empty()) return offsets[j];
    uint64_t at = 0;
    for (size_t k = 0; k < j; ++k) at += bytes[k];
    return at;
  }
};

// Alltoall(v) of the job's ranks between nodes: rank a's block for rank b
// lands in rank b's block from rank a, for every pair of ranks on different
// nodes; pairs on one node are the caller's. node_of_rank[r] is rank r's
// node; `ranks` has one entry per rank, set for this node's ranks, ignored
// for the others. Rank a's send_bytes[b] must equal rank b's recv_bytes[a]
// (the caller checks; sizes that disagree fail the transfer or land
// misplaced). N-1 steps, step s exchanging with nodes r+s+1 and r-s-1,
// straight between the ranks' buffers; each node sends its ranks' blocks
// for other nodes once, in chunks of chunk_bytes. `meanwhile` (may be null:
// the caller's copies between its own ranks, say) runs on the calling thread
// while the first transfers travel, and in every case before it returns; it
// must not touch the blocks that cross nodes.
absl::Status AlltoallPairwise(const InterNodeContext& ctx, const std::vector<int>& node_of_rank,
                              const std::vector<AlltoallBuffers>& ranks,
                              const std::function<void()>& meanwhile = nullptr);

// `bytes` of `data` from node `root` to all. A message that fits in one chunk
// goes down a binomial tree (ceil(log2 N) hops); a longer one down a chain
// root -> root+1 -> ... in chunks, each node forwarding a chunk as soon as it
// has it (N-1 + chunks-1 chunk times, every link used once).
absl::Status BroadcastPipeline(const InterNodeContext& ctx, void* data, size_t bytes, int root);

// avg's final division, with the local reduction's semantics (reduce.h):
// floats divide in their accumulator type (float32 for float16/bfloat16, then
// rounded once to nearest even); integers divide the value widened to
// int64/uint64, truncating toward zero. Requires divisor >= 1.
void DivideInPlace(wire::DataType dtype, void* data, size_t count, uint64_t divisor);

}  // namespace ciuic::daemon
