// The Prometheus endpoint of fracgpud (`[daemon] metrics_address`): the same
// figures as `fracgpu status` (one collect_status() snapshot per scrape), in
// the Prometheus text format, served over plain HTTP/1.0 by a small server
// on its own thread. Metric names are listed in docs/operations.md ("Metrics").
//
// Why a thread: a scrape reads every ledger and arbiter (milliseconds) and a
// client may be slow; neither may delay the daemon's reaping loop. The thread
// shares no state with the loop: it reads the run dir read-only, exactly as
// the CLI does.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <thread>

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

  // Binds and starts serving <run_dir>'s figures at /metrics. False and
  // *error if the address cannot be bound (nothing is left running).
  bool start(const HostPort& address, std::string run_dir, std::shared_ptr<spdlog::logger> log, std::string* error);
  // Stops the thread and closes the socket; a no-op when not running.
  void stop();

  bool running() const { return thread_.joinable(); }
  uint16_t port() const { return port_; }  // the bound port (useful with port 0)
  const std::string& address() const { return address_; }  // format_host_port() of the bound address

 private:
  void serve();
  void handle(int client);

  std::string run_dir_;
  std::shared_ptr<spdlog::logger> log_;
  std::string address_;
  int listen_fd_ = -1;
  int stop_fd_ = -1;  // an eventfd: written once to stop the thread
  uint16_t port_ = 0;
  std::thread thread_;
};

}  // namespace fracgpu::controller
