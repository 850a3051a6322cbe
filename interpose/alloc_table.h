// What this process has charged, by device pointer or handle, so that each
// release gives back exactly what its allocation took.
//
// A fixed-capacity open-addressing table with linear probing, mapped once at
// attach: insert and remove are a few atomic operations, never a lock or an
// allocation. Keys are unique while live (the driver does not hand out the
// same pointer twice), so a key is inserted and removed by at most one
// thread at a time; other threads only probe past it.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>

namespace fracgpu::interpose {

enum class ChargeKind : uint8_t {
  kLinear,     // cuMemAlloc, cuMemAllocPitch: freed with their context
  kManaged,    // cuMemAllocManaged: freed with their context
  kAsync,      // stream-ordered: `owner` is the pool; charged through the pool
  kVmm,        // a mapping of a cuMemCreate allocation (cuMemMap): `owner` is its handle,
               // `bytes` the mapped size; charged through the handle (memory_vmm.cpp)
  kArray,      // cuArrayCreate / cuArray3DCreate: freed with their context
  kMipmapped,  // cuMipmappedArrayCreate: freed with their context
  kContext,    // a regular context's footprint
};

struct ChargeRecord {
  uint64_t bytes = 0;  // charged to the ledger (0 for kAsync: the pool holds the charge)
  uint64_t owner = 0;  // the context it belongs to, or the pool for kAsync
  uint32_t gpu = 0;    // ledger GPU entry
  ChargeKind kind = ChargeKind::kLinear;
};

class ChargeTable {
 public:
  // Maps room for 2^log2_capacity records. Not thread-safe; call once.
  bool init(unsigned log2_capacity);
  // Drops every record (after fork, in the child). Not thread-safe.
  void reset();
  bool ready() const { return entries_ != nullptr; }

  bool insert(uint64_t key, const ChargeRecord& record);
  bool remove(uint64_t key, ChargeRecord* out);

  // Removes and reports every record for which pred(record) holds. Slow
  // path (context teardown); safe alongside concurrent inserts/removes.
  template <class Pred, class Sink>
  void remove_if(Pred&& pred, Sink&& sink) {
    for (size_t i = 0; i < capacity_; ++i) {
      Entry& e = entries_[i];
      uint64_t key = e.key.load(std::memory_order_acquire);
      if (key <= kBusy) continue;
      ChargeRecord r{e.bytes, e.owner, e.gpu, e.kind};
      if (!pred(r)) continue;
      if (e.key.compare_exchange_strong(key, kTombstone, std::memory_order_acq_rel)) sink(r);
    }
  }

 private:
  // Key values with a meaning of their own; real keys are never this small.
  static constexpr uint64_t kEmpty = 0;
  static constexpr uint64_t kTombstone = 1;
  static constexpr uint64_t kBusy = 2;  // being written

  struct Entry {
    std::atomic<uint64_t> key;
    uint64_t bytes;
    uint64_t owner;
    uint32_t gpu;
    ChargeKind kind;
  };
  static_assert(sizeof(Entry) == 32);

  // Where a key's probe starts. Keys are mostly device addresses, aligned to
  // at least 256 bytes. Hashing each key to a random slot put every new
  // allocation's record on a cold cache line of a multi-MiB table (most of
  // the interposer's cost per allocation, docs/performance.md); instead the
  // 64 KiB region of the address is hashed and the address's 256-byte step
  // within it picks one of 256 consecutive slots, so a burst of allocations
  // close together shares a few lines and one page of the table, while
  // regions still spread over the whole table.
  size_t slot_of(uint64_t key) const {
    const uint64_t region_start = ((key >> 16) * 0x9E3779B97F4A7C15ull) >> (64 - log2_capacity_);
    const uint64_t step = (key >> 8) & (kSlotsPerRegion - 1);
    return static_cast<size_t>(region_start + step) & (capacity_ - 1);
  }
  static constexpr uint64_t kSlotsPerRegion = 256;

  Entry* entries_ = nullptr;
  size_t capacity_ = 0;
  unsigned log2_capacity_ = 0;
};

}  // namespace fracgpu::interpose
