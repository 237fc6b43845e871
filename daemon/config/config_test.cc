#include "config/config.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <string>

#include "config/peer_list.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace ciuic::config {
namespace {

using ::testing::HasSubstr;
using ::testing::StartsWith;

absl::StatusOr<DaemonConfig> Parse(absl::string_view text) {
  return ParseConfigYaml(text, "config.yaml");
}

// The error message of parsing `text`, which must fail.
std::string ErrorOf(absl::string_view text) {
  absl::StatusOr<DaemonConfig> config = Parse(text);
  EXPECT_FALSE(config.ok()) << text;
  if (config.ok()) return "";
  EXPECT_EQ(config.status().code(), absl::StatusCode::kInvalidArgument);
  return std::string(config.status().message());
}

TEST(ConfigTest, EmptyDocumentGivesDefaults) {
  for (const char* text : {"", "\n", "# only a comment\n", "~\n", "---\n"}) {
    absl::StatusOr<DaemonConfig> config = Parse(text);
    ASSERT_TRUE(config.ok()) << config.status().ToString();
    EXPECT_EQ(config->socket_path, "/run/ciuic/ciuicd.sock");
    EXPECT_EQ(config->node_name, DefaultNodeName());
    EXPECT_FALSE(config->node_name.empty());
    EXPECT_EQ(config->log_level, "info");
    EXPECT_EQ(config->worker_threads, 0);
    EXPECT_EQ(config->max_arena_bytes, uint64_t{8} << 30);
    EXPECT_EQ(config->listen, "auto");
    EXPECT_EQ(config->cluster_token_file, "");
    EXPECT_EQ(config->tuning, Tuning{});
  }
}

TEST(ConfigTest, EveryKeySet) {
  absl::StatusOr<DaemonConfig> config = Parse(R"(
socket: /tmp/ciuic-test/d.sock
node_name: gpu-node-07
log_level: debug
worker_threads: 12
max_arena_bytes: 16G
listen: "[::1]:9000"
ordering_port: 7362
cluster_token_file: /etc/ciuic/token
tuning:
  chunk_bytes: 8M
  small_op_bytes: 64K
  spin_us: 0
  op_timeout_ms: 5000
  channels: 4
  algorithm: ring
)");
  ASSERT_TRUE(config.ok()) << config.status().ToString();
  EXPECT_EQ(config->socket_path, "/tmp/ciuic-test/d.sock");
  EXPECT_EQ(config->node_name, "gpu-node-07");
  EXPECT_EQ(config->log_level, "debug");
  EXPECT_EQ(config->worker_threads, 12);
  EXPECT_EQ(config->max_arena_bytes, uint64_t{16} << 30);
  EXPECT_EQ(config->listen, "[::1]:9000");
  EXPECT_EQ(config->ordering_port, 7362);
  EXPECT_EQ(config->cluster_token_file, "/etc/ciuic/token");
  EXPECT_EQ(config->tuning.chunk_bytes, 8u << 20);
  EXPECT_EQ(config->tuning.small_op_bytes, 64u << 10);
  EXPECT_EQ(config->tuning.spin_us, 0u);
  EXPECT_EQ(config->tuning.op_timeout_ms, 5000u);
  EXPECT_EQ(config->tuning.channels, 4u);
  EXPECT_EQ(config->tuning.algorithm, Algorithm::kRing);
}

TEST(ConfigTest, ExampleFileParses) {
  absl::StatusOr<DaemonConfig> config = LoadConfigFile(CIUIC_EXAMPLE_CONFIG);
  ASSERT_TRUE(config.ok()) << config.status().ToString();
  // The example documents the defaults.
  DaemonConfig defaults;
  EXPECT_EQ(config->socket_path, defaults.socket_path);
  EXPECT_EQ(config->log_level, defaults.log_level);
  EXPECT_EQ(config->worker_threads, defaults.worker_threads);
  EXPECT_EQ(config->max_arena_bytes, defaults.max_arena_bytes);
  EXPECT_EQ(config->listen, defaults.listen);
  EXPECT_EQ(config->ordering_port, defaults.ordering_port);
  EXPECT_EQ(config->cluster_token_file, defaults.cluster_token_file);
  EXPECT_EQ(config->admin_group, defaults.admin_group);
  EXPECT_EQ(config->max_world_size, defaults.max_world_size);
  EXPECT_EQ(config->max_sessions, defaults.max_sessions);
  EXPECT_EQ(config->max_sessions_per_uid, defaults.max_sessions_per_uid);
  EXPECT_EQ(config->max_jobs_per_uid, defaults.max_jobs_per_uid);
  EXPECT_EQ(config->max_arena_bytes_per_uid, defaults.max_arena_bytes_per_uid);
  EXPECT_EQ(config->max_arena_bytes_total, defaults.max_arena_bytes_total);
  EXPECT_EQ(config->insecure_no_auth, defaults.insecure_no_auth);
  EXPECT_EQ(config->peers, defaults.peers);
  EXPECT_EQ(config->channel_devices, defaults.channel_devices);
  EXPECT_EQ(config->tuning, defaults.tuning);
}

TEST(ConfigTest, ExampleMentionsEveryKey) {
  std::ifstream file(CIUIC_EXAMPLE_CONFIG);
  std::string text((std::istreambuf_iterator<char>(file)), std::istreambuf_iterator<char>());
  for (const char* key : {"socket:", "node_name:", "log_level:", "worker_threads:",
                          "max_arena_bytes:", "listen:", "ordering_port:", "cluster_token_file:",
                          "metrics_listen:", "admin_group:", "max_world_size:",
                          "max_sessions:", "max_sessions_per_uid:", "max_jobs_per_uid:",
                          "max_arena_bytes_per_uid:", "max_arena_bytes_total:",
                          "insecure_no_auth:", "peers:", "channel_devices:", "rack:", "tuning:"}) {
    EXPECT_THAT(text, HasSubstr(key));
  }
  for (const char* key : {"tls_cert_file:", "tls_key_file:", "tls_ca_file:"}) {
    EXPECT_THAT(text, HasSubstr(key));
  }
  for (const std::string& key : TuningKeys()) EXPECT_THAT(text, HasSubstr(key + ":"));
}

TEST(ConfigTest, UnknownTopLevelKeyNamesLineAndSuggests) {
  EXPECT_EQ(ErrorOf("log_level: info\nworker_thread: 4\n"),
            "config.yaml:2: unknown key 'worker_thread' (did you mean 'worker_threads'?)");
  EXPECT_EQ(ErrorOf("bogus: 1\n"), "config.yaml:1: unknown key 'bogus'");
}

TEST(ConfigTest, UnknownTuningKeyNamesLineAndSuggests) {
  EXPECT_EQ(ErrorOf("# comment\n\nsocket: /x.sock\nlog_level: info\n\n"
                    "tuning:\n  chunk_byts: 4M\n"),
            "config.yaml:7: unknown key 'chunk_byts' in 'tuning' (did you mean 'chunk_bytes'?)");
}

TEST(ConfigTest, BadValuesNameKeyValueAndRange) {
  EXPECT_EQ(ErrorOf("tuning:\n  chunk_bytes: 2G\n"),
            "config.yaml:2: invalid value '2G' for 'chunk_bytes': out of range; expected a size "
            "in 4K..1G");
  EXPECT_THAT(ErrorOf("tuning:\n  chunk_bytes: 99999999999G\n"), HasSubstr("too large"));
  EXPECT_THAT(ErrorOf("tuning:\n  channels: 0\n"), HasSubstr("'channels'"));
  EXPECT_THAT(ErrorOf("tuning:\n  algorithm: fastest\n"),
              HasSubstr("expected one of auto, ring, halving_doubling"));
  EXPECT_EQ(ErrorOf("log_level: loud\n"),
            "config.yaml:1: invalid value 'loud' for 'log_level': expected one of trace, debug, "
            "info, warn, error, critical, off");
  EXPECT_THAT(ErrorOf("worker_threads: 257\n"), HasSubstr("0..256"));
  EXPECT_THAT(ErrorOf("worker_threads: -1\n"), HasSubstr("'worker_threads'"));
  EXPECT_THAT(ErrorOf("worker_threads: many\n"), HasSubstr("'many'"));
  EXPECT_THAT(ErrorOf("max_arena_bytes: 512K\n"), HasSubstr("expected a size in 1M..1T"));
  EXPECT_EQ(ErrorOf("ordering_port: 70000\n"),
            "config.yaml:1: invalid value '70000' for 'ordering_port': expected an integer in "
            "0..65535 (0 = a free port)");
  EXPECT_THAT(ErrorOf("ordering_port: seven\n"), HasSubstr("'ordering_port'"));
  EXPECT_THAT(ErrorOf("max_arena_bytes: 2T\n"), HasSubstr("out of range"));
  EXPECT_THAT(ErrorOf("max_arena_bytes: 99999999999G\n"), HasSubstr("too large"));
  EXPECT_THAT(ErrorOf("node_name: \"two words\"\n"), HasSubstr("'node_name'"));
  EXPECT_THAT(ErrorOf("socket: \"\"\n"), HasSubstr("'socket'"));
  EXPECT_THAT(ErrorOf("socket: /" + std::string(200, 'a') + "\n"), HasSubstr("107"));
}

TEST(ConfigTest, SecurityKeysAndLimits) {
  absl::StatusOr<DaemonConfig> config = Parse(
      "admin_group: adm\nmax_world_size: 1024\nmax_sessions: 64\nmax_sessions_per_uid: 8\n"
      "max_jobs_per_uid: 4\nmax_arena_bytes_per_uid: 16G\nmax_arena_bytes_total: 0\n");
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->admin_group, "adm");
  EXPECT_EQ(config->max_world_size, 1024u);
  EXPECT_EQ(config->max_sessions, 64u);
  EXPECT_EQ(config->max_sessions_per_uid, 8u);
  EXPECT_EQ(config->max_jobs_per_uid, 4u);
  EXPECT_EQ(config->max_arena_bytes_per_uid, uint64_t{16} << 30);
  EXPECT_EQ(config->max_arena_bytes_total, 0u);
  EXPECT_EQ(ErrorOf("admin_group: no-such-group-ciuic\n"),
            "config.yaml:1: invalid value 'no-such-group-ciuic' for 'admin_group': no such group "
            "on this host");
  EXPECT_EQ(ErrorOf("max_world_size: 0\n"),
            "config.yaml:1: invalid value '0' for 'max_world_size': expected an integer in "
            "1..16777216");
  EXPECT_THAT(ErrorOf("max_world_size: 16777217\n"), HasSubstr("'max_world_size'"));
  EXPECT_THAT(ErrorOf("max_sessions_per_uid: lots\n"), HasSubstr("'max_sessions_per_uid'"));
  EXPECT_THAT(ErrorOf("max_arena_bytes_per_uid: 1K\n"),
              HasSubstr("'max_arena_bytes_per_uid': expected a size in 1M..64T, or 0"));
  EXPECT_THAT(ErrorOf("max_arena_bytes_total: 65T\n"), HasSubstr("'max_arena_bytes_total'"));
  EXPECT_THAT(ErrorOf("max_sessoins: 3\n"), HasSubstr("did you mean 'max_sessions'"));
}

TEST(ConfigTest, ValidValues) {
  EXPECT_EQ(Parse("log_level: WARNING\n")->log_level, "warn");
  EXPECT_EQ(Parse("log_level: off\n")->log_level, "off");
  EXPECT_EQ(Parse("worker_threads: 256\n")->worker_threads, 256);
  EXPECT_EQ(Parse("max_arena_bytes: 1M\n")->max_arena_bytes, 1u << 20);
  EXPECT_EQ(Parse("max_arena_bytes: 1T\n")->max_arena_bytes, uint64_t{1} << 40);
  EXPECT_EQ(Parse("max_arena_bytes: 1048576\n")->max_arena_bytes, 1u << 20);
  EXPECT_EQ(Parse("tuning:\n")->tuning, Tuning{});
  EXPECT_EQ(Parse("cluster_token_file: \"\"\n")->cluster_token_file, "");
}

TEST(ConfigTest, Listen) {
  for (const char* good :
       {"0.0.0.0:7361", "node-1.example.com:80", "[::]:7361", "127.0.0.1:0", "localhost:65535"}) {
    absl::StatusOr<DaemonConfig> config = Parse(std::string("listen: \"") + good + "\"\n");
    ASSERT_TRUE(config.ok()) << good << ": " << config.status().ToString();
    EXPECT_EQ(config->listen, good);
  }
  for (const char* bad : {"7361", ":7361", "host:", "host:65536", "host:http", "::1:7361",
                          "[::1:7361", "ho st:1", "[zz]:1"}) {
    EXPECT_THAT(ErrorOf(std::string("listen: \"") + bad + "\"\n"),
                StartsWith("config.yaml:1: invalid value"))
        << bad;
  }
}

TEST(ConfigTest, MetricsListen) {
  absl::StatusOr<DaemonConfig> config = Parse("log_level: info\n");
  ASSERT_TRUE(config.ok());
  EXPECT_EQ(config->metrics_listen, "");  // off by default
  config = Parse("metrics_listen: \"127.0.0.1:9464\"\n");
  ASSERT_TRUE(config.ok()) << config.status().ToString();
  EXPECT_EQ(config->metrics_listen, "127.0.0.1:9464");
  config = Parse("metrics_listen: \"\"\n");
  ASSERT_TRUE(config.ok());
  EXPECT_EQ(config->metrics_listen, "");
  EXPECT_EQ(ErrorOf("metrics_listen: \"9464\"\n"),
            "config.yaml:1: invalid value '9464' for 'metrics_listen': no port; expected "
            "host:port, e.g. 0.0.0.0:7361 or [::]:7361");
}

TEST(ConfigTest, WrongNodeTypesAreErrors) {
  EXPECT_EQ(ErrorOf("log_level:\n  level: info\n"),
            "config.yaml:2: key 'log_level' must be a single value, not a map");
  EXPECT_EQ(ErrorOf("socket: [a, b]\n"),
            "config.yaml:1: key 'socket' must be a single value, not a list");
  EXPECT_EQ(ErrorOf("tuning: 5\n"), "config.yaml:1: 'tuning' must be a map of 'key: value' lines");
  EXPECT_EQ(ErrorOf("tuning:\n  - chunk_bytes\n"),
            "config.yaml:2: 'tuning' must be a map of 'key: value' lines");
  EXPECT_EQ(ErrorOf("tuning:\n  chunk_bytes:\n    a: 1\n"),
            "config.yaml:3: key 'chunk_bytes' must be a single value, not a map");
  EXPECT_EQ(ErrorOf("tuning:\n  chunk_bytes:\n"), "config.yaml:2: key 'chunk_bytes' has no value");
  EXPECT_EQ(ErrorOf("worker_threads:\n"), "config.yaml:1: key 'worker_threads' has no value");
  EXPECT_THAT(ErrorOf("- a\n- b\n"), HasSubstr("must be a map"));
  EXPECT_THAT(ErrorOf("just a string\n"), HasSubstr("must be a map"));
  EXPECT_THAT(ErrorOf("? [a, b]\n: c\n"), HasSubstr("keys must be plain names"));
}

TEST(ConfigTest, DuplicateKeysAreErrors) {
  EXPECT_EQ(ErrorOf("log_level: info\nlog_level: debug\n"),
            "config.yaml:2: key 'log_level' appears more than once");
  EXPECT_EQ(ErrorOf("tuning:\n  channels: 2\n  channels: 3\n"),
            "config.yaml:3: key 'channels' appears more than once");
}

TEST(ConfigTest, SyntaxErrorsNameFileAndLine) {
  EXPECT_THAT(ErrorOf("log_level: info\ntuning:\n  chunk_bytes: [4M\n"),
              StartsWith("config.yaml:"));
  std::string message = ErrorOf("socket: /x\n  bad indent: 1\n");
  EXPECT_THAT(message, StartsWith("config.yaml:2: YAML syntax error"));
  EXPECT_THAT(ErrorOf("log_level: info\nsocket: a: b\n"),
              StartsWith("config.yaml:2: YAML syntax error"));
}

TEST(ConfigTest, LoadConfigFile) {
  char dir_template[] = "/tmp/ciuic_config_test.XXXXXX";
  ASSERT_NE(mkdtemp(dir_template), nullptr);
  std::string dir = dir_template;
  std::string path = dir + "/ciuicd.yaml";
  {
    std::ofstream out(path);
    out << "worker_threads: 3\ntuning:\n  channels: 5\n  chunk_bytse: 1M\n";
  }
  absl::StatusOr<DaemonConfig> config = LoadConfigFile(path);
  ASSERT_FALSE(config.ok());
  EXPECT_EQ(config.status().message(),
            path + ":4: unknown key 'chunk_bytse' in 'tuning' (did you mean 'chunk_bytes'?)");
  {
    std::ofstream out(path);
    out << "worker_threads: 3\ntuning:\n  channels: 5\n";
  }
  config = LoadConfigFile(path);
  ASSERT_TRUE(config.ok()) << config.status().ToString();
  EXPECT_EQ(config->worker_threads, 3);
  EXPECT_EQ(config->tuning.channels, 5u);

  absl::StatusOr<DaemonConfig> missing = LoadConfigFile(dir + "/nope.yaml");
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(missing.status().message(), HasSubstr("nope.yaml"));
  EXPECT_THAT(missing.status().message(), HasSubstr("No such file"));
  EXPECT_FALSE(LoadConfigFile(dir).ok());

  std::remove(path.c_str());
  rmdir(dir.c_str());
}

// Where the peer service listens: "auto" follows the token (everywhere
// with one, this host only without); an address other hosts can reach
// needs a token or insecure_no_auth; "off" is no port.
TEST(ConfigTest, ListenIsLoopbackUnlessATokenOrInsecureNoAuthSaysOtherwise) {
  auto with = [](const std::string& yaml) {
    auto c = Parse(yaml);
    EXPECT_TRUE(c.ok()) << c.status();
    return PeerListenAddress(*c);
  };
  EXPECT_EQ(*with(""), "127.0.0.1:7361");
  EXPECT_EQ(*with("cluster_token_file: /t\n"), "0.0.0.0:7361");
  EXPECT_EQ(*with("listen: auto\ninsecure_no_auth: true\n"), "127.0.0.1:7361");
  EXPECT_EQ(*with("listen: off\n"), "");
  for (const char* loopback : {"127.0.0.1:0", "127.3.2.1:7361", "[::1]:7361", "localhost:9"}) {
    EXPECT_EQ(*with(std::string("listen: \"") + loopback + "\"\n"), loopback);
  }
  for (const char* open : {"0.0.0.0:0", "10.0.0.1:7361", "[::]:7361", "node-1:7361"}) {
    auto refused = with(std::string("listen: \"") + open + "\"\n");
    ASSERT_FALSE(refused.ok()) << open;
    EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_THAT(std::string(refused.status().message()), HasSubstr("cluster_token_file"));
    EXPECT_THAT(std::string(refused.status().message()), HasSubstr("insecure_no_auth"));
    EXPECT_EQ(*with(std::string("listen: \"") + open + "\"\ninsecure_no_auth: true\n"), open);
    EXPECT_EQ(*with(std::string("listen: \"") + open + "\"\ncluster_token_file: /t\n"), open);
  }
  EXPECT_EQ(ErrorOf("insecure_no_auth: maybe\n"),
            "config.yaml:1: invalid value 'maybe' for 'insecure_no_auth': expected true or false");
}

TEST(ConfigTest, PeersAreAListOrACommaSeparatedStringCheckedEntryByEntry) {
  auto list = Parse("peers:\n  - 10.0.0.0/8\n  - fd00::/64\n  - node-1.cluster\n");
  ASSERT_TRUE(list.ok()) << list.status();
  EXPECT_EQ(list->peers, (std::vector<std::string>{"10.0.0.0/8", "fd00::/64", "node-1.cluster"}));
  auto comma = Parse("peers: \"10.1.2.3, [::1] ,host_a\"\n");
  ASSERT_TRUE(comma.ok()) << comma.status();
  EXPECT_EQ(comma->peers, (std::vector<std::string>{"10.1.2.3", "[::1]", "host_a"}));
  EXPECT_TRUE(Parse("peers: []\n")->peers.empty());
  EXPECT_TRUE(Parse("peers: \"\"\n")->peers.empty());
  EXPECT_EQ(ErrorOf("log_level: info\npeers:\n  - 10.0.0.0/8\n  - 10.0.0.0/33\n"),
            "config.yaml:4: invalid entry in 'peers': '10.0.0.0/33' is not a CIDR range: the "
            "prefix length must be 0..32");
  EXPECT_THAT(ErrorOf("peers: \"10.0.0.1, bad host!\"\n"),
              HasSubstr("config.yaml:1: invalid entry in 'peers': 'bad host!' is neither"));
  EXPECT_THAT(ErrorOf("peers:\n  a: b\n"), HasSubstr("config.yaml:2: 'peers' must be a list"));
  EXPECT_THAT(ErrorOf("peers:\n  - [1]\n"), HasSubstr("each entry of 'peers'"));
}

TEST(ConfigTest, ChannelDevicesAreAListOfDeviceNames) {
  auto list = Parse("channel_devices:\n  - eth1\n  - mlx5_0:1\n");
  ASSERT_TRUE(list.ok()) << list.status();
  EXPECT_EQ(list->channel_devices, (std::vector<std::string>{"eth1", "mlx5_0:1"}));
  auto comma = Parse("channel_devices: \"veth-a, veth-b\"\n");
  ASSERT_TRUE(comma.ok()) << comma.status();
  EXPECT_EQ(comma->channel_devices, (std::vector<std::string>{"veth-a", "veth-b"}));
  EXPECT_TRUE(Parse("channel_devices: []\n")->channel_devices.empty());
  EXPECT_EQ(ErrorOf("channel_devices:\n  - eth1\n  - \"eth 2\"\n"),
            "config.yaml:3: invalid entry 'eth 2' in 'channel_devices': a network device as UCX "
            "names it (e.g. eth1, mlx5_0:1), at most 64 characters");
  std::string many = "channel_devices: \"";
  for (int i = 0; i < 65; ++i) many += "d" + std::to_string(i) + ",";
  EXPECT_THAT(ErrorOf(many + "\"\n"), HasSubstr("'channel_devices' has 65 entries; at most 64"));
  EXPECT_THAT(ErrorOf("channel_devices:\n  a: b\n"),
              HasSubstr("'channel_devices' must be a list (or a comma-separated string) of "
                        "network devices"));
}

TEST(ConfigTest, RackIsANameOrEmpty) {
  EXPECT_EQ(Parse("")->rack, "");
  auto named = Parse("rack: row-3.b_2\n");
  ASSERT_TRUE(named.ok()) << named.status();
  EXPECT_EQ(named->rack, "row-3.b_2");
  EXPECT_EQ(Parse("rack: \"\"\n")->rack, "");
  EXPECT_EQ(ErrorOf("rack: \"rack 1\"\n"),
            "config.yaml:1: invalid value 'rack 1' for 'rack': expected up to 64 characters from "
            "letters, digits, '-', '.', '_'");
  EXPECT_THAT(ErrorOf("rack: " + std::string(65, 'r') + "\n"), HasSubstr("up to 64 characters"));
  EXPECT_THAT(ErrorOf("rack: [a]\n"), HasSubstr("rack"));
}

TEST(ConfigTest, TlsKeysComeAllThreeOrNone) {
  auto all = Parse(
      "tls_cert_file: /etc/ciuic/node.pem\ntls_key_file: /etc/ciuic/node.key\n"
      "tls_ca_file: /etc/ciuic/ca.pem\n");
  ASSERT_TRUE(all.ok()) << all.status();
  EXPECT_EQ(all->tls_cert_file, "/etc/ciuic/node.pem");
  EXPECT_EQ(all->tls_key_file, "/etc/ciuic/node.key");
  EXPECT_EQ(all->tls_ca_file, "/etc/ciuic/ca.pem");
  auto none = Parse("tls_cert_file: \"\"\n");
  ASSERT_TRUE(none.ok()) << none.status();
  EXPECT_EQ(none->tls_cert_file, "");
  EXPECT_EQ(ErrorOf("log_level: info\ntls_key_file: /k\ntls_cert_file: /c\n"),
            "config.yaml:2: TLS between daemons needs tls_cert_file, tls_key_file and tls_ca_file "
            "together (or none of them); missing: tls_ca_file");
  EXPECT_THAT(ErrorOf("tls_ca_file: /ca\ntls_key_file: \"\"\n"),
              HasSubstr("config.yaml:1: TLS between daemons needs"));
}

TEST(PeerListTest, AddressesRangesAndNamesMatch) {
  auto list = PeerList::Parse({"10.1.0.0/16", "192.168.7.7", "fd00:1::/32", "localhost"});
  ASSERT_TRUE(list.ok()) << list.status();
  const auto v4 = [](const char* text) {
    sockaddr_in a{};
    a.sin_family = AF_INET;
    inet_pton(AF_INET, text, &a.sin_addr);
    return a;
  };
  const auto v6 = [](const char* text) {
    sockaddr_in6 a{};
    a.sin6_family = AF_INET6;
    inet_pton(AF_INET6, text, &a.sin6_addr);
    return a;
  };
  const auto allows = [&](const auto& a) {
    return list->Allows(reinterpret_cast<const sockaddr*>(&a));
  };
  EXPECT_TRUE(allows(v4("10.1.255.3")));
  EXPECT_FALSE(allows(v4("10.2.0.1")));
  EXPECT_TRUE(allows(v4("192.168.7.7")));
  EXPECT_FALSE(allows(v4("192.168.7.8")));
  EXPECT_TRUE(allows(v6("fd00:1:ffff::9")));
  EXPECT_FALSE(allows(v6("fd00:2::1")));
  EXPECT_TRUE(allows(v6("::ffff:10.1.0.1")));  // v4-mapped counts as v4
  EXPECT_TRUE(allows(v4("127.0.0.1")));        // localhost, by name
  const sockaddr_in loopback = v4("127.0.0.1");
  EXPECT_FALSE(
      PeerList::Parse({"10.0.0.0/8"})->Allows(reinterpret_cast<const sockaddr*>(&loopback)));
  auto odd = PeerList::Parse({"10.0.0.0/7"});  // a prefix that is not on a byte
  ASSERT_TRUE(odd.ok());
  const sockaddr_in in = v4("11.255.0.1"), out = v4("12.0.0.1");
  EXPECT_TRUE(odd->Allows(reinterpret_cast<const sockaddr*>(&in)));
  EXPECT_FALSE(odd->Allows(reinterpret_cast<const sockaddr*>(&out)));
  EXPECT_FALSE(CheckPeerEntry("fd00::/129").ok());
  EXPECT_FALSE(CheckPeerEntry("10.0.0.0/").ok());
  EXPECT_FALSE(CheckPeerEntry("-bad.host").ok());
  EXPECT_FALSE(CheckPeerEntry("").ok());
  EXPECT_TRUE(CheckPeerEntry("[fe80::1]").ok());
}

}  // namespace
}  // namespace ciuic::config
