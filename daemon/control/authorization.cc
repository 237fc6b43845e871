#include "control/authorization.h"

#include <grp.h>

#include <algorithm>
#include <vector>

#include "absl/strings/str_cat.h"

namespace ciuic::daemon {

absl::StatusOr<Authorization> Authorization::Make(uid_t daemon_uid,
                                                  const std::string& admin_group) {
  if (admin_group.empty()) return Authorization(daemon_uid, "", std::nullopt);
  // getgrnam_r: the buffer grows for groups with many members.
  std::vector<char> buffer(16384);
  group entry{};
  group* found = nullptr;
  int error = 0;
  while ((error = getgrnam_r(admin_group.c_str(), &entry, buffer.data(), buffer.size(),
                             &found)) == ERANGE &&
         buffer.size() < (16u << 20)) {
    buffer.resize(buffer.size() * 4);
  }
  if (error != 0 || found == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("admin_group '", admin_group, "' is not a group on this host"));
  }
  return Authorization(daemon_uid, admin_group, found->gr_gid);
}

bool Authorization::IsAdmin(const Caller& caller) const {
  if (caller.uid == 0 || caller.uid == daemon_uid_) return true;
  if (!admin_gid_) return false;
  return caller.gid == *admin_gid_ ||
         std::find(caller.groups.begin(), caller.groups.end(), *admin_gid_) !=
             caller.groups.end();
}

absl::Status Authorization::CheckAdmin(const Caller& caller, const std::string& what) const {
  if (IsAdmin(caller)) return absl::OkStatus();
  return absl::PermissionDeniedError(absl::StrCat(
      what, " changes ciuicd for every user: it needs root, ciuicd's own uid (", daemon_uid_,
      ")",
      group_name_.empty() ? " or a member of the config's admin_group (none is set)"
                          : absl::StrCat(" or a member of admin_group '", group_name_, "'"),
      "; uid ", caller.uid, " is none of these"));
}

}  // namespace ciuic::daemon
