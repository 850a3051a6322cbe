// `fracgpu status` against prepared ledgers: the collected report, its text
// and JSON renderings, and the binary's exit codes; the live view of
// `fracgpu status --watch` and `fracgpu top` (state/live_view.h): its
// windows computed from successive readings, its order, its frames, and the
// binary's frames when stdout is not a terminal. On a terminal it is tested
// by cli_watch_tmux_test.sh.
#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <sys/stat.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <ctime>
#include <filesystem>
#include <atomic>
#include <sstream>
#include <string>
#include <thread>

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "config/config.h"
#include "controller_test_util.h"
#include "daemon/daemon.h"
#include "gputime.h"
#include "ledger.h"
#include "policy_util.h"
#include "state/live_view.h"
#include "state/status.h"
#include "common/uuid.h"

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
    for (const Tenant& t : r.config->tenants) {
      ledger::TenantLedger l;
      char err[256];
      ASSERT_TRUE(fs_mkdirs(run_dir_ + "/tenants"));
      ASSERT_EQ(ledger::open_ledger(tenant_dir(t.name).c_str(), ledger::AccessMode::kDaemon, t.name.c_str(), &l, err,
                                    sizeof err),
                ledger::LedgerError::kOk)
          << err;
      ledger::GpuTable current, planned;
      ledger::latest_gpu_table(l, &current);
      std::string error;
      ASSERT_TRUE(plan_policy(current, &t, *r.config, &planned, &error)) << error;
      publish_table(l, planned);
      l.policy->daemon_heartbeat_ns.store(monotonic_ns());
      l.policy->daemon_pid.store(getpid());
      ledger::close_ledger(&l);
    }
    worker_ = spawn_tenant_process(tenant_dir("alice"), 0, 1 * kGiB, "trainer");
    ASSERT_GT(worker_, 0);
  }

  void TearDown() override {
    kill_and_reap(worker_);
    for (const pid_t pid : holders_) kill_and_reap(pid);
    gputime::close_arbiter(&arbiter_);
    ledger::close_ledger(&usage_);
  }

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

  // An arbiter for `uuid` at `path` (created complete, as fracgpud does);
  // *out maps it read-write.
  static void create_arbiter(const std::string& path, const std::string& uuid, gputime::Arbiter* out) {
    const auto bytes = parse_gpu_uuid(uuid);
    ASSERT_TRUE(bytes);
    ASSERT_TRUE(fs_mkdirs(std::filesystem::path(path).parent_path().string()));
    char err[256];
    ASSERT_EQ(gputime::open_arbiter(path.c_str(), true, false, bytes->data(), out, err, sizeof err),
              ledger::LedgerError::kOk)
        << err;
  }

  // The GPU's arbiter as fracgpud leaves it: <run>/gpus/<UUID>/gputime, both
  // tenants active there, hard-linked into their dirs as gputime-0 (the GPU
  // is entry 0 of both policies).
  void create_gpu_arbiter() {
    const std::string path =
        run_dir_ + "/" + gputime::kGpusDirName + "/" + kUuid + "/" + gputime::kGpuTimeFileName;
    create_arbiter(path, kUuid, &arbiter_);
    ASSERT_TRUE(arbiter_.is_open());
    for (const auto& [name, share] : {std::pair{"alice", 500'000u}, std::pair{"bob", 0u}}) {
      const int row = gputime::bind_tenant(*arbiter_.seg, name);
      ASSERT_GE(row, 0);
      gputime::TenantTime& t = arbiter_.seg->tenants[row];
      t.share_ppm.store(share);
      t.limit_ppm.store(share == 0 ? gputime::kPpm : share);
      t.state.store(gputime::kTenantActive);
      ASSERT_EQ(link(path.c_str(), gpu_time_link(name).c_str()), 0);
    }
    arbiter_.seg->daemon.active_tenants.store(2);
  }

  std::string gpu_time_link(const std::string& tenant) const { return tenant_dir(tenant) + "/gputime-0"; }

  gputime::TenantTime& tenant_row(const char* name) {
    return arbiter_.seg->tenants[gputime::find_tenant(*arbiter_.seg, name)];
  }

  // A process of `tenant` attached to its ledger (a slot, no charge), and
  // the GPU-time requests of its slot on GPU entry 0, which the test writes
  // as the process would. Null if it could not start.
  ledger::GpuTimeRequest* spawn_gpu_process(const std::string& tenant, const char* comm, pid_t* pid_out = nullptr) {
    const pid_t pid = spawn_tenant_process(tenant_dir(tenant), 0, 0, comm);
    if (pid <= 0) return nullptr;
    holders_.push_back(pid);
    if (pid_out != nullptr) *pid_out = pid;
    if (!usage_.is_open()) {
      char err[256];
      if (ledger::open_ledger(tenant_dir(tenant).c_str(), ledger::AccessMode::kTenant, nullptr, &usage_, err,
                              sizeof err) != ledger::LedgerError::kOk)
        return nullptr;
    }
    for (uint32_t s = 0; s < ledger::kMaxSlots; ++s)
      if (usage_.usage->slots[s].state.load() == ledger::kSlotLive && usage_.usage->slots[s].pid.load() == pid)
        return &usage_.usage->gputime[0][s];
    return nullptr;
  }

  // Figures as processes and the daemon would have written them: alice
  // holds the GPU (grant 77); of her processes, "sampler" (no memory
  // charged) entered that grant, "waiter" asks for the GPU, and "dead" died
  // asking (its slot not yet reclaimed: neither waiting nor counted). bob is
  // idle.
  void fill_gpu_time() {
    create_gpu_arbiter();
    if (::testing::Test::HasFatalFailure()) return;
    gputime::TenantTime& alice = tenant_row("alice");
    alice.achieved_1s_ppm.store(300'000);
    alice.achieved_10s_ppm.store(287'000);
    alice.used_ns.store(754'000'000'000);   // 12.6 min
    alice.throttled_ns.store(2'500'000'000);  // 2.5 s
    alice.slices.store(42);
    alice.waiting_processes.store(1);
    // Measured mode: 700 s used of the 943 s it held a grant (DUTY 74.2%).
    arbiter_.seg->daemon.charging.store(gputime::kChargeMeasured);
    alice.measured_ns.store(700'000'000'000);
    alice.held_ns.store(943'000'000'000);
    gputime::TenantTime& bob = tenant_row("bob");
    bob.achieved_1s_ppm.store(700'000);
    bob.achieved_10s_ppm.store(713'000);
    bob.used_ns.store(7'560'000'000'000);  // 2.1 h
    bob.throttled_ns.store(1'234'000'000);  // 1.2 s
    bob.slices.store(7);
    bob.missed_deadlines.store(3);
    bob.flags.store(gputime::kTenantBlocked | gputime::kTenantYields | gputime::kTenantTakesTurns);
    {
      const auto row = static_cast<uint32_t>(gputime::find_tenant(*arbiter_.seg, "alice"));
      arbiter_.seg->tenants[row].grant.store(gputime::grant_word(77, row, gputime::kGranted));
    }

    ledger::GpuTimeRequest* holder = spawn_gpu_process("alice", "sampler", &holder_pid_);
    ASSERT_NE(holder, nullptr);
    holder->entered_grant.store(77);
    holder->used_ns.store(600'000'000'000);  // 10.0 min
    holder->waited_ns.store(1'500'000'000);  // 1.5 s

    ledger::GpuTimeRequest* waiter = spawn_gpu_process("alice", "waiter");
    ASSERT_NE(waiter, nullptr);
    waiter->want_since_ns.store(monotonic_ns());
    waiter->drained_grant.store(76);

    pid_t dead_pid = -1;
    ledger::GpuTimeRequest* dead = spawn_gpu_process("alice", "dead", &dead_pid);
    ASSERT_NE(dead, nullptr);
    dead->want_since_ns.store(monotonic_ns());
    kill_and_reap(dead_pid);
    holders_.pop_back();
  }

  TempDir tmp_;
  std::string run_dir_ = tmp_ / "run";
  pid_t worker_ = -1;
  std::vector<pid_t> holders_;  // children of spawn_gpu_process, killed at the end
  gputime::Arbiter arbiter_;
  ledger::TenantLedger usage_;  // alice's, as her processes map it
  pid_t holder_pid_ = -1;
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
  fill_gpu_time();
  const std::string text = status_to_text(collect());
  std::istringstream in(text);
  std::string line, header, alice, bob, procs_header, proc, sampler;
  while (std::getline(in, line)) {
    if (line.rfind("GPU ", 0) == 0) header = line;
    if (line.rfind(kUuid, 0) == 0) alice = line;
    if (line.find(" bob ") != std::string::npos) bob = line;
    if (line.rfind("TENANT ", 0) == 0) procs_header = line;
    if (line.rfind("alice ", 0) == 0 && line.find("trainer") != std::string::npos) proc = line;
    if (line.rfind("alice ", 0) == 0 && line.find("sampler") != std::string::npos) sampler = line;
  }
  EXPECT_NE(text.find("daemon:  alive (pid " + std::to_string(getpid())), std::string::npos) << text;
  EXPECT_NE(text.find(std::string("charging on ") + kUuid + ": GPU time as NVML's samples measure it"), std::string::npos)
      << text;
  ASSERT_FALSE(header.empty()) << text;
  EXPECT_EQ(header.find("TENANT"), alice.find("alice")) << text;  // columns line up
  EXPECT_EQ(header.find("QUOTA"), alice.find("8 GiB")) << text;
  EXPECT_EQ(header.find("USED"), alice.find("1 GiB")) << text;
  EXPECT_NE(alice.find("granted"), std::string::npos);
  EXPECT_NE(alice.find(" 0.5 "), std::string::npos);
  // GPU time: share and limit as fractions of a GPU, achieved shares in
  // percent, times used and throttled, and who holds the GPU.
  EXPECT_EQ(header.find("SHARE"), alice.find("0.5")) << text;
  EXPECT_EQ(header.find("LIMIT"), alice.find("0.5", header.find("SHARE") + 1)) << text;
  EXPECT_EQ(header.find("1S"), alice.find("30.0%")) << text;
  EXPECT_EQ(header.find("10S"), alice.find("28.7%")) << text;
  EXPECT_EQ(header.find("GPU TIME"), alice.find("12.6 min")) << text;
  EXPECT_EQ(header.find("THROTTLED"), alice.find("2.5 s")) << text;
  EXPECT_EQ(header.find("DUTY"), alice.find("74.2%")) << text;
  EXPECT_EQ(header.find("NOW"), alice.find("holding")) << text;
  // trainer (charged), sampler and waiter (GPU-time requests); not dead
  EXPECT_EQ(header.find("PROCS"), alice.rfind("3")) << text;
  // bob shares alice's GPU: its row leaves the GPU column blank.
  EXPECT_EQ(bob.find("bob"), header.find("TENANT")) << text;
  EXPECT_EQ(bob.find_first_not_of(' '), header.find("TENANT"));
  EXPECT_NE(bob.find("2 GiB"), std::string::npos);
  EXPECT_EQ(header.find("SHARE"), bob.find("-")) << text;  // memory only
  EXPECT_EQ(header.find("LIMIT"), bob.find("1 ")) << text;
  EXPECT_EQ(header.find("1S"), bob.find("70.0%")) << text;
  EXPECT_EQ(header.find("10S"), bob.find("71.3%")) << text;
  EXPECT_EQ(header.find("GPU TIME"), bob.find("2.1 h")) << text;
  EXPECT_EQ(header.find("THROTTLED"), bob.find("1.2 s")) << text;
  EXPECT_EQ(header.find("NOW"), bob.find("blocked")) << text;  // it missed a drain deadline
  ASSERT_FALSE(proc.empty()) << text;
  EXPECT_EQ(procs_header.find("HOST PID"), proc.find(std::to_string(worker_))) << text;
  EXPECT_NE(proc.find("trainer"), std::string::npos);
  EXPECT_NE(proc.find("running"), std::string::npos);
  EXPECT_EQ(proc.substr(procs_header.find("GPU TIME"), 3), "-  ") << text;  // never asked for GPU time
  EXPECT_EQ(proc.substr(procs_header.find("WAITED")), "-") << text;
  // sampler: no memory charged, a row for its GPU time.
  ASSERT_FALSE(sampler.empty()) << text;
  EXPECT_EQ(procs_header.find("HOST PID"), sampler.find(std::to_string(holder_pid_))) << text;
  EXPECT_EQ(procs_header.find("GPU"), sampler.find(kUuid)) << text;
  EXPECT_EQ(procs_header.find("CHARGE"), sampler.find("0 B")) << text;
  EXPECT_EQ(procs_header.find("GPU TIME"), sampler.find("10.0 min")) << text;
  EXPECT_EQ(procs_header.find("WAITED"), sampler.find("1.5 s")) << text;
  EXPECT_EQ(text.find("unreadable"), std::string::npos) << text;
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
  // No arbiter linked (a daemon without GPU-time arbiters): null, no error.
  EXPECT_TRUE(gpu.at("gpu_time").is_null());
  EXPECT_TRUE(gpu.at("gpu_time_error").is_null());
  EXPECT_EQ(proc.at("gpu_time"), nlohmann::json::array());
  // The documented key order.
  const nlohmann::ordered_json ordered = status_to_json(collect());
  EXPECT_EQ(ordered.begin().key(), "schema_version");
  std::vector<std::string> keys;
  for (const auto& [key, value] : ordered["tenants"][0]["gpus"][0].items()) keys.push_back(key);
  EXPECT_EQ(keys, (std::vector<std::string>{"entry", "uuid", "state", "memory_quota", "memory_used", "context_memory",
                                            "share_ppm", "limit_ppm", "count_managed_memory", "gpu_time",
                                            "gpu_time_error"}));
  keys.clear();
  for (const auto& [key, value] : ordered["tenants"][0]["processes"][0].items()) keys.push_back(key);
  EXPECT_EQ(keys, (std::vector<std::string>{"slot", "host_pid", "pid", "comm", "running", "charges", "total_bytes",
                                            "gpu_time"}));
}

// The arbiter's figures for each tenant, exactly as written, in the report,
// the JSON and the binary's output.
TEST_F(CliTest, GpuTimeFromTheArbiter) {
  fill_gpu_time();
  const StatusReport report = collect();
  EXPECT_TRUE(report.all_ledgers_read());
  ASSERT_EQ(report.tenants.size(), 2u);
  const GpuEntryStatus& alice = report.tenants[0].gpus.at(0);
  EXPECT_EQ(alice.gpu_time_error, "");
  ASSERT_TRUE(alice.gpu_time);
  EXPECT_EQ(alice.gpu_time->achieved_1s_ppm, 300'000u);
  EXPECT_EQ(alice.gpu_time->achieved_10s_ppm, 287'000u);
  EXPECT_EQ(alice.gpu_time->used_ns, 754'000'000'000u);
  EXPECT_EQ(alice.gpu_time->throttled_ns, 2'500'000'000u);
  EXPECT_EQ(alice.gpu_time->slices, 42u);
  EXPECT_TRUE(alice.gpu_time->holding);
  EXPECT_EQ(alice.gpu_time->waiting_processes, 1u);  // the daemon's count
  EXPECT_EQ(alice.gpu_time->tenants_sharing, 2u);
  EXPECT_EQ(alice.gpu_time->missed_deadlines, 0u);
  EXPECT_FALSE(alice.gpu_time->blocked);
  const GpuEntryStatus& bob = report.tenants[1].gpus.at(0);
  ASSERT_TRUE(bob.gpu_time);
  EXPECT_EQ(bob.gpu_time->achieved_1s_ppm, 700'000u);
  EXPECT_EQ(bob.gpu_time->achieved_10s_ppm, 713'000u);
  EXPECT_EQ(bob.gpu_time->used_ns, 7'560'000'000'000u);
  EXPECT_EQ(bob.gpu_time->throttled_ns, 1'234'000'000u);
  EXPECT_EQ(bob.gpu_time->slices, 7u);
  EXPECT_FALSE(bob.gpu_time->holding);
  EXPECT_EQ(bob.gpu_time->waiting_processes, 0u);
  EXPECT_EQ(bob.gpu_time->tenants_sharing, 2u);
  EXPECT_EQ(bob.gpu_time->missed_deadlines, 3u);
  EXPECT_TRUE(bob.gpu_time->blocked);
  EXPECT_TRUE(bob.gpu_time->yields);
  EXPECT_FALSE(alice.gpu_time->yields);
  EXPECT_TRUE(bob.gpu_time->takes_turns);
  EXPECT_FALSE(alice.gpu_time->takes_turns);
  // Per process: its slot's requests in the tenant's usage file.
  const std::vector<ProcessStatus>& procs = report.tenants[0].processes;
  ASSERT_EQ(procs.size(), 4u);
  EXPECT_EQ(procs[0].comm, "trainer");
  EXPECT_TRUE(procs[0].gpu_time.empty());  // never asked for GPU time
  EXPECT_EQ(procs[1].comm, "sampler");
  EXPECT_EQ(procs[1].host_pid, holder_pid_);
  EXPECT_TRUE(procs[1].charges.empty());
  ASSERT_EQ(procs[1].gpu_time.size(), 1u);
  EXPECT_EQ(procs[1].gpu_time[0].uuid, kUuid);
  EXPECT_EQ(procs[1].gpu_time[0].used_ns, 600'000'000'000u);
  EXPECT_EQ(procs[1].gpu_time[0].waited_ns, 1'500'000'000u);
  EXPECT_TRUE(procs[1].gpu_time[0].holding);
  EXPECT_FALSE(procs[1].gpu_time[0].waiting);
  EXPECT_EQ(procs[2].comm, "waiter");
  ASSERT_EQ(procs[2].gpu_time.size(), 1u);
  EXPECT_TRUE(procs[2].gpu_time[0].waiting);
  EXPECT_FALSE(procs[2].gpu_time[0].holding);
  EXPECT_EQ(procs[3].comm, "dead");
  EXPECT_FALSE(procs[3].running);
  EXPECT_TRUE(procs[3].gpu_time.empty()) << "a dead process neither waits nor holds";

  // JSON, in the documented key order.
  const nlohmann::ordered_json ordered = status_to_json(report);
  const nlohmann::ordered_json& time = ordered["tenants"][0]["gpus"][0]["gpu_time"];
  std::vector<std::string> keys;
  for (const auto& [key, value] : time.items()) keys.push_back(key);
  EXPECT_EQ(keys, (std::vector<std::string>{"achieved_1s_ppm", "achieved_10s_ppm", "used_ns", "charging", "audited",
                                            "sample_period_ns", "measured_ns", "out_of_grant_ns",
                                            "out_of_grant_samples", "held_ns", "throttled_ns", "slices", "holding", "waiting_processes",
                                            "tenants_sharing", "gated", "missed_deadlines", "blocked", "side_by_side",
                                            "yields", "takes_turns", "priority"}));
  EXPECT_EQ(time, nlohmann::ordered_json::parse(R"({"achieved_1s_ppm": 300000, "achieved_10s_ppm": 287000,
      "used_ns": 754000000000, "charging": "measured", "audited": false, "sample_period_ns": 0,
      "measured_ns": 700000000000, "out_of_grant_ns": 0, "out_of_grant_samples": 0, "held_ns": 943000000000,
      "throttled_ns": 2500000000, "slices": 42, "holding": true,
      "waiting_processes": 1, "tenants_sharing": 2, "gated": true, "missed_deadlines": 0, "blocked": false,
      "side_by_side": false, "yields": false, "takes_turns": false, "priority": "normal"})"));
  EXPECT_TRUE(ordered["tenants"][0]["gpus"][0]["gpu_time_error"].is_null());
  EXPECT_EQ(ordered["tenants"][1]["gpus"][0]["gpu_time"]["used_ns"], 7'560'000'000'000u);
  EXPECT_EQ(ordered["tenants"][1]["gpus"][0]["gpu_time"]["holding"], false);
  EXPECT_EQ(ordered["tenants"][1]["gpus"][0]["gpu_time"]["yields"], true);
  EXPECT_EQ(ordered["tenants"][1]["gpus"][0]["gpu_time"]["takes_turns"], true);
  const nlohmann::ordered_json& proc_time = ordered["tenants"][0]["processes"][1]["gpu_time"];
  ASSERT_EQ(proc_time.size(), 1u);
  keys.clear();
  for (const auto& [key, value] : proc_time[0].items()) keys.push_back(key);
  EXPECT_EQ(keys, (std::vector<std::string>{"uuid", "used_ns", "waited_ns", "waiting", "holding"}));
  EXPECT_EQ(proc_time[0], nlohmann::ordered_json::parse(R"({"uuid": ")" + kUuid + R"(", "used_ns": 600000000000,
      "waited_ns": 1500000000, "waiting": false, "holding": true})"));

  // The binary shows the same.
  std::string out;
  ASSERT_EQ(run_cli("status --json --run-dir " + run_dir_, &out), kStatusOk) << out;
  EXPECT_EQ(nlohmann::json::parse(out)["tenants"][0]["gpus"][0]["gpu_time"], nlohmann::json(time)) << out;
  ASSERT_EQ(run_cli("status --run-dir " + run_dir_, &out), kStatusOk) << out;
  EXPECT_NE(out.find("12.6 min"), std::string::npos) << out;
  EXPECT_NE(out.find("holding"), std::string::npos) << out;
  EXPECT_NE(out.find("blocked"), std::string::npos) << out;
}

// A tenant's priority, and a latency tenant's waits for the GPU, as the
// daemon's scheduler publishes them in the arbiter.
TEST_F(CliTest, PriorityAndLatencyWaitsFromTheArbiter) {
  fill_gpu_time();
  gputime::TenantTime& alice = tenant_row("alice");
  alice.priority.store(gputime::kPriorityLatency);
  alice.wait_p50_ns.store(120'000);        // 120 us
  alice.wait_p99_ns.store(2'500'000);      // 2.50 ms
  alice.wait_p999_ns.store(1'500'000'000);  // 1.5 s
  alice.waits.store(5000);
  gputime::TenantTime& bob = tenant_row("bob");
  bob.priority.store(gputime::kPriorityBatch);
  bob.wait_p50_ns.store(999);  // not a latency tenant's: not shown
  bob.waits.store(9);

  StatusReport report = collect();
  const GpuTimeStatus& a = report.tenants[0].gpus.at(0).gpu_time.value();
  EXPECT_EQ(a.priority, "latency");
  EXPECT_EQ(a.wait_p50_ns, 120'000u);
  EXPECT_EQ(a.wait_p99_ns, 2'500'000u);
  EXPECT_EQ(a.wait_p999_ns, 1'500'000'000u);
  EXPECT_EQ(a.waits, 5000u);
  const GpuTimeStatus& b = report.tenants[1].gpus.at(0).gpu_time.value();
  EXPECT_EQ(b.priority, "batch");
  EXPECT_EQ(b.waits, 0u);

  const nlohmann::ordered_json ordered = status_to_json(report);
  const nlohmann::ordered_json& alice_time = ordered["tenants"][0]["gpus"][0]["gpu_time"];
  EXPECT_EQ(alice_time["priority"], "latency");
  EXPECT_EQ(alice_time["wait_p50_ns"], 120'000u);
  EXPECT_EQ(alice_time["wait_p99_ns"], 2'500'000u);
  EXPECT_EQ(alice_time["wait_p999_ns"], 1'500'000'000u);
  EXPECT_EQ(alice_time["waits"], 5000u);
  std::vector<std::string> keys;
  for (const auto& [key, value] : alice_time.items()) keys.push_back(key);
  ASSERT_GE(keys.size(), 5u);
  EXPECT_EQ(std::vector<std::string>(keys.end() - 5, keys.end()),
            (std::vector<std::string>{"priority", "wait_p50_ns", "wait_p99_ns", "wait_p999_ns", "waits"}));
  const nlohmann::ordered_json& bob_time = ordered["tenants"][1]["gpus"][0]["gpu_time"];
  EXPECT_EQ(bob_time["priority"], "batch");
  EXPECT_FALSE(bob_time.contains("waits"));
  EXPECT_FALSE(bob_time.contains("wait_p50_ns"));

  const std::string text = status_to_text(report);
  EXPECT_NE(text.find("alice [latency]"), std::string::npos) << text;
  EXPECT_NE(text.find("bob [batch]"), std::string::npos) << text;
  EXPECT_NE(text.find("tenant alice [latency]: waits for the GPU p50 120 us, p99 2.50 ms, p99.9 1.5 s (last 1024 of "
                      "5000 waits)"),
            std::string::npos)
      << text;
  EXPECT_EQ(text.find("tenant bob [batch]:"), std::string::npos) << text;

  // A latency tenant that has not waited yet says so.
  alice.waits.store(0);
  EXPECT_NE(status_to_text(collect()).find("tenant alice [latency]: no wait for the GPU yet"), std::string::npos);

  // A stale or damaged file's unknown value is normal: nothing stands out.
  alice.priority.store(7);
  bob.priority.store(0xffffffffu);
  report = collect();
  EXPECT_EQ(report.tenants[0].gpus.at(0).gpu_time->priority, "normal");
  EXPECT_EQ(report.tenants[0].gpus.at(0).gpu_time->waits, 0u);
  EXPECT_EQ(report.tenants[1].gpus.at(0).gpu_time->priority, "normal");
  EXPECT_EQ(status_to_json(report)["tenants"][0]["gpus"][0]["gpu_time"]["priority"], "normal");
  const std::string plain = status_to_text(report);
  EXPECT_EQ(plain.find("[latency]"), std::string::npos) << plain;
  EXPECT_EQ(plain.find("[batch]"), std::string::npos) << plain;
  EXPECT_EQ(plain.find("[normal]"), std::string::npos) << plain;
}

// A process that died holding the GPU: its tenant holds the grant until the
// daemon sees the death (the grant is the daemon's to end), but the dead
// process is shown exited, neither holding nor waiting, with its totals.
TEST_F(CliTest, DeadHolderIsNotHolding) {
  fill_gpu_time();
  kill_and_reap(holder_pid_);
  holders_.erase(std::find(holders_.begin(), holders_.end(), holder_pid_));
  const StatusReport report = collect();
  ASSERT_TRUE(report.tenants[0].gpus.at(0).gpu_time);
  EXPECT_TRUE(report.tenants[0].gpus[0].gpu_time->holding);
  const ProcessStatus& sampler = report.tenants[0].processes.at(1);
  EXPECT_FALSE(sampler.running);
  ASSERT_EQ(sampler.gpu_time.size(), 1u);
  EXPECT_FALSE(sampler.gpu_time[0].holding);
  EXPECT_FALSE(sampler.gpu_time[0].waiting);
  EXPECT_EQ(sampler.gpu_time[0].used_ns, 600'000'000'000u);
}

TEST_F(CliTest, NoArbiterLinkMeansNoGpuTime) {
  const StatusReport report = collect();
  for (const TenantStatus& t : report.tenants) {
    ASSERT_EQ(t.gpus.size(), 1u);
    EXPECT_FALSE(t.gpus[0].gpu_time) << t.name;
    EXPECT_EQ(t.gpus[0].gpu_time_error, "") << t.name;
    for (const ProcessStatus& p : t.processes) EXPECT_TRUE(p.gpu_time.empty());
  }
  const std::string text = status_to_text(report);
  std::istringstream in(text);
  std::string line, header, alice;
  while (std::getline(in, line)) {
    if (line.rfind("GPU ", 0) == 0) header = line;
    if (line.rfind(kUuid, 0) == 0) alice = line;
  }
  for (const char* column : {"1S", "10S", "GPU TIME", "THROTTLED", "NOW"})
    EXPECT_EQ(alice.substr(header.find(column), 3), "-  ") << column << "\n" << text;
  EXPECT_EQ(text.find("unreadable"), std::string::npos) << text;
  const nlohmann::json j = nlohmann::json::parse(status_to_json(report).dump());
  EXPECT_TRUE(j["tenants"][0]["gpus"][0]["gpu_time"].is_null());
  EXPECT_TRUE(j["tenants"][0]["gpus"][0]["gpu_time_error"].is_null());
}

// An arbiter that cannot be used is named with the reason; the rest of the
// report (the other tenant's GPU time included) is still read, and the exit
// code stays 0: every ledger was read.
TEST_F(CliTest, CorruptArbiterIsReportedNotFatal) {
  fill_gpu_time();
  // alice's link now names a file that is no arbiter.
  ASSERT_EQ(unlink(gpu_time_link("alice").c_str()), 0);
  write_file(gpu_time_link("alice"), std::string(sizeof(gputime::GpuTimeSegment), '\x5a'));
  StatusReport report = collect();
  const GpuEntryStatus& alice = report.tenants[0].gpus.at(0);
  EXPECT_FALSE(alice.gpu_time);
  EXPECT_NE(alice.gpu_time_error.find("foreign segment"), std::string::npos) << alice.gpu_time_error;
  EXPECT_NE(alice.gpu_time_error.find(gpu_time_link("alice") + ": not a fracgpu GPU-time arbiter (bad magic)"),
            std::string::npos)
      << alice.gpu_time_error;
  EXPECT_EQ(alice.memory_used, 1 * kGiB);  // the ledger is still read
  EXPECT_TRUE(report.tenants[0].processes.at(1).gpu_time.empty());
  ASSERT_TRUE(report.tenants[1].gpus.at(0).gpu_time);  // bob's link still works
  EXPECT_EQ(report.tenants[1].gpus[0].gpu_time->slices, 7u);
  EXPECT_TRUE(report.all_ledgers_read());
  std::string text = status_to_text(report);
  EXPECT_NE(text.find("unreadable GPU-time arbiters (GPU time not shown):\n  alice on " + kUuid + ": foreign segment"),
            std::string::npos)
      << text;

  std::string out;
  EXPECT_EQ(run_cli("status --json --run-dir " + run_dir_, &out), kStatusOk) << out;
  const nlohmann::json j = nlohmann::json::parse(out);
  EXPECT_TRUE(j["tenants"][0]["gpus"][0]["gpu_time"].is_null());
  EXPECT_NE(j["tenants"][0]["gpus"][0]["gpu_time_error"].get<std::string>().find("bad magic"), std::string::npos);
  EXPECT_TRUE(j["tenants"][1]["gpus"][0]["gpu_time"].is_object());

  // bob's link names another GPU's arbiter: refused, not misreported.
  const std::string other_uuid = "GPU-5a1c0de0-0000-4000-8000-000000000002";
  gputime::Arbiter other;
  create_arbiter(tmp_ / "other/gputime", other_uuid, &other);
  ASSERT_EQ(gputime::bind_tenant(*other.seg, "bob"), 0);
  gputime::close_arbiter(&other);
  ASSERT_EQ(unlink(gpu_time_link("bob").c_str()), 0);
  ASSERT_EQ(link((tmp_ / "other/gputime").c_str(), gpu_time_link("bob").c_str()), 0);
  report = collect();
  EXPECT_FALSE(report.tenants[1].gpus.at(0).gpu_time);
  EXPECT_NE(report.tenants[1].gpus[0].gpu_time_error.find("governs another GPU"), std::string::npos)
      << report.tenants[1].gpus[0].gpu_time_error;

  // bob's link names this GPU's arbiter, which does not list bob.
  gputime::Arbiter unlisted;
  create_arbiter(tmp_ / "unlisted/gputime", kUuid, &unlisted);
  gputime::close_arbiter(&unlisted);
  ASSERT_EQ(unlink(gpu_time_link("bob").c_str()), 0);
  ASSERT_EQ(link((tmp_ / "unlisted/gputime").c_str(), gpu_time_link("bob").c_str()), 0);
  report = collect();
  EXPECT_FALSE(report.tenants[1].gpus.at(0).gpu_time);
  EXPECT_EQ(report.tenants[1].gpus[0].gpu_time_error, gpu_time_link("bob") + ": tenant \"bob\" not listed");
  text = status_to_text(report);
  EXPECT_NE(text.find("  bob on " + kUuid + ": " + gpu_time_link("bob")), std::string::npos) << text;
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
  fill_gpu_time();
  const uint64_t stale = monotonic_ns() - 5'000'000'000ull;
  set_heartbeat("alice", stale);
  set_heartbeat("bob", stale);
  const StatusReport report = collect();
  EXPECT_FALSE(report.daemon.alive);
  ASSERT_TRUE(report.daemon.heartbeat_age_ms);
  EXPECT_GE(*report.daemon.heartbeat_age_ms, 5000u);
  const std::string text = status_to_text(report);
  EXPECT_NE(text.find("daemon:  NOT RUNNING"), std::string::npos);
  // The achieved shares the daemon last wrote stand still: say so.
  EXPECT_NE(text.find("they are stale"), std::string::npos) << text;
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

// A live view whose reader goes away (`| head -1`) ends with exit 0, as
// documented, not killed by SIGPIPE (141).
TEST_F(CliTest, AWatchWhoseReaderLeavesExitsZero) {
  const std::string pipeline = std::string("bash -c '") + FRACGPU_CLI_PATH + " status --watch 0.1 --count 1000 --run-dir " +
                               run_dir_ + " | head -c 1 >/dev/null; exit ${PIPESTATUS[0]}'";
  const int status = system(pipeline.c_str());
  ASSERT_TRUE(WIFEXITED(status)) << status;
  EXPECT_EQ(WEXITSTATUS(status), 0) << pipeline;
}

// `gpu clear` says "no fence" only after reading the fences: a run dir it
// cannot read is an error (exit 1), never the all-clear. And an index that
// two fences record (ordinals move between boots) clears neither.
TEST_F(CliTest, GpuClearTellsAnUnreadableRunDirAndAnAmbiguousIndexApart) {
  std::string out;
  EXPECT_EQ(run_cli("gpu clear 0 --run-dir /nonexistent/fracgpu", &out), kStatusNoRunDir) << out;
  EXPECT_EQ(out.find("has no Xid fence"), std::string::npos) << out;
  EXPECT_EQ(run_cli("gpu clear " + std::string(kUuid) + " --run-dir /nonexistent/fracgpu", &out), kStatusNoRunDir)
      << out;
  EXPECT_EQ(run_cli("gpu clear 0 --run-dir " + run_dir_, &out), kStatusNoFence) << out;  // readable, no fences/

  const std::string fences = run_dir_ + "/fences";
  ASSERT_TRUE(fs_mkdirs(fences));
  const std::string other = "GPU-5a1c0de0-0000-4000-8000-0000000000b9";
  for (const std::string& uuid : {std::string(kUuid), other})
    write_file(fences + "/" + uuid, "{\"uuid\": \"" + uuid + "\", \"index\": 0, \"xid\": 79}\n");
  EXPECT_EQ(run_cli("gpu clear 0 --run-dir " + run_dir_, &out), kStatusUsage) << out;
  EXPECT_NE(out.find("several fences record GPU index 0"), std::string::npos) << out;
  EXPECT_TRUE(std::filesystem::exists(fences + "/" + kUuid));
  EXPECT_TRUE(std::filesystem::exists(fences + "/" + other));
  EXPECT_EQ(run_cli("gpu clear " + other + " --run-dir " + run_dir_, &out), kStatusOk) << out;
  EXPECT_EQ(run_cli("gpu clear 0 --run-dir " + run_dir_, &out), kStatusOk) << out;  // one left: that one
  EXPECT_FALSE(std::filesystem::exists(fences + "/" + kUuid));
}

}  // namespace

namespace {

// A process names itself: its name is the tenant's bytes. An escape
// sequence there must reach the operator's terminal as text, and bytes that
// are not UTF-8 must not break the JSON.
TEST_F(CliTest, ControlCharactersInAProcessNameAreEscaped) {
  const char evil[] = "\x1b]0;pwn\x07\x1b[2J\xff";  // retitle, clear the screen, not UTF-8
  const pid_t p = spawn_tenant_process(tenant_dir("bob"), 0, 1 << 20, evil);
  ASSERT_GT(p, 0);
  holders_.push_back(p);
  std::string out;
  EXPECT_EQ(run_cli("status --run-dir " + run_dir_, &out), kStatusOk) << out;
  EXPECT_EQ(out.find('\x1b'), std::string::npos) << "raw escape reached the terminal";
  EXPECT_EQ(out.find('\x07'), std::string::npos);
  EXPECT_EQ(out.find('\xff'), std::string::npos);
  EXPECT_NE(out.find("\\x1b]0;pwn\\x07\\x1b[2J\\xff"), std::string::npos) << out;
  EXPECT_EQ(run_cli("status --json --run-dir " + run_dir_, &out), kStatusOk) << out;
  EXPECT_EQ(out.find('\x1b'), std::string::npos);
  const nlohmann::json j = nlohmann::json::parse(out);
  std::string comm;
  for (const auto& proc : j.at("tenants").at(1).at("processes")) comm = proc.at("comm").get<std::string>();
  EXPECT_EQ(comm, "\x1b]0;pwn\x07\x1b[2J\xef\xbf\xbd");  // JSON escapes controls; the bad byte is replaced
}

// C1 controls are valid UTF-8 (U+009B is CSI, U+009D OSC, U+009C ST) and
// xterm-like terminals act on them: `status --json` prints ASCII only, so
// they come out as \u escapes there too, and the parsed name is the same.
TEST_F(CliTest, C1ControlsInAProcessNameReachNoTerminal) {
  const char evil[] = "\xc2\x9b" "2J\xc2\x9d" "0;x\xc2\x9c";
  const pid_t p = spawn_tenant_process(tenant_dir("bob"), 0, 1 << 20, evil);
  ASSERT_GT(p, 0);
  holders_.push_back(p);
  const auto non_ascii = [](const std::string& text) {
    return std::count_if(text.begin(), text.end(), [](char c) { return static_cast<unsigned char>(c) >= 0x80; });
  };
  std::string out;
  EXPECT_EQ(run_cli("status --run-dir " + run_dir_, &out), kStatusOk) << out;
  EXPECT_EQ(out.find("\xc2\x9b"), std::string::npos) << out;
  EXPECT_EQ(run_cli("status --json --run-dir " + run_dir_, &out), kStatusOk) << out;
  EXPECT_EQ(non_ascii(out), 0) << out;
  const nlohmann::json j = nlohmann::json::parse(out);
  std::string comm;
  for (const auto& proc : j.at("tenants").at(1).at("processes")) comm = proc.at("comm").get<std::string>();
  EXPECT_EQ(comm, evil);
}

// Status never waits on what a tenant may have planted in its directory: a
// FIFO (an open for reading would block for ever), a link, a device.
TEST_F(CliTest, AFifoLinkOrDeviceForAFileIsRefusedNotWaitedOn) {
  const std::string usage = tenant_dir("bob") + "/usage";
  const std::string link = tenant_dir("alice") + "/gputime-0";
  std::filesystem::remove(usage);
  ASSERT_EQ(mkfifo(usage.c_str(), 0666), 0);
  ASSERT_EQ(symlink("/dev/zero", link.c_str()), 0);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  std::string out;
  EXPECT_EQ(run_cli("status --run-dir " + run_dir_, &out), kStatusBadLedger) << out;
  EXPECT_LT(std::chrono::steady_clock::now(), deadline);
  EXPECT_NE(out.find("  bob: " + usage + ": refused: not a regular file (a FIFO)"), std::string::npos) << out;
  EXPECT_NE(out.find("alice on " + kUuid + ": " + link + ": refused: not a regular file (a symbolic link)"),
            std::string::npos)
      << out;
}

// Tenants are directories of the daemon's user: a link in tenants/ (which
// only the daemon can write) is reported, never followed.
TEST_F(CliTest, ATenantDirectoryThatIsALinkIsRefused) {
  ASSERT_EQ(symlink(tenant_dir("alice").c_str(), tenant_dir("mallory").c_str()), 0);
  const StatusReport report = collect();
  ASSERT_EQ(report.tenants.size(), 3u);
  EXPECT_EQ(report.tenants[2].name, "mallory");
  EXPECT_NE(report.tenants[2].error.find(tenant_dir("mallory") + ": refused: not a directory (a symbolic link)"),
            std::string::npos)
      << report.tenants[2].error;
}

}  // namespace

// ---- The live view: `fracgpu status --watch`, `fracgpu top` ----
namespace {

constexpr uint64_t kSecondNs = 1'000'000'000;
const std::string kUuid2 = "GPU-5a1c0de0-0000-4000-8000-000000000002";

// A report as collect_status() would make it, without files: each tenant
// has GPU entries with the given cumulative figures.
struct FakeGpu {
  std::string uuid = kUuid;
  uint64_t used_ns = 0;       // charged (held mode's counter)
  uint64_t measured_ns = 0;   // measured mode's counter
  uint64_t throttled_ns = 0;
  bool measured = false;
  uint64_t memory_used = 0;
  uint32_t share_ppm = 250'000;
};

StatusReport fake_report(const std::vector<std::pair<std::string, std::vector<FakeGpu>>>& tenants) {
  StatusReport report;
  report.run_dir = "/run/fracgpu";
  report.daemon.alive = true;
  report.daemon.pid = 42;
  report.daemon.heartbeat_age_ms = 100;
  for (const auto& [name, gpus] : tenants) {
    TenantStatus t;
    t.name = name;
    for (const FakeGpu& f : gpus) {
      GpuEntryStatus g;
      g.uuid = f.uuid;
      g.state = "granted";
      g.memory_quota = 4 * kGiB;
      g.memory_used = f.memory_used;
      g.share_ppm = f.share_ppm;
      g.limit_ppm = f.share_ppm;
      GpuTimeStatus time;
      time.used_ns = f.used_ns;
      time.measured_ns = f.measured_ns;
      time.measured = f.measured;
      time.throttled_ns = f.throttled_ns;
      g.gpu_time = time;
      t.gpus.push_back(g);
    }
    report.tenants.push_back(t);
  }
  return report;
}

StatusReport one_tenant(uint64_t used_ns, uint64_t throttled_ns = 0) {
  return fake_report({{"alice", {{.used_ns = used_ns, .throttled_ns = throttled_ns}}}});
}

TEST(LiveView, IntervalSecondsAreChecked) {
  std::string why;
  EXPECT_EQ(parse_interval_seconds("1", &why), 1.0);
  EXPECT_EQ(parse_interval_seconds("0.5", &why), 0.5);
  EXPECT_EQ(parse_interval_seconds("0.1", &why), 0.1);
  EXPECT_EQ(parse_interval_seconds("3600", &why), 3600.0);
  EXPECT_EQ(parse_interval_seconds("2.", &why), 2.0);
  for (const char* bad : {"", "0", "0.05", "3601", "-1", "+1", "abc", "1s", " 1", "1e3", "inf", "nan", "1.2.3", ".",
                          "0x10"}) {
    why.clear();
    EXPECT_FALSE(parse_interval_seconds(bad, &why)) << bad;
    EXPECT_EQ(why, fmt::format("\"{}\" is not a number of seconds from 0.1 to 3600 (e.g. 1 or 0.5)", bad)) << bad;
  }
  // What it echoes is escaped: the text is the operator's, but a terminal
  // must not take it for a control sequence.
  EXPECT_FALSE(parse_interval_seconds("\x1b[2J", &why));
  EXPECT_EQ(why.find('\x1b'), std::string::npos) << why;
  EXPECT_EQ(parse_live_order("gpu"), LiveOrder::kGpuTime);
  EXPECT_EQ(parse_live_order("memory"), LiveOrder::kMemory);
  EXPECT_EQ(parse_live_order("name"), LiveOrder::kName);
  EXPECT_FALSE(parse_live_order("cpu"));
}

// Two readings a second apart give the share over that second; the 10 s
// window spans only what has been read so far until readings go back 10 s.
TEST(LiveView, SharesFromTwoReadings) {
  GpuTimeReadings r;
  const uint64_t t0 = 1000 * kSecondNs;
  r.record(one_tenant(5 * kSecondNs, 2 * kSecondNs), t0);
  EXPECT_FALSE(r.used("alice", kUuid, kLiveShortWindowNs)) << "one reading is no window";
  r.record(one_tenant(5 * kSecondNs + 300'000'000, 2 * kSecondNs + 700'000'000), t0 + kSecondNs);
  const auto short_used = r.used("alice", kUuid, kLiveShortWindowNs);
  ASSERT_TRUE(short_used);
  EXPECT_EQ(short_used->ppm, 300'000u);
  EXPECT_EQ(short_used->span_ns, kSecondNs);
  const auto long_used = r.used("alice", kUuid, kLiveLongWindowNs);
  ASSERT_TRUE(long_used);
  EXPECT_EQ(long_used->ppm, 300'000u);
  EXPECT_EQ(long_used->span_ns, kSecondNs);  // all there is so far
  const auto throttled = r.throttled("alice", kUuid, kLiveLongWindowNs);
  ASSERT_TRUE(throttled);
  EXPECT_EQ(throttled->ppm, 700'000u);
  EXPECT_FALSE(r.used("bob", kUuid, kLiveShortWindowNs));
  EXPECT_FALSE(r.used("alice", kUuid2, kLiveShortWindowNs));
}

// Readings every 0.5 s for 12 s: 30% of the GPU for the first 6 s, 70% for
// the next 6. At the end, the last second is all 70%; the last ten, 4 s at
// 30% and 6 s at 70%: 54%.
TEST(LiveView, WindowsOfOneAndTenSeconds) {
  GpuTimeReadings r;
  const uint64_t t0 = 77 * kSecondNs;
  const uint64_t step = kSecondNs / 2;
  uint64_t used = 0;
  for (uint64_t i = 0; i <= 24; ++i) {
    if (i > 0) used += (i <= 12 ? 300'000'000 : 700'000'000) / 2;
    r.record(one_tenant(used), t0 + i * step);
    if (i == 12) {
      EXPECT_EQ(r.used("alice", kUuid, kLiveShortWindowNs)->ppm, 300'000u);
      EXPECT_EQ(r.used("alice", kUuid, kLiveLongWindowNs)->span_ns, 6 * kSecondNs);
    }
  }
  const auto short_used = r.used("alice", kUuid, kLiveShortWindowNs);
  ASSERT_TRUE(short_used);
  EXPECT_EQ(short_used->ppm, 700'000u);
  EXPECT_EQ(short_used->span_ns, kSecondNs);
  const auto long_used = r.used("alice", kUuid, kLiveLongWindowNs);
  ASSERT_TRUE(long_used);
  EXPECT_EQ(long_used->ppm, 540'000u);
  EXPECT_EQ(long_used->span_ns, 10 * kSecondNs);
  // Readings a little off the half second: the earlier reading closest to
  // the window's age is used, and the share is over the actual span.
  GpuTimeReadings jitter;
  jitter.record(one_tenant(0), t0);
  jitter.record(one_tenant(100'000'000), t0 + 480'000'000);
  jitter.record(one_tenant(200'000'000), t0 + 990'000'000);
  jitter.record(one_tenant(400'000'000), t0 + 1'490'000'000);
  const auto s = jitter.used("alice", kUuid, kLiveShortWindowNs);
  ASSERT_TRUE(s);
  EXPECT_EQ(s->span_ns, 1'010'000'000u);  // from t0 + 0.48 s
  EXPECT_EQ(s->ppm, static_cast<uint32_t>(300'000'000ull * 1'000'000 / 1'010'000'000));
}

// The counter is the one the daemon's achieved shares use: measured GPU
// time where the daemon charges measured time, else time charged.
TEST(LiveView, MeasuredChargingCountsMeasuredTime) {
  GpuTimeReadings r;
  const auto report = [](uint64_t used, uint64_t measured, bool is_measured) {
    return fake_report({{"alice", {{.used_ns = used, .measured_ns = measured, .measured = is_measured}}}});
  };
  r.record(report(0, 0, true), kSecondNs);
  r.record(report(900'000'000, 400'000'000, true), 2 * kSecondNs);
  EXPECT_EQ(r.used("alice", kUuid, kLiveShortWindowNs)->ppm, 400'000u);
  // A change of charging starts afresh: the two counters do not compare.
  r.record(report(1'000'000'000, 450'000'000, false), 3 * kSecondNs);
  EXPECT_FALSE(r.used("alice", kUuid, kLiveShortWindowNs));
  r.record(report(1'500'000'000, 450'000'000, false), 4 * kSecondNs);
  EXPECT_EQ(r.used("alice", kUuid, kLiveShortWindowNs)->ppm, 500'000u);
}

// A counter that goes back (the daemon restarted, the tenant was made
// again) starts its series afresh, and never shows a negative or huge
// share; a share above the whole window is capped at 100%; a tenant no
// longer in the report is forgotten.
TEST(LiveView, CountersThatGoBackOrVanish) {
  GpuTimeReadings r;
  r.record(one_tenant(50 * kSecondNs), kSecondNs);
  r.record(one_tenant(51 * kSecondNs), 2 * kSecondNs);
  EXPECT_EQ(r.used("alice", kUuid, kLiveShortWindowNs)->ppm, 1'000'000u);
  r.record(one_tenant(100'000'000), 3 * kSecondNs);
  EXPECT_FALSE(r.used("alice", kUuid, kLiveShortWindowNs));
  r.record(one_tenant(3 * kSecondNs), 4 * kSecondNs);  // more than the second: capped
  EXPECT_EQ(r.used("alice", kUuid, kLiveShortWindowNs)->ppm, 1'000'000u);
  r.record(fake_report({{"bob", {{.used_ns = 0}}}}), 5 * kSecondNs);
  EXPECT_FALSE(r.used("alice", kUuid, kLiveShortWindowNs));
  r.record(one_tenant(3 * kSecondNs), 6 * kSecondNs);
  EXPECT_FALSE(r.used("alice", kUuid, kLiveShortWindowNs)) << "forgotten, not compared with 2 s ago";
}

// The table's tenant column, top to bottom.
std::vector<std::string> tenant_order(const std::vector<std::string>& lines) {
  std::vector<std::string> names;
  bool in_table = false;
  for (const std::string& line : lines) {
    if (line.rfind("GPU ", 0) == 0) {
      in_table = true;
      continue;
    }
    if (!in_table) continue;
    if (line.empty()) break;
    std::istringstream in(line);
    std::string first, second;
    in >> first >> second;
    // The GPU cell is blank on a GPU's later rows.
    names.push_back(line[0] == ' ' ? first : second);
  }
  return names;
}

TEST(LiveView, OrderByGpuTimeMemoryOrName) {
  // alice and carol on GPU 1, bob on GPU 2 (by UUID); used for 1 s:
  // alice 20%, bob 50%, carol 30%; memory: carol > alice > bob.
  const auto report = [](uint64_t a, uint64_t b, uint64_t c) {
    return fake_report({{"alice", {{.used_ns = a, .memory_used = 2 * kGiB}}},
                        {"bob", {{.uuid = kUuid2, .used_ns = b, .memory_used = 1 * kGiB}}},
                        {"carol", {{.used_ns = c, .memory_used = 3 * kGiB}}}});
  };
  GpuTimeReadings r;
  r.record(report(0, 0, 0), kSecondNs);
  r.record(report(200'000'000, 500'000'000, 300'000'000), 2 * kSecondNs);
  const StatusReport now = report(200'000'000, 500'000'000, 300'000'000);
  LiveFrameInfo info;
  info.title = "fracgpu top";
  info.node = "node-7";
  info.clock = "2030-01-02 03:04:05 UTC";
  const auto order = [&](LiveOrder o) {
    info.order = o;
    return tenant_order(live_view_lines(now, "", r, info));
  };
  using Names = std::vector<std::string>;
  EXPECT_EQ(order(LiveOrder::kGpu), (Names{"alice", "carol", "bob"}));  // as fracgpu status: by GPU
  EXPECT_EQ(order(LiveOrder::kGpuTime), (Names{"bob", "carol", "alice"}));
  EXPECT_EQ(order(LiveOrder::kMemory), (Names{"carol", "alice", "bob"}));
  EXPECT_EQ(order(LiveOrder::kName), (Names{"alice", "bob", "carol"}));
  // Without two readings, GPU time cannot rank: status order.
  GpuTimeReadings none;
  info.order = LiveOrder::kGpuTime;
  EXPECT_EQ(tenant_order(live_view_lines(now, "", none, info)), (Names{"alice", "carol", "bob"}));
}

TEST(LiveView, FrameShowsHeaderColumnsAndWindows) {
  StatusReport report = fake_report({{"alice", {{.used_ns = 0, .memory_used = 1 * kGiB, .share_ppm = 250'000}}},
                                     {"bob", {{.used_ns = 0, .share_ppm = 500'000}}}});
  report.tenants[1].gpus[0].memory_quota.reset();
  report.tenants[1].gpus[0].gpu_time->priority = "latency";
  report.gpu_health = nlohmann::json::parse(R"({"nvml": true, "gpus": [{"index": 3, "uuid": ")" + kUuid +
                                            R"(", "healthy": false, "reason": "xid"}]})");
  GpuTimeReadings r;
  r.record(report, kSecondNs);
  report.tenants[0].gpus[0].gpu_time->used_ns = 250'000'000;
  report.tenants[0].gpus[0].gpu_time->throttled_ns = 500'000'000;
  report.tenants[1].gpus[0].gpu_time->used_ns = 500'000'000;
  r.record(report, 2 * kSecondNs);
  LiveFrameInfo info;
  info.title = "fracgpu status --watch";
  info.node = "node-7";
  info.clock = "2030-01-02 03:04:05 UTC";
  info.interval_s = 0.5;
  const std::vector<std::string> lines = live_view_lines(report, "", r, info);
  std::string text;
  for (const std::string& line : lines) text += line + "\n";
  ASSERT_GE(lines.size(), 6u) << text;
  EXPECT_EQ(lines[0], "fracgpu status --watch on node-7  2030-01-02 03:04:05 UTC  every 0.5 s, by GPU, then tenant");
  EXPECT_EQ(lines[1], "daemon: alive (pid 42, heartbeat 0.1 s ago)  run dir: /run/fracgpu");
  std::string header, alice, bob;
  for (const std::string& line : lines) {
    if (line.rfind("GPU ", 0) == 0) header = line;
    if (line.find(" alice ") != std::string::npos) alice = line;
    if (line.find(" bob ") != std::string::npos) bob = line;
  }
  ASSERT_FALSE(header.empty()) << text;
  for (const char* column : {"TENANT", "SHARE", "LIMIT", "1S", "10S", "MEMORY", "THROTTLED", "PRIORITY", "HEALTH"})
    EXPECT_NE(header.find(column), std::string::npos) << column;
  // The GPU by its driver ordinal where health.json gives it.
  EXPECT_EQ(alice.rfind("3 ", 0), 0u) << text;
  EXPECT_EQ(alice.find("alice"), header.find("TENANT")) << text;
  EXPECT_EQ(alice.find("0.25"), header.find("SHARE")) << text;
  EXPECT_EQ(alice.find("25.0%"), header.find("1S")) << text;
  EXPECT_EQ(alice.find("25.0%*"), header.find("10S")) << text;  // 1 s of 10 so far
  EXPECT_EQ(alice.find("1 GiB / 4 GiB"), header.find("MEMORY")) << text;
  EXPECT_EQ(alice.find("50.0%*"), header.find("THROTTLED")) << text;  // 0.5 s of the 1 s read so far
  EXPECT_EQ(alice.find("normal"), header.find("PRIORITY")) << text;
  EXPECT_EQ(alice.find("UNHEALTHY (xid)"), header.find("HEALTH")) << text;
  EXPECT_EQ(bob.find_first_not_of(' '), header.find("TENANT")) << text;  // same GPU: blank
  EXPECT_EQ(bob.find("50.0%"), header.find("1S")) << text;
  EXPECT_EQ(bob.find("0 B / unlimited"), header.find("MEMORY")) << text;
  EXPECT_EQ(bob.find("latency"), header.find("PRIORITY")) << text;
  EXPECT_EQ(std::count(lines.begin(), lines.end(), header), 1);
  EXPECT_NE(text.find("\n*: not over the column's whole window"), std::string::npos) << text;

  // The tenant's own mark is what refuses its processes: it wins.
  report.tenants[1].gpus[0].unavailable = "bypass";
  report.gpu_health.reset();
  const std::vector<std::string> marked = live_view_lines(report, "", r, info);
  std::string marked_text;
  for (const std::string& line : marked) marked_text += line + "\n";
  EXPECT_NE(marked_text.find("DENIED (bypass)"), std::string::npos) << marked_text;
  EXPECT_NE(marked_text.find("\n" + kUuid.substr(0, 12) + " "), std::string::npos)
      << "no health.json: the GPU by its UUID's start\n" << marked_text;

  // A daemon that went away is said so; a run dir that cannot be read is
  // a frame that says why, not a failure.
  report.daemon.alive = false;
  report.daemon.heartbeat_age_ms = 12'000;
  const std::vector<std::string> stopped = live_view_lines(report, "", r, info);
  EXPECT_EQ(stopped[1], "daemon: NOT RUNNING or hung, pid 42 (last heartbeat 12.0 s ago)  run dir: /run/fracgpu");
  EXPECT_EQ(stopped[2], "fracgpud is not running: its counters stand still (GPU-time shares fall to 0%), the rest is "
                        "as it left it");
  const std::vector<std::string> gone = live_view_lines(std::nullopt, "/run/fracgpu: missing", GpuTimeReadings(), info);
  ASSERT_EQ(gone.size(), 3u);
  EXPECT_EQ(gone[1], "cannot read the run dir: /run/fracgpu: missing");
  EXPECT_EQ(gone[2], "trying again every 0.5 s (Ctrl-C quits)");
}

TEST(CliRunDir, WatchAndTopUsageErrors) {
  std::string out;
  EXPECT_EQ(run_cli("status --watch abc --run-dir /nonexistent", &out), kStatusUsage) << out;
  EXPECT_NE(out.find("fracgpu: --watch: \"abc\" is not a number of seconds from 0.1 to 3600"), std::string::npos)
      << out;
  EXPECT_EQ(run_cli("status --watch 0", &out), kStatusUsage) << out;
  EXPECT_EQ(run_cli("status --watch=-1", &out), kStatusUsage) << out;
  EXPECT_EQ(run_cli("status --watch 1 --json", &out), kStatusUsage) << out;
  EXPECT_NE(out.find("cannot be combined with --json"), std::string::npos) << out;
  EXPECT_EQ(run_cli("status --count 2", &out), kStatusUsage) << out;
  EXPECT_NE(out.find("--count counts the frames of --watch"), std::string::npos) << out;
  EXPECT_EQ(run_cli("top --interval 0.01", &out), kStatusUsage) << out;
  EXPECT_NE(out.find("fracgpu: --interval: \"0.01\" is not a number of seconds"), std::string::npos) << out;
  EXPECT_EQ(run_cli("top --sort cpu", &out), kStatusUsage) << out;
  EXPECT_NE(out.find("cpu not in {gpu,memory,name}"), std::string::npos) << out;
  EXPECT_EQ(run_cli("top --count 0", &out), kStatusUsage) << out;
  // A run dir that cannot be read at the start: as plain status.
  EXPECT_EQ(run_cli("top --run-dir /nonexistent/fracgpu", &out), kStatusNoRunDir) << out;
  EXPECT_NE(out.find("fracgpu: /nonexistent/fracgpu"), std::string::npos) << out;
  EXPECT_EQ(run_cli("status --watch --run-dir /nonexistent/fracgpu", &out), kStatusNoRunDir) << out;
  EXPECT_EQ(run_cli("top --help", &out), 0) << out;
  EXPECT_NE(out.find("--sort"), std::string::npos) << out;
}

// The binary, stdout a pipe: one frame per interval, a blank line between,
// no terminal controls; the shares are fracgpu's own, from its readings of
// counters that a thread here advances as the daemon would (alice 30% of
// the time, bob 70%, measured).
TEST_F(CliTest, TopPrintsFramesWithSharesFromItsReadings) {
  fill_gpu_time();
  gputime::TenantTime& alice = tenant_row("alice");
  gputime::TenantTime& bob = tenant_row("bob");
  // The daemon's own achieved shares, far from what the counters show:
  // the view must not show (or sort by) these.
  alice.achieved_1s_ppm.store(990'000);
  alice.achieved_10s_ppm.store(990'000);
  bob.achieved_1s_ppm.store(10'000);
  bob.achieved_10s_ppm.store(10'000);
  std::atomic<bool> stop{false};
  const uint64_t start = monotonic_ns();
  const uint64_t alice_base = alice.measured_ns.load(), bob_base = bob.measured_ns.load();
  std::thread daemon([&] {
    while (!stop.load()) {
      const uint64_t elapsed = monotonic_ns() - start;
      alice.measured_ns.store(alice_base + elapsed * 3 / 10);
      bob.measured_ns.store(bob_base + elapsed * 7 / 10);
      usleep(2000);
    }
  });
  std::string out;
  const int rc = run_cli("top --interval 0.5 --count 4 --run-dir " + run_dir_, &out);
  stop = true;
  daemon.join();
  ASSERT_EQ(rc, kStatusOk) << out;
  EXPECT_EQ(out.find('\x1b'), std::string::npos) << "no terminal controls into a pipe";
  size_t frames = 0;
  for (size_t at = 0; (at = out.find("fracgpu top on ", at)) != std::string::npos; ++at) ++frames;
  EXPECT_EQ(frames, 4u) << out;
  EXPECT_EQ(out.rfind("fracgpu top on ", 0), 0u) << out;
  size_t gaps = 0;
  for (size_t at = 0; (at = out.find("\n\nfracgpu top on ", at)) != std::string::npos; ++at) ++gaps;
  EXPECT_EQ(gaps, 3u) << out;
  // The last frame: bob first (sorted by GPU time), both near their rates.
  const std::string last = out.substr(out.rfind("fracgpu top on "));
  std::istringstream in(last);
  std::vector<std::string> lines;
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  EXPECT_EQ(tenant_order(lines), (std::vector<std::string>{"bob", "alice"})) << last;
  std::string header;
  for (const std::string& line : lines)
    if (line.rfind("GPU ", 0) == 0) header = line;
  ASSERT_FALSE(header.empty()) << last;
  const auto percent = [&](const std::string& tenant, const char* column) {
    for (const std::string& line : lines)
      if (line.find(" " + tenant + " ") != std::string::npos) return std::atof(line.c_str() + header.find(column));
    return -1.0;
  };
  // Loose: a reading may come while the thread above is not scheduled.
  EXPECT_NEAR(percent("alice", "1S"), 30, 8) << last;
  EXPECT_NEAR(percent("bob", "1S"), 70, 8) << last;
  EXPECT_NEAR(percent("alice", "10S"), 30, 8) << last;
  EXPECT_NEAR(percent("bob", "10S"), 70, 8) << last;

  // status --watch: the same view, in status order (alice, then bob).
  ASSERT_EQ(run_cli("status --watch 0.5 --count 2 --run-dir " + run_dir_, &out), kStatusOk) << out;
  EXPECT_EQ(out.rfind("fracgpu status --watch on ", 0), 0u) << out;
  const std::string second = out.substr(out.rfind("fracgpu status --watch on "));
  std::istringstream in2(second);
  lines.clear();
  for (std::string line; std::getline(in2, line);) lines.push_back(line);
  EXPECT_EQ(tenant_order(lines), (std::vector<std::string>{"alice", "bob"})) << out;
}

}  // namespace
