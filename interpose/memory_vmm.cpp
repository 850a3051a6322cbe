// Virtual memory management: the physical allocations of cuMemCreate.
//
// The driver frees one when nothing refers to it any more: its handle
// (cuMemCreate's, and one more for each cuMemRetainAllocationHandle, each
// ended by a cuMemRelease) and every mapping of it (cuMemMap, ended by
// cuMemUnmap). A common pattern maps the memory and releases the handle at
// once, leaving the mapping as its only owner, so the charge follows the same
// count: it goes back when the count reaches zero, not at cuMemRelease.
//
// Handles live in a fixed open-addressing table (lock-free, like the charge
// tables); each mapping is a record in the pointer table, keyed by its
// address, naming its handle, so that cuMemUnmap knows which handles it ends.
#include "log.h"
#include "memory_hooks.h"

namespace fracgpu::interpose {

namespace {

constexpr size_t kMaxVmmHandles = 16384;  // power of two
constexpr uint64_t kEmpty = 0;
constexpr uint64_t kTombstone = 1;
constexpr uint64_t kBusy = 2;

struct VmmEntry {
  std::atomic<uint64_t> key;   // the handle, or kEmpty / kTombstone / kBusy
  std::atomic<int64_t> refs;   // the handle's references plus its mappings
  uint64_t bytes;
  uint32_t gpu;
};

VmmEntry g_vmm[kMaxVmmHandles];

size_t home_slot(uint64_t handle) {
  return static_cast<size_t>((handle * 0x9E3779B97F4A7C15ull) >> 50) & (kMaxVmmHandles - 1);
}

VmmEntry* find(uint64_t handle) {
  size_t i = home_slot(handle);
  for (size_t probes = 0; probes < kMaxVmmHandles; ++probes, i = (i + 1) & (kMaxVmmHandles - 1)) {
    const uint64_t key = g_vmm[i].key.load(std::memory_order_acquire);
    if (key == handle) return &g_vmm[i];
    if (key == kEmpty) return nullptr;
  }
  return nullptr;
}

}  // namespace

bool vmm_created(CUmemGenericAllocationHandle handle, uint64_t bytes, int gpu) {
  const auto key = static_cast<uint64_t>(handle);
  if (key <= kBusy) return false;
  size_t i = home_slot(key);
  for (size_t probes = 0; probes < kMaxVmmHandles; ++probes, i = (i + 1) & (kMaxVmmHandles - 1)) {
    uint64_t slot = g_vmm[i].key.load(std::memory_order_acquire);
    if ((slot == kEmpty || slot == kTombstone) &&
        g_vmm[i].key.compare_exchange_strong(slot, kBusy, std::memory_order_acq_rel)) {
      g_vmm[i].bytes = bytes;
      g_vmm[i].gpu = static_cast<uint32_t>(gpu);
      g_vmm[i].refs.store(1, std::memory_order_relaxed);
      g_vmm[i].key.store(key, std::memory_order_release);
      return true;
    }
  }
  FRACGPU_LOG_ONCE(LogLevel::kError, "more than %zu VMM allocations: further ones are refused", kMaxVmmHandles);
  return false;
}

bool vmm_ref(CUmemGenericAllocationHandle handle) {
  VmmEntry* e = find(static_cast<uint64_t>(handle));
  if (e == nullptr) return false;  // not charged through us (made before attach, or imported)
  e->refs.fetch_add(1, std::memory_order_acq_rel);
  return true;
}

void vmm_unref(CUmemGenericAllocationHandle handle) {
  VmmEntry* e = find(static_cast<uint64_t>(handle));
  if (e == nullptr || e->refs.fetch_sub(1, std::memory_order_acq_rel) != 1) return;
  // The last reference: the driver has freed the memory.
  const uint64_t bytes = e->bytes;
  const int gpu = static_cast<int>(e->gpu);
  e->key.store(kTombstone, std::memory_order_release);
  unreserve(gpu, bytes);
}

bool vmm_record_mapping(CUdeviceptr va, size_t bytes, CUmemGenericAllocationHandle handle) {
  if (!vmm_ref(handle)) return true;  // nothing charged to follow
  if (record_pointer(va, {bytes, static_cast<uint64_t>(handle), 0, ChargeKind::kVmm})) return true;
  vmm_unref(handle);
  return false;
}

int vmm_forget_mappings(CUdeviceptr* va, CUdeviceptr end, VmmMapping* out, int capacity) {
  // Mappings tile an unmapped range exactly (the driver refuses anything
  // else): walk them from its start.
  int n = 0;
  while (*va < end && n < capacity) {
    ChargeRecord r;
    if (!forget_pointer(*va, &r)) break;
    if (r.kind != ChargeKind::kVmm || r.bytes == 0) {
      record_pointer(*va, r);  // not a mapping: not ours to take
      break;
    }
    out[n++] = {*va, r};
    *va += r.bytes;
  }
  return n;
}

void reset_vmm() {
  for (auto& e : g_vmm) {
    e.key.store(kEmpty, std::memory_order_relaxed);
    e.refs.store(0, std::memory_order_relaxed);
  }
}

}  // namespace fracgpu::interpose
