#include "config/config.h"

#include <arpa/inet.h>
#include <grp.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstring>
#include <fstream>
#include <functional>
#include <set>
#include <sstream>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "config/peer_list.h"
#include "config/values.h"
#include "yaml-cpp/yaml.h"

namespace ciuic::config {
namespace {

constexpr absl::string_view kLogLevels[] = {"trace", "debug",    "info", "warn",
                                            "error", "critical", "off"};
constexpr int kMaxWorkerThreads = 256;
constexpr uint64_t kMinArenaBytes = kMiB;
constexpr uint64_t kMaxArenaBytes = kTiB;
// sizeof(sockaddr_un::sun_path) is 108, including the terminating NUL.
constexpr size_t kMaxSocketPathLength = 107;
constexpr uint64_t kMaxWorldSizeLimit = uint64_t{1} << 24;
constexpr uint64_t kMaxSessionsLimit = 1u << 20;
constexpr size_t kMaxPeerEntries = 4096;
constexpr size_t kMaxChannelDevices = 64;  // cluster/membership.h kMaxChannels

// Parses one YAML document into a DaemonConfig, turning each problem into a
// status prefixed with "source:line: ".
class Parser {
 public:
  explicit Parser(absl::string_view source_name) : source_(source_name) {}

  absl::StatusOr<DaemonConfig> Parse(const YAML::Node& root) {
    DaemonConfig config;
    if (!root.IsDefined() || root.IsNull()) return config;
    if (!root.IsMap()) {
      return Error(root, "the config must be a map of 'key: value' lines");
    }
    using Setter = std::function<absl::Status(const YAML::Node& key, const YAML::Node& value)>;
    const std::vector<std::pair<std::string, Setter>> keys = {
        {"socket",
         Scalar([&](const auto& key, const auto& value) { return SetSocket(key, value, config); })},
        {"node_name", Scalar([&](const auto& key, const auto& value) {
           return SetNodeName(key, value, config);
         })},
        {"rack", Scalar([&](const auto& key, const auto& value) {
           return SetRack(key, value, config);
         })},
        {"log_level", Scalar([&](const auto& key, const auto& value) {
           return SetLogLevel(key, value, config);
         })},
        {"worker_threads", Scalar([&](const auto& key, const auto& value) {
           return SetWorkerThreads(key, value, config);
         })},
        {"max_arena_bytes", Scalar([&](const auto& key, const auto& value) {
           return SetArenaBytes(key, value, config);
         })},
        {"listen", Scalar([&](const auto& key, const auto& value) {
           if (value == "auto" || value == "off") {
             config.listen = value;
             return absl::OkStatus();
           }
           return SetHostPort(key, value, "listen", &config.listen);
         })},
        {"insecure_no_auth", Scalar([&](const auto& key, const auto& value) {
           const std::string v = absl::AsciiStrToLower(value);
           if (v != "true" && v != "false") {
             return Error(key, absl::StrCat("invalid value '", value,
                                            "' for 'insecure_no_auth': expected true or false"));
           }
           config.insecure_no_auth = v == "true";
           return absl::OkStatus();
         })},
        {"peers", [&](const YAML::Node& key,
                      const YAML::Node& value) { return SetPeers(key, value, config); }},
        {"channel_devices", [&](const YAML::Node& key, const YAML::Node& value) {
           return SetChannelDevices(key, value, config);
         }},
        {"metrics_listen", Scalar([&](const auto& key, const auto& value) {
           if (value.empty()) {
             config.metrics_listen.clear();
             return absl::OkStatus();
           }
           return SetHostPort(key, value, "metrics_listen", &config.metrics_listen);
         })},
        {"ordering_port", Scalar([&](const auto& key, const auto& value) {
           absl::StatusOr<uint64_t> number = ParseUnsigned(value);
           if (!number.ok() || *number > 65535) {
             return Error(key, absl::StrCat("invalid value '", value,
                                            "' for 'ordering_port': expected an integer in "
                                            "0..65535 (0 = a free port)"));
           }
           config.ordering_port = static_cast<int>(*number);
           return absl::OkStatus();
         })},
        {"cluster_token_file", Scalar([&](const auto& key, const auto& value) {
           config.cluster_token_file = value;
           return absl::OkStatus();
         })},
        {"tls_cert_file", Scalar([&](const auto& key, const auto& value) {
           return SetTlsFile(key, value, 0, &config.tls_cert_file);
         })},
        {"tls_key_file", Scalar([&](const auto& key, const auto& value) {
           return SetTlsFile(key, value, 1, &config.tls_key_file);
         })},
        {"tls_ca_file", Scalar([&](const auto& key, const auto& value) {
           return SetTlsFile(key, value, 2, &config.tls_ca_file);
         })},
        {"admin_group", Scalar([&](const auto& key, const auto& value) {
           return SetAdminGroup(key, value, config);
         })},
        {"max_world_size", Scalar([&](const auto& key, const auto& value) {
           return SetCount(key, value, "max_world_size", 1, kMaxWorldSizeLimit,
                           &config.max_world_size);
         })},
        {"max_sessions", Scalar([&](const auto& key, const auto& value) {
           return SetCount(key, value, "max_sessions", 1, kMaxSessionsLimit, &config.max_sessions);
         })},
        {"max_sessions_per_uid", Scalar([&](const auto& key, const auto& value) {
           return SetCount(key, value, "max_sessions_per_uid", 1, kMaxSessionsLimit,
                           &config.max_sessions_per_uid);
         })},
        {"max_jobs_per_uid", Scalar([&](const auto& key, const auto& value) {
           return SetCount(key, value, "max_jobs_per_uid", 1, kMaxSessionsLimit,
                           &config.max_jobs_per_uid);
         })},
        {"max_arena_bytes_per_uid", Scalar([&](const auto& key, const auto& value) {
           return SetTotalBytes(key, value, "max_arena_bytes_per_uid",
                                &config.max_arena_bytes_per_uid);
         })},
        {"max_arena_bytes_total", Scalar([&](const auto& key, const auto& value) {
           return SetTotalBytes(key, value, "max_arena_bytes_total", &config.max_arena_bytes_total);
         })},
        {"tuning", [&](const YAML::Node& key,
                       const YAML::Node& value) { return ParseTuning(key, value, config.tuning); }},
    };
    std::vector<std::string> names;
    for (const auto& [name, setter] : keys) names.push_back(name);

    std::set<std::string> seen;
    for (const auto& item : root) {
      absl::StatusOr<std::string> name = KeyName(item.first, seen);
      if (!name.ok()) return name.status();
      auto it = std::find_if(keys.begin(), keys.end(),
                             [&](const auto& entry) { return entry.first == *name; });
      if (it == keys.end()) {
        return Error(item.first,
                     absl::StrCat("unknown key '", *name, "'", DidYouMean(*name, names)));
      }
      if (absl::Status status = it->second(item.first, item.second); !status.ok()) {
        return status;
      }
    }
    if (absl::Status status = CheckTlsKeys(); !status.ok()) return status;
    return config;
  }

 private:
  using ScalarSetter = std::function<absl::Status(const YAML::Node& key, const std::string& value)>;

  // Wraps a setter that takes the scalar text, rejecting maps, lists and
  // missing values first.
  std::function<absl::Status(const YAML::Node&, const YAML::Node&)> Scalar(ScalarSetter setter) {
    return [this, setter](const YAML::Node& key, const YAML::Node& value) -> absl::Status {
      std::string name = key.Scalar();
      if (value.IsNull()) return Error(key, absl::StrCat("key '", name, "' has no value"));
      if (!value.IsScalar()) {
        return Error(value, absl::StrCat("key '", name, "' must be a single value, not a ",
                                         value.IsMap() ? "map" : "list"));
      }
      return setter(key, value.Scalar());
    };
  }

  absl::Status ParseTuning(const YAML::Node& key, const YAML::Node& map, Tuning& tuning) {
    if (map.IsNull()) return absl::OkStatus();
    if (!map.IsMap()) {
      return Error(map, "'tuning' must be a map of 'key: value' lines");
    }
    std::set<std::string> seen;
    for (const auto& item : map) {
      absl::StatusOr<std::string> name = KeyName(item.first, seen);
      if (!name.ok()) return name.status();
      if (!IsTuningKey(*name)) {
        return Error(item.first, absl::StrCat("unknown key '", *name, "' in 'tuning'",
                                              DidYouMean(*name, TuningKeys())));
      }
      const YAML::Node& value = item.second;
      if (value.IsNull()) return Error(item.first, absl::StrCat("key '", *name, "' has no value"));
      if (!value.IsScalar()) {
        return Error(value, absl::StrCat("key '", *name, "' must be a single value, not a ",
                                         value.IsMap() ? "map" : "list"));
      }
      if (absl::Status status = SetTuningValue(tuning, *name, value.Scalar()); !status.ok()) {
        return Error(value, status.message());
      }
    }
    return absl::OkStatus();
  }

  absl::Status SetSocket(const YAML::Node& key, const std::string& value, DaemonConfig& config) {
    if (value.empty()) return Error(key, "invalid value '' for 'socket': expected a path");
    if (value.size() > kMaxSocketPathLength) {
      return Error(key, absl::StrCat("invalid value '", value, "' for 'socket': longer than ",
                                     kMaxSocketPathLength, " bytes (the unix socket limit)"));
    }
    config.socket_path = value;
    return absl::OkStatus();
  }

  absl::Status SetRack(const YAML::Node& key, const std::string& value, DaemonConfig& config) {
    if (!ValidRackName(value)) {
      return Error(key, absl::StrCat("invalid value '", value,
                                     "' for 'rack': expected up to 64 characters from "
                                     "letters, digits, '-', '.', '_'"));
    }
    config.rack = value;
    return absl::OkStatus();
  }

  absl::Status SetNodeName(const YAML::Node& key, const std::string& value, DaemonConfig& config) {
    bool valid = !value.empty() && value.size() <= 255;
    for (char c : value) {
      if (!absl::ascii_isalnum(static_cast<unsigned char>(c)) && c != '-' && c != '.' && c != '_') {
        valid = false;
      }
    }
    if (!valid) {
      return Error(key, absl::StrCat("invalid value '", value,
                                     "' for 'node_name': expected 1..255 characters from "
                                     "letters, digits, '-', '.', '_'"));
    }
    config.node_name = value;
    return absl::OkStatus();
  }

  absl::Status SetLogLevel(const YAML::Node& key, const std::string& value, DaemonConfig& config) {
    std::string level = absl::AsciiStrToLower(value);
    if (level == "warning") level = "warn";
    for (absl::string_view known : kLogLevels) {
      if (level == known) {
        config.log_level = level;
        return absl::OkStatus();
      }
    }
    return Error(key, absl::StrCat("invalid value '", value, "' for 'log_level': expected one of ",
                                   absl::StrJoin(kLogLevels, ", ")));
  }

  absl::Status SetWorkerThreads(const YAML::Node& key, const std::string& value,
                                DaemonConfig& config) {
    absl::StatusOr<uint64_t> number = ParseUnsigned(value);
    if (!number.ok() || *number > kMaxWorkerThreads) {
      return Error(key, absl::StrCat("invalid value '", value,
                                     "' for 'worker_threads': expected an integer in 0..",
                                     kMaxWorkerThreads, " (0 = number of cores)"));
    }
    config.worker_threads = static_cast<int>(*number);
    return absl::OkStatus();
  }

  absl::Status SetArenaBytes(const YAML::Node& key, const std::string& value,
                             DaemonConfig& config) {
    absl::StatusOr<uint64_t> bytes = ParseByteSize(value);
    std::string range =
        absl::StrCat(FormatByteSize(kMinArenaBytes), "..", FormatByteSize(kMaxArenaBytes));
    if (!bytes.ok()) {
      return Error(key, absl::StrCat("invalid value '", value, "' for 'max_arena_bytes': ",
                                     bytes.status().message(), "; expected a size in ", range));
    }
    if (*bytes < kMinArenaBytes || *bytes > kMaxArenaBytes) {
      return Error(
          key, absl::StrCat("invalid value '", value,
                            "' for 'max_arena_bytes': out of range; expected a size in ", range));
    }
    config.max_arena_bytes = *bytes;
    return absl::OkStatus();
  }

  absl::Status SetAdminGroup(const YAML::Node& key, const std::string& value,
                             DaemonConfig& config) {
    if (!value.empty() && getgrnam(value.c_str()) == nullptr) {
      return Error(key, absl::StrCat("invalid value '", value,
                                     "' for 'admin_group': no such group on this host"));
    }
    config.admin_group = value;
    return absl::OkStatus();
  }

  absl::Status SetCount(const YAML::Node& key, const std::string& value, absl::string_view name,
                        uint64_t min, uint64_t max, uint32_t* out) {
    absl::StatusOr<uint64_t> number = ParseUnsigned(value);
    if (!number.ok() || *number < min || *number > max) {
      return Error(key, absl::StrCat("invalid value '", value, "' for '", name,
                                     "': expected an integer in ", min, "..", max));
    }
    *out = static_cast<uint32_t>(*number);
    return absl::OkStatus();
  }

  absl::Status SetTotalBytes(const YAML::Node& key, const std::string& value,
                             absl::string_view name, uint64_t* out) {
    absl::StatusOr<uint64_t> bytes = ParseByteSize(value);
    if (!bytes.ok() || (*bytes != 0 && (*bytes < kMinArenaBytes || *bytes > 64 * kTiB))) {
      return Error(key, absl::StrCat("invalid value '", value, "' for '", name,
                                     "': expected a size in ", FormatByteSize(kMinArenaBytes),
                                     "..64T, or 0 for a share of physical memory"));
    }
    *out = *bytes;
    return absl::OkStatus();
  }

  // A YAML list, or one string of comma-separated entries; "" or [] = none.
  // The entries of a key whose value is a YAML list or a comma-separated
  // string (`name: a, b` or `name: [a, b]`; nothing after the key: none),
  // each with its node for error lines.
  absl::Status ListEntries(const YAML::Node& value, absl::string_view name,
                           absl::string_view what,
                           std::vector<std::pair<std::string, YAML::Node>>* entries) {
    if (value.IsNull()) return absl::OkStatus();
    if (value.IsScalar()) {
      for (absl::string_view part : absl::StrSplit(value.Scalar(), ',')) {
        part = absl::StripAsciiWhitespace(part);
        if (!part.empty()) entries->emplace_back(std::string(part), value);
      }
      return absl::OkStatus();
    }
    if (value.IsSequence()) {
      for (const YAML::Node& item : value) {
        if (!item.IsScalar()) {
          return Error(item, absl::StrCat("each entry of '", name, "' must be a single value"));
        }
        entries->emplace_back(std::string(absl::StripAsciiWhitespace(item.Scalar())), item);
      }
      return absl::OkStatus();
    }
    return Error(value, absl::StrCat("'", name, "' must be a list (or a comma-separated string) of ",
                                     what));
  }

  absl::Status SetPeers(const YAML::Node& key, const YAML::Node& value, DaemonConfig& config) {
    std::vector<std::pair<std::string, YAML::Node>> entries;
    if (absl::Status s =
            ListEntries(value, "peers", "addresses, CIDR ranges and host names", &entries);
        !s.ok()) {
      return s;
    }
    if (entries.size() > kMaxPeerEntries) {
      return Error(
          key, absl::StrCat("'peers' has ", entries.size(), " entries; at most ", kMaxPeerEntries));
    }
    config.peers.clear();
    for (const auto& [entry, node] : entries) {
      if (absl::Status s = CheckPeerEntry(entry); !s.ok()) {
        return Error(node, absl::StrCat("invalid entry in 'peers': ", s.message()));
      }
      config.peers.push_back(entry);
    }
    return absl::OkStatus();
  }

  absl::Status SetChannelDevices(const YAML::Node& key, const YAML::Node& value,
                                 DaemonConfig& config) {
    std::vector<std::pair<std::string, YAML::Node>> entries;
    if (absl::Status s = ListEntries(value, "channel_devices", "network devices", &entries);
        !s.ok()) {
      return s;
    }
    if (entries.size() > kMaxChannelDevices) {
      return Error(key, absl::StrCat("'channel_devices' has ", entries.size(),
                                     " entries; at most ", kMaxChannelDevices, " channels"));
    }
    config.channel_devices.clear();
    for (const auto& [entry, node] : entries) {
      const bool ok = entry.size() <= 64 && std::all_of(entry.begin(), entry.end(), [](char c) {
                        return absl::ascii_isalnum(static_cast<unsigned char>(c)) || c == '_' || c == '.' || c == ':' ||
                               c == '-' || c == '@';
                      });
      if (!ok) {
        return Error(node, absl::StrCat("invalid entry '", entry,
                                        "' in 'channel_devices': a network device as UCX names "
                                        "it (e.g. eth1, mlx5_0:1), at most 64 characters"));
      }
      config.channel_devices.push_back(entry);
    }
    return absl::OkStatus();
  }

  absl::Status SetHostPort(const YAML::Node& key, const std::string& value, absl::string_view name,
                           std::string* out) {
    auto bad = [&](absl::string_view why) {
      return Error(key, absl::StrCat("invalid value '", value, "' for '", name, "': ", why,
                                     "; expected host:port, e.g. 0.0.0.0:7361 or [::]:7361"));
    };
    size_t colon = value.rfind(':');
    if (colon == std::string::npos) return bad("no port");
    std::string host = value.substr(0, colon);
    std::string port = value.substr(colon + 1);
    if (host.empty()) return bad("no host");
    if (host.front() == '[') {
      if (host.size() < 3 || host.back() != ']') return bad("unbalanced brackets");
      for (char c : host.substr(1, host.size() - 2)) {
        if (!absl::ascii_isxdigit(static_cast<unsigned char>(c)) && c != ':' && c != '.') {
          return bad("not an IPv6 address in brackets");
        }
      }
    } else {
      for (char c : host) {
        if (c == ':') return bad("IPv6 addresses must be in brackets");
        if (!absl::ascii_isalnum(static_cast<unsigned char>(c)) && c != '-' && c != '.' &&
            c != '_') {
          return bad("bad character in host");
        }
      }
    }
    absl::StatusOr<uint64_t> number = ParseUnsigned(port);
    if (!number.ok() || *number > 65535) return bad("port must be an integer in 0..65535");
    *out = value;
    return absl::OkStatus();
  }

  // The text of a map key, which must be a scalar and appear once.
  absl::StatusOr<std::string> KeyName(const YAML::Node& key, std::set<std::string>& seen) {
    if (!key.IsScalar()) return Error(key, "keys must be plain names");
    std::string name = key.Scalar();
    if (!seen.insert(name).second) {
      return Error(key, absl::StrCat("key '", name, "' appears more than once"));
    }
    return name;
  }

  // tls_cert_file, tls_key_file, tls_ca_file: the key nodes of those set
  // (non-empty), to name the line when they do not come together.
  absl::Status SetTlsFile(const YAML::Node& key, const std::string& value, int which,
                          std::string* out) {
    *out = value;
    tls_set_[which] = !value.empty();
    tls_keys_[which] = key;
    return absl::OkStatus();
  }

  absl::Status CheckTlsKeys() const {
    static constexpr absl::string_view kNames[3] = {"tls_cert_file", "tls_key_file", "tls_ca_file"};
    int set = 0;
    std::string missing;
    for (int i = 0; i < 3; ++i) {
      if (tls_set_[i]) {
        ++set;
      } else {
        absl::StrAppend(&missing, missing.empty() ? "" : ", ", kNames[i]);
      }
    }
    if (set == 0 || set == 3) return absl::OkStatus();
    int first = -1;  // the one set earliest in the file names the line
    for (int i = 0; i < 3; ++i) {
      if (tls_set_[i] && (first < 0 || tls_keys_[i].Mark().line < tls_keys_[first].Mark().line)) {
        first = i;
      }
    }
    return Error(tls_keys_[first],
                 absl::StrCat("TLS between daemons needs tls_cert_file, tls_key_file and "
                              "tls_ca_file together (or none of them); missing: ",
                              missing));
  }

  absl::Status Error(const YAML::Node& node, absl::string_view message) const {
    YAML::Mark mark = node.Mark();
    if (mark.is_null()) {
      return absl::InvalidArgumentError(absl::StrCat(source_, ": ", message));
    }
    return absl::InvalidArgumentError(absl::StrCat(source_, ":", mark.line + 1, ": ", message));
  }

  std::string source_;
  bool tls_set_[3] = {false, false, false};
  YAML::Node tls_keys_[3];
};

}  // namespace

bool ValidRackName(absl::string_view rack) {
  if (rack.size() > 64) return false;
  for (char c : rack) {
    if (!absl::ascii_isalnum(static_cast<unsigned char>(c)) && c != '-' && c != '.' && c != '_') {
      return false;
    }
  }
  return true;
}

std::string DefaultNodeName() {
  char name[HOST_NAME_MAX + 1] = {};
  if (gethostname(name, sizeof(name) - 1) != 0 || name[0] == '\0') return "localhost";
  return name;
}

absl::StatusOr<DaemonConfig> ParseConfigYaml(absl::string_view text,
                                             absl::string_view source_name) {
  YAML::Node root;
  try {
    root = YAML::Load(std::string(text));
  } catch (const YAML::Exception& e) {
    if (e.mark.is_null()) {
      return absl::InvalidArgumentError(absl::StrCat(source_name, ": YAML syntax error: ", e.msg));
    }
    return absl::InvalidArgumentError(
        absl::StrCat(source_name, ":", e.mark.line + 1, ": YAML syntax error: ", e.msg));
  }
  try {
    return Parser(source_name).Parse(root);
  } catch (const std::exception& e) {
    // yaml-cpp reports misuse by exception; none should reach here, but a
    // config file must never crash the daemon.
    return absl::InvalidArgumentError(absl::StrCat(source_name, ": ", e.what()));
  }
}

bool IsLoopbackHost(absl::string_view host) {
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') {
    host = host.substr(1, host.size() - 2);
  }
  if (absl::AsciiStrToLower(host) == "localhost") return true;
  const std::string h(host);
  unsigned char bytes[16];
  if (inet_pton(AF_INET, h.c_str(), bytes) == 1) return bytes[0] == 127;
  if (inet_pton(AF_INET6, h.c_str(), bytes) == 1) {
    static const unsigned char kLoopback6[16] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1};
    return std::memcmp(bytes, kLoopback6, 16) == 0;
  }
  return false;
}

absl::StatusOr<std::string> PeerListenAddress(const DaemonConfig& config) {
  const bool token = !config.cluster_token_file.empty();
  if (config.listen == "off") return std::string();
  if (config.listen == "auto") {
    return std::string(token ? "0.0.0.0:7361" : "127.0.0.1:7361");
  }
  const std::string host = config.listen.substr(0, config.listen.rfind(':'));
  if (!token && !config.insecure_no_auth && !IsLoopbackHost(host)) {
    return absl::FailedPreconditionError(absl::StrCat(
        "listen: ", config.listen,
        " is reachable from other hosts, but there is no "
        "cluster_token_file: any host could join this daemon's jobs. Set cluster_token_file "
        "(the same secret on every node), listen on 127.0.0.1, or set insecure_no_auth: true "
        "on a network you trust"));
  }
  return config.listen;
}

absl::StatusOr<DaemonConfig> LoadConfigFile(const std::string& path) {
  struct stat info;
  if (stat(path.c_str(), &info) == 0 && S_ISDIR(info.st_mode)) {
    return absl::InvalidArgumentError(
        absl::StrCat("cannot read config file '", path, "': it is a directory"));
  }
  std::ifstream file(path, std::ios::in | std::ios::binary);
  if (!file) {
    int error = errno;
    std::string message =
        absl::StrCat("cannot read config file '", path, "': ", std::strerror(error));
    if (error == EACCES) return absl::PermissionDeniedError(message);
    return absl::NotFoundError(message);
  }
  std::ostringstream text;
  text << file.rdbuf();
  if (file.bad()) {
    return absl::DataLossError(absl::StrCat("error reading config file '", path, "'"));
  }
  return ParseConfigYaml(text.str(), path);
}

}  // namespace ciuic::config
