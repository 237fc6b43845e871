#pragma once

// The `peers` allow-list: the hosts this daemon may connect to as a job's
// coordinator, whatever address a trainer names. Entries are IPv4 or IPv6
// addresses, CIDR ranges of either ("10.0.0.0/8", "fd00::/64") and host
// names ("node-1.cluster"). A host name stands for the addresses it
// resolves to when a connection is checked, so a name-based list follows
// DNS changes. The config parser checks each entry's syntax with
// CheckPeerEntry; the daemon matches with PeerList.
//
// Thread-safety: a PeerList is immutable once built; Allows may be called
// from any thread (it may block on name resolution).

#include <sys/socket.h>

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace ciuic::config {

// OK when `entry` is an address, a CIDR range or a host name; else
// INVALID_ARGUMENT saying what is wrong with it (no key or line: the
// caller adds those).
absl::Status CheckPeerEntry(absl::string_view entry);

class PeerList {
 public:
  PeerList() = default;
  // Every entry must pass CheckPeerEntry.
  static absl::StatusOr<PeerList> Parse(const std::vector<std::string>& entries);

  bool empty() const { return entries_.empty(); }
  // Whether `address` (AF_INET or AF_INET6; v4-mapped v6 addresses count as
  // v4) is one of the listed addresses, inside a listed range, or one of
  // the addresses a listed host name resolves to now.
  bool Allows(const sockaddr* address) const;
  // The entries as written, comma-separated, for messages.
  std::string ToString() const;

 private:
  struct Entry {
    std::string text;
    int family = 0;  // AF_INET, AF_INET6; 0: a host name
    unsigned char bytes[16] = {};
    int prefix = 0;  // bits that must match
  };
  static bool Matches(const Entry& e, int family, const unsigned char* bytes);
  std::vector<Entry> entries_;
};

}  // namespace ciuic::config
