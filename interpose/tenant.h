// This process's tie to its tenants: the mapped ledgers, a process slot in
// each, the map from device ordinals to the tenant granting each device, and
// what it charged.
//
// A process usually has one tenant. A Kubernetes container with several
// fracgpu claims has one tenant per claim, each claim's directory mounted at
// its own path under /run/fracgpu/claims/ (docs/kubernetes.md): the process
// attaches to every one (at most kMaxTenants), and each device is charged to
// and scheduled for the one tenant that grants it.
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

// Tenant directories one process attaches to (claims of one container).
inline constexpr int kMaxTenants = 8;

struct TenantState {
  ledger::TenantLedger ledger;
  char dir[1024] = {};  // the tenant directory: the ledger and the GPU-time arbiters' links
  int slot = -1;
};

extern std::atomic<int> g_tenant_mode;
// g_tenants[0, g_tenant_count): set while attaching, before g_tenant_mode
// says kManaged (whose release store publishes them).
extern TenantState g_tenants[kMaxTenants];
extern int g_tenant_count;
// What this process charged, across its tenants: device pointers (linear,
// managed, async), and arrays, mipmapped arrays, VMM handles, contexts.
extern ChargeTable g_pointers;
extern ChargeTable g_handles;

// A "GPU" in the hooks and the charge records: one tenant's GPU entry,
// tenant index * kMaxGpus + entry. With one tenant it is the entry itself.
inline constexpr int kMaxTenantGpus = kMaxTenants * static_cast<int>(ledger::kMaxGpus);
inline TenantState& tenant_of(int gpu) { return g_tenants[static_cast<unsigned>(gpu) / ledger::kMaxGpus]; }
inline uint32_t entry_of(int gpu) { return static_cast<unsigned>(gpu) % ledger::kMaxGpus; }

TenantMode attach_tenant_slow();
inline TenantMode tenant_mode() {
  int mode = g_tenant_mode.load(std::memory_order_acquire);
  if (mode == static_cast<int>(TenantMode::kManaged)) [[likely]]
    return TenantMode::kManaged;
  return attach_tenant_slow();
}

inline constexpr int kNotGranted = -1;
inline constexpr int kMaxDevices = 64;

// The GPU (tenant and entry, as above) for a device ordinal (as this process
// numbers its devices, after CUDA_VISIBLE_DEVICES), found by UUID among the
// tenants' grants: kNotGranted if no tenant grants it, or if two do (then
// device_denied() says so). Managed mode only.
int gpu_entry_for_device(CUdevice device);
// Whether the driver has a device of that ordinal for this process (it
// numbers only the tenants' GPUs: visible_devices.h). Slow: a driver call.
bool device_exists(CUdevice device);
// The GPU granted by the tenants for a GPU's UUID (kNotGranted: none, or two).
int gpu_for_uuid(const uint8_t uuid[16]);
// The GPUs this process's tenants grant now (each once, however many of its
// tenants grant it), in the order of the tenants and of their entries: how
// many, their UUIDs in out[0, n) (at most `capacity`). Managed mode only.
int granted_gpus(uint8_t (*out)[16], int capacity);
// Whether one of this process's tenants grants the GPU `uuid` now.
bool is_granted_gpu(const uint8_t uuid[16]);
// Who the tenants are, for a log line: `tenant "alice" (dir)`, or `this
// process's N tenants`.
const char* tenants_text(char* buf, size_t size);
// True for a device two attached tenants both grant: whose quota and time
// it would use cannot be told, so it is refused (after one log line).
bool device_denied(CUdevice device);

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

// Entry `gpu` of its tenant's GPU table in force (the committed copy), read
// whole: fields taken from one call belong to one generation of policy.
ledger::GpuEntry gpu_policy(int gpu);
// ledger::read_committed_entry on the tenant and entry of `gpu`.
template <typename Read>
bool read_committed_gpu(int gpu, Read&& read) {
  return ledger::read_committed_entry(tenant_of(gpu).ledger, entry_of(gpu), static_cast<Read&&>(read));
}

// cuInit (managed mode): true, after one log line naming the GPU and why,
// when a GPU this process can see is granted to one of its tenants but marked
// unavailable by the daemon (unhealthy, or the tenant denied for a bypass).
// Slow path: asks the driver for each visible device's UUID.
bool visible_gpu_unavailable();

// Pool slack that can be given back before refusing (memory.cpp).
void settle_all_pools();
// Forgets per-process pool and primary-context bookkeeping (a forked child
// inherits its parent's copy, which describes the parent's driver state).
void reset_memory_state();

}  // namespace fracgpu::interpose
