// cuInit and cuGetProcAddress: where a process meets the driver first, and
// how the CUDA runtime finds every other entry point (see resolve.cpp).
#pragma once

#include "hook_table.h"
#include "memory_hooks.h"

namespace fracgpu::interpose {

template <HookId id>
CUresult init(unsigned int flags) {
  if (!load_real_driver()) return kNoDriver;
  CUresult result = FRACGPU_PASS(id, flags);
  if (result != CUDA_SUCCESS) return result;
  // Attach now, so a refused ledger is reported where the process starts
  // using the GPU rather than at some later allocation.
  return tenant_mode() == TenantMode::kDenied ? kDenied : CUDA_SUCCESS;
}

// Both versions: let the real driver pick the variant for (symbol,
// cudaVersion, flags), then hand out our hook for exactly that variant.
template <HookId id, class... Status>
CUresult get_proc_address(const char* symbol, void** pfn, int cuda_version, cuuint64_t flags, Status... status) {
  if (!load_real_driver()) return kNoDriver;
  CUresult result = FRACGPU_PASS(id, symbol, pfn, cuda_version, flags, status...);
  if (result == CUDA_SUCCESS && pfn != nullptr) *pfn = hook_for_real_address(*pfn);
  return result;
}

}  // namespace fracgpu::interpose
