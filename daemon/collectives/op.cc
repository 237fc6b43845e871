#include "collectives/op.h"

#include <cstring>
#include <limits>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "ciuic/collective_rules.h"
#include "ciuic/fast_path.h"
#include "cuda/gpu_info.h"
#include "reduce/reduce.h"
#include "shm/session_memory.h"

namespace ciuic::daemon {

std::string OpSignature::ToString() const {
  // Shared with the SDK's fast path, so a mismatch reads the same on both.
  std::string out =
      wire::SignatureString(collective, dtype, reduce_op, root, count, codec, codec_ratio);
  if (device) out += " in CUDA device memory";
  return out;
}

namespace {

// alltoallv's counts: 2 * world_size uint64 at `offset` (8-aligned) in the
// arena, copied out; op's send and recv bytes are their sums times `es`.
absl::Status ReadSplits(uint64_t offset, const SessionMemory& memory, int world_size, size_t es,
                        ValidatedOp* op) {
  const size_t w = static_cast<size_t>(world_size);
  if (offset % alignof(uint64_t) != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("alltoallv counts at offset ", offset, " are not 8-byte aligned"));
  }
  auto p = memory.DataRange(offset, 2 * w * sizeof(uint64_t));
  if (!p.ok()) return absl::InvalidArgumentError(absl::StrCat("alltoallv counts: ", p.status().message()));
  std::vector<uint64_t> counts(2 * w);
  std::memcpy(counts.data(), *p, counts.size() * sizeof(uint64_t));  // the trainer may change them
  // Every sum times es must fit comfortably in 63 bits.
  const uint64_t max_elems = (std::numeric_limits<uint64_t>::max() >> 1) / es;
  uint64_t sums[2] = {0, 0};
  for (size_t i = 0; i < 2 * w; ++i) {
    uint64_t& sum = sums[i / w];
    if (counts[i] > max_elems - sum) {
      return absl::InvalidArgumentError(absl::StrCat("alltoallv ", i < w ? "send" : "recv",
                                                     " counts add up to too many elements"));
    }
    sum += counts[i];
  }
  op->send_counts.assign(counts.begin(), counts.begin() + w);
  op->recv_counts.assign(counts.begin() + w, counts.end());
  op->send_bytes = sums[0] * es;
  op->recv_bytes = sums[1] * es;
  return absl::OkStatus();
}

}  // namespace

absl::Status ValidateDeviceBuffer(const wire::DeviceBufferDescriptor& d, uint64_t bytes,
                                  int device_count, absl::string_view what) {
  auto bad = [&](absl::string_view why) {
    return absl::InvalidArgumentError(absl::StrCat(what, " device buffer: ", why));
  };
  if ((d.flags & ~wire::kDeviceDescriptorEventValid) != 0) {
    return bad(absl::StrCat("reserved descriptor flags 0x", absl::Hex(d.flags), " set"));
  }
  if (d.allocation_bytes == 0) return bad("allocation of 0 bytes");
  if (d.offset > d.allocation_bytes || bytes > d.allocation_bytes - d.offset) {
    return bad(absl::StrCat(bytes, " bytes at offset ", d.offset,
                            " do not fit in the allocation of ", d.allocation_bytes, " bytes"));
  }
  if (d.device < 0 || d.device >= device_count) {
    return bad(absl::StrCat("device ", d.device, " is not one of this ciuicd's ", device_count,
                            " CUDA device(s)"));
  }
  return absl::OkStatus();
}

absl::StatusOr<ValidatedOp> ValidateSubmission(const wire::SubmissionEntry& e,
                                               const SessionMemory& memory, int world_size,
                                               int rank) {
  ValidatedOp op;
  op.op_id = e.op_id;
  if (e.name_len == 0 || e.name_len > wire::kMaxOpName) {
    return absl::InvalidArgumentError(
        absl::StrCat("operation name length ", e.name_len, " is not in 1..", wire::kMaxOpName));
  }
  if (!wire::IsValidUtf8(e.name, e.name_len)) {
    return absl::InvalidArgumentError("operation name is not valid UTF-8");
  }
  op.name.assign(e.name, e.name_len);
  auto fail = [&](absl::string_view what) {
    return absl::InvalidArgumentError(absl::StrCat("operation '", op.name, "': ", what));
  };
  const bool device = (e.flags & wire::kSubmitFlagDeviceBuffers) != 0;
  if ((e.flags & ~wire::kSubmitFlagDeviceBuffers) != 0) {
    return fail(absl::StrCat("reserved flags 0x", absl::Hex(e.flags), " set"));
  }
  if (e.codec > static_cast<uint32_t>(wire::Codec::kTopK)) {
    return fail(absl::StrCat("unknown compression codec ", e.codec));
  }
  if (static_cast<wire::Codec>(e.codec) == wire::Codec::kTopK &&
      !(e.codec_ratio > 0.0f && e.codec_ratio <= 1.0f)) {
    return fail(absl::StrCat("topk ratio ", e.codec_ratio, " is not in (0, 1]"));
  }

  op.sig.device = device;
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
    if (device) return fail("a barrier has no buffers: the device-buffer flag does not apply");
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
  const bool v_splits = collective == wire::Collective::kAlltoallv;
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
  if (v_splits) {
    if (e.count != 0) return fail(absl::StrCat("alltoallv with count ", e.count, " (must be 0)"));
    absl::Status read = ReadSplits(e.splits_offset, memory, world_size, es, &op);
    if (!read.ok()) return fail(read.message());
  }
  if (!v_splits) {  // alltoallv's come from ReadSplits
    const wire::RankBytes bytes = wire::RankBytesOf(collective, block, world_size, rank, e.root);
    op.send_bytes = bytes.send;
    op.recv_bytes = bytes.recv;
  }
  // Where the two buffers start, in one address space: the daemon's mapping
  // of the arena, or (device buffers of the same allocation) the offset in
  // that allocation. Buffers of different allocations never overlap.
  uint64_t send_at = 0;
  uint64_t recv_at = 0;
  bool same_space = true;
  if (!device) {
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
    send_at = reinterpret_cast<uintptr_t>(op.send);
    recv_at = reinterpret_cast<uintptr_t>(op.recv);
  } else {
    // The records are copied out first: the trainer may change them later.
    auto read = [&](uint64_t offset, absl::string_view what,
                    wire::DeviceBufferDescriptor* out) -> absl::Status {
      if (offset % alignof(wire::DeviceBufferDescriptor) != 0) {
        return fail(absl::StrCat(what, " device descriptor at offset ", offset,
                                 " is not 8-byte aligned"));
      }
      auto p = memory.DataRange(offset, sizeof(*out));
      if (!p.ok()) return fail(absl::StrCat(what, " device descriptor: ", p.status().message()));
      std::memcpy(out, *p, sizeof(*out));
      return absl::OkStatus();
    };
    if (op.send_bytes > 0) {
      absl::Status s = read(e.send_offset, "send", &op.send_device);
      if (!s.ok()) return s;
    }
    if (op.recv_bytes > 0) {
      absl::Status s = read(e.recv_offset, "recv", &op.recv_device);
      if (!s.ok()) return s;
    }
    const GpuProbe& gpus = ProbeGpus();
    if (!gpus.built_with_cuda || gpus.devices.empty()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "operation '", op.name, "': device (CUDA) buffers: ",
          !gpus.built_with_cuda ? "this ciuicd was built without CUDA"
                                : absl::StrCat("no CUDA device: ", gpus.unavailable)));
    }
    const int devices = static_cast<int>(gpus.devices.size());
    if (op.send_bytes > 0) {
      absl::Status s = ValidateDeviceBuffer(op.send_device, op.send_bytes, devices, "send");
      if (!s.ok()) return fail(s.message());
    }
    if (op.recv_bytes > 0) {
      absl::Status s = ValidateDeviceBuffer(op.recv_device, op.recv_bytes, devices, "recv");
      if (!s.ok()) return fail(s.message());
    }
    send_at = op.send_device.offset;
    recv_at = op.recv_device.offset;
    same_space = op.send_bytes > 0 && op.recv_bytes > 0 &&
                 std::memcmp(op.send_device.memory_handle, op.recv_device.memory_handle,
                             wire::kCudaIpcHandleBytes) == 0;
  }

  // Aliasing: exactly in place is allowed, partial overlap is not.
  if (same_space && wire::Overlap(send_at, op.send_bytes, recv_at, op.recv_bytes) &&
      !wire::InPlace(collective, send_at, recv_at, block, rank)) {
    return fail("send and recv buffers overlap without being in place");
  }
  return op;
}

}  // namespace ciuic::daemon
