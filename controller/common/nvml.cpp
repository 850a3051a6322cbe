#include "common/nvml.h"

#include <fmt/format.h>

namespace fracgpu::controller {

const char* nvml_return_name(nvmlReturn_t rc) {
  switch (rc) {
    case NVML_SUCCESS: return "NVML_SUCCESS";
    case NVML_ERROR_UNINITIALIZED: return "NVML_ERROR_UNINITIALIZED";
    case NVML_ERROR_INVALID_ARGUMENT: return "NVML_ERROR_INVALID_ARGUMENT";
    case NVML_ERROR_NOT_SUPPORTED: return "NVML_ERROR_NOT_SUPPORTED";
    case NVML_ERROR_NO_PERMISSION: return "NVML_ERROR_NO_PERMISSION";
    case NVML_ERROR_ALREADY_INITIALIZED: return "NVML_ERROR_ALREADY_INITIALIZED";
    case NVML_ERROR_NOT_FOUND: return "NVML_ERROR_NOT_FOUND";
    case NVML_ERROR_INSUFFICIENT_SIZE: return "NVML_ERROR_INSUFFICIENT_SIZE";
    case NVML_ERROR_INSUFFICIENT_POWER: return "NVML_ERROR_INSUFFICIENT_POWER";
    case NVML_ERROR_DRIVER_NOT_LOADED: return "NVML_ERROR_DRIVER_NOT_LOADED";
    case NVML_ERROR_TIMEOUT: return "NVML_ERROR_TIMEOUT";
    case NVML_ERROR_IRQ_ISSUE: return "NVML_ERROR_IRQ_ISSUE";
    case NVML_ERROR_LIBRARY_NOT_FOUND: return "NVML_ERROR_LIBRARY_NOT_FOUND";
    case NVML_ERROR_FUNCTION_NOT_FOUND: return "NVML_ERROR_FUNCTION_NOT_FOUND";
    case NVML_ERROR_CORRUPTED_INFOROM: return "NVML_ERROR_CORRUPTED_INFOROM";
    case NVML_ERROR_GPU_IS_LOST: return "NVML_ERROR_GPU_IS_LOST";
    case NVML_ERROR_RESET_REQUIRED: return "NVML_ERROR_RESET_REQUIRED";
    case NVML_ERROR_OPERATING_SYSTEM: return "NVML_ERROR_OPERATING_SYSTEM";
    case NVML_ERROR_LIB_RM_VERSION_MISMATCH: return "NVML_ERROR_LIB_RM_VERSION_MISMATCH";
    case NVML_ERROR_IN_USE: return "NVML_ERROR_IN_USE";
    case NVML_ERROR_MEMORY: return "NVML_ERROR_MEMORY";
    case NVML_ERROR_NO_DATA: return "NVML_ERROR_NO_DATA";
    case NVML_ERROR_ARGUMENT_VERSION_MISMATCH: return "NVML_ERROR_ARGUMENT_VERSION_MISMATCH";
    case NVML_ERROR_UNKNOWN: return "NVML_ERROR_UNKNOWN";
  }
  return "NVML_ERROR_?";
}

std::unique_ptr<Nvml> Nvml::open(const char* library, std::string* problem) {
  // Kept loaded for the life of the process on purpose (see ~Nvml).
  void* handle = dlopen(library, RTLD_NOW | RTLD_LOCAL);
  if (handle == nullptr) {
    const char* why = dlerror();
    *problem = fmt::format("NVML is not available ({}): {}", library, why != nullptr ? why : "unknown error");
    return nullptr;
  }
  std::unique_ptr<Nvml> nvml(new Nvml());
  Api& a = nvml->api_;
  std::string missing;
  load_symbol(handle, "nvmlInit_v2", &a.init, &missing);
  load_symbol(handle, "nvmlShutdown", &a.shutdown, &missing);
  load_symbol(handle, "nvmlErrorString", &a.error_string, &missing);
  load_symbol(handle, "nvmlDeviceGetCount_v2", &a.get_count, &missing);
  load_symbol(handle, "nvmlDeviceGetHandleByIndex_v2", &a.get_handle, &missing);
  load_symbol(handle, "nvmlDeviceGetHandleByUUID", &a.get_handle_by_uuid, &missing);
  load_symbol(handle, "nvmlDeviceGetUUID", &a.get_uuid, &missing);
  load_symbol(handle, "nvmlDeviceGetName", &a.get_name, &missing);
  load_symbol(handle, "nvmlDeviceGetMemoryInfo", &a.get_memory, &missing);
  if (!missing.empty()) {
    *problem = fmt::format("NVML ({}) lacks {}: driver too old? Not using it", library, missing);
    return nullptr;
  }
  std::string optional;  // the health probe and the audit say what they skip
  load_symbol(handle, "nvmlDeviceGetComputeRunningProcesses_v3", &a.get_processes, &optional);
  load_symbol(handle, "nvmlDeviceGetTemperature", &a.get_temperature, &optional);
  load_symbol(handle, "nvmlDeviceGetPowerUsage", &a.get_power, &optional);
  load_symbol(handle, "nvmlDeviceGetTotalEccErrors", &a.get_ecc, &optional);
  load_symbol(handle, "nvmlEventSetCreate", &a.event_set_create, &optional);
  load_symbol(handle, "nvmlDeviceRegisterEvents", &a.register_events, &optional);
  load_symbol(handle, "nvmlEventSetWait_v2", &a.event_wait, &optional);
  load_symbol(handle, "nvmlEventSetFree", &a.event_set_free, &optional);
  load_symbol(handle, "nvmlSystemGetDriverVersion", &a.driver_version, &optional);
  load_symbol(handle, "nvmlDeviceGetProcessUtilization", &a.get_process_utilization, &optional);
  load_symbol(handle, "nvmlDeviceGetSamples", &a.get_samples, &optional);
  load_symbol(handle, "nvmlDeviceGetCudaComputeCapability", &a.get_compute_capability, &optional);
  const nvmlReturn_t rc = a.init();
  if (rc != NVML_SUCCESS) {
    *problem = fmt::format("NVML ({}) did not initialize: {}", library, nvml->describe(rc));
    a.shutdown = nullptr;  // not initialized: nothing to shut down
    return nullptr;
  }
  return nvml;
}

Nvml::~Nvml() {
  // Balanced with nvmlInit_v2 (NVML counts them); the library itself stays
  // mapped, as NVIDIA's own tools leave it.
  if (api_.shutdown != nullptr) api_.shutdown();
}

std::string Nvml::describe(nvmlReturn_t rc) const {
  const char* text = api_.error_string != nullptr ? api_.error_string(rc) : nullptr;
  return text != nullptr ? fmt::format("{} ({})", nvml_return_name(rc), text) : nvml_return_name(rc);
}

nvmlReturn_t Nvml::compute_processes(nvmlDevice_t device, std::vector<Process>* out) const {
  if (api_.get_processes == nullptr) return NVML_ERROR_FUNCTION_NOT_FOUND;
  std::vector<nvmlProcessInfo_t> infos(32);
  for (int attempt = 0; attempt < 4; ++attempt) {
    unsigned count = static_cast<unsigned>(infos.size());
    const nvmlReturn_t rc = api_.get_processes(device, &count, infos.data());
    if (rc == NVML_ERROR_INSUFFICIENT_SIZE) {
      // Processes come and go between calls: ask again with room to spare.
      infos.resize(static_cast<size_t>(count) * 2 + 8);
      continue;
    }
    if (rc != NVML_SUCCESS) return rc;
    out->clear();
    for (unsigned i = 0; i < count && i < infos.size(); ++i) {
      const bool known = infos[i].usedGpuMemory != NVML_VALUE_NOT_AVAILABLE;
      out->push_back({infos[i].pid, known ? infos[i].usedGpuMemory : 0, known});
    }
    return NVML_SUCCESS;
  }
  return NVML_ERROR_INSUFFICIENT_SIZE;
}

}  // namespace fracgpu::controller
