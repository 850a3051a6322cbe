// A tenant's process sees only the GPUs its tenants grant: through CUDA
// (device count, ordinals, UUIDs, contexts, peer queries: the interposer
// sets CUDA_VISIBLE_DEVICES before the driver's first cuInit) and through
// NVML (count and handles, filtered by the interposer's NVML hooks).
//
// The simulated driver reads CUDA_VISIBLE_DEVICES as the real one does
// (first tests); fracgpu_probe and nvml_probe then run under
// LD_PRELOAD=libfracgpu.so on a simulated node with more GPUs than the
// tenant is granted. `jax-start` is JAX's start-up: it enumerates every
// device the driver shows and makes a context and takes memory on each.
// The tests play the daemon (they write the policies).
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "ledger.h"
#include "policy_util.h"

using namespace fracgpu::ledger;
namespace fs = std::filesystem;

namespace {

constexpr uint64_t kMiB = 1ull << 20;
constexpr uint64_t kGiB = 1ull << 30;
constexpr uint64_t kContext = 64 * kMiB;  // per context, in the sim and in the policies
constexpr const char* kUuids[3] = {"GPU-11111111-2222-3333-4444-000000000000",
                                   "GPU-11111111-2222-3333-4444-000000000001",
                                   "GPU-22222222-2222-3333-4444-000000000002"};

// CUDA and NVML answers as the probes print them.
constexpr const char* kSuccess = "0";
constexpr const char* kNoDevice = "100";
constexpr const char* kInvalidDevice = "101";
constexpr const char* kNotInitialized = "3";
constexpr const char* kNvmlInvalidArgument = "2";
constexpr const char* kNvmlNotFound = "6";

struct Output {
  int status = -1;
  std::string out, err;
  std::map<std::string, std::string> values;
  const std::string& operator[](const std::string& key) const {
    static const std::string missing = "<missing>";
    auto it = values.find(key);
    return it == values.end() ? missing : it->second;
  }
};

class VisibleDevicesTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/fracgpu-visible-XXXXXX";
    ASSERT_NE(mkdtemp(tmpl), nullptr);
    root_ = tmpl;
    fs::create_directories(root_ + "/tenants");
  }
  void TearDown() override {
    for (pid_t pid : held_) {
      kill(pid, SIGKILL);
      waitpid(pid, nullptr, 0);
    }
    for (int fd : held_fds_) close(fd);
    for (auto& [name, ledger] : ledgers_) close_ledger(&ledger);
    fs::remove_all(root_);
  }

  std::string tenant_dir(const std::string& tenant) { return root_ + "/tenants/" + tenant; }

  // Plays the daemon: grants GPU `device` to `tenant` (a ledger with a node
  // file of its own, so each tenant commits on its own).
  void grant(const std::string& tenant, int device, uint64_t quota) {
    TenantLedger& l = open_tenant(tenant);
    uint8_t uuid[16];
    ASSERT_TRUE(parse_gpu_uuid_text(kUuids[device], uuid));
    ASSERT_GE(fracgpu::testing::grant_gpu(l, uuid, quota, kContext, kCountManagedMemory), 0);
  }
  TenantLedger& open_tenant(const std::string& tenant) {
    TenantLedger& l = ledgers_[tenant];
    if (!l.is_open()) {
      char err[256] = {};
      fs::create_directories(tenant_dir(tenant));
      EXPECT_EQ(open_ledger(tenant_dir(tenant).c_str(), AccessMode::kDaemon, tenant.c_str(), &l, err, sizeof err),
                LedgerError::kOk)
          << err;
    }
    return l;
  }
  uint64_t tenant_used_on(const std::string& tenant, int device) {
    TenantLedger& l = ledgers_[tenant];
    uint8_t uuid[16];
    parse_gpu_uuid_text(kUuids[device], uuid);
    const int entry = find_gpu(l, uuid);
    return entry < 0 ? 0 : tenant_used(*l.usage, static_cast<uint32_t>(entry));
  }

  // Each claim's tenant directory linked under the claims directory, as the
  // kubelet plugin mounts them (first by name: the first tenant).
  std::vector<std::string> claims(const std::vector<std::string>& tenants) {
    fs::create_directories(root_ + "/claims");
    for (size_t i = 0; i < tenants.size(); ++i)
      fs::create_directory_symlink(tenant_dir(tenants[i]), root_ + "/claims/claim-" + std::to_string(i));
    return {"-FRACGPU_TENANT_DIR", "FRACGPU_CLAIMS_DIR=" + root_ + "/claims"};
  }

  // tenant "": no tenant at all. `extra`: "KEY=value" replaces KEY, "-KEY"
  // removes it.
  std::vector<std::string> env(const std::string& tenant, bool preload = true,
                               const std::vector<std::string>& extra = {}) {
    std::vector<std::string> e = {
        "PATH=/usr/bin:/bin",
        std::string("LD_LIBRARY_PATH=") + SIMNVML_DIR + ":" + SIMCUDA_DIR,
        "SIMCUDA_STATE=" + root_ + "/sim-state",
        "SIMCUDA_DEVICES=" + devices_,
        "FRACGPU_CLAIMS_DIR=" + root_ + "/no-claims",
    };
    if (!tenant.empty()) e.push_back("FRACGPU_TENANT_DIR=" + tenant_dir(tenant));
    if (preload) e.push_back(std::string("LD_PRELOAD=") + FRACGPU_LIB);
    for (const auto& x : extra) {
      const bool remove = x[0] == '-';
      const std::string key = remove ? x.substr(1) + "=" : x.substr(0, x.find('=') + 1);
      std::erase_if(e, [&](const std::string& y) { return y.rfind(key, 0) == 0; });
      if (!remove) e.push_back(x);
    }
    return e;
  }

  static pid_t spawn(const char* program, const std::vector<std::string>& args, const std::vector<std::string>& envs,
                     int* out_fd, int* err_fd) {
    int out[2], err[2];
    if (pipe(out) != 0 || pipe(err) != 0) return -1;
    const pid_t pid = fork();
    if (pid == 0) {
      dup2(out[1], 1);
      dup2(err[1], 2);
      close(out[0]);
      close(err[0]);
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
    close(err[1]);
    *out_fd = out[0];
    *err_fd = err[0];
    return pid;
  }

  static std::string drain(int fd) {
    std::string s;
    char buf[4096];
    ssize_t n;
    while ((n = read(fd, buf, sizeof buf)) > 0) s.append(buf, static_cast<size_t>(n));
    close(fd);
    return s;
  }

  static void parse(Output& r) {
    size_t start = 0;
    while (start < r.out.size()) {
      size_t end = r.out.find('\n', start);
      if (end == std::string::npos) end = r.out.size();
      const std::string line = r.out.substr(start, end - start);
      if (const size_t eq = line.find('='); eq != std::string::npos) r.values[line.substr(0, eq)] = line.substr(eq + 1);
      start = end + 1;
    }
  }

  Output run(const char* program, const std::vector<std::string>& args, const std::vector<std::string>& envs) {
    Output r;
    int out_fd = -1, err_fd = -1;
    const pid_t pid = spawn(program, args, envs, &out_fd, &err_fd);
    std::thread err_reader([&] { r.err = drain(err_fd); });
    r.out = drain(out_fd);
    err_reader.join();
    waitpid(pid, &r.status, 0);
    EXPECT_TRUE(WIFEXITED(r.status) && WEXITSTATUS(r.status) == 0) << r.out << r.err;
    parse(r);
    return r;
  }
  Output probe(const std::vector<std::string>& args, const std::vector<std::string>& envs) {
    return run(PROBE_PATH, args, envs);
  }
  Output nvml(const std::vector<std::string>& args, const std::vector<std::string>& envs) {
    return run(NVML_PROBE_PATH, args, envs);
  }

  // Runs the probe up to its `hold`, and leaves it holding (killed at the end).
  Output probe_and_hold(std::vector<std::string> args, const std::vector<std::string>& envs) {
    args.push_back("hold");
    Output r;
    int out_fd = -1, err_fd = -1;
    const pid_t pid = spawn(PROBE_PATH, args, envs, &out_fd, &err_fd);
    held_.push_back(pid);
    char buf[1024];
    ssize_t n;
    while (r.out.find("holding=") == std::string::npos && (n = read(out_fd, buf, sizeof buf)) > 0)
      r.out.append(buf, static_cast<size_t>(n));
    held_fds_.push_back(out_fd);  // open while it holds: it may still write
    held_fds_.push_back(err_fd);
    parse(r);
    return r;
  }

  // Device memory held on each GPU, by the simulated driver's count.
  uint64_t sim_used(int device) {
    const Output r = probe({"sim-used", std::to_string(device)}, env("", false));
    return std::stoull(r["sim_used"]);
  }

  std::string root_;
  std::string devices_ = std::string("uuid=") + kUuids[0] + ",mem=16GiB,ctx=64MiB;uuid=" + kUuids[1] +
                         ",mem=16GiB,ctx=64MiB";
  std::map<std::string, TenantLedger> ledgers_;
  std::vector<pid_t> held_;
  std::vector<int> held_fds_;
};

void use_three_gpus(std::string& devices) {
  devices += std::string(";uuid=") + kUuids[2] + ",mem=16GiB,ctx=64MiB";
}

// ---- The simulated driver reads CUDA_VISIBLE_DEVICES as the driver does ----

TEST_F(VisibleDevicesTest, TheSimulatedDriverNumbersOnlyTheDevicesCudaVisibleDevicesNames) {
  use_three_gpus(devices_);
  struct Case {
    const char* value;  // null: unset
    std::vector<int> devices;
  };
  const Case cases[] = {
      {nullptr, {0, 1, 2}},
      {"1", {1}},
      {"2,0", {2, 0}},
      {"0,2,-1,1", {0, 2}},   // an invalid entry ends the list (NVIDIA's example)
      {" 1 ,0", {1, 0}},      // blanks around an index
      {"1gpu,0", {1, 0}},     // read like strtoul
      {"0,3,1", {0}},         // past the last device
      {"0,GPU-22222222", {0}},  // an entry of the other kind
      {"GPU-22222222", {2}},  // a UUID prefix naming one device
      {"GPU-11111111-2222-3333-4444-000000000001,GPU-2,1", {1, 2}},
      {"GPU-1", {}},           // a prefix two devices share
      {"GPU-33", {}},          // no such device
      {"0,1,0", {}},           // a device named twice: none
      {"GPU-2,GPU-22222222", {}},
      {"MIG-11111111-2222-3333-4444-000000000000/1/0", {}},
      {"", {}},
      {"x", {}},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.value != nullptr ? std::string("CUDA_VISIBLE_DEVICES=\"") + c.value + "\"" : "unset");
    const std::vector<std::string> extra = {c.value != nullptr ? std::string("CUDA_VISIBLE_DEVICES=") + c.value
                                                               : std::string("-CUDA_VISIBLE_DEVICES")};
    const Output r = probe({"init", "devices"}, env("", false, extra));
    if (c.devices.empty()) {
      EXPECT_EQ(r["init"], kNoDevice);
      EXPECT_EQ(r["devices_rc"], kNotInitialized);
      continue;
    }
    EXPECT_EQ(r["init"], kSuccess);
    EXPECT_EQ(r["devices"], std::to_string(c.devices.size()));
    for (size_t i = 0; i < c.devices.size(); ++i) {
      EXPECT_EQ(r["device_" + std::to_string(i) + "_uuid"], kUuids[c.devices[i]]) << i;
      char bus[32];
      snprintf(bus, sizeof bus, "0000:%02x:00.0", 0x10 + c.devices[i]);
      EXPECT_EQ(r["device_" + std::to_string(i) + "_bus"], bus) << i;
    }
    EXPECT_EQ(r["device_past_end"], kInvalidDevice);
  }
}

// Ordinals are the visible ones everywhere in the driver API; the control
// API and NVML number devices as SIMCUDA_DEVICES lists them.
TEST_F(VisibleDevicesTest, TheSimulatedDriversOrdinalsAreTheVisibleOnes) {
  use_three_gpus(devices_);
  const Output r = probe_and_hold({"init", "primary", "0", "ctx-device", "alloc", "100MiB", "ctx-create", "2", "1",
                                "ctx-device", "primary", "2"},
                               env("", false, {"CUDA_VISIBLE_DEVICES=2,1"}));
  EXPECT_NE(r.out.find("primary=0\nctx_device=0\nalloc=0\nctx_create=0\nctx_device=1\nprimary=101\n"),
            std::string::npos)
      << r.out;
  EXPECT_EQ(sim_used(2), kContext + 100 * kMiB);  // ordinal 0: the third device
  EXPECT_EQ(sim_used(1), kContext);
  EXPECT_EQ(sim_used(0), 0u);
  const Output n = nvml({"init", "gpus", "direct"}, env("", false, {"CUDA_VISIBLE_DEVICES=2,1"}));
  EXPECT_EQ(n["gpus_direct_count"], "3");  // NVML ignores CUDA_VISIBLE_DEVICES
}

// ---- A tenant's process sees only its GPUs ----

// A tenant granted GPU 0 of two, CUDA_VISIBLE_DEVICES unset (as outside
// Kubernetes): one device, GPU 0, through every path to cuInit; GPU 1 is no
// device at all. (Before: the count was 2 and a context could be made on
// GPU 1, which nothing charged.)
TEST_F(VisibleDevicesTest, ATenantSeesOnlyTheGpuItIsGranted) {
  grant("alice", 0, 1 * kGiB);
  for (const char* init : {"init", "init-dlsym"}) {
    SCOPED_TRACE(init);
    const Output r = probe({init, "devices", "primary", "1", "getenv", "CUDA_VISIBLE_DEVICES"}, env("alice"));
    EXPECT_EQ(r["init"], kSuccess) << r.err;
    EXPECT_EQ(r["devices"], "1");
    EXPECT_EQ(r["device_0_uuid"], kUuids[0]);
    EXPECT_EQ(r["device_past_end"], kInvalidDevice);
    EXPECT_EQ(r["primary"], kInvalidDevice);  // GPU 1 cannot be reached
    EXPECT_EQ(r["env_CUDA_VISIBLE_DEVICES"], kUuids[0]);
    EXPECT_EQ(r.err, "");
  }
  EXPECT_EQ(sim_used(1), 0u);
  // Granted GPU 1 only: it is device 0.
  grant("bob", 1, 1 * kGiB);
  const Output r = probe({"init", "devices", "primary", "0", "alloc", "10MiB"}, env("bob"));
  EXPECT_EQ(r["devices"], "1");
  EXPECT_EQ(r["device_0_uuid"], kUuids[1]);
  EXPECT_EQ(r["alloc"], kSuccess) << r.err;
}

// JAX's start-up makes a context and takes most of the memory on every GPU
// it is shown. Granted GPU 0 of two, it is shown GPU 0 only: nothing is held
// on GPU 1, and its share of GPU 0 is taken within its quota. (Before: a
// context on GPU 1 held there uncharged, and the allocation there failed.)
TEST_F(VisibleDevicesTest, AJaxStartTouchesOnlyTheGrantedGpu) {
  grant("alice", 0, 4 * kGiB);
  const Output r = probe_and_hold({"jax-start", "75"}, env("alice"));
  EXPECT_EQ(r["jax_init"], kSuccess);
  EXPECT_EQ(r["jax_count"], "1");
  EXPECT_EQ(r["jax_0_uuid"], kUuids[0]);
  EXPECT_EQ(r["jax_0_ctx"], kSuccess);
  EXPECT_EQ(r["jax_0_alloc"], kSuccess);
  EXPECT_EQ(r.values.count("jax_1_ctx"), 0u) << r.out;
  const uint64_t taken = (4 * kGiB - kContext) * 3 / 4;
  EXPECT_EQ(r["jax_0_free"], std::to_string(4 * kGiB - kContext));
  EXPECT_EQ(sim_used(0), kContext + taken);
  EXPECT_EQ(sim_used(1), 0u);
  EXPECT_EQ(tenant_used_on("alice", 0), kContext + taken);
}

// Three such processes side by side: none holds anything on GPU 1.
TEST_F(VisibleDevicesTest, SeveralJaxStartsHoldNothingOnAnotherGpu) {
  grant("alice", 0, 8 * kGiB);
  for (int i = 0; i < 3; ++i) {
    const Output r = probe_and_hold({"jax-start", "10"}, env("alice"));
    EXPECT_EQ(r["jax_count"], "1");
    EXPECT_EQ(r["jax_0_alloc"], kSuccess);
  }
  EXPECT_EQ(sim_used(1), 0u);
  EXPECT_EQ(sim_used(0), tenant_used_on("alice", 0));
}

// Two claims (two tenants) in one process, granting GPU 0 and GPU 1 of
// three: the process sees both, in the node's order, each charged to the
// tenant granting it, and nothing on GPU 2.
TEST_F(VisibleDevicesTest, TwoClaimsSeeTheUnionOfTheirGpus) {
  use_three_gpus(devices_);
  grant("bob", 1, 2 * kGiB);  // bob's claim is listed second, its GPU still comes second
  grant("alice", 0, 1 * kGiB);
  const std::vector<std::string> both = claims({"alice", "bob"});
  const Output r = probe_and_hold({"jax-start", "50"}, env("", true, both));
  EXPECT_EQ(r["jax_count"], "2") << r.out;
  EXPECT_EQ(r["jax_0_uuid"], kUuids[0]);
  EXPECT_EQ(r["jax_1_uuid"], kUuids[1]);
  EXPECT_EQ(r["jax_0_alloc"], kSuccess);
  EXPECT_EQ(r["jax_1_alloc"], kSuccess);
  EXPECT_EQ(r["jax_peer_0_1"], kSuccess);
  EXPECT_EQ(r["jax_peer_1_0"], kSuccess);
  EXPECT_EQ(r.values.count("jax_2_ctx"), 0u) << r.out;
  EXPECT_EQ(tenant_used_on("alice", 0), kContext + (1 * kGiB - kContext) / 2);
  EXPECT_EQ(tenant_used_on("bob", 1), kContext + (2 * kGiB - kContext) / 2);
  EXPECT_EQ(sim_used(2), 0u);
  const Output n = nvml({"init", "gpus", "direct", "gpus", "dlsym"}, env("", true, both));
  for (const char* path : {"direct", "dlsym"}) {
    SCOPED_TRACE(path);
    const std::string p = std::string("gpus_") + path;
    EXPECT_EQ(n[p + "_count"], "2");
    EXPECT_EQ(n[p + "_0_uuid"], kUuids[0]);
    EXPECT_EQ(n[p + "_1_uuid"], kUuids[1]);
    EXPECT_EQ(n[p + "_1_index"], "1");
  }
}

// NVML ignores CUDA_VISIBLE_DEVICES: its hooks show a tenant's process its
// GPUs only, numbered as CUDA numbers them; lookups of the others find nothing.
TEST_F(VisibleDevicesTest, NvmlShowsOnlyTheTenantsGpus) {
  use_three_gpus(devices_);
  grant("alice", 1, 1 * kGiB);
  grant("alice", 2, 1 * kGiB);
  const Output n = nvml({"init", "gpus", "direct", "gpus", "dlsym", "byuuid", kUuids[0], "direct", "byuuid", kUuids[0],
                      "dlsym", "byuuid", kUuids[2], "dlsym", "bypci", "0000:10:00.0", "direct", "bypci",
                      "0000:10:00.0", "dlsym", "bypci", "0000:11:00.0", "dlsym"},
                     env("alice"));
  for (const char* path : {"direct", "dlsym"}) {
    SCOPED_TRACE(path);
    const std::string p = std::string("gpus_") + path;
    EXPECT_EQ(n[p + "_rc"], kSuccess);
    EXPECT_EQ(n[p + "_count"], "2");
    EXPECT_EQ(n[p + "_0_uuid"], kUuids[1]);
    EXPECT_EQ(n[p + "_0_index"], "0");
    EXPECT_EQ(n[p + "_1_uuid"], kUuids[2]);
    EXPECT_EQ(n[p + "_1_index"], "1");
    EXPECT_EQ(n[p + "_past_end_rc"], kNvmlInvalidArgument);
    EXPECT_EQ(n[std::string("byuuid_") + path + "_" + kUuids[0] + "_rc"], kNvmlNotFound);
    EXPECT_EQ(n[std::string("bypci_") + path + "_0000:10:00.0_rc"], kNvmlNotFound);
  }
  EXPECT_EQ(n[std::string("byuuid_dlsym_") + kUuids[2] + "_rc"], kSuccess);
  EXPECT_EQ(n["bypci_dlsym_0000:11:00.0_rc"], kSuccess);
  // CUDA numbers them the same way.
  const Output r = probe({"init", "devices"}, env("alice"));
  EXPECT_EQ(r["device_0_uuid"], kUuids[1]);
  EXPECT_EQ(r["device_1_uuid"], kUuids[2]);
  // Not a tenant's process: every GPU, as NVML has them.
  for (const auto& e : {env(""), env("alice", false)}) {
    const Output all = nvml({"init", "gpus", "direct", "byuuid", kUuids[0], "direct"}, e);
    EXPECT_EQ(all["gpus_direct_count"], "3");
    EXPECT_EQ(all[std::string("byuuid_direct_") + kUuids[0] + "_rc"], kSuccess);
  }
}

// The GPUs are numbered in NVML's (the node's) order, whatever the order of
// the grants; without NVML, in the order of the grants.
TEST_F(VisibleDevicesTest, TheTenantsGpusKeepTheNodesOrder) {
  grant("alice", 1, 1 * kGiB);  // entry 0
  grant("alice", 0, 1 * kGiB);  // entry 1
  Output r = probe({"init", "devices"}, env("alice"));
  EXPECT_EQ(r["devices"], "2");
  EXPECT_EQ(r["device_0_uuid"], kUuids[0]);
  EXPECT_EQ(r["device_1_uuid"], kUuids[1]);
  r = probe({"init", "devices"}, env("alice", true, {std::string("LD_LIBRARY_PATH=") + SIMCUDA_DIR}));
  EXPECT_EQ(r["devices"], "2");
  if (r["device_0_uuid"] == kUuids[0]) GTEST_SKIP() << "an NVML outside the tests numbers these GPUs";
  EXPECT_EQ(r["device_0_uuid"], kUuids[1]);
  EXPECT_EQ(r["device_1_uuid"], kUuids[0]);
}

// A CUDA_VISIBLE_DEVICES the user set chooses among the tenant's GPUs as the
// driver would on a node that had only them.
TEST_F(VisibleDevicesTest, AUserValueChoosesAmongTheTenantsGpus) {
  use_three_gpus(devices_);
  grant("alice", 0, 1 * kGiB);
  grant("alice", 2, 1 * kGiB);
  struct Case {
    std::string value;
    std::vector<int> devices;  // empty: cuInit refused
    bool said;                 // a log line says why it was refused
  };
  const std::vector<Case> cases = {
      {"1", {2}, false},  // the tenant's second GPU
      {"1,0", {2, 0}, false},
      {"0,1,2", {0, 2}, false},  // "2" names none of its GPUs: the list ends there
      {std::string(kUuids[2]) + "," + kUuids[0], {2, 0}, false},
      {"GPU-22222222", {2}, false},
      {"gpu-22222222", {}, true},  // not a UUID: read as an index, and none
      {kUuids[1], {}, true},       // a GPU the tenant is not granted
      {std::string(kUuids[0]) + "," + kUuids[1] + "," + kUuids[2], {0}, false},
      {"2", {}, true},
      {"0,0", {}, true},
      {"MIG-11111111-2222-3333-4444-000000000000/1/0", {}, true},
      {"", {}, false},  // asked for no GPU: refused without a word, as the driver would
  };
  for (const Case& c : cases) {
    SCOPED_TRACE("CUDA_VISIBLE_DEVICES=\"" + c.value + "\"");
    const Output r = probe({"init", "devices", "getenv", "CUDA_VISIBLE_DEVICES"},
                        env("alice", true, {"CUDA_VISIBLE_DEVICES=" + c.value}));
    if (c.devices.empty()) {
      EXPECT_EQ(r["init"], kNoDevice);
      EXPECT_EQ(r["devices_rc"], kNotInitialized);
      EXPECT_EQ(r["env_CUDA_VISIBLE_DEVICES"], c.value);  // left as the user set it
      if (c.said) {
        EXPECT_NE(r.err.find("cuInit refused (CUDA_ERROR_NO_DEVICE): CUDA_VISIBLE_DEVICES=\"" + c.value + "\""),
                  std::string::npos)
            << r.err;
        EXPECT_NE(r.err.find(std::string(kUuids[0]) + "," + kUuids[2]), std::string::npos) << r.err;
      } else {
        EXPECT_EQ(r.err, "");
      }
      continue;
    }
    EXPECT_EQ(r["init"], kSuccess) << r.err;
    EXPECT_EQ(r["devices"], std::to_string(c.devices.size()));
    std::string expected;
    for (size_t i = 0; i < c.devices.size(); ++i) {
      EXPECT_EQ(r["device_" + std::to_string(i) + "_uuid"], kUuids[c.devices[i]]) << i;
      expected += (i > 0 ? "," : "") + std::string(kUuids[c.devices[i]]);
    }
    EXPECT_EQ(r["env_CUDA_VISIBLE_DEVICES"], expected);
  }
}

// No GPU granted (here: the policy not committed yet): cuInit says there is
// no device, without initializing the driver, so a later cuInit succeeds
// once the GPU is granted.
TEST_F(VisibleDevicesTest, NoGpuGrantedIsNoDevice) {
  open_tenant("alice");
  Output r = probe({"init", "devices"}, env("alice"));
  EXPECT_EQ(r["init"], kNoDevice);
  EXPECT_NE(r.err.find("cuInit refused (CUDA_ERROR_NO_DEVICE): no GPU is granted to tenant \"alice\""),
            std::string::npos)
      << r.err;
  grant("alice", 1, 1 * kGiB);
  r = probe({"init", "devices"}, env("alice"));
  EXPECT_EQ(r["init"], kSuccess);
  EXPECT_EQ(r["device_0_uuid"], kUuids[1]);
}

// A process with no tenant (FRACGPU_UNMANAGED=passthrough) or without the
// interposer sees what the driver shows, CUDA_VISIBLE_DEVICES untouched.
TEST_F(VisibleDevicesTest, ProcessesWithoutATenantSeeWhatTheDriverShows) {
  grant("alice", 0, 1 * kGiB);
  for (const auto& e : {env(""), env("alice", false)}) {
    Output r = probe({"init", "devices", "getenv", "CUDA_VISIBLE_DEVICES"}, e);
    EXPECT_EQ(r["devices"], "2");
    EXPECT_EQ(r["env_CUDA_VISIBLE_DEVICES_unset"], "1");
    std::vector<std::string> one = e;
    one.push_back("CUDA_VISIBLE_DEVICES=1");
    r = probe({"init", "devices", "getenv", "CUDA_VISIBLE_DEVICES"}, one);
    EXPECT_EQ(r["devices"], "1");
    EXPECT_EQ(r["device_0_uuid"], kUuids[1]);
    EXPECT_EQ(r["env_CUDA_VISIBLE_DEVICES"], "1");
  }
}

// A forked child keeps its parent's view, and a program it runs inherits the
// narrowed variable (and under the interposer chooses the same GPUs again).
TEST_F(VisibleDevicesTest, ChildrenKeepTheNarrowedView) {
  grant("alice", 1, 1 * kGiB);
  const Output r = probe({"init", "fork", "init", "devices", "getenv", "CUDA_VISIBLE_DEVICES"}, env("alice"));
  EXPECT_EQ(r["fork_child_exit"], "0");
  EXPECT_EQ(r["devices"], "1");
  EXPECT_EQ(r["device_0_uuid"], kUuids[1]);
  EXPECT_EQ(r["env_CUDA_VISIBLE_DEVICES"], kUuids[1]);
  const Output again = probe({"init", "devices"}, env("alice", true, {std::string("CUDA_VISIBLE_DEVICES=") + kUuids[1]}));
  EXPECT_EQ(again["devices"], "1");
  EXPECT_EQ(again["device_0_uuid"], kUuids[1]);
}

// A program started after its parent's cuInit inherits the value the
// interposer set there: the GPUs granted then. A resize may have changed
// them since, so that value is not read as the user's choice: the user's
// own, kept beside it, chooses again among the GPUs granted now (none kept:
// all of them).
TEST_F(VisibleDevicesTest, AProgramStartedLaterChoosesAgainAmongTheGpusGrantedNow) {
  use_three_gpus(devices_);
  grant("alice", 0, 1 * kGiB);
  grant("alice", 2, 1 * kGiB);
  // The parent: the user asked for its second GPU.
  Output r = probe({"init", "getenv", "CUDA_VISIBLE_DEVICES", "getenv", "FRACGPU_VISIBLE_DEVICES_SET", "getenv",
                    "FRACGPU_VISIBLE_DEVICES_ASKED"},
                   env("alice", true, {"CUDA_VISIBLE_DEVICES=1"}));
  EXPECT_EQ(r["env_CUDA_VISIBLE_DEVICES"], kUuids[2]);
  EXPECT_EQ(r["env_FRACGPU_VISIBLE_DEVICES_SET"], kUuids[2]);
  EXPECT_EQ(r["env_FRACGPU_VISIBLE_DEVICES_ASKED"], "1");
  // Children of a parent granted GPU 1 only, which alice no longer is.
  const std::string inherited = std::string("CUDA_VISIBLE_DEVICES=") + kUuids[1];
  const std::string set = std::string("FRACGPU_VISIBLE_DEVICES_SET=") + kUuids[1];
  r = probe({"init", "devices"}, env("alice", true, {inherited, set}));
  EXPECT_EQ(r["init"], kSuccess) << r.err;
  EXPECT_EQ(r["devices"], "2");
  EXPECT_EQ(r["device_0_uuid"], kUuids[0]);
  EXPECT_EQ(r["device_1_uuid"], kUuids[2]);
  r = probe({"init", "devices"}, env("alice", true, {inherited, set, "FRACGPU_VISIBLE_DEVICES_ASKED=1"}));
  EXPECT_EQ(r["devices"], "1");
  EXPECT_EQ(r["device_0_uuid"], kUuids[2]);
  // The parent's choice selects none of the GPUs granted now: the refusal
  // quotes that choice and says where it came from, not the inherited value.
  r = probe({"init"}, env("alice", true, {inherited, set, "FRACGPU_VISIBLE_DEVICES_ASKED=2"}));
  EXPECT_EQ(r["init"], kNoDevice);
  EXPECT_NE(r.err.find("CUDA_VISIBLE_DEVICES=\"2\" (as a parent process was given it, kept in "
                       "FRACGPU_VISIBLE_DEVICES_ASKED) selects none of the 2 GPU(s)"),
            std::string::npos)
      << r.err;
  // A value the user set in the child (not the one set for its parent) is
  // the user's.
  r = probe({"init", "devices"}, env("alice", true, {std::string("CUDA_VISIBLE_DEVICES=") + kUuids[1], "FRACGPU_VISIBLE_DEVICES_SET=0"}));
  EXPECT_EQ(r["init"], kNoDevice);
}

}  // namespace
