// This process's tie to its tenant: the mapped ledger, its process slot, the
// map from device ordinals to the tenant's GPU entries, and what it charged.
//
// Attaching is lazy (first hook that needs it) because the library may be
// loaded into processes that never touch a GPU, and before main. Everything
// here is constant-initialized with trivial destructors, so hooks keep working
// during exit, and after fork the child simply attaches again.
#pragma once

#include <cuda.h>

#include <atomic>
#include <cstdint>

#include "alloc_table.h"
#include "ledger.h"

namespace fracgpu::interpose {

enum class TenantMode : int {
  kUnattached = 0,
  kManaged = 1,      // quotas enforced
  kPassthrough = 2,  // no tenant state found; FRACGPU_UNMANAGED=passthrough (default)
  kDenied = 3,       // ledger refused (corrupt, foreign, wrong version), or FRACGPU_UNMANAGED=deny
  kAttaching = 4,
};

struct TenantState {
  ledger::TenantLedger ledger;
  char dir[1024] = {};  // the tenant directory: the ledger and the GPU-time arbiters' links
  int slot = -1;
  ChargeTable pointers;  // device pointers (linear, managed, async)
  ChargeTable handles;   // arrays, mipmapped arrays, VMM handles, contexts
};

extern std::atomic<int> g_tenant_mode;
extern TenantState g_tenant;

TenantMode attach_tenant_slow();
inline TenantMode tenant_mode() {
  int mode = g_tenant_mode.load(std::memory_order_acquire);
  if (mode == static_cast<int>(TenantMode::kManaged)) [[likely]]
    return TenantMode::kManaged;
  return attach_tenant_slow();
}

inline constexpr int kNotGranted = -1;
inline constexpr int kMaxDevices = 64;

// The tenant's GPU entry for a device ordinal (as this process numbers its
// devices, after CUDA_VISIBLE_DEVICES), found by UUID: kNotGranted if the
// tenant has no grant on it. Managed mode only.
int gpu_entry_for_device(CUdevice device);

// The current context and its device's GPU entry. Returns false when no
// context is current (the caller lets the driver report that).
bool current_gpu_entry(CUcontext* ctx, CUdevice* device, int* gpu);

// Call after any driver call that may create a context or free a context
// handle for reuse (create, destroy, primary retain, release, reset): it ends
// every thread's cached context -> device answer (see current_gpu_entry), and
// the calling thread's launch pass.
void note_contexts_changed();

// Charging with the ledger, for this process's slot. reserve() refuses past
// the quota; on refusal it first reclaims dead processes' charges and settles
// pools (both slow paths) and tries once more.
bool reserve(int gpu, uint64_t bytes);
void unreserve(int gpu, uint64_t bytes);

// Entry `gpu` of the tenant's GPU table in force (the committed copy), read
// whole: fields taken from one call belong to one generation of policy.
ledger::GpuEntry gpu_policy(int gpu);

// cuInit (managed mode): true, after one log line naming the GPU and why,
// when a GPU this process can see is granted to its tenant but marked
// unavailable by the daemon (unhealthy, or the tenant denied for a bypass).
// Slow path: asks the driver for each visible device's UUID.
bool visible_gpu_unavailable();

// Pool slack that can be given back before refusing (memory.cpp).
void settle_all_pools();
// Forgets per-process pool and primary-context bookkeeping (a forked child
// inherits its parent's copy, which describes the parent's driver state).
void reset_memory_state();

}  // namespace fracgpu::interpose
