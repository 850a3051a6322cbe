// Ledger unit tests: layout validation, charging at the quota's edge from
// threads and processes, process slots and their reclamation after SIGKILL.
#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "ledger.h"
#include "reclaim_util.h"
#include "sigbus_guard.h"

using namespace fracgpu::ledger;
namespace fs = std::filesystem;

namespace {

constexpr uint8_t kUuidA[16] = {0xa1, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
constexpr uint8_t kUuidB[16] = {0xb2, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};

class LedgerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/fracgpu-ledger-XXXXXX";
    ASSERT_NE(mkdtemp(tmpl), nullptr);
    dir_ = tmpl;
    tenant_dir_ = dir_ + "/alice";
  }
  void TearDown() override { fs::remove_all(dir_); }

  // The daemon's side: create the tenant and grant GPU A with `quota` bytes.
  TenantLedger make_daemon(uint64_t quota) {
    TenantLedger d;
    char err[256] = {};
    EXPECT_EQ(open_ledger(tenant_dir_.c_str(), AccessMode::kDaemon, "alice", &d, err, sizeof err), LedgerError::kOk)
        << err;
    int g = bind_gpu(*d.policy, kUuidA);
    EXPECT_EQ(g, 0);
    d.policy->gpus[g].memory_quota.store(quota);
    d.policy->gpus[g].state.store(kGpuGranted);
    publish_policy_change(*d.policy);
    return d;
  }

  TenantLedger open_tenant() {
    TenantLedger t;
    char err[256] = {};
    EXPECT_EQ(open_ledger(tenant_dir_.c_str(), AccessMode::kTenant, nullptr, &t, err, sizeof err), LedgerError::kOk)
        << err;
    return t;
  }
  // A child process that claims a slot of the tenant's ledger, charges
  // `bytes` on GPU entry 0, writes a byte to the pipe `ready` and waits to be
  // killed. Returns once it is ready.
  pid_t spawn_holder(uint64_t bytes, int ready[2]) {
    const pid_t child = fork();
    if (child == 0) {
      TenantLedger t;
      char err[256];
      if (open_ledger(tenant_dir_.c_str(), AccessMode::kTenant, nullptr, &t, err, sizeof err) != LedgerError::kOk)
        _exit(2);
      ProcessIdentity self{};
      read_self_identity(&self);
      const int slot = claim_slot(t, self, nullptr);
      if (slot < 0 || !try_charge(*t.policy, *t.usage, 0, slot, bytes)) _exit(3);
      char c = 1;
      if (write(ready[1], &c, 1) != 1) _exit(4);
      pause();
      _exit(0);
    }
    char c;
    EXPECT_EQ(read(ready[0], &c, 1), 1);
    return child;
  }


  std::string dir_;
  std::string tenant_dir_;
};

TEST(LedgerHeader, AllZeroSegmentIsValidAndEmpty) {
  SegmentHeader zero{};
  EXPECT_EQ(check_header(zero, kPolicyMagic, sizeof(PolicySegment)), LedgerError::kOk);
  SegmentHeader other = zero;
  other.magic = 0x1234;
  EXPECT_EQ(check_header(other, kPolicyMagic, sizeof(PolicySegment)), LedgerError::kForeign);
  other.magic = kPolicyMagic;
  other.layout_version = kLayoutVersion + 1;
  EXPECT_EQ(check_header(other, kPolicyMagic, sizeof(PolicySegment)), LedgerError::kWrongVersion);
  other.layout_version = kLayoutVersion;
  other.header_bytes = sizeof(SegmentHeader);
  other.segment_bytes = 12;
  EXPECT_EQ(check_header(other, kPolicyMagic, sizeof(PolicySegment)), LedgerError::kCorrupt);
}

TEST_F(LedgerTest, AllZeroFilesOpenAsAnEmptyLedger) {
  fs::create_directories(tenant_dir_);
  for (auto [name, size] : {std::pair{kPolicyFileName, sizeof(PolicySegment)}, {kUsageFileName, sizeof(UsageSegment)}}) {
    int fd = open((tenant_dir_ + "/" + name).c_str(), O_RDWR | O_CREAT, 0666);
    ASSERT_GE(fd, 0);
    ASSERT_EQ(ftruncate(fd, static_cast<off_t>(size)), 0);
    close(fd);
  }
  TenantLedger t = open_tenant();
  ASSERT_TRUE(t.is_open());
  EXPECT_EQ(find_gpu(*t.policy, kUuidA), -1);
  EXPECT_EQ(tenant_used(*t.usage, 0), 0u);
  close_ledger(&t);
}

TEST_F(LedgerTest, DaemonCreatesStampedSegmentsWithModes) {
  TenantLedger d = make_daemon(1 << 20);
  EXPECT_EQ(d.policy->header.magic, kPolicyMagic);
  EXPECT_EQ(d.usage->header.magic, kUsageMagic);
  EXPECT_STREQ(d.policy->tenant, "alice");
  struct stat st {};
  ASSERT_EQ(stat((tenant_dir_ + "/policy").c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0644u);
  ASSERT_EQ(stat((tenant_dir_ + "/usage").c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0666u);
  // Re-adopting keeps what is there.
  TenantLedger again;
  char err[256];
  ASSERT_EQ(open_ledger(tenant_dir_.c_str(), AccessMode::kDaemon, "alice", &again, err, sizeof err), LedgerError::kOk);
  EXPECT_EQ(again.policy->gpus[0].memory_quota.load(), 1u << 20);
  close_ledger(&again);
  close_ledger(&d);
}

TEST_F(LedgerTest, RefusesForeignWrongVersionWrongSizeAndCorruptSegments) {
  TenantLedger d = make_daemon(1 << 20);
  close_ledger(&d);
  const std::string policy = tenant_dir_ + "/policy";
  auto patch = [&](off_t offset, const void* bytes, size_t n) {
    int fd = open(policy.c_str(), O_RDWR);
    ASSERT_GE(fd, 0);
    ASSERT_EQ(pwrite(fd, bytes, n, offset), static_cast<ssize_t>(n));
    close(fd);
  };
  char err[256] = {};
  TenantLedger t;

  uint32_t version = kLayoutVersion + 7;
  patch(offsetof(SegmentHeader, layout_version), &version, sizeof version);
  EXPECT_EQ(open_ledger(tenant_dir_.c_str(), AccessMode::kTenant, nullptr, &t, err, sizeof err),
            LedgerError::kWrongVersion);
  EXPECT_NE(std::string(err).find("version " + std::to_string(kLayoutVersion + 7)), std::string::npos) << err;
  EXPECT_FALSE(t.is_open());
  version = kLayoutVersion;
  patch(offsetof(SegmentHeader, layout_version), &version, sizeof version);

  uint64_t magic = 0xdeadbeef;
  patch(0, &magic, sizeof magic);
  EXPECT_EQ(open_ledger(tenant_dir_.c_str(), AccessMode::kTenant, nullptr, &t, err, sizeof err), LedgerError::kForeign);
  EXPECT_NE(std::string(err).find("not a fracgpu"), std::string::npos) << err;
  magic = kPolicyMagic;
  patch(0, &magic, sizeof magic);

  uint32_t bad_state = 77;
  patch(offsetof(PolicySegment, gpus) + offsetof(GpuPolicy, state), &bad_state, sizeof bad_state);
  EXPECT_EQ(open_ledger(tenant_dir_.c_str(), AccessMode::kTenant, nullptr, &t, err, sizeof err), LedgerError::kCorrupt);
  uint32_t good_state = kGpuGranted;
  patch(offsetof(PolicySegment, gpus) + offsetof(GpuPolicy, state), &good_state, sizeof good_state);

  ASSERT_EQ(truncate(policy.c_str(), 100), 0);
  EXPECT_EQ(open_ledger(tenant_dir_.c_str(), AccessMode::kTenant, nullptr, &t, err, sizeof err),
            LedgerError::kWrongSize);
  EXPECT_NE(std::string(err).find("expects"), std::string::npos) << err;

  fs::remove_all(tenant_dir_);
  EXPECT_EQ(open_ledger(tenant_dir_.c_str(), AccessMode::kTenant, nullptr, &t, err, sizeof err), LedgerError::kMissing);
}

TEST_F(LedgerTest, TenantMapsPolicyReadOnly) {
  TenantLedger d = make_daemon(1 << 20);
  TenantLedger t = open_tenant();
  // Writing the quota through the tenant's mapping faults instead of raising it.
  EXPECT_DEATH(t.policy->gpus[0].memory_quota.store(kUnlimited), "");
  EXPECT_EQ(d.policy->gpus[0].memory_quota.load(), 1u << 20);
  close_ledger(&t);
  close_ledger(&d);
}

TEST_F(LedgerTest, UnprivilegedTenantCannotOpenPolicyForWriting) {
  TenantLedger d = make_daemon(1 << 20);
  close_ledger(&d);
  if (geteuid() != 0) {
    EXPECT_LT(open((tenant_dir_ + "/policy").c_str(), O_RDWR), 0);
    EXPECT_EQ(errno, EACCES);
    return;
  }
  // As root, check it as an ordinary user would meet it.
  ASSERT_EQ(chmod(dir_.c_str(), 0755), 0);
  pid_t child = fork();
  if (child == 0) {
    if (setgid(65534) != 0 || setuid(65534) != 0) _exit(3);
    int w = open((tenant_dir_ + "/policy").c_str(), O_RDWR);
    int u = open((tenant_dir_ + "/usage").c_str(), O_RDWR);
    _exit(w < 0 && errno != 0 && u >= 0 ? 0 : 1);
  }
  int status = 0;
  waitpid(child, &status, 0);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << status;
}

TEST_F(LedgerTest, ChargesStopAtTheQuota) {
  TenantLedger d = make_daemon(1000);
  TenantLedger t = open_tenant();
  ProcessIdentity self{};
  ASSERT_TRUE(read_self_identity(&self));
  EXPECT_EQ(self.pid, getpid());
  EXPECT_GT(self.start_time, 0u);
  int slot = claim_slot(t, self, nullptr);
  ASSERT_GE(slot, 0);
  EXPECT_TRUE(try_charge(*t.policy, *t.usage, 0, slot, 600));
  EXPECT_FALSE(try_charge(*t.policy, *t.usage, 0, slot, 401));
  EXPECT_TRUE(try_charge(*t.policy, *t.usage, 0, slot, 400));
  EXPECT_EQ(tenant_used(*t.usage, 0), 1000u);
  EXPECT_FALSE(try_charge(*t.policy, *t.usage, 0, slot, 1));
  uncharge(*t.usage, 0, slot, 500);
  EXPECT_EQ(tenant_used(*t.usage, 0), 500u);
  // Lowering the quota below use refuses new charges and frees nothing.
  d.policy->gpus[0].memory_quota.store(100);
  EXPECT_FALSE(try_charge(*t.policy, *t.usage, 0, slot, 1));
  EXPECT_EQ(tenant_used(*t.usage, 0), 500u);
  d.policy->gpus[0].memory_quota.store(kUnlimited);
  EXPECT_TRUE(try_charge(*t.policy, *t.usage, 0, slot, 1ull << 50));
  // A revoked grant refuses everything.
  d.policy->gpus[0].state.store(kGpuRevoked);
  EXPECT_FALSE(try_charge(*t.policy, *t.usage, 0, slot, 1));
  // An entry that was never granted refuses too.
  EXPECT_FALSE(try_charge(*t.policy, *t.usage, 1, slot, 1));
  close_ledger(&t);
  close_ledger(&d);
}

TEST_F(LedgerTest, GpuEntriesAreBoundByUuidAndAppendOnly) {
  TenantLedger d = make_daemon(1);
  EXPECT_EQ(find_gpu(*d.policy, kUuidA), 0);
  EXPECT_EQ(find_gpu(*d.policy, kUuidB), -1);
  EXPECT_EQ(bind_gpu(*d.policy, kUuidB), 1);
  EXPECT_EQ(bind_gpu(*d.policy, kUuidB), 1);
  EXPECT_EQ(d.policy->gpus[1].state.load(), kGpuRevoked);  // bound, not granted yet
  uint8_t uuid[16] = {};
  for (uint32_t i = 2; i < kMaxGpus; ++i) {
    uuid[0] = static_cast<uint8_t>(i);
    EXPECT_EQ(bind_gpu(*d.policy, uuid), static_cast<int>(i));
  }
  uuid[0] = 0xff;
  EXPECT_EQ(bind_gpu(*d.policy, uuid), -1);
  close_ledger(&d);
}

// Several threads, each with its own slot, allocate and free at the edge of
// the quota. What they hold after a successful charge can never pass it.
TEST_F(LedgerTest, ConcurrentChargesNeverPassTheQuota) {
  constexpr uint64_t kQuota = 64 << 20;
  TenantLedger d = make_daemon(kQuota);
  TenantLedger t = open_tenant();
  std::atomic<uint64_t> held{0};
  std::atomic<bool> violated{false};
  std::atomic<uint64_t> successes{0}, refusals{0};
  // Slots are written directly here, so publish the high-water mark.
  t.usage->slot_high_water.store(8);
  std::vector<std::thread> threads;
  for (int i = 0; i < 8; ++i) {
    threads.emplace_back([&, i] {
      std::mt19937_64 rng(i);
      const auto end = std::chrono::steady_clock::now() + std::chrono::milliseconds(700);
      std::vector<uint64_t> mine;
      const uint32_t slot = static_cast<uint32_t>(i);
      while (std::chrono::steady_clock::now() < end) {
        if (!mine.empty() && (rng() % 3 == 0 || mine.size() > 8)) {
          held.fetch_sub(mine.back());
          uncharge(*t.usage, 0, slot, mine.back());
          mine.pop_back();
          continue;
        }
        const uint64_t bytes = (rng() % 16 + 1) << 20;
        if (try_charge(*t.policy, *t.usage, 0, slot, bytes)) {
          if (held.fetch_add(bytes) + bytes > kQuota) violated = true;
          mine.push_back(bytes);
          successes++;
        } else {
          refusals++;
        }
      }
      for (uint64_t b : mine) {
        held.fetch_sub(b);
        uncharge(*t.usage, 0, slot, b);
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_FALSE(violated.load());
  EXPECT_GT(successes.load(), 100u);
  EXPECT_GT(refusals.load(), 100u);  // the edge was really reached
  EXPECT_EQ(tenant_used(*t.usage, 0), 0u);
  close_ledger(&t);
  close_ledger(&d);
}

// 4 processes x 8 threads, each process with its own slot.
TEST_F(LedgerTest, ConcurrentChargesFromProcessesNeverPassTheQuota) {
  constexpr uint64_t kQuota = 64 << 20;
  TenantLedger d = make_daemon(kQuota);
  auto* shared = static_cast<std::atomic<uint64_t>*>(
      mmap(nullptr, 4096, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0));
  ASSERT_NE(shared, MAP_FAILED);
  std::atomic<uint64_t>& held = shared[0];
  std::atomic<uint64_t>& violations = shared[1];
  std::atomic<uint64_t>& refusals = shared[2];
  std::vector<pid_t> children;
  for (int p = 0; p < 4; ++p) {
    pid_t child = fork();
    if (child == 0) {
      TenantLedger t;
      char err[256];
      if (open_ledger(tenant_dir_.c_str(), AccessMode::kTenant, nullptr, &t, err, sizeof err) != LedgerError::kOk)
        _exit(2);
      ProcessIdentity self{};
      read_self_identity(&self);
      int slot = claim_slot(t, self, nullptr);
      if (slot < 0) _exit(3);
      std::vector<std::thread> threads;
      for (int i = 0; i < 8; ++i) {
        threads.emplace_back([&, i] {
          std::mt19937_64 rng(p * 100 + i);
          const auto end = std::chrono::steady_clock::now() + std::chrono::milliseconds(1500);
          std::vector<uint64_t> mine;
          while (std::chrono::steady_clock::now() < end) {
            if (!mine.empty() && (rng() % 3 == 0 || mine.size() > 4)) {
              held.fetch_sub(mine.back());
              uncharge(*t.usage, 0, slot, mine.back());
              mine.pop_back();
              continue;
            }
            const uint64_t bytes = (rng() % 8 + 1) << 20;
            if (try_charge(*t.policy, *t.usage, 0, slot, bytes)) {
              if (held.fetch_add(bytes) + bytes > kQuota) violations++;
              mine.push_back(bytes);
            } else {
              refusals++;
            }
          }
          for (uint64_t b : mine) {
            held.fetch_sub(b);
            uncharge(*t.usage, 0, slot, b);
          }
        });
      }
      for (auto& th : threads) th.join();
      _exit(0);
    }
    children.push_back(child);
  }
  for (pid_t c : children) {
    int status = 0;
    waitpid(c, &status, 0);
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << status;
  }
  EXPECT_EQ(violations.load(), 0u);
  EXPECT_GT(refusals.load(), 0u);
  EXPECT_EQ(tenant_used(*d.usage, 0), 0u);
  munmap(shared, 4096);
  close_ledger(&d);
}

TEST_F(LedgerTest, KilledProcessChargesAreReclaimedAndLiveOnesAreNot) {
  TenantLedger d = make_daemon(1 << 30);
  int ready[2];
  ASSERT_EQ(pipe(ready), 0);
  pid_t victim = spawn_holder(300, ready);
  pid_t survivor = spawn_holder(500, ready);
  EXPECT_EQ(tenant_used(*d.usage, 0), 800u);
  // The kernel, not the slot's content, tells who is alive.
  bool saw_victim = false;
  for (uint32_t s = 0; s < d.usage->slot_high_water.load(); ++s)
    if (slot_owner_pid(d, s) == victim) saw_victim = true;
  EXPECT_TRUE(saw_victim);

  uint64_t bytes = 0;
  EXPECT_EQ(reclaim_settled(d, -1, &bytes), 0);  // both alive
  kill(victim, SIGKILL);
  waitpid(victim, nullptr, 0);
  EXPECT_EQ(reclaim_settled(d, -1, &bytes), 1);
  EXPECT_EQ(bytes, 300u);
  EXPECT_EQ(tenant_used(*d.usage, 0), 500u);

  // A newcomer reuses the dead slot, never the live one.
  TenantLedger t = open_tenant();
  ProcessIdentity self{};
  read_self_identity(&self);
  int slot = claim_slot(t, self, nullptr);
  ASSERT_GE(slot, 0);
  // (Our own lock is invisible to F_GETLK from this process; the slot says who.)
  EXPECT_EQ(t.usage->slots[slot].pid.load(), getpid());
  // Our own slot is never "dead" to us.
  EXPECT_EQ(reclaim_settled(t, slot, &bytes), 0);
  EXPECT_EQ(tenant_used(*d.usage, 0), 500u);

  kill(survivor, SIGKILL);
  waitpid(survivor, nullptr, 0);
  EXPECT_EQ(reclaim_settled(t, slot, &bytes), 1);
  EXPECT_EQ(tenant_used(*d.usage, 0), 0u);
  close_ledger(&t);
  close_ledger(&d);
  close(ready[0]);
  close(ready[1]);
}

// The daemon's record of each live slot's host PID: the lock holder, only if
// it started when the slot's owner did; cleared once the owner is gone.
TEST_F(LedgerTest, HostPidsAreRecordedForLiveProcessesOnly) {
  TenantLedger d = make_daemon(1 << 30);
  int ready[2];
  ASSERT_EQ(pipe(ready), 0);
  const pid_t child = spawn_holder(100, ready);
  auto slot_of_child = [&]() -> int {
    for (uint32_t s = 0; s < d.usage->slot_high_water.load(); ++s)
      if (d.usage->slots[s].pid.load() == child && d.usage->slots[s].state.load() == kSlotLive) return static_cast<int>(s);
    return -1;
  };
  const int slot = slot_of_child();
  ASSERT_GE(slot, 0);
  EXPECT_EQ(d.usage->slots[slot].host_pid.load(), 0);  // nothing recorded yet
  record_host_pids(d);
  EXPECT_EQ(d.usage->slots[slot].host_pid.load(), child);
  // A slot whose start time is not the lock holder's (the slot changed hands
  // between the two reads) gets no host PID.
  const uint64_t start = d.usage->slots[slot].start_time.load();
  d.usage->slots[slot].start_time.store(start + 1);
  record_host_pids(d);
  EXPECT_EQ(d.usage->slots[slot].host_pid.load(), 0);
  d.usage->slots[slot].start_time.store(start);
  record_host_pids(d);
  EXPECT_EQ(d.usage->slots[slot].host_pid.load(), child);
  kill(child, SIGKILL);
  waitpid(child, nullptr, 0);
  record_host_pids(d);  // the lock is gone with the process
  EXPECT_EQ(d.usage->slots[slot].host_pid.load(), 0);
  close_ledger(&d);
  close(ready[0]);
  close(ready[1]);
}

TEST_F(LedgerTest, SlotsRunOutCleanly) {
  TenantLedger d = make_daemon(1);
  // Our process can hold only one lock per byte, and POSIX locks never
  // conflict with our own: take every slot from one child instead.
  pid_t child = fork();
  if (child == 0) {
    TenantLedger t;
    char err[256];
    if (open_ledger(tenant_dir_.c_str(), AccessMode::kTenant, nullptr, &t, err, sizeof err) != LedgerError::kOk) _exit(2);
    ProcessIdentity self{};
    read_self_identity(&self);
    for (uint32_t i = 0; i < kMaxSlots; ++i)
      if (claim_slot(t, self, nullptr) < 0) _exit(3);
    pause();
    _exit(0);
  }
  for (int i = 0; i < 200 && d.usage->slot_high_water.load() < kMaxSlots; ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  ASSERT_EQ(d.usage->slot_high_water.load(), kMaxSlots);
  TenantLedger t = open_tenant();
  ProcessIdentity self{};
  read_self_identity(&self);
  LedgerError e = LedgerError::kOk;
  EXPECT_EQ(claim_slot(t, self, &e), -1);
  EXPECT_EQ(e, LedgerError::kFull);
  kill(child, SIGKILL);
  waitpid(child, nullptr, 0);
  EXPECT_GE(claim_slot(t, self, &e), 0);
  close_ledger(&t);
  close_ledger(&d);
}

}  // namespace

// A mapping shrunk under a guarded reader costs the read, not the process;
// the same read unguarded is fatal, so the guard is what saves it.
TEST(SigbusGuard, AShrunkMappingFailsTheGuardedReadInsteadOfKillingTheProcess) {
  char path[] = "/tmp/fracgpu-sigbus-XXXXXX";
  const int fd = mkstemp(path);
  ASSERT_GE(fd, 0);
  unlink(path);
  const size_t bytes = 4 * 4096;
  ASSERT_EQ(ftruncate(fd, bytes), 0);
  auto* map = static_cast<volatile uint64_t*>(mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0));
  ASSERT_NE(map, MAP_FAILED);
  map[bytes / 8 - 1] = 7;
  uint64_t seen = 0;
  EXPECT_TRUE(fracgpu::shm::sigbus_guarded([&] { seen = map[bytes / 8 - 1]; }));
  EXPECT_EQ(seen, 7u);
  ASSERT_EQ(ftruncate(fd, 0), 0);
  for (int round = 0; round < 3; ++round) {  // the guard re-arms after each jump
    seen = 1;
    EXPECT_FALSE(fracgpu::shm::sigbus_guarded([&] { seen = map[bytes / 8 - 1]; }));
    EXPECT_EQ(seen, 1u);
  }
  // Nested guards: the inner one catches, the outer body goes on.
  bool inner = true;
  EXPECT_TRUE(fracgpu::shm::sigbus_guarded([&] { inner = fracgpu::shm::sigbus_guarded([&] { map[0] = 1; }); }));
  EXPECT_FALSE(inner);
  EXPECT_EXIT(
      {
        fracgpu::shm::install_sigbus_guard();
        map[0] = 1;
        _exit(0);
      },
      ::testing::KilledBySignal(SIGBUS), "");
  munmap(const_cast<uint64_t*>(map), bytes);
  close(fd);
}
