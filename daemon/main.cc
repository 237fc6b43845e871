// ciuicd: the per-node ciuic daemon.
//
//   ciuicd [--config FILE] [--socket PATH] [--node-name NAME] [--log-level LEVEL]
//          [--worker-threads N]
//
// Flags override the config file. Trainers open sessions on PATH.session and
// join jobs over gRPC on PATH. SIGTERM or SIGINT drains and exits 0. Under
// systemd (Type=notify) readiness is signalled once both sockets listen.
#include <sched.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>
#include <thread>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "config/config.h"
#include "config/peer_list.h"
#include "config/tuning.h"
#include "cluster/coordinator.h"
#include "cluster/ucx_transports.h"
#include "control/authorization.h"
#include "control/control_service.h"
#include "control/control_socket.h"
#include "control/peer_client.h"
#include "control/metrics.h"
#include "control/peer_service.h"
#include "control/peer_socket.h"
#include "control/tcp_ordering.h"
#include "cuda/gpu_info.h"
#include "engine/engine.h"
#include "grpcpp/grpcpp.h"
#include "reduce/reduce.h"
#include "shm/session_socket.h"
#include "spdlog/sinks/stdout_color_sinks.h"
#include "spdlog/spdlog.h"
#include "transport/ucx_transport.h"

namespace ciuic::daemon {
namespace {

constexpr char kUsage[] =
    "usage: ciuicd [--config FILE] [--socket PATH] [--node-name NAME] [--log-level LEVEL]\n"
    "              [--worker-threads N] [--listen HOST:PORT|auto|off] [--version]\n"
    "Flags override the config file; see deploy/ciuicd.yaml for every key.\n";

// The systemd notify protocol: one datagram to $NOTIFY_SOCKET.
void NotifySystemd(const char* state) {
  const char* path = getenv("NOTIFY_SOCKET");
  if (path == nullptr || path[0] == '\0') return;
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  size_t len = strlen(path);
  if (len >= sizeof(addr.sun_path)) return;
  memcpy(addr.sun_path, path, len);
  if (addr.sun_path[0] == '@') addr.sun_path[0] = '\0';  // abstract namespace
  int fd = socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return;
  sendto(fd, state, strlen(state), MSG_NOSIGNAL, reinterpret_cast<sockaddr*>(&addr),
         static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + len));
  close(fd);
}

int MakeParentDir(const std::string& path) {
  auto slash = path.rfind('/');
  if (slash == std::string::npos || slash == 0) return 0;
  std::string dir = path.substr(0, slash);
  std::string partial;
  for (size_t i = 1; i <= dir.size(); ++i) {
    if (i == dir.size() || dir[i] == '/') {
      partial = dir.substr(0, i);
      if (mkdir(partial.c_str(), 0755) != 0 && errno != EEXIST) return -1;
    }
  }
  return 0;
}

// A byte limit of the config, 0 meaning `share` of physical memory.
uint64_t ResolveMemoryLimit(uint64_t configured, double share) {
  if (configured != 0) return configured;
  const long pages = sysconf(_SC_PHYS_PAGES);
  const long page = sysconf(_SC_PAGESIZE);
  if (pages <= 0 || page <= 0) return UINT64_MAX;
  return static_cast<uint64_t>(static_cast<double>(pages) * static_cast<double>(page) * share);
}

int Main(int argc, char** argv) {
  // Debian's Abseil was built with deadlock detection on: every absl::Mutex
  // lock (gRPC takes many per message) then walks a global lock graph. The
  // daemon's own locks are std::mutex; measured as ~1% of a daemon's CPU in
  // a 2-node allreduce.
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
  std::string config_path, socket_flag, node_flag, log_flag, workers_flag, listen_flag;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    auto value = [&](std::string* out) {
      auto eq = a.find('=');
      if (eq != std::string::npos) {
        *out = a.substr(eq + 1);
        return true;
      }
      if (i + 1 >= argc) return false;
      *out = argv[++i];
      return true;
    };
    auto is = [&](const char* flag) {
      return a == flag || a.rfind(std::string(flag) + "=", 0) == 0;
    };
    bool ok = true;
    if (a == "--help" || a == "-h") {
      fputs(kUsage, stdout);
      return 0;
    } else if (a == "--version") {
      printf("ciuicd %s\n", CIUIC_VERSION);
      return 0;
    } else if (is("--config")) {
      ok = value(&config_path);
    } else if (is("--socket")) {
      ok = value(&socket_flag);
    } else if (is("--node-name")) {
      ok = value(&node_flag);
    } else if (is("--log-level")) {
      ok = value(&log_flag);
    } else if (is("--worker-threads")) {
      ok = value(&workers_flag);
    } else if (is("--listen")) {
      ok = value(&listen_flag);
    } else {
      fprintf(stderr, "ciuicd: unknown argument '%s'\n%s", a.c_str(), kUsage);
      return 64;
    }
    if (!ok) {
      fprintf(stderr, "ciuicd: %s needs a value\n%s", a.c_str(), kUsage);
      return 64;
    }
  }

  absl::StatusOr<config::DaemonConfig> loaded =
      config_path.empty() ? config::ParseConfigYaml("", "defaults") : config::LoadConfigFile(config_path);
  if (!loaded.ok()) {
    fprintf(stderr, "ciuicd: %s\n", std::string(loaded.status().message()).c_str());
    return 78;  // EX_CONFIG
  }
  config::DaemonConfig cfg = *loaded;
  // Flags override the file; validate them with the file's rules.
  std::string overrides;
  if (!socket_flag.empty()) absl::StrAppend(&overrides, "socket: \"", socket_flag, "\"\n");
  if (!node_flag.empty()) absl::StrAppend(&overrides, "node_name: \"", node_flag, "\"\n");
  if (!log_flag.empty()) absl::StrAppend(&overrides, "log_level: \"", log_flag, "\"\n");
  if (!workers_flag.empty()) absl::StrAppend(&overrides, "worker_threads: ", workers_flag, "\n");
  if (!listen_flag.empty()) absl::StrAppend(&overrides, "listen: \"", listen_flag, "\"\n");
  if (!overrides.empty()) {
    auto flags = config::ParseConfigYaml(overrides, "command line");
    if (!flags.ok()) {
      fprintf(stderr, "ciuicd: %s\n", std::string(flags.status().message()).c_str());
      return 64;
    }
    if (!socket_flag.empty()) cfg.socket_path = flags->socket_path;
    if (!node_flag.empty()) cfg.node_name = flags->node_name;
    if (!log_flag.empty()) cfg.log_level = flags->log_level;
    if (!workers_flag.empty()) cfg.worker_threads = flags->worker_threads;
    if (!listen_flag.empty()) cfg.listen = flags->listen;
  }
  // CIUIC_RACK (set by a node's provisioning, e.g. from the scheduler's
  // topology) overrides the file's `rack`, checked by the same rule.
  if (const char* rack = getenv("CIUIC_RACK"); rack != nullptr) {
    if (!config::ValidRackName(rack)) {
      fprintf(stderr,
              "ciuicd: invalid CIUIC_RACK '%s': expected up to 64 characters from letters, "
              "digits, '-', '.', '_'\n",
              absl::CEscape(rack).c_str());
      return 78;
    }
    cfg.rack = rack;
  }
  std::string cluster_token;
  if (!cfg.cluster_token_file.empty()) {
    std::ifstream in(cfg.cluster_token_file);
    if (!in) {
      fprintf(stderr, "ciuicd: cluster_token_file '%s' cannot be read: %s\n",
              cfg.cluster_token_file.c_str(), strerror(errno));
      return 78;
    }
    std::getline(in, cluster_token);
    while (!cluster_token.empty() && isspace(static_cast<unsigned char>(cluster_token.back()))) {
      cluster_token.pop_back();
    }
    if (cluster_token.empty()) {
      fprintf(stderr, "ciuicd: cluster_token_file '%s' is empty\n", cfg.cluster_token_file.c_str());
      return 78;
    }
  }

  // Before anything starts: a daemon open to the network without a token
  // stops here (exit 78, like every other config mistake).
  absl::StatusOr<std::string> listen = config::PeerListenAddress(cfg);
  if (!listen.ok()) {
    fprintf(stderr, "ciuicd: %s\n", std::string(listen.status().message()).c_str());
    return 78;
  }
  absl::StatusOr<config::PeerList> peers = config::PeerList::Parse(cfg.peers);
  if (!peers.ok()) {
    fprintf(stderr, "ciuicd: peers: %s\n", std::string(peers.status().message()).c_str());
    return 78;
  }
  PeerSecurity security{cluster_token, *peers, nullptr};
  if (!cfg.tls_cert_file.empty()) {
    // Read and checked now: a key that cannot be used stops the daemon
    // here (exit 78) rather than failing each connection later.
    auto tls = TlsContext::Load(cfg.tls_cert_file, cfg.tls_key_file, cfg.tls_ca_file);
    if (!tls.ok()) {
      fprintf(stderr, "ciuicd: %s\n", std::string(tls.status().message()).c_str());
      return 78;
    }
    security.tls = *tls;
  }

  auto logger = spdlog::stderr_color_mt("ciuicd");
  spdlog::set_default_logger(logger);
  spdlog::set_level(spdlog::level::from_str(cfg.log_level));
  spdlog::set_pattern("[%Y-%m-%d %H:%M:%S.%e] [%l] %v");

  // Signals are taken synchronously by the main thread below; every thread
  // started from here on inherits the mask.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGINT);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);
  signal(SIGPIPE, SIG_IGN);

  if (MakeParentDir(cfg.socket_path) != 0) {
    spdlog::critical("cannot create the directory of {}: {}", cfg.socket_path,
                     strerror(errno));
    return 1;
  }
  if (absl::Status dir = CheckRuntimeDirectory(cfg.socket_path); !dir.ok()) {
    spdlog::critical("{}", std::string(dir.message()));
    return 78;  // EX_CONFIG: the socket's place is the operator's to fix
  }
  auto authorization = Authorization::Make(geteuid(), cfg.admin_group);
  if (!authorization.ok()) {
    spdlog::critical("{}", std::string(authorization.status().message()));
    return 78;
  }
  // worker_threads 0: one per CPU this process may run on (systemd's
  // CPUAffinity=, taskset), not per CPU of the host.
  int workers = cfg.worker_threads;
  if (workers <= 0) {
    cpu_set_t allowed;
    CPU_ZERO(&allowed);
    workers = sched_getaffinity(0, sizeof(allowed), &allowed) == 0
                  ? CPU_COUNT(&allowed)
                  : static_cast<int>(std::thread::hardware_concurrency());
    workers = std::max(1, workers);
  }

  config::TuningRegistry tuning(cfg.tuning);
  // Before the engine, whose jobs may order through it in-process.
  // Fusion and cycle time for its jobs; no job of more ranks than this daemon takes.
  Coordinator coordinator(&tuning, static_cast<int>(cfg.max_world_size));
  Engine::Options options;
  options.session_socket_path = cfg.socket_path + ".session";
  options.worker_threads = workers;
  options.max_arena_bytes = cfg.max_arena_bytes;
  options.tuning = &tuning;
  options.node_name = cfg.node_name;
  options.rack = cfg.rack;
  options.transports = UcxTransportFactory(cfg.channel_devices);
  options.channels = static_cast<int>(cfg.channel_devices.size());
  options.coordinator_clients = GrpcCoordinatorClients(security);
  if (listen->empty()) {
    options.check_coordinator = [](const std::string&) {
      return absl::FailedPreconditionError(
          "this ciuicd runs with `listen: off` (single-node jobs only): a job that spans "
          "several nodes needs the peer service (set `listen`)");
    };
  } else if (!security.allowed.empty()) {
    options.check_coordinator = [allowed = security.allowed](const std::string& coordinator) {
      return CheckPeerAllowed(HostOfAddress(coordinator), allowed);
    };
  }
  options.local_coordinator = &coordinator;
  options.max_world_size = cfg.max_world_size;
  options.max_sessions = cfg.max_sessions;
  options.max_sessions_per_uid = cfg.max_sessions_per_uid;
  options.max_jobs_per_uid = cfg.max_jobs_per_uid;
  options.max_arena_bytes_per_uid = ResolveMemoryLimit(cfg.max_arena_bytes_per_uid, 0.5);
  options.max_arena_bytes_total = ResolveMemoryLimit(cfg.max_arena_bytes_total, 0.75);
  auto engine = Engine::Start(options);
  if (!engine.ok()) {
    spdlog::critical("{}", std::string(engine.status().message()));
    return 1;
  }
  ControlService service(engine->get(), &tuning, *authorization, cfg.node_name,
                         cfg.socket_path);
  auto server = StartControlServer(&service);
  if (!server.ok()) {
    spdlog::critical("{}", std::string(server.status().message()));
    (*engine)->Shutdown();
    return 1;
  }
  auto control_socket = ControlSocket::Start(cfg.socket_path, server->get());
  if (!control_socket.ok()) {
    spdlog::critical("{}", std::string(control_socket.status().message()));
    (*server)->Shutdown();
    (*engine)->Shutdown();
    return 1;
  }
  service.set_callers(control_socket->get());
  PeerService peer_service(&coordinator);
  std::unique_ptr<PeerServer> peer_server;
  std::unique_ptr<OrderingListener> ordering_listener;  // before the coordinator goes
  if (listen->empty()) {
    spdlog::info("listen: off: no peer service, single-node jobs only");
  } else {
    if (cluster_token.empty() && !config::IsLoopbackHost(HostOfAddress(*listen))) {
      spdlog::warn(
          "insecure_no_auth: the peer service on {} takes any daemon that reaches it, "
          "without a cluster token",
          *listen);
    }
    auto started = PeerServer::Start(*listen, cluster_token, &peer_service, security.tls);
    if (!started.ok()) {
      spdlog::critical("{}", std::string(started.status().message()));
      (*server)->Shutdown();
      (*engine)->Shutdown();
      return 1;
    }
    peer_server = std::move(*started);
    const std::string host = listen->substr(0, listen->rfind(':'));
    auto listener = OrderingListener::Start(host, cfg.ordering_port, &coordinator, cluster_token,
                                            security.tls);
    if (!listener.ok()) {
      spdlog::critical("{}", std::string(listener.status().message()));
      peer_server->Shutdown();
      (*server)->Shutdown();
      (*engine)->Shutdown();
      return 1;
    }
    ordering_listener = std::move(*listener);
    coordinator.set_ordering_port(ordering_listener->port());
    service.set_peer_address(absl::StrCat(host, ":", peer_server->port()));
    service.set_ordering_port(ordering_listener->port());
    spdlog::info("peer service on {}:{}, ordering streams on port {}{}{}{}", host,
                 peer_server->port(), ordering_listener->port(),
                 cluster_token.empty() ? " (no cluster token)" : " (cluster token required)",
                 security.tls ? absl::StrCat("; TLS with certificates of ", cfg.tls_ca_file)
                              : std::string("; no TLS"),
                 security.allowed.empty()
                     ? ""
                     : absl::StrCat("; coordinators allowed: ", security.allowed.ToString()));
  }
  std::unique_ptr<MetricsEndpoint> metrics;
  if (!cfg.metrics_listen.empty()) {
    auto started = MetricsEndpoint::Start(cfg.metrics_listen, engine->get(), cfg.node_name);
    if (!started.ok()) {
      spdlog::critical("{}", std::string(started.status().message()));
      if (peer_server) peer_server->Shutdown();
      if (ordering_listener) ordering_listener->Shutdown();
      (*server)->Shutdown();
      (*engine)->Shutdown();
      return 1;
    }
    metrics = std::move(*started);
    service.set_metrics_address(metrics->address());
    spdlog::info("Prometheus metrics on http://{}/metrics", metrics->address());
  }
  {
    std::string runs;
    for (std::string_view isa : reduce::SupportedIsas()) {
      absl::StrAppend(&runs, runs.empty() ? "" : ", ", std::string(isa));
    }
    spdlog::info("reduction kernels: {} (this CPU runs: {})", reduce::ActiveIsa(), runs);
  }
  if (std::string note = reduce::IsaNote(); !note.empty()) spdlog::warn("{}", note);
  // Probed once here, so that `ciuicctl status` answers from the cache.
  spdlog::info("GPUs: {} (built {} CUDA; UCX moves CUDA memory: {})",
               DescribeGpus(ProbeGpus()), ProbeGpus().built_with_cuda ? "with" : "without",
               UcxTransport::SupportsCudaMemory() ? "yes" : "no");
  spdlog::info("ciuicd {} ready on {} (node {}, {} worker threads)", CIUIC_VERSION,
               cfg.socket_path, cfg.node_name, workers);
  spdlog::info("limits: {} ranks a job, {} sessions ({} a uid), {} jobs a uid, arenas {} bytes "
               "({} a uid); tune set by root, uid {}{}",
               options.max_world_size, options.max_sessions, options.max_sessions_per_uid,
               options.max_jobs_per_uid, options.max_arena_bytes_total,
               options.max_arena_bytes_per_uid, geteuid(),
               cfg.admin_group.empty() ? "" : " and group " + cfg.admin_group);
  NotifySystemd("READY=1");

  int sig = 0;
  sigwait(&signals, &sig);
  spdlog::info("{} received: draining", strsignal(sig));
  NotifySystemd("STOPPING=1");
  metrics.reset();  // no scrape reads the engine after this
  (*control_socket)->Shutdown();  // no new control connections
  coordinator.Shutdown();
  (*engine)->Shutdown();
  if (peer_server) peer_server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
  if (ordering_listener) ordering_listener->Shutdown();
  (*server)->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
  unlink(cfg.socket_path.c_str());
  spdlog::info("ciuicd stopped");
  return 0;
}

}  // namespace
}  // namespace ciuic::daemon

int main(int argc, char** argv) { return ciuic::daemon::Main(argc, argv); }
