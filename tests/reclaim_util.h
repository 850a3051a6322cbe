// Shared by the ledger and interposer tests.
#pragma once

#include <chrono>
#include <thread>

#include "ledger.h"

namespace fracgpu::ledger {

// Reclaims dead slots the way the daemon does over two passes: the first
// sees the owners gone, the second, after the grace period, clears them.
inline int reclaim_settled(TenantLedger& ledger, int own_slot, uint64_t* bytes) {
  ReclaimResult first = reclaim_dead_slots(ledger, own_slot);
  std::this_thread::sleep_for(std::chrono::nanoseconds(kReclaimGraceNs) + std::chrono::milliseconds(5));
  ReclaimResult second = reclaim_dead_slots(ledger, own_slot);
  *bytes = first.bytes + second.bytes;
  return first.reclaimed + second.reclaimed;
}

}  // namespace fracgpu::ledger
