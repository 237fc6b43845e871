// Compressed allreduce (sum) between nodes, pipelined. See internode.h and
// ../README.md ("Compressed allreduce").
//
// Structure (what bounds the error): segment j of the buffer (count/N
// elements, as in the ring) belongs to node j.
//   Phase 0, direct reduce-scatter: every node encodes each chunk of every
//   other node's segment once and sends it to the owner; the owner decodes
//   the N-1 contributions of a chunk and adds them, in ascending node order,
//   into its own (exact) values. Nothing decoded is ever encoded again.
//   Phase 1, allgather: as soon as a chunk of the owner's segment holds the
//   full sum, the owner encodes it once, replaces its own copy by the decoded
//   form (so that it ends with what everybody else gets) and sends the
//   encoding to every other node, which decodes it in place.
// Each element is therefore compressed exactly twice whatever N is: once as
// part of each node's contribution (N-1 independent errors, one per
// contribution, never compounded) and once as the sum. Every node ends with
// the owner's bits.
//
// Pipelining: chunks of chunk_bytes (of raw data, at most kMaxChunkBytes;
// whole elements, whole int8 blocks when larger than one), a window of slots per direction, several
// chunks in flight spread over the channels. The calling thread encodes a
// chunk when a send slot frees (the earlier chunks are on the wire
// meanwhile: the transport's progress threads move them), and decodes or
// decode-adds each received chunk as it arrives. With a coder (the data on
// a device) an encoding is begun when a send slot frees and ended when the
// device is done: the device encodes the chunks ahead of those being sent,
// each chunk sent once it and every chunk before it in key order ended.
//
// Messages: every chunk is one message of 8 + TypicalEncodedBytes bytes: a
// little-endian uint64 with the encoded size, then the encoding. When the
// encoding is longer than typical (int8 blocks holding NaN/Inf travel raw),
// the excess follows as a second message with the overflow bit of the tag
// set; the receiver posts its receive once the header told it the size.
//
// Tags: tag_base | phase << 23 | overflow << 22 | chunk (chunk index within
// its segment; the peer tells segments apart). Channel: (chunk + owner) mod
// channels.
//
// Threads: everything (posting, encoding, decoding, error feedback) runs on
// the calling thread; transfer callbacks, on the transport's threads, only
// queue an event for it.
//
// Ordering (no deadlock over a rendezvous transport): sends and receives are
// posted in the order of a key shared by all nodes, (phase, chunk), and a
// window holds at least N-1 slots, as many as the transfers of one key in one
// direction. The earliest unfinished key can then always post all its
// transfers everywhere, and all its dependencies (a phase-1 send of chunk c
// needs the phase-0 receives of chunk c) have smaller keys.
//
// Yielding (ctx.yield > 0: a higher-priority operation runs beside this one):
// a new chunk message is sent only when none of this operation's sends is in
// flight, so the other operation's chunks wait behind at most one of ours per
// link (an overflow message travels with its chunk). Only the issue of sends
// is limited; the window, its slots and the posting of receives stay as
// above, so nodes that disagree about yielding (each reads its own flag at
// its own moments) still post everything in the same key order: the earliest
// unfinished key's sends are then the only ones a node can have left, and
// each of them completes in turn, since its receives are posted everywhere.
// A phase-1 chunk goes to the other nodes one at a time while yielding.
#include <algorithm>
#include <chrono>
#include <cstring>
#include <memory>
#include <utility>

#include "absl/strings/str_cat.h"
#include "collectives/internode/common.h"
#include "collectives/internode/internode.h"

namespace ciuic::daemon {

namespace {

constexpr const char* kWhat = "AllreduceCompressed";
constexpr int kTagFieldBits = 24;
constexpr int kChunkBits = 22;
constexpr uint64_t kOverflowBit = uint64_t{1} << 22;
constexpr uint64_t kPhaseBit = uint64_t{1} << 23;
constexpr size_t kHeader = sizeof(uint64_t);
constexpr size_t kInt8Block = 256;
// Chunks carry at most this much raw data, whatever chunk_bytes says: the
// pipeline's fill and drain each cost about one chunk's encode plus its wire
// time, which the compressed path cannot hide, while a smaller chunk only
// adds per-message work. Measured on the 1 Gbit/s namespace link (64 MiB,
// 2 nodes): int8 took 212 / 166 / 194 / 238 ms with 4M / 1M / 512K / 256K
// chunks, fp16 357 / 296 / 305 / 371 ms.
constexpr uint64_t kMaxChunkBytes = uint64_t{1} << 20;
// Piece of a chunk encoded at a time by splittable codecs: 64 KiB of
// float32, so that the piece, its encoding and its decoded copy stay in L2.
constexpr size_t kPieceElems = 16384;
using Clock = std::chrono::steady_clock;
// How long the pipeline waits for a coder's wake before it asks anyway.
constexpr auto kEncodePoll = std::chrono::milliseconds(10);

struct Event {
  bool is_send;
  size_t item;
  int peer;
  absl::Status status;
  bool wake = false;  // the coder's: an encoding may have completed
};

using EventMailbox = internode_internal::Mailbox<Event>;

// One chunk to send: phase 0 to its owner, or phase 1 (the own segment's
// chunk) to every other node.
struct SendItem {
  int phase;
  size_t chunk;
  int owner;         // the segment's owner (phase 1: this node)
  int slot = -1;
  int pending = 0;   // callbacks still to come
  int dests = 0;     // destinations sent to (phase 0: 1 at most; phase 1: N-1)
  uint64_t encoded = 0;
};

// One chunk to receive: phase 0 a contribution to the own segment from
// `peer`, phase 1 the chunk of segment `peer` from its owner.
struct RecvItem {
  int phase;
  size_t chunk;
  int peer;
  int slot = -1;
  int pending = 0;
  bool overflow_posted = false;
  bool ready = false;  // whole encoding in the slot
  bool done = false;   // added / decoded, slot free
};

class Pipeline {
 public:
  // `coder`: the data is not host memory; it encodes and decodes (with its
  // own error feedback), and `feedback` must be null.
  Pipeline(const InterNodeContext& ctx, const Codec& codec, ErrorFeedback* feedback,
           const std::vector<FeedbackPiece>& pieces, wire::DataType dtype, void* data, size_t count,
           CompressionStats* stats, ChunkCoder* coder = nullptr)
      : ctx_(ctx),
        t_(ctx.transport),
        codec_(codec),
        coder_(coder),
        feedback_(dtype == wire::DataType::kFloat32 && coder == nullptr ? feedback : nullptr),
        pieces_(pieces),
        dtype_(dtype),
        base_(static_cast<uint8_t*>(data)),
        count_(count),
        stats_(stats),
        n_(t_->num_peers()),
        me_(t_->self()),
        channels_(std::max(1, t_->num_channels())),
        es_(wire::DataTypeSize(static_cast<uint32_t>(dtype))),
        mailbox_(std::make_shared<EventMailbox>()) {}

  absl::Status Run();

 private:
  size_t First(int j) const { return count_ * static_cast<size_t>(j) / static_cast<size_t>(n_); }
  size_t Len(int j) const { return First(j + 1) - First(j); }
  size_t Chunks(int j) const { return (Len(j) + elems_ - 1) / elems_; }
  // Element range of chunk c of segment j.
  size_t ChunkFirst(int j, size_t c) const { return First(j) + c * elems_; }
  size_t ChunkLen(int j, size_t c) const { return std::min(elems_, Len(j) - c * elems_); }
  uint8_t* ChunkPtr(int j, size_t c) const { return base_ + ChunkFirst(j, c) * es_; }
  uint8_t* SendSlot(int s) const { return send_slots_ + static_cast<size_t>(s) * slot_bytes_; }
  uint8_t* RecvSlot(int s) const { return recv_slots_ + static_cast<size_t>(s) * slot_bytes_; }
  uint64_t Tag(int phase, size_t chunk, bool overflow) const {
    return ctx_.tag_base | (phase ? kPhaseBit : 0) | (overflow ? kOverflowBit : 0) | chunk;
  }
  // Chunk c of owner o's segment: channel_table[(c + o) mod size] (the
  // run's shares of the channels), or (c + o) mod channels. The same on
  // every node: sender and receiver name one channel.
  int Channel(size_t chunk, int owner) const {
    const size_t i = chunk + static_cast<size_t>(owner);
    const std::vector<uint8_t>& table = ctx_.channel_table;
    if (!table.empty()) return table[i % table.size()];
    return static_cast<int>(i % channels_);
  }

  absl::Status Prepare();
  bool PostSends();
  bool Yielding() const {
    return ctx_.yield != nullptr && ctx_.yield->load(std::memory_order_relaxed) > 0;
  }
  bool PostRecvs();
  // Encodes item `s` (slot taken) into its slot: at once on the CPU, or
  // begun on the coder (ended by EndEncodings).
  void Encode(SendItem& s);
  void EncodeInto(uint8_t* slot, int owner, size_t c, bool own_sum, uint64_t* encoded);
  // Ends the coder's encodings that are complete, in order; true if any.
  bool EndEncodings();
  // Calls fn(piece index, offset in the piece, offset from `first`, length)
  // for each piece overlapping elements [first, first + n) of the buffer.
  template <typename Fn>
  void ForPieces(size_t first, size_t n, Fn fn) const;
  void SendMessage(size_t item, int peer, int phase, size_t c, int owner, const uint8_t* slot,
                   uint64_t encoded, size_t typical);
  void Apply(Event& e);
  bool AddReady();
  absl::Status CheckHeader(const RecvItem& r, uint64_t* encoded) const;
  // A received encoding into (add: added to) the data: the coder's, or the
  // CPU codec's.
  absl::Status DecodeChunk(const uint8_t* in, uint64_t bytes, size_t count, uint8_t* data,
                           bool add) {
    if (coder_ != nullptr) return coder_->Decode(in, bytes, count, data, add);
    return add ? codec_.DecodeAdd(dtype_, in, bytes, count, data)
               : codec_.Decode(dtype_, in, bytes, count, data);
  }
  void Fail(absl::Status s);
  TransferDone Callback(bool is_send, size_t item, int peer);
  // At the deadline or on a failure: every peer failed on the transport
  // (sticky: a job-level fault), so every posted transfer ends at once;
  // error_ names the first node still awaited when nothing failed before.
  void Cancel();

  const InterNodeContext& ctx_;
  Transport* const t_;
  const Codec& codec_;
  ChunkCoder* const coder_;  // null: host data, the CPU codec
  ErrorFeedback* const feedback_;
  const std::vector<FeedbackPiece>& pieces_;  // sorted, covering [0, count_)
  const wire::DataType dtype_;
  uint8_t* const base_;
  const size_t count_;
  CompressionStats* const stats_;
  const int n_, me_, channels_;
  const size_t es_;
  std::shared_ptr<EventMailbox> mailbox_;

  size_t elems_ = 0;       // elements per chunk
  size_t slot_bytes_ = 0;  // header + MaxEncodedBytes of a chunk, rounded to 64
  uint8_t* send_slots_ = nullptr;
  uint8_t* recv_slots_ = nullptr;
  float* decoded_ = nullptr;  // error feedback: what receivers will see of a chunk
  std::vector<int> free_send_, free_recv_;
  std::vector<SendItem> sends_;
  std::vector<RecvItem> recvs_;
  size_t next_send_ = 0, next_recv_ = 0;
  // Sends from next_send_ up to next_encode_ have begun encoding, the last
  // encoding_ of them on the coder and not ended: those before are encoded.
  size_t next_encode_ = 0, encoding_ = 0;
  size_t outstanding_ = 0;  // callbacks to come
  size_t send_msgs_in_flight_ = 0;  // send messages posted and not completed
  std::vector<int> per_peer_outstanding_;
  // Phase 0: recvs_[c * (n_-1) + t] is the contribution to own chunk c from
  // the t-th other node (ascending); added_[c] of them are added.
  std::vector<size_t> added_;
  absl::Status error_;
  bool cancelled_ = false;
};

absl::Status Pipeline::Prepare() {
  if (absl::Status s = internode_internal::CheckChannelTable(ctx_.channel_table, channels_, kWhat);
      !s.ok()) {
    return s;
  }
  // Chunk size: whole elements, whole int8 blocks when more than one block,
  // and few enough chunks per segment for the tag's chunk field.
  elems_ = std::max<size_t>(1, std::min<uint64_t>(ctx_.chunk_bytes, kMaxChunkBytes) / es_);
  if (elems_ > kInt8Block) elems_ = elems_ / kInt8Block * kInt8Block;
  size_t max_len = 0;
  for (int j = 0; j < n_; ++j) max_len = std::max(max_len, Len(j));
  const size_t max_chunks = size_t{1} << kChunkBits;
  if ((max_len + elems_ - 1) / elems_ > max_chunks) {
    elems_ = (max_len + max_chunks - 1) / max_chunks;
    elems_ = (elems_ + kInt8Block - 1) / kInt8Block * kInt8Block;
  }
  const size_t chunk_elems = std::min(elems_, std::max<size_t>(max_len, 1));
  slot_bytes_ = (kHeader + codec_.MaxEncodedBytes(dtype_, chunk_elems) + 63) / 64 * 64;
  const int window = std::max(ctx_.max_inflight, n_ - 1);
  const size_t slots_bytes = slot_bytes_ * static_cast<size_t>(window);
  const size_t fb_bytes = feedback_ != nullptr ? chunk_elems * sizeof(float) : 0;
  // A coder's slots are the memory its copies are quick to and from.
  uint8_t* scratch = nullptr;
  if (coder_ != nullptr) {
    auto host = coder_->HostMemory(2 * slots_bytes);
    if (!host.ok()) {
      return absl::Status(host.status().code(), absl::StrCat(kWhat, ": ", host.status().message()));
    }
    scratch = *host;
  }
  if (scratch == nullptr) scratch = ctx_.scratch->Get(2 * slots_bytes + fb_bytes);
  if (scratch == nullptr) {
    return absl::ResourceExhaustedError(absl::StrCat(
        kWhat, ": cannot map ", 2 * slots_bytes + fb_bytes, " bytes of scratch space"));
  }
  send_slots_ = scratch;
  recv_slots_ = scratch + slots_bytes;
  if (feedback_ != nullptr) decoded_ = reinterpret_cast<float*>(scratch + 2 * slots_bytes);
  for (int s = window - 1; s >= 0; --s) {
    free_send_.push_back(s);
    free_recv_.push_back(s);
  }

  // The two sequences, in key order (phase, chunk).
  size_t max_c = 0;
  for (int j = 0; j < n_; ++j) max_c = std::max(max_c, Chunks(j));
  for (size_t c = 0; c < max_c; ++c) {
    for (int d = 1; d < n_; ++d) {  // starting after this node: owners get data evenly
      const int j = (me_ + d) % n_;
      if (c < Chunks(j)) sends_.push_back(SendItem{0, c, j});
    }
  }
  for (size_t c = 0; c < Chunks(me_); ++c) {
    for (int j = 0; j < n_; ++j) {
      if (j != me_) recvs_.push_back(RecvItem{0, c, j});
    }
  }
  added_.assign(Chunks(me_), 0);
  for (size_t c = 0; c < Chunks(me_); ++c) sends_.push_back(SendItem{1, c, me_});
  for (size_t c = 0; c < max_c; ++c) {
    for (int d = 1; d < n_; ++d) {
      const int j = (me_ + d) % n_;
      if (c < Chunks(j)) recvs_.push_back(RecvItem{1, c, j});
    }
  }
  per_peer_outstanding_.assign(n_, 0);
  return absl::OkStatus();
}

TransferDone Pipeline::Callback(bool is_send, size_t item, int peer) {
  return [mailbox = mailbox_, is_send, item, peer](absl::Status status) {
    mailbox->Post(Event{is_send, item, peer, std::move(status)});
  };
}

// Encodes chunk c of segment `owner` (with error feedback: the residual of
// the last operation added first, the new residual kept) into slot+header.
// own_sum: the owner's reduced chunk (phase 1), which the owner then
// replaces by its decoded form. A splittable codec (SplitGranule) goes
// through the chunk in pieces of kPieceElems, so that apply, encode, decode
// and update of a piece find it in cache: one pass over memory instead of
// four; the bytes are those of encoding the chunk whole.
template <typename Fn>
void Pipeline::ForPieces(size_t first, size_t n, Fn fn) const {
  // The last piece starting at or before `first`.
  size_t i = static_cast<size_t>(
      std::upper_bound(pieces_.begin(), pieces_.end(), first,
                       [](size_t x, const FeedbackPiece& p) { return x < p.offset; }) -
      pieces_.begin());
  i = i == 0 ? 0 : i - 1;
  for (size_t at = first; at < first + n && i < pieces_.size(); ++i) {
    const FeedbackPiece& p = pieces_[i];
    const size_t end = std::min(first + n, p.offset + p.count);
    if (end <= at) continue;
    fn(i, at - p.offset, at - first, end - at);
    at = end;
  }
}

void Pipeline::EncodeInto(uint8_t* slot, int owner, size_t c, bool own_sum, uint64_t* encoded) {
  uint8_t* ptr = ChunkPtr(owner, c);
  const size_t m = ChunkLen(owner, c);
  const size_t chunk_first = ChunkFirst(owner, c);
  // One residual per piece (operation), under its name, indexed by element
  // of the piece: an element's is what compression dropped of this node's
  // contribution to it, or (in the node's own segment) of its sum.
  const size_t g = codec_.SplitGranule();
  const size_t piece = g == 0 ? m : std::max(g, kPieceElems / g * g);
  uint64_t total = 0;
  for (size_t a = 0; a < m; a += piece) {
    const size_t k = std::min(piece, m - a);
    uint8_t* p = ptr + a * es_;
    uint8_t* out = slot + kHeader + total;
    auto* f = reinterpret_cast<float*>(p);
    if (feedback_ != nullptr) {
      ForPieces(chunk_first + a, k, [&](size_t i, size_t at, size_t from, size_t len) {
        if (!pieces_[i].name.empty()) {
          feedback_->ApplyRange(pieces_[i].name, pieces_[i].count, at, f + from, len);
        }
      });
    }
    const size_t bytes = codec_.Encode(dtype_, p, k, out);
    absl::Status s;
    if (feedback_ != nullptr) {
      s = codec_.Decode(dtype_, out, bytes, k, decoded_);
      if (s.ok()) {
        ForPieces(chunk_first + a, k, [&](size_t i, size_t at, size_t from, size_t len) {
          if (!pieces_[i].name.empty()) {
            feedback_->UpdateRange(pieces_[i].name, pieces_[i].count, at, f + from, decoded_ + from,
                                   len);
          }
        });
        if (own_sum) std::memcpy(p, decoded_, k * sizeof(float));
      }
    } else if (own_sum) {
      s = codec_.Decode(dtype_, out, bytes, k, p);
    }
    if (!s.ok()) {  // our own encoding: a codec bug
      Fail(absl::InternalError(absl::StrCat(kWhat, ": own encoding does not decode: ",
                                            s.message())));
      return;
    }
    total += bytes;
  }
  *encoded = total;
  std::memcpy(slot, encoded, kHeader);
}

void Pipeline::Encode(SendItem& s) {
  if (coder_ == nullptr) {
    EncodeInto(SendSlot(s.slot), s.owner, s.chunk, s.phase == 1, &s.encoded);
    return;
  }
  absl::Status begun = coder_->BeginEncode(
      ChunkPtr(s.owner, s.chunk), ChunkFirst(s.owner, s.chunk), ChunkLen(s.owner, s.chunk),
      s.phase == 1, SendSlot(s.slot) + kHeader, [mailbox = mailbox_] {
        mailbox->Post(Event{false, 0, -1, absl::OkStatus(), true});
      });
  if (!begun.ok()) {
    Fail(absl::Status(begun.code(),
                      absl::StrCat(kWhat, ": encoding chunk ", s.chunk, ": ", begun.message())));
    return;
  }
  ++encoding_;
}

bool Pipeline::EndEncodings() {
  bool any = false;
  while (encoding_ > 0 && error_.ok()) {
    SendItem& s = sends_[next_encode_ - encoding_];
    absl::StatusOr<bool> done = coder_->EncodeDone();
    if (done.ok() && !*done) break;
    absl::StatusOr<uint64_t> bytes = done.ok() ? coder_->EndEncode() : done.status();
    if (!bytes.ok()) {
      Fail(absl::Status(bytes.status().code(), absl::StrCat(kWhat, ": encoding chunk ", s.chunk,
                                                            ": ", bytes.status().message())));
      break;
    }
    --encoding_;
    s.encoded = *bytes;
    std::memcpy(SendSlot(s.slot), &s.encoded, kHeader);
    any = true;
  }
  return any;
}

void Pipeline::SendMessage(size_t item, int peer, int phase, size_t c, int owner,
                           const uint8_t* slot, uint64_t encoded, size_t typical) {
  SendItem& s = sends_[item];
  const int channel = Channel(c, owner);
  const size_t main = kHeader + typical;
  const bool overflow = encoded > typical;
  s.pending += overflow ? 2 : 1;
  outstanding_ += overflow ? 2 : 1;
  send_msgs_in_flight_ += overflow ? 2 : 1;
  per_peer_outstanding_[peer] += overflow ? 2 : 1;
  t_->Send(peer, channel, Tag(phase, c, false), slot, main, Callback(true, item, peer));
  if (overflow) {
    t_->Send(peer, channel, Tag(phase, c, true), slot + main, encoded - typical,
             Callback(true, item, peer));
  }
  stats_->raw_bytes += ChunkLen(owner, c) * es_;
  stats_->wire_bytes += kHeader + std::max<uint64_t>(encoded, typical);
}

// Sends in key order. An item is encoded into its slot once (begun in key
// order as send slots free, on a coder ahead of the sends), then sent to
// its destinations (phase 1: every other node, in the order me+1, me+2,
// ...) once it and every item before it are encoded; while yielding, one
// message is sent only when no other send is in flight, so an item may be
// sent to its destinations over several calls (next_send_ stays on it
// until the last one is sent), and nothing is encoded ahead.
bool Pipeline::PostSends() {
  bool progress = false;
  while (error_.ok()) {
    if (coder_ != nullptr && EndEncodings()) progress = true;
    while (error_.ok() && next_send_ < next_encode_ - encoding_) {
      SendItem& s = sends_[next_send_];
      const int total = s.phase == 0 ? 1 : n_ - 1;
      const size_t typical = codec_.TypicalEncodedBytes(dtype_, ChunkLen(s.owner, s.chunk));
      while (s.dests < total) {
        if (send_msgs_in_flight_ > 0 && Yielding()) break;
        const int peer = s.phase == 0 ? s.owner : (me_ + 1 + s.dests) % n_;
        SendMessage(next_send_, peer, s.phase, s.chunk, s.owner, SendSlot(s.slot), s.encoded,
                    typical);
        ++s.dests;
        progress = true;
      }
      if (s.dests < total) break;
      ++next_send_;
    }
    if (!error_.ok() || next_encode_ == sends_.size() || free_send_.empty()) break;
    SendItem& s = sends_[next_encode_];
    if (s.phase == 1 && added_[s.chunk] != static_cast<size_t>(n_ - 1)) break;
    // Yielding: nothing ahead, and fresh (encoded when it can go).
    if (Yielding() && (send_msgs_in_flight_ > 0 || next_send_ != next_encode_)) break;
    s.slot = free_send_.back();
    free_send_.pop_back();
    ++next_encode_;
    Encode(s);
    progress = true;
  }
  return progress;
}

bool Pipeline::PostRecvs() {
  bool posted = false;
  while (error_.ok() && next_recv_ < recvs_.size() && !free_recv_.empty()) {
    RecvItem& r = recvs_[next_recv_];
    const int owner = r.phase == 0 ? me_ : r.peer;
    r.slot = free_recv_.back();
    free_recv_.pop_back();
    r.pending = 1;
    ++outstanding_;
    ++per_peer_outstanding_[r.peer];
    const size_t main = kHeader + codec_.TypicalEncodedBytes(dtype_, ChunkLen(owner, r.chunk));
    t_->Recv(r.peer, Channel(r.chunk, owner), Tag(r.phase, r.chunk, false), RecvSlot(r.slot),
             main, Callback(false, next_recv_, r.peer));
    ++next_recv_;
    posted = true;
  }
  return posted;
}

absl::Status Pipeline::CheckHeader(const RecvItem& r, uint64_t* encoded) const {
  const int owner = r.phase == 0 ? me_ : r.peer;
  const size_t m = ChunkLen(owner, r.chunk);
  std::memcpy(encoded, RecvSlot(r.slot), kHeader);
  const size_t max = codec_.MaxEncodedBytes(dtype_, m);
  if (*encoded > max) {
    return absl::DataLossError(absl::StrCat(kWhat, ": ", internode_internal::NodeLabel(ctx_.node_names, r.peer),
                                            " announced ", *encoded,
                                            " bytes for chunk ", r.chunk, " (phase ", r.phase,
                                            "), at most ", max, " possible"));
  }
  return absl::OkStatus();
}

void Pipeline::Fail(absl::Status s) {
  if (error_.ok()) error_ = std::move(s);
}

void Pipeline::Apply(Event& e) {
  if (e.wake) return;  // PostSends asks the coder
  --outstanding_;
  --per_peer_outstanding_[e.peer];
  if (e.is_send) {
    --send_msgs_in_flight_;
    SendItem& s = sends_[e.item];
    if (!e.status.ok()) {
      Fail(absl::Status(e.status.code(),
                        absl::StrCat(kWhat, ": send of chunk ", s.chunk, " (phase ", s.phase,
                                     ") to ", internode_internal::NodeLabel(ctx_.node_names, e.peer),
                                     " failed: ", e.status.message())));
    }
    // Free once every destination was sent to and every send completed.
    if (--s.pending == 0 && s.dests == (s.phase == 0 ? 1 : n_ - 1)) free_send_.push_back(s.slot);
    return;
  }
  RecvItem& r = recvs_[e.item];
  --r.pending;
  if (!e.status.ok()) {
    Fail(absl::Status(e.status.code(),
                      absl::StrCat(kWhat, ": receive of chunk ", r.chunk, " (phase ", r.phase,
                                   ") from ", internode_internal::NodeLabel(ctx_.node_names, r.peer),
                                   " failed: ", e.status.message())));
  }
  if (!error_.ok()) {
    if (r.pending == 0) {
      r.done = true;
      free_recv_.push_back(r.slot);
    }
    return;
  }
  const int owner = r.phase == 0 ? me_ : r.peer;
  const size_t typical = codec_.TypicalEncodedBytes(dtype_, ChunkLen(owner, r.chunk));
  if (!r.overflow_posted) {
    uint64_t encoded = 0;
    if (absl::Status s = CheckHeader(r, &encoded); !s.ok()) {
      Fail(std::move(s));
      r.done = true;
      free_recv_.push_back(r.slot);
      return;
    }
    if (encoded > typical) {
      r.overflow_posted = true;
      r.pending = 1;
      ++outstanding_;
      ++per_peer_outstanding_[r.peer];
      t_->Recv(r.peer, Channel(r.chunk, owner), Tag(r.phase, r.chunk, true),
               RecvSlot(r.slot) + kHeader + typical, encoded - typical,
               Callback(false, e.item, r.peer));
      return;
    }
  }
  r.ready = true;
  if (r.phase == 1) {
    uint64_t encoded = 0;
    std::memcpy(&encoded, RecvSlot(r.slot), kHeader);
    absl::Status s = DecodeChunk(RecvSlot(r.slot) + kHeader, encoded, ChunkLen(r.peer, r.chunk),
                                 ChunkPtr(r.peer, r.chunk), false);
    if (!s.ok()) {
      Fail(absl::Status(s.code(), absl::StrCat(kWhat, ": chunk ", r.chunk, " from ",
                                               internode_internal::NodeLabel(ctx_.node_names, r.peer), ": ",
                                               s.message())));
    }
    r.done = true;
    free_recv_.push_back(r.slot);
  }
}

// Adds the phase-0 contributions that are in, in ascending node order per
// chunk (so the owner's sum does not depend on arrival order).
bool Pipeline::AddReady() {
  bool any = false;
  const size_t others = static_cast<size_t>(n_ - 1);
  for (size_t c = 0; c < added_.size() && error_.ok(); ++c) {
    while (added_[c] < others) {
      RecvItem& r = recvs_[c * others + added_[c]];
      if (!r.ready) break;
      if (!r.done) {
        uint64_t encoded = 0;
        std::memcpy(&encoded, RecvSlot(r.slot), kHeader);
        absl::Status s = DecodeChunk(RecvSlot(r.slot) + kHeader, encoded, ChunkLen(me_, c),
                                     ChunkPtr(me_, c), true);
        r.done = true;
        free_recv_.push_back(r.slot);
        if (!s.ok()) {
          Fail(absl::Status(s.code(), absl::StrCat(kWhat, ": chunk ", c, " from ",
                                                   internode_internal::NodeLabel(ctx_.node_names, r.peer), ": ",
                                                   s.message())));
          return true;
        }
      }
      ++added_[c];
      any = true;
    }
  }
  return any;
}

void Pipeline::Cancel() {
  cancelled_ = true;
  if (error_.ok()) {
    int first = -1;
    for (size_t i = 0; i < recvs_.size() && first < 0; ++i) {
      if (recvs_[i].pending > 0) first = recvs_[i].peer;
    }
    for (int p = 0; p < n_ && first < 0; ++p) {
      if (per_peer_outstanding_[p] > 0) first = p;
    }
    error_ = absl::DeadlineExceededError(
        first >= 0 ? absl::StrCat(kWhat, ": deadline exceeded waiting for ",
                                  internode_internal::NodeLabel(ctx_.node_names, first))
                   : absl::StrCat(kWhat, ": deadline exceeded"));
  }
  for (int p = 0; p < n_; ++p) {
    if (p != me_) t_->FailPeer(p, error_);
  }
}

absl::Status Pipeline::Run() {
  if (absl::Status s = Prepare(); !s.ok()) return s;
  std::vector<Event> batch;
  while (true) {
    if (error_.ok()) {
      // Adding first: it frees receive slots and completes phase-1 sums.
      while (AddReady() | PostRecvs() | PostSends()) {
      }
    }
    if (cancelled_ || !error_.ok()) {
      // Encodings not ended are the coder's to finish (or abandon).
      encoding_ = 0;
    }
    // Failed (a transfer, a chunk, the device): what is still posted would
    // wait for peers that wait for this node. Cancelled at once, as at the
    // deadline.
    if (!error_.ok() && !cancelled_ && outstanding_ > 0) Cancel();
    if (outstanding_ == 0 && encoding_ == 0) {
      if (!error_.ok()) break;
      if (next_send_ == sends_.size() && next_recv_ == recvs_.size()) {
        bool all = true;
        for (size_t a : added_) all = all && a == static_cast<size_t>(n_ - 1);
        if (all) break;
      }
      error_ = absl::InternalError(absl::StrCat(kWhat, ": pipeline cannot progress"));
      break;
    }
    batch.clear();
    // Encodings on the coder: asked about again at least every
    // kEncodePoll, in case a wake never comes (a failed device).
    const auto until =
        encoding_ > 0 ? std::min(ctx_.deadline, Clock::now() + kEncodePoll) : ctx_.deadline;
    if (!mailbox_->Take(&batch, cancelled_, until)) {
      if (Clock::now() >= ctx_.deadline) Cancel();
      continue;
    }
    for (Event& e : batch) Apply(e);
  }
  return error_;
}

// The checks every entry point makes; OK to go on (`*done`: nothing to do).
absl::Status CheckCompressed(const InterNodeContext& ctx, const Codec& codec, wire::DataType dtype,
                             size_t count, bool* done) {
  *done = true;
  if (absl::Status s = codec.Supports(dtype); !s.ok()) {
    return absl::Status(s.code(), absl::StrCat(kWhat, ": ", s.message()));
  }
  if (ctx.transport == nullptr)
    return absl::InvalidArgumentError(absl::StrCat(kWhat, ": no transport"));
  if (ctx.tag_bits != kTagFieldBits ||
      (ctx.tag_base & ((uint64_t{1} << kTagFieldBits) - 1)) != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        kWhat, ": needs all 24 low tag bits (tag_bits ", ctx.tag_bits, ", tag_base ",
        ctx.tag_base, ")"));
  }
  if (ctx.transport->num_peers() <= 1 || count == 0) return absl::OkStatus();
  if (ctx.scratch == nullptr)
    return absl::InvalidArgumentError(absl::StrCat(kWhat, ": no scratch buffer"));
  *done = false;
  return absl::OkStatus();
}

}  // namespace

absl::Status AllreduceCompressedWith(const InterNodeContext& ctx, const Codec& codec,
                                     ChunkCoder& coder, wire::DataType dtype, void* data,
                                     size_t count, CompressionStats* stats) {
  bool done = false;
  if (absl::Status s = CheckCompressed(ctx, codec, dtype, count, &done); !s.ok() || done) {
    return s;
  }
  const std::vector<FeedbackPiece> pieces = {FeedbackPiece{"", 0, count}};
  CompressionStats local;
  Pipeline pipeline(ctx, codec, nullptr, pieces, dtype, data, count, stats ? stats : &local,
                    &coder);
  return pipeline.Run();
}

absl::Status AllreduceCompressed(const InterNodeContext& ctx, const Codec& codec,
                                 ErrorFeedback* feedback, const std::string& name,
                                 wire::DataType dtype, void* data, size_t count,
                                 CompressionStats* stats) {
  const std::vector<FeedbackPiece> pieces = {FeedbackPiece{name, 0, count}};
  return AllreduceCompressedPieces(ctx, codec, feedback, pieces, dtype, data, count, stats);
}

absl::Status AllreduceCompressedPieces(const InterNodeContext& ctx, const Codec& codec,
                                       ErrorFeedback* feedback,
                                       const std::vector<FeedbackPiece>& pieces,
                                       wire::DataType dtype, void* data, size_t count,
                                       CompressionStats* stats) {
  size_t covered = 0;
  for (const FeedbackPiece& p : pieces) {
    if (p.offset != covered) {
      return absl::InvalidArgumentError(absl::StrCat(
          kWhat, ": piece '", p.name, "' starts at ", p.offset, ", expected ", covered));
    }
    covered += p.count;
  }
  if (covered != count) {
    return absl::InvalidArgumentError(
        absl::StrCat(kWhat, ": pieces cover ", covered, " elements of ", count));
  }
  bool done = false;
  if (absl::Status s = CheckCompressed(ctx, codec, dtype, count, &done); !s.ok() || done) {
    return s;
  }
  CompressionStats local;
  Pipeline pipeline(ctx, codec, feedback, pieces, dtype, data, count, stats ? stats : &local);
  return pipeline.Run();
}

}  // namespace ciuic::daemon
