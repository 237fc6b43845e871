// The local phase of a collective: all ranks' buffers are on this node and
// mapped in the daemon, so the daemon reads every input straight from the
// ranks' shared memory and writes every output there (zero copy).
//
// An operation is cut into independent chunks of about chunk_bytes so that
// several worker threads can share it and a small high-priority operation
// waits for at most one chunk of a large one. Within a chunk, work goes in
// cache-sized blocks: the reduction of a block lands in rank 0's output and
// is copied to the other ranks' outputs while it is still in cache.
//
// Bytes moved per rank for an operation of S bytes per rank and W ranks:
//   allreduce       reads W*S, writes W*S         (algbw S/t, busbw 2(W-1)/W)
//   reduce_scatter  reads W*S, writes S           (S = full send buffer)
//   allgather       reads S,   writes W*S         (S = full recv buffer)
//   broadcast       reads S,   writes (W-1)*S
//
// Thread-safety: RunChunk may be called concurrently for different chunks.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <vector>

#include "absl/status/status.h"
#include "collectives/op.h"

namespace ciuic::daemon {

class LocalCollective {
 public:
  // send[r] / recv[r] are rank r's buffers (nullptr where ValidatedOp has
  // none); they stay valid until the last chunk has run. An allreduce may
  // have fewer recv buffers than send buffers (at least one): it reduces
  // every send buffer into recv[0] and copies the result to the others (a
  // multi-node job's local phase reduces its ranks into one node buffer).
  // A broadcast's send needs only the root's entry. alltoallv:
  // send_counts[r] is rank r's (elements for each rank; the receivers'
  // counts agree, AlltoallvMismatch), empty for every other collective.
  LocalCollective(const OpSignature& sig, std::vector<const uint8_t*> send,
                  std::vector<uint8_t*> recv, uint64_t chunk_bytes,
                  std::vector<std::vector<uint64_t>> send_counts = {});

  size_t num_chunks() const { return num_chunks_; }
  void RunChunk(size_t index) const;
  // Payload bytes per rank, as nccl-tests counts them for algbw.
  uint64_t payload_bytes() const;

 private:
  OpSignature sig_;
  std::vector<const uint8_t*> send_;
  std::vector<uint8_t*> recv_;
  int ranks_;
  uint64_t chunk_elems_ = 1;
  size_t chunks_per_block_ = 1;  // chunks per rank block (reduce_scatter, allgather)
  size_t num_chunks_ = 0;
  // alltoallv: each chunk's pair and elements, in bytes.
  struct Piece {
    const uint8_t* from;
    uint8_t* to;
    uint64_t bytes;
  };
  std::vector<Piece> pieces_;
  uint64_t v_payload_bytes_ = 0;
};

// Runs `body(i)` for every i in [0, n), on the caller and on whichever
// helper threads join (WorkerPool::ParallelFor); returns once all ran.
using ParallelChunks = std::function<void(size_t n, const std::function<void(size_t)>& body)>;

// Runs every chunk of `collective`: through `parallel` from two chunks up
// (and when it is set), else on the caller. The one way a multi-node job's
// host local phase runs (ClusterJob::ReduceLocal, FanOut); a single-node
// job's chunks go to the worker pool one task each, with the operation's
// priority (Engine::LaunchOnLoop).
void RunChunks(const LocalCollective& collective, const ParallelChunks& parallel);

// alltoallv: OK when every send_counts[i][j] equals recv_counts[j][i] among
// `ranks` (indices into both), else INVALID_ARGUMENT naming the first pair
// that disagrees.
absl::Status AlltoallvMismatch(const std::vector<int>& ranks,
                               const std::vector<const std::vector<uint64_t>*>& send_counts,
                               const std::vector<const std::vector<uint64_t>*>& recv_counts);

}  // namespace ciuic::daemon
