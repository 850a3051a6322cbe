// NVML inside the tenant: which GPUs there are, and what nvidia-smi and
// frameworks read about memory and processes, shown as the tenant's share of
// the GPU.
//
// - GPUs (nvmlDeviceGetCount, nvmlDeviceGetHandleByIndex, both versions;
//   nvmlDeviceGetIndex): only those the process's tenants grant, numbered
//   from 0 in NVML's order, which is the order CUDA numbers them in for the
//   process (visible_devices.h). Lookups by UUID, PCI bus ID or serial of any
//   other GPU: NVML_ERROR_NOT_FOUND.
// - Memory (nvmlDeviceGetMemoryInfo, _v2): the same view as cuMemGetInfo
//   (tenant_memory_view): total = the quota, used = the tenant's usage on
//   that GPU (all its processes, from the ledger), free = total - used capped
//   by the device's real free memory; _v2's `reserved` is 0. No quota: the
//   real figures. A GPU not granted to the tenant: all 0.
// - Processes (compute lists, v1/_v2/_v3): the tenant's own processes only,
//   taken from its ledger, not from NVML's list. The driver reports host
//   PIDs, which mean nothing inside a container's PID namespace (an empty
//   process table in nvidia-smi, HAMi's failure); the ledger's record locks
//   give each live process's PID *in this process's namespace* (F_GETLK), so
//   the rows carry the PIDs `ps` shows here and nvidia-smi can name them.
//   Each row's memory is what fracgpu charged that process on that GPU, so
//   the rows add up to the `used` shown above them.
// - Graphics and MPS lists: empty (fracgpu charges neither).
// - nvmlDeviceGetRunningProcessDetailList: by its mode, the compute list or
//   an empty graphics/MPS list, as above.
// - Per-process utilization (nvmlDeviceGetProcessUtilization,
//   nvmlDeviceGetProcessesUtilizationInfo) and accounting records
//   (nvmlDeviceGetAccountingPids/Stats): NVML's own, filtered to the tenant's
//   processes and renumbered to this namespace's PIDs (see keep_own).
// - Device utilization (nvmlDeviceGetUtilizationRates): the tenant's own
//   GPU time over the last second, as the daemon publishes it in the GPU's
//   arbiter (what `fracgpu status` shows), not the device's, which counts
//   every tenant's work; memory: the device's figure in the same proportion.
//   The device's rings of utilization samples (nvmlDeviceGetSamples, GPU
//   and memory) have nothing of the tenant's alone: no samples.
//
// The NVML device is matched to the GPU entry of the tenant granting it by
// UUID (the real nvmlDeviceGetUUID), never by index; "the tenant" is that
// one (a process with several tenants: docs/architecture.md). None of this is a hot path, but the
// user's process rules hold: no exit, NVML errors returned, log once.
#include "nvml_hooks.h"

#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "gputime.h"
#include "log.h"
#include "memory_hooks.h"
#include "tenant.h"

namespace fracgpu::interpose {

namespace {

// NVML functions we call without hooking them.
struct NvmlCalls {
  decltype(&::nvmlDeviceGetUUID) get_uuid;
  decltype(&::nvmlInit_v2) init;
  decltype(&::nvmlShutdown) shutdown;
};
NvmlCalls g_nvml = {};

void resolve_nvml_calls(DlsymFn sym, void* handle, void* into) {
  auto& calls = *static_cast<NvmlCalls*>(into);
  calls.get_uuid = reinterpret_cast<decltype(calls.get_uuid)>(sym(handle, "nvmlDeviceGetUUID"));
  calls.init = reinterpret_cast<decltype(calls.init)>(sym(handle, "nvmlInit_v2"));
  calls.shutdown = reinterpret_cast<decltype(calls.shutdown)>(sym(handle, "nvmlShutdown"));
}

}  // namespace

const char* const kNvmlHookNames[kNvmlHookCount] = {
#define FRACGPU_NVML_HOOK(name, impl, params, args) #name,
#include "nvml_hooks.def"
};
void* const kNvmlHookAddresses[kNvmlHookCount] = {
#define FRACGPU_NVML_HOOK(name, impl, params, args) reinterpret_cast<void*>(&::name),
#include "nvml_hooks.def"
};
void* g_nvml_real[kNvmlHookCount] = {};
std::atomic<bool> g_nvml_ready{false};

RealTable g_nvml_table = {"libnvidia-ml.so.1", "libnvidia-ml.so", "NVML",         kNvmlHookNames,
                          kNvmlHookAddresses,  g_nvml_real,       kNvmlHookCount, 1u << 1,
                          &g_nvml_ready,       &g_nvml,           sizeof g_nvml,  resolve_nvml_calls};

namespace {

// No real function to call: NVML could not be loaded, or lacks this one.
nvmlReturn_t no_real_function() {
  return g_nvml_table.state.load(std::memory_order_acquire) == RealTable::kFailed ? NVML_ERROR_LIBRARY_NOT_FOUND
                                                                 : NVML_ERROR_FUNCTION_NOT_FOUND;
}

enum class Scope {
  kReal,     // not a managed tenant: NVML's own answer
  kTenant,   // the tenant's view of GPU entry *gpu (kNotGranted: none)
  kRefused,  // answer *error
};

Scope scope_of(nvmlDevice_t device, int* gpu, nvmlReturn_t* error) {
  const TenantMode mode = tenant_mode();
  if (mode == TenantMode::kPassthrough) return Scope::kReal;
  if (mode != TenantMode::kManaged) {
    // A refused ledger: the real figures would show other tenants' memory and
    // processes, and the quota is unknown.
    FRACGPU_LOG_ONCE(LogLevel::kError, "NVML memory and process queries refused: the tenant ledger was refused");
    *error = NVML_ERROR_NO_PERMISSION;
    return Scope::kRefused;
  }
  if (g_nvml.get_uuid == nullptr) {
    FRACGPU_LOG_ONCE(LogLevel::kError, "NVML lacks nvmlDeviceGetUUID: cannot tell which GPU a query is about");
    *error = NVML_ERROR_FUNCTION_NOT_FOUND;
    return Scope::kRefused;
  }
  char text[NVML_DEVICE_UUID_V2_BUFFER_SIZE] = {};
  // Also what checks the handle, initialisation and a lost GPU for us.
  const nvmlReturn_t result = g_nvml.get_uuid(device, text, sizeof text);
  if (result != NVML_SUCCESS) {
    *error = result;
    return Scope::kRefused;
  }
  // Anything but a GPU's UUID (MIG devices' "MIG-..." included) is not a GPU we grant.
  uint8_t uuid[16];
  *gpu = ledger::parse_gpu_uuid_text(text, uuid) ? gpu_for_uuid(uuid) : kNotGranted;
  return Scope::kTenant;
}

// A device's GPU UUID (false: NVML cannot say, or it is no GPU's: a MIG
// device's "MIG-..." included).
bool device_uuid(nvmlDevice_t device, uint8_t uuid[16]) {
  char text[NVML_DEVICE_UUID_V2_BUFFER_SIZE] = {};
  return g_nvml.get_uuid != nullptr && g_nvml.get_uuid(device, text, sizeof text) == NVML_SUCCESS &&
         ledger::parse_gpu_uuid_text(text, uuid);
}

// Whether a tenant's process (managed mode) sees the device: one of its
// tenants grants it.
bool tenant_sees(nvmlDevice_t device) {
  uint8_t uuid[16];
  return device_uuid(device, uuid) && is_granted_gpu(uuid);
}

// NVML's enumeration a hook goes with: the first versions' count and index
// lookup, or the _v2 ones (either one standing in where NVML lacks the other).
struct Enumeration {
  nvmlReturn_t (*count)(unsigned int*) = nullptr;
  nvmlReturn_t (*by_index)(unsigned int, nvmlDevice_t*) = nullptr;
};

template <NvmlHookId id>
Enumeration enumeration() {
  constexpr bool first = id == NvmlHookId::nvmlDeviceGetCount || id == NvmlHookId::nvmlDeviceGetHandleByIndex;
  Enumeration v1{nvml_real<NvmlHookId::nvmlDeviceGetCount>(), nvml_real<NvmlHookId::nvmlDeviceGetHandleByIndex>()};
  Enumeration v2{nvml_real<NvmlHookId::nvmlDeviceGetCount_v2>(),
                 nvml_real<NvmlHookId::nvmlDeviceGetHandleByIndex_v2>()};
  Enumeration e = first ? v1 : v2;
  const Enumeration& other = first ? v2 : v1;
  if (e.count == nullptr) e.count = other.count;
  if (e.by_index == nullptr) e.by_index = other.by_index;
  return e;
}

// The tenant's devices in NVML's order: visit(handle, k) for the k-th, until
// it returns true. NVML's error if it cannot count (not initialized, ...).
template <class Visit>
nvmlReturn_t walk_tenant_devices(const Enumeration& e, Visit visit) {
  if (e.count == nullptr || e.by_index == nullptr) return no_real_function();
  unsigned real_count = 0;
  if (const nvmlReturn_t r = e.count(&real_count); r != NVML_SUCCESS) return r;
  unsigned k = 0;
  for (unsigned i = 0; i < real_count; ++i) {
    nvmlDevice_t device = nullptr;
    if (e.by_index(i, &device) != NVML_SUCCESS || !tenant_sees(device)) continue;
    if (visit(device, k++)) break;
  }
  return NVML_SUCCESS;
}

// The tenant's memory on GPU entry `gpu`; false: no quota, keep the real figures.
bool tenant_memory(int gpu, uint64_t real_free, uint64_t real_total, uint64_t* total, uint64_t* free, uint64_t* used) {
  if (!tenant_memory_view(gpu, real_free, real_total, free, total)) return false;
  // Read again after `free` was: never more than total - free, so that a
  // charge made between the two reads cannot make used + free exceed total.
  *used = gpu < 0 || *total == 0
              ? 0
              : std::min(ledger::tenant_used(*tenant_of(gpu).ledger.usage, entry_of(gpu)), *total - std::min(*free, *total));
  return true;
}

struct OwnProcess {
  unsigned pid;
  uint64_t bytes;
};

// The PID of slot `s`'s owner in this process's namespace: the kernel names
// a record lock's holder in the asker's namespace (0 if it is not visible
// there); nobody holding it means the owner is gone and only awaits
// reclaiming. A process cannot see its own lock, so our own slot is getpid().
int32_t local_pid_of_slot(const TenantState& tenant, uint32_t s) {
  return static_cast<int>(s) == tenant.slot ? getpid() : ledger::slot_owner_pid(tenant.ledger, s);
}

// The tenant's live processes holding a charge on GPU entry `gpu`, with PIDs
// in this process's PID namespace. Processes of the tenant in a namespace we
// cannot see (another container of the same tenant) are counted in `used`
// but not listed: there is no PID to show for them here.
unsigned own_processes(int gpu, OwnProcess* rows) {
  const TenantState& tenant = tenant_of(gpu);
  const ledger::TenantLedger& ledger = tenant.ledger;
  const uint32_t high = std::min(ledger.usage->slot_high_water.load(std::memory_order_acquire), ledger::kMaxSlots);
  unsigned n = 0;
  for (uint32_t s = 0; s < high; ++s) {
    if (ledger.usage->slots[s].state.load(std::memory_order_acquire) != ledger::kSlotLive) continue;
    const uint64_t bytes = ledger.usage->charges[entry_of(gpu)][s].load(std::memory_order_relaxed);
    if (bytes == 0) continue;
    const int32_t pid = local_pid_of_slot(tenant, s);
    if (pid > 0) rows[n++] = {static_cast<unsigned>(pid), bytes};
  }
  return n;
}

// What every hook starts with: its real function and whose view applies.
template <NvmlHookId id>
struct Query {
  typename NvmlHookTraits<id>::Fn real = nullptr;
  Scope scope = Scope::kRefused;
  int gpu = kNotGranted;
  nvmlReturn_t error = NVML_SUCCESS;  // the answer when kRefused
};

template <NvmlHookId id>
Query<id> query(nvmlDevice_t device) {
  Query<id> q;
  q.real = nvml_real<id>();
  if (q.real == nullptr) q.error = no_real_function();
  else q.scope = scope_of(device, &q.gpu, &q.error);
  return q;
}

}  // namespace

int nvml_gpu_order(uint8_t (*out)[16], int capacity) {
  if (!load_real_table(g_nvml_table, /*optional=*/true)) return -1;
  const auto count = nvml_real<NvmlHookId::nvmlDeviceGetCount_v2>();
  const auto by_index = nvml_real<NvmlHookId::nvmlDeviceGetHandleByIndex_v2>();
  if (g_nvml.init == nullptr || g_nvml.shutdown == nullptr || count == nullptr || by_index == nullptr) return -1;
  if (g_nvml.init() != NVML_SUCCESS) return -1;
  unsigned n = 0;
  int kept = 0;
  if (count(&n) == NVML_SUCCESS) {
    for (unsigned i = 0; i < n && kept < capacity; ++i) {
      nvmlDevice_t device = nullptr;
      if (by_index(i, &device) == NVML_SUCCESS && device_uuid(device, out[kept])) ++kept;
    }
  }
  g_nvml.shutdown();
  return kept;
}

// The count and the index lookups (both versions): the tenant's devices
// only. Not a tenant's process (no tenant, or refused): NVML's answers.
template <NvmlHookId id>
nvmlReturn_t nvml_device_count(unsigned int* count) {
  const auto real = nvml_real<id>();
  if (real == nullptr) return no_real_function();
  if (count == nullptr || tenant_mode() != TenantMode::kManaged) return real(count);
  unsigned n = 0;
  const nvmlReturn_t result = walk_tenant_devices(enumeration<id>(), [&](nvmlDevice_t, unsigned) {
    ++n;
    return false;
  });
  if (result == NVML_SUCCESS) *count = n;
  return result;
}

template <NvmlHookId id>
nvmlReturn_t nvml_handle_by_index(unsigned int index, nvmlDevice_t* device) {
  const auto real = nvml_real<id>();
  if (real == nullptr) return no_real_function();
  if (device == nullptr || tenant_mode() != TenantMode::kManaged) return real(index, device);
  nvmlDevice_t found = nullptr;
  const nvmlReturn_t result = walk_tenant_devices(enumeration<id>(), [&](nvmlDevice_t d, unsigned k) {
    if (k == index) found = d;
    return k == index;
  });
  if (result != NVML_SUCCESS) return result;
  if (found == nullptr) return NVML_ERROR_INVALID_ARGUMENT;  // NVML's answer for an index past the count
  *device = found;
  return NVML_SUCCESS;
}

// By UUID, PCI bus ID, serial number: a GPU that is not the tenant's is not found.
template <NvmlHookId id>
nvmlReturn_t nvml_handle_lookup(const char* key, nvmlDevice_t* device) {
  const auto real = nvml_real<id>();
  if (real == nullptr) return no_real_function();
  const nvmlReturn_t result = real(key, device);
  if (result != NVML_SUCCESS || tenant_mode() != TenantMode::kManaged || tenant_sees(*device)) return result;
  *device = nullptr;
  return NVML_ERROR_NOT_FOUND;
}

namespace {

// A set of GPUs as NVML gives it (`ask(count, array)`: *count 0 asks how
// many; else up to *count handles), in a tenant's process only the tenant's
// GPUs: the whole set is read into a scratch array and filtered, so neither
// the count nor the caller's array tells of the others.
template <class Ask>
nvmlReturn_t tenant_device_set(unsigned int* count, nvmlDevice_t* devices, Ask ask) {
  constexpr unsigned kMaxDevices = 64;
  nvmlDevice_t all[kMaxDevices] = {};
  unsigned n = kMaxDevices;
  if (const nvmlReturn_t r = ask(&n, all); r != NVML_SUCCESS) return r;
  if (count == nullptr || (*count != 0 && devices == nullptr)) return NVML_ERROR_INVALID_ARGUMENT;
  unsigned kept = 0;
  for (unsigned i = 0; i < std::min(n, kMaxDevices); ++i) {
    if (!tenant_sees(all[i])) continue;
    if (*count != 0 && kept < *count) devices[kept] = all[i];
    ++kept;
  }
  *count = *count == 0 ? kept : std::min(kept, *count);
  return NVML_SUCCESS;
}

}  // namespace

template <NvmlHookId id>
nvmlReturn_t nvml_nearest_gpus(nvmlDevice_t device, nvmlGpuTopologyLevel_t level, unsigned int* count,
                               nvmlDevice_t* devices) {
  const auto real = nvml_real<id>();
  if (real == nullptr) return no_real_function();
  if (tenant_mode() != TenantMode::kManaged) return real(device, level, count, devices);
  if (!tenant_sees(device)) return NVML_ERROR_NOT_FOUND;  // no handle of another GPU is the tenant's to ask about
  return tenant_device_set(count, devices, [&](unsigned* n, nvmlDevice_t* all) { return real(device, level, n, all); });
}

template <NvmlHookId id>
nvmlReturn_t nvml_cpu_gpu_set(unsigned int cpu, unsigned int* count, nvmlDevice_t* devices) {
  const auto real = nvml_real<id>();
  if (real == nullptr) return no_real_function();
  if (tenant_mode() != TenantMode::kManaged) return real(cpu, count, devices);
  return tenant_device_set(count, devices, [&](unsigned* n, nvmlDevice_t* all) { return real(cpu, n, all); });
}

// A device's index among the tenant's devices (the index the count and the
// index lookup above number it by).
template <NvmlHookId id>
nvmlReturn_t nvml_device_index(nvmlDevice_t device, unsigned int* index) {
  const auto real = nvml_real<id>();
  if (real == nullptr) return no_real_function();
  const unsigned before = index != nullptr ? *index : 0;
  const nvmlReturn_t result = real(device, index);  // checks the handle and the pointer
  if (result != NVML_SUCCESS || tenant_mode() != TenantMode::kManaged) return result;
  *index = before;  // NVML's own index is not the tenant's to see
  bool found = false;
  const nvmlReturn_t walked = walk_tenant_devices(enumeration<id>(), [&](nvmlDevice_t d, unsigned k) {
    if (d == device) {
      *index = k;
      found = true;
    }
    return found;
  });
  if (walked != NVML_SUCCESS) return walked;
  return found ? NVML_SUCCESS : NVML_ERROR_NOT_FOUND;
}

template <NvmlHookId id, class Memory>
nvmlReturn_t nvml_memory_info(nvmlDevice_t device, Memory* memory) {
  const Query<id> q = query<id>(device);
  if (q.scope == Scope::kRefused) return q.error;
  // The real call checks the arguments (_v2's version field too) and gives
  // the device's real free memory, which caps the tenant's.
  const nvmlReturn_t result = q.real(device, memory);
  if (result != NVML_SUCCESS || q.scope == Scope::kReal) return result;
  uint64_t total = 0, free = 0, used = 0;
  if (!tenant_memory(q.gpu, memory->free, memory->total, &total, &free, &used)) return result;
  memory->total = total;
  memory->free = free;
  memory->used = used;
  // The driver's own reservation is not the tenant's to see; fracgpu's
  // context charges are already inside `used`.
  if constexpr (requires { memory->reserved; }) memory->reserved = 0;
  return NVML_SUCCESS;
}

namespace {

// Fills a process list with the tenant's own rows on GPU entry `gpu` (none
// when !list_own or the GPU is not granted). NVML's contract: *count in =
// capacity, out = rows; a short array gets NVML_ERROR_INSUFFICIENT_SIZE with
// the count needed.
template <class Info>
nvmlReturn_t tenant_rows(int gpu, bool list_own, unsigned int* count, Info* infos) {
  if (count == nullptr) return NVML_ERROR_INVALID_ARGUMENT;
  OwnProcess rows[ledger::kMaxSlots];
  const unsigned n = list_own && gpu >= 0 ? own_processes(gpu, rows) : 0;
  const unsigned capacity = *count;
  *count = n;
  if (n > capacity) return NVML_ERROR_INSUFFICIENT_SIZE;
  if (n > 0 && infos == nullptr) return NVML_ERROR_INVALID_ARGUMENT;
  for (unsigned i = 0; i < n; ++i) {
    Info info{};  // zero: nvmlProcessDetail_v1_t's usedGpuCcProtectedMemory too
    info.pid = rows[i].pid;
    info.usedGpuMemory = rows[i].bytes;
    if constexpr (requires { info.gpuInstanceId; }) {
      info.gpuInstanceId = 0xFFFFFFFFu;  // not a MIG instance, as NVML reports it
      info.computeInstanceId = 0xFFFFFFFFu;
    }
    infos[i] = info;
  }
  return NVML_SUCCESS;
}

// NVML keys per-process samples and accounting records by host PID. Inside
// a container nothing the tenant can read maps its processes to host PIDs,
// so the daemon, which sees them, writes each live slot's host PID into the
// ledger (ProcessSlot::host_pid, checked against the slot's start time).
// A record is the tenant's only if its PID is one of those; it is shown with
// the PID this namespace knows the process by, like the process lists. No
// host PIDs recorded (daemon down, a process that attached a moment ago): no
// records, never another tenant's.
struct PidPair {
  unsigned host;
  unsigned local;
};

unsigned own_host_pids(int gpu, PidPair* pairs) {
  const TenantState& tenant = tenant_of(gpu);
  const ledger::TenantLedger& ledger = tenant.ledger;
  const uint32_t high = std::min(ledger.usage->slot_high_water.load(std::memory_order_acquire), ledger::kMaxSlots);
  unsigned n = 0;
  for (uint32_t s = 0; s < high; ++s) {
    const ledger::ProcessSlot& slot = ledger.usage->slots[s];
    if (slot.state.load(std::memory_order_acquire) != ledger::kSlotLive) continue;
    const int32_t host = slot.host_pid.load(std::memory_order_relaxed);
    const int32_t local = local_pid_of_slot(tenant, s);
    if (host > 0 && local > 0) pairs[n++] = {static_cast<unsigned>(host), static_cast<unsigned>(local)};
  }
  return n;
}

// Keeps those of records[0, n) whose PID (pid_of(record), a host PID) is one
// of the tenant's processes, renumbered to this namespace's PIDs, in order;
// returns how many.
template <class Record, class PidOf>
unsigned keep_own(int gpu, Record* records, unsigned n, PidOf pid_of) {
  PidPair pairs[ledger::kMaxSlots];
  const unsigned own = own_host_pids(gpu, pairs);
  unsigned kept = 0;
  for (unsigned i = 0; i < n; ++i) {
    const PidPair* match = std::find_if(pairs, pairs + own, [&](const PidPair& p) { return p.host == pid_of(records[i]); });
    if (match == pairs + own) continue;
    records[kept] = records[i];
    pid_of(records[kept]) = match->local;
    ++kept;
  }
  // The others' records were written into the caller's array too: past the
  // count it returns is still the caller's memory to read.
  for (unsigned i = kept; i < n; ++i) records[i] = Record{};
  return kept;
}

// A sample list after keep_own: NVML_ERROR_NOT_FOUND is NVML's own answer
// for "no samples" (an idle GPU gives it too), which its callers handle.
nvmlReturn_t own_samples(nvmlReturn_t real_result, int gpu, unsigned int* count,
                         nvmlProcessUtilizationSample_t* samples) {
  if (real_result != NVML_SUCCESS) return real_result;  // sizes: the real count is an upper bound
  *count = gpu >= 0 ? keep_own(gpu, samples, *count, [](auto& r) -> unsigned& { return r.pid; }) : 0;
  return *count > 0 ? NVML_SUCCESS : NVML_ERROR_NOT_FOUND;
}

}  // namespace

template <NvmlHookId id, class Info>
nvmlReturn_t nvml_processes(nvmlDevice_t device, unsigned int* count, Info* infos, bool list_own) {
  const Query<id> q = query<id>(device);
  if (q.scope == Scope::kRefused) return q.error;
  if (q.scope == Scope::kReal) return q.real(device, count, infos);
  return tenant_rows(q.gpu, list_own, count, infos);
}

template <NvmlHookId id, class Info>
nvmlReturn_t nvml_own_processes(nvmlDevice_t device, unsigned int* count, Info* infos) {
  return nvml_processes<id>(device, count, infos, true);
}

template <NvmlHookId id, class Info>
nvmlReturn_t nvml_no_processes(nvmlDevice_t device, unsigned int* count, Info* infos) {
  return nvml_processes<id>(device, count, infos, false);
}

// One call for the compute, graphics and MPS lists (plist->mode); the same
// answers as the older calls give for each kind.
template <NvmlHookId id>
nvmlReturn_t nvml_process_detail_list(nvmlDevice_t device, nvmlProcessDetailList_t* plist) {
  const Query<id> q = query<id>(device);
  if (q.scope == Scope::kRefused) return q.error;
  if (q.scope == Scope::kReal) return q.real(device, plist);
  if (plist == nullptr) return NVML_ERROR_INVALID_ARGUMENT;
  if (plist->version != nvmlProcessDetailList_v1) return NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
  if (plist->mode > NVML_PROCESS_MODE_MPS) return NVML_ERROR_INVALID_ARGUMENT;
  return tenant_rows(q.gpu, plist->mode == NVML_PROCESS_MODE_COMPUTE, &plist->numProcArrayEntries, plist->procArray);
}

template <NvmlHookId id>
nvmlReturn_t nvml_process_utilization(nvmlDevice_t device, nvmlProcessUtilizationSample_t* utilization,
                                      unsigned int* count, unsigned long long last_seen) {
  const Query<id> q = query<id>(device);
  if (q.scope == Scope::kRefused) return q.error;
  const nvmlReturn_t result = q.real(device, utilization, count, last_seen);
  if (q.scope == Scope::kReal) return result;
  return own_samples(result, q.gpu, count, utilization);
}

template <NvmlHookId id>
nvmlReturn_t nvml_processes_utilization_info(nvmlDevice_t device, nvmlProcessesUtilizationInfo_t* info) {
  const Query<id> q = query<id>(device);
  if (q.scope == Scope::kRefused) return q.error;
  const nvmlReturn_t result = q.real(device, info);
  if (q.scope == Scope::kReal || result != NVML_SUCCESS) return result;
  unsigned& count = info->processSamplesCount;
  count = q.gpu >= 0 ? keep_own(q.gpu, info->procUtilArray, count, [](auto& r) -> unsigned& { return r.pid; }) : 0;
  return count > 0 ? NVML_SUCCESS : NVML_ERROR_NOT_FOUND;
}

namespace {

// The tenant's GPU time on GPU entry `gpu` over the last second (ppm of the
// device's time), from the arbiter the daemon links into the tenant
// directory; false where none answers: no arbiter (the daemon does not
// schedule this GPU's time), one refused, no row for the tenant, or a daemon
// that stopped (its figure would be stale). Opened per call: NVML callers
// ask about once a second, and a process that only reads NVML (nvidia-smi)
// has no launch gate with the arbiter mapped.
bool tenant_gpu_time_ppm(int gpu, uint32_t* ppm) {
  const TenantState& tenant = tenant_of(gpu);
  char path[1100];
  snprintf(path, sizeof path, "%s/gputime-%u", tenant.dir, entry_of(gpu));
  const ledger::GpuEntry policy = gpu_policy(gpu);
  gputime::Arbiter arbiter;
  char err[256];
  if (gputime::open_arbiter(path, false, true, policy.uuid, &arbiter, err, sizeof err) != ledger::LedgerError::kOk)
    return false;
  const int row = gputime::find_tenant(*arbiter.seg, tenant.ledger.policy->tenant);
  const bool fresh = row >= 0 && gputime::daemon_alive(*arbiter.seg, gputime::monotonic_ns());
  if (fresh) *ppm = std::min(arbiter.seg->tenants[row].achieved_1s_ppm.load(std::memory_order_relaxed), gputime::kPpm);
  gputime::close_arbiter(&arbiter);
  return fresh;
}

}  // namespace

// What nvidia-smi shows as GPU-Util: the tenant's part of the GPU, in whole
// percent of the device's time (a 0.5 tenant using all of its share reads
// 50 %), never its neighbours' work. The memory figure (time the device's
// memory was read or written) has no per-tenant measure: the device's,
// scaled by the tenant's part of the device's busy time.
template <NvmlHookId id>
nvmlReturn_t nvml_utilization_rates(nvmlDevice_t device, nvmlUtilization_t* utilization) {
  const Query<id> q = query<id>(device);
  if (q.scope == Scope::kRefused) return q.error;
  const nvmlReturn_t result = q.real(device, utilization);
  if (q.scope == Scope::kReal || result != NVML_SUCCESS) return result;
  uint32_t ppm = 0;
  if (q.gpu >= 0 && !tenant_gpu_time_ppm(q.gpu, &ppm)) {
    FRACGPU_LOG_ONCE(LogLevel::kInfo,
                     "nvmlDeviceGetUtilizationRates: fracgpud publishes no GPU time for this tenant (no arbiter, "
                     "or the daemon is down): not supported, rather than the whole device's figure");
    *utilization = nvmlUtilization_t{};  // the real call wrote the device's figures there
    return NVML_ERROR_NOT_SUPPORTED;
  }
  const uint64_t device_gpu = std::min(utilization->gpu, 100u);
  const uint64_t device_memory = std::min(utilization->memory, 100u);
  const uint64_t tenant_gpu = (uint64_t{ppm} * 100 + gputime::kPpm / 2) / gputime::kPpm;
  utilization->gpu = static_cast<unsigned>(tenant_gpu);
  // Scaled in ppm, not whole percent: a tenant at 0.4 % of a busy device
  // still shows its share of the memory traffic.
  utilization->memory =
      device_gpu == 0 ? 0
                      : static_cast<unsigned>(std::min<uint64_t>(device_memory, (device_memory * ppm + device_gpu * 5'000) /
                                                                                    (device_gpu * 10'000)));
  return NVML_SUCCESS;
}

// The device's rings of GPU and memory utilization: every tenant's work, so
// none of it is shown inside a tenant (NVML's "no samples", which callers
// handle). The other rings (power, clocks, encoder...) are NVML's own.
template <NvmlHookId id>
nvmlReturn_t nvml_samples(nvmlDevice_t device, nvmlSamplingType_t type, unsigned long long last_seen,
                          nvmlValueType_t* value_type, unsigned int* count, nvmlSample_t* samples) {
  const Query<id> q = query<id>(device);
  if (q.scope == Scope::kRefused) return q.error;
  const unsigned capacity = count != nullptr ? *count : 0;
  const nvmlReturn_t result = q.real(device, type, last_seen, value_type, count, samples);
  const bool device_busy = type == NVML_GPU_UTILIZATION_SAMPLES || type == NVML_MEMORY_UTILIZATION_SAMPLES;
  // A size query (no array) keeps NVML's answer: the ring's depth.
  if (q.scope == Scope::kReal || !device_busy || samples == nullptr) return result;
  if (result != NVML_SUCCESS && result != NVML_ERROR_INSUFFICIENT_SIZE) return result;
  // Nothing shown, nothing left: the real call filled the caller's array
  // (as many entries as it says, up to the array's size).
  for (unsigned i = 0; i < std::min(capacity, *count); ++i) samples[i] = nvmlSample_t{};
  *count = 0;
  return NVML_ERROR_NOT_FOUND;
}

// Accounting records (what `nvidia-smi --query-accounted-apps` reads while
// accounting mode is on): the tenant's own, by the PIDs of this namespace.
template <NvmlHookId id>
nvmlReturn_t nvml_accounting_pids(nvmlDevice_t device, unsigned int* count, unsigned int* pids) {
  const Query<id> q = query<id>(device);
  if (q.scope == Scope::kRefused) return q.error;
  const nvmlReturn_t result = q.real(device, count, pids);
  if (q.scope == Scope::kReal || result != NVML_SUCCESS) return result;  // sizes: an upper bound
  *count = q.gpu >= 0 ? keep_own(q.gpu, pids, *count, [](unsigned& pid) -> unsigned& { return pid; }) : 0;
  return NVML_SUCCESS;
}

// `pid` is one this namespace knows (as the list above gives it).
template <NvmlHookId id>
nvmlReturn_t nvml_accounting_stats(nvmlDevice_t device, unsigned int pid, nvmlAccountingStats_t* stats) {
  const Query<id> q = query<id>(device);
  if (q.scope == Scope::kRefused) return q.error;
  if (q.scope == Scope::kReal) return q.real(device, pid, stats);
  PidPair pairs[ledger::kMaxSlots];
  const unsigned own = q.gpu >= 0 ? own_host_pids(q.gpu, pairs) : 0;
  const PidPair* match = std::find_if(pairs, pairs + own, [&](const PidPair& p) { return p.local == pid; });
  if (match == pairs + own) return NVML_ERROR_NOT_FOUND;  // NVML's answer for a PID it holds no record of
  return q.real(device, match->host, stats);
}

}  // namespace fracgpu::interpose

// The exported entry points; the definitions repeat NVML's declarations, so
// a signature that differs does not compile.
#define FRACGPU_NVML_HOOK(name, impl, params, args)                                  \
  extern "C" __attribute__((visibility("default"))) nvmlReturn_t name params {        \
    return ::fracgpu::interpose::impl<::fracgpu::interpose::NvmlHookId::name> args; \
  }
#include "nvml_hooks.def"
