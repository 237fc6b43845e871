// The ciuic C++ SDK: hand tensors to the node's ciuicd and get collective
// results back.
//
//   ciuic::JobOptions opts;            // job id, rank, world size, ...
//   std::unique_ptr<ciuic::Communicator> comm;
//   ciuic::Status s = ciuic::Communicator::Create(opts, &comm);
//   ciuic::Buffer buf;
//   s = comm->Allocate(n * sizeof(float), &buf);   // zero copy
//   ciuic::Handle h = comm->Allreduce(buf.data(), buf.data(), n,
//                                     ciuic::DataType::kFloat32, ciuic::ReduceOp::kSum);
//   s = h.Wait();
//
// Every collective returns a Handle at once; the daemon works while the
// caller computes. Buffers from Allocate() live in memory shared with the
// daemon and are used in place; any other pointer works too, and is copied
// into shared memory at submission and out of it at completion. A buffer
// belongs to its operation until the handle completes.
//
// Operations are matched across ranks by name (OpOptions::name). Unnamed
// operations are named by their order of submission on the communicator, so
// ranks must then submit them in the same order; named ones may be submitted
// in any order. The same name with a different collective, dtype, count,
// reduce op or root on different ranks fails on every rank with an error
// naming the operation and the mismatch.
//
// Threads: a Communicator may be used from several threads; Handles may be
// waited on from any thread. No call spins while nothing is pending.
//
// Device memory: the overloads taking DeviceBuffer run the collective on
// CUDA memory (cudaMalloc'd, or a framework's caching allocator; not
// cudaMallocAsync pools, which CUDA IPC cannot export). The SDK exports the
// allocation to the daemon (CUDA IPC, once per allocation) and records an
// event on OpOptions::stream, so the daemon's work starts after everything
// enqueued there so far. The handle completes once the results are in every
// rank's device memory. Every rank of an operation must use device memory or
// none. Without CUDA (a libciuic or ciuicd built without it, no GPU) they
// fail with an error saying so.
//
// This header includes only the standard library and itself (no CUDA types:
// streams are void*).
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "ciuic/status.h"

namespace ciuic {

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

size_t DataTypeSize(DataType dtype);
const char* DataTypeName(DataType dtype);  // "float32", ...
const char* ReduceOpName(ReduceOp op);     // "sum", ...
// Parse the names above; false if unknown.
bool ParseDataType(const std::string& name, DataType* out);
bool ParseReduceOp(const std::string& name, ReduceOp* out);

// The default control socket: $CIUIC_SOCKET, else /run/ciuic/ciuicd.sock.
std::string DefaultSocketPath();

struct JobOptions {
  std::string socket_path;  // empty: DefaultSocketPath()
  std::string job_id;
  int rank = 0;
  int world_size = 1;
  int local_rank = -1;  // -1: same as rank
  int local_size = -1;  // -1: same as world_size
  // host:port of the peer service of the daemon that hosts rank 0; needed
  // when the job spans several nodes (local_size < world_size). Empty:
  // $CIUIC_COORDINATOR, else $MASTER_ADDR:$CIUIC_PEER_PORT (default port 7361).
  std::string coordinator;
  // Bytes of shared memory for this communicator's buffers and for staging
  // buffers that are not zero copy. 0: $CIUIC_ARENA_BYTES, else 512 MiB.
  uint64_t arena_bytes = 0;
};

struct OpOptions {
  std::string name;          // empty: named by submission order
  int32_t priority = 0;      // higher runs first among ready operations
  uint32_t timeout_ms = 0;   // 0: the daemon's op_timeout_ms
  // Codec for what crosses the network between nodes (float sum/avg):
  // "none", "fp16", "bf16", "int8", "topk:RATIO"; empty: the daemon's
  // `compression` setting. All ranks must choose the same.
  std::string compression;
  // Device buffers only: the cudaStream_t (as void*) whose work so far the
  // daemon waits for before it reads or writes them; nullptr: the legacy
  // default stream.
  void* stream = nullptr;
};

// A buffer in CUDA device memory: `ptr` on device ordinal `device` (the
// trainer's numbering, which must match the daemon's: give both the same
// CUDA_VISIBLE_DEVICES).
struct DeviceBuffer {
  void* ptr = nullptr;
  int device = 0;
};

// True if this libciuic was built with CUDA; if not, `why` says so.
bool SdkSupportsDeviceBuffers(std::string* why = nullptr);

// The device ordinal of the CUDA device memory at `ptr`, for buffers whose
// owner says only where they are (__cuda_array_interface__ in Python):
// INVALID_ARGUMENT if it is not device memory (host, managed, unknown),
// FAILED_PRECONDITION without CUDA or a device.
Status DeviceOfPointer(const void* ptr, int* device);

// A region of the communicator's shared memory. Move-only; freed when
// destroyed (it must not outlive its Communicator or an operation using it).
class Buffer {
 public:
  Buffer() = default;
  ~Buffer();
  Buffer(Buffer&& other) noexcept;
  Buffer& operator=(Buffer&& other) noexcept;
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;

  void* data() const { return data_; }
  size_t size() const { return size_; }
  template <typename T>
  T* as() const { return static_cast<T*>(data_); }

  struct Arena;  // the SDK's shared-memory mapping; opaque

 private:
  friend struct BufferAccess;  // the SDK's internals
  std::shared_ptr<Arena> arena_;
  void* data_ = nullptr;
  size_t size_ = 0;
};

// The result of an asynchronous operation. Copyable; all copies share the
// operation. A default-constructed Handle is invalid.
class Handle {
 public:
  Handle() = default;

  // Blocks until the operation completes; returns its status. Never for
  // ever: a daemon that has not completed the operation by twice its
  // timeout and a grace (30 s, CIUIC_WAIT_GRACE_MS) after its submission,
  // long past every deadline ciuicd keeps, is stopped or hung, and Wait
  // returns DEADLINE_EXCEEDED saying so (the daemon may still write the
  // output buffers).
  Status Wait();
  // Like Wait, but gives up after `timeout` with DEADLINE_EXCEEDED (the
  // operation goes on; wait again later).
  Status WaitFor(std::chrono::milliseconds timeout);
  // True once the operation has completed, or once Wait would give up on a
  // stopped daemon (above); never blocks.
  bool Test();
  bool valid() const { return state_ != nullptr; }

  struct State;
  explicit Handle(std::shared_ptr<State> state) : state_(std::move(state)) {}

 private:
  std::shared_ptr<State> state_;
};

class Communicator {
 public:
  // Opens a session with the daemon at options.socket_path and joins the
  // job. Blocks until the daemon has accepted the rank (not until all ranks
  // have joined: operations wait for them).
  static Status Create(const JobOptions& options, std::unique_ptr<Communicator>* out);
  ~Communicator();  // ends the session; pending operations fail

  int rank() const;
  int world_size() const;
  int local_rank() const;
  int local_size() const;
  const std::string& job_id() const;
  const std::string& node_name() const;

  // Zero-copy shared memory of at least `bytes` bytes (64-byte aligned).
  Status Allocate(size_t bytes, Buffer* out);
  // True if [ptr, ptr + bytes) lies in this communicator's shared memory.
  bool IsShared(const void* ptr, size_t bytes) const;

  // send and recv hold `count` elements; recv may equal send (in place).
  Handle Allreduce(const void* send, void* recv, size_t count, DataType dtype, ReduceOp op,
                   const OpOptions& options = {});
  // send holds recv_count * world_size elements; rank r receives the
  // reduction of block r. recv may be this rank's block of send.
  Handle ReduceScatter(const void* send, void* recv, size_t recv_count, DataType dtype,
                       ReduceOp op, const OpOptions& options = {});
  // recv holds send_count * world_size elements; block r comes from rank r.
  // send may be this rank's block of recv.
  Handle Allgather(const void* send, void* recv, size_t send_count, DataType dtype,
                   const OpOptions& options = {});
  // Every rank's recv receives root's send (read on root only).
  Handle Broadcast(const void* send, void* recv, size_t count, DataType dtype, int root,
                   const OpOptions& options = {});
  Handle Broadcast(void* buffer, size_t count, DataType dtype, int root,
                   const OpOptions& options = {}) {
    return Broadcast(buffer, buffer, count, dtype, root, options);
  }
  Handle Barrier(const OpOptions& options = {});
  // send and recv hold count * world_size elements each: block j of send
  // goes to rank j, block i of recv comes from rank i (expert parallelism's
  // token exchange). Never in place: send and recv must not overlap.
  Handle Alltoall(const void* send, void* recv, size_t count, DataType dtype,
                  const OpOptions& options = {});
  // Alltoall with blocks of any size (MoE token exchange): send holds
  // send_counts[j] elements for each rank j, back to back in rank order;
  // recv gets recv_counts[i] elements from each rank i, likewise. Both
  // vectors have world_size entries, and rank i's send_counts[j] must equal
  // rank j's recv_counts[i] (else every rank gets INVALID_ARGUMENT). Never in
  // place. The counts are host memory; the buffers may be on the device
  // (below).
  Handle Alltoallv(const void* send, const std::vector<size_t>& send_counts, void* recv,
                   const std::vector<size_t>& recv_counts, DataType dtype,
                   const OpOptions& options = {});

  // The same collectives on device memory (see the top of this file); sizes
  // and in-place rules as above, in-place meaning the same pointer.
  Handle Allreduce(DeviceBuffer send, DeviceBuffer recv, size_t count, DataType dtype,
                   ReduceOp op, const OpOptions& options = {});
  Handle ReduceScatter(DeviceBuffer send, DeviceBuffer recv, size_t recv_count, DataType dtype,
                       ReduceOp op, const OpOptions& options = {});
  Handle Allgather(DeviceBuffer send, DeviceBuffer recv, size_t send_count, DataType dtype,
                   const OpOptions& options = {});
  Handle Broadcast(DeviceBuffer send, DeviceBuffer recv, size_t count, DataType dtype, int root,
                   const OpOptions& options = {});
  // Across nodes staged through pinned host memory: alltoall in segments
  // (staging_segment_bytes), alltoallv whole (2 x the node's send bytes).
  Handle Alltoall(DeviceBuffer send, DeviceBuffer recv, size_t count, DataType dtype,
                  const OpOptions& options = {});
  Handle Alltoallv(DeviceBuffer send, const std::vector<size_t>& send_counts, DeviceBuffer recv,
                   const std::vector<size_t>& recv_counts, DataType dtype,
                   const OpOptions& options = {});

  // When one of this rank's operations was submitted and completed, on the
  // host's steady clock (CLOCK_MONOTONIC; the daemon stamps its completions
  // with it). Ranks compare durations, never these times across hosts.
  struct OpTiming {
    std::string name;
    std::chrono::steady_clock::time_point submitted;
    std::chrono::steady_clock::time_point completed;
  };
  // The operations of this rank that completed successfully since the last
  // call, in the order of their completion. At most kMaxOpTimings are kept;
  // `dropped` (if not null) gets how many older ones were let go meanwhile.
  // The SDK's load balancing (Python's Communicator.balance()) is built on
  // it: how much longer a rank waited for an operation than the rank that
  // submitted it last is how far ahead of that rank it was.
  static constexpr size_t kMaxOpTimings = 4096;
  std::vector<OpTiming> TakeOpTimings(uint64_t* dropped = nullptr);

  class Impl;

 private:
  explicit Communicator(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace ciuic
