// Compressed allreduce (sum) between nodes. See internode.h.
//
// Phase 1, reduce-scatter: node j owns segment j. Every node encodes each
// other segment once and sends it straight to its owner; the owner decodes
// the N-1 contributions and adds them, in node order, into its own segment.
// Phase 2, allgather: each owner encodes its summed segment once, keeps the
// decoded form itself and sends the encoding to every other node, which
// decodes it in place. So each element is compressed exactly twice, whatever
// N is (a ring that re-compresses at every hop would add error per hop), and
// every node ends with the same bits.
//
// Encoded sizes can vary (int8 sends a block raw when it holds NaN/Inf), so
// every message is a 8-byte size header followed by the payload.
#include <condition_variable>
#include <cstring>
#include <map>
#include <mutex>
#include <set>

#include "absl/strings/str_cat.h"
#include "collectives/internode/internode.h"

namespace ciuic::daemon {

namespace {

// Transfers posted together and waited for together. Wait() returns only
// once every callback has run, also on error or deadline.
class Transfers {
 public:
  Transfers(Transport* t, const char* what) : t_(t), what_(what) {}
  ~Transfers() { WaitAllCallbacks(); }

  void Send(int peer, int channel, uint64_t tag, const void* p, size_t n) {
    Posted(peer);
    t_->Send(peer, channel, tag, p, n, [this, peer](absl::Status s) { Done(peer, std::move(s)); });
  }
  void Recv(int peer, int channel, uint64_t tag, void* p, size_t n) {
    Posted(peer);
    t_->Recv(peer, channel, tag, p, n, [this, peer](absl::Status s) { Done(peer, std::move(s)); });
  }

  absl::Status Wait(std::chrono::steady_clock::time_point deadline) {
    std::unique_lock<std::mutex> lock(mu_);
    if (!cv_.wait_until(lock, deadline, [&] { return pending_ == 0; })) {
      std::set<int> peers = waiting_on_;
      lock.unlock();
      absl::Status late = absl::DeadlineExceededError(
          absl::StrCat(what_, ": timed out waiting for node ", *peers.begin()));
      for (int p : peers) t_->FailPeer(p, late);
      WaitAllCallbacks();
      lock.lock();
      if (first_error_.ok()) first_error_ = late;
    }
    return first_error_;
  }

 private:
  void Posted(int peer) {
    std::lock_guard<std::mutex> lock(mu_);
    ++pending_;
    ++per_peer_[peer];
    waiting_on_.insert(peer);
  }
  void Done(int peer, absl::Status s) {
    std::lock_guard<std::mutex> lock(mu_);
    if (!s.ok() && first_error_.ok()) {
      first_error_ = absl::Status(s.code(), absl::StrCat(what_, ": node ", peer, ": ", s.message()));
    }
    if (--per_peer_[peer] == 0) waiting_on_.erase(peer);
    if (--pending_ == 0) cv_.notify_all();
  }
  void WaitAllCallbacks() {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return pending_ == 0; });
  }

  Transport* t_;
  const char* what_;
  std::mutex mu_;
  std::condition_variable cv_;
  int pending_ = 0;
  std::map<int, int> per_peer_;
  std::set<int> waiting_on_;
  absl::Status first_error_;
};

constexpr uint64_t kPhaseShift = 20;

uint64_t Tag(const InterNodeContext& ctx, int phase, int peer, bool payload) {
  return ctx.tag_base | (static_cast<uint64_t>(phase) << kPhaseShift) |
         (static_cast<uint64_t>(peer) << 1) | (payload ? 1 : 0);
}

// Sends encoded[j] (sizes[j] bytes) to every j in `to` and receives one
// message from every j in `from` into rx[j] (capacity cap[j]), header first.
absl::Status Exchange(const InterNodeContext& ctx, const char* what, int phase,
                      const std::vector<int>& to, const std::vector<uint8_t*>& encoded,
                      std::vector<uint64_t>& sizes, const std::vector<int>& from,
                      const std::vector<uint8_t*>& rx, const std::vector<size_t>& cap,
                      std::vector<uint64_t>& rx_sizes) {
  Transport* t = ctx.transport;
  const int me = t->self();
  const int channels = std::max(1, t->num_channels());
  {
    Transfers headers(t, what);
    for (int j : from) headers.Recv(j, j % channels, Tag(ctx, phase, j, false), &rx_sizes[j], 8);
    for (int j : to) headers.Send(j, me % channels, Tag(ctx, phase, me, false), &sizes[j], 8);
    absl::Status s = headers.Wait(ctx.deadline);
    if (!s.ok()) return s;
  }
  for (int j : from) {
    if (rx_sizes[j] > cap[j]) {
      return absl::DataLossError(absl::StrCat(what, ": node ", j, " announced ", rx_sizes[j],
                                              " bytes, at most ", cap[j], " expected"));
    }
  }
  Transfers payload(t, what);
  for (int j : from) {
    if (rx_sizes[j] > 0) payload.Recv(j, j % channels, Tag(ctx, phase, j, true), rx[j], rx_sizes[j]);
  }
  for (int j : to) {
    if (sizes[j] > 0) payload.Send(j, me % channels, Tag(ctx, phase, me, true), encoded[j], sizes[j]);
  }
  return payload.Wait(ctx.deadline);
}

}  // namespace

absl::Status AllreduceCompressed(const InterNodeContext& ctx, const Codec& codec,
                                 ErrorFeedback* feedback, const std::string& name,
                                 wire::DataType dtype, void* data, size_t count,
                                 CompressionStats* stats) {
  static const char* kWhat = "AllreduceCompressed";
  if (absl::Status s = codec.Supports(dtype); !s.ok()) return s;
  if ((ctx.tag_base & ((uint64_t{1} << 24) - 1)) != 0) {
    return absl::InvalidArgumentError("AllreduceCompressed: tag_base has low bits set");
  }
  Transport* t = ctx.transport;
  const int n = t->num_peers();
  const int me = t->self();
  if (n <= 1 || count == 0) return absl::OkStatus();
  const size_t es = wire::DataTypeSize(static_cast<uint32_t>(dtype));
  auto* base = static_cast<uint8_t*>(data);
  auto first = [&](int j) { return count * static_cast<size_t>(j) / static_cast<size_t>(n); };
  auto len = [&](int j) { return first(j + 1) - first(j); };
  auto seg = [&](int j) { return base + first(j) * es; };
  const bool fb = feedback != nullptr && dtype == wire::DataType::kFloat32;

  // Scratch: [encoded per peer][received per peer][float32 image of the buffer].
  std::vector<size_t> enc_cap(n), off(n), rx_off(n);
  size_t total = 0;
  for (int j = 0; j < n; ++j) {
    enc_cap[j] = (codec.MaxEncodedBytes(dtype, len(j)) + 63) / 64 * 64;
    off[j] = total;
    total += enc_cap[j];
  }
  for (int j = 0; j < n; ++j) {
    rx_off[j] = total;
    total += enc_cap[me];  // everything received in phase 1 is a segment `me`
  }
  const size_t phase2_rx = total;
  size_t phase2_total = 0;
  std::vector<size_t> rx2_off(n);
  for (int j = 0; j < n; ++j) {
    rx2_off[j] = phase2_rx + phase2_total;
    phase2_total += enc_cap[j];
  }
  total += phase2_total;
  const size_t image_off = total;
  if (fb) total += count * sizeof(float) + 64;
  uint8_t* scratch = ctx.scratch->Get(total);

  std::vector<int> others;
  for (int j = 0; j < n; ++j) {
    if (j != me) others.push_back(j);
  }
  std::vector<uint8_t*> enc(n), rx(n), rx2(n);
  std::vector<size_t> rx_cap(n, enc_cap[me]), rx2_cap(n);
  for (int j = 0; j < n; ++j) {
    enc[j] = scratch + off[j];
    rx[j] = scratch + rx_off[j];
    rx2[j] = scratch + rx2_off[j];
    rx2_cap[j] = enc_cap[j];
  }
  std::vector<uint64_t> sizes(n, 0), rx_sizes(n, 0);

  // Phase 1: this node's contribution (plus what compression dropped last
  // time), encoded once per owner.
  float* image = fb ? reinterpret_cast<float*>(scratch + image_off) : nullptr;
  if (fb) feedback->Apply(name, static_cast<float*>(data), count);
  for (int j : others) {
    sizes[j] = codec.Encode(dtype, seg(j), len(j), enc[j]);
    stats->raw_bytes += len(j) * es;
    stats->wire_bytes += sizes[j];
  }
  if (fb) {
    // What the owners will see of our contribution: the decoded segments.
    std::memcpy(image + first(me), seg(me), len(me) * sizeof(float));
    for (int j : others) {
      absl::Status s = codec.Decode(dtype, enc[j], sizes[j], len(j), image + first(j));
      if (!s.ok()) return s;
    }
    feedback->Update(name, static_cast<const float*>(data), image, count);
  }
  absl::Status s = Exchange(ctx, kWhat, 0, others, enc, sizes, others, rx, rx_cap, rx_sizes);
  if (!s.ok()) return s;
  for (int j : others) {  // node order: the owner's sum is reproducible
    s = codec.DecodeAdd(dtype, rx[j], rx_sizes[j], len(me), seg(me));
    if (!s.ok()) return absl::Status(s.code(), absl::StrCat(kWhat, ": from node ", j, ": ", s.message()));
  }

  // Phase 2: the owner's sum, encoded once; the owner keeps what it sends.
  const std::string owner_name = name + "#owner";
  if (fb) feedback->Apply(owner_name, reinterpret_cast<float*>(seg(me)), len(me));
  const uint64_t mine = codec.Encode(dtype, seg(me), len(me), enc[me]);
  if (fb) std::memcpy(image + first(me), seg(me), len(me) * sizeof(float));
  s = codec.Decode(dtype, enc[me], mine, len(me), seg(me));
  if (!s.ok()) return s;
  if (fb) feedback->Update(owner_name, image + first(me), reinterpret_cast<float*>(seg(me)), len(me));
  std::vector<uint8_t*> out(n, enc[me]);
  std::vector<uint64_t> out_sizes(n, mine);
  stats->raw_bytes += len(me) * es * others.size();
  stats->wire_bytes += mine * others.size();
  s = Exchange(ctx, kWhat, 1, others, out, out_sizes, others, rx2, rx2_cap, rx_sizes);
  if (!s.ok()) return s;
  for (int j : others) {
    s = codec.Decode(dtype, rx2[j], rx_sizes[j], len(j), seg(j));
    if (!s.ok()) return absl::Status(s.code(), absl::StrCat(kWhat, ": from node ", j, ": ", s.message()));
  }
  return absl::OkStatus();
}

}  // namespace ciuic::daemon
