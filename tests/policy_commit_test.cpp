// Atomic policy changes (ledger_layout.h, shm/ledger.h "Policy writes"):
// several tenants share one node file; a change writes each tenant's copy not
// in force, then commits with one store. Readers must see, on every tenant,
// the whole old policy or the whole new one: before the commit, after it, if
// the writer dies at any step, and while a writer keeps rewriting copies
// under them.
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <atomic>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "ledger.h"

using namespace fracgpu::ledger;
namespace fs = std::filesystem;

namespace {

constexpr int kTenants = 3;
constexpr uint32_t kEntries = 4;  // GPU entries each tenant has granted

uint8_t uuid_of(uint32_t entry) { return static_cast<uint8_t>(0xc0 + entry); }

// What `policy` (a number) grants tenant t on entry g: every field differs
// between policies and between entries, so a copy mixing two is visible.
GpuEntry planned(uint64_t policy, int t, uint32_t g) {
  GpuEntry e;
  e.state = kGpuGranted;
  e.uuid[0] = uuid_of(g);
  e.memory_quota = (policy << 20) + static_cast<uint64_t>(t) * 100 + g;
  e.context_memory = policy * 7 + g;
  e.share_ppm = static_cast<uint32_t>(policy % 1'000'000);
  e.limit_ppm = static_cast<uint32_t>((policy + g) % 1'000'000);
  e.flags = static_cast<uint32_t>(policy & 1);
  return e;
}

// Which policy a table read whole holds: -1 if it matches none (a mix), or
// nothing granted (0: no policy yet).
int64_t policy_of(const GpuTable& table, int t) {
  if (table.gpus[0].state == kGpuUnused) {
    for (const GpuEntry& e : table.gpus)
      if (e.state != kGpuUnused) return -1;
    return 0;
  }
  const uint64_t policy = table.gpus[0].memory_quota >> 20;
  for (uint32_t g = 0; g < kMaxGpus; ++g) {
    const GpuEntry expected = g < kEntries ? planned(policy, t, g) : GpuEntry{};
    if (!(table.gpus[g] == expected)) return -1;
  }
  return static_cast<int64_t>(policy);
}

class PolicyCommit : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/fracgpu-commit-XXXXXX";
    ASSERT_NE(mkdtemp(tmpl), nullptr);
    root_ = tmpl;
    char err[256] = {};
    ASSERT_EQ(open_node(root_.c_str(), &node_, &node_fd_, err, sizeof err), LedgerError::kOk) << err;
    // As fracgpud lays it out: the node file linked into every tenant dir first.
    for (int t = 0; t < kTenants; ++t) {
      const std::string dir = root_ + "/t" + std::to_string(t);
      fs::create_directories(dir);
      ASSERT_EQ(link((root_ + "/node").c_str(), (dir + "/node").c_str()), 0);
      ASSERT_EQ(open_ledger(dir.c_str(), AccessMode::kDaemon, ("t" + std::to_string(t)).c_str(), &daemon_[t], err,
                            sizeof err),
                LedgerError::kOk)
          << err;
      ASSERT_EQ(open_ledger(dir.c_str(), AccessMode::kTenant, nullptr, &tenant_[t], err, sizeof err), LedgerError::kOk)
          << err;
    }
  }
  void TearDown() override {
    for (int t = 0; t < kTenants; ++t) {
      close_ledger(&daemon_[t]);
      close_ledger(&tenant_[t]);
    }
    close_node(node_, node_fd_);
    fs::remove_all(root_);
  }

  // Writes `policy` into every tenant's copy for the next generation; with
  // commit, commits it and retires the old copies. `step` is called after
  // every store-level step (the mark, each entry, the stamp; the commit; each
  // retirement) with its number.
  static constexpr int kCommitStep = kTenants * (kEntries + 2);
  static constexpr int kSteps = kCommitStep + 1 + kTenants;
  template <typename Step>
  uint64_t change(uint64_t policy, bool commit, Step&& step) {
    const uint64_t previous = node_->committed.load();
    uint64_t next = previous + 1;
    for (TenantLedger& l : daemon_) next = next_generation(next, l);
    int n = 0;
    for (int t = 0; t < kTenants; ++t) {
      GpuPolicy* gpus = begin_policy_copy(daemon_[t], next);
      step(n++);
      for (uint32_t g = 0; g < kEntries; ++g) {
        store_gpu_entry(gpus[g], planned(policy, t, g));
        step(n++);
      }
      end_policy_copy(daemon_[t], next);
      step(n++);
    }
    if (commit) {
      commit_generation(*node_, next);
      step(n++);
      for (TenantLedger& l : daemon_) {
        retire_policy_copy(l, previous);
        step(n++);
      }
    }
    return next;
  }
  uint64_t change(uint64_t policy, bool commit = true) {
    return change(policy, commit, [](int) {});
  }

  // The policy every tenant's process sees, read as the interposer reads it;
  // -1 if any tenant's table is a mix or they disagree.
  int64_t seen_everywhere() {
    int64_t agreed = -2;
    for (int t = 0; t < kTenants; ++t) {
      GpuTable table;
      read_gpu_table(tenant_[t], &table);
      const int64_t p = policy_of(table, t);
      if (p < 0 || (agreed != -2 && p != agreed)) return -1;
      agreed = p;
    }
    return agreed;
  }

  std::string root_;
  NodeSegment* node_ = nullptr;
  int node_fd_ = -1;
  TenantLedger daemon_[kTenants];
  TenantLedger tenant_[kTenants];
};

TEST_F(PolicyCommit, ReadersSeeNothingNewUntilTheCommitThenAllOfIt) {
  EXPECT_EQ(seen_everywhere(), 0);
  change(1);
  EXPECT_EQ(seen_everywhere(), 1);
  const uint64_t generation = node_->committed.load();
  change(2, /*commit=*/false);  // every copy written, not committed
  EXPECT_EQ(seen_everywhere(), 1);
  EXPECT_EQ(node_->committed.load(), generation);
  commit_generation(*node_, generation + 1);
  EXPECT_EQ(seen_everywhere(), 2);
  // The interposer's hot path reads the same copy.
  ProcessIdentity self{};
  ASSERT_TRUE(read_self_identity(&self));
  const int slot = claim_slot(tenant_[1], self, nullptr);
  ASSERT_GE(slot, 0);
  const uint64_t quota = planned(2, 1, 0).memory_quota;
  EXPECT_TRUE(try_charge(tenant_[1], 0, static_cast<uint32_t>(slot), quota));
  EXPECT_FALSE(try_charge(tenant_[1], 0, static_cast<uint32_t>(slot), 1));
  uncharge(*tenant_[1].usage, 0, static_cast<uint32_t>(slot), quota);
  release_slot(tenant_[1], static_cast<uint32_t>(slot));
}

TEST_F(PolicyCommit, ATenantWithoutACopyOfTheCommittedGenerationGetsNothing) {
  change(1);
  // A commit for which tenant 2's copy was never written (a tenant the
  // daemon did not know of): it grants nothing rather than an older policy.
  const uint64_t next = node_->committed.load() + 1;
  for (int t = 0; t < 2; ++t) {
    begin_policy_copy(daemon_[t], next);
    end_policy_copy(daemon_[t], next);
  }
  commit_generation(*node_, next);
  GpuTable table;
  EXPECT_FALSE(read_gpu_table(tenant_[2], &table));
  EXPECT_EQ(policy_of(table, 2), 0);
  EXPECT_EQ(find_gpu(tenant_[2], std::array<uint8_t, 16>{uuid_of(0)}.data()), -1);
  EXPECT_EQ(read_gpu_entry(tenant_[2], 0).state, kGpuUnused);
  // The daemon still knows the bindings its live charges are indexed by.
  latest_gpu_table(daemon_[2], &table);
  EXPECT_EQ(policy_of(table, 2), 1);
}

TEST_F(PolicyCommit, KilledAtAnyStepTheWriterLeavesTheOldPolicyOrTheNewEverywhere) {
  constexpr uint64_t before = 1, after = 2;
  change(before);
  int old_seen = 0, new_seen = 0;
  for (int kill_after = -1; kill_after < kSteps; ++kill_after) {
    ASSERT_EQ(seen_everywhere(), static_cast<int64_t>(before));
    const pid_t writer = fork();
    if (writer == 0) {
      if (kill_after < 0) raise(SIGKILL);
      change(after, true, [&](int n) {
        if (n == kill_after) raise(SIGKILL);
      });
      _exit(0);
    }
    int status = 0;
    ASSERT_EQ(waitpid(writer, &status, 0), writer);
    ASSERT_TRUE(WIFSIGNALED(status)) << "step " << kill_after;
    const int64_t seen = seen_everywhere();
    if (kill_after >= kCommitStep) EXPECT_EQ(seen, static_cast<int64_t>(after)) << "killed after step " << kill_after;
    else EXPECT_EQ(seen, static_cast<int64_t>(before)) << "killed after step " << kill_after << " of " << kSteps;
    (seen == static_cast<int64_t>(before) ? old_seen : new_seen) += 1;
    // The next daemon starts over from what it finds, and then commits; and
    // the next round starts from the old policy again.
    change(after);
    ASSERT_EQ(seen_everywhere(), static_cast<int64_t>(after));
    change(before);
  }
  EXPECT_EQ(old_seen, kCommitStep + 1);  // killed before any step, and after each step before the commit
  EXPECT_EQ(new_seen, 1 + kTenants);     // after the commit, and after each retirement
}

TEST_F(PolicyCommit, NoNodeFileCanPointATenantBackAtAnOlderPolicy) {
  change(1);
  const uint64_t first = node_->committed.load();
  change(2);
  EXPECT_EQ(seen_everywhere(), 2);
  // A node file saying `first` (a stale one, or one written by someone who
  // should not): the copy of `first` was retired at the commit, so it grants
  // nothing rather than the older, perhaps larger, quotas.
  node_->committed.store(first);
  EXPECT_EQ(seen_everywhere(), 0);
  ProcessIdentity self{};
  ASSERT_TRUE(read_self_identity(&self));
  const int slot = claim_slot(tenant_[0], self, nullptr);
  ASSERT_GE(slot, 0);
  EXPECT_FALSE(try_charge(tenant_[0], 0, static_cast<uint32_t>(slot), 1));
  release_slot(tenant_[0], static_cast<uint32_t>(slot));
}

// A writer rewrites copies as fast as it can while readers read: every table
// a reader accepts must be one policy whole, on every path readers use.
TEST_F(PolicyCommit, ConcurrentReadersNeverAcceptAHalfRewrittenCopy) {
  change(1);
  std::atomic<bool> stop{false};
  std::atomic<uint64_t> accepted{0}, mixed{0}, discarded{0};
  std::thread writer([&] {
    for (uint64_t policy = 2; !stop.load(); ++policy) change(policy);
  });
  std::vector<std::thread> readers;
  for (int r = 0; r < 2; ++r) {
    readers.emplace_back([&, r] {
      const int t = r;
      while (!stop.load()) {
        GpuTable table;
        if (read_gpu_table(tenant_[t], &table)) {
          (policy_of(table, t) > 0 ? accepted : mixed).fetch_add(1);
        } else {
          discarded.fetch_add(1);
        }
        // The hot path's two fields, as try_charge reads them.
        const CommittedGpus c = committed_gpus(tenant_[t]);
        const uint64_t quota = c.gpus[1].memory_quota.load(std::memory_order_acquire);
        const uint64_t context = c.gpus[1].context_memory.load(std::memory_order_acquire);
        if (still_committed(c) && context != (quota >> 20) * 7 + 1) mixed.fetch_add(1);
      }
    });
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(700));
  stop.store(true);
  writer.join();
  for (std::thread& r : readers) r.join();
  EXPECT_EQ(mixed.load(), 0u) << accepted.load() << " tables accepted";
  EXPECT_GT(accepted.load(), 1000u);
  printf("policy reads: %llu accepted whole, %llu given up (writer faster than the retries), %llu mixed\n",
         static_cast<unsigned long long>(accepted.load()), static_cast<unsigned long long>(discarded.load()),
         static_cast<unsigned long long>(mixed.load()));
}

}  // namespace
