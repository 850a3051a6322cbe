// The daemon's GPU-time scheduler (controller/gpu_scheduler.h) on its own:
// a real arbiter file and real tenant ledgers in a scratch directory, tenant
// processes that hold their slots' record locks, requests written the way
// the interposer writes them (or the way a hostile tenant could), and
// scheduling passes driven with a made-up clock, so every decision is
// checked exactly. The end-to-end behaviour is in gputime_test.cpp.
#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <functional>
#include <map>
#include <set>
#include <string>
#include <thread>

#include <gtest/gtest.h>

#include "controller_test_util.h"
#include "daemon/gpu_scheduler.h"
#include "policy_util.h"
#include "gputime.h"
#include "ledger.h"
#include "sigbus_guard.h"

using namespace fracgpu;
using namespace fracgpu::controller;
using namespace fracgpu::testing;

namespace {

constexpr uint64_t kMs = 1'000'000;
constexpr uint8_t kUuid[16] = {0x5a, 0x1c, 0x0d, 0xe0, 0, 0, 0x40, 0, 0x80, 0, 0, 0, 0, 0, 0, 1};

// A meter with made-up figures: each process's GPU time grows at its duty
// (a fraction of real time) between readings; `fail` makes readings fail;
// `extra` is added once to the next reading, as is.
struct FakeMeterState {
  std::map<uint32_t, double> duty;
  std::map<uint32_t, uint64_t> extra;
  bool fail = false;
  std::string problem;  // why, while `fail`
  std::string warning;  // what the log should say about good readings
  uint64_t last = 0;
  int reads = 0;
  // Driver samples handed over as they are (pid, busy, instant), once; and
  // the sampling period the meter says it sees.
  std::vector<ProcessUse> samples;
  uint64_t period = 0;
  // The device's own busy share (device_busy()); negative: no such figure.
  double device_duty = -1;
  uint64_t device_ns = 0;
  // Run at each reading: what a tenant's process does while the daemon's
  // pass waits on the driver.
  std::function<void()> during_read;
};

class FakeMeter final : public UsageMeter {
 public:
  explicit FakeMeter(FakeMeterState* state) : state_(state) {}
  bool read(uint64_t now, std::vector<ProcessUse>* out) override {
    ++state_->reads;
    if (state_->during_read) state_->during_read();
    if (state_->fail) return false;
    const uint64_t dt = state_->last == 0 ? 0 : now - state_->last;
    state_->last = now;
    state_->device_ns = static_cast<uint64_t>(std::max(state_->device_duty, 0.0) * static_cast<double>(dt));
    for (const auto& [pid, duty] : state_->duty)
      if (duty > 0) out->push_back({pid, static_cast<uint64_t>(duty * static_cast<double>(dt))});
    for (const auto& [pid, ns] : state_->extra) out->push_back({pid, ns});
    state_->extra.clear();
    out->insert(out->end(), state_->samples.begin(), state_->samples.end());
    state_->samples.clear();
    return true;
  }
  uint64_t sample_period_ns() const override { return state_->period; }
  std::string problem() const override { return state_->fail ? state_->problem : std::string(); }
  std::string warning() const override { return state_->warning; }
  bool device_busy(uint64_t* busy_ns) override {
    if (state_->device_duty < 0) return false;
    *busy_ns = state_->device_ns;
    return true;
  }

 private:
  FakeMeterState* state_;
};

struct TenantFixture {
  std::string name;
  std::string dir;
  ledger::TenantLedger daemon;  // as fracgpud maps it (its usage fd is what the scheduler borrows)
  ledger::TenantLedger tenant;  // as the tenant's processes map it: requests are written through this
};

class SchedulerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    path_ = tmp_ / "gputime";
    char err[256] = {};
    ASSERT_EQ(gputime::open_arbiter(path_.c_str(), true, false, kUuid, &arbiter_, err, sizeof err),
              ledger::LedgerError::kOk)
        << err;
    // c: configured only by the tests that name it (configure_three).
    for (const char* name : {"a", "b", "c"}) {
      TenantFixture& t = tenants_.emplace_back();
      t.name = name;
      t.dir = tmp_ / name;
      ASSERT_EQ(ledger::open_ledger(t.dir.c_str(), ledger::AccessMode::kDaemon, name, &t.daemon, err, sizeof err),
                ledger::LedgerError::kOk)
          << err;
      ASSERT_EQ(fracgpu::testing::grant_gpu(t.daemon, kUuid, ledger::kUnlimited), 0);
      ASSERT_EQ(ledger::open_ledger(t.dir.c_str(), ledger::AccessMode::kTenant, nullptr, &t.tenant, err, sizeof err),
                ledger::LedgerError::kOk)
          << err;
    }
    now_ = gputime::monotonic_ns();
    sched_ = std::make_unique<GpuScheduler>(*arbiter_.seg, kUuid, "GPU 0");
    sched_->adopt(now_);
    configure(500'000, 500'000);
  }

  void TearDown() override {
    sched_.reset();
    for (const pid_t pid : processes_) kill_and_reap(pid);
    for (TenantFixture& t : tenants_) {
      ledger::close_ledger(&t.daemon);
      ledger::close_ledger(&t.tenant);
    }
    gputime::close_arbiter(&arbiter_);
  }

  void configure(uint32_t a_limit, uint32_t b_limit, uint32_t a_priority = gputime::kPriorityNormal,
                 uint32_t b_priority = gputime::kPriorityNormal, uint64_t slice_ns = 20 * kMs) {
    sched_->configure({{"a", 500'000, a_limit, tenants_[0].daemon.usage_fd, 0, a_priority},
                       {"b", 500'000, b_limit, tenants_[1].daemon.usage_fd, 0, b_priority}},
                      slice_ns);
  }

  // Three tenants of equal shares (a third each), c of `c_priority`.
  void configure_three(uint32_t c_priority) {
    sched_->configure({{"a", 333'333, gputime::kPpm, tenants_[0].daemon.usage_fd, 0, gputime::kPriorityNormal},
                       {"b", 333'333, gputime::kPpm, tenants_[1].daemon.usage_fd, 0, gputime::kPriorityNormal},
                       {"c", 333'333, gputime::kPpm, tenants_[2].daemon.usage_fd, 0, c_priority}},
                      20 * kMs);
  }

  // Measured mode: a and b (normal) hold the GPU beside each other, then
  // keep it busy (no room), and c, configured with `c_priority`, asks.
  void two_hold_beside_each_other_then_c_asks(uint32_t c_priority) {
    configure_three(c_priority);
    uint32_t pa = 0, pb = 0, pc = 0;
    use_meter();
    const int a = spawn_attributed(0, &pa), b = spawn_attributed(1, &pb), c = spawn_attributed(2, &pc);
    meter_.duty[pa] = 0.3;
    meter_.duty[pb] = 0.3;
    want(0, a);
    want(1, b);
    for (int ms = 0; ms < 40 && !(holds(0) && holds(1)); ++ms) {
      pass(1 * kMs);
      follow(0, a);
      follow(1, b);
    }
    ASSERT_TRUE(holds(0) && holds(1)) << "a and b hold beside each other (busy 0.3 each: room)";
    meter_.duty[pa] = meter_.duty[pb] = 0.5;  // now no room
    for (int i = 0; i < 12; ++i) pass(1 * kMs);
    ASSERT_TRUE(holds(0) && holds(1));
    want(2, c);
    pass(1 * kMs);
  }

  // A live process of tenant t (index): it holds its slot's record lock.
  // Returns its slot.
  int spawn(int t) {
    const pid_t pid = spawn_tenant_process(tenants_[t].dir, 0, 0, "proc");
    EXPECT_GT(pid, 0);
    processes_.push_back(pid);
    for (uint32_t s = 0; s < ledger::kMaxSlots; ++s)
      if (tenants_[t].tenant.usage->slots[s].state.load() == ledger::kSlotLive &&
          tenants_[t].tenant.usage->slots[s].pid.load() == pid)
        return static_cast<int>(s);
    ADD_FAILURE() << "no slot";
    return 0;
  }

  ledger::GpuTimeRequest& request(int t, int slot) { return tenants_[t].tenant.usage->gputime[0][slot]; }

  // The process asks, as a waiting thread of it does.
  void want(int t, int slot) {
    request(t, slot).want_since_ns.store(now_);
    request(t, slot).poll_ns.store(now_);
  }

  // The process enters the grant its tenant holds (enter_grant, as the interposer does).
  bool enter(int t, int slot) {
    const uint64_t word = arbiter_.seg->tenants[t].grant.load();  // its tenant's own word
    if (!gputime::enter_grant(*arbiter_.seg, request(t, slot), word)) return false;
    request(t, slot).want_since_ns.store(0);
    request(t, slot).last_active_ns.store(now_);
    return true;
  }

  // A pass `advance_ns` from the last. Processes that entered a grant and
  // have not drained it report, as their pacers do, that they launched just
  // now; those that ask renew their want (all but `silent_` ones).
  // a's process holds the GPU (it entered the grant), b's asks, and a's
  // slice is over: the grant is being revoked. Returns its number.
  uint64_t hold_then_revoke(int a, int b) {
    want(0, a);
    pass();
    EXPECT_TRUE(enter(0, a));
    const uint64_t seq = gputime::grant_seq(word());
    want(1, b);
    pass(20 * kMs);
    EXPECT_EQ(state(), gputime::kGrantRevoking);
    return seq;
  }

  // Tenant a (limit 0.1) holds the GPU alone until its limit revokes it:
  // 60 ms at 0.1 is beyond the 50 ms burst.
  void hold_until_the_limit_revokes(int a) {
    want(0, a);
    pass();
    ASSERT_TRUE(enter(0, a));
    for (int i = 0; i < 60 && state_of(0) == gputime::kGranted; ++i) pass(1 * kMs);
    ASSERT_EQ(state_of(0), gputime::kGrantRevoking) << "a's limit revokes it";
  }

  // The scheduler's thread's passes over the next half second, and the most
  // it may run in that time (one per kMinPassIntervalNs).
  std::pair<uint64_t, double> passes_in_half_a_second() {
    const uint64_t before = sched_->passes();
    const auto t0 = std::chrono::steady_clock::now();
    std::this_thread::sleep_for(std::chrono::milliseconds(500));
    const uint64_t passes = sched_->passes() - before;
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    return {passes, seconds / (GpuScheduler::kMinPassIntervalNs / 1e9)};
  }

  void pass(uint64_t advance_ns = 0) {
    now_ += advance_ns;
    for (size_t t = 0; t < tenants_.size(); ++t) {
      // Guarded: a test may have truncated the file under us.
      shm::sigbus_guarded([&] {
        for (uint32_t s = 0; s < ledger::kMaxSlots; ++s) {
          if (silent_.count({static_cast<int>(t), static_cast<int>(s)}) != 0) continue;
          ledger::GpuTimeRequest& r = tenants_[t].tenant.usage->gputime[0][s];
          if (r.entered_grant.load() != 0 && r.entered_grant.load() != r.drained_grant.load())
            r.last_active_ns.store(now_);
          if (r.want_since_ns.load() != 0) r.poll_ns.store(now_);
        }
      });
    }
    sched_->pass(now_);
  }

  uint64_t word() const { return arbiter_.seg->grant.word.load(); }
  // Tenant t's own grant word, and its state.
  uint64_t word_of(int t) const { return arbiter_.seg->tenants[t].grant.load(); }
  uint32_t state_of(int t) const { return gputime::grant_state(word_of(t)); }
  bool holds(int t) const { return state_of(t) == gputime::kGranted; }
  // Measured mode: a fake meter, and the daemon's attribution of PIDs.
  void use_meter() {
    sched_->set_meter(std::make_unique<FakeMeter>(&meter_));
    sched_->set_measured_charging(true);
    meter_.last = now_;
  }
  // Measured mode with one attributed process of each tenant: their slots
  // in *a and *b, their PIDs in *pa and *pb.
  void measured_pair(int* a, int* b, uint32_t* pa, uint32_t* pb) {
    use_meter();
    *a = spawn_attributed(0, pa);
    *b = spawn_attributed(1, pb);
  }
  // a's process (slot a, PID pa) asks, is granted, enters, and keeps the
  // GPU busy `duty` of the time.
  void a_holds_at(int a, uint32_t pa, double duty) {
    meter_.duty[pa] = duty;
    want(0, a);
    pass();
    ASSERT_TRUE(holds(0));
    ASSERT_TRUE(enter(0, a));
  }
  // Held mode audited by a meter sampling every 167 ms, past the audit's
  // grace: a and b uncapped, each with one attributed process (slots *a and
  // *b, b's PID *pb), and b with kOutside too, a process outside the gate
  // alive for a second already; then a holds the GPU (its process entered).
  static constexpr uint32_t kOutside = 4'000'002;
  void pair_beside_a_process_outside_the_gate(int* a, int* b, uint32_t* pb) {
    configure(gputime::kPpm, gputime::kPpm);
    sched_->set_meter(std::make_unique<FakeMeter>(&meter_));
    meter_.period = 167 * kMs;
    meter_.last = now_;
    uint32_t pa = 0;
    *a = spawn_attributed(0, &pa);
    *b = spawn_attributed(1, pb);
    now_ += GpuScheduler::kAuditGraceNs;
    sched_->attribute({{tenants_[0].name, attributed_[0]}, {tenants_[1].name, {*pb, kOutside}}},
                      {{kOutside, {now_ - 1000 * kMs, 0}}});
    want(0, *a);
    pass(2 * kMs);
    ASSERT_TRUE(holds(0));
    ASSERT_TRUE(enter(0, *a));
  }
  // A process of tenant t, attributed to it: its slot; *pid its PID.
  int spawn_attributed(int t, uint32_t* pid) {
    const int slot = spawn(t);
    *pid = static_cast<uint32_t>(processes_.back());
    attributed_[t].push_back(*pid);
    reattribute();
    return slot;
  }
  // Tenant a alone on the GPU with no limit (its processes ungated), the
  // fake meter charging in `measured` mode or held.
  void configure_alone(bool measured) {
    sched_->configure({{"a", gputime::kPpm, gputime::kPpm, tenants_[0].daemon.usage_fd, 0, gputime::kPriorityNormal}},
                      20 * kMs);
    sched_->set_meter(std::make_unique<FakeMeter>(&meter_));
    sched_->set_measured_charging(measured);
    meter_.last = now_;
  }
  // Tenant a alone and ungated (a whole GPU, no limit), its process busy
  // 0.8 for 2 s; then b comes at half each (the tests below).
  void alone_ungated_then_a_neighbour(bool measured) {
    configure_alone(measured);
    uint32_t pa = 0, pb = 0;
    const int a = spawn_attributed(0, &pa);
    meter_.duty[pa] = 0.8;
    const uint64_t start = now_;
    for (int i = 0; i < 200; ++i) {
      pass(10 * kMs);
      sched_->sample_achieved(now_);
    }
    EXPECT_EQ(arbiter_.seg->daemon.active_tenants.load(), 1u);
    EXPECT_EQ(row(0).slices.load(), 0u) << "never granted: ungated";
    EXPECT_NEAR(static_cast<double>(row(0).used_ns.load()), 0.8 * static_cast<double>(now_ - start), 20.0 * kMs)
        << "charged what it used";
    EXPECT_NEAR(row(0).achieved_1s_ppm.load(), 800'000, 20'000);
    EXPECT_NEAR(row(0).achieved_10s_ppm.load(), 800'000, 20'000);
    // b comes, at half each: both are gated now and ask. a's 1.6 s alone
    // must not make it wait while b catches up.
    configure(gputime::kPpm, gputime::kPpm);
    const int b = spawn_attributed(1, &pb);
    uint64_t a_held = 0, b_held = 0;
    for (int ms = 0; ms < 1000; ++ms) {
      meter_.duty[pa] = holds(0) ? 1.0 : 0.0;
      meter_.duty[pb] = holds(1) ? 1.0 : 0.0;
      want(0, a);
      want(1, b);
      pass(1 * kMs);
      follow(0, a);
      follow(1, b);
      a_held += holds(0) ? 1 : 0;
      b_held += holds(1) ? 1 : 0;
    }
    EXPECT_GE(a_held, 350u) << "b held the GPU for " << b_held << " of 1000 ms";
    EXPECT_GE(b_held, 350u) << "a held the GPU for " << a_held << " of 1000 ms";
  }
  // Tells the scheduler whose every attributed process is, as the daemon does.
  void reattribute() {
    std::map<std::string, std::vector<uint32_t>> by_tenant;
    for (const auto& [t, pids] : attributed_) by_tenant[tenants_[t].name] = pids;
    sched_->attribute(by_tenant);
  }
  // Enters tenant t's grant if it holds one and slot has not entered it;
  // reports a revoked grant drained.
  void follow(int t, int slot) {
    const uint64_t w = word_of(t);
    const uint64_t seq = gputime::grant_seq(w);
    if (gputime::grant_state(w) == gputime::kGranted && request(t, slot).entered_grant.load() != seq) enter(t, slot);
    if (gputime::grant_state(w) == gputime::kGrantRevoking && request(t, slot).drained_grant.load() != seq)
      gputime::report_drained(*arbiter_.seg, request(t, slot), seq);
  }
  bool granted_to(int row) const {
    return gputime::grant_state(word()) == gputime::kGranted && gputime::grant_row(word()) == static_cast<uint32_t>(row);
  }
  uint32_t state() const { return gputime::grant_state(word()); }
  const gputime::TenantTime& row(int t) const { return arbiter_.seg->tenants[t]; }

  TempDir tmp_;
  std::string path_;
  gputime::Arbiter arbiter_;
  std::vector<TenantFixture> tenants_;
  std::vector<pid_t> processes_;
  std::unique_ptr<GpuScheduler> sched_;
  uint64_t now_ = 0;
  std::set<std::pair<int, int>> silent_;  // (tenant, slot): a stopped process, renewing nothing
  FakeMeterState meter_;
  std::map<int, std::vector<uint32_t>> attributed_;
};

// The configured rows, in the order configured.
TEST_F(SchedulerTest, ConfigurationIsPublished) {
  EXPECT_EQ(gputime::find_tenant(*arbiter_.seg, "a"), 0);
  EXPECT_EQ(gputime::find_tenant(*arbiter_.seg, "b"), 1);
  EXPECT_EQ(row(0).state.load(), gputime::kTenantActive);
  EXPECT_EQ(row(0).share_ppm.load(), 500'000u);
  EXPECT_EQ(arbiter_.seg->daemon.active_tenants.load(), 2u);
  EXPECT_EQ(arbiter_.seg->daemon.slice_ns.load(), 20 * kMs);
  EXPECT_EQ(state(), gputime::kGrantIdle);
  pass();
  EXPECT_EQ(arbiter_.seg->daemon.daemon_heartbeat_ns.load(), now_);
}

// A tenant that asks is granted; it is charged the time it holds the GPU,
// its virtual time advancing by that over its share.
TEST_F(SchedulerTest, GrantsTheTenantThatAsksAndChargesTheTimeItHolds) {
  const int a = spawn(0);
  want(0, a);
  pass();
  ASSERT_TRUE(granted_to(0));
  EXPECT_EQ(row(0).slices.load(), 1u);
  ASSERT_TRUE(enter(0, a));
  pass(10 * kMs);
  EXPECT_TRUE(granted_to(0)) << "alone, it keeps the GPU";
  EXPECT_EQ(row(0).used_ns.load(), 10 * kMs);
  EXPECT_EQ(row(0).vtime.load(), 20 * kMs);
  EXPECT_EQ(row(1).used_ns.load(), 0u);
}

// At the end of its slice, with another tenant asking, the holder is
// revoked; the GPU goes on only once the process that entered the grant
// reports its drain. The holder pays until then; the other's wait counts
// as throttled.
TEST_F(SchedulerTest, ASliceEndsWithADrainHandshake) {
  const int a = spawn(0), b = spawn(1);
  want(0, a);
  pass();
  ASSERT_TRUE(enter(0, a));
  const uint64_t seq = gputime::grant_seq(word());
  want(1, b);
  pass(19 * kMs);
  EXPECT_TRUE(granted_to(0)) << "the slice is not over";
  pass(1 * kMs);
  EXPECT_EQ(state(), gputime::kGrantRevoking);
  EXPECT_EQ(gputime::grant_seq(word()), seq);
  pass(5 * kMs);
  EXPECT_EQ(state(), gputime::kGrantRevoking) << "a has not drained";
  gputime::report_drained(*arbiter_.seg, request(0, a), seq);
  pass(1 * kMs);
  EXPECT_TRUE(granted_to(1));
  EXPECT_GT(gputime::grant_seq(word()), seq);
  EXPECT_EQ(row(0).used_ns.load(), 26 * kMs) << "charged from grant to the end of its revocation";
  EXPECT_EQ(row(1).throttled_ns.load(), 26 * kMs);
  EXPECT_EQ(row(0).missed_deadlines.load(), 0u);
}

// A process that gave the grant back (its pacer found it idle, and reported
// it drained) and enters it again before the daemon's next pass, as its
// next launch does: its words then read entered G, drained G. That must not
// read as done: the next tenant waits for this process's drain.
TEST_F(SchedulerTest, AProcessThatEntersAGrantAgainAfterGivingItBackIsWaitedFor) {
  const int a = spawn(0), b = spawn(1);
  want(0, a);
  pass();
  ASSERT_TRUE(enter(0, a));
  const uint64_t seq = gputime::grant_seq(word_of(0));
  pass(1 * kMs);
  gputime::report_drained(*arbiter_.seg, request(0, a), seq);  // given back, idle
  ASSERT_TRUE(enter(0, a)) << "the grant is still a's";
  want(1, b);
  pass(1 * kMs);
  EXPECT_FALSE(holds(1)) << "b granted while a's process launches under grant " << seq;
  EXPECT_TRUE(holds(0)) << "a's process works on: its slice goes on";
  pass(20 * kMs);
  EXPECT_EQ(state_of(0), gputime::kGrantRevoking) << "the slice is over; a's process is to drain";
  gputime::report_drained(*arbiter_.seg, request(0, a), seq);
  pass(1 * kMs);
  EXPECT_TRUE(holds(1));
  EXPECT_EQ(row(0).missed_deadlines.load(), 0u);
}

// The holder's last process drains and nobody of it asks: the grant ends.
// But a second process of the tenant may enter the grant (a granted word
// needs no asking) after the pass has read the slots and before the word
// changes: here, while the pass reads the driver's figures. It is waited
// for, as if it had entered before the pass.
TEST_F(SchedulerTest, AProcessThatEntersTheGrantDuringThePassIsWaitedFor) {
  configure(gputime::kPpm, gputime::kPpm);
  sched_->set_meter(std::make_unique<FakeMeter>(&meter_));  // held mode, the driver read each pass
  meter_.period = 167 * kMs;
  meter_.last = now_;
  const int a1 = spawn(0), a2 = spawn(0), b = spawn(1);
  want(0, a1);
  pass(2 * kMs);
  ASSERT_TRUE(enter(0, a1));
  const uint64_t seq = gputime::grant_seq(word_of(0));
  pass(2 * kMs);
  ASSERT_TRUE(holds(0));
  want(1, b);
  gputime::report_drained(*arbiter_.seg, request(0, a1), seq);
  bool entered = false;
  meter_.during_read = [&] {
    if (!entered) entered = gputime::enter_grant(*arbiter_.seg, request(0, a2), word_of(0));
  };
  pass(2 * kMs);
  meter_.during_read = nullptr;
  ASSERT_TRUE(entered) << "the pass reads the driver before it decides";
  EXPECT_FALSE(holds(1)) << "b granted while a2 launches under grant " << seq;
  gputime::report_drained(*arbiter_.seg, request(0, a2), seq);
  pass(1 * kMs);
  EXPECT_TRUE(holds(1));
}

// A process of the holder exits, its slot is found dead, and a new process
// takes the slot at once and enters the grant (a granted word needs no
// asking): the slot's remembered "dead" must not hide it from the end of
// the grant.
TEST_F(SchedulerTest, ANewProcessInASlotJustFoundDeadIsWaitedFor) {
  const int a1 = spawn(0), b = spawn(1);
  want(0, a1);
  pass();
  ASSERT_TRUE(enter(0, a1));
  const uint64_t seq = gputime::grant_seq(word_of(0));
  const int a2 = spawn(0);
  want(0, a2);
  kill_and_reap(processes_.back());
  processes_.pop_back();
  pass(1 * kMs);  // a2's want is looked at: its slot is dead
  const int a3 = spawn(0);
  ASSERT_EQ(a3, a2) << "the new process takes the dead one's slot";
  ASSERT_TRUE(enter(0, a3));
  want(1, b);
  gputime::report_drained(*arbiter_.seg, request(0, a1), seq);
  pass(1 * kMs);
  EXPECT_FALSE(holds(1)) << "b granted while the new process launches under grant " << seq;
  gputime::report_drained(*arbiter_.seg, request(0, a3), seq);
  pass(1 * kMs);
  EXPECT_TRUE(holds(1));
}

// The holder's process enters the grant and is killed; a new process of the
// tenant takes its slot and does not enter (it waits, or uses the GPU only
// through NVML). The dead process's queued work went with it, and the new
// one has none under this grant: the grant ends at once when another asks,
// with no deadline missed. (Before: the slot stayed "seen to enter", so the
// new owner was waited for to the drain deadline, the tenant charged through
// it and blocked.)
TEST_F(SchedulerTest, ANewProcessInTheSlotOfOneThatEnteredAndDiedIsNotWaitedFor) {
  const int a1 = spawn(0), b = spawn(1);
  const pid_t a1_pid = processes_.front();
  want(0, a1);
  pass();
  ASSERT_TRUE(enter(0, a1));
  pass(1 * kMs);  // the scheduler sees a1 enter
  const uint64_t seq = gputime::grant_seq(word_of(0));
  kill_and_reap(a1_pid);
  processes_.erase(processes_.begin());
  const int a2 = spawn(0);
  ASSERT_EQ(a2, a1) << "the new process takes the dead one's slot";
  ASSERT_EQ(request(0, a2).entered_grant.load(), 0u);
  want(1, b);
  pass(1 * kMs);
  pass(1 * kMs);
  pass(1 * kMs);
  EXPECT_TRUE(holds(1)) << "b waits for a process that never entered grant " << seq;
  EXPECT_EQ(row(0).missed_deadlines.load(), 0u);
}

// A tenant's garbage in the words of all its dead slots (grant numbers
// from the future, nothing drained), rewritten every pass for a while: its
// grants end at the deadline while it goes on, since every rewritten slot
// is probed again and the probes a pass may make are few. Once it stops,
// the probes go round all 256 slots, not always to the first few while the
// last are never probed (and taken for alive): its next grant ends as soon
// as its one real process drains, well before the deadline. (Before: every
// grant of the tenant ran to the deadline for as long as it lived.)
TEST_F(SchedulerTest, GarbageInEveryDeadSlotStopsCostingItsTenantOnceItStops) {
  const int a = spawn(0), b = spawn(1);
  ledger::UsageSegment& u = *tenants_[0].tenant.usage;
  u.slot_high_water.store(ledger::kMaxSlots);
  for (int round = 0; round < 20; ++round) {
    for (uint32_t s = 0; s < ledger::kMaxSlots; ++s)
      if (static_cast<int>(s) != a) {
        u.gputime[0][s].entered_grant.store(uint64_t{1} << 40 | static_cast<uint64_t>(round));
        u.gputime[0][s].drained_grant.store(0);
      }
    pass(1 * kMs);
  }
  want(0, a);
  pass(1 * kMs);
  ASSERT_TRUE(enter(0, a));
  const uint64_t seq = gputime::grant_seq(word_of(0));
  pass(1 * kMs);
  want(1, b);
  gputime::report_drained(*arbiter_.seg, request(0, a), seq);
  const uint64_t deadline = gputime::kDrainDeadlineNs;
  uint64_t waited = 0;
  while (!holds(1) && waited < deadline) {
    pass(1 * kMs);
    waited += kMs;
  }
  EXPECT_TRUE(holds(1));
  EXPECT_LT(waited, deadline / 2) << "a's grant ran towards its deadline for slots no process holds";
  EXPECT_EQ(row(0).missed_deadlines.load(), 0u);
}

// A holder that truncates its usage file with its work still queued (its
// process entered and never drained) does not end its grant by it: its
// process is waited for to the deadline as before, and the tenant is then
// blocked, as any holder that misses one.
TEST_F(SchedulerTest, AHolderThatTruncatesItsUsageFileStillMissesItsDeadline) {
  const int a = spawn(0), b = spawn(1);
  want(0, a);
  pass();
  ASSERT_TRUE(enter(0, a));
  pass(5 * kMs);
  want(1, b);
  const std::string usage = tenants_[0].dir + "/" + ledger::kUsageFileName;
  ASSERT_EQ(truncate(usage.c_str(), 0), 0);
  pass(1 * kMs);
  EXPECT_EQ(state_of(0), gputime::kGrantRevoking) << "a's process is still to drain";
  EXPECT_FALSE(holds(1));
  pass(gputime::kDrainDeadlineNs);
  EXPECT_TRUE(holds(1)) << "the deadline ends it";
  EXPECT_EQ(row(0).missed_deadlines.load(), 1u);
  EXPECT_NE(row(0).flags.load() & gputime::kTenantBlocked, 0u);
}

// A process that entered the grant and died (its record lock gone) is not
// waited for.
TEST_F(SchedulerTest, ADeadProcessDoesNotHoldUpARevocation) {
  const int a = spawn(0), b = spawn(1);
  const pid_t a_pid = processes_[0];
  hold_then_revoke(a, b);
  kill_and_reap(a_pid);
  processes_.erase(processes_.begin());
  pass(2 * kMs);  // past the liveness probe's cache
  EXPECT_TRUE(granted_to(1));
  EXPECT_EQ(row(0).missed_deadlines.load(), 0u);
}

// Drains and entries of other grants than the current one count for
// nothing; a revocation not drained in time completes at the deadline, the
// holder pays through it, and is not granted again, though it asks, until
// the late process reports the drain.
TEST_F(SchedulerTest, AMissedDeadlineBlocksTheTenantUntilItShowsProgress) {
  const int a = spawn(0), b = spawn(1);
  const uint64_t seq = hold_then_revoke(a, b);
  // Claims about other grants: ignored.
  request(0, a).drained_grant.store(seq + 1);
  pass(50 * kMs);
  EXPECT_EQ(state(), gputime::kGrantRevoking);
  request(0, a).drained_grant.store(seq - 1);
  pass(49 * kMs);
  EXPECT_EQ(state(), gputime::kGrantRevoking);
  pass(1 * kMs);  // 100 ms: the deadline
  EXPECT_TRUE(granted_to(1));
  EXPECT_EQ(row(0).missed_deadlines.load(), 1u);
  EXPECT_EQ(row(0).used_ns.load(), 120 * kMs) << "charged through the deadline";
  EXPECT_TRUE(row(0).flags.load() & gputime::kTenantBlocked);
  // b leaves the GPU; a asks again (another of its processes, say): blocked.
  const int a2 = spawn(0);
  want(0, a2);
  ASSERT_TRUE(enter(1, b));
  gputime::report_drained(*arbiter_.seg, request(1, b), gputime::grant_seq(word()));
  request(1, b).want_since_ns.store(0);
  pass(1 * kMs);
  EXPECT_EQ(state(), gputime::kGrantIdle) << "a is blocked";
  pass(30 * kMs);
  EXPECT_EQ(state(), gputime::kGrantIdle);
  // Its late work ran all that time (on this driver without compute
  // preemption, ahead of b's): a pays for it until it reports the drain.
  EXPECT_EQ(row(0).used_ns.load(), 151 * kMs) << "charged for its late work";
  EXPECT_LE(row(1).used_ns.load(), gputime::kIdleNs) << "b's grant ran a's late work: b pays a hand-over's least";
  // Progress: the late process reports its drain.
  gputime::report_drained(*arbiter_.seg, request(0, a), seq);
  want(0, a2);
  pass(1 * kMs);
  EXPECT_FALSE(row(0).flags.load() & gputime::kTenantBlocked);
  EXPECT_EQ(row(0).used_ns.load(), 151 * kMs) << "nothing more once it reported the drain";
  // Granted again once its limit (0.5, 50 ms burst) allows 151 ms in 152.
  for (int i = 0; i < 200 && !granted_to(0); ++i) pass(1 * kMs);
  EXPECT_TRUE(granted_to(0));
}

// A grant nobody needs any more ends at once: the process that entered it
// reported its drain (as at exit) and nobody of the tenant asks.
// ... but a grant given up before kIdleNs costs kIdleNs: the hand-over it
// provokes idles the GPU for everyone, and a tenant reporting drains it has
// not done could otherwise provoke them as often as it likes.
TEST_F(SchedulerTest, AGrantGivenUpAtOnceCostsTheIdleTime) {
  const int a = spawn(0), b = spawn(1);
  want(0, a);
  want(1, b);
  pass();
  ASSERT_TRUE(granted_to(0));
  ASSERT_TRUE(enter(0, a));
  gputime::report_drained(*arbiter_.seg, request(0, a), gputime::grant_seq(word()));
  pass(1 * kMs);
  EXPECT_TRUE(granted_to(1));
  EXPECT_EQ(row(0).held_ns.load(), 1 * kMs);
  EXPECT_EQ(row(0).used_ns.load(), gputime::kIdleNs) << "held 1 ms, charged 2";
}

TEST_F(SchedulerTest, AGrantEndsAtOnceWhenItsProcessesAreDone) {
  const int a = spawn(0), b = spawn(1);
  want(0, a);
  pass();
  ASSERT_TRUE(enter(0, a));
  want(1, b);
  pass(1 * kMs);
  ASSERT_TRUE(granted_to(0));
  gputime::report_drained(*arbiter_.seg, request(0, a), gputime::grant_seq(word()));
  pass(1 * kMs);
  EXPECT_TRUE(granted_to(1));
}

// Times are clamped to the daemon's clock: a want or activity stamped in
// the future neither throttles nor makes a holder look busy past now; a
// want nobody renews stops counting; a tenant over its limit is revoked
// and not granted until its allowance is back.
TEST_F(SchedulerTest, ClaimsAreClampedAndStaleWantsStopCounting) {
  const int a = spawn(0), b = spawn(1);
  want(1, b);
  request(0, a).want_since_ns.store(UINT64_MAX);
  request(0, a).poll_ns.store(UINT64_MAX);
  pass();
  EXPECT_TRUE(granted_to(0)) << "equal virtual times: the earliest want (clamped to now) wins the tie";
  EXPECT_EQ(row(0).throttled_ns.load(), 0u) << "a want from the future throttles nothing";
  // Nobody of a enters; b waits: throttled the time since the last pass,
  // however early its want claims to be.
  request(1, b).want_since_ns.store(1);
  pass(3 * kMs);
  EXPECT_EQ(row(1).throttled_ns.load(), 3 * kMs);
  // Its slice over, a is revoked (nothing to drain) and b is served.
  pass(17 * kMs);
  EXPECT_TRUE(granted_to(1));
  ASSERT_TRUE(enter(1, b));
  gputime::report_drained(*arbiter_.seg, request(1, b), gputime::grant_seq(word()));
  request(1, b).want_since_ns.store(0);
  // a (stopped, say) no longer renews its want: 50 ms after its last
  // renewal it stops counting, and does not hold a grant it cannot take up.
  silent_.insert({0, a});
  request(0, a).poll_ns.store(now_);
  pass(1 * kMs);
  EXPECT_TRUE(granted_to(0));
  pass(48 * kMs);
  EXPECT_TRUE(granted_to(0)) << "alone, its want still fresh";
  pass(1 * kMs);
  EXPECT_EQ(state(), gputime::kGrantIdle) << "a's stale want no longer holds the GPU";
  EXPECT_EQ(row(0).flags.load() & gputime::kTenantWants, 0u);
}

TEST_F(SchedulerTest, ALimitRevokesTheHolderAndHoldsItBackUntilItsAllowanceReturns) {
  configure(300'000, 500'000);
  const int a = spawn(0);
  want(0, a);
  pass();
  ASSERT_TRUE(enter(0, a));
  // 30% of a GPU with a 50 ms burst (GCRA): t of GPU time costs t / 0.3 of
  // wall time from 50 ms before the grant, and the tenant may hold the GPU
  // while that is at most 50 ms ahead of now: -50 + t / 0.3 <= t + 50, so
  // up to 42.9 ms held from a fresh start.
  pass(42 * kMs);
  EXPECT_TRUE(granted_to(0));
  pass(1 * kMs);
  EXPECT_EQ(state(), gputime::kGrantRevoking) << "past its limit, alone";
  gputime::report_drained(*arbiter_.seg, request(0, a), gputime::grant_seq(word()));
  want(0, a);
  // 44 ms held: its allowance is back at 146.7 - 50 - 50 ms = 46.7 ms.
  pass(1 * kMs);
  EXPECT_EQ(state(), gputime::kGrantIdle) << "over its limit: the GPU idles";
  pass(2 * kMs);
  EXPECT_EQ(state(), gputime::kGrantIdle);
  pass(1 * kMs);
  EXPECT_TRUE(granted_to(0)) << "its allowance is back";
  EXPECT_EQ(row(0).used_ns.load(), 44 * kMs);
}

// A tenant that truncates its usage file cannot hurt the scheduler: reading
// it fails inside the SIGBUS guard and the tenant counts as not asking
// until the file is whole again.
TEST_F(SchedulerTest, ATruncatedUsageFileMeansNotAskingAndHurtsNobody) {
  const int a = spawn(0), b = spawn(1);
  want(1, b);
  const std::string usage = tenants_[1].dir + "/" + ledger::kUsageFileName;
  ASSERT_EQ(truncate(usage.c_str(), 0), 0);
  want(0, a);
  pass();
  EXPECT_TRUE(granted_to(0));
  ASSERT_TRUE(enter(0, a));
  pass(30 * kMs);
  EXPECT_TRUE(granted_to(0)) << "b does not ask: a keeps the GPU";
  EXPECT_EQ(row(1).flags.load() & gputime::kTenantWants, 0u);
  auto messages = sched_->take_messages();
  ASSERT_FALSE(messages.empty());
  EXPECT_NE(messages[0].text.find("usage file cannot be read"), std::string::npos) << messages[0].text;
  // Whole again (zeroed: its requests are gone); b asks again.
  ASSERT_EQ(truncate(usage.c_str(), sizeof(ledger::UsageSegment)), 0);
  tenants_[1].tenant.usage->slot_high_water.store(b + 1);
  tenants_[1].tenant.usage->slots[b].state.store(ledger::kSlotLive);
  want(1, b);
  pass(1 * kMs);
  EXPECT_TRUE(row(1).flags.load() & gputime::kTenantWants);
}

// A tenant that marks all its slots live and asking (no process behind
// them) costs the daemon a bounded number of liveness probes per pass, and
// the other tenant is served as before.
TEST_F(SchedulerTest, ATenantFakingAllItsSlotsCostsBoundedProbes) {
  const int b = spawn(1);
  ledger::UsageSegment& u = *tenants_[0].tenant.usage;
  u.slot_high_water.store(ledger::kMaxSlots);
  for (uint32_t s = 0; s < ledger::kMaxSlots; ++s) {
    u.slots[s].state.store(ledger::kSlotLive);
    want(0, static_cast<int>(s));
  }
  want(1, b);
  const uint64_t before = sched_->probes();
  for (int i = 0; i < 200; ++i) {
    pass(1 * kMs);
    // b takes up its grants, and asks again once revoked.
    if (granted_to(1) && request(1, b).entered_grant.load() != gputime::grant_seq(word())) enter(1, b);
    if (state() == gputime::kGrantRevoking && gputime::grant_row(word()) == 1) {
      gputime::report_drained(*arbiter_.seg, request(1, b), gputime::grant_seq(word()));
      want(1, b);
    }
  }
  const uint64_t probes = sched_->probes() - before;
  printf("200 passes with 256 faked slots: %llu probes; b held %.0f ms, a %.0f ms\n",
         static_cast<unsigned long long>(probes), row(1).used_ns.load() / 1e6, row(0).used_ns.load() / 1e6);
  EXPECT_LE(probes, 200u * 8 * 2) << "8 per tenant per pass (twice in a pass that starts a revocation)";
  // The grants a wastes are its own (charged to it): b keeps its half.
  EXPECT_GE(row(1).used_ns.load(), 90 * kMs);
}

// A restarted daemon keeps an earlier run's plausible figures, clamps the
// rest, starts with no holder under a grant number above the old one, and
// puts back a damaged header.
TEST_F(SchedulerTest, AdoptingAFileKeepsWhatIsPlausible) {
  const int a = spawn(0);
  want(0, a);
  pass();
  ASSERT_TRUE(enter(0, a));
  pass(10 * kMs);
  sched_.reset();
  const uint64_t old_seq = gputime::grant_seq(word());
  gputime::GpuTimeSegment& seg = *arbiter_.seg;
  seg.tenants[0].vtime.store(1'000 * kMs);
  seg.tenants[1].vtime.store(UINT64_MAX / 2);  // damaged: would starve b
  seg.tenants[1].used_ns.store(UINT64_MAX);    // more than the time since boot
  seg.header.magic = 0;
  sched_ = std::make_unique<GpuScheduler>(seg, kUuid, "GPU 0");
  sched_->adopt(now_);
  configure(500'000, 500'000);
  EXPECT_TRUE(gputime::header_valid(seg.header, kUuid));
  EXPECT_EQ(state(), gputime::kGrantIdle) << "no holder after a restart";
  EXPECT_GT(gputime::grant_seq(word()), old_seq);
  EXPECT_EQ(seg.tenants[0].used_ns.load(), 10 * kMs) << "kept";
  EXPECT_EQ(seg.tenants[1].used_ns.load(), 0u) << "implausible: reset";
  EXPECT_EQ(seg.tenants[0].vtime.load(), 1'000 * kMs);
  EXPECT_LE(seg.tenants[1].vtime.load(), 1'000 * kMs + 20'000 * kMs) << "at most 10 s (at its share) ahead";
}

// Root overwrites a live arbiter: the next pass puts everything back.
TEST_F(SchedulerTest, APassRepairsAnOverwrittenArbiter) {
  const int a = spawn(0);
  want(0, a);
  pass();
  ASSERT_TRUE(enter(0, a));
  const uint64_t before = word();
  memset(static_cast<void*>(arbiter_.seg), 0xa5, sizeof(gputime::GpuTimeSegment));
  pass(1 * kMs);
  EXPECT_TRUE(gputime::header_valid(arbiter_.seg->header, kUuid));
  EXPECT_EQ(word(), before);
  EXPECT_EQ(gputime::find_tenant(*arbiter_.seg, "a"), 0);
  EXPECT_EQ(row(0).state.load(), gputime::kTenantActive);
  EXPECT_EQ(arbiter_.seg->daemon.active_tenants.load(), 2u);
  EXPECT_EQ(arbiter_.seg->daemon.doorbell.load(), 0u);
  EXPECT_EQ(arbiter_.seg->daemon.daemon_heartbeat_ns.load(), now_);
}

// Issue requirement: a FUTEX_WAKE through a read-only mapping of the
// arbiter, by another user's process, wakes the daemon asleep on the
// doorbell (the kernel keys shared futexes by inode and offset, and a wake
// only reads the word). Without the wake the same sleep lasts its timeout.
TEST(GpuTimeDoorbell, AWakeThroughAReadOnlyMappingWakesTheDaemon) {
  TempDir tmp;
  const std::string path = tmp / "gputime";
  gputime::Arbiter rw;
  char err[256] = {};
  ASSERT_EQ(gputime::open_arbiter(path.c_str(), true, false, kUuid, &rw, err, sizeof err), ledger::LedgerError::kOk)
      << err;
  ASSERT_EQ(chmod(tmp.path().c_str(), 0755), 0);
  // Control: nobody rings, the sleep lasts its timeout.
  auto t0 = std::chrono::steady_clock::now();
  gputime::wait_for_doorbell(*rw.seg, 200 * kMs);
  EXPECT_GE(std::chrono::steady_clock::now() - t0, std::chrono::milliseconds(190));

  const pid_t child = fork();
  if (child == 0) {
    if (geteuid() == 0 && (setgid(65534) != 0 || setuid(65534) != 0)) _exit(10);
    gputime::Arbiter ro;
    if (gputime::open_arbiter(path.c_str(), false, true, kUuid, &ro, nullptr, 0) != ledger::LedgerError::kOk) _exit(11);
    usleep(300'000);
    gputime::ring_doorbell(*ro.seg);
    _exit(0);
  }
  t0 = std::chrono::steady_clock::now();
  gputime::wait_for_doorbell(*rw.seg, 10'000 * kMs);
  const auto slept = std::chrono::steady_clock::now() - t0;
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << status;
  EXPECT_LT(slept, std::chrono::seconds(3)) << "the wake did not reach the daemon's wait";
  EXPECT_GE(slept, std::chrono::milliseconds(250));
  EXPECT_EQ(rw.seg->daemon.doorbell.load(), 0u) << "a wake changes nothing";
  gputime::close_arbiter(&rw);
}

// A GPU nobody has asked for, held or (by the meter) used for a second is
// looked at every 100 ms instead of every 20 (every millisecond while
// someone asks): an idle node's scheduler threads wake ten times a second.
// The heartbeat, from which tenants tell the daemon is alive, stays well
// within kDaemonDownNs.
TEST_F(SchedulerTest, AGpuUnusedForASecondIsLookedAtLessOften) {
  configure(gputime::kPpm, gputime::kPpm);
  sched_->set_meter(std::make_unique<FakeMeter>(&meter_));
  meter_.last = now_;
  uint32_t pa = 0;
  const int a = spawn_attributed(0, &pa);
  static_assert(GpuScheduler::kQuietPassNs * 5 <= gputime::kDaemonDownNs);
  EXPECT_EQ(sched_->pass(now_), GpuScheduler::kIdlePassNs);
  now_ += GpuScheduler::kQuietAfterNs - kMs;
  EXPECT_EQ(sched_->pass(now_), GpuScheduler::kIdlePassNs) << "not a second yet";
  now_ += kMs;
  EXPECT_EQ(sched_->pass(now_), GpuScheduler::kQuietPassNs);
  // a's process asks, holds and gives the GPU back: a second from then.
  want(0, a);
  pass();
  ASSERT_TRUE(holds(0));
  ASSERT_TRUE(enter(0, a));
  EXPECT_EQ(sched_->pass(now_ += kMs), GpuScheduler::kLonePassNs);
  request(0, a).want_since_ns.store(0);
  gputime::report_drained(*arbiter_.seg, request(0, a), gputime::grant_seq(word_of(0)));
  for (int i = 0; i < 100 && state_of(0) != gputime::kGrantIdle; ++i) sched_->pass(now_ += kMs);
  ASSERT_EQ(state_of(0), gputime::kGrantIdle) << "a kept the GPU";
  const uint64_t released = now_;
  EXPECT_EQ(sched_->pass(now_ += kMs), GpuScheduler::kIdlePassNs);
  // Work the meter finds (a process outside the gate, an ungated tenant)
  // counts as use too.
  meter_.duty[pa] = 0.5;
  EXPECT_EQ(sched_->pass(now_ = released + GpuScheduler::kQuietAfterNs), GpuScheduler::kIdlePassNs);
  meter_.duty.clear();
  EXPECT_EQ(sched_->pass(now_ += GpuScheduler::kQuietAfterNs / 2), GpuScheduler::kIdlePassNs);
  EXPECT_EQ(sched_->pass(now_ += GpuScheduler::kQuietAfterNs / 2), GpuScheduler::kQuietPassNs);
  EXPECT_EQ(arbiter_.seg->daemon.daemon_heartbeat_ns.load(), now_);
}

// A lone holder that nobody waits for, uncapped, is looked at every 5 ms:
// the next tenant to ask rings the doorbell, and the scheduler looks every
// millisecond again while it waits (a slice's end, the holder's idle rule);
// so does a capped holder, whose limit is a rate the passes keep.
TEST_F(SchedulerTest, ALoneUncappedHolderIsLookedAtEveryFiveMilliseconds) {
  static_assert(GpuScheduler::kLonePassNs * 4 <= gputime::kLoneIdleNs);
  configure(gputime::kPpm, 300'000);
  const int a = spawn(0);
  want(0, a);
  pass();
  ASSERT_TRUE(holds(0));
  ASSERT_TRUE(enter(0, a));
  request(0, a).want_since_ns.store(0);
  EXPECT_EQ(sched_->pass(now_ += kMs), GpuScheduler::kLonePassNs) << "a alone";
  const int b = spawn(1);
  want(1, b);
  EXPECT_EQ(sched_->pass(now_ += kMs), GpuScheduler::kBusyPassNs) << "b waits";
  // a gives the GPU back: b's turn, and its limit caps it.
  gputime::report_drained(*arbiter_.seg, request(0, a), gputime::grant_seq(word_of(0)));
  for (int i = 0; i < 20 && !holds(1); ++i) sched_->pass(now_ += kMs);
  ASSERT_TRUE(holds(1)) << "b never got the GPU";
  ASSERT_TRUE(enter(1, b));
  request(1, b).want_since_ns.store(0);
  EXPECT_EQ(sched_->pass(now_ += kMs), GpuScheduler::kBusyPassNs) << "b alone, capped";
}

// Tenants ringing the doorbell as fast as they can make the scheduler run
// more passes, never more than one per 100 us.
TEST_F(SchedulerTest, RingingTheDoorbellCannotMakePassesMoreFrequentThanTheBound) {
  sched_->start();
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  const uint64_t idle_before = sched_->passes();
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  const uint64_t idle = sched_->passes() - idle_before;  // nobody asks: a pass per 20 ms
  std::atomic<bool> stop{false};
  std::thread ringer([&] {
    while (!stop.load()) gputime::ring_doorbell(*arbiter_.seg);
  });
  const auto [passes, bound] = passes_in_half_a_second();
  stop.store(true);
  ringer.join();
  printf("passes in 0.5 s: %llu idle, %llu while a tenant rings without pause (bound %.0f)\n",
         static_cast<unsigned long long>(idle), static_cast<unsigned long long>(passes),
         bound);
  EXPECT_LE(idle, 30u);
  EXPECT_GT(passes, 5 * idle) << "the rings do wake the scheduler";
  EXPECT_LE(passes, bound + 10);
  sched_->stop();
  EXPECT_EQ(arbiter_.seg->daemon.daemon_heartbeat_ns.load(), 0u) << "a clean stop says so";
}

// A tenant changing its requests without pause (here a claimed entered
// grant, counting up) makes the scheduler skip its sleeps, since each change
// could be a doorbell it missed: still never more than one pass per 100 us.
// The changes come from another CPU, as a ring the scheduler could miss
// does (a tenant on the scheduler's own CPU, which is real-time where it
// can be, changes nothing while a pass runs).
TEST_F(SchedulerTest, ChangingRequestsInALoopCannotMakePassesMoreFrequentThanTheBound) {
  cpu_set_t before_start;
  ASSERT_EQ(pthread_getaffinity_np(pthread_self(), sizeof before_start, &before_start), 0);
  std::vector<int> cpus;  // the first two this process may run on
  for (int c = 0; c < CPU_SETSIZE && cpus.size() < 2; ++c)
    if (CPU_ISSET(c, &before_start)) cpus.push_back(c);
  if (cpus.size() < 2) GTEST_SKIP() << "needs two CPUs";
  configure(gputime::kPpm, gputime::kPpm);
  const int a = spawn(0);
  auto pin = [](int cpu) {
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(cpu, &set);
    return pthread_setaffinity_np(pthread_self(), sizeof set, &set) == 0;
  };
  ASSERT_TRUE(pin(cpus[0]));
  sched_->start();  // its thread on the first CPU, as this one is now
  ASSERT_EQ(pthread_setaffinity_np(pthread_self(), sizeof before_start, &before_start), 0);
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  std::atomic<bool> stop{false};
  std::thread flipper([&] {
    if (!pin(cpus[1])) return;
    for (uint64_t i = 0; !stop.load(); ++i) request(0, a).entered_grant.store(1000 + i);
  });
  const auto [passes, bound] = passes_in_half_a_second();
  stop.store(true);
  flipper.join();
  sched_->stop();
  printf("passes in 0.5 s while a tenant flips its requests: %llu (bound %.0f)\n",
         static_cast<unsigned long long>(passes), bound);
  EXPECT_GT(passes, 150u) << "a changed request skips the sleep (idle: a pass per 20 ms)";
  EXPECT_LE(passes, bound + 10);
}

}  // namespace

// ---- Measured mode (a meter): share when there is room, enforce under contention ----

// A holder that leaves the GPU idle (measured busy below 0.9 over a full
// window) gets company: the waiting tenant is granted too, and both hold.
// Before the window is full, the holder alone is charged the time the other
// could not use (max(measured, held alone)); once both hold, each pays what
// it used.
TEST_F(SchedulerTest, MeasuredModeSharesTheGpuWhenTheHolderLeavesRoom) {
  uint32_t pa = 0, pb = 0;
  int a = 0, b = 0;
  measured_pair(&a, &b, &pa, &pb);
  a_holds_at(a, pa, 0.2);
  want(1, b);
  for (int i = 0; i < 9; ++i) {
    pass(1 * kMs);
    EXPECT_FALSE(holds(1)) << "no full window yet, ms " << i + 1;
  }
  EXPECT_EQ(arbiter_.seg->daemon.charging.load(), gputime::kChargeMeasured);
  EXPECT_NEAR(static_cast<double>(row(0).measured_ns.load()), 0.2 * 8 * kMs, 0.05 * kMs);
  EXPECT_GE(row(0).used_ns.load(), 8 * kMs) << "held alone while b waited: charged the time b could not use";
  pass(1 * kMs);
  pass(1 * kMs);
  EXPECT_TRUE(holds(0));
  EXPECT_TRUE(holds(1)) << "the GPU had room (busy 0.2): b is granted beside a";
  ASSERT_TRUE(enter(1, b));
  meter_.duty[pb] = 0.3;
  const uint64_t a_used = row(0).used_ns.load(), b_used = row(1).used_ns.load();
  for (int i = 0; i < 40; ++i) pass(1 * kMs);
  EXPECT_TRUE(holds(0) && holds(1)) << "no slice ends while both hold and neither leads";
  EXPECT_NEAR(static_cast<double>(row(0).used_ns.load() - a_used), 0.2 * 40 * kMs, 0.5 * kMs);
  EXPECT_NEAR(static_cast<double>(row(1).used_ns.load() - b_used), 0.3 * 40 * kMs, 0.5 * kMs);
  EXPECT_GT(row(0).held_ns.load(), 49 * kMs);
}

// A holder that keeps the GPU busy gets no company; at its slice's end the
// next tenant is granted at once, before the holder drained, and the
// holder's queued work that runs meanwhile is charged to it (measured).
TEST_F(SchedulerTest, MeasuredModeHandsOverAtOnceAndChargesTheTailToTheOutgoingHolder) {
  uint32_t pa = 0, pb = 0;
  int a = 0, b = 0;
  measured_pair(&a, &b, &pa, &pb);
  a_holds_at(a, pa, 1.0);
  want(1, b);
  for (int i = 0; i < 19; ++i) {
    pass(1 * kMs);
    EXPECT_FALSE(holds(1)) << "the GPU is busy: no room, ms " << i + 1;
  }
  pass(1 * kMs);
  EXPECT_EQ(state_of(0), gputime::kGrantRevoking);
  EXPECT_TRUE(holds(1)) << "granted at once, without waiting for a's drain";
  const uint64_t a_used = row(0).used_ns.load(), b_used = row(1).used_ns.load();
  ASSERT_TRUE(enter(1, b));
  for (int i = 0; i < 6; ++i) pass(1 * kMs);  // a's queued work runs 6 ms more
  EXPECT_NEAR(static_cast<double>(row(0).used_ns.load() - a_used), 6.0 * kMs, 0.1 * kMs) << "a pays for its tail";
  EXPECT_EQ(row(1).used_ns.load(), b_used) << "b ran nothing yet, and nobody waited: b pays nothing";
  EXPECT_EQ(state_of(0), gputime::kGrantRevoking) << "a has not drained: not granted again meanwhile";
}

// Fairness under contention is kept on measured time: a holder more than
// kLeadNs of GPU time ahead of the other is revoked and benched; it is
// granted again once its bench is over.
TEST_F(SchedulerTest, MeasuredModeRevokesATenantThatRunsAheadAndBenchesIt) {
  uint32_t pa = 0, pb = 0;
  int a = 0, b = 0;
  measured_pair(&a, &b, &pa, &pb);
  meter_.duty[pa] = 0.1;
  meter_.duty[pb] = 0.1;
  want(0, a);
  want(1, b);
  int ms = 0;
  for (; ms < 40 && !(holds(0) && holds(1)); ++ms) {
    pass(1 * kMs);
    follow(0, a);
    follow(1, b);
  }
  ASSERT_TRUE(holds(0) && holds(1)) << "both hold once the GPU shows room";
  meter_.duty[pa] = 0.9;
  int revoked_at = -1;
  for (int i = 0; i < 200 && revoked_at < 0; ++i) {
    pass(1 * kMs);
    if (state_of(0) != gputime::kGranted) revoked_at = i;
    follow(1, b);
  }
  ASSERT_GE(revoked_at, 0) << "a ran ahead without being revoked";
  const double lead = (static_cast<double>(row(0).vtime.load()) - static_cast<double>(row(1).vtime.load())) / 2;
  EXPECT_GT(lead, 50.0 * kMs) << "revoked once more than 50 ms of GPU time ahead";
  EXPECT_LT(lead, 55.0 * kMs);
  EXPECT_TRUE(holds(1));
  meter_.duty[pa] = 0;
  follow(0, a);  // a drains, and asks again
  want(0, a);
  for (int i = 0; i < 90; ++i) {
    pass(1 * kMs);
    follow(1, b);
    EXPECT_FALSE(holds(0)) << "benched, ms " << i + 1;
  }
  bool again = false;
  for (int i = 0; i < 40 && !again; ++i) {
    pass(1 * kMs);
    follow(1, b);
    again = holds(0);
  }
  EXPECT_TRUE(again) << "granted again after its bench";
}

// A limit is enforced on measured time: a tenant alone, capped at 0.3, that
// keeps the GPU busy only half the time it holds it, uses 0.3 of the GPU
// (charged by held time, it would use only 0.15).
TEST_F(SchedulerTest, MeasuredModeEnforcesALimitOnTimeUsed) {
  configure(300'000, 500'000);
  use_meter();
  uint32_t pa = 0;
  const int a = spawn_attributed(0, &pa);
  want(0, a);
  const uint64_t start_measured = row(0).measured_ns.load();
  pass();
  const uint64_t t0 = now_;
  for (int i = 0; i < 3000; ++i) {
    meter_.duty[pa] = state_of(0) != gputime::kGrantIdle ? 0.5 : 0.0;
    follow(0, a);
    want(0, a);
    pass(1 * kMs);
  }
  const double used = static_cast<double>(row(0).measured_ns.load() - start_measured) / static_cast<double>(now_ - t0);
  std::printf("capped at 0.3, busy half the time it holds the GPU: used %.3f of the GPU\n", used);
  EXPECT_NEAR(used, 0.3, 0.02);
}

// A sampling driver (the real NVML: a sample every ~1/6 s naming the process
// on the GPU at its instant) charges a whole period to the process it
// caught. A tenant capped at 0.3 that uses 0.2 (caught in one sample of
// five) must not stall after each catch (a 167 ms lump is 557 ms of its
// limit's time, beyond a 50 ms burst): the burst is two sample periods'
// worth. What it leaves unused within its grant is not banked beyond that
// burst; one caught in every sample it holds the GPU for is still held to
// 0.3 over time.
TEST_F(SchedulerTest, MeasuredModeOnASamplingDriverHoldsLimitsWithoutStallingAtEachSample) {
  configure(300'000, 500'000);
  use_meter();
  meter_.period = 167 * kMs;
  uint32_t pa = 0;
  const int a = spawn_attributed(0, &pa);
  auto run = [&](int seconds, auto caught) {
    const uint64_t t0 = now_, used0 = row(0).used_ns.load(), throttled0 = row(0).throttled_ns.load();
    int samples = 0;
    for (int ms = 1; ms <= seconds * 1000; ++ms) {
      follow(0, a);
      want(0, a);
      // A sample every 167 ms; it names a's process if it holds the GPU and
      // is caught this time.
      if (ms % 167 == 0 && holds(0) && caught(samples++)) meter_.samples.push_back({pa, 167 * kMs, now_});
      pass(1 * kMs);
    }
    sched_->sample_achieved(now_);
    return std::pair{static_cast<double>(row(0).used_ns.load() - used0) / static_cast<double>(now_ - t0),
                     static_cast<double>(row(0).throttled_ns.load() - throttled0) / static_cast<double>(now_ - t0)};
  };
  want(0, a);
  pass(1 * kMs);
  ASSERT_EQ(arbiter_.seg->daemon.charging.load(), gputime::kChargeMeasured);
  const auto [used, throttled] = run(10, [](int n) { return n % 5 == 0; });
  std::printf("caught in 1 sample of 5: used %.3f, throttled %.3f of the time\n", used, throttled);
  EXPECT_NEAR(used, 0.2, 0.02);
  EXPECT_LT(throttled, 0.02) << "it stalled at its limit, within it";
  // What it left unused within its one long grant is not banked beyond the
  // burst (two periods at 0.3: 1.11 s of its limit's time), give or take a
  // sample (the charge's own length, the time since the last catch): before
  // the floor moved with the clock, 4.4 s.
  EXPECT_GE(static_cast<int64_t>(row(0).cap_tat_ns.load()), static_cast<int64_t>(now_) - 1500 * static_cast<int64_t>(kMs))
      << "banked unused allowance";
  const auto [greedy, greedy_throttled] = run(60, [](int) { return true; });
  std::printf("caught whenever it holds the GPU: used %.3f, throttled %.3f\n", greedy, greedy_throttled);
  EXPECT_NEAR(greedy, 0.3, 0.03) << "the limit holds over time";
}

// What the scheduler believes of the meter and of tenants: a process's GPU
// time is charged to the tenant the daemon attributed its PID to (never to
// one whose usage file names it); usage measured before attribution is kept
// and charged once attributed; a reading larger than possible is clamped.
TEST_F(SchedulerTest, MeasuredModeChargesByTheDaemonsAttributionOnly) {
  use_meter();
  uint32_t pa = 0;
  const int a = spawn_attributed(0, &pa);
  const int b = spawn(1);
  const auto pb = static_cast<uint32_t>(processes_.back());
  // b's usage file claims a's process (the host_pid field is tenant-writable).
  tenants_[1].tenant.usage->slots[b].host_pid.store(static_cast<int32_t>(pa));
  meter_.extra[pa] = 3 * kMs;
  meter_.extra[pb] = 7 * kMs;  // not attributed yet
  pass(2 * kMs);
  pass(2 * kMs);
  EXPECT_EQ(row(0).measured_ns.load(), 3 * kMs);
  EXPECT_EQ(row(1).measured_ns.load(), 0u) << "not yet attributed";
  attributed_[1].push_back(pb);
  reattribute();
  pass(2 * kMs);
  EXPECT_EQ(row(1).measured_ns.load(), 7 * kMs) << "kept, and charged once attributed";
  meter_.extra[pa] = UINT64_MAX / 2;
  pass(2 * kMs);
  EXPECT_EQ(row(0).measured_ns.load(), 3 * kMs + 1'000'000'000) << "one reading is at most a second";
  (void)a;
}

// A meter that stops answering: after kMeterStaleNs the scheduler charges
// held time again, one holder at a time, and says so once, with the
// meter's reason; and once more when the meter answers again. (Before,
// nothing said why the audit was off.)
TEST_F(SchedulerTest, AFailingMeterFallsBackToHeldTimeAndOneHolder) {
  uint32_t pa = 0, pb = 0;
  int a = 0, b = 0;
  measured_pair(&a, &b, &pa, &pb);
  pass(2 * kMs);
  EXPECT_EQ(arbiter_.seg->daemon.charging.load(), gputime::kChargeMeasured);
  (void)sched_->take_messages();
  meter_.fail = true;
  meter_.problem = "its time stamps are on no clock this host has";
  meter_.duty[pa] = 0.1;
  for (int i = 0; i < 150; ++i) pass(1 * kMs);
  EXPECT_TRUE(sched_->take_messages().empty()) << "a failure shorter than kMeterStaleNs changes nothing: unsaid";
  for (int i = 0; i < 100; ++i) pass(1 * kMs);
  EXPECT_EQ(arbiter_.seg->daemon.charging.load(), gputime::kChargeHeld);
  auto messages = sched_->take_messages();
  ASSERT_EQ(messages.size(), 1u);
  EXPECT_TRUE(messages[0].warning);
  EXPECT_NE(messages[0].text.find("cannot be used (its time stamps are on no clock this host has): GPU time is charged "
                                  "as held and not audited"),
            std::string::npos)
      << messages[0].text;
  want(0, a);
  want(1, b);
  for (int i = 0; i < 30; ++i) {
    pass(1 * kMs);
    follow(0, a);
    follow(1, b);
    EXPECT_FALSE(holds(0) && holds(1)) << "held mode: one holder, ms " << i + 1;
  }
  EXPECT_TRUE(sched_->take_messages().empty()) << "said once";
  meter_.fail = false;
  pass(2 * kMs);
  messages = sched_->take_messages();
  ASSERT_EQ(messages.size(), 1u);
  EXPECT_FALSE(messages[0].warning);
  EXPECT_NE(messages[0].text.find("can be used again"), std::string::npos) << messages[0].text;
  // A meter's warning about readings it still makes: said once.
  meter_.warning = "time stamps on no clock this host has: each sample is placed at the time it is read";
  pass(2 * kMs);
  pass(2 * kMs);
  messages = sched_->take_messages();
  ASSERT_EQ(messages.size(), 1u);
  EXPECT_TRUE(messages[0].warning);
  EXPECT_NE(messages[0].text.find(meter_.warning), std::string::npos) << messages[0].text;
}

// A driver's sample time stamps are placed on the host clock they are near:
// the wall clock's (as drivers stamp them) or the monotonic one; near
// neither, none (0: NvmlMeter then places each sample at its reading).
TEST(StampClockTest, AStampIsPlacedOnTheClockItIsNear) {
  const auto us_of = [](clockid_t clock) {
    struct timespec ts {};
    clock_gettime(clock, &ts);
    return static_cast<unsigned long long>(ts.tv_sec) * 1'000'000ull + static_cast<unsigned long long>(ts.tv_nsec) / 1000;
  };
  const unsigned long long real = us_of(CLOCK_REALTIME), mono = us_of(CLOCK_MONOTONIC);
  const auto near = [](uint64_t now_ns, unsigned long long us) {
    const uint64_t ns = us * 1000;
    return (now_ns > ns ? now_ns - ns : ns - now_ns) < 5'000'000'000ull;
  };
  EXPECT_TRUE(near(stamp_clock_now_ns(real), real));
  EXPECT_TRUE(near(stamp_clock_now_ns(real - 3'600'000'000ull), real)) << "an hour old: still the wall clock";
  EXPECT_TRUE(near(stamp_clock_now_ns(mono), mono));
  EXPECT_TRUE(near(stamp_clock_now_ns(mono - 1'000'000ull), mono));
  EXPECT_EQ(stamp_clock_now_ns(real + 3'600'000'000ull), 0u) << "an hour in the future";
  EXPECT_EQ(stamp_clock_now_ns(real * 1000), 0u) << "ns taken for us";
  EXPECT_EQ(stamp_clock_now_ns(real / 2), 0u) << "decades ago";
}

// Held mode's audit (the default charging where a meter answers): a sample
// that finds a tenant's process on the GPU at an instant its tenant held no
// grant charges that tenant the sample's worth and gives it back to the
// tenant that held the GPU then; a sample inside the tenant's own grant
// changes nothing (its time is paid as held); a process the daemon has not
// attributed yet is filed, with its instant, once it is.
TEST_F(SchedulerTest, HeldModesAuditChargesWorkOutsideAGrantAndCreditsTheHolder) {
  sched_->set_meter(std::make_unique<FakeMeter>(&meter_));
  meter_.period = 167 * kMs;
  meter_.last = now_;
  uint32_t pa = 0;
  const int a = spawn_attributed(0, &pa);
  spawn(1);
  const auto pb = static_cast<uint32_t>(processes_.back());
  // Just after the scheduler starts, nothing is audited: processes have
  // not yet seen it (they run ungated while no daemon schedules).
  meter_.samples.push_back({pb, 40 * kMs, now_ + 1 * kMs});
  pass(2 * kMs);
  attributed_[1].push_back(pb);
  reattribute();
  pass(2 * kMs);
  EXPECT_EQ(row(1).out_of_grant_ns.load(), 0u) << "within the grace after the start";
  attributed_[1].clear();
  reattribute();
  now_ += GpuScheduler::kAuditGraceNs;
  const uint64_t before_grant = now_ + 1 * kMs;
  want(0, a);
  pass(2 * kMs);
  ASSERT_TRUE(holds(0));
  ASSERT_TRUE(enter(0, a));
  pass(10 * kMs);
  EXPECT_EQ(arbiter_.seg->daemon.charging.load(), gputime::kChargeHeld);
  EXPECT_EQ(arbiter_.seg->daemon.sample_period_ns.load(), 167 * kMs);
  EXPECT_EQ(row(0).used_ns.load(), 10 * kMs);
  // a's own process, inside a's grant: already paid as held.
  meter_.samples.push_back({pa, 100 * kMs, now_ - 5 * kMs});
  // b's process, not yet attributed, found on the GPU in a's grant.
  meter_.samples.push_back({pb, 150 * kMs, now_ - 4 * kMs});
  pass(2 * kMs);
  EXPECT_EQ(row(0).used_ns.load(), 12 * kMs) << "a sample in a's own grant changes nothing";
  EXPECT_EQ(row(1).out_of_grant_ns.load(), 0u) << "not attributed yet";
  attributed_[1].push_back(pb);
  reattribute();
  pass(2 * kMs);
  EXPECT_EQ(row(1).out_of_grant_ns.load(), 150 * kMs);
  EXPECT_EQ(row(1).out_of_grant_samples.load(), 1u);
  EXPECT_EQ(row(1).used_ns.load(), 150 * kMs) << "b pays for its work outside its grants";
  EXPECT_EQ(row(1).vtime.load(), 300 * kMs);
  EXPECT_EQ(row(0).used_ns.load(), 12 * kMs) << "a, which held the GPU then, gets it back from its next charges";
  for (int i = 0; i < 10; ++i) pass(10 * kMs);
  EXPECT_EQ(row(0).used_ns.load(), 12 * kMs) << "100 ms of a's holding paid by the credit";
  pass(60 * kMs);
  EXPECT_EQ(row(0).used_ns.load(), 24 * kMs) << "the credit (150 ms: 2 + 100 + 48 of holding) used up, a pays again";
  // A sample of b at an instant nobody held the GPU (before a's grant):
  // work then took no other tenant's turn, so nobody is credited; but no
  // grant at all covered its period, so what the GPU was busy beyond a
  // tenth of the period (the allowance for the period's ends) ran outside
  // every grant, and b, named, pays it.
  meter_.samples.push_back({pb, 50 * kMs, before_grant});
  pass(2 * kMs);
  EXPECT_EQ(row(1).out_of_grant_ns.load(), 150 * kMs + 50 * kMs - 167 * kMs / 10);
  EXPECT_EQ(row(0).used_ns.load(), 26 * kMs) << "nobody held the GPU then: nobody is credited";
}

// A process outside the gate that has exited (a chain of short-lived
// processes without the interposer): the daemon keeps its PID attributed
// with the span of its life, and only the samples within it are charged to
// its tenant; one after it is of another process behind the reused PID.
TEST_F(SchedulerTest, APidIsChargedOnlyForTheSamplesWithinItsProcesssLife) {
  sched_->set_meter(std::make_unique<FakeMeter>(&meter_));
  meter_.period = 167 * kMs;
  meter_.last = now_;
  uint32_t pa = 0;
  const int a = spawn_attributed(0, &pa);
  spawn(1);
  now_ += GpuScheduler::kAuditGraceNs;
  want(0, a);
  pass(2 * kMs);
  ASSERT_TRUE(holds(0));
  ASSERT_TRUE(enter(0, a));
  pass(10 * kMs);
  constexpr uint32_t kGone = 4'000'001;  // b's process without the interposer, exited
  const uint64_t born = now_ - 100 * kMs, gone = now_ - 2 * kMs;
  meter_.samples.push_back({kGone, 150 * kMs, now_ - 4 * kMs});  // in its life
  meter_.samples.push_back({kGone, 100 * kMs, now_ - 1 * kMs});   // after it: another process
  pass(2 * kMs);
  EXPECT_EQ(row(1).out_of_grant_ns.load(), 0u) << "not attributed yet";
  const std::map<std::string, std::vector<uint32_t>> by_tenant = {{tenants_[0].name, attributed_[0]},
                                                                  {tenants_[1].name, {kGone}}};
  sched_->attribute(by_tenant, {{kGone, {born, gone}}});
  pass(2 * kMs);
  EXPECT_EQ(row(1).out_of_grant_ns.load(), 150 * kMs);
  EXPECT_EQ(row(1).out_of_grant_samples.load(), 1u);
  const std::vector<uint32_t> left = sched_->unattributed_pids();
  EXPECT_NE(std::find(left.begin(), left.end(), kGone), left.end()) << "the later sample waits for its own process";
  // Read once the PID is attributed: the same rule, both ways.
  meter_.samples.push_back({kGone, 120 * kMs, now_ - 1 * kMs});
  meter_.samples.push_back({kGone, 130 * kMs, born - 1 * kMs});
  pass(2 * kMs);
  EXPECT_EQ(row(1).out_of_grant_ns.load(), 150 * kMs);
  EXPECT_EQ(row(1).out_of_grant_samples.load(), 1u);
}

// A tenant whose process outside the gate the driver names at work gives
// way to every tenant that asks: the holder keeps the GPU at its slice's
// end although the yielding tenant's virtual time is less, until
// kOutsideYieldPeriods sampling periods pass without such a sample. A
// sample naming a gated process of it in another's grant (a drain it did
// not do) is charged the same, but moves no turn.
TEST_F(SchedulerTest, ATenantWhoseProcessOutsideTheGateRunsInOthersGrantsGivesWayToThem) {
  int a = 0, b = 0;
  uint32_t pb = 0;
  ASSERT_NO_FATAL_FAILURE(pair_beside_a_process_outside_the_gate(&a, &b, &pb));
  // a holds alone for a second: its virtual time runs far ahead of b's.
  for (int i = 0; i < 100; ++i) pass(10 * kMs);
  // b's gated process named in a's grant: charged, but b still takes its turn.
  meter_.samples.push_back({pb, 20 * kMs, now_ - 4 * kMs});
  want(1, b);
  pass(2 * kMs);
  EXPECT_EQ(row(1).out_of_grant_ns.load(), 20 * kMs);
  for (int i = 0; i < 30 && !holds(1); ++i) {
    pass(1 * kMs);
    follow(0, a);
  }
  ASSERT_TRUE(holds(1)) << "a sample of a gated process moves no turn";
  ASSERT_TRUE(enter(1, b));
  pass(25 * kMs);
  follow(1, b);
  want(0, a);
  for (int i = 0; i < 30 && !holds(0); ++i) {
    pass(1 * kMs);
    follow(1, b);
  }
  ASSERT_TRUE(holds(0));
  ASSERT_TRUE(enter(0, a));
  // Now b's process outside the gate, named in a's grant, after a has
  // held alone long enough to be behind b again.
  for (int i = 0; i < 20; ++i) pass(10 * kMs);
  meter_.samples.push_back({kOutside, 20 * kMs, now_ - 4 * kMs});
  want(1, b);
  pass(2 * kMs);
  EXPECT_EQ(row(1).out_of_grant_ns.load(), 40 * kMs);
  ASSERT_LT(row(1).vtime.load(), row(0).vtime.load()) << "b would be next by virtual time";
  EXPECT_TRUE(row(1).flags.load() & gputime::kTenantYields) << "fracgpu status shows it";
  EXPECT_FALSE(row(0).flags.load() & gputime::kTenantYields);
  const uint64_t named = now_;
  const uint64_t yield_ns = GpuScheduler::kOutsideYieldPeriods * meter_.period;
  while (now_ - named + 10 * kMs < yield_ns) {
    pass(10 * kMs);
    follow(0, a);
    ASSERT_TRUE(holds(0)) << "a keeps the GPU " << (now_ - named) / kMs << " ms after the sample";
  }
  for (int i = 0; i < 40 && !holds(1); ++i) {
    pass(1 * kMs);
    follow(0, a);
  }
  EXPECT_TRUE(holds(1)) << "once the yield lapses, b takes its turn";
  EXPECT_FALSE(row(1).flags.load() & gputime::kTenantYields);
}

// A process outside the gate that NVML lists on the GPU takes the driver's
// turns in every holder's grant, whether or not a sample ever names it (one
// that stays off the GPU at the sampling instants never is): while it is
// listed, the holder pays its contexts' part of its grant (one of two here)
// and the listed process's tenant the rest; its own grants it pays whole.
// A sample naming that process in the holder's grant is counted, not
// charged again.
TEST_F(SchedulerTest, AListedProcessOutsideTheGatePaysItsPartOfEveryOtherHoldersGrant) {
  int a = 0, b = 0;
  uint32_t pb = 0;
  ASSERT_NO_FATAL_FAILURE(pair_beside_a_process_outside_the_gate(&a, &b, &pb));
  sched_->set_listed_outside({{"b", 1000}});
  const uint64_t a0 = row(0).used_ns.load(), b0 = row(1).used_ns.load();
  for (int i = 0; i < 100; ++i) {
    pass(10 * kMs);
    follow(0, a);
  }
  ASSERT_TRUE(holds(0));
  EXPECT_NEAR(static_cast<double>(row(0).used_ns.load() - a0), 500.0 * kMs, 25.0 * kMs) << "a pays half";
  EXPECT_NEAR(static_cast<double>(row(1).used_ns.load() - b0), 500.0 * kMs, 25.0 * kMs) << "b pays the rest";
  // A sample naming b's process in a's grant adds nothing to that.
  const uint64_t b1 = row(1).used_ns.load();
  meter_.samples.push_back({kOutside, 100 * kMs, now_ - 4 * kMs});
  pass(10 * kMs);
  follow(0, a);
  EXPECT_NEAR(static_cast<double>(row(1).used_ns.load() - b1), 5.0 * kMs, 1.0 * kMs);
  EXPECT_EQ(row(1).out_of_grant_samples.load(), 1u);
  // No longer listed: a pays its grant whole again.
  sched_->set_listed_outside({});
  const uint64_t a2 = row(0).used_ns.load(), b2 = row(1).used_ns.load();
  for (int i = 0; i < 50; ++i) {
    pass(10 * kMs);
    follow(0, a);
  }
  EXPECT_NEAR(static_cast<double>(row(0).used_ns.load() - a2), 500.0 * kMs, 15.0 * kMs);
  EXPECT_EQ(row(1).used_ns.load(), b2);
}

// A tenant that yields falls behind in virtual time while the others hold
// the GPU, since it is served only when nobody else asks. That lag is no
// debt: once its yield lapses it takes turns as a tenant back from idle
// does, and does not keep the GPU until it has caught up (it did: a tenant
// whose process outside the gate had yielded for seconds then held the
// GPU for as long again, its neighbour's work waiting).
TEST_F(SchedulerTest, ATenantThatYieldedHasNoLagToMakeUpOnceItStops) {
  int a = 0, b = 0;
  uint32_t pb = 0;
  ASSERT_NO_FATAL_FAILURE(pair_beside_a_process_outside_the_gate(&a, &b, &pb));
  // Both ask throughout, as saturating processes do.
  const auto step = [&](uint64_t ms) {
    for (const auto& [t, slot] : {std::pair{0, a}, std::pair{1, b}})
      if (!holds(t) && request(t, slot).want_since_ns.load() == 0) want(t, slot);
    pass(ms * kMs);
    follow(0, a);
    follow(1, b);
  };
  // 3 s in which b's process outside the gate is named in a's grants at
  // every sample: b yields, a holds.
  uint64_t held_by_a = 0, ms = 0;
  for (uint64_t next_sample = now_; ms < 3000; ++ms) {
    if (now_ >= next_sample) {
      meter_.samples.push_back({kOutside, 20 * kMs, now_ - 4 * kMs});
      next_sample += meter_.period;
    }
    step(1);
    held_by_a += holds(0);
  }
  EXPECT_GT(held_by_a, 2700u) << "b yields while its process outside the gate is at work";
  // Then no more samples of it: once the yield has lapsed, the next 2 s go
  // about half each.
  const uint64_t lapse = now_ + GpuScheduler::kOutsideYieldPeriods * meter_.period;
  while (now_ < lapse) step(1);
  held_by_a = 0;
  uint64_t held_by_b = 0;
  for (ms = 0; ms < 2000; ++ms) {
    step(1);
    held_by_a += holds(0);
    held_by_b += holds(1);
  }
  EXPECT_GT(held_by_a, 700u) << "b held " << held_by_b << " ms of 2000";
  EXPECT_GT(held_by_b, 700u) << "a held " << held_by_a << " ms of 2000";
}

// A tenant the audit credits (another tenant's work found in its grants)
// has its limit enforced with a burst of kOutsideYieldPeriods sampling
// periods, since such credits come a sample at a time; a tenant nobody
// credited keeps the tight burst. Both capped at 0.3: alone, a holder is
// revoked once it is a burst ahead, 0.7 of each ms held.
TEST_F(SchedulerTest, AnAuditCreditWidensOnlyThatTenantsLimitBurst) {
  configure(300'000, 300'000);
  sched_->set_meter(std::make_unique<FakeMeter>(&meter_));
  meter_.period = 100 * kMs;
  meter_.last = now_;
  uint32_t pa = 0, pb = 0;
  const int a = spawn_attributed(0, &pa);
  const int b = spawn_attributed(1, &pb);
  now_ += GpuScheduler::kAuditGraceNs;
  // How long tenant t holds the GPU alone before its limit revokes it.
  auto held_until_revoked = [&](int t, int slot) {
    int ms = 0;
    for (; ms < 2000 && state_of(t) == gputime::kGranted; ++ms) {
      pass(1 * kMs);
      follow(t, slot);
    }
    return ms;
  };
  want(0, a);
  pass(1 * kMs);
  ASSERT_TRUE(holds(0));
  ASSERT_TRUE(enter(0, a));
  pass(5 * kMs);
  // b's process named in a's grant: a is credited (1 ms, too little to
  // matter by itself).
  meter_.samples.push_back({pb, 1 * kMs, now_ - 1 * kMs});
  int ms = 1;
  for (; ms < 100 && row(1).out_of_grant_samples.load() == 0; ++ms) pass(1 * kMs);
  ASSERT_EQ(row(1).out_of_grant_samples.load(), 1u);
  const int credited = ms + held_until_revoked(0, a);
  const double wide = static_cast<double>(GpuScheduler::kOutsideYieldPeriods * meter_.period) * 0.3 / kMs;
  EXPECT_GT(credited, wide / 0.7 * 0.8) << "a's burst spans 8 periods at its limit: " << wide << " ms";
  // b, never credited, alone next: the 50 ms burst.
  for (int i = 0; i < 100 && !holds(1); ++i) {
    pass(1 * kMs);
    follow(0, a);
    if (state_of(1) == gputime::kGrantIdle && request(1, b).want_since_ns.load() == 0) want(1, b);
  }
  ASSERT_TRUE(holds(1));
  ASSERT_TRUE(enter(1, b));
  const int plain = held_until_revoked(1, b);
  EXPECT_LT(plain, 2 * gputime::kLimitBurstNs / kMs) << "b keeps the tight burst";
}

// While it yields, a tenant is granted a free GPU only once nobody else has
// held or asked for it for kYieldGapNs (a holder between two launches lets
// it go for a moment), and it gives the GPU up at once when another asks.
TEST_F(SchedulerTest, AYieldingTenantWaitsOutAGapForAFreeGpuAndGivesItUpAtOnce) {
  int a = 0, b = 0;
  uint32_t pb = 0;
  ASSERT_NO_FATAL_FAILURE(pair_beside_a_process_outside_the_gate(&a, &b, &pb));
  pass(10 * kMs);
  meter_.samples.push_back({kOutside, 20 * kMs, now_ - 4 * kMs});
  want(1, b);
  pass(2 * kMs);
  ASSERT_EQ(row(1).out_of_grant_samples.load(), 1u);
  // a's process drains and asks no more: its grant ends.
  gputime::report_drained(*arbiter_.seg, request(0, a), gputime::grant_seq(word_of(0)));
  pass(1 * kMs);
  ASSERT_FALSE(holds(0));
  const uint64_t freed = now_;
  while (now_ - freed + 2 * kMs < GpuScheduler::kYieldGapNs) {
    pass(1 * kMs);
    ASSERT_FALSE(holds(1)) << (now_ - freed) / kMs << " ms after a let the GPU go";
  }
  for (int i = 0; i < 5 && !holds(1); ++i) pass(1 * kMs);
  ASSERT_TRUE(holds(1)) << "nobody else asks: b is granted";
  ASSERT_TRUE(enter(1, b));
  pass(1 * kMs);
  want(0, a);
  pass(1 * kMs);
  EXPECT_EQ(state_of(1), gputime::kGrantRevoking) << "a asks: b gives the GPU up at once, before its slice ends";
}

// A tenant capped below the GPU, alone, is named by the driver's samples
// after its grant ended at its limit (a driver naming the process that ran
// last in each period does that): nobody else held the GPU since, so it is
// not charged again for work its grant paid for, as long as the GPU was
// busy in the period no longer than the grants there lasted. Busier, the
// difference ran outside every grant and is charged to it. Once another
// tenant holds the GPU, a sample naming it is work outside its grant, and
// charged whole.
TEST_F(SchedulerTest, HeldModesAuditChargesNothingNamedAfterItsGrantWhileNobodyElseHolds) {
  sched_->set_meter(std::make_unique<FakeMeter>(&meter_));
  meter_.period = 300 * kMs;
  meter_.last = now_;
  configure(100'000, 500'000);
  uint32_t pa = 0, pb = 0;
  const int a = spawn_attributed(0, &pa);
  const int b = spawn_attributed(1, &pb);
  now_ += GpuScheduler::kAuditGraceNs;
  pass(1 * kMs);
  pass(300 * kMs);  // the scheduler's record of grants reaches back over a whole period
  hold_until_the_limit_revokes(a);
  gputime::report_drained(*arbiter_.seg, request(0, a), gputime::grant_seq(word_of(0)));
  pass(1 * kMs);
  ASSERT_EQ(state_of(0), gputime::kGrantIdle);
  pass(50 * kMs);
  const uint64_t used = row(0).used_ns.load();
  const uint64_t held_in_period = row(0).held_ns.load();  // all of a's grant lies in the sample's period
  ASSERT_LE(held_in_period, 250 * kMs);
  meter_.samples.push_back({pa, held_in_period, now_});
  pass(3 * kMs);
  EXPECT_EQ(row(0).out_of_grant_ns.load(), 0u) << "named after its grant, nobody else holding, no busier than it held";
  EXPECT_EQ(row(0).used_ns.load(), used);
  // The same, with the GPU busy in the period for longer than any grant
  // covered (a's work ran on after its grant ended: a drain it reported and
  // did not do): what no grant accounts for, beyond a tenth of the period,
  // is a's, whichever process the driver names.
  meter_.samples.push_back({pa, held_in_period + 100 * kMs, now_ + 1 * kMs});
  pass(3 * kMs);
  EXPECT_NEAR(static_cast<double>(row(0).out_of_grant_ns.load()), static_cast<double>(100 * kMs - 30 * kMs),
              static_cast<double>(4 * kMs))
      << "the busy time beyond its grant, less the allowance";
  EXPECT_EQ(row(0).used_ns.load(), used + row(0).out_of_grant_ns.load());
  const uint64_t beyond = row(0).out_of_grant_ns.load();
  want(1, b);
  pass(1 * kMs);
  ASSERT_TRUE(holds(1));
  ASSERT_TRUE(enter(1, b));
  pass(5 * kMs);
  meter_.samples.push_back({pa, 60 * kMs, now_});
  pass(3 * kMs);
  EXPECT_EQ(row(0).out_of_grant_ns.load(), beyond + 60 * kMs) << "named while b holds: work outside its grant";
}

// ---- Priorities (docs/sm-time.md, "Latency tenants") ----

// A latency tenant within its share takes the GPU at once: the holder is
// revoked and the latency tenant granted in the same pass, without waiting
// for the drain; the holder pays until it has drained, the latency tenant
// from then on. While it is active, the others are asked to pace (1 ms
// queued), for 2 s after it last asked; its waits are published.
TEST_F(SchedulerTest, ALatencyTenantWithinItsShareTakesTheGpuAtOnce) {
  configure(500'000, 500'000, gputime::kPriorityNormal, gputime::kPriorityLatency);
  const int a = spawn(0);
  want(0, a);
  pass();
  ASSERT_TRUE(enter(0, a));
  EXPECT_EQ(arbiter_.seg->daemon.pace_inflight_ns.load(), GpuScheduler::kPaceInflightNs)
      << "no process of the latency tenant yet, but it was just configured";
  const int b = spawn(1);
  EXPECT_EQ(row(1).priority.load(), gputime::kPriorityLatency);
  pass(3 * kMs);
  want(1, b);
  pass(1 * kMs);
  EXPECT_EQ(state_of(0), gputime::kGrantRevoking) << "revoked 4 ms into its slice";
  EXPECT_TRUE(holds(1)) << "granted without waiting for a's drain";
  EXPECT_EQ(arbiter_.seg->daemon.pace_inflight_ns.load(), GpuScheduler::kPaceInflightNs);
  ASSERT_TRUE(enter(1, b));
  pass(1 * kMs);
  EXPECT_EQ(row(1).used_ns.load(), 0u) << "a's queued work still runs: a pays";
  gputime::report_drained(*arbiter_.seg, request(0, a), gputime::grant_seq(word_of(0)));
  pass(1 * kMs);
  EXPECT_EQ(state_of(0), gputime::kGrantIdle);
  EXPECT_EQ(row(0).used_ns.load(), 6 * kMs);
  pass(2 * kMs);
  EXPECT_EQ(row(1).used_ns.load(), 2 * kMs);
  sched_->sample_achieved(now_);
  EXPECT_EQ(row(1).waits.load(), 1u);
  EXPECT_EQ(row(1).wait_p50_ns.load(), 1 * kMs) << "asked a pass before its grant";
  EXPECT_EQ(row(0).waits.load(), 0u) << "a normal tenant's waits are not kept";
  // Its processes give the grant back; the GPU goes to a in the same pass.
  want(0, a);
  gputime::report_drained(*arbiter_.seg, request(1, b), gputime::grant_seq(word_of(1)));
  pass(1 * kMs);
  EXPECT_TRUE(holds(0));
  // The pace budget stays while the latency tenant has a live process,
  // asking or not (past its configuration's 60 s), and 2 s after its last
  // one is gone.
  ASSERT_TRUE(enter(0, a));
  pass(61'000 * kMs);
  EXPECT_EQ(arbiter_.seg->daemon.pace_inflight_ns.load(), GpuScheduler::kPaceInflightNs) << "b's process lives";
  kill_and_reap(processes_[1]);
  pass(11 * kMs);  // the first pass after the kill finds it dead
  pass(1980 * kMs);
  EXPECT_EQ(arbiter_.seg->daemon.pace_inflight_ns.load(), GpuScheduler::kPaceInflightNs);
  pass(20 * kMs);
  EXPECT_EQ(arbiter_.seg->daemon.pace_inflight_ns.load(), 0u);
}

// The same hand-over on a driver that time-slices contexts: while the
// revoked holder drains, the driver runs its work and the latency tenant's
// by turns, so the two split the time in equal parts (the driver's turns
// are per context, whatever the shares). Charged to the drainer alone, the
// overlap was the latency tenant's for free: a latency tenant that asked
// every few hundred microseconds took more than its share, the more so the
// slower the drains.
TEST_F(SchedulerTest, OnATimeSlicingGpuAHolderDrainingBesideALatencyTenantPaysHalf) {
  configure(500'000, 500'000, gputime::kPriorityNormal, gputime::kPriorityLatency);
  sched_->set_side_by_side(false, /*driver_time_slices=*/true);
  const int a = spawn(0), b = spawn(1);
  want(0, a);
  pass();
  ASSERT_TRUE(enter(0, a));
  pass(4 * kMs);
  want(1, b);
  pass(1 * kMs);
  ASSERT_EQ(state_of(0), gputime::kGrantRevoking);
  ASSERT_TRUE(holds(1));
  ASSERT_TRUE(enter(1, b));
  const uint64_t a_before = row(0).used_ns.load(), b_before = row(1).used_ns.load();
  pass(2 * kMs);
  pass(2 * kMs);
  EXPECT_EQ(row(0).used_ns.load() - a_before, 2 * kMs) << "half of the 4 ms of overlap";
  EXPECT_EQ(row(1).used_ns.load() - b_before, 2 * kMs) << "the latency tenant's turns while a drains";
  gputime::report_drained(*arbiter_.seg, request(0, a), gputime::grant_seq(word_of(0)));
  pass(1 * kMs);
  ASSERT_EQ(state_of(0), gputime::kGrantIdle);
  const uint64_t a_drained = row(0).used_ns.load(), b_drained = row(1).used_ns.load();
  pass(3 * kMs);
  EXPECT_EQ(row(0).used_ns.load(), a_drained) << "drained: nothing more";
  EXPECT_EQ(row(1).used_ns.load() - b_drained, 3 * kMs) << "alone on the GPU: all of it";
}

// A tenant that misses its drain deadline still has work on the GPU: on a
// driver that time-slices, its late work runs beside the next holder's by
// turns, so the two split that time until it reports the drain. Its hold
// stays open meanwhile, so a sample naming it then is not charged again
// (nor credited to the holder); past kOverdueChargeMaxNs it pays no more,
// and samples that find its work are the audit's again.
TEST_F(SchedulerTest, OnATimeSlicingGpuATenantPastItsDrainDeadlinePaysHalfUntilItReportsTheDrain) {
  configure(gputime::kPpm, gputime::kPpm);
  sched_->set_side_by_side(false, /*driver_time_slices=*/true);
  sched_->set_meter(std::make_unique<FakeMeter>(&meter_));
  meter_.period = 167 * kMs;
  meter_.last = now_;
  uint32_t pa = 0;
  const int a = spawn_attributed(0, &pa);
  const int b = spawn(1);
  now_ += GpuScheduler::kAuditGraceNs;
  auto late_drain = [&] {
    const uint64_t seq = hold_then_revoke(a, b);
    pass(100 * kMs);  // the deadline
    EXPECT_TRUE(granted_to(1));
    EXPECT_TRUE(row(0).flags.load() & gputime::kTenantBlocked);
    EXPECT_TRUE(enter(1, b));
    return seq;
  };
  const uint64_t seq = late_drain();
  const uint64_t a0 = row(0).used_ns.load(), b0 = row(1).used_ns.load();
  pass(10 * kMs);
  pass(10 * kMs);
  EXPECT_EQ(row(0).used_ns.load() - a0, 10 * kMs) << "half of b's 20 ms: a's late work ran beside b's";
  EXPECT_EQ(row(1).used_ns.load() - b0, 10 * kMs);
  // A sample naming a's process in b's grant: that work is paid already.
  meter_.samples.push_back({pa, 150 * kMs, now_ - 5 * kMs});
  pass(2 * kMs);
  EXPECT_EQ(row(0).out_of_grant_ns.load(), 0u) << "charged twice for its late work";
  EXPECT_EQ(row(1).used_ns.load() - b0, 11 * kMs) << "b credited for time a paid";
  gputime::report_drained(*arbiter_.seg, request(0, a), seq);
  pass(1 * kMs);
  EXPECT_FALSE(row(0).flags.load() & gputime::kTenantBlocked);
  const uint64_t a1 = row(0).used_ns.load(), b1 = row(1).used_ns.load();
  pass(10 * kMs);
  EXPECT_EQ(row(0).used_ns.load(), a1) << "drained: nothing more";
  EXPECT_EQ(row(1).used_ns.load() - b1, 10 * kMs);
  // a misses the deadline again, and never reports the drain: it pays for
  // at most kOverdueChargeMaxNs of late work.
  request(1, b).want_since_ns.store(0);
  gputime::report_drained(*arbiter_.seg, request(1, b), gputime::grant_seq(word()));
  pass(1 * kMs);
  ASSERT_EQ(state(), gputime::kGrantIdle);
  pass(200 * kMs);  // the turns start afresh
  late_drain();
  const uint64_t a2 = row(0).used_ns.load();
  for (int i = 0; i < 120; ++i) pass(10 * kMs);
  EXPECT_TRUE(row(0).flags.load() & gputime::kTenantBlocked);
  EXPECT_GE(row(0).used_ns.load() - a2, GpuScheduler::kOverdueChargeMaxNs / 2 - 10 * kMs);
  EXPECT_LE(row(0).used_ns.load() - a2, GpuScheduler::kOverdueChargeMaxNs / 2 + 10 * kMs);
  const uint64_t a3 = row(0).used_ns.load(), b3 = row(1).used_ns.load();
  pass(10 * kMs);
  EXPECT_EQ(row(0).used_ns.load(), a3) << "past the bound: no more";
  EXPECT_EQ(row(1).used_ns.load() - b3, 10 * kMs);
  // ... and a sample that finds its work then is the audit's again.
  meter_.samples.push_back({pa, 150 * kMs, now_ - 5 * kMs});
  pass(2 * kMs);
  EXPECT_EQ(row(0).out_of_grant_ns.load(), 150 * kMs);
  EXPECT_EQ(row(0).used_ns.load(), a3 + 150 * kMs);
}

// A latency tenant's queue protection starts when it is configured, not at
// its first process: a cluster starts its container seconds after the claim
// is prepared, and the others' queues must be gone by its first request.
// Without a process the budget goes after 60 s; an unchanged configuration
// does not start it again, a tenant newly given the priority does.
TEST_F(SchedulerTest, PacingStartsWhenALatencyTenantIsConfigured) {
  auto pace = [&] { return arbiter_.seg->daemon.pace_inflight_ns.load(); };
  pass(1 * kMs);
  EXPECT_EQ(pace(), 0u) << "no latency tenant";
  configure(500'000, 500'000, gputime::kPriorityNormal, gputime::kPriorityLatency);
  pass(1 * kMs);
  EXPECT_EQ(pace(), GpuScheduler::kPaceInflightNs) << "configured, no process yet";
  pass(59'000 * kMs);
  configure(500'000, 500'000, gputime::kPriorityNormal, gputime::kPriorityLatency);  // a reload, unchanged
  pass(998 * kMs);
  EXPECT_EQ(pace(), GpuScheduler::kPaceInflightNs);
  pass(2 * kMs);
  EXPECT_EQ(pace(), 0u) << "60 s without a process";
  configure(500'000, 500'000);  // b normal
  pass(1 * kMs);
  EXPECT_EQ(pace(), 0u);
  configure(500'000, 500'000, gputime::kPriorityLatency, gputime::kPriorityNormal);  // a given the priority
  pass(1 * kMs);
  EXPECT_EQ(pace(), GpuScheduler::kPaceInflightNs);
  configure(500'000, 500'000);  // and taken away again: nobody to protect
  pass(1 * kMs);
  EXPECT_EQ(pace(), 0u);
}

// Priority buys latency, not time: a latency tenant that has used more than
// its share while another tenant wanted the GPU (at its share's rate, with
// the limit's 50 ms burst) counts as normal and waits for the holder's
// slice to end, like anyone. (Slices of 1 s here, so that only priority
// can take the GPU from a holder.)
TEST_F(SchedulerTest, ALatencyTenantBeyondItsShareWaitsLikeANormalOne) {
  configure(gputime::kPpm, gputime::kPpm, gputime::kPriorityNormal, gputime::kPriorityLatency, 1000 * kMs);
  const int a = spawn(0), b = spawn(1);
  // b holds for 200 ms while a asks: 200 ms of GPU time at a 0.5 share is
  // 150 ms beyond it.
  want(1, b);
  pass();
  ASSERT_TRUE(enter(1, b));
  want(0, a);
  for (int i = 0; i < 200; ++i) pass(1 * kMs);
  ASSERT_TRUE(holds(1));
  // b stops; a takes the GPU.
  gputime::report_drained(*arbiter_.seg, request(1, b), gputime::grant_seq(word_of(1)));
  pass(1 * kMs);
  ASSERT_TRUE(holds(0));
  ASSERT_TRUE(enter(0, a));
  pass(1 * kMs);
  want(1, b);
  pass(1 * kMs);
  EXPECT_TRUE(holds(0)) << "b is beyond its share: no priority";
  EXPECT_EQ(state_of(1), gputime::kGrantIdle);
}

// GPU time a tenant used while nobody else wanted the GPU does not count
// against its share's rate: a normal tenant that had the GPU to itself for
// 200 ms is not beyond its share (as batch) when another normal tenant
// comes, so the newcomer does not take the GPU by priority (it waits for
// the slice's end, 1 s here).
TEST_F(SchedulerTest, TimeUsedWhileNobodyElseAskedDoesNotPutATenantBeyondItsShare) {
  configure(gputime::kPpm, gputime::kPpm, gputime::kPriorityNormal, gputime::kPriorityNormal, 1000 * kMs);
  const int a = spawn(0), b = spawn(1);
  want(0, a);
  pass();
  ASSERT_TRUE(enter(0, a));
  for (int i = 0; i < 200; ++i) pass(1 * kMs);
  want(1, b);
  pass(1 * kMs);
  EXPECT_TRUE(holds(0)) << "a is within its share: b has no priority over it";
  // Contended from now on: 100 ms more and a is beyond its share (0.5 of
  // 100 ms is 50 ms, plus the 50 ms burst): b takes the GPU by priority.
  for (int i = 0; i < 150 && holds(0); ++i) pass(1 * kMs);
  EXPECT_EQ(state_of(0), gputime::kGrantRevoking) << "a beyond its share while b asked";
}

// A tenant alone on a GPU with no limit below a whole one runs ungated and
// never holds a grant. It is charged what the meter measured (held mode
// too: held time would be none), so its achieved share shows the GPU time
// it used; but that time is no debt once a neighbour comes: the two take
// turns at once.
TEST_F(SchedulerTest, InHeldModeATenantAloneAndUngatedIsChargedWhatItUsedAndOwesNothingToANewcomer) {
  alone_ungated_then_a_neighbour(false);
}

TEST_F(SchedulerTest, InMeasuredModeATenantAloneAndUngatedOwesNothingToANewcomer) {
  alone_ungated_then_a_neighbour(true);
}

// The per-process samples name one process per period, the one on the GPU
// at its instant, and none when the GPU was idle then: a lone process busy
// 0.8 of the time is named for 0.64. The device's own figure counts every
// period; what the samples named other processes for (here one outside
// fracgpu, 0.05) is not the tenant's.
TEST_F(SchedulerTest, ATenantAloneAndUngatedIsChargedTheDevicesBusyTimeLessOtherProcesses) {
  for (const bool measured : {false, true}) {
    SCOPED_TRACE(measured ? "measured mode" : "held mode");
    const uint64_t used_before = row(0).used_ns.load();
    configure_alone(measured);
    uint32_t pa = 0;
    if (attributed_[0].empty()) spawn_attributed(0, &pa);
    pa = attributed_[0].front();
    constexpr uint32_t kStranger = 4'000'003;  // nobody's process
    meter_.duty[pa] = 0.64;
    meter_.duty[kStranger] = 0.05;
    meter_.device_duty = 0.85;
    const uint64_t start = now_;
    for (int i = 0; i < 100; ++i) pass(10 * kMs);
    EXPECT_NEAR(static_cast<double>(row(0).used_ns.load() - used_before), 0.8 * static_cast<double>(now_ - start),
                10.0 * kMs);
    EXPECT_EQ(row(0).measured_ns.load(), row(0).used_ns.load()) << "the figure measured mode shows, too";
    EXPECT_EQ(row(0).slices.load(), 0u) << "never granted: ungated";
  }
}

// A new process of the lone tenant's is somebody else's until the daemon
// attributes it: its first samples are taken off the device's figure, and
// added back once it is known to be the tenant's.
TEST_F(SchedulerTest, ANewProcessOfATenantAloneAndUngatedIsChargedOnceAttributed) {
  for (const bool measured : {false, true}) {
    SCOPED_TRACE(measured ? "measured mode" : "held mode");
    const uint64_t used_before = row(0).used_ns.load();
    configure_alone(measured);
    uint32_t pa = 0;
    spawn_attributed(0, &pa);
    spawn(0);
    const auto fresh = static_cast<uint32_t>(processes_.back());  // not attributed yet
    meter_.duty[pa] = 0.5;
    meter_.duty[fresh] = 0.3;
    meter_.device_duty = 0.8;
    const uint64_t start = now_;
    for (int i = 0; i < 20; ++i) pass(10 * kMs);
    EXPECT_NEAR(static_cast<double>(row(0).used_ns.load() - used_before), 0.5 * static_cast<double>(now_ - start),
                2.0 * kMs)
        << "the new process's samples are not the tenant's yet";
    attributed_[0].push_back(fresh);
    reattribute();
    for (int i = 0; i < 10; ++i) pass(10 * kMs);
    EXPECT_NEAR(static_cast<double>(row(0).used_ns.load() - used_before), 0.8 * static_cast<double>(now_ - start),
                4.0 * kMs)
        << "added back once attributed";
    EXPECT_EQ(row(0).vtime.load(), 0u) << "charged as used only";
    meter_.duty.clear();
    attributed_.clear();
    reattribute();
  }
}

// Measured charging too: a latency tenant within its share takes the GPU
// from a lone holder that keeps it busy (no room to grant it beside) at
// once, instead of waiting for the holder's slice to end or its lead.
TEST_F(SchedulerTest, InMeasuredModeALatencyTenantTakesTheGpuAtOnce) {
  configure(gputime::kPpm, gputime::kPpm, gputime::kPriorityNormal, gputime::kPriorityLatency);
  uint32_t pa = 0, pb = 0;
  int a = 0, b = 0;
  measured_pair(&a, &b, &pa, &pb);
  a_holds_at(a, pa, 1.0);
  pass(1 * kMs);
  want(1, b);
  pass(1 * kMs);
  EXPECT_EQ(arbiter_.seg->daemon.charging.load(), gputime::kChargeMeasured);
  EXPECT_EQ(state_of(0), gputime::kGrantRevoking) << "revoked 2 ms into its slice";
  EXPECT_TRUE(holds(1)) << "granted in the same pass";
}

// Measured mode lets two tenants hold the GPU beside each other while it
// has room; a latency tenant that asks then takes it from both at once (it
// does not wait for room, nor share the GPU's time-slicing with them),
// where a normal one waits for room beside them.
TEST_F(SchedulerTest, InMeasuredModeALatencyTenantTakesTheGpuFromHoldersBesideEachOther) {
  two_hold_beside_each_other_then_c_asks(gputime::kPriorityLatency);
  EXPECT_EQ(state_of(0), gputime::kGrantRevoking);
  EXPECT_EQ(state_of(1), gputime::kGrantRevoking);
  EXPECT_TRUE(holds(2)) << "granted in the same pass, before their drains";
}

TEST_F(SchedulerTest, InMeasuredModeANormalTenantWaitsForRoomBesideHolders) {
  two_hold_beside_each_other_then_c_asks(gputime::kPriorityNormal);
  EXPECT_TRUE(holds(0) && holds(1)) << "a normal tenant does not take the GPU from them";
  EXPECT_FALSE(holds(2)) << "no room beside them";
}

// A latency tenant that asks while the holder is already leaving (its
// limit reached, here) is granted at once too, not after the drain: the
// holder's gate is closed, and what the GPU still runs of it is its queue.
TEST_F(SchedulerTest, ALatencyTenantDoesNotWaitForTheDrainOfAHolderAlreadyLeaving) {
  configure(100'000, 500'000, gputime::kPriorityNormal, gputime::kPriorityLatency);
  const int a = spawn(0), b = spawn(1);
  hold_until_the_limit_revokes(a);
  want(1, b);
  pass(1 * kMs);
  EXPECT_EQ(state_of(0), gputime::kGrantRevoking) << "a has not drained";
  EXPECT_TRUE(holds(1)) << "the latency tenant does not wait for a's drain";
}

// A normal tenant does not take the GPU from a holder that is leaving before
// the holder drained (only a latency tenant does).
TEST_F(SchedulerTest, ANormalTenantWaitsForTheDrainOfAHolderLeavingAtItsLimit) {
  configure(100'000, 500'000);
  const int a = spawn(0), b = spawn(1);
  hold_until_the_limit_revokes(a);
  want(1, b);
  pass(1 * kMs);
  EXPECT_EQ(state_of(1), gputime::kGrantIdle) << "granted only after a's drain";
  gputime::report_drained(*arbiter_.seg, request(0, a), gputime::grant_seq(word_of(0)));
  pass(1 * kMs);
  EXPECT_TRUE(holds(1));
}

// A request made while a pass runs rings a doorbell nobody waits on: the
// scheduler's thread looks at the requests again before it sleeps, and
// does not sleep if one changed (an ask, an entry, a drain report).
TEST_F(SchedulerTest, ARequestMadeDuringAPassIsNotLeftForTheNextTimeout) {
  configure(gputime::kPpm, gputime::kPpm);
  const int a = spawn(0), b = spawn(1);
  pass();
  EXPECT_FALSE(sched_->requests_changed()) << "nothing asked since the pass";
  want(0, a);
  EXPECT_TRUE(sched_->requests_changed()) << "an ask";
  pass(1 * kMs);
  EXPECT_FALSE(sched_->requests_changed());
  ASSERT_TRUE(enter(0, a));
  EXPECT_TRUE(sched_->requests_changed()) << "an entry (and the want withdrawn)";
  pass(1 * kMs);
  request(0, a).poll_ns.store(now_ + 1);
  request(0, a).last_active_ns.store(now_ + 1);
  EXPECT_FALSE(sched_->requests_changed()) << "renewals need no pass of their own";
  want(1, b);
  EXPECT_TRUE(sched_->requests_changed()) << "another tenant's ask";
  pass(1 * kMs);
  gputime::report_drained(*arbiter_.seg, request(0, a), gputime::grant_seq(word_of(0)));
  EXPECT_TRUE(sched_->requests_changed()) << "a drain report";
  pass(1 * kMs);
  EXPECT_FALSE(sched_->requests_changed());
}

// A normal tenant within its share takes the GPU from a batch one at once,
// but (unlike a latency tenant) only once the batch tenant has drained.
TEST_F(SchedulerTest, ANormalTenantTakesTheGpuFromABatchOneAfterItsDrain) {
  configure(500'000, 500'000, gputime::kPriorityBatch, gputime::kPriorityNormal);
  const int a = spawn(0), b = spawn(1);
  want(0, a);
  pass();
  ASSERT_TRUE(enter(0, a));
  pass(2 * kMs);
  want(1, b);
  pass(1 * kMs);
  EXPECT_EQ(state_of(0), gputime::kGrantRevoking);
  EXPECT_EQ(state_of(1), gputime::kGrantIdle) << "granted only after the drain";
  gputime::report_drained(*arbiter_.seg, request(0, a), gputime::grant_seq(word_of(0)));
  pass(1 * kMs);
  EXPECT_TRUE(holds(1));
}

// ---- Side by side (held charging; docs/sm-time.md, "Side by side") ----

class SideBySideTest : public SchedulerTest {
 protected:
  // Held charging audited by a meter whose driver samples every 100 ms and
  // finds the GPU `util` busy over each period; tenants a and b, one
  // process each, both asking; side by side allowed on a GPU whose driver
  // time-slices (unless `slices` is false).
  void start(double util, bool slices = true) {
    sched_->set_meter(std::make_unique<FakeMeter>(&meter_));
    sched_->set_side_by_side(true, slices);
    meter_.last = now_;
    meter_.period = 100 * kMs;
    util_ = util;
    a_ = spawn_attributed(0, &pa_);
    b_ = spawn_attributed(1, &pb_);
    want(0, a_);
    want(1, b_);
  }
  // `ms` passes 1 ms apart. Each process enters its tenant's grant, drains
  // a revoked one, and asks again once it holds none (it always has work);
  // every 100 ms the driver's sample names a process of a holder.
  void run(int ms) {
    for (int i = 0; i < ms; ++i) {
      pass(1 * kMs);
      for (const auto& [t, slot] : std::vector<std::pair<int, int>>{{0, a_}, {1, b_}, {2, c_}}) {
        if (slot < 0) continue;
        bool draining = false;
        if (t < 2 && drain_ms_[t] > 0) {
          // A process whose queue takes drain_ms_ to run down reports the
          // drain only then, whether or not the revocation has ended. Its
          // launching thread asks again meanwhile.
          const uint64_t w = word_of(t);
          if (revoked_at_[t] == 0 && gputime::grant_state(w) == gputime::kGrantRevoking &&
              request(t, slot).drained_grant.load() != gputime::grant_seq(w)) {
            revoked_at_[t] = now_;
            revoked_seq_[t] = gputime::grant_seq(w);
          }
          if (revoked_at_[t] != 0 && now_ - revoked_at_[t] < static_cast<uint64_t>(drain_ms_[t]) * kMs) {
            draining = true;
          } else if (revoked_at_[t] != 0) {
            gputime::report_drained(*arbiter_.seg, request(t, slot), revoked_seq_[t]);
            revoked_at_[t] = 0;
          }
        }
        if (!draining) follow(t, slot);
        if (state_of(t) == gputime::kGrantIdle && request(t, slot).want_since_ns.load() == 0) want(t, slot);
      }
      if (++ticks_ % 100 == 0) {
        // Side by side the driver's equal turns put each process on the GPU
        // at about every other instant; a_share_ of them go to a's. A drain
        // runs the drainer's work.
        uint32_t pid = holds(0) || (state_of(0) == gputime::kGrantRevoking && !holds(1)) ? pa_ : pb_;
        if (together()) {
          side_named_a_ += a_share_;
          pid = side_named_a_ >= 1 ? pa_ : pb_;
          if (side_named_a_ >= 1) side_named_a_ -= 1;
        }
        // A dodger is never on the GPU at an instant: side by side the other
        // is named, and in the dodger's own turns the GPU is idle then (no
        // sample).
        if (dodger_ >= 0 && pid == (dodger_ == 0 ? pa_ : pb_)) {
          if (!together()) continue;
          pid = dodger_ == 0 ? pb_ : pa_;
        }
        const double util = side_util_ >= 0 && holds(0) && holds(1) ? side_util_ : util_;
        meter_.samples.push_back({pid, static_cast<uint64_t>(util * 100 * kMs), now_});
      }
    }
  }
  bool side_by_side(int t) const { return (row(t).flags.load() & gputime::kTenantSideBySide) != 0; }
  // `phases` times: the pair goes side by side after the measuring turns,
  // and stays so for the whole phase (nobody is barred meanwhile).
  void expect_whole_side_phases(int phases) {
    for (int phase = 0; phase < phases; ++phase) {
      ms_while(false, 2000);
      ASSERT_TRUE(together()) << phase;
      EXPECT_GE(ms_while(true, 30'000), static_cast<int>(GpuScheduler::kMinSidePhaseNs / kMs) - 150) << phase;
    }
  }
  bool together() { return holds(0) && holds(1); }
  bool takes_turns(int t) const { return (row(t).flags.load() & gputime::kTenantTakesTurns) != 0; }
  // a named at nine of ten instants side by side: found within the first
  // phase, it takes turns (and stays named so).
  void bar_a() {
    start(0.6);
    a_share_ = 0.9;
    ms_while(false, 2000);
    ASSERT_TRUE(together());
    ms_while(true, 30'000);
    ASSERT_TRUE(takes_turns(0));
  }
  // What the scheduler said since this was last asked, a line each.
  std::string messages() {
    std::string all;
    for (const SchedulerMessage& m : sched_->take_messages()) all += m.text + "\n";
    return all;
  }
  // Runs while the pair is (`side`) or is not side by side, `most` ms at
  // most; returns how long that was.
  int ms_while(bool side, int most) {
    int ms = 0;
    while (together() == side && ms < most) {
      run(1);
      ++ms;
    }
    return ms;
  }

  double util_ = 0;
  double side_util_ = -1;  // the GPU's busy share while both hold it, if not util_
  double a_share_ = 0.5;   // of the samples side by side, the part naming a's process
  int dodger_ = -1;        // a tenant never on the GPU at a sampling instant (0: a, 1: b)
  double side_named_a_ = 0;
  int drain_ms_[2] = {0, 0};  // how long a and b take to drain a revoked grant
  uint64_t revoked_at_[2] = {0, 0}, revoked_seq_[2] = {0, 0};
  int a_ = -1, b_ = -1, c_ = -1;
  uint32_t pa_ = 0, pb_ = 0;
  uint64_t ticks_ = 0;
};

// Two tenants that leave the GPU idle a third of the time while taking
// turns hold it side by side after a few sampling periods, each paying half
// of the time they hold it together (their default limits, the shares,
// allow that), until the phase ends and they take turns again to measure.
TEST_F(SideBySideTest, TenantsThatLeaveRoomInTurnsHoldTheGpuSideBySide) {
  start(0.6);
  run(250);
  EXPECT_FALSE(holds(0) && holds(1)) << "turns until two whole periods say there is room";
  run(200);
  ASSERT_TRUE(holds(0) && holds(1)) << "side by side after the periods measured";
  EXPECT_TRUE(side_by_side(0) && side_by_side(1));
  const uint64_t used_a = row(0).used_ns.load(), used_b = row(1).used_ns.load();
  run(1000);
  EXPECT_TRUE(holds(0) && holds(1)) << "a second later: still side by side (the 0.5 limits allow half each)";
  EXPECT_NEAR(static_cast<double>(row(0).used_ns.load() - used_a), 500.0 * kMs, 5.0 * kMs);
  EXPECT_NEAR(static_cast<double>(row(1).used_ns.load() - used_b), 500.0 * kMs, 5.0 * kMs);
  int side_ms = 1000;
  while (holds(0) && holds(1) && side_ms < 10'000) {
    run(1);
    ++side_ms;
  }
  EXPECT_NEAR(side_ms, GpuScheduler::kMinSidePhaseNs / kMs, 450) << "the phase ends: turns again";
  EXPECT_FALSE(side_by_side(0) || side_by_side(1));
  run(100);
  EXPECT_FALSE(holds(0) && holds(1)) << "turns, for the periods they are measured over";
}

// Tenants that stay light measure their turns less often: each phase that
// follows a measure finding room again is twice as long as the one before,
// up to four times the first (16 s here); the measuring turns last two
// whole periods after a mixed one. A measure that finds the GPU full (the
// tenants changed) sends them back to short phases.
TEST_F(SideBySideTest, TenantsThatStayLightHoldTheGpuSideBySideForLongerPhases) {
  start(0.6);
  ms_while(false, 2000);
  ASSERT_TRUE(together());
  const uint64_t first = GpuScheduler::kMinSidePhaseNs / kMs;
  for (const uint64_t expected : {first, 2 * first, 4 * first, 4 * first}) {
    EXPECT_NEAR(ms_while(true, 30'000), expected, 150);
    const int turns = ms_while(false, 2000);
    EXPECT_GE(turns, 200) << "two whole periods of turns at least";
    EXPECT_LE(turns, 400) << "and not more than three and a mixed one";
  }
  // Full turns, busier than side by side (the driver's switches): no room,
  // the next phase is the first's length again.
  util_ = 0.97;
  side_util_ = 0.94;
  ms_while(true, 30'000);
  run(1000);
  EXPECT_FALSE(together());
  util_ = 0.6;
  side_util_ = -1;
  ms_while(false, 2000);
  ASSERT_TRUE(together());
  EXPECT_NEAR(ms_while(true, 30'000), first, 150);
}

// Tenants that fill their turns gain nothing side by side (the driver's
// switches would cost them): they keep taking turns.
TEST_F(SideBySideTest, TenantsThatFillTheirTurnsKeepTakingTurns) {
  start(0.97);
  for (int i = 0; i < 20; ++i) {
    run(100);
    EXPECT_FALSE(holds(0) && holds(1)) << i;
  }
}

// A light tenant beside one that floods fills the turns (the flooder's
// side of them), but side by side the driver gives the light one's idle
// moments to the flooder at once: the GPU is as busy or busier so. After
// such a phase, a measure finding no room sends the pair back side by side,
// in longer phases; once the turns are busier than side by side by more
// than the margin (the driver's switches costing the pair), they take turns.
TEST_F(SideBySideTest, TenantsAsBusySideBySideAsInTurnsGoBackSideBySide) {
  start(0.6);
  side_util_ = 0.98;
  ms_while(false, 2000);
  ASSERT_TRUE(together()) << "room in turns: side by side";
  util_ = 0.93;  // the turns are full from now on
  const uint64_t first = GpuScheduler::kMinSidePhaseNs / kMs;
  for (const uint64_t expected : {first, 2 * first, 4 * first}) {
    EXPECT_NEAR(ms_while(true, 30'000), expected, 150);
    const int turns = ms_while(false, 2000);
    EXPECT_GE(turns, 200) << "two whole periods of turns measured";
    EXPECT_LE(turns, 400) << "then back side by side: it was busier than 0.93";
  }
  // Side by side now less busy than the turns: they take turns, and stay.
  side_util_ = 0.90;
  ms_while(true, 30'000);
  EXPECT_EQ(ms_while(false, 3000), 3000) << "turns at 0.93 are busier than 0.90 side by side";
}

// The same pair, the flooder now taking 250 ms to drain each revoked grant
// (its queue: past the drain deadline, so it is blocked until it reports).
// Blocked, it is still there: the light tenant holding meanwhile is no
// tenant alone, so the measure of turns and the side-by-side figure are
// kept, and the pair goes back side by side.
TEST_F(SideBySideTest, ATenantMissingItsDrainDeadlinesIsNoTenantLeftAlone) {
  start(0.6);
  side_util_ = 0.98;
  ms_while(false, 2000);
  ASSERT_TRUE(together());
  util_ = 0.93;
  drain_ms_[1] = 250;
  ms_while(true, 30'000);
  const uint32_t missed = row(1).missed_deadlines.load();
  EXPECT_LT(ms_while(false, 3000), 3000) << "back side by side: it was busier than the turns";
  EXPECT_GT(row(1).missed_deadlines.load(), missed) << "b missed its deadline in the turns";
}

// A tenant whose process is on the GPU at nine of ten sampling instants side
// by side (it set its own contexts' slice nine times the driver's) keeps
// the other to a tenth, where its turns before gave it half: the driver's
// turns are not equal. Within the first phase the scheduler finds the
// other short of what it used in turns, and the one named more takes
// turns from then on, though the turns leave room; the other is not
// barred. The other waits for its drains longer (1 s) before being granted
// beside its queue, of which it would take nine tenths. (The bar's end:
// TheBarEndsAfterItsTimeAndThePairSharesAgain.)
TEST_F(SideBySideTest, ATenantNamedBeyondItsPartWhileTheOtherIsKeptShortTakesTurns) {
  start(0.6);
  a_share_ = 0.9;
  ms_while(false, 2000);
  ASSERT_TRUE(together());
  EXPECT_FALSE(takes_turns(0));
  EXPECT_LT(ms_while(true, 30'000), static_cast<int>(GpuScheduler::kMinSidePhaseNs / kMs))
      << "found before the phase's end";
  EXPECT_TRUE(takes_turns(0)) << "fracgpu status shows it";
  EXPECT_FALSE(takes_turns(1)) << "the one kept short is not barred";
  for (int i = 0; i < 20; ++i) {
    run(100);
    EXPECT_FALSE(together()) << i << ": a takes turns";
  }
  // a's drains now take 250 ms, past the usual deadline: b is granted only
  // once a has drained (its queue would take most of the GPU beside b's
  // grant), and a pays for the drain alone.
  drain_ms_[0] = 250;
  const uint32_t missed = row(0).missed_deadlines.load();
  for (int i = 0; i < 3000 && state_of(0) != gputime::kGrantRevoking; ++i) run(1);
  ASSERT_EQ(state_of(0), gputime::kGrantRevoking);
  const uint64_t used_b = row(1).used_ns.load();
  run(200);
  EXPECT_EQ(state_of(0), gputime::kGrantRevoking) << "still draining, 200 ms on";
  EXPECT_FALSE(holds(1)) << "b waits for the drain";
  EXPECT_EQ(row(1).used_ns.load(), used_b) << "and pays none of it";
  run(100);
  EXPECT_TRUE(holds(1)) << "granted once a drained";
  EXPECT_EQ(row(0).missed_deadlines.load(), missed) << "a missed no deadline";
}

// The bar lasts kSideBarNs, not for good: a tenant that shows its part again
// shares again once it ends (after the measuring turns), and its flag goes.
TEST_F(SideBySideTest, TheBarEndsAfterItsTimeAndThePairSharesAgain) {
  ASSERT_NO_FATAL_FAILURE(bar_a());
  const uint64_t barred_at = now_;
  a_share_ = 0.5;
  const int bar_ms = static_cast<int>(GpuScheduler::kSideBarNs / kMs);
  EXPECT_EQ(ms_while(false, bar_ms - 1000), bar_ms - 1000) << "side by side before the bar's end";
  EXPECT_TRUE(takes_turns(0)) << "a second before the end";
  ms_while(false, 5000);
  ASSERT_TRUE(together()) << "still taking turns " << (now_ - barred_at) / kMs << " ms after the bar";
  EXPECT_GE(now_ - barred_at, GpuScheduler::kSideBarNs);
  EXPECT_FALSE(takes_turns(0)) << "fracgpu status no longer shows it";
}

// A tenant found again soon after its bar ends takes turns twice as long as
// before. (30 minutes of the fixture's clock, 9 s.)
TEST_F(SideBySideTest, ATenantFoundAgainSoonAfterItsBarTakesTurnsTwiceAsLong) {
  const int bar_ms = static_cast<int>(GpuScheduler::kSideBarNs / kMs);
  ASSERT_NO_FATAL_FAILURE(bar_a());
  std::string said = messages();
  EXPECT_NE(said.find("taking turns: \"a\" for 600 s\n"), std::string::npos) << said;
  // Still taking nine tenths: shares once the bar ends, and is found again.
  ms_while(false, bar_ms + 5000);
  ASSERT_TRUE(together()) << "the first bar did not end";
  ms_while(true, 30'000);
  ASSERT_TRUE(takes_turns(0));
  said = messages();
  EXPECT_NE(said.find("taking turns: \"a\" for 1200 s (found again within 3600 s of its last bar)\n"),
            std::string::npos)
      << said;
  a_share_ = 0.5;
  EXPECT_EQ(ms_while(false, 2 * bar_ms - 1000), 2 * bar_ms - 1000) << "turns for twice the first bar";
  EXPECT_TRUE(takes_turns(0));
  ms_while(false, 5000);
  EXPECT_TRUE(together()) << "the second bar did not end";
}

// A tenant that shares fairly for an hour after its bar, then takes nine
// tenths again, is found within the thousand samples the counts keep (58 s
// here), where counts that only grew made the hour's record a credit to
// spend: unfound for 30 minutes. And the hour past its bar, it is barred
// for the first bar's length again. (73 minutes of the fixture's clock,
// 23 s.)
TEST_F(SideBySideTest, AnHourOfFairSharingHidesNoLaterTakingAndClearsTheRecord) {
  ASSERT_NO_FATAL_FAILURE(bar_a());
  const uint64_t barred_at = now_;
  a_share_ = 0.5;
  run(static_cast<int>((GpuScheduler::kSideBarNs + GpuScheduler::kSideBarMemoryNs) / kMs));
  EXPECT_FALSE(takes_turns(0)) << "barred while taking its part";
  (void)messages();
  a_share_ = 0.9;
  const uint64_t taking_from = now_;
  while (!takes_turns(0) && now_ - taking_from < 300 * (1000 * kMs)) run(100);
  ASSERT_TRUE(takes_turns(0)) << "not found in 300 s, " << (now_ - barred_at) / (1000 * kMs)
                               << " s after the first bar";
  EXPECT_LT(now_ - taking_from, 120 * (1000 * kMs)) << "found in " << (now_ - taking_from) / kMs << " ms";
  const std::string said = messages();
  EXPECT_NE(said.find("taking turns: \"a\" for 600 s\n"), std::string::npos) << said;
}

// A tenant that keeps off the GPU at the sampling instants side by side
// (the phase-locked cheat) is named seldom there by its own doing, and its
// neighbour, named at the instants it leaves, looks greedy: the neighbour
// is barred. What that costs the neighbour is bounded: it takes turns, in
// which each pays for the time it holds, half each here; any tenant can
// send all to turns by reporting a second context. (Bounding the least
// share by the samples in turns spared the neighbour, but let a flooder
// with a long slice go unfound: docs/sm-time.md.)
TEST_F(SideBySideTest, ATenantDodgingTheInstantsGetsItsNeighbourTurnsAndNothingMore) {
  start(0.6);
  dodger_ = 0;
  ms_while(false, 2000);
  ASSERT_TRUE(together());
  EXPECT_LT(ms_while(true, 30'000), static_cast<int>(GpuScheduler::kMinSidePhaseNs / kMs));
  EXPECT_TRUE(takes_turns(1)) << "the neighbour named at every instant";
  EXPECT_FALSE(takes_turns(0));
  const uint64_t used_a = row(0).used_ns.load(), used_b = row(1).used_ns.load();
  for (int i = 0; i < 30; ++i) {
    run(100);
    EXPECT_FALSE(together()) << i;
  }
  const double a = static_cast<double>(row(0).used_ns.load() - used_a);
  const double b = static_cast<double>(row(1).used_ns.load() - used_b);
  EXPECT_NEAR(a / (a + b), 0.5, 0.05) << "turns: each pays what it holds";
}

// A restarted daemon finds the bar in the arbiter it adopts: the pair that
// would share at once (as in TenantsThatLeaveRoomInTurnsHoldTheGpuSideBySide)
// keeps taking turns.
TEST_F(SideBySideTest, ARestartedDaemonKeepsTheBar) {
  sched_.reset();
  arbiter_.seg->tenants[0].flags.store(gputime::kTenantTakesTurns);
  sched_ = std::make_unique<GpuScheduler>(*arbiter_.seg, kUuid, "GPU 0");
  sched_->adopt(now_);
  configure(500'000, 500'000);
  start(0.6);
  for (int i = 0; i < 30; ++i) {
    run(100);
    EXPECT_FALSE(together()) << i;
  }
  EXPECT_TRUE(takes_turns(0));
}

// The driver's equal turns, as the samples show them side by side, bar
// nobody: a tenant named a little less than its half (its own idle moments)
// stays side by side phase after phase.
TEST_F(SideBySideTest, TenantsNamedAboutTheirPartsKeepSharing) {
  start(0.6);
  a_share_ = 0.6;
  expect_whole_side_phases(4);
}

// Where the driver does not time-slice (no compute preemption), holding the
// GPU together would leave shares to the order of the driver's queue.
TEST_F(SideBySideTest, NotWhereTheDriverDoesNotTimeSliceContexts) {
  start(0.6, false);
  for (int i = 0; i < 20; ++i) {
    run(100);
    EXPECT_FALSE(holds(0) && holds(1)) << i;
  }
}

// A tenant with a second process on the GPU would get two turns of the
// driver's to the other's one; one found outside the gate likewise.
TEST_F(SideBySideTest, NotWithATenantOfTwoProcessesOrOneOutsideTheGate) {
  start(0.6);
  const int a2 = spawn(0);
  want(0, a2);
  for (int i = 0; i < 10; ++i) {
    run(100);
    request(0, a2).poll_ns.store(now_);
    EXPECT_FALSE(holds(0) && holds(1)) << i;
  }
  request(0, a2).want_since_ns.store(0);
  request(0, a2).poll_ns.store(0);
  run(600);
  ASSERT_TRUE(holds(0) && holds(1)) << "its second process gone quiet, side by side";
  sched_->set_outside_tenants({"b"});
  run(5);
  EXPECT_FALSE(holds(0) && holds(1)) << "b has a process outside the gate: turns at once";
  for (int i = 0; i < 10; ++i) {
    run(100);
    EXPECT_FALSE(holds(0) && holds(1)) << i;
  }
}

// A third tenant of another share, or of latency priority, asks: the
// driver's equal turns would not give it what it is promised, so everybody
// takes turns again; a latency tenant is granted at once.
TEST_F(SideBySideTest, ATenantThatDoesNotFitEndsItAtOnce) {
  for (const uint32_t priority : {gputime::kPriorityLatency, gputime::kPriorityNormal}) {
    SCOPED_TRACE(priority == gputime::kPriorityLatency ? "latency" : "another share");
    if (priority == gputime::kPriorityLatency)
      configure_three(gputime::kPriorityLatency);
    else
      sched_->configure({{"a", 400'000, 500'000, tenants_[0].daemon.usage_fd, 0, gputime::kPriorityNormal},
                         {"b", 400'000, 500'000, tenants_[1].daemon.usage_fd, 0, gputime::kPriorityNormal},
                         {"c", 200'000, 200'000, tenants_[2].daemon.usage_fd, 0, gputime::kPriorityNormal}},
                        20 * kMs);
    if (a_ < 0) start(0.6);
    c_ = -1;
    run(600);
    ASSERT_TRUE(holds(0) && holds(1));
    uint32_t pc = 0;
    const int c = spawn_attributed(2, &pc);
    want(2, c);
    pass(1 * kMs);
    EXPECT_TRUE(state_of(0) == gputime::kGrantRevoking && state_of(1) == gputime::kGrantRevoking)
        << "both holders leave";
    if (priority == gputime::kPriorityLatency) {
      EXPECT_TRUE(holds(2)) << "the latency tenant at once";
    }
    c_ = c;
    run(300);
    EXPECT_FALSE(holds(0) && holds(1));
    request(2, c).want_since_ns.store(0);
    request(2, c).poll_ns.store(0);
    kill_and_reap(processes_.back());
    processes_.pop_back();
    attributed_.erase(2);
    reattribute();
    c_ = -1;
  }
}

// Holding the GPU together, each pays its part of the time: where the
// limits do not allow that part (two tenants of 0.25 capped there), they
// take turns, each held to its limit.
TEST_F(SideBySideTest, NotWhereTheLimitsDoNotAllowEachItsPart) {
  sched_->configure({{"a", 250'000, 250'000, tenants_[0].daemon.usage_fd, 0, gputime::kPriorityNormal},
                     {"b", 250'000, 250'000, tenants_[1].daemon.usage_fd, 0, gputime::kPriorityNormal}},
                    20 * kMs);
  start(0.4);
  for (int i = 0; i < 20; ++i) {
    run(100);
    EXPECT_FALSE(holds(0) && holds(1)) << i;
  }
}

// A process that launches into two contexts on the GPU gets two turns of
// the driver's to the other's one: its tenant takes turns.
TEST_F(SideBySideTest, NotWithAProcessOfTwoContexts) {
  start(0.6);
  run(600);
  ASSERT_TRUE(holds(0) && holds(1));
  request(0, a_).contexts.store(2);
  run(5);
  EXPECT_FALSE(holds(0) && holds(1)) << "turns at once";
  for (int i = 0; i < 10; ++i) {
    run(100);
    EXPECT_FALSE(holds(0) && holds(1)) << i;
  }
  request(0, a_).contexts.store(1);
  run(600);
  EXPECT_TRUE(holds(0) && holds(1)) << "one context again: side by side";
}

// What the GPU did while one tenant had it alone says nothing of turns
// between two: a light tenant alone for a while, then a saturating one
// beside it, are measured from when both ask.
TEST_F(SideBySideTest, TimeAloneDoesNotCountAsRoomInTurns) {
  start(0.3);
  request(1, b_).want_since_ns.store(0);
  request(1, b_).poll_ns.store(0);
  const int b = b_;
  b_ = -1;  // b's process stays quiet
  run(1000);
  EXPECT_FALSE(holds(1));
  util_ = 0.98;
  b_ = b;
  want(1, b_);
  for (int i = 0; i < 10; ++i) {
    run(100);
    EXPECT_FALSE(holds(0) && holds(1)) << i;
  }
}

// A meter that reads every process's time every few milliseconds (an exact
// one, not a sampling driver) gives several readings per instant: together
// they are the GPU's busy time, and two tenants filling their turns are
// seen to fill them.
TEST_F(SideBySideTest, AnExactMeterIsReadAsTheGpusBusyTime) {
  start(0.0);
  meter_.period = 2 * kMs;
  meter_.duty[pa_] = 0.5;
  meter_.duty[pb_] = 0.5;
  for (int i = 0; i < 10; ++i) {
    run(100);
    EXPECT_FALSE(holds(0) && holds(1)) << i;
  }
  meter_.duty[pa_] = meter_.duty[pb_] = 0.3;
  int ms = 0;
  while (!(holds(0) && holds(1)) && ms < 3000) {
    run(10);
    ms += 10;
  }
  EXPECT_TRUE(holds(0) && holds(1)) << "0.6 busy: room, once the turns' mean over their whole span is below 0.9";
}
