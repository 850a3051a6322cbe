// Types and tables generated from nvml_hooks.def: what nvidia-smi and
// frameworks read through NVML inside a tenant (see nvml_hooks.cpp).
#pragma once

#include <atomic>
#include <cstddef>

#include "fracgpu/nvml_abi.h"
#include "hook_table.h"

// NVML's graphics and MPS process lists: same records as the compute lists.
// Not in nvml_abi.h (fracgpu's daemon does not call them); declared here from
// NVML's public API reference so their hooks' signatures are checked too.
extern "C" {
nvmlReturn_t nvmlDeviceGetGraphicsRunningProcesses(nvmlDevice_t device, unsigned int* infoCount,
                                                   nvmlProcessInfo_v1_t* infos);
nvmlReturn_t nvmlDeviceGetGraphicsRunningProcesses_v2(nvmlDevice_t device, unsigned int* infoCount,
                                                      nvmlProcessInfo_v2_t* infos);
nvmlReturn_t nvmlDeviceGetGraphicsRunningProcesses_v3(nvmlDevice_t device, unsigned int* infoCount,
                                                      nvmlProcessInfo_t* infos);
nvmlReturn_t nvmlDeviceGetMPSComputeRunningProcesses(nvmlDevice_t device, unsigned int* infoCount,
                                                     nvmlProcessInfo_v1_t* infos);
nvmlReturn_t nvmlDeviceGetMPSComputeRunningProcesses_v2(nvmlDevice_t device, unsigned int* infoCount,
                                                        nvmlProcessInfo_v2_t* infos);
nvmlReturn_t nvmlDeviceGetMPSComputeRunningProcesses_v3(nvmlDevice_t device, unsigned int* infoCount,
                                                        nvmlProcessInfo_t* infos);
}

namespace fracgpu::interpose {

enum class NvmlHookId : unsigned {
#define FRACGPU_NVML_HOOK(name, impl, params, args) name,
#include "nvml_hooks.def"
  kCount
};
inline constexpr size_t kNvmlHookCount = static_cast<size_t>(NvmlHookId::kCount);

template <NvmlHookId id>
struct NvmlHookTraits;
#define FRACGPU_NVML_HOOK(name, impl, params, args) \
  template <>                                       \
  struct NvmlHookTraits<NvmlHookId::name> {         \
    using Fn = nvmlReturn_t(*) params;              \
  };
#include "nvml_hooks.def"

// Real NVML entry points, indexed by NvmlHookId (g_nvml_table loads them).
extern void* g_nvml_real[kNvmlHookCount];

// The real function for an NVML hook, typed; loads NVML on first use. Null
// if NVML cannot be loaded or lacks the function.
template <NvmlHookId id>
inline typename NvmlHookTraits<id>::Fn nvml_real() {
  if (!load_real_table(g_nvml_table)) return nullptr;
  return reinterpret_cast<typename NvmlHookTraits<id>::Fn>(g_nvml_real[static_cast<size_t>(id)]);
}

}  // namespace fracgpu::interpose
