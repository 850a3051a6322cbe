// Out-of-line parts of the memory hooks: records, arrays, primary contexts
// (pools: memory_pools.cpp). Nothing here runs on the common allocation path except
// record/forget (a few atomics each).
#include <sched.h>

#include <algorithm>

#include "log.h"
#include "memory_held.h"
#include "memory_hooks.h"

namespace fracgpu::interpose {

bool record_pointer(uint64_t key, const ChargeRecord& record) {
  if (g_pointers.insert(key, record)) [[likely]]
    return true;
  FRACGPU_LOG_ONCE(LogLevel::kError, "allocation table full: further allocations are refused");
  return false;
}

bool record_handle(uint64_t key, const ChargeRecord& record) {
  if (g_handles.insert(key, record)) [[likely]]
    return true;
  FRACGPU_LOG_ONCE(LogLevel::kError, "handle table full: further arrays, VMM handles and contexts are refused");
  return false;
}

bool forget_pointer(uint64_t key, ChargeRecord* out) { return g_pointers.remove(key, out); }
bool forget_handle(uint64_t key, ChargeRecord* out) { return g_handles.remove(key, out); }

void release_context_records(uint64_t ctx) {
  // Destroying a context frees its linear, managed and array memory; VMM
  // and stream-ordered memory outlive it (CUDA driver API, cuCtxDestroy).
  auto belongs = [ctx](const ChargeRecord& r) {
    return r.owner == ctx && (r.kind == ChargeKind::kLinear || r.kind == ChargeKind::kManaged ||
                              r.kind == ChargeKind::kArray || r.kind == ChargeKind::kMipmapped);
  };
  auto give_back = [](const ChargeRecord& r) { unreserve(static_cast<int>(r.gpu), r.bytes); };
  g_pointers.remove_if(belongs, give_back);
  g_handles.remove_if(belongs, give_back);
}

bool settle(int gpu, uint64_t reserved, uint64_t actual) {
  if (actual > reserved) return reserve(gpu, actual - reserved);
  unreserve(gpu, reserved - actual);
  return true;
}

// ---- Arrays ----

namespace {

uint64_t format_bytes(CUarray_format format) {
  switch (format) {
    case CU_AD_FORMAT_UNSIGNED_INT8:
    case CU_AD_FORMAT_SIGNED_INT8:
      return 1;
    case CU_AD_FORMAT_UNSIGNED_INT16:
    case CU_AD_FORMAT_SIGNED_INT16:
    case CU_AD_FORMAT_HALF:
      return 2;
    case CU_AD_FORMAT_UNSIGNED_INT32:
    case CU_AD_FORMAT_SIGNED_INT32:
    case CU_AD_FORMAT_FLOAT:
      return 4;
    default:
      return 16;  // block-compressed and newer formats: never under-reserve
  }
}

// Reserved before the driver call, so meant to be at least what the driver
// takes: rows padded to 512 bytes and heights to 32 rows (tiled layouts pad
// both), the whole rounded up to 2 MiB (the allocation granularity). The
// driver's own figure (cu*GetMemoryRequirements) is settled to after the
// call; a driver that took more than this is charged after the fact.
constexpr uint64_t kArrayRowAlign = 512;
constexpr uint64_t kArrayHeightAlign = 32;
constexpr uint64_t kArrayGranularity = 2ull << 20;

uint64_t round_up(uint64_t v, uint64_t align) { return (v + align - 1) / align * align; }

uint64_t padded_extent(uint64_t width, uint64_t height, uint64_t depth, unsigned channels, CUarray_format format) {
  const uint64_t row = round_up(std::max<uint64_t>(width, 1) * std::max(channels, 1u) * format_bytes(format),
                                kArrayRowAlign);
  const uint64_t rows = height > 1 ? round_up(height, kArrayHeightAlign) : 1;
  return row * rows * std::max<uint64_t>(depth, 1);
}

// Levels halve width and height (depth is left whole: layered and cubemap
// arrays keep it, and more is never less safe).
uint64_t levels_estimate(uint64_t width, uint64_t height, uint64_t depth, unsigned channels, CUarray_format format,
                         unsigned levels) {
  uint64_t total = 0;
  for (unsigned l = 0; l < std::max(levels, 1u) && l < 64; ++l)
    total += padded_extent(std::max<uint64_t>(width >> l, 1), height == 0 ? 0 : std::max<uint64_t>(height >> l, 1),
                           depth, channels, format);
  return round_up(total, kArrayGranularity);
}

}  // namespace

uint64_t array_estimate_bytes(const CUDA_ARRAY_DESCRIPTOR_v1& d) {
  return levels_estimate(d.Width, d.Height, 1, d.NumChannels, d.Format, 1);
}
uint64_t array_estimate_bytes(const CUDA_ARRAY_DESCRIPTOR& d) {
  return levels_estimate(d.Width, d.Height, 1, d.NumChannels, d.Format, 1);
}
uint64_t array_estimate_bytes(const CUDA_ARRAY3D_DESCRIPTOR_v1& d) {
  return levels_estimate(d.Width, d.Height, d.Depth, d.NumChannels, d.Format, 1);
}
uint64_t array_estimate_bytes(const CUDA_ARRAY3D_DESCRIPTOR& d, unsigned levels) {
  return levels_estimate(d.Width, d.Height, d.Depth, d.NumChannels, d.Format, levels);
}

uint64_t array_real_bytes(CUarray array, CUdevice device) {
  CUDA_ARRAY_MEMORY_REQUIREMENTS req{};
  if (g_driver.cuArrayGetMemoryRequirements == nullptr ||
      g_driver.cuArrayGetMemoryRequirements(&req, array, device) != CUDA_SUCCESS)
    return 0;
  return req.size;
}

uint64_t mipmapped_real_bytes(CUmipmappedArray array, CUdevice device) {
  CUDA_ARRAY_MEMORY_REQUIREMENTS req{};
  if (g_driver.cuMipmappedArrayGetMemoryRequirements == nullptr ||
      g_driver.cuMipmappedArrayGetMemoryRequirements(&req, array, device) != CUDA_SUCCESS)
    return 0;
  return req.size;
}

// ---- Primary contexts ----
//
// The driver keeps one primary context per device, alive while retained.
// We mirror its retain count to charge the footprint once, on the first
// retain, and give it back (with the context's allocations) on the last
// release or a reset.
namespace {

struct PrimaryContext {
  std::atomic<int> retains;
  std::atomic<int> gpu;
  std::atomic<uint64_t> charged;
  std::atomic<uint64_t> ctx;
};
PrimaryContext g_primary[kMaxDevices];

uint64_t context_footprint(int gpu) {
  return gpu >= 0 ? gpu_policy(gpu).context_memory : 0;
}

}  // namespace

bool primary_retain_charge(CUdevice device, int gpu) {
  PrimaryContext& p = g_primary[device];
  for (;;) {
    int retains = p.retains.load(std::memory_order_acquire);
    if (retains > 0) {
      if (p.retains.compare_exchange_weak(retains, retains + 1, std::memory_order_acq_rel)) return true;
      continue;
    }
    // We would be the first retain: the footprint is ours to charge.
    const uint64_t footprint = context_footprint(gpu);
    if (!reserve(gpu, footprint)) return false;
    if (p.retains.compare_exchange_strong(retains, 1, std::memory_order_acq_rel)) {
      p.gpu.store(gpu, std::memory_order_relaxed);
      p.charged.store(footprint, std::memory_order_relaxed);
      return true;
    }
    unreserve(gpu, footprint);  // another thread was first
  }
}

void primary_retain_failed(CUdevice device, int gpu) {
  (void)gpu;
  primary_released(device, false);
}

void primary_retained(CUdevice device, CUcontext ctx) {
  g_primary[device].ctx.store(reinterpret_cast<uint64_t>(ctx), std::memory_order_release);
}

void primary_released(CUdevice device, bool reset) {
  PrimaryContext& p = g_primary[device];
  if (reset) {
    if (p.retains.exchange(0, std::memory_order_acq_rel) == 0) return;
  } else {
    int retains = p.retains.load(std::memory_order_acquire);
    do {
      if (retains == 0) return;  // retained before we were attached
    } while (!p.retains.compare_exchange_weak(retains, retains - 1, std::memory_order_acq_rel));
    if (retains != 1) return;
  }
  unreserve(p.gpu.load(std::memory_order_relaxed), p.charged.exchange(0, std::memory_order_acq_rel));
  const uint64_t ctx = p.ctx.exchange(0, std::memory_order_acq_rel);
  if (ctx != 0) release_context_records(ctx);
}

// ---- cuCtxAttach's usage counts ----
//
// Deprecated and rare: a small table under a spin lock. Counted per context
// handle: attaches beyond the creation's one use.
namespace {

constexpr size_t kMaxAttached = 64;
struct AttachCount {
  uint64_t ctx;
  uint64_t extra;
};
AttachCount g_attached[kMaxAttached];
std::atomic<bool> g_attached_lock{false};

AttachCount* find_attached(uint64_t ctx) {
  for (auto& a : g_attached)
    if (a.ctx == ctx && a.extra != 0) return &a;
  return nullptr;
}

}  // namespace

bool context_attached(CUcontext ctx) {
  const auto key = reinterpret_cast<uint64_t>(ctx);
  SpinGuard lock(g_attached_lock);
  if (AttachCount* a = find_attached(key)) {
    ++a->extra;
    return true;
  }
  for (auto& a : g_attached) {
    if (a.extra != 0) continue;
    a = {key, 1};
    return true;
  }
  FRACGPU_LOG_ONCE(LogLevel::kError, "more than %zu contexts attached with cuCtxAttach: further attaches are refused",
                   kMaxAttached);
  return false;
}

bool context_detach_keeps(CUcontext ctx) {
  SpinGuard lock(g_attached_lock);
  AttachCount* a = find_attached(reinterpret_cast<uint64_t>(ctx));
  if (a == nullptr) return false;
  --a->extra;
  return true;
}

void context_attaches_forget(CUcontext ctx) {
  SpinGuard lock(g_attached_lock);
  if (AttachCount* a = find_attached(reinterpret_cast<uint64_t>(ctx))) a->extra = 0;
}

void reset_memory_state() {
  reset_graph_memory_state();
  reset_pools();
  reset_vmm();
  for (auto& a : g_attached) a = {0, 0};
  g_attached_lock.store(false, std::memory_order_relaxed);
  for (auto& p : g_primary) {
    p.retains.store(0, std::memory_order_relaxed);
    p.charged.store(0, std::memory_order_relaxed);
    p.ctx.store(0, std::memory_order_relaxed);
  }
}

// ---- The tenant's view ----

bool tenant_memory_view(int gpu, uint64_t real_free, uint64_t real_total, uint64_t* free_bytes, uint64_t* total_bytes) {
  if (gpu < 0) {
    *free_bytes = 0;
    *total_bytes = 0;
    return true;
  }
  // Only the two fields needed, from one copy of the policy (a common path).
  uint32_t state = ledger::kGpuUnused;
  uint64_t quota = 0;
  if (!read_committed_gpu(gpu, [&](const ledger::GpuPolicy& e) {
        state = e.state.load(std::memory_order_acquire);
        quota = e.memory_quota.load(std::memory_order_acquire);
      }))
    state = ledger::kGpuUnused;
  if (state != ledger::kGpuGranted) {
    *free_bytes = 0;
    *total_bytes = 0;
    return true;
  }
  if (quota == ledger::kUnlimited) {
    *free_bytes = real_free;
    *total_bytes = real_total;
    return false;
  }
  const uint64_t used = ledger::tenant_used(*tenant_of(gpu).ledger.usage, entry_of(gpu));
  *total_bytes = quota;
  *free_bytes = std::min(used >= quota ? 0 : quota - used, real_free);
  return true;
}

}  // namespace fracgpu::interpose
