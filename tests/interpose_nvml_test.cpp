// NVML inside the tenant, end to end: nvml_probe (an NVML client, direct
// calls and dlopen + dlsym like nvidia-smi) runs under LD_PRELOAD=libfracgpu.so
// against the stand-in NVML (tests/simnvml), which reports the simulated
// driver's real figures: every process's memory, every tenant's processes.
// Tenant processes are fracgpu_probe runs that allocate through the
// interposer and hold. The tests play the daemon (they write the policy).
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "controller_test_util.h"
#include "gputime.h"
#include "ledger.h"
#include "policy_util.h"

using namespace fracgpu::ledger;
using fracgpu::testing::TempDir;

namespace {

constexpr uint64_t kMiB = 1ull << 20;
constexpr uint64_t kGiB = 1ull << 30;
constexpr uint64_t kContext = 64 * kMiB;  // per context, in the sim and in the policy
constexpr const char* kUuids[2] = {"GPU-aaaaaaaa-0000-0000-0000-000000000000",
                                   "GPU-aaaaaaaa-0000-0000-0000-000000000001"};
constexpr const char* kInsufficientSize = "7";
constexpr const char* kFunctionNotFound = "13";
constexpr const char* kNoPermission = "4";

using Values = std::map<std::string, std::string>;

Values parse(const std::string& out) {
  Values v;
  size_t start = 0;
  while (start < out.size()) {
    size_t end = out.find('\n', start);
    if (end == std::string::npos) end = out.size();
    const std::string line = out.substr(start, end - start);
    if (const size_t eq = line.find('='); eq != std::string::npos && line.find(' ') == std::string::npos)
      v[line.substr(0, eq)] = line.substr(eq + 1);
    start = end + 1;
  }
  return v;
}

std::string get(const Values& v, const std::string& key) {
  auto it = v.find(key);
  return it == v.end() ? "<missing " + key + ">" : it->second;
}

class NvmlInTenantTest : public ::testing::Test {
 protected:
  void TearDown() override {
    for (pid_t pid : holders_) fracgpu::testing::kill_and_reap(pid);
    for (auto& [name, ledger] : ledgers_) close_ledger(&ledger);
  }

  std::string tenant_dir(const std::string& tenant) { return root_ / ("tenants/" + tenant); }

  // Plays the daemon: grants GPU `device` to `tenant` with `quota` bytes.
  void grant(const std::string& tenant, int device, uint64_t quota) {
    TenantLedger& l = ledgers_[tenant];
    if (!l.is_open()) {
      char err[256];
      std::filesystem::create_directories(tenant_dir(tenant));
      ASSERT_EQ(open_ledger(tenant_dir(tenant).c_str(), AccessMode::kDaemon, tenant.c_str(), &l, err, sizeof err),
                LedgerError::kOk)
          << err;
    }
    uint8_t uuid[16];
    std::string hex;
    for (const char* p = kUuids[device] + 4; *p; ++p)
      if (*p != '-') hex += *p;
    for (int i = 0; i < 16; ++i) uuid[i] = static_cast<uint8_t>(std::stoul(hex.substr(2 * i, 2), nullptr, 16));
    ASSERT_GE(fracgpu::testing::grant_gpu(l, uuid, quota, kContext, 0), 0);
  }

  // tenant "" : no tenant state at all. preload false: no interposer.
  std::vector<std::string> env(const std::string& tenant, bool preload = true) {
    std::vector<std::string> e = {
        "PATH=/usr/bin:/bin",
        std::string("LD_LIBRARY_PATH=") + SIMNVML_DIR + ":" + SIMCUDA_DIR,
        "SIMCUDA_STATE=" + (root_ / "sim-state"),
        std::string("SIMCUDA_DEVICES=uuid=") + kUuids[0] + ",mem=16GiB,ctx=64MiB;uuid=" + kUuids[1] +
            ",mem=16GiB,ctx=64MiB",
    };
    if (!tenant.empty()) e.push_back("FRACGPU_TENANT_DIR=" + tenant_dir(tenant));
    if (preload) e.push_back(std::string("LD_PRELOAD=") + FRACGPU_LIB);
    return e;
  }

  // Starts `program` with `args`; returns its pid and its stdout's read end.
  static pid_t start(const char* program, const std::vector<std::string>& args, const std::vector<std::string>& envs,
                     int* out_fd) {
    int out[2];
    if (pipe(out) != 0) return -1;
    const pid_t pid = fork();
    if (pid == 0) {
      dup2(out[1], 1);
      close(out[0]);
      std::vector<char*> argv{const_cast<char*>(program)};
      for (const auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
      argv.push_back(nullptr);
      std::vector<char*> envp;
      for (const auto& e : envs) envp.push_back(const_cast<char*>(e.c_str()));
      envp.push_back(nullptr);
      execve(program, argv.data(), envp.data());
      _exit(127);
    }
    close(out[1]);
    *out_fd = out[0];
    return pid;
  }

  static std::string read_until(int fd, const char* marker) {
    std::string acc;
    char buf[1024];
    ssize_t n;
    while ((marker == nullptr || acc.find(marker) == std::string::npos) && (n = read(fd, buf, sizeof buf)) > 0)
      acc.append(buf, static_cast<size_t>(n));
    return acc;
  }

  // Runs nvml_probe to the end; its key=value lines.
  Values nvml(const std::vector<std::string>& args, const std::vector<std::string>& envs) {
    int fd = -1;
    const pid_t pid = start(NVML_PROBE_PATH, args, envs, &fd);
    const std::string out = read_until(fd, nullptr);
    close(fd);
    int status = 0;
    waitpid(pid, &status, 0);
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << out;
    return parse(out);
  }

  // A process of `tenant` that allocates `bytes` on `device` through the
  // interposer (after its primary context) and holds. Returns its pid.
  pid_t hold(const std::string& tenant, int device, const std::string& bytes) {
    int fd = -1;
    const std::string dev = std::to_string(device);
    const pid_t pid = start(PROBE_PATH, {"init", "primary", dev, "alloc", bytes, "hold"}, env(tenant), &fd);
    holders_.push_back(pid);
    const Values v = parse(read_until(fd, "holding="));
    close(fd);
    EXPECT_EQ(get(v, "alloc"), "0") << tenant << " could not allocate " << bytes;
    return pid;
  }

  static std::string row(pid_t pid, uint64_t bytes) { return std::to_string(pid) + ":" + std::to_string(bytes); }
  static std::string rows(std::vector<std::pair<pid_t, uint64_t>> list) {
    std::sort(list.begin(), list.end());
    std::string s;
    for (const auto& [pid, bytes] : list) s += (s.empty() ? "" : ",") + row(pid, bytes);
    return s;
  }

  // Alice (1 GiB on GPU 0) runs two processes there; bob (no memory limit on
  // GPU 0, and GPU 1) one on each GPU.
  void two_tenants() {
    grant("alice", 0, 1 * kGiB);
    grant("bob", 0, kUnlimited);
    grant("bob", 1, kUnlimited);
    a1_ = hold("alice", 0, "100MiB");
    a2_ = hold("alice", 0, "200MiB");
    b1_ = hold("bob", 0, "300MiB");
    b2_ = hold("bob", 1, "50MiB");
  }

  // Plays the daemon's tick: each live slot's host PID into the ledgers.
  void record_host_pids() {
    for (auto& [name, ledger] : ledgers_) fracgpu::ledger::record_host_pids(ledger);
  }

  // GPU 0's rows after two_tenants(): alice's, and everyone's.
  std::string alice_rows() const { return rows({{a1_, kContext + 100 * kMiB}, {a2_, kContext + 200 * kMiB}}); }
  std::string gpu0_rows() const {
    return rows({{a1_, kContext + 100 * kMiB}, {a2_, kContext + 200 * kMiB}, {b1_, kContext + 300 * kMiB}});
  }

  TempDir root_;
  std::map<std::string, TenantLedger> ledgers_;
  std::vector<pid_t> holders_;
  pid_t a1_ = -1, a2_ = -1, b1_ = -1, b2_ = -1;
};

const std::vector<std::string> kPaths = {"dlsym", "direct"};

TEST_F(NvmlInTenantTest, MemoryShowsTheQuotaAndTheUsageOfAllTheTenantsProcesses) {
  two_tenants();
  const uint64_t alice = 2 * kContext + 300 * kMiB;
  const uint64_t everyone = alice + kContext + 300 * kMiB;  // bob's process on GPU 0 too
  std::vector<std::string> args = {"init"};
  for (const auto& path : kPaths) args.insert(args.end(), {"mem", "0", path, "mem2", "0", path});
  const Values v = nvml(args, env("alice"));
  for (const auto& path : kPaths) {
    for (const std::string& p : {"mem_" + path + "_0", "mem2_" + path + "_0"}) {
      SCOPED_TRACE(p);
      EXPECT_EQ(get(v, p + "_rc"), "0");
      EXPECT_EQ(get(v, p + "_total"), std::to_string(1 * kGiB));
      EXPECT_EQ(get(v, p + "_used"), std::to_string(alice));
      EXPECT_EQ(get(v, p + "_free"), std::to_string(1 * kGiB - alice));
    }
    EXPECT_EQ(get(v, "mem2_" + path + "_0_reserved"), "0");
  }
  // The device as it is, for comparison: what the hook must have replaced.
  const Values real = nvml({"init", "mem", "0", "dlsym"}, env("alice", false));
  EXPECT_EQ(get(real, "mem_dlsym_0_total"), std::to_string(16 * kGiB));
  EXPECT_EQ(get(real, "mem_dlsym_0_used"), std::to_string(everyone));
}

// A process with two tenants (two claims of one container, each tenant's
// directory under the claims directory): each GPU is shown as the tenant
// granting it sees it, alice's 1 GiB on GPU 0, bob's 2 GiB on GPU 1.
TEST_F(NvmlInTenantTest, WithTwoClaimsEachGpuShowsItsOwnTenantsQuota) {
  grant("alice", 0, 1 * kGiB);
  grant("bob", 1, 2 * kGiB);
  const std::string claims = root_ / "claims";
  std::filesystem::create_directories(claims);
  std::filesystem::create_directory_symlink(tenant_dir("alice"), claims + "/claim-a");
  std::filesystem::create_directory_symlink(tenant_dir("bob"), claims + "/claim-b");
  std::vector<std::string> e = env("");
  e.push_back("FRACGPU_CLAIMS_DIR=" + claims);
  const Values v = nvml({"init", "mem", "0", kPaths[0], "mem", "1", kPaths[0]}, e);
  EXPECT_EQ(get(v, "mem_" + std::string(kPaths[0]) + "_0_total"), std::to_string(1 * kGiB));
  EXPECT_EQ(get(v, "mem_" + std::string(kPaths[0]) + "_1_total"), std::to_string(2 * kGiB));
}

TEST_F(NvmlInTenantTest, ProcessListsShowOnlyTheTenantsOwnProcesses) {
  two_tenants();
  std::vector<std::string> args = {"init", "which", "nvmlDeviceGetComputeRunningProcesses_v3"};
  for (const auto& path : kPaths)
    for (const char* version : {"1", "2", "3"}) args.insert(args.end(), {"procs", "0", version, path});
  const Values v = nvml(args, env("alice"));
  EXPECT_EQ(get(v, "which_nvmlDeviceGetComputeRunningProcesses_v3"), "libfracgpu.so");
  const std::string own = alice_rows();
  for (const auto& path : kPaths) {
    for (const char* version : {"1", "2", "3"}) {
      const std::string p = std::string("procs") + version + "_" + path + "_0";
      SCOPED_TRACE(p);
      EXPECT_EQ(get(v, p + "_sized_rc"), kInsufficientSize);  // NVML's contract: asked with no room, told how many
      EXPECT_EQ(get(v, p + "_rc"), "0");
      EXPECT_EQ(get(v, p + "_list"), own);
    }
  }
  // Bob sees his own on GPU 0 (no memory limit: his memory figures are the
  // device's, but the process list is still his alone).
  const Values bob = nvml({"init", "procs", "0", "3", "dlsym", "mem", "0", "dlsym"}, env("bob"));
  EXPECT_EQ(get(bob, "procs3_dlsym_0_list"), rows({{b1_, kContext + 300 * kMiB}}));
  EXPECT_EQ(get(bob, "mem_dlsym_0_total"), std::to_string(16 * kGiB));
  // Without the interposer, or without tenant state, NVML's own list: everyone.
  const std::string everyone = gpu0_rows();
  EXPECT_EQ(get(nvml({"init", "procs", "0", "3", "dlsym"}, env("alice", false)), "procs3_dlsym_0_list"), everyone);
  const Values unmanaged = nvml({"init", "procs", "0", "3", "dlsym", "mem", "0", "direct"}, env(""));
  EXPECT_EQ(get(unmanaged, "procs3_dlsym_0_list"), everyone);
  EXPECT_EQ(get(unmanaged, "mem_direct_0_total"), std::to_string(16 * kGiB));
}

TEST_F(NvmlInTenantTest, ProcessDetailListShowsOnlyTheTenantsOwnProcesses) {
  two_tenants();
  std::vector<std::string> args = {"init", "which", "nvmlDeviceGetRunningProcessDetailList"};
  for (const auto& path : kPaths)
    for (const char* mode : {"0", "1", "2"}) args.insert(args.end(), {"detail", "0", mode, path});
  const Values v = nvml(args, env("alice"));
  EXPECT_EQ(get(v, "which_nvmlDeviceGetRunningProcessDetailList"), "libfracgpu.so");
  const std::string own = alice_rows();
  for (const auto& path : kPaths) {
    const std::string compute = "detail0_" + path + "_0";
    SCOPED_TRACE(compute);
    EXPECT_EQ(get(v, compute + "_sized_rc"), kInsufficientSize);
    EXPECT_EQ(get(v, compute + "_rc"), "0");
    EXPECT_EQ(get(v, compute + "_list"), own);
    EXPECT_EQ(v.count(compute + "_cc_memory"), 0u);  // zeroed, not left as the caller's
    for (const char* mode : {"1", "2"}) {  // graphics and MPS: fracgpu charges neither
      const std::string p = std::string("detail") + mode + "_" + path + "_0";
      EXPECT_EQ(get(v, p + "_sized_rc"), "0") << p;
      EXPECT_EQ(get(v, p + "_list"), "") << p;
    }
  }
  // Without tenant state, or without the interposer: everyone on GPU 0.
  const std::string everyone = gpu0_rows();
  EXPECT_EQ(get(nvml({"init", "detail", "0", "0", "dlsym"}, env("")), "detail0_dlsym_0_list"), everyone);
  EXPECT_EQ(get(nvml({"init", "detail", "0", "0", "direct"}, env("alice", false)), "detail0_direct_0_list"), everyone);
  // A GPU not granted is not shown at all (its processes neither), though
  // bob runs there; without tenant state NVML shows it and bob's process.
  EXPECT_EQ(get(nvml({"init", "gpus", "dlsym"}, env("alice")), "gpus_dlsym_count"), "1");
  EXPECT_EQ(get(nvml({"init", "detail", "1", "0", "dlsym"}, env("")), "detail0_dlsym_1_list"),
            rows({{b2_, kContext + 50 * kMiB}}));
}

// NVML keys per-process samples and accounting records by host PID: a tenant
// gets its own processes' (matched through the host PIDs the daemon records
// in the ledger), never another tenant's, and none before the daemon has
// recorded any.
TEST_F(NvmlInTenantTest, PerProcessUtilizationShowsOnlyTheTenantsOwnProcesses) {
  two_tenants();
  std::vector<std::string> args = {"init", "which", "nvmlDeviceGetProcessUtilization", "which",
                                   "nvmlDeviceGetProcessesUtilizationInfo"};
  for (const auto& path : kPaths) args.insert(args.end(), {"util", "0", path, "utilinfo", "0", path});
  constexpr const char* kNotFound = "6";  // NVML's "no samples"
  // Before the daemon has recorded host PIDs: nothing can be told apart.
  const Values before = nvml(args, env("alice"));
  EXPECT_EQ(get(before, "which_nvmlDeviceGetProcessUtilization"), "libfracgpu.so");
  EXPECT_EQ(get(before, "which_nvmlDeviceGetProcessesUtilizationInfo"), "libfracgpu.so");
  for (const auto& path : kPaths) {
    for (const std::string& p : {"util_" + path + "_0", "utilinfo_" + path + "_0"}) {
      SCOPED_TRACE(p);
      EXPECT_EQ(get(before, p + "_rc"), kNotFound);
      EXPECT_EQ(get(before, p + "_count"), "0");
      EXPECT_EQ(get(before, p + "_list"), "");
    }
  }
  record_host_pids();
  const Values v = nvml(args, env("alice"));
  // The stand-in's SM figure is measured from the sim's kernel log: these
  // processes hold memory and ran no kernels.
  const std::string alices = rows({{a1_, 0}, {a2_, 0}});
  for (const auto& path : kPaths) {
    for (const std::string& p : {"util_" + path + "_0", "utilinfo_" + path + "_0"}) {
      SCOPED_TRACE(p);
      EXPECT_EQ(get(v, p + "_rc"), "0");
      EXPECT_EQ(get(v, p + "_count"), "2");
      EXPECT_EQ(get(v, p + "_list"), alices);
      EXPECT_EQ(get(v, p + "_left_over"), "0") << "bob's record left in alice's buffer";
    }
  }
  // A GPU alice has no grant on is not shown, though bob runs there.
  EXPECT_EQ(get(nvml({"init", "gpus", "direct"}, env("alice")), "gpus_direct_count"), "1");
  // NVML's own samples, without tenant state or the interposer: every
  // process on GPU 0, alice's and bob's.
  const std::string everyone = rows({{a1_, 0}, {a2_, 0}, {b1_, 0}});
  const Values unmanaged = nvml({"init", "util", "0", "dlsym", "utilinfo", "0", "direct"}, env(""));
  EXPECT_EQ(get(unmanaged, "util_dlsym_0_sized_rc"), kInsufficientSize);
  EXPECT_EQ(get(unmanaged, "util_dlsym_0_list"), everyone);
  EXPECT_EQ(get(unmanaged, "utilinfo_direct_0_list"), everyone);
  EXPECT_EQ(get(nvml({"init", "util", "0", "direct"}, env("alice", false)), "util_direct_0_list"), everyone);
}

TEST_F(NvmlInTenantTest, AccountingShowsOnlyTheTenantsOwnProcesses) {
  two_tenants();
  const std::string a1 = std::to_string(a1_), b1 = std::to_string(b1_);
  std::vector<std::string> args = {"init", "which", "nvmlDeviceGetAccountingPids", "which",
                                   "nvmlDeviceGetAccountingStats"};
  for (const auto& path : kPaths)
    args.insert(args.end(), {"acct", "0", path, "acctstats", "0", a1, path, "acctstats", "0", b1, path});
  const Values before = nvml(args, env("alice"));
  EXPECT_EQ(get(before, "which_nvmlDeviceGetAccountingPids"), "libfracgpu.so");
  EXPECT_EQ(get(before, "which_nvmlDeviceGetAccountingStats"), "libfracgpu.so");
  EXPECT_EQ(get(before, "acct_direct_0_list"), "");
  EXPECT_EQ(get(before, "acctstats_direct_0_" + a1 + "_rc"), "6");  // NVML_ERROR_NOT_FOUND
  record_host_pids();
  const Values v = nvml(args, env("alice"));
  for (const auto& path : kPaths) {
    SCOPED_TRACE(path);
    EXPECT_EQ(get(v, "acct_" + path + "_0_rc"), "0");
    EXPECT_EQ(get(v, "acct_" + path + "_0_list"), rows({{a1_, 0}, {a2_, 0}}));
    EXPECT_EQ(get(v, "acct_" + path + "_0_left_over"), "0") << "bob's PID left in alice's buffer";
    EXPECT_EQ(get(v, "acctstats_" + path + "_0_" + a1 + "_rc"), "0");
    EXPECT_EQ(get(v, "acctstats_" + path + "_0_" + a1 + "_mem"), std::to_string(kContext + 100 * kMiB));
    EXPECT_EQ(get(v, "acctstats_" + path + "_0_" + b1 + "_rc"), "6");
    EXPECT_EQ(get(v, "acctstats_" + path + "_0_" + b1 + "_mem"), "0");
  }
  // Without tenant state or without the interposer: NVML's records, everyone's.
  const std::string everyone = rows({{a1_, 0}, {a2_, 0}, {b1_, 0}});
  const Values unmanaged = nvml({"init", "acct", "0", "dlsym", "acctstats", "0", b1, "direct"}, env(""));
  EXPECT_EQ(get(unmanaged, "acct_dlsym_0_list"), everyone);
  EXPECT_EQ(get(unmanaged, "acctstats_direct_0_" + b1 + "_rc"), "0");
  EXPECT_EQ(get(unmanaged, "acctstats_direct_0_" + b1 + "_mem"), std::to_string(kContext + 300 * kMiB));
  EXPECT_EQ(get(nvml({"init", "acct", "0", "direct"}, env("alice", false)), "acct_direct_0_list"), everyone);
}

// A GPU not granted is not there: not counted, no handle by index, UUID or
// PCI bus ID, so neither its memory nor its processes can be asked for
// (visible_devices_test covers the enumeration in full).
// GPU-Util inside a tenant is the tenant's own GPU time, as the daemon
// publishes it in the GPU's arbiter, never the device's (every tenant's
// work); the device's utilization rings show nothing.
TEST_F(NvmlInTenantTest, UtilizationShowsTheTenantsOwnGpuTimeNotTheDevices) {
  grant("alice", 0, 1 * kGiB);
  grant("bob", 0, kUnlimited);
  // The device's figures, as NVML would give them: 80 % busy, memory 40 %.
  const std::string faults = root_ / "nvml-faults";
  fracgpu::testing::write_file(faults, "0 utilization_gpu=80\n0 utilization_memory=40\n");
  auto env_of = [&](const std::string& tenant, bool preload = true) {
    std::vector<std::string> e = env(tenant, preload);
    e.push_back("SIMNVML_FAULTS=" + faults);
    return e;
  };
  std::vector<std::string> rates = {"init"};
  for (const auto& path : kPaths) rates.insert(rates.end(), {"rates", "0", path});
  const Values device = nvml(rates, env_of(""));
  EXPECT_EQ(get(device, "rates_direct_0_gpu"), "80");
  EXPECT_EQ(get(device, "rates_direct_0_memory"), "40");
  // No arbiter: nothing says what the tenant used, and the device's figure
  // would show its neighbours' work.
  const Values unpublished = nvml(rates, env_of("alice"));
  for (const auto& path : kPaths) {
    EXPECT_EQ(get(unpublished, "rates_" + path + "_0_rc"), "3") << path;
    EXPECT_EQ(get(unpublished, "rates_" + path + "_0_gpu"), "0") << path << ": the device's figure left behind";
  }

  // Play the daemon: alice's row, 30 % of the GPU over the last second.
  const std::string arbiter_path = tenant_dir("alice") + "/gputime-0";
  uint8_t uuid[16];
  ASSERT_TRUE(parse_gpu_uuid_text(kUuids[0], uuid));
  fracgpu::gputime::Arbiter arbiter;
  char err[256];
  ASSERT_EQ(fracgpu::gputime::open_arbiter(arbiter_path.c_str(), true, false, uuid, &arbiter, err, sizeof err),
            LedgerError::kOk)
      << err;
  const int row = fracgpu::gputime::bind_tenant(*arbiter.seg, "alice");
  ASSERT_GE(row, 0);
  fracgpu::gputime::TenantTime& alice = arbiter.seg->tenants[row];
  alice.share_ppm.store(500'000);
  alice.state.store(fracgpu::gputime::kTenantActive);
  alice.achieved_1s_ppm.store(300'000);
  std::atomic<bool> beating{true};
  std::thread heartbeat([&] {
    while (beating) {
      arbiter.seg->daemon.daemon_heartbeat_ns.store(fracgpu::gputime::monotonic_ns());
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  });
  const Values own = nvml(rates, env_of("alice"));
  for (const auto& path : kPaths) {
    SCOPED_TRACE(path);
    EXPECT_EQ(get(own, "rates_" + path + "_0_rc"), "0");
    EXPECT_EQ(get(own, "rates_" + path + "_0_gpu"), "30");
    // Memory in the tenant's proportion of the busy time: 40 * 30 / 80.
    EXPECT_EQ(get(own, "rates_" + path + "_0_memory"), "15");
  }
  // More than the device's own figure over its (shorter) period: memory
  // never shows more than the device's.
  alice.achieved_1s_ppm.store(950'000);
  const Values most = nvml(rates, env_of("alice"));
  EXPECT_EQ(get(most, "rates_direct_0_gpu"), "95");
  EXPECT_EQ(get(most, "rates_direct_0_memory"), "40");
  // Without the interposer: the device's.
  EXPECT_EQ(get(nvml(rates, env_of("alice", false)), "rates_dlsym_0_gpu"), "80");
  // A stopped daemon's figure is stale: not shown.
  beating = false;
  heartbeat.join();
  arbiter.seg->daemon.daemon_heartbeat_ns.store(fracgpu::gputime::monotonic_ns() - 5'000'000'000ull);
  EXPECT_EQ(get(nvml(rates, env_of("alice")), "rates_direct_0_rc"), "3");

  // The device's ring of GPU utilization samples, with a process at work on
  // GPU 0 (bob's, without the interposer): NVML has samples, alice sees none.
  int load_out = -1;
  const pid_t load = start(GPUTIME_LOAD_PATH, {"devices=0", "kernels_us=500", "seconds=20"}, env(""), &load_out);
  holders_.push_back(load);
  std::vector<std::string> samples = {"init"};
  for (const auto& path : kPaths) samples.insert(samples.end(), {"samples", "0", "1", path, "samples", "0", "0", path});
  Values everyone;
  for (int tries = 0; tries < 200 && get(everyone, "samples_direct_0_1_rc") != "0"; ++tries) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    everyone = nvml(samples, env(""));
  }
  ASSERT_EQ(get(everyone, "samples_direct_0_1_rc"), "0") << "the load never showed in the device's ring";
  EXPECT_NE(get(everyone, "samples_direct_0_1_count"), "0");
  const Values seen = nvml(samples, env("alice"));
  for (const auto& path : kPaths) {
    const std::string p = "samples_" + path + "_0_";
    SCOPED_TRACE(p);
    EXPECT_EQ(get(seen, p + "1_sized_rc"), "0");  // a size query keeps NVML's answer: the ring's depth
    EXPECT_EQ(get(seen, p + "1_sized_count"), get(everyone, p + "1_sized_count"));
    EXPECT_EQ(get(seen, p + "1_rc"), "6");  // NVML's "no samples"
    EXPECT_EQ(get(seen, p + "1_count"), "0");
    EXPECT_EQ(get(seen, p + "1_left_over"), "0") << "the device's samples left in the buffer";
    // Other rings are NVML's own answer (the stand-in has none of power).
    EXPECT_EQ(get(seen, p + "0_rc"), get(everyone, p + "0_rc"));
  }
  close(load_out);
  fracgpu::gputime::close_arbiter(&arbiter);
}

TEST_F(NvmlInTenantTest, AGpuNotGrantedIsNotShown) {
  two_tenants();  // alice has no grant on GPU 1; bob runs a process there
  const Values v = nvml({"init", "gpus", "dlsym", "gpus", "direct", "byuuid", kUuids[1], "dlsym", "bypci",
                         "0000:11:00.0", "direct", "mem", "0", "dlsym"},
                        env("alice"));
  for (const auto& path : kPaths) {
    SCOPED_TRACE(path);
    EXPECT_EQ(get(v, "gpus_" + path + "_count"), "1");
    EXPECT_EQ(get(v, "gpus_" + path + "_0_uuid"), kUuids[0]);
    EXPECT_EQ(get(v, "gpus_" + path + "_past_end_rc"), "2");  // NVML_ERROR_INVALID_ARGUMENT
  }
  EXPECT_EQ(get(v, std::string("byuuid_dlsym_") + kUuids[1] + "_rc"), "6");  // NVML_ERROR_NOT_FOUND
  EXPECT_EQ(get(v, "bypci_direct_0000:11:00.0_rc"), "6");
  EXPECT_EQ(get(v, "mem_dlsym_0_total"), std::to_string(1 * kGiB));  // its own GPU as before
  // Bob, granted both, sees both.
  EXPECT_EQ(get(nvml({"init", "gpus", "direct"}, env("bob")), "gpus_direct_count"), "2");
}

// The topology calls hand out handles too: inside a tenant, only of its own
// GPUs (the size query's count included), so no handle of another GPU can
// be had through them; NVML's own answer (both GPUs on one system bus)
// without the interposer.
TEST_F(NvmlInTenantTest, TopologyCallsHandOutOnlyTheTenantsGpus) {
  two_tenants();  // alice: GPU 0 only; bob: both
  std::vector<std::string> args = {"init"};
  for (const auto& path : kPaths) args.insert(args.end(), {"nearest", "0", path, "gpuset", path});
  const Values alice = nvml(args, env("alice"));
  const Values native = nvml(args, env(""));
  for (const auto& path : kPaths) {
    SCOPED_TRACE(path);
    const std::string near = "nearest_" + path + "_0", set = "gpuset_" + path;
    EXPECT_EQ(get(native, near + "_uuids"), kUuids[1]);
    EXPECT_EQ(get(native, set + "_sized_count"), "2");
    EXPECT_EQ(get(alice, near + "_rc"), "0");
    EXPECT_EQ(get(alice, near + "_sized_count"), "0");
    EXPECT_EQ(get(alice, near + "_count"), "0");
    EXPECT_EQ(get(alice, near + "_uuids"), "");
    EXPECT_EQ(get(alice, set + "_sized_count"), "1");
    EXPECT_EQ(get(alice, set + "_uuids"), kUuids[0]);
  }
  // Bob sees GPU 1 near GPU 0, as without fracgpu.
  EXPECT_EQ(get(nvml({"init", "nearest", "0", "direct"}, env("bob")), "nearest_direct_0_uuids"), kUuids[1]);
}

TEST_F(NvmlInTenantTest, GraphicsAndMpsListsAreNeverOtherTenants) {
  // The stand-in NVML has no graphics list: only the interposer's export
  // answers, and with the real function absent it says so.
  grant("alice", 0, 1 * kGiB);
  EXPECT_EQ(get(nvml({"init", "graphics", "0"}, env("alice")), "graphics_0_rc"), kFunctionNotFound);
  EXPECT_EQ(get(nvml({"init", "graphics", "0"}, env("alice", false)), "graphics_0_rc"), "none");
}

TEST_F(NvmlInTenantTest, ARefusedLedgerGetsNoFiguresAtAll) {
  two_tenants();
  fracgpu::testing::write_file(tenant_dir("mallory") + "/policy", "not a ledger");
  fracgpu::testing::write_file(tenant_dir("mallory") + "/usage", "not a ledger");
  const Values v = nvml({"init", "mem", "0", "dlsym", "procs", "0", "3", "direct", "detail", "0", "0", "dlsym", "util",
                         "0", "direct", "utilinfo", "0", "dlsym"},
                        env("mallory"));
  EXPECT_EQ(get(v, "mem_dlsym_0_rc"), kNoPermission);  // not the device's real figures
  EXPECT_EQ(get(v, "procs3_direct_0_rc"), kNoPermission);
  EXPECT_EQ(get(v, "detail0_dlsym_0_rc"), kNoPermission);
  EXPECT_EQ(get(v, "util_direct_0_rc"), kNoPermission);
  EXPECT_EQ(get(v, "utilinfo_dlsym_0_rc"), kNoPermission);
}

// Inside a PID namespace (a container), the driver's PIDs are the host's;
// the list must carry the PIDs this namespace uses. Needs root for unshare.
TEST_F(NvmlInTenantTest, InAPidNamespaceTheListCarriesTheNamespacesPids) {
  if (geteuid() != 0 || access("/usr/bin/unshare", X_OK) != 0) GTEST_SKIP() << "needs root and unshare(1)";
  two_tenants();
  const std::string script =
      std::string("\"$PROBE\" init primary 0 alloc 10MiB hold > \"$OUT\" & h=$!\n"
                  "while ! grep -q holding= \"$OUT\"; do sleep 0.01; done\n"
                  "echo \"inside=$h\"\n"
                  "\"$NVML\" init procs 0 3 dlsym mem 0 dlsym\n"
                  "kill -9 $h\n");
  std::vector<std::string> envs = env("alice");
  envs.push_back(std::string("PROBE=") + PROBE_PATH);
  envs.push_back(std::string("NVML=") + NVML_PROBE_PATH);
  envs.push_back("OUT=" + (root_ / "ns-holder.out"));
  int fd = -1;
  const pid_t pid = start("/usr/bin/unshare", {"--pid", "--fork", "/bin/sh", "-c", script}, envs, &fd);
  const std::string out = read_until(fd, nullptr);
  close(fd);
  int status = 0;
  waitpid(pid, &status, 0);
  if (out.find("inside=") == std::string::npos) GTEST_SKIP() << "unshare --pid did not run here: " << out;
  const Values v = parse(out);
  const Values holder = parse(fracgpu::testing::read_file(root_ / "ns-holder.out"));
  // The holder's own getpid() inside the namespace is what the list shows;
  // alice's two processes outside are not visible from in here (counted in
  // `used`, not listed), and bob's are not alice's.
  EXPECT_EQ(get(holder, "holding"), get(v, "inside"));
  EXPECT_EQ(get(v, "procs3_dlsym_0_list"), get(v, "inside") + ":" + std::to_string(kContext + 10 * kMiB)) << out;
  EXPECT_EQ(get(v, "mem_dlsym_0_used"), std::to_string(3 * kContext + 310 * kMiB)) << out;
}

}  // namespace
