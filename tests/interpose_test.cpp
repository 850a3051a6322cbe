// The interposer end to end: fracgpu_probe runs under LD_PRELOAD=libfracgpu.so
// against the simulated driver, and these tests check what it gets (results,
// the memory it is shown, which entry points it receives) against the ledger
// and against the simulated driver's own count of device memory.
#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "ledger.h"
#include "policy_util.h"
#include "reclaim_util.h"

using namespace fracgpu::ledger;
namespace fs = std::filesystem;

namespace {

constexpr uint64_t kMiB = 1ull << 20;
constexpr uint64_t kGiB = 1ull << 30;
constexpr uint64_t kContextBytes = 64 * kMiB;  // footprint per context, in the sim and the policy
constexpr const char* kUuid0 = "GPU-11111111-2222-3333-4444-000000000000";
constexpr const char* kUuid1 = "GPU-11111111-2222-3333-4444-000000000001";

// CUDA error codes as the probe prints them.
constexpr const char* kSuccess = "0";
constexpr const char* kOutOfMemory = "2";
constexpr const char* kNotPermitted = "800";
constexpr const char* kNotFound = "500";
constexpr const char* kNoDevice = "100";

void uuid_bytes(const char* text, uint8_t out[16]) {
  std::string hex;
  for (const char* p = text + 4; *p; ++p)
    if (*p != '-') hex += *p;
  for (int i = 0; i < 16; ++i) out[i] = static_cast<uint8_t>(std::stoul(hex.substr(2 * i, 2), nullptr, 16));
}

struct ProbeResult {
  int status = -1;
  std::map<std::string, std::string> values;
  std::string out, err;
  const std::string& operator[](const std::string& key) const {
    static const std::string missing = "<missing>";
    auto it = values.find(key);
    return it == values.end() ? missing : it->second;
  }
  uint64_t num(const std::string& key) const { return std::stoull(operator[](key)); }
};

void parse_values(ProbeResult& r) {
  size_t start = 0;
  while (start < r.out.size()) {
    size_t end = r.out.find('\n', start);
    if (end == std::string::npos) end = r.out.size();
    std::string line = r.out.substr(start, end - start);
    size_t pos = 0;
    while (pos < line.size()) {
      size_t sp = line.find(' ', pos);
      std::string token = line.substr(pos, sp == std::string::npos ? std::string::npos : sp - pos);
      size_t eq = token.find('=');
      if (eq != std::string::npos) r.values[token.substr(0, eq)] = token.substr(eq + 1);
      if (sp == std::string::npos) break;
      pos = sp + 1;
    }
    start = end + 1;
  }
}

class InterposeTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/fracgpu-interpose-XXXXXX";
    ASSERT_NE(mkdtemp(tmpl), nullptr);
    root_ = tmpl;
    tenant_dir_ = root_ + "/tenants/alice";
    fs::create_directories(root_ + "/tenants");
    devices_ = std::string("uuid=") + kUuid0 + ",mem=16GiB,ctx=64MiB;uuid=" + kUuid1 + ",mem=16GiB,ctx=64MiB";
  }
  void TearDown() override {
    if (daemon_.is_open()) close_ledger(&daemon_);
    fs::remove_all(root_);
  }

  // Plays the daemon: grants `uuid` to alice with `quota` bytes.
  int grant(const char* uuid, uint64_t quota, bool count_managed = true) {
    if (!daemon_.is_open()) {
      char err[256];
      EXPECT_EQ(open_ledger(tenant_dir_.c_str(), AccessMode::kDaemon, "alice", &daemon_, err, sizeof err),
                LedgerError::kOk)
          << err;
    }
    uint8_t bytes[16];
    uuid_bytes(uuid, bytes);
    return fracgpu::testing::grant_gpu(daemon_, bytes, quota, kContextBytes,
                                       count_managed ? static_cast<uint32_t>(kCountManagedMemory) : 0u);
  }

  // What the tenant's live processes hold: exited and killed probes' slots
  // are reclaimed first, as the daemon would.
  uint64_t used(int gpu) {
    uint64_t ignored = 0;
    reclaim_settled(daemon_, -1, &ignored);
    return tenant_used(*daemon_.usage, static_cast<uint32_t>(gpu));
  }

  std::vector<std::string> environment(bool preload, const std::vector<std::string>& extra) {
    std::vector<std::string> env = {
        "PATH=/usr/bin:/bin",
        // NVML too: a tenant's GPUs are numbered in NVML's (the node's) order.
        std::string("LD_LIBRARY_PATH=") + SIMNVML_DIR + ":" + SIMCUDA_DIR,
        "SIMCUDA_STATE=" + root_ + "/sim-state",
        "SIMCUDA_DEVICES=" + devices_,
        "FRACGPU_TENANT_DIR=" + tenant_dir_,
    };
    if (preload) env.push_back(std::string("LD_PRELOAD=") + FRACGPU_LIB);
    for (const auto& e : extra) {
      const std::string key = e.substr(0, e.find('=') + 1);
      std::erase_if(env, [&](const std::string& x) { return x.rfind(key, 0) == 0; });
      if (e.back() != '=') env.push_back(e);  // "KEY=" alone removes KEY
    }
    return env;
  }

  pid_t spawn(const std::vector<std::string>& args, const std::vector<std::string>& env, int* out_fd, int* err_fd) {
    int out[2], err[2];
    EXPECT_EQ(pipe(out), 0);
    EXPECT_EQ(pipe(err), 0);
    pid_t pid = fork();
    if (pid == 0) {
      dup2(out[1], 1);
      dup2(err[1], 2);
      close(out[0]);
      close(err[0]);
      std::vector<char*> argv{const_cast<char*>(PROBE_PATH)};
      for (const auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
      argv.push_back(nullptr);
      std::vector<char*> envp;
      for (const auto& e : env) envp.push_back(const_cast<char*>(e.c_str()));
      envp.push_back(nullptr);
      execve(PROBE_PATH, argv.data(), envp.data());
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

  ProbeResult probe(const std::vector<std::string>& args, const std::vector<std::string>& extra_env = {},
                    bool preload = true) {
    ProbeResult r;
    int out_fd, err_fd;
    pid_t pid = spawn(args, environment(preload, extra_env), &out_fd, &err_fd);
    std::thread err_reader([&] { r.err = drain(err_fd); });
    r.out = drain(out_fd);
    err_reader.join();
    waitpid(pid, &r.status, 0);
    parse_values(r);
    return r;
  }

  // Starts a probe that ends with `hold`; returns once it holds.
  struct Held {
    pid_t pid;
    int out_fd, err_fd;
    ProbeResult seen;
  };
  Held probe_and_hold(std::vector<std::string> args, const std::vector<std::string>& extra_env = {}) {
    args.push_back("hold");
    Held h{};
    h.pid = spawn(args, environment(true, extra_env), &h.out_fd, &h.err_fd);
    std::string acc;
    char buf[512];
    while (acc.find("holding=") == std::string::npos) {
      ssize_t n = read(h.out_fd, buf, sizeof buf);
      if (n <= 0) break;
      acc.append(buf, static_cast<size_t>(n));
    }
    h.seen.out = acc;
    parse_values(h.seen);
    return h;
  }
  void kill_held(Held& h) {
    kill(h.pid, SIGKILL);
    waitpid(h.pid, nullptr, 0);
    close(h.out_fd);
    close(h.err_fd);
  }

  // Ground truth: the simulated driver's own count, read by a probe without
  // the interposer.
  uint64_t sim_used(int device) {
    ProbeResult r = probe({"sim-used", std::to_string(device)}, {}, false);
    return r.num("sim_used");
  }
  uint64_t sim_peak(int device) {
    ProbeResult r = probe({"sim-peak", std::to_string(device)}, {}, false);
    return r.num("sim_peak");
  }

  // A node config giving alice 1 GiB of GPU 0, for start_daemon.
  void write_daemon_config() {
    FILE* f = fopen(daemon_config().c_str(), "w");
    ASSERT_NE(f, nullptr);
    fprintf(f,
            "[daemon]\nrun_dir = \"%s\"\nreap_interval_ms = 100\n\n[[gpu]]\nuuid = \"%s\"\ncontext_memory = \"64MiB\"\n\n"
            "[[tenant]]\nname = \"alice\"\n[tenant.memory]\n\"%s\" = \"1GiB\"\n",
            root_.c_str(), kUuid0, kUuid0);
    fclose(f);
  }
  std::string daemon_config() const { return root_ + "/fracgpud.toml"; }

  // The real fracgpud on that config (stderr discarded).
  pid_t start_daemon() {
    pid_t pid = fork();
    if (pid == 0) {
      // The daemon as these tests always ran it: without NVML.
      std::vector<std::string> env = environment(false, {std::string("LD_LIBRARY_PATH=") + SIMCUDA_DIR});
      std::vector<char*> envp;
      for (auto& e : env) envp.push_back(e.data());
      envp.push_back(nullptr);
      const std::string config = daemon_config();
      const char* argv[] = {FRACGPUD_PATH, "--config", config.c_str(), nullptr};
      int devnull = open("/dev/null", O_WRONLY);
      dup2(devnull, 2);
      execve(FRACGPUD_PATH, const_cast<char**>(argv), envp.data());
      _exit(127);
    }
    return pid;
  }

  // Until the daemon has granted alice GPU 0; *view then maps her ledger.
  ::testing::AssertionResult wait_until_granted(TenantLedger* view) {
    char err[256] = {};
    const bool granted = wait_for([&] {
      if (view->is_open()) close_ledger(view);
      return open_ledger(tenant_dir_.c_str(), AccessMode::kReadOnly, nullptr, view, err, sizeof err) ==
                 LedgerError::kOk &&
             read_gpu_entry(*view, 0).state == kGpuGranted;
    }, 5000);
    if (granted) return ::testing::AssertionSuccess();
    return ::testing::AssertionFailure() << "alice was not granted GPU 0: " << err;
  }

  static bool wait_for(const std::function<bool()>& done, int ms) {
    for (int i = 0; i < ms / 10 && !done(); ++i) std::this_thread::sleep_for(std::chrono::milliseconds(10));
    return done();
  }

  std::string root_, tenant_dir_, devices_;
  TenantLedger daemon_;
};

TEST_F(InterposeTest, AllocationsStopAtTheQuotaAndTheTenantSeesItsQuota) {
  const int g = grant(kUuid0, 1 * kGiB);
  Held h = probe_and_hold({"init", "primary", "0", "alloc", "512MiB", "alloc", "512MiB", "info", "total", "0"});
  EXPECT_EQ(h.seen["init"], kSuccess);
  EXPECT_EQ(h.seen["primary"], kSuccess);
  EXPECT_EQ(h.seen["alloc"], kOutOfMemory);  // the second: 64 MiB context + 2 x 512 MiB > 1 GiB
  EXPECT_EQ(h.seen.num("total"), 1 * kGiB);
  EXPECT_EQ(h.seen.num("free"), 1 * kGiB - kContextBytes - 512 * kMiB);
  EXPECT_EQ(h.seen.num("device_total"), 1 * kGiB);
  EXPECT_EQ(used(g), kContextBytes + 512 * kMiB);
  // The refused allocation was never made.
  EXPECT_EQ(sim_used(0), kContextBytes + 512 * kMiB);
  kill_held(h);
  uint64_t bytes = 0;
  EXPECT_EQ(reclaim_settled(daemon_, -1, &bytes), 1);
  EXPECT_EQ(bytes, kContextBytes + 512 * kMiB);
  EXPECT_EQ(used(g), 0u);
}

TEST_F(InterposeTest, EveryReleaseReturnsExactlyWhatWasCharged) {
  const int g = grant(kUuid0, 2 * kGiB);
  Held h = probe_and_hold({"init", "primary", "0", "alloc", "100MiB", "alloc", "3", "alloc-v1", "1MiB", "free", "0",
                           "free", "0", "free", "0", "alloc", "7"});
  EXPECT_EQ(h.seen["alloc_v1"], kSuccess);
  EXPECT_EQ(used(g), kContextBytes + 7);
  kill_held(h);
}

TEST_F(InterposeTest, UnlimitedGrantShowsTheRealDevice) {
  grant(kUuid0, kUnlimited);
  ProbeResult r = probe({"init", "primary", "0", "info", "total", "0", "alloc", "8GiB"});
  EXPECT_EQ(r["alloc"], kSuccess);
  EXPECT_EQ(r.num("total"), 16 * kGiB);
  EXPECT_EQ(r.num("device_total"), 16 * kGiB);
  EXPECT_EQ(r.num("free"), 16 * kGiB - kContextBytes);  // never 0
  EXPECT_EQ(r.err, "");  // a healthy process hears nothing from the interposer
}

TEST_F(InterposeTest, QuotasAreKeyedByUuidNotByOrdinal) {
  // Entry 0 is device 1's UUID: a limit keyed by index would land on device 0.
  const int g1 = grant(kUuid1, 1 * kGiB);
  const int g0 = grant(kUuid0, 3 * kGiB);
  ASSERT_EQ(g1, 0);
  ProbeResult r = probe({"init", "total", "0", "total", "1", "primary", "1", "fill", "256MiB"});
  EXPECT_EQ(r["primary"], kSuccess);
  EXPECT_EQ(r.num("filled"), 1 * kGiB - 256 * kMiB);  // the context took 64 MiB of the last chunk
  ProbeResult t0 = probe({"init", "total", "0"});
  EXPECT_EQ(t0.num("device_total"), 3 * kGiB);
  (void)g0;
}

// A process sees only its tenant's GPUs (visible_devices_test), numbered
// as the driver numbers them then. A GPU taken from the tenant while the
// process runs stays one of its devices: it is refused there, and shown 0.
TEST_F(InterposeTest, AGpuNoLongerGrantedIsRefused) {
  grant(kUuid0, 1 * kGiB);
  grant(kUuid1, 1 * kGiB);
  const std::string barrier = root_ + "/barrier";
  ASSERT_TRUE(fs::create_directories(barrier));
  ProbeResult r;
  std::thread runner([&] { r = probe({"init", "barrier", barrier, "primary", "0", "total", "0", "primary", "1"}); });
  bool ready = false;
  for (int waited_ms = 0; !ready && waited_ms < 20000; waited_ms += 5) {
    for (const auto& entry : fs::directory_iterator(barrier)) ready |= entry.path().filename().string().rfind("ready-", 0) == 0;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  EXPECT_TRUE(ready);
  uint8_t gpu0[16];
  uuid_bytes(kUuid0, gpu0);
  fracgpu::testing::publish_policy(daemon_, [&](GpuPolicy* gpus) {
    gpus[find_gpu(daemon_, gpu0)].state.store(kGpuUnused);
  });
  FILE* go = fopen((barrier + "/go").c_str(), "w");
  ASSERT_NE(go, nullptr);
  fclose(go);
  runner.join();
  EXPECT_EQ(r["init"], kSuccess);
  EXPECT_NE(r.out.find("primary=2\ntotal_result=0\ndevice_total=0\n"), std::string::npos) << r.out;  // out of memory
  EXPECT_EQ(r["primary"], kSuccess);  // GPU 1, still granted
  EXPECT_NE(r.err.find("device 0 is not granted"), std::string::npos) << r.err;
}

TEST_F(InterposeTest, PitchIsChargedAsPitchTimesHeight) {
  const int g = grant(kUuid0, 1 * kGiB);
  Held h = probe_and_hold({"init", "primary", "0", "pitch", "1000", "100"});
  EXPECT_EQ(h.seen["pitch_result"], kSuccess);
  const uint64_t pitch = h.seen.num("pitch");
  EXPECT_GE(pitch, 1000u);
  EXPECT_EQ(used(g), kContextBytes + pitch * 100);
  EXPECT_EQ(sim_used(0), kContextBytes + pitch * 100);
  kill_held(h);
}

TEST_F(InterposeTest, ManagedMemoryIsChargedUnlessConfiguredOff) {
  int g = grant(kUuid0, 256 * kMiB);
  ProbeResult r = probe({"init", "primary", "0", "managed", "128MiB", "managed", "128MiB"});
  EXPECT_EQ(r["managed"], kOutOfMemory);
  grant(kUuid0, 256 * kMiB, /*count_managed=*/false);
  Held h = probe_and_hold({"init", "primary", "0", "managed", "128MiB", "managed", "128MiB"});
  EXPECT_EQ(h.seen["managed"], kSuccess);
  EXPECT_EQ(used(g), kContextBytes);
  kill_held(h);
}

TEST_F(InterposeTest, VirtualMemoryHandlesAreCharged) {
  const int g = grant(kUuid0, 512 * kMiB);
  Held h = probe_and_hold({"init", "primary", "0", "vmm", "256MiB", "0", "vmm", "256MiB", "0", "vmm", "128MiB", "0",
                           "vmm-release", "0"});
  EXPECT_EQ(h.seen["vmm"], kSuccess);  // the last one made: 256 refused, then 128 fits
  EXPECT_EQ(used(g), kContextBytes + 128 * kMiB);
  kill_held(h);
  ProbeResult r = probe({"init", "primary", "0", "vmm", "256MiB", "0", "vmm", "256MiB", "0"});
  EXPECT_EQ(r["vmm"], kOutOfMemory);
}

// The driver frees a VMM allocation when its handle is released and its
// last mapping is gone, whichever comes last: mapping, then releasing the
// handle at once, is a common pattern.
TEST_F(InterposeTest, VirtualMemoryStaysChargedWhileMappedOrRetained) {
  const int g = grant(kUuid0, 512 * kMiB);
  Held h = probe_and_hold({"init", "primary", "0", "vmm", "256MiB", "0", "vmm-map", "0", "vmm-release", "0"});
  EXPECT_EQ(h.seen["vmm_map"], kSuccess);
  EXPECT_EQ(h.seen["vmm_release"], kSuccess);
  EXPECT_EQ(used(g), kContextBytes + 256 * kMiB);
  EXPECT_EQ(sim_used(0), used(g));
  kill_held(h);
  used(g);
  // So another 256 MiB does not fit beside it.
  ProbeResult r = probe({"init", "primary", "0", "vmm", "256MiB", "0", "vmm-map", "0", "vmm-release", "0", "vmm",
                         "256MiB", "0"});
  EXPECT_EQ(r["vmm"], kOutOfMemory);
  // Unmapped as well: given back.
  h = probe_and_hold({"init", "primary", "0", "vmm", "256MiB", "0", "vmm-map", "0", "vmm-release", "0", "vmm-unmap",
                      "0"});
  EXPECT_EQ(h.seen["vmm_unmap"], kSuccess);
  EXPECT_EQ(used(g), kContextBytes);
  EXPECT_EQ(sim_used(0), kContextBytes);
  kill_held(h);
  used(g);
  // A handle retained from its mapping is one more reference to release.
  h = probe_and_hold({"init", "primary", "0", "vmm", "256MiB", "0", "vmm-map", "0", "vmm-retain", "0", "vmm-release",
                      "0", "vmm-unmap", "0"});
  EXPECT_EQ(h.seen["vmm_retain"], kSuccess);
  EXPECT_EQ(used(g), kContextBytes + 256 * kMiB);
  EXPECT_EQ(sim_used(0), used(g));
  kill_held(h);
  used(g);
  h = probe_and_hold({"init", "primary", "0", "vmm", "256MiB", "0", "vmm-map", "0", "vmm-retain", "0", "vmm-release",
                      "0", "vmm-unmap", "0", "vmm-release", "0"});
  EXPECT_EQ(h.seen["vmm_release"], kSuccess);
  EXPECT_EQ(used(g), kContextBytes);
  EXPECT_EQ(sim_used(0), kContextBytes);
  kill_held(h);
}

// cuCtxDetach (deprecated, still handed to the CUDA runtime) destroys the
// context unless cuCtxAttach raised its usage count.
TEST_F(InterposeTest, ADetachedContextIsGivenBackUnlessStillAttached) {
  const int g = grant(kUuid0, 1 * kGiB);
  Held h = probe_and_hold({"init", "ctx-create", "2", "0", "alloc", "100MiB", "ctx-attach", "ctx-detach", "last"});
  EXPECT_EQ(h.seen["ctx_attach"], kSuccess);
  EXPECT_EQ(h.seen["ctx_detach"], kSuccess);
  EXPECT_EQ(used(g), kContextBytes + 100 * kMiB);
  EXPECT_EQ(sim_used(0), used(g));
  kill_held(h);
  used(g);
  h = probe_and_hold({"init", "ctx-create", "2", "0", "alloc", "100MiB", "ctx-attach", "ctx-detach", "last",
                      "ctx-detach", "0"});
  EXPECT_EQ(h.seen["ctx_detach"], kSuccess);
  EXPECT_EQ(used(g), 0u);  // the context and the memory allocated in it
  EXPECT_EQ(sim_used(0), 0u);
  kill_held(h);
}

TEST_F(InterposeTest, StreamOrderedPoolsChargeWhatThePoolHolds) {
  const int g = grant(kUuid0, 512 * kMiB);
  // Default pool, release threshold 0: memory goes back at synchronize.
  Held h = probe_and_hold({"init", "primary", "0", "async", "100MiB", "async", "500MiB", "free-async", "0", "sync"});
  EXPECT_EQ(h.seen["async"], kOutOfMemory);
  EXPECT_EQ(used(g), kContextBytes);
  EXPECT_EQ(sim_used(0), kContextBytes);
  kill_held(h);
  used(g);  // the killed probe's charges are gone before the next starts

  // A pool that keeps its memory: the charge stays until trimmed or destroyed.
  h = probe_and_hold({"init", "primary", "0", "pool-create", "0", "pool-threshold", "1GiB", "pool-async", "100MiB",
                      "free-async", "0", "sync", "info"});
  EXPECT_EQ(h.seen["pool_async"], kSuccess);
  EXPECT_EQ(used(g), kContextBytes + 100 * kMiB);
  EXPECT_EQ(sim_used(0), used(g));
  EXPECT_EQ(h.seen.num("free"), 512 * kMiB - kContextBytes - 100 * kMiB);
  kill_held(h);
  used(g);  // the killed probe's charges are gone before the next starts

  h = probe_and_hold({"init", "primary", "0", "pool-create", "0", "pool-threshold", "1GiB", "pool-async", "100MiB",
                      "free-async", "0", "pool-trim", "0"});
  EXPECT_EQ(used(g), kContextBytes);
  kill_held(h);
  used(g);  // the killed probe's charges are gone before the next starts

  // Destroyed with allocations outstanding: the driver keeps their memory
  // until they are freed, and the charge stays until then.
  h = probe_and_hold({"init", "primary", "0", "pool-create", "0", "pool-threshold", "1GiB", "pool-async", "100MiB",
                      "pool-async", "100MiB", "pool-destroy"});
  EXPECT_EQ(h.seen["pool_destroy"], kSuccess);
  EXPECT_EQ(used(g), kContextBytes + 200 * kMiB);
  EXPECT_EQ(sim_used(0), used(g));
  kill_held(h);
  used(g);  // the killed probe's charges are gone before the next starts
  h = probe_and_hold({"init", "primary", "0", "pool-create", "0", "pool-threshold", "1GiB", "pool-async", "100MiB",
                      "pool-async", "100MiB", "pool-destroy", "free-async", "0", "free-async", "0"});
  EXPECT_EQ(used(g), kContextBytes);
  EXPECT_EQ(sim_used(0), kContextBytes);
  kill_held(h);
  used(g);

  // Reuse inside the pool needs no new charge.
  h = probe_and_hold({"init", "primary", "0", "pool-create", "0", "pool-threshold", "1GiB", "pool-async", "300MiB",
                      "free-async", "0", "sync", "pool-async", "300MiB"});
  EXPECT_EQ(h.seen["pool_async"], kSuccess);
  EXPECT_EQ(used(g), kContextBytes + 300 * kMiB);
  kill_held(h);
  used(g);  // the killed probe's charges are gone before the next starts
}

// Where the interposer cannot tell what an allocation will cost, it refuses
// or charges more, never lets memory through uncharged. SIMCUDA_FAIL makes
// the simulated driver refuse the query.
TEST_F(InterposeTest, WhatCannotBeCostedIsRefusedOrOvercharged) {
  const int g = grant(kUuid0, 512 * kMiB);
  // The pool cuMemAllocAsync would use cannot be named.
  ProbeResult r = probe({"init", "primary", "0", "async", "100MiB"}, {"SIMCUDA_FAIL=cuDeviceGetMemPool"});
  EXPECT_EQ(r["primary"], kSuccess);
  EXPECT_EQ(r["async"], "801");  // CUDA_ERROR_NOT_SUPPORTED, the driver's own answer
  // A graph whose nodes cannot be read.
  r = probe({"init", "primary", "0", "graph-node", "0", "100MiB", "graph-launch", "last"},
            {"SIMCUDA_FAIL=cuGraphGetNodes"});
  EXPECT_EQ(r["graph_alloc_node"], kSuccess);
  EXPECT_EQ(r["graph_instantiate"], "801");
  // A pool whose size cannot be read: its charge is never lowered on a guess.
  Held h = probe_and_hold({"init", "primary", "0", "async", "100MiB", "free-async", "0", "sync"},
                          {"SIMCUDA_FAIL=cuMemPoolGetAttribute"});
  EXPECT_EQ(h.seen["async"], kSuccess);
  EXPECT_EQ(used(g), kContextBytes + 100 * kMiB);
  EXPECT_EQ(sim_used(0), kContextBytes);  // the pool gave it back at the synchronize
  kill_held(h);
}

TEST_F(InterposeTest, PoolMemoryIsChargedToThePoolsOwnGpu) {
  const int g0 = grant(kUuid0, 1 * kGiB);
  const int g1 = grant(kUuid1, 1 * kGiB);
  // Current context on device 0, pool on device 1.
  Held h = probe_and_hold({"init", "primary", "0", "pool-create", "1", "pool-threshold", "1GiB", "pool-async",
                           "100MiB"});
  EXPECT_EQ(h.seen["pool_async"], kSuccess);
  EXPECT_EQ(used(g0), kContextBytes);
  EXPECT_EQ(used(g1), 100 * kMiB);
  EXPECT_EQ(sim_used(1), 100 * kMiB);
  kill_held(h);
  // Device 1's default pool, never seen created, first used while device
  // 0's context is current: its device is found from the driver's default
  // pools, and every later allocation from it is charged there too.
  h = probe_and_hold({"init", "primary", "0", "pool-default", "1", "pool-threshold", "1GiB", "pool-async", "100MiB",
                      "pool-async", "60MiB"});
  EXPECT_EQ(h.seen["pool_default"], kSuccess);
  EXPECT_EQ(h.seen["pool_async"], kSuccess);
  EXPECT_EQ(used(g0), kContextBytes);
  EXPECT_EQ(used(g1), 160 * kMiB);
  EXPECT_EQ(sim_used(1), 160 * kMiB);
  kill_held(h);
}

// CUDA_GRAPH_INSTANTIATE_FLAG_UPLOAD uploads the exec as it is made, which
// takes its graph memory there and then: charged as cuGraphUpload's is, and
// past the quota refused with no exec left. (The flag once backed an 8 GiB
// allocation node on a 1 GiB quota, uncharged.)
TEST_F(InterposeTest, AGraphUploadedAtInstantiationIsCharged) {
  const int g = grant(kUuid0, 1 * kGiB);
  Held h = probe_and_hold({"init", "primary", "0", "graph-node-upload", "0", "100MiB"});
  EXPECT_EQ(h.seen["graph_instantiate"], kSuccess);
  EXPECT_EQ(used(g), kContextBytes + 100 * kMiB);
  EXPECT_EQ(sim_used(0), used(g));
  kill_held(h);
  used(g);
  h = probe_and_hold({"init", "primary", "0", "graph-node-upload", "0", "8GiB"});
  EXPECT_EQ(h.seen["graph_instantiate"], kOutOfMemory);
  EXPECT_EQ(h.seen["graph_exec_left"], "0");
  EXPECT_EQ(used(g), kContextBytes);
  EXPECT_EQ(sim_used(0), kContextBytes);
  kill_held(h);
}

// cuMemAllocAsync on a stream of another device's context: the driver serves
// it from the pool of the stream's device, and it is charged there. (It was
// charged to the current context's device, whose pool did not grow: nothing
// stayed charged, and four 900 MiB allocations held 3.6 GiB on a 1 GiB quota.)
TEST_F(InterposeTest, AnAsyncAllocationOnAnotherDevicesStreamIsChargedToThatDevice) {
  const int g0 = grant(kUuid0, 1 * kGiB);
  const int g1 = grant(kUuid1, 1 * kGiB);
  Held h = probe_and_hold({"init", "primary", "0", "stream-on", "1", "async-other", "600MiB"});
  EXPECT_EQ(h.seen["stream_on"], kSuccess);
  EXPECT_EQ(h.seen["async_other"], kSuccess);
  EXPECT_EQ(used(g0), kContextBytes);
  EXPECT_EQ(used(g1), kContextBytes + 600 * kMiB);
  EXPECT_EQ(sim_used(1), used(g1));
  kill_held(h);
  used(g0);
  used(g1);
  // Past device 1's quota: refused, though device 0 has room.
  h = probe_and_hold({"init", "primary", "0", "stream-on", "1", "async-other", "600MiB", "async-other", "600MiB"});
  EXPECT_EQ(h.seen["async_other"], kOutOfMemory);
  EXPECT_EQ(used(g1), kContextBytes + 600 * kMiB);
  EXPECT_EQ(sim_used(1), used(g1));
  kill_held(h);
}

// CUDA graphs' allocation nodes take device memory when the graph is launched
// or uploaded, and the driver keeps it cached for graphs until trimmed.
TEST_F(InterposeTest, GraphMemoryIsChargedWhenTheGraphTakesIt) {
  const int g = grant(kUuid0, 512 * kMiB);
  // Captured from a stream: nothing is taken at capture or instantiation;
  // the launch takes it; relaunching takes nothing more.
  Held h = probe_and_hold({"init", "primary", "0", "graph-capture", "100MiB", "info", "graph-launch", "last",
                           "graph-launch", "last", "sync"});
  EXPECT_EQ(h.seen["capture_alloc"], kSuccess);
  EXPECT_EQ(h.seen["graph_instantiate"], kSuccess);
  EXPECT_EQ(h.seen.num("free"), 512 * kMiB - kContextBytes);
  EXPECT_EQ(h.seen["graph_launch"], kSuccess);
  EXPECT_EQ(used(g), kContextBytes + 100 * kMiB);
  EXPECT_EQ(sim_used(0), used(g));
  kill_held(h);
  used(g);  // the killed probe's charges are gone before the next starts

  // Destroying the exec leaves its memory cached (still charged) until a trim.
  h = probe_and_hold({"init", "primary", "0", "graph-capture", "100MiB", "graph-launch", "last",
                      "graph-exec-destroy", "last", "info"});
  EXPECT_EQ(h.seen["graph_exec_destroy"], kSuccess);
  EXPECT_EQ(used(g), kContextBytes + 100 * kMiB);
  EXPECT_EQ(sim_used(0), used(g));
  kill_held(h);
  used(g);
  h = probe_and_hold({"init", "primary", "0", "graph-capture", "100MiB", "graph-launch", "last",
                      "graph-exec-destroy", "last", "graph-trim", "0", "info"});
  EXPECT_EQ(h.seen["graph_trim"], kSuccess);
  EXPECT_EQ(used(g), kContextBytes);
  EXPECT_EQ(h.seen.num("free"), 512 * kMiB - kContextBytes);
  EXPECT_EQ(sim_used(0), kContextBytes);
  kill_held(h);
  used(g);

  // Past the quota: the launch is refused and takes nothing; the capture
  // itself is not refused (it takes nothing).
  h = probe_and_hold({"init", "primary", "0", "alloc", "300MiB", "graph-capture", "200MiB", "graph-launch", "last",
                      "graph-upload", "last"});
  EXPECT_EQ(h.seen["capture_alloc"], kSuccess);
  EXPECT_EQ(h.seen["graph_launch"], kOutOfMemory);
  EXPECT_EQ(h.seen["graph_upload"], kOutOfMemory);
  EXPECT_EQ(used(g), kContextBytes + 300 * kMiB);
  EXPECT_EQ(sim_used(0), used(g));
  kill_held(h);
  used(g);

  // An explicit allocation node, instantiated with parameters, backed by an
  // upload. A second graph near the quota is refused while the first holds
  // its memory, and is served from the cache once the first is destroyed.
  h = probe_and_hold({"init", "primary", "0", "graph-node", "0", "300MiB", "graph-upload", "last", "graph-node",
                      "0", "300MiB", "graph-launch", "last", "graph-exec-destroy", "0", "graph-launch", "last"});
  EXPECT_EQ(h.seen["graph_alloc_node"], kSuccess);
  EXPECT_EQ(h.seen["graph_upload"], kSuccess);
  const size_t refused = h.seen.out.find("graph_launch=2\n");
  const size_t served = h.seen.out.find("graph_launch=0\n");
  EXPECT_NE(refused, std::string::npos) << h.seen.out;
  EXPECT_NE(served, std::string::npos) << h.seen.out;
  EXPECT_LT(refused, served);
  EXPECT_EQ(used(g), kContextBytes + 300 * kMiB);
  EXPECT_EQ(sim_used(0), used(g));
  kill_held(h);
  // A killed process's graph memory goes with it.
  EXPECT_EQ(used(g), 0u);
}

TEST_F(InterposeTest, ArraysAreChargedAtTheirRealSize) {
  const int g = grant(kUuid0, 512 * kMiB);
  Held h = probe_and_hold({"init", "primary", "0", "array", "1000", "1000", "array3d", "64", "64", "64", "mipmap",
                           "512", "512", "4"});
  EXPECT_EQ(h.seen["array"], kSuccess);
  EXPECT_EQ(h.seen["array3d"], kSuccess);
  EXPECT_EQ(h.seen["mipmap"], kSuccess);
  EXPECT_EQ(used(g), sim_used(0));  // the sim's own size for each, not our estimate
  EXPECT_GT(used(g), kContextBytes + 1000 * 1000 * 16);
  kill_held(h);
  h = probe_and_hold({"init", "primary", "0", "array", "1000", "1000", "array-destroy", "0", "mipmap", "512", "512",
                      "4", "mipmap-destroy", "0"});
  EXPECT_EQ(used(g), kContextBytes);
  kill_held(h);
  ProbeResult r = probe({"init", "primary", "0", "array", "16384", "16384"});  // 4 GiB of float4
  EXPECT_EQ(r["array"], kOutOfMemory);
}

// With the handle table full, an array the driver made is destroyed and
// its charge given back: exactly what it was charged, which by then is the
// driver's size (3 rows of 1 MiB: 4 MiB), not the reservation made before
// the driver answered (the rows padded to 32: 32 MiB).
TEST_F(InterposeTest, AnArrayRefusedForAFullHandleTableGivesBackWhatItWasCharged) {
  devices_ = std::string("uuid=") + kUuid0 + ",mem=64GiB,ctx=64MiB";  // room for a full table of 2 MiB arrays
  const int g = grant(kUuid0, 48 * kGiB);
  Held h = probe_and_hold({"init", "primary", "0", "array-until-refused", "1", "1", "array", "65536", "3"});
  EXPECT_EQ(h.seen["arrays_refused"], kOutOfMemory) << h.seen.out;
  EXPECT_GE(std::stoll(h.seen["arrays_made"]), 16000) << "refused for the table, not the quota";
  EXPECT_EQ(h.seen["array"], kOutOfMemory) << "no room to record it";
  EXPECT_EQ(used(g), sim_used(0)) << "the ledger against the driver's count";
  kill_held(h);
}

TEST_F(InterposeTest, ContextsAreChargedTheirFootprintAndTakeTheirAllocationsWithThem) {
  const int g = grant(kUuid0, 1 * kGiB);
  Held h = probe_and_hold({"init", "ctx-create", "1", "0", "ctx-create", "2", "0", "ctx-create", "3", "0",
                           "ctx-create", "4", "0", "alloc", "100MiB", "ctx-destroy", "last"});
  EXPECT_EQ(h.seen["ctx_create"], kSuccess);
  EXPECT_EQ(h.seen["ctx_destroy"], kSuccess);
  EXPECT_EQ(used(g), 3 * kContextBytes);  // the fourth context and its 100 MiB are gone
  EXPECT_EQ(sim_used(0), 3 * kContextBytes);
  kill_held(h);
  // Primary context: charged once however often retained, given back on reset.
  h = probe_and_hold({"init", "primary", "0", "primary", "0", "alloc", "10MiB", "reset-primary", "0"});
  EXPECT_EQ(used(g), 0u);
  kill_held(h);
  // A context that does not fit is refused.
  grant(kUuid0, 100 * kMiB);
  ProbeResult r = probe({"init", "ctx-create", "4", "0", "ctx-create", "4", "0"});
  EXPECT_EQ(r["ctx_create"], kOutOfMemory);
}

// The interposer remembers each thread's context -> device answer; a context
// handle that comes back for a new context on another GPU must not be charged
// to the old one. The simulated driver keeps handles unique unless
// SIMCUDA_REUSE_CONTEXTS=1 makes it hand the destroyed context's handle to the
// next one.
TEST_F(InterposeTest, AReusedContextHandleIsChargedToItsNewGpu) {
  const int g0 = grant(kUuid0, 1 * kGiB);
  const int g1 = grant(kUuid1, 1 * kGiB);
  Held h = probe_and_hold({"init", "ctx-create", "2", "0", "current-ctx", "first_ctx", "alloc", "1MiB",
                           "ctx-destroy", "last", "ctx-create", "2", "1", "current-ctx", "second_ctx", "alloc",
                           "100MiB"},
                          {"SIMCUDA_REUSE_CONTEXTS=1"});
  ASSERT_EQ(h.seen["ctx_create"], kSuccess);
  ASSERT_EQ(h.seen["alloc"], kSuccess);
  ASSERT_NE(h.seen["first_ctx"], "0");
  // Without reuse this test would prove nothing: say so rather than pass.
  ASSERT_EQ(h.seen["first_ctx"], h.seen["second_ctx"]) << "the simulated driver did not reuse the context handle";
  EXPECT_EQ(used(g0), 0u);
  EXPECT_EQ(used(g1), kContextBytes + 100 * kMiB);
  EXPECT_EQ(sim_used(1), kContextBytes + 100 * kMiB);
  kill_held(h);
}

// The same for a green context's CUcontext: destroyed, its handle may come
// back for a context on another GPU. Green contexts take no context
// footprint from the quota.
TEST_F(InterposeTest, AGreenContextsReusedHandleIsChargedToItsNewGpu) {
  const int g0 = grant(kUuid0, 1 * kGiB);
  const int g1 = grant(kUuid1, 1 * kGiB);
  Held h = probe_and_hold({"init", "green-create", "0", "green_ctx", "alloc", "1MiB", "green-destroy", "ctx-create",
                           "2", "1", "current-ctx", "second_ctx", "alloc", "100MiB"},
                          {"SIMCUDA_REUSE_CONTEXTS=1"});
  ASSERT_EQ(h.seen["green_create"], kSuccess);
  ASSERT_EQ(h.seen["green_destroy"], kSuccess);
  ASSERT_EQ(h.seen["ctx_create"], kSuccess);
  ASSERT_EQ(h.seen["alloc"], kSuccess);
  ASSERT_NE(h.seen["green_ctx"], "0");
  ASSERT_EQ(h.seen["green_ctx"], h.seen["second_ctx"]) << "the simulated driver did not reuse the context handle";
  // The green context's memory outlives it (the primary context's, in the sim).
  EXPECT_EQ(used(g0), 1 * kMiB);
  EXPECT_EQ(sim_used(0), 1 * kMiB);
  EXPECT_EQ(used(g1), kContextBytes + 100 * kMiB);
  EXPECT_EQ(sim_used(1), kContextBytes + 100 * kMiB);
  kill_held(h);
  used(g0);  // the killed probe's charges are gone before the next starts

  // Reused by another green context: only the green hooks can tell the
  // thread that its cached answer for this handle is stale.
  h = probe_and_hold({"init", "green-create", "0", "green_ctx", "alloc", "1MiB", "green-destroy", "green-create", "1",
                      "second_ctx", "alloc", "100MiB"},
                     {"SIMCUDA_REUSE_CONTEXTS=1"});
  ASSERT_EQ(h.seen["green_create"], kSuccess);
  ASSERT_EQ(h.seen["alloc"], kSuccess);
  ASSERT_EQ(h.seen["green_ctx"], h.seen["second_ctx"]) << "the simulated driver did not reuse the context handle";
  EXPECT_EQ(used(g0), 1 * kMiB);
  EXPECT_EQ(used(g1), 100 * kMiB);
  EXPECT_EQ(sim_used(1), 100 * kMiB);
  kill_held(h);
}

// ---- Reaching the driver: linked, dlsym, cuGetProcAddress ----

TEST_F(InterposeTest, CuGetProcAddressHandsOutTheHookForTheVariantTheDriverChose) {
  grant(kUuid0, 1 * kGiB);
  struct Case {
    const char* symbol;
    int version;
    const char* flags;
    const char* lib;
    const char* sym;
  };
  const Case cases[] = {
      {"cuMemAlloc", 3010, "0", "libfracgpu.so", "cuMemAlloc"},
      {"cuMemAlloc", 3020, "0", "libfracgpu.so", "cuMemAlloc_v2"},
      {"cuMemAlloc", 12080, "0", "libfracgpu.so", "cuMemAlloc_v2"},
      {"cuCtxCreate", 3010, "0", "libfracgpu.so", "cuCtxCreate"},
      {"cuCtxCreate", 3020, "0", "libfracgpu.so", "cuCtxCreate_v2"},
      {"cuCtxCreate", 11040, "0", "libfracgpu.so", "cuCtxCreate_v3"},
      {"cuCtxCreate", 12050, "0", "libfracgpu.so", "cuCtxCreate_v4"},
      {"cuMemAllocAsync", 12000, "0", "libfracgpu.so", "cuMemAllocAsync"},
      {"cuMemAllocAsync", 12000, "2", "libfracgpu.so", "cuMemAllocAsync_ptsz"},
      {"cuGetProcAddress", 12000, "0", "libfracgpu.so", "cuGetProcAddress_v2"},
      // Not hooked: exactly what the driver returns.
      {"cuMemAdvise", 12000, "0", "libcuda.so.1", "cuMemAdvise"},
      {"cuMemAdvise", 12020, "0", "libcuda.so.1", "cuMemAdvise_v2"},
      {"cuCtxGetDevice", 12000, "0", "libcuda.so.1", "cuCtxGetDevice"},
  };
  for (const Case& c : cases) {
    ProbeResult r = probe({"init", "getproc", c.symbol, std::to_string(c.version), c.flags});
    SCOPED_TRACE(std::string(c.symbol) + " @" + std::to_string(c.version) + " flags " + c.flags);
    EXPECT_EQ(r["getproc"], kSuccess);
    EXPECT_EQ(r["getproc_lib"], c.lib);
    EXPECT_EQ(r["getproc_sym"], c.sym);
  }
  ProbeResult missing = probe({"init", "getproc", "cuNoSuchFunction", "12000", "0"});
  EXPECT_EQ(missing["getproc"], kNotFound);
  EXPECT_EQ(missing["getproc_lib"], "none");
  ProbeResult too_old = probe({"init", "getproc", "cuMemAllocAsync", "11000", "0"});
  EXPECT_EQ(too_old["getproc"], kNotFound);
  EXPECT_EQ(too_old["getproc_status"], "2");  // CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT
  ProbeResult v1 = probe({"init", "getproc-v1", "cuMemAlloc", "12000"});
  EXPECT_EQ(v1["getproc_v1_entry_lib"], "libfracgpu.so");
  EXPECT_EQ(v1["getproc_v1_sym"], "cuMemAlloc_v2");
}

TEST_F(InterposeTest, EveryPathEnforcesTheQuotaAndCallsTheRightVariant) {
  const int g = grant(kUuid0, 256 * kMiB);
  ProbeResult r = probe({"init", "primary", "0", "call-alloc-via-getproc", "12000", "100MiB", "call-alloc-via-getproc",
                         "12000", "100MiB", "simcount", "cuMemAlloc_v2"});
  EXPECT_EQ(r["call_alloc"], kOutOfMemory);
  EXPECT_EQ(r["simcount_cuMemAlloc_v2"], "1");  // the refused one never reached the driver
  r = probe({"init", "primary", "0", "call-alloc-via-getproc", "3010", "1MiB", "simcount", "cuMemAlloc", "simcount",
             "cuMemAlloc_v2"});
  EXPECT_EQ(r["simcount_cuMemAlloc"], "1");  // the v1 ABI reached the v1 function
  EXPECT_EQ(r["simcount_cuMemAlloc_v2"], "0");
  r = probe({"init", "primary", "0", "call-alloc-via-dlsym", "100MiB", "call-alloc-via-dlsym", "100MiB"});
  EXPECT_EQ(r["call_alloc_dlsym"], kOutOfMemory);
  r = probe({"init", "primary", "0", "call-async-ptsz-via-getproc", "100MiB", "call-async-ptsz-via-getproc",
             "100MiB", "simcount", "cuMemAllocAsync_ptsz", "simcount", "cuMemAllocAsync"});
  EXPECT_EQ(r["call_async_ptsz"], kOutOfMemory);
  EXPECT_EQ(r["simcount_cuMemAllocAsync_ptsz"], "1");
  EXPECT_EQ(r["simcount_cuMemAllocAsync"], "0");
  r = probe({"init", "dlsym", "cuMemAlloc_v2", "dlsym", "cuCtxGetDevice"});
  EXPECT_EQ(r["dlsym_lib"], "libcuda.so.1");  // the last one: not hooked
  r = probe({"init", "dlsym", "cuMemAlloc_v2"});
  EXPECT_EQ(r["dlsym_lib"], "libfracgpu.so");
  EXPECT_EQ(r["dlsym_sym"], "cuMemAlloc_v2");
  // dlsym(RTLD_NEXT) keeps glibc's meaning through our dlsym: the search
  // starts after the library that called it, not after libfracgpu.so.
  r = probe({"rtld-next"});
  EXPECT_EQ(r["rtld_next_who"], "2");
  r = probe({"rtld-next"}, {}, /*preload=*/false);
  EXPECT_EQ(r["rtld_next_who"], "2");
  // dlsym(RTLD_DEFAULT) too searches the caller's scope: from a library
  // loaded with RTLD_LOCAL, it finds that library's own dependency.
  r = probe({"rtld-default-local", RTLD_LOCAL_USER});
  EXPECT_EQ(r["rtld_default_local"], "7");
  r = probe({"rtld-default-local", RTLD_LOCAL_USER}, {}, /*preload=*/false);
  EXPECT_EQ(r["rtld_default_local"], "7");
  r = probe({"init", "export-table", "simcount", "cuGetExportTable"});
  EXPECT_EQ(r["simcount_cuGetExportTable"], "1");  // passed through untouched
  (void)g;
}

// ---- Races, kills, bad state ----

// The quota is a limit on the device's memory in use, whatever the driver
// holds it for (allocations, pool reserves, the graph memory cache, contexts),
// under any interleaving. The simulated driver's own high-water mark is the
// judge: it counts all of those, as a real driver does.
class RaceTest : public InterposeTest, public ::testing::WithParamInterface<const char*> {};

// Threads of one process racing on one path: sharing the current context,
// the default pool (async), one explicit pool (pool) and one graph exec that
// every thread launches next to its own (graph).
TEST_P(RaceTest, ThreadsOfOneProcessNeverPassTheQuota) {
  constexpr uint64_t kQuota = 1 * kGiB;
  const int g = grant(kUuid0, kQuota);
  const std::string kind = GetParam();
  ProbeResult reset = probe({"sim-reset-peak", "0"}, {}, false);
  ASSERT_EQ(reset.status, 0) << reset.err;
  std::vector<std::string> args = {"init", "primary", "0"};
  // An explicit pool that keeps what is freed into it: allocations at the
  // edge find it holding unused memory.
  if (kind == "pool" || kind == "mixed") args.insert(args.end(), {"pool-create", "0", "pool-threshold", "256MiB"});
  args.insert(args.end(), {"race", "8", "1.5", "96MiB", kind});
  ProbeResult r = probe(args);
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_EQ(r["race_other"], "0") << "last error " << r["race_last_other"] << "\n" << r.err;
  EXPECT_GT(r.num("race_ok"), 100u) << r.out << r.err;
  // Refusals (few for graphs: a refused launch first trims the cache, taking
  // the memory of execs not running).
  EXPECT_GT(r.num("race_oom"), 0u) << r.out << r.err;
  const uint64_t peak = sim_peak(0);
  EXPECT_LE(peak, kQuota) << r.out << r.err;
  // The race reached the edge. Graph launches refused at the edge trim the
  // cache first, which takes the memory of execs not running: their peak
  // lands anywhere above half.
  EXPECT_GT(peak, kind == "graph" ? kQuota / 2 : kQuota - 2 * 96 * kMiB);
  EXPECT_EQ(used(g), 0u);  // everything given back (the probe has exited)
}

INSTANTIATE_TEST_SUITE_P(EveryChargedPath, RaceTest,
                         ::testing::Values("linear", "pitch", "managed", "async", "pool", "vmm", "array", "graph",
                                           "relaunch", "context", "mixed"));

// Processes of one tenant, each with threads, racing on every path at once.
TEST_F(InterposeTest, ThreadsInProcessesNeverTogetherPassTheQuota) {
  constexpr uint64_t kQuota = 1 * kGiB;
  grant(kUuid0, kQuota);
  ProbeResult reset = probe({"sim-reset-peak", "0"}, {}, false);
  ASSERT_EQ(reset.status, 0) << reset.err;
  // All four take their contexts first, then race together: on a loaded
  // machine a late starter would otherwise find the quota full and have
  // nothing to race with.
  const std::string barrier = root_ + "/barrier";
  ASSERT_TRUE(fs::create_directories(barrier));
  std::vector<std::thread> runners;
  std::vector<ProbeResult> results(4);
  for (int p = 0; p < 4; ++p)
    runners.emplace_back([&, p] {
      results[p] = probe({"init", "primary", "0", "pool-create", "0", "pool-threshold", "128MiB", "barrier", barrier,
                          "race", "4", "3", "96MiB", p == 0 ? "linear" : "mixed"});
    });
  auto ready = [&] {
    int n = 0;
    for (const auto& entry : fs::directory_iterator(barrier)) n += entry.path().filename().string().rfind("ready-", 0) == 0;
    return n;
  };
  for (int waited_ms = 0; ready() < 4 && waited_ms < 20000; waited_ms += 5)
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  EXPECT_EQ(ready(), 4) << "not every probe reached the barrier";
  FILE* go = fopen((barrier + "/go").c_str(), "w");
  ASSERT_NE(go, nullptr);
  fclose(go);
  for (auto& t : runners) t.join();
  uint64_t ok = 0, oom = 0;
  for (const auto& r : results) {
    ASSERT_EQ(r.status, 0) << r.err;
    EXPECT_EQ(r["primary"], kSuccess);  // 4 contexts fit: the race starts after
    EXPECT_EQ(r["race_other"], "0") << "last error " << r["race_last_other"];
    ok += r.num("race_ok");
    oom += r.num("race_oom");
  }
  EXPECT_GT(ok, 1000u);
  EXPECT_GT(oom, 100u);  // the edge was reached, often
  // The driver's own high-water mark: contexts and allocations together.
  EXPECT_LE(sim_peak(0), kQuota);
  EXPECT_GT(sim_peak(0), kQuota / 2);
}

TEST_F(InterposeTest, AKilledProcessLeavesNoChargeOnceReclaimed) {
  const int g = grant(kUuid0, 1 * kGiB);
  Held h = probe_and_hold({"init", "primary", "0", "alloc", "300MiB"});
  EXPECT_EQ(used(g), kContextBytes + 300 * kMiB);
  kill_held(h);
  // A newcomer that finds the quota taken reclaims the dead by itself, even
  // with no daemon running.
  ProbeResult r = probe({"init", "primary", "0", "alloc", "900MiB"});
  EXPECT_EQ(r["alloc"], kSuccess) << r.err;
}

TEST_F(InterposeTest, WithoutAValidNodeFileAPolicyIsRefusedNeverPassedThrough) {
  // Which copy of the policy is in force is the node file's to say: without
  // it the process is denied (as for a corrupt ledger), not let through
  // unlimited as a process without any tenant would be.
  grant(kUuid0, 1 * kGiB);
  close_ledger(&daemon_);
  const std::string node = tenant_dir_ + "/node";
  ASSERT_EQ(rename(node.c_str(), (node + ".away").c_str()), 0);
  ProbeResult r = probe({"init", "primary", "0", "alloc", "1MiB"});
  EXPECT_EQ(r.status, 0);
  EXPECT_EQ(r["init"], kNotPermitted);
  EXPECT_EQ(r["alloc"], kNotPermitted);
  EXPECT_NE(r.err.find("GPU access denied"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("/node: missing"), std::string::npos) << r.err;
  // Another program's file in its place.
  std::ofstream(node, std::ios::binary) << std::string(sizeof(NodeSegment), 'x');
  r = probe({"init", "primary", "0", "alloc", "1MiB"});
  EXPECT_EQ(r["init"], kNotPermitted);
  EXPECT_EQ(r["alloc"], kNotPermitted);
  EXPECT_NE(r.err.find("not a fracgpu node segment"), std::string::npos) << r.err;
  // Back in place: the grant holds again.
  ASSERT_EQ(rename((node + ".away").c_str(), node.c_str()), 0);
  r = probe({"init", "primary", "0", "alloc", "1MiB"});
  EXPECT_EQ(r["alloc"], kSuccess) << r.err;
}

TEST_F(InterposeTest, APolicyWithoutACopyOfTheCommittedGenerationGrantsNothing) {
  // The node file says a generation this tenant's policy has no copy of (a
  // daemon died creating the tenant, or another node file was linked in):
  // nothing is granted, and the process says why.
  grant(kUuid0, 1 * kGiB);
  daemon_.node->committed.store(daemon_.node->committed.load() + 2);
  ProbeResult r = probe({"init", "primary", "0", "alloc", "1MiB"});
  EXPECT_EQ(r.status, 0);
  EXPECT_EQ(r["init"], kNoDevice) << r.err;  // no GPU at all
  EXPECT_NE(r["primary"], kSuccess) << r.err;
  EXPECT_NE(r["alloc"], kSuccess) << r.err;
  EXPECT_NE(r.err.find("holds no copy of generation"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("no GPU is granted to tenant \"alice\""), std::string::npos) << r.err;
}

TEST_F(InterposeTest, ACorruptOrForeignLedgerIsRefusedWithoutCrashing) {
  grant(kUuid0, 1 * kGiB);
  close_ledger(&daemon_);
  const std::string policy = tenant_dir_ + "/policy";
  uint32_t version = kLayoutVersion + 1;
  int fd = open(policy.c_str(), O_RDWR);
  ASSERT_EQ(pwrite(fd, &version, sizeof version, offsetof(SegmentHeader, layout_version)), 4);
  ProbeResult r = probe({"init", "primary", "0", "alloc", "1MiB"});
  EXPECT_EQ(r.status, 0);  // the process carries on
  EXPECT_EQ(r["init"], kNotPermitted);
  EXPECT_EQ(r["alloc"], kNotPermitted);
  EXPECT_NE(r.err.find("layout version"), std::string::npos) << r.err;
  uint64_t garbage = 0x0123456789abcdefull;
  ASSERT_EQ(pwrite(fd, &garbage, sizeof garbage, 0), 8);
  close(fd);
  r = probe({"init"});
  EXPECT_EQ(r.status, 0);
  EXPECT_EQ(r["init"], kNotPermitted);
  EXPECT_NE(r.err.find("not a fracgpu"), std::string::npos) << r.err;
}

TEST_F(InterposeTest, WithoutTenantStateTheProcessPassesThroughOrIsDenied) {
  ProbeResult r = probe({"init", "primary", "0", "alloc", "8GiB"}, {"FRACGPU_TENANT_DIR="});
  EXPECT_EQ(r["init"], kSuccess);
  EXPECT_EQ(r["alloc"], kSuccess);
  EXPECT_NE(r.err.find("no tenant"), std::string::npos) << r.err;
  r = probe({"init", "alloc", "1MiB"}, {"FRACGPU_TENANT_DIR=", "FRACGPU_UNMANAGED=deny"});
  EXPECT_EQ(r["init"], kNotPermitted);
  EXPECT_EQ(r.status, 0);
  // FRACGPU_TENANT + FRACGPU_RUN_DIR select the same tenant directory.
  const int g = grant(kUuid0, 256 * kMiB);
  r = probe({"init", "primary", "0", "alloc", "150MiB", "alloc", "100MiB"},
            {"FRACGPU_TENANT_DIR=", "FRACGPU_TENANT=alice", "FRACGPU_RUN_DIR=" + root_});
  EXPECT_EQ(r["alloc"], kOutOfMemory);
  (void)g;
}

// A tenant runs at most kMaxSlots processes that use a GPU at once (each
// holds a slot of its usage file, by a record lock). One more is denied with
// a line that says why, and gets CUDA_ERROR_NOT_PERMITTED, never a hang or
// a crash; once a slot is free again, a new process takes it.
TEST_F(InterposeTest, AProcessBeyondItsTenantsSlotsIsDeniedUntilOneIsFree) {
  grant(kUuid0, 256 * kMiB);
  const std::string usage = tenant_dir_ + "/usage";
  int ready[2], go[2];
  ASSERT_EQ(pipe(ready), 0);
  ASSERT_EQ(pipe(go), 0);
  // One process holding every slot's lock stands for kMaxSlots live ones.
  const pid_t holder = fork();
  ASSERT_GE(holder, 0);
  if (holder == 0) {
    const int fd = open(usage.c_str(), O_RDWR | O_CLOEXEC);
    bool all = fd >= 0;
    for (uint32_t s = 0; all && s < kMaxSlots; ++s) {
      struct flock fl {};
      fl.l_type = F_WRLCK;
      fl.l_whence = SEEK_SET;
      fl.l_start = slot_lock_offset(s);
      fl.l_len = 1;
      all = fcntl(fd, F_SETLK, &fl) == 0;
    }
    char c = all ? 'y' : 'n';
    if (write(ready[1], &c, 1) != 1 || read(go[0], &c, 1) != 1 || c != 'f') _exit(1);
    struct flock fl {};  // free the last slot, then hold the rest until told
    fl.l_type = F_UNLCK;
    fl.l_whence = SEEK_SET;
    fl.l_start = slot_lock_offset(kMaxSlots - 1);
    fl.l_len = 1;
    c = fcntl(fd, F_SETLK, &fl) == 0 ? 'y' : 'n';
    if (write(ready[1], &c, 1) != 1 || read(go[0], &c, 1) != 1) _exit(1);
    _exit(0);
  }
  char c = 0;
  ASSERT_EQ(read(ready[0], &c, 1), 1);
  ASSERT_EQ(c, 'y') << "could not lock every slot";
  const std::vector<std::string> work = {"init", "primary", "0", "alloc", "64MiB"};
  ProbeResult r = probe(work);
  EXPECT_EQ(r.status, 0);
  EXPECT_EQ(r["init"], kNotPermitted);
  EXPECT_EQ(r["alloc"], kNotPermitted);
  EXPECT_NE(r.err.find(tenant_dir_ + ": no free process slot (full); GPU access denied"), std::string::npos)
      << r.err;
  c = 'f';
  ASSERT_EQ(write(go[1], &c, 1), 1);
  ASSERT_EQ(read(ready[0], &c, 1), 1);
  ASSERT_EQ(c, 'y');
  r = probe(work);
  EXPECT_EQ(r["init"], kSuccess) << r.err;
  EXPECT_EQ(r["alloc"], kSuccess) << r.err;
  c = 'x';
  ASSERT_EQ(write(go[1], &c, 1), 1);
  int status = 0;
  ASSERT_EQ(waitpid(holder, &status, 0), holder);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  for (int fd : {ready[0], ready[1], go[0], go[1]}) close(fd);
}

// A tenant directory with a policy is a tenant: a usage file that is
// missing, not a regular file, foreign or of the wrong size means its
// charges cannot be counted, so GPU access is denied, never unlimited. Only
// a directory with no tenant state at all passes through.
TEST_F(InterposeTest, APolicyWithoutAUsableUsageFileIsDeniedNeverPassedThrough) {
  grant(kUuid0, 256 * kMiB);
  close_ledger(&daemon_);
  const std::string usage = tenant_dir_ + "/usage";
  const std::vector<std::string> greedy = {"init", "primary", "0", "alloc", "8GiB"};
  fs::remove(usage);
  ProbeResult r = probe(greedy);
  EXPECT_EQ(r.status, 0);
  EXPECT_EQ(r["init"], kNotPermitted);
  EXPECT_EQ(r["alloc"], kNotPermitted);
  EXPECT_NE(r.err.find(usage + ": missing; GPU access denied"), std::string::npos) << r.err;
  ASSERT_EQ(mkfifo(usage.c_str(), 0666), 0);  // and no waiting on it
  r = probe(greedy);
  EXPECT_EQ(r["alloc"], kNotPermitted);
  EXPECT_NE(r.err.find(usage + ": refused: not a regular file (a FIFO)"), std::string::npos) << r.err;
  fs::remove(usage);
  ASSERT_EQ(symlink((root_ + "/elsewhere").c_str(), usage.c_str()), 0);
  r = probe(greedy);
  EXPECT_EQ(r["alloc"], kNotPermitted);
  EXPECT_NE(r.err.find("(a symbolic link)"), std::string::npos) << r.err;
  fs::remove(usage);
  {
    std::ofstream(usage) << "short";
  }
  r = probe(greedy);
  EXPECT_EQ(r["alloc"], kNotPermitted);
  EXPECT_NE(r.err.find("size is 5 bytes"), std::string::npos) << r.err;
  // The usage file without its policy is tenant state too.
  fs::remove(tenant_dir_ + "/policy");
  r = probe(greedy);
  EXPECT_EQ(r["alloc"], kNotPermitted) << r.err;
  // Nothing at all: not a tenant, passes through.
  fs::remove(usage);
  r = probe(greedy);
  EXPECT_EQ(r["alloc"], kSuccess) << r.err;
  EXPECT_NE(r.err.find("no tenant ledger"), std::string::npos) << r.err;
}

// `rm usage` (possible where a tenant could write its directory) with the
// daemon down: denied. With the daemon up: denied until the daemon has made
// a new one, then limited again; never unlimited.
TEST_F(InterposeTest, ARemovedUsageFileIsNeverUnlimitedWithTheDaemonDownOrUp) {
  write_daemon_config();
  pid_t daemon = start_daemon();
  TenantLedger view;
  ASSERT_TRUE(wait_until_granted(&view));
  close_ledger(&view);
  const std::string usage = tenant_dir_ + "/usage";
  const std::vector<std::string> greedy = {"init", "primary", "0", "alloc", "8GiB"};

  fs::remove(usage);
  ProbeResult r = probe(greedy);
  EXPECT_NE(r["alloc"], kSuccess) << r.err;  // denied, or limited if the daemon was quicker
  ASSERT_TRUE(wait_for([&] { return fs::exists(usage); }, 2000)) << "the daemon did not make a new usage file";
  r = probe({"init", "primary", "0", "alloc", "900MiB", "alloc", "8GiB"});
  EXPECT_EQ(r["init"], kSuccess) << r.err;
  EXPECT_EQ(r["alloc"], kOutOfMemory) << r.err;  // the last: 900 MiB fit, 8 GiB does not

  kill(daemon, SIGKILL);
  waitpid(daemon, nullptr, 0);
  fs::remove(usage);
  r = probe(greedy);
  EXPECT_EQ(r["init"], kNotPermitted) << r.err;
  EXPECT_EQ(r["alloc"], kNotPermitted);
  daemon = start_daemon();
  ASSERT_TRUE(wait_for([&] { return fs::exists(usage); }, 5000));
  r = probe({"init", "primary", "0", "alloc", "900MiB", "alloc", "8GiB"});
  EXPECT_EQ(r["alloc"], kOutOfMemory) << r.err;
  kill(daemon, SIGTERM);
  waitpid(daemon, nullptr, 0);
}

TEST_F(InterposeTest, AForkedChildAttachesWithItsOwnSlot) {
  const int g = grant(kUuid0, 1 * kGiB);
  ProbeResult r = probe({"init", "primary", "0", "alloc", "600MiB", "fork", "init", "primary", "0", "alloc",
                         "600MiB", "alloc", "200MiB"});
  EXPECT_EQ(r["fork_child_exit"], "0");
  // The child shares the tenant's quota (its 600 MiB did not fit next to the
  // parent's) and was charged on a slot of its own, context included.
  EXPECT_EQ(r["alloc"], kSuccess);
  uint64_t bytes = 0;
  EXPECT_EQ(reclaim_settled(daemon_, -1, &bytes), 2);
  EXPECT_EQ(bytes, 2 * kContextBytes + 800 * kMiB);
  EXPECT_EQ(used(g), 0u);
}

TEST_F(InterposeTest, WorksBeforeMainAndDuringExit) {
  const int g = grant(kUuid0, 1 * kGiB);
  ProbeResult r = probe({"alloc", "200MiB", "info", "free-at-exit"}, {"PROBE_BEFORE_MAIN=1"});
  EXPECT_EQ(r.status, 0) << r.err;
  EXPECT_EQ(r["before_main"], kSuccess);
  EXPECT_EQ(r["alloc"], kSuccess);
  EXPECT_EQ(r.num("free"), 1 * kGiB - kContextBytes - 300 * kMiB);  // the constructor's 100 MiB counted
  EXPECT_EQ(r["at_exit_failures"], "0");
  EXPECT_EQ(used(g), 0u);
}

// A library constructor (run with glibc's loader lock held) that calls the
// driver while another thread's first call is loading libcuda (a dlopen,
// waiting for that lock): neither may wait for the other.
TEST_F(InterposeTest, AConstructorCallingTheDriverDuringItsFirstLoadDoesNotDeadlock) {
  grant(kUuid0, 1 * kGiB);
  for (bool preload : {true, false}) {
    ProbeResult r = probe({"load-race", CTOR_CALLS_DRIVER}, {}, preload);
    ASSERT_TRUE(WIFEXITED(r.status)) << (preload ? "with" : "without") << " the interposer: signal "
                                     << (WIFSIGNALED(r.status) ? WTERMSIG(r.status) : 0) << "\n" << r.err;
    EXPECT_EQ(r["load_race_main"], kSuccess) << r.err;
    EXPECT_EQ(r["load_race_ctor"], kSuccess) << r.err;
  }
}

// With the daemon SIGKILLed, running tenants go on and their quotas hold;
// a restarted daemon re-adopts the ledgers and reclaims the dead.
TEST_F(InterposeTest, QuotasHoldWithTheDaemonDownAndARestartedDaemonReclaims) {
  write_daemon_config();
  pid_t daemon = start_daemon();
  TenantLedger view;
  ASSERT_TRUE(wait_until_granted(&view));

  Held holder = probe_and_hold({"init", "primary", "0", "alloc", "600MiB"});
  EXPECT_EQ(holder.seen["alloc"], kSuccess);
  kill(daemon, SIGKILL);
  waitpid(daemon, nullptr, 0);
  ProbeResult r = probe({"init", "primary", "0", "alloc", "600MiB", "alloc", "200MiB"});
  EXPECT_EQ(r["alloc"], kSuccess);  // the last; the 600 MiB before it was refused
  EXPECT_EQ(tenant_used(*view.usage, 0), kContextBytes + 600 * kMiB + kContextBytes + 200 * kMiB);

  daemon = start_daemon();
  kill_held(holder);
  // Within a second: reclaim interval + grace + one more interval.
  EXPECT_TRUE(wait_for([&] { return tenant_used(*view.usage, 0) == 0; }, 1000))
      << tenant_used(*view.usage, 0) << " bytes still charged";
  r = probe({"init", "primary", "0", "alloc", "900MiB"});
  EXPECT_EQ(r["alloc"], kSuccess);
  kill(daemon, SIGTERM);
  int status = 0;
  waitpid(daemon, &status, 0);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << status;
  close_ledger(&view);
}

TEST_F(InterposeTest, TwoProcessesOfOneTenantShareTheQuota) {
  const int g = grant(kUuid0, 1 * kGiB);
  Held first = probe_and_hold({"init", "primary", "0", "alloc", "500MiB"});
  ProbeResult second = probe({"init", "primary", "0", "alloc", "300MiB", "alloc", "100MiB", "info"});
  EXPECT_EQ(second["alloc"], kOutOfMemory);  // 2 x 64 + 500 + 300 + 100 > 1024
  EXPECT_EQ(second.num("free"), 1 * kGiB - 2 * kContextBytes - 800 * kMiB);
  uint64_t bytes = 0;
  EXPECT_EQ(reclaim_settled(daemon_, -1, &bytes), 1);  // the second has exited
  EXPECT_EQ(bytes, kContextBytes + 300 * kMiB);
  EXPECT_EQ(used(g), kContextBytes + 500 * kMiB);
  kill_held(first);
}

// A container with two claims (docs/kubernetes.md): each claim's tenant
// directory at its own path under the claims directory (here links to the
// tenants' directories; in a container, bind mounts), no FRACGPU_TENANT_DIR.
// Returns bob's ledger (the daemon's side), bob granting `bob_uuid`.
TenantLedger two_claims(const std::string& root, const char* bob_uuid, uint64_t bob_quota);

// One process, two tenants: alice grants GPU 0 (1 GiB), bob GPU 1 (2 GiB).
// Each device's context and allocations are charged to the tenant granting
// it, in that tenant's ledger and slot, and stopped by that tenant's quota.
// (Before: only FRACGPU_TENANT_DIR or /run/fracgpu/tenant were looked at,
// so neither tenant was found, and with FRACGPU_UNMANAGED=deny nothing ran.)
TEST_F(InterposeTest, TwoClaimsInOneProcessChargeEachGpuToTheTenantGrantingIt) {
  const int a = grant(kUuid0, 1 * kGiB);
  TenantLedger bob = two_claims(root_, kUuid1, 2 * kGiB);
  const std::vector<std::string> env = {"FRACGPU_TENANT_DIR=", "FRACGPU_CLAIMS_DIR=" + root_ + "/claims",
                                        "FRACGPU_UNMANAGED=deny"};
  Held h = probe_and_hold({"init", "primary", "0", "alloc", "900MiB", "alloc", "100MiB", "primary", "1", "alloc",
                           "1536MiB", "alloc", "512MiB", "info", "total", "0"},
                          env);
  // GPU 0: 64 MiB context + 900 MiB fit alice's 1 GiB, 100 MiB more do not;
  // GPU 1: 64 MiB + 1.5 GiB fit bob's 2 GiB, 512 MiB more do not.
  EXPECT_NE(h.seen.out.find("init=0\nprimary=0\nalloc=0\nalloc=2\nprimary=0\nalloc=0\nalloc=2\n"), std::string::npos)
      << h.seen.out;
  EXPECT_EQ(h.seen.num("total"), 2 * kGiB);  // the current device, 1: bob's quota
  EXPECT_EQ(h.seen.num("free"), 2 * kGiB - kContextBytes - 1536 * kMiB);
  EXPECT_EQ(h.seen.num("device_total"), 1 * kGiB);  // device 0: alice's
  EXPECT_EQ(used(a), kContextBytes + 900 * kMiB);
  EXPECT_EQ(tenant_used(*bob.usage, 0), kContextBytes + 1536 * kMiB);
  EXPECT_EQ(sim_used(0), kContextBytes + 900 * kMiB);
  EXPECT_EQ(sim_used(1), kContextBytes + 1536 * kMiB);
  kill_held(h);
  // A slot in each ledger, both given back once reclaimed.
  uint64_t bytes = 0;
  EXPECT_EQ(reclaim_settled(daemon_, -1, &bytes), 1);
  EXPECT_EQ(bytes, kContextBytes + 900 * kMiB);
  EXPECT_EQ(reclaim_settled(bob, -1, &bytes), 1);
  EXPECT_EQ(bytes, kContextBytes + 1536 * kMiB);
  close_ledger(&bob);
}

// Fork with two tenants: the child attaches to both again, with slots of its
// own (record locks are not inherited), and its charges on each GPU go to
// that GPU's tenant beside the parent's.
TEST_F(InterposeTest, TwoClaimsAForkedChildChargesEachGpuToItsTenantInSlotsOfItsOwn) {
  const int a = grant(kUuid0, 1 * kGiB);
  TenantLedger bob = two_claims(root_, kUuid1, 2 * kGiB);
  ProbeResult r = probe({"init", "primary", "0", "alloc", "600MiB", "fork", "init", "primary", "0", "alloc", "200MiB",
                         "alloc", "200MiB", "primary", "1", "alloc", "1GiB"},
                        {"FRACGPU_TENANT_DIR=", "FRACGPU_CLAIMS_DIR=" + root_ + "/claims"});
  EXPECT_EQ(r["fork_child_exit"], "0");
  // The child's second 200 MiB did not fit beside the parent's 600 MiB and both contexts.
  EXPECT_NE(r.out.find("alloc=0\nalloc=2\nprimary=0\nalloc=0\n"), std::string::npos) << r.out;
  uint64_t bytes = 0;
  EXPECT_EQ(reclaim_settled(daemon_, -1, &bytes), 2);  // the parent's slot and the child's
  EXPECT_EQ(bytes, 2 * kContextBytes + 800 * kMiB);
  EXPECT_EQ(used(a), 0u);
  EXPECT_EQ(reclaim_settled(bob, -1, &bytes), 2);
  EXPECT_EQ(bytes, kContextBytes + 1 * kGiB);
  close_ledger(&bob);
}

// Two tenants of one process granting the same GPU: whose quota and time it
// would use cannot be told, so the GPU is refused (CUDA_ERROR_NOT_PERMITTED,
// one log line); the process's other GPUs are not affected.
TEST_F(InterposeTest, TwoClaimsGrantingOneGpuAreRefusedThatGpu) {
  grant(kUuid0, 1 * kGiB);
  grant(kUuid1, 1 * kGiB);
  TenantLedger bob = two_claims(root_, kUuid0, 2 * kGiB);
  ProbeResult r = probe({"init", "primary", "0", "primary", "0", "primary", "1", "alloc", "100MiB"},
                        {"FRACGPU_TENANT_DIR=", "FRACGPU_CLAIMS_DIR=" + root_ + "/claims"});
  EXPECT_NE(r.out.find("init=0\nprimary=800\nprimary=800\nprimary=0\nalloc=0\n"), std::string::npos) << r.out;
  const size_t said = r.err.find("device 0 is granted to two tenants of this process");
  EXPECT_NE(said, std::string::npos) << r.err;
  EXPECT_EQ(r.err.find("device 0 is granted to two tenants", said + 1), std::string::npos)
      << "logged more than once: " << r.err;
  EXPECT_NE(r.err.find("\"alice\""), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("\"bob\""), std::string::npos) << r.err;
  close_ledger(&bob);
}

// At most 8 tenant directories per process: with 9 claims, the first 8 by
// name are attached, the process says so once, and the GPU only the ninth
// grants is not given (never let through). The first 8 grant nothing here,
// so the process has no GPU.
TEST_F(InterposeTest, NineClaimsAttachTheFirstEightAndRefuseTheNinthsGpu) {
  fs::create_directories(root_ + "/claims");
  for (int t = 0; t < 9; ++t) {
    const std::string name = "claim-" + std::to_string(t);
    const std::string dir = root_ + "/tenants/" + name;
    fs::create_directories(dir);
    TenantLedger l;
    char err[256] = {};
    ASSERT_EQ(open_ledger(dir.c_str(), AccessMode::kDaemon, name.c_str(), &l, err, sizeof err), LedgerError::kOk) << err;
    if (t == 8) {
      uint8_t bytes[16];
      uuid_bytes(kUuid0, bytes);
      fracgpu::testing::grant_gpu(l, bytes, 1 * kGiB, kContextBytes, kCountManagedMemory);
    }
    close_ledger(&l);
    fs::create_directory_symlink(dir, root_ + "/claims/" + name);
  }
  ProbeResult r = probe({"init", "primary", "0"}, {"FRACGPU_TENANT_DIR=", "FRACGPU_CLAIMS_DIR=" + root_ + "/claims"});
  EXPECT_EQ(r["init"], kNoDevice);
  EXPECT_NE(r["primary"], kSuccess);
  EXPECT_NE(r.err.find("holds 9 claims' tenant directories: attached to the first 8 by name only"), std::string::npos)
      << r.err;
  EXPECT_NE(r.err.find("no GPU is granted to this process's 8 tenants"), std::string::npos) << r.err;
}

TenantLedger two_claims(const std::string& root, const char* bob_uuid, uint64_t bob_quota) {
  TenantLedger bob;
  char err[256] = {};
  const std::string dir = root + "/tenants/bob";
  fs::create_directories(dir);
  EXPECT_EQ(open_ledger(dir.c_str(), AccessMode::kDaemon, "bob", &bob, err, sizeof err), LedgerError::kOk) << err;
  uint8_t bytes[16];
  uuid_bytes(bob_uuid, bytes);
  fracgpu::testing::grant_gpu(bob, bytes, bob_quota, kContextBytes, kCountManagedMemory);
  fs::create_directories(root + "/claims");
  fs::create_directory_symlink(root + "/tenants/alice", root + "/claims/3f0c-claim-a");
  fs::create_directory_symlink(dir, root + "/claims/9e1d-claim-b");
  return bob;
}

// The hooks' common paths make no system calls: under strace, the calls a
// process makes beyond what it makes without the interposer must not grow
// with the number of allocations (only attaching costs any).
TEST_F(InterposeTest, CommonPathsMakeNoSystemCalls) {
  grant(kUuid0, 1 * kGiB);
  auto syscalls = [&](bool preload, int n) -> long {
    const std::string trace = root_ + "/strace." + std::to_string(preload) + "." + std::to_string(n);
    int out_fd, err_fd;
    std::vector<std::string> env = environment(preload, {});
    // Run strace itself through the probe's environment.
    pid_t pid = fork();
    if (pid == 0) {
      std::vector<std::string> args = {"/usr/bin/strace", "-f", "-c", "-o", trace, PROBE_PATH, "init", "primary",
                                       "0", "loop", std::to_string(n), "1MiB"};
      std::vector<char*> argv, envp;
      for (auto& a : args) argv.push_back(a.data());
      argv.push_back(nullptr);
      for (auto& e : env) envp.push_back(e.data());
      envp.push_back(nullptr);
      int devnull = open("/dev/null", O_WRONLY);
      dup2(devnull, 1);
      execve(args[0].c_str(), argv.data(), envp.data());
      _exit(127);
    }
    (void)out_fd;
    (void)err_fd;
    int status = 0;
    waitpid(pid, &status, 0);
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "strace missing? status " << status;
    // strace -c ends with a line "100.00 ... <calls> <errors> total".
    FILE* f = fopen(trace.c_str(), "r");
    if (f == nullptr) return -1;
    char line[512];
    long total = -1;
    while (fgets(line, sizeof line, f)) {
      if (strstr(line, " total") == nullptr) continue;
      double pct, secs;
      long usecs, calls;
      if (sscanf(line, "%lf %lf %ld %ld", &pct, &secs, &usecs, &calls) == 4) total = calls;
    }
    fclose(f);
    return total;
  };
  const long plain_small = syscalls(false, 200), plain_large = syscalls(false, 2000);
  const long hooked_small = syscalls(true, 200), hooked_large = syscalls(true, 2000);
  ASSERT_GT(plain_small, 0);
  ASSERT_GT(hooked_small, 0);
  const long extra_small = hooked_small - plain_small, extra_large = hooked_large - plain_large;
  // 1800 more allocate/free/info rounds: 5400 hooked calls, not one more system call each.
  EXPECT_LT(extra_large - extra_small, 50) << "plain " << plain_small << "/" << plain_large << ", hooked "
                                           << hooked_small << "/" << hooked_large;
}

}  // namespace
