// Types and tables generated from nvml_hooks.def: what nvidia-smi and
// frameworks read through NVML inside a tenant (see nvml_hooks.cpp).
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>

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
// The first versions of the count and index lookup, and the lookups by PCI
// bus ID and by board serial number.
nvmlReturn_t nvmlDeviceGetCount(unsigned int* deviceCount);
nvmlReturn_t nvmlDeviceGetHandleByIndex(unsigned int index, nvmlDevice_t* device);
nvmlReturn_t nvmlDeviceGetHandleByPciBusId(const char* pciBusId, nvmlDevice_t* device);
nvmlReturn_t nvmlDeviceGetHandleBySerial(const char* serial, nvmlDevice_t* device);
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

// NVML's GPUs in its index order (PCI bus order, as nvidia-smi numbers
// them), read with NVML's own functions (this process's tenants play no part):
// their UUIDs in out[0, n), at most `capacity`; returns n, or -1 when NVML
// cannot be loaded or initialized. Slow: initializes NVML and shuts it down.
int nvml_gpu_order(uint8_t (*out)[16], int capacity);

// The real function for an NVML hook, typed; loads NVML on first use. Null
// if NVML cannot be loaded or lacks the function.
template <NvmlHookId id>
inline typename NvmlHookTraits<id>::Fn nvml_real() {
  if (!load_real_table(g_nvml_table)) return nullptr;
  return reinterpret_cast<typename NvmlHookTraits<id>::Fn>(g_nvml_real[static_cast<size_t>(id)]);
}

}  // namespace fracgpu::interpose
