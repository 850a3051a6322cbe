// fracgpud end to end: the real binary on the simulated driver, against a
// temporary run dir, with stand-in tenant processes attached to the ledgers.
#include <fcntl.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/mount.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <sstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "controller_test_util.h"
#include "common/gpu_discovery.h"
#include "daemon/daemon.h"
#include "state/status.h"
#include "ledger.h"
#include "common/uuid.h"

using namespace fracgpu;
using namespace fracgpu::testing;
using namespace std::chrono_literals;
namespace fs = std::filesystem;

namespace {

constexpr uint64_t kGiB = 1ull << 30;
const std::string kUuid = "GPU-5a1c0de0-0000-4000-8000-000000000001";
const std::string kUuid2 = "GPU-5a1c0de0-0000-4000-8000-000000000002";
// Two simulated 16 GiB GPUs.
const std::string kDevices = "uuid=" + kUuid + ",name=Sim A,mem=16GiB,ctx=64MiB;uuid=" + kUuid2 + ",name=Sim B,mem=16GiB,ctx=64MiB";

class DaemonTest : public ::testing::Test {
 protected:
  void TearDown() override {
    for (pid_t pid : children_) kill_and_reap(pid);
    kill_and_reap(daemon_);
  }

  // alice: a fraction of GPU 0; bob: an explicit quota on GPU 0.
  static std::string config(const std::string& run_dir, const std::string& alice_gpus, bool with_bob = true) {
    std::string text = "[daemon]\nrun_dir = \"" + run_dir + "\"\nreap_interval_ms = 50\nlog_level = \"debug\"\n" +
                       "[[gpu]]\nindex = 0\ncontext_memory = \"128MiB\"\n"
                       "[[tenant]]\nname = \"alice\"\ngpus = " + alice_gpus + "\ndevices = [0]\n";
    if (with_bob) text += "[[tenant]]\nname = \"bob\"\ncount_managed = false\nmemory = { \"0\" = \"2GiB\" }\n";
    return text;
  }

  void write_config(const std::string& text) { write_file(config_path_, text); }

  // Runs a binary with the simulated driver; stdout and stderr go to `log`.
  pid_t spawn(const std::vector<std::string>& args, const std::string& log, const std::string& devices = kDevices,
              int gate = -1) {
    // No SIMCUDA_STATE: a private simulated state, the daemon only lists GPUs.
    return spawn_logged(args, log,
                        {std::string("LD_LIBRARY_PATH=") + SIMCUDA_DIR, "SIMCUDA_DEVICES=" + devices, "SIMCUDA_STATE"},
                        gate);
  }

  // Runs fracgpud to completion (--check, or a start that must fail).
  int run_daemon(const std::vector<std::string>& extra, std::string* output, const std::string& devices = kDevices) {
    std::vector<std::string> args{FRACGPUD_PATH, "--config", config_path_};
    args.insert(args.end(), extra.begin(), extra.end());
    const std::string log = tmp_ / "run-once.log";
    fs::remove(log);
    const int rc = wait_exit(spawn(args, log, devices), 10s);
    *output = read_file(log);
    return rc;
  }

  // Starts fracgpud and waits until it heartbeats into alice's ledger.
  pid_t start_daemon() { return wait_until_up(spawn({FRACGPUD_PATH, "--config", config_path_}, log_path_)); }

  pid_t wait_until_up(pid_t pid) {
    const bool up = eventually([&] {
      ledger::TenantLedger l;
      if (!open_tenant("alice", &l)) return false;
      const bool ours = l.policy->daemon_pid.load() == pid;
      ledger::close_ledger(&l);
      return ours;
    });
    EXPECT_TRUE(up) << "fracgpud did not come up; its log:\n" << read_file(log_path_);
    return pid;
  }

  bool open_tenant(const std::string& name, ledger::TenantLedger* out) {
    char err[256];
    return ledger::open_ledger(tenant_dir(name).c_str(), ledger::AccessMode::kReadOnly, nullptr, out, err, sizeof err) ==
           ledger::LedgerError::kOk;
  }

  // A read-only mapping kept for the test's duration, as a tenant process would.
  ledger::TenantLedger map_tenant(const std::string& name) {
    ledger::TenantLedger l;
    EXPECT_TRUE(open_tenant(name, &l)) << name;
    return l;
  }

  std::string tenant_dir(const std::string& name) const { return run_dir_ + "/tenants/" + name; }

  // A tenant process (spawn_tenant_process) killed at the end of the test.
  pid_t keep_worker(const std::string& tenant, uint64_t bytes, const char* comm = "trainer") {
    const pid_t pid = spawn_tenant_process(tenant_dir(tenant), 0, bytes, comm);
    EXPECT_GT(pid, 0) << "the tenant process of " << tenant << " could not charge";
    if (pid > 0) children_.push_back(pid);
    return pid;
  }

  bool log_contains(const std::string& text) const { return read_file(log_path_).find(text) != std::string::npos; }

  static int entry_of(const ledger::TenantLedger& l, const std::string& uuid) {
    return ledger::find_gpu(l, controller::parse_gpu_uuid(uuid)->data());
  }

  // Entry `gpu` of a tenant's table in force, read as the interposer reads it.
  static ledger::GpuEntry entry(const ledger::TenantLedger& l, uint32_t gpu) { return ledger::read_gpu_entry(l, gpu); }

  TempDir tmp_;
  std::string run_dir_ = tmp_ / "run";
  std::string config_path_ = tmp_ / "fracgpud.toml";
  std::string log_path_ = tmp_ / "fracgpud.log";
  std::vector<pid_t> children_;
  pid_t daemon_ = -1;
};

TEST_F(DaemonTest, CreatesLedgersWithTheConfiguredQuotas) {
  write_config(config(run_dir_, "0.5"));
  daemon_ = start_daemon();
  ledger::TenantLedger alice = map_tenant("alice");
  ASSERT_TRUE(alice.is_open());
  EXPECT_STREQ(alice.policy->tenant, "alice");
  const int a = entry_of(alice, kUuid);
  ASSERT_EQ(a, 0);
  const ledger::GpuEntry ga = entry(alice, a);
  EXPECT_EQ(ga.state, ledger::kGpuGranted);
  EXPECT_EQ(ga.memory_quota, 8 * kGiB);
  EXPECT_EQ(ga.context_memory, 128ull << 20);
  EXPECT_EQ(ga.flags, uint32_t{ledger::kCountManagedMemory});
  EXPECT_EQ(ga.share_ppm, 500'000u);
  EXPECT_EQ(ga.limit_ppm, 500'000u);
  EXPECT_GE(alice.node->committed.load(), 1u);
  EXPECT_NE(alice.policy->daemon_heartbeat_ns.load(), 0u);
  // No other GPU entry was touched.
  EXPECT_EQ(entry(alice, 1).state, ledger::kGpuUnused);

  ledger::TenantLedger bob = map_tenant("bob");
  const ledger::GpuEntry gb = entry(bob, entry_of(bob, kUuid));
  EXPECT_EQ(gb.state, ledger::kGpuGranted);
  EXPECT_EQ(gb.memory_quota, 2 * kGiB);
  EXPECT_EQ(gb.flags, 0u);
  EXPECT_EQ(gb.share_ppm, 0u);

  EXPECT_EQ(std::stoi(read_file(run_dir_ + "/fracgpud.pid")), daemon_);
  ledger::close_ledger(&alice);
  ledger::close_ledger(&bob);
}

// A few descriptors per tenant and GPU: the daemon takes what the hard
// limit allows, whatever soft limit it was started with.
TEST_F(DaemonTest, RaisesItsDescriptorLimitToTheHardLimit) {
  struct rlimit saved {};
  ASSERT_EQ(getrlimit(RLIMIT_NOFILE, &saved), 0);
  if (saved.rlim_max <= 256) GTEST_SKIP() << "hard limit " << saved.rlim_max << ": nothing to raise to";
  struct rlimit low = saved;
  low.rlim_cur = 256;
  write_config(config(run_dir_, "0.5"));
  ASSERT_EQ(setrlimit(RLIMIT_NOFILE, &low), 0);
  daemon_ = start_daemon();  // inherits the low soft limit
  ASSERT_EQ(setrlimit(RLIMIT_NOFILE, &saved), 0);
  const pid_t daemon = daemon_;
  std::string soft, line;
  std::istringstream limits(read_file("/proc/" + std::to_string(daemon) + "/limits"));
  while (std::getline(limits, line))
    if (line.rfind("Max open files", 0) == 0) soft = line;
  const std::string hard = saved.rlim_max == RLIM_INFINITY ? "unlimited" : std::to_string(saved.rlim_max);
  EXPECT_NE(soft.find(" " + hard + " "), std::string::npos) << soft;
  EXPECT_EQ(soft.find(" 256 "), std::string::npos) << soft;
}

TEST_F(DaemonTest, SighupChangesAQuotaInPlaceInAnotherProcesssMapping) {
  write_config(config(run_dir_, "0.5"));
  daemon_ = start_daemon();
  ledger::TenantLedger alice = map_tenant("alice");  // mapped before the reload, kept across it
  const auto g = [&] { return entry(alice, 0); };
  ASSERT_EQ(g().memory_quota, 8 * kGiB);
  const uint64_t generation = alice.node->committed.load();

  write_config(config(run_dir_, "0.25"));
  ASSERT_EQ(kill(daemon_, SIGHUP), 0);
  EXPECT_TRUE(eventually([&] { return g().memory_quota == 4 * kGiB; })) << read_file(log_path_);
  EXPECT_EQ(g().share_ppm, 250'000u);
  EXPECT_EQ(g().state, ledger::kGpuGranted);
  EXPECT_GT(alice.node->committed.load(), generation);
  ledger::close_ledger(&alice);
}

TEST_F(DaemonTest, LoweringAQuotaBelowUseFreesNothing) {
  write_config(config(run_dir_, "0.5"));
  daemon_ = start_daemon();
  const pid_t worker = spawn_tenant_process(tenant_dir("alice"), 0, 6 * kGiB);
  ASSERT_GT(worker, 0);
  children_.push_back(worker);
  ledger::TenantLedger alice = map_tenant("alice");
  write_config(config(run_dir_, "0.25"));
  kill(daemon_, SIGHUP);
  ASSERT_TRUE(eventually([&] { return entry(alice, 0).memory_quota == 4 * kGiB; }));
  std::this_thread::sleep_for(200ms);  // several reap passes
  EXPECT_EQ(ledger::tenant_used(*alice.usage, 0), 6 * kGiB);
  EXPECT_EQ(waitpid(worker, nullptr, WNOHANG), 0) << "the tenant process must keep running";
  ledger::close_ledger(&alice);
}

TEST_F(DaemonTest, InvalidReloadKeepsTheOldPolicy) {
  write_config(config(run_dir_, "0.5"));
  daemon_ = start_daemon();
  ledger::TenantLedger alice = map_tenant("alice");
  const uint64_t generation = alice.node->committed.load();

  write_config(config(run_dir_, "0.25") + "[[tenant]]\nname = \"carol\"\ngpus = 0.8\nmemroy = 1\n");
  kill(daemon_, SIGHUP);
  ASSERT_TRUE(eventually([&] { return log_contains("reload rejected"); })) << read_file(log_path_);
  EXPECT_TRUE(log_contains("fracgpud.toml:19: tenant \"carol\": unknown key \"memroy\""));
  EXPECT_TRUE(log_contains("cannot place gpus = 0.8"));  // every error, not only the first
  EXPECT_EQ(entry(alice, 0).memory_quota, 8 * kGiB);
  EXPECT_EQ(alice.node->committed.load(), generation);
  EXPECT_FALSE(fs::exists(tenant_dir("carol")));
  EXPECT_EQ(waitpid(daemon_, nullptr, WNOHANG), 0) << "the daemon must keep running";

  // A good config afterwards is applied as usual.
  write_config(config(run_dir_, "0.25"));
  kill(daemon_, SIGHUP);
  EXPECT_TRUE(eventually([&] { return entry(alice, 0).memory_quota == 4 * kGiB; }));
  ledger::close_ledger(&alice);
}

TEST_F(DaemonTest, RemovedTenantIsRevokedAndItsDirectoryKept) {
  write_config(config(run_dir_, "0.5"));
  daemon_ = start_daemon();
  ledger::TenantLedger bob = map_tenant("bob");
  write_config(config(run_dir_, "0.5", /*with_bob=*/false));
  kill(daemon_, SIGHUP);
  EXPECT_TRUE(eventually([&] { return entry(bob, 0).state == ledger::kGpuRevoked; }));
  EXPECT_TRUE(fs::exists(tenant_dir("bob") + "/policy"));
  EXPECT_TRUE(fs::exists(tenant_dir("bob") + "/usage"));
  // Back in the config: the same entry is granted again.
  write_config(config(run_dir_, "0.5"));
  kill(daemon_, SIGHUP);
  EXPECT_TRUE(eventually([&] { return entry(bob, 0).state == ledger::kGpuGranted; }));
  ledger::close_ledger(&bob);
}

TEST_F(DaemonTest, KilledProcessIsReclaimedWithinASecond) {
  write_config(config(run_dir_, "0.5"));
  daemon_ = start_daemon();
  ledger::TenantLedger alice = map_tenant("alice");
  const pid_t worker = spawn_tenant_process(tenant_dir("alice"), 0, 1 * kGiB);
  ASSERT_GT(worker, 0);
  ASSERT_EQ(ledger::tenant_used(*alice.usage, 0), 1 * kGiB);

  kill_and_reap(worker);
  const auto killed = std::chrono::steady_clock::now();
  ASSERT_TRUE(eventually([&] { return ledger::tenant_used(*alice.usage, 0) == 0; }, 3s));
  EXPECT_LT(std::chrono::steady_clock::now() - killed, 1s);
  // The reclaim clears the charges, then frees the slot: the test may look
  // in between.
  EXPECT_TRUE(eventually([&] { return alice.usage->slots[0].state.load() == ledger::kSlotFree; }, 1s));
  EXPECT_TRUE(eventually([&] { return log_contains("reclaimed slot 0 of dead process"); }));
  EXPECT_TRUE(log_contains("(trainer): 1 GiB released"));
  ledger::close_ledger(&alice);
}

TEST_F(DaemonTest, RestartAfterSigkillReadoptsLedgersAndKeepsLiveCharges) {
  write_config(config(run_dir_, "0.5"));
  daemon_ = start_daemon();
  const pid_t worker = spawn_tenant_process(tenant_dir("alice"), 0, 3 * kGiB);
  ASSERT_GT(worker, 0);
  children_.push_back(worker);
  ledger::TenantLedger alice = map_tenant("alice");
  const uint64_t generation = alice.node->committed.load();

  kill_and_reap(daemon_);
  daemon_ = start_daemon();
  EXPECT_EQ(alice.policy->daemon_pid.load(), daemon_);
  EXPECT_EQ(entry(alice, 0).memory_quota, 8 * kGiB);
  EXPECT_EQ(alice.node->committed.load(), generation) << "re-adopting an unchanged policy must not rewrite it";
  std::this_thread::sleep_for(200ms);  // several reap passes of the new daemon
  EXPECT_EQ(ledger::tenant_used(*alice.usage, 0), 3 * kGiB);
  EXPECT_EQ(alice.usage->slots[0].state.load(), ledger::kSlotLive);
  EXPECT_EQ(ledger::slot_owner_pid(alice, 0), worker);
  EXPECT_TRUE(log_contains("started"));

  // The new daemon reaps what the old one left.
  kill_and_reap(worker);
  EXPECT_TRUE(eventually([&] { return ledger::tenant_used(*alice.usage, 0) == 0; }, 1s));
  ledger::close_ledger(&alice);
}

TEST_F(DaemonTest, CorruptLedgersAreLeftAloneAndReported) {
  // carol: a policy file of the right size with someone else's bytes;
  // dave: a policy file of the wrong size.
  const std::string garbage(sizeof(ledger::PolicySegment), '\xab');
  write_file(tenant_dir("carol") + "/policy", garbage);
  write_file(tenant_dir("dave") + "/policy", "not a ledger");
  write_config(config(run_dir_, "0.25") + "[[tenant]]\nname = \"carol\"\ngpus = 0.25\n" +
               "[[tenant]]\nname = \"dave\"\ngpus = 0.25\n");
  daemon_ = start_daemon();  // alice is served regardless
  EXPECT_TRUE(eventually([&] { return log_contains("tenant \"dave\": ledger left alone"); }));
  EXPECT_TRUE(log_contains("tenant \"carol\": ledger left alone and tenant skipped (foreign segment)"));
  EXPECT_TRUE(log_contains(tenant_dir("carol") + "/policy"));
  EXPECT_EQ(read_file(tenant_dir("carol") + "/policy"), garbage);
  EXPECT_EQ(read_file(tenant_dir("dave") + "/policy"), "not a ledger");
  EXPECT_FALSE(fs::exists(tenant_dir("carol") + "/usage"));
  // Still left alone after a reload, and the daemon keeps serving.
  kill(daemon_, SIGHUP);
  EXPECT_TRUE(eventually([&] { return log_contains("reload applied"); }));
  EXPECT_EQ(read_file(tenant_dir("carol") + "/policy"), garbage);
  EXPECT_EQ(waitpid(daemon_, nullptr, WNOHANG), 0);
}

TEST_F(DaemonTest, SigtermExitsZeroAndLeavesTheLedgers) {
  write_config(config(run_dir_, "0.5"));
  daemon_ = start_daemon();
  ASSERT_EQ(kill(daemon_, SIGTERM), 0);
  EXPECT_EQ(wait_exit(daemon_), 0);
  daemon_ = -1;
  ledger::TenantLedger alice = map_tenant("alice");
  EXPECT_EQ(entry(alice, 0).state, ledger::kGpuGranted);  // tenants keep running
  EXPECT_EQ(alice.policy->daemon_pid.load(), 0);                        // a clean stop says so
  ledger::close_ledger(&alice);
  EXPECT_EQ(read_file(run_dir_ + "/fracgpud.pid"), "");
}

TEST_F(DaemonTest, SigintExitsZero) {
  write_config(config(run_dir_, "0.5"));
  daemon_ = start_daemon();
  kill(daemon_, SIGINT);
  EXPECT_EQ(wait_exit(daemon_), 0);
  daemon_ = -1;
}

TEST_F(DaemonTest, InvalidConfigAtStartExits2AndChangesNothing) {
  write_config(config(run_dir_, "1.5"));  // one GPU configured
  std::string output;
  EXPECT_EQ(run_daemon({}, &output), 2);
  EXPECT_NE(output.find(config_path_ + ":11: tenant \"alice\": devices lists 1 GPU(s) but gpus = 1.5"), std::string::npos)
      << output;
  EXPECT_NE(output.find("nothing was changed"), std::string::npos);
  EXPECT_FALSE(fs::exists(run_dir_));
}

TEST_F(DaemonTest, CheckValidatesWithoutTouchingAnything) {
  write_config(config(run_dir_, "0.5"));
  std::string output;
  EXPECT_EQ(run_daemon({"--check"}, &output), 0) << output;
  EXPECT_NE(output.find("valid (1 GPU(s), 2 tenant(s))"), std::string::npos) << output;
  EXPECT_NE(output.find("tenant \"alice\": GPU 0 (" + kUuid + "): share 0.5, limit 0.5, memory quota 8 GiB"), std::string::npos);
  EXPECT_FALSE(fs::exists(run_dir_));
  // A priority other than normal is printed after the tenant's name.
  write_config(config(run_dir_, "0.5") + "[[tenant]]\nname = \"carol\"\ngpus = 0.25\npriority = \"batch\"\n");
  EXPECT_EQ(run_daemon({"--check"}, &output), 0) << output;
  EXPECT_NE(output.find("tenant \"carol\" (batch): GPU 0 (" + kUuid + "): share 0.25"), std::string::npos) << output;
  EXPECT_NE(output.find("tenant \"alice\": GPU 0"), std::string::npos) << output;

  write_config(config(run_dir_, "0.5") + "[daemon]\n");  // a table defined twice
  EXPECT_EQ(run_daemon({"--check"}, &output), 1);
  EXPECT_NE(output.find(config_path_ + ":"), std::string::npos);
  EXPECT_NE(output.find("TOML syntax error"), std::string::npos) << output;
}

// Valid settings that work against each other are said, and the config
// still passes: a latency tenant under measured charging (NVML's samples
// charge it in lumps of ~1/6 s).
TEST_F(DaemonTest, CheckWarnsOfALatencyTenantUnderMeasuredCharging) {
  const std::string carol = "[[tenant]]\nname = \"carol\"\ngpus = 0.25\npriority = \"latency\"\n";
  std::string text = config(run_dir_, "0.5") + carol;
  std::string output;
  write_config(text);
  EXPECT_EQ(run_daemon({"--check"}, &output), 0) << output;
  EXPECT_EQ(output.find("warning: "), std::string::npos) << "held charging: nothing to warn of\n" << output;
  const std::string daemon_table = "reap_interval_ms = 50\n";
  text.replace(text.find(daemon_table), daemon_table.size(), daemon_table + "gpu_time_charging = \"measured\"\n");
  write_config(text);
  EXPECT_EQ(run_daemon({"--check"}, &output), 0) << output;
  EXPECT_NE(output.find("warning: tenant \"carol\" has priority = \"latency\" under gpu_time_charging = \"measured\""),
            std::string::npos)
      << output;
  EXPECT_EQ(output.find("tenant \"alice\" has priority"), std::string::npos) << "alice is normal";
}

TEST_F(DaemonTest, BadCommandLineIsAUsageError) {
  std::string output;
  EXPECT_EQ(run_daemon({"--log-level", "chatty"}, &output), 64);
  EXPECT_NE(output.find("not a log level"), std::string::npos);
  const pid_t pid = spawn({FRACGPUD_PATH}, tmp_ / "usage.log");
  EXPECT_EQ(wait_exit(pid), 64);
}

TEST_F(DaemonTest, SecondDaemonOnTheSameRunDirIsRefused) {
  write_config(config(run_dir_, "0.5"));
  daemon_ = start_daemon();
  std::string output;
  EXPECT_EQ(run_daemon({}, &output), 3);
  EXPECT_NE(output.find("another fracgpud (pid " + std::to_string(daemon_) + ") already manages"), std::string::npos)
      << output;
  EXPECT_EQ(std::stoi(read_file(run_dir_ + "/fracgpud.pid")), daemon_);
}

// A daemon whose run dir nobody else sees (a mount namespace of its own
// with a tmpfs over the run dir's parent, as systemd's PrivateTmp does to
// /tmp) says so at start: tenant processes would find no ledger there. The
// same daemon with PID 1's view says nothing of it. Both run in a PID
// namespace of their own, whose PID 1 (a shell) the test can read the root
// of, where a sandbox may hide the host's PID 1.
TEST_F(DaemonTest, ARunDirOnlyTheDaemonSeesIsReportedAtStart) {
  if (system("unshare -p -f -m --mount-proc --propagation private true 2>/dev/null") != 0)
    GTEST_SKIP() << "unshare -p -m is not permitted here: no namespaces to hide the run dir in";
  const std::string hidden = tmp_ / "hidden";
  fs::create_directories(hidden);
  write_config(config(hidden + "/run", "0.5"));
  const std::string alone = "is this daemon's alone";
  const auto start = [&](bool hide) {
    fs::remove(log_path_);
    const std::string daemon = std::string("exec ") + FRACGPUD_PATH + " --config " + config_path_;
    const std::string inner = hide ? "unshare -m --propagation private sh -c 'mount -t tmpfs fracgpu-test " + hidden +
                                         " && " + daemon + "'"
                                   : daemon;
    daemon_ = spawn({"/usr/bin/unshare", "-p", "-f", "-m", "--mount-proc", "--propagation", "private", "--kill-child",
                     "/bin/sh", "-c", inner + " & wait"},
                    log_path_);
    return eventually([&] { return log_contains("started: config"); });
  };
  ASSERT_TRUE(start(true)) << read_file(log_path_);
  EXPECT_TRUE(log_contains(alone)) << read_file(log_path_);
  EXPECT_FALSE(fs::exists(hidden + "/run")) << "the daemon's run dir is visible outside its namespace";
  kill_and_reap(daemon_);
  ASSERT_TRUE(start(false)) << read_file(log_path_);
  EXPECT_TRUE(eventually([&] { return fs::exists(hidden + "/run/tenants/alice/usage"); }));
  EXPECT_FALSE(log_contains(alone)) << read_file(log_path_);
}

// Any user of the host may open the run dir (0755) and hold a shared flock on
// it, or a read lock on the pid file (0644): neither may keep the daemon out.
// The lock is on the run dir's 0700 lock directory, which no other user can
// open.
TEST_F(DaemonTest, ALockOnTheRunDirItselfDoesNotKeepTheDaemonOut) {
  write_config(config(run_dir_, "0.5"));
  fs::create_directories(run_dir_);
  chmod(tmp_.path().c_str(), 0755);
  const int held = ::open(run_dir_.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  ASSERT_GE(held, 0);
  ASSERT_EQ(flock(held, LOCK_SH | LOCK_NB), 0);
  // The same with a read lock on the (0644) pid file: the daemon puts a new
  // file in its place.
  write_file(run_dir_ + "/fracgpud.pid", "");
  const int pid_file = ::open((run_dir_ + "/fracgpud.pid").c_str(), O_RDONLY | O_CLOEXEC);
  ASSERT_GE(pid_file, 0);
  struct flock read_lock {};
  read_lock.l_type = F_RDLCK;
  read_lock.l_whence = SEEK_SET;
  ASSERT_EQ(fcntl(pid_file, F_SETLK, &read_lock), 0);
  daemon_ = start_daemon();
  EXPECT_EQ(fs::status(run_dir_ + "/.lock").permissions(), static_cast<fs::perms>(0700));
  EXPECT_EQ(std::stoi(read_file(run_dir_ + "/fracgpud.pid")), daemon_);
  EXPECT_NE(read_file(log_path_).find("putting a new pid file in its place"), std::string::npos) << read_file(log_path_);
  ::close(pid_file);
  // Another user cannot open the lock directory, so cannot hold its lock.
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    if (setgid(65534) != 0 || setuid(65534) != 0) _exit(120);
    if (::open(run_dir_.c_str(), O_RDONLY | O_DIRECTORY) < 0) _exit(121);  // the run dir itself: open to all
    const int fd = ::open((run_dir_ + "/.lock").c_str(), O_RDONLY | O_DIRECTORY);
    _exit(fd < 0 && errno == EACCES ? 0 : 122);
  }
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "child status " << status;
  ::close(held);
}

// A write lock on the pid file takes the file open for writing, which only
// the daemon's user can do: that is a daemon (an older release's, which locked
// the run dir itself rather than .lock), and the start is refused.
TEST_F(DaemonTest, AWriteLockOnThePidFileIsTakenForAnotherDaemons) {
  write_config(config(run_dir_, "0.5"));
  fs::create_directories(run_dir_);
  write_file(run_dir_ + "/fracgpud.pid", "4242\n");
  // Held by a process of its own, as an older daemon would hold it.
  int ready[2];
  ASSERT_EQ(pipe(ready), 0);
  const pid_t holder = fork();
  ASSERT_GE(holder, 0);
  if (holder == 0) {
    const int fd = ::open((run_dir_ + "/fracgpud.pid").c_str(), O_RDWR);
    struct flock lock {};
    lock.l_type = F_WRLCK;
    lock.l_whence = SEEK_SET;
    const char ok = fd >= 0 && fcntl(fd, F_SETLK, &lock) == 0 ? 'y' : 'n';
    if (write(ready[1], &ok, 1) != 1) _exit(1);
    pause();
    _exit(0);
  }
  char ok = 0;
  ASSERT_EQ(read(ready[0], &ok, 1), 1);
  ASSERT_EQ(ok, 'y');
  std::string output;
  EXPECT_NE(run_daemon({}, &output), 0) << output;
  EXPECT_NE(output.find("another fracgpud (pid " + std::to_string(holder) + ") already manages"), std::string::npos)
      << output;
  EXPECT_EQ(read_file(run_dir_ + "/fracgpud.pid"), "4242\n") << "the pid file is left alone";
  kill_and_reap(holder);
  ::close(ready[0]);
  ::close(ready[1]);
}

TEST_F(DaemonTest, SecondDaemonIsRefusedEvenWithThePidFileRemoved) {
  // With metrics on: its child process must not be what holds the lock.
  write_config("[daemon]\nmetrics_address = \"127.0.0.1:0\"\n" + config(run_dir_, "0.5").substr(9));
  daemon_ = start_daemon();
  ASSERT_TRUE(eventually([&] { return logged_metrics_port(read_file(log_path_)) != 0; })) << read_file(log_path_);
  // The metrics child keeps no descriptor of the run dir: a copy of the
  // daemon's lock would outlive the daemon for as long as the child lives.
  const std::string children = read_file("/proc/" + std::to_string(daemon_) + "/task/" + std::to_string(daemon_) + "/children");
  ASSERT_FALSE(children.empty());
  const std::string child_proc = "/proc/" + std::to_string(std::stoi(children));
  // The child names itself only after closing what it inherited: until then
  // it may still hold copies of the daemon's descriptors (a race, not a leak).
  ASSERT_TRUE(eventually([&] { return read_file(child_proc + "/comm") == "fracgpud-metric\n"; }))
      << read_file(child_proc + "/comm");
  const std::string child_fds = child_proc + "/fd";
  size_t child_fd_count = 0;
  for (const auto& fd : fs::directory_iterator(child_fds)) {
    std::error_code ec;
    const fs::path target = fs::read_symlink(fd.path(), ec);
    EXPECT_NE(target, fs::path(run_dir_)) << "the metrics child holds " << fd.path();
    EXPECT_NE(target, fs::path(run_dir_) / ".lock") << "the metrics child holds " << fd.path();
    ++child_fd_count;
  }
  EXPECT_GT(child_fd_count, 0u);
  ASSERT_TRUE(fs::remove(run_dir_ + "/fracgpud.pid"));
  std::string output;
  EXPECT_EQ(run_daemon({}, &output), 3) << output;
  EXPECT_NE(output.find("another fracgpud (pid " + std::to_string(daemon_) + ") already manages " + run_dir_),
            std::string::npos)
      << output;
  // Refused before writing anything: no new pid file, the first daemon's policies untouched.
  EXPECT_FALSE(fs::exists(run_dir_ + "/fracgpud.pid"));
  ledger::TenantLedger alice = map_tenant("alice");
  EXPECT_EQ(alice.policy->daemon_pid.load(), daemon_);
  ledger::close_ledger(&alice);

  // Once the first daemon is gone (SIGKILL: nothing cleaned up), its metrics
  // child goes with it and the run dir is free at once.
  kill_and_reap(daemon_);
  daemon_ = -1;
  std::string second_log = tmp_ / "second.log";
  const pid_t second = spawn({FRACGPUD_PATH, "--config", config_path_}, second_log);
  EXPECT_TRUE(eventually([&] { return read_file(second_log).find("started") != std::string::npos; }))
      << read_file(second_log);
  daemon_ = second;
}

TEST_F(DaemonTest, NodeWithoutGpusGetsAClearMessage) {
  write_config(config(run_dir_, "0.5"));
  std::string output;
  EXPECT_EQ(run_daemon({"--check"}, &output, /*devices=*/""), 1);
  EXPECT_NE(output.find("GPU index 0 is not present on this node"), std::string::npos) << output;
}

// The node checks run only at the daemon's tick: a 250 ms memory audit at
// 200 ms ticks must still run every 250 ms on average (40 times in 10 s),
// not at every second tick (25, what `now + interval` gave); an interval
// shorter than the tick runs at every tick; one behind by more than an
// interval (a pass that took 1 s) runs again an interval after it.
TEST(NodeChecks, KeepTheirIntervalOnAverageAtTheDaemonsTick) {
  constexpr uint64_t kMs = 1'000'000;
  const auto runs = [](uint64_t tick, uint64_t interval, uint64_t span) {
    uint64_t due = 0, count = 0;
    for (uint64_t now = 5'000 * kMs; now < 5'000 * kMs + span; now += tick) {
      if (now < due) continue;
      ++count;
      due = controller::next_check_ns(due, now, interval);
    }
    return count;
  };
  EXPECT_EQ(runs(200 * kMs, 250 * kMs, 10'000 * kMs), 40u);
  EXPECT_EQ(runs(200 * kMs, 100 * kMs, 10'000 * kMs), 50u);
  EXPECT_EQ(runs(200 * kMs, 5'000 * kMs, 10'000 * kMs), 2u);
  EXPECT_EQ(controller::next_check_ns(1'000 * kMs, 2'000 * kMs, 250 * kMs), 2'250 * kMs);
}

TEST(Discovery, FindsTheSimulatedGpus) {
  setenv("SIMCUDA_DEVICES", kDevices.c_str(), 1);
  unsetenv("SIMCUDA_STATE");
  const controller::Discovery d = controller::discover_gpus(SIMCUDA_DIR "/libcuda.so.1");
  EXPECT_EQ(d.problem, "");
  ASSERT_EQ(d.gpus.size(), 2u);
  EXPECT_EQ(d.gpus[0].index, 0);
  EXPECT_EQ(d.gpus[0].uuid, kUuid);
  EXPECT_EQ(d.gpus[0].name, "Sim A");
  EXPECT_EQ(d.gpus[0].memory_bytes, 16 * kGiB);
  EXPECT_EQ(d.gpus[1].index, 1);
  EXPECT_EQ(d.gpus[1].uuid, kUuid2);
}

TEST(Discovery, MissingDriverIsAProblemNotACrash) {
  const controller::Discovery d = controller::discover_gpus("/nonexistent/libcuda.so.1");
  EXPECT_TRUE(d.gpus.empty());
  EXPECT_NE(d.problem.find("cannot load the CUDA driver (/nonexistent/libcuda.so.1)"), std::string::npos) << d.problem;
}

}  // namespace

namespace {

// What a host file is: its content, mode and owner.
struct FileFacts {
  std::string content;
  mode_t mode = 0;
  uid_t uid = 0;
  gid_t gid = 0;
  bool operator==(const FileFacts&) const = default;
};

FileFacts facts_of(const std::string& path) {
  struct stat st {};
  EXPECT_EQ(lstat(path.c_str(), &st), 0) << path;
  return {read_file(path), st.st_mode, st.st_uid, st.st_gid};
}

// `fracgpu status` with a deadline: its exit code (-1 if it hangs, then
// killed), output in *out.
int status_within(const std::string& run_dir, const std::string& log, std::string* out,
                  std::chrono::milliseconds deadline = 10s) {
  fs::remove(log);
  const pid_t pid = spawn_logged({FRACGPU_CLI_PATH, "status", "--run-dir", run_dir}, log, {});
  const int rc = wait_exit(pid, deadline);
  if (rc == -1) kill_and_reap(pid);
  *out = read_file(log);
  return rc;
}

// The config with a metrics endpoint on a free port (logged_metrics_port).
std::string with_metrics(std::string config) {
  return config.replace(config.find("[daemon]\n"), 9, "[daemon]\nmetrics_address = \"127.0.0.1:0\"\n");
}

size_t count_of(const std::string& text, const std::string& what) {
  size_t n = 0;
  for (size_t at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) ++n;
  return n;
}

}  // namespace

// A tenant that could write its directory (older recipes mounted it
// read-write) plants links and FIFOs under every name the daemon uses there,
// temporaries included, while the daemon is down. The next daemon changes no
// file outside the run dir, stays up, and `fracgpu status` still answers.
TEST_F(DaemonTest, LinksAndFifosPlantedInTenantDirsChangeNothingOutsideTheRunDir) {
  const std::string canary = tmp_ / "canary";
  write_file(canary, "a host file the tenant wants rewritten\n");
  ASSERT_EQ(chmod(canary.c_str(), 0640), 0);
  if (geteuid() == 0) {
    ASSERT_EQ(chown(canary.c_str(), 65534, 65534), 0);
  }
  const FileFacts before = facts_of(canary);
  write_config(with_metrics(config(run_dir_, "0.5")) + "[[tenant]]\nname = \"carol\"\nmemory = { \"0\" = \"1GiB\" }\n");
  for (const char* tenant : {"alice", "bob", "carol"}) fs::create_directories(tenant_dir(tenant));
  int gate[2];
  ASSERT_EQ(pipe(gate), 0);
  daemon_ = spawn({FRACGPUD_PATH, "--config", config_path_}, log_path_, kDevices, gate[0]);
  close(gate[0]);
  const std::string pid = std::to_string(daemon_);
  const auto plant_link = [&](const std::string& path) { EXPECT_EQ(symlink(canary.c_str(), path.c_str()), 0) << path; };
  const auto plant_fifo = [&](const std::string& path) { EXPECT_EQ(mkfifo(path.c_str(), 0666), 0) << path; };
  // alice: the temporaries of every file the daemon made there (named by
  // its pid), the GPU-time link and its temporary, the node link.
  for (const char* name : {"policy", "usage"}) plant_link(tenant_dir("alice") + "/" + name + ".tmp." + pid);
  plant_fifo(tenant_dir("alice") + "/gputime-0");
  plant_link(tenant_dir("alice") + "/gputime-0.tmp");
  plant_link(tenant_dir("alice") + "/node");
  // bob: a FIFO for a usage file; carol: links for both files.
  plant_fifo(tenant_dir("bob") + "/usage");
  plant_link(tenant_dir("carol") + "/policy");
  plant_link(tenant_dir("carol") + "/usage");
  ASSERT_EQ(write(gate[1], "g", 1), 1);
  close(gate[1]);
  wait_until_up(daemon_);

  EXPECT_EQ(facts_of(canary), before) << "a file outside the run dir was changed";
  EXPECT_EQ(waitpid(daemon_, nullptr, WNOHANG), 0) << "the daemon died:\n" << read_file(log_path_);
  // alice is served: her GPU-time link is the arbiter itself now.
  struct stat link {}, arbiter {};
  ASSERT_EQ(lstat((tenant_dir("alice") + "/gputime-0").c_str(), &link), 0);
  ASSERT_EQ(stat((run_dir_ + "/gpus/" + kUuid + "/gputime").c_str(), &arbiter), 0);
  EXPECT_TRUE(S_ISREG(link.st_mode));
  EXPECT_EQ(link.st_ino, arbiter.st_ino);
  // bob and carol are refused, and said so.
  EXPECT_TRUE(eventually([&] { return log_contains("tenant \"carol\": ledger left alone"); })) << read_file(log_path_);
  EXPECT_TRUE(log_contains(tenant_dir("bob") + "/usage: refused: not a regular file (a FIFO)"));
  EXPECT_TRUE(log_contains(tenant_dir("carol") + "/policy: refused: not a regular file (a symbolic link)"));
  std::string out;
  EXPECT_EQ(status_within(run_dir_, tmp_ / "status.log", &out), controller::kStatusBadLedger) << out;
  EXPECT_NE(out.find("  bob: " + tenant_dir("bob") + "/usage: refused: not a regular file (a FIFO)"),
            std::string::npos)
      << out;
  EXPECT_NE(out.find("alice"), std::string::npos) << out;
  uint16_t port = 0;
  ASSERT_TRUE(eventually([&] { return (port = logged_metrics_port(read_file(log_path_))) != 0; }));
  const std::string metrics = http_get(port, "/metrics");
  EXPECT_NE(metrics.find("fracgpu_tenant_ledger_readable{tenant=\"bob\"} 0"), std::string::npos) << metrics;
  EXPECT_NE(metrics.find("fracgpu_tenant_ledger_readable{tenant=\"alice\"} 1"), std::string::npos) << metrics;
  EXPECT_EQ(facts_of(canary), before);
}

// A tenant truncates its usage file under everyone's mappings. The daemon,
// `fracgpu status` and the metrics endpoint survive it, report the ledger
// corrupt, and recover when the file is restored.
TEST_F(DaemonTest, ATruncatedUsageFileIsReportedCorruptAndKillsNoOneOutsideTheTenant) {
  write_config(with_metrics(config(run_dir_, "0.5")));
  daemon_ = start_daemon();
  uint16_t port = 0;
  ASSERT_TRUE(eventually([&] { return (port = logged_metrics_port(read_file(log_path_))) != 0; }));
  const pid_t worker = keep_worker("alice", 1 * kGiB);
  const std::string usage = tenant_dir("alice") + "/usage";
  const std::string saved = read_file(usage);
  ASSERT_EQ(saved.size(), sizeof(ledger::UsageSegment));
  const std::string status_log = tmp_ / "status.log";
  std::string out;

  ASSERT_EQ(truncate(usage.c_str(), 0), 0);
  EXPECT_TRUE(eventually([&] { return log_contains("its ledger is corrupt"); })) << read_file(log_path_);
  EXPECT_EQ(status_within(run_dir_, status_log, &out), controller::kStatusBadLedger) << out;
  EXPECT_NE(out.find("alice: wrong size: " + usage + ": size is 0 bytes"), std::string::npos) << out;
  EXPECT_NE(http_get(port, "/metrics").find("fracgpu_tenant_ledger_readable{tenant=\"alice\"} 0"), std::string::npos);

  // Shrunk and restored over and over while everyone reads it. Restored
  // with every slot in use by a dead owner, so that each pass of the daemon
  // works through all of them (record locks, /proc) and a shrink lands in
  // the middle of its reading, past its size check.
  std::string busy = saved;
  const uint32_t all = ledger::kMaxSlots;
  memcpy(busy.data() + offsetof(ledger::UsageSegment, slot_high_water), &all, sizeof all);
  for (uint32_t slot = 1; slot < ledger::kMaxSlots; ++slot) {
    const uint32_t live = ledger::kSlotLive;
    const int32_t dead_pid = 0x7ffffff0;
    const size_t at = offsetof(ledger::UsageSegment, slots) + slot * sizeof(ledger::ProcessSlot);
    memcpy(busy.data() + at + offsetof(ledger::ProcessSlot, state), &live, sizeof live);
    memcpy(busy.data() + at + offsetof(ledger::ProcessSlot, pid), &dead_pid, sizeof dead_pid);
  }
  std::atomic<bool> stop{false};
  std::thread flipper([&] {
    const int fd = open(usage.c_str(), O_WRONLY);
    while (!stop.load()) {
      if (ftruncate(fd, 0) != 0 || pwrite(fd, busy.data(), busy.size(), 0) != static_cast<ssize_t>(busy.size())) break;
      std::this_thread::sleep_for(200us);
    }
    close(fd);
  });
  for (const auto until = std::chrono::steady_clock::now() + 2s; std::chrono::steady_clock::now() < until;) {
    const int rc = status_within(run_dir_, status_log, &out);
    EXPECT_TRUE(rc == controller::kStatusOk || rc == controller::kStatusBadLedger) << rc << "\n" << out;
    EXPECT_NE(http_get(port, "/metrics").find("fracgpu_daemon_up 1"), std::string::npos);
  }
  stop = true;
  flipper.join();
  EXPECT_EQ(waitpid(daemon_, nullptr, WNOHANG), 0) << "the daemon died:\n" << read_file(log_path_);
  EXPECT_NE(http_get(port, "/healthz").find("200 OK"), std::string::npos);
  EXPECT_FALSE(log_contains("metrics: the endpoint's process")) << read_file(log_path_);

  // Restored: valid again, and reclaiming resumes. (First let the daemon
  // take the file back after the flipping: it logs each change once.)
  ASSERT_TRUE(eventually([&] {
    const std::string log = read_file(log_path_);
    return count_of(log, "is valid again; reclaiming resumes") == count_of(log, "its ledger is corrupt");
  })) << read_file(log_path_);
  // Counted before the truncation: the daemon may log it before a count
  // taken after could see it.
  const size_t corrupt_before = count_of(read_file(log_path_), "its ledger is corrupt");
  ASSERT_EQ(truncate(usage.c_str(), 0), 0);
  ASSERT_TRUE(eventually([&] { return count_of(read_file(log_path_), "its ledger is corrupt") > corrupt_before; }))
      << read_file(log_path_);
  const size_t valid_before = count_of(read_file(log_path_), "is valid again; reclaiming resumes");
  {
    const int fd = open(usage.c_str(), O_WRONLY);
    ASSERT_GE(fd, 0);
    ASSERT_EQ(pwrite(fd, saved.data(), saved.size(), 0), static_cast<ssize_t>(saved.size()));
    close(fd);
  }
  EXPECT_TRUE(eventually([&] { return count_of(read_file(log_path_), "is valid again; reclaiming resumes") > valid_before; }));
  EXPECT_EQ(status_within(run_dir_, status_log, &out), controller::kStatusOk) << out;
  EXPECT_NE(http_get(port, "/metrics").find("fracgpu_tenant_ledger_readable{tenant=\"alice\"} 1"), std::string::npos);
  ledger::TenantLedger alice = map_tenant("alice");
  EXPECT_EQ(ledger::tenant_used(*alice.usage, 0), 1 * kGiB);
  kill_and_reap(worker);
  EXPECT_TRUE(eventually([&] { return ledger::tenant_used(*alice.usage, 0) == 0; }, 2s));
  ledger::close_ledger(&alice);
}

// A tenant writes past the end of its usage file (it can write the file:
// that is how it could fill the run dir's file system). The daemon cuts it
// back to the layout's size; nothing of the layout is lost.
TEST_F(DaemonTest, AUsageFileGrownTo100MBIsCutBack) {
  write_config(config(run_dir_, "0.5"));
  daemon_ = start_daemon();
  keep_worker("alice", 1 * kGiB);
  const std::string usage = tenant_dir("alice") + "/usage";
  const int fd = open(usage.c_str(), O_WRONLY);
  ASSERT_GE(fd, 0);
  const std::string chunk(1 << 20, 'x');
  for (off_t at = sizeof(ledger::UsageSegment); at < (100 << 20); at += static_cast<off_t>(chunk.size()))
    ASSERT_EQ(pwrite(fd, chunk.data(), chunk.size(), at), static_cast<ssize_t>(chunk.size()));
  close(fd);
  EXPECT_TRUE(eventually([&] { return fs::file_size(usage) == sizeof(ledger::UsageSegment); }))
      << fs::file_size(usage);
  // (Logged just after the cut.)
  EXPECT_TRUE(eventually([&] { return log_contains("tenant \"alice\": " + usage + " had grown to"); }))
      << read_file(log_path_);
  ledger::TenantLedger alice = map_tenant("alice");
  ASSERT_TRUE(alice.is_open());
  EXPECT_EQ(ledger::tenant_used(*alice.usage, 0), 1 * kGiB);
  EXPECT_EQ(alice.usage->header.magic, ledger::kUsageMagic);
  ledger::close_ledger(&alice);
}

// A tenant's root (the host's, without a user namespace) can change its
// usage file's mode: setuid and executable, the file it writes would be a
// program for the node's users. The daemon puts the mode back at its next
// pass, and the file stays the tenant's ledger.
TEST_F(DaemonTest, AUsageFileMadeSetuidGetsItsModeBack) {
  write_config(config(run_dir_, "0.5"));
  daemon_ = start_daemon();
  keep_worker("alice", 1 * kGiB);
  const std::string usage = tenant_dir("alice") + "/usage";
  ASSERT_EQ(chmod(usage.c_str(), 04777), 0);
  const auto mode = [&] {
    struct stat st {};
    return stat(usage.c_str(), &st) == 0 ? st.st_mode & 07777 : 0u;
  };
  EXPECT_TRUE(eventually([&] { return mode() == 0666; })) << std::oct << mode();
  // (4777, or 0777 where a write by one without CAP_FSETID cleared the bit.)
  EXPECT_TRUE(eventually([&] {
    return log_contains("tenant \"alice\": " + usage + " had mode ") && log_contains("7: set back to 0666");
  })) << read_file(log_path_);
  ledger::TenantLedger alice = map_tenant("alice");
  ASSERT_TRUE(alice.is_open());
  EXPECT_EQ(ledger::tenant_used(*alice.usage, 0), 1 * kGiB);
  ledger::close_ledger(&alice);
}

// The run dir holds every tenant's policy: a run dir others may write, or
// that is not the daemon's, is refused at start, with a message that says
// what to do. Directories the daemon makes in it get their modes back.
TEST_F(DaemonTest, ARunDirOthersMayWriteIsRefused) {
  write_config(config(run_dir_, "0.5"));
  fs::create_directories(run_dir_);
  std::string output;
  ASSERT_EQ(chmod(run_dir_.c_str(), 0777), 0);
  EXPECT_EQ(run_daemon({}, &output), 3);
  EXPECT_NE(output.find("run dir refused: " + run_dir_ + ": refused: writable by every user (mode 0777)"),
            std::string::npos)
      << output;
  EXPECT_NE(output.find("chmod 755"), std::string::npos) << output;
  ASSERT_EQ(chmod(run_dir_.c_str(), 0775), 0);
  EXPECT_EQ(run_daemon({}, &output), 3);
  EXPECT_NE(output.find("writable by its group (mode 0775)"), std::string::npos) << output;
  EXPECT_FALSE(fs::exists(run_dir_ + "/tenants"));
  ASSERT_EQ(chmod(run_dir_.c_str(), 0755), 0);
  if (geteuid() == 0) {
    ASSERT_EQ(chown(run_dir_.c_str(), 65534, 65534), 0);
    EXPECT_EQ(run_daemon({}, &output), 3);
    EXPECT_NE(output.find("refused: owned by uid 65534, expected uid 0"), std::string::npos) << output;
    ASSERT_EQ(chown(run_dir_.c_str(), 0, 0), 0);
  }
  fs::create_directories(tenant_dir("alice"));
  ASSERT_EQ(chmod((run_dir_ + "/tenants").c_str(), 0777), 0);
  ASSERT_EQ(chmod(tenant_dir("alice").c_str(), 0777), 0);
  daemon_ = start_daemon();
  EXPECT_TRUE(log_contains(run_dir_ + "/tenants: mode set to 0755")) << read_file(log_path_);
  EXPECT_TRUE(log_contains(tenant_dir("alice") + " was writable by others: its mode is 0755 again"));
  EXPECT_EQ(fs::status(run_dir_ + "/tenants").permissions(), static_cast<fs::perms>(0755));
  EXPECT_EQ(fs::status(tenant_dir("alice")).permissions(), static_cast<fs::perms>(0755));
  EXPECT_EQ(fs::status(run_dir_ + "/.tmp").permissions(), static_cast<fs::perms>(0700));
}

// The run dir's file system fills up (a tenant could do it through the one
// file it may write, until the daemon cuts it back). Stores through the
// ledgers' mappings cannot fault then: the files' blocks were reserved when
// they were made. The daemon's own files are replaced whole or not at all.
TEST_F(DaemonTest, AFullRunDirFileSystemFaultsNoMappingAndKeepsTheDaemonsFiles) {
  fs::create_directories(run_dir_);
  if (mount("tmpfs", run_dir_.c_str(), "tmpfs", 0, "size=1m,mode=0755") != 0)
    GTEST_SKIP() << "cannot mount a tmpfs here: " << strerror(errno);
  struct Unmount {
    std::string path;
    ~Unmount() { umount2(path.c_str(), MNT_DETACH); }
  } unmount{run_dir_};
  write_config(config(run_dir_, "0.5"));
  daemon_ = start_daemon();
  const std::string placement = read_file(run_dir_ + "/placement.json");
  ASSERT_NE(placement, "");
  {
    const int fd = open((run_dir_ + "/filler").c_str(), O_WRONLY | O_CREAT, 0600);
    const std::string chunk(4096, 'f');
    while (write(fd, chunk.data(), chunk.size()) > 0) {
    }
    EXPECT_EQ(errno, ENOSPC);
    close(fd);
  }
  // bob's usage file was never written past its header: its first charge
  // lands on a page nothing touched before.
  const pid_t worker = keep_worker("bob", 1 * kGiB, "bobs");  // (a SIGBUS would kill it charging)
  // A reload writes placement.json: it cannot, says so, keeps the old one.
  write_config(config(run_dir_, "0.25"));
  kill(daemon_, SIGHUP);
  EXPECT_TRUE(eventually([&] { return log_contains("reload applied"); })) << read_file(log_path_);
  EXPECT_TRUE(log_contains("cannot write " + run_dir_ + "/placement.json: "));
  EXPECT_TRUE(log_contains("the previous version (if any) is kept"));
  EXPECT_EQ(read_file(run_dir_ + "/placement.json"), placement);
  EXPECT_TRUE(fs::is_empty(run_dir_ + "/.tmp"));
  // The daemon still reclaims (stores into the mapping) and runs on.
  ledger::TenantLedger bob = map_tenant("bob");
  EXPECT_EQ(ledger::tenant_used(*bob.usage, 0), 1 * kGiB);
  kill_and_reap(worker);
  EXPECT_TRUE(eventually([&] { return ledger::tenant_used(*bob.usage, 0) == 0; }, 2s));
  ledger::close_ledger(&bob);
  EXPECT_EQ(waitpid(daemon_, nullptr, WNOHANG), 0) << read_file(log_path_);
}
