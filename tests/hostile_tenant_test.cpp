// The hostile-tenant test (docs/security.md): two tenants share a GPU, half
// each. The honest one runs a GPU-time load and, at the end, takes its whole
// memory quota. The hostile one runs in a container's view of the node and,
// for the length of the honest load, attacks everything it can reach
// (tests/probe/hostile_tenant.cpp), competes for the GPU, and cheats on
// memory, while the test reloads the daemon and kills and restarts it.
//
// The container's view, when the machine lets this test make mount
// namespaces (it runs as root): a private mount and PID namespace in which
// the tenant's directory is mounted read-only, its usage file read-write,
// and everything else of the test's (run dir, config, canaries, logs)
// hidden under an empty tmpfs, run with CAP_SYS_ADMIN and CAP_SYS_PTRACE
// dropped from the bounding set (as a container runtime does). The run dir
// itself is a 64 MiB tmpfs, so "fill the filesystem" is real. Without mount
// namespaces the test is skipped: the same files with the same modes are
// no test of a root tenant (root ignores modes).
//
// Asserted: no file outside the hostile tenant's directory changes (canaries:
// content, mode, owner) and nothing was planted; the honest load never dies
// and never stalls much beyond a hand-over; its GPU-time share over the attack
// stays within 5 points of 0.5; its whole memory quota is obtainable at the
// end; the hostile memory cheat is stopped within 2 s; the daemon stays up;
// `fracgpu status` answers throughout.
#include <dlfcn.h>
#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "controller_test_util.h"

namespace fs = std::filesystem;
using namespace std::chrono_literals;
using fracgpu::testing::eventually;
using fracgpu::testing::kill_and_reap;
using fracgpu::testing::read_file;
using fracgpu::testing::spawn_logged;
using fracgpu::testing::wait_exit;
using fracgpu::testing::write_file;

namespace {

constexpr const char* kUuid = "GPU-0badc0de-0000-4000-8000-000000000001";

// The number after "key=" in a program's output, or -1.
long long value_of(const std::string& out, const std::string& key) {
  const size_t at = out.find(key + "=");
  return at == std::string::npos ? -1 : atoll(out.c_str() + at + key.size() + 1);
}

struct Canary {
  std::string path, content;
  mode_t mode = 0;
};

// The simulated driver's own record of who ran on each GPU, read in the
// test's process (the independent measure): open while it lives.
class SimRecord {
 public:
  SimRecord() : handle_(dlopen((std::string(SIMCUDA_DIR) + "/libcuda.so.1").c_str(), RTLD_NOW | RTLD_LOCAL)) {
    if (handle_ == nullptr) {
      error_ = dlerror();
      return;
    }
    busy_ns_ = reinterpret_cast<uint64_t (*)(int, int)>(dlsym(handle_, "simcuda_busy_ns"));
    device_busy_ns_ = reinterpret_cast<uint64_t (*)(int)>(dlsym(handle_, "simcuda_device_busy_ns"));
    if (busy_ns_ == nullptr || device_busy_ns_ == nullptr) error_ = "no simcuda_busy_ns or simcuda_device_busy_ns";
  }
  ~SimRecord() {
    if (handle_ != nullptr) dlclose(handle_);
  }
  SimRecord(const SimRecord&) = delete;
  SimRecord& operator=(const SimRecord&) = delete;
  bool ok() const { return error_.empty(); }
  const std::string& error() const { return error_; }
  // GPU time of process `pid` on `device`, and of everyone on it.
  uint64_t busy_ns(int device, pid_t pid) const { return busy_ns_(device, pid); }
  uint64_t device_busy_ns(int device) const { return device_busy_ns_(device); }

 private:
  void* handle_;
  uint64_t (*busy_ns_)(int, int) = nullptr;
  uint64_t (*device_busy_ns_)(int) = nullptr;
  std::string error_;
};

class HostileTenantTest : public ::testing::Test {
 protected:
  void SetUp() override {
    // A mount namespace of the test's own: the tmpfs run dir and the
    // container mounts below vanish with it.
    if (unshare(CLONE_NEWNS) != 0 || mount(nullptr, "/", nullptr, MS_REC | MS_PRIVATE, nullptr) != 0)
      GTEST_SKIP() << "no private mount namespace here (" << strerror(errno)
                   << "): a root tenant's container view cannot be made, and modes alone do not stop root";
    char tmpl[] = "/tmp/fracgpu-hostile-XXXXXX";
    ASSERT_NE(mkdtemp(tmpl), nullptr);
    root_ = tmpl;
    run_dir_ = root_ + "/run";
    fs::create_directories(run_dir_);
    ASSERT_EQ(mount("tmpfs", run_dir_.c_str(), "tmpfs", 0, "size=64m,mode=0755"), 0) << strerror(errno);
    char ctr[] = "/tmp/fracgpu-container-XXXXXX";
    ASSERT_NE(mkdtemp(ctr), nullptr);
    container_ = ctr;
    sim_state_ = container_ + ".sim-state";
    devices_ = std::string("uuid=") + kUuid + ",name=Sim,mem=16GiB,ctx=64MiB,sms=100";
    // Canaries: files a symlink planted by the tenant could make a root
    // daemon truncate, chmod or overwrite.
    for (const std::string& path : {root_ + "/canary", run_dir_ + "/canary"}) {
      write_file(path, "precious " + path + "\n");
      chmod(path.c_str(), 0600);
      canaries_.push_back({path, read_file(path), 0600});
    }
    config_ = root_ + "/fracgpud.toml";
    write_config("0.5");
  }

  void TearDown() override {
    for (pid_t pid : children_) kill_and_reap(pid);
    kill_and_reap(daemon_);
    if (!run_dir_.empty()) umount2(run_dir_.c_str(), MNT_DETACH);
    std::error_code ec;
    if (!root_.empty()) fs::remove_all(root_, ec);
    if (!container_.empty()) fs::remove_all(container_, ec);
    fs::remove(sim_state_, ec);
  }

  void write_config(const std::string& honest_gpus, const std::string& mallory_extra = "") {
    write_file(config_, "[daemon]\nrun_dir = \"" + run_dir_ +
                            "\"\nreap_interval_ms = 50\nmetrics_address = \"off\"\n"
                            "audit_interval = \"100ms\"\nmemory_audit_interval = \"100ms\"\n"
                            "memory_grace = \"500ms\"\nmemory_tolerance = \"128MiB\"\n"
                            "[[gpu]]\nuuid = \"" + kUuid + "\"\ncontext_memory = \"64MiB\"\n"
                            "[[tenant]]\nname = \"alice\"\ngpus = " + honest_gpus + "\ndevices = [0]\n"
                            "[[tenant]]\nname = \"mallory\"\ngpus = 0.5\ndevices = [0]\n" + mallory_extra);
  }

  std::vector<std::string> env(bool nvml) const {
    std::vector<std::string> e = {"LD_LIBRARY_PATH=" + std::string(nvml ? SIMNVML_DIR ":" : "") + SIMCUDA_DIR,
                                  "SIMCUDA_STATE=" + sim_state_, "SIMCUDA_DEVICES=" + devices_,
                                  "FRACGPU_RUN_DIR=" + run_dir_, "LD_PRELOAD", "FRACGPU_TENANT", "FRACGPU_TENANT_DIR"};
    if (!sched_.empty()) e.push_back("SIMCUDA_SCHED=" + sched_);
    // The daemon's NVML samples like the real one's when a test asks.
    if (nvml && !sample_ms_.empty()) {
      e.push_back("SIMNVML_SAMPLE_MS=" + sample_ms_);
      e.push_back("SIMNVML_ATTRIB=instant");
    }
    return e;
  }

  void start_daemon() {
    daemon_ = spawn_logged({FRACGPUD_PATH, "--config", config_}, root_ + "/daemon.log", env(true));
    // This daemon's own line: the log holds its predecessors' too.
    const std::string started = "fracgpud " + std::to_string(daemon_) + " started";
    ASSERT_TRUE(eventually([&] { return fs::exists(run_dir_ + "/tenants/mallory/gputime-0") && daemon_log_has(started); },
                           10s))
        << daemon_log();
  }
  std::string daemon_log() const { return read_file(root_ + "/daemon.log"); }
  bool daemon_log_has(const std::string& text) const { return daemon_log().find(text) != std::string::npos; }
  bool daemon_alive() const { return daemon_ > 0 && waitpid(daemon_, nullptr, WNOHANG) == 0; }

  pid_t spawn(const std::vector<std::string>& args, const std::string& log, std::vector<std::string> extra) {
    std::vector<std::string> e = env(false);
    e.insert(e.end(), extra.begin(), extra.end());
    const pid_t pid = spawn_logged(args, log, e);
    children_.push_back(pid);
    return pid;
  }

  // The hostile tenant's container: runs `script` (sh) with its tenant
  // directory at $T, nothing else of the test's visible, no CAP_SYS_ADMIN.
  pid_t start_container(const std::string& script, const std::string& log) {
    const std::string tenant = run_dir_ + "/tenants/mallory";
    const std::string t = container_ + "/tenant";
    fs::create_directories(t);
    // Mounts first (with every privilege), then hide the test's files, then
    // drop what a container runtime drops and run the tenant's programs.
    const std::string setup =
        "set -e; mount --bind '" + tenant + "' '" + t + "'; mount -o remount,bind,ro '" + t + "'; " +
        "mount --bind '" + tenant + "/usage' '" + t + "/usage'; mount -t tmpfs -o size=1m tmpfs '" + root_ + "'; " +
        "export T='" + t + "' FRACGPU_TENANT_DIR='" + t + "'; " +
        "exec setpriv --bounding-set -sys_admin,-sys_ptrace,-sys_module,-sys_rawio,-mknod -- /bin/sh -c '" + script +
        "'";
    return spawn({"/usr/bin/unshare", "--mount", "--pid", "--fork", "--kill-child", "--mount-proc", "--propagation", "private",
                  "/bin/sh", "-c", setup},
                 log, {});
  }

  std::string status_output() {
    const std::string log = container_ + "/status.out";
    fs::remove(log);
    const pid_t pid = spawn_logged({FRACGPU_CLI_PATH, "status", "--run-dir", run_dir_}, log, env(false));
    const int rc = wait_exit(pid, 5s);
    if (rc == -1) {
      kill_and_reap(pid);
      return "(status hung)";
    }
    // 2: some ledger is unreadable (the hostile tenant's, while it is cut
    // short): status says so, and still shows the rest.
    return rc == 0 || rc == 2 ? read_file(log) : "(status failed: " + std::to_string(rc) + ")\n" + read_file(log);
  }
  // Status answered, and showed the honest tenant.
  bool status_answers() {
    const std::string out = status_output();
    const bool ok = out.find("(status") == std::string::npos && out.find("alice") != std::string::npos;
    if (!ok) ADD_FAILURE() << "fracgpu status: " << out;
    return ok;
  }

  // This process's simulated driver (SimRecord) on the tests' devices and
  // state, with the model they run.
  void use_sim_state() const {
    setenv("SIMCUDA_STATE", sim_state_.c_str(), 1);
    setenv("SIMCUDA_DEVICES", devices_.c_str(), 1);
    if (sched_.empty()) unsetenv("SIMCUDA_SCHED");
    else setenv("SIMCUDA_SCHED", sched_.c_str(), 1);
  }

  // GPU time, for the GPU-time cheats: the honest tenant runs one load of
  // 1 ms kernels for `seconds` while the hostile one runs `script` in its
  // container; returns the honest tenant's share of the GPU and the GPU's
  // busy time (everyone's) over the last `seconds` - 2 of it. `interposed`
  // false: the honest load runs without fracgpu's interposer (what it gets
  // without fracgpu, with `script` run without it too).
  std::pair<double, double> honest_beside(const std::string& script, double seconds, bool interposed = true) {
    use_sim_state();
    const SimRecord sim;
    EXPECT_TRUE(sim.ok()) << sim.error();
    if (!sim.ok()) return {0, 0};
    const pid_t mallory = start_container(script, container_ + "/container.log");
    const std::string preload = std::string("LD_PRELOAD=") + FRACGPU_LIB;
    const pid_t honest = spawn({LOAD_PATH, "devices=0", "kernels_us=1000", "seconds=" + std::to_string(seconds)},
                               root_ + "/honest.out", {interposed ? preload : "LD_PRELOAD", "FRACGPU_TENANT=alice"});
    std::this_thread::sleep_for(2s);
    const auto t0 = std::chrono::steady_clock::now();
    const uint64_t h0 = sim.busy_ns(0, honest), d0 = sim.device_busy_ns(0);
    std::this_thread::sleep_for(std::chrono::duration<double>(seconds - 2.5));
    const double wall = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() * 1e9;
    const double share = static_cast<double>(sim.busy_ns(0, honest) - h0) / wall;
    const double busy = static_cast<double>(sim.device_busy_ns(0) - d0) / wall;
    EXPECT_EQ(wait_exit(honest, 20s), 0) << read_file(root_ + "/honest.out");
    kill_and_reap(mallory);
    return {share, busy};
  }

  // The hostile tenant's script: a load of 1 ms kernels through the
  // interposer (without it, for the pair without fracgpu) and `attack` beside
  // it, for `seconds` (and one more, so the load outlasts the judged span).
  static std::string load_beside(const std::string& attack, double seconds, bool interposed) {
    const std::string load = std::string(LOAD_PATH) + " devices=0 kernels_us=1000 seconds=" + std::to_string(seconds + 1);
    return "( " + std::string(interposed ? "LD_PRELOAD=" FRACGPU_LIB " " : "") + load + " ) & " + attack + "; wait";
  }

  std::string root_, run_dir_, container_, sim_state_, devices_, config_, sample_ms_;
  std::string sched_;  // the simulated driver's model (SIMCUDA_SCHED) for every process; "": its default
  std::vector<Canary> canaries_;
  std::vector<pid_t> children_;
  pid_t daemon_ = -1;
};

TEST_F(HostileTenantTest, AHostileTenantHurtsNobodyButItself) {
  start_daemon();
  // The sim's own record of who ran on the GPU: the independent measure.
  use_sim_state();
  const SimRecord sim;
  ASSERT_TRUE(sim.ok()) << sim.error();

  constexpr double kSeconds = 8;
  // The hostile tenant: a competing GPU-time load (restarted when its own
  // attacks kill it), a memory cheat that wipes its charges to hold 10 GiB
  // of an 8 GiB quota, and the file attacks.
  const std::string preload = std::string("LD_PRELOAD=") + FRACGPU_LIB;
  const std::string load = std::string(LOAD_PATH) + " devices=0 kernels_us=1000 seconds=1";
  const std::string script =
      "end=$(($(date +%s) + " + std::to_string(static_cast<int>(kSeconds) + 1) + ")); "
      "( " + preload + " " + PROBE_PATH + " init primary 0 alloc 4GiB zero-charges alloc 4GiB zero-charges "
      "alloc 2GiB zero-charges hold > " + container_ + "/cheat.log 2>&1 ) & "
      "until grep -q holding= " + container_ + "/cheat.log; do sleep 0.05; done; "
      "( while [ $(date +%s) -lt $end ]; do " + preload + " " + load + " >/dev/null 2>&1; sleep 0.05; done ) & "
      + HOSTILE_PATH + " $T " + std::to_string(kSeconds) + " 42 " + root_ + "/canary > " + container_ +
      "/hostile.out 2>&1; wait";
  const pid_t mallory = start_container(script, container_ + "/container.log");

  // The cheat: stopped within 2 s of holding what it should not.
  const std::string cheat_log = container_ + "/cheat.log";
  ASSERT_TRUE(eventually([&] { return read_file(cheat_log).find("holding=") != std::string::npos; }, 10s))
      << read_file(cheat_log) << read_file(container_ + "/container.log");
  const auto cheat_from = std::chrono::steady_clock::now();
  const pid_t cheat_pid = static_cast<pid_t>(value_of(read_file(cheat_log), "holding"));  // in its PID namespace
  (void)cheat_pid;
  EXPECT_TRUE(eventually([&] { return daemon_log_has("memory audit: tenant \"mallory\" over its quota"); }, 2s))
      << daemon_log();
  EXPECT_LE(std::chrono::steady_clock::now() - cheat_from, 2s);

  // The honest tenant's load, through the attack.
  const std::string honest_log = root_ + "/honest.out";
  const pid_t honest = spawn({LOAD_PATH, "devices=0", "kernels_us=1000", "seconds=" + std::to_string(kSeconds)},
                             honest_log, {preload, "FRACGPU_TENANT=alice"});
  const auto start = std::chrono::steady_clock::now();
  const uint64_t busy_before = sim.busy_ns(0, honest);

  // Meanwhile: a reload (with a change), a daemon SIGKILLed and restarted,
  // a reload back; status asked throughout.
  std::this_thread::sleep_for(1500ms);
  EXPECT_TRUE(status_answers());
  write_config("0.5\nlimit = 0.9");
  kill(daemon_, SIGHUP);
  std::this_thread::sleep_for(1500ms);
  EXPECT_TRUE(daemon_alive()) << daemon_log();
  kill_and_reap(daemon_);
  start_daemon();
  std::this_thread::sleep_for(1500ms);
  write_config("0.5");
  kill(daemon_, SIGHUP);
  EXPECT_TRUE(status_answers());

  // Sampled while the load lives: once it is gone, the sim may hand its
  // record to one of the many short-lived processes the attacker starts.
  uint64_t busy_last = busy_before;
  auto sampled_at = start;
  int status = 0;
  while (waitpid(honest, &status, WNOHANG) == 0) {
    const auto now = std::chrono::steady_clock::now();
    const uint64_t busy = sim.busy_ns(0, honest);
    if (busy >= busy_last) {
      busy_last = busy;
      sampled_at = now;
    }
    ASSERT_LT(now - start, 30s) << "the honest load hung";
    std::this_thread::sleep_for(50ms);
  }
  ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << read_file(honest_log);
  const double elapsed = std::chrono::duration<double>(sampled_at - start).count();
  const double share = static_cast<double>(busy_last - busy_before) / 1e9 / elapsed;
  const std::string out = read_file(honest_log);
  const long long step_max_us = value_of(out, "step_max_us");
  RecordProperty("honest_share_ppm", static_cast<int>(share * 1e6));
  RecordProperty("honest_step_max_us", static_cast<int>(step_max_us));
  printf("honest share %.3f over %.1f s, longest stall %lld us\n", share, elapsed, step_max_us);
  EXPECT_GE(share, 0.45) << "the honest tenant lost more than 5 points of its 0.5";
  EXPECT_GT(value_of(out, "launches_0"), 0);
  // A hand-over costs a slice (20 ms) and a drain; a daemon restart a moment
  // more. Anything past 200 ms beyond that is a stall the attack caused.
  EXPECT_LT(step_max_us, 250'000) << out;

  // The attacker's report; then its container goes (whatever of its own it
  // left hanging: that is its own business).
  ASSERT_TRUE(eventually([&] { return read_file(container_ + "/hostile.out").find("planted=") != std::string::npos; },
                         30s))
      << read_file(container_ + "/container.log");
  kill_and_reap(mallory);
  const std::string hostile = read_file(container_ + "/hostile.out");
  EXPECT_EQ(value_of(hostile, "planted"), 0) << hostile;
  EXPECT_GT(value_of(hostile, "truncate"), 0) << hostile;

  // The node: canaries untouched, nothing planted in the run dir, daemon up.
  for (const Canary& c : canaries_) {
    struct stat st {};
    ASSERT_EQ(lstat(c.path.c_str(), &st), 0) << c.path;
    EXPECT_TRUE(S_ISREG(st.st_mode)) << c.path;
    EXPECT_EQ(st.st_mode & 07777, c.mode) << c.path;
    EXPECT_EQ(st.st_uid, 0u) << c.path;
    EXPECT_EQ(read_file(c.path), c.content) << c.path;
  }
  for (const auto& entry : fs::recursive_directory_iterator(run_dir_)) {
    EXPECT_FALSE(entry.is_symlink()) << entry.path();
    // The one socket is the daemon's control API, where it makes it.
    const bool control_socket = entry.path() == fs::path(run_dir_) / "control.sock" && entry.is_socket();
    EXPECT_TRUE(entry.is_regular_file() || entry.is_directory() || control_socket) << entry.path();
  }
  EXPECT_TRUE(daemon_alive()) << daemon_log();

  // And the honest tenant's whole quota (8 GiB, one 64 MiB context) is there.
  const std::string quota_log = root_ + "/quota.out";
  const pid_t quota = spawn({PROBE_PATH, "init", "primary", "0", "alloc", "8128MiB"}, quota_log,
                            {preload, "FRACGPU_TENANT=alice"});
  EXPECT_EQ(wait_exit(quota, 10s), 0) << read_file(quota_log);
  EXPECT_NE(read_file(quota_log).find("alloc=0\n"), std::string::npos) << read_file(quota_log) << daemon_log();
  EXPECT_TRUE(status_answers());
}

// GPU time against a stand-in NVML that samples like the real one (every
// 167 ms, one process a sample): the hostile tenant's load stops launching
// 8 ms before each sampling instant and starts again 1 ms after, so no
// sample ever finds it. Held charging (the default) charges the time it
// holds the GPU, which such timing does not change.
TEST_F(HostileTenantTest, APhaseLockedTenantGetsNoMoreThanItsShare) {
  sample_ms_ = "167";
  start_daemon();
  const std::string preload = std::string("LD_PRELOAD=") + FRACGPU_LIB;
  const auto [honest, busy] = honest_beside(
      preload + " " + LOAD_PATH + " devices=0 kernels_us=2000 seconds=10 dodge_ms=167 guard_ms=8", 9);
  printf("phase-locked tenant beside an honest one: honest %.3f, the hostile %.3f, GPU busy %.3f\n", honest,
         busy - honest, busy);
  EXPECT_GE(honest, 0.48);
  EXPECT_LE(busy - honest, 0.52);
}

// The long kernel timed between samples: 1 ms after each sampling instant
// the hostile tenant takes a grant with a tiny kernel, then queues one
// kernel that ends 8 ms before the next instant, and waits for it. Its drain
// misses the deadline at every revocation; the samples always find the
// honest tenant, which holds the GPU while that kernel runs on. On the
// simulated driver's queue model (no compute preemption: the late kernel
// runs ahead of the honest tenant's work) that left the honest tenant 0.013
// of the GPU, the hostile one 0.977, when the holder paid for that time. A
// tenant past its drain deadline now pays for its late work until it
// reports the drain (docs/sm-time.md, "Drains"): 0.494 / 0.487 here; 0.499
// / 0.500 at 167 ms and 0.525 / 0.527 at 1 s samples; on the time-slice
// model 0.490 / 0.480, 0.496 / 0.464 and 0.483 / 0.484; capped at 0.1 (share
// 0.1 beside 0.9) it got 0.100 on the queue model, 0.090 on time slices.
TEST_F(HostileTenantTest, ALongKernelTimedBetweenSamplesGetsNoMoreThanItsShare) {
  sample_ms_ = "300";
  sched_ = "queue";
  start_daemon();
  const std::string preload = std::string("LD_PRELOAD=") + FRACGPU_LIB;
  const auto [honest, busy] =
      honest_beside(preload + " " + LOAD_PATH + " devices=0 kernels_us=50 seconds=13 timed_ms=300 guard_ms=8", 12);
  printf("long kernels timed between samples: honest %.3f, the hostile %.3f, GPU busy %.3f\n", honest, busy - honest,
         busy);
  EXPECT_GE(honest, 0.48);
  EXPECT_LE(busy - honest, 0.52);
}

// A latency tenant's priority buys latency, not time (docs/sm-time.md,
// "Latency tenants"): the hostile tenant is a latency tenant that asks for
// the GPU without pause, in two shapes at once: a process launching
// continuously and one whose short bursts come every 600 us (each a new
// ask, each taking the GPU from the honest tenant while it may). Beyond its
// share it counts as normal, and the honest tenant keeps its half.
TEST_F(HostileTenantTest, ALatencyTenantBurstingWithoutPauseGetsNoMoreThanItsShare) {
  sample_ms_ = "167";
  write_config("0.5", "priority = \"latency\"\n");
  start_daemon();
  const std::string preload = std::string("LD_PRELOAD=") + FRACGPU_LIB;
  // Each of the latency tenant's asks may take the GPU at once while it is
  // within its share, so the two tenants' lead swings by a few hundred ms:
  // over 6.5 s the honest tenant's share of the time used spread from 0.48
  // to 0.58. The window is 13.5 s, and the shares are of the time used
  // (each hand-over idles the GPU a moment, paid by both).
  const std::string steady = std::string(LOAD_PATH) + " devices=0 kernels_us=100 seconds=17";
  const std::string bursts = std::string(LOAD_PATH) + " devices=0 kernels_us=100 seconds=17 burst=4,600,100";
  const auto [honest, busy] = honest_beside("( " + preload + " " + steady + " ) & " + preload + " " + bursts + "; wait", 16);
  printf("a latency tenant bursting without pause: honest %.3f, the hostile %.3f, GPU busy %.3f\n", honest,
         busy - honest, busy);
  // Seen 0.515-0.550 of the time used, 0.49-0.53 with busy loops beside
  // it; once 0.418 on a loaded host, not seen again in 14 runs. One path to
  // such a drop is closed: a launch that lost its CPU after its marker had
  // that wait measured as GPU time (4 ms seen on a starved host), 8 ms of
  // which put the honest tenant on one launch at a time for 5 s
  // (interpose/launch_pacing.cpp, kMarkerLateNs). The target is 0.48; the
  // bound leaves room for the spread of a shared 2-core host.
  ASSERT_GT(busy, 0.9);
  EXPECT_GE(honest / busy, 0.45);
  EXPECT_LE((busy - honest) / busy, 0.55);
}

// The hostile tenant runs a process without the interposer beside one with
// it. The gate cannot stop it; the audit finds it in the samples, the
// kernel says whose container it is in, and its tenant is charged for it and
// yields: its gated process gets the GPU only when the honest tenant does
// not ask, so the process outside the gate is all the hostile tenant gets.
// (Without fracgpu each of the three processes would get about a third of
// the simulated GPU.) On the time-slice model, where that process shares
// every grant of the honest tenant slice by slice: before the yield the
// charge alone left the honest tenant 0.35 of the GPU (0.42 of the time
// used); GpuTimeTest's twin runs on the queue model.
TEST_F(HostileTenantTest, AProcessWithoutTheInterposerIsChargedToItsTenant) {
  sample_ms_ = "167";
  start_daemon();
  const std::string preload = std::string("LD_PRELOAD=") + FRACGPU_LIB;
  const std::string load = std::string(LOAD_PATH) + " devices=0 kernels_us=1000 seconds=11";
  const auto [honest, busy] = honest_beside("( " + preload + " " + load + " ) & " + load + "; wait", 10);
  printf("a process without the interposer: honest %.3f, the hostile tenant %.3f, GPU busy %.3f; honest %.3f of "
         "the time used\n",
         honest, busy - honest, busy, busy > 0 ? honest / busy : 0);
  EXPECT_TRUE(daemon_log_has("outside fracgpu's gate (no interposer): charged to tenant \"mallory\"")) << daemon_log();
  EXPECT_TRUE(daemon_log_has("tenant \"mallory\" runs work on the GPU outside the gate: it gives way")) << daemon_log();
  // The bounds on the GPU time the two use; the driver's time
  // slices give the two processes on the GPU equal turns, less the switches.
  ASSERT_GT(busy, 0);
  EXPECT_GE(honest / busy, 0.47);
  EXPECT_LE((busy - honest) / busy, 0.53);
}

// The hostile tenant's chain of short-lived processes without the interposer
// for `seconds`: one after the other, each set up, then running 1 ms kernels
// until 2 ms past the next sampling instant (the stand-in NVML's, every
// 167 ms), then gone; so one process per sampling period, dead by the time
// anyone asks whose the PID a sample names is. Each start bumps the number
// in `count`.
std::string bypass_chain(double seconds, const std::string& count) {
  return "end=$(($(date +%s) + " + std::to_string(static_cast<int>(seconds) + 2) +
         ")); n=0; while [ $(date +%s) -lt $end ]; do " + LOAD_PATH +
         " devices=0 kernels_us=1000 exit_at_ms=167 exit_after_ms=2 >/dev/null 2>&1; n=$((n + 1)); echo $n > " +
         count + "; done";
}

// The samples `fracgpu status` says the audit charged to `tenant` outside its
// grants ("... (N samples), charged to it"); 0 if none.
long long samples_charged(const std::string& status, const std::string& tenant) {
  const size_t line = status.find("tenant " + tenant + ": ");
  const size_t at = line == std::string::npos ? line : status.find(" samples), charged to it", line);
  if (at == std::string::npos) return 0;
  const size_t open = status.rfind('(', at);
  return open == std::string::npos ? 0 : atoll(status.c_str() + open + 1);
}

// The chain is charged by the samples that name it: an estimate, each
// sample standing for a whole period. Over the 17.5 s judged (about 105
// samples, half of them naming the chain) its error is about 2 points of
// the honest tenant's share, and runs on a loaded 2-core machine spread
// more (seen: 0.42-0.53 of the GPU time used against a mean of about 0.49):
// the bound allows for that.
constexpr double kChainEstimateError = 0.06;
// The same pair without fracgpu, the reference, needs no estimate (the
// simulated driver's record is exact): a shorter run is enough.
constexpr double kNativeSeconds = 10;

// A chain of short-lived processes without the interposer (bypass_chain) is
// all the hostile tenant runs: by the time a sample naming one is read, the
// process is gone, so the daemon learns whose each process on the GPU is
// while it lives (NVML's list of processes with a context, read every
// 50 ms) and keeps that after it dies, and the samples naming it are
// charged to its tenant. The gate cannot stop the chain; the charge gives
// the honest tenant back, as credit, the time the chain took from its
// grants. Judged on shares of the GPU time used, against the same pair
// without fracgpu in the same run (the honest load without the interposer).
TEST_F(HostileTenantTest, AChainOfShortLivedBypassProcessesLeavesTheHonestTenantItsShare) {
  sample_ms_ = "167";
  constexpr double kSeconds = 20;
  // The daemon runs throughout (the container mounts the tenant directory it
  // makes); without the interposer nothing of it touches the processes.
  start_daemon();
  const std::string count = container_ + "/chain.count";
  const auto [native, native_busy] = honest_beside(bypass_chain(kNativeSeconds, count), kNativeSeconds, false);
  const auto [honest, busy] = honest_beside(bypass_chain(kSeconds, count), kSeconds);
  const long long samples = samples_charged(status_output(), "mallory");
  printf("a chain of short-lived bypass processes: honest %.3f of the GPU time used (%.3f of the time, GPU busy "
         "%.3f), without fracgpu %.3f (%.3f, busy %.3f); %lld samples charged to the chain's tenant, of %s "
         "processes\n",
         honest / busy, honest, busy, native / native_busy, native, native_busy, samples, read_file(count).c_str());
  EXPECT_TRUE(daemon_log_has("outside fracgpu's gate (no interposer): charged to tenant \"mallory\"")) << daemon_log();
  EXPECT_GT(samples, 0);
  EXPECT_GE(honest / busy, std::min(0.48, native / native_busy) - kChainEstimateError);
}

// The same chain beside a load of the hostile tenant's through the
// interposer: while NVML lists a link, the honest holder pays only its part
// of its grant and the chain's tenant the rest (and a sample naming a link
// in its grant is counted), so its gated load gets fewer grants, and the
// honest tenant keeps its half of the GPU time used (without fracgpu it
// would get about a third: three processes).
TEST_F(HostileTenantTest, AChainOfShortLivedBypassProcessesIsChargedToItsTenant) {
  sample_ms_ = "167";
  constexpr double kSeconds = 20;
  start_daemon();
  const std::string count = container_ + "/chain.count";
  const auto [native, native_busy] = honest_beside(
      load_beside(bypass_chain(kNativeSeconds, count), kNativeSeconds, false), kNativeSeconds, false);
  const auto [honest, busy] = honest_beside(load_beside(bypass_chain(kSeconds, count), kSeconds, true), kSeconds);
  const long long samples = samples_charged(status_output(), "mallory");
  printf("a chain of short-lived bypass processes beside a gated load: honest %.3f of the GPU time used (%.3f of "
         "the time, GPU busy %.3f), without fracgpu %.3f (%.3f, busy %.3f); %lld samples charged to the chain's "
         "tenant, of %s processes\n",
         honest / busy, honest, busy, native / native_busy, native, native_busy, samples, read_file(count).c_str());
  EXPECT_GT(samples, 0);
  EXPECT_GE(honest / busy, std::min(0.48, native / native_busy) - kChainEstimateError);
}

// A process without the interposer that stays off the GPU around every
// sampling instant (dodge_ms), beside the hostile tenant's gated load, in
// the default configuration (audit_action = "report"): no sample names it,
// but NVML lists it on the GPU whatever its timing, and while it is listed
// the honest holder pays only its part of each grant (one context of two)
// and the hostile tenant the rest, which keeps its gated load off the GPU.
// Judged against the same three processes without fracgpu in the same run
// (the honest tenant one process of three there: about a third).
TEST_F(HostileTenantTest, ABypassThatDodgesTheSamplesPaysForItsTurns) {
  sample_ms_ = "167";
  constexpr double kSeconds = 12;
  start_daemon();
  const std::string dodger = std::string(LOAD_PATH) + " devices=0 kernels_us=1000 seconds=" +
                             std::to_string(kSeconds + 1) + " dodge_ms=167 guard_ms=8";
  const auto [native, native_busy] = honest_beside(load_beside(dodger, kSeconds, false), kSeconds, false);
  const auto [honest, busy] = honest_beside(load_beside(dodger, kSeconds, true), kSeconds);
  printf("a bypass dodging the samples beside a gated load: honest %.3f of the GPU time used (%.3f of the time, GPU "
         "busy %.3f), without fracgpu %.3f (%.3f, busy %.3f)\n",
         honest / busy, honest, busy, native / native_busy, native, native_busy);
  ASSERT_GT(busy, 0);
  ASSERT_GT(native_busy, 0);
  EXPECT_GE(honest / busy, 0.45);
  EXPECT_GT(honest / busy, native / native_busy + 0.05) << "no better than without fracgpu";
}

// A process without the interposer that stays off the GPU around every
// sampling instant (dodge_ms) is never named by a sample, so nothing charges
// it, and beside the hostile tenant's gated load it takes part of each of
// the honest tenant's grants. The defence is the bypass audit's `terminate`:
// NVML lists the process whatever its timing, and the audit kills it at its
// second pass. Shown with audit_action = "terminate" and the audit's default
// interval (10 s): the process is killed within two intervals, and from then
// on the honest tenant keeps its half of the GPU time used.
TEST_F(HostileTenantTest, ABypassThatDodgesTheSamplesIsTerminatedByTheAudit) {
  sample_ms_ = "167";
  // The fixture's config with audit_action = "terminate" instead of its
  // short audit interval: the audit runs at its default interval.
  std::string config = read_file(config_);
  const std::string interval = "audit_interval = \"100ms\"\n";
  ASSERT_NE(config.find(interval), std::string::npos) << config;
  config.replace(config.find(interval), interval.size(), "audit_action = \"terminate\"\n");
  write_file(config_, config);
  start_daemon();
  use_sim_state();
  const SimRecord sim;
  ASSERT_TRUE(sim.ok()) << sim.error();
  const std::string preload = std::string("LD_PRELOAD=") + FRACGPU_LIB;
  const std::string load = std::string(LOAD_PATH) + " devices=0 kernels_us=1000 seconds=45";
  const pid_t mallory = start_container("( " + preload + " " + load + " ) & " + load + " dodge_ms=167 guard_ms=8; wait",
                                        container_ + "/container.log");
  const pid_t honest = spawn({LOAD_PATH, "devices=0", "kernels_us=1000", "seconds=45"}, root_ + "/honest.out",
                             {preload, "FRACGPU_TENANT=alice"});
  // The honest tenant's share of the GPU time used from now until the kill,
  // then over 8 s after it.
  const auto share_since = [&](uint64_t h0, uint64_t d0) {
    const uint64_t used = std::max<uint64_t>(sim.device_busy_ns(0) - d0, 1);
    return static_cast<double>(sim.busy_ns(0, honest) - h0) / static_cast<double>(used);
  };
  std::this_thread::sleep_for(2s);
  const uint64_t h0 = sim.busy_ns(0, honest), d0 = sim.device_busy_ns(0);
  const auto t0 = std::chrono::steady_clock::now();
  ASSERT_TRUE(eventually([&] { return daemon_log_has("without being charged to any tenant (no interposer, or no "
                                                     "tenant): terminated (SIGKILL)"); }, 30s))
      << daemon_log();
  const double before = share_since(h0, d0);
  const double until_kill = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::this_thread::sleep_for(1s);
  const uint64_t h1 = sim.busy_ns(0, honest), d1 = sim.device_busy_ns(0);
  std::this_thread::sleep_for(8s);
  const double after = share_since(h1, d1);
  printf("a bypass dodging the samples: honest %.3f of the GPU time used over the %.1f s before the audit "
         "terminated it, %.3f after\n", before, until_kill, after);
  EXPECT_TRUE(daemon_log_has("tenant \"mallory\"")) << daemon_log();
  EXPECT_GE(after, 0.48);
  // Its load runs on (45 s: past the latest kill the audit allows); not
  // waited for.
  EXPECT_EQ(waitpid(honest, nullptr, WNOHANG), 0) << "the honest load ended early: " << read_file(root_ + "/honest.out");
  kill_and_reap(honest);
  kill_and_reap(mallory);
}

// A process without the interposer on two GPUs that leaves one of them
// (its context there destroyed) and runs on in the other. While NVML lists
// it on a GPU, the holders there pay only their part of their grants and
// its tenant the rest; once it is off that GPU, the holders there pay all
// they hold again. Seen through a cap: the honest tenant, alone on GPU 1
// with `limit = 0.5`, runs at its cap once the process has left that GPU
// (when its record kept the GPU, the honest tenant paid half of what it
// held there and ran at twice its cap).
TEST_F(HostileTenantTest, AProcessOutsideTheGateThatLeftAGpuNoLongerSharesTheTurnsThere) {
  sample_ms_ = "167";
  const std::string second = "GPU-0badc0de-0000-4000-8000-000000000002";
  devices_ += ";uuid=" + second + ",name=Sim2,mem=16GiB,ctx=64MiB,sms=100";
  std::string config = read_file(config_);
  const std::string tenants = config.substr(config.find("[[tenant]]"));
  config.replace(config.find("[[tenant]]"), tenants.size(),
                 "[[gpu]]\nuuid = \"" + second + "\"\ncontext_memory = \"64MiB\"\n"
                 "[[tenant]]\nname = \"alice\"\ngpus = 0.5\nlimit = 0.5\ndevices = [\"" + second + "\"]\n"
                 "[[tenant]]\nname = \"mallory\"\ngpus = 1.5\ndevices = [\"" + kUuid + "\", \"" + second + "\"]\n");
  write_file(config_, config);
  start_daemon();
  use_sim_state();
  const SimRecord sim;
  ASSERT_TRUE(sim.ok()) << sim.error();
  // GPU 1 for 2 s, GPU 0 for 12.
  const pid_t mallory = start_container(std::string(LOAD_PATH) + " devices=0,1 kernels_us=1000 seconds=12 leave_after_s=2",
                                        container_ + "/container.log");
  // The honest tenant sees its one GPU as device 0 (fracgpu shows a tenant
  // only its GPUs); the driver's record is of GPU 1.
  const pid_t honest = spawn({LOAD_PATH, "devices=0", "kernels_us=1000", "seconds=11"}, root_ + "/honest.out",
                             {std::string("LD_PRELOAD=") + FRACGPU_LIB, "FRACGPU_TENANT=alice"});
  ASSERT_TRUE(eventually([&] { return daemon_log_has("outside fracgpu's gate (no interposer): charged to tenant"); }, 5s))
      << daemon_log();
  std::this_thread::sleep_for(4s);  // off GPU 1 by now, and the cap's window past it
  const auto t0 = std::chrono::steady_clock::now();
  const uint64_t h0 = sim.busy_ns(1, honest);
  std::this_thread::sleep_for(5s);
  const double wall = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() * 1e9;
  const double share = static_cast<double>(sim.busy_ns(1, honest) - h0) / wall;
  printf("the honest tenant, capped at 0.5 on GPU 1 after a process outside the gate left it: %.3f of GPU 1\n", share);
  // Seen 0.42-0.48 on an idle 2-core host; the bug gives 1.00. A capped
  // load starved of CPU on a loaded host uses less than its cap, never more.
  EXPECT_LE(share, 0.55);
  EXPECT_GE(share, 0.33);  // and not kept off it
  EXPECT_EQ(wait_exit(honest, 20s), 0) << read_file(root_ + "/honest.out");
  EXPECT_EQ(wait_exit(mallory, 20s), 0) << read_file(container_ + "/container.log");
}

// Memory, as a container sees it (issue: the audit's allowance grew with the
// tenant's process count, and it never looked at a GPU the tenant had no
// grant on). The hostile tenant's container runs, without the interposer,
// twelve processes of 704 MiB each on GPU 0 (8.25 GiB against its 8 GiB
// quota: within the old quota + 12 x 128 MiB) and one holding 1 GiB on a
// second GPU it has no grant on. The largest on GPU 0 and the one on GPU 1
// are stopped; the rest stay; the honest tenant still gets its whole quota.
TEST_F(HostileTenantTest, ManyProcessesOrAnotherGpuBuyAContainerNoMoreMemory) {
  devices_ += ";uuid=GPU-0badc0de-0000-4000-8000-000000000002,name=Sim2,mem=16GiB,ctx=64MiB,sms=100";
  start_daemon();
  std::string script;
  for (int i = 0; i < 12; ++i)
    script += std::string(PROBE_PATH) + " init primary 0 alloc 640MiB hold > " + container_ + "/many-" +
              std::to_string(i) + ".log 2>&1 & ";
  script += std::string(PROBE_PATH) + " init primary 1 alloc 1GiB hold > " + container_ + "/other.log 2>&1 & wait";
  const pid_t mallory = start_container(script, container_ + "/container.log");
  const auto holding = [&](const std::string& name) {
    return read_file(container_ + "/" + name + ".log").find("holding=") != std::string::npos;
  };
  ASSERT_TRUE(eventually([&] {
    for (int i = 0; i < 12; ++i)
      if (!holding("many-" + std::to_string(i))) return false;
    return holding("other");
  }, 20s)) << read_file(container_ + "/container.log") << read_file(container_ + "/many-0.log");
  // Processes the audit stopped, by its log line for each.
  const auto stopped = [&] {
    const std::string log = daemon_log();
    const std::string line = "memory audit: tenant \"mallory\" over its quota on GPU";
    size_t n = 0;
    for (size_t at = log.find(line); at != std::string::npos; at = log.find(line, at + 1)) ++n;
    return n;
  };
  EXPECT_TRUE(eventually([&] { return daemon_log_has("over a GPU it has no grant on"); }, 3s)) << daemon_log();
  EXPECT_TRUE(eventually([&] { return stopped() >= 2; }, 5s)) << daemon_log();
  std::this_thread::sleep_for(1s);  // more passes: nothing more to stop
  // The largest on GPU 0 (the other eleven, 7.56 GiB, fit) and the one on GPU 1.
  EXPECT_EQ(stopped(), 2u) << daemon_log();

  const std::string preload = std::string("LD_PRELOAD=") + FRACGPU_LIB;
  const std::string quota_log = root_ + "/quota.out";
  const pid_t quota = spawn({PROBE_PATH, "init", "primary", "0", "alloc", "8128MiB"}, quota_log,
                            {preload, "FRACGPU_TENANT=alice"});
  EXPECT_EQ(wait_exit(quota, 10s), 0) << read_file(quota_log);
  EXPECT_NE(read_file(quota_log).find("alloc=0\n"), std::string::npos) << read_file(quota_log) << daemon_log();
  kill_and_reap(mallory);
}

}  // namespace
