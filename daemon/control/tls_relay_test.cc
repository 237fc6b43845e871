// TLS between daemons (tls_relay.h) through the real entry points
// (PeerListener, ConnectToPeer) on loopback, with certificates made by the
// test: mutual verification, bytes intact both ways, half-close, refusals
// that name the problem on both sides, and no fd or thread left behind.
#include "control/tls_relay.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/socket.h>
#include <unistd.h>

#include <condition_variable>
#include <deque>
#include <mutex>
#include <sstream>
#include <thread>

#include "control/peer_socket.h"
#include "control/testing/test_certs.h"
#include "gtest/gtest.h"
#include "spdlog/sinks/ostream_sink.h"
#include "spdlog/sinks/stdout_color_sinks.h"
#include "spdlog/spdlog.h"

namespace ciuic::daemon {
namespace {

using Clock = std::chrono::steady_clock;
constexpr char kToken[] = "tls test token";

Clock::time_point In(int ms) { return Clock::now() + std::chrono::milliseconds(ms); }

// Polls `done` every 10 ms until it holds or `ms` pass; its last value.
template <typename F>
bool Eventually(F done, int ms) {
  for (const auto until = In(ms); Clock::now() < until;) {
    if (done()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return done();
}

int CountEntries(const char* dir) {
  DIR* d = opendir(dir);
  int n = 0;
  while (dirent* e = readdir(d)) n += e->d_name[0] != '.';
  closedir(d);
  return n;
}

// Writes all of `data` (blocking fd).
bool WriteAll(int fd, const std::string& data) {
  size_t at = 0;
  while (at < data.size()) {
    const ssize_t w = send(fd, data.data() + at, data.size() - at, MSG_NOSIGNAL);
    if (w <= 0) return false;
    at += static_cast<size_t>(w);
  }
  return true;
}

// Reads until EOF (blocking fd, 10 s receive timeout); "<error>" on an error.
std::string ReadToEnd(int fd) {
  timeval tv{10, 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  std::string got;
  char buf[16384];
  while (true) {
    const ssize_t r = recv(fd, buf, sizeof(buf), 0);
    if (r == 0) return got;
    if (r < 0) return "<error>";
    got.append(buf, static_cast<size_t>(r));
  }
}

std::string Pattern(size_t n, uint32_t seed) {
  std::string s(n, '\0');
  for (size_t i = 0; i < n; ++i) {
    seed = seed * 1664525u + 1013904223u;
    s[i] = static_cast<char>(seed >> 24);
  }
  return s;
}

class TlsRelayTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    std::string error;
    certs_ = testing::TestCerts::Make({"node0", "node1"}, &error).release();
    ASSERT_NE(certs_, nullptr) << error;
  }
  static void TearDownTestSuite() {
    delete certs_;
    certs_ = nullptr;
  }

  void SetUp() override {
    // The daemon's log, read by the tests that check what it says.
    auto sink = std::make_shared<spdlog::sinks::ostream_sink_mt>(log_);
    spdlog::set_default_logger(std::make_shared<spdlog::logger>("test", sink));
  }

  // Sockets a test did not take are closed, so that their relays end.
  void TearDown() override {
    listener_.reset();
    // log_ goes with this fixture: later lines go to stderr.
    spdlog::set_default_logger(spdlog::stderr_color_mt("after-" + std::to_string(++fixtures_)));
    std::lock_guard<std::mutex> lock(mu_);
    for (int fd : accepted_) close(fd);
    accepted_.clear();
  }

  std::string Log() {
    spdlog::default_logger()->flush();
    return log_.str();
  }

  static std::shared_ptr<const TlsContext> Tls(const std::string& node) {
    auto tls = TlsContext::Load(certs_->cert(node), certs_->key(node), certs_->ca());
    EXPECT_TRUE(tls.ok()) << tls.status();
    return tls.ok() ? *tls : nullptr;
  }

  // A listener (TLS with node0's keys unless `tls` is null) whose accepted
  // sockets wait in accepted_.
  void Listen(std::shared_ptr<const TlsContext> tls) {
    PeerListener::Options o;
    o.what = "test listener";
    o.token = kToken;
    o.tls = std::move(tls);
    o.handshake_timeout = std::chrono::milliseconds(3000);
    auto l = PeerListener::Start("127.0.0.1", 0, o, [this](int fd, const std::string&) {
      std::lock_guard<std::mutex> lock(mu_);
      accepted_.push_back(fd);
      cv_.notify_all();
    });
    ASSERT_TRUE(l.ok()) << l.status();
    listener_ = std::move(*l);
  }

  // The next accepted socket, in blocking mode; -1 after 5 s.
  int NextAccepted() {
    std::unique_lock<std::mutex> lock(mu_);
    if (!cv_.wait_for(lock, std::chrono::seconds(5), [&] { return !accepted_.empty(); })) {
      return -1;
    }
    const int fd = accepted_.front();
    accepted_.pop_front();
    fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) & ~O_NONBLOCK);
    return fd;
  }

  absl::StatusOr<int> Connect(std::shared_ptr<const TlsContext> tls) {
    return ConnectToPeer("127.0.0.1", listener_->port(), PeerSecurity{kToken, {}, std::move(tls)},
                         "test server", In(5000));
  }

  static testing::TestCerts* certs_;
  static inline int fixtures_ = 0;
  std::ostringstream log_;
  std::unique_ptr<PeerListener> listener_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<int> accepted_;
};

testing::TestCerts* TlsRelayTest::certs_ = nullptr;

// Both ways at once, one large write (several relay buffers) and small
// ones, then a half-close each way: a side that ended its writes still
// reads everything the other sends, and each sees EOF exactly after the
// other's last byte.
TEST_F(TlsRelayTest, MutualTlsCarriesBytesBothWaysIntactWithHalfClose) {
  Listen(Tls("node0"));
  auto client = Connect(Tls("node1"));
  ASSERT_TRUE(client.ok()) << client.status();
  const int server = NextAccepted();
  ASSERT_GE(server, 0);
  EXPECT_EQ(TlsRelay::Running(), 2);

  // Small writes first: an 8-byte round trip (the ordering stream's size).
  ASSERT_TRUE(WriteAll(*client, "12345678"));
  char small[8];
  ASSERT_EQ(recv(server, small, sizeof(small), MSG_WAITALL), 8);
  EXPECT_EQ(std::string(small, 8), "12345678");

  const std::string up = Pattern(5 << 20, 1) + "end of client";
  const std::string down = Pattern(3 << 20, 2);
  std::string got_by_server, got_by_client;
  std::thread reader([&] { got_by_server = ReadToEnd(server); });
  // The client writes in pieces of many sizes, then ends its writes.
  size_t at = 0;
  for (size_t piece = 1; at < up.size(); piece = piece * 3 % 200003 + 1) {
    const size_t n = std::min(piece, up.size() - at);
    ASSERT_TRUE(WriteAll(*client, up.substr(at, n)));
    at += n;
  }
  ASSERT_EQ(shutdown(*client, SHUT_WR), 0);
  reader.join();
  EXPECT_EQ(got_by_server.size(), up.size());
  EXPECT_TRUE(got_by_server == up) << "bytes changed on the way to the server";

  // The server still writes after the client's half-close, then closes.
  std::thread writer([&] {
    EXPECT_TRUE(WriteAll(server, down));
    close(server);
  });
  got_by_client = ReadToEnd(*client);
  writer.join();
  EXPECT_EQ(got_by_client.size(), down.size());
  EXPECT_TRUE(got_by_client == down) << "bytes changed on the way to the client";
  close(*client);
  // Both relays end once both sides are done.
  EXPECT_TRUE(Eventually([] { return TlsRelay::Running() == 0; }, 5000)) << TlsRelay::Running();
}

// A peer that goes away is seen as EOF by the local end (and the other way).
TEST_F(TlsRelayTest, ACloseOnEitherSideIsEofOnTheOther) {
  Listen(Tls("node0"));
  auto client = Connect(Tls("node1"));
  ASSERT_TRUE(client.ok()) << client.status();
  const int server = NextAccepted();
  ASSERT_GE(server, 0);
  ASSERT_TRUE(WriteAll(server, "bye"));
  close(server);
  EXPECT_EQ(ReadToEnd(*client), "bye");
  close(*client);

  auto again = Connect(Tls("node1"));
  ASSERT_TRUE(again.ok()) << again.status();
  const int server2 = NextAccepted();
  ASSERT_GE(server2, 0);
  close(*again);
  EXPECT_EQ(ReadToEnd(server2), "");
  close(server2);
}

// A daemon whose certificate another CA signed is refused: its connection
// fails naming TLS, and the server logs the refusal with its address.
TEST_F(TlsRelayTest, AClientCertificateFromAnotherCaIsRefused) {
  Listen(Tls("node0"));
  auto rogue = TlsContext::Load(certs_->cert("rogue"), certs_->key("rogue"), certs_->ca());
  ASSERT_TRUE(rogue.ok()) << rogue.status();
  auto refused = Connect(*rogue);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kPermissionDenied) << refused.status();
  EXPECT_NE(refused.status().message().find("TLS"), absl::string_view::npos) << refused.status();
  Eventually([&] { return Log().find("certificate is refused") != std::string::npos; }, 3000);
  const std::string log = Log();
  EXPECT_NE(log.find("refused a connection: peer 127.0.0.1:"), std::string::npos) << log;
  EXPECT_NE(log.find("certificate is refused"), std::string::npos) << log;
  // And a server whose certificate another CA signed is refused by a client.
  listener_.reset();
  Listen(*rogue);
  auto to_rogue = Connect(Tls("node1"));
  ASSERT_FALSE(to_rogue.ok());
  EXPECT_NE(to_rogue.status().message().find("certificate is refused"), absl::string_view::npos)
      << to_rogue.status();
}

// A daemon without TLS keys against one with them, both ways: each side
// fails at once with an error naming the tls_* keys, and the server goes
// on serving TLS clients.
TEST_F(TlsRelayTest, PlaintextAndTlsDaemonsRefuseEachOtherClearly) {
  Listen(Tls("node0"));
  const auto start = Clock::now();
  auto plain = Connect(nullptr);
  ASSERT_FALSE(plain.ok());
  EXPECT_LT(Clock::now() - start, std::chrono::seconds(2)) << "waited for a timeout";
  EXPECT_EQ(plain.status().code(), absl::StatusCode::kPermissionDenied) << plain.status();
  EXPECT_NE(plain.status().message().find("requires TLS"), absl::string_view::npos)
      << plain.status();
  Eventually([&] { return Log().find("does not use TLS") != std::string::npos; }, 3000);
  EXPECT_NE(Log().find("peer 127.0.0.1:"), std::string::npos) << Log();
  EXPECT_NE(Log().find("does not use TLS and this daemon requires it"), std::string::npos) << Log();
  auto good = Connect(Tls("node1"));
  ASSERT_TRUE(good.ok()) << good.status();
  close(*good);

  listener_.reset();
  Listen(nullptr);
  auto tls = Connect(Tls("node1"));
  ASSERT_FALSE(tls.ok());
  EXPECT_EQ(tls.status().code(), absl::StatusCode::kPermissionDenied) << tls.status();
  EXPECT_NE(tls.status().message().find("does not use TLS and this daemon does"),
            absl::string_view::npos)
      << tls.status();
  Eventually([&] { return Log().find("uses TLS and this daemon does not") != std::string::npos; },
             3000);
  EXPECT_NE(Log().find("uses TLS and this daemon does not"), std::string::npos) << Log();
}

// A wrong cluster token inside TLS is still refused (defence in depth).
TEST_F(TlsRelayTest, TheTokenIsCheckedInsideTls) {
  Listen(Tls("node0"));
  auto wrong = ConnectToPeer("127.0.0.1", listener_->port(),
                             PeerSecurity{"guess", {}, Tls("node1")}, "test server", In(5000));
  ASSERT_FALSE(wrong.ok());
  EXPECT_NE(wrong.status().message().find("cluster token"), absl::string_view::npos)
      << wrong.status();
}

// Many connections (good ones, refused ones, ones closed mid-stream) leave
// no fd and no thread behind.
TEST_F(TlsRelayTest, ManyConnectionsLeaveNoFdOrThreadBehind) {
  Listen(Tls("node0"));
  auto node1 = Tls("node1");
  auto rogue = TlsContext::Load(certs_->cert("rogue"), certs_->key("rogue"), certs_->ca());
  ASSERT_TRUE(rogue.ok());
  // Warm up (lazily made OpenSSL and logger state), then count.
  {
    auto c = Connect(node1);
    ASSERT_TRUE(c.ok()) << c.status();
    close(*c);
    close(NextAccepted());
  }
  Eventually([] { return TlsRelay::Running() == 0; }, 5000);
  const int fds = CountEntries("/proc/self/fd");
  const int threads = CountEntries("/proc/self/task");
  for (int i = 0; i < 60; ++i) {
    if (i % 10 == 9) {
      EXPECT_FALSE(Connect(*rogue).ok());
      continue;
    }
    if (i % 10 == 8) {
      EXPECT_FALSE(Connect(nullptr).ok());
      continue;
    }
    auto c = Connect(node1);
    ASSERT_TRUE(c.ok()) << c.status();
    const int s = NextAccepted();
    ASSERT_GE(s, 0);
    ASSERT_TRUE(WriteAll(*c, Pattern(100000, i)));
    if (i % 2 == 0) {
      close(s);  // mid-stream, with bytes unread
      close(*c);
    } else {
      char buf[100];
      ASSERT_EQ(recv(s, buf, sizeof(buf), MSG_WAITALL), 100);
      close(*c);
      close(s);
    }
  }
  // Handshake threads end once their connection is handed on or refused;
  // relays once both ends closed.
  int fds_now = 0, threads_now = 0;
  Eventually(
      [&] {
        fds_now = CountEntries("/proc/self/fd");
        threads_now = CountEntries("/proc/self/task");
        return TlsRelay::Running() == 0 && fds_now <= fds && threads_now <= threads;
      },
      10000);
  EXPECT_EQ(TlsRelay::Running(), 0);
  EXPECT_LE(fds_now, fds);
  EXPECT_LE(threads_now, threads);
}

TEST_F(TlsRelayTest, LoadNamesTheFileThatIsWrong) {
  auto missing = TlsContext::Load(certs_->dir() + "/nope.pem", certs_->key("node0"), certs_->ca());
  ASSERT_FALSE(missing.ok());
  EXPECT_NE(missing.status().message().find("tls_cert_file '" + certs_->dir() + "/nope.pem'"),
            absl::string_view::npos)
      << missing.status();
  auto not_a_cert = TlsContext::Load(certs_->key("node0"), certs_->key("node0"), certs_->ca());
  ASSERT_FALSE(not_a_cert.ok());
  EXPECT_NE(not_a_cert.status().message().find("tls_cert_file"), absl::string_view::npos)
      << not_a_cert.status();
  auto wrong_key = TlsContext::Load(certs_->cert("node0"), certs_->key("node1"), certs_->ca());
  ASSERT_FALSE(wrong_key.ok());
  EXPECT_NE(wrong_key.status().message().find("tls_key_file"), absl::string_view::npos)
      << wrong_key.status();
  auto no_ca = TlsContext::Load(certs_->cert("node0"), certs_->key("node0"), certs_->key("node1"));
  ASSERT_FALSE(no_ca.ok());
  EXPECT_NE(no_ca.status().message().find("tls_ca_file"), absl::string_view::npos)
      << no_ca.status();
}

}  // namespace
}  // namespace ciuic::daemon
