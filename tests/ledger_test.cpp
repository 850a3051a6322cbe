// Ledger unit tests: layout validation, charging at the quota's edge from
// threads and processes, process slots and their reclamation after SIGKILL.
#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
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
#include "policy_util.h"
#include "safe_file.h"
#include "reclaim_util.h"
#include "sigbus_guard.h"

using namespace fracgpu::ledger;
using fracgpu::testing::grant_gpu;
using fracgpu::testing::publish_policy;
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
    EXPECT_EQ(grant_gpu(d, kUuidA, quota), 0);
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
  // In a forked child: opens the tenant's ledger and claims a slot (its
  // record lock taken), or exits.
  int claim_in_child(TenantLedger* t) {
    char err[256];
    if (open_ledger(tenant_dir_.c_str(), AccessMode::kTenant, nullptr, t, err, sizeof err) != LedgerError::kOk)
      _exit(2);
    ProcessIdentity self{};
    read_self_identity(&self);
    const int slot = claim_slot(*t, self, nullptr);
    if (slot < 0) _exit(3);
    return slot;
  }

  pid_t spawn_holder(uint64_t bytes, int ready[2]) {
    const pid_t child = fork();
    if (child == 0) {
      TenantLedger t;
      const int slot = claim_in_child(&t);
      if (!try_charge(t, 0, slot, bytes)) _exit(3);
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
  for (auto [name, size] : {std::pair{kPolicyFileName, sizeof(PolicySegment)}, {kUsageFileName, sizeof(UsageSegment)},
                            {kNodeFileName, sizeof(NodeSegment)}}) {
    int fd = open((tenant_dir_ + "/" + name).c_str(), O_RDWR | O_CREAT, 0666);
    ASSERT_GE(fd, 0);
    ASSERT_EQ(ftruncate(fd, static_cast<off_t>(size)), 0);
    close(fd);
  }
  TenantLedger t = open_tenant();
  ASSERT_TRUE(t.is_open());
  EXPECT_EQ(find_gpu(t, kUuidA), -1);
  GpuTable table;
  EXPECT_TRUE(read_gpu_table(t, &table));  // generation 0, stamped 0: nothing granted, consistently
  EXPECT_EQ(table.gpus[0].state, kGpuUnused);
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
  ASSERT_EQ(stat((tenant_dir_ + "/node").c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0644u);
  EXPECT_EQ(d.node->header.magic, kNodeMagic);
  // Re-adopting keeps what is there.
  TenantLedger again;
  char err[256];
  ASSERT_EQ(open_ledger(tenant_dir_.c_str(), AccessMode::kDaemon, "alice", &again, err, sizeof err), LedgerError::kOk);
  EXPECT_EQ(read_gpu_entry(again, 0).memory_quota, 1u << 20);
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

  // A bad entry in either copy, the one in force or not.
  for (size_t copy = 0; copy < 2; ++copy) {
    const off_t state = static_cast<off_t>(offsetof(PolicySegment, copies) + copy * sizeof(PolicyCopy) +
                                           offsetof(PolicyCopy, gpus) + offsetof(GpuPolicy, state));
    uint32_t bad_state = 77;
    patch(state, &bad_state, sizeof bad_state);
    EXPECT_EQ(open_ledger(tenant_dir_.c_str(), AccessMode::kTenant, nullptr, &t, err, sizeof err),
              LedgerError::kCorrupt);
    uint32_t good_state = kGpuGranted;
    patch(state, &good_state, sizeof good_state);
  }

  // The node file: which copy is in force cannot be told without it. Refused
  // as corrupt (a tenant is then denied), not as missing (let through).
  const std::string node = tenant_dir_ + "/node";
  ASSERT_EQ(rename(node.c_str(), (node + ".away").c_str()), 0);
  EXPECT_EQ(open_ledger(tenant_dir_.c_str(), AccessMode::kTenant, nullptr, &t, err, sizeof err), LedgerError::kCorrupt);
  EXPECT_NE(std::string(err).find("/node: missing"), std::string::npos) << err;
  ASSERT_EQ(rename((node + ".away").c_str(), node.c_str()), 0);
  {
    const int fd = open(node.c_str(), O_RDWR);
    const uint64_t not_node = kPolicyMagic;
    ASSERT_EQ(pwrite(fd, &not_node, sizeof not_node, 0), 8);
    close(fd);
  }
  EXPECT_EQ(open_ledger(tenant_dir_.c_str(), AccessMode::kTenant, nullptr, &t, err, sizeof err), LedgerError::kForeign);
  EXPECT_NE(std::string(err).find("not a fracgpu node segment"), std::string::npos) << err;
  ASSERT_EQ(truncate(node.c_str(), 10), 0);
  EXPECT_EQ(open_ledger(tenant_dir_.c_str(), AccessMode::kTenant, nullptr, &t, err, sizeof err),
            LedgerError::kWrongSize);
  EXPECT_FALSE(t.is_open());

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
  // Writing the quota, or the generation in force, through the tenant's
  // mappings faults instead of raising it.
  const uint64_t in_force = t.node->committed.load();
  EXPECT_DEATH(t.policy->copies[in_force & 1].gpus[0].memory_quota.store(kUnlimited), "");
  EXPECT_DEATH(t.policy->copies[(in_force + 1) & 1].gpus[0].memory_quota.store(kUnlimited), "");
  EXPECT_DEATH(t.node->committed.store(in_force + 1), "");
  EXPECT_EQ(read_gpu_entry(d, 0).memory_quota, 1u << 20);
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
  EXPECT_TRUE(try_charge(t, 0, slot, 600));
  EXPECT_FALSE(try_charge(t, 0, slot, 401));
  EXPECT_TRUE(try_charge(t, 0, slot, 400));
  EXPECT_EQ(tenant_used(*t.usage, 0), 1000u);
  EXPECT_FALSE(try_charge(t, 0, slot, 1));
  uncharge(*t.usage, 0, slot, 500);
  EXPECT_EQ(tenant_used(*t.usage, 0), 500u);
  // Lowering the quota below use refuses new charges and frees nothing.
  publish_policy(d, [](GpuPolicy* gpus) { gpus[0].memory_quota.store(100); });
  EXPECT_FALSE(try_charge(t, 0, slot, 1));
  EXPECT_EQ(tenant_used(*t.usage, 0), 500u);
  publish_policy(d, [](GpuPolicy* gpus) { gpus[0].memory_quota.store(kUnlimited); });
  EXPECT_TRUE(try_charge(t, 0, slot, 1ull << 50));
  // A revoked grant refuses everything.
  publish_policy(d, [](GpuPolicy* gpus) { gpus[0].state.store(kGpuRevoked); });
  EXPECT_FALSE(try_charge(t, 0, slot, 1));
  // An entry that was never granted refuses too.
  EXPECT_FALSE(try_charge(t, 1, slot, 1));
  close_ledger(&t);
  close_ledger(&d);
}

TEST_F(LedgerTest, GpuEntriesAreBoundByUuidAndAppendOnly) {
  TenantLedger d = make_daemon(1);
  EXPECT_EQ(find_gpu(d, kUuidA), 0);
  EXPECT_EQ(find_gpu(d, kUuidB), -1);
  publish_policy(d, [](GpuPolicy* gpus) {
    EXPECT_EQ(bind_gpu(gpus, kUuidB), 1);
    EXPECT_EQ(bind_gpu(gpus, kUuidB), 1);
    EXPECT_EQ(gpus[1].state.load(), kGpuRevoked);  // bound, not granted yet
  });
  EXPECT_EQ(find_gpu(d, kUuidB), 1);
  // Every later copy keeps the bindings: entries only ever append.
  publish_policy(d, [](GpuPolicy* gpus) {
    uint8_t uuid[16] = {};
    for (uint32_t i = 2; i < kMaxGpus; ++i) {
      uuid[0] = static_cast<uint8_t>(i);
      EXPECT_EQ(bind_gpu(gpus, uuid), static_cast<int>(i));
    }
    uuid[0] = 0xff;
    EXPECT_EQ(bind_gpu(gpus, uuid), -1);
    EXPECT_EQ(bind_gpu(gpus, kUuidA), 0);
  });
  EXPECT_EQ(find_gpu(d, kUuidA), 0);
  EXPECT_EQ(find_gpu(d, kUuidB), 1);
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
        if (try_charge(t, 0, slot, bytes)) {
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
            if (try_charge(t, 0, slot, bytes)) {
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
// it started when the slot's owner did; cleared once the owner is gone. The
// same with the daemon's memo of owners it checked (which spares it a read
// of /proc per live process and tick): nothing of this is remembered past a
// change.
class HostPidsTest : public LedgerTest, public ::testing::WithParamInterface<bool> {};

TEST_P(HostPidsTest, AreRecordedForLiveProcessesOnly) {
  HostPidMemo memo_storage;
  HostPidMemo* memo = GetParam() ? &memo_storage : nullptr;
  const auto record_host_pids = [&](TenantLedger& l) { fracgpu::ledger::record_host_pids(l, nullptr, memo); };
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
  if (memo != nullptr) {
    EXPECT_EQ(memo->host_pid[slot], child) << "the owner found is remembered";
  }
  d.usage->slots[slot].host_pid.store(0);  // the tenant's copy, overwritten
  record_host_pids(d);
  EXPECT_EQ(d.usage->slots[slot].host_pid.load(), child) << "rewritten from what the daemon found";
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

// A slot's lock is its descriptor table's, and names the process that took
// it: a second process sharing that table (clone with CLONE_FILES) keeps the
// lock when the taker leaves it, and the PID the lock names may then belong
// to a process that holds nothing (on a node, after the taker exits and its
// PID is reused: any process at all). The taker here leaves the table by
// unshare(CLONE_FILES) and lives on, so the PID it left in the lock names a
// live process with no lock of its own: it is nobody the daemon verified.
TEST_P(HostPidsTest, APidALockOutlivedVerifiesNothing) {
  HostPidMemo memo_storage;
  HostPidMemo* memo = GetParam() ? &memo_storage : nullptr;
  TenantLedger d = make_daemon(1 << 30);
  int ready[2];
  ASSERT_EQ(pipe(ready), 0);
  // An honest holder beside it, verified as ever.
  const pid_t honest = spawn_holder(100, ready);
  const pid_t taker = fork();
  if (taker == 0) {
    TenantLedger t;
    claim_in_child(&t);
    const long keeper = syscall(SYS_clone, CLONE_FILES | SIGCHLD, nullptr, nullptr, nullptr, nullptr);
    if (keeper == 0) {
      pause();
      _exit(0);
    }
    if (keeper < 0 || unshare(CLONE_FILES) != 0) _exit(4);
    const int32_t keeper_pid = static_cast<int32_t>(keeper);
    if (write(ready[1], &keeper_pid, sizeof keeper_pid) != sizeof keeper_pid) _exit(5);
    pause();
    _exit(0);
  }
  int32_t keeper = 0;
  ASSERT_EQ(read(ready[0], &keeper, sizeof keeper), static_cast<ssize_t>(sizeof keeper));
  int32_t verified[kMaxSlots];
  for (int pass = 0; pass < 2; ++pass) {  // the second with what the first remembered
    fracgpu::ledger::record_host_pids(d, verified, memo);
    std::vector<int32_t> found;
    for (const int32_t pid : verified)
      if (pid != 0) found.push_back(pid);
    EXPECT_EQ(found, std::vector<int32_t>{honest}) << "pass " << pass << "; the taker is " << taker;
  }
  // The lock is still there, naming the taker: F_GETLK alone would verify it.
  bool named = false;
  for (uint32_t s = 0; s < d.usage->slot_high_water.load(); ++s) named |= slot_owner_pid(d, s) == taker;
  EXPECT_TRUE(named);
  for (const pid_t pid : {honest, taker, static_cast<pid_t>(keeper)}) kill(pid, SIGKILL);
  waitpid(honest, nullptr, 0);
  waitpid(taker, nullptr, 0);
  close_ledger(&d);
  close(ready[0]);
  close(ready[1]);
}

// The daemon looks for a holder's lock only where its slot says: a process
// holding its lock through a descriptor past thousands of others would
// otherwise cost a look through them all, for each slot it locks, at each
// tick. A slot that names the wrong descriptor leaves its holder unverified;
// naming the right one again verifies it again. A read lock, which needs no
// write access to the usage file, verifies nobody.
TEST_P(HostPidsTest, AHolderIsVerifiedThroughTheDescriptorItsSlotNamesOnly) {
  HostPidMemo memo_storage;
  HostPidMemo* memo = GetParam() ? &memo_storage : nullptr;
  TenantLedger d = make_daemon(1 << 30);
  int ready[2];
  ASSERT_EQ(pipe(ready), 0);
  const pid_t holder = spawn_holder(100, ready);
  int slot = -1;
  for (uint32_t s = 0; s < d.usage->slot_high_water.load(); ++s)
    if (d.usage->slots[s].pid.load() == holder) slot = static_cast<int>(s);
  ASSERT_GE(slot, 0);
  const int32_t fd = d.usage->slots[slot].lock_fd.load();
  EXPECT_GE(fd, 0) << "claim_slot names the descriptor it locked through";
  int32_t verified[kMaxSlots];
  auto verified_pids = [&] {
    fracgpu::ledger::record_host_pids(d, verified, memo);
    std::vector<int32_t> found;
    for (const int32_t pid : verified)
      if (pid != 0) found.push_back(pid);
    return found;
  };
  EXPECT_EQ(verified_pids(), std::vector<int32_t>{holder});
  d.usage->slots[slot].lock_fd.store(fd + 7);  // the holder's word, wrong
  EXPECT_EQ(verified_pids(), std::vector<int32_t>{}) << "looked for only where the slot says";
  EXPECT_EQ(verified_pids(), std::vector<int32_t>{}) << "and again";
  d.usage->slots[slot].lock_fd.store(fd);
  EXPECT_EQ(verified_pids(), std::vector<int32_t>{holder}) << "a new word is looked at anew";

  // A read lock on another slot's byte, through a read-only descriptor that
  // slot names.
  const int other = slot + 1;
  int told[2];
  ASSERT_EQ(pipe(told), 0);
  const pid_t reader = fork();
  if (reader == 0) {
    const int rd = open((tenant_dir_ + "/usage").c_str(), O_RDONLY | O_CLOEXEC);
    struct flock fl {};
    fl.l_type = F_RDLCK;
    fl.l_whence = SEEK_SET;
    fl.l_start = slot_lock_offset(other);
    fl.l_len = 1;
    const int32_t said = rd >= 0 && fcntl(rd, F_SETLK, &fl) == 0 ? rd : -1;
    if (write(told[1], &said, sizeof said) != sizeof said) _exit(1);
    pause();
    _exit(0);
  }
  int32_t reader_fd = -1;
  ASSERT_EQ(read(told[0], &reader_fd, sizeof reader_fd), static_cast<ssize_t>(sizeof reader_fd));
  ASSERT_GE(reader_fd, 0) << "could not take a read lock";
  d.usage->slots[other].lock_fd.store(reader_fd);
  EXPECT_EQ(slot_owner_pid(d, other), reader) << "F_GETLK alone names the reader";
  EXPECT_EQ(verified_pids(), std::vector<int32_t>{holder});
  for (const pid_t pid : {holder, reader}) {
    kill(pid, SIGKILL);
    waitpid(pid, nullptr, 0);
  }
  close_ledger(&d);
  for (const int p : {ready[0], ready[1], told[0], told[1]}) close(p);
}

INSTANTIATE_TEST_SUITE_P(WithAndWithoutMemo, HostPidsTest, ::testing::Bool(),
                         [](const ::testing::TestParamInfo<bool>& info) { return info.param ? "Memo" : "NoMemo"; });

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
  sigset_t mask_before;
  ASSERT_EQ(pthread_sigmask(SIG_SETMASK, nullptr, &mask_before), 0);
  for (int round = 0; round < 3; ++round) {  // the guard re-arms after each jump
    seen = 1;
    EXPECT_FALSE(fracgpu::shm::sigbus_guarded([&] { seen = map[bytes / 8 - 1]; }));
    EXPECT_EQ(seen, 1u);
    // The jump leaves the thread's signal mask as it found it.
    sigset_t mask_after;
    ASSERT_EQ(pthread_sigmask(SIG_SETMASK, nullptr, &mask_after), 0);
    for (int sig = 1; sig < NSIG; ++sig) EXPECT_EQ(sigismember(&mask_after, sig), sigismember(&mask_before, sig)) << sig;
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

namespace {

// A file outside the tenant directory that a planted link points at: it must
// come out of every open exactly as it went in.
struct Canary {
  std::string path, content;
  explicit Canary(const std::string& p, std::string text = "host file: not the ledger's\n")
      : path(p), content(std::move(text)) {
    FILE* f = fopen(path.c_str(), "w");
    fwrite(content.data(), 1, content.size(), f);
    fclose(f);
    chmod(path.c_str(), 0600);
  }
  ::testing::AssertionResult untouched() const {
    struct stat st {};
    if (lstat(path.c_str(), &st) != 0) return ::testing::AssertionFailure() << path << " is gone";
    FILE* f = fopen(path.c_str(), "r");
    std::string now(content.size() + 1, '\0');
    now.resize(fread(now.data(), 1, now.size(), f));
    fclose(f);
    if (now != content) return ::testing::AssertionFailure() << path << " was rewritten (" << now.size() << " bytes)";
    if ((st.st_mode & 07777) != 0600) return ::testing::AssertionFailure() << path << " mode " << std::oct << st.st_mode;
    return ::testing::AssertionSuccess();
  }
};

}  // namespace

// The daemon used to create its files under <name>.tmp.<pid> with O_CREAT |
// O_TRUNC, following a link a tenant planted there: any host file could be
// truncated and made world-writable. Now nothing is written through a name.
TEST_F(LedgerTest, TheDaemonNeverWritesThroughLinksPlantedUnderItsNames) {
  const Canary canary(dir_ + "/canary");
  fs::create_directories(tenant_dir_);
  for (const char* name : {"policy", "usage"})
    ASSERT_EQ(symlink(canary.path.c_str(), (tenant_dir_ + "/" + name + ".tmp." + std::to_string(getpid())).c_str()),
              0);
  TenantLedger d = make_daemon(1 << 20);
  ASSERT_TRUE(d.is_open());
  EXPECT_TRUE(canary.untouched());
  struct stat st {};
  ASSERT_EQ(lstat((tenant_dir_ + "/usage").c_str(), &st), 0);
  EXPECT_TRUE(S_ISREG(st.st_mode));
  close_ledger(&d);

  // The files themselves as links (to a file of the right size, even):
  // refused, never mapped, never followed, for every kind of caller.
  fs::remove(tenant_dir_ + "/usage");
  const Canary big(dir_ + "/canary-big", std::string(sizeof(UsageSegment), '\0'));
  ASSERT_EQ(symlink(big.path.c_str(), (tenant_dir_ + "/usage").c_str()), 0);
  for (AccessMode mode : {AccessMode::kDaemon, AccessMode::kTenant, AccessMode::kReadOnly}) {
    TenantLedger t;
    char err[512] = {};
    EXPECT_EQ(open_ledger(tenant_dir_.c_str(), mode, "alice", &t, err, sizeof err), LedgerError::kRefused);
    EXPECT_NE(std::string(err).find("usage: refused: not a regular file (a symbolic link)"), std::string::npos) << err;
  }
  EXPECT_TRUE(big.untouched());
}

// A FIFO where a file should be is never opened (an open for reading would
// wait for a writer for ever), and neither is a device.
TEST_F(LedgerTest, FifosAndDevicesAreRefusedWithoutBeingOpened) {
  TenantLedger d = make_daemon(1 << 20);
  close_ledger(&d);
  fs::remove(tenant_dir_ + "/policy");
  ASSERT_EQ(mkfifo((tenant_dir_ + "/policy").c_str(), 0644), 0);
  char err[512] = {};
  TenantLedger t;
  EXPECT_EQ(open_ledger(tenant_dir_.c_str(), AccessMode::kReadOnly, nullptr, &t, err, sizeof err), LedgerError::kRefused);
  EXPECT_NE(std::string(err).find("policy: refused: not a regular file (a FIFO)"), std::string::npos) << err;
  fs::remove(tenant_dir_ + "/policy");
  ASSERT_EQ(symlink("/dev/zero", (tenant_dir_ + "/policy").c_str()), 0);
  EXPECT_EQ(open_ledger(tenant_dir_.c_str(), AccessMode::kTenant, nullptr, &t, err, sizeof err), LedgerError::kRefused);
  EXPECT_NE(std::string(err).find("(a symbolic link)"), std::string::npos) << err;
}

// The daemon and the CLI accept only files of the daemon's user; the
// interposer does not check (in a user namespace owners may look different).
TEST_F(LedgerTest, FilesOfAnotherOwnerAreRefusedByTheDaemonAndTheCli) {
  if (geteuid() != 0) GTEST_SKIP() << "needs root to give a file away";
  TenantLedger d = make_daemon(1 << 20);
  close_ledger(&d);
  ASSERT_EQ(chown((tenant_dir_ + "/usage").c_str(), 65534, 65534), 0);
  char err[512] = {};
  TenantLedger t;
  EXPECT_EQ(open_ledger(tenant_dir_.c_str(), AccessMode::kDaemon, "alice", &t, err, sizeof err), LedgerError::kRefused);
  EXPECT_NE(std::string(err).find("usage: refused: owned by uid 65534, expected uid 0"), std::string::npos) << err;
  EXPECT_EQ(open_ledger(tenant_dir_.c_str(), AccessMode::kReadOnly, nullptr, &t, err, sizeof err),
            LedgerError::kRefused);
  ASSERT_EQ(open_ledger(tenant_dir_.c_str(), AccessMode::kTenant, nullptr, &t, err, sizeof err), LedgerError::kOk)
      << err;
  close_ledger(&t);
}

// Files are created with their blocks reserved: a store through a mapping
// can never fault for lack of space on a full file system.
TEST_F(LedgerTest, NewSegmentsAreNotSparse) {
  TenantLedger d = make_daemon(1 << 20);
  close_ledger(&d);
  for (auto [name, size] : {std::pair{"policy", sizeof(PolicySegment)}, {"usage", sizeof(UsageSegment)}}) {
    struct stat st {};
    ASSERT_EQ(stat((tenant_dir_ + "/" + name).c_str(), &st), 0);
    EXPECT_EQ(static_cast<size_t>(st.st_size), size);
    EXPECT_GE(static_cast<size_t>(st.st_blocks) * 512, size) << name << " is sparse";
  }
}

// Without O_TMPFILE, files are made under a random name in the daemon's
// private directory, never in the tenant's, and linked in from there.
TEST_F(LedgerTest, WithoutTmpfileNewFilesAreMadeInThePrivateDirectory) {
  fracgpu::shm::force_no_tmpfile_for_testing(true);
  TenantLedger d;
  char err[512] = {};
  EXPECT_EQ(open_ledger(tenant_dir_.c_str(), AccessMode::kDaemon, "alice", &d, err, sizeof err), LedgerError::kIo);
  EXPECT_NE(std::string(err).find("no O_TMPFILE and no private directory"), std::string::npos) << err;
  const std::string priv = dir_ + "/.tmp";
  ASSERT_EQ(mkdir(priv.c_str(), 0700), 0);
  const int priv_fd = open(priv.c_str(), O_RDONLY | O_DIRECTORY);
  fracgpu::shm::set_private_dir(priv_fd);
  const LedgerError e = open_ledger(tenant_dir_.c_str(), AccessMode::kDaemon, "alice", &d, err, sizeof err);
  fracgpu::shm::force_no_tmpfile_for_testing(false);
  fracgpu::shm::set_private_dir(-1);
  close(priv_fd);
  ASSERT_EQ(e, LedgerError::kOk) << err;
  EXPECT_STREQ(d.policy->tenant, "alice");
  EXPECT_EQ(d.usage->header.magic, kUsageMagic);
  close_ledger(&d);
  EXPECT_TRUE(fs::is_empty(priv));
  std::vector<std::string> names;
  for (const auto& entry : fs::directory_iterator(tenant_dir_)) names.push_back(entry.path().filename());
  std::sort(names.begin(), names.end());
  EXPECT_EQ(names, (std::vector<std::string>{"node", "policy", "usage"}));
}

TEST_F(LedgerTest, AUsageFileGrownPastTheLayoutIsCutBackAndAShrunkOneReported) {
  TenantLedger d = make_daemon(1 << 20);
  TenantLedger t = open_tenant();
  ProcessIdentity self{};
  read_self_identity(&self);
  const int slot = claim_slot(t, self, nullptr);
  ASSERT_GE(slot, 0);
  ASSERT_TRUE(try_charge(t, 0, slot, 4096));
  EXPECT_EQ(enforce_usage_size(d, nullptr), UsageSize::kOk);
  const char byte = 1;
  ASSERT_EQ(pwrite(t.usage_fd, &byte, 1, 100 << 20), 1);  // a tenant filling the disk
  uint64_t seen = 0;
  EXPECT_EQ(enforce_usage_size(d, &seen), UsageSize::kTruncated);
  EXPECT_EQ(seen, (100u << 20) + 1);
  struct stat st {};
  ASSERT_EQ(fstat(d.usage_fd, &st), 0);
  EXPECT_EQ(static_cast<size_t>(st.st_size), sizeof(UsageSegment));
  EXPECT_EQ(tenant_used(*d.usage, 0), 4096u);  // nothing of the layout lost
  ASSERT_EQ(ftruncate(t.usage_fd, 100), 0);
  EXPECT_EQ(enforce_usage_size(d, &seen), UsageSize::kShrunk);
  EXPECT_EQ(seen, 100u);
  close_ledger(&t);
  close_ledger(&d);
}

TEST_F(LedgerTest, TenantStateIsAPolicyOrAUsageFileOrAnythingByThoseNames) {
  EXPECT_FALSE(has_tenant_state(tenant_dir_.c_str()));  // no directory
  fs::create_directories(tenant_dir_);
  EXPECT_FALSE(has_tenant_state(tenant_dir_.c_str()));  // empty
  ASSERT_EQ(symlink("/nonexistent", (tenant_dir_ + "/usage").c_str()), 0);
  EXPECT_TRUE(has_tenant_state(tenant_dir_.c_str()));  // a dangling link counts
  fs::remove(tenant_dir_ + "/usage");
  TenantLedger d = make_daemon(1 << 20);
  close_ledger(&d);
  fs::remove(tenant_dir_ + "/usage");
  EXPECT_TRUE(has_tenant_state(tenant_dir_.c_str()));  // a policy alone
}
