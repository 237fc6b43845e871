// The session socket: where a trainer opens its data-plane session.
//
// SOCK_SEQPACKET on a unix path; the kernel tells the daemon who connected
// (SO_PEERCRED) and carries the session's fds back (SCM_RIGHTS).
#pragma once

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

// Binds and listens on `path` (mode 0666: any user may open a session; what
// a session can reach is decided by its uid). A stale socket file left by a
// dead daemon is replaced; a live one is an ALREADY_EXISTS error.
absl::StatusOr<int> ListenSeqpacket(const std::string& path);

absl::StatusOr<PeerCredentials> GetPeerCredentials(int fd);

// Sends one datagram with `num_fds` descriptors attached.
absl::Status SendWithFds(int fd, const void* data, size_t len, const int* fds, int num_fds);

}  // namespace ciuic::daemon
