// How interception works
// ======================
//
//   application / CUDA runtime / framework
//        |  direct call   |  dlsym(h, "cuX")     |  cuGetProcAddress("cuX", ver, flags)
//        v                v                      v
//   +---------------------------------------------------------------+
//   | libfracgpu.so (LD_PRELOAD)                                    |
//   |  exports every hooked versioned name   (hooks.def)            |
//   |  dlsym():  real dlsym, then map a hooked real address to ours |
//   |  cuGetProcAddress*(): ask the real driver which variant it    |
//   |     returns for (name, ver, flags), map that address to ours  |
//   +---------------------------------------------------------------+
//        |  g_real[id]: typed pointers from dlsym(libcuda handle)
//        v
//   libcuda.so.1 (the real driver, or the tests' simulated one)
//
// 1. Linked calls bind to our exports because a preloaded object comes first
//    in symbol lookup.
// 2. dlsym(handle, name) with a libcuda handle would bypass symbol lookup,
//    so we export dlsym too: we call glibc's, and if the address it returns
//    is the real function of a hooked symbol, we return our hook instead.
// 3. cuGetProcAddress is how the CUDA runtime (so PyTorch, JAX, ...) finds
//    every driver function. The same name yields different functions with
//    different ABIs depending on cudaVersion and flags (cuMemAdvise vs
//    cuMemAdvise_v2, cuCtxCreate v1..v4, _ptsz variants). We never guess a
//    variant from the name: we let the real driver choose and translate only
//    the address it chose, so the caller gets exactly the ABI it asked for.
// Everything we do not hook passes through untouched (cuGetExportTable too).
// 4. NVML (nvml_hooks.def) is reached the same way, minus cuGetProcAddress:
//    exports for linked calls, and the dlsym mapping for the usual
//    dlopen("libnvidia-ml.so.1") + dlsym. Both libraries go through one
//    loader (RealTable), each loaded on first use.
#include <dlfcn.h>
#include <link.h>
#include <sched.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "hook_table.h"
#include "log.h"

namespace fracgpu::interpose {

void* g_real[kHookCount] = {};
std::atomic<bool> g_real_ready{false};
DriverCalls g_driver = {};

const char* const kHookNames[kHookCount] = {
#define FRACGPU_HOOK(name, impl, params, args) #name,
#include "hooks.def"
};

namespace {

std::atomic<DlsymFn> g_real_dlsym{nullptr};

// Bits of the tables (RealTable::loading_bit) this thread is loading.
thread_local unsigned t_loading = 0;

bool is_inside_this_library(void* address) {
  Dl_info mine{}, theirs{};
  if (dladdr(reinterpret_cast<void*>(&is_inside_this_library), &mine) == 0) return false;
  if (dladdr(address, &theirs) == 0) return false;
  return mine.dli_fbase == theirs.dli_fbase;
}

}  // namespace

DlsymFn real_dlsym() {
  DlsymFn fn = g_real_dlsym.load(std::memory_order_acquire);
  if (fn != nullptr) [[likely]]
    return fn;
  // dlsym moved into libc.so.6 in glibc 2.34; older glibc has only 2.2.5.
  void* found = dlvsym(RTLD_NEXT, "dlsym", "GLIBC_2.34");
  if (found == nullptr) found = dlvsym(RTLD_NEXT, "dlsym", "GLIBC_2.2.5");
  fn = reinterpret_cast<DlsymFn>(found);
  g_real_dlsym.store(fn, std::memory_order_release);
  return fn;
}

// No thread waits for another's load. A library constructor that calls the
// driver runs with glibc's loader lock held, and a load on another thread
// (dlopen, dlsym) waits for that lock: had the constructor waited for that
// load, neither would go on. So every thread that finds the table unloaded
// loads it into its own copy (dlopen only counts a second reference), and the
// first to finish publishes its copy; a later one waits only for that copy,
// which holds no lock.
bool load_real_table_slow(RealTable& table, bool optional) {
  int state = table.state.load(std::memory_order_acquire);
  if (state == RealTable::kLoaded) return true;
  if (state == RealTable::kFailed) return false;
  // The library's own initialisation can call back into us (its dlsym calls,
  // for one); on this thread, while loading, behave as not loaded yet.
  if (t_loading & table.loading_bit) return false;
  void** found = static_cast<void**>(calloc(table.count, sizeof(void*)));
  void* extra = table.extra_size != 0 ? calloc(1, table.extra_size) : nullptr;
  if (found == nullptr || (table.extra_size != 0 && extra == nullptr)) {
    free(found);
    free(extra);
    return false;  // out of memory: this call fails, a later one tries again
  }
  t_loading |= table.loading_bit;
  DlsymFn sym = real_dlsym();
  void* handle = dlopen(table.soname, RTLD_NOW | RTLD_GLOBAL);
  const bool ok = sym != nullptr && handle != nullptr;
  char why[256] = "";
  if (!ok) {
    const char* error = dlerror();
    snprintf(why, sizeof why, "%s", error != nullptr ? error : "dlsym not found");
  } else {
    for (size_t i = 0; i < table.count; ++i) {
      void* address = sym(handle, table.names[i]);
      // A "real" function inside ourselves would make every call recurse.
      if (address != nullptr && is_inside_this_library(address)) {
        log_line(LogLevel::kError, "real %s resolves into libfracgpu itself; treating it as absent", table.names[i]);
        address = nullptr;
      }
      found[i] = address;
    }
    if (table.resolve_extra != nullptr) table.resolve_extra(sym, handle, extra);
  }
  t_loading &= ~table.loading_bit;
  if (table.publishing.exchange(true, std::memory_order_acq_rel)) {
    free(found);
    free(extra);
    while ((state = table.state.load(std::memory_order_acquire)) == RealTable::kNotLoaded) sched_yield();
    return state == RealTable::kLoaded;
  }
  if (ok) {
    memcpy(table.real, found, table.count * sizeof(void*));
    if (extra != nullptr) memcpy(table.extra, extra, table.extra_size);
    table.ready->store(true, std::memory_order_release);
  } else {
    log_line(optional ? LogLevel::kInfo : LogLevel::kError, "cannot load %s (%s): %s", table.what, table.soname, why);
  }
  free(found);
  free(extra);
  table.state.store(ok ? RealTable::kLoaded : RealTable::kFailed, std::memory_order_release);
  return ok;
}

namespace {

void resolve_driver_calls(DlsymFn sym, void* handle, void* into) {
  auto& calls = *static_cast<DriverCalls*>(into);
#define FRACGPU_CALL(name, params) calls.name = reinterpret_cast<decltype(calls.name)>(sym(handle, #name));
#include "driver_calls.def"
}

}  // namespace

RealTable g_driver_table = {"libcuda.so.1",     "libcuda.so",   "the CUDA driver", kHookNames,
                            kHookAddresses,     g_real,         kHookCount,        1u << 0,
                            &g_real_ready,      &g_driver,      sizeof g_driver,   resolve_driver_calls};

bool load_real_driver_slow() { return load_real_table_slow(g_driver_table); }

bool is_hooked_name(const char* symbol) {
  const size_t length = strlen(symbol);
  for (const char* name : kHookNames) {
    if (strncmp(name, symbol, length) != 0) continue;
    // The same function, or one of its versioned or per-thread variants.
    const char* rest = name + length;
    if (*rest == '\0' || strncmp(rest, "_v", 2) == 0 || strncmp(rest, "_pt", 3) == 0) return true;
  }
  return false;
}

void* hook_for_real_address(const RealTable& table, void* address) {
  if (address == nullptr || !table.ready->load(std::memory_order_acquire)) return address;
  for (size_t i = 0; i < table.count; ++i)
    if (table.real[i] == address) return table.hooks[i];
  return address;
}

void* hook_for_real_address(void* address) { return hook_for_real_address(g_driver_table, address); }

// dlsym's answer for a name that landed in `table`'s library: our hook if we
// hook that function. Loads the table only for a lookup that landed in its
// library, so a process that never touches the driver or NVML loads neither.
void* hook_for_lookup(RealTable& table, void* address) {
  if (!table.ready->load(std::memory_order_acquire)) {
    Dl_info info{};
    if (dladdr(address, &info) == 0 || info.dli_fname == nullptr || strstr(info.dli_fname, table.file_stem) == nullptr)
      return address;
    if (!load_real_table(table)) return address;
  }
  return hook_for_real_address(table, address);
}

}  // namespace fracgpu::interpose

using fracgpu::interpose::hook_for_lookup;
using fracgpu::interpose::real_dlsym;

// glibc resolves RTLD_NEXT and RTLD_DEFAULT relative to the object that
// called dlsym, which it finds from the return address: RTLD_NEXT searches
// after it, RTLD_DEFAULT in its scope (which, for a library loaded with
// RTLD_LOCAL, holds that library's own dependencies). So such a lookup must
// reach glibc as a tail call from here, leaving the application's return
// address in place: otherwise the search would be libfracgpu.so's, a library
// loaded after us that wraps a function could be handed itself, and a
// library loaded with RTLD_LOCAL would not find its own dependency's
// functions. Every name that cannot be ours goes the same way. Forced even
// in unoptimized builds; tests/interpose_test checks the results.
extern "C" __attribute__((visibility("default"), optimize("O2", "optimize-sibling-calls"))) void* dlsym(
    void* handle, const char* symbol) {
  auto sym = real_dlsym();
  if (sym == nullptr) return nullptr;
  if (handle == RTLD_NEXT) return sym(RTLD_NEXT, symbol);  // a sibling call: see above
  // Only driver and NVML names can be ours. nvidia-smi and most NVML users
  // dlopen libnvidia-ml.so.1 and reach every function this way, so NVML's
  // hooks depend on this path as much as on their exports.
  const bool driver = symbol[0] == 'c' && symbol[1] == 'u';
  const bool nvml = strncmp(symbol, "nvml", 4) == 0;
  if (!driver && !nvml) return sym(handle, symbol);  // a sibling call: see above
  void* address = sym(handle, symbol);
  if (address == nullptr) return address;
  return hook_for_lookup(driver ? fracgpu::interpose::g_driver_table : fracgpu::interpose::g_nvml_table, address);
}
