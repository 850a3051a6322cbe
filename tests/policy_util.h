// Playing the daemon's part in policy writes, for tests: a change is written
// into the copy of the policy not in force and committed with one store into
// the node file, as fracgpud does (shm/ledger.h, "Policy writes"). Only for a
// ledger with a node file of its own (open_ledger(kDaemon) creates one in a
// directory that has none): a commit on a node file shared with other
// ledgers would leave those granting nothing.
#pragma once

#include <cstdint>

#include "ledger.h"

namespace fracgpu::testing {

// Copies the tenant's table into the next generation's copy, lets edit(gpus)
// change it, and commits it. Returns the generation committed.
template <typename Edit>
uint64_t publish_policy(ledger::TenantLedger& daemon, Edit&& edit) {
  const uint64_t previous = daemon.node->committed.load(std::memory_order_acquire);
  const uint64_t next = ledger::next_generation(previous + 1, daemon);
  ledger::GpuPolicy* gpus = ledger::begin_policy_copy(daemon, next);
  edit(gpus);
  ledger::end_policy_copy(daemon, next);
  ledger::commit_generation(*daemon.node, next);
  ledger::retire_policy_copy(daemon, previous);
  return next;
}

// Writes `table` (every entry) as the next generation and commits it.
inline uint64_t publish_table(ledger::TenantLedger& daemon, const ledger::GpuTable& table) {
  return publish_policy(daemon, [&](ledger::GpuPolicy* gpus) {
    for (uint32_t g = 0; g < ledger::kMaxGpus; ++g) ledger::store_gpu_entry(gpus[g], table.gpus[g]);
  });
}

// Grants GPU `uuid`: binds it (or finds its entry) and fills its limits.
// Returns the entry.
inline int grant_gpu(ledger::TenantLedger& daemon, const uint8_t uuid[16], uint64_t quota,
                     uint64_t context_memory = 0, uint32_t flags = ledger::kCountManagedMemory) {
  int entry = -1;
  publish_policy(daemon, [&](ledger::GpuPolicy* gpus) {
    entry = ledger::bind_gpu(gpus, uuid);
    if (entry < 0) return;
    gpus[entry].memory_quota.store(quota);
    gpus[entry].context_memory.store(context_memory);
    gpus[entry].flags.store(flags);
    gpus[entry].state.store(ledger::kGpuGranted);
  });
  return entry;
}

}  // namespace fracgpu::testing
