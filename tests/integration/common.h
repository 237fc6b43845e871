// Small helpers shared by the integration tests' rank functions.
#pragma once

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "ciuic/ciuic.h"
#include "harness.h"
#include "reference.h"

namespace ciuic::testing {

// Rank `rank` of a single-node job of `world` ranks on the daemon at
// `socket`: the status of Communicator::Create.
inline Status CreateComm(const std::string& socket, const std::string& job, int rank, int world,
                         uint64_t arena, std::unique_ptr<Communicator>* out) {
  JobOptions o;
  o.socket_path = socket;
  o.job_id = job;
  o.rank = rank;
  o.world_size = world;
  o.arena_bytes = arena;
  return Communicator::Create(o, out);
}

inline std::unique_ptr<Communicator> JoinJob(const std::string& socket, const std::string& job,
                                             int rank, int world, uint64_t arena = 16 << 20) {
  std::unique_ptr<Communicator> c;
  Status s = CreateComm(socket, job, rank, world, arena, &c);
  if (!s.ok()) fprintf(stderr, "rank %d: Create: %s\n", rank, s.ToString().c_str());
  return c;
}

// A fresh 2-rank job on the daemon at `socket` runs an allreduce: the
// daemon still serves (after whatever a test did to it or its peers).
inline void ExpectServes(const std::string& socket) {
  const std::string job = UniqueJobId("still-serves");
  auto codes = RunRanks(2, [&](int rank) {
    auto comm = JoinJob(socket, job, rank, 2);
    if (comm == nullptr) return 1;
    std::vector<int32_t> v(1000, rank + 1);
    Status s = comm->Allreduce(v.data(), v.data(), v.size(), DataType::kInt32, ReduceOp::kSum).Wait();
    if (!s.ok() || v[999] != 3) {
      fprintf(stderr, "rank %d: %s (got %d)\n", rank, s.ToString().c_str(), v[999]);
      return 1;
    }
    return 0;
  }, std::chrono::seconds(30));
  EXPECT_EQ(codes, (std::vector<int>{0, 0})) << "the daemon no longer serves new jobs";
}

inline bool Contains(const std::string& haystack, const std::string& needle) {
  return haystack.find(needle) != std::string::npos;
}

// How RunAndCheck places and fills the buffers of one operation.
struct CheckOptions {
  std::string name;        // the operation's name
  bool zero_copy = false;  // shared-memory buffers (else heap ones, staged by the SDK)
  // Allreduce/broadcast into the send buffer; reduce_scatter out of its own
  // block of the send buffer; allgather from its own block of the receive one;
  // ignored for alltoall (never in place).
  bool in_place = false;
  int root = 0;            // broadcast
  uint64_t salt = 0;       // FillInput's
  bool small_values = false;  // FillSmall's data instead of FillInput's
};

// One rank: runs `coll` on FillInput data and compares the whole receive
// buffer, byte for byte, with ReferenceCollective. Returns 0 or, through
// CHILD_CHECK, 1 with a message naming the operation and the element.
inline int RunAndCheck(Communicator& comm, Coll coll, DataType t, ReduceOp op, size_t count,
                       const CheckOptions& o) {
  const int world = comm.world_size();
  const int rank = comm.rank();
  const size_t es = DataTypeSize(t);
  const size_t send_count =
      coll == Coll::kReduceScatter || coll == Coll::kAlltoall ? count * world : count;
  const size_t recv_count =
      coll == Coll::kAllgather || coll == Coll::kAlltoall ? count * world : count;
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
  const auto fill = [&](int r, void* out, size_t n) {
    if (o.small_values) {
      FillSmall(t, op, r, out, n);
    } else {
      FillInput(t, op, r, out, n, o.salt);
    }
  };
  fill(rank, send, send_count);
  std::memset(recv, 0x5a, recv_count * es);
  const uint8_t* send_arg = send;
  uint8_t* recv_arg = recv;
  if (o.in_place && coll != Coll::kAlltoall) {  // alltoall is never in place
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
    case Coll::kAlltoall: h = comm.Alltoall(send_arg, recv_arg, count, t, opts); break;
  }
  Status s = h.Wait();
  CHILD_CHECK(s.ok(), "%s: %s", o.name.c_str(), s.ToString().c_str());
  const std::vector<uint8_t> want =
      ReferenceCollective(coll, t, op, world, rank, o.root, count, fill);
  const uint8_t* got = o.in_place && coll == Coll::kAllgather ? recv : recv_arg;
  for (size_t i = 0; i < recv_count; ++i) {
    CHILD_CHECK(std::memcmp(got + i * es, want.data() + i * es, es) == 0,
                "%s rank %d: element %zu of %zu differs from the reference", o.name.c_str(), rank,
                i, recv_count);
  }
  return 0;
}

// A free TCP port on 127.0.0.1 (bound, read, released).
inline int FreePort() {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(a);
  bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a));
  getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  close(fd);
  return ntohs(a.sin_port);
}

// A cluster token in a file of its own (mode 0600), removed with it.
class TokenFile {
 public:
  explicit TokenFile(const std::string& secret) {
    char tmpl[] = "/tmp/ciuic-token-XXXXXX";
    if (mkdtemp(tmpl) != nullptr) dir_ = tmpl;
    path_ = dir_ + "/token";
    FILE* f = fopen(path_.c_str(), "w");
    if (f != nullptr) {
      fchmod(fileno(f), 0600);
      fprintf(f, "%s\n", secret.c_str());
      fclose(f);
    }
  }
  ~TokenFile() {
    unlink(path_.c_str());
    rmdir(dir_.c_str());
  }
  const std::string& path() const { return path_; }

 private:
  std::string dir_, path_;
};

// N daemons, each with its own socket, peer port and node name.
struct Cluster {
  std::vector<std::unique_ptr<DaemonProcess>> nodes;
  std::vector<std::string> peers;  // host:port of each peer service

  // `node_configs[i]`, when there, is added to node i's config.
  static std::unique_ptr<Cluster> Start(int n, const std::string& config = "",
                                        const std::vector<std::string>& token_files = {},
                                        const std::vector<std::string>& node_configs = {}) {
    auto c = std::make_unique<Cluster>();
    for (int i = 0; i < n; ++i) {
      std::string peer = "127.0.0.1:" + std::to_string(FreePort());
      std::vector<std::string> args = {"--listen", peer, "--node-name", "node" + std::to_string(i)};
      std::string yaml = config;
      if (i < static_cast<int>(token_files.size()) && !token_files[i].empty()) {
        yaml += "cluster_token_file: " + token_files[i] + "\n";
      }
      if (i < static_cast<int>(node_configs.size())) yaml += node_configs[i];
      auto d = DaemonProcess::StartWith(yaml, args, {}, {"UCX_TLS=tcp", "UCX_WARN_UNUSED_ENV_VARS=n"});
      if (!d) return nullptr;
      c->nodes.push_back(std::move(d));
      c->peers.push_back(peer);
    }
    return c;
  }
  // Rank r lives on node r / ranks_per_node.
  std::unique_ptr<Communicator> Join(const std::string& job, int rank, int nodes,
                                     int ranks_per_node, uint64_t arena = 64 << 20) {
    JobOptions o;
    o.socket_path = this->nodes[rank / ranks_per_node]->socket();
    o.job_id = job;
    o.rank = rank;
    o.world_size = nodes * ranks_per_node;
    o.local_rank = rank % ranks_per_node;
    o.local_size = ranks_per_node;
    o.coordinator = peers[0];
    o.arena_bytes = arena;
    std::unique_ptr<Communicator> comm;
    Status s = Communicator::Create(o, &comm);
    if (!s.ok()) fprintf(stderr, "rank %d: Create: %s\n", rank, s.ToString().c_str());
    return comm;
  }
  // Stops the running daemons; true if each exited 0.
  bool StopAll() {
    bool clean = true;
    for (auto& d : nodes) {
      if (d && d->Alive()) clean = d->Stop() == 0 && clean;
    }
    return clean;
  }
};

// Rank `rank`'s part of an alltoallv in which rank i sends counts(i, j)
// elements to rank j (the same function on every rank): its send counts,
// its recv counts and their sums.
template <typename Counts>
void AlltoallvCountsOf(Counts counts, int world, int rank, std::vector<size_t>* send_counts,
                       std::vector<size_t>* recv_counts, size_t* send_total, size_t* recv_total) {
  send_counts->assign(world, 0);
  recv_counts->assign(world, 0);
  *send_total = *recv_total = 0;
  for (int j = 0; j < world; ++j) {
    (*send_counts)[j] = counts(rank, j);
    (*recv_counts)[j] = counts(j, rank);
    *send_total += (*send_counts)[j];
    *recv_total += (*recv_counts)[j];
  }
}

// Checks rank `rank`'s receive buffer of that alltoallv (recv_total
// elements and one more, which was 0x5a bytes and must stay so) against the
// senders' FillInput(sender, salt) blocks. 0, or through CHILD_CHECK 1
// naming the operation and the element.
template <typename Counts>
int CheckAlltoallvResult(DataType t, Counts counts, int world, int rank, const uint8_t* recv,
                         size_t recv_total, uint64_t salt, const std::string& name) {
  const size_t es = DataTypeSize(t);
  size_t at = 0;
  for (int from = 0; from < world; ++from) {
    size_t from_total = 0, offset = 0;
    for (int j = 0; j < world; ++j) {
      if (j < rank) offset += counts(from, j);
      from_total += counts(from, j);
    }
    std::vector<uint8_t> theirs(from_total * es + 1);
    FillInput(t, ReduceOp::kSum, from, theirs.data(), from_total, salt);
    for (size_t i = 0; i < counts(from, rank); ++i) {
      CHILD_CHECK(std::memcmp(recv + (at + i) * es, theirs.data() + (offset + i) * es, es) == 0,
                  "%s rank %d: element %zu from rank %d differs from its input", name.c_str(),
                  rank, i, from);
    }
    at += counts(from, rank);
  }
  for (size_t b = 0; b < es; ++b) {
    CHILD_CHECK(recv[recv_total * es + b] == 0x5a, "%s rank %d: written past the end",
                name.c_str(), rank);
  }
  return 0;
}

// One rank of an alltoallv in which rank i sends counts(i, j) elements to
// rank j (the same function on every rank): rank r's send buffer is
// FillInput(r, salt) data; the whole receive buffer is compared with the
// senders' blocks, and one element past it must stay untouched. Returns 0
// or, through CHILD_CHECK, 1 naming the operation and the element.
template <typename Counts>
int RunAlltoallvAndCheck(Communicator& comm, DataType t, Counts counts, const std::string& name,
                         bool zero_copy, uint64_t salt = 0) {
  const int world = comm.world_size();
  const int rank = comm.rank();
  const size_t es = DataTypeSize(t);
  std::vector<size_t> send_counts, recv_counts;
  size_t send_total = 0, recv_total = 0;
  AlltoallvCountsOf(counts, world, rank, &send_counts, &recv_counts, &send_total, &recv_total);
  Buffer sb, rb;
  std::vector<uint8_t> sh, rh;
  uint8_t* send;
  uint8_t* recv;
  if (zero_copy) {
    Status s = comm.Allocate(send_total * es + 1, &sb);
    CHILD_CHECK(s.ok(), "%s", s.ToString().c_str());
    s = comm.Allocate((recv_total + 1) * es, &rb);
    CHILD_CHECK(s.ok(), "%s", s.ToString().c_str());
    send = static_cast<uint8_t*>(sb.data());
    recv = static_cast<uint8_t*>(rb.data());
  } else {
    sh.resize(send_total * es + 1);
    rh.resize((recv_total + 1) * es);
    send = sh.data();
    recv = rh.data();
  }
  FillInput(t, ReduceOp::kSum, rank, send, send_total, salt);
  std::memset(recv, 0x5a, (recv_total + 1) * es);
  OpOptions opts;
  opts.name = name;
  Status s = comm.Alltoallv(send, send_counts, recv, recv_counts, t, opts).Wait();
  CHILD_CHECK(s.ok(), "%s: %s", name.c_str(), s.ToString().c_str());
  return CheckAlltoallvResult(t, counts, world, rank, recv, recv_total, salt, name);
}

// One alltoallv whose counts are counts(i, j) except that rank `off_to`
// expects one element more from rank `off_from`: every rank must fail with
// INVALID_ARGUMENT containing `words`.
template <typename Counts>
int ExpectAlltoallvMismatch(Communicator& comm, Counts counts, int off_from, int off_to,
                            const std::string& name, const std::string& words) {
  const int world = comm.world_size();
  const int rank = comm.rank();
  std::vector<size_t> send_counts(world), recv_counts(world);
  size_t st = 0, rt = 0;
  for (int j = 0; j < world; ++j) {
    send_counts[j] = counts(rank, j);
    recv_counts[j] = counts(j, rank) + (rank == off_to && j == off_from ? 1 : 0);
    st += send_counts[j];
    rt += recv_counts[j];
  }
  std::vector<int32_t> in(st, rank), out(rt, -1);
  OpOptions o;
  o.name = name;
  Status s =
      comm.Alltoallv(in.data(), send_counts, out.data(), recv_counts, DataType::kInt32, o).Wait();
  CHILD_CHECK(s.code() == StatusCode::kInvalidArgument &&
                  Contains(s.message(), "'" + name + "' mismatched across ranks") &&
                  Contains(s.message(), words),
              "%s: %s", name.c_str(), s.ToString().c_str());
  return 0;
}

// Uneven alltoallv counts of every kind: none (0), one element, odd sizes,
// some pairs empty, a rank that sends nothing, rank 0 moving nothing at all
// (no buffer of its own either way); `scale` makes them large.
constexpr int kUnevenPatterns = 5;
inline size_t UnevenCounts(int from, int to, int pattern, size_t scale) {
  switch (pattern) {
    case 0: return 0;
    case 1: return 1;
    case 2: return (from * 3 + to) % 4 == 0 ? 0 : (from + 1) * 7 + to * 3;
    case 3: return from == 1 ? 0 : ((to + from) % 3 + 1) * scale + from;
    case 4: return from == 0 || to == 0 ? 0 : (from + to) * scale / 3 + to;
  }
  return 0;
}

}  // namespace ciuic::testing
