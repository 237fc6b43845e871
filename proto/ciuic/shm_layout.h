// The shared-memory contract between a trainer (the SDK) and ciuicd.
//
// A session is opened on the daemon's session socket (SOCK_SEQPACKET, path
// "<control socket>.session"). The daemon learns the trainer's uid and pid
// from the kernel (SO_PEERCRED), creates a sealed memfd for the session and
// passes it back with SCM_RIGHTS, together with an eventfd (the submission
// doorbell). The socket stays open for the life of the session: its hang-up
// is how each side learns that the other is gone.
//
// The memfd holds, at fixed offsets described by SessionHeader:
//   [0, 4 KiB)          SessionHeader
//   [sq_offset, ...)    submission ring: SubmissionEntry[sq_capacity]
//   [cq_offset, ...)    completion ring: CompletionEntry[cq_capacity]
//   [data_offset, end)  the arena in which the trainer allocates tensors
//
// Both rings are single-producer single-consumer with free-running 32-bit
// indices (index & (capacity - 1) is the slot). The trainer produces
// submissions and consumes completions; the daemon the reverse.
//
// Doorbells. Submission: after publishing sq_tail the trainer rings the
// eventfd only if the daemon armed it (daemon_armed, exchanged to 0), so a
// busy daemon costs the trainer no syscall. Completion: cq_tail is a futex
// word; the daemon calls FUTEX_WAKE after publishing when trainer_waiters is
// non-zero. Nobody spins while nothing is pending.
//
// Trust. Everything the trainer can write here is untrusted by the daemon:
// it copies an entry out of the ring before looking at it, validates every
// field, and keeps its own copy of the ring indices.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>

namespace ciuic::wire {

inline constexpr uint64_t kSessionMagic = 0x31765f6369756963ULL;  // "ciuic_v1"
inline constexpr uint32_t kLayoutVersion = 4;  // 3: device buffer descriptors; 4: splits_offset

enum class Collective : uint32_t {
  kAllreduce = 1,
  kReduceScatter = 2,
  kAllgather = 3,
  kBroadcast = 4,
  kBarrier = 5,
  kAlltoall = 6,
  kAlltoallv = 7,
};

enum class DataType : uint32_t {
  kFloat32 = 1,
  kFloat64 = 2,
  kFloat16 = 3,
  kBFloat16 = 4,
  kInt8 = 5,
  kUInt8 = 6,
  kInt32 = 7,
  kInt64 = 8,
};

enum class ReduceOp : uint32_t {
  kSum = 1,
  kAvg = 2,
  kMin = 3,
  kMax = 4,
  kProd = 5,
};

// Every DataType and ReduceOp, for code (and tests) that go through them all.
inline constexpr DataType kAllDataTypes[] = {
    DataType::kFloat32, DataType::kFloat64, DataType::kFloat16, DataType::kBFloat16,
    DataType::kInt8,    DataType::kUInt8,   DataType::kInt32,   DataType::kInt64,
};
inline constexpr ReduceOp kAllReduceOps[] = {ReduceOp::kSum, ReduceOp::kAvg, ReduceOp::kMin,
                                             ReduceOp::kMax, ReduceOp::kProd};

// Size in bytes of one element, or 0 for a value that is no DataType.
inline constexpr size_t DataTypeSize(uint32_t dtype) {
  switch (static_cast<DataType>(dtype)) {
    case DataType::kFloat32: return 4;
    case DataType::kFloat64: return 8;
    case DataType::kFloat16: return 2;
    case DataType::kBFloat16: return 2;
    case DataType::kInt8: return 1;
    case DataType::kUInt8: return 1;
    case DataType::kInt32: return 4;
    case DataType::kInt64: return 8;
  }
  return 0;
}

// Names used in messages, tables and command-line flags; nullptr if unknown.
inline constexpr const char* DataTypeName(uint32_t dtype) {
  switch (static_cast<DataType>(dtype)) {
    case DataType::kFloat32: return "float32";
    case DataType::kFloat64: return "float64";
    case DataType::kFloat16: return "float16";
    case DataType::kBFloat16: return "bfloat16";
    case DataType::kInt8: return "int8";
    case DataType::kUInt8: return "uint8";
    case DataType::kInt32: return "int32";
    case DataType::kInt64: return "int64";
  }
  return nullptr;
}

inline constexpr const char* ReduceOpName(uint32_t op) {
  switch (static_cast<ReduceOp>(op)) {
    case ReduceOp::kSum: return "sum";
    case ReduceOp::kAvg: return "avg";
    case ReduceOp::kMin: return "min";
    case ReduceOp::kMax: return "max";
    case ReduceOp::kProd: return "prod";
  }
  return nullptr;
}

inline constexpr const char* CollectiveName(uint32_t c) {
  switch (static_cast<Collective>(c)) {
    case Collective::kAllreduce: return "allreduce";
    case Collective::kReduceScatter: return "reduce_scatter";
    case Collective::kAllgather: return "allgather";
    case Collective::kBroadcast: return "broadcast";
    case Collective::kBarrier: return "barrier";
    case Collective::kAlltoall: return "alltoall";
    case Collective::kAlltoallv: return "alltoallv";
  }
  return nullptr;
}

inline constexpr size_t kMaxOpName = 104;

// Whether `p[0..n)` is well-formed UTF-8 (no overlong forms, surrogates or
// code points past U+10FFFF). Operation names must be: they travel in
// protobuf strings (the ordering stream, ciuicctl), which refuse anything else.
inline bool IsValidUtf8(const char* p, size_t n) {
  const auto* s = reinterpret_cast<const unsigned char*>(p);
  size_t i = 0;
  while (i < n) {
    const unsigned char c = s[i];
    size_t len = 0;
    uint32_t cp = 0;
    if (c < 0x80) {
      ++i;
      continue;
    } else if ((c & 0xE0) == 0xC0) {
      len = 2;
      cp = c & 0x1F;
    } else if ((c & 0xF0) == 0xE0) {
      len = 3;
      cp = c & 0x0F;
    } else if ((c & 0xF8) == 0xF0) {
      len = 4;
      cp = c & 0x07;
    } else {
      return false;
    }
    if (n - i < len) return false;
    for (size_t k = 1; k < len; ++k) {
      if ((s[i + k] & 0xC0) != 0x80) return false;
      cp = (cp << 6) | (s[i + k] & 0x3F);
    }
    static constexpr uint32_t kMin[] = {0, 0, 0x80, 0x800, 0x10000};
    if (cp < kMin[len] || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return false;
    i += len;
  }
  return true;
}
inline constexpr size_t kMaxMessage = 232;

// What a trainer hears of an error message longer than kMaxMessage.
// First, quoted names ('...' without a space: operation names up to
// kMaxOpName bytes, job ids up to 256) longer than kNameKeep bytes keep
// their first kNameHead and last kNameTail bytes around "...": a mismatch
// then still shows both ranks' signatures, and a nested error its
// explanation, whatever the names' lengths. If that is still too long: its
// first kMessageHead bytes (the operation and what happened to it),
// " ... ", and its last bytes (a nested error's root cause comes last:
// "ring failed: lost peer 1: node n1 failed run 5: rank 3 left"). Cuts fall
// between UTF-8 characters. Writes into `out`, returns the bytes used.
inline constexpr size_t kMessageHead = 150;
inline constexpr size_t kNameHead = 24;
inline constexpr size_t kNameTail = 8;
inline constexpr size_t kNameKeep = kNameHead + 3 + kNameTail;

namespace internal {

inline bool Utf8Continuation(const char* s, size_t i) {
  return (static_cast<unsigned char>(s[i]) & 0xC0) == 0x80;
}

// `message` (n > kMaxMessage bytes) cut to kMaxMessage: its first
// kMessageHead bytes, " ... ", its last bytes, cuts between characters.
inline size_t CutMiddle(const char* message, size_t n, char (&out)[kMaxMessage]) {
  static constexpr char kGap[] = " ... ";
  static constexpr size_t kGapBytes = sizeof(kGap) - 1;
  size_t head = kMessageHead;
  while (head > 0 && Utf8Continuation(message, head)) --head;  // message[head] starts a character
  size_t tail = n - (kMaxMessage - kMessageHead - kGapBytes);
  while (tail < n && Utf8Continuation(message, tail)) ++tail;
  std::memcpy(out, message, head);
  std::memcpy(out + head, kGap, kGapBytes);
  std::memcpy(out + head + kGapBytes, message + tail, n - tail);
  return head + kGapBytes + (n - tail);
}

// `message` with its long quoted names shortened (see ClipMessage).
inline std::string ShortenQuotedNames(const char* message, size_t n) {
  std::string out;
  out.reserve(n);
  size_t i = 0;
  while (i < n) {
    const void* q = std::memchr(message + i, '\'', n - i);
    if (q == nullptr) {
      out.append(message + i, n - i);
      break;
    }
    const size_t open = static_cast<size_t>(static_cast<const char*>(q) - message);
    out.append(message + i, open + 1 - i);  // through the opening quote
    const size_t first = open + 1;
    const void* e = first < n ? std::memchr(message + first, '\'', n - first) : nullptr;
    if (e == nullptr) {
      out.append(message + first, n - first);
      break;
    }
    const size_t close = static_cast<size_t>(static_cast<const char*>(e) - message);
    const size_t len = close - first;
    if (len > kNameKeep && std::memchr(message + first, ' ', len) == nullptr) {
      size_t head = first + kNameHead;
      while (head > first && Utf8Continuation(message, head)) --head;
      size_t tail = close - kNameTail;
      while (tail < close && Utf8Continuation(message, tail)) ++tail;
      out.append(message + first, head - first);
      out += "...";
      out.append(message + tail, close - tail);
    } else {
      out.append(message + first, len);
    }
    out += '\'';
    i = close + 1;
  }
  return out;
}

}  // namespace internal

inline size_t ClipMessage(const char* message, size_t n, char (&out)[kMaxMessage]) {
  if (n <= kMaxMessage) {
    // An OK status's message may be a null pointer with n == 0: memcpy from
    // null is undefined even for 0 bytes.
    if (n > 0) std::memcpy(out, message, n);
    return n;
  }
  const std::string shorter = internal::ShortenQuotedNames(message, n);
  if (shorter.size() <= kMaxMessage) {
    std::memcpy(out, shorter.data(), shorter.size());
    return shorter.size();
  }
  return internal::CutMiddle(shorter.data(), shorter.size(), out);
}

// Buffers per collective (count is in elements; W is the job's world size):
//   allreduce       send: count        recv: count (may be the send buffer)
//   reduce_scatter  send: count * W    recv: count (rank r gets block r)
//   allgather       send: count        recv: count * W (block r from rank r)
//   broadcast       send: count (read on root only)  recv: count
//   barrier         no buffers; count must be 0
//   alltoall        send: count * W (block j goes to rank j)
//                   recv: count * W (block i comes from rank i); never in place
//   alltoallv       count must be 0; splits_offset locates 2 * W uint64 element
//                   counts: send_counts[W] then recv_counts[W]. send holds
//                   sum(send_counts) elements, block j (send_counts[j] of them,
//                   blocks back to back in rank order) going to rank j; recv
//                   holds sum(recv_counts), block i from rank i. Rank i's
//                   send_counts[j] must equal rank j's recv_counts[i]. Never
//                   in place.
struct SubmissionEntry {
  uint64_t op_id;        // chosen by the SDK, echoed in the completion
  uint32_t collective;   // Collective
  uint32_t dtype;        // DataType
  uint32_t reduce_op;    // ReduceOp (reductions only)
  int32_t root;          // broadcast only
  uint64_t count;
  uint64_t send_offset;  // byte offsets into the session memfd
  uint64_t recv_offset;
  uint32_t timeout_ms;   // 0: the daemon's op_timeout_ms
  int32_t priority;      // higher goes first among ready operations
  uint32_t flags;        // kSubmitFlag* bits; the others are reserved (0)
  uint32_t name_len;     // bytes of name used, <= kMaxOpName
  // Compression of what crosses the network (multi-node float sum/avg):
  // 0 = the daemon's `compression` setting, else Codec.
  uint32_t codec;
  float codec_ratio;     // topk only: fraction of elements kept, (0, 1]
  uint64_t splits_offset;  // alltoallv only: byte offset (8-aligned) of the counts
  char name[kMaxOpName]; // matches the operation across ranks
};
static_assert(sizeof(SubmissionEntry) == 184);

// SubmissionEntry.flags: the buffers are CUDA device memory. send_offset
// and recv_offset then point at DeviceBufferDescriptor records in the
// session arena (8-byte aligned) instead of at data; the buffer sizes are
// the same as for host buffers. Not allowed on a barrier (no buffers). A
// daemon that cannot take device buffers ends such an operation with
// FAILED_PRECONDITION saying why (built without CUDA, no usable device).
inline constexpr uint32_t kSubmitFlagDeviceBuffers = 1u << 0;

inline constexpr size_t kCudaIpcHandleBytes = 64;  // cudaIpc{Mem,Event}Handle_t

// DeviceBufferDescriptor.flags: event_handle holds an IPC event recorded on
// the trainer's stream after the buffer's data was written; the daemon's
// work on the buffer waits for it. Without it the daemon starts at once
// (the trainer synchronised its stream itself).
inline constexpr uint32_t kDeviceDescriptorEventValid = 1u << 0;

// One device buffer: the allocation that holds it, exported with
// cudaIpcGetMemHandle (whose handle always names the allocation's base),
// and where in that allocation the buffer starts. The daemon checks
// offset + the operation's bytes <= allocation_bytes and device against its
// device count before it opens anything.
struct DeviceBufferDescriptor {
  uint8_t memory_handle[kCudaIpcHandleBytes];  // cudaIpcMemHandle_t of the allocation
  uint64_t offset;            // of the buffer from the allocation's base
  uint64_t allocation_bytes;  // size of the allocation (cuMemGetAddressRange)
  int32_t device;             // CUDA device ordinal, as the trainer numbers it
  uint32_t flags;             // kDeviceDescriptor* bits; the others are reserved (0)
  uint8_t event_handle[kCudaIpcHandleBytes];   // cudaIpcEventHandle_t, if flagged
};
static_assert(sizeof(DeviceBufferDescriptor) == 152);

enum class Codec : uint32_t {
  kDefault = 0,
  kNone = 1,
  kFp16 = 2,
  kBf16 = 3,
  kInt8 = 4,
  kTopK = 5,
};

struct CompletionEntry {
  uint64_t op_id;
  int32_t status_code;   // absl::StatusCode / ciuic::StatusCode values
  uint32_t message_len;  // bytes of message used, <= kMaxMessage
  // When the daemon wrote the entry: CLOCK_MONOTONIC in ns, the clock the
  // trainers on the host read too (the SDK's operation timings; 0: unknown).
  uint64_t completed_ns;
  char message[kMaxMessage];
};
static_assert(sizeof(CompletionEntry) == 256);

struct alignas(64) SessionHeader {
  uint64_t magic;
  uint32_t version;
  uint32_t reserved0;
  uint64_t memfd_bytes;
  uint64_t sq_offset;
  uint64_t cq_offset;
  uint64_t data_offset;
  uint64_t data_bytes;
  uint32_t sq_capacity;  // power of two
  uint32_t cq_capacity;  // power of two, >= sq_capacity

  alignas(64) std::atomic<uint32_t> sq_tail;          // trainer writes
  alignas(64) std::atomic<uint32_t> sq_head;          // daemon writes
  alignas(64) std::atomic<uint32_t> daemon_armed;     // daemon sets, trainer clears
  alignas(64) std::atomic<uint32_t> cq_tail;          // daemon writes; futex word
  alignas(64) std::atomic<uint32_t> cq_head;          // trainer writes
  alignas(64) std::atomic<uint32_t> trainer_waiters;  // trainer writes
};
static_assert(std::atomic<uint32_t>::is_always_lock_free);
static_assert(sizeof(SessionHeader) <= 4096);

inline constexpr uint32_t kRingCapacity = 1024;
inline constexpr uint64_t kHeaderBytes = 4096;
inline constexpr uint64_t kSqOffset = kHeaderBytes;
inline constexpr uint64_t kCqOffset = kSqOffset + kRingCapacity * sizeof(SubmissionEntry);
inline constexpr uint64_t kDataOffset = 1 << 20;  // data starts 1 MiB in
static_assert(kCqOffset + kRingCapacity * sizeof(CompletionEntry) <= kDataOffset);

// One round of a spin on a word in shared memory (the rings here, the fast
// path's slots): tells the core the thread is waiting, so that the sibling
// hyperthread gets the pipeline and leaving the loop costs no pipeline flush.
inline void CpuRelax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

// Session socket messages (one datagram each on SOCK_SEQPACKET).
struct HelloRequest {
  uint64_t magic;         // kSessionMagic
  uint32_t version;       // kLayoutVersion
  uint32_t reserved;
  uint64_t arena_bytes;   // data bytes the trainer asks for
};

inline constexpr size_t kTokenBytes = 16;

// Sent with two fds (SCM_RIGHTS): the memfd and the submission eventfd,
// unless status_code is not 0.
struct HelloReply {
  uint64_t magic;
  int32_t status_code;
  uint32_t message_len;
  uint64_t session_id;
  uint64_t memfd_bytes;
  uint8_t token[kTokenBytes];  // proves the session to the Control service
  char message[kMaxMessage];
};

}  // namespace ciuic::wire
