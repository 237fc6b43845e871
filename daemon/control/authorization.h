// Who may do what on the control socket (README, "Security").
//
// Reading (status, jobs, peers, trace) is open to every local user, but a
// caller sees its own uid's jobs and sessions in full and everyone else's
// only as counts; an administrator sees everything. Changing the daemon
// (tune set) needs an administrator: root, the daemon's own uid, or a
// member of the configured admin_group. Plain data, any thread.
#pragma once

#include <sys/types.h>

#include <optional>
#include <string>

#include "absl/status/status.h"
#include "control/control_socket.h"

namespace ciuic::daemon {

class Authorization {
 public:
  // `admin_group` is a group name ("" = none) that must exist.
  static absl::StatusOr<Authorization> Make(uid_t daemon_uid, const std::string& admin_group);

  bool IsAdmin(const Caller& caller) const;
  // Whether `caller` sees the jobs and sessions of `owner` in full.
  bool Sees(const Caller& caller, uid_t owner) const {
    return caller.uid == owner || IsAdmin(caller);
  }
  // OK for an administrator; else PERMISSION_DENIED naming what was asked
  // (`what`, e.g. "tune set") and the rule.
  absl::Status CheckAdmin(const Caller& caller, const std::string& what) const;

 private:
  Authorization(uid_t daemon_uid, std::string group_name, std::optional<gid_t> gid)
      : daemon_uid_(daemon_uid), group_name_(std::move(group_name)), admin_gid_(gid) {}

  uid_t daemon_uid_;
  std::string group_name_;
  std::optional<gid_t> admin_gid_;
};

}  // namespace ciuic::daemon
