// A hostile client for the integration tests: opens a session the way the
// SDK does, then writes whatever it likes into the rings.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "ciuic/shm_layout.h"

namespace ciuic::testing {

struct RawSession {
  int sock = -1;
  int doorbell = -1;
  int memfd = -1;
  uint8_t* base = nullptr;
  uint64_t size = 0;
  std::string token;
  std::string refusal;  // what the daemon said when it refused Open

  // Handshake on `socket`.session; false (and a message on stderr) on failure.
  bool Open(const std::string& socket, uint64_t arena_bytes);
  // JoinJob over gRPC; returns the gRPC status code (0 = OK) and message.
  // local_size < 0: every rank on this node (local rank = rank); else a
  // multi-node job whose coordinator is `coordinator` (local rank: rank %
  // local_size).
  int Join(const std::string& socket, const std::string& job, int rank, int world,
           std::string* message, int local_size = -1, const std::string& coordinator = "");
  ~RawSession();

  wire::SessionHeader* header() const { return reinterpret_cast<wire::SessionHeader*>(base); }
  // Publishes `e` at the next submission slot and rings the doorbell.
  void Submit(const wire::SubmissionEntry& e);
  // Waits up to `ms` for a completion; false on timeout.
  bool NextCompletion(wire::CompletionEntry* out, int ms);
  // True once the daemon has hung up on this session.
  bool HungUp(int ms);

 private:
  uint32_t sq_tail_ = 0;
  uint32_t cq_head_ = 0;
};

// A submission: `collective` of `count` elements of `dtype`, reduced with
// `op`, named `name`, its buffers at arena offsets `send_offset` and
// `recv_offset`; every other field zero (flags, timeout, root: the
// caller's).
wire::SubmissionEntry Entry(uint64_t op_id, wire::Collective collective, wire::DataType dtype,
                            wire::ReduceOp op, uint64_t count, uint64_t send_offset,
                            uint64_t recv_offset, std::string_view name);

// A completion's message (at most kMaxMessage bytes, whatever its length
// field says).
std::string MessageOf(const wire::CompletionEntry& done);

}  // namespace ciuic::testing
