// The daemon's NVML side end to end: discovery with and without NVML, the GPU
// health probe (faults injected into the stand-in NVML while fracgpud runs)
// and the bypass audit. fracgpud, the probes and the stand-in NVML all share
// one simulated driver state, so NVML's per-process memory is what the
// probes really allocated.
#include <dlfcn.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "config/config.h"
#include "control/client.h"
#include "controller_test_util.h"
#include "common/gpu_discovery.h"
#include "common/nvml.h"
#include "daemon/gpu_meter.h"
#include "ledger.h"
#include "common/uuid.h"

using namespace fracgpu;
using namespace fracgpu::testing;
using namespace std::chrono_literals;
namespace fs = std::filesystem;

namespace {

const std::string kUuid = "GPU-5a1c0de0-0000-4000-8000-0000000000a1";
const std::string kUuid2 = "GPU-5a1c0de0-0000-4000-8000-0000000000a2";
const std::string kDevices =
    "uuid=" + kUuid + ",name=Sim A,mem=16GiB,ctx=64MiB,sms=100;uuid=" + kUuid2 + ",name=Sim B,mem=8GiB,ctx=64MiB,sms=50";
constexpr int kDeviceUnavailable = 46;  // CUDA_ERROR_DEVICE_UNAVAILABLE

// ---- Discovery (each case in a child: the sim attaches once per process) ----

// Runs discover_gpus in a child with SIMCUDA_DEVICES = devices and returns
// its result as text lines: "nvml=<0|1>", "problem=...", "nvml_problem=...",
// then "gpu=<index> <uuid> <name>|<bytes> <sms> <nvml_index>" per GPU.
std::string discover_in_child(const std::string& devices, const std::string& nvml_library) {
  return output_of_child([&] {
    setenv("SIMCUDA_DEVICES", devices.c_str(), 1);
    unsetenv("SIMCUDA_STATE");
    unsetenv("SIMNVML_FAULTS");
    const controller::Discovery d = controller::discover_gpus(SIMCUDA_DIR "/libcuda.so.1", nvml_library.c_str());
    std::ostringstream out;
    out << "nvml=" << d.nvml << "\nproblem=" << d.problem << "\nnvml_problem=" << d.nvml_problem << "\n";
    for (const auto& g : d.gpus)
      out << "gpu=" << g.index << " " << g.uuid << " " << g.name << "|" << g.memory_bytes << " " << g.sm_count << " "
          << g.nvml_index << "\n";
    return out.str();
  });
}

TEST(NvmlDiscovery, ListsGpusThroughNvmlWithCudaOrdinalsAndSmCounts) {
  const std::string out = discover_in_child(kDevices, SIMNVML_DIR "/libnvidia-ml.so.1");
  EXPECT_NE(out.find("nvml=1\n"), std::string::npos) << out;
  EXPECT_NE(out.find("problem=\n"), std::string::npos) << out;
  EXPECT_NE(out.find("gpu=0 " + kUuid + " Sim A|" + std::to_string(16ull << 30) + " 100 0\n"), std::string::npos) << out;
  EXPECT_NE(out.find("gpu=1 " + kUuid2 + " Sim B|" + std::to_string(8ull << 30) + " 50 1\n"), std::string::npos) << out;
}

TEST(NvmlDiscovery, WithoutNvmlFallsBackToCudaAndSaysSo) {
  const std::string out = discover_in_child(kDevices, "/nonexistent/libnvidia-ml.so.1");
  EXPECT_NE(out.find("nvml=0\n"), std::string::npos) << out;
  EXPECT_NE(out.find("nvml_problem=NVML is not available (/nonexistent/libnvidia-ml.so.1)"), std::string::npos) << out;
  EXPECT_NE(out.find("problem=\n"), std::string::npos) << out;
  // CUDA alone: ordinals, names, memory and SM counts, no NVML index.
  EXPECT_NE(out.find("gpu=0 " + kUuid + " Sim A|" + std::to_string(16ull << 30) + " 100 -1\n"), std::string::npos) << out;
  EXPECT_NE(out.find("gpu=1 " + kUuid2 + " Sim B|" + std::to_string(8ull << 30) + " 50 -1\n"), std::string::npos) << out;
}

TEST(NvmlDiscovery, NodeWithoutGpusIsEmptyNotAnError) {
  const std::string out = discover_in_child("", SIMNVML_DIR "/libnvidia-ml.so.1");
  EXPECT_NE(out.find("nvml=1\nproblem=\nnvml_problem=\n"), std::string::npos) << out;
  EXPECT_EQ(out.find("gpu="), std::string::npos) << out;
}

TEST(NvmlDiscovery, NvmlThatFailsToInitializeIsReportedAndCudaStillLists) {
  // init_fail: NVML present but not initializing (driver not loaded).
  const std::string faults = "/tmp/fracgpu-nvml-initfail-" + std::to_string(getpid());
  write_file(faults, "init_fail\n");
  setenv("SIMNVML_FAULTS", faults.c_str(), 1);
  int fds[2];
  ASSERT_EQ(pipe(fds), 0);
  const pid_t pid = fork();
  if (pid == 0) {
    close(fds[0]);
    setenv("SIMCUDA_DEVICES", kDevices.c_str(), 1);
    const controller::Discovery d =
        controller::discover_gpus(SIMCUDA_DIR "/libcuda.so.1", SIMNVML_DIR "/libnvidia-ml.so.1");
    const std::string text = std::to_string(d.nvml) + " " + std::to_string(d.gpus.size()) + " " + d.nvml_problem;
    if (write(fds[1], text.data(), text.size()) < 0) _exit(1);
    _exit(0);
  }
  close(fds[1]);
  char buf[1024] = {};
  const ssize_t n = read(fds[0], buf, sizeof buf - 1);
  close(fds[0]);
  waitpid(pid, nullptr, 0);
  unsetenv("SIMNVML_FAULTS");
  fs::remove(faults);
  ASSERT_GT(n, 0);
  EXPECT_NE(std::string(buf).find("0 2 NVML (" SIMNVML_DIR "/libnvidia-ml.so.1) did not initialize: "
                                  "NVML_ERROR_DRIVER_NOT_LOADED"),
            std::string::npos)
      << buf;
}

// ---- The GPU-time meter (daemon/gpu_meter.h) against the sampling stand-in ----

// NvmlMeter's device figure, the GPU's busy time from nvmlDeviceGetSamples,
// against the simulated driver's record. Asked after every reading, it
// covers the time asked for, the periods whose instant found the GPU idle
// included. Asked again after readings it was not asked at, it starts
// afresh (false) and then covers only what follows: never the spell in
// between, which a tenant that just turned ungated was charged as held.
TEST(NvmlMeterTest, TheDevicesBusyTimeCoversOnlyTheSpellsItWasAskedFor) {
  const std::string out = output_of_child([]() -> std::string {
    const std::string state = "/tmp/fracgpu-meter-sim-" + std::to_string(getpid());
    setenv("SIMCUDA_STATE", state.c_str(), 1);
    setenv("SIMCUDA_DEVICES", kDevices.c_str(), 1);
    setenv("SIMNVML_SAMPLE_MS", "20", 1);
    unsetenv("SIMNVML_FAULTS");
    // The sim first: the stand-in NVML finds it by its soname.
    void* sim = dlopen(SIMCUDA_DIR "/libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    const auto device_busy = sim == nullptr ? nullptr
                                            : reinterpret_cast<uint64_t (*)(int)>(dlsym(sim, "simcuda_device_busy_ns"));
    std::string problem;
    std::unique_ptr<controller::Nvml> nvml = controller::Nvml::open(SIMNVML_DIR "/libnvidia-ml.so.1", &problem);
    nvmlDevice_t device{};
    if (device_busy == nullptr || nvml == nullptr || nvml->api().get_handle(0, &device) != NVML_SUCCESS)
      return "setup failed: " + problem;
    // About 0.6 busy: one 0.6 ms kernel at a time, launched before 1 ms of host work.
    const pid_t load = fork();
    if (load == 0) {
      execl(LOAD_PATH, LOAD_PATH, "devices=0", "kernels_us=600", "host_us=1000", "ahead_us=0", "seconds=5",
            static_cast<char*>(nullptr));
      _exit(127);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(500));
    controller::NvmlMeter meter(*nvml, device);
    std::vector<controller::ProcessUse> uses;
    // Reads every 2 ms for `ms`, asking for the device's figure after each
    // reading if `ask`: the figures' sum, the driver's busy time meanwhile,
    // and whether the first answer was "afresh".
    struct Phase {
      uint64_t figure = 0, truth = 0;
      bool first_refused = false;
    };
    const auto phase = [&](int ms, bool ask) {
      Phase p;
      const uint64_t before = device_busy(0);
      const auto end = std::chrono::steady_clock::now() + std::chrono::milliseconds(ms);
      bool first = true;
      while (std::chrono::steady_clock::now() < end) {
        uses.clear();
        if (meter.read(ledger::monotonic_ns(), &uses) && ask) {
          uint64_t busy = 0;
          const bool ok = meter.device_busy(&busy);
          if (first) p.first_refused = !ok;
          first = false;
          p.figure += ok ? busy : 0;
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(2));
      }
      p.truth = device_busy(0) - before;
      return p;
    };
    const Phase asked = phase(1500, true), skipped = phase(1000, false), again = phase(1500, true);
    kill(load, SIGKILL);
    waitpid(load, nullptr, 0);
    std::remove(state.c_str());
    std::ostringstream text;
    text << asked.figure << " " << asked.truth << " " << asked.first_refused << " " << skipped.truth << " "
         << again.figure << " " << again.truth << " " << again.first_refused;
    return text.str();
  });
  std::istringstream in(out);
  uint64_t figure1 = 0, truth1 = 0, skipped = 0, figure3 = 0, truth3 = 0;
  bool refused1 = false, refused3 = false;
  ASSERT_TRUE(in >> figure1 >> truth1 >> refused1 >> skipped >> figure3 >> truth3 >> refused3) << out;
  printf("device figure %.3f s for %.3f s busy; skipped %.3f s busy; then %.3f s for %.3f s\n", figure1 / 1e9,
         truth1 / 1e9, skipped / 1e9, figure3 / 1e9, truth3 / 1e9);
  EXPECT_TRUE(refused1) << "the first answer only sets where the next begins";
  EXPECT_TRUE(refused3) << "asked after readings it was not asked at: afresh";
  // The load shares the host's CPUs with whatever else runs: a third of
  // the phase busy is enough to tell the spells apart (one run beside the
  // suite kept it 0.45 s busy of 1.5 s).
  ASSERT_GT(truth1, 300'000'000u) << "the load kept the GPU busy";
  ASSERT_GT(skipped, 200'000'000u);
  // A phase's ends and the sampled periods' ends differ by up to a period
  // (20 ms) each, the first answer's period is not counted, and whole
  // percent truncates: 6 %, and never less than those two periods.
  const auto bound = [](uint64_t truth) { return std::max(0.06 * static_cast<double>(truth), 40e6); };
  EXPECT_NEAR(static_cast<double>(figure1), static_cast<double>(truth1), bound(truth1));
  EXPECT_NEAR(static_cast<double>(figure3), static_cast<double>(truth3), bound(truth3))
      << "not the skipped spell's " << skipped << " ns too";
}

// ---- Config keys ----

TEST(NvmlConfig, HealthAndAuditKeysAreValidatedWithFileAndLine) {
  const std::vector<controller::DiscoveredGpu> node{{0, kUuid, "Sim A", 16ull << 30}};
  auto parse = [&](const std::string& daemon_keys) {
    return controller::parse_config("[daemon]\n" + daemon_keys + "\n[[gpu]]\nindex = 0\n", "node.toml", node);
  };
  const auto good = parse("health_interval = \"250ms\"\naudit_interval = \"2s\"\naudit_action = \"deny\"");
  ASSERT_TRUE(good.ok()) << (good.errors.empty() ? "" : good.errors[0].to_string());
  EXPECT_EQ(good.config->daemon.health_interval, 250ms);
  EXPECT_EQ(good.config->daemon.audit_interval, 2s);
  EXPECT_EQ(good.config->daemon.audit_action, controller::AuditAction::kDeny);
  const auto defaults = parse("");
  ASSERT_TRUE(defaults.ok());
  EXPECT_EQ(defaults.config->daemon.audit_action, controller::AuditAction::kReport);
  EXPECT_EQ(defaults.config->daemon.health_interval, 5s);

  const auto bad = parse("audit_action = \"kill\"\nhealth_interval = \"1ms\"\naudit_interval = 5");
  ASSERT_EQ(bad.errors.size(), 3u);
  EXPECT_EQ(bad.errors[0].to_string(),
            "node.toml:2: [daemon]: audit_action \"kill\" is not an audit action (use report, deny, terminate)");
  EXPECT_NE(bad.errors[1].to_string().find("node.toml:3: [daemon]: health_interval \"1ms\" is out of range"),
            std::string::npos)
      << bad.errors[1].to_string();
  EXPECT_NE(bad.errors[2].to_string().find("node.toml:4:"), std::string::npos) << bad.errors[2].to_string();
}

TEST(NvmlConfig, MemoryAuditKeysAreValidatedWithFileAndLine) {
  const std::vector<controller::DiscoveredGpu> node{{0, kUuid, "Sim A", 16ull << 30}};
  auto parse = [&](const std::string& daemon_keys) {
    return controller::parse_config("[daemon]\n" + daemon_keys + "\n[[gpu]]\nindex = 0\n", "node.toml", node);
  };
  const auto defaults = parse("");
  ASSERT_TRUE(defaults.ok());
  EXPECT_EQ(defaults.config->daemon.memory_audit.action, controller::MemoryAuditAction::kTerminate);
  EXPECT_EQ(defaults.config->daemon.memory_audit.grace, 1s);
  EXPECT_EQ(defaults.config->daemon.memory_audit.tolerance, 512ull << 20);
  const auto good = parse("memory_audit_interval = \"100ms\"\nmemory_grace = \"0s\"\nmemory_tolerance = \"1GiB\"\n"
                          "memory_audit_action = \"report\"");
  ASSERT_TRUE(good.ok()) << (good.errors.empty() ? "" : good.errors[0].to_string());
  EXPECT_EQ(good.config->daemon.memory_audit.interval, 100ms);
  EXPECT_EQ(good.config->daemon.memory_audit.grace, 0s);
  EXPECT_EQ(good.config->daemon.memory_audit.tolerance, 1ull << 30);
  EXPECT_EQ(good.config->daemon.memory_audit.action, controller::MemoryAuditAction::kReport);

  const auto bad = parse("memory_audit_action = \"stop\"\nmemory_grace = \"90s\"\nmemory_tolerance = -1");
  ASSERT_EQ(bad.errors.size(), 3u);
  EXPECT_EQ(bad.errors[0].to_string(),
            "node.toml:2: [daemon]: memory_audit_action \"stop\" is not a memory audit action (use report, terminate)");
  EXPECT_NE(bad.errors[1].to_string().find("node.toml:3: [daemon]: memory_grace \"90s\" is out of range"),
            std::string::npos)
      << bad.errors[1].to_string();
  EXPECT_NE(bad.errors[2].to_string().find("node.toml:4:"), std::string::npos) << bad.errors[2].to_string();
}

TEST(NvmlConfig, UnownedAllowanceAndNodeAgentCgroupsAreValidatedWithFileAndLine) {
  const std::vector<controller::DiscoveredGpu> node{{0, kUuid, "Sim A", 16ull << 30}};
  auto parse = [&](const std::string& daemon_keys) {
    return controller::parse_config("[daemon]\n" + daemon_keys + "\n[[gpu]]\nindex = 0\n", "node.toml", node);
  };
  const auto defaults = parse("");
  ASSERT_TRUE(defaults.ok());
  EXPECT_EQ(defaults.config->daemon.memory_audit.unowned_allowance, 512ull << 20);
  EXPECT_TRUE(defaults.config->daemon.memory_audit.node_agent_cgroups.empty());
  const auto good = parse("unowned_memory_allowance = \"0\"\n"
                          "node_agent_cgroups = [\"/system.slice/dcgm.service\", \"/agents\"]");
  ASSERT_TRUE(good.ok()) << (good.errors.empty() ? "" : good.errors[0].to_string());
  EXPECT_EQ(good.config->daemon.memory_audit.unowned_allowance, 0u);
  EXPECT_EQ(good.config->daemon.memory_audit.node_agent_cgroups,
            (std::vector<std::string>{"/system.slice/dcgm.service", "/agents"}));

  const auto bad = parse("unowned_memory_allowance = \"lots\"\nnode_agent_cgroups = [\n  \"/\",\n  \"system.slice\",\n"
                         "  \"/a/../b\",\n  \"/a/\",\n  7,\n]\nnode_agent_cgroups2 = 1");
  ASSERT_EQ(bad.errors.size(), 7u);
  EXPECT_NE(bad.errors[0].to_string().find("node.toml:2: [daemon]: unowned_memory_allowance \"lots\""),
            std::string::npos)
      << bad.errors[0].to_string();
  EXPECT_EQ(bad.errors[1].to_string(), "node.toml:4: [daemon]: node_agent_cgroups \"/\" is the root cgroup: it would "
                                       "exempt every process, tenants' escaped ones included");
  EXPECT_EQ(bad.errors[2].to_string(), "node.toml:5: [daemon]: node_agent_cgroups \"system.slice\" must be an "
                                       "absolute cgroup path (as /proc/<pid>/cgroup shows it)");
  EXPECT_NE(bad.errors[3].to_string().find("node.toml:6: [daemon]: node_agent_cgroups \"/a/../b\" must not hold"),
            std::string::npos)
      << bad.errors[3].to_string();
  EXPECT_EQ(bad.errors[4].to_string(), "node.toml:7: [daemon]: node_agent_cgroups \"/a/\" must not end in \"/\"");
  EXPECT_NE(bad.errors[5].to_string().find("node.toml:8:"), std::string::npos) << bad.errors[5].to_string();
  EXPECT_NE(bad.errors[6].to_string().find("node.toml:10:"), std::string::npos) << bad.errors[6].to_string();
  const auto not_a_list = parse("node_agent_cgroups = \"/agents\"");
  ASSERT_EQ(not_a_list.errors.size(), 1u);
  EXPECT_NE(not_a_list.errors[0].to_string().find("node.toml:2: [daemon]: node_agent_cgroups must be an array"),
            std::string::npos)
      << not_a_list.errors[0].to_string();
}

// ---- Attribution, fed fabricated /proc ----

// Processes as the kernel would show them, written by the test.
class FabricatedProc : public controller::ProcessReader {
 public:
  int32_t self() const override { return kDaemon; }
  std::optional<controller::KernelTies> ties(int32_t pid) const override {
    const auto it = ties_.find(pid);
    if (it == ties_.end()) return std::nullopt;
    return it->second;
  }
  std::set<std::string> mounted_tenants(int32_t pid) const override {
    const auto it = mounts_.find(pid);
    return it == mounts_.end() ? std::set<std::string>{} : it->second;
  }
  static constexpr int32_t kDaemon = 100;
  std::map<int32_t, controller::KernelTies> ties_;
  std::map<int32_t, std::set<std::string>> mounts_;
};

TEST(Attribution, ProcFilesAreParsedAsTheKernelWritesThem) {
  const std::string cgroup = "12:memory:/kubepods/x\n1:name=systemd:/system.slice/a:b.service\n0::/kubepods/pod1/ctr\n";
  EXPECT_EQ(controller::cgroup_path_in(cgroup, ""), "/kubepods/pod1/ctr");
  EXPECT_EQ(controller::cgroup_path_in(cgroup, "name=systemd"), "/system.slice/a:b.service");  // ':' in a path
  EXPECT_EQ(controller::cgroup_path_in("4:memory:/x\n", ""), "");
  EXPECT_EQ(controller::parent_pid_in("Name:\tsh\nState:\tS\nTgid:\t42\nPid:\t42\nPPid:\t7\n"), 7);
  EXPECT_EQ(controller::parent_pid_in("PPid:\t0\n"), 0);
  EXPECT_EQ(controller::parent_pid_in("Name:\tPPid: 9\n"), 0);  // a name is not a field
  EXPECT_TRUE(controller::cgroup_within("/a/b", "/a"));
  EXPECT_TRUE(controller::cgroup_within("/a", "/a"));
  EXPECT_FALSE(controller::cgroup_within("/ab", "/a"));
  EXPECT_FALSE(controller::cgroup_within("/a", "/a/b"));  // the reverse never
  EXPECT_FALSE(controller::cgroup_within("", "/a"));
}

// Each tie on its own: a process is its tenant's by what it cannot leave
// (its cgroup, its PID namespace's ancestry, its parents), however it
// rearranged its mounts; and never by anything that reads the other way.
TEST(Attribution, ByCgroupPidNamespaceAndParentsNeverTheReverse) {
  using controller::KernelTies;
  FabricatedProc proc;
  const std::string host_mnt = "mnt:[4026531840]";
  proc.ties_[FabricatedProc::kDaemon] = KernelTies{"/system.slice/fracgpud.service", "", host_mnt, {}, 1};
  // alice: a container (own mount and PID namespaces, its own cgroup).
  proc.ties_[200] = KernelTies{"/kubepods/pod-a/ctr-a", "", "mnt:[2]", {20}, 150};
  proc.ties_[150] = KernelTies{"/kubepods/pod-a/ctr-a", "", "mnt:[2]", {20}, 1};  // its container's init
  // bob: on the host, in a login session, verified too.
  proc.ties_[300] = KernelTies{"/user.slice/session-1.scope", "", host_mnt, {}, 290};
  // carol: a container that shares the daemon's cgroup (ties nothing by cgroup).
  proc.ties_[400] = KernelTies{"/system.slice/fracgpud.service", "", "mnt:[4]", {}, 1};
  const std::map<int32_t, std::string> charged{{200, "alice"}, {300, "bob"}, {400, "carol"}};
  const controller::TenantContainers containers(charged, proc);
  const auto tenants = [&](int32_t pid, KernelTies t) {
    proc.ties_[pid] = std::move(t);
    return containers.tenants_of(pid);
  };
  using Set = std::set<std::string>;
  // unshare -U -r -m, pivot_root, a sub-cgroup of its own: the cgroup tells.
  EXPECT_EQ(tenants(501, {"/kubepods/pod-a/ctr-a/escaped", "", "mnt:[9]", {}, 1}), Set{"alice"});
  // A new PID namespace beneath the container's, a cgroup elsewhere: the PID namespace tells.
  EXPECT_EQ(tenants(502, {"/elsewhere", "", "mnt:[9]", {25, 20}, 1}), Set{"alice"});
  // Nothing but its parent chain: a grandchild of alice's verified process.
  proc.ties_[503] = KernelTies{"/elsewhere", "", "mnt:[9]", {}, 200};
  EXPECT_EQ(tenants(504, {"/elsewhere", "", "mnt:[9]", {}, 503}), Set{"alice"});
  // A child of bob's verified process on the host is bob's...
  EXPECT_EQ(tenants(505, {"/user.slice/session-1.scope", "", host_mnt, {}, 300}), Set{"bob"});
  // ...but another process of that login session is not: a host cgroup names no container.
  EXPECT_EQ(tenants(506, {"/user.slice/session-1.scope", "", host_mnt, {}, 1}), Set{});
  // A sibling cgroup whose name merely starts the same, and the pod above
  // alice's container (the reverse of a prefix): nobody's.
  EXPECT_EQ(tenants(507, {"/kubepods/pod-a/ctr-ab", "", "mnt:[9]", {}, 1}), Set{});
  EXPECT_EQ(tenants(508, {"/kubepods/pod-a", "", "mnt:[9]", {}, 1}), Set{});
  // The daemon's own cgroup ties nobody to carol.
  EXPECT_EQ(tenants(509, {"/system.slice/fracgpud.service", "", "mnt:[9]", {}, 1}), Set{});
  // Mounts still count, and every tie is kept: a container with two claims.
  proc.mounts_[510] = {"dave"};
  EXPECT_EQ(tenants(510, {"/kubepods/pod-a/ctr-a", "", "mnt:[9]", {}, 1}), (Set{"alice", "dave"}));
  // An ancestor with a tenant directory mounted (nothing verified beside it).
  proc.mounts_[511] = {"erin"};
  proc.ties_[511] = KernelTies{"/elsewhere", "", "mnt:[11]", {}, 1};
  EXPECT_EQ(tenants(512, {"/elsewhere", "", "mnt:[12]", {}, 511}), Set{"erin"});
  // cgroup v1's name=systemd hierarchy where v2 shows every process at "/".
  proc.ties_[FabricatedProc::kDaemon].systemd_cgroup = "/system.slice/fracgpud.service";
  proc.ties_[600] = KernelTies{"/", "/docker/ctr-f", "mnt:[6]", {}, 1};
  const std::map<int32_t, std::string> v1{{600, "frank"}};
  const controller::TenantContainers v1_containers(v1, proc);
  proc.ties_[601] = KernelTies{"/", "/docker/ctr-f/inner", "mnt:[9]", {}, 1};
  EXPECT_EQ(v1_containers.tenants_of(601), Set{"frank"});
  proc.ties_[602] = KernelTies{"/", "/docker", "mnt:[9]", {}, 1};
  EXPECT_EQ(v1_containers.tenants_of(602), Set{});
  // Gone: nobody's, and no crash.
  EXPECT_EQ(containers.tenants_of(999), Set{});
}

// What a process shows in /proc is its own to shape: its environment can
// be any range of its address space (prctl PR_SET_MM_MAP, no privilege
// needed), a terabyte of it for nothing. The audit reads a claim from the first MiB and no more: a
// claim 4 MiB in is not read, one at the start still is.
TEST(Attribution, AnEnvironmentOfAnySizeIsReadOnlyToItsFirstMebibyte) {
  const auto claim_at = [](size_t offset, std::string* claimed) -> bool {
    constexpr size_t kSize = 64 << 20;
    int ready[2];
    if (pipe(ready) != 0) return false;
    const pid_t child = fork();
    if (child == 0) {
      auto* base = static_cast<char*>(mmap(nullptr, kSize, PROT_READ | PROT_WRITE,
                                           MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0));
      char ok = 0;
      // PR_SET_MM_MAP (no capability needed) takes the whole layout: the
      // rest as /proc/self/stat has it, fields 26-28 and 45-49.
      char stat[4096] = {};
      const int fd = open("/proc/self/stat", O_RDONLY);
      const ssize_t got = fd >= 0 ? read(fd, stat, sizeof stat - 1) : -1;
      const char* rest = got > 0 ? strrchr(stat, ')') : nullptr;
      if (base != MAP_FAILED && rest != nullptr) {
        std::vector<unsigned long> field(3);  // fields 1 and 2 (pid, comm) before ')'
        std::istringstream words(rest + 2);
        for (std::string w; words >> w;) field.push_back(std::strtoul(w.c_str(), nullptr, 10));
        memset(base, 'x', offset);  // one long variable, then the claim
        if (offset > 0) base[offset - 1] = '\0';
        strcpy(base + offset, "FRACGPU_TENANT=mallory");
        if (field.size() > 49) {
          prctl_mm_map map{};
          map.start_code = field[26], map.end_code = field[27], map.start_stack = field[28];
          map.start_data = field[45], map.end_data = field[46], map.start_brk = field[47];
          map.brk = reinterpret_cast<unsigned long>(sbrk(0));
          map.arg_start = field[48], map.arg_end = field[49];
          map.env_start = reinterpret_cast<unsigned long>(base), map.env_end = map.env_start + kSize;
          map.exe_fd = static_cast<uint32_t>(-1);
          ok = prctl(PR_SET_MM, PR_SET_MM_MAP, reinterpret_cast<unsigned long>(&map), sizeof map, 0) == 0;
        }
      }
      if (write(ready[1], &ok, 1) != 1) _exit(1);
      pause();
      _exit(0);
    }
    char ok = 0;
    const bool read_back = read(ready[0], &ok, 1) == 1 && ok;
    if (read_back) *claimed = controller::claimed_tenant_of_process(child, "/run/fracgpu");
    kill(child, SIGKILL);
    waitpid(child, nullptr, 0);
    close(ready[0]);
    close(ready[1]);
    return read_back;
  };
  std::string near, far;
  if (!claim_at(0, &near)) GTEST_SKIP() << "prctl(PR_SET_MM_MAP) refused here (a kernel without CONFIG_CHECKPOINT_RESTORE)";
  EXPECT_EQ(near, "mallory");
  ASSERT_TRUE(claim_at(4 << 20, &far));
  EXPECT_EQ(far, "");
}

// A daemon under systemd's sandboxing (PrivateTmp, ProtectSystem: the
// shipped unit) runs in a mount namespace of its own. A tenant's verified
// process on the host is then in PID 1's mount namespace, not the daemon's,
// and is still on the host: neither that namespace nor its login session
// ties anybody else's process to the tenant.
TEST(Attribution, AHostProcessIsOnTheHostBesideADaemonWithItsOwnMounts) {
  using controller::KernelTies;
  FabricatedProc proc;
  const std::string host_mnt = "mnt:[4026531840]";
  proc.ties_[1] = KernelTies{"/init.scope", "", host_mnt, {}, 0};
  proc.ties_[FabricatedProc::kDaemon] = KernelTies{"/system.slice/fracgpud.service", "", "mnt:[4026532500]", {}, 1};
  // bob: verified, on the host, in a login session.
  proc.ties_[300] = KernelTies{"/user.slice/session-1.scope", "", host_mnt, {}, 290};
  // alice: a container.
  proc.ties_[200] = KernelTies{"/kubepods/pod-a/ctr-a", "", "mnt:[2]", {20}, 150};
  const std::map<int32_t, std::string> charged{{200, "alice"}, {300, "bob"}};
  const controller::TenantContainers containers(charged, proc);
  const auto tenants = [&](int32_t pid, KernelTies t) {
    proc.ties_[pid] = std::move(t);
    return containers.tenants_of(pid);
  };
  using Set = std::set<std::string>;
  // A node agent on the host, another user's job in the same login session: nobody's.
  EXPECT_EQ(tenants(401, {"/system.slice/dcgm.service", "", host_mnt, {}, 1}), Set{});
  EXPECT_EQ(tenants(402, {"/user.slice/session-1.scope", "", host_mnt, {}, 1}), Set{});
  // bob's own child is still bob's, and alice's container still ties.
  EXPECT_EQ(tenants(403, {"/user.slice/session-1.scope", "", host_mnt, {}, 300}), Set{"bob"});
  EXPECT_EQ(tenants(404, {"/elsewhere", "", "mnt:[2]", {}, 1}), Set{"alice"});
}

// ---- The daemon with NVML: health and audit ----

class NvmlDaemonTest : public ::testing::Test {
 protected:
  void TearDown() override {
    // Only children not yet reaped: a reaped PID may already name another process.
    for (pid_t pid : children_)
      if (waitpid(pid, nullptr, WNOHANG) == 0) kill_and_reap(pid);
    kill_and_reap(daemon_);
    // Deepest first; a cgroup empties once its processes are gone (a moment after their reaping).
    for (auto it = cgroups_.rbegin(); it != cgroups_.rend(); ++it)
      eventually([&] { return rmdir(it->c_str()) == 0 || errno == ENOENT; }, 2000ms);
  }

  // A cgroup (v2) of the test's own at `name` (nested with "/"), made on the
  // node's cgroup2 mount: (its directory, its path as /proc/<pid>/cgroup
  // shows it). Empty where none can be made (not root, no writable cgroup2).
  std::pair<std::string, std::string> make_cgroup(const std::string& name) {
    std::istringstream mounts(read_file("/proc/self/mounts"));
    std::string device, mount_point, type, rest;
    while (mounts >> device >> mount_point >> type && std::getline(mounts, rest)) {
      if (type != "cgroup2") continue;
      // Only where the test itself sits at the root: then paths under the
      // mount are the paths /proc/<pid>/cgroup shows.
      if (controller::cgroup_path_in(read_file("/proc/self/cgroup"), "") != "/") return {};
      const std::string relative = "/fracgpu-test-" + std::to_string(getpid()) + "/" + name;
      std::error_code ec;
      size_t from = 1;
      for (size_t slash = relative.find('/', from); from <= relative.size(); slash = relative.find('/', from)) {
        const std::string dir = mount_point + relative.substr(0, slash == std::string::npos ? relative.size() : slash);
        if (!fs::exists(dir)) {
          if (!fs::create_directory(dir, ec)) return {};
          cgroups_.push_back(dir);
        }
        if (slash == std::string::npos) break;
        from = slash + 1;
      }
      return {mount_point + relative, relative};
    }
    return {};
  }

  // `args` started in cgroup `dir` (make_cgroup's directory) by a shell that
  // moves itself there and execs them: the returned PID is theirs.
  pid_t spawn_in_cgroup(const std::string& dir, const std::vector<std::string>& args, const std::string& log) {
    std::string script = "echo $$ > '" + dir + "/cgroup.procs' && exec";
    for (const std::string& a : args) script += " '" + a + "'";
    return spawn({"/bin/sh", "-c", script}, environment(true), log);
  }

  // The host PID of the fracgpu_probe started with `sleep-ms <marker>`
  // among its commands (how a probe deep inside namespaces is found); 0 if none.
  static pid_t probe_marked(const std::string& marker) {
    const std::string wanted = std::string(PROBE_PATH) + '\0';
    const std::string mark = std::string("sleep-ms") + '\0' + marker + '\0';
    for (const auto& entry : fs::directory_iterator("/proc")) {
      const std::string name = entry.path().filename();
      if (name.find_first_not_of("0123456789") != std::string::npos) continue;
      const std::string cmdline = read_file(entry.path() / "cmdline");
      if (cmdline.starts_with(wanted) && cmdline.find(mark) != std::string::npos) return std::stoi(name);
    }
    return 0;
  }

  // `extra`: more [daemon] lines; `every`: the health and audit interval.
  void write_config(const std::string& audit_action = "report", const std::string& extra = "",
                    const std::string& every = "20ms") {
    write_file(config_path_, "[daemon]\nrun_dir = \"" + run_dir_ +
                                 "\"\nreap_interval_ms = 20\nlog_level = \"debug\"\n" +
                                 (extra.find("metrics_address") == std::string::npos ? "metrics_address = \"off\"\n" : "") +
                                 "health_interval = \"" + every + "\"\naudit_interval = \"" + every +
                                 "\"\naudit_action = \"" + audit_action + "\"\n" + extra +
                                 "[[gpu]]\nindex = 0\n[[tenant]]\nname = \"alice\"\ngpus = 0.5\ndevices = [0]\n");
  }

  // Faults for the stand-in NVML, replaced atomically (it re-reads the file on every call).
  void set_faults(const std::string& text) {
    write_file(faults_path_ + ".new", text);
    fs::rename(faults_path_ + ".new", faults_path_);
  }

  std::vector<std::string> environment(bool with_nvml) const {
    return {"LD_LIBRARY_PATH=" + std::string(with_nvml ? SIMNVML_DIR ":" : "") + SIMCUDA_DIR,
            "SIMCUDA_DEVICES=" + devices_,
            "SIMCUDA_STATE=" + (tmp_ / "sim-state"),
            "SIMNVML_FAULTS=" + faults_path_,
            "PATH=/usr/bin:/bin"};
  }

  pid_t spawn(const std::vector<std::string>& args, std::vector<std::string> env, const std::string& log) {
    const pid_t pid = fork();
    if (pid == 0) {
      const int fd = open(log.c_str(), O_WRONLY | O_CREAT | O_APPEND, 0644);
      dup2(fd, 1);
      dup2(fd, 2);
      std::vector<char*> argv, envp;
      for (const std::string& a : args) argv.push_back(const_cast<char*>(a.c_str()));
      argv.push_back(nullptr);
      for (std::string& e : env) envp.push_back(e.data());
      envp.push_back(nullptr);
      execve(argv[0], argv.data(), envp.data());
      _exit(127);
    }
    children_.push_back(pid);
    return pid;
  }

  void start_daemon(bool with_nvml = true) {
    daemon_ = spawn({FRACGPUD_PATH, "--config", config_path_}, environment(with_nvml), log_path_);
    children_.pop_back();
    // health.json is written after the first probe, which registers for Xid
    // events: an Xid injected before that would (as with real NVML) be missed.
    ASSERT_TRUE(eventually([&] {
      return fs::exists(run_dir_ + "/tenants/alice/policy") && log_contains("started") &&
             (!with_nvml || fs::exists(run_dir_ + "/health.json"));
    })) << daemon_log();
  }

  // fracgpud with NVML, no faults, and the given audit action.
  void start_with(const std::string& audit_action) {
    write_config(audit_action);
    set_faults("");
    start_daemon();
  }

  // A process holding 32 MiB on GPU 0 (with or without the interposer).
  pid_t holder(const std::string& name, bool preload) {
    return probe(name, {"init", "primary", "0", "alloc", "32MiB", "hold"}, preload);
  }

  // fracgpu_probe with the given commands; under the interposer as alice
  // unless `preload` is false. Its output goes to `name`.log.
  pid_t probe(const std::string& name, const std::vector<std::string>& commands, bool preload = true,
              const std::string& tenant_dir = "") {
    std::vector<std::string> args{PROBE_PATH};
    args.insert(args.end(), commands.begin(), commands.end());
    std::vector<std::string> env = environment(true);
    env.push_back("FRACGPU_TENANT_DIR=" + (tenant_dir.empty() ? run_dir_ + "/tenants/alice" : tenant_dir));
    if (preload) env.push_back(std::string("LD_PRELOAD=") + FRACGPU_LIB);
    return spawn(args, env, tmp_ / (name + ".log"));
  }
  std::string probe_output(const std::string& name) const { return read_file(tmp_ / (name + ".log")); }

  static bool can_make_containers() { return system("unshare -m --propagation private true 2>/dev/null") == 0; }

  // fracgpu_probe without the interposer in a container of `tenant`'s: a
  // private mount namespace with the tenant's directory mounted into it, as
  // docs/containers.md does. Its environment names no tenant.
  // With several tenants: a container with several claims, each mounted at
  // a path of its own.
  pid_t in_container(const std::string& name, const std::string& tenant, const std::vector<std::string>& commands) {
    return in_container(name, std::vector<std::string>{tenant}, commands);
  }
  pid_t in_container(const std::string& name, const std::vector<std::string>& tenants,
                     const std::vector<std::string>& commands) {
    std::string script;
    for (const std::string& tenant : tenants) {
      const std::string mount_point = tmp_ / ("container-" + name) + "/" + tenant;
      fs::create_directories(mount_point);
      script += "mount --bind '" + run_dir_ + "/tenants/" + tenant + "' '" + mount_point + "' && ";
    }
    script += std::string("exec '") + PROBE_PATH + "'";
    for (const std::string& c : commands) script += " " + c;
    return spawn({"/usr/bin/unshare", "-m", "--propagation", "private", "/bin/sh", "-c", script}, environment(true),
                 tmp_ / (name + ".log"));
  }
  bool probe_says(const std::string& name, const std::string& text) const {
    return probe_output(name).find(text) != std::string::npos;
  }

  // `fracgpu <args> --run-dir <run dir>`: (exit code, output).
  std::pair<int, std::string> cli(std::vector<std::string> args) {
    args.insert(args.begin(), FRACGPU_CLI_PATH);
    args.push_back("--run-dir");
    args.push_back(run_dir_);
    const std::string log = tmp_ / "cli.out";
    fs::remove(log);
    const int rc = wait_exit(spawn(args, environment(true), log), 10s);
    return {rc, read_file(log)};
  }

  // `fracgpu status` (text, or --json) on the test's run dir.
  std::string status(bool json = false) {
    std::vector<std::string> args{FRACGPU_CLI_PATH, "status", "--run-dir", run_dir_};
    if (json) args.push_back("--json");
    const std::string log = tmp_ / "status.out";
    fs::remove(log);
    wait_exit(spawn(args, environment(true), log), 10s);
    return read_file(log);
  }

  // The control API, spoken to directly.
  control::Reply control_call(const nlohmann::json& request) const {
    return control::call(control::socket_path_in(run_dir_), request, 10s);
  }
  // create or resize: `name` with share 0.25 and `memory` on GPU 0.
  control::Reply put_tenant(const char* op, const std::string& name, uint64_t memory) const {
    const nlohmann::json gpu = {{"uuid", kUuid}, {"share", 0.25}, {"memory", memory}};
    return control_call({{"op", op}, {"tenant", {{"name", name}, {"gpus", nlohmann::json::array({gpu})}}}});
  }
  // GPU 0's memory that the daemon's book leaves free (the node request);
  // -1 when the daemon does not answer.
  int64_t free_memory() const {
    const control::Reply r = control_call({{"op", "node"}});
    if (!r.ok) return -1;
    return r.body["node"]["gpus"][0]["free_memory"].get<int64_t>();
  }
  // SIGKILL, and a new daemon on the same run dir, ready once its control
  // API answers (what it read back at start is applied by then).
  void kill_and_restart() {
    kill_and_reap(daemon_);
    daemon_ = spawn({FRACGPUD_PATH, "--config", config_path_}, environment(true), log_path_);
    children_.pop_back();
    ASSERT_TRUE(eventually([&] { return control_call({{"op", "node"}}).ok; }, 10s)) << daemon_log();
  }

  std::string daemon_log() const { return read_file(log_path_); }
  bool log_contains(const std::string& text) const { return daemon_log().find(text) != std::string::npos; }

  nlohmann::json health() const {
    const std::string text = read_file(run_dir_ + "/health.json");
    return nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  }

  // alice's entry for GPU 0: (unavailable, detail).
  std::pair<uint32_t, uint32_t> alice_mark() {
    ledger::TenantLedger l;
    char err[256];
    if (ledger::open_ledger((run_dir_ + "/tenants/alice").c_str(), ledger::AccessMode::kReadOnly, nullptr, &l, err,
                            sizeof err) != ledger::LedgerError::kOk)
      return {UINT32_MAX, 0};
    ledger::GpuTable table;
    ledger::read_gpu_table(l, &table);
    const int e = ledger::find_gpu(table, controller::parse_gpu_uuid(kUuid)->data());
    std::pair<uint32_t, uint32_t> mark{UINT32_MAX, 0};
    if (e >= 0) mark = {table.gpus[e].unavailable, table.gpus[e].unavailable_detail};
    ledger::close_ledger(&l);
    return mark;
  }

  bool finding_for(pid_t pid) const {
    const nlohmann::json h = health();
    if (!h.is_object()) return false;
    for (const auto& f : h["audit"]["findings"])
      if (f["pid"] == pid) return true;
    return false;
  }

  TempDir tmp_;
  std::string run_dir_ = tmp_ / "run";
  std::string config_path_ = tmp_ / "fracgpud.toml";
  std::string log_path_ = tmp_ / "fracgpud.log";
  std::string faults_path_ = tmp_ / "nvml-faults";
  std::string devices_ = kDevices;
  std::vector<pid_t> children_;
  std::vector<std::string> cgroups_;  // made by make_cgroup, removed at the end
  pid_t daemon_ = -1;
};

TEST_F(NvmlDaemonTest, StartsWithoutNvmlAndSaysHealthAndAuditAreOff) {
  write_config();
  start_daemon(/*with_nvml=*/false);
  EXPECT_TRUE(eventually([&] { return log_contains("GPU health, the bypass audit and the memory audit are off"); })) << daemon_log();
  EXPECT_TRUE(log_contains("NVML is not available (libnvidia-ml.so.1)")) << daemon_log();
  EXPECT_TRUE(log_contains("found GPU 0 " + kUuid + " (Sim A, 16 GiB, 100 SMs)")) << daemon_log();
  // Processes still start: nothing is marked.
  const pid_t p = probe("p", {"init", "primary", "0", "alloc", "16MiB", "hold"});
  EXPECT_TRUE(eventually([&] { return probe_says("p", "holding="); })) << probe_output("p");
  EXPECT_TRUE(probe_says("p", "init=0\n")) << probe_output("p");
  (void)p;
  // health.json is written just after that log line, at the daemon's pace.
  std::string text;
  EXPECT_TRUE(eventually([&] {
    text = status();
    return text.find("GPU health: off (no NVML: NVML is not available (libnvidia-ml.so.1)") != std::string::npos;
  })) << text;
}

TEST_F(NvmlDaemonTest, CriticalXidMarksGpuUnhealthyNewProcessesRefusedRunningOnesKeepWorking) {
  start_with("report");
  EXPECT_TRUE(log_contains("NVML: GPUs listed by NVML")) << daemon_log();
  // A process that started while the GPU was healthy, and allocates again later.
  const pid_t running = probe("running", {"init", "primary", "0", "alloc", "16MiB", "sleep-ms", "3000", "alloc",
                                          "16MiB", "hold"});
  ASSERT_TRUE(eventually([&] { return probe_says("running", "alloc=0"); })) << probe_output("running");

  set_faults("0 xid=79\n");  // GPU fell off the bus
  ASSERT_TRUE(eventually([&] { return alice_mark().first == ledger::kGpuXid; }, 2000ms)) << daemon_log();
  EXPECT_EQ(alice_mark().second, 79u);
  // Marked while the running process was still in its sleep.
  const std::string before = probe_output("running");
  EXPECT_EQ(before.find("alloc=0\nalloc=0"), std::string::npos) << "marked too late for this check: " << before;
  EXPECT_TRUE(log_contains("health: GPU 0 (" + kUuid + ") is unhealthy: critical Xid 79 reported by NVML")) << daemon_log();

  const pid_t fresh = probe("fresh", {"init"});
  EXPECT_EQ(wait_exit(fresh, 5s), 0);
  EXPECT_TRUE(probe_says("fresh", "init=" + std::to_string(kDeviceUnavailable) + "\n")) << probe_output("fresh");
  EXPECT_TRUE(probe_says("fresh", "cuInit refused: device 0 (" + kUuid + ") is marked unavailable by fracgpud "
                                  "(critical Xid 79)"))
      << probe_output("fresh");

  // The running process was not killed and its next allocation succeeds.
  EXPECT_TRUE(eventually([&] { return probe_says("running", "alloc=0\nalloc=0\nholding="); }, 5000ms))
      << probe_output("running");
  EXPECT_EQ(kill(running, 0), 0);

  // Exported: health.json (what `fracgpu status` shows), logged once.
  const nlohmann::json h = health();
  ASSERT_TRUE(h.is_object());
  EXPECT_EQ(h["gpus"][0]["healthy"], false);
  EXPECT_EQ(h["gpus"][0]["reason"], "xid");
  EXPECT_EQ(h["gpus"][0]["last_xid"], 79);
  EXPECT_EQ(h["gpus"][1]["healthy"], true);
  const std::string text = status();
  EXPECT_NE(text.find("GPU health (NVML):"), std::string::npos) << text;
  EXPECT_NE(text.find("UNHEALTHY"), std::string::npos) << text;
  EXPECT_NE(text.find("critical Xid 79 reported by NVML"), std::string::npos) << text;
  const nlohmann::json j = nlohmann::json::parse(status(/*json=*/true), nullptr, false);
  ASSERT_TRUE(j.is_object());
  EXPECT_EQ(j["gpu_health"]["gpus"][0]["reason"], "xid");
  std::this_thread::sleep_for(200ms);  // several more probes
  const std::string log = daemon_log();
  const std::string line = "is unhealthy: critical Xid 79";
  EXPECT_EQ(log.find(line), log.rfind(line)) << "logged more than once:\n" << log;
}

TEST_F(NvmlDaemonTest, ApplicationXidIsNotAGpuFault) {
  start_with("report");
  set_faults("0 xid=13\n");  // graphics engine exception: the application's fault
  ASSERT_TRUE(eventually([&] { return log_contains("Xid 13 (an application fault"); })) << daemon_log();
  EXPECT_EQ(alice_mark().first, uint32_t{ledger::kGpuAvailable});
}

TEST_F(NvmlDaemonTest, LostGpuRefusesNewProcessesAndRecovers) {
  start_with("report");
  set_faults("0 lost\n");
  ASSERT_TRUE(eventually([&] { return alice_mark().first == ledger::kGpuLost; }, 2000ms)) << daemon_log();
  const pid_t refused = probe("refused", {"init"});
  EXPECT_EQ(wait_exit(refused, 5s), 0);
  EXPECT_TRUE(probe_says("refused", "init=" + std::to_string(kDeviceUnavailable) + "\n")) << probe_output("refused");
  EXPECT_TRUE(probe_says("refused", "(NVML cannot reach it)")) << probe_output("refused");

  set_faults("1 ecc=3\n");  // GPU 0 back; GPU 1 (no tenant) has uncorrected ECC errors
  ASSERT_TRUE(eventually([&] { return alice_mark().first == ledger::kGpuAvailable; }, 2000ms)) << daemon_log();
  EXPECT_TRUE(log_contains("health: GPU 0 (" + kUuid + ") is healthy again")) << daemon_log();
  EXPECT_TRUE(eventually([&] { return log_contains("3 uncorrected ECC error(s)"); })) << daemon_log();
  const pid_t accepted = probe("accepted", {"init"});
  EXPECT_EQ(wait_exit(accepted, 5s), 0);
  EXPECT_TRUE(probe_says("accepted", "init=0\n")) << probe_output("accepted");
}

TEST_F(NvmlDaemonTest, RestartedDaemonClearsMarksOfGpusThatRecovered) {
  start_with("report");
  set_faults("0 lost\n");
  ASSERT_TRUE(eventually([&] { return alice_mark().first == ledger::kGpuLost; }, 2000ms)) << daemon_log();
  kill_and_reap(daemon_);
  set_faults("");
  EXPECT_EQ(alice_mark().first, uint32_t{ledger::kGpuLost});  // the mark outlives the daemon
  start_daemon();
  EXPECT_TRUE(eventually([&] { return alice_mark().first == ledger::kGpuAvailable; }, 2000ms)) << daemon_log();
}

TEST_F(NvmlDaemonTest, AuditReportsProcessesWithoutTheInterposerOnly) {
  start_with("report");
  const pid_t managed = holder("managed", true);
  const pid_t bypass = holder("bypass", /*preload=*/false);
  ASSERT_TRUE(eventually([&] { return probe_says("managed", "holding=") && probe_says("bypass", "holding="); }));
  ASSERT_TRUE(eventually([&] { return finding_for(bypass); }, 3000ms)) << daemon_log();
  // On the host, outside any container: its tenant cannot be told, whatever it claims.
  EXPECT_TRUE(log_contains("audit: process " + std::to_string(bypass) +
                           " (fracgpu_probe, tenant unknown, claims \"alice\" (unverified)) uses"))
      << daemon_log();
  EXPECT_TRUE(log_contains("without being charged to any tenant (no interposer, or no tenant): reported")) << daemon_log();
  std::this_thread::sleep_for(200ms);  // many audit passes
  EXPECT_FALSE(finding_for(managed)) << read_file(run_dir_ + "/health.json");
  EXPECT_EQ(alice_mark().first, uint32_t{ledger::kGpuAvailable});  // report only: nothing denied
  EXPECT_EQ(kill(bypass, 0), 0);                                  // and nothing killed
  const std::string text = status();
  EXPECT_NE(text.find("bypass audit (action report): processes using a GPU uncharged:"), std::string::npos) << text;
  EXPECT_NE(text.find(std::to_string(bypass) + "  fracgpu_probe"), std::string::npos) << text;

  // Gone: no longer reported.
  kill_and_reap(bypass);
  EXPECT_TRUE(eventually([&] { return !finding_for(bypass); }, 3000ms)) << read_file(run_dir_ + "/health.json");
}

TEST_F(NvmlDaemonTest, AuditDenyRefusesTheTenantsNewProcessesUntilTheBypassEnds) {
  if (!can_make_containers()) GTEST_SKIP() << "unshare -m is not permitted here: no container to attribute it by";
  start_with("deny");
  // A process of alice's with its LD_PRELOAD stripped, in alice's container:
  // that, not its environment, is what ties it to alice.
  const pid_t bypass = in_container("bypass", "alice", {"init", "primary", "0", "alloc", "32MiB", "hold"});
  ASSERT_TRUE(eventually([&] { return alice_mark().first == ledger::kGpuBypassDenied; }, 3000ms)) << daemon_log();
  EXPECT_EQ(alice_mark().second, static_cast<uint32_t>(bypass));
  const pid_t refused = probe("refused", {"init"});
  EXPECT_EQ(wait_exit(refused, 5s), 0);
  EXPECT_TRUE(probe_says("refused", "init=" + std::to_string(kDeviceUnavailable) + "\n")) << probe_output("refused");
  EXPECT_TRUE(probe_says("refused", "uses this GPU without fracgpu, pid " + std::to_string(bypass)))
      << probe_output("refused");

  kill_and_reap(bypass);
  ASSERT_TRUE(eventually([&] { return alice_mark().first == ledger::kGpuAvailable; }, 3000ms)) << daemon_log();
  const pid_t accepted = probe("accepted", {"init"});
  EXPECT_EQ(wait_exit(accepted, 5s), 0);
  EXPECT_TRUE(probe_says("accepted", "init=0\n")) << probe_output("accepted");
}

// A deny left in the ledger by a daemon that was killed, then a daemon
// without NVML on the same run dir: it cannot audit, and the mark is not its
// own; its first pass clears it, and the tenant's processes start again.
// (Before: the mark stayed until a reload.)
TEST_F(NvmlDaemonTest, ADenyLeftByAnEarlierDaemonIsClearedByOneWithoutNvml) {
  if (!can_make_containers()) GTEST_SKIP() << "unshare -m is not permitted here: no container to attribute it by";
  start_with("deny");
  const pid_t bypass = in_container("bypass", "alice", {"init", "primary", "0", "alloc", "32MiB", "hold"});
  ASSERT_TRUE(eventually([&] { return alice_mark().first == ledger::kGpuBypassDenied; }, 3000ms)) << daemon_log();
  kill_and_reap(daemon_);
  kill_and_reap(bypass);
  EXPECT_EQ(alice_mark().first, uint32_t{ledger::kGpuBypassDenied}) << "left in the ledger";
  start_daemon(/*with_nvml=*/false);
  EXPECT_TRUE(eventually([&] { return alice_mark().first == ledger::kGpuAvailable; }, 3000ms)) << daemon_log();
  const pid_t accepted = probe("accepted", {"init"});
  EXPECT_EQ(wait_exit(accepted, 5s), 0);
  EXPECT_TRUE(probe_says("accepted", "init=0\n")) << probe_output("accepted");
}

// A container with two claims has two tenants' directories mounted: a
// process there without the interposer, on GPU 0, is the tenant's whose
// policy holds GPU 0 (alice's), not bob's (GPU 1), and the bypass audit's
// deny acts on alice alone. (Before: two tenants mounted told nothing, and
// nobody was denied: "tenant unknown".)
TEST_F(NvmlDaemonTest, AuditDenyActsOnTheTenantOfTheGpuForAProcessWithTwoClaims) {
  if (!can_make_containers()) GTEST_SKIP() << "unshare -m is not permitted here: no container to attribute it by";
  write_config("deny");
  write_file(config_path_, read_file(config_path_) +
                               "[[gpu]]\nindex = 1\n[[tenant]]\nname = \"bob\"\ngpus = 0.5\ndevices = [1]\n");
  set_faults("");
  start_daemon();
  const pid_t bypass = in_container("bypass", std::vector<std::string>{"alice", "bob"},
                                    {"init", "primary", "0", "alloc", "32MiB", "hold"});
  ASSERT_TRUE(eventually([&] { return alice_mark().first == ledger::kGpuBypassDenied; }, 3000ms)) << daemon_log();
  EXPECT_EQ(alice_mark().second, static_cast<uint32_t>(bypass));
  EXPECT_TRUE(log_contains("audit: process " + std::to_string(bypass) + " (fracgpu_probe, tenant \"alice\") uses"))
      << daemon_log();
  EXPECT_FALSE(log_contains("tenant \"bob\" denied")) << daemon_log();
  kill_and_reap(bypass);
}

// A bypassing process's environment is its own to write: naming another
// tenant there must not get that tenant denied. Only where the process
// runs (beside which tenant's processes) counts.
TEST_F(NvmlDaemonTest, AuditDenyNeverActsOnTheTenantABypassingProcessNames) {
  write_config("deny", "", "20ms");
  write_file(config_path_, read_file(config_path_) + "[[tenant]]\nname = \"bob\"\ngpus = 0.25\ndevices = [0]\n");
  set_faults("");
  start_daemon();
  // Nothing of alice's runs yet: a bypassing process that claims to be bob's.
  std::vector<std::string> env = environment(true);
  env.push_back("FRACGPU_TENANT_DIR=" + run_dir_ + "/tenants/bob");
  const pid_t liar = spawn({PROBE_PATH, "init", "primary", "0", "alloc", "32MiB", "hold"}, env, tmp_ / "liar.log");
  ASSERT_TRUE(eventually([&] { return finding_for(liar); }, 3000ms)) << daemon_log();
  const nlohmann::json h = health();
  for (const auto& f : h["audit"]["findings"]) {
    if (f["pid"] != liar) continue;
    EXPECT_EQ(f["tenant"], "") << h.dump();        // bob runs nothing beside it: unknown
    EXPECT_EQ(f["claimed_tenant"], "bob") << h.dump();  // the claim is shown, not believed
    EXPECT_EQ(f["action"], "reported (deny: tenant unknown)") << h.dump();
  }
  EXPECT_TRUE(log_contains("tenant unknown, claims \"bob\" (unverified)")) << daemon_log();
  // bob's GPU stays open to bob's processes.
  ledger::TenantLedger l;
  char err[256];
  ASSERT_EQ(ledger::open_ledger((run_dir_ + "/tenants/bob").c_str(), ledger::AccessMode::kReadOnly, nullptr, &l, err,
                                sizeof err),
            ledger::LedgerError::kOk)
      << err;
  std::this_thread::sleep_for(200ms);  // many audit passes
  ledger::GpuTable table;
  ASSERT_TRUE(ledger::read_gpu_table(l, &table));
  const int e = ledger::find_gpu(table, controller::parse_gpu_uuid(kUuid)->data());
  ASSERT_GE(e, 0);
  EXPECT_EQ(table.gpus[e].unavailable, uint32_t{ledger::kGpuAvailable});
  ledger::close_ledger(&l);
  kill_and_reap(liar);
}

// A process's name and environment are its own to write: the audit's log
// lines show them escaped, never as control characters for a terminal.
TEST_F(NvmlDaemonTest, AuditLogLinesEscapeWhatTheProcessWrote) {
  start_with("report");
  std::vector<std::string> env = environment(true);
  env.push_back("FRACGPU_TENANT=bob\x1b[2J");
  const pid_t liar = spawn({PROBE_PATH, "init", "primary", "0", "alloc", "32MiB", "hold"}, env, tmp_ / "esc.log");
  ASSERT_TRUE(eventually([&] { return finding_for(liar); }, 3000ms)) << daemon_log();
  EXPECT_TRUE(log_contains("claims \"bob\\x1b[2J\" (unverified)")) << daemon_log();
  EXPECT_EQ(daemon_log().find('\x1b'), std::string::npos);
  kill_and_reap(liar);
}

// The driver is the authority on memory: a tenant that wipes its own charges
// in its usage file and allocates past its quota is caught by NVML's count
// of what its processes hold, and (default action) its processes are killed
// until the rest fit, within the grace period, so its neighbour gets its
// whole quota back.
TEST_F(NvmlDaemonTest, MemoryAuditKillsATenantThatUnderReportsPastItsQuota) {
  write_config("report",
               "memory_audit_interval = \"50ms\"\nmemory_grace = \"500ms\"\nmemory_tolerance = \"128MiB\"\n");
  write_file(config_path_, read_file(config_path_) + "[[tenant]]\nname = \"bob\"\ngpus = 0.5\ndevices = [0]\n");
  set_faults("");
  start_daemon();
  // bob, honest, well within his 8 GiB: never touched.
  const pid_t bob = probe("bob", {"init", "primary", "0", "alloc", "5GiB", "hold"}, true, run_dir_ + "/tenants/bob");
  ASSERT_TRUE(eventually([&] { return probe_says("bob", "holding="); })) << probe_output("bob");
  // alice (quota 8 GiB) wipes her charges between allocations: 10 GiB held,
  // her ledger says 0, and the 16 GiB GPU has under 1 GiB left for bob.
  const pid_t cheat = probe("cheat", {"init", "primary", "0", "alloc", "4GiB", "zero-charges", "alloc", "4GiB",
                                      "zero-charges", "alloc", "2GiB", "zero-charges", "hold"});
  ASSERT_TRUE(eventually([&] { return probe_says("cheat", "holding="); })) << probe_output("cheat");
  EXPECT_EQ(probe_output("cheat").find("alloc=2"), std::string::npos) << probe_output("cheat");  // all went through
  const auto held_from = std::chrono::steady_clock::now();
  int status = 0;
  ASSERT_TRUE(eventually([&] { return waitpid(cheat, &status, WNOHANG) == cheat; }, 2000ms)) << daemon_log();
  const auto took = std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - held_from);
  EXPECT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL);
  EXPECT_GE(took.count(), 300) << "acted before the grace period";
  EXPECT_TRUE(log_contains("memory audit: tenant \"alice\" holds")) << daemon_log();
  EXPECT_TRUE(eventually([&] { return log_contains("terminated process " + std::to_string(cheat)); }, 2000ms))
      << daemon_log();
  EXPECT_EQ(kill(bob, 0), 0);  // the honest neighbour is left alone
  // And bob gets the rest of his quota (a second process: its context is
  // charged 256 MiB, so 5 + 0.25 + 0.25 + 2.5 = 8 GiB).
  const pid_t more = probe("more", {"init", "primary", "0", "alloc", "2GiB", "alloc", "512MiB"}, true,
                           run_dir_ + "/tenants/bob");
  EXPECT_EQ(wait_exit(more, 10s), 0);
  EXPECT_EQ(probe_output("more").find("alloc=2"), std::string::npos) << probe_output("more");
  EXPECT_TRUE(eventually([&] { return log_contains("is within its quota on GPU"); }, 2000ms)) << daemon_log();
  kill_and_reap(bob);
}

// A process that bypasses the interposer altogether (no slot, so nothing
// the daemon verified) is still the tenant's if its container has the
// tenant's directory mounted: the kernel says so in its mountinfo, which a
// process without CAP_SYS_ADMIN cannot change. Its memory counts against the
// tenant's quota; what its environment says does not matter.
TEST_F(NvmlDaemonTest, MemoryAuditCountsAnUnchargedProcessInTheTenantsContainer) {
  if (!can_make_containers()) GTEST_SKIP() << "unshare -m is not permitted here: no container view to test";
  write_config("report", "memory_audit_interval = \"50ms\"\nmemory_grace = \"200ms\"\nmemory_tolerance = \"128MiB\"\n");
  set_faults("");
  start_daemon();
  const pid_t ctr = in_container("ctr", "alice", {"init", "primary", "0", "alloc", "9GiB", "hold"});
  ASSERT_TRUE(eventually([&] { return probe_says("ctr", "holding="); })) << probe_output("ctr");
  EXPECT_EQ(controller::tenants_mounted_in(std::to_string(ctr), run_dir_), std::set<std::string>{"alice"});
  int status = 0;
  ASSERT_TRUE(eventually([&] { return waitpid(ctr, &status, WNOHANG) == ctr; }, 2000ms)) << daemon_log();
  EXPECT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL);
  EXPECT_TRUE(log_contains("memory audit: tenant \"alice\" holds")) << daemon_log();
  EXPECT_TRUE(log_contains("(fracgpu_probe, tenant \"alice\") uses")) << daemon_log();  // the bypass audit agrees
}

// One tolerance per tenant and GPU, whatever its process count: twelve
// processes of alice's container (no interposer), 704 MiB each by the
// driver's count (8.25 GiB), pass her 8 GiB quota by more than the 128 MiB
// tolerance. With a tolerance per process (quota + 12 x 128 MiB = 9.5 GiB)
// they all stayed; now the largest goes, and the rest fit.
TEST_F(NvmlDaemonTest, MemoryAuditAllowsOneTolerancePerTenantWhateverItsProcessCount) {
  if (!can_make_containers()) GTEST_SKIP() << "unshare -m is not permitted here: no container view to test";
  write_config("report", "memory_audit_interval = \"50ms\"\nmemory_grace = \"200ms\"\nmemory_tolerance = \"128MiB\"\n");
  set_faults("");
  start_daemon();
  std::vector<pid_t> many;
  for (int i = 0; i < 12; ++i) {
    const std::string name = "many-" + std::to_string(i);
    many.push_back(in_container(name, "alice", {"init", "primary", "0", "alloc", "640MiB", "hold"}));
  }
  for (int i = 0; i < 12; ++i)
    ASSERT_TRUE(eventually([&] { return probe_says("many-" + std::to_string(i), "holding="); }, 10s))
        << probe_output("many-" + std::to_string(i));
  ASSERT_TRUE(eventually([&] { return log_contains("terminated process"); }, 3000ms)) << daemon_log();
  EXPECT_TRUE(log_contains("memory audit: tenant \"alice\" holds 8.25 GiB on GPU 0 (" + kUuid + ") by the driver's "
                           "count in 12 process(es)"))
      << daemon_log();
  std::this_thread::sleep_for(500ms);  // several more passes: nothing more to do
  int alive = 0;
  for (const pid_t pid : many) alive += waitpid(pid, nullptr, WNOHANG) == 0;
  EXPECT_EQ(alive, 11) << daemon_log();  // 11 x 704 MiB = 7.56 GiB fits
}

// Every GPU is audited, not only those a tenant has a grant on: alice's
// container, without the interposer, opens GPU 1 (no grant of hers, not
// even managed) and holds 1 GiB there. Her quota there is 0.
TEST_F(NvmlDaemonTest, MemoryAuditActsOnAGpuTheTenantHasNoGrantOn) {
  if (!can_make_containers()) GTEST_SKIP() << "unshare -m is not permitted here: no container view to test";
  write_config("report", "memory_audit_interval = \"50ms\"\nmemory_grace = \"200ms\"\nmemory_tolerance = \"128MiB\"\n");
  set_faults("");
  start_daemon();
  const pid_t other = in_container("other", "alice", {"init", "primary", "1", "alloc", "1GiB", "hold"});
  ASSERT_TRUE(eventually([&] { return probe_says("other", "holding="); })) << probe_output("other");
  int status = 0;
  ASSERT_TRUE(eventually([&] { return waitpid(other, &status, WNOHANG) == other; }, 3000ms)) << daemon_log();
  EXPECT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL);
  EXPECT_TRUE(log_contains("over a GPU it has no grant on")) << daemon_log();
}

// A container with two claims: alice's (GPU 0) and bob's (GPU 1) tenant
// directories are both mounted in it. A process there holding 9 GiB on
// GPU 0 without the interposer is counted against alice, the one of its
// tenants with a grant on GPU 0, and stopped. (It used to be nobody's.)
TEST_F(NvmlDaemonTest, MemoryAuditCountsAProcessWithTwoTenantsMountsAgainstTheGpusTenant) {
  if (!can_make_containers()) GTEST_SKIP() << "unshare -m is not permitted here: no container view to test";
  write_config("report", "memory_audit_interval = \"50ms\"\nmemory_grace = \"200ms\"\nmemory_tolerance = \"128MiB\"\n");
  write_file(config_path_, read_file(config_path_) +
                               "[[gpu]]\nindex = 1\n[[tenant]]\nname = \"bob\"\ngpus = 0.5\ndevices = [1]\n");
  set_faults("");
  start_daemon();
  const pid_t both = in_container("both", std::vector<std::string>{"alice", "bob"},
                                  {"init", "primary", "0", "alloc", "9GiB", "hold"});
  ASSERT_TRUE(eventually([&] { return probe_says("both", "holding="); })) << probe_output("both");
  EXPECT_EQ(controller::tenants_mounted_in(std::to_string(both), run_dir_), (std::set<std::string>{"alice", "bob"}));
  int status = 0;
  ASSERT_TRUE(eventually([&] { return waitpid(both, &status, WNOHANG) == both; }, 3000ms)) << daemon_log();
  EXPECT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL);
  EXPECT_TRUE(log_contains("memory audit: tenant \"alice\" holds")) << daemon_log();
  EXPECT_FALSE(log_contains("memory audit: tenant \"bob\" holds")) << daemon_log();
}

// A process of alice's container enters a user and mount namespace of its
// own (unshare -U -r -m, as rootless container tools do: no capability
// needed) and moves into a sub-cgroup it made: no tenant directory is
// mounted where it runs, and its mount namespace holds no charged process.
// It cannot leave the container's cgroup: that ties it to alice, and its
// 9 GiB count against her 8 GiB quota. (Before: nobody's, and it held the
// memory for as long as it liked.)
TEST_F(NvmlDaemonTest, MemoryAuditCountsAProcessThatLeftItsContainersMountsByItsCgroup) {
  if (!can_make_containers() || system("unshare -U -r -m true 2>/dev/null") != 0)
    GTEST_SKIP() << "unshare -m or unprivileged user namespaces are not permitted here";
  const auto [container, container_path] = make_cgroup("ctr");
  const auto [escaped_dir, escaped_path] = make_cgroup("ctr/escaped");
  if (container.empty() || escaped_dir.empty()) GTEST_SKIP() << "no cgroup v2 the test can make cgroups in (needs root)";
  write_config("report", "memory_audit_interval = \"50ms\"\nmemory_grace = \"200ms\"\nmemory_tolerance = \"128MiB\"\n");
  set_faults("");
  start_daemon();
  // alice's process, under the interposer, in the container: its own mount
  // namespace and the container's cgroup.
  const pid_t verified = spawn_in_cgroup(
      container,
      {"/usr/bin/unshare", "-m", "--propagation", "private", "/usr/bin/env", std::string("LD_PRELOAD=") + FRACGPU_LIB,
       "FRACGPU_TENANT_DIR=" + run_dir_ + "/tenants/alice", PROBE_PATH, "init", "primary", "0", "alloc", "32MiB", "hold"},
      tmp_ / "verified.log");
  ASSERT_TRUE(eventually([&] { return probe_says("verified", "holding="); })) << probe_output("verified");
  std::this_thread::sleep_for(200ms);  // the daemon has found its slot's holder by now
  const pid_t escaped = spawn_in_cgroup(escaped_dir,
                                        {"/usr/bin/unshare", "-U", "-r", "-m", PROBE_PATH, "init", "primary", "0",
                                         "alloc", "9GiB", "hold"},
                                        tmp_ / "escaped.log");
  EXPECT_EQ(controller::tenants_mounted_in(std::to_string(escaped), run_dir_), std::set<std::string>{});
  int status = 0;
  ASSERT_TRUE(eventually([&] { return waitpid(escaped, &status, WNOHANG) == escaped; }, 5000ms))
      << probe_output("escaped") << daemon_log();
  EXPECT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL);
  EXPECT_TRUE(log_contains("memory audit: tenant \"alice\" holds")) << daemon_log();
  EXPECT_FALSE(log_contains("memory audit: processes no tenant owns hold")) << daemon_log();
  EXPECT_TRUE(log_contains("audit: process " + std::to_string(escaped) + " (fracgpu_probe, tenant \"alice\") uses"))
      << daemon_log();
  EXPECT_EQ(kill(verified, 0), 0);  // the rest fits: left alone
}

// A container (its own PID and mount namespaces; no tenant directory
// mounted, the host's cgroup) runs alice's process under the interposer and
// one that made its own user, mount and PID namespaces: the PID namespace
// it made is a descendant of the container's, which it cannot leave.
TEST_F(NvmlDaemonTest, MemoryAuditCountsAProcessInAPidNamespaceBeneathItsContainers) {
  if (system("unshare -U -r -m -p -f true 2>/dev/null") != 0 || !can_make_containers())
    GTEST_SKIP() << "PID, mount or unprivileged user namespaces are not permitted here";
  write_config("report", "memory_audit_interval = \"50ms\"\nmemory_grace = \"200ms\"\nmemory_tolerance = \"128MiB\"\n");
  set_faults("");
  start_daemon();
  const std::string verified_log = tmp_ / "verified.log", escaped_log = tmp_ / "escaped.log";
  const std::string script =
      std::string("LD_PRELOAD='") + FRACGPU_LIB + "' FRACGPU_TENANT_DIR='" + run_dir_ + "/tenants/alice' '" +
      PROBE_PATH + "' init primary 0 alloc 32MiB sleep-ms 101 hold > '" + verified_log +
      "' 2>&1 &\nwhile ! grep -q holding= '" + verified_log + "'; do sleep 0.05; done; sleep 0.3\n" +
      "unshare -U -r -m -p -f '" + PROBE_PATH + "' init primary 0 alloc 9GiB sleep-ms 102 hold > '" + escaped_log +
      "' 2>&1\nwait\n";  // the container's init stays: its end would end every process in the container
  spawn({"/usr/bin/unshare", "-p", "-f", "--kill-child", "-m", "--propagation", "private", "/bin/sh", "-c", script},
        environment(true), tmp_ / "container.log");
  ASSERT_TRUE(eventually([&] { return read_file(escaped_log).find("holding=") != std::string::npos; }, 10s))
      << read_file(escaped_log) << read_file(tmp_ / "container.log");
  const pid_t verified = probe_marked("101"), escaped = probe_marked("102");
  ASSERT_GT(verified, 0);
  ASSERT_TRUE(escaped > 0 || log_contains("terminated process")) << daemon_log();
  ASSERT_TRUE(eventually([&] { return log_contains("terminated process"); }, 5000ms)) << daemon_log();
  EXPECT_TRUE(log_contains("memory audit: tenant \"alice\" holds")) << daemon_log();
  EXPECT_FALSE(log_contains("memory audit: processes no tenant owns hold")) << daemon_log();
  if (escaped > 0) {
    EXPECT_TRUE(eventually([&] { return log_contains("terminated process " + std::to_string(escaped)); }, 2000ms))
        << daemon_log();
    EXPECT_TRUE(eventually([&] { return kill(escaped, 0) != 0; }, 2000ms));
  }
  EXPECT_EQ(kill(verified, 0), 0);
}

// By default, a process on a managed GPU that no tenant owns (here: on the
// host, no interposer, beside no tenant) is held to a small allowance,
// together with every other such process there, and stopped beyond it. Not
// on a GPU fracgpu does not manage, and not a node agent in a cgroup the
// operator named. The daemon says at start that this is in force.
TEST_F(NvmlDaemonTest, ProcessesNoTenantOwnsAreHeldToAnAllowanceOnManagedGpusOnly) {
  const auto [agent_dir, agent_path] = make_cgroup("agent");
  write_config("report", "memory_audit_interval = \"50ms\"\nmemory_grace = \"200ms\"\n"
                         "unowned_memory_allowance = \"256MiB\"\nnode_agent_cgroups = [\"" +
                             (agent_path.empty() ? std::string("/no/agent/here") : agent_path) + "\"]\n");
  set_faults("");
  start_daemon();
  EXPECT_TRUE(log_contains("memory audit: processes no tenant owns (by cgroup, PID namespace, parent or mounts) may "
                           "hold 256 MiB together on each managed GPU (unowned_memory_allowance); beyond it for "
                           "200 ms: terminate (memory_audit_action); node agents exempt by cgroup"))
      << daemon_log();
  const pid_t small = spawn({PROBE_PATH, "init", "primary", "0", "alloc", "32MiB", "hold"}, environment(true),
                            tmp_ / "small.log");
  const pid_t stray = spawn({PROBE_PATH, "init", "primary", "0", "alloc", "1GiB", "hold"}, environment(true),
                            tmp_ / "stray.log");
  // GPU 1 is not in the config: fracgpu does not manage it.
  const pid_t elsewhere = spawn({PROBE_PATH, "init", "primary", "1", "alloc", "1GiB", "hold"}, environment(true),
                                tmp_ / "elsewhere.log");
  const pid_t agent = agent_dir.empty() ? -1
                                        : spawn_in_cgroup(agent_dir, {PROBE_PATH, "init", "primary", "0", "alloc",
                                                                      "1GiB", "hold"},
                                                          tmp_ / "agent.log");
  int status = 0;
  ASSERT_TRUE(eventually([&] { return waitpid(stray, &status, WNOHANG) == stray; }, 5000ms)) << daemon_log();
  EXPECT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL);
  EXPECT_TRUE(log_contains("memory audit: processes no tenant owns hold")) << daemon_log();
  // The daemon logs after its kill: the stray may be reaped here first.
  EXPECT_TRUE(eventually([&] { return log_contains("terminated process " + std::to_string(stray)); }, 2000ms))
      << daemon_log();
  std::this_thread::sleep_for(500ms);  // several more passes: what is left fits, or is not held
  EXPECT_EQ(kill(small, 0), 0) << daemon_log();  // 32 MiB and its context fit the allowance
  EXPECT_EQ(kill(elsewhere, 0), 0) << daemon_log();
  if (agent > 0) {
    EXPECT_TRUE(probe_says("agent", "holding=")) << probe_output("agent");
    EXPECT_EQ(kill(agent, 0), 0) << daemon_log();
  }
}

// An operator's resize never kills and never frees what is still held:
// carol (4 GiB on GPU 0) holds about 3 GiB when her quota is lowered to
// 1 GiB, then when GPU 0 is taken from her altogether. Her process lives
// through both, and the memory it holds stays booked (dave's 7 GiB does not
// fit beside alice's 8 GiB and carol's 3 GiB) until it is freed.
TEST_F(NvmlDaemonTest, AResizeBelowWhatATenantHoldsKillsNothingAndFreesNothingStillHeld) {
  write_config("report", "memory_audit_interval = \"50ms\"\nmemory_grace = \"200ms\"\nmemory_tolerance = \"128MiB\"\n");
  write_file(config_path_, read_file(config_path_) + "[[gpu]]\nindex = 1\n");
  set_faults("");
  start_daemon();
  auto [rc, out] = cli({"tenant", "create", "carol", "--gpu", kUuid + ":share=0.25:memory=4GiB"});
  ASSERT_EQ(rc, 0) << out;
  const pid_t carol = probe("carol", {"init", "primary", "0", "alloc", "3GiB", "hold"}, true, run_dir_ + "/tenants/carol");
  ASSERT_TRUE(eventually([&] { return probe_says("carol", "holding="); })) << probe_output("carol");

  std::tie(rc, out) = cli({"tenant", "resize", "carol", "--gpu", kUuid + ":share=0.25:memory=1GiB"});
  ASSERT_EQ(rc, 0) << out;
  std::this_thread::sleep_for(1000ms);  // many audit passes, well past the grace
  EXPECT_EQ(waitpid(carol, nullptr, WNOHANG), 0) << daemon_log();
  EXPECT_FALSE(log_contains("terminated process")) << daemon_log();
  std::tie(rc, out) = cli({"tenant", "create", "dave", "--gpu", kUuid + ":share=0.25:memory=7GiB"});
  EXPECT_EQ(rc, 4) << out;
  EXPECT_NE(out.find("still held past shrunk quotas"), std::string::npos) << out;

  // A daemon killed and started again remembers it.
  kill_and_reap(daemon_);
  start_daemon();
  std::this_thread::sleep_for(1000ms);
  EXPECT_EQ(waitpid(carol, nullptr, WNOHANG), 0) << daemon_log();
  EXPECT_TRUE(log_contains("1 shrunk quota(s) read back")) << daemon_log();
  std::tie(rc, out) = cli({"tenant", "create", "dave", "--gpu", kUuid + ":share=0.25:memory=7GiB"});
  EXPECT_EQ(rc, 4) << out;

  std::tie(rc, out) = cli({"tenant", "resize", "carol", "--gpu", kUuid2 + ":share=0.25:memory=1GiB"});
  ASSERT_EQ(rc, 0) << out;
  std::this_thread::sleep_for(1000ms);
  EXPECT_EQ(waitpid(carol, nullptr, WNOHANG), 0) << daemon_log();
  std::tie(rc, out) = cli({"tenant", "create", "dave", "--gpu", kUuid + ":share=0.25:memory=7GiB"});
  EXPECT_EQ(rc, 4) << out;

  // Freed: the capacity comes back.
  kill_and_reap(carol);
  ASSERT_TRUE(eventually([&] { return log_contains("fits its quota again"); }, 3000ms)) << daemon_log();
  std::tie(rc, out) = cli({"tenant", "create", "dave", "--gpu", kUuid + ":share=0.25:memory=7GiB"});
  EXPECT_EQ(rc, 0) << out;
}

// A shrunk tenant's allowance is lowered by every memory audit to what the
// driver says it holds, and what that frees goes back to the book at once.
// <run_dir>/shrunk-quotas.json must follow each change, so that a daemon
// SIGKILLed after any step comes back with the allowance as last lowered,
// never a higher one from before: the freed capacity may be another
// tenant's by then, and the shrunk tenant may have grown back while no
// daemon watched. GPU 0 has 16 GiB, 8 of them alice's. carol (7 GiB) holds
// 6.75 GiB in two processes (6.375 GiB by the driver's count: 64 MiB
// contexts, not the 256 MiB charged) and is resized to 1 GiB. The larger
// process exits: 2.5 GiB + 64 MiB are held, 1600 MiB past her quota stay
// booked, and dave gets 5 GiB. With the daemon down, a process of carol's
// container without the interposer takes 4 GiB more, within the 7 GiB she
// once had but far past what she may still hold: the restarted daemon's
// memory audit stops it, and nothing is booked twice.
TEST_F(NvmlDaemonTest, AShrunkAllowanceComesBackFromAKillAsLastLoweredAndNothingIsBookedTwice) {
  if (!can_make_containers()) GTEST_SKIP() << "unshare -m is not permitted here: no container to regrow in";
  write_config("report", "memory_audit_interval = \"50ms\"\nmemory_grace = \"200ms\"\nmemory_tolerance = \"128MiB\"\n");
  set_faults("");
  start_daemon();
  constexpr int64_t kMiB = 1 << 20;
  const std::string carol_dir = run_dir_ + "/tenants/carol";
  // What shrunk-quotas.json lets carol hold on GPU 0; 0 when nothing.
  const auto allowance_on_disk = [&] {
    const nlohmann::json doc =
        nlohmann::json::parse(read_file(run_dir_ + "/shrunk-quotas.json"), nullptr, /*allow_exceptions=*/false);
    if (!doc.is_object() || !doc.contains("held")) return int64_t{0};
    for (const nlohmann::json& e : doc["held"])
      if (e.value("tenant", "") == "carol" && e.value("gpu", "") == kUuid) return e.value("bytes", int64_t{0});
    return int64_t{0};
  };
  // The book settles at `free` and the file at `allowance`; the daemon is
  // SIGKILLed and started again; the book shows the same at once, and still
  // after a few audits, and the file says no more.
  const auto kill_after = [&](const std::string& step, int64_t free, int64_t allowance) {
    SCOPED_TRACE("killed after: " + step);
    EXPECT_TRUE(eventually([&] { return free_memory() == free && allowance_on_disk() == allowance; }, 3000ms))
        << free_memory() / kMiB << " MiB free, " << free / kMiB << " MiB expected; "
        << allowance_on_disk() / kMiB << " MiB allowed on disk, " << allowance / kMiB << " MiB expected\n"
        << daemon_log();
    kill_and_restart();
    EXPECT_EQ(free_memory() / kMiB, free / kMiB) << daemon_log();
    std::this_thread::sleep_for(400ms);
    EXPECT_EQ(free_memory() / kMiB, free / kMiB) << daemon_log();
    EXPECT_LE(allowance_on_disk(), allowance);
  };
  kill_after("start", 8192 * kMiB, 0);

  ASSERT_TRUE(put_tenant("create", "carol", 7168 * kMiB).ok);
  kill_after("carol created", 1024 * kMiB, 0);

  const pid_t big = probe("big", {"init", "primary", "0", "alloc", "3840MiB", "hold"}, true, carol_dir);
  const pid_t small = probe("small", {"init", "primary", "0", "alloc", "2560MiB", "hold"}, true, carol_dir);
  ASSERT_TRUE(eventually([&] { return probe_says("big", "holding=") && probe_says("small", "holding="); }))
      << probe_output("big") << probe_output("small");
  kill_after("carol holds 6.75 GiB", 1024 * kMiB, 0);

  ASSERT_TRUE(put_tenant("resize", "carol", 1024 * kMiB).ok);
  kill_after("carol resized to 1 GiB", (16384 - 8192 - 6528) * kMiB, 6528 * kMiB);
  EXPECT_EQ(waitpid(big, nullptr, WNOHANG), 0) << daemon_log();

  kill_and_reap(big);
  kill_after("carol's larger process exited", (16384 - 8192 - 2624) * kMiB, 2624 * kMiB);

  const control::Reply dave = put_tenant("create", "dave", 5120 * kMiB);
  ASSERT_TRUE(dave.ok) << dave.error;
  kill_after("dave created", (16384 - 8192 - 2624 - 5120) * kMiB, 2624 * kMiB);

  // carol grows back while no daemon runs.
  kill_and_reap(daemon_);
  const pid_t regrow = in_container("regrow", "carol", {"init", "primary", "0", "alloc", "4GiB", "hold"});
  ASSERT_TRUE(eventually([&] { return probe_says("regrow", "holding="); })) << probe_output("regrow");
  kill_and_restart();
  int status = 0;
  EXPECT_TRUE(eventually([&] { return waitpid(regrow, &status, WNOHANG) == regrow; }, 3000ms)) << daemon_log();
  EXPECT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL);
  EXPECT_EQ(waitpid(small, nullptr, WNOHANG), 0) << daemon_log();  // within what carol may still hold
  kill_after("carol's regrowth stopped", (16384 - 8192 - 2624 - 5120) * kMiB, 2624 * kMiB);

  kill_and_reap(small);
  ASSERT_TRUE(eventually([&] { return log_contains("fits its quota again"); }, 3000ms)) << daemon_log();
  kill_after("carol freed everything", (16384 - 8192 - 1024 - 5120) * kMiB, 0);
}

// A tenant whose memory is held only by processes without the interposer
// (its container's, within its quota, which the memory audit allows) is
// shrunk like any other: the driver's count, not its empty ledger, says what
// it still holds. carol's container holds 3 GiB (+ a 64 MiB context) of her
// 7 GiB when she is resized to 1 GiB: nothing is killed, the 2112 MiB past
// her new quota stay booked, across a restart too, and return once freed.
TEST_F(NvmlDaemonTest, AResizeKeepsWhatProcessesWithoutTheInterposerHold) {
  if (!can_make_containers()) GTEST_SKIP() << "unshare -m is not permitted here: no container view to test";
  write_config("report", "memory_audit_interval = \"50ms\"\nmemory_grace = \"200ms\"\nmemory_tolerance = \"128MiB\"\n");
  set_faults("");
  start_daemon();
  constexpr int64_t kMiB = 1 << 20;
  ASSERT_TRUE(put_tenant("create", "carol", 7168 * kMiB).ok);
  const pid_t ctr = in_container("ctr", "carol", {"init", "primary", "0", "alloc", "3GiB", "hold"});
  ASSERT_TRUE(eventually([&] { return probe_says("ctr", "holding="); })) << probe_output("ctr");
  std::this_thread::sleep_for(500ms);  // audits: within her quota
  ASSERT_EQ(waitpid(ctr, nullptr, WNOHANG), 0) << daemon_log();

  ASSERT_TRUE(put_tenant("resize", "carol", 1024 * kMiB).ok);
  const int64_t expected = (16384 - 8192 - 1024 - 2112) * kMiB;
  EXPECT_TRUE(eventually([&] { return free_memory() == expected; }, 2000ms))
      << free_memory() / kMiB << " MiB free\n" << daemon_log();
  std::this_thread::sleep_for(1000ms);  // many audit passes, well past the grace
  EXPECT_EQ(waitpid(ctr, nullptr, WNOHANG), 0) << daemon_log();
  EXPECT_FALSE(log_contains("terminated process")) << daemon_log();
  const control::Reply dave = put_tenant("create", "dave", 6144 * kMiB);
  EXPECT_EQ(dave.code, "no_capacity") << dave.body.dump();
  EXPECT_NE(dave.error.find("still held past shrunk quotas"), std::string::npos) << dave.error;

  kill_and_restart();
  EXPECT_EQ(free_memory() / kMiB, expected / kMiB) << daemon_log();
  std::this_thread::sleep_for(1000ms);
  EXPECT_EQ(waitpid(ctr, nullptr, WNOHANG), 0) << daemon_log();
  EXPECT_EQ(free_memory() / kMiB, expected / kMiB) << daemon_log();

  kill_and_reap(ctr);
  ASSERT_TRUE(eventually([&] { return log_contains("fits its quota again"); }, 3000ms)) << daemon_log();
  EXPECT_EQ(free_memory(), 7168 * kMiB);
  EXPECT_TRUE(put_tenant("create", "dave", 6144 * kMiB).ok);
}

// Without NVML, what a shrunk tenant holds is read from its own charges:
// its allowance follows them down, and the capacity returns once they are
// freed. carol (4 GiB) is charged 3.25 GiB (3 GiB + a 256 MiB context) when
// she is resized to 1 GiB: 3.25 GiB stay hers and booked until her process
// ends.
TEST_F(NvmlDaemonTest, WithoutNvmlAShrunkAllowanceFollowsTheTenantsCharges) {
  write_config();
  start_daemon(/*with_nvml=*/false);
  ASSERT_TRUE(eventually([&] { return control_call({{"op", "node"}}).ok; })) << daemon_log();
  constexpr int64_t kMiB = 1 << 20;
  ASSERT_TRUE(put_tenant("create", "carol", 4096 * kMiB).ok);
  const pid_t carol = probe("carol", {"init", "primary", "0", "alloc", "3GiB", "hold"}, true, run_dir_ + "/tenants/carol");
  ASSERT_TRUE(eventually([&] { return probe_says("carol", "holding="); })) << probe_output("carol");
  ASSERT_TRUE(put_tenant("resize", "carol", 1024 * kMiB).ok);
  EXPECT_TRUE(eventually([&] { return free_memory() == (16384 - 8192 - 3328) * kMiB; }, 2000ms))
      << free_memory() / kMiB << " MiB free\n" << daemon_log();
  EXPECT_EQ(waitpid(carol, nullptr, WNOHANG), 0);
  kill_and_reap(carol);
  EXPECT_TRUE(eventually([&] { return free_memory() == (16384 - 8192 - 1024) * kMiB; }, 3000ms))
      << free_memory() / kMiB << " MiB free\n" << daemon_log();
  EXPECT_TRUE(log_contains("fits its quota again")) << daemon_log();
}

// memory_audit_action = "report": the overuse is shown (health.json, status)
// and nothing is killed.
TEST_F(NvmlDaemonTest, MemoryAuditReportOnlyShowsTheOveruse) {
  write_config("report", "memory_audit_interval = \"50ms\"\nmemory_grace = \"100ms\"\nmemory_tolerance = \"0\"\n"
                         "memory_audit_action = \"report\"\n");
  set_faults("");
  start_daemon();
  const pid_t cheat = probe("cheat", {"init", "primary", "0", "alloc", "6GiB", "zero-charges", "alloc", "6GiB", "hold"});
  ASSERT_TRUE(eventually([&] { return probe_says("cheat", "holding="); })) << probe_output("cheat");
  const auto reported = [&] {
    const nlohmann::json h = health();
    if (!h.is_object()) return false;
    for (const auto& o : h["memory_audit"]["overuses"])
      if (o["tenant"] == "alice" && o["action"] == "reported") return true;
    return false;
  };
  ASSERT_TRUE(eventually(reported, 3000ms)) << daemon_log();
  const std::string text = status();
  EXPECT_NE(text.find("memory audit (action report): tenants over their quota by the driver's count:"),
            std::string::npos)
      << text;
  EXPECT_NE(text.find("  alice"), std::string::npos) << text;
  EXPECT_EQ(kill(cheat, 0), 0);
  kill_and_reap(cheat);
}

TEST_F(NvmlDaemonTest, AuditTerminateKillsTheBypassingProcessOnly) {
  start_with("terminate");
  const pid_t managed = holder("managed", true);
  const pid_t bypass = holder("bypass", /*preload=*/false);
  int status = 0;
  ASSERT_TRUE(eventually([&] { return waitpid(bypass, &status, WNOHANG) == bypass; }, 3000ms)) << daemon_log();
  EXPECT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL);
  EXPECT_TRUE(log_contains(": terminated (SIGKILL)")) << daemon_log();
  EXPECT_EQ(kill(managed, 0), 0);
}

// A critical Xid fences the GPU in a file under the run dir: a daemon that
// crashes and starts again keeps it unhealthy (the Xid is not reported
// again) until the operator clears it with `fracgpu gpu clear`.
TEST_F(NvmlDaemonTest, XidFenceSurvivesARestartUntilClearedByTheCli) {
  start_with("report");
  set_faults("0 xid=79\n");
  ASSERT_TRUE(eventually([&] { return alice_mark().first == ledger::kGpuXid; }, 2000ms)) << daemon_log();
  ASSERT_TRUE(fs::exists(run_dir_ + "/fences/" + kUuid));
  kill_and_reap(daemon_);  // a crash: no clean stop
  set_faults("");
  start_daemon();
  std::this_thread::sleep_for(300ms);  // many probes
  EXPECT_EQ(alice_mark().first, uint32_t{ledger::kGpuXid}) << daemon_log();
  EXPECT_EQ(alice_mark().second, 79u);
  EXPECT_TRUE(log_contains("health: GPU 0 (" + kUuid + ") stays fenced: critical Xid 79 reported by NVML"))
      << daemon_log();
  EXPECT_NE(status().find("fracgpu gpu clear " + kUuid), std::string::npos) << status();
  const pid_t refused = probe("refused", {"init"});
  EXPECT_EQ(wait_exit(refused, 5s), 0);
  EXPECT_TRUE(probe_says("refused", "init=" + std::to_string(kDeviceUnavailable) + "\n")) << probe_output("refused");

  // Bad input is refused with a reason; a GPU without a fence says so.
  auto [rc, out] = cli({"gpu", "clear", "banana"});
  EXPECT_EQ(rc, 64) << out;
  EXPECT_NE(out.find("\"banana\" is neither a GPU index nor a GPU UUID"), std::string::npos) << out;
  std::tie(rc, out) = cli({"gpu", "clear", "1"});
  EXPECT_EQ(rc, 3) << out;
  EXPECT_NE(out.find("GPU 1 has no Xid fence"), std::string::npos) << out;
  EXPECT_NE(out.find("fenced: " + kUuid + " (GPU 0)"), std::string::npos) << out;
  EXPECT_EQ(alice_mark().first, uint32_t{ledger::kGpuXid});

  std::tie(rc, out) = cli({"gpu", "clear", "0"});  // by index
  EXPECT_EQ(rc, 0) << out;
  EXPECT_NE(out.find("cleared the Xid fence of " + kUuid), std::string::npos) << out;
  ASSERT_TRUE(eventually([&] { return alice_mark().first == ledger::kGpuAvailable; }, 2000ms)) << daemon_log();
  EXPECT_TRUE(log_contains("Xid fence cleared by the operator")) << daemon_log();
  const pid_t accepted = probe("accepted", {"init"});
  EXPECT_EQ(wait_exit(accepted, 5s), 0);
  EXPECT_TRUE(probe_says("accepted", "init=0\n")) << probe_output("accepted");
  // By UUID, case-insensitively: now there is nothing to clear.
  std::string upper = kUuid;
  for (char& c : upper) c = static_cast<char>(toupper(c));
  std::tie(rc, out) = cli({"gpu", "clear", upper});
  EXPECT_EQ(rc, 3) << out;
}

// An operator lowers a quota in the config and restarts the daemon (a
// package upgrade, `systemctl restart`) instead of reloading it: what the
// tenant's processes hold stays theirs, as at a reload. The restarted
// daemon used to see no lowering (it knew no quota from before) and its
// memory audit killed the process at once.
TEST_F(NvmlDaemonTest, AQuotaLoweredAcrossARestartKillsNothing) {
  const std::string audit = "memory_audit_interval = \"50ms\"\nmemory_grace = \"200ms\"\nmemory_tolerance = \"128MiB\"\n";
  write_config("report", audit);
  set_faults("");
  start_daemon();
  const pid_t holder = probe("alice", {"init", "primary", "0", "alloc", "3GiB", "hold"});
  ASSERT_TRUE(eventually([&] { return probe_says("alice", "holding="); })) << probe_output("alice");
  write_file(config_path_, read_file(config_path_) + "[tenant.memory]\n\"0\" = \"1GiB\"\n");
  kill(daemon_, SIGTERM);
  waitpid(daemon_, nullptr, 0);
  daemon_ = -1;
  start_daemon();
  EXPECT_TRUE(eventually([&] { return log_contains("quota lowered from 8 GiB to 1 GiB"); })) << daemon_log();
  std::this_thread::sleep_for(1000ms);  // many audits, each past the grace
  EXPECT_EQ(waitpid(holder, nullptr, WNOHANG), 0) << "the holder lives\n" << daemon_log();
  EXPECT_FALSE(log_contains("terminated process")) << daemon_log();
}

// NVML gives a process's memory as "not available" where it cannot tell:
// the memory audit then cannot see what such a process holds, and says so
// once for the GPU, rather than acting on a count of 0 in silence.
TEST_F(NvmlDaemonTest, TheMemoryAuditSaysWhenNvmlCannotTellAProcesssMemory) {
  write_config("report", "memory_audit_interval = \"50ms\"\n");
  set_faults("0 memory_not_available\n");
  start_daemon();
  const pid_t holder = probe("alice", {"init", "primary", "0", "alloc", "1GiB", "hold"});
  ASSERT_TRUE(eventually([&] { return probe_says("alice", "holding="); })) << probe_output("alice");
  const std::string said = "memory audit: NVML does not say how much memory process " + std::to_string(holder) +
                           " holds on GPU 0 (" + kUuid + ")";
  EXPECT_TRUE(eventually([&] { return log_contains(said); })) << daemon_log();
  std::this_thread::sleep_for(300ms);  // many audits: said once
  const std::string log = daemon_log();
  EXPECT_EQ(log.find(said), log.rfind(said)) << log;
}

// A GPU failed, and the daemon restarts on a node whose NVML no longer
// loads (a driver left half upgraded after the failure, say): the fence
// holds as it does with NVML, through reloads, until the operator clears
// it. Without NVML the health checks were off, and the first reload wrote
// every GPU available again, fence file or not.
TEST_F(NvmlDaemonTest, AnXidFenceHoldsAfterARestartWithoutNvml) {
  start_with("report");
  set_faults("0 xid=79\n");
  ASSERT_TRUE(eventually([&] { return alice_mark().first == ledger::kGpuXid; }, 2000ms)) << daemon_log();
  kill_and_reap(daemon_);
  set_faults("");
  start_daemon(/*with_nvml=*/false);
  // (The log holds the first daemon's lines too: wait for this one's.)
  ASSERT_TRUE(eventually([&] { return log_contains("fracgpud " + std::to_string(daemon_) + " started"); })) << daemon_log();
  kill(daemon_, SIGHUP);
  ASSERT_TRUE(eventually([&] { return log_contains("reload applied"); })) << daemon_log();
  std::this_thread::sleep_for(300ms);  // many health intervals
  EXPECT_EQ(alice_mark().first, uint32_t{ledger::kGpuXid}) << daemon_log();
  EXPECT_EQ(alice_mark().second, 79u);
  const pid_t refused = probe("refused", {"init"});
  EXPECT_EQ(wait_exit(refused, 5s), 0);
  EXPECT_TRUE(probe_says("refused", "init=" + std::to_string(kDeviceUnavailable) + "\n")) << probe_output("refused");
  auto [rc, out] = cli({"gpu", "clear", kUuid});
  EXPECT_EQ(rc, 0) << out;
  ASSERT_TRUE(eventually([&] { return alice_mark().first == ledger::kGpuAvailable; }, 2000ms)) << daemon_log();
  EXPECT_TRUE(log_contains("Xid fence cleared by the operator")) << daemon_log();
}

// A fence file edited by hand into fields of other types is still a fence,
// and the daemon starts (it used to stop at the parse, at every start).
TEST_F(NvmlDaemonTest, AFenceWithFieldsOfOtherTypesStillFencesAndTheDaemonStarts) {
  start_with("report");
  kill_and_reap(daemon_);
  fs::create_directories(run_dir_ + "/fences");
  write_file(run_dir_ + "/fences/" + kUuid, "{\"xid\": \"79\", \"why\": 42, \"since_unix\": -1}\n");
  start_daemon();
  ASSERT_TRUE(eventually([&] { return alice_mark().first == ledger::kGpuXid; }, 2000ms)) << daemon_log();
  EXPECT_TRUE(log_contains("stays fenced: critical Xid")) << daemon_log();
}

// The stand-in NVML's sensor faults: an unreadable temperature or power
// reading marks the GPU (reason sensors) and clears when it reads again.
TEST_F(NvmlDaemonTest, UnreadableSensorsMarkTheGpuUntilTheyReadAgain) {
  start_with("report");
  for (const std::string fault : {"no_temperature", "no_power"}) {
    set_faults("0 " + fault + "\n");
    ASSERT_TRUE(eventually([&] { return alice_mark().first == ledger::kGpuSensors; }, 2000ms)) << daemon_log();
    EXPECT_TRUE(eventually([&] { return health()["gpus"][0]["reason"] == "sensors"; })) << health().dump();
    EXPECT_NE(health()["gpus"][0]["why"].get<std::string>().find(fault == "no_power" ? "power" : "temperature"),
              std::string::npos)
        << health().dump();
    set_faults("");
    ASSERT_TRUE(eventually([&] { return alice_mark().first == ledger::kGpuAvailable; }, 2000ms)) << daemon_log();
  }
}

// Uncorrected ECC errors on a GPU a tenant is granted: its new processes are
// refused with the count as detail; scraped metrics say so too.
TEST_F(NvmlDaemonTest, EccOnAGrantedGpuIsMarkedAndScraped) {
  write_config("report", "metrics_address = \"127.0.0.1:0\"\n");
  set_faults("");
  start_daemon();
  ASSERT_TRUE(eventually([&] { return logged_metrics_port(daemon_log()) != 0; })) << daemon_log();
  const uint16_t port = logged_metrics_port(daemon_log());
  const std::string gpu0 = "{gpu=\"" + kUuid + "\"}";
  EXPECT_TRUE(eventually([&] { return http_get(port, "/metrics").find("fracgpu_gpu_healthy" + gpu0 + " 1\n") !=
                                      std::string::npos; }))
      << http_get(port, "/metrics");
  set_faults("0 ecc=2\n");
  ASSERT_TRUE(eventually([&] { return alice_mark().first == ledger::kGpuEcc; }, 2000ms)) << daemon_log();
  EXPECT_EQ(alice_mark().second, 2u);
  const pid_t refused = probe("refused", {"init"});
  EXPECT_EQ(wait_exit(refused, 5s), 0);
  EXPECT_TRUE(probe_says("refused", "init=" + std::to_string(kDeviceUnavailable) + "\n")) << probe_output("refused");
  const std::string body = http_get(port, "/metrics");
  EXPECT_NE(body.find("fracgpu_gpu_healthy" + gpu0 + " 0\n"), std::string::npos) << body;
  EXPECT_NE(body.find("fracgpu_gpu_unhealthy_reason{gpu=\"" + kUuid + "\",reason=\"ecc\"} 1\n"), std::string::npos)
      << body;
  EXPECT_NE(body.find("fracgpu_gpu_healthy{gpu=\"" + kUuid2 + "\"} 1\n"), std::string::npos) << body;

  // A bypassing process shows in the audit metric of its GPU.
  set_faults("");
  const pid_t bypass = holder("bypass", /*preload=*/false);
  EXPECT_TRUE(eventually([&] {
    return http_get(port, "/metrics").find("fracgpu_audit_uncharged_processes" + gpu0 + " 1\n") != std::string::npos;
  }, 3000ms)) << http_get(port, "/metrics");
  kill_and_reap(bypass);
}

// A reload that shortens health_interval takes effect at once, not after
// the old interval (here an hour) has run out.
TEST_F(NvmlDaemonTest, ReloadWithAShorterHealthIntervalTakesEffectAtOnce) {
  write_config("report", "", "3600s");
  set_faults("");
  start_daemon();
  write_config("report", "", "20ms");
  kill(daemon_, SIGHUP);
  ASSERT_TRUE(eventually([&] { return log_contains("reload applied"); })) << daemon_log();
  set_faults("0 lost\n");
  EXPECT_TRUE(eventually([&] { return alice_mark().first == ledger::kGpuLost; }, 2000ms)) << daemon_log();
}

}  // namespace
