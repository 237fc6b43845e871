#include "collectives/local.h"

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "reduce/reduce.h"

namespace ciuic::daemon {

namespace {
// Block that stays in L2 between the reduction and its copies.
constexpr uint64_t kCacheBlockBytes = 64 * 1024;
}  // namespace

LocalCollective::LocalCollective(const OpSignature& sig, std::vector<const uint8_t*> send,
                                 std::vector<uint8_t*> recv, uint64_t chunk_bytes,
                                 std::vector<std::vector<uint64_t>> send_counts)
    : sig_(sig), send_(std::move(send)), recv_(std::move(recv)),
      ranks_(static_cast<int>(recv_.size())) {
  const auto c = static_cast<wire::Collective>(sig_.collective);
  if (c == wire::Collective::kAlltoallv) {
    // Pieces of at most chunk_bytes per (sender, receiver) pair; block j of
    // a send buffer and block i of a receive buffer follow the blocks before.
    const size_t w = static_cast<size_t>(ranks_);
    const uint64_t es = sig_.element_bytes();
    const uint64_t piece = std::max<uint64_t>(es, chunk_bytes / es * es);
    std::vector<uint64_t> recv_at(w, 0);
    for (size_t from = 0; from < w; ++from) {
      uint64_t send_at = 0;
      uint64_t sent = 0;
      for (size_t to = 0; to < w; ++to) {
        const uint64_t bytes = send_counts[from][to] * es;
        for (uint64_t done = 0; done < bytes; done += piece) {
          pieces_.push_back(Piece{send_[from] + send_at + done, recv_[to] + recv_at[to] + done,
                                  std::min(piece, bytes - done)});
        }
        send_at += bytes;
        recv_at[to] += bytes;
        sent += bytes;
      }
      v_payload_bytes_ = std::max(v_payload_bytes_, sent);
    }
    num_chunks_ = pieces_.size();
    return;
  }
  if (c == wire::Collective::kBarrier || sig_.count == 0) {
    num_chunks_ = 0;
    return;
  }
  const uint64_t es = sig_.element_bytes();
  chunk_elems_ = std::max<uint64_t>(1, chunk_bytes / es);
  chunks_per_block_ = (sig_.count + chunk_elems_ - 1) / chunk_elems_;
  switch (c) {
    case wire::Collective::kAllreduce:
    case wire::Collective::kBroadcast:
      num_chunks_ = chunks_per_block_;
      break;
    case wire::Collective::kReduceScatter:
    case wire::Collective::kAllgather:
      num_chunks_ = chunks_per_block_ * static_cast<size_t>(ranks_);
      break;
    case wire::Collective::kAlltoall:  // one block per (sender, receiver) pair
      num_chunks_ = chunks_per_block_ * static_cast<size_t>(ranks_) * static_cast<size_t>(ranks_);
      break;
    case wire::Collective::kAlltoallv:  // above
    case wire::Collective::kBarrier:
      break;
  }
}

uint64_t LocalCollective::payload_bytes() const {
  if (static_cast<wire::Collective>(sig_.collective) == wire::Collective::kAlltoallv) {
    return v_payload_bytes_;  // the largest send buffer
  }
  const uint64_t block = sig_.count * sig_.element_bytes();
  switch (static_cast<wire::Collective>(sig_.collective)) {
    case wire::Collective::kReduceScatter:
    case wire::Collective::kAllgather:
    case wire::Collective::kAlltoall:
      return block * static_cast<uint64_t>(ranks_);
    default:
      return block;
  }
}

void LocalCollective::RunChunk(size_t index) const {
  const auto c = static_cast<wire::Collective>(sig_.collective);
  if (c == wire::Collective::kAlltoallv) {
    const Piece& p = pieces_[index];
    std::memcpy(p.to, p.from, p.bytes);
    return;
  }
  const uint64_t es = sig_.element_bytes();
  const uint64_t block_bytes = sig_.count * es;
  // Which rank block (for reduce_scatter / allgather) and which element range.
  const size_t owner = index / chunks_per_block_;
  const uint64_t first = (index % chunks_per_block_) * chunk_elems_;
  const uint64_t elems = std::min(chunk_elems_, sig_.count - first);
  const uint64_t step = std::max<uint64_t>(1, kCacheBlockBytes / es);

  std::vector<const void*> inputs(send_.size());
  for (uint64_t done = 0; done < elems; done += step) {
    const uint64_t n = std::min(step, elems - done);
    const uint64_t off = (first + done) * es;
    switch (c) {
      case wire::Collective::kAllreduce: {
        for (size_t r = 0; r < send_.size(); ++r) inputs[r] = send_[r] + off;
        uint8_t* out = recv_[0] + off;
        Reduce(static_cast<wire::DataType>(sig_.dtype), static_cast<wire::ReduceOp>(sig_.reduce_op),
               inputs.data(), static_cast<int>(send_.size()), out, n);
        for (int r = 1; r < ranks_; ++r) std::memcpy(recv_[r] + off, out, n * es);
        break;
      }
      case wire::Collective::kReduceScatter: {
        const uint64_t src = owner * block_bytes + off;
        for (int r = 0; r < ranks_; ++r) inputs[r] = send_[r] + src;
        Reduce(static_cast<wire::DataType>(sig_.dtype), static_cast<wire::ReduceOp>(sig_.reduce_op),
               inputs.data(), ranks_, recv_[owner] + off, n);
        break;
      }
      case wire::Collective::kAllgather: {
        const uint8_t* src = send_[owner] + off;
        const uint64_t dst = owner * block_bytes + off;
        for (int r = 0; r < ranks_; ++r) {
          if (recv_[r] + dst != src) std::memcpy(recv_[r] + dst, src, n * es);
        }
        break;
      }
      case wire::Collective::kBroadcast: {
        const uint8_t* src = send_[sig_.root] + off;
        for (int r = 0; r < ranks_; ++r) {
          if (recv_[r] + off != src) std::memcpy(recv_[r] + off, src, n * es);
        }
        break;
      }
      case wire::Collective::kAlltoall: {
        // owner = sender * ranks + receiver: the sender's block for the
        // receiver lands in the receiver's block for the sender.
        const size_t from = owner / static_cast<size_t>(ranks_);
        const size_t to = owner % static_cast<size_t>(ranks_);
        std::memcpy(recv_[to] + from * block_bytes + off, send_[from] + to * block_bytes + off,
                    n * es);
        break;
      }
      case wire::Collective::kAlltoallv:  // above
      case wire::Collective::kBarrier:
        break;
    }
  }
}

void RunChunks(const LocalCollective& collective, const ParallelChunks& parallel) {
  const size_t chunks = collective.num_chunks();
  if (!parallel || chunks < 2) {
    for (size_t i = 0; i < chunks; ++i) collective.RunChunk(i);
    return;
  }
  parallel(chunks, [&collective](size_t i) { collective.RunChunk(i); });
}

absl::Status AlltoallvMismatch(const std::vector<int>& ranks,
                               const std::vector<const std::vector<uint64_t>*>& send_counts,
                               const std::vector<const std::vector<uint64_t>*>& recv_counts) {
  for (int i : ranks) {
    for (int j : ranks) {
      const uint64_t sends = (*send_counts[i])[j];
      const uint64_t expects = (*recv_counts[j])[i];
      if (sends != expects) {
        return absl::InvalidArgumentError(absl::StrCat(
            "alltoallv counts disagree: rank ", i, " sends ", sends, " element(s) to rank ", j,
            ", which expects ", expects, " from it"));
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace ciuic::daemon
