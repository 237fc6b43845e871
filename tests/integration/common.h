// Small helpers shared by the integration tests' rank functions.
#pragma once

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "ciuic/ciuic.h"
#include "harness.h"
#include "reference.h"

namespace ciuic::testing {

inline std::unique_ptr<Communicator> JoinJob(const std::string& socket, const std::string& job,
                                             int rank, int world, uint64_t arena = 16 << 20) {
  JobOptions o;
  o.socket_path = socket;
  o.job_id = job;
  o.rank = rank;
  o.world_size = world;
  o.arena_bytes = arena;
  std::unique_ptr<Communicator> c;
  Status s = Communicator::Create(o, &c);
  if (!s.ok()) fprintf(stderr, "rank %d: Create: %s\n", rank, s.ToString().c_str());
  return c;
}

inline bool Contains(const std::string& haystack, const std::string& needle) {
  return haystack.find(needle) != std::string::npos;
}

// How RunAndCheck places and fills the buffers of one operation.
struct CheckOptions {
  std::string name;        // the operation's name
  bool zero_copy = false;  // shared-memory buffers (else heap ones, staged by the SDK)
  // Allreduce/broadcast into the send buffer; reduce_scatter out of its own
  // block of the send buffer; allgather from its own block of the receive one.
  bool in_place = false;
  int root = 0;            // broadcast
  uint64_t salt = 0;       // FillInput's
};

// One rank: runs `coll` on FillInput data and compares the whole receive
// buffer, byte for byte, with ReferenceCollective. Returns 0 or, through
// CHILD_CHECK, 1 with a message naming the operation and the element.
inline int RunAndCheck(Communicator& comm, Coll coll, DataType t, ReduceOp op, size_t count,
                       const CheckOptions& o) {
  const int world = comm.world_size();
  const int rank = comm.rank();
  const size_t es = DataTypeSize(t);
  const size_t send_count = coll == Coll::kReduceScatter ? count * world : count;
  const size_t recv_count = coll == Coll::kAllgather ? count * world : count;
  Buffer sb, rb;
  std::vector<uint8_t> sh, rh;
  uint8_t* send;
  uint8_t* recv;
  if (o.zero_copy) {
    Status s = comm.Allocate(send_count * es, &sb);
    CHILD_CHECK(s.ok(), "%s", s.ToString().c_str());
    s = comm.Allocate(recv_count * es, &rb);
    CHILD_CHECK(s.ok(), "%s", s.ToString().c_str());
    send = static_cast<uint8_t*>(sb.data());
    recv = static_cast<uint8_t*>(rb.data());
  } else {
    sh.resize(send_count * es + 1);
    rh.resize(recv_count * es + 1);
    send = sh.data();
    recv = rh.data();
  }
  FillInput(t, op, rank, send, send_count, o.salt);
  std::memset(recv, 0x5a, recv_count * es);
  const uint8_t* send_arg = send;
  uint8_t* recv_arg = recv;
  if (o.in_place) {
    if (coll == Coll::kAllreduce || coll == Coll::kBroadcast) {
      recv_arg = send;
    } else if (coll == Coll::kReduceScatter) {
      recv_arg = send + rank * count * es;
    } else {
      std::memcpy(recv + rank * count * es, send, count * es);
      send_arg = recv + rank * count * es;
    }
  }
  OpOptions opts;
  opts.name = o.name;
  Handle h;
  switch (coll) {
    case Coll::kAllreduce: h = comm.Allreduce(send_arg, recv_arg, count, t, op, opts); break;
    case Coll::kReduceScatter: h = comm.ReduceScatter(send_arg, recv_arg, count, t, op, opts); break;
    case Coll::kAllgather: h = comm.Allgather(send_arg, recv_arg, count, t, opts); break;
    case Coll::kBroadcast: h = comm.Broadcast(send_arg, recv_arg, count, t, o.root, opts); break;
  }
  Status s = h.Wait();
  CHILD_CHECK(s.ok(), "%s: %s", o.name.c_str(), s.ToString().c_str());
  const std::vector<uint8_t> want = ReferenceCollective(
      coll, t, op, world, rank, o.root, count,
      [&](int r, void* out, size_t n) { FillInput(t, op, r, out, n, o.salt); });
  const uint8_t* got = o.in_place && coll == Coll::kAllgather ? recv : recv_arg;
  for (size_t i = 0; i < recv_count; ++i) {
    CHILD_CHECK(std::memcmp(got + i * es, want.data() + i * es, es) == 0,
                "%s rank %d: element %zu of %zu differs from the reference", o.name.c_str(), rank,
                i, recv_count);
  }
  return 0;
}

}  // namespace ciuic::testing
