// fracgpud's operator-facing parts end to end, on the simulated driver: the
// Prometheus endpoint scraped over loopback and checked against the ledger,
// and placement that keeps running tenants on their GPUs across a restart
// and a reload, explained by `fracgpu status`.
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <map>
#include <regex>
#include <sstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <spdlog/sinks/ostream_sink.h>
#include <spdlog/spdlog.h>

#include "controller_test_util.h"
#include "ledger.h"
#include "daemon/log_limit.h"
#include "daemon/metrics.h"
#include "config/placement.h"
#include "state/status.h"
#include "common/uuid.h"

using namespace fracgpu;
using namespace fracgpu::testing;
using namespace std::chrono_literals;

namespace {

constexpr uint64_t kMiB = 1ull << 20;
const std::string kUuid0 = "GPU-0be7a000-0000-4000-8000-000000000001";
const std::string kUuid1 = "GPU-0be7a000-0000-4000-8000-000000000002";
const std::string kDevices =
    "uuid=" + kUuid0 + ",name=Sim A,mem=16GiB,ctx=64MiB;uuid=" + kUuid1 + ",name=Sim B,mem=16GiB,ctx=64MiB";

class OpsTest : public ::testing::Test {
 protected:
  void TearDown() override {
    for (pid_t pid : children_) kill_and_reap(pid);
    kill_and_reap(daemon_);
  }

  std::string daemon_section(const std::string& extra) const {
    return "[daemon]\nrun_dir = \"" + run_dir_ + "\"\nreap_interval_ms = 50\nlog_level = \"debug\"\n" + extra +
           "[[gpu]]\nindex = 0\ncontext_memory = \"64MiB\"\n[[gpu]]\nindex = 1\ncontext_memory = \"64MiB\"\n";
  }

  // Runs `args` with the simulated driver and `env` added; output to `log`.
  pid_t spawn(const std::vector<std::string>& args, const std::string& log, const std::vector<std::string>& env = {}) {
    // A private simulated state unless `env` shares one.
    std::vector<std::string> all = {std::string("LD_LIBRARY_PATH=") + SIMCUDA_DIR, "SIMCUDA_DEVICES=" + kDevices,
                                    "SIMCUDA_STATE"};
    all.insert(all.end(), env.begin(), env.end());
    return spawn_logged(args, log, all);
  }

  // Starts fracgpud; waits until the pid-file lock is held and `ready` is logged.
  void start_daemon(const std::string& ready = "started: config") {
    const size_t before = read_file(log_path_).size();
    daemon_ = spawn({FRACGPUD_PATH, "--config", config_path_}, log_path_);
    ASSERT_TRUE(eventually([&] { return read_file(log_path_).find(ready, before) != std::string::npos; }))
        << read_file(log_path_);
    std::string error;
    ASSERT_TRUE(eventually([&] {
      const auto report = controller::collect_status(run_dir_, &error);
      // A heartbeat in a ledger, not only the pid-file lock: the policies are written.
      return report && report->daemon.alive && report->daemon.heartbeat_age_ms.has_value();
    }));
  }

  void stop_daemon() {
    kill(daemon_, SIGTERM);
    EXPECT_EQ(wait_exit(daemon_, 10s), 0) << read_file(log_path_);
    daemon_ = -1;
  }

  // A second fracgpud on the same run dir must be refused: the running one
  // still holds its pid-file lock (scrapes and reloads must not drop it).
  void expect_pid_lock_held() {
    const std::string log = tmp_ / "second.log";
    std::filesystem::remove(log);
    const pid_t second = spawn({FRACGPUD_PATH, "--config", config_path_}, log);
    const int rc = wait_exit(second, 10s);
    if (rc == -1) kill_and_reap(second);  // it started: never leave it running
    EXPECT_EQ(rc, 3) << read_file(log);
    EXPECT_NE(read_file(log).find("another fracgpud (pid " + std::to_string(daemon_) + ")"), std::string::npos)
        << read_file(log);
  }

  // The ledger's granted share (ppm) of `tenant` per GPU UUID.
  std::map<std::string, uint32_t> shares(const std::string& tenant) {
    std::map<std::string, uint32_t> out;
    ledger::TenantLedger l;
    char err[256];
    if (ledger::open_ledger((run_dir_ + "/tenants/" + tenant).c_str(), ledger::AccessMode::kReadOnly, nullptr, &l, err,
                            sizeof err) != ledger::LedgerError::kOk)
      return out;
    ledger::GpuTable table;
    ledger::read_gpu_table(l, &table);
    for (const ledger::GpuEntry& g : table.gpus)
      if (g.state == ledger::kGpuGranted) out[controller::format_gpu_uuid(g.uuid)] = g.share_ppm;
    ledger::close_ledger(&l);
    return out;
  }

  std::string run_cli(const std::vector<std::string>& args) {
    const std::string log = tmp_ / "cli.out";
    std::filesystem::remove(log);
    std::vector<std::string> argv{FRACGPU_CLI_PATH};
    argv.insert(argv.end(), args.begin(), args.end());
    EXPECT_EQ(wait_exit(spawn(argv, log), 10s), 0) << read_file(log);
    return read_file(log);
  }

  TempDir tmp_;
  std::string run_dir_ = tmp_ / "run";
  std::string config_path_ = tmp_ / "fracgpud.toml";
  std::string log_path_ = tmp_ / "fracgpud.log";
  std::vector<pid_t> children_;
  pid_t daemon_ = -1;
};

// Parses the text format strictly: every line a HELP, a TYPE or a sample,
// every sample's metric described first. Returns series -> value.
std::map<std::string, double> parse_exposition(const std::string& body) {
  static const std::regex help(R"(# HELP ([a-zA-Z_:][a-zA-Z0-9_:]*) .+)");
  static const std::regex type(R"(# TYPE ([a-zA-Z_:][a-zA-Z0-9_:]*) (gauge|counter))");
  static const std::regex sample(R"(([a-zA-Z_:][a-zA-Z0-9_:]*)(\{([a-z_]+="[^"\\]*",?)*\})? ([-+0-9.eE]+|NaN))");
  std::map<std::string, double> out;
  std::map<std::string, int> described;
  size_t start = 0;
  while (start < body.size()) {
    const size_t end = body.find('\n', start);
    EXPECT_NE(end, std::string::npos) << "the last line must end with a newline";
    const std::string line = body.substr(start, end - start);
    start = end == std::string::npos ? body.size() : end + 1;
    std::smatch m;
    if (std::regex_match(line, m, help)) {
      described[m[1]] |= 1;
    } else if (std::regex_match(line, m, type)) {
      described[m[1]] |= 2;
    } else if (std::regex_match(line, m, sample)) {
      EXPECT_EQ(described[m[1]], 3) << "no HELP and TYPE before: " << line;
      const size_t space = line.rfind(' ');
      EXPECT_TRUE(out.emplace(line.substr(0, space), std::stod(line.substr(space + 1))).second) << "duplicate " << line;
    } else {
      ADD_FAILURE() << "not in the text format: \"" << line << "\"";
    }
  }
  return out;
}

TEST_F(OpsTest, MetricsScrapeMatchesTheLedger) {
  write_file(config_path_, daemon_section("metrics_address = \"127.0.0.1:0\"\n") +
                               "[[tenant]]\nname = \"alice\"\ngpus = 0.5\nlimit = 0.75\n"
                               "[[tenant]]\nname = \"bob\"\nmemory = { \"1\" = \"2GiB\" }\n");
  start_daemon("metrics: serving http://127.0.0.1:");
  const uint16_t port = logged_metrics_port(read_file(log_path_));
  ASSERT_GT(port, 0);

  // A real tenant process: the probe allocates through the interposer.
  const std::string probe_log = tmp_ / "probe.log";
  const std::string tenant_env = "FRACGPU_TENANT_DIR=" + run_dir_ + "/tenants/alice";
  const std::string preload = std::string("LD_PRELOAD=") + FRACGPU_LIB;
  const std::string state = "SIMCUDA_STATE=" + (tmp_ / "sim-state");
  const pid_t probe = spawn({PROBE_PATH, "init", "primary", "0", "alloc", "100MiB", "hold"}, probe_log,
                            {tenant_env, preload, state});
  children_.push_back(probe);
  ASSERT_TRUE(eventually([&] { return read_file(probe_log).find("holding=") != std::string::npos; }))
      << read_file(probe_log);
  EXPECT_NE(read_file(probe_log).find("alloc=0"), std::string::npos) << read_file(probe_log);

  const std::string response = http_get(port, "/metrics");
  ASSERT_EQ(response.rfind("HTTP/1.0 200 OK\r\n", 0), 0u) << response;
  EXPECT_NE(response.find("Content-Type: text/plain; version=0.0.4"), std::string::npos);
  const std::string body = response.substr(response.find("\r\n\r\n") + 4);
  const std::map<std::string, double> series = parse_exposition(body);
  // A series' value; a missing one fails the test, showing the whole scrape.
  const auto value = [&](const std::string& name) {
    const auto it = series.find(name);
    if (it != series.end()) return it->second;
    ADD_FAILURE() << "no series " << name << " in:\n" << body;
    return -1.0;
  };

  // The same figures, read from the ledgers directly (what `fracgpu status` reads).
  std::string error;
  const auto report = controller::collect_status(run_dir_, &error);
  ASSERT_TRUE(report) << error;
  const controller::TenantStatus* alice = nullptr;
  for (const auto& t : report->tenants)
    if (t.name == "alice") alice = &t;
  ASSERT_NE(alice, nullptr);
  ASSERT_EQ(alice->gpus.size(), 1u);
  const controller::GpuEntryStatus& g = alice->gpus[0];
  EXPECT_EQ(g.uuid, kUuid0);
  EXPECT_EQ(g.memory_used, 164 * kMiB);  // the context (64 MiB) and the allocation
  const std::string a = "{gpu=\"" + kUuid0 + "\",tenant=\"alice\"}";
  EXPECT_EQ(value("fracgpu_memory_used_bytes" + a), static_cast<double>(g.memory_used)) << body;
  EXPECT_EQ(value("fracgpu_memory_quota_bytes" + a), static_cast<double>(*g.memory_quota));
  EXPECT_EQ(value("fracgpu_memory_quota_bytes" + a), 8.0 * (1ull << 30));
  EXPECT_EQ(value("fracgpu_gpu_time_share" + a), 0.5);
  EXPECT_EQ(value("fracgpu_gpu_time_limit" + a), 0.75);
  EXPECT_EQ(value("fracgpu_processes" + a), 1.0);
  EXPECT_EQ(value("fracgpu_grant_revoked" + a), 0.0);
  EXPECT_EQ(value("fracgpu_tenant_processes{tenant=\"alice\"}"), 1.0);
  EXPECT_EQ(value("fracgpu_tenant_ledger_readable{tenant=\"alice\"}"), 1.0);
  EXPECT_EQ(value("fracgpu_daemon_up"), 1.0);
  ASSERT_TRUE(g.gpu_time.has_value());
  // The probe only allocates (no launches): its GPU time figures are 0 and
  // stay so, so the scrape must equal the snapshot exactly.
  const controller::GpuTimeStatus& t = *g.gpu_time;
  EXPECT_EQ(t.used_ns, 0u);
  EXPECT_EQ(t.throttled_ns, 0u);
  const std::string a1 = "{gpu=\"" + kUuid0 + "\",tenant=\"alice\",window=\"1s\"}";
  const std::string a10 = "{gpu=\"" + kUuid0 + "\",tenant=\"alice\",window=\"10s\"}";
  EXPECT_EQ(value("fracgpu_gpu_time_achieved" + a1), t.achieved_1s_ppm / 1e6);
  EXPECT_EQ(value("fracgpu_gpu_time_achieved" + a10), t.achieved_10s_ppm / 1e6);
  EXPECT_EQ(value("fracgpu_gpu_time_throttled_seconds_total" + a), t.throttled_ns / 1e9);
  EXPECT_EQ(value("fracgpu_gpu_time_used_seconds_total" + a), t.used_ns / 1e9);
  EXPECT_EQ(value("fracgpu_gpu_time_missed_drain_deadlines_total" + a), 0.0);
  EXPECT_EQ(value("fracgpu_gpu_time_blocked" + a), 0.0);
  EXPECT_EQ(value("fracgpu_gpu_time_yields" + a), 0.0);
  EXPECT_EQ(value("fracgpu_gpu_time_takes_turns" + a), 0.0);
  EXPECT_EQ(value("fracgpu_gpu_time_gated" + a), 1.0) << "a limit below a whole GPU";
  EXPECT_EQ(value("fracgpu_gpu_time_priority{gpu=\"" + kUuid0 + "\",tenant=\"alice\",priority=\"normal\"}"), 1.0);
  // bob: a memory quota on GPU 1, no share, nothing used.
  const std::string b = "{gpu=\"" + kUuid1 + "\",tenant=\"bob\"}";
  EXPECT_EQ(value("fracgpu_memory_quota_bytes" + b), 2.0 * (1ull << 30));
  EXPECT_EQ(value("fracgpu_memory_used_bytes" + b), 0.0);
  EXPECT_EQ(value("fracgpu_gpu_time_share" + b), 0.0);
  EXPECT_EQ(value("fracgpu_processes" + b), 0.0);

  // The process exits: its charge and its count leave the metrics.
  kill_and_reap(probe);
  children_.clear();
  ASSERT_TRUE(eventually([&] {
    const auto body2 = http_get(port, "/metrics");
    return body2.find("fracgpu_memory_used_bytes" + a + " 0\n") != std::string::npos &&
           body2.find("fracgpu_processes" + a + " 0\n") != std::string::npos;
  })) << http_get(port, "/metrics");

  EXPECT_EQ(http_get(port, "/nothing").rfind("HTTP/1.0 404", 0), 0u);
  expect_pid_lock_held();

  // Reload with metrics off: the endpoint goes away, the daemon stays.
  write_file(config_path_, daemon_section("metrics_address = \"off\"\n") +
                               "[[tenant]]\nname = \"alice\"\ngpus = 0.5\n");
  kill(daemon_, SIGHUP);
  ASSERT_TRUE(eventually([&] { return read_file(log_path_).find("metrics: endpoint") != std::string::npos; }))
      << read_file(log_path_);
  EXPECT_EQ(http_get(port, "/metrics"), "");
  EXPECT_EQ(waitpid(daemon_, nullptr, WNOHANG), 0);
  expect_pid_lock_held();
}

// fracgpud writes each live tenant process's host PID into its ledger slot
// (what NVML's per-process records are keyed by, docs/architecture.md), and
// clears it when the process is gone.
TEST_F(OpsTest, TheDaemonRecordsEachTenantProcessesHostPid) {
  write_file(config_path_, daemon_section("metrics_address = \"off\"\n") +
                               "[[tenant]]\nname = \"alice\"\ngpus = 0.5\n");
  start_daemon();
  const std::string probe_log = tmp_ / "probe.log";
  const pid_t probe = spawn({PROBE_PATH, "init", "primary", "0", "alloc", "10MiB", "hold"}, probe_log,
                            {"FRACGPU_TENANT_DIR=" + run_dir_ + "/tenants/alice",
                             std::string("LD_PRELOAD=") + FRACGPU_LIB, "SIMCUDA_STATE=" + (tmp_ / "sim-state")});
  children_.push_back(probe);
  ASSERT_TRUE(eventually([&] { return read_file(probe_log).find("holding=") != std::string::npos; }))
      << read_file(probe_log);
  ledger::TenantLedger l;
  char err[256] = {};
  ASSERT_EQ(ledger::open_ledger((run_dir_ + "/tenants/alice").c_str(), ledger::AccessMode::kReadOnly, nullptr, &l,
                                err, sizeof err),
            ledger::LedgerError::kOk)
      << err;
  // The probe's slot: the one whose owner says it is the probe.
  const auto host_pid_of_probe = [&]() -> int32_t {
    for (uint32_t s = 0; s < l.usage->slot_high_water.load(); ++s)
      if (l.usage->slots[s].state.load() == ledger::kSlotLive && l.usage->slots[s].pid.load() == probe)
        return l.usage->slots[s].host_pid.load();
    return -1;
  };
  EXPECT_TRUE(eventually([&] { return host_pid_of_probe() == probe; })) << "host_pid " << host_pid_of_probe();
  kill_and_reap(probe);
  children_.clear();
  // The dead process's slot is reclaimed (state free) and its host PID gone.
  EXPECT_TRUE(eventually([&] {
    for (uint32_t s = 0; s < l.usage->slot_high_water.load(); ++s)
      if (l.usage->slots[s].host_pid.load() == probe) return false;
    return true;
  }));
  ledger::close_ledger(&l);
}

// /healthz answers from the daemon's heartbeat, not from the endpoint's own
// process: a daemon stopped in its main loop (as one hung in NVML would be)
// fails it within liveness_timeout, while /metrics still answers.
TEST_F(OpsTest, HealthzFailsWhileTheMainLoopIsStalled) {
  write_file(config_path_, daemon_section("metrics_address = \"127.0.0.1:0\"\nliveness_timeout = \"1s\"\n") +
                               "[[tenant]]\nname = \"alice\"\ngpus = 0.5\n");
  start_daemon("metrics: serving http://127.0.0.1:");
  const uint16_t port = logged_metrics_port(read_file(log_path_));
  ASSERT_GT(port, 0);
  ASSERT_TRUE(eventually([&] { return http_get(port, "/healthz").rfind("HTTP/1.0 200 OK", 0) == 0; }))
      << http_get(port, "/healthz");
  EXPECT_NE(http_get(port, "/healthz").find("ok: last heartbeat"), std::string::npos);
  ASSERT_EQ(kill(daemon_, SIGSTOP), 0);
  const std::string stalled = "HTTP/1.0 503 Service Unavailable";
  EXPECT_TRUE(eventually([&] { return http_get(port, "/healthz").rfind(stalled, 0) == 0; }, 3000ms))
      << http_get(port, "/healthz");
  EXPECT_NE(http_get(port, "/healthz").find("main loop stalled: last heartbeat"), std::string::npos)
      << http_get(port, "/healthz");
  EXPECT_EQ(http_get(port, "/metrics").rfind("HTTP/1.0 200 OK", 0), 0u);  // why a probe on /metrics is not enough
  ASSERT_EQ(kill(daemon_, SIGCONT), 0);
  EXPECT_TRUE(eventually([&] { return http_get(port, "/healthz").rfind("HTTP/1.0 200 OK", 0) == 0; }, 3000ms))
      << http_get(port, "/healthz");
}

// Idle connections, from the prober's own address and another, hold the
// endpoint no longer than it takes to answer the next client: the kubelet's
// probe (1 s by default) is answered beside them. Served one at a time, 60
// of them held each request for up to 2 s apiece, and the probe failed.
TEST_F(OpsTest, IdleConnectionsDoNotStarveTheLivenessProbe) {
  write_file(config_path_, daemon_section("metrics_address = \"127.0.0.1:0\"\n") + "[[tenant]]\nname = \"alice\"\ngpus = 0.5\n");
  start_daemon("metrics: serving http://127.0.0.1:");
  const uint16_t port = logged_metrics_port(read_file(log_path_));
  ASSERT_GT(port, 0);
  ASSERT_TRUE(eventually([&] { return http_get(port, "/healthz").rfind("HTTP/1.0 200 OK", 0) == 0; }));
  std::vector<int> idle;
  for (const char* from : {"127.0.0.2", "127.0.0.1"})
    for (int i = 0; i < 30; ++i) {
      const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
      struct sockaddr_in local {}, server {};
      local.sin_family = server.sin_family = AF_INET;
      inet_pton(AF_INET, from, &local.sin_addr);
      inet_pton(AF_INET, "127.0.0.1", &server.sin_addr);
      server.sin_port = htons(port);
      ASSERT_EQ(bind(fd, reinterpret_cast<struct sockaddr*>(&local), sizeof local), 0) << strerror(errno);
      ASSERT_EQ(connect(fd, reinterpret_cast<struct sockaddr*>(&server), sizeof server), 0) << strerror(errno);
      idle.push_back(fd);  // sends nothing
    }
  std::chrono::milliseconds longest{0};
  for (int i = 0; i < 3; ++i) {
    const auto asked = std::chrono::steady_clock::now();
    const std::string reply = http_get(port, "/healthz");
    longest = std::max(longest, std::chrono::duration_cast<std::chrono::milliseconds>(
                                    std::chrono::steady_clock::now() - asked));
    EXPECT_EQ(reply.rfind("HTTP/1.0 200 OK", 0), 0u) << reply;
  }
  std::cout << "/healthz beside 60 idle connections: answered within " << longest.count() << " ms\n";
  EXPECT_LT(longest, 1000ms);
  for (const int fd : idle) close(fd);
}

TEST_F(OpsTest, ATakenMetricsPortDoesNotStopTheDaemon) {
  const int blocker = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  struct sockaddr_in addr {};
  addr.sin_family = AF_INET;
  inet_pton(AF_INET, "127.0.0.1", &addr.sin_addr);
  ASSERT_EQ(bind(blocker, reinterpret_cast<struct sockaddr*>(&addr), sizeof addr), 0);
  ASSERT_EQ(listen(blocker, 1), 0);
  socklen_t len = sizeof addr;
  getsockname(blocker, reinterpret_cast<struct sockaddr*>(&addr), &len);
  const int port = ntohs(addr.sin_port);
  write_file(config_path_, daemon_section("metrics_address = \"127.0.0.1:" + std::to_string(port) + "\"\n") +
                               "[[tenant]]\nname = \"alice\"\ngpus = 0.5\n");
  start_daemon("running without metrics");
  EXPECT_EQ(shares("alice").at(kUuid0), 500'000u);
  close(blocker);
}

// Config 1 puts a = 0.5 on GPU 0 and b = 0.75 on GPU 1. Config 2 lists them
// the other way round, where a fresh bundle placement would swap them.
const std::string kTenantsAB = "[[tenant]]\nname = \"a\"\ngpus = 0.5\n[[tenant]]\nname = \"b\"\ngpus = 0.75\n";
const std::string kTenantsBA = "[[tenant]]\nname = \"b\"\ngpus = 0.75\n[[tenant]]\nname = \"a\"\ngpus = 0.5\n";

TEST_F(OpsTest, ARestartKeepsARunningTenantOnItsGpu) {
  write_file(config_path_, daemon_section("metrics_address = \"off\"\n") + kTenantsAB);
  start_daemon();
  ASSERT_EQ(shares("b"), (std::map<std::string, uint32_t>{{kUuid1, 750'000u}}));
  ASSERT_EQ(shares("a"), (std::map<std::string, uint32_t>{{kUuid0, 500'000u}}));
  const pid_t worker = spawn_tenant_process(run_dir_ + "/tenants/b", 0, 10 * kMiB);
  ASSERT_GT(worker, 0);
  children_.push_back(worker);
  stop_daemon();

  write_file(config_path_, daemon_section("metrics_address = \"off\"\n") + kTenantsBA);
  start_daemon();
  EXPECT_EQ(shares("b"), (std::map<std::string, uint32_t>{{kUuid1, 750'000u}})) << read_file(log_path_);
  EXPECT_EQ(shares("a"), (std::map<std::string, uint32_t>{{kUuid0, 500'000u}}));
  const std::string status = run_cli({"status", "--run-dir", run_dir_});
  EXPECT_NE(status.find("placement (policy bundle):"), std::string::npos) << status;
  EXPECT_TRUE(std::regex_search(status, std::regex("  b +kept from before")) ) << status;
  EXPECT_TRUE(std::regex_search(status, std::regex("  a +kept from before \\(unchanged"))) << status;
  const std::string json = run_cli({"status", "--json", "--run-dir", run_dir_});
  EXPECT_NE(json.find("\"placement\": {\n    \"policy\": \"bundle\""), std::string::npos) << json;

  // Once b has no running process, a restart still keeps both where they
  // are: their pods are pinned to those GPUs, and nothing in their config
  // changed (placement.json records the grants). A fresh bundle placement
  // would swap them.
  const auto record = controller::read_placement_record(run_dir_);
  ASSERT_TRUE(record);
  EXPECT_EQ(record->grants.at("a"), (std::vector<std::pair<std::string, uint32_t>>{{kUuid0, 500'000u}}));
  kill_and_reap(worker);
  children_.clear();
  stop_daemon();
  start_daemon();
  EXPECT_EQ(shares("b"), (std::map<std::string, uint32_t>{{kUuid1, 750'000u}})) << read_file(log_path_);
  EXPECT_EQ(shares("a"), (std::map<std::string, uint32_t>{{kUuid0, 500'000u}}));
  EXPECT_EQ(controller::read_placement_record(run_dir_)->why.at("b"), "unchanged");
  const std::string again = run_cli({"status", "--run-dir", run_dir_});
  EXPECT_TRUE(std::regex_search(again, std::regex("  b +kept from before \\(unchanged"))) << again;

  // A changed `gpus` places afresh.
  write_file(config_path_, daemon_section("metrics_address = \"off\"\n") +
                               "[[tenant]]\nname = \"b\"\ngpus = 0.25\n[[tenant]]\nname = \"a\"\ngpus = 0.5\n");
  stop_daemon();
  start_daemon();
  EXPECT_EQ(controller::read_placement_record(run_dir_)->why.at("b"), "policy");
  EXPECT_EQ(controller::read_placement_record(run_dir_)->why.at("a"), "unchanged");
}

// A running tenant whose `gpus` changes stays on its GPU when that has room,
// and the daemon warns when it cannot.
TEST_F(OpsTest, AResizedRunningTenantStaysOnItsGpuOrIsWarnedAbout) {
  write_file(config_path_, daemon_section("metrics_address = \"off\"\n") + kTenantsAB);
  start_daemon();
  ASSERT_EQ(shares("a"), (std::map<std::string, uint32_t>{{kUuid0, 500'000u}}));
  for (const char* tenant : {"a", "b"}) {
    const pid_t worker = spawn_tenant_process(run_dir_ + "/tenants/" + tenant, 0, 10 * kMiB);
    ASSERT_GT(worker, 0);
    children_.push_back(worker);
  }
  // a: 0.5 -> 0.2. Bundle alone would put it on GPU 1 (0.25 free, the fullest).
  write_file(config_path_, daemon_section("metrics_address = \"off\"\n") +
                               "[[tenant]]\nname = \"a\"\ngpus = 0.2\n[[tenant]]\nname = \"b\"\ngpus = 0.75\n");
  kill(daemon_, SIGHUP);
  ASSERT_TRUE(eventually([&] { return shares("a") == std::map<std::string, uint32_t>{{kUuid0, 200'000u}}; })) << read_file(log_path_);
  EXPECT_EQ(shares("a"), (std::map<std::string, uint32_t>{{kUuid0, 200'000u}})) << read_file(log_path_);
  EXPECT_EQ(read_file(log_path_).find("has running processes on"), std::string::npos);
  // a: 0.5 pinned elsewhere by a new tenant taking all of GPU 0: it must move, with a warning.
  write_file(config_path_, daemon_section("metrics_address = \"off\"\n") +
                               "[[tenant]]\nname = \"c\"\ngpus = 1\ndevices = [0]\n"
                               "[[tenant]]\nname = \"a\"\ngpus = 0.25\n[[tenant]]\nname = \"b\"\ngpus = 0.75\n");
  kill(daemon_, SIGHUP);
  ASSERT_TRUE(eventually([&] { return shares("c").size() == 1; })) << read_file(log_path_);
  EXPECT_EQ(shares("a"), (std::map<std::string, uint32_t>{{kUuid1, 250'000u}}));
  EXPECT_NE(read_file(log_path_).find("warning: placement: tenant \"a\" has running processes on " + kUuid0 +
                                      " but is now placed on " + kUuid1),
            std::string::npos)
      << read_file(log_path_);
}

TEST_F(OpsTest, AReloadKeepsARunningTenantOnItsGpu) {
  write_file(config_path_, daemon_section("metrics_address = \"off\"\n") + kTenantsAB);
  start_daemon();
  const pid_t worker = spawn_tenant_process(run_dir_ + "/tenants/b", 0, 10 * kMiB);
  ASSERT_GT(worker, 0);
  children_.push_back(worker);
  write_file(config_path_, daemon_section("metrics_address = \"off\"\nplacement = \"spread\"\n") + kTenantsBA +
                               "[[tenant]]\nname = \"c\"\ngpus = 0.25\n");
  kill(daemon_, SIGHUP);
  ASSERT_TRUE(eventually([&] { return shares("c").size() == 1; })) << read_file(log_path_);
  EXPECT_EQ(shares("b"), (std::map<std::string, uint32_t>{{kUuid1, 750'000u}}));
  // a has no process but is unchanged: it stays on GPU 0; c then goes to
  // the least loaded GPU, also 0 (0.5 free against 0.25).
  EXPECT_EQ(shares("a"), (std::map<std::string, uint32_t>{{kUuid0, 500'000u}}));
  EXPECT_EQ(shares("c"), (std::map<std::string, uint32_t>{{kUuid0, 250'000u}}));
  const auto record = controller::read_placement_record(run_dir_);
  ASSERT_TRUE(record);
  EXPECT_EQ(record->policy, "spread");
  EXPECT_EQ(record->why.at("b"), "kept");
  EXPECT_EQ(record->why.at("a"), "unchanged");  // idle, but its `gpus` did not change
  expect_pid_lock_held();  // the reload read the running placement without dropping it
}

}  // namespace

namespace {

// An unhealthy GPU's reason and the audit's findings per GPU.
TEST(RenderMetrics, UnhealthyReasonAndUnchargedProcesses) {
  controller::StatusReport report;
  report.gpu_health = nlohmann::json::parse(R"({"nvml": true, "gpus": [
      {"uuid": "GPU-0be7a000-0000-4000-8000-000000000001", "healthy": true, "reason": "healthy"},
      {"uuid": "GPU-0be7a000-0000-4000-8000-000000000002", "healthy": false, "reason": "ecc"}],
      "audit": {"findings": [{"gpu_uuid": "GPU-0be7a000-0000-4000-8000-000000000002", "pid": 7},
                             {"gpu_uuid": "GPU-0be7a000-0000-4000-8000-000000000002", "pid": 8}]}})");
  const auto series = parse_exposition(controller::render_metrics(report));
  EXPECT_EQ(series.at("fracgpu_gpu_unhealthy_reason{gpu=\"" + kUuid1 + "\",reason=\"ecc\"}"), 1.0);
  EXPECT_FALSE(series.contains("fracgpu_gpu_unhealthy_reason{gpu=\"" + kUuid0 + "\",reason=\"healthy\"}"));
  EXPECT_EQ(series.at("fracgpu_audit_uncharged_processes{gpu=\"" + kUuid0 + "\"}"), 0.0);
  EXPECT_EQ(series.at("fracgpu_audit_uncharged_processes{gpu=\"" + kUuid1 + "\"}"), 2.0);
}

// GPU health comes from the daemon's NVML probe (health.json) only.
TEST(RenderMetrics, GpuHealthOnlyFromARealProbe) {
  controller::StatusReport report;
  EXPECT_EQ(controller::render_metrics(report).find("fracgpu_gpu_healthy{"), std::string::npos);
  report.gpu_health = nlohmann::json::parse(R"({"nvml": true, "gpus": [
      {"uuid": "GPU-0be7a000-0000-4000-8000-000000000001", "healthy": true},
      {"uuid": "GPU-0be7a000-0000-4000-8000-000000000002", "healthy": false}]})");
  const std::string text = controller::render_metrics(report);
  EXPECT_NE(text.find("fracgpu_gpu_healthy{gpu=\"" + kUuid0 + "\"} 1\n"), std::string::npos) << text;
  EXPECT_NE(text.find("fracgpu_gpu_healthy{gpu=\"" + kUuid1 + "\"} 0\n"), std::string::npos) << text;
  (*report.gpu_health)["nvml"] = false;  // no NVML: the daemon cannot tell
  EXPECT_EQ(controller::render_metrics(report).find("fracgpu_gpu_healthy{"), std::string::npos);
  report.gpu_health = nlohmann::json::parse(R"({"nvml": true, "gpus": [{"uuid": 7}, "x"]})");  // malformed: skipped
  EXPECT_EQ(controller::render_metrics(report).find("fracgpu_gpu_healthy{"), std::string::npos);
}

// Each tenant's priority on each GPU, and a latency tenant's waits for the
// GPU, as `fracgpu status` reads them from the arbiter.
TEST(RenderMetrics, PriorityAndLatencyWaits) {
  controller::StatusReport report;
  for (const char* priority : {"latency", "batch"}) {
    controller::TenantStatus t;
    t.name = std::string(priority) + "-tenant";
    controller::GpuEntryStatus g;
    g.uuid = kUuid0;
    g.state = "granted";
    controller::GpuTimeStatus time;
    time.priority = priority;
    if (time.priority == "latency") {
      time.wait_p50_ns = 250'000;
      time.wait_p99_ns = 4'000'000;
      time.wait_p999_ns = 12'000'000;
      time.waits = 3000;
    }
    g.gpu_time = time;
    t.gpus.push_back(g);
    report.tenants.push_back(t);
  }
  const std::string text = controller::render_metrics(report);
  const auto series = parse_exposition(text);
  const std::string l = "gpu=\"" + kUuid0 + "\",tenant=\"latency-tenant\"";
  const std::string b = "gpu=\"" + kUuid0 + "\",tenant=\"batch-tenant\"";
  EXPECT_EQ(series.at("fracgpu_gpu_time_priority{" + l + ",priority=\"latency\"}"), 1.0) << text;
  EXPECT_EQ(series.at("fracgpu_gpu_time_priority{" + b + ",priority=\"batch\"}"), 1.0) << text;
  EXPECT_EQ(series.at("fracgpu_gpu_time_wait_seconds{" + l + ",quantile=\"0.5\"}"), 0.00025) << text;
  EXPECT_EQ(series.at("fracgpu_gpu_time_wait_seconds{" + l + ",quantile=\"0.99\"}"), 0.004) << text;
  EXPECT_EQ(series.at("fracgpu_gpu_time_wait_seconds{" + l + ",quantile=\"0.999\"}"), 0.012) << text;
  EXPECT_EQ(series.at("fracgpu_gpu_time_waits_total{" + l + "}"), 3000.0) << text;
  // Only latency tenants' waits are measured.
  EXPECT_EQ(text.find("fracgpu_gpu_time_wait_seconds{" + b), std::string::npos) << text;
  EXPECT_EQ(text.find("fracgpu_gpu_time_waits_total{" + b), std::string::npos) << text;
  EXPECT_NE(text.find("# TYPE fracgpu_gpu_time_wait_seconds gauge\n"), std::string::npos) << text;
  EXPECT_NE(text.find("# TYPE fracgpu_gpu_time_waits_total counter\n"), std::string::npos) << text;
}

// Label values are escaped as the text format defines (backslash, quote,
// line feed); what it cannot carry (other controls, bytes that are not
// UTF-8) becomes U+FFFD, so a scrape always parses and a terminal showing it
// gets no escape sequence.
TEST(RenderMetrics, LabelValuesAreEscapedPerTheTextFormat) {
  controller::StatusReport report;
  controller::TenantStatus t;
  t.name = std::string("a\"b\\c\nd\x1b[2J\xff\xc3\xa9");
  t.error = "unreadable";
  report.tenants.push_back(t);
  const std::string text = controller::render_metrics(report);
  EXPECT_NE(text.find("fracgpu_tenant_ledger_readable{tenant=\"a\\\"b\\\\c\\nd\xef\xbf\xbd[2J\xef\xbf\xbd\xc3\xa9\"} 0\n"),
            std::string::npos)
      << text;
  EXPECT_EQ(text.find('\x1b'), std::string::npos);
}

// The daemon's log is bounded whatever a tenant provokes: a burst, then a
// steady rate; what is dropped is counted and said once lines pass again.
// Debug lines (asked for) are not limited.
TEST(DaemonLog, IsRateLimitedAndSaysWhatItDropped) {
  uint64_t now = 0;
  std::ostringstream captured;
  auto out = std::make_shared<spdlog::sinks::ostream_sink_st>(captured);
  auto limited = std::make_shared<controller::RateLimitedSink>(out, 100, 10, [&] { return now; });
  spdlog::logger log("t", limited);
  log.set_level(spdlog::level::trace);
  log.set_pattern("%l: %v");
  for (int i = 0; i < 1000; ++i) log.warn("flood {}", i);
  for (int i = 0; i < 50; ++i) log.debug("asked for {}", i);
  EXPECT_EQ(limited->dropped_total(), 900u);
  now += 1'000'000'000;  // one second: 10 more lines
  for (int i = 0; i < 20; ++i) log.error("later {}", i);
  const std::string text = captured.str();
  size_t lines = 0;
  for (char c : text) lines += c == '\n';
  EXPECT_EQ(lines, 100u + 50u + 1u + 10u) << text.substr(0, 400);
  EXPECT_NE(text.find("warning: log rate limit: 900 line(s) dropped"), std::string::npos);
  EXPECT_NE(text.find("debug: asked for 49"), std::string::npos);
  EXPECT_EQ(text.find("flood 100\n"), std::string::npos);
  EXPECT_EQ(limited->dropped_total(), 910u);
}

}  // namespace
