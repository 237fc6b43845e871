// The session socket: where a trainer opens its data-plane session.
//
// SOCK_SEQPACKET on a unix path; the kernel tells the daemon who connected
// (SO_PEERCRED) and carries the session's fds back (SCM_RIGHTS).
#pragma once

#include <sys/socket.h>
#include <sys/types.h>

#include <cstddef>
#include <string>

#include "absl/status/statusor.h"

namespace ciuic::daemon {

struct PeerCredentials {
  uid_t uid = 0;
  gid_t gid = 0;
  pid_t pid = 0;
};

// Binds and listens on `path` with a socket of `type` (SOCK_STREAM,
// SOCK_SEQPACKET). The socket file is created with mode 0666 (any user may
// connect; what a caller can reach is decided by its uid) by the bind
// itself, under a umask set for it: never chmod by path afterwards, which a
// user who could rename files in the directory could turn against another
// file. A stale socket file left by a dead daemon is replaced; a live one
// is an ALREADY_EXISTS error.
absl::StatusOr<int> ListenUnix(const std::string& path, int type);
inline absl::StatusOr<int> ListenSeqpacket(const std::string& path) {
  return ListenUnix(path, SOCK_SEQPACKET);
}

// The directory that holds the daemon's sockets must belong to the daemon's
// uid and be writable by nobody else: whoever can write there can replace
// the sockets and pose as the daemon to every trainer. FAILED_PRECONDITION
// naming the directory, its owner and mode otherwise.
absl::Status CheckRuntimeDirectory(const std::string& socket_path);

absl::StatusOr<PeerCredentials> GetPeerCredentials(int fd);

// Sends one datagram with `num_fds` descriptors attached.
absl::Status SendWithFds(int fd, const void* data, size_t len, const int* fds, int num_fds);

}  // namespace ciuic::daemon
