#include "daemon/metrics.h"

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <map>
#include <optional>
#include <vector>

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <sys/socket.h>
#include <unistd.h>

#include <fmt/format.h>

#include "fracgpu/gputime_layout.h"
#include "ledger.h"
#include "state/status.h"
#include "common/text_escape.h"

namespace fracgpu::controller {
namespace {

// Accumulates samples grouped by metric, each metric with one HELP and TYPE,
// as the format requires.
class Exposition {
 public:
  void describe(std::string_view name, std::string_view type, std::string_view help) {
    order_.emplace_back(name);
    metrics_[std::string(name)] = fmt::format("# HELP {} {}\n# TYPE {} {}\n", name, help, name, type);
  }
  template <typename T>
  void sample(std::string_view name, std::string_view labels, T value) {
    std::string& out = metrics_.at(std::string(name));
    if (labels.empty())
      out += fmt::format("{} {}\n", name, value);
    else
      out += fmt::format("{}{{{}}} {}\n", name, labels, value);
  }
  std::string text() const {
    std::string out;
    for (const std::string& name : order_) out += metrics_.at(name);
    return out;
  }

 private:
  std::vector<std::string> order_;
  std::map<std::string, std::string> metrics_;
};

double ppm_fraction(uint32_t ppm) { return static_cast<double>(ppm) / 1e6; }
double ns_seconds(uint64_t ns) { return static_cast<double>(ns) / 1e9; }

std::string http_response(std::string_view status, std::string_view type, std::string_view body) {
  return fmt::format("HTTP/1.0 {}\r\nContent-Type: {}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{}", status,
                     type, body.size(), body);
}

// A client's address without its port: what one peer holds is bounded.
std::string peer_address(const struct sockaddr_storage& address) {
  char text[INET6_ADDRSTRLEN] = {};
  if (address.ss_family == AF_INET)
    inet_ntop(AF_INET, &reinterpret_cast<const struct sockaddr_in&>(address).sin_addr, text, sizeof text);
  else if (address.ss_family == AF_INET6)
    inet_ntop(AF_INET6, &reinterpret_cast<const struct sockaddr_in6&>(address).sin6_addr, text, sizeof text);
  return text;
}

}  // namespace

std::optional<HostPort> parse_host_port(std::string_view text, std::string* why) {
  auto fail = [&](std::string reason) -> std::optional<HostPort> {
    *why = std::move(reason);
    return std::nullopt;
  };
  const std::string example = "write host:port, e.g. \"127.0.0.1:9410\", or \"off\"";
  std::string_view host;
  std::string_view port;
  if (text.starts_with('[')) {  // [IPv6]:port
    const size_t close = text.find(']');
    if (close == std::string_view::npos || close + 1 >= text.size() || text[close + 1] != ':')
      return fail(fmt::format("is not an address ({})", example));
    host = text.substr(1, close - 1);
    port = text.substr(close + 2);
  } else {
    const size_t colon = text.rfind(':');
    if (colon == std::string_view::npos) return fail(fmt::format("has no port ({})", example));
    host = text.substr(0, colon);
    port = text.substr(colon + 1);
  }
  if (port.empty() || port.size() > 5 || !std::all_of(port.begin(), port.end(), [](char c) { return c >= '0' && c <= '9'; }))
    return fail(fmt::format("has a bad port \"{}\" (0..65535)", port));
  const unsigned long number = std::stoul(std::string(port));
  if (number > 65535) return fail(fmt::format("has a bad port \"{}\" (0..65535)", port));
  HostPort out;
  out.port = static_cast<uint16_t>(number);
  out.host = host == "localhost" ? "127.0.0.1" : std::string(host);
  unsigned char buf[sizeof(struct in6_addr)];
  if (inet_pton(AF_INET, out.host.c_str(), buf) != 1 && inet_pton(AF_INET6, out.host.c_str(), buf) != 1)
    return fail(fmt::format("has a host \"{}\" that is not a numeric IP address (names are not resolved)", host));
  return out;
}

std::string format_host_port(const HostPort& address) {
  return address.host.find(':') != std::string::npos ? fmt::format("[{}]:{}", address.host, address.port)
                                                     : fmt::format("{}:{}", address.host, address.port);
}

std::string render_metrics(const StatusReport& report) {
  Exposition m;
  m.describe("fracgpu_daemon_up", "gauge", "1 if fracgpud's heartbeat is fresh");
  m.describe("fracgpu_gpu_healthy", "gauge", "1 if fracgpud's last NVML health probe found the GPU healthy");
  m.describe("fracgpu_gpu_unhealthy_reason", "gauge",
             "1 for an unhealthy GPU, labelled with why (lost, xid, ecc, sensors); absent while healthy");
  m.describe("fracgpu_audit_uncharged_processes", "gauge",
             "Processes the bypass audit finds using the GPU without being charged to any tenant");
  m.describe("fracgpu_tenant_ledger_readable", "gauge", "1 if the tenant's ledger could be read (else see fracgpu status)");
  m.describe("fracgpu_tenant_processes", "gauge", "Processes attached to the tenant's ledger and still running");
  m.describe("fracgpu_grant_revoked", "gauge", "1 if the tenant's grant on this GPU is revoked (new charges refused)");
  m.describe("fracgpu_memory_quota_bytes", "gauge", "Memory quota of the tenant on the GPU (absent: unlimited)");
  m.describe("fracgpu_memory_used_bytes", "gauge", "Memory charged to the tenant on the GPU");
  m.describe("fracgpu_gpu_time_share", "gauge", "Guaranteed share of the GPU's time, fraction of one GPU");
  m.describe("fracgpu_gpu_time_limit", "gauge", "Cap on the GPU's time when others leave it idle, fraction of one GPU");
  m.describe("fracgpu_gpu_time_achieved", "gauge", "GPU time used over the window, fraction of the window");
  m.describe("fracgpu_gpu_time_used_seconds_total", "counter",
             "GPU time charged to the tenant (measured use, or the time it held the GPU without a meter)");
  m.describe("fracgpu_gpu_time_measured_seconds_total", "counter",
             "GPU time the tenant's processes used, as the driver measured it (0 without a meter)");
  m.describe("fracgpu_gpu_time_held_seconds_total", "counter", "Time the tenant held a grant of the GPU");
  m.describe("fracgpu_gpu_time_throttled_seconds_total", "counter",
             "Time the tenant wanted the GPU and did not hold it (others held it, or its limit)");
  m.describe("fracgpu_gpu_time_missed_drain_deadlines_total", "counter",
             "Revocations the tenant's processes did not drain within the deadline");
  m.describe("fracgpu_gpu_time_blocked", "gauge",
             "1 while the tenant is not granted the GPU until a process that missed a drain deadline reports it");
  m.describe("fracgpu_gpu_time_yields", "gauge",
             "1 while a process of the tenant runs work outside the gate and the tenant gives way to the others");
  m.describe("fracgpu_gpu_time_takes_turns", "gauge",
             "1 while the tenant takes turns for having taken more than its part of the driver's turns side by side");
  m.describe("fracgpu_gpu_time_gated", "gauge",
             "1 while the tenant's processes ask for grants of the GPU; 0 while it is alone there with no limit below "
             "a whole GPU and they run unshared");
  m.describe("fracgpu_gpu_time_priority", "gauge",
             "1, labelled with the tenant's priority on the GPU (latency, normal, batch; docs/sm-time.md)");
  m.describe("fracgpu_gpu_time_wait_seconds", "gauge",
             fmt::format("Latency tenants: how long the tenant waited for the GPU, from asking to its grant, "
                         "quantile over its last {} waits",
                         gputime::kWaitWindow));
  m.describe("fracgpu_gpu_time_waits_total", "counter", "Latency tenants: waits for the GPU the quantiles are taken from");
  m.describe("fracgpu_processes", "gauge",
             "The tenant's processes on the GPU (charged there, or asking for or using its time)");
  m.sample("fracgpu_daemon_up", "", uint64_t{report.daemon.alive ? 1u : 0u});
  // Only from a real probe: without NVML the daemon cannot tell, and a
  // made-up 1 would hide that (health.h).
  if (report.gpu_health && report.gpu_health->is_object() && report.gpu_health->value("nvml", false) &&
      report.gpu_health->contains("gpus") && (*report.gpu_health)["gpus"].is_array()) {
    for (const auto& g : (*report.gpu_health)["gpus"]) {
      if (!g.is_object() || !g.contains("uuid") || !g["uuid"].is_string() || !g.contains("healthy") ||
          !g["healthy"].is_boolean())
        continue;
      const std::string gpu = fmt::format("gpu=\"{}\"", escape_label_value(g["uuid"].get<std::string>()));
      m.sample("fracgpu_gpu_healthy", gpu, uint64_t{g["healthy"].get<bool>() ? 1u : 0u});
      if (!g["healthy"].get<bool>() && g.contains("reason") && g["reason"].is_string())
        m.sample("fracgpu_gpu_unhealthy_reason",
                 fmt::format("{},reason=\"{}\"", gpu, escape_label_value(g["reason"].get<std::string>())), uint64_t{1});
      uint64_t uncharged = 0;
      const nlohmann::json& audit = *report.gpu_health;
      if (audit.contains("audit") && audit["audit"].is_object() && audit["audit"].contains("findings") &&
          audit["audit"]["findings"].is_array())
        for (const auto& f : audit["audit"]["findings"])
          if (f.is_object() && f.value("gpu_uuid", std::string()) == g["uuid"].get<std::string>()) ++uncharged;
      m.sample("fracgpu_audit_uncharged_processes", gpu, uncharged);
    }
  }
  for (const TenantStatus& t : report.tenants) {
    const std::string tenant = fmt::format("tenant=\"{}\"", escape_label_value(t.name));
    m.sample("fracgpu_tenant_ledger_readable", tenant, uint64_t{t.error.empty() ? 1u : 0u});
    if (!t.error.empty()) continue;
    const auto running = std::count_if(t.processes.begin(), t.processes.end(), [](const ProcessStatus& p) { return p.running; });
    m.sample("fracgpu_tenant_processes", tenant, static_cast<uint64_t>(running));
    for (const GpuEntryStatus& g : t.gpus) {
      const std::string labels = fmt::format("gpu=\"{}\",{}", escape_label_value(g.uuid), tenant);
      m.sample("fracgpu_grant_revoked", labels, uint64_t{g.state == "granted" ? 0u : 1u});
      if (g.memory_quota) m.sample("fracgpu_memory_quota_bytes", labels, *g.memory_quota);
      m.sample("fracgpu_memory_used_bytes", labels, g.memory_used);
      m.sample("fracgpu_gpu_time_share", labels, ppm_fraction(g.share_ppm));
      m.sample("fracgpu_gpu_time_limit", labels, ppm_fraction(g.limit_ppm));
      if (g.gpu_time) {
        m.sample("fracgpu_gpu_time_achieved", labels + ",window=\"1s\"", ppm_fraction(g.gpu_time->achieved_1s_ppm));
        m.sample("fracgpu_gpu_time_achieved", labels + ",window=\"10s\"", ppm_fraction(g.gpu_time->achieved_10s_ppm));
        m.sample("fracgpu_gpu_time_used_seconds_total", labels, ns_seconds(g.gpu_time->used_ns));
        m.sample("fracgpu_gpu_time_measured_seconds_total", labels, ns_seconds(g.gpu_time->measured_ns));
        m.sample("fracgpu_gpu_time_held_seconds_total", labels, ns_seconds(g.gpu_time->held_ns));
        m.sample("fracgpu_gpu_time_throttled_seconds_total", labels, ns_seconds(g.gpu_time->throttled_ns));
        m.sample("fracgpu_gpu_time_missed_drain_deadlines_total", labels, uint64_t{g.gpu_time->missed_deadlines});
        m.sample("fracgpu_gpu_time_blocked", labels, uint64_t{g.gpu_time->blocked ? 1u : 0u});
        m.sample("fracgpu_gpu_time_yields", labels, uint64_t{g.gpu_time->yields ? 1u : 0u});
        m.sample("fracgpu_gpu_time_takes_turns", labels, uint64_t{g.gpu_time->takes_turns ? 1u : 0u});
        m.sample("fracgpu_gpu_time_gated", labels, uint64_t{g.gpu_time->gated ? 1u : 0u});
        // status.cpp has already read an unknown stored value as normal.
        m.sample("fracgpu_gpu_time_priority", fmt::format("{},priority=\"{}\"", labels, g.gpu_time->priority),
                 uint64_t{1});
        if (g.gpu_time->priority == "latency") {
          m.sample("fracgpu_gpu_time_wait_seconds", labels + ",quantile=\"0.5\"", ns_seconds(g.gpu_time->wait_p50_ns));
          m.sample("fracgpu_gpu_time_wait_seconds", labels + ",quantile=\"0.99\"", ns_seconds(g.gpu_time->wait_p99_ns));
          m.sample("fracgpu_gpu_time_wait_seconds", labels + ",quantile=\"0.999\"",
                   ns_seconds(g.gpu_time->wait_p999_ns));
          m.sample("fracgpu_gpu_time_waits_total", labels, g.gpu_time->waits);
        }
      }
      // As `fracgpu status` counts its PROCS column, but running ones only:
      // an exited process awaiting reclaim is not "on" the GPU any more.
      const auto here = [&](const auto& e) { return e.uuid == g.uuid; };
      const auto procs = std::count_if(t.processes.begin(), t.processes.end(), [&](const ProcessStatus& p) {
        return p.running && (std::any_of(p.charges.begin(), p.charges.end(), here) ||
                             std::any_of(p.gpu_time.begin(), p.gpu_time.end(), here));
      });
      m.sample("fracgpu_processes", labels, static_cast<uint64_t>(procs));
    }
  }
  return m.text();
}

MetricsServer::Shared* MetricsServer::shared() {
  if (shared_ == nullptr) {
    void* page = mmap(nullptr, sizeof(Shared), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    if (page == MAP_FAILED) return nullptr;  // /healthz then says so
    shared_ = new (page) Shared();
  }
  return shared_;
}

void MetricsServer::heartbeat(uint64_t now_ns) {
  if (Shared* s = shared()) s->heartbeat_ns.store(now_ns, std::memory_order_release);
}

void MetricsServer::set_liveness_timeout(uint64_t ns) {
  if (Shared* s = shared()) s->liveness_timeout_ns.store(ns, std::memory_order_release);
}

// In the child: the daemon's heartbeat age against the bound.
std::string MetricsServer::healthz() const {
  if (shared_ == nullptr)
    return http_response("503 Service Unavailable", "text/plain", "no heartbeat page (mmap failed at start)\n");
  const uint64_t beat = shared_->heartbeat_ns.load(std::memory_order_acquire);
  const uint64_t bound = shared_->liveness_timeout_ns.load(std::memory_order_acquire);
  const uint64_t now = ledger::monotonic_ns();
  if (beat == 0) return http_response("503 Service Unavailable", "text/plain", "fracgpud: no heartbeat yet\n");
  const uint64_t age_ms = now > beat ? (now - beat) / 1'000'000 : 0;
  if (now > beat && now - beat > bound)
    return http_response("503 Service Unavailable", "text/plain",
                         fmt::format("fracgpud: main loop stalled: last heartbeat {} ms ago (bound {} ms)\n", age_ms,
                                     bound / 1'000'000));
  return http_response("200 OK", "text/plain", fmt::format("ok: last heartbeat {} ms ago\n", age_ms));
}

bool MetricsServer::start(const HostPort& address, std::string run_dir, std::shared_ptr<spdlog::logger> log,
                          std::string* error) {
  stop();
  shared();  // before the fork, so the child shares it
  run_dir_ = std::move(run_dir);
  log_ = std::move(log);
  address_ = format_host_port(address);
  struct sockaddr_storage storage {};
  socklen_t length = 0;
  int family = AF_INET;
  auto* v4 = reinterpret_cast<struct sockaddr_in*>(&storage);
  auto* v6 = reinterpret_cast<struct sockaddr_in6*>(&storage);
  if (inet_pton(AF_INET, address.host.c_str(), &v4->sin_addr) == 1) {
    v4->sin_family = AF_INET;
    v4->sin_port = htons(address.port);
    length = sizeof *v4;
  } else if (inet_pton(AF_INET6, address.host.c_str(), &v6->sin6_addr) == 1) {
    family = AF_INET6;
    v6->sin6_family = AF_INET6;
    v6->sin6_port = htons(address.port);
    length = sizeof *v6;
  } else {
    *error = fmt::format("metrics_address {}: not a numeric IP address", address_);
    return false;
  }
  listen_fd_ = ::socket(family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  const int on = 1;
  if (listen_fd_ < 0 || setsockopt(listen_fd_, SOL_SOCKET, SO_REUSEADDR, &on, sizeof on) != 0 ||
      ::bind(listen_fd_, reinterpret_cast<struct sockaddr*>(&storage), length) != 0 || ::listen(listen_fd_, 64) != 0) {
    *error = fmt::format("metrics: cannot listen on {}: {}", address_, std::strerror(errno));
    if (listen_fd_ >= 0) ::close(listen_fd_);
    listen_fd_ = -1;
    return false;
  }
  struct sockaddr_storage bound {};
  socklen_t bound_length = sizeof bound;
  getsockname(listen_fd_, reinterpret_cast<struct sockaddr*>(&bound), &bound_length);
  port_ = ntohs(family == AF_INET ? reinterpret_cast<struct sockaddr_in*>(&bound)->sin_port
                                  : reinterpret_cast<struct sockaddr_in6*>(&bound)->sin6_port);
  const pid_t parent = getpid();
  const pid_t child = fork();
  if (child < 0) {
    *error = fmt::format("metrics: fork: {}", std::strerror(errno));
    ::close(listen_fd_);
    listen_fd_ = -1;
    return false;
  }
  if (child == 0) {
    // Die with the daemon; take the signals it blocks (for its signalfd) back.
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (getppid() != parent) _exit(0);
    sigset_t all;
    sigfillset(&all);
    sigprocmask(SIG_UNBLOCK, &all, nullptr);
    // Every inherited descriptor but the socket goes: a copy of the run dir's
    // flock (run_dir_lock.h) would keep it held after the daemon dies, and
    // the child needs none of the daemon's files. POSIX record locks (pid
    // file, ledger slots) are the daemon's own, never inherited: closing the
    // child's copies cannot drop them.
    close_range(3, static_cast<unsigned>(listen_fd_) - 1, 0);
    close_range(static_cast<unsigned>(listen_fd_) + 1, ~0u, 0);
    prctl(PR_SET_NAME, "fracgpud-metric");
    serve();
  }
  ::close(listen_fd_);  // the child's copy serves
  listen_fd_ = -1;
  child_ = child;
  return true;
}

void MetricsServer::stop() {
  if (child_ <= 0) return;
  kill(child_, SIGKILL);
  waitpid(child_, nullptr, 0);
  child_ = -1;
  port_ = 0;
}

bool MetricsServer::died(std::string* why) {
  if (child_ <= 0) return false;
  int status = 0;
  if (waitpid(child_, &status, WNOHANG) != child_) return false;
  *why = WIFSIGNALED(status) ? fmt::format("killed by signal {}", WTERMSIG(status))
                             : fmt::format("exited with status {}", WEXITSTATUS(status));
  child_ = -1;
  port_ = 0;
  return true;
}

// Serves every client at once, each bounded: 8 KiB of request head, and 2 s
// from its connection for the whole exchange. One at a time, ten idle
// connections held the endpoint for 20 s, and the kubelet's liveness probe
// (1 s by default) failed behind them: anyone who can reach the port could
// have the daemon restarted. A peer address holds at most kMaxPerPeer
// connections and all peers kMaxClients; past either, the oldest one that
// has not sent its whole request goes.
void MetricsServer::serve() {
  struct Client {
    int fd = -1;
    std::string peer;      // its address (port left out)
    uint64_t deadline_ns = 0;
    std::string request;   // the head so far
    std::string response;  // once the head is whole: what is left to send
    bool answered = false;
  };
  constexpr size_t kMaxClients = 64, kMaxPerPeer = 8;
  constexpr uint64_t kExchangeNs = 2'000'000'000;
  std::vector<Client> clients;
  const auto drop = [&](size_t i) {
    ::close(clients[i].fd);
    clients.erase(clients.begin() + static_cast<std::ptrdiff_t>(i));
  };
  // The oldest client of `*peer` (of any peer if null) still sending its head.
  const auto oldest_unanswered = [&](const std::string* peer) -> std::optional<size_t> {
    std::optional<size_t> found;
    for (size_t i = 0; i < clients.size(); ++i)
      if (!clients[i].answered && (peer == nullptr || clients[i].peer == *peer) &&
          (!found || clients[i].deadline_ns < clients[*found].deadline_ns))
        found = i;
    return found;
  };
  // Reads what the client sent; once the head is whole (or at its bound, or
  // at the end of what it sends), the response. False: drop it.
  const auto read_head = [&](Client& c) {
    char buf[2048];
    for (;;) {
      const ssize_t n = ::recv(c.fd, buf, sizeof buf, MSG_DONTWAIT);
      if (n < 0 && errno == EINTR) continue;
      if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return true;
      if (n > 0) c.request.append(buf, static_cast<size_t>(n));
      if (n <= 0 || c.request.find("\r\n\r\n") != std::string::npos || c.request.find("\n\n") != std::string::npos ||
          c.request.size() >= 8192) {
        if (n < 0 && c.request.empty()) return false;
        try {
          c.response = respond(c.request);
        } catch (const std::exception& e) {
          // A scrape must never take the endpoint down.
          log_->error("metrics: scrape failed: {}", e.what());
          return false;
        }
        c.answered = true;
        return true;
      }
    }
  };
  // Sends what it can. False: done or gone (drop it).
  const auto send_some = [&](Client& c) {
    while (!c.response.empty()) {
      const ssize_t n = ::send(c.fd, c.response.data(), c.response.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
      if (n < 0 && errno == EINTR) continue;
      if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return true;
      if (n <= 0) {
        log_->debug("metrics: client went away: {}", std::strerror(errno));
        return false;
      }
      c.response.erase(0, static_cast<size_t>(n));
    }
    return false;
  };
  std::vector<struct pollfd> polled;
  for (;;) {
    uint64_t now = ledger::monotonic_ns();
    for (size_t i = 0; i < clients.size();)
      if (now >= clients[i].deadline_ns)
        drop(i);
      else
        ++i;
    polled.assign(1, {listen_fd_, POLLIN, 0});
    int timeout_ms = -1;
    for (const Client& c : clients) {
      polled.push_back({c.fd, static_cast<short>(c.answered ? POLLOUT : POLLIN), 0});
      const int left = static_cast<int>((c.deadline_ns - now + 999'999) / 1'000'000);
      timeout_ms = timeout_ms < 0 ? left : std::min(timeout_ms, left);
    }
    if (::poll(polled.data(), polled.size(), timeout_ms) < 0) {
      if (errno == EINTR) continue;
      log_->error("metrics: poll: {}; the endpoint stops", std::strerror(errno));
      _exit(1);
    }
    now = ledger::monotonic_ns();
    // The clients first (their indices are the poll's), then new ones.
    for (size_t i = clients.size(); i-- > 0;) {
      const short events = polled[i + 1].revents;
      if (events == 0) continue;
      Client& c = clients[i];
      const bool keep = c.answered ? send_some(c) : read_head(c) && (!c.answered || send_some(c));
      if (!keep) drop(i);
    }
    if ((polled[0].revents & POLLIN) == 0) continue;
    for (int accepted = 0; accepted < 16; ++accepted) {
      struct sockaddr_storage address {};
      socklen_t length = sizeof address;
      const int fd = ::accept4(listen_fd_, reinterpret_cast<struct sockaddr*>(&address), &length,
                               SOCK_CLOEXEC | SOCK_NONBLOCK);
      if (fd < 0) break;  // none left, or the client gave up
      Client c;
      c.fd = fd;
      c.peer = peer_address(address);
      c.deadline_ns = now + kExchangeNs;
      size_t of_peer = 0;
      for (const Client& other : clients) of_peer += other.peer == c.peer;
      if (of_peer >= kMaxPerPeer) {
        if (const auto old = oldest_unanswered(&c.peer)) drop(*old);
      }
      if (clients.size() >= kMaxClients) {
        if (const auto old = oldest_unanswered(nullptr)) drop(*old);
      }
      if (clients.size() >= kMaxClients) {  // all of them being answered: this one is refused (closed)
        ::close(fd);
        continue;
      }
      // Its request has usually come with it: answered now, if so.
      if (!read_head(c) || (c.answered && !send_some(c))) {
        ::close(fd);
        continue;
      }
      clients.push_back(std::move(c));
    }
  }
}

// The response to one request head (HTTP/1.0 style: one per connection).
std::string MetricsServer::respond(const std::string& request) {
  const std::string line = request.substr(0, request.find_first_of("\r\n"));
  const size_t sp1 = line.find(' ');
  const size_t sp2 = sp1 == std::string::npos ? std::string::npos : line.find(' ', sp1 + 1);
  const std::string method = line.substr(0, sp1);
  std::string path = sp1 == std::string::npos ? "" : line.substr(sp1 + 1, sp2 == std::string::npos ? sp2 : sp2 - sp1 - 1);
  path = path.substr(0, path.find('?'));
  std::string response;
  if (method != "GET" && method != "HEAD") {
    response = http_response("405 Method Not Allowed", "text/plain", "only GET\n");
  } else if (path == "/metrics") {
    std::string error;
    const auto report = collect_status(run_dir_, &error);
    if (report)
      response = http_response("200 OK", "text/plain; version=0.0.4; charset=utf-8", render_metrics(*report));
    else
      response = http_response("503 Service Unavailable", "text/plain", error + "\n");
  } else if (path == "/healthz") {
    response = healthz();
  } else if (path == "/") {
    response = http_response("200 OK", "text/plain", "fracgpud: metrics at /metrics, liveness at /healthz\n");
  } else {
    response = http_response("404 Not Found", "text/plain", "not found; metrics at /metrics, liveness at /healthz\n");
  }
  if (method == "HEAD") response = response.substr(0, response.find("\r\n\r\n") + 4);
  return response;
}

}  // namespace fracgpu::controller
