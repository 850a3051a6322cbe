// `fracgpu status` against prepared ledgers: the collected report, its text
// and JSON renderings, and the binary's exit codes.
#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <ctime>
#include <sstream>
#include <string>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <spdlog/logger.h>

#include "config.h"
#include "controller_test_util.h"
#include "daemon.h"
#include "ledger.h"
#include "status.h"

using namespace fracgpu;
using namespace fracgpu::controller;
using namespace fracgpu::testing;

namespace {

constexpr uint64_t kGiB = 1ull << 30;
const std::string kUuid = "GPU-5a1c0de0-0000-4000-8000-000000000001";

uint64_t monotonic_ns() {
  struct timespec ts {};
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<uint64_t>(ts.tv_sec) * 1'000'000'000ull + static_cast<uint64_t>(ts.tv_nsec);
}

// Runs the CLI; returns its exit code and its stdout + stderr in *output.
int run_cli(const std::string& args, std::string* output, const std::string& env = "") {
  FILE* p = popen((env + " " + FRACGPU_CLI_PATH + " " + args + " 2>&1").c_str(), "r");
  std::string out;
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof buf, p)) > 0) out.append(buf, n);
  const int status = pclose(p);
  *output = out;
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

// Ledgers as fracgpud would leave them: alice holds half of a 16 GiB GPU,
// bob 2 GiB of it; a "trainer" process of alice's has charged 1 GiB.
class CliTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const std::vector<DiscoveredGpu> node{{0, kUuid, "Sim", 16 * kGiB}};
    const ConfigResult r = parse_config("[[gpu]]\nindex = 0\n"
                                        "[[tenant]]\nname = \"alice\"\ngpus = 0.5\n"
                                        "[[tenant]]\nname = \"bob\"\nmemory = { \"0\" = \"2GiB\" }\n",
                                        "test.toml", node);
    ASSERT_TRUE(r.ok());
    spdlog::logger quiet("test");  // no sinks
    for (const Tenant& t : r.config->tenants) {
      ledger::TenantLedger l;
      char err[256];
      ASSERT_TRUE(fs_mkdirs(run_dir_ + "/tenants"));
      ASSERT_EQ(ledger::open_ledger(tenant_dir(t.name).c_str(), ledger::AccessMode::kDaemon, t.name.c_str(), &l, err,
                                    sizeof err),
                ledger::LedgerError::kOk)
          << err;
      std::string error;
      ASSERT_TRUE(write_policy(*l.policy, &t, *r.config, quiet, &error)) << error;
      l.policy->daemon_heartbeat_ns.store(monotonic_ns());
      l.policy->daemon_pid.store(getpid());
      ledger::close_ledger(&l);
    }
    worker_ = spawn_tenant_process(tenant_dir("alice"), 0, 1 * kGiB, "trainer");
    ASSERT_GT(worker_, 0);
  }

  void TearDown() override { kill_and_reap(worker_); }

  static bool fs_mkdirs(const std::string& dir) {
    std::error_code ec;
    std::filesystem::create_directories(dir, ec);
    return !ec;
  }

  std::string tenant_dir(const std::string& name) const { return run_dir_ + "/tenants/" + name; }

  StatusReport collect() {
    std::string error;
    auto report = collect_status(run_dir_, &error);
    EXPECT_TRUE(report.has_value()) << error;
    return report.value_or(StatusReport{});
  }

  void set_heartbeat(const std::string& tenant, uint64_t ns) {
    ledger::TenantLedger l;
    char err[256];
    ASSERT_EQ(ledger::open_ledger(tenant_dir(tenant).c_str(), ledger::AccessMode::kDaemon, tenant.c_str(), &l, err,
                                  sizeof err),
              ledger::LedgerError::kOk);
    l.policy->daemon_heartbeat_ns.store(ns);
    ledger::close_ledger(&l);
  }

  TempDir tmp_;
  std::string run_dir_ = tmp_ / "run";
  pid_t worker_ = -1;
};

TEST_F(CliTest, CollectsQuotasUsageAndProcesses) {
  const StatusReport report = collect();
  EXPECT_TRUE(report.all_ledgers_read());
  EXPECT_TRUE(report.daemon.alive);
  EXPECT_EQ(report.daemon.pid, getpid());
  ASSERT_TRUE(report.daemon.heartbeat_age_ms);
  EXPECT_LT(*report.daemon.heartbeat_age_ms, kHeartbeatFreshMs);
  ASSERT_EQ(report.tenants.size(), 2u);

  const TenantStatus& alice = report.tenants[0];
  EXPECT_EQ(alice.name, "alice");
  EXPECT_EQ(alice.error, "");
  ASSERT_EQ(alice.gpus.size(), 1u);
  EXPECT_EQ(alice.gpus[0].uuid, kUuid);
  EXPECT_EQ(alice.gpus[0].state, "granted");
  EXPECT_EQ(alice.gpus[0].memory_quota, 8 * kGiB);
  EXPECT_EQ(alice.gpus[0].memory_used, 1 * kGiB);
  EXPECT_EQ(alice.gpus[0].share_ppm, 500'000u);
  EXPECT_TRUE(alice.gpus[0].count_managed);
  ASSERT_EQ(alice.processes.size(), 1u);
  const ProcessStatus& p = alice.processes[0];
  EXPECT_EQ(p.host_pid, worker_);
  EXPECT_EQ(p.pid, worker_);  // same PID namespace here
  EXPECT_EQ(p.comm, "trainer");
  EXPECT_TRUE(p.running);
  ASSERT_EQ(p.charges.size(), 1u);
  EXPECT_EQ(p.charges[0].uuid, kUuid);
  EXPECT_EQ(p.charges[0].bytes, 1 * kGiB);

  const TenantStatus& bob = report.tenants[1];
  EXPECT_EQ(bob.gpus[0].memory_quota, 2 * kGiB);
  EXPECT_EQ(bob.gpus[0].share_ppm, 0u);
  EXPECT_TRUE(bob.processes.empty());
}

TEST_F(CliTest, TextIsAnAlignedTablePerGpuAndTenant) {
  const std::string text = status_to_text(collect());
  std::istringstream in(text);
  std::string line, header, alice, bob, procs_header, proc;
  while (std::getline(in, line)) {
    if (line.rfind("GPU ", 0) == 0) header = line;
    if (line.rfind(kUuid, 0) == 0) alice = line;
    if (line.find(" bob ") != std::string::npos) bob = line;
    if (line.rfind("TENANT ", 0) == 0) procs_header = line;
    if (line.rfind("alice ", 0) == 0) proc = line;
  }
  EXPECT_NE(text.find("daemon:  alive (pid " + std::to_string(getpid())), std::string::npos) << text;
  ASSERT_FALSE(header.empty()) << text;
  EXPECT_EQ(header.find("TENANT"), alice.find("alice")) << text;  // columns line up
  EXPECT_EQ(header.find("QUOTA"), alice.find("8 GiB")) << text;
  EXPECT_EQ(header.find("USED"), alice.find("1 GiB")) << text;
  EXPECT_NE(alice.find("granted"), std::string::npos);
  EXPECT_NE(alice.find(" 0.5 "), std::string::npos);
  // bob shares alice's GPU: its row leaves the GPU column blank.
  EXPECT_EQ(bob.find("bob"), header.find("TENANT")) << text;
  EXPECT_EQ(bob.find_first_not_of(' '), header.find("TENANT"));
  EXPECT_NE(bob.find("2 GiB"), std::string::npos);
  ASSERT_FALSE(proc.empty()) << text;
  EXPECT_EQ(procs_header.find("HOST PID"), proc.find(std::to_string(worker_))) << text;
  EXPECT_NE(proc.find("trainer"), std::string::npos);
  EXPECT_NE(proc.find("running"), std::string::npos);
}

TEST_F(CliTest, JsonFollowsTheDocumentedSchema) {
  const nlohmann::json j = nlohmann::json::parse(status_to_json(collect()).dump());
  EXPECT_EQ(j.at("schema_version"), 1);
  EXPECT_EQ(j.at("run_dir"), run_dir_);
  EXPECT_EQ(j.at("daemon").at("alive"), true);
  EXPECT_EQ(j.at("daemon").at("pid"), getpid());
  EXPECT_TRUE(j.at("daemon").at("heartbeat_age_ms").is_number_unsigned());
  ASSERT_EQ(j.at("tenants").size(), 2u);
  const nlohmann::json& alice = j.at("tenants").at(0);
  EXPECT_EQ(alice.at("name"), "alice");
  EXPECT_EQ(alice.at("dir"), tenant_dir("alice"));
  EXPECT_TRUE(alice.at("error").is_null());
  EXPECT_GE(alice.at("policy_generation"), 1);
  const nlohmann::json& gpu = alice.at("gpus").at(0);
  EXPECT_EQ(gpu.at("entry"), 0);
  EXPECT_EQ(gpu.at("uuid"), kUuid);
  EXPECT_EQ(gpu.at("state"), "granted");
  EXPECT_EQ(gpu.at("memory_quota"), 8 * kGiB);
  EXPECT_EQ(gpu.at("memory_used"), 1 * kGiB);
  EXPECT_EQ(gpu.at("context_memory"), kDefaultContextMemory);
  EXPECT_EQ(gpu.at("share_ppm"), 500'000);
  EXPECT_EQ(gpu.at("limit_ppm"), 500'000);
  EXPECT_EQ(gpu.at("count_managed_memory"), true);
  const nlohmann::json& proc = alice.at("processes").at(0);
  EXPECT_EQ(proc.at("slot"), 0);
  EXPECT_EQ(proc.at("host_pid"), worker_);
  EXPECT_EQ(proc.at("pid"), worker_);
  EXPECT_EQ(proc.at("comm"), "trainer");
  EXPECT_EQ(proc.at("running"), true);
  EXPECT_EQ(proc.at("charges").at(0).at("uuid"), kUuid);
  EXPECT_EQ(proc.at("charges").at(0).at("bytes"), 1 * kGiB);
  EXPECT_EQ(proc.at("total_bytes"), 1 * kGiB);
  // The documented key order.
  EXPECT_EQ(status_to_json(collect()).begin().key(), "schema_version");
}

TEST_F(CliTest, BinaryPrintsTextAndJson) {
  std::string out;
  EXPECT_EQ(run_cli("status --run-dir " + run_dir_, &out), kStatusOk) << out;
  EXPECT_NE(out.find(kUuid), std::string::npos) << out;
  EXPECT_EQ(run_cli("status --json --run-dir " + run_dir_, &out), kStatusOk) << out;
  const nlohmann::json j = nlohmann::json::parse(out);
  EXPECT_EQ(j.at("tenants").at(0).at("processes").at(0).at("host_pid"), worker_);
  // The run dir from the environment.
  EXPECT_EQ(run_cli("status --json", &out, "FRACGPU_RUN_DIR=" + run_dir_), kStatusOk) << out;
  EXPECT_EQ(nlohmann::json::parse(out).at("run_dir"), run_dir_);
}

TEST_F(CliTest, CorruptLedgerIsReportedNotFatal) {
  write_file(tenant_dir("carol") + "/policy", std::string(sizeof(ledger::PolicySegment), '\x5a'));
  write_file(tenant_dir("dave") + "/policy", "short");
  const StatusReport report = collect();
  ASSERT_EQ(report.tenants.size(), 4u);
  EXPECT_FALSE(report.all_ledgers_read());
  EXPECT_NE(report.tenants[2].error.find("foreign segment"), std::string::npos) << report.tenants[2].error;
  EXPECT_NE(report.tenants[2].error.find(tenant_dir("carol") + "/policy"), std::string::npos);
  EXPECT_NE(report.tenants[3].error.find("wrong size"), std::string::npos) << report.tenants[3].error;
  EXPECT_EQ(report.tenants[0].gpus[0].memory_used, 1 * kGiB);  // the others are still read
  const std::string text = status_to_text(report);
  EXPECT_NE(text.find("unreadable ledgers:\n  carol: foreign segment"), std::string::npos) << text;

  std::string out;
  EXPECT_EQ(run_cli("status --json --run-dir " + run_dir_, &out), kStatusBadLedger);
  const nlohmann::json j = nlohmann::json::parse(out);
  EXPECT_TRUE(j.at("tenants").at(2).at("error").is_string());
  EXPECT_TRUE(j.at("tenants").at(2).at("gpus").empty());
}

TEST_F(CliTest, TenantWithoutGpusIsListed) {
  ledger::TenantLedger l;
  char err[256];
  ASSERT_EQ(ledger::open_ledger(tenant_dir("idle").c_str(), ledger::AccessMode::kDaemon, "idle", &l, err, sizeof err),
            ledger::LedgerError::kOk);
  ledger::close_ledger(&l);
  const std::string text = status_to_text(collect());
  EXPECT_NE(text.find("\n-  "), std::string::npos) << text;
  EXPECT_NE(text.find("idle"), std::string::npos) << text;
  EXPECT_NE(text.find("no GPU"), std::string::npos) << text;
}

TEST_F(CliTest, ExitedProcessAwaitingReclaimIsShownAsSuch) {
  kill_and_reap(worker_);
  worker_ = -1;
  const StatusReport report = collect();
  ASSERT_EQ(report.tenants[0].processes.size(), 1u);
  const ProcessStatus& p = report.tenants[0].processes[0];
  EXPECT_FALSE(p.running);
  EXPECT_FALSE(p.host_pid.has_value());
  EXPECT_EQ(p.total_bytes, 1 * kGiB);  // no daemon ran to reclaim it
  EXPECT_NE(status_to_text(report).find("exited"), std::string::npos);
  EXPECT_TRUE(status_to_json(report)["tenants"][0]["processes"][0]["host_pid"].is_null());
}

TEST_F(CliTest, StaleHeartbeatMeansTheDaemonIsNotRunning) {
  const uint64_t stale = monotonic_ns() - 5'000'000'000ull;
  set_heartbeat("alice", stale);
  set_heartbeat("bob", stale);
  const StatusReport report = collect();
  EXPECT_FALSE(report.daemon.alive);
  ASSERT_TRUE(report.daemon.heartbeat_age_ms);
  EXPECT_GE(*report.daemon.heartbeat_age_ms, 5000u);
  EXPECT_NE(status_to_text(report).find("daemon:  NOT RUNNING"), std::string::npos);
}

TEST(CliRunDir, DaemonSeenThroughItsPidFileWhenNoTenantExists) {
  TempDir tmp;
  const std::string pid_file = tmp / kPidFileName;
  write_file(pid_file, "");
  int ready[2];
  ASSERT_EQ(pipe(ready), 0);
  const pid_t holder = fork();
  if (holder == 0) {  // stands in for fracgpud holding its pid-file lock
    const int fd = open(pid_file.c_str(), O_RDWR);
    struct flock fl {};
    fl.l_type = F_WRLCK;
    fl.l_whence = SEEK_SET;
    const char ok = fcntl(fd, F_SETLK, &fl) == 0 ? 1 : 0;
    if (write(ready[1], &ok, 1) != 1) _exit(1);
    for (;;) pause();
  }
  char ok = 0;
  ASSERT_EQ(read(ready[0], &ok, 1), 1);
  ASSERT_EQ(ok, 1);
  std::string error;
  auto report = collect_status(tmp.path(), &error);
  kill_and_reap(holder);
  ASSERT_TRUE(report) << error;
  EXPECT_TRUE(report->tenants.empty());
  EXPECT_TRUE(report->daemon.alive);
  EXPECT_EQ(report->daemon.pid, holder);
  EXPECT_FALSE(report->daemon.heartbeat_age_ms);
  EXPECT_NE(status_to_text(*report).find("no tenant\n"), std::string::npos);
  close(ready[0]);
  close(ready[1]);
}

TEST(CliRunDir, MissingRunDirAndUsageErrors) {
  std::string out;
  EXPECT_EQ(run_cli("status --run-dir /nonexistent/fracgpu", &out), kStatusNoRunDir);
  EXPECT_NE(out.find("fracgpu: /nonexistent/fracgpu"), std::string::npos) << out;
  EXPECT_EQ(run_cli("", &out), kStatusUsage) << out;
  EXPECT_EQ(run_cli("status --bogus", &out), kStatusUsage) << out;
  EXPECT_EQ(run_cli("status --help", &out), 0) << out;
  EXPECT_NE(out.find("--run-dir"), std::string::npos);
}

}  // namespace
