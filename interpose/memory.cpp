// Out-of-line parts of the memory hooks: records, pools, arrays, primary
// contexts. Nothing here runs on the common allocation path except
// record/forget (a few atomics each).
#include <sched.h>

#include <algorithm>

#include "log.h"
#include "memory_hooks.h"

namespace fracgpu::interpose {

bool record_pointer(uint64_t key, const ChargeRecord& record) {
  if (g_tenant.pointers.insert(key, record)) [[likely]]
    return true;
  FRACGPU_LOG_ONCE(LogLevel::kError, "allocation table full: further allocations are refused");
  return false;
}

bool record_handle(uint64_t key, const ChargeRecord& record) {
  if (g_tenant.handles.insert(key, record)) [[likely]]
    return true;
  FRACGPU_LOG_ONCE(LogLevel::kError, "handle table full: further arrays, VMM handles and contexts are refused");
  return false;
}

bool forget_pointer(uint64_t key, ChargeRecord* out) { return g_tenant.pointers.remove(key, out); }
bool forget_handle(uint64_t key, ChargeRecord* out) { return g_tenant.handles.remove(key, out); }

void release_context_records(uint64_t ctx) {
  // Destroying a context frees its linear, managed and array memory; VMM
  // and stream-ordered memory outlive it (CUDA driver API, cuCtxDestroy).
  auto belongs = [ctx](const ChargeRecord& r) {
    return r.owner == ctx && (r.kind == ChargeKind::kLinear || r.kind == ChargeKind::kManaged ||
                              r.kind == ChargeKind::kArray || r.kind == ChargeKind::kMipmapped);
  };
  auto give_back = [](const ChargeRecord& r) { unreserve(static_cast<int>(r.gpu), r.bytes); };
  g_tenant.pointers.remove_if(belongs, give_back);
  g_tenant.handles.remove_if(belongs, give_back);
}

bool settle(int gpu, uint64_t reserved, uint64_t actual) {
  if (actual > reserved) return reserve(gpu, actual - reserved);
  unreserve(gpu, reserved - actual);
  return true;
}

bool settle_charge(std::atomic<uint64_t>& charged, int gpu, uint64_t holds, uint64_t inflight) {
  // Charges beyond holds + inflight are given back; below holds, taken. In
  // between, the difference is reservations of calls still in the driver.
  const uint64_t target = holds + inflight;
  for (;;) {
    uint64_t now = charged.load(std::memory_order_seq_cst);
    if (now > target) {
      if (charged.compare_exchange_weak(now, target, std::memory_order_seq_cst)) {
        unreserve(gpu, now - target);
        return true;
      }
      continue;
    }
    if (now < holds) {
      const uint64_t missing = holds - now;
      if (!ledger::try_charge(g_tenant.ledger, static_cast<uint32_t>(gpu), static_cast<uint32_t>(g_tenant.slot),
                              missing))
        return false;
      charged.fetch_add(missing, std::memory_order_seq_cst);
    }
    return true;
  }
}

// ---- Stream-ordered pools ----
//
// A pool holds device memory beyond what is allocated from it: freed blocks
// stay reserved in the pool until it is trimmed, destroyed, or synchronized
// above its release threshold. That reserve is what the device loses, so it
// is what we charge. Per pool we keep `charged` (bytes charged to the ledger)
// and `inflight` (reservations for allocations still inside the driver):
//   alloc:  reserve the request rounded up to the pool granularity (2 MiB)
//           before calling the driver; then settle.
//   settle: read the pool's RESERVED_MEM_CURRENT (R). Charge down to
//           R + inflight if we hold more; charge up to R if the pool grew
//           beyond our reservations, and if the quota refuses that, the
//           allocation that made it grow is undone and refused.
//   free:   nothing changes until the pool really lets go: the pool is marked
//           dirty and settled at the next synchronize, trim, cuMemGetInfo
//           or refused reservation.
//   destroy: everything charged for the pool is given back.
namespace {

constexpr uint64_t kPoolGranularity = 2ull << 20;
constexpr size_t kMaxPools = 64;

struct PoolCharge {
  std::atomic<uint64_t> pool;  // CUmemoryPool handle; 0 = free entry
  std::atomic<int> gpu;
  std::atomic<uint64_t> charged;
  std::atomic<uint64_t> inflight;
  std::atomic<bool> dirty;
};

PoolCharge g_pools[kMaxPools];
std::atomic<bool> g_pools_dirty{false};

PoolCharge* find_pool(CUmemoryPool pool) {
  const auto key = reinterpret_cast<uint64_t>(pool);
  for (auto& p : g_pools)
    if (p.pool.load(std::memory_order_acquire) == key) return &p;
  return nullptr;
}

PoolCharge* find_or_add_pool(CUmemoryPool pool, int gpu) {
  if (PoolCharge* found = find_pool(pool)) return found;
  const auto key = reinterpret_cast<uint64_t>(pool);
  for (auto& p : g_pools) {
    uint64_t expected = 0;
    if (p.pool.load(std::memory_order_relaxed) != 0) continue;
    p.gpu.store(gpu, std::memory_order_relaxed);
    if (p.pool.compare_exchange_strong(expected, key, std::memory_order_acq_rel)) return &p;
  }
  // Two threads adding the same pool at once: one of them won.
  return find_pool(pool);
}

uint64_t pool_reserved(CUmemoryPool pool, bool* known) {
  cuuint64_t reserved = 0;
  *known = g_driver.cuMemPoolGetAttribute != nullptr &&
           g_driver.cuMemPoolGetAttribute(pool, CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT, &reserved) == CUDA_SUCCESS;
  return reserved;
}

// Memory the pool holds but has not handed out.
uint64_t pool_slack(CUmemoryPool pool) {
  cuuint64_t reserved = 0, used = 0;
  if (g_driver.cuMemPoolGetAttribute == nullptr ||
      g_driver.cuMemPoolGetAttribute(pool, CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT, &reserved) != CUDA_SUCCESS ||
      g_driver.cuMemPoolGetAttribute(pool, CU_MEMPOOL_ATTR_USED_MEM_CURRENT, &used) != CUDA_SUCCESS)
    return 0;
  return reserved > used ? reserved - used : 0;
}

// Brings the pool's charge to what it really holds. False if it holds more
// than the quota lets us charge.
bool settle_pool(PoolCharge& p) {
  const auto pool = reinterpret_cast<CUmemoryPool>(p.pool.load(std::memory_order_acquire));
  if (pool == nullptr) return true;
  p.dirty.store(false, std::memory_order_relaxed);
  const int gpu = p.gpu.load(std::memory_order_relaxed);
  // inflight before R: an allocation that finishes between the two reads is
  // then counted twice (safe), never zero times.
  const uint64_t inflight = p.inflight.load(std::memory_order_seq_cst);
  bool known = false;
  const uint64_t reserved = pool_reserved(pool, &known);
  if (!known) return true;
  return settle_charge(p.charged, gpu, reserved, inflight);
}

}  // namespace

bool pools_dirty() { return g_pools_dirty.load(std::memory_order_relaxed); }

void settle_all_pools() {
  if (g_graph_execs_with_memory.load(std::memory_order_relaxed) != 0) settle_all_graph_memory();
  if (!g_pools_dirty.exchange(false, std::memory_order_acq_rel)) return;
  for (auto& p : g_pools)
    if (p.pool.load(std::memory_order_acquire) != 0 && p.dirty.load(std::memory_order_relaxed)) settle_pool(p);
}

CUresult pooled_alloc(CUmemoryPool pool, int gpu, size_t bytes, CUdeviceptr* dptr, CUstream stream,
                      CUresult (*alloc)(void*), void* alloc_state) {
  PoolCharge* p = find_or_add_pool(pool, gpu);
  if (p == nullptr) {
    FRACGPU_LOG_ONCE(LogLevel::kError, "more than %zu memory pools in use: further pools are refused", kMaxPools);
    return CUDA_ERROR_OUT_OF_MEMORY;
  }
  uint64_t reservation = (bytes + kPoolGranularity - 1) / kPoolGranularity * kPoolGranularity;
  if (!reserve(gpu, reservation)) {
    // The pool may hold slack charged earlier that it no longer has.
    settle_pool(*p);
    if (!reserve(gpu, reservation)) {
      // Or it may serve the request from memory it holds (already charged):
      // try with no reservation; the settle below undoes the allocation if
      // the pool had to grow after all.
      if (pool_slack(pool) < bytes) return CUDA_ERROR_OUT_OF_MEMORY;
      reservation = 0;
    }
  }
  p->charged.fetch_add(reservation, std::memory_order_seq_cst);
  p->inflight.fetch_add(reservation, std::memory_order_seq_cst);
  CUresult result = alloc(alloc_state);
  p->inflight.fetch_sub(reservation, std::memory_order_seq_cst);
  if (result != CUDA_SUCCESS) {
    p->charged.fetch_sub(reservation, std::memory_order_seq_cst);
    unreserve(gpu, reservation);
    return result;
  }
  const ChargeRecord record{0, reinterpret_cast<uint64_t>(pool), static_cast<uint32_t>(gpu), ChargeKind::kAsync};
  if (!record_pointer(*dptr, record) || !settle_pool(*p)) {
    // The pool grew past what the quota allows: undo this allocation and
    // have the pool let go of what it no longer needs.
    ChargeRecord ignored;
    forget_pointer(*dptr, &ignored);
    real<HookId::cuMemFreeAsync>()(*dptr, stream);
    if (g_driver.cuMemPoolGetAttribute != nullptr && real<HookId::cuStreamSynchronize>() != nullptr) {
      real<HookId::cuStreamSynchronize>()(stream);
      real<HookId::cuMemPoolTrimTo>()(pool, 0);
    }
    settle_pool(*p);
    return CUDA_ERROR_OUT_OF_MEMORY;
  }
  return CUDA_SUCCESS;
}

void pooled_free_done(const ChargeRecord& record) {
  PoolCharge* p = find_pool(reinterpret_cast<CUmemoryPool>(record.owner));
  if (p == nullptr) return;
  p->dirty.store(true, std::memory_order_relaxed);
  g_pools_dirty.store(true, std::memory_order_release);
}

void pool_settle(CUmemoryPool pool) {
  if (PoolCharge* p = find_pool(pool)) settle_pool(*p);
}

void pool_created(CUmemoryPool pool, int gpu) {
  if (find_or_add_pool(pool, gpu) == nullptr)
    FRACGPU_LOG_ONCE(LogLevel::kError, "more than %zu memory pools in use: further pools are refused", kMaxPools);
}

int pool_gpu(CUmemoryPool pool, int otherwise) {
  const PoolCharge* p = find_pool(pool);
  return p != nullptr ? p->gpu.load(std::memory_order_relaxed) : otherwise;
}

void pool_destroyed(CUmemoryPool pool) {
  PoolCharge* p = find_pool(pool);
  if (p == nullptr) return;
  const uint64_t charged = p->charged.exchange(0, std::memory_order_seq_cst);
  unreserve(p->gpu.load(std::memory_order_relaxed), charged);
  p->dirty.store(false, std::memory_order_relaxed);
  p->pool.store(0, std::memory_order_release);
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

uint64_t extent_bytes(uint64_t width, uint64_t height, uint64_t depth, unsigned channels, CUarray_format format) {
  return std::max<uint64_t>(width, 1) * std::max<uint64_t>(height, 1) * std::max<uint64_t>(depth, 1) *
         std::max(channels, 1u) * format_bytes(format);
}

}  // namespace

uint64_t array_estimate_bytes(const CUDA_ARRAY_DESCRIPTOR_v1& d) {
  return extent_bytes(d.Width, d.Height, 1, d.NumChannels, d.Format);
}
uint64_t array_estimate_bytes(const CUDA_ARRAY_DESCRIPTOR& d) {
  return extent_bytes(d.Width, d.Height, 1, d.NumChannels, d.Format);
}
uint64_t array_estimate_bytes(const CUDA_ARRAY3D_DESCRIPTOR_v1& d) {
  return extent_bytes(d.Width, d.Height, d.Depth, d.NumChannels, d.Format);
}
uint64_t array_estimate_bytes(const CUDA_ARRAY3D_DESCRIPTOR& d) {
  return extent_bytes(d.Width, d.Height, d.Depth, d.NumChannels, d.Format);
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

void reset_memory_state() {
  reset_graph_memory_state();
  for (auto& p : g_pools) {
    p.pool.store(0, std::memory_order_relaxed);
    p.charged.store(0, std::memory_order_relaxed);
    p.inflight.store(0, std::memory_order_relaxed);
    p.dirty.store(false, std::memory_order_relaxed);
  }
  g_pools_dirty.store(false, std::memory_order_relaxed);
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
  if (!ledger::read_committed_entry(g_tenant.ledger, static_cast<uint32_t>(gpu), [&](const ledger::GpuPolicy& e) {
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
  const uint64_t used = ledger::tenant_used(*g_tenant.ledger.usage, static_cast<uint32_t>(gpu));
  *total_bytes = quota;
  *free_bytes = std::min(used >= quota ? 0 : quota - used, real_free);
  return true;
}

}  // namespace fracgpu::interpose
