// Types and tables generated from hooks.def. See resolve.cpp for how the
// hooks are reached.
#pragma once

#include <cuda.h>

#include <atomic>
#include <cstddef>

namespace fracgpu::interpose {

enum class HookId : unsigned {
#define FRACGPU_HOOK(name, impl, params, args) name,
#include "hooks.def"
  kCount
};
inline constexpr size_t kHookCount = static_cast<size_t>(HookId::kCount);

template <HookId id>
struct HookTraits;
#define FRACGPU_HOOK(name, impl, params, args)  \
  template <>                                   \
  struct HookTraits<HookId::name> {             \
    using Fn = CUresult(*) params;              \
    static constexpr const char* kName = #name; \
  };
#include "hooks.def"

// Exported symbol names and our wrappers' addresses, indexed by HookId.
extern const char* const kHookNames[kHookCount];
extern void* const kHookAddresses[kHookCount];

// Real driver entry points, indexed by HookId; null where the driver lacks
// the symbol. Written once by load_real_driver() before g_real_ready.
extern void* g_real[kHookCount];
extern std::atomic<bool> g_real_ready;

// The glibc dlsym, found without going through our own export.
using DlsymFn = void* (*)(void*, const char*);
DlsymFn real_dlsym();

// A library whose functions we hook: the CUDA driver (hooks.def) and NVML
// (nvml_hooks.def, nvml_hooks.h). One loader serves both: the library is
// dlopen()ed on first use (never linked), and real[i] = dlsym(its handle,
// names[i]), null where it lacks the symbol or the address is our own.
struct RealTable {
  const char* soname;              // what to dlopen
  const char* file_stem;           // how a loaded copy's path reads (dladdr), for dlsym
  const char* what;                // for the one log line if it cannot be loaded
  const char* const* names;        // exported names, in hook-id order
  void* const* hooks;              // our wrappers' addresses, same order
  void** real;                     // filled by load_real_table_slow
  size_t count;
  unsigned loading_bit;            // this table's bit in the loading thread's mask
  std::atomic<bool>* ready;        // set (release) once real[] is filled
  // Functions we call without hooking them: a struct of pointers, filled
  // through resolve_extra (given a copy of that size to fill); may be null.
  void* extra;
  size_t extra_size;
  void (*resolve_extra)(DlsymFn sym, void* handle, void* into);
  enum : int { kNotLoaded = 0, kLoaded = 2, kFailed = 3 };
  std::atomic<int> state{kNotLoaded};
  std::atomic<bool> publishing{false};  // taken by the one thread that publishes its load
};
extern RealTable g_driver_table;
extern RealTable g_nvml_table;  // nvml_hooks.cpp

// Loads the table's library (once, thread-safe, re-entrancy safe: a call
// from the thread that is loading it returns false; never waits for another
// thread's dlopen, see resolve.cpp). False if it cannot;
// that is an error line, or an info line when `optional` (a caller that has
// a way to do without it).
bool load_real_table_slow(RealTable& table, bool optional = false);
inline bool load_real_table(RealTable& table, bool optional = false) {
  if (table.ready->load(std::memory_order_acquire)) [[likely]]
    return true;
  return load_real_table_slow(table, optional);
}

// Our hook for a real address of the table's library, or `address` itself
// if we do not hook it (or the library is not loaded yet).
void* hook_for_real_address(const RealTable& table, void* address);

// Loads libcuda.so.1 (once, thread-safe, re-entrancy safe) and fills g_real.
// Returns false if the driver cannot be loaded.
bool load_real_driver_slow();
inline bool load_real_driver() {
  if (g_real_ready.load(std::memory_order_acquire)) [[likely]]
    return true;
  return load_real_driver_slow();
}

// The real function for a hook, typed. Null if the driver lacks it.
template <HookId id>
inline typename HookTraits<id>::Fn real() {
  return reinterpret_cast<typename HookTraits<id>::Fn>(g_real[static_cast<size_t>(id)]);
}

// Our hook for a real driver address, or `address` itself if we do not hook it.
void* hook_for_real_address(void* address);

// Driver functions we call without hooking them (driver_calls.def).
struct DriverCalls {
#define FRACGPU_CALL(name, params) CUresult (*name) params;
#include "driver_calls.def"
};
extern DriverCalls g_driver;

// True if `symbol` (as passed to cuGetProcAddress) names a function we hook
// in some variant.
bool is_hooked_name(const char* symbol);

}  // namespace fracgpu::interpose
