// The cluster-token handshake between daemons (peer_auth.h), the listener
// and connector that run it (peer_socket.h), and the gRPC peer service and
// client on top of them: both sides must know the same token, the token
// never crosses the wire, and a connection that does not take part is
// dropped at its deadline having cost a fixed few bytes.
#include "control/peer_auth.h"

#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <future>
#include <string>
#include <thread>
#include <vector>

#include "cluster/coordinator.h"
#include "cluster/membership.h"
#include "control/peer_client.h"
#include "control/peer_service.h"
#include "control/peer_socket.h"

namespace ciuic::daemon {
namespace {

using Clock = std::chrono::steady_clock;

constexpr char kToken[] = "correct horse battery staple";

Clock::time_point In(int ms) { return Clock::now() + std::chrono::milliseconds(ms); }

// Two connected sockets: [0] the server's end, [1] the client's.
struct Pair {
  int fd[2] = {-1, -1};
  Pair() { EXPECT_EQ(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, fd), 0); }
  ~Pair() {
    for (int f : fd) {
      if (f >= 0) close(f);
    }
  }
};

struct Outcome {
  absl::Status server, client;
};

Outcome Handshake(const std::string& server_token, const std::string& client_token) {
  Pair p;
  auto server = std::async(std::launch::async, [&] {
    return AuthenticateClient(p.fd[0], server_token, "1.2.3.4:5", In(5000));
  });
  absl::Status client = AuthenticateServer(p.fd[1], client_token, "coordinator x:1", In(5000));
  return Outcome{server.get(), client};
}

// Everything readable on fd now (non-blocking).
std::string Drain(int fd) {
  std::string all;
  char buf[4096];
  ssize_t n;
  while ((n = recv(fd, buf, sizeof(buf), MSG_DONTWAIT)) > 0)
    all.append(buf, static_cast<size_t>(n));
  return all;
}

bool Contains(const std::string& haystack, const std::string& needle) {
  return haystack.find(needle) != std::string::npos;
}

TEST(PeerAuthTest, TheSameTokenPassesAndWhatFollowsIsUntouched) {
  for (const std::string token : {std::string(kToken), std::string()}) {
    Pair p;
    auto server = std::async(std::launch::async, [&] {
      absl::Status s = AuthenticateClient(p.fd[0], token, "1.2.3.4:5", In(5000));
      char after[5] = {};
      if (s.ok() && recv(p.fd[0], after, sizeof(after), MSG_WAITALL) != 5) {
        return absl::DataLossError("lost what followed");
      }
      return s.ok() && std::string(after, 5) != "PRI *" ? absl::DataLossError("garbled") : s;
    });
    ASSERT_TRUE(AuthenticateServer(p.fd[1], token, "coordinator x:1", In(5000)).ok());
    ASSERT_EQ(send(p.fd[1], "PRI *", 5, 0), 5);
    EXPECT_TRUE(server.get().ok());
  }
}

TEST(PeerAuthTest, DifferentTokensAreRefusedOnBothSides) {
  const std::vector<std::pair<std::string, std::string>> pairs = {
      {"alpha", "beta"}, {kToken, ""}, {"", kToken}};
  for (const auto& [server_token, client_token] : pairs) {
    SCOPED_TRACE(server_token + " / " + client_token);
    Outcome o = Handshake(server_token, client_token);
    EXPECT_EQ(o.server.code(), absl::StatusCode::kPermissionDenied) << o.server;
    EXPECT_TRUE(
        Contains(std::string(o.server.message()), "peer 1.2.3.4:5 does not know the cluster token"))
        << o.server;
    EXPECT_EQ(o.client.code(), absl::StatusCode::kPermissionDenied) << o.client;
    EXPECT_TRUE(Contains(std::string(o.client.message()),
                         "coordinator x:1 refused this daemon's cluster-token proof"))
        << o.client;
  }
}

// A fake server's first half: a challenge (nonce all zeros), then the
// client's proof read and dropped.
void ChallengeAndTakeProof(int fd) {
  char hello[kServerHelloBytes] = {};
  std::memcpy(hello, kPeerAuthMagic, sizeof(kPeerAuthMagic));
  send(fd, hello, sizeof(hello), 0);
  char proof[kClientProofBytes];
  recv(fd, proof, sizeof(proof), MSG_WAITALL);
}

// A server that does not know the token cannot pass itself off as one that
// does by saying yes: the client checks the server's proof too.
TEST(PeerAuthTest, AServerThatSaysYesWithoutTheTokenIsRefused) {
  Pair p;
  auto impostor = std::async(std::launch::async, [&] {
    ChallengeAndTakeProof(p.fd[0]);
    char verdict[kVerdictBytes] = {};
    std::memcpy(verdict, kPeerAuthMagic, sizeof(kPeerAuthMagic));
    verdict[sizeof(kPeerAuthMagic)] = 1;
    send(p.fd[0], verdict, sizeof(verdict), 0);
  });
  absl::Status s = AuthenticateServer(p.fd[1], kToken, "coordinator x:1", In(5000));
  impostor.get();
  EXPECT_EQ(s.code(), absl::StatusCode::kPermissionDenied) << s;
  EXPECT_TRUE(
      Contains(std::string(s.message()), "coordinator x:1 failed the cluster-token challenge"))
      << s;
}

// What a client sends a server it connects to (here one that records
// everything) holds nothing of the token: no copy of it, in any length.
TEST(PeerAuthTest, TheTokenNeverCrossesTheWire) {
  Pair p;
  auto recorder = std::async(std::launch::async, [&] {
    char hello[kServerHelloBytes] = {};
    std::memcpy(hello, kPeerAuthMagic, sizeof(kPeerAuthMagic));
    send(p.fd[0], hello, sizeof(hello), 0);
    std::string got;
    char buf[256];
    ssize_t n;
    timeval tv{2, 0};
    setsockopt(p.fd[0], SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
    while (got.size() < kClientProofBytes && (n = recv(p.fd[0], buf, sizeof(buf), 0)) > 0) {
      got.append(buf, static_cast<size_t>(n));
    }
    shutdown(p.fd[0], SHUT_RDWR);
    return got;
  });
  absl::Status s = AuthenticateServer(p.fd[1], kToken, "coordinator x:1", In(5000));
  EXPECT_FALSE(s.ok());
  const std::string seen = recorder.get();
  EXPECT_EQ(seen.size(), kClientProofBytes);
  EXPECT_FALSE(Contains(seen, kToken));
  EXPECT_FALSE(Contains(seen, std::string(kToken).substr(0, 8)));
}

// A client that sends garbage is refused having cost exactly one proof
// frame: the rest of what it sent stays unread in the socket.
TEST(PeerAuthTest, GarbageIsRefusedAfterOneFixedFrame) {
  Pair p;
  const std::string garbage(kClientProofBytes + 1000, '\xff');
  ASSERT_EQ(send(p.fd[1], garbage.data(), garbage.size(), 0), static_cast<ssize_t>(garbage.size()));
  absl::Status s = AuthenticateClient(p.fd[0], kToken, "1.2.3.4:5", In(2000));
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_TRUE(Contains(std::string(s.message()), "does not speak the ciuic peer handshake")) << s;
  EXPECT_EQ(Drain(p.fd[0]).size(), 1000u);
}

TEST(PeerAuthTest, SilenceEndsAtTheDeadline) {
  Pair p;
  const auto start = Clock::now();
  absl::Status s = AuthenticateClient(p.fd[0], kToken, "1.2.3.4:5", In(300));
  const auto waited = Clock::now() - start;
  EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
  EXPECT_TRUE(Contains(std::string(s.message()), "waiting for its proof")) << s;
  EXPECT_GE(waited, std::chrono::milliseconds(250));
  EXPECT_LT(waited, std::chrono::seconds(3));
  // And a client whose server says nothing.
  Pair q;
  s = AuthenticateServer(q.fd[1], kToken, "coordinator x:1", In(300));
  EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
}

TEST(PeerAuthTest, TruncatedFramesAreClearErrors) {
  {
    Pair p;
    ASSERT_EQ(send(p.fd[0], kPeerAuthMagic, 8, 0), 8);
    close(p.fd[0]);
    p.fd[0] = -1;
    absl::Status s = AuthenticateServer(p.fd[1], kToken, "coordinator x:1", In(2000));
    EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
    EXPECT_TRUE(Contains(std::string(s.message()), "closed after 8 of 40 bytes")) << s;
  }
  {
    // The verdict cut short.
    Pair p;
    auto server = std::async(std::launch::async, [&] {
      ChallengeAndTakeProof(p.fd[0]);
      send(p.fd[0], kPeerAuthMagic, 8, 0);
      shutdown(p.fd[0], SHUT_RDWR);
    });
    absl::Status s = AuthenticateServer(p.fd[1], kToken, "coordinator x:1", In(2000));
    server.get();
    EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
    EXPECT_TRUE(Contains(std::string(s.message()), "waiting for its verdict")) << s;
  }
}

int ConnectRaw(int port) {
  int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(port));
  inet_pton(AF_INET, "127.0.0.1", &a.sin_addr);
  EXPECT_EQ(connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)), 0);
  timeval tv{5, 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  return fd;
}

// Reads until the server closes (true) or 5 s pass (false).
bool ClosedByServer(int fd) {
  char buf[256];
  ssize_t n;
  while ((n = recv(fd, buf, sizeof(buf), 0)) > 0) {
  }
  return n == 0 || (n < 0 && errno == ECONNRESET);
}

// The listener authenticates on a bounded number of threads: connections
// beyond them are closed at once, silent ones at the deadline, and the
// owner sees only those that passed.
TEST(PeerListenerTest, HandshakesAreBoundedAndOnlyTheAuthenticatedArePassedOn) {
  std::atomic<int> accepted{0};
  PeerListener::Options o;
  o.what = "test listener";
  o.token = kToken;
  o.max_handshakes = 2;
  o.handshake_timeout = std::chrono::milliseconds(500);
  auto l = PeerListener::Start("127.0.0.1", 0, o, [&](int fd, const std::string& peer) {
    EXPECT_TRUE(Contains(peer, "127.0.0.1:")) << peer;
    ++accepted;
    close(fd);
  });
  ASSERT_TRUE(l.ok()) << l.status();
  const int port = (*l)->port();
  const int silent[2] = {ConnectRaw(port), ConnectRaw(port)};
  std::this_thread::sleep_for(std::chrono::milliseconds(100));  // both are being served
  const auto start = Clock::now();
  const int third = ConnectRaw(port);
  char hello[kServerHelloBytes];
  EXPECT_EQ(recv(third, hello, sizeof(hello), 0), 0) << "the third was not closed at once";
  EXPECT_LT(Clock::now() - start, std::chrono::milliseconds(400));
  close(third);
  for (int fd : silent) {
    EXPECT_TRUE(ClosedByServer(fd));
    close(fd);
  }
  EXPECT_LT(Clock::now() - start, std::chrono::seconds(3));
  // Room again: one with the token passes, one without does not.
  PeerSecurity good{kToken, {}}, bad{"guess", {}};
  auto fd = ConnectToPeer("127.0.0.1", port, good, "test listener", In(5000));
  ASSERT_TRUE(fd.ok()) << fd.status();
  close(*fd);
  auto refused = ConnectToPeer("127.0.0.1", port, bad, "test listener", In(5000));
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kPermissionDenied) << refused.status();
  (*l)->Shutdown();
  EXPECT_EQ(accepted.load(), 1);
}

TEST(PeerListenerTest, ConnectingGoesOnlyToAllowedPeers) {
  PeerListener::Options o;
  o.what = "test listener";
  o.token = kToken;
  auto l = PeerListener::Start("127.0.0.1", 0, o, [](int fd, const std::string&) { close(fd); });
  ASSERT_TRUE(l.ok()) << l.status();
  auto others = config::PeerList::Parse({"10.0.0.0/8", "fd00::/64"});
  ASSERT_TRUE(others.ok());
  auto refused = ConnectToPeer("127.0.0.1", (*l)->port(), PeerSecurity{kToken, *others},
                               "coordinator c", In(2000));
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kPermissionDenied) << refused.status();
  EXPECT_TRUE(Contains(std::string(refused.status().message()), "`peers`")) << refused.status();
  EXPECT_EQ(CheckPeerAllowed("127.0.0.1", *others).code(), absl::StatusCode::kPermissionDenied);
  for (const std::string entry : {"127.0.0.0/8", "127.0.0.1", "localhost"}) {
    auto mine = config::PeerList::Parse({"10.0.0.0/8", entry});
    ASSERT_TRUE(mine.ok());
    auto fd = ConnectToPeer("127.0.0.1", (*l)->port(), PeerSecurity{kToken, *mine}, "coordinator c",
                            In(2000));
    ASSERT_TRUE(fd.ok()) << entry << ": " << fd.status();
    close(*fd);
    EXPECT_TRUE(CheckPeerAllowed("127.0.0.1", *mine).ok()) << entry;
  }
}

// The gRPC peer service behind the listener: a registration over an
// authenticated connection works; a client with another token gets a clear
// refusal; raw HTTP/2 without the handshake is closed and the service goes
// on.
class PeerServiceTest : public ::testing::Test {
 protected:
  PeerServiceTest() : service_(&coordinator_, std::chrono::milliseconds(300)) {
    auto s = PeerServer::Start("127.0.0.1:0", kToken, &service_);
    EXPECT_TRUE(s.ok()) << s.status();
    server_ = std::move(*s);
    address_ = "127.0.0.1:" + std::to_string(server_->port());
  }
  ~PeerServiceTest() override {
    server_->Shutdown();
    coordinator_.Shutdown();
  }
  absl::StatusOr<proto::Membership> RegisterAlone(const PeerSecurity& security,
                                                  const std::string& job) {
    proto::RegisterNodeRequest r;
    r.set_job_id(job);
    r.set_uid(1);
    r.set_world_size(1);
    r.set_node_name("n0");
    r.add_ranks(0);
    r.add_transport_addresses("addr");
    r.set_channels(1);
    r.set_protocol(kPeerProtocol);
    return GrpcCoordinatorClients(security)(address_)->Register(
        r, std::chrono::system_clock::now() + std::chrono::seconds(10));
  }

  Coordinator coordinator_;
  PeerService service_;
  std::unique_ptr<PeerServer> server_;
  std::string address_;
};

TEST_F(PeerServiceTest, OnlyDaemonsWithTheTokenRegister) {
  auto ok = RegisterAlone(PeerSecurity{kToken, {}}, "a");
  ASSERT_TRUE(ok.ok()) << ok.status();
  EXPECT_EQ(ok->nodes_size(), 1);
  for (const std::string token : {"guess", ""}) {
    auto refused = RegisterAlone(PeerSecurity{token, {}}, "b");
    EXPECT_EQ(refused.status().code(), absl::StatusCode::kPermissionDenied) << refused.status();
    EXPECT_TRUE(Contains(std::string(refused.status().message()),
                         "coordinator " + address_ + " refused this daemon's cluster-token proof"))
        << refused.status();
  }
}

TEST_F(PeerServiceTest, RawHttp2WithoutTheHandshakeIsClosedAndTheServiceGoesOn) {
  const int fd = ConnectRaw(server_->port());
  const std::string preface = "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
  std::string bytes = preface + std::string(200, '\0');
  ASSERT_EQ(send(fd, bytes.data(), bytes.size(), MSG_NOSIGNAL), static_cast<ssize_t>(bytes.size()));
  EXPECT_TRUE(ClosedByServer(fd));
  close(fd);
  auto ok = RegisterAlone(PeerSecurity{kToken, {}}, "after");
  EXPECT_TRUE(ok.ok()) << ok.status();
}

// An ordering stream that never says Hello is ended at the service's
// deadline rather than holding a server thread.
TEST_F(PeerServiceTest, AnOrderingStreamWithoutHelloEndsAtTheDeadline) {
  auto client = GrpcCoordinatorClients(PeerSecurity{kToken, {}})(address_);
  auto stream = client->OpenStream(0);
  ASSERT_TRUE(stream.ok()) << stream.status();
  const auto start = Clock::now();
  proto::CoordinatorEvent e;
  EXPECT_FALSE((*stream)->Read(&e));
  absl::Status s = (*stream)->Finish();
  // The service cancels the call: the client sees it end, not why.
  EXPECT_LT(Clock::now() - start, std::chrono::seconds(5));
  EXPECT_FALSE(s.ok());
}

}  // namespace
}  // namespace ciuic::daemon
