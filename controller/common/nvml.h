// NVML (libnvidia-ml.so.1), loaded with dlopen() and called through typed
// pointers, so the same fracgpud binary runs on nodes with and without it.
// Used by discovery (gpu_discovery.cpp), the health probe (health.cpp) and the
// bypass audit (audit.cpp). Daemon-side only: nothing here runs in a tenant
// process, and every call may block on the driver.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <dlfcn.h>

#include "fracgpu/nvml_abi.h"

namespace fracgpu::controller {

// *out = dlsym(handle, symbol) as the typed pointer; a missing symbol is
// appended to *missing (", "-separated) and leaves *out null.
template <typename Fn>
bool load_symbol(void* handle, const char* symbol, Fn* out, std::string* missing) {
  *out = reinterpret_cast<Fn>(dlsym(handle, symbol));
  if (*out == nullptr) {
    if (!missing->empty()) *missing += ", ";
    *missing += symbol;
  }
  return *out != nullptr;
}

class Nvml {
 public:
  // The entry points, typed from nvml_abi.h: a signature mismatch is a compile
  // error, not a corrupted stack. Required ones are never null once loaded.
  struct Api {
    decltype(&nvmlInit_v2) init = nullptr;
    decltype(&nvmlShutdown) shutdown = nullptr;
    decltype(&nvmlErrorString) error_string = nullptr;
    decltype(&nvmlDeviceGetCount_v2) get_count = nullptr;
    decltype(&nvmlDeviceGetHandleByIndex_v2) get_handle = nullptr;
    decltype(&nvmlDeviceGetHandleByUUID) get_handle_by_uuid = nullptr;
    decltype(&nvmlDeviceGetUUID) get_uuid = nullptr;
    decltype(&nvmlDeviceGetName) get_name = nullptr;
    decltype(&nvmlDeviceGetMemoryInfo) get_memory = nullptr;
    // Optional: a probe or audit that lacks one says so and skips that check.
    decltype(&nvmlDeviceGetComputeRunningProcesses_v3) get_processes = nullptr;
    decltype(&nvmlDeviceGetTemperature) get_temperature = nullptr;
    decltype(&nvmlDeviceGetPowerUsage) get_power = nullptr;
    decltype(&nvmlDeviceGetTotalEccErrors) get_ecc = nullptr;
    decltype(&nvmlEventSetCreate) event_set_create = nullptr;
    decltype(&nvmlDeviceRegisterEvents) register_events = nullptr;
    decltype(&nvmlEventSetWait_v2) event_wait = nullptr;
    decltype(&nvmlEventSetFree) event_set_free = nullptr;
    decltype(&nvmlSystemGetDriverVersion) driver_version = nullptr;  // for the control API's node view
    // The GPU-time meter (daemon/gpu_meter.h): per-process SM utilization.
    decltype(&nvmlDeviceGetProcessUtilization) get_process_utilization = nullptr;
    // ... and the device's own busy share per sample, naming nobody.
    decltype(&nvmlDeviceGetSamples) get_samples = nullptr;
    // Whether the driver time-slices contexts (compute preemption, 6.0 and later).
    decltype(&nvmlDeviceGetCudaComputeCapability) get_compute_capability = nullptr;
  };

  // dlopen()s `library` and calls nvmlInit_v2. nullptr (with *problem set to
  // one line saying why) when the library is absent, lacks a required entry
  // point, or does not initialize. Never throws.
  static std::unique_ptr<Nvml> open(const char* library, std::string* problem);
  ~Nvml();  // nvmlShutdown; the library stays loaded (unloading a driver library is unsafe)
  Nvml(const Nvml&) = delete;
  Nvml& operator=(const Nvml&) = delete;

  const Api& api() const { return api_; }
  // "NVML_ERROR_GPU_IS_LOST (GPU is lost)"-style text for messages.
  std::string describe(nvmlReturn_t rc) const;

  struct Process {
    uint32_t pid = 0;      // host PID (NVML reports the daemon's PID namespace view)
    uint64_t used_bytes = 0;  // 0 where NVML cannot tell (used_known false)
    bool used_known = true;   // false: NVML said NVML_VALUE_NOT_AVAILABLE
  };
  // The compute processes on a device (nvmlDeviceGetComputeRunningProcesses_v3,
  // growing the buffer as NVML asks). Returns NVML's code; *out only on success.
  nvmlReturn_t compute_processes(nvmlDevice_t device, std::vector<Process>* out) const;

 private:
  Nvml() = default;
  Api api_;
};

// The NVML code's symbolic name ("NVML_ERROR_GPU_IS_LOST"), for logs.
const char* nvml_return_name(nvmlReturn_t rc);

}  // namespace fracgpu::controller
