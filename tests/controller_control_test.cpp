// fracgpud's control API end to end: the real daemon on the simulated driver
// (and stand-in NVML), spoken to over its socket with the client library and
// raw bytes, by root and by unprivileged peers; tenant processes through the
// interposer; and `fracgpu tenant`.
#include <fcntl.h>
#include <grp.h>
#include <poll.h>
#include <pwd.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <iostream>
#include <new>
#include <optional>
#include <sstream>
#include <filesystem>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "common/uuid.h"
#include "control/client.h"
#include "control/protocol.h"
#include "controller_test_util.h"
#include "ledger.h"

using namespace fracgpu;
using namespace fracgpu::testing;
using namespace std::chrono_literals;
namespace fs = std::filesystem;
using nlohmann::json;

namespace {

constexpr uint64_t kGiB = 1ull << 30;
constexpr uint64_t kMiB = 1ull << 20;
const std::string kUuid0 = "GPU-c0a7801a-0000-4000-8000-000000000001";
const std::string kUuid1 = "GPU-c0a7801a-0000-4000-8000-000000000002";
// Two simulated 16 GiB GPUs of different compute capabilities.
const std::string kDevices = "uuid=" + kUuid0 + ",name=Sim A,mem=16GiB,ctx=64MiB,cc=8.6;uuid=" + kUuid1 +
                             ",name=Sim B,mem=16GiB,ctx=64MiB,cc=9.0";
const std::string kAlice = "[[tenant]]\nname = \"alice\"\ngpus = 0.5\ndevices = [0]\n";

// Root's view while a load runs: every `period`, a `node` request (and every
// tenth time a create and a delete), timed from the call to the reply; and
// the heartbeat's age, sampled every 10 ms.
struct RootView {
  std::vector<double> latencies_ms;  // of every request
  int failures = 0;
  std::string first_failure;
  uint64_t stalest_heartbeat_ns = 0;

  double p99_ms() const {
    if (latencies_ms.empty()) return 0;
    std::vector<double> sorted = latencies_ms;
    std::sort(sorted.begin(), sorted.end());
    return sorted[std::min(sorted.size() - 1, static_cast<size_t>(std::ceil(0.99 * sorted.size())) - 1)];
  }
  double max_ms() const { return latencies_ms.empty() ? 0 : *std::max_element(latencies_ms.begin(), latencies_ms.end()); }
};

class ControlTest : public ::testing::Test {
 protected:
  void SetUp() override {
    // Unprivileged peers must reach the run dir (mkdtemp makes it 0700).
    chmod(tmp_.path().c_str(), 0755);
    write_file(faults_path_, "");
    write_config();
  }

  void TearDown() override {
    for (pid_t pid : children_) kill_and_reap(pid);
    kill_and_reap(daemon_);
  }

  void write_config(const std::string& daemon_extra = "", const std::string& tenants = kAlice) {
    write_file(config_path_, "[daemon]\nrun_dir = \"" + run_dir_ +
                                 "\"\nreap_interval_ms = 50\nlog_level = \"debug\"\nmetrics_address = \"off\"\n"
                                 "health_interval = \"50ms\"\n" +
                                 daemon_extra +
                                 "[[gpu]]\nindex = 0\ncontext_memory = \"64MiB\"\n[[gpu]]\nindex = 1\n"
                                 "context_memory = \"64MiB\"\n" +
                                 tenants);
  }

  // The daemon keeps a private simulated state; tenant processes share one.
  pid_t spawn(const std::vector<std::string>& args, const std::string& log, const std::vector<std::string>& env = {}) {
    std::vector<std::string> all = {std::string("LD_LIBRARY_PATH=") + SIMNVML_DIR + ":" + SIMCUDA_DIR,
                                    "SIMCUDA_DEVICES=" + kDevices, "SIMCUDA_STATE", "SIMNVML_FAULTS=" + faults_path_};
    all.insert(all.end(), env.begin(), env.end());
    return spawn_logged(args, log, all);
  }

  void start_daemon() {
    const size_t before = read_file(log_path_).size();
    daemon_ = spawn({FRACGPUD_PATH, "--config", config_path_}, log_path_);
    ASSERT_TRUE(eventually(
        [&] { return read_file(log_path_).find("control API: listening on", before) != std::string::npos; }, 10s))
        << read_file(log_path_);
  }

  void stop_daemon(int signal = SIGTERM) {
    kill(daemon_, signal);
    const int rc = wait_exit(daemon_, 10s);
    if (signal == SIGTERM) {
      EXPECT_EQ(rc, 0) << read_file(log_path_);
    }
    daemon_ = -1;
  }

  std::string socket_path() const { return run_dir_ + "/" + control::kSocketName; }

  control::Reply call(const json& request, std::chrono::milliseconds timeout = 10s) const {
    return control::call(socket_path(), request, timeout);
  }

  static json gpu(const std::string& uuid, double share, uint64_t memory = 0) {
    json g = {{"uuid", uuid}, {"share", share}};
    if (memory != 0) g["memory"] = memory;
    return g;
  }
  control::Reply create(const std::string& name, json gpus, const char* op = "create") const {
    return call({{"op", op}, {"tenant", {{"name", name}, {"gpus", std::move(gpus)}}}});
  }

  std::string tenant_dir(const std::string& name) const { return run_dir_ + "/tenants/" + name; }

  // Entry of `uuid` in a tenant's table in force, read as the interposer does.
  ledger::GpuEntry policy_of(const std::string& tenant, const std::string& uuid) const {
    ledger::TenantLedger l;
    char err[256];
    ledger::GpuEntry e;
    if (ledger::open_ledger(tenant_dir(tenant).c_str(), ledger::AccessMode::kReadOnly, nullptr, &l, err, sizeof err) !=
        ledger::LedgerError::kOk)
      return e;
    const int entry = ledger::find_gpu(l, controller::parse_gpu_uuid(uuid)->data());
    if (entry >= 0) e = ledger::read_gpu_entry(l, static_cast<uint32_t>(entry));
    ledger::close_ledger(&l);
    return e;
  }

  uint64_t heartbeat_ns(const std::string& tenant) const {
    ledger::TenantLedger l;
    char err[256];
    if (ledger::open_ledger(tenant_dir(tenant).c_str(), ledger::AccessMode::kReadOnly, nullptr, &l, err, sizeof err) !=
        ledger::LedgerError::kOk)
      return 0;
    const uint64_t ns = l.policy->daemon_heartbeat_ns.load();
    ledger::close_ledger(&l);
    return ns;
  }

  // What a tenant's processes have charged on its GPU entry `entry`, by its
  // usage file (a dead process's charge is gone once the daemon reclaimed it).
  uint64_t charged(const std::string& tenant, uint32_t entry) const {
    ledger::TenantLedger l;
    char err[256];
    if (ledger::open_ledger(tenant_dir(tenant).c_str(), ledger::AccessMode::kReadOnly, nullptr, &l, err, sizeof err) !=
        ledger::LedgerError::kOk)
      return UINT64_MAX;
    const uint64_t bytes = ledger::tenant_used(*l.usage, entry);
    ledger::close_ledger(&l);
    return bytes;
  }

  // Root's requests (see RootView) and the heartbeat's age for `how_long`.
  RootView watch_as_root(std::chrono::milliseconds how_long) const {
    using Clock = std::chrono::steady_clock;
    RootView view;
    std::atomic<bool> done{false};
    std::thread sampler([&] {
      while (!done) {
        const uint64_t beat = heartbeat_ns("alice"), now = ledger::monotonic_ns();
        if (beat != 0 && now > beat) view.stalest_heartbeat_ns = std::max(view.stalest_heartbeat_ns, now - beat);
        std::this_thread::sleep_for(10ms);
      }
    });
    const auto timed = [&](const json& request) {
      const auto asked = Clock::now();
      const control::Reply r = call(request, 5s);
      view.latencies_ms.push_back(std::chrono::duration<double, std::milli>(Clock::now() - asked).count());
      if (!r.ok && view.failures++ == 0) view.first_failure = request.dump() + ": " + r.code + ": " + r.error;
    };
    const auto end = Clock::now() + how_long;
    for (int i = 0; Clock::now() < end; ++i) {
      timed({{"op", "node"}});
      if (i % 10 == 9) {
        const std::string name = "root-" + std::to_string(i);
        timed({{"op", "create"}, {"tenant", {{"name", name}, {"gpus", {gpu(kUuid1, 0.01)}}}}});
        timed({{"op", "delete"}, {"name", name}});
      }
      std::this_thread::sleep_for(50ms);
    }
    done = true;
    sampler.join();
    return view;
  }

  static void report(const std::string& load, const RootView& view) {
    std::cout << load << ": root's requests p99 " << view.p99_ms() << " ms, at most " << view.max_ms() << " ms ("
              << view.latencies_ms.size() << " requests, " << view.failures << " failed); heartbeat at most "
              << view.stalest_heartbeat_ns / 1'000'000 << " ms old\n";
  }

  bool log_contains(const std::string& text) const { return read_file(log_path_).find(text) != std::string::npos; }

  // A probe (tests/probe) in tenant `name` under the interposer, sharing the
  // tenant processes' simulated state; its output goes to `log`.
  pid_t spawn_probe(const std::string& name, const std::vector<std::string>& commands, const std::string& log) {
    std::vector<std::string> args{PROBE_PATH};
    args.insert(args.end(), commands.begin(), commands.end());
    const pid_t pid = spawn(args, log,
                            {"FRACGPU_TENANT_DIR=" + tenant_dir(name), std::string("LD_PRELOAD=") + FRACGPU_LIB,
                             "SIMCUDA_STATE=" + (tmp_ / "sim-state")});
    children_.push_back(pid);
    return pid;
  }

  // `fracgpu ARGS --run-dir <run dir>`: its exit code, its output in *out.
  int cli(std::vector<std::string> args, std::string* out) {
    const std::string log = tmp_ / "cli.out";
    fs::remove(log);
    std::vector<std::string> argv{FRACGPU_CLI_PATH};
    argv.insert(argv.end(), args.begin(), args.end());
    argv.insert(argv.end(), {"--run-dir", run_dir_});
    const int rc = wait_exit(spawn(argv, log), 20s);
    *out = read_file(log);
    return rc;
  }

  TempDir tmp_;
  std::string run_dir_ = tmp_ / "run";
  std::string config_path_ = tmp_ / "fracgpud.toml";
  std::string log_path_ = tmp_ / "fracgpud.log";
  std::string faults_path_ = tmp_ / "nvml-faults";
  std::vector<pid_t> children_;
  pid_t daemon_ = -1;
};

// A failure at `field` whose message starts with it.
void expect_failure(const control::Reply& r, const std::string& code, const std::string& field,
                    const std::string& part) {
  EXPECT_FALSE(r.ok) << r.body.dump();
  EXPECT_EQ(r.code, code) << r.body.dump();
  EXPECT_EQ(r.field, field) << r.body.dump();
  if (!field.empty()) {
    EXPECT_EQ(r.error.rfind(field + ": ", 0), 0u) << r.error;
  }
  EXPECT_NE(r.error.find(part), std::string::npos) << "expected \"" << part << "\" in: " << r.error;
}

TEST_F(ControlTest, CreateGetListResizeDeleteAndTheLedger) {
  start_daemon();
  json g = gpu(kUuid1, 0.25, 2 * kGiB);
  g["limit"] = 0.5;
  json request = {{"op", "create"},
                  {"tenant", {{"name", "dra-1"}, {"gpus", {g}}, {"annotations", {{"pod", "default/train"}}}}}};
  control::Reply r = call(request);
  ASSERT_TRUE(r.ok) << r.body.dump();
  EXPECT_EQ(r.body["created"], true);
  const json& t = r.body["tenant"];
  EXPECT_EQ(t["name"], "dra-1");
  EXPECT_EQ(t["source"], "api");
  EXPECT_EQ(t["state"], "active");
  EXPECT_EQ(t["processes"], 0);
  EXPECT_EQ(t["annotations"]["pod"], "default/train");
  EXPECT_EQ(t["priority"], "normal");  // not asked for: the default
  ASSERT_EQ(t["gpus"].size(), 1u);
  EXPECT_EQ(t["gpus"][0]["uuid"], kUuid1);
  EXPECT_EQ(t["gpus"][0]["index"], 1);
  EXPECT_EQ(t["gpus"][0]["share"], 0.25);
  EXPECT_EQ(t["gpus"][0]["limit"], 0.5);
  EXPECT_EQ(t["gpus"][0]["memory"], 2 * kGiB);

  // The ledger holds exactly that, as a config tenant's would.
  ledger::GpuEntry e = policy_of("dra-1", kUuid1);
  EXPECT_EQ(e.state, ledger::kGpuGranted);
  EXPECT_EQ(e.share_ppm, 250'000u);
  EXPECT_EQ(e.limit_ppm, 500'000u);
  EXPECT_EQ(e.memory_quota, 2 * kGiB);
  EXPECT_EQ(e.context_memory, 64 * kMiB);
  EXPECT_EQ(e.flags, uint32_t{ledger::kCountManagedMemory});
  // Placement and GPU time see it too.
  EXPECT_NE(read_file(run_dir_ + "/placement.json").find("\"dra-1\""), std::string::npos);
  EXPECT_TRUE(fs::exists(tenant_dir("dra-1") + "/gputime-0"));

  // The same spec again: nothing changes. Another spec: refused, saying what differs.
  r = call(request);
  ASSERT_TRUE(r.ok) << r.body.dump();
  EXPECT_EQ(r.body["created"], false);
  expect_failure(create("dra-1", {gpu(kUuid1, 0.3)}), "exists", "name",
                 kUuid1 + ": share 0.3 asked (0.25 held), limit 0.3 asked (0.5 held)");

  r = call({{"op", "list"}});
  ASSERT_TRUE(r.ok) << r.body.dump();
  ASSERT_EQ(r.body["tenants"].size(), 2u);
  EXPECT_EQ(r.body["tenants"][0]["name"], "alice");
  EXPECT_EQ(r.body["tenants"][0]["source"], "config");
  EXPECT_EQ(r.body["tenants"][1]["name"], "dra-1");

  r = create("dra-1", {gpu(kUuid1, 0.5), gpu(kUuid0, 0.25)}, "resize");
  ASSERT_TRUE(r.ok) << r.body.dump();
  EXPECT_EQ(r.body["tenant"]["gpus"].size(), 2u);
  EXPECT_EQ(policy_of("dra-1", kUuid1).share_ppm, 500'000u);
  EXPECT_EQ(policy_of("dra-1", kUuid1).memory_quota, 8 * kGiB);  // default: share x 16 GiB
  EXPECT_EQ(policy_of("dra-1", kUuid0).state, ledger::kGpuGranted);
  r = call({{"op", "get"}, {"name", "dra-1"}});
  ASSERT_TRUE(r.ok);
  EXPECT_TRUE(r.body["tenant"]["annotations"].empty());  // a resize replaces the spec
  // A priority alone is a change a resize applies.
  r = call({{"op", "resize"},
            {"tenant", {{"name", "dra-1"}, {"gpus", {gpu(kUuid1, 0.5), gpu(kUuid0, 0.25)}}, {"priority", "batch"}}}});
  ASSERT_TRUE(r.ok) << r.body.dump();
  EXPECT_EQ(r.body["tenant"]["priority"], "batch");
  EXPECT_NE(read_file(run_dir_ + "/api-tenants.json").find("\"priority\": \"batch\""), std::string::npos);

  expect_failure(call({{"op", "get"}, {"name", "nobody"}}), "not_found", "name", "no tenant \"nobody\"");
  expect_failure(create("nobody", {gpu(kUuid1, 0.1)}, "resize"), "not_found", "name", "no tenant \"nobody\" to resize");
  // Config tenants are the config's.
  expect_failure(create("alice", {gpu(kUuid1, 0.1)}), "conflict", "name", "is a tenant of the config file");
  expect_failure(call({{"op", "delete"}, {"name", "alice"}}), "conflict", "name", "is a tenant of the config file");

  r = call({{"op", "delete"}, {"name", "dra-1"}});
  ASSERT_TRUE(r.ok) << r.body.dump();
  EXPECT_EQ(r.body["state"], "deleted");
  EXPECT_FALSE(fs::exists(tenant_dir("dra-1")));
  r = call({{"op", "delete"}, {"name", "dra-1"}});
  ASSERT_TRUE(r.ok);
  EXPECT_EQ(r.body["state"], "absent");
  EXPECT_EQ(read_file(run_dir_ + "/api-tenants.json").find("dra-1"), std::string::npos);
}

TEST_F(ControlTest, RequestsAreValidatedFieldByField) {
  start_daemon();
  expect_failure(create("a", {gpu(kUuid1, 1.5)}), "invalid", "gpus[0].share", "1.5 must be above 0 and at most 1.0");
  expect_failure(create("a", {gpu("GPU-c0a7801a-0000-4000-8000-0000000000ff", 0.5)}), "invalid", "gpus[0].uuid",
                 "is not a GPU this fracgpud manages (managed: " + kUuid0 + ", " + kUuid1 + ")");
  expect_failure(create("A", {gpu(kUuid1, 0.5)}), "invalid", "name", "is invalid");
  expect_failure(create("a", {gpu(kUuid1, 0.5, 17 * kGiB)}), "invalid", "gpus[0].memory",
                 "memory quota 17 GiB on GPU 1 is above the GPU's memory (16 GiB)");
  expect_failure(call({{"op", "frobnicate"}}), "invalid", "op", "\"frobnicate\" is not an operation");
  expect_failure(call({{"name", "a"}}), "invalid", "op", "missing");
  expect_failure(call({{"op", "create"}}), "invalid", "tenant", "missing");
  expect_failure(call({{"op", "get"}, {"name", "../../etc"}}), "invalid", "name", "is invalid");
  expect_failure(call({{"op", "create"}, {"tenant", {{"name", "a"}, {"gpus", {gpu(kUuid1, 0.5)}}, {"priority", "high"}}}}),
                 "invalid", "priority", "\"high\" is not a priority (use latency, normal, batch)");
  // Nothing was made by any of them.
  EXPECT_FALSE(fs::exists(tenant_dir("a")));
  EXPECT_FALSE(fs::exists(run_dir_ + "/api-tenants.json"));
}

TEST_F(ControlTest, OneBookForConfigAndApiTenantsAndTheNodeView) {
  start_daemon();
  control::Reply r = call({{"op", "node"}});
  ASSERT_TRUE(r.ok) << r.body.dump();
  json node = r.body["node"];
  EXPECT_EQ(node["driver_version"], "simnvml");  // nvmlSystemGetDriverVersion
  EXPECT_EQ(node["cuda_driver_version"], 13000);  // cuDriverGetVersion
  EXPECT_EQ(node["allow_overcommit"], false);
  ASSERT_EQ(node["gpus"].size(), 2u);
  EXPECT_EQ(node["gpus"][0]["uuid"], kUuid0);
  EXPECT_EQ(node["gpus"][0]["name"], "Sim A");
  EXPECT_EQ(node["gpus"][0]["compute_capability"], "8.6");
  EXPECT_EQ(node["gpus"][1]["compute_capability"], "9.0");
  EXPECT_EQ(node["gpus"][0]["memory"], 16 * kGiB);
  EXPECT_EQ(node["gpus"][0]["config_share"], 0.5);
  EXPECT_EQ(node["gpus"][0]["config_memory"], 8 * kGiB);
  EXPECT_EQ(node["gpus"][0]["free_share"], 0.5);
  EXPECT_EQ(node["gpus"][0]["free_memory"], 8 * kGiB);
  EXPECT_EQ(node["gpus"][0]["fenced"], false);
  const uint64_t generation = node["generation"];

  // More than alice left of GPU 0.
  const control::Reply full = create("greedy", {gpu(kUuid0, 0.75)});
  expect_failure(full, "no_capacity", "", kUuid0 + ": share 0.75 asked, 0.5 free (config tenants 0.5, API tenants 0)");
  ASSERT_TRUE(create("half", {gpu(kUuid0, 0.5)}).ok);
  expect_failure(create("more", {gpu(kUuid0, 0.000001, 1 * kGiB)}), "no_capacity", "",
                 "share 0.000001 asked, 0 free (config tenants 0.5, API tenants 0.5)");
  // Memory: a small share with a quota past what is left.
  ASSERT_TRUE(create("mem", {gpu(kUuid1, 0.1, 12 * kGiB)}).ok);
  expect_failure(create("mem2", {gpu(kUuid1, 0.1, 5 * kGiB)}), "no_capacity", "",
                 kUuid1 + ": memory 5 GiB asked, 4 GiB free of its 16 GiB (config tenants 0 B, API tenants 12 GiB)");

  r = call({{"op", "node"}});
  node = r.body["node"];
  EXPECT_EQ(node["gpus"][0]["api_share"], 0.5);
  EXPECT_EQ(node["gpus"][0]["free_share"], 0.0);
  EXPECT_EQ(node["gpus"][1]["api_memory"], 12 * kGiB);
  EXPECT_GT(node["generation"].get<uint64_t>(), generation);
  const uint64_t after = node["generation"];
  EXPECT_EQ(call({{"op", "node"}}).body["node"]["generation"], after);  // nothing changed since
}

TEST_F(ControlTest, AFencedGpuTakesNoNewTenant) {
  start_daemon();
  write_file(faults_path_, "1 lost\n");
  ASSERT_TRUE(eventually([&] { return call({{"op", "node"}}).body["node"]["gpus"][1]["fenced"] == true; }, 10s))
      << read_file(log_path_);
  const json node = call({{"op", "node"}}).body["node"];
  EXPECT_FALSE(node["gpus"][1]["fence_reason"].get<std::string>().empty());
  expect_failure(create("late", {gpu(kUuid0, 0.1), gpu(kUuid1, 0.1)}), "unavailable", "gpus[1].uuid",
                 kUuid1 + " is fenced by the health probe");
  EXPECT_TRUE(create("ok", {gpu(kUuid0, 0.1)}).ok);
}

// Eight clients at once for a GPU with room for one: the daemon serves
// requests one at a time, so exactly one wins.
TEST_F(ControlTest, ConcurrentCreatesForTheLastCapacityOneWins) {
  start_daemon();
  constexpr int kClients = 8;
  std::vector<control::Reply> replies(kClients);
  std::atomic<bool> go{false};
  std::vector<std::thread> threads;
  for (int i = 0; i < kClients; ++i)
    threads.emplace_back([&, i] {
      while (!go.load()) std::this_thread::yield();
      replies[i] = create("race-" + std::to_string(i), {gpu(kUuid1, 0.6)});
    });
  go.store(true);
  for (std::thread& t : threads) t.join();
  int won = 0;
  for (const control::Reply& r : replies) {
    if (r.ok) {
      ++won;
      continue;
    }
    EXPECT_EQ(r.code, "no_capacity") << r.body.dump();
    EXPECT_NE(r.error.find("share 0.6 asked, 0.4 free (config tenants 0, API tenants 0.6)"), std::string::npos)
        << r.error;
  }
  EXPECT_EQ(won, 1);
  EXPECT_EQ(call({{"op", "node"}}).body["node"]["gpus"][1]["api_share"], 0.6);
  EXPECT_EQ(call({{"op", "list"}}).body["tenants"].size(), 2u);  // alice and the winner
}

TEST_F(ControlTest, ApiTenantsSurviveRestartsAndKills) {
  start_daemon();
  ASSERT_TRUE(call({{"op", "create"},
                    {"tenant", {{"name", "keep"}, {"gpus", {gpu(kUuid1, 0.25, 3 * kGiB)}}, {"priority", "latency"}}}})
                  .ok);
  // A SIGKILL right after the reply: the tenant was on disk before it.
  stop_daemon(SIGKILL);
  start_daemon();
  control::Reply r = call({{"op", "get"}, {"name", "keep"}});
  ASSERT_TRUE(r.ok) << r.body.dump() << read_file(log_path_);
  EXPECT_EQ(r.body["tenant"]["gpus"][0]["memory"], 3 * kGiB);
  EXPECT_EQ(r.body["tenant"]["priority"], "latency");
  EXPECT_TRUE(log_contains("1 tenant(s) of the control API re-created"));
  EXPECT_EQ(policy_of("keep", kUuid1).memory_quota, 3 * kGiB);
  // Its capacity is booked from the start: nothing else gets it.
  expect_failure(create("other", {gpu(kUuid1, 0.8)}), "no_capacity", "", "API tenants 0.25");
  stop_daemon();
  EXPECT_FALSE(fs::exists(socket_path()));  // a clean stop removes the socket
  start_daemon();
  EXPECT_TRUE(call({{"op", "get"}, {"name", "keep"}}).ok);
}

TEST_F(ControlTest, ReloadLeavesApiTenantsAndIsRefusedWhenItCollides) {
  start_daemon();
  ASSERT_TRUE(create("api1", {gpu(kUuid0, 0.5)}).ok);
  kill(daemon_, SIGHUP);
  ASSERT_TRUE(eventually([&] { return log_contains("reload applied"); })) << read_file(log_path_);
  EXPECT_TRUE(call({{"op", "get"}, {"name", "api1"}}).ok);
  EXPECT_EQ(policy_of("api1", kUuid0).share_ppm, 500'000u);

  // alice wants 0.75 of GPU 0, which api1 holds half of.
  write_config("", "[[tenant]]\nname = \"alice\"\ngpus = 0.75\ndevices = [0]\n");
  kill(daemon_, SIGHUP);
  ASSERT_TRUE(eventually([&] { return log_contains("reload rejected"); })) << read_file(log_path_);
  EXPECT_TRUE(log_contains("API tenants hold 0.5 of GPU 0 (\"api1\" 0.5)")) << read_file(log_path_);
  EXPECT_EQ(policy_of("alice", kUuid0).share_ppm, 500'000u);  // the old policy stays
  EXPECT_EQ(policy_of("api1", kUuid0).share_ppm, 500'000u);

  // A config tenant may not take an API tenant's name.
  write_config("", kAlice + "[[tenant]]\nname = \"api1\"\ngpus = 0.1\ndevices = [1]\n");
  kill(daemon_, SIGHUP);
  ASSERT_TRUE(eventually([&] {
    return log_contains("the name belongs to a tenant created through the control API");
  })) << read_file(log_path_);
  EXPECT_TRUE(call({{"op", "get"}, {"name", "api1"}}).body["tenant"]["source"] == "api");
}

// On Kubernetes the config is rebuilt from the node's GPUs at each start: a
// GPU that failed is gone from it, and an admin's [[tenant]] may take an API
// tenant's name. The daemon must still come up (it used to exit 2, and the
// API that could repair it needs the daemon): it places what fits, reports
// the rest as unplaced, and the API repairs them.
TEST_F(ControlTest, AStartWithAGoneGpuOrATakenNameComesUpAndTheApiRepairsIt) {
  start_daemon();
  ASSERT_TRUE(create("api1", {gpu(kUuid1, 0.5)}).ok);
  ASSERT_TRUE(create("api2", {gpu(kUuid0, 0.25)}).ok);
  stop_daemon();
  write_file(config_path_, "[daemon]\nrun_dir = \"" + run_dir_ +
                               "\"\nreap_interval_ms = 50\nmetrics_address = \"off\"\n"
                               "[[gpu]]\nindex = 0\ncontext_memory = \"64MiB\"\n" + kAlice +
                               "[[tenant]]\nname = \"api2\"\ngpus = 0.1\ndevices = [0]\n");
  // --check (the systemd unit's ExecStartPre) agrees with the start: valid,
  // the two API tenants named as unplaced.
  const std::string check_log = tmp_ / "check.log";
  EXPECT_EQ(wait_exit(spawn({FRACGPUD_PATH, "--config", config_path_, "--check"}, check_log), 10s), 0)
      << read_file(check_log);
  EXPECT_NE(read_file(check_log).find("API tenant \"api1\" cannot be placed beside this config"), std::string::npos)
      << read_file(check_log);
  EXPECT_NE(read_file(check_log).find("API tenant \"api2\" cannot be placed beside this config"), std::string::npos)
      << read_file(check_log);
  start_daemon();
  EXPECT_TRUE(log_contains("API tenant \"api1\" cannot be placed")) << read_file(log_path_);
  EXPECT_TRUE(log_contains("API tenant \"api2\" cannot be placed")) << read_file(log_path_);
  control::Reply got = call({{"op", "get"}, {"name", "api1"}});
  ASSERT_TRUE(got.ok) << got.body.dump();
  EXPECT_EQ(got.body["tenant"]["state"], "unplaced") << got.body.dump();
  EXPECT_NE(got.body["tenant"]["unplaced_reason"].get<std::string>().find("not a configured [[gpu]] any more"),
            std::string::npos)
      << got.body.dump();
  EXPECT_EQ(policy_of("alice", kUuid0).share_ppm, 500'000u);  // the rest of the node runs
  EXPECT_EQ(policy_of("api2", kUuid0).share_ppm, 100'000u);   // the config's api2

  // Repaired through the API: api1 resized onto a GPU the node has; the
  // API's api2 deleted, leaving the config's tenant of that name alone.
  control::Reply resized = create("api1", {gpu(kUuid0, 0.25)}, "resize");
  ASSERT_TRUE(resized.ok) << resized.body.dump();
  EXPECT_EQ(policy_of("api1", kUuid0).share_ppm, 250'000u);
  control::Reply deleted = call({{"op", "delete"}, {"name", "api2"}});
  ASSERT_TRUE(deleted.ok) << deleted.body.dump();
  EXPECT_EQ(deleted.body["state"], "deleted");
  EXPECT_EQ(policy_of("api2", kUuid0).share_ppm, 100'000u);
  control::Reply list = call({{"op", "list"}});
  ASSERT_TRUE(list.ok);
  for (const auto& t : list.body["tenants"]) EXPECT_NE(t["state"], "unplaced") << list.body.dump();
  // And the next start needs no repair.
  stop_daemon();
  start_daemon();
  EXPECT_EQ(policy_of("api1", kUuid0).share_ppm, 250'000u);
}

// A reload refused after the config was placed (here: it moves run_dir)
// leaves which API tenants are placed as it was, with the config in force.
// It once kept the refused config's list: an unplaced tenant then read as
// not found, an identical create of it crashed the daemon, and another
// create put it back on its GPU beside the tenants it did not fit beside.
// A run_dir written with a trailing slash is no move.
TEST_F(ControlTest, ARefusedReloadLeavesTheUnplacedAsTheyWere) {
  start_daemon();
  ASSERT_TRUE(create("api1", {gpu(kUuid0, 0.5)}).ok);
  stop_daemon();
  write_config("", "[[tenant]]\nname = \"alice\"\ngpus = 0.75\ndevices = [0]\n");
  start_daemon();
  ASSERT_EQ(call({{"op", "get"}, {"name", "api1"}}).body["tenant"]["state"], "unplaced");
  const auto config_with_run_dir = [&](const std::string& run_dir) {
    write_file(config_path_, "[daemon]\nrun_dir = \"" + run_dir +
                                 "\"\nreap_interval_ms = 50\nlog_level = \"debug\"\nmetrics_address = \"off\"\n"
                                 "[[gpu]]\nindex = 0\ncontext_memory = \"64MiB\"\n[[gpu]]\nindex = 1\n"
                                 "context_memory = \"64MiB\"\n" +
                                 kAlice);  // alice back to 0.5: api1 would fit
  };
  config_with_run_dir(run_dir_ + "/elsewhere");
  kill(daemon_, SIGHUP);
  ASSERT_TRUE(eventually([&] { return log_contains("reload rejected"); })) << read_file(log_path_);
  const control::Reply got = call({{"op", "get"}, {"name", "api1"}});
  ASSERT_TRUE(got.ok) << got.body.dump();
  EXPECT_EQ(got.body["tenant"]["state"], "unplaced") << got.body.dump();
  const control::Reply again = create("api1", {gpu(kUuid0, 0.5)});
  EXPECT_EQ(again.code, "conflict") << again.body.dump();
  ASSERT_TRUE(create("api2", {gpu(kUuid1, 0.1)}).ok);  // a change of the node: every API tenant looked at again
  EXPECT_EQ(policy_of("alice", kUuid0).share_ppm, 750'000u);
  EXPECT_EQ(policy_of("api2", kUuid1).state, ledger::kGpuGranted);
  EXPECT_NE(policy_of("api1", kUuid0).state, ledger::kGpuGranted) << "not put back beside alice's 0.75";
  EXPECT_EQ(waitpid(daemon_, nullptr, WNOHANG), 0) << "the daemon runs";

  // The same directory, spelt with a trailing slash: the reload applies,
  // and api1 now fits.
  config_with_run_dir(run_dir_ + "/");
  kill(daemon_, SIGHUP);
  ASSERT_TRUE(eventually([&] { return log_contains("reload applied"); })) << read_file(log_path_);
  EXPECT_EQ(policy_of("alice", kUuid0).share_ppm, 500'000u);
  EXPECT_EQ(call({{"op", "get"}, {"name", "api1"}}).body["tenant"]["state"], "active");
}

// The admission budget's figures (control_ops.cpp: 4 descriptors a tenant,
// 2 a granted GPU) must hold: 60 tenants, each on both GPUs, cost the daemon
// no more than 60 x (4 + 2 x 2) descriptors.
TEST_F(ControlTest, ATenantCostsTheDaemonNoMoreDescriptorsThanItsBudget) {
  start_daemon();
  const auto descriptors = [&] {
    size_t n = 0;
    for (const auto& e : fs::directory_iterator("/proc/" + std::to_string(daemon_) + "/fd")) n += !e.path().empty();
    return n;
  };
  const size_t before = descriptors();
  for (int i = 0; i < 60; ++i) {
    const control::Reply r = create("fd-" + std::to_string(i), {gpu(kUuid0, 0.005), gpu(kUuid1, 0.005)});
    ASSERT_TRUE(r.ok) << r.body.dump();
  }
  const size_t after = descriptors();
  printf("60 tenants on 2 GPUs: %zu descriptors (%.2f a tenant)\n", after - before, (after - before) / 60.0);
  EXPECT_LE(after - before, 60u * (4 + 2 * 2));
}

// With few descriptors (a hard limit of 400, so 256 kept free leaves room
// for a few dozen tenants), creates are refused clearly before anything
// breaks: every tenant answered `ok` has its ledger, the daemon keeps
// answering, and a delete makes room again.
TEST_F(ControlTest, CreatesAreRefusedBeforeTheDaemonRunsOutOfDescriptors) {
  daemon_ = spawn({"/usr/bin/prlimit", "--nofile=400:400", FRACGPUD_PATH, "--config", config_path_}, log_path_);
  ASSERT_TRUE(eventually([&] { return log_contains("control API: listening on"); }, 10s)) << read_file(log_path_);
  int created = 0;
  control::Reply refused;
  for (int i = 0; i < 200; ++i) {
    const control::Reply r = create("fd-" + std::to_string(i), {gpu(kUuid0, 0.004)});
    if (!r.ok) {
      refused = r;
      break;
    }
    ++created;
    ASSERT_GT(policy_of("fd-" + std::to_string(i), kUuid0).share_ppm, 0u) << "answered ok without a ledger";
  }
  ASSERT_GT(created, 5);
  ASSERT_FALSE(refused.ok) << "200 tenants fitted in 400 descriptors";
  EXPECT_EQ(refused.body["code"], "no_capacity") << refused.body.dump();
  EXPECT_NE(refused.body["error"].get<std::string>().find("descriptors"), std::string::npos) << refused.body.dump();
  EXPECT_FALSE(log_contains("Too many open files")) << read_file(log_path_);
  EXPECT_TRUE(call({{"op", "list"}}).ok);
  ASSERT_TRUE(call({{"op", "delete"}, {"name", "fd-0"}}).ok);
  ASSERT_TRUE(call({{"op", "delete"}, {"name", "fd-1"}}).ok);
  const control::Reply again = create("fd-again", {gpu(kUuid0, 0.004)});
  EXPECT_TRUE(again.ok) << again.body.dump();
  EXPECT_EQ(kill(daemon_, 0), 0);
}

// Its one GPU (GPU 1 of the node) is its device 0: a tenant's process sees
// only the GPUs it is granted.
TEST_F(ControlTest, AnApiTenantsProcessSeesItsQuotaThroughTheInterposer) {
  start_daemon();
  ASSERT_TRUE(create("q", {gpu(kUuid1, 0.25, 1 * kGiB)}).ok);
  const std::string log = tmp_ / "probe.log";
  const pid_t probe = spawn_probe("q", {"init", "primary", "0", "info", "alloc", "2GiB", "alloc", "512MiB"}, log);
  ASSERT_EQ(wait_exit(probe, 20s), 0) << read_file(log);
  const std::string out = read_file(log);
  EXPECT_NE(out.find("init=0\n"), std::string::npos) << out;
  EXPECT_NE(out.find("total=" + std::to_string(1 * kGiB) + "\n"), std::string::npos) << out;
  EXPECT_NE(out.find("alloc=2\nalloc=0\n"), std::string::npos) << out;  // 2 GiB refused (out of memory), 512 MiB fits
}

// Deleted while a process runs: it keeps running within its quota, a new
// process is refused, the capacity stays booked, and the ledger goes once the
// process is gone.
TEST_F(ControlTest, DeletingATenantWithAProcessDrainsIt) {
  start_daemon();
  ASSERT_TRUE(create("drain", {gpu(kUuid1, 0.5, 1 * kGiB)}).ok);
  const std::string barrier = tmp_ / "barrier";
  fs::create_directories(barrier);
  const std::string log = tmp_ / "running.log";
  const pid_t running = spawn_probe(
      "drain", {"init", "primary", "0", "alloc", "100MiB", "barrier", barrier, "alloc", "100MiB", "alloc", "2GiB", "hold"},
      log);
  ASSERT_TRUE(eventually([&] { return fs::exists(barrier + "/ready-" + std::to_string(running)); }, 20s))
      << read_file(log);

  control::Reply r = call({{"op", "delete"}, {"name", "drain"}});
  ASSERT_TRUE(r.ok) << r.body.dump();
  EXPECT_EQ(r.body["state"], "draining");
  r = call({{"op", "get"}, {"name", "drain"}});
  EXPECT_EQ(r.body["tenant"]["state"], "draining");
  EXPECT_EQ(r.body["tenant"]["processes"], 1);
  EXPECT_TRUE(policy_of("drain", kUuid1).flags & ledger::kTenantDraining);
  EXPECT_EQ(call({{"op", "node"}}).body["node"]["gpus"][1]["api_share"], 0.5);  // still booked
  expect_failure(create("drain", {gpu(kUuid1, 0.5, 1 * kGiB)}), "conflict", "name", "is draining");
  EXPECT_EQ(call({{"op", "delete"}, {"name", "drain"}}).body["state"], "draining");  // idempotent

  // A new process is refused at cuInit, as a denied tenant is.
  const std::string late_log = tmp_ / "late.log";
  const pid_t late = spawn_probe("drain", {"init", "primary", "0", "alloc", "10MiB"}, late_log);
  ASSERT_EQ(wait_exit(late, 20s), 0) << read_file(late_log);
  EXPECT_NE(read_file(late_log).find("init=800\n"), std::string::npos) << read_file(late_log);  // NOT_PERMITTED
  EXPECT_NE(read_file(late_log).find("is being deleted"), std::string::npos) << read_file(late_log);

  // The running one goes on, its quota enforced.
  write_file(barrier + "/go", "");
  ASSERT_TRUE(eventually([&] { return read_file(log).find("holding=") != std::string::npos; }, 20s)) << read_file(log);
  EXPECT_NE(read_file(log).find("alloc=0\nalloc=0\nalloc=2\n"), std::string::npos) << read_file(log);
  EXPECT_TRUE(fs::exists(tenant_dir("drain")));

  kill_and_reap(running);
  ASSERT_TRUE(eventually([&] { return !fs::exists(tenant_dir("drain")); }, 10s)) << read_file(log_path_);
  expect_failure(call({{"op", "get"}, {"name", "drain"}}), "not_found", "name", "no tenant");
  EXPECT_EQ(call({{"op", "node"}}).body["node"]["gpus"][1]["api_share"], 0.0);
  EXPECT_EQ(read_file(run_dir_ + "/api-tenants.json").find("drain"), std::string::npos);
  EXPECT_TRUE(create("drain", {gpu(kUuid1, 0.5)}).ok);  // the name is free again
}

// Capacity is released when the tenant's last process is gone, by the
// kernel's word (the record locks its processes hold), never by what the
// tenant wrote: a tenant that truncates its own usage file before its last
// process ends is still deleted. (Before: its processes could no longer be
// counted, and it stayed draining, its capacity booked, until a restart.)
TEST_F(ControlTest, ATenantThatTruncatesItsUsageFileIsStillDeletedWhenItsLastProcessEnds) {
  start_daemon();
  ASSERT_TRUE(create("drain", {gpu(kUuid1, 0.5, 1 * kGiB)}).ok);
  const std::string barrier = tmp_ / "barrier";
  fs::create_directories(barrier);
  const std::string log = tmp_ / "running.log";
  const pid_t running = spawn_probe("drain", {"init", "primary", "0", "alloc", "100MiB", "barrier", barrier, "hold"}, log);
  ASSERT_TRUE(eventually([&] { return fs::exists(barrier + "/ready-" + std::to_string(running)); }, 20s))
      << read_file(log);
  ASSERT_EQ(call({{"op", "delete"}, {"name", "drain"}}).body["state"], "draining");
  ASSERT_EQ(truncate((tenant_dir("drain") + "/usage").c_str(), 0), 0) << strerror(errno);
  std::this_thread::sleep_for(500ms);
  EXPECT_TRUE(fs::exists(tenant_dir("drain"))) << "its process still runs";
  EXPECT_EQ(call({{"op", "get"}, {"name", "drain"}}).body["tenant"]["processes"], 1) << "counted by its lock";
  kill_and_reap(running);
  ASSERT_TRUE(eventually([&] { return !fs::exists(tenant_dir("drain")); }, 10s)) << read_file(log_path_);
  EXPECT_EQ(call({{"op", "node"}}).body["node"]["gpus"][1]["api_share"], 0.0);
  EXPECT_TRUE(create("drain2", {gpu(kUuid1, 1.0)}).ok) << "the whole GPU is free again";
}

TEST_F(ControlTest, DrainingSurvivesADaemonRestart) {
  start_daemon();
  ASSERT_TRUE(create("drain", {gpu(kUuid1, 0.5, 1 * kGiB)}).ok);
  const pid_t holder = spawn_tenant_process(tenant_dir("drain"), 0, 10 * kMiB);
  ASSERT_GT(holder, 0);
  children_.push_back(holder);
  ASSERT_EQ(call({{"op", "delete"}, {"name", "drain"}}).body["state"], "draining");
  stop_daemon();
  start_daemon();
  control::Reply r = call({{"op", "get"}, {"name", "drain"}});
  ASSERT_TRUE(r.ok) << r.body.dump();
  EXPECT_EQ(r.body["tenant"]["state"], "draining");
  EXPECT_TRUE(policy_of("drain", kUuid1).flags & ledger::kTenantDraining);
  kill_and_reap(holder);
  ASSERT_TRUE(eventually([&] { return !fs::exists(tenant_dir("drain")); }, 10s)) << read_file(log_path_);
  EXPECT_TRUE(eventually([&] { return log_contains("tenant \"drain\" deleted: no process left, ledger directory removed"); }))
      << read_file(log_path_);
}

// The user "nobody" and its primary group, for peers that are neither root
// nor the daemon's user; nullopt (with *why) where the test cannot use it.
struct OtherUser {
  uid_t uid = 0;
  gid_t gid = 0;
  std::string group;
};
std::optional<OtherUser> nobody_user(std::string* why) {
  if (geteuid() != 0) {
    *why = "needs root to become another user";
    return std::nullopt;
  }
  const struct passwd* nobody = getpwnam("nobody");
  if (nobody == nullptr) {
    *why = "no user \"nobody\"";
    return std::nullopt;
  }
  const struct group* group = getgrgid(nobody->pw_gid);
  if (group == nullptr) {
    *why = "nobody's group has no name";
    return std::nullopt;
  }
  for (char** m = group->gr_mem; *m != nullptr; ++m) {
    if (std::string(*m) == "nobody") {
      *why = "nobody is listed in its own group";
      return std::nullopt;
    }
  }
  return OtherUser{nobody->pw_uid, nobody->pw_gid, group->gr_name};
}

// The result of `request` sent by a child running as `uid`, with primary
// group `gid` and supplementary groups `groups`.
control::Reply call_as(const std::string& socket, uid_t uid, gid_t gid, const std::vector<gid_t>& groups,
                       const json& request) {
  const std::string text = output_of_child([&] {
    if (setgroups(groups.size(), groups.data()) != 0 || setgid(gid) != 0 || setuid(uid) != 0) return std::string();
    const control::Reply r = control::call(socket, request, 5s);
    return json{{"code", r.code}, {"error", r.error}, {"body", r.body}}.dump();
  });
  control::Reply r;
  const json j = json::parse(text, nullptr, false);
  if (!j.is_object()) return r;
  r.body = j["body"];
  r.ok = r.body.value("ok", false);
  r.code = j["code"];
  r.error = j["error"];
  return r;
}

TEST_F(ControlTest, OnlyRootTheDaemonsUserAndTheControlGroupGetIn) {
  std::string why;
  const std::optional<OtherUser> other = nobody_user(&why);
  if (!other) GTEST_SKIP() << why;
  const uid_t uid = other->uid;
  const gid_t group_gid = other->gid;
  const std::string group_name = other->group;
  const gid_t other_gid = 54321;  // no group of the control API's

  // No control_group: the socket is 0600, an unprivileged user cannot even connect.
  start_daemon();
  struct stat st {};
  ASSERT_EQ(stat(socket_path().c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0600u);
  control::Reply r = call_as(socket_path(), uid, group_gid, {}, {{"op", "list"}});
  EXPECT_EQ(r.code, "unreachable") << r.error;
  EXPECT_NE(r.error.find("Permission denied"), std::string::npos) << r.error;
  EXPECT_TRUE(call({{"op", "list"}}).ok);  // root

  // With the group (a reload is enough): its members get in.
  write_config("control_group = \"" + group_name + "\"\n");
  kill(daemon_, SIGHUP);
  ASSERT_TRUE(eventually([&] { return log_contains("control API: group " + group_name); })) << read_file(log_path_);
  ASSERT_EQ(stat(socket_path().c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0660u);
  EXPECT_EQ(st.st_gid, group_gid);
  r = call_as(socket_path(), uid, group_gid, {}, {{"op", "create"},
                                                 {"tenant", {{"name", "by-group"}, {"gpus", {gpu(kUuid1, 0.1)}}}}});
  EXPECT_TRUE(r.ok) << r.code << ": " << r.error;

  // A process in the group only as a supplementary group can open the
  // socket file, but the daemon checks the peer itself (SO_PEERCRED: its
  // primary group, and the group file's members) and refuses it.
  r = call_as(socket_path(), uid, other_gid, {group_gid}, {{"op", "delete"}, {"name", "by-group"}});
  EXPECT_EQ(r.code, "denied") << r.error;
  EXPECT_NE(r.error.find("may not use fracgpud's control API"), std::string::npos) << r.error;
  EXPECT_TRUE(call({{"op", "get"}, {"name", "by-group"}}).ok);  // not deleted
}

TEST_F(ControlTest, ControlGroupThatDoesNotExistStopsTheStart) {
  write_config("control_group = \"no-such-group-fracgpu\"\n");
  std::string out;
  const pid_t pid = spawn({FRACGPUD_PATH, "--config", config_path_}, log_path_);
  EXPECT_EQ(wait_exit(pid, 10s), 2);
  EXPECT_TRUE(log_contains("control_group \"no-such-group-fracgpu\" is not a group on this node")) << read_file(log_path_);
}

// A raw connection to the socket, for what the client library never sends.
class RawClient {
 public:
  explicit RawClient(const std::string& path) {
    fd_ = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    struct sockaddr_un addr {};
    addr.sun_family = AF_UNIX;
    snprintf(addr.sun_path, sizeof addr.sun_path, "%s", path.c_str());
    connected_ = connect(fd_, reinterpret_cast<struct sockaddr*>(&addr), sizeof addr) == 0;
    const struct timeval timeout {10, 0};
    setsockopt(fd_, SOL_SOCKET, SO_RCVTIMEO, &timeout, sizeof timeout);
  }
  ~RawClient() { close(fd_); }
  bool connected() const { return connected_; }
  bool send_text(const std::string& text) {
    return ::send(fd_, text.data(), text.size(), MSG_NOSIGNAL) == static_cast<ssize_t>(text.size());
  }
  // One reply line; "" when the connection ends first (or 10 s pass).
  std::string read_line() {
    for (;;) {
      if (const size_t nl = buffer_.find('\n'); nl != std::string::npos) {
        const std::string line = buffer_.substr(0, nl);
        buffer_.erase(0, nl + 1);
        return line;
      }
      char buf[4096];
      const ssize_t n = recv(fd_, buf, sizeof buf, 0);
      if (n <= 0) return "";
      buffer_.append(buf, static_cast<size_t>(n));
    }
  }
  // True when the daemon closed the connection: end of file, or a reset
  // (a Unix socket closed with bytes it did not read resets its peer).
  bool closed() {
    char c;
    const ssize_t n = recv(fd_, &c, 1, 0);
    return n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK);
  }

 private:
  int fd_ = -1;
  bool connected_ = false;
  std::string buffer_;
};

// The "code" of a reply line; "" for anything else.
std::string code_of(const std::string& line) {
  const json reply = json::parse(line, nullptr, false);
  return reply.is_object() ? reply.value("code", "") : "";
}

// A request too long for the daemon is refused by the client itself as a
// bad request, never reported as a daemon out of reach (the CLI said "is it
// running?" for an annotation too long).
TEST(ControlClient, ARequestTooLongIsInvalidNotUnreachable) {
  const json request = {{"op", "create"},
                        {"tenant", {{"name", "t"}, {"annotations", {{"k", std::string(70 << 10, 'a')}}}}}};
  const control::Reply r = control::call("/nonexistent/control.sock", request, 1s);
  EXPECT_EQ(r.code, "invalid") << r.error;
  EXPECT_NE(r.error.find("above the 65536 the daemon reads"), std::string::npos) << r.error;
}

TEST_F(ControlTest, HostileClientsAreBoundedAndNeverStallTheDaemon) {
  start_daemon();
  {  // More than 64 KiB without a newline: refused, connection closed.
    RawClient c(socket_path());
    ASSERT_TRUE(c.connected());
    c.send_text(std::string(70 << 10, 'a'));
    const json reply = json::parse(c.read_line(), nullptr, false);
    EXPECT_EQ(reply["code"], "invalid") << reply.dump();
    EXPECT_NE(reply["error"].get<std::string>().find("request longer than 65536 bytes"), std::string::npos);
    EXPECT_TRUE(c.closed());
  }
  {  // Garbage, deep nesting, bytes that are not UTF-8: each refused, the connection goes on.
    RawClient c(socket_path());
    c.send_text("hello\n");
    EXPECT_EQ(json::parse(c.read_line(), nullptr, false)["code"], "invalid");
    c.send_text(std::string(60000, '[') + "\n");
    EXPECT_EQ(json::parse(c.read_line(), nullptr, false)["code"], "invalid");
    c.send_text("{\"op\":\"get\",\"name\":\"\xff\xfe\"}\n");
    EXPECT_EQ(json::parse(c.read_line(), nullptr, false)["code"], "invalid");
    c.send_text("{\"op\":\"list\"}\n{\"op\":\"list\"}\n");  // two in one write
    EXPECT_EQ(json::parse(c.read_line(), nullptr, false)["ok"], true);
    EXPECT_EQ(json::parse(c.read_line(), nullptr, false)["ok"], true);
  }
  {  // A client that stops halfway: the daemon ticks and serves others meanwhile, then drops it.
    RawClient slow(socket_path());
    ASSERT_TRUE(slow.connected());
    slow.send_text("{\"op\":\"li");
    const auto started = std::chrono::steady_clock::now();
    const uint64_t before = heartbeat_ns("alice");
    ASSERT_TRUE(eventually([&] { return heartbeat_ns("alice") > before + 200'000'000; }, 3s));
    EXPECT_TRUE(call({{"op", "list"}}, 2s).ok);
    EXPECT_TRUE(slow.closed());  // after the 5 s idle limit
    const auto waited = std::chrono::steady_clock::now() - started;
    EXPECT_GE(waited, 4s);
    EXPECT_LE(waited, 8s);
  }
  {  // More connections than the daemon keeps: the extra one is told the daemon is busy; once the
     // others have sent nothing for a second, a new one takes the place of one of them (the client
     // library asks again meanwhile).
    std::vector<std::unique_ptr<RawClient>> idle;
    for (size_t i = 0; i < 64; ++i) idle.push_back(std::make_unique<RawClient>(socket_path()));
    RawClient extra(socket_path());
    const std::string refused = extra.read_line();
    EXPECT_EQ(code_of(refused), "busy") << refused;
    EXPECT_NE(refused.find("too many connections"), std::string::npos) << refused;
    EXPECT_TRUE(call({{"op", "list"}}, 3s).ok);
    // One was told why it was closed; the rest are closed at their 5 s deadline without a word.
    size_t evicted = 0;
    for (const auto& c : idle) {
      const std::string line = c->read_line();
      evicted += code_of(line) == "busy";
      EXPECT_TRUE(line.empty() || c->closed());
    }
    EXPECT_EQ(evicted, 1u);
  }
  EXPECT_EQ(kill(daemon_, 0), 0);  // alive through all of it
}

// Connects to the control socket without blocking past 200 ms (a full
// backlog); -1 when that fails.
int connect_control(const std::string& path) {
  const int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  const struct timeval timeout {0, 200'000};
  setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &timeout, sizeof timeout);
  struct sockaddr_un addr {};
  addr.sun_family = AF_UNIX;
  snprintf(addr.sun_path, sizeof addr.sun_path, "%s", path.c_str());
  if (connect(fd, reinterpret_cast<struct sockaddr*>(&addr), sizeof addr) != 0) {
    close(fd);
    return -1;
  }
  return fd;
}

// Forks a slow-loris client: it keeps `count` connections open, sends each
// one space a second and never a newline (a request that never ends), and
// reconnects whenever the daemon closes one. As root, or as `uid`/`gid`
// when given. Runs until killed.
pid_t spawn_trickler(const std::string& path, size_t count, std::optional<std::pair<uid_t, gid_t>> as = {}) {
  const pid_t pid = fork();
  if (pid != 0) return pid;
  if (as && (setgroups(0, nullptr) != 0 || setgid(as->second) != 0 || setuid(as->first) != 0)) _exit(1);
  std::vector<int> fds(count, -1);
  for (;;) {
    for (int& fd : fds) {
      char buf[4096];
      const ssize_t got = fd < 0 ? 0 : recv(fd, buf, sizeof buf, MSG_DONTWAIT);
      const bool gone = fd >= 0 && (got == 0 || (got < 0 && errno != EAGAIN && errno != EWOULDBLOCK));
      if (gone || (fd >= 0 && send(fd, " ", 1, MSG_NOSIGNAL | MSG_DONTWAIT) != 1)) {
        close(fd);
        fd = -1;
      }
      if (fd < 0) fd = connect_control(path);
    }
    sleep(1);
  }
}

TEST_F(ControlTest, PipelinedChangesOnEveryConnectionCannotStopTheDaemonsTick) {
  // 100 API tenants, 50 a GPU, beside alice (0.5 of GPU 0).
  start_daemon();
  constexpr int kTenants = 100;
  const auto tenant_gpu = [](int i, double share) { return gpu(i % 2 == 0 ? kUuid0 : kUuid1, share); };
  for (int i = 0; i < kTenants; ++i) {
    const control::Reply r = create("t" + std::to_string(i), {tenant_gpu(i, 0.009)});
    ASSERT_TRUE(r.ok) << r.body.dump();
  }
  const pid_t worker = spawn_tenant_process(tenant_dir("alice"), 0, 64 * kMiB, "worker");
  ASSERT_GT(worker, 0);
  children_.push_back(worker);
  ASSERT_EQ(charged("alice", 0), 64 * kMiB);

  // 64 connections, each with 16 resizes in flight at all times, each
  // resize a change (its own tenant's share goes back and forth).
  constexpr int kConnections = 64, kPipelined = 16;
  std::atomic<bool> stop{false};
  std::atomic<int> ok_replies{0}, failed_replies{0};
  std::thread load([&] {
    std::vector<int> fds;
    for (int c = 0; c < kConnections; ++c) fds.push_back(connect_control(socket_path()));
    std::vector<int> awaited(kConnections, 0);
    std::vector<std::string> received(kConnections);
    int round = 0;
    while (!stop) {
      std::vector<struct pollfd> polled;
      for (int c = 0; c < kConnections; ++c) {
        if (fds[c] < 0) continue;
        if (awaited[c] == 0) {
          std::string batch;
          for (int k = 0; k < kPipelined; ++k) {
            const json request = {{"op", "resize"},
                                  {"tenant",
                                   {{"name", "t" + std::to_string(c)},
                                    {"gpus", {tenant_gpu(c, (round + k) % 2 == 0 ? 0.008 : 0.009)}}}}};
            batch += request.dump() + "\n";
          }
          if (send(fds[c], batch.data(), batch.size(), MSG_NOSIGNAL) != static_cast<ssize_t>(batch.size())) {
            close(fds[c]);
            fds[c] = -1;
            continue;
          }
          awaited[c] = kPipelined;
        }
        polled.push_back({fds[c], POLLIN, 0});
      }
      ++round;
      if (polled.empty() || poll(polled.data(), polled.size(), 100) <= 0) continue;
      for (const struct pollfd& p : polled) {
        if (p.revents == 0) continue;
        const int c = static_cast<int>(std::find(fds.begin(), fds.end(), p.fd) - fds.begin());
        char buf[65536];
        const ssize_t n = recv(p.fd, buf, sizeof buf, MSG_DONTWAIT);
        if (n <= 0) {
          close(fds[c]);
          fds[c] = -1;
          continue;
        }
        received[c].append(buf, static_cast<size_t>(n));
        for (size_t nl; (nl = received[c].find('\n')) != std::string::npos; received[c].erase(0, nl + 1)) {
          const json reply = json::parse(received[c].substr(0, nl), nullptr, false);
          ++(reply.is_object() && reply.value("ok", false) ? ok_replies : failed_replies);
          --awaited[c];
        }
      }
    }
    // Every request sent is answered before the connections close: none is
    // left for the daemon to serve after the load.
    const auto drain_end = std::chrono::steady_clock::now() + 10s;
    for (int c = 0; c < kConnections; ++c) {
      while (fds[c] >= 0 && awaited[c] > 0 && std::chrono::steady_clock::now() < drain_end) {
        char buf[65536];
        struct pollfd p = {fds[c], POLLIN, 0};
        if (poll(&p, 1, 100) <= 0) continue;
        const ssize_t n = recv(fds[c], buf, sizeof buf, 0);
        if (n <= 0) break;
        awaited[c] -= static_cast<int>(std::count(buf, buf + n, '\n'));
      }
      close(fds[c]);
    }
  });

  // Meanwhile: how stale the daemon's heartbeat gets (it is stored at every
  // tick, every 50 ms), and how soon the charge of a process killed in the
  // middle of it is reclaimed.
  const auto stalest = [&](std::chrono::milliseconds how_long) {
    uint64_t worst = 0;
    const auto end = std::chrono::steady_clock::now() + how_long;
    while (std::chrono::steady_clock::now() < end) {
      const uint64_t beat = heartbeat_ns("alice"), now = ledger::monotonic_ns();
      if (beat != 0 && now > beat) worst = std::max(worst, now - beat);
      std::this_thread::sleep_for(10ms);
    }
    return worst;
  };
  const auto load_started = std::chrono::steady_clock::now();
  const uint64_t stalest_before_kill = stalest(3s);
  kill_and_reap(worker);
  const auto killed = std::chrono::steady_clock::now();
  // By the ledger, not the log: under this load the log's rate limit may drop the line.
  const bool reclaimed = eventually([&] { return charged("alice", 0) == 0; }, 10s);
  const auto reclaim_ms =
      std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - killed).count();
  const uint64_t stalest_after_kill = stalest(1s);
  const int replies_during = ok_replies.load();
  const double load_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - load_started).count();
  stop = true;
  load.join();

  const uint64_t worst_ms = std::max(stalest_before_kill, stalest_after_kill) / 1'000'000;
  std::cout << "under load: heartbeat at most " << worst_ms << " ms old, a dead process reclaimed after " << reclaim_ms
            << " ms, " << replies_during << " resizes answered in " << load_s << " s\n";
  EXPECT_GT(replies_during, 200) << "the load did not run";
  EXPECT_EQ(failed_replies.load(), 0);
  // Ticks every 50 ms; a 2-core machine under this load is allowed a lot.
  EXPECT_LT(worst_ms, 750u) << read_file(log_path_).substr(0, 4000);
  EXPECT_TRUE(reclaimed);
  EXPECT_LT(reclaim_ms, 1000);
  // Every resize the daemon answered is in force: tenant t0's table says
  // what the last answer said.
  const control::Reply t0 = call({{"op", "get"}, {"name", "t0"}});
  ASSERT_TRUE(t0.ok);
  EXPECT_EQ(policy_of("t0", kUuid0).share_ppm,
            static_cast<uint32_t>(std::lround(t0.body["tenant"]["gpus"][0]["share"].get<double>() * 1e6)));
}

// A client that pipelines requests and never reads a reply: the replies
// fill its socket, its deadline passes with more requests queued behind
// them. It is dropped at that deadline, as one that reads no reply is
// (before, the requests queued kept it for ever, the daemon's loop polling
// its past deadline without sleeping).
TEST_F(ControlTest, AClientThatPipelinesAndNeverReadsIsDropped) {
  start_daemon();
  const int fd = connect_control(socket_path());
  ASSERT_GE(fd, 0);
  std::string batch;
  while (batch.size() + 20 < 60'000) batch += "{\"op\":\"list\"}\n";
  size_t sent = 0;
  const auto connected = std::chrono::steady_clock::now();
  while (sent < batch.size() && std::chrono::steady_clock::now() - connected < 2s) {
    const ssize_t n = send(fd, batch.data() + sent, batch.size() - sent, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n > 0) sent += static_cast<size_t>(n);
    else std::this_thread::sleep_for(10ms);
  }
  bool closed = false;
  while (!closed && std::chrono::steady_clock::now() - connected < 12s) {
    struct pollfd p {fd, 0, 0};
    closed = poll(&p, 1, 100) > 0 && (p.revents & (POLLHUP | POLLERR)) != 0;
  }
  close(fd);
  std::cout << "a client pipelining " << sent << " bytes of requests and reading nothing: "
            << (closed ? "dropped" : "still open") << " after "
            << std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - connected).count()
            << " ms\n";
  EXPECT_TRUE(closed);
  // Still serving others.
  EXPECT_TRUE(call({{"op", "list"}}, 5s).ok);
}

TEST_F(ControlTest, SlowClientsAreDroppedAndCannotKeepRootOut) {
  start_daemon();
  {  // One byte a second never makes a request: dropped 5 s after connecting all the same.
    const int fd = connect_control(socket_path());
    ASSERT_GE(fd, 0);
    const auto connected = std::chrono::steady_clock::now();
    bool closed = false;
    while (!closed && std::chrono::steady_clock::now() - connected < 9s) {
      char c;
      const ssize_t n = recv(fd, &c, 1, MSG_DONTWAIT);
      closed = n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK) ||
               send(fd, " ", 1, MSG_NOSIGNAL | MSG_DONTWAIT) != 1;
      if (!closed) std::this_thread::sleep_for(1s);
    }
    close(fd);
    EXPECT_TRUE(closed);
    EXPECT_LE(std::chrono::steady_clock::now() - connected, 7s);
  }
  // 80 trickling connections by root (more than the daemon keeps), always
  // reconnecting: root (the kubelet plugin) still gets in, and soon.
  const pid_t root_trickler = spawn_trickler(socket_path(), 80);
  children_.push_back(root_trickler);
  std::this_thread::sleep_for(2500ms);
  const auto timed_call = [&](const json& request, std::chrono::milliseconds* longest) {
    const auto asked = std::chrono::steady_clock::now();
    const control::Reply r = call(request, 5s);
    *longest = std::max(*longest, std::chrono::duration_cast<std::chrono::milliseconds>(
                                      std::chrono::steady_clock::now() - asked));
    return r;
  };
  std::chrono::milliseconds longest{0};
  for (int i = 0; i < 3; ++i) {
    const control::Reply r = timed_call(
        {{"op", "create"}, {"tenant", {{"name", "plugin" + std::to_string(i)}, {"gpus", {gpu(kUuid1, 0.1)}}}}},
        &longest);
    EXPECT_TRUE(r.ok) << r.code << ": " << r.error;
    std::this_thread::sleep_for(700ms);
  }
  std::cout << "root beside root's 80 trickling connections: answered within " << longest.count() << " ms\n";
  EXPECT_LT(longest, 2s);
  kill_and_reap(root_trickler);

  // The same by a user of the control group, 80 connections: root gets in
  // at once, on the connections kept for it.
  std::string why;
  const std::optional<OtherUser> other = nobody_user(&why);
  if (!other) GTEST_SKIP() << why;
  write_config("control_group = \"" + other->group + "\"\n");
  kill(daemon_, SIGHUP);
  ASSERT_TRUE(eventually([&] { return log_contains("control API: group " + other->group); })) << read_file(log_path_);
  const pid_t user_trickler = spawn_trickler(socket_path(), 80, std::make_pair(other->uid, other->gid));
  children_.push_back(user_trickler);
  std::this_thread::sleep_for(1500ms);
  longest = 0ms;
  for (int i = 0; i < 3; ++i) {
    const control::Reply r = timed_call({{"op", "list"}}, &longest);
    EXPECT_TRUE(r.ok) << r.code << ": " << r.error;
    std::this_thread::sleep_for(500ms);
  }
  std::cout << "root beside another user's 80 trickling connections: answered within " << longest.count() << " ms\n";
  EXPECT_LT(longest, 1s);
}

// What a load child (spawn_list_load) did, counted in memory it shares with
// the test.
struct LoadCounters {
  std::atomic<uint64_t> connects{0};  // connect() attempts
  std::atomic<uint64_t> answered{0};  // replies with "ok": true
  std::atomic<uint64_t> busy{0};      // refused connections (`busy`)
  std::atomic<uint64_t> hinted{0};    // of those, the ones that said when to come back
  std::atomic<uint64_t> failed{0};    // any other reply
};

// `count` counters in anonymous shared memory, zeroed, for load children.
LoadCounters* shared_counters(size_t count) {
  void* mem = mmap(nullptr, sizeof(LoadCounters) * count, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  if (mem == MAP_FAILED) return nullptr;
  auto* counters = static_cast<LoadCounters*>(mem);
  for (size_t i = 0; i < count; ++i) new (&counters[i]) LoadCounters();
  return counters;
}

// Forks a hostile but allowed client running as `uid`/`gid`: `connections`
// connections, each keeping `pipelined` valid `list` requests in flight.
// A connection refused (`busy`) or closed is made again at once, whatever
// the daemon said about when to come back: with more connections than the
// daemon lets a user have, that is a connect storm. Runs until killed.
pid_t spawn_list_load(const std::string& path, uid_t uid, gid_t gid, size_t connections, int pipelined,
                      LoadCounters* counters) {
  const pid_t pid = fork();
  if (pid != 0) return pid;
  if (setgroups(0, nullptr) != 0 || setgid(gid) != 0 || setuid(uid) != 0) _exit(1);
  struct sockaddr_un addr {};
  addr.sun_family = AF_UNIX;
  snprintf(addr.sun_path, sizeof addr.sun_path, "%s", path.c_str());
  std::string batch;
  for (int k = 0; k < pipelined; ++k) batch += "{\"op\":\"list\"}\n";
  struct Slot {
    int fd = -1;
    int awaited = 0;
    std::string in;
  };
  std::vector<Slot> slots(connections);
  const auto drop = [](Slot& s) {
    close(s.fd);
    s.fd = -1;
    s.in.clear();
  };
  std::vector<struct pollfd> polled;
  std::vector<Slot*> polled_slots;
  for (;;) {
    polled.clear();
    polled_slots.clear();
    for (Slot& s : slots) {
      if (s.fd < 0) {
        ++counters->connects;
        // Connected as the client library does: a full backlog is waited
        // for (at most 200 ms), so the kernel queues it the moment the
        // daemon accepts another.
        s.fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
        const struct timeval timeout {0, 200'000};
        setsockopt(s.fd, SOL_SOCKET, SO_SNDTIMEO, &timeout, sizeof timeout);
        if (connect(s.fd, reinterpret_cast<struct sockaddr*>(&addr), sizeof addr) != 0 ||
            fcntl(s.fd, F_SETFL, O_NONBLOCK) != 0) {
          drop(s);
          continue;
        }
        s.awaited = 0;
      }
      if (s.awaited == 0) {
        if (send(s.fd, batch.data(), batch.size(), MSG_NOSIGNAL) != static_cast<ssize_t>(batch.size())) {
          drop(s);
          continue;
        }
        s.awaited = pipelined;
      }
      polled.push_back({s.fd, POLLIN, 0});
      polled_slots.push_back(&s);
    }
    if (polled.empty() || poll(polled.data(), polled.size(), 10) <= 0) continue;
    for (size_t i = 0; i < polled.size(); ++i) {
      if (polled[i].revents == 0) continue;
      Slot& s = *polled_slots[i];
      char buf[65536];
      const ssize_t n = recv(s.fd, buf, sizeof buf, MSG_DONTWAIT);
      if (n <= 0) {
        if (n == 0 || (errno != EAGAIN && errno != EWOULDBLOCK)) drop(s);
        continue;
      }
      s.in.append(buf, static_cast<size_t>(n));
      for (size_t nl; s.fd >= 0 && (nl = s.in.find('\n')) != std::string::npos;) {
        const std::string_view line(s.in.data(), nl);
        if (line.find("\"code\":\"busy\"") != std::string_view::npos) {
          ++counters->busy;
          if (line.find("\"retry_after_ms\"") != std::string_view::npos) ++counters->hinted;
          drop(s);
          break;
        }
        ++(line.substr(0, 10) == "{\"ok\":true" ? counters->answered : counters->failed);
        --s.awaited;
        s.in.erase(0, nl + 1);
      }
    }
  }
}

// The daemon with nobody's group as control_group, and kLoadTenants API
// tenants beside alice (a list answers with all of them), for loads by
// members of the group.
class ControlLoadTest : public ControlTest {
 protected:
  static constexpr int kLoadTenants = 40;

  void SetUp() override {
    ControlTest::SetUp();
    std::string why;
    other_ = nobody_user(&why);
    if (!other_) GTEST_SKIP() << why;
    write_config("control_group = \"" + other_->group + "\"\n");
    start_daemon();
    for (int i = 0; i < kLoadTenants; ++i)
      ASSERT_TRUE(create("t" + std::to_string(i), {gpu(i % 2 == 0 ? kUuid0 : kUuid1, 0.01)}).ok);
  }

  // The k-th member of the group, by its primary group as a pod's user would be.
  static uid_t member(int k) { return static_cast<uid_t>(61000 + k); }
  gid_t group() const { return other_->gid; }

  std::optional<OtherUser> other_;
};

TEST_F(ControlLoadTest, GroupUsersPipeliningRequestsCannotDelayRootOrStallTheLoop) {
  LoadCounters* counters = shared_counters(4);
  ASSERT_NE(counters, nullptr);

  const RootView idle = watch_as_root(2s);
  // One user: 16 connections (all it may have), each with 16 lists in flight.
  children_.push_back(spawn_list_load(socket_path(), member(0), group(), 16, 16, &counters[0]));
  const RootView one = watch_as_root(6s);
  // Four: more connections than other users may hold together; the last one's
  // refused connections are made again at once.
  for (int k = 1; k < 4; ++k)
    children_.push_back(spawn_list_load(socket_path(), member(k), group(), 16, 16, &counters[k]));
  const RootView four = watch_as_root(6s);
  for (int k = 0; k < 4; ++k) {
    std::cout << "user " << k << ": " << counters[k].answered << " lists answered, " << counters[k].connects
              << " connects, " << counters[k].busy << " refused busy, " << counters[k].failed << " other replies\n";
  }
  report("no load", idle);
  report("1 user x 16 connections x 16 lists", one);
  report("4 users x 16 connections x 16 lists", four);
  for (const RootView* view : {&one, &four}) {
    EXPECT_EQ(view->failures, 0) << view->first_failure;
    EXPECT_GE(view->latencies_ms.size(), 40u);
    EXPECT_LT(view->p99_ms(), 200.0);
    EXPECT_LT(view->stalest_heartbeat_ns, 250'000'000u);
  }
  for (int k = 0; k < 4; ++k) {
    EXPECT_GT(counters[k].answered.load(), 100u) << "user " << k << "'s load did not run";
    EXPECT_EQ(counters[k].failed.load(), 0u);
  }
}

TEST_F(ControlLoadTest, RequestsAreSharedAmongUsersNotAmongConnections) {
  LoadCounters* counters = shared_counters(4);
  ASSERT_NE(counters, nullptr);
  // Three users with 16 connections each, one with 2; all with 16 lists in
  // flight on each. Served by connection, the small user would get 2/50 of
  // the daemon's time; served by user, a quarter.
  for (int k = 0; k < 4; ++k)
    children_.push_back(spawn_list_load(socket_path(), member(k), group(), k == 3 ? 2 : 16,
                                        16, &counters[k]));
  std::this_thread::sleep_for(1s);
  uint64_t before[4];
  for (int k = 0; k < 4; ++k) before[k] = counters[k].answered;
  std::this_thread::sleep_for(5s);
  uint64_t served[4];
  for (int k = 0; k < 4; ++k) served[k] = counters[k].answered - before[k];
  const double big = static_cast<double>(served[0] + served[1] + served[2]) / 3;
  std::cout << "lists answered in 5 s: users of 16 connections " << served[0] << ", " << served[1] << ", "
            << served[2] << "; the user of 2 connections " << served[3] << "\n";
  EXPECT_GT(big, 100.0) << "the load did not run";
  EXPECT_GT(static_cast<double>(served[3]), big / 3);
}

TEST_F(ControlLoadTest, AConnectStormOfGroupUsersCannotStallTheLoopOrKeepRootOut) {
  // Five users, each trying to hold 32 connections (4 processes of 8) with 4
  // lists in flight on each: at most 56 are let in, and every refused one
  // is made again at once, whatever the daemon says.
  constexpr int kUsers = 5;
  LoadCounters* counters = shared_counters(kUsers);
  ASSERT_NE(counters, nullptr);
  for (int k = 0; k < kUsers; ++k)
    for (int process = 0; process < 4; ++process)
      children_.push_back(spawn_list_load(socket_path(), member(k), group(), 8, 4, &counters[k]));
  std::this_thread::sleep_for(500ms);
  // What the users did while root watched.
  const auto sum = [&](std::atomic<uint64_t> LoadCounters::*counter) {
    uint64_t total = 0;
    for (int k = 0; k < kUsers; ++k) total += (counters[k].*counter).load();
    return total;
  };
  const uint64_t connects_before = sum(&LoadCounters::connects), busy_before = sum(&LoadCounters::busy),
                 hinted_before = sum(&LoadCounters::hinted), answered_before = sum(&LoadCounters::answered);
  const auto started = std::chrono::steady_clock::now();
  const RootView storm = watch_as_root(8s);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  const uint64_t connects = sum(&LoadCounters::connects) - connects_before, busy = sum(&LoadCounters::busy) - busy_before,
                 hinted = sum(&LoadCounters::hinted) - hinted_before,
                 answered = sum(&LoadCounters::answered) - answered_before;
  std::cout << "storm: " << connects << " connects in " << seconds << " s; " << busy << " refused busy (" << hinted
            << " with retry_after_ms), " << answered << " lists answered\n";
  report("5 users reconnecting at once on busy", storm);
  EXPECT_GT(connects, 5000u) << "no storm";
  EXPECT_EQ(storm.failures, 0) << storm.first_failure;
  EXPECT_GE(storm.latencies_ms.size(), 50u);
  EXPECT_LT(storm.p99_ms(), 200.0);
  EXPECT_LT(storm.stalest_heartbeat_ns, 250'000'000u);
  EXPECT_EQ(hinted, busy) << "a refusal without a retry_after_ms";
  EXPECT_EQ(kill(daemon_, 0), 0);
}

TEST_F(ControlLoadTest, ARefusedUserIsToldWhenToComeBackAndHeldToIt) {
  // As a member of the group: all 16 connections a user may have, each
  // just served (so none is stalled and can be replaced), then a 17th,
  // again each time the daemon said it may come back.
  const std::string text = output_of_child([&] {
    if (setgroups(0, nullptr) != 0 || setgid(group()) != 0 || setuid(member(0)) != 0) return std::string();
    std::vector<std::unique_ptr<RawClient>> held;
    for (int i = 0; i < 16; ++i) held.push_back(std::make_unique<RawClient>(socket_path()));
    const auto refresh = [&] {
      for (const auto& c : held) {
        c->send_text("{\"op\":\"list\"}\n");
        c->read_line();
      }
    };
    json out = {{"hints", json::array()}};
    for (int round = 0; round < 5; ++round) {
      refresh();
      RawClient extra(socket_path());
      const json reply = json::parse(extra.read_line(), nullptr, false);
      out["hints"].push_back(reply.is_object() ? reply.value("retry_after_ms", 0) : -1);
      std::this_thread::sleep_for(std::chrono::milliseconds(out["hints"].back().get<int>() + 10));
    }
    refresh();
    {  // Refused (800 ms); a place is free at once, but it is not to come back yet.
      RawClient extra(socket_path());
      out["refused"] = extra.read_line();
    }
    held.pop_back();
    {
      RawClient early(socket_path());
      out["early"] = early.read_line();
    }
    const json early = json::parse(out["early"].get<std::string>(), nullptr, false);
    std::this_thread::sleep_for(
        std::chrono::milliseconds((early.is_object() ? early.value("retry_after_ms", 0) : 0) + 10));
    RawClient later(socket_path());
    later.send_text("{\"op\":\"list\"}\n");
    out["later"] = later.read_line();
    return out.dump();
  });
  const json out = json::parse(text, nullptr, false);
  ASSERT_TRUE(out.is_object()) << text;
  // Each refusal soon after the last back-off ended doubles it.
  EXPECT_EQ(out["hints"], json({50, 100, 200, 400, 800})) << text;
  EXPECT_EQ(code_of(out["refused"]), "busy") << text;
  const json early = json::parse(out["early"].get<std::string>(), nullptr, false);
  EXPECT_EQ(code_of(out["early"]), "busy") << text;
  EXPECT_NE(out["early"].get<std::string>().find("came back too soon"), std::string::npos) << text;
  EXPECT_GT(early.value("retry_after_ms", 0), 0) << text;
  EXPECT_LE(early.value("retry_after_ms", 0), 1600) << text;
  EXPECT_EQ(json::parse(out["later"].get<std::string>(), nullptr, false).value("ok", false), true) << text;
}

TEST_F(ControlTest, AReloadThatTakesAUsersAccessAwayRefusesItsOpenConnection) {
  std::string why;
  const std::optional<OtherUser> other = nobody_user(&why);
  if (!other) GTEST_SKIP() << why;
  write_config("control_group = \"" + other->group + "\"\n");
  start_daemon();
  // A member of the group connects and is served; it keeps the connection
  // open across a reload that drops the group; its next request is refused.
  int asked[2], go[2], out[2];
  ASSERT_EQ(pipe(asked), 0);
  ASSERT_EQ(pipe(go), 0);
  ASSERT_EQ(pipe(out), 0);
  const pid_t child = fork();
  if (child == 0) {
    close(asked[0]);
    close(go[1]);
    close(out[0]);
    if (setgroups(0, nullptr) != 0 || setgid(other->gid) != 0 || setuid(other->uid) != 0) _exit(1);
    RawClient c(socket_path());
    c.send_text("{\"op\":\"list\"}\n");
    std::string text = c.read_line() + "\n";
    char byte = 1;
    if (write(asked[1], &byte, 1) == 1 && read(go[0], &byte, 1) == 1) {
      c.send_text("{\"op\":\"list\"}\n");
      text += c.read_line() + "\n";
      text += c.closed() ? "closed" : "open";
    }
    if (write(out[1], text.data(), text.size()) < 0) _exit(1);
    _exit(0);
  }
  close(asked[1]);
  close(go[0]);
  close(out[1]);
  char byte = 0;
  const bool first_done = read(asked[0], &byte, 1) == 1;
  if (first_done) {
    write_config();
    kill(daemon_, SIGHUP);
    EXPECT_TRUE(eventually([&] { return log_contains("control API: group none"); })) << read_file(log_path_);
    EXPECT_EQ(write(go[1], &byte, 1), 1);
  }
  close(go[1]);
  std::string replies;
  char buf[4096];
  for (ssize_t n; (n = read(out[0], buf, sizeof buf)) > 0;) replies.append(buf, static_cast<size_t>(n));
  close(out[0]);
  close(asked[0]);
  waitpid(child, nullptr, 0);
  ASSERT_TRUE(first_done) << replies;
  std::istringstream lines(replies);
  std::string first, second, state;
  std::getline(lines, first);
  std::getline(lines, second);
  std::getline(lines, state);
  EXPECT_EQ(json::parse(first, nullptr, false).value("ok", false), true) << replies;
  EXPECT_EQ(code_of(second), "denied") << replies;
  EXPECT_EQ(state, "closed") << replies;
}

TEST_F(ControlTest, FracgpuTenantCommands) {
  start_daemon();
  std::string out;
  EXPECT_EQ(cli({"tenant", "create", "cli-1", "--gpu", kUuid1 + ":share=0.25:memory=2GiB:limit=0.5", "--annotation",
                 "pod=default/train"},
                &out),
            0)
      << out;
  EXPECT_NE(out.find("tenant \"cli-1\" created"), std::string::npos) << out;
  EXPECT_NE(out.find("0.25   0.5    2 GiB   pod=default/train"), std::string::npos) << out;
  EXPECT_EQ(policy_of("cli-1", kUuid1).memory_quota, 2 * kGiB);
  // The same again: unchanged, exit 0.
  EXPECT_EQ(cli({"tenant", "create", "cli-1", "--gpu", kUuid1 + ":share=0.25:memory=2GiB:limit=0.5", "--annotation",
                 "pod=default/train"},
                &out),
            0)
      << out;
  EXPECT_NE(out.find("already exists with this spec"), std::string::npos) << out;
  // Refused (4), with the field as the command line names it.
  EXPECT_EQ(cli({"tenant", "create", "cli-2", "--gpu", kUuid1 + ":share=1.5"}, &out), 4) << out;
  EXPECT_NE(out.find("gpus[0].share: 1.5 must be above 0 and at most 1.0 (one GPU) (gpus[0] is --gpu number 1) "
                     "[invalid]"),
            std::string::npos)
      << out;
  EXPECT_EQ(cli({"tenant", "create", "cli-2", "--gpu", kUuid0}, &out), 4) << out;  // whole GPU 0: alice holds half
  EXPECT_NE(out.find("[no_capacity]"), std::string::npos) << out;
  EXPECT_EQ(cli({"tenant", "create", "cli-2", "--gpu", kUuid1 + ":shares=1"}, &out), 64) << out;
  EXPECT_EQ(cli({"tenant", "create", "cli-2", "--gpu", kUuid1 + ":memory=lots"}, &out), 64) << out;
  EXPECT_EQ(cli({"tenant", "get", "nope"}, &out), 5) << out;
  EXPECT_EQ(cli({"tenant", "resize", "nope", "--gpu", kUuid1}, &out), 5) << out;

  EXPECT_EQ(cli({"tenant", "resize", "cli-1", "--gpu", kUuid1 + ":share=0.5"}, &out), 0) << out;
  EXPECT_EQ(policy_of("cli-1", kUuid1).share_ppm, 500'000u);

  EXPECT_EQ(cli({"tenant", "list"}, &out), 0) << out;
  EXPECT_NE(out.find("alice   config"), std::string::npos) << out;
  EXPECT_NE(out.find("cli-1   api"), std::string::npos) << out;
  EXPECT_EQ(cli({"tenant", "get", "cli-1", "--json"}, &out), 0) << out;
  const json got = json::parse(out, nullptr, false);
  EXPECT_EQ(got["ok"], true) << out;
  EXPECT_EQ(got["tenant"]["gpus"][0]["share"], 0.5) << out;
  EXPECT_EQ(cli({"tenant", "get", "nope", "--json"}, &out), 5) << out;
  EXPECT_EQ(json::parse(out, nullptr, false)["code"], "not_found") << out;

  // --priority: sent as asked, shown by create, get and list; anything
  // else is a usage error, refused before the daemon is asked.
  EXPECT_EQ(cli({"tenant", "create", "cli-3", "--gpu", kUuid1 + ":share=0.1", "--priority", "latency"}, &out), 0)
      << out;
  EXPECT_NE(out.find("PRIORITY"), std::string::npos) << out;
  EXPECT_NE(out.find("cli-3   api     active  latency"), std::string::npos) << out;
  EXPECT_EQ(cli({"tenant", "get", "cli-3", "--json"}, &out), 0) << out;
  EXPECT_EQ(json::parse(out, nullptr, false)["tenant"]["priority"], "latency") << out;
  // Another priority is another spec.
  EXPECT_EQ(cli({"tenant", "create", "cli-3", "--gpu", kUuid1 + ":share=0.1", "--priority", "batch"}, &out), 4)
      << out;
  EXPECT_NE(out.find("priority batch asked, latency held"), std::string::npos) << out;
  EXPECT_EQ(cli({"tenant", "create", "cli-4", "--gpu", kUuid1 + ":share=0.1", "--priority", "urgent"}, &out), 64)
      << out;
  EXPECT_NE(out.find("--priority"), std::string::npos) << out;
  EXPECT_EQ(cli({"tenant", "list"}, &out), 0) << out;
  EXPECT_NE(out.find("alice   config  active  normal"), std::string::npos) << out;
  EXPECT_EQ(cli({"tenant", "delete", "cli-3"}, &out), 0) << out;

  // fracgpu status shows where tenants come from.
  ASSERT_EQ(cli({"tenant", "resize", "cli-1", "--gpu", kUuid1 + ":share=0.5", "--annotation", "claim=abc"}, &out), 0);
  EXPECT_EQ(cli({"status"}, &out), 0) << out;
  EXPECT_NE(out.find("tenants of the control API (fracgpu tenant):"), std::string::npos) << out;
  EXPECT_NE(out.find("cli-1   active  claim=abc"), std::string::npos) << out;
  EXPECT_NE(out.find("named by its control API request"), std::string::npos) << out;
  EXPECT_EQ(cli({"status", "--json"}, &out), 0) << out;
  const json status = json::parse(out, nullptr, false);
  bool seen = false;
  for (const json& t : status["tenants"]) {
    if (t["name"] == "alice") {
      EXPECT_EQ(t["source"], "config");
    }
    if (t["name"] != "cli-1") continue;
    seen = true;
    EXPECT_EQ(t["source"], "api");
    EXPECT_EQ(t["state"], "active");
    EXPECT_EQ(t["annotations"]["claim"], "abc");
  }
  EXPECT_TRUE(seen) << out;

  EXPECT_EQ(cli({"tenant", "delete", "cli-1"}, &out), 0) << out;
  EXPECT_NE(out.find("tenant \"cli-1\" deleted"), std::string::npos) << out;
  EXPECT_EQ(cli({"tenant", "delete", "cli-1"}, &out), 0) << out;
  EXPECT_NE(out.find("nothing to delete"), std::string::npos) << out;

  stop_daemon();
  EXPECT_EQ(cli({"tenant", "list"}, &out), 1) << out;
  EXPECT_NE(out.find("cannot reach fracgpud"), std::string::npos) << out;
}

}  // namespace
