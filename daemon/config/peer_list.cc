#include "config/peer_list.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>

#include <cstring>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"

namespace ciuic::config {
namespace {

constexpr size_t kMaxHostNameLength = 253;

// An address, with an optional "/prefix"; false if `text` is neither.
bool ParseAddress(absl::string_view text, int* family, unsigned char* bytes, int* prefix,
                  std::string* why) {
  absl::string_view address = text;
  absl::string_view bits;
  const size_t slash = text.find('/');
  if (slash != absl::string_view::npos) {
    address = text.substr(0, slash);
    bits = text.substr(slash + 1);
  }
  std::string a(address);
  if (a.size() >= 2 && a.front() == '[' && a.back() == ']') a = a.substr(1, a.size() - 2);
  if (inet_pton(AF_INET, a.c_str(), bytes) == 1) {
    *family = AF_INET;
  } else if (inet_pton(AF_INET6, a.c_str(), bytes) == 1) {
    *family = AF_INET6;
  } else {
    if (slash != absl::string_view::npos) *why = "a range must start with an IP address";
    return false;
  }
  const int max_bits = *family == AF_INET ? 32 : 128;
  *prefix = max_bits;
  if (slash != absl::string_view::npos) {
    int n = -1;
    if (!absl::SimpleAtoi(bits, &n) || n < 0 || n > max_bits || bits.empty() ||
        !absl::ascii_isdigit(static_cast<unsigned char>(bits.front()))) {
      *why = absl::StrCat("the prefix length must be 0..", max_bits);
      return false;
    }
    *prefix = n;
  }
  return true;
}

bool IsHostName(absl::string_view text) {
  if (text.empty() || text.size() > kMaxHostNameLength) return false;
  for (absl::string_view label : absl::StrSplit(text, '.')) {
    if (label.empty() || label.size() > 63 || label.front() == '-' || label.back() == '-') {
      return false;
    }
    for (char c : label) {
      if (!absl::ascii_isalnum(static_cast<unsigned char>(c)) && c != '-' && c != '_') return false;
    }
  }
  return true;
}

// The address bytes of `a` as (family, bytes): v4-mapped v6 as v4.
bool AddressBytes(const sockaddr* a, int* family, unsigned char* bytes) {
  if (a->sa_family == AF_INET) {
    *family = AF_INET;
    std::memcpy(bytes, &reinterpret_cast<const sockaddr_in*>(a)->sin_addr, 4);
    return true;
  }
  if (a->sa_family == AF_INET6) {
    const auto* v6 = &reinterpret_cast<const sockaddr_in6*>(a)->sin6_addr;
    if (IN6_IS_ADDR_V4MAPPED(v6)) {
      *family = AF_INET;
      std::memcpy(bytes, v6->s6_addr + 12, 4);
    } else {
      *family = AF_INET6;
      std::memcpy(bytes, v6->s6_addr, 16);
    }
    return true;
  }
  return false;
}

}  // namespace

absl::Status CheckPeerEntry(absl::string_view entry) {
  int family = 0, prefix = 0;
  unsigned char bytes[16];
  std::string why;
  if (ParseAddress(entry, &family, bytes, &prefix, &why)) return absl::OkStatus();
  if (!why.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("'", entry, "' is not a CIDR range: ", why));
  }
  if (IsHostName(entry)) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat("'", entry,
                   "' is neither an IP address, a CIDR range (10.0.0.0/8, fd00::/64) nor a host "
                   "name"));
}

absl::StatusOr<PeerList> PeerList::Parse(const std::vector<std::string>& entries) {
  PeerList list;
  for (const std::string& text : entries) {
    if (absl::Status s = CheckPeerEntry(text); !s.ok()) return s;
    Entry e;
    e.text = text;
    std::string why;
    if (!ParseAddress(text, &e.family, e.bytes, &e.prefix, &why)) e.family = 0;
    list.entries_.push_back(std::move(e));
  }
  return list;
}

bool PeerList::Matches(const Entry& e, int family, const unsigned char* bytes) {
  if (e.family != family) return false;
  const int full = e.prefix / 8, rest = e.prefix % 8;
  if (std::memcmp(e.bytes, bytes, static_cast<size_t>(full)) != 0) return false;
  if (rest == 0) return true;
  const unsigned char mask = static_cast<unsigned char>(0xff << (8 - rest));
  return (e.bytes[full] & mask) == (bytes[full] & mask);
}

bool PeerList::Allows(const sockaddr* address) const {
  int family = 0;
  unsigned char bytes[16] = {};
  if (!AddressBytes(address, &family, bytes)) return false;
  for (const Entry& e : entries_) {
    if (e.family != 0) {
      if (Matches(e, family, bytes)) return true;
      continue;
    }
    addrinfo hints{};
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    addrinfo* found = nullptr;
    if (getaddrinfo(e.text.c_str(), nullptr, &hints, &found) != 0) continue;
    bool match = false;
    for (addrinfo* a = found; a != nullptr && !match; a = a->ai_next) {
      Entry resolved;
      if (!AddressBytes(a->ai_addr, &resolved.family, resolved.bytes)) continue;
      resolved.prefix = resolved.family == AF_INET ? 32 : 128;
      match = Matches(resolved, family, bytes);
    }
    freeaddrinfo(found);
    if (match) return true;
  }
  return false;
}

std::string PeerList::ToString() const {
  return absl::StrJoin(entries_, ", ",
                       [](std::string* out, const Entry& e) { out->append(e.text); });
}

}  // namespace ciuic::config
