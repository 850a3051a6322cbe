// GPU-time shares end to end: fracgpud with a config, tenants running
// gputime_load under LD_PRELOAD=libfracgpu.so, and the simulated driver's
// shared device timeline as the ground truth (it records each process's
// kernel time). Every figure checked here is what the sim measured, never
// what the interposer believes it did.
//
// Tolerances: shares within 2 points of GPU time over every 10 s window
// after the first second (the target); the sim's timeline is exact,
// the noise is the 2-core CI machine's scheduling, which the checks leave
// room for only where stated.
#include <dlfcn.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "gputime.h"

namespace fs = std::filesystem;
using namespace fracgpu;

namespace {

constexpr const char* kUuids[] = {"GPU-11111111-2222-3333-4444-000000000000", "GPU-11111111-2222-3333-4444-000000000001",
                                  "GPU-11111111-2222-3333-4444-000000000002"};
constexpr uint64_t kSecond = 1'000'000'000ull;

uint64_t now_ns() {
  struct timespec ts {};
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<uint64_t>(ts.tv_sec) * kSecond + static_cast<uint64_t>(ts.tv_nsec);
}

bool wait_for(const std::function<bool()>& done, int ms) {
  for (int i = 0; i < ms / 10 && !done(); ++i) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  return done();
}

struct TenantSpec {
  std::string name;
  std::string gpus;          // as written in the config: "0.5", "2.5"
  std::string devices;       // config devices list, e.g. "[0]" ("" to let fracgpu place it)
  std::string limit;         // "" for the default (= share)
};

struct Load {
  std::string tenant;
  std::vector<std::string> args;  // gputime_load arguments
  pid_t pid = -1;
  int err_fd = -1;
};

// Busy time (ns) per process and device, sampled over time.
struct Sample {
  uint64_t t = 0;
  std::map<pid_t, std::vector<uint64_t>> busy;  // per device
};

class GpuTimeTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/fracgpu-gputime-XXXXXX";
    ASSERT_NE(mkdtemp(tmpl), nullptr);
    root_ = tmpl;
    devices_.clear();
    for (const char* uuid : kUuids) devices_ += std::string(devices_.empty() ? "" : ";") + "uuid=" + uuid + ",mem=16GiB,ctx=64MiB";
    // The test reads the sim's ground truth through the same shared state.
    // The sim attaches once per process, so every test of this binary uses
    // one state file (tests measure per-process differences, so what earlier
    // tests left on the timeline does not matter).
    static const std::string state = "/tmp/fracgpu-gputime-sim-" + std::to_string(getpid());
    sim_state_ = state;
    setenv("SIMCUDA_STATE", sim_state_.c_str(), 1);
    setenv("SIMCUDA_DEVICES", devices_.c_str(), 1);
    sim_ = dlopen((std::string(SIMCUDA_DIR) + "/libcuda.so.1").c_str(), RTLD_NOW | RTLD_LOCAL);
    ASSERT_NE(sim_, nullptr) << dlerror();
    busy_ns_ = reinterpret_cast<uint64_t (*)(int, int)>(dlsym(sim_, "simcuda_busy_ns"));
    device_busy_ns_ = reinterpret_cast<uint64_t (*)(int)>(dlsym(sim_, "simcuda_device_busy_ns"));
    ASSERT_NE(busy_ns_, nullptr);
    ASSERT_NE(device_busy_ns_, nullptr);
  }

  void TearDown() override {
    for (Load& l : loads_)
      if (l.pid > 0) {
        kill(l.pid, SIGKILL);
        waitpid(l.pid, nullptr, 0);
      }
    stop_daemon();
    fs::remove_all(root_);
  }

  std::vector<std::string> environment(const std::string& tenant, bool preload) const {
    std::vector<std::string> env = {
        "PATH=/usr/bin:/bin",
        std::string("LD_LIBRARY_PATH=") + SIMCUDA_DIR,
        "SIMCUDA_STATE=" + sim_state_,
        "SIMCUDA_DEVICES=" + devices_,
        "FRACGPU_RUN_DIR=" + root_,
    };
    if (!tenant.empty()) env.push_back("FRACGPU_TENANT=" + tenant);
    if (preload) env.push_back(std::string("LD_PRELOAD=") + FRACGPU_LIB);
    return env;
  }

  static pid_t spawn(const std::string& path, const std::vector<std::string>& args, const std::vector<std::string>& env,
                     int* err_fd) {
    int err[2] = {-1, -1};
    if (err_fd != nullptr && pipe(err) != 0) return -1;
    pid_t pid = fork();
    if (pid == 0) {
      int devnull = open("/dev/null", O_WRONLY);
      dup2(devnull, 1);
      dup2(err_fd != nullptr ? err[1] : devnull, 2);
      std::vector<char*> argv{const_cast<char*>(path.c_str())};
      for (const auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
      argv.push_back(nullptr);
      std::vector<char*> envp;
      for (const auto& e : env) envp.push_back(const_cast<char*>(e.c_str()));
      envp.push_back(nullptr);
      execve(path.c_str(), argv.data(), envp.data());
      _exit(127);
    }
    if (err_fd != nullptr) {
      close(err[1]);
      *err_fd = err[0];
    }
    return pid;
  }

  void write_config(const std::vector<TenantSpec>& tenants, const std::string& extra_daemon = "") {
    config_ = root_ + "/fracgpud.toml";
    FILE* f = fopen(config_.c_str(), "w");
    ASSERT_NE(f, nullptr);
    fprintf(f, "[daemon]\nrun_dir = \"%s\"\nreap_interval_ms = 100\n%s\n", root_.c_str(), extra_daemon.c_str());
    for (const char* uuid : kUuids) fprintf(f, "[[gpu]]\nuuid = \"%s\"\ncontext_memory = \"64MiB\"\n\n", uuid);
    for (const TenantSpec& t : tenants) {
      fprintf(f, "[[tenant]]\nname = \"%s\"\ngpus = %s\n", t.name.c_str(), t.gpus.c_str());
      if (!t.devices.empty()) fprintf(f, "devices = %s\n", t.devices.c_str());
      if (!t.limit.empty()) fprintf(f, "limit = %s\n", t.limit.c_str());
      fprintf(f, "\n");
    }
    fclose(f);
    tenants_ = tenants;
  }

  void start_daemon() {
    daemon_ = spawn(FRACGPUD_PATH, {"--config", config_}, environment("", false), nullptr);
    ASSERT_GT(daemon_, 0);
    for (const TenantSpec& t : tenants_) {
      const std::string link = root_ + "/tenants/" + t.name + "/gputime-0";
      ASSERT_TRUE(wait_for([&] { return fs::exists(link); }, 10000)) << link << " never appeared";
    }
  }

  void stop_daemon(int sig = SIGTERM) {
    if (daemon_ <= 0) return;
    kill(daemon_, sig);
    waitpid(daemon_, nullptr, 0);
    daemon_ = -1;
  }

  void start_load(const std::string& tenant, std::vector<std::string> args, bool preload = true) {
    Load l;
    l.tenant = tenant;
    l.args = args;
    l.pid = spawn(LOAD_PATH, args, environment(tenant, preload), &l.err_fd);
    ASSERT_GT(l.pid, 0);
    loads_.push_back(l);
  }

  // Waits for every load; each must have exited 0.
  void finish_loads() {
    for (Load& l : loads_) {
      int status = 0;
      waitpid(l.pid, &status, 0);
      std::string err;
      char buf[4096];
      ssize_t n;
      while ((n = read(l.err_fd, buf, sizeof buf)) > 0) err.append(buf, static_cast<size_t>(n));
      close(l.err_fd);
      EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0)
          << "load of " << l.tenant << " failed (" << status << "): " << err;
      l.pid = -1;
    }
  }

  Sample sample(int devices) const {
    Sample s;
    s.t = now_ns();
    for (const Load& l : loads_) {
      std::vector<uint64_t>& v = s.busy[l.pid];
      for (int d = 0; d < devices; ++d) v.push_back(busy_ns_(d, l.pid));
    }
    return s;
  }

  // Samples every `step` until `duration` has passed.
  std::vector<Sample> record(int devices, uint64_t duration, uint64_t step = kSecond / 4) {
    std::vector<Sample> out;
    const uint64_t start = now_ns();
    while (true) {
      out.push_back(sample(devices));
      if (now_ns() - start >= duration) break;
      std::this_thread::sleep_for(std::chrono::nanoseconds(step));
    }
    return out;
  }

  // Busy time of a tenant's processes on a device between two samples.
  uint64_t tenant_busy(const Sample& a, const Sample& b, const std::string& tenant, int device) const {
    uint64_t sum = 0;
    for (const Load& l : loads_)
      if (l.tenant == tenant) sum += b.busy.at(l.pid)[device] - a.busy.at(l.pid)[device];
    return sum;
  }

  // Checks every window of `window` ns starting after `skip` ns: each
  // tenant's share of the device's wall time is within `tolerance` of what
  // `expected` says. Returns the worst deviation seen (for messages).
  void expect_shares(const std::vector<Sample>& samples, int device, const std::map<std::string, double>& expected,
                     uint64_t skip, uint64_t window, double tolerance) {
    ASSERT_FALSE(samples.empty());
    const uint64_t t0 = samples.front().t;
    int windows = 0;
    std::map<std::string, std::pair<double, double>> range;  // lowest, highest share seen
    for (size_t i = 0; i < samples.size(); ++i) {
      if (samples[i].t - t0 < skip) continue;
      size_t j = i;
      while (j < samples.size() && samples[j].t - samples[i].t < window) ++j;
      if (j == samples.size()) break;
      const double length = static_cast<double>(samples[j].t - samples[i].t);
      ++windows;
      for (const auto& [tenant, share] : expected) {
        const double got = static_cast<double>(tenant_busy(samples[i], samples[j], tenant, device)) / length;
        auto [it, fresh] = range.try_emplace(tenant, got, got);
        it->second = {std::min(it->second.first, got), std::max(it->second.second, got)};
        EXPECT_NEAR(got, share, tolerance) << "tenant " << tenant << " on device " << device << ", window starting "
                                           << (samples[i].t - t0) / 1e9 << " s";
      }
    }
    EXPECT_GT(windows, 0) << "no complete window: the run was too short";
    // The figures, for the log and docs/sm-time.md.
    for (const auto& [tenant, r] : range)
      printf("device %d tenant %s: configured %.3f, measured %.3f..%.3f over %d windows of %.0f s\n", device,
             tenant.c_str(), expected.at(tenant), r.first, r.second, windows, window / 1e9);
  }

  // Runs the loads, records `seconds` and checks every 10 s window after
  // the first second on `device` against `expected`.
  void run_and_expect(int device, const std::map<std::string, double>& expected, double seconds,
                      double tolerance = 0.02) {
    const std::vector<Sample> samples = record(device + 1, static_cast<uint64_t>(seconds * kSecond));
    expect_shares(samples, device, expected, kSecond, 10 * kSecond, tolerance);
  }

  // Share of wall time the tenant's processes used on `device` over the
  // next `ms` milliseconds.
  double measure(const std::string& tenant, int device, int ms) {
    const Sample a = sample(device + 1);
    std::this_thread::sleep_for(std::chrono::milliseconds(ms));
    const Sample b = sample(device + 1);
    return static_cast<double>(tenant_busy(a, b, tenant, device)) / static_cast<double>(b.t - a.t);
  }

  std::string root_, devices_, config_, sim_state_;
  std::vector<TenantSpec> tenants_;
  std::vector<Load> loads_;
  pid_t daemon_ = -1;
  void* sim_ = nullptr;
  uint64_t (*busy_ns_)(int, int) = nullptr;
  uint64_t (*device_busy_ns_)(int) = nullptr;
};

std::vector<std::string> load_args(const std::string& kernels_us, double seconds, const std::string& devices = "0",
                                   const std::string& path = "kernel") {
  return {"devices=" + devices, "kernels_us=" + kernels_us, "seconds=" + std::to_string(seconds), "path=" + path};
}

// ---- The arbiter's own rules, without processes ----

TEST(GpuTimeArbiter, LimitAllowsItsRateAndABurstNoMore) {
  gputime::GpuTimeSegment seg{};
  gputime::TenantTime& t = seg.tenants[0];
  const uint64_t start = 10 * kSecond;
  uint64_t eligible = 0;
  ASSERT_TRUE(gputime::within_limit(t, 300'000, start, &eligible));
  // 30 ms of GPU time at a 30% limit costs 100 ms of wall time.
  gputime::charge(seg, 0, 0, 30'000'000, 300'000, 300'000, start);
  EXPECT_EQ(t.cap_tat_ns.load(), start - gputime::kLimitBurstNs + 100'000'000);
  EXPECT_TRUE(gputime::within_limit(t, 300'000, start, &eligible));  // inside the burst
  gputime::charge(seg, 0, 0, 30'000'000, 300'000, 300'000, start);
  EXPECT_FALSE(gputime::within_limit(t, 300'000, start, &eligible));
  EXPECT_EQ(eligible, start - gputime::kLimitBurstNs + 200'000'000 - gputime::kLimitBurstNs);
  EXPECT_TRUE(gputime::within_limit(t, 300'000, eligible, nullptr));
  EXPECT_TRUE(gputime::within_limit(t, gputime::kPpm, start, nullptr));  // a whole GPU is never capped
}

TEST(GpuTimeArbiter, VirtualTimeAdvancesInverselyToTheShare) {
  gputime::GpuTimeSegment seg{};
  gputime::charge(seg, 0, 0, 10'000'000, 250'000, gputime::kPpm, kSecond);
  gputime::charge(seg, 1, 1, 10'000'000, 500'000, gputime::kPpm, kSecond);
  EXPECT_EQ(seg.tenants[0].vtime.load(), 40'000'000u);
  EXPECT_EQ(seg.tenants[1].vtime.load(), 20'000'000u);
  EXPECT_EQ(seg.tenants[0].used_ns.load(), 10'000'000u);
  EXPECT_EQ(seg.processes[1].used_ns.load(), 10'000'000u);
}

TEST(GpuTimeArbiter, OverlappingWaitsCountOnce) {
  gputime::TenantTime t{};
  gputime::add_throttled(t, 100, 200);
  gputime::add_throttled(t, 150, 250);  // overlaps the first by 50
  gputime::add_throttled(t, 120, 180);  // inside: nothing new
  gputime::add_throttled(t, 300, 310);
  EXPECT_EQ(t.throttled_ns.load(), 100u + 50u + 10u);
}

// ---- End to end on the simulated driver ----

TEST_F(GpuTimeTest, TwoTenantsAtHalfSplitEvenlyAndKeepTheGpuBusy) {
  write_config({{"a", "0.5", "[0]", ""}, {"b", "0.5", "[0]", ""}});
  start_daemon();
  const double seconds = 12;
  start_load("a", load_args("50,200", seconds));
  start_load("b", load_args("5000,50000", seconds));
  const uint64_t device_before = device_busy_ns_(0);
  const uint64_t t_before = now_ns();
  const std::vector<Sample> samples = record(1, static_cast<uint64_t>((seconds - 0.5) * kSecond));
  expect_shares(samples, 0, {{"a", 0.5}, {"b", 0.5}}, kSecond, 10 * kSecond, 0.02);
  const double utilization = static_cast<double>(device_busy_ns_(0) - device_before) / static_cast<double>(now_ns() - t_before);
  EXPECT_GE(utilization, 0.97) << "sharing wasted the GPU";
  printf("device 0 busy %.3f of the time\n", utilization);
  finish_loads();
}

// The checks above must be able to fail: the same loads without the
// interposer do not split 50/50 (the long kernels crowd out the short ones).
TEST_F(GpuTimeTest, WithoutEnforcementTheSplitIsWrong) {
  write_config({{"a", "0.5", "[0]", ""}, {"b", "0.5", "[0]", ""}});
  start_daemon();
  const double seconds = 4;
  start_load("a", load_args("50,200", seconds), /*preload=*/false);
  start_load("b", load_args("5000,50000", seconds), /*preload=*/false);
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  const Sample first = sample(1);
  std::this_thread::sleep_for(std::chrono::seconds(3));
  const Sample last = sample(1);
  const double length = static_cast<double>(last.t - first.t);
  const double a = static_cast<double>(tenant_busy(first, last, "a", 0)) / length;
  ASSERT_GT(static_cast<double>(tenant_busy(first, last, "a", 0) + tenant_busy(first, last, "b", 0)) / length, 0.9)
      << "the loads did not saturate the GPU";
  printf("without enforcement: a %.3f, b %.3f\n", a, static_cast<double>(tenant_busy(first, last, "b", 0)) / length);
  EXPECT_GT(std::fabs(a - 0.5), 0.1) << "this workload would pass without enforcement: the test proves nothing";
  finish_loads();
}

TEST_F(GpuTimeTest, ThreeTenantsSplitTwoThreeFiveWithMixedKernels) {
  write_config({{"a", "0.2", "[0]", ""}, {"b", "0.3", "[0]", ""}, {"c", "0.5", "[0]", ""}});
  start_daemon();
  const double seconds = 12.5;
  start_load("a", load_args("50000", seconds));
  start_load("b", load_args("50,5000", seconds));
  start_load("c", load_args("50,500,5000,50000", seconds));
  run_and_expect(0, {{"a", 0.2}, {"b", 0.3}, {"c", 0.5}}, seconds - 0.5);
  finish_loads();
}

TEST_F(GpuTimeTest, OneToNineSplitHoldsWithShortAndLongKernels) {
  write_config({{"small", "0.1", "[0]", ""}, {"big", "0.9", "[0]", ""}});
  start_daemon();
  const double seconds = 12.5;
  start_load("small", load_args("50", seconds));
  start_load("big", load_args("50000", seconds));
  run_and_expect(0, {{"small", 0.1}, {"big", 0.9}}, seconds - 0.5);
  finish_loads();
}

TEST_F(GpuTimeTest, AHardCapHoldsWhenAloneAndWorkConservingTakesTheIdleTime) {
  // capped: share 0.3, limit = share. open: share 0.3, limit 1.0. Same GPU
  // model, different GPUs, so each runs alone on its own.
  write_config({{"capped", "0.3", "[0]", ""}, {"open", "0.3", "[1]", "1.0"}, {"other", "0.7", "[1]", ""}});
  start_daemon();
  start_load("capped", load_args("50,5000", 5, "0"));
  start_load("open", load_args("50,5000", 5, "1"));
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  const Sample a = sample(2);
  std::this_thread::sleep_for(std::chrono::seconds(4));
  const Sample b = sample(2);
  const double length = static_cast<double>(b.t - a.t);
  const double capped = static_cast<double>(tenant_busy(a, b, "capped", 0)) / length;
  const double open = static_cast<double>(tenant_busy(a, b, "open", 1)) / length;
  printf("alone: capped at 0.3 used %.3f, work-conserving used %.3f\n", capped, open);
  EXPECT_LE(capped, 0.32);
  EXPECT_GE(capped, 0.25) << "the cap must not starve its own tenant";
  EXPECT_GE(open, 0.95);
  finish_loads();
}

TEST_F(GpuTimeTest, ANewcomerGetsItsShareWithinHalfASecond) {
  write_config({{"old", "0.5", "[0]", "1.0"}, {"new", "0.5", "[0]", "1.0"}});
  start_daemon();
  start_load("old", load_args("5000,50000", 5));
  std::this_thread::sleep_for(std::chrono::seconds(2));
  EXPECT_GE(measure("old", 0, 500), 0.95) << "alone and work-conserving";
  start_load("new", load_args("50,500", 3));
  // From 500 ms after it started, it has its share.
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  const double got = measure("new", 0, 1000);
  printf("newcomer: %.3f in the second after its first 500 ms\n", got);
  EXPECT_NEAR(got, 0.5, 0.05);
  finish_loads();
}

TEST_F(GpuTimeTest, TwoAndAHalfGpusAreTwoWholeOnesAndHalfOfAThird) {
  write_config({{"big", "2.5", "[0, 1, 2]", ""}, {"half", "0.5", "[2]", ""}});
  start_daemon();
  const double seconds = 12.5;
  start_load("big", load_args("50,5000,50000", seconds, "0,1,2"));
  start_load("half", load_args("500", seconds, "2"));
  const std::vector<Sample> samples = record(3, static_cast<uint64_t>((seconds - 0.5) * kSecond));
  expect_shares(samples, 0, {{"big", 1.0}}, kSecond, 10 * kSecond, 0.02);
  expect_shares(samples, 1, {{"big", 1.0}}, kSecond, 10 * kSecond, 0.02);
  expect_shares(samples, 2, {{"big", 0.5}, {"half", 0.5}}, kSecond, 10 * kSecond, 0.02);
  finish_loads();
}

// Every entry point that launches kernels is governed: a tenant capped at
// 0.3 and alone uses about 0.3 whichever it uses (without the gate: ~1.0).
TEST_F(GpuTimeTest, EveryLaunchPathIsGoverned) {
  write_config({{"capped", "0.3", "[0]", ""}, {"other", "0.7", "[0]", ""}});
  start_daemon();
  for (const char* path : {"kernel", "kernel_ptsz", "ex", "ex_ptsz", "coop", "coop_ptsz", "multi", "graph",
                           "graph_ptsz", "legacy", "legacy_grid", "legacy_async"}) {
    SCOPED_TRACE(path);
    start_load("capped", load_args("1000", 2.5, "0", path));
    std::this_thread::sleep_for(std::chrono::milliseconds(500));
    const double got = measure("capped", 0, 1500);
    printf("path %s: capped tenant used %.3f\n", path, got);
    EXPECT_LE(got, 0.33);
    EXPECT_GE(got, 0.2);
    finish_loads();
    loads_.clear();
  }
}

TEST_F(GpuTimeTest, SharesChangeOnReloadWithoutRestartingTenants) {
  write_config({{"a", "0.5", "[0]", ""}, {"b", "0.5", "[0]", ""}});
  start_daemon();
  start_load("a", load_args("1000", 6));
  start_load("b", load_args("1000", 6));
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  EXPECT_NEAR(measure("a", 0, 1500), 0.5, 0.04);
  write_config({{"a", "0.2", "[0]", ""}, {"b", "0.8", "[0]", ""}});
  kill(daemon_, SIGHUP);
  std::this_thread::sleep_for(std::chrono::milliseconds(700));
  const double a = measure("a", 0, 2000);
  printf("after reload to 0.2/0.8: a %.3f\n", a);
  EXPECT_NEAR(a, 0.2, 0.03);
  finish_loads();
}

// `fracgpu status` shows share, limit, achieved shares and throttled time
// per tenant and GPU, as the daemon computed them.
TEST_F(GpuTimeTest, StatusShowsAchievedSharesAndThrottledTime) {
  write_config({{"a", "0.3", "[0]", ""}, {"b", "0.7", "[0]", "1.0"}});
  start_daemon();
  start_load("a", load_args("1000", 3.5));
  start_load("b", load_args("1000", 3.5));
  std::this_thread::sleep_for(std::chrono::milliseconds(2500));
  auto run_cli = [&](bool json) {
    const std::string out_path = root_ + "/status.out";
    std::vector<std::string> args = {"status", "--run-dir", root_};
    if (json) args.push_back("--json");
    pid_t pid = fork();
    if (pid == 0) {
      int fd = open(out_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
      dup2(fd, 1);
      std::vector<char*> argv{const_cast<char*>(FRACGPU_CLI_PATH)};
      for (auto& a : args) argv.push_back(a.data());
      argv.push_back(nullptr);
      execv(FRACGPU_CLI_PATH, argv.data());
      _exit(127);
    }
    int status = 0;
    waitpid(pid, &status, 0);
    std::string text;
    FILE* f = fopen(out_path.c_str(), "r");
    char buf[4096];
    size_t n;
    while (f != nullptr && (n = fread(buf, 1, sizeof buf, f)) > 0) text.append(buf, n);
    if (f != nullptr) fclose(f);
    return text;
  };
  const nlohmann::json status = nlohmann::json::parse(run_cli(true));
  std::map<std::string, nlohmann::json> by_tenant;
  for (const auto& t : status["tenants"]) by_tenant[t["name"]] = t["gpus"][0];
  ASSERT_TRUE(by_tenant.contains("a") && by_tenant.contains("b")) << status.dump(2);
  const nlohmann::json& a = by_tenant["a"];
  const nlohmann::json& b = by_tenant["b"];
  EXPECT_EQ(a["share_ppm"], 300000);
  EXPECT_EQ(a["limit_ppm"], 300000);
  EXPECT_EQ(b["limit_ppm"], 1000000);
  ASSERT_TRUE(a["gpu_time"].is_object()) << a.dump(2);
  EXPECT_NEAR(a["gpu_time"]["achieved_1s_ppm"].get<double>(), 300000, 40000) << a.dump(2);
  EXPECT_NEAR(b["gpu_time"]["achieved_1s_ppm"].get<double>(), 700000, 40000) << b.dump(2);
  EXPECT_GT(a["gpu_time"]["throttled_ns"].get<uint64_t>(), 500'000'000u) << "a waited most of the time";
  EXPECT_EQ(a["gpu_time"]["tenants_sharing"], 2);
  const std::string text = run_cli(false);
  EXPECT_NE(text.find("LIMIT"), std::string::npos) << text;
  EXPECT_NE(text.find("THROTTLED"), std::string::npos) << text;
  finish_loads();
}

// SIGKILL the holder: the other tenant runs again within 200 ms. Then with
// the daemon killed too, the survivors keep their shares.
TEST_F(GpuTimeTest, AKilledHolderStallsNobodyAndTenantsGoOnWithoutTheDaemon) {
  write_config({{"a", "0.5", "[0]", "1.0"}, {"b", "0.5", "[0]", "1.0"}, {"c", "0.5", "[1]", ""},
                {"d", "0.5", "[1]", ""}});
  start_daemon();
  start_load("a", load_args("200", 30));  // killed below
  start_load("b", load_args("200", 3));
  std::this_thread::sleep_for(std::chrono::milliseconds(800));
  // Kill a while it holds the GPU: its record lock is its proof of life.
  gputime::Arbiter arbiter;
  char err[256];
  ASSERT_EQ(gputime::open_arbiter((root_ + "/tenants/a/gputime-0").c_str(), false, true, nullptr, &arbiter, err,
                                  sizeof err),
            ledger::LedgerError::kOk)
      << err;
  const pid_t victim = loads_[0].pid;
  ASSERT_TRUE(wait_for([&] {
    const uint32_t holder = arbiter.seg->arbiter.holder.load();
    return holder != 0 && arbiter.seg->processes[holder - 1].pid.load() == victim;
  }, 2000));
  kill(victim, SIGKILL);
  waitpid(victim, nullptr, 0);
  loads_.erase(loads_.begin());
  const uint64_t killed_at = now_ns();
  // b's launches run again: its busy time grows, within 200 ms of the kill
  // (its queue behind the dead process's last kernels included).
  const uint64_t before = busy_ns_(0, loads_[0].pid);
  ASSERT_TRUE(wait_for([&] { return busy_ns_(0, loads_[0].pid) > before; }, 1000));
  const uint64_t stall = now_ns() - killed_at;
  printf("killed holder: the other tenant launched again after %.1f ms\n", stall / 1e6);
  EXPECT_LT(stall, 200'000'000u);
  gputime::close_arbiter(&arbiter);
  finish_loads();
  loads_.clear();

  stop_daemon(SIGKILL);
  start_load("c", load_args("50,5000", 12.5, "1"));
  start_load("d", load_args("500", 12.5, "1"));
  run_and_expect(1, {{"c", 0.5}, {"d", 0.5}}, 12);
  finish_loads();
}

}  // namespace
