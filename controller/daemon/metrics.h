// The Prometheus endpoint of fracgpud (`[daemon] metrics_address`): the same
// figures as `fracgpu status` (one collect_status() snapshot per scrape), in
// the Prometheus text format, served over plain HTTP/1.0 by a small server
// in a child process. Metric names are listed in docs/operations.md ("Metrics").
//
// Why a child process, not a thread: a scrape opens and closes every ledger,
// arbiter and the pid file, and closing any descriptor of a file drops every
// POSIX record lock the *process* holds on it. In fracgpud's own process
// that would drop its pid-file lock (`fracgpu status` would think it gone)
// and, while the reaper holds a dead slot's lock, let a new process claim the
// slot under it. A child holds no record locks, so its closes cost nothing.
// It closes every descriptor it inherits but its socket at once: a flock (the
// run dir's, run_dir_lock.h) does follow a descriptor into a child, and would
// outlive the daemon with it. It also keeps a slow client or a slow scrape
// away from the reaping loop. The child dies with the daemon
// (PR_SET_PDEATHSIG) and shares no state with it but one page: the daemon's
// heartbeat, for /healthz (below). Otherwise it reads the run dir read-only,
// exactly as the CLI does.
//
// /healthz: 200 while the daemon's main loop has stored a heartbeat (every
// tick) within the configured bound ([daemon] liveness_timeout), 503 with the
// heartbeat's age otherwise. /metrics is served by the child even while the
// daemon hangs (in an NVML call, say), so a liveness probe must use /healthz.
// The heartbeat lives in a MAP_SHARED anonymous page made before the first
// fork, so every child (a restarted endpoint too) sees the daemon's stores.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <sys/types.h>

#include <spdlog/logger.h>

namespace fracgpu::controller {

struct StatusReport;

struct HostPort {
  std::string host;  // a numeric IPv4 or IPv6 address
  uint16_t port = 0;  // 0: any free port (the bound one is logged)
};

// "127.0.0.1:9410", "0.0.0.0:9410", "[::1]:9410", "localhost:9410" (taken
// as 127.0.0.1). nullopt and *why (a phrase completing `metrics_address "x" ...`)
// for anything else.
std::optional<HostPort> parse_host_port(std::string_view text, std::string* why);

// "127.0.0.1:9410", "[::1]:9410".
std::string format_host_port(const HostPort& address);

// The exposition text (format 0.0.4) for a status snapshot.
std::string render_metrics(const StatusReport& report);

class MetricsServer {
 public:
  MetricsServer() = default;
  ~MetricsServer() { stop(); }
  MetricsServer(const MetricsServer&) = delete;
  MetricsServer& operator=(const MetricsServer&) = delete;

  // Binds, then forks the child that serves <run_dir>'s figures at /metrics.
  // Call from a single-threaded process (fracgpud is). False and *error if
  // the address cannot be bound (nothing is left running).
  bool start(const HostPort& address, std::string run_dir, std::shared_ptr<spdlog::logger> log, std::string* error);
  // Kills and reaps the child; a no-op when not running.
  void stop();
  // Reaps the child if it died (it should not); true and *why if it did.
  bool died(std::string* why);

  // The daemon's loop calls this every tick (CLOCK_MONOTONIC ns); and sets
  // how old a heartbeat may be before /healthz answers 503. Work before start().
  void heartbeat(uint64_t now_ns);
  void set_liveness_timeout(uint64_t ns);

  bool running() const { return child_ > 0; }
  uint16_t port() const { return port_; }  // the bound port (useful with port 0)
  const std::string& address() const { return address_; }  // format_host_port() of the bound address

 private:
  [[noreturn]] void serve();
  std::string respond(const std::string& request);
  std::string healthz() const;

  // Shared with the children (MAP_SHARED | MAP_ANONYMOUS), made on first use.
  struct Shared {
    std::atomic<uint64_t> heartbeat_ns{0};
    std::atomic<uint64_t> liveness_timeout_ns{30'000'000'000ull};
  };
  Shared* shared();
  Shared* shared_ = nullptr;

  std::string run_dir_;
  std::shared_ptr<spdlog::logger> log_;
  std::string address_;
  int listen_fd_ = -1;
  pid_t child_ = -1;
  uint16_t port_ = 0;
};

}  // namespace fracgpu::controller
