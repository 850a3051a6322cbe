// cuInit and cuGetProcAddress: where a process meets the driver first (and
// where a tenant's process is given only its GPUs), and how the CUDA runtime
// finds every other entry point (see resolve.cpp).
#pragma once

#include "hook_table.h"
#include "log.h"
#include "memory_hooks.h"
#include "visible_devices.h"

namespace fracgpu::interpose {

template <HookId id>
CUresult init(unsigned int flags) {
  if (!load_real_driver()) return kNoDriver;
  // Attach now, so a refused ledger is reported where the process starts
  // using the GPU rather than at some later allocation, and before the
  // driver reads CUDA_VISIBLE_DEVICES: a tenant's process sees only its
  // tenants' GPUs (visible_devices.h).
  const TenantMode mode = tenant_mode();
  if (mode == TenantMode::kManaged)
    if (const CUresult chosen = choose_visible_devices(); chosen != CUDA_SUCCESS) return chosen;
  CUresult result = FRACGPU_PASS(id, flags);
  if (result != CUDA_SUCCESS) return result;
  if (mode == TenantMode::kManaged) note_driver_initialized();
  if (mode == TenantMode::kDenied) return kDenied;
  // A GPU the daemon marked unavailable (unhealthy, or a bypass found) turns
  // new processes away here, where the application expects device errors.
  if (mode == TenantMode::kManaged && visible_gpu_unavailable()) return CUDA_ERROR_DEVICE_UNAVAILABLE;
  return CUDA_SUCCESS;
}

// Both versions: let the real driver pick the variant for (symbol,
// cudaVersion, flags), then hand out our hook for exactly that variant.
template <HookId id, class... Status>
CUresult get_proc_address(const char* symbol, void** pfn, int cuda_version, cuuint64_t flags, Status... status) {
  if (!load_real_driver()) return kNoDriver;
  CUresult result = FRACGPU_PASS(id, symbol, pfn, cuda_version, flags, status...);
  if (result == CUDA_SUCCESS && pfn != nullptr && *pfn != nullptr) {
    void* real_fn = *pfn;
    *pfn = hook_for_real_address(real_fn);
    // The driver handed out an entry point for a function we hook that is
    // none of the exported variants: we cannot know its ABI, so it goes out
    // unhooked. Say so, since limits are not enforced through it.
    if (*pfn == real_fn && symbol != nullptr && is_hooked_name(symbol))
      log_line(LogLevel::kError, "cuGetProcAddress(%s, %d, %llu): the driver returned an entry point fracgpu does not "
               "know; it is passed through unenforced", symbol, cuda_version, static_cast<unsigned long long>(flags));
  }
  return result;
}

}  // namespace fracgpu::interpose
