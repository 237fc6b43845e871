#include "control/peer_auth.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <openssl/rand.h>
#include <poll.h>
#include <sys/socket.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace ciuic::daemon {
namespace {

using Clock = std::chrono::steady_clock;

constexpr absl::string_view kClientLabel = "ciuic peer auth v1 client";
constexpr absl::string_view kServerLabel = "ciuic peer auth v1 server";

int MillisecondsLeft(Clock::time_point deadline) {
  const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
  return static_cast<int>(std::clamp<int64_t>(left.count(), 0, 3600 * 1000));
}

absl::string_view View(const unsigned char* p, size_t n) {
  return absl::string_view(reinterpret_cast<const char*>(p), n);
}

bool HasMagic(const unsigned char* frame) {
  return std::memcmp(frame, kPeerAuthMagic, sizeof(kPeerAuthMagic)) == 0;
}

bool HasTlsMagic(const unsigned char* frame) {
  return std::memcmp(frame, kPeerTlsMagic, sizeof(kPeerTlsMagic)) == 0;
}

bool SameProof(const std::string& want, const unsigned char* got) {
  return want.size() == kPeerAuthMacBytes && CRYPTO_memcmp(want.data(), got, want.size()) == 0;
}

absl::Status RandomNonce(unsigned char* out) {
  if (RAND_bytes(out, static_cast<int>(kPeerAuthNonceBytes)) != 1) {
    return absl::InternalError("no random bytes for the cluster-token handshake (OpenSSL RAND)");
  }
  return absl::OkStatus();
}

absl::Status NotThisHandshake(absl::string_view who) {
  return absl::InvalidArgumentError(absl::StrCat(
      who, " does not speak the ciuic peer handshake (not a ciuicd of this version?)"));
}

// The handshake's own step failed: the status says which step and why.
absl::Status During(const absl::Status& s, absl::string_view who, absl::string_view step) {
  return absl::Status(s.code(),
                      absl::StrCat(who, ": cluster-token handshake: ", step, ": ", s.message()));
}

}  // namespace

absl::Status WaitForSocket(int fd, short events, Clock::time_point deadline) {
  while (true) {
    pollfd p{fd, events, 0};
    const int r = poll(&p, 1, MillisecondsLeft(deadline));
    if (r > 0) return absl::OkStatus();
    if (r == 0) return absl::DeadlineExceededError("timed out");
    if (errno != EINTR) return absl::UnavailableError(std::strerror(errno));
  }
}

absl::Status SendExactly(int fd, const unsigned char* p, size_t n, Clock::time_point deadline) {
  while (n > 0) {
    if (absl::Status s = WaitForSocket(fd, POLLOUT, deadline); !s.ok()) return s;
    const ssize_t w = send(fd, p, n, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (w < 0) {
      if (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK) continue;
      return absl::UnavailableError(std::strerror(errno));
    }
    p += w;
    n -= static_cast<size_t>(w);
  }
  return absl::OkStatus();
}

absl::Status ReceiveExactly(int fd, unsigned char* p, size_t n, Clock::time_point deadline) {
  size_t got = 0;
  while (got < n) {
    if (absl::Status s = WaitForSocket(fd, POLLIN, deadline); !s.ok()) {
      return absl::Status(s.code(), absl::StrCat(s.message(), " after ", got, " of ", n, " bytes"));
    }
    const ssize_t r = recv(fd, p + got, n - got, MSG_DONTWAIT);
    if (r == 0) {
      return absl::UnavailableError(
          absl::StrCat("the connection closed after ", got, " of ", n, " bytes"));
    }
    if (r < 0) {
      if (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK) continue;
      return absl::UnavailableError(std::strerror(errno));
    }
    got += static_cast<size_t>(r);
  }
  return absl::OkStatus();
}

absl::Status TlsModeMismatch(const std::string& who, absl::string_view mismatch) {
  return absl::PermissionDeniedError(
      absl::StrCat(who, mismatch,
                   ": give every daemon of the cluster the TLS keys (tls_cert_file, tls_key_file, "
                   "tls_ca_file) or none"));
}

absl::Status RefuseOtherTlsMode(int fd, const char (&magic)[8], const std::string& who,
                                absl::string_view mismatch, Clock::time_point deadline) {
  unsigned char notice[kClientProofBytes] = {};
  std::memcpy(notice, magic, sizeof(magic));
  SendExactly(fd, notice, sizeof(notice), deadline).IgnoreError();  // the error below says enough
  return TlsModeMismatch(who, mismatch);
}

std::string PeerAuthProof(absl::string_view key, absl::string_view label, absl::string_view a,
                          absl::string_view b) {
  std::string message = absl::StrCat(label, a, b);
  unsigned char mac[EVP_MAX_MD_SIZE];
  unsigned int len = 0;
  static const unsigned char kEmpty = 0;  // OpenSSL wants a key pointer even for 0 bytes
  const unsigned char* k =
      key.empty() ? &kEmpty : reinterpret_cast<const unsigned char*>(key.data());
  if (HMAC(EVP_sha256(), k, static_cast<int>(key.size()),
           reinterpret_cast<const unsigned char*>(message.data()), message.size(), mac,
           &len) == nullptr) {
    return std::string();  // never equal to a received proof (SameProof checks the size)
  }
  return std::string(reinterpret_cast<const char*>(mac), len);
}

std::string PeerAddressOf(int fd) {
  sockaddr_storage a{};
  socklen_t len = sizeof(a);
  if (getpeername(fd, reinterpret_cast<sockaddr*>(&a), &len) != 0) return "(unknown peer)";
  char text[INET6_ADDRSTRLEN] = {};
  if (a.ss_family == AF_INET) {
    const auto* v4 = reinterpret_cast<const sockaddr_in*>(&a);
    inet_ntop(AF_INET, &v4->sin_addr, text, sizeof(text));
    return absl::StrCat(text, ":", ntohs(v4->sin_port));
  }
  if (a.ss_family == AF_INET6) {
    const auto* v6 = reinterpret_cast<const sockaddr_in6*>(&a);
    inet_ntop(AF_INET6, &v6->sin6_addr, text, sizeof(text));
    return absl::StrCat("[", text, "]:", ntohs(v6->sin6_port));
  }
  return "(a non-IP peer)";
}

absl::Status AuthenticateClient(int fd, absl::string_view token, const std::string& peer,
                                Clock::time_point deadline) {
  const std::string who = absl::StrCat("peer ", peer);
  unsigned char hello[kServerHelloBytes];
  std::memcpy(hello, kPeerAuthMagic, sizeof(kPeerAuthMagic));
  unsigned char* nonce_s = hello + sizeof(kPeerAuthMagic);
  if (absl::Status s = RandomNonce(nonce_s); !s.ok()) return s;
  if (absl::Status s = SendExactly(fd, hello, sizeof(hello), deadline); !s.ok()) {
    return During(s, who, "sending the challenge");
  }
  unsigned char proof[kClientProofBytes];
  if (absl::Status s = ReceiveExactly(fd, proof, sizeof(proof), deadline); !s.ok()) {
    return During(s, who, "waiting for its proof");
  }
  if (HasTlsMagic(proof)) return TlsModeMismatch(who, " uses TLS and this daemon does not");
  if (!HasMagic(proof)) {
    return NotThisHandshake(who);
  }
  const unsigned char* nonce_c = proof + sizeof(kPeerAuthMagic);
  const unsigned char* mac_c = nonce_c + kPeerAuthNonceBytes;
  const absl::string_view ns = View(nonce_s, kPeerAuthNonceBytes);
  const absl::string_view nc = View(nonce_c, kPeerAuthNonceBytes);
  const bool accepted = SameProof(PeerAuthProof(token, kClientLabel, ns, nc), mac_c);
  unsigned char verdict[kVerdictBytes] = {};
  std::memcpy(verdict, kPeerAuthMagic, sizeof(kPeerAuthMagic));
  verdict[sizeof(kPeerAuthMagic)] = accepted ? 1 : 0;
  if (accepted) {
    const std::string mac_s = PeerAuthProof(token, kServerLabel, ns, nc);
    std::memcpy(verdict + sizeof(kPeerAuthMagic) + 1, mac_s.data(),
                std::min(mac_s.size(), kPeerAuthMacBytes));
  }
  // Sent either way: a refused daemon hears why rather than a reset.
  absl::Status sent = SendExactly(fd, verdict, sizeof(verdict), deadline);
  if (!accepted) {
    return absl::PermissionDeniedError(
        absl::StrCat(who,
                     " does not know the cluster token (its daemon has another cluster_token_file, "
                     "or none)"));
  }
  if (!sent.ok()) return During(sent, who, "sending the verdict");
  return absl::OkStatus();
}

absl::Status AuthenticateServer(int fd, absl::string_view token, const std::string& server,
                                Clock::time_point deadline) {
  unsigned char hello[kServerHelloBytes];
  if (absl::Status s = ReceiveExactly(fd, hello, sizeof(hello), deadline); !s.ok()) {
    return During(s, server, "waiting for its challenge");
  }
  if (HasTlsMagic(hello)) {
    return RefuseOtherTlsMode(fd, kPeerAuthMagic, server,
                              " requires TLS and this daemon has no TLS keys", deadline);
  }
  if (!HasMagic(hello)) {
    return NotThisHandshake(server);
  }
  const absl::string_view ns = View(hello + sizeof(kPeerAuthMagic), kPeerAuthNonceBytes);
  unsigned char proof[kClientProofBytes];
  std::memcpy(proof, kPeerAuthMagic, sizeof(kPeerAuthMagic));
  unsigned char* nonce_c = proof + sizeof(kPeerAuthMagic);
  if (absl::Status s = RandomNonce(nonce_c); !s.ok()) return s;
  const absl::string_view nc = View(nonce_c, kPeerAuthNonceBytes);
  const std::string mac_c = PeerAuthProof(token, kClientLabel, ns, nc);
  std::memcpy(nonce_c + kPeerAuthNonceBytes, mac_c.data(),
              std::min(mac_c.size(), kPeerAuthMacBytes));
  if (absl::Status s = SendExactly(fd, proof, sizeof(proof), deadline); !s.ok()) {
    return During(s, server, "sending this daemon's proof");
  }
  unsigned char verdict[kVerdictBytes];
  if (absl::Status s = ReceiveExactly(fd, verdict, sizeof(verdict), deadline); !s.ok()) {
    return During(s, server, "waiting for its verdict");
  }
  if (!HasMagic(verdict)) {
    return NotThisHandshake(server);
  }
  if (verdict[sizeof(kPeerAuthMagic)] != 1) {
    return absl::PermissionDeniedError(
        absl::StrCat(server,
                     " refused this daemon's cluster-token proof: the two daemons have different "
                     "cluster tokens (or one has none)"));
  }
  if (!SameProof(PeerAuthProof(token, kServerLabel, ns, nc),
                 verdict + sizeof(kPeerAuthMagic) + 1)) {
    return absl::PermissionDeniedError(
        absl::StrCat(server,
                     " failed the cluster-token challenge: it does not know this daemon's cluster "
                     "token"));
  }
  return absl::OkStatus();
}

}  // namespace ciuic::daemon
