// Fuzz target: the daemon's check of what a trainer submits
// (collectives/op.h, ValidateSubmission), which stands between any bytes a
// trainer writes into its ring and arena and the daemon's memory.
//
// Input: the submission's fields (offsets mostly near the arena, sometimes
// any 64-bit value), the job's size and the rank, then patches written
// into the arena (alltoallv counts, device descriptors live there). An
// accepted submission must give buffers inside the arena with exactly the
// sizes the collective implies (recomputed here from the entry and the
// arena), buffers that overlap only in place, the entry's name; device
// buffers are refused with FAILED_PRECONDITION in this build (no CUDA). A
// refused one is INVALID_ARGUMENT (or that FAILED_PRECONDITION) with a
// message naming the operation once its name is valid.
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>

#include "ciuic/shm_layout.h"
#include "collectives/op.h"
#include "fuzz_input.h"
#include "shm/session_memory.h"

namespace {

constexpr const char* kTarget = "submission_fuzz";
constexpr uint64_t kArenaBytes = 64 << 10;

namespace wire = ciuic::wire;
using ciuic::daemon::SessionMemory;

SessionMemory& Memory() {
  static SessionMemory* memory = [] {
    auto m = SessionMemory::Create(kArenaBytes);
    if (!m.ok()) ciuic::fuzz::Broken(kTarget, "SessionMemory::Create fails");
    return m->release();
  }();
  return *memory;
}

// An offset into the session's memfd: mostly a little before, in or a
// little past the data region, sometimes any value at all.
uint64_t Offset(ciuic::fuzz::Input& in, bool any) {
  if (any) return in.U64();
  return wire::kDataOffset + in.U16() % (kArenaBytes + 512) - 256;
}

bool Overlap(const uint8_t* a, uint64_t an, const uint8_t* b, uint64_t bn) {
  return an > 0 && bn > 0 && a < b + bn && b < a + an;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  ciuic::fuzz::Input in(data, size);
  SessionMemory& memory = Memory();
  uint8_t* base = reinterpret_cast<uint8_t*>(memory.header());
  uint8_t* arena = base + memory.data_offset();
  std::memset(arena, 0, memory.data_bytes());

  wire::SubmissionEntry e;
  std::memset(&e, 0, sizeof(e));
  const uint8_t wide = in.Byte();  // which fields take any 64-bit value
  e.op_id = in.U64();
  e.collective = in.Byte() % 9;  // 1..7 are collectives
  e.dtype = in.Byte() % 10;      // 1..8 are dtypes
  e.reduce_op = in.Byte() % 7;   // 1..5 are ops
  e.root = static_cast<int8_t>(in.Byte());
  e.count = (wide & 1) ? in.U64() : in.U16() % 4096;
  e.send_offset = Offset(in, wide & 2);
  e.recv_offset = (wide & 16) ? e.send_offset + in.U16() % 64 : Offset(in, wide & 4);
  e.timeout_ms = in.U32();
  e.priority = static_cast<int32_t>(in.U32());
  e.flags = in.Byte();
  if ((e.flags & 0x80) == 0) e.flags &= wire::kSubmitFlagDeviceBuffers;  // mostly no reserved bit
  e.name_len = in.Byte() % (wire::kMaxOpName + 8);
  in.Bytes(e.name, std::min<size_t>(e.name_len, wire::kMaxOpName));
  e.codec = in.Byte() % 7;
  uint32_t ratio_bits = in.U32();
  std::memcpy(&e.codec_ratio, &ratio_bits, 4);
  e.splits_offset = Offset(in, wide & 8);
  const int world = 1 + in.Byte() % 4;
  const int rank = in.Byte() % world;
  // Patches into the arena: [offset u16][length u8][bytes], until the end.
  while (in.rest_size() > 0) {
    const uint64_t at = in.U16() % kArenaBytes;
    const size_t n = std::min<uint64_t>(in.Byte(), kArenaBytes - at);
    in.Bytes(arena + at, n);
  }

  auto op = ciuic::daemon::ValidateSubmission(e, memory, world, rank);
  const bool device = (e.flags & wire::kSubmitFlagDeviceBuffers) != 0;
  const bool name_ok = e.name_len >= 1 && e.name_len <= wire::kMaxOpName;
  if (!op.ok()) {
    const absl::StatusCode code = op.status().code();
    FUZZ_CHECK(code == absl::StatusCode::kInvalidArgument ||
                   (device && code == absl::StatusCode::kFailedPrecondition),
               "a refusal with an unexpected code");
    const std::string message(op.status().message());
    FUZZ_CHECK(!message.empty(), "a refusal without a message");
    if (name_ok && message.rfind("operation name", 0) != 0) {
      FUZZ_CHECK(message.rfind("operation '", 0) == 0,
                 "a refusal that does not name the operation");
    }
    return 0;
  }
  FUZZ_CHECK(!device, "device buffers accepted by a daemon without CUDA");
  FUZZ_CHECK(name_ok && op->name == std::string(e.name, e.name_len), "the name is not the entry's");
  FUZZ_CHECK(op->op_id == e.op_id, "the op id is not the entry's");
  const auto collective = static_cast<wire::Collective>(e.collective);
  if (collective == wire::Collective::kBarrier) {
    FUZZ_CHECK(op->send_bytes == 0 && op->recv_bytes == 0, "a barrier with buffers");
    return 0;
  }
  // The sizes, recomputed.
  const uint64_t es = wire::DataTypeSize(e.dtype);
  FUZZ_CHECK(es > 0, "an unknown dtype accepted");
  const uint64_t block = e.count * es;
  const uint64_t all = block * static_cast<uint64_t>(world);
  uint64_t send = 0, recv = 0;
  switch (collective) {
    case wire::Collective::kAllreduce:
      send = recv = block;
      break;
    case wire::Collective::kReduceScatter:
      send = all;
      recv = block;
      break;
    case wire::Collective::kAllgather:
      send = block;
      recv = all;
      break;
    case wire::Collective::kBroadcast:
      FUZZ_CHECK(e.root >= 0 && e.root < world, "a broadcast root outside the job accepted");
      send = rank == e.root ? block : 0;
      recv = block;
      break;
    case wire::Collective::kAlltoall:
      send = recv = all;
      break;
    case wire::Collective::kAlltoallv: {
      FUZZ_CHECK(e.count == 0, "alltoallv with a count accepted");
      const uint64_t at = e.splits_offset - memory.data_offset();
      FUZZ_CHECK(e.splits_offset >= memory.data_offset() &&
                     at + 2 * world * sizeof(uint64_t) <= memory.data_bytes(),
                 "alltoallv counts outside the arena accepted");
      for (int i = 0; i < 2 * world; ++i) {
        uint64_t c;
        std::memcpy(&c, arena + at + i * sizeof(uint64_t), sizeof(c));
        (i < world ? send : recv) += c * es;
        FUZZ_CHECK((i < world ? op->send_counts[i] : op->recv_counts[i - world]) == c,
                   "alltoallv counts not the arena's");
      }
      break;
    }
    case wire::Collective::kBarrier:
      break;
  }
  FUZZ_CHECK(op->send_bytes == send && op->recv_bytes == recv,
             "buffer sizes that are not the collective's");
  // Inside the arena, where the entry says.
  uint8_t* end = base + memory.size();
  if (send > 0) {
    FUZZ_CHECK(op->send == base + e.send_offset && op->send >= arena && op->send <= end &&
                   send <= static_cast<uint64_t>(end - op->send),
               "a send buffer outside the arena");
    volatile uint8_t touch = op->send[0] + op->send[send - 1];  // mapped: no fault
    (void)touch;
  }
  if (recv > 0) {
    FUZZ_CHECK(op->recv == base + e.recv_offset && op->recv >= arena && op->recv <= end &&
                   recv <= static_cast<uint64_t>(end - op->recv),
               "a recv buffer outside the arena");
    volatile uint8_t touch = op->recv[0] + op->recv[recv - 1];
    (void)touch;
  }
  if (Overlap(op->send, send, op->recv, recv)) {
    bool in_place = false;
    switch (collective) {
      case wire::Collective::kAllreduce:
      case wire::Collective::kBroadcast:
        in_place = op->send == op->recv;
        break;
      case wire::Collective::kReduceScatter:
        in_place = op->recv == op->send + rank * block;
        break;
      case wire::Collective::kAllgather:
        in_place = op->send == op->recv + rank * block;
        break;
      default:
        break;
    }
    FUZZ_CHECK(in_place, "buffers that overlap without being in place accepted");
  }
  return 0;
}
