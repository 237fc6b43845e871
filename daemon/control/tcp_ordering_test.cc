// Ordering streams over TCP on loopback, against a real Coordinator (and the
// gRPC client choosing between them and its own stream): the
// job's traffic, the ends (half-close after Leave, a node that vanishes,
// the listener shutting down) and every protocol violation a connection can
// commit, each answered with a JobFailed naming it while the listener keeps
// serving the others.
#include "control/tcp_ordering.h"

#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <future>
#include <string>
#include <vector>

#include "cluster/membership.h"
#include "control/peer_auth.h"
#include "control/peer_client.h"
#include "control/peer_service.h"

namespace ciuic::daemon {
namespace {

using Clock = std::chrono::steady_clock;

proto::RegisterNodeRequest Reg(const std::string& node, int rank) {
  proto::RegisterNodeRequest r;
  r.set_job_id("job");
  r.set_uid(7);
  r.set_world_size(2);
  r.set_node_name(node);
  r.add_ranks(rank);
  r.add_transport_addresses("addr-" + node);
  r.set_channels(1);
  r.set_protocol(kPeerProtocol);
  return r;
}

proto::NodeEvent Hello(const proto::Membership& m, int node) {
  proto::NodeEvent e;
  auto* h = e.mutable_hello();
  h->set_job_id("job");
  h->set_uid(7);
  h->set_instance(m.instance());
  h->set_node(node);
  return e;
}

proto::NodeEvent Ready(const std::string& name) {
  proto::NodeEvent e;
  e.mutable_ready()->set_name(name);
  e.mutable_ready()->mutable_signature()->set_collective(2);
  e.mutable_ready()->mutable_signature()->set_dtype(1);
  e.mutable_ready()->mutable_signature()->set_reduce_op(1);
  e.mutable_ready()->mutable_signature()->set_count(10);
  return e;
}

// A NodeEvent as the stream frames it: 4-byte little-endian length, then
// the message.
std::string Frame(const proto::NodeEvent& e) {
  std::string f(4, '\0');
  e.AppendToString(&f);
  const uint32_t n = static_cast<uint32_t>(f.size() - 4);
  for (int i = 0; i < 4; ++i) f[i] = static_cast<char>(n >> (8 * i));
  return f;
}

// The next event that is not a heartbeat (the coordinator sends one to
// every node every heartbeat_interval_ms).
bool ReadEvent(OrderingStream* stream, proto::CoordinatorEvent* e) {
  while (stream->Read(e)) {
    if (!e->has_heartbeat()) return true;
  }
  return false;
}

// Reads `stream` to its end on another thread; the future holds Finish().
std::future<absl::Status> ReadToEnd(OrderingStream* stream) {
  return std::async(std::launch::async, [stream] {
    proto::CoordinatorEvent e;
    while (stream->Read(&e)) {
    }
    return stream->Finish();
  });
}

class TcpOrderingTest : public ::testing::Test {
 protected:
  TcpOrderingTest() {
    auto l = OrderingListener::Start("127.0.0.1", 0, &coordinator_, "secret");
    EXPECT_TRUE(l.ok()) << l.status();
    listener_ = std::move(*l);
    EXPECT_GT(listener_->port(), 0);
    coordinator_.set_ordering_port(listener_->port());
  }

  // Registers both nodes of the job (concurrently: Register blocks until
  // the job has formed) and returns the table.
  proto::Membership Form() {
    auto deadline = Clock::now() + std::chrono::seconds(10);
    auto other = std::async(std::launch::async,
                            [&] { return coordinator_.Register(Reg("n1", 1), deadline); });
    auto m = coordinator_.Register(Reg("n0", 0), deadline);
    EXPECT_TRUE(m.ok()) << m.status();
    EXPECT_TRUE(other.get().ok());
    // The table tells the nodes where to connect, and which daemon coordinates.
    EXPECT_EQ(m->ordering_port(), static_cast<uint32_t>(listener_->port()));
    EXPECT_EQ(m->coordinator(), coordinator_.id());
    return *m;
  }

  std::unique_ptr<OrderingStream> Open() {
    auto s = OpenTcpOrderingStream("127.0.0.1", listener_->port(), Secret(), 2000);
    EXPECT_TRUE(s.ok()) << s.status();
    return s.ok() ? std::move(*s) : nullptr;
  }

  static PeerSecurity Secret() { return PeerSecurity{"secret", {}}; }

  // A raw connection to the listener, not authenticated.
  int Unauthenticated() {
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons(static_cast<uint16_t>(listener_->port()));
    inet_pton(AF_INET, "127.0.0.1", &a.sin_addr);
    EXPECT_EQ(connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)), 0);
    return fd;
  }
  // An authenticated raw connection, for writing what no stream would.
  int Raw() {
    const int fd = Unauthenticated();
    absl::Status s =
        AuthenticateServer(fd, "secret", "the listener", Clock::now() + std::chrono::seconds(5));
    EXPECT_TRUE(s.ok()) << s;
    return fd;
  }

  // Reads one length-prefixed CoordinatorEvent from a raw connection.
  static bool ReadRaw(int fd, proto::CoordinatorEvent* e) {
    timeval tv{10, 0};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
    unsigned char h[4];
    if (recv(fd, h, 4, MSG_WAITALL) != 4) return false;
    const uint32_t n = h[0] | (h[1] << 8) | (h[2] << 16) | (uint32_t{h[3]} << 24);
    std::string body(n, '\0');
    if (n > 0 && recv(fd, body.data(), n, MSG_WAITALL) != static_cast<ssize_t>(n)) return false;
    return e->ParseFromString(body);
  }

  // The JobFailed a refused connection gets, then the end of its stream.
  static std::string Refusal(int fd) {
    proto::CoordinatorEvent e;
    if (!ReadRaw(fd, &e) || !e.has_job_failed()) return "<no JobFailed>";
    char byte;
    if (recv(fd, &byte, 1, 0) != 0) return "<stream did not end>";
    return e.job_failed().message();
  }

  Coordinator coordinator_;
  std::unique_ptr<OrderingListener> listener_;
};

TEST_F(TcpOrderingTest, CarriesAJobAndEndsCleanlyAfterLeave) {
  const proto::Membership m = Form();
  auto s0 = Open();
  auto s1 = Open();
  ASSERT_TRUE(s0 && s1);
  ASSERT_TRUE(s0->Write(Hello(m, 0)));
  ASSERT_TRUE(s1->Write(Hello(m, 1)));
  for (int i = 0; i < 50; ++i) {
    const std::string name = "op" + std::to_string(i);
    ASSERT_TRUE(s1->Write(Ready(name)));  // the order of the two nodes' Ready does not matter
    ASSERT_TRUE(s0->Write(Ready(name)));
    for (auto* s : {s0.get(), s1.get()}) {
      proto::CoordinatorEvent e;
      ASSERT_TRUE(ReadEvent(s, &e));
      ASSERT_TRUE(e.has_run()) << e.DebugString();
      EXPECT_EQ(e.run().name(), name);
      EXPECT_EQ(e.run().seq(), static_cast<uint64_t>(i));
      proto::NodeEvent done;
      done.mutable_done()->set_seq(e.run().seq());
      ASSERT_TRUE(s->Write(done));
    }
  }
  // Node 1 leaves and half-closes: node 0 learns why, and node 1's stream
  // ends cleanly once the coordinator is done with it.
  proto::NodeEvent leave;
  leave.mutable_leave()->set_reason("rank 1 exited");
  ASSERT_TRUE(s1->Write(leave));
  s1->WritesDone();
  EXPECT_FALSE(s1->Write(Ready("late")));
  proto::CoordinatorEvent e;
  ASSERT_TRUE(ReadEvent(s0.get(), &e));
  ASSERT_TRUE(e.has_job_failed()) << e.DebugString();
  EXPECT_NE(e.job_failed().message().find("n1"), std::string::npos) << e.job_failed().message();
  EXPECT_NE(e.job_failed().message().find("rank 1 exited"), std::string::npos);
  s0->WritesDone();
  while (ReadEvent(s1.get(), &e)) {
  }
  EXPECT_TRUE(s1->Finish().ok()) << s1->Finish();
}

TEST_F(TcpOrderingTest, ANodeThatVanishesFailsTheJobNamingIt) {
  const proto::Membership m = Form();
  auto s0 = Open();
  int raw = Raw();  // node 1, which will just close its socket
  ASSERT_TRUE(s0->Write(Hello(m, 0)));
  for (const proto::NodeEvent& event : {Hello(m, 1), Ready("x")}) {
    const std::string frame = Frame(event);
    ASSERT_EQ(send(raw, frame.data(), frame.size(), 0), static_cast<ssize_t>(frame.size()));
  }
  ASSERT_TRUE(s0->Write(Ready("x")));
  proto::CoordinatorEvent e;
  ASSERT_TRUE(ReadEvent(s0.get(), &e));  // both nodes are attached once "x" runs
  ASSERT_TRUE(e.has_run()) << e.DebugString();
  close(raw);
  ASSERT_TRUE(ReadEvent(s0.get(), &e));
  ASSERT_TRUE(e.has_job_failed()) << e.DebugString();
  EXPECT_NE(e.job_failed().message().find("n1"), std::string::npos) << e.job_failed().message();
  // "ended", or "broke: Connection reset by peer" when the Run it never
  // read was still in its socket as it closed.
  EXPECT_NE(e.job_failed().message().find("its stream "), std::string::npos)
      << e.job_failed().message();
}

TEST_F(TcpOrderingTest, ProtocolViolationsAreRefusedByNameAndTheListenerGoesOn) {
  const proto::Membership m = Form();
  struct Case {
    std::string what;
    std::string bytes;
    std::string expect;
  };
  const std::string huge = std::string("\xff\xff\xff\x7f", 4);
  const std::string junk = std::string("\x05\x00\x00\x00", 4) + "\xff\xff\xff\xff\xff";
  const std::vector<Case> cases = {
      {"no Hello first", Frame(Ready("x")), "the first message must be Hello"},
      {"a frame too large", huge, "more than the"},
      {"bytes that do not parse", junk, "not an ordering message"},
      {"a job that is not here",
       [&] {
         proto::NodeEvent h = Hello(m, 1);
         h.mutable_hello()->set_instance(m.instance() + 99);
         return Frame(h);
       }(),
       "no formed job"},
      {"a node index out of range", Frame(Hello(m, 5)), "bad or duplicate node"},
  };
  for (const Case& c : cases) {
    int fd = Raw();
    ASSERT_EQ(send(fd, c.bytes.data(), c.bytes.size(), 0), static_cast<ssize_t>(c.bytes.size()));
    const std::string why = Refusal(fd);
    EXPECT_NE(why.find(c.expect), std::string::npos) << c.what << ": " << why;
    EXPECT_NE(why.find("ordering stream refused"), std::string::npos) << c.what << ": " << why;
    close(fd);
  }
  // A connection that says nothing holds no one up; the job still runs.
  int silent = Raw();
  auto s0 = Open();
  auto s1 = Open();
  ASSERT_TRUE(s0->Write(Hello(m, 0)));
  ASSERT_TRUE(s1->Write(Hello(m, 1)));
  ASSERT_TRUE(s0->Write(Ready("y")));
  ASSERT_TRUE(s1->Write(Ready("y")));
  proto::CoordinatorEvent e;
  ASSERT_TRUE(ReadEvent(s1.get(), &e));
  EXPECT_TRUE(e.has_run()) << e.DebugString();
  close(silent);
}

TEST_F(TcpOrderingTest, ShutdownEndsOpenStreams) {
  const proto::Membership m = Form();
  auto s0 = Open();
  ASSERT_TRUE(s0->Write(Hello(m, 0)));
  auto reader = ReadToEnd(s0.get());
  listener_->Shutdown();
  ASSERT_EQ(reader.wait_for(std::chrono::seconds(10)), std::future_status::ready);
  reader.get().IgnoreError();  // ended; OK or broken depending on how the close arrived
  EXPECT_FALSE(OpenTcpOrderingStream("127.0.0.1", listener_->port(), Secret(), 1000).ok());
}

TEST_F(TcpOrderingTest, CancelEndsTheNodesOwnRead) {
  const proto::Membership m = Form();
  auto s0 = Open();
  ASSERT_TRUE(s0->Write(Hello(m, 0)));
  auto reader = ReadToEnd(s0.get());
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  s0->Cancel();
  ASSERT_EQ(reader.wait_for(std::chrono::seconds(10)), std::future_status::ready);
  EXPECT_TRUE(absl::IsCancelled(reader.get()));
}

// The gRPC coordinator client orders over TCP where the coordinator
// announces a listener it can reach, and over its gRPC stream otherwise
// (nothing announced, or the port closed): the stream says which.
TEST_F(TcpOrderingTest, TheGrpcClientUsesTheListenerWhereItCanAndFallsBack) {
  PeerService service(&coordinator_);
  auto server = PeerServer::Start("127.0.0.1:0", "secret", &service);
  ASSERT_TRUE(server.ok()) << server.status();
  const std::string address = "127.0.0.1:" + std::to_string((*server)->port());
  auto client = GrpcCoordinatorClients(Secret())(address);
  auto tcp = client->OpenStream(static_cast<uint32_t>(listener_->port()));
  ASSERT_TRUE(tcp.ok()) << tcp.status();
  EXPECT_EQ((*tcp)->Describe(), "over TCP to 127.0.0.1 port " + std::to_string(listener_->port()));
  auto none = client->OpenStream(0);
  ASSERT_TRUE(none.ok()) << none.status();
  EXPECT_EQ((*none)->Describe(), "over gRPC to " + address);
  const int closed = listener_->port();
  listener_->Shutdown();
  auto fallback = client->OpenStream(static_cast<uint32_t>(closed));
  ASSERT_TRUE(fallback.ok()) << fallback.status();
  EXPECT_EQ((*fallback)->Describe(), "over gRPC to " + address);
  (*server)->Shutdown();
}

// A daemon with another token, or none, gets no ordering stream: both ends
// say why, and no frame of it is read.
TEST_F(TcpOrderingTest, ADaemonWithAnotherTokenGetsNoStream) {
  for (const std::string token : {"guess", ""}) {
    auto s = OpenTcpOrderingStream("127.0.0.1", listener_->port(), PeerSecurity{token, {}}, 2000);
    ASSERT_FALSE(s.ok());
    EXPECT_EQ(s.status().code(), absl::StatusCode::kPermissionDenied) << s.status();
    EXPECT_NE(s.status().message().find("refused this daemon's cluster-token proof"),
              std::string::npos)
        << s.status();
  }
  // Nor does the gRPC client fall back to another way in.
  auto client = GrpcCoordinatorClients(PeerSecurity{"guess", {}})("127.0.0.1:1");
  auto s = client->OpenStream(static_cast<uint32_t>(listener_->port()));
  EXPECT_EQ(s.status().code(), absl::StatusCode::kPermissionDenied) << s.status();
}

// Before the handshake nothing is read as a frame: a 16 MiB length prefix
// from a connection that never proved the token allocates nothing and is
// closed, and the listener goes on serving a job.
TEST_F(TcpOrderingTest, AnUnauthenticatedLengthPrefixIsNeverRead) {
  const proto::Membership m = Form();
  int fd = Unauthenticated();
  timeval tv{10, 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  char hello[kServerHelloBytes];
  ASSERT_EQ(recv(fd, hello, sizeof(hello), MSG_WAITALL), static_cast<ssize_t>(sizeof(hello)));
  std::string prefix("\x00\x00\x00\x01", 4);  // 16 MiB
  prefix += Frame(Hello(m, 1));
  prefix.resize(kClientProofBytes + 16, '\0');
  ASSERT_EQ(send(fd, prefix.data(), prefix.size(), 0), static_cast<ssize_t>(prefix.size()));
  char byte;
  EXPECT_LE(recv(fd, &byte, 1, 0), 0) << "the connection was not closed";
  close(fd);
  auto s0 = Open();
  auto s1 = Open();
  ASSERT_TRUE(s0->Write(Hello(m, 0)));
  ASSERT_TRUE(s1->Write(Hello(m, 1)));
  ASSERT_TRUE(s0->Write(Ready("z")));
  ASSERT_TRUE(s1->Write(Ready("z")));
  proto::CoordinatorEvent e;
  ASSERT_TRUE(ReadEvent(s1.get(), &e));
  EXPECT_TRUE(e.has_run()) << e.DebugString();
}

TEST(TcpOrderingAddressTest, HostOfAddress) {
  EXPECT_EQ(HostOfAddress("10.0.0.1:7361"), "10.0.0.1");
  EXPECT_EQ(HostOfAddress("node-3.cluster:7361"), "node-3.cluster");
  EXPECT_EQ(HostOfAddress("[fd00::1]:7361"), "fd00::1");
  EXPECT_EQ(HostOfAddress("localhost"), "localhost");
}

// A fixed ordering_port that is taken, or a host that is not there, stops
// ciuicd at start with a message naming it.
TEST_F(TcpOrderingTest, APortInUseOrABadHostIsAClearError) {
  auto taken = OrderingListener::Start("127.0.0.1", listener_->port(), &coordinator_, "secret");
  ASSERT_FALSE(taken.ok());
  EXPECT_NE(taken.status().message().find("cannot listen on 127.0.0.1:" +
                                          std::to_string(listener_->port())),
            std::string::npos)
      << taken.status();
  auto bad = OrderingListener::Start("no-such-host.invalid", 0, &coordinator_, "secret");
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("cannot resolve 'no-such-host.invalid'"),
            std::string::npos)
      << bad.status();
}

TEST(TcpOrderingAddressTest, NothingListeningIsAClearError) {
  Coordinator c;
  auto l = OrderingListener::Start("127.0.0.1", 0, &c, "t");
  ASSERT_TRUE(l.ok());
  const int port = (*l)->port();
  (*l)->Shutdown();
  auto s = OpenTcpOrderingStream("127.0.0.1", port, PeerSecurity{"t", {}}, 1000);
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.status().message().find("ordering stream to 127.0.0.1 port"), std::string::npos)
      << s.status();
}

}  // namespace
}  // namespace ciuic::daemon

namespace ciuic::daemon {
namespace {

proto::CoordinatorEvent Numbered(int i, size_t pad) {
  proto::CoordinatorEvent e;
  e.mutable_fail()->set_name("op" + std::to_string(i));
  e.mutable_fail()->set_code(2);
  e.mutable_fail()->set_message(std::string(pad, 'x'));
  return e;
}

// Reads frames from `fd` until EOF or an error; the names of the Fails.
std::vector<std::string> ReadNames(int fd) {
  std::vector<std::string> names;
  while (true) {
    unsigned char h[4];
    size_t got = 0;
    while (got < 4) {
      ssize_t r = recv(fd, h + got, 4 - got, 0);
      if (r <= 0) return names;
      got += static_cast<size_t>(r);
    }
    const uint32_t n = h[0] | (h[1] << 8) | (h[2] << 16) | (static_cast<uint32_t>(h[3]) << 24);
    std::string body(n, '\0');
    got = 0;
    while (got < n) {
      ssize_t r = recv(fd, body.data() + got, n - got, 0);
      if (r <= 0) return names;
      got += static_cast<size_t>(r);
    }
    proto::CoordinatorEvent e;
    if (!e.ParseFromString(body)) return names;
    names.push_back(e.fail().name());
  }
}

// The coordinator sends to a node under its lock: a node that stops
// reading must not make a Send block. Its frames queue up to the bound;
// past it the node is cut off (the connection shut down), and every Send
// still returns at once.
TEST(TcpNodeStreamTest, ANodeThatStopsReadingNeverBlocksTheSender) {
  int fds[2];
  ASSERT_EQ(socketpair(AF_UNIX, SOCK_STREAM, 0, fds), 0);
  int small = 16 << 10;
  setsockopt(fds[0], SOL_SOCKET, SO_SNDBUF, &small, sizeof(small));
  {
    TcpNodeStream stream(fds[0], /*max_queued_bytes=*/size_t{1} << 20);
    Clock::duration slowest{};
    const auto start = Clock::now();
    for (int i = 0; i < 4000; ++i) {  // about 4 MiB
      const auto t = Clock::now();
      stream.Send(Numbered(i, 1000));
      slowest = std::max(slowest, Clock::now() - t);
    }
    EXPECT_LT(slowest, std::chrono::milliseconds(100));
    EXPECT_LT(Clock::now() - start, std::chrono::seconds(5));
    // Cut off: the node reads what got through, then the end.
    std::vector<std::string> names = ReadNames(fds[1]);
    ASSERT_FALSE(names.empty());
    EXPECT_LT(names.size(), 4000u);
    for (size_t i = 0; i < names.size(); ++i) ASSERT_EQ(names[i], "op" + std::to_string(i));
  }
  close(fds[0]);
  close(fds[1]);
}

// A node that reads late gets every frame, in order: the queue holds what
// the socket could not.
TEST(TcpNodeStreamTest, ASlowNodeGetsEveryFrameInOrder) {
  int fds[2];
  ASSERT_EQ(socketpair(AF_UNIX, SOCK_STREAM, 0, fds), 0);
  int small = 16 << 10;
  setsockopt(fds[0], SOL_SOCKET, SO_SNDBUF, &small, sizeof(small));
  std::future<std::vector<std::string>> names;
  {
    TcpNodeStream stream(fds[0]);
    for (int i = 0; i < 2000; ++i) stream.Send(Numbered(i, 1000));
    names = std::async(std::launch::async, [fd = fds[1]] { return ReadNames(fd); });
  }  // written out before it goes
  shutdown(fds[0], SHUT_WR);
  std::vector<std::string> got = names.get();
  ASSERT_EQ(got.size(), 2000u);
  for (size_t i = 0; i < got.size(); ++i) ASSERT_EQ(got[i], "op" + std::to_string(i));
  close(fds[0]);
  close(fds[1]);
}

}  // namespace
}  // namespace ciuic::daemon
