#include "tenant.h"

#include <pthread.h>
#include <sched.h>
#include <time.h>
#include <sys/stat.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "hook_table.h"
#include "launch_gate.h"
#include "log.h"

namespace fracgpu::interpose {

std::atomic<int> g_tenant_mode{0};
TenantState g_tenant;

namespace {

constexpr int kUnknownDevice = -2;
constexpr unsigned kPointerTableLog2 = 18;  // 262144 live allocations
constexpr unsigned kHandleTableLog2 = 14;   // 16384 arrays, VMM handles, contexts

std::atomic<int> g_device_entry[kMaxDevices];
std::atomic<uint64_t> g_device_entry_generation{UINT64_MAX};
std::atomic<bool> g_atfork_registered{false};

// The device of this thread's current context, as last asked of the driver.
// Finding the current GPU is on every allocation, and asking the driver for a
// context's device there cost a driver call each time. A context's device
// never changes, but a destroyed context's handle may come back for a new
// context on another device: every hook that creates or destroys a context
// bumps g_context_epoch after the driver returns (note_contexts_changed), and
// an answer is reused only under the epoch it was found in. A thread can only
// make a new context current after whoever created it got the handle back,
// so after the bump. Constant-initialized and trivially destructible: no TLS
// init call on the hot path, nothing to run at thread exit.
struct CurrentDevice {
  CUcontext ctx;
  CUdevice device;
  uint64_t epoch;  // 0: never filled (the epoch starts at 1)
};
constinit thread_local CurrentDevice t_current_device{};
std::atomic<uint64_t> g_context_epoch{1};

void forget_devices() {
  for (auto& e : g_device_entry) e.store(kUnknownDevice, std::memory_order_relaxed);
}

// In a forked child the parent's slot lock is not ours (record locks are not
// inherited) and its allocations are not usable: start over on next use.
void on_fork_child() {
  g_tenant_mode.store(static_cast<int>(TenantMode::kUnattached), std::memory_order_release);
  note_contexts_changed();
}

// Where this process's tenant directory is, or false if none is configured.
bool tenant_directory(char* out, size_t len) {
  const char* dir = getenv("FRACGPU_TENANT_DIR");
  if (dir != nullptr && dir[0] != '\0') {
    snprintf(out, len, "%s", dir);
    return true;
  }
  const char* tenant = getenv("FRACGPU_TENANT");
  if (tenant != nullptr && tenant[0] != '\0') {
    const char* run_dir = getenv("FRACGPU_RUN_DIR");
    snprintf(out, len, "%s/tenants/%s", run_dir != nullptr && run_dir[0] != '\0' ? run_dir : "/run/fracgpu", tenant);
    return true;
  }
  // Inside a container: the tenant's directory mounted at the default path.
  struct stat st {};
  if (stat("/run/fracgpu/tenant", &st) == 0) {
    snprintf(out, len, "/run/fracgpu/tenant");
    return true;
  }
  return false;
}

TenantMode unmanaged_mode() {
  const char* policy = getenv("FRACGPU_UNMANAGED");
  return policy != nullptr && strcmp(policy, "deny") == 0 ? TenantMode::kDenied : TenantMode::kPassthrough;
}

TenantMode attach() {
  if (g_tenant.ledger.is_open()) ledger::close_ledger(&g_tenant.ledger);  // inherited over fork
  g_tenant.slot = -1;
  reset_memory_state();
  forget_devices();
  g_device_entry_generation.store(UINT64_MAX, std::memory_order_relaxed);

  char dir[1024];
  if (!tenant_directory(dir, sizeof dir)) {
    TenantMode mode = unmanaged_mode();
    log_line(LogLevel::kError,
             "no tenant: set FRACGPU_TENANT_DIR, or FRACGPU_TENANT (and FRACGPU_RUN_DIR), or mount the tenant "
             "directory at /run/fracgpu/tenant; %s",
             mode == TenantMode::kDenied ? "GPU access denied (FRACGPU_UNMANAGED=deny)"
                                         : "running without limits (FRACGPU_UNMANAGED=passthrough)");
    return mode;
  }
  char err[512] = {};
  ledger::TenantLedger ledger;
  ledger::LedgerError e = ledger::open_ledger(dir, ledger::AccessMode::kTenant, nullptr, &ledger, err, sizeof err);
  if (e == ledger::LedgerError::kMissing && ledger::has_tenant_state(dir)) {
    // A policy without its usage (or the reverse) is a tenant whose charges
    // cannot be counted: never a reason to run without limits.
    log_line(LogLevel::kError, "tenant ledger refused (missing): %s; GPU access denied", err);
    return TenantMode::kDenied;
  }
  if (e == ledger::LedgerError::kMissing) {
    TenantMode mode = unmanaged_mode();
    log_line(LogLevel::kError, "no tenant ledger: %s; %s", err,
             mode == TenantMode::kDenied ? "GPU access denied (FRACGPU_UNMANAGED=deny)" : "running without limits");
    return mode;
  }
  if (e != ledger::LedgerError::kOk) {
    // A tenant is configured but its ledger is unusable: refusing is the only
    // answer that cannot turn a damaged file into unlimited access.
    log_line(LogLevel::kError, "tenant ledger refused (%s): %s; GPU access denied", ledger::ledger_error_name(e), err);
    return TenantMode::kDenied;
  }
  ledger::ProcessIdentity self{};
  ledger::read_self_identity(&self);
  ledger::LedgerError slot_error = ledger::LedgerError::kOk;
  int slot = ledger::claim_slot(ledger, self, &slot_error);
  if (slot < 0) {
    log_line(LogLevel::kError, "%s: no free process slot (%s); GPU access denied", dir,
             ledger::ledger_error_name(slot_error));
    ledger::close_ledger(&ledger);
    return TenantMode::kDenied;
  }
  if (!g_tenant.pointers.ready()) {
    if (!g_tenant.pointers.init(kPointerTableLog2) || !g_tenant.handles.init(kHandleTableLog2)) {
      log_line(LogLevel::kError, "cannot map the allocation tables; GPU access denied");
      ledger::release_slot(ledger, static_cast<uint32_t>(slot));
      ledger::close_ledger(&ledger);
      return TenantMode::kDenied;
    }
  } else {
    g_tenant.pointers.reset();
    g_tenant.handles.reset();
  }
  // The slot is claimed before the policy is read: the daemon marks a
  // tenant draining and only then counts its live slots, so a process it
  // did not count has claimed its slot after the mark and sees it here.
  ledger::GpuTable table;
  const bool committed = ledger::read_gpu_table(ledger, &table);
  for (const ledger::GpuEntry& e : table.gpus) {
    if (e.state != ledger::kGpuGranted || (e.flags & ledger::kTenantDraining) == 0) continue;
    log_line(LogLevel::kError,
             "tenant \"%s\" (%s) is being deleted: it accepts no new process (those already running keep their "
             "quotas until they exit); GPU access denied",
             ledger.policy->tenant, dir);
    ledger::release_slot(ledger, static_cast<uint32_t>(slot));
    ledger::close_ledger(&ledger);
    return TenantMode::kDenied;
  }
  g_tenant.ledger = ledger;
  g_tenant.slot = slot;
  snprintf(g_tenant.dir, sizeof g_tenant.dir, "%s", dir);
  log_line(LogLevel::kInfo, "attached to tenant \"%s\" (%s), slot %d", ledger.policy->tenant, dir, slot);
  if (!committed)
    log_line(LogLevel::kError,
             "%s: the policy holds no copy of generation %llu, which %s/node says is in force: no GPU is granted "
             "until fracgpud commits a policy for this tenant",
             dir, static_cast<unsigned long long>(table.generation), dir);
  return TenantMode::kManaged;
}

}  // namespace

TenantMode attach_tenant_slow() {
  for (;;) {
    int mode = g_tenant_mode.load(std::memory_order_acquire);
    if (mode == static_cast<int>(TenantMode::kAttaching)) {
      sched_yield();
      continue;
    }
    if (mode != static_cast<int>(TenantMode::kUnattached)) return static_cast<TenantMode>(mode);
    if (!g_tenant_mode.compare_exchange_weak(mode, static_cast<int>(TenantMode::kAttaching),
                                             std::memory_order_acq_rel))
      continue;
    if (!g_atfork_registered.exchange(true)) pthread_atfork(nullptr, nullptr, on_fork_child);
    TenantMode result = attach();
    g_tenant_mode.store(static_cast<int>(result), std::memory_order_release);
    return result;
  }
}

ledger::GpuEntry gpu_policy(int gpu) { return ledger::read_gpu_entry(g_tenant.ledger, static_cast<uint32_t>(gpu)); }

int gpu_entry_for_device(CUdevice device) {
  if (device < 0 || device >= kMaxDevices) return kNotGranted;
  // A new grant (config reload) commits a new generation: look again.
  const uint64_t generation = g_tenant.ledger.node->committed.load(std::memory_order_acquire);
  if (generation != g_device_entry_generation.load(std::memory_order_relaxed)) [[unlikely]] {
    forget_devices();
    g_device_entry_generation.store(generation, std::memory_order_relaxed);
  }
  int entry = g_device_entry[device].load(std::memory_order_relaxed);
  if (entry != kUnknownDevice) [[likely]]
    return entry;
  CUuuid uuid{};
  entry = kNotGranted;
  if (g_driver.cuDeviceGetUuid_v2 != nullptr && g_driver.cuDeviceGetUuid_v2(&uuid, device) == CUDA_SUCCESS)
    entry = ledger::find_gpu(g_tenant.ledger, reinterpret_cast<const uint8_t*>(uuid.bytes));
  if (entry == kNotGranted)
    FRACGPU_LOG_ONCE(LogLevel::kError, "device %d is not granted to tenant \"%s\": allocations on it are refused",
                     device, g_tenant.ledger.policy->tenant);
  g_device_entry[device].store(entry, std::memory_order_relaxed);
  return entry;
}

namespace {

const char* unavailable_text(uint32_t reason) {
  switch (reason) {
    case ledger::kGpuLost: return "NVML cannot reach it";
    case ledger::kGpuXid: return "critical Xid";
    case ledger::kGpuEcc: return "uncorrected ECC errors:";
    case ledger::kGpuSensors: return "its temperature or power cannot be read";
    case ledger::kGpuBypassDenied: return "tenant denied: a process uses this GPU without fracgpu, pid";
    default: return "reason code";
  }
}

}  // namespace

bool visible_gpu_unavailable() {
  int count = 0;
  if (g_driver.cuDeviceGetCount == nullptr || g_driver.cuDeviceGetUuid_v2 == nullptr ||
      g_driver.cuDeviceGetCount(&count) != CUDA_SUCCESS)
    return false;  // the driver will report its own trouble on the next call
  ledger::GpuTable table;
  ledger::read_gpu_table(g_tenant.ledger, &table);
  for (int device = 0; device < count; ++device) {
    CUuuid uuid{};
    if (g_driver.cuDeviceGetUuid_v2(&uuid, device) != CUDA_SUCCESS) continue;
    const int entry = ledger::find_gpu(table, reinterpret_cast<const uint8_t*>(uuid.bytes));
    if (entry < 0 || table.gpus[entry].state != ledger::kGpuGranted) continue;
    const uint32_t reason = table.gpus[entry].unavailable;
    if (reason == ledger::kGpuAvailable) continue;
    const uint32_t detail = table.gpus[entry].unavailable_detail;
    const auto* u = reinterpret_cast<const unsigned char*>(uuid.bytes);
    const bool has_detail = reason != ledger::kGpuLost && reason != ledger::kGpuSensors;
    char number[16] = "";
    if (has_detail) snprintf(number, sizeof number, " %u", detail);
    log_line(LogLevel::kError,
             "cuInit refused: device %d (GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x) "
             "is marked unavailable by fracgpud (%s%s); new processes of tenant \"%s\" get "
             "CUDA_ERROR_DEVICE_UNAVAILABLE until it is cleared, running ones are not affected",
             device, u[0], u[1], u[2], u[3], u[4], u[5], u[6], u[7], u[8], u[9], u[10], u[11], u[12], u[13], u[14],
             u[15], unavailable_text(reason), number, g_tenant.ledger.policy->tenant);
    return true;
  }
  return false;
}

void note_contexts_changed() {
  g_context_epoch.fetch_add(1, std::memory_order_acq_rel);
  // Creating a context makes it current, and destroying the current one pops
  // it: either way this thread's launch pass may be for another GPU than its
  // next launch's (docs/sm-time.md). The next launch re-checks.
  invalidate_launch_pass();
}

bool current_gpu_entry(CUcontext* ctx, CUdevice* device, int* gpu) {
  if (g_driver.cuCtxGetCurrent == nullptr || g_driver.cuCtxGetDevice == nullptr) return false;
  if (g_driver.cuCtxGetCurrent(ctx) != CUDA_SUCCESS || *ctx == nullptr) return false;
  CurrentDevice& cached = t_current_device;
  const uint64_t epoch = g_context_epoch.load(std::memory_order_acquire);
  if (cached.ctx == *ctx && cached.epoch == epoch) [[likely]] {
    *device = cached.device;
  } else {
    if (g_driver.cuCtxGetDevice(device) != CUDA_SUCCESS) return false;
    cached = {*ctx, *device, epoch};
  }
  *gpu = gpu_entry_for_device(*device);
  return true;
}

bool reserve(int gpu, uint64_t bytes) {
  if (gpu < 0) return false;
  auto& ledger = g_tenant.ledger;
  if (ledger::try_charge(ledger, static_cast<uint32_t>(gpu), static_cast<uint32_t>(g_tenant.slot), bytes)) [[likely]]
    return true;
  // Refused. Charges of dead processes and slack held by our own pools may
  // be standing in the way: clear both, then ask once more.
  ledger::ReclaimResult reclaim = ledger::reclaim_dead_slots(ledger, g_tenant.slot);
  if (reclaim.pending > 0) {
    // A neighbour just died and the driver may still be giving its memory
    // back: wait out the grace period once rather than refuse.
    struct timespec grace = {0, static_cast<long>(ledger::kReclaimGraceNs)};
    nanosleep(&grace, nullptr);
    ledger::reclaim_dead_slots(ledger, g_tenant.slot);
  }
  settle_all_pools();
  if (ledger::try_charge(ledger, static_cast<uint32_t>(gpu), static_cast<uint32_t>(g_tenant.slot), bytes))
    return true;
  log_line(LogLevel::kInfo, "refused %llu bytes on GPU entry %d: quota %llu, tenant uses %llu",
           static_cast<unsigned long long>(bytes), gpu,
           static_cast<unsigned long long>(gpu_policy(gpu).memory_quota),
           static_cast<unsigned long long>(ledger::tenant_used(*ledger.usage, static_cast<uint32_t>(gpu))));
  return false;
}

void unreserve(int gpu, uint64_t bytes) {
  if (gpu < 0 || bytes == 0) return;
  ledger::uncharge(*g_tenant.ledger.usage, static_cast<uint32_t>(gpu), static_cast<uint32_t>(g_tenant.slot), bytes);
}

}  // namespace fracgpu::interpose
