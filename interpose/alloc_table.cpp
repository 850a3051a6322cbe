#include "alloc_table.h"

#include <sys/mman.h>

namespace fracgpu::interpose {

bool ChargeTable::init(unsigned log2_capacity) {
  const size_t capacity = size_t{1} << log2_capacity;
  // Anonymous memory is zero (all entries kEmpty) and paged in on touch, so
  // a large capacity costs only what is used.
  void* map = mmap(nullptr, capacity * sizeof(Entry), PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (map == MAP_FAILED) return false;
  entries_ = static_cast<Entry*>(map);
  capacity_ = capacity;
  log2_capacity_ = log2_capacity;
  return true;
}

void ChargeTable::reset() {
  if (entries_ != nullptr) madvise(entries_, capacity_ * sizeof(Entry), MADV_DONTNEED);
}

bool ChargeTable::insert(uint64_t key, const ChargeRecord& record) {
  if (key <= kBusy || entries_ == nullptr) return false;
  size_t i = slot_of(key);
  for (size_t probes = 0; probes < capacity_; ++probes, i = (i + 1) & (capacity_ - 1)) {
    Entry& e = entries_[i];
    uint64_t seen = e.key.load(std::memory_order_relaxed);
    if (seen != kEmpty && seen != kTombstone) continue;
    // Reusing tombstones keeps the table from filling up; lookups stay
    // correct because an entry never goes back to kEmpty, so no probe
    // sequence is ever cut short.
    if (!e.key.compare_exchange_strong(seen, kBusy, std::memory_order_acquire)) continue;
    e.bytes = record.bytes;
    e.owner = record.owner;
    e.gpu = record.gpu;
    e.kind = record.kind;
    e.key.store(key, std::memory_order_release);
    return true;
  }
  return false;
}

bool ChargeTable::remove(uint64_t key, ChargeRecord* out) {
  if (key <= kBusy || entries_ == nullptr) return false;
  size_t i = slot_of(key);
  for (size_t probes = 0; probes < capacity_; ++probes, i = (i + 1) & (capacity_ - 1)) {
    Entry& e = entries_[i];
    uint64_t seen = e.key.load(std::memory_order_acquire);
    if (seen == kEmpty) return false;
    if (seen != key) continue;
    ChargeRecord r{e.bytes, e.owner, e.gpu, e.kind};
    if (!e.key.compare_exchange_strong(seen, kTombstone, std::memory_order_acq_rel)) return false;
    if (out) *out = r;
    return true;
  }
  return false;
}

}  // namespace fracgpu::interpose
