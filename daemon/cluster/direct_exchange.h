// One small allreduce (or a barrier) between the nodes of a job without the
// coordinator: a "direct operation" (README.md, "Direct operations").
//
// Each node starts its DirectExchange as soon as its own ranks have
// submitted the operation, with the node's reduced value in payload() (or
// in the caller's buffer, UseBuffers). With P the largest power of two <= N
// nodes, node P + i first hands its value to node i (i < N - P), which
// folds it in; nodes 0..P-1 then run rounds with node self ^ d for d = 1,
// 2, .. P/2; node i finally sends the result to node P + i. In the rounds
// a small value (and any value on 2 or 3 nodes) goes by recursive
// doubling: each node exchanges its whole value and folds what it gets. A
// value of kHalvingMinBytes and more on 4 nodes and more goes by halving
// (Halving): each round a node sends the half of its part that the partner
// keeps and folds the partner's copy of its own half in, so after log2(P)
// rounds node k holds the final 1/P of the value; then the rounds run
// backwards, each node sending what it holds and receiving its partner's,
// until every node has all of it. The value crosses each link
// 2 (P - 1) / P times instead of log2(P) times. Every fold is op(lower
// node's value, higher node's value), and with the halving each element is
// folded on one node only, so every node ends with the same bits.
//
// Each step's message is kMessageBytes long whatever the operation: a
// DirectHeader, then the step's part of the value itself when it fits
// (kInlineBytes), so that an 8-byte allreduce costs one message per step. A
// larger part follows as a second message whose size the header announces
// (the sender's own signature, from which the receiver computes the
// sender's steps: BytesSent); the receiver posts its receive once it has read the header,
// so no receive ever disagrees with its send in size, even between nodes
// whose operations differ (a transport receive of the wrong size fails, and
// UCX over TCP was seen to drop the connection after one). The header also
// carries a signature different from the sender's that it has seen (if
// any), and, when the sender's exchange has failed, that failure's code and
// message (no value follows then): after the last step every node has
// heard, directly or through others, from every node, so a mismatch or
// failure anywhere ends the operation on every node with the same kind of
// error (INVALID_ARGUMENT naming both signatures or the failing node's
// words, or UNAVAILABLE), never with a partial result. Nodes whose
// signatures disagree may run different algorithms (by their sizes): the
// halving's first rounds have the doubling's partners and phases, so every
// node knows of the mismatch after them, and no node runs the halving's
// gathering rounds then (StepDone). A node whose
// transfer fails still sends its later steps (flagged), so that the
// others' receives complete instead of waiting for a deadline.
//
// The exchange is driven by the transport's completion callbacks: it never
// blocks and owns no thread. Start() posts the first step; the callback that
// completes a step posts the next; the last one calls `finished` (on a
// transport thread). A transport's callbacks must not run inline in
// Send/Recv (transport.h); they may run concurrently for one step's send and
// receive. The object stays alive until its last callback has run.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "ciuic/shm_layout.h"
#include "collectives/op.h"
#include "transport/transport.h"

namespace ciuic::daemon {

class DirectExchange : public std::enable_shared_from_this<DirectExchange> {
 public:
  struct Params {
    Transport* transport = nullptr;  // must outlive every callback
    int channel = 0;
    uint64_t tag_base = 0;  // low kTagBits bits zero; distinct per operation in flight
    std::string name;       // for error messages
    // Matched by name and occurrence (else by submission order, "#N"): for
    // error messages.
    bool named = false;
    OpSignature sig;        // compared across nodes (sig.device is not)
    // The reduction between nodes (avg: kSum, the caller divides).
    wire::ReduceOp op = wire::ReduceOp::kSum;
  };
  // `result` points to the reduced value (payload bytes) when `status` is
  // OK (the receiver may change it in place); valid during the call only.
  using Finished = std::function<void(absl::Status status, uint8_t* result)>;

  static std::shared_ptr<DirectExchange> Create(Params params, Finished finished);

  // What an exchange of a `payload_bytes` value allocates: its messages,
  // its value and, when the value travels apart, the one it receives.
  static constexpr size_t MemoryBytes(size_t payload_bytes) {
    return 2 * kMessageBytes + payload_bytes + (payload_bytes > kInlineBytes ? payload_bytes : 0);
  }

  // The node's value, payload_bytes() long: fill it before Start(), or
  // name where it is with UseBuffers.
  uint8_t* payload() { return Value(); }
  size_t payload_bytes() const { return payload_bytes_; }
  // Before Start(): the node's value is read from `input` instead of
  // payload() (null: payload()), and the result is left in `output` (null:
  // in the exchange's own memory); `result` is then `output`. Both stay
  // valid until `finished`. `input` is only read, and must not overlap
  // `output`. A value sent apart is sent straight from `input` and folded
  // straight into `output` on the last step that receives, so that a
  // node's single rank costs no copy in or out. On failure `output` may
  // hold part of a result.
  void UseBuffers(const uint8_t* input, uint8_t* output) {
    input_ = input;
    output_ = output;
  }
  // The bytes of values the exchange holds in its own memory (0 while it
  // works in the caller's buffers alone): a node's single rank on two nodes
  // costs no allocation beyond the messages.
  size_t own_payload_bytes() const {
    return (value_ != nullptr ? payload_bytes_ : 0) + (bulk_in_ != nullptr ? payload_bytes_ : 0);
  }
  // Before Start(): this node cannot take part (its local phase failed).
  // It still runs every step, its messages flagged, so that every node
  // ends the operation at once with an error instead of waiting for it.
  void FailLocally(absl::Status why);
  void Start();
  // The operation has ended without the exchange (its deadline, or its
  // job's end) and its ranks are about to hear of it: from now on the
  // exchange neither reads nor writes the caller's buffers (UseBuffers).
  // Its remaining steps still run, their messages flagged with `why`, so
  // that the other nodes' receives complete and they fail the operation
  // too; values that arrive land in memory of the exchange's own. A
  // transfer that the transport already holds from or into the caller's
  // buffers cannot be taken back: `released` runs once none is in flight,
  // at once on this thread when none is (Abandon then returns true), else
  // on the transport thread that ends the last one (false), before the
  // exchange's `finished`. The ranks must not hear before it has run.
  bool Abandon(absl::Status why, std::function<void()> released);
  // The node whose message of the current step has not arrived (-1: none),
  // for a deadline's error message.
  int Waiting() const;

  // Whether nodes whose power-of-two part is `p` exchange a value of
  // `payload_bytes` by halving: a reduce-scatter by recursive halving, then
  // an allgather by recursive doubling (each node's link carries the value
  // 2 (p - 1) / p times in 2 log2(p) rounds), instead of recursive
  // doubling of the whole value (log2(p) times in log2(p) rounds). From 4
  // nodes and kHalvingMinBytes: for 2 nodes both carry it once, and the
  // doubling has half the rounds.
  static constexpr size_t kHalvingMinBytes = size_t{64} << 10;
  static bool Halving(int p, size_t payload_bytes) {
    return p >= 4 && payload_bytes >= kHalvingMinBytes;
  }

  // The low bits of the transport tag that are the exchange's: its phases
  // (0, the rounds up to 2 log2 of the nodes, 30 for Transport's 2^15, and
  // kHandBackTag) and the bit of a value sent apart.
  static constexpr int kTagBits = 8;
  static constexpr uint64_t kHandBackTag = (uint64_t{1} << (kTagBits - 1)) - 1;
  static constexpr size_t kHeaderBytes = 256;
  static constexpr size_t kInlineBytes = 1024;
  static constexpr size_t kMessageBytes = kHeaderBytes + kInlineBytes;
  // A value announced larger than this is not drained (no direct operation
  // is: direct_max_bytes <= 1M).
  static constexpr size_t kMaxBulkBytes = size_t{1} << 20;
  // The most of a failing node's message its header carries.
  static constexpr size_t kMaxFailureText = 168;

 private:
  struct Step {
    int send_to = -1;    // -1: none
    int recv_from = -1;  // -1: none
    bool fold = false;   // fold what arrives into the value (else: it is the result)
    // The phase, alike on both ends: 0 fold-in, 1.. the rounds,
    // kHandBackTag the hand-back.
    uint64_t tag = 0;
    // Elements [lo, hi) of the value that this step sends and that it
    // receives: all of it, except in the halving algorithm's rounds.
    uint64_t send_lo = 0, send_hi = 0, recv_lo = 0, recv_hi = 0;
    bool gather = false;  // an allgather round (halving): skipped on a mismatch
  };
  // The steps of node `self` of `nodes` for a value of `count` elements of
  // `element_bytes` (what every node computes alike for every other node's
  // signature too, to know what size a message from it has).
  static std::vector<Step> Schedule(int nodes, int self, uint64_t count, size_t element_bytes);
  // The bytes `sender` sends to `receiver` in phase `tag` for a value of
  // signature `sig` (0: none, or none that fits kMaxBulkBytes).
  static size_t BytesSent(int nodes, int sender, int receiver, uint64_t tag, const OpSignature& sig);

  DirectExchange(Params params, Finished finished);
  void RunStep();
  // One transfer of the step ended.
  void Transferred();
  void StepDone();
  // The header of step `step`'s message has arrived (`received`: its
  // receive's status): records what it says and, if a value follows,
  // posts its receive (into bulk_in_, or a drain buffer when it is not
  // ours to fold) before the step can end.
  void HeaderArrived(const Step& step, uint64_t tag, absl::Status received);
  // Folds or takes the step's value. Only the thread that completed the
  // step calls it.
  void Absorb(const Step& step);
  // Where step `at`'s value lands (at the offset of its range): with
  // doubling, output_ on the last step that receives, else whichever own
  // buffer does not hold the current value (which may be on its way out
  // in the same step); in the halving rounds, value_ (output_ on the last
  // reduce-scatter round), folded in place beside the half on its way out,
  // and the allgather in the buffer that holds the node's part.
  uint8_t* LandingFor(size_t at);
  // current_ as a writable buffer of the exchange's or the caller's
  // output, or null when it is the caller's input.
  uint8_t* Writable(const uint8_t* p);
  bool MismatchKnown() const;
  // Calls `finished` with the outcome and, when OK, the result (in output_
  // when set, else in own memory).
  void Finish();
  absl::Status OutcomeLocked() const;  // under mu_
  // Whether `p` points into the caller's buffers (input_ or output_).
  bool InCallerBuffers(const uint8_t* p) const;
  // A transfer from or into the caller's buffers has ended (Abandon).
  void CallerTransferEnded();

  Params params_;
  Finished finished_;
  int nodes_ = 0;
  int self_ = 0;
  size_t payload_bytes_ = 0;
  size_t element_bytes_ = 1;
  bool halving_ = false;
  std::vector<Step> steps_;
  // The step in progress: written by the thread that completes the one
  // before (each step's completion happens after its posting).
  std::atomic<size_t> step_{0};
  // value_ and bulk_in_ (payload_bytes_ each) are allocated on first use,
  // and not zeroed: every byte is written before it is read or sent. A
  // node of one rank on 2 nodes uses neither (it sends from its rank's
  // buffer and folds into its rank's), and a megabyte allocated and
  // cleared per operation costs tens of microseconds and evicts the data
  // of the operation from the cache. Both are allocated by payload() or
  // Start(), before any transfer; LandingFor and Finish only find them.
  uint8_t* Value();
  uint8_t* BulkIn();
  std::unique_ptr<uint8_t[]> value_;  // the node's value
  std::vector<uint8_t> out_;          // the step's first message: header (+ value inline)
  std::vector<uint8_t> in_;           // the step's first message received
  // A value received apart (> kInlineBytes) lands in the buffer that does
  // not hold the node's current value: the fold of that value and the one
  // arriving (a reducing receive), or a value handed back. The current
  // value may still be on its way out in the same step.
  std::unique_ptr<uint8_t[]> bulk_in_;
  const uint8_t* input_ = nullptr;  // UseBuffers
  uint8_t* output_ = nullptr;       // UseBuffers
  // The node's current value: input_, value_, bulk_in_ or output_. Written
  // by the thread that completes a step, before the next is posted.
  const uint8_t* current_ = nullptr;
  uint8_t* landing_ = nullptr;  // under mu_: where this step's value apart lands
  bool bulk_sent_ = false;        // this step sends the value apart
  std::atomic<int> outstanding_{0};
  mutable std::mutex mu_;        // the fields below, written from transport threads
  absl::Status transfer_error_;  // the first of this node's failed transfers
  absl::Status step_error_;      // this step's receive
  bool mismatch_ = false;
  OpSignature other_;        // with mismatch_: a signature another node submitted
  int other_node_ = -1;      // who, when heard directly
  bool peer_failed_ = false; // a node flagged its exchange as failed
  int failed_node_ = -1;
  int failed_code_ = 0;      // its status code and message, as its header said
  std::string failed_text_;
  // Abandon: the caller's buffers are no longer the exchange's, once the
  // transfers the transport holds in them (caller_transfers_) have ended;
  // then released_ runs.
  bool abandoned_ = false;
  int caller_transfers_ = 0;
  std::function<void()> released_;
};

}  // namespace ciuic::daemon
