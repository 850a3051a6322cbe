#include "tenant.h"

#include <dirent.h>
#include <fcntl.h>
#include <pthread.h>
#include <sched.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "hook_table.h"
#include "launch_gate.h"
#include "log.h"
#include "memory_held.h"

namespace fracgpu::interpose {

std::atomic<int> g_tenant_mode{0};
TenantState g_tenants[kMaxTenants];
int g_tenant_count = 0;
ChargeTable g_pointers;
ChargeTable g_handles;

namespace {

constexpr int kUnknownDevice = -2;
constexpr unsigned kPointerTableLog2 = 18;  // 262144 live allocations
constexpr unsigned kHandleTableLog2 = 14;   // 16384 arrays, VMM handles, contexts

std::atomic<int> g_device_entry[kMaxDevices];
std::atomic<uint64_t> g_device_entry_generation{UINT64_MAX};
// Devices two tenants grant (refused), and those already logged as such.
std::atomic<uint64_t> g_device_denied{0};
std::atomic<uint64_t> g_device_denied_logged{0};
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
  g_device_denied.store(0, std::memory_order_relaxed);
}

// The committed generations of every tenant's policy, summed: each only
// grows, so the sum changes whenever one does (one load with one tenant).
uint64_t committed_generations() {
  uint64_t sum = g_tenants[0].ledger.node->committed.load(std::memory_order_acquire);
  for (int t = 1; t < g_tenant_count; ++t) sum += g_tenants[t].ledger.node->committed.load(std::memory_order_acquire);
  return sum;
}

// Dead slots are reclaimed by taking their record locks, and a record lock
// is the process's, not the thread's: two of our threads reclaiming at once
// would both get a dead slot's lock, and the later could clear the slot
// after the first had freed it and another process had claimed it (that
// process's charges lost, its later uncharge wrapping). One at a time.
std::atomic<bool> g_reclaiming{false};

ledger::ReclaimResult reclaim_dead_slots_alone(ledger::TenantLedger& ledger, int own_slot) {
  SpinGuard one_at_a_time(g_reclaiming);
  return ledger::reclaim_dead_slots(ledger, own_slot);
}

// In a forked child the parent's slot lock is not ours (record locks are not
// inherited) and its allocations are not usable: start over on next use.
void on_fork_child() {
  g_reclaiming.store(false, std::memory_order_relaxed);  // a thread the child does not have may have held it
  g_tenant_mode.store(static_cast<int>(TenantMode::kUnattached), std::memory_order_release);
  note_contexts_changed();
}

using DirName = char[1024];

// The entries of the claims directory that may be tenant directories (not
// "." or "..", nor hidden), the `capacity` (at most kMaxTenants) first by
// name: their number, and in *seen how many there were. No allocation
// (attach may run anywhere): the directory is read with getdents64 into a
// buffer on the stack.
int claim_directories(const char* parent, DirName* out, int capacity, int* seen) {
  *seen = 0;
  if (capacity > kMaxTenants) capacity = kMaxTenants;
  if (capacity <= 0) return 0;
  const int fd = open(parent, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return 0;
  char names[kMaxTenants][256];
  int count = 0;
  alignas(8) char buf[4096];
  for (;;) {
    const long n = syscall(SYS_getdents64, fd, buf, sizeof buf);
    if (n <= 0) break;
    for (long at = 0; at < n;) {
      const auto* d = reinterpret_cast<const struct dirent64*>(buf + at);
      at += d->d_reclen;
      if (d->d_name[0] == '.') continue;
      // Directories (a container's mount points), or links to them.
      if (d->d_type != DT_DIR && d->d_type != DT_LNK && d->d_type != DT_UNKNOWN) continue;
      ++*seen;
      // Insertion into the sorted `capacity` first names.
      int i = count < capacity ? count++ : capacity;
      if (i == capacity && strcmp(d->d_name, names[capacity - 1]) >= 0) continue;
      if (i == capacity) i = capacity - 1;
      for (; i > 0 && strcmp(d->d_name, names[i - 1]) < 0; --i) memcpy(names[i], names[i - 1], sizeof names[i]);
      snprintf(names[i], sizeof names[i], "%s", d->d_name);
    }
  }
  close(fd);
  int kept = 0;
  for (int i = 0; i < count; ++i)  // a path too long to hold is no tenant's: left out
    if (snprintf(out[kept], sizeof out[kept], "%s/%s", parent, names[i]) < static_cast<int>(sizeof out[kept])) ++kept;
  return kept;
}

// Where this process's tenant directories are: how many (0: none configured).
int tenant_directories(DirName* out) {
  const char* dir = getenv("FRACGPU_TENANT_DIR");
  if (dir != nullptr && dir[0] != '\0') {
    snprintf(out[0], sizeof out[0], "%s", dir);
    return 1;
  }
  const char* tenant = getenv("FRACGPU_TENANT");
  if (tenant != nullptr && tenant[0] != '\0') {
    const char* run_dir = getenv("FRACGPU_RUN_DIR");
    snprintf(out[0], sizeof out[0], "%s/tenants/%s", run_dir != nullptr && run_dir[0] != '\0' ? run_dir : "/run/fracgpu", tenant);
    return 1;
  }
  // Inside a container: the tenant's directory mounted at the default path,
  // and each Kubernetes claim's at its own path under the claims directory.
  int count = 0;
  struct stat st {};
  if (stat("/run/fracgpu/tenant", &st) == 0) snprintf(out[count++], sizeof out[0], "/run/fracgpu/tenant");
  const char* claims = getenv("FRACGPU_CLAIMS_DIR");
  if (claims == nullptr || claims[0] == '\0') claims = "/run/fracgpu/claims";
  int seen = 0;
  const int found = claim_directories(claims, out + count, kMaxTenants - count, &seen);
  if (seen > found)
    log_line(LogLevel::kError,
             "%s holds %d claims' tenant directories: attached to the first %d by name only (at most %d tenants); "
             "the GPUs of the others are refused",
             claims, seen, found, kMaxTenants);
  return count + found;
}

TenantMode unmanaged_mode() {
  const char* policy = getenv("FRACGPU_UNMANAGED");
  return policy != nullptr && strcmp(policy, "deny") == 0 ? TenantMode::kDenied : TenantMode::kPassthrough;
}

// Attaches to one tenant directory: its ledger validated and a slot claimed,
// into *out. kManaged, or the verdict for the process (after one log line).
TenantMode attach_dir(const char* dir, TenantState* out) {
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
  // The slot is claimed before the policy is read: the daemon marks a
  // tenant draining and only then counts its live slots, so a process it
  // did not count has claimed its slot after the mark and sees it here.
  ledger::GpuTable table;
  const bool committed = ledger::read_gpu_table(ledger, &table);
  for (const ledger::GpuEntry& g : table.gpus) {
    if (g.state != ledger::kGpuGranted || (g.flags & ledger::kTenantDraining) == 0) continue;
    log_line(LogLevel::kError,
             "tenant \"%s\" (%s) is being deleted: it accepts no new process (those already running keep their "
             "quotas until they exit); GPU access denied",
             ledger.policy->tenant, dir);
    ledger::release_slot(ledger, static_cast<uint32_t>(slot));
    ledger::close_ledger(&ledger);
    return TenantMode::kDenied;
  }
  out->ledger = ledger;
  out->slot = slot;
  if (snprintf(out->dir, sizeof out->dir, "%s", dir) >= static_cast<int>(sizeof out->dir)) out->dir[0] = '\0';
  log_line(LogLevel::kInfo, "attached to tenant \"%s\" (%s), slot %d", ledger.policy->tenant, dir, slot);
  if (!committed)
    log_line(LogLevel::kError,
             "%s: the policy holds no copy of generation %llu, which %s/node says is in force: no GPU is granted "
             "until fracgpud commits a policy for this tenant",
             dir, static_cast<unsigned long long>(table.generation), dir);
  return TenantMode::kManaged;
}

void detach_all() {
  for (int t = 0; t < g_tenant_count; ++t) {
    TenantState& tenant = g_tenants[t];
    if (tenant.slot >= 0) ledger::release_slot(tenant.ledger, static_cast<uint32_t>(tenant.slot));
    ledger::close_ledger(&tenant.ledger);
    tenant.slot = -1;
  }
  g_tenant_count = 0;
}

TenantMode attach() {
  // Inherited over fork: the parent's slots are not ours (record locks are
  // not inherited), so only the mappings are closed.
  for (TenantState& tenant : g_tenants) {
    if (tenant.ledger.is_open()) ledger::close_ledger(&tenant.ledger);
    tenant.slot = -1;
  }
  g_tenant_count = 0;
  reset_memory_state();
  forget_devices();
  g_device_entry_generation.store(UINT64_MAX, std::memory_order_relaxed);

  DirName dirs[kMaxTenants];
  const int count = tenant_directories(dirs);
  if (count == 0) {
    TenantMode mode = unmanaged_mode();
    log_line(LogLevel::kError,
             "no tenant: set FRACGPU_TENANT_DIR, or FRACGPU_TENANT (and FRACGPU_RUN_DIR), or mount the tenant "
             "directory at /run/fracgpu/tenant (or each claim's under /run/fracgpu/claims/); %s",
             mode == TenantMode::kDenied ? "GPU access denied (FRACGPU_UNMANAGED=deny)"
                                         : "running without limits (FRACGPU_UNMANAGED=passthrough)");
    return mode;
  }
  if (!g_pointers.ready()) {
    if (!g_pointers.init(kPointerTableLog2) || !g_handles.init(kHandleTableLog2)) {
      log_line(LogLevel::kError, "cannot map the allocation tables; GPU access denied");
      return TenantMode::kDenied;
    }
  } else {
    g_pointers.reset();
    g_handles.reset();
  }
  for (int i = 0; i < count; ++i) {
    const TenantMode mode = attach_dir(dirs[i], &g_tenants[g_tenant_count]);
    if (mode == TenantMode::kManaged) {
      ++g_tenant_count;
      continue;
    }
    // One of several directories unusable: its GPUs cannot be told from the
    // others', and passing through would leave the others' unlimited.
    detach_all();
    if (count > 1 && mode != TenantMode::kDenied) {
      log_line(LogLevel::kError, "%s is one of %d tenant directories and holds no ledger; GPU access denied", dirs[i],
               count);
      return TenantMode::kDenied;
    }
    return mode;
  }
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

ledger::GpuEntry gpu_policy(int gpu) { return ledger::read_gpu_entry(tenant_of(gpu).ledger, entry_of(gpu)); }

namespace {

constexpr int kTwoTenants = -5;  // not kUnknownDevice: never stored

// The GPU for `uuid` in the tables given (one per tenant), kNotGranted, or
// kTwoTenants (then the two granting it are in *first and *second). A
// tenant's revoked entry (kept while its charges drain) counts only where no
// tenant grants the GPU.
int find_tenant_gpu(const ledger::GpuTable* tables, const uint8_t uuid[16], int* first, int* second) {
  int granted = kNotGranted, revoked = kNotGranted;
  for (int t = 0; t < g_tenant_count; ++t) {
    const int entry = ledger::find_gpu(tables[t], uuid);
    if (entry < 0) continue;
    const int gpu = t * static_cast<int>(ledger::kMaxGpus) + entry;
    if (tables[t].gpus[entry].state != ledger::kGpuGranted) {
      if (revoked == kNotGranted) revoked = gpu;
      continue;
    }
    if (granted != kNotGranted) {
      *first = granted;
      *second = gpu;
      return kTwoTenants;
    }
    granted = gpu;
  }
  return granted != kNotGranted ? granted : revoked;
}

int find_tenant_gpu(const uint8_t uuid[16], int* first, int* second) {
  ledger::GpuTable tables[kMaxTenants];
  for (int t = 0; t < g_tenant_count; ++t) ledger::read_gpu_table(g_tenants[t].ledger, &tables[t]);
  return find_tenant_gpu(tables, uuid, first, second);
}

}  // namespace

int gpu_for_uuid(const uint8_t uuid[16]) {
  int first = kNotGranted, second = kNotGranted;
  const int gpu = find_tenant_gpu(uuid, &first, &second);
  return gpu >= 0 ? gpu : kNotGranted;
}

int granted_gpus(uint8_t (*out)[16], int capacity) {
  int n = 0;
  for (int t = 0; t < g_tenant_count; ++t) {
    ledger::GpuTable table;
    ledger::read_gpu_table(g_tenants[t].ledger, &table);
    for (const ledger::GpuEntry& e : table.gpus) {
      if (e.state != ledger::kGpuGranted) continue;
      bool listed = false;
      for (int i = 0; i < n && !listed; ++i) listed = memcmp(out[i], e.uuid, 16) == 0;
      if (listed || n == capacity) continue;
      memcpy(out[n++], e.uuid, 16);
    }
  }
  return n;
}

bool is_granted_gpu(const uint8_t uuid[16]) {
  for (int t = 0; t < g_tenant_count; ++t) {
    ledger::GpuTable table;
    ledger::read_gpu_table(g_tenants[t].ledger, &table);
    const int entry = ledger::find_gpu(table, uuid);
    if (entry >= 0 && table.gpus[entry].state == ledger::kGpuGranted) return true;
  }
  return false;
}

const char* tenants_text(char* buf, size_t size) {
  if (g_tenant_count == 1)
    snprintf(buf, size, "tenant \"%s\" (%s)", g_tenants[0].ledger.policy->tenant, g_tenants[0].dir);
  else
    snprintf(buf, size, "this process's %d tenants", g_tenant_count);
  return buf;
}

bool device_denied(CUdevice device) {
  return device >= 0 && device < kMaxDevices && gpu_entry_for_device(device) == kNotGranted &&
         (g_device_denied.load(std::memory_order_relaxed) >> device & 1) != 0;
}

bool device_exists(CUdevice device) {
  CUuuid uuid{};
  return g_driver.cuDeviceGetUuid_v2 != nullptr && g_driver.cuDeviceGetUuid_v2(&uuid, device) == CUDA_SUCCESS;
}

int gpu_entry_for_device(CUdevice device) {
  if (device < 0 || device >= kMaxDevices) return kNotGranted;
  // A new grant (config reload) commits a new generation: look again.
  const uint64_t generation = committed_generations();
  if (generation != g_device_entry_generation.load(std::memory_order_relaxed)) [[unlikely]] {
    forget_devices();
    g_device_entry_generation.store(generation, std::memory_order_relaxed);
  }
  int entry = g_device_entry[device].load(std::memory_order_relaxed);
  if (entry != kUnknownDevice) [[likely]]
    return entry;
  CUuuid uuid{};
  entry = kNotGranted;
  int first = kNotGranted, second = kNotGranted;
  // No such device (an ordinal past those the process sees): nobody's, and
  // nothing to say or remember (the caller lets the driver answer).
  if (g_driver.cuDeviceGetUuid_v2 == nullptr || g_driver.cuDeviceGetUuid_v2(&uuid, device) != CUDA_SUCCESS)
    return kNotGranted;
  entry = find_tenant_gpu(reinterpret_cast<const uint8_t*>(uuid.bytes), &first, &second);
  if (entry == kTwoTenants) {
    // Whose quota and GPU time would it be? Neither can be told: refused.
    const uint64_t bit = uint64_t{1} << device;
    g_device_denied.fetch_or(bit, std::memory_order_relaxed);
    if ((g_device_denied_logged.fetch_or(bit, std::memory_order_relaxed) & bit) == 0)
      log_line(LogLevel::kError,
               "device %d is granted to two tenants of this process, \"%s\" (%s) and \"%s\" (%s): whose quota "
               "and GPU time it would use cannot be told, so it is refused (CUDA_ERROR_NOT_PERMITTED)",
               device, tenant_of(first).ledger.policy->tenant, tenant_of(first).dir,
               tenant_of(second).ledger.policy->tenant, tenant_of(second).dir);
    entry = kNotGranted;
  } else if (entry == kNotGranted) {
    if (g_tenant_count == 1)
      FRACGPU_LOG_ONCE(LogLevel::kError, "device %d is not granted to tenant \"%s\": allocations on it are refused",
                       device, g_tenants[0].ledger.policy->tenant);
    else
      FRACGPU_LOG_ONCE(LogLevel::kError,
                       "device %d is granted to none of this process's %d tenants: allocations on it are refused",
                       device, g_tenant_count);
  }
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
  ledger::GpuTable tables[kMaxTenants];
  for (int t = 0; t < g_tenant_count; ++t) ledger::read_gpu_table(g_tenants[t].ledger, &tables[t]);
  for (int device = 0; device < count; ++device) {
    CUuuid uuid{};
    if (g_driver.cuDeviceGetUuid_v2(&uuid, device) != CUDA_SUCCESS) continue;
    int first = kNotGranted, second = kNotGranted;
    const int gpu = find_tenant_gpu(tables, reinterpret_cast<const uint8_t*>(uuid.bytes), &first, &second);
    if (gpu < 0) continue;
    const ledger::GpuEntry& e = tables[gpu / static_cast<int>(ledger::kMaxGpus)].gpus[entry_of(gpu)];
    if (e.state != ledger::kGpuGranted) continue;
    const uint32_t reason = e.unavailable;
    if (reason == ledger::kGpuAvailable) continue;
    const uint32_t detail = e.unavailable_detail;
    const auto* u = reinterpret_cast<const unsigned char*>(uuid.bytes);
    const bool has_detail = reason != ledger::kGpuLost && reason != ledger::kGpuSensors;
    char number[16] = "";
    if (has_detail) snprintf(number, sizeof number, " %u", detail);
    log_line(LogLevel::kError,
             "cuInit refused: device %d (GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x) "
             "is marked unavailable by fracgpud (%s%s); new processes of tenant \"%s\" get "
             "CUDA_ERROR_DEVICE_UNAVAILABLE until it is cleared, running ones are not affected",
             device, u[0], u[1], u[2], u[3], u[4], u[5], u[6], u[7], u[8], u[9], u[10], u[11], u[12], u[13], u[14],
             u[15], unavailable_text(reason), number, tenant_of(gpu).ledger.policy->tenant);
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
  TenantState& tenant = tenant_of(gpu);
  const uint32_t entry = entry_of(gpu);
  auto& ledger = tenant.ledger;
  if (ledger::try_charge(ledger, entry, static_cast<uint32_t>(tenant.slot), bytes)) [[likely]]
    return true;
  // Refused. Charges of dead processes and slack held by our own pools may
  // be standing in the way: clear both, then ask once more.
  ledger::ReclaimResult reclaim = reclaim_dead_slots_alone(ledger, tenant.slot);
  if (reclaim.pending > 0) {
    // A neighbour just died and the driver may still be giving its memory
    // back: wait out the grace period once rather than refuse.
    struct timespec grace = {0, static_cast<long>(ledger::kReclaimGraceNs)};
    nanosleep(&grace, nullptr);
    reclaim_dead_slots_alone(ledger, tenant.slot);
  }
  settle_all_pools();
  if (ledger::try_charge(ledger, entry, static_cast<uint32_t>(tenant.slot), bytes))
    return true;
  log_line(LogLevel::kInfo, "refused %llu bytes on GPU entry %u of tenant \"%s\": quota %llu, tenant uses %llu",
           static_cast<unsigned long long>(bytes), entry, ledger.policy->tenant,
           static_cast<unsigned long long>(gpu_policy(gpu).memory_quota),
           static_cast<unsigned long long>(ledger::tenant_used(*ledger.usage, entry)));
  return false;
}

void unreserve(int gpu, uint64_t bytes) {
  if (gpu < 0 || bytes == 0) return;
  const TenantState& tenant = tenant_of(gpu);
  ledger::uncharge(*tenant.ledger.usage, entry_of(gpu), static_cast<uint32_t>(tenant.slot), bytes);
}

}  // namespace fracgpu::interpose
