#include "collectives/op.h"

#include <limits>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "cuda/gpu_info.h"
#include "reduce/reduce.h"
#include "shm/session_memory.h"

namespace ciuic::daemon {

std::string OpSignature::ToString() const {
  const char* c = wire::CollectiveName(collective);
  std::string out = c ? c : absl::StrCat("collective#", collective);
  if (static_cast<wire::Collective>(collective) == wire::Collective::kBarrier) return out;
  const char* d = wire::DataTypeName(dtype);
  absl::StrAppend(&out, " ", d ? d : absl::StrCat("dtype#", dtype), " count=", count);
  if (reduce_op != 0) {
    const char* r = wire::ReduceOpName(reduce_op);
    absl::StrAppend(&out, " op=", r ? r : absl::StrCat("#", reduce_op));
  }
  if (static_cast<wire::Collective>(collective) == wire::Collective::kBroadcast) {
    absl::StrAppend(&out, " root=", root);
  }
  static const char* kCodecs[] = {"", "none", "fp16", "bf16", "int8", "topk"};
  if (codec != 0) {
    absl::StrAppend(&out, " compression=", codec < 6 ? kCodecs[codec] : "?");
    if (static_cast<wire::Codec>(codec) == wire::Codec::kTopK) absl::StrAppend(&out, ":", codec_ratio);
  }
  return out;
}

namespace {

bool Overlap(const uint8_t* a, uint64_t an, const uint8_t* b, uint64_t bn) {
  if (an == 0 || bn == 0) return false;
  return a < b + bn && b < a + an;
}

}  // namespace

absl::StatusOr<ValidatedOp> ValidateSubmission(const wire::SubmissionEntry& e,
                                               const SessionMemory& memory, int world_size,
                                               int rank) {
  ValidatedOp op;
  op.op_id = e.op_id;
  if (e.name_len == 0 || e.name_len > wire::kMaxOpName) {
    return absl::InvalidArgumentError(
        absl::StrCat("operation name length ", e.name_len, " is not in 1..", wire::kMaxOpName));
  }
  op.name.assign(e.name, e.name_len);
  auto fail = [&](absl::string_view what) {
    return absl::InvalidArgumentError(absl::StrCat("operation '", op.name, "': ", what));
  };
  if ((e.flags & wire::kSubmitFlagDeviceBuffers) != 0) {
    const GpuProbe& gpus = ProbeGpus();
    std::string why;
    if (!gpus.built_with_cuda) {
      why = "this ciuicd was built without CUDA";
    } else if (gpus.devices.empty()) {
      why = absl::StrCat("no CUDA device: ", gpus.unavailable);
    } else {
      why = "device buffers through the daemon are not implemented yet";
    }
    return absl::FailedPreconditionError(
        absl::StrCat("operation '", op.name, "': device (CUDA) buffers: ", why));
  }
  if (e.flags != 0) return fail(absl::StrCat("reserved flags 0x", absl::Hex(e.flags), " set"));
  if (e.codec > static_cast<uint32_t>(wire::Codec::kTopK)) {
    return fail(absl::StrCat("unknown compression codec ", e.codec));
  }
  if (static_cast<wire::Codec>(e.codec) == wire::Codec::kTopK &&
      !(e.codec_ratio > 0.0f && e.codec_ratio <= 1.0f)) {
    return fail(absl::StrCat("topk ratio ", e.codec_ratio, " is not in (0, 1]"));
  }

  op.sig.codec = e.codec;
  op.sig.codec_ratio = static_cast<wire::Codec>(e.codec) == wire::Codec::kTopK ? e.codec_ratio : 0;
  const char* cname = wire::CollectiveName(e.collective);
  if (cname == nullptr) return fail(absl::StrCat("unknown collective ", e.collective));
  const auto collective = static_cast<wire::Collective>(e.collective);
  op.sig.collective = e.collective;
  op.timeout_ms = e.timeout_ms;
  op.priority = e.priority;

  if (collective == wire::Collective::kBarrier) {
    if (e.count != 0) return fail(absl::StrCat("barrier with count ", e.count, " (must be 0)"));
    return op;
  }

  const size_t es = wire::DataTypeSize(e.dtype);
  if (es == 0) return fail(absl::StrCat("unknown dtype ", e.dtype));
  op.sig.dtype = e.dtype;
  op.sig.count = e.count;
  const bool reduces = collective == wire::Collective::kAllreduce ||
                       collective == wire::Collective::kReduceScatter;
  if (reduces) {
    absl::Status s = CheckReducible(e.dtype, e.reduce_op);
    if (!s.ok()) return fail(s.message());
    op.sig.reduce_op = e.reduce_op;
  }
  if (collective == wire::Collective::kBroadcast) {
    if (e.root < 0 || e.root >= world_size) {
      return fail(absl::StrCat("broadcast root ", e.root, " is not a rank of a job of ",
                               world_size, " ranks"));
    }
    op.sig.root = e.root;
  }

  // count * element size * world size must fit comfortably in 63 bits.
  const uint64_t max_count = (std::numeric_limits<uint64_t>::max() >> 1) / es /
                             static_cast<uint64_t>(world_size);
  if (e.count > max_count) return fail(absl::StrCat("count ", e.count, " is too large"));
  const uint64_t block = e.count * es;
  const uint64_t all = block * static_cast<uint64_t>(world_size);
  switch (collective) {
    case wire::Collective::kAllreduce: op.send_bytes = block; op.recv_bytes = block; break;
    case wire::Collective::kReduceScatter: op.send_bytes = all; op.recv_bytes = block; break;
    case wire::Collective::kAllgather: op.send_bytes = block; op.recv_bytes = all; break;
    case wire::Collective::kBroadcast:
      op.send_bytes = rank == e.root ? block : 0;
      op.recv_bytes = block;
      break;
    case wire::Collective::kBarrier: break;
  }
  if (op.send_bytes > 0) {
    auto p = memory.DataRange(e.send_offset, op.send_bytes);
    if (!p.ok()) return fail(absl::StrCat("send ", p.status().message()));
    op.send = *p;
  }
  if (op.recv_bytes > 0) {
    auto p = memory.DataRange(e.recv_offset, op.recv_bytes);
    if (!p.ok()) return fail(absl::StrCat("recv ", p.status().message()));
    op.recv = *p;
  }

  // Aliasing: exactly in place is allowed, partial overlap is not.
  if (Overlap(op.send, op.send_bytes, op.recv, op.recv_bytes)) {
    bool in_place = false;
    switch (collective) {
      case wire::Collective::kAllreduce:
      case wire::Collective::kBroadcast:
        in_place = op.send == op.recv;
        break;
      case wire::Collective::kReduceScatter:  // recv is this rank's block of send
        in_place = op.recv == op.send + static_cast<uint64_t>(rank) * block;
        break;
      case wire::Collective::kAllgather:  // send is this rank's block of recv
        in_place = op.send == op.recv + static_cast<uint64_t>(rank) * block;
        break;
      case wire::Collective::kBarrier: break;
    }
    if (!in_place) return fail("send and recv buffers overlap without being in place");
  }
  return op;
}

}  // namespace ciuic::daemon
