// Stream-ordered pools (cuMemAllocAsync, cuMemAllocFromPoolAsync).
//
// A pool holds device memory beyond what is allocated from it: freed blocks
// stay reserved in the pool until it is trimmed, destroyed, or synchronized
// above its release threshold. That reserve is what the device loses, so it
// is what we charge, as a HeldCharge per pool (memory_held.h: the invariant
// and why it holds under any interleaving):
//   alloc:   reserve the request rounded up to the pool granularity (2 MiB:
//            the most one allocation can make the pool grow), call the
//            driver, then settle to the pool's RESERVED_MEM_CURRENT.
//   free:    nothing changes until the pool really lets go: the pool is
//            marked and settled at the next synchronize, cuMemGetInfo, trim
//            or refused reservation.
//   edge:    a reservation the quota refuses while the pool holds unused
//            memory: that memory is charged but cannot stand in for the
//            reservation (the driver may grow the pool anyway, fragmented),
//            so the pool is trimmed, settled, and the reservation tried again.
//   destroy: what is charged for the pool is given back once no allocation
//            from it is outstanding (the driver keeps its memory until then).
//
// Entries are found without a lock (a scan of 64); adding and retiring them
// is a slow path (first use of a pool, destroy) under a spin lock, so one pool
// never gets two entries.
#include "log.h"
#include "memory_held.h"
#include "memory_hooks.h"

namespace fracgpu::interpose {

namespace {

constexpr uint64_t kPoolGranularity = 2ull << 20;
constexpr size_t kMaxPools = 64;
// A pool of host memory (cuMemPoolCreate with a host location): not charged.
constexpr int kHostPool = -3;

struct PoolCharge {
  std::atomic<uint64_t> pool;      // CUmemoryPool handle; 0: free entry
  std::atomic<int> gpu;            // ledger GPU entry its memory is charged to
  std::atomic<bool> destroyed;     // its handle may name another pool by now
  std::atomic<int64_t> users;      // outstanding allocations and calls in the driver
  std::atomic<bool> dirty;         // a block was freed since the last settle
  HeldCharge charge;
};

PoolCharge g_pools[kMaxPools];
std::atomic<bool> g_pools_dirty{false};
std::atomic<bool> g_pools_lock{false};  // adding and retiring entries

PoolCharge* find_live(CUmemoryPool pool) {
  const auto key = reinterpret_cast<uint64_t>(pool);
  for (auto& p : g_pools)
    if (p.pool.load(std::memory_order_acquire) == key && !p.destroyed.load(std::memory_order_acquire)) return &p;
  return nullptr;
}

PoolCharge* add_pool(CUmemoryPool pool, int gpu) {
  SpinGuard lock(g_pools_lock);
  if (PoolCharge* found = find_live(pool)) return found;
  for (auto& p : g_pools) {
    if (p.pool.load(std::memory_order_relaxed) != 0) continue;
    p.gpu.store(gpu, std::memory_order_relaxed);
    p.destroyed.store(false, std::memory_order_relaxed);
    p.users.store(0, std::memory_order_relaxed);
    p.dirty.store(false, std::memory_order_relaxed);
    p.charge.reset();
    p.pool.store(reinterpret_cast<uint64_t>(pool), std::memory_order_release);
    return &p;
  }
  FRACGPU_LOG_ONCE(LogLevel::kError, "more than %zu memory pools in use: further pools are refused", kMaxPools);
  return nullptr;
}

// A destroyed pool whose last allocation is gone: the driver has let go of
// its memory, and so do we.
void retire_if_unused(PoolCharge& p) {
  SpinGuard lock(g_pools_lock);
  if (p.pool.load(std::memory_order_relaxed) == 0 || !p.destroyed.load(std::memory_order_seq_cst) ||
      p.users.load(std::memory_order_seq_cst) != 0)
    return;
  unreserve(p.gpu.load(std::memory_order_relaxed), p.charge.take_settled());
  p.pool.store(0, std::memory_order_release);
}

void leave(PoolCharge& p) {
  if (p.users.fetch_sub(1, std::memory_order_seq_cst) == 1 && p.destroyed.load(std::memory_order_seq_cst))
    retire_if_unused(p);
}

// The GPU entry of a pool this process did not see created (a device's
// default pool, or one made before it attached): the driver has no query
// for a pool's location, but each device names its default and current
// pools. `fallback` (the caller's device) where none names it, or where its
// device is not one the tenant is granted.
int gpu_of_unseen_pool(CUmemoryPool pool, int fallback) {
  int count = 0;
  if (g_driver.cuDeviceGetCount == nullptr || g_driver.cuDeviceGetCount(&count) != CUDA_SUCCESS) return fallback;
  for (CUdevice d = 0; d < count; ++d) {
    CUmemoryPool named = nullptr;
    const bool is_default = g_driver.cuDeviceGetDefaultMemPool != nullptr &&
                            g_driver.cuDeviceGetDefaultMemPool(&named, d) == CUDA_SUCCESS && named == pool;
    const bool is_current = !is_default && g_driver.cuDeviceGetMemPool != nullptr &&
                            g_driver.cuDeviceGetMemPool(&named, d) == CUDA_SUCCESS && named == pool;
    if (!is_default && !is_current) continue;
    const int gpu = gpu_entry_for_device(d);
    return gpu >= 0 ? gpu : fallback;
  }
  return fallback;
}

// The live entry for `pool`, added if new, with a use counted: the entry
// cannot be retired (and reused) until leave().
PoolCharge* use_pool(CUmemoryPool pool, int gpu) {
  for (;;) {
    PoolCharge* p = find_live(pool);
    if (p == nullptr && (p = add_pool(pool, gpu_of_unseen_pool(pool, gpu))) == nullptr) return nullptr;
    // Counted first, then checked: a retirer marks `destroyed` first, then
    // reads `users` (all sequentially consistent), so one of us sees the other.
    p->users.fetch_add(1, std::memory_order_seq_cst);
    if (p->pool.load(std::memory_order_seq_cst) == reinterpret_cast<uint64_t>(pool) &&
        !p->destroyed.load(std::memory_order_seq_cst))
      return p;
    leave(*p);
  }
}

bool pool_holds(const void* arg, uint64_t* bytes) {
  const auto& p = *static_cast<const PoolCharge*>(arg);
  // Settles of a pool being destroyed are held off (pool_destroy_begin), so
  // a destroyed entry's handle is never asked about: it may be another's.
  if (p.destroyed.load(std::memory_order_acquire)) return false;
  cuuint64_t reserved = 0;
  if (g_driver.cuMemPoolGetAttribute == nullptr ||
      g_driver.cuMemPoolGetAttribute(reinterpret_cast<CUmemoryPool>(p.pool.load(std::memory_order_relaxed)),
                                     CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT, &reserved) != CUDA_SUCCESS)
    return false;
  *bytes = reserved;
  return true;
}

HeldCharge::Settled settle_pool(PoolCharge& p, bool wait) {
  // Host pools and pools of GPUs not granted hold nothing charged.
  const int gpu = p.gpu.load(std::memory_order_relaxed);
  if (gpu < 0) return HeldCharge::Settled::kDone;
  return p.charge.settle(gpu, pool_holds, &p, wait);
}

// Memory the pool holds that no allocation uses, or 0 if it cannot tell.
uint64_t pool_unused(CUmemoryPool pool) {
  cuuint64_t reserved = 0, used = 0;
  if (g_driver.cuMemPoolGetAttribute == nullptr ||
      g_driver.cuMemPoolGetAttribute(pool, CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT, &reserved) != CUDA_SUCCESS ||
      g_driver.cuMemPoolGetAttribute(pool, CU_MEMPOOL_ATTR_USED_MEM_CURRENT, &used) != CUDA_SUCCESS)
    return 0;
  return reserved > used ? reserved - used : 0;
}

// The quota refused `reservation` after reserve() had settled every pool and
// reclaimed the dead. If the pool holds unused memory, give it back to the
// device and try once more.
bool reserve_after_trim(PoolCharge& p, CUmemoryPool pool, int gpu, uint64_t reservation) {
  if (pool_unused(pool) == 0 || real<HookId::cuMemPoolTrimTo>() == nullptr) return false;
  if (real<HookId::cuMemPoolTrimTo>()(pool, 0) != CUDA_SUCCESS) return false;
  settle_pool(p, /*wait=*/true);
  return reserve(gpu, reservation);
}

void undo_allocation(CUdeviceptr dptr, CUmemoryPool pool, CUstream stream) {
  ChargeRecord ignored;
  forget_pointer(dptr, &ignored);
  if (real<HookId::cuMemFreeAsync>() != nullptr) real<HookId::cuMemFreeAsync>()(dptr, stream);
  // Have the pool let go of what it no longer needs.
  if (real<HookId::cuStreamSynchronize>() != nullptr) real<HookId::cuStreamSynchronize>()(stream);
  if (real<HookId::cuMemPoolTrimTo>() != nullptr) real<HookId::cuMemPoolTrimTo>()(pool, 0);
}

}  // namespace

bool pools_dirty() { return g_pools_dirty.load(std::memory_order_relaxed); }

void settle_dirty_pools() {
  if (g_graph_execs_with_memory.load(std::memory_order_relaxed) != 0) settle_all_graph_memory(/*wait=*/false);
  if (!g_pools_dirty.exchange(false, std::memory_order_acq_rel)) return;
  for (auto& p : g_pools)
    if (p.pool.load(std::memory_order_acquire) != 0 && p.dirty.exchange(false, std::memory_order_acq_rel))
      settle_pool(p, /*wait=*/false);
}

// reserve() before it refuses: every charge brought to what the driver
// holds, each settle finished before this returns.
void settle_all_pools() {
  settle_all_graph_memory(/*wait=*/true);
  g_pools_dirty.store(false, std::memory_order_release);
  for (auto& p : g_pools) {
    if (p.pool.load(std::memory_order_acquire) == 0) continue;
    p.dirty.store(false, std::memory_order_relaxed);
    settle_pool(p, /*wait=*/true);
  }
}

CUresult pooled_alloc(CUmemoryPool pool, int gpu, size_t bytes, CUdeviceptr* dptr, CUstream stream,
                      CUresult (*alloc)(void*), void* alloc_state) {
  PoolCharge* p = use_pool(pool, gpu);
  if (p == nullptr) return CUDA_ERROR_OUT_OF_MEMORY;
  gpu = p->gpu.load(std::memory_order_relaxed);
  if (gpu == kHostPool) {
    const CUresult result = alloc(alloc_state);
    leave(*p);
    return result;
  }
  if (bytes > UINT64_MAX - kPoolGranularity) {
    leave(*p);
    return CUDA_ERROR_OUT_OF_MEMORY;
  }
  const uint64_t reservation = (bytes + kPoolGranularity - 1) / kPoolGranularity * kPoolGranularity;
  if (!reserve(gpu, reservation) && !reserve_after_trim(*p, pool, gpu, reservation)) {
    leave(*p);
    return CUDA_ERROR_OUT_OF_MEMORY;
  }
  p->charge.begin(reservation);
  const CUresult result = alloc(alloc_state);
  p->charge.end(reservation, result == CUDA_SUCCESS, gpu);
  if (result != CUDA_SUCCESS) {
    leave(*p);
    return result;
  }
  // The allocation keeps its use of the entry until it is freed.
  const ChargeRecord record{0, static_cast<uint64_t>(p - g_pools), static_cast<uint32_t>(gpu), ChargeKind::kAsync};
  if (!record_pointer(*dptr, record) || settle_pool(*p, /*wait=*/false) == HeldCharge::Settled::kExcess) {
    // The table is full, or the pool grew past every reservation and the
    // quota: undo this allocation, and charge what remains.
    undo_allocation(*dptr, pool, stream);
    settle_pool(*p, /*wait=*/true);
    leave(*p);
    return CUDA_ERROR_OUT_OF_MEMORY;
  }
  return CUDA_SUCCESS;
}

void pooled_free_done(const ChargeRecord& record) {
  if (record.owner >= kMaxPools) return;
  PoolCharge& p = g_pools[record.owner];
  p.dirty.store(true, std::memory_order_relaxed);
  g_pools_dirty.store(true, std::memory_order_release);
  leave(p);
}

void pool_settle(CUmemoryPool pool) {
  if (PoolCharge* p = find_live(pool)) settle_pool(*p, /*wait=*/false);
}

void pool_created(CUmemoryPool pool, const CUmemPoolProps& props) {
  const bool device = props.location.type == CU_MEM_LOCATION_TYPE_DEVICE;
  add_pool(pool, device ? gpu_entry_for_device(props.location.id) : kHostPool);
}

PoolDestroy pool_destroy_begin(CUmemoryPool pool) {
  PoolDestroy d;
  PoolCharge* p = find_live(pool);
  if (p == nullptr) return d;
  p->charge.lock_settles();
  d.index = static_cast<int>(p - g_pools);
  return d;
}

void pool_destroy_end(PoolDestroy d, bool destroyed) {
  if (d.index < 0) return;
  PoolCharge& p = g_pools[d.index];
  if (destroyed) p.destroyed.store(true, std::memory_order_seq_cst);
  p.charge.unlock_settles();
  if (destroyed) retire_if_unused(p);
}

void reset_pools() {
  for (auto& p : g_pools) {
    p.pool.store(0, std::memory_order_relaxed);
    p.destroyed.store(false, std::memory_order_relaxed);
    p.users.store(0, std::memory_order_relaxed);
    p.dirty.store(false, std::memory_order_relaxed);
    p.charge.reset();
  }
  g_pools_dirty.store(false, std::memory_order_relaxed);
  g_pools_lock.store(false, std::memory_order_relaxed);
}

}  // namespace fracgpu::interpose
