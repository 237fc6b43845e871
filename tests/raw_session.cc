#include "raw_session.h"

#include <algorithm>

#include <poll.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <thread>

#include "ciuic/control.grpc.pb.h"
#include "ciuic/fast_path.h"
#include "grpcpp/grpcpp.h"

namespace ciuic::testing {

bool RawSession::Open(const std::string& socket_path, uint64_t arena_bytes) {
  std::string path = socket_path + ".session";
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, path.data(), path.size());
  sock = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
  if (connect(sock, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    perror("connect");
    return false;
  }
  wire::HelloRequest hello{};
  hello.magic = wire::kSessionMagic;
  hello.version = wire::kLayoutVersion;
  hello.arena_bytes = arena_bytes;
  send(sock, &hello, sizeof(hello), MSG_NOSIGNAL);
  wire::HelloReply reply{};
  iovec iov{&reply, sizeof(reply)};
  alignas(cmsghdr) char control[CMSG_SPACE(2 * sizeof(int))];
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  msg.msg_control = control;
  msg.msg_controllen = sizeof(control);
  if (recvmsg(sock, &msg, 0) != sizeof(reply) || reply.status_code != 0) {
    refusal.assign(reply.message, std::min<size_t>(reply.message_len, wire::kMaxMessage));
    fprintf(stderr, "session refused: %s\n", refusal.c_str());
    return false;
  }
  cmsghdr* c = CMSG_FIRSTHDR(&msg);
  if (c == nullptr) return false;
  int fds[2];
  std::memcpy(fds, CMSG_DATA(c), sizeof(fds));
  memfd = fds[0];
  doorbell = fds[1];
  size = reply.memfd_bytes;
  base = static_cast<uint8_t*>(mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, memfd, 0));
  token.assign(reinterpret_cast<const char*>(reply.token), wire::kTokenBytes);
  return base != MAP_FAILED;
}

int RawSession::Join(const std::string& socket_path, const std::string& job, int rank,
                     int world, std::string* message, int local_size,
                     const std::string& coordinator) {
  auto stub = proto::Control::NewStub(
      grpc::CreateChannel("unix:" + socket_path, grpc::InsecureChannelCredentials()));
  proto::JoinJobRequest req;
  req.set_session_token(token);
  req.set_job_id(job);
  req.set_rank(rank);
  req.set_world_size(world);
  req.set_local_rank(local_size < 0 ? rank : rank % local_size);
  req.set_local_size(local_size < 0 ? world : local_size);
  req.set_coordinator(coordinator);
  proto::JoinJobReply reply;
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  grpc::Status s = stub->JoinJob(&ctx, req, &reply);
  if (message) *message = s.error_message();
  if (s.ok() && reply.fast_path_bytes() > 0) {
    // The job's fast-path segment waits on the session socket; a raw
    // session uses the rings only, so it takes the datagram and drops the fd.
    wire::FastPathHello hello{};
    iovec iov{&hello, sizeof(hello)};
    alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))];
    msghdr msg{};
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control;
    msg.msg_controllen = sizeof(control);
    if (recvmsg(sock, &msg, MSG_CMSG_CLOEXEC) == static_cast<ssize_t>(sizeof(hello))) {
      for (cmsghdr* c = CMSG_FIRSTHDR(&msg); c != nullptr; c = CMSG_NXTHDR(&msg, c)) {
        if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS) {
          int fd = -1;
          std::memcpy(&fd, CMSG_DATA(c), sizeof(int));
          if (fd >= 0) close(fd);
        }
      }
    }
  }
  return s.error_code();
}

RawSession::~RawSession() {
  if (base && base != MAP_FAILED) munmap(base, size);
  for (int fd : {sock, doorbell, memfd}) {
    if (fd >= 0) close(fd);
  }
}

void RawSession::Submit(const wire::SubmissionEntry& e) {
  auto* ring = reinterpret_cast<wire::SubmissionEntry*>(base + wire::kSqOffset);
  ring[sq_tail_ & (wire::kRingCapacity - 1)] = e;
  ++sq_tail_;
  header()->sq_tail.store(sq_tail_);
  uint64_t one = 1;
  (void)!write(doorbell, &one, sizeof(one));
}

bool RawSession::NextCompletion(wire::CompletionEntry* out, int ms) {
  auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(ms);
  while (true) {  // looks at least once, also with ms = 0
    if (header()->cq_tail.load() != cq_head_) {
      auto* ring = reinterpret_cast<wire::CompletionEntry*>(base + wire::kCqOffset);
      *out = ring[cq_head_ & (wire::kRingCapacity - 1)];
      ++cq_head_;
      header()->cq_head.store(cq_head_);
      return true;
    }
    if (std::chrono::steady_clock::now() >= until) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
}

bool RawSession::HungUp(int ms) {
  pollfd p{sock, POLLIN, 0};
  if (poll(&p, 1, ms) <= 0) return false;
  char b;
  return recv(sock, &b, 1, MSG_DONTWAIT) == 0 || (p.revents & POLLHUP);
}

wire::SubmissionEntry Entry(uint64_t op_id, wire::Collective collective, wire::DataType dtype,
                            wire::ReduceOp op, uint64_t count, uint64_t send_offset,
                            uint64_t recv_offset, std::string_view name) {
  wire::SubmissionEntry e{};
  e.op_id = op_id;
  e.collective = static_cast<uint32_t>(collective);
  e.dtype = static_cast<uint32_t>(dtype);
  e.reduce_op = static_cast<uint32_t>(op);
  e.count = count;
  e.send_offset = send_offset;
  e.recv_offset = recv_offset;
  const size_t n = std::min(name.size(), sizeof(e.name));
  std::memcpy(e.name, name.data(), n);
  e.name_len = static_cast<uint32_t>(n);
  return e;
}

std::string MessageOf(const wire::CompletionEntry& done) {
  return std::string(done.message, std::min<uint32_t>(done.message_len, wire::kMaxMessage));
}

}  // namespace ciuic::testing
