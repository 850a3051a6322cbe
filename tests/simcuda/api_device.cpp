// Initialization, errors, cuGetProcAddress, devices and contexts.
#include <climits>
#include <cstdlib>
#include <cstdio>
#include <cstring>
#include <type_traits>

#include "sim_internal.h"

using namespace simcuda;

// ---------------------------------------------------------------------------
// The entry-point table (proc_table.def): checked against cudaTypedefs.h.
// ---------------------------------------------------------------------------

// Each row's exported function must have exactly the PFN type cudaTypedefs.h
// gives for (base, version, variant): a wrong version number or a variant with
// another ABI does not compile.
#define SIMCUDA_PROC(base, version, variant, exported)                                 \
  static_assert(std::is_same_v<decltype(&exported), PFN_##base##_v##version##variant>, \
                #exported " does not have the type PFN_" #base "_v" #version #variant);
#include "proc_table.def"
#undef SIMCUDA_PROC

namespace {

// Addresses of the definitions in this library. Linked with
// -Bsymbolic-functions, so an interposer exporting the same names (LD_PRELOAD)
// cannot substitute its own: cuGetProcAddress returns exactly what
// dlsym(libcuda handle, exported) returns.
void* const kFns[] = {
#define SIMCUDA_PROC(base, version, variant, exported) reinterpret_cast<void*>(&exported),
#include "proc_table.def"
#undef SIMCUDA_PROC
};

consteval bool exported_names_unique() {
  for (size_t i = 0; i < kProcRows; ++i)
    for (size_t j = i + 1; j < kProcRows; ++j)
      if (kProcTable[i].exported == kProcTable[j].exported) return false;
  return true;
}
static_assert(exported_names_unique(), "an exported symbol appears twice in proc_table.def");

CUresult get_proc_address(const char* symbol, void** pfn, int cuda_version, cuuint64_t flags,
                          CUdriverProcAddressQueryResult* status) {
  if (symbol == nullptr || pfn == nullptr) return CUDA_ERROR_INVALID_VALUE;
  constexpr cuuint64_t kKnown = CU_GET_PROC_ADDRESS_LEGACY_STREAM | CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM;
  if ((flags & ~kKnown) != 0 || flags == kKnown) return CUDA_ERROR_INVALID_VALUE;
  // CU_GET_PROC_ADDRESS_DEFAULT behaves as LEGACY_STREAM (a per-thread build
  // of cuda.h adds the PER_THREAD flag itself before calling us).
  bool want_ptds = (flags & CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM) != 0;
  bool known_name = false;
  int best = -1;
  // Per-thread rows first when asked for; a name without a per-thread
  // variant (or too old a version for it) falls back to the legacy rows.
  for (int pass = want_ptds ? 0 : 1; pass < 2 && best < 0; ++pass) {
    bool per_thread = pass == 0;
    for (size_t i = 0; i < kProcRows; ++i) {
      const ProcRow& r = kProcTable[i];
      if (r.per_thread != per_thread || r.base != symbol) continue;
      known_name = true;
      if (r.version <= cuda_version && (best < 0 || r.version > kProcTable[best].version)) best = static_cast<int>(i);
    }
  }
  if (best < 0) {
    *pfn = nullptr;
    if (status != nullptr)
      *status = known_name ? CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT : CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
    return CUDA_ERROR_NOT_FOUND;
  }
  *pfn = kFns[best];
  if (status != nullptr) *status = CU_GET_PROC_ADDRESS_SUCCESS;
  return CUDA_SUCCESS;
}

// ---------------------------------------------------------------------------
// Error names
// ---------------------------------------------------------------------------

struct ErrorInfo {
  CUresult code;
  const char* name;
  const char* text;
};

#define SIMCUDA_ERR(code, text) {code, #code, text}
constexpr ErrorInfo kErrors[] = {
    SIMCUDA_ERR(CUDA_SUCCESS, "no error"),
    SIMCUDA_ERR(CUDA_ERROR_INVALID_VALUE, "invalid argument"),
    SIMCUDA_ERR(CUDA_ERROR_OUT_OF_MEMORY, "out of memory"),
    SIMCUDA_ERR(CUDA_ERROR_NOT_INITIALIZED, "initialization error"),
    SIMCUDA_ERR(CUDA_ERROR_DEINITIALIZED, "driver shutting down"),
    SIMCUDA_ERR(CUDA_ERROR_NO_DEVICE, "no CUDA-capable device is detected"),
    SIMCUDA_ERR(CUDA_ERROR_INVALID_DEVICE, "invalid device ordinal"),
    SIMCUDA_ERR(CUDA_ERROR_INVALID_IMAGE, "device kernel image is invalid"),
    SIMCUDA_ERR(CUDA_ERROR_INVALID_CONTEXT, "invalid device context"),
    SIMCUDA_ERR(CUDA_ERROR_CONTEXT_ALREADY_CURRENT, "context already current"),
    SIMCUDA_ERR(CUDA_ERROR_UNSUPPORTED_EXEC_AFFINITY, "the provided execution affinity is not supported"),
    SIMCUDA_ERR(CUDA_ERROR_FILE_NOT_FOUND, "file not found"),
    SIMCUDA_ERR(CUDA_ERROR_OPERATING_SYSTEM, "OS call failed or operation not supported on this OS"),
    SIMCUDA_ERR(CUDA_ERROR_INVALID_HANDLE, "invalid resource handle"),
    SIMCUDA_ERR(CUDA_ERROR_ILLEGAL_STATE, "the operation cannot be performed in the present state"),
    SIMCUDA_ERR(CUDA_ERROR_NOT_FOUND, "named symbol not found"),
    SIMCUDA_ERR(CUDA_ERROR_NOT_READY, "device not ready"),
    SIMCUDA_ERR(CUDA_ERROR_ILLEGAL_ADDRESS, "an illegal memory access was encountered"),
    SIMCUDA_ERR(CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES, "too many resources requested for launch"),
    SIMCUDA_ERR(CUDA_ERROR_LAUNCH_FAILED, "unspecified launch failure"),
    SIMCUDA_ERR(CUDA_ERROR_PRIMARY_CONTEXT_ACTIVE, "primary context active"),
    SIMCUDA_ERR(CUDA_ERROR_CONTEXT_IS_DESTROYED, "context is destroyed"),
    SIMCUDA_ERR(CUDA_ERROR_NOT_PERMITTED, "operation not permitted"),
    SIMCUDA_ERR(CUDA_ERROR_NOT_SUPPORTED, "operation not supported"),
    SIMCUDA_ERR(CUDA_ERROR_INVALID_RESOURCE_TYPE, "invalid resource type"),
    SIMCUDA_ERR(CUDA_ERROR_UNKNOWN, "unknown error"),
};
#undef SIMCUDA_ERR

const ErrorInfo* find_error(CUresult e) {
  for (const auto& info : kErrors)
    if (info.code == e) return &info;
  return nullptr;
}

// ---------------------------------------------------------------------------
// Context helpers
// ---------------------------------------------------------------------------

// CU_CTX_SCHED_* is a 3-bit field with one bit set at most; higher flags up to 0xFF.
bool valid_ctx_flags(unsigned flags) {
  if (flags > CU_CTX_FLAGS_MASK) return false;
  unsigned sched = flags & CU_CTX_SCHED_MASK;
  return sched == 0 || sched == CU_CTX_SCHED_SPIN || sched == CU_CTX_SCHED_YIELD ||
         sched == CU_CTX_SCHED_BLOCKING_SYNC;
}

// A new, active, non-primary context record on `dev` (regular or green).
// SIMCUDA_REUSE_CONTEXTS=1: a destroyed context's handle (regular or green)
// is handed to the next new context (whatever its device), as a driver that
// recycles its context records may do; by default handles stay unique, so
// that using a destroyed one reports CUDA_ERROR_CONTEXT_IS_DESTROYED.
Ctx* new_context_record(CUdevice dev) {
  Process& P = proc();
  static const bool reuse = [] {
    const char* v = std::getenv("SIMCUDA_REUSE_CONTEXTS");
    return v != nullptr && std::strcmp(v, "1") == 0;
  }();
  Ctx* raw = nullptr;
  if (reuse)
    for (auto& old : P.contexts)
      if (!old->primary && !old->active) raw = old.get();
  if (raw == nullptr) {
    P.contexts.push_back(std::make_unique<Ctx>());
    raw = P.contexts.back().get();
  }
  *raw = Ctx{};
  raw->dev = dev;
  raw->active = true;
  P.ctx_set.insert(raw);
  return raw;
}

CUresult ctx_create(CUcontext* pctx, unsigned flags, CUdevice dev) {
  if (pctx == nullptr) return CUDA_ERROR_INVALID_VALUE;
  if (!take_ordinal(dev)) return CUDA_ERROR_INVALID_DEVICE;
  if (!valid_ctx_flags(flags)) return CUDA_ERROR_INVALID_VALUE;
  if (CUresult r = charge(dev, S()->devices[dev].ctx_bytes)) return r;
  Ctx* raw = new_context_record(dev);
  raw->flags = flags;
  ctx_stack().push_back(raw);  // a new context becomes current
  *pctx = reinterpret_cast<CUcontext>(raw);
  return CUDA_SUCCESS;
}

CUresult check_affinity(const CUexecAffinityParam* params, int n, CUdevice dev) {
  if (n < 0 || (n > 0 && params == nullptr)) return CUDA_ERROR_INVALID_VALUE;
  for (int i = 0; i < n; ++i) {
    if (params[i].type != CU_EXEC_AFFINITY_TYPE_SM_COUNT) return CUDA_ERROR_UNSUPPORTED_EXEC_AFFINITY;
    int d = dev;
    if (take_ordinal(d) && params[i].param.smCount.val > S()->devices[d].sms)
      return CUDA_ERROR_UNSUPPORTED_EXEC_AFFINITY;
  }
  return CUDA_SUCCESS;
}

Ctx* primary_of(int dev) {
  Process& P = proc();
  if (P.dev[dev].primary == nullptr) {
    auto c = std::make_unique<Ctx>();
    c->dev = dev;
    c->primary = true;
    Ctx* raw = c.get();
    P.contexts.push_back(std::move(c));
    P.ctx_set.insert(raw);
    P.dev[dev].primary = raw;
  }
  return P.dev[dev].primary;
}

CUresult ctx_destroy(CUcontext h) {
  Process& P = proc();
  if (h == nullptr || P.ctx_set.count(key(h)) == 0) return CUDA_ERROR_INVALID_CONTEXT;
  Ctx* c = reinterpret_cast<Ctx*>(h);
  if (c->primary || c->green || !c->active) return CUDA_ERROR_INVALID_CONTEXT;
  teardown_ctx(c);
  auto& st = ctx_stack();
  if (!st.empty() && st.back() == c) st.pop_back();
  return CUDA_SUCCESS;
}

CUresult push_current(CUcontext h) {
  Process& P = proc();
  if (h == nullptr) return CUDA_ERROR_INVALID_VALUE;
  if (P.ctx_set.count(key(h)) == 0) return CUDA_ERROR_INVALID_CONTEXT;
  Ctx* c = reinterpret_cast<Ctx*>(h);
  if (!c->primary && !c->active) return CUDA_ERROR_CONTEXT_IS_DESTROYED;
  ctx_stack().push_back(c);
  return CUDA_SUCCESS;
}

CUresult pop_current(CUcontext* out) {
  auto& st = ctx_stack();
  if (st.empty()) return CUDA_ERROR_INVALID_CONTEXT;
  Ctx* c = st.back();
  st.pop_back();
  if (out != nullptr) *out = reinterpret_cast<CUcontext>(c);
  return CUDA_SUCCESS;
}

CUresult ctx_synchronize(Guard& guard, Ctx* c) {
  int dev = c->dev;
  const Mark until = proc().dev[dev].proc_tail.load();
  guard.unlock();  // never sleep holding the process lock
  wait_mark(dev, until);
  guard.lock();
  pools_release_at_sync(dev);
  return CUDA_SUCCESS;
}

CUresult primary_release(CUdevice dev) {
  if (!take_ordinal(dev)) return CUDA_ERROR_INVALID_DEVICE;
  Ctx* c = primary_of(dev);
  if (c->refcount == 0) return CUDA_ERROR_INVALID_CONTEXT;
  if (--c->refcount == 0) teardown_ctx(c);  // the last release destroys it
  return CUDA_SUCCESS;
}

CUresult primary_reset(CUdevice dev) {
  if (!take_ordinal(dev)) return CUDA_ERROR_INVALID_DEVICE;
  Ctx* c = primary_of(dev);
  if (c->active) teardown_ctx(c);
  c->refcount = 0;
  c->flags = 0;
  return CUDA_SUCCESS;
}

CUresult primary_set_flags(CUdevice dev, unsigned flags, bool reject_if_active) {
  if (!take_ordinal(dev)) return CUDA_ERROR_INVALID_DEVICE;
  if (!valid_ctx_flags(flags)) return CUDA_ERROR_INVALID_VALUE;
  Ctx* c = primary_of(dev);
  if (reject_if_active && c->active) return CUDA_ERROR_PRIMARY_CONTEXT_ACTIVE;  // pre-11.0 behaviour
  c->flags = flags;
  return CUDA_SUCCESS;
}

// ---------------------------------------------------------------------------
// Green contexts
// ---------------------------------------------------------------------------

GreenCtx* find_green(CUgreenCtx h) {
  return proc().green_set.count(key(h)) != 0 ? reinterpret_cast<GreenCtx*>(h) : nullptr;
}

// Destroying a green context: its CUcontext is the device's primary context
// with the green context's SMs (cuda.h), so what was allocated or loaded in
// it stays, now the primary context's (freed by cuMemFree etc. or the
// primary context's teardown); its streams go. No footprint to give back.
void green_teardown(GreenCtx* g) {
  Process& P = proc();
  Ctx* c = g->ctx;
  Ctx* primary = primary_of(c->dev);
  for (auto& [ptr, alloc] : P.allocs)
    if (alloc.ctx == c) alloc.ctx = primary;
  for (auto* table : {&P.arrays, &P.mipmaps})
    for (auto& [h, array] : *table)
      if (array->ctx == c) array->ctx = primary;
  for (auto& [h, module] : P.modules)
    if (module->ctx == c) module->ctx = primary;
  for (auto it = P.streams.begin(); it != P.streams.end();) {
    if (it->second->ctx == c) it = P.streams.erase(it);
    else ++it;
  }
  c->active = false;
  g->active = false;
  auto& st = ctx_stack();
  if (!st.empty() && st.back() == c) st.pop_back();
}

}  // namespace

namespace simcuda {

// Destroying a context frees what lives in it, as the real driver does:
// linear/pitch/managed allocations, arrays, modules, streams; and its
// footprint. Pool blocks, pools and VMM allocations are device-level and stay.
void teardown_ctx(Ctx* c) {
  Process& P = proc();
  uint64_t freed[kMaxDevices] = {};
  for (auto it = P.allocs.begin(); it != P.allocs.end();) {
    if (it->second.ctx == c && it->second.kind != AllocKind::PoolBlock) {
      freed[it->second.dev] += it->second.charged;
      it = P.allocs.erase(it);
    } else {
      ++it;
    }
  }
  for (auto* table : {&P.arrays, &P.mipmaps}) {
    for (auto it = table->begin(); it != table->end();) {
      if (it->second->ctx == c) {
        freed[it->second->dev] += it->second->charged;
        it = table->erase(it);
      } else {
        ++it;
      }
    }
  }
  for (auto it = P.modules.begin(); it != P.modules.end();) {
    if (it->second->ctx == c) {
      for (auto& [name, fn] : it->second->functions) P.functions.erase(key(fn.get()));
      it = P.modules.erase(it);
    } else {
      ++it;
    }
  }
  for (auto it = P.streams.begin(); it != P.streams.end();) {
    if (it->second->ctx == c) it = P.streams.erase(it);
    else ++it;
  }
  if (c->active && !c->green) freed[c->dev] += S()->devices[c->dev].ctx_bytes;
  c->active = false;
  for (int d = 0; d < kMaxDevices; ++d) uncharge(d, freed[d]);
}

}  // namespace simcuda

extern "C" {

// ---------------------------------------------------------------------------
// Initialization, version, errors, lookup
// ---------------------------------------------------------------------------

CUresult cuInit(unsigned int flags) {
  SIMCUDA_ENTRY(cuInit);
  Guard guard;
  if (flags != 0) return CUDA_ERROR_INVALID_VALUE;
  return initialize();
}

CUresult cuDriverGetVersion(int* version) {
  SIMCUDA_ENTRY(cuDriverGetVersion);
  if (version == nullptr) return CUDA_ERROR_INVALID_VALUE;
  *version = kDriverVersion;
  return CUDA_SUCCESS;
}

CUresult cuGetErrorName(CUresult error, const char** str) {
  SIMCUDA_ENTRY(cuGetErrorName);
  if (str == nullptr) return CUDA_ERROR_INVALID_VALUE;
  const ErrorInfo* e = find_error(error);
  *str = e != nullptr ? e->name : nullptr;
  return e != nullptr ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

CUresult cuGetErrorString(CUresult error, const char** str) {
  SIMCUDA_ENTRY(cuGetErrorString);
  if (str == nullptr) return CUDA_ERROR_INVALID_VALUE;
  const ErrorInfo* e = find_error(error);
  *str = e != nullptr ? e->text : nullptr;
  return e != nullptr ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

// Exists so that pass-through of this undocumented entry point can be
// tested; it hands out no table (count calls with simcuda_call_count).
CUresult cuGetExportTable(const void** table, const CUuuid* id) {
  SIMCUDA_ENTRY(cuGetExportTable);
  if (table == nullptr || id == nullptr) return CUDA_ERROR_INVALID_VALUE;
  *table = nullptr;
  return CUDA_ERROR_NOT_SUPPORTED;
}

CUresult cuGetProcAddress(const char* symbol, void** pfn, int cuda_version, cuuint64_t flags) {
  SIMCUDA_ENTRY(cuGetProcAddress);
  return get_proc_address(symbol, pfn, cuda_version, flags, nullptr);
}

CUresult cuGetProcAddress_v2(const char* symbol, void** pfn, int cuda_version, cuuint64_t flags,
                             CUdriverProcAddressQueryResult* status) {
  SIMCUDA_ENTRY(cuGetProcAddress_v2);
  return get_proc_address(symbol, pfn, cuda_version, flags, status);
}

// ---------------------------------------------------------------------------
// Devices
// ---------------------------------------------------------------------------

CUresult cuDeviceGet(CUdevice* device, int ordinal) {
  SIMCUDA_LOCKED_ENTRY(cuDeviceGet);
  if (device == nullptr) return CUDA_ERROR_INVALID_VALUE;
  if (ordinal < 0 || ordinal >= visible_count()) return CUDA_ERROR_INVALID_DEVICE;
  *device = ordinal;
  return CUDA_SUCCESS;
}

CUresult cuDeviceGetCount(int* count) {
  SIMCUDA_LOCKED_ENTRY(cuDeviceGetCount);
  if (count == nullptr) return CUDA_ERROR_INVALID_VALUE;
  *count = visible_count();
  return CUDA_SUCCESS;
}

CUresult cuDeviceGetName(char* name, int len, CUdevice dev) {
  SIMCUDA_LOCKED_ENTRY(cuDeviceGetName);
  if (name == nullptr || len <= 0) return CUDA_ERROR_INVALID_VALUE;
  if (!take_ordinal(dev)) return CUDA_ERROR_INVALID_DEVICE;
  std::snprintf(name, static_cast<size_t>(len), "%s", S()->devices[dev].name);
  return CUDA_SUCCESS;
}

CUresult cuDeviceGetUuid(CUuuid* uuid, CUdevice dev) {
  SIMCUDA_LOCKED_ENTRY(cuDeviceGetUuid);
  if (uuid == nullptr) return CUDA_ERROR_INVALID_VALUE;
  if (!take_ordinal(dev)) return CUDA_ERROR_INVALID_DEVICE;
  std::memcpy(uuid->bytes, S()->devices[dev].uuid, 16);
  return CUDA_SUCCESS;
}

CUresult cuDeviceGetUuid_v2(CUuuid* uuid, CUdevice dev) {
  SIMCUDA_LOCKED_ENTRY(cuDeviceGetUuid_v2);
  if (uuid == nullptr) return CUDA_ERROR_INVALID_VALUE;
  if (!take_ordinal(dev)) return CUDA_ERROR_INVALID_DEVICE;
  std::memcpy(uuid->bytes, S()->devices[dev].uuid, 16);
  return CUDA_SUCCESS;
}

CUresult cuDeviceTotalMem(unsigned int* bytes, CUdevice dev) {
  SIMCUDA_LOCKED_ENTRY(cuDeviceTotalMem);
  if (bytes == nullptr) return CUDA_ERROR_INVALID_VALUE;
  if (!take_ordinal(dev)) return CUDA_ERROR_INVALID_DEVICE;
  uint64_t cap = S()->devices[dev].capacity;
  *bytes = cap > UINT_MAX ? UINT_MAX : static_cast<unsigned int>(cap);  // the 32-bit ABI saturates
  return CUDA_SUCCESS;
}

CUresult cuDeviceTotalMem_v2(size_t* bytes, CUdevice dev) {
  SIMCUDA_LOCKED_ENTRY(cuDeviceTotalMem_v2);
  if (bytes == nullptr) return CUDA_ERROR_INVALID_VALUE;
  if (!take_ordinal(dev)) return CUDA_ERROR_INVALID_DEVICE;
  *bytes = S()->devices[dev].capacity;
  return CUDA_SUCCESS;
}

CUresult cuDeviceGetAttribute(int* value, CUdevice_attribute attrib, CUdevice dev) {
  SIMCUDA_LOCKED_ENTRY(cuDeviceGetAttribute);
  if (value == nullptr) return CUDA_ERROR_INVALID_VALUE;
  if (!take_ordinal(dev)) return CUDA_ERROR_INVALID_DEVICE;
  if (attrib <= 0 || attrib >= CU_DEVICE_ATTRIBUTE_MAX) return CUDA_ERROR_INVALID_VALUE;
  const SharedDevice& d = S()->devices[dev];
  int v = 0;  // everything not listed: 0 (unsupported / absent)
  switch (attrib) {
    case CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_BLOCK: v = 1024; break;
    case CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_X: v = 1024; break;
    case CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_Y: v = 1024; break;
    case CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_Z: v = 64; break;
    case CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_X: v = INT_MAX; break;
    case CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_Y: v = 65535; break;
    case CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_Z: v = 65535; break;
    case CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK: v = 49152; break;
    case CU_DEVICE_ATTRIBUTE_TOTAL_CONSTANT_MEMORY: v = 65536; break;
    case CU_DEVICE_ATTRIBUTE_WARP_SIZE: v = 32; break;
    case CU_DEVICE_ATTRIBUTE_MAX_PITCH: v = INT_MAX; break;
    case CU_DEVICE_ATTRIBUTE_MAX_REGISTERS_PER_BLOCK: v = 65536; break;
    case CU_DEVICE_ATTRIBUTE_CLOCK_RATE: v = 1980000; break;
    case CU_DEVICE_ATTRIBUTE_TEXTURE_ALIGNMENT: v = 512; break;
    case CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT: v = static_cast<int>(d.sms); break;
    case CU_DEVICE_ATTRIBUTE_CAN_MAP_HOST_MEMORY: v = 1; break;
    case CU_DEVICE_ATTRIBUTE_CONCURRENT_KERNELS: v = 1; break;
    case CU_DEVICE_ATTRIBUTE_PCI_BUS_ID: v = static_cast<int>(d.pci_bus); break;
    case CU_DEVICE_ATTRIBUTE_PCI_DEVICE_ID: v = 0; break;
    case CU_DEVICE_ATTRIBUTE_PCI_DOMAIN_ID: v = 0; break;
    case CU_DEVICE_ATTRIBUTE_MEMORY_CLOCK_RATE: v = 2619000; break;
    case CU_DEVICE_ATTRIBUTE_GLOBAL_MEMORY_BUS_WIDTH: v = 5120; break;
    case CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE: v = 50 * 1024 * 1024; break;
    case CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_MULTIPROCESSOR: v = 2048; break;
    case CU_DEVICE_ATTRIBUTE_ASYNC_ENGINE_COUNT: v = 3; break;
    case CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING: v = 1; break;
    case CU_DEVICE_ATTRIBUTE_TEXTURE_PITCH_ALIGNMENT: v = 512; break;
    case CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR: v = static_cast<int>(d.cc_major); break;
    case CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR: v = static_cast<int>(d.cc_minor); break;
    case CU_DEVICE_ATTRIBUTE_MANAGED_MEMORY: v = 1; break;
    case CU_DEVICE_ATTRIBUTE_CONCURRENT_MANAGED_ACCESS: v = 1; break;
    case CU_DEVICE_ATTRIBUTE_COOPERATIVE_LAUNCH: v = 1; break;
    case CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED: v = 1; break;
    case CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED: v = 1; break;
    default: break;
  }
  *value = v;
  return CUDA_SUCCESS;
}

CUresult cuDeviceGetPCIBusId(char* bus_id, int len, CUdevice dev) {
  SIMCUDA_LOCKED_ENTRY(cuDeviceGetPCIBusId);
  if (bus_id == nullptr || len <= 0) return CUDA_ERROR_INVALID_VALUE;
  if (!take_ordinal(dev)) return CUDA_ERROR_INVALID_DEVICE;
  std::snprintf(bus_id, static_cast<size_t>(len), "0000:%02x:00.0", S()->devices[dev].pci_bus);
  return CUDA_SUCCESS;
}

// Peer access is not simulated: no device can reach another's memory.
CUresult cuDeviceCanAccessPeer(int* can_access, CUdevice dev, CUdevice peer) {
  SIMCUDA_LOCKED_ENTRY(cuDeviceCanAccessPeer);
  if (can_access == nullptr) return CUDA_ERROR_INVALID_VALUE;
  if (!take_ordinal(dev) || !take_ordinal(peer)) return CUDA_ERROR_INVALID_DEVICE;
  *can_access = 0;
  return CUDA_SUCCESS;
}

// ---------------------------------------------------------------------------
// Primary contexts
// ---------------------------------------------------------------------------

CUresult cuDevicePrimaryCtxRetain(CUcontext* pctx, CUdevice dev) {
  SIMCUDA_LOCKED_ENTRY(cuDevicePrimaryCtxRetain);
  if (pctx == nullptr) return CUDA_ERROR_INVALID_VALUE;
  if (!take_ordinal(dev)) return CUDA_ERROR_INVALID_DEVICE;
  Ctx* c = primary_of(dev);
  if (c->refcount == 0) {  // (re)activation: the footprint is charged again
    if (CUresult r = charge(dev, S()->devices[dev].ctx_bytes)) return r;
    c->active = true;
  }
  ++c->refcount;
  *pctx = reinterpret_cast<CUcontext>(c);
  return CUDA_SUCCESS;
}

CUresult cuDevicePrimaryCtxRelease(CUdevice dev) {
  SIMCUDA_LOCKED_ENTRY(cuDevicePrimaryCtxRelease);
  return primary_release(dev);
}

CUresult cuDevicePrimaryCtxRelease_v2(CUdevice dev) {
  SIMCUDA_LOCKED_ENTRY(cuDevicePrimaryCtxRelease_v2);
  return primary_release(dev);
}

CUresult cuDevicePrimaryCtxReset(CUdevice dev) {
  SIMCUDA_LOCKED_ENTRY(cuDevicePrimaryCtxReset);
  return primary_reset(dev);
}

CUresult cuDevicePrimaryCtxReset_v2(CUdevice dev) {
  SIMCUDA_LOCKED_ENTRY(cuDevicePrimaryCtxReset_v2);
  return primary_reset(dev);
}

CUresult cuDevicePrimaryCtxSetFlags(CUdevice dev, unsigned int flags) {
  SIMCUDA_LOCKED_ENTRY(cuDevicePrimaryCtxSetFlags);
  return primary_set_flags(dev, flags, true);
}

CUresult cuDevicePrimaryCtxSetFlags_v2(CUdevice dev, unsigned int flags) {
  SIMCUDA_LOCKED_ENTRY(cuDevicePrimaryCtxSetFlags_v2);
  return primary_set_flags(dev, flags, false);
}

CUresult cuDevicePrimaryCtxGetState(CUdevice dev, unsigned int* flags, int* active) {
  SIMCUDA_LOCKED_ENTRY(cuDevicePrimaryCtxGetState);
  if (flags == nullptr || active == nullptr) return CUDA_ERROR_INVALID_VALUE;
  if (!take_ordinal(dev)) return CUDA_ERROR_INVALID_DEVICE;
  Ctx* c = primary_of(dev);
  *flags = c->flags;
  *active = c->active ? 1 : 0;
  return CUDA_SUCCESS;
}

// ---------------------------------------------------------------------------
// Contexts
// ---------------------------------------------------------------------------

CUresult cuCtxCreate(CUcontext* pctx, unsigned int flags, CUdevice dev) {
  SIMCUDA_LOCKED_ENTRY(cuCtxCreate);
  return ctx_create(pctx, flags, dev);
}

CUresult cuCtxCreate_v2(CUcontext* pctx, unsigned int flags, CUdevice dev) {
  SIMCUDA_LOCKED_ENTRY(cuCtxCreate_v2);
  return ctx_create(pctx, flags, dev);
}

CUresult cuCtxCreate_v3(CUcontext* pctx, CUexecAffinityParam* params, int num_params, unsigned int flags,
                        CUdevice dev) {
  SIMCUDA_LOCKED_ENTRY(cuCtxCreate_v3);
  if (CUresult r = check_affinity(params, num_params, dev)) return r;
  return ctx_create(pctx, flags, dev);
}

CUresult cuCtxCreate_v4(CUcontext* pctx, CUctxCreateParams* params, unsigned int flags, CUdevice dev) {
  SIMCUDA_LOCKED_ENTRY(cuCtxCreate_v4);
  if (params != nullptr) {
    if (params->execAffinityParams != nullptr && params->cigParams != nullptr) return CUDA_ERROR_INVALID_VALUE;
    if (params->cigParams != nullptr) return CUDA_ERROR_NOT_SUPPORTED;  // no graphics interop here
    if (CUresult r = check_affinity(params->execAffinityParams, params->numExecAffinityParams, dev)) return r;
  }
  return ctx_create(pctx, flags, dev);
}

CUresult cuCtxDestroy(CUcontext ctx) {
  SIMCUDA_LOCKED_ENTRY(cuCtxDestroy);
  return ctx_destroy(ctx);
}

CUresult cuCtxDestroy_v2(CUcontext ctx) {
  SIMCUDA_LOCKED_ENTRY(cuCtxDestroy_v2);
  return ctx_destroy(ctx);
}

// The deprecated usage count: cuCtxAttach raises it on the current context,
// cuCtxDetach lowers it and destroys the context at zero (cuCtxCreate counts
// as the first use). Both want a regular context current to the caller.
CUresult cuCtxAttach(CUcontext* pctx, unsigned int flags) {
  SIMCUDA_LOCKED_ENTRY(cuCtxAttach);
  if (pctx == nullptr || flags != 0) return CUDA_ERROR_INVALID_VALUE;
  Ctx* c = current_ctx();
  if (c == nullptr || c->primary || c->green || !c->active) return CUDA_ERROR_INVALID_CONTEXT;
  ++c->attaches;
  *pctx = reinterpret_cast<CUcontext>(c);
  return CUDA_SUCCESS;
}

CUresult cuCtxDetach(CUcontext ctx) {
  SIMCUDA_LOCKED_ENTRY(cuCtxDetach);
  if (ctx == nullptr || proc().ctx_set.count(key(ctx)) == 0) return CUDA_ERROR_INVALID_CONTEXT;
  Ctx* c = reinterpret_cast<Ctx*>(ctx);
  if (c != current_ctx()) return CUDA_ERROR_INVALID_CONTEXT;
  if (c->attaches > 0 && c->active && !c->primary && !c->green) {
    --c->attaches;
    return CUDA_SUCCESS;
  }
  return ctx_destroy(ctx);
}

CUresult cuCtxSetCurrent(CUcontext ctx) {
  SIMCUDA_LOCKED_ENTRY(cuCtxSetCurrent);
  auto& st = ctx_stack();
  if (ctx == nullptr) {  // unbind: the stack loses its top
    if (!st.empty()) st.pop_back();
    return CUDA_SUCCESS;
  }
  if (proc().ctx_set.count(key(ctx)) == 0) return CUDA_ERROR_INVALID_CONTEXT;
  Ctx* c = reinterpret_cast<Ctx*>(ctx);
  if (!c->primary && !c->active) return CUDA_ERROR_CONTEXT_IS_DESTROYED;
  if (st.empty()) st.push_back(c);
  else st.back() = c;
  return CUDA_SUCCESS;
}

CUresult cuCtxGetCurrent(CUcontext* pctx) {
  SIMCUDA_LOCKED_ENTRY(cuCtxGetCurrent);
  if (pctx == nullptr) return CUDA_ERROR_INVALID_VALUE;
  *pctx = reinterpret_cast<CUcontext>(current_ctx());
  return CUDA_SUCCESS;
}

CUresult cuCtxPushCurrent(CUcontext ctx) {
  SIMCUDA_LOCKED_ENTRY(cuCtxPushCurrent);
  return push_current(ctx);
}

CUresult cuCtxPushCurrent_v2(CUcontext ctx) {
  SIMCUDA_LOCKED_ENTRY(cuCtxPushCurrent_v2);
  return push_current(ctx);
}

CUresult cuCtxPopCurrent(CUcontext* pctx) {
  SIMCUDA_LOCKED_ENTRY(cuCtxPopCurrent);
  return pop_current(pctx);
}

CUresult cuCtxPopCurrent_v2(CUcontext* pctx) {
  SIMCUDA_LOCKED_ENTRY(cuCtxPopCurrent_v2);
  return pop_current(pctx);
}

CUresult cuCtxGetDevice(CUdevice* device) {
  SIMCUDA_LOCKED_ENTRY(cuCtxGetDevice);
  if (device == nullptr) return CUDA_ERROR_INVALID_VALUE;
  Ctx* c = nullptr;
  if (CUresult r = require_ctx(c)) return r;
  *device = ordinal_of(c->dev);
  return CUDA_SUCCESS;
}

CUresult cuCtxGetDevice_v2(CUdevice* device, CUcontext ctx) {
  SIMCUDA_LOCKED_ENTRY(cuCtxGetDevice_v2);
  if (device == nullptr) return CUDA_ERROR_INVALID_VALUE;
  Ctx* c = nullptr;
  if (CUresult r = resolve_ctx(ctx, c)) return r;
  *device = ordinal_of(c->dev);
  return CUDA_SUCCESS;
}

CUresult cuCtxSynchronize(void) {
  SIMCUDA_LOCKED_ENTRY(cuCtxSynchronize);
  Ctx* c = nullptr;
  if (CUresult r = require_ctx(c)) return r;
  return ctx_synchronize(guard_, c);
}

CUresult cuCtxSynchronize_v2(CUcontext ctx) {
  SIMCUDA_LOCKED_ENTRY(cuCtxSynchronize_v2);
  Ctx* c = nullptr;
  if (CUresult r = resolve_ctx(ctx, c)) return r;
  return ctx_synchronize(guard_, c);
}

// ---------------------------------------------------------------------------
// Green contexts (minimal: SM resources only, no splitting)
// ---------------------------------------------------------------------------

CUresult cuDeviceGetDevResource(CUdevice dev, CUdevResource* resource, CUdevResourceType type) {
  SIMCUDA_LOCKED_ENTRY(cuDeviceGetDevResource);
  if (resource == nullptr) return CUDA_ERROR_INVALID_VALUE;
  if (!take_ordinal(dev)) return CUDA_ERROR_INVALID_DEVICE;
  if (type != CU_DEV_RESOURCE_TYPE_SM) return CUDA_ERROR_INVALID_RESOURCE_TYPE;
  std::memset(resource, 0, sizeof(*resource));
  resource->type = CU_DEV_RESOURCE_TYPE_SM;
  resource->sm.smCount = S()->devices[dev].sms;
  resource->sm.minSmPartitionSize = 1;
  resource->sm.smCoscheduledAlignment = 1;
  return CUDA_SUCCESS;
}

CUresult cuDevResourceGenerateDesc(CUdevResourceDesc* desc, CUdevResource* resources, unsigned int count) {
  SIMCUDA_LOCKED_ENTRY(cuDevResourceGenerateDesc);
  if (desc == nullptr || resources == nullptr || count == 0) return CUDA_ERROR_INVALID_VALUE;
  unsigned sms = 0;
  for (unsigned i = 0; i < count; ++i) {
    if (resources[i].type != CU_DEV_RESOURCE_TYPE_SM) return CUDA_ERROR_INVALID_RESOURCE_TYPE;
    sms += resources[i].sm.smCount;
  }
  Process& P = proc();
  P.descs.push_back(std::make_unique<ResourceDesc>());
  P.descs.back()->sms = sms;
  P.desc_set.insert(P.descs.back().get());
  *desc = reinterpret_cast<CUdevResourceDesc>(P.descs.back().get());
  return CUDA_SUCCESS;
}

CUresult cuGreenCtxCreate(CUgreenCtx* phandle, CUdevResourceDesc desc, CUdevice dev, unsigned int flags) {
  SIMCUDA_LOCKED_ENTRY(cuGreenCtxCreate);
  Process& P = proc();
  if (phandle == nullptr || P.desc_set.count(key(desc)) == 0) return CUDA_ERROR_INVALID_VALUE;
  if (!take_ordinal(dev)) return CUDA_ERROR_INVALID_DEVICE;
  if (flags != CU_GREEN_CTX_DEFAULT_STREAM) return CUDA_ERROR_INVALID_VALUE;  // required, and the only flag
  const unsigned sms = reinterpret_cast<ResourceDesc*>(desc)->sms;
  if (sms == 0 || sms > S()->devices[dev].sms) return CUDA_ERROR_INVALID_VALUE;
  Ctx* c = new_context_record(dev);
  c->green = true;
  P.greens.push_back(std::make_unique<GreenCtx>());
  GreenCtx* g = P.greens.back().get();
  g->ctx = c;
  g->active = true;
  g->sms = sms;
  P.green_set.insert(g);
  *phandle = reinterpret_cast<CUgreenCtx>(g);  // not made current (cuda.h)
  return CUDA_SUCCESS;
}

CUresult cuCtxFromGreenCtx(CUcontext* pctx, CUgreenCtx handle) {
  SIMCUDA_LOCKED_ENTRY(cuCtxFromGreenCtx);
  if (pctx == nullptr) return CUDA_ERROR_INVALID_VALUE;
  GreenCtx* g = find_green(handle);
  if (g == nullptr || !g->active) return CUDA_ERROR_INVALID_CONTEXT;
  *pctx = reinterpret_cast<CUcontext>(g->ctx);
  return CUDA_SUCCESS;
}

CUresult cuGreenCtxDestroy(CUgreenCtx handle) {
  SIMCUDA_LOCKED_ENTRY(cuGreenCtxDestroy);
  GreenCtx* g = find_green(handle);
  if (g == nullptr) return CUDA_ERROR_INVALID_CONTEXT;
  if (!g->active) return CUDA_ERROR_CONTEXT_IS_DESTROYED;
  green_teardown(g);
  return CUDA_SUCCESS;
}

}  // extern "C"
