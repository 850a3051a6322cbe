// The exported entry points, generated from hooks.def: each forwards to its
// implementation instantiated for its own HookId. The definitions repeat
// cuda.h's declarations, so a signature that differs from the driver's does
// not compile.
#include "hook_table.h"
#include "launch_hooks.h"
#include "lookup_hooks.h"
#include "memory_hooks.h"

#define FRACGPU_HOOK(name, impl, params, args)                      \
  extern "C" __attribute__((visibility("default"))) CUresult name params { \
    return ::fracgpu::interpose::impl<::fracgpu::interpose::HookId::name> args; \
  }
#include "hooks.def"

namespace fracgpu::interpose {

void* const kHookAddresses[kHookCount] = {
#define FRACGPU_HOOK(name, impl, params, args) reinterpret_cast<void*>(&::name),
#include "hooks.def"
};

}  // namespace fracgpu::interpose
