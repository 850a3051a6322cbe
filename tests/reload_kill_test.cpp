// fracgpud SIGKILLed at random instants of 100 policy changes: reloads, and
// starts with a changed config. Two configs alternate whose quotas and shares
// differ on every tenant, with tenants added and removed between them. After
// each kill, every tenant's policy in force, read through the accessor the
// interposer uses (ledger::read_gpu_table), must be entirely the old config's
// or entirely the new one's, and all tenants must agree; then the daemon is
// started again (it applies the config on disk) and the next change follows.
//
// Half the kills come after a random delay from the signal or the start.
// Writing the policies themselves takes tens of microseconds of a change's
// milliseconds, so the other half are aimed at it: the test watches the
// first tenant's policy (t00, the first the daemon writes) and kills at a
// random moment shortly after the first byte changes there (the bound adapts
// to what the kills find). If fewer than 3 kills of the 100 landed while the
// policies were being written, more aimed changes follow (up to 200 more).
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <map>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "config/config.h"
#include "controller_test_util.h"
#include "ledger.h"
#include "common/uuid.h"

using namespace fracgpu;
using namespace fracgpu::testing;
using namespace std::chrono_literals;
namespace fs = std::filesystem;

namespace {

constexpr uint64_t kGiB = 1ull << 30;
const std::string kUuid0 = "GPU-0e1d0000-0000-4000-8000-000000000000";
const std::string kUuid1 = "GPU-0e1d0000-0000-4000-8000-000000000001";
const std::string kDevices = "uuid=" + kUuid0 + ",name=Sim A,mem=80GiB;uuid=" + kUuid1 + ",name=Sim B,mem=80GiB";

std::vector<controller::DiscoveredGpu> node() {
  return {{0, kUuid0, "Sim A", 80 * kGiB}, {1, kUuid1, "Sim B", 80 * kGiB}};
}

// Tenants [first, last) each pinned to GPU i % 2 with share `gpus` and
// `limit`: A is t00..t15 at 0.05 / 0.2, B t04..t19 at 0.06 / 0.3, so every
// tenant's quota and share differ between them, t00..t03 exist only in A and
// t16..t19 only in B. Many tenants: the write phase of a change lasts long
// enough for random kills to land in it.
std::string config_text(const std::string& run_dir, int first, int last, const std::string& gpus,
                        const std::string& limit) {
  std::string text = "[daemon]\nrun_dir = \"" + run_dir +
                     "\"\nreap_interval_ms = 1000\nmetrics_address = \"off\"\nlog_level = \"info\"\n"
                     "[[gpu]]\nindex = 0\n[[gpu]]\nindex = 1\ncontext_memory = \"128MiB\"\n";
  for (int i = first; i < last; ++i) {
    char name[16];
    snprintf(name, sizeof name, "t%02d", i);
    text += std::string("[[tenant]]\nname = \"") + name + "\"\ngpus = " + gpus + "\nlimit = " + limit +
            "\ndevices = [" + std::to_string(i % 2) + "]\n";
  }
  return text;
}

struct Expected {
  std::string text;
  controller::NodeConfig config;
};

class ReloadKillTest : public ::testing::Test {
 protected:
  void SetUp() override {
    for (auto [first, last, gpus, limit] : {std::tuple{0, 16, "0.05", "0.2"}, std::tuple{4, 20, "0.06", "0.3"}}) {
      Expected e;
      e.text = config_text(run_dir_, first, last, gpus, limit);
      controller::ConfigResult r = controller::parse_config(e.text, "test.toml", node());
      ASSERT_TRUE(r.ok()) << r.errors[0].to_string();
      e.config = std::move(*r.config);
      for (const controller::Tenant& t : e.config.tenants) names_.insert(t.name);
      configs_.push_back(std::move(e));
    }
  }
  void TearDown() override { kill_and_reap(daemon_); }

  void write_config(int which) {
    write_file(config_path_ + ".tmp", configs_[which].text);
    fs::rename(config_path_ + ".tmp", config_path_);
  }

  pid_t spawn_daemon() {
    return spawn_logged({FRACGPUD_PATH, "--config", config_path_}, log_path_,
                        {std::string("LD_LIBRARY_PATH=") + SIMCUDA_DIR, "SIMCUDA_DEVICES=" + kDevices, "SIMCUDA_STATE"});
  }

  // Does `table` grant exactly what config `which` gives `name` (nothing if
  // the tenant is not in it)?
  bool matches(const ledger::GpuTable& table, const std::string& name, int which) const {
    const controller::NodeConfig& c = configs_[which].config;
    const controller::Tenant* tenant = c.find_tenant(name);
    size_t granted = 0;
    for (const ledger::GpuEntry& e : table.gpus) granted += e.state == ledger::kGpuGranted ? 1 : 0;
    if (tenant == nullptr) return granted == 0;
    if (granted != tenant->grants.size()) return false;
    for (const controller::Grant& g : tenant->grants) {
      const controller::ManagedGpu& gpu = c.gpus[g.gpu];
      const int entry = ledger::find_gpu(table, gpu.uuid_bytes.data());
      if (entry < 0) return false;
      const ledger::GpuEntry& e = table.gpus[entry];
      if (e.state != ledger::kGpuGranted || e.memory_quota != g.memory_quota || e.share_ppm != g.share_ppm ||
          e.limit_ppm != g.limit_ppm || e.context_memory != gpu.context_memory)
        return false;
    }
    return true;
  }

  struct Seen {
    int config = -1;           // 0 or 1: every tenant at that config; -1: a mix (or unreadable)
    std::string detail;        // per tenant, when not uniform
    bool torn_write = false;   // some tenant's copy not in force was being, or had been, written
    uint64_t generation = 0;
  };

  // What every tenant's processes see now, as the interposer reads it.
  Seen seen() const {
    Seen s;
    std::set<int> verdicts;
    for (const std::string& name : names_) {
      const std::string dir = run_dir_ + "/tenants/" + name;
      ledger::GpuTable table;  // no directory yet: nothing granted
      if (fs::exists(dir + "/policy")) {
        ledger::TenantLedger l;
        char err[256] = {};
        if (ledger::open_ledger(dir.c_str(), ledger::AccessMode::kReadOnly, nullptr, &l, err, sizeof err) !=
            ledger::LedgerError::kOk) {
          s.detail += name + ": cannot open: " + err + "\n";
          verdicts.insert(-1);
          continue;
        }
        ledger::read_gpu_table(l, &table);
        s.generation = table.generation;
        const uint64_t other_stamp = l.policy->copies[(table.generation + 1) & 1].stamp.load();
        if (other_stamp == ledger::kStampWriting || (other_stamp > table.generation && other_stamp != ledger::kStampRetired))
          s.torn_write = true;
        ledger::close_ledger(&l);
      }
      const bool a = matches(table, name, 0), b = matches(table, name, 1);
      const int verdict = a && !b ? 0 : b && !a ? 1 : -1;
      verdicts.insert(verdict);
      s.detail += name + ": " + (verdict == 0 ? "A" : verdict == 1 ? "B" : "neither") + "\n";
    }
    if (verdicts.size() == 1 && *verdicts.begin() >= 0) s.config = *verdicts.begin();
    return s;
  }

  // The policies' GPU tables as bytes: what a change writes.
  static std::string copies_of(const ledger::TenantLedger& l) {
    const auto* bytes = reinterpret_cast<const char*>(l.policy->copies);
    return std::string(bytes, sizeof l.policy->copies);
  }

  // Spins until t00's GPU tables differ from `before` (or 2 s pass).
  static void wait_for_change(const ledger::TenantLedger& t00, const std::string& before) {
    const auto* bytes = reinterpret_cast<const volatile char*>(t00.policy->copies);
    const auto deadline = std::chrono::steady_clock::now() + 2s;
    for (;;) {
      for (size_t i = 0; i < before.size(); ++i)
        if (bytes[i] != before[i]) return;
      if (std::chrono::steady_clock::now() > deadline) return;
    }
  }

  bool settled_at(int which, std::chrono::milliseconds timeout = 10s) {
    return eventually([&] { return seen().config == which; }, timeout);
  }

  // When the daemon commits after being signalled or spawned: the node
  // file's generation moves. Polled tightly; for calibrating kill delays.
  std::chrono::microseconds time_to_commit(const std::function<void()>& go) {
    ledger::NodeSegment* node = nullptr;
    int fd = -1;
    char err[256];
    EXPECT_EQ(ledger::open_node(run_dir_.c_str(), &node, &fd, err, sizeof err), ledger::LedgerError::kOk) << err;
    const uint64_t before = node->committed.load();
    const auto start = std::chrono::steady_clock::now();
    go();
    while (node->committed.load() == before && std::chrono::steady_clock::now() - start < 10s) {
    }
    const auto took = std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::steady_clock::now() - start);
    ledger::close_node(node, fd);
    return took;
  }

  TempDir tmp_;
  std::string run_dir_ = tmp_ / "run";
  std::string config_path_ = tmp_ / "fracgpud.toml";
  std::string log_path_ = tmp_ / "fracgpud.log";
  std::vector<Expected> configs_;
  std::set<std::string> names_;
  pid_t daemon_ = -1;
};

TEST_F(ReloadKillTest, EveryTenantSeesTheWholeOldPolicyOrTheWholeNewOne) {
  write_config(0);
  daemon_ = spawn_daemon();
  ASSERT_TRUE(settled_at(0)) << seen().detail << read_file(log_path_);

  // Calibrate: how long a reload and a start take until their commit.
  int current = 0;
  write_config(1);
  const auto reload_time = time_to_commit([&] { kill(daemon_, SIGHUP); });
  ASSERT_TRUE(settled_at(1)) << seen().detail;
  kill_and_reap(daemon_);
  write_config(0);
  const auto start_time = time_to_commit([&] { daemon_ = spawn_daemon(); });
  ASSERT_TRUE(settled_at(0)) << seen().detail;
  printf("reload to commit: %lld us; start to commit: %lld us\n", static_cast<long long>(reload_time.count()),
         static_cast<long long>(start_time.count()));

  std::mt19937_64 rng(0xc0ffee);
  // Random delays are drawn up to a bit past the commit; the bound follows
  // what the kills find, so both outcomes keep coming up on any machine.
  double window_us[2] = {reload_time.count() * 1.3, start_time.count() * 1.3};
  // Aimed kills: spins of this loop per microsecond, measured here.
  volatile uint64_t spin = 0;
  const auto spin_start = std::chrono::steady_clock::now();
  for (int k = 0; k < 10'000'000; ++k) spin = spin + 1;
  const double spins_per_us =
      1e7 / std::max<double>(1, std::chrono::duration_cast<std::chrono::microseconds>(
                                    std::chrono::steady_clock::now() - spin_start).count());
  ledger::TenantLedger t00;
  char err[256] = {};
  ASSERT_EQ(ledger::open_ledger((run_dir_ + "/tenants/t00").c_str(), ledger::AccessMode::kReadOnly, nullptr, &t00, err,
                                sizeof err),
            ledger::LedgerError::kOk)
      << err;
  double aim_us[2] = {40, 40};
  int outcomes[2][2] = {};  // [reload or start][old or new]
  int torn = 0;
  constexpr int kChanges = 100, kMinTorn = 3, kMaxChanges = 300;
  int changes = 0;
  for (int i = 0; i < kChanges || (torn < kMinTorn && i < kMaxChanges); ++i, ++changes) {
    const int next = 1 - current;
    const int mode = i % 4 == 3 ? 1 : 0;  // every fourth change: a start with the changed config
    const bool aimed = i % 2 == 1 || i >= kChanges;
    const auto delay = std::chrono::microseconds(static_cast<int64_t>(
        std::uniform_real_distribution<double>(0, aimed ? aim_us[mode] : window_us[mode])(rng)));
    const std::string before = copies_of(t00);
    if (mode == 0) {
      write_config(next);
      kill(daemon_, SIGHUP);
    } else {
      kill_and_reap(daemon_);
      write_config(next);
      daemon_ = spawn_daemon();
    }
    if (aimed) {
      wait_for_change(t00, before);
      for (int64_t k = 0; k < static_cast<int64_t>(delay.count() * spins_per_us); ++k) spin = spin + 1;
    } else {
      std::this_thread::sleep_for(delay);
    }
    kill_and_reap(daemon_);
    daemon_ = -1;

    const Seen s = seen();
    ASSERT_GE(s.config, 0) << "change " << i << (mode ? " (start)" : " (reload)") << ", killed after "
                           << delay.count() << " us: tenants see a mix:\n"
                           << s.detail;
    const bool got_new = s.config == next;
    ++outcomes[mode][got_new ? 1 : 0];
    torn += s.torn_write ? 1 : 0;
    if (!aimed) window_us[mode] *= got_new ? 0.95 : 1.05;
    if (aimed && !s.torn_write) aim_us[mode] = std::clamp(aim_us[mode] * (got_new ? 0.8 : 1.25), 5.0, 2000.0);

    // Restart: the daemon applies the config on disk, the new one. Ready
    // once it heartbeats (until then a SIGHUP would kill it, not reload it).
    daemon_ = spawn_daemon();
    ASSERT_TRUE(settled_at(next)) << "change " << i << ": the restarted daemon did not apply it:\n"
                                  << seen().detail << read_file(log_path_);
    ASSERT_TRUE(eventually([&] { return t00.policy->daemon_pid.load() == daemon_; })) << read_file(log_path_);
    current = next;
  }
  printf("%d kills: reloads left %d old, %d new; starts left %d old, %d new; %d landed while copies were written\n",
         changes, outcomes[0][0], outcomes[0][1], outcomes[1][0], outcomes[1][1], torn);
  ledger::close_ledger(&t00);
  // Kills landed on both sides of the commit point, and some while the
  // policies were being written (else the test proved little).
  EXPECT_GT(outcomes[0][0] + outcomes[1][0], 0);
  EXPECT_GT(outcomes[0][1] + outcomes[1][1], 0);
  EXPECT_GT(torn, 0);
}

}  // namespace
