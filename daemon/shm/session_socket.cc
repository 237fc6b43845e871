#include "shm/session_socket.h"

#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace ciuic::daemon {

namespace {
absl::Status Errno(absl::string_view what) {
  return absl::InternalError(absl::StrCat(what, ": ", std::strerror(errno)));
}
}  // namespace

absl::StatusOr<int> ListenUnix(const std::string& path, int type) {
  sockaddr_un addr{};
  if (path.empty() || path.size() >= sizeof(addr.sun_path)) {
    return absl::InvalidArgumentError(
        absl::StrCat("socket path '", path, "' is empty or longer than ",
                     sizeof(addr.sun_path) - 1, " bytes"));
  }
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, path.data(), path.size());

  // Is somebody alive behind an existing socket file?
  int probe = socket(AF_UNIX, type | SOCK_CLOEXEC, 0);
  if (probe >= 0) {
    bool alive = connect(probe, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0;
    close(probe);
    if (alive) {
      return absl::AlreadyExistsError(
          absl::StrCat("another ciuicd is already listening on ", path));
    }
  }
  unlink(path.c_str());

  int fd = socket(AF_UNIX, type | SOCK_CLOEXEC, 0);
  if (fd < 0) return Errno("socket");
  // The file gets 0777 & ~umask at bind: 0666 under umask 0111. The umask
  // is the process's; ciuicd binds its sockets while starting, before any
  // thread of its own creates files.
  const mode_t old_umask = umask(0111);
  const int bound = bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
  const int bind_errno = errno;
  umask(old_umask);
  if (bound != 0) {
    errno = bind_errno;
    absl::Status s = Errno(absl::StrCat("bind ", path));
    close(fd);
    return s;
  }
  if (listen(fd, 128) != 0) {
    absl::Status s = Errno(absl::StrCat("listen ", path));
    close(fd);
    return s;
  }
  return fd;
}

absl::Status CheckRuntimeDirectory(const std::string& socket_path) {
  const auto slash = socket_path.rfind('/');
  const std::string dir = slash == std::string::npos ? "."
                          : slash == 0              ? "/"
                                                    : socket_path.substr(0, slash);
  struct stat st {};
  if (stat(dir.c_str(), &st) != 0) return Errno(absl::StrCat("stat ", dir));
  const uid_t self = geteuid();
  if (st.st_uid != self || (st.st_mode & (S_IWGRP | S_IWOTH)) != 0) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "the directory %s of socket %s belongs to uid %d with mode %04o; it must belong to "
        "ciuicd's uid %d and be writable by no one else, or another user could replace the "
        "daemon's sockets and pose as ciuicd (use e.g. /run/ciuic, systemd's "
        "RuntimeDirectory)",
        dir, socket_path, st.st_uid, st.st_mode & 07777, self));
  }
  return absl::OkStatus();
}

absl::StatusOr<PeerCredentials> GetPeerCredentials(int fd) {
  ucred cred{};
  socklen_t len = sizeof(cred);
  if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0) return Errno("SO_PEERCRED");
  return PeerCredentials{cred.uid, cred.gid, cred.pid};
}

absl::Status SendWithFds(int fd, const void* data, size_t len, const int* fds, int num_fds) {
  iovec iov{const_cast<void*>(data), len};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  std::vector<char> control;
  if (num_fds > 0) {
    control.resize(CMSG_SPACE(sizeof(int) * num_fds));
    msg.msg_control = control.data();
    msg.msg_controllen = control.size();
    cmsghdr* cmsg = CMSG_FIRSTHDR(&msg);
    cmsg->cmsg_level = SOL_SOCKET;
    cmsg->cmsg_type = SCM_RIGHTS;
    cmsg->cmsg_len = CMSG_LEN(sizeof(int) * num_fds);
    std::memcpy(CMSG_DATA(cmsg), fds, sizeof(int) * num_fds);
  }
  ssize_t n;
  do {
    n = sendmsg(fd, &msg, MSG_NOSIGNAL);
  } while (n < 0 && errno == EINTR);
  if (n < 0) return Errno("sendmsg on session socket");
  if (static_cast<size_t>(n) != len) return absl::InternalError("short send on session socket");
  return absl::OkStatus();
}

}  // namespace ciuic::daemon
