// Mutual challenge-response between two daemons of a cluster, on a freshly
// connected TCP socket, before anything else is read from it or allocated
// for it. Both sides prove that they know the cluster token; the token
// itself never crosses the wire.
//
// Frames (fixed sizes, nothing in them sizes a buffer):
//   server -> client  ServerHello  kMagic (8) | nonce_s (32)
//   client -> server  ClientProof  kMagic (8) | nonce_c (32) |
//                                  HMAC-SHA256(token, "ciuic peer auth v1 client" | nonce_s |
//                                  nonce_c)
//   server -> client  Verdict      kMagic (8) | accepted (1: 1 yes, 0 no) |
//                                  HMAC-SHA256(token, "ciuic peer auth v1 server" | nonce_s |
//                                  nonce_c) (zeros when refused)
// Then the socket carries the real protocol (gRPC's HTTP/2, or the ordering
// stream's frames). A daemon without a token uses the empty key: the same
// exchange, so a daemon with a token and one without fail it, clearly.
// Proofs are compared in constant time; the labels differ per direction so
// that one side's proof can never be replayed as the other's. Each side's
// fresh nonce makes a recorded exchange useless for a later connection.
//
// With TLS keys (tls_relay.h) the exchange runs inside the TLS session.
// A plaintext daemon that meets a TLS daemon's announcement (kPeerTlsMagic
// where a ServerHello or ClientProof belongs) says so and fails with an
// error naming the tls_* keys; the TLS side does the same the other way.
//
// What it does not do by itself: encrypt or integrity-protect what follows
// (TLS does, when configured), or stop a host that a trainer names as its job's
// coordinator from relaying the exchange to a real daemon (the `peers`
// allow-list does: the daemon then connects to listed hosts only).
//
// Every read and write has the caller's deadline (poll). Both functions may
// be called from any thread; they block.
#pragma once

#include <chrono>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace ciuic::daemon {

inline constexpr char kPeerAuthMagic[8] = {'C', 'I', 'U', 'I', 'C', 'P', 'A', '1'};
// Opens the frames of a daemon that uses TLS before its TLS handshake.
inline constexpr char kPeerTlsMagic[8] = {'C', 'I', 'U', 'I', 'C', 'T', 'L', '1'};
inline constexpr size_t kPeerAuthNonceBytes = 32;
inline constexpr size_t kPeerAuthMacBytes = 32;
inline constexpr size_t kServerHelloBytes = sizeof(kPeerAuthMagic) + kPeerAuthNonceBytes;
inline constexpr size_t kClientProofBytes =
    sizeof(kPeerAuthMagic) + kPeerAuthNonceBytes + kPeerAuthMacBytes;
inline constexpr size_t kVerdictBytes = sizeof(kPeerAuthMagic) + 1 + kPeerAuthMacBytes;
// How long a connection may take to authenticate, by default.
inline constexpr std::chrono::milliseconds kPeerAuthTimeout{5000};

// The accepting side. `peer` (e.g. "1.2.3.4:5", PeerAddressOf) names the
// other end in the status and the log. PERMISSION_DENIED when the peer's
// proof is wrong ("peer X does not know the cluster token"),
// INVALID_ARGUMENT when it does not speak this handshake,
// DEADLINE_EXCEEDED, UNAVAILABLE when the connection breaks.
absl::Status AuthenticateClient(int fd, absl::string_view token, const std::string& peer,
                                std::chrono::steady_clock::time_point deadline);

// The connecting side; `server` names the other end ("coordinator
// HOST:PORT"). PERMISSION_DENIED when the server refuses this side's proof
// or fails the challenge itself, else as above.
absl::Status AuthenticateServer(int fd, absl::string_view token, const std::string& server,
                                std::chrono::steady_clock::time_point deadline);

// Socket steps with a deadline, for this handshake and the TLS one (fd
// non-blocking or not). WaitForSocket: `events` (poll) on fd; OK,
// DEADLINE_EXCEEDED or UNAVAILABLE. SendExactly: all n bytes.
// ReceiveExactly: exactly n bytes, never more, so that what follows stays
// in the socket for the protocol that takes it over.
absl::Status WaitForSocket(int fd, short events, std::chrono::steady_clock::time_point deadline);
absl::Status SendExactly(int fd, const unsigned char* p, size_t n,
                         std::chrono::steady_clock::time_point deadline);
absl::Status ReceiveExactly(int fd, unsigned char* p, size_t n,
                            std::chrono::steady_clock::time_point deadline);

// One daemon with TLS keys and one without (tls_relay.h): sends the other
// side a ClientProof-sized frame of zeros under `magic` (kPeerAuthMagic
// from the plaintext side, kPeerTlsMagic from the TLS one), so that it too
// can say why the connection goes, and returns PERMISSION_DENIED
// "<who><mismatch>: give every daemon of the cluster the TLS keys (...) or
// none".
absl::Status RefuseOtherTlsMode(int fd, const char (&magic)[8], const std::string& who,
                                absl::string_view mismatch,
                                std::chrono::steady_clock::time_point deadline);
// The same error without a frame sent (the side that learns it second).
absl::Status TlsModeMismatch(const std::string& who, absl::string_view mismatch);

// "1.2.3.4:5" or "[::1]:5": the remote end of a connected socket.
std::string PeerAddressOf(int fd);

// HMAC-SHA256(key, label | a | b): the proof each side computes.
std::string PeerAuthProof(absl::string_view key, absl::string_view label, absl::string_view a,
                          absl::string_view b);

}  // namespace ciuic::daemon
